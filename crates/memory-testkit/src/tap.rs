//! Capability forwarding shared by the wrappers: a wrapper hands out a `CapabilityTap`
//! that counts, gates or fails each capability call and then forwards it to the
//! capability of the wrapped allocator.

use std::sync::Arc;

use memory_api::{
    BackendError, ByteRange, CapabilityError, DeviceAllocator, MappingAccess, RawAllocation, SharedBacking,
    SharedMapping, SharedPlacement, VirtualBacking,
};

use crate::callback::Callback;

/// What a wrapper does around each capability call.
pub(crate) trait Interposer: Send + Sync {
    /// The wrapped allocator.
    type Inner: DeviceAllocator;
    /// Held for the duration of the forwarded call.
    type Guard<'a>
    where
        Self: 'a;

    fn inner(&self) -> &Self::Inner;

    /// Runs on entry; an error is returned to the caller instead of forwarding.
    fn enter(&self, callback: Callback) -> Result<Self::Guard<'_>, CapabilityError>;
}

/// Forwards capability calls through an [`Interposer`].
pub(crate) struct CapabilityTap<I>(pub(crate) Arc<I>);

fn vanished(callback: Callback, capability: &'static str) -> CapabilityError {
    CapabilityError::Backend(BackendError {
        backend: "testkit",
        operation: callback.name(),
        code: -1,
        detail: format!("the wrapped allocator no longer offers {capability}"),
    })
}

impl<I: Interposer> CapabilityTap<I> {
    fn virtual_call<R>(
        &self,
        callback: Callback,
        f: impl FnOnce(&dyn VirtualBacking) -> Result<R, CapabilityError>,
    ) -> Result<R, CapabilityError> {
        let _guard = self.0.enter(callback)?;
        let backing = self.0.inner().virtual_backing().ok_or_else(|| vanished(callback, "VirtualBacking"))?;
        f(backing)
    }

    fn shared_call<R>(
        &self,
        callback: Callback,
        f: impl FnOnce(&dyn SharedMapping) -> Result<R, CapabilityError>,
    ) -> Result<R, CapabilityError> {
        let _guard = self.0.enter(callback)?;
        let mapping = self.0.inner().shared_mapping().ok_or_else(|| vanished(callback, "SharedMapping"))?;
        f(mapping)
    }
}

impl<I: Interposer> VirtualBacking for CapabilityTap<I> {
    fn granularity(&self) -> usize {
        self.0.inner().virtual_backing().map_or(0, VirtualBacking::granularity)
    }

    fn commit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.virtual_call(Callback::Commit, |v| v.commit(allocation, range))
    }

    fn decommit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.virtual_call(Callback::Decommit, |v| v.decommit(allocation, range))
    }

    fn committed_bytes(&self, allocation: &RawAllocation) -> Result<usize, CapabilityError> {
        self.virtual_call(Callback::CommittedBytes, |v| v.committed_bytes(allocation))
    }
}

impl<I: Interposer> SharedMapping for CapabilityTap<I> {
    fn granularity(&self) -> usize {
        self.0.inner().shared_mapping().map_or(0, SharedMapping::granularity)
    }

    fn create_backing(&self, bytes: usize) -> Result<SharedBacking, CapabilityError> {
        self.shared_call(Callback::CreateBacking, |m| m.create_backing(bytes))
    }

    fn map(
        &self,
        backing: &SharedBacking,
        allocation: &RawAllocation,
        placement: SharedPlacement,
        access: MappingAccess,
    ) -> Result<(), CapabilityError> {
        self.shared_call(Callback::Map, |m| m.map(backing, allocation, placement, access))
    }

    fn unmap(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.shared_call(Callback::Unmap, |m| m.unmap(allocation, range))
    }
}
