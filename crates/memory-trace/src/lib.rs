//! memory-trace: record a runtime's governed allocations, replay them against another
//! allocator stack, and look at them.
//!
//! # What it does
//! - **Record** ([`Recorder`], [`TracedAllocator`]): an opt-in adaptor around a
//!   [`GovernedAllocator`](memory_governor::GovernedAllocator). Every allocation,
//!   release, refusal (with the governor's recovery-ladder figures: scope, used, limit,
//!   allocated and reserved, idle cache bytes, largest free block, trimmed, reclaimed),
//!   quarantine and block lost with its device goes to a trace with the block's identity,
//!   tenant, role, device, bytes, alignment, thread, a monotonic time and the caller's tag
//!   ([`set_caller_tag`]). Per-thread rings, drained by one writer thread, keep memory
//!   bounded however long the run.
//! - **A versioned format** (`docs/TRACE-FORMAT.md`): [`read_trace`] refuses an unknown
//!   major version with an error that says so, and reads a damaged file up to the damage
//!   ([`Trace::damage`] says where). [`TraceWriter`] writes one from events in hand.
//! - **Convert** ([`convert`]): to the Chrome trace-event format (the governor's timeline
//!   shape) and to RMM's replay CSV log (`Thread,Time,Action,Pointer,Size,Stream`).
//! - **Replay** ([`replay`]): a trace against `system`, `pooled` or `virtual` host
//!   allocator stacks on a simulated device, the governor in front: peak allocated and
//!   reserved, fragmentation at the peak, refusals, latency percentiles, side by side.
//! - **See** ([`html`]): one self-contained page (inline SVG and script, no network).
//!
//! # Why an adaptor, not a governor option
//! Recording wraps the governed allocator instead of living inside the governor or the
//! registry. A runtime that does not record registers the governed allocator itself, and
//! its hot path is exactly what it was: no flag to test, no branch, nothing to keep the
//! instruction budget of the governed pair honest against. A runtime that records gets
//! the governor's structured refusal (through
//! [`GovernedAllocator::try_allocate`](memory_governor::GovernedAllocator::try_allocate))
//! and sees every block exactly where the registry hands it to the governor.
//!
//! # Cost
//! A recorded call costs the governed call plus one raw counter read (`rdtsc` through
//! `quanta`, scaled to nanoseconds later on the writer thread: see `src/clock.rs`), a
//! few thread-local loads and five to seven stores into the thread's ring. Allocations
//! and releases go into the ring in a compact form (`event::compact`: 5 words, 40 bytes,
//! plus one for a caller tag and one for bytes asked for other than the block's or a
//! quarantine's residual) instead of the file's 9 and 10 words: the thread and the
//! device are not stored (a ring has one owner thread at a time, named by a pseudo-event
//! when it changes; the device is the tenant's) and the alignment is a shift. The writer
//! thread expands them into the file's events, so the file format is the same; it
//! drains, frames and checksums (CRC-32 by `crc32fast`) on another core, about 76 bytes
//! of file an event; a thread that finds its ring full does that work itself, under the
//! output lock, rather than wait for the scheduler to run the writer.
//!
//! `cargo bench -p memory-benches --bench trace` measures allocate + release through a
//! binding, governed vs traced, interleaved in one run (4 KiB; the counter allocator,
//! with no memory behind it, and the system allocator). Medians of four runs of that
//! bench each, before (`Instant::now` per event, slicing-by-8 CRC, a full ring waiting
//! for the writer) and after, alternating, on the 2-core shared development VM at load
//! average 5.6-6.5 (the writer competing with other builds for the two cores; the
//! governed pair itself ran at 2.5x its idle time): counter 5.99x -> 2.80x, system
//! 3.86x -> 2.28x (per run: 1.79-3.36x and 1.63-2.41x after). At load 0.4, before the
//! change, it was 2.35x and 1.62x, the clock read 57 of the 75 ns added per pair.
//! Idle, later: counter 2.14x (66 -> 142 ns), system 1.48x (136 -> 202 ns). Taking the
//! parts out one at a time in that bench: with neither the stamps nor the ring push,
//! 1.10x and 1.05x (the wrapper, the thread-local loads, building the words); the two
//! counter reads add about 25 ns a pair (12 ns each on this VM); the pushes, with the
//! writer draining on the other core, about 40 ns (then about 150 bytes a pair written
//! into lines the writer reads, so each is a cross-core miss).
//!
//! The compact ring form cut those bytes to 80 a pair (19 words to 10, the bench's pairs
//! having no caller tag). Instructions per pair under callgrind
//! (`examples/traced_instructions.rs`, whose header has the commands; counter
//! allocator, the difference of 60,000 and 10,000 pairs, deterministic for a build):
//! the traced allocate and release themselves (the governed allocate inlined in the
//! first) 464 -> 410, the writer's draining, expanding, framing and checksumming 627 ->
//! 344, the whole process 1859 -> 1555 (the governed pair alone: about 850). The ring
//! push now stores the event's words through one slice instead of rereading the ring's
//! fields for each word, and the writer lays each expanded event out as bytes in one
//! copy instead of zero-filling a buffer and copying into it word by word.
//!
//! In time, twenty alternating runs of the bench binary (built by `cargo bench -p
//! memory-benches --bench trace --no-run`, run with `--bench`) before (commit d57eaf2)
//! and after, two sets of ten, one in each order, at load average 4.4-5.4 (other builds
//! on the two cores), gave medians of counter 1.92x -> 1.73x (154 -> 140 ns a traced pair;
//! quartiles 1.81-2.10x -> 1.53-1.93x) and system 1.44x -> 1.36x (222 -> 203 ns;
//! 1.31-1.53x -> 1.26-1.47x). The compact form before the writer's one-copy layout had
//! shown no change in twenty such runs (medians 2.21x -> 2.31x and 1.61x -> 1.73x at
//! load 2.4-6.3): on this machine the figure follows how much of a core the writer
//! gets, so the writer's work counts as much as the recording thread's. The issue's
//! target (1.1x) is not met here. Recording off costs nothing: code that does not record
//! registers the governed allocator itself, whose instruction budget (`cargo xtask
//! budget`) this crate does not touch.
//!
//! # Correctness
//! - No `unsafe` code (`#![forbid(unsafe_code)]`).
//! - The only concurrency protocol is the recorder's per-thread ring (single producer:
//!   the recording thread; single consumer: the writer thread; no lock and no
//!   read-modify-write on the producer's side). Its argument is in `src/ring.rs`; a loom
//!   model (`src/loom_ring.rs`) checks that the writer sees exactly the pushed words, in
//!   order, across the ring's wrap, and runs with
//!   `RUSTFLAGS="--cfg memory_loom" cargo test -p memory-trace --lib loom`.
//! - The recorder never drops an event while recording: a thread that finds its ring
//!   full drains it itself under the output lock, as the rings' one consumer for a
//!   moment (its own ring only; counted in [`RecordingSummary::waits`]); a test records ten
//!   million events from several threads and reads back every one.
//! - Finishing loses nothing silently. A mark [`Recorder::try_mark`] answered `Ok` is in
//!   the file, whichever thread finishes and when: the writer's last pass takes the
//!   queue of cold records and closes it under one lock, so a mark is queued before
//!   that pass or refused ([`RecordError::AlreadyFinished`], counted). An event whose
//!   call returned before [`Recorder::finish`] was called is in the file; one racing it
//!   on another thread is in the file or counted by [`Recorder::dropped`] (it found the
//!   recording closed, or reached its ring after the last drain): never both, and never
//!   neither unless writing failed (finish's [`RecordError::Io`]). The event path keeps its lock-free ring: the count comes from the
//!   consumer's side, after the fact, so the hot path gains nothing. Tests race marks
//!   and traced allocations against finish on real threads, 200 and 50 times.
//! - The reader checks every record's CRC-32 and every event's size before decoding, so
//!   a damaged file cannot be misread past the damage; tests truncate and corrupt files at
//!   every record boundary. A record's header (its kind) is not under the checksum, so in
//!   a file of a version the reader knows whole (its own minor or older) a record or event
//!   kind it does not know, bytes past a record's fields, and an end record whose counts
//!   are not what was read are damage too: a flipped bit in a kind cannot drop records
//!   from a trace that reads as clean (a test flips every bit of every record's kind).
//!
//! # Quickstart
//! ```
//! use std::sync::Arc;
//! use memory_governor::*;
//! use memory_trace::{Recorder, replay::{self, AllocatorKind, ReplayConfig}};
//!
//! let gpu = DeviceKey::host(1); // a simulated device
//! let governor = Governor::new();
//! governor.set_device_limit(gpu, 64 << 20)?;
//! let tenant = IdentityIssuer::new()?.authority()?;
//! governor.open_account(AccountConfig::new(gpu, tenant).with_label("tenant-a"))?;
//! let system = Arc::new(allocator_cpu::SystemAllocator::for_device(gpu));
//!
//! // Record: wrap the governed allocator; register `traced` where `governed` would go.
//! let path = std::env::temp_dir().join(format!("lib-quickstart-{}.mtrace", std::process::id()));
//! let recorder = Recorder::create(&path)?;
//! let traced = recorder.trace(&governor, governor.govern(system, tenant)?);
//! let kv = AllocationRequest::new(1 << 20, 256)?.with_role(MemoryRole::KvCache);
//! let blocks: Vec<_> = (0..8).map(|_| traced.allocate(&kv)).collect::<Result<_, _>>()?;
//! for block in blocks {
//!     assert!(traced.release(block).is_complete());
//! }
//! recorder.finish()?;
//!
//! // Read and replay against a pool.
//! let trace = memory_trace::read_trace(std::fs::File::open(&path)?)?;
//! # std::fs::remove_file(&path)?;
//! assert_eq!(trace.events.len(), 16);
//! let report = replay::replay(&trace, &ReplayConfig::new(AllocatorKind::Pooled));
//! assert_eq!(report.devices[0].peak_allocated, 8 << 20);
//! assert!(report.devices[0].refusals.is_empty());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

mod books;
mod clock;
mod event;
mod format;
mod read;
mod recorder;
mod ring;
mod sync;
mod traced;
mod writer;

pub mod convert;
pub mod html;
pub mod replay;

#[cfg(all(test, memory_loom))]
mod loom_ring;

// The public interface.

// Recording.
pub use recorder::{
    CallerTag, RecordError, Recorder, RecorderConfig, RecordingSummary, caller_tag, replace_caller_tag, set_caller_tag,
    with_caller_tag,
};
pub use traced::TracedAllocator;

// What a trace holds.
pub use event::{Block, Event, FailureKind, MarkKind, Refusal, RefusalKind, ReleaseKind, Scope, Tenant, What};

// The format: reading and writing.
pub use format::{MAGIC, MAJOR, MINOR, crc32};
pub use read::{Damage, DamageKind, End, ReadError, Trace, read_trace, scan_trace};
pub use writer::TraceWriter;
