//! Stress: four worker threads run mixed operations (bind, allocate, release through
//! the right and the wrong binding, views, deferred release through a small queue,
//! drops, hand-offs of handles between threads) over one registry whose allocators
//! (`RecordingAllocator` over `FaultyAllocator` over `HostHeap`) inject failed
//! allocations, failed releases and partial releases. A control thread plans the
//! faults, rotates the host device's selection (register, select, retire, remove),
//! retries quarantine, runs the queues, and half-way through invalidates the
//! accelerator and polls `confirm_context_terminated` until it succeeds.
//!
//! Afterwards every block each heap handed out is accounted for: released exactly once
//! (each non-injected release callback freed exactly one block), still quarantined, or
//! lost (handed to `forget_lost`, matching the termination report); nothing is in
//! flight; every mechanism can be removed. Operations per second go to stderr.
//!
//! `MEMORY_STRESS_SECS` bounds the run (default 2 seconds); the time bound only limits
//! how long the run lasts, nothing asserts on timing.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::HeldQueue;
use memory_api::ReleaseSummary;
use memory_api::{
    AllocError, AllocationRequest, AuthorityIdentity, DeviceAllocator, DeviceKey, MechanismIdentity,
    ProviderContextIdentity, QueueRefusalReason, ReleaseError,
};
use memory_binding::{
    AllocateError, BindingRegistry, BoundAllocation, DropPolicy, HandleError, MechanismOptions, MechanismState,
    MemoryBinding, RegistryError, TerminationReport, ViewError,
};
use memory_testkit::{Callback, FaultyAllocator, HostHeap, RecordingAllocator, is_injected};

type Recorder = RecordingAllocator<FaultyAllocator<HostHeap>>;

const GPU: DeviceKey = DeviceKey::device(0);
const HOST: DeviceKey = DeviceKey::host(1);
const DEVICES: [DeviceKey; 2] = [GPU, HOST];
const WORKERS: usize = 4;
const QUEUE_CAPACITY: usize = 8;
const SIZES: [usize; 5] = [0, 64, 100, 4096, 8192];
/// Handles one worker keeps at most.
const HELD: usize = 32;

fn seconds() -> f64 {
    std::env::var("MEMORY_STRESS_SECS").ok().and_then(|s| s.parse().ok()).filter(|s: &f64| *s > 0.0).unwrap_or(2.0)
}

/// xorshift64*: a deterministic per-thread generator (no shared state).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn device_index(device: DeviceKey) -> usize {
    DEVICES.iter().position(|d| *d == device).unwrap()
}

struct Mechanism {
    id: MechanismIdentity,
    allocator: Arc<Recorder>,
}

struct Shared {
    registry: BindingRegistry,
    queues: [Arc<HeldQueue>; 2],
    mechanisms: Mutex<Vec<Mechanism>>,
    stop: AtomicBool,
    /// Handles passed between threads (released by whoever takes them).
    mailbox: Mutex<Vec<(BoundAllocation, MemoryBinding)>>,
    allocated: AtomicU64,
}

impl Shared {
    fn register(
        &self,
        context: ProviderContextIdentity,
        authority: AuthorityIdentity,
        device: DeviceKey,
        defer: bool,
    ) -> MechanismIdentity {
        let allocator = Arc::new(RecordingAllocator::new(FaultyAllocator::new(HostHeap::on_device(device))));
        let queue = &self.queues[device_index(device)];
        let options = MechanismOptions::default().with_drop_policy(defer.then(|| DropPolicy::Defer(queue.clone())));
        let id = self.registry.register_allocator_with(&context, &authority, allocator.clone(), options).unwrap();
        self.mechanisms.lock().unwrap().push(Mechanism { id, allocator });
        id
    }
}

#[derive(Debug, Default)]
struct Tally {
    ops: u64,
    allocated: u64,
    released: u64,
    partial: u64,
    refused: u64,
    deferred: u64,
    lost: u64,
    mismatched: u64,
    views: u64,
    handed_over: u64,
}

/// What a release said, and whether the handle comes back to the holder.
fn settle(
    tally: &mut Tally,
    what: &str,
    result: Result<ReleaseSummary, memory_binding::Rejected<BoundAllocation>>,
) -> Option<BoundAllocation> {
    match result {
        Ok(ReleaseSummary::Complete { .. }) => tally.released += 1,
        Ok(ReleaseSummary::Quarantined { .. }) => tally.partial += 1,
        Ok(other) => panic!("{what}: unexpected report {other:?}"),
        Err(rejected) => match &rejected.reason {
            // Lost or terminated: nothing was called; dropping the handle is all that is left.
            HandleError::DeviceLost { .. } | HandleError::StaleAllocation => tally.lost += 1,
            HandleError::ReleaseFailed(ReleaseError::Backend(source)) if is_injected(source) => {
                tally.refused += 1;
                return Some(rejected.handle);
            }
            other => panic!("{what}: unexpected refusal {other}"),
        },
    }
    None
}

fn worker(shared: &Shared, seed: u64) -> Tally {
    let mut rng = Rng::new(seed);
    let mut tally = Tally::default();
    let mut bindings: [Option<MemoryBinding>; 2] = [None, None];
    let mut held: Vec<(BoundAllocation, MemoryBinding)> = Vec::new();
    while !shared.stop.load(Ordering::Relaxed) {
        tally.ops += 1;
        let d = rng.below(DEVICES.len());
        match rng.below(100) {
            0..=29 => {
                if held.len() >= HELD {
                    drop(held.swap_remove(rng.below(held.len())));
                }
                let binding = match &bindings[d] {
                    Some(b) if b.state() == MechanismState::Active => b.clone(),
                    _ => match shared.registry.bind(DEVICES[d]) {
                        Ok(b) => {
                            bindings[d] = Some(b.clone());
                            b
                        }
                        Err(_) => continue, // no selection right now (rotation or loss)
                    },
                };
                let bytes = SIZES[rng.below(SIZES.len())];
                match binding.allocate(AllocationRequest::new(bytes, 64).unwrap()) {
                    Ok(block) => {
                        assert_eq!((block.bytes(), block.device()), (bytes, Some(DEVICES[d])));
                        tally.allocated += 1;
                        shared.allocated.fetch_add(1, Ordering::Relaxed);
                        held.push((block, binding));
                    }
                    Err(AllocateError::Inactive { .. } | AllocateError::DeviceLost { .. }) => bindings[d] = None,
                    Err(AllocateError::Allocator(AllocError::Backend { source, .. })) if is_injected(&source) => {}
                    Err(other) => panic!("allocate: {other}"),
                }
            }
            30..=54 if !held.is_empty() => {
                let (block, binding) = held.swap_remove(rng.below(held.len()));
                if let Some(block) = settle(&mut tally, "release", binding.release(block)) {
                    held.push((block, binding));
                }
            }
            55..=64 if !held.is_empty() => {
                tally.views += 1;
                let (block, _) = &held[rng.below(held.len())];
                let (offset, len) = (rng.below(block.bytes() + 2), rng.below(block.bytes() + 2));
                let fits = offset + len <= block.bytes();
                match block.view(offset, len) {
                    Ok(view) => assert!(fits && view.address().get() == block.address().get() + offset as u64),
                    Err(ViewError::OutOfBounds { .. }) => assert!(!fits),
                    Err(ViewError::Handle(HandleError::DeviceLost { .. } | HandleError::StaleAllocation)) => {}
                    Err(other) => panic!("view: {other}"),
                }
            }
            65..=74 if !held.is_empty() => {
                let (block, binding) = held.swap_remove(rng.below(held.len()));
                let queue = &shared.queues[device_index(binding.device())];
                match binding.release_deferred(block, &**queue) {
                    Ok(()) => tally.deferred += 1,
                    Err(rejected) => match rejected.reason {
                        HandleError::QueueRefused(QueueRefusalReason::Full { .. }) => {
                            held.push((rejected.handle, binding))
                        }
                        HandleError::DeviceLost { .. } | HandleError::StaleAllocation => tally.lost += 1,
                        other => panic!("release_deferred: {other}"),
                    },
                }
            }
            75..=81 if !held.is_empty() => drop(held.swap_remove(rng.below(held.len()))),
            82..=85 if !held.is_empty() => {
                // Through a binding of the other device: always refused, handle back.
                let i = rng.below(held.len());
                let other = device_index(held[i].1.device()) ^ 1;
                if let Some(wrong) = bindings[other].clone() {
                    let (block, owner) = held.swap_remove(i);
                    let rejected = wrong.release(block).unwrap_err();
                    assert!(matches!(rejected.reason, HandleError::BindingMismatch { .. }), "{}", rejected.reason);
                    tally.mismatched += 1;
                    held.push((rejected.handle, owner));
                }
            }
            86..=89 => {
                if rng.below(2) == 0 && !held.is_empty() {
                    let handed = held.swap_remove(rng.below(held.len()));
                    shared.mailbox.lock().unwrap().push(handed);
                } else {
                    let taken = shared.mailbox.lock().unwrap().pop();
                    if let Some((block, binding)) = taken {
                        tally.handed_over += 1;
                        if let Some(block) =
                            settle(&mut tally, "release of a handed-over block", binding.release(block))
                        {
                            held.push((block, binding));
                        }
                    }
                }
            }
            90..=92 => drop(shared.queues[d].run_all()),
            _ => bindings[d] = shared.registry.bind(DEVICES[d]).ok(),
        }
    }
    drop(held); // each by its mechanism's drop policy
    tally
}

struct Control {
    ops: u64,
    polls: u64,
    report: Option<TerminationReport>,
    lost_mechanisms: Vec<MechanismIdentity>,
}

fn control(
    shared: &Shared,
    seconds: f64,
    gpu: [ProviderContextIdentity; 1],
    host: (ProviderContextIdentity, AuthorityIdentity),
) -> Control {
    let mut rng = Rng::new(0xC0FFEE);
    let start = Instant::now();
    let mut out = Control { ops: 0, polls: 0, report: None, lost_mechanisms: Vec::new() };
    let mut host_selected = shared.registry.selected(HOST).unwrap();
    let mut retired: Vec<MechanismIdentity> = Vec::new();
    while start.elapsed().as_secs_f64() < seconds {
        out.ops += 1;
        std::thread::sleep(Duration::from_micros(200));
        let mechanisms: Vec<(MechanismIdentity, Arc<Recorder>)> =
            shared.mechanisms.lock().unwrap().iter().map(|m| (m.id, m.allocator.clone())).collect();
        let (id, allocator) = &mechanisms[rng.below(mechanisms.len())];
        match rng.below(10) {
            0..=3 => {
                // Mostly on a selected mechanism, where the traffic is.
                let selected = shared.registry.selected(DEVICES[rng.below(2)]);
                let target = selected.and_then(|s| mechanisms.iter().find(|(m, _)| *m == s)).map(|(_, a)| a);
                let faulty = target.unwrap_or(allocator).inner();
                let n = 1 + rng.below(8) as u64;
                match rng.below(3) {
                    0 => faulty.fail_nth(Callback::Allocate, n),
                    1 => faulty.fail_nth(Callback::Release, n),
                    _ => faulty.quarantine_nth_release(n, 0, 64),
                }
            }
            4 | 5 => {
                // Rotate the host device: a new mechanism takes over, the old one retires.
                let next = shared.register(host.0, host.1, HOST, false);
                shared.registry.select(&next).unwrap();
                shared.registry.retire(&host_selected).unwrap();
                retired.push(std::mem::replace(&mut host_selected, next));
                retired.retain(|m| match shared.registry.remove(m) {
                    Ok(()) => false,
                    Err(RegistryError::NotQuiescent { .. }) => true,
                    Err(other) => panic!("remove: {other}"),
                });
            }
            6 => match shared.registry.retry_quarantined(id) {
                Ok(_) | Err(RegistryError::InvalidState { .. } | RegistryError::Unknown { .. }) => {}
                Err(other) => panic!("retry: {other}"),
            },
            7 => drop(shared.queues[rng.below(2)].run_all()),
            8 => {
                for snapshot in shared.registry.snapshots().mechanisms {
                    assert!(snapshot.quarantined.iter().all(|q| q.residual_bytes <= q.bytes), "{snapshot:?}");
                }
            }
            _ => match shared.registry.select(id) {
                Ok(_) | Err(RegistryError::InvalidState { .. } | RegistryError::Unknown { .. }) => {}
                Err(other) => panic!("select: {other}"),
            },
        }
        if out.report.is_none() && start.elapsed().as_secs_f64() >= seconds / 2.0 {
            out.lost_mechanisms = mechanisms.iter().filter(|(_, a)| a.device() == GPU).map(|(m, _)| *m).collect();
            let report = shared.registry.invalidate_device(GPU, "stress: device lost");
            assert_eq!(report.mechanisms, out.lost_mechanisms.len());
            let polling = Instant::now();
            let terminated = loop {
                match shared.registry.confirm_context_terminated(&gpu[0]) {
                    Ok(report) => break report,
                    Err(RegistryError::ContextNotQuiescent { .. }) => {
                        out.polls += 1;
                        // Queued releases count as in flight until they run.
                        drop(shared.queues[0].run_all());
                        std::thread::yield_now();
                        assert!(polling.elapsed() < Duration::from_secs(120), "termination never became quiescent");
                    }
                    Err(other) => panic!("confirm: {other}"),
                }
            };
            assert!(!terminated.already_terminated);
            out.report = Some(terminated);
            // A new context takes the device over.
            let context = shared.registry.register_provider_context(GPU, Arc::new("after loss")).unwrap();
            let authority = shared.registry.register_authority(GPU, Arc::new("after loss")).unwrap();
            shared.register(context, authority, GPU, false);
            shared.register(context, authority, GPU, true);
        }
    }
    out
}

#[test]
#[cfg_attr(miri, ignore = "time-bounded multi-threaded stress: hours under Miri")]
fn concurrent_mixed_operations_with_faults_and_device_loss_account_for_every_block() {
    install_pause_hook(); // before any event, so the other tests' hook sees every callsite
    let seconds = seconds();
    let registry = BindingRegistry::new();
    let shared = Shared {
        registry: registry.clone(),
        queues: DEVICES.map(|d| Arc::new(HeldQueue::new(d, QUEUE_CAPACITY))),
        mechanisms: Mutex::new(Vec::new()),
        stop: AtomicBool::new(false),
        mailbox: Mutex::new(Vec::new()),
        allocated: AtomicU64::new(0),
    };
    let gpu_context = registry.register_provider_context(GPU, Arc::new("gpu")).unwrap();
    let gpu_authority = registry.register_authority(GPU, Arc::new("tenant")).unwrap();
    shared.register(gpu_context, gpu_authority, GPU, false);
    shared.register(gpu_context, gpu_authority, GPU, true);
    let host_context = registry.register_provider_context(HOST, Arc::new("host")).unwrap();
    let host_authority = registry.register_authority(HOST, Arc::new("tenant")).unwrap();
    shared.register(host_context, host_authority, HOST, false);

    let start = Instant::now();
    let (tallies, control) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..WORKERS)
            .map(|i| {
                let shared = &shared;
                scope.spawn(move || worker(shared, i as u64 + 1))
            })
            .collect();
        let control = control(&shared, seconds, [gpu_context], (host_context, host_authority));
        shared.stop.store(true, Ordering::Relaxed);
        let tallies: Vec<Tally> = workers.into_iter().map(|w| w.join().unwrap()).collect();
        (tallies, control)
    });
    let elapsed = start.elapsed().as_secs_f64();

    // As the workers stopped: every block a heap still holds is a record (a handle in
    // the mailbox, or lost with its device), quarantined, queued, or forgotten.
    let mechanisms = std::mem::take(&mut *shared.mechanisms.lock().unwrap());
    for m in &mechanisms {
        let queued: usize =
            shared.queues.iter().map(|q| q.count_where(|p| p.identity().binding().mechanism() == m.id)).sum();
        let (live, quarantined, in_flight) = match registry.snapshot(&m.id) {
            Ok(s) => (s.live_allocations, s.quarantined.len(), s.in_flight),
            Err(RegistryError::Unknown { .. }) => (0, 0, 0), // removed while quiescent
            Err(other) => panic!("snapshot: {other}"),
        };
        assert_eq!(in_flight, queued, "{}: in flight beyond the queued releases", m.id);
        let held = m.allocator.inner().inner().stats().unwrap().live_allocations;
        let accounted = (live + quarantined + queued) as u64 + m.allocator.forgotten_blocks();
        assert_eq!(held, accounted, "{}: blocks held by the heap vs. recorded + quarantined + queued + lost", m.id);
    }

    // Hand everything back and drain: pending faults off, queues run, quarantine retried.
    drop(std::mem::take(&mut *shared.mailbox.lock().unwrap()));
    for m in &mechanisms {
        m.allocator.inner().clear();
    }
    for queue in &shared.queues {
        queue.run_all();
        assert_eq!(queue.len(), 0);
    }
    for m in &mechanisms {
        if let Ok(retry) = registry.retry_quarantined(&m.id) {
            assert_eq!(retry.still_quarantined, 0, "with no faults planned every quarantined block releases");
        }
    }

    // Every block each heap handed out is accounted for.
    let report = control.report.expect("the device was invalidated and its context confirmed terminated");
    let mut forgotten_by_lost = 0;
    let mut allocated = 0;
    let (mut injected, mut forgotten_total) = (0, 0);
    for m in &mechanisms {
        let heap = m.allocator.inner().inner().stats().unwrap();
        let forgotten = m.allocator.forgotten_blocks();
        let (live, quarantined) = match registry.snapshot(&m.id) {
            Ok(snapshot) => {
                assert_eq!(snapshot.in_flight, 0, "{}: still in flight", m.id);
                let expected_state =
                    if control.lost_mechanisms.contains(&m.id) { MechanismState::Terminated } else { snapshot.state };
                assert_eq!(snapshot.state, expected_state);
                (snapshot.live_allocations as u64, snapshot.quarantined.len() as u64)
            }
            Err(RegistryError::Unknown { .. }) => (0, 0), // removed while quiescent
            Err(other) => panic!("snapshot: {other}"),
        };
        assert_eq!(live + quarantined, 0, "{}: every handle was dropped and every quarantine retried", m.id);
        assert_eq!(heap.live_allocations, forgotten, "{}: the heap still holds exactly the lost blocks", m.id);
        if control.lost_mechanisms.contains(&m.id) {
            forgotten_by_lost += forgotten;
            assert_eq!(m.allocator.calls(Callback::ForgetLost), 1, "{}", m.id);
        } else {
            assert_eq!(forgotten, 0, "{}: only the lost context's blocks are forgotten", m.id);
        }
        // Every release callback that was not an injected fault freed exactly one block,
        // and every allocate callback that was not injected made one.
        let freed = heap.allocations_total - heap.live_allocations;
        let calls = m.allocator.calls(Callback::Allocate) + m.allocator.calls(Callback::Release);
        assert_eq!(
            calls,
            heap.allocations_total + freed + m.allocator.inner().injected(),
            "{}: a release freed nothing or twice",
            m.id
        );
        assert_eq!(m.allocator.in_flight(), 0);
        allocated += heap.allocations_total;
        injected += m.allocator.inner().injected();
        forgotten_total += forgotten;
    }
    assert_eq!(allocated, shared.allocated.load(Ordering::Relaxed), "a block was allocated outside the registry");
    assert_eq!((report.lost_allocations + report.discharged_quarantine) as u64, forgotten_by_lost);
    assert_eq!(report.mechanisms, control.lost_mechanisms.len());

    // Quiescent: everything can be retired and removed.
    for m in &mechanisms {
        match registry.retire(&m.id) {
            Ok(()) | Err(RegistryError::InvalidState { .. } | RegistryError::Unknown { .. }) => {}
            Err(other) => panic!("retire: {other}"),
        }
        match registry.remove(&m.id) {
            Ok(()) | Err(RegistryError::Unknown { .. }) => {}
            Err(other) => panic!("remove {}: {other}", m.id),
        }
    }
    assert!(registry.snapshots().mechanisms.is_empty());

    let total: Tally = tallies.iter().fold(Tally::default(), |mut t, w| {
        t.ops += w.ops;
        t.allocated += w.allocated;
        t.released += w.released;
        t.partial += w.partial;
        t.refused += w.refused;
        t.deferred += w.deferred;
        t.lost += w.lost;
        t.mismatched += w.mismatched;
        t.views += w.views;
        t.handed_over += w.handed_over;
        t
    });
    assert!(total.allocated > 0 && total.released > 0, "the workers did nothing: {total:?}");
    let ops = total.ops + control.ops;
    eprintln!(
        "stress: {WORKERS} workers + control, {elapsed:.2} s, {ops} ops ({:.0} ops/s); {total:?}; \
         {injected} faults injected, {forgotten_total} blocks lost with the device; \
         control {} ops, {} termination polls; termination {report:?}",
        ops as f64 / elapsed,
        control.ops,
        control.polls,
    );
}

// ---------------------------------------------------------------------------------
// Deterministic interleavings
// ---------------------------------------------------------------------------------

/// A process-wide tracing subscriber that pauses a thread at the first WARN-or-above
/// event whose message matches what that thread armed: a precise hook inside the
/// registry, between the event and what follows it. Installed before any test of
/// this binary emits an event (tracing caches per-callsite interest process-wide, so a
/// thread-scoped subscriber could miss events under concurrent tests); it enables
/// nothing below WARN, so the hot path's trace events stay off.
struct PauseAt;

/// What an armed thread waits for, and how it reports and resumes.
struct Armed {
    message: &'static str,
    signal: std::sync::mpsc::Sender<Signal>,
    resume: std::sync::mpsc::Receiver<()>,
}

enum Signal {
    Reached,
    Done,
}

thread_local! {
    static ARMED: std::cell::RefCell<Option<Armed>> = const { std::cell::RefCell::new(None) };
}

struct Message(String);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl tracing::Subscriber for PauseAt {
    fn register_callsite(&self, metadata: &'static tracing::Metadata<'static>) -> tracing::subscriber::Interest {
        if self.enabled(metadata) {
            tracing::subscriber::Interest::sometimes()
        } else {
            tracing::subscriber::Interest::never()
        }
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::WARN)
    }
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let Some(armed) = ARMED.with(|armed| armed.borrow_mut().take()) else { return };
        let mut message = Message(String::new());
        event.record(&mut message);
        if message.0 != armed.message {
            ARMED.with(|slot| *slot.borrow_mut() = Some(armed));
            return;
        }
        let _ = armed.signal.send(Signal::Reached);
        let _ = armed.resume.recv();
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Installs [`PauseAt`] once per process; every test of this binary calls it first.
fn install_pause_hook() {
    static INSTALLED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    INSTALLED.get_or_init(|| tracing::subscriber::set_global_default(PauseAt).expect("no other global subscriber"));
}

/// Sends `Done` when the worker's closure ends, normally or by panic.
struct DoneGuard(std::sync::mpsc::Sender<Signal>);

impl Drop for DoneGuard {
    fn drop(&mut self) {
        let _ = self.0.send(Signal::Done);
    }
}

/// Runs `work` on another thread, paused just before a block enters a quarantine
/// list; runs `meanwhile` there, then lets `work` finish.
///
/// # Panics
/// If `work` ends without reaching the pause point (the hook is no longer where the
/// test expects it), or if `work` panics.
fn paused_before_quarantine(work: impl FnOnce() + Send, meanwhile: impl FnOnce()) {
    install_pause_hook();
    let (signal, signals) = std::sync::mpsc::channel();
    let (resume, resumed) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        let done = DoneGuard(signal.clone());
        let worker = scope.spawn(move || {
            let _done = done;
            let armed = Armed { message: "allocation quarantined", signal, resume: resumed };
            ARMED.with(|slot| *slot.borrow_mut() = Some(armed));
            work();
        });
        match signals.recv().expect("the worker reports") {
            Signal::Reached => {
                meanwhile();
                resume.send(()).unwrap();
                worker.join().unwrap();
            }
            Signal::Done => {
                worker.join().unwrap();
                panic!("the work ended without reaching the pause point (\"allocation quarantined\")");
            }
        }
    });
}

/// Drops `block` paused just before it enters the quarantine list.
fn drop_paused_before_quarantine(block: BoundAllocation, meanwhile: impl FnOnce()) {
    paused_before_quarantine(move || drop(block), meanwhile);
}

#[test]
fn termination_and_removal_wait_for_an_explicit_partial_release_in_transit() {
    let registry = BindingRegistry::new();
    let allocator = Arc::new(RecordingAllocator::new(FaultyAllocator::new(HostHeap::on_device(GPU))));
    let context = registry.register_provider_context(GPU, Arc::new(())).unwrap();
    let authority = registry.register_authority(GPU, Arc::new(())).unwrap();
    let mechanism = registry.register_allocator(&context, &authority, allocator.clone()).unwrap();
    let binding = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(AllocationRequest::new(8192, 64).unwrap()).unwrap();
    registry.retire(&mechanism).unwrap();
    allocator.inner().quarantine_nth_release(1, 4096, 4096);
    paused_before_quarantine(
        || assert!(matches!(binding.release(block), Ok(ReleaseSummary::Quarantined { .. }))),
        || {
            // Record taken, block not yet quarantined: the release is in flight.
            let removed = registry.remove(&mechanism);
            assert!(matches!(removed, Err(RegistryError::NotQuiescent { in_flight: 1, .. })), "{removed:?}");
            registry.invalidate_device(GPU, "lost during a release");
            let confirmed = registry.confirm_context_terminated(&context);
            assert!(matches!(confirmed, Err(RegistryError::ContextNotQuiescent { in_flight: 1, .. })), "{confirmed:?}");
        },
    );
    let report = registry.confirm_context_terminated(&context).unwrap();
    assert_eq!((report.lost_allocations, report.discharged_quarantine), (0, 1));
    assert_eq!(allocator.forgotten_blocks(), 1);
    registry.remove(&mechanism).unwrap();
}

#[test]
fn termination_cannot_complete_while_a_dropped_block_is_on_its_way_to_quarantine() {
    let registry = BindingRegistry::new();
    let allocator = Arc::new(RecordingAllocator::new(FaultyAllocator::new(HostHeap::on_device(GPU))));
    let context = registry.register_provider_context(GPU, Arc::new(())).unwrap();
    let authority = registry.register_authority(GPU, Arc::new(())).unwrap();
    let mechanism = registry.register_allocator(&context, &authority, allocator.clone()).unwrap();
    let binding = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(AllocationRequest::new(64, 64).unwrap()).unwrap();

    let mut confirmed = None;
    drop_paused_before_quarantine(block, || {
        // The record is already taken, the block not yet quarantined.
        registry.invalidate_device(GPU, "lost while a drop was under way");
        confirmed = Some(registry.confirm_context_terminated(&context));
    });
    let snapshot = registry.snapshot(&mechanism).unwrap();
    // Either termination waited for the drop (not quiescent), or the block reached
    // forget_lost; it must never be left quarantined on a terminated mechanism.
    if let Some(Ok(report)) = confirmed {
        assert_eq!(
            (snapshot.state, snapshot.quarantined.len(), report.lost_allocations + report.discharged_quarantine),
            (MechanismState::Terminated, 0, 1),
            "termination completed while the block was in transit: it is stranded in quarantine, never forgotten"
        );
    }
}

#[test]
fn remove_cannot_succeed_while_a_dropped_block_is_on_its_way_to_quarantine() {
    let registry = BindingRegistry::new();
    let allocator = Arc::new(RecordingAllocator::new(FaultyAllocator::new(HostHeap::on_device(GPU))));
    let context = registry.register_provider_context(GPU, Arc::new(())).unwrap();
    let authority = registry.register_authority(GPU, Arc::new(())).unwrap();
    let mechanism = registry.register_allocator(&context, &authority, allocator.clone()).unwrap();
    let binding = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(AllocationRequest::new(64, 64).unwrap()).unwrap();
    registry.retire(&mechanism).unwrap();

    let mut removed = None;
    drop_paused_before_quarantine(block, || removed = Some(registry.remove(&mechanism)));
    // The block is still owned by the allocator, so the mechanism must still be
    // registered (with the block quarantined), not removed with the block lost.
    assert_eq!(allocator.inner().inner().stats().unwrap().live_allocations, 1);
    assert!(
        matches!(removed, Some(Err(RegistryError::NotQuiescent { .. }))),
        "remove succeeded while a block was in transit to quarantine: {removed:?}"
    );
    assert_eq!(registry.snapshot(&mechanism).unwrap().quarantined.len(), 1);
}

/// Refuses every release without mutating anything (a busy device), so a handle can
/// be released over and over and always comes back.
struct AlwaysBusy;

impl DeviceAllocator for AlwaysBusy {
    fn device(&self) -> DeviceKey {
        HOST
    }
    fn name(&self) -> &str {
        "always-busy"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<memory_api::RawAllocation, AllocError> {
        let address = memory_api::DeviceAddress::new(0x10_0000).unwrap();
        Ok(memory_api::RawAllocation::new(address, request.bytes(), request.align(), HOST, 0))
    }
    fn release(&self, allocation: memory_api::RawAllocation) -> memory_api::ReleaseOutcome {
        let busy = memory_api::BackendError { backend: "test", operation: "release", code: 1, detail: "busy".into() };
        memory_api::ReleaseOutcome::failed(allocation, ReleaseError::Backend(busy))
    }
}

/// `remove` reads live records, quarantine and in-flight counts one after another
/// without first closing the mechanism. A release on the retired mechanism that takes
/// the record before the first read and puts it back (refused) or quarantines it, and
/// ends, before the last read, is missed by all three. Many pins (threads that touched
/// the mechanism) widen the window between the reads; one thread releases a live handle
/// in a loop while another calls `remove`. Bounded by rounds, not by time.
#[test]
#[cfg_attr(miri, ignore = "100 rounds of 64 threads: hours under Miri")]
fn remove_never_succeeds_while_a_live_handle_is_being_released_and_refused() {
    const PINS: usize = 64;
    const ROUNDS: usize = 100;
    const REMOVALS: usize = 200;
    for round in 0..ROUNDS {
        let registry = BindingRegistry::new();
        let context = registry.register_provider_context(HOST, Arc::new(())).unwrap();
        let authority = registry.register_authority(HOST, Arc::new(())).unwrap();
        let mechanism = registry.register_allocator(&context, &authority, Arc::new(AlwaysBusy)).unwrap();
        let stop = AtomicBool::new(false);
        let ready = std::sync::Barrier::new(2);
        let removed = std::thread::scope(|scope| {
            let releaser = scope.spawn(|| {
                let binding = registry.bind_registered(&mechanism).unwrap();
                let mut block = binding.allocate(AllocationRequest::new(64, 8).unwrap()).unwrap();
                ready.wait();
                while !stop.load(Ordering::Relaxed) {
                    block = binding.release(block).unwrap_err().handle;
                }
                block
            });
            let pinned = std::sync::Barrier::new(PINS + 1);
            std::thread::scope(|pins| {
                for _ in 0..PINS {
                    pins.spawn(|| {
                        let _pin = registry.bind_registered(&mechanism).unwrap();
                        pinned.wait();
                    });
                }
                pinned.wait();
            });
            ready.wait();
            registry.retire(&mechanism).unwrap();
            let removed = (0..REMOVALS).any(|_| registry.remove(&mechanism).is_ok());
            stop.store(true, Ordering::Relaxed);
            let block = releaser.join().unwrap();
            (removed, block.is_valid())
        });
        assert!(
            !removed.0,
            "round {round}: remove succeeded while a handle was live (still valid: {}); its block is now \
             invisible to snapshots, allocation_state and termination",
            removed.1
        );
    }
}
