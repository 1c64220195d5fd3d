/* Suspect blocks, from C11, with memory-plugin's example plugin as a shared library
 * (the argument: its path). A block the host keeps as suspect (the plugin wrote it and
 * answered an unknown status, or it overlaps a live block) keeps its instance and the
 * library loaded after every handle made through it is gone: the tally shows it,
 * mc_plugin_unload answers MC_ERR_SUSPECT_BLOCKS with the count, and a suspect retry
 * (mc_plugin_retry_suspects for the library, mc_mechanism_retry_suspects for one
 * mechanism) hands the block back so the library unloads. Every program retries before
 * it exits, so valgrind sees nothing kept (issue 23, items 3 and 4). A block that runs
 * past the end of the address space is no suspect: it is handed straight back. */
#include <stdint.h>

#include "check.h"

static const MpDevice HOST = {MP_TIER_HOST, 0};

/* What one scenario registers: a registry, a context, an authority, a plugin mechanism
 * configured with `config`, and a binding of it. */
typedef struct {
    McRegistry *registry;
    McContext *context;
    McAuthority *tenant;
    McMechanism *mechanism;
    McBinding *binding;
} World;

static World world(McPluginLibrary *library, const char *config) {
    World w = {0};
    OK(mc_registry_create(&w.registry));
    OK(mc_context_register(w.registry, HOST, NULL, NULL, &w.context));
    OK(mc_authority_register(w.registry, HOST, NULL, NULL, &w.tenant));
    OK(mc_register_plugin(w.registry, NULL, w.context, w.tenant, library, config, &w.mechanism));
    OK(mc_bind_mechanism(w.registry, w.mechanism, &w.binding));
    return w;
}

/* Destroys the binding, retires (when `retire`: a terminated mechanism needs none) and
 * removes the mechanism, then the rest. */
static void teardown(World *w, int retire) {
    OK(mc_binding_destroy(w->binding));
    if (retire) OK(mc_mechanism_retire(w->registry, w->mechanism));
    OK(mc_mechanism_remove(w->registry, w->mechanism));
    OK(mc_context_remove(w->registry, w->context));
    OK(mc_authority_remove(w->registry, w->tenant));
    OK(mc_registry_destroy(w->registry));
}

static McPluginTallies tally(McPluginLibrary *library) {
    McPluginTallies tallies;
    OK(mc_plugin_tally(library, &tallies));
    return tallies;
}

/* The message of the last failure does not say `text`. */
#define NOT_SAYS(text) TRUE(strstr(mc_last_error_message(), (text)) == NULL)

/* The review's scenario: the plugin writes a block and answers 0x7777. */
static void an_unknown_status_keeps_the_block_and_blocks_unload_until_retried(const char *path) {
    McPluginLibrary *library = NULL;
    McAllocation *block = NULL;
    McSuspectRetry retry = {99, 99};
    OK(mc_plugin_load(path, &library));
    World w = world(library, "fault=alloc_unknown_status at=1 status=0x7777");

    EXPECT(mc_allocate(w.binding, 4096, 64, MP_ROLE_WORKSPACE, &block), MC_ERR_BACKEND);
    SAYS("0x7777");
    SAYS("suspect");
    SAYS("mc_plugin_retry_suspects");
    NOT_SAYS("nothing was allocated");
    TRUE(block == NULL);
    McPluginTallies tallies = tally(library);
    TRUE(tallies.host_suspect_blocks == 1 && tallies.host_allocations == 0);

    /* Every argument is checked before anything is handed back. */
    EXPECT(mc_plugin_retry_suspects(NULL, &retry), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_plugin_retry_suspects(library, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_plugin_retry_suspects((McPluginLibrary *)w.registry, &retry), MC_ERR_INVALID_HANDLE);
    EXPECT(mc_mechanism_retry_suspects(NULL, w.mechanism, &retry), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_mechanism_retry_suspects(w.registry, NULL, &retry), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_mechanism_retry_suspects(w.registry, w.mechanism, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_mechanism_retry_suspects(w.registry, (McMechanism *)w.binding, &retry), MC_ERR_INVALID_HANDLE);
    TRUE(retry.discharged == 99 && retry.still_suspect == 99);
    TRUE(tally(library).host_suspect_blocks == 1);

    /* Every handle made through the library goes; the suspect block keeps its instance. */
    teardown(&w, 1);
    tallies = tally(library);
    TRUE(tallies.host_instances == 1 && tallies.host_suspect_blocks == 1);
    TRUE(tallies.plugin_reported == 1 && tallies.plugin.instances == 1);
    EXPECT(mc_plugin_unload(library), MC_ERR_SUSPECT_BLOCKS);
    SAYS("1 suspect");
    SAYS("mc_plugin_retry_suspects");

    /* The retry hands the block back: the plugin takes it, the instance goes. */
    OK(mc_plugin_retry_suspects(library, &retry));
    TRUE(retry.discharged == 1 && retry.still_suspect == 0);
    tallies = tally(library);
    TRUE(tallies.host_instances == 0 && tallies.host_suspect_blocks == 0 && tallies.plugin.instances == 0);
    OK(mc_plugin_retry_suspects(library, &retry));
    TRUE(retry.discharged == 0 && retry.still_suspect == 0);
    OK(mc_plugin_unload(library));
    EXPECT(mc_plugin_unload(library), MC_ERR_STALE_HANDLE);
}

/* A block that overlaps (or aliases) a live one is refused and kept, and goes back only
 * once the live block is released. */
static void an_overlapping_block_is_refused_and_kept_until_the_live_one_is_gone(const char *path, const char *config) {
    McPluginLibrary *library = NULL;
    McAllocation *live = NULL, *overlapping = NULL;
    McSuspectRetry retry;
    OK(mc_plugin_load(path, &library));
    World w = world(library, config);

    OK(mc_allocate(w.binding, 4096, 64, MP_ROLE_WORKSPACE, &live));
    EXPECT(mc_allocate(w.binding, 4096, 64, MP_ROLE_WORKSPACE, &overlapping), MC_ERR_BACKEND);
    SAYS("overlaps a live block");
    SAYS("suspect");
    TRUE(overlapping == NULL);
    TRUE(tally(library).host_suspect_blocks == 1);

    /* While the live block lives the suspect one is not handed back. */
    OK(mc_mechanism_retry_suspects(w.registry, w.mechanism, &retry));
    TRUE(retry.discharged == 0 && retry.still_suspect == 1);
    OK(mc_release(w.binding, live, NULL));
    /* The plugin does not hold it (it answers MP_ERR_NOT_OWNED): discharged. */
    OK(mc_mechanism_retry_suspects(w.registry, w.mechanism, &retry));
    TRUE(retry.discharged == 1 && retry.still_suspect == 0);
    TRUE(tally(library).host_suspect_blocks == 0);

    teardown(&w, 1);
    OK(mc_plugin_unload(library));
}

/* A block whose bytes run past 2^64 (it would wrap around to address 0) breaks the
 * ABI's rules: it goes straight back to the plugin's release, and nothing is allocated
 * or kept as suspect. */
static void a_block_running_past_the_address_space_is_handed_back(const char *path) {
    McPluginLibrary *library = NULL;
    McAllocation *block = NULL;
    OK(mc_plugin_load(path, &library));
    World w = world(library, "fault=alloc_wraps at=1");
    EXPECT(mc_allocate(w.binding, 4096, 64, MP_ROLE_WORKSPACE, &block), MC_ERR_BACKEND);
    SAYS("run past the end of the address space");
    SAYS("handed back to the plugin's release and nothing was allocated");
    TRUE(block == NULL);
    McPluginTallies tallies = tally(library);
    TRUE(tallies.host_allocations == 0 && tallies.host_suspect_blocks == 0 && tallies.plugin.allocations == 0);
    /* The next answer is honest. */
    OK(mc_allocate(w.binding, 4096, 64, MP_ROLE_WORKSPACE, &block));
    OK(mc_release(w.binding, block, NULL));
    teardown(&w, 1);
    OK(mc_plugin_unload(library));
}

/* A mechanism's retry needs a plugin or vtable mechanism, and a device that is not lost. */
static void a_mechanism_retry_refuses_built_ins_and_lost_devices(const char *path) {
    McPluginLibrary *library = NULL;
    McMechanism *builtin = NULL;
    McAllocation *block = NULL;
    McSuspectRetry retry;
    OK(mc_plugin_load(path, &library));
    World w = world(library, "fault=alloc_unknown_status at=1 status=0x7777");
    OK(mc_register_cpu_allocator(w.registry, NULL, w.context, w.tenant, MC_CPU_SYSTEM, &builtin));
    EXPECT(mc_mechanism_retry_suspects(w.registry, builtin, &retry), MC_ERR_UNSUPPORTED);
    SAYS("mc_register_plugin");

    EXPECT(mc_allocate(w.binding, 256, 64, MP_ROLE_WORKSPACE, &block), MC_ERR_BACKEND);
    OK(mc_invalidate_device(w.registry, HOST, "simulated", NULL));
    EXPECT(mc_mechanism_retry_suspects(w.registry, w.mechanism, &retry), MC_ERR_DEVICE_LOST);
    SAYS("mc_confirm_terminated");
    TRUE(tally(library).host_suspect_blocks == 1);
    OK(mc_confirm_terminated(w.registry, w.context, NULL));
    OK(mc_mechanism_retry_suspects(w.registry, w.mechanism, &retry));
    TRUE(retry.discharged == 1 && retry.still_suspect == 0);

    OK(mc_mechanism_remove(w.registry, builtin));
    teardown(&w, 0);
    OK(mc_plugin_unload(library));
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s PATH-OF-THE-EXAMPLE-PLUGIN\n", argv[0]);
        return 2;
    }
    uint32_t major = 0, minor = 0;
    OK(mc_api_version(&major, &minor));
    TRUE(major == MC_API_MAJOR && minor >= 2);
    an_unknown_status_keeps_the_block_and_blocks_unload_until_retried(argv[1]);
    an_overlapping_block_is_refused_and_kept_until_the_live_one_is_gone(argv[1], "fault=alloc_overlap at=2");
    an_overlapping_block_is_refused_and_kept_until_the_live_one_is_gone(argv[1], "fault=alloc_alias at=2");
    a_mechanism_retry_refuses_built_ins_and_lost_devices(argv[1]);
    a_block_running_past_the_address_space_is_handed_back(argv[1]);
    printf("c suspects: %d checks passed (%d failure messages checked)\n", checks, messages_checked);
    return 0;
}
