//! The demo binary as a user runs it.

use std::process::Command;

fn demo(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_memory-demo")).args(args).output().expect("the demo binary starts")
}

#[test]
fn demo_runs_the_walkthrough_and_ends_with_a_passing_check() {
    let output = demo(&[]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    for section in ["1. Allocate", "2. Write", "3. Bad layouts", "4. Release", "5. Identities", "check: passed"] {
        assert!(stdout.contains(section), "missing {section:?} in:\n{stdout}");
    }
    assert!(stdout.contains("failed, block handed back"), "{stdout}");
}

#[test]
fn demo_help_exits_zero_and_unknown_flags_are_rejected() {
    let help = demo(&["--help"]);
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("USAGE"));
    let bad = demo(&["--requests", "10"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unexpected argument"));
}
