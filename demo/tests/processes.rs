//! `memory-demo --processes 3`: three engine processes share node books, one is killed
//! two thirds in, and the report ends with the nothing-lost check across processes.

use std::process::Command;

#[test]
fn three_engine_processes_share_the_books_and_lose_nothing_when_one_is_killed() {
    let output = Command::new(env!("CARGO_BIN_EXE_memory-demo"))
        .args(["--processes", "3", "--requests", "240"])
        .output()
        .expect("the demo starts");
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{report}{}", String::from_utf8_lossy(&output.stderr));
    assert!(report.contains("killed with SIGKILL") && report.contains("a survivor refunded its slot"), "{report}");
    assert!(report.contains("never over a limit or a quota"), "{report}");
    assert!(report.contains("0 slot(s) held"), "{report}");
    assert!(report.trim_end().ends_with("nothing lost across processes"), "{report}");
}
