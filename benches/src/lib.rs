//! Criterion benches across the workspace (see `benches/`), the allocators they share
//! as floors, and [`interleaved`], the timing loop of the side-by-side comparisons.
#![forbid(unsafe_code)]

use std::cell::Cell;
use std::time::{Duration, Instant};

use memory_api::{
    AllocError, AllocationRequest, DeviceAddress, DeviceAllocator, DeviceKey, RawAllocation, ReleaseOutcome,
};

/// Hands out addresses from a per-thread counter and frees nothing: the cheapest
/// allocator, sharing no cache line between threads, so a bench measures the layers
/// above it (the registry, the governor) rather than the allocator.
#[derive(Debug)]
pub struct CounterAllocator {
    device: DeviceKey,
}

impl CounterAllocator {
    /// A counter allocator claiming to serve `device`.
    pub fn new(device: DeviceKey) -> CounterAllocator {
        CounterAllocator { device }
    }
}

thread_local!(static NEXT: Cell<u64> = const { Cell::new(1 << 20) });

impl DeviceAllocator for CounterAllocator {
    fn device(&self) -> DeviceKey {
        self.device
    }

    fn name(&self) -> &str {
        "counter"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let start = NEXT.with(|next| {
            let start = next.get();
            next.set(start + 4096);
            start
        });
        let address = DeviceAddress::new(start).ok_or_else(|| AllocError::Unsupported {
            allocator: "counter".to_owned(),
            device: self.device,
            what: "a counter that wrapped to address zero",
        })?;
        Ok(RawAllocation::new(address, request.bytes(), request.align(), self.device, 0))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        ReleaseOutcome::complete(allocation.bytes())
    }
}

/// A per-thread pool of fixed-size slots: allocate pops a free slot (or takes a new
/// one), release pushes it back, on the calling thread's own list. The floor of a
/// caching allocator whose fast path touches only thread-local state, so a bench
/// against it measures what the layers above add to a realistic pooled allocation.
#[derive(Debug)]
pub struct SlotPoolAllocator {
    device: DeviceKey,
}

impl SlotPoolAllocator {
    /// A slot pool claiming to serve `device`.
    pub fn new(device: DeviceKey) -> SlotPoolAllocator {
        SlotPoolAllocator { device }
    }
}

thread_local!(static POOL: std::cell::RefCell<(Vec<u64>, u64)> = const { std::cell::RefCell::new((Vec::new(), 1 << 40)) });

impl DeviceAllocator for SlotPoolAllocator {
    fn device(&self) -> DeviceKey {
        self.device
    }

    fn name(&self) -> &str {
        "slot pool"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let start = POOL.with_borrow_mut(|(free, next)| {
            free.pop().unwrap_or_else(|| {
                let start = *next;
                *next += 1 << 16;
                start
            })
        });
        let address = DeviceAddress::new(start).ok_or_else(|| AllocError::Unsupported {
            allocator: "slot pool".to_owned(),
            device: self.device,
            what: "a slot at address zero",
        })?;
        Ok(RawAllocation::new(address, request.bytes(), request.align(), self.device, 0))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let bytes = allocation.bytes();
        POOL.with_borrow_mut(|(free, _)| free.push(allocation.address().get()));
        ReleaseOutcome::complete(bytes)
    }
}

/// Pairs per batch in [`interleaved`].
pub const INTERLEAVED_BATCH: u64 = 512;

/// Runs `first` and `second` `iters` times each, in alternating batches of
/// [`INTERLEAVED_BATCH`], and returns the time each side took in all.
///
/// Two sides compared this way run within the same fraction of a millisecond, so a
/// machine whose speed drifts moves both alike, and each batch starts from the
/// allocator state the other side's batch left (glibc's cost for an aligned block
/// depends on where its free chunks lie), alike for both.
pub fn interleaved(iters: u64, mut first: impl FnMut(), mut second: impl FnMut()) -> (Duration, Duration) {
    let (mut first_time, mut second_time) = (Duration::ZERO, Duration::ZERO);
    let mut left = iters;
    while left > 0 {
        let batch = left.min(INTERLEAVED_BATCH);
        let start = Instant::now();
        (0..batch).for_each(|_| first());
        let middle = Instant::now();
        (0..batch).for_each(|_| second());
        second_time += middle.elapsed();
        first_time += middle - start;
        left -= batch;
    }
    (first_time, second_time)
}
