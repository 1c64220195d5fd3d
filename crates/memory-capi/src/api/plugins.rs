//! Plugin libraries: load, tally, retry suspect blocks, unload (docs/C-ABI.md §4).

use std::ffi::c_char;

use memory_plugin::PluginLibrary;

use super::{borrow, check_out, fill, handle_failure, text, vacancy, write};
use crate::handles::{Scheme, number};
use crate::status::{Failure, MC_ERR_INVALID_ARGUMENT, MC_ERR_SUSPECT_BLOCKS, MC_ERR_UNLOAD_REFUSED, McStatus, guard};
use crate::types::*;

pub(crate) const KIND_LIBRARY: u8 = 0xa8;

tables! {
    LIBRARIES in LIBRARY_CELLS: PluginLibrary = (KIND_LIBRARY, Scheme::Hazard, "plugin library", FREE_LIBRARIES);
}

/// Loads a plugin library. An empty path is `MC_ERR_INVALID_ARGUMENT` (the dynamic
/// loader would open this program itself); a library the loader cannot open is
/// `MC_ERR_PLUGIN`, with the loader's reason in the message.
///
/// # Safety
/// `path` is null or NUL-terminated; `out` is null or writable. Loading runs the
/// library's code in this process: load only plugins you trust (docs/C-ABI.md).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_plugin_load(path: *const c_char, out: *mut *mut McPluginLibrary) -> McStatus {
    guard("mc_plugin_load", || {
        check_out(out, "out")?;
        // SAFETY: null or NUL-terminated (the caller's contract).
        let path = unsafe { text(path, "path") }?;
        if path.is_empty() {
            return Err(Failure::new(
                MC_ERR_INVALID_ARGUMENT,
                "path is empty, which names this program itself to the dynamic loader, not a plugin library; \
                 pass the path of the plugin's shared library"
                    .to_owned(),
            ));
        }
        let cell = vacancy(&LIBRARIES)?;
        // SAFETY: the caller trusts the library (documented above).
        let library = unsafe { PluginLibrary::load(path) }?;
        let handle = fill(cell, library);
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Writes both sides' tallies of a plugin library.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_plugin_tally(library: *mut McPluginLibrary, out: *mut McPluginTallies) -> McStatus {
    guard("mc_plugin_tally", || {
        check_out(out, "out")?;
        let library = borrow(&LIBRARIES, library)?;
        let tallies = tallies(&library.host_tally(), library.plugin_tally());
        // SAFETY: checked above.
        unsafe { write(out, tallies) };
        Ok(())
    })
}

fn tallies(host: &memory_plugin::HostTally, plugin: Option<memory_plugin::PluginTally>) -> McPluginTallies {
    let plugin_abi = plugin.map(|t| memory_plugin_abi::MpTally {
        instances: t.instances,
        allocations: t.allocations,
        bytes: t.bytes,
        backings: t.backings,
        deferred: t.deferred,
    });
    McPluginTallies {
        host_instances: host.instances as u64,
        host_allocations: host.allocations as u64,
        host_bytes: host.bytes as u64,
        host_backings: host.backings as u64,
        host_queued_releases: host.queued_releases as u64,
        host_suspect_blocks: host.suspect_blocks as u64,
        host_other_pins: host.other_pins as u64,
        plugin_reported: u32::from(plugin_abi.is_some()),
        reserved: 0,
        plugin: plugin_abi.unwrap_or_default(),
    }
}

/// Hands every block the host keeps as suspect through `library` (any of its instances,
/// ones kept only for their suspect blocks included) back to the plugin's `release`: a
/// block the plugin takes back, or says it does not hold, is discharged; any other answer
/// keeps it. A block that overlapped a live block goes back only once no live block
/// overlaps it. An instance left with no suspect block is no longer kept, so the library
/// can unload once nothing else lives. Writes how many were discharged and how many are
/// still kept. The library belongs to no registry: to keep a lost device's plugin from
/// being called, confirm its context terminated first (`mc_confirm_terminated`).
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_plugin_retry_suspects(library: *mut McPluginLibrary, out: *mut McSuspectRetry) -> McStatus {
    guard("mc_plugin_retry_suspects", || {
        check_out(out, "out")?;
        let library = borrow(&LIBRARIES, library)?;
        let retry = McSuspectRetry::from(library.retry_suspects());
        // SAFETY: checked above.
        unsafe { write(out, retry) };
        Ok(())
    })
}

/// Unloads a plugin library if nothing made through it lives on either side, and frees
/// the handle. Otherwise the handle stays valid and the status says why:
/// `MC_ERR_SUSPECT_BLOCKS` while the host keeps blocks of it as suspect (their count in
/// the message; `mc_plugin_retry_suspects` hands them back), else
/// `MC_ERR_UNLOAD_REFUSED`, with both tallies in the message either way.
#[unsafe(no_mangle)]
pub extern "C" fn mc_plugin_unload(library: *mut McPluginLibrary) -> McStatus {
    guard("mc_plugin_unload", || {
        let number = number(library);
        let (value, reservation) =
            LIBRARIES.take(number).map_err(|fault| handle_failure("plugin library", number, fault))?.into_parts();
        match value.unload() {
            Ok(()) => {
                reservation.free();
                Ok(())
            }
            Err(refused) => {
                let status = if refused.suspect_blocks() > 0 { MC_ERR_SUSPECT_BLOCKS } else { MC_ERR_UNLOAD_REFUSED };
                let message = refused.to_string();
                reservation.restore(refused.library);
                Err(Failure::new(status, message))
            }
        }
    })
}
