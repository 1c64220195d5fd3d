//! `cargo xtask bench --ort`: per real model, latency (p50, p99) and peak resident
//! memory of four ways to give ONNX Runtime its CPU memory, as ratios against (a):
//!
//! - (a) `arena`: ONNX Runtime's default CPU arena (stock session);
//! - (b) `no-arena`: ONNX Runtime's CPU allocator without its arena;
//! - (c) `governed-pool`: memory-ort over a governed `PooledAllocator`;
//! - (d) `governed-system`: memory-ort over a governed `SystemAllocator`.
//!
//! Each (model, configuration) is measured in a child process of its own (this binary
//! with `--child`), so its peak resident memory (`VmHWM`) is its own; the children run
//! in rotating order, round after round, so the configurations alternate in one run.
//! Each child also counts the minor page faults of its timed runs: a figure that load
//! on the machine does not disturb, and the first thing to look at when a
//! configuration is slower (an allocator that hands large blocks back to the system
//! and gets fresh ones every run pays a fault per page touched).
//! Target: (c) p50 <= 1.05x (a), and (c) peak RSS no higher than (a).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Instant;

use allocator_cpu::{PooledAllocator, SystemAllocator};
use memory_governor::{AccountConfig, BindingRegistry, DeviceAllocator, DeviceKey, Governor};
use memory_ort::workloads::{Infer, VadStream, detect_text, ocr_image};
use memory_ort::{GovernedOrtAllocator, OrtAllocatorConfig, OrtAssets, OrtEnvironment};

const CONFIGS: [&str; 4] = ["arena", "no-arena", "governed-pool", "governed-system"];
const MODELS: [&str; 2] = ["silero-vad", "pp-ocrv4-det"];
const OCR_SIZE: (usize, usize) = (480, 640);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = if args.first().is_some_and(|a| a == "--child") { child(&args[1..]) } else { parent(&args) };
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

fn parent(args: &[String]) -> Result<(), String> {
    let rounds = flag(args, "--rounds", 3)?;
    let vad_iters = flag(args, "--vad-iters", 400)?;
    let ocr_iters = flag(args, "--ocr-iters", 12)?;
    OrtAssets::locate().map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // (model, config) -> latencies in microseconds, peak RSS in KiB per child.
    let mut latencies: BTreeMap<(&str, &str), Vec<u64>> = BTreeMap::new();
    let mut peaks: BTreeMap<(&str, &str), Vec<u64>> = BTreeMap::new();
    let mut faults: BTreeMap<(&str, &str), Vec<u64>> = BTreeMap::new();
    for round in 0..rounds {
        for model in MODELS {
            for offset in 0..CONFIGS.len() {
                let config = CONFIGS[(round + offset) % CONFIGS.len()];
                let iters = if model == MODELS[0] { vad_iters } else { ocr_iters };
                let output = Command::new(&exe)
                    .args(["--child", model, config, &iters.to_string()])
                    .output()
                    .map_err(|e| format!("cannot start a child: {e}"))?;
                let stdout = String::from_utf8_lossy(&output.stdout);
                if !output.status.success() {
                    return Err(format!(
                        "child {model} {config} failed: {}{}",
                        stdout,
                        String::from_utf8_lossy(&output.stderr)
                    ));
                }
                let line = stdout.lines().find(|l| l.starts_with("result ")).ok_or("a child printed no result")?;
                let mut fields = line.split_whitespace().skip(1);
                let hwm: u64 = fields.next().and_then(|v| v.parse().ok()).ok_or("bad result line")?;
                let faulted: u64 = fields.next().and_then(|v| v.parse().ok()).ok_or("bad result line")?;
                peaks.entry((model, config)).or_default().push(hwm);
                faults.entry((model, config)).or_default().push(faulted);
                latencies.entry((model, config)).or_default().extend(fields.filter_map(|v| v.parse::<u64>().ok()));
            }
        }
        eprintln!("ort-bench: round {}/{rounds} done", round + 1);
    }
    println!("\n## ort bench: {rounds} rounds, configurations alternating; each (model, config) in its own process");
    println!(
        "\n| model | configuration | p50 ms | p99 ms | peak RSS MiB | faults/run | p50 vs (a) | p99 vs (a) | peak RSS vs (a) |"
    );
    println!(
        "|-------|---------------|-------:|-------:|-------------:|-----------:|-----------:|-----------:|----------------:|"
    );
    let mut verdicts = Vec::new();
    for model in MODELS {
        let base = &latencies[&(model, CONFIGS[0])];
        let (base_p50, base_p99) = (percentile(base, 0.5), percentile(base, 0.99));
        let base_rss = median(&peaks[&(model, CONFIGS[0])]);
        for (index, config) in CONFIGS.iter().enumerate() {
            let samples = &latencies[&(model, *config)];
            let (p50, p99) = (percentile(samples, 0.5), percentile(samples, 0.99));
            let rss = median(&peaks[&(model, *config)]);
            let iters = samples.len() as f64 / peaks[&(model, *config)].len() as f64;
            let faults_per_run = median(&faults[&(model, *config)]) as f64 / iters;
            let label = format!("({}) {config}", (b'a' + index as u8) as char);
            println!(
                "| {model} | {label} | {:.3} | {:.3} | {:.1} | {:.1} | {:.3}x | {:.3}x | {:.3}x |",
                p50 / 1e3,
                p99 / 1e3,
                rss as f64 / 1024.0,
                faults_per_run,
                p50 / base_p50,
                p99 / base_p99,
                rss as f64 / base_rss as f64
            );
            if *config == "governed-pool" {
                verdicts.push(format!(
                    "{model}: (c) p50 {:.3}x (a) [target <= 1.05x: {}], peak RSS {:.3}x (a) [target <= 1.00x: {}]",
                    p50 / base_p50,
                    if p50 / base_p50 <= 1.05 { "met" } else { "missed" },
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

fn child(args: &[String]) -> Result<(), String> {
    let [model, config, iters] = args else { return Err("usage: --child MODEL CONFIG ITERS".to_owned()) };
    let iters: usize = iters.parse().map_err(|_| "ITERS is a number")?;
    let assets = OrtAssets::locate().map_err(|e| e.to_string())?;
    let env = OrtEnvironment::load(&assets.library).map_err(|e| e.to_string())?;
    let path = if model == MODELS[0] { &assets.silero_vad } else { &assets.ocr_det };
    let mut session: Box<dyn FnMut() -> Result<(), String>> = match config.as_str() {
        "arena" | "no-arena" => {
            let session = env.plain_session(path, config == "arena", true).map_err(|e| e.to_string())?;
            workload(model, session)
        }
        "governed-pool" | "governed-system" => {
            let inner: Arc<dyn DeviceAllocator> = if config == "governed-pool" {
                Arc::new(PooledAllocator::new(SystemAllocator::new()))
            } else {
                Arc::new(SystemAllocator::new())
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
            let builder = env.session_builder().map_err(|e| e.to_string())?;
            let session = env.commit_from_file(&allocator, builder, path).map_err(|e| e.to_string())?;
            // The registry and governor must outlive the session: leak them into the closure.
            let keep = (registry, governor);
            let mut run = workload(model, session);
            Box::new(move || {
                let _ = &keep;
                run()
            })
        }
        other => return Err(format!("unknown configuration {other}")),
    };
    let warm_up = if model == MODELS[0] { 20 } else { 2 };
    for _ in 0..warm_up {
        session()?;
    }
    let mut micros = Vec::with_capacity(iters);
    let faults_before = minor_faults().ok_or("no fault count in /proc/self/stat")?;
    for _ in 0..iters {
        let started = Instant::now();
        session()?;
        micros.push(started.elapsed().as_micros() as u64);
    }
    let faulted = minor_faults().ok_or("no fault count in /proc/self/stat")? - faults_before;
    drop(session);
    let hwm = peak_rss_kib().ok_or("no VmHWM in /proc/self/status")?;
    let list: Vec<String> = micros.iter().map(u64::to_string).collect();
    println!("result {hwm} {faulted} {}", list.join(" "));
    Ok(())
}

/// One request of `model` against `session`, as a closure.
fn workload<S: Infer + 'static>(model: &str, mut session: S) -> Box<dyn FnMut() -> Result<(), String>> {
    if model == MODELS[0] {
        let mut stream = VadStream::new(1);
        Box::new(move || {
            let chunk = stream.next_chunk();
            stream.step(&mut session, &chunk).map(|_| ()).map_err(|e| e.to_string())
        })
    } else {
        let mut seed = 0;
        Box::new(move || {
            seed += 1;
            let (height, width) = OCR_SIZE;
            detect_text(&mut session, ocr_image(seed, height, width), height, width)
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    }
}

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Minor page faults of this process so far (`minflt`, the 10th field of
/// `/proc/self/stat`, counted after the command name's closing parenthesis).
fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after_name = stat.get(stat.rfind(')')? + 1..)?;
    after_name.split_whitespace().nth(7)?.parse().ok()
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
