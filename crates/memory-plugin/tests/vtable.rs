//! A caller's own vtable (`PluginAllocator::from_table`): who owns the instance when a
//! table is refused, and when a refused registration hands it back (`relinquish`).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use memory_api::{AllocationRequest, DeviceAllocator};
use memory_plugin::PluginAllocator;
use memory_plugin_abi::{
    MP_ABI_MAJOR, MP_ABI_MINOR, MP_CAP_ALL, MP_CAP_STRUCTURED_RELEASE, MP_OK, MP_RELEASE_COMPLETE, MP_TIER_HOST,
    MpAllocator, MpBlock, MpDevice, MpHeader, MpReleaseOutcome, MpRequest, MpStatus,
};

const DEVICE: MpDevice = MpDevice { tier: MP_TIER_HOST, index: 5 };

/// The caller's instance: counts the calls its slots see, and lies when told to.
#[derive(Default)]
struct Instance {
    allocated: AtomicU64,
    released: AtomicU64,
    destroyed: AtomicU64,
    /// Declares an alignment its address does not have.
    misalign: AtomicBool,
    /// Declares less alignment than was asked for.
    underalign: AtomicBool,
    /// Answers a structured `Complete` for ten times the block.
    overclaim: AtomicBool,
}

/// # Safety
/// `instance` is an `Instance`; `request` and `out` are valid.
unsafe extern "C" fn allocate(instance: *mut c_void, request: *const MpRequest, out: *mut MpBlock) -> MpStatus {
    // SAFETY: the table below passes its own `Instance`.
    let instance = unsafe { &*instance.cast::<Instance>() };
    let serial = instance.allocated.fetch_add(1, Ordering::Relaxed) + 1;
    // SAFETY: the host passes a valid request.
    let request = unsafe { *request };
    let mut block =
        MpBlock { address: serial << 20, bytes: request.bytes, align: 1 << 20, device: DEVICE, tag: serial };
    if instance.misalign.load(Ordering::Relaxed) {
        block.address += 64;
    }
    if instance.underalign.load(Ordering::Relaxed) {
        block.align = request.align / 2;
    }
    // SAFETY: the host passes a writable block.
    unsafe { out.write(block) };
    MP_OK
}

/// # Safety
/// `instance` is an `Instance`; `block` is valid; `out` is writable.
unsafe extern "C" fn release(instance: *mut c_void, block: *const MpBlock, out: *mut MpReleaseOutcome) -> MpStatus {
    // SAFETY: the table below passes its own `Instance`.
    let instance = unsafe { &*instance.cast::<Instance>() };
    instance.released.fetch_add(1, Ordering::Relaxed);
    // SAFETY: the host passes a valid block.
    let block = unsafe { *block };
    let claimed = if instance.overclaim.load(Ordering::Relaxed) { block.bytes * 10 } else { block.bytes };
    let answer =
        MpReleaseOutcome { kind: MP_RELEASE_COMPLETE, reserved: 0, unmapped_bytes: claimed, residual_bytes: 0, block };
    // SAFETY: with MP_CAP_STRUCTURED_RELEASE claimed, the host passes a writable outcome.
    unsafe { out.write(answer) };
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
    table.capabilities = MP_CAP_STRUCTURED_RELEASE;
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

#[test]
fn a_block_without_the_alignment_it_declares_or_was_asked_is_refused_and_given_back() {
    let instance = Instance::default();
    let plugin = negotiate(&table(&instance)).expect("the table is accepted");
    let request = AllocationRequest::new(256, 4096).unwrap();
    for lie in [&instance.misalign, &instance.underalign] {
        lie.store(true, Ordering::Relaxed);
        let released = instance.released.load(Ordering::Relaxed);
        let error = plugin.allocate(&request).expect_err("an unaligned block is refused");
        assert!(error.to_string().contains("handed back"), "{error}");
        assert_eq!(instance.released.load(Ordering::Relaxed), released + 1, "the block went back to the plugin");
        lie.store(false, Ordering::Relaxed);
    }
    assert_eq!(plugin.host_tally().allocations, 0, "no refused block is recorded");
    let honest = plugin.allocate(&request).expect("an honest block is taken");
    assert!(plugin.release(honest).is_complete());
}

#[test]
fn a_complete_release_never_claims_more_than_the_block() {
    let instance = Instance::default();
    instance.overclaim.store(true, Ordering::Relaxed);
    let plugin = negotiate(&table(&instance)).expect("the table is accepted");
    let block = plugin.allocate(&AllocationRequest::new(1000, 8).unwrap()).expect("allocate");
    let summary = plugin.release(block).summary();
    assert_eq!(summary, memory_api::ReleaseSummary::Complete { unmapped_bytes: 1000 });
}
