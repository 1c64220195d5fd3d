//! The example plugin (`tests/c/example_plugin.c`, built at test time with the `cc`
//! crate) loaded through the real loader: negotiation, every capability, the unload
//! protocol, dishonest answers, and the conformance suite.
//!
//! Each test loads its own copy of the library (its own path and inode), so the
//! dynamic loader maps it separately and `is_mapped` can tell when it is unloaded.
//!
//! Unix only: the example plugin is a shared object built by the host C compiler, and
//! `is_mapped` asks the dynamic loader with `RTLD_NOLOAD`.
#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use memory_api::ReleaseSummary;
use memory_api::{
    AllocationRequest, ByteRange, CapabilityError, DeviceAddress, DeviceAllocator, DeviceKey, MappingAccess,
    RawAllocation, ReleaseError, ReleaseOutcome, SharedPlacement,
};
use memory_binding::{AllocateError, AllocationState, BindingRegistry, HandleError, MemoryBinding};
use memory_plugin::{InstanceOptions, PluginAllocator, PluginError, PluginLibrary};
use memory_plugin_abi::{
    MP_ALLOCATOR_SIZE_V1_0, MP_ALLOCATOR_SIZE_V1_1, MP_CAP_ALL, MP_CAP_DEFERRED_RELEASE, MP_CAP_STRUCTURED_RELEASE,
    MP_CAP_VIRTUAL_BACKING, MP_ERR_VERSION_MISMATCH,
};
use memory_testkit::native::{Language, NativeBuild};

fn built_plugin() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| build_plugin(&[], "libexample_plugin.so"))
}

/// The example plugin built without `mp_plugin_tally`: only the host's tally can
/// refuse its unload.
fn built_plugin_without_tally() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| build_plugin(&["-DEXAMPLE_NO_TALLY"], "libexample_plugin_no_tally.so"))
}

fn build_plugin(args: &[&str], name: &str) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let build = NativeBuild::new(Language::C("c11"))
        .source(manifest.join("tests/c/example_plugin.c"))
        .include(manifest.join("../../include"))
        .arg("-lpthread");
    let build = args.iter().fold(build, |build, arg| build.arg(*arg));
    build.shared_library(&PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("plugin"), name)
}

/// A private copy of a plugin build for one test.
fn plugin_copy(test: &str, built: &Path) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("plugin-copies");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("lib{test}-{}.so", std::process::id()));
    let _ = std::fs::remove_file(&path);
    std::fs::copy(built, &path).unwrap();
    path
}

fn load(test: &str) -> (PluginLibrary, PathBuf) {
    load_built(test, built_plugin())
}

fn load_built(test: &str, built: &Path) -> (PluginLibrary, PathBuf) {
    let path = plugin_copy(test, built);
    // SAFETY: the example plugin is built from this crate's own C source.
    let library = unsafe { PluginLibrary::load(&path) }.expect("the example plugin loads");
    (library, path)
}

fn instance(library: &PluginLibrary, config: &str) -> Result<PluginAllocator, PluginError> {
    library.instantiate(&InstanceOptions::new().config(config))
}

/// Whether the dynamic loader has `path` mapped (asks without loading it).
fn is_mapped(path: &Path) -> bool {
    // SAFETY: RTLD_NOLOAD maps nothing and runs no initialiser; an existing mapping is
    // only referenced once more, and closed again at once.
    unsafe { libloading::os::unix::Library::open(Some(path), libc_flags()) }.is_ok()
}

fn libc_flags() -> i32 {
    // The values differ between Linux and macOS: take them from libc.
    libc::RTLD_LAZY | libc::RTLD_NOLOAD
}

fn request(bytes: usize) -> AllocationRequest {
    AllocationRequest::new(bytes, 64).unwrap()
}

/// A registry with `allocator` registered on its device; returns a binding to it.
fn registered(allocator: &PluginAllocator) -> (BindingRegistry, MemoryBinding) {
    let registry = BindingRegistry::new();
    let device = allocator.device();
    let context = registry.register_provider_context(device, Arc::new("plugin context")).unwrap();
    let authority = registry.register_authority(device, Arc::new("tenant")).unwrap();
    let mechanism = registry.register_allocator(&context, &authority, Arc::new(allocator.clone())).unwrap();
    let binding = registry.bind_registered(&mechanism).unwrap();
    (registry, binding)
}

// ---------------------------------------------------------------------------------
// Negotiation

#[test]
fn current_table_negotiates_the_hosts_minor_with_every_offered_capability() {
    let (library, _) = load("current");
    let allocator = instance(&library, "").unwrap();
    assert_eq!(allocator.abi_minor(), 1);
    assert_eq!(allocator.capabilities(), MP_CAP_ALL);
    assert_eq!(allocator.device(), DeviceKey::HOST);
    assert_eq!(allocator.name(), "example-plugin");
    let block = allocator.allocate(&request(4096)).unwrap();
    assert!(allocator.release(block).is_complete());
}

#[test]
fn older_minor_table_is_read_to_its_prefix_and_newer_slots_are_unsupported() {
    // The plugin poisons every slot past its 64-byte table: reading one would crash.
    let (library, _) = load("older");
    let allocator = instance(&library, "minor=0 claim=0").unwrap();
    assert_eq!(allocator.abi_minor(), 0);
    let block = allocator.allocate(&request(100)).unwrap();
    assert!(allocator.release(block).is_complete());
    assert!(matches!(allocator.try_stats(), Err(PluginError::Unsupported { what: "stats", minor: 0, .. })));
    assert!(matches!(allocator.try_trim(), Err(PluginError::Unsupported { what: "trim", .. })));
    assert!(matches!(allocator.tally(), Err(PluginError::Unsupported { what: "tally", .. })));
    assert!(allocator.virtual_backing().is_none());
    assert!(matches!(allocator.release_queue(4), Err(PluginError::Unsupported { .. })));
    // A minor-0 table that claims capabilities whose slots are minor 1 is refused, and
    // the refusal says why: the slots lie past its end (the plugin wrote them: poison),
    // not "left null".
    let error = instance(&library, "minor=0").unwrap_err();
    assert!(
        matches!(error, PluginError::CapabilitiesNeedNewerMinor { claimed: 0x7, minor: 0, needed_minor: 1, .. }),
        "{error}"
    );
    let text = error.to_string();
    assert!(text.contains("in a minor-0 table") && text.contains("ends before the capability slots"), "{text}");
    assert!(text.contains("build the table as minor 1") && !text.contains("null"), "{text}");
    // A structured release needs no slot: a minor-0 table may claim it.
    let structured = instance(&library, "minor=0 claim=8").unwrap();
    assert_eq!(structured.capabilities(), MP_CAP_STRUCTURED_RELEASE);
    let block = structured.allocate(&request(100)).unwrap();
    assert!(structured.release(block).is_complete());
}

#[test]
fn newer_minor_table_negotiates_down_and_its_extra_fields_are_ignored() {
    let (library, _) = load("newer");
    let allocator = instance(&library, "minor=2").unwrap();
    assert_eq!(allocator.abi_minor(), 1);
    assert_eq!(allocator.capabilities(), MP_CAP_ALL);
    let block = allocator.allocate(&request(64)).unwrap();
    assert!(allocator.release(block).is_complete());
    assert_eq!(allocator.try_stats().unwrap().allocations_total, 1);
}

#[test]
fn wrong_major_is_refused_before_any_slot_is_called() {
    let (library, _) = load("major");
    let error = instance(&library, "major=2").unwrap_err();
    assert!(matches!(error, PluginError::WrongMajor { found_major: 2, expected_major: 1, .. }), "{error}");
    assert!(error.to_string().contains("rebuild the plugin"), "{error}");
}

#[test]
fn short_tables_are_refused_and_never_read_past() {
    let (library, _) = load("short");
    let error = instance(&library, "minor=1 size=100").unwrap_err();
    assert_eq!(
        error,
        PluginError::ShortTable {
            plugin: library.path().to_owned(),
            size: 100,
            needed: MP_ALLOCATOR_SIZE_V1_1,
            major: 1,
            minor: 1
        }
    );
    let error = instance(&library, "minor=0 size=40").unwrap_err();
    assert!(matches!(error, PluginError::ShortTable { needed, .. } if needed == MP_ALLOCATOR_SIZE_V1_0), "{error}");
    assert!(error.to_string().contains("nothing past its end was read"), "{error}");
}

#[test]
fn a_plugin_refusing_the_host_is_a_typed_error() {
    let (library, _) = load("refuse");
    let error = instance(&library, "refuse=1").unwrap_err();
    assert!(
        matches!(error, PluginError::EntryRefused { status, .. } if status.0 == MP_ERR_VERSION_MISMATCH),
        "{error}"
    );
    assert!(error.to_string().contains("MP_ERR_VERSION_MISMATCH"), "{error}");
}

#[test]
fn missing_required_slot_is_refused_and_the_instance_destroyed() {
    let (library, _) = load("required");
    let error = instance(&library, "null=allocate").unwrap_err();
    assert!(matches!(error, PluginError::MissingSlot { slot: "allocate", .. }), "{error}");
    // The host destroyed the instance it refused: the plugin holds nothing.
    assert_eq!(library.plugin_tally().unwrap().instances, 0);
    library.unload().unwrap();
}

#[test]
fn claiming_a_capability_the_host_did_not_offer_is_refused() {
    let (library, _) = load("unoffered");
    let options = InstanceOptions::new().config(format!("claim={MP_CAP_ALL}")).offer(MP_CAP_STRUCTURED_RELEASE);
    let error = library.instantiate(&options).unwrap_err();
    assert_eq!(
        error,
        PluginError::UnofferedCapability {
            plugin: "example-plugin".into(),
            claimed: MP_CAP_ALL & !MP_CAP_STRUCTURED_RELEASE,
            offered: MP_CAP_STRUCTURED_RELEASE
        }
    );
    // A bit no version defines is never offered either.
    let error = instance(&library, "claim=0x100").unwrap_err();
    assert!(matches!(error, PluginError::UnofferedCapability { claimed: 0x100, .. }), "{error}");
    // Offering less makes a well-behaved plugin claim less.
    let allocator = library.instantiate(&InstanceOptions::new().offer(MP_CAP_VIRTUAL_BACKING)).unwrap();
    assert_eq!(allocator.capabilities(), MP_CAP_VIRTUAL_BACKING);
    assert!(allocator.shared_mapping().is_none());
}

#[test]
fn unknown_device_tier_is_refused() {
    let (library, _) = load("tier");
    let error = instance(&library, "tier=7").unwrap_err();
    assert!(matches!(error, PluginError::InvalidDevice { tier: 7, .. }), "{error}");
}

// ---------------------------------------------------------------------------------
// Capabilities, through the registry

#[test]
fn virtual_backing_commits_and_decommits_through_a_binding() {
    let (library, _) = load("virtual");
    let allocator = instance(&library, "").unwrap();
    let (_registry, binding) = registered(&allocator);
    let backing = binding.virtual_backing().unwrap();
    assert_eq!(backing.granularity(), 4096);
    let block = binding.allocate(AllocationRequest::new(64 << 10, 4096).unwrap()).unwrap();
    assert_eq!(backing.commit(&block, ByteRange::new(0, 16 << 10)).unwrap(), 16 << 10);
    assert_eq!(backing.commit(&block, ByteRange::new(8 << 10, 16 << 10)).unwrap(), 8 << 10);
    assert_eq!(backing.committed_bytes(&block).unwrap(), 24 << 10);
    assert_eq!(backing.decommit(&block, ByteRange::new(0, 8 << 10)).unwrap(), 8 << 10);
    // Checked on the host side, before the plugin is called.
    let misaligned = backing.commit(&block, ByteRange::new(100, 4096)).unwrap_err();
    assert!(misaligned.to_string().contains("granularity"), "{misaligned}");
    binding.release(block).unwrap();
}

#[test]
fn shared_mapping_maps_one_backing_into_two_blocks_and_refuses_foreign_backings() {
    let (library, _) = load("shared");
    let allocator = instance(&library, "").unwrap();
    let other = instance(&library, "name=other").unwrap();
    let (_registry, binding) = registered(&allocator);
    let mapping = binding.shared_mapping().unwrap();
    let prefix = mapping.create_backing(8192).unwrap();
    let a = binding.allocate(AllocationRequest::new(16384, 4096).unwrap()).unwrap();
    let b = binding.allocate(AllocationRequest::new(16384, 4096).unwrap()).unwrap();
    let placement = SharedPlacement { target: ByteRange::new(0, 8192), backing_offset: 0 };
    mapping.map(&prefix, &a, placement, MappingAccess::ReadOnly).unwrap();
    mapping.map(&prefix, &b, placement, MappingAccess::ReadOnly).unwrap();
    assert!(mapping.map(&prefix, &a, placement, MappingAccess::ReadOnly).is_err(), "already mapped");
    assert_eq!(allocator.host_tally().backings, 1);
    assert_eq!(mapping.unmap(&a, ByteRange::new(0, 8192)).unwrap(), 8192);
    // A backing made by another instance is refused before any plugin call.
    let foreign = other.shared_mapping().unwrap().create_backing(4096).unwrap();
    let error = mapping
        .map(
            &foreign,
            &a,
            SharedPlacement { target: ByteRange::new(0, 4096), backing_offset: 0 },
            MappingAccess::ReadWrite,
        )
        .unwrap_err();
    assert!(error.to_string().contains("belongs to"), "{error}");
    binding.release(a).unwrap();
    binding.release(b).unwrap();
    drop((prefix, foreign));
    assert_eq!(allocator.host_tally().backings, 0);
    assert_eq!(library.plugin_tally().unwrap().backings, 0);
}

#[test]
fn deferred_release_runs_only_once_the_plugin_reports_it_ready() {
    let (library, _) = load("deferred");
    let allocator = instance(&library, "defer_polls=2").unwrap();
    let queue = allocator.release_queue(8).unwrap();
    let (registry, binding) = registered(&allocator);
    let block = binding.allocate(request(4096)).unwrap();
    let identity = block.identity().unwrap();
    binding.release_deferred(block, &queue).unwrap();
    assert_eq!(queue.len(), 1);
    assert_eq!(allocator.host_tally().queued_releases, 1);
    assert_eq!(library.plugin_tally().unwrap().deferred, 1);
    assert_eq!(queue.poll(), 0, "not ready after one poll");
    assert_eq!(library.plugin_tally().unwrap().allocations, 1);
    assert_eq!(queue.poll(), 1);
    assert_eq!(registry.allocation_state(&identity), AllocationState::Gone);
    assert_eq!(library.plugin_tally().unwrap().allocations, 0);
    assert_eq!(allocator.host_tally().queued_releases, 0);
}

#[test]
fn a_full_plugin_queue_hands_the_release_back() {
    let (library, _) = load("full");
    let allocator = instance(&library, "defer_polls=9").unwrap();
    let queue = allocator.release_queue(1).unwrap();
    let (_registry, binding) = registered(&allocator);
    binding.release_deferred(binding.allocate(request(64)).unwrap(), &queue).unwrap();
    let refused = binding.release_deferred(binding.allocate(request(64)).unwrap(), &queue).unwrap_err();
    assert!(matches!(refused.reason, HandleError::QueueRefused(_)), "{}", refused.reason);
    binding.release(refused.handle).unwrap();
}

#[test]
fn null_optional_slots_are_typed_unsupported_errors() {
    let (library, _) = load("optional");
    let allocator = instance(&library, "null=stats").unwrap();
    let error = allocator.try_stats().unwrap_err();
    assert!(matches!(error, PluginError::Unsupported { what: "stats", .. }), "{error}");
    assert!(error.to_string().contains("does not support stats"), "{error}");
    assert_eq!(allocator.stats(), None);
    let allocator = instance(&library, "null=trim").unwrap();
    assert!(matches!(allocator.try_trim(), Err(PluginError::Unsupported { what: "trim", .. })));
    // A claimed capability whose slot is null is refused at negotiation.
    let error = instance(&library, "null=commit").unwrap_err();
    assert!(matches!(error, PluginError::MissingSlot { slot: "commit", .. }), "{error}");
}

#[test]
fn capabilities_not_offered_are_unsupported_through_the_binding() {
    let (library, _) = load("unclaimed");
    let allocator = library.instantiate(&InstanceOptions::new().offer(0)).unwrap();
    assert_eq!(allocator.capabilities(), 0);
    let (_registry, binding) = registered(&allocator);
    let error = binding.virtual_backing().unwrap_err();
    assert!(error.to_string().contains("no virtual backing capability"), "{error}");
    assert!(binding.shared_mapping().is_err());
}

#[test]
fn stats_and_tallies_agree_with_what_is_live() {
    let (library, _) = load("stats");
    let allocator = instance(&library, "").unwrap();
    let a = allocator.allocate(&request(1000)).unwrap();
    let b = allocator.allocate(&request(24)).unwrap();
    let stats = allocator.try_stats().unwrap();
    assert_eq!((stats.live_allocations, stats.live_bytes), (2, 1024));
    let tally = allocator.tally().unwrap();
    assert_eq!((tally.instances, tally.allocations, tally.bytes), (1, 2, 1024));
    let host = allocator.host_tally();
    assert_eq!((host.allocations, host.bytes), (2, 1024));
    assert_eq!(allocator.try_trim().unwrap(), 0);
    assert!(allocator.release(a).is_complete());
    assert!(allocator.release(b).is_complete());
    assert!(allocator.tally().unwrap().allocations == 0 && allocator.host_tally().allocations == 0);
}

// ---------------------------------------------------------------------------------
// The unload protocol

#[test]
fn unload_is_refused_while_anything_made_through_it_lives_and_succeeds_after() {
    let (library, path) = load("unload");
    let allocator = instance(&library, "defer_polls=1").unwrap();
    let queue = allocator.release_queue(4).unwrap();
    let (registry, binding) = registered(&allocator);
    let mechanism = binding.identity().mechanism();
    let block = binding.allocate(request(4096)).unwrap();
    let view = block.view(0, 64).unwrap();
    assert_eq!(view.len(), 64);

    // An allocation (and its view) lives: both sides count it.
    let refused = library.unload().unwrap_err();
    assert_eq!(refused.host.allocations, 1);
    assert_eq!(refused.plugin.unwrap().allocations, 1);
    let message = refused.to_string();
    assert!(message.contains("the host still holds") && message.contains("the plugin reports"), "{message}");
    let library = refused.library;
    assert!(is_mapped(&path));

    // A queued release lives.
    binding.release_deferred(block, &queue).unwrap();
    let refused = library.unload().unwrap_err();
    assert_eq!(refused.host.queued_releases, 1);
    assert_eq!(refused.plugin.unwrap().deferred, 1);
    let library = refused.library;
    assert_eq!(queue.poll(), 1);

    // A shared backing lives.
    let backing = binding.shared_mapping().unwrap().create_backing(4096).unwrap();
    let refused = library.unload().unwrap_err();
    assert_eq!((refused.host.backings, refused.plugin.unwrap().backings), (1, 1));
    let library = refused.library;
    drop(backing);

    // The queue, the binding and the mechanism still hold the instance.
    drop(queue);
    let refused = library.unload().unwrap_err();
    assert_eq!(refused.host.instances, 1);
    assert_eq!(refused.host.allocations, 0);
    let library = refused.library;
    drop(binding);
    registry.retire(&mechanism).unwrap();
    registry.remove(&mechanism).unwrap();
    let refused = library.unload().unwrap_err();
    assert_eq!(refused.host.instances, 1, "our own handle still holds it");
    let library = refused.library;
    drop(allocator);
    drop(registry);

    assert!(is_mapped(&path));
    library.unload().unwrap();
    assert!(!is_mapped(&path), "the library is unmapped once unloaded");
}

#[test]
fn dropping_the_library_handle_keeps_the_code_mapped_until_the_last_pin_goes() {
    let (library, path) = load("pins");
    let allocator = instance(&library, "").unwrap();
    drop(library);
    assert!(is_mapped(&path));
    let block = allocator.allocate(&request(128)).unwrap();
    assert!(allocator.release(block).is_complete());
    drop(allocator);
    assert!(!is_mapped(&path));
}

/// One library loaded twice (two handles, one mapping: the dynamic loader counts the
/// loads): a handle dropped while an instance made through the other lives must not keep
/// the library mapped for good. The plugin's tally (library-wide) still shows that
/// instance, but it is the other load's, and that load keeps the code mapped.
#[test]
fn a_library_loaded_twice_unmaps_once_both_handles_and_their_instances_are_gone() {
    let (first, path) = load("twice");
    // SAFETY: the example plugin is built from this crate's own C source.
    let second = unsafe { PluginLibrary::load(&path) }.expect("the same library loads again");
    let allocator = instance(&first, "").unwrap();
    // The second handle made nothing: its unload is refused only by the plugin's
    // library-wide tally, which counts the first load's instance.
    let refused = second.unload().unwrap_err();
    assert!(refused.host.is_empty(), "{}", refused.host);
    assert_eq!(refused.plugin.unwrap().instances, 1);
    drop(refused);
    let block = allocator.allocate(&request(256)).unwrap();
    assert!(allocator.release(block).is_complete());
    drop(allocator);
    assert!(is_mapped(&path), "the first handle still holds it");
    first.unload().unwrap();
    assert!(!is_mapped(&path), "both loads are gone: the library is unmapped");
}

/// A plugin whose `mp_plugin_tally` fails cannot say it holds nothing: the unload is
/// refused, and the message says the tally failed instead of counting
/// 18446744073709551615 instances.
#[test]
fn a_tally_that_fails_refuses_the_unload_and_the_message_says_so() {
    let (library, path) = load("tally-fails");
    drop(instance(&library, "tally_fails=1").unwrap());
    let tally = library.plugin_tally().expect("the library exports a tally");
    assert!(!tally.is_empty(), "an unreadable tally is not an empty one");
    let refused = library.unload().unwrap_err();
    let message = refused.to_string();
    assert!(message.contains("mp_plugin_tally failed"), "{message}");
    assert!(!message.contains("18446744073709551615"), "{message}");
    assert_c_readable(&message);
    // Readable again: it unloads.
    let library = refused.library;
    drop(instance(&library, "tally_fails=0").unwrap());
    library.unload().unwrap();
    assert!(!is_mapped(&path));
}

#[test]
fn the_plugins_own_tally_refuses_unload_when_the_host_holds_nothing() {
    let (library, path) = load("plugin-side");
    // A refused wrong-major table is never called, not even destroy: the plugin keeps
    // its instance, and says so.
    assert!(instance(&library, "major=3").is_err());
    let refused = library.unload().unwrap_err();
    assert!(refused.host.is_empty(), "{}", refused.host);
    assert_eq!(refused.plugin.unwrap().instances, 1);
    // Dropping the handle does not unmap a library whose plugin still holds objects.
    drop(refused);
    assert!(is_mapped(&path));
}

// ---------------------------------------------------------------------------------
// Dishonest answers

fn plugin_allocations(library: &PluginLibrary) -> u64 {
    library.plugin_tally().unwrap().allocations
}

/// Whether a message that reaches C programmers (through memory-capi) stays in their
/// terms: no Rust value dumps, no Rust item paths.
fn assert_c_readable(message: &str) {
    for rust in ["MpBlock {", "MpDevice {", "::", "Some(", "None"] {
        assert!(!message.contains(rust), "{rust:?} in: {message}");
    }
}

#[test]
fn unusable_blocks_are_handed_back_and_the_message_says_which_rule_broke() {
    let (library, _) = load("unusable");
    // (fault, what the message must say: asked vs given)
    let cases: [(&str, &[&str]); 5] = [
        ("alloc_wrong_device", &["it is on host:1, but this instance serves host:0"]),
        ("alloc_misaligned", &["is not a multiple of its alignment 64 (0x40): it is aligned to 1 only"]),
        ("alloc_short", &["its size 2048 bytes is less than the 4096 bytes asked", "it gave 2048 bytes"]),
        ("alloc_null", &["its address is 0x0", "at 0x0 on host:0"]),
        // Bytes that run past 2^64: the block would wrap around to address 0.
        ("alloc_wraps", &["run past the end of the address space", "wrapping around to 0x0..0x1000"]),
    ];
    for (fault, says) in cases {
        let allocator = instance(&library, &format!("fault={fault}")).unwrap();
        let (_registry, binding) = registered(&allocator);
        let error = binding.allocate(request(4096)).unwrap_err();
        assert!(matches!(&error, AllocateError::Allocator(_)), "{fault}: {error}");
        let message = error.to_string();
        assert!(message.contains("example-plugin: MP_OK (0), but its block breaks the ABI's rules"), "{message}");
        assert!(message.contains("asked for 4096 bytes aligned to 64 on host:0"), "{message}");
        for said in says {
            assert!(message.contains(said), "{fault}: {said:?} missing in: {message}");
        }
        assert!(message.contains("handed back to the plugin's release and nothing was allocated"), "{message}");
        assert!(!message.contains("MP_ERR_BACKEND"), "the plugin did not answer that: {message}");
        assert_c_readable(&message);
        assert_eq!(plugin_allocations(&library), 0, "{fault}: the block went back to the plugin");
        assert_eq!(allocator.host_tally().suspect_blocks, 0, "{fault}");
        // The next call is honest and works.
        binding.release(binding.allocate(request(4096)).unwrap()).unwrap();
    }
    // The misaligned block's address, in hex: the host's own copy of what it was given.
    let allocator = instance(&library, "fault=alloc_misaligned").unwrap();
    let message = allocator.allocate(&request(4096)).unwrap_err().to_string();
    let address = message.split("its address ").nth(1).and_then(|rest| rest.split(' ').next()).unwrap();
    assert!(address.starts_with("0x") && u64::from_str_radix(&address[2..], 16).unwrap() % 2 == 1, "{message}");
}

#[test]
fn an_unknown_allocate_status_keeps_its_block_as_suspect_and_the_message_says_so() {
    let (library, _) = load("suspect");
    let allocator = instance(&library, "fault=alloc_unknown_status").unwrap();
    let error = allocator.allocate(&request(512)).unwrap_err();
    let message = error.to_string();
    assert!(message.contains("unknown status 77 (0x4d), and wrote a block of 512 bytes at 0x"), "{message}");
    assert!(message.contains("keeps the block as suspect"), "{message}");
    assert!(!message.contains("nothing was allocated"), "the host keeps a block: {message}");
    assert_c_readable(&message);
    assert_eq!(allocator.host_tally().suspect_blocks, 1);
    drop(allocator);
    let refused = library.unload().unwrap_err();
    assert_eq!(refused.suspect_blocks(), 1);
    assert_eq!(refused.plugin.unwrap().allocations, 1, "never freed: its owner is unknown");
}

/// The C-ABI review's case: a plugin with no tally of its own writes a block and answers
/// 0x7777. Every handle is dropped and the mechanism removed: the instance must stay
/// (the plugin may own the block), the unload must say suspect blocks remain, and only a
/// suspect retry that hands the block back lets it unload.
#[test]
fn a_suspect_block_keeps_its_instance_and_library_until_a_retry_discharges_it() {
    let (library, path) = load_built("suspect-unload", built_plugin_without_tally());
    assert!(library.plugin_tally().is_none(), "the build exports no tally");
    let allocator = instance(&library, "fault=alloc_unknown_status status=0x7777").unwrap();
    let (registry, binding) = registered(&allocator);
    let mechanism = binding.identity().mechanism();
    let error = binding.allocate(request(4096)).unwrap_err();
    assert!(error.to_string().contains("unknown status 30583 (0x7777)"), "{error}");
    assert_eq!(library.host_tally().suspect_blocks, 1);

    // Every handle goes: the binding, the mechanism (the registry drops its allocator),
    // our own clone.
    drop(binding);
    registry.retire(&mechanism).unwrap();
    registry.remove(&mechanism).unwrap();
    drop((allocator, registry));
    let host = library.host_tally();
    assert_eq!((host.instances, host.suspect_blocks), (1, 1), "the instance is kept, not destroyed: {host}");

    let refused = library.unload().unwrap_err();
    assert_eq!(refused.suspect_blocks(), 1);
    let message = refused.to_string();
    assert!(message.contains("refused: 1 suspect block(s) remain"), "{message}");
    assert!(message.contains("retry the suspect blocks"), "{message}");
    assert_c_readable(&message);
    let library = refused.library;
    assert!(is_mapped(&path));

    // The plugin takes the block back: discharged, the instance destroyed, unloadable.
    let retried = library.retry_suspects();
    assert_eq!((retried.discharged, retried.still_suspect), (1, 0), "{retried}");
    assert!(library.host_tally().is_empty(), "{}", library.host_tally());
    library.unload().unwrap();
    assert!(!is_mapped(&path), "unmapped once the suspect block was discharged");
}

#[test]
fn a_suspect_the_plugin_will_not_take_back_stays_and_the_library_stays_mapped() {
    let (library, path) = load_built("suspect-stays", built_plugin_without_tally());
    // Every release fails: the retry cannot discharge the block.
    let allocator = instance(&library, "fault=alloc_unknown_status status=0x7777 keep=1").unwrap();
    assert!(allocator.allocate(&request(64)).is_err());
    let retried = allocator.retry_suspects();
    assert_eq!((retried.discharged, retried.still_suspect), (0, 1), "a retry the plugin does not honour");
    // An unusable block the plugin will not take back is kept too, and the message says so.
    let unusable = instance(&library, "fault=alloc_misaligned keep=1").unwrap();
    let message = unusable.allocate(&request(64)).unwrap_err().to_string();
    assert!(message.contains("breaks the ABI's rules") && message.contains("keeps the block as suspect"), "{message}");
    assert!(!message.contains("nothing was allocated"), "{message}");
    assert_eq!(library.host_tally().suspect_blocks, 2);
    drop(unusable);
    drop(allocator);
    // Dropping the library handle too: the kept instance keeps the code mapped.
    drop(library);
    assert!(is_mapped(&path), "a suspect block's instance and library are never pulled from under it");
}

#[test]
fn a_block_overlapping_a_live_one_is_refused_and_kept_as_suspect_until_that_one_is_released() {
    // alloc_alias: the live block's own address and size; alloc_overlap: 64 bytes into it.
    for (fault, offset) in [("alloc_alias", 0), ("alloc_overlap", 64)] {
        let (library, path) = load(fault);
        let allocator = instance(&library, &format!("fault={fault} at=2")).unwrap();
        let (registry, binding) = registered(&allocator);
        let live = binding.allocate(request(4096)).unwrap();
        let error = binding.allocate(request(4096)).unwrap_err();
        assert!(matches!(&error, AllocateError::Allocator(_)), "{fault}: {error}");
        let message = error.to_string();
        let at = live.address().get();
        let said =
            format!("its block (4096 bytes at {:#x}..{:#x}) overlaps a live block", at + offset, at + offset + 4096);
        assert!(message.contains(&said), "{fault}: {said:?} missing in: {message}");
        assert!(message.contains(&format!("(4096 bytes at {at:#x}..{:#x})", at + 4096)), "{message}");
        assert!(message.contains("two live allocations must never share memory"), "{message}");
        assert!(message.contains("keeps the block as suspect"), "{message}");
        assert_c_readable(&message);
        let host = allocator.host_tally();
        assert_eq!((host.allocations, host.suspect_blocks), (1, 1), "{fault}: {host}");
        assert_eq!(plugin_allocations(&library), 1, "{fault}: nothing new was allocated");
        // Not handed back while the block it overlaps lives.
        let retried = allocator.retry_suspects();
        assert_eq!((retried.discharged, retried.still_suspect), (0, 1), "{fault}");
        // The live block stays whole and usable.
        assert!(matches!(binding.release(live).unwrap(), ReleaseSummary::Complete { .. }), "{fault}");
        // Now it overlaps nothing live: handed back, the plugin says it holds no such
        // block, and it is discharged.
        let retried = allocator.retry_suspects();
        assert_eq!((retried.discharged, retried.still_suspect), (1, 0), "{fault}");
        drop((binding, registry, allocator));
        library.unload().unwrap();
        assert!(!is_mapped(&path), "{fault}");
    }
}

#[test]
fn a_block_overlapping_one_live_on_another_thread_is_refused() {
    let (library, _) = load("alias-threads");
    let allocator = instance(&library, "fault=alloc_alias at=2").unwrap();
    // Recorded by another thread, in another part of the records.
    let live = std::thread::scope(|scope| scope.spawn(|| allocator.allocate(&request(256)).unwrap()).join().unwrap());
    let error = allocator.allocate(&request(256)).unwrap_err();
    assert!(error.to_string().contains("overlaps a live block"), "{error}");
    assert_eq!(allocator.host_tally().suspect_blocks, 1);
    assert!(allocator.release(live).is_complete());
    assert_eq!(allocator.retry_suspects().discharged, 1);
}

/// An honest plugin whose addresses move between threads (glibc hands a block freed on
/// one thread out again on that thread): no block is ever taken for an alias, including
/// one answered while the release of the block that last held its address is still
/// under way on the other thread.
#[test]
fn honest_addresses_reused_across_threads_are_never_taken_for_overlaps() {
    let (library, _) = load("honest-reuse");
    let allocator = instance(&library, "").unwrap();
    let rounds = if cfg!(miri) { 50 } else { 20_000 };
    let (to_first, from_second) = std::sync::mpsc::channel::<RawAllocation>();
    let (to_second, from_first) = std::sync::mpsc::channel::<RawAllocation>();
    std::thread::scope(|scope| {
        for (send, receive) in [(to_second, from_second), (to_first, from_first)] {
            let allocator = allocator.clone();
            scope.spawn(move || {
                let release = |block: RawAllocation| assert!(allocator.release(block).is_complete());
                for round in 0..rounds {
                    let bytes = 64 << (round % 4);
                    let block = allocator.allocate(&request(bytes)).unwrap_or_else(|error| panic!("{round}: {error}"));
                    send.send(block).unwrap();
                    receive.try_iter().for_each(release);
                }
                drop(send);
                receive.into_iter().for_each(release);
            });
        }
    });
    let host = allocator.host_tally();
    assert_eq!((host.allocations, host.suspect_blocks), (0, 0), "{host}");
    assert_eq!(plugin_allocations(&library), 0);
}

fn quarantined_release(config: &str, expect_unmapped: usize, expect_residual: usize) {
    let (library, _) = load(&format!("release-{}", config.replace([' ', '='], "-")));
    let allocator = instance(&library, config).unwrap();
    let (registry, binding) = registered(&allocator);
    let block = binding.allocate(request(4096)).unwrap();
    let identity = block.identity().unwrap();
    let report = binding.release(block).unwrap();
    assert_eq!(
        report,
        ReleaseSummary::Quarantined { unmapped_bytes: expect_unmapped, residual_bytes: expect_residual },
        "{config}"
    );
    assert_eq!(registry.allocation_state(&identity), AllocationState::Quarantined, "{config}");
    // The fault fired once: a retry through the original allocator completes.
    let retried = registry.retry_quarantined(&identity.binding().mechanism()).unwrap();
    assert_eq!((retried.released, retried.still_quarantined), (1, 0), "{config}");
    assert_eq!(plugin_allocations(&library), 0, "{config}");
}

#[test]
fn an_unknown_release_status_is_a_quarantine_of_the_whole_block() {
    quarantined_release("fault=release_unknown_status", 0, 4096);
}

#[test]
fn an_unknown_outcome_kind_is_a_quarantine_of_the_whole_block() {
    quarantined_release("fault=release_unknown_kind", 0, 4096);
}

#[test]
fn an_outcome_about_another_block_is_a_quarantine_of_the_block_given() {
    quarantined_release("fault=release_other_block", 0, 4096);
}

#[test]
fn an_overclaiming_quarantine_is_corrected_to_all_owned() {
    quarantined_release("fault=release_overclaim", 0, 4096);
}

#[test]
fn an_honest_partial_release_keeps_its_exact_bytes() {
    quarantined_release("fault=release_partial", 2048, 2048);
}

#[test]
fn a_failed_release_hands_the_allocation_back_unchanged() {
    for fault in ["release_fail", "release_failed_outcome"] {
        let (library, _) = load(fault);
        let allocator = instance(&library, &format!("fault={fault}")).unwrap();
        let (_registry, binding) = registered(&allocator);
        let block = binding.allocate(request(256)).unwrap();
        let rejected = binding.release(block).unwrap_err();
        assert!(matches!(rejected.reason, HandleError::ReleaseFailed(_)), "{fault}: {}", rejected.reason);
        assert!(rejected.handle.is_valid());
        binding.release(rejected.handle).unwrap();
        assert_eq!(plugin_allocations(&library), 0, "{fault}");
    }
}

#[test]
fn forged_and_repeated_blocks_never_reach_the_plugin() {
    let (library, _) = load("forged");
    let allocator = instance(&library, "").unwrap();
    let block = allocator.allocate(&request(64)).unwrap();
    let copy = RawAllocation::new(block.address(), block.bytes(), block.align(), block.device(), block.provider_tag());
    let forged = RawAllocation::new(DeviceAddress::new(0x1000).unwrap(), 64, 64, DeviceKey::HOST, 0);
    let ReleaseOutcome::Failed(failed) = allocator.release(forged) else { panic!("a forged block must fail") };
    assert!(matches!(failed.error(), ReleaseError::NotOwned { .. }));
    assert!(allocator.release(block).is_complete());
    let ReleaseOutcome::Failed(failed) = allocator.release(copy) else { panic!("a second release must fail") };
    assert!(matches!(failed.error(), ReleaseError::NotOwned { .. }));
    assert_eq!(plugin_allocations(&library), 0);
}

/// Two threads releasing copies of the same blocks at once, the blocks made on a third:
/// each block reaches the plugin exactly once (a second release there would free it
/// twice, and the plugin's tally, allocations minus releases, would not come back to
/// zero), the other copy is refused as not owned, and the recording thread reuses the
/// slots the others gave back.
#[test]
fn racing_releases_from_other_threads_reach_the_plugin_exactly_once() {
    let (library, _) = load("racing");
    let allocator = instance(&library, "").unwrap();
    let blocks = if cfg!(miri) { 50 } else { 2000 };
    for round in 0..3 {
        let made: Vec<RawAllocation> = (0..blocks).map(|_| allocator.allocate(&request(64)).unwrap()).collect();
        if round > 0 {
            // The tag's slot field (bits 24..48): the slots the racers gave back through
            // this thread's remote stack, not new ones.
            let slots: Vec<u64> = made.iter().map(|b| (b.provider_tag() >> 24) & 0xff_ffff).collect();
            assert!(slots.iter().all(|&slot| slot < blocks as u64), "round {round}: the records grew: {slots:?}");
        }
        let copies = |made: &[RawAllocation]| -> Vec<RawAllocation> {
            made.iter()
                .map(|b| RawAllocation::new(b.address(), b.bytes(), b.align(), b.device(), b.provider_tag()))
                .collect()
        };
        let sides = [copies(&made), made];
        let start = Arc::new(std::sync::Barrier::new(2));
        let outcomes: Vec<(usize, usize)> = std::thread::scope(|scope| {
            let racers: Vec<_> = sides
                .into_iter()
                .map(|side| {
                    let (allocator, start) = (allocator.clone(), Arc::clone(&start));
                    scope.spawn(move || {
                        start.wait();
                        side.into_iter().fold((0, 0), |(complete, refused), block| match allocator.release(block) {
                            ReleaseOutcome::Complete(_) => (complete + 1, refused),
                            ReleaseOutcome::Failed(failed) => {
                                assert!(matches!(failed.error(), ReleaseError::NotOwned { .. }), "{}", failed.error());
                                (complete, refused + 1)
                            }
                            other => panic!("round {round}: {}", other.summary()),
                        })
                    })
                })
                .collect();
            racers.into_iter().map(|racer| racer.join().unwrap()).collect()
        });
        let complete: usize = outcomes.iter().map(|(complete, _)| complete).sum();
        let refused: usize = outcomes.iter().map(|(_, refused)| refused).sum();
        assert_eq!((complete, refused), (blocks, blocks), "round {round}: {outcomes:?}");
        assert_eq!(plugin_allocations(&library), 0, "round {round}: a block reached the plugin twice or never");
        assert_eq!(allocator.host_tally().allocations, 0, "round {round}");
    }
}

#[test]
fn an_overclaiming_commit_is_an_error() {
    let (library, _) = load("commit");
    let allocator = instance(&library, "fault=commit_overclaim").unwrap();
    let block = allocator.allocate(&AllocationRequest::new(16384, 4096).unwrap()).unwrap();
    let error = allocator.virtual_backing().unwrap().commit(&block, ByteRange::new(0, 4096)).unwrap_err();
    assert!(matches!(error, CapabilityError::Backend(_)), "{error}");
    assert!(error.to_string().contains("claimed 8192 bytes for a range of 4096"), "{error}");
    assert!(allocator.release(block).is_complete());
}

#[test]
fn tickets_the_host_never_issued_are_ignored_and_counted() {
    let (library, _) = load("tickets");
    for (fault, runs) in [("poll_bogus_ticket", 1), ("poll_duplicate_ticket", 1)] {
        let allocator = instance(&library, &format!("fault={fault} at=0")).unwrap();
        let queue = allocator.release_queue(4).unwrap();
        let (_registry, binding) = registered(&allocator);
        binding.release_deferred(binding.allocate(request(64)).unwrap(), &queue).unwrap();
        assert_eq!(queue.poll(), runs, "{fault}");
        assert_eq!(queue.dishonest_reports(), 1, "{fault}");
        assert!(queue.is_empty());
    }
    assert_eq!(plugin_allocations(&library), 0);
}

// ---------------------------------------------------------------------------------
// The contract every allocator meets

#[test]
fn the_plugin_allocator_passes_the_conformance_suite() {
    let (library, _) = load("conformance");
    let report = memory_testkit::conformance::Suite::new(|| instance(&library, "").unwrap()).run();
    eprintln!("{report}");
    report.assert_passed();
    let structured_only = InstanceOptions::new().offer(MP_CAP_STRUCTURED_RELEASE | MP_CAP_DEFERRED_RELEASE);
    let report = memory_testkit::conformance::Suite::new(|| library.instantiate(&structured_only).unwrap()).run();
    report.assert_passed();
}

// ---------------------------------------------------------------------------------
// Loading

/// A library the loader cannot open is refused with the loader's own reason (libloading
/// says only "dlopen failed" and keeps `dlerror()` as its source), and an empty path,
/// which `dlopen` takes as the program itself, is refused before the loader runs.
#[test]
fn a_load_that_fails_says_what_the_loader_said_and_an_empty_path_is_refused() {
    let missing = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("no-such-plugin.so");
    // SAFETY: nothing is loaded: the file does not exist.
    let error = unsafe { PluginLibrary::load(&missing) }.expect_err("a missing file does not load");
    let text = error.to_string();
    assert!(matches!(error, PluginError::Load { .. }), "{text}");
    assert!(text.contains("No such file or directory") && text.contains("no-such-plugin.so"), "{text}");
    // A directory: the loader says what is wrong with it.
    // SAFETY: a directory is never mapped.
    let error = unsafe { PluginLibrary::load(env!("CARGO_TARGET_TMPDIR")) }.expect_err("a directory does not load");
    assert!(error.to_string().contains("dlopen failed: "), "{error}");
    // SAFETY: refused before the loader runs.
    let error = unsafe { PluginLibrary::load("") }.expect_err("an empty path does not load");
    let text = error.to_string();
    assert!(matches!(error, PluginError::Load { .. }), "{text}");
    assert!(text.contains("empty path names this program itself"), "{text}");
}

/// The library whose entry point [`instantiate_again`] re-enters, and what that nested
/// call answered.
static REENTERED: OnceLock<PluginLibrary> = OnceLock::new();
static NESTED_ANSWER: std::sync::Mutex<Option<Result<u16, PluginError>>> = std::sync::Mutex::new(None);

/// Called by the example plugin from inside its entry point (`reenter=ADDR`): asks the
/// same library for a second instance, as a composite plugin asking its host would.
extern "C" fn instantiate_again() {
    let library = REENTERED.get().expect("set before the outer instantiate");
    let answer = instance(library, "").map(|allocator| allocator.abi_minor());
    *NESTED_ANSWER.lock().unwrap() = Some(answer);
}

/// An entry point that calls back into the host for another instance of its own library
/// (a plugin calling back into the host from its callbacks) gets a typed refusal that
/// says so; the outer instantiate then completes. Before the fix the nested call waited
/// for the library's entry lock, which its own thread held: the thread hung for good.
#[test]
fn an_entry_point_that_asks_its_own_library_for_an_instance_is_refused_not_deadlocked() {
    let (library, _) = load("reenter");
    REENTERED.set(library).expect("set once");
    let config = format!("reenter={:#x}", instantiate_again as extern "C" fn() as usize);
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let outer = REENTERED.get().expect("set above");
        let _ = done.send(instance(outer, &config).map(|allocator| allocator.abi_minor()));
    });
    // A generous bound: only a hang (the defect) reaches it.
    let outer = finished
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the instantiate whose entry point re-entered its library never returned (deadlock)");
    assert_eq!(outer, Ok(1));
    let nested = NESTED_ANSWER.lock().unwrap().take().expect("the entry point called back");
    let error = nested.expect_err("the nested instantiate is refused");
    assert!(matches!(error, PluginError::ReentrantEntry { .. }), "{error}");
    let text = error.to_string();
    assert!(
        text.contains("from inside its own entry point") && text.contains("once mp_plugin_entry has returned"),
        "{text}"
    );
}
