//! Hands the target triple to `native`, which drives the `cc` crate at test time.
fn main() {
    let target = std::env::var("TARGET").unwrap_or_default();
    println!("cargo:rustc-env=MEMORY_TESTKIT_TARGET={target}");
    println!("cargo:rerun-if-changed=build.rs");
}
