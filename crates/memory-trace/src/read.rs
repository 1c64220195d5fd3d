//! The reader: a trace from any `Read`, sorted by time, with what damage it found.

use std::fmt;
use std::io::{self, Read};

use crate::event::{Event, MarkKind, Tenant, What};
use crate::format::{self, Cursor, MAGIC, MAJOR, MAX_PAYLOAD, MINOR, RECORD_HEADER_BYTES, record};

/// A trace as read.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Trace {
    /// The file's format version (major, minor).
    pub version: (u16, u16),
    /// Wall-clock time of time zero, nanoseconds since the Unix epoch (0: unknown).
    pub origin_unix_ns: u64,
    /// Tenants, by number.
    pub tenants: Vec<Tenant>,
    /// Thread names, by number.
    pub threads: Vec<(u32, String)>,
    /// Every event read, sorted by time (ties: by thread, then as recorded).
    pub events: Vec<Event>,
    /// What the end record says, if the recording finished.
    pub end: Option<End>,
    /// Where the file is damaged, if it is: everything before was read.
    pub damage: Option<Damage>,
    /// Records and events of kinds this version does not know (a newer minor version's),
    /// skipped. In a file of this reader's minor version or older there are none: such a
    /// kind there is damage (a damaged record header), see [`Trace::damage`].
    pub skipped: u64,
}

/// The end record of a finished recording.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct End {
    /// Events the recorder wrote.
    pub events: u64,
    /// Records it wrote, this one included.
    pub records: u64,
    /// Events it dropped (recorded after the recording was finished).
    pub dropped: u64,
}

/// Where and how a trace is damaged.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Damage {
    /// Byte offset of the record that is damaged (or of the end of the file).
    pub offset: u64,
    /// Its index among the file's records (from 0).
    pub record: u64,
    /// Events read before it.
    pub events_before: u64,
    /// What is wrong.
    pub kind: DamageKind,
}

/// What is wrong with a damaged trace.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DamageKind {
    /// The file ends inside a record (a recording cut short: a crash, a full disk).
    Truncated {
        /// Bytes the record needed.
        needed: u64,
        /// Bytes there were.
        found: u64,
    },
    /// A record's checksum does not match its bytes.
    Checksum {
        /// The CRC-32 the record header says.
        expected: u32,
        /// The CRC-32 of the bytes.
        found: u32,
    },
    /// A record's bytes do not decode.
    Malformed(String),
    /// The file ends cleanly between records but without the end record: the recording
    /// did not finish.
    Unfinished,
}

impl fmt::Display for Damage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            DamageKind::Truncated { needed, found } => write!(
                f,
                "the trace is truncated at byte {} (record {}): the record needs {needed} bytes, {found} remain",
                self.offset, self.record
            )?,
            DamageKind::Checksum { expected, found } => write!(
                f,
                "the trace is corrupt at byte {} (record {}): checksum {found:#010x}, the record says {expected:#010x}",
                self.offset, self.record
            )?,
            DamageKind::Malformed(what) => {
                write!(f, "the trace is corrupt at byte {} (record {}): {what}", self.offset, self.record)?;
            }
            DamageKind::Unfinished => write!(
                f,
                "the trace has no end record (it ends at byte {} after {} records): the recording did not finish",
                self.offset, self.record
            )?,
        }
        write!(f, "; the {} events before it were read", self.events_before)
    }
}

/// Why a trace could not be read at all.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// Reading failed.
    #[error("reading the trace failed: {0}")]
    Io(#[from] io::Error),
    /// The file does not start like a trace.
    #[error("not a memory trace: {}", not_a_trace(found))]
    NotATrace {
        /// The first bytes found (up to eight).
        found: Vec<u8>,
    },
    /// The trace has a major version this reader does not know.
    #[error(
        "trace format version {major}.{minor} is not supported: this reader reads major version {supported} \
         (memory-trace {crate_version}); read it with a memory-trace that knows version {major}"
    )]
    UnsupportedVersion {
        /// The file's major version.
        major: u16,
        /// The file's minor version.
        minor: u16,
        /// The major version this reader reads.
        supported: u16,
        /// This crate's version.
        crate_version: &'static str,
    },
    /// The header is shorter than its own length field says, or than the fixed part.
    #[error(
        "the trace header is cut short ({found} of {needed} bytes): the file ends before its first record (a \
         recording cut short as it started); record again"
    )]
    ShortHeader {
        /// Bytes needed.
        needed: u64,
        /// Bytes found.
        found: u64,
    },
    /// The header's length field is not one the file's version can have: a version's
    /// header is 32 bytes, a newer minor's may be longer, never shorter.
    #[error(
        "the trace header says it is {length} bytes long, but a version {major}.{minor} header is {}: the header's \
         length field (bytes 12-15) is damaged; {}",
        if *exact { "32 bytes" } else { "at least 32 bytes" },
        if *exact {
            "the records of this version start at byte 32: set the field to 32 (20 00 00 00) to read them"
        } else {
            "read the file with the memory-trace that wrote it"
        }
    )]
    HeaderLength {
        /// What the length field says.
        length: u32,
        /// The file's major version.
        major: u16,
        /// The file's minor version.
        minor: u16,
        /// Whether the version is one this reader knows whole (its header is exactly 32
        /// bytes).
        exact: bool,
    },
}

/// What a file that is not a trace starts with, for [`ReadError::NotATrace`].
fn not_a_trace(found: &[u8]) -> String {
    let hint = "a trace starts with \"MEMTRACE\" (record one with memory_trace::Recorder)";
    if found.is_empty() {
        format!(
            "the file is empty, as a recording whose process ended before its first write (or whose disk was full) \
             leaves it; record again ({hint})"
        )
    } else {
        format!("the file starts with {found:02x?}, {hint}")
    }
}

/// Reads up to `buf.len()` bytes; how many were read (short only at the end).
fn read_full(input: &mut dyn Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut at = 0;
    while at < buf.len() {
        match input.read(&mut buf[at..]) {
            Ok(0) => break,
            Ok(n) => at += n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(at)
}

/// Reads a trace from `input` (a file, a byte slice).
///
/// A damaged file is read up to the damage, and [`Trace::damage`] says where; only a
/// file that is not a trace, a major version this reader does not know, or an I/O
/// error is an error.
///
/// # Errors
/// [`ReadError`] as above.
pub fn read_trace(input: impl Read) -> Result<Trace, ReadError> {
    let mut trace = read_with(input, None)?;
    trace.events.sort_by_key(|event| (event.ts_ns, event.thread));
    Ok(trace)
}

/// Reads a trace from `input` and hands each event to `visit` as it is decoded, in file
/// order (not sorted by time: a recording writes each thread's events in order, threads
/// in batches), keeping none of them: for traces too large to hold. The trace returned
/// has everything but [`Trace::events`], which is empty.
///
/// # Errors
/// As [`read_trace`].
pub fn scan_trace(input: impl Read, mut visit: impl FnMut(Event)) -> Result<Trace, ReadError> {
    read_with(input, Some(&mut visit))
}

fn read_with(mut input: impl Read, sink: Option<&mut dyn FnMut(Event)>) -> Result<Trace, ReadError> {
    let input: &mut dyn Read = &mut input;
    let mut fixed = [0u8; 32];
    let got = read_full(input, &mut fixed)?;
    if got < 8 || fixed[..8] != MAGIC {
        return Err(ReadError::NotATrace { found: fixed[..got.min(8)].to_vec() });
    }
    if got < 16 {
        return Err(ReadError::ShortHeader { needed: 32, found: got as u64 });
    }
    let major = u16::from_le_bytes([fixed[8], fixed[9]]);
    let minor = u16::from_le_bytes([fixed[10], fixed[11]]);
    if major != MAJOR {
        return Err(ReadError::UnsupportedVersion {
            major,
            minor,
            supported: MAJOR,
            crate_version: env!("CARGO_PKG_VERSION"),
        });
    }
    let header_bytes = u32::from_le_bytes([fixed[12], fixed[13], fixed[14], fixed[15]]);
    // A version this reader knows whole has exactly its header; a newer minor's may be
    // longer (skipped below), never shorter.
    #[allow(clippy::absurd_extreme_comparisons, reason = "MINOR is 0 for now; the comparison is for later minors")]
    let exact = minor <= MINOR;
    if header_bytes < 32 || (exact && header_bytes != format::HEADER_BYTES) {
        return Err(ReadError::HeaderLength { length: header_bytes, major, minor, exact });
    }
    if got < 32 {
        return Err(ReadError::ShortHeader { needed: u64::from(header_bytes), found: got as u64 });
    }
    let origin_unix_ns = u64::from_le_bytes(fixed[16..24].try_into().unwrap_or_default());
    // A newer minor version may have a longer header: skip what this version does not know.
    let extra = u64::from(header_bytes - 32);
    let skipped = io::copy(&mut input.take(extra), &mut io::sink())?;
    if skipped < extra {
        return Err(ReadError::ShortHeader { needed: u64::from(header_bytes), found: 32 + skipped });
    }
    let mut reader = Reader {
        trace: Trace {
            version: (major, minor),
            origin_unix_ns,
            tenants: Vec::new(),
            threads: Vec::new(),
            events: Vec::new(),
            end: None,
            damage: None,
            skipped: 0,
        },
        offset: u64::from(header_bytes),
        record: 0,
        sink,
        count: 0,
        exact,
    };
    reader.records(input)?;
    let mut trace = reader.trace;
    trace.tenants.sort_by_key(|tenant| tenant.id);
    trace.threads.sort();
    Ok(trace)
}

struct Reader<'s> {
    trace: Trace,
    offset: u64,
    record: u64,
    /// Where events go; `None`: into `trace.events`.
    sink: Option<&'s mut dyn FnMut(Event)>,
    /// Events read.
    count: u64,
    /// The file's minor version is one this reader knows whole (this one or older), so
    /// it holds nothing this reader does not know: a record or event kind it lacks, bytes
    /// past a record's fields, or counts in the end record other than those read are
    /// damage, not a newer version's additions. (A record's header is not under its
    /// checksum: one flipped bit in its kind turns an events record into an unknown kind,
    /// a thread record or the end record, which a lenient reader would skip or misread
    /// without a word.)
    exact: bool,
}

impl Reader<'_> {
    fn damage(&mut self, kind: DamageKind) {
        self.trace.damage = Some(Damage { offset: self.offset, record: self.record, events_before: self.count, kind });
    }

    fn event(&mut self, event: Event) {
        self.count += 1;
        match &mut self.sink {
            Some(sink) => sink(event),
            None => self.trace.events.push(event),
        }
    }

    fn records(&mut self, input: &mut dyn Read) -> io::Result<()> {
        let mut payload = Vec::new();
        loop {
            let mut header = [0u8; RECORD_HEADER_BYTES];
            let got = read_full(input, &mut header)?;
            if got == 0 {
                if self.trace.end.is_none() {
                    self.damage(DamageKind::Unfinished);
                }
                return Ok(());
            }
            if got < RECORD_HEADER_BYTES {
                self.damage(DamageKind::Truncated { needed: RECORD_HEADER_BYTES as u64, found: got as u64 });
                return Ok(());
            }
            let kind = u32::from_le_bytes(header[0..4].try_into().unwrap_or_default());
            let length = u32::from_le_bytes(header[4..8].try_into().unwrap_or_default());
            let expected = u32::from_le_bytes(header[8..12].try_into().unwrap_or_default());
            if length > MAX_PAYLOAD {
                self.damage(DamageKind::Malformed(format!(
                    "a record of kind {kind} claims {length} bytes, more than the 64 MiB a record may have"
                )));
                return Ok(());
            }
            payload.resize(length as usize, 0);
            let got = read_full(input, &mut payload)?;
            if got < payload.len() {
                let needed = (RECORD_HEADER_BYTES + payload.len()) as u64;
                self.damage(DamageKind::Truncated { needed, found: (RECORD_HEADER_BYTES + got) as u64 });
                return Ok(());
            }
            let found = format::crc32(&payload);
            if found != expected {
                self.damage(DamageKind::Checksum { expected, found });
                return Ok(());
            }
            if let Err(what) = self.record(kind, &payload) {
                self.damage(DamageKind::Malformed(what));
                return Ok(());
            }
            self.offset += (RECORD_HEADER_BYTES + payload.len()) as u64;
            self.record += 1;
            if kind == record::END {
                // Anything after the end record is not part of the recording.
                return Ok(());
            }
        }
    }

    fn record(&mut self, kind: u32, payload: &[u8]) -> Result<(), String> {
        let mut cursor = Cursor::new(payload);
        match kind {
            record::EVENTS => self.events(payload)?,
            record::TENANT => {
                let id = cursor.u32()?;
                let device = device(&mut cursor)?;
                cursor.skip(4)?;
                let quota = optional(cursor.u64()?);
                let device_limit = optional(cursor.u64()?);
                let label = cursor.string()?;
                let mut tenant = Tenant::new(id, device, label);
                tenant.authority = cursor.string()?;
                tenant.allocator = cursor.string()?;
                (tenant.quota, tenant.device_limit) = (quota, device_limit);
                self.trace.tenants.push(tenant);
            }
            record::THREAD => {
                let thread = cursor.u32()?;
                self.trace.threads.push((thread, cursor.string()?));
            }
            record::MARK => {
                let ts_ns = cursor.u64()?;
                let thread = cursor.u32()?;
                let tenant = cursor.u32()?;
                let device = device(&mut cursor)?;
                let kind = MarkKind::decode(cursor.u8()?);
                cursor.skip(3)?;
                let value = cursor.u64()?;
                let label = cursor.string()?;
                self.event(Event::new(ts_ns, thread, device, tenant, None, What::Mark { kind, value, label }));
            }
            record::END => {
                let end = End { events: cursor.u64()?, records: cursor.u64()?, dropped: cursor.u64()? };
                self.check_end(&end)?;
                self.trace.end = Some(end);
            }
            _ if self.exact => {
                let (major, minor) = self.trace.version;
                return Err(format!(
                    "a record of kind {kind}, which format version {major}.{minor} (the file's) does not have: the \
                     record's header is damaged (its kind is not covered by the checksum)"
                ));
            }
            _ => {
                self.trace.skipped += 1;
                return Ok(());
            }
        }
        if self.exact && cursor.remaining() > 0 && kind != record::EVENTS {
            return Err(format!(
                "a {} record of {} bytes has {} bytes past its fields, which format version {}.{} does not have: \
                 the record's header is damaged (its kind is not covered by the checksum)",
                record::name(kind),
                payload.len(),
                cursor.remaining(),
                self.trace.version.0,
                self.trace.version.1
            ));
        }
        Ok(())
    }

    /// The end record's counts against what was read: the recording's records, this one
    /// included, and (for a version this reader knows whole) its events.
    fn check_end(&self, end: &End) -> Result<(), String> {
        let records = self.record + 1;
        let events_differ = self.exact && end.events != self.count;
        if end.records != records || events_differ {
            return Err(format!(
                "the end record says the recording wrote {} events in {} records, but {} events in {records} records \
                 were read: a record before it was lost or misread (a damaged record header), or this is not an end \
                 record",
                end.events, end.records, self.count
            ));
        }
        Ok(())
    }

    fn events(&mut self, payload: &[u8]) -> Result<(), String> {
        if !payload.len().is_multiple_of(8) {
            return Err(format!("an events record of {} bytes is not a whole number of words", payload.len()));
        }
        let words: Vec<u64> =
            payload.chunks_exact(8).map(|word| u64::from_le_bytes(word.try_into().unwrap_or_default())).collect();
        let mut at = 0;
        while at < words.len() {
            if at + format::words::HEADER > words.len() {
                return Err(format!("an event at word {at} of the record is cut short"));
            }
            let size = format::split_word1(words[at + 1]).size;
            if size < format::words::HEADER || at + size > words.len() {
                return Err(format!(
                    "an event at word {at} of the record says it has {size} words ({} remain)",
                    words.len() - at
                ));
            }
            match Event::decode(&words[at..at + size])? {
                Some(event) => self.event(event),
                None if self.exact => {
                    let (major, minor) = self.trace.version;
                    return Err(format!(
                        "an event at word {at} of the record has kind {}, which format version {major}.{minor} (the \
                         file's) does not have",
                        format::split_word1(words[at + 1]).kind
                    ));
                }
                None => self.trace.skipped += 1,
            }
            at += size;
        }
        Ok(())
    }
}

fn device(cursor: &mut Cursor<'_>) -> Result<memory_governor::DeviceKey, String> {
    let tier = cursor.u8()?;
    cursor.skip(3)?;
    let index = cursor.u32()?;
    format::device_of(tier, index).ok_or_else(|| format!("device tier {tier} is unknown"))
}

fn optional(word: u64) -> Option<u64> {
    (word != format::NONE).then_some(word)
}

impl Trace {
    /// The tenant numbered `id`.
    pub fn tenant(&self, id: u32) -> Option<&Tenant> {
        self.tenants.iter().find(|tenant| tenant.id == id)
    }

    /// The label of tenant `id` (`tenant N` when the trace does not name it).
    pub fn tenant_label(&self, id: u32) -> String {
        self.tenant(id).map_or_else(|| format!("tenant {id}"), |tenant| tenant.label.clone())
    }

    /// The name of thread `thread`.
    pub fn thread_name(&self, thread: u32) -> Option<&str> {
        self.threads.iter().find(|(number, _)| *number == thread).map(|(_, name)| name.as_str())
    }

    /// The devices the events name, in order.
    pub fn devices(&self) -> Vec<memory_governor::DeviceKey> {
        let mut devices: Vec<_> = self.events.iter().map(|event| event.device).collect();
        devices.extend(self.tenants.iter().map(|tenant| tenant.device));
        devices.sort();
        devices.dedup();
        devices
    }
}
