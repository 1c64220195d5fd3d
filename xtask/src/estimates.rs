//! Reading criterion's results: every `<id>/new/benchmark.json` (the benchmark's full id
//! and declared throughput) with the `estimates.json` beside it (the median's point
//! estimate, in nanoseconds per iteration).
//!
//! Parsing is pure ([`parse_benchmark`], [`parse_median`]) and unit-tested on fixture
//! JSON; [`read_results`] walks a criterion directory and keeps, by name, every result
//! it could not use, so that nothing is skipped in silence.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// How much older than the run's start a result may look and still count as written
/// by the run (file systems that round modification times down).
const CLOCK_SLACK: Duration = Duration::from_secs(2);

/// One benchmark's result.
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) struct Estimate {
    /// Median time per iteration, in nanoseconds (criterion's point estimate).
    pub(crate) median_ns: f64,
    /// Elements per iteration, when the bench declares `Throughput::Elements`.
    pub(crate) elements: Option<u64>,
}

impl Estimate {
    /// Median time per element (per iteration when no throughput is declared).
    pub(crate) fn per_element(&self) -> f64 {
        match self.elements {
            Some(elements) if elements > 0 => self.median_ns / elements as f64,
            _ => self.median_ns,
        }
    }
}

/// What one run left in a criterion directory.
#[derive(Debug, Default)]
pub(crate) struct Results {
    /// Usable results by criterion full id (`pair/bound`).
    pub(crate) benches: BTreeMap<String, Estimate>,
    /// Results that exist but could not be used, each naming its file.
    pub(crate) problems: Vec<ResultError>,
    /// The machine's other load while a bench ran, by criterion id, as the bench wrote
    /// it to `<criterion home>/load/<id>.txt` (the two-thread benches do).
    pub(crate) loads: BTreeMap<String, String>,
}

/// A criterion result that could not be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ResultError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file is not the JSON criterion writes.
    #[error("{path} is not criterion's {what}: {reason}; delete it and run the benches again")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// `benchmark.json` or `estimates.json`.
        what: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// A result older than this run (its bench did not run this time).
    #[error(
        "{id}: the result in {path} was written before this run started, so its bench did not run this time \
         (filtered out, renamed or removed?)"
    )]
    Stale {
        /// The benchmark's full id.
        id: String,
        /// Its `estimates.json`.
        path: PathBuf,
    },
}

/// What [`parse_benchmark`] reads from `benchmark.json`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BenchmarkId {
    /// Criterion's full id (`group/function[/value]`).
    pub(crate) full_id: String,
    /// `Throughput::Elements(n)`, if declared.
    pub(crate) elements: Option<u64>,
}

/// The part of criterion's `benchmark.json` the table needs.
#[derive(serde::Deserialize)]
struct BenchmarkJson {
    full_id: String,
    #[serde(default)]
    throughput: Option<ThroughputJson>,
}

/// Criterion's `Throughput`, externally tagged (`{"Elements": 64}`). Other variants
/// (bytes or bits per iteration) leave `elements` empty: the time per iteration is what
/// is compared then.
#[derive(serde::Deserialize)]
struct ThroughputJson {
    #[serde(rename = "Elements")]
    elements: Option<u64>,
}

/// The part of criterion's `estimates.json` the table needs.
#[derive(serde::Deserialize)]
struct EstimatesJson {
    median: PointEstimate,
}

#[derive(serde::Deserialize)]
struct PointEstimate {
    point_estimate: f64,
}

/// Reads criterion's `benchmark.json`: the `full_id` and any `Elements` throughput.
///
/// # Errors
/// A message saying what is missing or malformed.
pub(crate) fn parse_benchmark(text: &str) -> Result<BenchmarkId, String> {
    let json: BenchmarkJson =
        serde_json::from_str(text).map_err(|err| json_error(&err, "`full_id` and `throughput.Elements`"))?;
    if json.full_id.is_empty() {
        return Err("an empty `full_id`".into());
    }
    Ok(BenchmarkId { full_id: json.full_id, elements: json.throughput.and_then(|t| t.elements) })
}

/// Reads criterion's `estimates.json`: `median.point_estimate`, in nanoseconds.
///
/// # Errors
/// A message saying what is missing, or that the value is negative or not finite.
pub(crate) fn parse_median(text: &str) -> Result<f64, String> {
    let json: EstimatesJson =
        serde_json::from_str(text).map_err(|err| json_error(&err, "a number at `median.point_estimate`"))?;
    let median = json.median.point_estimate;
    if median.is_finite() && median >= 0.0 {
        Ok(median)
    } else {
        Err(format!("`median.point_estimate` is {median}, not a time"))
    }
}

/// Says whether the text was not JSON at all, or JSON without what criterion writes.
fn json_error(err: &serde_json::Error, expected: &str) -> String {
    if err.is_syntax() || err.is_eof() {
        format!("invalid JSON ({err})")
    } else {
        format!("expected {expected} ({err})")
    }
}

/// Reads every result under `criterion_home` (criterion's output directory). With
/// `since`, results whose `estimates.json` is older than that are reported as
/// [`ResultError::Stale`] instead of used. A missing directory yields no results (every
/// bench will then be reported missing by name).
pub(crate) fn read_results(criterion_home: &Path, since: Option<SystemTime>) -> Results {
    let mut results = Results { loads: read_loads(&criterion_home.join("load"), since), ..Results::default() };
    let mut pending = vec![criterion_home.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        let mut subdirs: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            // `file_type` does not follow links: a linked directory is not walked.
            .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()))
            .map(|entry| entry.path())
            .collect();
        subdirs.sort();
        // Criterion's other directories (`base`, saved baselines, `report`) hold their
        // files directly, never in a `new` directory, so walking them finds nothing; a
        // bench group that happens to be called `base` is still found.
        for subdir in subdirs {
            if subdir.file_name().is_some_and(|name| name == "new") && subdir.join("benchmark.json").is_file() {
                read_one(&subdir, since, &mut results);
            } else {
                pending.push(subdir);
            }
        }
    }
    results
}

/// Every `<group>/<function>.txt` under `dir` written since `since`, by criterion id.
/// Older files belong to earlier runs and are left out.
fn read_loads(dir: &Path, since: Option<SystemTime>) -> BTreeMap<String, String> {
    let mut loads = BTreeMap::new();
    let Ok(groups) = std::fs::read_dir(dir) else { return loads };
    for group in groups.filter_map(Result::ok) {
        let Ok(files) = std::fs::read_dir(group.path()) else { continue };
        for file in files.filter_map(Result::ok) {
            let path = file.path();
            let fresh = match (since, file.metadata().and_then(|meta| meta.modified())) {
                (None, _) => true,
                (Some(since), Ok(modified)) => modified + CLOCK_SLACK >= since,
                (Some(_), Err(_)) => false,
            };
            let (Some(function), Some("txt")) =
                (path.file_stem().and_then(|stem| stem.to_str()), path.extension().and_then(|ext| ext.to_str()))
            else {
                continue;
            };
            if let (true, Ok(text)) = (fresh, std::fs::read_to_string(&path)) {
                let id = format!("{}/{function}", group.file_name().to_string_lossy());
                loads.insert(id, text.trim().to_owned());
            }
        }
    }
    loads
}

fn read_one(new_dir: &Path, since: Option<SystemTime>, results: &mut Results) {
    let read = |name: &str| -> Result<(String, PathBuf), ResultError> {
        let path = new_dir.join(name);
        std::fs::read_to_string(&path)
            .map(|text| (text, path.clone()))
            .map_err(|source| ResultError::Io { path, source })
    };
    let outcome = (|| -> Result<(String, Estimate), ResultError> {
        let (text, path) = read("benchmark.json")?;
        let id =
            parse_benchmark(&text).map_err(|reason| ResultError::Malformed { path, what: "benchmark.json", reason })?;
        let (text, path) = read("estimates.json")?;
        if let Some(since) = since {
            let modified = std::fs::metadata(&path)
                .and_then(|meta| meta.modified())
                .map_err(|source| ResultError::Io { path: path.clone(), source })?;
            if modified + CLOCK_SLACK < since {
                return Err(ResultError::Stale { id: id.full_id, path });
            }
        }
        let median_ns =
            parse_median(&text).map_err(|reason| ResultError::Malformed { path, what: "estimates.json", reason })?;
        Ok((id.full_id, Estimate { median_ns, elements: id.elements }))
    })();
    match outcome {
        Ok((id, estimate)) => {
            results.benches.insert(id, estimate);
        }
        Err(problem) => results.problems.push(problem),
    }
}

/// A time in nanoseconds, with a unit that keeps three or four significant digits.
pub(crate) struct Nanos(pub(crate) f64);

impl fmt::Display for Nanos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ns = self.0;
        let magnitude = ns.abs();
        if !ns.is_finite() {
            write!(f, "{ns} ns")
        } else if magnitude < 1e3 {
            write!(f, "{ns:.1} ns")
        } else if magnitude < 1e6 {
            write!(f, "{:.2} µs", ns / 1e3)
        } else if magnitude < 1e9 {
            write!(f, "{:.2} ms", ns / 1e6)
        } else {
            write!(f, "{:.2} s", ns / 1e9)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `benchmark.json` as criterion 0.8 writes it.
    pub(crate) fn benchmark_json(full_id: &str, elements: Option<u64>) -> String {
        let (group, function) = full_id.split_once('/').unwrap_or((full_id, ""));
        let throughput = elements.map_or_else(|| "null".to_owned(), |n| format!("{{\"Elements\":{n}}}"));
        format!(
            "{{\"group_id\":\"{group}\",\"function_id\":\"{function}\",\"value_str\":null,\
             \"throughput\":{throughput},\"full_id\":\"{full_id}\",\"directory_name\":\"{full_id}\",\
             \"title\":\"{full_id}\"}}"
        )
    }

    /// `estimates.json` as criterion 0.8 writes it, with `median` as the median's
    /// point estimate and other statistics around it.
    pub(crate) fn estimates_json(median: f64) -> String {
        let estimate = |point: f64| {
            format!(
                "{{\"confidence_interval\":{{\"confidence_level\":0.95,\"lower_bound\":{},\"upper_bound\":{}}},\
                 \"point_estimate\":{point},\"standard_error\":0.12}}",
                point * 0.99,
                point * 1.01
            )
        };
        format!(
            "{{\"mean\":{},\"median\":{},\"median_abs_dev\":{},\"slope\":{},\"std_dev\":{}}}",
            estimate(median * 1.05),
            estimate(median),
            estimate(1.0),
            estimate(median * 1.02),
            estimate(2.0)
        )
    }

    /// Writes one result the way criterion lays it out under `home`.
    pub(crate) fn write_result(home: &Path, full_id: &str, elements: Option<u64>, median: f64) {
        let new = home.join(full_id.replace('/', std::path::MAIN_SEPARATOR_STR)).join("new");
        std::fs::create_dir_all(&new).unwrap();
        std::fs::write(new.join("benchmark.json"), benchmark_json(full_id, elements)).unwrap();
        std::fs::write(new.join("estimates.json"), estimates_json(median)).unwrap();
    }

    /// A fresh directory under the system's temp dir, removed on drop.
    pub(crate) struct TempDir(pub(crate) PathBuf);

    impl TempDir {
        pub(crate) fn new(tag: &str) -> TempDir {
            use std::sync::atomic::{AtomicU32, Ordering};
            static NEXT: AtomicU32 = AtomicU32::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!("xtask-{tag}-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).unwrap();
            TempDir(path)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn loads_written_by_this_run_are_read_by_id_and_older_ones_left_out() {
        let home = TempDir::new("loads");
        let dir = home.0.join("load").join("threads");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("two_shared_ref.txt"), "0.05 cores (loadavg 1.10)\n").unwrap();
        std::fs::write(dir.join("notes.md"), "not a load").unwrap();
        let results = read_results(&home.0, None);
        assert_eq!(results.loads.len(), 1);
        assert_eq!(results.loads["threads/two_shared_ref"], "0.05 cores (loadavg 1.10)");
        let later = SystemTime::now() + Duration::from_secs(60);
        assert!(read_results(&home.0, Some(later)).loads.is_empty(), "a load from an earlier run was used");
    }

    #[test]
    fn benchmark_json_gives_the_full_id_and_element_throughput() {
        assert_eq!(
            parse_benchmark(&benchmark_json("pair/bound", None)),
            Ok(BenchmarkId { full_id: "pair/bound".into(), elements: None })
        );
        assert_eq!(
            parse_benchmark(&benchmark_json("kv_pages_2_threads/pooled", Some(16))),
            Ok(BenchmarkId { full_id: "kv_pages_2_threads/pooled".into(), elements: Some(16) })
        );
        // A real file from criterion 0.8.2, verbatim.
        let real = r#"{"group_id":"pair","function_id":"bound","value_str":null,"throughput":null,"full_id":"pair/bound","directory_name":"pair/bound","title":"pair/bound"}"#;
        assert_eq!(parse_benchmark(real).unwrap().full_id, "pair/bound");
        let bytes = r#"{"full_id":"copy","throughput":{"Bytes":4096}}"#;
        assert_eq!(parse_benchmark(bytes), Ok(BenchmarkId { full_id: "copy".into(), elements: None }));
    }

    #[test]
    fn malformed_benchmark_json_says_what_is_wrong() {
        assert!(parse_benchmark("{").unwrap_err().contains("invalid JSON"));
        assert!(parse_benchmark(r#"{"group_id":"pair"}"#).unwrap_err().contains("full_id"));
        assert!(parse_benchmark(r#"{"full_id":""}"#).unwrap_err().contains("full_id"));
        assert!(parse_benchmark(r#"{"full_id":"a","throughput":{"Elements":-1}}"#).unwrap_err().contains("Elements"));
    }

    #[test]
    fn estimates_json_gives_the_median_point_estimate() {
        assert_eq!(parse_median(&estimates_json(78.13)), Ok(78.13));
        // A real file from criterion 0.8.2, verbatim: the median, not the mean or slope.
        let real = r#"{"mean":{"confidence_interval":{"confidence_level":0.95,"lower_bound":78.21498987725369,"upper_bound":78.98230221644546},"point_estimate":78.56475608579592,"standard_error":0.19679025339915504},"median":{"confidence_interval":{"confidence_level":0.95,"lower_bound":77.9846359990222,"upper_bound":78.46606422065165},"point_estimate":78.13874721057381,"standard_error":0.1258156840385217},"median_abs_dev":{"confidence_interval":{"confidence_level":0.95,"lower_bound":0.8220259072608076,"upper_bound":1.235239909307826},"point_estimate":1.0281052793224155,"standard_error":0.1061027634797313},"slope":{"confidence_interval":{"confidence_level":0.95,"lower_bound":78.17608538111303,"upper_bound":79.37261080311998},"point_estimate":78.66080226757936,"standard_error":0.31369788321246345},"std_dev":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0743318625431872,"upper_bound":2.7744219011487083},"point_estimate":1.9812007432173495,"standard_error":0.44040114814398834}}"#;
        assert_eq!(parse_median(real), Ok(78.13874721057381));
        // `slope` is null for benches with too few iterations; the median is always there.
        assert_eq!(parse_median(r#"{"median":{"point_estimate":5.0},"slope":null}"#), Ok(5.0));
    }

    #[test]
    fn malformed_estimates_json_says_what_is_wrong() {
        assert!(parse_median("[]").unwrap_err().contains("median.point_estimate"));
        assert!(parse_median(r#"{"median":{"point_estimate":"fast"}}"#).unwrap_err().contains("median.point_estimate"));
        assert!(parse_median(r#"{"median":{"point_estimate":-3.0}}"#).unwrap_err().contains("not a time"));
        assert!(parse_median("not json").unwrap_err().contains("invalid JSON"));
    }

    #[test]
    fn per_element_divides_by_the_declared_throughput() {
        assert_eq!(Estimate { median_ns: 1600.0, elements: Some(16) }.per_element(), 100.0);
        assert_eq!(Estimate { median_ns: 1600.0, elements: None }.per_element(), 1600.0);
        assert_eq!(Estimate { median_ns: 1600.0, elements: Some(0) }.per_element(), 1600.0);
    }

    #[test]
    fn a_criterion_directory_is_read_by_full_id_and_problems_are_kept() {
        let home = TempDir::new("estimates");
        write_result(&home.0, "pair/bound", None, 30.0);
        write_result(&home.0, "bind", None, 12.0);
        write_result(&home.0, "kv_pages_2_threads/pooled", Some(16), 1600.0);
        // Criterion's other directories are not results: `base` holds the files directly.
        let base = home.0.join("pair").join("bound").join("base");
        std::fs::create_dir_all(&base).unwrap();
        std::fs::write(base.join("benchmark.json"), benchmark_json("pair/bound", None)).unwrap();
        std::fs::write(base.join("estimates.json"), estimates_json(99.0)).unwrap();
        std::fs::create_dir_all(home.0.join("report")).unwrap();
        // A group that happens to be called `base` is a result like any other.
        write_result(&home.0, "base/x", None, 7.0);
        // A broken result is reported by path, not skipped.
        let broken = home.0.join("live").join("none").join("new");
        std::fs::create_dir_all(&broken).unwrap();
        std::fs::write(broken.join("benchmark.json"), benchmark_json("live/none", None)).unwrap();
        std::fs::write(broken.join("estimates.json"), "{}").unwrap();

        let results = read_results(&home.0, None);
        let ids: Vec<&str> = results.benches.keys().map(String::as_str).collect();
        assert_eq!(ids, ["base/x", "bind", "kv_pages_2_threads/pooled", "pair/bound"]);
        assert_eq!(results.benches["pair/bound"].median_ns, 30.0, "new, not base");
        assert_eq!(results.benches["kv_pages_2_threads/pooled"].per_element(), 100.0);
        assert_eq!(results.problems.len(), 1, "{:?}", results.problems);
        let problem = results.problems[0].to_string();
        assert!(problem.contains("live") && problem.contains("estimates.json"), "{problem}");

        assert!(read_results(&home.0.join("absent"), None).benches.is_empty());
    }

    #[test]
    fn results_older_than_the_run_are_stale_not_used() {
        let home = TempDir::new("stale");
        write_result(&home.0, "pair/bound", None, 30.0);
        let later = SystemTime::now() + Duration::from_secs(60);
        let results = read_results(&home.0, Some(later));
        assert!(results.benches.is_empty());
        assert!(matches!(&results.problems[..], [ResultError::Stale { id, .. }] if id == "pair/bound"));
        assert!(results.problems[0].to_string().contains("before this run started"));
        let earlier = SystemTime::now() - Duration::from_secs(60);
        assert_eq!(read_results(&home.0, Some(earlier)).benches.len(), 1);
    }

    #[test]
    fn times_print_with_a_fitting_unit() {
        assert_eq!(Nanos(12.345).to_string(), "12.3 ns");
        assert_eq!(Nanos(-25.0).to_string(), "-25.0 ns");
        assert_eq!(Nanos(1_234.0).to_string(), "1.23 µs");
        assert_eq!(Nanos(5_600_000.0).to_string(), "5.60 ms");
        assert_eq!(Nanos(2.5e9).to_string(), "2.50 s");
        assert_eq!(Nanos(f64::NAN).to_string(), "NaN ns");
    }
}
