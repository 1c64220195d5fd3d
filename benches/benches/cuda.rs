//! CUDA allocator benches (issue 6, item 10), each against the eager allocator in the
//! same run:
//! - `cuda_alloc_release/{eager,pool,vmm,vmm_reserve}/{4KiB,...,1GiB}`: one allocate +
//!   release pair on device 0.
//!   - `eager`: `CudaAllocator` (`cuMemAlloc` / `cuMemFree`);
//!   - `pool`: `CudaPoolAllocator` (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync` on one
//!     stream, release threshold kept at its default `u64::MAX`, so freed memory stays
//!     cached); the stream is synchronised once at the end of every timed batch, so the
//!     queued work is paid for, amortised over the batch;
//!   - `vmm`: `CudaVmmAllocator` reserve + commit of the whole (granule-rounded) block +
//!     release: the same usable device memory as `eager`;
//!   - `vmm_reserve`: reserve + release only (address space, no physical memory).
//! - `cuda_vmm_commit/{1,8,64}_granules`: committing a range of a reservation (the
//!   decommit after each iteration is not timed); reported per granule.
//!
//! Without a CUDA driver or device, each group prints one `skipped <group>: <why>`
//! line and the bench exits successfully. An allocator or size the device refuses
//! (an unsupported feature, out of memory) is skipped by name, the same way. Nothing
//! here panics on a driver failure: a failure inside a timed loop stops that bench and
//! is reported in the summary.
//!
//! After criterion's own output, a summary prints the median of each bench's measured
//! samples (from this run) and the ratios pool/eager and vmm/eager per size.
//!
//! Against the fake driver of `allocator-cuda` (host memory behind a `libcuda.so`
//! built from `crates/allocator-cuda/fake-driver/fake_cuda.c`, found through
//! `LD_LIBRARY_PATH`), this bench exercises every code path; its figures are host
//! figures, not GPU figures.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use allocator_cuda::{
    CudaAllocator, CudaDevice, CudaError, CudaPoolAllocator, CudaStream, CudaVmmAllocator, PoolConfig, device_count,
    driver_available,
};
use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use memory_api::{AllocationRequest, ByteRange, DeviceAllocator, RawAllocation};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// The sizes of `cuda_alloc_release`, with their labels.
const SIZES: [(usize, &str); 6] =
    [(4 * KIB, "4KiB"), (64 * KIB, "64KiB"), (MIB, "1MiB"), (16 * MIB, "16MiB"), (256 * MIB, "256MiB"), (GIB, "1GiB")];
/// Granules per commit in `cuda_vmm_commit`.
const COMMIT_GRANULES: [usize; 3] = [1, 8, 64];
/// Alignment asked for (the eager and pool allocators' native alignment).
const ALIGN: usize = 256;

const ALLOC_GROUP: &str = "cuda_alloc_release";
const COMMIT_GROUP: &str = "cuda_vmm_commit";
const KINDS: [&str; 4] = ["eager", "pool", "vmm", "vmm_reserve"];

/// Per-element times (ns) of every measured sample, by bench name, for the summary.
static SAMPLES: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());
/// Benches stopped by a driver failure inside their timed loop, with the failure.
static FAILURES: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn samples() -> std::sync::MutexGuard<'static, BTreeMap<String, Vec<f64>>> {
    SAMPLES.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn record(name: &str, elapsed: Duration, iters: u64, elements: usize) -> Duration {
    let per_element = elapsed.as_secs_f64() * 1e9 / (iters.max(1) as f64 * elements.max(1) as f64);
    samples().entry(name.to_owned()).or_default().push(per_element);
    elapsed
}

fn fail(name: &str, what: String) {
    let mut failures = FAILURES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if !failures.iter().any(|f| f.starts_with(name)) {
        failures.push(format!("{name}: {what}"));
    }
}

/// What one measured operation does.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Kind {
    Eager,
    Pool,
    /// Reserve, commit everything, release.
    Vmm,
    /// Reserve and release only.
    VmmReserve,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Eager => "eager",
            Kind::Pool => "pool",
            Kind::Vmm => "vmm",
            Kind::VmmReserve => "vmm_reserve",
        }
    }
}

/// The allocators under test, each present only if the device supports it.
struct Cuda {
    eager: CudaAllocator,
    pool: Option<CudaPoolAllocator>,
    vmm: Option<CudaVmmAllocator>,
}

/// Opens device 0 and its allocators, or says in one line per group why nothing runs.
fn open() -> Option<Cuda> {
    let why = if !driver_available() {
        Some("no CUDA driver (libcuda could not be loaded; install the NVIDIA driver or put a libcuda on LD_LIBRARY_PATH)".to_owned())
    } else {
        match device_count() {
            Ok(0) => Some("the CUDA driver reports no device".to_owned()),
            Ok(_) => None,
            Err(error) => Some(format!("the CUDA driver cannot count devices: {error}")),
        }
    };
    let device = match why {
        Some(why) => Err(why),
        None => CudaDevice::open(0).map_err(|error: CudaError| format!("device 0 cannot be opened: {error}")),
    };
    let device = match device {
        Ok(device) => device,
        Err(why) => {
            for group in [ALLOC_GROUP, COMMIT_GROUP] {
                println!("skipped {group}: {why}");
            }
            return None;
        }
    };
    let pool = CudaStream::new(&device)
        .and_then(|stream| CudaPoolAllocator::new(&stream, PoolConfig::default()))
        .map_err(|error| println!("skipped {ALLOC_GROUP}/pool: {error}"))
        .ok();
    let vmm = CudaVmmAllocator::new(&device)
        .map_err(|error| println!("skipped {ALLOC_GROUP}/vmm, {ALLOC_GROUP}/vmm_reserve and {COMMIT_GROUP}: {error}"))
        .ok();
    Some(Cuda { eager: CudaAllocator::new(&device), pool, vmm })
}

impl Cuda {
    fn allocator(&self, kind: Kind) -> Option<&dyn DeviceAllocator> {
        match kind {
            Kind::Eager => Some(&self.eager),
            Kind::Pool => self.pool.as_ref().map(|p| p as &dyn DeviceAllocator),
            Kind::Vmm | Kind::VmmReserve => self.vmm.as_ref().map(|v| v as &dyn DeviceAllocator),
        }
    }

    /// One allocate (+ commit for `Vmm`) + release pair.
    fn pair(&self, kind: Kind, request: &AllocationRequest) -> Result<(), String> {
        let allocator = self.allocator(kind).ok_or("allocator unavailable")?;
        let block = allocator.allocate(request).map_err(|e| format!("allocate: {e}"))?;
        let committed = if kind == Kind::Vmm { commit_all(allocator, &block) } else { Ok(()) };
        let outcome = allocator.release(black_box(block));
        committed?;
        if outcome.is_complete() { Ok(()) } else { Err(format!("release: {}", outcome.summary())) }
    }

    /// Makes freed pool memory reusable and pays for the stream's queued work.
    fn settle(&self, kind: Kind) -> Result<(), String> {
        match (kind, &self.pool) {
            (Kind::Pool, Some(pool)) => pool.stream().synchronize().map_err(|e| format!("synchronize: {e}")),
            _ => Ok(()),
        }
    }

    /// Hands cached memory back once a kind is done, so the next kind has the device.
    fn trim(&self, kind: Kind) {
        if let Some(allocator) = self.allocator(kind) {
            let _ = self.settle(kind);
            let _ = allocator.trim();
        }
    }
}

fn commit_all(allocator: &dyn DeviceAllocator, block: &RawAllocation) -> Result<(), String> {
    let backing = allocator.virtual_backing().ok_or("the VMM allocator has no virtual backing")?;
    backing.commit(block, ByteRange::new(0, block.bytes())).map(drop).map_err(|e| format!("commit: {e}"))
}

fn alloc_release(c: &mut Criterion, cuda: &Cuda) {
    let mut group = c.benchmark_group(ALLOC_GROUP);
    group.throughput(Throughput::Elements(1));
    // Flat: the same iteration count in every sample, so a 1 GiB pair that takes
    // milliseconds is not run 210 times just to fit criterion's linear ramp.
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(20);
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(2));
    for kind in [Kind::Eager, Kind::Pool, Kind::Vmm, Kind::VmmReserve] {
        if cuda.allocator(kind).is_none() {
            continue; // said so in `open`
        }
        for (bytes, label) in SIZES {
            let name = format!("{ALLOC_GROUP}/{}/{label}", kind.name());
            let Ok(request) = AllocationRequest::new(bytes, ALIGN) else { continue };
            // A pair the device refuses (out of memory at 1 GiB, say) is skipped by name.
            if let Err(why) = cuda.pair(kind, &request).and_then(|()| cuda.settle(kind)) {
                println!("skipped {name}: {why}");
                continue;
            }
            group.bench_function(BenchmarkId::new(kind.name(), label), |b| {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    for _ in 0..iters {
                        if let Err(why) = cuda.pair(kind, &request) {
                            fail(&name, why);
                            break;
                        }
                    }
                    if let Err(why) = cuda.settle(kind) {
                        fail(&name, why);
                    }
                    record(&name, start.elapsed(), iters, 1)
                })
            });
        }
        cuda.trim(kind);
    }
    group.finish();
}

fn vmm_commit(c: &mut Criterion, cuda: &Cuda) {
    let Some(vmm) = &cuda.vmm else { return }; // said so in `open`
    let Some(backing) = vmm.virtual_backing() else {
        println!("skipped {COMMIT_GROUP}: the VMM allocator offers no virtual backing");
        return;
    };
    let granularity = vmm.granularity();
    let mut group = c.benchmark_group(COMMIT_GROUP);
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(20);
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(2));
    for granules in COMMIT_GRANULES {
        let label = format!("{granules}_granules");
        let name = format!("{COMMIT_GROUP}/{label}");
        let Some(bytes) = granules.checked_mul(granularity) else { continue };
        let reservation = AllocationRequest::new(bytes, granularity)
            .map_err(|e| e.to_string())
            .and_then(|request| vmm.allocate(&request).map_err(|e| format!("reserve: {e}")));
        let reservation = match reservation {
            Ok(reservation) => reservation,
            Err(why) => {
                println!("skipped {name}: {why}");
                continue;
            }
        };
        let whole = ByteRange::new(0, bytes);
        let cycle = |timed: &mut Duration| -> Result<(), String> {
            let start = Instant::now();
            let committed = backing.commit(&reservation, whole).map_err(|e| format!("commit: {e}"))?;
            *timed += start.elapsed();
            backing.decommit(&reservation, whole).map_err(|e| format!("decommit: {e}"))?;
            if committed == bytes { Ok(()) } else { Err(format!("commit reported {committed} of {bytes} bytes")) }
        };
        let mut untimed = Duration::ZERO;
        if let Err(why) = cycle(&mut untimed) {
            println!("skipped {name}: {why}");
        } else {
            group.throughput(Throughput::Elements(granules as u64));
            group.bench_function(label.as_str(), |b| {
                b.iter_custom(|iters| {
                    let mut timed = Duration::ZERO;
                    for _ in 0..iters {
                        if let Err(why) = cycle(&mut timed) {
                            fail(&name, why);
                            break;
                        }
                    }
                    record(&name, timed, iters, granules)
                })
            });
        }
        let outcome = vmm.release(reservation);
        if !outcome.is_complete() {
            fail(&name, format!("release of the reservation: {}", outcome.summary()));
        }
    }
    group.finish();
}

fn median(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Human-readable time from nanoseconds.
fn time(ns: f64) -> String {
    if ns.is_nan() {
        "-".to_owned()
    } else if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} us", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

fn ratio(a: f64, b: f64) -> String {
    let r = a / b;
    if !r.is_finite() {
        "-".to_owned()
    } else if r >= 0.01 {
        format!("{r:.2}x")
    } else {
        format!("{r:.1e}x")
    }
}

/// The medians of this run's measured samples (only the last `sample_size` calls of
/// each bench are criterion's measured samples; the earlier ones are warm-up) and the
/// ratios against eager, as a table.
fn summary(granularity: Option<usize>) -> String {
    let samples = samples();
    let measured = |name: &str| -> f64 {
        let all = samples.get(name).map(Vec::as_slice).unwrap_or_default();
        median(&all[all.len().saturating_sub(20)..])
    };
    let mut out = String::new();
    let _ = writeln!(out, "\ncuda summary (medians of this run's measured samples, per allocate+release pair):");
    let _ = writeln!(
        out,
        "  {:<7} {:>10} {:>10} {:>10} {:>12} {:>10} {:>10}",
        "size", "eager", "pool", "vmm", "vmm_reserve", "pool/eager", "vmm/eager"
    );
    for (_, label) in SIZES {
        let [eager, pool, vmm, reserve] = KINDS.map(|kind| measured(&format!("{ALLOC_GROUP}/{kind}/{label}")));
        let _ = writeln!(
            out,
            "  {label:<7} {:>10} {:>10} {:>10} {:>12} {:>10} {:>10}",
            time(eager),
            time(pool),
            time(vmm),
            time(reserve),
            ratio(pool, eager),
            ratio(vmm, eager)
        );
    }
    if let Some(granularity) = granularity {
        let _ = writeln!(out, "  vmm commit per granule ({} KiB granules):", granularity / KIB);
        for granules in COMMIT_GRANULES {
            let per = measured(&format!("{COMMIT_GROUP}/{granules}_granules"));
            let _ = writeln!(out, "    {granules:>3} granules per commit   {:>10} per granule", time(per));
        }
    }
    let failures = FAILURES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    for failure in failures.iter() {
        let _ = writeln!(out, "  stopped early: {failure}");
    }
    out
}

fn main() {
    let Some(cuda) = open() else { return };
    let mut criterion = Criterion::default().configure_from_args();
    alloc_release(&mut criterion, &cuda);
    vmm_commit(&mut criterion, &cuda);
    criterion.final_summary();
    print!("{}", summary(cuda.vmm.as_ref().map(CudaVmmAllocator::granularity)));
}
