//! The scratch sink: what a stopped run gets past the overdraft limit.
//!
//! A run that was refused keeps allocating until ONNX Runtime reaches the next kernel
//! boundary and sees the terminate flag; a null there would crash the process (its
//! tensors do not check), and the overdraft is bounded. Past the bound, a request is
//! served from the sink: address space of the size asked for, every 2 MiB of it mapped
//! onto the *same* 2 MiB of shared memory. Reads and writes are valid for the whole
//! length, so kernels in flight finish; the contents are meaningless (blocks alias one
//! another), which is harmless because the run is failing and its outputs are
//! discarded. The process holds 2 MiB for the sink however much is asked of it.
//!
//! Linux only (`memfd_create`); elsewhere the sink is unavailable and such a request is
//! answered with null.

/// The physical backing every sink block maps, over and over.
#[cfg(target_os = "linux")]
const BACKING: usize = 2 << 20;

/// Address space for `size` bytes aligned to `align` (at most the page size), backed by
/// the sink; `None` if it cannot be mapped.
#[cfg(target_os = "linux")]
pub(crate) fn allocate(size: usize, align: usize) -> Option<usize> {
    use rustix::mm::{MapFlags, ProtFlags, mmap, mmap_anonymous, munmap};
    // Mappings start page-aligned, and pages are at least 4 KiB.
    if align > 4096 {
        return None;
    }
    let fd = backing()?;
    let len = mapped_len(size)?;
    // SAFETY: a fresh private reservation at an address the kernel picks: it aliases
    // nothing of ours.
    let base = unsafe { mmap_anonymous(std::ptr::null_mut(), len, ProtFlags::empty(), MapFlags::PRIVATE) }.ok()?;
    for offset in (0..len).step_by(BACKING) {
        let at = base.cast::<u8>().wrapping_add(offset).cast();
        // SAFETY: `at .. at + BACKING` lies inside the reservation made above, which
        // nothing else uses; MAP_FIXED replaces that part of it with the backing.
        let mapped =
            unsafe { mmap(at, BACKING, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED | MapFlags::FIXED, fd, 0) };
        if mapped.is_err() {
            // SAFETY: the whole reservation is ours and nothing points into it yet.
            let _ = unsafe { munmap(base, len) };
            return None;
        }
    }
    Some(base.addr())
}

/// Unmaps a block from [`allocate`] of `size` bytes.
#[cfg(target_os = "linux")]
pub(crate) fn free(address: usize, size: usize) {
    let Some(len) = mapped_len(size) else { return };
    // SAFETY: `address` came from `allocate(size, _)`, which mapped exactly `len` bytes
    // there; the live table handed it back exactly once, so nothing uses it any more.
    let unmapped = unsafe { rustix::mm::munmap(std::ptr::with_exposed_provenance_mut(address), len) };
    if let Err(err) = unmapped {
        tracing::error!(address, %err, "could not unmap a scratch sink block");
    }
}

#[cfg(target_os = "linux")]
fn mapped_len(size: usize) -> Option<usize> {
    size.checked_next_multiple_of(BACKING)
}

/// The shared backing, made once per process.
#[cfg(target_os = "linux")]
fn backing() -> Option<rustix::fd::BorrowedFd<'static>> {
    use std::os::fd::AsFd;
    use std::sync::OnceLock;
    static BACKING_FD: OnceLock<Option<rustix::fd::OwnedFd>> = OnceLock::new();
    let fd = BACKING_FD.get_or_init(|| {
        let made = rustix::fs::memfd_create("memory-ort-scratch-sink", rustix::fs::MemfdFlags::CLOEXEC)
            .and_then(|fd| rustix::fs::ftruncate(&fd, BACKING as u64).map(|()| fd));
        made.map_err(|err| tracing::error!(%err, "could not create the scratch sink")).ok()
    });
    fd.as_ref().map(AsFd::as_fd)
}

/// Unavailable off Linux: a request past the overdraft limit is answered with null.
#[cfg(not(target_os = "linux"))]
pub(crate) fn allocate(_size: usize, _align: usize) -> Option<usize> {
    None
}

/// Nothing to unmap off Linux.
#[cfg(not(target_os = "linux"))]
pub(crate) fn free(_address: usize, _size: usize) {}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_sink_block_is_writable_over_its_whole_length_and_holds_one_backing() {
        let size = 9 * BACKING + 123;
        let address = allocate(size, 64).expect("the sink maps");
        let block: *mut u8 = std::ptr::with_exposed_provenance_mut(address);
        let last = block.wrapping_add(size - 1);
        let second = block.wrapping_add(BACKING);
        // SAFETY: `allocate` mapped `size` bytes (rounded up) read-write at `block`.
        unsafe { block.write(1) };
        // SAFETY: as above; `last` is the block's last byte.
        unsafe { last.write(2) };
        // Every 2 MiB of the block is the same backing.
        // SAFETY: as above; `second` lies inside the block.
        assert_eq!(unsafe { second.read() }, 1);
        free(address, size);
        assert!(allocate(4096, 8192).is_none(), "alignment past a page is refused");
    }
}
