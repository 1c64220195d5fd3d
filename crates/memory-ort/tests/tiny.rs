//! Fast tests on the tiny model generated in `common/tiny_model.rs`.

mod common;

use common::{Backing, Tenant, tiny_model};
use memory_governor::MemoryRole;
use ort::value::Tensor;

fn input(batch: usize) -> Vec<f32> {
    (0..batch * tiny_model::FEATURES).map(|i| ((i % 13) as f32 - 6.0) / 7.0).collect()
}

#[test]
fn tiny_model_runs_on_governed_memory_with_weights_and_activations_charged_apart() {
    let Some((env, _)) = common::ort("tiny_model_runs_on_governed_memory_with_weights_and_activations_charged_apart")
    else {
        return;
    };
    let tenant = Tenant::new("tiny", 64 << 20, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_memory(&allocator, env.session_builder().unwrap(), &tiny_model::bytes()).unwrap();

    // The initializers were reserved and charged to weights.
    let weights = tenant.charged(MemoryRole::Weights);
    assert!(weights >= (tiny_model::FEATURES * tiny_model::FEATURES * 4) as u64, "weights charged: {weights}");
    assert!(allocator.stats().reserves > 0, "{:?}", allocator.stats());

    let batch = 32;
    let data = input(batch);
    let outputs =
        session.run(ort::inputs![Tensor::from_array(([batch, tiny_model::FEATURES], data.clone())).unwrap()]).unwrap();
    let (_, values) = outputs[0].try_extract_tensor::<f32>().unwrap();
    let expected = tiny_model::reference(&data);
    for (got, want) in values.iter().zip(&expected) {
        assert!((got - want).abs() < 1e-4, "{got} vs {want}");
    }
    // The output is held: activations are charged while it lives.
    assert!(tenant.charged(MemoryRole::Activations) >= (batch * tiny_model::FEATURES * 4) as u64);
    let runtime = allocator.stats().runtime_held;
    assert_eq!(tenant.registry_live().0 as u64 + runtime, tenant.charged_total(), "registry and governor agree");
    drop(outputs);
    assert_eq!(tenant.charged(MemoryRole::Activations), 0, "run memory refunded once the outputs are gone");
    assert!(allocator.stats().allocs > 0);

    drop(session);
    assert_eq!(tenant.charged_total(), 0, "everything refunded when the session drops");
    assert_eq!(tenant.registry_live(), (0, 0));
    assert_eq!(allocator.live_blocks(), 0);
}

#[test]
fn a_refusal_in_the_last_kernel_of_a_run_discards_its_outputs_and_names_the_governors_reason() {
    let name = "a_refusal_in_the_last_kernel_of_a_run_discards_its_outputs_and_names_the_governors_reason";
    let Some((env, _)) = common::ort(name) else { return };
    let tenant = Tenant::new("tight", 64 << 20, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_memory(&allocator, env.session_builder().unwrap(), &tiny_model::bytes()).unwrap();
    let weights = tenant.charged_total();
    // Room for nothing of a 512-row batch: the first activation is refused. ONNX Runtime
    // would crash on a null there; the adapter serves the overdraft and stops the run.
    tenant.governor.set_quota(tenant.authority, weights + 1000).unwrap();
    let batch = 512;
    let data = input(batch);
    let err = session
        .run(ort::inputs![Tensor::from_array(([batch, tiny_model::FEATURES], data)).unwrap()])
        .map(|_| ())
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, memory_ort::OrtAdapterError::Refused { action: "run", .. }), "{text}");
    assert!(text.contains("authority quota"), "{text}");
    let stats = allocator.stats();
    assert!(stats.overdraft_blocks > 0 && stats.refusals > 0, "{stats:?}");
    assert_eq!(tenant.charged_total(), weights, "nothing of the failed run stays booked");
    assert_eq!(allocator.live_blocks(), tenant.registry_live().1, "no overdraft block outlives the run");

    // Within the quota again, the same session runs.
    tenant.governor.set_quota(tenant.authority, 64 << 20).unwrap();
    let data = input(4);
    let outputs = session.run(ort::inputs![Tensor::from_array(([4, tiny_model::FEATURES], data)).unwrap()]).unwrap();
    assert_eq!(outputs[0].try_extract_tensor::<f32>().unwrap().1.len(), 4 * tiny_model::FEATURES);
}
