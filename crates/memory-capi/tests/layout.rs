//! Both headers compile with the system compiler as C11 and as C++17 (warnings are
//! errors), and every struct has the size, alignment and field offsets Rust gives it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use memory_capi::*;
use memory_plugin_abi::*;
use memory_testkit::native::{Language, NativeBuild};

/// `(type, [fields])` for every struct of both headers, with Rust's figures.
macro_rules! layouts {
    ($($ty:ident { $($field:ident),* $(,)? })*) => {
        fn rust_layouts() -> BTreeMap<String, usize> {
            let mut map = BTreeMap::new();
            $(
                map.insert(format!("{}.size", stringify!($ty)), std::mem::size_of::<$ty>());
                map.insert(format!("{}.align", stringify!($ty)), std::mem::align_of::<$ty>());
                $(map.insert(format!("{}.{}", stringify!($ty), stringify!($field)), std::mem::offset_of!($ty, $field));)*
            )*
            map
        }

        fn probe_source() -> String {
            let mut lines = String::new();
            $(
                lines.push_str(&format!("    PRINT(\"{0}.size\", sizeof({0}));\n", stringify!($ty)));
                lines.push_str(&format!("    PRINT(\"{0}.align\", _Alignof_({0}));\n", stringify!($ty)));
                $(lines.push_str(&format!("    PRINT(\"{0}.{1}\", offsetof({0}, {1}));\n", stringify!($ty), stringify!($field)));)*
            )*
            lines
        }
    };
}

layouts! {
    MpHeader { struct_size, abi_major, abi_minor }
    MpDevice { tier, index }
    MpRequest { bytes, align, role, reserved }
    MpBlock { address, bytes, align, device, tag }
    MpReleaseOutcome { kind, reserved, unmapped_bytes, residual_bytes, block }
    MpStats { live_bytes, live_allocations, cached_bytes, reserved_bytes, allocations_total, failures_total }
    MpTally { instances, allocations, bytes, backings, deferred }
    MpBacking { handle, bytes }
    MpHost { header, offered_capabilities, config, config_length, host_data, log }
    MpAllocator {
        header, capabilities, instance, name, device, allocate, release, destroy, tally, stats, trim, forget_lost,
        virtual_granularity, commit, decommit, committed_bytes, shared_granularity, create_backing, map, unmap,
        drop_backing, defer_release, poll_deferred,
    }
    McReleaseReport { kind, reserved, unmapped_bytes, residual_bytes }
    McAllocationInfo { address, bytes, align, device }
    McInvalidation { mechanisms, contexts, selection_dropped, reserved }
    McTermination { already_terminated, reserved, mechanisms, lost_allocations, lost_bytes, discharged_quarantine }
    McPluginTallies {
        host_instances, host_allocations, host_bytes, host_backings, host_queued_releases, host_suspect_blocks,
        host_other_pins, plugin_reported, reserved, plugin,
    }
    McReclaimRequest { device, bytes, role, reserved }
    McSuspectRetry { discharged, still_suspect }
    McRecordingSummary { events, records, bytes, dropped, waits }
}

fn probe(language: Language, extension: &str) -> BTreeMap<String, usize> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("layout");
    std::fs::create_dir_all(&dir).unwrap();
    let alignof = match language {
        Language::C(_) => "_Alignof",
        Language::Cpp(_) => "alignof",
    };
    let source = format!(
        "#include <stddef.h>\n#include <stdio.h>\n#include \"memory_plugin.h\"\n#include \"memory_capi.h\"\n\
         #define _Alignof_(t) {alignof}(t)\n#define PRINT(name, value) printf(\"%s %zu\\n\", name, (size_t)(value))\n\
         int main(void) {{\n{}    return 0;\n}}\n",
        probe_source()
    );
    let path = dir.join(format!("probe.{extension}"));
    std::fs::write(&path, source).unwrap();
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include");
    let program =
        NativeBuild::new(language).source(&path).include(include).executable(&dir, &format!("probe-{extension}"));
    let output = Command::new(&program).output().expect("the probe runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| {
            let (name, value) = line.split_once(' ').expect("name value");
            (name.to_owned(), value.parse().expect("a number"))
        })
        .collect()
}

fn compare(language: Language, extension: &str) {
    let c = probe(language, extension);
    let rust = rust_layouts();
    let differences: Vec<String> = rust
        .iter()
        .filter(|(name, value)| c.get(*name) != Some(value))
        .map(|(name, value)| format!("{name}: Rust {value}, {extension} {:?}", c.get(name)))
        .collect();
    assert!(differences.is_empty(), "layout drift between the headers and Rust:\n  {}", differences.join("\n  "));
    assert_eq!(c.len(), rust.len());
}

#[test]
fn headers_compile_as_c11_with_the_layouts_rust_uses() {
    compare(Language::C("c11"), "c");
}

#[test]
fn headers_compile_as_cpp17_with_the_layouts_rust_uses() {
    compare(Language::Cpp("c++17"), "cpp");
}
