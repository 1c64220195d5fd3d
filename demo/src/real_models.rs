//! `cargo xtask demo --ort`: the demo's real mode. Two tenants share one process and one
//! host device, each with its own quota: tenant `voice` streams audio through Silero
//! VAD, tenant `scan` runs PP-OCRv4 text detection on pages of varying sizes, and a
//! third stream of each runs for the other tenant so both models serve both. Every
//! byte ONNX Runtime allocates comes from the tenant's governed binding, a pool of the
//! tenant's own that takes its memory through the governor's cache backing (so the
//! device limit bounds what the pools hold, used and idle). The report gives per-tenant
//! request counts and latency percentiles, allocated and reserved (allocated + idle in
//! the pools) per device and tenant with their peaks, the governor's books by role, and
//! ends with the nothing-lost check (registry and governor back to zero, every charge
//! released, nothing quarantined, no overdraft, the footprint's books balanced).
//! With `--record PATH`, each tenant's governed pool is wrapped by a memory-trace
//! recorder, so every block ONNX Runtime took (varying shapes, two models, two tenants)
//! goes to a trace that `cargo xtask replay` replays against other allocator stacks.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use allocator_cpu::{PooledAllocator, SystemAllocator};
use memory_governor::{
    AccountConfig, AuthorityIdentity, BindingRegistry, DeviceAllocator, DeviceKey, Footprint, Governor,
    MechanismIdentity, MemoryRole,
};
use memory_ort::workloads::{VadStream, detect_text, ocr_image};
use memory_ort::{GovernedOrtAllocator, OrtAllocatorConfig, OrtAssets, OrtEnvironment};

struct TenantSpec {
    name: &'static str,
    quota: u64,
    vad_streams: u64,
    page_sizes: &'static [(usize, usize)],
}

const TENANTS: [TenantSpec; 2] = [
    TenantSpec { name: "voice", quota: 96 << 20, vad_streams: 3, page_sizes: &[(160, 224), (320, 320)] },
    TenantSpec { name: "scan", quota: 256 << 20, vad_streams: 1, page_sizes: &[(320, 480), (640, 480), (480, 800)] },
];

/// What one tenant's thread measured.
struct Served {
    vad: Vec<Duration>,
    ocr: Vec<Duration>,
    speech_chunks: usize,
    text_pixels: usize,
    overdraft_blocks: u64,
    /// The tenant's footprint after its last request, its sessions still open.
    at_end: Footprint,
}

/// Runs the real mode, `requests` per tenant and model; returns the report and whether
/// the nothing-lost check passed. With `record`, every governed allocation is recorded
/// to that file (the recording is finished, with every session closed, before this
/// returns).
///
/// # Errors
/// A message when the assets are missing, a model fails or the trace cannot be written.
pub fn run(requests: usize, record: Option<&Path>) -> Result<(String, bool), String> {
    let assets = OrtAssets::locate().map_err(|err| err.to_string())?;
    let env = OrtEnvironment::load(&assets.library).map_err(|err| err.to_string())?;
    let recorder = record
        .map(|path| {
            memory_trace::Recorder::create(path)
                .map_err(|error| format!("--record: cannot record to {}: {error}", path.display()))
        })
        .transpose()?;

    let registry = BindingRegistry::new();
    let governor = Governor::new();
    let device = DeviceKey::HOST;
    governor.set_device_limit(device, 512 << 20).map_err(|err| err.to_string())?;
    let context = registry.register_provider_context(device, Arc::new("onnx runtime")).map_err(|e| e.to_string())?;
    let mut tenants: Vec<(&TenantSpec, AuthorityIdentity, MechanismIdentity)> = Vec::new();
    for spec in &TENANTS {
        let authority = registry.register_authority(device, Arc::new(spec.name)).map_err(|e| e.to_string())?;
        governor
            .open_account(AccountConfig::new(device, authority).with_quota(spec.quota).with_label(spec.name))
            .map_err(|e| e.to_string())?;
        // The tenant's own pool, over a cache backing: its idle blocks are the tenant's
        // `cached`, and the device limit bounds what all pools hold.
        let backing = governor.cache_backing(Arc::new(SystemAllocator::for_caches(DeviceKey::HOST)));
        let pool: Arc<dyn DeviceAllocator> = Arc::new(PooledAllocator::new(backing));
        let governed = governor.govern(pool, authority).map_err(|e| e.to_string())?;
        let governed: Arc<dyn DeviceAllocator> = match &recorder {
            Some(recorder) => Arc::new(recorder.trace(&governor, governed)),
            None => Arc::new(governed),
        };
        let mechanism = registry.register_allocator(&context, &authority, governed).map_err(|e| e.to_string())?;
        tenants.push((spec, authority, mechanism));
    }

    let started = Instant::now();
    // The governor keeps a reserved peak per device, not per account: this thread
    // samples each tenant's while they serve.
    let accounts: Vec<_> = tenants
        .iter()
        .map(|(_, authority, _)| governor.account(*authority))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let mut reserved_peaks = vec![0u64; tenants.len()];
    let mut samples = 0u64;
    let served: Vec<Result<Served, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = tenants
            .iter()
            .map(|(spec, authority, mechanism)| {
                let (registry, governor, env, assets) = (&registry, &governor, &env, &assets);
                scope.spawn(move || serve(spec, registry, governor, *authority, mechanism, env, assets, requests))
            })
            .collect();
        while handles.iter().any(|handle| !handle.is_finished()) {
            for (account, peak) in accounts.iter().zip(&mut reserved_peaks) {
                *peak = (*peak).max(account.footprint().tenant_reserved);
            }
            samples += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
        handles.into_iter().map(|handle| handle.join().map_err(|_| "a tenant thread panicked".to_owned())?).collect()
    });
    let elapsed = started.elapsed();
    let served: Vec<Served> = served.into_iter().collect::<Result<_, _>>()?;
    // Every session closed with its tenant's thread: the trace ends with the books at zero.
    let recording = recorder.as_ref().map(memory_trace::Recorder::finish).transpose().map_err(|e| e.to_string())?;

    let mut out = String::new();
    let _ = writeln!(
        out,
        "memory-demo --ort: two tenants on ONNX Runtime {} through governed allocators",
        memory_ort::assets::ONNXRUNTIME_VERSION
    );
    let _ = writeln!(out, "  {requests} requests per tenant and model in {:.2} s\n", elapsed.as_secs_f64());
    let _ = writeln!(out, "| tenant | model | requests | p50 ms | p95 ms | p99 ms | result |");
    let _ = writeln!(out, "|--------|-------|---------:|-------:|-------:|-------:|--------|");
    for ((spec, _, _), served) in tenants.iter().zip(&served) {
        for (model, latencies, result) in [
            ("silero-vad", &served.vad, format!("{} speech chunks", served.speech_chunks)),
            ("pp-ocrv4-det", &served.ocr, format!("{} text pixels", served.text_pixels)),
        ] {
            let _ = writeln!(
                out,
                "| {} | {model} | {} | {:.2} | {:.2} | {:.2} | {result} |",
                spec.name,
                latencies.len(),
                percentile(latencies, 0.50),
                percentile(latencies, 0.95),
                percentile(latencies, 0.99)
            );
        }
    }
    let snapshot = governor.snapshot();
    let books = snapshot.device(device).ok_or("the governor has no books for the host")?;
    let _ = writeln!(
        out,
        "\nfootprint: allocated = charged to tenants, reserved = allocated + idle in the pools (each tenant's pool takes \
         its memory through Governor::cache_backing, so the device limit bounds reserved)"
    );
    let _ = writeln!(
        out,
        "\n| device | limit MiB | allocated peak MiB | reserved peak MiB | reserved / allocated | held by caches peak MiB \
         | trims | trimmed MiB | refused over reserved |"
    );
    let _ = writeln!(
        out,
        "|--------|----------:|-------------------:|------------------:|---------------------:|------------------------:\
         |------:|------------:|----------------------:|"
    );
    let _ = writeln!(
        out,
        "| {} | {} | {:.1} | {:.1} | {:.3}x | {:.1} | {} | {:.1} | {} |",
        books.device,
        books.limit.map_or("-".to_owned(), |l| (l >> 20).to_string()),
        mib(books.peak),
        mib(books.reserved_peak),
        crate::report::reserved_ratio(books),
        mib(books.held_by_caches_peak),
        books.ladder.trims,
        mib(books.ladder.trimmed_bytes),
        books.ladder.refused_over_reserved
    );
    let _ = writeln!(
        out,
        "\nafter the sessions closed, {}: {:.1} MiB allocated, {:.1} MiB idle in the pools ({:.1} MiB reserved, {:.1} MiB \
         held by the cache backings), largest free block {:.1} MiB, fragmentation {:.0}%",
        books.device,
        mib(books.allocated),
        mib(books.cached),
        mib(books.reserved),
        mib(books.held_by_caches),
        mib(books.largest_free),
        books.fragmentation() * 100.0
    );
    let _ = writeln!(
        out,
        "\n| tenant | quota MiB | allocated peak MiB | reserved peak MiB | weights peak MiB | activations peak MiB \
         | allocated at end MiB | reserved at end MiB | idle after close MiB | refusals |"
    );
    let _ = writeln!(
        out,
        "|--------|----------:|-------------------:|------------------:|-----------------:|---------------------:\
         |---------------------:|--------------------:|---------------------:|---------:|"
    );
    for (((spec, authority, _), served), peak) in tenants.iter().zip(&served).zip(&reserved_peaks) {
        let account = books.authority(*authority).ok_or("a tenant has no account")?;
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
            spec.name,
            spec.quota >> 20,
            mib(account.peak),
            mib((*peak).max(served.at_end.tenant_reserved)),
            mib(account.role(MemoryRole::Weights).peak),
            mib(account.role(MemoryRole::Activations).peak),
            mib(served.at_end.tenant_allocated),
            mib(served.at_end.tenant_reserved),
            mib(account.cached),
            account.totals.failures
        );
    }
    let _ = writeln!(
        out,
        "  (reserved peak sampled {samples} times while the tenants served; at end: after each tenant's last request, \
         its sessions still open)"
    );

    // Nothing lost: every session is gone, so the registry holds no block, the governor
    // no byte, every charge was released, nothing is quarantined, no overdraft served.
    let mut failures = Vec::new();
    for (spec, authority, mechanism) in &tenants {
        let mechanism = registry.snapshot(mechanism).map_err(|e| e.to_string())?;
        let account = books.authority(*authority).ok_or("a tenant has no account")?;
        if mechanism.live_allocations != 0 || mechanism.live_bytes != 0 {
            failures.push(format!("{}: {} blocks still live in the registry", spec.name, mechanism.live_allocations));
        }
        if !mechanism.quarantined.is_empty() {
            failures.push(format!("{}: {} blocks quarantined", spec.name, mechanism.quarantined.len()));
        }
        if account.current != 0 || account.totals.allocations != account.totals.releases {
            failures.push(format!(
                "{}: {} bytes still charged, {} charges vs {} releases",
                spec.name, account.current, account.totals.allocations, account.totals.releases
            ));
        }
    }
    failures.extend(crate::report::footprint_violations(&snapshot));
    for (spec, served) in tenants.iter().map(|t| t.0).zip(&served) {
        if served.at_end.tenant_reserved < served.at_end.tenant_allocated {
            failures.push(format!("{}: reserved below allocated at the end: {}", spec.name, served.at_end));
        }
    }
    let overdraft: u64 = served.iter().map(|s| s.overdraft_blocks).sum();
    if overdraft != 0 {
        failures.push(format!("{overdraft} refused blocks were served from the overdraft"));
    }
    let passed = failures.is_empty();
    if passed {
        let _ = writeln!(
            out,
            "\nnothing lost: registry and governor back to zero, every charge released, nothing quarantined; \
             the footprint's books balance"
        );
    } else {
        let _ = writeln!(out, "\nNOTHING-LOST CHECK FAILED:\n  {}", failures.join("\n  "));
    }
    if let (Some(recording), Some(path)) = (recording, record) {
        let _ = writeln!(
            out,
            "recorded {} events ({} bytes, {} ring waits) to {}",
            recording.events,
            recording.bytes,
            recording.waits,
            path.display()
        );
    }
    Ok((out, passed))
}

#[allow(clippy::too_many_arguments)]
fn serve(
    spec: &TenantSpec,
    registry: &BindingRegistry,
    governor: &Governor,
    authority: AuthorityIdentity,
    mechanism: &MechanismIdentity,
    env: &OrtEnvironment,
    assets: &OrtAssets,
    requests: usize,
) -> Result<Served, String> {
    let binding = registry.bind_registered(mechanism).map_err(|e| e.to_string())?;
    let account = governor.account(authority).map_err(|e| e.to_string())?;
    let allocator = GovernedOrtAllocator::cpu(env, binding, Some(account.clone()), OrtAllocatorConfig::default())
        .map_err(|e| e.to_string())?;
    let builder = || {
        env.session_builder().and_then(|b| {
            b.with_intra_threads(1)
                .map_err(|e| memory_ort::OrtAdapterError::Runtime { action: "set threads", message: e.to_string() })
        })
    };
    let mut vad = env
        .commit_from_file(&allocator, builder().map_err(|e| e.to_string())?, &assets.silero_vad)
        .map_err(|e| e.to_string())?;
    let mut ocr = env
        .commit_from_file(&allocator, builder().map_err(|e| e.to_string())?, &assets.ocr_det)
        .map_err(|e| e.to_string())?;
    let mut streams: Vec<VadStream> = (0..spec.vad_streams).map(VadStream::new).collect();
    let mut served = Served {
        vad: Vec::new(),
        ocr: Vec::new(),
        speech_chunks: 0,
        text_pixels: 0,
        overdraft_blocks: 0,
        at_end: Footprint::default(),
    };
    for request in 0..requests {
        let count = streams.len();
        let stream = &mut streams[request % count];
        let chunk = stream.next_chunk();
        let started = Instant::now();
        let probability = stream.step(&mut vad, &chunk).map_err(|e| e.to_string())?;
        served.vad.push(started.elapsed());
        served.speech_chunks += usize::from(probability > 0.5);

        let (height, width) = spec.page_sizes[request % spec.page_sizes.len()];
        let image = ocr_image(request as u64, height, width);
        let started = Instant::now();
        let (pixels, _) = detect_text(&mut ocr, image, height, width).map_err(|e| e.to_string())?;
        served.ocr.push(started.elapsed());
        served.text_pixels += pixels;
    }
    served.overdraft_blocks = allocator.stats().overdraft_blocks;
    served.at_end = account.footprint();
    drop((vad, ocr));
    Ok(served)
}

fn percentile(latencies: &[Duration], q: f64) -> f64 {
    if latencies.is_empty() {
        return 0.0;
    }
    let mut sorted: Vec<Duration> = latencies.to_vec();
    sorted.sort();
    let index = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[index].as_secs_f64() * 1e3
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}
