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

/// Compiles `source` with the system C compiler (`cc`, or `$CC`) and `flags`, syntax
/// only; returns whether it compiled and what the compiler said.
fn syntax_check(extension: &str, source: &str, flags: &[&str]) -> (bool, String) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("layout");
    std::fs::create_dir_all(&dir).unwrap();
    let name = format!("check-{}.{extension}", flags.join("").replace(['-', '=', '+'], ""));
    let path = dir.join(name);
    std::fs::write(&path, source).unwrap();
    let compiler = match extension {
        "cpp" => std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned()),
        _ => std::env::var("CC").unwrap_or_else(|_| "cc".to_owned()),
    };
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include");
    let output = Command::new(&compiler)
        .args(flags)
        .arg("-fsyntax-only")
        .arg("-I")
        .arg(&include)
        .arg(&path)
        .output()
        .unwrap_or_else(|error| panic!("{compiler} starts: {error}"));
    (output.status.success(), String::from_utf8_lossy(&output.stderr).into_owned())
}

const BOTH_HEADERS: &str = "#include \"memory_plugin.h\"\n#include \"memory_capi.h\"\nint main(void) { return 0; }\n";

/// The strictest modes a runtime builds in: C99 (which the headers' comments and
/// fixed-width integers promise) and C11 with prototypes required and undefined macros
/// in `#if` warned about, and C++11 and C++17; every warning an error.
#[test]
fn headers_compile_as_strict_c99_c11_cpp11_and_cpp17() {
    let c = ["-Wall", "-Wextra", "-Werror", "-pedantic", "-Wstrict-prototypes", "-Wundef", "-Wmissing-prototypes"];
    let cpp =
        ["-Wall", "-Wextra", "-Werror", "-pedantic", "-Wundef", "-Wold-style-cast", "-Wzero-as-null-pointer-constant"];
    for (extension, standard, warnings) in [
        ("c", "-std=c99", &c[..]),
        ("c", "-std=c11", &c[..]),
        ("cpp", "-std=c++11", &cpp[..]),
        ("cpp", "-std=c++17", &cpp[..]),
    ] {
        let flags: Vec<&str> = std::iter::once(standard).chain(warnings.iter().copied()).collect();
        let (compiled, said) = syntax_check(extension, BOTH_HEADERS, &flags);
        assert!(compiled, "the headers do not compile with {flags:?}:\n{said}");
    }
}

/// The headers' layouts are the library's on 64-bit targets only (docs/C-ABI.md): a
/// 32-bit build (here gcc's `-m32`, freestanding so that no 32-bit C library is needed)
/// stops at the header with a message saying so, instead of compiling structs whose
/// pointers are 4 bytes (an `MpAllocator` of another size than the 184 bytes the library reads).
#[test]
fn a_32_bit_build_is_stopped_by_the_headers_with_a_message() {
    let probe = syntax_check("c", "int main(void) { return 0; }\n", &["-m32", "-ffreestanding", "-std=c99"]);
    if !probe.0 {
        eprintln!("skipped: this compiler cannot build for a 32-bit target (-m32): {}", probe.1.trim());
        return;
    }
    let (compiled, said) = syntax_check("c", BOTH_HEADERS, &["-m32", "-ffreestanding", "-std=c99", "-Wall", "-Wundef"]);
    assert!(!compiled, "the headers compiled for a 32-bit target, with layouts the library does not use");
    assert!(said.contains("defined for 64-bit targets only"), "{said}");
}
