/* Calls made while a thread exits, from C11: a C runtime's per-thread cache, kept under a
 * pthread key, gives its blocks back from the key's destructor. glibc runs key
 * destructors after the thread's thread-local destructors (Rust's and C++'s), so a call
 * made there may be the thread's first (a worker that only ever received blocks) or come
 * after the library's own thread-local state is gone. Every call must still answer
 * MC_OK (a refusal its status and message) and leave nothing behind: no memory
 * (valgrind, run by tests/programs.rs, reports no leak) and no handle cell, hazard slot
 * or message held by a thread that is gone. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "check.h"

static const MpDevice HOST = {MP_TIER_HOST, 13};

#define HELD 4
#define THREADS 12

typedef struct Cache {
    McAllocation *held[HELD];
} Cache;

static McBinding *binding;
static pthread_key_t cache_key;
static atomic_int exit_calls, exit_failures;

static void note(McStatus status, const char *call) {
    atomic_fetch_add(&exit_calls, 1);
    if (status != MC_OK) {
        fprintf(stderr, "at thread exit: %s returned %s: %s\n", call, mc_status_name(status), mc_last_error_message());
        atomic_fetch_add(&exit_failures, 1);
    }
}

/* The key's destructor: releases what the thread's cache holds (through the binding
 * and by the handle alone), then allocates and releases once more. */
static void give_back_at_exit(void *value) {
    Cache *cache = value;
    for (int i = 0; i < HELD; i++) {
        if (i % 2 == 0) {
            note(mc_release(binding, cache->held[i], NULL), "mc_release");
        } else {
            note(mc_allocation_release(cache->held[i], NULL), "mc_allocation_release");
        }
    }
    McAllocation *late = NULL;
    note(mc_allocate(binding, 256, 16, MP_ROLE_OTHER, &late), "mc_allocate");
    if (late != NULL) note(mc_release(binding, late, NULL), "mc_release");
    /* A refusal there still says why. */
    McStatus stale = mc_allocation_release(cache->held[0], NULL);
    atomic_fetch_add(&exit_calls, 1);
    if (stale != MC_ERR_STALE_HANDLE || strstr(mc_last_error_message(), "already released") == NULL) {
        fprintf(stderr, "at thread exit: a second release returned %s: \"%s\"\n", mc_status_name(stale),
                mc_last_error_message());
        atomic_fetch_add(&exit_failures, 1);
    }
    free(cache);
}

/* A worker that never calls the library: the blocks were allocated for it by the main
 * thread; its key's destructor makes its first calls. */
static void *receive(void *argument) {
    TRUE(pthread_setspecific(cache_key, argument) == 0);
    return NULL;
}

/* A worker that allocates its blocks itself, then leaves them to its key's destructor. */
static void *allocate_then_exit(void *argument) {
    Cache *cache = argument;
    for (int i = 0; i < HELD; i++) {
        McStatus status = mc_allocate(binding, 4096, 64, MP_ROLE_KV_CACHE, &cache->held[i]);
        if (status != MC_OK) {
            fprintf(stderr, "mc_allocate returned %s: %s\n", mc_status_name(status), mc_last_error_message());
            exit(1);
        }
    }
    TRUE(pthread_setspecific(cache_key, cache) == 0);
    return NULL;
}

int main(void) {
    McRegistry *registry = NULL;
    McContext *context = NULL;
    McAuthority *tenant = NULL;
    McMechanism *pool = NULL;
    TRUE(pthread_key_create(&cache_key, give_back_at_exit) == 0);
    OK(mc_registry_create(&registry));
    OK(mc_context_register(registry, HOST, NULL, NULL, &context));
    OK(mc_authority_register(registry, HOST, NULL, NULL, &tenant));
    OK(mc_register_cpu_allocator(registry, NULL, context, tenant, MC_CPU_POOLED, &pool));
    OK(mc_bind(registry, HOST, &binding));

    for (int round = 0; round < THREADS; round++) {
        Cache *cache = calloc(1, sizeof *cache);
        TRUE(cache != NULL);
        pthread_t thread;
        if (round % 2 == 0) {
            for (int i = 0; i < HELD; i++) OK(mc_allocate(binding, 4096, 64, MP_ROLE_KV_CACHE, &cache->held[i]));
            TRUE(pthread_create(&thread, NULL, receive, cache) == 0);
        } else {
            TRUE(pthread_create(&thread, NULL, allocate_then_exit, cache) == 0);
        }
        TRUE(pthread_join(thread, NULL) == 0);
    }
    TRUE(atomic_load(&exit_calls) == THREADS * (HELD + 3));
    TRUE(atomic_load(&exit_failures) == 0);

    static char json[1 << 14];
    size_t length = 0;
    OK(mc_snapshot_json(registry, NULL, json, sizeof json, &length));
    TRUE(strstr(json, "\"live_allocations\":0") != NULL);
    OK(mc_binding_destroy(binding));
    OK(mc_mechanism_retire(registry, pool));
    OK(mc_mechanism_remove(registry, pool));
    OK(mc_context_remove(registry, context));
    OK(mc_authority_remove(registry, tenant));
    OK(mc_registry_destroy(registry));
    TRUE(pthread_key_delete(cache_key) == 0);
    printf("c thread exit: %d checks passed (%d calls from key destructors)\n", checks, atomic_load(&exit_calls));
    return 0;
}
