//! The recorder: per-thread rings of event words, drained to a file by one writer thread.
//!
//! A recording thread encodes its event into a small array on its stack (allocations
//! and releases in the ring's compact form, see [`compact`](crate::event::compact); the
//! writer expands them into the file's events) and pushes it into its own ring
//! (`memory_sync`'s per-thread table: one ring per thread index, reused by the next
//! thread that gets the index), with no lock and no read-modify-write (see
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
use crate::event::{self, Compact, MarkKind, Tenant, compact};
use crate::format::{self, record};
use crate::ring::{Pushed, Ring};
use crate::sync::{Arc, AtomicBool, AtomicU32, AtomicU64, Mutex, Ordering, lock, yield_now};
use crate::traced::TracedAllocator;
use crate::writer::{self, Cold};

/// Settings of a [`Recorder`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecorderConfig {
    /// Words (8 bytes each) of each thread's ring; an allocation or release is 5 to 7
    /// words there, other events 7 to 18. Rounded up to a power of two. Default 32768
    /// (256 KiB, about 6,500 allocations and releases without caller tags); at most
    /// [`RecorderConfig::MAX_RING_WORDS`].
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
    /// The most words a ring may have: 2^30 (8 GiB for each recording thread).
    /// [`Recorder::to_writer`] refuses more: a ring is allocated by a thread's first
    /// event, on its allocation path, where a size past what rounds up to a power of two
    /// panicked (or, in release, made a ring of no words, on which every event of the
    /// thread spun until the recording finished) and one past memory aborted.
    pub const MAX_RING_WORDS: usize = 1 << 30;

    /// The same settings with rings of `words` words.
    #[must_use]
    pub fn with_ring_words(self, words: usize) -> RecorderConfig {
        RecorderConfig { ring_words: words, ..self }
    }
}

/// One thread's part of a recorder.
struct Local {
    ring: Ring,
    /// The trace thread number this ring's thread announced (its name record and the
    /// ring's owner pseudo-event); owner only.
    announced: AtomicU32,
    /// The thread whose events the consumer is reading in this ring: the last owner
    /// pseudo-event it drained (see [`compact`](crate::event::compact)); consumer only,
    /// under the output lock, so `Relaxed`.
    thread: AtomicU32,
}

/// What recording threads and the writer share.
pub(crate) struct Shared {
    /// Stamps on the hot path, nanoseconds since the recording started on the writer's.
    clock: Clock,
    locals: PerThread<Local>,
    ring_words: usize,
    /// Records built on cold paths (tenants, thread names, marks), until the writer's
    /// last pass closes the queue (see [`ColdQueue`]).
    cold: Mutex<ColdQueue>,
    /// Set by [`Recorder::finish`]: events recorded from now on are dropped (counted).
    closed: AtomicBool,
    writer: std::sync::OnceLock<Thread>,
    /// Each tenant's device, by tenant number - 1: the writer expands compact events
    /// with it (see [`Output::devices`]).
    devices: Mutex<Vec<DeviceKey>>,
    /// Events and marks not recorded because the recording was finished: those that
    /// found it closed, and (counted by [`Recorder::dropped`]) those that landed in a
    /// ring after the writer's last drain.
    dropped: AtomicU64,
    /// Times a thread found its ring full and drained it itself.
    waits: AtomicU64,
    /// The file; its holder is the rings' consumer (see [`Output`]).
    output: Mutex<Output>,
}

/// The records queued on cold paths, and whether the queue still takes them. The
/// writer's last pass takes the records and closes the queue under one lock, so a record
/// is either queued before that (and written, before the end record) or refused: a mark
/// that [`Recorder::try_mark`] answered `Ok` is in the file.
struct ColdQueue {
    records: Vec<Cold>,
    closed: bool,
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
    fn new(out: BufWriter<Counted>, ring_words: usize) -> Shared {
        let output = Output {
            out,
            error: None,
            summary: RecordingSummary { bytes: u64::from(format::HEADER_BYTES), ..RecordingSummary::default() },
            finished: false,
            devices: Vec::new(),
            scratch: Scratch::default(),
            max_record: format::MAX_PAYLOAD as usize,
        };
        Shared {
            clock: Clock::start(),
            locals: PerThread::new(),
            ring_words,
            cold: Mutex::new(ColdQueue { records: Vec::new(), closed: false }),
            closed: AtomicBool::new(false),
            writer: std::sync::OnceLock::new(),
            devices: Mutex::new(Vec::new()),
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
        if let Some((local, thread)) = self.local() {
            let words = build(ts, thread);
            self.push(local, &words, true);
        }
    }

    /// Records one event in ring form (see [`compact`]).
    #[inline(always)]
    pub(crate) fn emit_compact(&self, event: &Compact) {
        if let Some((local, _)) = self.local() {
            self.push(local, event.words(), true);
        }
    }

    /// The calling thread's ring and trace number, its name announced; `None` (the
    /// event counted as dropped) once the recording is closed.
    #[inline(always)]
    fn local(&self) -> Option<(&Local, u32)> {
        if self.closed.load(Ordering::Relaxed) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let thread = thread_number();
        let local = self.locals.get_or(thread_index(), || Local {
            ring: Ring::new(self.ring_words),
            announced: AtomicU32::new(0),
            thread: AtomicU32::new(0),
        });
        if local.announced.load(Ordering::Relaxed) != thread && !self.announce(local, thread) {
            // The thread could not be named (the recording closed meanwhile): an
            // event pushed without it would be read as the ring's previous owner's.
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some((local, thread))
    }

    /// Pushes one event's words (`event`: an event, counted if dropped; else the owner
    /// pseudo-event); whether they are in the ring.
    #[inline(always)]
    fn push(&self, local: &Local, words: &[u64], event: bool) -> bool {
        match local.ring.push(words) {
            Pushed::Queued => true,
            Pushed::QueuedWake => {
                self.wake();
                true
            }
            Pushed::Full => self.push_when_drained(local, words, event),
        }
    }

    /// The thread's first event through this recorder (or the first since its ring
    /// belonged to another thread): its name goes into the trace, and its owner
    /// pseudo-event into the ring, before its events. `false` when either could not go
    /// in (the writer's last pass closed the record queue, or the ring is full and the
    /// recording closed): the ring is left unannounced, so no event of this thread may
    /// follow (its events would be the previous owner's, or a thread the file never
    /// names).
    #[cold]
    #[inline(never)]
    fn announce(&self, local: &Local, thread: u32) -> bool {
        let current = std::thread::current();
        let name = current.name().map_or_else(|| format!("thread {thread}"), str::to_owned);
        if !self.queue(writer::thread_record(thread, &name)) {
            return false;
        }
        let pushed = self.push(local, &event::owner_words(thread), false);
        if pushed {
            local.announced.store(thread, Ordering::Relaxed);
        }
        pushed
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
    fn push_when_drained(&self, local: &Local, words: &[u64], event: bool) -> bool {
        let mut counted = false;
        loop {
            if self.closed.load(Ordering::Acquire) {
                if event {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                }
                return false;
            }
            if !counted {
                // A wait is a full ring this thread drains itself (not one it drops).
                self.waits.fetch_add(1, Ordering::Relaxed);
                counted = true;
            }
            self.drain_own(&mut lock(&self.output), local);
            if local.ring.push(words) != Pushed::Full {
                return true;
            }
            yield_now();
        }
    }

    fn wake(&self) {
        if let Some(writer) = self.writer.get() {
            writer.unpark();
        }
    }

    /// Queues a record built on a cold path for the writer; whether the queue took it
    /// (`false`: the writer's last pass closed it, and the record is not written).
    pub(crate) fn queue(&self, cold: Cold) -> bool {
        let mut queue = lock(&self.cold);
        if queue.closed {
            return false;
        }
        queue.records.push(cold);
        true
    }

    /// Queues a mark at the time now; `Err` (counted in `dropped`) when the recording
    /// is finished: the writer's last pass closed the queue, and the mark is not written.
    pub(crate) fn mark(
        &self,
        device: DeviceKey,
        tenant: u32,
        kind: MarkKind,
        value: u64,
        label: &str,
    ) -> Result<(), RecordError> {
        let ts = self.clock.nanos(self.clock.stamp());
        if self.queue(writer::mark_record(ts, thread_number(), device, tenant, kind, value, label)) {
            return Ok(());
        }
        self.dropped.fetch_add(1, Ordering::Relaxed);
        Err(RecordError::AlreadyFinished { asked: format!("a {} mark \"{label}\"", kind.name()) })
    }

    fn register_tenant(&self, mut tenant: Tenant) -> u32 {
        let id = {
            let mut devices = lock(&self.devices);
            devices.push(tenant.device);
            devices.len() as u32
        };
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
    /// Events and marks not recorded because they came after the recording was finished
    /// (up to its end record; [`Recorder::dropped`] counts those since, too).
    pub dropped: u64,
    /// Times a recording thread found its ring full and drained that ring itself.
    pub waits: u64,
}

/// Why a recording could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// Writing the trace failed; what was written before the error stays readable up to it.
    #[error(
        "writing the trace failed after {written} bytes reached it: {source}; the file is readable up to there, and \
         what was recorded after that is not in it: make room (or fix the output) and record again"
    )]
    Io {
        /// Bytes that reached the output before the failure (the header included).
        written: u64,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The writer thread panicked.
    #[error("the trace writer thread panicked; the file is readable up to its last flush")]
    WriterPanicked,
    /// The recording was already finished: what was asked (a second finish, a mark) added
    /// nothing to the file.
    #[error(
        "{asked} was asked of a recording that was already finished (Recorder::finish), so nothing was added to \
         the file; ask before finishing, or record again with a new Recorder"
    )]
    AlreadyFinished {
        /// What was asked: `"finish"`, or the mark with its kind and label.
        asked: String,
    },
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
    /// The error of writing the header or starting the writer thread;
    /// [`io::ErrorKind::InvalidInput`] for rings of more than
    /// [`RecorderConfig::MAX_RING_WORDS`] words.
    pub fn to_writer(out: impl Write + Send + 'static, config: RecorderConfig) -> io::Result<Recorder> {
        if config.ring_words > RecorderConfig::MAX_RING_WORDS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "RecorderConfig::ring_words is {} words ({} bytes for each recording thread), more than the {} \
                     (8 GiB) a ring may have; ring_words counts 8-byte words, not bytes: ask for fewer (the default \
                     is {})",
                    config.ring_words,
                    (config.ring_words as u128) * 8,
                    RecorderConfig::MAX_RING_WORDS,
                    RecorderConfig::default().ring_words
                ),
            ));
        }
        let origin_unix_ns =
            SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |since| since.as_nanos() as u64);
        // Smaller than a drained ring's events record (half a ring, 128 KiB by default),
        // so those go to `out` without a copy through the buffer; the small cold records
        // are gathered.
        let mut out = BufWriter::with_capacity(64 << 10, Counted::new(Box::new(out), 0));
        format::write_header(&mut out, origin_unix_ns)?;
        let shared = Arc::new(Shared::new(out, config.ring_words));
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
    /// (a phase of the workload). `Ok` means the mark is in the file once the recording
    /// is finished, even when this call races [`Recorder::finish`] on another thread.
    ///
    /// # Errors
    /// [`RecordError::AlreadyFinished`] when the recording is finished (or its finish,
    /// racing this call, already wrote its last pass): the mark is not in the file, and
    /// is counted in [`Recorder::dropped`].
    pub fn try_mark(&self, device: DeviceKey, kind: MarkKind, label: &str) -> Result<(), RecordError> {
        self.shared.mark(device, 0, kind, 0, label)
    }

    /// [`Recorder::try_mark`] for callers with nothing to do about a finished recording:
    /// a mark refused because the recording is finished is not in the file, is counted in
    /// [`Recorder::dropped`] and logged (a `tracing` warning). Never silently lost.
    pub fn mark(&self, device: DeviceKey, kind: MarkKind, label: &str) {
        if let Err(error) = self.try_mark(device, kind, label) {
            tracing::warn!(%error, "trace mark not recorded");
        }
    }

    /// Events and marks not in the file because they came after [`Recorder::finish`], or
    /// raced it: the summary's `dropped`, plus those recorded since. Every event a traced
    /// allocator records is either in the file or counted here, once the calls that
    /// recorded it have returned (an event that raced the last drain waits in its ring
    /// until this call counts it); 0 while recording.
    pub fn dropped(&self) -> u64 {
        let output = lock(&self.shared.output);
        if output.finished {
            // The rings' consumer (under the output lock): what landed after the last
            // drain is counted and discarded.
            for local in self.shared.locals.iter() {
                let (mut words, mut at, mut late) = (Vec::new(), 0usize, 0u64);
                local.ring.drain(&mut words);
                while let Some(size) = event_size(&words, at) {
                    late += u64::from(!is_owner(&words[at..at + size]));
                    at += size;
                }
                self.shared.dropped.fetch_add(late, Ordering::Relaxed);
            }
        }
        drop(output);
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// Whether [`Recorder::finish`] was called (it may still be running on another
    /// thread): from then on nothing more is recorded.
    pub fn is_finished(&self) -> bool {
        lock(&self.writer).is_none()
    }

    /// Stops recording, drains every ring, writes the end record and waits for the
    /// writer.
    ///
    /// What is in the file:
    /// - every event recorded by a call that returned before this one was made (on any
    ///   thread, ordered before it: joined, or synchronised with it);
    /// - every mark [`Recorder::try_mark`] answered `Ok`, whenever it was made;
    /// - of the events recorded by calls that overlap this one on other threads, those
    ///   that reached their ring before the writer's last drain. The others are not in
    ///   the file and are counted, never silently lost: those that found the recording
    ///   closed in the summary's `dropped` (and the end record's), and those that landed
    ///   in a ring after the last drain in [`Recorder::dropped`], which counts every
    ///   event not in the file once the calls have returned. Stop the workload first to
    ///   have it all.
    ///
    /// # Errors
    /// [`RecordError`] when writing failed (the file is readable up to the failure), or
    /// [`RecordError::AlreadyFinished`] when this is not the first call.
    pub fn finish(&self) -> Result<RecordingSummary, RecordError> {
        let Some(handle) = lock(&self.writer).take() else {
            return Err(RecordError::AlreadyFinished { asked: "finish".to_owned() });
        };
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
    out: BufWriter<Counted>,
    error: Option<io::Error>,
    summary: RecordingSummary,
    /// The end record is written: nothing more goes to the file.
    finished: bool,
    /// The writer's copy of [`Shared::devices`], refreshed when an event names a tenant
    /// it does not hold yet.
    devices: Vec<DeviceKey>,
    scratch: Scratch,
    /// The largest events record written (the format's limit; smaller in tests).
    max_record: usize,
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
            Err(error) => self.failed(error),
        }
    }

    /// `bytes` (whole file events, back to back) as events records of at most
    /// `max_record` bytes each, cut between events: a drained ring expands to up to twice
    /// its words (a compact release of 5 words is a file event of 10), so a ring of more
    /// than 4M words (32 MiB; `RecorderConfig::ring_words` is the caller's) drains to
    /// more than a record may hold, and one record of it failed the whole recording
    /// ("trace record larger than 64 MiB").
    fn events_records(&mut self, bytes: &[u8]) {
        if bytes.len() <= self.max_record {
            self.record(record::EVENTS, bytes);
            return;
        }
        let mut start = 0;
        while start < bytes.len() {
            let mut end = start;
            while end < bytes.len() {
                // The low byte of an event's second word is its size in words (at least
                // its header's 3 in the events the recorder writes).
                let size = usize::from(bytes[end + 8]).max(format::words::HEADER) * 8;
                if end > start && end + size - start > self.max_record {
                    break;
                }
                end += size;
            }
            let end = end.min(bytes.len());
            self.record(record::EVENTS, &bytes[start..end]);
            start = end;
        }
    }

    fn flush(&mut self) {
        if self.error.is_none()
            && let Err(error) = self.out.flush()
        {
            self.failed(error);
        }
    }

    /// The first write error: kept for [`Recorder::finish`], and logged now, since a long
    /// run may not finish for hours (a full disk): from here on nothing reaches the file
    /// and the rings are drained into nothing, so no recording thread waits on it.
    #[cold]
    fn failed(&mut self, error: io::Error) {
        tracing::error!(
            %error, written = self.out.get_ref().accepted,
            "writing the trace failed; recording goes on, but nothing more reaches the file (Recorder::finish will \
             say so)"
        );
        self.error = Some(error);
    }

    /// Closes the file now, not when the last traced allocator drops, and says how many
    /// bytes it took. After a write error the bytes still buffered are dropped, not tried
    /// again, so the count is what the file holds.
    fn close(&mut self) -> u64 {
        let closed = std::mem::replace(&mut self.out, BufWriter::new(Counted::new(Box::new(io::sink()), 0)));
        let (counted, _unwritten) = closed.into_parts();
        counted.accepted
    }
}

/// The recording's output under its buffer, counting the bytes it took: what reached the
/// file, which an I/O error reports (the bytes handed to the buffer can be up to its
/// size more).
pub(crate) struct Counted {
    inner: Box<dyn Write + Send>,
    /// Bytes `inner` accepted.
    accepted: u64,
}

impl Counted {
    /// `inner`, which already holds `accepted` bytes.
    fn new(inner: Box<dyn Write + Send>, accepted: u64) -> Counted {
        Counted { inner, accepted }
    }
}

impl Write for Counted {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(bytes)?;
        self.accepted += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// The size in words of the event at `at` of a drained ring's `words` (the low byte of
/// its second word, at least 2, at most what is left); `None` past the last event.
#[inline]
fn event_size(words: &[u64], at: usize) -> Option<usize> {
    (at + 1 < words.len()).then(|| usize::from(words[at + 1] as u8).max(2).min(words.len() - at))
}

/// Whether a ring event is an owner pseudo-event (a ring's new thread), not an event.
#[inline]
fn is_owner(event: &[u64]) -> bool {
    (event[1] >> 8) as u8 == compact::OWNER
}

/// Scratch buffers of the consumer, kept between drains.
#[derive(Default)]
struct Scratch {
    /// A ring's words as drained.
    ring: Vec<u64>,
    /// The file's bytes of those events.
    bytes: Vec<u8>,
}

impl Shared {
    /// Drains `local`'s ring into `scratch.ring` and lays its events out in
    /// `scratch.bytes` as the file's little-endian bytes (compact events expanded with
    /// their ring's thread and their tenant's device, see [`compact`]; others as they
    /// are), each time word turned from a clock stamp into nanoseconds since the
    /// recording started; the number of events. A ring holds whole
    /// events only (its head is published past whole events), and the low byte of an
    /// event's second word is its size in words.
    fn drain_events(&self, local: &Local, devices: &mut Vec<DeviceKey>, scratch: &mut Scratch) -> u64 {
        let Scratch { ring, bytes } = scratch;
        ring.clear();
        bytes.clear();
        local.ring.drain(ring);
        // A compact event expands to at most twice its words.
        bytes.reserve(ring.len() * 16);
        let (mut at, mut events) = (0usize, 0u64);
        let mut thread = local.thread.load(Ordering::Relaxed);
        while let Some(size) = event_size(ring, at) {
            let event = &mut ring[at..at + size];
            if is_owner(event) {
                thread = event[0] as u32;
            } else {
                event[0] = self.clock.nanos(event[0]);
                event::expand(event, thread, |tenant| self.device_of(devices, tenant), bytes);
                events += 1;
            }
            at += size;
        }
        local.thread.store(thread, Ordering::Relaxed);
        events
    }

    /// Tenant `tenant`'s device, from the consumer's copy `devices` of the table
    /// (refreshed when it does not hold the tenant yet: a tenant's device is in the table
    /// before its allocator exists, so before any of its events is in a ring).
    #[inline]
    fn device_of(&self, devices: &mut Vec<DeviceKey>, tenant: u32) -> DeviceKey {
        let index = (tenant as usize).wrapping_sub(1);
        if let Some(&device) = devices.get(index) {
            return device;
        }
        devices.clone_from(&lock(&self.devices));
        // Tenant numbers come only from `register_tenant`; a device index no tier has
        // would mark one that did not, for the reader.
        devices.get(index).copied().unwrap_or(DeviceKey::device(u32::MAX))
    }
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
            wrote |= self.drain_ring(output, local);
        }
        wrote
    }

    /// What a thread whose ring is full drains (`output` held): the cold records queued
    /// so far, then its own ring only.
    fn drain_own(&self, output: &mut Output, local: &Local) {
        if output.finished {
            return;
        }
        self.drain_cold(output);
        self.drain_ring(output, local);
    }

    /// The cold records queued so far (`output` held); whether there were any.
    fn drain_cold(&self, output: &mut Output) -> bool {
        self.take_cold(output, false)
    }

    /// The cold records queued so far (`output` held), closing the queue when `close`
    /// (in the same lock, so every record queued is taken by this pass or an earlier
    /// one); whether there were any.
    fn take_cold(&self, output: &mut Output, close: bool) -> bool {
        let cold = {
            let mut queue = lock(&self.cold);
            queue.closed |= close;
            std::mem::take(&mut queue.records)
        };
        for record in &cold {
            if record.kind == record::MARK {
                output.summary.events += 1;
            }
            output.record(record.kind, &record.payload);
        }
        !cold.is_empty()
    }

    /// `local`'s ring into one events record (`output` held); whether it held any event.
    fn drain_ring(&self, output: &mut Output, local: &Local) -> bool {
        if local.ring.is_empty() {
            return false;
        }
        let mut scratch = std::mem::take(&mut output.scratch);
        output.summary.events += self.drain_events(local, &mut output.devices, &mut scratch);
        let wrote = !scratch.bytes.is_empty();
        if wrote {
            output.events_records(&scratch.bytes);
        }
        output.scratch = scratch;
        wrote
    }
}

fn write_loop(shared: &Shared, interval: Duration) -> Result<RecordingSummary, RecordError> {
    // Until `closed` (with `Acquire`: every event recorded before `finish` is in its
    // ring, below a head this thread's drains see).
    while !shared.closed.load(Ordering::Acquire) {
        {
            let mut output = lock(&shared.output);
            if shared.drain_into(&mut output) {
                output.flush();
            }
        }
        std::thread::park_timeout(interval);
    }
    // The last pass: the cold queue closed as it is taken (a mark is either in it or
    // refused), then every ring, then the end record.
    let mut output = lock(&shared.output);
    shared.take_cold(&mut output, true);
    for local in shared.locals.iter() {
        shared.drain_ring(&mut output, local);
    }
    output.summary.dropped = shared.dropped.load(Ordering::Relaxed);
    output.summary.waits = shared.waits.load(Ordering::Relaxed);
    let end = writer::end_record(output.summary.events, output.summary.records + 1, output.summary.dropped);
    output.record(end.kind, &end.payload);
    output.flush();
    output.finished = true;
    let written = output.close();
    match output.error.take() {
        None => Ok(output.summary),
        Some(source) => Err(RecordError::Io { written, source }),
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

    /// A recording with `ring_words` per ring into a buffer the test reads back, with
    /// no writer thread (the test drains).
    fn recording(ring_words: usize) -> (Bytes, Shared) {
        let bytes = Bytes::default();
        let mut out = bytes.clone();
        format::write_header(&mut out, 0).unwrap();
        let out = BufWriter::new(Counted::new(Box::new(out), u64::from(format::HEADER_BYTES)));
        (bytes, Shared::new(out, ring_words))
    }

    #[test]
    fn an_owner_event_that_finds_the_ring_full_and_the_recording_closed_announces_nothing() {
        let (_, shared) = recording(32);
        let device = DeviceKey::host(1);
        // The owner event (2 words) and four lost events (7 words each): 30 of 32 words.
        for id in 0..4 {
            shared.emit(|ts, thread| event::lost_words(ts, thread, device, 1, &Block::new(id, id << 12, 64, 64)));
        }
        let local = shared.locals.get(thread_index()).expect("this thread's ring");
        assert_eq!(local.ring.push(&[0]), Pushed::Queued, "31 of 32 words: no room for an owner event");
        shared.closed.store(true, Ordering::Release);
        let before = local.announced.load(Ordering::Relaxed);
        // Another thread taking the ring over now could not name itself in it: it must
        // not be left announced, or its events would read as the previous owner's.
        assert!(!shared.announce(local, before + 1));
        assert_eq!(local.announced.load(Ordering::Relaxed), before);
        assert_eq!(shared.waits.load(Ordering::Relaxed), 0, "a dropped push is not a wait");
        assert_eq!(shared.dropped.load(Ordering::Relaxed), 0, "the owner event is not an event");
        // Once the writer's last pass closed the record queue, a thread that could not
        // be named in the file is not announced either, whatever room the ring has.
        local.ring.drain(&mut Vec::new());
        lock(&shared.cold).closed = true;
        assert!(!shared.announce(local, before + 2));
        assert_eq!(local.announced.load(Ordering::Relaxed), before);
        assert!(local.ring.is_empty(), "nothing pushed for a thread the file would not name");
    }

    #[test]
    fn a_full_ring_drains_only_itself_and_every_threads_events_stay_in_order() {
        // No writer thread: only a thread whose ring is full drains, so what it drained
        // is exactly what the file holds. 32 words: four lost events (7 words) fit.
        let (bytes, shared) = recording(32);
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

    #[test]
    fn a_ring_handed_to_a_new_thread_keeps_each_events_thread() {
        let (bytes, shared) = recording(1024);
        let tenant = shared.register_tenant(Tenant::new(0, DeviceKey::host(2), "t"));
        let allocate = |id: u64| {
            let block = Block::new(id, id << 12, 64, 64);
            let compact = event::compact_allocate(shared.stamp(), tenant, memory_governor::MemoryRole::Other, &block);
            shared.emit_compact(&compact.expect("a power-of-two alignment"));
        };
        // One thread after another, nothing drained between them: the second finds the
        // first's events still in the ring its index owns (the index is reused once the
        // first thread has exited). Other tests' threads may take the freed index first:
        // a thread that does not get it records nothing, and the next one tries.
        let run = |body: &(dyn Fn() -> bool + Sync)| std::thread::scope(|scope| scope.spawn(body).join().unwrap());
        let first_index = std::sync::OnceLock::new();
        run(&|| {
            allocate(0);
            allocate(1);
            first_index.set(thread_index()).is_ok()
        });
        let first_index = *first_index.get().expect("the first thread's index");
        let handed_over = (0..1000).any(|_| {
            run(&|| {
                let same = thread_index() == first_index;
                if same {
                    allocate(10);
                    allocate(11);
                }
                same
            })
        });
        assert!(handed_over, "a later thread got the first's index, so its ring");
        shared.closed.store(true, Ordering::Release);
        write_loop(&shared, Duration::ZERO).unwrap();
        let written = bytes.0.lock().unwrap().clone();
        let mut by_thread = std::collections::BTreeMap::<u32, Vec<u64>>::new();
        let trace = crate::scan_trace(&written[..], |event| match event.what {
            What::Allocate(block) => {
                assert_eq!((event.tenant, event.device), (tenant, DeviceKey::host(2)));
                by_thread.entry(event.thread).or_default().push(block.id);
            }
            other => panic!("only allocations were recorded: {other:?}"),
        })
        .unwrap();
        assert!(trace.damage.is_none(), "{:?}", trace.damage);
        assert_eq!(trace.threads.len(), 2, "{:?}", trace.threads);
        assert_eq!(by_thread.into_values().collect::<Vec<_>>(), [vec![0, 1], vec![10, 11]]);
    }

    #[test]
    fn a_ring_that_drains_to_more_than_a_record_holds_is_written_as_several_records() {
        // The format's 64 MiB, scaled down: records of at most 100 bytes hold one
        // allocation (9 words, 72 bytes) each, so a drain of many is cut between events.
        let (bytes, mut shared) = recording(256);
        shared.output.get_mut().unwrap().max_record = 100;
        let tenant = shared.register_tenant(Tenant::new(0, DeviceKey::host(2), "t"));
        for id in 0..40u64 {
            let block = Block::new(id, id << 12, 64, 64);
            let role = memory_governor::MemoryRole::Other;
            shared.emit_compact(&event::compact_allocate(shared.stamp(), tenant, role, &block).unwrap());
        }
        shared.closed.store(true, Ordering::Release);
        let summary = write_loop(&shared, Duration::ZERO).expect("a drain larger than a record is no write error");
        assert_eq!(summary.events, 40);
        let written = bytes.0.lock().unwrap().clone();
        let mut ids = Vec::new();
        let trace = crate::scan_trace(&written[..], |event| match event.what {
            What::Allocate(block) => ids.push(block.id),
            other => panic!("only allocations were recorded: {other:?}"),
        })
        .unwrap();
        assert!(trace.damage.is_none(), "{:?}", trace.damage);
        assert_eq!(ids, (0..40).collect::<Vec<u64>>(), "every event, in order");
        // The records: header 32 bytes, then (16-byte header + payload) each.
        let mut at = 32;
        let mut events_records = 0;
        while at < written.len() {
            let kind = u32::from_le_bytes(written[at..at + 4].try_into().unwrap());
            let length = u32::from_le_bytes(written[at + 4..at + 8].try_into().unwrap()) as usize;
            if kind == record::EVENTS {
                assert!(length <= 100 && length.is_multiple_of(72), "an events record of {length} bytes");
                events_records += 1;
            }
            at += 16 + length;
        }
        assert_eq!(events_records, 40, "one allocation a record");
    }
}
