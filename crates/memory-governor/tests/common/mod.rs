//! Helpers shared by the integration tests.
#![allow(dead_code, unreachable_pub)]

use std::sync::{Arc, Mutex};

use memory_governor::*;

/// A fresh authority identity (from a throwaway issuer).
pub fn authority() -> AuthorityIdentity {
    IdentityIssuer::new().unwrap().authority().unwrap()
}

/// A governor whose threads cache `chunk` bytes of credit at a time.
pub fn governor(chunk: u64) -> Governor {
    Governor::with_config(GovernorConfig::default().with_credit_chunk(chunk))
}

/// A governor with a device limit and one account with a quota.
pub fn one_account(device: DeviceKey, limit: u64, quota: u64, chunk: u64) -> (Governor, Account) {
    let governor = governor(chunk);
    governor.set_device_limit(device, limit).unwrap();
    let account =
        governor.open_account(AccountConfig::new(device, authority()).with_quota(quota).with_label("tenant")).unwrap();
    (governor, account)
}

/// The account's charged bytes for `role` (exact when no thread is mid-operation).
pub fn current(account: &Account, role: MemoryRole) -> u64 {
    account.snapshot().role(role).current
}

/// A reclaim holder that frees from a pool of leases, recording every request.
pub struct LeaseHolder {
    pub name: String,
    pub leases: Mutex<Vec<OwnedLease>>,
    /// At most this many bytes are freed per request (a stingy holder frees less).
    pub max_per_request: u64,
    pub asked: Arc<Mutex<Vec<(String, u64)>>>,
}

impl LeaseHolder {
    pub fn new(
        name: &str,
        leases: Vec<OwnedLease>,
        max_per_request: u64,
        asked: Arc<Mutex<Vec<(String, u64)>>>,
    ) -> Arc<LeaseHolder> {
        Arc::new(LeaseHolder { name: name.to_owned(), leases: Mutex::new(leases), max_per_request, asked })
    }
}

impl ReclaimHolder for LeaseHolder {
    fn name(&self) -> &str {
        &self.name
    }

    fn reclaimable(&self, _device: DeviceKey) -> u64 {
        self.leases.lock().unwrap().iter().map(|l| l.bytes()).sum::<u64>().min(self.max_per_request)
    }

    fn reclaim(&self, request: &ReclaimRequest) -> u64 {
        self.asked.lock().unwrap().push((self.name.clone(), request.bytes));
        let mut freed = 0;
        let mut leases = self.leases.lock().unwrap();
        while freed < request.bytes.min(self.max_per_request) {
            let Some(lease) = leases.pop() else { break };
            if freed + lease.bytes() > self.max_per_request {
                leases.push(lease);
                break;
            }
            freed += lease.bytes();
            drop(lease);
        }
        freed
    }
}

/// A reclaim holder that panics inside its reclaim, with this message (it says which
/// test's path it exploded on); it reports one reclaimable byte so it is asked.
pub struct PanickingHolder(pub &'static str);

impl ReclaimHolder for PanickingHolder {
    fn name(&self) -> &str {
        "panicking"
    }

    fn reclaimable(&self, _device: DeviceKey) -> u64 {
        1
    }

    fn reclaim(&self, _request: &ReclaimRequest) -> u64 {
        panic!("{}", self.0)
    }
}
