//! Host-memory [`DeviceAllocator`](memory_api::DeviceAllocator) backends.
//!
//! | allocator | what it is | capability |
//! |-----------|------------|------------|
//! | [`SystemAllocator`] | the global allocator, any size and power-of-two alignment | — |
//! | [`PooledAllocator`] | a caching allocator over any allocator: size classes, large requests carved best-fit from segments (split, merged), idle memory given back without a trim, capped, trimmable | — |
//! | [`VirtualHostAllocator`] | reserve address space, commit pages on demand (the CPU twin of CUDA VMM) | [`VirtualBacking`](memory_api::VirtualBacking) |
//! | [`SharedHostAllocator`] | one memfd mapped into several reservations (the CPU twin of a shared KV prefix) | [`SharedMapping`](memory_api::SharedMapping) |
//!
//! Beside them, [`HostReleaseQueue`]: a bounded [`DeferredReleaseQueue`](memory_api::DeferredReleaseQueue)
//! whose releases run when its owner says so (the C API's `mc_queue_create`).
//!
//! Platforms: [`SystemAllocator`] and [`PooledAllocator`] build and run everywhere;
//! [`VirtualHostAllocator`], [`SharedHostAllocator`] and [`probe`] need `mmap` and
//! exist on unix only (Linux and macOS). On Windows they are absent at compile time.
//!
//! [`probe`] reads and writes host memory that may be protected without crashing.
//! This crate depends on `memory-api` and `memory-sync` only (never on the registry or
//! the governor): it is a provider.
//!
//! # Correctness
//! - **Every block is validated before memory is touched.** Each allocator keeps a
//!   record per live block, named by the block's provider tag: the system and pooled
//!   allocators in `memory_sync`'s record table (inserted by the allocating thread with
//!   plain stores, taken by a release on any thread with one compare-and-swap), the
//!   address-space allocators in per-thread shards of slabs (their records are `Arc`
//!   pins of a reservation with its own lock). `release` and every capability call first check that the record exists and
//!   matches the block's address, size, alignment and device exactly; a foreign,
//!   forged or repeated block is refused ([`ReleaseOutcome::Failed`](memory_api::ReleaseOutcome)
//!   or [`CapabilityError::NotOwned`](memory_api::CapabilityError)) and nothing is
//!   freed. So no safe call can free, unmap or re-protect memory this allocator does
//!   not own, and none can do so twice.
//! - **Unsafe code is confined and argued.** The system calls live in one private
//!   module whose functions state their obligations (`# Safety`); every `unsafe` block
//!   says in `// SAFETY:` why each obligation holds (the lint
//!   `clippy::undocumented_unsafe_blocks` is denied workspace-wide). The obligations
//!   reduce to: the range lies inside a live reservation of ours (checked against the
//!   record, under the reservation's lock, which also excludes a racing release), and
//!   no Rust reference points into it (we never create one; callers reach the memory
//!   only through addresses, whose use is their own unsafe obligation).
//! - **Errors before mutation hand the block back**; a release that unmapped part of
//!   a reservation before failing reports a quarantine with the exact bytes. Nothing
//!   panics on bad input; a size the system refuses is an `AllocError`.
//! - **Concurrency**: no allocator has a global lock on its hot path (the record table;
//!   per-thread class caches behind an owner gate, which a trim claims; per-thread
//!   shards and per-reservation locks for the address-space allocators; the pool's
//!   segments share one lock, a request that large costing far more). The gate and the
//!   record table are loom-checked in `memory-sync`. The conformance suite of
//!   `memory-testkit` runs over every allocator here, including its multi-threaded
//!   checks, and every system-call error path is driven by test-only fault injection.
//! - Addresses are exposed-provenance values (`expose_provenance` when memory is
//!   obtained, `with_exposed_provenance_mut` when it is handed back to the system).
//!
//! # Quickstart
//! ```
//! use allocator_cpu::{PooledAllocator, SystemAllocator, VirtualHostAllocator};
//! use memory_api::{AllocationRequest, ByteRange, DeviceAllocator, MemoryRole};
//!
//! // A pool of KV pages over the system allocator (large blocks from the OS, so what
//! // the pool gives back leaves the process).
//! let pool = PooledAllocator::new(SystemAllocator::for_caches(memory_api::DeviceKey::HOST));
//! let page = AllocationRequest::new(64 << 10, 256)?.with_role(MemoryRole::KvCache);
//! let block = pool.allocate(&page)?;
//! assert!(pool.release(block).is_complete());     // cached, not freed
//! let again = pool.allocate(&page)?;              // served from the cache
//! assert_eq!(pool.pool_stats().hits, 1);
//! assert!(pool.release(again).is_complete());
//! assert_eq!(pool.trim(), 64 << 10);              // handed back to the system
//!
//! // Reserve 1 MiB of address space; commit only what is used.
//! let arena = VirtualHostAllocator::new();
//! let reservation = arena.allocate(&AllocationRequest::new(1 << 20, 4096)?)?;
//! let vb = arena.virtual_backing().expect("virtual allocators reserve and commit");
//! assert_eq!(vb.commit(&reservation, ByteRange::new(0, 64 << 10))?, 64 << 10);
//! assert_eq!(vb.committed_bytes(&reservation)?, 64 << 10);
//! let memory = allocator_cpu::probe::read;        // committed pages are readable
//! // SAFETY: the reservation is ours and nothing else touches it.
//! assert_eq!(unsafe { memory(reservation.address(), 16) }?, vec![0; 16]);
//! assert!(arena.release(reservation).is_complete());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

// The allocators that build everywhere, and what they share. `pooled` is a folder,
// one file per cache: `classes` (the size classes: per-thread caches), `segments`
// (large blocks carved from segments, BFC-style), `records` (the record of every block
// handed out, in memory-sync's record table) and `stats` (the counters both keep);
// `table` holds the slabs of the segments and the per-thread shards the address-space
// allocators validate a release against.
mod lost;
mod pooled;
mod queue;
mod system;
mod table;

// Address-space reservation and shared mappings need `mmap`: Linux and macOS.
#[cfg(unix)]
pub mod probe;
#[cfg(unix)]
mod ranges;
#[cfg(unix)]
mod region;
#[cfg(unix)]
mod shared_host;
#[cfg(unix)]
mod sys;
#[cfg(unix)]
mod virtual_host;

// The public interface.
pub use pooled::{PoolConfig, PoolStats, PooledAllocator};
pub use queue::HostReleaseQueue;
pub use system::SystemAllocator;
// Unix only (Linux and macOS). On other platforms these names do not exist, so a use
// of them fails at compile time rather than at run time.
#[cfg(unix)]
pub use shared_host::{HostBacking, SharedHostAllocator};
#[cfg(unix)]
pub use virtual_host::VirtualHostAllocator;
