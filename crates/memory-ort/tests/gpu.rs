//! The CUDA variant on a real device: `#[ignore = "gpu: ..."]` and named `gpu_*`, run by
//! `cargo xtask test --gpu` (which fails when none ran). Without a device they fail
//! loudly; they never skip.

mod common;

use std::sync::Arc;

use allocator_cuda::{CudaDevice, CudaPoolAllocator, CudaReleaseQueue, CudaStream, PoolConfig};
use memory_governor::{
    AccountConfig, BindingRegistry, DeviceAllocator, DeviceKey, Governor, GovernorConfig, MemoryRole,
};
use memory_ort::{GovernedOrtAllocator, OrtAllocatorConfig, OrtAssets, OrtEnvironment};

fn environment() -> &'static OrtEnvironment {
    // The GPU run needs the runtime library (any build: the CUDA memory info is data).
    common::ort("gpu tests")
        .map(|(env, _)| env)
        .unwrap_or_else(|| panic!("the GPU tests need the onnx runtime library: {:?}", OrtAssets::locate().err()))
}

#[test]
#[ignore = "gpu: needs a CUDA device and the onnx runtime library (cargo xtask test --gpu)"]
fn gpu_cuda_ort_allocator_charges_the_pool_and_orders_frees_on_the_stream() {
    let env = environment();
    let device = CudaDevice::open(0).unwrap_or_else(|e| panic!("the GPU tests need CUDA device 0: {e}"));
    let stream = CudaStream::new(&device).unwrap();
    let pool: Arc<dyn DeviceAllocator> = Arc::new(CudaPoolAllocator::new(&stream, PoolConfig::default()).unwrap());
    let queue = Arc::new(CudaReleaseQueue::new(&stream, 1024));
    let key: DeviceKey = device.key();

    let registry = BindingRegistry::new();
    let governor = Governor::with_config(GovernorConfig::default().with_credit_chunk(0));
    let context = registry.register_provider_context(key, Arc::new("cuda ctx")).unwrap();
    let tenant = registry.register_authority(key, Arc::new("gpu-tenant")).unwrap();
    let account = governor.open_account(AccountConfig::new(key, tenant).with_quota(64 << 20)).unwrap();
    let mechanism =
        registry.register_allocator(&context, &tenant, Arc::new(governor.govern(pool, tenant).unwrap())).unwrap();
    let binding = registry.bind_registered(&mechanism).unwrap();
    let allocator =
        GovernedOrtAllocator::cuda(env, binding, Some(account.clone()), queue.clone(), OrtAllocatorConfig::cuda())
            .unwrap();

    let (a, b) = (common::table_alloc(&allocator, 1 << 20, false), common::table_alloc(&allocator, 3 << 20, true));
    assert!(!a.is_null() && !b.is_null());
    assert_eq!(a.addr() % 256, 0, "CUDA alignment");
    let snapshot = account.snapshot();
    assert_eq!(snapshot.role(MemoryRole::Activations).current, 1 << 20);
    assert_eq!(snapshot.role(MemoryRole::Weights).current, 3 << 20);
    common::table_free(&allocator, a);
    common::table_free(&allocator, b);
    // Frees were queued on the stream, not executed at once; draining completes them.
    queue.drain().unwrap();
    assert_eq!(account.snapshot().current, 0);
    // A request over the quota answers null (device memory has no host overdraft).
    assert!(common::table_alloc(&allocator, 128 << 20, false).is_null());
    assert!(allocator.last_refusal().is_some_and(|reason| reason.contains("authority quota")));
}
