/* Threads from C11, as a C runtime's worker pool uses the API, for each allocator kind
 * given (system, pooled, virtual, shared, vtable, plugin:PATH; run in turn in one
 * process):
 *   - hand-off: producer threads allocate through one shared binding, make the memory
 *     usable (commit, map a backing), write it and exit; consumer threads started after
 *     they are gone read each block and release it (through the binding, by the handle
 *     alone, through a queue the main thread polls);
 *   - racing releases: two threads release each of a set of blocks at once, one through
 *     the binding, one by the handle alone: exactly one succeeds, the other is stale or
 *     busy;
 *   - destroyed under load: threads allocate and release through one binding while the
 *     main thread destroys it; every call is MC_OK or stale, and the blocks each thread
 *     still holds are released by their handles alone;
 *   - device loss with live handles on threads (every kind: each frees the lost blocks
 *     in forget_lost): every release is MC_ERR_DEVICE_LOST and leaves the handle valid;
 *     after mc_confirm_terminated the handles are dropped;
 * then everything is torn down: the account is back at zero, the user destructors ran
 * once, a plugin unloads. record:TRACE records a pool to TRACE and finishes, then
 * destroys, the recording while threads allocate through it and mark. Run plainly,
 * under valgrind and under the sanitizers by tests/programs.rs. PHASES=hrdl (the
 * default) picks the parts, for debugging one. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"

/* Checks made on worker threads: check.h's counters are the main thread's. */
static atomic_int thread_checks;

static void thread_fail(const char *file, int line, const char *call, McStatus got, const char *expected) {
    fprintf(stderr, "%s:%d: %s returned %s, expected %s: %s\n", file, line, call, mc_status_name(got), expected,
            mc_last_error_message());
    exit(1);
}

#define T_EXPECT(call, expected)                                                                    \
    do {                                                                                            \
        McStatus status_ = (call);                                                                  \
        atomic_fetch_add(&thread_checks, 1);                                                        \
        if (status_ != (expected)) thread_fail(__FILE__, __LINE__, #call, status_, #expected);      \
        if (status_ != MC_OK && mc_last_error_message()[0] == '\0')                                 \
            thread_fail(__FILE__, __LINE__, #call, status_, "a message");                           \
    } while (0)
#define T_OK(call) T_EXPECT(call, MC_OK)
#define T_TRUE(condition)                                                                           \
    do {                                                                                            \
        atomic_fetch_add(&thread_checks, 1);                                                        \
        if (!(condition)) {                                                                         \
            fprintf(stderr, "%s:%d: %s is false\n", __FILE__, __LINE__, #condition);                \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

static const MpDevice HOST = {MP_TIER_HOST, 3};

static atomic_int destroyed;
static void on_destroy(void *user) { atomic_fetch_add(&destroyed, *(int *)user); }

/* A thread-safe C allocator handed over as a vtable. */
static atomic_int vtable_live, vtable_destroyed;

static MpStatus vt_allocate(void *instance, const MpRequest *request, MpBlock *out) {
    (void)instance;
    uint64_t align = request->align < 16 ? 16 : request->align;
    uint64_t bytes = (request->bytes + align - 1) / align * align;
    void *memory = aligned_alloc(align, bytes == 0 ? align : bytes);
    if (memory == NULL) return MP_ERR_OUT_OF_MEMORY;
    MpBlock block = {(uint64_t)(uintptr_t)memory, request->bytes, align, HOST, 0};
    *out = block;
    atomic_fetch_add(&vtable_live, 1);
    return MP_OK;
}

static MpStatus vt_release(void *instance, const MpBlock *block, MpReleaseOutcome *outcome) {
    (void)instance, (void)outcome;
    free((void *)(uintptr_t)block->address);
    atomic_fetch_sub(&vtable_live, 1);
    return MP_OK;
}

static MpStatus vt_forget_lost(void *instance, const MpBlock *block) {
    return vt_release(instance, block, NULL);
}

static void vt_destroy(void *instance) {
    (void)instance;
    atomic_fetch_add(&vtable_destroyed, 1);
}

/* The kind under test, shared by every thread. */
static struct {
    const char *name;
    int is_virtual, is_shared, is_plugin, is_vtable;
    uint64_t granule;
    McRegistry *registry;
    McGovernor *governor;
    McContext *context;
    McAuthority *tenant;
    McMechanism *mechanism;
    McBinding *binding;
    McQueue *queue;
    McPluginLibrary *library;
} world;

#define PRODUCERS 4
#define PER_PRODUCER 24
#define CONSUMERS 3

typedef struct Slot {
    McAllocation *allocation;
    uint64_t address, usable;
    unsigned char pattern;
} Slot;

static Slot slots[PRODUCERS * PER_PRODUCER];

/* Makes `usable` bytes at the start of `allocation` readable and writable the way the
 * kind needs: nothing, a commit, or a fresh backing mapped there (its handle destroyed
 * at once: the mapping keeps it). */
static void make_usable(McAllocation *allocation, uint64_t usable) {
    if (world.is_virtual) {
        uint64_t committed = 0;
        T_OK(mc_virtual_commit(world.binding, allocation, 0, usable, &committed));
        T_TRUE(committed == usable);
    } else if (world.is_shared) {
        McBacking *backing = NULL;
        T_OK(mc_backing_create(world.binding, usable, &backing));
        T_OK(mc_shared_map(world.binding, backing, allocation, 0, usable, 0, MC_ACCESS_READ_WRITE));
        T_OK(mc_backing_destroy(backing));
    }
}

static void fill(uint64_t address, uint64_t bytes, unsigned char pattern) {
    memset((void *)(uintptr_t)address, pattern, bytes);
}

static int holds(uint64_t address, uint64_t bytes, unsigned char pattern) {
    const unsigned char *memory = (const unsigned char *)(uintptr_t)address;
    for (uint64_t i = 0; i < bytes; i += 97)
        if (memory[i] != pattern) return 0;
    return memory[bytes - 1] == pattern;
}

static void *produce(void *argument) {
    int producer = (int)(intptr_t)argument;
    for (int i = 0; i < PER_PRODUCER; i++) {
        Slot *slot = &slots[producer * PER_PRODUCER + i];
        uint64_t granules = 1 + (uint64_t)(i % 3);
        uint64_t align = (uint64_t)64 << (i % 4);
        McAllocationInfo info;
        T_OK(mc_allocate(world.binding, granules * world.granule, align, MP_ROLE_KV_CACHE, &slot->allocation));
        T_OK(mc_allocation_info(slot->allocation, &info));
        T_TRUE(info.address % align == 0 && info.bytes == granules * world.granule);
        slot->address = info.address;
        slot->usable = world.granule;
        slot->pattern = (unsigned char)(0x10 + producer * PER_PRODUCER + i);
        make_usable(slot->allocation, slot->usable);
        fill(slot->address, slot->usable, slot->pattern);
    }
    return NULL;
}

static atomic_int deferred;

static void *consume(void *argument) {
    int consumer = (int)(intptr_t)argument;
    for (int at = consumer; at < PRODUCERS * PER_PRODUCER; at += CONSUMERS) {
        Slot *slot = &slots[at];
        T_TRUE(holds(slot->address, slot->usable, slot->pattern));
        McReleaseReport report;
        switch (at % 3) {
        case 0:
            T_OK(mc_release(world.binding, slot->allocation, &report));
            T_TRUE(report.kind == MC_RELEASE_COMPLETE);
            T_EXPECT(mc_release(world.binding, slot->allocation, &report), MC_ERR_STALE_HANDLE);
            break;
        case 1:
            T_OK(mc_allocation_release(slot->allocation, &report));
            T_TRUE(report.kind == MC_RELEASE_COMPLETE);
            T_EXPECT(mc_allocation_release(slot->allocation, &report), MC_ERR_STALE_HANDLE);
            break;
        default:
            T_OK(mc_release_deferred(world.binding, slot->allocation, world.queue));
            T_EXPECT(mc_release_deferred(world.binding, slot->allocation, world.queue), MC_ERR_STALE_HANDLE);
            atomic_fetch_add(&deferred, 1);
            break;
        }
        slot->allocation = NULL;
    }
    return NULL;
}

static void hand_off(void) {
    pthread_t threads[PRODUCERS];
    for (int i = 0; i < PRODUCERS; i++) TRUE(pthread_create(&threads[i], NULL, produce, (void *)(intptr_t)i) == 0);
    for (int i = 0; i < PRODUCERS; i++) TRUE(pthread_join(threads[i], NULL) == 0);
    /* Every producer is gone; other threads take over its blocks. */
    for (int i = 0; i < CONSUMERS; i++) TRUE(pthread_create(&threads[i], NULL, consume, (void *)(intptr_t)i) == 0);
    for (int i = 0; i < CONSUMERS; i++) TRUE(pthread_join(threads[i], NULL) == 0);
    size_t ran_total = 0, ran = 0;
    for (int polls = 0; polls < 16 && ran_total < (size_t)atomic_load(&deferred); polls++) {
        OK(mc_queue_poll(world.queue, &ran));
        ran_total += ran;
    }
    TRUE(ran_total == (size_t)atomic_load(&deferred) && ran_total == PRODUCERS * PER_PRODUCER / 3);
}

/* ---- racing releases ---- */

#define RACED 48
static McAllocation *raced[RACED];
static atomic_int race_wins[RACED];
static atomic_int race_start;

static void *race(void *argument) {
    int by_handle = (int)(intptr_t)argument;
    atomic_fetch_add(&race_start, 1);
    while (atomic_load(&race_start) < 2) {
    }
    for (int i = 0; i < RACED; i++) {
        McStatus status = by_handle ? mc_allocation_release(raced[i], NULL) : mc_release(world.binding, raced[i], NULL);
        atomic_fetch_add(&thread_checks, 1);
        if (status == MC_OK) {
            atomic_fetch_add(&race_wins[i], 1);
        } else if (status != MC_ERR_STALE_HANDLE && status != MC_ERR_BUSY) {
            thread_fail(__FILE__, __LINE__, "a racing release", status, "MC_OK, stale or busy");
        }
    }
    return NULL;
}

static void racing_releases(void) {
    for (int i = 0; i < RACED; i++) {
        OK(mc_allocate(world.binding, world.granule, 64, MP_ROLE_ACTIVATIONS, &raced[i]));
        atomic_store(&race_wins[i], 0);
    }
    atomic_store(&race_start, 0);
    pthread_t threads[2];
    for (int i = 0; i < 2; i++) TRUE(pthread_create(&threads[i], NULL, race, (void *)(intptr_t)i) == 0);
    for (int i = 0; i < 2; i++) TRUE(pthread_join(threads[i], NULL) == 0);
    for (int i = 0; i < RACED; i++) {
        /* One compare-and-swap takes the handle: exactly one of the two succeeds. */
        TRUE(atomic_load(&race_wins[i]) == 1);
        EXPECT(mc_allocation_release(raced[i], NULL), MC_ERR_STALE_HANDLE);
    }
}

/* ---- a binding destroyed under load ---- */

#define HAMMERS 4
#define KEEP 6
static atomic_int pairs;

static void *hammer(void *argument) {
    (void)argument;
    McAllocation *held[KEEP] = {0};
    int next = 0, stale = 0;
    while (!stale) {
        if (held[next] != NULL) {
            McStatus status = mc_release(world.binding, held[next], NULL);
            atomic_fetch_add(&thread_checks, 1);
            if (status == MC_ERR_STALE_HANDLE) break; /* the binding went: the block is still ours */
            if (status != MC_OK) thread_fail(__FILE__, __LINE__, "mc_release", status, "MC_OK or stale");
            held[next] = NULL;
            atomic_fetch_add(&pairs, 1);
        }
        McStatus status = mc_allocate(world.binding, world.granule, 64, MP_ROLE_WORKSPACE, &held[next]);
        atomic_fetch_add(&thread_checks, 1);
        if (status == MC_ERR_STALE_HANDLE) {
            held[next] = NULL;
            stale = 1;
        } else if (status != MC_OK) {
            thread_fail(__FILE__, __LINE__, "mc_allocate", status, "MC_OK or stale");
        } else if (!world.is_virtual && !world.is_shared) {
            McAllocationInfo info;
            T_OK(mc_allocation_info(held[next], &info));
            fill(info.address, 64, 0x5c);
        }
        next = (next + 1) % KEEP;
    }
    /* The binding is gone; what this thread holds is released by the handles alone. */
    for (int i = 0; i < KEEP; i++) {
        if (held[i] == NULL) continue;
        T_EXPECT(mc_release(world.binding, held[i], NULL), MC_ERR_STALE_HANDLE);
        T_OK(mc_allocation_release(held[i], NULL));
    }
    return NULL;
}

static void destroyed_under_load(void) {
    atomic_store(&pairs, 0);
    pthread_t threads[HAMMERS];
    for (int i = 0; i < HAMMERS; i++) TRUE(pthread_create(&threads[i], NULL, hammer, NULL) == 0);
    while (atomic_load(&pairs) < 200) sched_yield();
    OK(mc_binding_destroy(world.binding));
    EXPECT(mc_binding_destroy(world.binding), MC_ERR_STALE_HANDLE);
    for (int i = 0; i < HAMMERS; i++) TRUE(pthread_join(threads[i], NULL) == 0);
    world.binding = NULL;
    OK(mc_bind(world.registry, HOST, &world.binding));
}

/* ---- device loss with live handles on threads ---- */

#define HOLDERS 3
#define HELD 8
static McAllocation *lost[HOLDERS][HELD];
static pthread_barrier_t lost_step;

static void *hold_through_loss(void *argument) {
    int holder = (int)(intptr_t)argument;
    for (int i = 0; i < HELD; i++) {
        T_OK(mc_allocate(world.binding, world.granule, 64, MP_ROLE_KV_CACHE, &lost[holder][i]));
    }
    pthread_barrier_wait(&lost_step); /* allocated */
    pthread_barrier_wait(&lost_step); /* the device is lost */
    for (int i = 0; i < HELD; i++) {
        T_EXPECT(mc_release(world.binding, lost[holder][i], NULL), MC_ERR_DEVICE_LOST);
        T_EXPECT(mc_allocation_release(lost[holder][i], NULL), MC_ERR_DEVICE_LOST);
    }
    pthread_barrier_wait(&lost_step); /* tried */
    pthread_barrier_wait(&lost_step); /* terminated */
    for (int i = 0; i < HELD; i++) T_OK(mc_allocation_drop(lost[holder][i]));
    return NULL;
}

static void device_lost_with_live_handles(void) {
    pthread_t threads[HOLDERS];
    McInvalidation invalidation;
    McTermination termination;
    TRUE(pthread_barrier_init(&lost_step, NULL, HOLDERS + 1) == 0);
    for (int i = 0; i < HOLDERS; i++)
        TRUE(pthread_create(&threads[i], NULL, hold_through_loss, (void *)(intptr_t)i) == 0);
    pthread_barrier_wait(&lost_step);
    OK(mc_invalidate_device(world.registry, HOST, "simulated loss with live handles", &invalidation));
    TRUE(invalidation.mechanisms == 1 && invalidation.contexts == 1);
    pthread_barrier_wait(&lost_step);
    pthread_barrier_wait(&lost_step);
    OK(mc_confirm_terminated(world.registry, world.context, &termination));
    TRUE(termination.lost_allocations == HOLDERS * HELD);
    TRUE(termination.lost_bytes == HOLDERS * HELD * world.granule);
    pthread_barrier_wait(&lost_step);
    for (int i = 0; i < HOLDERS; i++) TRUE(pthread_join(threads[i], NULL) == 0);
    TRUE(pthread_barrier_destroy(&lost_step) == 0);
}

/* ---- a recording finished, then destroyed, while threads allocate and mark ---- */

#define RECORDERS_THREADS 3
static struct {
    McBinding *binding;
    McRecorder *recorder;
    atomic_int stop;
    atomic_int pairs;
    atomic_int marks_ok, marks_refused;
} rec;

static void *record_pairs(void *argument) {
    int worker = (int)(intptr_t)argument;
    T_OK(mc_trace_set_caller_tag(100 + (uint64_t)worker));
    while (!atomic_load(&rec.stop)) {
        McAllocation *allocation = NULL;
        T_OK(mc_allocate(rec.binding, 4096 << (worker % 3), 64, MP_ROLE_ACTIVATIONS, &allocation));
        T_OK(mc_release(rec.binding, allocation, NULL));
        atomic_fetch_add(&rec.pairs, 1);
    }
    return NULL;
}

static void *record_marks(void *argument) {
    (void)argument;
    while (!atomic_load(&rec.stop)) {
        McStatus status = mc_recorder_mark(rec.recorder, HOST, MC_MARK_NOTE, "m");
        atomic_fetch_add(&thread_checks, 1);
        if (status == MC_OK) {
            atomic_fetch_add(&rec.marks_ok, 1);
        } else if (status == MC_ERR_STATE || status == MC_ERR_STALE_HANDLE) {
            /* finished (or destroyed): refused, never lost */
            atomic_fetch_add(&rec.marks_refused, 1);
        } else {
            thread_fail(__FILE__, __LINE__, "mc_recorder_mark", status, "MC_OK, finished or stale");
        }
        sched_yield();
    }
    return NULL;
}

static void wait_pairs(int more) {
    int until = atomic_load(&rec.pairs) + more;
    while (atomic_load(&rec.pairs) < until) sched_yield();
}

/* Threads allocate through a recorded pool and mark while the main thread finishes the
 * recording, then destroys the recorder and the recording governor handle: every call
 * answers MC_OK (a mark after the finish MC_ERR_STATE or stale); the file is whole, holds
 * every mark that answered MC_OK, and tests/programs.rs reads it back. */
static void record_while_threads_run(const char *path) {
    int before = checks, thread_before = atomic_load(&thread_checks);
    McRegistry *registry = NULL;
    McGovernor *governor = NULL, *recorded = NULL;
    McContext *context = NULL;
    McAuthority *tenant = NULL;
    McMechanism *pool = NULL;
    McRecordingSummary summary;
    memset(&rec, 0, sizeof rec);
    OK(mc_registry_create(&registry));
    OK(mc_governor_create(&governor));
    OK(mc_context_register(registry, HOST, NULL, NULL, &context));
    OK(mc_authority_register(registry, HOST, NULL, NULL, &tenant));
    OK(mc_governor_set_device_limit(governor, HOST, 64u << 20));
    OK(mc_governor_open_account(governor, tenant, 32u << 20, "threads"));
    OK(mc_recorder_create(path, &rec.recorder));
    OK(mc_recorder_trace_governor(rec.recorder, governor, &recorded));
    OK(mc_register_cpu_allocator(registry, recorded, context, tenant, MC_CPU_POOLED, &pool));
    OK(mc_bind(registry, HOST, &rec.binding));
    OK(mc_recorder_mark(rec.recorder, HOST, MC_MARK_NOTE, "m"));
    atomic_fetch_add(&rec.marks_ok, 1);

    pthread_t threads[RECORDERS_THREADS + 1];
    for (int i = 0; i < RECORDERS_THREADS; i++)
        TRUE(pthread_create(&threads[i], NULL, record_pairs, (void *)(intptr_t)i) == 0);
    TRUE(pthread_create(&threads[RECORDERS_THREADS], NULL, record_marks, NULL) == 0);
    wait_pairs(300);
    OK(mc_recorder_finish(rec.recorder, &summary));
    EXPECT(mc_recorder_finish(rec.recorder, NULL), MC_ERR_STATE);
    wait_pairs(100); /* the pool keeps working, unrecorded */
    OK(mc_recorder_destroy(rec.recorder));
    OK(mc_governor_destroy(recorded));
    wait_pairs(100);
    atomic_store(&rec.stop, 1);
    for (int i = 0; i <= RECORDERS_THREADS; i++) TRUE(pthread_join(threads[i], NULL) == 0);

    OK(mc_binding_destroy(rec.binding));
    OK(mc_mechanism_retire(registry, pool));
    OK(mc_mechanism_remove(registry, pool));
    OK(mc_context_remove(registry, context));
    OK(mc_authority_remove(registry, tenant));
    OK(mc_registry_destroy(registry));
    OK(mc_governor_destroy(governor));
    printf("c threads record: marks %d refused %d events %llu dropped %llu pairs %d\n", atomic_load(&rec.marks_ok),
           atomic_load(&rec.marks_refused), (unsigned long long)summary.events, (unsigned long long)summary.dropped,
           atomic_load(&rec.pairs));
    printf("c threads record:%s: %d checks passed (%d on worker threads)\n", path, checks - before,
           atomic_load(&thread_checks) - thread_before);
}

/* ---- one kind ---- */

static McStatus register_kind(MpAllocator *table) {
    const char *kind = world.name;
    if (world.is_plugin) {
        OK(mc_plugin_load(kind + 7, &world.library));
        return mc_register_plugin(world.registry, world.governor, world.context, world.tenant, world.library,
                                  "index=3 claim=4 name=c-threads", &world.mechanism);
    }
    McCpuAllocator cpu = strcmp(kind, "system") == 0   ? MC_CPU_SYSTEM
                         : strcmp(kind, "pooled") == 0 ? MC_CPU_POOLED
                         : world.is_virtual            ? MC_CPU_VIRTUAL
                                                       : MC_CPU_SHARED;
    if (world.is_vtable) {
        return mc_register_vtable(world.registry, world.governor, world.context, world.tenant, table,
                                  &world.mechanism);
    }
    if (strcmp(kind, "system") != 0 && strcmp(kind, "pooled") != 0 && !world.is_virtual && !world.is_shared) {
        fprintf(stderr, "unknown kind %s; use system, pooled, virtual, shared, vtable or plugin:PATH\n", kind);
        exit(2);
    }
    return mc_register_cpu_allocator(world.registry, world.governor, world.context, world.tenant, cpu,
                                     &world.mechanism);
}

/* The bytes charged to the tenant's account right now, from a snapshot; -1 when not found. */
static long long account_used(void) {
    static char json[1 << 16];
    size_t length = 0;
    OK(mc_snapshot_json(world.registry, world.governor, json, sizeof json, &length));
    const char *account = strstr(json, "\"label\":\"threads\"");
    const char *used = account == NULL ? NULL : strstr(account, "\"current\":");
    return used == NULL ? -1 : strtoll(used + strlen("\"current\":"), NULL, 10);
}

static void run_kind(const char *kind) {
    int before = checks, thread_before = atomic_load(&thread_checks);
    memset(&world, 0, sizeof world);
    world.name = kind;
    world.is_plugin = strncmp(kind, "plugin:", 7) == 0;
    world.is_vtable = strcmp(kind, "vtable") == 0;
    world.is_virtual = strcmp(kind, "virtual") == 0;
    world.is_shared = strcmp(kind, "shared") == 0;
    atomic_store(&destroyed, 0);
    atomic_store(&vtable_live, 0);
    atomic_store(&vtable_destroyed, 0);
    atomic_store(&deferred, 0);
    int context_user = 1, tenant_user = 10;

    MpAllocator table;
    memset(&table, 0, sizeof table);
    MpHeader header = {(uint32_t)sizeof(MpAllocator), MP_ABI_MAJOR, MP_ABI_MINOR};
    table.header = header;
    table.instance = &vtable_live;
    table.name = "c-threads-vtable";
    table.device = HOST;
    table.allocate = vt_allocate;
    table.release = vt_release;
    table.forget_lost = vt_forget_lost;
    table.destroy = vt_destroy;

    OK(mc_registry_create(&world.registry));
    OK(mc_governor_create(&world.governor));
    OK(mc_context_register(world.registry, HOST, &context_user, on_destroy, &world.context));
    OK(mc_authority_register(world.registry, HOST, &tenant_user, on_destroy, &world.tenant));
    OK(mc_governor_set_device_limit(world.governor, HOST, 256u << 20));
    OK(mc_governor_open_account(world.governor, world.tenant, 128u << 20, "threads"));
    OK(register_kind(&table));
    OK(mc_bind(world.registry, HOST, &world.binding));
    world.granule = (uint64_t)sysconf(_SC_PAGESIZE);
    if (world.is_virtual) OK(mc_virtual_granularity(world.binding, &world.granule));
    if (world.is_shared) OK(mc_shared_granularity(world.binding, &world.granule));
    if (world.is_plugin) {
        OK(mc_plugin_queue_create(world.mechanism, PRODUCERS * PER_PRODUCER, &world.queue));
    } else {
        OK(mc_queue_create(HOST, PRODUCERS * PER_PRODUCER, &world.queue));
    }

    const char *phases = getenv("PHASES") ? getenv("PHASES") : "hrdl";
    if (strchr(phases, 'h')) hand_off();
    TRUE(account_used() == 0);
    if (strchr(phases, 'r')) racing_releases();
    TRUE(account_used() == 0);
    if (strchr(phases, 'd')) destroyed_under_load();
    TRUE(account_used() == 0);
    OK(mc_queue_destroy(world.queue));
    /* A lost device's blocks are handed to forget_lost at termination: the built-in CPU
     * allocators release their host memory there, the vtable and the plugin free theirs
     * (valgrind checks that nothing is left). */
    int lose = strchr(phases, 'l') != NULL;
    if (lose) device_lost_with_live_handles();

    /* Teardown in order; the user destructors run exactly once. */
    OK(mc_binding_destroy(world.binding));
    if (!lose) OK(mc_mechanism_retire(world.registry, world.mechanism));
    OK(mc_mechanism_remove(world.registry, world.mechanism));
    OK(mc_context_remove(world.registry, world.context));
    OK(mc_authority_remove(world.registry, world.tenant));
    TRUE(account_used() == 0);
    OK(mc_registry_destroy(world.registry));
    OK(mc_governor_destroy(world.governor));
    TRUE(atomic_load(&destroyed) == 11);
    if (world.is_vtable) TRUE(atomic_load(&vtable_live) == 0 && atomic_load(&vtable_destroyed) == 1);
    if (world.is_plugin) {
        McPluginTallies tallies;
        OK(mc_plugin_tally(world.library, &tallies));
        TRUE(tallies.host_instances == 0 && tallies.host_allocations == 0 && tallies.host_suspect_blocks == 0);
        TRUE(tallies.plugin_reported == 1 && tallies.plugin.allocations == 0 && tallies.plugin.instances == 0);
        OK(mc_plugin_unload(world.library));
    }
    printf("c threads %s: %d checks passed (%d on worker threads)\n", kind, checks - before,
           atomic_load(&thread_checks) - thread_before);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s system|pooled|virtual|shared|vtable|plugin:PATH|record:TRACE...\n", argv[0]);
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "record:", 7) == 0) {
            record_while_threads_run(argv[i] + 7);
        } else {
            run_kind(argv[i]);
        }
    }
    printf("c threads: %d checks passed (%d on worker threads, %d failure messages checked)\n", checks,
           atomic_load(&thread_checks), messages_checked);
    return 0;
}
