//! Prints `cuda devices: N` and exits 0, or explains why CUDA is unavailable and exits 1.
//!
//! `cargo xtask test --gpu` runs this to decide whether a device is present.

use std::process::ExitCode;

fn main() -> ExitCode {
    match allocator_cuda::device_count() {
        Ok(count) => {
            println!("cuda devices: {count}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("cuda_probe: {error}");
            ExitCode::FAILURE
        }
    }
}
