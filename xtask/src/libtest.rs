//! Reading libtest's output: the `test result:` summary lines and the `cuda devices: N`
//! line of the CUDA probe. Pure functions over text, so the verdicts that matter (a GPU
//! run that ran nothing is a failure) are unit-tested without a GPU.

/// Test counts summed over every `test result:` line of one `cargo test` run (one line
/// per test binary and one per doctest run).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TestCounts {
    /// `test result:` lines seen.
    pub(crate) suites: u32,
    /// Tests that passed.
    pub(crate) passed: u32,
    /// Tests that failed.
    pub(crate) failed: u32,
    /// Tests skipped as `#[ignore]`d.
    pub(crate) ignored: u32,
    /// Tests left out by the name filter.
    pub(crate) filtered_out: u32,
}

impl TestCounts {
    /// Tests that ran (passed or failed).
    pub(crate) fn ran(&self) -> u32 {
        self.passed + self.failed
    }
}

/// Sums every `test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 2 filtered out; ...`
/// line in `output`. Other lines are ignored; colour escapes are stripped first.
pub(crate) fn parse_test_results(output: &str) -> TestCounts {
    let mut counts = TestCounts::default();
    for line in output.lines() {
        let line = strip_ansi(line);
        let Some(rest) = line.trim().strip_prefix("test result:") else { continue };
        counts.suites += 1;
        // `rest` is ` ok. 3 passed; 0 failed; ...`: drop the status word, then read
        // `N label` pairs separated by `;`.
        let rest = rest.trim_start();
        let fields = rest.split_once(". ").map_or(rest, |(_, fields)| fields);
        for field in fields.split(';') {
            let mut words = field.split_whitespace();
            let (Some(number), Some(label)) = (words.next(), words.next()) else { continue };
            let Ok(number) = number.parse::<u32>() else { continue };
            let slot = match label {
                "passed" => &mut counts.passed,
                "failed" => &mut counts.failed,
                "ignored" => &mut counts.ignored,
                "filtered" => &mut counts.filtered_out,
                _ => continue,
            };
            *slot = slot.saturating_add(number);
        }
    }
    counts
}

/// The `N` of the CUDA probe's `cuda devices: N` line, if it printed one.
pub(crate) fn parse_device_count(output: &str) -> Option<u32> {
    output.lines().find_map(|line| strip_ansi(line).trim().strip_prefix("cuda devices:")?.trim().parse().ok())
}

/// `line` without ANSI colour escapes (`ESC [ ... letter`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // Skip `[`, parameters, and the final letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_SUITES: &str = "\
running 2 tests
test tests::gpu_allocates ... ok
test tests::gpu_releases ... ok

test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 7 filtered out; finished in 0.31s

   Doc-tests allocator_cuda

running 0 tests

test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 3 filtered out; finished in 0.00s
";

    #[test]
    fn summaries_are_summed_over_every_binary_and_doctest_run() {
        let counts = parse_test_results(TWO_SUITES);
        assert_eq!(counts, TestCounts { suites: 2, passed: 2, failed: 0, ignored: 0, filtered_out: 10 });
        assert_eq!(counts.ran(), 2);
    }

    #[test]
    fn failures_and_ignored_tests_are_counted() {
        let output =
            "test result: FAILED. 1 passed; 2 failed; 4 ignored; 0 measured; 0 filtered out; finished in 1.00s";
        let counts = parse_test_results(output);
        assert_eq!((counts.passed, counts.failed, counts.ignored), (1, 2, 4));
        assert_eq!(counts.ran(), 3);
    }

    #[test]
    fn colour_escapes_do_not_hide_a_summary() {
        let output = "test result: \u{1b}[32mok\u{1b}[0m. 5 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out";
        assert_eq!(parse_test_results(output).passed, 5);
    }

    #[test]
    fn output_without_summaries_counts_nothing() {
        let counts = parse_test_results("error[E0425]: cannot find value `x`\nerror: could not compile");
        assert_eq!(counts, TestCounts::default());
        assert_eq!(counts.suites, 0);
    }

    #[test]
    fn test_names_that_mention_test_result_are_not_summaries() {
        let output = "test tests::test_result_is_parsed ... ok\n";
        assert_eq!(parse_test_results(output).suites, 0);
    }

    #[test]
    fn device_count_is_read_from_the_probe_line() {
        assert_eq!(parse_device_count("loading libcuda\ncuda devices: 2\n"), Some(2));
        assert_eq!(parse_device_count("cuda devices: 0"), Some(0));
        assert_eq!(parse_device_count("cuda devices: none"), None);
        assert_eq!(parse_device_count("no CUDA driver found"), None);
    }
}
