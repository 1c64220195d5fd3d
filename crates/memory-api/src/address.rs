//! Device addresses as plain values.

use std::fmt;
use std::num::NonZeroU64;
use std::ptr::NonNull;

/// An address in some device's address space.
///
/// A value, not a host reference: it is `Send + Sync` without `unsafe impl`, and
/// holding one proves nothing about what it points to. Host backends convert to and
/// from pointers at their boundary; dereferencing stays their (unsafe) business.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceAddress(NonZeroU64);

impl DeviceAddress {
    /// The address `raw`, or `None` for the null address.
    #[inline]
    pub const fn new(raw: u64) -> Option<DeviceAddress> {
        match NonZeroU64::new(raw) {
            Some(value) => Some(DeviceAddress(value)),
            None => None,
        }
    }

    /// The numeric address.
    #[inline]
    pub const fn get(self) -> u64 {
        self.0.get()
    }

    /// The address of a host pointer. Exposes the pointer's provenance, so
    /// [`DeviceAddress::as_host_ptr`] can later rebuild a usable pointer from it.
    #[inline]
    pub fn from_host_ptr(ptr: NonNull<u8>) -> DeviceAddress {
        // A non-null pointer has a non-zero address; usize always fits in u64 on the
        // targets this workspace supports (checked below).
        let address = ptr.as_ptr().expose_provenance() as u64;
        DeviceAddress(NonZeroU64::new(address).unwrap_or(NonZeroU64::MIN))
    }

    /// This address as a host pointer (meaningful only for host-tier allocations),
    /// carrying the provenance exposed by [`DeviceAddress::from_host_ptr`] (or by the
    /// backend that mapped the memory). Creating the pointer is safe; using it is the
    /// caller's unsafe obligation.
    #[inline]
    pub fn as_host_ptr(self) -> *mut u8 {
        std::ptr::with_exposed_provenance_mut(self.get() as usize)
    }

    /// `self + offset`, or `None` on overflow.
    #[inline]
    pub fn checked_add(self, offset: usize) -> Option<DeviceAddress> {
        let offset = u64::try_from(offset).ok()?;
        self.get().checked_add(offset).and_then(DeviceAddress::new)
    }

    /// Whether the address is a multiple of `align` (a power of two).
    #[inline]
    pub fn is_aligned_to(self, align: usize) -> bool {
        align != 0 && self.get().is_multiple_of(align as u64)
    }
}

const _: () = assert!(std::mem::size_of::<usize>() <= std::mem::size_of::<u64>());

impl fmt::Debug for DeviceAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.get())
    }
}

impl fmt::Display for DeviceAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_is_not_an_address() {
        assert!(DeviceAddress::new(0).is_none());
        assert_eq!(DeviceAddress::new(0x1000).unwrap().get(), 0x1000);
    }

    #[test]
    fn offsets_are_checked() {
        let a = DeviceAddress::new(u64::MAX - 1).unwrap();
        assert!(a.checked_add(1).is_some());
        assert!(a.checked_add(2).is_none());
        assert!(DeviceAddress::new(0x2000).unwrap().is_aligned_to(0x1000));
        assert!(!DeviceAddress::new(0x2100).unwrap().is_aligned_to(0x1000));
    }

    #[test]
    fn host_pointers_round_trip() {
        let mut byte = 7u8;
        let ptr = NonNull::from(&mut byte);
        let addr = DeviceAddress::from_host_ptr(ptr);
        assert_eq!(addr.as_host_ptr().addr(), ptr.as_ptr().addr());
    }

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn addresses_are_send_and_sync() {
        assert_send_sync::<DeviceAddress>();
    }
}
