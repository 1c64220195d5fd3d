//! `--processes N`: N engine processes on one node, each with its own registry and
//! governor, sharing the two simulated devices' budgets and the tenants' quotas through
//! node books (`memory-node`). The coordinator (this process) creates the books, sets
//! the node's limits, starts the engines (this binary again, with the hidden
//! `--engine-of` flag), watches the books, kills one engine with SIGKILL two thirds into
//! its requests, and ends the report with the nothing-lost check across processes: the
//! killed engine's grants came back within the stated bound, every survivor released
//! everything it allocated and its local limits equal its node grants, no consistent
//! sample of the books was over a limit or a quota, and the books end empty.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use memory_governor::{
    AccountConfig, AllocationRequest, AuthorityIdentity, BindingRegistry, DeviceAllocator, DeviceKey, Governor,
    GovernorConfig, GuaranteedReserve, MemoryBinding, MemoryRole, ReclaimThenFail,
};
use memory_node::{NodeBooks, NodeConfig, NodeSnapshot};
use rand::{Rng, SeedableRng};

use crate::sim::world::{DEVICE_BUDGET, MIB, TENANTS};

/// The simulated devices, as the single-process demo names them.
const DEVICES: [DeviceKey; 2] = [DeviceKey::host(1), DeviceKey::host(2)];
/// Each engine's weights on each device (a reserve of its own, inside the node limit).
const ENGINE_WEIGHTS: u64 = 16 * MIB;
/// The node quota of the platform authority (the weights of every engine) per device.
const PLATFORM_QUOTA: u64 = 64 * MIB;
/// Which engine the coordinator kills, and when (a fraction of its requests).
const VICTIM: usize = 1;
const KILL_AT: f64 = 2.0 / 3.0;

/// What `--processes` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessesConfig {
    /// Engine processes (at least 2: one is killed).
    pub processes: usize,
    /// Requests per engine.
    pub requests: u64,
    /// Seed of every random choice.
    pub seed: u64,
    /// Worker threads per engine.
    pub threads: usize,
}

/// What the hidden `--engine-of` flag asks for: one engine of a `--processes` run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// The books file.
    pub books: std::path::PathBuf,
    /// This engine's index.
    pub index: usize,
    /// Requests to serve.
    pub requests: u64,
    /// Seed.
    pub seed: u64,
    /// Worker threads.
    pub threads: usize,
}

/// The coordinator's report: printable, with the verdict.
#[derive(Debug)]
pub struct ProcessesReport {
    text: String,
    passed: bool,
}

impl ProcessesReport {
    /// Whether the nothing-lost check across processes passed.
    pub fn passed(&self) -> bool {
        self.passed
    }
}

impl std::fmt::Display for ProcessesReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

fn node_config(books: &std::path::Path) -> NodeConfig {
    let name = books.file_name().map_or_else(String::new, |name| name.to_string_lossy().into_owned());
    let directory = books.parent().map_or_else(|| std::path::PathBuf::from("/dev/shm"), std::path::Path::to_path_buf);
    NodeConfig::new(name).with_directory(directory).with_grant_chunk(4 * MIB).with_margin(4 * MIB)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / MIB as f64)
}

/// Runs the coordinator.
///
/// # Errors
/// A message when the books cannot be made or an engine cannot be started or read.
pub fn run(config: &ProcessesConfig) -> Result<ProcessesReport, String> {
    let directory = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
    let name = format!("memory-demo-{}", std::process::id());
    let books = NodeBooks::open(node_config(&directory.join(&name))).map_err(|e| e.to_string())?;
    let path = books.path().to_owned();
    let _cleanup = RemoveOnDrop(path.clone());
    for device in DEVICES {
        books.set_device_limit(device, DEVICE_BUDGET).map_err(|e| e.to_string())?;
        books.set_tenant_quota(device, "platform", PLATFORM_QUOTA).map_err(|e| e.to_string())?;
        for (tenant, quota) in TENANTS {
            books.set_tenant_quota(device, tenant, quota).map_err(|e| e.to_string())?;
        }
    }
    let started = Instant::now();
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let mut engines = Vec::new();
    for index in 0..config.processes {
        let mut child = Command::new(&exe)
            .args(["--engine-of", &path.display().to_string(), "--engine-index", &index.to_string()])
            .args(["--requests", &config.requests.to_string(), "--seed", &config.seed.to_string()])
            .args(["--threads", &config.threads.to_string(), "--no-progress"])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start engine {index}: {e}"))?;
        let stdout = child.stdout.take().ok_or("no engine stdout")?;
        let progress = Arc::new(AtomicU64::new(0));
        let result = Arc::new(Mutex::new(None::<serde_json::Value>));
        let reader = {
            let (progress, result) = (Arc::clone(&progress), Arc::clone(&result));
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if let Some(served) = line.strip_prefix("served ") {
                        progress.store(served.trim().parse().unwrap_or(0), Ordering::SeqCst);
                    } else if let Some(json) = line.strip_prefix("RESULT ") {
                        *result.lock().unwrap_or_else(PoisonError::into_inner) = serde_json::from_str(json).ok();
                    }
                }
            })
        };
        engines.push(Engine { index, pid: child.id(), child, progress, result, reader });
    }

    // Watch the books; kill the victim two thirds in.
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let (books, watching) = (books.clone(), Arc::clone(&watching));
        std::thread::spawn(move || watch(&books, &watching))
    };
    let victim = VICTIM.min(engines.len() - 1);
    let kill_after = (config.requests as f64 * KILL_AT) as u64;
    let bound = books.config().refund_bound();
    let mut kill = None;
    let deadline = Instant::now() + Duration::from_secs(300);
    while kill.is_none() && Instant::now() < deadline {
        let engine = &mut engines[victim];
        if engine.progress.load(Ordering::SeqCst) >= kill_after {
            let before = books.snapshot();
            let held: Vec<(String, u64)> = before
                .slot_of(u64::from(engine.pid))
                .map(|slot| {
                    slot.budgets.iter().filter(|b| b.tenant.is_none()).map(|b| (b.device.clone(), b.granted)).collect()
                })
                .unwrap_or_default();
            let _ = engine.child.kill();
            let killed = Instant::now();
            let served = engine.progress.load(Ordering::SeqCst);
            // The survivors' timers (or their next refusal) refund it; we only watch.
            let refunded = loop {
                if books.snapshot().slot_of(u64::from(engine.pid)).is_none() {
                    break Some(killed.elapsed());
                }
                if killed.elapsed() > bound + Duration::from_secs(5) {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(1));
            };
            let _ = engine.child.wait();
            kill = Some(Kill { served, held, refunded, at: started.elapsed() });
        }
        if engines[victim].child.try_wait().ok().flatten().is_some() && kill.is_none() {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    for engine in &mut engines {
        if engine.index != victim {
            let _ = engine.child.wait();
        }
    }
    watching.store(false, Ordering::SeqCst);
    let watched = watcher.join().map_err(|_| "the watcher panicked")?;
    let mut results = BTreeMap::new();
    for engine in engines {
        let _ = engine.reader.join();
        let result = engine.result.lock().unwrap_or_else(PoisonError::into_inner).take();
        results.insert(engine.index, (engine.pid, result));
    }
    // The survivors left; nothing should remain (a last scan settles a slot of an
    // engine that exited without leaving).
    let _ = books.refund_dead();
    let end = books.snapshot();
    Ok(report(config, &books, &path, &results, victim, kill.as_ref(), &watched, &end, bound, started.elapsed()))
}

struct Engine {
    index: usize,
    pid: u32,
    child: Child,
    progress: Arc<AtomicU64>,
    result: Arc<Mutex<Option<serde_json::Value>>>,
    reader: std::thread::JoinHandle<()>,
}

struct Kill {
    served: u64,
    held: Vec<(String, u64)>,
    refunded: Option<Duration>,
    at: Duration,
}

#[derive(Default)]
struct Watched {
    samples: u64,
    consistent: u64,
    highest: BTreeMap<String, (u64, Option<u64>)>,
    over: Vec<String>,
}

fn watch(books: &NodeBooks, watching: &AtomicBool) -> Watched {
    let mut watched = Watched::default();
    while watching.load(Ordering::SeqCst) {
        let snapshot = books.snapshot();
        watched.samples += 1;
        if snapshot.consistent {
            watched.consistent += 1;
            for device in &snapshot.devices {
                let entry = watched.highest.entry(device.device.clone()).or_insert((0, device.limit));
                entry.0 = entry.0.max(device.granted);
                if device.limit.is_some_and(|limit| device.granted > limit) && watched.over.len() < 5 {
                    watched.over.push(format!("{} granted {} over its limit", device.device, device.granted));
                }
            }
            for tenant in &snapshot.tenants {
                if tenant.quota.is_some_and(|quota| tenant.granted > quota) && watched.over.len() < 5 {
                    watched.over.push(format!("{} on {} granted {}", tenant.tenant, tenant.device, tenant.granted));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    watched
}

#[allow(clippy::too_many_arguments, reason = "one report from the run's parts")]
fn report(
    config: &ProcessesConfig,
    books: &NodeBooks,
    path: &std::path::Path,
    results: &BTreeMap<usize, (u32, Option<serde_json::Value>)>,
    victim: usize,
    kill: Option<&Kill>,
    watched: &Watched,
    end: &NodeSnapshot,
    bound: Duration,
    elapsed: Duration,
) -> ProcessesReport {
    let mut text = String::new();
    let mut failures = Vec::new();
    let _ = writeln!(
        text,
        "memory-demo --processes {}: {} engine processes, each with its own registry and governor, sharing the \
         node books {} ({} simulated devices, {} each; quotas over all processes: {}, platform {})",
        config.processes,
        config.processes,
        path.display(),
        DEVICES.len(),
        mib(DEVICE_BUDGET),
        TENANTS.iter().map(|(t, q)| format!("{t} {}", mib(*q))).collect::<Vec<_>>().join(", "),
        mib(PLATFORM_QUOTA),
    );
    let _ = writeln!(
        text,
        "run: {:.2} s, {} requests per engine, {} threads each",
        elapsed.as_secs_f64(),
        config.requests,
        config.threads
    );
    for (index, (pid, result)) in results {
        if *index == victim {
            match kill {
                Some(kill) => {
                    let held = kill.held.iter().map(|(d, b)| format!("{d} {}", mib(*b))).collect::<Vec<_>>().join(", ");
                    match kill.refunded {
                        Some(after) => {
                            let _ = writeln!(
                                text,
                                "engine {index} (pid {pid}): killed with SIGKILL at {:.2} s, {} of {} requests in, \
                                 holding node grants {held}; a survivor refunded its slot {:.1} ms later (bound {} ms)",
                                kill.at.as_secs_f64(),
                                kill.served,
                                config.requests,
                                after.as_secs_f64() * 1e3,
                                bound.as_millis()
                            );
                            if after > bound + Duration::from_millis(500) {
                                failures
                                    .push(format!("engine {index}'s grants came back after {after:?}, past {bound:?}"));
                            }
                        }
                        None => failures.push(format!("engine {index} was killed but its slot was never refunded")),
                    }
                }
                None => failures.push(format!("engine {index} ended before it could be killed")),
            }
            continue;
        }
        let Some(result) = result else {
            failures.push(format!("engine {index} (pid {pid}) reported nothing"));
            continue;
        };
        let number = |key: &str| result[key].as_u64().unwrap_or(0);
        let _ = writeln!(
            text,
            "engine {index} (pid {pid}): served {}, refused {} ({}); {} allocations, {} released; {} node grants \
             ({} drawn, {} given back), {} refused by the node; peak local limits {}",
            number("served"),
            number("refused"),
            result["refusals"].as_str().unwrap_or(""),
            number("allocations"),
            number("released"),
            number("grants"),
            mib(number("granted_bytes")),
            mib(number("given_back_bytes")),
            number("node_refusals"),
            result["peak_limits"].as_str().unwrap_or(""),
        );
        if result["exact"] != true {
            failures.push(format!("engine {index}'s books were not exact at the end: {result}"));
        }
    }
    let highest = watched
        .highest
        .iter()
        .map(|(device, (granted, limit))| format!("{device} {} of {}", mib(*granted), limit.map_or("none".into(), mib)))
        .collect::<Vec<_>>()
        .join(", ");
    let _ = writeln!(
        text,
        "node books while running: {} samples ({} consistent); highest granted {highest}; {}",
        watched.samples,
        watched.consistent,
        if watched.over.is_empty() { "never over a limit or a quota".to_owned() } else { watched.over.join("; ") }
    );
    failures.extend(watched.over.iter().cloned());
    if watched.consistent == 0 {
        failures.push("the watcher saw no consistent sample of the books".to_owned());
    }
    // The cross-process check.
    let _ = writeln!(text, "nothing-lost check across processes:");
    for (index, (_, result)) in results {
        if *index == victim {
            continue;
        }
        if let Some(result) = result {
            let _ = writeln!(
                text,
                "  engine {index}: {} allocations = {} released + 0 live, nothing charged at the end, local limits = \
                 node grants, slot freed: {}",
                result["allocations"].as_u64().unwrap_or(0),
                result["released"].as_u64().unwrap_or(0),
                if result["exact"] == true { "yes" } else { "NO" }
            );
        }
    }
    if let Some(kill) = kill {
        let _ = writeln!(
            text,
            "  engine {victim} (killed): its grants ({}) returned to the node {}",
            mib(kill.held.iter().map(|(_, b)| b).sum()),
            kill.refunded.map_or("NEVER".to_owned(), |d| format!("{:.1} ms after the kill", d.as_secs_f64() * 1e3))
        );
    }
    let granted: u64 =
        end.devices.iter().map(|d| d.granted).sum::<u64>() + end.tenants.iter().map(|t| t.granted).sum::<u64>();
    let _ = writeln!(
        text,
        "  node books after the run: {} granted over every device and tenant, {} slot(s) held ({})",
        mib(granted),
        end.slots.len(),
        if end.consistent { "consistent" } else { "INCONSISTENT" }
    );
    if granted != 0 || !end.slots.is_empty() || !end.consistent {
        failures.push(format!("the node books did not end empty: {}", end.to_json()));
    }
    let _ = books;
    let passed = failures.is_empty();
    for failure in &failures {
        let _ = writeln!(text, "  FAILED: {failure}");
    }
    let _ = writeln!(text, "{}", if passed { "nothing lost across processes" } else { "FAILED" });
    ProcessesReport { text, passed }
}

struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// One device of an engine: the tenants' bindings.
struct EngineDevice {
    key: DeviceKey,
    /// Platform, then the tenants (as [`TENANTS`]).
    authorities: Vec<(String, AuthorityIdentity, MemoryBinding)>,
    /// Their pools (trimmed at the end).
    pools: Vec<Arc<dyn DeviceAllocator>>,
}

/// Runs one engine (a child of the coordinator) and prints its result line.
///
/// # Errors
/// A message when the engine cannot be set up.
pub fn engine(config: &EngineConfig) -> Result<(), String> {
    let books = NodeBooks::open_existing(node_config(&config.books)).map_err(|e| e.to_string())?;
    let registry = BindingRegistry::new();
    let governor = Governor::with_config(GovernorConfig::default().with_credit_chunk(MIB));
    let member = books.join(&governor).map_err(|e| e.to_string())?;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let mut devices = Vec::new();
    let mut weights = Vec::new();
    for key in DEVICES {
        let context = registry
            .register_provider_context(key, Arc::new(format!("engine {} context", config.index)))
            .map_err(|e| err(&e))?;
        let (mut authorities, mut pools) = (Vec::new(), Vec::new());
        let names = std::iter::once("platform").chain(TENANTS.iter().map(|(t, _)| *t));
        for name in names {
            let authority = registry.register_authority(key, Arc::new(name.to_owned())).map_err(|e| err(&e))?;
            governor.open_account(AccountConfig::new(key, authority).with_label(name)).map_err(|e| err(&e))?;
            let system: Arc<dyn DeviceAllocator> = Arc::new(allocator_cpu::SystemAllocator::for_caches(key));
            let pool: Arc<dyn DeviceAllocator> =
                Arc::new(allocator_cpu::PooledAllocator::new(governor.cache_backing(system)));
            pools.push(Arc::clone(&pool));
            let governed = governor.govern(pool, authority).map_err(|e| err(&e.failure))?;
            let mechanism =
                registry.register_allocator(&context, &authority, Arc::new(governed)).map_err(|e| err(&e))?;
            authorities.push((name.to_owned(), authority, registry.bind_registered(&mechanism).map_err(|e| err(&e))?));
        }
        // Weights can never be squeezed out by KV growth; the rest reclaims, then fails.
        let policy =
            GuaranteedReserve::new(Arc::new(ReclaimThenFail)).with_reserve(MemoryRole::Weights, ENGINE_WEIGHTS);
        member.govern_device(key, Arc::new(policy)).map_err(|e| err(&e))?;
        for (name, authority, _) in &authorities {
            member.bind_tenant(*authority, name).map_err(|e| err(&e))?;
        }
        let request =
            AllocationRequest::new(ENGINE_WEIGHTS as usize, 4096).map_err(|e| err(&e))?.with_role(MemoryRole::Weights);
        weights.push(authorities[0].2.allocate(request).map_err(|e| err(&e))?);
        devices.push(EngineDevice { key, authorities, pools });
    }
    let next = AtomicU64::new(0);
    let served = AtomicU64::new(0);
    // The weights count as one allocation per device.
    let (allocations, released) = (AtomicU64::new(devices.len() as u64), AtomicU64::new(0));
    let refusals: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());
    let peak_limits: Mutex<BTreeMap<DeviceKey, u64>> = Mutex::new(BTreeMap::new());
    std::thread::scope(|scope| {
        for _ in 0..config.threads {
            scope.spawn(|| {
                loop {
                    let id = next.fetch_add(1, Ordering::SeqCst);
                    if id >= config.requests {
                        break;
                    }
                    let mut rng = rand::rngs::StdRng::seed_from_u64(config.seed ^ ((config.index as u64) << 48) ^ id);
                    let device = &devices[rng.random_range(0..devices.len())];
                    let (_, _, binding) = &device.authorities[1 + rng.random_range(0..TENANTS.len())];
                    let mut blocks = Vec::new();
                    let mut refused = None;
                    // A sequence: KV pages as it grows, activations and workspace per step.
                    for step in 0..rng.random_range(4..16u32) {
                        let (bytes, role) = match step % 3 {
                            0 | 1 => (256 << 10, MemoryRole::KvCache),
                            _ => (rng.random_range(1..4usize) << 20, MemoryRole::Activations),
                        };
                        let Ok(request) = AllocationRequest::new(bytes, 256).map(|r| r.with_role(role)) else {
                            continue;
                        };
                        match binding.allocate(request) {
                            Ok(block) => {
                                allocations.fetch_add(1, Ordering::SeqCst);
                                blocks.push(block);
                            }
                            Err(error) => {
                                let text = error.to_string();
                                refused = Some(if text.contains("authority quota") {
                                    "tenant quota"
                                } else if text.contains("device limit") {
                                    "device limit"
                                } else {
                                    "other"
                                });
                                break;
                            }
                        }
                        std::thread::sleep(Duration::from_micros(rng.random_range(50..400)));
                    }
                    if let Some(limit) = governor.device_limit(device.key) {
                        let mut peaks = peak_limits.lock().unwrap_or_else(PoisonError::into_inner);
                        let peak = peaks.entry(device.key).or_insert(0);
                        *peak = (*peak).max(limit);
                    }
                    for block in blocks {
                        if binding.release(block).is_ok() {
                            released.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    match refused {
                        Some(reason) => {
                            *refusals.lock().unwrap_or_else(PoisonError::into_inner).entry(reason).or_insert(0) += 1;
                        }
                        None => {
                            served.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    let done = id + 1;
                    if done.is_multiple_of(20) {
                        println!("served {done}");
                    }
                }
            });
        }
    });
    for (device, block) in devices.iter().zip(weights) {
        if device.authorities[0].2.release(block).is_ok() {
            released.fetch_add(1, Ordering::SeqCst);
        }
    }
    // The pools give their idle memory back, so the process holds nothing.
    for device in &devices {
        for pool in &device.pools {
            pool.trim();
        }
    }
    let _ = governor.return_idle_credit();
    let exact = exact_books(&books, &governor, &member, &devices);
    let stats = member.stats();
    let held = governor.snapshot();
    let report = member.leave();
    if !report.slot_freed {
        eprintln!("engine {} left holding {report:?}: {}", config.index, held.to_json());
    }
    let refusals = refusals.into_inner().unwrap_or_else(PoisonError::into_inner);
    let result = serde_json::json!({
        "served": served.load(Ordering::SeqCst),
        "refused": refusals.values().sum::<u64>(),
        "refusals": refusals.iter().map(|(r, n)| format!("{r} {n}")).collect::<Vec<_>>().join(", "),
        "allocations": allocations.load(Ordering::SeqCst),
        "released": released.load(Ordering::SeqCst),
        "grants": stats.grants,
        "granted_bytes": stats.granted_bytes,
        "given_back_bytes": stats.given_back_bytes,
        "node_refusals": stats.refusals,
        "peak_limits": peak_limits.into_inner().unwrap_or_else(PoisonError::into_inner).iter()
            .map(|(d, b)| format!("{d} {}", mib(*b))).collect::<Vec<_>>().join(", "),
        "exact": exact && report.slot_freed && allocations.load(Ordering::SeqCst) == released.load(Ordering::SeqCst),
    });
    println!("RESULT {result}");
    Ok(())
}

/// Whether the engine's books are exact at its end: nothing charged on any device or
/// account, and every local limit and quota equal to its node grant in the slot. (The
/// member's timer may be giving surplus back while we look: look again until a look
/// falls between two of its changes, a few times at most.)
fn exact_books(books: &NodeBooks, governor: &Governor, member: &memory_node::Member, devices: &[EngineDevice]) -> bool {
    let pid = u64::from(std::process::id());
    (0..200).any(|_| {
        let snapshot = governor.snapshot();
        let node = books.snapshot();
        let Some(slot) = node.slot_of(pid) else { return false };
        let charged_nothing = devices.iter().all(|device| {
            snapshot.device(device.key).is_some_and(|d| d.current == 0 && d.authorities.iter().all(|a| a.current == 0))
        });
        let limits_are_grants = devices.iter().all(|device| {
            let name = device.key.to_string();
            let slot_device =
                slot.budgets.iter().find(|b| b.device == name && b.tenant.is_none()).map_or(0, |b| b.granted);
            governor.device_limit(device.key) == member.device_grant(device.key)
                && member.device_grant(device.key) == Some(slot_device)
                && device.authorities.iter().all(|(tenant, authority, _)| {
                    let slot_tenant = slot
                        .budgets
                        .iter()
                        .find(|b| b.device == name && b.tenant.as_deref() == Some(tenant))
                        .map_or(0, |b| b.granted);
                    member.tenant_grant(*authority) == Some(slot_tenant)
                        && governor.account(*authority).ok().and_then(|a| a.quota()) == Some(slot_tenant)
                })
        });
        let exact = charged_nothing && limits_are_grants;
        if !exact {
            std::thread::sleep(Duration::from_millis(2));
        }
        exact
    })
}
