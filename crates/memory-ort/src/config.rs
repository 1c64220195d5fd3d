//! What an adapter charges and how it aligns.

use memory_governor::MemoryRole;

use crate::error::OrtAdapterError;

/// The alignment ONNX Runtime's CPU kernels expect of every buffer (its own CPU
/// allocator aligns to 64 bytes, a cache line and an AVX-512 vector).
pub const CPU_MIN_ALIGNMENT: usize = 64;

/// The alignment the CUDA execution provider expects (`cudaMalloc` gives 256).
pub const CUDA_MIN_ALIGNMENT: usize = 256;

/// Which role each kind of ONNX Runtime request is charged to, and the alignment.
///
/// ONNX Runtime calls `Reserve` for memory it keeps for the session's life
/// (initializers, that is weights) and `Alloc` for memory of one run (activations,
/// outputs). The governor books them apart, so a tenant's weights and its per-request
/// memory show (and can be limited) separately.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct OrtAllocatorConfig {
    alloc_role: MemoryRole,
    reserve_role: MemoryRole,
    alignment: usize,
    prepacking: bool,
    trim_new_shapes: bool,
}

impl Default for OrtAllocatorConfig {
    fn default() -> OrtAllocatorConfig {
        OrtAllocatorConfig {
            alloc_role: MemoryRole::Activations,
            reserve_role: MemoryRole::Weights,
            alignment: CPU_MIN_ALIGNMENT,
            prepacking: false,
            trim_new_shapes: true,
        }
    }
}

impl OrtAllocatorConfig {
    /// The defaults for the CUDA allocator: the same roles, aligned to
    /// [`CUDA_MIN_ALIGNMENT`].
    pub fn cuda() -> OrtAllocatorConfig {
        OrtAllocatorConfig { alignment: CUDA_MIN_ALIGNMENT, ..OrtAllocatorConfig::default() }
    }

    /// The role `Alloc` (per-run memory) is charged to; activations by default.
    #[must_use]
    pub fn alloc_role(mut self, role: MemoryRole) -> OrtAllocatorConfig {
        self.alloc_role = role;
        self
    }

    /// The role `Reserve` (session-long memory: initializers) is charged to; weights
    /// by default.
    #[must_use]
    pub fn reserve_role(mut self, role: MemoryRole) -> OrtAllocatorConfig {
        self.reserve_role = role;
        self
    }

    /// The alignment of every block (at least [`CPU_MIN_ALIGNMENT`] for the CPU
    /// allocator, [`CUDA_MIN_ALIGNMENT`] for CUDA; checked when the allocator is made).
    #[must_use]
    pub fn alignment(mut self, bytes: usize) -> OrtAllocatorConfig {
        self.alignment = bytes;
        self
    }

    /// Whether sessions committed with the allocator prepack their weights (off by
    /// default). ONNX Runtime allocates prepacked weight copies with its own CPU
    /// allocator, not the environment's, so with prepacking on those bytes (most of a
    /// convolutional model's weights) escape the books; off, every weight byte is
    /// reserved through the governed allocator and charged.
    ///
    /// What it costs, measured with ONNX Runtime 1.31 (instructions per run under
    /// callgrind, so machine load does not blur it): Silero VAD runs 1.8% more
    /// instructions without prepacking, PP-OCRv4 detection none more.
    #[must_use]
    pub fn prepacking(mut self, enabled: bool) -> OrtAllocatorConfig {
        self.prepacking = enabled;
        self
    }

    /// Whether sessions prepack their weights.
    pub fn prepacks(&self) -> bool {
        self.prepacking
    }

    /// Whether a session returns its allocator's cached memory after the first run of
    /// each new set of input shapes (on by default). ONNX Runtime allocates every buffer
    /// of a new shape separately on its first run, then one planned block per run: a
    /// caching allocator would keep the first run's buffers for good, and nothing asks for
    /// them again. Trimming releases only wholly free cached memory, so outputs still held
    /// are untouched.
    ///
    /// Measured with `cargo xtask bench --ort` (peak RSS against ONNX Runtime's arena,
    /// governed pool, without / with): PP-OCRv4 recognition over a width sweep 1.64x /
    /// 1.16x; detection over a size sweep 1.43x / 0.87x; the direction classifier over
    /// batch sizes 1.39x / 1.10x; detection at one size 0.95x / 0.69x. What remains above
    /// the arena is the pool's own policy (exact-size segments that do not merge).
    #[must_use]
    pub fn trim_on_new_shapes(mut self, enabled: bool) -> OrtAllocatorConfig {
        self.trim_new_shapes = enabled;
        self
    }

    /// Whether sessions trim after the first run of a new input shape.
    pub fn trims_new_shapes(&self) -> bool {
        self.trim_new_shapes
    }

    /// The role of `Alloc` requests.
    pub fn role_of_alloc(&self) -> MemoryRole {
        self.alloc_role
    }

    /// The role of `Reserve` requests.
    pub fn role_of_reserve(&self) -> MemoryRole {
        self.reserve_role
    }

    /// The alignment of every block.
    pub fn block_alignment(&self) -> usize {
        self.alignment
    }

    /// The alignment, checked against `minimum`.
    pub(crate) fn checked_alignment(&self, minimum: usize) -> Result<usize, OrtAdapterError> {
        if self.alignment.is_power_of_two() && self.alignment >= minimum {
            Ok(self.alignment)
        } else {
            Err(OrtAdapterError::Alignment { requested: self.alignment, minimum })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_charge_reserve_to_weights_and_alloc_to_activations_aligned_to_a_cache_line() {
        let config = OrtAllocatorConfig::default();
        assert_eq!(config.role_of_reserve(), MemoryRole::Weights);
        assert_eq!(config.role_of_alloc(), MemoryRole::Activations);
        assert_eq!(config.checked_alignment(CPU_MIN_ALIGNMENT).unwrap(), 64);
    }

    #[test]
    fn alignment_below_what_onnx_runtime_needs_is_a_typed_error() {
        let err = OrtAllocatorConfig::default().alignment(16).checked_alignment(CPU_MIN_ALIGNMENT).unwrap_err();
        assert!(matches!(err, OrtAdapterError::Alignment { requested: 16, minimum: 64 }), "{err}");
        assert!(err.to_string().contains("configure 64"), "{err}");
        let err = OrtAllocatorConfig::default().alignment(96).checked_alignment(CPU_MIN_ALIGNMENT).unwrap_err();
        assert!(matches!(err, OrtAdapterError::Alignment { requested: 96, .. }));
        assert_eq!(OrtAllocatorConfig::default().alignment(4096).checked_alignment(CUDA_MIN_ALIGNMENT).unwrap(), 4096);
    }
}
