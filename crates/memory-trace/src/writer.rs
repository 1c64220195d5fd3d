//! Framing records: the payloads of tenant, thread, mark and end records (shared by the
//! recorder's writer thread and [`TraceWriter`]), and [`TraceWriter`] itself, which writes
//! a trace from events in hand (synthetic traces, converters, tests).

use std::io::{self, Write};

use crate::event::{Event, MarkKind, Tenant, What};
use crate::format::{self, NONE, put_str, record};

/// A record built away from the writer (tenants, thread names, marks): kind and payload.
pub(crate) struct Cold {
    pub(crate) kind: u32,
    pub(crate) payload: Vec<u8>,
}

fn device_bytes(payload: &mut Vec<u8>, device: memory_governor::DeviceKey) {
    payload.push(format::tier_code(device.tier()).unwrap_or(0xff));
    payload.extend_from_slice(&[0; 3]);
    payload.extend_from_slice(&device.index().to_le_bytes());
}

pub(crate) fn tenant_record(tenant: &Tenant) -> Cold {
    let mut payload = Vec::with_capacity(64);
    payload.extend_from_slice(&tenant.id.to_le_bytes());
    device_bytes(&mut payload, tenant.device);
    payload.extend_from_slice(&0u32.to_le_bytes());
    payload.extend_from_slice(&tenant.quota.unwrap_or(NONE).to_le_bytes());
    payload.extend_from_slice(&tenant.device_limit.unwrap_or(NONE).to_le_bytes());
    put_str(&mut payload, &tenant.label);
    put_str(&mut payload, &tenant.authority);
    put_str(&mut payload, &tenant.allocator);
    Cold { kind: record::TENANT, payload }
}

pub(crate) fn thread_record(thread: u32, name: &str) -> Cold {
    let mut payload = Vec::with_capacity(8 + name.len());
    payload.extend_from_slice(&thread.to_le_bytes());
    put_str(&mut payload, name);
    Cold { kind: record::THREAD, payload }
}

/// A mark's record.
pub(crate) fn mark_record(
    ts: u64,
    thread: u32,
    device: memory_governor::DeviceKey,
    tenant: u32,
    kind: MarkKind,
    value: u64,
    label: &str,
) -> Cold {
    let mut payload = Vec::with_capacity(40 + label.len());
    payload.extend_from_slice(&ts.to_le_bytes());
    payload.extend_from_slice(&thread.to_le_bytes());
    payload.extend_from_slice(&tenant.to_le_bytes());
    device_bytes(&mut payload, device);
    payload.push(kind.code());
    payload.extend_from_slice(&[0; 3]);
    payload.extend_from_slice(&value.to_le_bytes());
    put_str(&mut payload, label);
    Cold { kind: record::MARK, payload }
}

pub(crate) fn end_record(events: u64, records: u64, dropped: u64) -> Cold {
    let mut payload = Vec::with_capacity(24);
    for value in [events, records, dropped] {
        payload.extend_from_slice(&value.to_le_bytes());
    }
    Cold { kind: record::END, payload }
}

/// Little-endian bytes of event words.
pub(crate) fn words_bytes(words: &[u64], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(words.len() * 8);
    for word in words {
        out.extend_from_slice(&word.to_le_bytes());
    }
}

/// Writes a trace from events in hand: the same bytes a recording has, with the times
/// and identities given (so a synthetic trace is byte-for-byte reproducible).
///
/// ```
/// use memory_trace::{Block, Event, TraceWriter, Tenant, What, read_trace};
/// use memory_governor::{DeviceKey, MemoryRole};
///
/// let gpu = DeviceKey::device(0);
/// let mut writer = TraceWriter::new(Vec::new(), 0)?;
/// writer.tenant(&Tenant::new(1, gpu, "tenant-a"))?;
/// let block = Block::new(7, 0x1000, 4096, 256);
/// writer.event(&Event::new(10, 1, gpu, 1, Some(MemoryRole::KvCache), What::Allocate(block)))?;
/// let bytes = writer.finish()?;
/// let trace = read_trace(&bytes[..])?;
/// assert_eq!(trace.events.len(), 1);
/// assert!(trace.damage.is_none());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct TraceWriter<W: Write> {
    out: W,
    batch: Vec<u64>,
    batch_events: u64,
    events: u64,
    records: u64,
    bytes: Vec<u8>,
}

/// Events per events record the [`TraceWriter`] writes.
const BATCH_EVENTS: u64 = 4096;

impl<W: Write> TraceWriter<W> {
    /// Starts a trace on `out`; `origin_unix_ns` is the wall-clock time of time zero
    /// (nanoseconds since the Unix epoch; 0 when unknown).
    ///
    /// # Errors
    /// The error of writing the header.
    pub fn new(mut out: W, origin_unix_ns: u64) -> io::Result<TraceWriter<W>> {
        format::write_header(&mut out, origin_unix_ns)?;
        Ok(TraceWriter { out, batch: Vec::new(), batch_events: 0, events: 0, records: 0, bytes: Vec::new() })
    }

    fn cold(&mut self, cold: &Cold) -> io::Result<()> {
        self.flush_batch()?;
        self.records += 1;
        format::write_record(&mut self.out, cold.kind, &cold.payload)
    }

    /// Writes a tenant.
    ///
    /// # Errors
    /// The error of writing it.
    pub fn tenant(&mut self, tenant: &Tenant) -> io::Result<()> {
        self.cold(&tenant_record(tenant))
    }

    /// Names a thread.
    ///
    /// # Errors
    /// The error of writing it.
    pub fn thread(&mut self, thread: u32, name: &str) -> io::Result<()> {
        self.cold(&thread_record(thread, name))
    }

    /// Writes an event (a mark becomes a mark record).
    ///
    /// # Errors
    /// The error of writing it.
    pub fn event(&mut self, event: &Event) -> io::Result<()> {
        match event.encode() {
            Some(words) => {
                self.batch.extend_from_slice(&words);
                self.batch_events += 1;
                self.events += 1;
                if self.batch_events == BATCH_EVENTS {
                    self.flush_batch()?;
                }
                Ok(())
            }
            None => {
                let What::Mark { kind, value, label } = &event.what else { return Ok(()) };
                let mark = mark_record(event.ts_ns, event.thread, event.device, event.tenant, *kind, *value, label);
                self.events += 1;
                self.cold(&mark)
            }
        }
    }

    fn flush_batch(&mut self) -> io::Result<()> {
        if self.batch.is_empty() {
            return Ok(());
        }
        words_bytes(&self.batch, &mut self.bytes);
        self.batch.clear();
        self.batch_events = 0;
        self.records += 1;
        format::write_record(&mut self.out, record::EVENTS, &self.bytes)
    }

    /// Writes the end record and hands the output back.
    ///
    /// # Errors
    /// The error of writing the last records or flushing.
    pub fn finish(mut self) -> io::Result<W> {
        self.flush_batch()?;
        let end = end_record(self.events, self.records + 1, 0);
        format::write_record(&mut self.out, end.kind, &end.payload)?;
        self.out.flush()?;
        Ok(self.out)
    }
}
