//! Every lifecycle transition emits a tracing event (warn on quarantine, error on
//! device loss), and the hot path emits nothing above trace level (and nothing at all
//! without the `hot-path-trace` feature).

mod common;

use std::sync::Arc;

use common::{Caps, Collector, bind, has, register, request};
use memory_api::DeviceKey;
use memory_binding::BindingRegistry;
use tracing::Level;

#[test]
fn lifecycle_transitions_are_traced_and_the_hot_path_stays_at_trace() {
    let collector = Collector::default();
    let _default = collector.install();
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
    // Per-call events exist only with the `hot-path-trace` feature (the `features`
    // step of `cargo xtask test` runs this file with it).
    if cfg!(feature = "hot-path-trace") {
        for step in ["bind", "allocate", "release"] {
            assert!(has(&hot, Level::TRACE, step), "no {step} event with hot-path-trace: {hot:?}");
        }
    } else {
        assert!(hot.is_empty(), "per-call events without the hot-path-trace feature: {hot:?}");
    }

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

/// One opened span: its name and its fields as text.
type OpenedSpan = (String, Vec<(String, String)>);

/// Records the spans opened.
#[derive(Clone, Default)]
struct SpanCollector(Arc<std::sync::Mutex<Vec<OpenedSpan>>>);

struct Fields(Vec<(String, String)>);
impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.push((field.name().to_owned(), value.to_owned()));
    }
}

impl tracing::Subscriber for SpanCollector {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let mut fields = Fields(Vec::new());
        span.record(&mut fields);
        let mut spans = self.0.lock().unwrap();
        spans.push((span.metadata().name().to_owned(), fields.0));
        tracing::span::Id::from_u64(spans.len() as u64)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn cold_path_operations_open_spans_named_for_them_with_identities_as_fields() {
    let spans = SpanCollector::default();
    let registry = BindingRegistry::new();
    let gpu = DeviceKey::device(0);
    let (context, mechanism) = tracing::subscriber::with_default(spans.clone(), || {
        let (context, _, mechanism) = register(&registry, Arc::new(Caps::new(gpu)));
        registry.select(&mechanism).unwrap();
        registry.invalidate_device(gpu, "Xid 79");
        registry.confirm_context_terminated(&context).unwrap();
        (context, mechanism)
    });
    let spans = spans.0.lock().unwrap().clone();
    let field = |name: &str, key: &str| -> Option<String> {
        spans.iter().find(|(n, _)| n == name)?.1.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    };
    assert_eq!(field("register_provider_context", "device"), Some(gpu.to_string()), "{spans:?}");
    assert_eq!(field("register_allocator", "context"), Some(context.to_string()), "{spans:?}");
    assert_eq!(field("select", "mechanism"), Some(mechanism.to_string()), "{spans:?}");
    assert_eq!(field("invalidate_device", "device"), Some(gpu.to_string()), "{spans:?}");
    assert_eq!(field("invalidate_device", "reason"), Some("Xid 79".to_owned()), "{spans:?}");
    assert_eq!(field("confirm_context_terminated", "context"), Some(context.to_string()), "{spans:?}");
}
