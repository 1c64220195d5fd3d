//! CUDA [`DeviceAllocator`](memory_api::DeviceAllocator) backends through cudarc's
//! driver API, loaded at run time.
//!
//! # Correctness
//! - **No CUDA is fine.** libcuda is opened at run time (cudarc `dynamic-loading`);
//!   the crate builds and its tests run on machines without it. cudarc panics when
//!   libcuda or one of its symbols is missing, so every entry point first passes a
//!   cached presence guard ([`driver_available`], then a check of every symbol the
//!   crate calls) and returns [`CudaError::NoDriver`] or [`CudaError::DriverTooOld`]
//!   instead. [`device_count`] answers `Ok(0)` when the driver is present but reports
//!   no device.
//! - **Errors never call the driver.** A failed call keeps its raw `CUresult` as a
//!   [`CudaErrorCode`] named from this crate's own table; cudarc's `DriverError` (whose
//!   `Display` calls `cuGetErrorString`) is never formatted. Sticky errors (illegal
//!   address, launch failure, ECC, ...) become [`CudaError::DeviceLost`], and the
//!   device handle remembers them so later calls fail fast without touching a dead
//!   context.
//! - **Unsafe code** is confined to driver calls. Every `unsafe` block carries a
//!   `// SAFETY:` comment naming each obligation (valid out-pointers, a current
//!   context, a handle this crate created and has not released), enforced by clippy's
//!   `undocumented_unsafe_blocks` at `deny`. No cudarc type appears in the public API.
//!
//! # Quickstart
//! Probing is safe on any machine; on one without a GPU it is a typed error:
//! ```
//! use allocator_cuda::{device_count, CudaDevice, CudaError};
//!
//! match CudaDevice::open(0) {
//!     Ok(device) => println!("opened {}", device.key()),
//!     Err(CudaError::NoDriver) => println!("no CUDA driver here"),
//!     Err(CudaError::NoDevice { available, .. }) => println!("{available} devices"),
//!     Err(other) => println!("CUDA failed: {other}"),
//! }
//! let _ = device_count();
//! ```

mod device;
mod driver;
mod error;

// The public interface.
pub use device::CudaDevice;
pub use driver::{REQUIRED_SYMBOLS, device_count, driver_available};
pub use error::{BACKEND, CudaError, CudaErrorCode};
