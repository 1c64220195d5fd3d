//! [`SystemAllocator`]: host memory from the global allocator (`std::alloc`), and
//! optionally large blocks straight from the OS.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, BackendError, DeviceAddress, DeviceAllocator, DeviceKey,
    LayoutError, MaybeBytes, RawAllocation, ReleaseError, ReleaseOutcome,
};

use memory_sync::per_thread::{PerThread, thread_index};
use memory_sync::primitives::{AtomicU64, Ordering};
use memory_sync::records::{RecordTable, Words};

/// A live block's record: `[address (its provenance exposed at allocation), bytes,
/// align]`.
type Block = Words<3>;

/// One thread's counters, written by that thread alone (plain loads and stores). A
/// block released on another thread is counted off there, so one thread's live figures
/// may be "negative" (they wrap); their sum over threads is right.
#[derive(Default)]
struct Counters {
    live_bytes: AtomicU64,
    live_allocations: AtomicU64,
    allocations_total: AtomicU64,
    failures_total: AtomicU64,
}

/// Adds `n` (wrapping) to a counter only the calling thread writes.
#[inline(always)]
fn add(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// Host memory from the global allocator, for any size and power-of-two alignment.
///
/// - Zero-byte requests get a unique one-byte block, so they are distinct and
///   releasable like any other.
/// - Every power-of-two alignment the global allocator can honour is honoured (2 MiB
///   and beyond); a size the system refuses is [`AllocError::OutOfMemory`], an
///   impossible layout is [`AllocError::Layout`]. Nothing here panics or aborts.
/// - Each live block has a record in `memory_sync`'s record table (inserted by the
///   allocating thread with plain stores), named by the block's provider tag. A release
///   takes the record with one compare-and-swap and frees memory only if it matches the
///   block's address, size and alignment exactly; anything else (another allocator's
///   block, another device's key, a second release) is refused with
///   [`ReleaseOutcome::Failed`] handing the block back.
///
/// [`SystemAllocator::for_device`] labels the memory with another key, so tests can
/// simulate several devices with real, writable memory.
///
/// [`SystemAllocator::with_large_blocks_from_os`] takes large blocks straight from the
/// OS instead (the backing a cache such as [`crate::PooledAllocator`] should have): see
/// there why.
pub struct SystemAllocator {
    device: DeviceKey,
    records: RecordTable<Block>,
    counters: PerThread<Box<Counters>>,
    /// Blocks of at least this many bytes are mapped from the OS (`usize::MAX`: none).
    from_os: usize,
}

impl SystemAllocator {
    /// A system allocator for [`DeviceKey::HOST`].
    pub fn new() -> SystemAllocator {
        SystemAllocator::for_device(DeviceKey::HOST)
    }

    /// A system allocator whose blocks claim to live on `device` (a simulated,
    /// host-backed device; the memory is host memory whatever the key says).
    pub fn for_device(device: DeviceKey) -> SystemAllocator {
        SystemAllocator { device, records: RecordTable::new(), counters: PerThread::new(), from_os: usize::MAX }
    }

    /// The size from which [`SystemAllocator::for_caches`] maps blocks from the OS.
    /// Chosen on ONNX Runtime models (`cargo xtask bench --ort`, peak resident memory
    /// against the runtime's arena): at 128 and 256 KiB a small model's few pool
    /// segments (256 KiB each) took fresh pages while the heap held free memory left from
    /// loading (Silero VAD 1.03x instead of 1.00x); from 1 MiB up the blocks of 0.5-1 MiB
    /// that varying shapes ask for stayed behind on the heap (the direction classifier's
    /// sweep 0.94x instead of 0.93x at 512 KiB, 0.89x at 256 KiB).
    pub const LARGE_BLOCK_BYTES: usize = 512 << 10;

    /// The same allocator, taking every block of `min_bytes` or more straight from the
    /// OS as whole pages (a private anonymous `mmap`, zeroed, backed as it is touched)
    /// and giving it back on release (`munmap`), so a released large block leaves the
    /// process at once. On targets without `mmap` this changes nothing.
    ///
    /// Why: the global allocator keeps freed memory for itself. glibc serves large
    /// blocks by `mmap` only until the first such block is freed, then raises its
    /// threshold to that block's size (up to 32 MiB) and serves later ones from its
    /// heap, where a freed block stays resident and a later, larger one needs fresh
    /// memory beside it. Under a cache that gives idle blocks back (a pool trimming its
    /// segments), the process then holds the cache's blocks *and* the heap's leftovers:
    /// two ONNX Runtime sessions sharing one governed pool, shapes varying, peaked at
    /// 255 MiB resident over the heap and 187 MiB with the blocks from the OS, the
    /// governor's `reserved` peak being 132 MiB both ways (`cargo xtask bench --ort`).
    /// With the blocks from the OS, what the cache holds is what the process holds. The price is a page fault per page of a fresh block,
    /// which a cache pays only when it grows.
    #[must_use]
    pub fn with_large_blocks_from_os(mut self, min_bytes: usize) -> SystemAllocator {
        if cfg!(unix) {
            self.from_os = min_bytes.max(1);
        }
        self
    }

    /// A system allocator for a cache to sit on: blocks of
    /// [`SystemAllocator::LARGE_BLOCK_BYTES`] and more from the OS
    /// ([`SystemAllocator::with_large_blocks_from_os`]).
    pub fn for_caches(device: DeviceKey) -> SystemAllocator {
        SystemAllocator::for_device(device).with_large_blocks_from_os(SystemAllocator::LARGE_BLOCK_BYTES)
    }

    /// Whether a block of `bytes` comes from (and goes back to) the OS.
    #[inline(always)]
    fn is_from_os(&self, bytes: usize) -> bool {
        bytes >= self.from_os
    }

    /// Allocates `bytes` bytes aligned to `align`, validating the layout first.
    ///
    /// # Errors
    /// [`AllocError::Layout`] for an alignment that is not a power of two or a size that
    /// overflows; [`AllocError::OutOfMemory`] when the system refuses the memory.
    pub fn allocate_layout(&self, bytes: usize, align: usize) -> Result<RawAllocation, AllocError> {
        self.allocate(&AllocationRequest::new(bytes, align)?)
    }

    fn refuse(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let error = ReleaseError::NotOwned {
            allocator: self.name().to_owned(),
            device: self.device,
            address: allocation.address().get(),
        };
        ReleaseOutcome::failed(allocation, error)
    }

    /// The calling thread's counters.
    #[inline(always)]
    fn counters(&self) -> &Counters {
        self.counters.get_or(thread_index(), Box::default)
    }

    fn count_failure(&self) {
        add(&self.counters().failures_total, 1);
    }

    /// Gives a block back where it came from: the OS for a large block
    /// ([`SystemAllocator::with_large_blocks_from_os`]), the global allocator otherwise.
    ///
    /// # Safety
    /// `address` is the exposed address of a block `allocate` made with `layout`, not
    /// yet freed, and nothing uses the block any more.
    unsafe fn free(&self, address: u64, layout: Layout) {
        if self.is_from_os(layout.size()) {
            // SAFETY: forwarded from the caller: the block was mapped by `os_pages::map`
            // with this size and is unused.
            unsafe { os_pages::unmap(address, layout.size()) };
        } else {
            // SAFETY: forwarded from the caller: `std::alloc::alloc(layout)` made it.
            unsafe { std::alloc::dealloc(std::ptr::with_exposed_provenance_mut(address as usize), layout) };
        }
    }
}

impl Default for SystemAllocator {
    fn default() -> SystemAllocator {
        SystemAllocator::new()
    }
}

impl DeviceAllocator for SystemAllocator {
    fn device(&self) -> DeviceKey {
        self.device
    }

    fn name(&self) -> &str {
        "system"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let (bytes, align) = (request.bytes(), request.align());
        let Ok(layout) = Layout::from_size_align(bytes.max(1), align) else {
            // Unreachable for a validated request; kept so no input can panic.
            self.count_failure();
            return Err(LayoutError::SizeOverflow { bytes, align, max: AllocationRequest::MAX_BYTES }.into());
        };
        let ptr = if self.is_from_os(layout.size()) {
            os_pages::map(layout.size(), align)
        } else {
            // SAFETY: `layout` has a non-zero size (at least one byte).
            NonNull::new(unsafe { std::alloc::alloc(layout) })
        };
        let Some(ptr) = ptr else {
            self.count_failure();
            return Err(AllocError::OutOfMemory {
                device: self.device,
                requested: bytes,
                align,
                available: MaybeBytes(None),
            });
        };
        let address = DeviceAddress::from_host_ptr(ptr);
        let Some(tag) = self.records.insert_tag(&[address.get(), bytes as u64, align as u64]) else {
            // SAFETY: `ptr` was made just above with this layout (by `std::alloc::alloc`
            // or, for a block from the OS, mapped) and was never handed out.
            unsafe { self.free(address.get(), layout) };
            self.count_failure();
            return Err(AllocError::Backend {
                device: self.device,
                source: BackendError {
                    backend: "system",
                    operation: "allocate",
                    code: 0,
                    detail: format!(
                        "this thread holds {} blocks of this allocator, the record table's bound per thread; \
                         release some blocks first",
                        memory_sync::records::SLOTS_PER_OWNER
                    ),
                },
            });
        };
        let counters = self.counters();
        add(&counters.live_bytes, bytes as u64);
        add(&counters.live_allocations, 1);
        add(&counters.allocations_total, 1);
        tracing::trace!(bytes, align, %address, "system allocate");
        Ok(RawAllocation::new(address, bytes, align, self.device, tag))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        if allocation.device() != self.device {
            return self.refuse(allocation);
        }
        let presented = [allocation.address().get(), allocation.bytes() as u64, allocation.align() as u64];
        let Some(taken) = self.records.take(allocation.provider_tag(), |recorded| *recorded == presented) else {
            return self.refuse(allocation);
        };
        let (bytes, align) = (allocation.bytes(), allocation.align());
        let Ok(layout) = Layout::from_size_align(bytes.max(1), align) else {
            unreachable!("the layout was valid at allocation")
        };
        // SAFETY: the address is the exposed address of a block made by `allocate` with
        // exactly this layout (address, size and alignment are the record's, made at
        // that allocation), and this thread took the record with the table's
        // compare-and-swap, which exactly one release of a record wins, so this is the
        // one and only deallocation of that block.
        unsafe { self.free(presented[0], layout) };
        taken.free();
        let counters = self.counters();
        add(&counters.live_bytes, (bytes as u64).wrapping_neg());
        add(&counters.live_allocations, u64::MAX);
        tracing::trace!(bytes, "system release");
        ReleaseOutcome::complete(bytes)
    }

    /// Host memory: released here, as nothing else ever frees it (see `lost.rs`).
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        crate::lost::release_lost(self, lost);
    }

    fn stats(&self) -> Option<AllocatorStats> {
        let mut stats = AllocatorStats::default();
        let sum = |into: &mut u64, counter: &AtomicU64| *into = into.wrapping_add(counter.load(Ordering::Relaxed));
        for counters in self.counters.iter() {
            sum(&mut stats.live_bytes, &counters.live_bytes);
            sum(&mut stats.live_allocations, &counters.live_allocations);
            sum(&mut stats.allocations_total, &counters.allocations_total);
            sum(&mut stats.failures_total, &counters.failures_total);
        }
        Some(stats)
    }
}

impl Drop for SystemAllocator {
    fn drop(&mut self) {
        // Blocks still live are leaked, not freed: whoever holds them may still use the
        // memory, and freeing it under them would be a use-after-free.
        let live = self.stats().map_or(0, |s| s.live_allocations);
        if live > 0 {
            tracing::warn!(live, device = %self.device, "system allocator dropped with live blocks; leaking them");
        }
    }
}

impl fmt::Debug for SystemAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SystemAllocator").field("device", &self.device).field("stats", &self.stats()).finish()
    }
}

/// Large blocks straight from the OS (see [`SystemAllocator::with_large_blocks_from_os`]).
#[cfg(unix)]
mod os_pages {
    use std::ptr::NonNull;

    use crate::sys;

    fn pages(bytes: usize) -> Option<usize> {
        bytes.checked_next_multiple_of(sys::page_size())
    }

    /// A fresh mapping of `bytes` (whole pages) aligned to `align`, or `None` when the
    /// OS refuses.
    pub(super) fn map(bytes: usize, align: usize) -> Option<NonNull<u8>> {
        let start = sys::map_pages(pages(bytes)?, align).ok()?;
        NonNull::new(std::ptr::with_exposed_provenance_mut(start))
    }

    /// Unmaps a block [`map`] made for `bytes`.
    ///
    /// # Safety
    /// `address` is the start of a live mapping `map(bytes, _)` made, which nothing
    /// uses any more.
    pub(super) unsafe fn unmap(address: u64, bytes: usize) {
        // `map` computed the same page count, so it fits.
        let Some(len) = pages(bytes) else { return };
        // SAFETY: forwarded from the caller; the range is the whole mapping.
        if let Err(error) = unsafe { sys::unmap(address as usize, len) } {
            // Only a failure to split a mapping can make munmap fail, and a whole
            // mapping needs no split; the pages stay mapped (nothing is lost but them).
            tracing::warn!(
                ?error,
                address,
                len,
                "system allocator: unmapping a large block failed; its pages stay mapped"
            );
        }
    }
}

/// Without `mmap`, [`SystemAllocator::with_large_blocks_from_os`] is never in force.
#[cfg(not(unix))]
mod os_pages {
    use std::ptr::NonNull;

    pub(super) fn map(_bytes: usize, _align: usize) -> Option<NonNull<u8>> {
        unreachable!("large blocks come from the OS only on unix")
    }

    /// Never called: no block comes from the OS here.
    ///
    /// # Safety
    /// None beyond the unix version's (a block [`map`] made, unused); as [`map`] never
    /// makes one, there is nothing to uphold.
    pub(super) unsafe fn unmap(_address: u64, _bytes: usize) {
        unreachable!("large blocks come from the OS only on unix")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_and_check(block: &RawAllocation, seed: u8) {
        if block.bytes() == 0 {
            return;
        }
        let ptr: *mut u8 = std::ptr::with_exposed_provenance_mut(block.address().get() as usize);
        // SAFETY: the block is live, owned by this test, `bytes()` long and writable;
        // no other reference to it exists.
        unsafe { std::ptr::write_bytes(ptr, seed, block.bytes()) };
        // SAFETY: as above; the bytes were just initialised.
        let slice = unsafe { std::slice::from_raw_parts(ptr, block.bytes()) };
        assert!(slice.iter().all(|&b| b == seed));
    }

    #[test]
    fn every_power_of_two_alignment_up_to_2_mib_is_honoured() {
        let system = SystemAllocator::new();
        for shift in 0..=21 {
            let align = 1 << shift;
            let block = system.allocate_layout(100, align).unwrap();
            assert!(block.address().is_aligned_to(align), "align {align}: {block:?}");
            write_and_check(&block, shift as u8);
            assert!(system.release(block).is_complete());
        }
    }

    #[test]
    fn live_blocks_are_distinct_and_independently_writable() {
        let system = SystemAllocator::new();
        let blocks: Vec<_> = (0..32).map(|i| system.allocate_layout(64 + i * 100, 16).unwrap()).collect();
        for (i, block) in blocks.iter().enumerate() {
            write_and_check(block, i as u8);
        }
        for (i, block) in blocks.iter().enumerate() {
            let ptr: *const u8 = std::ptr::with_exposed_provenance(block.address().get() as usize);
            // SAFETY: live block, initialised above, no mutable reference alive.
            let slice = unsafe { std::slice::from_raw_parts(ptr, block.bytes()) };
            assert!(slice.iter().all(|&b| b == i as u8), "block {i} was overwritten");
        }
        assert_eq!(system.stats().unwrap().live_allocations, 32);
        for block in blocks {
            assert!(system.release(block).is_complete());
        }
        assert_eq!(system.stats().unwrap().live_bytes, 0);
    }

    #[test]
    fn zero_size_blocks_are_unique_and_release_completely() {
        let system = SystemAllocator::new();
        let a = system.allocate_layout(0, 1).unwrap();
        let b = system.allocate_layout(0, 1).unwrap();
        assert_ne!(a.address(), b.address());
        assert_eq!(a.bytes(), 0);
        let ReleaseOutcome::Complete(done) = system.release(a) else { panic!("zero-size release must complete") };
        assert_eq!(done.unmapped_bytes(), 0);
        assert!(system.release(b).is_complete());
    }

    #[test]
    fn every_invalid_layout_is_a_typed_error() {
        let system = SystemAllocator::new();
        for align in [0, 3, 6, 48, usize::MAX] {
            let err = system.allocate_layout(64, align).unwrap_err();
            assert_eq!(err, AllocError::Layout(LayoutError::AlignmentNotPowerOfTwo { align }));
            assert!(err.to_string().contains("power of two"), "{err}");
        }
        for (bytes, align) in [(usize::MAX, 1), (isize::MAX as usize, 2), (isize::MAX as usize - 2, 8)] {
            let err = system.allocate_layout(bytes, align).unwrap_err();
            assert!(matches!(err, AllocError::Layout(LayoutError::SizeOverflow { .. })), "{err}");
            assert!(err.to_string().contains(&bytes.to_string()), "the message names the size: {err}");
        }
        assert_eq!(system.stats().unwrap().allocations_total, 0);
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri aborts on a ~isize::MAX-byte allocation instead of returning null")]
    fn a_size_the_system_refuses_is_out_of_memory_naming_the_request() {
        let system = SystemAllocator::for_device(DeviceKey::host(1));
        let bytes = AllocationRequest::MAX_BYTES & !4095;
        let err = system.allocate_layout(bytes, 4096).unwrap_err();
        assert_eq!(
            err,
            AllocError::OutOfMemory {
                device: DeviceKey::host(1),
                requested: bytes,
                align: 4096,
                available: MaybeBytes(None)
            }
        );
        assert!(err.to_string().contains(&bytes.to_string()) && err.to_string().contains("host:1"), "{err}");
        assert_eq!(system.stats().unwrap().failures_total, 1);
        // Still usable afterwards.
        let block = system.allocate_layout(8, 8).unwrap();
        assert!(system.release(block).is_complete());
    }

    #[test]
    fn a_block_of_another_device_or_allocator_is_handed_back() {
        let host = SystemAllocator::new();
        let device = SystemAllocator::for_device(DeviceKey::device(0));
        let block = host.allocate_layout(128, 64).unwrap();
        let ReleaseOutcome::Failed(failed) = device.release(block) else { panic!("wrong device must fail") };
        assert!(matches!(failed.error(), ReleaseError::NotOwned { .. }));
        assert!(failed.error().to_string().contains("release it through the allocator that made it"));
        let (block, _) = failed.into_parts();
        let other_host = SystemAllocator::new();
        let ReleaseOutcome::Failed(failed) = other_host.release(block) else { panic!("other instance must fail") };
        let (block, _) = failed.into_parts();
        let twin = RawAllocation::new(block.address(), 64, 64, DeviceKey::HOST, block.provider_tag());
        assert!(matches!(host.release(twin), ReleaseOutcome::Failed(_)), "a size mismatch must be refused");
        assert!(host.release(block).is_complete());
        assert_eq!(host.stats().unwrap().live_allocations, 0);
    }

    #[test]
    fn blocks_released_on_another_thread_are_freed_and_their_records_reused() {
        let system = SystemAllocator::new();
        let blocks: Vec<_> = (0..16).map(|_| system.allocate_layout(256, 8).unwrap()).collect();
        std::thread::scope(|s| {
            s.spawn(|| {
                for block in blocks {
                    assert!(system.release(block).is_complete());
                }
            });
        });
        let stats = system.stats().unwrap();
        assert_eq!((stats.live_allocations, stats.live_bytes, stats.allocations_total), (0, 0, 16));
        // The records came back to this thread's part through its remote stack: the next
        // blocks reuse their slots (a tag's slot field, bits 24..48).
        let slot = |block: &RawAllocation| (block.provider_tag() >> 24) & ((1 << 24) - 1);
        let again: Vec<_> = (0..16).map(|_| system.allocate_layout(256, 8).unwrap()).collect();
        assert!(again.iter().all(|block| slot(block) < 32), "{:?}", again.iter().map(slot).collect::<Vec<_>>());
        for block in again {
            assert!(system.release(block).is_complete());
        }
    }

    /// Whether `[start, start + len)` lies inside one of this process's mappings.
    #[cfg(target_os = "linux")]
    fn mapped(start: u64, len: u64) -> bool {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines().any(|line| {
            let range = line.split_whitespace().next().unwrap();
            let (from, to) = range.split_once('-').unwrap();
            let (from, to) = (u64::from_str_radix(from, 16).unwrap(), u64::from_str_radix(to, 16).unwrap());
            from <= start && start + len <= to
        })
    }

    /// Whether one of this process's mappings starts at `start`.
    #[cfg(target_os = "linux")]
    fn mapping_starts_at(start: u64) -> bool {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines()
            .any(|line| line.split('-').next().and_then(|from| u64::from_str_radix(from, 16).ok()) == Some(start))
    }

    #[cfg(unix)]
    #[test]
    #[cfg_attr(miri, ignore = "mmap/munmap system calls, which Miri does not support")]
    fn large_blocks_from_the_os_are_aligned_zeroed_writable_and_unmapped_on_release() {
        let system = SystemAllocator::new().with_large_blocks_from_os(1 << 20);
        for (bytes, align) in [(1 << 20, 64), (3 << 20 | 123, 4096), (5 << 20, 2 << 20), (1 << 20, 1)] {
            let block = system.allocate_layout(bytes, align).unwrap();
            assert!(block.address().is_aligned_to(align), "{bytes} bytes at align {align}: {block:?}");
            let ptr: *const u8 = std::ptr::with_exposed_provenance(block.address().get() as usize);
            // SAFETY: live block of `bytes` bytes; nothing writes it meanwhile.
            let fresh = unsafe { std::slice::from_raw_parts(ptr, bytes) };
            assert!(fresh.iter().all(|&b| b == 0), "a block from the OS reads as zeroes");
            write_and_check(&block, 7);
            #[cfg(target_os = "linux")]
            assert!(
                mapping_starts_at(block.address().get()),
                "a block of {bytes} bytes is a mapping of its own (glibc's own mmap puts a header first)"
            );
            let address = block.address().get();
            assert!(system.release(block).is_complete());
            #[cfg(target_os = "linux")]
            assert!(!mapped(address, bytes as u64), "released: its pages left the process ({bytes} bytes)");
            let _ = address;
        }
        let stats = system.stats().unwrap();
        assert_eq!((stats.live_bytes, stats.live_allocations, stats.allocations_total), (0, 0, 4));
    }

    #[cfg(unix)]
    #[test]
    #[cfg_attr(miri, ignore = "mmap/munmap system calls, which Miri does not support")]
    fn blocks_below_the_size_come_from_the_global_allocator_and_both_kinds_are_checked_on_release() {
        let system = SystemAllocator::new().with_large_blocks_from_os(1 << 20);
        let small = system.allocate_layout((1 << 20) - 1, 64).unwrap();
        let large = system.allocate_layout(1 << 20, 64).unwrap();
        write_and_check(&small, 1);
        write_and_check(&large, 2);
        // A presented size that differs from the record is refused before anything is
        // freed: it would pick the wrong way back (heap for a mapping, or the reverse).
        let forged = RawAllocation::new(large.address(), (1 << 20) - 1, 64, large.device(), large.provider_tag());
        let refused = system.release(forged);
        assert!(!refused.is_complete(), "a forged size was accepted: {refused:?}");
        write_and_check(&large, 3);
        assert!(system.release(small).is_complete());
        assert!(system.release(large).is_complete());
        assert_eq!(system.stats().unwrap().live_allocations, 0);
    }

    #[cfg(unix)]
    #[test]
    #[cfg_attr(miri, ignore = "mmap/munmap system calls, which Miri does not support")]
    fn with_every_block_from_the_os_a_zero_byte_block_is_a_page_of_its_own() {
        let system = SystemAllocator::new().with_large_blocks_from_os(0);
        let (empty, byte) = (system.allocate_layout(0, 1).unwrap(), system.allocate_layout(1, 1).unwrap());
        assert_ne!(empty.address(), byte.address());
        write_and_check(&byte, 9);
        assert!(system.release(empty).is_complete());
        assert!(system.release(byte).is_complete());
        assert_eq!(system.stats().unwrap().live_allocations, 0);
    }

    #[cfg(unix)]
    #[test]
    #[cfg_attr(miri, ignore = "mmap/munmap system calls, which Miri does not support")]
    fn a_mapping_the_os_refuses_is_out_of_memory_and_nothing_is_recorded() {
        use crate::sys::{Op, inject};
        let system = SystemAllocator::for_caches(DeviceKey::HOST);
        inject::fail_nth(Op::MapPages, 1, rustix::io::Errno::NOMEM);
        let error = system.allocate_layout(SystemAllocator::LARGE_BLOCK_BYTES, 64).unwrap_err();
        inject::clear();
        assert!(
            matches!(error, AllocError::OutOfMemory { requested, .. } if requested == SystemAllocator::LARGE_BLOCK_BYTES),
            "{error:?}"
        );
        let stats = system.stats().unwrap();
        assert_eq!((stats.live_allocations, stats.failures_total), (0, 1));
        let block = system.allocate_layout(SystemAllocator::LARGE_BLOCK_BYTES, 64).unwrap();
        assert!(system.release(block).is_complete());
    }
}
