//! Every CPU allocator passes the `memory-testkit` conformance suite, with memory
//! checks done through fault-safe probes.

use allocator_cpu::{PoolConfig, PooledAllocator, SystemAllocator};
#[cfg(unix)]
use allocator_cpu::{SharedHostAllocator, VirtualHostAllocator, probe};
use memory_api::{DeviceAddress, DeviceKey};
use memory_testkit::conformance::{CHECKS, Report, Suite};
use memory_testkit::{AccessError, FaultyAllocator, MemoryAccess, RecordingAllocator};

/// Reads and writes host memory through `allocator_cpu::probe`, so a protected page is
/// an error rather than a crash.
struct HostProbe;

#[cfg(unix)]
impl MemoryAccess for HostProbe {
    fn write(&self, address: DeviceAddress, data: &[u8]) -> Result<(), AccessError> {
        // SAFETY: the suite only passes ranges of blocks it allocated from the allocator
        // under test and still holds, and it keeps no Rust reference into them.
        unsafe { probe::write(address, data) }.map_err(|e| AccessError {
            address,
            len: data.len(),
            reason: e.to_string(),
        })
    }

    fn read(&self, address: DeviceAddress, len: usize) -> Result<Vec<u8>, AccessError> {
        // SAFETY: as above; no thread writes the range while the suite reads it.
        unsafe { probe::read(address, len) }.map_err(|e| AccessError { address, len, reason: e.to_string() })
    }
}

/// Without `probe` (no unix), only the system and pooled allocators run, whose blocks
/// are ordinary heap memory that is always readable and writable.
#[cfg(not(unix))]
impl MemoryAccess for HostProbe {
    fn write(&self, address: DeviceAddress, data: &[u8]) -> Result<(), AccessError> {
        let target = std::ptr::with_exposed_provenance_mut::<u8>(address.get() as usize);
        // SAFETY: the suite only passes ranges of live heap blocks it allocated and
        // still holds, with no Rust reference into them.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), target, data.len()) };
        Ok(())
    }

    fn read(&self, address: DeviceAddress, len: usize) -> Result<Vec<u8>, AccessError> {
        let source = std::ptr::with_exposed_provenance::<u8>(address.get() as usize);
        let mut out = vec![0; len];
        // SAFETY: as above; no thread writes the range while the suite reads it.
        unsafe { std::ptr::copy_nonoverlapping(source, out.as_mut_ptr(), len) };
        Ok(out)
    }
}

fn checks_with_prefix(prefix: &str) -> Vec<&'static str> {
    CHECKS.iter().map(|c| c.name).filter(|name| name.starts_with(prefix)).collect()
}

fn run(suite: Suite<'_>) -> Report {
    let report = suite.with_access(&HostProbe).run();
    eprintln!("{report}");
    report.assert_passed();
    report
}

fn assert_skipped_exactly(report: &Report, expected: &[&str]) {
    let mut skipped: Vec<_> = report.skipped().into_iter().map(|(name, _)| name).collect();
    let mut expected = expected.to_vec();
    skipped.sort_unstable();
    expected.sort_unstable();
    assert_eq!(skipped, expected, "{report}");
}

fn capability_checks() -> Vec<&'static str> {
    [checks_with_prefix("virtual_"), checks_with_prefix("shared_")].concat()
}

#[test]
#[cfg_attr(miri, ignore = "the suite asks for ~isize::MAX bytes (Miri aborts) and probes through pipes")]
fn system_allocator_conforms() {
    let report = run(Suite::new(SystemAllocator::new));
    assert_skipped_exactly(&report, &capability_checks());
    report.assert_ran(&["memory_is_writable", "concurrent_use", "release_refuses_foreign_blocks"]);
}

#[test]
#[cfg_attr(miri, ignore = "the suite asks for ~isize::MAX bytes (Miri aborts) and probes through pipes")]
fn system_allocator_for_a_simulated_device_conforms() {
    let report = run(Suite::new(|| SystemAllocator::for_device(DeviceKey::device(1))));
    assert_skipped_exactly(&report, &capability_checks());
}

#[test]
#[cfg_attr(miri, ignore = "the suite asks for ~isize::MAX bytes (Miri aborts) and probes through pipes")]
fn pooled_allocator_over_the_system_allocator_conforms() {
    let report = run(Suite::new(|| PooledAllocator::new(SystemAllocator::new())));
    assert_skipped_exactly(&report, &capability_checks());
    report.assert_ran(&["trim_keeps_live_blocks", "stats_follow_live_blocks", "memory_is_writable"]);
}

#[test]
#[cfg_attr(miri, ignore = "the suite asks for ~isize::MAX bytes (Miri aborts) and probes through pipes")]
fn pooled_allocator_that_caches_nothing_conforms() {
    let config = PoolConfig::default().with_max_cached_bytes(0);
    let report = run(Suite::new(move || PooledAllocator::with_config(SystemAllocator::new(), config)));
    assert_skipped_exactly(&report, &capability_checks());
}

#[test]
#[cfg_attr(miri, ignore = "the suite asks for ~isize::MAX bytes (Miri aborts) and probes through pipes")]
fn pooled_allocator_carving_segments_conforms() {
    // Classes end at 1 KiB, so the suite's blocks are pieces of segments (split, merged,
    // evicted under a small cap) rather than class blocks.
    let config = PoolConfig { max_cached_bytes: 256 << 10, max_class_bytes: 1024, shards: 4 };
    let report = run(Suite::new(move || PooledAllocator::with_config(SystemAllocator::new(), config)));
    assert_skipped_exactly(&report, &capability_checks());
    report.assert_ran(&["concurrent_use", "trim_keeps_live_blocks", "memory_is_writable"]);
}

#[test]
#[cfg_attr(miri, ignore = "the suite asks for ~isize::MAX bytes (Miri aborts) and probes through pipes")]
fn pooled_allocator_over_wrappers_conforms() {
    let report = run(Suite::new(|| PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()))));
    assert_skipped_exactly(&report, &capability_checks());
    let report = run(Suite::new(|| PooledAllocator::new(FaultyAllocator::new(SystemAllocator::new()))));
    assert_skipped_exactly(&report, &capability_checks());
}

#[test]
#[cfg(unix)]
#[cfg_attr(miri, ignore = "mmap/memfd system calls and the full suite, which Miri cannot run")]
fn virtual_host_allocator_conforms() {
    let report = run(Suite::new(VirtualHostAllocator::new));
    assert_skipped_exactly(&report, &[&["memory_is_writable"][..], &checks_with_prefix("shared_")].concat());
    report.assert_ran(&checks_with_prefix("virtual_"));
}

#[test]
#[cfg(unix)]
#[cfg_attr(miri, ignore = "mmap/memfd system calls and the full suite, which Miri cannot run")]
fn populating_virtual_host_allocator_conforms() {
    let report = run(Suite::new(|| VirtualHostAllocator::new().populating()));
    report.assert_ran(&checks_with_prefix("virtual_"));
}

#[test]
#[cfg(unix)]
#[cfg_attr(miri, ignore = "mmap/memfd system calls and the full suite, which Miri cannot run")]
fn shared_host_allocator_conforms() {
    let report = run(Suite::new(SharedHostAllocator::new));
    assert_skipped_exactly(&report, &[&["memory_is_writable"][..], &checks_with_prefix("virtual_")].concat());
    report.assert_ran(&checks_with_prefix("shared_"));
}

#[test]
#[cfg(unix)]
#[cfg_attr(miri, ignore = "mmap/memfd system calls and the full suite, which Miri cannot run")]
fn recording_wrapper_over_capability_allocators_conforms() {
    let report = run(Suite::new(|| RecordingAllocator::new(VirtualHostAllocator::new())));
    report.assert_ran(&checks_with_prefix("virtual_"));
    let report = run(Suite::new(|| RecordingAllocator::new(SharedHostAllocator::new())));
    report.assert_ran(&checks_with_prefix("shared_"));
}
