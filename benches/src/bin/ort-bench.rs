//! `cargo xtask bench --ort`: per real model and workload, latency (p50, p99) and peak
//! resident memory of four ways to give ONNX Runtime its CPU memory, as ratios against
//! (a):
//!
//! - (a) `arena`: ONNX Runtime's default CPU arena (stock session);
//! - (b) `no-arena`: ONNX Runtime's CPU allocator without its arena;
//! - (c) `governed-pool`: memory-ort over a governed `PooledAllocator`;
//! - (d) `governed-system`: memory-ort over a governed `SystemAllocator`.
//!
//! The workloads: a Silero VAD stream; PP-OCRv4 detection on one page size; and the
//! varying-shape sweeps, where ONNX Runtime plans memory anew for every input shape:
//! PP-OCRv4 recognition over text-line widths 80..800 at batch 1 and 2, PP-OCRv4
//! detection over page sizes, and the PP-OCR direction classifier over batch sizes. A
//! sweep's latencies are those of its single runs (every shape equally often in every
//! configuration), and its peak resident memory is the process's over the whole sweep.
//! The ratio columns compare like with like: each run's latency is divided by the
//! baseline's median for the same input, and the p50 (p99) of those quotients is
//! divided by the baseline's own (for fixed-size work, the plain ratio of p50s);
//! otherwise which shape happens to sit at a sweep's median would decide its ratio.
//!
//! Each (model, configuration) is measured in a child process of its own (this binary
//! with `--child`), so its peak resident memory (`VmHWM`) is its own; the children run
//! in rotating order, round after round, so the configurations alternate in one run.
//! Each child also counts the minor page faults of its timed runs: a figure that load
//! on the machine does not disturb, and the first thing to look at when a
//! configuration is slower (an allocator that hands large blocks back to the system
//! and gets fresh ones every run pays a fault per page touched).
//!
//! Options: `--rounds N`, `--vad-iters N`, `--ocr-iters N` (runs of the fixed-size
//! page), `--sweeps N` (timed passes over each sweep), `--models a,b` and
//! `--configs a,b` (a subset, or the extra configurations below; the first
//! configuration is the baseline of the ratios), and `--trace MODEL CONFIG`, which runs
//! one child and prints, run by run, the shape, the requests above 1 MiB that reached
//! the allocator under the governor, the pool's segments and the resident memory.
//!
//! Extra configurations, for the question of what the adapter should ask for or give
//! back when shapes vary (none is the default of anything):
//! - `arena-nopattern`, `governed-pool-nopattern`: the session's memory pattern off
//!   (ONNX Runtime then allocates each buffer on its own instead of one planned block
//!   per shape);
//! - `governed-pool-trim-shape`: the pool trimmed (`DeviceAllocator::trim`) before a
//!   run whose input shape differs from the previous run's;
//! - `governed-pool-trim-new`: the pool trimmed after the first run of each input shape
//!   (the run in which ONNX Runtime allocates every buffer on its own to plan the
//!   shape's memory; later runs of the shape ask for one planned block instead, so
//!   what the pool cached from the first run is never asked for again);
//! - `governed-pool-trim-grow`: as `-trim-new`, and the pool also trimmed before a
//!   request of 1 MiB or more larger than any before it (no cached segment can serve
//!   it, so the idle ones only add to the footprint);
//! - `governed-pool-trim-run`: the pool trimmed after every run (what an ONNX Runtime
//!   `Shrink` after each run would do);
//! - `governed-pool-pow2`: requests of 1 MiB and more rounded up to a power of two
//!   before they reach the pool (charged as rounded), so one cached block serves
//!   nearby shapes, as the arena's power-of-two extension does;
//! - `governed-pool-cap16`: the pool's cache capped at 16 MiB.
//!
//! Target: (c) p50 <= 1.0x (a), and (c) peak RSS no higher than (a), on every model and
//! sweep.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use allocator_cpu::{PoolConfig, PooledAllocator, SystemAllocator};
use memory_governor::{
    AccountConfig, AllocError, AllocationRequest, AllocatorStats, BindingRegistry, DeviceAllocator, DeviceKey,
    Governor, RawAllocation, ReleaseOutcome,
};
use memory_ort::workloads::{
    Infer, OCR_CLS_WIDTH, VadStream, classify_direction, detect_text, ocr_image, ocr_lines, recognize_text,
};
use memory_ort::{GovernedOrtAllocator, OrtAllocatorConfig, OrtAssets, OrtEnvironment};

/// The configurations of a default run; the first is the baseline.
const CONFIGS: [&str; 4] = ["arena", "no-arena", "governed-pool", "governed-system"];
/// The configurations `--configs` also accepts.
const EXTRA_CONFIGS: [&str; 8] = [
    "arena-nopattern",
    "governed-pool-nopattern",
    "governed-pool-trim-shape",
    "governed-pool-trim-new",
    "governed-pool-trim-grow",
    "governed-pool-trim-run",
    "governed-pool-pow2",
    "governed-pool-cap16",
];

/// The fixed page size of `pp-ocrv4-det`.
const OCR_SIZE: (usize, usize) = (480, 640);
/// `pp-ocrv4-rec-sweep`: (batch, width), up the widths at batch 1, down at batch 2.
const REC_SWEEP: [(usize, usize); 12] = [
    (1, 80),
    (1, 160),
    (1, 320),
    (1, 480),
    (1, 640),
    (1, 800),
    (2, 800),
    (2, 640),
    (2, 480),
    (2, 320),
    (2, 160),
    (2, 80),
];
/// `pp-ocrv4-det-sweep`: (height, width) of the pages, up and back down.
const DET_SWEEP: [(usize, usize); 8] =
    [(160, 160), (224, 320), (320, 480), (480, 640), (640, 640), (480, 640), (320, 480), (224, 320)];
/// `pp-ocr-cls-sweep`: batch sizes of 192-wide lines.
const CLS_SWEEP: [usize; 6] = [1, 2, 4, 8, 6, 3];

/// One workload: a model and the inputs of its runs, cycled.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Work {
    /// Silero VAD, one 512-sample chunk per run.
    Vad,
    /// PP-OCRv4 detection on pages of these sizes.
    Det(&'static [(usize, usize)]),
    /// PP-OCRv4 recognition on (batch, width) lines.
    Rec(&'static [(usize, usize)]),
    /// The direction classifier on batches of lines.
    Cls(&'static [usize]),
}

/// A model of the bench: its name, its workload, how many runs warm it up.
struct Model {
    name: &'static str,
    work: Work,
}

const MODELS: [Model; 5] = [
    Model { name: "silero-vad", work: Work::Vad },
    Model { name: "pp-ocrv4-det", work: Work::Det(&[OCR_SIZE]) },
    Model { name: "pp-ocrv4-rec-sweep", work: Work::Rec(&REC_SWEEP) },
    Model { name: "pp-ocrv4-det-sweep", work: Work::Det(&DET_SWEEP) },
    Model { name: "pp-ocr-cls-sweep", work: Work::Cls(&CLS_SWEEP) },
];

impl Work {
    /// Distinct inputs of one pass (the sweep's length; 1 for fixed-size work).
    fn cycle(self) -> usize {
        match self {
            Work::Vad => 1,
            Work::Det(sizes) => sizes.len(),
            Work::Rec(shapes) => shapes.len(),
            Work::Cls(batches) => batches.len(),
        }
    }

    /// Untimed runs first: enough to settle the VAD's state and the arena, and one
    /// whole pass of a sweep (ONNX Runtime's first run of a shape plans its memory).
    fn warm_up(self) -> usize {
        match self {
            Work::Vad => 20,
            _ if self.cycle() == 1 => 2,
            _ => self.cycle(),
        }
    }

    /// The input shape of run `index`, for traces and shape-change trims.
    fn shape(self, index: usize) -> String {
        match self {
            Work::Vad => "chunk".to_owned(),
            Work::Det(sizes) => {
                let (height, width) = sizes[index % sizes.len()];
                format!("{height}x{width}")
            }
            Work::Rec(shapes) => {
                let (batch, width) = shapes[index % shapes.len()];
                format!("{batch}x{width}")
            }
            Work::Cls(batches) => format!("{}x{OCR_CLS_WIDTH}", batches[index % batches.len()]),
        }
    }

    fn path(self, assets: &OrtAssets) -> &std::path::Path {
        match self {
            Work::Vad => &assets.silero_vad,
            Work::Det(_) => &assets.ocr_det,
            Work::Rec(_) => &assets.ocr_rec,
            Work::Cls(_) => &assets.ocr_cls,
        }
    }
}

fn model(name: &str) -> Result<&'static Model, String> {
    MODELS.iter().find(|m| m.name == name).ok_or_else(|| {
        let names: Vec<&str> = MODELS.iter().map(|m| m.name).collect();
        format!("unknown model `{name}`; the models are {}", names.join(", "))
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("--child") => child(&args[1..]),
        Some("--trace") => trace(&args[1..]),
        _ => parent(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("ort-bench: {err}");
            ExitCode::FAILURE
        }
    }
}

fn flag(args: &[String], name: &str, default: usize) -> Result<usize, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .filter(|&v| v > 0)
            .ok_or_else(|| format!("`{name}` expects a whole number of at least 1")),
    }
}

/// A comma-separated list flag, each item checked against `known`.
fn list_flag(
    args: &[String],
    name: &str,
    default: Vec<&'static str>,
    known: &[&'static str],
) -> Result<Vec<&'static str>, String> {
    let Some(i) = args.iter().position(|a| a == name) else { return Ok(default) };
    let value = args.get(i + 1).ok_or_else(|| format!("`{name}` expects a comma-separated list"))?;
    value
        .split(',')
        .map(|item| {
            known
                .iter()
                .copied()
                .find(|k| *k == item)
                .ok_or_else(|| format!("`{name}`: unknown `{item}`; known: {}", known.join(", ")))
        })
        .collect()
}

/// Per (model, configuration): latencies in microseconds, and per child its peak RSS
/// in KiB and the minor faults of its timed runs.
#[derive(Default)]
struct Samples {
    latencies: Vec<u64>,
    /// The input (position in the workload's cycle) of each latency.
    inputs: Vec<usize>,
    peaks: Vec<u64>,
    faults: Vec<u64>,
}

fn parent(args: &[String]) -> Result<(), String> {
    let rounds = flag(args, "--rounds", 3)?;
    let vad_iters = flag(args, "--vad-iters", 400)?;
    let ocr_iters = flag(args, "--ocr-iters", 12)?;
    let sweeps = flag(args, "--sweeps", 2)?;
    let all_models: Vec<&'static str> = MODELS.iter().map(|m| m.name).collect();
    let models = list_flag(args, "--models", all_models.clone(), &all_models)?;
    let known: Vec<&'static str> = CONFIGS.iter().chain(EXTRA_CONFIGS.iter()).copied().collect();
    let configs = list_flag(args, "--configs", CONFIGS.to_vec(), &known)?;
    OrtAssets::locate().map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut samples: BTreeMap<(&str, &str), Samples> = BTreeMap::new();
    let started = Instant::now();
    for round in 0..rounds {
        for &name in &models {
            let work = model(name)?.work;
            let iters = match work {
                Work::Vad => vad_iters,
                _ if work.cycle() == 1 => ocr_iters,
                _ => sweeps * work.cycle(),
            };
            for offset in 0..configs.len() {
                let config = configs[(round + offset) % configs.len()];
                let output = Command::new(&exe)
                    .args(["--child", name, config, &iters.to_string()])
                    .output()
                    .map_err(|e| format!("cannot start a child: {e}"))?;
                let stdout = String::from_utf8_lossy(&output.stdout);
                if !output.status.success() {
                    return Err(format!(
                        "child {name} {config} failed: {}{}",
                        stdout,
                        String::from_utf8_lossy(&output.stderr)
                    ));
                }
                let line = stdout.lines().find(|l| l.starts_with("result ")).ok_or("a child printed no result")?;
                let mut fields = line.split_whitespace().skip(1);
                let hwm: u64 = fields.next().and_then(|v| v.parse().ok()).ok_or("bad result line")?;
                let faulted: u64 = fields.next().and_then(|v| v.parse().ok()).ok_or("bad result line")?;
                let entry = samples.entry((name, config)).or_default();
                entry.peaks.push(hwm);
                entry.faults.push(faulted);
                let timed: Vec<u64> = fields.filter_map(|v| v.parse::<u64>().ok()).collect();
                entry.inputs.extend((0..timed.len()).map(|i| (work.warm_up() + i) % work.cycle()));
                entry.latencies.extend(timed);
            }
        }
        eprintln!("ort-bench: round {}/{rounds} done ({:.0} s)", round + 1, started.elapsed().as_secs_f64());
    }
    println!(
        "\n## ort bench: {rounds} rounds, configurations alternating; each (model, config) in its own process \
         (sweeps: {sweeps} timed passes each, peak RSS over the whole sweep; medians over rounds)"
    );
    println!(
        "\n| model | configuration | runs | p50 ms | p99 ms | peak RSS MiB | faults/run | p50 vs (a) | p99 vs (a) | peak \
         RSS vs (a) |"
    );
    println!(
        "|-------|---------------|-----:|-------:|-------:|-------------:|-----------:|-----------:|-----------:|\
         ----------------:|"
    );
    let mut verdicts = Vec::new();
    for &name in &models {
        let base = &samples[&(name, configs[0])];
        let base_medians = base.medians_by_input();
        let base_normal = base.normalised(&base_medians);
        let (base_p50, base_p99) = (percentile_f(&base_normal, 0.5), percentile_f(&base_normal, 0.99));
        let base_rss = median(&base.peaks);
        for (index, config) in configs.iter().enumerate() {
            let s = &samples[&(name, *config)];
            let normal = s.normalised(&base_medians);
            let (p50_ms, p99_ms) = (percentile(&s.latencies, 0.5), percentile(&s.latencies, 0.99));
            let (p50, p99) = (percentile_f(&normal, 0.5), percentile_f(&normal, 0.99));
            let rss = median(&s.peaks);
            let iters = s.latencies.len() as f64 / s.peaks.len() as f64;
            let faults_per_run = median(&s.faults) as f64 / iters;
            let label = format!("({}) {config}", (b'a' + index as u8) as char);
            println!(
                "| {name} | {label} | {} | {:.3} | {:.3} | {:.1} | {:.1} | {:.3}x | {:.3}x | {:.3}x |",
                s.latencies.len(),
                p50_ms / 1e3,
                p99_ms / 1e3,
                rss as f64 / 1024.0,
                faults_per_run,
                p50 / base_p50,
                p99 / base_p99,
                rss as f64 / base_rss as f64
            );
            if *config == "governed-pool" && configs[0] == "arena" {
                verdicts.push(format!(
                    "{name}: {label} p50 {:.3}x (a) [target <= 1.00x: {}], peak RSS {:.3}x (a) [target <= 1.00x: {}]",
                    p50 / base_p50,
                    if p50 <= base_p50 { "met" } else { "missed" },
                    rss as f64 / base_rss as f64,
                    if rss <= base_rss { "met" } else { "missed" }
                ));
            }
        }
    }
    println!();
    for verdict in verdicts {
        println!("{verdict}");
    }
    Ok(())
}

/// A log of request sizes.
type Log = Arc<Mutex<Vec<usize>>>;

/// What a child needs besides its session: the pool (for trims and traces) and the
/// request logs above the pool (what the adapter asked for, let through by the
/// governor) and below it (what reached the system allocator).
#[derive(Default)]
struct Handles {
    pool: Option<Arc<PooledAllocator<Probe<SystemAllocator>>>>,
    above: Option<Log>,
    below: Option<Log>,
}

/// One child's session and workload: `run(index)` runs input `index` of the cycle.
struct Bench {
    run: Box<dyn FnMut(usize) -> Result<(), String>>,
    handles: Handles,
}

fn build(name: &str, config: &str) -> Result<Bench, String> {
    let work = model(name)?.work;
    let assets = OrtAssets::locate().map_err(|e| e.to_string())?;
    let env = OrtEnvironment::load(&assets.library).map_err(|e| e.to_string())?;
    let path = work.path(&assets);
    let pattern = !config.ends_with("-nopattern");
    match config {
        "arena" | "no-arena" | "arena-nopattern" => {
            let session = if pattern {
                env.plain_session(path, config != "no-arena", true).map_err(|e| e.to_string())?
            } else {
                // The stock session (the arena, prepacking on) with the memory pattern off.
                env.session_builder()
                    .map_err(|e| e.to_string())?
                    .with_memory_pattern(false)
                    .map_err(|e| e.to_string())?
                    .commit_from_file(path)
                    .map_err(|e| e.to_string())?
            };
            Ok(Bench { run: workload(work, session), handles: Handles::default() })
        }
        _ if config.starts_with("governed-") => {
            let mut handles = Handles::default();
            let inner: Arc<dyn DeviceAllocator> = if config == "governed-system" {
                Arc::new(SystemAllocator::new())
            } else {
                let (above, below): (Log, Log) = Default::default();
                let pool_config = if config == "governed-pool-cap16" {
                    PoolConfig::default().with_max_cached_bytes(16 << 20)
                } else {
                    PoolConfig::default()
                };
                let pool = Arc::new(PooledAllocator::with_config(
                    Probe { inner: SystemAllocator::new(), log: Arc::clone(&below) },
                    pool_config,
                ));
                handles.pool = Some(Arc::clone(&pool));
                (handles.above, handles.below) = (Some(Arc::clone(&above)), Some(below));
                let pool: Arc<dyn DeviceAllocator> = pool;
                if config == "governed-pool-pow2" {
                    Arc::new(PowerOfTwo { inner: pool, log: above })
                } else if config == "governed-pool-trim-grow" {
                    let trimmed = Arc::clone(handles.pool.as_ref().expect("set above"));
                    Arc::new(TrimOnGrowth { inner: pool, log: above, pool: trimmed, largest: AtomicUsize::new(0) })
                } else {
                    Arc::new(Probe { inner: pool, log: above })
                }
            };
            let registry = BindingRegistry::new();
            let governor = Governor::new();
            let context =
                registry.register_provider_context(DeviceKey::HOST, Arc::new("bench")).map_err(|e| e.to_string())?;
            let tenant = registry.register_authority(DeviceKey::HOST, Arc::new("bench")).map_err(|e| e.to_string())?;
            let account = governor
                .open_account(AccountConfig::new(DeviceKey::HOST, tenant).with_quota(4 << 30))
                .map_err(|e| e.to_string())?;
            let governed = governor.govern(inner, tenant).map_err(|e| e.to_string())?;
            let mechanism =
                registry.register_allocator(&context, &tenant, Arc::new(governed)).map_err(|e| e.to_string())?;
            let binding = registry.bind_registered(&mechanism).map_err(|e| e.to_string())?;
            let allocator = GovernedOrtAllocator::cpu(&env, binding, Some(account), OrtAllocatorConfig::default())
                .map_err(|e| e.to_string())?;
            let builder = env
                .session_builder()
                .map_err(|e| e.to_string())?
                .with_memory_pattern(pattern)
                .map_err(|e| e.to_string())?;
            let session = env.commit_from_file(&allocator, builder, path).map_err(|e| e.to_string())?;
            // The registry and governor must outlive the session: keep them in the closure.
            let keep = (registry, governor);
            let mut run = workload(work, session);
            let pool = handles.pool.clone();
            let mut previous: Option<String> = None;
            let mut seen = std::collections::BTreeSet::new();
            let trim_shape = config == "governed-pool-trim-shape";
            let trim_new = config == "governed-pool-trim-new" || config == "governed-pool-trim-grow";
            let trim_run = config == "governed-pool-trim-run";
            Ok(Bench {
                run: Box::new(move |index| {
                    let _ = &keep;
                    let shape = work.shape(index);
                    if trim_shape
                        && previous.as_ref().is_some_and(|p| *p != shape)
                        && let Some(pool) = &pool
                    {
                        pool.trim();
                    }
                    run(index)?;
                    let first_of_shape = seen.insert(shape.clone());
                    if (trim_run || (trim_new && first_of_shape))
                        && let Some(pool) = &pool
                    {
                        pool.trim();
                    }
                    previous = Some(shape);
                    Ok(())
                }),
                handles,
            })
        }
        other => Err(format!("unknown configuration {other}")),
    }
}

fn child(args: &[String]) -> Result<(), String> {
    let [name, config, iters] = args else { return Err("usage: --child MODEL CONFIG ITERS".to_owned()) };
    let iters: usize = iters.parse().map_err(|_| "ITERS is a number")?;
    let work = model(name)?.work;
    let mut bench = build(name, config)?;
    let warm_up = work.warm_up();
    for index in 0..warm_up {
        (bench.run)(index)?;
    }
    let mut micros = Vec::with_capacity(iters);
    let faults_before = minor_faults().ok_or("no fault count in /proc/self/stat")?;
    for index in warm_up..warm_up + iters {
        let started = Instant::now();
        (bench.run)(index)?;
        micros.push(started.elapsed().as_micros() as u64);
    }
    let faulted = minor_faults().ok_or("no fault count in /proc/self/stat")? - faults_before;
    drop(bench);
    let hwm = proc_status_kib("VmHWM:").ok_or("no VmHWM in /proc/self/status")?;
    let list: Vec<String> = micros.iter().map(u64::to_string).collect();
    println!("result {hwm} {faulted} {}", list.join(" "));
    Ok(())
}

/// `--trace MODEL CONFIG [PASSES]`: one child's runs, one line each.
fn trace(args: &[String]) -> Result<(), String> {
    let (name, config) = match args {
        [name, config, ..] => (name, config),
        _ => return Err("usage: --trace MODEL CONFIG [PASSES]".to_owned()),
    };
    let passes: usize = args.get(2).map_or(Ok(2), |v| v.parse().map_err(|_| "PASSES is a number"))?;
    let work = model(name)?.work;
    let mut bench = build(name, config)?;
    println!("# {name} {config}, per run: its time; the requests that reached the pool (what the adapter asked for,");
    println!("# let through by the governor) and those that reached the system below it: count, and those of >= 1 MiB");
    println!("# in MiB; the pool's segments after the run (count, MiB, of which cached MiB); resident and peak MiB");
    let mib = |bytes: usize| bytes as f64 / f64::from(1 << 20);
    let lengths = |handles: &Handles| {
        let len = |log: &Option<Log>| log.as_ref().map_or(0, |log| log.lock().map_or(0, |l| l.len()));
        (len(&handles.above), len(&handles.below))
    };
    let since = |log: &Option<Log>, from: usize| -> String {
        let Some(log) = log else { return "-".to_owned() };
        let log = log.lock().map(|l| l[from..].to_vec()).unwrap_or_default();
        let large: Vec<usize> = log.iter().copied().filter(|&b| b >= 1 << 20).collect();
        let total = mib(large.iter().sum());
        let max = mib(large.iter().copied().max().unwrap_or(0));
        format!("{:>3} req, {:>3} >= 1 MiB: {total:>5.1} MiB, max {max:>4.1}", log.len(), large.len())
    };
    for index in 0..passes * work.cycle() {
        let (above, below) = lengths(&bench.handles);
        let started = Instant::now();
        (bench.run)(index)?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let pool = bench.handles.pool.as_ref().map_or_else(String::new, |pool| {
            let s = pool.pool_stats();
            format!(
                "segments {} {:.1} cached {:.1}",
                s.segments,
                mib(s.segment_bytes as usize),
                mib(s.cached_bytes as usize)
            )
        });
        println!(
            "run {index:>3} {:>8} {ms:>7.1} ms | pool {} | system {} | {pool} | rss {:.1} hwm {:.1}",
            work.shape(index),
            since(&bench.handles.above, above),
            since(&bench.handles.below, below),
            proc_status_kib("VmRSS:").unwrap_or(0) as f64 / 1024.0,
            proc_status_kib("VmHWM:").unwrap_or(0) as f64 / 1024.0,
        );
    }
    for (what, log) in [("pool", &bench.handles.above), ("system", &bench.handles.below)] {
        let Some(log) = log else { continue };
        let log = log.lock().map(|l| l.clone()).unwrap_or_default();
        let buckets: [(usize, &str); 5] = [
            (64 << 10, "< 64 KiB"),
            (1 << 20, "< 1 MiB"),
            (4 << 20, "< 4 MiB"),
            (16 << 20, "< 16 MiB"),
            (usize::MAX, ">= 16 MiB"),
        ];
        let counts: Vec<String> = buckets
            .iter()
            .enumerate()
            .map(|(i, (below, label))| {
                let above = if i == 0 { 0 } else { buckets[i - 1].0 };
                let sizes: Vec<usize> = log.iter().copied().filter(|b| *b >= above && *b < *below).collect();
                format!("{label}: {} ({:.1} MiB)", sizes.len(), mib(sizes.iter().sum()))
            })
            .collect();
        println!("# requests that reached the {what}, by size: {}", counts.join(", "));
    }
    if let Some(pool) = &bench.handles.pool {
        println!("# the pool at the end: {:?}", pool.pool_stats());
    }
    Ok(())
}

/// Records the size of every request it passes on (the requests the governor let
/// through: what the adapter asked for, or what reached the system below the pool).
struct Probe<A> {
    inner: A,
    log: Log,
}

impl<A: DeviceAllocator> DeviceAllocator for Probe<A> {
    fn device(&self) -> DeviceKey {
        self.inner.device()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        if let Ok(mut log) = self.log.lock() {
            log.push(request.bytes());
        }
        self.inner.allocate(request)
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.inner.release(allocation)
    }
    fn stats(&self) -> Option<AllocatorStats> {
        self.inner.stats()
    }
    fn trim(&self) -> usize {
        self.inner.trim()
    }
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        self.inner.forget_lost(lost);
    }
}

/// Trims the pool before a request of 1 MiB or more that is larger than every request
/// before it, and logs requests as `Probe` does.
struct TrimOnGrowth<A> {
    inner: A,
    log: Log,
    pool: Arc<PooledAllocator<Probe<SystemAllocator>>>,
    largest: AtomicUsize,
}

impl<A: DeviceAllocator> DeviceAllocator for TrimOnGrowth<A> {
    fn device(&self) -> DeviceKey {
        self.inner.device()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        if let Ok(mut log) = self.log.lock() {
            log.push(request.bytes());
        }
        if request.bytes() >= 1 << 20 && self.largest.fetch_max(request.bytes(), Ordering::Relaxed) < request.bytes() {
            self.pool.trim();
        }
        self.inner.allocate(request)
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.inner.release(allocation)
    }
    fn stats(&self) -> Option<AllocatorStats> {
        self.inner.stats()
    }
    fn trim(&self) -> usize {
        self.inner.trim()
    }
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        self.inner.forget_lost(lost);
    }
}

/// Rounds requests of 1 MiB and more up to a power of two before the pool sees them
/// (the block, and so the charge, is the rounded size), and logs them as `Probe` does.
struct PowerOfTwo<A> {
    inner: A,
    log: Log,
}

impl<A: DeviceAllocator> DeviceAllocator for PowerOfTwo<A> {
    fn device(&self) -> DeviceKey {
        self.inner.device()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        if let Ok(mut log) = self.log.lock() {
            log.push(request.bytes());
        }
        if request.bytes() >= 1 << 20
            && let Some(rounded) = request.bytes().checked_next_power_of_two()
            && let Ok(bigger) = AllocationRequest::new(rounded, request.align())
        {
            return self.inner.allocate(&bigger.with_role(request.role()));
        }
        self.inner.allocate(request)
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.inner.release(allocation)
    }
    fn stats(&self) -> Option<AllocatorStats> {
        self.inner.stats()
    }
    fn trim(&self) -> usize {
        self.inner.trim()
    }
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        self.inner.forget_lost(lost);
    }
}

/// Run `index` of `work` against `session`, as a closure.
fn workload<S: Infer + 'static>(work: Work, mut session: S) -> Box<dyn FnMut(usize) -> Result<(), String>> {
    match work {
        Work::Vad => {
            let mut stream = VadStream::new(1);
            Box::new(move |_| {
                let chunk = stream.next_chunk();
                stream.step(&mut session, &chunk).map(|_| ()).map_err(|e| e.to_string())
            })
        }
        Work::Det(sizes) => Box::new(move |index| {
            let (height, width) = sizes[index % sizes.len()];
            detect_text(&mut session, ocr_image(index as u64, height, width), height, width)
                .map(|_| ())
                .map_err(|e| e.to_string())
        }),
        Work::Rec(shapes) => Box::new(move |index| {
            let (batch, width) = shapes[index % shapes.len()];
            recognize_text(&mut session, ocr_lines(index as u64, batch, width), batch, width)
                .map(|_| ())
                .map_err(|e| e.to_string())
        }),
        Work::Cls(batches) => Box::new(move |index| {
            let batch = batches[index % batches.len()];
            classify_direction(&mut session, ocr_lines(index as u64, batch, OCR_CLS_WIDTH), batch)
                .map(|_| ())
                .map_err(|e| e.to_string())
        }),
    }
}

/// A `kB` figure of `/proc/self/status` (`VmHWM:`, `VmRSS:`).
fn proc_status_kib(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Minor page faults of this process so far (`minflt`, the 10th field of
/// `/proc/self/stat`, counted after the command name's closing parenthesis).
fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after_name = stat.get(stat.rfind(')')? + 1..)?;
    after_name.split_whitespace().nth(7)?.parse().ok()
}

impl Samples {
    /// The baseline's median latency of each input of the cycle.
    fn medians_by_input(&self) -> BTreeMap<usize, f64> {
        let mut by_input: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
        for (&latency, &input) in self.latencies.iter().zip(&self.inputs) {
            by_input.entry(input).or_default().push(latency);
        }
        by_input.into_iter().map(|(input, latencies)| (input, percentile(&latencies, 0.5))).collect()
    }

    /// Each latency over the baseline's median for the same input, so a sweep's ratios
    /// compare like with like (for fixed-size work this is a plain ratio).
    fn normalised(&self, medians: &BTreeMap<usize, f64>) -> Vec<f64> {
        self.latencies
            .iter()
            .zip(&self.inputs)
            .map(|(&latency, input)| latency as f64 / medians.get(input).copied().unwrap_or(1.0).max(1.0))
            .collect()
    }
}

fn percentile_f(samples: &[f64], q: f64) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable_by(f64::total_cmp);
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn percentile(samples: &[u64], q: f64) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize] as f64
}

fn median(samples: &[u64]) -> u64 {
    percentile(samples, 0.5) as u64
}
