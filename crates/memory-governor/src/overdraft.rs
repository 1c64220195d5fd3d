//! The overdraft: memory an adapter serves *past* a refusal, booked apart from charges.
//!
//! Some clients cannot take a refusal at the moment it happens. ONNX Runtime's tensors
//! do not check the pointer an allocator returns, so an adapter that is refused in the
//! middle of a run must hand out *something* while it stops the run at the next kernel
//! boundary. That memory is not a charge (the quota said no), but it is memory the
//! process holds, so it is booked here: per device (with a limit that bounds it, the
//! *overdraft limit*) and per account, live and peak, in snapshots and metrics.
//!
//! A draw is admitted against the device's overdraft limit only (quotas and the device
//! limit were what refused the request in the first place); it is an RAII
//! [`OverdraftDraw`] that gives the bytes back exactly once when dropped. Draws are rare
//! (only after a refusal) and cold: one compare-and-swap on the device's figure, one
//! add on the account's.

use std::fmt;

use crate::sync::{Arc, AtomicU64, Ordering};

use memory_api::{AuthorityIdentity, DeviceKey};
use serde::Serialize;

/// The overdraft limit of a device unless configured otherwise
/// ([`GovernorConfig::with_overdraft_limit`](crate::GovernorConfig::with_overdraft_limit),
/// [`Governor::set_overdraft_limit`](crate::Governor::set_overdraft_limit)): 64 MiB.
pub const DEFAULT_OVERDRAFT_LIMIT: u64 = 64 << 20;

/// One level's overdraft figures (a device's or an account's).
#[derive(Debug)]
pub(crate) struct OverdraftBooks {
    limit: AtomicU64,
    current: AtomicU64,
    peak: AtomicU64,
    draws: AtomicU64,
    refused: AtomicU64,
}

impl OverdraftBooks {
    pub(crate) fn new(limit: u64) -> OverdraftBooks {
        OverdraftBooks {
            limit: AtomicU64::new(limit),
            current: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            draws: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    pub(crate) fn set_limit(&self, bytes: u64) -> u64 {
        self.limit.swap(bytes, Ordering::AcqRel)
    }

    /// Admits `bytes` under the limit, atomically: concurrent draws never pass it.
    fn admit(&self, bytes: u64) -> Result<(), u64> {
        let limit = self.limit.load(Ordering::Acquire);
        let admitted = self.current.fetch_update(Ordering::AcqRel, Ordering::Acquire, |current| {
            current.checked_add(bytes).filter(|&total| total <= limit)
        });
        match admitted {
            Ok(before) => {
                self.record(before + bytes);
                Ok(())
            }
            Err(current) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                Err(current)
            }
        }
    }

    /// Adds `bytes` with no limit (an account's figure: the device's limit bounds it).
    fn add(&self, bytes: u64) {
        let now = self.current.fetch_add(bytes, Ordering::AcqRel).saturating_add(bytes);
        self.record(now);
    }

    fn record(&self, now: u64) {
        self.draws.fetch_add(1, Ordering::Relaxed);
        self.peak.fetch_max(now, Ordering::AcqRel);
    }

    fn give_back(&self, bytes: u64) {
        self.current.fetch_sub(bytes, Ordering::AcqRel);
    }

    pub(crate) fn snapshot(&self, limited: bool) -> OverdraftSnapshot {
        OverdraftSnapshot {
            limit: limited.then(|| self.limit.load(Ordering::Acquire)),
            current: self.current.load(Ordering::Acquire),
            peak: self.peak.load(Ordering::Acquire),
            draws: self.draws.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }
}

/// What a device or an account holds past refusals (see the module docs of
/// [`Account::draw_overdraft`](crate::Account::draw_overdraft)).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct OverdraftSnapshot {
    /// The device's overdraft limit; `None` for an account (the device's bounds it).
    pub limit: Option<u64>,
    /// Bytes drawn and not given back.
    pub current: u64,
    /// High-water mark of `current` (exact: every draw writes it).
    pub peak: u64,
    /// Draws admitted.
    pub draws: u64,
    /// Draws refused at the limit (counted on the device only).
    pub refused: u64,
}

/// A draw on the overdraft, given back exactly once when dropped.
#[must_use = "dropping the draw gives its bytes back at once"]
pub struct OverdraftDraw {
    device: Arc<OverdraftBooks>,
    account: Arc<OverdraftBooks>,
    bytes: u64,
}

impl OverdraftDraw {
    /// The bytes drawn.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl fmt::Debug for OverdraftDraw {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OverdraftDraw").field("bytes", &self.bytes).finish()
    }
}

impl Drop for OverdraftDraw {
    fn drop(&mut self) {
        self.account.give_back(self.bytes);
        self.device.give_back(self.bytes);
    }
}

/// A draw the device's overdraft limit could not hold.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "an overdraft of {requested} bytes for authority {authority} on {device} would pass the device's overdraft limit \
     of {limit} bytes ({current} bytes are drawn now); raise it with Governor::set_overdraft_limit or \
     GovernorConfig::with_overdraft_limit, or give the workload a quota its runs fit in"
)]
#[non_exhaustive]
pub struct OverdraftRefused {
    /// The device.
    pub device: DeviceKey,
    /// The account's authority.
    pub authority: AuthorityIdentity,
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes drawn on the device at the time.
    pub current: u64,
    /// The device's overdraft limit.
    pub limit: u64,
}

/// Draws `bytes` for `authority` on `device`: admitted against `device_books`' limit,
/// added to `account_books`.
pub(crate) fn draw(
    device: DeviceKey,
    authority: AuthorityIdentity,
    device_books: &Arc<OverdraftBooks>,
    account_books: &Arc<OverdraftBooks>,
    bytes: u64,
) -> Result<OverdraftDraw, OverdraftRefused> {
    device_books.admit(bytes).map_err(|current| OverdraftRefused {
        device,
        authority,
        requested: bytes,
        current,
        limit: device_books.limit.load(Ordering::Acquire),
    })?;
    account_books.add(bytes);
    Ok(OverdraftDraw { device: Arc::clone(device_books), account: Arc::clone(account_books), bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_past_the_limit_are_refused_and_counted_and_a_dropped_draw_gives_back_once() {
        let device = Arc::new(OverdraftBooks::new(100));
        let account = Arc::new(OverdraftBooks::new(u64::MAX));
        let registry = memory_binding::BindingRegistry::new();
        let who = (DeviceKey::HOST, registry.register_authority(DeviceKey::HOST, Arc::new(())).unwrap());
        let first = draw(who.0, who.1, &device, &account, 60).unwrap();
        assert_eq!(first.bytes(), 60);
        assert_eq!(format!("{first:?}"), "OverdraftDraw { bytes: 60 }");
        let refused = draw(who.0, who.1, &device, &account, 41).unwrap_err();
        assert_eq!((refused.requested, refused.current, refused.limit), (41, 60, 100));
        assert!(refused.to_string().contains("set_overdraft_limit"), "{refused}");
        let second = draw(who.0, who.1, &device, &account, 40).unwrap();
        assert_eq!(device.snapshot(true).current, 100);
        drop(first);
        drop(second);
        let snapshot = device.snapshot(true);
        assert_eq!((snapshot.current, snapshot.peak, snapshot.draws, snapshot.refused), (0, 100, 2, 1));
        assert_eq!(snapshot.limit, Some(100));
        let account = account.snapshot(false);
        assert_eq!((account.current, account.peak, account.draws, account.limit), (0, 100, 2, None));
    }

    #[test]
    fn the_default_limit_is_the_documented_64_mib() {
        assert_eq!(DEFAULT_OVERDRAFT_LIMIT, 64 * 1024 * 1024);
    }
}
