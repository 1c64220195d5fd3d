//! A process's membership: its slot, the grants its governor's local limits stand on,
//! the [`NodePolicy`] that draws more when a local budget runs short, and the timer
//! that gives surplus back, publishes figures and refunds dead slots.

use std::cell::Cell;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Condvar, Weak};
use std::time::{Duration, Instant};

use memory_governor::{
    Account, AdmissionPolicy, AuthorityIdentity, DeviceKey, Governor, GovernorSnapshot, HolderId, LimitScope,
    MemoryRole, ReclaimHolder, ReclaimRequest, Shortfall, ShortfallDecision,
};
use serde::Serialize;

use crate::books::{NodeBooks, refund_slot};
use crate::error::{BooksIoError, NodeError};
use crate::format::Shared;
use crate::protocol::{self, Budget, SLOT_LIVE, state_word};
use crate::sync::{Arc, AtomicBool, AtomicU64, Mutex, lock};

/// What one budget's grant stands at, in this process.
#[derive(Debug, Default)]
struct GrantState {
    /// Bytes granted: equal to the slot's word and to the governor's local limit (or
    /// quota) outside the short windows where one of them is being changed.
    held: u64,
    /// When the last grant was drawn (a give-back leaves a fresh grant alone, so the
    /// admission it was drawn for can retry into it).
    last_grant: Option<Instant>,
    /// The budget's pressure counter as last seen.
    pressure_seen: u64,
}

/// A device this member governs.
struct DeviceGrant {
    key: DeviceKey,
    entry: usize,
    inner: Arc<dyn AdmissionPolicy>,
    holder: HolderId,
    state: Mutex<GrantState>,
    /// Shortfalls being served on this budget: the timer leaves it alone meanwhile.
    serving: AtomicU64,
}

/// A tenant (an account of this process's governor) bound to a node tenant.
struct TenantGrant {
    authority: AuthorityIdentity,
    account: Account,
    device: DeviceKey,
    device_entry: usize,
    entry: usize,
    name: String,
    state: Mutex<GrantState>,
    /// Shortfalls being served on this budget: the timer leaves it alone meanwhile.
    serving: AtomicU64,
}

#[derive(Copy, Clone)]
enum Target<'a> {
    Device(&'a DeviceGrant),
    Tenant(&'a TenantGrant),
}

/// See [`Target::serve`].
struct Serving<'a>(Target<'a>);

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        lock(self.0.grant_state()).last_grant = Some(Instant::now());
        self.0.serving().fetch_sub(1, SeqCst);
    }
}

impl<'a> Target<'a> {
    fn budget(self) -> Budget {
        match self {
            Target::Device(device) => Budget::Device(device.entry),
            Target::Tenant(tenant) => Budget::Tenant(tenant.entry),
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Target::Device(_) => "device",
            Target::Tenant(_) => "tenant",
        }
    }

    fn grant_state(self) -> &'a Mutex<GrantState> {
        match self {
            Target::Device(device) => &device.state,
            Target::Tenant(tenant) => &tenant.state,
        }
    }

    fn serving(self) -> &'a AtomicU64 {
        match self {
            Target::Device(device) => &device.serving,
            Target::Tenant(tenant) => &tenant.serving,
        }
    }

    /// Marks a shortfall served on this budget until the guard drops, which then counts
    /// as a fresh grant (so the admission's retry finds it).
    fn serve(self) -> Serving<'a> {
        self.serving().fetch_add(1, SeqCst);
        Serving(self)
    }

    fn limit(self, shared: &Shared) -> u64 {
        match self {
            Target::Device(device) => shared.devices[device.entry].limit.load(SeqCst),
            Target::Tenant(tenant) => shared.tenants[tenant.entry].quota.load(SeqCst),
        }
    }

    fn pressure(self, shared: &Shared) -> &AtomicU64 {
        match self {
            Target::Device(device) => &shared.devices[device.entry].pressure,
            Target::Tenant(tenant) => &shared.tenants[tenant.entry].pressure,
        }
    }

    fn name(self) -> String {
        match self {
            Target::Device(device) => device.key.to_string(),
            Target::Tenant(tenant) => format!("{} on {}", tenant.name, tenant.device),
        }
    }

    /// Sets the governor's local limit (or quota) to `bytes`.
    fn apply(self, governor: &Governor, bytes: u64) -> Result<(), NodeError> {
        let result = match self {
            Target::Device(device) => governor.set_device_limit(device.key, bytes).map(drop).map_err(Box::from),
            Target::Tenant(tenant) => governor.set_quota(tenant.authority, bytes).map(drop).map_err(Box::from),
        };
        result.map_err(|source| NodeError::Governor { operation: "change a limit to a node grant", source })
    }
}

/// Counters of one member (cumulative).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct MemberStats {
    /// Grants drawn from the node.
    pub grants: u64,
    /// Bytes they brought.
    pub granted_bytes: u64,
    /// Bytes given back.
    pub given_back_bytes: u64,
    /// Grants the node could not give (the admission went on to the inner policy).
    pub refusals: u64,
    /// Dead slots this member refunded.
    pub refunds: u64,
}

#[derive(Default)]
struct Counters {
    grants: AtomicU64,
    granted_bytes: AtomicU64,
    given_back_bytes: AtomicU64,
    refusals: AtomicU64,
    refunds: AtomicU64,
}

pub(crate) struct MemberInner {
    books: NodeBooks,
    governor: Governor,
    slot: usize,
    generation: u64,
    devices: Mutex<Vec<Arc<DeviceGrant>>>,
    tenants: Mutex<Vec<Arc<TenantGrant>>>,
    counters: Counters,
    /// The slot's lease file, `flock`ed while this process holds the slot (see
    /// [`format::SLOT_LEASE_GENERATION`](crate::format::SLOT_LEASE_GENERATION)).
    lease: Mutex<Option<std::fs::File>>,
    /// Set when the member leaves, before its grants are given back: a shortfall still
    /// being served then draws nothing (its slot may be freed and claimed by another).
    left: AtomicBool,
    stop: Mutex<bool>,
    wake: Condvar,
}

/// One process's (one governor's) place in the node books. Keep it for as long as the
/// governor allocates: dropping it (or [`Member::leave`]) stops the timer, gives back
/// what the governor does not use, and, when the governor holds nothing on the books'
/// devices (no charge, nothing cached), frees the slot and leaves the governor with
/// `HardLimit` policies and zero limits there. Otherwise the inner policies come back,
/// the grants keep covering what the governor uses, and the slot stays until the
/// process exits, when a survivor refunds it.
///
/// A fork of the process inherits a copy of the member, but the slot, its grants and
/// the timer stay the parent's: in the fork, the copy draws, gives back and publishes
/// nothing, and dropping it touches nothing ([`NodeError::Forked`] from the calls that
/// would). A forked process that should be governed opens the books again and joins.
pub struct Member {
    inner: Arc<MemberInner>,
    timer: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Member").field("books", &self.inner.books).field("slot", &self.inner.slot).finish()
    }
}

/// What [`Member::leave`] did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct LeaveReport {
    /// Bytes of grants given back.
    pub given_back: u64,
    /// Bytes the governor still held on its devices, which stay granted (with the
    /// tenants' grants inside them) until the process exits.
    pub still_held: u64,
    /// Whether the slot was freed (nothing was held).
    pub slot_freed: bool,
}

/// Held through [`Member::govern_device`] and [`Member::bind_tenant`], so that the look
/// for a device governed (an account bound) already and the record of a new one are one
/// step: threads racing between them each drew an initial grant and each recorded the
/// device or the account (counting its charges twice). One for the process, since two
/// members of one governor race on the governor's device the same way.
static SETUP: Mutex<()> = Mutex::new(());

std::thread_local! {
    /// A grant [`NodePolicy::on_shortfall`] just drew on this thread, for the
    /// [`NodeHolder`] the governor asks next (first in reclaim order), so that the
    /// governor's retry follows without asking the process's real holders.
    static HANDOFF: Cell<Option<Handoff>> = const { Cell::new(None) };
}

#[derive(Copy, Clone, Debug)]
struct Handoff {
    device: DeviceKey,
    authority: AuthorityIdentity,
    bytes: u64,
}

impl NodeBooks {
    /// Joins the books with `governor`: claims a slot for this process (pid, start time,
    /// boot id), refunding dead slots first, and starts the member's timer. Then hand it
    /// devices ([`Member::govern_device`]) and tenants ([`Member::bind_tenant`]).
    ///
    /// # Errors
    /// [`NodeError::SlotsFull`] when every slot is held by a live process;
    /// [`NodeError::Forked`] in a fork of the process that opened the books (open them
    /// again there); the lock's or the timer thread's I/O error.
    pub fn join(&self, governor: &Governor) -> Result<Member, NodeError> {
        let _ = self.refund_dead()?;
        let me = self.inner.me;
        let uid = u64::from(rustix::process::getuid().as_raw());
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let mut lease = None;
        let claimed = self.with_lock(|shared| {
            protocol::claim(shared, |slot| {
                let entry = &shared.slots[slot];
                entry.pid.store(me.pid, SeqCst);
                entry.start_time.store(me.start_time, SeqCst);
                entry.boot[0].store(me.boot[0], SeqCst);
                entry.boot[1].store(me.boot[1], SeqCst);
                entry.pid_ns.store(me.pid_ns, SeqCst);
                entry.uid.store(uid, SeqCst);
                entry.joined_secs.store(now, SeqCst);
                // The generation this claim is writing (the state word says CLAIMING with it).
                entry.pidfd_inode.store(me.pidfd_inode, SeqCst);
                entry.pidfd_generation.store(protocol::generation_of(entry.state.load(SeqCst)), SeqCst);
                // The lease, for survivors of other pid namespaces (see `format`).
                lease = self.take_lease(slot);
                let leased = if lease.is_some() { protocol::generation_of(entry.state.load(SeqCst)) } else { 0 };
                entry.lease_generation.store(leased, SeqCst);
            })
        })?;
        let (slot, generation) = claimed
            .ok_or_else(|| NodeError::SlotsFull { path: self.path().to_owned(), slots: crate::format::MAX_SLOTS })?;
        tracing::info!(path = %self.path().display(), slot, generation, pid = me.pid, "joined the node books");
        let inner = Arc::new(MemberInner {
            books: self.clone(),
            governor: governor.clone(),
            slot,
            generation,
            devices: Mutex::new(Vec::new()),
            tenants: Mutex::new(Vec::new()),
            counters: Counters::default(),
            lease: Mutex::new(lease),
            left: AtomicBool::new(false),
            stop: Mutex::new(false),
            wake: Condvar::new(),
        });
        let timer_inner = Arc::clone(&inner);
        let timer = std::thread::Builder::new()
            .name(format!("memory-node-{slot}"))
            .spawn(move || timer_inner.run_timer())
            .map_err(|source| NodeError::from(BooksIoError::new(self.path(), "start the timer of", source)));
        let timer = match timer {
            Ok(timer) => timer,
            Err(error) => {
                inner.free_slot();
                return Err(error);
            }
        };
        Ok(Member { inner, timer: Some(timer) })
    }
}

impl Member {
    /// The slot this process holds.
    pub fn slot(&self) -> usize {
        self.inner.slot
    }

    /// The books.
    pub fn books(&self) -> &NodeBooks {
        &self.inner.books
    }

    /// Hands `device` of this member's governor to the node books: its local limit
    /// becomes a grant (what the governor holds there now, or its reserves, drawn at
    /// once), and a [`NodePolicy`] over `inner` (the policy the device would otherwise
    /// have: `HardLimit`, `ReclaimThenFail`, a `GuaranteedReserve`...) draws more from
    /// the node when it runs short, before `inner` is asked. From here on the member
    /// owns the device's local limit: do not set it yourself.
    ///
    /// # Errors
    /// [`NodeError::AlreadyGoverned`]; [`NodeError::GrantRefused`] when the node cannot
    /// grant what the governor already holds; [`NodeError::Forked`] in a fork of the
    /// member's process; a governor or entry error.
    pub fn govern_device(&self, device: DeviceKey, inner: Arc<dyn AdmissionPolicy>) -> Result<(), NodeError> {
        let member = &self.inner;
        member.books.check_not_forked()?;
        let _setup = lock(&SETUP);
        if lock(&member.devices).iter().any(|grant| grant.key == device) {
            return Err(NodeError::AlreadyGoverned { device });
        }
        // Another member of this governor (joined to these books or others) governs the
        // device already: its node holder is registered there. Two members would each
        // set the one local limit to their own grant, and bind the device's accounts
        // twice (their charges counted twice in a tenant's node quota).
        let governed_elsewhere = member
            .governor
            .snapshot()
            .device(device)
            .is_some_and(|snapshot| snapshot.holders.iter().any(|holder| holder.name == NODE_HOLDER));
        if governed_elsewhere {
            return Err(NodeError::AlreadyGoverned { device });
        }
        let books = &member.books;
        let entry = books.device_entry(device, true)?.ok_or(NodeError::NotGoverned { device })?;
        let snapshot = member.governor.snapshot();
        let held = snapshot.device(device).map_or(0, |d| d.used.max(d.reserved).max(d.held_by_caches));
        let reserves = MemoryRole::ALL.iter().fold(0u64, |sum, &role| sum.saturating_add(inner.reserve(role)));
        let initial = held.max(reserves);
        let shared = books.shared();
        let budget = Budget::Device(entry);
        if initial > 0 {
            let limit = shared.devices[entry].limit.load(SeqCst);
            protocol::try_grant(shared, member.slot, budget, limit, initial, initial).map_err(|available| {
                NodeError::GrantRefused { budget: device.to_string(), asked: initial, available }
            })?;
        }
        let undo = |error: NodeError| {
            protocol::give_back(shared, member.slot, budget, initial);
            error
        };
        member.governor.set_device_limit(device, initial).map_err(|source| {
            undo(NodeError::Governor { operation: "set a device's limit to its node grant", source: Box::new(source) })
        })?;
        let holder = member.governor.register_holder(
            device,
            0,
            Arc::new(NodeHolder { member: Arc::downgrade(&self.inner), device }),
        );
        let policy = Arc::new(NodePolicy {
            member: Arc::downgrade(&self.inner),
            device,
            name: format!("node({})", inner.name()),
            inner: Arc::clone(&inner),
        });
        if let Err(error) = member.governor.set_policy(device, policy) {
            member.governor.unregister_holder(holder);
            return Err(undo(NodeError::Governor {
                operation: "install the node policy",
                source: format!("{error}").into(),
            }));
        }
        let state = GrantState { held: initial, last_grant: Some(Instant::now()), pressure_seen: 0 };
        lock(&member.devices).push(Arc::new(DeviceGrant {
            key: device,
            entry,
            inner,
            holder,
            state: Mutex::new(state),
            serving: AtomicU64::new(0),
        }));
        tracing::info!(path = %books.path().display(), slot = member.slot, device = %device, initial,
            "device governed by the node books");
        Ok(())
    }

    /// Binds the account of `authority` (on a device this member governs) to the node
    /// tenant `tenant` of that device: its local quota becomes a grant from the tenant's
    /// node quota (what the account uses now, drawn at once), drawn on when it runs
    /// short. Processes that bind accounts to the same name share that quota.
    ///
    /// # Errors
    /// [`NodeError::NotGoverned`] when the account's device is not governed here;
    /// [`NodeError::AlreadyBound`] when the account is bound already;
    /// [`NodeError::GrantRefused`]; [`NodeError::Forked`] in a fork of the member's
    /// process; an unknown authority, a name error.
    pub fn bind_tenant(&self, authority: AuthorityIdentity, tenant: &str) -> Result<(), NodeError> {
        let member = &self.inner;
        member.books.check_not_forked()?;
        let _setup = lock(&SETUP);
        if let Some(bound) = member.tenant(authority) {
            return Err(NodeError::AlreadyBound { authority, tenant: bound.name.clone() });
        }
        let account = member
            .governor
            .account(authority)
            .map_err(|source| NodeError::Governor { operation: "find the account", source: Box::new(source) })?;
        let device = account.device();
        let device_entry = lock(&member.devices)
            .iter()
            .find(|grant| grant.key == device)
            .map(|grant| grant.entry)
            .ok_or(NodeError::NotGoverned { device })?;
        let books = &member.books;
        let entry = books.tenant_entry(device_entry, tenant, true)?.ok_or(NodeError::NotGoverned { device })?;
        let snapshot = account.snapshot();
        let initial = snapshot.used.max(snapshot.reserved);
        let shared = books.shared();
        let budget = Budget::Tenant(entry);
        if initial > 0 {
            let quota = shared.tenants[entry].quota.load(SeqCst);
            protocol::try_grant(shared, member.slot, budget, quota, initial, initial).map_err(|available| {
                NodeError::GrantRefused { budget: format!("{tenant} on {device}"), asked: initial, available }
            })?;
        }
        if let Err(source) = member.governor.set_quota(authority, initial) {
            protocol::give_back(shared, member.slot, budget, initial);
            return Err(NodeError::Governor { operation: "set a quota to its node grant", source: Box::new(source) });
        }
        let state = GrantState { held: initial, last_grant: Some(Instant::now()), pressure_seen: 0 };
        lock(&member.tenants).push(Arc::new(TenantGrant {
            authority,
            account,
            device,
            device_entry,
            entry,
            name: tenant.to_owned(),
            state: Mutex::new(state),
            serving: AtomicU64::new(0),
        }));
        tracing::info!(path = %books.path().display(), slot = member.slot, device = %device, tenant, initial,
            "tenant bound to the node books");
        Ok(())
    }

    /// Gives back what this process's grants hold beyond what its governor uses (plus
    /// the margin, unless another member was refused), as the timer does every tick.
    /// Returns the bytes given back.
    pub fn give_back_surplus(&self) -> u64 {
        self.inner.give_back_surplus(false)
    }

    /// Writes this process's allocated and reserved figures into its slot, as the timer
    /// does every refund interval.
    pub fn publish(&self) {
        self.inner.publish(&self.inner.governor.snapshot());
    }

    /// Bytes this process holds granted on `device`.
    pub fn device_grant(&self, device: DeviceKey) -> Option<u64> {
        lock(&self.inner.devices).iter().find(|grant| grant.key == device).map(|grant| lock(&grant.state).held)
    }

    /// Bytes this process holds granted for `authority`'s account.
    pub fn tenant_grant(&self, authority: AuthorityIdentity) -> Option<u64> {
        lock(&self.inner.tenants).iter().find(|grant| grant.authority == authority).map(|grant| lock(&grant.state).held)
    }

    /// This member's counters.
    pub fn stats(&self) -> MemberStats {
        let c = &self.inner.counters;
        MemberStats {
            grants: c.grants.load(SeqCst),
            granted_bytes: c.granted_bytes.load(SeqCst),
            given_back_bytes: c.given_back_bytes.load(SeqCst),
            refusals: c.refusals.load(SeqCst),
            refunds: c.refunds.load(SeqCst),
        }
    }

    /// Leaves the books (see [`Member`]).
    pub fn leave(mut self) -> LeaveReport {
        self.shutdown()
    }

    fn shutdown(&mut self) -> LeaveReport {
        let Some(timer) = self.timer.take() else {
            return LeaveReport { given_back: 0, still_held: 0, slot_freed: false };
        };
        let member = &self.inner;
        if member.books.check_not_forked().is_err() {
            // A fork's copy of its parent's member: the timer is a thread of the parent
            // (joining it here would wait forever) and the slot and grants are the
            // parent's, which goes on using them. Leave both alone.
            std::mem::forget(timer);
            tracing::warn!(path = %member.books.path().display(), slot = member.slot,
                "a forked process dropped its parent's node member: the parent's slot is left alone");
            return LeaveReport { given_back: 0, still_held: 0, slot_freed: false };
        }
        *lock(&member.stop) = true;
        member.wake.notify_all();
        let _ = timer.join();
        let devices: Vec<_> = lock(&member.devices).clone();
        // A governor that holds nothing on the books' devices (no charge, nothing in its
        // caches) leaves entirely: its policies become `HardLimit` (so reserves, which
        // are bookkeeping then, go back too) and its limits zero. Otherwise the inner
        // policies come back and the grants keep covering what it uses.
        let _ = member.governor.return_idle_credit();
        let snapshot = member.governor.snapshot();
        let holds_nothing = devices.iter().all(|grant| {
            snapshot.device(grant.key).is_none_or(|d| d.current == 0 && d.reserved == 0 && d.held_by_caches == 0)
        });
        for grant in &devices {
            let policy: Arc<dyn AdmissionPolicy> =
                if holds_nothing { Arc::new(memory_governor::HardLimit) } else { Arc::clone(&grant.inner) };
            let _ = member.governor.set_policy(grant.key, policy);
            member.governor.unregister_holder(grant.holder);
        }
        member.left.store(true, SeqCst);
        let before = member.counters.given_back_bytes.load(SeqCst);
        member.give_back_surplus(true);
        let given_back = member.counters.given_back_bytes.load(SeqCst) - before;
        let still_held = devices.iter().map(|grant| lock(&grant.state).held).sum::<u64>();
        let tenants_held = lock(&member.tenants).iter().map(|grant| lock(&grant.state).held).sum::<u64>();
        let slot_freed = still_held == 0 && tenants_held == 0 && member.free_slot();
        if !slot_freed && let Some(lease) = lock(&member.lease).take() {
            // The slot stays until the process exits: so does the lease's lock (the
            // kernel drops it then), or a survivor of another pid namespace would take
            // the slot for dead while the process still uses its grants.
            std::mem::forget(lease);
        }
        if still_held > 0 {
            member.publish(&member.governor.snapshot());
            tracing::warn!(path = %member.books.path().display(), slot = member.slot, still_held,
                "left the node books while the governor still holds memory: the slot stays until the process exits");
        } else {
            tracing::info!(path = %member.books.path().display(), slot = member.slot, given_back, "left the node books");
        }
        LeaveReport { given_back, still_held, slot_freed }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

impl MemberInner {
    fn shared(&self) -> &Shared {
        self.books.shared()
    }

    fn config(&self) -> &crate::NodeConfig {
        self.books.config()
    }

    fn device(&self, key: DeviceKey) -> Option<Arc<DeviceGrant>> {
        lock(&self.devices).iter().find(|grant| grant.key == key).cloned()
    }

    fn tenant(&self, authority: AuthorityIdentity) -> Option<Arc<TenantGrant>> {
        lock(&self.tenants).iter().find(|grant| grant.authority == authority).cloned()
    }

    /// Frees this member's slot (nothing is held). `false` if it was not ours any more.
    fn free_slot(&self) -> bool {
        let expected = state_word(SLOT_LIVE, self.generation);
        self.books
            .with_lock(|shared| {
                let freed = refund_slot(shared, self.slot, expected).is_some();
                if let Some(lease) = lock(&self.lease).take() {
                    // Removed while the books' lock is held: no judge has it open, and
                    // the slot's next owner makes it anew.
                    if freed {
                        self.books.remove_lease(self.slot);
                    }
                    drop(lease);
                }
                freed
            })
            .unwrap_or(false)
    }

    /// Draws at least `missing` bytes (a chunk if it can) for `target`, raising the
    /// local limit. Returns the bytes drawn (0: the node had none, even after refunding
    /// dead slots and waiting `pressure_wait` for other members' surplus).
    fn grow(&self, target: Target<'_>, missing: u64) -> u64 {
        if self.books.check_not_forked().is_err() {
            // The slot is the parent's: a fork draws nothing into it (its grants would
            // stay there, unknown to the parent, and be refunded with the parent).
            return 0;
        }
        let missing = missing.max(1);
        let want = missing.max(self.config().grant_chunk);
        let shared = self.shared();
        let deadline = crate::books::deadline_after(self.config().pressure_wait);
        let (mut scanned, mut pressured, mut tries) = (false, false, 0u32);
        loop {
            {
                let mut state = lock(target.grant_state());
                // Checked under the grant's lock, which the leaving give-back takes after
                // setting `left`: either it sees this grant, or this grant sees it left.
                if self.left.load(SeqCst) {
                    return 0;
                }
                let limit = target.limit(shared);
                if let Ok(granted) = protocol::try_grant(shared, self.slot, target.budget(), limit, want, missing) {
                    let new = state.held.saturating_add(granted);
                    if let Err(error) = target.apply(&self.governor, new) {
                        protocol::give_back(shared, self.slot, target.budget(), granted);
                        tracing::warn!(error = %error, "could not raise a local limit to a node grant");
                        return 0;
                    }
                    state.held = new;
                    state.last_grant = Some(Instant::now());
                    self.counters.grants.fetch_add(1, SeqCst);
                    self.counters.granted_bytes.fetch_add(granted, SeqCst);
                    tracing::trace!(slot = self.slot, budget = %target.name(), granted, held = new, "node grant");
                    return granted;
                }
            }
            tries += 1;
            // Two grants racing can both back off: retry at once a few times.
            if tries < 4 {
                crate::sync::yield_now();
                continue;
            }
            if !scanned {
                scanned = true;
                if let Ok(Some(refunds)) = self.books.refund_dead_within(self.config().pressure_wait) {
                    self.counters.refunds.fetch_add(refunds.len() as u64, SeqCst);
                    if !refunds.is_empty() {
                        continue;
                    }
                }
            }
            if !pressured {
                pressured = true;
                target.pressure(shared).fetch_add(1, SeqCst);
            }
            if Instant::now() >= deadline {
                self.counters.refusals.fetch_add(1, SeqCst);
                tracing::debug!(slot = self.slot, budget = %target.name(), missing, kind = target.kind(),
                    "the node books could not grant");
                return 0;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The policy's side: grants for a shortfall of the governor.
    fn grow_for(&self, shortfall: &Shortfall) -> u64 {
        let missing = shortfall.missing();
        match shortfall.scope {
            LimitScope::Device => self.device(shortfall.device).map_or(0, |device| {
                let _serving = Target::Device(&device).serve();
                self.grow(Target::Device(&device), missing)
            }),
            LimitScope::Authority => {
                let Some(tenant) = self.tenant(shortfall.authority) else { return 0 };
                let device = self.device(tenant.device);
                let _serving = (Target::Tenant(&tenant).serve(), device.as_ref().map(|d| Target::Device(d).serve()));
                let granted = self.grow(Target::Tenant(&tenant), missing);
                // The retry charges the device too: cover it, so the one retry fits.
                if granted > 0
                    && let Some(device) = &device
                {
                    self.grow(Target::Device(device), shortfall.requested);
                }
                granted
            }
            _ => 0,
        }
    }

    /// Gives surplus back: down to what is used plus the margin (none under pressure,
    /// or when leaving). Returns the bytes given back.
    fn give_back_surplus(&self, leaving: bool) -> u64 {
        if self.books.check_not_forked().is_err() {
            // The slot's words are the parent's grants, not this fork's to lower.
            return 0;
        }
        let config = self.config();
        let (margin, tick) = (config.margin, config.tick);
        let shared = self.shared();
        let tenants: Vec<_> = lock(&self.tenants).clone();
        let devices: Vec<_> = lock(&self.devices).clone();
        let mut snapshot: Option<GovernorSnapshot> = None;
        let mut total = 0;
        let targets = devices.iter().map(|d| Target::Device(d)).chain(tenants.iter().map(|t| Target::Tenant(t)));
        for target in targets {
            let mut state = lock(target.grant_state());
            if !leaving && (target.serving().load(SeqCst) > 0 || state.last_grant.is_some_and(|at| at.elapsed() < tick))
            {
                // Left alone this tick; pressure seen now is still answered next tick.
                continue;
            }
            let pressure = target.pressure(shared).load(SeqCst);
            let pressured = leaving || pressure != state.pressure_seen;
            state.pressure_seen = pressure;
            // A cheap look first: most ticks find nothing to give back.
            let cheap = match target {
                Target::Tenant(tenant) => Some(tenant.account.used()),
                Target::Device(device) => {
                    tenants.iter().find(|tenant| tenant.device == device.key).map(|tenant| tenant.account.device_used())
                }
            };
            let slack = if pressured { 0 } else { margin.saturating_mul(2) };
            if cheap.is_some_and(|used| state.held <= used.saturating_add(slack)) {
                continue;
            }
            let used = self.used_by(target, snapshot.get_or_insert_with(|| self.governor.snapshot()));
            let keep = used.saturating_add(if pressured { 0 } else { margin });
            if state.held <= keep || (!pressured && state.held <= used.saturating_add(slack)) {
                continue;
            }
            if target.apply(&self.governor, keep).is_err() {
                continue;
            }
            // Admissions on other threads go on while we look: one that drew from the
            // local budget between the look above and the lower limit is charged beyond
            // `keep`. Measured again now that the lower limit stands, what is used stays
            // granted (and the local limit with it), so the slot's word never falls below
            // what the governor holds.
            let now = self.used_by(target, &self.governor.snapshot());
            let keep = if now > keep {
                let kept = now.min(state.held);
                if target.apply(&self.governor, kept).is_err() {
                    // The lower limit stands: the grant stays as it was, above it.
                    continue;
                }
                kept
            } else {
                keep
            };
            if state.held <= keep {
                continue;
            }
            let surplus = state.held - keep;
            protocol::give_back(shared, self.slot, target.budget(), surplus);
            state.held = keep;
            self.counters.given_back_bytes.fetch_add(surplus, SeqCst);
            total += surplus;
            tracing::trace!(slot = self.slot, budget = %target.name(), surplus, held = keep, pressured, "node give-back");
        }
        total
    }

    /// What the governor holds of `target`'s budget: drawn (charges, cached credit and
    /// reserves), or held by caches, if more.
    fn used_by(&self, target: Target<'_>, snapshot: &GovernorSnapshot) -> u64 {
        match target {
            Target::Device(device) => {
                snapshot.device(device.key).map_or(0, |d| d.used.max(d.reserved).max(d.held_by_caches))
            }
            Target::Tenant(tenant) => {
                let account = tenant.account.snapshot();
                account.used.max(account.reserved)
            }
        }
    }

    /// Writes allocated and reserved per device and allocated per tenant into the slot.
    fn publish(&self, snapshot: &GovernorSnapshot) {
        if self.books.check_not_forked().is_err() {
            return;
        }
        let entry = &self.shared().slots[self.slot];
        for device in lock(&self.devices).iter() {
            let (allocated, reserved) = snapshot.device(device.key).map_or((0, 0), |d| (d.allocated, d.reserved));
            entry.device_allocated[device.entry].store(allocated, SeqCst);
            entry.device_reserved[device.entry].store(reserved, SeqCst);
        }
        for tenant in lock(&self.tenants).iter() {
            let _ = tenant.device_entry;
            entry.tenant_allocated[tenant.entry].store(tenant.account.snapshot().allocated, SeqCst);
        }
    }

    fn run_timer(&self) {
        let config = self.config().clone();
        let mut last_scan = Instant::now();
        let mut stop = lock(&self.stop);
        while !*stop {
            stop = self.wake.wait_timeout(stop, config.tick).map_or_else(|e| e.into_inner().0, |(guard, _)| guard);
            if *stop {
                break;
            }
            drop(stop);
            self.give_back_surplus(false);
            if config.scan_due(last_scan.elapsed()) {
                last_scan = Instant::now();
                if let Ok(Some(refunds)) = self.books.refund_dead_within(config.tick) {
                    self.counters.refunds.fetch_add(refunds.len() as u64, SeqCst);
                }
                self.publish(&self.governor.snapshot());
            }
            stop = lock(&self.stop);
        }
    }
}

/// The admission policy of a device governed by the node books. On a shortfall (the
/// local limit or a bound tenant's local quota is full) it draws a grant of at least
/// what is missing (a grant chunk if the node has it) from the node, raises the local
/// limit, and answers [`ShortfallDecision::Reclaim`]: the governor then asks its
/// holders, the first of which is this member's node holder, which reports the grant
/// as freed, so no other holder is asked and the governor retries. When the node has
/// nothing (after refunding dead slots and waiting for surplus), `inner` decides.
pub struct NodePolicy {
    member: Weak<MemberInner>,
    device: DeviceKey,
    inner: Arc<dyn AdmissionPolicy>,
    name: String,
}

impl std::fmt::Debug for NodePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodePolicy").field("device", &self.device).field("inner", &self.inner.name()).finish()
    }
}

impl AdmissionPolicy for NodePolicy {
    fn name(&self) -> &str {
        &self.name
    }

    fn reserve(&self, role: MemoryRole) -> u64 {
        self.inner.reserve(role)
    }

    fn on_shortfall(&self, shortfall: &Shortfall) -> ShortfallDecision {
        let granted = self.member.upgrade().map_or(0, |member| member.grow_for(shortfall));
        if granted > 0 {
            HANDOFF.set(Some(Handoff { device: shortfall.device, authority: shortfall.authority, bytes: granted }));
            return ShortfallDecision::Reclaim;
        }
        let decision = self.inner.on_shortfall(shortfall);
        if decision == ShortfallDecision::Reclaim {
            // The node holder has nothing for this one: the real holders are asked.
            HANDOFF.set(Some(Handoff { device: shortfall.device, authority: shortfall.authority, bytes: 0 }));
        }
        decision
    }
}

/// The name of a member's reclaim holder on each device it governs.
const NODE_HOLDER: &str = "node-books";

/// The first reclaim holder of a governed device: it hands the governor the grant its
/// [`NodePolicy`] just drew on this thread, and on the recovery ladder (no policy call
/// before it) draws a device grant for what the ladder misses.
struct NodeHolder {
    member: Weak<MemberInner>,
    device: DeviceKey,
}

impl ReclaimHolder for NodeHolder {
    fn name(&self) -> &str {
        NODE_HOLDER
    }

    fn reclaimable(&self, _device: DeviceKey) -> u64 {
        0
    }

    fn reclaim(&self, request: &ReclaimRequest) -> u64 {
        match HANDOFF.take() {
            Some(handoff) if handoff.device == request.device && handoff.authority == request.authority => {
                handoff.bytes
            }
            _ => self
                .member
                .upgrade()
                .and_then(|member| {
                    let device = member.device(self.device)?;
                    let _serving = Target::Device(&device).serve();
                    Some(member.grow(Target::Device(&device), request.bytes))
                })
                .unwrap_or(0),
        }
    }
}
