//! The driver boundary: is libcuda there, does it have what we call, how many devices.
//!
//! cudarc's dynamic loader (`dynamic-loading`) opens libcuda on the first driver call
//! and resolves each symbol lazily, on that symbol's first call. Both steps **panic**
//! when they fail (`Unable to dynamically load the "cuda" shared library`,
//! `Missing symbol cuMemPoolCreate`). So before any driver call this crate checks, once
//! per process and cached:
//!
//! 1. that a libcuda can be opened at all (`cudarc::driver::sys::is_culib_present`,
//!    which tries cudarc's own candidate names and closes what it opened), and
//! 2. that every entry point this crate calls is exported ([`REQUIRED_SYMBOLS`]), so an
//!    old driver is a typed [`CudaError::DriverTooOld`] instead of a panic halfway
//!    through a teardown.
//!
//! The library search path (`LD_LIBRARY_PATH`) is read by the dynamic loader when the
//! process starts; changing it afterwards has no effect on which libcuda is found.

use std::sync::OnceLock;

use cudarc::driver::{result, sys};

use crate::error::{CudaError, CudaErrorCode};

/// Every driver entry point this crate calls. The presence guard checks them all once,
/// so cudarc's lazy resolver can never panic on a missing symbol later.
pub const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolSetAttribute",
    "cuMemPoolGetAttribute",
    "cuMemPoolTrimTo",
    "cuMemAllocFromPoolAsync",
    "cuMemFreeAsync",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemsetD8Async",
];

/// Whether a libcuda can be loaded in this process (cached after the first call).
///
/// This is the cheap question; [`device_count`] also checks that the driver exports
/// every entry point this crate calls.
pub fn driver_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: `is_culib_present` dlopens cudarc's candidate names for libcuda and
        // closes each handle it opened. Its one obligation is that loading a library
        // named libcuda runs that library's initialisers: the library on the search
        // path under that name is trusted to be a CUDA driver (or this crate's fake
        // driver in tests), which is the trust every CUDA program places in it.
        unsafe { sys::is_culib_present() }
    })
}

/// Checks, once per process, that libcuda is present and exports [`REQUIRED_SYMBOLS`].
///
/// # Errors
/// [`CudaError::NoDriver`] without libcuda; [`CudaError::DriverTooOld`] naming the
/// first missing entry point.
pub(crate) fn ensure_driver() -> Result<(), CudaError> {
    static CHECKED: OnceLock<Result<(), CudaError>> = OnceLock::new();
    CHECKED
        .get_or_init(|| {
            if !driver_available() {
                return Err(CudaError::NoDriver);
            }
            // SAFETY: `culib` panics only when no libcuda can be opened; we just checked
            // that one can (the search path is fixed for the life of the process). The
            // same trust in the library's initialisers as in `driver_available` applies.
            let library = unsafe { sys::culib() };
            for &symbol in REQUIRED_SYMBOLS {
                // SAFETY: the symbol is only looked up, never called through this
                // pointer type; `get` itself has no other obligation.
                let found = unsafe { library.get::<unsafe extern "C" fn()>(symbol.as_bytes()) };
                if found.is_err() {
                    return Err(CudaError::DriverTooOld { symbol });
                }
            }
            Ok(())
        })
        .clone()
}

/// The driver's answer as a code: `Ok` for `CUDA_SUCCESS`.
pub(crate) fn check(result: sys::CUresult) -> Result<(), CudaErrorCode> {
    match result {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(CudaErrorCode(other as u32)),
    }
}

/// Classifies a failure that belongs to no device (initialisation, counting).
fn global_error(operation: &'static str, code: CudaErrorCode) -> CudaError {
    match CudaError::from_code(u32::MAX, operation, code) {
        CudaError::DeviceLost { operation, code, .. } => CudaError::Driver { operation, code },
        other => other,
    }
}

/// Initialises the driver: `Ok(false)` when it reports no device at all.
pub(crate) fn init() -> Result<bool, CudaError> {
    ensure_driver()?;
    // `result::init` wraps `cuInit(0)`; its error is a bare code that we never format.
    match result::init() {
        Ok(()) => Ok(true),
        Err(error) if error.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => Ok(false),
        Err(error) => Err(global_error("cuInit", CudaErrorCode(error.0 as u32))),
    }
}

/// How many CUDA devices this process can see.
///
/// `Ok(0)` when the driver is loaded but reports no device (`cuInit` answering
/// `CUDA_ERROR_NO_DEVICE`, or a count of zero).
///
/// # Errors
/// [`CudaError::NoDriver`] when libcuda cannot be loaded (every CPU-only machine),
/// [`CudaError::DriverTooOld`] when it lacks an entry point this crate needs, or the
/// driver's own failure of `cuInit` / `cuDeviceGetCount`.
///
/// ```
/// match allocator_cuda::device_count() {
///     Ok(count) => println!("cuda devices: {count}"),
///     Err(err) => println!("no CUDA here: {err}"),
/// }
/// ```
pub fn device_count() -> Result<u32, CudaError> {
    if !init()? {
        return Ok(0);
    }
    let count =
        result::device::get_count().map_err(|error| global_error("cuDeviceGetCount", CudaErrorCode(error.0 as u32)))?;
    Ok(u32::try_from(count).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_count_is_consistent_with_the_presence_guard() {
        // Runs on every machine: without libcuda (CI) it must be the typed NoDriver
        // error, never a panic; with a driver it is a count or a driver error.
        match device_count() {
            Err(CudaError::NoDriver) => assert!(!driver_available()),
            Ok(_) | Err(_) => assert!(driver_available()),
        }
        // The answer is cached and stable.
        assert_eq!(driver_available(), driver_available());
        assert_eq!(ensure_driver().is_ok(), ensure_driver().is_ok());
    }

    #[test]
    fn success_is_ok_and_failures_keep_the_raw_code() {
        assert_eq!(check(sys::CUresult::CUDA_SUCCESS), Ok(()));
        assert_eq!(check(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY), Err(CudaErrorCode::ERROR_OUT_OF_MEMORY));
        assert_eq!(check(sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS), Err(CudaErrorCode(700)));
    }

    #[test]
    fn initialisation_errors_are_never_reported_as_a_lost_device() {
        let err = global_error("cuInit", CudaErrorCode::ERROR_DEINITIALIZED);
        assert_eq!(err, CudaError::Driver { operation: "cuInit", code: CudaErrorCode::ERROR_DEINITIALIZED });
        assert!(matches!(global_error("cuInit", CudaErrorCode::ERROR_OUT_OF_MEMORY), CudaError::OutOfMemory { .. }));
    }

    #[test]
    fn required_symbols_are_unique() {
        let mut sorted = REQUIRED_SYMBOLS.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), REQUIRED_SYMBOLS.len());
    }
}
