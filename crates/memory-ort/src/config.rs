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
    runtime_memory: bool,
    trim_new_shapes: bool,
    return_heap_pages: bool,
}

impl Default for OrtAllocatorConfig {
    fn default() -> OrtAllocatorConfig {
        OrtAllocatorConfig {
            alloc_role: MemoryRole::Activations,
            reserve_role: MemoryRole::Weights,
            alignment: CPU_MIN_ALIGNMENT,
            prepacking: true,
            runtime_memory: true,
            trim_new_shapes: true,
            return_heap_pages: true,
        }
    }
}

impl OrtAllocatorConfig {
    /// The defaults for the CUDA allocator: the same roles, aligned to
    /// [`CUDA_MIN_ALIGNMENT`], without booking ONNX Runtime's own (host) memory to the
    /// device's account (see [`OrtAllocatorConfig::charge_runtime_memory`]). Commits and
    /// trims still hand the C heap's free pages back
    /// ([`OrtAllocatorConfig::return_free_heap_pages`]): ONNX Runtime loads the model and
    /// plans a new shape in host memory with any execution provider.
    pub fn cuda() -> OrtAllocatorConfig {
        OrtAllocatorConfig { alignment: CUDA_MIN_ALIGNMENT, runtime_memory: false, ..OrtAllocatorConfig::default() }
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

    /// Whether sessions committed with the allocator prepack their weights (on by
    /// default, as in a stock session).
    ///
    /// With ONNX Runtime 1.31 prepacking moves no byte out of the books: what it leaves
    /// outside the adapter (the kernels' packed weights and the buffers they are packed
    /// from) is ONNX Runtime's own memory, measured at commit and booked to the reserve
    /// role with the rest of it ([`OrtAllocatorConfig::charge_runtime_memory`]). Off, the
    /// session copies every initializer into blocks of the adapter as well, a second copy
    /// of weights ONNX Runtime already holds: measured with `tests/prepacking.rs`, Silero
    /// VAD holds 2.2 MB more and PP-OCRv4 detection 4.9 MB more than with it on (a stock
    /// session holds neither copy).
    ///
    /// What prepacking buys, measured with ONNX Runtime 1.31: a half-precision VAD export
    /// ran 1.4x slower without it; Silero VAD runs 1.8% more instructions per run without
    /// it (callgrind), PP-OCRv4 detection none more.
    #[must_use]
    pub fn prepacking(mut self, enabled: bool) -> OrtAllocatorConfig {
        self.prepacking = enabled;
        self
    }

    /// Whether sessions prepack their weights.
    pub fn prepacks(&self) -> bool {
        self.prepacking
    }

    /// Whether a commit books ONNX Runtime's own memory for the session (on by default
    /// for the CPU allocator, off for [`OrtAllocatorConfig::cuda`]).
    ///
    /// ONNX Runtime keeps part of every session in allocations of its own that no
    /// `OrtAllocator` sees: the graph with its initializer buffers (in every execution
    /// mode: the buffers the kernels read when weights are prepacked and when the
    /// parallel executor runs them), the kernels and their packed weights. The adapter
    /// measures how much the C heap grew across the commit, less what its own work grew
    /// it by, and charges that to the reserve role (weights) for as long as ONNX Runtime
    /// keeps the session; a quota too small for it fails the commit with the governor's
    /// reason. The crate docs say how exact the measure is. Only host memory is
    /// measured, so it is booked only to a host-tier binding's account.
    #[must_use]
    pub fn charge_runtime_memory(mut self, enabled: bool) -> OrtAllocatorConfig {
        self.runtime_memory = enabled;
        self
    }

    /// Whether a commit books ONNX Runtime's own memory for the session.
    pub fn charges_runtime_memory(&self) -> bool {
        self.runtime_memory
    }

    /// Whether a session returns its allocator's cached memory after the first run of
    /// each new set of input shapes (on by default). ONNX Runtime allocates every buffer
    /// of a new shape separately on its first run, then one planned block per run: a
    /// caching allocator would keep the first run's buffers for good, and nothing asks for
    /// them again. A first run that fails (refused, stopped) trims too, and leaves the
    /// shape new: ONNX Runtime plans from a run that completes, so the next run of it
    /// allocates each buffer on its own again. Trimming releases only wholly free cached
    /// memory, so outputs still held are untouched. Runs on an I/O binding do not trim
    /// (the bound inputs' shapes cannot be read back), and the trim is the allocator's,
    /// so with sessions sharing one it also returns what another cached between its runs
    /// (its next run takes its planned block from the source again).
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

    /// Whether a commit and every trim of the allocator's cache (after a new shape's
    /// first run, and ONNX Runtime's `Shrink`) also hand the C heap's free pages back to
    /// the operating system (on by default; glibc's `malloc_trim`, a no-op on C libraries
    /// without it). glibc keeps freed memory resident for later `malloc`s: what ONNX
    /// Runtime loaded the model with, the blocks a trimmed cache took from the heap, and
    /// ONNX Runtime's own buffers of a shape's first run (its allocations outside any
    /// `OrtAllocator`) would stay in the process's footprint though nothing uses them
    /// until a later request happens to fit. The price is one `malloc_trim` per commit
    /// and trim: it takes each heap arena's lock in turn (other threads' `malloc` in that
    /// arena wait meanwhile), measured at 0.1-0.3 ms typically and up to 8 ms after many
    /// frees on PP-OCRv4 (on a loaded 2-core machine) (a new shape's first run takes 10-300 ms there), and the page
    /// faults of a later `malloc` that reuses the pages.
    ///
    /// Measured with `cargo xtask bench --ort -- --configs
    /// arena,governed-pool,governed-pool-keep-heap` (peak RSS against ONNX Runtime's
    /// arena, governed pool, without / with, one run of 3 rounds): Silero VAD 1.008x /
    /// 0.984x; PP-OCRv4 detection at one size 0.664x / 0.620x, over a size sweep 0.787x /
    /// 0.748x; recognition over a width sweep 0.913x / 0.828x; the direction classifier
    /// over batch sizes 0.923x / 0.879x.
    #[must_use]
    pub fn return_free_heap_pages(mut self, enabled: bool) -> OrtAllocatorConfig {
        self.return_heap_pages = enabled;
        self
    }

    /// Whether commits and trims also hand the C heap's free pages back to the
    /// operating system.
    pub fn returns_free_heap_pages(&self) -> bool {
        self.return_heap_pages
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
        assert!(config.prepacks() && config.charges_runtime_memory(), "stock prepacking, every byte booked");
        let cuda = OrtAllocatorConfig::cuda();
        assert!(cuda.prepacks() && !cuda.charges_runtime_memory(), "host memory is not booked to a device");
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
