//! A server's own run options and I/O bindings compose with the adapter's
//! stop-on-refusal: the caller's tag and terminate keep working, a refusal stops the run
//! through the caller's options and leaves them reusable, and outputs bound ahead of a
//! run are allocated (and charged) through the governed table.

mod common;

use common::{Backing, Tenant, tiny_model};
use memory_governor::MemoryRole;
use memory_ort::OrtAdapterError;
use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};
use ort::session::RunOptions;
use ort::value::Tensor;

fn input(batch: usize) -> Tensor<f32> {
    let data: Vec<f32> = (0..batch * tiny_model::FEATURES).map(|i| (i % 7) as f32 / 7.0).collect();
    Tensor::from_array(([batch, tiny_model::FEATURES], data)).unwrap()
}

#[test]
fn the_callers_run_options_stop_a_refused_run_and_are_reusable_afterwards() {
    let name = "the_callers_run_options_stop_a_refused_run_and_are_reusable_afterwards";
    let Some((env, _)) = common::ort(name) else { return };
    let tenant = Tenant::new("options", 64 << 20, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_memory(&allocator, env.session_builder().unwrap(), &tiny_model::bytes()).unwrap();
    let options = RunOptions::new().unwrap().with_tag("request-17").unwrap();

    let outputs = session.run_with_options(ort::inputs![input(8)], &options).unwrap();
    assert_eq!(outputs[0].try_extract_tensor::<f32>().unwrap().1.len(), 8 * tiny_model::FEATURES);
    drop(outputs);

    let weights = tenant.charged_total();
    tenant.governor.set_quota(tenant.authority, weights + 1000).unwrap();
    let err = session.run_with_options(ort::inputs![input(512)], &options).map(|_| ()).unwrap_err();
    assert!(matches!(err, OrtAdapterError::Refused { action: "run", .. }), "{err}");
    assert_eq!(tenant.charged_total(), weights);
    assert_eq!(options.tag().unwrap(), "request-17", "the caller's options are untouched");

    // The refusal's terminate was cleared: the same options run again.
    tenant.governor.set_quota(tenant.authority, 64 << 20).unwrap();
    let outputs = session.run_with_options(ort::inputs![input(4)], &options).unwrap();
    assert_eq!(outputs[0].try_extract_tensor::<f32>().unwrap().1.len(), 4 * tiny_model::FEATURES);
    drop(outputs);

    // The caller's own terminate still stops a run, as ONNX Runtime reports it.
    options.terminate().unwrap();
    let err = session.run_with_options(ort::inputs![input(4)], &options).map(|_| ()).unwrap_err();
    assert!(matches!(err, OrtAdapterError::Runtime { action: "run", .. }), "{err}");
    options.unterminate().unwrap();
    assert!(session.run_with_options(ort::inputs![input(4)], &options).is_ok());
    drop(session);
    assert_eq!(tenant.charged_total(), 0);
}

#[test]
fn outputs_bound_ahead_of_a_run_are_allocated_through_the_governed_table() {
    let name = "outputs_bound_ahead_of_a_run_are_allocated_through_the_governed_table";
    let Some((env, _)) = common::ort(name) else { return };
    let tenant = Tenant::new("binding", 64 << 20, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_memory(&allocator, env.session_builder().unwrap(), &tiny_model::bytes()).unwrap();
    let mut binding = session.create_binding().unwrap();
    let batch = 64;
    binding.bind_input("X", &input(batch)).unwrap();
    let cpu = MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Device, MemoryType::Default).unwrap();
    binding.bind_output_to_device("Y", &cpu).unwrap();
    let allocs = session.stats().allocs;
    let outputs = session.run_binding(&mut binding).unwrap();
    let values = outputs["Y"].try_extract_tensor::<f32>().unwrap().1.to_vec();
    assert_eq!(values.len(), batch * tiny_model::FEATURES);
    assert!(allocator.stats().allocs > allocs, "the run allocated through the governed tables");
    assert!(tenant.charged(MemoryRole::Activations) >= (batch * tiny_model::FEATURES * 4) as u64);
    drop(outputs);
    drop(binding);

    // Refused under the caller's options: the binding's run fails with the reason, and
    // the stopped run's output buffers (overdraft, then sink) do not stay bound.
    let weights = tenant.charged(MemoryRole::Weights);
    let batch = 512;
    for overdraft_limit in [64 << 20, 0] {
        tenant.governor.set_overdraft_limit(tenant.device, overdraft_limit);
        tenant.governor.set_quota(tenant.authority, weights + 1000).unwrap();
        let mut binding = session.create_binding().unwrap();
        binding.bind_input("X", &input(batch)).unwrap();
        binding.bind_output_to_device("Y", &cpu).unwrap();
        let options = RunOptions::new().unwrap();
        let err = session.run_binding_with_options(&mut binding, &options).map(|_| ()).unwrap_err();
        assert!(matches!(err, OrtAdapterError::Refused { .. }), "{err}");
        assert_eq!(session.stats().overdraft_in_use, 0, "the refused run's outputs were unbound");
        let device = tenant.governor.snapshot().device(tenant.device).cloned().unwrap();
        assert_eq!(device.overdraft.current, 0);
        assert_eq!(tenant.charged_total(), weights);

        // Bound again under a quota that fits: the right values, charged as activations.
        tenant.governor.set_quota(tenant.authority, 64 << 20).unwrap();
        binding.bind_output_to_device("Y", &cpu).unwrap();
        let data: Vec<f32> = (0..batch * tiny_model::FEATURES).map(|i| (i % 7) as f32 / 7.0).collect();
        let outputs = session.run_binding(&mut binding).unwrap();
        let values = outputs["Y"].try_extract_tensor::<f32>().unwrap().1.to_vec();
        for (got, want) in values.iter().zip(tiny_model::reference(&data)) {
            assert!((got - want).abs() < 1e-4, "limit {overdraft_limit}: {got} vs {want}");
        }
        assert!(tenant.charged(MemoryRole::Activations) >= (batch * tiny_model::FEATURES * 4) as u64);
        drop(outputs);
    }
    drop(session);
    assert_eq!(tenant.charged_total(), 0);
}
