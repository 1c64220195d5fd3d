//! Test kit for the device-memory workspace: allocators that record and fail on
//! demand, the reference model of the registry, and the conformance suite every [`DeviceAllocator`](memory_api::DeviceAllocator) must pass.
//!
//! | item | use it to |
//! |------|-----------|
//! | [`RecordingAllocator`] | count every callback (allocate, release, capability calls, trim, forget_lost) and hold one in flight with a [`CallbackGate`] |
//! | [`FaultyAllocator`] | fail the n-th call, return a partial (quarantined) or failed release, or panic inside a chosen callback |
//! | [`HostHeap`] | real host memory in safe Rust, labelled with any [`DeviceKey`](memory_api::DeviceKey), optionally with a byte limit |
//! | [`conformance`] | the contract checks, individually or all at once, with skips reported by name |
//! | [`reference`](mod@reference) | the sequential reference model of the registry that the property test and the fuzz harness both check against |
//! | [`MemoryAccess`] | fault-safe reads and writes so memory checks never crash and run on device memory too |
//!
//! # Correctness
//! - The crate has no `unsafe` code (`#![forbid(unsafe_code)]`): [`HostHeap`] keeps its
//!   blocks as `Vec<u8>` in a table and [`HostHeapAccess`] copies through that table.
//! - Wrappers count a call on entry, before forwarding it, and restore their in-flight
//!   count when the wrapped callback unwinds, so tests can assert that a callback was
//!   never made and that a panic left nothing in flight.
//! - A faulted call never reaches the inner allocator: an injected failure mutates
//!   nothing, which is exactly what [`ReleaseOutcome::Failed`](memory_api::ReleaseOutcome)
//!   promises, and a quarantined block is still owned by the inner allocator, so a retry
//!   releases it for real.
//! - The conformance suite is tested against a bookkeeping model allocator and a set of
//!   deliberately broken variants: every check must pass on the model and fail on the
//!   variant that breaks its behaviour.
//! - No test here relies on timing: [`CallbackGate`] synchronises with a condition variable
//!   (with a deadlock guard that only fires if a test is already broken).
//!
//! # Quickstart
//! ```
//! use memory_api::{AllocationRequest, DeviceAllocator, DeviceKey, ReleaseOutcome};
//! use memory_testkit::{Callback, FaultyAllocator, RecordingAllocator, conformance};
//!
//! // Count what a component does to its allocator.
//! let recorder = RecordingAllocator::on_device(DeviceKey::device(0));
//! let block = recorder.allocate(&AllocationRequest::new(4096, 256)?)?;
//! assert!(recorder.release(block).is_complete());
//! assert_eq!((recorder.calls(Callback::Allocate), recorder.calls(Callback::Release)), (1, 1));
//!
//! // Drive an error path: the next release fails and hands the block back.
//! let faulty = FaultyAllocator::host();
//! let block = faulty.allocate(&AllocationRequest::new(64, 8)?)?;
//! faulty.fail_nth(Callback::Release, 1);
//! let ReleaseOutcome::Failed(failed) = faulty.release(block) else { unreachable!() };
//! assert!(faulty.release(failed.into_parts().0).is_complete());
//!
//! // Check an allocator against the contract.
//! let report = conformance::run_all(memory_testkit::HostHeap::new);
//! assert!(report.ran("release_refuses_foreign_blocks"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

mod access;
mod callback;
pub mod conformance;
mod deadline;
mod faulty;
mod gate;
mod heap;
pub mod native;
mod recording;
pub mod reference;
mod tap;

// The public interface.
pub use access::{AccessError, MemoryAccess};
pub use callback::Callback;
pub use deadline::{DEADLINE, within};
pub use faulty::{FaultyAllocator, INJECTED_BACKEND, is_injected};
pub use gate::CallbackGate;
pub use heap::{HostHeap, HostHeapAccess};
pub use recording::{CallCounts, RecordingAllocator};
