//! Recording the `tracing` events a piece of code emits, so that tests can check that
//! a failure nobody can return (a destructor's) is at least reported.

use std::fmt::{self, Write as _};
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// One recorded event: its level and its fields as `name=value` pairs.
#[derive(Clone, Debug)]
pub(crate) struct Logged {
    pub(crate) level: Level,
    pub(crate) text: String,
}

/// The events recorded while a closure ran.
#[derive(Clone, Debug, Default)]
pub(crate) struct Logs(Vec<Logged>);

impl Logs {
    /// Whether an event at `level` or more severe mentions every word of `words`.
    pub(crate) fn has(&self, level: Level, words: &[&str]) -> bool {
        // `Level` orders by verbosity: ERROR < WARN < INFO.
        self.0.iter().any(|event| event.level <= level && words.iter().all(|word| event.text.contains(word)))
    }

    /// The events, for assertion messages.
    pub(crate) fn all(&self) -> &[Logged] {
        &self.0
    }
}

/// Runs `f` with a subscriber that records every event on this thread.
pub(crate) fn capture<R>(f: impl FnOnce() -> R) -> (R, Logs) {
    let recorder = Recorder::default();
    let events = Arc::clone(&recorder.events);
    let result = tracing::subscriber::with_default(recorder, f);
    let logs = Logs(events.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone());
    (result, logs)
}

#[derive(Default)]
struct Recorder {
    events: Arc<Mutex<Vec<Logged>>>,
}

struct Fields<'a>(&'a mut String);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let _ = write!(self.0, "{}={value:?} ", field.name());
    }
}

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut text = String::new();
        event.record(&mut Fields(&mut text));
        let logged = Logged { level: *event.metadata().level(), text };
        self.events.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(logged);
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}
