//! `cargo xtask replay TRACE [...]`: memory-trace's replay, built in release (latencies
//! of a debug build would say nothing). It runs from the project root (as every xtask
//! command does), so a relative TRACE or `--html` path is made absolute against the
//! directory `cargo xtask` was called from first: it means what it says from anywhere in
//! the tree (`crates/memory-trace$ cargo xtask replay traces/demo.mtrace`).

use std::path::Path;

use crate::flags;
use crate::step::Cmd;

/// The command that replays as `flags` asks, its relative paths taken from the current
/// directory.
pub(crate) fn replay_cmd(flags: &flags::Replay) -> Cmd {
    // An unreadable current directory leaves relative paths as they are (the root's).
    let cwd = std::env::current_dir().unwrap_or_default();
    replay_cmd_from(flags, &cwd)
}

/// The command that replays as `flags` asks, called from `cwd`.
fn replay_cmd_from(flags: &flags::Replay, cwd: &Path) -> Cmd {
    let mut args: Vec<String> =
        ["run", "--release", "-q", "-p", "memory-trace", "--bin", "memory-trace", "--", "replay"]
            .map(String::from)
            .to_vec();
    args.push(cwd.join(&flags.trace).display().to_string());
    if let Some(allocator) = flags.allocator {
        args.extend(["--allocator".to_owned(), allocator.name().to_owned()]);
    }
    if let Some(limit) = &flags.device_limit {
        args.extend(["--device-limit".to_owned(), limit.clone()]);
    }
    if let Some(compare) = &flags.compare {
        args.extend(["--compare".to_owned(), compare.clone()]);
    }
    if flags.no_quotas {
        args.push("--no-quotas".to_owned());
    }
    if let Some(html) = &flags.html {
        args.extend(["--html".to_owned(), cwd.join(html).display().to_string()]);
    }
    Cmd::cargo(args)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::flags::ReplayAllocator;

    #[test]
    fn replay_runs_the_release_binary_with_every_flag_passed_on() {
        let flags = flags::Replay {
            trace: PathBuf::from("t.mtrace"),
            allocator: Some(ReplayAllocator::System),
            device_limit: Some("64MiB".into()),
            compare: Some("pooled,virtual".into()),
            no_quotas: true,
            html: Some(PathBuf::from("r.html")),
        };
        let line = replay_cmd_from(&flags, Path::new("/w")).to_string();
        assert!(line.contains("run --release -q -p memory-trace --bin memory-trace -- replay /w/t.mtrace"), "{line}");
        assert!(
            line.ends_with(
                "--allocator system --device-limit 64MiB --compare pooled,virtual --no-quotas --html /w/r.html"
            ),
            "{line}"
        );
        let bare =
            flags::Replay { allocator: None, device_limit: None, compare: None, no_quotas: false, html: None, ..flags };
        assert!(replay_cmd_from(&bare, Path::new("/w")).to_string().ends_with("replay /w/t.mtrace"));
    }

    /// The command runs from the project root: a relative path given from a directory
    /// below it (`crates/memory-trace$ cargo xtask replay traces/demo.mtrace --html r.html`)
    /// was passed on as it was, so the replay looked for the trace (and wrote the page)
    /// under the root: "cannot open traces/demo.mtrace". Relative paths are now the
    /// caller's; absolute ones stay.
    #[test]
    fn relative_paths_are_the_callers_from_wherever_it_calls() {
        let flags = flags::Replay {
            trace: PathBuf::from("traces/demo.mtrace"),
            allocator: None,
            device_limit: None,
            compare: None,
            no_quotas: false,
            html: Some(PathBuf::from("out/r.html")),
        };
        let line = replay_cmd_from(&flags, Path::new("/repo/crates/memory-trace")).to_string();
        assert!(
            line.ends_with(
                "replay /repo/crates/memory-trace/traces/demo.mtrace --html /repo/crates/memory-trace/out/r.html"
            ),
            "{line}"
        );
        let absolute =
            flags::Replay { trace: PathBuf::from("/data/t.mtrace"), html: Some(PathBuf::from("/tmp/r.html")), ..flags };
        let line = replay_cmd_from(&absolute, Path::new("/repo/crates/memory-trace")).to_string();
        assert!(line.ends_with("replay /data/t.mtrace --html /tmp/r.html"), "{line}");
        // The command the task builds takes the current directory.
        let here = std::env::current_dir().unwrap().join("t.mtrace");
        let line = replay_cmd(&flags::Replay { trace: PathBuf::from("t.mtrace"), html: None, ..absolute }).to_string();
        assert!(line.ends_with(&format!("replay {}", here.display())), "{line}");
    }
}
