//! The ratio table of `cargo xtask bench`: each row sets two results of one run against
//! each other (or one result against an absolute bound) and checks the target the
//! issues set for it.
//!
//! [`RATIOS`] is the table's definition; [`rows`] computes it from criterion's medians
//! and [`render`] prints it as markdown. Both are pure and tested on fixtures; a result
//! the table needs but the run did not produce is reported by name, never skipped.

use std::collections::BTreeMap;

use crate::estimates::{Estimate, Nanos, ResultError};
use crate::table::{self, Align};

/// How a row sets its two results against each other. Times are per element (per
/// iteration where the bench declares no throughput).
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) enum Measure {
    /// `candidate / baseline` time: how much slower the candidate is (lower is better).
    Slowdown {
        /// The baseline's criterion id.
        baseline: &'static str,
    },
    /// `baseline / candidate` time: the candidate's throughput relative to the baseline
    /// (higher is better).
    Speedup {
        /// The baseline's criterion id.
        baseline: &'static str,
    },
    /// `candidate - baseline`, in nanoseconds: the cost above a floor.
    Excess {
        /// The floor's criterion id.
        baseline: &'static str,
    },
    /// `(baseline + candidate) / baseline`: the slowdown implied by a candidate that is
    /// itself a time *above* the baseline, measured with the two interleaved (robust to
    /// a machine whose speed drifts between benches run seconds apart).
    SlowdownOfExcess {
        /// The baseline's criterion id.
        baseline: &'static str,
    },
    /// The candidate's own time, in nanoseconds.
    Absolute,
}

impl Measure {
    fn baseline(self) -> Option<&'static str> {
        match self {
            Measure::Slowdown { baseline }
            | Measure::Speedup { baseline }
            | Measure::Excess { baseline }
            | Measure::SlowdownOfExcess { baseline } => Some(baseline),
            Measure::Absolute => None,
        }
    }

    /// `value` as this measure prints it: `1.23x`, `+25.1 ns`, `12.0 ns`.
    fn format(self, value: f64) -> String {
        match self {
            Measure::Slowdown { .. } | Measure::Speedup { .. } | Measure::SlowdownOfExcess { .. } => {
                format!("{value:.2}x")
            }
            Measure::Excess { .. } if value >= 0.0 => format!("+{}", Nanos(value)),
            Measure::Excess { .. } | Measure::Absolute => Nanos(value).to_string(),
        }
    }
}

/// A row's target.
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) enum Target {
    /// Reported, not judged.
    None,
    /// The value must be at most this.
    AtMost(f64),
    /// The value must be at least this.
    AtLeast(f64),
}

/// One row of the table.
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) struct RatioSpec {
    /// What the row measures, in words.
    pub(crate) name: &'static str,
    /// The issue that sets the target.
    pub(crate) issue: u32,
    /// How the two results are set against each other.
    pub(crate) measure: Measure,
    /// The candidate's criterion id.
    pub(crate) candidate: &'static str,
    /// What one element is, for benches that declare a throughput (`page`).
    pub(crate) element: Option<&'static str>,
    /// The target.
    pub(crate) target: Target,
}

const fn row(issue: u32, name: &'static str, measure: Measure, candidate: &'static str, target: Target) -> RatioSpec {
    RatioSpec { name, issue, measure, candidate, element: None, target }
}

const fn per(spec: RatioSpec, element: &'static str) -> RatioSpec {
    RatioSpec { element: Some(element), ..spec }
}

/// The table: the issues' targets, in issue order. Renaming a bench means changing its
/// id here too (a stale id shows up as a missing result).
pub(crate) const RATIOS: [RatioSpec; 31] = [
    // Issue 3: the registry's hot path against the same allocator through `&dyn`.
    row(3, "pair: bound / raw allocator", Measure::Slowdown { baseline: "pair/raw_dyn" }, "pair/bound", Target::None),
    row(
        3,
        "2 threads, one mechanism, each binding for itself: throughput vs 1 thread",
        Measure::Speedup { baseline: "threads/one_thread" },
        "threads/two_own_bindings",
        Target::AtLeast(1.6),
    ),
    row(
        3,
        "2 threads, two devices: throughput vs 1 thread",
        Measure::Speedup { baseline: "threads/one_thread" },
        "threads/two_devices",
        Target::AtLeast(1.8),
    ),
    row(
        3,
        "pair with 100k live / with none",
        Measure::Slowdown { baseline: "live/none" },
        "live/100k_live",
        Target::AtMost(1.3),
    ),
    row(
        3,
        "pair after releasing them / with none",
        Measure::Slowdown { baseline: "live/none" },
        "live/after_release",
        Target::AtMost(1.1),
    ),
    // Issue 12: scaling however a runtime shares its bindings, the pair's overhead,
    // bind at any device count.
    row(
        12,
        "pair: bound above the raw floor (counter allocator)",
        Measure::Excess { baseline: "pair/raw_dyn" },
        "pair/bound",
        Target::AtMost(25.0),
    ),
    row(
        12,
        "pair: bound above the raw floor (per-thread slot pool)",
        Measure::Excess { baseline: "pair_pool/raw_dyn" },
        "pair_pool/bound",
        Target::AtMost(25.0),
    ),
    row(
        12,
        "pair: dropping a host allocation / releasing it",
        Measure::Slowdown { baseline: "pair/bound" },
        "pair/bound_drop",
        Target::AtMost(1.1),
    ),
    row(12, "bind(device) + drop, 1 device", Measure::Absolute, "bind/one_device", Target::AtMost(15.0)),
    row(12, "bind(device) + drop, the 64th of 64 devices", Measure::Absolute, "bind/64_devices", Target::AtMost(15.0)),
    row(
        12,
        "bind: 64 devices / 1 device",
        Measure::Slowdown { baseline: "bind/one_device" },
        "bind/64_devices",
        Target::AtMost(1.1),
    ),
    row(
        12,
        "2 threads using bindings made on one thread: throughput vs 1 thread",
        Measure::Speedup { baseline: "threads/one_thread" },
        "threads/two_bound_on_one_thread",
        Target::AtLeast(1.8),
    ),
    row(
        12,
        "2 threads sharing one binding by reference: throughput vs 1 thread",
        Measure::Speedup { baseline: "threads/one_thread" },
        "threads/two_shared_ref",
        Target::AtLeast(1.8),
    ),
    row(
        12,
        "2 threads, every block released by the other thread / by its own",
        Measure::Slowdown { baseline: "threads/two_local_batches" },
        "threads/two_cross_release",
        Target::None,
    ),
    row(
        12,
        "2 threads sharing nothing (ALU control, ≈ 2.0x when idle): throughput vs 1",
        Measure::Speedup { baseline: "threads/alu_one" },
        "threads/alu_two",
        Target::None,
    ),
    // Issue 4: the governor.
    row(4, "lease admit + refund", Measure::Absolute, "lease/admit_refund", Target::AtMost(30.0)),
    row(
        4,
        "lease, 2 threads on one budget: throughput vs 1 thread",
        Measure::Speedup { baseline: "lease_threads/one" },
        "lease_threads/two",
        Target::AtLeast(1.5),
    ),
    row(
        4,
        "lease, 2 threads sharing nothing (control): throughput vs 1",
        Measure::Speedup { baseline: "lease_threads/one" },
        "lease_threads/two_devices_control",
        Target::None,
    ),
    row(
        4,
        "pair governed / bound (counter allocator)",
        Measure::Slowdown { baseline: "governed/counter_ungoverned" },
        "governed/counter_governed",
        Target::AtMost(1.5),
    ),
    row(
        4,
        "pair governed / bound (system allocator)",
        Measure::Slowdown { baseline: "governed/system_ungoverned" },
        "governed/system_governed",
        Target::AtMost(1.5),
    ),
    // Issue 5: the CPU allocators.
    per(
        row(
            5,
            "pooled vs system: 64 KiB KV pages, 2 threads",
            Measure::Speedup { baseline: "kv_pages_2_threads/system" },
            "kv_pages_2_threads/pooled",
            Target::AtLeast(3.0),
        ),
        "pair",
    ),
    per(
        row(
            5,
            "pooled vs system: 1-64 MiB blocks, pages touched",
            Measure::Speedup { baseline: "large_blocks/system" },
            "large_blocks/pooled",
            Target::AtLeast(5.0),
        ),
        "block",
    ),
    per(row(5, "virtual commit of 2 MiB, lazy", Measure::Absolute, "virtual_commit_2mib/lazy", Target::None), "page"),
    per(
        row(5, "virtual commit of 2 MiB, populated", Measure::Absolute, "virtual_commit_2mib/populate", Target::None),
        "page",
    ),
    per(
        row(
            5,
            "virtual commit of 2 MiB, lazy then touched",
            Measure::Absolute,
            "virtual_commit_2mib/lazy_then_touch",
            Target::None,
        ),
        "page",
    ),
    // Issue 15: both C directions against the same pair through the Rust API (system
    // allocator, 4 KiB at 64-byte alignment). Judged on the `*_excess` benches, which
    // time both sides in alternating batches of 512 and report the C side's time above
    // the Rust side's; the plain pair of benches, timed seconds apart, is reported too.
    row(
        15,
        "pair through the host C API / through Rust (interleaved)",
        Measure::SlowdownOfExcess { baseline: "capi_pair/rust" },
        "capi_pair/c_api_excess",
        Target::AtMost(1.2),
    ),
    row(15, "pair: host C API above Rust (interleaved)", Measure::Absolute, "capi_pair/c_api_excess", Target::None),
    row(
        15,
        "pair through the host C API / through Rust (timed apart)",
        Measure::Slowdown { baseline: "capi_pair/rust" },
        "capi_pair/c_api",
        Target::None,
    ),
    row(
        15,
        "pair through a C plugin / the Rust system allocator (interleaved)",
        Measure::SlowdownOfExcess { baseline: "plugin_pair/rust_system" },
        "plugin_pair/plugin_excess",
        Target::AtMost(1.2),
    ),
    row(
        15,
        "pair: C plugin above the Rust system allocator (interleaved)",
        Measure::Absolute,
        "plugin_pair/plugin_excess",
        Target::None,
    ),
    row(
        15,
        "pair through a C plugin / the Rust system allocator (timed apart)",
        Measure::Slowdown { baseline: "plugin_pair/rust_system" },
        "plugin_pair/plugin",
        Target::None,
    ),
];

/// The issues that set the table's targets, as prose: "3, 4, 5, 12 and 15" (ascending,
/// each once), so the report's text follows the table.
pub(crate) fn target_issues(specs: &[RatioSpec]) -> String {
    let mut issues: Vec<u32> = specs.iter().map(|spec| spec.issue).collect();
    issues.sort_unstable();
    issues.dedup();
    let mut names: Vec<String> = issues.iter().map(u32::to_string).collect();
    match names.pop() {
        Some(last) if !names.is_empty() => format!("{} and {last}", names.join(", ")),
        last => last.unwrap_or_default(),
    }
}

/// A row's judgement.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Verdict {
    /// The target is met.
    Met,
    /// The target is missed.
    Missed,
    /// The row has no target.
    NoTarget,
    /// Results the row needs are missing (by criterion id).
    Missing(Vec<&'static str>),
    /// The value is undefined (a zero time to divide by).
    Undefined,
}

/// One computed row.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Row {
    /// Its definition.
    pub(crate) spec: RatioSpec,
    /// The baseline's result, if the row has one and the run produced it.
    pub(crate) baseline: Option<Estimate>,
    /// The candidate's result, if the run produced it.
    pub(crate) candidate: Option<Estimate>,
    /// The measured value (see [`Measure`]).
    pub(crate) value: Option<f64>,
    /// The judgement.
    pub(crate) verdict: Verdict,
}

/// Computes every row of `specs` from one run's results.
pub(crate) fn rows(specs: &[RatioSpec], results: &BTreeMap<String, Estimate>) -> Vec<Row> {
    specs.iter().map(|&spec| compute(spec, results)).collect()
}

fn compute(spec: RatioSpec, results: &BTreeMap<String, Estimate>) -> Row {
    let baseline = spec.measure.baseline().and_then(|id| results.get(id).copied());
    let candidate = results.get(spec.candidate).copied();
    let mut missing = Vec::new();
    if let (Some(id), None) = (spec.measure.baseline(), baseline) {
        missing.push(id);
    }
    if candidate.is_none() {
        missing.push(spec.candidate);
    }
    let value = match (spec.measure, baseline, candidate) {
        (_, _, None) => None,
        (Measure::Absolute, _, Some(c)) => Some(c.per_element()),
        (_, None, Some(_)) => None,
        (Measure::Slowdown { .. }, Some(b), Some(c)) => divide(c.per_element(), b.per_element()),
        (Measure::Speedup { .. }, Some(b), Some(c)) => divide(b.per_element(), c.per_element()),
        (Measure::Excess { .. }, Some(b), Some(c)) => Some(c.per_element() - b.per_element()),
        (Measure::SlowdownOfExcess { .. }, Some(b), Some(c)) => {
            divide(b.per_element() + c.per_element(), b.per_element())
        }
    };
    let verdict = if !missing.is_empty() {
        Verdict::Missing(missing)
    } else {
        match (value, spec.target) {
            (None, _) => Verdict::Undefined,
            (Some(_), Target::None) => Verdict::NoTarget,
            (Some(value), Target::AtMost(bound)) if value <= bound => Verdict::Met,
            (Some(value), Target::AtLeast(bound)) if value >= bound => Verdict::Met,
            (Some(_), _) => Verdict::Missed,
        }
    };
    Row { spec, baseline, candidate, value, verdict }
}

fn divide(numerator: f64, denominator: f64) -> Option<f64> {
    (denominator > 0.0).then(|| numerator / denominator).filter(|ratio| ratio.is_finite())
}

/// Every criterion id that some row needs and the run did not produce.
pub(crate) fn missing(rows: &[Row]) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = rows
        .iter()
        .flat_map(|row| match &row.verdict {
            Verdict::Missing(names) => names.clone(),
            _ => Vec::new(),
        })
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// The table as markdown, then the missing results (with the reason where one is
/// known from `problems`), the problems with results the table does not use, and one
/// count line. `loads` holds, by criterion id, the machine's other load recorded while
/// a bench ran (the two-thread benches record it); a row shows its candidate's.
pub(crate) fn render(rows: &[Row], problems: &[ResultError], loads: &BTreeMap<String, String>) -> String {
    let cell = |id: Option<&str>, estimate: Option<Estimate>, element: Option<&str>| -> String {
        match (id, estimate) {
            (None, _) => "—".to_owned(),
            (Some(id), None) => format!("`{id}` missing"),
            (Some(id), Some(estimate)) => {
                let unit = match (estimate.elements, element) {
                    (Some(_), Some(element)) => format!("/{element}"),
                    (Some(_), None) => "/element".to_owned(),
                    (None, _) => String::new(),
                };
                format!("`{id}` {}{unit}", Nanos(estimate.per_element()))
            }
        }
    };
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            let spec = &row.spec;
            vec![
                format!("#{}", spec.issue),
                spec.name.to_owned(),
                cell(spec.measure.baseline(), row.baseline, spec.element),
                cell(Some(spec.candidate), row.candidate, spec.element),
                row.value.map_or_else(|| "—".to_owned(), |value| spec.measure.format(value)),
                match spec.target {
                    Target::None => "—".to_owned(),
                    Target::AtMost(bound) => format!("≤ {}", spec.measure.format(bound)),
                    Target::AtLeast(bound) => format!("≥ {}", spec.measure.format(bound)),
                },
                match &row.verdict {
                    Verdict::Met => "met",
                    Verdict::Missed => "MISSED",
                    Verdict::NoTarget => "—",
                    Verdict::Missing(_) => "missing",
                    Verdict::Undefined => "undefined",
                }
                .to_owned(),
                loads.get(spec.candidate).cloned().unwrap_or_else(|| "—".to_owned()),
            ]
        })
        .collect();
    let mut out = table::markdown(
        &[
            ("issue", Align::Left),
            ("measure", Align::Left),
            ("baseline (median)", Align::Right),
            ("candidate (median)", Align::Right),
            ("ratio", Align::Right),
            ("target", Align::Right),
            ("result", Align::Left),
            ("other load while it ran", Align::Left),
        ],
        &body,
    );
    let missing = missing(rows);
    if !missing.is_empty() {
        out.push_str("\nMissing results (their rows are not judged):\n");
        for id in &missing {
            let stale = problems.iter().find_map(|problem| match problem {
                ResultError::Stale { id: stale, path } if stale == id => Some(path),
                _ => None,
            });
            match stale {
                Some(path) => out.push_str(&format!(
                    "- `{id}`: its last result ({}) predates this run: the bench did not run (filtered out?)\n",
                    path.display()
                )),
                None => out.push_str(&format!(
                    "- `{id}`: no result from this run; is the bench renamed or removed? (the table's ids are in \
                     xtask/src/ratios.rs)\n"
                )),
            }
        }
    }
    let unreadable: Vec<&ResultError> =
        problems.iter().filter(|problem| !matches!(problem, ResultError::Stale { .. })).collect();
    if !unreadable.is_empty() {
        out.push_str("\nResults that could not be read:\n");
        for problem in unreadable {
            out.push_str(&format!("- {problem}\n"));
        }
    }
    let count = |wanted: fn(&Verdict) -> bool| rows.iter().filter(|row| wanted(&row.verdict)).count();
    out.push_str(&format!(
        "\nTargets: {} met, {} missed, {} not judged (results missing or undefined), {} rows without a target.\n",
        count(|verdict| *verdict == Verdict::Met),
        count(|verdict| *verdict == Verdict::Missed),
        count(|verdict| matches!(verdict, Verdict::Missing(_) | Verdict::Undefined)),
        count(|verdict| *verdict == Verdict::NoTarget),
    ));
    out
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::estimates::read_results;
    use crate::estimates::tests::{TempDir, write_result};

    fn plain(median_ns: f64) -> Estimate {
        Estimate { median_ns, elements: None }
    }

    /// A full run's results where every target is met.
    fn healthy() -> BTreeMap<String, Estimate> {
        let mut results: BTreeMap<String, Estimate> = [
            ("pair/raw_dyn", 5.0),
            ("pair/bound", 25.0),
            ("pair/bound_drop", 26.0),
            ("pair_pool/raw_dyn", 8.0),
            ("pair_pool/bound", 30.0),
            ("bind/one_device", 12.0),
            ("bind/64_devices", 12.5),
            ("threads/one_thread", 40.0),
            ("threads/two_own_bindings", 22.0),
            ("threads/two_devices", 21.0),
            ("threads/two_bound_on_one_thread", 21.5),
            ("threads/two_shared_ref", 21.0),
            ("threads/two_local_batches", 22.0),
            ("threads/two_cross_release", 33.0),
            ("threads/alu_one", 10.0),
            ("threads/alu_two", 5.0),
            ("live/none", 30.0),
            ("live/100k_live", 33.0),
            ("live/after_release", 31.0),
            ("lease/admit_refund", 18.0),
            ("lease_threads/one", 20.0),
            ("lease_threads/two", 11.0),
            ("lease_threads/two_devices_control", 10.5),
            ("governed/counter_ungoverned", 30.0),
            ("governed/counter_governed", 40.0),
            ("governed/system_ungoverned", 60.0),
            ("governed/system_governed", 70.0),
            ("capi_pair/rust", 200.0),
            ("capi_pair/c_api", 230.0),
            ("plugin_pair/rust_system", 200.0),
            ("plugin_pair/plugin", 220.0),
            ("capi_pair/c_api_excess", 30.0),
            ("plugin_pair/plugin_excess", 20.0),
        ]
        .into_iter()
        .map(|(id, ns)| (id.to_owned(), plain(ns)))
        .collect();
        let with = |ns: f64, n: u64| Estimate { median_ns: ns, elements: Some(n) };
        results.insert("kv_pages_2_threads/system".into(), with(16.0 * 400.0, 16));
        results.insert("kv_pages_2_threads/pooled".into(), with(16.0 * 100.0, 16));
        results.insert("large_blocks/system".into(), with(12.0 * 6e6, 12));
        results.insert("large_blocks/pooled".into(), with(12.0 * 1e6, 12));
        for (id, ns) in [("lazy", 512.0 * 50.0), ("populate", 512.0 * 250.0), ("lazy_then_touch", 512.0 * 300.0)] {
            results.insert(format!("virtual_commit_2mib/{id}"), with(ns, 512));
        }
        results
    }

    fn find<'a>(rows: &'a [Row], name: &str) -> &'a Row {
        rows.iter().find(|row| row.spec.name == name).unwrap_or_else(|| panic!("no row {name}"))
    }

    #[test]
    fn the_target_issues_are_named_from_the_table_once_each() {
        assert_eq!(target_issues(&RATIOS), "3, 4, 5, 12 and 15");
        assert_eq!(target_issues(&RATIOS[..1]), "3");
        assert_eq!(target_issues(&[]), "");
    }

    #[test]
    fn a_healthy_run_meets_every_target_with_the_expected_values() {
        let rows = rows(&RATIOS, &healthy());
        assert!(missing(&rows).is_empty());
        for row in &rows {
            let expected = if row.spec.target == Target::None { Verdict::NoTarget } else { Verdict::Met };
            assert_eq!(row.verdict, expected, "{}", row.spec.name);
        }
        let value = |name: &str| find(&rows, name).value.unwrap();
        assert_eq!(value("pair: bound / raw allocator"), 5.0);
        assert_eq!(value("pair: bound above the raw floor (counter allocator)"), 20.0);
        assert_eq!(value("pair: bound above the raw floor (per-thread slot pool)"), 22.0);
        assert_eq!(value("bind(device) + drop, 1 device"), 12.0);
        assert!(
            (value("2 threads, one mechanism, each binding for itself: throughput vs 1 thread") - 40.0 / 22.0).abs()
                < 1e-12
        );
        assert_eq!(value("2 threads, every block released by the other thread / by its own"), 1.5);
        assert_eq!(value("2 threads sharing nothing (ALU control, ≈ 2.0x when idle): throughput vs 1"), 2.0);
        assert_eq!(value("pair with 100k live / with none"), 1.1);
        assert_eq!(value("lease, 2 threads on one budget: throughput vs 1 thread"), 20.0 / 11.0);
        assert_eq!(value("pair governed / bound (counter allocator)"), 40.0 / 30.0);
        // Per element where the bench declares a throughput: 400 vs 100 ns per pair.
        assert_eq!(value("pooled vs system: 64 KiB KV pages, 2 threads"), 4.0);
        assert_eq!(value("pooled vs system: 1-64 MiB blocks, pages touched"), 6.0);
        assert_eq!(value("virtual commit of 2 MiB, lazy"), 50.0);
        assert_eq!(value("pair through the host C API / through Rust (interleaved)"), 230.0 / 200.0);
        assert_eq!(value("pair: host C API above Rust (interleaved)"), 30.0);
        assert_eq!(value("pair through the host C API / through Rust (timed apart)"), 230.0 / 200.0);
        assert_eq!(value("pair through a C plugin / the Rust system allocator (interleaved)"), 1.1);
        assert_eq!(value("pair: C plugin above the Rust system allocator (interleaved)"), 20.0);
    }

    #[test]
    fn targets_are_judged_in_the_direction_of_the_measure() {
        let mut results = healthy();
        results.insert("pair/bound".into(), plain(60.0)); // 55 ns above the floor
        results.insert("pair/bound_drop".into(), plain(60.0)); // as cheap as releasing
        results.insert("bind/one_device".into(), plain(15.0)); // exactly the bound: met
        results.insert("bind/64_devices".into(), plain(16.0)); // 1.07x: met, but 16 ns > 15
        results.insert("threads/two_devices".into(), plain(25.0)); // 1.6x < 1.8x
        results.insert("live/after_release".into(), plain(34.0)); // 1.13x > 1.1x
        results.insert("kv_pages_2_threads/pooled".into(), Estimate { median_ns: 16.0 * 200.0, elements: Some(16) });
        results.insert("capi_pair/c_api_excess".into(), plain(50.0)); // 1.25x > 1.2x
        results.insert("capi_pair/c_api".into(), plain(250.0)); // reported, not judged
        let rows = rows(&RATIOS, &results);
        assert_eq!(find(&rows, "pair: bound above the raw floor (counter allocator)").verdict, Verdict::Missed);
        assert_eq!(find(&rows, "pair: bound / raw allocator").verdict, Verdict::NoTarget);
        assert_eq!(find(&rows, "bind(device) + drop, 1 device").verdict, Verdict::Met);
        assert_eq!(find(&rows, "bind(device) + drop, the 64th of 64 devices").verdict, Verdict::Missed);
        assert_eq!(find(&rows, "bind: 64 devices / 1 device").verdict, Verdict::Met);
        assert_eq!(find(&rows, "2 threads, two devices: throughput vs 1 thread").verdict, Verdict::Missed);
        assert_eq!(find(&rows, "pair after releasing them / with none").verdict, Verdict::Missed);
        assert_eq!(find(&rows, "pooled vs system: 64 KiB KV pages, 2 threads").verdict, Verdict::Missed);
        assert_eq!(find(&rows, "pair through the host C API / through Rust (interleaved)").verdict, Verdict::Missed);
        assert_eq!(find(&rows, "pair through the host C API / through Rust (timed apart)").verdict, Verdict::NoTarget);
        let text = render(&rows, &[], &BTreeMap::new());
        assert!(text.contains("Targets: 14 met, 6 missed, 0 not judged"), "{text}");
    }

    #[test]
    fn missing_results_are_reported_by_name() {
        let mut results = healthy();
        results.remove("live/none");
        results.remove("bind/one_device");
        let rows = rows(&RATIOS, &results);
        assert_eq!(missing(&rows), ["bind/one_device", "live/none"]);
        assert_eq!(find(&rows, "pair with 100k live / with none").verdict, Verdict::Missing(vec!["live/none"]));
        assert_eq!(find(&rows, "pair with 100k live / with none").value, None);
        assert_eq!(find(&rows, "bind(device) + drop, 1 device").verdict, Verdict::Missing(vec!["bind/one_device"]));
        let stale = ResultError::Stale {
            id: "bind/one_device".into(),
            path: PathBuf::from("/t/criterion/bind/one_device/new/estimates.json"),
        };
        let text = render(&rows, &[stale], &BTreeMap::new());
        assert!(text.contains("`live/none` missing"), "{text}");
        assert!(text.contains("- `live/none`: no result from this run"), "{text}");
        assert!(text.contains(
            "- `bind/one_device`: its last result (/t/criterion/bind/one_device/new/estimates.json) predates this run"
        ));
        assert!(text.contains("4 not judged (results missing or undefined)"), "{text}");
        // Nothing at all: every row is missing, nothing panics.
        let empty = super::rows(&RATIOS, &BTreeMap::new());
        assert!(empty.iter().all(|row| matches!(row.verdict, Verdict::Missing(_))));
        assert!(render(&empty, &[], &BTreeMap::new()).contains("0 met, 0 missed, 31 not judged"));
    }

    #[test]
    fn a_zero_time_to_divide_by_is_undefined_not_infinite() {
        let mut results = healthy();
        results.insert("threads/two_own_bindings".into(), plain(0.0));
        results.insert("live/none".into(), plain(0.0));
        let rows = rows(&RATIOS, &results);
        assert_eq!(
            find(&rows, "2 threads, one mechanism, each binding for itself: throughput vs 1 thread").verdict,
            Verdict::Undefined
        );
        assert_eq!(find(&rows, "pair with 100k live / with none").verdict, Verdict::Undefined);
        assert!(render(&rows, &[], &BTreeMap::new()).contains("undefined"));
    }

    #[test]
    fn the_rendered_table_shows_medians_ratios_targets_and_results() {
        let loads: BTreeMap<String, String> =
            [("threads/two_shared_ref".to_owned(), "0.05 cores (loadavg 1.10)".to_owned())].into();
        let text = render(&rows(&RATIOS, &healthy()), &[], &loads);
        let line = |needle: &str| -> &str {
            text.lines().find(|line| line.contains(needle)).unwrap_or_else(|| panic!("no line with {needle}:\n{text}"))
        };
        let floor = line("bound above the raw floor (counter");
        for part in ["#12", "`pair/raw_dyn` 5.0 ns", "`pair/bound` 25.0 ns", "+20.0 ns", "≤ +25.0 ns", "met"] {
            assert!(floor.contains(part), "{floor} lacks {part}");
        }
        let bind = line("bind(device) + drop, 1 device");
        assert!(bind.contains("— |") && bind.contains("≤ 15.0 ns"), "{bind}");
        let shared = line("sharing one binding by reference");
        assert!(shared.contains("0.05 cores (loadavg 1.10)"), "{shared}");
        let kv = line("64 KiB KV pages");
        for part in ["`kv_pages_2_threads/system` 400.0 ns/pair", "100.0 ns/pair", "4.00x", "≥ 3.00x", "met"] {
            assert!(kv.contains(part), "{kv} lacks {part}");
        }
        assert!(line("lazy then touched").contains("300.0 ns/page"));
        assert!(text.starts_with("| issue | measure"), "{text}");
        assert!(text.contains(
            "Targets: 20 met, 0 missed, 0 not judged (results missing or undefined), 11 rows without a target."
        ));
    }

    #[test]
    fn unreadable_results_are_listed_under_the_table() {
        let problem = ResultError::Malformed {
            path: PathBuf::from("/t/criterion/pair/bound/new/estimates.json"),
            what: "estimates.json",
            reason: "no number at `median.point_estimate`".into(),
        };
        let text = render(&rows(&RATIOS, &healthy()), &[problem], &BTreeMap::new());
        assert!(text.contains("Results that could not be read:\n- /t/criterion/pair/bound/new/estimates.json"));
    }

    #[test]
    fn the_table_reads_a_criterion_directory_end_to_end() {
        let home = TempDir::new("ratios");
        for (id, estimate) in healthy() {
            write_result(&home.0, &id, estimate.elements, estimate.median_ns);
        }
        let results = read_results(&home.0, None);
        assert!(results.problems.is_empty(), "{:?}", results.problems);
        let rows = rows(&RATIOS, &results.benches);
        assert!(missing(&rows).is_empty());
        assert_eq!(find(&rows, "pair: bound above the raw floor (counter allocator)").value, Some(20.0));
    }

    #[test]
    fn every_row_names_its_ids_once_and_absolute_rows_have_no_baseline() {
        for spec in RATIOS {
            assert!(!spec.candidate.is_empty() && !spec.name.is_empty());
            assert_ne!(spec.measure.baseline(), Some(spec.candidate), "{}", spec.name);
            if let Target::AtLeast(_) = spec.target {
                assert!(matches!(spec.measure, Measure::Speedup { .. }), "{}: only speedups have floors", spec.name);
            }
        }
        let mut names: Vec<&str> = RATIOS.iter().map(|spec| spec.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), RATIOS.len(), "row names are unique");
    }
}
