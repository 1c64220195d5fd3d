//! N allocate + release pairs through a registry binding over the example C plugin
//! (`tests/c/example_plugin.c`, built with -O2 as the ffi bench builds it), for counting
//! the loader's instructions per pair under callgrind, a measure that does not move with
//! the load of a shared machine:
//!
//! ```text
//! cargo build --release -p memory-plugin --example pair_instructions
//! for n in 10000 110000; do
//!   valgrind --tool=callgrind --callgrind-out-file=cg.$n --toggle-collect='*plugin_batch*' \
//!     target/release/examples/pair_instructions $n
//!   callgrind_annotate --inclusive=no --threshold=100 cg.$n   # self cost per function, by object
//! done   # (second − first) / 100000 = instructions per pair
//! ```
//!
//! The total includes the plugin's own `posix_memalign` / `free`, and glibc's share moves
//! with the heap's layout between two builds (how often `malloc_consolidate` runs), so
//! compare the executable's own functions (the loader and the registry) between two
//! commits of this crate.

use std::hint::black_box;
use std::path::Path;
use std::sync::Arc;

use memory_api::{AllocationRequest, DeviceAllocator, MemoryRole};
use memory_binding::{BindingRegistry, MemoryBinding};
use memory_plugin::{InstanceOptions, PluginLibrary};
use memory_testkit::native::{Language, NativeBuild};

fn main() {
    let n: u64 = std::env::args().nth(1).and_then(|n| n.parse().ok()).unwrap_or(100_000);
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = manifest.join("../../target/pair-instructions-plugin");
    let path = NativeBuild::new(Language::C("c11"))
        .source(manifest.join("tests/c/example_plugin.c"))
        .include(manifest.join("../../include"))
        .arg("-lpthread")
        .arg("-O2")
        .shared_library(&out, "libexample_plugin.so");
    // SAFETY: the example plugin is this crate's own C source.
    let library = unsafe { PluginLibrary::load(path) }.expect("the example plugin loads");
    let allocator = library.instantiate(&InstanceOptions::new().offer(0)).expect("an instance");
    let registry = BindingRegistry::new();
    let device = allocator.device();
    let context = registry.register_provider_context(device, Arc::new(())).expect("context");
    let authority = registry.register_authority(device, Arc::new(())).expect("authority");
    let mechanism = registry.register_allocator(&context, &authority, Arc::new(allocator)).expect("mechanism");
    let binding = registry.bind_registered(&mechanism).expect("binding");
    let request = AllocationRequest::new(4096, 64).expect("layout").with_role(MemoryRole::KvCache);
    plugin_batch(&binding, request, 300);
    plugin_batch(&binding, request, n);
}

#[inline(never)]
fn plugin_batch(binding: &MemoryBinding, request: AllocationRequest, n: u64) {
    (0..n).for_each(|_| {
        let block = binding.allocate(black_box(request)).expect("allocate");
        black_box(binding.release(block).expect("release"));
    });
}
