//! Shared by the node tests: books in a fresh file, and an "engine" (a registry and a
//! governor with governed allocators per tenant) joined to them.

#![allow(dead_code, unreachable_pub, reason = "each test binary uses part of the kit")]

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use memory_governor::{
    AccountConfig, AllocError, AllocationRequest, AuthorityIdentity, BindingRegistry, BoundAllocation, DeviceAllocator,
    DeviceKey, Governor, GovernorConfig, HardLimit, MemoryBinding, RawAllocation, ReleaseOutcome,
};
use memory_node::{Member, NodeBooks, NodeConfig};

pub const MIB: u64 = 1 << 20;

/// A directory for books: `/dev/shm` when there is one (the default's kind of place),
/// the temporary directory otherwise.
pub fn books_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() { shm } else { std::env::temp_dir() }
}

/// A config for fresh books (a name no other test uses), with small chunks and fast
/// timers so tests see many grants, give-backs and refunds in a short run.
pub fn fresh_config(tag: &str) -> NodeConfig {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    NodeConfig::new(format!("memory-node-test-{tag}-{}-{nanos}", std::process::id()))
        .with_directory(books_dir())
        .with_grant_chunk(MIB)
        .with_margin(MIB)
        .with_tick(Duration::from_millis(5))
        .with_refund_interval(Duration::from_millis(50))
        .with_pressure_wait(Duration::from_millis(10))
}

/// The same books seen from another process (name and directory taken from `config`).
pub fn config_from_env() -> NodeConfig {
    let name = std::env::var("MEMORY_NODE_BOOKS").expect("MEMORY_NODE_BOOKS");
    let dir = std::env::var("MEMORY_NODE_DIR").expect("MEMORY_NODE_DIR");
    NodeConfig::new(name)
        .with_directory(dir)
        .with_grant_chunk(MIB)
        .with_margin(MIB)
        .with_tick(Duration::from_millis(5))
        .with_refund_interval(Duration::from_millis(50))
        .with_pressure_wait(Duration::from_millis(10))
}

/// Removes the books file when dropped.
pub struct Cleanup(pub PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        // And the slots' lease files beside it (a slot kept by a member that left while
        // holding memory keeps its lease until someone refunds it).
        let (Some(dir), Some(name)) = (self.0.parent(), self.0.file_name().and_then(|name| name.to_str())) else {
            return;
        };
        let prefix = format!(".{name}.");
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let lease = |file: &str| file.starts_with(&prefix) && file.contains(".slot-") && file.ends_with(".lease");
            if entry.file_name().to_str().is_some_and(lease) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// One tenant of an engine.
pub struct Tenant {
    pub name: String,
    pub authority: AuthorityIdentity,
    pub binding: MemoryBinding,
}

/// One process's stack: registry, governor, member, a governed allocator per tenant.
pub struct Engine {
    pub registry: BindingRegistry,
    pub governor: Governor,
    pub member: Member,
    pub tenants: Vec<Tenant>,
    pub device: DeviceKey,
}

/// An engine on `device` joined to `books`, with `tenants` bound to node tenants of the
/// same names, each over an allocator made by `allocator`.
pub fn engine(
    books: &NodeBooks,
    device: DeviceKey,
    tenants: &[&str],
    allocator: impl Fn() -> Arc<dyn DeviceAllocator>,
) -> Engine {
    let registry = BindingRegistry::new();
    let governor = Governor::with_config(GovernorConfig::default().with_credit_chunk(256 << 10));
    let context = registry.register_provider_context(device, Arc::new("test-context")).unwrap();
    let mut opened = Vec::new();
    for name in tenants {
        let authority = registry.register_authority(device, Arc::new(name.to_string())).unwrap();
        governor.open_account(AccountConfig::new(device, authority).with_label(*name)).unwrap();
        let governed = governor.govern(allocator(), authority).unwrap();
        let mechanism = registry.register_allocator(&context, &authority, Arc::new(governed)).unwrap();
        opened.push((name.to_string(), authority, mechanism));
    }
    let member = books.join(&governor).unwrap();
    member.govern_device(device, Arc::new(HardLimit)).unwrap();
    let tenants = opened
        .into_iter()
        .map(|(name, authority, mechanism)| {
            member.bind_tenant(authority, &name).unwrap();
            Tenant { name, authority, binding: registry.bind_registered(&mechanism).unwrap() }
        })
        .collect();
    Engine { registry, governor, member, tenants, device }
}

/// A plain host allocator for `device`.
pub fn system(device: DeviceKey) -> Arc<dyn DeviceAllocator> {
    Arc::new(allocator_cpu::SystemAllocator::for_device(device))
}

/// Allocates `bytes` through `tenant`; `None` when refused.
pub fn allocate(tenant: &Tenant, bytes: u64) -> Option<BoundAllocation> {
    tenant.binding.allocate(AllocationRequest::new(bytes as usize, 64).unwrap()).ok()
}

/// A host allocator whose allocations stall forever once `stall` is set (after the
/// governor charged them: a process killed there dies inside a charge).
pub struct Stalling {
    pub inner: Arc<dyn DeviceAllocator>,
    pub stall: Arc<AtomicBool>,
    pub stalled: Arc<AtomicBool>,
}

impl DeviceAllocator for Stalling {
    fn device(&self) -> DeviceKey {
        self.inner.device()
    }

    fn name(&self) -> &str {
        "stalling"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        if self.stall.load(Ordering::SeqCst) {
            self.stalled.store(true, Ordering::SeqCst);
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        self.inner.allocate(request)
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.inner.release(allocation)
    }
}
