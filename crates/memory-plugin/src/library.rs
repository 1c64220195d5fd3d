//! Loading a plugin library, creating instances through its entry point, counting
//! what lives through it, and unloading it only when nothing does.

#![allow(
    clippy::disallowed_types,
    reason = "loom models only the block records (src/records.rs, all from memory-sync); the locks and counters here keep the loader's own bookkeeping outside every model"
)]

use std::collections::BTreeMap;
use std::ffi::{CString, c_char, c_void};
use std::fmt;
use std::mem::ManuallyDrop;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use memory_plugin_abi::{
    MP_ABI_MAJOR, MP_ABI_MINOR, MP_CAP_ALL, MP_ENTRY_SYMBOL, MP_ERR_VERSION_MISMATCH, MP_HOST_SIZE_V1_0, MP_LOG_DEBUG,
    MP_LOG_ERROR, MP_LOG_INFO, MP_LOG_WARN, MP_OK, MP_TALLY_SYMBOL, MpAllocator, MpEntryFn, MpHeader, MpHost, MpTally,
    MpTallyFn,
};

use crate::allocator::{Instance, PluginAllocator};
use crate::error::{PluginError, StatusCode, UnloadRefused};
use crate::negotiate::{InstanceOrigin, negotiate};
use crate::tally::{HostTally, PluginTally, SuspectRetry};

/// The most entry calls one thread tracks as nested (a plugin's entry point asking the
/// host for an instance of another library, whose entry point asks again, ...); deeper
/// ones are not tracked, only never refused.
const MAX_NESTED_ENTRIES: usize = 8;

std::thread_local! {
    /// The libraries (by mapping) whose entry point this thread is inside, outermost
    /// first. Plain cells without a destructor: an instance may be made from any thread,
    /// one exiting included.
    static ENTERING: [std::cell::Cell<usize>; MAX_NESTED_ENTRIES] =
        const { [const { std::cell::Cell::new(0) }; MAX_NESTED_ENTRIES] };
    /// How many entry calls this thread is inside.
    static DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// This thread is inside the entry point of the library at `mapping` until dropped.
struct Entering;

impl Entering {
    /// Records the entry call, or `None` if this thread is inside that library's entry
    /// point already (its entry lock is this thread's: waiting for it would never end).
    fn begin(mapping: usize) -> Option<Entering> {
        let depth = DEPTH.with(std::cell::Cell::get);
        let nested =
            ENTERING.with(|entering| entering[..depth.min(MAX_NESTED_ENTRIES)].iter().any(|m| m.get() == mapping));
        if nested {
            return None;
        }
        if depth < MAX_NESTED_ENTRIES {
            ENTERING.with(|entering| entering[depth].set(mapping));
        }
        DEPTH.with(|cell| cell.set(depth + 1));
        Some(Entering)
    }
}

impl Drop for Entering {
    fn drop(&mut self) {
        let depth = DEPTH.with(std::cell::Cell::get) - 1;
        if depth < MAX_NESTED_ENTRIES {
            ENTERING.with(|entering| entering[depth].set(0));
        }
        DEPTH.with(|cell| cell.set(depth));
    }
}

/// What an instance is created with.
#[derive(Clone, Debug)]
pub struct InstanceOptions {
    config: String,
    offered: u64,
}

impl Default for InstanceOptions {
    fn default() -> InstanceOptions {
        InstanceOptions { config: String::new(), offered: MP_CAP_ALL }
    }
}

impl InstanceOptions {
    /// Default options: no configuration, every capability offered.
    pub fn new() -> InstanceOptions {
        InstanceOptions::default()
    }

    /// The configuration string handed to the plugin (its format is the plugin's).
    #[must_use]
    pub fn config(mut self, config: impl Into<String>) -> InstanceOptions {
        self.config = config.into();
        self
    }

    /// The capabilities the host offers (`MP_CAP_*` bits); the plugin may claim no more.
    #[must_use]
    pub fn offer(mut self, capabilities: u64) -> InstanceOptions {
        self.offered = capabilities;
        self
    }
}

/// A loaded plugin library. See the [crate docs](crate) for the unload protocol.
///
/// Not `Clone`: this is the one handle that can unload. Every instance made through it
/// pins the library on its own, so dropping this handle never unmaps code that is
/// still in use; the library is unmapped when the last pin goes, and never while the
/// plugin's own tally says it still holds something.
pub struct PluginLibrary {
    shared: Arc<LoadedLibrary>,
}

pub(crate) struct LoadedLibrary {
    path: String,
    /// Which mapping this load is (the entry point's address: loads of one library share
    /// one mapping, which the dynamic loader counts), for [`LOADS`].
    mapping: usize,
    /// NUL-terminated copy of `path`: the `host_data` of every instance's log lines.
    log_label: CString,
    entry: MpEntryFn,
    /// Serialises the entry point and the copy of its table: a plugin may build its
    /// table in one static it refills on every call.
    entry_lock: Mutex<()>,
    tally: Option<MpTallyFn>,
    instances: Mutex<Vec<Weak<Instance>>>,
    library: ManuallyDrop<libloading::Library>,
}

/// How many live loads each mapping has ([`LoadedLibrary::mapping`]). The plugin's tally
/// is the library's, over every load of it in the process: a load dropped while another
/// lives closes its own reference whatever the tally says (the other load keeps the code
/// mapped); only the last one keeps the mapping when the plugin still holds something.
static LOADS: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

fn loads() -> MutexGuard<'static, BTreeMap<usize, usize>> {
    LOADS.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LoadedLibrary {
    fn instances(&self) -> MutexGuard<'_, Vec<Weak<Instance>>> {
        self.instances.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn plugin_tally(&self) -> Option<PluginTally> {
        let tally = self.tally?;
        let mut out = MpTally::default();
        // SAFETY: the symbol was resolved with this signature from the library, which
        // is mapped while `self` lives; `out` is a live local.
        let status = unsafe { tally(&mut out) };
        if status != MP_OK {
            tracing::warn!(plugin = %self.path, status = %StatusCode(status), "mp_plugin_tally failed; treating the plugin as busy");
            // An answer we cannot read is not "nothing held".
            return Some(PluginTally::UNREADABLE);
        }
        Some(out.into())
    }
}

impl Drop for LoadedLibrary {
    fn drop(&mut self) {
        let other_loads = {
            let mut loads = loads();
            let left = loads.get_mut(&self.mapping).map_or(0, |count| {
                *count = count.saturating_sub(1);
                *count
            });
            if left == 0 {
                loads.remove(&self.mapping);
            }
            left
        };
        // Nothing of ours uses the library any more. If the plugin disagrees (threads
        // or objects it still owns), keep it mapped rather than pull code from under it,
        // unless another load of it lives: that one keeps the code mapped (the dynamic
        // loader counts the loads), and what the plugin holds may well be its.
        if other_loads == 0
            && let Some(tally) = self.plugin_tally().filter(|tally| !tally.is_empty())
        {
            tracing::warn!(plugin = %self.path, %tally, "plugin still holds objects; its library stays mapped");
            // Its instances may still log with our label as `host_data`: keep it too.
            std::mem::forget(std::mem::take(&mut self.log_label));
            return;
        }
        // SAFETY: dropped exactly once, here; every instance (each holding an `Arc` of
        // `self`) is gone, so no slot of this library can run any more.
        let library = unsafe { ManuallyDrop::take(&mut self.library) };
        match library.close() {
            Ok(()) => tracing::info!(plugin = %self.path, "plugin library unloaded"),
            Err(error) => tracing::warn!(plugin = %self.path, %error, "closing the plugin library failed"),
        }
    }
}

/// Forwards a plugin's log line to `tracing`.
///
/// # Safety
/// `host_data` is null or the NUL-terminated label of a live library; `message` is
/// null or points to `length` readable bytes.
unsafe extern "C" fn host_log(host_data: *mut c_void, level: i32, message: *const c_char, length: usize) {
    // A panic must not unwind into C.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let plugin = if host_data.is_null() {
            String::from("plugin")
        } else {
            // SAFETY: the caller's guarantee: a NUL-terminated label of a live library.
            unsafe { std::ffi::CStr::from_ptr(host_data.cast::<c_char>()) }.to_string_lossy().into_owned()
        };
        let text = if message.is_null() {
            String::new()
        } else {
            // SAFETY: the caller's guarantee: `length` readable bytes at `message`.
            let bytes = unsafe { std::slice::from_raw_parts(message.cast::<u8>(), length) };
            String::from_utf8_lossy(bytes).into_owned()
        };
        match level {
            MP_LOG_ERROR => tracing::error!(%plugin, "{text}"),
            MP_LOG_WARN => tracing::warn!(%plugin, "{text}"),
            MP_LOG_INFO => tracing::info!(%plugin, "{text}"),
            MP_LOG_DEBUG => tracing::debug!(%plugin, "{text}"),
            _ => tracing::trace!(%plugin, level, "{text}"),
        }
    }));
}

/// What the dynamic loader said: libloading's error reads "dlopen failed" and keeps the
/// loader's own reason (`dlerror()`: the file not found, a dependency or symbol that does
/// not resolve) as its source, which a message must carry.
#[cold]
fn loader_detail(error: &libloading::Error) -> String {
    let mut detail = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        detail.push_str(": ");
        detail.push_str(&cause.to_string());
        source = cause.source();
    }
    detail
}

impl PluginLibrary {
    /// Loads the plugin library at `path` and resolves its entry point (and its
    /// optional tally).
    ///
    /// # Errors
    /// [`PluginError::Load`] when the path is empty (the dynamic loader would open the
    /// program itself) or the loader fails (with its reason), [`PluginError::MissingEntry`]
    /// when the library exports no `mp_plugin_entry`.
    ///
    /// # Safety
    /// Loading runs the library's initialisers, and its code then runs in this
    /// process: the caller trusts it to be memory-safe and to follow `docs/C-ABI.md`
    /// (thread-safe slots, honest table sizes, no unwinding across the boundary). The
    /// host checks every *answer* the plugin gives; it cannot check its code.
    pub unsafe fn load(path: impl AsRef<Path>) -> Result<PluginLibrary, PluginError> {
        let path_ref = path.as_ref();
        let path = path_ref.display().to_string();
        if path_ref.as_os_str().is_empty() {
            // dlopen("") is the program itself, not a library: never a plugin to load.
            return Err(PluginError::Load {
                path: "\"\"".to_owned(),
                detail: "an empty path names this program itself to the dynamic loader, not a plugin library; \
                         pass the plugin's file"
                    .to_owned(),
            });
        }
        // SAFETY: the caller trusts the library (see `# Safety`).
        let library = unsafe { libloading::Library::new(path_ref) }
            .map_err(|error| PluginError::Load { path: path.clone(), detail: loader_detail(&error) })?;
        // SAFETY: the symbol is declared by the ABI with exactly this signature.
        let entry = unsafe { library.get::<MpEntryFn>(MP_ENTRY_SYMBOL.as_bytes()) }
            .map(|symbol| *symbol)
            .map_err(|_| PluginError::MissingEntry { path: path.clone(), symbol: MP_ENTRY_SYMBOL })?;
        // SAFETY: as above, for the optional tally.
        let tally = unsafe { library.get::<MpTallyFn>(MP_TALLY_SYMBOL.as_bytes()) }.ok().map(|symbol| *symbol);
        let log_label = CString::new(path.replace('\0', "?")).unwrap_or_default();
        let mapping = entry as usize;
        *loads().entry(mapping).or_insert(0) += 1;
        tracing::info!(plugin = %path, tally = tally.is_some(), "plugin library loaded");
        Ok(PluginLibrary {
            shared: Arc::new(LoadedLibrary {
                path,
                mapping,
                log_label,
                entry,
                entry_lock: Mutex::new(()),
                tally,
                instances: Mutex::new(Vec::new()),
                library: ManuallyDrop::new(library),
            }),
        })
    }

    /// The path the library was loaded from.
    pub fn path(&self) -> &str {
        &self.shared.path
    }

    /// Creates an allocator instance through the library's entry point and checks its
    /// table (see [`PluginError`] for every refusal).
    ///
    /// # Errors
    /// [`PluginError::ConfigHasNul`], [`PluginError::EntryRefused`] (the plugin said
    /// no, for example `MP_ERR_VERSION_MISMATCH`), or a negotiation error.
    pub fn instantiate(&self, options: &InstanceOptions) -> Result<PluginAllocator, PluginError> {
        let config = CString::new(options.config.as_str())
            .map_err(|error| PluginError::ConfigHasNul { position: error.nul_position() })?;
        let host = MpHost {
            header: MpHeader { struct_size: MP_HOST_SIZE_V1_0, abi_major: MP_ABI_MAJOR, abi_minor: MP_ABI_MINOR },
            offered_capabilities: options.offered,
            config: config.as_ptr(),
            config_length: config.as_bytes().len(),
            host_data: self.shared.log_label.as_ptr().cast_mut().cast::<c_void>(),
            log: Some(host_log),
        };
        let mut table: *const MpAllocator = std::ptr::null();
        // An entry point that called back into the host for another instance of its own
        // library: this thread holds the entry lock, so the nested call is refused.
        let Some(_entering) = Entering::begin(self.shared.mapping) else {
            return Err(PluginError::ReentrantEntry { plugin: self.shared.path.clone() });
        };
        // One entry call at a time per library, until its table has been copied.
        let entered = self.shared.entry_lock.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: the entry point has this signature (resolved at load); `host` and
        // `table` are live locals; `host_data` is the library's label, which lives as
        // long as the library (and so as long as any instance may log).
        let status = unsafe { (self.shared.entry)(&host, &mut table) };
        if status != MP_OK {
            if status == MP_ERR_VERSION_MISMATCH {
                tracing::warn!(plugin = %self.shared.path, "plugin refused the host's ABI version");
            }
            return Err(PluginError::EntryRefused { plugin: self.shared.path.clone(), status: StatusCode(status) });
        }
        // SAFETY: the plugin answered MP_OK, so by the ABI `table` points to its table
        // (size and layout checked by `negotiate`); the library stays mapped while the
        // instance lives (it holds an `Arc` of it).
        let negotiated = unsafe { negotiate(table, options.offered, &self.shared.path, InstanceOrigin::Entry) };
        drop(entered);
        let negotiated = negotiated?;
        let allocator = PluginAllocator::new(negotiated, Some(Arc::clone(&self.shared)));
        let mut instances = self.shared.instances();
        instances.retain(|weak| weak.strong_count() > 0);
        instances.push(Arc::downgrade(&allocator.shared));
        Ok(allocator)
    }

    /// What the host still holds through this library, over all its instances.
    pub fn host_tally(&self) -> HostTally {
        let instances: Vec<Arc<Instance>> = self.shared.instances().iter().filter_map(Weak::upgrade).collect();
        let mut tally = HostTally::default();
        for instance in &instances {
            let one = PluginAllocator { shared: Arc::clone(instance) }.host_tally();
            tally.instances += 1;
            tally.allocations += one.allocations;
            tally.bytes += one.bytes;
            tally.backings += one.backings;
            tally.queued_releases += one.queued_releases;
            tally.suspect_blocks += one.suspect_blocks;
        }
        // Pins of the library itself: ours, one per instance, the rest are other handles.
        let live = instances.len();
        drop(instances);
        tally.other_pins = Arc::strong_count(&self.shared).saturating_sub(1 + live);
        tally
    }

    /// Retries the suspect blocks of every instance of this library (see
    /// [`PluginAllocator::retry_suspects`]), instances kept only for their suspect blocks
    /// included: the way to discharge them once every handle made through the library
    /// is gone, so that it can unload.
    pub fn retry_suspects(&self) -> SuspectRetry {
        let instances: Vec<Arc<Instance>> = self.shared.instances().iter().filter_map(Weak::upgrade).collect();
        let mut total = SuspectRetry::default();
        for instance in &instances {
            let one = instance.retry_suspects();
            total.discharged += one.discharged;
            total.still_suspect += one.still_suspect;
        }
        // Our references go with no lock held: an instance no longer kept is destroyed here.
        drop(instances);
        total
    }

    /// What the plugin says all its instances still hold (`None` when it exports no
    /// `mp_plugin_tally`).
    pub fn plugin_tally(&self) -> Option<PluginTally> {
        self.shared.plugin_tally()
    }

    /// Unloads the library if nothing made through it lives, on either side.
    ///
    /// # Errors
    /// [`UnloadRefused`], handing the library back still loaded, with both sides'
    /// tallies, while the host or the plugin still holds anything.
    pub fn unload(self) -> Result<(), UnloadRefused> {
        let host = self.host_tally();
        let plugin = self.plugin_tally();
        let busy = !host.is_empty() || plugin.is_some_and(|tally| !tally.is_empty());
        if busy || Arc::strong_count(&self.shared) != 1 {
            tracing::warn!(plugin = %self.shared.path, %host, ?plugin, "plugin unload refused");
            return Err(UnloadRefused { library: self, host, plugin });
        }
        // The last pin: dropping it closes the library (see `LoadedLibrary::drop`).
        drop(self);
        Ok(())
    }
}

impl fmt::Debug for PluginLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PluginLibrary").field("path", &self.shared.path).finish_non_exhaustive()
    }
}
