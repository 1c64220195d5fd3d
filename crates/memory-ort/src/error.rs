//! The adapter's errors: one enum, every message saying what was asked, what was found
//! and what to do.

use memory_governor::{DeviceKey, Tier};

/// Why the adapter could not do what was asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OrtAdapterError {
    /// The ONNX Runtime library could not be loaded or its environment built.
    #[error(
        "could not load onnx runtime from {path}: {message}; run `cargo xtask test` (it fetches the runtime into \
         target/ort-cache) or point MEMORY_ORT_CACHE at a directory holding lib/libonnxruntime.so.1.31.1"
    )]
    Load {
        /// The library asked for.
        path: String,
        /// What the loader or ONNX Runtime said.
        message: String,
    },
    /// ONNX Runtime returned an error that no governor refusal explains.
    #[error("onnx runtime could not {action}: {message}")]
    Runtime {
        /// What was being done (`create the session`, `run`, ...).
        action: &'static str,
        /// ONNX Runtime's message.
        message: String,
    },
    /// ONNX Runtime failed because the governor refused memory it asked for.
    #[error(
        "onnx runtime could not {action} because the governor refused its memory: {reason} \
         (onnx runtime said: {runtime})"
    )]
    Refused {
        /// What was being done.
        action: &'static str,
        /// The governor's (or registry's) actionable message.
        reason: String,
        /// ONNX Runtime's own message.
        runtime: String,
    },
    /// The configured alignment is below what ONNX Runtime needs.
    #[error(
        "alignment {requested} is not a power of two of at least {minimum} bytes, which onnx runtime's kernels \
         expect; configure {minimum} or a larger power of two"
    )]
    Alignment {
        /// The alignment configured.
        requested: usize,
        /// The smallest one accepted.
        minimum: usize,
    },
    /// The binding is for another tier than the allocator serves.
    #[error(
        "the {kind} ort allocator needs a binding on a {expected} device, but the binding is on {found}; bind on \
         the right device"
    )]
    WrongDevice {
        /// `cpu` or `cuda`.
        kind: &'static str,
        /// The tier expected.
        expected: Tier,
        /// The binding's device.
        found: DeviceKey,
    },
    /// Registering with, or unregistering from, the environment failed.
    #[error(
        "could not {action} the governed allocator with the onnx runtime environment: {message}; another \
         allocator for the same memory info may be registered outside memory-ort (unregister it first)"
    )]
    Registration {
        /// `register` or `unregister`.
        action: &'static str,
        /// ONNX Runtime's message.
        message: String,
    },
    /// A cached asset (runtime library or model) is missing.
    #[error("{what} is missing at {path}; {hint}")]
    MissingAsset {
        /// What was looked for.
        what: &'static str,
        /// Where.
        path: String,
        /// How to get it.
        hint: String,
    },
}
