//! Real processes sharing node books: the test binary re-executes itself (its
//! `child_role` test, selected by `MEMORY_NODE_ROLE`) as the engines, while the parent
//! watches the books, kills engines, and checks that the books come back to the truth.
#![cfg(unix)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Cleanup, Engine, MIB, Stalling, allocate, config_from_env, engine, fresh_config, system};
use memory_governor::DeviceKey;
use memory_node::{NodeBooks, NodeConfig, NodeSnapshot};
use rand::Rng;

const ROLE: &str = "MEMORY_NODE_ROLE";
const GPU: DeviceKey = DeviceKey::host(50);
const TENANTS: [&str; 2] = ["tenant-a", "tenant-b"];

fn spawn(config: &NodeConfig, role: &str, millis: u64) -> Child {
    let path = config.path();
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_role", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env("MEMORY_NODE_MILLIS", millis.to_string())
        .env("MEMORY_NODE_BOOKS", path.file_name().unwrap())
        .env("MEMORY_NODE_DIR", path.parent().unwrap())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// What a hammer child reports when it ends.
fn result_of(child: Child) -> serde_json::Value {
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "a child failed: {stdout}");
    let line = stdout
        .lines()
        .find_map(|line| line.split_once("RESULT ").map(|(_, json)| json))
        .unwrap_or_else(|| panic!("{stdout}"));
    serde_json::from_str(line).unwrap()
}

/// Checks a consistent snapshot against the node's limit and quotas.
fn check_bounds(snapshot: &NodeSnapshot, limit: u64, quota: u64) -> Option<u64> {
    if !snapshot.consistent {
        return None;
    }
    let device = snapshot.device(GPU)?;
    assert!(device.granted <= limit, "granted {} over the node limit {limit}: {}", device.granted, snapshot.to_json());
    for tenant in TENANTS {
        if let Some(entry) = snapshot.tenant(GPU, tenant) {
            assert!(
                entry.granted <= quota,
                "{tenant} granted {} over its quota: {}",
                entry.granted,
                snapshot.to_json()
            );
        }
    }
    Some(device.granted)
}

fn setup(tag: &str, limit: u64, quota: u64) -> (NodeBooks, NodeConfig, Cleanup) {
    let config = fresh_config(tag);
    let books = NodeBooks::open(config.clone()).unwrap();
    let cleanup = Cleanup(books.path().to_owned());
    books.set_device_limit(GPU, limit).unwrap();
    for tenant in TENANTS {
        books.set_tenant_quota(GPU, tenant, quota).unwrap();
    }
    (books, config, cleanup)
}

/// The final books after every engine ended (or was refunded): nothing granted.
fn assert_settled(books: &NodeBooks) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let _ = books.refund_dead().unwrap();
        let snapshot = books.snapshot();
        let granted = snapshot.device(GPU).map_or(0, |d| d.granted)
            + TENANTS.iter().map(|t| snapshot.tenant(GPU, t).map_or(0, |e| e.granted)).sum::<u64>();
        if snapshot.consistent && granted == 0 && snapshot.slots.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "the books did not settle: {}", snapshot.to_json());
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn four_processes_of_two_threads_never_pass_the_node_limit_and_end_exact() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let (limit, quota) = (24 * MIB, 14 * MIB);
    let (books, config, _cleanup) = setup("hammer", limit, quota);
    let children: Vec<Child> = (0..4).map(|_| spawn(&config, "hammer", 2000)).collect();
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    // The watcher: sample the books until every child ended.
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (books, done) = (books.clone(), Arc::clone(&done));
        std::thread::spawn(move || {
            let (mut samples, mut consistent, mut highest) = (0u64, 0u64, 0u64);
            while !done.load(Ordering::SeqCst) {
                samples += 1;
                if let Some(granted) = check_bounds(&books.snapshot(), limit, quota) {
                    consistent += 1;
                    highest = highest.max(granted);
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            (samples, consistent, highest)
        })
    };
    let results: Vec<serde_json::Value> = children.into_iter().map(result_of).collect();
    done.store(true, Ordering::SeqCst);
    let (samples, consistent, highest) = watcher.join().unwrap();
    let allocations: u64 = results.iter().map(|r| r["allocations"].as_u64().unwrap()).sum();
    let refusals: u64 = results.iter().map(|r| r["refusals"].as_u64().unwrap()).sum();
    let grants: u64 = results.iter().map(|r| r["grants"].as_u64().unwrap()).sum();
    println!(
        "4 processes x 2 threads, 2 s: {allocations} allocations, {refusals} refusals, {grants} node grants; \
         watcher: {samples} samples ({consistent} consistent), highest granted {highest} of {limit}"
    );
    assert!(consistent > 100, "the watcher saw too few consistent samples: {consistent} of {samples}");
    assert!(refusals > 0, "the run never reached the limits");
    for (pid, result) in pids.iter().zip(&results) {
        assert_eq!(result["pid"].as_u64(), Some(u64::from(*pid)));
        assert_eq!(result["exact"], true, "{result}");
    }
    assert_settled(&books);
}

#[test]
fn a_process_killed_at_a_random_point_is_refunded_within_the_bound() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let (limit, quota) = (24 * MIB, 14 * MIB);
    let (books, config, _cleanup) = setup("kill", limit, quota);
    let mut children: Vec<Child> = (0..3).map(|_| spawn(&config, "hammer", 2500)).collect();
    let at = rand::rng().random_range(300..1500);
    std::thread::sleep(Duration::from_millis(at));
    let mut victim = children.remove(0);
    let pid = u64::from(victim.id());
    let held = books.snapshot().slot_of(pid).map(|slot| slot.budgets.iter().map(|b| b.granted).sum::<u64>());
    victim.kill().unwrap();
    let killed = Instant::now();
    // Not reaped yet: survivors see a zombie, which holds nothing any more.
    let bound = config.refund_bound();
    let refunded = loop {
        let snapshot = books.snapshot();
        check_bounds(&snapshot, limit, quota);
        if snapshot.slot_of(pid).is_none() {
            break killed.elapsed();
        }
        assert!(killed.elapsed() < bound + Duration::from_secs(2), "not refunded: {}", snapshot.to_json());
        std::thread::sleep(Duration::from_millis(1));
    };
    let _ = victim.wait();
    println!(
        "killed pid {pid} {at} ms in, holding {held:?} bytes of grants; refunded after {refunded:?} (bound {bound:?})"
    );
    assert!(refunded <= bound + Duration::from_millis(500), "refunded after {refunded:?}, past the bound {bound:?}");
    for child in children {
        let result = result_of(child);
        assert_eq!(result["exact"], true, "{result}");
    }
    assert_settled(&books);
}

#[test]
fn a_process_killed_inside_a_charge_gives_its_grant_back_to_a_survivor() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let (limit, quota) = (16 * MIB, 16 * MIB);
    let (books, config, _cleanup) = setup("stall", limit, quota);
    let mut victim = spawn(&config, "stall", 0);
    let mut lines = BufReader::new(victim.stdout.take().unwrap()).lines();
    assert!(lines.any(|line| line.unwrap().contains("STALLED")), "the victim did not stall");
    let pid = u64::from(victim.id());
    let held = books.snapshot().slot_of(pid).unwrap().budgets[0].granted;
    assert!(held >= 12 * MIB, "the victim holds {held} granted");
    // This process is a survivor: 8 MiB do not fit while the victim holds its grant.
    let survivor: Engine = engine(&books, GPU, &TENANTS, || system(GPU));
    assert!(allocate(&survivor.tenants[0], 8 * MIB).is_none());
    victim.kill().unwrap();
    let killed = Instant::now();
    let block = loop {
        if let Some(block) = allocate(&survivor.tenants[0], 8 * MIB) {
            break block;
        }
        assert!(killed.elapsed() < Duration::from_secs(3), "not refunded: {}", books.snapshot().to_json());
        std::thread::sleep(Duration::from_millis(2));
    };
    println!("killed inside a charge holding {held} granted; a survivor had 8 MiB after {:?}", killed.elapsed());
    assert!(killed.elapsed() <= config.refund_bound() + Duration::from_millis(500));
    let _ = victim.wait();
    drop(block);
    let report = survivor.member.leave();
    assert!(report.slot_freed);
    drop(survivor.tenants);
    assert_settled(&books);
}

const NS_LAST_PID: &str = "/proc/sys/kernel/ns_last_pid";

#[test]
fn a_pid_reused_by_a_new_process_never_inherits_the_dead_ones_slot() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    // A new process gets a chosen pid when the pid before it is written to
    // ns_last_pid (root, in this pid namespace).
    if !rustix::process::getuid().is_root() || std::fs::write(NS_LAST_PID, b"1").is_err() {
        println!("skipped a_pid_reused_by_a_new_process_never_inherits_the_dead_ones_slot: {NS_LAST_PID} not writable");
        return;
    }
    let (books, config, _cleanup) = setup("pidreuse", 16 * MIB, 16 * MIB);
    // The first owner joins, allocates and is killed; no member runs, so its slot stays.
    let mut first = spawn(&config, "stall", 0);
    let mut lines = BufReader::new(first.stdout.take().unwrap()).lines();
    assert!(lines.any(|line| line.unwrap().contains("STALLED")), "the first owner did not stall");
    let pid = first.id();
    let old = books.snapshot().slot_of(u64::from(pid)).unwrap().clone();
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(books.snapshot().slot_of(u64::from(pid)).is_some(), "nobody refunded the slot yet");
    // A new process with that very pid (other processes of the machine may take it first: retry).
    let mut newcomer = None;
    for _ in 0..200 {
        std::fs::write(NS_LAST_PID, (pid - 1).to_string()).unwrap();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_role", "--nocapture", "--test-threads=1"])
            .env(ROLE, "newcomer")
            .env("MEMORY_NODE_BOOKS", config.path().file_name().unwrap())
            .env("MEMORY_NODE_DIR", config.path().parent().unwrap())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        if child.id() == pid {
            newcomer = Some(child);
            break;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    let Some(mut newcomer) = newcomer else {
        println!("skipped a_pid_reused_by_a_new_process_never_inherits_the_dead_ones_slot: pid {pid} was never reused");
        return;
    };
    // The slot names a live pid, of a process that started at another time: dead.
    let refunds = books.refund_dead().unwrap();
    assert_eq!(refunds.len(), 1, "{refunds:?}");
    assert_eq!((refunds[0].slot, refunds[0].pid), (old.slot, u64::from(pid)));
    assert!(refunds[0].reason.contains("another time"), "{}", refunds[0].reason);
    assert_eq!(refunds[0].bytes, old.budgets.iter().map(|b| b.granted).sum::<u64>());
    // The newcomer joins with the same pid: a slot of its own, which no survivor takes.
    {
        use std::io::Write;
        writeln!(newcomer.stdin.as_mut().unwrap(), "join").unwrap();
    }
    let mut lines = BufReader::new(newcomer.stdout.take().unwrap()).lines();
    assert!(lines.any(|line| line.unwrap().contains("JOINED")), "the newcomer did not join");
    assert!(books.refund_dead().unwrap().is_empty(), "the newcomer's slot was taken for dead");
    let snapshot = books.snapshot();
    let slot = snapshot.slot_of(u64::from(pid)).unwrap();
    assert!(slot.alive && slot.start_time != old.start_time, "{}", snapshot.to_json());
    assert_eq!(snapshot.slots.len(), 1, "{}", snapshot.to_json());
    let device = snapshot.device(GPU).unwrap();
    let own = slot.budgets.iter().find(|b| b.tenant.is_none()).map_or(0, |b| b.granted);
    assert!(own >= 2 * MIB && device.granted == own, "the old owner's grants are gone: {}", snapshot.to_json());
    println!(
        "pid {pid} reused by a new process: the old slot {} ({} bytes) refunded as \"{}\", the newcomer holds slot {} \
         with {own} bytes",
        old.slot, refunds[0].bytes, refunds[0].reason, slot.slot
    );
    newcomer.kill().unwrap();
    newcomer.wait().unwrap();
    assert_settled(&books);
}

/// The engines' side (runs only as a child).
#[test]
fn child_role() {
    match std::env::var(ROLE).as_deref() {
        Ok("hammer") => hammer(),
        Ok("stall") => stall(),
        Ok("newcomer") => newcomer(),
        _ => {}
    }
}

/// Waits for a line on stdin, joins, allocates 2 MiB, says so and waits to be killed.
fn newcomer() {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let books = NodeBooks::open_existing(config_from_env()).unwrap();
    let engine = engine(&books, GPU, &TENANTS, || system(GPU));
    let _held = allocate(&engine.tenants[0], 2 * MIB).unwrap();
    println!("JOINED");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn hammer() {
    let millis: u64 = std::env::var("MEMORY_NODE_MILLIS").unwrap().parse().unwrap();
    let books = NodeBooks::open_existing(config_from_env()).unwrap();
    let engine = engine(&books, GPU, &TENANTS, || system(GPU));
    let deadline = Instant::now() + Duration::from_millis(millis);
    let counts: Vec<(u64, u64)> = std::thread::scope(|scope| {
        let workers: Vec<_> = engine
            .tenants
            .iter()
            .map(|tenant| {
                scope.spawn(move || {
                    let mut rng = rand::rng();
                    let (mut allocations, mut refusals) = (0u64, 0u64);
                    let mut blocks = Vec::new();
                    while Instant::now() < deadline {
                        if blocks.len() < 12 && rng.random_bool(0.55) {
                            match allocate(tenant, rng.random_range(16 << 10..=MIB / 2)) {
                                Some(block) => {
                                    allocations += 1;
                                    blocks.push(block);
                                }
                                None => refusals += 1,
                            }
                        } else if !blocks.is_empty() {
                            let block = blocks.swap_remove(rng.random_range(0..blocks.len()));
                            tenant.binding.release(block).unwrap();
                        }
                    }
                    for block in blocks {
                        tenant.binding.release(block).unwrap();
                    }
                    (allocations, refusals)
                })
            })
            .collect();
        workers.into_iter().map(|worker| worker.join().unwrap()).collect()
    });
    // The final books, exact: nothing charged, the local limits are the slot's grants.
    // (The member's timer may be giving surplus back while we look: look until one
    // look sees the slot and the governor between two of its changes.)
    let figures = || {
        let snapshot = engine.governor.snapshot();
        let device = snapshot.device(GPU).unwrap().clone();
        let node = books.snapshot();
        let slot = node.slot_of(u64::from(std::process::id())).unwrap().clone();
        (device, slot)
    };
    let mut tries = 0;
    let (device, slot, exact) = loop {
        let (device, slot) = figures();
        let slot_device = slot.budgets.iter().find(|b| b.tenant.is_none()).map_or(0, |b| b.granted);
        let exact = device.current == 0
            && device.authorities.iter().all(|account| account.current == 0)
            && engine.governor.device_limit(GPU) == engine.member.device_grant(GPU)
            && engine.member.device_grant(GPU) == Some(slot_device)
            && engine.tenants.iter().all(|tenant| {
                let slot_tenant =
                    slot.budgets.iter().find(|b| b.tenant.as_deref() == Some(&tenant.name)).map_or(0, |b| b.granted);
                engine.member.tenant_grant(tenant.authority) == Some(slot_tenant)
                    && engine.governor.account(tenant.authority).unwrap().quota() == Some(slot_tenant)
            });
        tries += 1;
        if exact || tries == 200 {
            break (device, slot, exact);
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let slot_device = slot.budgets.iter().find(|b| b.tenant.is_none()).map_or(0, |b| b.granted);
    let stats = engine.member.stats();
    let engine_limit = engine.governor.device_limit(GPU);
    let member_grant = engine.member.device_grant(GPU);
    let tenant_figures: Vec<_> = engine
        .tenants
        .iter()
        .map(|tenant| {
            (
                engine.member.tenant_grant(tenant.authority),
                engine.governor.account(tenant.authority).unwrap().quota(),
                slot.budgets.iter().find(|b| b.tenant.as_deref() == Some(&tenant.name)).map(|b| b.granted),
            )
        })
        .collect();
    let Engine { member, tenants, .. } = engine;
    drop(tenants);
    let report = member.leave();
    let result = serde_json::json!({
        "pid": std::process::id(),
        "allocations": counts.iter().map(|c| c.0).sum::<u64>(),
        "refusals": counts.iter().map(|c| c.1).sum::<u64>(),
        "grants": stats.grants,
        "exact": exact && report.slot_freed,
        "current": device.current,
        "local_limit": engine_limit,
        "member_grant": member_grant,
        "slot_grant": slot_device,
        "tenants": tenant_figures,
        "slot_freed": report.slot_freed,
    });
    println!("RESULT {result}");
}

fn stall() {
    let books = NodeBooks::open_existing(config_from_env()).unwrap();
    let (stall, stalled) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let engine = engine(&books, GPU, &TENANTS, || {
        Arc::new(Stalling { inner: system(GPU), stall: Arc::clone(&stall), stalled: Arc::clone(&stalled) })
    });
    let _held = allocate(&engine.tenants[0], 10 * MIB).unwrap();
    stall.store(true, Ordering::SeqCst);
    let tenant = &engine.tenants[1];
    std::thread::scope(|scope| {
        // Charged, then stuck inside the allocator.
        scope.spawn(|| allocate(tenant, 2 * MIB));
        while !stalled.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        println!("STALLED");
        loop {
            std::thread::sleep(Duration::from_secs(1));
        }
    });
}
