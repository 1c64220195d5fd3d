//! The simulated server: devices with governor budgets, a platform authority that owns
//! the weights, two tenants with quotas, and the mechanisms each of them binds.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use memory_governor::{
    AccountConfig, AllocationRequest, AuthorityIdentity, BindingRegistry, BoundAllocation, DeviceAllocator, DeviceKey,
    Governor, GuaranteedReserve, MechanismIdentity, MemoryBinding, MemoryRole, ProviderContextIdentity,
    ReclaimThenFail,
};

use memory_trace::Recorder;

use super::SimError;
use super::kv::KvCache;
use super::ledger::Ledger;

pub(crate) const MIB: u64 = 1 << 20;
/// Each device's budget.
pub(crate) const DEVICE_BUDGET: u64 = 160 * MIB;
/// Model weights, loaded once per device and guaranteed by a reserve.
pub(crate) const WEIGHTS: u64 = 48 * MIB;
/// The tenants and their quotas on every device.
pub(crate) const TENANTS: [(&str, u64); 2] = [("tenant-a", 80 * MIB), ("tenant-b", 48 * MIB)];
/// Index of the platform authority in a device's routes.
pub(crate) const PLATFORM: usize = 0;

/// Which allocator family backs the mechanisms.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Backend {
    /// `SystemAllocator` (CPU) or eager `cuMemAlloc` (GPU).
    Plain,
    /// `PooledAllocator` (CPU) or a stream-ordered CUDA pool (GPU).
    Pooled,
}

impl Backend {
    pub(crate) fn name(self, gpu: bool) -> &'static str {
        match (self, gpu) {
            (Backend::Plain, false) => "system",
            (Backend::Pooled, false) => "pooled",
            (Backend::Plain, true) => "cuda-eager",
            (Backend::Pooled, true) => "cuda-pool",
        }
    }
}

/// Where the allocators of one device come from.
pub(crate) enum Hardware {
    /// A host-backed simulated device.
    Host,
    /// A CUDA device (and a stream for its pool).
    #[cfg(feature = "cuda")]
    Cuda(allocator_cuda::CudaDevice),
}

/// One device of the server.
pub(crate) struct Device {
    pub(crate) key: DeviceKey,
    pub(crate) name: String,
    pub(crate) hardware: Hardware,
    pub(crate) context: Mutex<ProviderContextIdentity>,
    /// Platform, then the tenants (same order as [`TENANTS`]).
    pub(crate) authorities: Vec<AuthorityIdentity>,
    /// The mechanism each authority binds now (same order as `authorities`).
    pub(crate) routes: RwLock<Vec<MechanismIdentity>>,
    /// Mechanisms replaced by a switch or a loss, removed at the end.
    pub(crate) retired: Mutex<Vec<MechanismIdentity>>,
    pub(crate) kv: Arc<KvCache>,
    pub(crate) weights: Mutex<Option<(MemoryBinding, BoundAllocation)>>,
}

impl Device {
    pub(crate) fn route(&self, authority: usize) -> MechanismIdentity {
        self.routes.read().unwrap_or_else(PoisonError::into_inner)[authority]
    }

    pub(crate) fn context(&self) -> ProviderContextIdentity {
        *self.context.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The whole server.
pub(crate) struct World {
    pub(crate) registry: BindingRegistry,
    pub(crate) governor: Governor,
    pub(crate) devices: Vec<Device>,
    pub(crate) gpu: bool,
    pub(crate) backend: RwLock<Backend>,
    pub(crate) ledger: Arc<Ledger>,
    /// `--record`: every governed mechanism is installed wrapped by this recorder.
    pub(crate) recorder: Option<Recorder>,
}

impl World {
    /// Builds the registry, the governor's books and every device's mechanisms, and
    /// loads the weights; with `record`, every governed allocation from the first one
    /// (the weights) is recorded to that file.
    pub(crate) fn new(gpu: bool, record: Option<&Path>) -> Result<World, SimError> {
        let recorder = record
            .map(|path| {
                Recorder::create(path)
                    .map_err(|error| SimError::Record(format!("cannot record to {}: {error}", path.display())))
            })
            .transpose()?;
        let registry = BindingRegistry::new();
        let governor = Governor::new();
        // The newest 64 Ki events (a ring): enough for memory over time at a trace viewer's
        // resolution without a file of hundreds of megabytes.
        governor.enable_timeline(1 << 16);
        let hardware = if gpu { cuda_devices()? } else { vec![Hardware::Host, Hardware::Host] };
        let mut devices = Vec::new();
        for (index, hardware) in hardware.into_iter().enumerate() {
            let key = match hardware {
                Hardware::Host => DeviceKey::host(index as u32 + 1),
                #[cfg(feature = "cuda")]
                Hardware::Cuda(ref device) => DeviceKey::device(device.ordinal()),
            };
            devices.push(Device::new(&registry, &governor, key, format!("gpu{index}"), hardware)?);
        }
        let ledger = Arc::new(Ledger::default());
        for device in &devices {
            device.kv.attach(Arc::clone(&ledger));
        }
        let world = World { registry, governor, devices, gpu, backend: RwLock::new(Backend::Plain), ledger, recorder };
        for device in &world.devices {
            world.install(device, Backend::Plain)?;
            world.load_weights(device)?;
        }
        Ok(world)
    }

    pub(crate) fn backend(&self) -> Backend {
        *self.backend.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers one governed mechanism per authority of `device` on its current
    /// context, routes future binds to them, and retires the ones they replace.
    pub(crate) fn install(&self, device: &Device, backend: Backend) -> Result<(), SimError> {
        let context = device.context();
        let mut mechanisms = Vec::new();
        for &authority in &device.authorities {
            // One allocator per authority: a pool's cache is booked to the tenant whose
            // blocks it keeps (`reserved` per tenant).
            let allocator = self.allocator(device, backend)?;
            let governed = self.governor.govern(allocator, authority).map_err(|e| e.failure)?;
            // Recording: each install is a new tenant of the trace (its label, allocator
            // and quota as they are now), so a replay sees the switch to pools.
            let governed: Arc<dyn DeviceAllocator> = match &self.recorder {
                Some(recorder) => Arc::new(recorder.trace(&self.governor, governed)),
                None => Arc::new(governed),
            };
            mechanisms.push(self.registry.register_allocator(&context, &authority, governed)?);
        }
        let old = std::mem::replace(&mut *device.routes.write().unwrap_or_else(PoisonError::into_inner), mechanisms);
        for mechanism in old {
            // Retiring refuses new work; allocations already made keep releasing through
            // the allocator that made them. A lost mechanism cannot be retired (nor
            // needs to be).
            let _ = self.registry.retire(&mechanism);
            device.retired.lock().unwrap_or_else(PoisonError::into_inner).push(mechanism);
        }
        Ok(())
    }

    fn allocator(&self, device: &Device, backend: Backend) -> Result<Arc<dyn DeviceAllocator>, SimError> {
        Ok(match (&device.hardware, backend) {
            (Hardware::Host, Backend::Plain) => Arc::new(allocator_cpu::SystemAllocator::for_device(device.key)),
            // The pool takes its memory through a cache backing: the device limit bounds
            // what it holds, used and idle (`reserved`), and a shortfall runs the recovery
            // ladder (trim the caches, reclaim idle sequences, then refuse).
            (Hardware::Host, Backend::Pooled) => Arc::new(allocator_cpu::PooledAllocator::new(
                self.governor.cache_backing(Arc::new(allocator_cpu::SystemAllocator::for_caches(device.key))),
            )),
            #[cfg(feature = "cuda")]
            (Hardware::Cuda(cuda), Backend::Plain) => Arc::new(allocator_cuda::CudaAllocator::new(cuda)),
            #[cfg(feature = "cuda")]
            (Hardware::Cuda(cuda), Backend::Pooled) => {
                let stream = allocator_cuda::CudaStream::new(cuda)?;
                Arc::new(allocator_cuda::CudaPoolAllocator::new(&stream, allocator_cuda::PoolConfig::default())?)
            }
        })
    }

    /// Loads the weights of `device` through the platform's mechanism.
    pub(crate) fn load_weights(&self, device: &Device) -> Result<(), SimError> {
        let binding = self.registry.bind_registered(&device.route(PLATFORM))?;
        let request = AllocationRequest::new(WEIGHTS as usize, 4096)?.with_role(MemoryRole::Weights);
        let block = self.ledger.allocate(&binding, request)?;
        *device.weights.lock().unwrap_or_else(PoisonError::into_inner) = Some((binding, block));
        Ok(())
    }
}

impl Device {
    fn new(
        registry: &BindingRegistry,
        governor: &Governor,
        key: DeviceKey,
        name: String,
        hardware: Hardware,
    ) -> Result<Device, SimError> {
        let context = registry.register_provider_context(key, Arc::new(format!("{name} context")))?;
        governor.set_device_limit(key, DEVICE_BUDGET)?;
        // Weights can never be squeezed out by KV growth; everything else reclaims idle
        // KV pages before failing.
        let policy = GuaranteedReserve::new(Arc::new(ReclaimThenFail)).with_reserve(MemoryRole::Weights, WEIGHTS);
        governor.set_policy(key, Arc::new(policy)).map_err(|e| SimError::Setup(e.to_string()))?;
        let mut authorities = Vec::new();
        let platform = registry.register_authority(key, Arc::new("platform"))?;
        governor.open_account(AccountConfig::new(key, platform).with_quota(WEIGHTS).with_label("platform"))?;
        authorities.push(platform);
        for (tenant, quota) in TENANTS {
            let authority = registry.register_authority(key, Arc::new(tenant))?;
            governor.open_account(AccountConfig::new(key, authority).with_quota(quota).with_label(tenant))?;
            authorities.push(authority);
        }
        let kv = Arc::new(KvCache::new(key));
        governor.register_holder(key, 0, Arc::clone(&kv) as Arc<dyn memory_governor::ReclaimHolder>);
        Ok(Device {
            key,
            name,
            hardware,
            context: Mutex::new(context),
            authorities,
            routes: RwLock::new(Vec::new()),
            retired: Mutex::new(Vec::new()),
            kv,
            weights: Mutex::new(None),
        })
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices() -> Result<Vec<Hardware>, SimError> {
    Err(SimError::Setup(
        "--gpu: this build of memory-demo has no CUDA support; run `cargo xtask demo --gpu` \
         (which enables it) or build with `--features cuda`"
            .into(),
    ))
}

#[cfg(feature = "cuda")]
fn cuda_devices() -> Result<Vec<Hardware>, SimError> {
    let count = allocator_cuda::device_count()?;
    if count == 0 {
        return Err(SimError::Setup("--gpu: the CUDA driver reports no device; run without --gpu".into()));
    }
    (0..count.min(2)).map(|ordinal| Ok(Hardware::Cuda(allocator_cuda::CudaDevice::open(ordinal)?))).collect()
}
