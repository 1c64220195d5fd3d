//! One device's books: its budget and reserves, the slots of every thread's credit on
//! it, its policy, its reclaim holders, its caches and its overdraft. Accounts draw from
//! it (`account.rs`); the [`Governor`](crate::Governor) keeps one per device key.

use memory_api::DeviceKey;

use crate::credit::{DeviceCounters, Slot, UNLIMITED};
use crate::error::HolderReport;
use crate::footprint::Caches;
use crate::overdraft::OverdraftBooks;
use crate::peaks::{Bound, Charges};
use crate::policy::{AdmissionPolicy, HardLimit};
use crate::reclaim::{ReclaimHolder, ReclaimRequest};
use crate::stats;
use crate::sync::{Arc, Mutex, RwLock, lock, read, write};
use crate::timeline::Timeline;

pub(crate) fn limit_of(raw: u64) -> Option<u64> {
    (raw != UNLIMITED).then_some(raw)
}

struct HolderEntry {
    serial: u64,
    order: u32,
    holder: Arc<dyn ReclaimHolder>,
}

/// One device's books: budget, reserves, the slots of every thread's credit on it,
/// its policy and its reclaim holders.
pub(crate) struct DeviceBooks {
    pub(crate) key: DeviceKey,
    pub(crate) counters: Arc<DeviceCounters>,
    pub(crate) slots: Mutex<Vec<Arc<Slot>>>,
    pub(crate) policy: RwLock<Arc<dyn AdmissionPolicy>>,
    holders: RwLock<Vec<HolderEntry>>,
    /// The peak of real charges on the device (over every authority).
    pub(crate) charges: Arc<Charges>,
    /// Serialises limit, reserve and policy changes (never held with another lock).
    pub(crate) changes: Mutex<()>,
    pub(crate) timeline: Arc<Timeline>,
    /// What adapters hold on the device past refusals.
    pub(crate) overdraft: Arc<OverdraftBooks>,
    /// The allocators governed on the device (their caches) and what cache backings hold.
    pub(crate) caches: Caches,
}

impl DeviceBooks {
    pub(crate) fn new(key: DeviceKey, timeline: Arc<Timeline>, overdraft_limit: u64) -> DeviceBooks {
        let counters = Arc::new(DeviceCounters::new(UNLIMITED));
        DeviceBooks {
            key,
            counters: Arc::clone(&counters),
            slots: Mutex::new(Vec::new()),
            policy: RwLock::new(Arc::new(HardLimit)),
            holders: RwLock::new(Vec::new()),
            charges: Arc::new(Charges::new(Bound::Device(Arc::clone(&counters)))),
            changes: Mutex::new(()),
            timeline,
            overdraft: Arc::new(OverdraftBooks::new(overdraft_limit)),
            caches: Caches::new(),
        }
    }

    pub(crate) fn key(&self) -> DeviceKey {
        self.key
    }

    /// The device limit (`u64::MAX` when none is set).
    pub(crate) fn limit(&self) -> u64 {
        self.counters.budget.limit()
    }

    /// Bytes charged to the device's tenants: what its roles drew, less the credit its
    /// threads hold (cold: reads every slot).
    pub(crate) fn allocated(&self) -> u64 {
        let drawn = stats::sum(self.counters.roles.iter().map(|role| role.used()));
        let credit = stats::sum(lock(&self.slots).iter().map(|slot| slot.credit()));
        drawn.saturating_sub(credit)
    }

    /// The policy, copied out of its lock (so that it can be called with no lock held).
    pub(crate) fn policy(&self) -> Arc<dyn AdmissionPolicy> {
        Arc::clone(&*read(&self.policy))
    }

    /// The holders in reclaim order, copied out of their lock.
    pub(crate) fn holders(&self) -> Vec<(u32, Arc<dyn ReclaimHolder>)> {
        read(&self.holders).iter().map(|entry| (entry.order, Arc::clone(&entry.holder))).collect()
    }

    /// Asks the holders, in order and with no lock held, for `request.bytes`; returns
    /// the bytes they freed.
    pub(crate) fn reclaim(&self, request: ReclaimRequest) -> u64 {
        let mut freed = 0u64;
        for (order, holder) in self.holders() {
            let missing = request.bytes.saturating_sub(freed);
            if missing == 0 {
                break;
            }
            let got = holder.reclaim(&ReclaimRequest { bytes: missing, ..request });
            tracing::debug!(
                device = %self.key, holder = holder.name(), order, asked = missing, freed = got,
                "reclaim holder asked"
            );
            freed = freed.saturating_add(got);
        }
        tracing::info!(
            device = %self.key, authority = %request.authority, role = %request.role,
            asked = request.bytes, freed, "reclaim finished"
        );
        freed
    }

    /// The holder that says it could free the most (asked with no lock held).
    pub(crate) fn largest_holder(&self) -> Option<HolderReport> {
        self.holders()
            .into_iter()
            .map(|(order, holder)| HolderReport {
                name: holder.name().to_owned(),
                reclaimable: holder.reclaimable(self.key),
                order,
            })
            .max_by(|a, b| a.reclaimable.cmp(&b.reclaimable).then(b.order.cmp(&a.order)))
    }

    /// Adds a reclaim holder; holders are kept in ascending `order`, ties by `serial`.
    pub(crate) fn add_holder(&self, serial: u64, order: u32, holder: Arc<dyn ReclaimHolder>) {
        let mut holders = write(&self.holders);
        holders.push(HolderEntry { serial, order, holder });
        holders.sort_by_key(|entry| (entry.order, entry.serial));
    }

    /// Removes the holder registered as `serial`; the holder, if it was there.
    pub(crate) fn remove_holder(&self, serial: u64) -> Option<Arc<dyn ReclaimHolder>> {
        let mut holders = write(&self.holders);
        let index = holders.iter().position(|entry| entry.serial == serial)?;
        Some(holders.remove(index).holder)
    }
}
