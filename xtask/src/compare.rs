//! `cargo xtask bench --compare`: the per-benchmark change between the runs of a
//! baseline revision and the runs of the working tree, as a markdown table.
//!
//! Each side ran several times (alternating with the other); a bench's figure for a
//! side is the median of its runs' criterion medians, and the change is the candidate's
//! figure against the baseline's, in percent. A change whose size is within the noise
//! threshold, or within the spread of either side's own runs (a difference the runs of
//! one side show among themselves says nothing about the change), is marked `~ noise`.
//! Everything here is pure and tested on fixtures.

use std::collections::BTreeMap;

use crate::estimates::{Estimate, Nanos, Results};
use crate::table::{self, Align};

/// One side's figure for one bench.
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) struct Summary {
    /// Median over the runs of the per-element median, in nanoseconds.
    pub(crate) median: f64,
    /// Runs that produced this bench.
    pub(crate) runs: usize,
    /// The largest distance of one run from `median`, in percent of it.
    pub(crate) spread_pct: f64,
    /// Elements per iteration the bench declares (in its last run), if any: the times
    /// are then per element.
    pub(crate) elements: Option<u64>,
}

/// What happened to one bench.
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) enum Change {
    /// Faster by more than the threshold (negative percent).
    Faster(f64),
    /// Slower by more than the threshold (positive percent).
    Slower(f64),
    /// Within the threshold or the runs' own spread.
    Noise(f64),
    /// Only the baseline has it.
    Removed,
    /// Only the candidate has it.
    Added,
    /// The baseline's time is zero: no percentage.
    Undefined,
    /// The two sides declare different elements per iteration (a throughput added,
    /// removed or changed): their times measure different things.
    Incomparable,
}

/// One row of the comparison.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ChangeRow {
    /// Criterion's full id.
    pub(crate) bench: String,
    /// The baseline's figure.
    pub(crate) baseline: Option<Summary>,
    /// The candidate's figure.
    pub(crate) candidate: Option<Summary>,
    /// The change.
    pub(crate) change: Change,
}

/// The median of `values` (the mean of the middle two for an even count); `None` when
/// empty.
pub(crate) fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// Every bench's results over `runs`, in run order.
fn by_bench(runs: &[Results]) -> BTreeMap<&str, Vec<Estimate>> {
    let mut benches: BTreeMap<&str, Vec<Estimate>> = BTreeMap::new();
    for run in runs {
        for (id, estimate) in &run.benches {
            benches.entry(id.as_str()).or_default().push(*estimate);
        }
    }
    benches
}

/// One figure per bench for a side: the median of its runs' medians (elements from the
/// last run), for tables that take one result per bench such as the ratio table.
pub(crate) fn medians(runs: &[Results]) -> BTreeMap<String, Estimate> {
    by_bench(runs)
        .into_iter()
        .filter_map(|(id, estimates)| {
            let medians: Vec<f64> = estimates.iter().map(|estimate| estimate.median_ns).collect();
            let median_ns = median(&medians)?;
            let elements = estimates.last()?.elements;
            Some((id.to_owned(), Estimate { median_ns, elements }))
        })
        .collect()
}

fn summarize(estimates: &[Estimate]) -> Option<Summary> {
    let values: Vec<f64> = estimates.iter().map(Estimate::per_element).collect();
    let median = median(&values)?;
    let spread = values.iter().map(|value| (value - median).abs()).fold(0.0, f64::max);
    let spread_pct = if median > 0.0 { spread / median * 100.0 } else { 0.0 };
    let elements = estimates.last()?.elements;
    Some(Summary { median, runs: values.len(), spread_pct, elements })
}

/// Compares every bench that either side produced; `threshold_pct` is the noise
/// threshold in percent (a change of exactly the threshold is noise). A larger change
/// is noise too when one side's runs spread at least as far from their median.
pub(crate) fn compare(baseline: &[Results], candidate: &[Results], threshold_pct: f64) -> Vec<ChangeRow> {
    let base = by_bench(baseline);
    let cand = by_bench(candidate);
    let mut ids: Vec<&str> = base.keys().chain(cand.keys()).copied().collect();
    ids.sort_unstable();
    ids.dedup();
    ids.into_iter()
        .map(|id| {
            let baseline = base.get(id).and_then(|estimates| summarize(estimates));
            let candidate = cand.get(id).and_then(|estimates| summarize(estimates));
            let change = match (baseline, candidate) {
                (Some(b), Some(c)) if b.elements != c.elements => Change::Incomparable,
                (Some(b), Some(c)) if b.median > 0.0 => {
                    let pct = (c.median - b.median) * 100.0 / b.median;
                    if pct.abs() <= threshold_pct.max(b.spread_pct).max(c.spread_pct) {
                        Change::Noise(pct)
                    } else if pct < 0.0 {
                        Change::Faster(pct)
                    } else {
                        Change::Slower(pct)
                    }
                }
                (Some(_), Some(_)) => Change::Undefined,
                (Some(_), None) => Change::Removed,
                (None, _) => Change::Added,
            };
            ChangeRow { bench: id.to_owned(), baseline, candidate, change }
        })
        .collect()
}

/// What the comparison was run on, for the text around the table.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Context {
    /// The revision as given (`origin/main`).
    pub(crate) rev: String,
    /// The commit it resolved to.
    pub(crate) commit: String,
    /// Runs of each side.
    pub(crate) rounds: u32,
    /// The noise threshold, in percent.
    pub(crate) threshold_pct: f64,
    /// The criterion flags every run got.
    pub(crate) criterion_args: Vec<String>,
}

/// The comparison as markdown: a heading, how it was measured, the table, and a count.
pub(crate) fn render(rows: &[ChangeRow], context: &Context) -> String {
    let threshold = context.threshold_pct;
    let figure = |summary: Option<Summary>| match summary {
        None => "—".to_owned(),
        Some(summary) => {
            let unit = if summary.elements.is_some() { "/element" } else { "" };
            let spread = if summary.runs > 1 { format!(" ±{:.1}%", summary.spread_pct) } else { String::new() };
            format!("{}{unit}{spread}", Nanos(summary.median))
        }
    };
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            let (change, verdict) = match row.change {
                Change::Faster(pct) => (format!("{pct:+.1}%"), "faster"),
                Change::Slower(pct) => (format!("{pct:+.1}%"), "**slower**"),
                Change::Noise(pct) => (format!("{pct:+.1}%"), "~ noise"),
                Change::Removed => ("—".to_owned(), "only in baseline"),
                Change::Added => ("—".to_owned(), "only in candidate"),
                Change::Undefined => ("—".to_owned(), "undefined (zero baseline)"),
                Change::Incomparable => ("—".to_owned(), "not comparable (elements per iteration differ)"),
            };
            vec![format!("`{}`", row.bench), figure(row.baseline), figure(row.candidate), change, verdict.to_owned()]
        })
        .collect();
    let count = |wanted: fn(&Change) -> bool| rows.iter().filter(|row| wanted(&row.change)).count();
    let mut out = format!(
        "## Benchmarks: `{}` ({}) vs this change\n\n\
         {} run(s) of each side, alternating baseline and candidate on one machine (criterion `{}`). Each \
         figure is the median of the runs' criterion medians, per iteration (per element where the bench \
         declares a throughput); ± is the largest distance of one run from it. Changes within ±{threshold}%, or \
         within the ± of either side, are marked ~ noise.\n\n",
        context.rev,
        short(&context.commit),
        context.rounds,
        context.criterion_args.join(" "),
    );
    out.push_str(&table::markdown(
        &[
            ("benchmark", Align::Left),
            ("baseline", Align::Right),
            ("candidate", Align::Right),
            ("change", Align::Right),
            ("", Align::Left),
        ],
        &body,
    ));
    out.push_str(&format!(
        "\n{} slower, {} faster, {} within ±{threshold}% or the runs' spread (noise)",
        count(|change| matches!(change, Change::Slower(_))),
        count(|change| matches!(change, Change::Faster(_))),
        count(|change| matches!(change, Change::Noise(_))),
    ));
    let (removed, added) = (count(|change| *change == Change::Removed), count(|change| *change == Change::Added));
    if removed + added > 0 {
        out.push_str(&format!("; {removed} only in baseline, {added} only in candidate"));
    }
    let incomparable = count(|change| *change == Change::Incomparable);
    if incomparable > 0 {
        out.push_str(&format!("; {incomparable} not comparable"));
    }
    out.push_str(".\n");
    out
}

/// The first 12 hex digits of a commit id.
pub(crate) fn short(commit: &str) -> &str {
    commit.get(..12).unwrap_or(commit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(benches: &[(&str, f64)]) -> Results {
        Results {
            benches: benches
                .iter()
                .map(|&(id, ns)| (id.to_owned(), Estimate { median_ns: ns, elements: None }))
                .collect(),
            ..Results::default()
        }
    }

    fn context() -> Context {
        Context {
            rev: "origin/main".into(),
            commit: "0123456789abcdef0123456789abcdef01234567".into(),
            rounds: 2,
            threshold_pct: 5.0,
            criterion_args: vec!["--warm-up-time".into(), "1".into(), "--measurement-time".into(), "2".into()],
        }
    }

    #[test]
    fn the_median_of_runs_is_the_middle_or_the_mean_of_the_middle_two() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0]), Some(3.0));
        assert_eq!(median(&[9.0, 1.0, 5.0]), Some(5.0));
        assert_eq!(median(&[10.0, 20.0]), Some(15.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 100.0]), Some(3.5));
    }

    #[test]
    fn changes_outside_the_threshold_are_faster_or_slower_and_inside_are_noise() {
        let baseline = [
            run(&[("a", 100.0), ("b", 100.0), ("c", 100.0), ("d", 100.0)]),
            run(&[("a", 100.0), ("b", 100.0), ("c", 100.0), ("d", 100.0)]),
        ];
        let candidate = [
            run(&[("a", 80.0), ("b", 120.0), ("c", 104.0), ("d", 105.0)]),
            run(&[("a", 80.0), ("b", 120.0), ("c", 96.0), ("d", 105.0)]),
        ];
        let rows = compare(&baseline, &candidate, 5.0);
        let changes: Vec<(&str, Change)> = rows.iter().map(|row| (row.bench.as_str(), row.change)).collect();
        assert_eq!(
            changes,
            [
                ("a", Change::Faster(-20.0)),
                ("b", Change::Slower(20.0)),
                ("c", Change::Noise(0.0)),
                ("d", Change::Noise(5.0))
            ],
            "a change of exactly the threshold is noise"
        );
        // A tighter threshold turns d into a regression.
        assert_eq!(compare(&baseline, &candidate, 4.0)[3].change, Change::Slower(5.0));
        assert_eq!(rows[2].candidate.unwrap().spread_pct, 4.0);
    }

    #[test]
    fn a_change_within_the_runs_own_spread_is_noise() {
        // The candidate's runs differ by 24% among themselves: a 10% change is noise.
        let baseline = [run(&[("t", 100.0)]), run(&[("t", 100.0)])];
        let noisy = [run(&[("t", 98.0)]), run(&[("t", 122.0)])];
        let row = &compare(&baseline, &noisy, 5.0)[0];
        assert!((row.candidate.unwrap().spread_pct - 12.0 / 110.0 * 100.0).abs() < 1e-9);
        assert!(matches!(row.change, Change::Noise(pct) if (pct - 10.0).abs() < 1e-9), "{row:?}");
        // The same 10% with steady runs on both sides is a change.
        let steady = [run(&[("t", 110.0)]), run(&[("t", 110.0)])];
        assert!(matches!(compare(&baseline, &steady, 5.0)[0].change, Change::Slower(_)));
        // Spread on the baseline's side counts the same.
        assert!(matches!(compare(&noisy, &baseline, 5.0)[0].change, Change::Noise(_)));
    }

    #[test]
    fn each_side_is_the_median_over_its_runs() {
        // One noisy baseline run does not decide: the median of three is 100.
        let baseline = [run(&[("a", 100.0)]), run(&[("a", 160.0)]), run(&[("a", 99.0)])];
        let candidate = [run(&[("a", 101.0)]), run(&[("a", 102.0)]), run(&[("a", 100.0)])];
        let row = &compare(&baseline, &candidate, 5.0)[0];
        assert_eq!(row.baseline.unwrap().median, 100.0);
        assert_eq!(row.baseline.unwrap().runs, 3);
        assert_eq!(row.candidate.unwrap().median, 101.0);
        assert!(matches!(row.change, Change::Noise(pct) if (pct - 1.0).abs() < 1e-9));
        assert_eq!(medians(&baseline)["a"].median_ns, 100.0);
    }

    #[test]
    fn benches_on_one_side_only_are_shown_not_dropped() {
        let baseline = [run(&[("threads/one", 10.0), ("pair/bound", 30.0)])];
        let candidate = [run(&[("lease_threads/one", 10.0), ("pair/bound", 30.0)])];
        let rows = compare(&baseline, &candidate, 5.0);
        let changes: Vec<(&str, Change)> = rows.iter().map(|row| (row.bench.as_str(), row.change)).collect();
        assert_eq!(
            changes,
            [
                ("lease_threads/one", Change::Added),
                ("pair/bound", Change::Noise(0.0)),
                ("threads/one", Change::Removed)
            ]
        );
        // A bench missing from one run of a side still counts with the runs it has.
        let partial = [run(&[("x", 10.0)]), run(&[])];
        assert_eq!(compare(&partial, &partial, 5.0)[0].baseline.unwrap().runs, 1);
        let zero = [run(&[("z", 0.0)])];
        assert_eq!(compare(&zero, &[run(&[("z", 1.0)])], 5.0)[0].change, Change::Undefined);
    }

    #[test]
    fn per_element_benches_compare_per_element() {
        let with = |ns: f64, n: u64| Results {
            benches: [("kv".to_owned(), Estimate { median_ns: ns, elements: Some(n) })].into(),
            ..Results::default()
        };
        let rows = compare(&[with(1600.0, 16)], &[with(1760.0, 16)], 5.0);
        assert_eq!(rows[0].baseline.unwrap().median, 100.0);
        assert!(matches!(rows[0].change, Change::Slower(pct) if (pct - 10.0).abs() < 1e-9));
        assert!(render(&rows, &context()).contains("100.0 ns/element"));
        // A throughput declared on one side only, or a different element count, makes
        // the times measure different things: no percentage, said so.
        let plain = run(&[("kv", 1600.0)]);
        let rows = compare(&[plain], &[with(1600.0, 16)], 5.0);
        assert_eq!(rows[0].change, Change::Incomparable);
        assert_eq!(compare(&[with(1600.0, 16)], &[with(3200.0, 32)], 5.0)[0].change, Change::Incomparable);
        let text = render(&rows, &context());
        assert!(text.contains("not comparable (elements per iteration differ)"), "{text}");
        assert!(text.contains("; 1 not comparable."), "{text}");
    }

    #[test]
    fn the_markdown_names_the_revision_threshold_and_every_bench() {
        let baseline = [
            run(&[("pair/bound", 30.0), ("bind", 10.0), ("old", 1.0)]),
            run(&[("pair/bound", 32.0), ("bind", 10.0), ("old", 1.0)]),
        ];
        let candidate = [run(&[("pair/bound", 31.0), ("bind", 20.0)]), run(&[("pair/bound", 31.0), ("bind", 20.0)])];
        let text = render(&compare(&baseline, &candidate, 5.0), &context());
        assert!(text.starts_with("## Benchmarks: `origin/main` (0123456789ab) vs this change\n"), "{text}");
        assert!(text.contains("2 run(s) of each side, alternating"), "{text}");
        assert!(text.contains("criterion `--warm-up-time 1 --measurement-time 2`"), "{text}");
        assert!(text.contains("Changes within ±5%, or within the ± of either side, are marked ~ noise."), "{text}");
        let line = |needle: &str| text.lines().find(|line| line.contains(needle)).unwrap().to_owned();
        let pair = line("`pair/bound`");
        for part in ["31.0 ns ±3.2%", "31.0 ns ±0.0%", "+0.0%", "~ noise"] {
            assert!(pair.contains(part), "{pair} lacks {part}");
        }
        let bind = line("`bind`");
        assert!(bind.contains("+100.0%") && bind.contains("**slower**"), "{bind}");
        let old = line("`old`");
        assert!(old.contains("only in baseline") && old.contains("— |"), "{old}");
        assert!(
            text.contains(
                "\n1 slower, 0 faster, 1 within ±5% or the runs' spread (noise); 1 only in baseline, 0 only in \
                 candidate.\n"
            ),
            "{text}"
        );
        assert!(text.contains("| benchmark"), "{text}");
    }

    #[test]
    fn short_commits_are_twelve_digits_or_all_of_a_shorter_one() {
        assert_eq!(short("0123456789abcdef"), "0123456789ab");
        assert_eq!(short("abc"), "abc");
    }
}
