//! Errors of loading, negotiating, calling and unloading plugins. Messages say what
//! was asked, what was found and what to do.

use std::fmt;

use memory_plugin_abi::{MpStatus, status_name};

use crate::library::PluginLibrary;
use crate::tally::{HostTally, PluginTally};

/// A status code with its name, for messages (`MP_ERR_NOT_OWNED (4)`, `unknown status 77`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct StatusCode(pub MpStatus);

impl fmt::Display for StatusCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match status_name(self.0) {
            Some(name) => write!(f, "{name} ({})", self.0),
            None => write!(f, "unknown status {} ({:#x})", self.0, self.0),
        }
    }
}

/// Why a plugin could not be loaded, instantiated or called.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PluginError {
    /// The dynamic loader could not open the library.
    #[error("could not load plugin library {path}: {detail}; check the path and that its dependencies resolve")]
    Load {
        /// The path asked for.
        path: String,
        /// The loader's message.
        detail: String,
    },
    /// The library does not export the entry point.
    #[error("{path} exports no `{symbol}`; it is not an allocator plugin (build it against memory_plugin.h)")]
    MissingEntry {
        /// The library.
        path: String,
        /// The symbol looked for.
        symbol: &'static str,
    },
    /// The configuration string holds a NUL byte.
    #[error("the plugin configuration holds a NUL byte at {position}; pass UTF-8 text without NUL")]
    ConfigHasNul {
        /// Where the NUL is.
        position: usize,
    },
    /// The plugin's entry point refused to create an instance.
    #[error("plugin {plugin} refused to create an instance: {status}; see the plugin's log and its configuration")]
    EntryRefused {
        /// The library or table.
        plugin: String,
        /// What it answered.
        status: StatusCode,
    },
    /// The plugin answered success but handed over no table, or a misaligned one.
    #[error("plugin {plugin} handed over {found} instead of an allocator table; report the plugin's bug")]
    BadTable {
        /// The library or table.
        plugin: String,
        /// What was found (a null or misaligned pointer).
        found: String,
    },
    /// The table follows another major version of the ABI.
    #[error(
        "plugin {plugin} speaks ABI {found_major}.{found_minor}, this host speaks {expected_major}.x; \
         rebuild the plugin against this host's memory_plugin.h"
    )]
    WrongMajor {
        /// The library or table.
        plugin: String,
        /// The table's major.
        found_major: u16,
        /// The table's minor.
        found_minor: u16,
        /// The host's major.
        expected_major: u16,
    },
    /// The table is shorter than the prefix of the minor version both sides agreed on.
    #[error(
        "plugin {plugin}'s table is {size} bytes but ABI {major}.{minor} needs at least {needed}; \
         nothing past its end was read (rebuild the plugin, or fix its struct_size)"
    )]
    ShortTable {
        /// The library or table.
        plugin: String,
        /// The size it claims.
        size: u32,
        /// The prefix the negotiated minor needs.
        needed: u32,
        /// The major version.
        major: u16,
        /// The negotiated minor.
        minor: u16,
    },
    /// A required slot, or a slot a claimed capability needs, is null or outside the
    /// negotiated prefix.
    #[error("plugin {plugin} leaves slot `{slot}` null, but {why}; fill the slot or stop claiming what needs it")]
    MissingSlot {
        /// The library or table.
        plugin: String,
        /// The slot.
        slot: &'static str,
        /// Why it is needed.
        why: &'static str,
    },
    /// The library's entry point asked the host for another instance of the same
    /// library from inside its own entry call (a callback into the host): entry calls of
    /// one library are serialised, so the nested one could never start.
    #[error(
        "plugin {plugin} was asked for an instance from inside its own entry point (mp_plugin_entry called back \
         into the host, which asked the same library again); entry calls of one library run one at a time, so \
         this one cannot run: ask for the second instance once mp_plugin_entry has returned"
    )]
    ReentrantEntry {
        /// The library.
        plugin: String,
    },
    /// A minor-0 table claims capabilities that need slots (virtual backing, shared
    /// mapping, deferred release): those slots came with minor 1, past the end of a
    /// minor-0 table, so the host never reads them (they are not "left null").
    #[error(
        "plugin {plugin} claims capabilities {claimed:#x} in a minor-{minor} table, but a minor-{minor} table \
         ends before the capability slots (they came with minor {needed_minor}), so the host cannot read them; \
         build the table as minor {needed_minor} or later (MP_ABI_MINOR) with the slots filled, or claim no capability"
    )]
    CapabilitiesNeedNewerMinor {
        /// The library or table.
        plugin: String,
        /// The capability bits claimed that need slots.
        claimed: u64,
        /// The table's negotiated minor.
        minor: u16,
        /// The first minor with capability slots.
        needed_minor: u16,
    },
    /// The plugin claims capabilities the host did not offer (or does not know).
    #[error(
        "plugin {plugin} claims capabilities {claimed:#x} but the host offered only {offered:#x}; \
         a plugin may claim only offered capabilities (check offered_capabilities)"
    )]
    UnofferedCapability {
        /// The library or table.
        plugin: String,
        /// The bits claimed beyond the offer.
        claimed: u64,
        /// The bits offered.
        offered: u64,
    },
    /// The table names a device tier this ABI does not define.
    #[error("plugin {plugin} serves tier {tier} (index {index}), which ABI 1 does not define; use MP_TIER_*")]
    InvalidDevice {
        /// The library or table.
        plugin: String,
        /// The tier found.
        tier: u32,
        /// The index found.
        index: u32,
    },
    /// A claimed capability comes with an unusable granularity.
    #[error("plugin {plugin} claims {capability} with granularity {granularity}; it must be a power of two")]
    InvalidGranularity {
        /// The library or table.
        plugin: String,
        /// Which capability.
        capability: &'static str,
        /// The granularity found.
        granularity: u64,
    },
    /// An optional slot is null (or was not negotiated): the operation is unsupported.
    #[error(
        "plugin {plugin} does not support {what} (its slot is null or newer than the negotiated ABI {major}.{minor})"
    )]
    Unsupported {
        /// The plugin.
        plugin: String,
        /// What was asked for.
        what: &'static str,
        /// The major version.
        major: u16,
        /// The negotiated minor.
        minor: u16,
    },
    /// An optional call answered an error, or an answer that cannot be true.
    #[error("plugin {plugin}'s {operation} answered {status}{detail}")]
    Call {
        /// The plugin.
        plugin: String,
        /// The slot called.
        operation: &'static str,
        /// Its status.
        status: StatusCode,
        /// More about a dishonest answer (empty otherwise).
        detail: String,
    },
}

/// An unload that was refused because something made through the library still lives
/// (on the host's side, the plugin's, or both). The library is handed back, still
/// loaded; release what the tallies name, then try again.
#[derive(thiserror::Error)]
#[error("{}", unload_message(.library.path(), .host, .plugin))]
pub struct UnloadRefused {
    /// The library, still loaded.
    pub library: PluginLibrary,
    /// What the host still holds through it.
    pub host: HostTally,
    /// What the plugin says it still holds (`None` when it exports no tally).
    pub plugin: Option<PluginTally>,
}

impl UnloadRefused {
    /// Blocks the host keeps as suspect through the library: while there are any, its
    /// instances are kept and it never unloads (retry them with
    /// [`PluginLibrary::retry_suspects`]).
    pub fn suspect_blocks(&self) -> usize {
        self.host.suspect_blocks
    }
}

impl fmt::Debug for UnloadRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnloadRefused")
            .field("library", &self.library.path())
            .field("host", &self.host)
            .field("plugin", &self.plugin)
            .finish()
    }
}

fn unload_message(path: &str, host: &HostTally, plugin: &Option<PluginTally>) -> String {
    let plugin = match plugin {
        Some(tally) => tally.to_string(),
        None => "no tally (the library exports no mp_plugin_tally)".to_owned(),
    };
    if host.suspect_blocks != 0 {
        return format!(
            "unload of {path} refused: {} suspect block(s) remain, blocks the plugin wrote that the host keeps (an \
             unknown status, an overlap with a live block, or an unusable block it would not take back): the plugin \
             may still own them, so their instances are not destroyed and the library stays loaded; retry the \
             suspect blocks (each goes back to the plugin's release, once no live block overlaps it) or leave the \
             library loaded for the life of the process. The host also holds {host}; the plugin reports {plugin}",
            host.suspect_blocks
        );
    }
    format!(
        "unload of {path} refused: the host still holds {host}; the plugin reports {plugin}; \
         release the allocations, drop the bindings, queues and backings, remove the mechanisms \
         made through it, then unload again"
    )
}
