//! Books files that must be refused, each with the error that says which problem it is:
//! another version, truncated, corrupt, and one this user may not open (another user's
//! file with mode 0600: the joiner runs as `nobody` when the test runs as root).
#![cfg(unix)]

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{Cleanup, fresh_config};
use memory_node::format::{self, LAYOUT_SIZE};
use memory_node::{NodeBooks, NodeConfig, OpenError};

const ROLE: &str = "MEMORY_NODE_FILES_ROLE";

/// A good books file, closed again; the config that names it.
fn good_file(tag: &str) -> (NodeConfig, Cleanup) {
    let config = fresh_config(tag);
    let books = NodeBooks::open(config.clone()).unwrap();
    assert!(books.created());
    let cleanup = Cleanup(books.path().to_owned());
    drop(books);
    (config, cleanup)
}

fn write_word(path: &Path, offset: usize, value: u64) {
    let file = OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(&value.to_ne_bytes(), offset as u64).unwrap();
}

fn refusal(config: &NodeConfig) -> OpenError {
    NodeBooks::open(config.clone()).expect_err("a bad books file was accepted")
}

#[test]
fn a_file_of_another_version_is_refused_as_such() {
    let (config, _cleanup) = good_file("version");
    write_word(&config.path(), format::VERSION_OFFSET, 2);
    let error = refusal(&config);
    assert!(matches!(error, OpenError::Version { found: 2, expected: 1, .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.contains("layout version 2") && message.contains("remove the file"), "{message}");
}

#[test]
fn a_truncated_file_is_refused_as_such() {
    let (config, _cleanup) = good_file("truncated");
    let file = OpenOptions::new().write(true).open(config.path()).unwrap();
    file.set_len(LAYOUT_SIZE as u64 / 2).unwrap();
    let error = refusal(&config);
    assert!(matches!(error, OpenError::Truncated { expected, .. } if expected == LAYOUT_SIZE as u64), "{error:?}");
    assert!(error.to_string().contains("truncated"), "{error}");
    file.set_len(0).unwrap();
    let error = refusal(&config);
    assert!(matches!(error, OpenError::Truncated { size: 0, .. }), "{error:?}");
}

#[test]
fn a_corrupt_file_is_refused_as_such() {
    let (config, _cleanup) = good_file("corrupt");
    let path = config.path();
    // A scribbled check word.
    write_word(&path, format::CHECK_OFFSET, 0xdead_beef);
    let error = refusal(&config);
    assert!(matches!(&error, OpenError::Corrupt { what, .. } if what.contains("check word")), "{error:?}");
    // A wrong layout size (with a matching check word it would still be another layout).
    let (config, _cleanup2) = good_file("corrupt-size");
    write_word(&config.path(), format::LAYOUT_SIZE_OFFSET, 4096);
    let error = refusal(&config);
    assert!(matches!(&error, OpenError::Corrupt { what, .. } if what.contains("layout size")), "{error:?}");
    // A slot state no process writes.
    let (config, _cleanup3) = good_file("corrupt-slot");
    write_word(&config.path(), format::slot_offset(3, format::SLOT_STATE), 9);
    let error = refusal(&config);
    assert!(matches!(&error, OpenError::Corrupt { what, .. } if what.contains("slot 3")), "{error:?}");
    // Not a books file at all.
    let other = fresh_config("not-books");
    std::fs::write(other.path(), vec![7u8; 4096]).unwrap();
    let _cleanup4 = Cleanup(other.path());
    let error = refusal(&other);
    assert!(matches!(&error, OpenError::Corrupt { what, .. } if what.contains("magic")), "{error:?}");
    assert!(error.to_string().contains("choose another name"), "{error}");
}

#[test]
fn another_users_file_with_mode_0600_is_refused_as_a_permission_problem() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let (config, _cleanup) = good_file("permission");
    let path = config.path();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "books are created with mode 0600");
    if rustix::process::getuid().is_root() {
        // Root may open any file: the joiner runs as `nobody` (uid 65534), from a copy of
        // this test binary that `nobody` can execute.
        let dir = std::env::temp_dir().join(format!("memory-node-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let exe: PathBuf = dir.join("files-test");
        std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let output = Command::new(&exe)
            .args(["--exact", "joiner_role", "--nocapture", "--test-threads=1"])
            .env(ROLE, "join")
            .env("MEMORY_NODE_BOOKS", path.file_name().unwrap())
            .env("MEMORY_NODE_DIR", path.parent().unwrap())
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "the joiner failed: {stdout}{}", String::from_utf8_lossy(&output.stderr));
        assert!(stdout.contains("refused as expected:") && stdout.contains("may not open"), "{stdout}");
        assert!(
            stdout.contains("uid 65534") && stdout.contains("owner uid 0") && stdout.contains("mode 0600"),
            "{stdout}"
        );
    } else {
        // Not root: this user cannot make a file another user owns; a file it may not
        // open (mode 0000) exercises the same refusal.
        println!(
            "not root: testing the permission refusal with a mode-0000 file of this user instead of another user's"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o000)).unwrap();
        let error = refusal(&config);
        assert!(matches!(error, OpenError::Permission { .. }), "{error:?}");
    }
}

/// The joiner's side of the permission test (runs only as its child).
#[test]
fn joiner_role() {
    if std::env::var(ROLE).as_deref() != Ok("join") {
        return;
    }
    let config = common::config_from_env();
    match NodeBooks::open_existing(config) {
        Err(error @ OpenError::Permission { .. }) => println!("refused as expected: {error}"),
        Err(error) => panic!("refused for the wrong reason: {error:?}"),
        Ok(_) => panic!("uid {} opened another user's 0600 books", rustix::process::getuid().as_raw()),
    }
}
