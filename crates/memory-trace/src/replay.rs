//! Replay: a trace against an allocator stack on a host-backed simulated device, the
//! governor in front, and what the books say.
//!
//! For each configuration a fresh [`Governor`] (credit chunk 0, so its peaks are exact)
//! gets every device of the trace with its limit (the configuration's, else the one
//! recorded) and every tenant with its recorded quota; each tenant's governed allocator
//! wraps the configuration's stack, shared by the device's tenants:
//!
//! | allocator | stack per device |
//! |-----------|------------------|
//! | `system`  | `SystemAllocator` (no cache: reserved = allocated) |
//! | `pooled`  | `PooledAllocator` over `governor.cache_backing(SystemAllocator)`: the device limit bounds what the pool holds (docs/ACCOUNTING.md, "Allocated and reserved") |
//! | `virtual` | `VirtualHostAllocator`, each block reserved and then committed whole (its size rounded up to the page, as a runtime on reserve/commit memory asks; a block whose commit fails goes back, a failure) |
//!
//! The events run in the trace's order on one thread, so the same trace and
//! configuration give the same books ([`DeviceReport::books`]) every time; only the
//! latencies vary. Each event is replayed as recorded:
//! - an allocation is asked for again (size, alignment, role, tenant); if the replay
//!   refuses it, the refusal is reported and its release later skipped;
//! - a complete release, or a block lost with its device, releases the replayed block; a
//!   quarantined release keeps it (the recording still held it); a failed one does nothing;
//! - a recorded refusal or failure is asked for again: if this configuration admits it,
//!   it is counted (`recorded_refusals_admitted`) and released at once (the workload
//!   never had it);
//! - an event the recording's own books cannot pair (a release or lost block of a block
//!   the trace never allocated or had already released, an allocation of a block the
//!   trace still held: events missing from a damaged or merged recording) is reported
//!   ([`DeviceReport::unpaired`], and a warning in [`table`]); the release is skipped, and
//!   before such an allocation the replay gives back the block it held under that
//!   identity, so nothing it allocated is left behind.
//!
//! After every event the replay reads the stack's cache figures
//! (`AllocatorStats::cached_bytes`, `largest_free_bytes`), so `reserved` (allocated +
//! idle in caches) and the fragmentation (`1 - largest free / cached`) are known at
//! every step, and at the peak.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::fmt::{self, Write as _};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

#[cfg(unix)]
use allocator_cpu::VirtualHostAllocator;
use allocator_cpu::{PooledAllocator, SystemAllocator};
use memory_governor::{
    AccountConfig, AllocationRequest, ByteRange, DeviceAllocator, DeviceKey, GovernedAllocError, GovernedAllocator,
    Governor, GovernorConfig, IdentityIssuer, MemoryRole, RawAllocation,
};

use crate::event::{Block, Event, ReleaseKind, What};
use crate::read::Trace;

/// Which allocator stack a replay runs on.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AllocatorKind {
    /// The system allocator, no cache.
    System,
    /// A caching pool over the system allocator, its backing governed.
    Pooled,
    /// Reserve address space, commit each block whole (Unix: the host's virtual
    /// memory calls).
    #[cfg(unix)]
    Virtual,
}

impl AllocatorKind {
    /// Every kind, in the order `--compare` names them by default.
    #[cfg(unix)]
    pub const ALL: &[AllocatorKind] = &[AllocatorKind::System, AllocatorKind::Pooled, AllocatorKind::Virtual];
    /// Every kind, in the order `--compare` names them by default.
    #[cfg(not(unix))]
    pub const ALL: &[AllocatorKind] = &[AllocatorKind::System, AllocatorKind::Pooled];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            AllocatorKind::System => "system",
            AllocatorKind::Pooled => "pooled",
            #[cfg(unix)]
            AllocatorKind::Virtual => "virtual",
        }
    }
}

impl fmt::Display for AllocatorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for AllocatorKind {
    type Err = String;

    fn from_str(text: &str) -> Result<AllocatorKind, String> {
        AllocatorKind::ALL.iter().copied().find(|kind| kind.name() == text).ok_or_else(|| {
            let known: Vec<&str> = AllocatorKind::ALL.iter().map(|kind| kind.name()).collect();
            format!("unknown allocator `{text}`: expected one of {} (virtual needs a Unix host)", known.join(", "))
        })
    }
}

/// One replay configuration.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayConfig {
    /// The allocator stack.
    pub allocator: AllocatorKind,
    /// Every device's limit; `None`: the limit recorded (none if none was).
    pub device_limit: Option<u64>,
    /// Whether tenants keep the quotas recorded (default) or have none.
    pub recorded_quotas: bool,
    /// Points of the timeline kept for the page (each the highest of its stretch).
    pub timeline_points: usize,
}

impl ReplayConfig {
    /// `allocator` with the recorded limits and quotas.
    pub fn new(allocator: AllocatorKind) -> ReplayConfig {
        ReplayConfig { allocator, device_limit: None, recorded_quotas: true, timeline_points: 1500 }
    }

    /// The same configuration with every device limited to `bytes`.
    #[must_use]
    pub fn with_device_limit(self, bytes: u64) -> ReplayConfig {
        ReplayConfig { device_limit: Some(bytes), ..self }
    }

    /// The same configuration without the recorded quotas.
    #[must_use]
    pub fn without_quotas(self) -> ReplayConfig {
        ReplayConfig { recorded_quotas: false, ..self }
    }

    /// A short name for tables ("pooled", "pooled @ 64.0 MiB").
    pub fn label(&self) -> String {
        match self.device_limit {
            Some(limit) => format!("{} @ {}", self.allocator, bytes(limit)),
            None => self.allocator.name().to_owned(),
        }
    }
}

/// Latency percentiles of one operation, in nanoseconds.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Latency {
    /// Operations timed.
    pub count: u64,
    /// Median.
    pub p50_ns: u64,
    /// 99th percentile.
    pub p99_ns: u64,
    /// Slowest.
    pub max_ns: u64,
}

impl Latency {
    fn of(mut samples: Vec<u64>) -> Latency {
        if samples.is_empty() {
            return Latency::default();
        }
        samples.sort_unstable();
        let n = samples.len();
        let at = |pct: usize| samples[(n * pct / 100).min(n - 1)];
        Latency { count: n as u64, p50_ns: at(50), p99_ns: at(99), max_ns: samples[n - 1] }
    }
}

/// A request the replay refused.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayRefusal {
    /// The event's index in the trace.
    pub event: usize,
    /// Its recorded time.
    pub ts_ns: u64,
    /// Its tenant.
    pub tenant: u32,
    /// Its role.
    pub role: MemoryRole,
    /// Bytes asked for.
    pub requested: u64,
    /// Whether the recording refused it too.
    pub refused_when_recorded: bool,
    /// The governor's message (or the allocator's, for a failure).
    pub message: String,
}

/// An event the recording's own books cannot pair with another (see [`DeviceReport::unpaired`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Unpaired {
    /// The event's index in the trace.
    pub event: usize,
    /// Its recorded time.
    pub ts_ns: u64,
    /// Its tenant.
    pub tenant: u32,
    /// The block's recorded identity (the governed tag).
    pub id: u64,
    /// The block's recorded address.
    pub address: u64,
    /// What does not pair.
    pub kind: UnpairedKind,
}

/// What about an [`Unpaired`] event does not pair.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UnpairedKind {
    /// A release (complete or quarantined) or a lost block of a block the trace never
    /// allocated, or had already released.
    NotLive,
    /// An allocation of a block (device, address, identity) the trace still held.
    AlreadyLive,
}

/// A block live at the peak.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeakBlock {
    /// The allocation event's index.
    pub event: usize,
    /// Its recorded time.
    pub ts_ns: u64,
    /// Its recorded identity (the governed tag) and address.
    pub id: u64,
    /// Its recorded address.
    pub address: u64,
    /// Tenant, role, bytes in the replay, thread and caller tag.
    pub tenant: u32,
    /// Its role.
    pub role: MemoryRole,
    /// Bytes charged in the replay.
    pub bytes: u64,
    /// The recording thread.
    pub thread: u32,
    /// The caller's tag (0: none).
    pub caller: u64,
}

/// One point of the timeline: after event `event`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sample {
    /// The event's index.
    pub event: usize,
    /// Its recorded time.
    pub ts_ns: u64,
    /// Bytes allocated per series ([`DeviceReport::series`] order).
    pub allocated: Vec<u64>,
    /// Allocated plus idle in caches.
    pub reserved: u64,
}

/// The books a replay of one configuration kept for one device: what must come out the
/// same on every run.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Books {
    /// Peak allocated, reserved (the replay's and the governor's), the fragmentation at
    /// the reserved peak, refusals, failures and recorded refusals admitted.
    pub peak_allocated: u64,
    /// See [`DeviceReport::peak_reserved`].
    pub peak_reserved: u64,
    /// See [`DeviceReport::governor_peak`].
    pub governor_peak: u64,
    /// See [`DeviceReport::governor_reserved_peak`].
    pub governor_reserved_peak: u64,
    /// See [`DeviceReport::fragmentation_at_peak`].
    pub fragmentation_at_peak: f64,
    /// Refused events (indexes).
    pub refused: Vec<usize>,
    /// See [`DeviceReport::failures`].
    pub failures: u64,
    /// See [`DeviceReport::recorded_refusals_admitted`].
    pub recorded_refusals_admitted: u64,
}

/// What a replay found for one device.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct DeviceReport {
    /// The device.
    pub device: DeviceKey,
    /// Its limit in the replay.
    pub limit: Option<u64>,
    /// The highest bytes held at once by blocks the replay was handed (a recorded
    /// refusal admitted here counts while it is held, before it goes back).
    pub peak_allocated: u64,
    /// The highest allocated + idle in caches (the stack's `cached_bytes`) after any
    /// event, the governor's `reserved` as its snapshots compute it.
    pub peak_reserved: u64,
    /// `1 - largest free / cached` when reserved peaked.
    pub fragmentation_at_peak: f64,
    /// The event after which reserved peaked.
    pub peak_event: Option<usize>,
    /// Every refusal, in order (the first is the first refused event).
    pub refusals: Vec<ReplayRefusal>,
    /// Requests the allocator under the governor failed (charge cancelled).
    pub failures: u64,
    /// Requests refused (or failed) when recorded that this configuration admitted.
    pub recorded_refusals_admitted: u64,
    /// Releases of blocks the replay does not hold (refused here, or unmatched).
    pub skipped_releases: u64,
    /// Blocks still live at the end of the trace (released by the replay).
    pub live_at_end: u64,
    /// Events the recording's own books cannot pair, in order: releases and lost blocks
    /// of blocks the trace never allocated or had already released, allocations of a
    /// block it still held. A recording writes none (each block's allocation comes before
    /// its release); they mean events are missing (a damaged file read past its damage
    /// by other tools, or traces merged). The same for every configuration.
    pub unpaired: Vec<Unpaired>,
    /// Allocation latency through the governor and the stack.
    pub allocate: Latency,
    /// Release latency.
    pub release: Latency,
    /// The governor's figures at the end, before the replay released what was live:
    /// allocated, reserved and its peak.
    pub final_allocated: u64,
    /// See above.
    pub final_reserved: u64,
    /// The governor's `DeviceSnapshot::peak`: it counts a request's charge while its
    /// allocation runs, so it includes requests the recovery ladder refused in the end.
    pub governor_peak: u64,
    /// The governor's `DeviceSnapshot::reserved_peak`: it also sees the moment inside a
    /// call when a cache has grown (or a request is charged) and the ladder has not yet
    /// checked it, so it may pass the device limit (docs/ACCOUNTING.md, "Allocated and
    /// reserved").
    pub governor_reserved_peak: u64,
    /// The timeline's series: (tenant, role).
    pub series: Vec<(u32, MemoryRole)>,
    /// The timeline.
    pub timeline: Vec<Sample>,
    /// The largest blocks live when allocated peaked, largest first (at most 20).
    pub largest_at_peak: Vec<PeakBlock>,
}

impl DeviceReport {
    /// The books: what is the same on every replay of the same trace and configuration.
    pub fn books(&self) -> Books {
        Books {
            peak_allocated: self.peak_allocated,
            peak_reserved: self.peak_reserved,
            governor_peak: self.governor_peak,
            governor_reserved_peak: self.governor_reserved_peak,
            fragmentation_at_peak: self.fragmentation_at_peak,
            refused: self.refusals.iter().map(|refusal| refusal.event).collect(),
            failures: self.failures,
            recorded_refusals_admitted: self.recorded_refusals_admitted,
        }
    }
}

/// What a replay of one configuration found.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ReplayReport {
    /// The configuration.
    pub config: ReplayConfig,
    /// Per device, in the trace's order.
    pub devices: Vec<DeviceReport>,
    /// Events replayed.
    pub events: u64,
}

/// One device's stack in a replay.
struct Stack {
    device: DeviceKey,
    /// What the caches report (the stack's top allocator).
    top: Arc<dyn DeviceAllocator>,
    virtual_commit: bool,
}

struct ReplayTenant {
    governed: GovernedAllocator,
}

struct LiveBlock {
    raw: RawAllocation,
    /// The replay tenant's key.
    tenant: u32,
    series: usize,
}

/// The per-device running figures.
struct DeviceRun {
    report: DeviceReport,
    series_index: HashMap<(u32, MemoryRole), usize>,
    allocated_by_series: Vec<u64>,
    allocated: u64,
    peak_allocated_seen: u64,
    peak_allocated_event: Option<usize>,
    alloc_ns: Vec<u64>,
    release_ns: Vec<u64>,
    bucket: Option<Sample>,
}

fn stack_for(kind: AllocatorKind, device: DeviceKey, governor: &Governor) -> Stack {
    let top: Arc<dyn DeviceAllocator> = match kind {
        AllocatorKind::System => Arc::new(SystemAllocator::for_device(device)),
        AllocatorKind::Pooled => {
            let backing = governor.cache_backing(Arc::new(SystemAllocator::for_caches(device)));
            Arc::new(PooledAllocator::new(backing))
        }
        #[cfg(unix)]
        AllocatorKind::Virtual => Arc::new(VirtualHostAllocator::for_device(device)),
    };
    #[cfg(unix)]
    let virtual_commit = kind == AllocatorKind::Virtual;
    #[cfg(not(unix))]
    let virtual_commit = false;
    Stack { device, top, virtual_commit }
}

/// Replays `trace` against `config`.
pub fn replay(trace: &Trace, config: &ReplayConfig) -> ReplayReport {
    let governor = Governor::with_config(GovernorConfig::default().with_credit_chunk(0));
    let issuer = IdentityIssuer::new().ok();
    let devices = trace.devices();
    let mut stacks = Vec::with_capacity(devices.len());
    let mut runs = Vec::with_capacity(devices.len());
    for &device in &devices {
        let recorded = trace.tenants.iter().filter(|tenant| tenant.device == device).find_map(|t| t.device_limit);
        let limit = config.device_limit.or(recorded);
        if let Some(limit) = limit {
            let _ = governor.set_device_limit(device, limit);
        }
        stacks.push(stack_for(config.allocator, device, &governor));
        runs.push(DeviceRun {
            report: DeviceReport {
                device,
                limit,
                peak_allocated: 0,
                peak_reserved: 0,
                fragmentation_at_peak: 0.0,
                peak_event: None,
                refusals: Vec::new(),
                failures: 0,
                recorded_refusals_admitted: 0,
                skipped_releases: 0,
                live_at_end: 0,
                unpaired: Vec::new(),
                allocate: Latency::default(),
                release: Latency::default(),
                final_allocated: 0,
                final_reserved: 0,
                governor_peak: 0,
                governor_reserved_peak: 0,
                series: Vec::new(),
                timeline: Vec::new(),
                largest_at_peak: Vec::new(),
            },
            series_index: HashMap::new(),
            allocated_by_series: Vec::new(),
            allocated: 0,
            peak_allocated_seen: 0,
            peak_allocated_event: None,
            alloc_ns: Vec::new(),
            release_ns: Vec::new(),
            bucket: None,
        });
    }
    // Series are known up front, so every sample has every column.
    for event in &trace.events {
        let asks = matches!(event.what, What::Allocate(_) | What::Refusal(_) | What::Failure { .. });
        if let (true, Some(at)) = (asks, devices.iter().position(|d| *d == event.device)) {
            let role = event.role.unwrap_or(MemoryRole::Other);
            let run = &mut runs[at];
            let next = run.report.series.len();
            run.series_index.entry((event.tenant, role)).or_insert_with(|| {
                run.report.series.push((event.tenant, role));
                next
            });
        }
    }
    for run in &mut runs {
        run.allocated_by_series = vec![0; run.report.series.len()];
    }
    let mut tenants: HashMap<u32, ReplayTenant> = HashMap::new();
    let mut live: HashMap<(DeviceKey, u64, u64), LiveBlock> = HashMap::new();
    // The recording's own books: the blocks the trace holds after each event, whatever
    // this replay admitted.
    let mut recorded: HashSet<(DeviceKey, u64, u64)> = HashSet::new();
    let bucket_len = trace.events.len().div_ceil(config.timeline_points.max(1)).max(1);
    for (index, event) in trace.events.iter().enumerate() {
        let Some(at) = devices.iter().position(|device| *device == event.device) else { continue };
        // A tenant is per device: the same number on another device is another account.
        let key = event.tenant ^ (at as u32) << 24;
        if let Entry::Vacant(slot) = tenants.entry(key) {
            match open_tenant(trace, config, &governor, issuer.as_ref(), event.tenant, &stacks[at]) {
                Some(tenant) => slot.insert(tenant),
                None => continue,
            };
        }
        let tenant = &tenants[&key];
        let run = &mut runs[at];
        let stack = &stacks[at];
        match &event.what {
            What::Allocate(block) => {
                let identity = (event.device, block.address, block.id);
                if !recorded.insert(identity) {
                    run.unpaired(index, event, block, UnpairedKind::AlreadyLive);
                    // Its release is missing: give back what this replay held under the
                    // identity, or it would stay charged (and allocated) to the end.
                    if let Some(held) = live.remove(&identity) {
                        let holder = tenants.get(&held.tenant).unwrap_or(tenant);
                        run.release(&holder.governed, held);
                    }
                }
                let role = event.role.unwrap_or(MemoryRole::Other);
                match attempt(tenant, stack, run, role, block.requested, block.align) {
                    Attempt::Admitted(raw) => {
                        let series = run.series_index[&(event.tenant, role)];
                        run.add(series, raw.bytes() as u64, index);
                        live.insert(identity, LiveBlock { raw, tenant: key, series });
                    }
                    Attempt::Refused(message) => run.refused(index, event, role, block.requested, false, message),
                    Attempt::Failed => run.report.failures += 1,
                }
            }
            What::Refusal(refusal) => {
                let role = event.role.unwrap_or(MemoryRole::Other);
                retry_recorded(tenant, stack, run, (index, event), role, refusal.requested, refusal.align);
            }
            What::Failure { requested, align, .. } => {
                let role = event.role.unwrap_or(MemoryRole::Other);
                retry_recorded(tenant, stack, run, (index, event), role, *requested, *align);
            }
            What::Release { block, outcome: ReleaseKind::Quarantined, .. }
                if !recorded.contains(&(event.device, block.address, block.id)) =>
            {
                run.unpaired(index, event, block, UnpairedKind::NotLive);
            }
            What::Release { block, outcome: ReleaseKind::Complete, .. } | What::Lost(block) => {
                if !recorded.remove(&(event.device, block.address, block.id)) {
                    run.unpaired(index, event, block, UnpairedKind::NotLive);
                }
                match live.remove(&(event.device, block.address, block.id)) {
                    Some(held) => {
                        let holder = tenants.get(&held.tenant).unwrap_or(tenant);
                        run.release(&holder.governed, held);
                    }
                    None => run.report.skipped_releases += 1,
                }
            }
            _ => {}
        }
        run.observe(index, event, stack, bucket_len);
    }
    let snapshot = governor.snapshot();
    for (run, stack) in runs.iter_mut().zip(&stacks) {
        if let Some(bucket) = run.bucket.take() {
            run.report.timeline.push(bucket);
        }
        if let Some(device) = snapshot.device(stack.device) {
            run.report.final_allocated = device.allocated;
            run.report.final_reserved = device.reserved;
            run.report.governor_peak = device.peak;
            run.report.governor_reserved_peak = device.reserved_peak;
        }
        run.report.peak_allocated = run.peak_allocated_seen;
        run.report.allocate = Latency::of(std::mem::take(&mut run.alloc_ns));
        run.report.release = Latency::of(std::mem::take(&mut run.release_ns));
    }
    // What was live when allocated peaked: the trace again, with this replay's admissions.
    for (at, run) in runs.iter_mut().enumerate() {
        run.report.largest_at_peak = largest_at(trace, devices[at], run.peak_allocated_event, &run.report);
    }
    // Everything still live goes back (the trace ended holding it).
    for ((device, _, _), held) in live.drain() {
        if let Some(at) = devices.iter().position(|known| *known == device) {
            runs[at].report.live_at_end += 1;
        }
        if let Some(tenant) = tenants.get(&held.tenant) {
            let _ = tenant.governed.release(held.raw);
        }
    }
    for stack in &stacks {
        stack.top.trim();
    }
    ReplayReport {
        config: *config,
        devices: runs.into_iter().map(|run| run.report).collect(),
        events: trace.events.len() as u64,
    }
}

/// Opens the replay's account for recorded tenant `id` on `stack`'s device, with its
/// recorded label and (if the configuration keeps them) quota.
fn open_tenant(
    trace: &Trace,
    config: &ReplayConfig,
    governor: &Governor,
    issuer: Option<&IdentityIssuer>,
    id: u32,
    stack: &Stack,
) -> Option<ReplayTenant> {
    let device = stack.device;
    let authority = issuer?.authority().ok()?;
    let recorded = trace.tenant(id).filter(|tenant| tenant.device == device);
    let label = recorded.map_or_else(|| format!("tenant {id}"), |tenant| tenant.label.clone());
    let mut account = AccountConfig::new(device, authority).with_label(label);
    if config.recorded_quotas
        && let Some(quota) = recorded.and_then(|tenant| tenant.quota)
    {
        account = account.with_quota(quota);
    }
    governor.open_account(account).ok()?;
    let governed = governor.govern(Arc::clone(&stack.top), authority).ok()?;
    Some(ReplayTenant { governed })
}

enum Attempt {
    Admitted(RawAllocation),
    Refused(String),
    Failed,
}

fn attempt(
    tenant: &ReplayTenant,
    stack: &Stack,
    run: &mut DeviceRun,
    role: MemoryRole,
    requested: u64,
    align: u64,
) -> Attempt {
    // Reserve/commit memory is used in whole pages: the last partial page of a block
    // could never be committed (ranges are checked against the bytes allocated), so a
    // runtime on it asks for page multiples, and so does the replay.
    let backing = if stack.virtual_commit { tenant.governed.virtual_backing() } else { None };
    let granularity = backing.map_or(1, |backing| backing.granularity().max(1) as u64);
    let Some(asked) = requested.checked_next_multiple_of(granularity) else { return Attempt::Failed };
    let Ok(request) = AllocationRequest::new(asked as usize, align as usize) else { return Attempt::Failed };
    let request = request.with_role(role);
    let started = Instant::now();
    let result = tenant.governed.try_allocate(&request);
    let outcome = match result {
        Ok(raw) => match backing {
            Some(backing) if raw.bytes() > 0 => match backing.commit(&raw, ByteRange::new(0, raw.bytes())) {
                Ok(_) => Attempt::Admitted(raw),
                // A block that cannot be backed is of no use: it goes back, a failure.
                Err(_) => {
                    let _ = tenant.governed.release(raw);
                    Attempt::Failed
                }
            },
            _ => Attempt::Admitted(raw),
        },
        Err(GovernedAllocError::Refused(refusal)) => Attempt::Refused(refusal.to_string()),
        Err(_) => Attempt::Failed,
    };
    run.alloc_ns.push(started.elapsed().as_nanos() as u64);
    outcome
}

fn retry_recorded(
    tenant: &ReplayTenant,
    stack: &Stack,
    run: &mut DeviceRun,
    (index, event): (usize, &Event),
    role: MemoryRole,
    requested: u64,
    align: u64,
) {
    match attempt(tenant, stack, run, role, requested, align) {
        Attempt::Admitted(raw) => {
            run.report.recorded_refusals_admitted += 1;
            // Held for a moment: the peaks see it, then it goes back.
            let series = run.series_index[&(event.tenant, role)];
            run.add(series, raw.bytes() as u64, index);
            let reserved = run.observe_peak(index, stack);
            run.sample(index, event.ts_ns, reserved);
            run.release(&tenant.governed, LiveBlock { raw, tenant: 0, series });
        }
        Attempt::Refused(message) => run.refused(index, event, role, requested, true, message),
        Attempt::Failed => run.report.failures += 1,
    }
}

impl DeviceRun {
    fn add(&mut self, series: usize, bytes: u64, index: usize) {
        self.allocated_by_series[series] += bytes;
        self.allocated += bytes;
        if self.allocated > self.peak_allocated_seen {
            self.peak_allocated_seen = self.allocated;
            self.peak_allocated_event = Some(index);
        }
    }

    fn release(&mut self, governed: &GovernedAllocator, held: LiveBlock) {
        let bytes = held.raw.bytes() as u64;
        let started = Instant::now();
        let outcome = governed.release(held.raw);
        self.release_ns.push(started.elapsed().as_nanos() as u64);
        if outcome.is_complete() {
            self.allocated_by_series[held.series] -= bytes;
            self.allocated -= bytes;
        }
    }

    fn unpaired(&mut self, index: usize, event: &Event, block: &Block, kind: UnpairedKind) {
        self.report.unpaired.push(Unpaired {
            event: index,
            ts_ns: event.ts_ns,
            tenant: event.tenant,
            id: block.id,
            address: block.address,
            kind,
        });
    }

    fn refused(
        &mut self,
        index: usize,
        event: &Event,
        role: MemoryRole,
        requested: u64,
        recorded: bool,
        message: String,
    ) {
        self.report.refusals.push(ReplayRefusal {
            event: index,
            ts_ns: event.ts_ns,
            tenant: event.tenant,
            role,
            requested,
            refused_when_recorded: recorded,
            message,
        });
    }

    /// Reserved after event `index` (or inside it), and the peak; what it read.
    fn observe_peak(&mut self, index: usize, stack: &Stack) -> u64 {
        let stats = stack.top.stats().unwrap_or_default();
        let reserved = self.allocated + stats.cached_bytes;
        if reserved > self.report.peak_reserved || self.report.peak_event.is_none() {
            self.report.peak_reserved = reserved;
            self.report.peak_event = Some(index);
            self.report.fragmentation_at_peak =
                memory_governor::fragmentation(stats.cached_bytes, stats.largest_free_bytes);
        }
        reserved
    }

    /// The figures after event `index`: reserved, the peak, the timeline.
    fn observe(&mut self, index: usize, event: &Event, stack: &Stack, bucket_len: usize) {
        let reserved = self.observe_peak(index, stack);
        self.sample(index, event.ts_ns, reserved);
        if (index + 1).is_multiple_of(bucket_len)
            && let Some(bucket) = self.bucket.take()
        {
            self.report.timeline.push(bucket);
        }
    }

    /// Offers the books now to the timeline: each stretch keeps its highest point.
    fn sample(&mut self, index: usize, ts_ns: u64, reserved: u64) {
        let sample = Sample { event: index, ts_ns, allocated: self.allocated_by_series.clone(), reserved };
        let keep = match &self.bucket {
            Some(bucket) => {
                let total: u64 = bucket.allocated.iter().sum();
                reserved.max(self.allocated) > bucket.reserved.max(total)
            }
            None => true,
        };
        if keep {
            self.bucket = Some(sample);
        }
    }
}

/// The blocks this replay held after event `peak` on `device`, largest first.
fn largest_at(trace: &Trace, device: DeviceKey, peak: Option<usize>, report: &DeviceReport) -> Vec<PeakBlock> {
    let Some(peak) = peak else { return Vec::new() };
    let refused: std::collections::HashSet<usize> = report.refusals.iter().map(|refusal| refusal.event).collect();
    let mut live: HashMap<(u64, u64), PeakBlock> = HashMap::new();
    for (index, event) in trace.events.iter().enumerate().take(peak + 1) {
        if event.device != device {
            continue;
        }
        match &event.what {
            What::Allocate(block) if !refused.contains(&index) => {
                live.insert(
                    (block.address, block.id),
                    PeakBlock {
                        event: index,
                        ts_ns: event.ts_ns,
                        id: block.id,
                        address: block.address,
                        tenant: event.tenant,
                        role: event.role.unwrap_or(MemoryRole::Other),
                        bytes: block.bytes,
                        thread: event.thread,
                        caller: block.caller,
                    },
                );
            }
            What::Release { block, outcome: ReleaseKind::Complete, .. } | What::Lost(block) => {
                live.remove(&(block.address, block.id));
            }
            _ => {}
        }
    }
    let mut blocks: Vec<PeakBlock> = live.into_values().collect();
    blocks.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.event.cmp(&b.event)));
    blocks.truncate(20);
    blocks
}

/// Replays `trace` against each configuration in turn.
pub fn replay_all(trace: &Trace, configs: &[ReplayConfig]) -> Vec<ReplayReport> {
    configs.iter().map(|config| replay(trace, config)).collect()
}

/// Parses a size: a number of bytes, or one with a unit (`KiB`, `MiB`, `GiB`, `TiB`,
/// or `K`, `M`, `G`, `T`, powers of 1024; `KB`, `MB`, `GB`, `TB`, powers of 1000).
///
/// # Errors
/// A message naming what was wrong.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit = unit.trim();
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(format!("`{text}`: unknown unit `{unit}` (use bytes, KiB, MiB, GiB or TiB)")),
    };
    let value: f64 = number.parse().map_err(|_| format!("`{text}` is not a size (for example 268435456 or 256MiB)"))?;
    let bytes = value * scale as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err(format!("`{text}` is out of range"));
    }
    Ok(bytes.round() as u64)
}

impl FromStr for ReplayConfig {
    type Err = String;

    /// `system`, `pooled`, `virtual`, each optionally with a device limit: `pooled@64MiB`.
    fn from_str(text: &str) -> Result<ReplayConfig, String> {
        let (kind, limit) = match text.split_once('@') {
            Some((kind, limit)) => (kind, Some(parse_bytes(limit)?)),
            None => (text, None),
        };
        let config = ReplayConfig::new(kind.trim().parse()?);
        Ok(match limit {
            Some(limit) => config.with_device_limit(limit),
            None => config,
        })
    }
}

/// The table's warning about `device`'s unpaired events (the same in every report).
fn unpaired_warning(out: &mut String, trace: &Trace, device: &DeviceReport) {
    for (kind, what, did) in [
        (
            UnpairedKind::NotLive,
            "releases or loses blocks it never allocated or had already released",
            "the replay skipped those releases",
        ),
        (
            UnpairedKind::AlreadyLive,
            "allocates blocks it still held",
            "the replay gave back the block it held under each such identity before allocating it again",
        ),
    ] {
        let mut of_kind = device.unpaired.iter().filter(|unpaired| unpaired.kind == kind);
        let Some(first) = of_kind.next() else { continue };
        let _ = writeln!(
            out,
            "warning: on {} the trace {what}: {} such event(s), the first #{} at {:.3} s ({}, id {:#x} at {:#x}); events are \
             missing from the recording (a damaged file, or traces merged), and {did}; check the trace (memory-trace \
             info) and record again",
            device.device,
            1 + of_kind.count(),
            first.event,
            first.ts_ns as f64 / 1e9,
            trace.tenant_label(first.tenant),
            first.id,
            first.address
        );
    }
}

/// Bytes for people: `512 B`, `4.0 KiB`, `1.5 MiB`, `2.00 GiB`.
pub fn bytes(value: u64) -> String {
    const KIB: f64 = 1024.0;
    let v = value as f64;
    if value < 1024 {
        format!("{value} B")
    } else if v < KIB * KIB {
        format!("{:.1} KiB", v / KIB)
    } else if v < KIB * KIB * KIB {
        format!("{:.1} MiB", v / (KIB * KIB))
    } else {
        format!("{:.2} GiB", v / (KIB * KIB * KIB))
    }
}

fn nanos(value: u64) -> String {
    if value < 10_000 { format!("{value} ns") } else { format!("{:.1} us", value as f64 / 1e3) }
}

/// The side-by-side table of `reports` (one column per configuration, one block of rows
/// per device), then each configuration's first refused event.
pub fn table(trace: &Trace, reports: &[ReplayReport]) -> String {
    let mut out = String::new();
    let devices = trace.devices();
    let _ = writeln!(
        out,
        "{} events, {} tenants, {} threads, {} device(s), {:.3} s recorded",
        trace.events.len(),
        trace.tenants.len(),
        trace.threads.len(),
        devices.len(),
        trace.events.last().map_or(0.0, |event| event.ts_ns as f64 / 1e9)
    );
    if let Some(damage) = &trace.damage {
        let _ = writeln!(out, "warning: {damage}");
    }
    for (at, device) in devices.iter().enumerate() {
        let mut rows: Vec<(String, Vec<String>)> = Vec::new();
        let mut row = |name: &str, cell: &dyn Fn(&DeviceReport) -> String| {
            rows.push((name.to_owned(), reports.iter().map(|report| cell(&report.devices[at])).collect()));
        };
        row("device limit", &|d| d.limit.map_or_else(|| "none".to_owned(), bytes));
        row("peak allocated", &|d| bytes(d.peak_allocated));
        row("peak reserved", &|d| bytes(d.peak_reserved));
        row("governor peak / reserved_peak", &|d| {
            format!("{} / {}", bytes(d.governor_peak), bytes(d.governor_reserved_peak))
        });
        row("fragmentation at peak", &|d| format!("{:.0} %", d.fragmentation_at_peak * 100.0));
        row("refusals", &|d| d.refusals.len().to_string());
        row("first refused event", &|d| {
            d.refusals.first().map_or_else(|| "-".to_owned(), |refusal| format!("#{}", refusal.event))
        });
        row("recorded refusals admitted", &|d| d.recorded_refusals_admitted.to_string());
        row("allocator failures", &|d| d.failures.to_string());
        row("allocate p50 / p99", &|d| format!("{} / {}", nanos(d.allocate.p50_ns), nanos(d.allocate.p99_ns)));
        row("release p50 / p99", &|d| format!("{} / {}", nanos(d.release.p50_ns), nanos(d.release.p99_ns)));
        let headers: Vec<String> = reports.iter().map(|report| report.config.label()).collect();
        let first = rows.iter().map(|(name, _)| name.len()).max().unwrap_or(0).max(device.to_string().len());
        let widths: Vec<usize> = (0..reports.len())
            .map(|column| {
                rows.iter().map(|(_, cells)| cells[column].len()).chain([headers[column].len()]).max().unwrap_or(0)
            })
            .collect();
        let _ = write!(out, "\n{:<first$}", device.to_string());
        for (header, width) in headers.iter().zip(&widths) {
            let _ = write!(out, "  {header:>width$}");
        }
        out.push('\n');
        for (name, cells) in &rows {
            let _ = write!(out, "{name:<first$}");
            for (cell, width) in cells.iter().zip(&widths) {
                let _ = write!(out, "  {cell:>width$}");
            }
            out.push('\n');
        }
        if let Some(first) = reports.first() {
            unpaired_warning(&mut out, trace, &first.devices[at]);
        }
        for report in reports {
            if let Some(refusal) = report.devices[at].refusals.first() {
                let _ = writeln!(
                    out,
                    "{}: first refused event #{} at {:.3} s: {} {} {}: {}",
                    report.config.label(),
                    refusal.event,
                    refusal.ts_ns as f64 / 1e9,
                    trace.tenant_label(refusal.tenant),
                    refusal.role,
                    bytes(refusal.requested),
                    refusal.message
                );
            }
        }
    }
    out
}
