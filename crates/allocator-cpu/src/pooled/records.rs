//! The pool's record of every block it hands out, in `memory_sync`'s record table (as
//! every layer keeps its per-block records): inserted by the allocating thread with
//! plain stores, taken by a release on any thread with one compare-and-swap, restored
//! under the same tag when the inner allocator refuses or quarantines a release. The
//! block's provider tag is the record's tag, so a foreign, forged, stale or repeated
//! block takes nothing and is refused before anything is touched.
//!
//! A record is four words: the address, size and alignment handed out (a release must
//! present exactly these) and what holds the block: a cell of a thread's class cache
//! (`classes.rs`), or a piece of a segment (`segments.rs`).

use memory_api::{DeviceAddress, RawAllocation};
use memory_sync::records::Words;

/// The record table's payload: `[address, bytes, align, held]`.
pub(super) type LiveCells = Words<4>;

/// Set in `held` for a piece of a segment; clear for a cell.
const PIECE: u64 = 1 << 63;

/// What holds a live block.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Held {
    /// Cell `1` of the class cache of thread `0`.
    Cell(usize, u32),
    /// Piece `0` of a segment.
    Piece(usize),
}

/// The payload recording a block of `bytes` at `address` aligned to `align`, held by
/// `held`.
#[inline(always)]
pub(super) fn record(address: DeviceAddress, bytes: usize, align: usize, held: Held) -> [u64; 4] {
    let held = match held {
        Held::Cell(home, cell) => (home as u64) << 32 | u64::from(cell),
        Held::Piece(slot) => PIECE | slot as u64,
    };
    [address.get(), bytes as u64, align as u64, held]
}

/// Whether `recorded` is the record of exactly the block presented.
#[inline(always)]
pub(super) fn is(recorded: &[u64; 4], allocation: &RawAllocation) -> bool {
    recorded[0] == allocation.address().get()
        && recorded[1] == allocation.bytes() as u64
        && recorded[2] == allocation.align() as u64
}

/// Whether `recorded` is at the address presented (a block given up with its device,
/// whose size the caller may no longer know exactly).
#[inline]
pub(super) fn is_at(recorded: &[u64; 4], allocation: &RawAllocation) -> bool {
    recorded[0] == allocation.address().get()
}

/// What holds the recorded block.
#[inline(always)]
pub(super) fn held(recorded: &[u64; 4]) -> Held {
    let held = recorded[3];
    if held & PIECE != 0 {
        Held::Piece((held & !PIECE) as usize)
    } else {
        Held::Cell((held >> 32) as usize, held as u32)
    }
}

/// The largest thread index a record names (the home's 31 bits).
pub(super) const MAX_HOME: usize = (1 << 31) - 1;

#[cfg(test)]
mod tests {
    use super::*;
    use memory_api::DeviceKey;

    #[test]
    fn records_round_trip_and_match_only_the_block_presented() {
        let address = DeviceAddress::new(0x10_000).unwrap();
        let block = RawAllocation::new(address, 4000, 64, DeviceKey::HOST, 7);
        for held_by in [Held::Cell(MAX_HOME, u32::MAX - 1), Held::Cell(0, 0), Held::Piece(1 << 40)] {
            let recorded = record(address, 4000, 64, held_by);
            assert_eq!(held(&recorded), held_by);
            assert!(is(&recorded, &block) && is_at(&recorded, &block));
            for other in [
                RawAllocation::new(address, 4001, 64, DeviceKey::HOST, 7),
                RawAllocation::new(address, 4000, 128, DeviceKey::HOST, 7),
                RawAllocation::new(DeviceAddress::new(0x20_000).unwrap(), 4000, 64, DeviceKey::HOST, 7),
            ] {
                assert!(!is(&recorded, &other), "{other:?}");
            }
        }
    }
}
