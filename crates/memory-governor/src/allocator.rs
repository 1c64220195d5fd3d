//! `GovernedAllocator`: any `DeviceAllocator`, with every allocation charged to an
//! authority's account by the request's role.
//!
//! # Accounting rules
//! - `allocate` charges `request.bytes()` to the account under `request.role()` before
//!   calling the inner allocator; if the inner allocator fails, the charge is cancelled.
//! - A `Complete` release refunds the whole charge.
//! - A `Quarantined` release refunds what the allocator really let go and keeps the
//!   residual still owned charged (shown as `quarantined_bytes`); retrying the release
//!   later refunds the rest, exactly once.
//! - A `Failed` release changes nothing.
//! - Device loss: the registry makes no callback then, so the charge stays; when the
//!   registry confirms the context terminated it hands the lost blocks to
//!   [`DeviceAllocator::forget_lost`], which refunds them (counted as `lost_bytes`).
//!
//! # How a block remembers its role
//! The role (and whether the block was quarantined) travels in the block's
//! `provider_tag`, which belongs to the allocator that made the block, here the
//! governed allocator. The inner allocator's own tag is kept in the low 59 bits; a
//! wider inner tag is kept in a side table keyed by address (cold path). Capability
//! calls are forwarded with the inner allocator's own view of the block.

use std::collections::HashMap;
use std::fmt;

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, ByteRange, CapabilityError, DeviceAllocator, DeviceKey,
    MappingAccess, MemoryRole, RawAllocation, ReleaseError, ReleaseOutcome, SharedBacking, SharedMapping,
    SharedPlacement, VirtualBacking,
};

use crate::error::{AdmissionError, GovernError, GovernFailure};
use crate::governor::Account;
use crate::sync::{Arc, Mutex, Ordering, lock};
use crate::timeline::TimelineEventKind;

const ROLE_SHIFT: u32 = 61;
const QUARANTINED: u64 = 1 << 60;
const WIDE: u64 = 1 << 59;
const INNER: u64 = WIDE - 1;

/// Whether `error` is a governor refusal (a quota, limit or reserve), as returned
/// through the `DeviceAllocator` interface by a [`GovernedAllocator`].
pub fn is_governor_refusal(error: &AllocError) -> bool {
    matches!(error, AllocError::AdmissionRefused { .. })
}

/// The decoded tag of a governed block.
#[derive(Copy, Clone, Debug)]
struct Tag {
    role: MemoryRole,
    quarantined: bool,
    wide: bool,
    inner: u64,
}

impl Tag {
    fn decode(tag: u64) -> Option<Tag> {
        let role = (tag >> ROLE_SHIFT) as usize;
        let role = *MemoryRole::ALL.get(role.checked_sub(1)?)?;
        Some(Tag { role, quarantined: tag & QUARANTINED != 0, wide: tag & WIDE != 0, inner: tag & INNER })
    }

    fn encode(self) -> u64 {
        ((self.role.ordinal() as u64 + 1) << ROLE_SHIFT)
            | if self.quarantined { QUARANTINED } else { 0 }
            | if self.wide { WIDE } else { 0 }
            | (self.inner & INNER)
    }
}

/// Side tables (cold path): wide inner tags, and what quarantined blocks still owe.
#[derive(Debug, Default)]
struct Tables {
    wide: Mutex<HashMap<u64, u64>>,
    quarantined: Mutex<HashMap<u64, u64>>,
}

impl Tables {
    /// The inner allocator's view of a governed block.
    fn inner_view(&self, block: &RawAllocation, tag: Tag) -> RawAllocation {
        let inner_tag = if tag.wide {
            lock(&self.wide).get(&block.address().get()).copied().unwrap_or(tag.inner)
        } else {
            tag.inner
        };
        RawAllocation::new(block.address(), block.bytes(), block.align(), block.device(), inner_tag)
    }

    /// The governed view of an inner block.
    fn wrap(&self, block: RawAllocation, role: MemoryRole, quarantined: bool) -> RawAllocation {
        let inner = block.provider_tag();
        let wide = inner > INNER;
        if wide {
            lock(&self.wide).insert(block.address().get(), inner);
        }
        let tag = Tag { role, quarantined, wide, inner: if wide { 0 } else { inner } };
        RawAllocation::new(block.address(), block.bytes(), block.align(), block.device(), tag.encode())
    }

    fn forget(&self, block: &RawAllocation, tag: Tag) {
        if tag.wide {
            lock(&self.wide).remove(&block.address().get());
        }
        if tag.quarantined {
            lock(&self.quarantined).remove(&block.address().get());
        }
    }

    /// Bytes still charged for a block.
    fn charged(&self, block: &RawAllocation, tag: Tag) -> u64 {
        if tag.quarantined {
            lock(&self.quarantined).get(&block.address().get()).copied().unwrap_or(0)
        } else {
            block.bytes() as u64
        }
    }
}

fn capability_gone(what: &'static str) -> CapabilityError {
    CapabilityError::Unsupported { allocator: "the governed allocator's inner allocator".to_owned(), what }
}

fn not_ours(name: &str, block: &RawAllocation) -> CapabilityError {
    CapabilityError::NotOwned { allocator: name.to_owned(), address: block.address().get() }
}

/// Forwards capability calls with the inner allocator's view of each block.
struct Forward {
    inner: Arc<dyn DeviceAllocator>,
    tables: Arc<Tables>,
    name: String,
}

impl Forward {
    fn view(&self, block: &RawAllocation) -> Result<RawAllocation, CapabilityError> {
        let tag = Tag::decode(block.provider_tag()).ok_or_else(|| not_ours(&self.name, block))?;
        Ok(self.tables.inner_view(block, tag))
    }

    fn virtual_backing(&self) -> Result<&dyn VirtualBacking, CapabilityError> {
        self.inner.virtual_backing().ok_or_else(|| capability_gone("virtual_backing"))
    }

    fn shared_mapping(&self) -> Result<&dyn SharedMapping, CapabilityError> {
        self.inner.shared_mapping().ok_or_else(|| capability_gone("shared_mapping"))
    }
}

impl VirtualBacking for Forward {
    fn granularity(&self) -> usize {
        self.inner.virtual_backing().map_or(1, |backing| backing.granularity())
    }

    fn commit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.virtual_backing()?.commit(&self.view(allocation)?, range)
    }

    fn decommit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.virtual_backing()?.decommit(&self.view(allocation)?, range)
    }

    fn committed_bytes(&self, allocation: &RawAllocation) -> Result<usize, CapabilityError> {
        self.virtual_backing()?.committed_bytes(&self.view(allocation)?)
    }
}

impl SharedMapping for Forward {
    fn granularity(&self) -> usize {
        self.inner.shared_mapping().map_or(1, |mapping| mapping.granularity())
    }

    fn create_backing(&self, bytes: usize) -> Result<SharedBacking, CapabilityError> {
        self.shared_mapping()?.create_backing(bytes)
    }

    fn map(
        &self,
        backing: &SharedBacking,
        allocation: &RawAllocation,
        placement: SharedPlacement,
        access: MappingAccess,
    ) -> Result<(), CapabilityError> {
        self.shared_mapping()?.map(backing, &self.view(allocation)?, placement, access)
    }

    fn unmap(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.shared_mapping()?.unmap(&self.view(allocation)?, range)
    }
}

/// Wraps any [`DeviceAllocator`] and charges each allocation to an account. Register
/// it in the `BindingRegistry` like any allocator: identity and governance compose.
/// The accounting rules are written down in `docs/ACCOUNTING.md`.
pub struct GovernedAllocator {
    account: Account,
    tables: Arc<Tables>,
    forward: Forward,
    has_virtual: bool,
    has_shared: bool,
}

impl fmt::Debug for GovernedAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GovernedAllocator")
            .field("inner", &self.forward.inner.name())
            .field("account", &self.account)
            .finish()
    }
}

impl GovernedAllocator {
    /// Governs `inner` with `account`.
    ///
    /// # Errors
    /// [`GovernError`] (handing `inner` back) when `inner` serves another device.
    pub fn new(inner: Arc<dyn DeviceAllocator>, account: Account) -> Result<GovernedAllocator, GovernError> {
        if inner.device() != account.device() {
            let failure = GovernFailure::DeviceMismatch {
                allocator: inner.name().to_owned(),
                allocator_device: inner.device(),
                authority: account.authority(),
                account_device: account.device(),
            };
            return Err(GovernError { failure, allocator: inner });
        }
        let tables = Arc::new(Tables::default());
        let has_virtual = inner.virtual_backing().is_some();
        let has_shared = inner.shared_mapping().is_some();
        let name = format!("governed({})", inner.name());
        Ok(GovernedAllocator {
            account,
            forward: Forward { inner, tables: Arc::clone(&tables), name },
            tables,
            has_virtual,
            has_shared,
        })
    }

    /// The account charged.
    pub fn account(&self) -> &Account {
        &self.account
    }

    /// The wrapped allocator.
    pub fn inner(&self) -> &Arc<dyn DeviceAllocator> {
        &self.forward.inner
    }

    /// Allocates like [`DeviceAllocator::allocate`], with the governor's own error.
    ///
    /// # Errors
    /// [`GovernedAllocError::Refused`] when the account cannot hold the request;
    /// [`GovernedAllocError::Allocator`] when the inner allocator fails (the charge
    /// is cancelled then).
    pub fn try_allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, GovernedAllocError> {
        let role = request.role();
        let bytes = request.bytes() as u64;
        self.account.charge(role, bytes).map_err(GovernedAllocError::Refused)?;
        // Cancels the charge if the inner allocator fails or panics.
        let mut charge = PendingCharge { account: &self.account, role, bytes, armed: true };
        let block = match self.forward.inner.allocate(request) {
            Ok(block) => block,
            Err(error) => return Err(GovernedAllocError::Allocator(error)),
        };
        charge.armed = false;
        // The contract says the block has the requested size; keep the books exact if not.
        let actual = block.bytes() as u64;
        if actual > bytes {
            if let Err(refusal) = self.account.grow(role, bytes, actual - bytes) {
                let outcome = self.forward.inner.release(block);
                if outcome.is_complete() {
                    self.account.cancel(role, bytes);
                } else {
                    tracing::warn!(allocator = %self.forward.name, outcome = %outcome.summary(),
                        "could not undo an oversized allocation; its charge stays");
                }
                return Err(GovernedAllocError::Refused(refusal));
            }
        } else if actual < bytes {
            self.account.refund(role, bytes - actual, false);
        }
        Ok(self.tables.wrap(block, role, false))
    }
}

/// A charge made for an allocation the inner allocator has not returned yet: dropped
/// (on an error or an unwinding panic), it cancels the charge.
struct PendingCharge<'a> {
    account: &'a Account,
    role: MemoryRole,
    bytes: u64,
    armed: bool,
}

impl Drop for PendingCharge<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.account.cancel(self.role, self.bytes);
        }
    }
}

/// Why [`GovernedAllocator::try_allocate`] failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GovernedAllocError {
    /// The governor refused the charge; the inner allocator was not called.
    #[error(transparent)]
    Refused(AdmissionError),
    /// The inner allocator failed; the charge was cancelled.
    #[error(transparent)]
    Allocator(AllocError),
}

impl GovernedAllocError {
    /// This error through the `DeviceAllocator` interface: a refusal becomes an
    /// [`AllocError::AdmissionRefused`] whose detail is the full message (tier, device,
    /// authority, role, sizes, largest holder, what to change).
    pub fn into_alloc_error(self, device: DeviceKey) -> AllocError {
        match self {
            GovernedAllocError::Allocator(error) => error,
            GovernedAllocError::Refused(refusal) => {
                AllocError::AdmissionRefused { device, detail: refusal.to_string() }
            }
        }
    }
}

impl DeviceAllocator for GovernedAllocator {
    fn device(&self) -> DeviceKey {
        self.forward.inner.device()
    }

    fn name(&self) -> &str {
        &self.forward.name
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.try_allocate(request).map_err(|error| error.into_alloc_error(self.device()))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let Some(tag) = Tag::decode(allocation.provider_tag()) else {
            let error = ReleaseError::NotOwned {
                allocator: self.forward.name.clone(),
                device: self.device(),
                address: allocation.address().get(),
            };
            return ReleaseOutcome::failed(allocation, error);
        };
        let charged = self.tables.charged(&allocation, tag);
        let inner = self.tables.inner_view(&allocation, tag);
        let stats = self.account.role_stats(tag.role);
        match self.forward.inner.release(inner) {
            ReleaseOutcome::Complete(done) => {
                self.tables.forget(&allocation, tag);
                if tag.quarantined {
                    stats.quarantined.fetch_sub(charged, Ordering::Relaxed);
                }
                self.account.refund(tag.role, charged, true);
                ReleaseOutcome::Complete(done)
            }
            ReleaseOutcome::Quarantined(quarantine) => {
                let keep = (quarantine.residual_bytes() as u64).min(charged);
                let unmapped = quarantine.unmapped_bytes();
                let residual = quarantine.residual_bytes();
                lock(&self.tables.quarantined).insert(allocation.address().get(), keep);
                if tag.quarantined {
                    stats.quarantined.fetch_sub(charged, Ordering::Relaxed);
                }
                stats.quarantined.fetch_add(keep, Ordering::Relaxed);
                self.account.refund(tag.role, charged - keep, false);
                tracing::warn!(
                    allocator = %self.forward.name, authority = %self.account.authority(), role = %tag.role,
                    refunded = charged - keep, still_charged = keep, "quarantined release: residual stays charged"
                );
                let (block, error) = quarantine.into_parts();
                let block = self.tables.wrap(block, tag.role, true);
                ReleaseOutcome::quarantined(block, unmapped, residual, error)
            }
            ReleaseOutcome::Failed(failed) => {
                let (block, error) = failed.into_parts();
                if tag.wide {
                    lock(&self.tables.wide).remove(&block.address().get());
                }
                ReleaseOutcome::failed(self.tables.wrap(block, tag.role, tag.quarantined), error)
            }
        }
    }

    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        self.has_virtual.then_some(&self.forward as &dyn VirtualBacking)
    }

    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        self.has_shared.then_some(&self.forward as &dyn SharedMapping)
    }

    fn stats(&self) -> Option<AllocatorStats> {
        self.forward.inner.stats()
    }

    fn trim(&self) -> usize {
        self.forward.inner.trim()
    }

    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        let mut inner = Vec::with_capacity(lost.len());
        for block in lost {
            let Some(tag) = Tag::decode(block.provider_tag()) else {
                tracing::error!(allocator = %self.forward.name, block = ?block, "lost block was not made here; not refunded");
                continue;
            };
            let charged = self.tables.charged(&block, tag);
            let view = self.tables.inner_view(&block, tag);
            self.tables.forget(&block, tag);
            let stats = self.account.role_stats(tag.role);
            if tag.quarantined {
                stats.quarantined.fetch_sub(charged, Ordering::Relaxed);
            }
            stats.lost_bytes.fetch_add(charged, Ordering::Relaxed);
            stats.lost_allocations.fetch_add(1, Ordering::Relaxed);
            self.account.refund(tag.role, charged, true);
            if self.account.timeline().enabled() {
                self.account.timeline().record(
                    TimelineEventKind::Lost,
                    self.account.device(),
                    self.account.authority(),
                    tag.role,
                    charged,
                );
            }
            inner.push(view);
        }
        tracing::info!(allocator = %self.forward.name, authority = %self.account.authority(), blocks = inner.len(),
            "lost blocks refunded after termination");
        self.forward.inner.forget_lost(inner);
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_every_role_and_flag() {
        for role in MemoryRole::ALL {
            for (quarantined, wide, inner) in
                [(false, false, 0), (true, false, INNER), (false, true, 0), (true, true, 7)]
            {
                let tag = Tag { role, quarantined, wide, inner };
                let back = Tag::decode(tag.encode()).expect("a governed tag");
                assert_eq!((back.role, back.quarantined, back.wide, back.inner), (role, quarantined, wide, inner));
            }
        }
        assert!(Tag::decode(0).is_none(), "an untagged block is not ours");
        assert!(Tag::decode(7 << ROLE_SHIFT).is_none(), "no role has ordinal 6");
    }

    #[test]
    fn wide_inner_tags_are_kept_aside_and_restored() {
        let tables = Tables::default();
        let address = memory_api::DeviceAddress::new(0x4000).unwrap();
        let inner = RawAllocation::new(address, 64, 8, DeviceKey::HOST, u64::MAX);
        let governed = tables.wrap(inner, MemoryRole::KvCache, false);
        let tag = Tag::decode(governed.provider_tag()).unwrap();
        assert!(tag.wide);
        assert_eq!(tables.inner_view(&governed, tag).provider_tag(), u64::MAX);
        tables.forget(&governed, tag);
        assert!(lock(&tables.wide).is_empty());
    }
}
