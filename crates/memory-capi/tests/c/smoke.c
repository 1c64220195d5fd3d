/* The C API from C11: register -> bind -> allocate -> release (now and deferred) ->
 * invalidate -> confirm -> snapshot, checking every status, including the error
 * paths (null, stale, double-released, wrong-kind, made-up and foreign handles). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memory_capi.h"

static int checks;

#define EXPECT(call, expected)                                                                          \
    do {                                                                                                \
        McStatus status_ = (call);                                                                      \
        checks++;                                                                                       \
        if (status_ != (expected)) {                                                                    \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s: %s\n", __FILE__, __LINE__, #call,      \
                    mc_status_name(status_), mc_status_name(expected), mc_last_error_message());         \
            exit(1);                                                                                    \
        }                                                                                               \
    } while (0)
#define OK(call) EXPECT(call, MC_OK)
#define TRUE(condition)                                                                                 \
    do {                                                                                                \
        checks++;                                                                                       \
        if (!(condition)) {                                                                             \
            fprintf(stderr, "%s:%d: %s is false\n", __FILE__, __LINE__, #condition);                    \
            exit(1);                                                                                    \
        }                                                                                               \
    } while (0)

static int destroyed;

static void on_destroy(void *user) {
    destroyed += *(int *)user;
    free(user);
}

static int *user_value(int value) {
    int *user = malloc(sizeof *user);
    *user = value;
    return user;
}

int main(void) {
    uint32_t major = 0, minor = 0;
    OK(mc_api_version(&major, &minor));
    TRUE(major == MC_API_MAJOR);

    MpDevice device = {MP_TIER_HOST, 1};
    McRegistry *registry = NULL;
    McGovernor *governor = NULL;
    McContext *context = NULL;
    McAuthority *tenant = NULL;
    McMechanism *system = NULL;
    McBinding *binding = NULL;
    OK(mc_registry_create(&registry));
    OK(mc_governor_create(&governor));
    OK(mc_context_register(registry, device, user_value(1), on_destroy, &context));
    OK(mc_authority_register(registry, device, user_value(10), on_destroy, &tenant));
    OK(mc_governor_set_device_limit(governor, device, 1 << 20));
    OK(mc_governor_open_account(governor, tenant, 512 << 10, "tenant-a"));
    OK(mc_register_cpu_allocator(registry, governor, context, tenant, MC_CPU_SYSTEM, &system));
    OK(mc_bind(registry, device, &binding));

    /* allocate */
    McAllocation *a = NULL, *b = NULL;
    OK(mc_allocate(binding, 64 << 10, 256, MP_ROLE_KV_CACHE, &a));
    McAllocationInfo info;
    OK(mc_allocation_info(a, &info));
    TRUE(info.bytes == 64 << 10 && info.address % 256 == 0 && info.device.tier == MP_TIER_HOST && info.device.index == 1);
    memset((void *)(uintptr_t)info.address, 0xab, info.bytes); /* host memory: usable */
    OK(mc_allocate(binding, 4096, 64, MP_ROLE_WORKSPACE, &b));
    EXPECT(mc_allocate(binding, 1 << 20, 64, MP_ROLE_KV_CACHE, &a), MC_ERR_ADMISSION_REFUSED);
    TRUE(strstr(mc_last_error_message(), "quota") != NULL);
    EXPECT(mc_allocate(binding, 64, 3, MP_ROLE_OTHER, &a), MC_ERR_INVALID_ARGUMENT);
    TRUE(strstr(mc_last_error_message(), "power of two") != NULL);
    EXPECT(mc_allocate(binding, 64, 8, 99, &a), MC_ERR_INVALID_ARGUMENT);

    /* release now, then the same handle again */
    McReleaseReport report;
    OK(mc_release(binding, a, &report));
    TRUE(report.kind == MC_RELEASE_COMPLETE);
    EXPECT(mc_release(binding, a, &report), MC_ERR_STALE_HANDLE);
    TRUE(strstr(mc_last_error_message(), "already released") != NULL);
    EXPECT(mc_allocation_info(a, &info), MC_ERR_STALE_HANDLE);

    /* null, wrong-kind and made-up handles are statuses */
    EXPECT(mc_release(binding, NULL, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_allocate(NULL, 64, 8, MP_ROLE_OTHER, &a), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_allocate(binding, 64, 8, MP_ROLE_OTHER, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_release(binding, (McAllocation *)binding, NULL), MC_ERR_INVALID_HANDLE);
    EXPECT(mc_release(binding, (McAllocation *)&checks, NULL), MC_ERR_INVALID_HANDLE);
    EXPECT(mc_binding_destroy((McBinding *)registry), MC_ERR_INVALID_HANDLE);

    /* a handle from another registry is foreign, and stays valid */
    McRegistry *other = NULL;
    McContext *other_context = NULL;
    McAuthority *other_tenant = NULL;
    McMechanism *other_system = NULL;
    McBinding *other_binding = NULL;
    McAllocation *theirs = NULL;
    OK(mc_registry_create(&other));
    OK(mc_context_register(other, device, NULL, NULL, &other_context));
    OK(mc_authority_register(other, device, NULL, NULL, &other_tenant));
    OK(mc_register_cpu_allocator(other, NULL, other_context, other_tenant, MC_CPU_POOLED, &other_system));
    OK(mc_bind(other, device, &other_binding));
    OK(mc_allocate(other_binding, 128, 16, MP_ROLE_ACTIVATIONS, &theirs));
    EXPECT(mc_release(binding, theirs, NULL), MC_ERR_FOREIGN);
    EXPECT(mc_register_cpu_allocator(registry, NULL, other_context, tenant, MC_CPU_SYSTEM, &other_system), MC_ERR_FOREIGN);
    OK(mc_release(other_binding, theirs, NULL));
    OK(mc_binding_destroy(other_binding));
    OK(mc_mechanism_retire(other, other_system));
    OK(mc_mechanism_remove(other, other_system));
    OK(mc_context_remove(other, other_context));
    OK(mc_authority_remove(other, other_tenant));
    OK(mc_registry_destroy(other));
    EXPECT(mc_registry_destroy(other), MC_ERR_STALE_HANDLE);

    /* deferred release through a queue the caller polls */
    McQueue *queue = NULL;
    size_t ran = 0;
    OK(mc_queue_create(device, 4, &queue));
    OK(mc_release_deferred(binding, b, queue));
    EXPECT(mc_release_deferred(binding, b, queue), MC_ERR_STALE_HANDLE);
    OK(mc_queue_poll(queue, &ran));
    TRUE(ran == 1);
    OK(mc_queue_destroy(queue));

    /* snapshot */
    size_t length = 0;
    McAllocation *live = NULL;
    OK(mc_allocate(binding, 8192, 64, MP_ROLE_KV_CACHE, &live));
    EXPECT(mc_snapshot_json(registry, governor, NULL, 0, &length), MC_ERR_BUFFER_TOO_SMALL);
    TRUE(length > 0);
    char *json = malloc(length + 1);
    OK(mc_snapshot_json(registry, governor, json, length + 1, &length));
    TRUE(strlen(json) == length);
    TRUE(strstr(json, "\"kv-cache\"") != NULL && strstr(json, "tenant-a") != NULL);
    TRUE(strstr(json, "\"live_allocations\":1") != NULL);
    free(json);

    /* the device is lost: everything stops, nothing is freed until termination */
    McInvalidation invalidation;
    McTermination termination;
    OK(mc_invalidate_device(registry, device, "simulated ECC error", &invalidation));
    TRUE(invalidation.mechanisms == 1 && invalidation.contexts == 1);
    EXPECT(mc_release(binding, live, NULL), MC_ERR_DEVICE_LOST);
    EXPECT(mc_allocate(binding, 64, 8, MP_ROLE_OTHER, &a), MC_ERR_DEVICE_LOST);
    EXPECT(mc_bind(registry, device, &binding), MC_ERR_STATE);
    OK(mc_confirm_terminated(registry, context, &termination));
    TRUE(termination.lost_allocations == 1 && termination.lost_bytes == 8192 && !termination.already_terminated);
    OK(mc_confirm_terminated(registry, context, &termination));
    TRUE(termination.already_terminated == 1);
    EXPECT(mc_release(binding, live, NULL), MC_ERR_STALE_HANDLE);
    OK(mc_allocation_drop(live));
    json = malloc(1 << 16);
    OK(mc_snapshot_json(registry, governor, json, 1 << 16, &length));
    TRUE(strstr(json, "\"terminated\"") != NULL);
    TRUE(strstr(json, "\"lost_bytes\":8192") != NULL);
    free(json);

    /* teardown: every handle goes, and the user destructors run exactly once */
    OK(mc_binding_destroy(binding));
    EXPECT(mc_binding_destroy(binding), MC_ERR_STALE_HANDLE);
    OK(mc_mechanism_remove(registry, system));
    OK(mc_context_remove(registry, context));
    OK(mc_authority_remove(registry, tenant));
    OK(mc_registry_destroy(registry));
    OK(mc_governor_destroy(governor));
    TRUE(destroyed == 11);
    printf("c smoke: %d checks passed\n", checks);
    return 0;
}
