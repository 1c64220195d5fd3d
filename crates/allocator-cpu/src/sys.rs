//! Every system call this crate makes, in one place, so that each unsafe obligation is
//! stated once and every caller's `// SAFETY:` can point at it. Addresses are plain
//! `usize` values whose provenance was exposed when the mapping was created; a pointer
//! is rebuilt with `with_exposed_provenance_mut` only to pass it to the kernel.
//!
//! Linux and macOS (any unix with `mmap`): where the two differ (memory files, dropping
//! pages, placing a mapping only where nothing is mapped) each function says how.
//!
//! Under `cfg(test)` a thread-local plan can make the n-th call of an operation fail
//! with a chosen errno before the system call is made, so tests drive every error path.

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsFd, OwnedFd};

use memory_api::BackendError;
use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};

/// The operations, for fault injection and error messages.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Reserve,
    MapPages,
    Protect,
    Discard,
    Populate,
    Unmap,
    MapShared,
    ReserveFixed,
    ReserveNoReplace,
    Memfd,
    Truncate,
}

impl Op {
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Op::Reserve => "mmap(PROT_NONE)",
            Op::MapPages => "mmap(PROT_READ | PROT_WRITE)",
            Op::Protect => "mprotect",
            Op::Discard => "madvise(MADV_DONTNEED)",
            Op::Populate => "madvise(MADV_POPULATE_WRITE)",
            Op::Unmap => "munmap",
            Op::MapShared => "mmap(MAP_SHARED | MAP_FIXED)",
            Op::ReserveFixed => "mmap(PROT_NONE, MAP_FIXED)",
            Op::ReserveNoReplace => "mmap(PROT_NONE, MAP_FIXED_NOREPLACE)",
            Op::Memfd => "memfd_create",
            Op::Truncate => "ftruncate",
        }
    }
}

/// A failed system call, with the operation that failed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct SysError {
    pub(crate) op: Op,
    pub(crate) errno: rustix::io::Errno,
}

impl SysError {
    pub(crate) fn is_out_of_memory(self) -> bool {
        self.errno == rustix::io::Errno::NOMEM
    }

    pub(crate) fn backend(self, context: &str) -> BackendError {
        BackendError {
            backend: "os",
            operation: self.op.name(),
            code: i64::from(self.errno.raw_os_error()),
            detail: format!("{context}: {}", io::Error::from(self.errno)),
        }
    }
}

pub(crate) type SysResult<T> = Result<T, SysError>;

fn wrap<T>(op: Op, result: rustix::io::Result<T>) -> SysResult<T> {
    result.map_err(|errno| SysError { op, errno })
}

fn ptr(addr: usize) -> *mut c_void {
    std::ptr::with_exposed_provenance_mut(addr)
}

/// The system page size, read once.
///
/// From `sysconf(_SC_PAGESIZE)`, which the C library answers from the auxiliary vector
/// the kernel (or valgrind, or a sanitizer's runtime) handed the process, and which a
/// static link keeps. Not `rustix::param::page_size`: on Linux it finds the auxiliary
/// vector by walking the vDSO's ELF headers, which valgrind does not map, so a program
/// using this crate crashed under memcheck (issue 23).
pub(crate) fn page_size() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static PAGE: AtomicUsize = AtomicUsize::new(0);
    match PAGE.load(Ordering::Relaxed) {
        0 => {
            // SAFETY: `sysconf` reads a process constant; it has no memory obligation.
            let answered = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
            // POSIX allows -1 (no such limit), which no unix with mmap answers; 4 KiB is
            // then the smallest page any of them uses, so ranges stay aligned.
            let page = usize::try_from(answered).ok().filter(|page| page.is_power_of_two()).unwrap_or(4096);
            PAGE.store(page, Ordering::Relaxed);
            page
        }
        page => page,
    }
}

/// Reserves `len` bytes of inaccessible address space aligned to `align`; returns its
/// start. `len` must be a non-zero multiple of the page size and `align` a power of two.
/// Nothing is committed: the kernel neither backs nor charges a `PROT_NONE` mapping.
pub(crate) fn reserve(len: usize, align: usize) -> SysResult<usize> {
    map_fresh(Op::Reserve, len, align, ProtFlags::empty())
}

/// Maps `len` bytes of fresh, zeroed, readable and writable private memory aligned to
/// `align`; returns its start. `len` must be a non-zero multiple of the page size and
/// `align` a power of two. Pages are backed when first touched; [`unmap`] gives them
/// back to the system.
pub(crate) fn map_pages(len: usize, align: usize) -> SysResult<usize> {
    map_fresh(Op::MapPages, len, align, ProtFlags::READ | ProtFlags::WRITE)
}

/// A fresh private anonymous mapping of `len` bytes aligned to `align` with `prot`.
fn map_fresh(op: Op, len: usize, align: usize, prot: ProtFlags) -> SysResult<usize> {
    inject::check(op)?;
    let page = page_size();
    let align = align.max(page);
    let nomem = SysError { op, errno: rustix::io::Errno::NOMEM };
    let span = len.checked_add(align - page).ok_or(nomem)?;
    // SAFETY: a null hint asks the kernel for a fresh range, so no existing memory is
    // affected; `mmap_anonymous` has no other obligation.
    let base = unsafe { rustix::mm::mmap_anonymous(std::ptr::null_mut(), span, prot, MapFlags::PRIVATE) };
    let base = wrap(op, base)?.expose_provenance();
    let start = base.next_multiple_of(align);
    let (head, tail) = (start - base, span - (start - base) - len);
    // Trim the alignment slack. A failed trim only leaves a little extra inaccessible
    // address space mapped; give the whole span back rather than track odd pieces.
    let head_trimmed = head == 0 || {
        // SAFETY: `[base, start)` lies inside the span mapped just above, which no one
        // else knows about yet, so no Rust reference points into it.
        unsafe { rustix::mm::munmap(ptr(base), head) }.is_ok()
    };
    let tail_trimmed = tail == 0 || {
        // SAFETY: `[start + len, base + span)` lies inside the same fresh span.
        unsafe { rustix::mm::munmap(ptr(start + len), tail) }.is_ok()
    };
    if !(head_trimmed && tail_trimmed) {
        // SAFETY: the whole span is still ours (fresh, unreferenced); unmapping a range
        // that is already partly unmapped is allowed.
        let _ = unsafe { rustix::mm::munmap(ptr(base), span) };
        return Err(SysError { op: Op::Unmap, errno: rustix::io::Errno::NOMEM });
    }
    Ok(start)
}

/// Changes the protection of `[addr, addr + len)` to read-write or none.
///
/// # Safety
/// The range must be page-aligned and lie inside a reservation this crate made and
/// still owns; when revoking access, no Rust reference may point into it.
pub(crate) unsafe fn protect(addr: usize, len: usize, writable: bool) -> SysResult<()> {
    inject::check(Op::Protect)?;
    let flags = if writable { MprotectFlags::READ | MprotectFlags::WRITE } else { MprotectFlags::empty() };
    // SAFETY: the caller guarantees the range is ours and unreferenced (see `# Safety`).
    wrap(Op::Protect, unsafe { rustix::mm::mprotect(ptr(addr), len, flags) })
}

/// Drops the physical pages behind `[addr, addr + len)` (they read as zero afterwards).
///
/// # Safety
/// As for [`protect`]: our own reservation, no Rust reference into it.
pub(crate) unsafe fn discard(addr: usize, len: usize) -> SysResult<()> {
    inject::check(Op::Discard)?;
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // SAFETY: the caller guarantees the range is ours and unreferenced.
        wrap(Op::Discard, unsafe { rustix::mm::madvise(ptr(addr), len, rustix::mm::Advice::LinuxDontNeed) })
    }
    // Elsewhere `MADV_DONTNEED` may keep the old contents; replacing the range with a
    // fresh anonymous mapping drops the pages and makes them read as zero everywhere.
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        let flags = MapFlags::PRIVATE | MapFlags::FIXED;
        // SAFETY: MAP_FIXED replaces only the caller's own, unreferenced range.
        let mapped = unsafe { rustix::mm::mmap_anonymous(ptr(addr), len, ProtFlags::empty(), flags) };
        wrap(Op::Discard, mapped).map(drop)
    }
}

/// Faults in physical pages for `[addr, addr + len)` now (Linux 5.14+; `EINVAL` on
/// kernels and systems without `MADV_POPULATE_WRITE`, which callers treat as "not
/// available").
///
/// # Safety
/// The range must be committed (read-write) memory of our own reservation.
pub(crate) unsafe fn populate(addr: usize, len: usize) -> SysResult<()> {
    inject::check(Op::Populate)?;
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // SAFETY: the caller guarantees the range is ours and writable; populating
        // writes nothing visible (pages read as zero either way).
        wrap(Op::Populate, unsafe { rustix::mm::madvise(ptr(addr), len, rustix::mm::Advice::LinuxPopulateWrite) })
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        let _ = (addr, len);
        Err(SysError { op: Op::Populate, errno: rustix::io::Errno::INVAL })
    }
}

/// Unmaps `[addr, addr + len)`.
///
/// # Safety
/// The range must be page-aligned, lie inside a reservation this crate made, and no
/// Rust reference may point into it; afterwards the crate must forget the range.
pub(crate) unsafe fn unmap(addr: usize, len: usize) -> SysResult<()> {
    inject::check(Op::Unmap)?;
    // SAFETY: the caller guarantees the range is ours and unreferenced.
    wrap(Op::Unmap, unsafe { rustix::mm::munmap(ptr(addr), len) })
}

/// Maps `len` bytes of `fd` at `offset` over `[addr, addr + len)`, replacing what is
/// there, shared and read-only or read-write.
///
/// # Safety
/// The range must be page-aligned, lie inside a reservation this crate made and
/// owns, and no Rust reference may point into it.
pub(crate) unsafe fn map_shared(addr: usize, len: usize, fd: impl AsFd, offset: u64, writable: bool) -> SysResult<()> {
    inject::check(Op::MapShared)?;
    let prot = if writable { ProtFlags::READ | ProtFlags::WRITE } else { ProtFlags::READ };
    let flags = MapFlags::SHARED | MapFlags::FIXED;
    // SAFETY: MAP_FIXED replaces only the caller's own range (see `# Safety`).
    let mapped = unsafe { rustix::mm::mmap(ptr(addr), len, prot, flags, fd, offset) };
    wrap(Op::MapShared, mapped).map(drop)
}

/// Replaces `[addr, addr + len)` with fresh inaccessible reservation.
///
/// # Safety
/// As for [`map_shared`].
pub(crate) unsafe fn reserve_fixed(addr: usize, len: usize) -> SysResult<()> {
    inject::check(Op::ReserveFixed)?;
    let flags = MapFlags::PRIVATE | MapFlags::FIXED;
    // SAFETY: MAP_FIXED replaces only the caller's own range (see `# Safety`).
    let mapped = unsafe { rustix::mm::mmap_anonymous(ptr(addr), len, ProtFlags::empty(), flags) };
    wrap(Op::ReserveFixed, mapped).map(drop)
}

/// Reserves `[addr, addr + len)` again if (and only if) nothing is mapped there; used
/// after a failed `MAP_FIXED`, which on older kernels may leave a hole behind.
/// `EEXIST` means something is still mapped in the range.
pub(crate) fn reserve_no_replace(addr: usize, len: usize) -> SysResult<()> {
    inject::check(Op::ReserveNoReplace)?;
    // Without MAP_FIXED_NOREPLACE (before Linux 4.17, and on macOS) the address is a
    // hint the kernel follows only when the range is free: the check below covers both.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let flags = MapFlags::PRIVATE | MapFlags::FIXED_NOREPLACE;
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let flags = MapFlags::PRIVATE;
    // SAFETY: neither MAP_FIXED_NOREPLACE nor a plain hint ever replaces an existing
    // mapping (the first fails with EEXIST, the second maps elsewhere), so no memory
    // anyone uses can be affected.
    let mapped = unsafe { rustix::mm::mmap_anonymous(ptr(addr), len, ProtFlags::empty(), flags) };
    let mapped = wrap(Op::ReserveNoReplace, mapped)?.expose_provenance();
    if mapped != addr {
        // A hint (an old kernel, or no MAP_FIXED_NOREPLACE) maps elsewhere only when the
        // range is occupied: give that mapping back.
        // SAFETY: the mapping was created just above and nothing refers to it.
        let _ = unsafe { rustix::mm::munmap(ptr(mapped), len) };
        return Err(SysError { op: Op::ReserveNoReplace, errno: rustix::io::Errno::EXIST });
    }
    Ok(())
}

/// Creates an anonymous memory file of `len` bytes: a memfd on Linux; elsewhere a POSIX
/// shared-memory object unlinked at once, so only the descriptor names it.
pub(crate) fn memfd(len: usize) -> SysResult<OwnedFd> {
    inject::check(Op::Memfd)?;
    let fd = wrap(Op::Memfd, anonymous_file())?;
    inject::check(Op::Truncate)?;
    wrap(Op::Truncate, rustix::fs::ftruncate(&fd, len as u64))?;
    Ok(fd)
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn anonymous_file() -> rustix::io::Result<OwnedFd> {
    rustix::fs::memfd_create("allocator-cpu-shared", rustix::fs::MemfdFlags::CLOEXEC)
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn anonymous_file() -> rustix::io::Result<OwnedFd> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // macOS limits shared-memory names to 31 bytes: "/acpu-<pid>-<n>" fits.
    let name = format!("/acpu-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
    let flags = rustix::shm::OFlags::CREATE | rustix::shm::OFlags::EXCL | rustix::shm::OFlags::RDWR;
    let fd = rustix::shm::open(name.as_str(), flags, rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR)?;
    rustix::shm::unlink(name.as_str())?;
    Ok(fd)
}

#[cfg(test)]
pub(crate) mod inject {
    //! Test-only fault injection (per thread, so parallel tests do not interfere).
    use std::cell::RefCell;

    use super::{Op, SysError};

    thread_local! {
        static PLAN: RefCell<Vec<(Op, u32, rustix::io::Errno)>> = const { RefCell::new(Vec::new()) };
    }

    /// Makes the `n`-th call (1 = next) of `op` on this thread fail with `errno`.
    pub(crate) fn fail_nth(op: Op, n: u32, errno: rustix::io::Errno) {
        assert!(n >= 1);
        PLAN.with(|plan| plan.borrow_mut().push((op, n, errno)));
    }

    /// Drops every pending fault on this thread.
    pub(crate) fn clear() {
        PLAN.with(|plan| plan.borrow_mut().clear());
    }

    pub(super) fn check(op: Op) -> Result<(), SysError> {
        PLAN.with(|plan| {
            let mut plan = plan.borrow_mut();
            for entry in plan.iter_mut().filter(|e| e.0 == op) {
                entry.1 -= 1;
            }
            match plan.iter().position(|e| e.0 == op && e.1 == 0) {
                Some(i) => Err(SysError { op, errno: plan.remove(i).2 }),
                None => Ok(()),
            }
        })
    }
}

#[cfg(not(test))]
mod inject {
    use super::{Op, SysError};

    #[inline(always)]
    pub(super) fn check(_: Op) -> Result<(), SysError> {
        Ok(())
    }
}
