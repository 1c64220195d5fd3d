//! A plain, sequential reference model of the `BindingRegistry` (DESIGN.md section 4,
//! docs/LIFECYCLE.md): states of contexts and mechanisms, the selection per device,
//! where every allocation is (recorded, queued, quarantined, released, forgotten), the
//! faults planned on each allocator, and the callbacks each allocator must have seen.
//!
//! It knows nothing of the real registry: objects are named by the index of their
//! registration, bindings by a key shared between clones, allocations by the index of
//! their allocation. Every operation returns the [`Out`] the registry must produce.

use std::collections::{BTreeMap, VecDeque};

use memory_api::ReleaseSummary;
use memory_api::{DeviceKey, Tier};
use memory_binding::{AllocationState, ContextState, MechanismState, ObjectKind};

/// The simulated devices: two accelerators (quarantine on drop) and one host domain
/// (release on drop).
pub(crate) const DEVICES: [DeviceKey; 3] = [DeviceKey::device(0), DeviceKey::device(1), DeviceKey::host(1)];

/// Index of `device` in [`DEVICES`].
pub(crate) fn device_index(device: DeviceKey) -> usize {
    DEVICES.iter().position(|d| *d == device).expect("model devices only")
}

/// A reference to a registry object: one registered here (by index, possibly
/// removed since), or one issued by another registry.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Ref {
    Ours(usize),
    Foreign,
}

/// The binding a release goes through: one of ours (by key), or another registry's.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Through {
    Binding(usize),
    Foreign,
}

/// A cold-path error, by variant and the payload that matters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Reg {
    Foreign(ObjectKind),
    Unknown(ObjectKind),
    DeviceMismatch(&'static str),
    ContextNotLive(ContextState),
    ContextStillLive,
    ContextNotQuiescent(usize),
    InvalidState(MechanismState),
    NotQuiescent { kind: ObjectKind, live: usize, quarantined: usize, in_flight: usize, dependents: usize },
    Other(String),
}

/// A handle error (the reason inside `Rejected`, or inside a view error).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Handle {
    Foreign,
    Mismatch,
    Stale,
    DeviceLost(String),
    Inactive(MechanismState),
    ReleaseFailed,
    QueueFull,
    QueueWrongDevice,
    Other(String),
}

/// What one operation produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Out {
    /// The operation had nothing to act on (no binding or handle yet).
    Skipped,
    Done,
    Registered,
    Bound {
        mechanism: usize,
    },
    Allocated {
        mechanism: usize,
        bytes: usize,
    },
    Released(ReleaseSummary),
    Deferred,
    Viewed {
        len: usize,
    },
    Invalidated {
        mechanisms: usize,
        contexts: usize,
        selection_dropped: bool,
    },
    Terminated {
        already: bool,
        mechanisms: usize,
        lost_allocations: usize,
        lost_bytes: usize,
        discharged: usize,
    },
    Retried {
        released: usize,
        still: usize,
    },
    Registry(Reg),
    BindNoSelection,
    BindInactive(MechanismState),
    BindRegistry(Reg),
    AllocInactive(MechanismState),
    AllocDeviceLost(String),
    AllocAllocator,
    Handle(Handle),
    ViewOutOfBounds,
    ViewHandle(Handle),
    Other(String),
}

impl Out {
    /// Errors raised after the allocator was called (the callback itself failed).
    pub(crate) fn called_back(&self) -> bool {
        matches!(self, Out::AllocAllocator | Out::Handle(Handle::ReleaseFailed))
    }

    /// Whether this is a refusal.
    pub(crate) fn is_error(&self) -> bool {
        matches!(
            self,
            Out::Registry(_)
                | Out::BindNoSelection
                | Out::BindInactive(_)
                | Out::BindRegistry(_)
                | Out::AllocInactive(_)
                | Out::AllocDeviceLost(_)
                | Out::AllocAllocator
                | Out::Handle(_)
                | Out::ViewOutOfBounds
                | Out::ViewHandle(_)
                | Out::Other(_)
        )
    }
}

/// Why a block sits in quarantine, as the snapshot's reason text classifies it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Reason {
    /// The allocator's (injected) error.
    Injected,
    /// Dropped without a release path, or its queued release was dropped.
    Abandoned,
    /// The allocator claimed more than the block.
    Dishonest,
}

/// A fault planned on a mechanism's `FaultyAllocator` for its next release.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum ReleaseFault {
    Fail,
    Quarantine { unmapped: usize, residual: usize },
}

/// What dropping a live handle does on this mechanism.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Policy {
    Release,
    Quarantine,
    Defer,
}

/// Where an allocation is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// Recorded in the registry (live, or lost with its device).
    Record,
    /// Taken by a deferred release and held by the queue of device `usize`.
    Queued(usize),
    Quarantined {
        unmapped: usize,
        residual: usize,
        reason: Reason,
    },
    /// Completely released through its allocator (exactly once).
    Released,
    /// Retired by termination and handed to `forget_lost`.
    Forgotten,
}

#[derive(Clone, Debug)]
pub(crate) struct Context {
    pub(crate) device: DeviceKey,
    pub(crate) state: ContextState,
    pub(crate) removed: bool,
}

#[derive(Clone, Debug)]
pub(crate) struct Authority {
    pub(crate) device: DeviceKey,
    pub(crate) removed: bool,
}

/// Callbacks an allocator must have seen.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Calls {
    pub(crate) allocate: u64,
    pub(crate) release: u64,
    pub(crate) forget_lost: u64,
    pub(crate) forgotten_blocks: u64,
    /// Blocks the heap under the allocator still holds (allocated, not completely
    /// released; forgotten blocks stay in a `HostHeap`).
    pub(crate) heap_live: u64,
}

#[derive(Clone, Debug)]
pub(crate) struct Mechanism {
    pub(crate) context: usize,
    pub(crate) authority: usize,
    pub(crate) device: DeviceKey,
    pub(crate) state: MechanismState,
    pub(crate) removed: bool,
    pub(crate) policy: Policy,
    pub(crate) lost_reason: Option<String>,
    pub(crate) alloc_faults: usize,
    pub(crate) release_faults: VecDeque<ReleaseFault>,
    /// Quarantined allocations in the registry's list order.
    pub(crate) quarantine: Vec<usize>,
    pub(crate) calls: Calls,
}

#[derive(Clone, Debug)]
pub(crate) struct Allocation {
    pub(crate) mechanism: usize,
    pub(crate) binding: usize,
    pub(crate) bytes: usize,
    pub(crate) place: Place,
}

/// One mechanism as a snapshot should show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MechanismView {
    pub(crate) index: usize,
    pub(crate) device: DeviceKey,
    pub(crate) context: usize,
    pub(crate) authority: usize,
    pub(crate) state: MechanismState,
    pub(crate) selected: bool,
    pub(crate) live_allocations: usize,
    pub(crate) live_bytes: usize,
    pub(crate) in_flight: usize,
    /// allocation index -> (bytes, unmapped, residual, reason)
    pub(crate) quarantined: BTreeMap<usize, (usize, usize, usize, Reason)>,
    pub(crate) lost_reason: Option<String>,
}

/// The whole registry as a snapshot should show it (removed objects left out).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct View {
    pub(crate) contexts: Vec<(usize, DeviceKey, ContextState)>,
    pub(crate) authorities: Vec<(usize, DeviceKey)>,
    pub(crate) mechanisms: Vec<MechanismView>,
    pub(crate) selection: [Option<usize>; DEVICES.len()],
}

/// Capacity of each device's deferred-release queue in the model and in the test.
pub(crate) const QUEUE_CAPACITY: usize = 2;

/// The reference model.
#[derive(Clone, Debug, Default)]
pub(crate) struct Model {
    pub(crate) contexts: Vec<Context>,
    pub(crate) authorities: Vec<Authority>,
    pub(crate) mechanisms: Vec<Mechanism>,
    /// Binding key -> mechanism.
    pub(crate) bindings: Vec<usize>,
    pub(crate) allocations: Vec<Allocation>,
    pub(crate) selection: [Option<usize>; DEVICES.len()],
    /// Per device: queued allocations in queue order.
    pub(crate) queues: [Vec<usize>; DEVICES.len()],
    losses: usize,
}

/// What one allocator release returned, as the model predicts it.
enum Released {
    Complete,
    Failed,
    Quarantined { unmapped: usize, residual: usize, reason: Reason },
}

impl Model {
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

    fn registered(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.mechanisms.len()).filter(|&m| !self.mechanisms[m].removed)
    }

    fn count(&self, mechanism: usize, matches: impl Fn(&Place) -> bool) -> usize {
        self.allocations.iter().filter(|a| a.mechanism == mechanism && matches(&a.place)).count()
    }

    fn live(&self, mechanism: usize) -> usize {
        self.count(mechanism, |p| *p == Place::Record)
    }

    fn in_flight(&self, mechanism: usize) -> usize {
        self.count(mechanism, |p| matches!(p, Place::Queued(_)))
    }

    fn lost_reason(&self, mechanism: usize) -> String {
        self.mechanisms[mechanism].lost_reason.clone().unwrap_or_else(|| "device invalidated".to_owned())
    }

    fn quarantine(&mut self, allocation: usize, unmapped: usize, residual: usize, reason: Reason) {
        self.allocations[allocation].place = Place::Quarantined { unmapped, residual, reason };
        let mechanism = self.allocations[allocation].mechanism;
        self.mechanisms[mechanism].quarantine.push(allocation);
    }

    fn abandon(&mut self, allocation: usize) {
        let bytes = self.allocations[allocation].bytes;
        self.quarantine(allocation, 0, bytes, Reason::Abandoned);
    }

    /// One call of the allocator's release for `allocation`, consuming the next
    /// planned release fault. Updates the heap count; the caller moves the block.
    fn call_release(&mut self, allocation: usize) -> Released {
        let (mechanism, bytes) = (self.allocations[allocation].mechanism, self.allocations[allocation].bytes);
        let m = &mut self.mechanisms[mechanism];
        m.calls.release += 1;
        match m.release_faults.pop_front() {
            None => {
                m.calls.heap_live -= 1;
                Released::Complete
            }
            Some(ReleaseFault::Fail) => Released::Failed,
            Some(ReleaseFault::Quarantine { unmapped, residual }) => {
                // `ReleaseOutcome::quarantined` corrects a claim larger than the block.
                if unmapped.checked_add(residual).is_some_and(|sum| sum <= bytes) {
                    Released::Quarantined { unmapped, residual, reason: Reason::Injected }
                } else {
                    Released::Quarantined { unmapped: 0, residual: bytes, reason: Reason::Dishonest }
                }
            }
        }
    }

    /// A release nobody holds a handle for any more (drop, queue): a refusal is
    /// quarantined with the allocator's error.
    fn release_orphan(&mut self, allocation: usize) {
        match self.call_release(allocation) {
            Released::Complete => self.allocations[allocation].place = Place::Released,
            Released::Failed => {
                let bytes = self.allocations[allocation].bytes;
                self.quarantine(allocation, 0, bytes, Reason::Injected);
            }
            Released::Quarantined { unmapped, residual, reason } => {
                self.quarantine(allocation, unmapped, residual, reason)
            }
        }
    }

    pub(crate) fn register_context(&mut self, device: DeviceKey) -> Out {
        self.contexts.push(Context { device, state: ContextState::Live, removed: false });
        Out::Registered
    }

    pub(crate) fn register_authority(&mut self, device: DeviceKey) -> Out {
        self.authorities.push(Authority { device, removed: false });
        Out::Registered
    }

    pub(crate) fn register_allocator(&mut self, context: Ref, authority: Ref, device: DeviceKey, defer: bool) -> Out {
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
        let policy = match (defer, device.tier()) {
            (true, _) => Policy::Defer,
            (false, Tier::Host) => Policy::Release,
            (false, _) => Policy::Quarantine,
        };
        self.mechanisms.push(Mechanism {
            context: c,
            authority: a,
            device,
            state: MechanismState::Active,
            removed: false,
            policy,
            lost_reason: None,
            alloc_faults: 0,
            release_faults: VecDeque::new(),
            quarantine: Vec::new(),
            calls: Calls::default(),
        });
        let selected = &mut self.selection[device_index(device)];
        if selected.is_none() {
            *selected = Some(self.mechanisms.len() - 1);
        }
        Out::Registered
    }

    pub(crate) fn select(&mut self, mechanism: Ref) -> Out {
        let m = match self.mechanism(mechanism) {
            Ok(m) => m,
            Err(e) => return Out::Registry(e),
        };
        let state = self.mechanisms[m].state;
        if state != MechanismState::Active {
            return Out::Registry(Reg::InvalidState(state));
        }
        self.selection[device_index(self.mechanisms[m].device)] = Some(m);
        Out::Done
    }

    fn new_binding(&mut self, mechanism: usize) -> Out {
        self.bindings.push(mechanism);
        Out::Bound { mechanism }
    }

    /// `bind(device)`; on success the new binding's key is `self.bindings.len() - 1`.
    pub(crate) fn bind(&mut self, device: DeviceKey) -> Out {
        match self.selection[device_index(device)] {
            None => Out::BindNoSelection,
            // Retirement and invalidation drop the selection, so it is always active.
            Some(m) => self.new_binding(m),
        }
    }

    pub(crate) fn bind_registered(&mut self, mechanism: Ref) -> Out {
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

    /// `allocate` through binding `key`; on success the allocation's index is
    /// `self.allocations.len() - 1`.
    pub(crate) fn allocate(&mut self, key: usize, bytes: usize) -> Out {
        let mechanism = self.bindings[key];
        let m = &mut self.mechanisms[mechanism];
        match m.state {
            MechanismState::Active => {}
            MechanismState::Retired => return Out::AllocInactive(MechanismState::Retired),
            _ => return Out::AllocDeviceLost(self.lost_reason(mechanism)),
        }
        m.calls.allocate += 1;
        if m.alloc_faults > 0 {
            m.alloc_faults -= 1;
            return Out::AllocAllocator;
        }
        m.calls.heap_live += 1;
        self.allocations.push(Allocation { mechanism, binding: key, bytes, place: Place::Record });
        Out::Allocated { mechanism, bytes }
    }

    /// The checks every handle operation makes first: same registry, same binding.
    fn owns(&self, allocation: usize, through: Through) -> Result<(), Handle> {
        match through {
            Through::Foreign => Err(Handle::Foreign),
            Through::Binding(key) if key != self.allocations[allocation].binding => Err(Handle::Mismatch),
            Through::Binding(_) => Ok(()),
        }
    }

    /// The lifecycle check of release paths (active or retired admitted).
    fn releasable(&self, allocation: usize) -> Result<usize, Handle> {
        let mechanism = self.allocations[allocation].mechanism;
        match self.mechanisms[mechanism].state {
            MechanismState::DeviceLost => Err(Handle::DeviceLost(self.lost_reason(mechanism))),
            MechanismState::Terminated => Err(Handle::Stale),
            _ => Ok(mechanism),
        }
    }

    pub(crate) fn release(&mut self, allocation: usize, through: Through) -> Out {
        if let Err(e) = self.owns(allocation, through).and_then(|()| self.releasable(allocation).map(drop)) {
            return Out::Handle(e);
        }
        assert_eq!(self.allocations[allocation].place, Place::Record, "a held handle of a live mechanism is recorded");
        match self.call_release(allocation) {
            Released::Complete => {
                self.allocations[allocation].place = Place::Released;
                Out::Released(ReleaseSummary::Complete { unmapped_bytes: self.allocations[allocation].bytes })
            }
            Released::Failed => Out::Handle(Handle::ReleaseFailed),
            Released::Quarantined { unmapped, residual, reason } => {
                self.quarantine(allocation, unmapped, residual, reason);
                Out::Released(ReleaseSummary::Quarantined { unmapped_bytes: unmapped, residual_bytes: residual })
            }
        }
    }

    pub(crate) fn release_deferred(&mut self, allocation: usize, through: Through, queue: usize) -> Out {
        if let Err(e) = self.owns(allocation, through) {
            return Out::Handle(e);
        }
        let mechanism = self.allocations[allocation].mechanism;
        if DEVICES[queue] != self.mechanisms[mechanism].device {
            return Out::Handle(Handle::QueueWrongDevice);
        }
        if let Err(e) = self.releasable(allocation) {
            return Out::Handle(e);
        }
        if self.queues[queue].len() >= QUEUE_CAPACITY {
            return Out::Handle(Handle::QueueFull);
        }
        self.queues[queue].push(allocation);
        self.allocations[allocation].place = Place::Queued(queue);
        Out::Deferred
    }

    /// Runs every release held by the queue of device `queue`, in order.
    pub(crate) fn run_queue(&mut self, queue: usize) -> Out {
        for allocation in std::mem::take(&mut self.queues[queue]) {
            let mechanism = self.allocations[allocation].mechanism;
            match self.mechanisms[mechanism].state {
                MechanismState::Active | MechanismState::Retired => self.release_orphan(allocation),
                // Due after device loss: no callback, the block is recorded again (lost).
                _ => self.allocations[allocation].place = Place::Record,
            }
        }
        Out::Done
    }

    /// Drops every release held by the queue of device `queue` without running it.
    pub(crate) fn drop_queue(&mut self, queue: usize) -> Out {
        for allocation in std::mem::take(&mut self.queues[queue]) {
            self.abandon(allocation);
        }
        Out::Done
    }

    /// Dropping a held handle, by its mechanism's drop policy.
    pub(crate) fn drop_handle(&mut self, allocation: usize) -> Out {
        let mechanism = self.allocations[allocation].mechanism;
        let m = &self.mechanisms[mechanism];
        if !matches!(m.state, MechanismState::Active | MechanismState::Retired) {
            return Out::Done; // lost or terminated: nothing happens
        }
        match m.policy {
            Policy::Release => self.release_orphan(allocation),
            Policy::Quarantine => self.abandon(allocation),
            Policy::Defer => {
                let queue = device_index(m.device);
                if self.queues[queue].len() >= QUEUE_CAPACITY {
                    self.abandon(allocation);
                } else {
                    self.queues[queue].push(allocation);
                    self.allocations[allocation].place = Place::Queued(queue);
                }
            }
        }
        Out::Done
    }

    pub(crate) fn view(&self, allocation: usize, offset: usize, len: usize) -> Out {
        let bytes = self.allocations[allocation].bytes;
        if offset.checked_add(len).is_none_or(|end| end > bytes) {
            return Out::ViewOutOfBounds;
        }
        match self.releasable(allocation) {
            Ok(_) => Out::Viewed { len },
            Err(e) => Out::ViewHandle(e),
        }
    }

    pub(crate) fn retire(&mut self, mechanism: Ref) -> Out {
        let m = match self.mechanism(mechanism) {
            Ok(m) => m,
            Err(e) => return Out::Registry(e),
        };
        let state = self.mechanisms[m].state;
        if state != MechanismState::Active {
            return Out::Registry(Reg::InvalidState(state));
        }
        self.mechanisms[m].state = MechanismState::Retired;
        let selected = &mut self.selection[device_index(self.mechanisms[m].device)];
        if *selected == Some(m) {
            *selected = None;
        }
        Out::Done
    }

    /// `invalidate_device(device, reason)`; returns the reason string used.
    pub(crate) fn invalidate(&mut self, device: DeviceKey) -> (Out, String) {
        self.losses += 1;
        let reason = format!("loss {}", self.losses);
        let mut mechanisms = 0;
        for mech in self.mechanisms.iter_mut().filter(|m| !m.removed && m.device == device) {
            if mech.lost_reason.is_none() {
                mech.lost_reason = Some(reason.clone());
            }
            if matches!(mech.state, MechanismState::Active | MechanismState::Retired) {
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
        let selection_dropped = self.selection[device_index(device)].take().is_some();
        (Out::Invalidated { mechanisms, contexts, selection_dropped }, reason)
    }

    pub(crate) fn confirm(&mut self, context: Ref) -> Out {
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
            _ => {}
        }
        let mechanisms: Vec<usize> = self.registered().filter(|&m| self.mechanisms[m].context == c).collect();
        let in_flight: usize = mechanisms.iter().map(|&m| self.in_flight(m)).sum();
        if in_flight > 0 {
            return Out::Registry(Reg::ContextNotQuiescent(in_flight));
        }
        let (mut lost_allocations, mut lost_bytes, mut discharged) = (0, 0, 0);
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
            mech.quarantine.clear();
            mech.calls.forget_lost += 1;
            mech.calls.forgotten_blocks += blocks;
        }
        self.contexts[c].state = ContextState::Terminated;
        Out::Terminated { already: false, mechanisms: mechanisms.len(), lost_allocations, lost_bytes, discharged }
    }

    pub(crate) fn retry(&mut self, mechanism: Ref) -> Out {
        let m = match self.mechanism(mechanism) {
            Ok(m) => m,
            Err(e) => return Out::Registry(e),
        };
        let state = self.mechanisms[m].state;
        if !matches!(state, MechanismState::Active | MechanismState::Retired) {
            return Out::Registry(Reg::InvalidState(state));
        }
        let (mut released, mut still) = (0, Vec::new());
        for allocation in std::mem::take(&mut self.mechanisms[m].quarantine) {
            let Place::Quarantined { unmapped, residual, .. } = self.allocations[allocation].place else {
                unreachable!("the quarantine list holds quarantined blocks")
            };
            let place = match self.call_release(allocation) {
                Released::Complete => {
                    released += 1;
                    self.allocations[allocation].place = Place::Released;
                    continue;
                }
                Released::Failed => Place::Quarantined { unmapped, residual, reason: Reason::Injected },
                Released::Quarantined { unmapped: more, residual, reason } => {
                    // Unmapped bytes accumulate across retries but never exceed what the
                    // block minus its residual leaves (the honesty rule).
                    let ceiling = self.allocations[allocation].bytes.saturating_sub(residual);
                    Place::Quarantined { unmapped: (unmapped + more).min(ceiling), residual, reason }
                }
            };
            self.allocations[allocation].place = place;
            still.push(allocation);
        }
        let out = Out::Retried { released, still: still.len() };
        self.mechanisms[m].quarantine = still;
        out
    }

    pub(crate) fn remove(&mut self, mechanism: Ref) -> Out {
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

    pub(crate) fn remove_context(&mut self, context: Ref) -> Out {
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

    pub(crate) fn remove_authority(&mut self, authority: Ref) -> Out {
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

    pub(crate) fn plan_alloc_fault(&mut self, mechanism: usize) {
        self.mechanisms[mechanism].alloc_faults += 1;
    }

    pub(crate) fn plan_release_fault(&mut self, mechanism: usize, fault: ReleaseFault) {
        self.mechanisms[mechanism].release_faults.push_back(fault);
    }

    /// What `allocation_state` must say about allocation `allocation`.
    pub(crate) fn allocation_state(&self, allocation: usize) -> AllocationState {
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

    /// What `is_valid` must say about a handle the test still holds.
    pub(crate) fn handle_valid(&self, allocation: usize) -> bool {
        let a = &self.allocations[allocation];
        a.place == Place::Record && self.mechanisms[a.mechanism].state != MechanismState::Terminated
    }

    /// The snapshot the registry must show.
    pub(crate) fn view_all(&self) -> View {
        let contexts = (0..self.contexts.len())
            .filter(|&c| !self.contexts[c].removed)
            .map(|c| (c, self.contexts[c].device, self.contexts[c].state))
            .collect();
        let authorities = (0..self.authorities.len())
            .filter(|&a| !self.authorities[a].removed)
            .map(|a| (a, self.authorities[a].device))
            .collect();
        let mechanisms = self
            .registered()
            .map(|m| {
                let mech = &self.mechanisms[m];
                let quarantined = mech
                    .quarantine
                    .iter()
                    .map(|&a| {
                        let Place::Quarantined { unmapped, residual, reason } = self.allocations[a].place else {
                            unreachable!("the quarantine list holds quarantined blocks")
                        };
                        (a, (self.allocations[a].bytes, unmapped, residual, reason))
                    })
                    .collect();
                let live_bytes = self
                    .allocations
                    .iter()
                    .filter(|a| a.mechanism == m && a.place == Place::Record)
                    .map(|a| a.bytes)
                    .sum();
                MechanismView {
                    index: m,
                    device: mech.device,
                    context: mech.context,
                    authority: mech.authority,
                    state: mech.state,
                    selected: self.selection[device_index(mech.device)] == Some(m),
                    live_allocations: self.live(m),
                    live_bytes,
                    in_flight: self.in_flight(m),
                    quarantined,
                    lost_reason: matches!(mech.state, MechanismState::DeviceLost | MechanismState::Terminated)
                        .then(|| self.lost_reason(m)),
                }
            })
            .collect();
        View { contexts, authorities, mechanisms, selection: self.selection }
    }

    /// Internal bookkeeping must add up: every block the heap still holds is
    /// recorded, queued, quarantined or forgotten, and every released one is gone
    /// from the heap (released exactly once).
    pub(crate) fn check_conservation(&self) {
        for (m, mech) in self.mechanisms.iter().enumerate() {
            let held = self.count(m, |p| *p != Place::Released) as u64;
            assert_eq!(held, mech.calls.heap_live, "model conservation broken for mechanism {m}");
            assert_eq!(mech.quarantine.len(), self.count(m, |p| matches!(p, Place::Quarantined { .. })));
        }
    }
}
