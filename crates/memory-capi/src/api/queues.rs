//! Deferred-release queues: one the caller polls (`mc_queue_create`), or a plugin
//! mechanism's own (`mc_plugin_queue_create`).

use allocator_cpu::HostReleaseQueue;
use memory_governor::DeferredReleaseQueue;
use memory_plugin::PluginReleaseQueue;
use memory_plugin_abi::MpDevice;

use super::mechanisms::MECHANISMS;
use super::{borrow, check_optional_out, check_out, device_key, fill, vacancy, write, write_optional};
use crate::handles::Scheme;
use crate::status::{Failure, MC_ERR_INVALID_ARGUMENT, MC_ERR_UNSUPPORTED, McStatus, guard};
use crate::types::*;

pub(crate) const KIND_QUEUE: u8 = 0xa9;

pub(crate) enum QueueEntry {
    Host(HostReleaseQueue),
    Plugin(PluginReleaseQueue),
}

impl QueueEntry {
    pub(crate) fn queue(&self) -> &dyn DeferredReleaseQueue {
        match self {
            QueueEntry::Host(queue) => queue,
            QueueEntry::Plugin(queue) => queue,
        }
    }
}

tables! {
    QUEUES in QUEUE_CELLS: QueueEntry = (KIND_QUEUE, Scheme::Hazard, "queue", FREE_QUEUES);
}

/// A queue must hold at least one release.
fn check_capacity(capacity: usize) -> Result<(), Failure> {
    if capacity == 0 {
        return Err(Failure::new(
            MC_ERR_INVALID_ARGUMENT,
            "capacity 0 makes a queue that refuses every release; pass the most releases it may hold (1 or more)",
        ));
    }
    Ok(())
}

/// Creates a queue for `device` holding at most `capacity` (1 or more) releases, which
/// run when `mc_queue_poll` is called.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_queue_create(device: MpDevice, capacity: usize, out: *mut *mut McQueue) -> McStatus {
    guard("mc_queue_create", || {
        check_out(out, "out")?;
        let device = device_key(device)?;
        check_capacity(capacity)?;
        let handle = fill(vacancy(&QUEUES)?, QueueEntry::Host(HostReleaseQueue::new(device, capacity)));
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Creates the deferred-release queue of a plugin mechanism (`MP_CAP_DEFERRED_RELEASE`)
/// holding at most `capacity` (1 or more) releases: they run once the plugin reports
/// them ready, when `mc_queue_poll` is called.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_plugin_queue_create(
    mechanism: *mut McMechanism,
    capacity: usize,
    out: *mut *mut McQueue,
) -> McStatus {
    guard("mc_plugin_queue_create", || {
        check_out(out, "out")?;
        let entry = borrow(&MECHANISMS, mechanism)?;
        check_capacity(capacity)?;
        let Some(plugin) = entry.plugin.as_ref() else {
            return Err(Failure::new(
                MC_ERR_UNSUPPORTED,
                "the mechanism is not a plugin or vtable mechanism; use mc_queue_create for a host-run queue",
            ));
        };
        let cell = vacancy(&QUEUES)?;
        let handle = fill(cell, QueueEntry::Plugin(plugin.release_queue(capacity)?));
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Runs every release of `queue` that is ready; writes how many ran (`ran` may be null).
///
/// # Safety
/// `ran` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_queue_poll(queue: *mut McQueue, ran: *mut usize) -> McStatus {
    guard("mc_queue_poll", || {
        check_optional_out(ran, "ran")?;
        let queue = borrow(&QUEUES, queue)?;
        let count = match &*queue {
            QueueEntry::Host(queue) => queue.run_all().len(),
            QueueEntry::Plugin(queue) => queue.poll(),
        };
        // SAFETY: checked above.
        unsafe { write_optional(ran, count) };
        Ok(())
    })
}

/// Destroys a queue; releases still waiting stay quarantined (poll first).
#[unsafe(no_mangle)]
pub extern "C" fn mc_queue_destroy(queue: *mut McQueue) -> McStatus {
    guard("mc_queue_destroy", || super::remove(&QUEUES, queue))
}
