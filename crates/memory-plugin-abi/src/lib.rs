//! The versioned C ABI between the registry's loader and an allocator that lives in a
//! shared library (a "plugin"), and between a C runtime and the host C API when it
//! hands the registry an allocator vtable.
//!
//! Everything here is `#[repr(C)]` plain data and `extern "C"` function pointers; the
//! C header `include/memory_plugin.h` is generated from this file (cbindgen) and
//! checked in. The rules are in `docs/C-ABI.md`; in short:
//!
//! - Every table starts with an [`MpHeader`]: its size in bytes and the ABI version
//!   it was built for. The major version must match exactly ([`MP_ABI_MAJOR`]); the
//!   minor version negotiates down to what both sides know.
//! - Minor versions only append fields. A table of minor `m` must be at least
//!   `prefix_size(m)` bytes ([`MP_ALLOCATOR_SIZE_V1_0`], [`MP_ALLOCATOR_SIZE_V1_1`]);
//!   a shorter table is refused and never read past.
//! - Optional slots that are null are "unsupported" (the host returns a typed error),
//!   never a silent no-op. Capabilities ([`MP_CAP_VIRTUAL_BACKING`], ...) are bits a
//!   plugin may claim only if the host offered them in [`MpHost::offered_capabilities`].
//! - Status codes are plain `int32_t` values ([`MpStatus`]); a host treats a value it
//!   does not know as a fault of the plugin (quarantine), never as success.
//!
//! This crate has no dependencies and no `unsafe` code: it only names the layout.
//! Calling the slots is the loader's business (`memory-plugin`).
#![forbid(unsafe_code)]

use core::ffi::{c_char, c_void};

/// The ABI major version. A table or host of another major is refused.
pub const MP_ABI_MAJOR: u16 = 1;
/// The newest ABI minor version this crate describes.
pub const MP_ABI_MINOR: u16 = 1;

/// Size of an [`MpAllocator`] of minor 0: through the `destroy` slot.
pub const MP_ALLOCATOR_SIZE_V1_0: u32 = 64;
/// Size of an [`MpAllocator`] of minor 1: the whole table.
pub const MP_ALLOCATOR_SIZE_V1_1: u32 = 184;
/// Size of an [`MpHost`] of minor 0 and 1.
pub const MP_HOST_SIZE_V1_0: u32 = 48;

/// The symbol a plugin library exports: an [`MpEntryFn`].
pub const MP_ENTRY_SYMBOL: &str = "mp_plugin_entry";
/// The optional symbol a plugin library may export: an [`MpTallyFn`] that counts
/// what the whole library still holds (all instances together).
pub const MP_TALLY_SYMBOL: &str = "mp_plugin_tally";

/// A status code. Zero is success; see the `MP_ERR_*` constants.
pub type MpStatus = i32;
/// Success.
pub const MP_OK: MpStatus = 0;
/// The operation or slot is not supported (or was not negotiated).
pub const MP_ERR_UNSUPPORTED: MpStatus = 1;
/// Not enough memory; nothing was allocated or committed.
pub const MP_ERR_OUT_OF_MEMORY: MpStatus = 2;
/// A size, alignment, range or value is invalid; nothing was mutated.
pub const MP_ERR_INVALID_ARGUMENT: MpStatus = 3;
/// The block or backing was not made by this instance (or is already released).
pub const MP_ERR_NOT_OWNED: MpStatus = 4;
/// The device or its context is gone.
pub const MP_ERR_DEVICE_LOST: MpStatus = 5;
/// The other side's ABI major version is not this one.
pub const MP_ERR_VERSION_MISMATCH: MpStatus = 6;
/// A range lies outside the block.
pub const MP_ERR_OUT_OF_BOUNDS: MpStatus = 7;
/// A range is not a multiple of the granularity.
pub const MP_ERR_MISALIGNED: MpStatus = 8;
/// The target range is already mapped.
pub const MP_ERR_ALREADY_MAPPED: MpStatus = 9;
/// A deferral was refused (for example the plugin's queue is full); nothing was taken.
pub const MP_ERR_REFUSED: MpStatus = 10;
/// Any other failure of the backend; nothing was mutated.
pub const MP_ERR_BACKEND: MpStatus = 11;

/// [`MpDevice::tier`]: accelerator memory.
pub const MP_TIER_DEVICE: u32 = 0;
/// [`MpDevice::tier`]: host memory.
pub const MP_TIER_HOST: u32 = 1;
/// [`MpDevice::tier`]: disk-backed memory.
pub const MP_TIER_DISK: u32 = 2;

/// [`MpRequest::role`]: model weights.
pub const MP_ROLE_WEIGHTS: u32 = 0;
/// [`MpRequest::role`]: key/value cache.
pub const MP_ROLE_KV_CACHE: u32 = 1;
/// [`MpRequest::role`]: activations.
pub const MP_ROLE_ACTIVATIONS: u32 = 2;
/// [`MpRequest::role`]: kernel workspace.
pub const MP_ROLE_WORKSPACE: u32 = 3;
/// [`MpRequest::role`]: host staging buffers.
pub const MP_ROLE_STAGING: u32 = 4;
/// [`MpRequest::role`]: anything else.
pub const MP_ROLE_OTHER: u32 = 5;

/// Capability: reserve address space, commit and decommit ranges
/// (`commit`, `decommit`, `committed_bytes`, `virtual_granularity`).
pub const MP_CAP_VIRTUAL_BACKING: u64 = 1 << 0;
/// Capability: one physical backing mapped into several blocks
/// (`create_backing`, `map`, `unmap`, `drop_backing`, `shared_granularity`).
pub const MP_CAP_SHARED_MAPPING: u64 = 1 << 1;
/// Capability: deferred release (`defer_release`, `poll_deferred`).
pub const MP_CAP_DEFERRED_RELEASE: u64 = 1 << 2;
/// Capability: `release` fills an [`MpReleaseOutcome`] (complete, quarantined with
/// exact bytes, or failed) instead of answering with its status alone.
pub const MP_CAP_STRUCTURED_RELEASE: u64 = 1 << 3;
/// Every capability this ABI version defines.
pub const MP_CAP_ALL: u64 =
    MP_CAP_VIRTUAL_BACKING | MP_CAP_SHARED_MAPPING | MP_CAP_DEFERRED_RELEASE | MP_CAP_STRUCTURED_RELEASE;

/// [`MpReleaseOutcome::kind`]: everything was released.
pub const MP_RELEASE_COMPLETE: u32 = 0;
/// [`MpReleaseOutcome::kind`]: part was released; `residual_bytes` are still owned.
pub const MP_RELEASE_QUARANTINED: u32 = 1;
/// [`MpReleaseOutcome::kind`]: nothing was mutated; the block is still owned.
pub const MP_RELEASE_FAILED: u32 = 2;

/// [`MpMapAccess`]: read only.
pub const MP_ACCESS_READ_ONLY: u32 = 0;
/// [`MpMapAccess`]: read and write.
pub const MP_ACCESS_READ_WRITE: u32 = 1;
/// How a backing is mapped: `MP_ACCESS_*`.
pub type MpMapAccess = u32;

/// Log levels for [`MpHost::log`].
pub const MP_LOG_ERROR: i32 = 0;
/// Warning.
pub const MP_LOG_WARN: i32 = 1;
/// Information.
pub const MP_LOG_INFO: i32 = 2;
/// Debugging detail.
pub const MP_LOG_DEBUG: i32 = 3;

/// The first field of every table: how large the table is and which ABI it follows.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MpHeader {
    /// Size in bytes of the whole table, as its author built it (`sizeof`).
    pub struct_size: u32,
    /// ABI major version the table follows; must equal the reader's.
    pub abi_major: u16,
    /// ABI minor version the table follows; the reader uses the lower of both.
    pub abi_minor: u16,
}

/// A memory domain: a tier (`MP_TIER_*`) and an index inside it.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MpDevice {
    /// `MP_TIER_DEVICE`, `MP_TIER_HOST` or `MP_TIER_DISK`.
    pub tier: u32,
    /// GPU ordinal, NUMA node, ...
    pub index: u32,
}

/// An allocation request. `align` is a power of two; `bytes` rounded up to it fits
/// in `INT64_MAX` (the host checks both before calling).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MpRequest {
    /// Bytes asked for (zero allowed: the block must still be unique and releasable).
    pub bytes: u64,
    /// Alignment asked for.
    pub align: u64,
    /// What the memory is for (`MP_ROLE_*`).
    pub role: u32,
    /// Zero.
    pub reserved: u32,
}

/// One block as the plugin describes it. The host keeps the copy `allocate` wrote
/// and passes exactly that copy back to every later call about the block.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MpBlock {
    /// Start address (non-zero).
    pub address: u64,
    /// Usable bytes: at least what was asked for, all below 2^64 (`address + bytes`
    /// does not wrap around).
    pub bytes: u64,
    /// Alignment of `address` (a power of two, at least what was asked for).
    pub align: u64,
    /// The device the memory lives on (the instance's device).
    pub device: MpDevice,
    /// The plugin's private tag; the host never reads it.
    pub tag: u64,
}

/// The structured answer of `release` (with [`MP_CAP_STRUCTURED_RELEASE`]).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MpReleaseOutcome {
    /// `MP_RELEASE_COMPLETE`, `MP_RELEASE_QUARANTINED` or `MP_RELEASE_FAILED`.
    pub kind: u32,
    /// Zero.
    pub reserved: u32,
    /// Bytes of physical memory really unmapped or freed.
    pub unmapped_bytes: u64,
    /// Bytes still owned (quarantined only).
    pub residual_bytes: u64,
    /// The block this answer is about (must be the block given).
    pub block: MpBlock,
}

/// Counters an instance may report (`stats`). Fields it does not track stay zero.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MpStats {
    /// Bytes handed out.
    pub live_bytes: u64,
    /// Blocks handed out.
    pub live_allocations: u64,
    /// Bytes held but not handed out.
    pub cached_bytes: u64,
    /// Address space reserved.
    pub reserved_bytes: u64,
    /// Successful allocations since creation.
    pub allocations_total: u64,
    /// Failed allocations since creation.
    pub failures_total: u64,
}

/// What a plugin still holds: one instance (`tally`) or the whole library
/// ([`MpTallyFn`]). The host refuses to unload a library while any count is non-zero.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MpTally {
    /// Instances not yet destroyed (library tally only; an instance reports 1).
    pub instances: u64,
    /// Blocks allocated and not yet released.
    pub allocations: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Shared backings not yet dropped.
    pub backings: u64,
    /// Deferred releases accepted and not yet reported ready.
    pub deferred: u64,
}

/// A shared backing made by `create_backing`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MpBacking {
    /// The plugin's handle for it (never zero).
    pub handle: u64,
    /// Its size in bytes.
    pub bytes: u64,
}

/// Writes one log line: `message` is `length` bytes of UTF-8, not NUL-terminated.
/// May be called from any thread until the instance's `destroy` has returned.
pub type MpLogFn =
    Option<unsafe extern "C" fn(host_data: *mut c_void, level: i32, message: *const c_char, length: usize)>;

/// What the host tells a plugin when it asks for an instance. Valid only during the
/// [`MpEntryFn`] call; a plugin copies what it needs.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct MpHost {
    /// Size and version of this table as the host built it.
    pub header: MpHeader,
    /// Capabilities the host can use; a plugin claims a subset.
    pub offered_capabilities: u64,
    /// The configuration string the host was given for this instance: UTF-8,
    /// `config_length` bytes, followed by a NUL. Never null (empty when none).
    pub config: *const c_char,
    /// Length of `config` in bytes, without the NUL.
    pub config_length: usize,
    /// Passed back to `log` unchanged.
    pub host_data: *mut c_void,
    /// Where to send log lines (may be null: then do not log).
    pub log: MpLogFn,
}

/// Allocates a block for `request`; on `MP_OK` writes it to `out`.
pub type MpAllocateFn =
    Option<unsafe extern "C" fn(instance: *mut c_void, request: *const MpRequest, out: *mut MpBlock) -> MpStatus>;
/// Releases `block`. Without [`MP_CAP_STRUCTURED_RELEASE`] the status alone answers
/// (`MP_OK`: complete; an error: nothing mutated) and `out` must not be written; with
/// it, `MP_OK` means `out` holds the answer.
pub type MpReleaseFn =
    Option<unsafe extern "C" fn(instance: *mut c_void, block: *const MpBlock, out: *mut MpReleaseOutcome) -> MpStatus>;
/// Frees the instance. Called exactly once, after every other call has returned.
pub type MpDestroyFn = Option<unsafe extern "C" fn(instance: *mut c_void)>;
/// Fills `out` with what the instance still holds.
pub type MpInstanceTallyFn = Option<unsafe extern "C" fn(instance: *mut c_void, out: *mut MpTally) -> MpStatus>;
/// Fills `out` with counters.
pub type MpStatsFn = Option<unsafe extern "C" fn(instance: *mut c_void, out: *mut MpStats) -> MpStatus>;
/// Returns cached memory to the layer below; writes the bytes returned.
pub type MpTrimFn = Option<unsafe extern "C" fn(instance: *mut c_void, returned: *mut u64) -> MpStatus>;
/// Forgets a block lost with its device: drop the books, free nothing.
pub type MpForgetLostFn = Option<unsafe extern "C" fn(instance: *mut c_void, block: *const MpBlock) -> MpStatus>;
/// Commits or decommits `[offset, offset + length)` of `block`; writes the bytes
/// newly committed (commit) or really released (decommit).
pub type MpRangeFn = Option<
    unsafe extern "C" fn(
        instance: *mut c_void,
        block: *const MpBlock,
        offset: u64,
        length: u64,
        bytes: *mut u64,
    ) -> MpStatus,
>;
/// Writes the bytes of `block` currently committed.
pub type MpCommittedFn =
    Option<unsafe extern "C" fn(instance: *mut c_void, block: *const MpBlock, bytes: *mut u64) -> MpStatus>;
/// Creates a shared backing of `bytes` bytes.
pub type MpCreateBackingFn =
    Option<unsafe extern "C" fn(instance: *mut c_void, bytes: u64, out: *mut MpBacking) -> MpStatus>;
/// Maps `[backing_offset, backing_offset + length)` of `backing` at
/// `[target_offset, target_offset + length)` of `block`. Transactional.
pub type MpMapFn = Option<
    unsafe extern "C" fn(
        instance: *mut c_void,
        backing: u64,
        block: *const MpBlock,
        target_offset: u64,
        length: u64,
        backing_offset: u64,
        access: MpMapAccess,
    ) -> MpStatus,
>;
/// Drops the plugin's handle of a backing (called once, when the host's last
/// reference goes, after every mapping of it was unmapped or released).
pub type MpDropBackingFn = Option<unsafe extern "C" fn(instance: *mut c_void, backing: u64)>;
/// Accepts a deferred release of `bytes` bytes under the host's `ticket`: the plugin
/// reports the ticket from `poll_deferred` once the block may be released.
pub type MpDeferReleaseFn = Option<unsafe extern "C" fn(instance: *mut c_void, ticket: u64, bytes: u64) -> MpStatus>;
/// Writes up to `capacity` tickets that are ready to `ready` and their number to
/// `count`; each accepted ticket is reported exactly once.
pub type MpPollDeferredFn = Option<
    unsafe extern "C" fn(instance: *mut c_void, ready: *mut u64, capacity: usize, count: *mut usize) -> MpStatus,
>;

/// One allocator instance: its description and its slots. Built by the plugin,
/// which keeps it valid until the instance is destroyed; the host copies the prefix of
/// the negotiated minor right after the entry call returns; `instance` stays the
/// plugin's until `destroy`.
///
/// Slots up to `destroy` are minor 0 and required. Later slots are minor 1 and
/// optional (null: unsupported), except that a claimed capability requires its slots.
/// Every slot may be called from any thread, concurrently, until `destroy`.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct MpAllocator {
    /// Size and version of this table.
    pub header: MpHeader,
    /// Capabilities claimed (`MP_CAP_*`): a subset of what the host offered.
    pub capabilities: u64,
    /// The plugin's instance state, passed to every slot.
    pub instance: *mut c_void,
    /// NUL-terminated UTF-8 name for messages (null: "plugin"), valid as long as the
    /// table; the host copies at most 128 bytes of it.
    pub name: *const c_char,
    /// The device this instance serves.
    pub device: MpDevice,
    /// Required.
    pub allocate: MpAllocateFn,
    /// Required.
    pub release: MpReleaseFn,
    /// Required.
    pub destroy: MpDestroyFn,
    // ---- minor 1 ----
    /// Optional: what this instance holds.
    pub tally: MpInstanceTallyFn,
    /// Optional: counters.
    pub stats: MpStatsFn,
    /// Optional: trim caches.
    pub trim: MpTrimFn,
    /// Optional: forget blocks lost with their device.
    pub forget_lost: MpForgetLostFn,
    /// Commit granularity (a power of two) with `MP_CAP_VIRTUAL_BACKING`.
    pub virtual_granularity: u64,
    /// `MP_CAP_VIRTUAL_BACKING`.
    pub commit: MpRangeFn,
    /// `MP_CAP_VIRTUAL_BACKING`.
    pub decommit: MpRangeFn,
    /// `MP_CAP_VIRTUAL_BACKING`.
    pub committed_bytes: MpCommittedFn,
    /// Mapping granularity (a power of two) with `MP_CAP_SHARED_MAPPING`.
    pub shared_granularity: u64,
    /// `MP_CAP_SHARED_MAPPING`.
    pub create_backing: MpCreateBackingFn,
    /// `MP_CAP_SHARED_MAPPING`.
    pub map: MpMapFn,
    /// `MP_CAP_SHARED_MAPPING`: unmaps a range; writes the bytes really unmapped.
    pub unmap: MpRangeFn,
    /// `MP_CAP_SHARED_MAPPING`.
    pub drop_backing: MpDropBackingFn,
    /// `MP_CAP_DEFERRED_RELEASE`.
    pub defer_release: MpDeferReleaseFn,
    /// `MP_CAP_DEFERRED_RELEASE`.
    pub poll_deferred: MpPollDeferredFn,
}

/// The library's entry point ([`MP_ENTRY_SYMBOL`]): checks `host`, creates an
/// instance and writes a pointer to its table to `out`. The table (and its `name`)
/// must stay valid until the instance is destroyed; the host copies the agreed prefix
/// right after the call returns, and never runs two entry calls of one library at once
/// (a plugin may refill one static table per call). A plugin that does not speak the
/// host's major version returns `MP_ERR_VERSION_MISMATCH`.
pub type MpEntryFn = unsafe extern "C" fn(host: *const MpHost, out: *mut *const MpAllocator) -> MpStatus;

/// The library's optional tally ([`MP_TALLY_SYMBOL`]): what all its instances still hold.
pub type MpTallyFn = unsafe extern "C" fn(out: *mut MpTally) -> MpStatus;

/// Bytes of an [`MpAllocator`] of `minor` (the agreed prefix), or `None` for a minor
/// this crate does not describe.
pub const fn allocator_prefix_size(minor: u16) -> Option<u32> {
    match minor {
        0 => Some(MP_ALLOCATOR_SIZE_V1_0),
        1 => Some(MP_ALLOCATOR_SIZE_V1_1),
        _ => None,
    }
}

/// A readable name for a status code (for messages); `None` for an unknown code.
pub const fn status_name(status: MpStatus) -> Option<&'static str> {
    Some(match status {
        MP_OK => "MP_OK",
        MP_ERR_UNSUPPORTED => "MP_ERR_UNSUPPORTED",
        MP_ERR_OUT_OF_MEMORY => "MP_ERR_OUT_OF_MEMORY",
        MP_ERR_INVALID_ARGUMENT => "MP_ERR_INVALID_ARGUMENT",
        MP_ERR_NOT_OWNED => "MP_ERR_NOT_OWNED",
        MP_ERR_DEVICE_LOST => "MP_ERR_DEVICE_LOST",
        MP_ERR_VERSION_MISMATCH => "MP_ERR_VERSION_MISMATCH",
        MP_ERR_OUT_OF_BOUNDS => "MP_ERR_OUT_OF_BOUNDS",
        MP_ERR_MISALIGNED => "MP_ERR_MISALIGNED",
        MP_ERR_ALREADY_MAPPED => "MP_ERR_ALREADY_MAPPED",
        MP_ERR_REFUSED => "MP_ERR_REFUSED",
        MP_ERR_BACKEND => "MP_ERR_BACKEND",
        _ => return None,
    })
}

// The prefix sizes are the layout, not a guess: checked against the compiler's.
const _: () = assert!(core::mem::offset_of!(MpAllocator, tally) == MP_ALLOCATOR_SIZE_V1_0 as usize);
const _: () = assert!(core::mem::size_of::<MpAllocator>() == MP_ALLOCATOR_SIZE_V1_1 as usize);
const _: () = assert!(core::mem::size_of::<MpHost>() == MP_HOST_SIZE_V1_0 as usize);
const _: () = assert!(core::mem::size_of::<MpBlock>() == 40);
const _: () = assert!(core::mem::size_of::<MpReleaseOutcome>() == 64);
// Fixed-width fields only: the layout is the same on every 64-bit target.
const _: () = assert!(core::mem::size_of::<usize>() == 8, "the plugin ABI is defined for 64-bit targets");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_status_has_a_name_and_unknown_ones_do_not() {
        for status in MP_OK..=MP_ERR_BACKEND {
            assert!(status_name(status).is_some(), "{status}");
        }
        assert_eq!(status_name(-1), None);
        assert_eq!(status_name(MP_ERR_BACKEND + 1), None);
    }

    #[test]
    fn prefix_sizes_grow_with_the_minor_and_stop_at_the_newest() {
        assert_eq!(allocator_prefix_size(0), Some(MP_ALLOCATOR_SIZE_V1_0));
        assert_eq!(allocator_prefix_size(MP_ABI_MINOR), Some(MP_ALLOCATOR_SIZE_V1_1));
        const { assert!(MP_ALLOCATOR_SIZE_V1_0 < MP_ALLOCATOR_SIZE_V1_1) };
        assert_eq!(allocator_prefix_size(MP_ABI_MINOR + 1), None);
    }

    #[test]
    fn capability_bits_are_distinct() {
        let bits = [MP_CAP_VIRTUAL_BACKING, MP_CAP_SHARED_MAPPING, MP_CAP_DEFERRED_RELEASE, MP_CAP_STRUCTURED_RELEASE];
        assert_eq!(bits.iter().fold(0, |all, bit| all | bit), MP_CAP_ALL);
        assert_eq!(bits.iter().map(|bit| bit.count_ones()).sum::<u32>(), 4);
    }
}
