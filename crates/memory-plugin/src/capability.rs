//! The plugin's capabilities as the contract's traits: reserve/commit
//! (`VirtualBacking`) and shared mappings (`SharedMapping`). Ranges, ownership and
//! backings are checked on the host side before the plugin is called; its answers are
//! checked after.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use memory_api::{
    ByteRange, CapabilityError, MappingAccess, RawAllocation, SharedBacking, SharedBackingResource, SharedMapping,
    SharedPlacement, VirtualBacking,
};
use memory_plugin_abi::{
    MP_ACCESS_READ_ONLY, MP_ACCESS_READ_WRITE, MP_ERR_ALREADY_MAPPED, MP_ERR_DEVICE_LOST, MP_ERR_MISALIGNED,
    MP_ERR_NOT_OWNED, MP_ERR_OUT_OF_BOUNDS, MP_ERR_OUT_OF_MEMORY, MP_ERR_UNSUPPORTED, MP_OK, MpBacking, MpBlock,
    MpRangeFn, MpStatus,
};

use crate::allocator::Instance;

impl Instance {
    fn owned(&self, allocation: &RawAllocation) -> Result<MpBlock, CapabilityError> {
        self.records.get(allocation, self.abi_device).ok_or_else(|| CapabilityError::NotOwned {
            allocator: self.name.clone(),
            address: allocation.address().get(),
        })
    }

    fn capability_error(&self, operation: &'static str, status: MpStatus, range: ByteRange) -> CapabilityError {
        match status {
            MP_ERR_OUT_OF_BOUNDS => {
                CapabilityError::OutOfBounds { offset: range.offset(), len: range.len(), allocation_bytes: 0 }
            }
            MP_ERR_MISALIGNED => {
                CapabilityError::Misaligned { offset: range.offset(), len: range.len(), granularity: 0 }
            }
            MP_ERR_NOT_OWNED => CapabilityError::NotOwned { allocator: self.name.clone(), address: 0 },
            MP_ERR_ALREADY_MAPPED => CapabilityError::AlreadyMapped { offset: range.offset(), len: range.len() },
            MP_ERR_OUT_OF_MEMORY => CapabilityError::OutOfMemory { device: self.device, requested: range.len() },
            MP_ERR_DEVICE_LOST => {
                CapabilityError::DeviceLost { device: self.device, reason: format!("plugin {} reported it", self.name) }
            }
            MP_ERR_UNSUPPORTED => CapabilityError::Unsupported { allocator: self.name.clone(), what: operation },
            _ => CapabilityError::Backend(self.backend(operation, status, "")),
        }
    }

    /// Calls a range slot (`commit`, `decommit`, `unmap`): checks the block is ours and
    /// the range fits it at `granularity`, then holds the plugin's answer to the range.
    fn call_range(
        &self,
        operation: &'static str,
        slot: MpRangeFn,
        granularity: usize,
        allocation: &RawAllocation,
        range: ByteRange,
    ) -> Result<usize, CapabilityError> {
        let block = self.owned(allocation)?;
        range.check_within(allocation.bytes())?;
        range.check_aligned(granularity)?;
        let call = slot.ok_or(CapabilityError::Unsupported { allocator: self.name.clone(), what: operation })?;
        let mut done = 0u64;
        // SAFETY: a non-null slot of the negotiated table (checked with its capability);
        // `block` is the plugin's own record of a live block; pointers are to live locals.
        let status = unsafe { call(self.ptr(), &block, range.offset() as u64, range.len() as u64, &mut done) };
        if status != MP_OK {
            return Err(self.capability_error(operation, status, range));
        }
        if done > range.len() as u64 {
            return Err(self.dishonest(operation, done, range));
        }
        Ok(to_usize(done))
    }

    fn dishonest(&self, operation: &'static str, claimed: u64, range: ByteRange) -> CapabilityError {
        let detail =
            format!("; it claimed {claimed} bytes for a range of {} bytes (report the plugin's bug)", range.len());
        CapabilityError::Backend(self.backend(operation, MP_OK, &detail))
    }
}

fn to_usize(bytes: u64) -> usize {
    usize::try_from(bytes).unwrap_or(usize::MAX)
}

impl VirtualBacking for Instance {
    fn granularity(&self) -> usize {
        to_usize(self.table.virtual_granularity)
    }

    fn commit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.call_range("commit", self.table.commit, VirtualBacking::granularity(self), allocation, range)
    }

    fn decommit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.call_range("decommit", self.table.decommit, VirtualBacking::granularity(self), allocation, range)
    }

    fn committed_bytes(&self, allocation: &RawAllocation) -> Result<usize, CapabilityError> {
        let block = self.owned(allocation)?;
        let committed = self
            .table
            .committed_bytes
            .ok_or(CapabilityError::Unsupported { allocator: self.name.clone(), what: "committed_bytes" })?;
        let mut bytes = 0u64;
        // SAFETY: as in `commit`.
        let status = unsafe { committed(self.ptr(), &block, &mut bytes) };
        let whole = ByteRange::new(0, allocation.bytes());
        if status != MP_OK {
            return Err(self.capability_error("committed_bytes", status, whole));
        }
        if bytes > block.bytes {
            return Err(self.dishonest("committed_bytes", bytes, whole));
        }
        Ok(to_usize(bytes))
    }
}

/// A shared backing made by a plugin. Dropping the last reference tells the plugin
/// (`drop_backing`); it pins the instance, hence the library, until then.
pub struct PluginBacking {
    handle: u64,
    bytes: usize,
    instance: Arc<Instance>,
}

impl fmt::Debug for PluginBacking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PluginBacking")
            .field("plugin", &self.instance.name)
            .field("handle", &self.handle)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl SharedBackingResource for PluginBacking {
    fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for PluginBacking {
    fn drop(&mut self) {
        if let Some(drop_backing) = self.instance.table.drop_backing {
            // SAFETY: non-null slot (checked with the capability); the handle came from
            // this instance's `create_backing` and is dropped exactly once, here; the
            // instance (and its library) is alive through `self.instance`.
            unsafe { drop_backing(self.instance.ptr(), self.handle) };
        }
        self.instance.backings.fetch_sub(1, Ordering::AcqRel);
    }
}

impl SharedMapping for Instance {
    fn granularity(&self) -> usize {
        to_usize(self.table.shared_granularity)
    }

    fn create_backing(&self, bytes: usize) -> Result<SharedBacking, CapabilityError> {
        let granularity = SharedMapping::granularity(self);
        ByteRange::new(0, bytes).check_aligned(granularity)?;
        let create = self
            .table
            .create_backing
            .ok_or(CapabilityError::Unsupported { allocator: self.name.clone(), what: "create_backing" })?;
        let mut out = MpBacking::default();
        // SAFETY: non-null slot; `out` is a live local.
        let status = unsafe { create(self.ptr(), bytes as u64, &mut out) };
        if status != MP_OK {
            return Err(self.capability_error("create_backing", status, ByteRange::new(0, bytes)));
        }
        // Count it before anything can drop it, so the tally never goes below zero.
        self.backings.fetch_add(1, Ordering::AcqRel);
        // `self` is borrowed from a live `Arc`, so the upgrade succeeds.
        let Some(instance) = self.me.upgrade() else {
            self.backings.fetch_sub(1, Ordering::AcqRel);
            return Err(self.dishonest(
                "create_backing (instance is being destroyed)",
                out.bytes,
                ByteRange::new(0, bytes),
            ));
        };
        let backing = PluginBacking { handle: out.handle, bytes: to_usize(out.bytes), instance };
        if out.handle == 0 || out.bytes != bytes as u64 {
            let claimed = out.bytes;
            drop(backing);
            return Err(self.dishonest("create_backing", claimed, ByteRange::new(0, bytes)));
        }
        Ok(SharedBacking::new(self.device, Arc::new(backing)))
    }

    fn map(
        &self,
        backing: &SharedBacking,
        allocation: &RawAllocation,
        placement: SharedPlacement,
        access: MappingAccess,
    ) -> Result<(), CapabilityError> {
        let block = self.owned(allocation)?;
        let ours = backing.resource::<PluginBacking>().filter(|b| std::ptr::eq(&*b.instance, self));
        let Some(resource) = ours else {
            return Err(CapabilityError::ForeignBacking {
                found: format!("{backing:?}"),
                expected: format!("plugin {}", self.name),
            });
        };
        let granularity = SharedMapping::granularity(self);
        let target = placement.target;
        target.check_within(allocation.bytes())?;
        target.check_aligned(granularity)?;
        let source = ByteRange::new(placement.backing_offset, target.len());
        source.check_within_backing(resource.bytes)?;
        source.check_aligned(granularity)?;
        let map = self.table.map.ok_or(CapabilityError::Unsupported { allocator: self.name.clone(), what: "map" })?;
        let access = match access {
            MappingAccess::ReadOnly => MP_ACCESS_READ_ONLY,
            MappingAccess::ReadWrite => MP_ACCESS_READ_WRITE,
        };
        // SAFETY: non-null slot; the handle is this instance's live backing (pinned by
        // `backing`); `block` is the plugin's own record of a live block.
        let status = unsafe {
            map(
                self.ptr(),
                resource.handle,
                &block,
                target.offset() as u64,
                target.len() as u64,
                placement.backing_offset as u64,
                access,
            )
        };
        if status != MP_OK {
            return Err(self.capability_error("map", status, target));
        }
        Ok(())
    }

    fn unmap(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.call_range("unmap", self.table.unmap, SharedMapping::granularity(self), allocation, range)
    }
}

// The plugin allocator offers the instance's capabilities as its own (see
// `PluginAllocator::virtual_backing`): every call forwards to the instance.
impl VirtualBacking for crate::PluginAllocator {
    fn granularity(&self) -> usize {
        VirtualBacking::granularity(&*self.shared)
    }

    fn commit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.shared.commit(allocation, range)
    }

    fn decommit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.shared.decommit(allocation, range)
    }

    fn committed_bytes(&self, allocation: &RawAllocation) -> Result<usize, CapabilityError> {
        self.shared.committed_bytes(allocation)
    }
}

impl SharedMapping for crate::PluginAllocator {
    fn granularity(&self) -> usize {
        SharedMapping::granularity(&*self.shared)
    }

    fn create_backing(&self, bytes: usize) -> Result<SharedBacking, CapabilityError> {
        self.shared.create_backing(bytes)
    }

    fn map(
        &self,
        backing: &SharedBacking,
        allocation: &RawAllocation,
        placement: SharedPlacement,
        access: MappingAccess,
    ) -> Result<(), CapabilityError> {
        self.shared.map(backing, allocation, placement, access)
    }

    fn unmap(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.shared.unmap(allocation, range)
    }
}
