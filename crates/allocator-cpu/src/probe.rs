//! Fault-safe reads and writes of host memory that may be protected.
//!
//! A reservation with nothing committed, a decommitted page or a read-only mapping
//! crashes the process on a plain load or store. These probes copy through a pipe
//! instead, so the kernel does the access and reports a protected page as `EFAULT`
//! (an [`io::Error`]) rather than a signal. Tests (the conformance suite's
//! `MemoryAccess` over the host allocators) and diagnostics use them to check
//! protections without crashing.

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use memory_api::DeviceAddress;

/// Pipes hold 64 KiB by default; stay below so one write never blocks.
const CHUNK: usize = 32 * 1024;

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    // No pipe2 on macOS: set close-on-exec right after (a fork in between is harmless
    // for a probe, which never execs).
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let (read, write) = {
        let (read, write) = rustix::pipe::pipe()?;
        rustix::io::fcntl_setfd(&read, rustix::io::FdFlags::CLOEXEC)?;
        rustix::io::fcntl_setfd(&write, rustix::io::FdFlags::CLOEXEC)?;
        (read, write)
    };
    Ok((read, write))
}

fn check(result: isize, expected: usize) -> io::Result<()> {
    match result {
        n if n < 0 => Err(io::Error::last_os_error()),
        n if n as usize == expected => Ok(()),
        n => Err(io::Error::other(format!("short pipe transfer: {n} of {expected} bytes"))),
    }
}

/// Writes `data` at `address`, failing with `EFAULT` (not a crash) when any byte of the
/// range is not writable. Bytes before the first unwritable chunk may have been written.
///
/// # Errors
/// The operating system's error (`EFAULT` for a protected or unmapped page).
///
/// # Safety
/// The caller must own the host memory at `[address, address + data.len())` (for
/// example an allocation it holds) and no Rust reference may point into it: the write
/// bypasses the borrow rules.
pub unsafe fn write(address: DeviceAddress, data: &[u8]) -> io::Result<()> {
    let (reader, writer) = pipe()?;
    for (i, chunk) in data.chunks(CHUNK).enumerate() {
        // SAFETY: `chunk` is a valid readable slice of `chunk.len()` bytes.
        let sent = unsafe { libc::write(writer.as_raw_fd(), chunk.as_ptr().cast::<c_void>(), chunk.len()) };
        check(sent, chunk.len())?;
        let target = std::ptr::with_exposed_provenance_mut::<c_void>(address.get() as usize + i * CHUNK);
        // SAFETY: the kernel copies into `target` and returns EFAULT instead of faulting
        // when a page is not writable; the caller owns the range and holds no reference
        // into it (see `# Safety`).
        let received = unsafe { libc::read(reader.as_raw_fd(), target, chunk.len()) };
        check(received, chunk.len())?;
    }
    Ok(())
}

/// Reads `len` bytes at `address`, failing with `EFAULT` (not a crash) when any byte of
/// the range is not readable.
///
/// # Errors
/// The operating system's error (`EFAULT` for a protected or unmapped page).
///
/// # Safety
/// The caller must own the host memory at `[address, address + len)` and no one may be
/// writing it concurrently.
pub unsafe fn read(address: DeviceAddress, len: usize) -> io::Result<Vec<u8>> {
    let (reader, writer) = pipe()?;
    let mut out = vec![0u8; len];
    for (i, chunk) in out.chunks_mut(CHUNK).enumerate() {
        let source = std::ptr::with_exposed_provenance::<c_void>(address.get() as usize + i * CHUNK);
        // SAFETY: the kernel reads from `source` and returns EFAULT instead of faulting
        // when a page is not readable; the caller owns the range (see `# Safety`).
        let sent = unsafe { libc::write(writer.as_raw_fd(), source, chunk.len()) };
        check(sent, chunk.len())?;
        // SAFETY: `chunk` is a valid writable slice of `chunk.len()` bytes.
        let received = unsafe { libc::read(reader.as_raw_fd(), chunk.as_mut_ptr().cast::<c_void>(), chunk.len()) };
        check(received, chunk.len())?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "pipe and mmap system calls, which Miri does not support")]
    fn probes_round_trip_ordinary_memory_and_report_unmapped_pages() {
        let mut buffer = vec![0u8; 100_000];
        let address = DeviceAddress::new(buffer.as_mut_ptr().expose_provenance() as u64).unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        // SAFETY: `buffer` is ours and no reference into it is used until the probe returns.
        unsafe { write(address, &data) }.unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { read(address, data.len()) }.unwrap(), data);
        assert_eq!(buffer, data);

        let base = crate::sys::reserve(4096, 4096).unwrap();
        let reserved = DeviceAddress::new(base as u64).unwrap();
        // SAFETY: the reservation is ours and inaccessible; the probe must fail, not crash.
        let err = unsafe { write(reserved, &[1]) }.unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT));
        // SAFETY: as above.
        assert_eq!(unsafe { read(reserved, 1) }.unwrap_err().raw_os_error(), Some(libc::EFAULT));
        // SAFETY: the reservation was made above and nothing references it.
        unsafe { crate::sys::unmap(base, 4096) }.unwrap();
    }
}
