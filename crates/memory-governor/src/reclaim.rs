//! Reclaim holders: memory owners that can give bytes back on request (a KV cache that
//! can evict, a pool that can trim).
//!
//! Holders are registered per device with an order; when a policy decides to reclaim,
//! the governor asks them in ascending order (ties in registration order), outside any
//! lock, each for what is still missing, and stops once enough was freed. A holder that
//! frees less than asked ("stingy") is taken at its word: it is not asked again, and the
//! request retries once and fails cleanly if it still does not fit.
//!
//! A holder may call back into the governor, and may even ask it for memory. But an
//! admission made on a thread that is already inside a holder's `reclaim` never
//! reclaims again (that would ask the same holder, which asks again, until the stack
//! overflows): it is admitted if it fits as things stand, and otherwise refused with
//! [`AdmissionError::ReentrantReclaim`](crate::AdmissionError::ReentrantReclaim)
//! without asking any holder.

use std::fmt;

use memory_api::{AuthorityIdentity, DeviceKey, MemoryRole};

/// A request to free memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReclaimRequest {
    /// The device memory is needed on.
    pub device: DeviceKey,
    /// Bytes still missing.
    pub bytes: u64,
    /// The role of the request that is short.
    pub role: MemoryRole,
    /// The authority of the request that is short.
    pub authority: AuthorityIdentity,
}

/// Something that can free memory when asked.
///
/// Both methods are called with no governor lock held, so they may release leases and
/// allocations (which refund the governor) or call back into the governor.
pub trait ReclaimHolder: Send + Sync {
    /// A short name for messages ("kv-cache", "pool-trim").
    fn name(&self) -> &str;

    /// An estimate of the bytes this holder could free on `device` now (used to name the
    /// largest reclaimable holder in errors and snapshots).
    fn reclaimable(&self, device: DeviceKey) -> u64;

    /// Frees up to `request.bytes` (more is fine) and returns the bytes actually freed.
    fn reclaim(&self, request: &ReclaimRequest) -> u64;
}

impl fmt::Debug for dyn ReclaimHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ReclaimHolder({})", self.name())
    }
}

/// Names one holder registration (to unregister it).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct HolderId {
    pub(crate) device: DeviceKey,
    pub(crate) serial: u64,
}

impl HolderId {
    /// The device the holder was registered on.
    pub fn device(&self) -> DeviceKey {
        self.device
    }
}

/// Marks the calling thread as inside a reclaim until dropped; `None` when it already
/// is (a nested admission must not reclaim again).
///
/// A `const` thread-local of a type without a destructor stays readable during thread
/// teardown, so the mark works everywhere. Not part of any cross-thread protocol.
pub(crate) struct Reclaiming(());

std::thread_local! {
    static RECLAIMING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Reclaiming {
    pub(crate) fn enter() -> Option<Reclaiming> {
        (!RECLAIMING.replace(true)).then_some(Reclaiming(()))
    }
}

impl Drop for Reclaiming {
    fn drop(&mut self) {
        RECLAIMING.set(false);
    }
}
