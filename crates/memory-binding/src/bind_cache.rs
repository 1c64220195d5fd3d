//! Each thread's bind cache: (registry, device) → the selection epoch, the binding
//! generation and this thread's anchor of the selected mechanism.
//!
//! `bind` reads only its own thread's entry and the registry's epoch word: it writes
//! nothing another thread reads, and it costs the same however many devices are
//! registered. Entries are direct-mapped: a colliding device replaces the entry, and a
//! miss costs one read of the selection.
//!
//! The cache is a `const` thread-local of `Cell`s with no destructor, so a hit is a
//! plain read of the thread's block: no lazy-registration check and no borrow flag.
//! Its weak references to anchors are dropped by a separate guard whose destructor
//! runs at thread exit ([`CacheGuard`]); a fill registers that guard first and is
//! skipped once it has run (a bind from a later TLS destructor goes uncached).

use std::cell::Cell;
use std::sync::Weak;

use memory_api::{BindingGeneration, DeviceKey, RegistryId};

use crate::entry::Anchor;
use crate::unit_ref::{CachedWeak, UnitRef};

/// Entries per thread.
const ENTRIES: usize = 64;

std::thread_local! {
    static CACHE: BindCache = const { BindCache::new() };
    static GUARD: CacheGuard = const { CacheGuard };
}

/// What an entry was filled for: a hit needs all of it to match.
#[derive(Copy, Clone, PartialEq, Eq)]
struct Key {
    registry: RegistryId,
    device: DeviceKey,
    epoch: u64,
}

struct Entry {
    key: Cell<Option<Key>>,
    generation: Cell<Option<BindingGeneration>>,
    /// Weak: a cache entry never keeps a retired or removed mechanism alive.
    anchor: CachedWeak<Anchor>,
}

struct BindCache {
    entries: [Entry; ENTRIES],
    /// Cleared by the guard's destructor: no fill after it.
    open: Cell<bool>,
}

impl BindCache {
    const fn new() -> BindCache {
        BindCache {
            entries: [const { Entry { key: Cell::new(None), generation: Cell::new(None), anchor: CachedWeak::empty() } };
                ENTRIES],
            open: Cell::new(true),
        }
    }
}

/// Drops the cache's weak references when its thread exits.
struct CacheGuard;

impl Drop for CacheGuard {
    fn drop(&mut self) {
        let _ = CACHE.try_with(|cache| {
            cache.open.set(false);
            for entry in &cache.entries {
                entry.key.set(None);
                entry.anchor.clear();
            }
        });
    }
}

/// The entry of `device` of the registry whose hash is `salt`: an add and a mask, so
/// consecutive device indices of one tier never collide and the entry's load does not
/// wait on a multiply.
#[inline]
fn slot(salt: u64, device: DeviceKey) -> usize {
    let tier: u64 = match device.tier() {
        memory_api::Tier::Device => 0,
        memory_api::Tier::Host => 21,
        memory_api::Tier::Disk => 42,
        _ => 13,
    };
    (salt.wrapping_add(u64::from(device.index())).wrapping_add(tier) as usize) % ENTRIES
}

/// A unit of the cached anchor and the generation for `device` of `registry` (whose
/// hash is `salt`), if its entry was filled under `epoch`, its anchor is this thread's
/// own (a recycled thread index means a refill), and not orphaned (its mechanism is
/// still registered).
#[inline]
pub(crate) fn hit(
    salt: u64,
    registry: RegistryId,
    device: DeviceKey,
    epoch: u64,
) -> Option<(UnitRef<Anchor>, BindingGeneration)> {
    // `try_with` (inlined) rather than `with` (a call with a panic path); a `const`
    // thread-local with no destructor is always there.
    CACHE
        .try_with(|cache| {
            let entry = &cache.entries[slot(salt, device)];
            if entry.key.get() != Some(Key { registry, device, epoch }) {
                return None;
            }
            let generation = entry.generation.get()?;
            Some((entry.anchor.try_unit()?, generation))
        })
        .ok()
        .flatten()
}

/// Fills the entry for `device` of `registry` (whose hash is `salt`).
pub(crate) fn fill(
    salt: u64,
    registry: RegistryId,
    device: DeviceKey,
    epoch: u64,
    generation: BindingGeneration,
    anchor: Weak<Anchor>,
) {
    // The guard first: without it nothing would drop the weak reference.
    if GUARD.try_with(|_| ()).is_err() {
        return;
    }
    let _ = CACHE.try_with(|cache| {
        if !cache.open.get() {
            return;
        }
        let entry = &cache.entries[slot(salt, device)];
        // Invalidate before the anchor changes, so a half-filled entry never hits.
        entry.key.set(None);
        entry.anchor.set(anchor);
        entry.generation.set(Some(generation));
        entry.key.set(Some(Key { registry, device, epoch }));
    });
}
