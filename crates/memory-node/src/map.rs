//! The shared mapping: the one module with `unsafe` code. It creates or opens the books
//! file, checks its header with ordinary reads *before* mapping anything (so a file of
//! another version, a truncated or a foreign one is refused without touching its
//! pages), maps it shared, and hands out `&Shared` for as long as the mapping lives.
//!
//! Every word of [`Shared`] is an `AtomicU64`, for which every bit pattern is a valid
//! value and every access is atomic, so what other processes write (even garbage) can
//! make values wrong but never makes a Rust reference invalid or a read a data race.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::Ordering::SeqCst;

use rustix::fs::{FlockOperation, flock};
use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};

use crate::error::{BooksIoError, OpenError};
use crate::format::{self, LAYOUT_SIZE, MAGIC, Shared, VERSION};
use crate::protocol::{SLOT_REFUNDING, state_of};

/// The books file, mapped.
pub(crate) struct Mapping {
    ptr: NonNull<Shared>,
    file: File,
    /// The books file's inode, read once when it was mapped: it names the slots' lease
    /// files, which every process must name alike.
    inode: u64,
}

// SAFETY: the mapping is plain shared memory that every thread may read and write
// through `&Shared`, which holds atomics only (`Shared: Sync`); the pointer is never
// used for anything but that shared reference and `munmap` in `drop`.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`: `&Mapping` only gives out `&Shared`, and `Shared` is `Sync`.
unsafe impl Sync for Mapping {}

/// The books' cross-process lock (`flock(LOCK_EX)` on the file), released on drop, and
/// by the kernel if the holder dies.
pub(crate) struct FileLock<'a>(&'a File);

impl Drop for FileLock<'_> {
    fn drop(&mut self) {
        let _ = flock(self.0, FlockOperation::Unlock);
    }
}

fn io<'a>(path: &'a Path, operation: &'static str) -> impl FnOnce(std::io::Error) -> OpenError + 'a {
    move |source| BooksIoError::new(path, operation, source).into()
}

impl Mapping {
    /// Opens the books at `path`, creating them with `mode` if there are none (and
    /// `create`); `true` with the mapping when this call created them.
    pub(crate) fn open(path: &Path, mode: u32, create: bool) -> Result<(Mapping, bool), OpenError> {
        loop {
            match OpenOptions::new().read(true).write(true).open(path) {
                Ok(file) => return Mapping::join(path, file, mode).map(|mapping| (mapping, false)),
                Err(error) if error.kind() == ErrorKind::NotFound && create => {
                    if let Some(mapping) = Mapping::create(path, mode)? {
                        return Ok((mapping, true));
                    }
                    // Another process created it first: join that one.
                }
                Err(error) if error.kind() == ErrorKind::NotFound => {
                    return Err(OpenError::Missing { path: path.to_owned() });
                }
                Err(error) if error.kind() == ErrorKind::NotADirectory => {
                    let name = path.file_name().map_or_else(String::new, |name| name.to_string_lossy().into_owned());
                    return Err(directory_error(path, name, error));
                }
                Err(error) if error.kind() == ErrorKind::PermissionDenied => return Err(permission(path)),
                Err(error) => return Err(io(path, "open")(error)),
            }
        }
    }

    /// Builds a complete file under a temporary name, then links it in place, so no
    /// process ever sees a half-written header. `None` if another process linked its
    /// file first.
    fn create(path: &Path, mode: u32) -> Result<Option<Mapping>, OpenError> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let name = path.file_name().map_or_else(|| "books".into(), |name| name.to_string_lossy().into_owned());
        sweep_abandoned(path, &name);
        let temporary = path.with_file_name(format!(".{name}.{}.{nanos}.tmp", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&temporary)
            .map_err(|error| directory_error(path, name.clone(), error))?;
        let built = (|| {
            // The mode asked for, whatever the umask.
            file.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(io(&temporary, "set the mode of"))?;
            file.set_len(LAYOUT_SIZE as u64).map_err(io(&temporary, "size"))?;
            // Pages the file system cannot back would be mapped all the same (tmpfs and
            // most file systems make a sized file sparse) and fault with `SIGBUS` when
            // first written: here at the header, for a peer at the slot it claims.
            reserve(&file, path)?;
            let mapping = Mapping::map(&temporary, file)?;
            let header = &mapping.shared().header;
            let [_, version, size, devices, tenants, slots] = format::header_words();
            header.version.store(version, SeqCst);
            header.layout_size.store(size, SeqCst);
            header.max_devices.store(devices, SeqCst);
            header.max_tenants.store(tenants, SeqCst);
            header.max_slots.store(slots, SeqCst);
            header.check.store(format::check_word(format::header_words()), SeqCst);
            header.created_pid.store(u64::from(std::process::id()), SeqCst);
            header.created_secs.store((nanos / 1_000_000_000) as u64, SeqCst);
            header.magic.store(MAGIC, SeqCst);
            match std::fs::hard_link(&temporary, path) {
                Ok(()) => Ok(Some(mapping)),
                Err(error) if error.kind() == ErrorKind::AlreadyExists => Ok(None),
                Err(error) => Err(io(path, "link")(error)),
            }
        })();
        let _ = std::fs::remove_file(&temporary);
        built
    }

    /// Checks an existing file's owner (against `mode`, the one asked for) and header
    /// with plain reads, then maps it.
    fn join(path: &Path, file: File, mode: u32) -> Result<Mapping, OpenError> {
        let metadata = file.metadata().map_err(io(path, "stat"))?;
        let uid = rustix::process::geteuid().as_raw();
        // Books of this user only (no group or other bits asked for) are this user's
        // file: one another user made first is theirs, and they would be a peer.
        if mode & 0o077 == 0 && metadata.uid() != uid {
            return Err(OpenError::ForeignOwner {
                path: path.to_owned(),
                owner: metadata.uid(),
                mode: metadata.mode() & 0o7777,
                uid,
                asked: mode,
            });
        }
        let size = metadata.len();
        let mut header = [0u8; format::HEADER_SIZE];
        let readable = (size as usize).min(header.len());
        file.read_exact_at(&mut header[..readable], 0).map_err(io(path, "read"))?;
        let word = |index: usize| u64::from_ne_bytes(header[index * 8..index * 8 + 8].try_into().unwrap_or([0; 8]));
        let truncated =
            |expected: u64| OpenError::Truncated { path: path.to_owned(), size, expected, version: VERSION };
        let corrupt = |what: String| OpenError::Corrupt { path: path.to_owned(), what };
        if size < 8 {
            return Err(truncated(LAYOUT_SIZE as u64));
        }
        if word(0) != MAGIC {
            return Err(corrupt(format!("its first word is {:#018x}, not the books' magic {MAGIC:#018x}", word(0))));
        }
        if size < 16 {
            return Err(truncated(LAYOUT_SIZE as u64));
        }
        if word(1) != VERSION {
            return Err(OpenError::Version { path: path.to_owned(), found: word(1), expected: VERSION });
        }
        if size < format::HEADER_SIZE as u64 {
            return Err(truncated(LAYOUT_SIZE as u64));
        }
        let written = [word(0), word(1), word(2), word(3), word(4), word(5)];
        if written != format::header_words() {
            return Err(corrupt(format!(
                "its header gives layout size {} and {} devices, {} tenants, {} slots, where version {VERSION} has {} \
                 and {}, {}, {}",
                written[2],
                written[3],
                written[4],
                written[5],
                LAYOUT_SIZE,
                format::MAX_DEVICES,
                format::MAX_TENANTS,
                format::MAX_SLOTS
            )));
        }
        if word(6) != format::check_word(written) {
            return Err(corrupt(format!(
                "its header's check word is {:#018x}, where its fields give {:#018x}",
                word(6),
                format::check_word(written)
            )));
        }
        if size < LAYOUT_SIZE as u64 {
            return Err(truncated(LAYOUT_SIZE as u64));
        }
        if size > LAYOUT_SIZE as u64 {
            return Err(corrupt(format!("it is {size} bytes, longer than its layout ({LAYOUT_SIZE})")));
        }
        // A file made sparse (by an older build, or copied) gets its pages backed now,
        // or is refused, rather than a `SIGBUS` at the first slot past the space left.
        reserve(&file, path)?;
        let mapping = Mapping::map(path, file)?;
        let shared = mapping.shared();
        let hwm = shared.header.slots_hwm.load(SeqCst);
        if hwm > format::MAX_SLOTS as u64 {
            return Err(corrupt(format!("its slot high-water mark is {hwm}, past its {} slots", format::MAX_SLOTS)));
        }
        if let Some((slot, entry)) =
            shared.slots.iter().enumerate().find(|(_, entry)| state_of(entry.state.load(SeqCst)) > SLOT_REFUNDING)
        {
            return Err(corrupt(format!(
                "slot {slot} has state word {:#x}, which no version-{VERSION} process writes",
                entry.state.load(SeqCst)
            )));
        }
        Ok(mapping)
    }

    fn map(path: &Path, file: File) -> Result<Mapping, OpenError> {
        let inode = {
            use std::os::unix::fs::MetadataExt;
            file.metadata().map_err(io(path, "stat"))?.ino()
        };
        // SAFETY: a fresh shared read-write mapping of `LAYOUT_SIZE` bytes of `file`,
        // whose size was checked (or set) to exactly that; the kernel chooses the address
        // (no hint), so no existing mapping is replaced. The pointer is kept for `drop`.
        let raw = unsafe {
            mmap(std::ptr::null_mut(), LAYOUT_SIZE, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &file, 0)
        }
        .map_err(|errno| io(path, "map")(errno.into()))?;
        let ptr = NonNull::new(raw.cast::<Shared>())
            .ok_or_else(|| io(path, "map")(std::io::Error::other("mmap returned a null address")))?;
        Ok(Mapping { ptr, file, inode })
    }

    /// The books.
    pub(crate) fn shared(&self) -> &Shared {
        // SAFETY: `ptr` is the start of a live shared mapping of `LAYOUT_SIZE` bytes
        // (`size_of::<Shared>()`), page-aligned (so aligned for `Shared`, align 128), and
        // stays mapped until `self` is dropped, which the returned borrow outlives not.
        // `Shared` is made of `AtomicU64`s only: every byte pattern is a valid value, and
        // other processes change it only through atomic operations (a peer that writes
        // the file with plain writes changes values, not validity). Rust never creates a
        // `&mut` to it.
        unsafe { self.ptr.as_ref() }
    }

    /// The inode of the books file this mapping maps.
    pub(crate) fn inode(&self) -> u64 {
        self.inode
    }

    /// Takes the books' cross-process lock (waiting for it). The caller also holds the
    /// process's own lock: `flock` is per open file, so two threads of one process would
    /// both "hold" it.
    pub(crate) fn lock(&self) -> std::io::Result<FileLock<'_>> {
        loop {
            match flock(&self.file, FlockOperation::LockExclusive) {
                Ok(()) => return Ok(FileLock(&self.file)),
                Err(rustix::io::Errno::INTR) => continue,
                Err(errno) => return Err(errno.into()),
            }
        }
    }
}

impl Mapping {
    /// Takes the books' lock if it is free within `wait` (polling every millisecond);
    /// `None` when another process kept it.
    pub(crate) fn lock_within(&self, wait: std::time::Duration) -> std::io::Result<Option<FileLock<'_>>> {
        let deadline = crate::books::deadline_after(wait);
        loop {
            match flock(&self.file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(Some(FileLock(&self.file))),
                Err(rustix::io::Errno::WOULDBLOCK | rustix::io::Errno::INTR) => {}
                Err(errno) => return Err(errno.into()),
            }
            if std::time::Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `LAYOUT_SIZE` are exactly what `mmap` returned and was asked
        // for; no reference into the mapping outlives `self` (`shared` borrows `self`).
        let _ = unsafe { munmap(self.ptr.as_ptr().cast(), LAYOUT_SIZE) };
    }
}

/// Removes the temporary files (`.<name>.<pid>.<nanos>.tmp`) that creators of the books
/// at `path` left when they died mid-create (killed between making and linking it): its
/// creator's pid has no process and it is over a minute old (a create takes
/// milliseconds; a creator of another pid namespace, whose pid means nothing here, is
/// not kept waiting that long).
fn sweep_abandoned(path: &Path, name: &str) {
    let Some(directory) = path.parent() else { return };
    let Ok(entries) = std::fs::read_dir(directory) else { return };
    let prefix = format!(".{name}.");
    for entry in entries.flatten() {
        let file = entry.file_name();
        let Some((pid, nanos)) =
            file.to_str().and_then(|file| file.strip_prefix(&prefix)?.strip_suffix(".tmp")?.split_once('.'))
        else {
            continue;
        };
        let (Ok(pid), Ok(_)) = (pid.parse::<i32>(), nanos.parse::<u128>()) else { continue };
        let gone = rustix::process::Pid::from_raw(pid)
            .is_some_and(|pid| matches!(rustix::process::test_kill_process(pid), Err(rustix::io::Errno::SRCH)));
        let abandoned = entry
            .metadata()
            .ok()
            .and_then(|metadata| metadata.modified().ok()?.elapsed().ok())
            .is_some_and(|age| age > std::time::Duration::from_secs(60));
        if gone && abandoned && std::fs::remove_file(entry.path()).is_ok() {
            tracing::info!(path = %entry.path().display(), "removed a temporary books file its dead creator left");
        }
    }
}

/// Backs every page of the books `file` (whose name is `path`) with space of its file
/// system: [`OpenError::NoSpace`] when there is not enough. Where space cannot be
/// reserved ahead (`EOPNOTSUPP`, `ENOSYS` on some FUSE and network file systems, an
/// append-only file...) the file is left as it is: the reservation is a safeguard, and
/// books that worked there before keep working.
fn reserve(file: &File, path: &Path) -> Result<(), OpenError> {
    #[cfg(target_os = "linux")]
    loop {
        match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, LAYOUT_SIZE as u64) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::NOSPC | rustix::io::Errno::DQUOT) => {
                return Err(OpenError::NoSpace { path: path.to_owned(), needed: LAYOUT_SIZE as u64 });
            }
            Err(errno) => {
                tracing::debug!(path = %path.display(), %errno, "the node books' space could not be reserved ahead");
                return Ok(());
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (file, path);
        Ok(())
    }
}

/// The error of creating a file in the directory of the books at `path`: the directory's
/// problem (missing, read-only, not writable) with what was found there, or else an
/// I/O error naming the books.
fn directory_error(path: &Path, name: String, error: std::io::Error) -> OpenError {
    let directory = path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    let found = match error.kind() {
        ErrorKind::NotFound | ErrorKind::NotADirectory => match std::fs::metadata(&directory) {
            Ok(metadata) if !metadata.is_dir() => "it is not a directory".to_owned(),
            _ => "it does not exist".to_owned(),
        },
        ErrorKind::ReadOnlyFilesystem => "it is on a read-only file system".to_owned(),
        ErrorKind::PermissionDenied => match std::fs::metadata(&directory) {
            Ok(metadata) => format!("owner uid {}, mode {:04o}", metadata.uid(), metadata.mode() & 0o7777),
            Err(_) => "it cannot be read".to_owned(),
        },
        _ => return io(path, "create")(error),
    };
    OpenError::Directory { directory, name, found, uid: rustix::process::geteuid().as_raw(), source: error }
}

/// The permission error for `path`, with its owner and mode when they can be read.
fn permission(path: &Path) -> OpenError {
    let metadata = std::fs::metadata(path).ok();
    OpenError::Permission {
        path: PathBuf::from(path),
        uid: rustix::process::geteuid().as_raw(),
        owner: metadata.as_ref().map_or(u32::MAX, MetadataExt::uid),
        mode: metadata.as_ref().map_or(0, |m| m.mode() & 0o7777),
    }
}
