//! Shared fixtures for the registry tests: allocators with capabilities that count
//! their callbacks, a bounded deferred-release queue, registration helpers, and a
//! tracing event collector.
#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use memory_api::{
    AllocError, AllocationRequest, ByteRange, CapabilityError, DeviceAddress, DeviceAllocator, DeviceKey,
    MappingAccess, RawAllocation, ReleaseOutcome, SharedBacking, SharedBackingResource, SharedMapping, SharedPlacement,
    VirtualBacking,
};
use memory_binding::{BindingRegistry, MechanismOptions, MemoryBinding};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};

pub const PAGE: usize = 4096;

/// An allocator that hands out addresses from a counter (no memory behind them) and
/// implements both capabilities by bookkeeping, counting every callback. It makes no
/// heap allocation per allocate/release, so it also serves the allocation-free test.
#[derive(Debug)]
pub struct Caps {
    pub device: DeviceKey,
    next: AtomicU64,
    /// When set, every allocation gets this same address (an allocator reusing addresses).
    pub fixed_address: Option<u64>,
    pub allocates: AtomicUsize,
    pub releases: AtomicUsize,
    pub commits: AtomicUsize,
    pub decommits: AtomicUsize,
    pub maps: AtomicUsize,
    pub unmaps: AtomicUsize,
    pub forgotten: AtomicUsize,
    committed: AtomicUsize,
}

impl Caps {
    pub fn new(device: DeviceKey) -> Caps {
        Caps {
            device,
            next: AtomicU64::new(1 << 30),
            fixed_address: None,
            allocates: AtomicUsize::new(0),
            releases: AtomicUsize::new(0),
            commits: AtomicUsize::new(0),
            decommits: AtomicUsize::new(0),
            maps: AtomicUsize::new(0),
            unmaps: AtomicUsize::new(0),
            forgotten: AtomicUsize::new(0),
            committed: AtomicUsize::new(0),
        }
    }

    pub fn reusing(device: DeviceKey, address: u64) -> Caps {
        Caps { fixed_address: Some(address), ..Caps::new(device) }
    }

    /// Every callback that touches memory, summed.
    pub fn callbacks(&self) -> usize {
        [&self.allocates, &self.releases, &self.commits, &self.decommits, &self.maps, &self.unmaps]
            .iter()
            .map(|c| c.load(Ordering::SeqCst))
            .sum()
    }
}

impl DeviceAllocator for Caps {
    fn device(&self) -> DeviceKey {
        self.device
    }
    fn name(&self) -> &str {
        "caps"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.allocates.fetch_add(1, Ordering::SeqCst);
        let span = request.bytes().max(1).next_multiple_of(request.align().max(PAGE)) as u64;
        let start = match self.fixed_address {
            Some(address) => address,
            None => self.next.fetch_add(span, Ordering::Relaxed).next_multiple_of(request.align().max(PAGE) as u64),
        };
        let address = DeviceAddress::new(start).ok_or_else(|| AllocError::Unsupported {
            allocator: "caps".into(),
            device: self.device,
            what: "address zero",
        })?;
        Ok(RawAllocation::new(address, request.bytes(), request.align(), self.device, 0))
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.releases.fetch_add(1, Ordering::SeqCst);
        ReleaseOutcome::complete(allocation.bytes())
    }
    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        Some(self)
    }
    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        Some(self)
    }
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        self.forgotten.fetch_add(lost.len(), Ordering::SeqCst);
    }
}

impl VirtualBacking for Caps {
    fn granularity(&self) -> usize {
        PAGE
    }
    fn commit(&self, _allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.commits.fetch_add(1, Ordering::SeqCst);
        self.committed.fetch_add(range.len(), Ordering::SeqCst);
        Ok(range.len())
    }
    fn decommit(&self, _allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.decommits.fetch_add(1, Ordering::SeqCst);
        self.committed.fetch_sub(range.len(), Ordering::SeqCst);
        Ok(range.len())
    }
    fn committed_bytes(&self, _allocation: &RawAllocation) -> Result<usize, CapabilityError> {
        Ok(self.committed.load(Ordering::SeqCst))
    }
}

#[derive(Debug)]
struct Backing(usize);
impl SharedBackingResource for Backing {
    fn bytes(&self) -> usize {
        self.0
    }
}

impl SharedMapping for Caps {
    fn granularity(&self) -> usize {
        PAGE
    }
    fn create_backing(&self, bytes: usize) -> Result<SharedBacking, CapabilityError> {
        Ok(SharedBacking::new(self.device, Arc::new(Backing(bytes))))
    }
    fn map(
        &self,
        _backing: &SharedBacking,
        _allocation: &RawAllocation,
        _placement: SharedPlacement,
        _access: MappingAccess,
    ) -> Result<(), CapabilityError> {
        self.maps.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn unmap(&self, _allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.unmaps.fetch_add(1, Ordering::SeqCst);
        Ok(range.len())
    }
}

/// The bounded queue that holds prepared releases until the test runs them: the one
/// the C API hands out (`allocator_cpu::HostReleaseQueue`), not a copy of its own.
#[allow(unused_imports, reason = "not every test binary that includes this module defers releases")]
pub use allocator_cpu::HostReleaseQueue as HeldQueue;

/// Registers context + authority + `allocator` on its device.
pub fn register(
    registry: &BindingRegistry,
    allocator: Arc<dyn DeviceAllocator>,
) -> (memory_api::ProviderContextIdentity, memory_api::AuthorityIdentity, memory_api::MechanismIdentity) {
    register_with(registry, allocator, MechanismOptions::default())
}

pub fn register_with(
    registry: &BindingRegistry,
    allocator: Arc<dyn DeviceAllocator>,
    options: MechanismOptions,
) -> (memory_api::ProviderContextIdentity, memory_api::AuthorityIdentity, memory_api::MechanismIdentity) {
    let device = allocator.device();
    let context = registry.register_provider_context(device, Arc::new(())).unwrap();
    let authority = registry.register_authority(device, Arc::new(())).unwrap();
    let mechanism = registry.register_allocator_with(&context, &authority, allocator, options).unwrap();
    (context, authority, mechanism)
}

pub fn request(bytes: usize) -> AllocationRequest {
    AllocationRequest::new(bytes, 64).unwrap()
}

pub fn bind(registry: &BindingRegistry, mechanism: &memory_api::MechanismIdentity) -> MemoryBinding {
    registry.bind_registered(mechanism).unwrap()
}

// ---------------------------------------------------------------------------------
// Tracing: an event collector
// ---------------------------------------------------------------------------------

/// Collects (level, message) of every event the calling thread emits while installed.
#[derive(Clone, Default)]
pub struct Collector(Arc<Mutex<Vec<(Level, String)>>>);

struct Message(String);
impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

thread_local! {
    /// The collector installed on this thread, if any.
    static INSTALLED: std::cell::RefCell<Option<Collector>> = const { std::cell::RefCell::new(None) };
}

/// The test binary's one global subscriber: it hands each event to the collector
/// installed on the thread that emits it. A global subscriber rather than a scoped
/// default per test, because a callsite's interest is cached process-wide from the
/// subscribers alive when it is first reached: with scoped defaults, a callsite first
/// reached on a thread with none (another test) could stay disabled, and an event was
/// missed under load that way. The global one is interested in everything, always.
struct Router;

impl Subscriber for Router {
    fn register_callsite(&self, _: &'static Metadata<'static>) -> Interest {
        Interest::always()
    }
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        // `try_with`: events emitted while the thread's locals are torn down are dropped.
        let _ = INSTALLED.try_with(|installed| {
            if let Some(collector) = &*installed.borrow() {
                let mut message = Message(String::new());
                event.record(&mut message);
                collector.0.lock().unwrap().push((*event.metadata().level(), message.0));
            }
        });
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// Uninstalls the thread's collector when dropped.
pub struct Installed(());

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = INSTALLED.try_with(|installed| installed.borrow_mut().take());
    }
}

impl Collector {
    /// Makes this collector receive the calling thread's events until the guard drops.
    pub fn install(&self) -> Installed {
        static GLOBAL: std::sync::OnceLock<()> = std::sync::OnceLock::new();
        GLOBAL.get_or_init(|| {
            tracing::subscriber::set_global_default(Router).expect("no other global subscriber in this test binary");
        });
        INSTALLED.with(|installed| *installed.borrow_mut() = Some(self.clone()));
        Installed(())
    }

    /// The collector installed on the calling thread (to install it on a thread it spawns).
    pub fn current() -> Option<Collector> {
        INSTALLED.with(|installed| installed.borrow().clone())
    }

    pub fn take(&self) -> Vec<(Level, String)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

pub fn has(events: &[(Level, String)], level: Level, text: &str) -> bool {
    events.iter().any(|(l, m)| *l == level && m.contains(text))
}
