//! The conformance suite every [`DeviceAllocator`] must pass.
//!
//! Each check is a plain function (see [`checks`]) that takes a [`Suite`], makes fresh
//! allocators from its factory, and panics with a message naming what was asked, what
//! came back and what the contract says. A check that cannot apply (no
//! [`VirtualBacking`](memory_api::VirtualBacking), no [`MemoryAccess`] given) returns
//! [`Checked::Skipped`] with the reason, so a report always names what did not run.
//!
//! [`Suite::run`] runs every check in [`CHECKS`] with a fresh allocator, catching panics,
//! and returns a [`Report`]; [`run_all`] also prints the report and fails if any check
//! failed. The suite never dereferences allocator memory itself: memory checks go
//! through a [`MemoryAccess`], so it runs unchanged over device allocators.
//!
//! ```
//! use memory_testkit::{HostHeap, conformance};
//!
//! let report = conformance::Suite::new(HostHeap::new).with_access(&HostHeap::access()).run();
//! report.assert_passed();
//! assert!(report.ran("memory_is_writable"));
//! assert!(report.skipped().iter().any(|(name, _)| *name == "virtual_commit_accounting"));
//! ```

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};

use memory_api::DeviceAllocator;

use crate::access::MemoryAccess;

pub mod checks;
#[cfg(test)]
pub(crate) mod tests_support;

/// What a check that did not fail found.
#[must_use = "a skipped check did not verify anything"]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Checked {
    /// The allocator met the contract.
    Passed,
    /// The check does not apply; the reason says why.
    Skipped(String),
}

/// One conformance check.
#[derive(Copy, Clone, Debug)]
pub struct Check {
    /// The check's name (also the function's name in [`checks`]).
    pub name: &'static str,
    /// What the check proves.
    pub about: &'static str,
    /// Runs the check; panics on failure.
    pub run: fn(&Suite<'_>) -> Checked,
}

macro_rules! check_table {
    ($($name:ident: $about:literal,)*) => {
        /// Every check, in the order [`Suite::run`] runs them.
        pub const CHECKS: &[Check] = &[$(Check { name: stringify!($name), about: $about, run: checks::$name },)*];
    };
}

check_table! {
    alignment: "every power-of-two alignment up to 2 MiB is honoured or refused with AlignmentTooLarge (at least 256 honoured)",
    distinct_blocks: "live blocks never overlap, whatever their sizes",
    zero_size: "a zero-byte request yields a unique, aligned, releasable block",
    invalid_layouts: "invalid layouts and impossible sizes are typed errors, never panics; the allocator still works after them",
    release_refuses_foreign_blocks: "a block from another allocator, another device or with another size is handed back by a Failed release",
    stats_follow_live_blocks: "stats count live blocks and totals exactly",
    trim_keeps_live_blocks: "trim returns cached memory only; live blocks stay valid and releasable",
    memory_is_writable: "plain allocations are readable and writable over their whole size, independently of each other",
    virtual_bounds_and_granularity: "commit and decommit refuse out-of-bounds, overflowing and misaligned ranges without committing anything",
    virtual_commit_accounting: "commit returns only newly committed bytes; committed_bytes and the release's unmapped bytes are exact",
    virtual_decommit_returns_released_bytes: "decommit returns exactly the bytes it released",
    virtual_rejects_foreign_allocations: "capability calls on another allocator's block or a released block are NotOwned",
    virtual_memory_access: "committed pages are accessible; uncommitted and decommitted pages are not",
    virtual_concurrent_commit_counts_each_page_once: "racing commits and decommits count every page exactly once",
    shared_placement_validation: "map refuses out-of-bounds, misaligned, foreign-backing and foreign-allocation placements",
    shared_map_is_transactional: "a map that fails leaves nothing mapped",
    shared_unmap_accounting: "unmap returns exactly the bytes it unmapped; release unmaps the rest",
    shared_visibility_across_mappings: "a write through one mapping is visible through every mapping of the same backing",
    shared_read_only: "a read-only mapping refuses writes and still sees writes made elsewhere",
    concurrent_use: "several threads allocating, writing and releasing at once get disjoint blocks and complete releases",
}

/// Subject and settings for a conformance run: a factory for fresh allocators, an
/// optional [`MemoryAccess`] and a thread count.
pub struct Suite<'a> {
    make: Box<dyn Fn() -> Box<dyn DeviceAllocator + 'a> + 'a>,
    access: Option<&'a dyn MemoryAccess>,
    threads: usize,
}

impl<'a> Suite<'a> {
    /// A suite over allocators made by `make` (called once per check, and twice by
    /// checks that need a second, foreign allocator).
    pub fn new<A: DeviceAllocator + 'a>(make: impl Fn() -> A + 'a) -> Suite<'a> {
        Suite { make: Box::new(move || Box::new(make())), access: None, threads: 4 }
    }

    /// Enables the memory checks, reading and writing through `access`.
    #[must_use]
    pub fn with_access(mut self, access: &'a dyn MemoryAccess) -> Suite<'a> {
        self.access = Some(access);
        self
    }

    /// Threads used by the concurrency checks (default 4, at least 2).
    #[must_use]
    pub fn threads(mut self, threads: usize) -> Suite<'a> {
        self.threads = threads.max(2);
        self
    }

    /// A fresh allocator from the factory.
    pub fn make(&self) -> Box<dyn DeviceAllocator + 'a> {
        (self.make)()
    }

    /// The memory accessor, if one was given.
    pub fn access(&self) -> Option<&'a dyn MemoryAccess> {
        self.access
    }

    /// Threads for the concurrency checks.
    pub fn thread_count(&self) -> usize {
        self.threads
    }

    /// Runs one check by name, catching its panic; `None` for an unknown name.
    pub fn run_check(&self, name: &str) -> Option<CheckRecord> {
        CHECKS.iter().find(|check| check.name == name).map(|check| self.run_one(check))
    }

    fn run_one(&self, check: &Check) -> CheckRecord {
        let verdict = match catch_unwind(AssertUnwindSafe(|| (check.run)(self))) {
            Ok(Checked::Passed) => Verdict::Passed,
            Ok(Checked::Skipped(reason)) => Verdict::Skipped(reason),
            Err(payload) => {
                let message = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_else(|| "panicked with a non-string payload".to_owned());
                Verdict::Failed(message)
            }
        };
        CheckRecord { name: check.name, verdict }
    }

    /// Runs every check in [`CHECKS`]; never panics.
    pub fn run(&self) -> Report {
        let allocator = self.make();
        let label = format!("{} on {}", allocator.name(), allocator.device());
        drop(allocator);
        Report { allocator: label, records: CHECKS.iter().map(|check| self.run_one(check)).collect() }
    }
}

impl fmt::Debug for Suite<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Suite").field("access", &self.access.is_some()).field("threads", &self.threads).finish()
    }
}

/// Runs every check over allocators made by `make` (memory checks skipped), prints the
/// report to stderr and returns it.
///
/// # Panics
/// If any check failed; the message lists every failure.
pub fn run_all<'a, A: DeviceAllocator + 'a>(make: impl Fn() -> A + 'a) -> Report {
    let report = Suite::new(make).run();
    eprintln!("{report}");
    report.assert_passed();
    report
}

/// Like [`run_all`], with the memory checks enabled through `access`.
///
/// # Panics
/// If any check failed.
pub fn run_all_with_access<'a, A: DeviceAllocator + 'a>(
    make: impl Fn() -> A + 'a,
    access: &'a dyn MemoryAccess,
) -> Report {
    let report = Suite::new(make).with_access(access).run();
    eprintln!("{report}");
    report.assert_passed();
    report
}

/// The verdict of one check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The contract held.
    Passed,
    /// The check did not apply, for the reason given.
    Skipped(String),
    /// The contract was broken; the message says how.
    Failed(String),
}

/// One check's name and verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckRecord {
    /// The check's name.
    pub name: &'static str,
    /// What happened.
    pub verdict: Verdict,
}

/// The verdicts of a conformance run.
#[derive(Clone, Debug)]
pub struct Report {
    /// The allocator's name and device.
    pub allocator: String,
    /// One record per check, in run order.
    pub records: Vec<CheckRecord>,
}

impl Report {
    /// Names of the checks that passed.
    pub fn passed(&self) -> Vec<&'static str> {
        self.records.iter().filter(|r| r.verdict == Verdict::Passed).map(|r| r.name).collect()
    }

    /// Checks that were skipped, with their reasons.
    pub fn skipped(&self) -> Vec<(&'static str, &str)> {
        self.records
            .iter()
            .filter_map(|r| match &r.verdict {
                Verdict::Skipped(reason) => Some((r.name, reason.as_str())),
                _ => None,
            })
            .collect()
    }

    /// Checks that failed, with their messages.
    pub fn failures(&self) -> Vec<(&'static str, &str)> {
        self.records
            .iter()
            .filter_map(|r| match &r.verdict {
                Verdict::Failed(message) => Some((r.name, message.as_str())),
                _ => None,
            })
            .collect()
    }

    /// Whether the check `name` ran and passed.
    pub fn ran(&self, name: &str) -> bool {
        self.records.iter().any(|r| r.name == name && r.verdict == Verdict::Passed)
    }

    /// # Panics
    /// If any check failed; the message lists each failure by name.
    pub fn assert_passed(&self) {
        let failures = self.failures();
        if !failures.is_empty() {
            let list: Vec<String> = failures.iter().map(|(name, message)| format!("  {name}: {message}")).collect();
            panic!("{} failed {} conformance check(s):\n{}", self.allocator, failures.len(), list.join("\n"));
        }
    }

    /// # Panics
    /// Unless every check in `names` ran and passed (so a test can insist that a
    /// capability was really exercised rather than skipped).
    pub fn assert_ran(&self, names: &[&str]) {
        for name in names {
            let record = self.records.iter().find(|r| r.name == *name);
            match record.map(|r| &r.verdict) {
                Some(Verdict::Passed) => {}
                Some(verdict) => panic!("{}: conformance check {name} did not pass: {verdict:?}", self.allocator),
                None => panic!("{}: there is no conformance check named {name}", self.allocator),
            }
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "conformance of {}:", self.allocator)?;
        for record in &self.records {
            match &record.verdict {
                Verdict::Passed => writeln!(f, "  ok       {}", record.name)?,
                Verdict::Skipped(reason) => writeln!(f, "  skipped  {} ({reason})", record.name)?,
                Verdict::Failed(message) => writeln!(f, "  FAILED   {}: {message}", record.name)?,
            }
        }
        write!(
            f,
            "conformance of {}: {} ok, {} failed, {} skipped",
            self.allocator,
            self.passed().len(),
            self.failures().len(),
            self.skipped().len()
        )
    }
}
