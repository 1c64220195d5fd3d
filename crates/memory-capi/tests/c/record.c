/* Recording from C11: a governor with a device limit and quotas, two tenants on one
 * simulated device (chat on a governed pool, embed on the governed system allocator),
 * each registered through a governor handle that names a recorder
 * (mc_recorder_trace_governor), so both mechanisms are governed and recorded. Each
 * tenant serves requests on a thread of its own: chat loads weights once, then takes a
 * KV page per step (kept until the request two behind finishes) and activations;
 * embed takes a workspace per request and an output kept for four requests, and asks
 * once for more than its quota, which the governor refuses. Every request's id is its
 * thread's caller tag (mc_trace_set_caller_tag). Everything is released, the recording
 * finished and its summary checked; then every recorder function's refusals, each
 * before any effect, a recorder destroyed unfinished after it recorded, and recordings
 * whose file takes no write (/dev/full). The device limit and embed's quota the plain
 * handle set are lowered through the recording handle before the mechanisms register:
 * the recorded books and the refusal are the lowered ones.
 *
 * The workload runs on threads the program starts, not on the main thread: a thread's
 * first recorded event names the thread in the trace, through Rust's handle of the
 * current thread, which is freed when a thread exits but not for the main thread at
 * process exit (valgrind would call those 48 bytes possibly lost; docs/C-ABI.md).
 *
 *   record TRACE   writes the recording to TRACE and a recording that was never
 *                  finished (mc_recorder_destroy finishes it: LATE_PAIRS allocations and
 *                  releases of chat's account and a device-lost mark) to TRACE.unfinished
 *
 * The last lines of output give the workload's figures (tests/programs.rs compares the
 * trace with them); crates/memory-trace/traces/capi.mtrace is one such recording. */
#define _DEFAULT_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <unistd.h>

#include "check.h"

#define KIB (UINT64_C(1) << 10)
#define MIB (UINT64_C(1) << 20)

static const MpDevice GPU = {MP_TIER_HOST, 1}; /* a simulated device */

/* What one tenant did, counted as it happened. */
typedef struct {
    const char *label;
    uint64_t allocations, releases, refusals, bytes; /* bytes: asked for by the allocations */
} Tally;

/* A deterministic sequence of sizes (a linear congruential generator). */
static uint32_t next(uint32_t *state) {
    *state = *state * 1664525u + 1013904223u;
    return *state >> 8;
}

/* Calls on the workload's threads are checked here (check.h's counters belong to the
 * main thread); a failure exits with the call and its message. */
static void must(McStatus status, const char *call) {
    if (status != MC_OK) {
        fprintf(stderr, "record: %s returned %s: %s\n", call, mc_status_name(status), mc_last_error_message());
        exit(1);
    }
}

static McAllocation *take(McBinding *binding, uint64_t bytes, uint32_t role, Tally *tally) {
    McAllocation *allocation = NULL;
    McStatus status = mc_allocate(binding, bytes, 256, role, &allocation);
    if (status != MC_OK) {
        fprintf(stderr, "record: %s: mc_allocate(%llu bytes) returned %s: %s\n", tally->label,
                (unsigned long long)bytes, mc_status_name(status), mc_last_error_message());
        exit(1);
    }
    tally->allocations++;
    tally->bytes += bytes;
    return allocation;
}

static void give(McBinding *binding, McAllocation *allocation, Tally *tally) {
    McReleaseReport report;
    McStatus status = mc_release(binding, allocation, &report);
    if (status != MC_OK || report.kind != MC_RELEASE_COMPLETE) {
        fprintf(stderr, "record: %s: mc_release returned %s: %s\n", tally->label, mc_status_name(status),
                mc_last_error_message());
        exit(1);
    }
    tally->releases++;
}

/* Chat, on a thread: 1 MiB of weights (tagged 1, kept to the end), then 24 requests of
 * 2 to 5 steps; each step takes a 64 KiB KV page (kept until the request two behind
 * finishes) and activations of 16 to 128 KiB (given back at once). */
#define CHAT_REQUESTS 24
#define MAX_STEPS 5
typedef struct {
    McBinding *binding;
    Tally tally;
    uint64_t tag_seen; /* the caller tag this thread read back */
} Tenant;

static void *serve_chat(void *argument) {
    Tenant *chat = argument;
    McBinding *binding = chat->binding;
    Tally *tally = &chat->tally;
    uint32_t state = 7;
    must(mc_trace_set_caller_tag(1), "mc_trace_set_caller_tag");
    McAllocation *weights = take(binding, 1 * MIB, MP_ROLE_WEIGHTS, tally);
    McAllocation *pages[CHAT_REQUESTS][MAX_STEPS] = {{NULL}};
    int steps_of[CHAT_REQUESTS] = {0};
    for (int request = 0; request < CHAT_REQUESTS; request++) {
        must(mc_trace_set_caller_tag(1000 + (uint64_t)request), "mc_trace_set_caller_tag");
        steps_of[request] = 2 + request % 4;
        for (int step = 0; step < steps_of[request]; step++) {
            pages[request][step] = take(binding, 64 * KIB, MP_ROLE_KV_CACHE, tally);
            McAllocation *activations = take(binding, 16 * KIB * (1 + next(&state) % 8), MP_ROLE_ACTIVATIONS, tally);
            give(binding, activations, tally);
        }
        if (request >= 2) {
            for (int step = 0; step < steps_of[request - 2]; step++) give(binding, pages[request - 2][step], tally);
        }
    }
    for (int request = CHAT_REQUESTS - 2; request < CHAT_REQUESTS; request++) {
        for (int step = 0; step < steps_of[request]; step++) give(binding, pages[request][step], tally);
    }
    must(mc_trace_caller_tag(&chat->tag_seen), "mc_trace_caller_tag");
    must(mc_trace_set_caller_tag(0), "mc_trace_set_caller_tag");
    give(binding, weights, tally);
    return NULL;
}

/* Embed, on a second thread: 24 requests, each a workspace of 4 to 128 KiB (given back
 * at once) and an 8 KiB output kept for four requests; request 12 first asks for 2 MiB
 * of workspace, past the tenant's 1 MiB quota. */
#define EMBED_REQUESTS 24
#define KEPT 4
typedef struct {
    McBinding *binding;
    Tally tally;
    McStatus refused;      /* what the 2 MiB request returned */
    char message[512];     /* and its message (mc_last_error_message is per thread) */
    uint64_t tag_seen;     /* the caller tag this thread read back */
} Embed;

static void *serve_embed(void *argument) {
    Embed *embed = argument;
    uint32_t state = 11;
    McAllocation *outputs[KEPT] = {NULL};
    for (int request = 0; request < EMBED_REQUESTS; request++) {
        must(mc_trace_set_caller_tag(2000 + (uint64_t)request), "mc_trace_set_caller_tag");
        if (request == 12) {
            McAllocation *too_large = NULL;
            embed->refused = mc_allocate(embed->binding, 2 * MIB, 256, MP_ROLE_WORKSPACE, &too_large);
            snprintf(embed->message, sizeof embed->message, "%s", mc_last_error_message());
            if (embed->refused == MC_ERR_ADMISSION_REFUSED) embed->tally.refusals++;
        }
        McAllocation *workspace = take(embed->binding, 4 * KIB * (1 + next(&state) % 32), MP_ROLE_WORKSPACE, &embed->tally);
        give(embed->binding, workspace, &embed->tally);
        if (outputs[request % KEPT] != NULL) give(embed->binding, outputs[request % KEPT], &embed->tally);
        outputs[request % KEPT] = take(embed->binding, 8 * KIB, MP_ROLE_OTHER, &embed->tally);
    }
    must(mc_trace_caller_tag(&embed->tag_seen), "mc_trace_caller_tag");
    for (int i = 0; i < KEPT; i++) give(embed->binding, outputs[i], &embed->tally);
    return NULL;
}

/* On a thread, through a recorder that is destroyed unfinished: LATE_PAIRS blocks of
 * 4 KiB of chat's account, each given back at once, tagged 3000 + its number. */
#define LATE_PAIRS 3
static void *serve_late(void *argument) {
    Tenant *late = argument;
    for (uint64_t pair = 0; pair < LATE_PAIRS; pair++) {
        must(mc_trace_set_caller_tag(3000 + pair), "mc_trace_set_caller_tag");
        give(late->binding, take(late->binding, 4 * KIB, MP_ROLE_OTHER, &late->tally), &late->tally);
    }
    return NULL;
}

/* The quota of the account labelled `label` in a snapshot's JSON (an account's fields
 * are in name order: its label comes before its quota); -1 when not found. */
static long long account_quota(const char *json, const char *label) {
    char key[64];
    snprintf(key, sizeof key, "\"label\":\"%s\"", label);
    const char *account = strstr(json, key);
    const char *quota = account == NULL ? NULL : strstr(account, "\"quota\":");
    return quota == NULL ? -1 : strtoll(quota + strlen("\"quota\":"), NULL, 10);
}

static long file_size(const char *path) {
    FILE *file = fopen(path, "rb");
    if (file == NULL) return -1;
    fseek(file, 0, SEEK_END);
    long size = ftell(file);
    fclose(file);
    return size;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: record TRACE\n");
        return 2;
    }
    const char *path = argv[1];
    char unfinished[4096];
    snprintf(unfinished, sizeof unfinished, "%s.unfinished", path);

    McRegistry *registry = NULL;
    McGovernor *governor = NULL, *recorded = NULL;
    McContext *context = NULL;
    McAuthority *chat_tenant = NULL, *embed_tenant = NULL;
    McMechanism *chat_pool = NULL, *embed_system = NULL;
    McRecorder *recorder = NULL;
    OK(mc_registry_create(&registry));
    OK(mc_governor_create(&governor));
    OK(mc_context_register(registry, GPU, NULL, NULL, &context));
    OK(mc_authority_register(registry, GPU, NULL, NULL, &chat_tenant));
    OK(mc_authority_register(registry, GPU, NULL, NULL, &embed_tenant));
    OK(mc_governor_set_device_limit(governor, GPU, 16 * MIB));
    OK(mc_governor_open_account(governor, chat_tenant, 4 * MIB, "chat"));
    OK(mc_governor_open_account(governor, embed_tenant, 3 * MIB, "embed"));

    /* Record: a second handle of the governor's books that names the recorder; both
     * mechanisms are registered through it. */
    OK(mc_recorder_create(path, &recorder));
    OK(mc_recorder_trace_governor(recorder, governor, &recorded));
    /* Limits and quotas set through either handle are the same books: the recording
     * handle lowers the device limit (16 to 8 MiB) and embed's quota (3 to 1 MiB) that the
     * plain handle set. The plain handle's snapshot shows the new quota, the trace records
     * both as the tenants' books at registration (tests/programs.rs checks 8 MiB and
     * 1 MiB), and the governor enforces the quota: embed's 2 MiB request is refused by it,
     * which 3 MiB would have let through. */
    OK(mc_governor_set_device_limit(recorded, GPU, 8 * MIB));
    OK(mc_governor_set_quota(recorded, embed_tenant, 1 * MIB));
    size_t length = 0;
    EXPECT(mc_snapshot_json(registry, governor, NULL, 0, &length), MC_ERR_BUFFER_TOO_SMALL);
    char *json = malloc(length + 1);
    TRUE(json != NULL);
    OK(mc_snapshot_json(registry, governor, json, length + 1, &length));
    TRUE(account_quota(json, "embed") == 1 * MIB);
    TRUE(account_quota(json, "chat") == 4 * MIB);
    free(json);
    OK(mc_register_cpu_allocator(registry, recorded, context, chat_tenant, MC_CPU_POOLED, &chat_pool));
    OK(mc_register_cpu_allocator(registry, recorded, context, embed_tenant, MC_CPU_SYSTEM, &embed_system));
    Tenant chat = {.tally = {.label = "chat"}};
    OK(mc_bind_mechanism(registry, chat_pool, &chat.binding));
    Embed embed = {.tally = {.label = "embed"}};
    OK(mc_bind_mechanism(registry, embed_system, &embed.binding));

    uint64_t marks = 0;
    OK(mc_recorder_mark(recorder, GPU, MC_MARK_NOTE, "serve"));
    marks++;
    pthread_t chat_thread, embed_thread;
    TRUE(pthread_create(&chat_thread, NULL, serve_chat, &chat) == 0);
    TRUE(pthread_create(&embed_thread, NULL, serve_embed, &embed) == 0);
    TRUE(pthread_join(chat_thread, NULL) == 0);
    TRUE(pthread_join(embed_thread, NULL) == 0);
    OK(mc_recorder_mark(recorder, GPU, MC_MARK_NOTE, "drain"));
    marks++;
    /* The refusal, on the embed thread: by the quota, said in C terms. */
    TRUE(embed.refused == MC_ERR_ADMISSION_REFUSED);
    TRUE(strstr(embed.message, "quota") != NULL && strstr(embed.message, "mc_governor_set_quota") != NULL);
    TRUE(strstr(embed.message, "::") == NULL && strstr(embed.message, "Governor") == NULL);
    /* Each thread's caller tag is its own: the main thread never set one. */
    TRUE(chat.tag_seen == 1000 + CHAT_REQUESTS - 1);
    TRUE(embed.tag_seen == 2000 + EMBED_REQUESTS - 1);
    uint64_t tag = 99;
    OK(mc_trace_caller_tag(&tag));
    TRUE(tag == 0);

    McRecordingSummary summary;
    OK(mc_recorder_finish(recorder, &summary));
    uint64_t allocations = chat.tally.allocations + embed.tally.allocations;
    uint64_t releases = chat.tally.releases + embed.tally.releases;
    uint64_t refusals = chat.tally.refusals + embed.tally.refusals;
    TRUE(allocations == releases);
    TRUE(summary.events == allocations + releases + refusals + marks);
    TRUE(summary.dropped == 0);
    TRUE(summary.records >= 3 && (long)summary.bytes == file_size(path));

    /* Finished: once only; nothing more goes in. The recorded mechanisms keep working
     * (their events are dropped); registering through the recording handle is refused. */
    EXPECT(mc_recorder_finish(recorder, &summary), MC_ERR_STATE);
    SAYS("already finished");
    EXPECT(mc_recorder_mark(recorder, GPU, MC_MARK_NOTE, "late"), MC_ERR_STATE);
    SAYS("mc_recorder_create");
    McMechanism *late = NULL;
    EXPECT(mc_register_cpu_allocator(registry, recorded, context, chat_tenant, MC_CPU_SYSTEM, &late), MC_ERR_STATE);
    SAYS("finished");
    TRUE(late == NULL);
    McGovernor *again = NULL;
    EXPECT(mc_recorder_trace_governor(recorder, governor, &again), MC_ERR_STATE);
    TRUE(again == NULL);
    Tally late_tally = {.label = "chat, after the recording"};
    McAllocation *after = take(chat.binding, 4 * KIB, MP_ROLE_OTHER, &late_tally);
    give(chat.binding, after, &late_tally);

    /* Every argument is checked before any effect: no file is created, no handle made. */
    McRecorder *none = NULL;
    char refused_path[4096];
    snprintf(refused_path, sizeof refused_path, "%s.refused", path);
    unlink(refused_path);
    EXPECT(mc_recorder_create(NULL, &none), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_recorder_create(refused_path, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_recorder_create(refused_path, (McRecorder **)((uintptr_t)&none + 1)), MC_ERR_INVALID_ARGUMENT);
    TRUE(access(refused_path, F_OK) != 0);
    EXPECT(mc_recorder_create("", &none), MC_ERR_INVALID_ARGUMENT);
    SAYS("path is empty");
    EXPECT(mc_recorder_create("/nonexistent-directory/trace.mtrace", &none), MC_ERR_BACKEND);
    SAYS("cannot create the trace file");
    TRUE(none == NULL);
    EXPECT(mc_recorder_trace_governor(NULL, governor, &again), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_recorder_trace_governor(recorder, NULL, &again), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_recorder_trace_governor(recorder, governor, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_recorder_trace_governor((McRecorder *)governor, governor, &again), MC_ERR_INVALID_HANDLE);
    SAYS("governor handle");
    EXPECT(mc_recorder_trace_governor(recorder, (McGovernor *)recorder, &again), MC_ERR_INVALID_HANDLE);
    SAYS("recorder handle");
    EXPECT(mc_recorder_finish(NULL, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_recorder_finish((McRecorder *)registry, NULL), MC_ERR_INVALID_HANDLE);
    EXPECT(mc_recorder_mark(NULL, GPU, MC_MARK_NOTE, NULL), MC_ERR_NULL_ARGUMENT);
    EXPECT(mc_trace_caller_tag(NULL), MC_ERR_NULL_ARGUMENT);

    /* A recorder that was never finished: destroy finishes it (a whole trace); a running
     * recorder refuses a governor handle that already records, and unknown
     * marks and tiers. */
    McRecorder *second = NULL;
    McGovernor *second_recorded = NULL;
    OK(mc_recorder_create(unfinished, &second));
    EXPECT(mc_recorder_trace_governor(second, recorded, &second_recorded), MC_ERR_INVALID_ARGUMENT);
    SAYS("already records to");
    TRUE(second_recorded == NULL);
    EXPECT(mc_recorder_mark(second, GPU, 7, "what"), MC_ERR_INVALID_ARGUMENT);
    SAYS("MC_MARK_NOTE");
    MpDevice unknown_tier = {99, 0};
    EXPECT(mc_recorder_mark(second, unknown_tier, MC_MARK_NOTE, NULL), MC_ERR_INVALID_ARGUMENT);
    OK(mc_recorder_trace_governor(second, governor, &second_recorded));
    /* It records (a system allocator of chat's account, on a thread of its own, and a
     * device-lost mark), and is destroyed unfinished: the destroy writes the whole trace,
     * every event and the end record (tests/programs.rs reads it back). */
    McMechanism *late_system = NULL;
    OK(mc_register_cpu_allocator(registry, second_recorded, context, chat_tenant, MC_CPU_SYSTEM, &late_system));
    Tenant late_run = {.tally = {.label = "chat, recorded unfinished"}};
    OK(mc_bind_mechanism(registry, late_system, &late_run.binding));
    pthread_t late_thread;
    TRUE(pthread_create(&late_thread, NULL, serve_late, &late_run) == 0);
    TRUE(pthread_join(late_thread, NULL) == 0);
    TRUE(late_run.tally.allocations == LATE_PAIRS && late_run.tally.releases == LATE_PAIRS);
    OK(mc_recorder_mark(second, GPU, MC_MARK_DEVICE_LOST, "lost"));
    OK(mc_recorder_destroy(second));
    EXPECT(mc_recorder_destroy(second), MC_ERR_STALE_HANDLE);
    EXPECT(mc_recorder_finish(second, NULL), MC_ERR_STALE_HANDLE);
    TRUE(file_size(unfinished) > 0);
    /* Its mechanism keeps working, unrecorded; its recording handle takes no registration. */
    give(late_run.binding, take(late_run.binding, 4 * KIB, MP_ROLE_OTHER, &late_run.tally), &late_run.tally);
    late = NULL;
    EXPECT(mc_register_cpu_allocator(registry, second_recorded, context, chat_tenant, MC_CPU_SYSTEM, &late),
           MC_ERR_STATE);
    TRUE(late == NULL);
    OK(mc_binding_destroy(late_run.binding));
    OK(mc_mechanism_retire(registry, late_system));
    OK(mc_mechanism_remove(registry, late_system));
    OK(mc_governor_destroy(second_recorded));

    /* A recording whose file takes no write (every write to /dev/full fails with ENOSPC,
     * as root too): finish is MC_ERR_BACKEND with the system's reason, and the recording
     * is finished either way; a destroy that has to finish such a recording is
     * MC_ERR_BACKEND and leaves the handle for a second destroy. */
    McRecorder *full = NULL;
    McRecordingSummary unwritten = {0};
    OK(mc_recorder_create("/dev/full", &full));
    OK(mc_recorder_mark(full, GPU, MC_MARK_DEVICE_LOST, "nowhere"));
    EXPECT(mc_recorder_finish(full, &unwritten), MC_ERR_BACKEND);
    SAYS("No space left on device");
    SAYS("the file is readable up to there");
    TRUE(unwritten.events == 0 && unwritten.bytes == 0);
    EXPECT(mc_recorder_finish(full, NULL), MC_ERR_STATE);
    SAYS("already finished");
    OK(mc_recorder_destroy(full));
    OK(mc_recorder_create("/dev/full", &full));
    EXPECT(mc_recorder_destroy(full), MC_ERR_BACKEND);
    SAYS("/dev/full");
    OK(mc_recorder_destroy(full));
    EXPECT(mc_recorder_destroy(full), MC_ERR_STALE_HANDLE);

    /* Teardown: every handle goes. */
    OK(mc_binding_destroy(chat.binding));
    OK(mc_binding_destroy(embed.binding));
    OK(mc_mechanism_retire(registry, chat_pool));
    OK(mc_mechanism_retire(registry, embed_system));
    OK(mc_mechanism_remove(registry, chat_pool));
    OK(mc_mechanism_remove(registry, embed_system));
    OK(mc_context_remove(registry, context));
    OK(mc_authority_remove(registry, chat_tenant));
    OK(mc_authority_remove(registry, embed_tenant));
    OK(mc_registry_destroy(registry));
    OK(mc_governor_destroy(recorded));
    OK(mc_governor_destroy(governor));
    OK(mc_recorder_destroy(recorder));

    /* The workload, for the test that reads the trace. */
    printf("c record tenant chat: allocations %llu releases %llu refusals %llu bytes %llu\n",
           (unsigned long long)chat.tally.allocations, (unsigned long long)chat.tally.releases,
           (unsigned long long)chat.tally.refusals, (unsigned long long)chat.tally.bytes);
    printf("c record tenant embed: allocations %llu releases %llu refusals %llu bytes %llu\n",
           (unsigned long long)embed.tally.allocations, (unsigned long long)embed.tally.releases,
           (unsigned long long)embed.tally.refusals, (unsigned long long)embed.tally.bytes);
    printf("c record: marks %llu events %llu bytes %llu\n", (unsigned long long)marks,
           (unsigned long long)summary.events, (unsigned long long)summary.bytes);
    printf("c record: %d checks passed, %d failure messages checked\n", checks, messages_checked);
    return 0;
}
