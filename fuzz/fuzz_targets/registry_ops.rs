//! `cargo +nightly fuzz run registry_ops`: an arbitrary list of registry operations
//! against a real `BindingRegistry` over test-kit allocators, with every invariant of
//! `memory_fuzz` (see `src/lib.rs`) checked after each step.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(input) = memory_fuzz::decode(data) {
        memory_fuzz::run(&input);
    }
});
