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
/// A physical backing to map into allocations of a shared-mapping mechanism (opaque).
pub struct McBacking {
    _opaque: [u8; 0],
}
/// A reclaim holder registered with a governor (opaque).
pub struct McReclaimHolder {
    _opaque: [u8; 0],
}
/// A recording of governed allocations to a trace file (opaque; `mc_recorder_create`).
pub struct McRecorder {
    _opaque: [u8; 0],
}

/// Called once with the user pointer given at registration, when the registry and
/// every handle made under it no longer need it; never with a lock held.
pub type McDestroyFn = Option<unsafe extern "C" fn(user: *mut c_void)>;

/// Built-in host allocators (`mc_register_cpu_allocator`).
pub type McCpuAllocator = u32;
/// The system allocator: an allocation is usable memory at once.
pub const MC_CPU_SYSTEM: McCpuAllocator = 0;
/// A caching pool over the system allocator: an allocation is usable memory at once.
pub const MC_CPU_POOLED: McCpuAllocator = 1;
/// Reserve address space, commit pages on demand: an allocation is an inaccessible
/// reservation until ranges of it are committed (`mc_virtual_commit`).
pub const MC_CPU_VIRTUAL: McCpuAllocator = 2;
/// One physical backing mapped into several blocks: an allocation is an inaccessible
/// reservation until a backing is mapped into ranges of it (`mc_shared_map`).
pub const MC_CPU_SHARED: McCpuAllocator = 3;

/// How a backing is mapped (`mc_shared_map`).
pub type McAccess = u32;
/// Reads only (a write faults).
pub const MC_ACCESS_READ_ONLY: McAccess = 0;
/// Reads and writes.
pub const MC_ACCESS_READ_WRITE: McAccess = 1;

/// A governor's admission policy for a device (`mc_governor_set_policy`).
pub type McPolicy = u32;
/// Refuse what does not fit (the default).
pub const MC_POLICY_HARD_LIMIT: McPolicy = 0;
/// Ask the device's reclaim holders for the bytes missing, then retry once.
pub const MC_POLICY_RECLAIM_THEN_FAIL: McPolicy = 1;

/// What a reclaim holder is asked for (`McReclaimFn`).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct McReclaimRequest {
    /// The device memory is needed on.
    pub device: memory_plugin_abi::MpDevice,
    /// Bytes still missing (freeing more is fine).
    pub bytes: u64,
    /// The role (`MP_ROLE_*`) of the request that is short.
    pub role: u32,
    /// Zero.
    pub reserved: u32,
}

/// Frees up to `request->bytes` (more is fine) and returns the bytes it freed. Called
/// from any thread, with no lock of the library held; it may release allocations
/// through this API. `request` is valid during the call.
pub type McReclaimFn = Option<unsafe extern "C" fn(user: *mut c_void, request: *const McReclaimRequest) -> u64>;

/// Estimates the bytes the holder could free on `device` now (for messages and
/// snapshots). Called from any thread, with no lock of the library held.
pub type McReclaimableFn = Option<unsafe extern "C" fn(user: *mut c_void, device: memory_plugin_abi::MpDevice) -> u64>;

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
    /// The bytes asked for with the built-in kinds; with a plugin or vtable the bytes
    /// its block reports (at least those asked for; what a governed mechanism charges).
    /// For `MC_CPU_SYSTEM`, `MC_CPU_POOLED`, `MC_CUDA_EAGER`, `MC_CUDA_POOL` and most
    /// plugins all of them are usable at once; for a virtual-backing or shared-mapping
    /// mechanism (`MC_CPU_VIRTUAL`, `MC_CPU_SHARED`, `MC_CUDA_VMM`) they are reserved
    /// address space, usable only where committed or mapped (docs/C-ABI.md §6).
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

/// What a suspect retry did (`mc_plugin_retry_suspects`, `mc_mechanism_retry_suspects`).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct McSuspectRetry {
    /// Suspect blocks the plugin took back or said it does not hold: no longer kept.
    pub discharged: u64,
    /// Suspect blocks still kept (each keeps its instance and the library loaded).
    pub still_suspect: u64,
}

impl From<memory_plugin::SuspectRetry> for McSuspectRetry {
    fn from(retry: memory_plugin::SuspectRetry) -> McSuspectRetry {
        McSuspectRetry { discharged: retry.discharged as u64, still_suspect: retry.still_suspect as u64 }
    }
}

/// A mark in a recording (`mc_recorder_mark`).
pub type McMark = u32;
/// A note: a phase of the workload, say.
pub const MC_MARK_NOTE: McMark = 0;
/// The device was lost (record it beside `mc_invalidate_device`).
pub const MC_MARK_DEVICE_LOST: McMark = 1;

/// What a finished recording wrote (`mc_recorder_finish`).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct McRecordingSummary {
    /// Events written (allocations, releases, refusals, failures, lost blocks, marks).
    pub events: u64,
    /// Records written (the end record included).
    pub records: u64,
    /// Bytes written (the file's size).
    pub bytes: u64,
    /// Events not recorded because they came after the recording was finished.
    pub dropped: u64,
    /// Times a recording thread found its ring full and wrote that ring out itself.
    pub waits: u64,
}

impl From<memory_trace::RecordingSummary> for McRecordingSummary {
    fn from(summary: memory_trace::RecordingSummary) -> McRecordingSummary {
        McRecordingSummary {
            events: summary.events,
            records: summary.records,
            bytes: summary.bytes,
            dropped: summary.dropped,
            waits: summary.waits,
        }
    }
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
    /// 1 if the plugin exports a tally (then `plugin` holds it; `plugin.instances` is
    /// `UINT64_MAX`, the rest 0, when its `mp_plugin_tally` failed: treated as busy).
    pub plugin_reported: u32,
    /// Zero.
    pub reserved: u32,
    /// What the plugin says it holds.
    pub plugin: memory_plugin_abi::MpTally,
}
