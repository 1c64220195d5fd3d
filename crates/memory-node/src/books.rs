//! The books: opening the file ([`NodeBooks::open`]), the node's limits and quotas, the
//! device and tenant entries, snapshots, and refunding dead processes' slots.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use memory_governor::{DeviceKey, Tier};
use serde::Serialize;

use crate::error::{BooksIoError, NodeError, OpenError};
use crate::format::{MAX_DEVICES, MAX_SLOTS, MAX_TENANTS, SLOT_LIVE, Shared, TENANT_NAME_BYTES};
use crate::liveness::{Identity, Verdict};
use crate::map::Mapping;
use crate::protocol::{self, Budget, Table, generation_of, state_of};
use crate::sync::{Arc, Mutex, lock};

/// Where the books live and how a member draws from them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeConfig {
    pub(crate) name: String,
    pub(crate) directory: PathBuf,
    pub(crate) mode: u32,
    pub(crate) grant_chunk: u64,
    pub(crate) margin: u64,
    pub(crate) tick: Duration,
    pub(crate) refund_interval: Duration,
    pub(crate) pressure_wait: Duration,
}

/// The default grant chunk: 16 MiB.
pub const DEFAULT_GRANT_CHUNK: u64 = 16 << 20;

impl NodeConfig {
    /// Books named `name` (a file name: the books are `<directory>/<name>`) in `/dev/shm`,
    /// created with mode 0600, drawn in chunks of [`DEFAULT_GRANT_CHUNK`], with surplus
    /// given back every 10 ms and dead slots looked for every 100 ms.
    pub fn new(name: impl Into<String>) -> NodeConfig {
        NodeConfig {
            name: name.into(),
            directory: PathBuf::from("/dev/shm"),
            mode: 0o600,
            grant_chunk: DEFAULT_GRANT_CHUNK,
            margin: DEFAULT_GRANT_CHUNK,
            tick: Duration::from_millis(10),
            refund_interval: Duration::from_millis(100),
            pressure_wait: Duration::from_millis(20),
        }
    }

    /// The directory of the books file (default `/dev/shm`).
    #[must_use]
    pub fn with_directory(mut self, directory: impl Into<PathBuf>) -> NodeConfig {
        self.directory = directory.into();
        self
    }

    /// The mode a new books file is created with (default `0o600`: the owner's
    /// processes only). Every process that can open the file is a trusted peer. With a
    /// mode of no group or other bits, existing books another user owns are refused
    /// ([`OpenError::ForeignOwner`](crate::OpenError::ForeignOwner)): in a directory every
    /// user may write, another user could make them first.
    #[must_use]
    pub fn with_mode(mut self, mode: u32) -> NodeConfig {
        self.mode = mode & 0o7777;
        self
    }

    /// Bytes a member draws from the node at least, when its local budget runs short
    /// (default 16 MiB). Larger chunks touch the shared books less often and leave more
    /// idle with each process between give-backs.
    #[must_use]
    pub fn with_grant_chunk(mut self, bytes: u64) -> NodeConfig {
        self.grant_chunk = bytes.max(1);
        self
    }

    /// Bytes of grant a member keeps beyond what its governor uses when it gives surplus
    /// back (default: the grant chunk). Under pressure (another member was refused) it
    /// keeps none.
    #[must_use]
    pub fn with_margin(mut self, bytes: u64) -> NodeConfig {
        self.margin = bytes;
        self
    }

    /// How often a member's timer gives surplus back and publishes its figures
    /// (default 10 ms).
    #[must_use]
    pub fn with_tick(mut self, tick: Duration) -> NodeConfig {
        self.tick = tick.max(Duration::from_millis(1));
        self
    }

    /// How often a member's timer looks for dead processes' slots (default 100 ms): two
    /// looks are never more than this apart. A dead process's grants return within this
    /// plus one tick of its death ([`NodeConfig::refund_bound`]), or at once when another
    /// member is refused. `Duration::MAX`: the timer never looks (refusals still do).
    #[must_use]
    pub fn with_refund_interval(mut self, interval: Duration) -> NodeConfig {
        self.refund_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// How long a grant the node cannot give waits for other members to give surplus
    /// back before its admission is refused (default 20 ms: two ticks). Zero: refuse at
    /// once (after looking for dead slots); `Duration::MAX`: wait as long as it takes.
    #[must_use]
    pub fn with_pressure_wait(mut self, wait: Duration) -> NodeConfig {
        self.pressure_wait = wait;
        self
    }

    /// The books file.
    pub fn path(&self) -> PathBuf {
        self.directory.join(&self.name)
    }

    /// The grant chunk.
    pub fn grant_chunk(&self) -> u64 {
        self.grant_chunk
    }

    /// The refund interval (see [`NodeConfig::with_refund_interval`]).
    pub fn refund_interval(&self) -> Duration {
        self.refund_interval
    }

    /// The tick (see [`NodeConfig::with_tick`]).
    pub fn tick(&self) -> Duration {
        self.tick
    }

    /// The time within which a survivor's timer refunds a dead process's grants: the
    /// refund interval (or the tick, if that is longer: the timer looks at most once a
    /// tick) plus one tick (the most a refund waits for the books' lock), plus the
    /// time the timer's own work takes.
    pub fn refund_bound(&self) -> Duration {
        // `Duration::MAX` (and anything near it) means never: no overflow panic.
        self.refund_interval.max(self.tick).saturating_add(self.tick)
    }

    /// Whether a member's timer looks for dead slots now, `since` its last look: when
    /// waiting for the next tick would leave more than the refund interval between two
    /// looks. (Looking only once `since` reached the interval put looks up to a tick
    /// further apart, past [`NodeConfig::refund_bound`].)
    pub(crate) fn scan_due(&self, since: Duration) -> bool {
        since.saturating_add(self.tick) > self.refund_interval
    }
}

/// The instant `wait` from now, or the furthest the clock can name when that is past it
/// (a wait of `Duration::MAX` means never, and `Instant + Duration` would panic).
pub(crate) fn deadline_after(wait: Duration) -> Instant {
    let now = Instant::now();
    let mut wait = wait;
    loop {
        if let Some(deadline) = now.checked_add(wait) {
            return deadline;
        }
        wait /= 2;
    }
}

pub(crate) struct BooksInner {
    pub(crate) map: Mapping,
    pub(crate) path: PathBuf,
    pub(crate) config: NodeConfig,
    /// The process's side of the books' lock (`flock` is per open file).
    lock: Mutex<()>,
    pub(crate) me: Identity,
    created: bool,
}

/// The node books: one file, mapped, shared by every process that opens it. Cheap to
/// clone. See the [crate docs](crate).
#[derive(Clone)]
pub struct NodeBooks {
    pub(crate) inner: Arc<BooksInner>,
}

impl std::fmt::Debug for NodeBooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeBooks").field("path", &self.inner.path).finish_non_exhaustive()
    }
}

impl Table for Shared {
    fn hwm(&self) -> &crate::sync::AtomicU64 {
        &self.header.slots_hwm
    }

    fn slot_count(&self) -> usize {
        MAX_SLOTS
    }

    fn state(&self, slot: usize) -> &crate::sync::AtomicU64 {
        &self.slots[slot].state
    }

    fn seq(&self, slot: usize) -> &crate::sync::AtomicU64 {
        &self.slots[slot].seq
    }

    fn grant(&self, slot: usize, budget: Budget) -> &crate::sync::AtomicU64 {
        match budget {
            Budget::Device(entry) => &self.slots[slot].device_grant[entry],
            Budget::Tenant(entry) => &self.slots[slot].tenant_grant[entry],
        }
    }

    fn budgets(&self) -> impl Iterator<Item = Budget> {
        (0..MAX_DEVICES).map(Budget::Device).chain((0..MAX_TENANTS).map(Budget::Tenant))
    }
}

/// A slot a survivor refunded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Refund {
    /// The slot.
    pub slot: usize,
    /// The pid it named.
    pub pid: u64,
    /// Why its process was taken for dead.
    pub reason: String,
    /// Bytes of grants (over every device and tenant) it held.
    pub bytes: u64,
}

/// One device in a [`NodeSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct NodeDeviceSnapshot {
    /// The device key.
    #[serde(skip)]
    pub key: DeviceKey,
    /// The device ("device:0").
    pub device: String,
    /// The node limit; `None` when there is none.
    pub limit: Option<u64>,
    /// Bytes granted to processes, summed over slots.
    pub granted: u64,
    /// Bytes charged to tenants, as the processes last published them.
    pub allocated: u64,
    /// Bytes the processes hold (charged plus cached), as they last published them.
    pub reserved: u64,
    /// How many grants the node could not give (each asks members for their surplus).
    pub pressure: u64,
}

/// One tenant in a [`NodeSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct NodeTenantSnapshot {
    /// The device key.
    #[serde(skip)]
    pub key: DeviceKey,
    /// The device.
    pub device: String,
    /// The tenant's name.
    pub tenant: String,
    /// The node quota; `None` when there is none.
    pub quota: Option<u64>,
    /// Bytes granted, summed over slots.
    pub granted: u64,
    /// Bytes charged, as the processes last published them.
    pub allocated: u64,
}

/// One budget of one slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct SlotBudget {
    /// The device.
    pub device: String,
    /// The tenant, for a tenant's budget.
    pub tenant: Option<String>,
    /// Bytes granted.
    pub granted: u64,
    /// Bytes charged, as last published.
    pub allocated: u64,
    /// Bytes held, as last published (devices only).
    pub reserved: u64,
}

/// One held slot in a [`NodeSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct SlotSnapshot {
    /// The slot.
    pub slot: usize,
    /// Its generation (how many times it was claimed).
    pub generation: u64,
    /// "live", "claiming" or "refunding".
    pub state: String,
    /// The pid it names.
    pub pid: u64,
    /// The process's start time (clock ticks after boot).
    pub start_time: u64,
    /// Whether that process runs (as the snapshot's taker judges it).
    pub alive: bool,
    /// Its budgets that are not all zero.
    pub budgets: Vec<SlotBudget>,
}

/// What the books hold, read at once (see [`NodeSnapshot::consistent`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct NodeSnapshot {
    /// The file.
    pub path: String,
    /// Whether every figure was read at one instant (no grant in flight). A slot left
    /// mid-grant by a process that died keeps snapshots inconsistent until refunded.
    pub consistent: bool,
    /// The devices.
    pub devices: Vec<NodeDeviceSnapshot>,
    /// The tenants.
    pub tenants: Vec<NodeTenantSnapshot>,
    /// The held slots.
    pub slots: Vec<SlotSnapshot>,
}

impl NodeSnapshot {
    /// The figures of `device`.
    pub fn device(&self, device: DeviceKey) -> Option<&NodeDeviceSnapshot> {
        self.devices.iter().find(|entry| entry.key == device)
    }

    /// The figures of `tenant` on `device`.
    pub fn tenant(&self, device: DeviceKey, tenant: &str) -> Option<&NodeTenantSnapshot> {
        self.tenants.iter().find(|entry| entry.key == device && entry.tenant == tenant)
    }

    /// The slot of the process `pid`, if it holds one.
    pub fn slot_of(&self, pid: u64) -> Option<&SlotSnapshot> {
        self.slots.iter().find(|slot| slot.pid == pid)
    }

    /// The snapshot as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

pub(crate) fn encode_device(device: DeviceKey) -> Result<u64, NodeError> {
    let tier = match device.tier() {
        Tier::Device => 1,
        Tier::Host => 2,
        Tier::Disk => 3,
        _ => return Err(NodeError::UnsupportedTier { device }),
    };
    Ok((tier << 32) | u64::from(device.index()))
}

fn decode_device(word: u64) -> Option<DeviceKey> {
    let index = (word & 0xffff_ffff) as u32;
    match word >> 32 {
        1 => Some(DeviceKey::device(index)),
        2 => Some(DeviceKey::host(index)),
        3 => Some(DeviceKey::disk(index)),
        _ => None,
    }
}

fn limit_of(raw: u64) -> Option<u64> {
    (raw != u64::MAX).then_some(raw)
}

impl NodeBooks {
    /// Opens the books described by `config`, creating them (mode `config`'s, 0600 by
    /// default) if there are none.
    ///
    /// # Errors
    /// [`OpenError`]: the name is not a file name, the file is of another version,
    /// truncated or corrupt, this user may not open it, its directory does not exist or
    /// may not be written (to create it), its file system has no room for it, or another
    /// I/O error; each says what to do.
    pub fn open(config: NodeConfig) -> Result<NodeBooks, OpenError> {
        NodeBooks::open_with(config, true)
    }

    /// Opens existing books only (never creates them).
    ///
    /// # Errors
    /// As [`NodeBooks::open`], and [`OpenError::Missing`] when there are none.
    pub fn open_existing(config: NodeConfig) -> Result<NodeBooks, OpenError> {
        NodeBooks::open_with(config, false)
    }

    fn open_with(config: NodeConfig, create: bool) -> Result<NodeBooks, OpenError> {
        let name = &config.name;
        let reason = if name.is_empty() {
            Some("it is empty")
        } else if name.contains('/') {
            Some("it holds a '/' (it would name another directory)")
        } else if name == "." || name == ".." {
            Some("it names a directory")
        } else if name.contains('\0') {
            Some("it holds a NUL byte")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(OpenError::Name { name: name.clone(), reason });
        }
        let path = config.path();
        let me = Identity::current().map_err(|source| BooksIoError::new(&path, "identify this process for", source))?;
        let (map, created) = Mapping::open(&path, config.mode, create)?;
        tracing::info!(path = %path.display(), created, "node books opened");
        Ok(NodeBooks { inner: Arc::new(BooksInner { map, path, config, lock: Mutex::new(()), me, created }) })
    }

    /// The books file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The configuration it was opened with.
    pub fn config(&self) -> &NodeConfig {
        &self.inner.config
    }

    /// Whether this handle created the file.
    pub fn created(&self) -> bool {
        self.inner.created
    }

    pub(crate) fn shared(&self) -> &Shared {
        self.inner.map.shared()
    }

    fn io(&self, operation: &'static str) -> impl FnOnce(std::io::Error) -> NodeError + '_ {
        move |source| BooksIoError::new(&self.inner.path, operation, source).into()
    }

    /// [`NodeError::Forked`] when this process is not the one that opened the books (a
    /// fork of it: the `flock` and the slots it inherited are its parent's).
    pub(crate) fn check_not_forked(&self) -> Result<(), NodeError> {
        let pid = u64::from(std::process::id());
        if pid == self.inner.me.pid {
            return Ok(());
        }
        Err(NodeError::Forked { path: self.inner.path.clone(), opened_by: self.inner.me.pid, pid })
    }

    /// The lease file of `slot`: `.<name>.<inode>.slot-<slot>.lease` beside the books,
    /// the books file's inode in it so that books removed and made anew (which split the
    /// processes) never share a lease (see
    /// [`format::SLOT_LEASE_GENERATION`](crate::format::SLOT_LEASE_GENERATION)).
    pub(crate) fn lease_path(&self, slot: usize) -> PathBuf {
        let inode = self.inner.map.inode();
        self.inner.path.with_file_name(format!(".{}.{inode}.slot-{slot}.lease", self.inner.config.name))
    }

    /// Takes `slot`'s lease for a new owner (the caller holds the books' lock): the lease
    /// file, made if there is none, `flock`ed. `None` when it cannot be had (then the
    /// slot records no lease, and is judged by its pid alone).
    pub(crate) fn take_lease(&self, slot: usize) -> Option<std::fs::File> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.lease_path(slot);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(self.inner.config.mode)
            .open(&path)
            .map_err(|error| {
                tracing::warn!(path = %path.display(), %error,
                    "no lease file for the slot: a survivor in another pid namespace cannot refund it if this \
                     process dies; make the books' directory writable by this user")
            })
            .ok()?;
        // Only a lease file of this user: one another user made first (a world-writable
        // directory lets them) they could unlink and replace with one nobody locks, and
        // survivors of other namespaces would take this live process for dead.
        let own = file.metadata().is_ok_and(|metadata| {
            use std::os::unix::fs::MetadataExt;
            metadata.uid() == rustix::process::geteuid().as_raw()
        });
        if !own {
            tracing::warn!(path = %path.display(),
                "the slot's lease file belongs to another user: no lease (a survivor in another pid namespace \
                 cannot refund this slot); remove the file, or keep the books in a directory only this user writes");
            return None;
        }
        rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
            .map_err(|errno| tracing::debug!(path = %path.display(), %errno, "the slot's lease is held"))
            .ok()?;
        Some(file)
    }

    /// Whether `slot`'s lease is free (the caller holds the books' lock): its owner's
    /// process, which held it locked, is gone. `false` when it is held, or cannot be
    /// looked at (no evidence).
    fn lease_released(&self, slot: usize, owner_uid: u64) -> bool {
        use std::os::unix::fs::MetadataExt;
        let Ok(file) = std::fs::File::open(self.lease_path(slot)) else { return false };
        // A lease file of the slot's user (or this process's): another user's file is no
        // evidence (see `take_lease`).
        let trusted = file.metadata().is_ok_and(|metadata| {
            u64::from(metadata.uid()) == owner_uid || metadata.uid() == rustix::process::geteuid().as_raw()
        });
        if !trusted {
            return false;
        }
        // Locked (and unlocked again as `file` closes): nobody holds it.
        rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok()
    }

    /// Removes `slot`'s lease file (the slot was freed; the caller holds the books' lock,
    /// so no judge has it open and no claimer is making it).
    pub(crate) fn remove_lease(&self, slot: usize) {
        let _ = std::fs::remove_file(self.lease_path(slot));
    }

    /// Runs `f` holding the books' lock (the process's mutex, then `flock`).
    pub(crate) fn with_lock<R>(&self, f: impl FnOnce(&Shared) -> R) -> Result<R, NodeError> {
        // A fork shares the parent's open file, and so the parent's `flock`: taking it
        // here would not exclude the parent.
        self.check_not_forked()?;
        let _process = lock(&self.inner.lock);
        let _file = self.inner.map.lock().map_err(self.io("lock"))?;
        Ok(f(self.shared()))
    }

    /// The entry of `device`, made if `create`.
    pub(crate) fn device_entry(&self, device: DeviceKey, create: bool) -> Result<Option<usize>, NodeError> {
        let key = encode_device(device)?;
        let find = |shared: &Shared| shared.devices.iter().position(|entry| entry.key.load(SeqCst) == key);
        self.entry_or_make(create, find, |shared| {
            let free = shared
                .devices
                .iter()
                .position(|entry| entry.key.load(SeqCst) == 0)
                .ok_or(NodeError::DevicesFull { device, max: MAX_DEVICES })?;
            let entry = &shared.devices[free];
            entry.limit.store(u64::MAX, SeqCst);
            entry.pressure.store(0, SeqCst);
            entry.key.store(key, SeqCst);
            Ok(free)
        })
    }

    /// The entry of `tenant` on the device entry `device`, made if `create`.
    pub(crate) fn tenant_entry(&self, device: usize, tenant: &str, create: bool) -> Result<Option<usize>, NodeError> {
        let bytes = tenant.as_bytes();
        if bytes.is_empty() {
            return Err(NodeError::TenantName { tenant: tenant.to_owned(), reason: "it is empty" });
        }
        if bytes.len() > TENANT_NAME_BYTES {
            return Err(NodeError::TenantName { tenant: tenant.to_owned(), reason: "it is longer than 48 bytes" });
        }
        let key = ((device as u64 + 1) << 8) | bytes.len() as u64;
        let mut words = [0u64; TENANT_NAME_BYTES / 8];
        for (index, chunk) in bytes.chunks(8).enumerate() {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            words[index] = u64::from_le_bytes(word);
        }
        let find = |shared: &Shared| {
            shared.tenants.iter().position(|entry| {
                entry.key.load(SeqCst) == key && entry.name.iter().zip(&words).all(|(word, &w)| word.load(SeqCst) == w)
            })
        };
        self.entry_or_make(create, find, |shared| {
            let free = shared
                .tenants
                .iter()
                .position(|entry| entry.key.load(SeqCst) == 0)
                .ok_or_else(|| NodeError::TenantsFull { tenant: tenant.to_owned(), max: MAX_TENANTS })?;
            let entry = &shared.tenants[free];
            for (word, &w) in entry.name.iter().zip(&words) {
                word.store(w, SeqCst);
            }
            entry.quota.store(u64::MAX, SeqCst);
            entry.pressure.store(0, SeqCst);
            // The key last: a reader without the lock finds the entry only once it is whole.
            entry.key.store(key, SeqCst);
            Ok(free)
        })
    }

    /// The entry `find` finds; if there is none and `create`, the one `make` makes,
    /// under the books' lock and after looking again (another process may have made it
    /// meanwhile), so no entry is ever made twice.
    fn entry_or_make(
        &self,
        create: bool,
        find: impl Fn(&Shared) -> Option<usize>,
        make: impl FnOnce(&Shared) -> Result<usize, NodeError>,
    ) -> Result<Option<usize>, NodeError> {
        if let Some(entry) = find(self.shared()) {
            return Ok(Some(entry));
        }
        if !create {
            return Ok(None);
        }
        self.with_lock(|shared| match find(shared) {
            Some(entry) => Ok(Some(entry)),
            None => make(shared).map(Some),
        })?
    }

    /// Sets the node limit of `device` (`u64::MAX`: none), the sum of what every
    /// process's governor may hold on it; returns the old one. Lowering revokes no
    /// grant: new grants are refused until the sum falls below it (members give surplus
    /// back on their timers).
    ///
    /// # Errors
    /// [`NodeError::DevicesFull`], [`NodeError::UnsupportedTier`], or the lock's I/O error.
    pub fn set_device_limit(&self, device: DeviceKey, bytes: u64) -> Result<Option<u64>, NodeError> {
        let entry = self.device_entry(device, true)?.ok_or(NodeError::NotGoverned { device })?;
        let old = self.shared().devices[entry].limit.swap(bytes, SeqCst);
        tracing::info!(path = %self.inner.path.display(), device = %device, old = ?limit_of(old),
            new = ?limit_of(bytes), "node device limit changed");
        Ok(limit_of(old))
    }

    /// The node limit of `device`; `None` when it has none.
    pub fn device_limit(&self, device: DeviceKey) -> Option<u64> {
        let entry = self.device_entry(device, false).ok()??;
        limit_of(self.shared().devices[entry].limit.load(SeqCst))
    }

    /// Sets the node quota of `tenant` on `device` (`u64::MAX`: none), the sum of what
    /// every process may charge to that tenant there; returns the old one. Lowering
    /// behaves as for [`NodeBooks::set_device_limit`].
    ///
    /// # Errors
    /// As [`NodeBooks::set_device_limit`], and [`NodeError::TenantName`] /
    /// [`NodeError::TenantsFull`].
    pub fn set_tenant_quota(&self, device: DeviceKey, tenant: &str, bytes: u64) -> Result<Option<u64>, NodeError> {
        let device_entry = self.device_entry(device, true)?.ok_or(NodeError::NotGoverned { device })?;
        let entry = self.tenant_entry(device_entry, tenant, true)?.ok_or(NodeError::NotGoverned { device })?;
        let old = self.shared().tenants[entry].quota.swap(bytes, SeqCst);
        tracing::info!(path = %self.inner.path.display(), device = %device, tenant, old = ?limit_of(old),
            new = ?limit_of(bytes), "node tenant quota changed");
        Ok(limit_of(old))
    }

    /// The node quota of `tenant` on `device`; `None` when it has none.
    pub fn tenant_quota(&self, device: DeviceKey, tenant: &str) -> Option<u64> {
        let device_entry = self.device_entry(device, false).ok()??;
        let entry = self.tenant_entry(device_entry, tenant, false).ok()??;
        limit_of(self.shared().tenants[entry].quota.load(SeqCst))
    }

    /// Looks for slots whose process is gone and refunds them (zeroes their grants and
    /// frees them), holding the books' lock. Members do this on their timers and
    /// whenever the node refuses them a grant; call it to settle the books at once.
    ///
    /// # Errors
    /// The lock's I/O error; [`NodeError::Forked`] in a fork of the process that opened
    /// the books.
    pub fn refund_dead(&self) -> Result<Vec<Refund>, NodeError> {
        self.with_lock(|shared| self.refund_locked(shared))
    }

    /// [`NodeBooks::refund_dead`] if the books' lock is free within `wait`: an
    /// allocating thread (or a timer) never waits longer for a peer that keeps the lock.
    /// `Ok(None)` when the lock stayed taken.
    pub(crate) fn refund_dead_within(&self, wait: Duration) -> Result<Option<Vec<Refund>>, NodeError> {
        // The process's side of the lock within the same wait: another thread of this
        // process may be waiting for the file's lock (a join, a leave, `refund_dead`)
        // for as long as a peer keeps it.
        self.check_not_forked()?;
        let deadline = deadline_after(wait);
        let _process = loop {
            match self.inner.lock.try_lock() {
                Ok(guard) => break guard,
                Err(std::sync::TryLockError::Poisoned(poisoned)) => break poisoned.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    tracing::debug!(path = %self.inner.path.display(), "another thread waits for the books' lock: refunds wait");
                    return Ok(None);
                }
            }
        };
        let wait = deadline.saturating_duration_since(std::time::Instant::now());
        let Some(_file) = self.inner.map.lock_within(wait).map_err(self.io("lock"))? else {
            tracing::debug!(path = %self.inner.path.display(), "the books' lock is held: refunds wait");
            return Ok(None);
        };
        Ok(Some(self.refund_locked(self.shared())))
    }

    fn refund_locked(&self, shared: &Shared) -> Vec<Refund> {
        let me = self.inner.me;
        {
            let mut refunds = Vec::new();
            for (slot, entry) in shared.slots.iter().enumerate() {
                let word = entry.state.load(SeqCst);
                let reason = match state_of(word) {
                    protocol::SLOT_FREE => continue,
                    // Only a lock holder writes these, and we hold the lock: it died.
                    protocol::SLOT_CLAIMING | protocol::SLOT_REFUNDING => "it died holding the books' lock",
                    _ => match identity_of(shared, slot).verdict(&me) {
                        Verdict::Dead(reason) => reason.name(),
                        Verdict::Alive => continue,
                        // Its pid means nothing here; the lease its owner held locked
                        // tells, where it took one.
                        Verdict::Foreign => {
                            let leased =
                                generation_of(word) != 0 && entry.lease_generation.load(SeqCst) == generation_of(word);
                            if !(leased && self.lease_released(slot, entry.uid.load(SeqCst))) {
                                continue;
                            }
                            "it ran in another pid namespace, and its slot's lease is no longer held"
                        }
                    },
                };
                let pid = entry.pid.load(SeqCst);
                let leased = entry.lease_generation.load(SeqCst) != 0;
                if let Some(bytes) = refund_slot(shared, slot, word) {
                    if leased {
                        self.remove_lease(slot);
                    }
                    tracing::warn!(path = %self.inner.path.display(), slot, pid, reason, bytes,
                        "refunded a dead process's node grants");
                    refunds.push(Refund { slot, pid, reason: reason.to_owned(), bytes });
                }
            }
            refunds
        }
    }

    /// A snapshot of the books: limits, quotas, grants per device and tenant, and each
    /// held slot (see [`NodeSnapshot::consistent`]).
    pub fn snapshot(&self) -> NodeSnapshot {
        let shared = self.shared();
        let read = |shared: &Shared| {
            let slots: Vec<_> = (0..MAX_SLOTS)
                .map(|slot| {
                    let entry = &shared.slots[slot];
                    (
                        entry.state.load(SeqCst),
                        std::array::from_fn::<_, MAX_DEVICES, _>(|d| {
                            (
                                entry.device_grant[d].load(SeqCst),
                                entry.device_allocated[d].load(SeqCst),
                                entry.device_reserved[d].load(SeqCst),
                            )
                        }),
                        std::array::from_fn::<_, MAX_TENANTS, _>(|t| {
                            (entry.tenant_grant[t].load(SeqCst), entry.tenant_allocated[t].load(SeqCst))
                        }),
                    )
                })
                .collect();
            slots
        };
        let (slots, consistent) = match protocol::consistent(shared, 64, read) {
            Some(slots) => (slots, true),
            None => (read(shared), false),
        };
        let devices: Vec<(usize, DeviceKey)> = shared
            .devices
            .iter()
            .enumerate()
            .filter_map(|(entry, device)| decode_device(device.key.load(SeqCst)).map(|key| (entry, key)))
            .collect();
        let device_of = |entry: usize| devices.iter().find(|(e, _)| *e == entry).map(|&(_, key)| key);
        let tenants: Vec<(usize, DeviceKey, String)> = shared
            .tenants
            .iter()
            .enumerate()
            .filter_map(|(entry, tenant)| {
                let key = tenant.key.load(SeqCst);
                let device = device_of(((key >> 8) as usize).checked_sub(1)?)?;
                let len = (key & 0xff) as usize;
                let bytes: Vec<u8> = tenant.name.iter().flat_map(|word| word.load(SeqCst).to_le_bytes()).collect();
                let name = String::from_utf8_lossy(&bytes[..len.min(TENANT_NAME_BYTES)]).into_owned();
                Some((entry, device, name))
            })
            .collect();
        let me = self.inner.me;
        NodeSnapshot {
            path: self.inner.path.display().to_string(),
            consistent,
            devices: devices
                .iter()
                .map(|&(entry, key)| {
                    let sum = |pick: fn(&(u64, u64, u64)) -> u64| {
                        slots.iter().fold(0u64, |sum, slot| sum.saturating_add(pick(&slot.1[entry])))
                    };
                    NodeDeviceSnapshot {
                        key,
                        device: key.to_string(),
                        limit: limit_of(shared.devices[entry].limit.load(SeqCst)),
                        granted: sum(|w| w.0),
                        allocated: sum(|w| w.1),
                        reserved: sum(|w| w.2),
                        pressure: shared.devices[entry].pressure.load(SeqCst),
                    }
                })
                .collect(),
            tenants: tenants
                .iter()
                .map(|(entry, key, name)| {
                    let sum = |pick: fn(&(u64, u64)) -> u64| {
                        slots.iter().fold(0u64, |sum, slot| sum.saturating_add(pick(&slot.2[*entry])))
                    };
                    NodeTenantSnapshot {
                        key: *key,
                        device: key.to_string(),
                        tenant: name.clone(),
                        quota: limit_of(shared.tenants[*entry].quota.load(SeqCst)),
                        granted: sum(|w| w.0),
                        allocated: sum(|w| w.1),
                    }
                })
                .collect(),
            slots: slots
                .iter()
                .enumerate()
                .filter(|(_, (state, _, _))| state_of(*state) != protocol::SLOT_FREE)
                .map(|(slot, (state, device_words, tenant_words))| {
                    let identity = identity_of(shared, slot);
                    let mut budgets: Vec<SlotBudget> = devices
                        .iter()
                        .filter(|(entry, _)| device_words[*entry] != (0, 0, 0))
                        .map(|&(entry, key)| SlotBudget {
                            device: key.to_string(),
                            tenant: None,
                            granted: device_words[entry].0,
                            allocated: device_words[entry].1,
                            reserved: device_words[entry].2,
                        })
                        .collect();
                    budgets.extend(tenants.iter().filter(|(entry, _, _)| tenant_words[*entry] != (0, 0)).map(
                        |(entry, key, name)| SlotBudget {
                            device: key.to_string(),
                            tenant: Some(name.clone()),
                            granted: tenant_words[*entry].0,
                            allocated: tenant_words[*entry].1,
                            reserved: 0,
                        },
                    ));
                    SlotSnapshot {
                        slot,
                        generation: generation_of(*state),
                        state: match state_of(*state) {
                            SLOT_LIVE => "live",
                            protocol::SLOT_CLAIMING => "claiming",
                            _ => "refunding",
                        }
                        .to_owned(),
                        pid: identity.pid,
                        start_time: identity.start_time,
                        alive: !matches!(identity.verdict(&me), Verdict::Dead(_)),
                        budgets,
                    }
                })
                .collect(),
        }
    }
}

/// The identity a slot records.
pub(crate) fn identity_of(shared: &Shared, slot: usize) -> Identity {
    let entry = &shared.slots[slot];
    // The pidfs inode names the owner only if this claim wrote it (a process of an older
    // build of this layout writes none, and would leave a former owner's).
    let generation = generation_of(entry.state.load(SeqCst));
    let inode = entry.pidfd_inode.load(SeqCst);
    let pidfd_inode = if generation != 0 && entry.pidfd_generation.load(SeqCst) == generation { inode } else { 0 };
    Identity {
        pidfd_inode,
        pid: entry.pid.load(SeqCst),
        start_time: entry.start_time.load(SeqCst),
        boot: [entry.boot[0].load(SeqCst), entry.boot[1].load(SeqCst)],
        pid_ns: entry.pid_ns.load(SeqCst),
    }
}

/// Refunds `slot` (the caller holds the books' lock): zeroes its grants and published
/// figures and frees it, if its state is still `expected`.
pub(crate) fn refund_slot(shared: &Shared, slot: usize, expected: u64) -> Option<u64> {
    let entry = &shared.slots[slot];
    let held = protocol::refund(shared, slot, expected)?;
    for word in entry.device_allocated.iter().chain(&entry.device_reserved).chain(&entry.tenant_allocated) {
        word.store(0, SeqCst);
    }
    entry.pidfd_inode.store(0, SeqCst);
    entry.pidfd_generation.store(0, SeqCst);
    entry.lease_generation.store(0, SeqCst);
    Some(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The timer wakes every tick (here taking no time), looks for dead slots when
    /// [`NodeConfig::scan_due`] says so, and waits at most a tick for the books' lock: a
    /// process dead at any instant is refunded within [`NodeConfig::refund_bound`].
    #[test]
    fn the_timers_looks_for_dead_slots_meet_the_stated_refund_bound() {
        let ms = Duration::from_millis;
        for (interval, tick) in [(100, 10), (100, 30), (95, 10), (50, 5), (10, 10), (5, 20), (1, 1)] {
            let config = NodeConfig::new("bound").with_refund_interval(ms(interval)).with_tick(ms(tick));
            let (mut scans, mut last) = (Vec::new(), 0u64);
            for now in (1..=(20 * interval / tick + 20)).map(|k| k * tick) {
                if config.scan_due(ms(now - last)) {
                    scans.push(now);
                    last = now;
                }
            }
            let horizon = scans[scans.len() / 2];
            for death in 0..horizon {
                let found = scans.iter().find(|&&scan| scan > death).copied().unwrap();
                let refunded = ms(found - death + tick);
                assert!(
                    refunded <= config.refund_bound(),
                    "interval {interval} ms, tick {tick} ms: a process dead at {death} ms is refunded {refunded:?} \
                     later, past the stated bound {:?}",
                    config.refund_bound()
                );
            }
        }
    }
}
