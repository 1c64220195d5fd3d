//! What a pool over `SystemAllocator::for_caches` gives back leaves the process: after
//! a workload whose large blocks vary in size, and a trim, resident memory is back to
//! where it started. (Over the global allocator glibc keeps such blocks in its heap
//! once its mmap threshold has risen, so the process would go on holding them.) One
//! test in its own process, so no other test's memory moves the figure.
#![cfg(target_os = "linux")]

use allocator_cpu::{PooledAllocator, SystemAllocator};
use memory_api::{AllocationRequest, DeviceAllocator, DeviceKey};

const MIB: usize = 1 << 20;

fn resident_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let line = status.lines().find(|line| line.starts_with("VmRSS:")).expect("VmRSS");
    let kib: f64 = line.split_whitespace().nth(1).and_then(|kib| kib.parse().ok()).expect("kib");
    kib / 1024.0
}

fn touch(block: &memory_api::RawAllocation) {
    let ptr: *mut u8 = std::ptr::with_exposed_provenance_mut(block.address().get() as usize);
    // SAFETY: the block is live, this test's alone and `bytes()` long.
    unsafe { std::ptr::write_bytes(ptr, 0x5a, block.bytes()) };
}

#[test]
fn what_a_pool_over_os_pages_gives_back_leaves_the_process() {
    let pool = PooledAllocator::new(SystemAllocator::for_caches(DeviceKey::HOST));
    let request = |mib: usize| AllocationRequest::new(mib * MIB, 64).expect("request");
    // The runtime's own small, long-lived heap allocations, made between its large
    // buffers, as a runtime's are: they keep glibc from trimming its heap's top.
    let mut runtime_heap: Vec<Vec<u8>> = Vec::new();
    // A first large shape, given back: glibc (over the global allocator) then raises
    // its mmap threshold to that size and serves smaller large blocks from its heap.
    let first = pool.allocate(&request(24)).expect("allocate");
    touch(&first);
    assert!(pool.release(first).is_complete());
    pool.trim();
    let before = resident_mib();
    // The next shapes: six blocks of 6 MiB, each touched, with the runtime's heap
    // growing between them; then released, and the pool trimmed.
    let blocks: Vec<_> = (0..6)
        .map(|_| {
            let block = pool.allocate(&request(6)).expect("allocate");
            touch(&block);
            runtime_heap.push(vec![1; 256]);
            block
        })
        .collect();
    let held = resident_mib();
    for block in blocks {
        assert!(pool.release(block).is_complete());
    }
    let trimmed = pool.trim();
    let after = resident_mib();
    assert_eq!(runtime_heap.len(), 6);
    assert_eq!(trimmed, 36 * MIB, "the pool gave its six segments back");
    assert!(held >= before + 30.0, "the blocks were resident: {before:.1} MiB before, {held:.1} MiB with them");
    assert!(
        after <= before + 2.0,
        "resident memory {before:.1} MiB before, {held:.1} MiB with the blocks, {after:.1} MiB after the pool gave \
         {trimmed} bytes back"
    );
}
