//! Typed CUDA errors that never call back into the driver.
//!
//! Every driver call's `CUresult` is kept as a raw [`CudaErrorCode`]; names come from a
//! table in this crate, not from `cuGetErrorString`, so formatting an error is safe when
//! the driver is absent, unloading, or its context destroyed. (cudarc's own
//! `DriverError` calls into the driver from `Display`; this crate never formats one.)
//!
//! The classification that matters to a runtime:
//!
//! | kind                     | [`CudaError`] variant        | memory-api error                         |
//! |--------------------------|------------------------------|------------------------------------------|
//! | no libcuda               | [`CudaError::NoDriver`]      | (devices cannot be opened)               |
//! | ordinal out of range     | [`CudaError::NoDevice`]      | (devices cannot be opened)               |
//! | out of memory            | [`CudaError::OutOfMemory`]   | `AllocError::OutOfMemory`, `CapabilityError::OutOfMemory` |
//! | invalid value            | [`CudaError::InvalidValue`]  | `*::Backend` with code 1                 |
//! | sticky (context is gone) | [`CudaError::DeviceLost`]    | `*::DeviceLost`: call `invalidate_device` |
//! | anything else            | [`CudaError::Driver`]        | `*::Backend` with the raw code           |
//!
//! [`CudaError::from_backend`] recovers the typed error from a
//! [`memory_api::BackendError`] that this crate produced.

use std::fmt;

use memory_api::{AllocError, BackendError, CapabilityError, DeviceKey, MaybeBytes, ReleaseError};

macro_rules! cuda_codes {
    ($( $(#[$meta:meta])* $konst:ident = $value:literal, )*) => {
        impl CudaErrorCode {
            $( $(#[$meta])* pub const $konst: CudaErrorCode = CudaErrorCode($value); )*

            /// The `CUresult` name (`"CUDA_ERROR_OUT_OF_MEMORY"`), from this crate's own
            /// table of the CUDA 12.8 codes; `"CUDA_ERROR_UNRECOGNISED"` for any other value.
            pub const fn name(self) -> &'static str {
                match self.0 {
                    $( $value => concat!("CUDA_", stringify!($konst)), )*
                    _ => "CUDA_ERROR_UNRECOGNISED",
                }
            }
        }
    };
}

/// A raw `CUresult` value, kept as a number so that no driver call is needed to
/// describe it.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CudaErrorCode(pub u32);

cuda_codes! {
    /// `CUDA_SUCCESS`.
    SUCCESS = 0,
    /// `CUDA_ERROR_INVALID_VALUE`.
    ERROR_INVALID_VALUE = 1,
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    ERROR_OUT_OF_MEMORY = 2,
    /// `CUDA_ERROR_NOT_INITIALIZED`.
    ERROR_NOT_INITIALIZED = 3,
    /// `CUDA_ERROR_DEINITIALIZED` (the driver is shutting down).
    ERROR_DEINITIALIZED = 4,
    /// `CUDA_ERROR_PROFILER_DISABLED`.
    ERROR_PROFILER_DISABLED = 5,
    /// `CUDA_ERROR_PROFILER_NOT_INITIALIZED`.
    ERROR_PROFILER_NOT_INITIALIZED = 6,
    /// `CUDA_ERROR_PROFILER_ALREADY_STARTED`.
    ERROR_PROFILER_ALREADY_STARTED = 7,
    /// `CUDA_ERROR_PROFILER_ALREADY_STOPPED`.
    ERROR_PROFILER_ALREADY_STOPPED = 8,
    /// `CUDA_ERROR_STUB_LIBRARY` (the stub libcuda of the toolkit was loaded, not a driver).
    ERROR_STUB_LIBRARY = 34,
    /// `CUDA_ERROR_DEVICE_UNAVAILABLE`.
    ERROR_DEVICE_UNAVAILABLE = 46,
    /// `CUDA_ERROR_NO_DEVICE`.
    ERROR_NO_DEVICE = 100,
    /// `CUDA_ERROR_INVALID_DEVICE`.
    ERROR_INVALID_DEVICE = 101,
    /// `CUDA_ERROR_DEVICE_NOT_LICENSED`.
    ERROR_DEVICE_NOT_LICENSED = 102,
    /// `CUDA_ERROR_INVALID_IMAGE`.
    ERROR_INVALID_IMAGE = 200,
    /// `CUDA_ERROR_INVALID_CONTEXT`.
    ERROR_INVALID_CONTEXT = 201,
    /// `CUDA_ERROR_CONTEXT_ALREADY_CURRENT`.
    ERROR_CONTEXT_ALREADY_CURRENT = 202,
    /// `CUDA_ERROR_MAP_FAILED`.
    ERROR_MAP_FAILED = 205,
    /// `CUDA_ERROR_UNMAP_FAILED`.
    ERROR_UNMAP_FAILED = 206,
    /// `CUDA_ERROR_ARRAY_IS_MAPPED`.
    ERROR_ARRAY_IS_MAPPED = 207,
    /// `CUDA_ERROR_ALREADY_MAPPED`.
    ERROR_ALREADY_MAPPED = 208,
    /// `CUDA_ERROR_NO_BINARY_FOR_GPU`.
    ERROR_NO_BINARY_FOR_GPU = 209,
    /// `CUDA_ERROR_ALREADY_ACQUIRED`.
    ERROR_ALREADY_ACQUIRED = 210,
    /// `CUDA_ERROR_NOT_MAPPED`.
    ERROR_NOT_MAPPED = 211,
    /// `CUDA_ERROR_NOT_MAPPED_AS_ARRAY`.
    ERROR_NOT_MAPPED_AS_ARRAY = 212,
    /// `CUDA_ERROR_NOT_MAPPED_AS_POINTER`.
    ERROR_NOT_MAPPED_AS_POINTER = 213,
    /// `CUDA_ERROR_ECC_UNCORRECTABLE` (sticky).
    ERROR_ECC_UNCORRECTABLE = 214,
    /// `CUDA_ERROR_UNSUPPORTED_LIMIT`.
    ERROR_UNSUPPORTED_LIMIT = 215,
    /// `CUDA_ERROR_CONTEXT_ALREADY_IN_USE`.
    ERROR_CONTEXT_ALREADY_IN_USE = 216,
    /// `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`.
    ERROR_PEER_ACCESS_UNSUPPORTED = 217,
    /// `CUDA_ERROR_INVALID_PTX`.
    ERROR_INVALID_PTX = 218,
    /// `CUDA_ERROR_INVALID_GRAPHICS_CONTEXT`.
    ERROR_INVALID_GRAPHICS_CONTEXT = 219,
    /// `CUDA_ERROR_NVLINK_UNCORRECTABLE` (sticky).
    ERROR_NVLINK_UNCORRECTABLE = 220,
    /// `CUDA_ERROR_JIT_COMPILER_NOT_FOUND`.
    ERROR_JIT_COMPILER_NOT_FOUND = 221,
    /// `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`.
    ERROR_UNSUPPORTED_PTX_VERSION = 222,
    /// `CUDA_ERROR_JIT_COMPILATION_DISABLED`.
    ERROR_JIT_COMPILATION_DISABLED = 223,
    /// `CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY`.
    ERROR_UNSUPPORTED_EXEC_AFFINITY = 224,
    /// `CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC`.
    ERROR_UNSUPPORTED_DEVSIDE_SYNC = 225,
    /// `CUDA_ERROR_CONTAINED` (sticky: the GPU contained an error; the process must restart).
    ERROR_CONTAINED = 226,
    /// `CUDA_ERROR_INVALID_SOURCE`.
    ERROR_INVALID_SOURCE = 300,
    /// `CUDA_ERROR_FILE_NOT_FOUND`.
    ERROR_FILE_NOT_FOUND = 301,
    /// `CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND`.
    ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND = 302,
    /// `CUDA_ERROR_SHARED_OBJECT_INIT_FAILED`.
    ERROR_SHARED_OBJECT_INIT_FAILED = 303,
    /// `CUDA_ERROR_OPERATING_SYSTEM`.
    ERROR_OPERATING_SYSTEM = 304,
    /// `CUDA_ERROR_INVALID_HANDLE`.
    ERROR_INVALID_HANDLE = 400,
    /// `CUDA_ERROR_ILLEGAL_STATE`.
    ERROR_ILLEGAL_STATE = 401,
    /// `CUDA_ERROR_LOSSY_QUERY`.
    ERROR_LOSSY_QUERY = 402,
    /// `CUDA_ERROR_NOT_FOUND`.
    ERROR_NOT_FOUND = 500,
    /// `CUDA_ERROR_NOT_READY` (an event or stream has work pending; not a failure).
    ERROR_NOT_READY = 600,
    /// `CUDA_ERROR_ILLEGAL_ADDRESS` (sticky).
    ERROR_ILLEGAL_ADDRESS = 700,
    /// `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`.
    ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    /// `CUDA_ERROR_LAUNCH_TIMEOUT` (sticky).
    ERROR_LAUNCH_TIMEOUT = 702,
    /// `CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING`.
    ERROR_LAUNCH_INCOMPATIBLE_TEXTURING = 703,
    /// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`.
    ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
    /// `CUDA_ERROR_PEER_ACCESS_NOT_ENABLED`.
    ERROR_PEER_ACCESS_NOT_ENABLED = 705,
    /// `CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE`.
    ERROR_PRIMARY_CONTEXT_ACTIVE = 708,
    /// `CUDA_ERROR_CONTEXT_IS_DESTROYED` (sticky).
    ERROR_CONTEXT_IS_DESTROYED = 709,
    /// `CUDA_ERROR_ASSERT` (sticky: a device-side assert fired).
    ERROR_ASSERT = 710,
    /// `CUDA_ERROR_TOO_MANY_PEERS`.
    ERROR_TOO_MANY_PEERS = 711,
    /// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
    ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    /// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
    ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    /// `CUDA_ERROR_HARDWARE_STACK_ERROR` (sticky).
    ERROR_HARDWARE_STACK_ERROR = 714,
    /// `CUDA_ERROR_ILLEGAL_INSTRUCTION` (sticky).
    ERROR_ILLEGAL_INSTRUCTION = 715,
    /// `CUDA_ERROR_MISALIGNED_ADDRESS` (sticky).
    ERROR_MISALIGNED_ADDRESS = 716,
    /// `CUDA_ERROR_INVALID_ADDRESS_SPACE` (sticky).
    ERROR_INVALID_ADDRESS_SPACE = 717,
    /// `CUDA_ERROR_INVALID_PC` (sticky).
    ERROR_INVALID_PC = 718,
    /// `CUDA_ERROR_LAUNCH_FAILED` (sticky).
    ERROR_LAUNCH_FAILED = 719,
    /// `CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`.
    ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720,
    /// `CUDA_ERROR_TENSOR_MEMORY_LEAK`.
    ERROR_TENSOR_MEMORY_LEAK = 721,
    /// `CUDA_ERROR_NOT_PERMITTED`.
    ERROR_NOT_PERMITTED = 800,
    /// `CUDA_ERROR_NOT_SUPPORTED`.
    ERROR_NOT_SUPPORTED = 801,
    /// `CUDA_ERROR_SYSTEM_NOT_READY`.
    ERROR_SYSTEM_NOT_READY = 802,
    /// `CUDA_ERROR_SYSTEM_DRIVER_MISMATCH`.
    ERROR_SYSTEM_DRIVER_MISMATCH = 803,
    /// `CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE`.
    ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE = 804,
    /// `CUDA_ERROR_MPS_CONNECTION_FAILED`.
    ERROR_MPS_CONNECTION_FAILED = 805,
    /// `CUDA_ERROR_MPS_RPC_FAILURE`.
    ERROR_MPS_RPC_FAILURE = 806,
    /// `CUDA_ERROR_MPS_SERVER_NOT_READY`.
    ERROR_MPS_SERVER_NOT_READY = 807,
    /// `CUDA_ERROR_MPS_MAX_CLIENTS_REACHED`.
    ERROR_MPS_MAX_CLIENTS_REACHED = 808,
    /// `CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED`.
    ERROR_MPS_MAX_CONNECTIONS_REACHED = 809,
    /// `CUDA_ERROR_MPS_CLIENT_TERMINATED` (sticky).
    ERROR_MPS_CLIENT_TERMINATED = 810,
    /// `CUDA_ERROR_CDP_NOT_SUPPORTED`.
    ERROR_CDP_NOT_SUPPORTED = 811,
    /// `CUDA_ERROR_CDP_VERSION_MISMATCH`.
    ERROR_CDP_VERSION_MISMATCH = 812,
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
    ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`.
    ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    /// `CUDA_ERROR_STREAM_CAPTURE_MERGE`.
    ERROR_STREAM_CAPTURE_MERGE = 902,
    /// `CUDA_ERROR_STREAM_CAPTURE_UNMATCHED`.
    ERROR_STREAM_CAPTURE_UNMATCHED = 903,
    /// `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`.
    ERROR_STREAM_CAPTURE_UNJOINED = 904,
    /// `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`.
    ERROR_STREAM_CAPTURE_ISOLATION = 905,
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`.
    ERROR_STREAM_CAPTURE_IMPLICIT = 906,
    /// `CUDA_ERROR_CAPTURED_EVENT`.
    ERROR_CAPTURED_EVENT = 907,
    /// `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`.
    ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
    /// `CUDA_ERROR_TIMEOUT`.
    ERROR_TIMEOUT = 909,
    /// `CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE`.
    ERROR_GRAPH_EXEC_UPDATE_FAILURE = 910,
    /// `CUDA_ERROR_EXTERNAL_DEVICE` (sticky).
    ERROR_EXTERNAL_DEVICE = 911,
    /// `CUDA_ERROR_INVALID_CLUSTER_SIZE`.
    ERROR_INVALID_CLUSTER_SIZE = 912,
    /// `CUDA_ERROR_FUNCTION_NOT_LOADED`.
    ERROR_FUNCTION_NOT_LOADED = 913,
    /// `CUDA_ERROR_INVALID_RESOURCE_TYPE`.
    ERROR_INVALID_RESOURCE_TYPE = 914,
    /// `CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION`.
    ERROR_INVALID_RESOURCE_CONFIGURATION = 915,
    /// `CUDA_ERROR_KEY_ROTATION`.
    ERROR_KEY_ROTATION = 916,
    /// `CUDA_ERROR_UNKNOWN`.
    ERROR_UNKNOWN = 999,
}

impl CudaErrorCode {
    /// Whether this code means the context is unusable from now on: every later call
    /// in it fails the same way, and its memory is gone with it. These are reported as
    /// [`CudaError::DeviceLost`].
    pub const fn is_sticky(self) -> bool {
        matches!(
            self,
            CudaErrorCode::ERROR_DEINITIALIZED
                | CudaErrorCode::ERROR_ECC_UNCORRECTABLE
                | CudaErrorCode::ERROR_NVLINK_UNCORRECTABLE
                | CudaErrorCode::ERROR_CONTAINED
                | CudaErrorCode::ERROR_ILLEGAL_ADDRESS
                | CudaErrorCode::ERROR_LAUNCH_TIMEOUT
                | CudaErrorCode::ERROR_CONTEXT_IS_DESTROYED
                | CudaErrorCode::ERROR_ASSERT
                | CudaErrorCode::ERROR_HARDWARE_STACK_ERROR
                | CudaErrorCode::ERROR_ILLEGAL_INSTRUCTION
                | CudaErrorCode::ERROR_MISALIGNED_ADDRESS
                | CudaErrorCode::ERROR_INVALID_ADDRESS_SPACE
                | CudaErrorCode::ERROR_INVALID_PC
                | CudaErrorCode::ERROR_LAUNCH_FAILED
                | CudaErrorCode::ERROR_MPS_CLIENT_TERMINATED
                | CudaErrorCode::ERROR_EXTERNAL_DEVICE
        )
    }

    /// The raw value.
    pub const fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Debug for CudaErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

impl fmt::Display for CudaErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

/// Why a CUDA operation failed. Formatting never calls into the driver.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// libcuda could not be loaded: there is no NVIDIA driver on this machine (or it is
    /// not on the library search path).
    #[error(
        "no CUDA driver: libcuda.so could not be loaded; install the NVIDIA driver, or put the directory \
         holding libcuda.so.1 on LD_LIBRARY_PATH (CPU-only machines should use allocator-cpu)"
    )]
    NoDriver,
    /// libcuda was loaded but lacks an entry point this crate calls.
    #[error(
        "the CUDA driver does not export {symbol}, which allocator-cuda needs; \
         upgrade the NVIDIA driver (CUDA 12 or newer)"
    )]
    DriverTooOld {
        /// The first missing entry point.
        symbol: &'static str,
    },
    /// The driver is present but has no device with this ordinal.
    #[error(
        "CUDA device {ordinal} was asked for, but the driver reports {available} device(s); \
         pass an ordinal below {available} (check CUDA_VISIBLE_DEVICES)"
    )]
    NoDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// How many devices the driver reports.
        available: u32,
    },
    /// The device lacks a feature an allocator needs.
    #[error("CUDA device {ordinal} does not support {feature}; use the eager CudaAllocator on it instead")]
    Unsupported {
        /// The device.
        ordinal: u32,
        /// The missing feature ("memory pools", "virtual memory management").
        feature: &'static str,
    },
    /// The driver ran out of memory.
    #[error("{operation} failed: {code}: the device is out of memory; release or trim memory, or ask for less")]
    OutOfMemory {
        /// The driver call.
        operation: &'static str,
        /// The raw code.
        code: CudaErrorCode,
    },
    /// The driver rejected an argument.
    #[error(
        "{operation} failed: {code}: the driver rejected an argument (size, alignment or handle); this is a bug in the caller or in allocator-cuda"
    )]
    InvalidValue {
        /// The driver call.
        operation: &'static str,
        /// The raw code.
        code: CudaErrorCode,
    },
    /// A sticky error: the context is unusable and its memory is gone.
    #[error(
        "{operation} failed: {code}: the CUDA context on device {ordinal} is unusable (sticky error); \
         call invalidate_device for device:{ordinal} on the registry, then recreate the context"
    )]
    DeviceLost {
        /// The device whose context is gone.
        ordinal: u32,
        /// The driver call that reported it (or the call that was refused because an
        /// earlier call had reported it).
        operation: &'static str,
        /// The raw code.
        code: CudaErrorCode,
    },
    /// Any other driver failure.
    #[error("{operation} failed: {code}")]
    Driver {
        /// The driver call.
        operation: &'static str,
        /// The raw code.
        code: CudaErrorCode,
    },
}

impl CudaError {
    /// Classifies the failure of `operation` on device `ordinal` with `code`.
    pub fn from_code(ordinal: u32, operation: &'static str, code: CudaErrorCode) -> CudaError {
        match code {
            CudaErrorCode::ERROR_OUT_OF_MEMORY => CudaError::OutOfMemory { operation, code },
            CudaErrorCode::ERROR_INVALID_VALUE => CudaError::InvalidValue { operation, code },
            code if code.is_sticky() => CudaError::DeviceLost { ordinal, operation, code },
            code => CudaError::Driver { operation, code },
        }
    }

    /// The raw driver code, when a driver call failed.
    pub fn code(&self) -> Option<CudaErrorCode> {
        match self {
            CudaError::OutOfMemory { code, .. }
            | CudaError::InvalidValue { code, .. }
            | CudaError::DeviceLost { code, .. }
            | CudaError::Driver { code, .. } => Some(*code),
            CudaError::NoDriver
            | CudaError::DriverTooOld { .. }
            | CudaError::NoDevice { .. }
            | CudaError::Unsupported { .. } => None,
        }
    }

    /// Whether the context is gone (the runtime should call `invalidate_device`).
    pub fn is_device_lost(&self) -> bool {
        matches!(self, CudaError::DeviceLost { .. })
    }

    /// The driver call that failed, when one did.
    pub fn operation(&self) -> Option<&'static str> {
        match self {
            CudaError::OutOfMemory { operation, .. }
            | CudaError::InvalidValue { operation, .. }
            | CudaError::DeviceLost { operation, .. }
            | CudaError::Driver { operation, .. } => Some(operation),
            CudaError::NoDriver
            | CudaError::DriverTooOld { .. }
            | CudaError::NoDevice { .. }
            | CudaError::Unsupported { .. } => None,
        }
    }

    /// This error as the contract's [`BackendError`] (backend `"cuda"`, the raw code,
    /// and this error's message as the pre-formatted detail).
    pub fn to_backend(&self) -> BackendError {
        BackendError {
            backend: BACKEND,
            operation: self.operation().unwrap_or(match self {
                CudaError::NoDriver => "dlopen(libcuda)",
                CudaError::DriverTooOld { symbol } => symbol,
                CudaError::NoDevice { .. } => "cuDeviceGet",
                _ => "cuDeviceGetAttribute",
            }),
            code: self.code().map_or(-1, |code| i64::from(code.0)),
            detail: self.to_string(),
        }
    }

    /// Recovers the typed error from a [`BackendError`] this crate produced (`None`
    /// for another backend's error, or one without a driver code).
    pub fn from_backend(ordinal: u32, error: &BackendError) -> Option<CudaError> {
        if error.backend != BACKEND {
            return None;
        }
        let code = u32::try_from(error.code).ok()?;
        Some(CudaError::from_code(ordinal, error.operation, CudaErrorCode(code)))
    }

    fn device_lost_reason(&self) -> String {
        self.to_string()
    }

    /// As an allocation error for a request of `requested` bytes aligned to `align` on
    /// `device`; `available` is what the driver said was free, when known.
    pub(crate) fn into_alloc(
        self,
        device: DeviceKey,
        requested: usize,
        align: usize,
        available: Option<usize>,
    ) -> AllocError {
        match self {
            CudaError::OutOfMemory { .. } => {
                AllocError::OutOfMemory { device, requested, align, available: MaybeBytes(available) }
            }
            CudaError::DeviceLost { .. } => AllocError::DeviceLost { device, reason: self.device_lost_reason() },
            other => AllocError::Backend { device, source: other.to_backend() },
        }
    }

    /// As the reason inside a failed or quarantined release.
    pub(crate) fn into_release(self, device: DeviceKey) -> ReleaseError {
        match self {
            CudaError::DeviceLost { .. } => ReleaseError::DeviceLost { device, reason: self.device_lost_reason() },
            other => ReleaseError::Backend(other.to_backend()),
        }
    }

    /// As a capability error for `requested` bytes on `device`.
    pub(crate) fn into_capability(self, device: DeviceKey, requested: usize) -> CapabilityError {
        match self {
            CudaError::OutOfMemory { .. } => CapabilityError::OutOfMemory { device, requested },
            CudaError::DeviceLost { .. } => CapabilityError::DeviceLost { device, reason: self.device_lost_reason() },
            other => CapabilityError::Backend(other.to_backend()),
        }
    }
}

/// The `backend` name in every [`BackendError`] this crate produces.
pub const BACKEND: &str = "cuda";

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;

    #[test]
    fn names_match_the_driver_enum_without_calling_the_driver() {
        // The Debug names of cudarc's enum are pure Rust; compare a sample of every range.
        for code in [
            CUresult::CUDA_SUCCESS,
            CUresult::CUDA_ERROR_INVALID_VALUE,
            CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            CUresult::CUDA_ERROR_DEINITIALIZED,
            CUresult::CUDA_ERROR_STUB_LIBRARY,
            CUresult::CUDA_ERROR_NO_DEVICE,
            CUresult::CUDA_ERROR_INVALID_CONTEXT,
            CUresult::CUDA_ERROR_ECC_UNCORRECTABLE,
            CUresult::CUDA_ERROR_CONTAINED,
            CUresult::CUDA_ERROR_INVALID_HANDLE,
            CUresult::CUDA_ERROR_NOT_READY,
            CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
            CUresult::CUDA_ERROR_LAUNCH_FAILED,
            CUresult::CUDA_ERROR_TENSOR_MEMORY_LEAK,
            CUresult::CUDA_ERROR_NOT_SUPPORTED,
            CUresult::CUDA_ERROR_CDP_VERSION_MISMATCH,
            CUresult::CUDA_ERROR_KEY_ROTATION,
            CUresult::CUDA_ERROR_UNKNOWN,
        ] {
            let ours = CudaErrorCode(code as u32);
            assert_eq!(ours.name(), format!("{code:?}"), "code {}", code as u32);
        }
        assert_eq!(CudaErrorCode(123_456).name(), "CUDA_ERROR_UNRECOGNISED");
    }

    #[test]
    fn out_of_memory_invalid_value_and_sticky_errors_are_distinct() {
        let oom = CudaError::from_code(0, "cuMemAlloc_v2", CudaErrorCode::ERROR_OUT_OF_MEMORY);
        assert!(matches!(oom, CudaError::OutOfMemory { .. }));
        let invalid = CudaError::from_code(0, "cuMemAlloc_v2", CudaErrorCode::ERROR_INVALID_VALUE);
        assert!(matches!(invalid, CudaError::InvalidValue { .. }));
        for sticky in [
            CudaErrorCode::ERROR_ILLEGAL_ADDRESS,
            CudaErrorCode::ERROR_LAUNCH_FAILED,
            CudaErrorCode::ERROR_ECC_UNCORRECTABLE,
            CudaErrorCode::ERROR_CONTEXT_IS_DESTROYED,
            CudaErrorCode::ERROR_ASSERT,
        ] {
            let err = CudaError::from_code(3, "cuMemFree_v2", sticky);
            assert!(err.is_device_lost(), "{sticky:?}");
            let text = err.to_string();
            assert!(text.contains("invalidate_device") && text.contains("device:3"), "{text}");
        }
        let other = CudaError::from_code(0, "cuMemAlloc_v2", CudaErrorCode::ERROR_NOT_SUPPORTED);
        assert!(matches!(other, CudaError::Driver { .. }));
        assert!(!CudaErrorCode::ERROR_NOT_READY.is_sticky());
        assert!(!CudaErrorCode::ERROR_OUT_OF_MEMORY.is_sticky());
    }

    #[test]
    fn errors_map_onto_the_contract_with_the_raw_code() {
        let device = DeviceKey::device(1);
        let oom = CudaError::from_code(1, "cuMemAlloc_v2", CudaErrorCode::ERROR_OUT_OF_MEMORY);
        let err = oom.into_alloc(device, 4096, 256, Some(1024));
        assert_eq!(
            err,
            AllocError::OutOfMemory { device, requested: 4096, align: 256, available: MaybeBytes(Some(1024)) }
        );
        let lost = CudaError::from_code(1, "cuMemAlloc_v2", CudaErrorCode::ERROR_ILLEGAL_ADDRESS);
        assert!(matches!(lost.clone().into_alloc(device, 1, 1, None), AllocError::DeviceLost { .. }));
        assert!(matches!(lost.clone().into_release(device), ReleaseError::DeviceLost { .. }));
        assert!(matches!(lost.into_capability(device, 1), CapabilityError::DeviceLost { .. }));

        let invalid = CudaError::from_code(1, "cuMemMap", CudaErrorCode::ERROR_INVALID_VALUE);
        let AllocError::Backend { source, .. } = invalid.clone().into_alloc(device, 1, 1, None) else {
            panic!("invalid value should be a backend error")
        };
        assert_eq!((source.backend, source.operation, source.code), ("cuda", "cuMemMap", 1));
        assert!(source.detail.contains("CUDA_ERROR_INVALID_VALUE"), "{}", source.detail);
        assert_eq!(CudaError::from_backend(1, &source), Some(invalid));
        let os = BackendError { backend: "os", operation: "mmap", code: 12, detail: String::new() };
        assert_eq!(CudaError::from_backend(1, &os), None);
    }

    #[test]
    fn messages_say_what_to_do() {
        assert!(CudaError::NoDriver.to_string().contains("LD_LIBRARY_PATH"));
        let text = CudaError::NoDevice { ordinal: 2, available: 1 }.to_string();
        assert!(text.contains("device 2") && text.contains("reports 1") && text.contains("below 1"), "{text}");
        let text = CudaError::from_code(0, "cuMemAlloc_v2", CudaErrorCode::ERROR_OUT_OF_MEMORY).to_string();
        assert!(text.contains("cuMemAlloc_v2") && text.contains("CUDA_ERROR_OUT_OF_MEMORY (2)"), "{text}");
        assert!(text.contains("release or trim"), "{text}");
    }
}
