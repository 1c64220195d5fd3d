//! Reading and writing allocator memory from tests without dereferencing addresses.
//!
//! The conformance suite must run over device allocators whose memory the host cannot
//! dereference, and over host allocators whose memory may be protected (a reservation
//! with nothing committed, a read-only mapping). So it never touches memory itself: it
//! asks a [`MemoryAccess`], which reports a protected or unmapped range as an error
//! instead of crashing. Host backends implement it with fault-safe probes; a CUDA
//! backend with `cuMemcpy`.

use std::fmt;

use memory_api::DeviceAddress;

/// Fault-safe reads and writes of allocator memory.
pub trait MemoryAccess: Send + Sync {
    /// Writes `data` at `address`.
    ///
    /// # Errors
    /// [`AccessError`] when any byte of the range is not writable (unmapped, read-only,
    /// not committed); the process must not crash.
    fn write(&self, address: DeviceAddress, data: &[u8]) -> Result<(), AccessError>;

    /// Reads `len` bytes at `address`.
    ///
    /// # Errors
    /// [`AccessError`] when any byte of the range is not readable.
    fn read(&self, address: DeviceAddress, len: usize) -> Result<Vec<u8>, AccessError>;
}

/// A range that could not be read or written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessError {
    /// Start of the range.
    pub address: DeviceAddress,
    /// Length of the range.
    pub len: usize,
    /// What the accessor found ("not writable", "not inside a live block").
    pub reason: String,
}

impl fmt::Display for AccessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot access {} bytes at {}: {}", self.len, self.address, self.reason)
    }
}

impl std::error::Error for AccessError {}
