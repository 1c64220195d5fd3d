//! The C heap the process holds, read from the C library's allocator: how ONNX
//! Runtime's own memory for a session is measured (see the crate docs, "ONNX Runtime's
//! own memory").
//!
//! ONNX Runtime keeps part of a session's memory in allocations of its own (the graph
//! and its initializer buffers, kernels, prepacked weights where a kernel packs with its
//! own allocator), which no `OrtAllocator` sees. They all come from the C heap
//! (`malloc`, `posix_memalign`, C++ `operator new`), so the heap's growth across the
//! commit, less what the adapter's own work grew it by, is what ONNX Runtime kept.
//!
//! glibc reports its heap with `mallinfo2` (since 2.33): bytes in use in every arena
//! (`uordblks`) and in chunks mapped on their own (`hblkhd`). The symbol is looked up
//! at run time, so the crate still loads on an older glibc and on other C libraries;
//! there, and where `malloc` is replaced by another allocator that glibc does not see,
//! no measure is available and [`in_use`] answers `None` (or shows no growth).

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

/// Bytes of the C heap in use now (every thread's), or `None` when the C library
/// gives no such figure.
pub(crate) fn in_use() -> Option<u64> {
    imp::in_use()
}

/// Hands the C heap's free pages back to the operating system (glibc's
/// `malloc_trim(0)`: every arena's wholly free pages, not only the top of the heap);
/// `true` when the C library gave some back. A no-op answering `false` where the C
/// library has no such call.
///
/// Why: glibc keeps what is freed for later `malloc`s, resident. A trimmed cache whose
/// blocks came from the heap, and ONNX Runtime's own planning buffers of a new shape,
/// would otherwise stay in the process's footprint though nothing uses them.
pub(crate) fn return_free_pages() -> bool {
    imp::return_free_pages()
}

/// Measures in progress (commits are serialized, so at most one).
static MEASURING: AtomicUsize = AtomicUsize::new(0);

/// What the adapter's own work grew the C heap by while a measure was in progress, on
/// any thread: blocks of every session (when their backing allocates from the heap),
/// their bookkeeping, trimmed caches, log events.
static OWN_GROWTH: AtomicI64 = AtomicI64::new(0);

thread_local! {
    /// Whether this thread is inside [`own_work`] already.
    static IN_OWN_WORK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `work` of the adapter's own; while a commit is being measured, what it grew
/// the C heap by is kept apart from ONNX Runtime's growth. One atomic load otherwise.
///
/// Only the outermost call on a thread measures: work nests (an allocation whose
/// reclaim holder drops a session, whose blocks ONNX Runtime frees through the
/// adapter), and an inner call's growth is already in the outer call's.
pub(crate) fn own_work<R>(work: impl FnOnce() -> R) -> R {
    if MEASURING.load(Ordering::Acquire) == 0 || IN_OWN_WORK.with(std::cell::Cell::get) {
        return work();
    }
    /// Clears the flag also if `work` unwinds.
    struct Outermost;
    impl Drop for Outermost {
        fn drop(&mut self) {
            IN_OWN_WORK.with(|flag| flag.set(false));
        }
    }
    IN_OWN_WORK.with(|flag| flag.set(true));
    let outermost = Outermost;
    let before = in_use();
    let result = work();
    if let (Some(before), Some(after)) = (before, in_use()) {
        OWN_GROWTH.fetch_add(signed(after).saturating_sub(signed(before)), Ordering::Relaxed);
    }
    drop(outermost);
    result
}

fn signed(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// The C heap's growth across a commit, less the adapter's own (see [`own_work`]).
/// Ends when dropped, also if the commit unwinds.
pub(crate) struct Measure {
    start: Option<(u64, i64)>,
}

impl Measure {
    /// Starts measuring (the caller holds the commit lock).
    pub(crate) fn start() -> Measure {
        MEASURING.fetch_add(1, Ordering::AcqRel);
        let own = OWN_GROWTH.load(Ordering::Relaxed);
        Measure { start: in_use().map(|heap| (heap, own)) }
    }

    /// How much the heap grew since the start, less the adapter's own part of it;
    /// `None` when the C library gives no figure.
    pub(crate) fn grown(self) -> Option<i64> {
        let (heap, own) = self.start?;
        let now = in_use()?;
        let own = OWN_GROWTH.load(Ordering::Relaxed).saturating_sub(own);
        Some(signed(now).saturating_sub(signed(heap)).saturating_sub(own))
    }
}

impl Drop for Measure {
    fn drop(&mut self) {
        MEASURING.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The most bytes glibc's per-thread cache (tcache) can keep of freed chunks: 7 chunks
/// in each of its 64 size classes (32 to 1040 bytes), which `mallinfo2` counts as in
/// use. A commit whose first small allocations are served from a cache filled before
/// it shows at most this much less growth than ONNX Runtime made.
pub(crate) const THREAD_CACHE_BOUND: u64 = 7 * (64 * 32 + 16 * (63 * 64 / 2));

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod imp {
    use std::ffi::c_void;
    use std::sync::OnceLock;

    type Mallinfo2 = unsafe extern "C" fn() -> libc::mallinfo2;
    type MallocTrim = unsafe extern "C" fn(libc::size_t) -> libc::c_int;

    static ENTRY: OnceLock<Option<Mallinfo2>> = OnceLock::new();
    static TRIM: OnceLock<Option<MallocTrim>> = OnceLock::new();

    /// The address of the C library's `name`, or `None` where it has none.
    fn lookup(name: &std::ffi::CStr) -> Option<*mut c_void> {
        // SAFETY: `dlsym` with `RTLD_DEFAULT` and a NUL-terminated name only looks the
        // symbol up in the objects already loaded.
        let symbol: *mut c_void = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
        (!symbol.is_null()).then_some(symbol)
    }

    pub(super) fn return_free_pages() -> bool {
        let trim = *TRIM.get_or_init(|| {
            // SAFETY: glibc's `malloc_trim` is `int malloc_trim(size_t pad)` (malloc.h);
            // the symbol lives as long as libc.
            lookup(c"malloc_trim").map(|symbol| unsafe { std::mem::transmute::<*mut c_void, MallocTrim>(symbol) })
        });
        // SAFETY: `malloc_trim` takes each arena's own lock in turn and only returns
        // pages of chunks that are free; it may be called from any thread at any time.
        trim.is_some_and(|trim| unsafe { trim(0) } != 0)
    }

    fn entry() -> Option<Mallinfo2> {
        *ENTRY.get_or_init(|| {
            let Some(symbol) = lookup(c"mallinfo2") else {
                tracing::warn!("the C library has no mallinfo2: onnx runtime's own memory cannot be measured");
                return None;
            };
            // SAFETY: glibc's `mallinfo2` is `struct mallinfo2 mallinfo2(void)` (malloc.h),
            // which is what `libc::mallinfo2` lays out; the symbol lives as long as libc.
            Some(unsafe { std::mem::transmute::<*mut c_void, Mallinfo2>(symbol) })
        })
    }

    pub(super) fn in_use() -> Option<u64> {
        let mallinfo2 = entry()?;
        // SAFETY: `mallinfo2` takes nothing and only reads the allocator's state, under
        // the allocator's own locks; it may be called from any thread.
        let info = unsafe { mallinfo2() };
        Some(info.uordblks.saturating_add(info.hblkhd) as u64)
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod imp {
    pub(super) fn in_use() -> Option<u64> {
        None
    }

    pub(super) fn return_free_pages() -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_thread_cache_bound_is_seven_chunks_of_each_small_size() {
        let by_hand: u64 = (0..64).map(|class| 7 * (32 + 16 * class)).sum();
        assert_eq!(THREAD_CACHE_BOUND, by_hand);
        assert_eq!(THREAD_CACHE_BOUND, 240_128);
    }

    /// Nested own work (an allocation whose reclaim holder drops a session, whose blocks
    /// are freed through the adapter) is counted once: counted twice, the commit's
    /// measure came out higher by what the inner work freed.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn nested_own_work_is_kept_out_of_the_measure_once() {
        let size = 64usize << 20;
        let held = std::hint::black_box(vec![1u8; size]);
        let measure = Measure::start();
        own_work(|| own_work(|| drop(held)));
        let grown = measure.grown().expect("glibc reports its heap");
        // Other tests of this binary allocate meanwhile: far less than the block.
        assert!(grown.abs() < (size / 4) as i64, "the freed block shows in the measure: {grown}");
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_large_allocation_shows_in_the_heap_and_leaves_it_when_freed() {
        // Other tests of this binary allocate meanwhile: a block far larger than theirs.
        let size = 64usize << 20;
        let before = in_use().expect("glibc reports its heap");
        let block = std::hint::black_box(vec![1u8; size]);
        let held = in_use().unwrap();
        assert!(held.saturating_sub(before) >= size as u64 / 2, "{before} -> {held}");
        drop(block);
        assert!(held.saturating_sub(in_use().unwrap()) >= size as u64 / 2);
    }

    /// Freed heap memory below the top stays resident until [`return_free_pages`]
    /// hands it back: checked page by page with `mincore` on the freed blocks' own
    /// addresses, so other tests' memory does not blur it.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn freed_heap_blocks_leave_the_process_once_the_free_pages_are_returned() {
        const BLOCK: usize = 16 << 10;
        // 32 MiB in blocks glibc serves from its heap (below its mmap threshold), then
        // a fence after them, so they are not at the heap's top once freed.
        let blocks: Vec<Vec<u8>> = (0..2048).map(|_| vec![1u8; BLOCK]).collect();
        let fence = std::hint::black_box(vec![1u8; BLOCK]);
        let pages: Vec<usize> = blocks.iter().map(|block| block.as_ptr() as usize).collect();
        assert!(resident_share(&pages, BLOCK) > 0.9, "the blocks were touched");
        drop(blocks);
        let before = resident_share(&pages, BLOCK);
        assert!(before > 0.9, "freed, the blocks stay resident until the pages are returned: {before:.2}");
        assert!(return_free_pages(), "glibc gave pages back");
        let after = resident_share(&pages, BLOCK);
        // Other threads of this binary may reuse a few of the freed blocks meanwhile.
        assert!(after < 0.5 && after < before, "resident share of the freed blocks: {before:.2} -> {after:.2}");
        drop(fence);
    }

    /// The share of the whole pages inside `[start, start + len)` for each start that
    /// are resident.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn resident_share(starts: &[usize], len: usize) -> f64 {
        let page = 4096;
        let (mut resident, mut total) = (0usize, 0usize);
        for &start in starts {
            let first = start.div_ceil(page) * page;
            let count = (start + len).saturating_sub(first) / page;
            let mut vector = vec![0u8; count];
            // SAFETY: `mincore` only reads the page tables of the given range (of this
            // process's address space, mapped: the heap) into `vector`, one byte a page.
            let answer = unsafe { libc::mincore(first as *mut libc::c_void, count * page, vector.as_mut_ptr()) };
            assert_eq!(answer, 0, "mincore failed: {}", std::io::Error::last_os_error());
            resident += vector.iter().filter(|&&byte| byte & 1 == 1).count();
            total += count;
        }
        resident as f64 / total.max(1) as f64
    }
}
