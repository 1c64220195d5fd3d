//! Where memory lives: tiers, device keys and the roles memory plays.

use std::fmt;

/// The storage tier a device key names.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum Tier {
    /// Accelerator memory (a GPU's HBM, for example).
    Device,
    /// Host memory, pageable or pinned.
    Host,
    /// Disk-backed memory (spill files, memory-mapped weights).
    Disk,
}

impl Tier {
    /// Lower-case name used in messages and serialised reports.
    #[inline]
    pub const fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One memory domain: a tier plus an index inside it (GPU ordinal, NUMA node, disk).
///
/// Device keys are plain values chosen by the runtime (they name hardware, not
/// registry state), so they have public constructors; identities do not.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DeviceKey {
    tier: Tier,
    index: u32,
}

impl DeviceKey {
    /// The host memory domain.
    pub const HOST: DeviceKey = DeviceKey { tier: Tier::Host, index: 0 };

    /// Accelerator `index` (the CUDA ordinal, for example).
    #[inline]
    pub const fn device(index: u32) -> DeviceKey {
        DeviceKey { tier: Tier::Device, index }
    }

    /// Host memory domain `index` (a NUMA node, or a simulated device on the CPU).
    #[inline]
    pub const fn host(index: u32) -> DeviceKey {
        DeviceKey { tier: Tier::Host, index }
    }

    /// Disk domain `index`.
    #[inline]
    pub const fn disk(index: u32) -> DeviceKey {
        DeviceKey { tier: Tier::Disk, index }
    }

    /// The tier of this key.
    #[inline]
    pub const fn tier(self) -> Tier {
        self.tier
    }

    /// The index inside the tier.
    #[inline]
    pub const fn index(self) -> u32 {
        self.index
    }
}

impl fmt::Display for DeviceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.tier, self.index)
    }
}

/// What a piece of memory is for; the governor accounts and reserves per role.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum MemoryRole {
    /// Model weights: loaded once, long lived.
    Weights,
    /// Attention key/value cache pages: grow with sequences, evictable.
    KvCache,
    /// Per-step activations.
    Activations,
    /// Scratch space for kernels (GEMM workspace, sort buffers).
    Workspace,
    /// Host staging buffers for transfers.
    Staging,
    /// Anything not named above.
    #[default]
    Other,
}

impl MemoryRole {
    /// Every role, in a stable order (for tables and per-role arrays).
    pub const ALL: [MemoryRole; 6] = [
        MemoryRole::Weights,
        MemoryRole::KvCache,
        MemoryRole::Activations,
        MemoryRole::Workspace,
        MemoryRole::Staging,
        MemoryRole::Other,
    ];

    /// Position of this role in [`MemoryRole::ALL`], for per-role arrays.
    #[inline]
    pub const fn ordinal(self) -> usize {
        match self {
            MemoryRole::Weights => 0,
            MemoryRole::KvCache => 1,
            MemoryRole::Activations => 2,
            MemoryRole::Workspace => 3,
            MemoryRole::Staging => 4,
            MemoryRole::Other => 5,
        }
    }

    /// Lower-case name used in messages and serialised reports.
    #[inline]
    pub const fn name(self) -> &'static str {
        match self {
            MemoryRole::Weights => "weights",
            MemoryRole::KvCache => "kv-cache",
            MemoryRole::Activations => "activations",
            MemoryRole::Workspace => "workspace",
            MemoryRole::Staging => "staging",
            MemoryRole::Other => "other",
        }
    }
}

impl fmt::Display for MemoryRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_keys_compare_by_tier_and_index() {
        assert_eq!(DeviceKey::HOST, DeviceKey::host(0));
        assert_ne!(DeviceKey::device(0), DeviceKey::HOST);
        assert_ne!(DeviceKey::device(0), DeviceKey::device(1));
        assert_eq!(DeviceKey::device(3).index(), 3);
        assert_eq!(DeviceKey::device(3).tier(), Tier::Device);
        assert_eq!(DeviceKey::device(1).to_string(), "device:1");
        assert_eq!(DeviceKey::disk(2).to_string(), "disk:2");
    }

    #[test]
    fn role_ordinals_index_all_roles() {
        for (i, role) in MemoryRole::ALL.iter().enumerate() {
            assert_eq!(role.ordinal(), i, "{role}");
        }
    }
}
