//! Architecture tidy: the layering rules of the workspace (written down in
//! docs/ARCHITECTURE.md as "Architecture Invariant:" lines), checked as ordinary tests
//! against `cargo metadata --format-version 1 --no-deps` and the manifests' text.
//!
//! Each invariant is one [`Rule`] and one `#[test]`; a violation fails with a message
//! that names the offending edge (`memory-binding -> allocator-cpu (normal)`) and the
//! invariant it breaks. The `synthetic_*` tests feed hand-written metadata with bad edges
//! through the same checking functions, so a rule that stopped catching anything fails.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::{Value, json};

/// Crates that may contain `unsafe` code; every other library must `#![forbid(unsafe_code)]`.
const UNSAFE_ALLOWED: [&str; 7] =
    ["allocator-cpu", "allocator-cuda", "memory-binding", "memory-ort", "memory-plugin", "memory-capi", "memory-node"];

/// Tooling crates outside the layering (binaries and benches), exempt from the unsafe check.
const TOOLING: [&str; 3] = ["xtask", "memory-demo", "memory-benches"];

/// Crates the rules name; a rename must update the rules, not silently disable them.
const NAMED_CRATES: [&str; 13] = [
    "memory-api",
    "memory-sync",
    "memory-binding",
    "memory-governor",
    "allocator-cpu",
    "allocator-cuda",
    "memory-testkit",
    "memory-ort",
    "memory-plugin-abi",
    "memory-plugin",
    "memory-capi",
    "memory-trace",
    "memory-node",
];

/// Adapter crates: they consume the core (the governor and the providers); nothing but
/// tooling depends on them. memory-trace (record, replay, report) is one: it wraps the
/// governed allocator and replays onto the host providers. memory-node (node books
/// shared by processes) is one: it drives each process's governor through its public API.
const ADAPTERS: [&str; 4] = ["memory-ort", "memory-capi", "memory-trace", "memory-node"];

/// The adapter-to-adapter edges allowed, each with its reason; every other edge into an
/// adapter from outside tooling is refused. memory-capi -> memory-trace: the C API
/// exposes recording (`mc_recorder_*`), so the C adapter composes the recording adapter
/// exactly as a Rust runtime does (memory-trace depends on no adapter, so no cycle).
const ADAPTER_EDGES: [(&str, &str, &str); 1] = [(
    "memory-capi",
    "memory-trace",
    "the C API exposes recording (mc_recorder_*), so the C adapter composes the recording adapter",
)];

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum DepKind {
    Normal,
    Dev,
    Build,
}

impl DepKind {
    fn name(self) -> &'static str {
        match self {
            DepKind::Normal => "normal",
            DepKind::Dev => "dev",
            DepKind::Build => "build",
        }
    }
}

/// One dependency edge of a workspace member.
#[derive(Clone, Debug)]
struct Edge {
    from: String,
    to: String,
    kind: DepKind,
    /// `to` is a member of this workspace.
    internal: bool,
}

/// What the checks need to know about one workspace member.
#[derive(Clone, Debug)]
struct Package {
    name: String,
    manifest_path: PathBuf,
    /// The crate root of its library target, if it has one.
    lib_root: Option<PathBuf>,
    edges: Vec<Edge>,
}

/// One architecture invariant over dependency edges.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Rule {
    MemoryApiIsALeaf,
    SyncIsALeaf,
    AllocatorsDependOnMemoryApiAndSync,
    BindingKnowsNoConcreteAllocator,
    GovernorNamesNoCuda,
    OnlyAllocatorCudaNamesCudarc,
    OnlyMemoryOrtNamesOrt,
    AdaptersSitOnTheCore,
    OnlyToolingDependsOnAdapters,
    PluginAbiStandsAlone,
    PluginIsAProvider,
    CapiComposesThroughTheGovernor,
    TraceSitsOnTheCore,
    NodeSitsOnTheGovernor,
}

impl Rule {
    const ALL: [Rule; 14] = [
        Rule::MemoryApiIsALeaf,
        Rule::SyncIsALeaf,
        Rule::AllocatorsDependOnMemoryApiAndSync,
        Rule::BindingKnowsNoConcreteAllocator,
        Rule::GovernorNamesNoCuda,
        Rule::OnlyAllocatorCudaNamesCudarc,
        Rule::OnlyMemoryOrtNamesOrt,
        Rule::AdaptersSitOnTheCore,
        Rule::OnlyToolingDependsOnAdapters,
        Rule::PluginAbiStandsAlone,
        Rule::PluginIsAProvider,
        Rule::CapiComposesThroughTheGovernor,
        Rule::TraceSitsOnTheCore,
        Rule::NodeSitsOnTheGovernor,
    ];

    /// The invariant, as docs/ARCHITECTURE.md states it.
    fn invariant(self) -> &'static str {
        match self {
            Rule::MemoryApiIsALeaf => {
                "memory-api depends on no other crate of the workspace and on nothing GPU-related"
            }
            Rule::SyncIsALeaf => {
                "memory-sync depends on no other crate of the workspace (with any kind of dependency) and on \
                 nothing GPU-related"
            }
            Rule::AllocatorsDependOnMemoryApiAndSync => {
                "allocator-cpu and allocator-cuda depend on memory-api and memory-sync only (dev-dependencies may add \
                 memory-testkit)"
            }
            Rule::BindingKnowsNoConcreteAllocator => {
                "memory-binding knows no concrete allocator and sits below the governor \
                 (no normal dependency on memory-governor, allocator-cpu, allocator-cuda or cudarc)"
            }
            Rule::GovernorNamesNoCuda => "memory-governor has no normal dependency on allocator-cuda or cudarc",
            Rule::OnlyAllocatorCudaNamesCudarc => "only allocator-cuda depends on cudarc",
            Rule::OnlyMemoryOrtNamesOrt => "only memory-ort depends on ort (or ort-sys)",
            Rule::AdaptersSitOnTheCore => {
                "memory-ort depends (normally) on memory-governor and the allocator crates only, of the workspace"
            }
            Rule::OnlyToolingDependsOnAdapters => {
                "no crate depends on an adapter (memory-ort, memory-capi, memory-trace, memory-node) but tooling \
                 (memory-demo, memory-benches, xtask), and of the adapters only memory-capi on memory-trace (the C \
                 API exposes recording, so the C adapter composes the recording adapter)"
            }
            Rule::PluginAbiStandsAlone => "memory-plugin-abi has no normal or build dependency at all",
            Rule::PluginIsAProvider => {
                "memory-plugin depends on memory-api, memory-plugin-abi and memory-sync only, never on the registry \
                 or the governor (its tests may add memory-testkit and memory-binding)"
            }
            Rule::CapiComposesThroughTheGovernor => {
                "memory-capi reaches the core through memory-governor's facade: of the workspace it depends on \
                 memory-governor, allocator-cpu, allocator-cuda, memory-plugin, memory-plugin-abi, memory-sync and \
                 memory-trace (the recorder, which wraps the governed allocator) only"
            }
            Rule::TraceSitsOnTheCore => {
                "memory-trace depends (normally) on memory-governor, memory-sync and allocator-cpu only, of the \
                 workspace (it records through the governor and replays onto the host providers)"
            }
            Rule::NodeSitsOnTheGovernor => {
                "memory-node depends (normally) on memory-governor and memory-sync only, of the workspace (it \
                 drives each process's governor through its public API; its tests may add allocator-cpu)"
            }
        }
    }

    /// Whether `edge` breaks this rule.
    fn forbids(self, edge: &Edge) -> bool {
        let to = edge.to.as_str();
        let shipped = edge.kind != DepKind::Dev;
        match self {
            Rule::MemoryApiIsALeaf => edge.from == "memory-api" && (edge.internal || is_gpu_related(to)),
            Rule::SyncIsALeaf => edge.from == "memory-sync" && (edge.internal || is_gpu_related(to)),
            Rule::AllocatorsDependOnMemoryApiAndSync => {
                matches!(edge.from.as_str(), "allocator-cpu" | "allocator-cuda")
                    && edge.internal
                    && !matches!(to, "memory-api" | "memory-sync")
                    && !(edge.kind == DepKind::Dev && to == "memory-testkit")
            }
            Rule::BindingKnowsNoConcreteAllocator => {
                edge.from == "memory-binding"
                    && shipped
                    && matches!(to, "memory-governor" | "allocator-cpu" | "allocator-cuda" | "cudarc")
            }
            Rule::GovernorNamesNoCuda => {
                edge.from == "memory-governor" && shipped && matches!(to, "allocator-cuda" | "cudarc")
            }
            Rule::OnlyAllocatorCudaNamesCudarc => to == "cudarc" && edge.from != "allocator-cuda",
            Rule::OnlyMemoryOrtNamesOrt => matches!(to, "ort" | "ort-sys") && edge.from != "memory-ort",
            Rule::AdaptersSitOnTheCore => {
                edge.from == "memory-ort"
                    && edge.kind == DepKind::Normal
                    && edge.internal
                    && !matches!(to, "memory-governor" | "allocator-cpu" | "allocator-cuda")
            }
            Rule::OnlyToolingDependsOnAdapters => {
                ADAPTERS.contains(&to)
                    && !TOOLING.contains(&edge.from.as_str())
                    && !ADAPTER_EDGES.iter().any(|&(from, allowed, _reason)| edge.from == from && to == allowed)
            }
            Rule::PluginAbiStandsAlone => edge.from == "memory-plugin-abi" && shipped,
            Rule::PluginIsAProvider => {
                edge.from == "memory-plugin"
                    && edge.internal
                    && !matches!(to, "memory-api" | "memory-plugin-abi" | "memory-sync")
                    && !(edge.kind == DepKind::Dev && matches!(to, "memory-testkit" | "memory-binding"))
            }
            Rule::CapiComposesThroughTheGovernor => {
                edge.from == "memory-capi"
                    && edge.internal
                    && shipped
                    && !matches!(
                        to,
                        "memory-governor"
                            | "allocator-cpu"
                            | "allocator-cuda"
                            | "memory-plugin"
                            | "memory-plugin-abi"
                            | "memory-sync"
                            | "memory-trace"
                    )
            }
            Rule::TraceSitsOnTheCore => {
                edge.from == "memory-trace"
                    && edge.internal
                    && shipped
                    && !matches!(to, "memory-governor" | "memory-sync" | "allocator-cpu")
            }
            Rule::NodeSitsOnTheGovernor => {
                edge.from == "memory-node"
                    && edge.internal
                    && !matches!(to, "memory-governor" | "memory-sync")
                    && !(edge.kind == DepKind::Dev && to == "allocator-cpu")
            }
        }
    }
}

/// Crates that bind to a GPU runtime (memory-api must name none of them).
fn is_gpu_related(name: &str) -> bool {
    name == "cudarc" || name.contains("cuda")
}

/// Every edge that breaks `rule`, as `from -> to (kind): invariant`.
fn violations(packages: &[Package], rule: Rule) -> Vec<String> {
    packages
        .iter()
        .flat_map(|package| &package.edges)
        .filter(|edge| rule.forbids(edge))
        .map(|edge| {
            format!("{} -> {} ({} dependency) breaks: {}", edge.from, edge.to, edge.kind.name(), rule.invariant())
        })
        .collect()
}

/// Reads the members and their edges out of `cargo metadata --no-deps` JSON.
fn packages_from_metadata(metadata: &Value) -> Result<Vec<Package>, String> {
    let raw = metadata["packages"].as_array().ok_or("metadata has no `packages` array")?;
    let members: BTreeSet<&str> = raw.iter().filter_map(|package| package["name"].as_str()).collect();
    let mut packages = Vec::new();
    for package in raw {
        let name = package["name"].as_str().ok_or("a package has no name")?.to_owned();
        let manifest_path = PathBuf::from(
            package["manifest_path"].as_str().ok_or_else(|| format!("package {name} has no manifest_path"))?,
        );
        let lib_root = package["targets"].as_array().into_iter().flatten().find_map(|target| {
            let kinds = target["kind"].as_array()?;
            let is_lib = kinds.iter().any(|kind| matches!(kind.as_str(), Some("lib" | "rlib" | "proc-macro")));
            is_lib.then(|| PathBuf::from(target["src_path"].as_str().unwrap_or_default()))
        });
        let mut edges = Vec::new();
        for dep in package["dependencies"].as_array().ok_or_else(|| format!("package {name} has no dependencies"))? {
            let to = dep["name"].as_str().ok_or_else(|| format!("a dependency of {name} has no name"))?;
            let kind = match dep["kind"].as_str() {
                None => DepKind::Normal,
                Some("dev") => DepKind::Dev,
                Some("build") => DepKind::Build,
                Some(other) => return Err(format!("dependency {name} -> {to} has unknown kind {other}")),
            };
            edges.push(Edge { from: name.clone(), to: to.to_owned(), kind, internal: members.contains(to) });
        }
        packages.push(Package { name, manifest_path, lib_root, edges });
    }
    Ok(packages)
}

/// Whether a manifest opts into the workspace lints (`[lints]` + `workspace = true`, or
/// the dotted forms).
fn inherits_workspace_lints(manifest: &str) -> bool {
    let mut section = String::new();
    for line in manifest.lines() {
        let line = line.split('#').next().unwrap_or_default();
        let compact: String = line.chars().filter(|c| !c.is_whitespace()).collect();
        if compact.starts_with('[') {
            section = compact;
            continue;
        }
        let inherits = match section.as_str() {
            "[lints]" => compact == "workspace=true",
            "" => compact == "lints.workspace=true" || compact == "lints={workspace=true}",
            _ => false,
        };
        if inherits {
            return true;
        }
    }
    false
}

/// Whether a crate root carries `#![forbid(unsafe_code)]` outside comments.
fn forbids_unsafe(source: &str) -> bool {
    source.lines().map(str::trim).any(|line| line.starts_with("#![forbid(") && line.contains("unsafe_code"))
}

/// Members that do not inherit the workspace lints.
fn lint_violations(packages: &[Package], read: &dyn Fn(&Path) -> Result<String, String>) -> Vec<String> {
    packages
        .iter()
        .filter_map(|package| match read(&package.manifest_path) {
            Ok(text) if inherits_workspace_lints(&text) => None,
            Ok(_) => Some(format!(
                "{} ({}) lacks `[lints] workspace = true`; every member inherits the workspace lints",
                package.name,
                package.manifest_path.display()
            )),
            Err(err) => Some(err),
        })
        .collect()
}

/// Libraries outside [`UNSAFE_ALLOWED`] and [`TOOLING`] whose root lacks `#![forbid(unsafe_code)]`.
fn unsafe_violations(packages: &[Package], read: &dyn Fn(&Path) -> Result<String, String>) -> Vec<String> {
    packages
        .iter()
        .filter(|package| !UNSAFE_ALLOWED.contains(&package.name.as_str()) && !TOOLING.contains(&package.name.as_str()))
        .filter_map(|package| {
            let root = package.lib_root.as_ref()?;
            match read(root) {
                Ok(text) if forbids_unsafe(&text) => None,
                Ok(_) => Some(format!(
                    "{} ({}) lacks #![forbid(unsafe_code)]; only {} may use unsafe (extend UNSAFE_ALLOWED in \
                     xtask/tests/tidy.rs and docs/ARCHITECTURE.md together if a crate really needs it)",
                    package.name,
                    root.display(),
                    UNSAFE_ALLOWED.join(", ")
                )),
                Err(err) => Some(err),
            }
        })
        .collect()
}

fn read_file(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|err| format!("cannot read {}: {err}", path.display()))
}

/// The real workspace's members, read once per test binary.
fn workspace() -> &'static [Package] {
    static PACKAGES: OnceLock<Vec<Package>> = OnceLock::new();
    PACKAGES.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives inside the workspace");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let output = Command::new(cargo)
            .args(["metadata", "--format-version", "1", "--no-deps"])
            .current_dir(root)
            .output()
            .expect("cargo metadata starts");
        assert!(output.status.success(), "cargo metadata failed: {}", String::from_utf8_lossy(&output.stderr));
        let metadata: Value = serde_json::from_slice(&output.stdout).expect("cargo metadata prints JSON");
        packages_from_metadata(&metadata).expect("cargo metadata has the documented shape")
    })
}

fn assert_clean(rule: Rule) {
    let found = violations(workspace(), rule);
    assert!(found.is_empty(), "architecture invariant broken:\n  {}", found.join("\n  "));
}

#[test]
fn memory_api_depends_on_nothing_of_the_workspace_or_gpu() {
    assert_clean(Rule::MemoryApiIsALeaf);
}

#[test]
fn memory_sync_depends_on_nothing_of_the_workspace_or_gpu() {
    assert_clean(Rule::SyncIsALeaf);
}

#[test]
fn allocators_depend_on_memory_api_and_sync_only() {
    assert_clean(Rule::AllocatorsDependOnMemoryApiAndSync);
}

#[test]
fn memory_binding_knows_no_concrete_allocator() {
    assert_clean(Rule::BindingKnowsNoConcreteAllocator);
}

#[test]
fn memory_governor_names_no_cuda() {
    assert_clean(Rule::GovernorNamesNoCuda);
}

#[test]
fn only_allocator_cuda_names_cudarc() {
    assert_clean(Rule::OnlyAllocatorCudaNamesCudarc);
}

#[test]
fn only_memory_ort_names_ort() {
    assert_clean(Rule::OnlyMemoryOrtNamesOrt);
}

#[test]
fn adapters_sit_on_the_core_and_only_tooling_depends_on_them() {
    assert_clean(Rule::AdaptersSitOnTheCore);
    assert_clean(Rule::OnlyToolingDependsOnAdapters);
}

#[test]
fn memory_plugin_abi_stands_alone() {
    assert_clean(Rule::PluginAbiStandsAlone);
}

#[test]
fn memory_plugin_is_a_provider() {
    assert_clean(Rule::PluginIsAProvider);
}

#[test]
fn memory_capi_composes_through_the_governor() {
    assert_clean(Rule::CapiComposesThroughTheGovernor);
}

#[test]
fn memory_trace_sits_on_the_core_and_only_tooling_depends_on_it() {
    assert_clean(Rule::TraceSitsOnTheCore);
    assert_clean(Rule::OnlyToolingDependsOnAdapters);
}

#[test]
fn memory_node_sits_on_the_governor_and_only_tooling_depends_on_it() {
    assert_clean(Rule::NodeSitsOnTheGovernor);
    assert_clean(Rule::OnlyToolingDependsOnAdapters);
}

#[test]
fn each_allowed_adapter_edge_exists_and_says_why() {
    // An allowance outliving its edge would quietly permit it again later.
    for (from, to, reason) in ADAPTER_EDGES {
        assert!(!reason.is_empty(), "{from} -> {to} is allowed without a reason");
        let found =
            workspace().iter().flat_map(|package| &package.edges).any(|edge| edge.from == from && edge.to == to);
        assert!(found, "tidy allows {from} -> {to} ({reason}), but no such edge exists; drop it from ADAPTER_EDGES");
    }
}

#[test]
fn every_member_inherits_workspace_lints() {
    let found = lint_violations(workspace(), &read_file);
    assert!(found.is_empty(), "workspace lints not inherited:\n  {}", found.join("\n  "));
}

#[test]
fn libraries_outside_the_unsafe_allow_list_forbid_unsafe() {
    let found = unsafe_violations(workspace(), &read_file);
    assert!(found.is_empty(), "unsafe code not forbidden:\n  {}", found.join("\n  "));
}

#[test]
fn the_rules_name_crates_that_exist() {
    let names: BTreeSet<&str> = workspace().iter().map(|package| package.name.as_str()).collect();
    for name in NAMED_CRATES.iter().chain(&UNSAFE_ALLOWED).chain(&["xtask"]) {
        assert!(names.contains(name), "tidy rules name `{name}`, which is not a workspace member; update the rules");
    }
}

// ---------------------------------------------------------------------------------
// The checking functions against synthetic metadata: a deliberate violation fails.

/// A synthetic dependency: name and `kind` as cargo metadata writes it (`None` = normal).
type Dep = (&'static str, Option<&'static str>);

fn synthetic_package(name: &str, deps: &[Dep]) -> Value {
    json!({
        "name": name,
        "manifest_path": format!("/ws/{name}/Cargo.toml"),
        "targets": [{ "kind": ["lib"], "src_path": format!("/ws/{name}/src/lib.rs") }],
        "dependencies": deps.iter().map(|(to, kind)| json!({ "name": to, "kind": kind })).collect::<Vec<_>>(),
    })
}

/// A workspace laid out as docs/ARCHITECTURE.md says, plus `extra` edges of `from`.
fn synthetic(extra_from: &str, extra: &[Dep]) -> Vec<Package> {
    let mut layout: Vec<(&str, Vec<Dep>)> = vec![
        ("memory-api", vec![("thiserror", None)]),
        ("memory-sync", vec![("crossbeam-utils", None), ("rustix", None), ("loom", None)]),
        (
            "memory-binding",
            vec![("memory-api", None), ("memory-sync", None), ("dashmap", None), ("memory-testkit", Some("dev"))],
        ),
        (
            "memory-governor",
            vec![("memory-api", None), ("memory-binding", None), ("memory-sync", None), ("allocator-cpu", Some("dev"))],
        ),
        ("allocator-cpu", vec![("memory-api", None), ("memory-testkit", Some("dev"))]),
        ("allocator-cuda", vec![("memory-api", None), ("cudarc", None), ("memory-testkit", Some("dev"))]),
        ("memory-testkit", vec![("memory-api", None)]),
        (
            "memory-ort",
            vec![("memory-governor", None), ("allocator-cuda", None), ("ort", None), ("allocator-cpu", Some("dev"))],
        ),
        ("memory-demo", vec![("memory-governor", None), ("allocator-cpu", None), ("memory-ort", None)]),
        ("memory-plugin-abi", vec![]),
        (
            "memory-plugin",
            vec![
                ("memory-api", None),
                ("memory-plugin-abi", None),
                ("memory-sync", None),
                ("libloading", None),
                ("memory-binding", Some("dev")),
                ("memory-testkit", Some("dev")),
            ],
        ),
        (
            "memory-capi",
            vec![
                ("memory-governor", None),
                ("allocator-cpu", None),
                ("allocator-cuda", None),
                ("memory-plugin", None),
                ("memory-plugin-abi", None),
                ("memory-sync", None),
                ("memory-trace", None),
                ("cbindgen", Some("dev")),
            ],
        ),
        (
            "memory-trace",
            vec![
                ("memory-governor", None),
                ("memory-sync", None),
                ("allocator-cpu", None),
                ("serde_json", None),
                ("memory-testkit", Some("dev")),
            ],
        ),
        (
            "memory-node",
            vec![("memory-governor", None), ("memory-sync", None), ("rustix", None), ("allocator-cpu", Some("dev"))],
        ),
        (
            "memory-benches",
            vec![("memory-capi", Some("dev")), ("memory-plugin", Some("dev")), ("memory-trace", Some("dev"))],
        ),
    ];
    for (name, deps) in &mut layout {
        if *name == extra_from {
            deps.extend_from_slice(extra);
        }
    }
    let metadata = json!({
        "packages": layout.iter().map(|(name, deps)| synthetic_package(name, deps)).collect::<Vec<_>>(),
    });
    packages_from_metadata(&metadata).unwrap()
}

fn all_violations(packages: &[Package]) -> Vec<String> {
    Rule::ALL.iter().flat_map(|&rule| violations(packages, rule)).collect()
}

#[test]
fn synthetic_design_layout_is_clean() {
    assert_eq!(all_violations(&synthetic("", &[])), Vec::<String>::new());
}

#[test]
fn synthetic_bad_edges_are_reported_by_name() {
    let cases: [(&str, Dep, Rule, &str); 17] = [
        ("memory-sync", ("memory-api", None), Rule::SyncIsALeaf, "memory-sync -> memory-api (normal"),
        ("memory-sync", ("cudarc", Some("dev")), Rule::SyncIsALeaf, "memory-sync -> cudarc (dev"),
        ("memory-plugin-abi", ("libc", None), Rule::PluginAbiStandsAlone, "memory-plugin-abi -> libc (normal"),
        ("memory-plugin", ("memory-binding", None), Rule::PluginIsAProvider, "memory-plugin -> memory-binding (normal"),
        (
            "memory-plugin",
            ("memory-governor", Some("dev")),
            Rule::PluginIsAProvider,
            "memory-plugin -> memory-governor (dev",
        ),
        (
            "memory-capi",
            ("memory-binding", None),
            Rule::CapiComposesThroughTheGovernor,
            "memory-capi -> memory-binding",
        ),
        (
            "memory-governor",
            ("memory-capi", None),
            Rule::OnlyToolingDependsOnAdapters,
            "memory-governor -> memory-capi",
        ),
        (
            "memory-plugin",
            ("memory-capi", Some("build")),
            Rule::OnlyToolingDependsOnAdapters,
            "memory-plugin -> memory-capi (build",
        ),
        ("memory-api", ("memory-binding", None), Rule::MemoryApiIsALeaf, "memory-api -> memory-binding (normal"),
        ("memory-api", ("memory-testkit", Some("dev")), Rule::MemoryApiIsALeaf, "memory-api -> memory-testkit (dev"),
        (
            "allocator-cpu",
            ("memory-binding", None),
            Rule::AllocatorsDependOnMemoryApiAndSync,
            "allocator-cpu -> memory-binding",
        ),
        (
            "allocator-cuda",
            ("memory-governor", Some("dev")),
            Rule::AllocatorsDependOnMemoryApiAndSync,
            "allocator-cuda -> memory-governor (dev",
        ),
        (
            "allocator-cpu",
            ("memory-testkit", None),
            Rule::AllocatorsDependOnMemoryApiAndSync,
            "allocator-cpu -> memory-testkit (normal",
        ),
        (
            "memory-binding",
            ("allocator-cpu", None),
            Rule::BindingKnowsNoConcreteAllocator,
            "memory-binding -> allocator-cpu",
        ),
        (
            "memory-binding",
            ("memory-governor", Some("build")),
            Rule::BindingKnowsNoConcreteAllocator,
            "(build dependency)",
        ),
        ("memory-governor", ("allocator-cuda", None), Rule::GovernorNamesNoCuda, "memory-governor -> allocator-cuda"),
        (
            "memory-testkit",
            ("cudarc", Some("dev")),
            Rule::OnlyAllocatorCudaNamesCudarc,
            "memory-testkit -> cudarc (dev",
        ),
    ];
    for (from, edge, rule, expected) in cases {
        let packages = synthetic(from, &[edge]);
        let found = violations(&packages, rule);
        assert_eq!(found.len(), 1, "{from} -> {edge:?} should break {rule:?} once, found {found:?}");
        assert!(found[0].contains(expected), "{:?} does not name {expected:?}", found[0]);
        assert!(found[0].contains(rule.invariant()), "{:?} does not state the invariant", found[0]);
    }
}

#[test]
fn synthetic_adapter_edges_are_reported_by_name() {
    let cases: [(&str, Dep, Rule, &str); 14] = [
        ("memory-governor", ("ort", None), Rule::OnlyMemoryOrtNamesOrt, "memory-governor -> ort (normal"),
        // Adapter to adapter: only memory-capi -> memory-trace is allowed (ADAPTER_EDGES).
        (
            "memory-ort",
            ("memory-trace", None),
            Rule::OnlyToolingDependsOnAdapters,
            "memory-ort -> memory-trace (normal",
        ),
        (
            "memory-node",
            ("memory-capi", None),
            Rule::OnlyToolingDependsOnAdapters,
            "memory-node -> memory-capi (normal",
        ),
        (
            "memory-trace",
            ("memory-capi", Some("dev")),
            Rule::OnlyToolingDependsOnAdapters,
            "memory-trace -> memory-capi (dev",
        ),
        (
            "memory-capi",
            ("memory-node", None),
            Rule::OnlyToolingDependsOnAdapters,
            "memory-capi -> memory-node (normal",
        ),
        ("memory-trace", ("memory-capi", None), Rule::TraceSitsOnTheCore, "memory-trace -> memory-capi (normal"),
        ("memory-node", ("memory-binding", None), Rule::NodeSitsOnTheGovernor, "memory-node -> memory-binding (normal"),
        (
            "memory-binding",
            ("memory-node", Some("dev")),
            Rule::OnlyToolingDependsOnAdapters,
            "memory-binding -> memory-node",
        ),
        ("memory-trace", ("allocator-cuda", None), Rule::TraceSitsOnTheCore, "memory-trace -> allocator-cuda (normal"),
        ("memory-trace", ("memory-ort", None), Rule::TraceSitsOnTheCore, "memory-trace -> memory-ort (normal"),
        (
            "memory-governor",
            ("memory-trace", Some("dev")),
            Rule::OnlyToolingDependsOnAdapters,
            "memory-governor -> memory-trace (dev",
        ),
        ("memory-demo", ("ort-sys", None), Rule::OnlyMemoryOrtNamesOrt, "memory-demo -> ort-sys"),
        ("memory-ort", ("memory-testkit", None), Rule::AdaptersSitOnTheCore, "memory-ort -> memory-testkit (normal"),
        (
            "memory-governor",
            ("memory-ort", Some("dev")),
            Rule::OnlyToolingDependsOnAdapters,
            "memory-governor -> memory-ort (dev",
        ),
    ];
    for (from, edge, rule, expected) in cases {
        let found = violations(&synthetic(from, &[edge]), rule);
        assert_eq!(found.len(), 1, "{from} -> {edge:?} should break {rule:?} once, found {found:?}");
        assert!(found[0].contains(expected), "{:?} does not name {expected:?}", found[0]);
    }
}

#[test]
fn synthetic_allowed_dev_edges_pass() {
    // Tests may use a real allocator below the registry or governor.
    assert!(all_violations(&synthetic("memory-binding", &[("allocator-cpu", Some("dev"))])).is_empty());
    assert!(all_violations(&synthetic("memory-governor", &[("allocator-cpu", Some("dev"))])).is_empty());
}

#[test]
fn synthetic_cudarc_outside_allocator_cuda_breaks_two_rules_for_memory_api() {
    let packages = synthetic("memory-api", &[("cudarc", None)]);
    assert_eq!(violations(&packages, Rule::MemoryApiIsALeaf).len(), 1);
    assert_eq!(violations(&packages, Rule::OnlyAllocatorCudaNamesCudarc).len(), 1);
}

#[test]
fn lints_table_is_recognised_in_its_usual_forms() {
    assert!(inherits_workspace_lints("[package]\nname = \"a\"\n\n[lints]\nworkspace = true\n"));
    assert!(inherits_workspace_lints("[lints]\nworkspace=true # inherit\n"));
    assert!(inherits_workspace_lints("lints.workspace = true\n[package]\nname = \"a\"\n"));
    assert!(!inherits_workspace_lints("[package]\nname = \"a\"\n"));
    assert!(!inherits_workspace_lints("[lints]\n# workspace = true\n"));
    assert!(!inherits_workspace_lints("[lints.rust]\nworkspace = true\n"));
    assert!(!inherits_workspace_lints("[dependencies]\nworkspace = true\n"));
}

#[test]
fn synthetic_member_without_workspace_lints_is_reported() {
    let packages = synthetic("", &[]);
    let read = |path: &Path| -> Result<String, String> {
        Ok(if path.starts_with("/ws/memory-testkit") {
            "[package]\nname = \"memory-testkit\"\n"
        } else {
            "[lints]\nworkspace = true\n"
        }
        .to_owned())
    };
    let found = lint_violations(&packages, &read);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("memory-testkit "), "{found:?}");
}

#[test]
fn synthetic_library_without_forbid_unsafe_is_reported_unless_allowed() {
    let packages = synthetic("", &[]);
    let read = |_: &Path| -> Result<String, String> {
        Ok("//! A crate.\n// #![forbid(unsafe_code)]\npub mod a;\n".to_owned())
    };
    let found = unsafe_violations(&packages, &read);
    let named: Vec<&str> = found.iter().map(|line| line.split(' ').next().unwrap()).collect();
    // memory-binding, allocator-*, memory-plugin and memory-capi may use unsafe;
    // memory-demo and memory-benches are tooling.
    assert_eq!(
        named,
        ["memory-api", "memory-sync", "memory-governor", "memory-testkit", "memory-plugin-abi", "memory-trace"],
        "{found:?}"
    );
    let read = |_: &Path| -> Result<String, String> { Ok("//! A crate.\n#![forbid(unsafe_code)]\n".to_owned()) };
    assert!(unsafe_violations(&packages, &read).is_empty());
}
