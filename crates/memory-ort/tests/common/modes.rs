//! ONNX Runtime's execution configurations, and the one scenario every configuration
//! must pass: outputs equal to a plain session's, a refused run failing with the
//! governor's reason and an overdraft within its limit (then past it, on the sink),
//! books back to the weights after every run and to zero after the drop, and a device
//! loss that fails later runs and holds termination until the session is gone.

use std::sync::Arc;

use memory_governor::{BindingRegistry, Governor, GovernorConfig, MemoryRole, RegistryError};
use memory_ort::workloads::{detect_text, ocr_image};
use memory_ort::{OrtAdapterError, OrtEnvironment};
use ort::session::builder::SessionBuilder;

use super::{Backing, Tenant};

const MIB: u64 = 1 << 20;
/// A page big enough that its first activation is refused under a quota just above the
/// weights.
const PAGE: (usize, usize) = (320, 320);

/// How a session runs its graph.
#[derive(Copy, Clone, Debug)]
pub enum Mode {
    /// The sequential executor, one intra-op thread.
    Sequential,
    /// The sequential executor with `n` intra-op threads.
    Intra(usize),
    /// The parallel executor with `n` inter-op threads (and two intra-op threads).
    Parallel(usize),
    /// Whatever the environment's global thread pool gives (per-session threads off),
    /// with the parallel executor.
    GlobalPool,
}

impl Mode {
    pub fn builder(self, env: &OrtEnvironment) -> SessionBuilder {
        let builder = env.session_builder().unwrap();
        match self {
            Mode::Sequential => builder.with_intra_threads(1).unwrap(),
            Mode::Intra(n) => builder.with_intra_threads(n).unwrap(),
            Mode::Parallel(n) => builder
                .with_parallel_execution(true)
                .unwrap()
                .with_inter_threads(n)
                .unwrap()
                .with_intra_threads(2)
                .unwrap(),
            Mode::GlobalPool => builder.with_parallel_execution(true).unwrap(),
        }
    }
}

/// A tenant on a governor whose devices have `overdraft_limit`.
pub fn tenant(name: &'static str, quota: u64, overdraft_limit: u64) -> Tenant {
    let registry = Arc::new(BindingRegistry::new());
    let governor = Arc::new(Governor::with_config(
        GovernorConfig::default().with_credit_chunk(0).with_overdraft_limit(overdraft_limit),
    ));
    Tenant::on(registry, governor, name, quota, Backing::Pooled)
}

/// The whole scenario for `mode` on PP-OCRv4 detection.
pub fn every_byte_is_governed(env: &OrtEnvironment, model: &std::path::Path, mode: Mode) {
    let plain_map = {
        let mut plain = mode.builder(env).commit_from_file(model).unwrap();
        detect_text(&mut plain, ocr_image(3, PAGE.0, PAGE.1), PAGE.0, PAGE.1).unwrap().1
    };
    let limit = 64 * MIB;
    let tenant = tenant("modes", 512 * MIB, limit);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_file(&allocator, mode.builder(env), model).unwrap();
    let weights = tenant.charged_total();
    // In every mode ONNX Runtime keeps the initializers in buffers of its own (the
    // kernels read them there, prepacked or under the parallel executor): they are
    // measured at commit and booked with the rest of its memory for the session (how
    // much, against what is really held, is checked by `tests/prepacking.rs`, whose
    // tests measure one at a time; here other tests allocate meanwhile).
    let runtime = session.stats().runtime_held;
    assert_eq!(tenant.registry_live().0 as u64 + runtime, weights, "{mode:?}: blocks and onnx runtime's own");

    // Within the quota: the same map as a plain session, every block booked, and the
    // books back to the weights after the run.
    let (_, map) = detect_text(&mut session, ocr_image(3, PAGE.0, PAGE.1), PAGE.0, PAGE.1).unwrap();
    assert_eq!(map, plain_map, "{mode:?}: governed and plain maps differ");
    assert_eq!(tenant.charged_total(), weights, "{mode:?}: run memory refunded");
    assert!(tenant.snapshot().unwrap().role(MemoryRole::Activations).peak > 0, "{mode:?}: activations booked");
    let stats = session.stats();
    assert_eq!((stats.refusals, stats.overdraft_blocks, stats.sink_blocks), (0, 0, 0), "{mode:?}: {stats:?}");
    assert_eq!(stats.allocs, allocator.stats().allocs, "{mode:?}: one session, the same figures");

    // Refused: a quota just above the weights. Every thread of the run is seen as part
    // of it, so the run fails with the governor's reason, three times in a row.
    tenant.governor.set_quota(tenant.authority, weights + 64 * 1024).unwrap();
    for attempt in 0..3 {
        let err = detect_text(&mut session, ocr_image(4, PAGE.0, PAGE.1), PAGE.0, PAGE.1).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, OrtAdapterError::Refused { action: "run", .. }), "{mode:?} #{attempt}: {text}");
        assert!(text.contains("authority quota"), "{mode:?}: {text}");
        assert_eq!(tenant.charged_total(), weights, "{mode:?} #{attempt}: the failed run's memory was refunded");
        assert_eq!(session.stats().overdraft_in_use, 0, "{mode:?}: the overdraft went back with the run");
    }
    let stats = session.stats();
    assert!(stats.overdraft_blocks > 0 && stats.refusals >= 3, "{mode:?}: {stats:?}");
    let device = tenant.governor.snapshot().device(tenant.device).cloned().unwrap();
    assert!(device.overdraft.peak > 0 && device.overdraft.peak <= limit, "{mode:?}: {:?}", device.overdraft);
    assert_eq!(device.overdraft.current, 0, "{mode:?}");
    assert_eq!(tenant.snapshot().unwrap().overdraft.peak, device.overdraft.peak, "{mode:?}: the tenant's figure");

    // A small overdraft limit, then none: the overdraft never passes the limit, the sink
    // serves the rest of the stopped run, and the run still fails cleanly.
    for small in [256 * 1024, 0] {
        tenant.governor.set_overdraft_limit(tenant.device, small);
        let sunk = session.stats().sink_blocks;
        let err = detect_text(&mut session, ocr_image(5, PAGE.0, PAGE.1), PAGE.0, PAGE.1).unwrap_err();
        assert!(matches!(err, OrtAdapterError::Refused { .. }), "{mode:?}: {err}");
        assert!(session.stats().sink_blocks > sunk, "{mode:?}: {:?}", session.stats());
        let device = tenant.governor.snapshot().device(tenant.device).cloned().unwrap();
        assert!(device.overdraft.refused > 0 && device.overdraft.current == 0, "{mode:?}: {:?}", device.overdraft);
        assert_eq!(tenant.charged_total(), weights);
    }
    let peak = tenant.snapshot().unwrap().overdraft.peak;
    assert!(peak <= limit, "{mode:?}: the tenant's overdraft peaked at {peak}, over the limit {limit}");

    // A larger quota: the session runs again, with the same result.
    tenant.governor.set_quota(tenant.authority, 512 * MIB).unwrap();
    let (_, again) = detect_text(&mut session, ocr_image(3, PAGE.0, PAGE.1), PAGE.0, PAGE.1).unwrap();
    assert_eq!(again, plain_map, "{mode:?}: after the refusals");

    // Device loss: later runs fail, nothing is freed, and termination waits until the
    // session (which may still call Free) is gone.
    tenant.registry.invalidate_device(tenant.device, "simulated loss");
    let err = detect_text(&mut session, ocr_image(6, PAGE.0, PAGE.1), PAGE.0, PAGE.1).unwrap_err();
    assert!(matches!(err, OrtAdapterError::Refused { .. }), "{mode:?}: {err}");
    assert!(err.to_string().contains("lost"), "{mode:?}: {err}");
    let not_yet = tenant.registry.confirm_context_terminated(&tenant.context).unwrap_err();
    assert!(
        matches!(not_yet, RegistryError::ContextNotQuiescent { holds: 1, .. }),
        "{mode:?}: the live session holds termination: {not_yet}"
    );
    drop(session);
    let report = tenant.registry.confirm_context_terminated(&tenant.context).unwrap();
    assert!(report.lost_allocations > 0, "{mode:?}: {report:?}");
    assert_eq!(tenant.charged_total(), 0, "{mode:?}: refunded at termination");
}

/// Two sessions of one tenant committed with one allocator, run at once from two
/// threads, `rounds` times each: outputs equal to plain sessions', the books per
/// session add up to the allocator's, and everything is refunded after the drop.
pub fn two_sessions_share_one_allocator(env: &OrtEnvironment, model: &std::path::Path, mode: Mode, rounds: u64) {
    let sizes = [(320, 320), (256, 384)];
    let expected: Vec<Vec<f32>> = sizes
        .iter()
        .enumerate()
        .map(|(index, &(h, w))| {
            let mut plain = mode.builder(env).commit_from_file(model).unwrap();
            detect_text(&mut plain, ocr_image(index as u64, h, w), h, w).unwrap().1
        })
        .collect();
    let tenant = tenant("shared", 512 * MIB, 64 * MIB);
    let allocator = tenant.allocator(env);
    let mut sessions: Vec<_> =
        (0..2).map(|_| env.commit_from_file(&allocator, mode.builder(env), model).unwrap()).collect();
    let weights = tenant.charged_total();
    std::thread::scope(|scope| {
        for (index, session) in sessions.iter_mut().enumerate() {
            let (h, w) = sizes[index];
            let expected = &expected[index];
            scope.spawn(move || {
                for _ in 0..rounds {
                    let (_, map) = detect_text(session, ocr_image(index as u64, h, w), h, w).unwrap();
                    assert_eq!(&map, expected, "{mode:?}: session {index}");
                }
            });
        }
    });
    assert_eq!(tenant.charged_total(), weights, "{mode:?}: both runs refunded");
    let per_session: Vec<_> = sessions.iter().map(|session| session.stats()).collect();
    let all = allocator.stats();
    assert!(per_session.iter().all(|stats| stats.allocs > 0 && stats.reserves > 0), "{per_session:?}");
    assert_eq!(per_session.iter().map(|s| s.allocs).sum::<u64>(), all.allocs, "{mode:?}: {per_session:?} vs {all:?}");
    assert_eq!(per_session.iter().map(|s| s.in_use).sum::<u64>(), all.in_use, "{mode:?}");
    assert_eq!(all.in_use + all.runtime_held, weights, "{mode:?}: what ONNX Runtime holds is what is booked");
    assert_eq!(per_session.iter().map(|s| s.runtime_held).sum::<u64>(), all.runtime_held, "{mode:?}");
    assert_ne!(sessions[0].serial(), sessions[1].serial());

    // A refusal belongs to the run it stopped: the other session's figures and runs are
    // untouched.
    tenant.governor.set_quota(tenant.authority, weights + 64 * 1024).unwrap();
    let (h, w) = sizes[0];
    let err = detect_text(&mut sessions[0], ocr_image(9, h, w), h, w).unwrap_err();
    assert!(matches!(err, OrtAdapterError::Refused { action: "run", .. }), "{mode:?}: {err}");
    assert!(sessions[0].stats().refusals > 0, "{mode:?}");
    assert_eq!(sessions[1].stats().refusals, 0, "{mode:?}: the other session was not refused");
    tenant.governor.set_quota(tenant.authority, 512 * MIB).unwrap();
    let (h, w) = sizes[1];
    assert_eq!(detect_text(&mut sessions[1], ocr_image(1, h, w), h, w).unwrap().1, expected[1], "{mode:?}");
    assert_eq!(tenant.charged_total(), weights, "{mode:?}");
    drop(sessions);
    assert_eq!(tenant.charged_total(), 0, "{mode:?}");
    assert_eq!(tenant.registry_live(), (0, 0), "{mode:?}");
}
