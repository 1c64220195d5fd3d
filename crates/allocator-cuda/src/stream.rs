//! Streams (owned by this crate) and the events the release queue records on them.

use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys;
use memory_api::DeviceAddress;

use crate::device::{CudaDevice, DeviceInner};
use crate::error::{CudaError, CudaErrorCode};

/// A non-blocking CUDA stream on one device. Cheap to clone (an `Arc`); destroyed when
/// the last clone drops.
#[derive(Clone)]
pub struct CudaStream {
    inner: Arc<StreamInner>,
}

struct StreamInner {
    device: CudaDevice,
    raw: RawStream,
}

#[derive(Copy, Clone)]
struct RawStream(sys::CUstream);

// SAFETY: a CUstream is an opaque driver handle this crate never dereferences; the
// driver API accepts it from any thread.
unsafe impl Send for RawStream {}
// SAFETY: as for `Send`: shared access only passes the handle to the thread-safe driver.
unsafe impl Sync for RawStream {}

impl CudaStream {
    /// Creates a stream that does not synchronise with the legacy default stream.
    ///
    /// # Errors
    /// The driver's failure, or [`CudaError::DeviceLost`].
    pub fn new(device: &CudaDevice) -> Result<CudaStream, CudaError> {
        let inner = device.inner();
        let _current = inner.enter("cuStreamCreate")?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: `raw` is a valid out-pointer for one CUstream and the device's context
        // is current (held by `_current`). The stream is destroyed in `Drop`.
        inner.call("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut raw, flags) })?;
        Ok(CudaStream { inner: Arc::new(StreamInner { device: device.clone(), raw: RawStream(raw) }) })
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> &CudaDevice {
        &self.inner.device
    }

    /// Blocks until all work queued on the stream has finished.
    ///
    /// # Errors
    /// The driver's failure; a sticky error marks the device lost.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        let device = self.inner.device.inner();
        let _current = device.enter("cuStreamSynchronize")?;
        // SAFETY: the stream was created by `new` and is destroyed only when the last
        // clone drops, which cannot happen while `self` is borrowed.
        device.call("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.inner.raw.0) })
    }

    /// Queues a fill of `bytes` bytes at `dst` with `value` (`cuMemsetD8Async`), ordered
    /// after the work already queued on this stream.
    ///
    /// # Safety
    /// `dst .. dst + bytes` must be device memory the caller owns (a live block from an
    /// allocator of this crate, committed for VMM blocks) and must stay allocated until
    /// the stream has run the fill (a stream-ordered release on this stream qualifies).
    ///
    /// # Errors
    /// The driver's failure to queue the fill.
    pub unsafe fn memset_async(&self, dst: DeviceAddress, value: u8, bytes: usize) -> Result<(), CudaError> {
        let device = self.device_inner();
        let _current = device.enter("cuMemsetD8Async")?;
        // SAFETY: the range is the caller's and outlives the queued fill (this
        // function's contract); the stream is alive (owned by `self`); the context is
        // current.
        let result = unsafe { sys::cuMemsetD8Async(dst.get(), value, bytes, self.raw()) };
        device.call("cuMemsetD8Async", result)
    }

    /// The raw `CUstream`, for launching work on it through other driver bindings.
    /// It stays valid while any clone of this stream lives; do not destroy it.
    pub fn as_raw(&self) -> *mut c_void {
        self.inner.raw.0.cast()
    }

    pub(crate) fn raw(&self) -> sys::CUstream {
        self.inner.raw.0
    }

    pub(crate) fn device_inner(&self) -> &DeviceInner {
        self.inner.device.inner()
    }
}

impl fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaStream").field("device", &self.inner.device.ordinal()).finish_non_exhaustive()
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        let device = self.device.inner();
        let Some(_current) = device.enter_to_destroy("cuStreamDestroy_v2", "stream") else {
            return;
        };
        // SAFETY: the stream was created by `CudaStream::new` and this is the last
        // reference to it; queued work completes before the driver frees it.
        if let Err(error) = device.call("cuStreamDestroy_v2", unsafe { sys::cuStreamDestroy_v2(self.raw.0) }) {
            tracing::warn!(ordinal = device.ordinal(), "destroying a CUDA stream failed: {error}");
        }
    }
}

/// An event without timing, recorded on a stream to learn when earlier work finished.
pub(crate) struct Event {
    raw: RawEvent,
    stream: CudaStream,
}

#[derive(Copy, Clone)]
struct RawEvent(sys::CUevent);

// SAFETY: a CUevent is an opaque driver handle this crate never dereferences; the
// driver API accepts it from any thread.
unsafe impl Send for RawEvent {}
// SAFETY: as for `Send`: shared access only passes the handle to the thread-safe driver.
unsafe impl Sync for RawEvent {}

/// Whether an event's work has finished.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum EventState {
    Complete,
    Pending,
}

impl Event {
    /// Creates an event on `stream`'s device.
    pub(crate) fn new(stream: &CudaStream) -> Result<Event, CudaError> {
        let device = stream.device_inner();
        let _current = device.enter("cuEventCreate")?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: `raw` is a valid out-pointer for one CUevent and the context is current.
        // The event is destroyed in `Drop`.
        device.call("cuEventCreate", unsafe { sys::cuEventCreate(&mut raw, flags) })?;
        Ok(Event { raw: RawEvent(raw), stream: stream.clone() })
    }

    /// Records the event after all work queued so far on its stream.
    pub(crate) fn record(&self) -> Result<(), CudaError> {
        let device = self.stream.device_inner();
        let _current = device.enter("cuEventRecord")?;
        // SAFETY: event and stream were created by this crate on the current context
        // and both are alive (`self` owns the event and a clone of the stream).
        device.call("cuEventRecord", unsafe { sys::cuEventRecord(self.raw.0, self.stream.raw()) })
    }

    /// Asks, without blocking, whether the recorded work has finished.
    pub(crate) fn query(&self) -> Result<EventState, CudaError> {
        let device = self.stream.device_inner();
        let _current = device.enter("cuEventQuery")?;
        // SAFETY: the event was created by this crate and is alive (owned by `self`).
        match unsafe { sys::cuEventQuery(self.raw.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(EventState::Complete),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(EventState::Pending),
            other => Err(device.fail("cuEventQuery", CudaErrorCode(other as u32))),
        }
    }

    /// Blocks until the recorded work has finished.
    pub(crate) fn synchronize(&self) -> Result<(), CudaError> {
        let device = self.stream.device_inner();
        let _current = device.enter("cuEventSynchronize")?;
        // SAFETY: the event was created by this crate and is alive (owned by `self`).
        device.call("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.raw.0) })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let device = self.stream.device_inner();
        let Some(_current) = device.enter_to_destroy("cuEventDestroy_v2", "event") else {
            return;
        };
        // SAFETY: the event was created by `Event::new` and is destroyed only here.
        if let Err(error) = device.call("cuEventDestroy_v2", unsafe { sys::cuEventDestroy_v2(self.raw.0) }) {
            tracing::warn!(ordinal = device.ordinal(), "destroying a CUDA event failed: {error}");
        }
    }
}
