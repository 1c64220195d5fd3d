/* The C API's contract as a C programmer meets it (issue 23), from C11:
 * - every function checks every argument (null pointers, handles, enum values) before
 *   anything has an effect: a CUDA registration with a null registry is
 *   MC_ERR_NULL_ARGUMENT, not a driver error;
 * - a failed context or authority registration never calls destroy(user);
 * - mc_registry_destroy refuses while context, authority or mechanism handles live;
 * - a queue of capacity 0 is refused;
 * - a reclaim holder written in C frees memory when the governor asks;
 * - every failure's message names C functions, never Rust items (check.h checks each). */
#include <stdint.h>

#include "check.h"

static const MpDevice HOST = {MP_TIER_HOST, 5};
static const MpDevice GPU = {MP_TIER_DEVICE, 0};
static const MpDevice NO_TIER = {77, 0};

static int destroyed;
static void on_destroy(void *user) { destroyed += *(int *)user; }

/* A vtable none of whose slots may run: the calls that use it below are all refused. */
static int slot_calls;
static MpStatus never_allocate(void *instance, const MpRequest *request, MpBlock *out) {
    (void)instance, (void)request, (void)out;
    slot_calls++;
    return MP_ERR_BACKEND;
}
static MpStatus never_release(void *instance, const MpBlock *block, MpReleaseOutcome *outcome) {
    (void)instance, (void)block, (void)outcome;
    slot_calls++;
    return MP_ERR_BACKEND;
}
static void never_destroy(void *instance) {
    (void)instance;
    slot_calls++;
}

/* A KV cache that gives its block back when the governor asks. */
struct Cache {
    McBinding *binding;
    McAllocation *block;
    uint64_t bytes;
    int asked, destroyed;
    uint64_t last_request;
    uint32_t last_role;
};

static uint64_t cache_reclaim(void *user, const McReclaimRequest *request) {
    struct Cache *cache = user;
    cache->asked++;
    cache->last_request = request->bytes;
    cache->last_role = request->role;
    if (cache->block == NULL) return 0;
    /* Re-enters the API from inside an allocation: no lock of the library is held. */
    if (mc_release(cache->binding, cache->block, NULL) != MC_OK) return 0;
    cache->block = NULL;
    return cache->bytes;
}

static uint64_t cache_reclaimable(void *user, MpDevice device) {
    struct Cache *cache = user;
    (void)device;
    return cache->block != NULL ? cache->bytes : 0;
}

static void cache_destroy(void *user) { ((struct Cache *)user)->destroyed++; }

static void arguments_are_checked_before_anything_happens(void) {
    int user = 1000;
    uint32_t major, minor;
    McRegistry *registry = NULL, *stale = NULL;
    McGovernor *governor = NULL;
    McContext *context = NULL, *gpu_context = NULL;
    McAuthority *tenant = NULL, *gpu_tenant = NULL;
    McMechanism *mechanism = NULL, *out_mechanism = NULL;
    McBinding *binding = NULL, *out_binding = NULL;
    McAllocation *block = NULL, *out_block = NULL;
    McQueue *queue = NULL, *out_queue = NULL;
    McPluginLibrary *library = NULL;
    McReclaimHolder *holder = NULL;
    McBacking *backing = NULL;
    McAllocationInfo info;
    McPluginTallies tallies;
    McInvalidation invalidation;
    McTermination termination;
    size_t length = 0, ran = 0;
    uint64_t value = 0;
    char buffer[64];

    EXPECT(mc_api_version(NULL, &minor), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_api_version(&major, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_registry_create(NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_registry_destroy(NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_governor_create(NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_governor_destroy(NULL), MC_ERR_NULL_ARGUMENT);
    OK(mc_registry_create(&stale));
    OK(mc_registry_destroy(stale));
    OK(mc_registry_create(&registry));
    OK(mc_governor_create(&governor));

    /* Contexts and authorities: a refused registration never calls destroy(user). */
    EXPECT(mc_context_register(NULL, HOST, &user, on_destroy, &context), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_context_register(stale, HOST, &user, on_destroy, &context), MC_ERR_STALE_HANDLE);
    EXPECT(mc_context_register((McRegistry *)governor, HOST, &user, on_destroy, &context), MC_ERR_INVALID_HANDLE);
    EXPECT(mc_context_register(registry, NO_TIER, &user, on_destroy, &context), MC_ERR_INVALID_ARGUMENT);
    SAYS("MP_TIER_HOST");
    EXPECT(mc_context_register(registry, HOST, &user, on_destroy, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_authority_register(NULL, HOST, &user, on_destroy, &tenant), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_authority_register(stale, HOST, &user, on_destroy, &tenant), MC_ERR_STALE_HANDLE);
    EXPECT(mc_authority_register(registry, NO_TIER, &user, on_destroy, &tenant), MC_ERR_INVALID_ARGUMENT);
    EXPECT(mc_authority_register(registry, HOST, &user, on_destroy, NULL), MC_ERR_NULL_ARGUMENT);
    TRUE(destroyed == 0);
    OK(mc_context_register(registry, HOST, NULL, NULL, &context));
    OK(mc_authority_register(registry, HOST, NULL, NULL, &tenant));
    OK(mc_context_register(registry, GPU, NULL, NULL, &gpu_context));
    OK(mc_authority_register(registry, GPU, NULL, NULL, &gpu_tenant));
    EXPECT(mc_context_remove(NULL, context), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_context_remove(registry, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_authority_remove(NULL, tenant), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_authority_remove(registry, NULL), MC_ERR_NULL_ARGUMENT);

    /* The governor. */
    EXPECT(mc_governor_set_device_limit(NULL, HOST, 1), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_governor_set_device_limit(governor, NO_TIER, 1), MC_ERR_INVALID_ARGUMENT);
    EXPECT(mc_governor_open_account(NULL, tenant, 1, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_governor_open_account(governor, NULL, 1, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_governor_set_quota(NULL, tenant, 1), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_governor_set_quota(governor, NULL, 1), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_governor_set_policy(NULL, HOST, MC_POLICY_HARD_LIMIT), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_governor_set_policy(governor, NO_TIER, MC_POLICY_HARD_LIMIT), MC_ERR_INVALID_ARGUMENT);
    EXPECT(mc_governor_set_policy(governor, HOST, 9), MC_ERR_INVALID_ARGUMENT);
    SAYS("MC_POLICY_RECLAIM_THEN_FAIL");
    EXPECT(mc_governor_register_holder(NULL, HOST, 0, "h", cache_reclaim, NULL, &user, on_destroy, &holder),
           MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_governor_register_holder(governor, HOST, 0, "h", NULL, NULL, &user, on_destroy, &holder),
           MC_ERR_NULL_ARGUMENT);
    SAYS("reclaim is null");
    EXPECT(mc_governor_register_holder(governor, NO_TIER, 0, "h", cache_reclaim, NULL, &user, on_destroy, &holder),
           MC_ERR_INVALID_ARGUMENT);
    EXPECT(mc_governor_register_holder(governor, HOST, 0, "h", cache_reclaim, NULL, &user, on_destroy, NULL),
           MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_governor_unregister_holder(NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_governor_unregister_holder((McReclaimHolder *)governor), MC_ERR_INVALID_HANDLE);
    TRUE(destroyed == 0);

    /* Registration: handles, kinds and out-pointers before any allocator is made. */
    EXPECT(mc_register_cpu_allocator(NULL, NULL, context, tenant, MC_CPU_SYSTEM, &mechanism), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_register_cpu_allocator(registry, NULL, NULL, tenant, MC_CPU_SYSTEM, &mechanism), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_register_cpu_allocator(registry, NULL, context, NULL, MC_CPU_SYSTEM, &mechanism), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_register_cpu_allocator(registry, NULL, context, tenant, MC_CPU_SYSTEM, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_register_cpu_allocator(registry, NULL, context, tenant, 42, &mechanism), MC_ERR_INVALID_ARGUMENT);
    EXPECT(mc_register_cpu_allocator(registry, NULL, context, gpu_tenant, MC_CPU_SYSTEM, &mechanism),
           MC_ERR_INVALID_ARGUMENT);
    EXPECT(mc_register_cpu_allocator(registry, governor, context, tenant, MC_CPU_SYSTEM, &mechanism),
           MC_ERR_INVALID_ARGUMENT);
    SAYS("mc_governor_open_account");
    /* The CUDA driver is not loaded (and no device opened) for a call that is refused. */
    EXPECT(mc_register_cuda_allocator(NULL, NULL, gpu_context, gpu_tenant, MC_CUDA_EAGER, &mechanism),
           MC_ERR_NULL_ARGUMENT);
    SAYS("registry is null");
    EXPECT(mc_register_cuda_allocator(registry, NULL, NULL, gpu_tenant, MC_CUDA_EAGER, &mechanism), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_register_cuda_allocator(registry, NULL, gpu_context, NULL, MC_CUDA_EAGER, &mechanism), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_register_cuda_allocator(registry, NULL, gpu_context, gpu_tenant, MC_CUDA_EAGER, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_register_cuda_allocator(stale, NULL, gpu_context, gpu_tenant, MC_CUDA_EAGER, &mechanism),
           MC_ERR_STALE_HANDLE);
    EXPECT(mc_register_cuda_allocator(registry, NULL, gpu_context, gpu_tenant, 9, &mechanism), MC_ERR_INVALID_ARGUMENT);
    EXPECT(mc_register_cuda_allocator(registry, NULL, context, tenant, MC_CUDA_EAGER, &mechanism),
           MC_ERR_INVALID_ARGUMENT);
    SAYS("MP_TIER_DEVICE");
    EXPECT(mc_register_plugin(NULL, NULL, context, tenant, NULL, NULL, &mechanism), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_register_plugin(registry, NULL, context, tenant, (McPluginLibrary *)registry, NULL, &mechanism),
           MC_ERR_INVALID_HANDLE);
    /* A vtable is not even negotiated for a refused call. */
    MpAllocator table;
    memset(&table, 0, sizeof table);
    MpHeader header = {(uint32_t)sizeof(MpAllocator), MP_ABI_MAJOR, MP_ABI_MINOR};
    table.header = header;
    table.name = "never";
    table.device = HOST;
    table.allocate = never_allocate;
    table.release = never_release;
    table.destroy = never_destroy;
    EXPECT(mc_register_vtable(NULL, NULL, context, tenant, &table, &mechanism), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_register_vtable(registry, NULL, context, tenant, NULL, &mechanism), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_register_vtable(registry, NULL, context, tenant, &table, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_register_vtable(registry, NULL, gpu_context, tenant, &table, &mechanism), MC_ERR_INVALID_ARGUMENT);
    TRUE(slot_calls == 0);
    TRUE(mechanism == NULL);
    OK(mc_register_cpu_allocator(registry, NULL, context, tenant, MC_CPU_SYSTEM, &mechanism));

    /* Mechanisms, bindings, allocations. */
    EXPECT(mc_mechanism_select(NULL, mechanism), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_mechanism_select(registry, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_mechanism_retire(NULL, mechanism), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_mechanism_retire(registry, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_mechanism_remove(NULL, mechanism), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_mechanism_remove(registry, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_mechanism_retry_quarantined(NULL, mechanism, NULL, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_mechanism_retry_quarantined(registry, NULL, &value, &value), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_bind(NULL, HOST, &binding), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_bind(registry, NO_TIER, &binding), MC_ERR_INVALID_ARGUMENT);
    EXPECT(mc_bind(registry, HOST, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_bind_mechanism(NULL, mechanism, &binding), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_bind_mechanism(registry, NULL, &binding), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_bind_mechanism(registry, mechanism, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_binding_destroy(NULL), MC_ERR_NULL_ARGUMENT);
    OK(mc_bind(registry, HOST, &binding));
    EXPECT(mc_allocate(NULL, 64, 8, MP_ROLE_OTHER, &block), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_allocate(binding, 64, 8, MP_ROLE_OTHER, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_allocate(binding, 64, 8, 99, &block), MC_ERR_INVALID_ARGUMENT);
    EXPECT(mc_allocate(binding, 64, 3, MP_ROLE_OTHER, &block), MC_ERR_INVALID_ARGUMENT);
    OK(mc_allocate(binding, 64, 8, MP_ROLE_OTHER, &block));
    EXPECT(mc_allocation_info(NULL, &info), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_allocation_info(block, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_release(NULL, block, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_release(binding, NULL, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_allocation_drop(NULL), MC_ERR_NULL_ARGUMENT);

    /* Queues: capacity 0 is refused. */
    EXPECT(mc_queue_create(HOST, 4, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_queue_create(NO_TIER, 4, &queue), MC_ERR_INVALID_ARGUMENT);
    EXPECT(mc_queue_create(HOST, 0, &queue), MC_ERR_INVALID_ARGUMENT);
    SAYS("capacity 0");
    EXPECT(mc_plugin_queue_create(NULL, 4, &queue), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_plugin_queue_create(mechanism, 4, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_plugin_queue_create(mechanism, 0, &queue), MC_ERR_INVALID_ARGUMENT);
    EXPECT(mc_plugin_queue_create(mechanism, 4, &queue), MC_ERR_UNSUPPORTED);
    SAYS("mc_queue_create");
    OK(mc_queue_create(HOST, 1, &queue));
    EXPECT(mc_release_deferred(NULL, block, queue), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_release_deferred(binding, NULL, queue), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_release_deferred(binding, block, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_queue_poll(NULL, &ran), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_queue_destroy(NULL), MC_ERR_NULL_ARGUMENT);

    /* Capabilities. */
    EXPECT(mc_virtual_granularity(NULL, &value), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_virtual_granularity(binding, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_virtual_commit(NULL, block, 0, 4096, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_virtual_commit(binding, NULL, 0, 4096, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_virtual_decommit(NULL, block, 0, 4096, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_virtual_decommit(binding, NULL, 0, 4096, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_virtual_committed_bytes(binding, block, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_virtual_committed_bytes(NULL, block, &value), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_shared_granularity(NULL, &value), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_shared_granularity(binding, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_backing_create(NULL, 4096, &backing), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_backing_create(binding, 4096, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_backing_destroy(NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_shared_map(NULL, backing, block, 0, 4096, 0, MC_ACCESS_READ_ONLY), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_shared_map(binding, NULL, block, 0, 4096, 0, MC_ACCESS_READ_ONLY), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_shared_unmap(NULL, block, 0, 4096, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_shared_unmap(binding, NULL, 0, 4096, NULL), MC_ERR_NULL_ARGUMENT);

    /* Plugins, device loss, snapshots. */
    EXPECT(mc_plugin_load(NULL, &library), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_plugin_load("/nonexistent/plugin.so", NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_plugin_load("/nonexistent/plugin.so", &library), MC_ERR_PLUGIN);
    EXPECT(mc_plugin_tally(NULL, &tallies), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_plugin_unload(NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_invalidate_device(NULL, HOST, NULL, &invalidation), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_invalidate_device(registry, NO_TIER, NULL, &invalidation), MC_ERR_INVALID_ARGUMENT);
    EXPECT(mc_confirm_terminated(NULL, context, &termination), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_confirm_terminated(registry, NULL, &termination), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_snapshot_json(NULL, NULL, buffer, sizeof buffer, &length), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_snapshot_json(registry, NULL, buffer, sizeof buffer, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_snapshot_json(registry, (McGovernor *)registry, buffer, sizeof buffer, &length), MC_ERR_INVALID_HANDLE);

    /* None of the refused calls changed anything: the binding still allocates. */
    OK(mc_allocate(binding, 64, 8, MP_ROLE_OTHER, &out_block));
    OK(mc_release(binding, out_block, NULL));
    OK(mc_release_deferred(binding, block, queue));
    OK(mc_queue_poll(queue, &ran));
    TRUE(ran == 1);
    OK(mc_queue_destroy(queue));
    (void)out_mechanism, (void)out_binding, (void)out_queue;

    /* mc_registry_destroy refuses while mechanism, context or authority handles live. */
    OK(mc_binding_destroy(binding));
    EXPECT(mc_registry_destroy(registry), MC_ERR_STATE);
    SAYS("1 mechanism, 2 context and 2 authority handles");
    SAYS("mc_mechanism_remove");
    OK(mc_mechanism_retire(registry, mechanism));
    OK(mc_mechanism_remove(registry, mechanism));
    OK(mc_context_remove(registry, context));
    OK(mc_context_remove(registry, gpu_context));
    OK(mc_authority_remove(registry, tenant));
    EXPECT(mc_registry_destroy(registry), MC_ERR_STATE);
    SAYS("0 mechanism, 0 context and 1 authority handles");
    OK(mc_authority_remove(registry, gpu_tenant));
    OK(mc_registry_destroy(registry));
    EXPECT(mc_registry_destroy(registry), MC_ERR_STALE_HANDLE);
    OK(mc_governor_destroy(governor));
    TRUE(destroyed == 0 && slot_calls == 0);
}

static void registrations_refused_by_the_registry_keep_the_user_pointer(void) {
    int user = 1;
    McRegistry *registry = NULL, *other = NULL;
    McContext *context = NULL, *theirs = NULL;
    McAuthority *tenant = NULL;
    McMechanism *mechanism = NULL;
    OK(mc_registry_create(&registry));
    OK(mc_registry_create(&other));
    OK(mc_context_register(registry, HOST, &user, on_destroy, &context));
    OK(mc_authority_register(registry, HOST, &user, on_destroy, &tenant));
    OK(mc_context_register(other, HOST, NULL, NULL, &theirs));
    /* Handles of another registry are foreign, and nothing is registered. */
    EXPECT(mc_register_cpu_allocator(registry, NULL, theirs, tenant, MC_CPU_SYSTEM, &mechanism), MC_ERR_FOREIGN);
    EXPECT(mc_context_remove(other, context), MC_ERR_FOREIGN);
    EXPECT(mc_confirm_terminated(other, context, NULL), MC_ERR_FOREIGN);
    /* A live context cannot be confirmed terminated; the advice names C functions. */
    EXPECT(mc_confirm_terminated(registry, context, NULL), MC_ERR_STATE);
    SAYS("mc_invalidate_device");
    SAYS("mc_confirm_terminated");
    /* No selection on a device: the advice is mc_mechanism_select. */
    McBinding *binding = NULL;
    EXPECT(mc_bind(registry, GPU, &binding), MC_ERR_STATE);
    SAYS("mc_mechanism_select");
    /* A registry that is being destroyed registers nothing more, and keeps the pointer. */
    OK(mc_context_remove(other, theirs));
    OK(mc_registry_destroy(other));
    EXPECT(mc_context_register(other, HOST, &user, on_destroy, &theirs), MC_ERR_STALE_HANDLE);
    TRUE(destroyed == 0);
    OK(mc_context_remove(registry, context));
    OK(mc_authority_remove(registry, tenant));
    OK(mc_registry_destroy(registry));
    TRUE(destroyed == 2); /* the two that were registered, once each */
    destroyed = 0;
}

static void a_reclaim_holder_in_c_frees_memory_when_the_governor_asks(void) {
    const uint64_t KIB = 1024;
    McRegistry *registry = NULL;
    McGovernor *governor = NULL;
    McContext *context = NULL;
    McAuthority *tenant = NULL;
    McMechanism *mechanism = NULL;
    McBinding *binding = NULL;
    McAllocation *block = NULL, *more = NULL;
    McReclaimHolder *holder = NULL;
    struct Cache cache = {0};
    OK(mc_registry_create(&registry));
    OK(mc_governor_create(&governor));
    OK(mc_context_register(registry, HOST, NULL, NULL, &context));
    OK(mc_authority_register(registry, HOST, NULL, NULL, &tenant));
    OK(mc_governor_set_device_limit(governor, HOST, 256 * KIB));
    OK(mc_governor_open_account(governor, tenant, UINT64_MAX, "holder-tenant"));
    EXPECT(mc_governor_open_account(governor, tenant, UINT64_MAX, "again"), MC_ERR_INVALID_ARGUMENT);
    SAYS("mc_governor_set_quota");
    OK(mc_register_cpu_allocator(registry, governor, context, tenant, MC_CPU_SYSTEM, &mechanism));
    OK(mc_bind(registry, HOST, &binding));

    /* The cache holds 192 KiB; 128 KiB more does not fit the 256 KiB limit. */
    cache.binding = binding;
    cache.bytes = 192 * KIB;
    OK(mc_allocate(binding, cache.bytes, 64, MP_ROLE_KV_CACHE, &cache.block));
    EXPECT(mc_allocate(binding, 128 * KIB, 64, MP_ROLE_ACTIVATIONS, &block), MC_ERR_ADMISSION_REFUSED);
    SAYS("mc_governor_set_device_limit");
    SAYS("mc_governor_register_holder");
    OK(mc_governor_register_holder(governor, HOST, 10, "kv-cache", cache_reclaim, cache_reclaimable, &cache,
                                   cache_destroy, &holder));
    /* With the default policy the holder is named, not asked. */
    EXPECT(mc_allocate(binding, 128 * KIB, 64, MP_ROLE_ACTIVATIONS, &block), MC_ERR_ADMISSION_REFUSED);
    SAYS("kv-cache");
    SAYS("mc_governor_set_policy");
    TRUE(cache.asked == 0);
    /* A policy that reclaims asks it; it releases its block from inside the call. */
    OK(mc_governor_set_policy(governor, HOST, MC_POLICY_RECLAIM_THEN_FAIL));
    OK(mc_allocate(binding, 128 * KIB, 64, MP_ROLE_ACTIVATIONS, &block));
    TRUE(cache.asked == 1 && cache.block == NULL);
    TRUE(cache.last_request > 0 && cache.last_request <= 128 * KIB && cache.last_role == MP_ROLE_ACTIVATIONS);
    /* Nothing left to give: refused after asking once more. */
    EXPECT(mc_allocate(binding, 192 * KIB, 64, MP_ROLE_ACTIVATIONS, &more), MC_ERR_ADMISSION_REFUSED);
    TRUE(cache.asked == 2);
    OK(mc_governor_unregister_holder(holder));
    EXPECT(mc_governor_unregister_holder(holder), MC_ERR_STALE_HANDLE);
    TRUE(cache.destroyed == 1);
    EXPECT(mc_allocate(binding, 192 * KIB, 64, MP_ROLE_ACTIVATIONS, &more), MC_ERR_ADMISSION_REFUSED);
    TRUE(cache.asked == 2); /* unregistered: never asked again */
    OK(mc_release(binding, block, NULL));

    /* A quota refusal names mc_governor_set_quota. */
    OK(mc_governor_set_quota(governor, tenant, 16 * KIB));
    EXPECT(mc_allocate(binding, 32 * KIB, 64, MP_ROLE_ACTIVATIONS, &more), MC_ERR_ADMISSION_REFUSED);
    SAYS("mc_governor_set_quota");

    /* After device loss, quarantine is discharged by confirming termination. */
    OK(mc_invalidate_device(registry, HOST, "simulated", NULL));
    EXPECT(mc_mechanism_retry_quarantined(registry, mechanism, NULL, NULL), MC_ERR_STATE);
    SAYS("mc_confirm_terminated");
    OK(mc_confirm_terminated(registry, context, NULL));
    OK(mc_binding_destroy(binding));
    OK(mc_mechanism_remove(registry, mechanism));
    OK(mc_context_remove(registry, context));
    OK(mc_authority_remove(registry, tenant));
    OK(mc_registry_destroy(registry));
    OK(mc_governor_destroy(governor));
    TRUE(cache.destroyed == 1);
}

/* The refusals of the ordinary life of a binding, each message checked by check.h. */
static void every_refusal_speaks_c(void) {
    McRegistry *registry = NULL;
    McContext *context = NULL, *gpu_context = NULL;
    McAuthority *tenant = NULL, *gpu_tenant = NULL;
    McMechanism *mechanism = NULL, *cuda = NULL;
    McBinding *binding = NULL, *other = NULL;
    McAllocation *block = NULL, *second = NULL;
    McQueue *queue = NULL, *gpu_queue = NULL;
    McAllocationInfo info;
    char small[8];
    size_t length = 0;
    OK(mc_registry_create(&registry));
    OK(mc_context_register(registry, HOST, NULL, NULL, &context));
    OK(mc_authority_register(registry, HOST, NULL, NULL, &tenant));
    OK(mc_context_register(registry, GPU, NULL, NULL, &gpu_context));
    OK(mc_authority_register(registry, GPU, NULL, NULL, &gpu_tenant));
    /* Without a driver or a device: the backend's reason, in C terms. With one: a mechanism.
     * (Not under valgrind or the sanitizers, which would check the CUDA driver too.) */
    McStatus status = MC_OK;
    if (getenv("MC_TEST_NO_DRIVER") == NULL)
        status = mc_register_cuda_allocator(registry, NULL, gpu_context, gpu_tenant, MC_CUDA_EAGER, &cuda);
    checks++;
    if (status != MC_OK) {
        TRUE(status == MC_ERR_BACKEND);
        check_message(__FILE__, __LINE__, "mc_register_cuda_allocator", status);
        SAYS("mc_register_cpu_allocator");
    } else if (cuda != NULL) {
        OK(mc_mechanism_retire(registry, cuda));
        OK(mc_mechanism_remove(registry, cuda));
    }
    OK(mc_register_cpu_allocator(registry, NULL, context, tenant, MC_CPU_POOLED, &mechanism));
    OK(mc_bind(registry, HOST, &binding));
    OK(mc_bind_mechanism(registry, mechanism, &other));
    OK(mc_allocate(binding, 4096, 64, MP_ROLE_WEIGHTS, &block));
    /* Another binding of the same mechanism is not the one that allocated. */
    EXPECT(mc_release(other, block, NULL), MC_ERR_FOREIGN);
    SAYS("stays valid");
    /* Queues: full, and of another device. */
    OK(mc_queue_create(HOST, 1, &queue));
    OK(mc_queue_create(GPU, 1, &gpu_queue));
    EXPECT(mc_release_deferred(binding, block, gpu_queue), MC_ERR_QUEUE_REFUSED);
    OK(mc_allocate(binding, 4096, 64, MP_ROLE_WEIGHTS, &second));
    OK(mc_release_deferred(binding, second, queue));
    EXPECT(mc_release_deferred(binding, block, queue), MC_ERR_QUEUE_REFUSED);
    SAYS("mc_queue_poll");
    OK(mc_queue_poll(queue, NULL));
    /* A live mechanism cannot be removed; a context it uses neither. */
    EXPECT(mc_mechanism_remove(registry, mechanism), MC_ERR_STATE);
    SAYS("mc_mechanism_retire");
    EXPECT(mc_context_remove(registry, context), MC_ERR_NOT_QUIESCENT);
    SAYS("mc_mechanism_remove");
    /* A retired mechanism binds and allocates nothing new, but releases. */
    OK(mc_mechanism_retire(registry, mechanism));
    EXPECT(mc_mechanism_retire(registry, mechanism), MC_ERR_STATE);
    EXPECT(mc_mechanism_select(registry, mechanism), MC_ERR_STATE);
    EXPECT(mc_allocate(binding, 64, 8, MP_ROLE_OTHER, &second), MC_ERR_INACTIVE);
    SAYS("mc_bind");
    EXPECT(mc_bind_mechanism(registry, mechanism, &binding), MC_ERR_INACTIVE);
    EXPECT(mc_bind(registry, HOST, &binding), MC_ERR_STATE);
    EXPECT(mc_mechanism_remove(registry, mechanism), MC_ERR_NOT_QUIESCENT);
    OK(mc_allocation_info(block, &info));
    OK(mc_release(binding, block, NULL));
    EXPECT(mc_allocation_info(block, &info), MC_ERR_STALE_HANDLE);
    EXPECT(mc_snapshot_json(registry, NULL, small, sizeof small, &length), MC_ERR_BUFFER_TOO_SMALL);
    SAYS("pass a buffer of at least");
    SAYS("the buffer holds");
    /* A null buffer with a capacity (a size query) holds nothing: the message says so
     * rather than "the buffer holds 4096". */
    EXPECT(mc_snapshot_json(registry, NULL, NULL, 4096, &length), MC_ERR_BUFFER_TOO_SMALL);
    SAYS("no buffer was given (buffer is null, capacity 4096)");
    TRUE(strstr(mc_last_error_message(), "the buffer holds") == NULL);
    /* A table too short to be a vtable is refused without a call. */
    MpAllocator table;
    memset(&table, 0, sizeof table);
    MpHeader header = {MP_ALLOCATOR_SIZE_V1_0 - 8, MP_ABI_MAJOR, MP_ABI_MINOR};
    table.header = header;
    McMechanism *refused = NULL;
    EXPECT(mc_register_vtable(registry, NULL, context, tenant, &table, &refused), MC_ERR_PLUGIN);
    MpHeader wrong_major = {(uint32_t)sizeof(MpAllocator), MP_ABI_MAJOR + 1, 0};
    table.header = wrong_major;
    EXPECT(mc_register_vtable(registry, NULL, context, tenant, &table, &refused), MC_ERR_PLUGIN);
    /* A table at a misaligned address (inside a packed buffer) is refused, and the
     * message says why. */
    _Alignas(8) unsigned char packed[sizeof(MpAllocator) + 8];
    memset(packed, 0, sizeof packed);
    EXPECT(mc_register_vtable(registry, NULL, context, tenant, (const MpAllocator *)(void *)(packed + 4), &refused),
           MC_ERR_PLUGIN);
    SAYS("is not aligned to the 8 bytes an MpAllocator needs");
    TRUE(refused == NULL);
    /* Misaligned out-pointers are refused before anything happens. */
    _Alignas(8) unsigned char bytes[16];
    EXPECT(mc_allocation_info(block, (McAllocationInfo *)(void *)(bytes + 1)), MC_ERR_INVALID_ARGUMENT);
    OK(mc_queue_destroy(queue));
    OK(mc_queue_destroy(gpu_queue));
    OK(mc_binding_destroy(binding));
    OK(mc_binding_destroy(other));
    OK(mc_mechanism_remove(registry, mechanism));
    OK(mc_context_remove(registry, context));
    OK(mc_authority_remove(registry, tenant));
    OK(mc_context_remove(registry, gpu_context));
    OK(mc_authority_remove(registry, gpu_tenant));
    OK(mc_registry_destroy(registry));
}

/* An allocation is released with its handle alone, after its binding is gone. */
static void an_allocation_is_released_without_its_binding(void) {
    McRegistry *registry = NULL;
    McContext *context = NULL;
    McAuthority *tenant = NULL;
    McMechanism *mechanism = NULL;
    McBinding *binding = NULL, *other = NULL;
    McAllocation *block = NULL, *lost = NULL;
    McReleaseReport report;
    OK(mc_registry_create(&registry));
    OK(mc_context_register(registry, GPU, NULL, NULL, &context));
    OK(mc_authority_register(registry, GPU, NULL, NULL, &tenant));
    OK(mc_register_cpu_allocator(registry, NULL, context, tenant, MC_CPU_POOLED, &mechanism));
    OK(mc_bind_mechanism(registry, mechanism, &binding));
    OK(mc_bind_mechanism(registry, mechanism, &other));
    OK(mc_allocate(binding, 4096, 64, MP_ROLE_KV_CACHE, &block));
    OK(mc_allocate(binding, 4096, 64, MP_ROLE_KV_CACHE, &lost));
    OK(mc_binding_destroy(binding));
    /* Another binding of the same mechanism is still not the one that made it... */
    EXPECT(mc_release(other, block, NULL), MC_ERR_FOREIGN);
    /* ...but the handle alone releases it, through its own allocator. */
    EXPECT(mc_allocation_release(NULL, &report), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_allocation_release((McAllocation *)other, &report), MC_ERR_INVALID_HANDLE);
    OK(mc_allocation_release(block, &report));
    TRUE(report.kind == MC_RELEASE_COMPLETE);
    EXPECT(mc_allocation_release(block, &report), MC_ERR_STALE_HANDLE);
    /* A lost device: refused with no callback, and the handle stays valid. */
    OK(mc_invalidate_device(registry, GPU, "simulated", NULL));
    EXPECT(mc_allocation_release(lost, NULL), MC_ERR_DEVICE_LOST);
    OK(mc_confirm_terminated(registry, context, NULL));
    OK(mc_allocation_drop(lost));
    OK(mc_binding_destroy(other));
    OK(mc_mechanism_remove(registry, mechanism));
    OK(mc_context_remove(registry, context));
    OK(mc_authority_remove(registry, tenant));
    OK(mc_registry_destroy(registry));
}

int main(void) {
    arguments_are_checked_before_anything_happens();
    registrations_refused_by_the_registry_keep_the_user_pointer();
    a_reclaim_holder_in_c_frees_memory_when_the_governor_asks();
    every_refusal_speaks_c();
    an_allocation_is_released_without_its_binding();
    printf("c contract: %d checks passed (%d failure messages checked)\n", checks, messages_checked);
    return 0;
}
