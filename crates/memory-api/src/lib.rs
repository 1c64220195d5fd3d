//! Vocabulary and contracts for registry-issued device memory.
//!
//! This crate is the bottom layer of the workspace. It names where memory lives
//! ([`DeviceKey`], [`Tier`], [`MemoryRole`]), the identities a registry issues
//! ([`MechanismIdentity`], [`AllocationGeneration`], ...), and the contract every
//! memory source implements ([`DeviceAllocator`], with its honest
//! [`ReleaseOutcome`] and optional [`VirtualBacking`] / [`SharedMapping`]
//! capabilities). It depends on nothing GPU-related and on no other crate of the
//! workspace; allocator crates depend on it alone, like crypto providers under rustls.
//!
//! # Correctness
//! - The crate has no `unsafe` code (`#![forbid(unsafe_code)]`).
//! - Identities have no public numeric constructor. They come from an
//!   [`IdentityIssuer`] whose [`RegistryId`] is process-unique, so an identity from
//!   another registry is recognisably foreign; serial counters are checked and
//!   exhaustion is an error, never a wrap.
//! - [`RawAllocation`] is neither `Clone` nor `Copy`: release consumes it, so one
//!   block cannot be released twice through safe code, and every failure path
//!   ([`ReleaseOutcome::Failed`], [`ReleaseOutcome::Quarantined`],
//!   [`QueueRefusal`]) hands it back.
//! - Release outcomes can only be built through constructors that enforce the
//!   honesty rules (see [`ReleaseOutcome`]).
//!
//! # Release results, on one page
//! | type | who makes it | what it says |
//! |------|--------------|--------------|
//! | [`ReleaseOutcome`] | an allocator's `release` | complete, quarantined (with the block and the exact residual) or failed (with the block, untouched) |
//! | [`Completion`], [`Quarantine`], [`FailedRelease`] | the constructors of `ReleaseOutcome` | the payload of each outcome |
//! | [`ReleaseSummary`] | the registry (`MemoryBinding::release`), or `ReleaseOutcome::summary` | the sizes alone, `Copy`: complete or quarantined bytes |
//! | [`ReleaseError`] | inside a quarantine or failure | why |
//! | [`ReleaseCompletion`] | the registry, for a deferred queue | the callback a [`PreparedRelease`] calls exactly once with the outcome |
//!
//! # Quickstart
//! A minimal allocator over host memory, checked by its contract:
//! ```
//! use memory_api::*;
//! use std::sync::atomic::{AtomicU64, Ordering};
//!
//! /// Hands out addresses from a counter (no real memory; enough to show the contract).
//! struct Bump { next: AtomicU64 }
//!
//! impl DeviceAllocator for Bump {
//!     fn device(&self) -> DeviceKey { DeviceKey::device(0) }
//!     fn name(&self) -> &str { "bump" }
//!     fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
//!         let size = request.bytes().max(1).next_multiple_of(request.align()) as u64;
//!         let start = self.next.fetch_add(size, Ordering::Relaxed);
//!         let address = DeviceAddress::new(start).expect("counter starts above zero");
//!         Ok(RawAllocation::new(address, request.bytes(), request.align(), self.device(), 0))
//!     }
//!     fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
//!         ReleaseOutcome::complete(allocation.bytes())
//!     }
//! }
//!
//! let bump = Bump { next: AtomicU64::new(1 << 20) };
//! let request = AllocationRequest::new(4096, 256)?.with_role(MemoryRole::KvCache);
//! let block = bump.allocate(&request)?;
//! assert!(block.address().is_aligned_to(256));
//! assert!(bump.release(block).is_complete());
//!
//! // Bad layouts are typed errors, never panics.
//! assert!(matches!(AllocationRequest::new(64, 3), Err(LayoutError::AlignmentNotPowerOfTwo { align: 3 })));
//!
//! // Identities come only from an issuer, and know where they came from.
//! let ours = IdentityIssuer::new()?;
//! let theirs = IdentityIssuer::new()?;
//! let mechanism = theirs.mechanism()?;
//! assert!(!ours.issued(&mechanism));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

mod address;
mod allocator;
mod capability;
mod device;
mod error;
mod identity;
mod queue;
mod release;

// The public interface. Modules are private: every name is here, grouped by what it is
// for, so this list is the whole API.

// Where memory lives and what it is for.
pub use address::DeviceAddress;
pub use device::{DeviceKey, MemoryRole, Tier};

// Registry-issued identities.
pub use identity::{
    AllocationGeneration, AllocationIdentity, AuthorityIdentity, BindingGeneration, BindingId, BindingIdentity,
    Identity, IdentityBlock, IdentityIssuer, IdentityKind, MechanismIdentity, ProviderContextIdentity, RegistryId,
};

// The allocator contract and its optional capabilities.
pub use allocator::{AllocationRequest, AllocatorStats, DeviceAllocator, RawAllocation};
pub use capability::{
    ByteRange, MappingAccess, SharedBacking, SharedBackingResource, SharedMapping, SharedPlacement, VirtualBacking,
};

// Releasing: honest outcomes, and deferred release queues.
pub use queue::{DeferredReleaseQueue, PreparedRelease, QueueRefusal, QueueRefusalReason, ReleaseCompletion};
pub use release::{Completion, FailedRelease, Quarantine, ReleaseOutcome, ReleaseSummary};

// Errors, one enum per operation family.
pub use error::{AllocError, BackendError, CapabilityError, IdentityError, LayoutError, MaybeBytes, ReleaseError};
