//! Prepacking on (the default, as in a stock session) without escaping the books, on
//! real models: Silero VAD 6.2.3, PP-OCRv4 detection and the PP-OCR direction
//! classifier from RapidOCR 1.4.4.
//!
//! ONNX Runtime keeps part of every session in allocations of its own (the graph's
//! initializer buffers, which prepacked kernels and the parallel executor read, the
//! kernels, the graph); the adapter measures them at commit and books them as weights.
//! The books are checked here against what is really held, measured apart from the
//! adapter's own figure: the C heap a *stock* session of the same model takes (ONNX
//! Runtime alone on its own allocator, prepacking on, no adapter), and the heap the
//! governed commit took (every block of the adapter comes from the C heap here too).
//!
//! Both are read with glibc's `mallinfo2`, which is process-wide: the tests of this
//! binary take turns, so nothing else in the process allocates while one measures.

mod common;

use std::path::Path;
use std::sync::Once;

use common::{Backing, Tenant};
use memory_governor::MemoryRole;
use memory_ort::workloads::{Infer, VadStream, classify_direction, detect_text, ocr_image, ocr_lines};
use memory_ort::{GovernedOrtAllocator, OrtAdapterError, OrtAllocatorConfig, OrtEnvironment};
use ort::session::builder::SessionBuilder;

const MIB: u64 = 1 << 20;

#[repr(C)]
struct Mallinfo2 {
    arena: usize,
    ordblks: usize,
    smblks: usize,
    hblks: usize,
    hblkhd: usize,
    usmblks: usize,
    fsmblks: usize,
    uordblks: usize,
    fordblks: usize,
    keepcost: usize,
}

unsafe extern "C" {
    /// glibc's heap figures (malloc.h, since 2.33).
    fn mallinfo2() -> Mallinfo2;
}

/// Bytes of the C heap in use now: every arena's chunks in use and the chunks mapped on
/// their own.
fn heap() -> u64 {
    // SAFETY: mallinfo2 takes nothing and only reads the allocator's state.
    let info = unsafe { mallinfo2() };
    (info.uordblks + info.hblkhd) as u64
}

/// A model and the one workload the tests run on it.
#[derive(Copy, Clone, Debug)]
enum Model {
    Vad,
    Detection,
    Classifier,
}

impl Model {
    fn path(self, assets: &memory_ort::OrtAssets) -> &Path {
        match self {
            Model::Vad => &assets.silero_vad,
            Model::Detection => &assets.ocr_det,
            Model::Classifier => &assets.ocr_cls,
        }
    }

    /// The outputs of one short workload.
    fn outputs(self, session: &mut impl Infer) -> Vec<f32> {
        match self {
            Model::Vad => {
                let mut stream = VadStream::new(11);
                (0..4)
                    .map(|_| {
                        let chunk = stream.next_chunk();
                        stream.step(session, &chunk).unwrap()
                    })
                    .collect()
            }
            Model::Detection => detect_text(session, ocr_image(11, 96, 128), 96, 128).unwrap().1,
            Model::Classifier => classify_direction(session, ocr_lines(11, 2, 192), 2).unwrap(),
        }
    }
}

/// One intra-op thread, and the parallel executor with two inter-op threads or not.
fn builder(env: &OrtEnvironment, parallel: bool) -> SessionBuilder {
    let builder = env.session_builder().unwrap().with_intra_threads(1).unwrap();
    if parallel { builder.with_parallel_execution(true).unwrap().with_inter_threads(2).unwrap() } else { builder }
}

/// A stock session (prepacking on) on ONNX Runtime's own CPU allocator, its arena off
/// so it holds what it asks for and no arena chunk more.
fn stock(env: &OrtEnvironment, model: &Path, parallel: bool) -> ort::session::Session {
    let cpu = ort::ep::CPU::default().with_arena_allocator(false).build();
    builder(env, parallel)
        .with_no_environment_execution_providers()
        .unwrap()
        .with_execution_providers([cpu])
        .unwrap()
        .with_prepacking(true)
        .unwrap()
        .commit_from_file(model)
        .unwrap()
}

/// Commits one session first, so what ONNX Runtime sets up once per process (about
/// 1.4 MB, kept after that session is gone) is in no measure of a test.
fn warm(env: &OrtEnvironment, assets: &memory_ort::OrtAssets) {
    static WARM: Once = Once::new();
    WARM.call_once(|| drop(stock(env, &assets.ocr_cls, false)));
}

fn governed(tenant: &Tenant, env: &OrtEnvironment, config: OrtAllocatorConfig) -> GovernedOrtAllocator {
    let binding = tenant.registry.bind_registered(&tenant.mechanism).unwrap();
    GovernedOrtAllocator::cpu(env, binding, Some(tenant.account.clone()), config).unwrap()
}

/// What one governed commit booked and took.
struct Commit {
    /// The governor's books of the tenant after the commit (all weights).
    booked: u64,
    /// Of which ONNX Runtime's own memory, measured by the adapter.
    runtime: u64,
    /// The C heap the commit took, the adapter's blocks included.
    heap: u64,
    /// The adapter's blocks live after the commit.
    blocks: usize,
}

#[test]
fn with_prepacking_on_the_books_hold_every_byte_a_stock_session_holds_in_every_executor() {
    let name = "with_prepacking_on_the_books_hold_every_byte_a_stock_session_holds_in_every_executor";
    let Some((env, assets)) = common::ort(name) else { return };
    let _quiet = common::one_at_a_time();
    warm(env, assets);
    for model in [Model::Vad, Model::Detection, Model::Classifier] {
        for parallel in [false, true] {
            let what = format!("{model:?}, parallel executor {parallel}");
            let path = model.path(assets);

            // ONNX Runtime alone: what the model costs without the adapter.
            let before = heap();
            let mut plain = stock(env, path, parallel);
            let stock_heap = heap() - before;
            let expected = model.outputs(&mut plain);
            drop(plain);

            // Governed, prepacking on (the default), every block from the C heap.
            let tenant = Tenant::new("prepacked", 256 * MIB, Backing::System);
            let allocator = governed(&tenant, env, OrtAllocatorConfig::default());
            assert!(allocator.config().prepacks(), "prepacking is on by default");
            let before = heap();
            let mut session = env.commit_from_file(&allocator, builder(env, parallel), path).unwrap();
            let commit = Commit {
                booked: tenant.charged_total(),
                runtime: session.stats().runtime_held,
                heap: heap() - before,
                blocks: allocator.live_blocks(),
            };
            eprintln!(
                "{what}: stock session heap {stock_heap}; governed commit heap {}, booked {} (of which onnx \
                 runtime's own {}, the adapter's blocks {})",
                commit.heap,
                commit.booked,
                commit.runtime,
                commit.booked - commit.runtime
            );
            assert_eq!(tenant.charged(MemoryRole::Weights), commit.booked, "{what}: all of it is weights");
            assert_eq!(tenant.registry_live().0 as u64 + commit.runtime, commit.booked, "{what}: blocks and the rest");

            // Every byte a stock session of the model holds is booked.
            assert!(commit.booked >= stock_heap, "{what}: booked {} < stock session {stock_heap}", commit.booked);
            // And every byte the governed commit took, but the C allocator's own overhead
            // on the adapter's blocks (the books count what ONNX Runtime asked for; a
            // 64-byte aligned chunk costs glibc at most 64 + 32 bytes more).
            let overhead = commit.blocks as u64 * 96;
            assert!(
                commit.booked + overhead >= commit.heap,
                "{what}: booked {} + {overhead} < heap {}",
                commit.booked,
                commit.heap
            );
            // And not wildly more: the measure adds at most glibc's thread-cache bound.
            assert!(
                commit.booked <= commit.heap + 512 * 1024,
                "{what}: booked {} vs heap {}",
                commit.booked,
                commit.heap
            );

            // The same outputs as the stock session (the same prepacked kernels), and the
            // books back to the weights after the runs.
            assert_eq!(model.outputs(&mut session), expected, "{what}: governed and stock outputs");
            assert_eq!(tenant.charged_total(), commit.booked, "{what}: run memory refunded");

            drop(session);
            assert_eq!(tenant.charged_total(), 0, "{what}: everything refunded when the session drops");
            assert_eq!(tenant.registry_live(), (0, 0), "{what}");
            assert_eq!(allocator.stats().runtime_held, 0, "{what}: {:?}", allocator.stats());
        }
    }
}

#[test]
fn prepacking_off_books_every_byte_too_and_holds_a_second_copy_of_the_weights() {
    let name = "prepacking_off_books_every_byte_too_and_holds_a_second_copy_of_the_weights";
    let Some((env, assets)) = common::ort(name) else { return };
    let _quiet = common::one_at_a_time();
    warm(env, assets);
    for model in [Model::Vad, Model::Detection] {
        let path = model.path(assets);
        let mut commits = Vec::new();
        for prepacking in [true, false] {
            let tenant = Tenant::new("copies", 256 * MIB, Backing::System);
            let allocator = governed(&tenant, env, OrtAllocatorConfig::default().prepacking(prepacking));
            let before = heap();
            let session = env.commit_from_file(&allocator, builder(env, false), path).unwrap();
            let commit = Commit {
                booked: tenant.charged_total(),
                runtime: session.stats().runtime_held,
                heap: heap() - before,
                blocks: allocator.live_blocks(),
            };
            let overhead = commit.blocks as u64 * 96;
            assert!(commit.booked + overhead >= commit.heap, "{model:?} prepacking {prepacking}: under-booked");
            drop(session);
            assert_eq!(tenant.charged_total(), 0, "{model:?} prepacking {prepacking}");
            commits.push(commit);
        }
        let (on, off) = (&commits[0], &commits[1]);
        eprintln!(
            "{model:?}: prepacking on: heap {}, booked {} (onnx runtime's own {}); off: heap {}, booked {} (onnx \
             runtime's own {})",
            on.heap, on.booked, on.runtime, off.heap, off.booked, off.runtime
        );
        // Without prepacking ONNX Runtime keeps its own buffers all the same (the same
        // measure within the thread-cache bound) and the session copies the weights into
        // the adapter's blocks as well: a second copy, booked.
        assert!(on.runtime.abs_diff(off.runtime) <= 512 * 1024, "{model:?}: {} vs {}", on.runtime, off.runtime);
        assert!(off.heap > on.heap + MIB, "{model:?}: the copy costs memory: {} vs {}", off.heap, on.heap);
        assert!(off.booked > on.booked + MIB, "{model:?}: and is booked: {} vs {}", off.booked, on.booked);
    }
}

#[test]
fn a_quota_too_small_for_onnx_runtimes_own_memory_fails_the_commit_with_the_governors_reason() {
    let name = "a_quota_too_small_for_onnx_runtimes_own_memory_fails_the_commit_with_the_governors_reason";
    let Some((env, assets)) = common::ort(name) else { return };
    let _quiet = common::one_at_a_time();
    warm(env, assets);
    // PP-OCRv4 detection with prepacking on: about 11 KB of blocks reach the adapter, the
    // rest (7 MB) is ONNX Runtime's own. A quota of 1 MiB admits the blocks and refuses
    // the rest.
    let tenant = Tenant::new("prepack-quota", MIB, Backing::Pooled);
    let allocator = tenant.allocator(env);
    let err = env.commit_from_file(&allocator, builder(env, false), &assets.ocr_det).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, OrtAdapterError::Refused { action: "create the session", .. }), "{text}");
    assert!(text.contains("authority quota") && text.contains("prepack-quota"), "governor's reason missing: {text}");
    assert!(text.contains("onnx runtime's own memory"), "{text}");
    let refusal = allocator.last_refusal().unwrap();
    assert!(refusal.contains("weights") && refusal.contains("authority quota"), "{refusal}");
    let stats = allocator.stats();
    assert!(stats.refusals >= 1 && stats.runtime_held == 0 && stats.in_use == 0, "{stats:?}");
    assert!(tenant.snapshot().unwrap().totals.failures > 0);
    // The session was released: nothing stays booked or live.
    assert_eq!(tenant.charged_total(), 0);
    assert_eq!(tenant.registry_live(), (0, 0));
    assert_eq!(allocator.live_blocks(), 0);

    // A quota that holds it: the same allocator commits, and the books return to zero.
    tenant.governor.set_quota(tenant.authority, 64 * MIB).unwrap();
    let session = env.commit_from_file(&allocator, builder(env, false), &assets.ocr_det).unwrap();
    assert!(session.stats().runtime_held > 4 * MIB, "{:?}", session.stats());
    drop(session);
    assert_eq!(tenant.charged_total(), 0);
}
