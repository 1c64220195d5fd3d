//! The books file, version 1: a `#[repr(C)]` array of 64-bit words, every one read and
//! written atomically by every process that maps it.
//!
//! | part | size | what it holds |
//! |------|------|---------------|
//! | header | 128 bytes | [`MAGIC`], [`VERSION`], the layout size in bytes, the table sizes, a check word over those six, the slot high-water mark, who created the file and when |
//! | devices | [`MAX_DEVICES`] × 128 bytes | per device: its key (0: free), the node limit (`u64::MAX`: none), a pressure counter |
//! | tenants | [`MAX_TENANTS`] × 128 bytes | per tenant of a device: its key (device entry and name length; 0: free), the node quota, a pressure counter, the name (at most [`TENANT_NAME_BYTES`] bytes of UTF-8) |
//! | slots | [`MAX_SLOTS`] × 1,536 bytes | per process: state and generation, a sequence word (odd while the owner changes its grants), pid, start time, boot id, pid namespace, uid, join time, the process's pidfs inode and the generation it was written for (see [`SLOT_PIDFD_INODE`]), the generation whose owner holds the slot's lease (see [`SLOT_LEASE_GENERATION`]); then per device the bytes granted, allocated and reserved, and per tenant the bytes granted and allocated |
//!
//! Words are native-endian (the file never leaves the node). The constants below give
//! the offsets so a tool can read the file without this crate; the crate checks the
//! header (magic, version, layout size, table sizes and the check word) before it maps
//! anything else.

// The file's words are std's atomics in every build: the loom models never map a file
// (they check the protocol on a table of their own), so the layout stays the file's.
#![allow(clippy::disallowed_types, reason = "the layout of the file, which no loom model maps")]

use std::mem::{offset_of, size_of};
use std::sync::atomic::AtomicU64;

/// The first word of every books file: `b"memnode\0"` read as a little-endian `u64`.
pub const MAGIC: u64 = u64::from_le_bytes(*b"memnode\0");
/// The layout version this crate reads and writes.
pub const VERSION: u64 = 1;
/// Devices the books can hold.
pub const MAX_DEVICES: usize = 16;
/// Tenants (over every device) the books can hold.
pub const MAX_TENANTS: usize = 64;
/// Processes (governors) that can hold a slot at once.
pub const MAX_SLOTS: usize = 64;
/// The longest tenant name, in bytes.
pub const TENANT_NAME_BYTES: usize = 48;

/// Slot states (the low byte of a slot's state word; the generation is above it).
pub const SLOT_FREE: u64 = 0;
/// A process is writing its identity (only while it holds the books' lock).
pub const SLOT_CLAIMING: u64 = 1;
/// Held by a process.
pub const SLOT_LIVE: u64 = 2;
/// A survivor is refunding it (only while it holds the books' lock).
pub const SLOT_REFUNDING: u64 = 3;

#[repr(C, align(128))]
pub(crate) struct Header {
    pub(crate) magic: AtomicU64,
    pub(crate) version: AtomicU64,
    pub(crate) layout_size: AtomicU64,
    pub(crate) max_devices: AtomicU64,
    pub(crate) max_tenants: AtomicU64,
    pub(crate) max_slots: AtomicU64,
    pub(crate) check: AtomicU64,
    /// One past the highest slot ever claimed: grants sum the slots below it.
    pub(crate) slots_hwm: AtomicU64,
    pub(crate) created_pid: AtomicU64,
    pub(crate) created_secs: AtomicU64,
    _reserved: [AtomicU64; 6],
}

#[repr(C, align(128))]
pub(crate) struct DeviceEntry {
    pub(crate) key: AtomicU64,
    pub(crate) limit: AtomicU64,
    pub(crate) pressure: AtomicU64,
    _reserved: [AtomicU64; 13],
}

#[repr(C, align(128))]
pub(crate) struct TenantEntry {
    pub(crate) key: AtomicU64,
    pub(crate) quota: AtomicU64,
    pub(crate) pressure: AtomicU64,
    pub(crate) name: [AtomicU64; TENANT_NAME_BYTES / 8],
    _reserved: [AtomicU64; 7],
}

#[repr(C, align(128))]
pub(crate) struct SlotEntry {
    pub(crate) state: AtomicU64,
    pub(crate) seq: AtomicU64,
    pub(crate) pid: AtomicU64,
    pub(crate) start_time: AtomicU64,
    pub(crate) boot: [AtomicU64; 2],
    pub(crate) pid_ns: AtomicU64,
    pub(crate) uid: AtomicU64,
    pub(crate) joined_secs: AtomicU64,
    /// The owner's pidfs inode (`fstat` of a pidfd: unique per process for the boot),
    /// valid only while `pidfd_generation` equals the state word's generation.
    pub(crate) pidfd_inode: AtomicU64,
    /// The generation of the claim that wrote `pidfd_inode` (0: none).
    pub(crate) pidfd_generation: AtomicU64,
    /// The generation of the claim whose owner holds the slot's lease file locked (0:
    /// none; see [`SLOT_LEASE_GENERATION`]).
    pub(crate) lease_generation: AtomicU64,
    _reserved: [AtomicU64; 4],
    pub(crate) device_grant: [AtomicU64; MAX_DEVICES],
    pub(crate) device_allocated: [AtomicU64; MAX_DEVICES],
    pub(crate) device_reserved: [AtomicU64; MAX_DEVICES],
    pub(crate) tenant_grant: [AtomicU64; MAX_TENANTS],
    pub(crate) tenant_allocated: [AtomicU64; MAX_TENANTS],
}

/// The whole file.
#[repr(C)]
pub(crate) struct Shared {
    pub(crate) header: Header,
    pub(crate) devices: [DeviceEntry; MAX_DEVICES],
    pub(crate) tenants: [TenantEntry; MAX_TENANTS],
    pub(crate) slots: [SlotEntry; MAX_SLOTS],
}

/// Bytes of a version-1 books file.
pub const LAYOUT_SIZE: usize = size_of::<Shared>();
/// Bytes of the header.
pub const HEADER_SIZE: usize = size_of::<Header>();
/// Offset of the header's version word.
pub const VERSION_OFFSET: usize = offset_of!(Header, version);
/// Offset of the header's layout-size word.
pub const LAYOUT_SIZE_OFFSET: usize = offset_of!(Header, layout_size);
/// Offset of the header's check word.
pub const CHECK_OFFSET: usize = offset_of!(Header, check);
/// Offset of the first slot.
pub const SLOTS_OFFSET: usize = offset_of!(Shared, slots);
/// Bytes of one slot.
pub const SLOT_SIZE: usize = size_of::<SlotEntry>();
/// Offset of a slot's state word, inside the slot.
pub const SLOT_STATE: usize = offset_of!(SlotEntry, state);
/// Offset of a slot's sequence word, inside the slot.
pub const SLOT_SEQ: usize = offset_of!(SlotEntry, seq);
/// Offset of a slot's pid word, inside the slot.
pub const SLOT_PID: usize = offset_of!(SlotEntry, pid);
/// Offset of a slot's start-time word (clock ticks after boot, field 22 of `/proc/PID/stat`), inside the slot.
pub const SLOT_START_TIME: usize = offset_of!(SlotEntry, start_time);
/// Offset of a slot's boot id (two words: `/proc/sys/kernel/random/boot_id`), inside the slot.
pub const SLOT_BOOT: usize = offset_of!(SlotEntry, boot);
/// Offset of a slot's pid-namespace word (the inode of `/proc/self/ns/pid`), inside the slot.
pub const SLOT_PID_NS: usize = offset_of!(SlotEntry, pid_ns);
/// Offset of a slot's uid word (the owner's uid), inside the slot.
pub const SLOT_UID: usize = offset_of!(SlotEntry, uid);
/// Offset of a slot's pidfs-inode word, inside the slot: the inode of a pidfd of its owner
/// (Linux 6.9 and later give every process of a boot its own), 0 where the kernel has no
/// pidfs. A start time counts clock ticks (10 ms), so a pid reused within one tick
/// cannot be told from the original by it; the inode can. It names the owner only while
/// the word at [`SLOT_PIDFD_GENERATION`] equals the generation in the slot's state word
/// (a process of an older build of this version writes neither word).
pub const SLOT_PIDFD_INODE: usize = offset_of!(SlotEntry, pidfd_inode);
/// Offset of the generation the slot's pidfs inode was written for, inside the slot.
pub const SLOT_PIDFD_GENERATION: usize = offset_of!(SlotEntry, pidfd_generation);
/// Offset of the generation of the claim whose owner holds the slot's lease, inside the
/// slot. The lease is the file `.<books name>.<books inode>.slot-<slot>.lease` beside the books, which
/// the owner holds `flock`ed for as long as it holds the slot (the kernel drops the lock
/// when the process dies): a survivor of another pid namespace, which cannot judge the
/// owner's pid, takes a lease it can lock as its owner's death.
pub const SLOT_LEASE_GENERATION: usize = offset_of!(SlotEntry, lease_generation);
/// Offset of a slot's per-device grants, inside the slot (one word per device entry).
pub const SLOT_DEVICE_GRANT: usize = offset_of!(SlotEntry, device_grant);
/// Offset of a slot's per-tenant grants, inside the slot (one word per tenant entry).
pub const SLOT_TENANT_GRANT: usize = offset_of!(SlotEntry, tenant_grant);

/// Offset in the file of `slot`'s word at `field` (one of the `SLOT_*` offsets).
pub const fn slot_offset(slot: usize, field: usize) -> usize {
    SLOTS_OFFSET + slot * SLOT_SIZE + field
}

/// The check word over the header's first six words.
pub(crate) fn check_word(words: [u64; 6]) -> u64 {
    // FNV-1a over the words' bytes: catches a scribbled header, not a forger (the file's
    // mode is the boundary; see the crate docs).
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for word in words {
        for byte in word.to_le_bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash
}

/// The six header words this build writes.
pub(crate) fn header_words() -> [u64; 6] {
    [MAGIC, VERSION, LAYOUT_SIZE as u64, MAX_DEVICES as u64, MAX_TENANTS as u64, MAX_SLOTS as u64]
}

const _: () = assert!(SLOT_SIZE == 1536);
const _: () = assert!(HEADER_SIZE == 128);
const _: () = assert!(LAYOUT_SIZE.is_multiple_of(128));
