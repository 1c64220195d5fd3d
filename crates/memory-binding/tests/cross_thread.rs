//! Bindings used the way runtimes use them: made once on a setup thread and used by a
//! pool of workers (cloned or shared by reference), blocks released or dropped on
//! another thread than the one that allocated them, threads that exit while their
//! allocations live on, and every handle, binding and the registry going away.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use common::{Caps, register, request};
use memory_api::{AllocationRequest, DeviceAllocator, DeviceKey};
use memory_binding::{AllocationState, BindingRegistry, BoundAllocation, MemoryBinding};

const HOST: DeviceKey = DeviceKey::HOST;
const GPU0: DeviceKey = DeviceKey::device(0);

fn live(registry: &BindingRegistry, binding: &MemoryBinding) -> (usize, usize, usize) {
    let snapshot = registry.snapshot(&binding.identity().mechanism()).unwrap();
    (snapshot.live_allocations, snapshot.quarantined.len(), snapshot.in_flight)
}

#[test]
fn a_binding_made_on_one_thread_serves_workers_and_their_blocks_release_on_any_thread() {
    let registry = BindingRegistry::new();
    let caps = Arc::new(Caps::new(HOST));
    let (_, _, mechanism) = register(&registry, caps.clone());
    // Made at "session setup", used by two workers by reference and by two through
    // clones.
    let binding = registry.bind_registered(&mechanism).unwrap();
    let start = Barrier::new(4);
    let blocks: Vec<BoundAllocation> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..4)
            .map(|worker| {
                let (binding, clone, start) = (&binding, binding.clone(), &start);
                scope.spawn(move || {
                    let using = if worker % 2 == 0 { binding } else { &clone };
                    start.wait();
                    (0..100).map(|_| using.allocate(request(256)).unwrap()).collect::<Vec<_>>()
                })
            })
            .collect();
        workers.into_iter().flat_map(|worker| worker.join().unwrap()).collect()
    });
    assert_eq!(live(&registry, &binding), (400, 0, 0));
    let identities: Vec<_> = blocks.iter().map(|block| block.identity().unwrap()).collect();
    let mut generations: Vec<_> = identities.iter().map(|identity| identity.generation()).collect();
    generations.sort();
    generations.dedup();
    assert_eq!(generations.len(), 400, "every allocation has its own generation");
    assert!(identities.iter().all(|identity| registry.allocation_state(identity) == AllocationState::Live));

    // Released on this thread and on two others, none of which allocated them.
    let (here, there): (Vec<_>, Vec<_>) = blocks.into_iter().enumerate().partition(|(index, _)| index % 3 == 0);
    std::thread::scope(|scope| {
        let binding = &binding;
        let chunks: Vec<Vec<BoundAllocation>> = {
            let mut there: Vec<_> = there.into_iter().map(|(_, block)| block).collect();
            let half = there.split_off(there.len() / 2);
            vec![there, half]
        };
        for chunk in chunks {
            scope.spawn(move || {
                for block in chunk {
                    binding.release(block).unwrap();
                }
            });
        }
        for (_, block) in here {
            binding.release(block).unwrap();
        }
    });
    assert_eq!(live(&registry, &binding), (0, 0, 0));
    assert_eq!(caps.releases.load(Ordering::SeqCst), 400);
    assert!(identities.iter().all(|identity| registry.allocation_state(identity) == AllocationState::Gone));
}

#[test]
fn slots_freed_by_other_threads_are_reused_by_their_owner_and_old_handles_stay_stale() {
    let registry = BindingRegistry::new();
    let caps = Arc::new(Caps::new(HOST));
    let (_, _, mechanism) = register(&registry, caps.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    // Rounds of: this thread allocates, a worker releases (remote frees), this thread
    // allocates again (taking the remote stack). Identities never validate twice.
    let mut seen = Vec::new();
    for _ in 0..20 {
        let blocks: Vec<_> = (0..50).map(|_| binding.allocate(request(64)).unwrap()).collect();
        seen.extend(blocks.iter().map(|block| block.identity().unwrap()));
        std::thread::scope(|scope| {
            let binding = &binding;
            scope.spawn(move || {
                for block in blocks {
                    binding.release(block).unwrap();
                }
            });
        });
    }
    assert_eq!(live(&registry, &binding), (0, 0, 0));
    assert!(seen.iter().all(|identity| registry.allocation_state(identity) == AllocationState::Gone));
    let fresh = binding.allocate(request(64)).unwrap();
    assert_eq!(registry.allocation_state(&fresh.identity().unwrap()), AllocationState::Live);
    assert!(!seen.contains(&fresh.identity().unwrap()));
    binding.release(fresh).unwrap();
    assert_eq!(caps.releases.load(Ordering::SeqCst), 1001);
}

#[test]
fn dropping_a_host_allocation_on_another_thread_releases_it_and_a_device_one_is_quarantined() {
    let registry = BindingRegistry::new();
    let host = Arc::new(Caps::new(HOST));
    let gpu = Arc::new(Caps::new(GPU0));
    let (_, _, host_mechanism) = register(&registry, host.clone());
    let (_, _, gpu_mechanism) = register(&registry, gpu.clone());
    let host_binding = registry.bind_registered(&host_mechanism).unwrap();
    let gpu_binding = registry.bind_registered(&gpu_mechanism).unwrap();
    let host_blocks: Vec<_> = (0..10).map(|_| host_binding.allocate(request(64)).unwrap()).collect();
    let gpu_blocks: Vec<_> = (0..10).map(|_| gpu_binding.allocate(request(64)).unwrap()).collect();
    std::thread::spawn(move || {
        drop(host_blocks);
        drop(gpu_blocks);
    })
    .join()
    .unwrap();
    assert_eq!(host.releases.load(Ordering::SeqCst), 10);
    assert_eq!(live(&registry, &host_binding), (0, 0, 0));
    // Device memory dropped without a release path may still be in use: quarantined.
    assert_eq!(gpu.releases.load(Ordering::SeqCst), 0);
    assert_eq!(live(&registry, &gpu_binding), (0, 10, 0));
}

#[test]
fn a_refused_release_on_another_thread_hands_the_block_back_and_it_stays_releasable() {
    struct RefusesOnce(Caps, AtomicUsize);
    impl DeviceAllocator for RefusesOnce {
        fn device(&self) -> DeviceKey {
            HOST
        }
        fn name(&self) -> &str {
            "refuses-once"
        }
        fn allocate(&self, request: &AllocationRequest) -> Result<memory_api::RawAllocation, memory_api::AllocError> {
            self.0.allocate(request)
        }
        fn release(&self, allocation: memory_api::RawAllocation) -> memory_api::ReleaseOutcome {
            if self.1.fetch_add(1, Ordering::SeqCst) == 0 {
                let busy =
                    memory_api::BackendError { backend: "test", operation: "release", code: 1, detail: "busy".into() };
                return memory_api::ReleaseOutcome::failed(allocation, memory_api::ReleaseError::Backend(busy));
            }
            self.0.release(allocation)
        }
    }
    let registry = BindingRegistry::new();
    let (_, _, mechanism) = register(&registry, Arc::new(RefusesOnce(Caps::new(HOST), AtomicUsize::new(0))));
    let binding = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(request(64)).unwrap();
    let identity = block.identity().unwrap();
    let back = std::thread::scope(|scope| {
        let binding = &binding;
        scope.spawn(move || binding.release(block).unwrap_err().handle).join().unwrap()
    });
    assert_eq!(back.identity(), Some(identity));
    assert_eq!(registry.allocation_state(&identity), AllocationState::Live);
    assert_eq!(live(&registry, &binding), (1, 0, 0));
    binding.release(back).unwrap();
    assert_eq!(registry.allocation_state(&identity), AllocationState::Gone);
}

#[test]
fn termination_retires_the_records_of_every_thread() {
    let registry = BindingRegistry::new();
    let caps = Arc::new(Caps::new(GPU0));
    let (context, _, mechanism) = register(&registry, caps.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let blocks: Vec<BoundAllocation> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let binding = &binding;
                scope.spawn(move || (0..7).map(|_| binding.allocate(request(128)).unwrap()).collect::<Vec<_>>())
            })
            .collect();
        workers.into_iter().flat_map(|worker| worker.join().unwrap()).collect()
    });
    registry.invalidate_device(GPU0, "xid 79");
    let report = registry.confirm_context_terminated(&context).unwrap();
    assert_eq!((report.lost_allocations, report.lost_bytes), (21, 21 * 128));
    assert_eq!(caps.forgotten.load(Ordering::SeqCst), 21);
    // Dropping the handles afterwards, on any thread, makes no callback.
    std::thread::spawn(move || drop(blocks)).join().unwrap();
    assert_eq!(caps.releases.load(Ordering::SeqCst), 0);
    assert_eq!(live(&registry, &binding), (0, 0, 0));
}

#[test]
fn a_thread_that_exits_leaves_its_allocations_valid_and_its_pin_to_the_next_thread() {
    let registry = BindingRegistry::new();
    let caps = Arc::new(Caps::new(HOST));
    let (_, _, mechanism) = register(&registry, caps.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let mut kept = Vec::new();
    for _ in 0..10 {
        // Each short-lived worker allocates, hands its blocks back and exits; the next
        // one may receive its thread index, and with it the pin.
        let blocks = std::thread::scope(|scope| {
            let binding = &binding;
            scope
                .spawn(move || (0..10).map(|_| binding.allocate(request(64)).unwrap()).collect::<Vec<_>>())
                .join()
                .unwrap()
        });
        kept.extend(blocks);
        // Release half of what is kept, on this thread.
        let half = kept.len() / 2;
        for block in kept.drain(..half) {
            binding.release(block).unwrap();
        }
    }
    assert_eq!(live(&registry, &binding).0, kept.len());
    for block in kept {
        binding.release(block).unwrap();
    }
    assert_eq!(live(&registry, &binding), (0, 0, 0));
    assert_eq!(caps.releases.load(Ordering::SeqCst), 100);
}

#[test]
fn an_allocation_dropped_by_a_thread_local_destructor_is_released() {
    thread_local!(static HELD: std::cell::RefCell<Vec<BoundAllocation>> = const { std::cell::RefCell::new(Vec::new()) });
    let registry = BindingRegistry::new();
    let caps = Arc::new(Caps::new(HOST));
    let (_, _, mechanism) = register(&registry, caps.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let worker = binding.clone();
    // Not a scoped thread: `join` here waits for the thread to end, TLS destructors
    // included.
    std::thread::spawn(move || {
        let blocks: Vec<_> = (0..5).map(|_| worker.allocate(request(64)).unwrap()).collect();
        HELD.with_borrow_mut(|held| held.extend(blocks));
        // The thread exits: its TLS destructors drop the blocks, possibly after its
        // thread index was freed.
    })
    .join()
    .unwrap();
    assert_eq!(caps.releases.load(Ordering::SeqCst), 5);
    assert_eq!(live(&registry, &binding), (0, 0, 0));
}

/// Binds, allocates and releases three times from a thread-local destructor.
struct BindOnExit(BindingRegistry, Arc<AtomicUsize>);

impl Drop for BindOnExit {
    fn drop(&mut self) {
        for _ in 0..3 {
            let binding = self.0.bind(HOST).expect("bind from a TLS destructor");
            drop(binding.allocate(request(64)).expect("allocate from a TLS destructor"));
            self.1.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[test]
fn a_thread_local_destructor_binds_after_the_bind_cache_and_thread_index_are_gone() {
    thread_local!(static ON_EXIT: std::cell::RefCell<Option<BindOnExit>> = const { std::cell::RefCell::new(None) });
    let registry = BindingRegistry::new();
    let caps = Arc::new(Caps::new(HOST));
    let (_, _, mechanism) = register(&registry, caps.clone());
    registry.select(&mechanism).unwrap();
    let done = Arc::new(AtomicUsize::new(0));
    let (worker, counted) = (registry.clone(), done.clone());
    std::thread::spawn(move || {
        // Registered before the first bind, so its destructor runs after the bind
        // cache's guard and the thread-index guard (destructors run in reverse order
        // of registration): it binds through neither.
        ON_EXIT.with_borrow_mut(|slot| *slot = Some(BindOnExit(worker.clone(), counted)));
        for _ in 0..3 {
            drop(worker.bind(HOST).unwrap().allocate(request(64)).unwrap());
        }
    })
    .join()
    .unwrap();
    assert_eq!(done.load(Ordering::SeqCst), 3, "every bind from the destructor succeeded");
    assert_eq!(caps.releases.load(Ordering::SeqCst), 6);
    // Nothing the exited thread cached keeps the mechanism: it retires and goes.
    registry.retire(&mechanism).unwrap();
    registry.remove(&mechanism).unwrap();
}

/// An allocator whose drop is observable.
struct Watched(Caps, Arc<AtomicUsize>);

impl Drop for Watched {
    fn drop(&mut self) {
        self.1.fetch_add(1, Ordering::SeqCst);
    }
}

impl DeviceAllocator for Watched {
    fn device(&self) -> DeviceKey {
        self.0.device()
    }
    fn name(&self) -> &str {
        "watched"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<memory_api::RawAllocation, memory_api::AllocError> {
        self.0.allocate(request)
    }
    fn release(&self, allocation: memory_api::RawAllocation) -> memory_api::ReleaseOutcome {
        self.0.release(allocation)
    }
}

#[test]
fn the_allocator_is_dropped_once_handles_bindings_and_the_registry_are_gone() {
    // How the last reference goes away: the last handle dropped on the thread that
    // allocated it (its owner takes the unit back after orphaning) or on another
    // thread; the registry dropped first or the bindings first.
    for case in 0..4 {
        let dropped = Arc::new(AtomicUsize::new(0));
        let registry = BindingRegistry::new();
        let (_, _, mechanism) = register(&registry, Arc::new(Watched(Caps::new(HOST), dropped.clone())));
        let binding = registry.bind_registered(&mechanism).unwrap();
        // Pins on three threads, each with live allocations, some released remotely.
        let mut blocks: Vec<BoundAllocation> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..2)
                .map(|_| {
                    let binding = &binding;
                    scope.spawn(move || (0..5).map(|_| binding.allocate(request(64)).unwrap()).collect::<Vec<_>>())
                })
                .collect();
            workers.into_iter().flat_map(|worker| worker.join().unwrap()).collect()
        });
        blocks.extend((0..5).map(|_| binding.allocate(request(64)).unwrap()));
        // Allocated on this thread.
        let last = blocks.pop().unwrap();
        for block in blocks.drain(..7) {
            binding.release(block).unwrap();
        }
        let remaining = std::mem::take(&mut blocks);
        if case % 2 == 0 {
            drop(registry);
            drop(binding);
        } else {
            drop(binding);
            drop(registry);
        }
        assert_eq!(dropped.load(Ordering::SeqCst), 0, "case {case}: live handles keep the allocator");
        // No binding left: dropped (host policy: released at once), on another thread.
        std::thread::spawn(move || drop(remaining)).join().unwrap();
        assert_eq!(dropped.load(Ordering::SeqCst), 0, "case {case}: one handle is still live");
        if case < 2 {
            drop(last);
        } else {
            std::thread::spawn(move || drop(last)).join().unwrap();
        }
        assert_eq!(dropped.load(Ordering::SeqCst), 1, "case {case}: the allocator outlived everything");
    }
    // No allocation ever made: the allocator goes with the registry and the binding.
    let dropped = Arc::new(AtomicUsize::new(0));
    let registry = BindingRegistry::new();
    let (_, _, mechanism) = register(&registry, Arc::new(Watched(Caps::new(HOST), dropped.clone())));
    let binding = registry.bind_registered(&mechanism).unwrap();
    std::thread::spawn({
        let binding = binding.clone();
        move || drop(binding.allocate(request(64)).unwrap())
    })
    .join()
    .unwrap();
    drop((registry, binding));
    assert_eq!(dropped.load(Ordering::SeqCst), 1);
}

#[test]
fn removal_after_cross_thread_use_drops_the_allocator_once_bindings_are_gone() {
    let dropped = Arc::new(AtomicUsize::new(0));
    let registry = BindingRegistry::new();
    let (_, _, mechanism) = register(&registry, Arc::new(Watched(Caps::new(HOST), dropped.clone())));
    let binding = registry.bind_registered(&mechanism).unwrap();
    let blocks: Vec<_> = std::thread::scope(|scope| {
        let binding = &binding;
        scope.spawn(move || (0..10).map(|_| binding.allocate(request(64)).unwrap()).collect::<Vec<_>>()).join().unwrap()
    });
    // Bind on other threads too (their anchors and bind caches).
    std::thread::scope(|scope| {
        scope.spawn(|| drop(registry.bind(HOST).unwrap()));
    });
    registry.retire(&mechanism).unwrap();
    assert!(registry.remove(&mechanism).is_err(), "live allocations");
    for block in blocks {
        binding.release(block).unwrap();
    }
    registry.remove(&mechanism).unwrap();
    assert_eq!(dropped.load(Ordering::SeqCst), 0, "the binding still pins it");
    drop(binding);
    assert_eq!(dropped.load(Ordering::SeqCst), 1, "no cache or pin keeps a removed mechanism alive");
    assert!(registry.bind(HOST).is_err());
}

#[test]
fn bindings_cloned_on_any_thread_outlive_removal_and_the_last_one_drops_the_allocator() {
    // The maker's anchor counts its bindings in units: clones made on the maker thread
    // take plain units, clones made elsewhere take shared ones, and either kind may be
    // dropped anywhere, before or after the mechanism is removed (its anchors orphaned).
    for case in 0..4 {
        let dropped = Arc::new(AtomicUsize::new(0));
        let registry = BindingRegistry::new();
        let (_, _, mechanism) = register(&registry, Arc::new(Watched(Caps::new(HOST), dropped.clone())));
        registry.select(&mechanism).unwrap();
        // Through the bind cache (the second bind hits it).
        let made_here = registry.bind(HOST).unwrap();
        let cached = registry.bind(HOST).unwrap();
        assert_eq!(cached.identity().mechanism(), mechanism);
        let clone_here = made_here.clone();
        let (clone_there, clone_there_kept) =
            std::thread::scope(|scope| scope.spawn(|| (made_here.clone(), made_here.clone())).join().unwrap());
        // A clone dropped on another thread before removal, one after.
        std::thread::spawn(move || drop(clone_there)).join().unwrap();
        drop(cached);
        if case % 2 == 0 {
            drop(made_here.allocate(request(64)).unwrap());
        }
        registry.retire(&mechanism).unwrap();
        registry.remove(&mechanism).unwrap();
        // This thread's cache still names the removed mechanism: nothing binds through it.
        assert!(registry.bind(HOST).is_err(), "case {case}: bound through a removed mechanism");
        assert_eq!(dropped.load(Ordering::SeqCst), 0, "case {case}: live bindings pin the allocator");
        match case {
            0 | 1 => {
                drop(made_here);
                drop(clone_here);
                assert_eq!(dropped.load(Ordering::SeqCst), 0, "case {case}: a clone on a worker is still live");
                std::thread::spawn(move || drop(clone_there_kept)).join().unwrap();
            }
            _ => {
                std::thread::spawn(move || drop(clone_there_kept)).join().unwrap();
                drop(made_here);
                assert_eq!(dropped.load(Ordering::SeqCst), 0, "case {case}: a clone here is still live");
                drop(clone_here);
            }
        }
        assert_eq!(dropped.load(Ordering::SeqCst), 1, "case {case}: the last binding did not drop the allocator");
        // A new mechanism on the device binds, cache or not.
        let (_, _, next) = register(&registry, Arc::new(Caps::new(HOST)));
        registry.select(&next).unwrap();
        assert_eq!(registry.bind(HOST).unwrap().identity().mechanism(), next);
    }
}

#[test]
fn allocations_outlive_their_dropped_binding_and_release_by_handle_on_other_threads() {
    let registry = BindingRegistry::new();
    let recorder = Arc::new(memory_testkit::RecordingAllocator::on_device(GPU0));
    let (_, _, mechanism) = register(&registry, recorder.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let blocks: Vec<BoundAllocation> = (0..200).map(|_| binding.allocate(request(256)).unwrap()).collect();
    let identities: Vec<_> = blocks.iter().map(|block| block.identity().unwrap()).collect();
    drop(binding);

    // Two threads that never saw the binding: one moves handles into `release`, the
    // other releases them where they lie in its own table.
    let (moved, placed): (Vec<_>, Vec<_>) = blocks.into_iter().enumerate().partition(|(index, _)| index % 2 == 0);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            for (_, block) in moved {
                block.release().unwrap();
            }
        });
        scope.spawn(move || {
            let mut table: Vec<Option<BoundAllocation>> = placed.into_iter().map(|(_, block)| Some(block)).collect();
            for place in &mut table {
                BoundAllocation::release_in_place(place).unwrap();
            }
            assert!(table.iter().all(Option::is_none));
        });
    });
    assert_eq!(recorder.calls(memory_testkit::Callback::Release), 200);
    assert!(identities.iter().all(|identity| registry.allocation_state(identity) == AllocationState::Gone));
    let snapshot = registry.snapshot(&mechanism).unwrap();
    assert_eq!((snapshot.live_allocations, snapshot.quarantined.len(), snapshot.in_flight), (0, 0, 0));
    registry.retire(&mechanism).unwrap();
    registry.remove(&mechanism).unwrap();
}
