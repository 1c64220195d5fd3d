//! Per-operation trace events of the hot paths (bind, allocate, release).
//!
//! They are compiled in only with the `hot-path-trace` feature. Even a disabled
//! `tracing` event costs its callsite's level check on every call, and on paths of a
//! few dozen instructions that check measured 1–3 ns (criterion, `bind` 17.2 → 15.4 ns
//! without it). Lifecycle transitions, refusals and faults are always traced; these
//! are the events a runtime enables only to follow individual calls.
//!
//! With the feature, the caller pays one check of the global level filter and the
//! event itself is built in a cold function, so its field set does not crowd the hot
//! path's registers.

use memory_api::MechanismIdentity;

/// Which hot-path step an event reports.
#[derive(Clone, Copy, Debug)]
pub(crate) enum HotEvent {
    Bind,
    Allocate,
    Release,
    ReleaseOnDrop,
}

/// Emits `event` for `mechanism` (and `bytes`, where it has a block) when the
/// `hot-path-trace` feature is on and trace-level events are enabled at all.
#[inline(always)]
pub(crate) fn hot_trace(event: HotEvent, mechanism: &MechanismIdentity, bytes: usize) {
    #[cfg(feature = "hot-path-trace")]
    if tracing::level_enabled!(tracing::Level::TRACE) {
        emit(event, mechanism, bytes);
    }
    #[cfg(not(feature = "hot-path-trace"))]
    let _ = (event, mechanism, bytes);
}

#[cfg(feature = "hot-path-trace")]
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
