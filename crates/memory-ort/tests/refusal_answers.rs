//! How a refusal is answered where ONNX Runtime does not check the pointer, and the
//! commit lock around what can re-enter it: a commit refused at any quota fails cleanly
//! (prepacked weights are written as soon as they are allocated), a tensor made through
//! a session's table outside a run is served from the overdraft, a reclaim holder may
//! drop an idle session inside another session's commit, and a refused commit releases
//! its session under the commit lock.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use common::{Backing, Tenant, tiny_model};
use memory_governor::{DeviceKey, MemoryRole, ReclaimHolder, ReclaimRequest, ReclaimThenFail};
use memory_ort::{GovernedOrtAllocator, GovernedSession, OrtAdapterError, OrtAllocatorConfig};

fn allocator_with(
    env: &memory_ort::OrtEnvironment,
    tenant: &Tenant,
    config: OrtAllocatorConfig,
) -> GovernedOrtAllocator {
    let binding = tenant.registry.bind_registered(&tenant.mechanism).unwrap();
    GovernedOrtAllocator::cpu(env, binding, Some(tenant.account.clone()), config).unwrap()
}

/// PP-OCRv4 detection with prepacking on (the default) allocates prepacked weights
/// with `Alloc` while it commits and writes them at once: a null there crashed the
/// process for every quota between about 1.6 and 11 KiB. Every quota from 0 to what the
/// commit needs must now fail with the governor's reason (or succeed), and leave the
/// books at zero.
#[test]
fn a_commit_refused_at_any_quota_fails_with_the_reason_and_leaves_nothing_charged() {
    let Some((env, assets)) = common::ort("a_commit_refused_at_any_quota") else { return };
    for prepacking in [true, false] {
        let config = OrtAllocatorConfig::default().prepacking(prepacking);
        let probe = Tenant::new("probe", 1 << 30, Backing::Pooled);
        let session =
            env.commit_from_file(&allocator_with(env, &probe, config), env.session_builder().unwrap(), &assets.ocr_det);
        let needed = session.unwrap().stats().peak_in_use;
        let mut quotas: Vec<u64> = (0..=10).map(|step| needed * step / 10).collect();
        // Inside the window that crashed (prepacking's first buffers).
        quotas.extend([1700, 4096, 6144, 9000, 10_240]);
        let mut refused = 0;
        for quota in quotas {
            let tenant = Tenant::new("tight", quota, Backing::Pooled);
            let allocator = allocator_with(env, &tenant, config);
            match env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.ocr_det) {
                Ok(_) => assert!(quota >= needed, "quota {quota} of the {needed} bytes it needs: committed"),
                Err(OrtAdapterError::Refused { reason, .. }) => {
                    refused += 1;
                    assert!(reason.contains("refused"), "quota {quota}: the governor's reason, got {reason}");
                }
                Err(other) => panic!("quota {quota} (prepacking {prepacking}): not a refusal: {other}"),
            }
            drop(allocator);
            assert_eq!(tenant.charged_total(), 0, "quota {quota} (prepacking {prepacking}): books back to zero");
            let device = tenant.governor.snapshot().device(tenant.device).cloned().unwrap();
            assert_eq!(device.overdraft.current, 0, "quota {quota}: the overdraft given back");
        }
        assert!(refused >= 10, "prepacking {prepacking}: {refused} refused");
    }
}

/// `ort::memory::Allocator::new(session, ..)` hands safe code the session's own table;
/// `Tensor::new` through it does not check the pointer. A refusal outside a run is
/// served from the overdraft (booked as such, given back when the tensor drops).
#[test]
fn a_tensor_made_through_a_sessions_table_outside_a_run_is_served_from_the_overdraft() {
    let Some((env, _)) = common::ort("a_tensor_made_through_a_sessions_table") else { return };
    let tenant = Tenant::new("idle", 64 << 20, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let session = env.commit_from_memory(&allocator, env.session_builder().unwrap(), &tiny_model::bytes()).unwrap();
    let weights = tenant.charged_total();
    let info = ort::memory::MemoryInfo::new(
        ort::memory::AllocationDevice::CPU,
        0,
        ort::memory::AllocatorType::Device,
        ort::memory::MemoryType::Default,
    )
    .unwrap();
    let table = ort::memory::Allocator::new(session.session(), info).unwrap();
    tenant.governor.set_quota(tenant.authority, weights + 4096).unwrap();
    let mut tensor = ort::value::Tensor::<f32>::new(&table, [1024usize, 1024]).unwrap();
    let (_, data) = tensor.try_extract_tensor_mut::<f32>().unwrap();
    assert_eq!(data.len(), 1 << 20);
    data[0] = 1.0;
    data[(1 << 20) - 1] = 2.0;
    assert_eq!((data[0], data[(1 << 20) - 1]), (1.0, 2.0));
    let device = tenant.governor.snapshot().device(tenant.device).cloned().unwrap();
    assert!(device.overdraft.current >= 4 << 20, "booked as overdraft: {:?}", device.overdraft);
    assert_eq!(tenant.charged_total(), weights, "nothing charged past the quota");
    assert!(session.stats().overdraft_blocks >= 1, "{:?}", session.stats());
    drop(tensor);
    let device = tenant.governor.snapshot().device(tenant.device).cloned().unwrap();
    assert_eq!(device.overdraft.current, 0);
    drop(table);
    drop(session);
    drop(allocator);
    assert_eq!(tenant.charged_total(), 0);
}

/// Evicts the idle sessions it holds when asked (a server unloading idle models).
struct EvictIdle {
    idle: Mutex<Vec<GovernedSession>>,
}

impl ReclaimHolder for EvictIdle {
    fn name(&self) -> &str {
        "idle sessions"
    }

    fn reclaimable(&self, _device: DeviceKey) -> u64 {
        1 << 20
    }

    fn reclaim(&self, _request: &ReclaimRequest) -> u64 {
        let evicted = std::mem::take(&mut *self.idle.lock().unwrap());
        let count = evicted.len() as u64;
        drop(evicted);
        count * 1024
    }
}

/// A commit whose allocation does not fit calls the reclaim holders on the committing
/// thread; one that drops an idle session there takes the commit lock again (it used to
/// wait for itself for good). The eviction makes room, so the commit succeeds.
#[test]
fn a_reclaim_holder_may_drop_an_idle_session_inside_another_sessions_commit() {
    let Some((env, _)) = common::ort("a_reclaim_holder_may_drop_an_idle_session") else { return };
    let tenant = Arc::new(Tenant::new("evicting", 1 << 30, Backing::Pooled));
    // Only the blocks are booked: ONNX Runtime's own memory for a session, measured at
    // commit, varies by some KiB between commits (what it set up once per process, the
    // C library's caches), which would decide whether the second fits, not the eviction.
    let allocator = allocator_with(env, &tenant, OrtAllocatorConfig::default().charge_runtime_memory(false));
    let model = tiny_model::bytes();
    let first = env.commit_from_memory(&allocator, env.session_builder().unwrap(), &model).unwrap();
    let held = tenant.charged_total();
    assert!(held > 0 && tenant.charged(MemoryRole::Weights) > 0);
    // The device holds the first session and 8 KiB more: the second's weights fit only
    // once the first is gone.
    tenant.governor.set_device_limit(tenant.device, held + 8192).unwrap();
    tenant.governor.set_policy(tenant.device, Arc::new(ReclaimThenFail)).unwrap();
    let holder = Arc::new(EvictIdle { idle: Mutex::new(vec![first]) });
    tenant.governor.register_holder(tenant.device, 0, holder.clone());
    let (done, wait) = mpsc::channel();
    let (env2, allocator2) = (env.clone(), allocator.clone());
    std::thread::spawn(move || {
        let second = env2.commit_from_memory(&allocator2, env2.session_builder().unwrap(), &model);
        let _ = done.send(second.map(|session| session.stats().in_use).map_err(|err| err.to_string()));
    });
    let second = wait.recv_timeout(Duration::from_secs(60)).expect("the commit returned: no deadlock");
    let in_use = second.expect("the eviction made room for the second session");
    assert!(holder.idle.lock().unwrap().is_empty(), "the idle session was evicted");
    assert!(in_use > 0);
    drop(allocator);
    assert_eq!(tenant.charged_total(), 0);
}

/// A commit refused after ONNX Runtime created the session (its own memory does not fit
/// the quota) releases the session under the commit lock: ONNX Runtime's frees must not
/// show in another tenant's commit measure (they made it book next to nothing).
#[test]
fn a_refused_commit_releases_its_session_under_the_commit_lock() {
    let Some((env, assets)) = common::ort("a_refused_commit_releases_its_session") else { return };
    let model = assets.ocr_det.clone();
    let probe = Tenant::new("probe", 1 << 30, Backing::Pooled);
    let probe_allocator = probe.allocator(env);
    let mut alone = Vec::new();
    let mut blocks = 0;
    for _ in 0..3 {
        let session = env.commit_from_file(&probe_allocator, env.session_builder().unwrap(), &model).unwrap();
        alone.push(session.stats().runtime_held);
        blocks = session.stats().in_use;
    }
    let alone = *alone[1..].iter().min().unwrap();
    assert!(alone > 1 << 20, "ONNX Runtime keeps megabytes of its own for this model: {alone}");
    let stop = Arc::new(AtomicBool::new(false));
    let refusing = {
        let (stop, env, model) = (Arc::clone(&stop), env.clone(), model.clone());
        std::thread::spawn(move || {
            let tight = Tenant::new("tight", blocks + (256 << 10), Backing::Pooled);
            let allocator = tight.allocator(&env);
            let mut refused = 0;
            while !stop.load(Ordering::Relaxed) {
                let commit = env.commit_from_file(&allocator, env.session_builder().unwrap(), &model);
                assert!(matches!(commit, Err(OrtAdapterError::Refused { .. })), "the tight commit is refused");
                refused += 1;
            }
            drop(allocator);
            assert_eq!(tight.charged_total(), 0);
            refused
        })
    };
    let tenant = Tenant::new("measured", 1 << 30, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut raced = Vec::new();
    for _ in 0..8 {
        let session = env.commit_from_file(&allocator, env.session_builder().unwrap(), &model).unwrap();
        raced.push(session.stats().runtime_held);
    }
    stop.store(true, Ordering::Relaxed);
    let refused = refusing.join().unwrap();
    assert!(refused > 0);
    let least = *raced.iter().min().unwrap();
    assert!(least * 2 > alone, "racing {refused} refused commits, one booked {least} of about {alone}: {raced:?}");
}
