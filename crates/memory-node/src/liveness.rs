//! Who a process is, and whether the process a slot names still runs.
//!
//! A slot names its owner by pid, the process's start time (field 22 of
//! `/proc/PID/stat`: clock ticks after boot), its pidfs inode where the kernel has pidfs
//! (Linux 6.9 on: the inode of a pidfd, which no other process of the boot shares), the
//! boot id and the pid namespace. A pid the kernel reuses for a new process names another
//! pidfs inode, and has another start time unless it was reused within one clock tick
//! (10 ms; the inode tells those apart too), so it never inherits a slot; a slot from
//! before a reboot has another boot id. A process is declared dead only on evidence:
//! `kill(pid, 0)` says no such process, or the process with that pid is another one (its
//! pidfs inode or its start time differs), or the slot is from another boot. A slow or stopped process is alive,
//! and so is one whose `/proc` entry this user cannot read or see (`hidepid`).
//! A slot of another pid namespace cannot be judged from here by its pid (which means
//! something else); its owner's lease can (the books' `refund_locked`: a lease file the
//! owner holds `flock`ed, which the kernel unlocks when the owner dies, see
//! [`format::SLOT_LEASE_GENERATION`](crate::format::SLOT_LEASE_GENERATION)), and a slot
//! with no lease is left to a peer of its own namespace.

use std::fs;
use std::os::unix::fs::MetadataExt;

use rustix::io::Errno;
use rustix::process::{Pid, test_kill_process};

/// The identity a slot records.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) pid: u64,
    pub(crate) start_time: u64,
    pub(crate) boot: [u64; 2],
    pub(crate) pid_ns: u64,
    /// The process's pidfs inode; 0 when unknown (no pidfs, or a slot that records none).
    pub(crate) pidfd_inode: u64,
}

/// What a survivor concludes about a slot's owner.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Runs (or cannot be shown not to).
    Alive,
    /// Gone: its grants may be refunded.
    Dead(DeathReason),
    /// Of another pid namespace: not ours to judge.
    Foreign,
}

/// Why a slot's owner is taken for dead.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum DeathReason {
    /// No process has the pid.
    NoProcess,
    /// A process with the pid started at another time, or has another pidfs inode: the
    /// pid was reused.
    PidReused,
    /// The slot was written before this boot.
    OtherBoot,
    /// The process has exited (a zombie its parent has not reaped yet).
    Exited,
}

impl DeathReason {
    pub(crate) fn name(self) -> &'static str {
        match self {
            DeathReason::NoProcess => "no process has its pid",
            DeathReason::PidReused => {
                "its pid now names another process (one started at another time, or with another pidfs inode)"
            }
            DeathReason::OtherBoot => "it ran before the node rebooted",
            DeathReason::Exited => "it has exited (its parent has not reaped it yet)",
        }
    }
}

impl Identity {
    /// The calling process.
    pub(crate) fn current() -> std::io::Result<Identity> {
        let pid = u64::from(rustix::process::getpid().as_raw_nonzero().get().unsigned_abs());
        let start_time =
            stat_of(pid)?.ok_or_else(|| std::io::Error::other("/proc/self/stat has no start time"))?.start_time;
        let pidfd_inode = pidfs_inode(pid).ok().flatten().unwrap_or(0);
        Ok(Identity { pid, start_time, boot: boot_id()?, pid_ns: pid_namespace()?, pidfd_inode })
    }

    /// Whether the process this identity names still runs, judged by `me`.
    pub(crate) fn verdict(&self, me: &Identity) -> Verdict {
        if self.boot != me.boot {
            return Verdict::Dead(DeathReason::OtherBoot);
        }
        if self.pid_ns != me.pid_ns {
            return Verdict::Foreign;
        }
        let Some(pid) = i32::try_from(self.pid).ok().and_then(Pid::from_raw) else {
            return Verdict::Dead(DeathReason::NoProcess);
        };
        // The pidfs inode names one process of this boot: another one is another process
        // (a pid reused, even within the clock tick that start times count in).
        // The same inode is the same process: its start time is not compared then (a
        // reader in another time namespace sees start times shifted by its offset, and
        // would take a live process for a reused pid).
        let mut start_time = Some(self.start_time);
        if self.pidfd_inode != 0
            && let Ok(Some(inode)) = pidfs_inode(self.pid)
        {
            if inode != self.pidfd_inode {
                return Verdict::Dead(DeathReason::PidReused);
            }
            start_time = None;
        }
        // EPERM: it exists, under another user. Any other answer: not evidence.
        let exists = || !matches!(test_kill_process(pid), Err(Errno::SRCH));
        judge(start_time, exists, || stat_of(self.pid), || threads(self.pid))
    }
}

/// The verdict on a process of this boot and pid namespace, from what can be seen of it:
/// `exists` (`kill(pid, 0)` found it, perhaps under another user), its `stat` and its
/// thread count; `start_time` the one the slot records, `None` where the process is
/// known to be the slot's (its pidfs inode matched). Declares it dead only on evidence.
fn judge(
    start_time: Option<u64>,
    exists: impl Fn() -> bool,
    stat: impl FnOnce() -> std::io::Result<Option<Stat>>,
    threads: impl FnOnce() -> usize,
) -> Verdict {
    if !exists() {
        return Verdict::Dead(DeathReason::NoProcess);
    }
    match stat() {
        Ok(Some(stat)) if start_time.is_some_and(|start_time| stat.start_time != start_time) => {
            Verdict::Dead(DeathReason::PidReused)
        }
        // Exited, not yet reaped by its parent: it holds nothing any more. (A leader
        // thread that exited while other threads run shows `Z` too: those threads
        // are still listed under `task/`, and the process is alive.)
        Ok(Some(stat)) if matches!(stat.state, 'Z' | 'X') && threads() <= 1 => Verdict::Dead(DeathReason::Exited),
        // No `/proc/PID`: gone between the two looks, or hidden from us (`hidepid=2`
        // hides another user's processes, which `kill` still finds). Look again.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound && !exists() => {
            Verdict::Dead(DeathReason::NoProcess)
        }
        // The same process, or its stat is unreadable or hidden (hidepid): alive.
        _ => Verdict::Alive,
    }
}

/// The pidfs inode of the process `pid`: `Ok(None)` when the kernel has no pidfs (a pidfd
/// is then an anonymous inode every pidfd shares) or the pidfd cannot be had for a reason
/// other than there being no such process (`Err(ESRCH)`).
pub(crate) fn pidfs_inode(pid: u64) -> Result<Option<u64>, Errno> {
    #[cfg(target_os = "linux")]
    {
        /// `PID_FS_MAGIC` (`include/uapi/linux/magic.h`).
        const PID_FS_MAGIC: u64 = 0x5049_4446;
        let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) else { return Ok(None) };
        let pidfd = match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) {
            Ok(pidfd) => pidfd,
            Err(Errno::SRCH) => return Err(Errno::SRCH),
            Err(_) => return Ok(None),
        };
        let on_pidfs = rustix::fs::fstatfs(&pidfd).is_ok_and(|fs| fs.f_type as u64 == PID_FS_MAGIC);
        if !on_pidfs {
            return Ok(None);
        }
        #[allow(clippy::unnecessary_cast, reason = "`st_ino`'s type differs between targets")]
        Ok(rustix::fs::fstat(&pidfd).ok().map(|stat| stat.st_ino as u64).filter(|&inode| inode != 0))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = pid;
        Ok(None)
    }
}

/// What a slot's judge reads of a process.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Stat {
    /// Field 3: `R`, `S`, `D`, `T`, `Z` (zombie), ...
    pub(crate) state: char,
    /// Field 22: clock ticks after boot.
    pub(crate) start_time: u64,
}

/// The state and start time of `pid` from `/proc/PID/stat`, `Ok(None)` if unparsable.
pub(crate) fn stat_of(pid: u64) -> std::io::Result<Option<Stat>> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    Ok(parse_stat(&stat))
}

/// Fields 3 and 22 of a `/proc/PID/stat` line. The command (field 2) is in parentheses
/// and may itself hold spaces and parentheses, so the fields are counted after the last `)`.
pub(crate) fn parse_stat(stat: &str) -> Option<Stat> {
    let mut fields = stat[stat.rfind(')')? + 1..].split_ascii_whitespace();
    // Field 3 (state) is the first after the command: field 22 is the 20th from there.
    let state = fields.next()?.chars().next()?;
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(Stat { state, start_time })
}

/// How many threads `/proc/PID/task` lists (0 if it cannot be read).
fn threads(pid: u64) -> usize {
    fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |entries| entries.count())
}

fn boot_id() -> std::io::Result<[u64; 2]> {
    let text = fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    let hex: String = text.chars().filter(char::is_ascii_hexdigit).collect();
    let parse = |range: std::ops::Range<usize>| {
        hex.get(range)
            .and_then(|digits| u64::from_str_radix(digits, 16).ok())
            .ok_or_else(|| std::io::Error::other(format!("/proc/sys/kernel/random/boot_id is not a uuid: {text:?}")))
    };
    Ok([parse(0..16)?, parse(16..32)?])
}

fn pid_namespace() -> std::io::Result<u64> {
    Ok(fs::metadata("/proc/self/ns/pid")?.ino())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_and_start_time_are_fields_3_and_22_even_when_the_command_holds_parentheses() {
        let stat = "4242 (a (weird) cmd) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21";
        assert_eq!(parse_stat(stat), Some(Stat { state: 'S', start_time: 987654 }));
    }

    #[test]
    fn a_process_that_exists_but_whose_proc_entry_is_hidden_is_alive() {
        // `hidepid=2`: another user's process answers `kill(pid, 0)` with EPERM (it
        // exists) while its `/proc/PID` is not there for us (ENOENT). Not evidence of death.
        let hidden = || Err(std::io::Error::from(std::io::ErrorKind::NotFound));
        assert_eq!(judge(Some(7), || true, hidden, || 1), Verdict::Alive);
        // Gone between the two looks: the second `kill` says so.
        let looks = std::cell::Cell::new(0);
        let gone_after_first_look = || {
            looks.set(looks.get() + 1);
            looks.get() == 1
        };
        assert_eq!(judge(Some(7), gone_after_first_look, hidden, || 1), Verdict::Dead(DeathReason::NoProcess));
        // A zombie with no thread left is dead; one whose other threads run is not.
        let zombie = || Ok(Some(Stat { state: 'Z', start_time: 7 }));
        assert_eq!(judge(Some(7), || true, zombie, || 1), Verdict::Dead(DeathReason::Exited));
        assert_eq!(judge(Some(7), || true, zombie, || 3), Verdict::Alive);
        let reused = || Ok(Some(Stat { state: 'S', start_time: 8 }));
        assert_eq!(judge(Some(7), || true, reused, || 1), Verdict::Dead(DeathReason::PidReused));
    }

    #[test]
    fn the_calling_process_is_alive_and_a_forged_start_time_is_a_reused_pid() {
        let me = Identity::current().unwrap();
        assert_eq!(me.verdict(&me), Verdict::Alive);
        let reused = Identity { start_time: me.start_time + 1, pidfd_inode: 0, ..me };
        assert_eq!(reused.verdict(&me), Verdict::Dead(DeathReason::PidReused));
        // Its own pidfs inode with a start time read in another time namespace (shifted
        // by that namespace's offset): the same process, alive.
        if me.pidfd_inode != 0 {
            let shifted = Identity { start_time: me.start_time + 1000, ..me };
            assert_eq!(shifted.verdict(&me), Verdict::Alive);
        }
        let other_boot = Identity { boot: [me.boot[0] ^ 1, me.boot[1]], ..me };
        assert_eq!(other_boot.verdict(&me), Verdict::Dead(DeathReason::OtherBoot));
        let foreign = Identity { pid_ns: me.pid_ns ^ 1, ..me };
        assert_eq!(foreign.verdict(&me), Verdict::Foreign);
        // Same pid and start time (a pid reused within one clock tick), another process's
        // pidfs inode: another process. Where the kernel has no pidfs there is no inode.
        if me.pidfd_inode != 0 {
            let same_tick = Identity { pidfd_inode: me.pidfd_inode + 1, ..me };
            assert_eq!(same_tick.verdict(&me), Verdict::Dead(DeathReason::PidReused));
        }
        let unknown = Identity { pidfd_inode: 0, ..me };
        assert_eq!(unknown.verdict(&me), Verdict::Alive);
    }
}
