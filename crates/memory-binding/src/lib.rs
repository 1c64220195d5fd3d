//! The `BindingRegistry`: the sole issuer of provider-context, authority, mechanism,
//! binding and allocation identities, and the owner of every lifecycle.
//!
//! Nothing here trusts what an allocator reports about identity. Every
//! [`MemoryBinding`], [`BoundAllocation`], view and bound capability handle pins the
//! exact `Arc<dyn DeviceAllocator>` plus the provider-context and authority resources
//! it came from, and every operation checks, before any callback, that a handle
//! belongs to this registry, mechanism and binding and that its generation still
//! validates.
//!
//! # Lifecycles
//! - Mechanism: `Active -> Retired`, `Active|Retired -> DeviceLost -> Terminated`
//!   ([`MechanismState`]). Switching the selection affects only future binds;
//!   retiring rejects new work but lets existing allocations release;
//!   [`BindingRegistry::invalidate_device`] makes no allocator callback and never
//!   waits; [`BindingRegistry::confirm_context_terminated`] succeeds only once
//!   callbacks have drained.
//! - Provider context: `Live -> Lost -> Terminated` ([`ContextState`]).
//! - Allocation: live, released, quarantined (visible in snapshots, blocks removal),
//!   or lost with its device ([`AllocationState`]).
//!
//! # Correctness
//! - `unsafe` lives in one module, `unit_ref`: a handle's pointer to the per-thread
//!   pin that records it, and a binding's to the per-thread anchor that made it, each
//!   kept valid by a *unit* of that object (a biased reference count: no atomic
//!   read-modify-write on the owner thread) instead of an `Arc` clone, and the one drop
//!   of each object's unit share. The unit protocol is safe code checked by loom; the
//!   pointer use is checked by Miri (`cargo xtask miri`). [`BindingRegistry::register_trusted_composite`] is an `unsafe fn` only to
//!   make a trust boundary explicit, and contains no unsafe code. The safe registration
//!   path admits only capability objects that are part of the allocator's own value; a
//!   composite whose capabilities live in other objects needs the caller's word.
//! - The hot path (`bind`, `allocate`, `release`, views) takes no lock and writes no
//!   line another thread writes, whichever thread made the binding: an allocation is
//!   recorded in the *calling* thread's pin (lock-free records in segments that never
//!   move), a release from any thread marks the record in transit and frees it back to
//!   its owner (its own free list, or a remote stack the owner takes whole), in-flight
//!   counts are single-writer per-thread slots, generations and binding ids come from
//!   per-thread blocks, and `bind` reads a per-thread cache validated by a selection
//!   epoch. The Dekker points between the hot path and termination or removal use an
//!   asymmetric barrier pair (a compiler fence against `membarrier(2)`, or fences where
//!   that is unavailable). Every primitive comes from the crate-private `sync` module so
//!   loom can model the protocols under `--cfg memory_loom`; see docs/LIFECYCLE.md.
//! - Callbacks and resource destructors run with no lock held; a panicking callback
//!   restores the in-flight count on unwind and poisons nothing.
//!
//! # Features
//! - `serde`: `Serialize` for every snapshot and report.
//! - `hot-path-trace`: a trace-level event for every bind, allocate and release. Off
//!   by default: even a disabled event's level check costs 1–3 ns on those paths.
//!   Lifecycle transitions, refusals and faults are traced either way.
//!
//! # Quickstart
//! ```
//! use std::sync::Arc;
//! use memory_binding::{BindingRegistry, MechanismState};
//! use memory_api::{AllocationRequest, DeviceKey, MemoryRole};
//! # use memory_api::*;
//! # struct Host;
//! # impl DeviceAllocator for Host {
//! #     fn device(&self) -> DeviceKey { DeviceKey::HOST }
//! #     fn name(&self) -> &str { "doc" }
//! #     fn allocate(&self, r: &AllocationRequest) -> Result<RawAllocation, AllocError> {
//! #         let a = DeviceAddress::new(0x10000).unwrap();
//! #         Ok(RawAllocation::new(a, r.bytes(), r.align(), DeviceKey::HOST, 0))
//! #     }
//! #     fn release(&self, a: RawAllocation) -> ReleaseOutcome { ReleaseOutcome::complete(a.bytes()) }
//! # }
//! # let allocator: Arc<dyn DeviceAllocator> = Arc::new(Host);
//!
//! let registry = BindingRegistry::new();
//! let context = registry.register_provider_context(DeviceKey::HOST, Arc::new("host arena"))?;
//! let tenant = registry.register_authority(DeviceKey::HOST, Arc::new("tenant-a"))?;
//! let mechanism = registry.register_allocator(&context, &tenant, allocator)?;
//!
//! // The first mechanism for a device becomes its selection.
//! let binding = registry.bind(DeviceKey::HOST)?;
//! assert_eq!(binding.identity().mechanism(), mechanism);
//!
//! let block = binding.allocate(AllocationRequest::new(4096, 64)?.with_role(MemoryRole::KvCache))?;
//! let view = block.view(0, 1024)?;
//! assert_eq!(view.len(), 1024);
//! binding.release(block)?;
//!
//! registry.retire(&mechanism)?;
//! assert_eq!(binding.state(), MechanismState::Retired);
//! assert!(registry.bind(DeviceKey::HOST).is_err());
//! registry.remove(&mechanism)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(unsafe_code)]

mod bind_cache;
mod binding;
mod capability;
mod entry;
mod error;
mod hold;
mod hot_trace;
mod lifecycle;
mod registry;
mod release;
mod snapshot;
mod sync;
mod unit_ref;

// The public interface. Modules are private: every name is here, grouped by what it is
// for.

// The registry: registration, selection, lifecycles (the cold path).
pub use entry::{DropPolicy, Resource};
pub use lifecycle::{AllocationState, ContextState, MechanismState};
pub use registry::{BindingRegistry, InvalidationReport, MechanismOptions};

// Bindings, allocations, views and bound capabilities (the hot path).
pub use binding::{AllocationView, BoundAllocation, MemoryBinding};
pub use capability::{BoundSharedMapping, BoundVirtualBacking};
pub use hold::CallerHold;

// Reports and snapshots.
pub use snapshot::{
    AuthoritySnapshot, ContextSnapshot, MechanismSnapshot, QuarantineSnapshot, RegistrySnapshot, RetryReport,
    TerminationReport,
};

// Errors, one enum per operation family; a rejected handle comes back in `Rejected`.
pub use error::{
    AllocateError, BindError, BoundCapabilityError, HandleError, ObjectKind, RegistryError, Rejected, ViewError,
};
