//! Helpers shared by the fake-driver and GPU test binaries.

#![allow(dead_code, reason = "each test binary uses a different part of the helpers")]

pub(crate) mod fake;
pub(crate) mod logs;

/// A test whose body runs in a child process against the fake driver, with the given
/// `FAKE_CUDA_*` environment.
#[allow(unused_macros, reason = "the GPU test binary runs no fake-driver test")]
macro_rules! fake_test {
    ($(#[$meta:meta])* fn $name:ident() $body:block) => {
        fake_test!(env [] $(#[$meta])* fn $name() $body);
    };
    (env [$($key:literal = $value:literal),* $(,)?] $(#[$meta:meta])* fn $name:ident() $body:block) => {
        $(#[$meta])*
        #[test]
        fn $name() {
            if crate::common::fake::in_child() {
                $body
            } else {
                crate::common::fake::run_in_child(
                    concat!(module_path!(), "::", stringify!($name)),
                    &[$(($key, $value)),*],
                    crate::common::fake::Variant::Current,
                );
            }
        }
    };
}

use allocator_cuda::{CudaDevice, CudaError};
use memory_api::{
    AllocationIdentity, AllocationRequest, BindingIdentity, DeviceAddress, DeviceKey, IdentityIssuer, RawAllocation,
    ReleaseError, ReleaseOutcome,
};
use memory_testkit::{AccessError, MemoryAccess};

/// A validated request (test inputs are always valid).
pub(crate) fn request(bytes: usize, align: usize) -> AllocationRequest {
    AllocationRequest::new(bytes, align).expect("a valid test request")
}

/// Asserts a release completed and returns its unmapped bytes.
#[track_caller]
pub(crate) fn complete(outcome: ReleaseOutcome) -> usize {
    match outcome {
        ReleaseOutcome::Complete(done) => done.unmapped_bytes(),
        other => panic!("expected a complete release, got {}: {other:?}", other.summary()),
    }
}

/// Asserts a release failed (nothing mutated) and returns the block and the reason.
#[track_caller]
pub(crate) fn failed(outcome: ReleaseOutcome) -> (RawAllocation, ReleaseError) {
    match outcome {
        ReleaseOutcome::Failed(failed) => failed.into_parts(),
        other => panic!("expected a failed release, got {}: {other:?}", other.summary()),
    }
}

/// An allocation identity from a fresh issuer, for prepared releases.
pub(crate) fn identity(device: DeviceKey) -> AllocationIdentity {
    let issuer = IdentityIssuer::new().expect("an issuer");
    let binding = BindingIdentity::new(
        issuer.binding().expect("a binding id"),
        issuer.binding_generation().expect("a binding generation"),
        device,
        issuer.mechanism().expect("a mechanism"),
        issuer.provider_context().expect("a context"),
        issuer.authority().expect("an authority"),
    );
    AllocationIdentity::new(binding, issuer.allocation_generation().expect("a generation"))
}

/// Bytes that differ along the buffer and between seeds.
pub(crate) fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect()
}

/// Reads and writes device (and pinned host) memory through the driver's synchronous
/// copies, for the conformance suite and the read-back tests. The driver refuses
/// ranges that are not mapped with the access asked for, so refusals are errors, not
/// crashes.
pub(crate) struct CudaAccess {
    pub(crate) device: CudaDevice,
}

impl CudaAccess {
    fn error(address: DeviceAddress, len: usize, error: CudaError) -> AccessError {
        AccessError { address, len, reason: error.to_string() }
    }
}

impl MemoryAccess for CudaAccess {
    fn write(&self, address: DeviceAddress, data: &[u8]) -> Result<(), AccessError> {
        // SAFETY: the tests pass addresses of blocks they own and that no device work
        // uses, or ranges the driver must refuse (uncommitted, decommitted, read-only),
        // which it does without touching memory.
        unsafe { self.device.copy_to_device(address, data) }.map_err(|e| Self::error(address, data.len(), e))
    }

    fn read(&self, address: DeviceAddress, len: usize) -> Result<Vec<u8>, AccessError> {
        let mut out = vec![0; len];
        // SAFETY: as for `write`; reads change nothing.
        unsafe { self.device.copy_from_device(address, &mut out) }.map_err(|e| Self::error(address, len, e))?;
        Ok(out)
    }
}
