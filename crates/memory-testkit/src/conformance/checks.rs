//! The individual conformance checks. Each takes a [`Suite`], panics on a contract
//! violation with a message saying what was asked, what came back and what the contract
//! requires, and returns [`Checked::Skipped`] when it does not apply.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, PoisonError};

use memory_api::{
    AllocError, AllocationRequest, ByteRange, CapabilityError, DeviceAddress, DeviceAllocator, DeviceKey, LayoutError,
    MappingAccess, RawAllocation, ReleaseOutcome, SharedBacking, SharedBackingResource, SharedMapping, SharedPlacement,
    VirtualBacking,
};

use super::{Checked, Suite};
use crate::access::MemoryAccess;

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

fn request(bytes: usize, align: usize) -> AllocationRequest {
    AllocationRequest::new(bytes, align).unwrap_or_else(|e| panic!("conformance suite bug: {e}"))
}

fn allocate(a: &dyn DeviceAllocator, bytes: usize, align: usize) -> RawAllocation {
    match a.allocate(&request(bytes, align)) {
        Ok(block) => block,
        Err(e) => panic!("{}: allocate({bytes} bytes, align {align}) failed: {e}", a.name()),
    }
}

fn outcome_error(outcome: &ReleaseOutcome) -> String {
    match outcome {
        ReleaseOutcome::Complete(_) => String::new(),
        ReleaseOutcome::Quarantined(q) => q.error().to_string(),
        ReleaseOutcome::Failed(f) => f.error().to_string(),
    }
}

/// Releases a healthy block, insisting on `Complete`; returns the unmapped bytes.
fn release_complete(a: &dyn DeviceAllocator, block: RawAllocation) -> usize {
    let what = format!("{block:?}");
    let bytes = block.bytes();
    match a.release(block) {
        // Honest by the contract: a complete release never claims more than the block
        // (the registry flags a larger claim as dishonest).
        ReleaseOutcome::Complete(done) if done.unmapped_bytes() > bytes => panic!(
            "{}: releasing {what} claimed {} unmapped bytes, more than the block's {bytes}; report at most the block",
            a.name(),
            done.unmapped_bytes()
        ),
        ReleaseOutcome::Complete(done) => done.unmapped_bytes(),
        other => panic!(
            "{}: releasing the healthy {what} must complete, got {}: {}",
            a.name(),
            other.summary(),
            outcome_error(&other)
        ),
    }
}

/// Releases a block the allocator must refuse; returns it after checking it came back
/// unchanged.
fn expect_refused(a: &dyn DeviceAllocator, block: RawAllocation, what: &str) -> RawAllocation {
    let original = (block.address(), block.bytes(), block.align(), block.device());
    match a.release(block) {
        ReleaseOutcome::Failed(failed) => {
            let (returned, _) = failed.into_parts();
            let back = (returned.address(), returned.bytes(), returned.align(), returned.device());
            assert_eq!(back, original, "{}: a refused release must hand back the exact block", a.name());
            returned
        }
        ReleaseOutcome::Quarantined(q) => panic!(
            "{}: a block {what} was quarantined ({}); it must be refused before anything is mutated \
             (ReleaseOutcome::Failed handing it back)",
            a.name(),
            q.error()
        ),
        ReleaseOutcome::Complete(_) => panic!(
            "{}: a block {what} was released as complete; it must be refused with ReleaseOutcome::Failed \
             handing the block back",
            a.name()
        ),
    }
}

/// Whether allocations are ordinary memory (not reservations that need a capability
/// call before they can be touched).
fn plain(a: &dyn DeviceAllocator) -> bool {
    a.virtual_backing().is_none() && a.shared_mapping().is_none()
}

fn other_device(device: DeviceKey) -> DeviceKey {
    if device == DeviceKey::disk(u32::MAX) { DeviceKey::disk(0) } else { DeviceKey::disk(u32::MAX) }
}

/// Non-zero bytes that differ between seeds and along the block.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| (seed.wrapping_mul(131).wrapping_add(i.wrapping_mul(7)) % 251) as u8 + 1).collect()
}

fn at(block: &RawAllocation, offset: usize) -> DeviceAddress {
    block.address().checked_add(offset).unwrap_or_else(|| panic!("{block:?} + {offset} overflows the address space"))
}

/// Asserts that no two spans `(start, bytes)` overlap (a zero-byte span occupies one
/// byte: its address must be unique).
fn assert_disjoint(name: &str, spans: &mut [(u64, usize)]) {
    spans.sort_unstable();
    for pair in spans.windows(2) {
        let ((a, a_bytes), (b, _)) = (pair[0], pair[1]);
        let end = a.saturating_add(a_bytes.max(1) as u64);
        assert!(
            end <= b,
            "{name}: live blocks overlap: {a_bytes} bytes at {a:#x} and a block at {b:#x}; live blocks must be distinct"
        );
    }
}

fn spans(blocks: &[RawAllocation]) -> Vec<(u64, usize)> {
    blocks.iter().map(|b| (b.address().get(), b.bytes())).collect()
}

fn need_access<'a>(suite: &Suite<'a>) -> Result<&'a dyn MemoryAccess, Checked> {
    suite.access().ok_or_else(|| Checked::Skipped("no MemoryAccess was given to the suite".to_owned()))
}

fn need_virtual(a: &dyn DeviceAllocator) -> Result<(&dyn VirtualBacking, usize), Checked> {
    let vb = a.virtual_backing().ok_or_else(|| Checked::Skipped(format!("{} offers no VirtualBacking", a.name())))?;
    let g = vb.granularity();
    assert!(g.is_power_of_two(), "{}: VirtualBacking granularity {g} must be a non-zero power of two", a.name());
    Ok((vb, g))
}

fn need_shared(a: &dyn DeviceAllocator) -> Result<(&dyn SharedMapping, usize), Checked> {
    let sm = a.shared_mapping().ok_or_else(|| Checked::Skipped(format!("{} offers no SharedMapping", a.name())))?;
    let g = sm.granularity();
    assert!(g.is_power_of_two(), "{}: SharedMapping granularity {g} must be a non-zero power of two", a.name());
    Ok((sm, g))
}

macro_rules! require {
    ($e:expr) => {
        match $e {
            Ok(value) => value,
            Err(skipped) => return skipped,
        }
    };
}

fn expect_capability_error(
    name: &str,
    what: &str,
    result: Result<usize, CapabilityError>,
    expected: &str,
    matches: Matcher,
) {
    match result {
        Err(ref e) if matches(e) => {}
        Err(e) => panic!("{name}: {what} failed with `{e}`; expected {expected}"),
        Ok(n) => panic!("{name}: {what} succeeded ({n} bytes); expected {expected}"),
    }
}

/// Recognises the error a check expects.
type Matcher = fn(&CapabilityError) -> bool;

fn is_out_of_bounds(e: &CapabilityError) -> bool {
    matches!(e, CapabilityError::OutOfBounds { .. })
}

fn is_backing_out_of_bounds(e: &CapabilityError) -> bool {
    matches!(e, CapabilityError::BackingOutOfBounds { .. })
}

fn is_misaligned(e: &CapabilityError) -> bool {
    matches!(e, CapabilityError::Misaligned { .. })
}

fn is_not_owned(e: &CapabilityError) -> bool {
    matches!(e, CapabilityError::NotOwned { .. })
}

/// A range that does not fit (`OutOfBounds`) or is not granular (`Misaligned`), for a
/// `4 * g`-byte allocation.
fn bad_ranges(g: usize) -> Vec<(ByteRange, &'static str, Matcher)> {
    let mut ranges: Vec<(ByteRange, &'static str, Matcher)> = vec![
        (ByteRange::new(3 * g, 2 * g), "OutOfBounds", is_out_of_bounds),
        (ByteRange::new(4 * g, g), "OutOfBounds", is_out_of_bounds),
        (ByteRange::new(0usize.wrapping_sub(g), g), "OutOfBounds", is_out_of_bounds),
    ];
    if g > 1 {
        ranges.push((ByteRange::new(g / 2, g), "Misaligned", is_misaligned));
        ranges.push((ByteRange::new(0, g / 2), "Misaligned", is_misaligned));
        ranges.push((ByteRange::new(g, g + g / 2), "Misaligned", is_misaligned));
    }
    ranges
}

// ---------------------------------------------------------------------------------------
// Plain allocation
// ---------------------------------------------------------------------------------------

/// Every power-of-two alignment from 1 to 2 MiB is honoured, or refused with
/// [`LayoutError::AlignmentTooLarge`] from some maximum of at least 256 upwards.
pub fn alignment(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let name = a.name().to_owned();
    let mut blocks = Vec::new();
    let mut refused_from: Option<(usize, usize)> = None;
    for shift in 0..=21 {
        let align = 1usize << shift;
        for bytes in [1, 24, 4097] {
            match a.allocate(&request(bytes, align)) {
                Ok(block) => {
                    if let Some((first, max)) = refused_from {
                        panic!("{name}: refused align {first} as above its maximum {max}, then honoured align {align}");
                    }
                    assert!(
                        block.address().is_aligned_to(align),
                        "{name}: asked for {bytes} bytes aligned to {align}, got address {}",
                        block.address()
                    );
                    assert!(block.bytes() >= bytes, "{name}: asked for {bytes} bytes, got {block:?}");
                    assert!(block.align() >= align, "{name}: asked for align {align}, block records {block:?}");
                    assert_eq!(block.device(), a.device(), "{name}: block records another device than the allocator");
                    blocks.push(block);
                }
                Err(AllocError::Layout(LayoutError::AlignmentTooLarge { align: reported, max, device })) => {
                    assert_eq!(reported, align, "{name}: AlignmentTooLarge names align {reported}, asked for {align}");
                    assert!(max < align, "{name}: refused align {align} although its maximum is {max}");
                    assert!(max >= 256, "{name}: supports alignments only up to {max}; at least 256 is required");
                    assert_eq!(device, a.device(), "{name}: AlignmentTooLarge names another device");
                    refused_from.get_or_insert((align, max));
                }
                Err(e) => panic!(
                    "{name}: allocate({bytes} bytes, align {align}) failed: {e}; an alignment the allocator \
                     cannot honour must be refused with LayoutError::AlignmentTooLarge"
                ),
            }
        }
    }
    assert_disjoint(&name, &mut spans(&blocks));
    for block in blocks {
        release_complete(&*a, block);
    }
    Checked::Passed
}

/// Live blocks of many sizes never overlap.
pub fn distinct_blocks(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let mut blocks = Vec::new();
    for _ in 0..6 {
        for bytes in [0, 1, 7, 64, 100, 4096, 65539] {
            blocks.push(allocate(&*a, bytes, 8));
        }
    }
    assert_disjoint(a.name(), &mut spans(&blocks));
    for block in blocks {
        release_complete(&*a, block);
    }
    Checked::Passed
}

/// Zero-byte requests yield unique, aligned, releasable blocks.
pub fn zero_size(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let name = a.name().to_owned();
    let blocks = vec![allocate(&*a, 0, 1), allocate(&*a, 1, 1), allocate(&*a, 0, 4096)];
    assert!(blocks[2].address().is_aligned_to(4096), "{name}: zero bytes aligned to 4096 got {}", blocks[2].address());
    assert_ne!(blocks[0].address(), blocks[2].address(), "{name}: two live zero-byte blocks share an address");
    assert_disjoint(&name, &mut spans(&blocks));
    for block in blocks {
        release_complete(&*a, block);
    }
    let again = allocate(&*a, 0, 64);
    assert!(again.address().is_aligned_to(64), "{name}: zero bytes aligned to 64 got {}", again.address());
    release_complete(&*a, again);
    Checked::Passed
}

/// Invalid layouts are typed errors; valid requests no memory can satisfy are typed
/// errors, never panics; the allocator keeps working afterwards.
pub fn invalid_layouts(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let name = a.name().to_owned();
    // The request type refuses every layout no allocator could honour, so an allocator
    // never sees one.
    for align in [0, 3, 48, usize::MAX] {
        assert_eq!(AllocationRequest::new(64, align), Err(LayoutError::AlignmentNotPowerOfTwo { align }));
    }
    assert!(matches!(AllocationRequest::new(usize::MAX, 1), Err(LayoutError::SizeOverflow { .. })));
    assert!(matches!(
        AllocationRequest::new(AllocationRequest::MAX_BYTES, 4096),
        Err(LayoutError::SizeOverflow { .. })
    ));

    let max = AllocationRequest::MAX_BYTES;
    for (bytes, align) in [(max & !4095, 4096), (max, 1), (1usize << 62, 64), ((1usize << 62) + 1, 1)] {
        match catch_unwind(AssertUnwindSafe(|| a.allocate(&request(bytes, align)))) {
            Err(_) => panic!("{name}: allocate({bytes} bytes, align {align}) panicked; it must return an AllocError"),
            Ok(Ok(block)) => panic!("{name}: allocate({bytes} bytes) claims success ({block:?}); no machine has that"),
            Ok(Err(e)) => {
                if let AllocError::OutOfMemory { requested, align: asked, .. } = &e {
                    assert_eq!((*requested, *asked), (bytes, align), "{name}: OutOfMemory misreports the request: {e}");
                }
                assert!(!e.to_string().is_empty(), "{name}: an allocation error must explain itself");
            }
        }
    }
    // A huge alignment is honoured or refused with a typed error.
    let align = 1usize << 40;
    match catch_unwind(AssertUnwindSafe(|| a.allocate(&request(64, align)))) {
        Err(_) => panic!("{name}: allocate(64 bytes, align 2^40) panicked; it must return an AllocError or honour it"),
        Ok(Ok(block)) => {
            assert!(block.address().is_aligned_to(align), "{name}: align 2^40 was not honoured: {block:?}");
            release_complete(&*a, block);
        }
        Ok(Err(_)) => {}
    }
    let block = allocate(&*a, 64, 8);
    release_complete(&*a, block);
    Checked::Passed
}

/// A block from another allocator instance, with another device key or with another
/// size is refused (`Failed`, handed back unchanged); the real block still releases.
pub fn release_refuses_foreign_blocks(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let b = suite.make();
    let block = allocate(&*a, 256, 64);
    let block = expect_refused(&*b, block, "released through a second allocator of the same kind");
    let forged = RawAllocation::new(
        block.address(),
        block.bytes(),
        block.align(),
        other_device(a.device()),
        block.provider_tag(),
    );
    let _ = expect_refused(&*a, forged, "presented with another device's key");
    let forged =
        RawAllocation::new(block.address(), block.bytes() + 4096, block.align(), block.device(), block.provider_tag());
    let _ = expect_refused(&*a, forged, "presented with a size it was not allocated with");
    release_complete(&*a, block);
    let own = allocate(&*b, 64, 8);
    release_complete(&*b, own);
    Checked::Passed
}

fn check_delta(name: &str, field: &str, before: u64, after: u64, expected: i64) {
    if before == 0 && after == 0 {
        return; // a field the allocator does not track stays zero
    }
    let delta = after as i128 - before as i128;
    assert_eq!(
        delta, expected as i128,
        "{name}: stats.{field} went from {before} to {after}; expected a change of {expected}"
    );
}

/// Stats count live blocks and totals exactly (fields an allocator does not track stay
/// zero and are not judged).
pub fn stats_follow_live_blocks(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let name = a.name().to_owned();
    let Some(before) = a.stats() else {
        return Checked::Skipped(format!("{name} keeps no stats"));
    };
    let blocks: Vec<_> = [64, 128, 4096].into_iter().map(|bytes| allocate(&*a, bytes, 8)).collect();
    let during = a.stats().unwrap_or_else(|| panic!("{name}: stats() returned Some, then None"));
    check_delta(&name, "live_allocations", before.live_allocations, during.live_allocations, 3);
    check_delta(&name, "allocations_total", before.allocations_total, during.allocations_total, 3);
    if during.live_bytes != 0 {
        assert!(
            during.live_bytes >= before.live_bytes + 64 + 128 + 4096,
            "{name}: stats.live_bytes grew from {} to {} for 4288 bytes handed out",
            before.live_bytes,
            during.live_bytes
        );
    }
    for block in blocks {
        release_complete(&*a, block);
    }
    let after = a.stats().unwrap_or_else(|| panic!("{name}: stats() returned Some, then None"));
    check_delta(&name, "live_allocations", during.live_allocations, after.live_allocations, -3);
    assert_eq!(after.live_bytes, before.live_bytes, "{name}: stats.live_bytes did not return to its value");
    check_delta(&name, "allocations_total", during.allocations_total, after.allocations_total, 0);
    Checked::Passed
}

/// `trim` hands back cached memory only: live blocks keep their contents and release
/// completely, nothing stays cached, and a second trim has nothing left to return.
pub fn trim_keeps_live_blocks(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let name = a.name().to_owned();
    let access = if plain(&*a) { suite.access() } else { None };
    let mut blocks: Vec<_> = (0..4).map(|_| allocate(&*a, 65536, 64)).collect();
    for block in blocks.drain(2..) {
        release_complete(&*a, block);
    }
    if let Some(access) = access {
        for (i, block) in blocks.iter().enumerate() {
            access.write(block.address(), &pattern(i as u64, 256)).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
    let _ = a.trim();
    if let Some(stats) = a.stats() {
        assert_eq!(stats.cached_bytes, 0, "{name}: {} bytes still cached after trim", stats.cached_bytes);
    }
    if let Some(access) = access {
        for (i, block) in blocks.iter().enumerate() {
            let read = access.read(block.address(), 256).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(read, pattern(i as u64, 256), "{name}: trim changed the contents of a live block");
        }
    }
    for block in blocks {
        release_complete(&*a, block);
    }
    let _ = a.trim();
    assert_eq!(a.trim(), 0, "{name}: a second trim with nothing cached returned bytes");
    let block = allocate(&*a, 65536, 64);
    release_complete(&*a, block);
    Checked::Passed
}

/// Plain allocations can be written and read over their whole size, each independently.
pub fn memory_is_writable(suite: &Suite<'_>) -> Checked {
    let access = require!(need_access(suite));
    let a = suite.make();
    let name = a.name().to_owned();
    if !plain(&*a) {
        return Checked::Skipped(format!(
            "{name} hands out reservations (VirtualBacking/SharedMapping); the capability checks cover its memory"
        ));
    }
    let blocks: Vec<_> = [1, 64, 4096, 65537].into_iter().map(|bytes| allocate(&*a, bytes, 64)).collect();
    for (i, block) in blocks.iter().enumerate() {
        access
            .write(block.address(), &pattern(i as u64, block.bytes()))
            .unwrap_or_else(|e| panic!("{name}: a fresh {block:?} is not writable: {e}"));
    }
    for (i, block) in blocks.iter().enumerate() {
        let read = access.read(block.address(), block.bytes()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(read == pattern(i as u64, block.bytes()), "{name}: {block:?} does not hold what was written to it");
    }
    for block in blocks {
        release_complete(&*a, block);
    }
    Checked::Passed
}

// ---------------------------------------------------------------------------------------
// VirtualBacking
// ---------------------------------------------------------------------------------------

/// Out-of-bounds, overflowing and misaligned ranges are refused and commit nothing.
pub fn virtual_bounds_and_granularity(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let name = a.name().to_owned();
    let (vb, g) = require!(need_virtual(&*a));
    let block = allocate(&*a, 4 * g, g);
    for (range, expected, matches) in bad_ranges(g) {
        expect_capability_error(&name, &format!("commit of {range}"), vb.commit(&block, range), expected, matches);
        expect_capability_error(&name, &format!("decommit of {range}"), vb.decommit(&block, range), expected, matches);
    }
    assert_eq!(vb.committed_bytes(&block).ok(), Some(0), "{name}: refused commits must commit nothing");
    assert_eq!(vb.commit(&block, ByteRange::new(4 * g, 0)).ok(), Some(0), "{name}: an empty range commits 0 bytes");
    assert_eq!(vb.decommit(&block, ByteRange::new(0, 0)).ok(), Some(0), "{name}: an empty range decommits 0 bytes");
    assert_eq!(release_complete(&*a, block), 0, "{name}: a reservation with nothing committed unmaps 0 bytes");
    Checked::Passed
}

fn commit(name: &str, vb: &dyn VirtualBacking, block: &RawAllocation, range: ByteRange) -> usize {
    vb.commit(block, range).unwrap_or_else(|e| panic!("{name}: commit of {range} failed: {e}"))
}

fn decommit(name: &str, vb: &dyn VirtualBacking, block: &RawAllocation, range: ByteRange) -> usize {
    vb.decommit(block, range).unwrap_or_else(|e| panic!("{name}: decommit of {range} failed: {e}"))
}

fn committed(name: &str, vb: &dyn VirtualBacking, block: &RawAllocation) -> usize {
    vb.committed_bytes(block).unwrap_or_else(|e| panic!("{name}: committed_bytes failed: {e}"))
}

/// Commit counts only newly committed bytes; `committed_bytes` and the release's
/// unmapped bytes are exact.
pub fn virtual_commit_accounting(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let name = a.name().to_owned();
    let (vb, g) = require!(need_virtual(&*a));
    let block = allocate(&*a, 4 * g, g);
    assert_eq!(committed(&name, vb, &block), 0, "{name}: a fresh reservation must have nothing committed");
    assert_eq!(commit(&name, vb, &block, ByteRange::new(g, g)), g, "{name}: committing one granule");
    assert_eq!(commit(&name, vb, &block, ByteRange::new(g, g)), 0, "{name}: recommitting counts 0 new bytes");
    assert_eq!(committed(&name, vb, &block), g);
    assert_eq!(commit(&name, vb, &block, ByteRange::new(0, 3 * g)), 2 * g, "{name}: [0, 3g) around a committed g");
    assert_eq!(committed(&name, vb, &block), 3 * g);
    assert_eq!(commit(&name, vb, &block, ByteRange::new(0, 4 * g)), g, "{name}: the last granule");
    assert_eq!(committed(&name, vb, &block), 4 * g);
    let unmapped = release_complete(&*a, block);
    assert_eq!(unmapped, 4 * g, "{name}: releasing 4 committed granules must report {} unmapped bytes", 4 * g);
    Checked::Passed
}

/// Decommit returns exactly the bytes it released.
pub fn virtual_decommit_returns_released_bytes(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let name = a.name().to_owned();
    let (vb, g) = require!(need_virtual(&*a));
    let block = allocate(&*a, 4 * g, g);
    assert_eq!(commit(&name, vb, &block, ByteRange::new(0, 4 * g)), 4 * g);
    assert_eq!(decommit(&name, vb, &block, ByteRange::new(g, g)), g, "{name}: decommitting one granule");
    assert_eq!(decommit(&name, vb, &block, ByteRange::new(g, g)), 0, "{name}: decommitting it again releases 0");
    assert_eq!(committed(&name, vb, &block), 3 * g);
    assert_eq!(decommit(&name, vb, &block, ByteRange::new(0, 4 * g)), 3 * g, "{name}: decommitting the rest");
    assert_eq!(committed(&name, vb, &block), 0);
    assert_eq!(commit(&name, vb, &block, ByteRange::new(2 * g, g)), g, "{name}: recommitting after decommit");
    assert_eq!(release_complete(&*a, block), g, "{name}: release must report the one granule still committed");
    Checked::Passed
}

/// Capability calls on another instance's block, or on a released block, are `NotOwned`.
pub fn virtual_rejects_foreign_allocations(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let b = suite.make();
    let name = a.name().to_owned();
    let (vb, g) = require!(need_virtual(&*a));
    let theirs = allocate(&*b, 2 * g, g);
    let what = "a capability call on another allocator's block";
    expect_capability_error(&name, what, vb.commit(&theirs, ByteRange::new(0, g)), "NotOwned", is_not_owned);
    expect_capability_error(&name, what, vb.decommit(&theirs, ByteRange::new(0, g)), "NotOwned", is_not_owned);
    expect_capability_error(&name, what, vb.committed_bytes(&theirs), "NotOwned", is_not_owned);
    if let Some(their_vb) = b.virtual_backing() {
        assert_eq!(
            committed(&name, their_vb, &theirs),
            0,
            "{name}: a refused call committed memory of another allocator"
        );
    }
    release_complete(&*b, theirs);

    let ours = allocate(&*a, 2 * g, g);
    let stale = RawAllocation::new(ours.address(), ours.bytes(), ours.align(), ours.device(), ours.provider_tag());
    release_complete(&*a, ours);
    let what = "a capability call on a released block";
    expect_capability_error(&name, what, vb.commit(&stale, ByteRange::new(0, g)), "NotOwned", is_not_owned);
    expect_capability_error(&name, what, vb.committed_bytes(&stale), "NotOwned", is_not_owned);
    Checked::Passed
}

/// Committed pages are accessible; uncommitted and decommitted pages are not.
pub fn virtual_memory_access(suite: &Suite<'_>) -> Checked {
    let access = require!(need_access(suite));
    let a = suite.make();
    let name = a.name().to_owned();
    let (vb, g) = require!(need_virtual(&*a));
    let block = allocate(&*a, 3 * g, g);
    assert!(access.write(block.address(), &[1]).is_err(), "{name}: an uncommitted reservation accepted a write");
    commit(&name, vb, &block, ByteRange::new(0, g));
    let data = pattern(1, g);
    access.write(block.address(), &data).unwrap_or_else(|e| panic!("{name}: a committed granule is not writable: {e}"));
    assert!(access.read(block.address(), g).ok() == Some(data), "{name}: a committed granule lost what was written");
    assert!(
        access.write(at(&block, g), &[1]).is_err(),
        "{name}: the uncommitted granule after a commit accepted a write"
    );
    decommit(&name, vb, &block, ByteRange::new(0, g));
    assert!(access.write(block.address(), &[1]).is_err(), "{name}: a decommitted granule accepted a write");
    assert!(access.read(block.address(), 1).is_err(), "{name}: a decommitted granule can still be read");
    commit(&name, vb, &block, ByteRange::new(0, g));
    access.write(block.address(), &[9; 16]).unwrap_or_else(|e| panic!("{name}: a recommitted granule: {e}"));
    release_complete(&*a, block);
    Checked::Passed
}

/// Racing commits (then decommits) of overlapping ranges count every page once.
pub fn virtual_concurrent_commit_counts_each_page_once(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let name = a.name().to_owned();
    let (vb, g) = require!(need_virtual(&*a));
    const GRANULES: usize = 16;
    let block = allocate(&*a, GRANULES * g, g);
    for phase in ["commit", "decommit"] {
        let total = AtomicUsize::new(0);
        let errors = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for t in 0..suite.thread_count() {
                let (block, total, errors) = (&block, &total, &errors);
                s.spawn(move || {
                    for k in 0..GRANULES {
                        // Each thread walks the granules from a different start, two at a time.
                        let first = (t * 5 + k) % (GRANULES - 1);
                        let range = ByteRange::new(first * g, 2 * g);
                        let result =
                            if phase == "commit" { vb.commit(block, range) } else { vb.decommit(block, range) };
                        match result {
                            Ok(n) => {
                                total.fetch_add(n, Ordering::SeqCst);
                            }
                            Err(e) => errors.lock().unwrap_or_else(PoisonError::into_inner).push(e.to_string()),
                        }
                    }
                });
            }
        });
        let errors = errors.into_inner().unwrap_or_else(PoisonError::into_inner);
        assert!(errors.is_empty(), "{name}: concurrent {phase} failed: {errors:?}");
        assert_eq!(
            total.into_inner(),
            GRANULES * g,
            "{name}: racing {phase}s reported a different number of bytes than the {GRANULES} granules"
        );
    }
    assert_eq!(committed(&name, vb, &block), 0);
    assert_eq!(release_complete(&*a, block), 0);
    Checked::Passed
}

// ---------------------------------------------------------------------------------------
// SharedMapping
// ---------------------------------------------------------------------------------------

/// A backing resource no allocator made.
#[derive(Debug)]
struct ForeignResource(usize);

impl SharedBackingResource for ForeignResource {
    fn bytes(&self) -> usize {
        self.0
    }
}

fn create_backing(name: &str, sm: &dyn SharedMapping, bytes: usize) -> SharedBacking {
    sm.create_backing(bytes).unwrap_or_else(|e| panic!("{name}: create_backing({bytes}) failed: {e}"))
}

fn map(
    name: &str,
    sm: &dyn SharedMapping,
    backing: &SharedBacking,
    block: &RawAllocation,
    target: ByteRange,
    backing_offset: usize,
    access: MappingAccess,
) {
    sm.map(backing, block, SharedPlacement { target, backing_offset }, access)
        .unwrap_or_else(|e| panic!("{name}: mapping backing offset {backing_offset} at {target} failed: {e}"));
}

fn unmap(name: &str, sm: &dyn SharedMapping, block: &RawAllocation, range: ByteRange) -> usize {
    sm.unmap(block, range).unwrap_or_else(|e| panic!("{name}: unmap of {range} failed: {e}"))
}

fn expect_map_error(
    name: &str,
    result: Result<(), CapabilityError>,
    what: &str,
    expected: &str,
    matches: impl Fn(&CapabilityError) -> bool,
) {
    match result {
        Err(ref e) if matches(e) => {}
        Err(e) => panic!("{name}: map of {what} failed with `{e}`; expected {expected}"),
        Ok(()) => panic!("{name}: map of {what} succeeded; expected {expected}"),
    }
}

/// Map refuses out-of-bounds, misaligned, foreign-backing and foreign-allocation
/// placements, and maps nothing when it refuses.
pub fn shared_placement_validation(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let b = suite.make();
    let name = a.name().to_owned();
    let (sm, g) = require!(need_shared(&*a));
    let backing = create_backing(&name, sm, 2 * g);
    assert_eq!(backing.bytes(), 2 * g, "{name}: create_backing({}) made {} bytes", 2 * g, backing.bytes());
    assert_eq!(backing.device(), a.device(), "{name}: a backing must live on the allocator's device");
    if g > 1 {
        match sm.create_backing(g + g / 2) {
            Err(CapabilityError::Misaligned { .. }) => {}
            other => panic!("{name}: create_backing of {} bytes must be Misaligned, got {other:?}", g + g / 2),
        }
    }
    let block = allocate(&*a, 4 * g, g);
    let rw = MappingAccess::ReadWrite;
    let mut cases: Vec<(ByteRange, usize, &str, Matcher)> = vec![
        (ByteRange::new(3 * g, 2 * g), 0, "OutOfBounds", is_out_of_bounds),
        (ByteRange::new(0, 2 * g), g, "BackingOutOfBounds", is_backing_out_of_bounds),
        (ByteRange::new(0, g), 0usize.wrapping_sub(g), "BackingOutOfBounds", is_backing_out_of_bounds),
    ];
    if g > 1 {
        cases.push((ByteRange::new(g / 2, g), 0, "Misaligned", is_misaligned));
        cases.push((ByteRange::new(0, g), g / 2, "Misaligned", is_misaligned));
    }
    for (target, backing_offset, expected, matches) in cases {
        let what = format!("backing offset {backing_offset} at {target}");
        let result = sm.map(&backing, &block, SharedPlacement { target, backing_offset }, rw);
        expect_map_error(&name, result, &what, expected, matches);
        assert_eq!(unmap(&name, sm, &block, ByteRange::new(0, 4 * g)), 0, "{name}: a refused map left bytes mapped");
    }
    let placement = SharedPlacement { target: ByteRange::new(0, g), backing_offset: 0 };
    let is_foreign = |e: &CapabilityError| matches!(e, CapabilityError::ForeignBacking { .. });
    let fake = SharedBacking::new(a.device(), Arc::new(ForeignResource(2 * g)));
    expect_map_error(
        &name,
        sm.map(&fake, &block, placement, rw),
        "a backing no allocator made",
        "ForeignBacking",
        is_foreign,
    );
    let elsewhere = SharedBacking::new(other_device(a.device()), Arc::new(ForeignResource(2 * g)));
    expect_map_error(
        &name,
        sm.map(&elsewhere, &block, placement, rw),
        "another device's backing",
        "ForeignBacking",
        is_foreign,
    );
    let theirs = allocate(&*b, 2 * g, g);
    expect_map_error(
        &name,
        sm.map(&backing, &theirs, placement, rw),
        "another allocator's block",
        "NotOwned",
        is_not_owned,
    );
    assert_eq!(unmap(&name, sm, &block, ByteRange::new(0, 4 * g)), 0, "{name}: a refused map left bytes mapped");
    assert_eq!(release_complete(&*a, block), 0, "{name}: a reservation with nothing mapped unmaps 0 bytes");
    release_complete(&*b, theirs);
    Checked::Passed
}

/// A map over a range that is partly mapped fails and maps nothing; its free neighbours
/// stay mappable.
pub fn shared_map_is_transactional(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let name = a.name().to_owned();
    let (sm, g) = require!(need_shared(&*a));
    let backing = create_backing(&name, sm, 4 * g);
    let block = allocate(&*a, 4 * g, g);
    let rw = MappingAccess::ReadWrite;
    map(&name, sm, &backing, &block, ByteRange::new(g, g), 0, rw);
    for target in [ByteRange::new(0, 2 * g), ByteRange::new(g, 2 * g), ByteRange::new(0, 4 * g)] {
        let result = sm.map(&backing, &block, SharedPlacement { target, backing_offset: 0 }, rw);
        let already = |e: &CapabilityError| matches!(e, CapabilityError::AlreadyMapped { .. });
        expect_map_error(&name, result, &format!("{target} over a mapped granule"), "AlreadyMapped", already);
        assert_eq!(unmap(&name, sm, &block, ByteRange::new(0, g)), 0, "{name}: a failed map mapped [0, g)");
        assert_eq!(unmap(&name, sm, &block, ByteRange::new(2 * g, 2 * g)), 0, "{name}: a failed map mapped [2g, 4g)");
    }
    map(&name, sm, &backing, &block, ByteRange::new(0, g), 0, rw);
    map(&name, sm, &backing, &block, ByteRange::new(2 * g, 2 * g), 2 * g, MappingAccess::ReadOnly);
    assert_eq!(unmap(&name, sm, &block, ByteRange::new(0, 4 * g)), 4 * g, "{name}: unmapping four mapped granules");
    release_complete(&*a, block);
    Checked::Passed
}

/// Unmap returns exactly the bytes it unmapped, refuses bad ranges, and release unmaps
/// whatever is left.
pub fn shared_unmap_accounting(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let name = a.name().to_owned();
    let (sm, g) = require!(need_shared(&*a));
    let backing = create_backing(&name, sm, 2 * g);
    let block = allocate(&*a, 4 * g, g);
    map(&name, sm, &backing, &block, ByteRange::new(0, 2 * g), 0, MappingAccess::ReadWrite);
    map(&name, sm, &backing, &block, ByteRange::new(3 * g, g), g, MappingAccess::ReadOnly);
    assert_eq!(unmap(&name, sm, &block, ByteRange::new(0, g)), g, "{name}: unmapping one mapped granule");
    assert_eq!(unmap(&name, sm, &block, ByteRange::new(0, g)), 0, "{name}: unmapping it again unmaps 0");
    for (range, expected, matches) in bad_ranges(g) {
        expect_capability_error(&name, &format!("unmap of {range}"), sm.unmap(&block, range), expected, matches);
    }
    assert_eq!(unmap(&name, sm, &block, ByteRange::new(0, 4 * g)), 2 * g, "{name}: unmapping the two left");
    map(&name, sm, &backing, &block, ByteRange::new(g, 2 * g), 0, MappingAccess::ReadWrite);
    release_complete(&*a, block);
    Checked::Passed
}

fn write(name: &str, access: &dyn MemoryAccess, address: DeviceAddress, data: &[u8]) {
    access.write(address, data).unwrap_or_else(|e| panic!("{name}: {e}"));
}

fn read(name: &str, access: &dyn MemoryAccess, address: DeviceAddress, len: usize) -> Vec<u8> {
    access.read(address, len).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// A write through one mapping is visible through every mapping of the backing, also
/// after the last backing handle is dropped.
pub fn shared_visibility_across_mappings(suite: &Suite<'_>) -> Checked {
    let access = require!(need_access(suite));
    let a = suite.make();
    let name = a.name().to_owned();
    let (sm, g) = require!(need_shared(&*a));
    let backing = create_backing(&name, sm, 2 * g);
    let whole = allocate(&*a, 2 * g, g);
    let second_half = allocate(&*a, g, g);
    let again = allocate(&*a, 2 * g, g);
    let rw = MappingAccess::ReadWrite;
    map(&name, sm, &backing, &whole, ByteRange::new(0, 2 * g), 0, rw);
    map(&name, sm, &backing, &second_half, ByteRange::new(0, g), g, rw);
    map(&name, sm, &backing, &again, ByteRange::new(0, 2 * g), 0, rw);
    let data = pattern(1, g);
    write(&name, access, at(&whole, g), &data);
    assert!(
        read(&name, access, second_half.address(), g) == data,
        "{name}: a write is not visible at backing offset g"
    );
    assert!(read(&name, access, at(&again, g), g) == data, "{name}: a write is not visible through a second mapping");
    let data = pattern(2, g);
    write(&name, access, second_half.address(), &data);
    assert!(read(&name, access, at(&whole, g), g) == data, "{name}: a write through an offset mapping is not visible");
    drop(backing);
    let data = pattern(3, 2 * g);
    write(&name, access, again.address(), &data);
    assert!(
        read(&name, access, whole.address(), 2 * g) == data,
        "{name}: mappings stopped sharing when the handle dropped"
    );
    for block in [whole, second_half, again] {
        release_complete(&*a, block);
    }
    Checked::Passed
}

/// A read-only mapping refuses writes (without crashing) and sees writes made through a
/// writable mapping.
pub fn shared_read_only(suite: &Suite<'_>) -> Checked {
    let access = require!(need_access(suite));
    let a = suite.make();
    let name = a.name().to_owned();
    let (sm, g) = require!(need_shared(&*a));
    let backing = create_backing(&name, sm, g);
    let writer = allocate(&*a, g, g);
    let reader = allocate(&*a, g, g);
    map(&name, sm, &backing, &writer, ByteRange::new(0, g), 0, MappingAccess::ReadWrite);
    map(&name, sm, &backing, &reader, ByteRange::new(0, g), 0, MappingAccess::ReadOnly);
    let data = pattern(4, g);
    write(&name, access, writer.address(), &data);
    assert!(read(&name, access, reader.address(), g) == data, "{name}: a read-only mapping does not see a write");
    assert!(access.write(reader.address(), &[0xEE; 8]).is_err(), "{name}: a read-only mapping accepted a write");
    assert!(read(&name, access, writer.address(), g) == data, "{name}: a refused write changed the backing");
    release_complete(&*a, reader);
    release_complete(&*a, writer);
    Checked::Passed
}

// ---------------------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------------------

/// Several threads allocate blocks of mixed sizes and alignments at once: all live
/// blocks are disjoint, hold what their thread wrote (when memory can be accessed), and
/// release completely.
pub fn concurrent_use(suite: &Suite<'_>) -> Checked {
    let a = suite.make();
    let name = a.name().to_owned();
    let access = if plain(&*a) { suite.access() } else { None };
    let threads = suite.thread_count();
    const ROUNDS: u64 = 12;
    const PER_ROUND: usize = 8;
    let live = Mutex::new(Vec::<(u64, usize)>::new());
    let failures = Mutex::new(Vec::<String>::new());
    let barrier = Barrier::new(threads);
    let record = |message: String| failures.lock().unwrap_or_else(PoisonError::into_inner).push(message);
    // Every call into the allocator is caught, so a panicking allocator is reported
    // instead of leaving the other threads waiting at the barrier.
    let guarded = |what: &str, f: &mut dyn FnMut()| {
        if let Err(panic) = catch_unwind(AssertUnwindSafe(f)) {
            let message = panic.downcast_ref::<String>().cloned().unwrap_or_else(|| "non-string panic".to_owned());
            record(format!("{what} panicked: {message}"));
        }
    };
    std::thread::scope(|s| {
        for t in 0..threads {
            let (a, live, barrier, record, guarded) = (&*a, &live, &barrier, &record, &guarded);
            s.spawn(move || {
                let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ (t as u64 + 1);
                for round in 0..ROUNDS {
                    let mut blocks = Vec::new();
                    let tag = (t as u64) << 32 | round;
                    guarded(&format!("thread {t} allocating"), &mut || {
                        for _ in 0..PER_ROUND {
                            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                            let bytes = (seed >> 33) as usize % 20000;
                            let align = [8, 64, 256, 4096][(seed >> 20) as usize % 4];
                            match a.allocate(&request(bytes, align)) {
                                Ok(block) => {
                                    if !block.address().is_aligned_to(align) {
                                        record(format!("thread {t}: {block:?} is not aligned to {align}"));
                                    }
                                    blocks.push(block);
                                }
                                Err(e) => record(format!("thread {t}: allocate({bytes}, {align}) failed: {e}")),
                            }
                        }
                        if let Some(access) = access {
                            for (i, block) in blocks.iter().enumerate() {
                                if let Err(e) = access.write(block.address(), &pattern(tag + i as u64, block.bytes())) {
                                    record(format!("thread {t}: {e}"));
                                }
                            }
                        }
                    });
                    live.lock().unwrap_or_else(PoisonError::into_inner).extend(spans(&blocks));
                    // Everyone has allocated and written: check overlap, then contents.
                    barrier.wait();
                    if t == 0 {
                        let mut spans = std::mem::take(&mut *live.lock().unwrap_or_else(PoisonError::into_inner));
                        guarded(&format!("round {round}: overlap check"), &mut || assert_disjoint("", &mut spans));
                    }
                    if let Some(access) = access {
                        guarded(&format!("thread {t} reading"), &mut || {
                            for (i, block) in blocks.iter().enumerate() {
                                let expected = pattern(tag + i as u64, block.bytes());
                                match access.read(block.address(), block.bytes()) {
                                    Ok(read) if read == expected => {}
                                    Ok(_) => record(format!("thread {t}: {block:?} was overwritten by another thread")),
                                    Err(e) => record(format!("thread {t}: {e}")),
                                }
                            }
                        });
                    }
                    barrier.wait();
                    for block in blocks {
                        let what = format!("{block:?}");
                        let mut block = Some(block);
                        guarded(&format!("thread {t} releasing {what}"), &mut || {
                            if let Some(block) = block.take() {
                                let outcome = a.release(block);
                                if !outcome.is_complete() {
                                    record(format!("thread {t}: release of {what}: {}", outcome.summary()));
                                }
                            }
                        });
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap_or_else(PoisonError::into_inner);
    assert!(failures.is_empty(), "{name}: concurrent use broke the contract:\n  {}", failures.join("\n  "));
    Checked::Passed
}
