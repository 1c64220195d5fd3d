//! Error types of the allocator contracts: one enum per operation family, leaf structs
//! reused across them. Messages say what was asked, what was found and what to do.

use std::fmt;

use crate::device::DeviceKey;
use crate::identity::{IdentityKind, RegistryId};

/// A byte count that may be unknown, for messages.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct MaybeBytes(pub Option<usize>);

impl fmt::Display for MaybeBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(bytes) => write!(f, "{bytes} bytes"),
            None => f.write_str("an unknown number of bytes"),
        }
    }
}

/// A failure reported by a backend (a driver, the operating system), kept as its raw
/// code so that formatting never calls back into a driver that may be gone.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{backend} call {operation} failed with code {code}: {detail}")]
pub struct BackendError {
    /// Which backend ("cuda", "os").
    pub backend: &'static str,
    /// Which call failed (`cuMemAlloc`, `mmap`).
    pub operation: &'static str,
    /// The raw error code (a `CUresult`, an errno).
    pub code: i64,
    /// A static or pre-formatted description; never produced by calling the driver.
    pub detail: String,
}

/// An invalid size or alignment.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// The alignment is zero or not a power of two.
    #[error("alignment {align} is not a power of two; pass 1, 2, 4, 8, ... (for example 256 for device buffers)")]
    AlignmentNotPowerOfTwo {
        /// The alignment asked for.
        align: usize,
    },
    /// The size, rounded up to the alignment, does not fit in `isize::MAX`.
    #[error(
        "{bytes} bytes aligned to {align} overflows the largest allocation ({max} bytes); request less, or split the buffer"
    )]
    SizeOverflow {
        /// The size asked for.
        bytes: usize,
        /// The alignment asked for.
        align: usize,
        /// The largest size any allocation may have.
        max: usize,
    },
    /// The alignment is a power of two but larger than this allocator supports.
    #[error("alignment {align} exceeds the {max} bytes this allocator supports on {device}; ask for {max} or less")]
    AlignmentTooLarge {
        /// The alignment asked for.
        align: usize,
        /// The largest alignment the allocator supports.
        max: usize,
        /// The device of the allocator.
        device: DeviceKey,
    },
}

/// Why an allocation failed. Nothing was allocated when this is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AllocError {
    /// The request's size or alignment is invalid.
    #[error("invalid allocation request: {0}")]
    Layout(#[from] LayoutError),
    /// The allocator has no memory for the request.
    #[error(
        "out of memory on {device}: asked for {requested} bytes aligned to {align}, {available} available; \
         release or trim cached memory, or ask for less"
    )]
    OutOfMemory {
        /// The device of the allocator.
        device: DeviceKey,
        /// Bytes asked for.
        requested: usize,
        /// Alignment asked for.
        align: usize,
        /// Bytes the allocator says are still available, when it knows.
        available: MaybeBytes,
    },
    /// The device or its context is gone; call `invalidate_device` on the registry.
    #[error("device {device} is lost ({reason}); invalidate it in the registry and recreate its context")]
    DeviceLost {
        /// The lost device.
        device: DeviceKey,
        /// What reported the loss.
        reason: String,
    },
    /// An admission policy (a governor's quota, budget or reserve) refused the request
    /// before any memory was touched; `detail` names what ran short and what to change.
    #[error("admission refused on {device}: {detail}")]
    AdmissionRefused {
        /// The device asked for.
        device: DeviceKey,
        /// The policy's explanation (limits, usage, the largest reclaimable holder).
        detail: String,
    },
    /// The allocator cannot serve this kind of request at all.
    #[error("{allocator} on {device} does not support {what}; use a mechanism that does")]
    Unsupported {
        /// The allocator's name.
        allocator: String,
        /// The device of the allocator.
        device: DeviceKey,
        /// What was asked for.
        what: &'static str,
    },
    /// The backend failed in a way not covered above.
    #[error("allocation on {device} failed: {source}")]
    Backend {
        /// The device of the allocator.
        device: DeviceKey,
        /// The backend failure.
        source: BackendError,
    },
}

/// Why a release could not complete (the reason inside a failed or quarantined
/// [`ReleaseOutcome`](crate::ReleaseOutcome)).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReleaseError {
    /// The allocator does not own an allocation at this address.
    #[error(
        "{allocator} does not own an allocation at {address:#x} on {device}; release it through the allocator that made it"
    )]
    NotOwned {
        /// The allocator's name.
        allocator: String,
        /// The device of the allocator.
        device: DeviceKey,
        /// The address presented.
        address: u64,
    },
    /// The device or its context is gone.
    #[error(
        "device {device} is lost ({reason}); its memory is accounted as lost until the context is confirmed terminated"
    )]
    DeviceLost {
        /// The lost device.
        device: DeviceKey,
        /// What reported the loss.
        reason: String,
    },
    /// The owner dropped the allocation without a safe release path.
    #[error(
        "the allocation was dropped without a release path; it stays quarantined until released or its context terminates"
    )]
    Abandoned,
    /// The allocator reported an outcome that breaks the honesty rules; the registry
    /// keeps the whole allocation owned.
    #[error(
        "the allocator reported {claimed_unmapped} bytes unmapped and {claimed_residual} still owned \
         for a {allocation_bytes}-byte allocation; treating all of it as owned (report the allocator's bug)"
    )]
    DishonestOutcome {
        /// Bytes the allocator claimed it unmapped.
        claimed_unmapped: usize,
        /// Bytes the allocator claimed it still owns.
        claimed_residual: usize,
        /// The size of the allocation.
        allocation_bytes: usize,
    },
    /// The allocator panicked inside release; what it freed is unknown, so the whole
    /// block stays owned.
    #[error("the allocator panicked while releasing; the block stays quarantined (fix the allocator, then retry)")]
    CallbackPanicked,
    /// The backend failed in a way not covered above.
    #[error("release failed: {0}")]
    Backend(#[from] BackendError),
}

/// Why a capability call (commit, decommit, map, unmap) failed. Nothing was mutated
/// unless the variant says otherwise.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CapabilityError {
    /// The range does not lie inside the allocation.
    #[error(
        "range at offset {offset} of {len} bytes lies outside the {allocation_bytes}-byte allocation; \
         keep offset + len within the allocation (ranges are checked against the bytes allocated, so the \
         rest of a last page past them cannot be committed or mapped: to use whole pages, allocate a \
         multiple of the granularity)"
    )]
    OutOfBounds {
        /// Start of the range.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// Size of the allocation.
        allocation_bytes: usize,
    },
    /// A mapping's source range does not lie inside its shared backing.
    #[error(
        "backing range at offset {offset} of {len} bytes lies outside the {backing_bytes}-byte shared backing; \
         keep backing_offset + len within the backing (or create a larger one)"
    )]
    BackingOutOfBounds {
        /// Start of the range in the backing (the placement's `backing_offset`).
        offset: usize,
        /// Length of the range (the placement's target length).
        len: usize,
        /// Size of the backing.
        backing_bytes: usize,
    },
    /// The range is not aligned to the capability's granularity.
    #[error(
        "range at offset {offset} of {len} bytes is not aligned to the {granularity}-byte granularity; \
         round offset and len to multiples of {granularity} (where the range ends at an allocation whose \
         size is not such a multiple, its last partial page cannot be used: allocate a multiple of \
         {granularity})"
    )]
    Misaligned {
        /// Start of the range.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// Required granularity.
        granularity: usize,
    },
    /// The allocation was not made by this allocator (or was already released).
    #[error(
        "the allocation at {address:#x} was not made by {allocator}; call the capability of the allocator that made it"
    )]
    NotOwned {
        /// The allocator's name.
        allocator: String,
        /// The address presented.
        address: u64,
    },
    /// A shared backing from another allocator or device was presented.
    #[error("the shared backing belongs to {found}, not to {expected}; create the backing with the same allocator")]
    ForeignBacking {
        /// Where the backing belongs.
        found: String,
        /// Where it was presented.
        expected: String,
    },
    /// The range is already mapped (or committed where the capability forbids overlap).
    #[error("range at offset {offset} of {len} bytes is already mapped; unmap it first")]
    AlreadyMapped {
        /// Start of the range.
        offset: usize,
        /// Length of the range.
        len: usize,
    },
    /// Not enough physical memory to commit or map.
    #[error("out of memory committing {requested} bytes on {device}; decommit or release memory first")]
    OutOfMemory {
        /// The device.
        device: DeviceKey,
        /// Bytes asked for.
        requested: usize,
    },
    /// The device or its context is gone.
    #[error("device {device} is lost ({reason})")]
    DeviceLost {
        /// The lost device.
        device: DeviceKey,
        /// What reported the loss.
        reason: String,
    },
    /// The allocator (or the one it wraps) does not offer this capability.
    #[error("{allocator} does not offer {what}; use an allocator that does")]
    Unsupported {
        /// The allocator's name.
        allocator: String,
        /// The capability asked for.
        what: &'static str,
    },
    /// The backend failed in a way not covered above.
    #[error("capability call failed: {0}")]
    Backend(#[from] BackendError),
}

/// Identities could not be issued.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// The serial space of one identity kind is used up.
    #[error(
        "registry {registry} has issued all {limit} {kind} serials (asked for {requested} more); \
         create a new registry instead of reusing this one"
    )]
    Exhausted {
        /// Which kind ran out.
        kind: IdentityKind,
        /// The registry whose counter ran out.
        registry: RegistryId,
        /// The last serial the counter may issue.
        limit: u64,
        /// How many serials were asked for.
        requested: u64,
    },
    /// The process has created 2^64 - 1 registries.
    #[error("this process has created every possible registry id; reuse an existing registry")]
    RegistriesExhausted,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_message_says_what_was_asked_found_and_what_to_do() {
        let err = AllocError::OutOfMemory {
            device: DeviceKey::device(1),
            requested: 4096,
            align: 256,
            available: MaybeBytes(Some(1024)),
        };
        let text = err.to_string();
        assert!(text.contains("device:1"), "{text}");
        assert!(text.contains("4096 bytes"), "{text}");
        assert!(text.contains("1024 bytes available"), "{text}");
        assert!(text.contains("release or trim"), "{text}");
        let unknown =
            AllocError::OutOfMemory { device: DeviceKey::HOST, requested: 1, align: 1, available: MaybeBytes(None) };
        assert!(unknown.to_string().contains("an unknown number of bytes available"));
    }

    #[test]
    fn layout_messages_name_the_bad_value_and_the_fix() {
        let text = LayoutError::AlignmentNotPowerOfTwo { align: 3 }.to_string();
        assert!(text.contains("alignment 3") && text.contains("power of two"), "{text}");
        let text = LayoutError::SizeOverflow { bytes: usize::MAX, align: 8, max: isize::MAX as usize }.to_string();
        assert!(text.contains(&usize::MAX.to_string()) && text.contains("split"), "{text}");
    }

    #[test]
    fn capability_messages_name_range_and_limit() {
        let text = CapabilityError::OutOfBounds { offset: 4096, len: 8192, allocation_bytes: 8192 }.to_string();
        assert!(text.contains("offset 4096") && text.contains("8192-byte allocation"), "{text}");
        let text = CapabilityError::BackingOutOfBounds { offset: 8192, len: 8192, backing_bytes: 12288 }.to_string();
        assert!(text.contains("offset 8192") && text.contains("12288-byte shared backing"), "{text}");
        assert!(text.contains("backing_offset + len"), "says what to change: {text}");
        let text = CapabilityError::Misaligned { offset: 1, len: 2, granularity: 4096 }.to_string();
        assert!(text.contains("4096-byte granularity") && text.contains("round"), "{text}");
        // Both refusals a caller meets with a 100-byte reservation name the way out, so
        // rounding one way is never answered by the other refusal alone.
        assert!(text.contains("allocate a multiple of 4096"), "{text}");
        let text = CapabilityError::OutOfBounds { offset: 0, len: 4096, allocation_bytes: 100 }.to_string();
        assert!(
            text.contains("100-byte allocation") && text.contains("allocate a multiple of the granularity"),
            "{text}"
        );
    }

    #[test]
    fn admission_refusals_name_the_device_and_carry_the_policy_explanation() {
        let err = AllocError::AdmissionRefused {
            device: DeviceKey::device(2),
            detail: "tenant-a's quota of 80 MiB is used; raise the quota".into(),
        };
        let text = err.to_string();
        assert!(text.contains("device:2") && text.contains("raise the quota"), "{text}");
    }

    #[test]
    fn backend_errors_keep_the_raw_code() {
        let err = BackendError { backend: "cuda", operation: "cuMemAlloc", code: 2, detail: "out of memory".into() };
        let text = AllocError::Backend { device: DeviceKey::device(0), source: err }.to_string();
        assert!(text.contains("cuMemAlloc") && text.contains("code 2"), "{text}");
    }

    #[test]
    fn exhaustion_message_names_kind_and_fix() {
        let issuer = crate::IdentityIssuer::with_serial_limit(0).unwrap();
        let text = issuer.mechanism().unwrap_err().to_string();
        assert!(text.contains("mechanism serials") && text.contains("new registry"), "{text}");
    }
}
