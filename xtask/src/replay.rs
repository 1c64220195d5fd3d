//! `cargo xtask replay TRACE [...]`: memory-trace's replay, built in release (latencies
//! of a debug build would say nothing) and run from the project root, so a relative
//! TRACE or `--html` path means what it says.

use crate::flags;
use crate::step::Cmd;

/// The command that replays as `flags` asks.
pub(crate) fn replay_cmd(flags: &flags::Replay) -> Cmd {
    let mut args: Vec<String> =
        ["run", "--release", "-q", "-p", "memory-trace", "--bin", "memory-trace", "--", "replay"]
            .map(String::from)
            .to_vec();
    args.push(flags.trace.display().to_string());
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
        args.extend(["--html".to_owned(), html.display().to_string()]);
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
        let line = replay_cmd(&flags).to_string();
        assert!(line.contains("run --release -q -p memory-trace --bin memory-trace -- replay t.mtrace"), "{line}");
        assert!(
            line.ends_with(
                "--allocator system --device-limit 64MiB --compare pooled,virtual --no-quotas --html r.html"
            ),
            "{line}"
        );
        let bare =
            flags::Replay { allocator: None, device_limit: None, compare: None, no_quotas: false, html: None, ..flags };
        assert!(replay_cmd(&bare).to_string().ends_with("replay t.mtrace"));
    }
}
