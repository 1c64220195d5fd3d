//! Every lifecycle transition emits a tracing event (warn on quarantine, error on
//! device loss), and the hot path emits nothing above trace level.

mod common;

use std::sync::Arc;

use common::{Caps, Collector, bind, has, register, request};
use memory_api::DeviceKey;
use memory_binding::BindingRegistry;
use tracing::Level;

#[test]
fn lifecycle_transitions_are_traced_and_the_hot_path_stays_at_trace() {
    let collector = Collector::default();
    let _default = tracing::subscriber::set_default(collector.clone());
    let registry = BindingRegistry::new();
    let gpu = DeviceKey::device(0);

    let (context, authority, first) = register(&registry, Arc::new(Caps::new(gpu)));
    let (_, _, second) = register(&registry, Arc::new(Caps::new(gpu)));
    let events = collector.take();
    assert!(has(&events, Level::INFO, "provider context registered"));
    assert!(has(&events, Level::INFO, "authority registered"));
    assert!(has(&events, Level::INFO, "mechanism registered"));

    let binding = bind(&registry, &first);
    let block = binding.allocate(request(64)).unwrap();
    binding.release(block).unwrap();
    let hot = collector.take();
    assert!(hot.iter().all(|(level, _)| *level == Level::TRACE), "hot path above trace: {hot:?}");
    assert!(!hot.is_empty(), "the hot path still traces at trace level");

    registry.select(&second).unwrap();
    assert!(has(&collector.take(), Level::INFO, "mechanism selected"));
    registry.retire(&second).unwrap();
    assert!(has(&collector.take(), Level::INFO, "mechanism retired"));

    drop(binding.allocate(request(64)).unwrap()); // device memory dropped: quarantined
    assert!(has(&collector.take(), Level::WARN, "allocation quarantined"));

    registry.invalidate_device(gpu, "test loss");
    assert!(has(&collector.take(), Level::ERROR, "device lost"));
    registry.confirm_context_terminated(&context).unwrap();
    assert!(has(&collector.take(), Level::INFO, "provider context terminated"));
    registry.remove(&first).unwrap();
    assert!(has(&collector.take(), Level::INFO, "mechanism removed"));
    registry.remove_provider_context(&context).unwrap();
    assert!(has(&collector.take(), Level::INFO, "provider context removed"));
    // The second mechanism (retired before the loss) went device-lost too.
    let second_context = registry.snapshot(&second).unwrap().context;
    registry.confirm_context_terminated(&second_context).unwrap();
    registry.remove(&second).unwrap();
    let _ = collector.take();
    let snapshot = registry.snapshots();
    assert!(snapshot.mechanisms.is_empty());
    assert!(snapshot.authorities.iter().any(|a| a.identity == authority));
    registry.remove_authority(&authority).unwrap();
    assert!(has(&collector.take(), Level::INFO, "authority removed"));
}
