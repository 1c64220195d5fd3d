//! Shared by the integration tests: the process's one ONNX Runtime environment, the
//! skip-or-fail policy for missing assets, a governed tenant, and the tiny model.
#![allow(dead_code, unreachable_pub)]

pub mod modes;
pub mod tiny_model;

use std::sync::{Arc, OnceLock};

use allocator_cpu::{PooledAllocator, SystemAllocator};
use memory_governor::{
    Account, AccountConfig, AccountSnapshot, AuthorityIdentity, BindingRegistry, DeviceAllocator, DeviceKey, Governor,
    GovernorConfig, MechanismIdentity, MemoryRole, ProviderContextIdentity,
};
use memory_ort::{GovernedOrtAllocator, OrtAllocatorConfig, OrtAssets, OrtEnvironment};

/// Holds the test binary's one-at-a-time lock: for tests whose books include what a
/// commit measures of the process's heap, or that stall a commit, which another test
/// running meanwhile would disturb (its sessions' heap, or its deferred releases).
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The environment and assets, or `None` after printing that `test` was skipped.
/// Under `cargo xtask test` (`MEMORY_ORT_REQUIRED=1`) a missing asset fails the test.
pub fn ort(test: &str) -> Option<(&'static OrtEnvironment, &'static OrtAssets)> {
    static LOADED: OnceLock<Loaded> = OnceLock::new();
    ort_with(test, &LOADED, |assets| OrtEnvironment::load(&assets.library))
}

/// What a test binary's one environment load gave.
pub type Loaded = Result<(OrtEnvironment, OrtAssets), String>;

/// As [`ort`], with the binary's environment kept in `loaded` and built by `load` (a
/// binary whose environment needs options of its own, such as a global thread pool).
pub fn ort_with(
    test: &str,
    loaded: &'static OnceLock<Loaded>,
    load: impl FnOnce(&OrtAssets) -> Result<OrtEnvironment, memory_ort::OrtAdapterError>,
) -> Option<(&'static OrtEnvironment, &'static OrtAssets)> {
    let loaded = loaded.get_or_init(|| {
        let assets = OrtAssets::locate().map_err(|err| err.to_string())?;
        let env = load(&assets).map_err(|err| err.to_string())?;
        Ok((env, assets))
    });
    match loaded {
        Ok((env, assets)) => Some((env, assets)),
        Err(reason) if OrtAssets::required() => panic!("{test}: {reason}"),
        Err(reason) => {
            eprintln!("skipped {test}: {reason}");
            None
        }
    }
}

/// One tenant: a registry context and authority on a host device, an account with a
/// quota, a governed allocator (pooled or system) registered as a mechanism, and a
/// binding to it.
pub struct Tenant {
    pub registry: Arc<BindingRegistry>,
    pub governor: Arc<Governor>,
    pub device: DeviceKey,
    pub context: ProviderContextIdentity,
    pub authority: AuthorityIdentity,
    pub mechanism: MechanismIdentity,
    pub account: Account,
}

pub enum Backing {
    Pooled,
    System,
    Custom(Arc<dyn DeviceAllocator>),
}

impl Tenant {
    /// A tenant named `name` on `DeviceKey::HOST` of a fresh registry and governor
    /// (credit chunk 0, so the books are exact at every instant).
    pub fn new(name: &'static str, quota: u64, backing: Backing) -> Tenant {
        let registry = Arc::new(BindingRegistry::new());
        let governor = Arc::new(Governor::with_config(GovernorConfig::default().with_credit_chunk(0)));
        Tenant::on(registry, governor, name, quota, backing)
    }

    /// A tenant on an existing registry and governor.
    pub fn on(
        registry: Arc<BindingRegistry>,
        governor: Arc<Governor>,
        name: &'static str,
        quota: u64,
        backing: Backing,
    ) -> Tenant {
        let device = DeviceKey::HOST;
        let context = registry.register_provider_context(device, Arc::new(name)).unwrap();
        let authority = registry.register_authority(device, Arc::new(name)).unwrap();
        let account =
            governor.open_account(AccountConfig::new(device, authority).with_quota(quota).with_label(name)).unwrap();
        let inner: Arc<dyn DeviceAllocator> = match backing {
            // The stack a runtime is told to build: large blocks from the OS.
            Backing::Pooled => Arc::new(PooledAllocator::new(SystemAllocator::for_caches(device))),
            Backing::System => Arc::new(SystemAllocator::new()),
            Backing::Custom(inner) => inner,
        };
        let governed = governor.govern(inner, authority).unwrap();
        let mechanism = registry.register_allocator(&context, &authority, Arc::new(governed)).unwrap();
        Tenant { registry, governor, device, context, authority, mechanism, account }
    }

    pub fn allocator(&self, env: &OrtEnvironment) -> GovernedOrtAllocator {
        let binding = self.registry.bind_registered(&self.mechanism).unwrap();
        GovernedOrtAllocator::cpu(env, binding, Some(self.account.clone()), OrtAllocatorConfig::default()).unwrap()
    }

    /// Bytes the governor books to this tenant under `role` now.
    pub fn charged(&self, role: MemoryRole) -> u64 {
        self.snapshot().map_or(0, |account| account.role(role).current)
    }

    /// Bytes the governor books to this tenant in total now.
    pub fn charged_total(&self) -> u64 {
        self.snapshot().map_or(0, |account| account.current)
    }

    /// The governor's books of this tenant now.
    pub fn snapshot(&self) -> Option<AccountSnapshot> {
        self.governor.snapshot().device(self.device)?.authority(self.authority).cloned()
    }

    /// Live bytes and blocks the registry records for this tenant's mechanism.
    pub fn registry_live(&self) -> (usize, usize) {
        let snapshot = self.registry.snapshot(&self.mechanism).unwrap();
        (snapshot.live_bytes, snapshot.live_allocations)
    }
}

/// `Alloc` (or `Reserve`) through the adapter's C table, as ONNX Runtime calls it.
pub fn table_alloc(allocator: &GovernedOrtAllocator, size: usize, reserve: bool) -> *mut std::ffi::c_void {
    let this = allocator.as_ort_allocator();
    // SAFETY: the table is alive while `allocator` is, and only read.
    let table = unsafe { &*this };
    if reserve {
        let entry = table.Reserve.expect("the adapter sets Reserve");
        // SAFETY: the entry belongs to this live table; ONNX Runtime calls it the same way.
        unsafe { entry(this, size) }
    } else {
        let entry = table.Alloc.expect("the adapter sets Alloc");
        // SAFETY: as above.
        unsafe { entry(this, size) }
    }
}

/// `Free` through the adapter's C table.
pub fn table_free(allocator: &GovernedOrtAllocator, block: *mut std::ffi::c_void) {
    let this = allocator.as_ort_allocator();
    // SAFETY: the table is alive while `allocator` is, and only read.
    let free = unsafe { &*this }.Free.expect("the adapter sets Free");
    // SAFETY: Free checks the pointer against its table before touching anything.
    unsafe { free(this, block) }
}
