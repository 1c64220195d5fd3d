//! memory-node: one device budget, and tenant quotas, across every process on a node,
//! over memory-governor; a process that dies gives its memory back.
//!
//! # What it does
//! - **Node books** ([`NodeBooks`]): a file in a directory the operator chooses
//!   (`/dev/shm` by default, created with mode 0600 unless configured), mapped by every
//!   process that opens it: per device a node limit, per tenant of a device a node quota,
//!   and per process a slot (pid, process start time, pidfs inode, boot id, pid
//!   namespace) with what that process was granted, allocated and holds. A versioned
//!   layout with a checked header ([`format`](mod@format)); a file of another version, a
//!   truncated or corrupt one, one this user may not open, one another user owns where
//!   this process asked for books of its own user only (the default 0600), or one its
//!   file system has no room for (the pages of a file are reserved before they are
//!   mapped: an unbacked page would fault with `SIGBUS`), is refused with an
//!   [`OpenError`] that says which.
//! - **Grants** ([`Member`], [`NodePolicy`]): each process's governor keeps its own
//!   credit protocol untouched; its *local* device limit and tenant quotas are grants
//!   drawn from the node books. When a local budget runs short, the device's
//!   [`NodePolicy`] (asked by the governor with no lock held) draws
//!   `max(missing, grant chunk)` from the node, raises the local limit and lets the
//!   governor retry. So the shared memory is touched only when a process's local grant
//!   runs out: the governed hot path is the process-local one. Surplus goes back on a
//!   timer (and at once, margin and all, when another member was refused).
//! - **Crash refund**: a process's grants are the words of its slot, and nothing else
//!   holds a copy, so a survivor that finds the slot's process gone (its pid has no
//!   process, or a process that started at another time: a reused pid never inherits a
//!   slot, even one reused within the clock tick start times count in, where the kernel
//!   has pidfs: the process's pidfs inode tells it apart; or, for a process of another
//!   pid namespace, whose pid means nothing here, the slot's lease file it held locked is
//!   free) zeroes the slot and frees it.
//!   Members look on every refusal and on their timer (every
//!   [`NodeConfig::with_refund_interval`], 100 ms by default): a dead process's
//!   memory is back within [`NodeConfig::refund_bound`] while any member runs.
//!
//! The rules, the trust model (every process that can open the file is a trusted peer;
//! its owner and mode are the boundary) and the bounds are written down in
//! `docs/ACCOUNTING.md`, "Node books".
//!
//! # Platforms
//! Unix only (Linux is where the tests run): on other targets the crate is empty.
//!
//! # Correctness
//! - `unsafe` code lives in one module, `map` (the shared mapping: `mmap`, the
//!   reference to the mapped words, `munmap`), each block with its `// SAFETY:`
//!   argument. The mapping holds `AtomicU64`s only, so whatever another process writes
//!   can make a figure wrong but never a reference invalid; a file's header is checked
//!   with ordinary reads before anything is mapped.
//! - The protocol (`src/protocol.rs`, its argument in the module docs): a grant is one
//!   read-modify-write on the process's own word and a read of every slot's word
//!   (`SeqCst`, a store-buffering pair), so the sum of grants never exceeds a limit;
//!   claims, releases and refunds run under the books' `flock`, which the kernel drops
//!   when its holder dies. loom models (`src/loom_slots.rs`: racing grants against a
//!   limit with a watcher's snapshots, a process dying mid-grant refunded while others
//!   grant and a new process claims the slot) check that code unchanged through the
//!   `sync` module; run them with `cargo xtask loom`.
//! - Tests with real processes (`tests/processes.rs`, the test binary re-executing
//!   itself): four processes × two threads under one device limit and two tenant quotas
//!   with a watcher sampling the books, SIGKILL at random points and inside a charge,
//!   a forged slot with a live pid and another start time, and the bad files (another
//!   version, truncated, corrupt, another user's 0600 file).
//!
//! # Quickstart
//! ```
//! use std::sync::Arc;
//! use memory_governor::*;
//! use memory_node::{NodeBooks, NodeConfig};
//!
//! let gpu = DeviceKey::host(5); // a simulated device
//! let config = NodeConfig::new(format!("memory-node-doc-{}", std::process::id()))
//!     .with_directory(std::env::temp_dir())
//!     .with_grant_chunk(256 << 10);
//! // The operator's side: the node's limits (any process may set them).
//! let books = NodeBooks::open(config)?;
//! books.set_device_limit(gpu, 4 << 20)?;
//! books.set_tenant_quota(gpu, "tenant-a", 3 << 20)?;
//!
//! // Each process: its own registry and governor, joined to the books.
//! let registry = BindingRegistry::new();
//! let context = registry.register_provider_context(gpu, Arc::new("arena"))?;
//! let tenant = registry.register_authority(gpu, Arc::new("tenant-a"))?;
//! let governor = Governor::new();
//! governor.open_account(AccountConfig::new(gpu, tenant).with_label("tenant-a"))?;
//! let member = books.join(&governor)?;
//! member.govern_device(gpu, Arc::new(HardLimit))?;
//! member.bind_tenant(tenant, "tenant-a")?;
//!
//! let system: Arc<dyn DeviceAllocator> = Arc::new(allocator_cpu::SystemAllocator::for_device(gpu));
//! registry.register_allocator(&context, &tenant, Arc::new(governor.govern(system, tenant)?))?;
//! let binding = registry.bind(gpu)?;
//! // The first allocation draws a grant from the node; the rest come from it locally.
//! let block = binding.allocate(AllocationRequest::new(64 << 10, 256)?)?;
//! assert!(member.device_grant(gpu).unwrap() >= 64 << 10);
//! // The tenant's node quota holds across processes: 4 MiB is more than it has.
//! assert!(binding.allocate(AllocationRequest::new(4 << 20, 256)?).is_err());
//! binding.release(block)?;
//!
//! let report = member.leave();
//! assert!(report.slot_freed);
//! assert_eq!(books.snapshot().device(gpu).unwrap().granted, 0);
//! # std::fs::remove_file(books.path())?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
// The books are a Unix facility (a shared `mmap`, `flock`, `kill(pid, 0)` and the
// process's start time): on other targets the crate is empty, so a workspace that
// depends on it still builds there.
#![cfg(unix)]
// Under the loom cfg only the protocol and its models build (the mapping, the books and
// the members need a real file and real processes).
#![cfg_attr(memory_loom, allow(dead_code, unused_imports))]

#[cfg(not(memory_loom))]
mod books;
#[cfg(not(memory_loom))]
mod error;
pub mod format;
#[cfg(not(memory_loom))]
mod liveness;
#[cfg(not(memory_loom))]
mod map;
#[cfg(not(memory_loom))]
mod member;
mod protocol;
mod sync;

#[cfg(all(test, memory_loom))]
mod loom_slots;

// The public interface.

// The books: opening them, the node's limits and quotas, snapshots, refunds.
#[cfg(not(memory_loom))]
pub use books::{
    DEFAULT_GRANT_CHUNK, NodeBooks, NodeConfig, NodeDeviceSnapshot, NodeSnapshot, NodeTenantSnapshot, Refund,
    SlotBudget, SlotSnapshot,
};
// A process's membership and the policy that draws grants.
#[cfg(not(memory_loom))]
pub use member::{LeaveReport, Member, MemberStats, NodePolicy};
// Errors.
#[cfg(not(memory_loom))]
pub use error::{BooksIoError, NodeError, OpenError};
