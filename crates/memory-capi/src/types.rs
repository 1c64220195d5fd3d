//! The plain-data types of the C API (`#[repr(C)]`) and its opaque handle types.

use std::ffi::c_void;

/// A registry (opaque; never dereferenced).
pub struct McRegistry {
    _opaque: [u8; 0],
}
/// A governor (opaque).
pub struct McGovernor {
    _opaque: [u8; 0],
}
/// A registered provider context (opaque).
pub struct McContext {
    _opaque: [u8; 0],
}
/// A registered authority (opaque).
pub struct McAuthority {
    _opaque: [u8; 0],
}
/// A registered mechanism (opaque).
pub struct McMechanism {
    _opaque: [u8; 0],
}
/// A binding (opaque).
pub struct McBinding {
    _opaque: [u8; 0],
}
/// A live allocation (opaque).
pub struct McAllocation {
    _opaque: [u8; 0],
}
/// A loaded plugin library (opaque).
pub struct McPluginLibrary {
    _opaque: [u8; 0],
}
/// A deferred-release queue (opaque).
pub struct McQueue {
    _opaque: [u8; 0],
}

/// Called once with the user pointer given at registration, when the registry and
/// every handle made under it no longer need it; never with a lock held.
pub type McDestroyFn = Option<unsafe extern "C" fn(user: *mut c_void)>;

/// Built-in host allocators (`mc_register_cpu_allocator`).
pub type McCpuAllocator = u32;
/// The system allocator.
pub const MC_CPU_SYSTEM: McCpuAllocator = 0;
/// A caching pool over the system allocator.
pub const MC_CPU_POOLED: McCpuAllocator = 1;
/// Reserve address space, commit pages on demand.
pub const MC_CPU_VIRTUAL: McCpuAllocator = 2;
/// One physical backing mapped into several blocks.
pub const MC_CPU_SHARED: McCpuAllocator = 3;

/// Built-in CUDA allocators (`mc_register_cuda_allocator`).
pub type McCudaAllocator = u32;
/// `cuMemAlloc` / `cuMemFree`.
pub const MC_CUDA_EAGER: McCudaAllocator = 0;
/// A stream-ordered pool.
pub const MC_CUDA_POOL: McCudaAllocator = 1;
/// Virtual memory management (reserve, commit, map).
pub const MC_CUDA_VMM: McCudaAllocator = 2;

/// [`McReleaseReport::kind`]: everything was released.
pub const MC_RELEASE_COMPLETE: u32 = 0;
/// [`McReleaseReport::kind`]: part was released; the rest is quarantined in the registry.
pub const MC_RELEASE_QUARANTINED: u32 = 1;

/// What an accepted release did.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct McReleaseReport {
    /// `MC_RELEASE_COMPLETE` or `MC_RELEASE_QUARANTINED`.
    pub kind: u32,
    /// Zero.
    pub reserved: u32,
    /// Bytes unmapped or freed.
    pub unmapped_bytes: u64,
    /// Bytes still owned (quarantined only).
    pub residual_bytes: u64,
}

/// Where an allocation is.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct McAllocationInfo {
    /// Start address.
    pub address: u64,
    /// Usable bytes.
    pub bytes: u64,
    /// Alignment of the address.
    pub align: u64,
    /// The device (`MP_TIER_*` and index).
    pub device: memory_plugin_abi::MpDevice,
}

/// What `mc_invalidate_device` changed.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct McInvalidation {
    /// Mechanisms moved to device-lost.
    pub mechanisms: u64,
    /// Contexts moved to lost.
    pub contexts: u64,
    /// 1 if the device's selection was dropped.
    pub selection_dropped: u32,
    /// Zero.
    pub reserved: u32,
}

/// What `mc_confirm_terminated` retired.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct McTermination {
    /// 1 if the context was already terminated (an idempotent repeat).
    pub already_terminated: u32,
    /// Zero.
    pub reserved: u32,
    /// Mechanisms terminated with it.
    pub mechanisms: u64,
    /// Live allocations retired as lost.
    pub lost_allocations: u64,
    /// Their bytes.
    pub lost_bytes: u64,
    /// Quarantined allocations discharged.
    pub discharged_quarantine: u64,
}

/// Both sides' tallies of a plugin library (`mc_plugin_tally`).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct McPluginTallies {
    /// Instances the host holds.
    pub host_instances: u64,
    /// Blocks allocated through them and not released.
    pub host_allocations: u64,
    /// Their bytes.
    pub host_bytes: u64,
    /// Shared backings alive.
    pub host_backings: u64,
    /// Releases waiting in a plugin queue.
    pub host_queued_releases: u64,
    /// Blocks kept as suspect (never freed).
    pub host_suspect_blocks: u64,
    /// Other pins of the library.
    pub host_other_pins: u64,
    /// 1 if the plugin exports a tally (then `plugin` holds it).
    pub plugin_reported: u32,
    /// Zero.
    pub reserved: u32,
    /// What the plugin says it holds.
    pub plugin: memory_plugin_abi::MpTally,
}
