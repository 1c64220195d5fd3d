//! memory-governor: quotas, leases, admission policy, reclaim and stats over the
//! `BindingRegistry`, and the one crate a runtime needs to depend on.
//!
//! # What it does
//! - **Books** ([`Governor`]): a limit per device key (each GPU, host, disk), per
//!   authority quotas nested inside the device budget ([`Account`]), per-role
//!   accounting (weights, KV cache, activations, workspace, ...). Limits can be lowered
//!   and raised at run time; lowering revokes nothing, new admissions are refused until
//!   usage falls below the new limit.
//! - **Leases** ([`Lease`]): RAII charges that grow and shrink in place and are
//!   refunded exactly once, on drop.
//! - **Policy** ([`AdmissionPolicy`]): [`HardLimit`], [`ReclaimThenFail`] (asks the
//!   registered [`ReclaimHolder`]s in order, outside any lock, then retries once) and
//!   [`GuaranteedReserve`] (bytes per role no other role can take).
//! - **Governed allocation** ([`GovernedAllocator`]): wraps any `DeviceAllocator`;
//!   register it in the [`BindingRegistry`] like any allocator and every allocation is
//!   charged to the authority by its role. A complete release refunds; a quarantined
//!   residual stays charged; device-lost bytes are refunded only when the registry
//!   confirms the context terminated.
//! - **Errors** that name tier, device, authority, role, requested, used, limit,
//!   available and the largest reclaimable holder, and say what to change
//!   ([`Exhaustion`]).
//! - **Observability**: [`GovernorSnapshot`] (serde JSON), a Chrome trace-event
//!   timeline ([`Governor::chrome_trace_json`]), and `tracing` events on refusals,
//!   reclaim and limit changes (nothing above trace level on the hot path; the
//!   registry's per-call events need the `hot-path-trace` feature).
//!
//! The accounting rules are written down in `docs/ACCOUNTING.md`.
//!
//! # Correctness
//! - No `unsafe` code (`#![forbid(unsafe_code)]`).
//! - Admission is atomic: every budget is a counter updated by compare-and-swap against
//!   its limit, so concurrent admissions never push it over. To scale, each thread
//!   draws *credit* from the shared budget in chunks and admits from it with one
//!   uncontended compare-and-swap; credit goes back when the thread ends, when a
//!   limit is lowered, and whenever an admission finds the shared budget short, so no
//!   admission is refused while unused credit sits with another thread. The protocol
//!   and its argument are in `src/credit.rs`; loom models of admission racing refund,
//!   credit return and limit lowering live in `src/loom_credit.rs` and run with
//!   `RUSTFLAGS="--cfg memory_loom" cargo test --release -p memory-governor --lib loom`.
//!   Every atomic and lock comes from the `sync` module, which swaps in loom's.
//! - No lock is held across a callback (policy, reclaim holder, inner allocator):
//!   policies and holders are copied out of their locks before they are called, so
//!   they may call back into the governor. A nested admission inside a holder's
//!   reclaim never reclaims again ([`AdmissionError::ReentrantReclaim`]).
//!   Lock order: a device's change lock (limit, quota and policy changes; cold) may be
//!   held while a slot list is copied or the policy swapped; every other lock (slot
//!   lists, policy, holders, account and device tables, timeline) is a leaf, held for a
//!   copy or an insert only; a governed allocator's records (`memory_sync`'s record
//!   table) take no lock. A panic
//!   poisons nothing into a permanent error.
//! - Trust: a governed allocator takes role, charge and quarantine state from its own
//!   records, never from a block's `provider_tag`, and believes no release answer
//!   about another block than the one it sent (see [`GovernedAllocator`]).
//! - Tests: concurrent admission hammering one limit and checking it after every step,
//!   refund exactly once, reclaim order and a stingy holder, per-role reserves, limit
//!   lowering under load, refund rules through the registry (complete, quarantined,
//!   device-lost), the JSON shapes, a property test comparing the books (peaks
//!   included) with a sequential model, and `tests/hostile.rs`: lying inner
//!   allocators, forged tags, re-entrant policies and holders, each on a deadline.
//!
//! # Quickstart
//! ```
//! use std::sync::Arc;
//! use memory_governor::*;
//!
//! let registry = BindingRegistry::new();
//! let gpu = DeviceKey::host(1); // a simulated device
//! let context = registry.register_provider_context(gpu, Arc::new("arena"))?;
//! let tenant = registry.register_authority(gpu, Arc::new("tenant-a"))?;
//!
//! // Books: 1 MiB on the device, 512 KiB for this tenant, 256 KiB kept for weights.
//! let governor = Governor::new();
//! governor.set_device_limit(gpu, 1 << 20)?;
//! governor.set_policy(gpu, Arc::new(GuaranteedReserve::new(Arc::new(HardLimit)).with_reserve(MemoryRole::Weights, 256 << 10)))?;
//! let account = governor.open_account(AccountConfig::new(gpu, tenant).with_quota(512 << 10).with_label("tenant-a"))?;
//!
//! // Governed allocation through the registry: identity and governance compose.
//! let allocator: Arc<dyn DeviceAllocator> = Arc::new(allocator_cpu::SystemAllocator::for_device(gpu));
//! let governed = governor.govern(allocator, tenant)?;
//! registry.register_allocator(&context, &tenant, Arc::new(governed))?;
//! let binding = registry.bind(gpu)?;
//! let block = binding.allocate(AllocationRequest::new(64 << 10, 256)?.with_role(MemoryRole::KvCache))?;
//! assert_eq!(account.snapshot().role(MemoryRole::KvCache).current, 64 << 10);
//!
//! // Leases: RAII charges for memory the governor does not allocate itself.
//! let mut lease = account.lease(MemoryRole::Workspace, 128 << 10)?;
//! lease.grow(64 << 10)?;
//! let refused = account.lease(MemoryRole::KvCache, 400 << 10).unwrap_err();
//! assert!(refused.to_string().contains("authority quota"), "{refused}");
//! drop(lease);
//!
//! binding.release(block)?;
//! let snapshot = governor.snapshot();
//! assert_eq!(snapshot.device(gpu).unwrap().current, 0);
//! assert!(snapshot.to_json().contains("\"kv-cache\""));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

mod account;
mod allocator;
mod credit;
mod device;
mod error;
mod footprint;
mod governor;
mod lease;
#[cfg(feature = "metrics")]
pub mod metrics;
mod overdraft;
mod peaks;
mod policy;
mod reclaim;
mod stats;
mod sync;
mod timeline;

#[cfg(all(test, memory_loom))]
mod loom_credit;

// The public interface. Modules are private (except `metrics`, whose docs are the table
// of published names): every name is here, grouped by what it is for.

// The books: devices, accounts, leases.
pub use account::{Account, AccountConfig, MAX_CHARGE};
pub use governor::{Governor, GovernorConfig};
pub use lease::{BorrowedLease, Lease, OwnedLease};
pub use overdraft::{DEFAULT_OVERDRAFT_LIMIT, OverdraftDraw, OverdraftRefused, OverdraftSnapshot};

// Admission policy and reclaim.
pub use policy::{AdmissionPolicy, GuaranteedReserve, HardLimit, ReclaimThenFail, Shortfall, ShortfallDecision};
pub use reclaim::{HolderId, ReclaimHolder, ReclaimRequest};

// Governed allocation: any allocator, charged per block, registered like any other; and
// the backing of a cache, so that the device limit bounds what caches hold too.
pub use allocator::{CacheBacking, GovernedAllocError, GovernedAllocator, is_governor_refusal};
pub use footprint::fragmentation;

// Errors.
pub use error::{
    AccountError, AdmissionError, Exhaustion, Footprint, GovernError, GovernFailure, HolderReport, LeaseRequestError,
    LimitError, LimitScope, PolicyError, ShrinkError,
};

// Observability: snapshots and the timeline.
pub use stats::{
    AccountSnapshot, CacheSnapshot, DeviceSnapshot, GovernorSnapshot, HolderSnapshot, LadderSnapshot, ReserveSnapshot,
    RoleSnapshot, Totals,
};
pub use timeline::{TimelineEvent, TimelineEventKind};

// The compatibility surface: the contracts (`memory-api`) and the registry
// (`memory-binding`), as modules and flat, so a runtime depends on the governor alone
// and migrates crate by crate. Flat names are listed under the crates' own docs.
pub use memory_api as api;
#[doc(no_inline)]
pub use memory_api::*;
pub use memory_binding as binding;
#[doc(no_inline)]
pub use memory_binding::*;

/// The README's Rust examples, compiled and run as doctests so the adoption guide
/// cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
