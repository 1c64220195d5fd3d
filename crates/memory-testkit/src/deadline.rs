//! A deadline for tests of protocols that could deadlock.

use std::sync::mpsc;
use std::time::Duration;

/// How long [`within`] waits.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Runs `f` on a thread of its own and returns its result; a panic in `f` goes on in
/// the caller. When `f` has not finished within [`DEADLINE`] the caller panics, naming
/// `what` (a deadlock fails the test instead of hanging it; the stuck thread is left).
pub fn within<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    let answer = rx.recv_timeout(DEADLINE);
    if answer.is_ok() {
        let _ = worker.join();
    }
    match answer {
        Ok(Ok(value)) => value,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("{what} did not finish within {} s (deadlock?)", DEADLINE.as_secs()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_the_result_and_passes_a_panic_on() {
        assert_eq!(within("an addition", || 2 + 2), 4);
        let panicked = std::panic::catch_unwind(|| within("a panic", || panic!("inner")));
        let message = panicked.unwrap_err();
        assert_eq!(message.downcast_ref::<&str>(), Some(&"inner"));
    }
}
