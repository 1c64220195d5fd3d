//! A plain, sequential reference model of the `BindingRegistry` (docs/ARCHITECTURE.md,
//! docs/LIFECYCLE.md): the executable specification that the property test
//! (`crates/memory-binding/tests/model.rs`) and the fuzz harness (`fuzz/src/lib.rs`)
//! both run beside the real registry.
//!
//! It tracks the states of contexts and mechanisms, the selection per device, where
//! every allocation is (recorded, queued, quarantined, released, forgotten), the faults
//! planned on each allocator (with [`FaultyAllocator`](crate::FaultyAllocator)'s exact
//! counting), the bytes each allocator's heap holds against an optional limit, and the
//! callbacks each allocator must have seen. Every operation returns the [`Out`] the
//! registry must produce and changes the model the way the registry changes.
//!
//! It knows nothing of the real registry, so this crate keeps depending on
//! `memory-api` alone: objects are named by the index of their registration, bindings
//! by a key shared between clones, allocations by the index of their allocation,
//! devices by their index in the list given to [`Model::new`], and the registry's
//! enums by the model's own ([`MechanismState`], [`ContextState`], [`AllocationState`],
//! [`ObjectKind`]). Callers map the real values to these with small functions of
//! their own.
//!
//! What the model does not predict: identity exhaustion (a registry with a serial
//! limit). A caller that meets it restores a clone of the model taken before the
//! operation (nothing changed in the registry) or, for an allocation that could not
//! be recorded, books it with [`Model::allocate_unrecorded`].

use std::collections::VecDeque;

use memory_api::{DeviceKey, ReleaseSummary, Tier};

mod out;
#[cfg(test)]
mod tests;

pub use out::{Handle, Out, Reg};

/// A mechanism's lifecycle (`memory_binding::MechanismState`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum MechanismState {
    /// Takes binds and allocations.
    Active,
    /// Takes no new binds or allocations; existing ones may still be released.
    Retired,
    /// Its device was lost: every operation is refused, no callback runs.
    DeviceLost,
    /// Its context was confirmed terminated: its metadata is retired.
    Terminated,
}

impl MechanismState {
    /// Whether release paths (and views) are admitted: active or retired.
    pub fn healthy(self) -> bool {
        matches!(self, MechanismState::Active | MechanismState::Retired)
    }
}

/// A provider context's lifecycle (`memory_binding::ContextState`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ContextState {
    /// Accepts new mechanisms.
    Live,
    /// Its device was lost.
    Lost,
    /// Confirmed terminated; never reused.
    Terminated,
}

/// What `allocation_state` answers about an allocation (`memory_binding::AllocationState`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AllocationState {
    /// Recorded on a healthy mechanism.
    Live,
    /// Quarantined (partly released, abandoned, refused, or reported impossibly).
    Quarantined,
    /// Recorded on a mechanism whose device was lost.
    Lost,
    /// Released, queued, forgotten at termination, or its mechanism is gone.
    Gone,
}

/// The kind of registry object an error names (`memory_binding::ObjectKind`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ObjectKind {
    /// A provider context.
    ProviderContext,
    /// An authority.
    Authority,
    /// A mechanism.
    Mechanism,
    /// A binding (the model never names one in an error).
    Binding,
    /// An allocation (the model never names one in an error).
    Allocation,
}

/// A reference to a registry object: one registered here (by index, possibly removed
/// since), or one issued by another registry.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Ref {
    /// The `usize`-th object of its kind registered in this model.
    Ours(usize),
    /// An identity of another registry.
    Foreign,
}

/// The binding an operation on a handle goes through.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Through {
    /// One of ours, by binding key.
    Binding(usize),
    /// Another registry's.
    Foreign,
}

/// Why a block sits in quarantine, as the snapshot's reason text classifies it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    /// The allocator's (injected) error.
    Injected,
    /// Dropped without a release path, refused by its queue at drop time, or its
    /// queued release was dropped.
    Abandoned,
    /// The allocator claimed more than the block.
    Dishonest,
    /// The allocator's release panicked.
    Panicked,
}

/// A mechanism's drop policy: what dropping a live handle does.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Release through the allocator at once (a refusal is quarantined).
    Release,
    /// Quarantine the whole block, call nothing.
    Quarantine,
    /// Hand the release to the queue of device index `usize` (registration refuses a
    /// queue of another device; a full one refuses: the block is quarantined as
    /// abandoned).
    Defer(usize),
}

impl Policy {
    /// `DropPolicy::default_for(device)`: host memory is released, device memory
    /// (which the device may still use) is quarantined.
    pub fn default_for(device: DeviceKey) -> Policy {
        match device.tier() {
            Tier::Host => Policy::Release,
            _ => Policy::Quarantine,
        }
    }
}

/// The callbacks a fault can be planned on (see [`FaultyAllocator`](crate::FaultyAllocator)).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FaultOn {
    /// `allocate`.
    Allocate,
    /// `release`.
    Release,
    /// `forget_lost` (only a panic can be planned there).
    ForgetLost,
}

/// What a planned fault does when it falls due.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// An injected error (an out-of-memory answer counts the same).
    Fail,
    /// A partial release claiming `unmapped` bytes gone and `residual` still owned
    /// (a claim larger than the block is corrected to "all of it owned").
    Quarantine {
        /// Bytes claimed unmapped.
        unmapped: usize,
        /// Bytes claimed still owned.
        residual: usize,
    },
    /// The callback panics.
    Panic,
}

#[derive(Copy, Clone, Debug)]
struct Planned {
    on: FaultOn,
    remaining: u64,
    fault: Fault,
}

/// Where an allocation is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Place {
    /// Recorded in the registry (live, or lost with its device).
    Record,
    /// Taken by a deferred release and held by the queue of device index `usize`.
    Queued(usize),
    /// Quarantined, with what the registry books for it.
    Quarantined {
        /// Bytes unmapped so far.
        unmapped: usize,
        /// Bytes still owned.
        residual: usize,
        /// Why.
        reason: Reason,
    },
    /// Completely released through its allocator (exactly once).
    Released,
    /// Retired by termination and handed to `forget_lost`.
    Forgotten,
}

/// A provider context.
#[derive(Clone, Debug)]
pub struct Context {
    /// Its device.
    pub device: DeviceKey,
    /// Its lifecycle.
    pub state: ContextState,
    /// Removed from the registry.
    pub removed: bool,
}

/// An authority.
#[derive(Clone, Debug)]
pub struct Authority {
    /// Its device.
    pub device: DeviceKey,
    /// Removed from the registry.
    pub removed: bool,
}

/// Callbacks an allocator must have seen, and what its heap must still hold.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Calls {
    /// `allocate` calls (faulted ones included).
    pub allocate: u64,
    /// `release` calls (faulted ones included).
    pub release: u64,
    /// `forget_lost` calls (one per mechanism per termination).
    pub forget_lost: u64,
    /// Blocks handed to `forget_lost`.
    pub forgotten_blocks: u64,
    /// Blocks the heap under the allocator still holds (allocated, not completely
    /// released; forgotten blocks stay in a `HostHeap`).
    pub heap_live: u64,
    /// Bytes of those blocks (what a heap limit is checked against).
    pub heap_live_bytes: usize,
}

/// A registered mechanism.
#[derive(Clone, Debug)]
pub struct Mechanism {
    /// Its context's index.
    pub context: usize,
    /// Its authority's index.
    pub authority: usize,
    /// Its device.
    pub device: DeviceKey,
    /// Its lifecycle.
    pub state: MechanismState,
    /// Removed from the registry.
    pub removed: bool,
    /// What dropping a live handle does.
    pub policy: Policy,
    /// The reason of the first invalidation of its device.
    pub lost_reason: Option<String>,
    /// Quarantined allocations in the registry's list order.
    pub quarantine: Vec<usize>,
    /// Callbacks its allocator must have seen.
    pub calls: Calls,
    /// Blocks of allocations that could not be recorded and that the allocator did not
    /// take back whole: it still holds them, so they count as live (and block removal)
    /// until termination hands them to `forget_lost`.
    pub unrecorded: u64,
    /// Their bytes.
    pub unrecorded_bytes: usize,
    /// Unrecorded blocks handed to `forget_lost` (they stay in the heap, as forgotten
    /// recorded blocks do).
    pub unrecorded_forgotten: u64,
    faults: Vec<Planned>,
}

impl Mechanism {
    /// Faults planned and not yet fired.
    pub fn pending_faults(&self) -> usize {
        self.faults.len()
    }
}

/// An allocation ever made.
#[derive(Clone, Debug)]
pub struct Allocation {
    /// Its mechanism's index.
    pub mechanism: usize,
    /// The key of the binding that made it.
    pub binding: usize,
    /// Its size.
    pub bytes: usize,
    /// Where it is now.
    pub place: Place,
}

/// One mechanism as a snapshot should show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MechanismView {
    /// Its index.
    pub index: usize,
    /// Its device.
    pub device: DeviceKey,
    /// Its context's index.
    pub context: usize,
    /// Its authority's index.
    pub authority: usize,
    /// Its lifecycle.
    pub state: MechanismState,
    /// Whether it is its device's selection.
    pub selected: bool,
    /// Recorded allocations (lost ones included).
    pub live_allocations: usize,
    /// Their bytes.
    pub live_bytes: usize,
    /// Releases held by queues.
    pub in_flight: usize,
    /// Quarantine by allocation index: (allocation index, (bytes, unmapped, residual, reason)).
    pub quarantined: Vec<(usize, (usize, usize, usize, Reason))>,
    /// Why its device was lost, once lost or terminated.
    pub lost_reason: Option<String>,
}

/// The whole registry as a snapshot should show it (removed objects left out).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    /// (index, device, state) of every registered context.
    pub contexts: Vec<(usize, DeviceKey, ContextState)>,
    /// (index, device) of every registered authority.
    pub authorities: Vec<(usize, DeviceKey)>,
    /// Every registered mechanism, by index.
    pub mechanisms: Vec<MechanismView>,
    /// The selected mechanism per device index.
    pub selection: Vec<Option<usize>>,
}

/// The reference model.
#[derive(Clone, Debug)]
pub struct Model {
    /// The devices, by index (selection and queues are per device index).
    pub devices: Vec<DeviceKey>,
    /// Capacity of each device's deferred-release queue.
    pub queue_capacity: usize,
    /// The byte limit of every allocator's heap, if any.
    pub heap_limit: Option<usize>,
    /// Every context ever registered.
    pub contexts: Vec<Context>,
    /// Every authority ever registered.
    pub authorities: Vec<Authority>,
    /// Every mechanism ever registered.
    pub mechanisms: Vec<Mechanism>,
    /// Binding key -> mechanism.
    pub bindings: Vec<usize>,
    /// Every allocation ever made.
    pub allocations: Vec<Allocation>,
    /// The selected mechanism per device index.
    pub selection: Vec<Option<usize>>,
    /// Per device index: queued allocations in queue order.
    pub queues: Vec<Vec<usize>>,
    losses: usize,
}

/// What one allocator release returned, as the model predicts it.
enum Released {
    Complete,
    Failed,
    Quarantined { unmapped: usize, residual: usize, reason: Reason },
    Panicked,
}

impl Model {
    /// An empty registry over `devices`, each with a deferred-release queue of
    /// `queue_capacity` releases.
    pub fn new(devices: &[DeviceKey], queue_capacity: usize) -> Model {
        Model {
            devices: devices.to_vec(),
            queue_capacity,
            heap_limit: None,
            contexts: Vec::new(),
            authorities: Vec::new(),
            mechanisms: Vec::new(),
            bindings: Vec::new(),
            allocations: Vec::new(),
            selection: vec![None; devices.len()],
            queues: vec![Vec::new(); devices.len()],
            losses: 0,
        }
    }

    /// The same, with every allocator's heap limited to `limit` live bytes.
    pub fn with_heap_limit(mut self, limit: usize) -> Model {
        self.heap_limit = Some(limit);
        self
    }

    /// Index of `device` in the model's devices.
    ///
    /// # Panics
    /// If `device` is not one of them (a broken test).
    pub fn device_index(&self, device: DeviceKey) -> usize {
        self.devices.iter().position(|d| *d == device).expect("one of the model's devices")
    }

    // --- lookups --------------------------------------------------------------

    fn context(&self, r: Ref) -> Result<usize, Reg> {
        match r {
            Ref::Foreign => Err(Reg::Foreign(ObjectKind::ProviderContext)),
            Ref::Ours(i) if self.contexts[i].removed => Err(Reg::Unknown(ObjectKind::ProviderContext)),
            Ref::Ours(i) => Ok(i),
        }
    }

    fn authority(&self, r: Ref) -> Result<usize, Reg> {
        match r {
            Ref::Foreign => Err(Reg::Foreign(ObjectKind::Authority)),
            Ref::Ours(i) if self.authorities[i].removed => Err(Reg::Unknown(ObjectKind::Authority)),
            Ref::Ours(i) => Ok(i),
        }
    }

    fn mechanism(&self, r: Ref) -> Result<usize, Reg> {
        match r {
            Ref::Foreign => Err(Reg::Foreign(ObjectKind::Mechanism)),
            Ref::Ours(i) if self.mechanisms[i].removed => Err(Reg::Unknown(ObjectKind::Mechanism)),
            Ref::Ours(i) => Ok(i),
        }
    }

    /// Mechanisms still registered (not removed).
    pub fn registered(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.mechanisms.len()).filter(|&m| !self.mechanisms[m].removed)
    }

    fn count(&self, mechanism: usize, matches: impl Fn(&Place) -> bool) -> usize {
        self.allocations.iter().filter(|a| a.mechanism == mechanism && matches(&a.place)).count()
    }

    /// Recorded allocations of `mechanism` (live, or lost with its device), and the
    /// unrecorded blocks its allocator still holds.
    pub fn live(&self, mechanism: usize) -> usize {
        self.count(mechanism, |p| *p == Place::Record) + self.mechanisms[mechanism].unrecorded as usize
    }

    /// Releases of `mechanism` held by queues (its in-flight count in this
    /// single-threaded model).
    pub fn in_flight(&self, mechanism: usize) -> usize {
        self.count(mechanism, |p| matches!(p, Place::Queued(_)))
    }

    fn lost_reason(&self, mechanism: usize) -> String {
        self.mechanisms[mechanism].lost_reason.clone().unwrap_or_else(|| "device invalidated".to_owned())
    }

    // --- faults -----------------------------------------------------------------

    /// Plans `fault` on the `nth` (1 = next) `on` call of `mechanism`'s allocator,
    /// as `FaultyAllocator::fail_nth` / `quarantine_nth_release` / `panic_on_nth` do.
    pub fn plan_fault(&mut self, mechanism: usize, on: FaultOn, nth: u64, fault: Fault) {
        assert!(on != FaultOn::ForgetLost || fault == Fault::Panic, "forget_lost can only panic");
        self.mechanisms[mechanism].faults.push(Planned { on, remaining: nth, fault });
    }

    /// Drops every pending fault of `mechanism` (`FaultyAllocator::clear`).
    pub fn clear_faults(&mut self, mechanism: usize) {
        self.mechanisms[mechanism].faults.clear();
    }

    /// One `on` call of `mechanism`'s allocator: counts it against every pending
    /// fault for that callback and returns the first that falls due (one per call;
    /// two due at once fire on consecutive calls), exactly as `FaultyAllocator` does.
    fn take_fault(&mut self, mechanism: usize, on: FaultOn) -> Option<Fault> {
        let faults = &mut self.mechanisms[mechanism].faults;
        for planned in faults.iter_mut().filter(|p| p.on == on) {
            planned.remaining = planned.remaining.saturating_sub(1);
        }
        let due = faults.iter().position(|p| p.on == on && p.remaining == 0)?;
        Some(faults.remove(due).fault)
    }

    // --- allocator calls ----------------------------------------------------------

    fn quarantine(&mut self, allocation: usize, unmapped: usize, residual: usize, reason: Reason) {
        self.allocations[allocation].place = Place::Quarantined { unmapped, residual, reason };
        let mechanism = self.allocations[allocation].mechanism;
        self.mechanisms[mechanism].quarantine.push(allocation);
    }

    fn quarantine_whole(&mut self, allocation: usize, reason: Reason) {
        let bytes = self.allocations[allocation].bytes;
        self.quarantine(allocation, 0, bytes, reason);
    }

    /// One call of the allocator's release of a `bytes`-byte block of `mechanism`.
    /// Updates the call and heap counts; the caller moves the block.
    fn call_release(&mut self, mechanism: usize, bytes: usize) -> Released {
        self.mechanisms[mechanism].calls.release += 1;
        let released = match self.take_fault(mechanism, FaultOn::Release) {
            None => Released::Complete,
            Some(Fault::Fail) => Released::Failed,
            Some(Fault::Panic) => Released::Panicked,
            Some(Fault::Quarantine { unmapped, residual }) => {
                // `ReleaseOutcome::quarantined` corrects a claim larger than the block.
                if unmapped.checked_add(residual).is_some_and(|sum| sum <= bytes) {
                    Released::Quarantined { unmapped, residual, reason: Reason::Injected }
                } else {
                    Released::Quarantined { unmapped: 0, residual: bytes, reason: Reason::Dishonest }
                }
            }
        };
        if let Released::Complete = released {
            let calls = &mut self.mechanisms[mechanism].calls;
            calls.heap_live -= 1;
            calls.heap_live_bytes -= bytes;
        }
        released
    }

    /// A release nobody holds a handle for any more (drop, queue): a refusal is
    /// quarantined with the allocator's error, a panic with the whole block owned.
    /// Returns whether it panicked.
    fn release_orphan(&mut self, allocation: usize) -> bool {
        let (mechanism, bytes) = (self.allocations[allocation].mechanism, self.allocations[allocation].bytes);
        match self.call_release(mechanism, bytes) {
            Released::Complete => self.allocations[allocation].place = Place::Released,
            Released::Failed => self.quarantine_whole(allocation, Reason::Injected),
            Released::Quarantined { unmapped, residual, reason } => {
                self.quarantine(allocation, unmapped, residual, reason)
            }
            Released::Panicked => {
                self.quarantine_whole(allocation, Reason::Panicked);
                return true;
            }
        }
        false
    }

    /// One call of `mechanism`'s allocate for `bytes`: `Ok` when the heap handed a
    /// block out (counted in the heap), `Err(out)` for an injected fault or the heap's
    /// limit.
    fn call_allocate(&mut self, mechanism: usize, bytes: usize) -> Result<(), Out> {
        self.mechanisms[mechanism].calls.allocate += 1;
        match self.take_fault(mechanism, FaultOn::Allocate) {
            Some(Fault::Panic) => return Err(Out::Panicked),
            Some(_) => return Err(Out::AllocAllocator),
            None => {}
        }
        let calls = &mut self.mechanisms[mechanism].calls;
        if self.heap_limit.is_some_and(|limit| calls.heap_live_bytes.checked_add(bytes).is_none_or(|t| t > limit)) {
            return Err(Out::AllocAllocator);
        }
        calls.heap_live += 1;
        calls.heap_live_bytes += bytes;
        Ok(())
    }

    // --- registration -----------------------------------------------------------

    /// `register_provider_context(device, _)`.
    pub fn register_context(&mut self, device: DeviceKey) -> Out {
        self.contexts.push(Context { device, state: ContextState::Live, removed: false });
        Out::Registered
    }

    /// `register_authority(device, _)`.
    pub fn register_authority(&mut self, device: DeviceKey) -> Out {
        self.authorities.push(Authority { device, removed: false });
        Out::Registered
    }

    /// `register_allocator_with(context, authority, allocator on device, options)`,
    /// `policy: None` being the device's default drop policy. The first mechanism of
    /// a device with no selection becomes its selection.
    pub fn register_allocator(
        &mut self,
        context: Ref,
        authority: Ref,
        device: DeviceKey,
        policy: Option<Policy>,
    ) -> Out {
        let c = match self.context(context) {
            Ok(c) => c,
            Err(e) => return Out::Registry(e),
        };
        let a = match self.authority(authority) {
            Ok(a) => a,
            Err(e) => return Out::Registry(e),
        };
        let context = &self.contexts[c];
        if context.state != ContextState::Live {
            return Out::Registry(Reg::ContextNotLive(context.state));
        }
        if self.authorities[a].device != context.device {
            return Out::Registry(Reg::DeviceMismatch("authority"));
        }
        if device != context.device {
            return Out::Registry(Reg::DeviceMismatch("allocator"));
        }
        if let Some(Policy::Defer(queue)) = policy
            && self.devices[queue] != device
        {
            return Out::Registry(Reg::DeviceMismatch("drop policy's deferred-release queue"));
        }
        self.mechanisms.push(Mechanism {
            context: c,
            authority: a,
            device,
            state: MechanismState::Active,
            removed: false,
            policy: policy.unwrap_or_else(|| Policy::default_for(device)),
            lost_reason: None,
            quarantine: Vec::new(),
            calls: Calls::default(),
            unrecorded: 0,
            unrecorded_bytes: 0,
            unrecorded_forgotten: 0,
            faults: Vec::new(),
        });
        let selected = &mut self.selection[self.devices.iter().position(|d| *d == device).expect("a model device")];
        if selected.is_none() {
            *selected = Some(self.mechanisms.len() - 1);
        }
        Out::Registered
    }

    /// `with_memory(allocator on device)`: an implicit context, authority and
    /// mechanism (default drop policy), then a binding of that mechanism.
    pub fn with_memory(&mut self, device: DeviceKey) -> Out {
        self.register_context(device);
        self.register_authority(device);
        let (c, a) = (self.contexts.len() - 1, self.authorities.len() - 1);
        let registered = self.register_allocator(Ref::Ours(c), Ref::Ours(a), device, None);
        debug_assert_eq!(registered, Out::Registered, "a fresh context and authority admit the allocator");
        self.bind_registered(Ref::Ours(self.mechanisms.len() - 1))
    }

    // --- selection and binding ----------------------------------------------------

    /// `select(mechanism)`: only an active mechanism can be selected.
    pub fn select(&mut self, mechanism: Ref) -> Out {
        let m = match self.mechanism(mechanism) {
            Ok(m) => m,
            Err(e) => return Out::Registry(e),
        };
        let state = self.mechanisms[m].state;
        if state != MechanismState::Active {
            return Out::Registry(Reg::InvalidState(state));
        }
        let d = self.device_index(self.mechanisms[m].device);
        self.selection[d] = Some(m);
        Out::Done
    }

    fn new_binding(&mut self, mechanism: usize) -> Out {
        self.bindings.push(mechanism);
        Out::Bound { mechanism }
    }

    /// `bind(device)`; on success the new binding's key is `self.bindings.len() - 1`.
    pub fn bind(&mut self, device: DeviceKey) -> Out {
        match self.selection[self.device_index(device)] {
            None => Out::BindNoSelection,
            // Retirement and invalidation drop the selection, so it is always active.
            Some(m) => self.new_binding(m),
        }
    }

    /// `bind_registered(mechanism)`; on success as [`Model::bind`].
    pub fn bind_registered(&mut self, mechanism: Ref) -> Out {
        let m = match self.mechanism(mechanism) {
            Ok(m) => m,
            Err(e) => return Out::BindRegistry(e),
        };
        let state = self.mechanisms[m].state;
        if state != MechanismState::Active {
            return Out::BindInactive(state);
        }
        self.new_binding(m)
    }

    // --- allocation -------------------------------------------------------------

    fn admit_allocation(&self, mechanism: usize) -> Result<(), Out> {
        match self.mechanisms[mechanism].state {
            MechanismState::Active => Ok(()),
            MechanismState::Retired => Err(Out::AllocInactive(MechanismState::Retired)),
            _ => Err(Out::AllocDeviceLost(self.lost_reason(mechanism))),
        }
    }

    /// `allocate` through binding `key`; on success the allocation's index is
    /// `self.allocations.len() - 1`.
    pub fn allocate(&mut self, key: usize, bytes: usize) -> Out {
        let mechanism = self.bindings[key];
        if let Err(out) = self.admit_allocation(mechanism).and_then(|()| self.call_allocate(mechanism, bytes)) {
            return out;
        }
        self.allocations.push(Allocation { mechanism, binding: key, bytes, place: Place::Record });
        Out::Allocated { mechanism, bytes }
    }

    /// Books an `allocate` through binding `key` that the registry could not record
    /// (its identity serials ran out): the allocator made the block, and the registry
    /// gave it straight back through `release`. A given-back block the allocator does
    /// not release completely stays in its heap with no record; the registry keeps it
    /// as live ([`Mechanism::unrecorded`]) until termination hands it to `forget_lost`. Returns [`Out::IdentityExhausted`], or
    /// [`Out::Panicked`] when a callback panicked.
    pub fn allocate_unrecorded(&mut self, key: usize, bytes: usize) -> Out {
        let mechanism = self.bindings[key];
        if let Err(out) = self.admit_allocation(mechanism).and_then(|()| self.call_allocate(mechanism, bytes)) {
            return out;
        }
        let out = match self.call_release(mechanism, bytes) {
            Released::Complete => return Out::IdentityExhausted,
            Released::Panicked => Out::Panicked,
            _ => Out::IdentityExhausted,
        };
        self.mechanisms[mechanism].unrecorded += 1;
        self.mechanisms[mechanism].unrecorded_bytes += bytes;
        out
    }

    /// The checks every handle operation makes first: same registry, same binding.
    fn owns(&self, allocation: usize, through: Through) -> Result<(), Handle> {
        match through {
            Through::Foreign => Err(Handle::Foreign),
            Through::Binding(key) if key != self.allocations[allocation].binding => Err(Handle::Mismatch),
            Through::Binding(_) => Ok(()),
        }
    }

    /// The lifecycle check of release paths and views (active or retired admitted).
    fn releasable(&self, allocation: usize) -> Result<usize, Handle> {
        let mechanism = self.allocations[allocation].mechanism;
        match self.mechanisms[mechanism].state {
            MechanismState::DeviceLost => Err(Handle::DeviceLost(self.lost_reason(mechanism))),
            MechanismState::Terminated => Err(Handle::Stale),
            _ => Ok(mechanism),
        }
    }

    /// `release` of the held handle of allocation `allocation` through `through`.
    pub fn release(&mut self, allocation: usize, through: Through) -> Out {
        let mechanism = match self.owns(allocation, through).and_then(|()| self.releasable(allocation)) {
            Ok(m) => m,
            Err(e) => return Out::Handle(e),
        };
        assert_eq!(self.allocations[allocation].place, Place::Record, "a held handle of a live mechanism is recorded");
        let bytes = self.allocations[allocation].bytes;
        match self.call_release(mechanism, bytes) {
            Released::Complete => {
                self.allocations[allocation].place = Place::Released;
                Out::Released(ReleaseSummary::Complete { unmapped_bytes: bytes })
            }
            // Nothing was mutated: the record is live again and the handle comes back.
            Released::Failed => Out::Handle(Handle::ReleaseFailed),
            Released::Quarantined { unmapped, residual, reason } => {
                self.quarantine(allocation, unmapped, residual, reason);
                Out::Released(ReleaseSummary::Quarantined { unmapped_bytes: unmapped, residual_bytes: residual })
            }
            // The handle is consumed; the whole block is quarantined.
            Released::Panicked => {
                self.quarantine_whole(allocation, Reason::Panicked);
                Out::Panicked
            }
        }
    }

    /// `release_deferred` of the held handle of `allocation` through `through` to the
    /// queue of device index `queue`. No callback runs.
    pub fn release_deferred(&mut self, allocation: usize, through: Through, queue: usize) -> Out {
        if let Err(e) = self.owns(allocation, through) {
            return Out::Handle(e);
        }
        let mechanism = self.allocations[allocation].mechanism;
        if self.devices[queue] != self.mechanisms[mechanism].device {
            return Out::Handle(Handle::QueueWrongDevice);
        }
        if let Err(e) = self.releasable(allocation) {
            return Out::Handle(e);
        }
        if self.queues[queue].len() >= self.queue_capacity {
            return Out::Handle(Handle::QueueFull);
        }
        self.queues[queue].push(allocation);
        self.allocations[allocation].place = Place::Queued(queue);
        Out::Deferred
    }

    /// Runs every release held by the queue of device index `queue`, in order.
    pub fn run_queue(&mut self, queue: usize) -> Out {
        self.run_queued(queue, usize::MAX)
    }

    /// Runs the `count` oldest releases held by the queue of device index `queue`.
    /// A release that panics ends the run: the releases taken with it and not yet
    /// run are dropped unrun (abandoned), and the result is [`Out::Panicked`].
    pub fn run_queued(&mut self, queue: usize, count: usize) -> Out {
        let n = count.min(self.queues[queue].len());
        let mut taken = self.queues[queue].drain(..n).collect::<VecDeque<_>>();
        while let Some(allocation) = taken.pop_front() {
            let mechanism = self.allocations[allocation].mechanism;
            if !self.mechanisms[mechanism].state.healthy() {
                // Due after device loss: no callback, the block is recorded again (lost).
                self.allocations[allocation].place = Place::Record;
                continue;
            }
            if self.release_orphan(allocation) {
                for rest in taken {
                    self.quarantine_whole(rest, Reason::Abandoned);
                }
                return Out::Panicked;
            }
        }
        Out::Done
    }

    /// Drops every release held by the queue of device index `queue` unrun.
    pub fn drop_queue(&mut self, queue: usize) -> Out {
        self.drop_queued(queue, usize::MAX)
    }

    /// Drops the `count` oldest releases held by the queue of device index `queue`
    /// unrun: each block is quarantined as abandoned.
    pub fn drop_queued(&mut self, queue: usize, count: usize) -> Out {
        let n = count.min(self.queues[queue].len());
        for allocation in self.queues[queue].drain(..n).collect::<Vec<_>>() {
            self.quarantine_whole(allocation, Reason::Abandoned);
        }
        Out::Done
    }

    /// Dropping the held handle of `allocation`, by its mechanism's drop policy.
    /// Returns [`Out::Done`], or [`Out::Panicked`] when a drop-time release panicked.
    pub fn drop_handle(&mut self, allocation: usize) -> Out {
        let mechanism = self.allocations[allocation].mechanism;
        let m = &self.mechanisms[mechanism];
        if !m.state.healthy() {
            return Out::Done; // lost or terminated: nothing happens
        }
        match m.policy {
            Policy::Release => {
                if self.release_orphan(allocation) {
                    return Out::Panicked;
                }
            }
            Policy::Quarantine => self.quarantine_whole(allocation, Reason::Abandoned),
            Policy::Defer(queue) => {
                // Registration refused a queue of another device: only a full one refuses.
                if self.queues[queue].len() >= self.queue_capacity {
                    self.quarantine_whole(allocation, Reason::Abandoned);
                } else {
                    self.queues[queue].push(allocation);
                    self.allocations[allocation].place = Place::Queued(queue);
                }
            }
        }
        Out::Done
    }

    /// `view(offset, len)` of the held handle of `allocation`: bounds first, then
    /// the lifecycle.
    pub fn view(&self, allocation: usize, offset: usize, len: usize) -> Out {
        let bytes = self.allocations[allocation].bytes;
        if offset.checked_add(len).is_none_or(|end| end > bytes) {
            return Out::ViewOutOfBounds;
        }
        match self.releasable(allocation) {
            Ok(_) => Out::Viewed { len },
            Err(e) => Out::ViewHandle(e),
        }
    }

    // --- lifecycles -----------------------------------------------------------------

    /// `retire(mechanism)`: active only; drops its selection.
    pub fn retire(&mut self, mechanism: Ref) -> Out {
        let m = match self.mechanism(mechanism) {
            Ok(m) => m,
            Err(e) => return Out::Registry(e),
        };
        let state = self.mechanisms[m].state;
        if state != MechanismState::Active {
            return Out::Registry(Reg::InvalidState(state));
        }
        self.mechanisms[m].state = MechanismState::Retired;
        let d = self.device_index(self.mechanisms[m].device);
        if self.selection[d] == Some(m) {
            self.selection[d] = None;
        }
        Out::Done
    }

    /// `invalidate_device(device, reason)`; returns the outcome and the reason the
    /// caller must pass (`"loss n"` for the n-th invalidation). No callback runs.
    pub fn invalidate(&mut self, device: DeviceKey) -> (Out, String) {
        self.losses += 1;
        let reason = format!("loss {}", self.losses);
        let mut mechanisms = 0;
        for mech in self.mechanisms.iter_mut().filter(|m| !m.removed && m.device == device) {
            if mech.lost_reason.is_none() {
                mech.lost_reason = Some(reason.clone());
            }
            if mech.state.healthy() {
                mech.state = MechanismState::DeviceLost;
                mechanisms += 1;
            }
        }
        let mut contexts = 0;
        for c in self.contexts.iter_mut().filter(|c| !c.removed && c.device == device) {
            if c.state == ContextState::Live {
                c.state = ContextState::Lost;
                contexts += 1;
            }
        }
        let d = self.device_index(device);
        let selection_dropped = self.selection[d].take().is_some();
        (Out::Invalidated { mechanisms, contexts, selection_dropped }, reason)
    }

    /// `confirm_context_terminated(context)`: refused while live or while releases
    /// are queued; otherwise terminates every mechanism of the context, retires
    /// their records and quarantine and hands them to one `forget_lost` each
    /// (every one is called even when one panics; then the result is [`Out::Panicked`]).
    pub fn confirm(&mut self, context: Ref) -> Out {
        let c = match self.context(context) {
            Ok(c) => c,
            Err(e) => return Out::Registry(e),
        };
        match self.contexts[c].state {
            ContextState::Live => return Out::Registry(Reg::ContextStillLive),
            ContextState::Terminated => {
                return Out::Terminated {
                    already: true,
                    mechanisms: 0,
                    lost_allocations: 0,
                    lost_bytes: 0,
                    discharged: 0,
                };
            }
            ContextState::Lost => {}
        }
        let mechanisms: Vec<usize> = self.registered().filter(|&m| self.mechanisms[m].context == c).collect();
        let in_flight: usize = mechanisms.iter().map(|&m| self.in_flight(m)).sum();
        if in_flight > 0 {
            return Out::Registry(Reg::ContextNotQuiescent(in_flight));
        }
        let (mut lost_allocations, mut lost_bytes, mut discharged, mut panicked) = (0, 0, 0, false);
        for &m in &mechanisms {
            assert_eq!(self.mechanisms[m].state, MechanismState::DeviceLost, "a lost context's mechanisms are lost");
            self.mechanisms[m].state = MechanismState::Terminated;
            let mut blocks = 0;
            for a in self.allocations.iter_mut().filter(|a| a.mechanism == m) {
                match a.place {
                    Place::Record => {
                        lost_allocations += 1;
                        lost_bytes += a.bytes;
                    }
                    Place::Quarantined { .. } => discharged += 1,
                    _ => continue,
                }
                a.place = Place::Forgotten;
                blocks += 1;
            }
            let mech = &mut self.mechanisms[m];
            lost_allocations += mech.unrecorded as usize;
            lost_bytes += mech.unrecorded_bytes;
            blocks += mech.unrecorded;
            mech.unrecorded_forgotten += std::mem::take(&mut mech.unrecorded);
            mech.unrecorded_bytes = 0;
            self.mechanisms[m].quarantine.clear();
            self.mechanisms[m].calls.forget_lost += 1;
            self.mechanisms[m].calls.forgotten_blocks += blocks;
            panicked |= self.take_fault(m, FaultOn::ForgetLost) == Some(Fault::Panic);
        }
        self.contexts[c].state = ContextState::Terminated;
        if panicked {
            return Out::Panicked;
        }
        Out::Terminated { already: false, mechanisms: mechanisms.len(), lost_allocations, lost_bytes, discharged }
    }

    /// `retry_quarantined(mechanism)` on a healthy mechanism: retries every
    /// quarantined block in list order. A panicking release stops the retry: that
    /// block and the ones not yet retried stay quarantined, in order.
    pub fn retry(&mut self, mechanism: Ref) -> Out {
        let m = match self.mechanism(mechanism) {
            Ok(m) => m,
            Err(e) => return Out::Registry(e),
        };
        let state = self.mechanisms[m].state;
        if !state.healthy() {
            return Out::Registry(Reg::InvalidState(state));
        }
        let (mut released, mut still) = (0, Vec::new());
        let mut pending = std::mem::take(&mut self.mechanisms[m].quarantine).into_iter();
        while let Some(allocation) = pending.next() {
            let Place::Quarantined { unmapped, residual, reason } = self.allocations[allocation].place else {
                unreachable!("the quarantine list holds quarantined blocks")
            };
            let bytes = self.allocations[allocation].bytes;
            let place = match self.call_release(m, bytes) {
                Released::Complete => {
                    released += 1;
                    self.allocations[allocation].place = Place::Released;
                    continue;
                }
                Released::Failed => Place::Quarantined { unmapped, residual, reason: Reason::Injected },
                Released::Quarantined { unmapped: more, residual, reason } => {
                    // Unmapped bytes accumulate across retries but never exceed what the
                    // block minus its residual leaves (the honesty rule).
                    let ceiling = bytes.saturating_sub(residual);
                    Place::Quarantined { unmapped: (unmapped + more).min(ceiling), residual, reason }
                }
                Released::Panicked => {
                    let _ = reason;
                    self.allocations[allocation].place =
                        Place::Quarantined { unmapped, residual, reason: Reason::Panicked };
                    still.push(allocation);
                    still.extend(pending);
                    self.mechanisms[m].quarantine = still;
                    return Out::Panicked;
                }
            };
            self.allocations[allocation].place = place;
            still.push(allocation);
        }
        let out = Out::Retried { released, still: still.len() };
        self.mechanisms[m].quarantine = still;
        out
    }

    /// `remove(mechanism)`: retired or terminated, and quiescent.
    pub fn remove(&mut self, mechanism: Ref) -> Out {
        let m = match self.mechanism(mechanism) {
            Ok(m) => m,
            Err(e) => return Out::Registry(e),
        };
        let state = self.mechanisms[m].state;
        if matches!(state, MechanismState::Active | MechanismState::DeviceLost) {
            return Out::Registry(Reg::InvalidState(state));
        }
        let (live, quarantined, in_flight) = (self.live(m), self.mechanisms[m].quarantine.len(), self.in_flight(m));
        if live + quarantined + in_flight > 0 {
            let kind = ObjectKind::Mechanism;
            return Out::Registry(Reg::NotQuiescent { kind, live, quarantined, in_flight, dependents: 0 });
        }
        self.mechanisms[m].removed = true;
        Out::Done
    }

    /// `remove_provider_context(context)`: no registered mechanism may use it.
    pub fn remove_context(&mut self, context: Ref) -> Out {
        let c = match self.context(context) {
            Ok(c) => c,
            Err(e) => return Out::Registry(e),
        };
        let dependents = self.registered().filter(|&m| self.mechanisms[m].context == c).count();
        if dependents > 0 {
            let kind = ObjectKind::ProviderContext;
            return Out::Registry(Reg::NotQuiescent { kind, live: 0, quarantined: 0, in_flight: 0, dependents });
        }
        self.contexts[c].removed = true;
        Out::Done
    }

    /// `remove_authority(authority)`: no registered mechanism may use it.
    pub fn remove_authority(&mut self, authority: Ref) -> Out {
        let a = match self.authority(authority) {
            Ok(a) => a,
            Err(e) => return Out::Registry(e),
        };
        let dependents = self.registered().filter(|&m| self.mechanisms[m].authority == a).count();
        if dependents > 0 {
            let kind = ObjectKind::Authority;
            return Out::Registry(Reg::NotQuiescent { kind, live: 0, quarantined: 0, in_flight: 0, dependents });
        }
        self.authorities[a].removed = true;
        Out::Done
    }

    // --- what the registry must show ---------------------------------------------------

    /// What `allocation_state` must say about allocation `allocation`.
    pub fn allocation_state(&self, allocation: usize) -> AllocationState {
        let a = &self.allocations[allocation];
        let m = &self.mechanisms[a.mechanism];
        if m.removed || m.state == MechanismState::Terminated {
            return AllocationState::Gone;
        }
        match a.place {
            Place::Record if m.state == MechanismState::DeviceLost => AllocationState::Lost,
            Place::Record => AllocationState::Live,
            Place::Quarantined { .. } => AllocationState::Quarantined,
            Place::Queued(_) | Place::Released | Place::Forgotten => AllocationState::Gone,
        }
    }

    /// What `is_valid` must say about a handle the caller still holds.
    pub fn handle_valid(&self, allocation: usize) -> bool {
        let a = &self.allocations[allocation];
        a.place == Place::Record && self.mechanisms[a.mechanism].state != MechanismState::Terminated
    }

    /// The snapshot the registry must show.
    pub fn view_all(&self) -> View {
        let contexts = (0..self.contexts.len())
            .filter(|&c| !self.contexts[c].removed)
            .map(|c| (c, self.contexts[c].device, self.contexts[c].state))
            .collect();
        let authorities = (0..self.authorities.len())
            .filter(|&a| !self.authorities[a].removed)
            .map(|a| (a, self.authorities[a].device))
            .collect();
        let mechanisms = self.registered().map(|m| self.view_mechanism(m)).collect();
        View { contexts, authorities, mechanisms, selection: self.selection.clone() }
    }

    /// Mechanism `m` as its snapshot must show it.
    pub fn view_mechanism(&self, m: usize) -> MechanismView {
        let mech = &self.mechanisms[m];
        let mut quarantined: Vec<_> = mech
            .quarantine
            .iter()
            .map(|&a| {
                let Place::Quarantined { unmapped, residual, reason } = self.allocations[a].place else {
                    unreachable!("the quarantine list holds quarantined blocks")
                };
                (a, (self.allocations[a].bytes, unmapped, residual, reason))
            })
            .collect();
        // Snapshots promise no order: compare by allocation index.
        quarantined.sort_unstable_by_key(|q| q.0);
        let live_bytes = self
            .allocations
            .iter()
            .filter(|a| a.mechanism == m && a.place == Place::Record)
            .map(|a| a.bytes)
            .sum::<usize>()
            + mech.unrecorded_bytes;
        MechanismView {
            index: m,
            device: mech.device,
            context: mech.context,
            authority: mech.authority,
            state: mech.state,
            selected: self.selection[self.device_index(mech.device)] == Some(m),
            live_allocations: self.live(m),
            live_bytes,
            in_flight: self.in_flight(m),
            quarantined,
            lost_reason: (!mech.state.healthy()).then(|| self.lost_reason(m)),
        }
    }

    /// Internal bookkeeping must add up: every block the heap still holds is
    /// recorded, queued, quarantined, forgotten or an unrecorded leftover, every
    /// released one is gone from the heap (released exactly once), and each
    /// quarantine list holds exactly its mechanism's quarantined blocks.
    ///
    /// # Panics
    /// When the model's own books disagree (a bug in the model).
    pub fn check_conservation(&self) {
        for (m, mech) in self.mechanisms.iter().enumerate() {
            let held = self.count(m, |p| *p != Place::Released) as u64 + mech.unrecorded + mech.unrecorded_forgotten;
            assert_eq!(held, mech.calls.heap_live, "model conservation broken for mechanism {m}");
            let quarantined = self.count(m, |p| matches!(p, Place::Quarantined { .. }));
            assert_eq!(mech.quarantine.len(), quarantined, "model quarantine list of mechanism {m}");
        }
        for (d, queue) in self.queues.iter().enumerate() {
            assert!(queue.len() <= self.queue_capacity, "queue {d} over capacity");
            for &a in queue {
                assert_eq!(self.allocations[a].place, Place::Queued(d), "queued allocation {a} elsewhere");
            }
        }
    }
}
