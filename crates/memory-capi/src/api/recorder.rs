//! Recording from C: a recorder writes what governed mechanisms do to a trace file
//! (memory-trace's format, `docs/TRACE-FORMAT.md`), which `cargo xtask replay` replays
//! against other allocator stacks and draws.
//!
//! Recording is opt-in per governor handle, as it is per governed allocator in Rust:
//! `mc_recorder_trace_governor` makes a second handle of a governor's books that names
//! the recording, and a mechanism registered through that handle (any registration
//! function, any kind) is governed *and* recorded (memory-trace's `TracedAllocator`
//! around the governed allocator, registered where the governed one would go). A
//! mechanism registered through the plain handle runs exactly the governed path.

use std::sync::Arc;

use memory_governor::{GovernedAllocator, Governor};
use memory_plugin_abi::MpDevice;
use memory_trace::{MarkKind, RecordError, Recorder, TracedAllocator};

use super::governor::{GOVERNORS, GovernorEntry};
use super::{borrow, check_optional_out, check_out, device_key, fill, text, text_or, vacancy, write, write_optional};
use crate::handles::{Scheme, number};
use crate::status::{Failure, MC_ERR_BACKEND, MC_ERR_INVALID_ARGUMENT, MC_ERR_STATE, McStatus, guard};
use crate::types::*;

pub(crate) const KIND_RECORDER: u8 = 0xac;

/// One recording: the recorder and the file it writes. Whether it is finished is the
/// recorder's own state (`Recorder::is_finished`, set by the one `Recorder::finish` that
/// runs), the only one: every check below reads it.
pub(crate) struct Recording {
    recorder: Recorder,
    path: String,
}

impl Recording {
    /// Refuses a registration through `governor` (a handle naming this recording) once
    /// the recording is finished: its events would be dropped.
    pub(crate) fn check_open(&self, governor: *const McGovernor) -> Result<(), Failure> {
        if self.recorder.is_finished() {
            return Err(Failure::new(
                MC_ERR_STATE,
                format!(
                    "governor {:#x} records to \"{}\", whose recording is finished (mc_recorder_finish), so nothing \
                     registered through it would be recorded; register through the governor handle it was made from, \
                     or record with a new recorder (mc_recorder_create, mc_recorder_trace_governor)",
                    number(governor),
                    self.path
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a call that would add to the recording once it is finished.
    fn check_running(&self, recorder: *const McRecorder) -> Result<(), Failure> {
        if self.recorder.is_finished() {
            return Err(self.finished(recorder));
        }
        Ok(())
    }

    /// What a call that would add to a finished recording is answered.
    fn finished(&self, recorder: *const McRecorder) -> Failure {
        Failure::new(
            MC_ERR_STATE,
            format!(
                "recorder {:#x} finished its recording of \"{}\" (mc_recorder_finish); record again with a new \
                     recorder (mc_recorder_create)",
                number(recorder),
                self.path
            ),
        )
    }

    /// Wraps a governed allocator registered through a handle naming this recording.
    pub(crate) fn trace(&self, governor: &Governor, governed: GovernedAllocator) -> TracedAllocator {
        self.recorder.trace(governor, governed)
    }

    /// Finishes the recording, once; the summary of what was written. A second call (or
    /// one racing the first) is `MC_ERR_STATE`, as the recorder says.
    fn finish(&self, recorder: *const McRecorder) -> Result<McRecordingSummary, Failure> {
        match self.recorder.finish() {
            Ok(summary) => Ok(summary.into()),
            Err(RecordError::AlreadyFinished { .. }) => Err(Failure::new(
                MC_ERR_STATE,
                format!(
                    "recorder {:#x} already finished its recording of \"{}\"; a recording is finished once: read the \
                     file, or record again with a new recorder (mc_recorder_create)",
                    number(recorder),
                    self.path
                ),
            )),
            // Io, WriterPanicked and whatever a newer memory-trace adds: the file was not
            // written whole.
            Err(error) => Err(Failure::new(
                MC_ERR_BACKEND,
                format!("recording to \"{}\": {error}; the recording is finished", self.path),
            )),
        }
    }
}

tables! {
    RECORDERS in RECORDER_CELLS: Arc<Recording> = (KIND_RECORDER, Scheme::Hazard, "recorder", FREE_RECORDERS);
}

/// Starts recording to a new trace file at `path` (UTF-8; an existing file is
/// truncated). Nothing is recorded until a mechanism is registered through a governor
/// handle that names the recorder (`mc_recorder_trace_governor`). A writer thread of
/// the library writes the file while the recording runs; `mc_recorder_finish` ends it.
/// The file is created only once every argument was checked and a handle is free; if
/// it cannot be created the call is `MC_ERR_BACKEND` with the system's reason.
///
/// # Safety
/// `path` is null or NUL-terminated; `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_recorder_create(path: *const std::ffi::c_char, out: *mut *mut McRecorder) -> McStatus {
    guard("mc_recorder_create", || {
        check_out(out, "out")?;
        // SAFETY: null or NUL-terminated (the caller's contract).
        let path = unsafe { text(path, "path") }?;
        if path.is_empty() {
            return Err(Failure::new(
                MC_ERR_INVALID_ARGUMENT,
                "path is empty; pass the path of the trace file to write",
            ));
        }
        let cell = vacancy(&RECORDERS)?;
        let recorder = Recorder::create(path).map_err(|error| {
            Failure::new(
                MC_ERR_BACKEND,
                format!(
                    "cannot create the trace file \"{path}\": {error}; pass a path in a directory that exists and \
                     that this process may write"
                ),
            )
        })?;
        let recording = Recording { recorder, path: path.to_owned() };
        let handle = fill(cell, Arc::new(recording));
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Makes a second handle of `governor`'s books that names `recorder`: every mechanism
/// registered with it (`mc_register_cpu_allocator`, `mc_register_cuda_allocator`,
/// `mc_register_plugin`, `mc_register_vtable`) is governed exactly as through
/// `governor` and recorded, as a tenant of the trace of its own (the account's label,
/// the authority, the allocator's name, the quota and the device limit as they are at
/// registration). Limits, quotas, accounts, policies and holders set through either
/// handle are the same books. Destroy it with `mc_governor_destroy`; the mechanisms
/// registered through it stay recorded until the recording is finished. `governor` must
/// be a handle that names no recording (the one `mc_governor_create` returned).
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_recorder_trace_governor(
    recorder: *mut McRecorder,
    governor: *mut McGovernor,
    out: *mut *mut McGovernor,
) -> McStatus {
    guard("mc_recorder_trace_governor", || {
        check_out(out, "out")?;
        let recording = borrow(&RECORDERS, recorder)?;
        let governor_entry = borrow(&GOVERNORS, governor)?;
        if let Some(already) = &governor_entry.recording {
            return Err(Failure::new(
                MC_ERR_INVALID_ARGUMENT,
                format!(
                    "governor {:#x} already records to \"{}\" (mc_recorder_trace_governor made it); pass the governor \
                     handle that mc_governor_create returned",
                    number(governor),
                    already.path
                ),
            ));
        }
        recording.check_running(recorder)?;
        let cell = vacancy(&GOVERNORS)?;
        let entry =
            GovernorEntry { governor: governor_entry.governor.clone(), recording: Some(Arc::clone(&recording)) };
        let handle = fill(cell, entry);
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Records a mark now, at `device`: `MC_MARK_NOTE` (a phase of the workload) or
/// `MC_MARK_DEVICE_LOST` (record it beside `mc_invalidate_device`; the termination and
/// the blocks handed back by `mc_confirm_terminated` are recorded by the mechanisms
/// themselves). `label` may be null ("").
///
/// # Safety
/// `label` is null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_recorder_mark(
    recorder: *mut McRecorder,
    device: MpDevice,
    kind: McMark,
    label: *const std::ffi::c_char,
) -> McStatus {
    guard("mc_recorder_mark", || {
        let recording = borrow(&RECORDERS, recorder)?;
        let device = device_key(device)?;
        let kind = match kind {
            MC_MARK_NOTE => MarkKind::Note,
            MC_MARK_DEVICE_LOST => MarkKind::DeviceLost,
            other => {
                return Err(Failure::new(
                    MC_ERR_INVALID_ARGUMENT,
                    format!("mark kind {other} is unknown; use MC_MARK_NOTE or MC_MARK_DEVICE_LOST"),
                ));
            }
        };
        // SAFETY: null or NUL-terminated (the caller's contract).
        let label = unsafe { text_or(label, "label", "") }?;
        recording.check_running(recorder)?;
        // A finish racing this call on another thread: the recorder refuses the mark
        // (and counts it) rather than lose it, so MC_OK means the mark is in the file and
        // MC_ERR_STATE that it is not.
        match recording.recorder.try_mark(device, kind, label) {
            Ok(()) => Ok(()),
            Err(RecordError::AlreadyFinished { .. }) => Err(recording.finished(recorder)),
            Err(error) => Err(Failure::new(MC_ERR_BACKEND, format!("recording to \"{}\": {error}", recording.path))),
        }
    })
}

/// Finishes the recording: writes out every event recorded so far, the end record, and
/// closes the file; writes what was written to `out` (may be null). Stop the workload
/// first: an event another thread records during this call is in the file or left out
/// whole (a dropped event, never a damaged record), and events after it are dropped. A
/// mark that returned `MC_OK` is in the file (one racing this call is `MC_ERR_STATE`).
/// Once only: a second call is
/// `MC_ERR_STATE`. A write that failed is `MC_ERR_BACKEND` (the file is readable up to
/// the failure); the recording is finished either way. The handle stays valid until
/// `mc_recorder_destroy`.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_recorder_finish(recorder: *mut McRecorder, out: *mut McRecordingSummary) -> McStatus {
    guard("mc_recorder_finish", || {
        check_optional_out(out, "out")?;
        let recording = borrow(&RECORDERS, recorder)?;
        let summary = recording.finish(recorder)?;
        // SAFETY: checked above.
        unsafe { write_optional(out, summary) };
        Ok(())
    })
}

/// Destroys a recorder handle, finishing its recording first if `mc_recorder_finish`
/// was not called: the file is then a whole trace, as `mc_recorder_finish` writes it
/// (every event recorded before the call, the end record; no summary is given). If that
/// finish fails, the call is `MC_ERR_BACKEND` (the file is readable up to the failure),
/// the recording is finished and the handle stays valid: destroy it again. Governor
/// handles naming the recorder stay valid, and the mechanisms registered through them
/// keep working (unrecorded); a registration through them is refused (`MC_ERR_STATE`).
#[unsafe(no_mangle)]
pub extern "C" fn mc_recorder_destroy(recorder: *mut McRecorder) -> McStatus {
    guard("mc_recorder_destroy", || {
        {
            let recording = borrow(&RECORDERS, recorder)?;
            match recording.finish(recorder) {
                Ok(_) => {}
                // Finished already (by mc_recorder_finish, or a destroy whose finish failed).
                Err(failure) if failure.status == MC_ERR_STATE => {}
                Err(failure) => return Err(failure),
            }
        }
        super::remove(&RECORDERS, recorder)
    })
}

/// Sets the calling thread's caller tag (a request id, a stream id; 0: none): every
/// event a recorded mechanism records on this thread from now on carries it, whatever
/// the recorder, until the thread sets another. Thread-local; costs nothing without a
/// recording.
#[unsafe(no_mangle)]
pub extern "C" fn mc_trace_set_caller_tag(tag: u64) -> McStatus {
    guard("mc_trace_set_caller_tag", || {
        // In C the tag stays until the thread sets another: no guard to restore it.
        memory_trace::replace_caller_tag(tag);
        Ok(())
    })
}

/// Writes the calling thread's caller tag (0: none).
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_trace_caller_tag(out: *mut u64) -> McStatus {
    guard("mc_trace_caller_tag", || {
        check_out(out, "out")?;
        // SAFETY: checked above.
        unsafe { write(out, memory_trace::caller_tag()) };
        Ok(())
    })
}
