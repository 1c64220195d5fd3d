//! One CUDA device and its primary context, shared by every allocator on it.

use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use memory_api::{DeviceAddress, DeviceKey};

use crate::driver::{self, check};
use crate::error::{CudaError, CudaErrorCode};

/// A CUDA device ordinal with its primary context retained.
///
/// Cheap to clone (an `Arc`); the primary context is released when the last clone
/// (including those held by allocators, streams and backings) is dropped. Open each
/// device once and share the handle: the "device lost" state a sticky error sets is
/// kept here, so every allocator on the device sees it.
///
/// Every driver call this crate makes pushes this context onto the calling thread's
/// context stack and pops it afterwards, so the caller's current context is never
/// changed.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<DeviceInner>,
}

pub(crate) struct DeviceInner {
    ordinal: u32,
    device: sys::CUdevice,
    context: RawContext,
    lost: OnceLock<CudaError>,
}

/// A `CUcontext` handle.
#[derive(Copy, Clone)]
struct RawContext(sys::CUcontext);

// SAFETY: a CUcontext is an opaque driver handle that this crate never dereferences.
// The driver API is thread-safe and any thread may make a context current
// (`cuCtxPushCurrent`), so moving the handle to another thread is sound.
unsafe impl Send for RawContext {}
// SAFETY: as for `Send`: sharing the handle only lets other threads pass it to the
// thread-safe driver API.
unsafe impl Sync for RawContext {}

impl CudaDevice {
    /// Opens device `ordinal`: initialises the driver and retains its primary context.
    ///
    /// # Errors
    /// [`CudaError::NoDriver`] without libcuda (the answer on every CPU-only machine),
    /// [`CudaError::NoDevice`] when the ordinal is out of range, or the driver's failure.
    pub fn open(ordinal: u32) -> Result<CudaDevice, CudaError> {
        let available = driver::device_count()?;
        if ordinal >= available {
            return Err(CudaError::NoDevice { ordinal, available });
        }
        let index = i32::try_from(ordinal).map_err(|_| CudaError::NoDevice { ordinal, available })?;
        let mut device: sys::CUdevice = 0;
        // SAFETY: `device` is a valid out-pointer for one CUdevice; the driver is
        // present, exports cuDeviceGet (checked by `device_count`) and is initialised.
        check(unsafe { sys::cuDeviceGet(&mut device, index) })
            .map_err(|code| CudaError::from_code(ordinal, "cuDeviceGet", code))?;
        let mut context: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `context` is a valid out-pointer for one CUcontext and `device` came
        // from cuDeviceGet. The retain is balanced by the release in `Drop`.
        check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, device) })
            .map_err(|code| CudaError::from_code(ordinal, "cuDevicePrimaryCtxRetain", code))?;
        tracing::debug!(ordinal, "retained the primary CUDA context");
        Ok(CudaDevice {
            inner: Arc::new(DeviceInner { ordinal, device, context: RawContext(context), lost: OnceLock::new() }),
        })
    }

    /// The CUDA ordinal.
    pub fn ordinal(&self) -> u32 {
        self.inner.ordinal
    }

    /// The memory-api key of this device (`DeviceKey::device(ordinal)`).
    pub fn key(&self) -> DeviceKey {
        DeviceKey::device(self.inner.ordinal)
    }

    /// `(free, total)` device memory in bytes, as the driver reports it.
    ///
    /// # Errors
    /// The driver's failure, or [`CudaError::DeviceLost`] once the context is gone.
    pub fn memory_info(&self) -> Result<(usize, usize), CudaError> {
        let _current = self.inner.enter("cuMemGetInfo_v2")?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-pointers for one usize; the device's context is
        // current on this thread (held by `_current`).
        self.inner.call("cuMemGetInfo_v2", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        Ok((free, total))
    }

    /// Copies `data` from host memory to `dst` (`cuMemcpyHtoD_v2`, synchronous).
    ///
    /// # Safety
    /// `dst .. dst + data.len()` must be memory the caller owns: a live block from an
    /// allocator of this crate (committed, for VMM blocks) that no queued device work
    /// and no host reference (for pinned memory) uses while the copy runs. The driver
    /// rejects unmapped addresses with an error, but cannot tell whose memory it is.
    ///
    /// # Errors
    /// The driver's failure (an invalid range is [`CudaError::InvalidValue`]).
    pub unsafe fn copy_to_device(&self, dst: DeviceAddress, data: &[u8]) -> Result<(), CudaError> {
        let inner = &self.inner;
        let _current = inner.enter("cuMemcpyHtoD_v2")?;
        // SAFETY: the source is a live slice of `data.len()` bytes; the destination is
        // the caller's (this function's contract); the context is current.
        let result = unsafe { sys::cuMemcpyHtoD_v2(dst.get(), data.as_ptr().cast(), data.len()) };
        inner.call("cuMemcpyHtoD_v2", result)
    }

    /// Copies `out.len()` bytes from `src` into `out` (`cuMemcpyDtoH_v2`, synchronous).
    ///
    /// # Safety
    /// `src .. src + out.len()` must be memory the caller owns, as for
    /// [`CudaDevice::copy_to_device`], and no device work may write it during the copy.
    ///
    /// # Errors
    /// The driver's failure (an invalid range is [`CudaError::InvalidValue`]).
    pub unsafe fn copy_from_device(&self, src: DeviceAddress, out: &mut [u8]) -> Result<(), CudaError> {
        let inner = &self.inner;
        let _current = inner.enter("cuMemcpyDtoH_v2")?;
        // SAFETY: the destination is a live, exclusively borrowed slice of `out.len()`
        // bytes; the source is the caller's (this function's contract); the context is
        // current.
        let result = unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src.get(), out.len()) };
        inner.call("cuMemcpyDtoH_v2", result)
    }

    /// The sticky error that made this device's context unusable, if one was seen.
    /// Once set, every operation fails with [`CudaError::DeviceLost`] without calling
    /// the driver; the runtime should call `invalidate_device` on the registry.
    pub fn lost(&self) -> Option<&CudaError> {
        self.inner.lost.get()
    }

    pub(crate) fn inner(&self) -> &DeviceInner {
        &self.inner
    }

    /// Whether two handles share one opened device.
    pub fn same_device(&self, other: &CudaDevice) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice").field("ordinal", &self.inner.ordinal).field("lost", &self.lost()).finish()
    }
}

impl DeviceInner {
    pub(crate) fn ordinal(&self) -> u32 {
        self.ordinal
    }

    pub(crate) fn raw_device(&self) -> sys::CUdevice {
        self.device
    }

    pub(crate) fn key(&self) -> DeviceKey {
        DeviceKey::device(self.ordinal)
    }

    /// Fails with [`CudaError::DeviceLost`] if a sticky error was seen before.
    pub(crate) fn ensure_alive(&self, operation: &'static str) -> Result<(), CudaError> {
        match self.lost.get() {
            Some(lost) => Err(CudaError::DeviceLost {
                ordinal: self.ordinal,
                operation,
                code: lost.code().unwrap_or(CudaErrorCode::ERROR_CONTEXT_IS_DESTROYED),
            }),
            None => Ok(()),
        }
    }

    /// Classifies a driver answer; a sticky error marks the device lost.
    pub(crate) fn call(&self, operation: &'static str, result: sys::CUresult) -> Result<(), CudaError> {
        check(result).map_err(|code| self.fail(operation, code))
    }

    /// Classifies a failed call; a sticky error marks the device lost.
    pub(crate) fn fail(&self, operation: &'static str, code: CudaErrorCode) -> CudaError {
        let error = CudaError::from_code(self.ordinal, operation, code);
        if error.is_device_lost() && self.lost.set(error.clone()).is_ok() {
            tracing::error!(ordinal = self.ordinal, operation, code = code.0, "CUDA context lost: {error}");
        }
        error
    }

    /// Makes this device's context current on the calling thread until the guard drops.
    ///
    /// # Errors
    /// [`CudaError::DeviceLost`] if the device was lost before, or the push's failure.
    pub(crate) fn enter(&self, operation: &'static str) -> Result<CurrentContext<'_>, CudaError> {
        self.ensure_alive(operation)?;
        // SAFETY: the context was retained in `open` and stays retained while `self`
        // lives; pushing it has no other precondition. The guard pops it.
        self.call("cuCtxPushCurrent_v2", unsafe { sys::cuCtxPushCurrent_v2(self.context.0) })?;
        Ok(CurrentContext { device: self, _not_send: PhantomData })
    }

    /// Makes this device's context current so that a destructor can destroy `what`;
    /// `None` when it cannot. A destructor has no caller to tell, so this reports the
    /// outcome: after device loss the resource went with the context (debug); any other
    /// failure leaks it until the context is destroyed (error, naming the resource).
    pub(crate) fn enter_to_destroy(&self, operation: &'static str, what: &str) -> Option<CurrentContext<'_>> {
        match self.enter(operation) {
            Ok(current) => Some(current),
            Err(error) if error.is_device_lost() => {
                tracing::debug!(ordinal = self.ordinal, "the {what} went with the lost CUDA context: {error}");
                None
            }
            Err(error) => {
                tracing::error!(
                    ordinal = self.ordinal,
                    "could not make the CUDA context current to destroy a {what}, so the {what} leaks until the \
                     context is destroyed: {error}"
                );
                None
            }
        }
    }

    /// Reads a device attribute (`cuDeviceGetAttribute`).
    pub(crate) fn attribute(&self, attribute: sys::CUdevice_attribute) -> Result<i32, CudaError> {
        let mut value = 0i32;
        // SAFETY: `value` is a valid out-pointer for one int; `self.device` came from
        // cuDeviceGet. No context needs to be current.
        self.call("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut value, attribute, self.device) })?;
        Ok(value)
    }
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`; this is the last reference, so no
        // allocator, stream or backing of this crate uses the context any more.
        let result = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        if let Err(code) = check(result) {
            tracing::warn!(ordinal = self.ordinal, code = code.0, "releasing the primary context failed: {code}");
        }
    }
}

/// The device's context pushed onto this thread's context stack; pops it on drop.
pub(crate) struct CurrentContext<'a> {
    device: &'a DeviceInner,
    /// The context stack is per thread: the guard must pop on the thread that pushed.
    _not_send: PhantomData<*const ()>,
}

impl Drop for CurrentContext<'_> {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `enter` pushed exactly one context on this thread and guards are not
        // `Send`, so the pop happens on the same thread and removes that push.
        let result = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        if let Err(code) = check(result) {
            // The call made under this context stands; a sticky code still means the
            // context is gone, so record it like any other call's.
            let error = self.device.fail("cuCtxPopCurrent_v2", code);
            tracing::warn!(ordinal = self.device.ordinal, code = code.0, "popping the CUDA context failed: {error}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_a_device_without_a_driver_is_a_typed_error() {
        match CudaDevice::open(0) {
            Err(CudaError::NoDriver) => assert!(!driver::driver_available()),
            Err(CudaError::NoDevice { ordinal: 0, available: 0 }) => {}
            Err(other) => assert!(driver::driver_available(), "{other}"),
            Ok(device) => assert_eq!(device.key(), DeviceKey::device(0)),
        }
    }

    #[test]
    fn an_ordinal_past_the_count_names_both() {
        match CudaDevice::open(u32::MAX) {
            Err(CudaError::NoDevice { ordinal, .. }) => assert_eq!(ordinal, u32::MAX),
            Err(CudaError::NoDriver) => {}
            other => panic!("expected NoDevice or NoDriver, got {other:?}"),
        }
    }

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn handles_are_send_and_sync() {
        assert_send_sync::<CudaDevice>();
    }
}
