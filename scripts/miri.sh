#!/usr/bin/env bash
# Runs the tests of the unsafe-bearing crates (and of the registry and test kit they are
# checked through) under Miri, on the nightly toolchain. Not part of CI: a full run takes
# about ten minutes on two cores. `cargo xtask miri` runs this script.
#
#   scripts/miri.sh                 every run below
#   scripts/miri.sh memory-binding  only the runs of the named packages
#
# Environment:
#   MIRI_TOOLCHAIN   toolchain to use (default: nightly); the miri and rust-src
#                    components are installed on it when missing
#   MIRIFLAGS        replaces the default flags below (for example to add
#                    -Zmiri-tree-borrows, or -Zmiri-many-seeds=0..8 for more schedules)
#   CARGO_TARGET_DIR as usual; Miri builds under <target>/miri
#
# Flags. -Zmiri-strict-provenance cannot be used: by design, addresses are integers
# (`DeviceAddress`, see memory-api) and host backends turn them back into
# pointers with `std::ptr::with_exposed_provenance_mut` (memory-api's
# `DeviceAddress::as_host_ptr`, allocator-cpu's SystemAllocator and its tests), which
# strict provenance rejects as unsupported. -Zmiri-permissive-provenance accepts
# exposed provenance without a warning per cast; Miri still checks every access made
# through such a pointer against the allocations whose provenance was exposed.
# Leak checking stays on, except for the two tests below whose leak is their contract.
#
# What is skipped, and why, is said where it is skipped: each test Miri cannot run
# carries `#[cfg_attr(miri, ignore = "<reason>")]` (system calls Miri does not support:
# mmap, mprotect, memfd, pipes; an allocation of ~isize::MAX bytes, on which Miri
# aborts instead of returning null; multi-threaded stress and proptest searches that
# take hours; a few single tests over a minute), so `cargo miri test` prints every
# skipped test by name with its reason. Doctests run only for memory-api and
# memory-binding (the others reserve address space with mmap or run whole suites).
set -euo pipefail

cd "$(dirname "$0")/.."

toolchain="${MIRI_TOOLCHAIN:-nightly}"
flags="${MIRIFLAGS:--Zmiri-permissive-provenance}"

if ! cargo "+$toolchain" miri --version >/dev/null 2>&1; then
    echo "miri: installing the miri and rust-src components on $toolchain"
    rustup component add --toolchain "$toolchain" miri rust-src
fi
cargo "+$toolchain" miri setup

# package | cargo test arguments | libtest arguments | extra MIRIFLAGS
runs=(
    "memory-api||"
    "memory-binding||--skip callbacks_and_destructors_run_with_no_lock_held"
    # The test's allocator holds its registry, which holds the allocator: a reference
    # cycle that the test builds on purpose (re-entrant callbacks), leaked at exit.
    "memory-binding|--test checks|--exact callbacks_and_destructors_run_with_no_lock_held|-Zmiri-ignore-leaks"
    "memory-testkit|--lib --tests|"
    "allocator-cpu|--lib --tests|--skip forget_lost_drops_the_records_and_forwards_the_inner_blocks"
    # forget_lost hands lost blocks to an allocator that cannot free them (the context
    # is gone); for host memory that is a leak by contract.
    "allocator-cpu|--lib|--exact pooled::tests::forget_lost_drops_the_records_and_forwards_the_inner_blocks|-Zmiri-ignore-leaks"
    # Pure bookkeeping of the CUDA backend (no driver call): its live-block tables and
    # error mapping. Everything else there loads libcuda, which Miri cannot.
    "allocator-cuda|--lib|table:: error::"
    # The C ABI's handle tables (cells, generations, hazard slots, in-place values).
    # The rest of memory-capi loads plugins and compiles C programs, which Miri cannot.
    "memory-capi|--lib|handles::"
    # The per-thread tables, owner slots and the record table built on them, and the
    # plugin loader's block records in it and its live-range index over those (the rest
    # of memory-plugin loads plugins).
    "memory-sync|--lib|per_thread:: owner_slots:: records::"
    "memory-plugin|--lib|records:: ranges::"
)

wanted=("$@")
failed=()
summary=()
start_all=$(date +%s)
for run in "${runs[@]}"; do
    IFS='|' read -r package cargo_args test_args extra <<<"$run"
    if ((${#wanted[@]})) && [[ ! " ${wanted[*]} " == *" $package "* ]]; then
        continue
    fi
    label="$package ${cargo_args:-(all targets)} ${test_args}"
    echo
    echo "=== miri: $label"
    start=$(date +%s)
    # shellcheck disable=SC2086 # the argument lists are meant to split
    if MIRIFLAGS="$flags $extra" cargo "+$toolchain" miri test -p "$package" $cargo_args -- $test_args; then
        status=ok
    else
        status=FAILED
        failed+=("$label")
    fi
    summary+=("$(printf '%-7s %5ss  %s' "$status" "$(($(date +%s) - start))" "$label")")
done

echo
echo "miri summary (MIRIFLAGS=$flags, toolchain $toolchain, $(($(date +%s) - start_all))s in all):"
printf '  %s\n' "${summary[@]}"
if ((${#failed[@]})); then
    echo "miri: ${#failed[@]} run(s) failed; the first error above names the test and Miri's finding"
    exit 1
fi
