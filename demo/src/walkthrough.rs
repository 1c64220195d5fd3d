//! The walkthrough, on `allocator_cpu::SystemAllocator` (the production host backend):
//! allocate one block per role, write and verify a pattern per role, show that bad
//! layouts are typed errors, release every block (once through an allocator that does
//! not own it, to show the honest `Failed` outcome handing the block back), and end with
//! a table and the check that nothing is left live.
//!
//! `SystemAllocator` hands out addresses; touching the memory behind them is `unsafe`,
//! which this binary forbids. So the write path runs on the demo's own safe-Rust heap
//! ([`VecHostAllocator`]), which holds each block in a `Vec` it can index.

use std::fmt::Write as _;
use std::io::{self, Write};

use memory_api::{
    AllocationRequest, DeviceAllocator, IdentityIssuer, MemoryRole, RawAllocation, ReleaseOutcome, ReleaseSummary,
};

use allocator_cpu::SystemAllocator;

use crate::host::VecHostAllocator;

/// The blocks the walkthrough allocates: role, bytes, alignment.
pub(crate) const PLAN: [(MemoryRole, usize, usize); 4] = [
    (MemoryRole::Weights, 4 << 20, 4096),
    (MemoryRole::KvCache, 256 << 10, 256),
    (MemoryRole::Activations, 64 << 10, 64),
    (MemoryRole::Workspace, 0, 8),
];

/// What happened to one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Row {
    /// What the block was for.
    pub(crate) role: MemoryRole,
    /// Its size.
    pub(crate) bytes: usize,
    /// Its alignment.
    pub(crate) align: usize,
    /// Whether the pattern written into a block of this role read back intact.
    pub(crate) verified: bool,
    /// The final release outcome.
    pub(crate) release: ReleaseSummary,
}

/// The walkthrough's result, for the closing check and for tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Report {
    /// One row per allocated block.
    pub(crate) rows: Vec<Row>,
    /// Bad requests that were refused with a typed error (message per request).
    pub(crate) refused: Vec<String>,
    /// Releases through a non-owning allocator that were refused with the block handed back.
    pub(crate) handed_back: usize,
    /// Bytes still live in the allocator at the end.
    pub(crate) live_bytes_at_end: u64,
    /// Problems found (an empty list means every check passed).
    pub(crate) problems: Vec<String>,
}

impl Report {
    /// Whether every check passed.
    pub(crate) fn passed(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Runs the walkthrough, printing to `out`.
///
/// # Errors
/// Only when writing to `out` fails; problems with memory are recorded in the report.
pub(crate) fn run(out: &mut dyn Write) -> io::Result<Report> {
    let host = SystemAllocator::new();
    let stranger = SystemAllocator::new();
    let heap = VecHostAllocator::new("safe-heap");
    let mut report = Report::default();

    writeln!(out, "memory-demo: the memory-api contract on the CPU backend")?;
    writeln!(out, "allocator: allocator_cpu::SystemAllocator (\"{}\") on {}\n", host.name(), host.device())?;

    writeln!(out, "1. Allocate one block per role")?;
    writeln!(out, "   {:<12} {:>9} {:>6}  address", "role", "bytes", "align")?;
    let mut blocks: Vec<(MemoryRole, RawAllocation)> = Vec::new();
    for (role, bytes, align) in PLAN {
        let request = match AllocationRequest::new(bytes, align) {
            Ok(request) => request.with_role(role),
            Err(err) => {
                report.problems.push(format!("the plan's {role} request is invalid: {err}"));
                continue;
            }
        };
        match host.allocate(&request) {
            Ok(block) => {
                let note = if bytes == 0 { "  (zero-size: unique and releasable)" } else { "" };
                writeln!(out, "   {:<12} {:>9} {:>6}  {}{note}", role.name(), bytes, align, block.address())?;
                if !block.address().is_aligned_to(align) {
                    report.problems.push(format!("{role} block at {} is not aligned to {align}", block.address()));
                }
                blocks.push((role, block));
            }
            Err(err) => report.problems.push(format!("allocating {role}: {err}")),
        }
    }

    let mut addresses: Vec<u64> = blocks.iter().map(|(_, block)| block.address().get()).collect();
    addresses.sort_unstable();
    addresses.dedup();
    if addresses.len() != blocks.len() {
        report.problems.push("two live blocks share an address".to_owned());
    }

    writeln!(out, "\n2. Write a pattern per role and read it back")?;
    writeln!(
        out,
        "   ({} hands out addresses; touching them needs unsafe code, which this binary forbids,\n    \
         so the write path runs on the demo's {} allocator: safe Rust, one Vec per block)",
        host.name(),
        heap.name()
    )?;
    let mut verified = Vec::new();
    for (i, (role, block)) in blocks.iter().enumerate() {
        let ok = match write_and_verify(&heap, i, block) {
            Ok(()) => true,
            Err(problem) => {
                report.problems.push(format!("{role}: {problem}"));
                false
            }
        };
        writeln!(out, "   {:<12} {:>9} bytes written on {}, {}", role.name(), block.bytes(), heap.name(), verdict(ok))?;
        verified.push(ok);
    }

    writeln!(out, "\n3. Bad layouts are typed errors, not panics")?;
    let bad: [(&str, usize, usize); 3] = [
        ("64 bytes aligned to 3", 64, 3),
        ("usize::MAX bytes aligned to 8", usize::MAX, 8),
        ("isize::MAX - 4095 bytes", AllocationRequest::MAX_BYTES - 4095, 4096),
    ];
    for (what, bytes, align) in bad {
        let refused = match AllocationRequest::new(bytes, align) {
            Err(err) => Some(format!("invalid request: {err}")),
            Ok(request) => match host.allocate(&request) {
                Err(err) => Some(err.to_string()),
                Ok(block) => {
                    report.problems.push(format!("{what} was accepted"));
                    drop(host.release(block));
                    None
                }
            },
        };
        if let Some(message) = refused {
            writeln!(out, "   {what:<30} -> {message}")?;
            report.refused.push(message);
        }
    }

    writeln!(out, "\n4. Release: every outcome is honest")?;
    let mut rows = Vec::new();
    for (i, (role, block)) in blocks.into_iter().enumerate() {
        let block = if role == MemoryRole::KvCache {
            // The wrong allocator must refuse without touching the block and hand it back.
            match stranger.release(block) {
                ReleaseOutcome::Failed(failed) => {
                    let (block, error) = failed.into_parts();
                    writeln!(
                        out,
                        "   {:<12} via {:<16} -> failed, block handed back: {error}",
                        role.name(),
                        "another system"
                    )?;
                    report.handed_back += 1;
                    block
                }
                other => {
                    report
                        .problems
                        .push(format!("another allocator released a block it did not make: {}", other.summary()));
                    continue;
                }
            }
        } else {
            block
        };
        let (bytes, align) = (block.bytes(), block.align());
        let outcome = host.release(block);
        let summary = outcome.summary();
        writeln!(out, "   {:<12} via {:<16} -> {summary}", role.name(), format!("its own {}", host.name()))?;
        if !outcome.is_complete() {
            report.problems.push(format!("{role} did not release completely: {summary}"));
        }
        rows.push(Row { role, bytes, align, verified: verified.get(i).copied().unwrap_or(false), release: summary });
    }
    report.rows = rows;

    writeln!(out, "\n5. Identities come from an issuer and know where they came from")?;
    match (IdentityIssuer::new(), IdentityIssuer::new()) {
        (Ok(ours), Ok(theirs)) => match theirs.mechanism() {
            Ok(mechanism) => {
                let foreign = !ours.issued(&mechanism);
                writeln!(
                    out,
                    "   mechanism {mechanism} from registry {} is {} to registry {}",
                    theirs.registry(),
                    if foreign { "foreign" } else { "NOT foreign" },
                    ours.registry()
                )?;
                if !foreign {
                    report.problems.push("a mechanism from another registry was not recognised as foreign".into());
                }
            }
            Err(err) => report.problems.push(format!("issuing a mechanism: {err}")),
        },
        (Err(err), _) | (_, Err(err)) => report.problems.push(format!("creating an issuer: {err}")),
    }

    let stats = host.stats().unwrap_or_default();
    report.live_bytes_at_end = stats.live_bytes;
    let heap_stats = heap.stats().unwrap_or_default();
    if heap_stats.live_bytes != 0 || heap_stats.live_allocations != 0 {
        report.problems.push(format!("{} bytes are still live on {}", heap_stats.live_bytes, heap.name()));
    }
    if stats.live_bytes != 0 || stats.live_allocations != 0 {
        report.problems.push(format!(
            "{} bytes in {} allocations are still live after releasing everything",
            stats.live_bytes, stats.live_allocations
        ));
    }

    writeln!(out, "\n{}", table(&report))?;
    writeln!(
        out,
        "allocator stats: {} allocations, {} refused, {} bytes live in {} allocations",
        stats.allocations_total, stats.failures_total, stats.live_bytes, stats.live_allocations
    )?;
    if report.passed() {
        writeln!(
            out,
            "check: passed ({} blocks verified and released, {} bad requests refused, {} foreign release handed back, nothing left live)",
            report.rows.len(),
            report.refused.len(),
            report.handed_back
        )?;
    } else {
        writeln!(out, "check: FAILED")?;
        for problem in &report.problems {
            writeln!(out, "  - {problem}")?;
        }
    }
    Ok(report)
}

/// Allocates a block shaped like `like` on the safe heap, writes a pattern, reads it
/// back and releases it.
fn write_and_verify(heap: &VecHostAllocator, seed: usize, like: &RawAllocation) -> Result<(), String> {
    let request = AllocationRequest::new(like.bytes(), like.align()).map_err(|err| err.to_string())?;
    let block = heap.allocate(&request).map_err(|err| err.to_string())?;
    let pattern: Vec<u8> = (0..block.bytes()).map(|j| (j as u8).wrapping_mul(31).wrapping_add(seed as u8)).collect();
    let read = heap.write(&block, 0, &pattern).and_then(|()| heap.read(&block, 0, block.bytes()));
    let outcome = heap.release(block);
    match read {
        Ok(read) if read == pattern && outcome.is_complete() => Ok(()),
        Ok(read) if read == pattern => Err(format!("the safe heap did not release: {}", outcome.summary())),
        Ok(_) => Err("the pattern did not read back intact".to_owned()),
        Err(err) => Err(err.to_string()),
    }
}

fn verdict(ok: bool) -> &'static str {
    if ok { "read back intact" } else { "MISMATCH" }
}

/// The closing table, one row per block.
pub(crate) fn table(report: &Report) -> String {
    let mut text = String::new();
    let _ = writeln!(text, "{:<12} {:>9} {:>6}  {:<8}  release", "role", "bytes", "align", "data");
    let _ = writeln!(text, "{}", "-".repeat(64));
    for row in &report.rows {
        let data = if row.verified { "verified" } else { "BAD" };
        let _ =
            writeln!(text, "{:<12} {:>9} {:>6}  {:<8}  {}", row.role.name(), row.bytes, row.align, data, row.release);
    }
    let total: usize = report.rows.iter().map(|row| row.bytes).sum();
    let _ = write!(text, "{:<12} {:>9}", "total", total);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_walkthrough_passes_every_check() {
        let mut out = Vec::new();
        let report = run(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(report.passed(), "{:?}\n{text}", report.problems);
        assert_eq!(report.rows.len(), PLAN.len());
        assert!(report.rows.iter().all(|row| row.verified));
        assert!(report.rows.iter().all(|row| matches!(row.release, ReleaseSummary::Complete { .. })));
        assert_eq!(report.live_bytes_at_end, 0);
        assert!(text.contains("check: passed"), "{text}");
    }

    #[test]
    fn every_bad_layout_is_refused_with_a_message_that_says_what_to_do() {
        let report = run(&mut Vec::new()).unwrap();
        assert_eq!(report.refused.len(), 3, "{:?}", report.refused);
        assert!(report.refused[0].contains("not a power of two"), "{}", report.refused[0]);
        assert!(report.refused[1].contains("overflows"), "{}", report.refused[1]);
        assert!(report.refused[2].contains("out of memory"), "{}", report.refused[2]);
    }

    #[test]
    fn release_through_the_wrong_allocator_hands_the_block_back() {
        let report = run(&mut Vec::new()).unwrap();
        assert_eq!(report.handed_back, 1);
        let kv = report.rows.iter().find(|row| row.role == MemoryRole::KvCache).unwrap();
        assert_eq!(kv.release, ReleaseSummary::Complete { unmapped_bytes: 256 << 10 });
    }

    #[test]
    fn the_table_has_a_row_per_block_and_a_total() {
        let report = run(&mut Vec::new()).unwrap();
        let table = table(&report);
        assert_eq!(table.lines().count(), 2 + PLAN.len() + 1, "{table}");
        let total: usize = PLAN.iter().map(|(_, bytes, _)| bytes).sum();
        assert!(table.lines().last().unwrap().ends_with(&total.to_string()), "{table}");
    }
}
