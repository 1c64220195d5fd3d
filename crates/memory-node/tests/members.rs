//! Several governors (members) in one process sharing node books: the shared limit and
//! quota, give-backs and pressure, forged slots (a reused pid, a death mid-grant), leaving.
#![cfg(unix)]

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Cleanup, MIB, allocate, engine, fresh_config, system};
use memory_governor::DeviceKey;
use memory_node::format::{self, SLOT_LIVE};
use memory_node::{NodeBooks, NodeError};

const GPU: DeviceKey = DeviceKey::host(40);

fn read_word(path: &std::path::Path, offset: usize) -> u64 {
    let file = OpenOptions::new().read(true).open(path).unwrap();
    let mut word = [0u8; 8];
    file.read_exact_at(&mut word, offset as u64).unwrap();
    u64::from_ne_bytes(word)
}

fn write_word(path: &std::path::Path, offset: usize, value: u64) {
    let file = OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(&value.to_ne_bytes(), offset as u64).unwrap();
}

/// Writes a live slot at `slot` copying `from`'s identity, with `start_time` and a
/// device grant of `grant` on device entry 0; `seq` as given (odd: died mid-grant).
fn forge_slot(path: &std::path::Path, from: usize, slot: usize, pid: u64, start_time: u64, grant: u64, seq: u64) {
    for field in [format::SLOT_BOOT, format::SLOT_BOOT + 8, format::SLOT_PID_NS] {
        write_word(path, format::slot_offset(slot, field), read_word(path, format::slot_offset(from, field)));
    }
    write_word(path, format::slot_offset(slot, format::SLOT_PID), pid);
    write_word(path, format::slot_offset(slot, format::SLOT_START_TIME), start_time);
    write_word(path, format::slot_offset(slot, format::SLOT_DEVICE_GRANT), grant);
    write_word(path, format::slot_offset(slot, format::SLOT_SEQ), seq);
    write_word(path, format::slot_offset(slot, format::SLOT_STATE), (1 << 8) | SLOT_LIVE);
    // The slot high-water mark (header word 7).
    let hwm = read_word(path, 7 * 8).max(slot as u64 + 1);
    write_word(path, 7 * 8, hwm);
}

#[test]
fn two_governors_share_one_device_limit_and_one_tenant_quota() {
    let books = NodeBooks::open(fresh_config("share")).unwrap();
    let _cleanup = Cleanup(books.path().to_owned());
    books.set_device_limit(GPU, 8 * MIB).unwrap();
    books.set_tenant_quota(GPU, "tenant-a", 5 * MIB).unwrap();
    let a = engine(&books, GPU, &["tenant-a", "tenant-b"], || system(GPU));
    let b = engine(&books, GPU, &["tenant-a", "tenant-b"], || system(GPU));

    // tenant-a's quota spans both governors: 3 MiB here and 2 MiB there, then no more.
    let a1 = allocate(&a.tenants[0], 3 * MIB).expect("within the node quota");
    let b1 = allocate(&b.tenants[0], 2 * MIB).expect("within the node quota");
    assert!(allocate(&b.tenants[0], MIB).is_none(), "tenant-a's node quota is spent over both processes");
    assert!(allocate(&a.tenants[0], MIB).is_none());
    // The device limit spans them too: 5 MiB charged, 3 MiB left for tenant-b.
    let b2 = allocate(&b.tenants[1], 3 * MIB).expect("within the device limit");
    assert!(allocate(&a.tenants[1], MIB).is_none(), "the node limit is spent");
    let snapshot = books.snapshot();
    assert!(snapshot.consistent);
    let device = snapshot.device(GPU).unwrap();
    assert!(device.granted <= 8 * MIB, "{device:?}");
    assert!(snapshot.tenant(GPU, "tenant-a").unwrap().granted <= 5 * MIB);

    // Released memory returns to the node (the members give surplus back) and the other
    // governor can have it.
    drop((a1, b2));
    let deadline = Instant::now() + Duration::from_secs(5);
    let a2 = loop {
        if let Some(block) = allocate(&a.tenants[1], 6 * MIB) {
            break block;
        }
        assert!(
            Instant::now() < deadline,
            "released memory did not return to the node: {}",
            books.snapshot().to_json()
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    drop((a2, b1));
    for engine in [a, b] {
        let report = engine.member.leave();
        assert!(report.slot_freed, "{report:?}");
    }
    let snapshot = books.snapshot();
    assert_eq!(snapshot.device(GPU).unwrap().granted, 0);
    assert!(snapshot.slots.is_empty(), "{}", snapshot.to_json());
}

#[test]
fn a_refusal_at_the_node_names_the_local_limit_and_changes_nothing() {
    let books = NodeBooks::open(fresh_config("refusal")).unwrap();
    let _cleanup = Cleanup(books.path().to_owned());
    books.set_device_limit(GPU, 4 * MIB).unwrap();
    let a = engine(&books, GPU, &["tenant-a"], || system(GPU));
    let block = allocate(&a.tenants[0], 3 * MIB).unwrap();
    let refused = a.tenants[0]
        .binding
        .allocate(memory_governor::AllocationRequest::new(2 << 20, 64).unwrap())
        .expect_err("over the node limit");
    let message = refused.to_string();
    assert!(message.contains("device limit"), "{message}");
    assert!(a.member.stats().refusals >= 1);
    assert_eq!(a.governor.snapshot().device(GPU).unwrap().current, 3 * MIB);
    drop(block);
    drop(a);
    assert_eq!(books.snapshot().device(GPU).unwrap().granted, 0);
}

#[test]
fn a_member_under_pressure_gets_what_another_holds_idle() {
    // `a` keeps a large margin: idle grant that `b` needs.
    let config = fresh_config("pressure");
    let books_a = NodeBooks::open(config.clone().with_margin(6 * MIB).with_grant_chunk(6 * MIB)).unwrap();
    let _cleanup = Cleanup(books_a.path().to_owned());
    let books_b = NodeBooks::open(config.with_pressure_wait(Duration::from_millis(200))).unwrap();
    books_a.set_device_limit(GPU, 8 * MIB).unwrap();
    let a = engine(&books_a, GPU, &["tenant-a"], || system(GPU));
    let b = engine(&books_b, GPU, &["tenant-b"], || system(GPU));
    let small = allocate(&a.tenants[0], MIB).unwrap();
    assert!(a.member.device_grant(GPU).unwrap() >= 6 * MIB, "a holds a chunk");
    // b needs 4 MiB: only there if a gives its idle grant back, which it does once b's
    // refusal raised the pressure (within b's wait).
    let big = allocate(&b.tenants[0], 4 * MIB).unwrap_or_else(|| {
        panic!(
            "the pressure did not bring a's surplus back: {} a: {:?} b: {:?}",
            books_a.snapshot().to_json(),
            a.member.stats(),
            b.member.stats()
        )
    });
    assert!(books_a.snapshot().device(GPU).unwrap().pressure >= 1);
    drop((small, big));
    drop((a, b));
}

#[test]
fn a_slot_with_a_live_pid_but_another_start_time_is_refunded_and_the_true_one_is_not() {
    // No periodic scan (see the mid-grant test): only the refund_dead below refunds.
    let books = NodeBooks::open(fresh_config("reuse").with_refund_interval(Duration::from_secs(3600))).unwrap();
    let path = books.path().to_owned();
    let _cleanup = Cleanup(path.clone());
    books.set_device_limit(GPU, 16 * MIB).unwrap();
    let a = engine(&books, GPU, &["tenant-a"], || system(GPU));
    let me = a.member.slot();
    let pid = u64::from(std::process::id());
    let start = read_word(&path, format::slot_offset(me, format::SLOT_START_TIME));
    // Slot 10: our pid, another start time (the pid was reused). Slot 11: our true
    // identity (a second member of this very process): alive.
    forge_slot(&path, me, 10, pid, start + 1, 5 * MIB, 0);
    forge_slot(&path, me, 11, pid, start, 3 * MIB, 0);
    assert_eq!(books.snapshot().device(GPU).unwrap().granted, 8 * MIB + a.member.device_grant(GPU).unwrap());
    let refunds = books.refund_dead().unwrap();
    assert_eq!(refunds.len(), 1, "{refunds:?}");
    assert_eq!((refunds[0].slot, refunds[0].bytes), (10, 5 * MIB));
    assert!(refunds[0].reason.contains("another time"), "{}", refunds[0].reason);
    let snapshot = books.snapshot();
    assert!(snapshot.slots.iter().any(|slot| slot.slot == 11 && slot.alive));
    assert!(!snapshot.slots.iter().any(|slot| slot.slot == 10));
    // Refunding again finds nothing: nothing is refunded twice.
    assert!(books.refund_dead().unwrap().is_empty());
    // Slot 11 is ours to clean up: it names this live process, so only a forged copy.
    write_word(&path, format::slot_offset(11, format::SLOT_DEVICE_GRANT), 0);
    write_word(&path, format::slot_offset(11, format::SLOT_STATE), 1 << 8);
    drop(a);
    assert_eq!(books.snapshot().device(GPU).unwrap().granted, 0);
}

#[test]
fn a_pid_reused_within_the_start_times_clock_tick_is_told_apart_by_its_pidfs_inode() {
    // A start time counts clock ticks (10 ms): a pid reused within one tick has the
    // dead owner's start time. (The real-process test of pid reuse met this on a loaded
    // machine: the old slot, naming the newcomer's pid and start time, was taken for alive.)
    let books = NodeBooks::open(fresh_config("sametick").with_refund_interval(Duration::from_secs(3600))).unwrap();
    let path = books.path().to_owned();
    let _cleanup = Cleanup(path.clone());
    books.set_device_limit(GPU, 16 * MIB).unwrap();
    let a = engine(&books, GPU, &["tenant-a"], || system(GPU));
    let me = a.member.slot();
    let inode = read_word(&path, format::slot_offset(me, format::SLOT_PIDFD_INODE));
    if inode == 0 {
        println!("skipped: this kernel has no pidfs (Linux 6.9 on), so slots record no pidfs inode");
        return;
    }
    assert_eq!(read_word(&path, format::slot_offset(me, format::SLOT_PIDFD_GENERATION)), 1, "the claim's generation");
    let pid = u64::from(std::process::id());
    let start = read_word(&path, format::slot_offset(me, format::SLOT_START_TIME));
    // Slot 30: our pid and start time, another process's inode (the dead owner's).
    // Slot 31: our pid, start time and inode: this very process, alive. Slot 32: an
    // inode written for an older claim of the slot (generation 0, not 1): no evidence,
    // judged by the start time (alive).
    for (slot, written, generation) in [(30, inode + 1, 1), (31, inode, 1), (32, inode + 1, 0)] {
        forge_slot(&path, me, slot, pid, start, 2 * MIB, 0);
        write_word(&path, format::slot_offset(slot, format::SLOT_PIDFD_INODE), written);
        write_word(&path, format::slot_offset(slot, format::SLOT_PIDFD_GENERATION), generation);
    }
    let refunds = books.refund_dead().unwrap();
    assert_eq!(refunds.len(), 1, "only the other process's slot is dead: {refunds:?}");
    assert_eq!((refunds[0].slot, refunds[0].bytes), (30, 2 * MIB));
    assert!(refunds[0].reason.contains("another time"), "{}", refunds[0].reason);
    let snapshot = books.snapshot();
    for slot in [me, 31, 32] {
        assert!(snapshot.slots.iter().any(|s| s.slot == slot && s.alive), "slot {slot}: {}", snapshot.to_json());
    }
    // A refunded slot keeps no inode for its next owner.
    assert_eq!(read_word(&path, format::slot_offset(30, format::SLOT_PIDFD_INODE)), 0);
    for slot in [31, 32] {
        write_word(&path, format::slot_offset(slot, format::SLOT_DEVICE_GRANT), 0);
        write_word(&path, format::slot_offset(slot, format::SLOT_STATE), 1 << 8);
    }
    drop(a);
    assert_eq!(books.snapshot().device(GPU).unwrap().granted, 0);
}

#[test]
fn a_process_dead_mid_grant_leaves_snapshots_inconsistent_until_it_is_refunded() {
    // No periodic scan: the member's timer would refund the forged slot on its own
    // (every 50 ms in the tests' config), and on a loaded machine it did so before the
    // first snapshot. Only the refusal below may refund it.
    let config = fresh_config("midgrant").with_refund_interval(Duration::from_secs(3600));
    let books = NodeBooks::open(config).unwrap();
    let path = books.path().to_owned();
    let _cleanup = Cleanup(path.clone());
    books.set_device_limit(GPU, 16 * MIB).unwrap();
    let a = engine(&books, GPU, &["tenant-a"], || system(GPU));
    // A pid that no process has any more: a child we ran and reaped.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = u64::from(child.id());
    child.wait().unwrap();
    forge_slot(&path, a.member.slot(), 20, dead_pid, 12345, 7 * MIB, 1);
    assert!(!books.snapshot().consistent, "a slot mid-grant (odd seq) makes snapshots inconsistent");
    // The node counts the tentative 7 MiB until the refund: a grant that needs it waits
    // for a refund (every refusal looks for dead slots first) and then succeeds.
    let block = allocate(&a.tenants[0], 12 * MIB).expect("the dead slot was refunded on the refusal");
    let snapshot = books.snapshot();
    assert!(snapshot.consistent);
    assert!(!snapshot.slots.iter().any(|slot| slot.slot == 20));
    assert!(a.member.stats().refunds >= 1);
    drop(block);
    drop(a);
}

#[test]
fn leaving_with_charges_keeps_the_slot_and_leaving_empty_frees_it() {
    let books = NodeBooks::open(fresh_config("leave")).unwrap();
    let _cleanup = Cleanup(books.path().to_owned());
    books.set_device_limit(GPU, 16 * MIB).unwrap();
    let a = engine(&books, GPU, &["tenant-a"], || system(GPU));
    let block = allocate(&a.tenants[0], 2 * MIB).unwrap();
    let common::Engine { member, governor, tenants, registry, .. } = a;
    let old = member.slot();
    let report = member.leave();
    assert!(!report.slot_freed);
    assert!(report.still_held >= 2 * MIB, "{report:?}");
    // What stays granted is what the governor holds: the node counts it until this
    // process exits.
    assert_eq!(books.snapshot().device(GPU).unwrap().granted, report.still_held);
    drop(block);
    drop((tenants, registry, governor));
    // The slot is this live process's: no refund takes it, and it keeps its grant.
    assert!(books.refund_dead().unwrap().is_empty(), "a live process's slot was refunded");
    // Joining again is a new slot; the old one stays beside it.
    let governor = memory_governor::Governor::new();
    let again = books.join(&governor).unwrap();
    assert_ne!(again.slot(), old, "joining again took the slot that was left with charges");
    let snapshot = books.snapshot();
    let me = u64::from(std::process::id());
    let slots: Vec<_> = snapshot.slots.iter().map(|slot| (slot.slot, slot.pid, slot.alive)).collect();
    assert_eq!(slots.len(), 2, "{}", snapshot.to_json());
    assert!(slots.contains(&(old, me, true)) && slots.contains(&(again.slot(), me, true)), "{}", snapshot.to_json());
    // Leaving empty frees the new slot; the old one is still there, still granted.
    assert!(again.leave().slot_freed);
    let snapshot = books.snapshot();
    let slots: Vec<_> = snapshot.slots.iter().map(|slot| slot.slot).collect();
    assert_eq!(slots, [old], "{}", snapshot.to_json());
    assert_eq!(snapshot.device(GPU).unwrap().granted, report.still_held, "{}", snapshot.to_json());
}

#[test]
fn set_limits_report_the_old_value_and_names_are_checked() {
    let books = NodeBooks::open(fresh_config("limits")).unwrap();
    let _cleanup = Cleanup(books.path().to_owned());
    assert_eq!(books.set_device_limit(GPU, 4 * MIB).unwrap(), None);
    assert_eq!(books.set_device_limit(GPU, 5 * MIB).unwrap(), Some(4 * MIB));
    assert_eq!(books.device_limit(GPU), Some(5 * MIB));
    assert!(matches!(books.set_tenant_quota(GPU, "", 1), Err(NodeError::TenantName { .. })));
    let long = "x".repeat(49);
    let error = books.set_tenant_quota(GPU, &long, 1).unwrap_err();
    assert!(matches!(error, NodeError::TenantName { .. }), "{error:?}");
    // What was asked, what was found, what to do.
    let message = error.to_string();
    assert!(message.contains("(49 bytes)") && message.contains("give a name of 1 to 48 bytes"), "{message}");
    assert_eq!(books.set_tenant_quota(GPU, "tenant-a", MIB).unwrap(), None);
    assert_eq!(books.tenant_quota(GPU, "tenant-a"), Some(MIB));
    assert_eq!(books.tenant_quota(DeviceKey::host(41), "tenant-a"), None);
}

#[test]
fn a_peer_that_keeps_the_books_lock_delays_no_admission_past_the_pressure_wait() {
    let books = NodeBooks::open(fresh_config("lock")).unwrap();
    let _cleanup = Cleanup(books.path().to_owned());
    books.set_device_limit(GPU, 4 * MIB).unwrap();
    let a = engine(&books, GPU, &["tenant-a"], || system(GPU));
    let block = allocate(&a.tenants[0], 3 * MIB).unwrap();
    // Another open of the file keeps the lock (as a stuck or hostile peer would).
    let file = lock_as_a_peer(&books);
    let started = Instant::now();
    assert!(allocate(&a.tenants[0], 2 * MIB).is_none(), "over the node limit");
    assert!(started.elapsed() < Duration::from_secs(1), "a short admission waited {:?}", started.elapsed());
    // Grants take no lock: what fits is still granted.
    drop(block);
    let _ = a.member.give_back_surplus();
    drop(file);
    drop(a);
}

/// A reclaim holder that, once armed, allocates through `binding` the first time the
/// member's timer thread asks its name: inside the governor snapshot that the timer's
/// give-back reads `used` from, just after `used` was read. That is an admission on
/// another thread landing between the give-back's look and its lowering of the limit.
struct AdmitDuringGiveBack {
    armed: std::sync::atomic::AtomicBool,
    binding: std::sync::Mutex<Option<memory_governor::MemoryBinding>>,
    bytes: u64,
    block: std::sync::Mutex<Option<memory_governor::BoundAllocation>>,
}

impl memory_governor::ReclaimHolder for AdmitDuringGiveBack {
    fn name(&self) -> &str {
        let on_timer = std::thread::current().name().is_some_and(|name| name.starts_with("memory-node-"));
        if on_timer && self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let binding = self.binding.lock().unwrap().take().unwrap();
            // Within the local limit (no shortfall): only the governor's own books move.
            let block = binding.allocate(memory_governor::AllocationRequest::new(self.bytes as usize, 64).unwrap());
            *self.block.lock().unwrap() = Some(block.expect("within the local limit"));
        }
        "admit-during-give-back"
    }

    fn reclaimable(&self, _device: DeviceKey) -> u64 {
        0
    }

    fn reclaim(&self, _request: &memory_governor::ReclaimRequest) -> u64 {
        0
    }
}

#[test]
fn an_admission_racing_a_give_back_stays_covered_by_the_slots_grant() {
    let config = fresh_config("giveback-race")
        .with_grant_chunk(16 * MIB)
        .with_margin(0)
        .with_refund_interval(Duration::from_secs(60));
    let books = NodeBooks::open(config).unwrap();
    let _cleanup = Cleanup(books.path().to_owned());
    books.set_device_limit(GPU, 64 * MIB).unwrap();
    let a = engine(&books, GPU, &["tenant-a"], || system(GPU));
    let hook = Arc::new(AdmitDuringGiveBack {
        armed: std::sync::atomic::AtomicBool::new(true),
        binding: std::sync::Mutex::new(Some(a.registry.bind(GPU).unwrap())),
        bytes: 4 * MIB,
        block: std::sync::Mutex::new(None),
    });
    let holder = a.governor.register_holder(GPU, 100, hook.clone());
    // One MiB draws a 16 MiB grant; the timer then gives the surplus back, and the
    // hook's 4 MiB are admitted while it does.
    let small = allocate(&a.tenants[0], MIB).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while hook.block.lock().unwrap().is_none() || a.member.device_grant(GPU) == Some(16 * MIB) {
        assert!(Instant::now() < deadline, "the timer gave nothing back: {}", books.snapshot().to_json());
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(50));
    let used = a.governor.snapshot().device(GPU).unwrap().used;
    let grant = a.member.device_grant(GPU).unwrap();
    let slot = books.snapshot().slot_of(u64::from(std::process::id())).unwrap().budgets[0].granted;
    assert!(used >= 5 * MIB, "the hook's block is charged: used {used}");
    assert!(
        grant >= used && slot >= used,
        "the governor holds {used} bytes on a grant of {grant} (slot word {slot}): the node books lost track of \
         what it charged while it gave surplus back"
    );
    assert_eq!(a.governor.device_limit(GPU), Some(grant), "the local limit is the grant");
    a.governor.unregister_holder(holder);
    drop(hook.block.lock().unwrap().take());
    drop(small);
    drop(a);
    assert_eq!(books.snapshot().device(GPU).unwrap().granted, 0);
}

#[test]
fn a_shortfall_still_served_when_its_member_leaves_draws_nothing_on_the_freed_slot() {
    let config = fresh_config("leave-race").with_margin(0);
    let books_b = NodeBooks::open(config.clone()).unwrap();
    let _cleanup = Cleanup(books_b.path().to_owned());
    // a's admissions wait up to 3 s for a grant.
    let books_a = NodeBooks::open(config.with_pressure_wait(Duration::from_secs(3))).unwrap();
    books_b.set_device_limit(GPU, 4 * MIB).unwrap();
    let b = engine(&books_b, GPU, &["tenant-b"], || system(GPU));
    let b_block = allocate(&b.tenants[0], 3 * MIB + MIB / 2).unwrap();
    let a = engine(&books_a, GPU, &["tenant-a"], || system(GPU));
    let common::Engine { member, tenants, governor, registry, .. } = a;
    std::thread::scope(|scope| {
        // A thread of a waits inside its node policy for a grant the node cannot give yet.
        let waiting = scope.spawn(|| allocate(&tenants[0], MIB).map(drop).is_some());
        std::thread::sleep(Duration::from_millis(200));
        // a leaves meanwhile, holding nothing: its slot is freed.
        let report = member.leave();
        assert!(report.slot_freed, "{report:?}");
        // Then b's memory comes back to the node.
        drop(b_block);
        let admitted = waiting.join().unwrap();
        assert!(!admitted, "a governor that left the books was granted node memory");
    });
    drop((tenants, registry, governor));
    drop(b);
    let snapshot = books_a.snapshot();
    assert_eq!(
        snapshot.device(GPU).unwrap().granted,
        0,
        "a freed slot holds a grant nobody will give back: {}",
        snapshot.to_json()
    );
}

#[test]
fn an_account_bound_twice_is_refused_and_its_node_quota_counted_once() {
    let books = NodeBooks::open(fresh_config("bind-twice")).unwrap();
    let _cleanup = Cleanup(books.path().to_owned());
    books.set_device_limit(GPU, 16 * MIB).unwrap();
    books.set_tenant_quota(GPU, "tenant-a", 8 * MIB).unwrap();
    let a = engine(&books, GPU, &["tenant-a"], || system(GPU));
    let block = allocate(&a.tenants[0], 2 * MIB).unwrap();
    let before = books.snapshot().tenant(GPU, "tenant-a").unwrap().granted;
    let again = a.member.bind_tenant(a.tenants[0].authority, "tenant-a");
    let error = again.expect_err("a second binding of one account was accepted");
    assert!(error.to_string().contains("already"), "{error}");
    assert_eq!(books.snapshot().tenant(GPU, "tenant-a").unwrap().granted, before, "granted twice");
    drop(block);
    drop(a);
    assert_eq!(books.snapshot().tenant(GPU, "tenant-a").unwrap().granted, 0);
}

#[test]
fn a_thread_waiting_for_the_books_lock_delays_no_other_threads_admission_past_the_pressure_wait() {
    let books = NodeBooks::open(fresh_config("lock-thread")).unwrap();
    let _cleanup = Cleanup(books.path().to_owned());
    books.set_device_limit(GPU, 4 * MIB).unwrap();
    let a = engine(&books, GPU, &["tenant-a"], || system(GPU));
    let block = allocate(&a.tenants[0], 3 * MIB).unwrap();
    // A peer keeps the books' lock for 3 s, and a thread of this process waits for it.
    let file = lock_as_a_peer(&books);
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| books.refund_dead().map(|refunds| refunds.len()));
        scope.spawn(move || {
            std::thread::sleep(Duration::from_secs(3));
            drop(file);
        });
        std::thread::sleep(Duration::from_millis(100));
        let started = Instant::now();
        assert!(allocate(&a.tenants[0], 2 * MIB).is_none(), "over the node limit");
        let waited = started.elapsed();
        assert!(waited < Duration::from_secs(1), "an admission waited {waited:?} behind another thread's lock wait");
        assert_eq!(waiter.join().unwrap().unwrap(), 0);
    });
    drop(block);
    drop(a);
}

/// Another open of the books file holding the books' lock (as a stuck or hostile peer
/// would) until the returned file is dropped.
fn lock_as_a_peer(books: &NodeBooks) -> std::fs::File {
    let file = OpenOptions::new().read(true).write(true).open(books.path()).unwrap();
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive).unwrap();
    file
}

#[test]
fn a_device_governed_and_an_account_bound_from_many_threads_at_once_are_so_once() {
    // The AlreadyGoverned / AlreadyBound checks looked before the grant was recorded,
    // so threads racing past the look each drew an initial grant and each recorded the
    // device (two node policies, two holders) or the account (its charges counted twice
    // against the tenant's node quota).
    use memory_governor::{AccountConfig, Governor, HardLimit};
    const THREADS: usize = 8;
    let books = NodeBooks::open(fresh_config("setup-race")).unwrap();
    let _cleanup = Cleanup(books.path().to_owned());
    books.set_device_limit(GPU, 64 * MIB).unwrap();
    for round in 0..30 {
        let device = DeviceKey::host(41);
        let governor = Governor::new();
        let authority = memory_governor::BindingRegistry::new()
            .register_authority(device, Arc::new(format!("tenant-{round}")))
            .unwrap();
        governor.open_account(AccountConfig::new(device, authority)).unwrap();
        let member = books.join(&governor).unwrap();
        let barrier = std::sync::Barrier::new(THREADS);
        let (governed, bound) = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..THREADS)
                .map(|_| {
                    scope.spawn(|| {
                        barrier.wait();
                        let governed = member.govern_device(device, Arc::new(HardLimit));
                        let bound = member.bind_tenant(authority, "tenant-a");
                        (governed, bound)
                    })
                })
                .collect();
            let results: Vec<_> = threads.into_iter().map(|thread| thread.join().unwrap()).collect();
            let governed: Vec<_> = results.iter().map(|(governed, _)| governed).collect();
            let bound: Vec<_> = results.iter().map(|(_, bound)| bound).collect();
            (
                governed.iter().filter(|result| result.is_ok()).count(),
                bound
                    .iter()
                    .filter(|result| {
                        assert!(
                            matches!(result, Ok(()) | Err(NodeError::AlreadyBound { .. })),
                            "round {round}: {result:?}"
                        );
                        result.is_ok()
                    })
                    .count(),
            )
        });
        assert_eq!((governed, bound), (1, 1), "round {round}: governed {governed} times, bound {bound} times");
        drop(member);
    }
    assert_eq!(books.snapshot().device(DeviceKey::host(41)).map_or(0, |d| d.granted), 0);
}

#[test]
fn durations_too_long_to_add_to_the_clock_mean_never_and_panic_nowhere() {
    // `Duration::MAX` for "never" (the tests use an hour for that): `Instant::now() +
    // pressure_wait` panicked inside the admission that drew a grant, and
    // `refund_bound` panicked with it.
    let forever = Duration::MAX;
    let config = fresh_config("forever");
    assert_eq!(config.clone().with_refund_interval(forever).refund_bound(), forever);
    assert_eq!(config.clone().with_tick(forever).refund_bound(), forever);
    let books_a = NodeBooks::open(config.clone().with_margin(0)).unwrap();
    let _cleanup = Cleanup(books_a.path().to_owned());
    books_a.set_device_limit(GPU, 8 * MIB).unwrap();
    let a = engine(&books_a, GPU, &["tenant-a"], || system(GPU));
    let held = allocate(&a.tenants[0], 6 * MIB).unwrap();
    // b waits for a grant as long as it takes, and its timer never looks for dead slots.
    let books_b = NodeBooks::open(config.with_pressure_wait(forever).with_refund_interval(forever)).unwrap();
    let b = engine(&books_b, GPU, &["tenant-a"], || system(GPU));
    let small = allocate(&b.tenants[0], MIB / 2).expect("b's first grant fits at once");
    // a frees its block a little later: b's admission waits meanwhile, then gets the grant.
    let (done, result) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let block = allocate(&b.tenants[0], 4 * MIB);
        let _ = done.send(block.is_some());
        drop(block);
        drop(small);
        b
    });
    std::thread::sleep(Duration::from_millis(100));
    drop(held);
    let granted = result.recv_timeout(Duration::from_secs(60)).expect("b's admission panicked or never ended");
    assert!(granted, "b's wait ended without the grant a's give-back made room for");
    drop(waiter.join().unwrap());
    drop(a);
    assert_eq!(books_a.snapshot().device(GPU).unwrap().granted, 0);
}

#[test]
fn a_governor_joined_twice_governs_each_device_through_one_member() {
    // Two members of one governor (two libraries of a process, each joining the books
    // with the process's governor) each governed the device: each set the one local
    // limit to its own grant, and each could bind the device's accounts.
    use memory_governor::{AccountConfig, Governor, HardLimit};
    let books = NodeBooks::open(fresh_config("joined-twice")).unwrap();
    let _cleanup = Cleanup(books.path().to_owned());
    books.set_device_limit(GPU, 16 * MIB).unwrap();
    let governor = Governor::new();
    let authority =
        memory_governor::BindingRegistry::new().register_authority(GPU, Arc::new("tenant-a".to_owned())).unwrap();
    governor.open_account(AccountConfig::new(GPU, authority)).unwrap();
    let first = books.join(&governor).unwrap();
    let second = books.join(&governor).unwrap();
    first.govern_device(GPU, Arc::new(HardLimit)).unwrap();
    let error = second.govern_device(GPU, Arc::new(HardLimit)).unwrap_err();
    assert!(matches!(error, NodeError::AlreadyGoverned { device } if device == GPU), "{error:?}");
    assert!(error.to_string().contains("another member of the same governor"), "{error}");
    first.bind_tenant(authority, "tenant-a").unwrap();
    let error = second.bind_tenant(authority, "tenant-a").unwrap_err();
    assert!(matches!(error, NodeError::NotGoverned { .. }), "{error:?}");
    assert_eq!(governor.snapshot().device(GPU).unwrap().policy, "node(hard-limit)");
    // Once the first leaves, the second may govern the device.
    drop(first);
    second.govern_device(GPU, Arc::new(HardLimit)).unwrap();
    drop(second);
    assert_eq!(books.snapshot().device(GPU).unwrap().granted, 0);
}

#[test]
fn a_slot_of_another_pid_namespace_is_refunded_once_its_lease_is_free_and_not_before() {
    // A survivor cannot judge a pid of another pid namespace (containers sharing the
    // books): such slots were never refunded, however dead their processes, unless a
    // peer of that very namespace ran, and a container that crashed and restarted runs
    // in a new one. The lease its owner holds locked tells, from any namespace.
    let config = fresh_config("lease").with_refund_interval(Duration::from_secs(3600));
    let books = NodeBooks::open(config.clone()).unwrap();
    let path = books.path().to_owned();
    let _cleanup = Cleanup(path.clone());
    let inode = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&path).unwrap());
    let lease = |slot: usize| {
        path.with_file_name(format!(".{}.{inode}.slot-{slot}.lease", path.file_name().unwrap().to_str().unwrap()))
    };
    books.set_device_limit(GPU, 16 * MIB).unwrap();
    let a = engine(&books, GPU, &["tenant-a"], || system(GPU));
    let me = a.member.slot();
    // This member holds its lease: locked, recorded for the slot's generation.
    assert_eq!(read_word(&path, format::slot_offset(me, format::SLOT_LEASE_GENERATION)), 1);
    let try_lock = |slot: usize| {
        let file = std::fs::File::open(lease(slot)).unwrap();
        rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok()
    };
    assert!(!try_lock(me), "a live member's lease is locked");
    let pid_ns = read_word(&path, format::slot_offset(me, format::SLOT_PID_NS));
    // Slots of another pid namespace (a pid that means something else there): 50 with a
    // lease nobody holds (its process died), 51 with a lease held (by this test, as its
    // live owner would), 52 with no lease recorded (an older build's slot).
    let held = std::fs::File::create(lease(51)).unwrap();
    rustix::fs::flock(&held, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
    std::fs::File::create(lease(50)).unwrap();
    for (slot, leased) in [(50, 1), (51, 1), (52, 0)] {
        forge_slot(&path, me, slot, 1, 1, 2 * MIB, 0);
        write_word(&path, format::slot_offset(slot, format::SLOT_PID_NS), pid_ns ^ 1);
        write_word(&path, format::slot_offset(slot, format::SLOT_LEASE_GENERATION), leased);
    }
    let refunds = books.refund_dead().unwrap();
    assert_eq!(refunds.iter().map(|r| (r.slot, r.bytes)).collect::<Vec<_>>(), [(50, 2 * MIB)], "{refunds:?}");
    assert!(refunds[0].reason.contains("another pid namespace"), "{}", refunds[0].reason);
    assert!(!lease(50).exists(), "a refunded slot's lease file is removed");
    // Its owner gone, the held lease is free: refunded on the next look.
    drop(held);
    let refunds = books.refund_dead().unwrap();
    assert_eq!(refunds.iter().map(|r| r.slot).collect::<Vec<_>>(), [51], "{refunds:?}");
    // The slot with no lease stays (no evidence): this test cleans it up.
    write_word(&path, format::slot_offset(52, format::SLOT_DEVICE_GRANT), 0);
    write_word(&path, format::slot_offset(52, format::SLOT_STATE), 1 << 8);
    // A lease file of another user (who could have made it, unlocked, to have a live
    // slot taken for dead) is no evidence either.
    if rustix::process::getuid().is_root() {
        std::fs::File::create(lease(53)).unwrap();
        std::os::unix::fs::chown(lease(53), Some(65534), Some(65534)).unwrap();
        forge_slot(&path, me, 53, 1, 1, 2 * MIB, 0);
        write_word(&path, format::slot_offset(53, format::SLOT_PID_NS), pid_ns ^ 1);
        write_word(&path, format::slot_offset(53, format::SLOT_LEASE_GENERATION), 1);
        write_word(&path, format::slot_offset(53, format::SLOT_UID), 1000);
        assert!(books.refund_dead().unwrap().is_empty(), "another user's lease file was taken as evidence");
        write_word(&path, format::slot_offset(53, format::SLOT_DEVICE_GRANT), 0);
        write_word(&path, format::slot_offset(53, format::SLOT_STATE), 1 << 8);
    }
    // Books removed and made anew split the processes: the new books' member has a
    // lease of its own (not the old books' one, which the old member still holds).
    std::fs::remove_file(&path).unwrap();
    let renewed = NodeBooks::open(config).unwrap();
    assert!(renewed.created());
    let b = engine(&renewed, GPU, &["tenant-a"], || system(GPU));
    assert_eq!(b.member.slot(), 0, "the new books' first slot");
    assert_eq!(read_word(&path, format::slot_offset(0, format::SLOT_LEASE_GENERATION)), 1, "b holds a lease");
    drop(b);
    // Leaving frees the slot, unlocks the lease and removes its file.
    drop(a);
    assert!(!lease(me).exists(), "the lease of a freed slot is removed");
    assert_eq!(books.snapshot().device(GPU).unwrap().granted, 0);
}
