//! Registry-issued identities.
//!
//! Every identity is an opaque `Copy + Eq + Hash` value: the id of the registry that
//! issued it plus a serial from one of that registry's checked counters. There is no
//! public numeric constructor; the only way to obtain one is an [`IdentityIssuer`].
//! Any caller may create an issuer, but each issuer has a fresh process-unique
//! [`RegistryId`], so what it mints is recognisably foreign to every other registry.
//! Serials never wrap: exhaustion is an [`IdentityError`].

use std::fmt;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::DeviceKey;
use crate::error::IdentityError;

/// Process-unique id of one identity issuer (one registry).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegistryId(NonZeroU64);

impl RegistryId {
    /// Draws the next process-unique registry id.
    #[inline]
    fn next() -> Result<RegistryId, IdentityError> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let serial = checked_reserve(&NEXT, 1, u64::MAX).ok_or(IdentityError::RegistriesExhausted)?;
        Ok(RegistryId(serial))
    }
}

/// Serialised as its display form; there is no `Deserialize` (ids are minted, never read).
#[cfg(feature = "serde")]
impl serde::Serialize for RegistryId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl fmt::Display for RegistryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// Reserves `count` serials from `counter` (which holds the next free serial), never
/// passing `limit`. Returns the first reserved serial.
fn checked_reserve(counter: &AtomicU64, count: u64, limit: u64) -> Option<NonZeroU64> {
    counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |next| {
            let end = next.checked_add(count)?;
            // `end - 1` is the last serial handed out; it may equal `limit`.
            (end - 1 <= limit).then_some(end)
        })
        .ok()
        .and_then(NonZeroU64::new)
}

/// The kinds of identity an issuer mints; each has its own counter.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub enum IdentityKind {
    /// [`ProviderContextIdentity`].
    ProviderContext,
    /// [`AuthorityIdentity`].
    Authority,
    /// [`MechanismIdentity`].
    Mechanism,
    /// [`BindingId`].
    Binding,
    /// [`BindingGeneration`].
    BindingGeneration,
    /// [`AllocationGeneration`].
    AllocationGeneration,
}

impl IdentityKind {
    const COUNT: usize = 6;

    const fn slot(self) -> usize {
        match self {
            IdentityKind::ProviderContext => 0,
            IdentityKind::Authority => 1,
            IdentityKind::Mechanism => 2,
            IdentityKind::Binding => 3,
            IdentityKind::BindingGeneration => 4,
            IdentityKind::AllocationGeneration => 5,
        }
    }

    /// Lower-case name used in messages.
    #[inline]
    pub const fn name(self) -> &'static str {
        match self {
            IdentityKind::ProviderContext => "provider context",
            IdentityKind::Authority => "authority",
            IdentityKind::Mechanism => "mechanism",
            IdentityKind::Binding => "binding",
            IdentityKind::BindingGeneration => "binding generation",
            IdentityKind::AllocationGeneration => "allocation generation",
        }
    }
}

impl fmt::Display for IdentityKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Behaviour shared by every registry-issued identity.
///
/// Sealed: only the identity types of this module implement it.
pub trait Identity: Copy + Eq + std::hash::Hash + fmt::Debug + fmt::Display + sealed::Sealed {
    /// Which kind of identity this is.
    const KIND: IdentityKind;

    /// The registry that issued this identity.
    fn registry(&self) -> RegistryId;

    /// The serial inside the issuing registry. A number out, never a number in:
    /// compact handles store it and rebuild the identity with
    /// [`IdentityIssuer::recognise`], which accepts only serials it already issued.
    fn serial(&self) -> NonZeroU64;
}

mod sealed {
    use super::{NonZeroU64, RegistryId};

    pub trait Sealed {
        /// Builds the identity; callable only inside this module, since the trait
        /// cannot be named outside it.
        fn from_parts(registry: RegistryId, serial: NonZeroU64) -> Self;
    }
}

macro_rules! identity_type {
    ($(#[$doc:meta])* $name:ident, $kind:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name {
            registry: RegistryId,
            serial: NonZeroU64,
        }

        impl sealed::Sealed for $name {
            #[inline]
            fn from_parts(registry: RegistryId, serial: NonZeroU64) -> Self {
                $name { registry, serial }
            }
        }

        impl Identity for $name {
            const KIND: IdentityKind = IdentityKind::$kind;

            #[inline]
            fn registry(&self) -> RegistryId {
                self.registry
            }

            #[inline]
            fn serial(&self) -> NonZeroU64 {
                self.serial
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}.{}"), self.registry, self.serial)
            }
        }

        /// Serialised as its display form (`mech:1.5`): identities go out, never in,
        /// so there is no `Deserialize`.
        #[cfg(feature = "serde")]
        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_str(self)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(self, f)
            }
        }
    };
}

identity_type!(
    /// A registered provider context (a CUDA context owner, a host arena owner).
    ProviderContextIdentity, ProviderContext, "ctx:"
);
identity_type!(
    /// A registered authority (a tenant account, a quota owner).
    AuthorityIdentity, Authority, "auth:"
);
identity_type!(
    /// A registered allocation mechanism: one allocator under one context and authority.
    MechanismIdentity, Mechanism, "mech:"
);
identity_type!(
    /// One binding of a mechanism, handed to a caller.
    BindingId, Binding, "bind:"
);
identity_type!(
    /// The generation of a binding; a rebind gets a new one.
    BindingGeneration, BindingGeneration, "bgen:"
);
identity_type!(
    /// The generation of one allocation. Never derived from an address: an address
    /// the allocator reuses gets a new generation, so stale metadata never validates.
    AllocationGeneration, AllocationGeneration, "agen:"
);

// Identities travel in every handle; keep them two words.
const _: () = assert!(std::mem::size_of::<MechanismIdentity>() == 16);
const _: () = assert!(std::mem::size_of::<Option<MechanismIdentity>>() == 16);

/// Mints identities for one registry.
///
/// Each issuer has its own process-unique [`RegistryId`] and one checked counter per
/// [`IdentityKind`]. The registry crate holds one; nothing else should need to.
#[derive(Debug)]
pub struct IdentityIssuer {
    registry: RegistryId,
    limit: u64,
    counters: [AtomicU64; IdentityKind::COUNT],
}

impl IdentityIssuer {
    /// A new issuer with a fresh registry id and the full serial space.
    ///
    /// # Errors
    /// [`IdentityError::RegistriesExhausted`] once 2^64 - 1 issuers were created.
    #[inline]
    pub fn new() -> Result<IdentityIssuer, IdentityError> {
        IdentityIssuer::with_serial_limit(u64::MAX)
    }

    /// A new issuer whose serials stop at `limit` (inclusive), so exhaustion can be
    /// exercised in tests and capped in deployments.
    ///
    /// # Errors
    /// [`IdentityError::RegistriesExhausted`] once 2^64 - 1 issuers were created.
    #[inline]
    pub fn with_serial_limit(limit: u64) -> Result<IdentityIssuer, IdentityError> {
        Ok(IdentityIssuer {
            registry: RegistryId::next()?,
            limit,
            counters: std::array::from_fn(|_| AtomicU64::new(1)),
        })
    }

    /// The id every identity from this issuer carries.
    #[inline]
    pub fn registry(&self) -> RegistryId {
        self.registry
    }

    /// Whether `identity` was issued by this issuer's registry.
    #[inline]
    pub fn issued<I: Identity>(&self, identity: &I) -> bool {
        identity.registry() == self.registry
    }

    #[inline]
    fn reserve(&self, kind: IdentityKind, count: u64) -> Result<NonZeroU64, IdentityError> {
        checked_reserve(&self.counters[kind.slot()], count, self.limit).ok_or(IdentityError::Exhausted {
            kind,
            registry: self.registry,
            limit: self.limit,
            requested: count,
        })
    }

    /// Mints one identity of kind `I` (the named minters such as
    /// [`IdentityIssuer::mechanism`] are this, spelled out).
    ///
    /// # Errors
    /// [`IdentityError::Exhausted`] when the serial space of this kind is used up.
    #[inline]
    pub fn mint<I: Identity>(&self) -> Result<I, IdentityError> {
        let serial = self.reserve(I::KIND, 1)?;
        Ok(I::from_parts(self.registry, serial))
    }

    /// Reserves a block of `count` identities of kind `I` in one counter update, so a
    /// thread can mint them without touching the shared counter each time. Identities
    /// from a block are unique and never reused, but not ordered across blocks.
    ///
    /// # Errors
    /// [`IdentityError::Exhausted`] when fewer than `count` serials remain; nothing is
    /// reserved then.
    #[inline]
    pub fn block<I: Identity>(&self, count: u64) -> Result<IdentityBlock<I>, IdentityError> {
        let count = count.max(1);
        let first = self.reserve(I::KIND, count)?;
        Ok(IdentityBlock {
            registry: self.registry,
            next: first.get(),
            end: first.get() + count,
            kind: std::marker::PhantomData,
        })
    }

    /// Rebuilds an identity of kind `I` from a serial this issuer already issued
    /// (compact handles store serials). Returns `None` for a serial not issued yet,
    /// so no caller can mint identities ahead of the counter.
    #[inline]
    pub fn recognise<I: Identity>(&self, serial: NonZeroU64) -> Option<I> {
        let next = self.counters[I::KIND.slot()].load(Ordering::Relaxed);
        (serial.get() < next).then(|| I::from_parts(self.registry, serial))
    }
}

/// The named minters: [`IdentityIssuer::mint`] for each kind, spelled out for callers
/// that read better with a name than with a turbofish.
macro_rules! named_minters {
    ($($(#[$doc:meta])* $method:ident -> $kind:ty;)*) => {
        impl IdentityIssuer {
            $(
                $(#[$doc])*
                ///
                /// # Errors
                /// [`IdentityError::Exhausted`] when the serial space of this kind is used up.
                #[inline]
                pub fn $method(&self) -> Result<$kind, IdentityError> {
                    self.mint()
                }
            )*
        }
    };
}

named_minters! {
    /// Mints a provider-context identity.
    provider_context -> ProviderContextIdentity;
    /// Mints an authority identity.
    authority -> AuthorityIdentity;
    /// Mints a mechanism identity.
    mechanism -> MechanismIdentity;
    /// Mints a binding id.
    binding -> BindingId;
    /// Mints a binding generation.
    binding_generation -> BindingGeneration;
    /// Mints one allocation generation.
    allocation_generation -> AllocationGeneration;
}

/// A run of identities reserved from an [`IdentityIssuer`] for one thread.
#[derive(Debug)]
pub struct IdentityBlock<I> {
    registry: RegistryId,
    next: u64,
    end: u64,
    kind: std::marker::PhantomData<fn() -> I>,
}

impl<I: Identity> IdentityBlock<I> {
    /// An empty block (the first `next` asks for a refill).
    #[inline]
    pub fn empty(registry: RegistryId) -> IdentityBlock<I> {
        IdentityBlock { registry, next: 1, end: 1, kind: std::marker::PhantomData }
    }

    /// The next unused identity of this block, or `None` once it is spent.
    // Not `Iterator`: `None` means "reserve another block", not "the sequence ended".
    #[allow(clippy::should_implement_trait)]
    #[inline]
    pub fn next(&mut self) -> Option<I> {
        if self.next >= self.end {
            return None;
        }
        let serial = NonZeroU64::new(self.next)?;
        self.next += 1;
        Some(I::from_parts(self.registry, serial))
    }

    /// Identities left in this block.
    #[inline]
    pub fn remaining(&self) -> u64 {
        self.end - self.next
    }
}

/// Everything that identifies one binding: which binding, which generation of it, and
/// the device, mechanism, provider context and authority it is pinned to.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct BindingIdentity {
    binding: BindingId,
    generation: BindingGeneration,
    device: DeviceKey,
    mechanism: MechanismIdentity,
    context: ProviderContextIdentity,
    authority: AuthorityIdentity,
}

impl BindingIdentity {
    /// Assembles a binding identity from issued parts (the registry does this).
    #[inline]
    pub fn new(
        binding: BindingId,
        generation: BindingGeneration,
        device: DeviceKey,
        mechanism: MechanismIdentity,
        context: ProviderContextIdentity,
        authority: AuthorityIdentity,
    ) -> BindingIdentity {
        BindingIdentity { binding, generation, device, mechanism, context, authority }
    }

    /// The binding id.
    #[inline]
    pub fn binding(&self) -> BindingId {
        self.binding
    }

    /// The binding generation.
    #[inline]
    pub fn generation(&self) -> BindingGeneration {
        self.generation
    }

    /// The device the binding allocates on.
    #[inline]
    pub fn device(&self) -> DeviceKey {
        self.device
    }

    /// The mechanism the binding is pinned to.
    #[inline]
    pub fn mechanism(&self) -> MechanismIdentity {
        self.mechanism
    }

    /// The provider context the binding is pinned to.
    #[inline]
    pub fn context(&self) -> ProviderContextIdentity {
        self.context
    }

    /// The authority the binding is pinned to.
    #[inline]
    pub fn authority(&self) -> AuthorityIdentity {
        self.authority
    }

    /// The registry that issued the binding.
    #[inline]
    pub fn registry(&self) -> RegistryId {
        self.binding.registry()
    }
}

impl fmt::Display for BindingIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{} on {} via {} ({}, {})",
            self.binding, self.generation, self.device, self.mechanism, self.context, self.authority
        )
    }
}

/// A binding identity plus the generation of one allocation made through it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct AllocationIdentity {
    binding: BindingIdentity,
    generation: AllocationGeneration,
}

impl AllocationIdentity {
    /// Assembles an allocation identity (the registry does this).
    #[inline]
    pub fn new(binding: BindingIdentity, generation: AllocationGeneration) -> AllocationIdentity {
        AllocationIdentity { binding, generation }
    }

    /// The binding the allocation was made through.
    #[inline]
    pub fn binding(&self) -> &BindingIdentity {
        &self.binding
    }

    /// The allocation generation.
    #[inline]
    pub fn generation(&self) -> AllocationGeneration {
        self.generation
    }

    /// The device the allocation lives on.
    #[inline]
    pub fn device(&self) -> DeviceKey {
        self.binding.device
    }
}

impl fmt::Display for AllocationIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of {}", self.generation, self.binding)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn identities_from_one_issuer_are_distinct_and_recognised() {
        let issuer = IdentityIssuer::new().unwrap();
        let a = issuer.mechanism().unwrap();
        let b = issuer.mechanism().unwrap();
        assert_ne!(a, b);
        assert_eq!(a, a);
        assert!(issuer.issued(&a));
        assert_eq!(a.registry(), issuer.registry());
    }

    #[test]
    fn identities_hash_by_value() {
        let issuer = IdentityIssuer::new().unwrap();
        let ids: Vec<_> = (0..100).map(|_| issuer.allocation_generation().unwrap()).collect();
        let set: HashSet<_> = ids.iter().copied().collect();
        assert_eq!(set.len(), ids.len());
        for id in &ids {
            assert!(set.contains(id));
        }
    }

    #[test]
    fn identities_from_another_issuer_are_foreign() {
        let ours = IdentityIssuer::new().unwrap();
        let theirs = IdentityIssuer::new().unwrap();
        assert_ne!(ours.registry(), theirs.registry());
        let foreign = theirs.authority().unwrap();
        let own = ours.authority().unwrap();
        // Same serial (both issuers' first authority), different registries.
        assert_ne!(foreign, own);
        assert!(!ours.issued(&foreign));
        assert!(theirs.issued(&foreign));
    }

    #[test]
    fn serial_exhaustion_is_an_error_not_a_wrap() {
        let issuer = IdentityIssuer::with_serial_limit(2).unwrap();
        let first = issuer.binding().unwrap();
        let second = issuer.binding().unwrap();
        assert_ne!(first, second);
        let err = issuer.binding().unwrap_err();
        assert!(matches!(err, IdentityError::Exhausted { kind: IdentityKind::Binding, limit: 2, .. }));
        // Still exhausted: the failed reservation did not move the counter back or around.
        assert!(issuer.binding().is_err());
        // Other kinds have their own counters.
        assert!(issuer.mechanism().is_ok());
    }

    #[test]
    fn generation_blocks_are_disjoint_and_checked() {
        let issuer = IdentityIssuer::with_serial_limit(10).unwrap();
        let mut a = issuer.block::<AllocationGeneration>(4).unwrap();
        let mut b = issuer.block::<AllocationGeneration>(4).unwrap();
        let mut seen = HashSet::new();
        while let Some(g) = a.next() {
            assert!(seen.insert(g));
        }
        while let Some(g) = b.next() {
            assert!(seen.insert(g));
        }
        assert_eq!(seen.len(), 8);
        // Only two serials remain; a block of four is refused and reserves nothing.
        assert!(issuer.block::<AllocationGeneration>(4).is_err());
        assert_eq!(issuer.block::<AllocationGeneration>(2).unwrap().remaining(), 2);
    }

    #[test]
    fn recognise_accepts_only_issued_serials_of_its_own_registry() {
        let issuer = IdentityIssuer::new().unwrap();
        let other = IdentityIssuer::new().unwrap();
        let id = issuer.binding().unwrap();
        let rebuilt: BindingId = issuer.recognise(id.serial()).unwrap();
        assert_eq!(rebuilt, id);
        // A serial not issued yet cannot be minted through `recognise`.
        let ahead = NonZeroU64::new(id.serial().get() + 1).unwrap();
        assert!(issuer.recognise::<BindingId>(ahead).is_none());
        // The same serial in another registry is a different identity.
        let _ = other.binding().unwrap();
        let theirs: BindingId = other.recognise(id.serial()).unwrap();
        assert_ne!(theirs, id);
    }

    #[test]
    fn counter_at_u64_max_does_not_wrap() {
        let counter = AtomicU64::new(u64::MAX);
        assert_eq!(checked_reserve(&counter, 1, u64::MAX).map(NonZeroU64::get), None);
        assert_eq!(counter.load(Ordering::Relaxed), u64::MAX);
        let counter = AtomicU64::new(u64::MAX - 1);
        assert_eq!(checked_reserve(&counter, 1, u64::MAX).map(NonZeroU64::get), Some(u64::MAX - 1));
    }

    #[test]
    fn composite_identities_compare_every_part() {
        let issuer = IdentityIssuer::new().unwrap();
        let make = |device| {
            BindingIdentity::new(
                issuer.binding().unwrap(),
                issuer.binding_generation().unwrap(),
                device,
                issuer.mechanism().unwrap(),
                issuer.provider_context().unwrap(),
                issuer.authority().unwrap(),
            )
        };
        let a = make(DeviceKey::device(0));
        let b = make(DeviceKey::device(0));
        assert_ne!(a, b);
        let alloc = AllocationIdentity::new(a, issuer.allocation_generation().unwrap());
        assert_eq!(alloc.binding(), &a);
        assert_eq!(alloc.device(), DeviceKey::device(0));
        assert_eq!(a.registry(), issuer.registry());
        assert!(a.to_string().contains("device:0"));
    }
}
