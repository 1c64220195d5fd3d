//! The recorder: per-thread rings of event words, drained to a file by one writer thread.
//!
//! A recording thread encodes its event into a small array on its stack and pushes it
//! into its own ring (`memory_sync`'s per-thread table: one ring per thread index, reused
//! by the next thread that gets the index), with no lock and no read-modify-write (see
//! [`ring`](crate::ring)). The writer thread wakes every `flush_interval`, or when a ring
//! passes half full, drains every ring into one events record each, and writes the records
//! that cold paths queued (tenants, thread names, marks). A thread that finds its ring
//! full drains its own ring (and the queued cold records) itself under the output lock
//! (the lock makes whoever holds it the rings' one consumer) and pushes again: nothing is dropped, so a recording is whole
//! however long it runs, memory stays bounded by one ring per thread, and a thread never
//! waits for the scheduler to run the writer.

use std::cell::Cell;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, SystemTime};

use memory_governor::{DeviceKey, GovernedAllocator, Governor};
use memory_sync::per_thread::{PerThread, thread_index};

use crate::clock::Clock;
use crate::event::{MarkKind, Tenant};
use crate::format::{self, record};
use crate::ring::{Pushed, Ring};
use crate::sync::{Arc, AtomicBool, AtomicU32, AtomicU64, Mutex, Ordering, lock, yield_now};
use crate::traced::TracedAllocator;
use crate::writer::{self, Cold};

/// Settings of a [`Recorder`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecorderConfig {
    /// Words (8 bytes each) of each thread's ring; an event is 7 to 18 words. Rounded up
    /// to a power of two. Default 32768 (256 KiB, about 3,500 allocation events).
    pub ring_words: usize,
    /// How often the writer drains the rings when no ring asks sooner. Default 2 ms.
    pub flush_interval: Duration,
}

impl Default for RecorderConfig {
    fn default() -> RecorderConfig {
        RecorderConfig { ring_words: 32 << 10, flush_interval: Duration::from_millis(2) }
    }
}

impl RecorderConfig {
    /// The same settings with rings of `words` words.
    #[must_use]
    pub fn with_ring_words(self, words: usize) -> RecorderConfig {
        RecorderConfig { ring_words: words, ..self }
    }
}

/// One thread's part of a recorder.
struct Local {
    ring: Ring,
    /// The trace thread number this ring's thread announced (its name record); owner only.
    announced: AtomicU32,
}

/// What recording threads and the writer share.
pub(crate) struct Shared {
    /// Stamps on the hot path, nanoseconds since the recording started on the writer's.
    clock: Clock,
    locals: PerThread<Local>,
    ring_words: usize,
    cold: Mutex<Vec<Cold>>,
    closed: AtomicBool,
    writer: std::sync::OnceLock<Thread>,
    next_tenant: AtomicU32,
    /// Events not recorded because the recording was closed.
    dropped: AtomicU64,
    /// Times a thread found its ring full and drained it itself.
    waits: AtomicU64,
    /// The file; its holder is the rings' consumer (see [`Output`]).
    output: Mutex<Output>,
}

/// The calling thread's number in traces (process-wide, from 1, never reused).
#[inline(always)]
fn thread_number() -> u32 {
    // Not part of the ring protocol: std's atomic under loom too.
    #[allow(clippy::disallowed_types, reason = "an id counter, not a protocol under check")]
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    std::thread_local! {
        static NUMBER: Cell<u32> = const { Cell::new(0) };
    }
    NUMBER
        .try_with(|number| match number.get() {
            0 => {
                let next = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                number.set(next);
                next
            }
            n => n,
        })
        .unwrap_or(0)
}

std::thread_local! {
    static CALLER: Cell<u64> = const { Cell::new(0) };
}

/// The calling thread's caller tag (0: none), recorded with every event it makes.
#[inline(always)]
pub fn caller_tag() -> u64 {
    CALLER.try_with(Cell::get).unwrap_or(0)
}

/// Sets the calling thread's caller tag (a request id, a stream id) until the guard
/// drops, when the previous tag comes back. Events record the tag current at the call.
pub fn set_caller_tag(tag: u64) -> CallerTag {
    CallerTag { previous: replace_caller_tag(tag), _not_send: std::marker::PhantomData }
}

/// Sets the calling thread's caller tag to `tag` until the thread sets another (no
/// guard: for callers that keep a tag across calls, as C does); the previous tag.
pub fn replace_caller_tag(tag: u64) -> u64 {
    CALLER.try_with(|caller| caller.replace(tag)).unwrap_or(0)
}

/// Runs `f` with the calling thread's caller tag set to `tag`.
pub fn with_caller_tag<R>(tag: u64, f: impl FnOnce() -> R) -> R {
    let _tag = set_caller_tag(tag);
    f()
}

/// Restores the previous caller tag when dropped (see [`set_caller_tag`]); it belongs
/// to the thread that set it.
#[must_use = "the tag is restored when the guard drops"]
pub struct CallerTag {
    previous: u64,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for CallerTag {
    fn drop(&mut self) {
        let previous = self.previous;
        let _ = CALLER.try_with(|caller| caller.set(previous));
    }
}

impl Shared {
    /// What a recording to `out` (its header written) shares, before its writer starts.
    fn new(out: Box<dyn Write + Send>, ring_words: usize) -> Shared {
        let output = Output {
            out,
            error: None,
            summary: RecordingSummary { bytes: u64::from(format::HEADER_BYTES), ..RecordingSummary::default() },
            finished: false,
            words: Vec::new(),
            bytes: Vec::new(),
        };
        Shared {
            clock: Clock::start(),
            locals: PerThread::new(),
            ring_words,
            cold: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
            writer: std::sync::OnceLock::new(),
            next_tenant: AtomicU32::new(1),
            dropped: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            output: Mutex::new(output),
        }
    }

    /// The time now as a raw stamp of the recorder's clock (see [`Clock`]): what a ring
    /// holds in an event's first word until the writer turns it into nanoseconds.
    #[inline(always)]
    pub(crate) fn stamp(&self) -> u64 {
        self.clock.stamp()
    }

    /// Records one event built by `build(stamp, thread)` at the time now.
    #[inline(always)]
    pub(crate) fn emit<const N: usize>(&self, build: impl FnOnce(u64, u32) -> [u64; N]) {
        let stamp = self.stamp();
        self.emit_at(stamp, build);
    }

    /// Records one event built by `build(stamp, thread)` at `stamp` (from [`Shared::stamp`]).
    #[inline(always)]
    pub(crate) fn emit_at<const N: usize>(&self, ts: u64, build: impl FnOnce(u64, u32) -> [u64; N]) {
        if self.closed.load(Ordering::Relaxed) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let thread = thread_number();
        let local = self
            .locals
            .get_or(thread_index(), || Local { ring: Ring::new(self.ring_words), announced: AtomicU32::new(0) });
        if local.announced.load(Ordering::Relaxed) != thread {
            self.announce(local, thread);
        }
        let words = build(ts, thread);
        match local.ring.push(&words) {
            Pushed::Queued => {}
            Pushed::QueuedWake => self.wake(),
            Pushed::Full => self.push_when_drained(local, &words),
        }
    }

    /// The thread's first event through this recorder (or the first since its ring
    /// belonged to another thread): its name goes into the trace.
    #[cold]
    #[inline(never)]
    fn announce(&self, local: &Local, thread: u32) {
        local.announced.store(thread, Ordering::Relaxed);
        let current = std::thread::current();
        let name = current.name().map_or_else(|| format!("thread {thread}"), str::to_owned);
        self.queue(writer::thread_record(thread, &name));
    }

    /// The ring is full: this thread drains it itself, as the rings' consumer for a
    /// moment (under the output lock, which orders it with the writer thread and any
    /// other helper), then pushes again. Waiting for the writer instead left a thread
    /// parked for as long as the scheduler kept the writer off a core (milliseconds on a
    /// loaded machine); draining costs it the writer's work for its own ring's events and
    /// no more: the other threads' rings are not full and wait for the writer. Nothing
    /// orders events across rings in the file (a reader sorts by time; each thread's
    /// events stay in order within its ring and its records), so draining one ring
    /// early keeps every ordering the format promises. The cold records queued so far
    /// go first, as in the writer's pass, so this thread's name and its tenants come
    /// before its events in the file. A closed recording drops the event (counted).
    #[cold]
    #[inline(never)]
    fn push_when_drained(&self, local: &Local, words: &[u64]) {
        self.waits.fetch_add(1, Ordering::Relaxed);
        loop {
            if self.closed.load(Ordering::Acquire) {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            self.drain_own(&mut lock(&self.output), &local.ring);
            if local.ring.push(words) != Pushed::Full {
                return;
            }
            yield_now();
        }
    }

    fn wake(&self) {
        if let Some(writer) = self.writer.get() {
            writer.unpark();
        }
    }

    /// Queues a record built on a cold path for the writer.
    pub(crate) fn queue(&self, cold: Cold) {
        lock(&self.cold).push(cold);
    }

    /// Queues a mark at the time now.
    pub(crate) fn mark(&self, device: DeviceKey, tenant: u32, kind: MarkKind, value: u64, label: &str) {
        let ts = self.clock.nanos(self.clock.stamp());
        self.queue(writer::mark_record(ts, thread_number(), device, tenant, kind, value, label));
    }

    fn register_tenant(&self, mut tenant: Tenant) -> u32 {
        let id = self.next_tenant.fetch_add(1, Ordering::Relaxed);
        tenant.id = id;
        self.queue(writer::tenant_record(&tenant));
        id
    }
}

/// What a finished recording wrote.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordingSummary {
    /// Events written (marks included).
    pub events: u64,
    /// Records written (the end record included).
    pub records: u64,
    /// Bytes written (the header included).
    pub bytes: u64,
    /// Events not recorded because they came after the recording was finished.
    pub dropped: u64,
    /// Times a recording thread found its ring full and drained that ring itself.
    pub waits: u64,
}

/// Why a recording could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// Writing the trace failed; what was written before the error stays readable up to it.
    #[error("writing the trace failed after {written} bytes: {source}; the file is readable up to there")]
    Io {
        /// Bytes written before the failure.
        written: u64,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The writer thread panicked.
    #[error("the trace writer thread panicked; the file is readable up to its last flush")]
    WriterPanicked,
    /// The recording was already finished.
    #[error("the recording was already finished")]
    AlreadyFinished,
}

/// An opt-in recorder of governed allocations: wrap each governed allocator with
/// [`Recorder::trace`] and register the [`TracedAllocator`] instead; every allocation,
/// release, refusal (with the recovery ladder's figures), quarantine and lost block is
/// written, with its identity, tenant, role, device, size, alignment, thread, time and
/// caller tag ([`set_caller_tag`]), to the trace. Code that does not record pays nothing:
/// nothing is wrapped.
///
/// ```
/// use std::sync::Arc;
/// use memory_governor::*;
/// use memory_trace::{Recorder, read_trace};
///
/// let governor = Governor::new();
/// let tenant = IdentityIssuer::new()?.authority()?;
/// governor.open_account(AccountConfig::new(DeviceKey::host(1), tenant).with_label("tenant-a"))?;
/// let system = Arc::new(allocator_cpu::SystemAllocator::for_device(DeviceKey::host(1)));
///
/// let path = std::env::temp_dir().join(format!("quickstart-{}.mtrace", std::process::id()));
/// let recorder = Recorder::create(&path)?;
/// let traced = recorder.trace(&governor, governor.govern(system, tenant)?);
/// let block = traced.allocate(&AllocationRequest::new(4096, 64)?.with_role(MemoryRole::KvCache))?;
/// assert!(traced.release(block).is_complete());
/// let summary = recorder.finish()?;
/// assert_eq!(summary.events, 2);
///
/// let trace = read_trace(std::fs::File::open(&path)?)?;
/// assert_eq!(trace.events.len(), 2);
/// assert_eq!(trace.tenants[0].label, "tenant-a");
/// # std::fs::remove_file(&path)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Recorder {
    shared: Arc<Shared>,
    writer: Mutex<Option<JoinHandle<Result<RecordingSummary, RecordError>>>>,
}

impl Recorder {
    /// Records to a new file at `path` (truncating one that exists).
    ///
    /// # Errors
    /// The error of creating the file or starting the writer thread.
    pub fn create(path: impl AsRef<Path>) -> io::Result<Recorder> {
        Recorder::to_writer(File::create(path)?, RecorderConfig::default())
    }

    /// Records to `out` with `config`.
    ///
    /// # Errors
    /// The error of writing the header or starting the writer thread.
    pub fn to_writer(out: impl Write + Send + 'static, config: RecorderConfig) -> io::Result<Recorder> {
        let origin_unix_ns =
            SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |since| since.as_nanos() as u64);
        // Smaller than a drained ring's events record (half a ring, 128 KiB by default),
        // so those go to `out` without a copy through the buffer; the small cold records
        // are gathered.
        let mut out = BufWriter::with_capacity(64 << 10, out);
        format::write_header(&mut out, origin_unix_ns)?;
        let shared = Arc::new(Shared::new(Box::new(out), config.ring_words));
        let handle = {
            let shared = Arc::clone(&shared);
            let interval = config.flush_interval;
            std::thread::Builder::new()
                .name("memory-trace-writer".to_owned())
                .spawn(move || write_loop(&shared, interval))?
        };
        let _ = shared.writer.set(handle.thread().clone());
        Ok(Recorder { shared, writer: Mutex::new(Some(handle)) })
    }

    /// Wraps `governed` so that everything it does is recorded, as a new tenant of the
    /// trace (the account's label and authority, the inner allocator's name, the
    /// tenant's quota and `governor`'s limit for the device as they are now).
    pub fn trace(&self, governor: &Governor, governed: GovernedAllocator) -> TracedAllocator {
        let account = governed.account();
        let device = account.device();
        let mut tenant = Tenant::new(0, device, account.label());
        tenant.authority = account.authority().to_string();
        tenant.allocator = memory_governor::DeviceAllocator::name(governed.inner().as_ref()).to_owned();
        tenant.quota = account.quota();
        tenant.device_limit = governor.device_limit(device);
        let id = self.shared.register_tenant(tenant);
        TracedAllocator::new(governed, Arc::clone(&self.shared), id)
    }

    /// Records a mark now: a device lost (call it beside `invalidate_device`), or a note
    /// (a phase of the workload).
    pub fn mark(&self, device: DeviceKey, kind: MarkKind, label: &str) {
        self.shared.mark(device, 0, kind, 0, label);
    }

    /// Whether [`Recorder::finish`] was called (it may still be running on another
    /// thread): from then on nothing more is recorded.
    pub fn is_finished(&self) -> bool {
        lock(&self.writer).is_none()
    }

    /// Stops recording, drains every ring, writes the end record and waits for the
    /// writer. Events recorded after this call are dropped (counted); events recorded
    /// *during* it by other threads may be missing, so stop the workload first.
    ///
    /// # Errors
    /// [`RecordError`] when writing failed (the file is readable up to the failure), or
    /// [`RecordError::AlreadyFinished`] when this is not the first call.
    pub fn finish(&self) -> Result<RecordingSummary, RecordError> {
        let Some(handle) = lock(&self.writer).take() else { return Err(RecordError::AlreadyFinished) };
        self.shared.closed.store(true, Ordering::Release);
        handle.thread().unpark();
        handle.join().map_err(|_| RecordError::WriterPanicked)?
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        if !self.is_finished()
            && let Err(error) = self.finish()
        {
            tracing::error!(%error, "trace recorder dropped without finish(), and writing failed");
        }
    }
}

/// The recording's output: the file, what was written to it, and the writer's scratch
/// buffers. Whoever holds it (under [`Shared::output`]) is the rings' one consumer.
/// It keeps draining after an I/O error (dropping what it cannot write) so that no
/// recording thread waits on a dead file.
pub(crate) struct Output {
    out: Box<dyn Write + Send>,
    error: Option<io::Error>,
    summary: RecordingSummary,
    /// The end record is written: nothing more goes to the file.
    finished: bool,
    words: Vec<u64>,
    bytes: Vec<u8>,
}

impl Output {
    fn record(&mut self, kind: u32, payload: &[u8]) {
        if self.error.is_some() {
            return;
        }
        match format::write_record(&mut self.out, kind, payload) {
            Ok(()) => {
                self.summary.records += 1;
                self.summary.bytes += (format::RECORD_HEADER_BYTES + payload.len()) as u64;
            }
            Err(error) => self.error = Some(error),
        }
    }

    fn flush(&mut self) {
        if self.error.is_none()
            && let Err(error) = self.out.flush()
        {
            self.error = Some(error);
        }
    }
}

/// Drains `ring` into `words`, turns each event's first word from a clock stamp into
/// nanoseconds since the recording started, and lays the words out in `out` as
/// little-endian bytes; the number of events. A ring holds whole events only (its head
/// is published past whole events), and the low byte of an event's second word is its
/// size in words.
fn drain_events(ring: &Ring, clock: &Clock, words: &mut Vec<u64>, out: &mut Vec<u8>) -> u64 {
    words.clear();
    ring.drain_with(|word| words.push(word));
    let (mut at, mut events) = (0usize, 0u64);
    while at + 1 < words.len() {
        words[at] = clock.nanos(words[at]);
        at += usize::from(words[at + 1] as u8).max(2);
        events += 1;
    }
    out.clear();
    out.resize(words.len() * 8, 0);
    for (bytes, word) in out.chunks_exact_mut(8).zip(words.iter()) {
        bytes.copy_from_slice(&word.to_le_bytes());
    }
    events
}

impl Shared {
    /// One pass of the consumer (`output` held): the cold records queued so far, then
    /// every ring into one events record each; whether anything was written.
    fn drain_into(&self, output: &mut Output) -> bool {
        if output.finished {
            return false;
        }
        let mut wrote = self.drain_cold(output);
        for local in self.locals.iter() {
            wrote |= self.drain_ring(output, &local.ring);
        }
        wrote
    }

    /// What a thread whose ring is full drains (`output` held): the cold records queued
    /// so far, then its own `ring` only.
    fn drain_own(&self, output: &mut Output, ring: &Ring) {
        if output.finished {
            return;
        }
        self.drain_cold(output);
        self.drain_ring(output, ring);
    }

    /// The cold records queued so far (`output` held); whether there were any.
    fn drain_cold(&self, output: &mut Output) -> bool {
        let cold = std::mem::take(&mut *lock(&self.cold));
        for record in &cold {
            if record.kind == record::MARK {
                output.summary.events += 1;
            }
            output.record(record.kind, &record.payload);
        }
        !cold.is_empty()
    }

    /// `ring` into one events record (`output` held); whether it held anything.
    fn drain_ring(&self, output: &mut Output, ring: &Ring) -> bool {
        if ring.is_empty() {
            return false;
        }
        let (mut words, mut bytes) = (std::mem::take(&mut output.words), std::mem::take(&mut output.bytes));
        output.summary.events += drain_events(ring, &self.clock, &mut words, &mut bytes);
        output.record(record::EVENTS, &bytes);
        (output.words, output.bytes) = (words, bytes);
        true
    }
}

fn write_loop(shared: &Shared, interval: Duration) -> Result<RecordingSummary, RecordError> {
    loop {
        let closing = shared.closed.load(Ordering::Acquire);
        {
            let mut output = lock(&shared.output);
            if shared.drain_into(&mut output) && !closing {
                output.flush();
            }
        }
        if closing {
            break;
        }
        std::thread::park_timeout(interval);
    }
    let mut output = lock(&shared.output);
    output.summary.dropped = shared.dropped.load(Ordering::Relaxed);
    output.summary.waits = shared.waits.load(Ordering::Relaxed);
    let end = writer::end_record(output.summary.events, output.summary.records + 1, output.summary.dropped);
    output.record(end.kind, &end.payload);
    output.flush();
    output.finished = true;
    // Close the file now, not when the last traced allocator drops.
    output.out = Box::new(io::sink());
    match output.error.take() {
        None => Ok(output.summary),
        Some(source) => Err(RecordError::Io { written: output.summary.bytes, source }),
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;
    use crate::event::{self, Block, What};

    /// An output the test reads back.
    #[derive(Clone, Default)]
    struct Bytes(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Write for Bytes {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_full_ring_drains_only_itself_and_every_threads_events_stay_in_order() {
        let bytes = Bytes::default();
        let mut out = bytes.clone();
        format::write_header(&mut out, 0).unwrap();
        // No writer thread: only a thread whose ring is full drains, so what it drained
        // is exactly what the file holds. 32 words: four lost events (7 words) fit.
        let shared = Shared::new(Box::new(out), 32);
        let device = DeviceKey::host(1);
        let lost =
            |id: u64| move |ts, thread| event::lost_words(ts, thread, device, 1, &Block::new(id, id << 12, 64, 64));
        let events = || lock(&shared.output).summary.events;

        shared.emit(lost(0)); // this thread's ring (and thread index) first
        let other = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    shared.emit(lost(100));
                    shared.emit(lost(101));
                    shared.locals.get(thread_index()).expect("the other thread's ring")
                })
                .join()
                .unwrap()
        });
        for id in 1..10 {
            shared.emit(lost(id));
        }
        // Full at ids 4 and 8: each time this thread wrote out its own four events, and
        // the other thread's two wait in its ring for the writer.
        assert_eq!(shared.waits.load(Ordering::Relaxed), 2);
        assert_eq!(events(), 8, "only the full ring's events were written");
        assert!(!other.ring.is_empty(), "the other thread's ring was not drained");

        shared.closed.store(true, Ordering::Release);
        let summary = write_loop(&shared, Duration::ZERO).unwrap();
        assert_eq!((summary.events, summary.waits, summary.dropped), (12, 2, 0));
        let written = bytes.0.lock().unwrap().clone();
        let mut by_thread = std::collections::BTreeMap::<u32, Vec<u64>>::new();
        let trace = crate::scan_trace(&written[..], |event| match event.what {
            What::Lost(block) => by_thread.entry(event.thread).or_default().push(block.id),
            other => panic!("only lost blocks were recorded: {other:?}"),
        })
        .unwrap();
        assert!(trace.damage.is_none(), "{:?}", trace.damage);
        assert_eq!(trace.end.map(|end| end.events), Some(12));
        assert_eq!(trace.threads.len(), 2, "both threads are named: {:?}", trace.threads);
        let mut orders: Vec<Vec<u64>> = by_thread.into_values().collect();
        orders.sort();
        assert_eq!(orders, [(0..10).collect::<Vec<u64>>(), vec![100, 101]], "each thread's events in its order");
    }
}
