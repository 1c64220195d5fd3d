//! A caller's own vtable (`PluginAllocator::from_table`): who owns the instance when a
//! table is refused, and when a refused registration hands it back (`relinquish`).

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use memory_api::{AllocationRequest, DeviceAllocator};
use memory_plugin::PluginAllocator;
use memory_plugin_abi::{
    MP_ABI_MAJOR, MP_ABI_MINOR, MP_CAP_ALL, MP_OK, MP_TIER_HOST, MpAllocator, MpBlock, MpDevice, MpHeader,
    MpReleaseOutcome, MpRequest, MpStatus,
};

const DEVICE: MpDevice = MpDevice { tier: MP_TIER_HOST, index: 5 };

/// The caller's instance: counts the calls its slots see.
#[derive(Default)]
struct Instance {
    allocated: AtomicU64,
    destroyed: AtomicU64,
}

/// # Safety
/// `instance` is an `Instance`; `request` and `out` are valid.
unsafe extern "C" fn allocate(instance: *mut c_void, request: *const MpRequest, out: *mut MpBlock) -> MpStatus {
    // SAFETY: the table below passes its own `Instance`.
    let instance = unsafe { &*instance.cast::<Instance>() };
    let serial = instance.allocated.fetch_add(1, Ordering::Relaxed) + 1;
    // SAFETY: the host passes a valid request.
    let request = unsafe { *request };
    let block = MpBlock { address: serial << 20, bytes: request.bytes, align: 1 << 20, device: DEVICE, tag: serial };
    // SAFETY: the host passes a writable block.
    unsafe { out.write(block) };
    MP_OK
}

unsafe extern "C" fn release(_instance: *mut c_void, _block: *const MpBlock, _out: *mut MpReleaseOutcome) -> MpStatus {
    MP_OK
}

/// # Safety
/// `instance` is an `Instance`.
unsafe extern "C" fn destroy(instance: *mut c_void) {
    // SAFETY: the table below passes its own `Instance`.
    unsafe { &*instance.cast::<Instance>() }.destroyed.fetch_add(1, Ordering::Relaxed);
}

fn table(instance: &Instance) -> MpAllocator {
    // SAFETY: every field of the table (integers, raw pointers, optional function
    // pointers) is valid as all zeros: no optional slot, no capability.
    let mut table: MpAllocator = unsafe { std::mem::zeroed() };
    table.header =
        MpHeader { struct_size: size_of::<MpAllocator>() as u32, abi_major: MP_ABI_MAJOR, abi_minor: MP_ABI_MINOR };
    table.instance = std::ptr::from_ref(instance).cast_mut().cast();
    table.name = c"rust-vtable".as_ptr();
    table.device = DEVICE;
    table.allocate = Some(allocate);
    table.release = Some(release);
    table.destroy = Some(destroy);
    table
}

fn negotiate(table: &MpAllocator) -> Result<PluginAllocator, memory_plugin::PluginError> {
    // SAFETY: a whole, aligned table whose slots obey the ABI and outlive the result.
    unsafe { PluginAllocator::from_table(table, MP_CAP_ALL) }
}

#[test]
fn a_refused_caller_table_is_not_destroyed() {
    let instance = Instance::default();
    let mut refused = table(&instance);
    refused.allocate = None;
    assert!(negotiate(&refused).is_err());
    assert_eq!(instance.destroyed.load(Ordering::Relaxed), 0, "the caller still owns a refused instance");
}

#[test]
fn relinquish_hands_the_instance_back_only_from_its_last_idle_clone() {
    let instance = Instance::default();
    let plugin = negotiate(&table(&instance)).expect("the table is accepted");

    // Another clone alive: the allocator comes back, nothing is destroyed.
    let clone = plugin.clone();
    let plugin = plugin.relinquish().expect_err("a clone is alive");
    drop(clone);

    // A live block: the same.
    let block = plugin.allocate(&AllocationRequest::new(64, 8).unwrap()).expect("allocate");
    let plugin = plugin.relinquish().expect_err("a block is live");
    assert!(plugin.release(block).is_complete());
    assert_eq!(instance.destroyed.load(Ordering::Relaxed), 0);

    // The last idle clone: handed back without `destroy`.
    plugin.relinquish().expect("the last idle clone hands the instance back");
    assert_eq!(instance.destroyed.load(Ordering::Relaxed), 0, "relinquish never calls destroy");
}

#[test]
fn an_accepted_table_is_destroyed_once_when_its_last_clone_drops() {
    let instance = Instance::default();
    let plugin = negotiate(&table(&instance)).expect("the table is accepted");
    let clone = plugin.clone();
    drop(plugin);
    assert_eq!(instance.destroyed.load(Ordering::Relaxed), 0);
    drop(clone);
    assert_eq!(instance.destroyed.load(Ordering::Relaxed), 1);
}
