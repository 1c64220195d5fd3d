//! A property test: random sequences of leases, growths, shrinks, drops and limit,
//! quota and reserve changes, applied to the governor and to a plain sequential model
//! of the books; after every step both must agree on every admission and every
//! figure, and at the end the books must be exactly empty.
//!
//! Cases: `PROPTEST_CASES` (default 256), each up to 60 operations.

mod common;

use std::sync::Arc;

use common::*;
use memory_governor::*;
use proptest::prelude::*;

const GPU: DeviceKey = DeviceKey::device(0);
const ROLES: [MemoryRole; 3] = [MemoryRole::Weights, MemoryRole::KvCache, MemoryRole::Activations];

#[derive(Clone, Debug)]
enum Op {
    Lease { account: usize, role: usize, bytes: u64 },
    Drop { index: usize },
    Grow { index: usize, extra: u64 },
    Shrink { index: usize, less: u64 },
    SetLimit { bytes: u64 },
    SetQuota { account: usize, bytes: u64 },
    SetReserve { bytes: u64 },
    ReturnCredit,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..2usize, 0..ROLES.len(), 0..400u64).prop_map(|(account, role, bytes)| Op::Lease { account, role, bytes }),
        3 => (0..16usize).prop_map(|index| Op::Drop { index }),
        2 => (0..16usize, 0..200u64).prop_map(|(index, extra)| Op::Grow { index, extra }),
        1 => (0..16usize, 0..200u64).prop_map(|(index, less)| Op::Shrink { index, less }),
        1 => (0..1500u64).prop_map(|bytes| Op::SetLimit { bytes }),
        1 => (0..2usize, 0..1200u64).prop_map(|(account, bytes)| Op::SetQuota { account, bytes }),
        1 => (0..500u64).prop_map(|bytes| Op::SetReserve { bytes }),
        1 => Just(Op::ReturnCredit),
    ]
}

/// The books, sequentially: leases, limits, quotas and the weights reserve.
struct Model {
    limit: u64,
    quotas: [u64; 2],
    reserve: u64,
    leases: Vec<(usize, usize, u64)>,
    /// Highest charges seen: of the device, per account, per account and role.
    peak: u64,
    account_peaks: [u64; 2],
    role_peaks: [[u64; ROLES.len()]; 2],
}

impl Model {
    fn note_peaks(&mut self) {
        self.peak = self.peak.max(self.leases.iter().map(|l| l.2).sum());
        for account in 0..2 {
            self.account_peaks[account] = self.account_peaks[account].max(self.account_usage(account));
            for role in 0..ROLES.len() {
                let usage = self.leases.iter().filter(|l| l.0 == account && l.1 == role).map(|l| l.2).sum();
                self.role_peaks[account][role] = self.role_peaks[account][role].max(usage);
            }
        }
    }

    fn role_usage(&self, role: usize) -> u64 {
        self.leases.iter().filter(|l| l.1 == role).map(|l| l.2).sum()
    }

    fn account_usage(&self, account: usize) -> u64 {
        self.leases.iter().filter(|l| l.0 == account).map(|l| l.2).sum()
    }

    /// What the device holds if `role` uses `extra` more: max(usage, reserve) for weights.
    fn device_occupied(&self, role: usize, extra: u64, reserve: u64) -> u64 {
        (0..ROLES.len())
            .map(|r| {
                let usage = self.role_usage(r) + if r == role { extra } else { 0 };
                if r == 0 { usage.max(reserve) } else { usage }
            })
            .sum()
    }

    /// A request fits when it draws nothing more (zero bytes; or, for weights, bytes
    /// inside their reserve) or what it draws fits the limit.
    fn admits(&self, account: usize, role: usize, bytes: u64) -> bool {
        let quota = bytes == 0 || self.account_usage(account) + bytes <= self.quotas[account];
        let after = self.device_occupied(role, bytes, self.reserve);
        let device = after == self.device_occupied(role, 0, self.reserve) || after <= self.limit;
        quota && device
    }
}

fn run(chunk: u64, limit: u64, quotas: [u64; 2], reserve: u64, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let governor = governor(chunk);
    governor.set_device_limit(GPU, limit).unwrap();
    let accounts: Vec<Account> = quotas
        .iter()
        .map(|&quota| governor.open_account(AccountConfig::new(GPU, authority()).with_quota(quota)).unwrap())
        .collect();
    let reserve_policy = |bytes| -> Arc<dyn AdmissionPolicy> {
        Arc::new(GuaranteedReserve::new(Arc::new(HardLimit)).with_reserve(MemoryRole::Weights, bytes))
    };
    let mut model = Model {
        limit,
        quotas,
        reserve: 0,
        leases: Vec::new(),
        peak: 0,
        account_peaks: [0; 2],
        role_peaks: [[0; ROLES.len()]; 2],
    };
    if reserve <= limit {
        governor.set_policy(GPU, reserve_policy(reserve)).unwrap();
        model.reserve = reserve;
    }
    let mut leases: Vec<Lease<&Account>> = Vec::new();

    for op in ops {
        match op {
            Op::Lease { account, role, bytes } => {
                let expected = model.admits(account, role, bytes);
                let got = accounts[account].lease(ROLES[role], bytes);
                prop_assert_eq!(got.is_ok(), expected, "lease {} of {} for account {}", bytes, ROLES[role], account);
                if let Ok(lease) = got {
                    leases.push(lease);
                    model.leases.push((account, role, bytes));
                }
            }
            Op::Drop { index } if index < leases.len() => {
                drop(leases.swap_remove(index));
                model.leases.swap_remove(index);
            }
            Op::Grow { index, extra } if index < leases.len() => {
                let (account, role, _) = model.leases[index];
                let expected = model.admits(account, role, extra);
                prop_assert_eq!(leases[index].grow(extra).is_ok(), expected, "grow by {}", extra);
                if expected {
                    model.leases[index].2 += extra;
                }
            }
            Op::Shrink { index, less } if index < leases.len() => {
                let expected = less <= model.leases[index].2;
                prop_assert_eq!(leases[index].shrink(less).is_ok(), expected);
                if expected {
                    model.leases[index].2 -= less;
                }
            }
            Op::SetLimit { bytes } => {
                let expected = bytes >= model.reserve;
                prop_assert_eq!(governor.set_device_limit(GPU, bytes).is_ok(), expected);
                if expected {
                    model.limit = bytes;
                }
            }
            Op::SetQuota { account, bytes } => {
                governor.set_quota(accounts[account].authority(), bytes).unwrap();
                model.quotas[account] = bytes;
            }
            Op::SetReserve { bytes } => {
                // A reserve fits when the limit holds it, and the device can hold it on
                // top of what is charged (or it makes the device hold no more).
                let others: u64 = (1..ROLES.len()).map(|r| model.role_usage(r)).sum();
                let weights = model.role_usage(0);
                let fits = bytes <= model.limit
                    && (others + weights.max(bytes) <= model.limit || weights.max(bytes) <= weights.max(model.reserve));
                let got = governor.set_policy(GPU, reserve_policy(bytes));
                prop_assert_eq!(
                    got.is_ok(),
                    fits,
                    "reserve {} (weights {}, others {}, limit {})",
                    bytes,
                    weights,
                    others,
                    model.limit
                );
                if fits {
                    model.reserve = bytes;
                }
            }
            Op::ReturnCredit => {
                governor.return_idle_credit();
            }
            _ => {}
        }
        // Every figure agrees with the model after every step (one thread charges, so
        // the peaks of real charges are exact whatever the credit chunk).
        model.note_peaks();
        let snapshot = governor.snapshot();
        let device = snapshot.device(GPU).unwrap();
        prop_assert_eq!(device.current, model.leases.iter().map(|l| l.2).sum::<u64>());
        prop_assert_eq!(device.peak, model.peak);
        for (i, account) in accounts.iter().enumerate() {
            let books = device.authority(account.authority()).unwrap();
            prop_assert_eq!(books.current, model.account_usage(i));
            prop_assert_eq!(books.peak, model.account_peaks[i]);
            prop_assert_eq!(books.quota, Some(model.quotas[i]).filter(|&q| q != u64::MAX));
            for (r, role) in ROLES.iter().enumerate() {
                let expected: u64 = model.leases.iter().filter(|l| l.0 == i && l.1 == r).map(|l| l.2).sum();
                prop_assert_eq!(books.role(*role).current, expected);
                let live = model.leases.iter().filter(|l| l.0 == i && l.1 == r).count() as u64;
                prop_assert_eq!(books.role(*role).live, live);
                prop_assert_eq!(books.role(*role).peak, model.role_peaks[i][r]);
            }
        }
        let occupied = model.device_occupied(0, 0, model.reserve);
        prop_assert!(device.used >= occupied, "used {} below what is charged and reserved {}", device.used, occupied);
        prop_assert!(device.used <= model.limit.max(occupied), "used {} over the limit {}", device.used, model.limit);
    }
    drop(leases);
    governor.return_idle_credit();
    let snapshot = governor.snapshot();
    let device = snapshot.device(GPU).unwrap();
    prop_assert_eq!(device.current, 0);
    prop_assert_eq!(device.used, model.reserve, "only the reserve is left on an idle device");
    for account in &accounts {
        prop_assert_eq!(account.used(), 0);
    }
    Ok(())
}

proptest! {
    // `ProptestConfig::default()` reads `PROPTEST_CASES` (and the `proptest!` macro
    // applies the environment over any config given here, too).
    #![proptest_config(ProptestConfig::default())]

    #[test]
    fn the_books_match_a_sequential_model(
        chunk in prop_oneof![Just(0u64), Just(7), Just(64), Just(1000)],
        limit in 0..1500u64,
        quotas in [prop_oneof![Just(u64::MAX), 0..1200u64], prop_oneof![Just(u64::MAX), 0..1200u64]],
        reserve in 0..500u64,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        run(chunk, limit, quotas, reserve, ops)?;
    }
}
