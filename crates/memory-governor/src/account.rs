//! Accounts: one authority's books on one device. The handle ([`Account`]), what it
//! shares between clones (`AccountShared`: its budget, slots, figures), the calling
//! thread's slots and tallies, and how a charge goes through them (fast path in the
//! thread's credit, slow path through the shared budget and the device's policy).

use std::cell::RefCell;
use std::rc::Rc;

use memory_api::{AuthorityIdentity, DeviceKey, MemoryRole};

use crate::credit::{self, AccountCounters, Path, ROLES, Short, Slot, SlotLists, UNLIMITED};
use crate::device::{DeviceBooks, limit_of};
use crate::error::{AdmissionError, Exhaustion, Footprint, LimitScope};
use crate::footprint::Idle;
use crate::overdraft::{OverdraftBooks, OverdraftDraw, OverdraftRefused};
use crate::peaks::{Charges, Tally};
use crate::policy::{AdmissionPolicy, Shortfall, ShortfallDecision};
use crate::reclaim::{ReclaimRequest, Reclaiming};
use crate::stats::{self, AccountSnapshot, RoleSnapshot, Totals};
use crate::sync::{Arc, AtomicU64, IdCounter, Mutex, Ordering, lock, thread_local};
use crate::timeline::TimelineEventKind;

/// The largest charge one lease or allocation may hold: 2^56 - 1 bytes (64 PiB), the
/// most the books count per role and device. Larger requests are
/// [`AdmissionError::Overflow`] errors.
pub const MAX_CHARGE: u64 = credit::ROLE_USED;

/// How an account is opened: device, authority, quota and label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccountConfig {
    pub(crate) device: DeviceKey,
    pub(crate) authority: AuthorityIdentity,
    pub(crate) quota: u64,
    pub(crate) label: Option<String>,
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

/// Per-role figures of an account that live outside the credit protocol (cold path).
#[derive(Debug)]
pub(crate) struct RoleStats {
    pub(crate) failures: AtomicU64,
    pub(crate) quarantined: AtomicU64,
    pub(crate) lost_bytes: AtomicU64,
    pub(crate) lost_allocations: AtomicU64,
    /// Opened/closed counts of slots whose thread has gone, and of charges made without
    /// a slot (during thread teardown).
    pub(crate) retired_opened: AtomicU64,
    pub(crate) retired_closed: AtomicU64,
}

impl RoleStats {
    pub(crate) fn new() -> RoleStats {
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
pub(crate) static NEXT_ACCOUNT: IdCounter = IdCounter::new(1);

pub(crate) struct AccountShared {
    pub(crate) uid: u64,
    pub(crate) authority: AuthorityIdentity,
    pub(crate) label: String,
    pub(crate) chunk: u64,
    pub(crate) device: Arc<DeviceBooks>,
    pub(crate) counters: Arc<AccountCounters>,
    pub(crate) slots: Mutex<Vec<Arc<Slot>>>,
    pub(crate) roles: [RoleStats; ROLES],
    /// Peaks of real charges: per role, and of the account.
    pub(crate) role_charges: [Arc<Charges>; ROLES],
    pub(crate) charges: Arc<Charges>,
    /// How far a thread's tally of charges may drift before it is published.
    pub(crate) peak_slack: u64,
    /// What adapters hold for this account past refusals.
    pub(crate) overdraft: Arc<OverdraftBooks>,
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
pub(crate) fn prune_retired(slots: &mut Vec<Arc<Slot>>, roles: &[RoleStats; ROLES]) {
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
    pub(crate) fn path(&self, role: usize) -> Path<'_> {
        Path { account: &self.counters, device: &self.device.counters, role }
    }

    pub(crate) fn lists(&self) -> SlotLists<'_> {
        SlotLists { account: &self.slots, device: &self.device.slots }
    }

    pub(crate) fn register_slot(&self, role: usize) -> Arc<Slot> {
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
    pub(crate) fn levels(&self, role: usize) -> [&Arc<Charges>; 3] {
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
    pub(crate) fn with_slot<R>(&self, role: usize, f: impl FnOnce(&Slot) -> R) -> Option<R> {
        self.with_thread(role, |entry| f(&entry.slot))
    }

    /// Counts a charge made on the slow path in the calling thread's tallies.
    pub(crate) fn tally_charge(&self, role: usize, bytes: u64) {
        if self.with_thread(role, |entry| entry.charged(bytes, self.peak_slack)).is_none() {
            for charges in self.levels(role) {
                charges.publish_now(bytes as i64);
            }
        }
    }

    /// One admission attempt: the thread's credit, then a chunk or an exact draw, then
    /// pulling back other threads' credit. No policy, no callback.
    pub(crate) fn admit(&self, role: usize, bytes: u64) -> Result<(), Short> {
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

    pub(crate) fn count_open(&self, role: usize) {
        if self.with_slot(role, Slot::count_open).is_none() {
            self.roles[role].retired_opened.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn shortfall(&self, role: MemoryRole, requested: u64, short: Short) -> (Shortfall, u64, u64) {
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
    pub(crate) fn admit_with_policy(&self, role: MemoryRole, bytes: u64, short: Short) -> Result<(), AdmissionError> {
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
    pub(crate) fn refuse(
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
    pub(crate) fn allocated(&self) -> u64 {
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

    pub(crate) fn snapshot(&self) -> AccountSnapshot {
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
/// Charges go through [`Account::lease`] (or a [`GovernedAllocator`](crate::GovernedAllocator)); each is drawn
/// from the calling thread's credit when it can be, so admissions on different threads
/// do not contend.
#[derive(Clone)]
pub struct Account {
    pub(crate) shared: Arc<AccountShared>,
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
    /// account ([`DeviceSnapshot::overdraft`](crate::DeviceSnapshot::overdraft), [`AccountSnapshot::overdraft`]); the bytes
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

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use memory_api::{DeviceKey, IdentityIssuer};

    use super::*;
    use crate::{Governor, GovernorConfig};

    /// Threads that charge once and end leave retired slots; each slot registered
    /// after drops them (their counts folded into the role's), so the list does not grow
    /// with thread churn and the figures stay whole.
    #[test]
    fn slots_of_finished_threads_are_dropped_and_their_counts_kept() {
        let governor = Governor::with_config(GovernorConfig::default().with_credit_chunk(256));
        let authority = IdentityIssuer::new().unwrap().authority().unwrap();
        let account = governor.open_account(AccountConfig::new(DeviceKey::HOST, authority)).unwrap();
        for _ in 0..8 {
            let worker = account.clone();
            std::thread::spawn(move || drop(worker.lease(MemoryRole::Activations, 64).unwrap())).join().unwrap();
        }
        drop(account.lease(MemoryRole::Activations, 64).unwrap());
        assert_eq!(lock(&account.shared.slots).len(), 1, "only this thread's slot is left");
        let role = account.snapshot().role(MemoryRole::Activations).clone();
        assert_eq!((role.allocations, role.releases, role.live, role.current), (9, 9, 0, 0));
    }
}
