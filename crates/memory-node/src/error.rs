//! Errors: opening the books file ([`OpenError`]: which problem, and what to do), and
//! everything after ([`NodeError`]).

use std::path::PathBuf;

use memory_governor::{AuthorityIdentity, DeviceKey};

/// The books file could not be opened or created. Each variant says which problem it
/// is; the message says what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The file is of another layout version.
    #[error(
        "the node books at {path} are of layout version {found}, and this build reads version {expected} only: \
         stop the processes of the other version and remove the file (the books are rebuilt from the processes \
         that join), or give this build another books name or directory"
    )]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u64,
        /// The version this build reads.
        expected: u64,
    },
    /// The file is shorter than its layout.
    #[error(
        "the node books at {path} are truncated: {size} bytes, where a version-{version} file has {expected}: \
         something shortened it; stop the processes that use it and remove it"
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The size of its layout.
        expected: u64,
        /// The layout version expected.
        version: u64,
    },
    /// The file is not a books file, or its header or a slot holds what no books file
    /// holds.
    #[error(
        "the node books at {path} are corrupt: {what}; if it is not a books file, choose another name; otherwise \
         stop the processes that use it and remove it"
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// This user may not open the file (its owner and mode are the trust boundary).
    #[error(
        "this process (uid {uid}) may not open the node books at {} (owner uid {owner}, mode {mode:04o}): {}",
        path.display(),
        permission_advice(*uid, *owner)
    )]
    Permission {
        /// The file.
        path: PathBuf,
        /// The calling process's uid.
        uid: u32,
        /// The file's owner (`u32::MAX` when it could not be read).
        owner: u32,
        /// The file's mode bits (`0` when they could not be read).
        mode: u32,
    },
    /// The file system of the books has no room for them: the books would be mapped with
    /// pages that cannot be backed, which a process touching them takes as `SIGBUS`.
    #[error(
        "there is no room for the node books at {path} ({needed} bytes) on its file system: free space in {} \
         (a tmpfs such as /dev/shm is bounded by its size= mount option) or give the books another directory \
         (NodeConfig::with_directory)",
        path.parent().map_or_else(|| path.display().to_string(), |dir| dir.display().to_string())
    )]
    NoSpace {
        /// The file.
        path: PathBuf,
        /// The bytes the books need.
        needed: u64,
    },
    /// The file belongs to another user, and this process asked for books of its own
    /// user only (a mode with no group or other bits, 0600 by default): in a directory
    /// every user may write (`/dev/shm`), another user can make the books first and so
    /// be a peer of every process that joins them.
    #[error(
        "the node books at {} belong to uid {owner} (mode {mode:04o}), and this process (uid {uid}) asked for \
         books of its own user only (mode {asked:04o}): another user made them, and would be a trusted peer of \
         every process that joins; have them removed and let this user make them, choose another name, or, to \
         share books between users, give every process a mode that admits their group (NodeConfig::with_mode)",
        path.display()
    )]
    ForeignOwner {
        /// The file.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// Its mode bits.
        mode: u32,
        /// The calling process's uid.
        uid: u32,
        /// The mode this process's configuration asks for.
        asked: u32,
    },
    /// The books could not be made in their directory: it does not exist, is on a
    /// read-only file system, or this user may not write to it.
    #[error(
        "could not create the node books {name:?} in {} ({found}; this process runs as uid {uid}): {source}; \
         create the directory or let this user write to it, choose another directory \
         (NodeConfig::with_directory), or have a process that may write there create the books (NodeBooks::open) \
         for this one to join",
        directory.display()
    )]
    Directory {
        /// The directory.
        directory: PathBuf,
        /// The books' file name.
        name: String,
        /// What was found there: "it does not exist", "owner uid 0, mode 0755", ...
        found: String,
        /// The calling process's uid.
        uid: u32,
        /// The error of creating the file.
        #[source]
        source: std::io::Error,
    },
    /// [`NodeBooks::open_existing`](crate::NodeBooks::open_existing) found no books.
    #[error(
        "there are no node books at {}: NodeBooks::open_existing never creates them; open them with \
         NodeBooks::open (which does), or check the books' name and directory (NodeConfig)",
        path.display()
    )]
    Missing {
        /// The file looked for.
        path: PathBuf,
    },
    /// The books' name is not a plain file name.
    #[error(
        "the node books name {name:?} is not usable: {reason}; give NodeConfig::new a plain file name (and the \
         directory to NodeConfig::with_directory)"
    )]
    Name {
        /// The name.
        name: String,
        /// Why not.
        reason: &'static str,
    },
    /// Another I/O error ("open", "map", "create", ...).
    #[error(transparent)]
    Io(#[from] BooksIoError),
}

/// What to do about a books file this process may not open: the owner's process whose
/// file's mode locks out its owner, or another user's.
fn permission_advice(uid: u32, owner: u32) -> &'static str {
    if uid == owner {
        "this user owns them, but their mode does not let the owner read and write them: give the owner read and \
         write again (chmod u+rw), or remove them"
    } else {
        "run it as the owner, or have the owner create the books with a mode that admits this user's group \
         (NodeConfig::with_mode) and add the user to that group"
    }
}

/// A books operation after opening failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// Every slot is held by a live process.
    #[error(
        "all {slots} slots of the node books at {path} are held by live processes: end one, or give this group \
         of processes books of its own"
    )]
    SlotsFull {
        /// The file.
        path: PathBuf,
        /// How many slots there are.
        slots: usize,
    },
    /// Every device entry is taken.
    #[error("the node books hold {max} devices already, and {device} is not one of them: use fewer device keys")]
    DevicesFull {
        /// The device asked for.
        device: DeviceKey,
        /// How many devices the books hold.
        max: usize,
    },
    /// Every tenant entry is taken.
    #[error("the node books hold {max} tenants already, and {tenant:?} is not one of them: use fewer tenant names")]
    TenantsFull {
        /// The tenant asked for.
        tenant: String,
        /// How many tenants the books hold.
        max: usize,
    },
    /// A tenant name is empty or too long.
    #[error(
        "the tenant name {tenant:?} ({} bytes) is not usable in the node books: {reason}; give a name of 1 to {} \
         bytes of UTF-8",
        tenant.len(),
        crate::format::TENANT_NAME_BYTES
    )]
    TenantName {
        /// The name.
        tenant: String,
        /// Why not.
        reason: &'static str,
    },
    /// A device key of a tier the books cannot name.
    #[error("the node books cannot name {device}: only device, host and disk tiers are supported")]
    UnsupportedTier {
        /// The device.
        device: DeviceKey,
    },
    /// Joining needs a grant (what the governor already holds, or its reserves) that the
    /// node cannot give now.
    #[error(
        "the node books cannot grant {asked} bytes of {budget} to this process ({available} available): \
         its governor already holds (or reserves) them; raise the node limit or free memory elsewhere first"
    )]
    GrantRefused {
        /// Which budget ("device:0", "tenant-a on device:0").
        budget: String,
        /// Bytes asked.
        asked: u64,
        /// Bytes that were available.
        available: u64,
    },
    /// The device is governed by node books already (through this member, or another
    /// member of the same governor).
    #[error(
        "{device} is governed by node books already, through this member or another member of the same \
         governor: govern each device of a governor through one member"
    )]
    AlreadyGoverned {
        /// The device.
        device: DeviceKey,
    },
    /// The account is bound to a node tenant already (through this member).
    #[error(
        "the account of {authority} is bound to the node tenant {tenant:?} already: bind each account once (a \
         second binding would count its charges twice in the node quota)"
    )]
    AlreadyBound {
        /// The account's authority.
        authority: AuthorityIdentity,
        /// The node tenant it is bound to.
        tenant: String,
    },
    /// The device has not been handed to the books (`Member::govern_device`).
    #[error("{device} is not governed by the node books: call Member::govern_device first")]
    NotGoverned {
        /// The device.
        device: DeviceKey,
    },
    /// The governor refused a change (a limit, quota, policy or an unknown account).
    #[error("the governor refused to {operation}: {source}")]
    Governor {
        /// What was asked of it.
        operation: &'static str,
        /// Its error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The books (or the member) were opened by another process, of which this one is a
    /// fork: it shares that process's slot and its hold on the books' lock (`flock` is
    /// per open file, which a fork shares), so it may neither lock the books nor draw,
    /// give back or free grants through them.
    #[error(
        "the node books at {} were opened by process {opened_by}, and this is process {pid}, a fork of it: a \
         forked process shares its parent's slot and lock, so it may not use them; open the books again in this \
         process (NodeBooks::open) and join them with a governor of its own",
        path.display()
    )]
    Forked {
        /// The file.
        path: PathBuf,
        /// The process that opened the books.
        opened_by: u64,
        /// This process.
        pid: u64,
    },
    /// An I/O error on the books (the lock, the timer thread).
    #[error(transparent)]
    Io(#[from] BooksIoError),
}

/// An I/O error on the books file: what was being done, to which file, and the error.
/// The leaf of both [`OpenError::Io`] and [`NodeError::Io`].
#[derive(Debug, thiserror::Error)]
#[error("could not {operation} the node books at {}: {source}", path.display())]
#[non_exhaustive]
pub struct BooksIoError {
    /// The file.
    pub path: PathBuf,
    /// What was being done ("open", "map", "create", "lock", ...).
    pub operation: &'static str,
    /// The error.
    #[source]
    pub source: std::io::Error,
}

impl BooksIoError {
    pub(crate) fn new(path: impl Into<PathBuf>, operation: &'static str, source: std::io::Error) -> BooksIoError {
        BooksIoError { path: path.into(), operation, source }
    }
}
