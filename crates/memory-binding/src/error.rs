//! Errors of the registry, one enum per operation family. Messages say what was asked,
//! what was found and what to do. An error raised before anything was mutated hands
//! the caller's handle back inside [`Rejected`].

use std::fmt;

use memory_api::{
    AllocError, AuthorityIdentity, BindingIdentity, CapabilityError, DeviceKey, Identity, IdentityError,
    MechanismIdentity, ProviderContextIdentity, QueueRefusalReason, RegistryId, ReleaseError,
};

use crate::lifecycle::{ContextState, MechanismState};

/// Which kind of registry object an error is about.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ObjectKind {
    /// A provider context.
    ProviderContext,
    /// An authority.
    Authority,
    /// A mechanism.
    Mechanism,
    /// A binding.
    Binding,
    /// An allocation.
    Allocation,
}

impl fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ObjectKind::ProviderContext => "provider context",
            ObjectKind::Authority => "authority",
            ObjectKind::Mechanism => "mechanism",
            ObjectKind::Binding => "binding",
            ObjectKind::Allocation => "allocation",
        })
    }
}

/// The identity of a registered object, typed, as errors carry it (match on it, or
/// compare it with the identity you hold).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ObjectIdentity {
    /// A provider context.
    ProviderContext(ProviderContextIdentity),
    /// An authority.
    Authority(AuthorityIdentity),
    /// A mechanism.
    Mechanism(MechanismIdentity),
}

impl ObjectIdentity {
    /// Which kind of object this is.
    pub fn kind(&self) -> ObjectKind {
        match self {
            ObjectIdentity::ProviderContext(_) => ObjectKind::ProviderContext,
            ObjectIdentity::Authority(_) => ObjectKind::Authority,
            ObjectIdentity::Mechanism(_) => ObjectKind::Mechanism,
        }
    }

    /// The registry that issued it.
    pub fn registry(&self) -> RegistryId {
        match self {
            ObjectIdentity::ProviderContext(id) => id.registry(),
            ObjectIdentity::Authority(id) => id.registry(),
            ObjectIdentity::Mechanism(id) => id.registry(),
        }
    }
}

impl fmt::Display for ObjectIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ObjectIdentity::ProviderContext(id) => id.fmt(f),
            ObjectIdentity::Authority(id) => id.fmt(f),
            ObjectIdentity::Mechanism(id) => id.fmt(f),
        }
    }
}

impl From<ProviderContextIdentity> for ObjectIdentity {
    fn from(id: ProviderContextIdentity) -> ObjectIdentity {
        ObjectIdentity::ProviderContext(id)
    }
}

impl From<AuthorityIdentity> for ObjectIdentity {
    fn from(id: AuthorityIdentity) -> ObjectIdentity {
        ObjectIdentity::Authority(id)
    }
}

impl From<MechanismIdentity> for ObjectIdentity {
    fn from(id: MechanismIdentity) -> ObjectIdentity {
        ObjectIdentity::Mechanism(id)
    }
}

/// Errors of the cold path: registration, selection, retirement, invalidation,
/// termination, removal.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The identity was issued by another registry.
    #[error(
        "{kind} {identity} was issued by registry {found}, not by this registry ({expected}); use the registry that issued it"
    )]
    ForeignRegistry {
        /// What kind of object.
        kind: ObjectKind,
        /// The identity presented.
        identity: ObjectIdentity,
        /// This registry.
        expected: RegistryId,
        /// The issuing registry.
        found: RegistryId,
    },
    /// The identity is not (or no longer) registered here.
    #[error("{kind} {identity} is not registered (never registered, or already removed); register it first")]
    Unknown {
        /// What kind of object.
        kind: ObjectKind,
        /// The identity presented.
        identity: ObjectIdentity,
    },
    /// Context, authority and allocator disagree about the device.
    #[error(
        "{what} is on {found}, but the {against} is on {expected}; register all parts of a mechanism for one device"
    )]
    DeviceMismatch {
        /// The part that disagrees.
        what: &'static str,
        /// What it was compared against.
        against: &'static str,
        /// The device it should be on.
        expected: DeviceKey,
        /// The device it is on.
        found: DeviceKey,
    },
    /// The safe registration path was given an allocator whose capability object is
    /// not part of the allocator's own value (a composite).
    #[error(
        "registering {allocator} through the safe path: its {capability} is a separate object, not part of the \
         allocator value; keep the capability inside the allocator, or register the composite with \
         register_trusted_composite, attesting that its parts are coherent"
    )]
    SplitComposite {
        /// The allocator's name.
        allocator: String,
        /// The capability that lives in another object.
        capability: &'static str,
    },
    /// The provider context is lost or terminated and accepts no new mechanism.
    #[error("provider context {context} is {state}; register a new context for this device")]
    ContextNotLive {
        /// The context.
        context: ProviderContextIdentity,
        /// Its state.
        state: ContextState,
    },
    /// The context is still live: termination needs a lost context.
    #[error(
        "provider context {context} is still live; call invalidate_device for its device first, then confirm termination"
    )]
    ContextStillLive {
        /// The context.
        context: ProviderContextIdentity,
    },
    /// Callbacks of the context's mechanisms are still running, or foreign callers
    /// still hold it; poll again later, outside any lock.
    #[error(
        "provider context {context} still has {in_flight} callback(s) in flight and {holds} caller hold(s) (foreign \
         runtimes that may still call, such as open sessions); poll again once they have drained and the holders are \
         gone"
    )]
    ContextNotQuiescent {
        /// The context.
        context: ProviderContextIdentity,
        /// Callbacks (and queued releases) still in flight.
        in_flight: usize,
        /// Live [`CallerHold`](crate::CallerHold)s on the context's mechanisms.
        holds: usize,
    },
    /// The mechanism is in a state that forbids the operation.
    #[error("mechanism {mechanism} is {state}; {hint}")]
    InvalidState {
        /// The mechanism.
        mechanism: MechanismIdentity,
        /// Its state.
        state: MechanismState,
        /// What to do.
        hint: &'static str,
    },
    /// The object still has work or memory attached.
    #[error(
        "{kind} {identity} is not quiescent ({live} live allocation(s), {quarantined} quarantined, \
         {in_flight} in flight, {dependents} dependent mechanism(s)); release, retry quarantine or terminate first"
    )]
    NotQuiescent {
        /// What kind of object.
        kind: ObjectKind,
        /// Its identity.
        identity: ObjectIdentity,
        /// Live allocations.
        live: usize,
        /// Quarantined allocations.
        quarantined: usize,
        /// Operations in flight.
        in_flight: usize,
        /// Mechanisms still registered that reference it.
        dependents: usize,
    },
    /// Identities ran out.
    #[error(transparent)]
    Identity(#[from] IdentityError),
}

/// Why `bind` failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BindError {
    /// No mechanism is selected for the device.
    #[error("no mechanism is selected for {device}; register an allocator for it or call select")]
    NoSelection {
        /// The device asked for.
        device: DeviceKey,
    },
    /// The mechanism cannot take new bindings.
    #[error("mechanism {mechanism} is {state} and takes no new bindings; select an active mechanism")]
    Inactive {
        /// The mechanism.
        mechanism: MechanismIdentity,
        /// Its state.
        state: MechanismState,
    },
    /// The mechanism is unknown or foreign.
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// Why a binding operation on an allocation failed (the reason inside [`Rejected`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandleError {
    /// The handle comes from another registry.
    #[error("the allocation was issued by registry {found}, not {expected}; release it through its own registry")]
    ForeignRegistry {
        /// This binding's registry.
        expected: RegistryId,
        /// The handle's registry.
        found: RegistryId,
    },
    /// The handle belongs to another binding (or mechanism, authority, device).
    #[error(
        "the allocation belongs to {}, not to this binding ({expected}); use the binding that made it",
        found.map_or_else(|| "a binding this registry does not recognise".to_owned(), |b| b.to_string())
    )]
    BindingMismatch {
        /// This binding.
        expected: BindingIdentity,
        /// The binding that made the allocation (`None` if its serials are not ones this
        /// registry issued).
        found: Option<BindingIdentity>,
    },
    /// The handle's generation no longer validates (its metadata was retired).
    #[error(
        "the allocation's generation is stale (its metadata was retired by termination or release); drop the handle"
    )]
    StaleAllocation,
    /// The device was lost; nothing was called.
    #[error(
        "{device} was lost ({reason}); drop the handle, confirm the context terminated and rebind on a new context"
    )]
    DeviceLost {
        /// The lost device.
        device: DeviceKey,
        /// The mechanism the handle is pinned to (lost with its device).
        mechanism: MechanismIdentity,
        /// Why, as given to `invalidate_device`.
        reason: String,
    },
    /// The mechanism's state forbids the operation.
    #[error("mechanism {mechanism} is {state}; this operation needs an active mechanism")]
    Inactive {
        /// The mechanism.
        mechanism: MechanismIdentity,
        /// Its state.
        state: MechanismState,
    },
    /// The allocator refused the release without mutating anything.
    #[error("the allocator refused the release: {0}; retry later")]
    ReleaseFailed(ReleaseError),
    /// A deferred-release queue refused the release.
    #[error("the release queue refused: {0}")]
    QueueRefused(QueueRefusalReason),
}

/// An operation that was refused before anything was mutated: the handle comes back.
#[derive(Debug, thiserror::Error)]
#[error("{reason}")]
pub struct Rejected<T> {
    /// The caller's handle, untouched.
    pub handle: T,
    /// Why the operation was refused.
    pub reason: HandleError,
}

impl<T> Rejected<T> {
    /// Splits into handle and reason.
    pub fn into_parts(self) -> (T, HandleError) {
        (self.handle, self.reason)
    }
}

/// Why `allocate` failed. Nothing was allocated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AllocateError {
    /// The binding's mechanism takes no new allocations.
    #[error("mechanism {mechanism} is {state} and takes no new allocations; rebind to the selected mechanism")]
    Inactive {
        /// The mechanism.
        mechanism: MechanismIdentity,
        /// Its state.
        state: MechanismState,
    },
    /// The device was lost.
    #[error("{device} was lost ({reason}); rebind on a new context")]
    DeviceLost {
        /// The lost device.
        device: DeviceKey,
        /// The mechanism the handle is pinned to (lost with its device).
        mechanism: MechanismIdentity,
        /// Why, as given to `invalidate_device`.
        reason: String,
    },
    /// The allocator answered with a block that does not fit the request (wrong
    /// device, too small, misaligned, or an impossible alignment); it was given back.
    #[error(
        "{allocator} answered a request for {requested} bytes aligned to {align} on {device} with {found}; \
         the block was returned to it (report the allocator's bug)"
    )]
    InvalidBlock {
        /// The allocator's name.
        allocator: String,
        /// Bytes asked for.
        requested: usize,
        /// Alignment asked for.
        align: usize,
        /// The binding's device.
        device: DeviceKey,
        /// The block it returned.
        found: String,
    },
    /// The allocator failed.
    #[error(transparent)]
    Allocator(#[from] AllocError),
    /// Identities ran out.
    #[error(transparent)]
    Identity(#[from] IdentityError),
}

/// Why a view could not be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ViewError {
    /// The range leaves the allocation.
    #[error("view at offset {offset} of {len} bytes leaves the {allocation_bytes}-byte allocation; keep it inside")]
    OutOfBounds {
        /// Start asked for.
        offset: usize,
        /// Length asked for.
        len: usize,
        /// Size of the allocation.
        allocation_bytes: usize,
    },
    /// The allocation can no longer be used.
    #[error(transparent)]
    Handle(#[from] HandleError),
}

/// Why a bound capability call failed; the allocation was only borrowed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BoundCapabilityError {
    /// The mechanism's allocator has no such capability.
    #[error("mechanism {mechanism} has no {capability} capability; bind a mechanism whose allocator provides it")]
    Unsupported {
        /// The mechanism.
        mechanism: MechanismIdentity,
        /// Which capability.
        capability: &'static str,
    },
    /// The handle cannot be used with this binding, or the device was lost.
    #[error(transparent)]
    Handle(#[from] HandleError),
    /// The capability itself failed (bounds and granularity are checked first).
    #[error(transparent)]
    Capability(#[from] CapabilityError),
}
