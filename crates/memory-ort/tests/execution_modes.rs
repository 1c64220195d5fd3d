//! Every byte is governed in every execution configuration ONNX Runtime users run:
//! the sequential executor with one, two and four intra-op threads, the parallel
//! executor with two inter-op threads, and two sessions of one tenant sharing one
//! allocator, run at once from two threads. (The global thread pool needs an
//! environment of its own, so it has a test binary of its own: `global_pool.rs`.)

mod common;

use common::modes::{self, Mode};

fn scenario(name: &str, mode: Mode) {
    let Some((env, assets)) = common::ort(name) else { return };
    modes::every_byte_is_governed(env, &assets.ocr_det, mode);
}

#[test]
fn sequential_executor_with_one_intra_op_thread_governs_every_byte() {
    scenario("sequential_executor_with_one_intra_op_thread_governs_every_byte", Mode::Sequential);
}

#[test]
fn sequential_executor_with_two_intra_op_threads_governs_every_byte() {
    scenario("sequential_executor_with_two_intra_op_threads_governs_every_byte", Mode::Intra(2));
}

#[test]
fn sequential_executor_with_four_intra_op_threads_governs_every_byte() {
    scenario("sequential_executor_with_four_intra_op_threads_governs_every_byte", Mode::Intra(4));
}

#[test]
fn parallel_executor_with_two_inter_op_threads_governs_every_byte() {
    scenario("parallel_executor_with_two_inter_op_threads_governs_every_byte", Mode::Parallel(2));
}

#[test]
fn two_sessions_of_one_tenant_share_one_allocator_and_run_at_once_on_the_parallel_executor() {
    let name = "two_sessions_of_one_tenant_share_one_allocator_and_run_at_once_on_the_parallel_executor";
    let Some((env, assets)) = common::ort(name) else { return };
    modes::two_sessions_share_one_allocator(env, &assets.ocr_det, Mode::Parallel(2), 3);
    modes::two_sessions_share_one_allocator(env, &assets.ocr_det, Mode::Sequential, 2);
}
