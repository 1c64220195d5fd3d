//! memory-ort: ONNX Runtime allocates through the registry and the governor.
//!
//! [`GovernedOrtAllocator`] is an `OrtAllocator` (the C table: version, `Alloc`,
//! `Free`, `Info`, `Reserve`, `GetStats`, and API 23/25's `AllocOnStream` (null:
//! unsupported) and `Shrink`) whose every block is a
//! [`BoundAllocation`](memory_governor::BoundAllocation) of a governed
//! [`MemoryBinding`](memory_governor::MemoryBinding): registry-issued identity, charged
//! by the governor to the tenant, by role. `Reserve` (initializers) and `Alloc` (per-run
//! memory) charge different roles ([`OrtAllocatorConfig`]). A refusal answers null
//! (ONNX Runtime's failure signal); the governor's message is logged, kept
//! ([`GovernedOrtAllocator::last_refusal`]) and attached to the session's error
//! ([`OrtAdapterError::Refused`]).
//!
//! [`OrtEnvironment`] commits sessions with a governed allocator
//! ([`GovernedSession`]): it registers the allocator with the environment
//! (`RegisterAllocator`, non-arena memory info), creates the session with
//! `session.use_env_allocators = 1`, and unregisters it, so each session keeps its
//! tenant's allocator and two tenants share one process.
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
//! - **No panic crosses the boundary**: every `extern` entry catches unwinding and
//!   answers its failure value.
//! - **Device loss**: after `invalidate_device`, `Alloc` answers null (runs fail
//!   cleanly) and `Free` frees nothing; the registry retires the blocks and the
//!   governor refunds them when the context is confirmed terminated.
//! - **Unsafe code** is confined to `ffi.rs` (the table, memory info, status
//!   handling) and the two environment calls; every block says why it is sound.
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
//! let pool: Arc<dyn DeviceAllocator> = Arc::new(PooledAllocator::new(SystemAllocator::new()));
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
mod sink;
pub mod workloads;

// The public interface.
pub use allocator::{AllocatorWatch, GovernedOrtAllocator};
pub use assets::OrtAssets;
pub use blocks::OrtAllocatorStats;
pub use config::{CPU_MIN_ALIGNMENT, CUDA_MIN_ALIGNMENT, OrtAllocatorConfig};
pub use environment::{GovernedSession, OrtEnvironment};
pub use error::OrtAdapterError;
