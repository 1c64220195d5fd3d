//! What the process holds for each tenant over the run (`reserved`: its blocks plus
//! what its pools keep idle), sampled by the control loop. The governor keeps the
//! allocated peak of every account and the reserved peak of every device, but no
//! reserved peak per account, so the demo samples one.

use std::collections::BTreeMap;

use memory_governor::{Account, AuthorityIdentity};

use super::world::World;

/// The highest `reserved` seen per account, and how often it was looked at.
pub(crate) struct TenantPeaks {
    accounts: Vec<(AuthorityIdentity, Account)>,
    reserved: Vec<u64>,
    pub(crate) samples: u64,
}

impl TenantPeaks {
    /// Every account of every device (platform and tenants).
    pub(crate) fn new(world: &World) -> TenantPeaks {
        let accounts: Vec<_> = world
            .devices
            .iter()
            .flat_map(|device| device.authorities.iter())
            .filter_map(|&authority| world.governor.account(authority).ok().map(|account| (authority, account)))
            .collect();
        TenantPeaks { reserved: vec![0; accounts.len()], accounts, samples: 0 }
    }

    /// Looks at every account once (cold: asks each cache of the device for its figures).
    pub(crate) fn sample(&mut self) {
        for ((_, account), peak) in self.accounts.iter().zip(&mut self.reserved) {
            *peak = (*peak).max(account.footprint().tenant_reserved);
        }
        self.samples += 1;
    }

    /// The sampled peaks, by authority (as the snapshots name it).
    pub(crate) fn by_authority(&self) -> BTreeMap<String, u64> {
        self.accounts.iter().zip(&self.reserved).map(|((authority, _), &peak)| (authority.to_string(), peak)).collect()
    }
}
