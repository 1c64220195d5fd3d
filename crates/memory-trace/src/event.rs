//! What a trace holds: events (allocations, releases, refusals, failures, blocks lost with
//! their device, marks), tenants and thread names, as the reader returns them and the
//! [`TraceWriter`](crate::TraceWriter) takes them; and their encoding as words.

use std::fmt;

use memory_governor::{AdmissionError, DeviceKey, LimitScope, MemoryRole};

use crate::format::{self, NO_ROLE, NONE, kind, words};

/// One event of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Event {
    /// Nanoseconds since the recording started (monotonic clock). An allocation's time is
    /// when the block was handed out; a release's, when the release was asked for; so a
    /// block freed on one thread and reused on another is released before it is
    /// allocated again.
    pub ts_ns: u64,
    /// The recording's number of the thread that made the call (see [`Trace::threads`](crate::Trace::threads)).
    pub thread: u32,
    /// The device.
    pub device: DeviceKey,
    /// The tenant's number (see [`Trace::tenants`](crate::Trace::tenants)); 0 for none.
    pub tenant: u32,
    /// The role of the request; `None` for releases, lost blocks and marks (a block's
    /// role is its allocation's).
    pub role: Option<MemoryRole>,
    /// What happened.
    pub what: What,
}

/// What an [`Event`] records.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum What {
    /// A block was handed out.
    Allocate(Block),
    /// A block was given back (completely, or not: see `outcome`).
    Release {
        /// The block, as presented.
        block: Block,
        /// What the release did.
        outcome: ReleaseKind,
        /// Bytes still owned after a quarantine (0 otherwise).
        residual: u64,
    },
    /// The governor refused a request (boxed: it carries the recovery ladder's figures).
    Refusal(Box<Refusal>),
    /// The allocator under the governor failed (the charge was cancelled).
    Failure {
        /// Bytes asked for.
        requested: u64,
        /// Alignment asked for.
        align: u64,
        /// The caller's tag (0: none).
        caller: u64,
        /// What failed.
        error: FailureKind,
    },
    /// A block lost with its device was handed back at termination (its charge refunded).
    Lost(Block),
    /// Something the recorder was told, at a time (a device lost, a note).
    Mark {
        /// What kind of mark.
        kind: MarkKind,
        /// A number that goes with it (for termination: blocks refunded).
        value: u64,
        /// Its text.
        label: String,
    },
}

/// A block as an event names it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Block {
    /// The allocation's identity in the allocator that handed it out: the governed
    /// allocator's tag, which names its record (owner thread, slot, generation), unique
    /// among live blocks of that allocator.
    pub id: u64,
    /// The block's device address.
    pub address: u64,
    /// Bytes asked for (for releases and lost blocks: the block's size).
    pub requested: u64,
    /// The block's size.
    pub bytes: u64,
    /// Its alignment.
    pub align: u64,
    /// The caller's tag at the call (a request or stream id; 0: none).
    pub caller: u64,
}

impl Block {
    /// A block of `bytes` bytes at `address`, named `id`, asked for with `align`.
    pub fn new(id: u64, address: u64, bytes: u64, align: u64) -> Block {
        Block { id, address, requested: bytes, bytes, align, caller: 0 }
    }

    /// The same block, asked for as `requested` bytes.
    #[must_use]
    pub fn with_requested(self, requested: u64) -> Block {
        Block { requested, ..self }
    }

    /// The same block, with the caller's tag.
    #[must_use]
    pub fn with_caller(self, caller: u64) -> Block {
        Block { caller, ..self }
    }
}

/// How a release ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReleaseKind {
    /// Everything was released.
    Complete,
    /// Part of it is still owned (a quarantine): the block stays live in the books.
    Quarantined,
    /// Nothing was released (the block was not the allocator's, or it refused).
    Failed,
}

impl ReleaseKind {
    fn code(self) -> u64 {
        match self {
            ReleaseKind::Complete => 0,
            ReleaseKind::Quarantined => 1,
            ReleaseKind::Failed => 2,
        }
    }

    fn of(code: u64) -> Option<ReleaseKind> {
        match code {
            0 => Some(ReleaseKind::Complete),
            1 => Some(ReleaseKind::Quarantined),
            2 => Some(ReleaseKind::Failed),
            _ => None,
        }
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            ReleaseKind::Complete => "complete",
            ReleaseKind::Quarantined => "quarantined",
            ReleaseKind::Failed => "failed",
        }
    }
}

/// Which limit refused, as [`LimitScope`] says.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scope {
    /// The device's budget.
    Device,
    /// The tenant's quota.
    Authority,
    /// The device limit on reserved memory (the recovery ladder's refusal).
    Reserved,
}

impl Scope {
    /// The governor's scope.
    pub fn of(scope: LimitScope) -> Option<Scope> {
        match scope {
            LimitScope::Device => Some(Scope::Device),
            LimitScope::Authority => Some(Scope::Authority),
            LimitScope::Reserved => Some(Scope::Reserved),
            _ => None,
        }
    }

    fn code(scope: Option<Scope>) -> u64 {
        match scope {
            None => 0,
            Some(Scope::Device) => 1,
            Some(Scope::Authority) => 2,
            Some(Scope::Reserved) => 3,
        }
    }

    fn decode(code: u64) -> Option<Scope> {
        match code {
            1 => Some(Scope::Device),
            2 => Some(Scope::Authority),
            3 => Some(Scope::Reserved),
            _ => None,
        }
    }

    /// Lower-case name, as the governor's messages say it.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Device => "device limit",
            Scope::Authority => "authority quota",
            Scope::Reserved => "device limit on reserved memory",
        }
    }
}

/// Which refusal of the governor it was.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RefusalKind {
    /// The budget named by the scope could not hold the request.
    Exhausted,
    /// As `Exhausted`, inside a reclaim holder's reclaim (not reclaimed again).
    ReentrantReclaim,
    /// A cache's backing refused at the device limit.
    CacheLimit,
    /// The request overflowed the largest charge.
    Overflow,
    /// A refusal this version has no code for.
    Other,
}

impl RefusalKind {
    fn code(self) -> u64 {
        match self {
            RefusalKind::Exhausted => 0,
            RefusalKind::ReentrantReclaim => 1,
            RefusalKind::CacheLimit => 2,
            RefusalKind::Overflow => 3,
            RefusalKind::Other => 255,
        }
    }

    fn decode(code: u64) -> RefusalKind {
        match code {
            0 => RefusalKind::Exhausted,
            1 => RefusalKind::ReentrantReclaim,
            2 => RefusalKind::CacheLimit,
            3 => RefusalKind::Overflow,
            _ => RefusalKind::Other,
        }
    }
}

/// A refused request with the governor's figures at the refusal.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Refusal {
    /// Bytes asked for.
    pub requested: u64,
    /// Alignment asked for.
    pub align: u64,
    /// The caller's tag (0: none).
    pub caller: u64,
    /// Which refusal.
    pub kind: RefusalKind,
    /// Which limit refused (`None` for a cache-limit or overflow refusal).
    pub scope: Option<Scope>,
    /// Bytes drawn from that budget at the refusal.
    pub used: u64,
    /// The limit of that budget.
    pub limit: u64,
    /// Bytes the request could still have had.
    pub available: u64,
    /// Bytes reclaim holders freed for it, when they were asked.
    pub reclaimed: Option<u64>,
    /// Bytes charged on the device.
    pub device_allocated: u64,
    /// What the process held on the device (charged + idle in caches).
    pub device_reserved: u64,
    /// Idle bytes in the device's caches.
    pub device_cached: u64,
    /// The largest block any cache could hand out without growing.
    pub largest_free: u64,
    /// Bytes charged to the tenant.
    pub tenant_allocated: u64,
    /// What the tenant held (charged + its caches' idle bytes).
    pub tenant_reserved: u64,
    /// What trimming the caches gave back, when the ladder's first rung ran.
    pub trimmed: Option<u64>,
}

impl Refusal {
    /// The trace's record of a governor refusal of `requested` bytes aligned to `align`.
    pub fn of(error: &AdmissionError, requested: u64, align: u64, caller: u64) -> Refusal {
        let mut refusal = Refusal {
            requested,
            align,
            caller,
            kind: RefusalKind::Other,
            scope: None,
            used: 0,
            limit: 0,
            available: 0,
            reclaimed: None,
            device_allocated: 0,
            device_reserved: 0,
            device_cached: 0,
            largest_free: 0,
            tenant_allocated: 0,
            tenant_reserved: 0,
            trimmed: None,
        };
        match error {
            AdmissionError::Exhausted(_) | AdmissionError::ReentrantReclaim(_) => {
                refusal.kind = if matches!(error, AdmissionError::Exhausted(_)) {
                    RefusalKind::Exhausted
                } else {
                    RefusalKind::ReentrantReclaim
                };
            }
            AdmissionError::CacheLimit { held, limit, .. } => {
                refusal.kind = RefusalKind::CacheLimit;
                (refusal.used, refusal.limit) = (*held, *limit);
                refusal.available = limit.saturating_sub(*held);
            }
            AdmissionError::Overflow { .. } => refusal.kind = RefusalKind::Overflow,
            _ => {}
        }
        if let Some(exhaustion) = error.exhaustion() {
            let footprint = &exhaustion.footprint;
            refusal.scope = Scope::of(exhaustion.scope);
            (refusal.used, refusal.limit, refusal.available) =
                (exhaustion.used, exhaustion.limit, exhaustion.available);
            refusal.reclaimed = exhaustion.reclaimed;
            refusal.device_allocated = footprint.device_allocated;
            refusal.device_reserved = footprint.device_reserved;
            refusal.device_cached = footprint.device_cached;
            refusal.largest_free = footprint.largest_free;
            refusal.tenant_allocated = footprint.tenant_allocated;
            refusal.tenant_reserved = footprint.tenant_reserved;
            refusal.trimmed = footprint.trimmed;
        }
        refusal
    }

    /// `1 - largest free / cached` over the device's caches at the refusal.
    pub fn fragmentation(&self) -> f64 {
        memory_governor::fragmentation(self.device_cached, self.largest_free)
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.scope {
            Some(scope) => write!(f, "{} bytes refused by the {}", self.requested, scope.name())?,
            None => write!(f, "{} bytes refused ({:?})", self.requested, self.kind)?,
        }
        write!(
            f,
            ": {} of {} used, {} available; device {} allocated, {} reserved ({} idle in caches, largest free {})",
            self.used,
            self.limit,
            self.available,
            self.device_allocated,
            self.device_reserved,
            self.device_cached,
            self.largest_free
        )
    }
}

/// What failed when the allocator under the governor failed.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// Out of memory.
    OutOfMemory,
    /// The device is lost.
    DeviceLost,
    /// An invalid layout.
    Layout,
    /// Unsupported request.
    Unsupported,
    /// A backend error.
    Backend,
    /// An admission refusal from below the governor (a cache's backing).
    AdmissionRefused,
    /// Something this version has no code for.
    Other,
}

impl FailureKind {
    /// The failure class of an allocator error.
    pub fn of(error: &memory_governor::AllocError) -> FailureKind {
        use memory_governor::AllocError;
        match error {
            AllocError::OutOfMemory { .. } => FailureKind::OutOfMemory,
            AllocError::DeviceLost { .. } => FailureKind::DeviceLost,
            AllocError::Layout(_) => FailureKind::Layout,
            AllocError::Unsupported { .. } => FailureKind::Unsupported,
            AllocError::Backend { .. } => FailureKind::Backend,
            AllocError::AdmissionRefused { .. } => FailureKind::AdmissionRefused,
            _ => FailureKind::Other,
        }
    }

    fn code(self) -> u64 {
        match self {
            FailureKind::OutOfMemory => 1,
            FailureKind::DeviceLost => 2,
            FailureKind::Layout => 3,
            FailureKind::Unsupported => 4,
            FailureKind::Backend => 5,
            FailureKind::AdmissionRefused => 6,
            FailureKind::Other => 0,
        }
    }

    fn decode(code: u64) -> FailureKind {
        match code {
            1 => FailureKind::OutOfMemory,
            2 => FailureKind::DeviceLost,
            3 => FailureKind::Layout,
            4 => FailureKind::Unsupported,
            5 => FailureKind::Backend,
            6 => FailureKind::AdmissionRefused,
            _ => FailureKind::Other,
        }
    }
}

/// What a mark says.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MarkKind {
    /// A note (a phase of the workload, say).
    Note,
    /// The device was lost (`invalidate_device`).
    DeviceLost,
    /// The device's context was confirmed terminated and its lost blocks handed back.
    Terminated,
}

impl MarkKind {
    pub(crate) fn code(self) -> u8 {
        match self {
            MarkKind::Note => 0,
            MarkKind::DeviceLost => 1,
            MarkKind::Terminated => 2,
        }
    }

    pub(crate) fn decode(code: u8) -> MarkKind {
        match code {
            1 => MarkKind::DeviceLost,
            2 => MarkKind::Terminated,
            _ => MarkKind::Note,
        }
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            MarkKind::Note => "note",
            MarkKind::DeviceLost => "device lost",
            MarkKind::Terminated => "terminated",
        }
    }
}

/// A tenant of the recording: one governed allocator's account.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Tenant {
    /// Its number in events (from 1).
    pub id: u32,
    /// Its device.
    pub device: DeviceKey,
    /// The account's label.
    pub label: String,
    /// The authority, as the registry names it.
    pub authority: String,
    /// The allocator that serves it (its name).
    pub allocator: String,
    /// The tenant's quota when recording started, if it had one.
    pub quota: Option<u64>,
    /// The device's limit when recording started, if it had one.
    pub device_limit: Option<u64>,
}

impl Tenant {
    /// A tenant numbered `id` on `device`, labelled `label`.
    pub fn new(id: u32, device: DeviceKey, label: impl Into<String>) -> Tenant {
        let label = label.into();
        Tenant {
            id,
            device,
            authority: label.clone(),
            label,
            allocator: String::new(),
            quota: None,
            device_limit: None,
        }
    }

    /// The same tenant with a quota.
    #[must_use]
    pub fn with_quota(self, quota: u64) -> Tenant {
        Tenant { quota: Some(quota), ..self }
    }

    /// The same tenant with its device's limit.
    #[must_use]
    pub fn with_device_limit(self, limit: u64) -> Tenant {
        Tenant { device_limit: Some(limit), ..self }
    }
}

/// The role byte of a role.
#[inline(always)]
pub(crate) fn role_code(role: Option<MemoryRole>) -> u8 {
    role.map_or(NO_ROLE, |role| role.ordinal() as u8)
}

fn opt(value: Option<u64>) -> u64 {
    value.unwrap_or(NONE)
}

fn unopt(word: u64) -> Option<u64> {
    (word != NONE).then_some(word)
}

/// An allocation's words (the recorder's hot path builds these directly).
#[inline(always)]
pub(crate) fn allocate_words(
    ts: u64,
    thread: u32,
    device: DeviceKey,
    tenant: u32,
    role: MemoryRole,
    block: &Block,
) -> [u64; words::ALLOCATE] {
    [
        ts,
        format::word1(words::ALLOCATE, kind::ALLOCATE, role.ordinal() as u8, device),
        format::word2(thread, tenant),
        block.id,
        block.address,
        block.requested,
        block.bytes,
        block.align,
        block.caller,
    ]
}

/// A release's words.
#[inline(always)]
pub(crate) fn release_words(
    ts: u64,
    thread: u32,
    device: DeviceKey,
    tenant: u32,
    block: &Block,
    outcome: ReleaseKind,
    residual: u64,
) -> [u64; words::RELEASE] {
    [
        ts,
        format::word1(words::RELEASE, kind::RELEASE, NO_ROLE, device),
        format::word2(thread, tenant),
        block.id,
        block.address,
        block.bytes,
        block.align,
        block.caller,
        outcome.code(),
        residual,
    ]
}

/// A refusal's words.
pub(crate) fn refusal_words(
    ts: u64,
    thread: u32,
    device: DeviceKey,
    tenant: u32,
    role: Option<MemoryRole>,
    refusal: &Refusal,
) -> [u64; words::REFUSAL] {
    [
        ts,
        format::word1(words::REFUSAL, kind::REFUSAL, role_code(role), device),
        format::word2(thread, tenant),
        refusal.requested,
        refusal.align,
        refusal.caller,
        refusal.kind.code() | Scope::code(refusal.scope) << 8,
        refusal.used,
        refusal.limit,
        refusal.available,
        opt(refusal.reclaimed),
        refusal.device_allocated,
        refusal.device_reserved,
        refusal.device_cached,
        refusal.largest_free,
        refusal.tenant_allocated,
        refusal.tenant_reserved,
        opt(refusal.trimmed),
    ]
}

/// A failure's words.
pub(crate) fn failure_words(
    ts: u64,
    thread: u32,
    device: DeviceKey,
    tenant: u32,
    role: Option<MemoryRole>,
    (requested, align, caller): (u64, u64, u64),
    error: FailureKind,
) -> [u64; words::FAILURE] {
    [
        ts,
        format::word1(words::FAILURE, kind::FAILURE, role_code(role), device),
        format::word2(thread, tenant),
        requested,
        align,
        caller,
        error.code(),
    ]
}

/// A lost block's words.
pub(crate) fn lost_words(ts: u64, thread: u32, device: DeviceKey, tenant: u32, block: &Block) -> [u64; words::LOST] {
    [
        ts,
        format::word1(words::LOST, kind::LOST, NO_ROLE, device),
        format::word2(thread, tenant),
        block.id,
        block.address,
        block.bytes,
        block.align,
    ]
}

/// The recorder's ring encoding of the two hot events: what a recording thread stores,
/// which the writer expands into the file's events ([`expand`]). The file format does
/// not change; the ring holds fewer words, so a recording thread writes fewer cache
/// lines that the writer thread reads (each a cross-core miss): an allocation is 5 words
/// instead of 9 and a release 5 instead of 10, plus one word for a caller tag, one for
/// bytes asked for other than the block's (allocation) or a residual (quarantine).
///
/// A ring event's second word keeps the low byte as its size in words, as every event
/// does (the writer walks the ring by it):
///
/// | bits | field |
/// |------|-------|
/// | 0-7 | size in ring words (5 to 7) |
/// | 8-15 | ring kind ([`compact::ALLOCATE`], [`compact::RELEASE`]) |
/// | 16-23 | role ordinal (allocation) or outcome code (release) |
/// | 24-29 | log2 of the alignment (a power of two; other alignments go in file form) |
/// | 30 | a caller tag follows (last word) |
/// | 31 | an extra word follows: bytes asked for (allocation), residual (release) |
/// | 32-63 | tenant |
///
/// Words: 0 the clock stamp, 1 the header above, 2 id, 3 address, 4 block bytes, then
/// the extra word and the caller tag when their flags say so. The thread is not stored:
/// a ring belongs to one thread at a time, and the first event of each thread in it is
/// an [`compact::OWNER`] pseudo-event (`[thread, header]`) that the writer remembers for
/// that ring. Device: the tenant's, from the recorder's table of tenants.
pub(crate) mod compact {
    /// A pseudo-event: the thread whose events follow in this ring (not an event).
    pub(crate) const OWNER: u8 = 0x80;
    /// An allocation (file kind `allocate`).
    pub(crate) const ALLOCATE: u8 = 0x81;
    /// A release (file kind `release`).
    pub(crate) const RELEASE: u8 = 0x82;
    /// The most words a compact event has.
    pub(crate) const MAX: usize = 7;
    /// The words before the optional ones.
    pub(crate) const BASE: usize = 5;
    pub(crate) const CALLER: u64 = 1 << 30;
    pub(crate) const EXTRA: u64 = 1 << 31;
}

/// A compact ring event: its words and how many are used.
pub(crate) struct Compact {
    pub(crate) words: [u64; compact::MAX],
    pub(crate) len: usize,
}

impl Compact {
    /// The words to push.
    #[inline(always)]
    pub(crate) fn words(&self) -> &[u64] {
        &self.words[..self.len]
    }
}

/// A compact event of `kind` whose byte 2 is `code`: the header word filled in last,
/// once the optional words are known. `None` when the alignment is not a power of two
/// (the caller records the file form).
#[inline(always)]
fn compact_event(ts: u64, kind: u8, code: u8, tenant: u32, block: &Block, extra: Option<u64>) -> Option<Compact> {
    if !block.align.is_power_of_two() {
        return None;
    }
    let mut words = [ts, 0, block.id, block.address, block.bytes, 0, 0];
    let (mut len, mut flags) = (compact::BASE, 0);
    if let Some(extra) = extra {
        words[len] = extra;
        len += 1;
        flags |= compact::EXTRA;
    }
    if block.caller != 0 {
        words[len] = block.caller;
        len += 1;
        flags |= compact::CALLER;
    }
    words[1] = len as u64
        | u64::from(kind) << 8
        | u64::from(code) << 16
        | u64::from(block.align.trailing_zeros()) << 24
        | flags
        | u64::from(tenant) << 32;
    Some(Compact { words, len })
}

/// An allocation in ring form (see [`compact`]); `None` for an alignment that is not a
/// power of two.
#[inline(always)]
pub(crate) fn compact_allocate(ts: u64, tenant: u32, role: MemoryRole, block: &Block) -> Option<Compact> {
    let extra = (block.requested != block.bytes).then_some(block.requested);
    compact_event(ts, compact::ALLOCATE, role.ordinal() as u8, tenant, block, extra)
}

/// A release in ring form (see [`compact`]); `None` for an alignment that is not a power
/// of two.
#[inline(always)]
pub(crate) fn compact_release(
    ts: u64,
    tenant: u32,
    block: &Block,
    outcome: ReleaseKind,
    residual: u64,
) -> Option<Compact> {
    let extra = (residual != 0).then_some(residual);
    compact_event(ts, compact::RELEASE, outcome.code() as u8, tenant, block, extra)
}

/// The owner pseudo-event of a ring: `thread`'s events follow.
pub(crate) fn owner_words(thread: u32) -> [u64; 2] {
    [u64::from(thread), 2 | u64::from(compact::OWNER) << 8]
}

/// Appends the file bytes of the ring event `ring` (whole, its size checked by the
/// caller; its time word already in nanoseconds) to `out`, little-endian: a compact
/// event expanded with `thread` and the tenant's `device` (looked up only for compact
/// events), any other as it is.
#[inline]
pub(crate) fn expand(ring: &[u64], thread: u32, device: impl FnOnce(u32) -> DeviceKey, out: &mut Vec<u8>) {
    let header = ring[1];
    let ring_kind = (header >> 8) as u8;
    if ring_kind != compact::ALLOCATE && ring_kind != compact::RELEASE {
        out.reserve(ring.len() * 8);
        for word in ring {
            out.extend_from_slice(&word.to_le_bytes());
        }
        return;
    }
    let (code, tenant) = ((header >> 16) as u8, (header >> 32) as u32);
    let align = 1u64 << ((header >> 24) & 0x3f);
    let mut at = compact::BASE;
    let extra = if header & compact::EXTRA != 0 {
        at += 1;
        Some(ring[at - 1])
    } else {
        None
    };
    let caller = if header & compact::CALLER != 0 { ring[at] } else { 0 };
    let (ts, id, address, bytes) = (ring[0], ring[2], ring[3], ring[4]);
    let device = device(tenant);
    let word2 = format::word2(thread, tenant);
    if ring_kind == compact::ALLOCATE {
        let word1 = format::word1(words::ALLOCATE, kind::ALLOCATE, code, device);
        put(out, [ts, word1, word2, id, address, extra.unwrap_or(bytes), bytes, align, caller]);
    } else {
        let word1 = format::word1(words::RELEASE, kind::RELEASE, NO_ROLE, device);
        let residual = extra.unwrap_or(0);
        put(out, [ts, word1, word2, id, address, bytes, align, caller, u64::from(code), residual]);
    }
}

/// Appends `words` to `out` as little-endian bytes, in one copy.
#[inline(always)]
fn put<const N: usize>(out: &mut Vec<u8>, words: [u64; N]) {
    let mut bytes = [[0u8; 8]; N];
    for (to, word) in bytes.iter_mut().zip(words) {
        *to = word.to_le_bytes();
    }
    out.extend_from_slice(bytes.as_flattened());
}

impl Event {
    /// An event of `what` at `ts_ns` on `thread`, for `tenant` on `device`.
    pub fn new(ts_ns: u64, thread: u32, device: DeviceKey, tenant: u32, role: Option<MemoryRole>, what: What) -> Event {
        Event { ts_ns, thread, device, tenant, role, what }
    }

    /// The event's words; `None` for a mark (marks are records of their own).
    pub(crate) fn encode(&self) -> Option<Vec<u64>> {
        let (ts, thread, device, tenant) = (self.ts_ns, self.thread, self.device, self.tenant);
        Some(match &self.what {
            What::Allocate(block) => {
                let role = self.role.unwrap_or(MemoryRole::Other);
                allocate_words(ts, thread, device, tenant, role, block).to_vec()
            }
            What::Release { block, outcome, residual } => {
                release_words(ts, thread, device, tenant, block, *outcome, *residual).to_vec()
            }
            What::Refusal(refusal) => refusal_words(ts, thread, device, tenant, self.role, refusal).to_vec(),
            What::Failure { requested, align, caller, error } => {
                failure_words(ts, thread, device, tenant, self.role, (*requested, *align, *caller), *error).to_vec()
            }
            What::Lost(block) => lost_words(ts, thread, device, tenant, block).to_vec(),
            What::Mark { .. } => return None,
        })
    }

    /// Decodes one event from its words (the header's size already checked to be
    /// `words.len()`); `Ok(None)` for a kind this version does not know (skipped), `Err`
    /// for an event too short for its kind or with an unknown device tier.
    pub(crate) fn decode(words: &[u64]) -> Result<Option<Event>, String> {
        let header = format::split_word1(words[1]);
        let needed = match header.kind {
            kind::ALLOCATE => words::ALLOCATE,
            kind::RELEASE => words::RELEASE,
            kind::REFUSAL => words::REFUSAL,
            kind::FAILURE => words::FAILURE,
            kind::LOST => words::LOST,
            _ => return Ok(None),
        };
        if words.len() < needed {
            return Err(format!("event of kind {} has {} words, needs {needed}", header.kind, words.len()));
        }
        let device = format::device_of(header.tier, header.index)
            .ok_or_else(|| format!("event names device tier {}, which this version has no code for", header.tier))?;
        let (thread, tenant) = (words[2] as u32, (words[2] >> 32) as u32);
        let role = format::role_of(header.role);
        let what = match header.kind {
            kind::ALLOCATE => What::Allocate(Block {
                id: words[3],
                address: words[4],
                requested: words[5],
                bytes: words[6],
                align: words[7],
                caller: words[8],
            }),
            kind::RELEASE => What::Release {
                block: Block {
                    id: words[3],
                    address: words[4],
                    requested: words[5],
                    bytes: words[5],
                    align: words[6],
                    caller: words[7],
                },
                outcome: ReleaseKind::of(words[8]).ok_or_else(|| format!("release outcome {} is unknown", words[8]))?,
                residual: words[9],
            },
            kind::REFUSAL => What::Refusal(Box::new(Refusal {
                requested: words[3],
                align: words[4],
                caller: words[5],
                kind: RefusalKind::decode(words[6] & 0xff),
                scope: Scope::decode((words[6] >> 8) & 0xff),
                used: words[7],
                limit: words[8],
                available: words[9],
                reclaimed: unopt(words[10]),
                device_allocated: words[11],
                device_reserved: words[12],
                device_cached: words[13],
                largest_free: words[14],
                tenant_allocated: words[15],
                tenant_reserved: words[16],
                trimmed: unopt(words[17]),
            })),
            kind::FAILURE => What::Failure {
                requested: words[3],
                align: words[4],
                caller: words[5],
                error: FailureKind::decode(words[6]),
            },
            _ => What::Lost(Block {
                id: words[3],
                address: words[4],
                requested: words[5],
                bytes: words[5],
                align: words[6],
                caller: 0,
            }),
        };
        Ok(Some(Event { ts_ns: words[0], thread, device, tenant, role, what }))
    }

    /// Bytes this event is about: a block's size, or what was asked for.
    pub fn bytes(&self) -> u64 {
        match &self.what {
            What::Allocate(block) | What::Release { block, .. } | What::Lost(block) => block.bytes,
            What::Refusal(refusal) => refusal.requested,
            What::Failure { requested, .. } => *requested,
            What::Mark { value, .. } => *value,
        }
    }

    /// Lower-case name of the event's kind.
    pub fn kind_name(&self) -> &'static str {
        match &self.what {
            What::Allocate(_) => "allocate",
            What::Release { .. } => "release",
            What::Refusal(_) => "refusal",
            What::Failure { .. } => "failure",
            What::Lost(_) => "lost",
            What::Mark { .. } => "mark",
        }
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    fn expanded(compact: &Compact, thread: u32, device: DeviceKey) -> Vec<u8> {
        let mut out = Vec::new();
        expand(compact.words(), thread, |_| device, &mut out);
        out
    }

    fn bytes(words: &[u64]) -> Vec<u8> {
        words.iter().flat_map(|word| word.to_le_bytes()).collect()
    }

    #[test]
    fn a_compact_event_expands_to_the_file_event_it_stands_for() {
        let device = DeviceKey::device(3);
        let (thread, tenant) = (7, 2);
        for (requested, caller) in [(4096, 0), (4000, 0), (4096, 99), (4000, 99)] {
            let block = Block::new(0x1234, 0x7000_0000, 4096, 256).with_requested(requested).with_caller(caller);
            let role = MemoryRole::KvCache;
            let allocate = compact_allocate(11, tenant, role, &block).expect("a power-of-two alignment");
            let words = 5 + usize::from(requested != 4096) + usize::from(caller != 0);
            assert_eq!(allocate.len, words, "only the words that carry something");
            let file = allocate_words(11, thread, device, tenant, role, &block);
            assert_eq!(expanded(&allocate, thread, device), bytes(&file), "allocate {requested} {caller}");
            for (outcome, residual) in
                [(ReleaseKind::Complete, 0), (ReleaseKind::Quarantined, 1024), (ReleaseKind::Failed, 0)]
            {
                let release = compact_release(12, tenant, &block, outcome, residual).expect("a power-of-two alignment");
                let file = release_words(12, thread, device, tenant, &block, outcome, residual);
                let expanded = expanded(&release, thread, device);
                assert_eq!(expanded, bytes(&file), "release {outcome:?} {residual} {caller}");
            }
        }
    }

    #[test]
    fn an_alignment_that_is_not_a_power_of_two_has_no_compact_form() {
        let block = Block::new(1, 0x1000, 96, 48);
        assert!(compact_allocate(1, 1, MemoryRole::Other, &block).is_none());
        assert!(compact_release(1, 1, &block, ReleaseKind::Complete, 0).is_none());
    }

    #[test]
    fn a_file_event_in_a_ring_passes_through_as_it_is() {
        let device = DeviceKey::host(1);
        let lost = lost_words(5, 3, device, 1, &Block::new(9, 0x2000, 64, 64));
        let mut out = Vec::new();
        expand(&lost, 99, |_| panic!("no device lookup for a file event"), &mut out);
        assert_eq!(out, bytes(&lost));
    }
}
