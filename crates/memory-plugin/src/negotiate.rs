//! Reading a plugin's table: major must match, minor negotiates down, the agreed
//! prefix is copied and nothing past it (or past the table's own size) is read.

use std::mem::MaybeUninit;

use memory_api::DeviceKey;
use memory_plugin_abi::{
    MP_ABI_MAJOR, MP_ABI_MINOR, MP_CAP_ALL, MP_CAP_DEFERRED_RELEASE, MP_CAP_SHARED_MAPPING, MP_CAP_VIRTUAL_BACKING,
    MP_TIER_DEVICE, MP_TIER_DISK, MP_TIER_HOST, MpAllocator, MpDevice, MpHeader, allocator_prefix_size,
};

use crate::error::PluginError;

/// A table the host has checked: the prefix of the negotiated minor, copied, with
/// everything past it zero (absent).
#[derive(Debug)]
pub(crate) struct Negotiated {
    pub(crate) table: MpAllocator,
    pub(crate) minor: u16,
    pub(crate) name: String,
    pub(crate) device: DeviceKey,
}

/// The longest name kept from a table (longer names are cut, not rejected).
const MAX_NAME: usize = 128;

/// Who made the instance a table carries, and so who frees it when the table is refused.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum InstanceOrigin {
    /// A plugin library's entry point made it for this host: a refused table's
    /// instance is destroyed here, since nobody else holds it.
    Entry,
    /// The caller made it and keeps it until a registration succeeds.
    Caller,
}

/// Reads and checks the table at `table`.
///
/// On a layout error (null, misaligned, wrong major, short) nothing of the table is
/// called, not even `destroy`: its layout is not known to be ours. On a content error
/// (a missing slot, an unoffered capability, an unknown device) an instance a plugin's
/// entry point made for us ([`InstanceOrigin::Entry`]) is destroyed through its
/// `destroy` slot before the error is returned; a caller's own table
/// ([`InstanceOrigin::Caller`]) is left as it was, the instance still the caller's.
///
/// # Safety
/// `table`, when non-null and aligned, points to readable memory of at least
/// `size_of::<MpHeader>()` bytes, and of at least the `struct_size` its header claims;
/// its `name`, when non-null, is NUL-terminated; its slots obey the ABI (memory-safe,
/// callable from any thread) and their code stays mapped while the result lives.
pub(crate) unsafe fn negotiate(
    table: *const MpAllocator,
    offered: u64,
    label: &str,
    origin: InstanceOrigin,
) -> Result<Negotiated, PluginError> {
    if table.is_null() || !table.is_aligned() {
        let found = if table.is_null() {
            "a null table".to_owned()
        } else {
            format!("{table:p}, which is not aligned to the {} bytes an MpAllocator needs,", align_of::<MpAllocator>())
        };
        return Err(PluginError::BadTable { plugin: label.to_owned(), found });
    }
    // SAFETY: non-null and aligned (checked); the caller guarantees a readable header.
    let header: MpHeader = unsafe { table.cast::<MpHeader>().read() };
    if header.abi_major != MP_ABI_MAJOR {
        return Err(PluginError::WrongMajor {
            plugin: label.to_owned(),
            found_major: header.abi_major,
            found_minor: header.abi_minor,
            expected_major: MP_ABI_MAJOR,
        });
    }
    let minor = header.abi_minor.min(MP_ABI_MINOR);
    let needed = allocator_prefix_size(minor).unwrap_or(memory_plugin_abi::MP_ALLOCATOR_SIZE_V1_1);
    if header.struct_size < needed {
        return Err(PluginError::ShortTable {
            plugin: label.to_owned(),
            size: header.struct_size,
            needed,
            major: MP_ABI_MAJOR,
            minor,
        });
    }
    let mut copy = MaybeUninit::<MpAllocator>::zeroed();
    // SAFETY: the source holds at least `needed` readable bytes (its struct_size, which
    // the caller guarantees, is at least `needed`); the destination is our own table,
    // whose size is at least every prefix size; the two do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(table.cast::<u8>(), copy.as_mut_ptr().cast::<u8>(), needed as usize) };
    // SAFETY: every field of MpAllocator (integers, raw pointers, optional function
    // pointers) is valid as all zeros, and the prefix copied holds values of those types.
    let table = unsafe { copy.assume_init() };
    // SAFETY: the caller guarantees a null or NUL-terminated name.
    let name = unsafe { read_name(table.name) }.unwrap_or_else(|| label.to_owned());
    match check_content(&table, offered, &name, minor) {
        Ok(device) => Ok(Negotiated { table, minor, name, device }),
        Err(error) => {
            if let (InstanceOrigin::Entry, Some(destroy)) = (origin, table.destroy) {
                // SAFETY: the layout is ours and the slot non-null; the instance was
                // handed to us and is destroyed exactly once, here, since no
                // `Negotiated` (which would own it) is built.
                unsafe { destroy(table.instance) };
            }
            Err(error)
        }
    }
}

/// # Safety
/// `name` is null or NUL-terminated.
unsafe fn read_name(name: *const std::ffi::c_char) -> Option<String> {
    if name.is_null() {
        return None;
    }
    // Scan at most MAX_NAME bytes: a name without a NUL there is cut, never read past.
    let mut bytes = Vec::with_capacity(MAX_NAME);
    for offset in 0..MAX_NAME {
        // SAFETY: the caller's guarantee: readable up to its NUL, and `offset` is at
        // most the NUL's position (the loop stops there).
        let at = unsafe { name.add(offset) };
        // SAFETY: as above, `at` is inside the NUL-terminated name.
        let byte = unsafe { at.cast::<u8>().read() };
        if byte == 0 {
            break;
        }
        bytes.push(byte);
    }
    let text = String::from_utf8_lossy(&bytes).into_owned();
    Some(text)
}

fn check_content(table: &MpAllocator, offered: u64, name: &str, minor: u16) -> Result<DeviceKey, PluginError> {
    let missing =
        |slot: &'static str, why: &'static str| PluginError::MissingSlot { plugin: name.to_owned(), slot, why };
    if table.allocate.is_none() {
        return Err(missing("allocate", "it is required"));
    }
    if table.release.is_none() {
        return Err(missing("release", "it is required"));
    }
    if table.destroy.is_none() {
        return Err(missing("destroy", "it is required"));
    }
    let claimed = table.capabilities;
    let unoffered = claimed & !(offered & MP_CAP_ALL);
    if unoffered != 0 {
        return Err(PluginError::UnofferedCapability { plugin: name.to_owned(), claimed: unoffered, offered });
    }
    // Every capability slot lies past a minor-0 table's prefix (not copied, never read),
    // so a capability that needs slots cannot be claimed there; MP_CAP_STRUCTURED_RELEASE
    // needs none (it shapes minor 0's own release).
    let with_slots = claimed & (MP_CAP_VIRTUAL_BACKING | MP_CAP_SHARED_MAPPING | MP_CAP_DEFERRED_RELEASE);
    if with_slots != 0 && minor == 0 {
        return Err(PluginError::CapabilitiesNeedNewerMinor {
            plugin: name.to_owned(),
            claimed: with_slots,
            minor,
            needed_minor: 1,
        });
    }
    if claimed & MP_CAP_VIRTUAL_BACKING != 0 {
        let why = "it claims MP_CAP_VIRTUAL_BACKING";
        if table.commit.is_none() {
            return Err(missing("commit", why));
        }
        if table.decommit.is_none() {
            return Err(missing("decommit", why));
        }
        if table.committed_bytes.is_none() {
            return Err(missing("committed_bytes", why));
        }
        check_granularity(name, "MP_CAP_VIRTUAL_BACKING", table.virtual_granularity)?;
    }
    if claimed & MP_CAP_SHARED_MAPPING != 0 {
        let why = "it claims MP_CAP_SHARED_MAPPING";
        if table.create_backing.is_none() {
            return Err(missing("create_backing", why));
        }
        if table.map.is_none() {
            return Err(missing("map", why));
        }
        if table.unmap.is_none() {
            return Err(missing("unmap", why));
        }
        if table.drop_backing.is_none() {
            return Err(missing("drop_backing", why));
        }
        check_granularity(name, "MP_CAP_SHARED_MAPPING", table.shared_granularity)?;
    }
    if claimed & MP_CAP_DEFERRED_RELEASE != 0 {
        let why = "it claims MP_CAP_DEFERRED_RELEASE";
        if table.defer_release.is_none() {
            return Err(missing("defer_release", why));
        }
        if table.poll_deferred.is_none() {
            return Err(missing("poll_deferred", why));
        }
    }
    device_key(table.device).ok_or(PluginError::InvalidDevice {
        plugin: name.to_owned(),
        tier: table.device.tier,
        index: table.device.index,
    })
}

fn check_granularity(name: &str, capability: &'static str, granularity: u64) -> Result<(), PluginError> {
    if granularity.is_power_of_two() && usize::try_from(granularity).is_ok() {
        Ok(())
    } else {
        Err(PluginError::InvalidGranularity { plugin: name.to_owned(), capability, granularity })
    }
}

/// The device key an ABI device names, or `None` for an unknown tier.
pub(crate) fn device_key(device: MpDevice) -> Option<DeviceKey> {
    match device.tier {
        MP_TIER_DEVICE => Some(DeviceKey::device(device.index)),
        MP_TIER_HOST => Some(DeviceKey::host(device.index)),
        MP_TIER_DISK => Some(DeviceKey::disk(device.index)),
        _ => None,
    }
}

/// The ABI device of a device key.
pub fn abi_device(device: DeviceKey) -> MpDevice {
    let tier = match device.tier() {
        memory_api::Tier::Device => MP_TIER_DEVICE,
        memory_api::Tier::Host => MP_TIER_HOST,
        memory_api::Tier::Disk => MP_TIER_DISK,
        // A tier added later has no ABI code yet: it matches no plugin device.
        _ => u32::MAX,
    };
    MpDevice { tier, index: device.index() }
}
