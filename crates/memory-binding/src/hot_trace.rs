//! Trace events of the hot paths (bind, allocate, release), emitted out of line.
//!
//! A `tracing::trace!` written inline builds its field set in the caller even when
//! no subscriber wants it, and that code crowds the hot path's registers and frame.
//! Here the caller pays one check of the global level filter; the event itself is
//! built in a cold function.

use memory_api::MechanismIdentity;

/// Which hot-path step an event reports.
#[derive(Clone, Copy, Debug)]
pub(crate) enum HotEvent {
    Bind,
    Allocate,
    Release,
    ReleaseOnDrop,
}

/// Emits `event` for `mechanism` (and `bytes`, where it has a block) when trace-level
/// events are enabled at all.
#[inline(always)]
pub(crate) fn hot_trace(event: HotEvent, mechanism: &MechanismIdentity, bytes: usize) {
    if tracing::level_enabled!(tracing::Level::TRACE) {
        emit(event, mechanism, bytes);
    }
}

#[cold]
#[inline(never)]
fn emit(event: HotEvent, mechanism: &MechanismIdentity, bytes: usize) {
    match event {
        HotEvent::Bind => tracing::trace!(mechanism = %mechanism, "bind"),
        HotEvent::Allocate => tracing::trace!(mechanism = %mechanism, bytes, "allocate"),
        HotEvent::Release => tracing::trace!(mechanism = %mechanism, bytes, "release"),
        HotEvent::ReleaseOnDrop => tracing::trace!(mechanism = %mechanism, bytes, "release on drop"),
    }
}
