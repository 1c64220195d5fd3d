//! `PluginReleaseQueue`: deferred release through a plugin ([`MP_CAP_DEFERRED_RELEASE`]).
//!
//! The host keeps every queued [`PreparedRelease`] under a ticket it minted and tells
//! the plugin only the ticket and size (`defer_release`). [`PluginReleaseQueue::poll`]
//! asks the plugin which tickets are ready (`poll_deferred`) and runs those releases
//! through the original allocator, on the polling thread, with no lock held. A ticket
//! the plugin reports that the host never issued (or reports twice) is ignored and
//! counted as a dishonest answer; it can never release anything.
//!
//! [`MP_CAP_DEFERRED_RELEASE`]: memory_plugin_abi::MP_CAP_DEFERRED_RELEASE

#![allow(
    clippy::disallowed_types,
    reason = "loom models only the block records (src/records.rs, all from memory-sync); the locks and counters here keep the loader's own bookkeeping outside every model"
)]

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use memory_api::{BackendError, DeferredReleaseQueue, DeviceKey, PreparedRelease, QueueRefusal, QueueRefusalReason};
use memory_plugin_abi::{MP_ERR_REFUSED, MP_OK};

use crate::allocator::{BACKEND, Instance};
use crate::error::StatusCode;

/// Tickets asked for per `poll_deferred` call.
const POLL_BATCH: usize = 64;

/// A bounded deferred-release queue run by a plugin's readiness reports. Made by
/// [`PluginAllocator::release_queue`](crate::PluginAllocator::release_queue); it pins
/// the plugin instance (and its library), and so does every release waiting in it.
///
/// Dropping the queue drops its waiting releases unexecuted, which reports them to
/// their owners as quarantined (`ReleaseError::Abandoned`): nothing is freed that the
/// plugin has not declared ready.
pub struct PluginReleaseQueue {
    instance: Arc<Instance>,
    capacity: usize,
    pending: Mutex<HashMap<u64, PreparedRelease>>,
    next_ticket: AtomicU64,
    dishonest: AtomicU64,
}

impl PluginReleaseQueue {
    pub(crate) fn new(instance: Arc<Instance>, capacity: usize) -> PluginReleaseQueue {
        PluginReleaseQueue {
            instance,
            capacity,
            pending: Mutex::new(HashMap::new()),
            next_ticket: AtomicU64::new(1),
            dishonest: AtomicU64::new(0),
        }
    }

    fn pending(&self) -> MutexGuard<'_, HashMap<u64, PreparedRelease>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Releases waiting for the plugin.
    pub fn len(&self) -> usize {
        self.pending().len()
    }

    /// Whether no release is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tickets the plugin reported that were never issued or already run.
    pub fn dishonest_reports(&self) -> u64 {
        self.dishonest.load(Ordering::Relaxed)
    }

    /// Runs every release the plugin reports ready; returns how many ran.
    ///
    /// Releases run on this thread, in the order the plugin reports them, with no lock
    /// held (a completion may enqueue or poll again).
    pub fn poll(&self) -> usize {
        let instance = &*self.instance;
        let Some(poll) = instance.table.poll_deferred else { return 0 };
        let mut ready = Vec::new();
        loop {
            let mut batch = [0u64; POLL_BATCH];
            let mut count = 0usize;
            let ready_before = ready.len();
            // SAFETY: non-null slot (checked with the capability); `batch` holds
            // POLL_BATCH writable tickets and `count` is a live local.
            let status = unsafe { poll(instance.ptr(), batch.as_mut_ptr(), POLL_BATCH, &mut count) };
            if status != MP_OK {
                tracing::warn!(plugin = %instance.name, status = %StatusCode(status), "poll_deferred failed");
                break;
            }
            if count > POLL_BATCH {
                tracing::error!(plugin = %instance.name, count, "poll_deferred reported more tickets than it was given room for");
                self.dishonest.fetch_add(1, Ordering::Relaxed);
                count = POLL_BATCH;
            }
            let mut pending = self.pending();
            for ticket in &batch[..count] {
                match pending.remove(ticket) {
                    Some(release) => ready.push(release),
                    None => {
                        tracing::error!(plugin = %instance.name, ticket, "plugin reported a ticket the host never issued or already ran");
                        self.dishonest.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            drop(pending);
            // A short batch is the end; so is a full batch that named nothing we
            // issued (a plugin repeating bogus tickets must not keep us here forever).
            if count < POLL_BATCH || ready.len() == ready_before {
                break;
            }
        }
        let ran = ready.len();
        for release in ready {
            instance.queued.fetch_sub(1, Ordering::AcqRel);
            let summary = release.execute();
            tracing::trace!(plugin = %instance.name, %summary, "deferred release ran");
        }
        ran
    }
}

impl DeferredReleaseQueue for PluginReleaseQueue {
    fn device(&self) -> DeviceKey {
        self.instance.device
    }

    fn enqueue(&self, release: PreparedRelease) -> Result<(), QueueRefusal> {
        let instance = &*self.instance;
        if release.device() != instance.device {
            let reason = QueueRefusalReason::WrongDevice { queue: instance.device, release: release.device() };
            return Err(QueueRefusal { release, reason });
        }
        let Some(defer) = instance.table.defer_release else {
            return Err(QueueRefusal { release, reason: QueueRefusalReason::Closed });
        };
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let bytes = release.bytes() as u64;
        {
            let mut pending = self.pending();
            if pending.len() >= self.capacity {
                return Err(QueueRefusal { release, reason: QueueRefusalReason::Full { capacity: self.capacity } });
            }
            // Recorded before the plugin hears of it, so a ready report from another
            // thread's poll always finds it.
            pending.insert(ticket, release);
        }
        instance.queued.fetch_add(1, Ordering::AcqRel);
        // SAFETY: non-null slot (checked with the capability); plain values only.
        let status = unsafe { defer(instance.ptr(), ticket, bytes) };
        if status == MP_OK {
            return Ok(());
        }
        let Some(release) = self.pending().remove(&ticket) else {
            // A dishonest plugin reported the ticket ready before accepting it, and a
            // concurrent poll ran it: the release happened, so there is nothing to hand back.
            tracing::error!(plugin = %instance.name, ticket, "plugin refused a deferral it had already reported ready");
            self.dishonest.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        };
        // Counted out here only: the poll that ran a ticket already counted it out.
        instance.queued.fetch_sub(1, Ordering::AcqRel);
        let reason = if status == MP_ERR_REFUSED {
            QueueRefusalReason::Full { capacity: self.capacity }
        } else {
            QueueRefusalReason::Backend(BackendError {
                backend: BACKEND,
                operation: "defer_release",
                code: i64::from(status),
                detail: format!("{}: {}", instance.name, StatusCode(status)),
            })
        };
        Err(QueueRefusal { release, reason })
    }
}

impl Drop for PluginReleaseQueue {
    fn drop(&mut self) {
        let pending: Vec<PreparedRelease> = self.pending().drain().map(|(_, release)| release).collect();
        if !pending.is_empty() {
            tracing::warn!(plugin = %self.instance.name, count = pending.len(), "release queue dropped with releases waiting; they stay quarantined");
        }
        for release in pending {
            self.instance.queued.fetch_sub(1, Ordering::AcqRel);
            drop(release);
        }
    }
}

impl fmt::Debug for PluginReleaseQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PluginReleaseQueue")
            .field("plugin", &self.instance.name)
            .field("capacity", &self.capacity)
            .field("pending", &self.len())
            .finish()
    }
}
