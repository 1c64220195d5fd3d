//! Real models whose input shapes change from run to run (PP-OCRv4 recognition over a
//! width sweep and two batch sizes, PP-OCRv4 detection over image sizes, the PP-OCR
//! direction classifier over batch sizes), governed by a pooled allocator. ONNX
//! Runtime plans memory per input shape (its memory pattern: the first run of a shape
//! allocates each buffer on its own, later runs of that shape one planned block), so a
//! sweep that comes back to a shape takes both paths. At every step the outputs equal
//! a plain session's bit for bit, and the books hold exactly the weights between runs;
//! after the session drops they hold nothing. The tests run one at a time: their books
//! include ONNX Runtime's own memory, measured at commit as the process's heap growth,
//! which another test's sessions coming and going would disturb.

mod common;

use common::{Backing, Tenant};
use memory_governor::MemoryRole;
use memory_ort::workloads::{OCR_CLS_WIDTH, classify_direction, detect_text, ocr_image, ocr_lines, recognize_text};

const MIB: u64 = 1 << 20;

/// A session without the adapter, with the options a governed commit uses (prepacking
/// on, as in a stock session), so the allocator is the only difference.
fn plain(env: &memory_ort::OrtEnvironment, model: &std::path::Path) -> ort::session::Session {
    env.session_builder().unwrap().with_prepacking(true).unwrap().commit_from_file(model).unwrap()
}

/// The books between runs: the weights and nothing else, in the governor and the
/// registry alike (the registry records the adapter's blocks; ONNX Runtime's own memory
/// for the session is booked beside them).
fn assert_books_hold_only_the_weights(
    tenant: &Tenant,
    allocator: &memory_ort::GovernedOrtAllocator,
    weights: u64,
    what: &str,
) {
    assert_eq!(tenant.charged(MemoryRole::Activations), 0, "{what}: activations refunded");
    assert_eq!(tenant.charged_total(), weights, "{what}: only the weights stay booked");
    let runtime = allocator.stats().runtime_held;
    assert_eq!(tenant.registry_live().0 as u64 + runtime, weights, "{what}: registry live bytes vs the weights");
}

/// The books after the session dropped: nothing, every allocation released.
fn assert_books_are_empty(tenant: &Tenant, allocator: &memory_ort::GovernedOrtAllocator) {
    let snapshot = tenant.snapshot().unwrap();
    assert_eq!(snapshot.current, 0, "everything refunded: {snapshot:?}");
    assert_eq!(snapshot.totals.allocations, snapshot.totals.releases, "{snapshot:?}");
    assert_eq!(snapshot.totals.failures, 0, "nothing was refused: {snapshot:?}");
    assert_eq!(tenant.registry_live(), (0, 0));
    assert_eq!(allocator.stats().in_use, 0, "{:?}", allocator.stats());
    assert_eq!(allocator.stats().overdraft_blocks, 0, "{:?}", allocator.stats());
}

#[test]
fn ocr_recognition_over_a_width_sweep_equals_a_plain_session_and_books_return_to_the_weights() {
    let name = "ocr_recognition_over_a_width_sweep_equals_a_plain_session_and_books_return_to_the_weights";
    let Some((env, assets)) = common::ort(name) else { return };
    let _one = common::one_at_a_time();
    let mut plain = plain(env, &assets.ocr_rec);
    let tenant = Tenant::new("ocr-rec", 512 * MIB, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.ocr_rec).unwrap();
    let weights = tenant.charged(MemoryRole::Weights);
    assert!(weights > 5 * MIB, "pp-ocrv4 rec has about 10 MiB of weights, booked {weights}");
    assert_books_hold_only_the_weights(&tenant, &allocator, weights, "after commit");

    // Up the sweep and back down, at batch 1 and 2; the repeated shapes (320 and 80
    // on the way back, and batch 2 after batch 1) run on ONNX Runtime's planned block.
    let mut peaks = Vec::new();
    for batch in [1, 2] {
        for (step, width) in [80, 160, 320, 800, 320, 80].into_iter().enumerate() {
            let what = format!("batch {batch}, width {width} (step {step})");
            let seed = (batch * 100 + step) as u64;
            let (expected_shape, expected) =
                recognize_text(&mut plain, ocr_lines(seed, batch, width), batch, width).unwrap();
            let (shape, values) = recognize_text(&mut session, ocr_lines(seed, batch, width), batch, width).unwrap();
            assert_eq!(shape, expected_shape, "{what}");
            assert_eq!(shape[..2], [batch as i64, (width / 8) as i64], "{what}: one time step per 8 pixels");
            assert!(
                values.iter().map(|v| v.to_bits()).eq(expected.iter().map(|v| v.to_bits())),
                "{what}: outputs differ"
            );
            assert_books_hold_only_the_weights(&tenant, &allocator, weights, &what);
            peaks.push(tenant.snapshot().unwrap().role(MemoryRole::Activations).peak);
        }
    }
    assert!(peaks[3] > peaks[0], "the 800-wide run needed more activations than the 80-wide one: {peaks:?}");
    drop(session);
    assert_books_are_empty(&tenant, &allocator);
}

#[test]
fn ocr_detection_over_image_sizes_equals_a_plain_session_and_books_return_to_the_weights() {
    let name = "ocr_detection_over_image_sizes_equals_a_plain_session_and_books_return_to_the_weights";
    let Some((env, assets)) = common::ort(name) else { return };
    let _one = common::one_at_a_time();
    let mut plain = plain(env, &assets.ocr_det);
    let tenant = Tenant::new("ocr-det", 512 * MIB, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.ocr_det).unwrap();
    let weights = tenant.charged(MemoryRole::Weights);
    assert_books_hold_only_the_weights(&tenant, &allocator, weights, "after commit");
    let sizes = [(96, 160), (320, 320), (480, 640), (160, 96), (320, 320), (480, 640), (96, 160)];
    for (seed, (height, width)) in sizes.into_iter().enumerate() {
        let what = format!("{height}x{width} (step {seed})");
        let image = ocr_image(seed as u64, height, width);
        let (expected_pixels, expected) = detect_text(&mut plain, image.clone(), height, width).unwrap();
        let (pixels, map) = detect_text(&mut session, image, height, width).unwrap();
        assert_eq!(map.len(), height * width, "{what}");
        assert!(map.iter().map(|v| v.to_bits()).eq(expected.iter().map(|v| v.to_bits())), "{what}: maps differ");
        assert_eq!(pixels, expected_pixels, "{what}");
        assert_books_hold_only_the_weights(&tenant, &allocator, weights, &what);
    }
    drop(session);
    assert_books_are_empty(&tenant, &allocator);
}

#[test]
fn the_direction_classifier_over_batch_sizes_equals_a_plain_session_and_books_return_to_the_weights() {
    let name = "the_direction_classifier_over_batch_sizes_equals_a_plain_session_and_books_return_to_the_weights";
    let Some((env, assets)) = common::ort(name) else { return };
    let _one = common::one_at_a_time();
    let mut plain = plain(env, &assets.ocr_cls);
    let tenant = Tenant::new("ocr-cls", 256 * MIB, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.ocr_cls).unwrap();
    let weights = tenant.charged(MemoryRole::Weights);
    assert!(weights > 0);
    for (seed, batch) in [1, 2, 6, 2, 1].into_iter().enumerate() {
        let what = format!("batch {batch} (step {seed})");
        let lines = ocr_lines(seed as u64, batch, OCR_CLS_WIDTH);
        let expected = classify_direction(&mut plain, lines.clone(), batch).unwrap();
        let got = classify_direction(&mut session, lines, batch).unwrap();
        assert_eq!(got.len(), batch * 2, "{what}: two directions per line");
        assert!(got.iter().map(|v| v.to_bits()).eq(expected.iter().map(|v| v.to_bits())), "{what}: outputs differ");
        for pair in got.chunks(2) {
            assert!((pair[0] + pair[1] - 1.0).abs() < 1e-4, "{what}: probabilities {pair:?}");
        }
        assert_books_hold_only_the_weights(&tenant, &allocator, weights, &what);
    }
    drop(session);
    assert_books_are_empty(&tenant, &allocator);
}

#[test]
fn the_first_run_of_each_new_shape_trims_the_pool_and_a_repeated_shape_keeps_its_planned_block() {
    let name = "the_first_run_of_each_new_shape_trims_the_pool_and_a_repeated_shape_keeps_its_planned_block";
    let Some((env, assets)) = common::ort(name) else { return };
    let _one = common::one_at_a_time();
    let widths = [80, 320, 800, 160];
    let mut cached = Vec::new();
    let mut outputs = Vec::new();
    for trim in [true, false] {
        let pool = std::sync::Arc::new(allocator_cpu::PooledAllocator::new(
            allocator_cpu::SystemAllocator::for_caches(memory_governor::DeviceKey::HOST),
        ));
        let inner: std::sync::Arc<dyn memory_governor::DeviceAllocator> = pool.clone();
        let tenant = Tenant::new("trim", 512 * MIB, Backing::Custom(inner));
        let binding = tenant.registry.bind_registered(&tenant.mechanism).unwrap();
        let config = memory_ort::OrtAllocatorConfig::default().trim_on_new_shapes(trim);
        let allocator =
            memory_ort::GovernedOrtAllocator::cpu(env, binding, Some(tenant.account.clone()), config).unwrap();
        let mut session = env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.ocr_rec).unwrap();
        let mut values = Vec::new();
        for (seed, width) in widths.into_iter().enumerate() {
            values.push(recognize_text(&mut session, ocr_lines(seed as u64, 1, width), 1, width).unwrap().1);
        }
        let after_sweep = pool.pool_stats().cached_bytes;
        // A shape seen before: no trim, its planned block comes from the cache.
        recognize_text(&mut session, ocr_lines(9, 1, 160), 1, 160).unwrap();
        let before = pool.pool_stats();
        recognize_text(&mut session, ocr_lines(9, 1, 160), 1, 160).unwrap();
        let after = pool.pool_stats();
        assert_eq!(after.trims, before.trims, "trim {trim}: a repeated shape does not trim");
        assert_eq!(after.misses, before.misses, "trim {trim}: a repeated shape is served from the cache: {after:?}");
        cached.push(after_sweep);
        outputs.push(values);
    }
    assert_eq!(outputs[0], outputs[1], "trimming changes no output");
    assert!(
        cached[0] * 2 < cached[1],
        "after a sweep the trimming pool caches far less: {} vs {} bytes",
        cached[0],
        cached[1]
    );
}

/// A first run of a shape that the governor refused is not the run ONNX Runtime plans
/// that shape's memory from: the next good run of it allocates each buffer on its own
/// again, so that run still trims the pool (it used to count as a shape seen before,
/// and the pool kept its buffers for good).
#[test]
fn a_refused_first_run_of_a_shape_leaves_it_new_so_its_first_good_run_still_trims() {
    let name = "a_refused_first_run_of_a_shape_leaves_it_new_so_its_first_good_run_still_trims";
    let Some((env, assets)) = common::ort(name) else { return };
    let _one = common::one_at_a_time();
    let pool = std::sync::Arc::new(allocator_cpu::PooledAllocator::new(allocator_cpu::SystemAllocator::for_caches(
        memory_governor::DeviceKey::HOST,
    )));
    let inner: std::sync::Arc<dyn memory_governor::DeviceAllocator> = pool.clone();
    let tenant = Tenant::new("refused-shape", 512 * MIB, Backing::Custom(inner));
    let allocator = tenant.allocator(env);
    let mut session = env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.ocr_rec).unwrap();
    let weights = tenant.charged_total();
    let width = 480;
    tenant.governor.set_quota(tenant.authority, weights + 64 * 1024).unwrap();
    let err = recognize_text(&mut session, ocr_lines(3, 1, width), 1, width).unwrap_err();
    assert!(matches!(err, memory_ort::OrtAdapterError::Refused { .. }), "{err}");
    tenant.governor.set_quota(tenant.authority, 512 * MIB).unwrap();
    let before = pool.pool_stats();
    recognize_text(&mut session, ocr_lines(3, 1, width), 1, width).unwrap();
    let after = pool.pool_stats();
    assert!(after.trims > before.trims, "the first good run of the shape trims the pool: {before:?} -> {after:?}");
    // And that one run only: the shape is known now.
    recognize_text(&mut session, ocr_lines(4, 1, width), 1, width).unwrap();
    assert_eq!(pool.pool_stats().trims, after.trims, "a repeated shape does not trim");
    assert_books_hold_only_the_weights(&tenant, &allocator, weights, "after the runs");
}
