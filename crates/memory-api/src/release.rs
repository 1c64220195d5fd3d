//! Release outcomes, honest by construction.
//!
//! An allocator's release answers one of three things:
//!
//! | outcome       | what happened                                  | ownership afterwards          |
//! |---------------|------------------------------------------------|-------------------------------|
//! | `Complete`    | everything was released                        | none (zero unmapped is fine)  |
//! | `Quarantined` | something was mutated, something is still held | the block, handed back        |
//! | `Failed`      | nothing was mutated                            | the block, handed back intact |
//!
//! The payload types have private fields, so the only way to build an outcome is
//! through the constructors here, which enforce the rules: a quarantine cannot claim
//! to have unmapped or still own more than the block (a claim that does is recorded as
//! [`ReleaseError::DishonestOutcome`] and the whole block is treated as owned).

use std::fmt;

use crate::allocator::RawAllocation;
use crate::error::ReleaseError;

/// What a release did, honest by construction.
///
/// | outcome       | what happened                                  | ownership afterwards          |
/// |---------------|------------------------------------------------|-------------------------------|
/// | `Complete`    | everything was released                        | none (zero unmapped is fine)  |
/// | `Quarantined` | something was mutated, something is still held | the block, handed back        |
/// | `Failed`      | nothing was mutated                            | the block, handed back intact |
///
/// The payloads have private fields: outcomes are built only through the constructors,
/// which refuse dishonest claims (a quarantine claiming to have unmapped or still own
/// more than the block is recorded as [`ReleaseError::DishonestOutcome`] and the whole
/// block is treated as owned).
#[must_use = "a release outcome says whether memory is still owned"]
#[derive(Debug)]
pub enum ReleaseOutcome {
    /// Everything was released.
    Complete(Completion),
    /// Part of the teardown happened; the rest is still owned.
    Quarantined(Quarantine),
    /// Nothing was mutated; the block is handed back unchanged.
    Failed(FailedRelease),
}

/// Payload of [`ReleaseOutcome::Complete`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    unmapped_bytes: usize,
}

impl Completion {
    /// Bytes of the block the release unmapped or freed at the layer below (zero is a
    /// valid answer, for a reservation that had nothing committed or a zero-size
    /// block). It cannot exceed the block's size: padding a backend added for alignment
    /// is its own business, not part of the block. The registry treats a larger claim
    /// as dishonest (it reports the block's size, counts the outcome and traces an
    /// error); accounting layers refund their own charge, not this figure.
    #[inline]
    pub fn unmapped_bytes(&self) -> usize {
        self.unmapped_bytes
    }
}

/// Payload of [`ReleaseOutcome::Quarantined`].
///
/// Boxed, like [`FailedRelease`], so that a [`ReleaseOutcome`] is two words and the
/// common `Complete` answer travels in registers (measured: unboxed, copying the
/// 120-byte outcome through each layer cost more than the registry's own checks).
#[derive(Debug)]
pub struct Quarantine(Box<QuarantineParts>);

#[derive(Debug)]
struct QuarantineParts {
    allocation: RawAllocation,
    unmapped_bytes: usize,
    residual_bytes: usize,
    error: ReleaseError,
}

impl Quarantine {
    /// The block, still (partly) owned; release it again to retry.
    #[inline]
    pub fn allocation(&self) -> &RawAllocation {
        &self.0.allocation
    }

    /// Bytes that really were unmapped before the failure.
    #[inline]
    pub fn unmapped_bytes(&self) -> usize {
        self.0.unmapped_bytes
    }

    /// Bytes still owned.
    #[inline]
    pub fn residual_bytes(&self) -> usize {
        self.0.residual_bytes
    }

    /// Why the release stopped.
    #[inline]
    pub fn error(&self) -> &ReleaseError {
        &self.0.error
    }

    /// Whether the allocator's own claim broke the rules and was replaced by the
    /// conservative "everything still owned".
    #[inline]
    pub fn was_corrected(&self) -> bool {
        matches!(self.0.error, ReleaseError::DishonestOutcome { .. })
    }

    /// Splits the quarantine into the block (to retry the release) and its error.
    #[inline]
    pub fn into_parts(self) -> (RawAllocation, ReleaseError) {
        let parts = *self.0;
        (parts.allocation, parts.error)
    }
}

/// Payload of [`ReleaseOutcome::Failed`] (boxed; see [`Quarantine`]).
#[derive(Debug)]
pub struct FailedRelease(Box<FailedParts>);

#[derive(Debug)]
struct FailedParts {
    allocation: RawAllocation,
    error: ReleaseError,
}

impl FailedRelease {
    /// The block, untouched.
    #[inline]
    pub fn allocation(&self) -> &RawAllocation {
        &self.0.allocation
    }

    /// Why nothing was released.
    #[inline]
    pub fn error(&self) -> &ReleaseError {
        &self.0.error
    }

    /// Splits into the block and the error.
    #[inline]
    pub fn into_parts(self) -> (RawAllocation, ReleaseError) {
        let parts = *self.0;
        (parts.allocation, parts.error)
    }
}

impl ReleaseOutcome {
    /// Everything was released; `unmapped_bytes` of physical memory went back.
    #[inline]
    pub fn complete(unmapped_bytes: usize) -> ReleaseOutcome {
        ReleaseOutcome::Complete(Completion { unmapped_bytes })
    }

    /// Something was mutated but `residual_bytes` of `allocation` are still owned.
    ///
    /// If `unmapped_bytes + residual_bytes` exceeds the block's size the claim is
    /// dishonest: the outcome records [`ReleaseError::DishonestOutcome`] and treats
    /// the whole block as still owned with nothing unmapped.
    pub fn quarantined(
        allocation: RawAllocation,
        unmapped_bytes: usize,
        residual_bytes: usize,
        error: ReleaseError,
    ) -> ReleaseOutcome {
        let bytes = allocation.bytes();
        let honest = unmapped_bytes.checked_add(residual_bytes).is_some_and(|sum| sum <= bytes);
        if honest {
            return ReleaseOutcome::Quarantined(Quarantine(Box::new(QuarantineParts {
                allocation,
                unmapped_bytes,
                residual_bytes,
                error,
            })));
        }
        ReleaseOutcome::Quarantined(Quarantine(Box::new(QuarantineParts {
            allocation,
            unmapped_bytes: 0,
            residual_bytes: bytes,
            error: ReleaseError::DishonestOutcome {
                claimed_unmapped: unmapped_bytes,
                claimed_residual: residual_bytes,
                allocation_bytes: bytes,
            },
        })))
    }

    /// Nothing was mutated; hands `allocation` back unchanged.
    #[inline]
    pub fn failed(allocation: RawAllocation, error: ReleaseError) -> ReleaseOutcome {
        ReleaseOutcome::Failed(FailedRelease(Box::new(FailedParts { allocation, error })))
    }

    /// Whether nothing remains owned.
    #[inline]
    pub fn is_complete(&self) -> bool {
        matches!(self, ReleaseOutcome::Complete(_))
    }

    /// A `Copy` summary for logs, queues and stats.
    #[inline]
    pub fn summary(&self) -> ReleaseSummary {
        match self {
            ReleaseOutcome::Complete(c) => ReleaseSummary::Complete { unmapped_bytes: c.unmapped_bytes },
            ReleaseOutcome::Quarantined(q) => {
                ReleaseSummary::Quarantined { unmapped_bytes: q.unmapped_bytes(), residual_bytes: q.residual_bytes() }
            }
            ReleaseOutcome::Failed(f) => ReleaseSummary::Failed { bytes: f.allocation().bytes() },
        }
    }
}

/// The sizes of a [`ReleaseOutcome`], without the block it may carry.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ReleaseSummary {
    /// Released; this many bytes unmapped.
    Complete {
        /// Bytes unmapped.
        unmapped_bytes: usize,
    },
    /// Partly released.
    Quarantined {
        /// Bytes unmapped.
        unmapped_bytes: usize,
        /// Bytes still owned.
        residual_bytes: usize,
    },
    /// Nothing released.
    Failed {
        /// Size of the untouched block.
        bytes: usize,
    },
}

impl fmt::Display for ReleaseSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReleaseSummary::Complete { unmapped_bytes } => write!(f, "complete ({unmapped_bytes} bytes unmapped)"),
            ReleaseSummary::Quarantined { unmapped_bytes, residual_bytes } => {
                write!(f, "quarantined ({unmapped_bytes} bytes unmapped, {residual_bytes} still owned)")
            }
            ReleaseSummary::Failed { bytes } => write!(f, "failed (all {bytes} bytes still owned)"),
        }
    }
}

// The common answer must stay two words (returned in registers).
const _: () = assert!(std::mem::size_of::<ReleaseOutcome>() <= 16);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DeviceAddress, DeviceKey};

    fn block(bytes: usize) -> RawAllocation {
        RawAllocation::new(DeviceAddress::new(0x1000).unwrap(), bytes, 8, DeviceKey::HOST, 0)
    }

    #[test]
    fn complete_with_zero_unmapped_is_valid() {
        let outcome = ReleaseOutcome::complete(0);
        assert!(outcome.is_complete());
        assert_eq!(outcome.summary(), ReleaseSummary::Complete { unmapped_bytes: 0 });
    }

    #[test]
    fn honest_quarantine_keeps_the_claimed_bytes() {
        let outcome = ReleaseOutcome::quarantined(block(8192), 4096, 4096, ReleaseError::Abandoned);
        let ReleaseOutcome::Quarantined(q) = outcome else { panic!("expected quarantine") };
        assert_eq!((q.unmapped_bytes(), q.residual_bytes()), (4096, 4096));
        assert!(!q.was_corrected());
        assert_eq!(q.allocation().bytes(), 8192);
    }

    #[test]
    fn residual_larger_than_the_block_is_corrected_to_all_owned() {
        let outcome = ReleaseOutcome::quarantined(block(4096), 0, 8192, ReleaseError::Abandoned);
        let ReleaseOutcome::Quarantined(q) = outcome else { panic!("expected quarantine") };
        assert!(q.was_corrected());
        assert_eq!((q.unmapped_bytes(), q.residual_bytes()), (0, 4096));
        assert!(q.error().to_string().contains("8192 still owned"), "{}", q.error());
    }

    #[test]
    fn overflowing_claims_are_corrected() {
        let outcome = ReleaseOutcome::quarantined(block(16), usize::MAX, 1, ReleaseError::Abandoned);
        let ReleaseOutcome::Quarantined(q) = outcome else { panic!("expected quarantine") };
        assert!(q.was_corrected());
        assert_eq!(q.residual_bytes(), 16);
    }

    #[test]
    fn failed_release_hands_the_block_back_unchanged() {
        let original = block(64);
        let outcome = ReleaseOutcome::failed(block(64), ReleaseError::Abandoned);
        assert_eq!(outcome.summary(), ReleaseSummary::Failed { bytes: 64 });
        let ReleaseOutcome::Failed(f) = outcome else { panic!("expected failure") };
        let (returned, _) = f.into_parts();
        assert!(returned.same_block(&original));
    }
}
