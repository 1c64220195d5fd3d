//! The simulation: workers serve requests while the control thread switches the
//! mechanism and loses a device mid-run.

mod footprint;
mod kv;
pub(crate) mod ledger;
mod request;
pub(crate) mod world;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use memory_governor::{GovernorSnapshot, RegistryError, TerminationReport};

use crate::config::Config;
use crate::report::{Check, Report};
use footprint::TenantPeaks;
use request::{Shape, serve};
use world::{Backend, World};

/// Why the simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// Setting up the registry or the books failed.
    #[error("setting up the simulation failed: {0}")]
    Setup(String),
    /// The registry refused a cold-path call.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// `--record` could not create or write its trace.
    #[error("--record: {0}")]
    Record(String),
    /// CUDA is unavailable or failed (`--gpu`).
    #[cfg(feature = "cuda")]
    #[error("--gpu: {0}")]
    Cuda(#[from] allocator_cuda::CudaError),
}

macro_rules! setup_from {
    ($($error:ty),*) => {$(
        impl From<$error> for SimError {
            fn from(error: $error) -> SimError {
                SimError::Setup(error.to_string())
            }
        }
    )*};
}
setup_from!(
    memory_governor::BindError,
    memory_governor::AllocateError,
    memory_governor::LayoutError,
    memory_governor::LimitError,
    memory_governor::AccountError,
    memory_governor::GovernFailure
);

/// Milestones of the run, in order.
pub(crate) struct Events {
    pub(crate) switched_at: Option<(u64, Duration)>,
    pub(crate) lost: Option<LossReport>,
}

/// The footprint over the run: the books when the last request finished (weights
/// loaded, idle sequences parked, pools holding what they cached), and each account's
/// sampled reserved peak.
pub(crate) struct Observed {
    pub(crate) at_end: GovernorSnapshot,
    pub(crate) tenant_reserved_peaks: std::collections::BTreeMap<String, u64>,
    pub(crate) samples: u64,
}

/// What the device loss did.
pub(crate) struct LossReport {
    pub(crate) device: String,
    pub(crate) after_requests: u64,
    pub(crate) polls: u64,
    pub(crate) termination: TerminationReport,
}

/// Runs the whole simulation and returns its report.
///
/// # Errors
/// [`SimError`] when the server cannot be set up (for example `--gpu` without CUDA).
pub fn run(config: &Config) -> Result<Report, SimError> {
    let world = World::new(config.gpu, config.record.as_deref())?;
    let progress = if config.progress { ProgressBar::new(config.requests) } else { ProgressBar::hidden() };
    progress.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let next = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let started = Instant::now();
    let deadline = config.duration.map(|d| started + d);
    let mut events = Events { switched_at: None, lost: None };
    let mut peaks = TenantPeaks::new(&world);

    std::thread::scope(|scope| -> Result<(), SimError> {
        let workers: Vec<_> = (0..config.threads)
            .map(|_| {
                scope.spawn(|| {
                    loop {
                        let id = next.fetch_add(1, Ordering::Relaxed);
                        if id >= config.requests || deadline.is_some_and(|d| Instant::now() >= d) {
                            break;
                        }
                        let shape = Shape::draw(config.seed, id, world.devices.len());
                        match serve(&world, &shape) {
                            Ok(()) => {
                                world.ledger.served.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(refusal) => world.ledger.refuse(refusal),
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                        progress.inc(1);
                    }
                })
            })
            .collect();
        // The control loop: milestones by progress (or by time under --secs).
        while workers.iter().any(|w| !w.is_finished()) {
            std::thread::sleep(Duration::from_millis(2));
            peaks.sample();
            let served = done.load(Ordering::Relaxed);
            let fraction = milestone_fraction(config, served, started);
            if events.switched_at.is_none() && fraction >= 1.0 / 3.0 {
                switch(&world, &progress)?;
                events.switched_at = Some((served, started.elapsed()));
            }
            if events.lost.is_none() && fraction >= 2.0 / 3.0 {
                events.lost = lose_device(&world, &progress, served)?;
            }
        }
        Ok(())
    })?;
    // A run too short to reach a milestone still shows it, after the requests.
    if events.switched_at.is_none() {
        switch(&world, &progress)?;
        events.switched_at = Some((done.load(Ordering::Relaxed), started.elapsed()));
    }
    if events.lost.is_none() {
        events.lost = lose_device(&world, &progress, done.load(Ordering::Relaxed))?;
    }
    let elapsed = started.elapsed();
    progress.finish_and_clear();
    peaks.sample();
    let observed = Observed {
        at_end: world.governor.snapshot(),
        tenant_reserved_peaks: peaks.by_authority(),
        samples: peaks.samples,
    };
    let check = shut_down(&world, &events);
    // Everything is released: the trace ends with the books at zero.
    let recording = world
        .recorder
        .as_ref()
        .map(memory_trace::Recorder::finish)
        .transpose()
        .map_err(|error| SimError::Record(error.to_string()))?;
    let mut report = Report::new(&world, config, &events, &observed, check, elapsed);
    report.recording = recording;
    Ok(report)
}

fn milestone_fraction(config: &Config, done: u64, started: Instant) -> f64 {
    let by_requests = done as f64 / config.requests.max(1) as f64;
    match config.duration {
        Some(duration) => by_requests.max(started.elapsed().as_secs_f64() / duration.as_secs_f64()),
        None => by_requests,
    }
}

/// Switches every device to pooled mechanisms: future binds use them, and requests in
/// flight rebind when their retired mechanism refuses a new allocation.
fn switch(world: &World, progress: &ProgressBar) -> Result<(), SimError> {
    *world.backend.write().unwrap_or_else(PoisonError::into_inner) = Backend::Pooled;
    for device in &world.devices {
        world.install(device, Backend::Pooled)?;
    }
    progress.set_message(format!("switched to {}", Backend::Pooled.name(world.gpu)));
    Ok(())
}

/// Loses the last device: invalidation (no allocator callback), termination confirmed
/// once callbacks drain, then a fresh context takes over.
fn lose_device(world: &World, progress: &ProgressBar, served: u64) -> Result<Option<LossReport>, SimError> {
    let Some(device) = world.devices.last().filter(|_| world.devices.len() > 1) else { return Ok(None) };
    let old_context = device.context();
    let reason = "simulated Xid 79: GPU has fallen off the bus";
    if let Some(recorder) = &world.recorder {
        recorder.mark(device.key, memory_trace::MarkKind::DeviceLost, reason);
    }
    world.registry.invalidate_device(device.key, reason);
    // Idle sequences and weights on the lost device: dropping their handles makes no
    // callback; termination retires them.
    drop(device.kv.drain());
    drop(device.weights.lock().unwrap_or_else(PoisonError::into_inner).take());
    let mut polls = 0;
    let termination = loop {
        match world.registry.confirm_context_terminated(&old_context) {
            Ok(report) => break report,
            Err(RegistryError::ContextNotQuiescent { .. }) => {
                polls += 1;
                std::thread::sleep(Duration::from_micros(200));
            }
            Err(other) => return Err(other.into()),
        }
    };
    let context = world.registry.register_provider_context(device.key, Arc::new(format!("{} context", device.name)))?;
    *device.context.lock().unwrap_or_else(PoisonError::into_inner) = context;
    world.install(device, world.backend())?;
    world.load_weights(device)?;
    progress.set_message(format!("{} lost and replaced", device.name));
    let _ = world.registry.remove_provider_context(&old_context);
    Ok(Some(LossReport { device: device.name.clone(), after_requests: served, polls, termination }))
}

/// Releases everything still held, removes the replaced mechanisms, and checks that
/// every allocation is accounted for.
fn shut_down(world: &World, events: &Events) -> Check {
    for device in &world.devices {
        for sequence in device.kv.drain() {
            sequence.release(&world.ledger);
        }
        if let Some((binding, weights)) = device.weights.lock().unwrap_or_else(PoisonError::into_inner).take() {
            world.ledger.release(&binding, weights);
        }
    }
    let mut removed = 0;
    for device in &world.devices {
        let retired = std::mem::take(&mut *device.retired.lock().unwrap_or_else(PoisonError::into_inner));
        for mechanism in retired {
            removed += usize::from(world.registry.remove(&mechanism).is_ok());
        }
    }
    world.governor.return_idle_credit();
    Check::new(world, events, removed)
}

pub(crate) use world::MIB;

#[cfg(test)]
mod tests {
    use memory_governor::{AllocationRequest, BoundAllocation, MemoryBinding, MemoryRole};

    use super::ledger::{Refusal, Scope};
    use super::world::{DEVICE_BUDGET, PLATFORM, WEIGHTS};
    use super::*;

    const PAGE: u64 = 64 << 10;

    fn ask(world: &World, binding: &MemoryBinding, bytes: u64) -> Result<BoundAllocation, Refusal> {
        let request = AllocationRequest::new(bytes as usize, 256).unwrap().with_role(MemoryRole::Activations);
        world.ledger.allocate(binding, request).map_err(|error| world.ledger.classify(&error))
    }

    /// Every limit's refusal on one pooled device, each filed under its scope with a
    /// message that shows allocated vs reserved and what the ladder did: a tenant past
    /// its quota; a request past the device limit after the holders were asked; and a
    /// request that fits the tenants' charges but not what the process holds, because a
    /// pool keeps 2 MiB idle in a segment pinned by a live block (a 4 MiB segment
    /// freed, then split for a 2 MiB block), which trimming cannot give back.
    #[test]
    fn each_limit_refuses_with_its_scope_and_the_ladder_in_the_message() {
        let world = World::new(false, None).unwrap();
        let device = &world.devices[0];
        world.install(device, Backend::Pooled).unwrap();
        let bind = |authority: usize| world.registry.bind_registered(&device.route(authority)).unwrap();
        let (a, b) = (bind(PLATFORM + 1), bind(PLATFORM + 2));
        let mut held = Vec::new();
        let freed = ask(&world, &a, 4 * MIB).unwrap();
        assert!(world.ledger.release(&a, freed));
        held.push((a.clone(), ask(&world, &a, 2 * MIB).unwrap()));
        // The device at 156 MiB charged: weights 48, tenant-b its whole 48, tenant-a 60.
        for _ in 0..48 * MIB / PAGE {
            held.push((b.clone(), ask(&world, &b, PAGE).unwrap()));
        }
        for _ in 0..58 * MIB / PAGE {
            held.push((a.clone(), ask(&world, &a, PAGE).unwrap()));
        }
        assert_eq!(world.governor.snapshot().devices[0].allocated, DEVICE_BUDGET - 4 * MIB);
        assert_eq!(WEIGHTS, 48 * MIB);

        assert_eq!(ask(&world, &b, PAGE).unwrap_err(), Refusal::Budget, "tenant-b is at its quota");
        assert_eq!(ask(&world, &a, 8 * MIB).unwrap_err(), Refusal::Budget, "156 + 8 MiB is past the limit");
        // 159 MiB charged fits, but with the 2 MiB the pool cannot give back the process
        // would hold 161 MiB.
        assert_eq!(ask(&world, &a, 3 * MIB).unwrap_err(), Refusal::Budget, "past the limit on reserved memory");

        let refusals = world.ledger.budget_refusals();
        let scopes: Vec<Scope> = refusals.keys().copied().collect();
        assert_eq!(scopes, [Scope::Reserved, Scope::Device, Scope::Authority], "{refusals:#?}");
        for (scope, (count, message)) in &refusals {
            assert_eq!(*count, 1, "{scope:?}");
            for shown in ["allocated", "reserved", "largest free block", "fragmentation"] {
                assert!(message.contains(shown), "{scope:?} lacks {shown:?}: {message}");
            }
        }
        let ladder = &refusals[&Scope::Reserved].1;
        for rung in ["trimming caches gave back", "reclaim holders freed", "kv-cache (idle sequences)"] {
            assert!(ladder.contains(rung), "the ladder's refusal lacks {rung:?}: {ladder}");
        }
        assert!(refusals[&Scope::Device].1.contains("reclaim holders freed"), "{}", refusals[&Scope::Device].1);
        let ladder = world.governor.snapshot().devices[0].ladder.clone();
        assert_eq!(ladder.refused_over_reserved, 1, "{ladder:?}");

        for (binding, block) in held {
            assert!(world.ledger.release(&binding, block));
        }
    }
}
