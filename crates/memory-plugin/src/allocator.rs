//! `PluginAllocator`: a plugin's allocator instance as a `DeviceAllocator`, with every
//! answer checked before it is believed.

#![allow(
    clippy::disallowed_types,
    reason = "loom models only the block records (src/records.rs, all from memory-sync); the locks and counters here keep the loader's own bookkeeping outside every model"
)]

use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, BackendError, DeviceAddress, DeviceAllocator, DeviceKey, MaybeBytes,
    RawAllocation, ReleaseError, ReleaseOutcome, SharedMapping, VirtualBacking,
};
use memory_plugin_abi::{
    MP_ABI_MAJOR, MP_CAP_DEFERRED_RELEASE, MP_CAP_SHARED_MAPPING, MP_CAP_STRUCTURED_RELEASE, MP_CAP_VIRTUAL_BACKING,
    MP_ERR_DEVICE_LOST, MP_ERR_NOT_OWNED, MP_ERR_OUT_OF_MEMORY, MP_ERR_UNSUPPORTED, MP_OK, MP_RELEASE_COMPLETE,
    MP_RELEASE_FAILED, MP_RELEASE_QUARANTINED, MpAllocator, MpBlock, MpDevice, MpReleaseOutcome, MpRequest, MpStats,
    MpStatus, MpTally, status_name,
};

use crate::error::{PluginError, StatusCode};
use crate::library::LoadedLibrary;
use crate::negotiate::{InstanceOrigin, Negotiated, abi_device, negotiate};
use crate::queue::PluginReleaseQueue;
use crate::ranges::{LiveRanges, Span};
use crate::records::{Records, TakenRecord};
use crate::tally::{HostTally, PluginTally, SuspectRetry};

/// The backend name in every `BackendError` a plugin causes.
pub const BACKEND: &str = "plugin";

/// Instances that hold suspect blocks, kept from being destroyed (and their libraries
/// from being unmapped) until every suspect block is discharged: the plugin may still
/// own those blocks, so its instance must not go while the host holds them. A static,
/// so a kept instance stays reachable (valgrind counts it "still reachable", not lost)
/// after every handle to it is gone.
static KEPT: Mutex<Vec<Arc<Instance>>> = Mutex::new(Vec::new());

/// A block the host keeps as suspect: never freed by the host, never handed out.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Suspect {
    pub(crate) block: MpBlock,
    /// It overlapped a live block when it was answered: it is handed back only once it
    /// overlaps none (releasing it could free the live block's memory).
    pub(crate) aliases: bool,
}

/// What the plugin did with a block handed back to its `release`.
enum HandedBack {
    /// It took the block back (`MP_OK`, and a complete outcome about that block).
    TakenBack,
    /// It says it holds no such block (`MP_ERR_NOT_OWNED`).
    NotOwned,
    /// Anything else: the block may still be the plugin's.
    Kept,
}

/// One instance of a plugin allocator, shared by every handle made through it.
pub(crate) struct Instance {
    pub(crate) table: MpAllocator,
    pub(crate) minor: u16,
    pub(crate) name: String,
    pub(crate) device: DeviceKey,
    pub(crate) abi_device: MpDevice,
    pub(crate) records: Records,
    /// The address ranges of the live blocks, so an overlapping block is refused.
    pub(crate) ranges: LiveRanges,
    pub(crate) backings: AtomicUsize,
    pub(crate) queued: AtomicUsize,
    /// Blocks answered with an unknown status, that overlap a live block, or that could
    /// not be handed back: never freed, never forgotten (quarantine). While there are
    /// any, the instance is in [`KEPT`]: never destroyed.
    pub(crate) suspects: Mutex<Vec<Suspect>>,
    /// Serialises suspect retries, so no suspect block is handed back twice.
    pub(crate) retrying: Mutex<()>,
    /// This instance, for handles made through it (shared backings).
    pub(crate) me: Weak<Instance>,
    /// Declared last: the library stays mapped until `destroy` (in `Drop`) returned.
    pub(crate) library: Option<Arc<LoadedLibrary>>,
}

// SAFETY: the table holds raw pointers (the plugin's instance and name) and function
// pointers. The ABI requires every slot to be callable from any thread, concurrently,
// with the instance pointer, until `destroy`; the name was copied at negotiation and
// the pointer is never read again. Nothing else in `Instance` is thread-bound.
unsafe impl Send for Instance {}
// SAFETY: as for `Send`: shared access only calls thread-safe slots.
unsafe impl Sync for Instance {}

impl Drop for Instance {
    fn drop(&mut self) {
        // Unreachable while suspects remain (the instance is kept), so this is only a
        // guard against a future path that forgets to keep it.
        let suspects = self.suspects.get_mut().unwrap_or_else(PoisonError::into_inner).len();
        if suspects != 0 {
            tracing::error!(plugin = %self.name, suspects, "plugin instance dropped with suspect blocks; not destroyed");
            return;
        }
        if let Some(destroy) = self.table.destroy {
            tracing::info!(plugin = %self.name, "plugin allocator instance destroyed");
            // SAFETY: the slot was checked non-null at negotiation; this is the last
            // reference to the instance, so every other call has returned, and
            // `library` (dropped after this) keeps the code mapped.
            unsafe { destroy(self.table.instance) };
        }
    }
}

impl Instance {
    pub(crate) fn ptr(&self) -> *mut c_void {
        self.table.instance
    }

    pub(crate) fn has(&self, capability: u64) -> bool {
        self.table.capabilities & capability != 0
    }

    pub(crate) fn unsupported(&self, what: &'static str) -> PluginError {
        PluginError::Unsupported { plugin: self.name.clone(), what, major: MP_ABI_MAJOR, minor: self.minor }
    }

    pub(crate) fn call_error(&self, operation: &'static str, status: MpStatus, detail: String) -> PluginError {
        PluginError::Call { plugin: self.name.clone(), operation, status: StatusCode(status), detail }
    }

    pub(crate) fn backend(&self, operation: &'static str, status: MpStatus, detail: &str) -> BackendError {
        let status_text = StatusCode(status);
        BackendError {
            backend: BACKEND,
            operation,
            code: i64::from(status),
            detail: format!("{}: {status_text}{detail}", self.name),
        }
    }

    /// The block as the registry sees it, named by a fresh record (when it overlaps no
    /// live block); otherwise why this host cannot take it. Always inlined, like
    /// `Records::take`: its answer, returned through memory and read back with wider
    /// loads, stalled store forwarding.
    #[inline(always)]
    fn raw(&self, block: &MpBlock) -> Result<RawAllocation, Unrecorded> {
        let too_large = Unrecorded::Unfit("; the block does not fit this host");
        let address = DeviceAddress::new(block.address).ok_or(too_large)?;
        let bytes = usize::try_from(block.bytes).map_err(|_| too_large)?;
        let align = usize::try_from(block.align).ok().filter(|a| a.is_power_of_two()).ok_or(too_large)?;
        let tag =
            self.ranges.admit(block, &self.records, || self.records.insert_ref(block)).map_err(Unrecorded::Aliases)?;
        let tag = tag.ok_or(Unrecorded::Unfit(
            "; the loader cannot record another block from this thread (it records at most 2^24 - 32 live blocks \
             per thread): release some, or allocate from more threads",
        ))?;
        Ok(RawAllocation::new(address, bytes, align, self.device, tag))
    }

    /// Keeps `block` as suspect: never freed, never handed out, and the instance kept
    /// (never destroyed) until every suspect is discharged.
    fn suspect(&self, block: MpBlock, aliases: bool, why: &str) {
        tracing::error!(
            plugin = %self.name,
            address = format_args!("{:#x}", block.address),
            bytes = block.bytes,
            why,
            "plugin block kept as suspect by the loader (never freed; the instance is kept until it is discharged)"
        );
        let mut suspects = lock(&self.suspects);
        if suspects.is_empty() {
            // The caller holds the instance (it is allocating through it), so it upgrades.
            if let Some(me) = self.me.upgrade() {
                lock(&KEPT).push(me);
            }
        }
        suspects.push(Suspect { block, aliases });
    }

    /// Hands `block` (one `allocate` wrote) to the plugin's `release`.
    fn hand_back(&self, block: &MpBlock) -> HandedBack {
        let mut out = MpReleaseOutcome::default();
        let Some(release) = self.table.release else { return HandedBack::Kept };
        // SAFETY: `release` was checked non-null; `block` is exactly what `allocate`
        // wrote, so the plugin issued it (or answers MP_ERR_NOT_OWNED); both pointers are
        // to live locals.
        let status = unsafe { release(self.ptr(), block, &mut out) };
        let structured = self.has(MP_CAP_STRUCTURED_RELEASE);
        if status == MP_OK && (!structured || (out.kind == MP_RELEASE_COMPLETE && out.block == *block)) {
            HandedBack::TakenBack
        } else if status == MP_ERR_NOT_OWNED {
            HandedBack::NotOwned
        } else {
            HandedBack::Kept
        }
    }

    /// Hands an unusable fresh block straight back; keeps it as suspect when the
    /// plugin does not take it back cleanly. Whether it was taken back.
    fn give_back(&self, block: MpBlock, why: &str) -> bool {
        let taken = matches!(self.hand_back(&block), HandedBack::TakenBack);
        if !taken {
            self.suspect(block, false, why);
        }
        taken
    }

    /// Hands every suspect block back to the plugin's `release` (an overlapping one
    /// only once it overlaps no live block): one the plugin takes back, or says it does
    /// not hold, is discharged. When none is left the instance is no longer kept.
    pub(crate) fn retry_suspects(&self) -> SuspectRetry {
        let _one_retry = lock(&self.retrying);
        let pending = lock(&self.suspects).clone();
        let mut discharged = Vec::new();
        for suspect in &pending {
            if suspect.aliases && self.ranges.overlaps_live(&suspect.block, &self.records).is_some() {
                continue;
            }
            match self.hand_back(&suspect.block) {
                HandedBack::TakenBack | HandedBack::NotOwned => discharged.push(*suspect),
                HandedBack::Kept => {}
            }
        }
        let mut suspects = lock(&self.suspects);
        for gone in &discharged {
            if let Some(at) = suspects.iter().position(|suspect| suspect == gone) {
                suspects.swap_remove(at);
            }
        }
        let still_suspect = suspects.len();
        let released = if still_suspect == 0 && !discharged.is_empty() {
            let mut kept = lock(&KEPT);
            kept.iter().position(|kept| std::ptr::eq(Arc::as_ptr(kept), self)).map(|at| kept.swap_remove(at))
        } else {
            None
        };
        drop(suspects);
        tracing::info!(plugin = %self.name, discharged = discharged.len(), still_suspect, "suspect blocks retried");
        // The kept reference goes with no lock held; the caller's own keeps the instance.
        drop(released);
        SuspectRetry { discharged: discharged.len(), still_suspect }
    }

    fn suspect_count(&self) -> usize {
        lock(&self.suspects).len()
    }
}

/// Why a fresh block could not be recorded.
#[derive(Copy, Clone, Debug)]
enum Unrecorded {
    /// It does not fit this host, or this thread's records are full: handed back.
    Unfit(&'static str),
    /// It overlaps this live block: kept as suspect.
    Aliases(Span),
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The loader's bookkeeping stays valid whatever a panic interrupted.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A plugin's allocator instance as a [`DeviceAllocator`]. Register it like any other
/// allocator. Cheap to clone; clones share the instance.
///
/// Every block it hands out is recorded on the host side, so a forged, foreign or
/// already released block is refused (`NotOwned`) without calling the plugin. Every
/// answer is checked: a block on another device, misaligned, too small, at address
/// zero or running past the end of the address space is handed back and the allocation fails; a block overlapping a live block of the
/// instance is refused and kept as suspect, as is one answered with an unknown status;
/// a release outcome about another block, of an unknown kind or with an unknown status
/// is a quarantine of the whole block.
///
/// The instance (and, for a loaded plugin, its library) lives while any clone, any
/// registry mechanism, binding, allocation or queued release holding it, any shared
/// backing or release queue made through it lives, and while it keeps a suspect block
/// (until [`PluginAllocator::retry_suspects`] discharges it).
#[derive(Clone)]
pub struct PluginAllocator {
    pub(crate) shared: Arc<Instance>,
}

impl PluginAllocator {
    /// Wraps an allocator table that is not in a loaded library (a C runtime's own
    /// vtable). `offered` are the capabilities the host lets it claim. The table is
    /// negotiated like a plugin's: major must match, the minor's prefix must fit.
    ///
    /// # Errors
    /// As for a plugin's table (see [`PluginError`]). On every error nothing of the
    /// table was called: the instance is still the caller's. On success it belongs to
    /// the returned allocator, which calls `destroy` once, when its last clone drops
    /// (or never, if [`PluginAllocator::relinquish`] hands it back, or while it keeps a
    /// suspect block).
    ///
    /// # Safety
    /// `table` is null or points to a readable, aligned [`MpAllocator`] of at least the
    /// `struct_size` its header claims (at least the header), whose `name` is null or
    /// NUL-terminated, whose slots obey the ABI in `docs/C-ABI.md` (memory-safe,
    /// thread-safe), and whose code stays callable until `destroy` has returned.
    pub unsafe fn from_table(table: *const MpAllocator, offered: u64) -> Result<PluginAllocator, PluginError> {
        // SAFETY: forwarded from the caller.
        let negotiated = unsafe { negotiate(table, offered, "C vtable", InstanceOrigin::Caller) }?;
        Ok(PluginAllocator::new(negotiated, None))
    }

    pub(crate) fn new(negotiated: Negotiated, library: Option<Arc<LoadedLibrary>>) -> PluginAllocator {
        let Negotiated { table, minor, name, device } = negotiated;
        tracing::info!(plugin = %name, %device, minor, capabilities = table.capabilities, "plugin allocator instance created");
        PluginAllocator {
            shared: Arc::new_cyclic(|me| Instance {
                table,
                minor,
                abi_device: abi_device(device),
                name,
                device,
                records: Records::new(),
                ranges: LiveRanges::new(),
                backings: AtomicUsize::new(0),
                queued: AtomicUsize::new(0),
                suspects: Mutex::new(Vec::new()),
                retrying: Mutex::new(()),
                me: me.clone(),
                library,
            }),
        }
    }

    /// Hands a caller's instance (one from [`PluginAllocator::from_table`]) back
    /// without calling `destroy`: for a host that took a table, then failed to register
    /// it, and must leave the caller's instance as it found it. Only the last clone of
    /// an instance that holds no block can; otherwise the allocator comes back
    /// unchanged. An instance a plugin library made is never handed back.
    ///
    /// # Errors
    /// The allocator itself, when another clone is alive, a block is live or kept as
    /// suspect, or the instance came from a library.
    pub fn relinquish(self) -> Result<(), PluginAllocator> {
        let shared = self.shared;
        if shared.library.is_some() {
            return Err(PluginAllocator { shared });
        }
        // The last clone first, then the count: no other clone can record a block after.
        let mut instance = Arc::try_unwrap(shared).map_err(|shared| PluginAllocator { shared })?;
        if instance.records.count().0 != 0 {
            // Still the only handle: wrap it again, its self-reference renewed.
            return Err(PluginAllocator {
                shared: Arc::new_cyclic(|me| {
                    instance.me = me.clone();
                    instance
                }),
            });
        }
        // No `destroy`: the instance goes back to its caller untouched.
        instance.table.destroy = None;
        tracing::info!(plugin = %instance.name, "plugin allocator instance handed back to its caller");
        Ok(())
    }

    /// The ABI minor version both sides agreed on.
    pub fn abi_minor(&self) -> u16 {
        self.shared.minor
    }

    /// The capabilities the plugin claimed (and the host offered): `MP_CAP_*` bits.
    pub fn capabilities(&self) -> u64 {
        self.shared.table.capabilities
    }

    /// What the host holds through this instance.
    pub fn host_tally(&self) -> HostTally {
        let (allocations, bytes) = self.shared.records.count();
        HostTally {
            instances: 1,
            allocations,
            bytes,
            backings: self.shared.backings.load(Ordering::Acquire),
            queued_releases: self.shared.queued.load(Ordering::Acquire),
            suspect_blocks: self.shared.suspect_count(),
            other_pins: 0,
        }
    }

    /// Hands every block this instance keeps as suspect back to the plugin's `release`:
    /// a block the plugin takes back (`MP_OK`, a complete outcome) or says it does not
    /// hold (`MP_ERR_NOT_OWNED`) is discharged; any other answer keeps it. A block that
    /// overlapped a live block is handed back only once no live block overlaps it. Once
    /// none is left, the instance is no longer kept: it is destroyed when its last handle
    /// goes, and its library can unload. Retries of one instance run one at a time.
    ///
    /// Suspect blocks are never discharged otherwise: an instance that holds one is
    /// never destroyed, and its library never unmapped, for the life of the process.
    pub fn retry_suspects(&self) -> SuspectRetry {
        self.shared.retry_suspects()
    }

    /// What the plugin says this instance holds.
    ///
    /// # Errors
    /// [`PluginError::Unsupported`] when the `tally` slot is null; [`PluginError::Call`]
    /// when it fails.
    pub fn tally(&self) -> Result<PluginTally, PluginError> {
        let shared = &self.shared;
        let tally = shared.table.tally.ok_or_else(|| shared.unsupported("tally"))?;
        let mut out = MpTally::default();
        // SAFETY: non-null slot; `out` is a live local.
        let status = unsafe { tally(shared.ptr(), &mut out) };
        if status != MP_OK {
            return Err(shared.call_error("tally", status, String::new()));
        }
        Ok(out.into())
    }

    /// The plugin's counters.
    ///
    /// # Errors
    /// [`PluginError::Unsupported`] when the `stats` slot is null; [`PluginError::Call`]
    /// when it fails.
    pub fn try_stats(&self) -> Result<AllocatorStats, PluginError> {
        let shared = &self.shared;
        let stats = shared.table.stats.ok_or_else(|| shared.unsupported("stats"))?;
        let mut out = MpStats::default();
        // SAFETY: non-null slot; `out` is a live local.
        let status = unsafe { stats(shared.ptr(), &mut out) };
        if status != MP_OK {
            return Err(shared.call_error("stats", status, String::new()));
        }
        Ok(AllocatorStats {
            live_bytes: out.live_bytes,
            live_allocations: out.live_allocations,
            cached_bytes: out.cached_bytes,
            // The plugin ABI does not report it.
            largest_free_bytes: 0,
            reserved_bytes: out.reserved_bytes,
            allocations_total: out.allocations_total,
            failures_total: out.failures_total,
        })
    }

    /// Asks the plugin to return cached memory; the bytes returned.
    ///
    /// # Errors
    /// [`PluginError::Unsupported`] when the `trim` slot is null; [`PluginError::Call`]
    /// when it fails.
    pub fn try_trim(&self) -> Result<usize, PluginError> {
        let shared = &self.shared;
        let trim = shared.table.trim.ok_or_else(|| shared.unsupported("trim"))?;
        let mut returned = 0u64;
        // SAFETY: non-null slot; `returned` is a live local.
        let status = unsafe { trim(shared.ptr(), &mut returned) };
        if status != MP_OK {
            return Err(shared.call_error("trim", status, String::new()));
        }
        Ok(usize::try_from(returned).unwrap_or(usize::MAX))
    }

    /// A release queue that runs releases once the plugin reports them ready
    /// ([`MP_CAP_DEFERRED_RELEASE`]), holding at most `capacity` pending releases.
    ///
    /// # Errors
    /// [`PluginError::Unsupported`] without the capability.
    pub fn release_queue(&self, capacity: usize) -> Result<PluginReleaseQueue, PluginError> {
        if !self.shared.has(MP_CAP_DEFERRED_RELEASE) {
            return Err(self.shared.unsupported("deferred release (MP_CAP_DEFERRED_RELEASE)"));
        }
        Ok(PluginReleaseQueue::new(Arc::clone(&self.shared), capacity))
    }

    /// Whether two handles share one instance.
    pub fn same_instance(&self, other: &PluginAllocator) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }
}

impl fmt::Debug for PluginAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PluginAllocator")
            .field("name", &self.shared.name)
            .field("device", &self.shared.device)
            .field("abi_minor", &self.shared.minor)
            .field("capabilities", &self.shared.table.capabilities)
            .finish()
    }
}

fn alloc_error(shared: &Instance, request: &AllocationRequest, status: MpStatus, detail: &str) -> AllocError {
    let device = shared.device;
    match status {
        MP_ERR_OUT_OF_MEMORY => AllocError::OutOfMemory {
            device,
            requested: request.bytes(),
            align: request.align(),
            available: MaybeBytes(None),
        },
        MP_ERR_DEVICE_LOST => AllocError::DeviceLost { device, reason: format!("plugin {} reported it", shared.name) },
        MP_ERR_UNSUPPORTED => AllocError::Unsupported {
            allocator: shared.name.clone(),
            device,
            what: "this request (the plugin answered MP_ERR_UNSUPPORTED)",
        },
        _ => AllocError::Backend { device, source: shared.backend("allocate", status, detail) },
    }
}

fn release_error(shared: &Instance, block: &RawAllocation, status: MpStatus) -> ReleaseError {
    match status {
        MP_ERR_NOT_OWNED => ReleaseError::NotOwned {
            allocator: shared.name.clone(),
            device: shared.device,
            address: block.address().get(),
        },
        MP_ERR_DEVICE_LOST => {
            ReleaseError::DeviceLost { device: shared.device, reason: format!("plugin {} reported it", shared.name) }
        }
        _ => ReleaseError::Backend(shared.backend("release", status, "")),
    }
}

/// What happened to a refused block that went back to the plugin.
const HANDED_BACK: &str = "the block was handed back to the plugin's release and nothing was allocated";
/// What happened to a refused block the host keeps.
const SUSPECT: &str = "the host keeps the block as suspect (never freed, never handed out), and with it the plugin \
     instance and its library, which stay loaded until a suspect retry discharges it";

/// `allocate` answered an error status: what the block it may have written becomes.
#[cold]
fn refused_status(shared: &Instance, request: &AllocationRequest, status: MpStatus, block: MpBlock) -> AllocError {
    if status_name(status).is_none() && block.address != 0 {
        // The plugin may or may not own this block: never free it, never trust it.
        shared.suspect(block, false, "allocate answered an unknown status with a block");
        let detail = format!(
            ", and wrote a block of {} bytes at {:#x}; {SUSPECT}; report the plugin's bug (allocate answers \
             MP_OK or an MP_ERR_* status)",
            block.bytes, block.address
        );
        return alloc_error(shared, request, status, &detail);
    }
    alloc_error(shared, request, status, " (nothing was allocated)")
}

/// An ABI device as a message names it (`host:0`, `tier 7:0` for a tier ABI 1 lacks).
fn device_name(device: MpDevice) -> String {
    match crate::negotiate::device_key(device) {
        Some(key) => key.to_string(),
        None => format!("tier {}:{}", device.tier, device.index),
    }
}

/// Which of the rules a block answered with `MP_OK` must meet it breaks, asked vs given.
fn broken_rules(block: &MpBlock, asked: &MpRequest, device: MpDevice) -> Vec<String> {
    let mut broken = Vec::new();
    if block.address == 0 {
        broken.push("its address is 0x0 (a block needs a nonzero address)".to_owned());
    }
    if block.device != device {
        broken.push(format!(
            "it is on {}, but this instance serves {}",
            device_name(block.device),
            device_name(device)
        ));
    }
    if !block.align.is_power_of_two() {
        broken.push(format!("its alignment {} is not a power of two", block.align));
    } else {
        if block.align < asked.align {
            broken.push(format!("its alignment {} is less than the {} asked", block.align, asked.align));
        }
        if block.address != 0 && !block.address.is_multiple_of(block.align) {
            let actual = 1u64 << block.address.trailing_zeros();
            broken.push(format!(
                "its address {:#x} is not a multiple of its alignment {} ({:#x}): it is aligned to {actual} only",
                block.address, block.align, block.align
            ));
        }
    }
    if block.bytes < asked.bytes {
        broken.push(format!("its size {} bytes is less than the {} bytes asked", block.bytes, asked.bytes));
    }
    if !ends_in_address_space(block) {
        broken.push(format!(
            "its {} bytes at {:#x} run past the end of the address space, wrapping around to 0x0..{:#x}",
            block.bytes,
            block.address,
            block.address.wrapping_add(block.bytes)
        ));
    }
    broken
}

/// Whether a block's bytes lie below 2^64: its last byte has an address. A block that
/// ran past the end would wrap around to address 0, and no range check (overlap with a
/// live block, a capability's range) could see what it covers.
#[inline(always)]
fn ends_in_address_space(block: &MpBlock) -> bool {
    block.bytes == 0 || block.address.checked_add(block.bytes - 1).is_some()
}

/// `allocate` answered `MP_OK` with a block that breaks a rule: handed back (or kept).
#[cold]
fn unusable_block(shared: &Instance, request: &AllocationRequest, asked: &MpRequest, block: MpBlock) -> AllocError {
    let broken = broken_rules(&block, asked, shared.abi_device).join("; ");
    let kept = !shared.give_back(block, "an unusable block was not taken back cleanly");
    let detail = format!(
        ", but its block breaks the ABI's rules: asked for {} bytes aligned to {} on {}, it gave {} bytes aligned to \
         {} at {:#x} on {}: {broken}; {}; report the plugin's bug",
        asked.bytes,
        asked.align,
        device_name(shared.abi_device),
        block.bytes,
        block.align,
        block.address,
        device_name(block.device),
        if kept { SUSPECT } else { HANDED_BACK },
    );
    alloc_error(shared, request, MP_OK, &detail)
}

/// `allocate` answered `MP_OK` with a block overlapping a live one: kept as suspect.
#[cold]
fn aliasing_block(shared: &Instance, request: &AllocationRequest, block: MpBlock, live: Span) -> AllocError {
    shared.suspect(block, true, "allocate answered a block that overlaps a live block");
    let end = |address: u64, bytes: u64| address.saturating_add(bytes);
    let detail = format!(
        ", but its block ({} bytes at {:#x}..{:#x}) overlaps a live block it handed out before ({} bytes at \
         {:#x}..{:#x}), and two live allocations must never share memory: the host refused it, and {SUSPECT} (it is \
         not handed back while the live block lives: releasing it could free that block's memory); report the \
         plugin's bug",
        block.bytes,
        block.address,
        end(block.address, block.bytes),
        live.bytes,
        live.address,
        end(live.address, live.bytes),
    );
    alloc_error(shared, request, MP_OK, &detail)
}

/// Statuses that may answer a release with "nothing was mutated".
fn is_known_failure(status: MpStatus) -> bool {
    status != MP_OK && status_name(status).is_some()
}

impl DeviceAllocator for PluginAllocator {
    fn device(&self) -> DeviceKey {
        self.shared.device
    }

    fn name(&self) -> &str {
        &self.shared.name
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let shared = &*self.shared;
        let Some(allocate) = shared.table.allocate else {
            return Err(alloc_error(shared, request, MP_ERR_UNSUPPORTED, ""));
        };
        let abi_request = MpRequest {
            bytes: request.bytes() as u64,
            align: request.align() as u64,
            role: request.role().ordinal() as u32,
            reserved: 0,
        };
        let mut block = MpBlock::default();
        // SAFETY: `allocate` was checked non-null at negotiation; both pointers are to
        // live locals; the instance lives while `self` does.
        let status = unsafe { allocate(shared.ptr(), &abi_request, &mut block) };
        if status != MP_OK {
            return Err(refused_status(shared, request, status, block));
        }
        let fits = block.address != 0
            && block.device == shared.abi_device
            && block.align.is_power_of_two()
            && block.bytes >= abi_request.bytes
            && block.align >= abi_request.align
            && block.address.is_multiple_of(block.align)
            && ends_in_address_space(&block);
        if !fits {
            return Err(unusable_block(shared, request, &abi_request, block));
        }
        match shared.raw(&block) {
            Ok(raw) => {
                tracing::trace!(plugin = %shared.name, bytes = raw.bytes(), "plugin allocate");
                Ok(raw)
            }
            Err(Unrecorded::Unfit(why)) => {
                let kept = !shared.give_back(block, "a block this host cannot record was not taken back cleanly");
                let fate = if kept { SUSPECT } else { HANDED_BACK };
                Err(alloc_error(shared, request, MP_OK, &format!("{why}; {fate}")))
            }
            Err(Unrecorded::Aliases(live)) => Err(aliasing_block(shared, request, block, live)),
        }
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let shared = &*self.shared;
        let Some(taken) = shared.records.take(&allocation, shared.abi_device) else {
            let error = ReleaseError::NotOwned {
                allocator: shared.name.clone(),
                device: shared.device,
                address: allocation.address().get(),
            };
            return ReleaseOutcome::failed(allocation, error);
        };
        let Some(release) = shared.table.release else {
            let error = release_error(shared, &allocation, MP_ERR_UNSUPPORTED);
            return keep(shared, taken, allocation, |raw| ReleaseOutcome::failed(raw, error));
        };
        let record = taken.value();
        let mut out = MpReleaseOutcome::default();
        // SAFETY: `release` was checked non-null at negotiation; `record` is the copy the
        // plugin wrote when it issued the block (taken from our records by this release
        // alone); both pointers are to live locals.
        let status = unsafe { release(shared.ptr(), record, &mut out) };
        let bytes = allocation.bytes();
        if status == MP_OK && !shared.has(MP_CAP_STRUCTURED_RELEASE) {
            // Freed first: nothing that could panic (a tracing subscriber) runs between
            // the plugin's release and the record's.
            taken.free();
            tracing::trace!(plugin = %shared.name, bytes, "plugin release");
            return ReleaseOutcome::complete(bytes);
        }
        if status != MP_OK {
            let error = release_error(shared, &allocation, status);
            return if is_known_failure(status) {
                keep(shared, taken, allocation, |raw| ReleaseOutcome::failed(raw, error))
            } else {
                keep(shared, taken, allocation, |raw| ReleaseOutcome::quarantined(raw, 0, bytes, error))
            };
        }
        let unmapped = usize::try_from(out.unmapped_bytes).unwrap_or(usize::MAX);
        let residual = usize::try_from(out.residual_bytes).unwrap_or(usize::MAX);
        if out.block != *record {
            let detail = format!("; the outcome is about {:?}, not the block given ({record:?})", out.block);
            let error = ReleaseError::Backend(shared.backend("release", status, &detail));
            return keep(shared, taken, allocation, |raw| ReleaseOutcome::quarantined(raw, 0, bytes, error));
        }
        match out.kind {
            MP_RELEASE_COMPLETE => {
                taken.free();
                tracing::trace!(plugin = %shared.name, bytes, "plugin release");
                // A plugin cannot give back more than the block: its claim is held to it.
                // (An overclaiming quarantine is corrected the conservative way, to all
                // still owned, by `ReleaseOutcome::quarantined`.)
                if unmapped > bytes {
                    tracing::warn!(plugin = %shared.name, claimed = unmapped, bytes, "plugin release claimed more than the block");
                }
                ReleaseOutcome::complete(unmapped.min(bytes))
            }
            MP_RELEASE_QUARANTINED => {
                let error =
                    ReleaseError::Backend(shared.backend("release", status, "; the plugin quarantined the block"));
                keep(shared, taken, allocation, |raw| ReleaseOutcome::quarantined(raw, unmapped, residual, error))
            }
            MP_RELEASE_FAILED => {
                let error = ReleaseError::Backend(shared.backend("release", status, "; the plugin released nothing"));
                keep(shared, taken, allocation, |raw| ReleaseOutcome::failed(raw, error))
            }
            kind => {
                let detail = format!("; unknown outcome kind {kind}, treated as quarantine of the whole block");
                let error = ReleaseError::Backend(shared.backend("release", status, &detail));
                keep(shared, taken, allocation, |raw| ReleaseOutcome::quarantined(raw, 0, bytes, error))
            }
        }
    }

    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        // The allocator value itself (forwarding to the instance), so the registry's
        // safe path sees the capability inside the allocator, not split across objects.
        self.shared.has(MP_CAP_VIRTUAL_BACKING).then_some(self as &dyn VirtualBacking)
    }

    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        self.shared.has(MP_CAP_SHARED_MAPPING).then_some(self as &dyn SharedMapping)
    }

    fn stats(&self) -> Option<AllocatorStats> {
        self.try_stats().ok()
    }

    fn trim(&self) -> usize {
        self.try_trim().unwrap_or(0)
    }

    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        let shared = &*self.shared;
        for block in lost {
            let Some(taken) = shared.records.take(&block, shared.abi_device) else {
                tracing::warn!(plugin = %shared.name, ?block, "forget_lost: not a block of this plugin instance");
                continue;
            };
            let record = *taken.value();
            // The host forgets the block whatever the plugin answers.
            taken.free();
            if let Some(forget) = shared.table.forget_lost {
                // SAFETY: non-null slot; `record` is the plugin's own copy, taken once.
                let status = unsafe { forget(shared.ptr(), &record) };
                if status != MP_OK {
                    tracing::warn!(plugin = %shared.name, status = %StatusCode(status), "plugin forget_lost failed");
                }
            }
        }
    }
}

/// The block stays owned: its record is live again under the same tag, and the outcome
/// hands back the allocation exactly as it came.
fn keep(
    shared: &Instance,
    taken: TakenRecord<'_>,
    allocation: RawAllocation,
    outcome: impl FnOnce(RawAllocation) -> ReleaseOutcome,
) -> ReleaseOutcome {
    taken.restore();
    let result = outcome(allocation);
    tracing::warn!(plugin = %shared.name, outcome = %result.summary(), "plugin release did not complete");
    result
}
