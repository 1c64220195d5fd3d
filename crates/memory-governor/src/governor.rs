//! The governor: device books, the table of accounts, policies, reclaim holders,
//! snapshots. Accounts themselves are in `account.rs`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering as StdOrdering;

use memory_api::{AuthorityIdentity, DeviceAllocator, DeviceKey, MemoryRole};

use crate::account::{Account, AccountConfig, AccountShared, NEXT_ACCOUNT, RoleStats};
use crate::allocator::{CacheBacking, GovernedAllocator};
use crate::credit::{self, AccountCounters, MAX_CHUNK, ROLES};
use crate::device::{DeviceBooks, limit_of};
use crate::error::{AccountError, GovernError, GovernFailure, LeaseRequestError, LimitError, PolicyError};
use crate::footprint::Idle;
use crate::overdraft::{DEFAULT_OVERDRAFT_LIMIT, OverdraftBooks};
use crate::peaks::{Bound, Charges, PEAK_SLACK};
use crate::policy::AdmissionPolicy;
use crate::reclaim::{HolderId, ReclaimHolder};
use crate::stats::{
    self, AccountSnapshot, CacheSnapshot, DeviceSnapshot, GovernorSnapshot, HolderSnapshot, LadderSnapshot,
    ReserveSnapshot, RoleSnapshot, Totals,
};
use crate::sync::{Arc, IdCounter, Mutex, RwLock, lock, read, write};
use crate::timeline::{Timeline, TimelineEvent};

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
    /// [`AdmissionError`](crate::AdmissionError) as for [`Account::lease`], or the account lookup's error.
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
        books.add_holder(serial, order, holder);
        HolderId { device, serial }
    }

    /// Unregisters a holder; returns it, or `None` if it was not registered.
    pub fn unregister_holder(&self, id: HolderId) -> Option<Arc<dyn ReclaimHolder>> {
        self.books(id.device).remove_holder(id.serial)
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
    /// ([`AdmissionError::CacheLimit`](crate::AdmissionError::CacheLimit), which the governed allocator above the cache
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

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use memory_api::DeviceKey;

    use super::*;

    #[test]
    fn the_configured_overdraft_limit_is_what_every_new_device_starts_with() {
        let config = GovernorConfig::default().with_overdraft_limit(12_345);
        assert_eq!(config.overdraft_limit(), 12_345);
        let governor = Governor::with_config(config);
        governor.set_device_limit(DeviceKey::HOST, 1 << 20).unwrap();
        let device = governor.snapshot().device(DeviceKey::HOST).cloned().unwrap();
        assert_eq!(device.overdraft.limit, Some(12_345));
        assert_eq!(GovernorConfig::default().overdraft_limit(), crate::DEFAULT_OVERDRAFT_LIMIT);
    }

    #[test]
    #[allow(deprecated)]
    fn the_former_name_of_with_credit_chunk_still_sets_the_chunk() {
        assert_eq!(GovernorConfig::default().credit_chunk(1234).chunk(), 1234);
        assert_eq!(GovernorConfig::default().with_credit_chunk(1234).chunk(), 1234);
    }
}
