//! The format: the spec's tables match the bytes written; a synthetic trace's bytes are
//! pinned; unknown major versions are refused with a clear error; newer minor versions'
//! additions are skipped; damaged files are read up to the damage, which is located.

mod common;

use common::*;
use memory_governor::MemoryRole;
use memory_trace::{
    Block, DamageKind, Event, MAJOR, MINOR, ReadError, ReleaseKind, Trace, TraceWriter, What, crc32, read_trace,
};

fn read(bytes: &[u8]) -> Trace {
    read_trace(bytes).expect("readable")
}

/// The records of a trace's bytes: (offset, kind, payload).
fn records(bytes: &[u8]) -> Vec<(usize, u32, &[u8])> {
    let mut at = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    let mut out = Vec::new();
    while at + 16 <= bytes.len() {
        let kind = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let length = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
        out.push((at, kind, &bytes[at + 16..at + 16 + length]));
        at += 16 + length;
    }
    out
}

/// The rows of the markdown table under `heading` in docs/TRACE-FORMAT.md whose first
/// cell is a number: (number, cells).
fn spec_rows(after: &str) -> Vec<(u64, Vec<String>)> {
    let spec = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/TRACE-FORMAT.md")).unwrap();
    let start = spec.find(after).unwrap_or_else(|| panic!("the spec has no `{after}`"));
    spec[start..]
        .lines()
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .filter_map(|line| {
            let cells: Vec<String> = line.trim_matches('|').split('|').map(|cell| cell.trim().to_owned()).collect();
            Some((cells[0].parse().ok()?, cells))
        })
        .collect()
}

fn one_of_each() -> Vec<Event> {
    let events = synthetic_events();
    let mut kinds = Vec::new();
    let mut seen = Vec::new();
    for event in events {
        let name = event.kind_name();
        if !seen.contains(&name) {
            seen.push(name);
            kinds.push(event);
        }
    }
    assert_eq!(seen.len(), 6, "{seen:?}");
    kinds
}

#[test]
fn the_specs_tables_are_the_bytes_written() {
    let header = spec_rows("### Header");
    let bytes = synthetic_bytes();
    assert_eq!(&bytes[..8], b"MEMTRACE");
    assert_eq!(header[1].1[3], MAJOR.to_string());
    assert_eq!(header[2].1[3], MINOR.to_string());
    assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), MAJOR);
    assert_eq!(u16::from_le_bytes([bytes[10], bytes[11]]), MINOR);
    assert!(header[3].1[3].starts_with("32"));
    assert_eq!(u32::from_le_bytes(bytes[12..16].try_into().unwrap()), 32);
    // Record kinds.
    let kinds: std::collections::BTreeMap<String, u64> =
        spec_rows("| kind | name | payload |").into_iter().map(|(number, cells)| (cells[1].clone(), number)).collect();
    let written: std::collections::BTreeSet<u32> = records(&bytes).iter().map(|(_, kind, _)| *kind).collect();
    for name in ["events", "tenant", "thread", "mark", "end"] {
        assert!(written.contains(&(kinds[name] as u32)), "record kind {name} = {} not written", kinds[name]);
    }
    assert_eq!(records(&bytes).last().unwrap().1 as u64, kinds["end"], "the end record comes last");
    // Event kinds and sizes, from one event of each kind written alone.
    let events = spec_rows("| kind | name | words |");
    assert_eq!(events.len(), 5);
    for event in one_of_each().into_iter().filter(|event| event.kind_name() != "mark") {
        let mut writer = TraceWriter::new(Vec::new(), 0).unwrap();
        writer.event(&event).unwrap();
        let bytes = writer.finish().unwrap();
        let (_, kind, payload) = records(&bytes)[0];
        assert_eq!(u64::from(kind), kinds["events"]);
        let word1 = u64::from_le_bytes(payload[8..16].try_into().unwrap());
        let (size, code) = (word1 & 0xff, (word1 >> 8) & 0xff);
        let (number, cells) = events.iter().find(|(_, cells)| cells[1] == event.kind_name()).unwrap();
        assert_eq!((code, size.to_string()), (*number, cells[2].clone()), "{}", event.kind_name());
        assert_eq!(payload.len() as u64, size * 8);
        assert_eq!((word1 >> 24) & 0xff, 0, "tier 0 is a GPU");
    }
}

#[test]
fn the_synthetic_trace_in_the_repository_has_exactly_these_bytes() {
    // `MEMORY_TRACE_BLESS=1 cargo test -p memory-trace --test format` rewrites it after a
    // deliberate format or workload change; a change otherwise is a format break.
    let bytes = synthetic_bytes();
    let path = trace_path("synthetic.mtrace");
    if std::env::var_os("MEMORY_TRACE_BLESS").is_some() {
        std::fs::write(&path, &bytes).unwrap();
    }
    let checked_in = std::fs::read(&path).expect("traces/synthetic.mtrace (MEMORY_TRACE_BLESS=1 writes it)");
    assert!(checked_in == bytes, "traces/synthetic.mtrace differs from what this version writes");
    let trace = read(&bytes);
    let expected = synthetic_events();
    assert_eq!(trace.events.len(), expected.len());
    for (read, written) in trace.events.iter().zip(&expected) {
        assert_eq!(read, written, "every event round-trips");
    }
    assert_eq!(trace.tenants.iter().map(|t| t.label.as_str()).collect::<Vec<_>>(), ["chat", "embed"]);
    assert_eq!(trace.tenants[0].quota, Some(200 * MIB));
    assert_eq!(trace.thread_name(3), Some("chat-engine"));
    assert_eq!(trace.end.unwrap().events, synthetic_events().len() as u64);
    assert_eq!(trace.origin_unix_ns, 1_700_000_000_000_000_000);
}

#[test]
fn an_unknown_major_version_is_refused_with_both_versions_named() {
    let mut bytes = synthetic_bytes();
    bytes[8..10].copy_from_slice(&2u16.to_le_bytes());
    bytes[10..12].copy_from_slice(&3u16.to_le_bytes());
    let error = read_trace(&bytes[..]).unwrap_err();
    assert!(matches!(error, ReadError::UnsupportedVersion { major: 2, minor: 3, supported: 1, .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.contains("version 2.3 is not supported") && message.contains("major version 1"), "{message}");
}

#[test]
fn a_file_that_is_not_a_trace_is_refused() {
    for bytes in [&b""[..], b"MEMTRAC", b"{\"traceEvents\": []}", b"Thread,Time,Action"] {
        let error = read_trace(bytes).unwrap_err();
        assert!(matches!(error, ReadError::NotATrace { .. }), "{error:?}");
        assert!(error.to_string().contains("not a memory trace"), "{error}");
    }
    let error = read_trace(&synthetic_bytes()[..20]).unwrap_err();
    assert!(matches!(error, ReadError::ShortHeader { .. }), "{error:?}");
}

/// A damaged header length said "the trace header is cut short (32 of 32 bytes)" (below
/// 32) or asked for a 2 GiB header (a high bit), and an empty file "starts with []": each
/// now says what it found and what to do.
#[test]
fn a_damaged_header_length_or_an_empty_file_says_what_is_wrong_and_what_to_do() {
    let bytes = synthetic_bytes();
    let error = read_trace(&b""[..]).unwrap_err();
    assert!(matches!(&error, ReadError::NotATrace { found } if found.is_empty()), "{error:?}");
    let message = error.to_string();
    assert!(message.contains("the file is empty") && message.contains("record again"), "{message}");
    for length in [0u32, 16, 31, 33, 40, 0x8000_0020] {
        let mut damaged = bytes.clone();
        damaged[12..16].copy_from_slice(&length.to_le_bytes());
        let error = read_trace(&damaged[..]).unwrap_err();
        assert!(
            matches!(error, ReadError::HeaderLength { length: found, major: 1, minor: 0, exact: true } if found == length),
            "{length}: {error:?}"
        );
        let message = error.to_string();
        assert!(
            message.contains(&format!("says it is {length} bytes long"))
                && message.contains("a version 1.0 header is 32 bytes")
                && message.contains("set the field to 32"),
            "{message}"
        );
        // What it says to do reads the file.
        damaged[12..16].copy_from_slice(&32u32.to_le_bytes());
        assert_eq!(read(&damaged).events, read(&bytes).events);
    }
    // A newer minor's header may be longer, never shorter.
    let mut newer = bytes.clone();
    newer[10..12].copy_from_slice(&1u16.to_le_bytes());
    newer[12..16].copy_from_slice(&16u32.to_le_bytes());
    let error = read_trace(&newer[..]).unwrap_err();
    assert!(matches!(error, ReadError::HeaderLength { length: 16, minor: 1, exact: false, .. }), "{error:?}");
    assert!(error.to_string().contains("at least 32 bytes"), "{error}");
    let error = read_trace(&bytes[..20]).unwrap_err();
    assert!(matches!(error, ReadError::ShortHeader { needed: 32, found: 20 }), "{error:?}");
    assert!(error.to_string().contains("record again"), "{error}");
}

#[test]
fn a_newer_minor_versions_header_bytes_records_and_event_kinds_are_skipped() {
    let bytes = synthetic_bytes();
    let mut newer = bytes[..32].to_vec();
    newer[10..12].copy_from_slice(&7u16.to_le_bytes());
    newer[12..16].copy_from_slice(&40u32.to_le_bytes());
    newer.extend_from_slice(&[0xee; 8]);
    // An unknown record kind, then an events record with an unknown event kind (5 words)
    // between two known ones.
    let record = |kind: u32, payload: &[u8]| {
        let mut out = Vec::new();
        out.extend_from_slice(&kind.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&crc32(payload).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(payload);
        out
    };
    newer.extend(record(99, b"from the future"));
    let records_of = records(&bytes);
    let events_payload = records_of.iter().find(|(_, kind, _)| *kind == 1).unwrap().2;
    let first_size = (u64::from_le_bytes(events_payload[8..16].try_into().unwrap()) & 0xff) as usize * 8;
    let mut payload = events_payload[..first_size].to_vec();
    let unknown = [5u64, 5 | 77 << 8, 0, 1, 2];
    payload.extend(unknown.iter().flat_map(|word| word.to_le_bytes()));
    payload.extend_from_slice(&events_payload[first_size..]);
    newer.extend(record(1, &payload));
    let kept: Vec<_> = records_of.iter().filter(|(_, kind, _)| *kind != 1).collect();
    for (_, kind, payload) in &kept {
        let mut payload = payload.to_vec();
        if *kind == 5 {
            // The newer writer's end record counts every record it wrote, the one of a
            // kind this reader does not know included.
            let records = 2 + kept.len() as u64;
            payload[8..16].copy_from_slice(&records.to_le_bytes());
        }
        newer.extend(record(*kind, &payload));
    }
    let trace = read(&newer);
    assert_eq!(trace.version, (1, 7));
    assert_eq!(trace.skipped, 2, "one record, one event");
    assert!(trace.damage.is_none(), "{:?}", trace.damage);
    let known = events_payload.len() / 8;
    assert!(trace.events.len() > 2 && trace.events.len() < known);
}

#[test]
fn a_truncated_trace_reads_up_to_the_cut_at_every_byte_and_says_where() {
    let events = synthetic_events();
    let mut writer = TraceWriter::new(Vec::new(), 0).unwrap();
    for event in events.iter().take(20) {
        // One record per event, so every cut loses exactly the events after it.
        writer.event(event).unwrap();
        writer.thread(1, "cut").unwrap();
    }
    let bytes = writer.finish().unwrap();
    let boundaries: Vec<usize> = records(&bytes).iter().map(|(at, _, _)| *at).collect();
    for cut in 32..bytes.len() {
        let trace = read(&bytes[..cut]);
        let damage = trace.damage.clone().unwrap_or_else(|| panic!("cut at {cut}: no damage reported"));
        // The damaged record is the last one starting at or before the cut.
        let record = boundaries.iter().rposition(|&at| at <= cut).unwrap();
        assert_eq!(damage.offset, boundaries[record] as u64, "cut at {cut}");
        assert_eq!(damage.record, record as u64);
        if boundaries.contains(&cut) {
            assert_eq!(damage.kind, DamageKind::Unfinished, "cut at {cut}");
        } else {
            assert!(matches!(damage.kind, DamageKind::Truncated { .. }), "cut at {cut}: {:?}", damage.kind);
        }
        assert_eq!(damage.events_before, trace.events.len() as u64);
        assert_eq!(trace.events[..], events[..trace.events.len()], "what was read is what was written");
        let message = damage.to_string();
        assert!(message.contains(&format!("byte {}", damage.offset)), "{message}");
    }
}

#[test]
fn a_corrupt_record_stops_the_reader_there_with_a_checksum_error() {
    let bytes = synthetic_bytes();
    let all = read(&bytes);
    for (index, (at, _, payload)) in records(&bytes).into_iter().enumerate() {
        if payload.is_empty() {
            continue;
        }
        let mut corrupt = bytes.clone();
        corrupt[at + 16 + payload.len() / 2] ^= 0x40;
        let trace = read(&corrupt);
        let damage = trace.damage.expect("damage found");
        assert_eq!((damage.offset, damage.record), (at as u64, index as u64));
        assert!(matches!(damage.kind, DamageKind::Checksum { .. }), "{:?}", damage.kind);
        assert!(damage.to_string().contains("corrupt at byte"), "{damage}");
        assert!(trace.events.len() <= all.events.len());
    }
    // A length past 64 MiB is damage, not an allocation.
    let mut corrupt = bytes.clone();
    let (at, _, _) = records(&bytes)[0];
    corrupt[at + 4..at + 8].copy_from_slice(&u32::MAX.to_le_bytes());
    let damage = read(&corrupt).damage.unwrap();
    assert!(matches!(damage.kind, DamageKind::Malformed(_)) && damage.offset == at as u64, "{damage}");
}

/// A record's header is not under its checksum: a flipped bit in its kind made an
/// events record an unknown kind (skipped), a thread record (its payload ignored past a
/// name) or the end record (everything after it unread, its counts garbage), and a
/// tenant record a thread, each read back as a clean, finished trace with records
/// missing. A 1.0 file holds nothing a 1.0 reader does not know, so each is damage.
#[test]
fn a_flipped_bit_in_a_records_kind_is_damage_never_a_clean_trace_with_records_missing() {
    let bytes = synthetic_bytes();
    let whole = read(&bytes);
    assert!(whole.damage.is_none() && whole.end.is_some());
    for (index, (at, kind, _)) in records(&bytes).into_iter().enumerate() {
        for bit in 0..32 {
            let mut flipped = bytes.clone();
            flipped[at + bit / 8] ^= 1 << (bit % 8);
            let trace = read(&flipped);
            let damage = trace.damage.clone().unwrap_or_else(|| {
                panic!("record {index} (kind {kind}) at byte {at}, kind bit {bit} flipped: read as undamaged")
            });
            assert!(damage.offset >= at as u64, "the damage is at or after the flipped record: {damage}");
            assert!(damage.to_string().contains("corrupt at byte"), "{damage}");
            assert_eq!(damage.events_before, trace.events.len() as u64);
            assert!(trace.end.is_none(), "an end record that does not match what was read is not kept: {damage}");
        }
    }
    // Events (1) read as the end record (5): the counts it claims are not what was read.
    let (at, _, _) = records(&bytes).into_iter().find(|(_, kind, _)| *kind == 1).unwrap();
    let mut flipped = bytes.clone();
    flipped[at] ^= 4;
    let damage = read(&flipped).damage.unwrap();
    assert!(matches!(&damage.kind, DamageKind::Malformed(what) if what.contains("the end record says")), "{damage}");
}

#[test]
fn an_event_whose_size_runs_past_its_record_is_damage() {
    let block = Block::new(1, 0x1000, 64, 8);
    let mut writer = TraceWriter::new(Vec::new(), 0).unwrap();
    writer.event(&Event::new(5, 1, GPU, 1, Some(MemoryRole::Other), What::Allocate(block))).unwrap();
    let mut bytes = writer.finish().unwrap();
    let (at, _, payload) = records(&bytes)[0];
    let mut payload = payload.to_vec();
    payload[8] = 200; // size 200 words in a 9-word record
    let crc = crc32(&payload);
    bytes[at + 8..at + 12].copy_from_slice(&crc.to_le_bytes());
    bytes[at + 16..at + 16 + payload.len()].copy_from_slice(&payload);
    let damage = read(&bytes).damage.unwrap();
    assert!(matches!(&damage.kind, DamageKind::Malformed(what) if what.contains("200 words")), "{damage}");
}

#[test]
fn every_event_kind_round_trips_through_the_writer_and_reader() {
    let events = one_of_each();
    let mut writer = TraceWriter::new(Vec::new(), 0).unwrap();
    for event in &events {
        writer.event(event).unwrap();
    }
    let trace = read(&writer.finish().unwrap());
    assert_eq!(trace.events, events);
    let quarantine = synthetic_events()
        .into_iter()
        .find(|event| matches!(event.what, What::Release { outcome: ReleaseKind::Quarantined, .. }))
        .unwrap();
    let mut writer = TraceWriter::new(Vec::new(), 0).unwrap();
    writer.event(&quarantine).unwrap();
    assert_eq!(read(&writer.finish().unwrap()).events, [quarantine]);
}
