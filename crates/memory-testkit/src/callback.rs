//! Names for every callback a [`DeviceAllocator`](memory_api::DeviceAllocator) and its
//! capabilities receive, so wrappers can count, gate and fail them by name.

use std::fmt;

/// One allocator or capability callback.
///
/// `device()` and `name()` are not listed: they are pure queries that callers may make
/// at any time, so counting them would only add noise to tests.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Callback {
    /// [`DeviceAllocator::allocate`](memory_api::DeviceAllocator::allocate).
    Allocate,
    /// [`DeviceAllocator::release`](memory_api::DeviceAllocator::release).
    Release,
    /// Capability discovery: [`DeviceAllocator::virtual_backing`](memory_api::DeviceAllocator::virtual_backing).
    VirtualBacking,
    /// Capability discovery: [`DeviceAllocator::shared_mapping`](memory_api::DeviceAllocator::shared_mapping).
    SharedMapping,
    /// [`DeviceAllocator::stats`](memory_api::DeviceAllocator::stats).
    Stats,
    /// [`DeviceAllocator::trim`](memory_api::DeviceAllocator::trim).
    Trim,
    /// [`DeviceAllocator::forget_lost`](memory_api::DeviceAllocator::forget_lost).
    ForgetLost,
    /// [`VirtualBacking::commit`](memory_api::VirtualBacking::commit).
    Commit,
    /// [`VirtualBacking::decommit`](memory_api::VirtualBacking::decommit).
    Decommit,
    /// [`VirtualBacking::committed_bytes`](memory_api::VirtualBacking::committed_bytes).
    CommittedBytes,
    /// [`SharedMapping::create_backing`](memory_api::SharedMapping::create_backing).
    CreateBacking,
    /// [`SharedMapping::map`](memory_api::SharedMapping::map).
    Map,
    /// [`SharedMapping::unmap`](memory_api::SharedMapping::unmap).
    Unmap,
}

impl Callback {
    /// Every callback, in a stable order.
    pub const ALL: [Callback; 13] = [
        Callback::Allocate,
        Callback::Release,
        Callback::VirtualBacking,
        Callback::SharedMapping,
        Callback::Stats,
        Callback::Trim,
        Callback::ForgetLost,
        Callback::Commit,
        Callback::Decommit,
        Callback::CommittedBytes,
        Callback::CreateBacking,
        Callback::Map,
        Callback::Unmap,
    ];

    /// Number of callbacks (the length of [`Callback::ALL`]).
    pub const COUNT: usize = Callback::ALL.len();

    /// Position in [`Callback::ALL`], for per-callback arrays.
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The method's name, as written in the trait.
    pub const fn name(self) -> &'static str {
        match self {
            Callback::Allocate => "allocate",
            Callback::Release => "release",
            Callback::VirtualBacking => "virtual_backing",
            Callback::SharedMapping => "shared_mapping",
            Callback::Stats => "stats",
            Callback::Trim => "trim",
            Callback::ForgetLost => "forget_lost",
            Callback::Commit => "commit",
            Callback::Decommit => "decommit",
            Callback::CommittedBytes => "committed_bytes",
            Callback::CreateBacking => "create_backing",
            Callback::Map => "map",
            Callback::Unmap => "unmap",
        }
    }
}

impl fmt::Display for Callback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_follow_the_all_table() {
        for (i, callback) in Callback::ALL.iter().enumerate() {
            assert_eq!(callback.index(), i, "{callback}");
        }
    }
}
