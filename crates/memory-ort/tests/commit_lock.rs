//! The commit lock and the application's own locks: a session dropped under a lock that
//! a reclaim holder takes, while a commit on another thread waits in that holder. (A
//! test binary of its own, whose tests take turns: while a commit is stalled, releases
//! on other threads are deferred until it is done, which other tests' books would see.)

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use common::{Backing, Tenant, tiny_model};
use memory_governor::{DeviceKey, ReclaimHolder, ReclaimRequest, ReclaimThenFail};
use memory_ort::{GovernedOrtAllocator, GovernedSession, OrtAllocatorConfig};

fn allocator_with(
    env: &memory_ort::OrtEnvironment,
    tenant: &Tenant,
    config: OrtAllocatorConfig,
) -> GovernedOrtAllocator {
    let binding = tenant.registry.bind_registered(&tenant.mechanism).unwrap();
    GovernedOrtAllocator::cpu(env, binding, Some(tenant.account.clone()), config).unwrap()
}

/// A cache of idle sessions that evicts under its own lock, as a server's model cache
/// does (`cache.lock().clear()` drops the sessions while the guard is held).
struct EvictUnderLock {
    idle: Mutex<Vec<GovernedSession>>,
    asked: AtomicBool,
}

impl ReclaimHolder for EvictUnderLock {
    fn name(&self) -> &str {
        "cached sessions"
    }

    fn reclaimable(&self, _device: DeviceKey) -> u64 {
        1 << 20
    }

    fn reclaim(&self, _request: &ReclaimRequest) -> u64 {
        self.asked.store(true, Ordering::SeqCst);
        let mut idle = self.idle.lock().unwrap();
        let count = idle.len() as u64;
        idle.clear();
        count * 1024
    }
}

/// The application drops a session while it holds its cache's lock, at the moment a
/// commit on another thread asks the cache (a reclaim holder) for room. The drop used to
/// wait for the commit lock, held by the commit, which waited for the cache's lock: both
/// threads stopped for good. The drop is now released once the commit is done; the
/// commit gets its room from the cache.
#[test]
fn a_session_dropped_under_a_lock_a_reclaim_holder_takes_does_not_deadlock_a_commit() {
    // While a commit is stalled, releases on other threads are deferred, which the
    // other test's books would see.
    let _one = common::one_at_a_time();
    let Some((env, _)) = common::ort("a_session_dropped_under_a_lock_a_reclaim_holder_takes") else { return };
    let tenant = Arc::new(Tenant::new("cached", 1 << 30, Backing::Pooled));
    let allocator = allocator_with(env, &tenant, OrtAllocatorConfig::default().charge_runtime_memory(false));
    let model = tiny_model::bytes();
    let cached = env.commit_from_memory(&allocator, env.session_builder().unwrap(), &model).unwrap();
    let spare = env.commit_from_memory(&allocator, env.session_builder().unwrap(), &model).unwrap();
    let held = tenant.charged_total();
    tenant.governor.set_device_limit(tenant.device, held + 8192).unwrap();
    tenant.governor.set_policy(tenant.device, Arc::new(ReclaimThenFail)).unwrap();
    let cache = Arc::new(EvictUnderLock { idle: Mutex::new(vec![cached]), asked: AtomicBool::new(false) });
    tenant.governor.register_holder(tenant.device, 0, cache.clone());

    // The application's thread: takes the cache's lock, and once the commit is asking
    // the cache, drops a session of its own under it.
    let (locked, wait_locked) = mpsc::channel();
    let (dropped, wait_dropped) = mpsc::channel();
    let application = {
        let cache = Arc::clone(&cache);
        std::thread::spawn(move || {
            let guard = cache.idle.lock().unwrap();
            let _ = locked.send(());
            let start = std::time::Instant::now();
            while !cache.asked.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(1));
            }
            drop(spare);
            drop(guard);
            let _ = dropped.send(());
        })
    };
    wait_locked.recv_timeout(Duration::from_secs(30)).unwrap();
    let (done, wait) = mpsc::channel();
    let (env2, allocator2) = (env.clone(), allocator.clone());
    std::thread::spawn(move || {
        let second = env2.commit_from_memory(&allocator2, env2.session_builder().unwrap(), &model);
        let _ = done.send(second.map_err(|err| err.to_string()));
    });
    wait_dropped
        .recv_timeout(Duration::from_secs(60))
        .expect("the session dropped under the cache's lock: no deadlock");
    let second = wait.recv_timeout(Duration::from_secs(60)).expect("the commit returned: no deadlock");
    application.join().unwrap();
    let second = second.expect("the cache's eviction made room for the commit");
    assert!(cache.idle.lock().unwrap().is_empty(), "the cached session was evicted");
    // The spare session was released once the commit was done: only the new one is booked.
    assert_eq!(tenant.charged_total(), second.stats().in_use, "{:?}", allocator.stats());
    drop(second);
    drop(allocator);
    assert_eq!(tenant.charged_total(), 0);
    assert_eq!(tenant.registry_live(), (0, 0));
}

/// A cache of idle sessions that evicts under its own lock, asked for room by a run on
/// one thread and by a commit on another: the run's call holds the cache's lock while
/// the commit's waits for it.
struct SharedCache {
    idle: Mutex<Vec<GovernedSession>>,
    run_inside: AtomicBool,
    commit_asked: AtomicBool,
}

impl ReclaimHolder for SharedCache {
    fn name(&self) -> &str {
        "cached sessions"
    }

    fn reclaimable(&self, _device: DeviceKey) -> u64 {
        1 << 20
    }

    fn reclaim(&self, _request: &ReclaimRequest) -> u64 {
        let from_run = std::thread::current().name() == Some("run");
        if !from_run {
            self.commit_asked.store(true, Ordering::SeqCst);
        }
        let mut idle = self.idle.lock().unwrap();
        if from_run && !self.run_inside.swap(true, Ordering::SeqCst) {
            // The first call of the run: wait (holding the lock) until the commit asks too.
            let start = std::time::Instant::now();
            while !self.commit_asked.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let count = idle.len() as u64;
        idle.clear();
        count * 1024
    }
}

/// No application lock at all: a run and a commit, both short of room on one device,
/// ask the same cache-like holder. The run's call evicts a session under the holder's
/// lock while the commit (holding the commit lock) waits for that lock: the eviction's
/// release used to wait for the commit lock for good. Both now return (refused: the
/// eviction is released once the commit is done), and nothing stays booked.
#[test]
fn a_run_and_a_commit_asking_one_cache_for_room_at_once_do_not_deadlock() {
    // While a commit is stalled, releases on other threads are deferred, which the
    // other test's books would see.
    let _one = common::one_at_a_time();
    let Some((env, _)) = common::ort("a_run_and_a_commit_asking_one_cache_for_room_at_once") else { return };
    let tenant = Arc::new(Tenant::new("contended", 1 << 30, Backing::Pooled));
    let allocator = allocator_with(env, &tenant, OrtAllocatorConfig::default().charge_runtime_memory(false));
    let model = tiny_model::bytes();
    let builder = || env.session_builder().unwrap().with_intra_threads(1).unwrap();
    let mut running = env.commit_from_memory(&allocator, builder(), &model).unwrap();
    let cached = env.commit_from_memory(&allocator, builder(), &model).unwrap();
    let held = tenant.charged_total();
    tenant.governor.set_device_limit(tenant.device, held + 8192).unwrap();
    tenant.governor.set_policy(tenant.device, Arc::new(ReclaimThenFail)).unwrap();
    let cache = Arc::new(SharedCache {
        idle: Mutex::new(vec![cached]),
        run_inside: AtomicBool::new(false),
        commit_asked: AtomicBool::new(false),
    });
    tenant.governor.register_holder(tenant.device, 0, cache.clone());

    let (ran, wait_ran) = mpsc::channel();
    let run = std::thread::Builder::new()
        .name("run".to_owned())
        .spawn(move || {
            let batch = 4096;
            let input = ort::value::Tensor::from_array(([batch, tiny_model::FEATURES], vec![0.5f32; batch * 64]));
            let result = running.run(ort::inputs![input.unwrap()]).map(drop).map_err(|err| err.to_string());
            let _ = ran.send(result);
            running
        })
        .unwrap();
    let start = std::time::Instant::now();
    while !cache.run_inside.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(cache.run_inside.load(Ordering::SeqCst), "the run asked the cache for room");
    let (committed, wait_committed) = mpsc::channel();
    let (env2, allocator2) = (env.clone(), allocator.clone());
    std::thread::Builder::new()
        .name("commit".to_owned())
        .spawn(move || {
            let second = env2.commit_from_memory(&allocator2, env2.session_builder().unwrap(), &model);
            let _ = committed.send(second);
        })
        .unwrap();
    let ran = wait_ran.recv_timeout(Duration::from_secs(60)).expect("the run returned: no deadlock");
    let second = wait_committed.recv_timeout(Duration::from_secs(60)).expect("the commit returned: no deadlock");
    let running = run.join().unwrap();
    assert!(ran.as_ref().is_err_and(|err| err.contains("refused")), "the run was short of room: {ran:?}");
    assert!(cache.idle.lock().unwrap().is_empty(), "the cached session was evicted");
    drop(second);
    drop(running);
    drop(allocator);
    assert_eq!(tenant.charged_total(), 0, "the evicted session was released after the commit");
    assert_eq!(tenant.registry_live(), (0, 0));
}
