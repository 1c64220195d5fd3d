//! The governed side of the adapter, free of FFI: blocks allocated through a
//! [`MemoryBinding`], found again by address when ONNX Runtime frees them, and the
//! figures `GetStats` reports.
//!
//! Every block is a [`BoundAllocation`] (registry-issued identity, charged by the
//! governor through the binding's governed allocator). The live table maps each
//! address ONNX Runtime holds to its handle; it is a sharded map, so `Free` takes one
//! shard's lock, never a lock every thread shares.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use memory_governor::{
    Account, AllocationRequest, BoundAllocation, DeferredReleaseQueue, HandleError, MemoryBinding, MemoryRole,
    ReleaseSummary,
};

use crate::config::OrtAllocatorConfig;

/// Which ONNX Runtime entry point asked.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum RequestKind {
    /// `OrtAllocator::Alloc`: memory of one run.
    Alloc,
    /// `OrtAllocator::Reserve`: memory the session keeps (initializers).
    Reserve,
}

/// How a freed block goes back.
#[derive(Clone)]
pub(crate) enum ReleasePath {
    /// Released through the binding at once (host memory).
    Now,
    /// Handed to a deferred queue (device memory: freed after the stream's pending work).
    Deferred(Arc<dyn DeferredReleaseQueue>),
}

/// What `Free` did with a pointer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Freed {
    /// The block went back through its binding (or its queue).
    Released,
    /// The device was lost: nothing was freed; the registry retires the block when the
    /// context is confirmed terminated.
    AfterLoss,
    /// The registry refused the release for another reason; the handle was dropped
    /// under the mechanism's drop policy.
    Refused,
    /// The pointer is not one of ours; nothing was done.
    Unknown,
}

/// Watches one commit or run for refusals: keeps the first reason and, for a run,
/// stops it (ONNX Runtime's run-options terminate flag).
pub(crate) struct Watch {
    reason: Mutex<Option<String>>,
    stop: Option<Box<dyn Fn() + Send + Sync>>,
}

impl Watch {
    /// A watch that records refusals and calls `stop` on the first one.
    pub(crate) fn new(stop: Option<Box<dyn Fn() + Send + Sync>>) -> Arc<Watch> {
        Arc::new(Watch { reason: Mutex::new(None), stop })
    }

    fn refused(&self, reason: &str) {
        let first = {
            let mut slot = self.reason.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let first = slot.is_none();
            slot.get_or_insert_with(|| reason.to_owned());
            first
        };
        if first && let Some(stop) = &self.stop {
            stop();
        }
    }

    /// The first refusal's reason, if any.
    pub(crate) fn reason(&self) -> Option<String> {
        self.reason.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

/// What the current thread is doing for which adapter: committing a session (its
/// `Alloc` calls are session-long memory: prepacked weights), or running one (a refusal
/// stops that run).
#[derive(Clone, Default)]
enum Phase {
    #[default]
    Idle,
    Committing(usize, Arc<Watch>),
    Running(usize, Arc<Watch>),
}

thread_local! {
    static PHASE: RefCell<Phase> = const { RefCell::new(Phase::Idle) };
}

/// Restores the thread's previous phase when dropped.
pub(crate) struct PhaseGuard(Phase);

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        let previous = std::mem::take(&mut self.0);
        // During thread teardown the phase is gone with the thread: nothing to restore.
        let _ = PHASE.try_with(|phase| *phase.borrow_mut() = previous);
    }
}

fn enter(next: Phase) -> PhaseGuard {
    // During thread teardown there is no phase to enter: such a call runs as Idle.
    PhaseGuard(PHASE.try_with(|phase| std::mem::replace(&mut *phase.borrow_mut(), next)).unwrap_or_default())
}

/// How a refused run-time `Alloc` is answered. ONNX Runtime's tensors do not check the
/// pointer an `OrtAllocator` returns (its own allocators throw instead, which a C
/// allocator cannot), so a null during a run would crash the process.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum RefusalAnswer {
    /// Serve the block from host memory outside the books (the overdraft, counted and
    /// logged) and stop the run at its next kernel boundary; the run fails with the
    /// governor's reason and the overdraft is freed with it.
    OverdraftAndStop,
    /// Answer null (device memory: no host overdraft can stand in for it).
    Null,
}

/// Figures of one adapter, as `GetStats` reports them (ONNX Runtime's key names in
/// brackets).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OrtAllocatorStats {
    /// The tenant's quota, 0 when it has none (`Limit`).
    pub limit: u64,
    /// Bytes ONNX Runtime holds now (`InUse`).
    pub in_use: u64,
    /// Bytes handed out since the adapter was made (`TotalAllocated`).
    pub total_allocated: u64,
    /// The most bytes held at once (`MaxInUse`).
    pub peak_in_use: u64,
    /// Successful `Alloc` calls (`NumAllocs`).
    pub allocs: u64,
    /// Successful `Reserve` calls (`NumReserves`).
    pub reserves: u64,
    /// Blocks freed.
    pub frees: u64,
    /// The largest single block (`MaxAllocSize`).
    pub max_alloc_size: u64,
    /// Requests refused (by the governor, a lost device or the allocator).
    pub refusals: u64,
    /// Frees after the device was lost (nothing was freed for them).
    pub frees_after_loss: u64,
    /// Frees of pointers this adapter never handed out (ignored).
    pub unknown_frees: u64,
    /// Refused run-time requests served from the overdraft (their runs were stopped).
    pub overdraft_blocks: u64,
    /// Their bytes (cumulative).
    pub overdraft_bytes: u64,
}

impl OrtAllocatorStats {
    /// The figures as ONNX Runtime's `GetStats` key/value pairs.
    pub fn key_values(&self) -> [(&'static str, u64); 13] {
        [
            ("Limit", self.limit),
            ("InUse", self.in_use),
            ("TotalAllocated", self.total_allocated),
            ("MaxInUse", self.peak_in_use),
            ("NumAllocs", self.allocs),
            ("NumReserves", self.reserves),
            ("MaxAllocSize", self.max_alloc_size),
            ("NumFrees", self.frees),
            ("NumRefusals", self.refusals),
            ("NumFreesAfterLoss", self.frees_after_loss),
            ("NumUnknownFrees", self.unknown_frees),
            ("NumOverdraftBlocks", self.overdraft_blocks),
            ("OverdraftBytes", self.overdraft_bytes),
        ]
    }
}

#[derive(Default)]
struct Counters {
    in_use: AtomicU64,
    total_allocated: AtomicU64,
    peak_in_use: AtomicU64,
    allocs: AtomicU64,
    reserves: AtomicU64,
    frees: AtomicU64,
    max_alloc_size: AtomicU64,
    refusals: AtomicU64,
    frees_after_loss: AtomicU64,
    unknown_frees: AtomicU64,
    overdraft_blocks: AtomicU64,
    overdraft_bytes: AtomicU64,
}

/// One block ONNX Runtime holds.
enum Block {
    /// Governed: registry identity, charged by the governor.
    Governed(BoundAllocation),
    /// Served from the overdraft after a refusal; freed back to the host.
    Overdraft { bytes: usize },
}

/// The governed blocks of one adapter.
pub(crate) struct GovernedBlocks {
    binding: MemoryBinding,
    account: Option<Account>,
    config: OrtAllocatorConfig,
    alignment: usize,
    release: ReleasePath,
    live: DashMap<usize, Block>,
    refusal_answer: RefusalAnswer,
    counters: Counters,
    last_refusal: Mutex<Option<String>>,
}

impl GovernedBlocks {
    pub(crate) fn new(
        binding: MemoryBinding,
        account: Option<Account>,
        config: OrtAllocatorConfig,
        alignment: usize,
        release: ReleasePath,
        refusal_answer: RefusalAnswer,
    ) -> GovernedBlocks {
        GovernedBlocks {
            refusal_answer,
            binding,
            account,
            config,
            alignment,
            release,
            live: DashMap::new(),
            counters: Counters::default(),
            last_refusal: Mutex::new(None),
        }
    }

    pub(crate) fn binding(&self) -> &MemoryBinding {
        &self.binding
    }

    pub(crate) fn config(&self) -> OrtAllocatorConfig {
        self.config
    }

    /// This adapter's identity in the thread's phase (its address, unique while alive).
    fn owner(&self) -> usize {
        std::ptr::from_ref(self).addr()
    }

    /// Marks the current thread as committing a session with this adapter until the
    /// guard drops: its `Alloc` calls are then charged like `Reserve`.
    pub(crate) fn enter_commit(&self, watch: Arc<Watch>) -> PhaseGuard {
        enter(Phase::Committing(self.owner(), watch))
    }

    /// Marks the current thread as running a session of this adapter until the guard
    /// drops: a refusal is recorded in `watch`, which stops the run.
    pub(crate) fn enter_run(&self, watch: Arc<Watch>) -> PhaseGuard {
        enter(Phase::Running(self.owner(), watch))
    }

    fn phase(&self) -> Phase {
        let owner = self.owner();
        PHASE
            .try_with(|phase| match &*phase.borrow() {
                Phase::Committing(id, watch) if *id == owner => Phase::Committing(owner, Arc::clone(watch)),
                Phase::Running(id, watch) if *id == owner => Phase::Running(owner, Arc::clone(watch)),
                _ => Phase::Idle,
            })
            // A call from a thread's TLS destructors: no session phase is active there.
            .unwrap_or(Phase::Idle)
    }

    /// Allocates `size` bytes for `kind`, charged to its role: `Reserve`, and `Alloc`
    /// while a session is being committed (prepacked weights), to the reserve role;
    /// other `Alloc` calls to the alloc role. `None` is a refusal answered with null
    /// (during session creation, where ONNX Runtime checks it, or for device memory);
    /// a refusal during a run is served from the overdraft and stops the run (see
    /// [`RefusalAnswer`]). Either way the reason is logged and kept for
    /// [`GovernedBlocks::last_refusal`]. A zero-byte request gets `None` without a
    /// refusal, as ONNX Runtime's own allocator answers it.
    pub(crate) fn allocate(&self, size: usize, kind: RequestKind) -> Option<usize> {
        if size == 0 {
            return None;
        }
        let phase = self.phase();
        let session_long = kind == RequestKind::Reserve || matches!(phase, Phase::Committing(..));
        let role = if session_long { self.config.role_of_reserve() } else { self.config.role_of_alloc() };
        let granted = AllocationRequest::new(size, self.alignment)
            .map_err(|err| err.to_string())
            .and_then(|request| self.binding.allocate(request.with_role(role)).map_err(|err| err.to_string()));
        let block = match granted {
            Ok(block) => block,
            Err(reason) => {
                let reason = self.refuse(size, role, &reason);
                return match (phase, self.refusal_answer) {
                    (Phase::Committing(_, watch), _) => {
                        watch.refused(&reason);
                        None
                    }
                    (Phase::Running(_, watch), RefusalAnswer::Null) => {
                        watch.refused(&reason);
                        None
                    }
                    (_, RefusalAnswer::Null) => None,
                    (Phase::Running(_, watch), RefusalAnswer::OverdraftAndStop) => {
                        watch.refused(&reason);
                        self.overdraft(size)
                    }
                    (Phase::Idle, RefusalAnswer::OverdraftAndStop) if kind == RequestKind::Reserve => None,
                    (Phase::Idle, RefusalAnswer::OverdraftAndStop) => {
                        tracing::error!(
                            bytes = size,
                            "refused outside a governed run: served from the overdraft, and no run could be stopped \
                             (run sessions through GovernedSession::run)"
                        );
                        self.overdraft(size)
                    }
                };
            }
        };
        let address = block.address().get() as usize;
        let bytes = block.bytes() as u64;
        match self.live.entry(address) {
            Entry::Vacant(slot) => {
                slot.insert(Block::Governed(block));
            }
            Entry::Occupied(_) => {
                // The allocator handed out an address ONNX Runtime still holds: never
                // give it out twice. The new handle goes back through the binding.
                tracing::error!(address, "allocator returned a live address again; refusing the block");
                if let Err(rejected) = self.binding.release(block) {
                    tracing::error!(reason = %rejected.reason, "the duplicate block could not be released");
                }
                let reason = self.refuse(size, role, "the allocator returned an address that is still in use");
                if let Phase::Committing(_, watch) | Phase::Running(_, watch) = self.phase() {
                    watch.refused(&reason);
                }
                return None;
            }
        }
        let counters = &self.counters;
        match kind {
            RequestKind::Alloc => counters.allocs.fetch_add(1, Ordering::Relaxed),
            RequestKind::Reserve => counters.reserves.fetch_add(1, Ordering::Relaxed),
        };
        counters.total_allocated.fetch_add(bytes, Ordering::Relaxed);
        let now = counters.in_use.fetch_add(bytes, Ordering::Relaxed) + bytes;
        counters.peak_in_use.fetch_max(now, Ordering::Relaxed);
        counters.max_alloc_size.fetch_max(bytes, Ordering::Relaxed);
        tracing::trace!(address, bytes, ?kind, "ort block allocated");
        Some(address)
    }

    /// Serves a refused run-time block from host memory outside the books.
    fn overdraft(&self, size: usize) -> Option<usize> {
        let address = crate::ffi::overdraft_allocate(size, self.alignment)?;
        self.live.insert(address, Block::Overdraft { bytes: size });
        self.counters.overdraft_blocks.fetch_add(1, Ordering::Relaxed);
        self.counters.overdraft_bytes.fetch_add(size as u64, Ordering::Relaxed);
        tracing::warn!(bytes = size, "refused block served from the overdraft; the run is being stopped");
        Some(address)
    }

    /// Frees the block at `address` through the binding it came from.
    pub(crate) fn free(&self, address: usize) -> Freed {
        let Some((_, block)) = self.live.remove(&address) else {
            self.counters.unknown_frees.fetch_add(1, Ordering::Relaxed);
            tracing::error!(address, "onnx runtime freed a pointer this allocator never handed out; ignored");
            return Freed::Unknown;
        };
        let block = match block {
            Block::Governed(block) => block,
            Block::Overdraft { bytes } => {
                crate::ffi::overdraft_free(address, bytes, self.alignment);
                return Freed::Released;
            }
        };
        let bytes = block.bytes() as u64;
        self.counters.in_use.fetch_sub(bytes, Ordering::Relaxed);
        self.counters.frees.fetch_add(1, Ordering::Relaxed);
        let result = match &self.release {
            ReleasePath::Now => self.binding.release(block).map(|report| {
                if let ReleaseSummary::Quarantined { residual_bytes, .. } = report {
                    tracing::warn!(address, residual_bytes, "ort block release was partial; the rest is quarantined");
                }
            }),
            ReleasePath::Deferred(queue) => self.binding.release_deferred(block, queue.as_ref()),
        };
        match result {
            Ok(()) => Freed::Released,
            Err(rejected) => {
                let (block, reason) = rejected.into_parts();
                if matches!(reason, HandleError::DeviceLost { .. }) {
                    // No free after loss: dropping the handle on a lost mechanism makes no
                    // callback; termination retires the record and refunds the charge.
                    self.counters.frees_after_loss.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(address, "ort freed a block after its device was lost; nothing freed");
                    drop(block);
                    Freed::AfterLoss
                } else {
                    tracing::warn!(address, %reason, "ort block release refused; the mechanism's drop policy applies");
                    drop(block);
                    Freed::Refused
                }
            }
        }
    }

    fn refuse(&self, size: usize, role: MemoryRole, reason: &str) -> String {
        self.counters.refusals.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(bytes = size, %role, device = %self.binding.device(), reason, "ort allocation refused");
        let message = format!("{size} bytes of {role} on {}: {reason}", self.binding.device());
        *self.last_refusal.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(message.clone());
        message
    }

    /// The reason of the latest refusal.
    pub(crate) fn last_refusal(&self) -> Option<String> {
        self.last_refusal.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Blocks ONNX Runtime holds now.
    pub(crate) fn live_blocks(&self) -> usize {
        self.live.len()
    }

    /// Returns cached memory of the binding's allocator to its source.
    pub(crate) fn trim(&self) -> usize {
        self.binding.allocator().trim()
    }

    pub(crate) fn stats(&self) -> OrtAllocatorStats {
        let c = &self.counters;
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        OrtAllocatorStats {
            limit: self.account.as_ref().and_then(Account::quota).unwrap_or(0),
            in_use: load(&c.in_use),
            total_allocated: load(&c.total_allocated),
            peak_in_use: load(&c.peak_in_use),
            allocs: load(&c.allocs),
            reserves: load(&c.reserves),
            frees: load(&c.frees),
            max_alloc_size: load(&c.max_alloc_size),
            refusals: load(&c.refusals),
            frees_after_loss: load(&c.frees_after_loss),
            unknown_frees: load(&c.unknown_frees),
            overdraft_blocks: load(&c.overdraft_blocks),
            overdraft_bytes: load(&c.overdraft_bytes),
        }
    }
}
