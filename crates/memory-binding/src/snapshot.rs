//! Reports and snapshots: what the registry holds, per mechanism, context and
//! authority, including quarantine (which blocks removal) and lost memory.

use memory_api::{
    AllocationGeneration, AuthorityIdentity, BindingId, DeviceKey, MechanismIdentity, ProviderContextIdentity,
    RegistryId,
};

use crate::error::RegistryError;
use crate::lifecycle::{ContextState, MechanismState};
use crate::registry::BindingRegistry;

/// What `confirm_context_terminated` retired.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TerminationReport {
    /// The context.
    pub context: ProviderContextIdentity,
    /// Whether it was already terminated (an idempotent repeat).
    pub already_terminated: bool,
    /// Mechanisms terminated with it.
    pub mechanisms: usize,
    /// Live allocations retired as lost.
    pub lost_allocations: usize,
    /// Their bytes.
    pub lost_bytes: usize,
    /// Quarantined allocations discharged.
    pub discharged_quarantine: usize,
}

impl TerminationReport {
    pub(crate) fn empty(context: ProviderContextIdentity, already_terminated: bool) -> TerminationReport {
        TerminationReport {
            context,
            already_terminated,
            mechanisms: 0,
            lost_allocations: 0,
            lost_bytes: 0,
            discharged_quarantine: 0,
        }
    }
}

/// What `retry_quarantined` achieved.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryReport {
    /// Blocks now fully released.
    pub released: usize,
    /// Blocks still quarantined.
    pub still_quarantined: usize,
}

/// One quarantined block.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QuarantineSnapshot {
    /// Its allocation generation.
    pub generation: AllocationGeneration,
    /// The binding that made it.
    pub binding: BindingId,
    /// Size of the block.
    pub bytes: usize,
    /// Bytes unmapped before the release stopped.
    pub unmapped_bytes: usize,
    /// Bytes still owned.
    pub residual_bytes: usize,
    /// Why it is quarantined.
    pub reason: String,
}

/// One mechanism.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MechanismSnapshot {
    /// Its identity.
    pub identity: MechanismIdentity,
    /// Its device.
    pub device: DeviceKey,
    /// Its context.
    pub context: ProviderContextIdentity,
    /// Its authority.
    pub authority: AuthorityIdentity,
    /// Its lifecycle state.
    pub state: MechanismState,
    /// The allocator's name.
    pub allocator: String,
    /// Registered through `register_trusted_composite`: its capabilities may live in
    /// other objects than the allocator, on the registering caller's word.
    pub trusted_composite: bool,
    /// Whether it is the device's selection.
    pub selected: bool,
    /// Live (or, on a lost device, lost) allocations, including blocks an allocator
    /// answered after its device was lost that could not be recorded.
    pub live_allocations: usize,
    /// Their bytes.
    pub live_bytes: usize,
    /// Operations in flight.
    pub in_flight: usize,
    /// Quarantined blocks.
    pub quarantined: Vec<QuarantineSnapshot>,
    /// Release answers the registry did not believe: a quarantine or refusal about
    /// another block, a quarantine claiming more than the block, a `Complete` claiming
    /// to unmap more than the block. Each was corrected and traced as an error.
    pub dishonest_outcomes: usize,
    /// Why the device was lost, if it was.
    pub lost_reason: Option<String>,
}

impl MechanismSnapshot {
    /// Bytes still owned by quarantined blocks.
    pub fn quarantined_bytes(&self) -> usize {
        self.quarantined.iter().map(|q| q.residual_bytes).fold(0, usize::saturating_add)
    }
}

/// One provider context.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ContextSnapshot {
    /// Its identity.
    pub identity: ProviderContextIdentity,
    /// Its device.
    pub device: DeviceKey,
    /// Its state.
    pub state: ContextState,
}

/// One authority.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuthoritySnapshot {
    /// Its identity.
    pub identity: AuthorityIdentity,
    /// Its device.
    pub device: DeviceKey,
}

/// The whole registry.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RegistrySnapshot {
    /// The registry's id.
    pub registry: RegistryId,
    /// Contexts, in identity order.
    pub contexts: Vec<ContextSnapshot>,
    /// Authorities, in identity order.
    pub authorities: Vec<AuthoritySnapshot>,
    /// Mechanisms, in identity order.
    pub mechanisms: Vec<MechanismSnapshot>,
}

impl BindingRegistry {
    /// A snapshot of one mechanism.
    ///
    /// # Errors
    /// Foreign or unknown mechanism.
    pub fn snapshot(&self, mechanism: &MechanismIdentity) -> Result<MechanismSnapshot, RegistryError> {
        let entry = self.mechanism(mechanism)?;
        let core = &entry.core;
        let census = entry.census();
        let (live_allocations, live_bytes) = (census.live, census.live_bytes);
        let quarantined = core.with_quarantine(|list| {
            list.iter()
                .map(|q| QuarantineSnapshot {
                    generation: q.generation,
                    binding: q.binding,
                    bytes: q.allocation.bytes(),
                    unmapped_bytes: q.unmapped_bytes,
                    residual_bytes: q.residual_bytes,
                    reason: q.error.to_string(),
                })
                .collect()
        });
        let state = core.lifecycle.state();
        Ok(MechanismSnapshot {
            identity: core.identity,
            device: core.device,
            context: core.context.identity,
            authority: core.authority.identity,
            state,
            allocator: core.allocator_name.clone(),
            trusted_composite: core.trusted_composite,
            selected: self.selected(core.device) == Some(core.identity),
            live_allocations,
            live_bytes,
            in_flight: census.in_flight,
            quarantined,
            dishonest_outcomes: core.dishonest_outcomes(),
            lost_reason: matches!(state, MechanismState::DeviceLost | MechanismState::Terminated)
                .then(|| core.lost_reason()),
        })
    }

    /// A snapshot of everything registered.
    pub fn snapshots(&self) -> RegistrySnapshot {
        let mut contexts: Vec<_> = self
            .inner
            .contexts
            .iter()
            .map(|e| ContextSnapshot { identity: e.identity, device: e.device, state: e.state() })
            .collect();
        contexts.sort_by_key(|c| c.identity);
        let mut authorities: Vec<_> = self
            .inner
            .authorities
            .iter()
            .map(|e| AuthoritySnapshot { identity: e.identity, device: e.device })
            .collect();
        authorities.sort_by_key(|a| a.identity);
        let mut mechanisms: Vec<_> =
            self.all_mechanisms().iter().filter_map(|m| self.snapshot(&m.core.identity).ok()).collect();
        mechanisms.sort_by_key(|m| m.identity);
        RegistrySnapshot { registry: self.id(), contexts, authorities, mechanisms }
    }
}
