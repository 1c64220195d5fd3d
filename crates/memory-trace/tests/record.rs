//! Recording: a traced governed allocator behind the registry writes every call with its
//! identity, tenant, role, device, size, alignment, thread, time and caller tag;
//! refusals carry the governor's figures; quarantines, lost blocks and termination are
//! recorded; many threads record whole through small rings.

use std::collections::HashMap;
use std::sync::Arc;

use allocator_cpu::SystemAllocator;
use memory_governor::*;
use memory_testkit::{FaultyAllocator, HostHeap};
use memory_trace::{
    FailureKind, MarkKind, RecordError, Recorder, RecorderConfig, RefusalKind, ReleaseKind, Scope, Trace, What,
    caller_tag, read_trace, replace_caller_tag, set_caller_tag, with_caller_tag,
};

const DEV: DeviceKey = DeviceKey::host(7);

/// A recorder writing into memory; `finish` hands the bytes back.
struct Memory {
    bytes: Arc<std::sync::Mutex<Vec<u8>>>,
}

impl std::io::Write for Memory {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.bytes.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn recorder(config: RecorderConfig) -> (Recorder, Arc<std::sync::Mutex<Vec<u8>>>) {
    let bytes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let recorder = Recorder::to_writer(Memory { bytes: Arc::clone(&bytes) }, config).unwrap();
    (recorder, bytes)
}

fn finish(recorder: Recorder, bytes: &std::sync::Mutex<Vec<u8>>) -> Trace {
    recorder.finish().unwrap();
    let trace = read_trace(&bytes.lock().unwrap()[..]).unwrap();
    assert!(trace.damage.is_none(), "{:?}", trace.damage);
    trace
}

fn request(bytes: usize, role: MemoryRole) -> AllocationRequest {
    AllocationRequest::new(bytes, 256).unwrap().with_role(role)
}

struct Setup {
    registry: BindingRegistry,
    governor: Governor,
    context: ProviderContextIdentity,
    binding: MemoryBinding,
}

fn setup(recorder: &Recorder, inner: Arc<dyn DeviceAllocator>, quota: Option<u64>) -> Setup {
    let registry = BindingRegistry::new();
    let context = registry.register_provider_context(DEV, Arc::new("context")).unwrap();
    let authority = registry.register_authority(DEV, Arc::new("tenant-a")).unwrap();
    let governor = Governor::new();
    governor.set_device_limit(DEV, 1 << 30).unwrap();
    let mut config = AccountConfig::new(DEV, authority).with_label("tenant-a");
    if let Some(quota) = quota {
        config = config.with_quota(quota);
    }
    governor.open_account(config).unwrap();
    let traced = recorder.trace(&governor, governor.govern(inner, authority).unwrap());
    registry.register_allocator(&context, &authority, Arc::new(traced)).unwrap();
    let binding = registry.bind(DEV).unwrap();
    Setup { registry, governor, context, binding }
}

#[test]
fn a_replaced_caller_tag_stays_until_replaced_and_a_guard_restores_what_was_before() {
    assert_eq!(replace_caller_tag(7), 0);
    assert_eq!(caller_tag(), 7, "no guard: the tag stays");
    {
        let _guard = set_caller_tag(8);
        assert_eq!(caller_tag(), 8);
    }
    assert_eq!(caller_tag(), 7, "the guard put back the replaced tag");
    assert_eq!(replace_caller_tag(0), 7);
    assert_eq!(caller_tag(), 0);
}

#[test]
fn every_call_through_the_registry_is_recorded_with_identity_tenant_role_and_caller() {
    let (recorder, bytes) = recorder(RecorderConfig::default());
    let s = setup(&recorder, Arc::new(SystemAllocator::for_device(DEV)), Some(64 << 20));
    std::thread::Builder::new()
        .name("engine-0".into())
        .spawn({
            let binding = s.binding.clone();
            move || {
                let kv = with_caller_tag(42, || binding.allocate(request(10_000, MemoryRole::KvCache))).unwrap();
                let weights = binding.allocate(request(1 << 20, MemoryRole::Weights)).unwrap();
                let _tag = set_caller_tag(43);
                binding.release(kv).unwrap();
                binding.release(weights).unwrap();
            }
        })
        .unwrap()
        .join()
        .unwrap();
    let trace = finish(recorder, &bytes);
    assert_eq!(trace.version, (memory_trace::MAJOR, memory_trace::MINOR));
    assert_eq!(trace.end.map(|end| (end.events, end.dropped)), Some((4, 0)));
    let tenant = &trace.tenants[0];
    assert_eq!((tenant.label.as_str(), tenant.device, tenant.quota), ("tenant-a", DEV, Some(64 << 20)));
    assert_eq!(tenant.device_limit, Some(1 << 30));
    assert!(tenant.allocator.contains("system"), "{}", tenant.allocator);
    assert!(tenant.authority.starts_with("auth:"), "{}", tenant.authority);
    let kinds: Vec<&str> = trace.events.iter().map(|event| event.kind_name()).collect();
    assert_eq!(kinds, ["allocate", "allocate", "release", "release"]);
    let thread = trace.events[0].thread;
    assert_eq!(trace.thread_name(thread), Some("engine-0"));
    assert!(
        trace.events.iter().all(|event| event.thread == thread && event.tenant == tenant.id && event.device == DEV)
    );
    assert!(trace.events.windows(2).all(|pair| pair[0].ts_ns <= pair[1].ts_ns), "monotonic");
    let What::Allocate(kv) = &trace.events[0].what else { panic!() };
    assert_eq!((kv.requested, kv.bytes, kv.align, kv.caller), (10_000, 10_000, 256, 42));
    assert_eq!(trace.events[0].role, Some(MemoryRole::KvCache));
    let What::Allocate(weights) = &trace.events[1].what else { panic!() };
    assert_eq!((weights.bytes, weights.caller), (1 << 20, 0));
    assert_eq!(trace.events[1].role, Some(MemoryRole::Weights));
    let What::Release { block, outcome, residual } = &trace.events[2].what else { panic!() };
    assert_eq!((block.id, block.address, block.caller), (kv.id, kv.address, 43), "the same block, by identity");
    assert_eq!((*outcome, *residual), (ReleaseKind::Complete, 0));
    assert_ne!(kv.id, weights.id, "live blocks have distinct ids");
    drop(s);
}

#[test]
fn a_quota_refusal_carries_its_scope_and_footprint() {
    let (recorder, bytes) = recorder(RecorderConfig::default());
    let s = setup(&recorder, Arc::new(SystemAllocator::for_device(DEV)), Some(1 << 20));
    let held = s.binding.allocate(request(768 << 10, MemoryRole::Weights)).unwrap();
    let refused = s.binding.allocate(request(512 << 10, MemoryRole::KvCache)).unwrap_err();
    assert!(refused.to_string().contains("authority quota"), "{refused}");
    s.binding.release(held).unwrap();
    let trace = finish(recorder, &bytes);
    let What::Refusal(refusal) = &trace.events[1].what else { panic!("{:?}", trace.events[1]) };
    assert_eq!(trace.events[1].role, Some(MemoryRole::KvCache));
    assert_eq!((refusal.kind, refusal.scope), (RefusalKind::Exhausted, Some(Scope::Authority)));
    assert_eq!((refusal.requested, refusal.limit, refusal.used), (512 << 10, 1 << 20, 768 << 10));
    assert_eq!((refusal.device_allocated, refusal.tenant_allocated), (768 << 10, 768 << 10));
    assert!(refusal.to_string().contains("authority quota"), "{refusal}");
}

/// An allocator that is always out of cache room: the governor's recovery ladder runs
/// (trim, reclaim) and refuses with the reserved scope.
struct FullCache;

impl DeviceAllocator for FullCache {
    fn device(&self) -> DeviceKey {
        DEV
    }

    fn name(&self) -> &str {
        "full-cache"
    }

    fn allocate(&self, _request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        Err(AllocError::AdmissionRefused { device: DEV, detail: "the cache's backing is at the device limit".into() })
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        ReleaseOutcome::failed(
            allocation,
            ReleaseError::NotOwned { allocator: "full-cache".into(), device: DEV, address: 0 },
        )
    }
}

#[test]
fn a_recovery_ladder_refusal_is_recorded_with_the_reserved_scope_and_what_trimming_gave_back() {
    let (recorder, bytes) = recorder(RecorderConfig::default());
    let s = setup(&recorder, Arc::new(FullCache), None);
    let refused = s.binding.allocate(request(4096, MemoryRole::Activations)).unwrap_err();
    assert!(refused.to_string().contains("reserved"), "{refused}");
    let trace = finish(recorder, &bytes);
    let What::Refusal(refusal) = &trace.events[0].what else { panic!("{:?}", trace.events) };
    assert_eq!((refusal.kind, refusal.scope), (RefusalKind::Exhausted, Some(Scope::Reserved)));
    assert_eq!(refusal.trimmed, Some(0), "the ladder's first rung ran");
    drop(s);
}

#[test]
fn an_allocator_failure_below_the_governor_is_recorded_as_a_failure() {
    let (recorder, bytes) = recorder(RecorderConfig::default());
    let faulty = Arc::new(FaultyAllocator::new(HostHeap::on_device(DEV)));
    let s = setup(&recorder, Arc::clone(&faulty) as Arc<dyn DeviceAllocator>, None);
    faulty.fail_nth(memory_testkit::Callback::Allocate, 1);
    assert!(s.binding.allocate(request(4096, MemoryRole::Staging)).is_err());
    let trace = finish(recorder, &bytes);
    let What::Failure { requested, error, .. } = &trace.events[0].what else { panic!("{:?}", trace.events) };
    assert_eq!((*requested, *error), (4096, FailureKind::Backend));
}

#[test]
fn a_quarantine_its_retry_and_a_device_loss_with_termination_are_recorded() {
    let (recorder, bytes) = recorder(RecorderConfig::default());
    let faulty = Arc::new(FaultyAllocator::new(HostHeap::on_device(DEV)));
    let s = setup(&recorder, Arc::clone(&faulty) as Arc<dyn DeviceAllocator>, None);
    let quarantined = s.binding.allocate(request(8192, MemoryRole::KvCache)).unwrap();
    let lost = s.binding.allocate(request(4096, MemoryRole::Weights)).unwrap();
    faulty.quarantine_nth_release(1, 2048, 6144);
    s.binding.release(quarantined).unwrap();
    s.registry.invalidate_device(DEV, "xid 79");
    recorder.mark(DEV, MarkKind::DeviceLost, "xid 79");
    s.registry.confirm_context_terminated(&s.context).unwrap();
    drop(lost);
    let trace = finish(recorder, &bytes);
    let kinds: Vec<&str> = trace.events.iter().map(|event| event.kind_name()).collect();
    assert_eq!(kinds, ["allocate", "allocate", "release", "mark", "lost", "lost", "mark"], "{:#?}", trace.events);
    let What::Release { outcome, residual, .. } = &trace.events[2].what else { panic!() };
    assert_eq!((*outcome, *residual), (ReleaseKind::Quarantined, 6144));
    let What::Mark { kind, label, .. } = &trace.events[3].what else { panic!() };
    assert_eq!((*kind, label.as_str()), (MarkKind::DeviceLost, "xid 79"));
    let What::Mark { kind, value, .. } = &trace.events[6].what else { panic!() };
    assert_eq!((*kind, *value), (MarkKind::Terminated, 2));
    drop(s.governor);
}

#[test]
fn many_threads_record_every_event_whole_through_small_rings() {
    const THREADS: usize = 4;
    const PAIRS: usize = 5_000;
    // 64-word rings hold 7 allocation events: threads find them full all the time and
    // drain the rings themselves, several consumers in turn under the output lock.
    let config = RecorderConfig::default().with_ring_words(64);
    let (recorder, bytes) = recorder(config);
    let s = setup(&recorder, Arc::new(SystemAllocator::for_device(DEV)), None);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let binding = s.binding.clone();
            scope.spawn(move || {
                for i in 0..PAIRS {
                    let block = binding.allocate(request(64 + i % 512, MemoryRole::ALL[t % 6])).unwrap();
                    binding.release(block).unwrap();
                }
            });
        }
    });
    let summary_bytes = bytes.lock().unwrap().len();
    assert!(summary_bytes > 0);
    let trace = finish(recorder, &bytes);
    assert_eq!(trace.events.len(), THREADS * PAIRS * 2, "every event, none dropped");
    assert_eq!(trace.end.unwrap().events, (THREADS * PAIRS * 2) as u64);
    // Per thread, the events are in program order: allocate, release, allocate, ...
    let mut by_thread: HashMap<u32, Vec<&memory_trace::Event>> = HashMap::new();
    for event in &trace.events {
        by_thread.entry(event.thread).or_default().push(event);
    }
    assert_eq!(by_thread.len(), THREADS);
    for events in by_thread.values() {
        for (i, pair) in events.chunks(2).enumerate() {
            let (What::Allocate(a), What::Release { block: r, .. }) = (&pair[0].what, &pair[1].what) else {
                panic!("out of order: {pair:?}")
            };
            assert_eq!((a.id, a.address, a.requested), (r.id, r.address, (64 + i % 512) as u64));
        }
    }
    drop(s);
}

#[test]
fn events_after_finish_are_dropped_and_counted_not_written() {
    let (recorder, bytes) = recorder(RecorderConfig::default());
    let s = setup(&recorder, Arc::new(SystemAllocator::for_device(DEV)), None);
    let block = s.binding.allocate(request(128, MemoryRole::Other)).unwrap();
    let summary = recorder.finish().unwrap();
    assert_eq!((summary.events, summary.dropped), (1, 0));
    s.binding.release(block).unwrap();
    let second = recorder.finish().unwrap_err();
    assert!(matches!(&second, RecordError::AlreadyFinished { asked } if asked == "finish"), "{second:?}");
    let mark = recorder.try_mark(DEV, MarkKind::Note, "late").unwrap_err();
    assert_eq!(
        mark.to_string(),
        "a note mark \"late\" was asked of a recording that was already finished (Recorder::finish), so nothing \
         was added to the file; ask before finishing, or record again with a new Recorder"
    );
    recorder.mark(DEV, MarkKind::Note, "later"); // refused, counted and logged
    assert_eq!(recorder.dropped(), 3, "the release and both marks");
    let trace = read_trace(&bytes.lock().unwrap()[..]).unwrap();
    assert_eq!(trace.events.len(), 1);
}

/// Marks racing `finish` on other threads, many times: each `try_mark` either returns
/// `Ok` and its mark is in the file, or is refused as `AlreadyFinished` (and counted);
/// no mark is lost between the two.
#[test]
fn a_mark_racing_finish_is_in_the_file_or_refused_never_lost() {
    const ROUNDS: usize = 200;
    const THREADS: usize = 3;
    for round in 0..ROUNDS {
        let (recorder, bytes) = recorder(RecorderConfig::default());
        let (summary, marked) = std::thread::scope(|scope| {
            let markers: Vec<_> = (0..THREADS)
                .map(|t| {
                    let recorder = &recorder;
                    scope.spawn(move || {
                        let mut marked = Vec::new();
                        for i in 0.. {
                            let label = format!("{t}-{i}");
                            match recorder.try_mark(DEV, MarkKind::Note, &label) {
                                Ok(()) => marked.push(label),
                                Err(RecordError::AlreadyFinished { .. }) => return marked,
                                Err(error) => panic!("{error}"),
                            }
                        }
                        unreachable!()
                    })
                })
                .collect();
            // Finish at a different point of the marking each round.
            for _ in 0..round * 7 {
                std::hint::spin_loop();
            }
            let summary = recorder.finish().unwrap();
            let marked: Vec<String> = markers.into_iter().flat_map(|marker| marker.join().unwrap()).collect();
            (summary, marked)
        });
        let trace = read_trace(&bytes.lock().unwrap()[..]).unwrap();
        assert!(trace.damage.is_none(), "{:?}", trace.damage);
        let mut in_file: Vec<String> = trace
            .events
            .iter()
            .map(|event| match &event.what {
                What::Mark { label, .. } => label.clone(),
                other => panic!("only marks were recorded: {other:?}"),
            })
            .collect();
        let mut marked = marked;
        in_file.sort();
        marked.sort();
        assert_eq!(in_file, marked, "round {round}: the marks answered Ok, exactly");
        assert_eq!(summary.events, marked.len() as u64);
        assert_eq!(recorder.dropped(), THREADS as u64, "round {round}: one refused mark a thread");
    }
}

/// Allocations and releases racing `finish` on other threads, many times: every event
/// is in the file or counted by `Recorder::dropped` once the threads have stopped.
#[test]
fn events_racing_finish_are_in_the_file_or_counted_by_dropped() {
    const ROUNDS: usize = 50;
    const THREADS: usize = 3;
    for round in 0..ROUNDS {
        // Small rings: some threads find theirs full and drain it themselves meanwhile.
        let (recorder, bytes) = recorder(RecorderConfig::default().with_ring_words(64));
        let s = setup(&recorder, Arc::new(SystemAllocator::for_device(DEV)), None);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let events: u64 = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..THREADS)
                .map(|_| {
                    let (binding, stop) = (s.binding.clone(), &stop);
                    scope.spawn(move || {
                        let mut events = 0u64;
                        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                            let block = binding.allocate(request(256, MemoryRole::KvCache)).unwrap();
                            binding.release(block).unwrap();
                            events += 2;
                        }
                        events
                    })
                })
                .collect();
            std::thread::sleep(std::time::Duration::from_micros(200 + 37 * round as u64));
            recorder.finish().unwrap();
            // A little more after the finish: those are dropped.
            std::thread::sleep(std::time::Duration::from_micros(100));
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            workers.into_iter().map(|worker| worker.join().unwrap()).sum()
        });
        let trace = read_trace(&bytes.lock().unwrap()[..]).unwrap();
        assert!(trace.damage.is_none(), "{:?}", trace.damage);
        let written = trace.events.len() as u64;
        assert_eq!(trace.end.unwrap().events, written);
        assert_eq!(written + recorder.dropped(), events, "round {round}: {written} written of {events}");
        drop(s);
    }
}

/// Ten million events from four threads record whole and read back (release build:
/// `cargo test --release -p memory-trace --test record -- --ignored`; about ten seconds).
#[test]
#[ignore = "ten million events: run in release with --ignored"]
fn ten_million_events_record_whole() {
    const THREADS: usize = 4;
    const PAIRS: usize = 1_250_000;
    let path = std::env::temp_dir().join(format!("memory-trace-10m-{}.mtrace", std::process::id()));
    let recorder = Recorder::create(&path).unwrap();
    let s = setup(&recorder, Arc::new(SystemAllocator::for_device(DEV)), None);
    let started = std::time::Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..THREADS {
            let binding = s.binding.clone();
            scope.spawn(move || {
                for i in 0..PAIRS {
                    let block = binding.allocate(request(64 + i % 4096, MemoryRole::KvCache)).unwrap();
                    binding.release(block).unwrap();
                }
            });
        }
    });
    let recorded = started.elapsed();
    let summary = recorder.finish().unwrap();
    let size = std::fs::metadata(&path).unwrap().len();
    let mut count = 0u64;
    let trace =
        memory_trace::scan_trace(std::io::BufReader::new(std::fs::File::open(&path).unwrap()), |_| count += 1).unwrap();
    std::fs::remove_file(&path).unwrap();
    println!(
        "10M events: recorded in {recorded:?}, {size} bytes, {} waits, read back {count}, damage {:?}",
        summary.waits, trace.damage
    );
    assert_eq!((summary.events, count, summary.dropped), (10_000_000, 10_000_000, 0));
    assert!(trace.damage.is_none());
    drop(s);
}

/// An output with room for `room` bytes, then `StorageFull` (a full disk; a write that
/// does not fit takes what fits, as a file does).
struct Full {
    bytes: Arc<std::sync::Mutex<Vec<u8>>>,
    room: usize,
}

impl std::io::Write for Full {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut bytes = self.bytes.lock().unwrap();
        let fits = buf.len().min(self.room - bytes.len());
        if fits == 0 && !buf.is_empty() {
            return Err(std::io::Error::new(std::io::ErrorKind::StorageFull, "no space left on device"));
        }
        bytes.extend_from_slice(&buf[..fits]);
        Ok(fits)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A disk that fills while recording: `finish` says how many bytes reached the file,
/// exactly (it said how many were handed to the recorder's 64 KiB buffer, up to a buffer
/// more than the file holds: 0 bytes on /dev/full read as "after 102 bytes ... readable up
/// to there"), and the file reads up to there.
#[test]
fn a_full_disk_is_an_io_error_that_says_how_many_bytes_reached_the_file() {
    for room in [0, 20, 1000, 100_000] {
        let bytes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let full = Full { bytes: Arc::clone(&bytes), room };
        let recorder = Recorder::to_writer(full, RecorderConfig::default().with_ring_words(64)).unwrap();
        let s = setup(&recorder, Arc::new(SystemAllocator::for_device(DEV)), None);
        for i in 0..5_000 {
            let block = s.binding.allocate(request(64 + i % 512, MemoryRole::KvCache)).unwrap();
            s.binding.release(block).unwrap();
        }
        let error = recorder.finish().unwrap_err();
        let in_file = bytes.lock().unwrap().len() as u64;
        assert_eq!(in_file, room as u64, "the disk filled");
        let RecordError::Io { written, source } = &error else { panic!("{error:?}") };
        assert_eq!(*written, in_file, "room {room}: the bytes that reached the file");
        assert_eq!(source.kind(), std::io::ErrorKind::StorageFull);
        let message = error.to_string();
        assert!(
            message.contains(&format!("after {in_file} bytes reached it")) && message.contains("record again"),
            "{message}"
        );
        // Readable up to there: a file cut inside its header is not a trace yet.
        match read_trace(&bytes.lock().unwrap()[..]) {
            Ok(trace) => {
                let damage = trace.damage.expect("a cut recording is damaged");
                assert!(damage.offset <= in_file && trace.end.is_none(), "{damage}");
            }
            Err(error) => assert!(in_file < 32, "room {room}: {error}"),
        }
        drop(s);
    }
}

/// A ring is allocated by a thread's first event, on its allocation path: ring_words
/// past what rounds up to a power of two panicked there (or made a ring of no words on
/// which the thread spun until the recording finished, in release), and past memory
/// aborted. `to_writer` refuses them, saying what the number counts.
#[test]
fn rings_too_large_to_allocate_are_refused_when_the_recorder_is_made() {
    for words in [usize::MAX, (1 << 63) + 1, RecorderConfig::MAX_RING_WORDS + 1] {
        let Err(error) = Recorder::to_writer(std::io::sink(), RecorderConfig::default().with_ring_words(words)) else {
            panic!("{words} words accepted")
        };
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput);
        let message = error.to_string();
        assert!(
            message.contains(&format!("ring_words is {words} words")) && message.contains("8-byte words, not bytes"),
            "{message}"
        );
    }
    // The largest is taken (no ring exists before a thread records).
    let recorder =
        Recorder::to_writer(std::io::sink(), RecorderConfig::default().with_ring_words(RecorderConfig::MAX_RING_WORDS))
            .unwrap();
    assert_eq!(recorder.finish().unwrap().events, 0);
}

/// A recorder dropped without `finish` (an early return, a `?`) finishes on drop: its
/// events are in the file with the end record, and the traced allocator it made, still
/// in use, records nothing more (counted, not written).
#[test]
fn a_recorder_dropped_without_finish_writes_a_finished_trace() {
    let (recorder, bytes) = recorder(RecorderConfig::default());
    let s = setup(&recorder, Arc::new(SystemAllocator::for_device(DEV)), None);
    let block = s.binding.allocate(request(4096, MemoryRole::Weights)).unwrap();
    drop(recorder);
    s.binding.release(block).unwrap();
    let trace = read_trace(&bytes.lock().unwrap()[..]).unwrap();
    assert!(trace.damage.is_none(), "{:?}", trace.damage);
    assert_eq!(trace.end.map(|end| end.events), Some(1));
    assert_eq!(trace.events.len(), 1, "the allocation; the release came after the recording finished");
    drop(s);
}
