//! Both sides' counts of what lives through a plugin library: the host's (instances,
//! blocks, backings, queued releases, other pins) and the plugin's own.

use std::fmt;

use memory_plugin_abi::MpTally;

/// What the host still holds through a plugin library.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct HostTally {
    /// Allocator instances alive (each held by a mechanism, a binding, an allocation,
    /// a queue, a backing or the caller).
    pub instances: usize,
    /// Blocks allocated through them and not completely released (quarantined and
    /// device-lost blocks included).
    pub allocations: usize,
    /// Their bytes.
    pub bytes: usize,
    /// Shared backings alive.
    pub backings: usize,
    /// Releases waiting in a plugin release queue.
    pub queued_releases: usize,
    /// Blocks the host keeps as suspect, never freed and never handed out: ones the
    /// plugin wrote with an unknown status, ones that overlapped a live block, and
    /// unusable ones it would not take back. Each keeps its instance from being
    /// destroyed (it is counted in `instances`) until a suspect retry discharges it.
    pub suspect_blocks: usize,
    /// Other handles to the library itself.
    pub other_pins: usize,
}

impl HostTally {
    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        *self == HostTally::default()
    }
}

impl fmt::Display for HostTally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} instance(s), {} allocation(s) of {} bytes, {} backing(s), {} queued release(s), \
             {} suspect block(s), {} other pin(s)",
            self.instances,
            self.allocations,
            self.bytes,
            self.backings,
            self.queued_releases,
            self.suspect_blocks,
            self.other_pins
        )
    }
}

/// What a suspect retry did ([`PluginAllocator::retry_suspects`],
/// [`PluginLibrary::retry_suspects`]).
///
/// [`PluginAllocator::retry_suspects`]: crate::PluginAllocator::retry_suspects
/// [`PluginLibrary::retry_suspects`]: crate::PluginLibrary::retry_suspects
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct SuspectRetry {
    /// Suspect blocks the plugin took back or said it does not hold: no longer kept.
    pub discharged: usize,
    /// Suspect blocks still kept.
    pub still_suspect: usize,
}

impl fmt::Display for SuspectRetry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} suspect block(s) discharged, {} still kept", self.discharged, self.still_suspect)
    }
}

/// What a plugin says it still holds.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginTally {
    /// Instances not destroyed.
    pub instances: u64,
    /// Blocks not released.
    pub allocations: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Backings not dropped.
    pub backings: u64,
    /// Deferred releases not yet reported ready.
    pub deferred: u64,
}

impl PluginTally {
    /// What the host reads when `mp_plugin_tally` fails: not empty (a tally it cannot
    /// read is not "nothing held", so the unload is refused), `u64::MAX` instances.
    pub const UNREADABLE: PluginTally =
        PluginTally { instances: u64::MAX, allocations: 0, bytes: 0, backings: 0, deferred: 0 };

    /// Whether the plugin holds nothing.
    pub fn is_empty(&self) -> bool {
        *self == PluginTally::default()
    }

    /// Whether this is no answer of the plugin's but [`PluginTally::UNREADABLE`]: its
    /// `mp_plugin_tally` failed.
    pub fn is_unreadable(&self) -> bool {
        *self == PluginTally::UNREADABLE
    }
}

impl From<MpTally> for PluginTally {
    fn from(tally: MpTally) -> PluginTally {
        PluginTally {
            instances: tally.instances,
            allocations: tally.allocations,
            bytes: tally.bytes,
            backings: tally.backings,
            deferred: tally.deferred,
        }
    }
}

impl fmt::Display for PluginTally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_unreadable() {
            return f.write_str(
                "no readable tally (mp_plugin_tally failed, so the plugin is treated as still holding something; the \
                 library stays loaded until its tally answers)",
            );
        }
        write!(
            f,
            "{} instance(s), {} allocation(s) of {} bytes, {} backing(s), {} deferred release(s)",
            self.instances, self.allocations, self.bytes, self.backings, self.deferred
        )
    }
}
