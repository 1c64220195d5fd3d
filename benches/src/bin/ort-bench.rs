//! `cargo xtask bench --ort`: per real model and workload, latency (p50, p99) and peak
//! resident memory of four ways to give ONNX Runtime its CPU memory, as ratios against
//! (a):
//!
//! - (a) `arena`: ONNX Runtime's default CPU arena (stock session);
//! - (b) `no-arena`: ONNX Runtime's CPU allocator without its arena;
//! - (c) `governed-pool`: memory-ort over a governed `PooledAllocator` that takes its
//!   memory through `Governor::cache_backing` (so the device limit bounds what it
//!   holds, as a governed pool is built);
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
//! Then the **multi-session** case: N sessions of one tenant (N = 2 and 4), each two
//! models (PP-OCRv4 detection, then recognition, per request), each session on a thread
//! of its own and all at once, page sizes and line widths varying by session and
//! request, one intra-op thread per model. (a) `arenas`: every model with ONNX
//! Runtime's own arena (the stock session); (b) `shared-governed-pool`: all 2N models
//! committed with one `GovernedOrtAllocator` over one governed pool (over
//! `Governor::cache_backing`). Each (N, configuration) runs in a child of its own
//! (`--child-multi`), alternating, round after round; the table gives total peak RSS,
//! the resident memory once every model was committed (and the peak above it, what the
//! runs added), p50/p99 per request (each over the baseline's median for the same
//! session and input) and the governor's allocated and reserved peaks. Targets: (b)
//! total peak RSS <= 0.7x (a), p50 <= 1.05x. (`--child-multi N
//! shared-governed-pool-keep-heap REQUESTS` runs (b) with the C heap's free pages kept
//! resident after commits and trims, for comparison.)
//!
//! Options: `--rounds N`, `--vad-iters N`, `--ocr-iters N` (runs of the fixed-size
//! page), `--sweeps N` (timed passes over each sweep), `--sessions 2,4` (the Ns of the
//! multi-session case; `0`: skip it), `--multi-rounds N` (its rounds, default 2),
//! `--multi-requests N` (its timed requests per session, default 12), `--models a,b` and
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
//! - `governed-pool-cap16`: the pool's cache capped at 16 MiB;
//! - `governed-pool-keep-heap`: trims leave the C heap's free pages resident
//!   (`OrtAllocatorConfig::return_free_heap_pages(false)`).
//!
//! Targets: (c) p50 <= 1.0x (a), and (c) peak RSS <= 0.9x (a) (goal 0.8x), on every
//! model and sweep.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use allocator_cpu::{PoolConfig, PooledAllocator, SystemAllocator};
use memory_governor::{
    Account, AccountConfig, AllocError, AllocationRequest, AllocatorStats, AuthorityIdentity, BindingRegistry,
    CacheBacking, DeviceAllocator, DeviceKey, Governor, RawAllocation, ReleaseOutcome,
};
use memory_ort::workloads::{
    Infer, OCR_CLS_WIDTH, VadStream, classify_direction, detect_text, ocr_image, ocr_lines, recognize_text,
};
use memory_ort::{GovernedOrtAllocator, OrtAllocatorConfig, OrtAssets, OrtEnvironment};

/// The configurations of a default run; the first is the baseline.
const CONFIGS: [&str; 4] = ["arena", "no-arena", "governed-pool", "governed-system"];
/// The configurations `--configs` also accepts.
const EXTRA_CONFIGS: [&str; 9] = [
    "arena-nopattern",
    "governed-pool-nopattern",
    "governed-pool-trim-shape",
    "governed-pool-trim-new",
    "governed-pool-trim-grow",
    "governed-pool-trim-run",
    "governed-pool-pow2",
    "governed-pool-cap16",
    "governed-pool-keep-heap",
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

/// The configurations of the multi-session case; the first is the baseline.
const MULTI_CONFIGS: [&str; 2] = ["arenas", "shared-governed-pool"];
/// The multi-session case's page sizes and (batch, width) text lines: session `t`'s
/// request `i` detects text on page `(i + t) % 4` and recognises lines `(i + 2t) % 6`,
/// so the sessions run different shapes at once.
const MULTI_DET: [(usize, usize); 4] = [(224, 320), (320, 480), (480, 640), (320, 480)];
const MULTI_REC: [(usize, usize); 6] = [(1, 160), (1, 320), (1, 640), (2, 320), (1, 800), (2, 160)];
/// Requests after which a session's inputs repeat (and its untimed warm-up: each
/// session sees every shape of its cycle once before the timed requests).
const MULTI_CYCLE: usize = 12;

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

    /// Untimed runs first: enough to settle the VAD's state and the arena, and two
    /// whole passes of a sweep, so every configuration is timed in its steady state.
    /// ONNX Runtime's first run of a shape allocates each buffer on its own to plan the
    /// shape's memory; its second asks for the planned block, which a cache takes from
    /// its source then (the arena grew for the first run's buffers already, a pool that
    /// trimmed them grows now: with one pass, the pool's first timed pass paid the page
    /// faults of that growth, about 180 a run on the classifier's sweep).
    fn warm_up(self) -> usize {
        match self {
            Work::Vad => 20,
            _ if self.cycle() == 1 => 2,
            _ => 2 * self.cycle(),
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
        Some("--child-multi") => child_multi(&args[1..]),
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

/// A comma-separated list of whole numbers (`0` alone: none).
fn numbers_flag(args: &[String], name: &str, default: &[usize]) -> Result<Vec<usize>, String> {
    let Some(i) = args.iter().position(|a| a == name) else { return Ok(default.to_vec()) };
    let value = args.get(i + 1).ok_or_else(|| format!("`{name}` expects a comma-separated list of numbers"))?;
    if value == "0" {
        return Ok(Vec::new());
    }
    value
        .split(',')
        .map(|item| {
            item.parse()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("`{name}`: `{item}` is not a number of at least 1"))
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
    /// Multi-session children of the shared pool: the governor's allocated and
    /// reserved peaks on the device, in bytes.
    booked: Vec<(u64, u64)>,
    /// Multi-session children: resident KiB once every model was committed.
    committed: Vec<u64>,
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
    let multi = numbers_flag(args, "--sessions", &[2, 4])?;
    let multi_requests = flag(args, "--multi-requests", 12)?;
    let multi_rounds = flag(args, "--multi-rounds", 2)?;
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
    let mut multi_samples: BTreeMap<(usize, &str), Samples> = BTreeMap::new();
    for round in 0..if multi.is_empty() { 0 } else { multi_rounds } {
        for &sessions in &multi {
            for offset in 0..MULTI_CONFIGS.len() {
                let config = MULTI_CONFIGS[(round + offset) % MULTI_CONFIGS.len()];
                let output = Command::new(&exe)
                    .args(["--child-multi", &sessions.to_string(), config, &multi_requests.to_string()])
                    .output()
                    .map_err(|e| format!("cannot start a child: {e}"))?;
                let stdout = String::from_utf8_lossy(&output.stdout);
                if !output.status.success() {
                    return Err(format!(
                        "child --child-multi {sessions} {config} failed: {}{}",
                        stdout,
                        String::from_utf8_lossy(&output.stderr)
                    ));
                }
                let line = stdout.lines().find(|l| l.starts_with("result ")).ok_or("a child printed no result")?;
                let fields: Vec<u64> = line.split_whitespace().skip(1).map(|v| v.parse().unwrap_or(0)).collect();
                let [hwm, faulted, committed, allocated, reserved, ref timed @ ..] = fields[..] else {
                    return Err(format!("bad result line: {line}"));
                };
                let entry = multi_samples.entry((sessions, config)).or_default();
                entry.peaks.push(hwm);
                entry.committed.push(committed);
                entry.faults.push(faulted);
                entry.booked.push((allocated, reserved));
                // Pairs of (input, microseconds).
                for pair in timed.chunks_exact(2) {
                    entry.inputs.push(pair[0] as usize);
                    entry.latencies.push(pair[1]);
                }
            }
        }
        eprintln!(
            "ort-bench: multi-session round {}/{multi_rounds} done ({:.0} s)",
            round + 1,
            started.elapsed().as_secs_f64()
        );
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
                let rss_ratio = rss as f64 / base_rss as f64;
                verdicts.push(format!(
                    "{name}: {label} p50 {:.3}x (a) [target <= 1.00x: {}], peak RSS {rss_ratio:.3}x (a) \
                     [target <= 0.90x: {}; goal 0.80x]",
                    p50 / base_p50,
                    if p50 <= base_p50 { "met" } else { "missed" },
                    if rss_ratio <= 0.9 { "met" } else { "missed" }
                ));
            }
        }
    }
    if !multi.is_empty() {
        multi_table(&multi, &multi_samples, multi_rounds, multi_requests, &mut verdicts);
    }
    println!();
    for verdict in verdicts {
        println!("{verdict}");
    }
    Ok(())
}

/// The multi-session table, and its verdicts against the targets (the shared pool's
/// total peak RSS <= 0.7x the arenas', p50 <= 1.05x).
fn multi_table(
    multi: &[usize],
    samples: &BTreeMap<(usize, &str), Samples>,
    rounds: usize,
    requests: usize,
    verdicts: &mut Vec<String>,
) {
    println!(
        "\n## multi-session: N sessions of one tenant, each two models (PP-OCRv4 detection, then recognition, per \
         request) on a thread of its own, at once; page sizes and line widths vary by session and request; intra-op \
         threads 1. (a) every model with ONNX Runtime's own arena, (b) all 2N models over one governed pool (one \
         GovernedOrtAllocator, the pool over Governor::cache_backing). {rounds} rounds, configurations alternating, \
         each (N, configuration) in its own process; {requests} timed requests per session after a warm-up pass"
    );
    println!(
        "\n| N | models | configuration | requests | p50 ms | p99 ms | total peak RSS MiB | RSS at commit MiB | \
         faults/request | governor allocated / reserved peak MiB | p50 vs (a) | p99 vs (a) | total peak RSS vs (a) | \
         peak above commit vs (a) |"
    );
    println!(
        "|--:|-------:|---------------|---------:|-------:|-------:|-------------------:|------------------:|\
         ---------------:|---------------------------------------:|-----------:|-----------:|----------------------:|\
         -------------------------:|"
    );
    for &n in multi {
        let Some(base) = samples.get(&(n, MULTI_CONFIGS[0])) else { continue };
        let base_medians = base.medians_by_input();
        let base_normal = base.normalised(&base_medians);
        let (base_p50, base_p99) = (percentile_f(&base_normal, 0.5), percentile_f(&base_normal, 0.99));
        let base_rss = median(&base.peaks);
        let base_above = base_rss.saturating_sub(median(&base.committed)).max(1);
        for (index, config) in MULTI_CONFIGS.iter().enumerate() {
            let Some(s) = samples.get(&(n, *config)) else { continue };
            let normal = s.normalised(&base_medians);
            let (p50, p99) = (percentile_f(&normal, 0.5) / base_p50, percentile_f(&normal, 0.99) / base_p99);
            let rss = median(&s.peaks);
            let rss_ratio = rss as f64 / base_rss as f64;
            let committed = median(&s.committed);
            let above_ratio = rss.saturating_sub(committed) as f64 / base_above as f64;
            let per_child = s.latencies.len() as f64 / s.peaks.len() as f64;
            let booked = if s.booked.iter().all(|&(allocated, _)| allocated == 0) {
                "-".to_owned()
            } else {
                let allocated: Vec<u64> = s.booked.iter().map(|b| b.0).collect();
                let reserved: Vec<u64> = s.booked.iter().map(|b| b.1).collect();
                format!("{:.1} / {:.1}", mib_of(median(&allocated)), mib_of(median(&reserved)))
            };
            let label = format!("({}) {config}", (b'a' + index as u8) as char);
            println!(
                "| {n} | {} | {label} | {} | {:.3} | {:.3} | {:.1} | {:.1} | {:.1} | {booked} | {p50:.3}x | {p99:.3}x | \
                 {rss_ratio:.3}x | {above_ratio:.3}x |",
                2 * n,
                s.latencies.len(),
                percentile(&s.latencies, 0.5) / 1e3,
                percentile(&s.latencies, 0.99) / 1e3,
                rss as f64 / 1024.0,
                committed as f64 / 1024.0,
                median(&s.faults) as f64 / per_child,
            );
            if index > 0 {
                verdicts.push(format!(
                    "multi-session N = {n}: {label} total peak RSS {rss_ratio:.3}x (a) [target <= 0.70x: {}], \
                     p50 {p50:.3}x (a) [target <= 1.05x: {}]",
                    if rss_ratio <= 0.7 { "met" } else { "missed" },
                    if p50 <= 1.05 { "met" } else { "missed" }
                ));
            }
        }
    }
}

fn mib_of(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

/// A log of request sizes.
type Log = Arc<Mutex<Vec<usize>>>;

/// Logs `bytes` in `log`, when there is one (`--trace` only).
fn note(log: &Option<Log>, bytes: usize) {
    if let Some(Ok(mut log)) = log.as_ref().map(|log| log.lock()) {
        log.push(bytes);
    }
}

/// The governed pool of the `governed-pool*` configurations: over a cache backing,
/// with the requests that reach the backing logged.
type BenchPool = PooledAllocator<Probe<CacheBacking>>;

/// What a child needs besides its session: the pool (for trims and traces) and the
/// request logs above the pool (what the adapter asked for, let through by the
/// governor) and below it (what reached the system allocator).
#[derive(Default)]
struct Handles {
    pool: Option<Arc<BenchPool>>,
    above: Option<Log>,
    below: Option<Log>,
}

/// One child's session and workload: `run(index)` runs input `index` of the cycle.
struct Bench {
    run: Box<dyn FnMut(usize) -> Result<(), String>>,
    handles: Handles,
}

/// Builds a child's session for `config`. With `logged` (`--trace` only), the requests
/// above and below the pool are logged; the timed children log nothing, so what they
/// measure is the allocator stack a runtime would build, with no lock or growing log of
/// the bench's own on its path.
fn build(name: &str, config: &str, logged: bool) -> Result<Bench, String> {
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
            let (registry, governor, tenant, account) = governed_tenant()?;
            let mut handles = Handles::default();
            let inner: Arc<dyn DeviceAllocator> = if config == "governed-system" {
                Arc::new(SystemAllocator::new())
            } else {
                let (above, below): (Log, Log) = Default::default();
                let below_log = logged.then(|| Arc::clone(&below));
                let pool_config = if config == "governed-pool-cap16" {
                    PoolConfig::default().with_max_cached_bytes(16 << 20)
                } else {
                    PoolConfig::default()
                };
                // The pool takes its memory through a cache backing, as a governed pool
                // is built: the device limit bounds what it holds, used and idle.
                let backing = governor.cache_backing(Arc::new(SystemAllocator::for_caches(DeviceKey::HOST)));
                let pool =
                    Arc::new(PooledAllocator::with_config(Probe { inner: backing, log: below_log }, pool_config));
                handles.pool = Some(Arc::clone(&pool));
                if logged {
                    (handles.above, handles.below) = (Some(Arc::clone(&above)), Some(below));
                }
                let pool: Arc<dyn DeviceAllocator> = pool;
                if config == "governed-pool-pow2" {
                    Arc::new(PowerOfTwo { inner: pool, log: logged.then_some(above) })
                } else if config == "governed-pool-trim-grow" {
                    let trimmed = Arc::clone(handles.pool.as_ref().expect("set above"));
                    Arc::new(TrimOnGrowth {
                        inner: pool,
                        log: logged.then_some(above),
                        pool: trimmed,
                        largest: AtomicUsize::new(0),
                    })
                } else if logged {
                    Arc::new(Probe { inner: pool, log: Some(above) })
                } else {
                    pool
                }
            };
            let adapter = OrtAllocatorConfig::default().return_free_heap_pages(config != "governed-pool-keep-heap");
            let allocator = governed_allocator(&env, &registry, &governor, tenant, account, inner, adapter)?;
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

/// The governor's books for one bench tenant on the host: a registry, a governor with
/// a 4 GiB device limit (it bounds what cache backings hold; the bench never reaches
/// it), and the tenant's account with a quota of the same.
fn governed_tenant() -> Result<(BindingRegistry, Governor, AuthorityIdentity, Account), String> {
    let registry = BindingRegistry::new();
    let governor = Governor::new();
    governor.set_device_limit(DeviceKey::HOST, 4 << 30).map_err(|e| e.to_string())?;
    let tenant = registry.register_authority(DeviceKey::HOST, Arc::new("bench")).map_err(|e| e.to_string())?;
    let account = governor
        .open_account(AccountConfig::new(DeviceKey::HOST, tenant).with_quota(4 << 30))
        .map_err(|e| e.to_string())?;
    Ok((registry, governor, tenant, account))
}

/// `inner` governed for `tenant`, registered, bound, and wrapped as ONNX Runtime's
/// allocator.
fn governed_allocator(
    env: &OrtEnvironment,
    registry: &BindingRegistry,
    governor: &Governor,
    tenant: AuthorityIdentity,
    account: Account,
    inner: Arc<dyn DeviceAllocator>,
    config: OrtAllocatorConfig,
) -> Result<GovernedOrtAllocator, String> {
    let context = registry.register_provider_context(DeviceKey::HOST, Arc::new("bench")).map_err(|e| e.to_string())?;
    let governed = governor.govern(inner, tenant).map_err(|e| e.to_string())?;
    let mechanism = registry.register_allocator(&context, &tenant, Arc::new(governed)).map_err(|e| e.to_string())?;
    let binding = registry.bind_registered(&mechanism).map_err(|e| e.to_string())?;
    GovernedOrtAllocator::cpu(env, binding, Some(account), config).map_err(|e| e.to_string())
}

fn child(args: &[String]) -> Result<(), String> {
    let [name, config, iters] = args else { return Err("usage: --child MODEL CONFIG ITERS".to_owned()) };
    let iters: usize = iters.parse().map_err(|_| "ITERS is a number")?;
    let work = model(name)?.work;
    let mut bench = build(name, config, false)?;
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

/// `--child-multi N CONFIG REQUESTS`: N sessions of one tenant, each a detection and a
/// recognition model, on N threads; prints `result`, the peak RSS in KiB, the minor
/// faults of the timed requests, the resident KiB once every model was committed
/// (before any run), the governor's allocated and reserved peaks in bytes (0 for the
/// arenas), then (input, microseconds) per timed request.
fn child_multi(args: &[String]) -> Result<(), String> {
    let [sessions, config, requests] = args else {
        return Err("usage: --child-multi SESSIONS CONFIG REQUESTS".to_owned());
    };
    let sessions: usize = sessions.parse().map_err(|_| "SESSIONS is a number")?;
    let requests: usize = requests.parse().map_err(|_| "REQUESTS is a number")?;
    let assets = OrtAssets::locate().map_err(|e| e.to_string())?;
    let env = OrtEnvironment::load(&assets.library).map_err(|e| e.to_string())?;
    let builder = || env.session_builder().map_err(|e| e.to_string())?.with_intra_threads(1).map_err(|e| e.to_string());
    let (timed, faults, committed, booked) = match config.as_str() {
        "arenas" => {
            // The stock session (its CPU arena, prepacking on), one intra-op thread.
            let stock = |path: &std::path::Path| builder()?.commit_from_file(path).map_err(|e| e.to_string());
            let models = (0..sessions)
                .map(|_| Ok((stock(&assets.ocr_det)?, stock(&assets.ocr_rec)?)))
                .collect::<Result<Vec<_>, String>>()?;
            let committed = proc_status_kib("VmRSS:").ok_or("no VmRSS in /proc/self/status")?;
            let (timed, faults) = run_sessions(models, requests)?;
            (timed, faults, committed, (0, 0))
        }
        "shared-governed-pool" | "shared-governed-pool-keep-heap" => {
            let (registry, governor, tenant, account) = governed_tenant()?;
            let backing = governor.cache_backing(Arc::new(SystemAllocator::for_caches(DeviceKey::HOST)));
            let pool: Arc<dyn DeviceAllocator> = Arc::new(PooledAllocator::new(backing));
            let adapter = OrtAllocatorConfig::default().return_free_heap_pages(config == "shared-governed-pool");
            let allocator = governed_allocator(&env, &registry, &governor, tenant, account, pool, adapter)?;
            let commit =
                |path: &std::path::Path| env.commit_from_file(&allocator, builder()?, path).map_err(|e| e.to_string());
            let models = (0..sessions)
                .map(|_| Ok((commit(&assets.ocr_det)?, commit(&assets.ocr_rec)?)))
                .collect::<Result<Vec<_>, String>>()?;
            let committed = proc_status_kib("VmRSS:").ok_or("no VmRSS in /proc/self/status")?;
            let (timed, faults) = run_sessions(models, requests)?;
            let snapshot = governor.snapshot();
            let device = snapshot.device(DeviceKey::HOST).ok_or("the governor has no books for the host")?;
            (timed, faults, committed, (device.peak, device.reserved_peak))
        }
        other => {
            return Err(format!("unknown multi-session configuration {other}; known: {}", MULTI_CONFIGS.join(", ")));
        }
    };
    let hwm = proc_status_kib("VmHWM:").ok_or("no VmHWM in /proc/self/status")?;
    let list: Vec<String> = timed.iter().map(|(input, micros)| format!("{input} {micros}")).collect();
    println!("result {hwm} {faults} {committed} {} {} {}", booked.0, booked.1, list.join(" "));
    Ok(())
}

/// Runs each (detection, recognition) pair on a thread of its own: a warm-up pass over
/// the pair's cycle, then (all pairs released at once) `requests` timed requests. The
/// (input, microseconds) of every timed request, and the minor faults of the timed part.
fn run_sessions<S: Infer + Send>(models: Vec<(S, S)>, requests: usize) -> Result<(Vec<(usize, u64)>, u64), String> {
    let barrier = std::sync::Barrier::new(models.len() + 1);
    let (results, faults) = std::thread::scope(|scope| {
        let handles: Vec<_> = models
            .into_iter()
            .enumerate()
            .map(|(session, (mut det, mut rec))| {
                let barrier = &barrier;
                scope.spawn(move || -> Result<Vec<(usize, u64)>, String> {
                    let warm = (0..MULTI_CYCLE).try_for_each(|i| session_request(session, i, &mut det, &mut rec));
                    // Every thread passes both barriers, even after a failed warm-up.
                    barrier.wait();
                    barrier.wait();
                    warm?;
                    let mut timed = Vec::with_capacity(requests);
                    for i in MULTI_CYCLE..MULTI_CYCLE + requests {
                        let started = Instant::now();
                        session_request(session, i, &mut det, &mut rec)?;
                        timed.push((session * MULTI_CYCLE + i % MULTI_CYCLE, started.elapsed().as_micros() as u64));
                    }
                    Ok(timed)
                })
            })
            .collect();
        barrier.wait();
        let before = minor_faults();
        barrier.wait();
        let results: Vec<_> =
            handles.into_iter().map(|h| h.join().map_err(|_| "a session thread panicked".to_owned())).collect();
        (results, minor_faults().zip(before).map(|(after, before)| after - before))
    });
    let mut timed = Vec::new();
    for result in results {
        timed.extend(result??);
    }
    Ok((timed, faults.ok_or("no fault count in /proc/self/stat")?))
}

/// Request `i` of session `session`: text detection on a page, then recognition on
/// lines (inputs seeded by session and position in the cycle, the same in every
/// configuration).
fn session_request<S: Infer>(session: usize, i: usize, det: &mut S, rec: &mut S) -> Result<(), String> {
    let seed = (session * MULTI_CYCLE + i % MULTI_CYCLE) as u64;
    let (height, width) = MULTI_DET[(i + session) % MULTI_DET.len()];
    detect_text(det, ocr_image(seed, height, width), height, width).map_err(|e| e.to_string())?;
    let (batch, width) = MULTI_REC[(i + 2 * session) % MULTI_REC.len()];
    recognize_text(rec, ocr_lines(seed, batch, width), batch, width).map_err(|e| e.to_string())?;
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
    let mut bench = build(name, config, true)?;
    println!("# {name} {config}, per run: its time; the requests that reached the pool (what the adapter asked for,");
    println!("# let through by the governor) and those that reached the system below it: count, and those of >= 1 MiB");
    println!("# in MiB; the pool's segments after the run (count, MiB, of which cached MiB); resident and peak MiB");
    let mib = |bytes: usize| bytes as f64 / f64::from(1 << 20);
    println!(
        "committed: rss {:.1} hwm {:.1}",
        proc_status_kib("VmRSS:").unwrap_or(0) as f64 / 1024.0,
        proc_status_kib("VmHWM:").unwrap_or(0) as f64 / 1024.0,
    );
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
    /// `None`: forwards only (the timed children).
    log: Option<Log>,
}

impl<A: DeviceAllocator> DeviceAllocator for Probe<A> {
    fn device(&self) -> DeviceKey {
        self.inner.device()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        note(&self.log, request.bytes());
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
    log: Option<Log>,
    pool: Arc<BenchPool>,
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
        note(&self.log, request.bytes());
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
    log: Option<Log>,
}

impl<A: DeviceAllocator> DeviceAllocator for PowerOfTwo<A> {
    fn device(&self) -> DeviceKey {
        self.inner.device()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        note(&self.log, request.bytes());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn the_multi_session_ns_default_to_two_and_four_and_zero_skips_them() {
        assert_eq!(numbers_flag(&args("--rounds 1"), "--sessions", &[2, 4]), Ok(vec![2, 4]));
        assert_eq!(numbers_flag(&args("--sessions 3,1"), "--sessions", &[2, 4]), Ok(vec![3, 1]));
        assert_eq!(numbers_flag(&args("--sessions 0"), "--sessions", &[2, 4]), Ok(vec![]));
        assert!(numbers_flag(&args("--sessions 2,x"), "--sessions", &[2, 4]).unwrap_err().contains("`x`"));
        assert!(numbers_flag(&args("--sessions"), "--sessions", &[2, 4]).is_err());
    }

    #[test]
    fn every_session_sees_every_shape_of_its_cycle_in_its_warm_up() {
        for session in 0..4 {
            let det: std::collections::BTreeSet<_> =
                (0..MULTI_CYCLE).map(|i| MULTI_DET[(i + session) % MULTI_DET.len()]).collect();
            let rec: std::collections::BTreeSet<_> =
                (0..MULTI_CYCLE).map(|i| MULTI_REC[(i + 2 * session) % MULTI_REC.len()]).collect();
            assert_eq!(det.len(), MULTI_DET.iter().collect::<std::collections::BTreeSet<_>>().len());
            assert_eq!(rec.len(), MULTI_REC.len());
        }
        assert_eq!(MULTI_CYCLE % MULTI_DET.len(), 0);
        assert_eq!(MULTI_CYCLE % MULTI_REC.len(), 0);
    }
}
