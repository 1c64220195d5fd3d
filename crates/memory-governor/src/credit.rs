//! Budgets and per-thread credit: the admission protocol.
//!
//! # The books
//! Every budget is one `Budget`: `used` (bytes drawn from it), `limit`, `peak`, and
//! `drainers` (threads currently pulling credit back). An account's budget (an
//! authority's quota) is nested in its device's budget: every byte drawn is drawn from
//! both. A device also keeps, per role, a `DeviceRole`: the role's usage on the
//! device and its reserve (see "Reserves" below).
//!
//! # Credit
//! One shared `used` counter written by every admission does not scale, so each thread
//! keeps, per (account, role), a `Slot` of *credit*: bytes already drawn from the
//! account and the device but not yet handed to any charge. An admission that fits the
//! thread's credit is a few plain loads and stores on a cache line only this thread
//! writes, with no read-modify-write; so is a refund (see "The owner's section"). Credit is drawn in chunks (the request plus one chunk) and
//! only while the budget has a chunk to spare; a slot never caches more than two chunks.
//!
//! Hence, for every budget, at every instant:
//! `used = charges + credit cached in slots + credit a thread is moving`,
//! and `used <= limit` is kept by a compare-and-swap on `used`, so charges never exceed
//! the limit.
//!
//! # The owner's section
//! A slot word packs the credit with a flag, `CLOSED`: the slot may not cache credit
//! (refunds go straight to the shared budget, admissions draw exactly what they need).
//! The word is written only by the slot's owner inside its *section*, or by a sweeper
//! (below) that holds the slot. The owner enters by storing `active`, passing the hot
//! side of the Dekker barrier pair ([`light_barrier`]) and reading `sweeping`; a sweeper
//! claims `sweeping` (a compare-and-swap among sweepers), passes the cold side
//! ([`heavy_barrier`], one `membarrier` per sweep of a list) and reads `active`. Either the
//! owner sees the sweeper, leaves the word alone and uses the shared books for that
//! operation, or the sweeper sees the owner and counts the slot *busy* (it sweeps it again
//! once the owner is done). The owner's section is a few instructions (a chunk draw at
//! most: a few atomic operations, no callback, no lock), so the owner's operations are
//! plain loads and stores and a compiler fence where `membarrier` is offered.
//!
//! # Returning credit
//!
//! When an admission finds the shared budget short, it becomes a *drainer*: it counts
//! itself in `drainers` of the account and the device, then *sweeps* the slots of the
//! short budget: each slot's credit goes back to the shared budget and the slot is
//! closed. A closed slot reopens only when its owner finds no drainer on either budget
//! and the budget has room for a chunk to spare. The owner enters its section (a store
//! and the light barrier) before it reads `drainers` with a read-modify-write, and a
//! drainer increments `drainers` before it claims the slot and passes the heavy barrier,
//! so either the owner sees the drainer and stays closed, or the drainer sees the owner
//! active and sweeps the slot again once the owner is done. A drainer
//! that meets a busy slot waits for that window (a few atomic operations, no callback,
//! no lock) and sweeps again.
//!
//! So after a sweep that met no busy slot, no credit is cached in any slot of that
//! budget, and none can be until the drainer leaves: an admission refused then is
//! refused because charges (and other admissions in flight) fill the budget, never
//! because unused credit sits with another thread. Lowering a limit sweeps the same
//! way, so cached credit cannot outlive the old limit.
//!
//! # Reserves
//! A role with a reserve of `r` bytes occupies `max(usage, r)` of its device: the
//! device budget's `used` is the sum of that over roles, so the last `r` bytes can only
//! ever be drawn by that role, and bytes it draws inside its reserve cost the device
//! nothing more. Each change of a role's usage commits with one compare-and-swap of
//! the role's word and moves the device budget by exactly the change in
//! `max(usage, r)`; a reserve change freezes the word and bumps its 7-bit version, so no
//! draw computed against the old reserve commits (unless one thread stalls between two
//! atomic operations of one draw for exactly a multiple of 128 reserve changes). The
//! books stay exact: after every charge is refunded, a device's `used` is the sum of its
//! reserves.
//!
//! The loom models in `src/loom_credit.rs` check these claims under every interleaving
//! of admissions, refunds, sweeps and limit changes (within a preemption bound).

use memory_api::MemoryRole;

use crate::sync::{
    Arc, AtomicBool, AtomicU64, BarrierMode, CachePadded, Mutex, Ordering, heavy_barrier, light_barrier, lock,
    wait_for_other_thread,
};

/// Number of roles (per-role arrays).
pub(crate) const ROLES: usize = MemoryRole::ALL.len();

/// A limit that never refuses anything.
pub(crate) const UNLIMITED: u64 = u64::MAX;

/// Slot flag: the slot may not cache credit.
const CLOSED: u64 = 1 << 63;
/// Slot bits holding the credit.
const CREDIT: u64 = (1 << 62) - 1;

/// The largest chunk of credit a slot may draw (a slot holds at most two chunks).
pub(crate) const MAX_CHUNK: u64 = CREDIT / 4;

/// Whether `n` more bytes (plus `slack` to spare) fit under `limit` when `used` are used.
fn fits(used: u64, n: u64, slack: u64, limit: u64) -> bool {
    used.checked_add(n).and_then(|total| total.checked_add(slack)).is_some_and(|total| total <= limit)
}

/// Raises `peak` to `value` if it is lower (a load first, so the common case writes nothing).
pub(crate) fn bump_peak(peak: &AtomicU64, value: u64) {
    if peak.load(Ordering::Relaxed) < value {
        peak.fetch_max(value, Ordering::Relaxed);
    }
}

/// Bits of a budget's `used` word that hold bytes; the 4 bits above count lowerings of
/// the limit (see [`Budget::try_draw`]). 2^60 bytes holds every role's word
/// ([`ROLE_USED`]) summed, so a role's overflow is always found by the role.
const USED_BYTES: u64 = (1 << 60) - 1;
/// One lowering in a budget's `used` word.
const ONE_LOWERING: u64 = 1 << 60;

/// One limited counter: a device budget or an account's quota.
#[derive(Debug)]
pub(crate) struct Budget {
    /// Bytes drawn ([`USED_BYTES`]) and, above them, a count of limit lowerings.
    used: AtomicU64,
    limit: AtomicU64,
    peak: AtomicU64,
    drainers: AtomicU64,
}

impl Budget {
    pub(crate) fn new(limit: u64) -> Budget {
        Budget {
            used: AtomicU64::new(0),
            limit: AtomicU64::new(limit),
            peak: AtomicU64::new(0),
            drainers: AtomicU64::new(0),
        }
    }

    /// Bytes drawn (charges, cached credit, and for a device the reserves held).
    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire) & USED_BYTES
    }

    pub(crate) fn limit(&self) -> u64 {
        self.limit.load(Ordering::Acquire)
    }

    /// High-water mark of [`Budget::used`].
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Draws `n` (with `slack` to spare) or reports `used` at the refusal. Drawing
    /// nothing always succeeds, even over a lowered limit.
    ///
    /// A draw racing a lowering of the limit is either seen by the lowering or checked
    /// against the new limit: a lowering swaps the limit, then bumps the lowering count
    /// in `used`'s word ([`Budget::swap_limit`]). If the draw's compare-and-swap comes
    /// first, the bump (a read-modify-write of the same word) and every later read of
    /// `used` count the draw. If the bump comes first, the word the draw read and
    /// compared carries it, so that read acquired the bump and the limit it read after
    /// is the new one; a word read before the bump makes the compare-and-swap fail and
    /// the draw retry. No extra atomic operation on the draw's path. (The count wraps
    /// after 16 lowerings: a draw stalled between its read and its compare-and-swap
    /// across exactly a multiple of 16 lowerings, with `used` back at the bytes it read,
    /// could miss them.)
    fn try_draw(&self, n: u64, slack: u64) -> Result<(), u64> {
        if n == 0 {
            return Ok(());
        }
        let before = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |word| {
                let used = word & USED_BYTES;
                (fits(used, n, slack, self.limit.load(Ordering::Acquire)) && used + n <= USED_BYTES).then(|| word + n)
            })
            .map_err(|word| word & USED_BYTES)?;
        bump_peak(&self.peak, (before & USED_BYTES) + n);
        Ok(())
    }

    fn give_back(&self, n: u64) {
        if n > 0 {
            self.used.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Reads `drainers` with a read-modify-write, so that it orders against the
    /// increment of a drainer that then sweeps (see the module docs).
    fn has_drainers(&self) -> bool {
        self.drainers.fetch_add(0, Ordering::AcqRel) != 0
    }

    /// Swaps the limit; returns the old one. A lowering also bumps the lowering count
    /// in `used`'s word after the swap, so that no draw racing it commits unseen against
    /// the old limit (see [`Budget::try_draw`]).
    fn swap_limit(&self, limit: u64) -> u64 {
        let old = self.limit.swap(limit, Ordering::AcqRel);
        if limit < old {
            self.used.fetch_add(ONE_LOWERING, Ordering::AcqRel);
        }
        old
    }

    /// Counts one drainer until the guard drops (also on unwind).
    fn enter_drain(&self) -> DrainGuard<'_> {
        self.drainers.fetch_add(1, Ordering::AcqRel);
        DrainGuard { budget: self }
    }
}

struct DrainGuard<'a> {
    budget: &'a Budget,
}

impl Drop for DrainGuard<'_> {
    fn drop(&mut self) {
        self.budget.drainers.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Role word: a reserve change is in progress (draws and returns of the role wait).
const FROZEN: u64 = 1 << 63;
/// Role word: version bits, bumped by every reserve change, so that a draw computed
/// against the old reserve cannot commit.
const VERSION_SHIFT: u32 = 56;
const VERSION: u64 = 0x7f << VERSION_SHIFT;
/// Role word: bytes of the role drawn on the device (charges plus cached credit).
pub(crate) const ROLE_USED: u64 = (1 << VERSION_SHIFT) - 1;

/// `max(used, reserve)`: what a role occupies of its device.
fn occupied(used: u64, reserve: u64) -> u64 {
    used.max(reserve)
}

/// One role on one device: its usage and its reserve.
///
/// The device budget's `used` is the sum over roles of `max(usage, reserve)`: a role
/// with a reserve occupies at least its reserve, and bytes it draws inside the reserve
/// cost the device nothing more. Every change of a role's usage commits with one
/// compare-and-swap of `word` and moves the device budget by exactly
/// `max(new, reserve) - max(old, reserve)`, so the budget stays exact.
#[derive(Debug)]
pub(crate) struct DeviceRole {
    word: AtomicU64,
    target: AtomicU64,
}

impl DeviceRole {
    fn new() -> DeviceRole {
        DeviceRole { word: AtomicU64::new(0), target: AtomicU64::new(0) }
    }

    /// The reserve.
    pub(crate) fn target(&self) -> u64 {
        self.target.load(Ordering::Acquire)
    }

    /// Bytes of this role drawn on the device.
    pub(crate) fn used(&self) -> u64 {
        self.word.load(Ordering::Acquire) & ROLE_USED
    }

    /// Bytes of the reserve not drawn (held aside for this role).
    pub(crate) fn held(&self) -> u64 {
        self.target().saturating_sub(self.used())
    }

    /// Loads the word, waiting while a reserve change is in progress.
    fn load_settled(&self) -> u64 {
        loop {
            let word = self.word.load(Ordering::Acquire);
            if word & FROZEN == 0 {
                return word;
            }
            wait_for_other_thread();
        }
    }

    /// Draws `n` bytes of this role from `budget`, keeping `slack` to spare when the
    /// draw costs the budget anything.
    fn draw(&self, budget: &Budget, n: u64, slack: u64) -> Result<(), Short> {
        let mut word = self.load_settled();
        // What this draw has taken from the budget so far.
        let mut charged = 0u64;
        loop {
            let used = word & ROLE_USED;
            let Some(after) = used.checked_add(n).filter(|&after| after <= ROLE_USED) else {
                budget.give_back(charged);
                return Err(Short::Overflow { used, limit: ROLE_USED });
            };
            let reserve = self.target.load(Ordering::Acquire);
            let cost = occupied(after, reserve) - occupied(used, reserve);
            if cost > charged {
                if let Err(used) = budget.try_draw(cost - charged, slack) {
                    budget.give_back(charged);
                    return Err(Short::Device { used, limit: budget.limit() });
                }
            } else {
                budget.give_back(charged - cost);
            }
            charged = cost;
            match self.word.compare_exchange(word, word + n, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(now) if now & FROZEN != 0 => {
                    budget.give_back(charged);
                    charged = 0;
                    word = self.load_settled();
                }
                Err(now) => word = now,
            }
        }
    }

    /// Returns `n` bytes of this role to `budget`.
    fn give_back(&self, budget: &Budget, n: u64) {
        let mut word = self.load_settled();
        loop {
            let used = word & ROLE_USED;
            let after = used.saturating_sub(n);
            let reserve = self.target.load(Ordering::Acquire);
            match self.word.compare_exchange(word, word - (used - after), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    budget.give_back(occupied(used, reserve) - occupied(after, reserve));
                    return;
                }
                Err(now) if now & FROZEN != 0 => word = self.load_settled(),
                Err(now) => word = now,
            }
        }
    }

    /// Changes the reserve to `target`, moving the budget by the difference in what the
    /// role occupies. Callers serialise the reserve changes of a device.
    fn set_target(&self, budget: &Budget, target: u64) -> Result<(), u64> {
        // Freeze the role: no draw or return of it commits until the change is done.
        let mut word = self.load_settled();
        loop {
            match self.word.compare_exchange_weak(word, word | FROZEN, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) if now & FROZEN != 0 => word = self.load_settled(),
                Err(now) => word = now,
            }
        }
        let used = word & ROLE_USED;
        let old = self.target.load(Ordering::Acquire);
        let (before, after) = (occupied(used, old), occupied(used, target));
        let result = if after > before {
            budget.try_draw(after - before, 0).map_err(|used| budget.limit().saturating_sub(used))
        } else {
            budget.give_back(before - after);
            Ok(())
        };
        if result.is_ok() {
            self.target.store(target, Ordering::Release);
        }
        // Unfreeze with a new version, so that no draw computed against the old reserve
        // can commit.
        let version = (word & VERSION).wrapping_add(1 << VERSION_SHIFT) & VERSION;
        self.word.store(version | used, Ordering::Release);
        result
    }
}

/// A device's shared books.
#[derive(Debug)]
pub(crate) struct DeviceCounters {
    pub(crate) budget: CachePadded<Budget>,
    pub(crate) roles: [CachePadded<DeviceRole>; ROLES],
}

impl DeviceCounters {
    pub(crate) fn new(limit: u64) -> DeviceCounters {
        DeviceCounters {
            budget: CachePadded::new(Budget::new(limit)),
            roles: std::array::from_fn(|_| CachePadded::new(DeviceRole::new())),
        }
    }

    /// Sum of the reserves.
    pub(crate) fn reserve_targets(&self) -> u64 {
        self.roles.iter().map(|r| r.target()).sum()
    }

    /// Sets the reserve of `role` (callers serialise reserve changes).
    ///
    /// Returns `Err(available)` when the budget cannot hold a raised reserve.
    pub(crate) fn set_reserve(&self, role: usize, target: u64) -> Result<(), u64> {
        self.roles[role].set_target(&self.budget, target)
    }
}

/// Per-role books of an account (no limit of their own).
#[derive(Debug)]
pub(crate) struct RoleCounter {
    used: AtomicU64,
    peak: AtomicU64,
}

impl RoleCounter {
    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
}

/// An account's shared books: its quota and its per-role counters.
#[derive(Debug)]
pub(crate) struct AccountCounters {
    pub(crate) budget: CachePadded<Budget>,
    pub(crate) roles: [CachePadded<RoleCounter>; ROLES],
}

impl AccountCounters {
    pub(crate) fn new(quota: u64) -> AccountCounters {
        AccountCounters {
            budget: CachePadded::new(Budget::new(quota)),
            roles: std::array::from_fn(|_| {
                CachePadded::new(RoleCounter { used: AtomicU64::new(0), peak: AtomicU64::new(0) })
            }),
        }
    }
}

/// Why a draw was refused: which budget, and what it held at the refusal.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Short {
    /// The account's quota.
    Account { used: u64, limit: u64 },
    /// The device's budget (after the role's own reserve).
    Device { used: u64, limit: u64 },
    /// The role's usage on the device would pass [`ROLE_USED`].
    Overflow { used: u64, limit: u64 },
}

/// Where bytes of one role of one account are drawn from and returned to.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Path<'a> {
    pub(crate) account: &'a AccountCounters,
    pub(crate) device: &'a DeviceCounters,
    pub(crate) role: usize,
}

impl Path<'_> {
    /// Draws `n` bytes from the account and the device (inside the role's reserve
    /// first), keeping `slack` to spare in both.
    pub(crate) fn draw(&self, n: u64, slack: u64) -> Result<(), Short> {
        let account = &self.account.budget;
        if let Err(used) = account.try_draw(n, slack) {
            return Err(Short::Account { used, limit: account.limit() });
        }
        if let Err(short) = self.device.roles[self.role].draw(&self.device.budget, n, slack) {
            account.give_back(n);
            return Err(short);
        }
        let role = &self.account.roles[self.role];
        let before = role.used.fetch_add(n, Ordering::AcqRel);
        bump_peak(&role.peak, before + n);
        Ok(())
    }

    /// Returns `n` bytes to the shared books.
    pub(crate) fn give_back(&self, n: u64) {
        if n == 0 {
            return;
        }
        self.account.roles[self.role].used.fetch_sub(n, Ordering::AcqRel);
        self.account.budget.give_back(n);
        self.device.roles[self.role].give_back(&self.device.budget, n);
    }
}

/// One thread's credit for one role of one account, on its own cache line.
///
/// Only the owning thread admits and refunds through a slot, inside its section; other
/// threads only sweep it (see the module docs). `opened` and `closed` count the charges
/// the owner opened and closed; only the owner writes them.
// Aligned like `CachePadded` (128 bytes covers adjacent-line prefetch), so two threads'
// slots never share a line.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Slot {
    /// Credit and `CLOSED`: written by the owner in its section, or by the sweeper that
    /// holds `sweeping` while the owner is outside it.
    word: AtomicU64,
    /// The owner is inside its section (written by the owner only).
    active: AtomicBool,
    /// A sweeper holds the slot (claimed by compare-and-swap among sweepers).
    sweeping: AtomicBool,
    /// The barrier pair of this process (the same for the owner and every sweeper).
    mode: BarrierMode,
    opened: AtomicU64,
    closed: AtomicU64,
    retired: AtomicBool,
    role: usize,
    account: Arc<AccountCounters>,
    device: Arc<DeviceCounters>,
}

// Two threads' slots must never share a cache line (that alone halves two-thread
// throughput on one budget).
const _: () = assert!(std::mem::align_of::<Slot>() >= 128);

/// The outcome of one sweep of a list of slots.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Sweep {
    /// Bytes of credit returned to the shared books.
    pub(crate) returned: u64,
    /// Whether a busy slot was met (it must be swept again).
    pub(crate) busy: bool,
}

impl Slot {
    /// A new slot. It starts closed, so that its first admission checks for drainers
    /// before caching anything.
    pub(crate) fn new(account: Arc<AccountCounters>, device: Arc<DeviceCounters>, role: usize) -> Slot {
        Slot {
            word: AtomicU64::new(CLOSED),
            active: AtomicBool::new(false),
            sweeping: AtomicBool::new(false),
            mode: BarrierMode::detect(),
            opened: AtomicU64::new(0),
            closed: AtomicU64::new(0),
            retired: AtomicBool::new(false),
            role,
            account,
            device,
        }
    }

    pub(crate) fn path(&self) -> Path<'_> {
        Path { account: &self.account, device: &self.device, role: self.role }
    }

    pub(crate) fn role(&self) -> usize {
        self.role
    }

    /// Credit cached here right now.
    pub(crate) fn credit(&self) -> u64 {
        self.word.load(Ordering::Acquire) & CREDIT
    }

    /// Whether the slot is closed (caches no credit).
    #[cfg(test)]
    pub(crate) fn is_closed(&self) -> bool {
        self.word.load(Ordering::Acquire) & CLOSED != 0
    }

    /// Charges opened and closed by the owner.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (self.opened.load(Ordering::Relaxed), self.closed.load(Ordering::Relaxed))
    }

    /// Whether the owning thread has gone.
    pub(crate) fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// A cheap, possibly stale look at whether a drainer works on either budget. Only
    /// ever used to skip work; the decision to reopen re-checks with
    /// [`Budget::has_drainers`].
    fn drainers_visible(&self) -> bool {
        self.account.budget.drainers.load(Ordering::Relaxed) != 0
            || self.device.budget.drainers.load(Ordering::Relaxed) != 0
    }

    /// A cheap, possibly stale look at whether both budgets have `n` bytes to spare.
    fn room_visible(&self, n: u64) -> bool {
        let room = |budget: &Budget| {
            fits(budget.used.load(Ordering::Relaxed) & USED_BYTES, n, 0, budget.limit.load(Ordering::Relaxed))
        };
        room(&self.account.budget) && room(&self.device.budget)
    }

    /// Counts one charge opened (owner only: a load and a store, no read-modify-write).
    pub(crate) fn count_open(&self) {
        self.opened.store(self.opened.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }

    /// Takes back one count of [`Slot::count_open`] (owner only).
    pub(crate) fn uncount_open(&self) {
        self.opened.store(self.opened.load(Ordering::Relaxed).wrapping_sub(1), Ordering::Relaxed);
    }

    fn count_close(&self) {
        self.closed.store(self.closed.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }

    /// Enters the owner's section (see the module docs): `false` when a sweeper holds
    /// the slot (the owner must not touch the word then; it uses the shared books).
    #[inline(always)]
    fn enter(&self) -> bool {
        self.active.store(true, Ordering::Relaxed);
        light_barrier(self.mode);
        // Acquire: a sweep that ended before this read is seen whole (its word store).
        if self.sweeping.load(Ordering::Acquire) {
            self.leave();
            return false;
        }
        true
    }

    /// Leaves the owner's section; a sweeper that then reads `active` sees the word.
    #[inline(always)]
    fn leave(&self) {
        self.active.store(false, Ordering::Release);
    }

    /// The fast path: takes `n` from this slot's credit. `false` when the slot is
    /// closed, being swept or short (then call [`Slot::admit_slow`]).
    #[inline]
    pub(crate) fn admit_fast(&self, n: u64) -> bool {
        // A look before entering: the owner is the word's usual writer.
        let peek = self.word.load(Ordering::Relaxed);
        if peek & CLOSED != 0 || peek < n || !self.enter() {
            return false;
        }
        let word = self.word.load(Ordering::Relaxed);
        let admitted = word & CLOSED == 0 && word >= n;
        if admitted {
            self.word.store(word - n, Ordering::Relaxed);
        }
        self.leave();
        if admitted {
            self.count_open();
        }
        admitted
    }

    /// Whether a closed slot stays closed for an admission of `n`: it may not cache the
    /// request, or a drainer is visibly at work, or the budget has no room to spare.
    fn stays_closed(&self, word: u64, cacheable: bool, n: u64, chunk: u64) -> bool {
        word & CLOSED != 0 && (!cacheable || self.drainers_visible() || !self.room_visible(n + 2 * chunk))
    }

    /// Admits `n` bytes straight from the shared books (the slot is closed, or a
    /// sweeper holds it).
    fn admit_from_books(&self, n: u64) -> Result<(), Short> {
        let result = self.path().draw(n, 0);
        if result.is_ok() {
            self.count_open();
        }
        result
    }

    /// Admits `n` bytes, refilling the slot with a chunk when it may cache credit;
    /// draws exactly `n` when it may not. Does not sweep other slots.
    pub(crate) fn admit_slow(&self, n: u64, chunk: u64) -> Result<(), Short> {
        let cap = 2 * chunk;
        let cacheable = chunk > 0 && n <= cap;
        // A closed slot holds no credit and, while a drainer is visibly at work, will
        // not reopen: leave it alone, so that a sweeping drainer never waits for it.
        if self.stays_closed(self.word.load(Ordering::Relaxed), cacheable, n, chunk) || !self.enter() {
            return self.admit_from_books(n);
        }
        // The word is ours until `leave`.
        let word = self.word.load(Ordering::Relaxed);
        if self.stays_closed(word, cacheable, n, chunk) {
            self.leave();
            return self.admit_from_books(n);
        }
        let credit = word & CREDIT;
        let closed = word & CLOSED;
        let (result, credit, closed) = if credit >= n {
            (Ok(()), credit - n, closed)
        } else {
            let need = n - credit;
            // Reopening a closed slot is decided inside the section, with
            // read-modify-writes of `drainers` (see the module docs): a drainer either
            // sees the owner active or is seen.
            let may_cache = cacheable
                && (closed == 0 || (!self.account.budget.has_drainers() && !self.device.budget.has_drainers()));
            if may_cache && self.path().draw(need + chunk, chunk).is_ok() {
                // Reopened (if it was closed) with one chunk of credit.
                (Ok(()), chunk, 0)
            } else {
                match self.path().draw(need, 0) {
                    Ok(()) => (Ok(()), 0, closed),
                    Err(short) => (Err(short), credit, closed),
                }
            }
        };
        self.word.store(credit | closed, Ordering::Relaxed);
        self.leave();
        if result.is_ok() {
            self.count_open();
        }
        result
    }

    /// Refunds `n` bytes: into this slot's credit when it is open and has room, else
    /// straight to the shared books. `close` counts the end of one charge.
    #[inline]
    pub(crate) fn refund(&self, n: u64, chunk: u64, close: bool) {
        if close {
            self.count_close();
        }
        let cap = 2 * chunk;
        let peek = self.word.load(Ordering::Relaxed);
        if peek & CLOSED == 0 && n <= cap && peek + n <= cap && self.enter() {
            let word = self.word.load(Ordering::Relaxed);
            let cached = word & CLOSED == 0 && word + n <= cap;
            if cached {
                self.word.store(word + n, Ordering::Relaxed);
            }
            self.leave();
            if cached {
                return;
            }
        }
        self.path().give_back(n);
    }

    /// First half of a sweep: claims the slot against other sweepers. `false` when
    /// another sweeper holds it.
    fn claim_sweep(&self) -> bool {
        self.sweeping.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Second half of a sweep, after the heavy barrier: unless the owner is in its
    /// section, returns the slot's credit to the shared books and closes it. Releases
    /// the claim. `None` when the owner is active (sweep it again).
    fn finish_sweep(&self) -> Option<u64> {
        // Acquire: the owner's last section ended with a release store of `active`.
        let returned = if self.active.load(Ordering::Acquire) {
            None
        } else {
            let credit = self.word.load(Ordering::Acquire) & CREDIT;
            self.path().give_back(credit);
            self.word.store(CLOSED, Ordering::Release);
            Some(credit)
        };
        self.sweeping.store(false, Ordering::Release);
        returned
    }

    /// Returns this slot's credit to the shared books and closes it. Returns `None`
    /// when the slot is busy (its owner is in its section, or another sweeper holds it:
    /// sweep it again).
    fn sweep(&self) -> Option<u64> {
        if !self.claim_sweep() {
            return None;
        }
        heavy_barrier(self.mode);
        self.finish_sweep()
    }

    /// The owner is gone: returns the credit, closes the slot for good.
    pub(crate) fn retire(&self) {
        while self.sweep().is_none() {
            wait_for_other_thread();
        }
        self.retired.store(true, Ordering::Release);
    }
}

/// Sweeps every slot of `slots` once (see the module docs). The list lock is held
/// only to copy the list: a slot registered after the copy starts closed and cannot
/// reopen while the sweeping drainer is counted.
///
/// Every slot is claimed first, then one heavy barrier serves them all.
pub(crate) fn sweep(slots: &Mutex<Vec<Arc<Slot>>>) -> Sweep {
    let slots: Vec<Arc<Slot>> = lock(slots).clone();
    let mut outcome = Sweep::default();
    let claimed: Vec<bool> = slots.iter().map(|slot| slot.claim_sweep()).collect();
    if claimed.contains(&true) {
        heavy_barrier(BarrierMode::detect());
    }
    for (slot, claimed) in slots.iter().zip(claimed) {
        match claimed.then(|| slot.finish_sweep()).flatten() {
            Some(returned) => outcome.returned += returned,
            None => outcome.busy = true,
        }
    }
    outcome
}

/// The lists of slots a drain may sweep: the account's and the device's.
#[derive(Copy, Clone, Debug)]
pub(crate) struct SlotLists<'a> {
    pub(crate) account: &'a Mutex<Vec<Arc<Slot>>>,
    pub(crate) device: &'a Mutex<Vec<Arc<Slot>>>,
}

/// Admits `n` bytes on `path` after a refused draw, pulling back the credit other
/// threads cache in the short budget. Fails only when, after a sweep that met no busy
/// slot, the budget still cannot hold `n`.
pub(crate) fn admit_draining(path: Path<'_>, n: u64, lists: SlotLists<'_>) -> Result<(), Short> {
    let _account = path.account.budget.enter_drain();
    let _device = path.device.budget.enter_drain();
    let mut account_swept = false;
    let mut device_swept = false;
    loop {
        let short = match path.draw(n, 0) {
            Ok(()) => return Ok(()),
            Err(short) => short,
        };
        let swept = match short {
            Short::Account { .. } if !account_swept => {
                account_swept = true;
                sweep(lists.account)
            }
            Short::Device { .. } if !device_swept => {
                device_swept = true;
                sweep(lists.device)
            }
            _ => return Err(short),
        };
        if swept.busy {
            // Someone is moving credit in or out of a slot: sweep again after it is done.
            match short {
                Short::Account { .. } => account_swept = false,
                Short::Device { .. } | Short::Overflow { .. } => device_swept = false,
            }
            wait_for_other_thread();
        }
    }
}

/// Sets `budget`'s limit. When it is lowered, sweeps `slots` so that no credit cached
/// under the old limit survives (nothing charged is revoked). Returns the old limit.
pub(crate) fn set_limit(budget: &Budget, limit: u64, slots: &Mutex<Vec<Arc<Slot>>>) -> u64 {
    let old = budget.swap_limit(limit);
    if limit < old {
        let _drain = budget.enter_drain();
        while sweep(slots).busy {
            wait_for_other_thread();
        }
    }
    old
}

/// Closes every slot of `slots` and returns their credit (idle credit, on request).
pub(crate) fn return_credit(budget: &Budget, slots: &Mutex<Vec<Arc<Slot>>>) -> u64 {
    let _drain = budget.enter_drain();
    let mut returned = 0;
    loop {
        let swept = sweep(slots);
        returned += swept.returned;
        if !swept.busy {
            return returned;
        }
        wait_for_other_thread();
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    const KV: usize = 1;
    const WEIGHTS: usize = 0;

    fn books(device_limit: u64, quota: u64) -> (Arc<AccountCounters>, Arc<DeviceCounters>) {
        (Arc::new(AccountCounters::new(quota)), Arc::new(DeviceCounters::new(device_limit)))
    }

    fn slot(books: &(Arc<AccountCounters>, Arc<DeviceCounters>), role: usize) -> Arc<Slot> {
        Arc::new(Slot::new(Arc::clone(&books.0), Arc::clone(&books.1), role))
    }

    #[test]
    fn a_new_slot_is_closed_and_its_first_admission_draws_a_chunk() {
        let books = books(1000, UNLIMITED);
        let slot = slot(&books, KV);
        assert!(!slot.admit_fast(1), "a new slot holds nothing");
        slot.admit_slow(10, 100).unwrap();
        assert_eq!(slot.credit(), 100, "request plus one chunk drawn, the chunk cached");
        assert_eq!(books.1.budget.used(), 110);
        assert!(slot.admit_fast(100));
        assert_eq!(slot.credit(), 0);
    }

    #[test]
    fn refunds_cache_up_to_two_chunks_then_go_to_the_books() {
        let books = books(10_000, UNLIMITED);
        let slot = slot(&books, KV);
        slot.admit_slow(150, 100).unwrap();
        assert_eq!(slot.credit(), 100);
        slot.refund(100, 100, true);
        assert_eq!(slot.credit(), 200, "cached: within two chunks");
        slot.refund(50, 100, true);
        assert_eq!(slot.credit(), 200, "past two chunks: straight to the books");
        assert_eq!(books.1.budget.used(), 200);
        assert_eq!(books.0.roles[KV].used(), 200);
    }

    #[test]
    fn no_chunk_is_drawn_without_a_chunk_to_spare() {
        let books = books(120, UNLIMITED);
        let slot = slot(&books, KV);
        slot.admit_slow(100, 100).unwrap();
        assert_eq!((slot.credit(), books.1.budget.used()), (0, 100), "exact draw near the limit");
    }

    #[test]
    fn a_sweep_returns_credit_and_closes_the_slot_until_the_drainer_leaves() {
        let books = books(1000, UNLIMITED);
        let slot = slot(&books, KV);
        slot.admit_slow(10, 100).unwrap();
        let list = Mutex::new(vec![Arc::clone(&slot)]);
        let drain = books.1.budget.enter_drain();
        assert_eq!(sweep(&list), Sweep { returned: 100, busy: false });
        assert_eq!((slot.credit(), books.1.budget.used()), (0, 10));
        // While a drainer is counted, the closed slot draws exactly what it needs.
        slot.admit_slow(5, 100).unwrap();
        assert_eq!((slot.credit(), books.1.budget.used()), (0, 15));
        slot.refund(5, 100, true);
        assert_eq!((slot.credit(), books.1.budget.used()), (0, 10), "a closed slot caches no refund");
        drop(drain);
        // No drainer, room to spare: the slot reopens with a chunk.
        slot.admit_slow(5, 100).unwrap();
        assert_eq!((slot.credit(), books.1.budget.used()), (100, 115));
    }

    #[test]
    fn draining_pulls_back_credit_another_slot_caches() {
        let books = books(200, UNLIMITED);
        let idle = slot(&books, KV);
        idle.admit_slow(10, 50).unwrap();
        idle.refund(10, 50, true);
        assert_eq!(idle.credit(), 60);
        let needy = slot(&books, KV);
        let lists = (
            Mutex::new(vec![Arc::clone(&idle), Arc::clone(&needy)]),
            Mutex::new(vec![Arc::clone(&idle), Arc::clone(&needy)]),
        );
        assert!(needy.admit_slow(200, 50).is_err(), "60 bytes sit with the idle slot");
        admit_draining(needy.path(), 200, SlotLists { account: &lists.0, device: &lists.1 }).unwrap();
        assert_eq!((idle.credit(), books.1.budget.used()), (0, 200));
        let refused = admit_draining(needy.path(), 1, SlotLists { account: &lists.0, device: &lists.1 });
        assert_eq!(refused, Err(Short::Device { used: 200, limit: 200 }));
    }

    #[test]
    fn a_reserve_is_occupied_whether_used_or_not_and_moves_the_budget_exactly() {
        let books = books(1000, UNLIMITED);
        books.1.set_reserve(WEIGHTS, 300).unwrap();
        assert_eq!(books.1.budget.used(), 300);
        let path = Path { account: &books.0, device: &books.1, role: WEIGHTS };
        path.draw(200, 0).unwrap();
        assert_eq!(books.1.budget.used(), 300, "inside the reserve: free for the device");
        path.draw(200, 0).unwrap();
        assert_eq!(books.1.budget.used(), 400, "beyond the reserve: charged");
        assert_eq!(books.1.roles[WEIGHTS].held(), 0);
        // Lowering the reserve below usage frees nothing; raising above it charges the gap.
        books.1.set_reserve(WEIGHTS, 100).unwrap();
        assert_eq!(books.1.budget.used(), 400);
        books.1.set_reserve(WEIGHTS, 600).unwrap();
        assert_eq!(books.1.budget.used(), 600);
        path.give_back(400);
        assert_eq!((books.1.budget.used(), books.1.roles[WEIGHTS].held()), (600, 600));
        assert_eq!(books.1.set_reserve(WEIGHTS, 1200), Err(400));
        books.1.set_reserve(WEIGHTS, 0).unwrap();
        assert_eq!(books.1.budget.used(), 0);
    }

    #[test]
    fn a_busy_slot_is_left_alone_and_its_owner_uses_the_books() {
        let books = books(10_000, UNLIMITED);
        let slot = slot(&books, KV);
        slot.admit_slow(10, 100).unwrap();
        assert_eq!((slot.credit(), books.1.budget.used()), (100, 110));
        // Another thread is moving this slot's credit (a sweep in progress).
        assert!(slot.claim_sweep());
        assert!(!slot.admit_fast(5), "the fast path must not touch a slot being swept");
        slot.admit_slow(5, 100).unwrap();
        slot.refund(7, 100, true);
        assert_eq!(slot.word.load(Ordering::Acquire), 100, "the slot being swept was written");
        assert_eq!(books.1.budget.used(), 110 + 5 - 7, "drawn from and refunded to the books instead");
        let list = Mutex::new(vec![Arc::clone(&slot)]);
        assert_eq!(slot.sweep(), None);
        assert_eq!(sweep(&list), Sweep { returned: 0, busy: true });
        slot.sweeping.store(false, Ordering::Release);
        assert_eq!(sweep(&list), Sweep { returned: 100, busy: false });
        assert_eq!(slot.word.load(Ordering::Acquire), CLOSED);
        assert_eq!(slot.sweep(), Some(0), "a closed empty slot sweeps to nothing");
        assert_eq!(slot.counts(), (2, 1));
    }

    #[test]
    fn a_sweep_leaves_a_slot_whose_owner_is_in_its_section_and_reports_it_busy() {
        let books = books(10_000, UNLIMITED);
        let slot = slot(&books, KV);
        slot.admit_slow(10, 100).unwrap();
        let list = Mutex::new(vec![Arc::clone(&slot)]);
        // What `enter` stores first: the owner is between its reads and its write.
        slot.active.store(true, Ordering::Release);
        assert_eq!(sweep(&list), Sweep { returned: 0, busy: true });
        assert_eq!((slot.credit(), books.1.budget.used()), (100, 110), "the owner's credit was moved");
        assert!(slot.claim_sweep(), "a sweep that met the owner released its claim");
        slot.sweeping.store(false, Ordering::Release);
        slot.leave();
        assert_eq!(sweep(&list), Sweep { returned: 100, busy: false });
        assert_eq!(books.1.budget.used(), 10);
    }

    #[test]
    fn a_slot_short_of_a_request_draws_only_what_it_lacks_and_one_chunk() {
        let books = books(10_000, UNLIMITED);
        let slot = slot(&books, KV);
        slot.admit_slow(10, 100).unwrap();
        assert!(slot.admit_fast(80));
        assert_eq!((slot.credit(), books.1.budget.used()), (20, 110));
        // 50 asked, 20 cached: 30 more plus one chunk.
        slot.admit_slow(50, 100).unwrap();
        assert_eq!((slot.credit(), books.1.budget.used()), (100, 240));
        // A request beyond two chunks is drawn exactly, using up the cached credit.
        slot.admit_slow(500, 100).unwrap();
        assert_eq!((slot.credit(), books.1.budget.used()), (0, 640));
        assert_eq!(books.0.roles[KV].peak(), 640, "the role's high-water mark of what it drew");
    }

    #[test]
    fn a_slot_holding_enough_credit_serves_the_slow_path_from_it() {
        let books = books(10_000, UNLIMITED);
        let slot = slot(&books, KV);
        slot.admit_slow(10, 100).unwrap();
        slot.admit_slow(30, 100).unwrap();
        assert_eq!((slot.credit(), books.1.budget.used()), (70, 110));
    }

    #[test]
    fn setting_the_same_limit_again_leaves_cached_credit_alone() {
        let books = books(1000, UNLIMITED);
        let slot = slot(&books, KV);
        slot.admit_slow(10, 100).unwrap();
        let list = Mutex::new(vec![Arc::clone(&slot)]);
        assert_eq!(set_limit(&books.1.budget, 1000, &list), 1000);
        assert_eq!(slot.credit(), 100, "an unchanged limit sweeps nothing");
        assert_eq!(return_credit(&books.1.budget, &list), 100, "return_credit reports what it returned");
        assert_eq!(return_credit(&books.1.budget, &list), 0);
    }

    #[test]
    fn a_new_slot_asked_for_more_than_two_chunks_draws_exactly_and_stays_closed() {
        let books = books(10_000, UNLIMITED);
        let slot = slot(&books, KV);
        slot.admit_slow(500, 100).unwrap();
        assert_eq!((slot.credit(), books.1.budget.used()), (0, 500));
        assert_ne!(slot.word.load(Ordering::Acquire) & CLOSED, 0);
    }

    #[test]
    fn a_draw_of_a_role_waits_while_its_reserve_is_changing() {
        let books = books(1000, UNLIMITED);
        // What `set_target` does first: freeze the role's word.
        books.1.roles[KV].word.fetch_or(FROZEN, Ordering::AcqRel);
        let drawn = Arc::new(AtomicBool::new(false));
        let worker = {
            let (books, drawn) = (books.clone(), Arc::clone(&drawn));
            std::thread::spawn(move || {
                Path { account: &books.0, device: &books.1, role: KV }.draw(10, 0).unwrap();
                drawn.store(true, Ordering::Release);
            })
        };
        // Not a timing assumption: however long we wait, a frozen role admits nothing.
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!drawn.load(Ordering::Acquire), "a draw committed while the role was frozen");
        assert_eq!(books.1.budget.used(), 0);
        books.1.roles[KV].word.fetch_and(!FROZEN, Ordering::AcqRel);
        worker.join().unwrap();
        assert_eq!((books.1.budget.used(), books.1.roles[KV].used()), (10, 10));
    }

    #[test]
    fn lowerings_counted_in_the_used_word_never_show_as_bytes() {
        let budget = Budget::new(UNLIMITED);
        let slots = Mutex::new(Vec::new());
        budget.try_draw(100, 0).unwrap();
        // More lowerings than the count holds: it wraps without touching the bytes.
        let mut previous = UNLIMITED;
        for limit in (1_000..1_040).rev() {
            assert_eq!(set_limit(&budget, limit, &slots), previous);
            assert_eq!(budget.used(), 100);
            previous = limit;
        }
        budget.try_draw(900, 0).unwrap();
        assert_eq!(budget.try_draw(1, 0), Err(1_000), "the lowered limit is in force");
        budget.give_back(1_000);
        assert_eq!((budget.used(), budget.peak()), (0, 1_000));
    }

    #[test]
    fn a_draw_past_the_used_word_is_refused_not_wrapped() {
        let budget = Budget::new(UNLIMITED);
        budget.try_draw(USED_BYTES, 0).unwrap();
        assert_eq!(budget.try_draw(1, 0), Err(USED_BYTES));
        assert_eq!(budget.used(), USED_BYTES);
    }

    #[test]
    fn role_usage_past_the_word_is_an_overflow() {
        let books = books(UNLIMITED, UNLIMITED);
        let path = Path { account: &books.0, device: &books.1, role: KV };
        path.draw(ROLE_USED, 0).unwrap();
        assert_eq!(path.draw(1, 0), Err(Short::Overflow { used: ROLE_USED, limit: ROLE_USED }));
        assert_eq!(books.0.budget.used(), ROLE_USED, "the refused draw gave the account back");
    }

    #[test]
    fn an_open_slot_refills_while_a_drainer_is_counted() {
        let books = books(10_000, UNLIMITED);
        let slot = slot(&books, KV);
        slot.admit_slow(10, 100).unwrap();
        assert!(slot.admit_fast(100));
        // A drainer at work on both budgets that has not reached this slot yet: only a
        // closed slot waits for it to leave; an open one is swept in its turn.
        let _account = books.0.budget.enter_drain();
        let _device = books.1.budget.enter_drain();
        slot.admit_slow(5, 100).unwrap();
        assert_eq!((slot.credit(), books.1.budget.used()), (100, 215), "the open slot drew its chunk");
    }

    #[test]
    fn a_retired_slot_says_so_and_holds_nothing() {
        let books = books(1000, UNLIMITED);
        let slot = slot(&books, KV);
        slot.admit_slow(10, 100).unwrap();
        assert!(!slot.is_retired(), "a live slot is kept in the lists");
        slot.retire();
        // The lists drop a slot once it says it is retired: a slot that never said so
        // would stay listed for good, one more per thread that ever charged.
        assert!(slot.is_retired());
        assert_eq!((slot.credit(), books.1.budget.used()), (0, 10), "its credit went back");
        assert!(slot.is_closed(), "closed for good");
    }

    #[test]
    fn every_reserve_change_gives_the_role_word_a_new_version() {
        let books = books(1000, UNLIMITED);
        let path = Path { account: &books.0, device: &books.1, role: WEIGHTS };
        path.draw(5, 0).unwrap();
        let role = &books.1.roles[WEIGHTS];
        // A draw computed against an older word commits only if the word is equal
        // again: versions repeat only after 128 changes, whether a change succeeds or
        // is refused.
        for changes in 0..=130u64 {
            let word = role.word.load(Ordering::Acquire);
            assert_eq!(word & FROZEN, 0, "unfrozen after the change");
            assert_eq!(word & ROLE_USED, 5, "the usage survives the change");
            assert_eq!((word & VERSION) >> VERSION_SHIFT, changes % 128, "version after {changes} changes");
            let target = if changes % 10 == 9 { 2000 } else { changes % 7 };
            assert_eq!(books.1.set_reserve(WEIGHTS, target).is_ok(), target <= 1000);
        }
    }

    #[test]
    fn lowering_a_limit_sweeps_and_raising_does_not() {
        let books = books(1000, UNLIMITED);
        let slot = slot(&books, KV);
        slot.admit_slow(10, 100).unwrap();
        let list = Mutex::new(vec![Arc::clone(&slot)]);
        assert_eq!(set_limit(&books.1.budget, 2000, &list), 1000);
        assert_eq!(slot.credit(), 100, "raising leaves credit cached");
        assert_eq!(set_limit(&books.1.budget, 50, &list), 2000);
        assert_eq!((slot.credit(), books.1.budget.used()), (0, 10), "lowering pulls it back");
    }
}
