//! A commit and a new shape's trim hand the C heap's free pages back to the operating
//! system (`OrtAllocatorConfig::return_free_heap_pages`), on a real model. In a file of
//! its own: its sessions come and go while other tests' commits measure the C heap,
//! which this process then leaves alone.

mod common;

use common::{Backing, Tenant};
use memory_ort::workloads::{ocr_lines, recognize_text};

const MIB: u64 = 1 << 20;

/// A commit and a new shape's trim also hand the C heap's free pages back to the
/// operating system (glibc's `malloc_trim`), counted in the session's figures and the
/// adapter's; with that off, trims are counted and no heap pages are returned.
#[test]
fn commits_and_new_shapes_trims_return_the_c_heaps_free_pages_unless_configured_off() {
    let name = "commits_and_new_shapes_trims_return_the_c_heaps_free_pages_unless_configured_off";
    let Some((env, assets)) = common::ort(name) else { return };
    let widths = [80, 320, 800];
    for returning in [true, false] {
        let tenant = Tenant::new("heap-pages", 512 * MIB, Backing::Pooled);
        let binding = tenant.registry.bind_registered(&tenant.mechanism).unwrap();
        let config = memory_ort::OrtAllocatorConfig::default().return_free_heap_pages(returning);
        assert_eq!(config.returns_free_heap_pages(), returning);
        let allocator =
            memory_ort::GovernedOrtAllocator::cpu(env, binding, Some(tenant.account.clone()), config).unwrap();
        let mut session = env.commit_from_file(&allocator, env.session_builder().unwrap(), &assets.ocr_rec).unwrap();
        let committed = session.stats();
        assert_eq!(committed.trims, 0, "a commit does not trim the cache: {committed:?}");
        for (seed, width) in widths.into_iter().enumerate() {
            recognize_text(&mut session, ocr_lines(seed as u64, 1, width), 1, width).unwrap();
        }
        // A repeated shape: no trim.
        recognize_text(&mut session, ocr_lines(7, 1, 320), 1, 320).unwrap();
        let (mine, all) = (session.stats(), allocator.stats());
        assert_eq!(mine.trims, widths.len() as u64, "one trim per new shape, none for a repeated one: {mine:?}");
        assert_eq!(all.trims, mine.trims, "the adapter counts the session's trims: {all:?}");
        assert_eq!(all.heap_returns, mine.heap_returns, "{all:?}");
        let pairs = all.key_values();
        assert!(pairs.contains(&("NumTrims", all.trims)) && pairs.contains(&("NumHeapReturns", all.heap_returns)));
        if !returning {
            assert_eq!(mine.heap_returns, 0, "configured off: the heap keeps its pages: {mine:?}");
        } else if cfg!(all(target_os = "linux", target_env = "gnu")) {
            // Loading the model, and the first run of each shape, free hundreds of ONNX
            // Runtime's buffers.
            assert!(committed.heap_returns >= 1, "glibc handed free pages back after the commit: {committed:?}");
            assert!(mine.heap_returns > committed.heap_returns, "and after a new shape's trim: {mine:?}");
        }
    }
}
