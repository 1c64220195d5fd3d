//! The allocator ONNX Runtime calls outlives every caller, and no longer: handles,
//! sessions and output tensors dropped in every order. Plus the C table itself:
//! `GetStats` through ONNX Runtime's key/value pairs, and a panic inside an entry.

mod common;

use std::ffi::{CStr, CString};
use std::sync::Arc;

use allocator_cpu::SystemAllocator;
use common::{Backing, Tenant, tiny_model};
use memory_governor::DeviceAllocator;
use memory_testkit::{Callback, FaultyAllocator};
use ort::value::Tensor;

fn run_tiny(session: &mut memory_ort::GovernedSession, batch: usize) -> ort::value::DynValue {
    let data = vec![0.25f32; batch * tiny_model::FEATURES];
    let mut outputs =
        session.run(ort::inputs![Tensor::from_array(([batch, tiny_model::FEATURES], data)).unwrap()]).unwrap();
    outputs.remove("Y").unwrap()
}

#[test]
fn the_allocator_outlives_its_handle_while_a_session_and_an_output_still_use_it() {
    let name = "the_allocator_outlives_its_handle_while_a_session_and_an_output_still_use_it";
    let Some((env, _)) = common::ort(name) else { return };
    let tenant = Tenant::new("owners", 64 << 20, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let watch = allocator.watch();
    let mut session = env.commit_from_memory(&allocator, env.session_builder().unwrap(), &tiny_model::bytes()).unwrap();
    drop(allocator);
    assert!(watch.is_alive(), "the session keeps the allocator");

    // An output taken out of the run outlives the session.
    let output = run_tiny(&mut session, 8);
    drop(session);
    assert!(watch.is_alive(), "the output's block keeps the allocator");
    assert!(tenant.charged_total() > 0, "the output is still booked");
    assert_eq!(output.try_extract_tensor::<f32>().unwrap().1.len(), 8 * tiny_model::FEATURES);
    drop(output);
    assert!(!watch.is_alive(), "freed once the last user is gone, not leaked");
    assert_eq!(tenant.charged_total(), 0);
    assert_eq!(tenant.registry_live(), (0, 0));
}

#[test]
fn the_environment_keeps_no_count_after_a_commit_and_a_failed_commit_keeps_none_either() {
    let name = "the_environment_keeps_no_count_after_a_commit_and_a_failed_commit_keeps_none_either";
    let Some((env, _)) = common::ort(name) else { return };
    let tenant = Tenant::new("counts", 64 << 20, Backing::Pooled);
    let allocator = tenant.allocator(env);
    assert_eq!(allocator.owners(), 1);
    let session = env.commit_from_memory(&allocator, env.session_builder().unwrap(), &tiny_model::bytes()).unwrap();
    // This handle, the session's clone, and the session's own table (which the session's
    // logger and its live blocks keep alive in turn).
    assert!(allocator.live_blocks() > 0);
    assert_eq!(allocator.owners(), 3);
    drop(session);
    assert_eq!(allocator.owners(), 1);
    assert!(env.commit_from_memory(&allocator, env.session_builder().unwrap(), b"not a model").is_err());
    assert_eq!(allocator.owners(), 1);
    // A second allocator for the same memory info can be committed right after: the
    // first was unregistered.
    let other = Tenant::new("counts-2", 64 << 20, Backing::Pooled).allocator(env);
    let session = env.commit_from_memory(&other, env.session_builder().unwrap(), &tiny_model::bytes()).unwrap();
    drop(session);
}

#[test]
fn get_stats_through_the_c_table_reports_limit_use_totals_peak_and_counts() {
    let name = "get_stats_through_the_c_table_reports_limit_use_totals_peak_and_counts";
    let Some((env, _)) = common::ort(name) else { return };
    let tenant = Tenant::new("stats", 64 << 20, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_memory(&allocator, env.session_builder().unwrap(), &tiny_model::bytes()).unwrap();
    let held = run_tiny(&mut session, 16);

    let this = allocator.as_ort_allocator();
    let mut pairs = std::ptr::null_mut();
    // SAFETY: the table is alive while the handle is held, and only read.
    let get_stats = unsafe { &*this }.GetStats.expect("the adapter implements GetStats");
    // SAFETY: the entry belongs to this live table; `pairs` is a valid out-pointer.
    let status = unsafe { get_stats(this, &mut pairs) };
    assert!(status.0.is_null(), "GetStats failed");
    let read = |key: &str| -> u64 {
        let key = CString::new(key).unwrap();
        // SAFETY: `pairs` was created by ONNX Runtime for us and is released below;
        // the returned value is a NUL-terminated string owned by the pairs.
        let value = unsafe { (ort::api().GetKeyValue)(pairs, key.as_ptr()) };
        assert!(!value.is_null(), "missing key {key:?}");
        // SAFETY: non-null, NUL-terminated, alive while `pairs` is.
        unsafe { CStr::from_ptr(value) }.to_str().unwrap().parse().unwrap()
    };
    let stats = allocator.stats();
    assert_eq!(read("Limit"), 64 << 20);
    assert_eq!(read("InUse"), stats.in_use);
    assert_eq!(read("RuntimeHeld"), stats.runtime_held);
    assert_eq!(read("InUse") + read("RuntimeHeld"), tenant.charged_total(), "blocks and onnx runtime's own, booked");
    assert_eq!(read("TotalAllocated"), stats.total_allocated);
    assert!(read("MaxInUse") >= read("InUse"));
    assert!(read("NumAllocs") > 0 && read("NumReserves") > 0);
    assert_eq!(read("NumReserves"), stats.reserves);
    // SAFETY: created by ONNX Runtime for this call, released once.
    unsafe { (ort::api().ReleaseKeyValuePairs)(pairs) };
    drop(held);
}

#[test]
fn a_panic_inside_the_allocator_answers_null_and_the_process_lives_on() {
    let name = "a_panic_inside_the_allocator_answers_null_and_the_process_lives_on";
    let Some((env, _)) = common::ort(name) else { return };
    let faulty = Arc::new(FaultyAllocator::new(SystemAllocator::new()));
    let inner: Arc<dyn DeviceAllocator> = faulty.clone();
    let tenant = Tenant::new("panicky", 64 << 20, Backing::Custom(inner));
    let allocator = tenant.allocator(env);
    faulty.panic_on_nth(Callback::Allocate, 1);
    assert!(common::table_alloc(&allocator, 4096, false).is_null(), "a panic is answered with null");
    let block = common::table_alloc(&allocator, 4096, false);
    assert!(!block.is_null(), "the next request is served");
    common::table_free(&allocator, block);
    assert_eq!(tenant.charged_total(), 0);
    // A pointer the adapter never handed out is ignored, counted, and frees nothing.
    let mut foreign = [0u8; 64];
    common::table_free(&allocator, foreign.as_mut_ptr().cast());
    assert_eq!(allocator.stats().unknown_frees, 1);
}

#[test]
fn a_block_of_the_handles_own_table_holds_termination_until_it_is_freed() {
    let name = "a_block_of_the_handles_own_table_holds_termination_until_it_is_freed";
    let Some((env, _)) = common::ort(name) else { return };
    let tenant = Tenant::new("direct", 64 << 20, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let block = common::table_alloc(&allocator, 4096, false);
    assert!(!block.is_null());
    tenant.registry.invalidate_device(tenant.device, "lost while a caller holds a block");
    let not_yet = tenant.registry.confirm_context_terminated(&tenant.context).unwrap_err();
    assert!(
        matches!(not_yet, memory_governor::RegistryError::ContextNotQuiescent { holds: 1, .. }),
        "the caller may still free its block: {not_yet}"
    );
    common::table_free(&allocator, block);
    assert_eq!(allocator.stats().frees_after_loss, 1);
    let report = tenant.registry.confirm_context_terminated(&tenant.context).unwrap();
    assert_eq!(report.lost_allocations, 1);
    assert_eq!(tenant.charged_total(), 0);
}

/// An output and an I/O binding both keep ONNX Runtime's session (so its table) past
/// the governed session's drop; after a device loss, termination waits for the last of
/// them, since either can still call `Free`.
#[test]
fn termination_waits_for_an_output_and_an_io_binding_that_outlive_their_session() {
    let name = "termination_waits_for_an_output_and_an_io_binding_that_outlive_their_session";
    let Some((env, _)) = common::ort(name) else { return };
    let tenant = Tenant::new("outliving", 64 << 20, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_memory(&allocator, env.session_builder().unwrap(), &tiny_model::bytes()).unwrap();
    let output = run_tiny(&mut session, 8);
    let mut binding = session.create_binding().unwrap();
    let input = Tensor::from_array(([4usize, tiny_model::FEATURES], vec![0.5f32; 4 * tiny_model::FEATURES])).unwrap();
    binding.bind_input("X", &input).unwrap();
    let cpu = ort::memory::MemoryInfo::new(
        ort::memory::AllocationDevice::CPU,
        0,
        ort::memory::AllocatorType::Device,
        ort::memory::MemoryType::Default,
    )
    .unwrap();
    binding.bind_output_to_device("Y", &cpu).unwrap();
    drop(session.run_binding(&mut binding).unwrap());
    drop(session);
    tenant.registry.invalidate_device(tenant.device, "lost while an output and a binding live on");
    let not_quiescent = |what: &str| {
        let not_yet = tenant.registry.confirm_context_terminated(&tenant.context).unwrap_err();
        assert!(
            matches!(not_yet, memory_governor::RegistryError::ContextNotQuiescent { holds: 1, .. }),
            "{what} can still free: {not_yet}"
        );
    };
    not_quiescent("the output and the binding");
    assert_eq!(output.try_extract_tensor::<f32>().unwrap().1.len(), 8 * tiny_model::FEATURES);
    drop(output);
    not_quiescent("the binding");
    drop(binding);
    assert!(allocator.stats().frees_after_loss > 0, "{:?}", allocator.stats());
    let report = tenant.registry.confirm_context_terminated(&tenant.context).unwrap();
    assert!(report.lost_allocations > 0, "{report:?}");
    assert_eq!(tenant.charged_total(), 0);
}
