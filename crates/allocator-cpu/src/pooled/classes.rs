//! The size classes: requests up to [`PoolConfig::max_class_bytes`](super::PoolConfig)
//! round up to one of four classes per doubling (from 256 bytes) and reuse whole inner
//! blocks of that class.
//!
//! Each thread keeps its own cache ([`ThreadCache`], in a [`PerThread`] by
//! `memory_sync`'s thread index): the inner blocks it allocated, each in a cell of its
//! own (an [`OwnerSlots`] the thread alone claims from), and per class a list of the
//! cached ones. The block handed out is named by its record in the pool's record table
//! (see `records.rs`), which names the cell; so:
//!
//! - **on the owner thread** a warm pair is a pop from and a push onto its own list,
//!   behind an [`OwnerGate`] (two plain stores and a light barrier), with the record
//!   inserted by plain stores and taken by the table's one compare-and-swap: no lock
//!   and no other read-modify-write;
//! - **a block released on another thread** goes back to its home thread's cache
//!   through a per-class remote stack (one compare-and-swap), which the home takes
//!   whole with one swap when its own list of that class is empty;
//! - **a trim** (from any thread) claims each thread's gate (a lock and a heavy
//!   barrier, cold) to empty its lists, and releases the blocks with no gate held.
//!
//! Each thread's cache holds at most one share of the cap
//! ([`PoolConfig::max_cached_bytes`](super::PoolConfig) / shares), and at most
//! `shares` threads hold one at once (the first threads to allocate a class block), so
//! the class caches together never pass the cap (a release racing another thread's
//! may pass a share by one block). A block whose alignment exceeds its class's is kept
//! in a cell the same way, but never cached. (The allocation path itself is written
//! out in `allocate`, in `mod.rs`: see there.)

use memory_api::{AllocationRequest, DeviceAddress, DeviceAllocator, DeviceKey, RawAllocation, ReleaseOutcome};
use memory_sync::owner_gate::OwnerGate;
use memory_sync::owner_slots::{FreeLink, NO_SLOT, OwnerSlots};
use memory_sync::per_thread::is_current;
use memory_sync::primitives::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use memory_sync::records::TakenRecord;

use super::records::LiveCells;
use super::{PoolStats, PooledAllocator, capped};

/// Smallest size class: every block smaller than this uses one of this size.
const MIN_CLASS: usize = 256;
/// Size classes per doubling (sizes step by a quarter of their power of two).
const STEPS: usize = 4;
/// Largest alignment a class block is allocated with; requests asking for more than
/// their class's alignment bypass the cache.
const CLASS_ALIGN_MAX: usize = 4096;
/// A cell's class when its block is never cached (alignment beyond its class's).
pub(super) const NO_CLASS: u32 = u32::MAX;

/// The size class of `bytes` (at least [`MIN_CLASS`]): its index and size.
#[inline(always)]
pub(super) fn class_of(bytes: usize) -> (usize, usize) {
    if bytes <= MIN_CLASS {
        return (0, MIN_CLASS);
    }
    // Sizes from 2^power (exclusive) to 2^(power + 1) step by 2^(power - 2): in steps,
    // `bytes` rounds up to `quarters` (5..=8) of them. Shifts only, no division.
    let power = (usize::BITS - 1 - (bytes - 1).leading_zeros()) as usize; // floor(log2(bytes - 1))
    let shift = power - 2;
    let quarters = ((bytes - 1) >> shift) + 1;
    let min_power = MIN_CLASS.trailing_zeros() as usize;
    ((power - min_power) * STEPS + quarters - STEPS, quarters << shift)
}

/// Alignment class blocks of `size` are allocated with: the largest power of two
/// dividing it, at most [`CLASS_ALIGN_MAX`].
#[inline(always)]
pub(super) fn class_align(size: usize) -> usize {
    (1usize << size.trailing_zeros()).min(CLASS_ALIGN_MAX)
}

/// What a cell holds.
mod state {
    /// Nothing: the slot is free in its [`super::OwnerSlots`].
    pub(super) const FREE: u8 = 0;
    /// Handed out: the block's record names the cell, and whoever takes the record
    /// has the cell.
    pub(super) const LIVE: u8 = 1;
    /// In its class's list or remote stack.
    pub(super) const CACHED: u8 = 2;
    /// Being released to the inner allocator by a trim (taken out of the lists).
    pub(super) const RELEASING: u8 = 3;
    /// The inner allocator quarantined it during a trim; the next trim retries.
    pub(super) const QUARANTINED: u8 = 4;
}

/// One inner block a thread's cache holds, live or cached. Its fields are atomics so
/// that any thread reads them; who writes them is said by its state (see [`state`]).
#[derive(Default)]
pub(super) struct Cell {
    /// The slot table's link while the cell is free.
    free_link: AtomicU32,
    /// The next cell in its class's list or remote stack while cached.
    next: AtomicU32,
    state: AtomicU8,
    /// Its slot number (written when claimed).
    number: AtomicU32,
    /// Its size class, or [`NO_CLASS`].
    class: AtomicU32,
    /// The inner block.
    address: AtomicU64,
    bytes: AtomicU64,
    align: AtomicU64,
    tag: AtomicU64,
}

impl FreeLink for Cell {
    #[inline]
    fn free_link(&self) -> &AtomicU32 {
        &self.free_link
    }
}

impl Cell {
    /// Keeps inner block `block` (the caller has the cell).
    #[inline]
    fn hold(&self, block: &RawAllocation) {
        self.address.store(block.address().get(), Ordering::Relaxed);
        self.bytes.store(block.bytes() as u64, Ordering::Relaxed);
        self.align.store(block.align() as u64, Ordering::Relaxed);
        self.tag.store(block.provider_tag(), Ordering::Relaxed);
    }

    #[inline(always)]
    fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    #[inline(always)]
    pub(super) fn address(&self) -> u64 {
        self.address.load(Ordering::Relaxed)
    }

    /// The inner block, as the inner allocator handed it out.
    fn block(&self, device: DeviceKey) -> Option<RawAllocation> {
        let address = DeviceAddress::new(self.address())?;
        let bytes = self.bytes() as usize;
        let align = self.align.load(Ordering::Relaxed) as usize;
        Some(RawAllocation::new(address, bytes, align, device, self.tag.load(Ordering::Relaxed)))
    }

    #[inline(always)]
    fn state(&self) -> u8 {
        self.state.load(Ordering::Relaxed)
    }

    #[inline(always)]
    fn set_state(&self, state: u8) {
        self.state.store(state, Ordering::Relaxed);
    }
}

/// Adds `n` to a counter only its own thread writes (a plain load and store).
#[inline(always)]
fn add(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// Subtracts `n` from a counter only its own thread writes.
#[inline(always)]
fn sub(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed).wrapping_sub(n), Ordering::Relaxed);
}

/// The counters of [`PoolStats`] a thread keeps for the size classes, written by that
/// thread alone. A block released on another thread is counted there; the live figures
/// are what was served less what was released, summed over threads (wrapping: one
/// thread's part may be "negative").
#[derive(Default)]
pub(super) struct Counters {
    requested_bytes: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    failures: AtomicU64,
    released_bytes: AtomicU64,
    released_blocks: AtomicU64,
    passed_through: AtomicU64,
    trims: AtomicU64,
    trimmed_bytes: AtomicU64,
}

impl Counters {
    #[inline(always)]
    pub(super) fn served(&self, request: &AllocationRequest, hit: bool) {
        add(if hit { &self.hits } else { &self.misses }, 1);
        add(&self.requested_bytes, request.bytes() as u64);
    }

    #[inline(always)]
    fn released(&self, bytes: usize) {
        add(&self.released_bytes, bytes as u64);
        add(&self.released_blocks, 1);
    }

    /// Counts a block live again after its release failed.
    fn undo_release(&self, bytes: usize) {
        sub(&self.released_bytes, bytes as u64);
        sub(&self.released_blocks, 1);
        sub(&self.passed_through, 1);
    }

    pub(super) fn failed(&self) {
        add(&self.failures, 1);
    }

    /// Adds these counters to `total` (wrapping: see [`Counters`]).
    fn sum_into(&self, total: &mut PoolStats) {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let sum = |into: &mut u64, counter: &AtomicU64| *into = into.wrapping_add(load(counter));
        sum(&mut total.requested_bytes, &self.requested_bytes);
        sum(&mut total.hits, &self.hits);
        sum(&mut total.misses, &self.misses);
        sum(&mut total.failures, &self.failures);
        sum(&mut total.passed_through, &self.passed_through);
        sum(&mut total.trims, &self.trims);
        sum(&mut total.trimmed_bytes, &self.trimmed_bytes);
        // Live: served less released.
        sum(&mut total.live_bytes, &self.requested_bytes);
        total.live_bytes = total.live_bytes.wrapping_sub(load(&self.released_bytes));
        sum(&mut total.live_blocks, &self.hits);
        sum(&mut total.live_blocks, &self.misses);
        total.live_blocks = total.live_blocks.wrapping_sub(load(&self.released_blocks));
    }
}

/// One thread's cache of class blocks (see the module docs).
pub(super) struct ThreadCache {
    /// The thread index it belongs to.
    owner: usize,
    /// Guards `heads` and `cached`: the owner passes it, a trim claims it.
    gate: OwnerGate,
    /// Per class, the head of its list of cached cells (behind the gate).
    heads: Box<[AtomicU32]>,
    /// Bytes of the cells in `heads`' lists (behind the gate).
    cached: AtomicU64,
    /// Per class, cells cached by other threads (or put back by a trim): pushed with a
    /// compare-and-swap, taken whole with a swap.
    remote: Box<[AtomicU32]>,
    /// Bytes of the cells on the remote stacks.
    remote_bytes: AtomicU64,
    /// Bytes this cache may hold (none until its thread allocates a class block, when
    /// it is decided, once, by the owner).
    share: AtomicU64,
    share_decided: AtomicBool,
    /// The inner blocks, one per cell; claimed by the owner alone.
    cells: OwnerSlots<Cell>,
    /// This thread's counters.
    pub(super) counters: Counters,
}

impl ThreadCache {
    pub(super) fn new(owner: usize, classes: usize) -> ThreadCache {
        let lists = || (0..classes).map(|_| AtomicU32::new(NO_SLOT)).collect();
        ThreadCache {
            owner,
            gate: OwnerGate::default(),
            heads: lists(),
            cached: AtomicU64::new(0),
            remote: lists(),
            remote_bytes: AtomicU64::new(0),
            share: AtomicU64::new(0),
            share_decided: AtomicBool::new(false),
            cells: OwnerSlots::new(),
            counters: Counters::default(),
        }
    }

    /// A cached cell of `class`, now live (owner only): its own list's head, else the
    /// class's remote stack taken whole.
    #[inline(always)]
    pub(super) fn pop(&self, class: usize) -> Option<(u32, DeviceAddress)> {
        let head = self.heads.get(class)?;
        // Behind the gate (passed, or claimed while a trim holds it) until returning.
        let _inside = self.gate.enter_or_claim();
        let mut number = head.load(Ordering::Relaxed);
        if number == NO_SLOT {
            let remote = self.remote.get(class)?;
            if remote.load(Ordering::Relaxed) == NO_SLOT {
                return None;
            }
            number = self.take_remote(remote);
        }
        let cell = self.cells.get(number)?;
        let address = DeviceAddress::new(cell.address())?;
        head.store(cell.next.load(Ordering::Relaxed), Ordering::Relaxed);
        sub(&self.cached, cell.bytes());
        cell.set_state(state::LIVE);
        Some((number, address))
    }

    /// Takes a remote stack whole onto the cache's own books (behind the gate): its
    /// head, to become the class's list (which is empty).
    #[cold]
    fn take_remote(&self, remote: &AtomicU32) -> u32 {
        // Acquire: the pushers' links and cells happen before the walk below.
        let head = remote.swap(NO_SLOT, Ordering::Acquire);
        let bytes = self.walk(head).map(Cell::bytes).sum::<u64>();
        self.remote_bytes.fetch_sub(bytes, Ordering::Relaxed);
        add(&self.cached, bytes);
        head
    }

    /// The cells of a list from `head` on.
    fn walk(&self, head: u32) -> impl Iterator<Item = &Cell> {
        std::iter::successors(self.cells.get(head), |cell| self.cells.get(cell.next.load(Ordering::Relaxed)))
    }

    /// Whether `bytes` more fit the cache's share.
    #[inline(always)]
    fn fits(&self, bytes: u64, remote: u64) -> bool {
        self.cached.load(Ordering::Relaxed) + remote + bytes <= self.share.load(Ordering::Relaxed)
    }

    /// Caches live cell `number` of `class` released on its owner thread, if it fits
    /// the share.
    #[inline(always)]
    fn push_own(&self, class: usize, number: u32, cell: &Cell) -> bool {
        let Some(head) = self.heads.get(class) else { return false };
        let _inside = self.gate.enter_or_claim();
        let bytes = cell.bytes();
        if !self.fits(bytes, self.remote_bytes.load(Ordering::Relaxed)) {
            return false;
        }
        cell.set_state(state::CACHED);
        cell.next.store(head.load(Ordering::Relaxed), Ordering::Relaxed);
        head.store(number, Ordering::Relaxed);
        add(&self.cached, bytes);
        true
    }

    /// Caches live cell `number` of `class` released on another thread, if it fits the
    /// share (a release racing the owner's may pass it by this block).
    #[cold]
    fn push_remote(&self, class: usize, number: u32, cell: &Cell) -> bool {
        // A class with no remote stack (none the pool keeps) is not cached: the caller
        // passes the block through instead of counting bytes no list holds.
        if class >= self.remote.len() {
            return false;
        }
        let bytes = cell.bytes();
        let before = self.remote_bytes.fetch_add(bytes, Ordering::Relaxed);
        if !self.fits(bytes, before) {
            self.remote_bytes.fetch_sub(bytes, Ordering::Relaxed);
            return false;
        }
        self.push_onto_remote(class, number, cell);
        true
    }

    /// Pushes cell `number` onto its class's remote stack, cached (its bytes already
    /// counted in `remote_bytes`).
    fn push_onto_remote(&self, class: usize, number: u32, cell: &Cell) {
        let Some(remote) = self.remote.get(class) else { return };
        cell.set_state(state::CACHED);
        let mut head = remote.load(Ordering::Relaxed);
        loop {
            cell.next.store(head, Ordering::Relaxed);
            // Release: the cell and its link before the cell is on the stack.
            match remote.compare_exchange_weak(head, number, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return,
                Err(actual) => head = actual,
            }
        }
    }

    /// A cell for inner block `block` of `class` (or [`NO_CLASS`]), live (owner only).
    #[inline]
    pub(super) fn hold(&self, block: &RawAllocation, class: u32) -> Option<u32> {
        let (number, cell) = self.cells.claim()?;
        cell.hold(block);
        cell.number.store(number, Ordering::Relaxed);
        cell.class.store(class, Ordering::Relaxed);
        cell.set_state(state::LIVE);
        Some(number)
    }

    /// Gives cell `number` back (its block is gone).
    #[inline(always)]
    fn free(&self, number: u32, cell: &Cell) {
        cell.set_state(state::FREE);
        self.cells.give_back(number, cell, is_current(self.owner));
    }

    /// Releases the inner block of live cell `number`, which has no record, to `inner`;
    /// whether it is gone (if not, the cell is held as quarantined, for the next trim).
    #[cold]
    pub(super) fn release_unrecorded(&self, inner: &dyn DeviceAllocator, device: DeviceKey, number: u32) -> bool {
        let Some(cell) = self.cells.get(number) else { return false };
        let Some(block) = cell.block(device) else { return false };
        cell.set_state(state::RELEASING);
        match inner.release(block) {
            ReleaseOutcome::Complete(_) => {
                self.free(number, cell);
                true
            }
            ReleaseOutcome::Failed(failed) => {
                cell.hold(&failed.into_parts().0);
                cell.set_state(state::QUARANTINED);
                false
            }
            ReleaseOutcome::Quarantined(quarantine) => {
                cell.hold(&quarantine.into_parts().0);
                cell.set_state(state::QUARANTINED);
                false
            }
        }
    }

    /// Decides this cache's share on its thread's first class block (owner only):
    /// `share` bytes while fewer than the pool's shares are taken, none otherwise.
    #[inline]
    pub(super) fn decide_share(&self, take: impl FnOnce() -> u64) {
        if !self.share_decided.load(Ordering::Relaxed) {
            self.share.store(take(), Ordering::Relaxed);
            self.share_decided.store(true, Ordering::Relaxed);
        }
    }

    /// Takes every cached and quarantined cell out for release (claims the gate):
    /// their numbers and inner blocks.
    fn take_all(&self, device: DeviceKey) -> Vec<(u32, RawAllocation)> {
        // A cache holding nothing for a trim is not claimed (a lock and a heavy barrier
        // each): every cached cell is counted in `cached` or, before it is pushed, in
        // `remote_bytes`. A block cached after this look waits for the next trim, as
        // one cached just after the trim would.
        let idle = self.cached.load(Ordering::Relaxed) == 0
            && self.remote_bytes.load(Ordering::Relaxed) == 0
            && !self.cells.iter().any(|cell| cell.state() == state::QUARANTINED);
        if idle {
            return Vec::new();
        }
        let _claim = self.gate.claim();
        let mut numbers = Vec::new();
        for (head, remote) in self.heads.iter().zip(self.remote.iter()) {
            let local = head.swap(NO_SLOT, Ordering::Relaxed);
            let taken = remote.swap(NO_SLOT, Ordering::Acquire);
            let remote_bytes = self.walk(taken).map(Cell::bytes).sum::<u64>();
            self.remote_bytes.fetch_sub(remote_bytes, Ordering::Relaxed);
            for list in [local, taken] {
                numbers.extend(self.walk(list).map(|cell| cell.number.load(Ordering::Relaxed)));
            }
        }
        self.cached.store(0, Ordering::Relaxed);
        // Quarantined cells are in no list; only trims (one at a time per cache, under
        // the claim) change them.
        let quarantined = self
            .cells
            .iter()
            .filter(|cell| cell.state() == state::QUARANTINED)
            .map(|cell| cell.number.load(Ordering::Relaxed));
        numbers.extend(quarantined.collect::<Vec<_>>());
        numbers
            .into_iter()
            .filter_map(|number| {
                let cell = self.cells.get(number)?;
                cell.set_state(state::RELEASING);
                Some((number, cell.block(device)?))
            })
            .collect()
    }

    /// Adds this cache's counters, cached bytes and cached and quarantined blocks to
    /// `total`.
    pub(super) fn count_into(&self, total: &mut PoolStats) {
        self.counters.sum_into(total);
        total.cached_bytes += self.cached.load(Ordering::Relaxed) + self.remote_bytes.load(Ordering::Relaxed);
        for cell in self.cells.iter() {
            match cell.state() {
                state::CACHED => {
                    total.cached_blocks += 1;
                    total.largest_free_bytes = total.largest_free_bytes.max(cell.bytes());
                }
                state::QUARANTINED => total.quarantined_blocks += 1,
                _ => {}
            }
        }
    }

    /// Panics unless the cache's cached bytes are its cached cells, and its lists hold
    /// exactly them (quiescent caches only).
    #[cfg(test)]
    pub(super) fn assert_consistent(&self) {
        let cached: u64 = self.cells.iter().filter(|cell| cell.state() == state::CACHED).map(Cell::bytes).sum();
        let books = self.cached.load(Ordering::Relaxed) + self.remote_bytes.load(Ordering::Relaxed);
        assert_eq!(cached, books, "cached bytes of thread {}", self.owner);
        let mut listed = 0;
        for (class, (head, remote)) in self.heads.iter().zip(self.remote.iter()).enumerate() {
            for list in [head, remote] {
                for cell in self.walk(list.load(Ordering::Relaxed)) {
                    assert_eq!(cell.state(), state::CACHED, "a listed cell of thread {}", self.owner);
                    assert_eq!(cell.class.load(Ordering::Relaxed) as usize, class, "a cell in another class's list");
                    listed += cell.bytes();
                }
            }
        }
        assert_eq!(listed, cached, "the lists of thread {} hold exactly its cached cells", self.owner);
        assert!(cached <= self.share.load(Ordering::Relaxed), "thread {} caches past its share", self.owner);
    }

    /// Bytes of the inner blocks this cache holds: live, cached or quarantined.
    #[cfg(test)]
    pub(super) fn held_bytes(&self) -> usize {
        self.cells.iter().filter(|cell| cell.state() != state::FREE).map(|cell| cell.bytes() as usize).sum()
    }
}

impl<A: DeviceAllocator> PooledAllocator<A> {
    /// Releases a block held in cell `number` of thread `home`'s cache, its record
    /// `taken`: cached when its class has room, otherwise released to the inner
    /// allocator; on the inner allocator's refusal or quarantine, live again under the
    /// same record so the caller can retry.
    #[inline(always)]
    pub(super) fn release_cell(
        &self,
        taken: TakenRecord<'_, LiveCells>,
        (home, number): (usize, u32),
        allocation: RawAllocation,
    ) -> ReleaseOutcome {
        let Some((cache, cell)) = self.caches.get(home).and_then(|cache| Some((cache, cache.cells.get(number)?)))
        else {
            taken.restore();
            return self.refuse(allocation);
        };
        // The record was made on the home thread, in its part of the table: so the
        // table's answer is whether this is the home thread (a thread past the table's
        // owner indices records in its shared part, and its blocks come back remotely).
        let here = taken.is_owned_here();
        let own = if here { cache } else { self.own_cache() };
        own.counters.released(allocation.bytes());
        let class = cell.class.load(Ordering::Relaxed);
        if class != NO_CLASS {
            let cached = if here {
                cache.push_own(class as usize, number, cell)
            } else {
                cache.push_remote(class as usize, number, cell)
            };
            if cached {
                taken.free();
                return ReleaseOutcome::complete(0);
            }
        }
        self.pass_cell_through(taken, (cache, number, cell), allocation)
    }

    /// Releases the inner block of a live cell for the caller (not cacheable, or its
    /// cache's share is full).
    #[cold]
    fn pass_cell_through(
        &self,
        taken: TakenRecord<'_, LiveCells>,
        (cache, number, cell): (&ThreadCache, u32, &Cell),
        allocation: RawAllocation,
    ) -> ReleaseOutcome {
        let own = self.own_cache();
        add(&own.counters.passed_through, 1);
        let Some(block) = cell.block(self.device()) else { unreachable!("a cell holds a block at a non-null address") };
        match self.inner.release(block) {
            ReleaseOutcome::Complete(done) => {
                cache.free(number, cell);
                taken.free();
                // The inner block is the size class; the caller's block may be smaller.
                ReleaseOutcome::complete(done.unmapped_bytes().min(allocation.bytes()))
            }
            ReleaseOutcome::Failed(failed) => {
                let (block, error) = failed.into_parts();
                cell.hold(&block);
                taken.restore();
                own.counters.undo_release(allocation.bytes());
                ReleaseOutcome::failed(allocation, error)
            }
            ReleaseOutcome::Quarantined(quarantine) => {
                let (block, error, unmapped, residual) = capped(quarantine, &allocation);
                cell.hold(&block);
                // Part of the block may be gone: the caller's retry goes to the inner
                // allocator again, never into a class list (whatever room it has then).
                cell.class.store(NO_CLASS, Ordering::Relaxed);
                taken.restore();
                own.counters.undo_release(allocation.bytes());
                ReleaseOutcome::quarantined(allocation, unmapped, residual, error)
            }
        }
    }

    /// Returns every cached class block of every thread to the inner allocator; one it
    /// refuses stays cached, one it quarantines is held for the next trim.
    pub(super) fn trim_classes(&self) -> usize {
        let own = self.own_cache();
        add(&own.counters.trims, 1);
        let mut returned = 0;
        for cache in self.caches.iter() {
            for (number, block) in cache.take_all(self.device()) {
                let Some(cell) = cache.cells.get(number) else { continue };
                let size = block.bytes();
                match self.inner.release(block) {
                    ReleaseOutcome::Complete(_) => {
                        returned += size;
                        add(&own.counters.trimmed_bytes, size as u64);
                        cache.free(number, cell);
                    }
                    ReleaseOutcome::Failed(failed) => {
                        // Nothing happened: keep it cached.
                        let (block, _) = failed.into_parts();
                        cell.hold(&block);
                        let class = cell.class.load(Ordering::Relaxed) as usize;
                        cache.remote_bytes.fetch_add(cell.bytes(), Ordering::Relaxed);
                        cache.push_onto_remote(class, number, cell);
                    }
                    ReleaseOutcome::Quarantined(quarantine) => {
                        tracing::warn!(error = %quarantine.error(), "trim: inner allocator quarantined a cached block");
                        let (block, _) = quarantine.into_parts();
                        cell.hold(&block);
                        cell.set_state(state::QUARANTINED);
                    }
                }
            }
        }
        returned
    }

    /// Gives up a live block held in cell `number` of thread `home`'s cache with its
    /// device: frees its record and cell and returns its inner block, to be forgotten.
    pub(super) fn forget_cell(
        &self,
        taken: TakenRecord<'_, LiveCells>,
        (home, number): (usize, u32),
        bytes: usize,
    ) -> Option<RawAllocation> {
        let Some((cache, cell)) = self.caches.get(home).and_then(|cache| Some((cache, cache.cells.get(number)?)))
        else {
            taken.restore();
            return None;
        };
        let block = cell.block(self.device());
        cache.free(number, cell);
        taken.free();
        self.own_cache().counters.released(bytes);
        block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_step_by_quarters_and_cover_every_size() {
        assert_eq!(class_of(0), (0, 256));
        assert_eq!(class_of(256), (0, 256));
        assert_eq!(class_of(257), (1, 320));
        assert_eq!(class_of(512), (4, 512));
        assert_eq!(class_of(513), (5, 640));
        assert_eq!(class_of(65536), (class_of(65536).0, 65536));
        let mut last = (0, 256);
        for bytes in 1..=(1 << 16) {
            let (index, size) = class_of(bytes);
            assert!(size >= bytes && (bytes <= MIN_CLASS || size - bytes < size / 4), "{bytes} -> {size}");
            assert!(index == last.0 || index == last.0 + 1, "classes are dense at {bytes}");
            assert!(size == last.1 || index == last.0 + 1);
            last = (index, size);
        }
        assert_eq!(class_align(320), 64);
        assert_eq!(class_align(65536), 4096);
    }
}
