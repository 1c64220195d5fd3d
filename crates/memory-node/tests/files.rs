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

/// The tests that start processes, one at a time: the permission test copies this
/// binary and executes the copy, which fails with ETXTBSY when another test's thread
/// forks while the copy is open for writing (the fork holds the descriptor until exec).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SPAWNING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SPAWNING.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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
    let _serial = one_at_a_time();
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
        assert!(error.to_string().contains("chmod u+rw"), "{error}");
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

/// A tmpfs of `size` bytes mounted at a fresh directory, unmounted and removed when
/// dropped; `None` (the test is skipped) where this process may not mount one.
struct SmallTmpfs(PathBuf);

impl SmallTmpfs {
    fn mount(tag: &str, options: &str) -> Option<SmallTmpfs> {
        if !rustix::process::getuid().is_root() {
            return None;
        }
        let dir = std::env::temp_dir().join(format!("memory-node-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(&dir)
            .output()
            .is_ok_and(|output| output.status.success());
        if !mounted {
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        Some(SmallTmpfs(dir))
    }

    /// Writes a file until the file system is full.
    fn fill(&self) {
        use std::io::Write;
        let mut filler = std::fs::File::create(self.0.join("filler")).unwrap();
        while filler.write_all(&[1u8; 4096]).is_ok() {}
    }
}

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Opens the books named by the environment in a child process (a fault there would
/// otherwise kill the test binary); what it printed.
fn open_in_a_child(dir: &Path, name: &str) -> String {
    let output = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "opener_role", "--nocapture", "--test-threads=1"])
        .env(ROLE, "open")
        .env("MEMORY_NODE_BOOKS", name)
        .env("MEMORY_NODE_DIR", dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "the opener failed ({:?}, a SIGBUS is signal 7): {stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[test]
fn books_on_a_full_file_system_are_refused_as_no_space_not_a_sigbus() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let _serial = one_at_a_time();
    // A sized file is sparse on tmpfs: its pages were mapped unbacked, and the first
    // write to one (the header, here) killed the opener with SIGBUS.
    let Some(tmpfs) = SmallTmpfs::mount("full", "size=64k") else {
        println!("skipped: not root, or no tmpfs could be mounted");
        return;
    };
    tmpfs.fill();
    let stdout = open_in_a_child(&tmpfs.0, "books");
    assert!(stdout.contains("refused as expected: there is no room for the node books"), "{stdout}");
    assert!(stdout.contains(&format!("({LAYOUT_SIZE} bytes)")) && stdout.contains("with_directory"), "{stdout}");
    // Nothing is left behind: no books, no temporary file.
    let left: Vec<_> = std::fs::read_dir(&tmpfs.0).unwrap().map(|entry| entry.unwrap().file_name()).collect();
    assert_eq!(left, [std::ffi::OsString::from("filler")], "{left:?}");
    // A sparse books file (written by a build that did not reserve its pages) on a file
    // system with no room for its pages is refused too, before a peer faults on a slot.
    drop(tmpfs);
    let Some(tmpfs) = SmallTmpfs::mount("sparse", "size=64k") else {
        println!("skipped the sparse-file half: a second tmpfs could not be mounted");
        return;
    };
    let (config, _cleanup) = good_file("sparse");
    let whole = std::fs::read(config.path()).unwrap();
    let sparse = OpenOptions::new().write(true).create_new(true).open(tmpfs.0.join("books")).unwrap();
    sparse.set_len(LAYOUT_SIZE as u64).unwrap();
    sparse.write_all_at(&whole[..format::HEADER_SIZE], 0).unwrap();
    drop(sparse);
    let stdout = open_in_a_child(&tmpfs.0, "books");
    assert!(stdout.contains("refused as expected: there is no room for the node books"), "{stdout}");
}

/// The opener's side of the file-system tests (runs only as their child).
#[test]
fn opener_role() {
    if std::env::var(ROLE).as_deref() != Ok("open") {
        return;
    }
    match NodeBooks::open(common::config_from_env()) {
        Err(error @ OpenError::NoSpace { .. }) => println!("refused as expected: {error}"),
        Err(error) => panic!("refused for the wrong reason: {error:?}"),
        Ok(books) => {
            // Touch every slot, as peers claiming them would.
            let path = books.path().to_owned();
            drop(books);
            let file = OpenOptions::new().read(true).write(true).open(&path).unwrap();
            for slot in 0..format::MAX_SLOTS {
                file.write_all_at(&0u64.to_ne_bytes(), format::slot_offset(slot, format::SLOT_SEQ) as u64).unwrap();
            }
            panic!("opened books that have no room: {path:?}");
        }
    }
}

#[test]
fn a_books_directory_that_is_missing_or_read_only_and_a_bad_name_are_refused_naming_them() {
    let _serial = one_at_a_time();
    // The directory's problems were reported on the temporary file (".NAME.PID.NANOS.tmp")
    // as an I/O error, or as a permission problem of that file "owner uid 4294967295,
    // mode 0000" with advice about the books' mode.
    let missing = std::env::temp_dir().join(format!("memory-node-no-such-dir-{}", std::process::id()));
    let error = NodeBooks::open(fresh_config("nodir").with_directory(&missing)).unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(&error, OpenError::Directory { directory, found, .. }
            if *directory == missing && found == "it does not exist"),
        "{error:?}"
    );
    assert!(!message.contains(".tmp") && message.contains("with_directory"), "{message}");
    assert!(!missing.exists(), "nothing was made");
    // A "directory" that is a file.
    let file = fresh_config("plain-file");
    std::fs::write(file.path(), b"not a directory").unwrap();
    let _cleanup = Cleanup(file.path());
    let error = NodeBooks::open(fresh_config("in-a-file").with_directory(file.path())).unwrap_err();
    assert!(
        matches!(&error, OpenError::Directory { directory, found, .. }
            if *directory == file.path() && found == "it is not a directory"),
        "{error:?}"
    );
    // open_existing where there are none: says so, and what opens them.
    let config = fresh_config("none");
    let error = NodeBooks::open_existing(config.clone()).unwrap_err();
    assert!(matches!(&error, OpenError::Missing { path } if *path == config.path()), "{error:?}");
    assert!(error.to_string().contains("NodeBooks::open "), "{error}");
    assert!(!config.path().exists());
    // Names that are not file names.
    for name in ["", "a/b", "..", "/etc/passwd"] {
        let error = NodeBooks::open(NodeConfig::new(name).with_directory(common::books_dir())).unwrap_err();
        assert!(matches!(&error, OpenError::Name { name: found, .. } if found == name), "{name:?}: {error:?}");
        assert!(error.to_string().contains("plain file name"), "{error}");
    }
    // A directory this process may not write: read-only (a read-only tmpfs, as root, who
    // may write any directory's entries otherwise), or a mode-0555 directory.
    let readonly = if rustix::process::getuid().is_root() {
        SmallTmpfs::mount("readonly", "ro,size=64k").map(|tmpfs| (tmpfs, "it is on a read-only file system".to_owned()))
    } else {
        None
    };
    if let Some((tmpfs, expected)) = readonly {
        let error = NodeBooks::open(fresh_config("ro").with_directory(&tmpfs.0)).unwrap_err();
        assert!(
            matches!(&error, OpenError::Directory { directory, found, .. } if *directory == tmpfs.0 && *found == expected),
            "{error:?}"
        );
        assert!(!error.to_string().contains(".tmp"), "{error}");
    } else if !rustix::process::getuid().is_root() {
        let dir = std::env::temp_dir().join(format!("memory-node-ro-dir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
        let error = NodeBooks::open(fresh_config("ro").with_directory(&dir)).unwrap_err();
        let _ = std::fs::remove_dir(&dir);
        assert!(matches!(&error, OpenError::Directory { found, .. } if found.contains("mode 0555")), "{error:?}");
    } else {
        println!("skipped the read-only directory case: root, and no read-only tmpfs could be mounted");
    }
}

#[test]
fn books_another_user_made_first_are_refused_to_a_process_that_asked_for_its_own() {
    // /dev/shm is writable by every user: one who makes the books (a valid file, mode
    // 0666) before the owner's processes start was joined by them, a trusted peer that
    // can forge limits and grants, though they asked for books of their own (0600).
    if !rustix::process::getuid().is_root() {
        println!("skipped: not root, so no file of another user can be made");
        return;
    }
    let (config, _cleanup) = good_file("squatted");
    let path = config.path();
    std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let error = refusal(&config);
    assert!(
        matches!(error, OpenError::ForeignOwner { owner: 65534, mode: 0o666, uid: 0, asked: 0o600, .. }),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(message.contains("uid 65534") && message.contains("with_mode"), "{message}");
    // Books meant to be shared (a mode that admits a group) are joined as before.
    let shared = NodeBooks::open(config.with_mode(0o660)).expect("books shared between users are joined");
    assert!(!shared.created());
}

#[test]
fn a_permission_refusal_advises_the_owner_and_another_user_differently() {
    // Its own file with a mode that locks its owner out told the owner to "run it as
    // the owner" and to create the books with a group mode.
    let own = OpenError::Permission { path: PathBuf::from("/dev/shm/books"), uid: 1000, owner: 1000, mode: 0o400 };
    let message = own.to_string();
    assert!(message.contains("chmod u+rw") && !message.contains("run it as the owner"), "{message}");
    let foreign = OpenError::Permission { path: PathBuf::from("/dev/shm/books"), uid: 1000, owner: 0, mode: 0o600 };
    let message = foreign.to_string();
    assert!(message.contains("run it as the owner") && message.contains("with_mode"), "{message}");
    assert!(message.contains("/dev/shm/books (owner uid 0, mode 0600)"), "{message}");
}

#[test]
fn temporary_files_of_creators_that_died_mid_create_are_removed_by_the_next_creator() {
    // A creator killed between making its temporary file and linking it left the file
    // (the whole layout, reserved) in /dev/shm for good, one per such death.
    let _serial = one_at_a_time();
    let config = fresh_config("abandoned");
    let _cleanup = Cleanup(config.path());
    let dir = config.path().parent().unwrap().to_owned();
    let name = config.path().file_name().unwrap().to_str().unwrap().to_owned();
    let dead = {
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    };
    let temporary = |pid: u32, nanos: u64| dir.join(format!(".{name}.{pid}.{nanos}.tmp"));
    let an_hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let make = |path: &Path, old: bool| {
        let file = std::fs::File::create(path).unwrap();
        if old {
            file.set_modified(an_hour_ago).unwrap();
        }
    };
    let abandoned = temporary(dead, 1);
    let fresh = temporary(dead, 2);
    let live = temporary(std::process::id(), 3);
    make(&abandoned, true);
    make(&fresh, false);
    make(&live, true);
    let books = NodeBooks::open(config).unwrap();
    assert!(books.created());
    assert!(!abandoned.exists(), "an hour-old temporary file of a dead creator was left");
    assert!(fresh.exists(), "a fresh temporary file may be a creator's of another pid namespace, mid-create");
    assert!(live.exists(), "a live creator's temporary file was removed");
    let _ = std::fs::remove_file(fresh);
    let _ = std::fs::remove_file(live);
}
