//! `memory-trace`: replay, convert and summarise allocation traces (what
//! `cargo xtask replay` runs).
//!
//! ```text
//! memory-trace replay TRACE [--allocator system|pooled|virtual] [--device-limit BYTES]
//!                           [--compare A,B,...] [--no-quotas] [--html REPORT.html]
//! memory-trace info TRACE
//! memory-trace chrome TRACE OUT.json
//! memory-trace rmm TRACE OUT.csv [--device INDEX|TIER:INDEX]
//! ```
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use memory_governor::DeviceKey;
use memory_trace::replay::{self, AllocatorKind, ReplayConfig};
use memory_trace::{Trace, read_trace};

const USAGE: &str = "\
usage:
  memory-trace replay TRACE [--allocator system|pooled|virtual] [--device-limit BYTES]
                            [--compare A,B,...] [--no-quotas] [--html REPORT.html]
      Replays TRACE against each configuration on a host-backed simulated device, the
      governor in front, and prints peak allocated and reserved, fragmentation at the
      peak, refusals (the first refused event) and allocate/release latency side by side.
      --allocator      the stack (default pooled)
      --device-limit   every device's limit (default: the one recorded), e.g. 256MiB
      --compare        several stacks, each optionally with its own limit: system,pooled@64MiB
      --no-quotas      tenants without the quotas recorded
      --html           also write one self-contained page with the timeline
  memory-trace info TRACE             what the trace holds, and any damage
  memory-trace chrome TRACE OUT.json  the Chrome trace-event format (chrome://tracing, Perfetto)
  memory-trace rmm TRACE OUT.csv [--device INDEX|TIER:INDEX]
                                      RMM's replay log (Thread,Time,Action,Pointer,Size,Stream)
                                      of one device (0, device:0, host:1) or all";

/// What `replay` was asked.
#[derive(Debug, PartialEq)]
struct Replay {
    trace: PathBuf,
    configs: Vec<ReplayConfig>,
    html: Option<PathBuf>,
}

fn parse_replay(args: &[String]) -> Result<Replay, String> {
    let mut trace = None;
    let mut allocator = None;
    let mut limit = None;
    let mut compare: Option<Vec<ReplayConfig>> = None;
    let mut quotas = true;
    let mut html = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().cloned().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--allocator" => allocator = Some(value("--allocator")?.parse::<AllocatorKind>()?),
            "--device-limit" => limit = Some(replay::parse_bytes(&value("--device-limit")?)?),
            "--compare" => {
                let list = value("--compare")?;
                compare =
                    Some(list.split(',').filter(|part| !part.is_empty()).map(str::parse).collect::<Result<_, _>>()?);
            }
            "--no-quotas" => quotas = false,
            "--html" => html = Some(PathBuf::from(value("--html")?)),
            flag if flag.starts_with("--") => return Err(format!("unknown flag {flag}")),
            path if trace.is_none() => trace = Some(PathBuf::from(path)),
            extra => return Err(format!("unexpected argument {extra}")),
        }
    }
    let trace = trace.ok_or("replay needs a TRACE")?;
    let mut configs = Vec::new();
    if let Some(kind) = allocator {
        configs.push(ReplayConfig::new(kind));
    }
    if let Some(list) = compare {
        for config in list {
            if !configs.contains(&config) {
                configs.push(config);
            }
        }
    }
    if configs.is_empty() {
        configs.push(ReplayConfig::new(AllocatorKind::Pooled));
    }
    for config in &mut configs {
        if config.device_limit.is_none()
            && let Some(limit) = limit
        {
            *config = config.with_device_limit(limit);
        }
        if !quotas {
            *config = config.without_quotas();
        }
    }
    Ok(Replay { trace, configs, html })
}

fn load(path: &str) -> Result<Trace, String> {
    let file = std::fs::File::open(path).map_err(|error| format!("cannot open {path}: {error}"))?;
    let trace = read_trace(std::io::BufReader::new(file)).map_err(|error| format!("{path}: {error}"))?;
    if let Some(damage) = &trace.damage {
        eprintln!("memory-trace: warning: {path}: {damage}");
    }
    Ok(trace)
}

fn write(path: &str, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|error| format!("cannot write {path}: {error}"))
}

fn info(trace: &Trace) -> String {
    let mut kinds = std::collections::BTreeMap::new();
    for event in &trace.events {
        *kinds.entry(event.kind_name()).or_insert(0u64) += 1;
    }
    let mut out = format!(
        "format {}.{}, {} events over {:.3} s, {} threads\n",
        trace.version.0,
        trace.version.1,
        trace.events.len(),
        trace.events.last().map_or(0.0, |event| event.ts_ns as f64 / 1e9),
        trace.threads.len()
    );
    for (kind, count) in kinds {
        out.push_str(&format!("  {kind}: {count}\n"));
    }
    for tenant in &trace.tenants {
        out.push_str(&format!(
            "tenant {} \"{}\" ({}) on {} via {}: quota {}, device limit {}\n",
            tenant.id,
            tenant.label,
            tenant.authority,
            tenant.device,
            tenant.allocator,
            tenant.quota.map_or_else(|| "none".to_owned(), replay::bytes),
            tenant.device_limit.map_or_else(|| "none".to_owned(), replay::bytes)
        ));
    }
    match (&trace.end, &trace.damage) {
        (Some(end), None) => {
            out.push_str(&format!("finished: {} events written, {} dropped\n", end.events, end.dropped))
        }
        (_, Some(damage)) => out.push_str(&format!("damaged: {damage}\n")),
        (None, None) => {}
    }
    out
}

/// The trace's device that `--device` names: an index (`0`), or a device as the trace
/// names it (`device:0`, `host:1`). A device the trace does not have was taken as
/// `device:INDEX`, and the log came out as its header alone, without a word.
fn pick_device(trace: &Trace, asked: &str) -> Result<DeviceKey, String> {
    let devices = trace.devices();
    let names: Vec<String> = devices.iter().map(ToString::to_string).collect();
    let known = if names.is_empty() { "none".to_owned() } else { names.join(", ") };
    let matching: Vec<DeviceKey> = match asked.parse::<u32>() {
        Ok(index) => devices.iter().copied().filter(|device| device.index() == index).collect(),
        Err(_) => devices.iter().copied().filter(|device| device.to_string() == asked).collect(),
    };
    match matching[..] {
        [device] => Ok(device),
        [] => Err(format!(
            "--device {asked}: the trace has no such device (its devices: {known}); pass one of those, or leave \
             --device out for all of them"
        )),
        _ => Err(format!(
            "--device {asked}: the index names several of the trace's devices ({}); pass one of them as written",
            matching.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
        )),
    }
}

fn run(args: &[String]) -> Result<(), String> {
    match args.first().map(String::as_str) {
        Some("replay") => {
            let replay = parse_replay(&args[1..])?;
            let path = replay.trace.display().to_string();
            let trace = load(&path)?;
            let reports = replay::replay_all(&trace, &replay.configs);
            println!("replay of {path}: {}", replay::table(&trace, &reports));
            if let Some(html) = replay.html {
                let name = replay.trace.file_name().map_or(path.clone(), |name| name.to_string_lossy().into_owned());
                let page = memory_trace::html::report(&format!("Where did my memory go? {name}"), &trace, &reports);
                let out = html.display().to_string();
                write(&out, &page)?;
                println!("wrote {out}");
            }
            Ok(())
        }
        Some("info") => {
            let path = args.get(1).ok_or("info needs a TRACE")?;
            print!("{}", info(&load(path)?));
            Ok(())
        }
        Some("chrome") => {
            let (path, out) = (args.get(1).ok_or("chrome needs a TRACE")?, args.get(2).ok_or("chrome needs OUT.json")?);
            write(out, &memory_trace::convert::chrome_trace_json(&load(path)?))
        }
        Some("rmm") => {
            let (path, out) = (args.get(1).ok_or("rmm needs a TRACE")?, args.get(2).ok_or("rmm needs OUT.csv")?);
            let asked = match args.get(3).map(String::as_str) {
                Some("--device") => Some(args.get(4).ok_or("--device needs an index or a device (device:0)")?),
                Some(other) => return Err(format!("unexpected argument {other}")),
                None => None,
            };
            let trace = load(path)?;
            let device = asked.map(|asked| pick_device(&trace, asked)).transpose()?;
            write(out, &memory_trace::convert::rmm_csv(&trace, device))
        }
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(format!("unknown command {other}\n{USAGE}")),
        None => Err(USAGE.to_owned()),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("memory-trace: {message}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn replay_flags_build_the_configurations_in_order() {
        let replay =
            parse_replay(&args("t.mtrace --allocator system --compare pooled,virtual@1GiB --device-limit 64MiB"))
                .unwrap();
        assert_eq!(replay.trace, PathBuf::from("t.mtrace"));
        let labels: Vec<String> = replay.configs.iter().map(ReplayConfig::label).collect();
        assert_eq!(labels, ["system @ 64.0 MiB", "pooled @ 64.0 MiB", "virtual @ 1.00 GiB"]);
        let replay = parse_replay(&args("t.mtrace --no-quotas --html out.html")).unwrap();
        assert_eq!(replay.configs, [ReplayConfig::new(AllocatorKind::Pooled).without_quotas()]);
        assert_eq!(replay.html, Some(PathBuf::from("out.html")));
    }

    #[test]
    fn rmm_device_names_a_device_the_trace_has_or_is_refused_with_the_ones_it_has() {
        use memory_governor::MemoryRole;
        use memory_trace::{Block, Event, TraceWriter, What};
        let mut writer = TraceWriter::new(Vec::new(), 0).unwrap();
        for (ts, device) in [(1, DeviceKey::device(0)), (2, DeviceKey::host(0)), (3, DeviceKey::device(2))] {
            let block = Block::new(ts, ts << 12, 64, 64);
            writer.event(&Event::new(ts, 1, device, 1, Some(MemoryRole::Other), What::Allocate(block))).unwrap();
        }
        let trace = read_trace(&writer.finish().unwrap()[..]).unwrap();
        assert_eq!(pick_device(&trace, "2"), Ok(DeviceKey::device(2)));
        assert_eq!(pick_device(&trace, "host:0"), Ok(DeviceKey::host(0)));
        assert_eq!(pick_device(&trace, "device:0"), Ok(DeviceKey::device(0)));
        let missing = pick_device(&trace, "1").unwrap_err();
        assert!(missing.contains("no such device") && missing.contains("device:0, device:2, host:0"), "{missing}");
        let missing = pick_device(&trace, "gpu7").unwrap_err();
        assert!(missing.contains("--device gpu7: the trace has no such device"), "{missing}");
        let several = pick_device(&trace, "0").unwrap_err();
        assert!(several.contains("names several") && several.contains("device:0, host:0"), "{several}");
    }

    #[test]
    fn bad_replay_flags_say_what_is_wrong() {
        for (line, needle) in [
            ("", "needs a TRACE"),
            ("t --allocator slab", "unknown allocator `slab`"),
            ("t --device-limit lots", "unknown unit `lots`"),
            ("t --device-limit 1.2.3MiB", "not a size"),
            ("t --device-limit 3parsecs", "unknown unit"),
            ("t --compare pooled@", "not a size"),
            ("t --bogus", "unknown flag --bogus"),
            ("t u", "unexpected argument u"),
            ("t --html", "--html needs a value"),
        ] {
            let error = parse_replay(&args(line)).unwrap_err();
            assert!(error.contains(needle), "{line}: {error}");
        }
    }
}
