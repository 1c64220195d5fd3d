//! The governor: device books, accounts, policies, reclaim holders, snapshots.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::sync::atomic::Ordering as StdOrdering;

use memory_api::{AuthorityIdentity, DeviceAllocator, DeviceKey, MemoryRole};

use crate::allocator::{CacheBacking, GovernedAllocator};
use crate::credit::{self, AccountCounters, DeviceCounters, MAX_CHUNK, Path, ROLES, Short, Slot, SlotLists, UNLIMITED};
use crate::error::{
    AccountError, AdmissionError, Exhaustion, Footprint, GovernError, GovernFailure, HolderReport, LeaseRequestError,
    LimitError, LimitScope, PolicyError,
};
use crate::footprint::{Caches, Idle};
use crate::overdraft::{DEFAULT_OVERDRAFT_LIMIT, OverdraftBooks, OverdraftDraw, OverdraftRefused};
use crate::peaks::{Bound, Charges, PEAK_SLACK, Tally};
use crate::policy::{AdmissionPolicy, HardLimit, Shortfall, ShortfallDecision};
use crate::reclaim::{HolderId, ReclaimHolder, ReclaimRequest, Reclaiming};
use crate::stats::{
    self, AccountSnapshot, CacheSnapshot, DeviceSnapshot, GovernorSnapshot, HolderSnapshot, LadderSnapshot,
    ReserveSnapshot, RoleSnapshot, Totals,
};
use crate::sync::{Arc, AtomicU64, IdCounter, Mutex, Ordering, RwLock, lock, read, thread_local, write};
use crate::timeline::{Timeline, TimelineEvent, TimelineEventKind};

/// The largest charge one lease or allocation may hold: 2^56 - 1 bytes (64 PiB), the
/// most the books count per role and device. Larger requests are
/// [`AdmissionError::Overflow`] errors.
pub const MAX_CHARGE: u64 = credit::ROLE_USED;

/// Tunables of a [`Governor`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GovernorConfig {
    credit_chunk: u64,
    overdraft_limit: u64,
}

impl Default for GovernorConfig {
    fn default() -> GovernorConfig {
        GovernorConfig { credit_chunk: 4 << 20, overdraft_limit: DEFAULT_OVERDRAFT_LIMIT }
    }
}

impl GovernorConfig {
    /// Bytes of credit a thread draws at once per account and role (default 4 MiB; a
    /// thread caches at most two chunks). Zero turns caching off: every charge and
    /// refund then writes the shared books (exact `current` at every instant, but two
    /// threads contend on one cache line).
    #[must_use]
    pub fn with_credit_chunk(mut self, bytes: u64) -> GovernorConfig {
        self.credit_chunk = bytes.min(MAX_CHUNK);
        self
    }

    /// The former name of [`GovernorConfig::with_credit_chunk`].
    #[deprecated(note = "builders are named with_*: use with_credit_chunk")]
    #[must_use]
    pub fn credit_chunk(self, bytes: u64) -> GovernorConfig {
        self.with_credit_chunk(bytes)
    }

    /// The configured credit chunk.
    pub fn chunk(&self) -> u64 {
        self.credit_chunk
    }

    /// The overdraft limit every device starts with ([`DEFAULT_OVERDRAFT_LIMIT`] unless
    /// set): the most bytes adapters may hold on a device past refusals at once (see
    /// [`Account::draw_overdraft`]). Zero allows no overdraft.
    #[must_use]
    pub fn with_overdraft_limit(mut self, bytes: u64) -> GovernorConfig {
        self.overdraft_limit = bytes;
        self
    }

    /// The configured overdraft limit of new devices.
    pub fn overdraft_limit(&self) -> u64 {
        self.overdraft_limit
    }
}

/// How an account is opened: device, authority, quota and label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccountConfig {
    device: DeviceKey,
    authority: AuthorityIdentity,
    quota: u64,
    label: Option<String>,
}

impl AccountConfig {
    /// An account for `authority` on `device`, without a quota of its own (bounded by
    /// the device limit only).
    pub fn new(device: DeviceKey, authority: AuthorityIdentity) -> AccountConfig {
        AccountConfig { device, authority, quota: UNLIMITED, label: None }
    }

    /// Caps the account at `bytes` (nested inside the device limit).
    #[must_use]
    pub fn with_quota(mut self, bytes: u64) -> AccountConfig {
        self.quota = bytes;
        self
    }

    /// A human-readable name for messages and snapshots (default: the authority).
    #[must_use]
    pub fn with_label(mut self, label: impl Into<String>) -> AccountConfig {
        self.label = Some(label.into());
        self
    }

    /// The former name of [`AccountConfig::with_quota`].
    #[deprecated(note = "builders are named with_*: use with_quota")]
    #[must_use]
    pub fn quota(self, bytes: u64) -> AccountConfig {
        self.with_quota(bytes)
    }

    /// The former name of [`AccountConfig::with_label`].
    #[deprecated(note = "builders are named with_*: use with_label")]
    #[must_use]
    pub fn label(self, label: impl Into<String>) -> AccountConfig {
        self.with_label(label)
    }
}

fn limit_of(raw: u64) -> Option<u64> {
    (raw != UNLIMITED).then_some(raw)
}

struct HolderEntry {
    serial: u64,
    order: u32,
    holder: Arc<dyn ReclaimHolder>,
}

/// One device's books: budget, reserves, the slots of every thread's credit on it,
/// its policy and its reclaim holders.
pub(crate) struct DeviceBooks {
    key: DeviceKey,
    pub(crate) counters: Arc<DeviceCounters>,
    slots: Mutex<Vec<Arc<Slot>>>,
    policy: RwLock<Arc<dyn AdmissionPolicy>>,
    holders: RwLock<Vec<HolderEntry>>,
    /// The peak of real charges on the device (over every authority).
    charges: Arc<Charges>,
    /// Serialises limit, reserve and policy changes (never held with another lock).
    changes: Mutex<()>,
    pub(crate) timeline: Arc<Timeline>,
    /// What adapters hold on the device past refusals.
    overdraft: Arc<OverdraftBooks>,
    /// The allocators governed on the device (their caches) and what cache backings hold.
    pub(crate) caches: Caches,
}

impl DeviceBooks {
    fn new(key: DeviceKey, timeline: Arc<Timeline>, overdraft_limit: u64) -> DeviceBooks {
        let counters = Arc::new(DeviceCounters::new(UNLIMITED));
        DeviceBooks {
            key,
            counters: Arc::clone(&counters),
            slots: Mutex::new(Vec::new()),
            policy: RwLock::new(Arc::new(HardLimit)),
            holders: RwLock::new(Vec::new()),
            charges: Arc::new(Charges::new(Bound::Device(Arc::clone(&counters)))),
            changes: Mutex::new(()),
            timeline,
            overdraft: Arc::new(OverdraftBooks::new(overdraft_limit)),
            caches: Caches::new(),
        }
    }

    pub(crate) fn key(&self) -> DeviceKey {
        self.key
    }

    /// The device limit (`u64::MAX` when none is set).
    pub(crate) fn limit(&self) -> u64 {
        self.counters.budget.limit()
    }

    /// Bytes charged to the device's tenants: what its roles drew, less the credit its
    /// threads hold (cold: reads every slot).
    pub(crate) fn allocated(&self) -> u64 {
        let drawn = stats::sum(self.counters.roles.iter().map(|role| role.used()));
        let credit = stats::sum(lock(&self.slots).iter().map(|slot| slot.credit()));
        drawn.saturating_sub(credit)
    }

    /// The policy, copied out of its lock (so that it can be called with no lock held).
    fn policy(&self) -> Arc<dyn AdmissionPolicy> {
        Arc::clone(&*read(&self.policy))
    }

    /// The holders in reclaim order, copied out of their lock.
    fn holders(&self) -> Vec<(u32, Arc<dyn ReclaimHolder>)> {
        read(&self.holders).iter().map(|entry| (entry.order, Arc::clone(&entry.holder))).collect()
    }

    /// Asks the holders, in order and with no lock held, for `request.bytes`; returns
    /// the bytes they freed.
    fn reclaim(&self, request: ReclaimRequest) -> u64 {
        let mut freed = 0u64;
        for (order, holder) in self.holders() {
            let missing = request.bytes.saturating_sub(freed);
            if missing == 0 {
                break;
            }
            let got = holder.reclaim(&ReclaimRequest { bytes: missing, ..request });
            tracing::debug!(
                device = %self.key, holder = holder.name(), order, asked = missing, freed = got,
                "reclaim holder asked"
            );
            freed = freed.saturating_add(got);
        }
        tracing::info!(
            device = %self.key, authority = %request.authority, role = %request.role,
            asked = request.bytes, freed, "reclaim finished"
        );
        freed
    }

    /// The holder that says it could free the most (asked with no lock held).
    fn largest_holder(&self) -> Option<HolderReport> {
        self.holders()
            .into_iter()
            .map(|(order, holder)| HolderReport {
                name: holder.name().to_owned(),
                reclaimable: holder.reclaimable(self.key),
                order,
            })
            .max_by(|a, b| a.reclaimable.cmp(&b.reclaimable).then(b.order.cmp(&a.order)))
    }
}

/// Per-role figures of an account that live outside the credit protocol (cold path).
#[derive(Debug)]
pub(crate) struct RoleStats {
    pub(crate) failures: AtomicU64,
    pub(crate) quarantined: AtomicU64,
    pub(crate) lost_bytes: AtomicU64,
    pub(crate) lost_allocations: AtomicU64,
    /// Opened/closed counts of slots whose thread has gone, and of charges made without
    /// a slot (during thread teardown).
    retired_opened: AtomicU64,
    retired_closed: AtomicU64,
}

impl RoleStats {
    fn new() -> RoleStats {
        RoleStats {
            failures: AtomicU64::new(0),
            quarantined: AtomicU64::new(0),
            lost_bytes: AtomicU64::new(0),
            lost_allocations: AtomicU64::new(0),
            retired_opened: AtomicU64::new(0),
            retired_closed: AtomicU64::new(0),
        }
    }
}

/// Uids for accounts, so a thread can find its slots (not part of any protocol).
static NEXT_ACCOUNT: IdCounter = IdCounter::new(1);

pub(crate) struct AccountShared {
    uid: u64,
    authority: AuthorityIdentity,
    label: String,
    chunk: u64,
    pub(crate) device: Arc<DeviceBooks>,
    counters: Arc<AccountCounters>,
    slots: Mutex<Vec<Arc<Slot>>>,
    pub(crate) roles: [RoleStats; ROLES],
    /// Peaks of real charges: per role, and of the account.
    role_charges: [Arc<Charges>; ROLES],
    charges: Arc<Charges>,
    /// How far a thread's tally of charges may drift before it is published.
    peak_slack: u64,
    /// What adapters hold for this account past refusals.
    overdraft: Arc<OverdraftBooks>,
}

/// One thread's slot for one role of one account, and its tallies of the charges of
/// the role, the account and the device (the latter two shared with the thread's other
/// slots on them).
struct ThreadSlot {
    account: u64,
    role: usize,
    slot: Arc<Slot>,
    tallies: [Rc<Tally>; 3],
}

impl ThreadSlot {
    // Always inlined: on the fast path, a call costs as much as the three tallies.
    #[inline(always)]
    fn charged(&self, bytes: u64, slack: u64) {
        let [role, account, device] = &self.tallies;
        role.charge(bytes, slack);
        account.charge(bytes, slack);
        device.charge(bytes, slack);
    }

    #[inline(always)]
    fn refunded(&self, bytes: u64, slack: u64) {
        let [role, account, device] = &self.tallies;
        role.refund(bytes, slack);
        account.refund(bytes, slack);
        device.refund(bytes, slack);
    }
}

/// The calling thread's slots and tallies. When the thread ends, each tally is
/// published and each slot's credit goes back.
#[derive(Default)]
struct ThreadSlots {
    entries: Vec<ThreadSlot>,
    tallies: Vec<Rc<Tally>>,
}

impl Drop for ThreadSlots {
    fn drop(&mut self) {
        for tally in &self.tallies {
            tally.flush();
        }
        for entry in self.entries.drain(..) {
            entry.slot.retire();
        }
    }
}

thread_local! {
    static THREAD_SLOTS: RefCell<ThreadSlots> = RefCell::new(ThreadSlots::default());
}

/// Folds the counts of retired slots into `roles` and drops them from `slots`.
fn prune_retired(slots: &mut Vec<Arc<Slot>>, roles: &[RoleStats; ROLES]) {
    slots.retain(|slot| {
        if !slot.is_retired() {
            return true;
        }
        let (opened, closed) = slot.counts();
        let stats = &roles[slot.role()];
        stats.retired_opened.fetch_add(opened, Ordering::Relaxed);
        stats.retired_closed.fetch_add(closed, Ordering::Relaxed);
        false
    });
}

impl AccountShared {
    fn path(&self, role: usize) -> Path<'_> {
        Path { account: &self.counters, device: &self.device.counters, role }
    }

    fn lists(&self) -> SlotLists<'_> {
        SlotLists { account: &self.slots, device: &self.device.slots }
    }

    fn register_slot(&self, role: usize) -> Arc<Slot> {
        let slot = Arc::new(Slot::new(Arc::clone(&self.counters), Arc::clone(&self.device.counters), role));
        {
            let mut slots = lock(&self.slots);
            prune_retired(&mut slots, &self.roles);
            slots.push(Arc::clone(&slot));
        }
        {
            let mut slots = lock(&self.device.slots);
            slots.retain(|slot| !slot.is_retired());
            slots.push(Arc::clone(&slot));
        }
        slot
    }

    /// The three levels a charge of `role` counts in: the role's, the account's and
    /// the device's charges.
    fn levels(&self, role: usize) -> [&Arc<Charges>; 3] {
        [&self.role_charges[role], &self.charges, &self.device.charges]
    }

    /// Runs `f` on the calling thread's slot for `role` and its tallies, creating them
    /// on first use. `None` while the thread is being torn down (its slots are gone).
    #[inline(always)]
    fn with_thread<R>(&self, role: usize, f: impl FnOnce(&ThreadSlot) -> R) -> Option<R> {
        THREAD_SLOTS
            .try_with(|cell| {
                let mut slots = cell.try_borrow_mut().ok()?;
                let index = match slots.entries.iter().position(|e| e.account == self.uid && e.role == role) {
                    Some(index) => index,
                    None => self.add_thread_slot(&mut slots, role),
                };
                slots.entries.get(index).map(f)
            })
            .ok()
            .flatten()
    }

    /// Gives the calling thread a slot for `role` (its first charge or refund of the
    /// role on this account); its index in `slots.entries`.
    #[cold]
    #[inline(never)]
    fn add_thread_slot(&self, slots: &mut ThreadSlots, role: usize) -> usize {
        let slot = self.register_slot(role);
        let tallies = self.levels(role).map(|charges| {
            let known = slots.tallies.iter().find(|tally| tally.counts(charges)).cloned();
            known.unwrap_or_else(|| {
                let tally = Rc::new(Tally::new(Arc::clone(charges)));
                slots.tallies.push(Rc::clone(&tally));
                tally
            })
        });
        slots.entries.push(ThreadSlot { account: self.uid, role, slot, tallies });
        slots.entries.len() - 1
    }

    /// Runs `f` on the calling thread's slot for `role` (see [`AccountShared::with_thread`]).
    #[inline]
    fn with_slot<R>(&self, role: usize, f: impl FnOnce(&Slot) -> R) -> Option<R> {
        self.with_thread(role, |entry| f(&entry.slot))
    }

    /// Counts a charge made on the slow path in the calling thread's tallies.
    fn tally_charge(&self, role: usize, bytes: u64) {
        if self.with_thread(role, |entry| entry.charged(bytes, self.peak_slack)).is_none() {
            for charges in self.levels(role) {
                charges.publish_now(bytes as i64);
            }
        }
    }

    /// One admission attempt: the thread's credit, then a chunk or an exact draw, then
    /// pulling back other threads' credit. No policy, no callback.
    fn admit(&self, role: usize, bytes: u64) -> Result<(), Short> {
        let chunk = self.chunk;
        let first = self.with_slot(role, |slot| {
            if slot.admit_fast(bytes) {
                return Ok(());
            }
            slot.admit_slow(bytes, chunk)
        });
        match first {
            Some(Ok(())) => return Ok(()),
            Some(Err(_)) => {}
            None => {
                // No slot (thread teardown): draw directly and count here.
                if self.path(role).draw(bytes, 0).is_ok() {
                    self.roles[role].retired_opened.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
            }
        }
        let drained = credit::admit_draining(self.path(role), bytes, self.lists());
        if drained.is_ok() {
            // The drain drew straight from the books: count the charge on the slot.
            self.count_open(role);
        }
        drained
    }

    fn count_open(&self, role: usize) {
        if self.with_slot(role, Slot::count_open).is_none() {
            self.roles[role].retired_opened.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn shortfall(&self, role: MemoryRole, requested: u64, short: Short) -> (Shortfall, u64, u64) {
        let (scope, used, limit) = match short {
            Short::Account { used, limit } => (LimitScope::Authority, used, limit),
            Short::Device { used, limit } | Short::Overflow { used, limit } => (LimitScope::Device, used, limit),
        };
        let mut available = limit.saturating_sub(used);
        if scope == LimitScope::Device {
            available = available.saturating_add(self.device.counters.roles[role.ordinal()].held());
        }
        let shortfall =
            Shortfall { device: self.device.key, authority: self.authority, role, requested, scope, available };
        (shortfall, used, limit)
    }

    /// The slow path after a refused attempt: the policy, reclaim and one retry.
    #[cold]
    fn admit_with_policy(&self, role: MemoryRole, bytes: u64, short: Short) -> Result<(), AdmissionError> {
        let r = role.ordinal();
        if let Short::Overflow { used, limit } = short {
            return Err(AdmissionError::Overflow { role, requested: bytes, held: used, max: limit });
        }
        let policy = self.device.policy();
        let (shortfall, _, _) = self.shortfall(role, bytes, short);
        let mut last = short;
        let reclaimed = match policy.on_shortfall(&shortfall) {
            ShortfallDecision::Reclaim => {
                // A holder asking for memory from inside its own reclaim: asking the
                // holders again would recurse.
                let Some(reclaiming) = Reclaiming::enter() else {
                    return Err(self.refuse(role, bytes, last, None, &*policy, true));
                };
                let freed = self.device.reclaim(ReclaimRequest {
                    device: self.device.key,
                    bytes: shortfall.missing(),
                    role,
                    authority: self.authority,
                });
                drop(reclaiming);
                if self.device.timeline.enabled() {
                    self.device.timeline.record(
                        TimelineEventKind::Reclaim,
                        self.device.key,
                        self.authority,
                        role,
                        freed,
                    );
                }
                match self.admit(r, bytes) {
                    Ok(()) => return Ok(()),
                    Err(short) => last = short,
                }
                Some(freed)
            }
            ShortfallDecision::Fail => None,
        };
        Err(self.refuse(role, bytes, last, reclaimed, &*policy, false))
    }

    /// Counts, logs and explains a refused admission.
    #[cold]
    fn refuse(
        &self,
        role: MemoryRole,
        bytes: u64,
        last: Short,
        reclaimed: Option<u64>,
        policy: &dyn AdmissionPolicy,
        reentered: bool,
    ) -> AdmissionError {
        self.roles[role.ordinal()].failures.fetch_add(1, Ordering::Relaxed);
        let (shortfall, used, limit) = self.shortfall(role, bytes, last);
        let exhaustion = Exhaustion {
            tier: self.device.key.tier(),
            device: self.device.key,
            authority: self.authority,
            account: self.label.clone(),
            role,
            requested: bytes,
            scope: shortfall.scope,
            used,
            limit,
            available: shortfall.available,
            reclaimed,
            largest_holder: self.device.largest_holder(),
            policy: policy.name().to_owned(),
            footprint: self.footprint(None),
        };
        tracing::warn!(
            tier = %exhaustion.tier, device = %exhaustion.device, authority = %exhaustion.authority,
            account = %exhaustion.account, role = %role, requested = bytes, scope = %exhaustion.scope,
            used, limit, available = exhaustion.available, reclaimed = ?reclaimed,
            largest_holder = ?exhaustion.largest_holder.as_ref().map(|h| &h.name), reentered,
            "admission refused"
        );
        if self.device.timeline.enabled() {
            self.device.timeline.record(TimelineEventKind::Refusal, self.device.key, self.authority, role, bytes);
        }
        if reentered {
            AdmissionError::ReentrantReclaim(Box::new(exhaustion))
        } else {
            AdmissionError::Exhausted(Box::new(exhaustion))
        }
    }

    /// Bytes charged to this account (cold: reads its slots).
    fn allocated(&self) -> u64 {
        let drawn = stats::sum(self.counters.roles.iter().map(|role| role.used()));
        let credit = stats::sum(lock(&self.slots).iter().map(|slot| slot.credit()));
        drawn.saturating_sub(credit)
    }

    /// Allocated vs reserved on the device and for this account, asking every cache of
    /// the device for its figures (no lock held). `trimmed`: what the ladder's first
    /// rung got back, when it ran.
    pub(crate) fn footprint(&self, trimmed: Option<u64>) -> Footprint {
        let caches = self.device.caches.poll();
        let device = Idle::of(&caches);
        let own = Idle::of(caches.iter().filter(|cache| cache.authority == self.authority));
        let device_allocated = self.device.allocated();
        let tenant_allocated = self.allocated();
        let device_reserved = device_allocated.saturating_add(device.cached);
        self.device.caches.observe(device_reserved);
        Footprint {
            device_allocated,
            device_reserved,
            device_cached: device.cached,
            tenant_allocated,
            tenant_reserved: tenant_allocated.saturating_add(own.cached),
            largest_free: device.largest_free,
            trimmed,
        }
    }

    fn snapshot(&self) -> AccountSnapshot {
        let mut roles: Vec<RoleSnapshot> = MemoryRole::ALL.iter().map(|&role| RoleSnapshot::empty(role)).collect();
        {
            let mut slots = lock(&self.slots);
            prune_retired(&mut slots, &self.roles);
            for slot in slots.iter() {
                let role = &mut roles[slot.role()];
                let (opened, closed) = slot.counts();
                role.cached_credit = role.cached_credit.saturating_add(slot.credit());
                role.allocations = role.allocations.wrapping_add(opened);
                role.releases = role.releases.wrapping_add(closed);
            }
        }
        for (r, role) in roles.iter_mut().enumerate() {
            let counter = &self.counters.roles[r];
            let stats = &self.roles[r];
            role.allocations = role.allocations.wrapping_add(stats.retired_opened.load(Ordering::Relaxed));
            role.releases = role.releases.wrapping_add(stats.retired_closed.load(Ordering::Relaxed));
            // Counts are read slot by slot while threads may be counting: a release
            // counted on one slot can be seen before its allocation on another.
            role.live = role.allocations.saturating_sub(role.releases);
            role.current = counter.used().saturating_sub(role.cached_credit);
            role.peak = self.role_charges[r].peak();
            role.peak_used = counter.peak();
            role.failures = stats.failures.load(Ordering::Relaxed);
            role.quarantined_bytes = stats.quarantined.load(Ordering::Relaxed);
            role.lost_bytes = stats.lost_bytes.load(Ordering::Relaxed);
            role.lost_allocations = stats.lost_allocations.load(Ordering::Relaxed);
        }
        let current = stats::sum(roles.iter().map(|r| r.current));
        let own = self.device.caches.poll();
        let cached = Idle::of(own.iter().filter(|cache| cache.authority == self.authority)).cached;
        AccountSnapshot {
            authority: self.authority.to_string(),
            label: self.label.clone(),
            quota: limit_of(self.counters.budget.limit()),
            current,
            used: self.counters.budget.used(),
            peak: self.charges.peak(),
            peak_used: self.counters.budget.peak(),
            cached_credit: stats::sum(roles.iter().map(|r| r.cached_credit)),
            totals: Totals::of(&roles),
            roles,
            overdraft: self.overdraft.snapshot(false),
            allocated: current,
            cached,
            reserved: current.saturating_add(cached),
        }
    }
}

/// A handle to one authority's account on one device. Cheap to clone.
///
/// Charges go through [`Account::lease`] (or a [`GovernedAllocator`]); each is drawn
/// from the calling thread's credit when it can be, so admissions on different threads
/// do not contend.
#[derive(Clone)]
pub struct Account {
    shared: Arc<AccountShared>,
}

impl std::fmt::Debug for Account {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Account")
            .field("authority", &self.shared.authority)
            .field("label", &self.shared.label)
            .field("device", &self.shared.device.key)
            .finish()
    }
}

impl Account {
    /// The authority charged.
    pub fn authority(&self) -> AuthorityIdentity {
        self.shared.authority
    }

    /// The device of the account.
    pub fn device(&self) -> DeviceKey {
        self.shared.device.key
    }

    /// The account's label.
    pub fn label(&self) -> &str {
        &self.shared.label
    }

    /// The quota, `None` when unlimited.
    pub fn quota(&self) -> Option<u64> {
        limit_of(self.shared.counters.budget.limit())
    }

    /// Bytes drawn from the quota right now: charges plus credit threads cache. Never
    /// above the quota, except right after the quota was lowered under it.
    pub fn used(&self) -> u64 {
        self.shared.counters.budget.used()
    }

    /// Bytes drawn from the account's device budget right now (all authorities, cached
    /// credit and held reserves included). Never above the device limit, except right
    /// after the limit was lowered under it.
    pub fn device_used(&self) -> u64 {
        self.shared.device.counters.budget.used()
    }

    /// This account's current figures.
    pub fn snapshot(&self) -> AccountSnapshot {
        self.shared.snapshot()
    }

    /// Allocated vs reserved on the account's device and for this account, right now
    /// (cold: asks every cache of the device for its figures).
    pub fn footprint(&self) -> Footprint {
        self.shared.footprint(None)
    }

    /// [`Account::footprint`], noting what the ladder's first rung got back.
    pub(crate) fn footprint_after(&self, trimmed: Option<u64>) -> Footprint {
        self.shared.footprint(trimmed)
    }

    /// The device books (the ladder's caches and reclaim holders).
    pub(crate) fn device_books(&self) -> &Arc<DeviceBooks> {
        &self.shared.device
    }

    /// Rung (b) of the ladder: asks the device's reclaim holders, in order and with no
    /// lock held, for `bytes`. `None` when this thread is already inside a holder's
    /// reclaim (asking again would recurse).
    pub(crate) fn reclaim_for_ladder(&self, role: MemoryRole, bytes: u64) -> Option<u64> {
        let reclaiming = Reclaiming::enter()?;
        let shared = &*self.shared;
        let freed = shared.device.reclaim(ReclaimRequest {
            device: shared.device.key,
            bytes,
            role,
            authority: shared.authority,
        });
        drop(reclaiming);
        self.record_event(TimelineEventKind::Reclaim, role, freed);
        Some(freed)
    }

    /// Records a ladder event on the device's timeline (when it is on).
    pub(crate) fn record_event(&self, kind: TimelineEventKind, role: MemoryRole, bytes: u64) {
        let shared = &*self.shared;
        if shared.device.timeline.enabled() {
            shared.device.timeline.record(kind, shared.device.key, shared.authority, role, bytes);
        }
    }

    /// Rung (c) of the ladder: the refusal of an allocation of `bytes` whose block
    /// would keep what the process holds on the device over its limit after the
    /// caches were trimmed and the holders asked.
    pub(crate) fn refuse_over_reserved(
        &self,
        role: MemoryRole,
        bytes: u64,
        footprint: Footprint,
        reclaimed: Option<u64>,
    ) -> AdmissionError {
        let shared = &*self.shared;
        shared.roles[role.ordinal()].failures.fetch_add(1, Ordering::Relaxed);
        shared.device.caches.count_over_reserved();
        let limit = shared.device.limit();
        let exhaustion = Exhaustion {
            tier: shared.device.key.tier(),
            device: shared.device.key,
            authority: shared.authority,
            account: shared.label.clone(),
            role,
            requested: bytes,
            scope: LimitScope::Reserved,
            used: footprint.device_reserved,
            limit,
            available: limit.saturating_sub(footprint.device_reserved),
            reclaimed,
            largest_holder: shared.device.largest_holder(),
            policy: shared.device.policy().name().to_owned(),
            footprint,
        };
        tracing::warn!(
            device = %exhaustion.device, authority = %exhaustion.authority, role = %role, requested = bytes,
            reserved = footprint.device_reserved, allocated = footprint.device_allocated,
            cached = footprint.device_cached, trimmed = ?footprint.trimmed, reclaimed = ?reclaimed, limit,
            "allocation refused: what the process holds on the device would pass its limit"
        );
        self.record_event(TimelineEventKind::Refusal, role, bytes);
        AdmissionError::Exhausted(Box::new(exhaustion))
    }

    /// Draws `bytes` on the device's overdraft for this account: memory an adapter
    /// hands out *after* a refusal, because its client cannot take the refusal at
    /// once (ONNX Runtime in the middle of a run). Not a charge: the quota and the device
    /// limit are not consulted (they refused already); the device's overdraft limit
    /// bounds every account's draws together. Booked live and peak per device and
    /// account ([`DeviceSnapshot::overdraft`], [`AccountSnapshot::overdraft`]); the bytes
    /// come back when the draw is dropped.
    ///
    /// # Errors
    /// [`OverdraftRefused`] when the device's overdraft limit cannot hold `bytes` more.
    pub fn draw_overdraft(&self, bytes: u64) -> Result<OverdraftDraw, OverdraftRefused> {
        let shared = &*self.shared;
        let drawn = crate::overdraft::draw(
            shared.device.key,
            shared.authority,
            &shared.device.overdraft,
            &shared.overdraft,
            bytes,
        );
        match &drawn {
            Ok(_) => tracing::warn!(
                device = %shared.device.key, authority = %shared.authority, bytes, "overdraft drawn past a refusal"
            ),
            Err(refused) => tracing::warn!(%refused, "overdraft refused at the device's overdraft limit"),
        }
        drawn
    }

    /// Charges `bytes` of `role`, or explains why not. Nothing is charged on error.
    ///
    /// # Errors
    /// [`AdmissionError::Overflow`] above [`MAX_CHARGE`]; [`AdmissionError::Exhausted`]
    /// when the quota or the device limit cannot hold it after the policy had its say.
    #[inline]
    pub(crate) fn charge(&self, role: MemoryRole, bytes: u64) -> Result<(), AdmissionError> {
        let shared = &*self.shared;
        let r = role.ordinal();
        let fast = bytes <= MAX_CHARGE
            && shared
                .with_thread(r, |entry| {
                    let admitted = entry.slot.admit_fast(bytes);
                    if admitted {
                        entry.charged(bytes, shared.peak_slack);
                    }
                    admitted
                })
                .unwrap_or(false);
        if !fast {
            self.charge_slow(role, bytes)?;
        }
        if shared.device.timeline.enabled() {
            self.record_charge(role, bytes);
        }
        Ok(())
    }

    /// A charge the calling thread's credit could not admit: the shared books, then
    /// the policy.
    #[cold]
    #[inline(never)]
    fn charge_slow(&self, role: MemoryRole, bytes: u64) -> Result<(), AdmissionError> {
        if bytes > MAX_CHARGE {
            return Err(AdmissionError::Overflow { role, requested: bytes, held: 0, max: MAX_CHARGE });
        }
        let shared = &*self.shared;
        let r = role.ordinal();
        if let Err(short) = shared.admit(r, bytes) {
            shared.admit_with_policy(role, bytes, short)?;
        }
        shared.tally_charge(r, bytes);
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn record_charge(&self, role: MemoryRole, bytes: u64) {
        let shared = &*self.shared;
        shared.device.timeline.record(TimelineEventKind::Charge, shared.device.key, shared.authority, role, bytes);
    }

    /// Charges `extra` more bytes for an existing charge of `held` bytes (no new count).
    pub(crate) fn grow(&self, role: MemoryRole, held: u64, extra: u64) -> Result<(), AdmissionError> {
        if held.checked_add(extra).is_none_or(|total| total > MAX_CHARGE) {
            return Err(AdmissionError::Overflow { role, requested: extra, held, max: MAX_CHARGE });
        }
        self.charge(role, extra)?;
        // `charge` counted a new charge; this is the same one, grown.
        self.uncount_open(role);
        Ok(())
    }

    fn uncount_open(&self, role: MemoryRole) {
        let r = role.ordinal();
        if self.shared.with_slot(r, Slot::uncount_open).is_none() {
            self.shared.roles[r].retired_opened.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Refunds `bytes` of `role`; `close` counts the end of one charge.
    #[inline(always)]
    pub(crate) fn refund(&self, role: MemoryRole, bytes: u64, close: bool) {
        let shared = &*self.shared;
        let r = role.ordinal();
        let chunk = shared.chunk;
        let refunded = shared.with_thread(r, |entry| {
            entry.slot.refund(bytes, chunk, close);
            entry.refunded(bytes, shared.peak_slack);
        });
        if refunded.is_none() {
            self.refund_without_slot(r, bytes, close);
        }
        if shared.device.timeline.enabled() {
            self.record_refund(role, bytes);
        }
    }

    /// A refund on a thread whose slots are gone (thread teardown): straight to the
    /// shared books and the published charges.
    #[cold]
    #[inline(never)]
    fn refund_without_slot(&self, r: usize, bytes: u64, close: bool) {
        let shared = &*self.shared;
        shared.path(r).give_back(bytes);
        if close {
            shared.roles[r].retired_closed.fetch_add(1, Ordering::Relaxed);
        }
        for charges in shared.levels(r) {
            charges.publish_now(-(bytes as i64));
        }
    }

    #[cold]
    #[inline(never)]
    fn record_refund(&self, role: MemoryRole, bytes: u64) {
        let shared = &*self.shared;
        shared.device.timeline.record(TimelineEventKind::Refund, shared.device.key, shared.authority, role, bytes);
    }

    /// Refunds a charge whose memory was never handed out (the allocator failed after
    /// the charge): the charge is neither counted as opened nor as closed.
    pub(crate) fn cancel(&self, role: MemoryRole, bytes: u64) {
        self.refund(role, bytes, false);
        self.uncount_open(role);
    }

    pub(crate) fn role_stats(&self, role: MemoryRole) -> &RoleStats {
        &self.shared.roles[role.ordinal()]
    }

    /// Charges a lease of `bytes` for `role`, refunded when the lease drops.
    ///
    /// # Errors
    /// See [`AdmissionError`]; nothing is charged on error.
    pub fn lease(&self, role: MemoryRole, bytes: u64) -> Result<crate::Lease<&Account>, AdmissionError> {
        self.charge(role, bytes)?;
        Ok(crate::Lease::new(self, role, bytes))
    }

    /// Like [`Account::lease`], but the lease owns a handle to the account (`'static`,
    /// at the cost of a reference count on the account per lease).
    ///
    /// # Errors
    /// See [`AdmissionError`]; nothing is charged on error.
    pub fn lease_owned(&self, role: MemoryRole, bytes: u64) -> Result<crate::Lease<Account>, AdmissionError> {
        self.charge(role, bytes)?;
        Ok(crate::Lease::new(self.clone(), role, bytes))
    }
}

struct GovernorInner {
    config: GovernorConfig,
    devices: RwLock<BTreeMap<DeviceKey, Arc<DeviceBooks>>>,
    accounts: RwLock<HashMap<AuthorityIdentity, Account>>,
    timeline: Arc<Timeline>,
    next_holder: IdCounter,
}

/// Books for every device, with accounts per authority. Cheap to clone (shared).
///
/// See the [crate docs](crate) for the rules and a quickstart.
#[derive(Clone)]
pub struct Governor {
    inner: Arc<GovernorInner>,
}

impl std::fmt::Debug for Governor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Governor").field("config", &self.inner.config).finish_non_exhaustive()
    }
}

impl Default for Governor {
    fn default() -> Governor {
        Governor::new()
    }
}

impl Governor {
    /// A governor with default tunables and no limits.
    pub fn new() -> Governor {
        Governor::with_config(GovernorConfig::default())
    }

    /// A governor with `config`.
    pub fn with_config(config: GovernorConfig) -> Governor {
        Governor {
            inner: Arc::new(GovernorInner {
                config,
                devices: RwLock::new(BTreeMap::new()),
                accounts: RwLock::new(HashMap::new()),
                timeline: Arc::new(Timeline::new()),
                next_holder: IdCounter::new(1),
            }),
        }
    }

    /// The tunables.
    pub fn config(&self) -> GovernorConfig {
        self.inner.config
    }

    fn books(&self, device: DeviceKey) -> Arc<DeviceBooks> {
        if let Some(books) = read(&self.inner.devices).get(&device) {
            return Arc::clone(books);
        }
        let mut devices = write(&self.inner.devices);
        Arc::clone(devices.entry(device).or_insert_with(|| {
            Arc::new(DeviceBooks::new(device, Arc::clone(&self.inner.timeline), self.inner.config.overdraft_limit))
        }))
    }

    /// Sets the limit of `device` (`u64::MAX`: unlimited); returns the old one. Lowering
    /// revokes nothing: charges stay, credit threads cache is pulled back, and new
    /// admissions are refused until usage falls below the new limit.
    ///
    /// # Errors
    /// [`LimitError::BelowReserves`] when the limit would not hold the policy's reserves.
    pub fn set_device_limit(&self, device: DeviceKey, bytes: u64) -> Result<Option<u64>, LimitError> {
        let books = self.books(device);
        let _changes = lock(&books.changes);
        let reserved = books.counters.reserve_targets();
        if bytes < reserved {
            return Err(LimitError::BelowReserves { device, requested: bytes, reserved });
        }
        let old = credit::set_limit(&books.counters.budget, bytes, &books.slots);
        tracing::info!(
            device = %device, old = ?limit_of(old), new = ?limit_of(bytes), used = books.counters.budget.used(),
            "device limit changed"
        );
        Ok(limit_of(old))
    }

    /// Sets the overdraft limit of `device` (see [`Account::draw_overdraft`]); returns
    /// the old one. Lowering it takes nothing back: draws already made stay until
    /// dropped, new ones are refused until the device's overdraft falls below it.
    pub fn set_overdraft_limit(&self, device: DeviceKey, bytes: u64) -> u64 {
        let books = self.books(device);
        let old = books.overdraft.set_limit(bytes);
        tracing::info!(device = %device, old, new = bytes, "device overdraft limit changed");
        old
    }

    /// The limit of `device`, `None` when unlimited.
    pub fn device_limit(&self, device: DeviceKey) -> Option<u64> {
        read(&self.inner.devices).get(&device).and_then(|books| limit_of(books.counters.budget.limit()))
    }

    /// Sets the quota of `authority`'s account (`u64::MAX`: unlimited); returns the old
    /// one. Lowering behaves as for [`Governor::set_device_limit`].
    ///
    /// # Errors
    /// [`LimitError::Account`] when the authority has no account.
    pub fn set_quota(&self, authority: AuthorityIdentity, bytes: u64) -> Result<Option<u64>, LimitError> {
        let account = self.account(authority)?;
        let shared = &account.shared;
        let _changes = lock(&shared.device.changes);
        let old = credit::set_limit(&shared.counters.budget, bytes, &shared.slots);
        tracing::info!(
            device = %shared.device.key, authority = %authority, account = %shared.label,
            old = ?limit_of(old), new = ?limit_of(bytes), used = shared.counters.budget.used(),
            "authority quota changed"
        );
        Ok(limit_of(old))
    }

    /// Opens an account for an authority.
    ///
    /// # Errors
    /// [`AccountError::AlreadyOpen`] when the authority has one.
    pub fn open_account(&self, config: AccountConfig) -> Result<Account, AccountError> {
        let books = self.books(config.device);
        let counters = Arc::new(AccountCounters::new(config.quota));
        let account = Account {
            shared: Arc::new(AccountShared {
                uid: NEXT_ACCOUNT.fetch_add(1, StdOrdering::Relaxed),
                authority: config.authority,
                label: config.label.unwrap_or_else(|| config.authority.to_string()),
                chunk: self.inner.config.credit_chunk,
                device: books,
                counters: Arc::clone(&counters),
                slots: Mutex::new(Vec::new()),
                roles: std::array::from_fn(|_| RoleStats::new()),
                role_charges: std::array::from_fn(|r| {
                    Arc::new(Charges::new(Bound::AccountRole(Arc::clone(&counters), r)))
                }),
                charges: Arc::new(Charges::new(Bound::Account(Arc::clone(&counters)))),
                peak_slack: self.inner.config.credit_chunk.min(PEAK_SLACK),
                overdraft: Arc::new(OverdraftBooks::new(u64::MAX)),
            }),
        };
        let mut accounts = write(&self.inner.accounts);
        if let Some(existing) = accounts.get(&config.authority) {
            return Err(AccountError::AlreadyOpen { authority: config.authority, device: existing.device() });
        }
        accounts.insert(config.authority, account.clone());
        drop(accounts);
        tracing::info!(
            device = %config.device, authority = %config.authority, quota = ?limit_of(config.quota),
            "account opened"
        );
        Ok(account)
    }

    /// The account of `authority`.
    ///
    /// # Errors
    /// [`AccountError::UnknownAuthority`] when none was opened.
    pub fn account(&self, authority: AuthorityIdentity) -> Result<Account, AccountError> {
        read(&self.inner.accounts).get(&authority).cloned().ok_or(AccountError::UnknownAuthority { authority })
    }

    /// Charges a lease to `authority`'s account (a convenience over [`Governor::account`]
    /// and [`Account::lease_owned`]).
    ///
    /// # Errors
    /// [`AdmissionError`] as for [`Account::lease`], or the account lookup's error.
    pub fn lease(
        &self,
        authority: AuthorityIdentity,
        role: MemoryRole,
        bytes: u64,
    ) -> Result<crate::Lease<Account>, LeaseRequestError> {
        let account = self.account(authority)?;
        Ok(account.lease_owned(role, bytes)?)
    }

    /// Installs `policy` on `device` and applies its reserves; returns the old policy.
    ///
    /// Extra reserves are drawn before the surplus of the old ones is released, so a
    /// change must fit with both for a moment.
    ///
    /// # Errors
    /// [`PolicyError`] (handing `policy` back) when a reserve does not fit; nothing
    /// changed then.
    pub fn set_policy(
        &self,
        device: DeviceKey,
        policy: Arc<dyn AdmissionPolicy>,
    ) -> Result<Arc<dyn AdmissionPolicy>, PolicyError> {
        // Asked before any lock: `reserve` may call back into the governor.
        let new_targets: [u64; ROLES] = std::array::from_fn(|r| policy.reserve(MemoryRole::ALL[r]));
        let books = self.books(device);
        let changes = lock(&books.changes);
        // Reserves must fit what is charged, not what threads happen to cache.
        credit::return_credit(&books.counters.budget, &books.slots);
        let old_targets: [u64; ROLES] = std::array::from_fn(|r| books.counters.roles[r].target());
        let limit = books.counters.budget.limit();
        if new_targets.iter().try_fold(0u64, |sum, &t| sum.checked_add(t)).is_none_or(|sum| sum > limit) {
            let role = MemoryRole::ALL[(0..ROLES).max_by_key(|&r| new_targets[r]).unwrap_or(0)];
            return Err(PolicyError {
                device,
                role,
                reserve: new_targets[role.ordinal()],
                available: limit.saturating_sub(books.counters.budget.used()),
                policy,
            });
        }
        // Raise first; undo the raises if one does not fit.
        for r in 0..ROLES {
            if new_targets[r] > old_targets[r]
                && let Err(available) = books.counters.set_reserve(r, new_targets[r])
            {
                for undo in 0..r {
                    if new_targets[undo] > old_targets[undo] {
                        let _ = books.counters.set_reserve(undo, old_targets[undo]);
                    }
                }
                return Err(PolicyError {
                    device,
                    role: MemoryRole::ALL[r],
                    reserve: new_targets[r],
                    available,
                    policy,
                });
            }
        }
        for r in 0..ROLES {
            if new_targets[r] < old_targets[r] {
                let _ = books.counters.set_reserve(r, new_targets[r]);
            }
        }
        let old = std::mem::replace(&mut *write(&books.policy), Arc::clone(&policy));
        drop(changes);
        tracing::info!(device = %device, old = old.name(), new = policy.name(), reserves = ?new_targets, "admission policy installed");
        Ok(old)
    }

    /// The name of `device`'s policy.
    pub fn policy_name(&self, device: DeviceKey) -> String {
        self.books(device).policy().name().to_owned()
    }

    /// Registers a reclaim holder on `device`; holders are asked in ascending `order`
    /// (ties in registration order).
    pub fn register_holder(&self, device: DeviceKey, order: u32, holder: Arc<dyn ReclaimHolder>) -> HolderId {
        let books = self.books(device);
        let serial = self.inner.next_holder.fetch_add(1, StdOrdering::Relaxed);
        tracing::debug!(device = %device, holder = holder.name(), order, "reclaim holder registered");
        let mut holders = write(&books.holders);
        holders.push(HolderEntry { serial, order, holder });
        holders.sort_by_key(|entry| (entry.order, entry.serial));
        HolderId { device, serial }
    }

    /// Unregisters a holder; returns it, or `None` if it was not registered.
    pub fn unregister_holder(&self, id: HolderId) -> Option<Arc<dyn ReclaimHolder>> {
        let books = self.books(id.device);
        let mut holders = write(&books.holders);
        let index = holders.iter().position(|entry| entry.serial == id.serial)?;
        Some(holders.remove(index).holder)
    }

    /// Pulls every thread's cached credit back into the shared books (for example
    /// before a snapshot that must show `used == current`). Returns the bytes returned.
    pub fn return_idle_credit(&self) -> u64 {
        let devices: Vec<_> = read(&self.inner.devices).values().cloned().collect();
        devices.iter().map(|books| credit::return_credit(&books.counters.budget, &books.slots)).sum()
    }

    /// Wraps `allocator` so that each allocation is charged to `authority`'s account.
    ///
    /// # Errors
    /// [`GovernError`] (handing the allocator back) when the authority has no account or
    /// the allocator serves another device.
    pub fn govern(
        &self,
        allocator: Arc<dyn DeviceAllocator>,
        authority: AuthorityIdentity,
    ) -> Result<GovernedAllocator, GovernError> {
        match self.account(authority) {
            Ok(account) => GovernedAllocator::new(allocator, account),
            Err(error) => Err(GovernError { failure: GovernFailure::Account(error), allocator }),
        }
    }

    /// Wraps the *backing* of a cache (the allocator a pool takes its memory from) on
    /// `allocator`'s device: every block the cache takes is counted in the device's
    /// `held_by_caches` and refused past the device limit
    /// ([`AdmissionError::CacheLimit`], which the governed allocator above the cache
    /// answers with the recovery ladder). Build a governed pool as
    /// `governor.govern(Arc::new(Pool::new(governor.cache_backing(system))), authority)`.
    /// See `docs/ACCOUNTING.md`, "Allocated and reserved".
    pub fn cache_backing(&self, allocator: Arc<dyn DeviceAllocator>) -> CacheBacking {
        let books = self.books(allocator.device());
        CacheBacking::new(allocator, books)
    }

    /// A snapshot of every device's books.
    pub fn snapshot(&self) -> GovernorSnapshot {
        let devices: Vec<_> = read(&self.inner.devices).values().cloned().collect();
        let mut accounts: Vec<Account> = read(&self.inner.accounts).values().cloned().collect();
        accounts.sort_by_key(|account| account.shared.uid);
        let devices = devices
            .iter()
            .map(|books| {
                let authorities: Vec<AccountSnapshot> = accounts
                    .iter()
                    .filter(|account| account.device() == books.key)
                    .map(|account| account.shared.snapshot())
                    .collect();
                let mut roles: Vec<RoleSnapshot> =
                    MemoryRole::ALL.iter().map(|&role| RoleSnapshot::empty(role)).collect();
                for account in &authorities {
                    for (total, role) in roles.iter_mut().zip(&account.roles) {
                        total.absorb(role);
                    }
                }
                let counters = &books.counters;
                let current = stats::sum(authorities.iter().map(|a| a.current));
                let caches = books.caches.poll();
                let idle = Idle::of(&caches);
                let reserved = current.saturating_add(idle.cached);
                books.caches.observe(reserved);
                let backing = books.caches.figures();
                DeviceSnapshot {
                    device: books.key.to_string(),
                    tier: books.key.tier().name().to_owned(),
                    index: books.key.index(),
                    limit: limit_of(counters.budget.limit()),
                    current,
                    used: counters.budget.used(),
                    peak: books.charges.peak(),
                    peak_used: counters.budget.peak(),
                    cached_credit: stats::sum(authorities.iter().map(|a| a.cached_credit)),
                    policy: books.policy().name().to_owned(),
                    reserves: MemoryRole::ALL
                        .iter()
                        .filter(|role| counters.roles[role.ordinal()].target() > 0)
                        .map(|role| ReserveSnapshot {
                            role: role.name().to_owned(),
                            target: counters.roles[role.ordinal()].target(),
                            held: counters.roles[role.ordinal()].held(),
                        })
                        .collect(),
                    holders: books
                        .holders()
                        .into_iter()
                        .map(|(order, holder)| HolderSnapshot { name: holder.name().to_owned(), order })
                        .collect(),
                    totals: Totals::of(&roles),
                    roles,
                    authorities,
                    overdraft: books.overdraft.snapshot(true),
                    allocated: current,
                    cached: idle.cached,
                    reserved,
                    reserved_peak: backing.reserved_peak,
                    held_by_caches: backing.held,
                    held_by_caches_peak: backing.held_peak,
                    largest_free: idle.largest_free,
                    caches: caches
                        .iter()
                        .map(|cache| CacheSnapshot {
                            name: cache.name.clone(),
                            authority: cache.authority.to_string(),
                            live: cache.stats.live_bytes,
                            cached: cache.stats.cached_bytes,
                            reserved: cache.stats.live_bytes.saturating_add(cache.stats.cached_bytes),
                            largest_free: cache.stats.largest_free_bytes,
                        })
                        .collect(),
                    ladder: LadderSnapshot {
                        trims: backing.trims,
                        trimmed_bytes: backing.trimmed_bytes,
                        refused_over_reserved: backing.over_reserved,
                    },
                }
            })
            .collect();
        GovernorSnapshot { devices }
    }

    /// Starts recording a timeline of charges and refunds (the latest `capacity` events).
    pub fn enable_timeline(&self, capacity: usize) {
        self.inner.timeline.enable(capacity);
    }

    /// Stops recording; what was recorded stays.
    pub fn disable_timeline(&self) {
        self.inner.timeline.disable();
    }

    /// The recorded events (oldest first) and how many older ones were dropped.
    pub fn timeline_events(&self) -> (Vec<TimelineEvent>, u64) {
        self.inner.timeline.events()
    }

    /// The timeline in the Chrome trace-event format (see [`Governor::enable_timeline`])
    /// as a JSON string, ready to save as `trace.json` and open in a trace viewer. (A
    /// string, so no JSON library's type appears in this crate's API.)
    pub fn chrome_trace_json(&self) -> String {
        self.inner.timeline.chrome_trace().to_string()
    }
}
