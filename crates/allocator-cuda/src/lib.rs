//! CUDA [`DeviceAllocator`](memory_api::DeviceAllocator) backends through cudarc's
//! driver API, loaded at run time.
//!
//! | type                    | mechanism                                                  | capabilities                      |
//! |-------------------------|------------------------------------------------------------|-----------------------------------|
//! | [`CudaAllocator`]       | `cuMemAlloc` / `cuMemFree`                                  | stats                             |
//! | [`CudaPoolAllocator`]   | `cuMemAllocFromPoolAsync` / `cuMemFreeAsync` on a stream    | stats from the pool, trim         |
//! | [`CudaVmmAllocator`]    | `cuMemAddressReserve` + `cuMemCreate` / `cuMemMap` per granule | `VirtualBacking`, `SharedMapping` |
//! | [`PinnedHostAllocator`] | `cuMemHostAlloc` (page-locked host memory)                  | stats                             |
//! | [`CudaReleaseQueue`]    | a `DeferredReleaseQueue` that waits for an event on a stream | bounded, hands refusals back      |
//!
//! # Correctness
//! - **No CUDA is fine.** libcuda is opened at run time (cudarc `dynamic-loading`);
//!   the crate builds and its tests run on machines without it. cudarc panics when
//!   libcuda or one of its symbols is missing, so every entry point first passes a
//!   cached presence guard ([`driver_available`], then a check of every symbol the
//!   crate calls, [`REQUIRED_SYMBOLS`]) and returns [`CudaError::NoDriver`] or
//!   [`CudaError::DriverTooOld`] instead. [`device_count`] answers `Ok(0)` when the
//!   driver is present but reports no device.
//! - **Errors never call the driver.** A failed call keeps its raw `CUresult` as a
//!   [`CudaErrorCode`] named from this crate's own table; cudarc's `DriverError` (whose
//!   `Display` calls `cuGetErrorString`) is never formatted. Out of memory, invalid
//!   value and sticky errors (illegal address, launch failure, ECC, ...) are distinct
//!   [`CudaError`] variants; a sticky one becomes [`CudaError::DeviceLost`] and maps to
//!   the contract's `DeviceLost` errors so the runtime calls `invalidate_device`. The
//!   [`CudaDevice`] remembers it, so later calls fail fast without touching a dead
//!   context.
//! - **Honest releases.** Every allocator keeps a table of the blocks it handed out and
//!   rejects foreign or stale blocks (`NotOwned`) before calling the driver. A free the
//!   driver refuses hands the block back (`Failed`); a VMM teardown that stops partway
//!   reports `Quarantined` with the exact bytes returned and still held, and a retry
//!   resumes it.
//! - **Unsafe code** is confined to driver calls. Every `unsafe` block carries a
//!   `// SAFETY:` comment naming each obligation (valid out-pointers, a current
//!   context, a handle this crate created and has not released), enforced by clippy's
//!   `undocumented_unsafe_blocks` at `deny`. Driver handles are wrapped in private
//!   newtypes whose `Send`/`Sync` impls state why sharing them is sound. No cudarc type
//!   appears in the public API.
//! - **Destructors report what they cannot return.** Dropping a stream, event, pool or
//!   shared backing whose destroy the driver refuses logs a warning; one that cannot
//!   even make its context current logs an error naming the leaked resource, unless
//!   the device is lost (the resource went with the context).
//! - **Tested without a GPU.** `tests/fake_driver.rs` builds a small C driver
//!   (`fake-driver/fake_cuda.c`) backed by host memory, with error injection, and runs
//!   every allocator through the real cudarc call paths against it (each test re-runs
//!   its own binary with `LD_LIBRARY_PATH` pointing at it). The fake behaves like CUDA
//!   where it matters here: pools release memory above their threshold at
//!   synchronisation, and asynchronous faults surface at the next synchronising call.
//!   `tests/driver_failures.rs` fails every entry point in [`REQUIRED_SYMBOLS`] and
//!   checks the typed error, quarantine or device loss, and that nothing leaks or is
//!   freed twice. `tests/gpu.rs` holds the `gpu_*` tests for a real device, run by
//!   `cargo xtask test --gpu`.
//!
//! # Quickstart
//! Probing is safe on any machine; on one without a GPU it is a typed error:
//! ```
//! use allocator_cuda::{CudaAllocator, CudaDevice, CudaError};
//! use memory_api::{AllocationRequest, DeviceAllocator};
//!
//! match CudaDevice::open(0) {
//!     Ok(device) => {
//!         let eager = CudaAllocator::new(&device);
//!         let block = eager.allocate(&AllocationRequest::new(1 << 20, 256)?)?;
//!         assert!(eager.release(block).is_complete());
//!     }
//!     Err(CudaError::NoDriver) => println!("no CUDA driver here"),
//!     Err(CudaError::NoDevice { available, .. }) => println!("{available} devices"),
//!     Err(other) => println!("CUDA failed: {other}"),
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod device;
mod driver;
mod eager;
mod error;
mod pinned;
mod pool;
mod queue;
mod stream;
mod table;
mod vmm;

// The public interface.
pub use device::CudaDevice;
pub use driver::{REQUIRED_SYMBOLS, device_count, driver_available};
pub use eager::CudaAllocator;
pub use error::{BACKEND, CudaError, CudaErrorCode};
pub use pinned::PinnedHostAllocator;
pub use pool::{CudaPoolAllocator, PoolConfig, PoolUsage};
pub use queue::CudaReleaseQueue;
pub use stream::CudaStream;
pub use vmm::{CudaPhysicalBacking, CudaVmmAllocator};
