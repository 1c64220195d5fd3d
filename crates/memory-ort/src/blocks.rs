//! The governed side of the adapter, free of FFI: blocks allocated through a
//! [`MemoryBinding`], found again by address when ONNX Runtime frees them, and the
//! figures `GetStats` reports.
//!
//! Every block is a [`BoundAllocation`] (registry-issued identity, charged by the
//! governor through the binding's governed allocator). The live table maps each
//! address ONNX Runtime holds to its handle; it is a sharded map, so `Free` takes one
//! shard's lock, never a lock every thread shares.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use memory_governor::{
    Account, AllocationRequest, BoundAllocation, DeferredReleaseQueue, HandleError, MemoryBinding, MemoryRole,
    OverdraftDraw, OwnedLease, ReleaseSummary, Tier,
};

use crate::caller::{Caller, Phase};
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

/// How a refused run-time `Alloc` is answered. ONNX Runtime's tensors do not check the
/// pointer an `OrtAllocator` returns (its own allocators throw instead, which a C
/// allocator cannot), so a null during a run would crash the process.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum RefusalAnswer {
    /// Stop the run at its next kernel boundary (or fail the commit once ONNX Runtime
    /// returns) and serve the block meanwhile: from the governor's overdraft (host
    /// memory booked apart, bounded by the device's overdraft limit), and past that
    /// limit from the scratch sink (see [`crate::sink`]). The run or commit fails with
    /// the governor's reason; both are freed as it unwinds. Outside a commit or run, a
    /// session's table is served from the overdraft only (see `GovernedBlocks::refused`).
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
    /// Overdraft bytes held now (also in the governor's books).
    pub overdraft_in_use: u64,
    /// Refused run-time requests past the overdraft limit, served from the scratch sink
    /// (no memory of their own; their runs were stopped).
    pub sink_blocks: u64,
    /// ONNX Runtime's own memory for the session(s), measured at commit and booked to
    /// the reserve role now (`RuntimeHeld`; see
    /// [`OrtAllocatorConfig::charge_runtime_memory`](crate::OrtAllocatorConfig::charge_runtime_memory)).
    /// Not part of `in_use`: no block of the adapter holds it.
    pub runtime_held: u64,
    /// Trims of the allocator's cache: after the first run of a new input shape, and
    /// ONNX Runtime's `Shrink` (`NumTrims`).
    pub trims: u64,
    /// Bytes those trims returned to the cache's source (`TrimmedBytes`).
    pub trimmed_bytes: u64,
    /// Commits and trims after which the C library handed free heap pages back to the
    /// operating system (`NumHeapReturns`; see
    /// [`OrtAllocatorConfig::return_free_heap_pages`](crate::OrtAllocatorConfig::return_free_heap_pages)).
    pub heap_returns: u64,
}

impl OrtAllocatorStats {
    /// The figures as ONNX Runtime's `GetStats` key/value pairs.
    pub fn key_values(&self) -> [(&'static str, u64); 19] {
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
            ("OverdraftInUse", self.overdraft_in_use),
            ("NumSinkBlocks", self.sink_blocks),
            ("RuntimeHeld", self.runtime_held),
            ("NumTrims", self.trims),
            ("TrimmedBytes", self.trimmed_bytes),
            ("NumHeapReturns", self.heap_returns),
        ]
    }
}

/// The figures of an adapter, or of one session's table.
#[derive(Default)]
pub(crate) struct Counters {
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
    overdraft_in_use: AtomicU64,
    sink_blocks: AtomicU64,
    runtime_held: AtomicU64,
    trims: AtomicU64,
    trimmed_bytes: AtomicU64,
    heap_returns: AtomicU64,
}

/// Raises a high-water mark to `value`: a plain load first, so the common case (no new
/// high) makes no read-modify-write (`fetch_max` is a compare-and-swap loop even when
/// nothing changes).
#[inline(always)]
fn raise_to(mark: &AtomicU64, value: u64) {
    if mark.load(Ordering::Relaxed) < value {
        mark.fetch_max(value, Ordering::Relaxed);
    }
}

impl Counters {
    fn allocated(&self, kind: RequestKind, bytes: u64) {
        match kind {
            RequestKind::Alloc => self.allocs.fetch_add(1, Ordering::Relaxed),
            RequestKind::Reserve => self.reserves.fetch_add(1, Ordering::Relaxed),
        };
        self.total_allocated.fetch_add(bytes, Ordering::Relaxed);
        let now = self.in_use.fetch_add(bytes, Ordering::Relaxed) + bytes;
        raise_to(&self.peak_in_use, now);
        raise_to(&self.max_alloc_size, bytes);
    }

    fn freed(&self, bytes: u64) {
        self.in_use.fetch_sub(bytes, Ordering::Relaxed);
        self.frees.fetch_add(1, Ordering::Relaxed);
    }

    fn overdrawn(&self, bytes: u64) {
        self.overdraft_blocks.fetch_add(1, Ordering::Relaxed);
        self.overdraft_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.overdraft_in_use.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn stats(&self, limit: u64) -> OrtAllocatorStats {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        OrtAllocatorStats {
            limit,
            in_use: load(&self.in_use),
            total_allocated: load(&self.total_allocated),
            peak_in_use: load(&self.peak_in_use),
            allocs: load(&self.allocs),
            reserves: load(&self.reserves),
            frees: load(&self.frees),
            max_alloc_size: load(&self.max_alloc_size),
            refusals: load(&self.refusals),
            frees_after_loss: load(&self.frees_after_loss),
            unknown_frees: load(&self.unknown_frees),
            overdraft_blocks: load(&self.overdraft_blocks),
            overdraft_bytes: load(&self.overdraft_bytes),
            overdraft_in_use: load(&self.overdraft_in_use),
            sink_blocks: load(&self.sink_blocks),
            runtime_held: load(&self.runtime_held),
            trims: load(&self.trims),
            trimmed_bytes: load(&self.trimmed_bytes),
            heap_returns: load(&self.heap_returns),
        }
    }
}

/// Bumps the same figure of the adapter and of the calling table.
fn both(adapter: &Counters, caller: &Counters, bump: impl Fn(&Counters)) {
    bump(adapter);
    bump(caller);
}

/// One block ONNX Runtime holds.
enum Block {
    /// Governed: registry identity, charged by the governor.
    Governed(BoundAllocation),
    /// Served from the overdraft after a refusal (booked by the governor as such);
    /// freed back to the host.
    Overdraft { bytes: usize, _draw: OverdraftDraw },
    /// Served from the scratch sink after a refusal past the overdraft limit.
    Sink { bytes: usize },
}

/// A block ONNX Runtime holds, and the table that handed it out (its address: the
/// block holds a count of that table's core, given back when it is freed).
struct Record {
    block: Block,
    origin: usize,
}

/// The governed blocks of one adapter (shared by every session's table).
pub(crate) struct GovernedBlocks {
    binding: MemoryBinding,
    account: Option<Account>,
    config: OrtAllocatorConfig,
    alignment: usize,
    release: ReleasePath,
    /// Live blocks by address. Hashed with foldhash's fast hasher rather than the
    /// standard library's SipHash: the keys are addresses ONNX Runtime hands back, not
    /// input an attacker chooses to collide, and SipHash was half the map's cost on the
    /// allocate + free path (about 440 instructions of a pair, callgrind on Silero VAD).
    live: DashMap<usize, Record, foldhash::fast::RandomState>,
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
            live: DashMap::with_hasher(foldhash::fast::RandomState::default()),
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

    /// Allocates `size` bytes for `kind` on behalf of `caller` (the table it came
    /// through), charged to its role: `Reserve`, and `Alloc` while the session is being
    /// committed (prepacked weights), to the reserve role; other `Alloc` calls to the
    /// alloc role. A refusal is recorded in `caller` and answered by its phase (see
    /// [`GovernedBlocks::refused`]). The
    /// reason is logged and kept for [`GovernedBlocks::last_refusal`]. A zero-byte
    /// request gets `None` without a refusal, as ONNX Runtime's own allocator answers it.
    pub(crate) fn allocate(&self, caller: &Caller, origin: usize, size: usize, kind: RequestKind) -> Option<usize> {
        if size == 0 {
            return None;
        }
        let phase = caller.phase();
        let session_long = kind == RequestKind::Reserve || phase == Phase::Committing;
        let role = if session_long { self.config.role_of_reserve() } else { self.config.role_of_alloc() };
        let allocate = || {
            AllocationRequest::new(size, self.alignment)
                .map_err(|err| err.to_string())
                .and_then(|request| self.binding.allocate(request.with_role(role)).map_err(|err| err.to_string()))
        };
        // A commit's allocation may call reclaim holders that wait: a release on another
        // thread must be able to tell (see `environment::release`).
        let granted =
            if phase == Phase::Committing { crate::environment::commit_allocation(allocate) } else { allocate() };
        let block = match granted {
            Ok(block) => block,
            Err(reason) => return self.refused(caller, origin, phase, size, role, &reason),
        };
        let address = block.address().get() as usize;
        let bytes = block.bytes() as u64;
        match self.live.entry(address) {
            Entry::Vacant(slot) => {
                slot.insert(Record { block: Block::Governed(block), origin });
            }
            Entry::Occupied(_) => {
                // The allocator handed out an address ONNX Runtime still holds: never
                // give it out twice. The new handle goes back through the binding.
                tracing::error!(address, "allocator returned a live address again; refusing the block");
                if let Err(rejected) = self.binding.release(block) {
                    tracing::error!(reason = %rejected.reason, "the duplicate block could not be released");
                }
                let reason = self.refuse(caller, size, role, "the allocator returned an address that is still in use");
                caller.refused(&reason);
                return None;
            }
        }
        both(&self.counters, &caller.counters, |counters| counters.allocated(kind, bytes));
        tracing::trace!(address, bytes, ?kind, "ort block allocated");
        Some(address)
    }

    /// Answers a refused request. ONNX Runtime does not check every pointer an
    /// allocator returns (its own allocators throw instead, which a C allocator cannot):
    /// a run's tensors do not, nor do some of a commit's buffers (prepacked weights are
    /// written at once), nor a tensor that safe code makes through a session's table
    /// (`ort::memory::Allocator::new(session, ..)` then `Tensor::new`). So, with
    /// [`RefusalAnswer::OverdraftAndStop`] (host memory):
    /// - committing or running: the refusal is recorded (a run's terminate flag is set,
    ///   so it stops at the next kernel boundary; a commit fails with the reason once
    ///   ONNX Runtime returns) and the block is served from the overdraft, past its limit
    ///   from the scratch sink;
    /// - idle, through a session's table: from the overdraft, booked as such; past its
    ///   limit, null (the sink's aliased memory must never back a tensor that lives on);
    /// - idle, through the handle's own table: null (its pointer's callers must check).
    ///
    /// With [`RefusalAnswer::Null`] (device memory), null in every phase.
    fn refused(
        &self,
        caller: &Caller,
        origin: usize,
        phase: Phase,
        size: usize,
        role: MemoryRole,
        reason: &str,
    ) -> Option<usize> {
        let reason = self.refuse(caller, size, role, reason);
        if phase != Phase::Idle {
            caller.refused(&reason);
        }
        match (self.refusal_answer, phase) {
            (RefusalAnswer::Null, _) => None,
            (RefusalAnswer::OverdraftAndStop, Phase::Committing | Phase::Running) => {
                self.overdraft(caller, origin, size, true)
            }
            (RefusalAnswer::OverdraftAndStop, Phase::Idle) if caller.is_session() => {
                let served = self.overdraft(caller, origin, size, false);
                if served.is_none() {
                    tracing::error!(
                        bytes = size,
                        "refused outside a commit or run of a governed session and past the overdraft limit: \
                         answered null"
                    );
                }
                served
            }
            (RefusalAnswer::OverdraftAndStop, Phase::Idle) => {
                tracing::error!(
                    bytes = size,
                    "refused through the handle's own table: answered null (nothing can be stopped)"
                );
                None
            }
        }
    }

    /// Serves a refused block: from the governor's overdraft, or past its limit (or
    /// without an account to book it to) from the scratch sink when `sink` (the block's
    /// commit or run is failing, so its contents are discarded).
    fn overdraft(&self, caller: &Caller, origin: usize, size: usize, sink: bool) -> Option<usize> {
        let draw = self.account.as_ref().map(|account| account.draw_overdraft(size as u64));
        let draw = match draw {
            Some(Ok(draw)) => match crate::ffi::overdraft_allocate(size, self.alignment) {
                Some(address) => {
                    self.live.insert(address, Record { block: Block::Overdraft { bytes: size, _draw: draw }, origin });
                    both(&self.counters, &caller.counters, |counters| counters.overdrawn(size as u64));
                    tracing::warn!(bytes = size, "refused block served from the overdraft");
                    return Some(address);
                }
                // The host could not give the overdraft: the draw goes back, the sink serves.
                None => None,
            },
            other => other,
        };
        if !sink {
            return None;
        }
        let address = crate::sink::allocate(size, self.alignment)?;
        self.live.insert(address, Record { block: Block::Sink { bytes: size }, origin });
        both(&self.counters, &caller.counters, |counters| {
            counters.sink_blocks.fetch_add(1, Ordering::Relaxed);
        });
        match draw {
            Some(Err(refused)) => tracing::warn!(
                bytes = size, %refused,
                "refused block past the overdraft limit served from the scratch sink; its commit or run is failing"
            ),
            _ => tracing::warn!(
                bytes = size,
                "refused block (no account to book an overdraft to, or no host memory for it) served from the \
                 scratch sink; its commit or run is failing"
            ),
        }
        Some(address)
    }

    /// Frees the block at `address` through the binding it came from. `caller` is the
    /// table the free came through, `caller_of` finds the table that handed the block
    /// out (whose figures it is counted in); the answer names that table's address, whose
    /// count the block held.
    pub(crate) fn free<'c>(
        &self,
        caller: &Caller,
        address: usize,
        caller_of: impl FnOnce(usize) -> &'c Caller,
    ) -> (Freed, usize) {
        let Some((_, Record { block, origin })) = self.live.remove(&address) else {
            both(&self.counters, &caller.counters, |counters| {
                counters.unknown_frees.fetch_add(1, Ordering::Relaxed);
            });
            tracing::error!(address, "onnx runtime freed a pointer this allocator never handed out; ignored");
            return (Freed::Unknown, 0);
        };
        let caller = caller_of(origin);
        (self.free_block(caller, address, block), origin)
    }

    fn free_block(&self, caller: &Caller, address: usize, block: Block) -> Freed {
        let block = match block {
            Block::Governed(block) => block,
            Block::Overdraft { bytes, _draw } => {
                crate::ffi::overdraft_free(address, bytes, self.alignment);
                both(&self.counters, &caller.counters, |counters| {
                    counters.overdraft_in_use.fetch_sub(bytes as u64, Ordering::Relaxed);
                });
                // `_draw` drops here: the governor's overdraft books give the bytes back.
                return Freed::Released;
            }
            Block::Sink { bytes } => {
                crate::sink::free(address, bytes);
                return Freed::Released;
            }
        };
        let bytes = block.bytes() as u64;
        both(&self.counters, &caller.counters, |counters| counters.freed(bytes));
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
                    both(&self.counters, &caller.counters, |counters| {
                        counters.frees_after_loss.fetch_add(1, Ordering::Relaxed);
                    });
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

    fn refuse(&self, caller: &Caller, size: usize, role: MemoryRole, reason: &str) -> String {
        both(&self.counters, &caller.counters, |counters| {
            counters.refusals.fetch_add(1, Ordering::Relaxed);
        });
        tracing::warn!(bytes = size, %role, device = %self.binding.device(), reason, "ort allocation refused");
        let message = format!("{size} bytes of {role} on {}: {reason}", self.binding.device());
        *self.last_refusal.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(message.clone());
        message
    }

    /// Books `bytes` of ONNX Runtime's own memory for the session behind `caller` (see
    /// [`OrtAllocatorConfig::charge_runtime_memory`]) to the reserve role: a lease the
    /// session's table keeps for as long as ONNX Runtime keeps the session. `None` when
    /// there is nothing to book: no bytes, no account, or a binding that is not host
    /// memory (the measure is of the host heap).
    ///
    /// # Errors
    /// The governor's refusal, recorded like a refused block's (counted, logged, kept for
    /// [`GovernedBlocks::last_refusal`]).
    pub(crate) fn book_runtime(&self, caller: &Caller, bytes: u64) -> Result<Option<OwnedLease>, String> {
        let Some(account) = self.account.as_ref() else {
            tracing::debug!(bytes, "no account to book onnx runtime's own memory to");
            return Ok(None);
        };
        if bytes == 0 || self.binding.device().tier() != Tier::Host {
            return Ok(None);
        }
        let role = self.config.role_of_reserve();
        let lease = account.lease_owned(role, bytes).map_err(|refused| {
            let size = usize::try_from(bytes).unwrap_or(usize::MAX);
            self.refuse(caller, size, role, &format!("onnx runtime's own memory for the session: {refused}"))
        })?;
        both(&self.counters, &caller.counters, |counters| {
            counters.runtime_held.fetch_add(bytes, Ordering::Relaxed);
        });
        tracing::debug!(bytes, %role, "onnx runtime's own memory for the session booked");
        Ok(Some(lease))
    }

    /// The booking of [`GovernedBlocks::book_runtime`] went back (its session's table is
    /// gone).
    pub(crate) fn runtime_released(&self, bytes: u64) {
        self.counters.runtime_held.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// The reason of the latest refusal.
    pub(crate) fn last_refusal(&self) -> Option<String> {
        self.last_refusal.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Blocks ONNX Runtime holds now.
    pub(crate) fn live_blocks(&self) -> usize {
        self.live.len()
    }

    /// Returns cached memory of the binding's allocator to its source; the bytes
    /// returned. Counted in the adapter's figures and the calling table's.
    pub(crate) fn trim(&self, caller: &Counters) -> usize {
        let trimmed = self.binding.allocator().trim();
        both(&self.counters, caller, |counters| {
            counters.trims.fetch_add(1, Ordering::Relaxed);
            counters.trimmed_bytes.fetch_add(trimmed as u64, Ordering::Relaxed);
        });
        trimmed
    }

    /// [`GovernedBlocks::trim`] measured as the adapter's own work, then the C heap's
    /// free pages returned outside the measure: what a new shape's trim and ONNX
    /// Runtime's `Shrink` do. The bytes the cache returned.
    pub(crate) fn trim_and_return_heap_pages(&self, caller: &Counters) -> usize {
        let trimmed = crate::heap::own_work(|| self.trim(caller));
        self.return_heap_pages(caller);
        trimmed
    }

    /// Hands the C heap's free pages back to the operating system, as configured
    /// ([`OrtAllocatorConfig::return_free_heap_pages`]): after a trim and after a commit
    /// (ONNX Runtime has freed what it loaded the model with). Counted when the C library
    /// gave some back.
    ///
    /// Never inside [`crate::heap::own_work`]: it changes no byte in use, so it needs no
    /// measure, and it takes milliseconds, during which the measure would take a
    /// concurrent commit's own growth (another thread's) for the adapter's and book that
    /// commit next to nothing of ONNX Runtime's memory (PP-OCRv4 recognition's commit
    /// booked 0 of its runtime memory while another session trimmed).
    pub(crate) fn return_heap_pages(&self, caller: &Counters) {
        if self.config.returns_free_heap_pages() && crate::heap::return_free_pages() {
            both(&self.counters, caller, |counters| _ = counters.heap_returns.fetch_add(1, Ordering::Relaxed));
        }
    }

    /// The quota `GetStats` reports as the limit.
    pub(crate) fn limit(&self) -> u64 {
        self.account.as_ref().and_then(Account::quota).unwrap_or(0)
    }

    /// The adapter's figures, over every table.
    pub(crate) fn stats(&self) -> OrtAllocatorStats {
        self.counters.stats(self.limit())
    }
}
