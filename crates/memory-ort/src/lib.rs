//! memory-ort: ONNX Runtime allocates through the registry and the governor.
//!
//! [`GovernedOrtAllocator`] is an `OrtAllocator` (the C table: version, `Alloc`,
//! `Free`, `Info`, `Reserve`, `GetStats`, and API 23/25's `AllocOnStream` (null:
//! unsupported) and `Shrink`) whose every block is a
//! [`BoundAllocation`](memory_governor::BoundAllocation) of a governed
//! [`MemoryBinding`](memory_governor::MemoryBinding): registry-issued identity, charged
//! by the governor to the tenant, by role. `Reserve` (initializers) and `Alloc` (per-run
//! memory) charge different roles ([`OrtAllocatorConfig`]). A refusal fails the commit or
//! run that asked (see "A refusal in the middle of a run" for what ONNX Runtime gets
//! meanwhile); the governor's message is logged, kept
//! ([`GovernedOrtAllocator::last_refusal`]) and attached to the session's error
//! ([`OrtAdapterError::Refused`]).
//!
//! [`OrtEnvironment`] commits sessions with a governed allocator
//! ([`GovernedSession`]): it registers a table of the session's own with the
//! environment (`RegisterAllocator`, non-arena memory info), creates the session with
//! `session.use_env_allocators = 1`, and unregisters it, so each session keeps its
//! tenant's allocator and two tenants share one process. Several sessions of one tenant
//! commit with one allocator (ONNX Runtime's shared-allocator use: one pool, one set of
//! books), run at once, and each keeps figures of its own ([`GovernedSession::stats`]).
//!
//! # Every execution mode
//! ONNX Runtime gives `Alloc` nothing but the table, and its worker threads (intra-op,
//! inter-op for the parallel executor, a global thread pool shared by sessions) are not
//! the thread that called `run`. So the table says whose call it is: each session has
//! its own, whose phase (committing, running, idle) is one atomic word. Every request of
//! a run, on any thread, is charged to that run, and a refusal on any thread stops it
//! (`RunOptionsSetTerminate`) and fails it with [`OrtAdapterError::Refused`]. Tested on
//! real models in every configuration: sequential with 1, 2 and 4 intra-op threads, the
//! parallel executor, a global thread pool shared by two sessions, two sessions of one
//! allocator run at once (`tests/execution_modes.rs`, `tests/global_pool.rs`).
//!
//! # A refusal in the middle of a run (or a commit)
//! ONNX Runtime's tensors do not check the pointer an allocator returns, so a refused
//! run-time request cannot be answered with null; nor can a commit's (prepacked weights
//! are written as soon as they are allocated: a null there crashed the process). Until
//! the run reaches its next kernel boundary and stops, or the commit returns, refused
//! requests are served from the governor's **overdraft**
//! ([`Account::draw_overdraft`](memory_governor::Account::draw_overdraft): host memory
//! booked per device and tenant, live and peak, bounded by the device's overdraft limit,
//! 64 MiB by default); past that limit (or without an account to book it to) from the
//! **scratch sink** (`src/sink.rs`): address space of the size asked mapped onto one
//! fixed 2 MiB backing, so the process holds no more however much the stopped run asks.
//! The run or commit fails with the governor's reason, its outputs (or the session) are
//! discarded, and both are freed as it unwinds. Outside a commit or run, a request
//! through a session's table (which safe code reaches with
//! `ort::memory::Allocator::new(session, ..)`, and whose tensors do not check either) is
//! served from the overdraft, booked as such; past its limit it is answered with null,
//! never from the sink, whose aliased memory must not back a tensor that lives on. A
//! refusal through the handle's own table outside a run is answered with null (its
//! callers check the pointer). The CUDA allocator answers null in every phase: no host
//! memory can stand in for device memory.
//!
//! The phase is the session's, not the calling thread's: a tensor that another thread
//! makes through the session's table while the session runs is that run's request. Its
//! refusal stops the run (with that request's reason), and past the overdraft limit it
//! is served from the sink, whose aliased memory then backs a tensor that outlives the
//! run. Make such tensors through the handle's own table
//! ([`GovernedOrtAllocator::as_ort_allocator`]), or not while the session runs.
//!
//! # ONNX Runtime's own memory
//! ONNX Runtime keeps part of every session in allocations of its own that no
//! `OrtAllocator` sees: the graph with its initializer buffers, the kernels, and what a
//! kernel packs with its own allocator. With ONNX Runtime 1.31 on the CPU execution
//! provider this is most of a session's weights in *every* mode: prepacked kernels and
//! the parallel executor read the initializers from the graph's buffers, and without
//! prepacking the session copies them into blocks of the adapter as well (a second
//! copy; prepacking is therefore on by default, as in a stock session, and holds less:
//! [`OrtAllocatorConfig::prepacking`]). An allocation tracer (`LD_PRELOAD`, every
//! `malloc`, `posix_memalign`, `operator new` and `mmap` by caller) showed ONNX
//! Runtime's own live allocations after a commit the same with prepacking on and off
//! (Silero VAD 8.53 MB, PP-OCRv4 detection 6.95 MB): prepacking adds nothing outside
//! the adapter, it drops the adapter's copy. ONNX Runtime offers no way to hand these
//! allocations an allocator: `PrepackedWeightsContainer::GetOrCreateAllocator` (the
//! container behind `CreateSessionWithPrepackedWeightsContainer`) makes a plain
//! `CPUAllocator` of its own, and the session options have no key for it.
//!
//! So a commit measures them and books them ([`OrtAllocatorConfig::charge_runtime_memory`],
//! on for the CPU allocator): the C heap's growth across the commit (glibc's
//! `mallinfo2`, every arena), less what the adapter's own work grew it by on any thread
//! meanwhile (its blocks, their bookkeeping, trims, log events), plus 234.5 KiB, the most
//! glibc's per-thread cache can hide of the growth. The figure is charged to the
//! reserve role (weights) as a lease the session's table holds until ONNX Runtime
//! releases the session; a quota too small for it fails the commit with the governor's
//! reason ([`OrtAdapterError::Refused`]) and the session is released. It is reported as
//! [`OrtAllocatorStats::runtime_held`] (`RuntimeHeld` in `GetStats`), beside `in_use`.
//! `tests/prepacking.rs` checks, in both executors, that it is at least what a stock
//! session of the model takes from the heap and what the governed commit took.
//!
//! How exact it is:
//! - **Other threads.** The heap figure is the process's. Governed commits are
//!   serialized, a governed session (also one whose commit was refused after ONNX
//!   Runtime created it) is released under the same lock, and the adapter's
//!   own work on every thread is taken out; what else allocates or frees C heap during
//!   a commit (the application's threads, sessions without the adapter, outputs or
//!   I/O bindings releasing a session late) is booked to the commit, or taken from it
//!   (a figure that would be negative books nothing, with a `warn` event). So is what
//!   governed sessions running meanwhile do: ONNX Runtime's own heap of their runs is
//!   booked to the commit, and the commit's growth while one of their requests is in
//!   the adapter is taken out with that request's own work (the figure is the process's,
//!   not a thread's). Measured: PP-OCRv4 detection's commit books 7.6 MB alone, 4.0 to
//!   10.4 MB while two Silero VAD sessions run in a loop. Commit while nothing runs
//!   where the figure must be close.
//!   The lock is reentrant: a reclaim holder that drops an idle session from inside a
//!   commit's allocation (the governor calls holders on the allocating thread, the
//!   committing one) releases it at once, and what that frees counts as the adapter's
//!   own work, once (own work nests there: only the outermost measures;
//!   `tests/refusal_answers.rs`, `heap.rs`). A session dropped on another thread waits
//!   for a commit in progress, except one stalled in an allocation for 200 ms or more (a
//!   reclaim holder that waits, perhaps for a lock the dropping thread holds, as a cache
//!   that evicts under its own lock does): that drop returns at once, and the session is
//!   released under the lock as soon as the commit is done, so its memory does not make
//!   room for that commit (`tests/commit_lock.rs`). Release a holder's sessions on the
//!   calling thread. A commit waits for the lock in every case: do not commit while
//!   holding a lock a reclaim holder takes.
//! - **Overhead included.** The figure is heap in use, so glibc's chunk headers
//!   (about 0.4 MB on PP-OCRv4 detection's 27 000 small allocations) are booked too.
//! - **Once per process.** The first commit also books what ONNX Runtime sets up once
//!   per process and keeps after that session (about 1.4 MB), for that session's life.
//! - **Not heap.** Thread stacks of per-session thread pools and file mappings of
//!   external initializers are not in the figure; nor is heap ONNX Runtime allocates
//!   after the commit (a few KB per run shape).
//! - **Where it cannot measure**: without glibc's `mallinfo2` (another C library, glibc
//!   before 2.33) nothing is booked (a `warn` event says so); with `malloc` replaced by an
//!   allocator glibc does not see, the growth reads zero. The CUDA allocator does not
//!   book it ([`OrtAllocatorConfig::cuda`]): the figure is host memory.
//!
//! # Shapes that vary
//! ONNX Runtime allocates every buffer of a new input shape on its own in the shape's
//! first run and one planned block per run after it, so a caching allocator would keep
//! the first run's buffers for good. A session therefore trims its allocator after the
//! first run of each new shape ([`OrtAllocatorConfig::trim_on_new_shapes`]), and each
//! trim (also ONNX Runtime's `Shrink`) and each commit then hands the C heap's free
//! pages back to the operating system ([`OrtAllocatorConfig::return_free_heap_pages`];
//! glibc keeps freed memory resident otherwise: what the model was loaded with, the
//! trimmed blocks, ONNX Runtime's own first-run buffers). Both are counted
//! ([`OrtAllocatorStats::trims`], [`OrtAllocatorStats::heap_returns`]).
//!
//! # Correctness
//! - **Lifetimes across the boundary.** ONNX Runtime never says when it stops calling
//!   an allocator. The table lives in a reference-counted core held by every handle,
//!   by every session made with it (through the session's logger, which ONNX Runtime
//!   keeps until the session is released) and by every live block (`Free` gives the
//!   block's count back as its last step). Dropping the handle while a session or an
//!   output tensor can still call is therefore harmless, and the core is freed as soon
//!   as the last of them is gone, never leaked for the process. The argument is in the
//!   `ffi` module; `tests/ownership.rs` drops things in every order under ONNX Runtime.
//! - **`Free` finds the handle without a process-wide lock**: blocks live in a sharded
//!   map keyed by address; `Free` takes one shard's lock.
//! - **Termination waits for ONNX Runtime.** Each session's table holds a
//!   [`CallerHold`](memory_governor::CallerHold) on the binding's provider context for as
//!   long as the session, or an output tensor it handed out, can call `Free`: until then
//!   `confirm_context_terminated` answers `ContextNotQuiescent` and the weights stay
//!   booked while ONNX Runtime still holds them.
//! - **No panic crosses the boundary**: every `extern` entry catches unwinding and
//!   answers its failure value.
//! - **Device loss**: after `invalidate_device`, a run's requests are refused (the run
//!   is stopped and fails with the loss as its reason) and `Free` frees nothing; the
//!   registry retires the blocks and the governor refunds them when the context is
//!   confirmed terminated, once no session holds it.
//! - **Unsafe code** is confined to `ffi.rs` (the table, memory info, status
//!   handling), `caller.rs` (setting a run's terminate flag), `sink.rs` (the fixed
//!   mappings), `heap.rs` (looking up and calling glibc's `mallinfo2` and `malloc_trim`), the two
//!   environment calls and a session's release under the commit lock; every block says
//!   why it is sound.
//!
//! # Quickstart
//! ```no_run
//! use std::sync::Arc;
//! use allocator_cpu::{PooledAllocator, SystemAllocator};
//! use memory_governor::*;
//! use memory_ort::{GovernedOrtAllocator, OrtAllocatorConfig, OrtAssets, OrtEnvironment};
//!
//! let assets = OrtAssets::locate()?;
//! let env = OrtEnvironment::load(&assets.library)?;
//!
//! // A tenant on the host device, governed, over a pooled allocator.
//! let registry = BindingRegistry::new();
//! let governor = Governor::new();
//! let context = registry.register_provider_context(DeviceKey::HOST, Arc::new("onnx runtime"))?;
//! let tenant = registry.register_authority(DeviceKey::HOST, Arc::new("tenant-a"))?;
//! let account = governor.open_account(AccountConfig::new(DeviceKey::HOST, tenant).with_quota(256 << 20))?;
//! let pool: Arc<dyn DeviceAllocator> = Arc::new(PooledAllocator::new(SystemAllocator::for_caches(DeviceKey::HOST)));
//! let mechanism = registry.register_allocator(&context, &tenant, Arc::new(governor.govern(pool, tenant)?))?;
//! let binding = registry.bind_registered(&mechanism)?;
//!
//! let allocator = GovernedOrtAllocator::cpu(&env, binding, Some(account), OrtAllocatorConfig::default())?;
//! let mut session = env.commit_from_file(&allocator, env.session_builder()?, &assets.silero_vad)?;
//! // session.run(ort::inputs![...])? charges activations; the weights stay charged
//! // until the session is dropped.
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(unsafe_code)]

mod allocator;
pub mod assets;
mod blocks;
#[allow(unsafe_code)]
mod caller;
mod config;
mod environment;
mod error;
#[allow(unsafe_code)]
mod ffi;
#[allow(unsafe_code)]
mod heap;
#[allow(unsafe_code)]
mod sink;
pub mod workloads;

// The public interface.
pub use allocator::{AllocatorWatch, GovernedOrtAllocator};
pub use assets::OrtAssets;
pub use blocks::OrtAllocatorStats;
pub use config::{CPU_MIN_ALIGNMENT, CUDA_MIN_ALIGNMENT, OrtAllocatorConfig};
pub use environment::{GovernedSession, OrtEnvironment};
pub use error::OrtAdapterError;
