//! `cargo xtask demo --ort`: the demo's real mode. Two tenants share one process and one
//! host device, each with its own quota: tenant `voice` streams audio through Silero
//! VAD, tenant `scan` runs PP-OCRv4 text detection on pages of varying sizes, and a
//! third stream of each runs for the other tenant so both models serve both. Every
//! byte ONNX Runtime allocates comes from the tenant's governed binding. The report
//! gives per-tenant request counts and latency percentiles, the governor's books by
//! role, and ends with the nothing-lost check (registry and governor back to zero, every
//! charge released, nothing quarantined, no overdraft).

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use allocator_cpu::{PooledAllocator, SystemAllocator};
use memory_governor::{
    AccountConfig, BindingRegistry, DeviceAllocator, DeviceKey, Governor, MechanismIdentity, MemoryRole,
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
}

/// Runs the real mode, `requests` per tenant and model; returns the report and whether
/// the nothing-lost check passed.
///
/// # Errors
/// A message when the assets are missing or a model fails.
pub fn run(requests: usize) -> Result<(String, bool), String> {
    let assets = OrtAssets::locate().map_err(|err| err.to_string())?;
    let env = OrtEnvironment::load(&assets.library).map_err(|err| err.to_string())?;

    let registry = BindingRegistry::new();
    let governor = Governor::new();
    let device = DeviceKey::HOST;
    governor.set_device_limit(device, 512 << 20).map_err(|err| err.to_string())?;
    let context = registry.register_provider_context(device, Arc::new("onnx runtime")).map_err(|e| e.to_string())?;
    let mut tenants: Vec<(&TenantSpec, memory_governor::AuthorityIdentity, MechanismIdentity)> = Vec::new();
    for spec in &TENANTS {
        let authority = registry.register_authority(device, Arc::new(spec.name)).map_err(|e| e.to_string())?;
        governor
            .open_account(AccountConfig::new(device, authority).with_quota(spec.quota).with_label(spec.name))
            .map_err(|e| e.to_string())?;
        let pool: Arc<dyn DeviceAllocator> = Arc::new(PooledAllocator::new(SystemAllocator::new()));
        let governed = governor.govern(pool, authority).map_err(|e| e.to_string())?;
        let mechanism =
            registry.register_allocator(&context, &authority, Arc::new(governed)).map_err(|e| e.to_string())?;
        tenants.push((spec, authority, mechanism));
    }

    let started = Instant::now();
    let served: Vec<Result<Served, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = tenants
            .iter()
            .map(|(spec, authority, mechanism)| {
                let (registry, governor, env, assets) = (&registry, &governor, &env, &assets);
                scope.spawn(move || serve(spec, registry, governor, *authority, mechanism, env, assets, requests))
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().map_err(|_| "a tenant thread panicked".to_owned())?).collect()
    });
    let elapsed = started.elapsed();
    let served: Vec<Served> = served.into_iter().collect::<Result<_, _>>()?;

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
    let _ = writeln!(out, "\n| tenant | quota MiB | peak MiB | weights peak MiB | activations peak MiB | refusals |");
    let _ = writeln!(out, "|--------|----------:|---------:|-----------------:|---------------------:|---------:|");
    for (spec, authority, _) in &tenants {
        let account = books.authority(*authority).ok_or("a tenant has no account")?;
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} | {:.1} | {:.1} | {} |",
            spec.name,
            spec.quota >> 20,
            mib(account.peak),
            mib(account.role(MemoryRole::Weights).peak),
            mib(account.role(MemoryRole::Activations).peak),
            account.totals.failures
        );
    }

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
    let overdraft: u64 = served.iter().map(|s| s.overdraft_blocks).sum();
    if overdraft != 0 {
        failures.push(format!("{overdraft} refused blocks were served from the overdraft"));
    }
    let passed = failures.is_empty();
    if passed {
        let _ = writeln!(
            out,
            "\nnothing lost: registry and governor back to zero, every charge released, nothing quarantined"
        );
    } else {
        let _ = writeln!(out, "\nNOTHING-LOST CHECK FAILED:\n  {}", failures.join("\n  "));
    }
    Ok((out, passed))
}

#[allow(clippy::too_many_arguments)]
fn serve(
    spec: &TenantSpec,
    registry: &BindingRegistry,
    governor: &Governor,
    authority: memory_governor::AuthorityIdentity,
    mechanism: &MechanismIdentity,
    env: &OrtEnvironment,
    assets: &OrtAssets,
    requests: usize,
) -> Result<Served, String> {
    let binding = registry.bind_registered(mechanism).map_err(|e| e.to_string())?;
    let account = governor.account(authority).map_err(|e| e.to_string())?;
    let allocator = GovernedOrtAllocator::cpu(env, binding, Some(account), OrtAllocatorConfig::default())
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
    let mut served = Served { vad: Vec::new(), ocr: Vec::new(), speech_chunks: 0, text_pixels: 0, overdraft_blocks: 0 };
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
