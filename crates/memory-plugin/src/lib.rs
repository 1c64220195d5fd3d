//! Allocators from shared libraries: the loader for the versioned plugin ABI
//! (`memory-plugin-abi`, header `include/memory_plugin.h`) and the wrapper that makes a
//! plugin's allocator a [`DeviceAllocator`](memory_api::DeviceAllocator), so it
//! registers like any other mechanism.
//!
//! This crate is a provider: it depends on `memory-api` and the ABI crate only, never on
//! the registry or the governor. The contract is `docs/C-ABI.md`.
//!
//! # What it does
//! - [`PluginLibrary::load`] opens a library and resolves `mp_plugin_entry` (and the
//!   optional `mp_plugin_tally`); [`PluginLibrary::instantiate`] hands the plugin an
//!   `MpHost` (ABI version, offered capabilities, configuration, a log sink) and
//!   negotiates the table it returns: the major must match, the minor is the lower of
//!   both sides', a table shorter than that minor's prefix is refused and nothing past
//!   the prefix is read, required slots must be present, and claimed capabilities must
//!   have been offered and come with their slots.
//! - [`PluginAllocator`] wraps the instance: its capabilities become
//!   [`VirtualBacking`](memory_api::VirtualBacking) and
//!   [`SharedMapping`](memory_api::SharedMapping), deferred release becomes a
//!   [`PluginReleaseQueue`], and optional slots that are null are
//!   [`PluginError::Unsupported`] (never a silent no-op).
//! - [`PluginAllocator::from_table`] negotiates a table that is not in a library (a C
//!   runtime's own vtable, through the host C API).
//!
//! # Unload protocol
//! Every instance holds an `Arc` of its library; every registry mechanism, binding,
//! allocation, view and queued release made through the instance holds the instance (the
//! registry pins the allocator it came from), and so do shared backings and release
//! queues. So the library stays mapped while anything made through it lives.
//! [`PluginLibrary::unload`] succeeds only when the host holds nothing through it
//! ([`HostTally`]) and the plugin's own tally ([`PluginTally`]) is empty; otherwise it
//! returns [`UnloadRefused`] with both tallies and the library, still loaded. Dropping a
//! [`PluginLibrary`] gives up only that handle: the code is unmapped when the last pin
//! goes, and never while the plugin's tally says it still holds something (the tally is
//! the library's, over every load of it: while another load of the same library lives,
//! a dropped load closes its own reference, and that load keeps the code mapped).
//!
//! A block the host keeps as *suspect* (below) keeps its instance: the plugin may still
//! own it, so the instance is not destroyed, nor its library unmapped, until a suspect
//! retry ([`PluginLibrary::retry_suspects`], [`PluginAllocator::retry_suspects`]) hands
//! it back to the plugin's `release` and the plugin takes it back or says it holds no
//! such block. Without one, it stays for the life of the process, and every unload is
//! refused, saying how many suspect blocks remain ([`UnloadRefused::suspect_blocks`]).
//!
//! # Trust
//! A plugin's code is trusted to be memory-safe (loading it is `unsafe`), but none of
//! its answers is. The host records every block it handed out (owner-local records: no
//! read-modify-write to record, one compare-and-swap to take back, so of two racing
//! releases exactly one reaches the plugin) and passes a plugin only blocks it issued;
//! a block on another device, misaligned, too small, at address zero or running past
//! the end of the address space is handed back, with a message naming the rule it broke
//! (asked against given); a block overlapping a live block of the instance (checked
//! against an ordered map of the live ranges, by address region) is refused and kept as
//! suspect; a release outcome about another block, of an unknown kind, or with an
//! unknown status is a quarantine of the whole block; an unknown status on allocate
//! keeps any block it returned as suspect (never freed); commit and unmap answers larger
//! than the range are errors; a deferred-release ticket the host never issued is ignored.
//!
//! # Correctness
//! `unsafe` is confined to calling the plugin's slots, reading its table and loading
//! its library; every block names what the ABI guarantees (`// SAFETY:`), and every
//! `unsafe fn` says what the caller must (`# Safety`). The tests build an example
//! plugin in C at test time (`tests/c/example_plugin.c`) with a scripted fault mode and
//! load it through this crate: negotiation (older and newer minors, wrong major, short
//! table), every capability, unload refusal and success, and dishonest answers. The
//! block records (`records`, a payload in `memory_sync`'s record table, safe code whose
//! loom models live in `memory-sync`: racing releases of one block, a stale tag against
//! a reused slot, a restore racing a release) and their tests run under Miri, as do those of the
//! live-range index (`ranges`, safe code: an ordered map per address region under a
//! lock, consulted and written only by `allocate`).
//!
//! # Quickstart
//! ```no_run
//! use memory_api::{AllocationRequest, DeviceAllocator};
//! use memory_plugin::{InstanceOptions, PluginLibrary};
//!
//! // SAFETY: the library is our own build of an allocator plugin.
//! let library = unsafe { PluginLibrary::load("libexample_plugin.so") }?;
//! let allocator = library.instantiate(&InstanceOptions::new().config("device=host:0"))?;
//! let block = allocator.allocate(&AllocationRequest::new(4096, 64)?)?;
//! assert!(allocator.release(block).is_complete());
//!
//! // Anything still alive through the library refuses the unload, with tallies.
//! let library = library.unload().unwrap_err().library;
//! drop(allocator);
//! library.unload()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod allocator;
mod capability;
mod error;
mod library;
mod negotiate;
mod queue;
mod ranges;
mod records;
mod tally;

// The public interface.
pub use allocator::{BACKEND, PluginAllocator};
pub use capability::PluginBacking;
pub use error::{PluginError, StatusCode, UnloadRefused};
pub use library::{InstanceOptions, PluginLibrary};
pub use negotiate::abi_device;
pub use queue::PluginReleaseQueue;
pub use tally::{HostTally, PluginTally, SuspectRetry};
