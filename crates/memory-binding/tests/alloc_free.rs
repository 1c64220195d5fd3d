//! Zero heap allocations per `bind` and per allocate + release pair at steady state,
//! proved with a counting global allocator (this test binary's only test, so no
//! other test thread allocates while it counts).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

use common::{Caps, request};
use memory_api::DeviceKey;
use memory_binding::BindingRegistry;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

struct Counting;

// SAFETY: defers every call to `System` with the same arguments, so it upholds
// `GlobalAlloc`'s contract exactly as `System` does; the only addition is a
// thread-local counter increment, which does not allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller upholds `alloc`'s contract for `layout`; forwarded as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` through `alloc` above with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: forwarded unchanged; `ptr` came from `System` with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

#[test]
#[cfg_attr(miri, ignore = "counts heap allocations over 300 warm-up rounds: 140 s under Miri")]
fn bind_and_allocate_release_pairs_do_not_touch_the_heap_at_steady_state() {
    let registry = BindingRegistry::new();
    let binding = registry.with_memory(Arc::new(Caps::new(DeviceKey::device(0)))).unwrap();
    let request = request(4096);
    // Warm up: the pin, its slab and the identity blocks are created once.
    for _ in 0..300 {
        let block = binding.allocate(request).unwrap();
        binding.release(block).unwrap();
        drop(registry.bind(DeviceKey::device(0)).unwrap());
    }

    let before = allocations();
    for _ in 0..10_000 {
        let block = binding.allocate(request).unwrap();
        binding.release(block).unwrap();
    }
    assert_eq!(allocations() - before, 0, "allocate + release pairs allocated on the heap");

    // Binding ids come from per-pin blocks of 256: refilling a block is not a heap
    // allocation either.
    let before = allocations();
    for _ in 0..10_000 {
        drop(registry.bind(DeviceKey::device(0)).unwrap());
    }
    assert_eq!(allocations() - before, 0, "bind allocated on the heap");
}
