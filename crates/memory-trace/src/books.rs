//! The recorded books: which blocks are live after each event, paired by the identity
//! the events carry (device, address, id), as the governor counted them. Used by the
//! converters and the page; replay keeps its own books of the blocks it allocated.

use std::collections::HashMap;

use memory_governor::{DeviceKey, MemoryRole};

use crate::event::{Event, ReleaseKind, What};

/// The key that pairs a release or lost block with its allocation: no two live blocks of
/// one allocator share an address on a device, and the id (the governed tag) tells apart
/// blocks of different allocators at the same address.
pub(crate) type Key = (DeviceKey, u64, u64);

/// A live block of the recording.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Live {
    pub(crate) tenant: u32,
    pub(crate) role: MemoryRole,
    /// Bytes still charged (a quarantine keeps only its residual).
    pub(crate) bytes: u64,
    /// Bytes asked for.
    pub(crate) requested: u64,
    /// The allocation event's index.
    pub(crate) event: usize,
}

/// What one event did to the books.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// A block became live; `replaced`: the trace held a block of the same identity
    /// already, whose release is missing (a damaged or merged trace), and it left the
    /// books for this one.
    Opened { live: Live, replaced: Option<Live> },
    /// A block's charge went down by `freed` bytes; `closed` when it left the books.
    Freed { live: Live, freed: u64, closed: bool },
    /// A release or lost block that names no live block (its allocation is not in the
    /// trace, or the release failed).
    Unmatched,
    /// Nothing changed (refusals, failures, marks, failed releases).
    None,
}

/// Live blocks of the recording, event by event.
#[derive(Default)]
pub(crate) struct Books {
    live: HashMap<Key, Live>,
}

impl Books {
    pub(crate) fn key(event: &Event, address: u64, id: u64) -> Key {
        (event.device, address, id)
    }

    /// Applies event `index`.
    pub(crate) fn apply(&mut self, index: usize, event: &Event) -> Change {
        match &event.what {
            What::Allocate(block) => {
                let live = Live {
                    tenant: event.tenant,
                    role: event.role.unwrap_or(MemoryRole::Other),
                    bytes: block.bytes,
                    requested: block.requested,
                    event: index,
                };
                let replaced = self.live.insert(Books::key(event, block.address, block.id), live);
                Change::Opened { live, replaced }
            }
            What::Release { outcome: ReleaseKind::Failed, .. } => Change::None,
            What::Release { block, outcome: ReleaseKind::Quarantined, residual } => {
                let key = Books::key(event, block.address, block.id);
                let Some(live) = self.live.get_mut(&key) else { return Change::Unmatched };
                let keep = (*residual).min(live.bytes);
                let freed = live.bytes - keep;
                live.bytes = keep;
                Change::Freed { live: *live, freed, closed: false }
            }
            What::Release { block, .. } => match self.live.remove(&Books::key(event, block.address, block.id)) {
                Some(live) => Change::Freed { live, freed: live.bytes, closed: true },
                None => Change::Unmatched,
            },
            What::Lost(block) => match self.live.remove(&Books::key(event, block.address, block.id)) {
                Some(live) => Change::Freed { live, freed: live.bytes, closed: true },
                None => Change::Unmatched,
            },
            _ => Change::None,
        }
    }
}
