//! ONNX Runtime on real models (Silero VAD 6.2.3, PP-OCRv4 detection from RapidOCR
//! 1.4.4) with every CPU byte coming from a governed binding. The books are read from
//! the registry's and the governor's snapshots, never from counters of the test's own.

mod common;

use std::sync::Arc;

use allocator_cpu::{PooledAllocator, SystemAllocator};
use common::{Backing, Tenant};
use memory_governor::{BindingRegistry, DeviceAllocator, Governor, GovernorConfig, MemoryRole};
use memory_ort::OrtAdapterError;
use memory_ort::workloads::{Infer, VadStream, detect_text, ocr_image};
use memory_testkit::{Callback, RecordingAllocator};

const MIB: u64 = 1 << 20;

/// A session without the adapter, with the options a governed commit uses (prepacking
/// on, as in a stock session), so the allocator is the only difference.
fn plain(env: &memory_ort::OrtEnvironment, model: &std::path::Path) -> ort::session::Session {
    env.session_builder().unwrap().with_prepacking(true).unwrap().commit_from_file(model).unwrap()
}

/// A stock session (ONNX Runtime's defaults, prepacking on).
fn stock(env: &memory_ort::OrtEnvironment, model: &std::path::Path) -> ort::session::Session {
    env.session_builder().unwrap().commit_from_file(model).unwrap()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 1e-4, "{what}: {g} vs {w}");
    }
}

/// Speech probabilities of `chunks` chunks of stream `seed` through `session`.
fn vad_probabilities(session: &mut impl Infer, seed: u64, chunks: usize) -> Vec<f32> {
    let mut stream = VadStream::new(seed);
    (0..chunks)
        .map(|_| {
            let chunk = stream.next_chunk();
            stream.step(session, &chunk).unwrap()
        })
        .collect()
}

#[test]
fn silero_vad_stream_outputs_equal_those_of_a_session_without_the_adapter() {
    let name = "silero_vad_stream_outputs_equal_those_of_a_session_without_the_adapter";
    let Some((env, assets)) = common::ort(name) else { return };
    let mut plain = plain(env, &assets.silero_vad);
    let expected = vad_probabilities(&mut plain, 7, 24);
    let stock_probabilities = vad_probabilities(&mut stock(env, &assets.silero_vad), 7, 24);

    let tenant = Tenant::new("vad", 256 * MIB, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.silero_vad).unwrap();
    let got = vad_probabilities(&mut session, 7, 24);
    assert_eq!(got, expected, "governed and plain sessions disagree");
    assert_close(&got, &stock_probabilities, "governed vs stock (prepacked) session");
    assert!(got.iter().any(|&p| p > 0.5) || got.iter().any(|&p| p < 0.5), "{got:?}");
    assert!(allocator.stats().allocs > 0 && allocator.stats().reserves > 0, "{:?}", allocator.stats());
    drop(session);
    assert_eq!(tenant.charged_total(), 0);
}

#[test]
fn ocr_detection_outputs_equal_those_of_a_session_without_the_adapter_at_every_image_size() {
    let name = "ocr_detection_outputs_equal_those_of_a_session_without_the_adapter_at_every_image_size";
    let Some((env, assets)) = common::ort(name) else { return };
    let mut plain = plain(env, &assets.ocr_det);
    let tenant = Tenant::new("ocr", 512 * MIB, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.ocr_det).unwrap();
    let mut peaks = Vec::new();
    for (seed, (height, width)) in [(64, 96), (320, 480), (640, 480), (96, 64)].into_iter().enumerate() {
        let image = ocr_image(seed as u64, height, width);
        let (expected_pixels, expected) = detect_text(&mut plain, image.clone(), height, width).unwrap();
        let (pixels, map) = detect_text(&mut session, image, height, width).unwrap();
        assert_eq!(map, expected, "{height}x{width}: governed and plain maps differ");
        assert_eq!(pixels, expected_pixels);
        peaks.push(tenant.snapshot().unwrap().role(MemoryRole::Activations).peak);
    }
    // Activations grow with the image: the 640x480 run needed more than the 64x96 one.
    assert!(peaks[2] > peaks[0], "activation peaks by size: {peaks:?}");
}

#[test]
fn repeated_runs_over_a_pooled_allocator_reach_the_system_allocator_no_more() {
    // ONNX Runtime's first run of a shape allocates every activation on its own; from
    // the second it allocates one planned block per run (about 41 MiB for a 480x640
    // page). The pool must keep that block across runs like ONNX Runtime's own arena
    // does: handing it back and getting a fresh one every run costs a page fault per
    // page, and made governed sessions 1.6x slower than stock ones.
    let name = "repeated_runs_over_a_pooled_allocator_reach_the_system_allocator_no_more";
    let Some((env, assets)) = common::ort(name) else { return };
    let pool = Arc::new(PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new())));
    let inner: Arc<dyn DeviceAllocator> = pool.clone();
    let tenant = Tenant::new("steady", 512 * MIB, Backing::Custom(inner));
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.ocr_det).unwrap();
    let (height, width) = (480, 640);
    let mut run = |seed| detect_text(&mut session, ocr_image(seed, height, width), height, width).unwrap();
    run(0);
    run(1);
    let system = pool.inner();
    let settled = (system.calls(Callback::Allocate), system.calls(Callback::Release));
    let allocs = allocator.stats().allocs;
    for seed in 2..6 {
        run(seed);
        assert_eq!(tenant.charged(MemoryRole::Activations), 0, "run {seed}: activations refunded");
    }
    assert!(allocator.stats().allocs > allocs, "the runs allocated through the adapter");
    assert_eq!((system.calls(Callback::Allocate), system.calls(Callback::Release)), settled, "{:?}", pool.pool_stats());
    assert!(pool.pool_stats().segment_bytes >= 40 * MIB, "the planned block is a cached segment");
}

#[test]
fn every_byte_is_booked_by_role_while_the_session_lives_and_refunded_when_it_drops() {
    let name = "every_byte_is_booked_by_role_while_the_session_lives_and_refunded_when_it_drops";
    let Some((env, assets)) = common::ort(name) else { return };
    let tenant = Tenant::new("books", 256 * MIB, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.ocr_det).unwrap();

    // After creation: the weights are reserved, booked as weights, and the registry and
    // the governor agree to the byte.
    let weights = tenant.charged(MemoryRole::Weights);
    assert_eq!(weights, tenant.charged_total(), "before a run, all of it is weights");
    let (live_bytes, live_blocks) = tenant.registry_live();
    // Beside the blocks, ONNX Runtime's own memory for the session (measured at commit;
    // `tests/prepacking.rs` checks the figure).
    let runtime = session.stats().runtime_held;
    assert_eq!(live_bytes as u64 + runtime, tenant.charged_total(), "registry live bytes vs governor books");
    assert_eq!(live_blocks, allocator.live_blocks());

    // While outputs are held, their bytes are activations, in both books.
    let input = ort::value::Tensor::from_array(([1usize, 3, 320, 320], ocr_image(1, 320, 320))).unwrap();
    let outputs = session.run(ort::inputs!["x" => input]).unwrap();
    let activations = tenant.charged(MemoryRole::Activations);
    assert!(activations >= 320 * 320 * 4, "the probability map is booked: {activations}");
    assert_eq!(tenant.registry_live().0 as u64 + runtime, tenant.charged_total());
    assert_eq!(tenant.charged(MemoryRole::Weights), weights, "a run does not touch the weights");
    drop(outputs);
    assert_eq!(tenant.charged(MemoryRole::Activations), 0);
    let snapshot = tenant.snapshot().unwrap();
    assert!(snapshot.role(MemoryRole::Activations).peak > activations, "intermediate activations were booked");

    drop(session);
    let snapshot = tenant.snapshot().unwrap();
    assert_eq!(snapshot.current, 0, "everything refunded: {snapshot:?}");
    assert_eq!(snapshot.totals.allocations, snapshot.totals.releases, "{snapshot:?}");
    assert_eq!(tenant.registry_live(), (0, 0));
    assert_eq!(allocator.stats().in_use, 0);
}

#[test]
fn a_quota_too_small_for_the_weights_fails_session_creation_with_the_governors_reason() {
    let name = "a_quota_too_small_for_the_weights_fails_session_creation_with_the_governors_reason";
    let Some((env, assets)) = common::ort(name) else { return };
    let tenant = Tenant::new("tiny-quota", 256 << 10, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let err = env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.silero_vad).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, OrtAdapterError::Refused { action: "create the session", .. }), "{text}");
    assert!(text.contains("authority quota") && text.contains("tiny-quota"), "governor's reason missing: {text}");
    assert!(allocator.last_refusal().is_some_and(|reason| reason.contains("authority quota")));
    assert!(tenant.snapshot().unwrap().totals.failures > 0);
    // The process lives on, and nothing stays booked.
    assert_eq!(tenant.charged_total(), 0);
    assert_eq!(tenant.registry_live(), (0, 0));
    assert_eq!(allocator.live_blocks(), 0);
}

#[test]
fn a_quota_too_small_for_a_run_fails_the_run_with_the_governors_reason_and_the_session_recovers() {
    let name = "a_quota_too_small_for_a_run_fails_the_run_with_the_governors_reason_and_the_session_recovers";
    let Some((env, assets)) = common::ort(name) else { return };
    let tenant = Tenant::new("run-quota", 256 * MIB, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.ocr_det).unwrap();
    let weights = tenant.charged_total();
    tenant.governor.set_quota(tenant.authority, weights + MIB).unwrap();

    let input = ort::value::Tensor::from_array(([1usize, 3, 640, 640], ocr_image(2, 640, 640))).unwrap();
    let err = session.run(ort::inputs!["x" => input]).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, OrtAdapterError::Refused { action: "run", .. }), "{text}");
    assert!(text.contains("authority quota") && text.contains("activations"), "{text}");
    assert_eq!(tenant.charged_total(), weights, "the failed run's memory was all refunded");
    let stats = allocator.stats();
    assert!(stats.overdraft_blocks > 0 && stats.in_use + stats.runtime_held == weights, "{stats:?}");

    tenant.governor.set_quota(tenant.authority, 512 * MIB).unwrap();
    let input = ort::value::Tensor::from_array(([1usize, 3, 640, 640], ocr_image(2, 640, 640))).unwrap();
    assert!(session.run(ort::inputs!["x" => input]).is_ok(), "the session works again under a larger quota");
    drop(session);
    assert_eq!(tenant.charged_total(), 0);
    assert_eq!(tenant.registry_live(), (0, 0));
}

#[test]
fn two_tenants_run_concurrently_on_threads_within_their_quotas() {
    let name = "two_tenants_run_concurrently_on_threads_within_their_quotas";
    let Some((env, assets)) = common::ort(name) else { return };
    let mut plain_vad = plain(env, &assets.silero_vad);
    let mut plain_ocr = plain(env, &assets.ocr_det);
    let registry = Arc::new(BindingRegistry::new());
    let governor = Arc::new(Governor::with_config(GovernorConfig::default().with_credit_chunk(0)));
    let quotas = [96 * MIB, 160 * MIB];
    let tenants: Vec<Tenant> = ["tenant-a", "tenant-b"]
        .into_iter()
        .zip(quotas)
        .map(|(name, quota)| Tenant::on(Arc::clone(&registry), Arc::clone(&governor), name, quota, Backing::Pooled))
        .collect();
    let sizes = [(320, 320), (480, 640)];
    std::thread::scope(|scope| {
        let handles: Vec<_> = tenants
            .iter()
            .enumerate()
            .map(|(index, tenant)| {
                let (height, width) = sizes[index];
                scope.spawn(move || {
                    let allocator = tenant.allocator(env);
                    let builder = || env.session_builder().unwrap().with_intra_threads(1).unwrap();
                    let mut vad = env.commit_from_file(&allocator, builder(), &assets.silero_vad).unwrap();
                    let mut ocr = env.commit_from_file(&allocator, builder(), &assets.ocr_det).unwrap();
                    let mut probabilities = Vec::new();
                    let mut maps = Vec::new();
                    for round in 0..3 {
                        probabilities.extend(vad_probabilities(&mut vad, index as u64, 8));
                        let image = ocr_image(round, height, width);
                        maps.push(detect_text(&mut ocr, image, height, width).unwrap().1);
                    }
                    (probabilities, maps)
                })
            })
            .collect();
        for (index, handle) in handles.into_iter().enumerate() {
            let (probabilities, maps) = handle.join().unwrap();
            let (height, width) = sizes[index];
            let mut expected = Vec::new();
            for _ in 0..3 {
                expected.extend(vad_probabilities(&mut plain_vad, index as u64, 8));
            }
            assert_eq!(probabilities, expected, "tenant {index}'s vad stream");
            for (round, map) in maps.iter().enumerate() {
                let image = ocr_image(round as u64, height, width);
                assert_eq!(map, &detect_text(&mut plain_ocr, image, height, width).unwrap().1, "tenant {index}");
            }
        }
    });
    for (tenant, quota) in tenants.iter().zip(quotas) {
        let snapshot = tenant.snapshot().unwrap();
        assert!(
            snapshot.peak > 0 && snapshot.peak <= quota,
            "{}: peak {} quota {quota}",
            snapshot.label,
            snapshot.peak
        );
        assert_eq!(snapshot.totals.failures, 0, "{} was refused", snapshot.label);
        assert_eq!(snapshot.current, 0, "{} refunded", snapshot.label);
        assert!(snapshot.role(MemoryRole::Weights).peak > 0 && snapshot.role(MemoryRole::Activations).peak > 0);
    }
}

#[test]
fn a_device_lost_during_a_session_fails_later_runs_frees_nothing_and_terminates_once_dropped() {
    let name = "a_device_lost_during_a_session_fails_later_runs_frees_nothing_and_terminates_once_dropped";
    let Some((env, assets)) = common::ort(name) else { return };
    let recorder = Arc::new(RecordingAllocator::new(SystemAllocator::new()));
    let inner: Arc<dyn DeviceAllocator> = recorder.clone();
    let tenant = Tenant::new("lossy", 256 * MIB, Backing::Custom(inner));
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.silero_vad).unwrap();
    let mut stream = VadStream::new(1);
    let chunk = stream.next_chunk();
    stream.step(&mut session, &chunk).unwrap();
    let booked = tenant.charged_total();
    assert!(booked > 0);

    let report = tenant.registry.invalidate_device(tenant.device, "simulated loss during the session");
    assert_eq!(report.mechanisms, 1, "{report:?}");
    let releases_at_loss = recorder.calls(Callback::Release);

    let chunk = stream.next_chunk();
    let err = stream.step(&mut session, &chunk).unwrap_err();
    assert!(!err.to_string().is_empty());
    assert!(allocator.last_refusal().is_some_and(|reason| reason.contains("lost")), "{:?}", allocator.last_refusal());

    // Termination is refused while the session may still call; after the drop it is
    // confirmed and the books return to zero. ONNX Runtime's own memory for the session
    // (host heap, not the lost device's blocks) is freed as the session is released, and
    // refunded with it.
    let runtime = session.stats().runtime_held;
    drop(session);
    assert_eq!(recorder.calls(Callback::Release), releases_at_loss, "a block was freed after the loss");
    assert!(allocator.stats().frees_after_loss > 0, "{:?}", allocator.stats());
    assert_eq!(allocator.stats().runtime_held, 0, "{:?}", allocator.stats());
    assert_eq!(tenant.charged_total(), booked - runtime, "lost bytes stay booked until termination");
    let termination = tenant.registry.confirm_context_terminated(&tenant.context).unwrap();
    assert!(termination.lost_allocations > 0, "{termination:?}");
    let snapshot = tenant.snapshot().unwrap();
    assert_eq!(snapshot.current, 0, "{snapshot:?}");
    assert_eq!(recorder.calls(Callback::Release), releases_at_loss);
    assert_eq!(recorder.calls(Callback::ForgetLost), 1);
}
