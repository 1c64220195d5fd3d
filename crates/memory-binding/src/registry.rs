//! `BindingRegistry`: registration, selection and every lifecycle transition (the cold
//! path), plus `bind`.
//!
//! Lock order (also in docs/LIFECYCLE.md): the registry's `cold` mutex serialises
//! lifecycle transitions and may be held while briefly touching one dashmap shard;
//! nothing else nests. MechanismPin and quarantine mutexes are leaves, never taken under `cold`
//! or a shard. No allocator, capability, queue or user callback and no resource
//! destructor runs under any of them: values are moved out, locks released, then the
//! callback runs or the value drops.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::panic::{AssertUnwindSafe, catch_unwind};

use arc_swap::ArcSwap;
use dashmap::DashMap;
use memory_api::{
    AllocationIdentity, AuthorityIdentity, BindingGeneration, DeviceAllocator, DeviceKey, Identity, IdentityIssuer,
    MechanismIdentity, ProviderContextIdentity, RawAllocation, RegistryId, ReleaseOutcome,
};

use crate::bind_cache;
use crate::binding::MemoryBinding;
use crate::capability::split_capability;
use crate::entry::{Anchor, AuthorityEntry, ContextEntry, DropPolicy, Mechanism, MechanismCore, Resource};
use crate::error::{BindError, ObjectIdentity, ObjectKind, RegistryError};
use crate::hot_trace::{HotEvent, hot_trace};
use crate::lifecycle::{Admit, AllocationState, ContextState, MechanismState};
use crate::release::reraise_unless_unwinding;
use crate::snapshot::{RetryReport, TerminationReport};
use crate::sync::{Arc, AtomicU64, Mutex, Ordering, lock};
use crate::unit_ref::UnitRef;

/// The registry: sole issuer of identities, owner of every lifecycle.
///
/// Cheap to clone; clones share one registry.
#[derive(Clone)]
pub struct BindingRegistry {
    pub(crate) inner: Arc<RegistryInner>,
}

/// One selected mechanism per device.
#[derive(Clone)]
struct Selected {
    generation: BindingGeneration,
    mechanism: Arc<Mechanism>,
}

/// The selection: a copy-on-write map from device to its selected mechanism.
type Selection = HashMap<DeviceKey, Selected>;

pub(crate) struct RegistryInner {
    pub(crate) issuer: Arc<IdentityIssuer>,
    /// The issuer's registry id, and its hash for the bind cache (read by every bind).
    registry: RegistryId,
    bind_salt: u64,
    pub(crate) contexts: DashMap<ProviderContextIdentity, Arc<ContextEntry>>,
    pub(crate) authorities: DashMap<AuthorityIdentity, Arc<AuthorityEntry>>,
    pub(crate) mechanisms: DashMap<MechanismIdentity, Arc<Mechanism>>,
    /// Copy-on-write selection table, read through an arc-swap guard (no shared
    /// refcount) when a thread's bind cache misses.
    selection: ArcSwap<Selection>,
    /// Bumped after every change of `selection`: a thread's bind cache entry filled
    /// under an older epoch is not used (see `bind_cache`).
    selection_epoch: AtomicU64,
    cold: Mutex<()>,
}

/// Options for [`BindingRegistry::register_allocator_with`].
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct MechanismOptions {
    /// What dropping a live allocation does; `None` picks
    /// [`DropPolicy::default_for`] the device.
    pub drop_policy: Option<DropPolicy>,
}

impl MechanismOptions {
    /// The same options with `policy` for dropping a live allocation (`None`: the
    /// device's default, [`DropPolicy::default_for`]).
    #[must_use]
    pub fn with_drop_policy(mut self, policy: impl Into<Option<DropPolicy>>) -> MechanismOptions {
        self.drop_policy = policy.into();
        self
    }
}

/// What `invalidate_device` changed.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct InvalidationReport {
    /// Mechanisms moved to device-lost.
    pub mechanisms: usize,
    /// Contexts moved to lost.
    pub contexts: usize,
    /// Whether the device's selection was dropped.
    pub selection_dropped: bool,
}

impl Default for BindingRegistry {
    fn default() -> BindingRegistry {
        BindingRegistry::new()
    }
}

impl BindingRegistry {
    /// A new, empty registry with a fresh process-unique id.
    ///
    /// # Panics
    /// Only if the process has created 2^64 - 1 registries, which cannot happen in
    /// practice; [`BindingRegistry::try_new`] reports that as an error instead.
    pub fn new() -> BindingRegistry {
        match BindingRegistry::try_new() {
            Ok(registry) => registry,
            Err(error) => panic!("{error}"),
        }
    }

    /// A new, empty registry with a fresh process-unique id.
    ///
    /// # Errors
    /// [`RegistryError::Identity`] once the process has used up registry ids.
    pub fn try_new() -> Result<BindingRegistry, RegistryError> {
        Ok(BindingRegistry::with_issuer(IdentityIssuer::new()?))
    }

    /// A registry minting from `issuer` (for example one with a serial limit).
    pub fn with_issuer(issuer: IdentityIssuer) -> BindingRegistry {
        let registry = issuer.registry();
        BindingRegistry {
            inner: Arc::new(RegistryInner {
                registry,
                bind_salt: DeviceHash.hash_one(registry),
                issuer: Arc::new(issuer),
                contexts: DashMap::new(),
                authorities: DashMap::new(),
                mechanisms: DashMap::new(),
                selection: ArcSwap::from_pointee(Selection::new()),
                selection_epoch: AtomicU64::new(0),
                cold: Mutex::new(()),
            }),
        }
    }

    /// This registry's process-unique id.
    pub fn id(&self) -> RegistryId {
        self.inner.issuer.registry()
    }

    fn check_ours(&self, identity: impl Into<ObjectIdentity>) -> Result<(), RegistryError> {
        let identity = identity.into();
        let (expected, found) = (self.id(), identity.registry());
        if expected == found {
            Ok(())
        } else {
            Err(RegistryError::ForeignRegistry { kind: identity.kind(), identity, expected, found })
        }
    }

    fn unknown(identity: impl Into<ObjectIdentity>) -> RegistryError {
        let identity = identity.into();
        RegistryError::Unknown { kind: identity.kind(), identity }
    }

    fn context(&self, context: &ProviderContextIdentity) -> Result<Arc<ContextEntry>, RegistryError> {
        self.check_ours(*context)?;
        let entry = self.inner.contexts.get(context).map(|e| Arc::clone(&e));
        entry.ok_or_else(|| Self::unknown(*context))
    }

    fn authority(&self, authority: &AuthorityIdentity) -> Result<Arc<AuthorityEntry>, RegistryError> {
        self.check_ours(*authority)?;
        let entry = self.inner.authorities.get(authority).map(|e| Arc::clone(&e));
        entry.ok_or_else(|| Self::unknown(*authority))
    }

    pub(crate) fn mechanism(&self, mechanism: &MechanismIdentity) -> Result<Arc<Mechanism>, RegistryError> {
        self.check_ours(*mechanism)?;
        let entry = self.inner.mechanisms.get(mechanism).map(|e| Arc::clone(&e));
        entry.ok_or_else(|| Self::unknown(*mechanism))
    }

    /// Every registered mechanism, collected so no shard lock is held afterwards.
    pub(crate) fn all_mechanisms(&self) -> Vec<Arc<Mechanism>> {
        self.inner.mechanisms.iter().map(|e| Arc::clone(e.value())).collect()
    }

    /// Registers a provider context for `device`, pinning `resource`.
    ///
    /// # Errors
    /// [`RegistryError::Identity`] when identities ran out.
    pub fn register_provider_context(
        &self,
        device: DeviceKey,
        resource: Resource,
    ) -> Result<ProviderContextIdentity, RegistryError> {
        let _span = tracing::info_span!("register_provider_context", %device).entered();
        let identity = self.inner.issuer.provider_context()?;
        self.inner.contexts.insert(identity, Arc::new(ContextEntry::new(identity, device, resource)));
        tracing::info!(context = %identity, %device, "provider context registered");
        Ok(identity)
    }

    /// Registers an authority (a tenant, a quota owner) for `device`, pinning `resource`.
    ///
    /// # Errors
    /// [`RegistryError::Identity`] when identities ran out.
    pub fn register_authority(
        &self,
        device: DeviceKey,
        resource: Resource,
    ) -> Result<AuthorityIdentity, RegistryError> {
        let _span = tracing::info_span!("register_authority", %device).entered();
        let identity = self.inner.issuer.authority()?;
        self.inner.authorities.insert(identity, Arc::new(AuthorityEntry { identity, device, resource }));
        tracing::info!(authority = %identity, %device, "authority registered");
        Ok(identity)
    }

    /// Registers `allocator` under `context` and `authority` with default options.
    /// The first mechanism registered for a device without a selection becomes its
    /// selection.
    ///
    /// # Errors
    /// Foreign or unknown context or authority, a context that is not live, or
    /// devices that disagree; all checked before anything is published.
    pub fn register_allocator(
        &self,
        context: &ProviderContextIdentity,
        authority: &AuthorityIdentity,
        allocator: Arc<dyn DeviceAllocator>,
    ) -> Result<MechanismIdentity, RegistryError> {
        self.register_allocator_with(context, authority, allocator, MechanismOptions::default())
    }

    /// [`BindingRegistry::register_allocator`] with explicit options.
    ///
    /// # Errors
    /// As for [`BindingRegistry::register_allocator`].
    pub fn register_allocator_with(
        &self,
        context: &ProviderContextIdentity,
        authority: &AuthorityIdentity,
        allocator: Arc<dyn DeviceAllocator>,
        options: MechanismOptions,
    ) -> Result<MechanismIdentity, RegistryError> {
        let _span = tracing::info_span!("register_allocator", %context, %authority).entered();
        self.register(context, authority, allocator, options, false)
    }

    fn register(
        &self,
        context: &ProviderContextIdentity,
        authority: &AuthorityIdentity,
        allocator: Arc<dyn DeviceAllocator>,
        options: MechanismOptions,
        trusted_composite: bool,
    ) -> Result<MechanismIdentity, RegistryError> {
        // Allocator callbacks run before the lock (a slow or re-entrant callback must
        // stall nothing else), and capability discovery only once the identities
        // passed, so a refused registration makes no callback beyond `device()`.
        let device = allocator.device();
        self.admit_registration(context, authority, device)?;
        // Drop-time releases wait on the queue's device: one of another device would
        // free this device's blocks after the wrong work.
        if let Some(DropPolicy::Defer(queue)) = &options.drop_policy
            && queue.device() != device
        {
            return Err(RegistryError::DeviceMismatch {
                what: "drop policy's deferred-release queue",
                against: "allocator",
                expected: device,
                found: queue.device(),
            });
        }
        let name = allocator.name().to_owned();
        if !trusted_composite && let Some(capability) = split_capability(&*allocator) {
            return Err(RegistryError::SplitComposite { allocator: name, capability });
        }
        let cold = lock(&self.inner.cold);
        // Again under the lock: the context may have been lost or removed meanwhile.
        let (context, authority) = self.admit_registration(context, authority, device)?;
        let identity = self.inner.issuer.mechanism()?;
        let generation = self.inner.issuer.binding_generation()?;
        let drop_policy = options.drop_policy.unwrap_or_else(|| DropPolicy::default_for(device));
        let core = MechanismCore::new(
            identity,
            allocator,
            context,
            authority,
            generation,
            Arc::clone(&self.inner.issuer),
            drop_policy,
            name,
            trusted_composite,
        );
        let mechanism = Arc::new(Mechanism::new(core));
        self.inner.mechanisms.insert(identity, Arc::clone(&mechanism));
        let selected = self.inner.selection.load().contains_key(&device);
        let replaced = (!selected).then(|| self.store_selection(device, Some((generation, mechanism))));
        drop(cold);
        drop(replaced);
        tracing::info!(mechanism = %identity, %device, selected = !selected, trusted_composite, "mechanism registered");
        Ok(identity)
    }

    /// The context and authority a mechanism on `device` may be registered under.
    fn admit_registration(
        &self,
        context: &ProviderContextIdentity,
        authority: &AuthorityIdentity,
        device: DeviceKey,
    ) -> Result<(Arc<ContextEntry>, Arc<AuthorityEntry>), RegistryError> {
        let context = self.context(context)?;
        let authority = self.authority(authority)?;
        let state = context.state();
        if state != ContextState::Live {
            return Err(RegistryError::ContextNotLive { context: context.identity, state });
        }
        if authority.device != context.device {
            return Err(RegistryError::DeviceMismatch {
                what: "authority",
                against: "provider context",
                expected: context.device,
                found: authority.device,
            });
        }
        if device != context.device {
            return Err(RegistryError::DeviceMismatch {
                what: "allocator",
                against: "provider context",
                expected: context.device,
                found: device,
            });
        }
        Ok((context, authority))
    }

    /// Registers a composite whose allocation, capabilities and release live in
    /// different inner objects that `allocator` routes between.
    ///
    /// The safe path ([`BindingRegistry::register_allocator_with`]) accepts capability
    /// objects only when they are part of the allocator's own value (the allocator
    /// itself or one of its fields), so the allocator's own contract covers them; it
    /// refuses a capability reached through a pointer to another object with
    /// [`RegistryError::SplitComposite`]. This path accepts such a composite on the
    /// caller's word, and its snapshot says so (`MechanismSnapshot::trusted_composite`).
    ///
    /// # Safety
    /// Rust cannot prove such a composition coherent, so the caller attests that:
    /// every block `allocator.allocate` returns is one its `release` accepts exactly
    /// once and frees completely; the capability objects `allocator` exposes accept
    /// exactly those blocks and never touch memory outside them; and address ranges a
    /// capability maps are unmapped before `release` reports `Complete`. Host backends
    /// dereference these addresses, so breaking this is undefined behaviour.
    ///
    /// # Errors
    /// As for [`BindingRegistry::register_allocator_with`].
    // The crate forbids unsafe blocks; this `unsafe fn` only marks the trust boundary
    // and contains none.
    #[allow(unsafe_code)]
    pub unsafe fn register_trusted_composite(
        &self,
        context: &ProviderContextIdentity,
        authority: &AuthorityIdentity,
        allocator: Arc<dyn DeviceAllocator>,
        options: MechanismOptions,
    ) -> Result<MechanismIdentity, RegistryError> {
        tracing::info!("registering a trusted composite allocator (caller-attested coherence)");
        self.register(context, authority, allocator, options, true)
    }

    /// Replaces `device`'s selection; returns the replaced table, for the caller to drop
    /// once `cold` is released (it may hold the last reference to a mechanism).
    #[must_use = "drop the replaced selection after releasing the cold lock"]
    fn store_selection(
        &self,
        device: DeviceKey,
        selected: Option<(BindingGeneration, Arc<Mechanism>)>,
    ) -> Arc<Selection> {
        let mut table = Selection::clone(&self.inner.selection.load());
        match selected {
            Some((generation, mechanism)) => table.insert(device, Selected { generation, mechanism }),
            None => table.remove(&device),
        };
        // Only called under `cold`, so load-modify-store cannot lose an update. The
        // epoch moves after the table: a bind that reads the new epoch finds at
        // least this table.
        let replaced = self.inner.selection.swap(Arc::new(table));
        self.inner.selection_epoch.fetch_add(1, Ordering::Release);
        replaced
    }

    /// Makes `mechanism` the one future `bind(device)` calls use. Existing bindings,
    /// allocations and handles keep their original mechanism.
    ///
    /// # Errors
    /// Foreign or unknown mechanism, or one that is not active.
    pub fn select(&self, mechanism: &MechanismIdentity) -> Result<BindingGeneration, RegistryError> {
        let _span = tracing::info_span!("select", %mechanism).entered();
        let cold = lock(&self.inner.cold);
        let entry = self.mechanism(mechanism)?;
        let state = entry.core.lifecycle.state();
        if state != MechanismState::Active {
            return Err(RegistryError::InvalidState {
                mechanism: *mechanism,
                state,
                hint: "only an active mechanism can be selected; register a new one",
            });
        }
        let generation = self.inner.issuer.binding_generation()?;
        let device = entry.core.device;
        let replaced = self.store_selection(device, Some((generation, entry)));
        drop(cold);
        drop(replaced);
        tracing::info!(mechanism = %mechanism, %device, %generation, "mechanism selected");
        Ok(generation)
    }

    /// The mechanism selected for `device`, if any.
    pub fn selected(&self, device: DeviceKey) -> Option<MechanismIdentity> {
        self.inner.selection.load().get(&device).map(|s| s.mechanism.core.identity)
    }

    /// Binds the mechanism selected for `device`.
    ///
    /// # Errors
    /// [`BindError::NoSelection`], or [`BindError::Inactive`] when the selected
    /// mechanism was retired or lost concurrently.
    #[inline(always)]
    pub fn bind(&self, device: DeviceKey) -> Result<MemoryBinding, BindError> {
        let epoch = self.inner.selection_epoch.load(Ordering::Acquire);
        match self.bind_cached(device, epoch) {
            Some(binding) => Ok(binding),
            None => self.bind_uncached(device, epoch),
        }
    }

    /// `bind` through this thread's cache: a current entry, an active mechanism and a
    /// binding id at hand. Anything else (a miss, a refusal to report) is `None`, and
    /// the uncached path reads the selection and answers. No call and no error value
    /// on this path, so it inlines into the caller and the binding stays in registers.
    #[inline(always)]
    fn bind_cached(&self, device: DeviceKey, epoch: u64) -> Option<MemoryBinding> {
        let inner = &*self.inner;
        let (anchor, generation) = bind_cache::hit(inner.bind_salt, inner.registry, device, epoch)?;
        let core = &anchor.core;
        if core.lifecycle.check(Admit::ActiveOnly).is_err() {
            return None;
        }
        let binding = anchor.next_binding_id().ok()?;
        hot_trace(HotEvent::Bind, &core.identity, 0);
        Some(MemoryBinding { anchor, binding, generation })
    }

    /// `bind` when this thread's cache has no current entry for `device`: read the
    /// selection, fill the cache, bind.
    #[cold]
    #[inline(never)]
    fn bind_uncached(&self, device: DeviceKey, epoch: u64) -> Result<MemoryBinding, BindError> {
        let (anchor, weak, generation) = {
            let selection = self.inner.selection.load();
            let Some(selected) = selection.get(&device) else {
                return Err(BindError::NoSelection { device });
            };
            let anchor = selected.mechanism.anchor();
            (unit_of(&selected.mechanism, anchor)?, Arc::downgrade(anchor), selected.generation)
        };
        bind_cache::fill(self.inner.bind_salt, self.id(), device, epoch, generation, weak);
        bind_anchor(anchor, generation)
    }

    /// Binds a specific registered mechanism, selected or not.
    ///
    /// # Errors
    /// Foreign, unknown or inactive mechanism.
    pub fn bind_registered(&self, mechanism: &MechanismIdentity) -> Result<MemoryBinding, BindError> {
        let entry = self.mechanism(mechanism)?;
        let generation = entry.core.registered_generation;
        bind_anchor(unit_of(&entry, entry.anchor())?, generation)
    }

    /// One-call adapter for code that still holds a bare allocator: registers an
    /// implicit context, authority and mechanism for the allocator's device and
    /// returns a binding to it.
    ///
    /// # Errors
    /// Identity exhaustion.
    pub fn with_memory(&self, allocator: Arc<dyn DeviceAllocator>) -> Result<MemoryBinding, BindError> {
        let device = allocator.device();
        let context = self.register_provider_context(device, Arc::new(()))?;
        let authority = self.register_authority(device, Arc::new(()))?;
        let mechanism = self.register_allocator(&context, &authority, allocator)?;
        self.bind_registered(&mechanism)
    }

    /// Retires `mechanism`: new binds and allocations are refused; existing
    /// allocations can still be viewed, decommitted and released. Drops its selection.
    ///
    /// # Errors
    /// Foreign or unknown mechanism, or one that is not active.
    pub fn retire(&self, mechanism: &MechanismIdentity) -> Result<(), RegistryError> {
        let _span = tracing::info_span!("retire", %mechanism).entered();
        let cold = lock(&self.inner.cold);
        let entry = self.mechanism(mechanism)?;
        entry.core.lifecycle.transition(&[MechanismState::Active], MechanismState::Retired).map_err(|state| {
            RegistryError::InvalidState {
                mechanism: *mechanism,
                state,
                hint: "only an active mechanism can be retired",
            }
        })?;
        let device = entry.core.device;
        let replaced = (self.selected(device) == Some(*mechanism)).then(|| self.store_selection(device, None));
        drop(cold);
        drop(replaced);
        tracing::info!(mechanism = %mechanism, %device, "mechanism retired");
        Ok(())
    }

    /// Marks `device` lost: its mechanisms and contexts stop at once. Makes no
    /// allocator callback, frees and refunds nothing, and never waits.
    pub fn invalidate_device(&self, device: DeviceKey, reason: &str) -> InvalidationReport {
        let _span = tracing::info_span!("invalidate_device", %device, reason).entered();
        let cold = lock(&self.inner.cold);
        let mut report = InvalidationReport { mechanisms: 0, contexts: 0, selection_dropped: false };
        for mechanism in self.all_mechanisms().into_iter().filter(|m| m.core.device == device) {
            let _ = mechanism.core.lost_reason.set(reason.to_owned());
            let moved = mechanism
                .core
                .lifecycle
                .transition(&[MechanismState::Active, MechanismState::Retired], MechanismState::DeviceLost);
            report.mechanisms += usize::from(moved.is_ok());
        }
        let contexts: Vec<_> = self.inner.contexts.iter().map(|e| Arc::clone(e.value())).collect();
        for context in contexts.iter().filter(|c| c.device == device && c.state() == ContextState::Live) {
            context.set_state(ContextState::Lost);
            report.contexts += 1;
        }
        let replaced = self.selected(device).is_some().then(|| self.store_selection(device, None));
        report.selection_dropped = replaced.is_some();
        drop(cold);
        drop(replaced);
        tracing::error!(%device, reason, mechanisms = report.mechanisms, contexts = report.contexts, "device lost");
        report
    }

    /// [`BindingRegistry::confirm_context_terminated`], polled until the context's
    /// callbacks drain or `timeout` passes: the poll loop every caller would otherwise
    /// write. Each attempt takes and releases the registry's locks like a single call;
    /// between attempts no lock is held and the thread yields, then sleeps with a
    /// backoff of at most a millisecond, so waiting costs little and never blocks
    /// registration, selection or releases on other threads.
    ///
    /// # Errors
    /// The last [`RegistryError::ContextNotQuiescent`] when `timeout` passes first
    /// (poll again, or find what still holds a callback); every other error of
    /// `confirm_context_terminated` at once.
    pub fn wait_terminated(
        &self,
        context: &ProviderContextIdentity,
        timeout: std::time::Duration,
    ) -> Result<TerminationReport, RegistryError> {
        // A real-time wait outside every lock and every model: std's scheduler calls.
        #![allow(clippy::disallowed_methods, reason = "wait_terminated polls in real time, outside the models")]
        const LONGEST_PAUSE: std::time::Duration = std::time::Duration::from_millis(1);
        let start = std::time::Instant::now();
        let mut pause = std::time::Duration::from_micros(20);
        loop {
            match self.confirm_context_terminated(context) {
                Err(not_yet @ RegistryError::ContextNotQuiescent { .. }) => {
                    let waited = start.elapsed();
                    if waited >= timeout {
                        return Err(not_yet);
                    }
                    std::thread::yield_now();
                    std::thread::sleep(pause.min(timeout - waited));
                    pause = (pause * 2).min(LONGEST_PAUSE);
                }
                done => return done,
            }
        }
    }

    /// Confirms that `context` (whose device was invalidated) is gone and its
    /// callbacks have drained: retires all its allocation metadata, hands the lost
    /// blocks to each allocator's `forget_lost`, and discharges its quarantine.
    /// Idempotent; a terminated context accepts no new mechanism.
    ///
    /// # Errors
    /// [`RegistryError::ContextNotQuiescent`] at once while callbacks are in flight
    /// (poll again, outside any lock); [`RegistryError::ContextStillLive`] when its
    /// device was never invalidated; foreign or unknown context.
    pub fn confirm_context_terminated(
        &self,
        context: &ProviderContextIdentity,
    ) -> Result<TerminationReport, RegistryError> {
        let _span = tracing::info_span!("confirm_context_terminated", %context).entered();
        let cold = lock(&self.inner.cold);
        let entry = self.context(context)?;
        match entry.state() {
            ContextState::Live => return Err(RegistryError::ContextStillLive { context: *context }),
            ContextState::Terminated => {
                return Ok(TerminationReport::empty(*context, true));
            }
            ContextState::Lost => {}
        }
        let mechanisms: Vec<_> =
            self.all_mechanisms().into_iter().filter(|m| m.core.context.identity == *context).collect();
        let in_flight: usize = mechanisms.iter().map(|m| m.census().in_flight).sum();
        let holds: usize = mechanisms.iter().map(|m| m.core.caller_holds.load(Ordering::Acquire)).sum();
        if in_flight > 0 || holds > 0 {
            return Err(RegistryError::ContextNotQuiescent { context: *context, in_flight, holds });
        }
        for mechanism in &mechanisms {
            // Every mechanism of a lost context is device-lost; a failed transition
            // means it is already terminated.
            let _ = mechanism.core.lifecycle.transition(&[MechanismState::DeviceLost], MechanismState::Terminated);
        }
        entry.set_state(ContextState::Terminated);
        drop(cold);

        let mut report = TerminationReport::empty(*context, false);
        // Retire every mechanism's metadata first, then make the callbacks: a
        // panicking `forget_lost` must not leave another mechanism undrained.
        let mut handoffs = Vec::with_capacity(mechanisms.len());
        for mechanism in &mechanisms {
            let mut lost: Vec<RawAllocation> = mechanism.pins().flat_map(|pin| pin.collect_lost()).collect();
            lost.extend(mechanism.core.take_unrecorded());
            report.lost_allocations += lost.len();
            // Sizes are the allocator's word: saturate rather than overflow.
            let bytes = lost.iter().map(RawAllocation::bytes).fold(0, usize::saturating_add);
            report.lost_bytes = report.lost_bytes.saturating_add(bytes);
            let quarantine = mechanism.core.take_quarantine();
            report.discharged_quarantine += quarantine.len();
            lost.extend(quarantine.into_iter().map(|q| q.allocation));
            report.mechanisms += 1;
            handoffs.push((Arc::clone(&mechanism.core.allocator), lost));
        }
        let mut first_panic = None;
        for (allocator, lost) in handoffs {
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| allocator.forget_lost(lost))) {
                tracing::error!(context = %context, "forget_lost panicked; the context is terminated regardless");
                first_panic.get_or_insert(panic);
            }
        }
        if let Some(panic) = first_panic {
            reraise_unless_unwinding(panic, "forget_lost");
        }
        tracing::info!(context = %context, ?report, "provider context terminated");
        Ok(report)
    }

    /// Retries every quarantined release of `mechanism` through its original
    /// allocator (on a healthy device).
    ///
    /// # Errors
    /// Foreign or unknown mechanism, or one whose device was lost.
    pub fn retry_quarantined(&self, mechanism: &MechanismIdentity) -> Result<RetryReport, RegistryError> {
        let _span = tracing::info_span!("retry_quarantined", %mechanism).entered();
        let entry = self.mechanism(mechanism)?;
        let core = &entry.core;
        let pin = entry.table.pin();
        let Ok(in_flight) = core.lifecycle.begin(&pin.in_flight, Admit::ActiveOrRetired) else {
            return Err(RegistryError::InvalidState {
                mechanism: *mechanism,
                state: core.lifecycle.state(),
                hint: "quarantine on a lost device is discharged by confirm_context_terminated",
            });
        };
        let mut report = RetryReport::default();
        let mut still = Vec::new();
        let mut pending = core.take_quarantine().into_iter();
        while let Some(mut entry) = pending.next() {
            // Once the device is lost (a callback of this retry, or another thread,
            // found it gone) no further callback runs: the rest stay quarantined and
            // termination hands them to `forget_lost`.
            if core.lifecycle.state() == MechanismState::DeviceLost {
                still.push(entry);
                still.extend(pending);
                break;
            }
            // The registry's own copy of the block: an outcome about any other block is
            // not believed, and a panic must not lose the entry.
            let original = &entry.allocation;
            let kept = RawAllocation::new(
                original.address(),
                original.bytes(),
                original.align(),
                original.device(),
                original.provider_tag(),
            );
            let allocation = std::mem::replace(&mut entry.allocation, kept);
            let outcome = match catch_unwind(AssertUnwindSafe(|| core.allocator.release(allocation))) {
                Ok(outcome) => outcome,
                Err(panic) => {
                    entry.error = memory_api::ReleaseError::CallbackPanicked;
                    still.push(entry);
                    still.extend(pending);
                    report.still_quarantined = still.len();
                    core.restore_quarantine(still);
                    drop(in_flight);
                    reraise_unless_unwinding(panic, "a retried release");
                    return Ok(report);
                }
            };
            match outcome {
                ReleaseOutcome::Complete(done) => {
                    core.completed(entry.allocation.bytes(), done.unmapped_bytes());
                    report.released += 1;
                }
                ReleaseOutcome::Quarantined(q) if q.allocation().same_block(&entry.allocation) => {
                    // Never more unmapped than the block minus what it still holds.
                    let ceiling = entry.allocation.bytes().saturating_sub(q.residual_bytes());
                    entry.unmapped_bytes = entry.unmapped_bytes.saturating_add(q.unmapped_bytes()).min(ceiling);
                    entry.residual_bytes = q.residual_bytes();
                    // The registry's copy stays (an answer's tag is not believed).
                    entry.error = q.into_parts().1;
                    still.push(entry);
                }
                ReleaseOutcome::Failed(f) if f.allocation().same_block(&entry.allocation) => {
                    entry.error = f.into_parts().1;
                    still.push(entry);
                }
                // An answer about another block: keep ours, wholly owned.
                ReleaseOutcome::Quarantined(_) | ReleaseOutcome::Failed(_) => {
                    core.count_dishonest_outcome();
                    tracing::error!(mechanism = %mechanism, "allocator answered a retried release with another block");
                    let bytes = entry.allocation.bytes();
                    entry.error = memory_api::ReleaseError::DishonestOutcome {
                        claimed_unmapped: 0,
                        claimed_residual: bytes,
                        allocation_bytes: bytes,
                    };
                    entry.residual_bytes = bytes;
                    still.push(entry);
                }
            }
        }
        report.still_quarantined = still.len();
        core.restore_quarantine(still);
        drop(in_flight);
        tracing::info!(mechanism = %mechanism, ?report, "quarantine retried");
        Ok(report)
    }

    /// Removes a retired or terminated mechanism that has nothing live, quarantined
    /// or in flight. Live handles keep their own pins.
    ///
    /// # Errors
    /// Foreign or unknown mechanism, an active or device-lost one, or one that is not
    /// quiescent.
    pub fn remove(&self, mechanism: &MechanismIdentity) -> Result<(), RegistryError> {
        let _span = tracing::info_span!("remove", %mechanism).entered();
        let cold = lock(&self.inner.cold);
        let entry = self.mechanism(mechanism)?;
        let lifecycle = &entry.core.lifecycle;
        let state = lifecycle.state();
        let hint = match state {
            MechanismState::Active => Some("retire it first"),
            MechanismState::DeviceLost => Some("confirm its context terminated first"),
            MechanismState::Removing => Some("another remove is in progress"),
            MechanismState::Retired | MechanismState::Terminated => None,
        };
        if let Some(hint) = hint {
            return Err(RegistryError::InvalidState { mechanism: *mechanism, state, hint });
        }
        // Close a retired mechanism first, so no release can take a record and put it
        // back (or quarantine it) between the counts below; a terminated one admits
        // nothing already. The in-flight sum then covers everything that began before.
        let closed = state == MechanismState::Retired
            && lifecycle.transition(&[MechanismState::Retired], MechanismState::Removing).is_ok();
        let census = entry.census();
        let (live, in_flight) = (census.live, census.in_flight);
        let quarantined = entry.core.quarantined_count();
        if live + quarantined + in_flight > 0 {
            if closed {
                let _ = lifecycle.transition(&[MechanismState::Removing], MechanismState::Retired);
            }
            return Err(RegistryError::NotQuiescent {
                kind: ObjectKind::Mechanism,
                identity: ObjectIdentity::Mechanism(*mechanism),
                live,
                quarantined,
                in_flight,
                dependents: 0,
            });
        }
        let removed = self.inner.mechanisms.remove(mechanism);
        if closed {
            // Bindings that outlive the removal see a retired mechanism, as before.
            let _ = lifecycle.transition(&[MechanismState::Removing], MechanismState::Retired);
        }
        drop(cold);
        drop(removed);
        tracing::info!(mechanism = %mechanism, "mechanism removed");
        Ok(())
    }

    fn dependents(&self, matches: impl Fn(&MechanismCore) -> bool) -> usize {
        self.all_mechanisms().iter().filter(|m| matches(&m.core)).count()
    }

    /// Removes a provider context no registered mechanism references.
    ///
    /// # Errors
    /// Foreign or unknown context, or mechanisms still referencing it.
    pub fn remove_provider_context(&self, context: &ProviderContextIdentity) -> Result<(), RegistryError> {
        self.remove_unreferenced(
            *context,
            |core| core.context.identity == *context,
            |inner| inner.contexts.remove(context).map(|(_, entry)| Box::new(entry) as Box<dyn std::any::Any>),
        )
    }

    /// Removes an authority no registered mechanism references.
    ///
    /// # Errors
    /// Foreign or unknown authority, or mechanisms still referencing it.
    pub fn remove_authority(&self, authority: &AuthorityIdentity) -> Result<(), RegistryError> {
        self.remove_unreferenced(
            *authority,
            |core| core.authority.identity == *authority,
            |inner| inner.authorities.remove(authority).map(|(_, entry)| Box::new(entry) as Box<dyn std::any::Any>),
        )
    }

    /// The removal both contexts and authorities share: under the cold lock, check the
    /// identity, refuse while a mechanism references it, take the entry out; then drop
    /// it (the resource's destructor runs there) outside every lock.
    fn remove_unreferenced(
        &self,
        identity: impl Into<ObjectIdentity>,
        references: impl Fn(&MechanismCore) -> bool,
        take: impl FnOnce(&RegistryInner) -> Option<Box<dyn std::any::Any>>,
    ) -> Result<(), RegistryError> {
        let identity = identity.into();
        let cold = lock(&self.inner.cold);
        self.check_ours(identity)?;
        let dependents = self.dependents(references);
        let removed = if dependents > 0 { None } else { take(&self.inner) };
        drop(cold);
        match removed {
            Some(entry) => {
                drop(entry); // The resource's destructor runs here, outside every lock.
                match identity {
                    ObjectIdentity::ProviderContext(context) => {
                        tracing::info!(context = %context, "provider context removed")
                    }
                    _ => tracing::info!(authority = %identity, "authority removed"),
                }
                Ok(())
            }
            None if dependents > 0 => Err(RegistryError::NotQuiescent {
                kind: identity.kind(),
                identity,
                live: 0,
                quarantined: 0,
                in_flight: 0,
                dependents,
            }),
            None => Err(Self::unknown(identity)),
        }
    }

    /// Where the allocation named by `identity` stands, found by its generation
    /// (never by address): an address the allocator reused under a new generation
    /// does not make old metadata valid again.
    pub fn allocation_state(&self, identity: &AllocationIdentity) -> AllocationState {
        let Ok(mechanism) = self.mechanism(&identity.binding().mechanism()) else {
            return AllocationState::Gone;
        };
        let generation = identity.generation().serial();
        let state = mechanism.core.lifecycle.state();
        if state == MechanismState::Terminated {
            return AllocationState::Gone;
        }
        if mechanism.pins().any(|pin| pin.find(generation)) {
            return if state == MechanismState::DeviceLost { AllocationState::Lost } else { AllocationState::Live };
        }
        let quarantined =
            mechanism.core.with_quarantine(|list| list.iter().any(|q| q.generation == identity.generation()));
        if quarantined { AllocationState::Quarantined } else { AllocationState::Gone }
    }
}

/// A unit of `anchor`, the calling thread's anchor of `mechanism`, which the caller
/// holds: a mechanism held is never orphaned (that happens in its drop), so the refusal
/// below is only a typed answer for what cannot happen.
fn unit_of(mechanism: &Mechanism, anchor: &Arc<Anchor>) -> Result<UnitRef<Anchor>, BindError> {
    UnitRef::try_new(anchor).ok_or_else(|| BindError::Inactive {
        mechanism: mechanism.core.identity,
        state: mechanism.core.lifecycle.state(),
    })
}

/// Mints a binding through `anchor` (a unit of the calling thread's anchor of the
/// mechanism).
#[inline]
fn bind_anchor(anchor: UnitRef<Anchor>, generation: BindingGeneration) -> Result<MemoryBinding, BindError> {
    let core = &anchor.core;
    // On the encoded word: only a refusal is decoded, out of line.
    if let Err(state) = core.lifecycle.check(Admit::ActiveOnly) {
        return Err(inactive(core, state));
    }
    let binding = match anchor.next_binding_id() {
        Ok(binding) => binding,
        Err(exhausted) => return Err(RegistryError::from(exhausted).into()),
    };
    hot_trace(HotEvent::Bind, &core.identity, 0);
    Ok(MemoryBinding { anchor, binding, generation })
}

/// `bind`'s refusal of a mechanism that is not active (kept out of the hot path).
#[cold]
#[inline(never)]
fn inactive(core: &MechanismCore, state: MechanismState) -> BindError {
    BindError::Inactive { mechanism: core.identity, state }
}

/// A multiplicative hash for device keys (a few integers): cheaper than SipHash, and
/// the keys are the registry's own, not attacker-chosen strings.
#[derive(Copy, Clone, Default)]
struct DeviceHash;

impl BuildHasher for DeviceHash {
    type Hasher = DeviceHasher;
    fn build_hasher(&self) -> DeviceHasher {
        DeviceHasher(0)
    }
}

struct DeviceHasher(u64);

impl Hasher for DeviceHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }
    fn write_u8(&mut self, value: u8) {
        self.write_u64(u64::from(value));
    }
    fn write_u32(&mut self, value: u32) {
        self.write_u64(u64::from(value));
    }
    fn write_isize(&mut self, value: isize) {
        self.write_u64(value as u64);
    }
    fn write_usize(&mut self, value: usize) {
        self.write_u64(value as u64);
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = (self.0.rotate_left(5) ^ value).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn finish(&self) -> u64 {
        // The high bits are the well-mixed ones.
        self.0 >> 32 ^ self.0
    }
}

impl fmt::Debug for BindingRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BindingRegistry")
            .field("id", &self.id())
            .field("contexts", &self.inner.contexts.len())
            .field("authorities", &self.inner.authorities.len())
            .field("mechanisms", &self.inner.mechanisms.len())
            .finish()
    }
}

/// loom models of selection (`cargo xtask loom`): `select`, `bind` and `retire` racing.
/// (The selection table is an arc-swap and the tables dashmaps, which loom does not
/// instrument; their operations are linearisable and run between loom's switch points,
/// while the cold lock, the lifecycle word, the in-flight slots and the pin locks are
/// modelled.)
#[cfg(all(test, memory_loom))]
mod loom_selection {
    use super::*;
    use crate::error::AllocateError;
    use loom::sync::atomic::{AtomicBool, Ordering};
    use memory_api::{AllocError, AllocationRequest, DeviceAddress};

    const GPU0: DeviceKey = DeviceKey::device(0);

    /// Hands out one fixed block per call (nothing behind it).
    struct Blocks;
    impl DeviceAllocator for Blocks {
        fn device(&self) -> DeviceKey {
            GPU0
        }
        fn name(&self) -> &str {
            "blocks"
        }
        fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
            let address = DeviceAddress::new(0x10_0000).expect("non-zero");
            Ok(RawAllocation::new(address, request.bytes(), request.align(), GPU0, 0))
        }
        fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
            ReleaseOutcome::complete(allocation.bytes())
        }
    }

    /// A registry with two mechanisms on one device; the first is selected.
    fn two_mechanisms() -> (BindingRegistry, MechanismIdentity, MechanismIdentity) {
        let registry = BindingRegistry::new();
        let context = registry.register_provider_context(GPU0, Arc::new(())).unwrap();
        let authority = registry.register_authority(GPU0, Arc::new(())).unwrap();
        let first = registry.register_allocator(&context, &authority, Arc::new(Blocks)).unwrap();
        let second = registry.register_allocator(&context, &authority, Arc::new(Blocks)).unwrap();
        (registry, first, second)
    }

    /// `select` racing `retire` of the same mechanism, with a `bind` (and an
    /// allocation through it) racing both: a retired mechanism is never left selected,
    /// a select either lands before the retirement (whose removal of the selection
    /// wins) or is refused, a bind only ever sees a selection that was stored, with the
    /// generation `select` returned, and an allocation that starts after the retirement
    /// returned is refused.
    #[test]
    fn loom_select_bind_and_retire_race_without_selecting_a_retired_mechanism() {
        loom::model(|| {
            let (registry, first, second) = two_mechanisms();
            let initial = registry.bind(GPU0).unwrap().identity().generation();
            let retired = Arc::new(AtomicBool::new(false));
            let select = {
                let registry = registry.clone();
                loom::thread::spawn(move || registry.select(&second))
            };
            let retire = {
                let (registry, retired) = (registry.clone(), Arc::clone(&retired));
                loom::thread::spawn(move || {
                    registry.retire(&second).unwrap();
                    retired.store(true, Ordering::SeqCst);
                })
            };

            let bound = match registry.bind(GPU0) {
                Ok(bound) => Some(bound),
                // Selected and retired before this bind: nothing is selected.
                Err(BindError::NoSelection { .. }) => None,
                // Read the selection, then saw the retirement.
                Err(BindError::Inactive { mechanism, state: MechanismState::Retired }) if mechanism == second => None,
                Err(other) => panic!("bind: {other}"),
            };
            let retired_before = retired.load(Ordering::SeqCst);
            if let Some(bound) = &bound {
                let allocated = bound.allocate(AllocationRequest::new(64, 8).unwrap());
                if bound.identity().mechanism() == second && retired_before {
                    assert!(
                        matches!(allocated, Err(AllocateError::Inactive { state: MechanismState::Retired, .. })),
                        "an allocation started after retire returned was admitted"
                    );
                }
                if let Ok(block) = allocated {
                    bound.release(block).unwrap();
                }
            }

            let selected = select.join().unwrap();
            retire.join().unwrap();
            match (&selected, registry.selected(GPU0)) {
                // Selected first, then retired: the retirement dropped the selection.
                (Ok(_), None) => {}
                // Retired first: the select was refused and the first stays selected.
                (Err(RegistryError::InvalidState { state: MechanismState::Retired, .. }), Some(m)) if m == first => {}
                (selected, now) => panic!("select returned {selected:?} and the selection is {now:?}"),
            }
            if let Some(bound) = &bound {
                if bound.identity().mechanism() == second {
                    assert_eq!(Ok(bound.identity().generation()), selected, "a bind saw a selection never stored");
                } else {
                    assert_eq!(bound.identity().generation(), initial, "a bind of the first saw another generation");
                }
            }
            // Nothing is left in flight or recorded on the retired mechanism.
            drop(bound);
            registry.remove(&second).unwrap();
        });
    }

    /// Two selects racing: the selection ends on the one whose generation is the
    /// later-stored, and every bind afterwards carries that generation.
    #[test]
    fn loom_racing_selects_leave_one_selection_with_its_own_generation() {
        loom::model(|| {
            let (registry, first, second) = two_mechanisms();
            let other = {
                let registry = registry.clone();
                loom::thread::spawn(move || registry.select(&second).unwrap())
            };
            let mine = registry.select(&first).unwrap();
            let theirs = other.join().unwrap();
            let bound = registry.bind(GPU0).unwrap();
            let expected = if bound.identity().mechanism() == first { mine } else { theirs };
            assert_eq!(bound.identity().generation(), expected);
            assert_eq!(registry.selected(GPU0), Some(bound.identity().mechanism()));
        });
    }
}
