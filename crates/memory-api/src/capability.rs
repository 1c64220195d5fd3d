//! Optional allocator capabilities: reserve/commit (`VirtualBacking`) and one physical
//! backing mapped into several allocations (`SharedMapping`).

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::allocator::RawAllocation;
use crate::device::DeviceKey;
use crate::error::CapabilityError;

/// A byte range inside one allocation: `offset .. offset + len`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ByteRange {
    offset: usize,
    len: usize,
}

impl ByteRange {
    /// The range `offset .. offset + len` (not yet checked against anything).
    #[inline]
    pub const fn new(offset: usize, len: usize) -> ByteRange {
        ByteRange { offset, len }
    }

    /// Start of the range.
    #[inline]
    pub const fn offset(&self) -> usize {
        self.offset
    }

    /// Length of the range.
    #[inline]
    pub const fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty.
    #[inline]
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// One past the last byte, or `None` on overflow.
    #[inline]
    pub const fn checked_end(&self) -> Option<usize> {
        self.offset.checked_add(self.len)
    }

    /// Checks that the range lies inside an allocation of `allocation_bytes`.
    ///
    /// # Errors
    /// [`CapabilityError::OutOfBounds`] otherwise (overflow included).
    #[inline]
    pub fn check_within(&self, allocation_bytes: usize) -> Result<(), CapabilityError> {
        match self.checked_end() {
            Some(end) if end <= allocation_bytes => Ok(()),
            _ => Err(CapabilityError::OutOfBounds { offset: self.offset, len: self.len, allocation_bytes }),
        }
    }

    /// Checks that the range, the source of a mapping, lies inside a shared backing of
    /// `backing_bytes`.
    ///
    /// # Errors
    /// [`CapabilityError::BackingOutOfBounds`] otherwise (overflow included).
    #[inline]
    pub fn check_within_backing(&self, backing_bytes: usize) -> Result<(), CapabilityError> {
        match self.checked_end() {
            Some(end) if end <= backing_bytes => Ok(()),
            _ => Err(CapabilityError::BackingOutOfBounds { offset: self.offset, len: self.len, backing_bytes }),
        }
    }

    /// Checks that offset and length are multiples of `granularity`.
    ///
    /// # Errors
    /// [`CapabilityError::Misaligned`] otherwise.
    #[inline]
    pub fn check_aligned(&self, granularity: usize) -> Result<(), CapabilityError> {
        if granularity == 0 || !self.offset.is_multiple_of(granularity) || !self.len.is_multiple_of(granularity) {
            return Err(CapabilityError::Misaligned { offset: self.offset, len: self.len, granularity });
        }
        Ok(())
    }
}

impl fmt::Display for ByteRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}, +{})", self.offset, self.len)
    }
}

/// Reserve address space, then commit and decommit physical memory on demand.
///
/// The allocation the owning allocator returns is the reservation; nothing is
/// committed until `commit`. Ranges are relative to the allocation and must be
/// multiples of [`VirtualBacking::granularity`].
pub trait VirtualBacking: Send + Sync {
    /// The commit granularity in bytes (a page, or CUDA's allocation granularity).
    fn granularity(&self) -> usize;

    /// Backs `range` of `allocation` with physical memory; returns the bytes newly
    /// committed (already committed pages count zero).
    ///
    /// # Errors
    /// Out-of-bounds or misaligned ranges, a foreign allocation, or a backend failure;
    /// on error nothing was committed.
    fn commit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError>;

    /// Returns the physical memory behind `range`; returns the bytes really released.
    ///
    /// # Errors
    /// Out-of-bounds or misaligned ranges, a foreign allocation, or a backend failure.
    /// A backend failure part-way may have released some pages already; the
    /// allocator's books stay exact, so ask [`VirtualBacking::committed_bytes`] after an
    /// error.
    fn decommit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError>;

    /// Bytes of `allocation` currently committed.
    ///
    /// # Errors
    /// A foreign allocation.
    fn committed_bytes(&self, allocation: &RawAllocation) -> Result<usize, CapabilityError>;
}

/// How a shared backing is mapped into an allocation.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum MappingAccess {
    /// Reads only (a shared prompt prefix).
    ReadOnly,
    /// Reads and writes.
    ReadWrite,
}

/// Where a backing range lands in an allocation.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct SharedPlacement {
    /// Range of the allocation to map into.
    pub target: ByteRange,
    /// Offset inside the backing where the mapped bytes start.
    pub backing_offset: usize,
}

/// The provider's object behind a [`SharedBacking`] (a memfd, a CUDA physical
/// allocation handle). Dropping the last reference releases it once unmapped.
pub trait SharedBackingResource: Any + Send + Sync + fmt::Debug {
    /// Size of the physical backing in bytes.
    fn bytes(&self) -> usize;
}

/// One physical backing that can be mapped into several allocations, so a shared
/// prefix is paid for once. Cloning shares the same backing.
#[derive(Clone, Debug)]
pub struct SharedBacking {
    device: DeviceKey,
    resource: Arc<dyn SharedBackingResource>,
}

impl SharedBacking {
    /// Wraps a provider resource for `device`.
    #[inline]
    pub fn new(device: DeviceKey, resource: Arc<dyn SharedBackingResource>) -> SharedBacking {
        SharedBacking { device, resource }
    }

    /// Device the backing lives on.
    #[inline]
    pub fn device(&self) -> DeviceKey {
        self.device
    }

    /// Size in bytes.
    #[inline]
    pub fn bytes(&self) -> usize {
        self.resource.bytes()
    }

    /// The provider resource, if it is a `T` (providers use this to reject backings
    /// made by another kind of allocator).
    #[inline]
    pub fn resource<T: SharedBackingResource>(&self) -> Option<&T> {
        let any: &dyn Any = &*self.resource;
        any.downcast_ref::<T>()
    }

    /// Whether two handles share one backing.
    #[inline]
    pub fn same_backing(&self, other: &SharedBacking) -> bool {
        Arc::ptr_eq(&self.resource, &other.resource)
    }
}

/// Map one physical backing into several allocations.
pub trait SharedMapping: Send + Sync {
    /// Mapping granularity in bytes; placements must be multiples of it.
    fn granularity(&self) -> usize;

    /// Creates a physical backing of `bytes` bytes.
    ///
    /// # Errors
    /// Out of memory, a misaligned size, or a backend failure.
    fn create_backing(&self, bytes: usize) -> Result<SharedBacking, CapabilityError>;

    /// Maps `placement` of `backing` into `allocation` with `access`.
    /// Transactional: on error nothing is mapped.
    ///
    /// # Errors
    /// Out-of-bounds or misaligned placement, a foreign backing or allocation, an
    /// already mapped target, or a backend failure.
    fn map(
        &self,
        backing: &SharedBacking,
        allocation: &RawAllocation,
        placement: SharedPlacement,
        access: MappingAccess,
    ) -> Result<(), CapabilityError>;

    /// Unmaps `range` of `allocation`; returns the bytes really unmapped.
    ///
    /// # Errors
    /// Out-of-bounds or misaligned ranges, a foreign allocation, or a backend failure
    /// (which may leave part of the range unmapped; map again to restore it).
    fn unmap(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked_against_bounds_and_granularity() {
        assert!(ByteRange::new(0, 4096).check_within(4096).is_ok());
        assert!(ByteRange::new(4096, 0).check_within(4096).is_ok());
        assert!(matches!(ByteRange::new(1, 4096).check_within(4096), Err(CapabilityError::OutOfBounds { .. })));
        assert!(matches!(
            ByteRange::new(usize::MAX, 2).check_within(usize::MAX),
            Err(CapabilityError::OutOfBounds { .. })
        ));
        assert!(ByteRange::new(8192, 4096).check_aligned(4096).is_ok());
        assert_eq!(ByteRange::new(4096, 4096).check_within_backing(8192), Ok(()));
        assert_eq!(
            ByteRange::new(4096, 8192).check_within_backing(8192),
            Err(CapabilityError::BackingOutOfBounds { offset: 4096, len: 8192, backing_bytes: 8192 })
        );
        assert!(matches!(
            ByteRange::new(usize::MAX, 2).check_within_backing(usize::MAX),
            Err(CapabilityError::BackingOutOfBounds { .. })
        ));
        assert!(matches!(ByteRange::new(100, 4096).check_aligned(4096), Err(CapabilityError::Misaligned { .. })));
        assert!(matches!(ByteRange::new(0, 100).check_aligned(4096), Err(CapabilityError::Misaligned { .. })));
        assert!(ByteRange::new(0, 0).check_aligned(0).is_err());
    }

    #[derive(Debug)]
    struct Fake(usize);
    impl SharedBackingResource for Fake {
        fn bytes(&self) -> usize {
            self.0
        }
    }
    #[derive(Debug)]
    struct Other;
    impl SharedBackingResource for Other {
        fn bytes(&self) -> usize {
            0
        }
    }

    #[test]
    fn backings_downcast_only_to_their_own_type() {
        let backing = SharedBacking::new(DeviceKey::HOST, Arc::new(Fake(4096)));
        assert_eq!(backing.bytes(), 4096);
        assert!(backing.resource::<Fake>().is_some());
        assert!(backing.resource::<Other>().is_none());
        let clone = backing.clone();
        assert!(clone.same_backing(&backing));
        let other = SharedBacking::new(DeviceKey::HOST, Arc::new(Fake(4096)));
        assert!(!other.same_backing(&backing));
    }
}
