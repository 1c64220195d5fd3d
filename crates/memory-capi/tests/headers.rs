//! The checked-in headers under `include/` are what cbindgen generates from the Rust
//! sources now. Regenerate with `MEMORY_BLESS_HEADERS=1 cargo test -p memory-capi --test headers`.

use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the workspace root exists")
}

fn generate(crate_dir: &Path) -> String {
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let bindings = cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .unwrap_or_else(|e| panic!("cbindgen failed for {}: {e}", crate_dir.display()));
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).expect("cbindgen writes UTF-8")
}

fn check(crate_name: &str, header: &str) {
    let root = workspace();
    let generated = generate(&root.join("crates").join(crate_name));
    let path = root.join("include").join(header);
    if std::env::var_os("MEMORY_BLESS_HEADERS").is_some() {
        std::fs::write(&path, &generated).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "include/{header} differs from what cbindgen generates from crates/{crate_name}; \
         regenerate it with `MEMORY_BLESS_HEADERS=1 cargo test -p memory-capi --test headers` and commit it"
    );
}

#[test]
fn plugin_header_matches_the_rust_abi() {
    check("memory-plugin-abi", "memory_plugin.h");
}

#[test]
fn capi_header_matches_the_rust_api() {
    check("memory-capi", "memory_capi.h");
}
