//! [`GovernedOrtAllocator`]: the handle a runtime holds. Cloning it is cheap; the
//! allocator ONNX Runtime calls lives until the last handle, session and block made
//! with it are gone (see the `ffi` module docs).

use std::fmt;
use std::sync::Arc;

use memory_governor::{Account, MemoryBinding, Tier};

use crate::blocks::{GovernedBlocks, OrtAllocatorStats, RefusalAnswer, ReleasePath};
use crate::config::{CPU_MIN_ALIGNMENT, CUDA_MIN_ALIGNMENT, OrtAllocatorConfig};
use crate::environment::OrtEnvironment;
use crate::error::OrtAdapterError;
use crate::ffi::{Core, MemoryInfo};

/// An `OrtAllocator` whose every byte comes from a [`MemoryBinding`]: registry-issued
/// identity, charged by the governor to the binding's authority under the role of the
/// request (`Reserve` and `Alloc` apart, see [`OrtAllocatorConfig`]).
///
/// Sessions use it through [`OrtEnvironment::commit_from_file`] and
/// [`OrtEnvironment::commit_from_memory`].
#[derive(Clone)]
pub struct GovernedOrtAllocator {
    pub(crate) core: Arc<Core>,
    kind: &'static str,
}

impl GovernedOrtAllocator {
    /// An allocator for ONNX Runtime's CPU memory (non-arena `Cpu` memory info) over a
    /// binding on a host-tier device. `account`, when given, is the tenant's governor
    /// account; `GetStats` reports its quota as the limit.
    ///
    /// # Errors
    /// [`OrtAdapterError::WrongDevice`] when the binding is not on a host-tier device,
    /// [`OrtAdapterError::Alignment`] for an alignment below
    /// [`CPU_MIN_ALIGNMENT`](crate::CPU_MIN_ALIGNMENT), [`OrtAdapterError::Runtime`] if
    /// ONNX Runtime cannot describe CPU memory.
    pub fn cpu(
        environment: &OrtEnvironment,
        binding: MemoryBinding,
        account: Option<Account>,
        config: OrtAllocatorConfig,
    ) -> Result<GovernedOrtAllocator, OrtAdapterError> {
        let _loaded = environment;
        if binding.device().tier() != Tier::Host {
            return Err(OrtAdapterError::WrongDevice { kind: "cpu", expected: Tier::Host, found: binding.device() });
        }
        let alignment = config.checked_alignment(CPU_MIN_ALIGNMENT)?;
        let info =
            MemoryInfo::cpu().map_err(|message| OrtAdapterError::Runtime { action: "describe cpu memory", message })?;
        let blocks =
            GovernedBlocks::new(binding, account, config, alignment, ReleasePath::Now, RefusalAnswer::OverdraftAndStop);
        Ok(GovernedOrtAllocator::from_core(Core::new(info, blocks), "cpu"))
    }

    /// An allocator for the CUDA execution provider's device memory (`Cuda` memory
    /// info of the binding's device ordinal) over a binding on a device-tier key, for
    /// example a governed [`CudaPoolAllocator`](allocator_cuda::CudaPoolAllocator).
    /// Frees go to `queue`, so a block is reused only after the work queued on its
    /// stream has finished: give ONNX Runtime the queue's stream as its compute stream
    /// (the CUDA execution provider's `user_compute_stream`).
    ///
    /// # Errors
    /// As [`GovernedOrtAllocator::cpu`], for a device-tier binding and
    /// [`CUDA_MIN_ALIGNMENT`](crate::CUDA_MIN_ALIGNMENT) (start from
    /// [`OrtAllocatorConfig::cuda`]).
    pub fn cuda(
        environment: &OrtEnvironment,
        binding: MemoryBinding,
        account: Option<Account>,
        queue: Arc<allocator_cuda::CudaReleaseQueue>,
        config: OrtAllocatorConfig,
    ) -> Result<GovernedOrtAllocator, OrtAdapterError> {
        let _loaded = environment;
        let device = binding.device();
        if device.tier() != Tier::Device {
            return Err(OrtAdapterError::WrongDevice { kind: "cuda", expected: Tier::Device, found: device });
        }
        let alignment = config.checked_alignment(CUDA_MIN_ALIGNMENT)?;
        let ordinal = i32::try_from(device.index()).map_err(|_| OrtAdapterError::WrongDevice {
            kind: "cuda",
            expected: Tier::Device,
            found: device,
        })?;
        let info = MemoryInfo::cuda(ordinal)
            .map_err(|message| OrtAdapterError::Runtime { action: "describe cuda memory", message })?;
        let blocks =
            GovernedBlocks::new(binding, account, config, alignment, ReleasePath::Deferred(queue), RefusalAnswer::Null);
        Ok(GovernedOrtAllocator::from_core(Core::new(info, blocks), "cuda"))
    }

    fn from_core(core: Arc<Core>, kind: &'static str) -> GovernedOrtAllocator {
        let binding = core.blocks.binding();
        tracing::info!(kind, binding = %binding.identity(), "governed ort allocator created");
        GovernedOrtAllocator { core, kind }
    }

    /// The binding every block comes from.
    pub fn binding(&self) -> &MemoryBinding {
        self.core.blocks.binding()
    }

    /// The roles and alignment in force.
    pub fn config(&self) -> OrtAllocatorConfig {
        self.core.blocks.config()
    }

    /// The figures `GetStats` reports through this handle's table: the adapter's,
    /// over every session committed with it (each session's own are
    /// [`GovernedSession::stats`](crate::GovernedSession::stats)).
    pub fn stats(&self) -> OrtAllocatorStats {
        self.core.stats()
    }

    /// The reason of the latest refused request (the governor's message for a quota or
    /// limit), also logged with `tracing` when it happened.
    pub fn last_refusal(&self) -> Option<String> {
        self.core.blocks.last_refusal()
    }

    /// Blocks ONNX Runtime holds now.
    pub fn live_blocks(&self) -> usize {
        self.core.blocks.live_blocks()
    }

    /// The handle's own `OrtAllocator*` (sessions get tables of their own). Getting it is
    /// safe; calling through it is the caller's unsafe obligation, valid while this
    /// handle lives. Its calls belong to no run: a refused request is answered with null
    /// (there is no run to stop), so check the pointer (ONNX Runtime's
    /// `CreateTensorAsOrtValue` does not). While a block it handed out is live, the
    /// binding's provider context is held open (termination waits for its `Free`).
    pub fn as_ort_allocator(&self) -> *mut ort::sys::OrtAllocator {
        Core::as_ort(&self.core)
    }

    /// The memory info the allocator describes itself with.
    pub fn memory_info(&self) -> *const ort::sys::OrtMemoryInfo {
        self.core.info()
    }

    /// A weak watch on the allocator ONNX Runtime calls: says whether it still lives.
    pub fn watch(&self) -> AllocatorWatch {
        AllocatorWatch(Arc::downgrade(&self.core))
    }

    /// How many owners keep the allocator alive (this handle, its clones, and the table
    /// of each session made with it, which its session and blocks keep alive); for tests
    /// of the ownership rules.
    pub fn owners(&self) -> usize {
        Arc::strong_count(&self.core)
    }
}

/// Whether an allocator's core (the table ONNX Runtime calls) is still alive, without
/// keeping it alive. For tests and shutdown checks.
#[derive(Clone)]
pub struct AllocatorWatch(std::sync::Weak<Core>);

impl fmt::Debug for AllocatorWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AllocatorWatch").field("alive", &self.is_alive()).finish()
    }
}

impl AllocatorWatch {
    /// Whether a handle, a session or a live block still holds the allocator.
    pub fn is_alive(&self) -> bool {
        self.0.strong_count() > 0
    }
}

impl fmt::Debug for GovernedOrtAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GovernedOrtAllocator")
            .field("kind", &self.kind)
            .field("binding", &self.binding().identity())
            .field("stats", &self.stats())
            .finish()
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        self.release_runtime_lease();
        if self.is_session() {
            tracing::debug!(binding = %self.blocks.binding().identity(), "a session's ort allocator table released");
            return;
        }
        let stats = self.blocks.stats();
        tracing::info!(
            binding = %self.blocks.binding().identity(),
            allocs = stats.allocs,
            reserves = stats.reserves,
            frees = stats.frees,
            "governed ort allocator released: no session or block uses it any more"
        );
    }
}
