//! The trace format's bytes: the file header, records and events, shared by the
//! recorder (which encodes on the hot path and frames records on its writer thread), the
//! [`TraceWriter`](crate::TraceWriter) and the reader. The specification, with the same
//! numbers, is `docs/TRACE-FORMAT.md`; a test reads that file and checks its constants
//! against these.
//!
//! Everything is little-endian. An event is a whole number of 64-bit words whose first
//! three words are a common header (time; size, kind, role, device; thread, tenant), so a
//! reader can skip an event kind it does not know.

use std::io::{self, Write};

use memory_governor::{DeviceKey, MemoryRole, Tier};

/// The file's first eight bytes.
pub const MAGIC: [u8; 8] = *b"MEMTRACE";
/// The major version this crate writes and reads. A reader refuses any other major
/// version: a major change may change the meaning of existing bytes.
pub const MAJOR: u16 = 1;
/// The minor version this crate writes. Minor versions only add record kinds, event
/// kinds and trailing fields (which older readers skip); a reader reads every minor
/// version of its major.
pub const MINOR: u16 = 0;
/// Bytes of the file header this version writes.
pub(crate) const HEADER_BYTES: u32 = 32;
/// Bytes of a record header (kind, payload length, CRC-32 of the payload, zero).
pub(crate) const RECORD_HEADER_BYTES: usize = 16;
/// The largest payload a reader accepts (a corrupt length must not allocate gigabytes).
pub(crate) const MAX_PAYLOAD: u32 = 64 << 20;

/// Record kinds.
pub(crate) mod record {
    /// A batch of events (whole events, any threads, any order).
    pub(crate) const EVENTS: u32 = 1;
    /// A tenant: its number in events, device, label, authority, quota and limits.
    pub(crate) const TENANT: u32 = 2;
    /// A thread's name.
    pub(crate) const THREAD: u32 = 3;
    /// A mark: device lost, termination, or a note, at a time.
    pub(crate) const MARK: u32 = 4;
    /// The end of a finished recording, with its counts.
    pub(crate) const END: u32 = 5;

    /// A record kind's name in messages.
    pub(crate) fn name(kind: u32) -> &'static str {
        match kind {
            EVENTS => "events",
            TENANT => "tenant",
            THREAD => "thread",
            MARK => "mark",
            END => "end",
            _ => "unknown",
        }
    }
}

/// Event kinds (byte 1 of word 1).
pub(crate) mod kind {
    pub(crate) const ALLOCATE: u8 = 1;
    pub(crate) const RELEASE: u8 = 2;
    pub(crate) const REFUSAL: u8 = 3;
    pub(crate) const FAILURE: u8 = 4;
    pub(crate) const LOST: u8 = 5;
}

/// Words of each event kind this version writes.
pub(crate) mod words {
    pub(crate) const ALLOCATE: usize = 9;
    pub(crate) const RELEASE: usize = 10;
    pub(crate) const REFUSAL: usize = 18;
    pub(crate) const FAILURE: usize = 7;
    pub(crate) const LOST: usize = 7;
    /// The common header.
    pub(crate) const HEADER: usize = 3;
}

/// "No value" in an optional 64-bit field.
pub(crate) const NONE: u64 = u64::MAX;
/// "No role" in the role byte (a release: the role is the allocation's).
pub(crate) const NO_ROLE: u8 = 0xff;

/// A tier's code in the tier byte; `None` for a tier this version has no code for.
pub(crate) fn tier_code(tier: Tier) -> Option<u8> {
    match tier {
        Tier::Device => Some(0),
        Tier::Host => Some(1),
        Tier::Disk => Some(2),
        _ => None,
    }
}

/// The device of a tier code and index.
pub(crate) fn device_of(tier: u8, index: u32) -> Option<DeviceKey> {
    match tier {
        0 => Some(DeviceKey::device(index)),
        1 => Some(DeviceKey::host(index)),
        2 => Some(DeviceKey::disk(index)),
        _ => None,
    }
}

/// The role of a role byte (`None` for [`NO_ROLE`] or a role this version lacks).
pub(crate) fn role_of(code: u8) -> Option<MemoryRole> {
    MemoryRole::ALL.get(usize::from(code)).copied()
}

/// Word 1 of an event: size in words, kind, role, device.
#[inline(always)]
pub(crate) fn word1(size: usize, kind: u8, role: u8, device: DeviceKey) -> u64 {
    // A device on a tier without a code is written as tier 0xff; readers skip the event.
    let tier = tier_code(device.tier()).unwrap_or(0xff);
    size as u64 | u64::from(kind) << 8 | u64::from(role) << 16 | u64::from(tier) << 24 | u64::from(device.index()) << 32
}

/// Word 2 of an event: thread and tenant.
#[inline(always)]
pub(crate) fn word2(thread: u32, tenant: u32) -> u64 {
    u64::from(thread) | u64::from(tenant) << 32
}

/// The fields of word 1.
pub(crate) struct Word1 {
    pub(crate) size: usize,
    pub(crate) kind: u8,
    pub(crate) role: u8,
    pub(crate) tier: u8,
    pub(crate) index: u32,
}

pub(crate) fn split_word1(word: u64) -> Word1 {
    Word1 {
        size: (word & 0xff) as usize,
        kind: (word >> 8) as u8,
        role: (word >> 16) as u8,
        tier: (word >> 24) as u8,
        index: (word >> 32) as u32,
    }
}

/// CRC-32 lookup tables for slicing by eight: `TABLES[0]` is the classic byte table,
/// `TABLES[k][b]` the CRC of byte `b` followed by `k` zero bytes. The tests' reference
/// for [`crc32`], which uses `crc32fast` (carry-less multiplication where the CPU has it).
#[cfg(test)]
const TABLES: [[u32; 256]; 8] = {
    let mut tables = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { 0xedb8_8320 ^ (c >> 1) } else { c >> 1 };
            k += 1;
        }
        tables[0][i] = c;
        i += 1;
    }
    let mut t = 1;
    while t < 8 {
        let mut i = 0;
        while i < 256 {
            let previous = tables[t - 1][i];
            tables[t][i] = (previous >> 8) ^ tables[0][(previous & 0xff) as usize];
            i += 1;
        }
        t += 1;
    }
    tables
};

/// CRC-32 (IEEE 802.3, reflected, as zlib and PNG compute it) of `bytes` (the writer
/// thread checksums every record it writes): `crc32fast`, with SIMD carry-less
/// multiplication where the CPU has it, about ten times slicing-by-8's speed, which was
/// most of the writer's work per event.
pub fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// The same CRC-32, eight bytes a step with lookup tables (the tests' reference).
#[cfg(test)]
fn crc32_sliced(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        let low = crc ^ u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        let high = u32::from_le_bytes([chunk[4], chunk[5], chunk[6], chunk[7]]);
        crc = TABLES[7][(low & 0xff) as usize]
            ^ TABLES[6][((low >> 8) & 0xff) as usize]
            ^ TABLES[5][((low >> 16) & 0xff) as usize]
            ^ TABLES[4][(low >> 24) as usize]
            ^ TABLES[3][(high & 0xff) as usize]
            ^ TABLES[2][((high >> 8) & 0xff) as usize]
            ^ TABLES[1][((high >> 16) & 0xff) as usize]
            ^ TABLES[0][(high >> 24) as usize];
    }
    for &byte in chunks.remainder() {
        crc = TABLES[0][((crc ^ u32::from(byte)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// Writes the file header.
pub(crate) fn write_header(out: &mut dyn Write, origin_unix_ns: u64) -> io::Result<()> {
    let mut header = Vec::with_capacity(HEADER_BYTES as usize);
    header.extend_from_slice(&MAGIC);
    header.extend_from_slice(&MAJOR.to_le_bytes());
    header.extend_from_slice(&MINOR.to_le_bytes());
    header.extend_from_slice(&HEADER_BYTES.to_le_bytes());
    header.extend_from_slice(&origin_unix_ns.to_le_bytes());
    header.extend_from_slice(&0u64.to_le_bytes());
    out.write_all(&header)
}

/// Writes one record: its header (kind, length, CRC-32) and payload.
pub(crate) fn write_record(out: &mut dyn Write, kind: u32, payload: &[u8]) -> io::Result<()> {
    let length = u32::try_from(payload.len())
        .ok()
        .filter(|&length| length <= MAX_PAYLOAD)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "trace record larger than 64 MiB"))?;
    let mut header = [0u8; RECORD_HEADER_BYTES];
    header[0..4].copy_from_slice(&kind.to_le_bytes());
    header[4..8].copy_from_slice(&length.to_le_bytes());
    header[8..12].copy_from_slice(&crc32(payload).to_le_bytes());
    out.write_all(&header)?;
    out.write_all(payload)
}

/// Appends `text` as a length-prefixed string (u16 length, UTF-8, cut at a character
/// boundary to fit).
pub(crate) fn put_str(payload: &mut Vec<u8>, text: &str) {
    let mut end = text.len().min(usize::from(u16::MAX));
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    payload.extend_from_slice(&(end as u16).to_le_bytes());
    payload.extend_from_slice(&text.as_bytes()[..end]);
}

/// A cursor over a record's payload for the reader.
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Cursor<'a> {
        Cursor { bytes, at: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&end| end <= self.bytes.len()).ok_or_else(|| {
            format!(
                "field of {n} bytes at payload offset {} runs past the payload ({} bytes)",
                self.at,
                self.bytes.len()
            )
        })?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    pub(crate) fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap_or_default()))
    }

    pub(crate) fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap_or_default()))
    }

    pub(crate) fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap_or_default()))
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    pub(crate) fn skip(&mut self, n: usize) -> Result<(), String> {
        self.take(n).map(drop)
    }

    pub(crate) fn string(&mut self) -> Result<String, String> {
        let length = usize::from(self.u16()?);
        let bytes = self.take(length)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| "a string is not UTF-8".to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_matches_the_check_value_of_the_standard() {
        // The CRC-32/ISO-HDLC check value ("123456789").
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
        assert_eq!(crc32(b""), 0);
        // crc32fast and eight bytes a step agree with a byte at a time at every length
        // and offset.
        let bytes: Vec<u8> = (0..300u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let bytewise = |bytes: &[u8]| {
            let mut crc = !0u32;
            for &byte in bytes {
                crc = TABLES[0][((crc ^ u32::from(byte)) & 0xff) as usize] ^ (crc >> 8);
            }
            !crc
        };
        for start in 0..9 {
            for end in start..bytes.len() {
                assert_eq!(crc32(&bytes[start..end]), bytewise(&bytes[start..end]), "{start}..{end}");
                assert_eq!(crc32_sliced(&bytes[start..end]), bytewise(&bytes[start..end]), "{start}..{end}");
            }
        }
    }

    #[test]
    fn word1_round_trips_every_field() {
        let word = word1(18, kind::REFUSAL, 3, DeviceKey::disk(u32::MAX));
        let fields = split_word1(word);
        assert_eq!((fields.size, fields.kind, fields.role, fields.tier, fields.index), (18, 3, 3, 2, u32::MAX));
        assert_eq!(device_of(fields.tier, fields.index), Some(DeviceKey::disk(u32::MAX)));
        assert_eq!(role_of(NO_ROLE), None);
        assert_eq!(role_of(1), Some(MemoryRole::KvCache));
    }

    #[test]
    fn strings_are_cut_at_a_character_boundary() {
        let mut payload = Vec::new();
        let long = "é".repeat(40_000);
        put_str(&mut payload, &long);
        let mut cursor = Cursor::new(&payload);
        let back = cursor.string().unwrap();
        assert!(back.len() <= usize::from(u16::MAX) && long.starts_with(&back));
    }
}
