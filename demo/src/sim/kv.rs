//! The KV cache of finished sequences kept for prefix reuse, and the reclaim holder
//! that evicts them when the governor runs short.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use memory_governor::{AuthorityIdentity, BoundAllocation, DeviceKey, MemoryBinding, ReclaimHolder, ReclaimRequest};

use super::ledger::Ledger;

/// KV pages of one sequence, each with the binding that made it (a sequence that
/// outlived a mechanism switch holds pages of both mechanisms).
pub(crate) struct Sequence {
    pub(crate) authority: AuthorityIdentity,
    pub(crate) pages: Vec<(MemoryBinding, BoundAllocation)>,
}

impl Sequence {
    pub(crate) fn bytes(&self) -> u64 {
        self.pages.iter().map(|(_, page)| page.bytes() as u64).sum()
    }

    /// Releases every page through the binding that made it; returns the bytes freed.
    pub(crate) fn release(self, ledger: &Ledger) -> u64 {
        let mut freed = 0;
        for (binding, page) in self.pages {
            let bytes = page.bytes() as u64;
            if ledger.release(&binding, page) {
                freed += bytes;
            }
        }
        freed
    }
}

/// Idle sequences of one device, oldest first.
pub(crate) struct KvCache {
    device: DeviceKey,
    idle: Mutex<VecDeque<Sequence>>,
    idle_bytes: AtomicU64,
    ledger: Mutex<Option<std::sync::Arc<Ledger>>>,
    pub(crate) evicted_sequences: AtomicU64,
    pub(crate) evicted_bytes: AtomicU64,
}

impl KvCache {
    pub(crate) fn new(device: DeviceKey) -> KvCache {
        KvCache {
            device,
            idle: Mutex::new(VecDeque::new()),
            idle_bytes: AtomicU64::new(0),
            ledger: Mutex::new(None),
            evicted_sequences: AtomicU64::new(0),
            evicted_bytes: AtomicU64::new(0),
        }
    }

    pub(crate) fn attach(&self, ledger: std::sync::Arc<Ledger>) {
        *self.ledger.lock().unwrap_or_else(PoisonError::into_inner) = Some(ledger);
    }

    /// Keeps a finished sequence for reuse.
    pub(crate) fn park(&self, sequence: Sequence) {
        self.idle_bytes.fetch_add(sequence.bytes(), Ordering::Relaxed);
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).push_back(sequence);
    }

    /// Takes every idle sequence out (to release them, or to drop them after loss).
    pub(crate) fn drain(&self) -> Vec<Sequence> {
        let drained: Vec<_> = self.idle.lock().unwrap_or_else(PoisonError::into_inner).drain(..).collect();
        self.idle_bytes.store(0, Ordering::Relaxed);
        drained
    }

    /// Takes the oldest idle sequence, preferring `authority`'s.
    fn evict_one(&self, authority: AuthorityIdentity) -> Option<Sequence> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let index = idle.iter().position(|s| s.authority == authority).unwrap_or(0);
        let sequence = idle.remove(index)?;
        self.idle_bytes.fetch_sub(sequence.bytes(), Ordering::Relaxed);
        Some(sequence)
    }
}

impl ReclaimHolder for KvCache {
    fn name(&self) -> &str {
        "kv-cache (idle sequences)"
    }

    fn reclaimable(&self, device: DeviceKey) -> u64 {
        if device == self.device { self.idle_bytes.load(Ordering::Relaxed) } else { 0 }
    }

    fn reclaim(&self, request: &ReclaimRequest) -> u64 {
        let Some(ledger) = self.ledger.lock().unwrap_or_else(PoisonError::into_inner).clone() else { return 0 };
        let mut freed = 0;
        // Called with no governor or registry lock held, so releasing here is safe.
        while freed < request.bytes {
            let Some(sequence) = self.evict_one(request.authority) else { break };
            let bytes = sequence.release(&ledger);
            freed += bytes;
            self.evicted_sequences.fetch_add(1, Ordering::Relaxed);
            self.evicted_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        freed
    }
}
