//! A global thread pool (per-session threads off) shared by the sessions of the
//! process: its workers run every session's kernels, and each allocation is still
//! charged to, and stops, the run it belongs to. The environment is built with the
//! pool, so this binary holds only these tests.

mod common;

use std::sync::OnceLock;

use common::modes::{self, Mode};
use memory_ort::{OrtAssets, OrtEnvironment};
use ort::environment::GlobalThreadPoolOptions;

fn environment(test: &str) -> Option<(&'static OrtEnvironment, &'static OrtAssets)> {
    static LOADED: OnceLock<common::Loaded> = OnceLock::new();
    common::ort_with(test, &LOADED, |assets| {
        OrtEnvironment::load_with(&assets.library, |builder| {
            let pool = GlobalThreadPoolOptions::default().with_intra_threads(2)?.with_inter_threads(2)?;
            Ok(builder.with_global_thread_pool(pool))
        })
    })
}

#[test]
fn a_global_thread_pool_shared_by_two_sessions_governs_every_byte() {
    let name = "a_global_thread_pool_shared_by_two_sessions_governs_every_byte";
    let Some((env, assets)) = environment(name) else { return };
    modes::every_byte_is_governed(env, &assets.ocr_det, Mode::GlobalPool);
    modes::two_sessions_share_one_allocator(env, &assets.ocr_det, Mode::GlobalPool, 3);
}
