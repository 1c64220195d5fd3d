/* Allocator kinds end to end, from C11, as a C programmer uses them (each argument:
 * system, pooled, virtual, shared, vtable, vtable-virtual or plugin:PATH (a plugin
 * library, claiming only deferred release), run in turn in one process): register it governed, bind, allocate, make the
 * memory usable the way the kind needs (nothing; commit; map a backing), write and read
 * it, release now and through a queue, tear everything down. Run under valgrind for
 * every kind by tests/programs.rs (issue 23, items 1 and 2). */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, madvise */
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"

static int destroyed;

static void on_destroy(void *user) { destroyed += *(int *)user; }

/* A C allocator handed over as a vtable: host memory from aligned_alloc, counted. */
static int vtable_live, vtable_destroyed;
static const MpDevice HOST = {MP_TIER_HOST, 2};

static MpStatus vt_allocate(void *instance, const MpRequest *request, MpBlock *out) {
    (void)instance;
    uint64_t align = request->align < 16 ? 16 : request->align;
    uint64_t bytes = (request->bytes + align - 1) / align * align;
    void *memory = aligned_alloc(align, bytes == 0 ? align : bytes);
    if (memory == NULL) return MP_ERR_OUT_OF_MEMORY;
    MpBlock block = {(uint64_t)(uintptr_t)memory, request->bytes, align, HOST, 0};
    *out = block;
    vtable_live++;
    return MP_OK;
}

static MpStatus vt_release(void *instance, const MpBlock *block, MpReleaseOutcome *outcome) {
    (void)instance;
    (void)outcome;
    free((void *)(uintptr_t)block->address);
    vtable_live--;
    return MP_OK;
}

static void vt_destroy(void *instance) {
    (void)instance;
    vtable_destroyed++;
}

/* A C allocator with MP_CAP_VIRTUAL_BACKING: blocks are PROT_NONE reservations, commit
 * makes pages readable and writable, decommit drops them (the C twin of MC_CPU_VIRTUAL,
 * to show the capability calls reach a vtable's slots). Up to 8 blocks of 64 pages. */
#define VT_BLOCKS 8
static struct {
    uint64_t address, bytes, committed; /* `committed`: a bit per page */
} vt_blocks[VT_BLOCKS];
static uint64_t vt_page;

static int vt_find(const MpBlock *block) {
    for (int i = 0; i < VT_BLOCKS; i++)
        if (vt_blocks[i].address == block->address && vt_blocks[i].bytes != 0) return i;
    return -1;
}

static MpStatus vv_allocate(void *instance, const MpRequest *request, MpBlock *out) {
    (void)instance;
    uint64_t bytes = (request->bytes + vt_page - 1) / vt_page * vt_page;
    if (bytes == 0 || bytes > 64 * vt_page || request->align > vt_page) return MP_ERR_UNSUPPORTED;
    for (int i = 0; i < VT_BLOCKS; i++) {
        if (vt_blocks[i].bytes != 0) continue;
        void *memory = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (memory == MAP_FAILED) return MP_ERR_OUT_OF_MEMORY;
        vt_blocks[i].address = (uint64_t)(uintptr_t)memory;
        vt_blocks[i].bytes = bytes;
        vt_blocks[i].committed = 0;
        MpBlock block = {vt_blocks[i].address, request->bytes, vt_page, HOST, (uint64_t)i};
        *out = block;
        vtable_live++;
        return MP_OK;
    }
    return MP_ERR_OUT_OF_MEMORY;
}

static MpStatus vv_release(void *instance, const MpBlock *block, MpReleaseOutcome *outcome) {
    (void)instance, (void)outcome;
    int i = vt_find(block);
    if (i < 0) return MP_ERR_NOT_OWNED;
    munmap((void *)(uintptr_t)block->address, vt_blocks[i].bytes);
    vt_blocks[i].bytes = 0;
    vtable_live--;
    return MP_OK;
}

static MpStatus vv_range(const MpBlock *block, uint64_t offset, uint64_t length, uint64_t *bytes, int commit) {
    int i = vt_find(block);
    if (i < 0) return MP_ERR_NOT_OWNED;
    uint64_t changed = 0;
    for (uint64_t page = offset / vt_page; page < (offset + length) / vt_page; page++) {
        uint64_t bit = (uint64_t)1 << page;
        if (((vt_blocks[i].committed & bit) != 0) == commit) continue;
        void *at = (void *)(uintptr_t)(block->address + page * vt_page);
        if (!commit) madvise(at, vt_page, MADV_DONTNEED);
        if (mprotect(at, vt_page, commit ? PROT_READ | PROT_WRITE : PROT_NONE) != 0) return MP_ERR_BACKEND;
        vt_blocks[i].committed ^= bit;
        changed += vt_page;
    }
    *bytes = changed;
    return MP_OK;
}

static MpStatus vv_commit(void *instance, const MpBlock *block, uint64_t offset, uint64_t length, uint64_t *bytes) {
    (void)instance;
    return vv_range(block, offset, length, bytes, 1);
}

static MpStatus vv_decommit(void *instance, const MpBlock *block, uint64_t offset, uint64_t length, uint64_t *bytes) {
    (void)instance;
    return vv_range(block, offset, length, bytes, 0);
}

static MpStatus vv_committed(void *instance, const MpBlock *block, uint64_t *bytes) {
    (void)instance;
    int i = vt_find(block);
    if (i < 0) return MP_ERR_NOT_OWNED;
    *bytes = (uint64_t)__builtin_popcountll(vt_blocks[i].committed) * vt_page;
    return MP_OK;
}

static McPluginLibrary *library;

static McStatus register_kind(const char *kind, McRegistry *registry, McGovernor *governor, McContext *context,
                              McAuthority *tenant, MpAllocator *table, McMechanism **out) {
    if (strncmp(kind, "plugin:", 7) == 0) {
        OK(mc_plugin_load(kind + 7, &library));
        /* On this program's device, claiming deferred release only (its other
         * capabilities are bookkeeping over plain memory, which kinds.c cannot read back). */
        return mc_register_plugin(registry, governor, context, tenant, library, "index=2 claim=4 name=c-kinds", out);
    }
    if (strcmp(kind, "system") == 0) return mc_register_cpu_allocator(registry, governor, context, tenant, MC_CPU_SYSTEM, out);
    if (strcmp(kind, "pooled") == 0) return mc_register_cpu_allocator(registry, governor, context, tenant, MC_CPU_POOLED, out);
    if (strcmp(kind, "virtual") == 0) return mc_register_cpu_allocator(registry, governor, context, tenant, MC_CPU_VIRTUAL, out);
    if (strcmp(kind, "shared") == 0) return mc_register_cpu_allocator(registry, governor, context, tenant, MC_CPU_SHARED, out);
    if (strcmp(kind, "vtable") == 0) return mc_register_vtable(registry, governor, context, tenant, table, out);
    if (strcmp(kind, "vtable-virtual") == 0) {
        table->capabilities = MP_CAP_VIRTUAL_BACKING;
        table->name = "c-vtable-virtual";
        table->allocate = vv_allocate;
        table->release = vv_release;
        table->virtual_granularity = vt_page;
        table->commit = vv_commit;
        table->decommit = vv_decommit;
        table->committed_bytes = vv_committed;
        return mc_register_vtable(registry, governor, context, tenant, table, out);
    }
    fprintf(stderr, "unknown kind %s; use system, pooled, virtual, shared, vtable, vtable-virtual or plugin:PATH\n",
            kind);
    exit(2);
}

/* Writes `bytes` bytes of `pattern` at `address` and reads them back. */
static void write_and_read(uint64_t address, uint64_t bytes, unsigned char pattern) {
    unsigned char *memory = (unsigned char *)(uintptr_t)address;
    memset(memory, pattern, bytes);
    for (uint64_t i = 0; i < bytes; i += 511) TRUE(memory[i] == pattern);
    TRUE(memory[bytes - 1] == pattern);
}

static void run_kind(const char *kind) {
    int before = checks;
    destroyed = vtable_live = vtable_destroyed = 0;
    int is_vtable = strncmp(kind, "vtable", 6) == 0, is_plugin = strncmp(kind, "plugin:", 7) == 0;
    int is_virtual = strcmp(kind, "virtual") == 0 || strcmp(kind, "vtable-virtual") == 0, is_shared = strcmp(kind, "shared") == 0;
    int context_user = 1, tenant_user = 10;

    MpAllocator table;
    memset(&table, 0, sizeof table);
    MpHeader header = {(uint32_t)sizeof(MpAllocator), MP_ABI_MAJOR, MP_ABI_MINOR};
    table.header = header;
    table.instance = &vtable_live;
    table.name = "c-vtable";
    table.device = HOST;
    table.allocate = vt_allocate;
    table.release = vt_release;
    table.destroy = vt_destroy;

    McRegistry *registry = NULL;
    McGovernor *governor = NULL;
    McContext *context = NULL;
    McAuthority *tenant = NULL;
    McMechanism *mechanism = NULL;
    McBinding *binding = NULL;
    OK(mc_registry_create(&registry));
    OK(mc_governor_create(&governor));
    OK(mc_context_register(registry, HOST, &context_user, on_destroy, &context));
    OK(mc_authority_register(registry, HOST, &tenant_user, on_destroy, &tenant));
    OK(mc_governor_set_device_limit(governor, HOST, 64u << 20));
    OK(mc_governor_open_account(governor, tenant, 32u << 20, "kinds"));
    OK(register_kind(kind, registry, governor, context, tenant, &table, &mechanism));
    OK(mc_bind(registry, HOST, &binding));

    uint64_t granule = 0;
    if (is_virtual) {
        OK(mc_virtual_granularity(binding, &granule));
        EXPECT(mc_shared_granularity(binding, &granule), MC_ERR_UNSUPPORTED);
    } else if (is_shared) {
        OK(mc_shared_granularity(binding, &granule));
        EXPECT(mc_virtual_granularity(binding, &granule), MC_ERR_UNSUPPORTED);
    } else {
        EXPECT(mc_virtual_granularity(binding, &granule), MC_ERR_UNSUPPORTED);
        SAYS("virtual backing");
        EXPECT(mc_shared_granularity(binding, &granule), MC_ERR_UNSUPPORTED);
        granule = 4096;
    }
    TRUE(granule >= 4096 && (granule & (granule - 1)) == 0);
    const uint64_t bytes = 4 * granule;

    McAllocation *a = NULL, *b = NULL;
    McAllocationInfo info, info_b;
    OK(mc_allocate(binding, bytes, 64, MP_ROLE_KV_CACHE, &a));
    OK(mc_allocation_info(a, &info));
    TRUE(info.bytes == bytes && info.address % 64 == 0 && info.device.index == HOST.index);

    if (is_virtual) {
        /* Reserved, nothing committed: commit two granules, use them, decommit one. */
        uint64_t committed = 1, released = 0;
        OK(mc_virtual_committed_bytes(binding, a, &committed));
        TRUE(committed == 0);
        OK(mc_virtual_commit(binding, a, 0, 2 * granule, &committed));
        TRUE(committed == 2 * granule);
        write_and_read(info.address, 2 * granule, 0x5a);
        OK(mc_virtual_commit(binding, a, granule, granule, &committed));
        TRUE(committed == 0); /* already committed */
        OK(mc_virtual_commit(binding, a, 3 * granule, granule, NULL));
        write_and_read(info.address + 3 * granule, granule, 0x3c);
        OK(mc_virtual_decommit(binding, a, granule, granule, &released));
        TRUE(released == granule);
        OK(mc_virtual_committed_bytes(binding, a, &committed));
        TRUE(committed == 2 * granule); /* [0, g) and [3g, 4g) */
        TRUE(((unsigned char *)(uintptr_t)info.address)[0] == 0x5a); /* the rest keeps its bytes */
        /* Refused before the allocator runs: out of bounds, off the granularity. */
        EXPECT(mc_virtual_commit(binding, a, 3 * granule, 2 * granule, NULL), MC_ERR_INVALID_ARGUMENT);
        SAYS("outside");
        EXPECT(mc_virtual_commit(binding, a, 100, granule, NULL), MC_ERR_INVALID_ARGUMENT);
        SAYS("granularity");
        EXPECT(mc_virtual_commit(binding, NULL, 0, granule, NULL), MC_ERR_NULL_ARGUMENT);
        EXPECT(mc_virtual_commit(NULL, a, 0, granule, NULL), MC_ERR_NULL_ARGUMENT);
        EXPECT(mc_virtual_commit(binding, (McAllocation *)binding, 0, granule, NULL), MC_ERR_INVALID_HANDLE);
        /* A size off the granularity can never commit its last granule, and says so. */
        McAllocation *odd = NULL;
        OK(mc_allocate(binding, 100, 64, MP_ROLE_OTHER, &odd));
        EXPECT(mc_virtual_commit(binding, odd, 0, granule, NULL), MC_ERR_INVALID_ARGUMENT);
        SAYS("allocate multiples of the granularity");
        OK(mc_release(binding, odd, NULL));
    } else if (is_shared) {
        /* Reserved, nothing mapped: map one backing into two allocations. */
        McBacking *backing = NULL;
        uint64_t unmapped = 0;
        OK(mc_allocate(binding, bytes, 64, MP_ROLE_KV_CACHE, &b));
        OK(mc_allocation_info(b, &info_b));
        OK(mc_backing_create(binding, 2 * granule, &backing));
        EXPECT(mc_backing_create(binding, granule + 1, &backing), MC_ERR_INVALID_ARGUMENT);
        /* The refusal is about the backing's size, the one number given: no "range", no
         * "offset and len", no "allocation". */
        SAYS("a backing of");
        SAYS("is not a multiple of the");
        SAYS("mc_shared_granularity");
        TRUE(strstr(mc_last_error_message(), "offset") == NULL);
        EXPECT(mc_backing_create(binding, UINT64_MAX, &backing), MC_ERR_INVALID_ARGUMENT);
        SAYS("a backing of 18446744073709551615 bytes");
        OK(mc_shared_map(binding, backing, a, 0, 2 * granule, 0, MC_ACCESS_READ_WRITE));
        OK(mc_shared_map(binding, backing, b, 2 * granule, granule, granule, MC_ACCESS_READ_ONLY));
        write_and_read(info.address, 2 * granule, 0x77);
        /* b's third granule reads the backing's second granule, written through a. */
        TRUE(((unsigned char *)(uintptr_t)info_b.address)[2 * granule] == 0x77);
        EXPECT(mc_shared_map(binding, backing, a, 0, granule, 0, MC_ACCESS_READ_WRITE), MC_ERR_STATE);
        SAYS("already mapped");
        EXPECT(mc_shared_map(binding, backing, a, 2 * granule, granule, 2 * granule, MC_ACCESS_READ_WRITE),
               MC_ERR_INVALID_ARGUMENT); /* past the backing's end */
        EXPECT(mc_shared_map(binding, backing, a, 2 * granule, granule, 0, 7), MC_ERR_INVALID_ARGUMENT);
        SAYS("MC_ACCESS_READ_ONLY");
        EXPECT(mc_shared_map(binding, NULL, a, 2 * granule, granule, 0, MC_ACCESS_READ_WRITE), MC_ERR_NULL_ARGUMENT);
        /* The backing's handle can go while ranges still map it. */
        OK(mc_backing_destroy(backing));
        EXPECT(mc_backing_destroy(backing), MC_ERR_STALE_HANDLE);
        TRUE(((unsigned char *)(uintptr_t)info_b.address)[2 * granule] == 0x77);
        OK(mc_shared_unmap(binding, a, 0, 2 * granule, &unmapped));
        TRUE(unmapped == 2 * granule);
        OK(mc_shared_unmap(binding, a, 0, 2 * granule, &unmapped));
        TRUE(unmapped == 0);
    } else {
        /* Usable at once. */
        write_and_read(info.address, bytes, 0xab);
        EXPECT(mc_virtual_commit(binding, a, 0, granule, NULL), MC_ERR_UNSUPPORTED);
        EXPECT(mc_backing_create(binding, granule, NULL), MC_ERR_NULL_ARGUMENT);
        McBacking *backing = NULL;
        EXPECT(mc_backing_create(binding, granule, &backing), MC_ERR_UNSUPPORTED);
    }

    /* Release one now; hand the other to a queue the caller polls. */
    McReleaseReport report;
    OK(mc_release(binding, a, &report));
    TRUE(report.kind == MC_RELEASE_COMPLETE);
    EXPECT(mc_release(binding, a, &report), MC_ERR_STALE_HANDLE);
    if (b == NULL) OK(mc_allocate(binding, bytes, 64, MP_ROLE_WORKSPACE, &b));
    McQueue *queue = NULL;
    size_t ran = 0;
    if (is_plugin) {
        /* The plugin's own queue: ready once the plugin reports the ticket done. */
        OK(mc_plugin_queue_create(mechanism, 2, &queue));
        OK(mc_release_deferred(binding, b, queue));
        for (int polls = 0; polls < 4 && ran == 0; polls++) OK(mc_queue_poll(queue, &ran));
    } else {
        OK(mc_queue_create(HOST, 2, &queue));
        OK(mc_release_deferred(binding, b, queue));
        OK(mc_queue_poll(queue, &ran));
    }
    TRUE(ran == 1);
    OK(mc_queue_destroy(queue));

    /* Teardown in order; the user destructors run exactly once. */
    OK(mc_binding_destroy(binding));
    OK(mc_mechanism_retire(registry, mechanism));
    OK(mc_mechanism_remove(registry, mechanism));
    OK(mc_context_remove(registry, context));
    OK(mc_authority_remove(registry, tenant));
    OK(mc_registry_destroy(registry));
    OK(mc_governor_destroy(governor));
    TRUE(destroyed == 11);
    if (is_vtable) TRUE(vtable_live == 0 && vtable_destroyed == 1);
    if (is_plugin) {
        /* Nothing made through the library lives on either side: it unloads. */
        McPluginTallies tallies;
        OK(mc_plugin_tally(library, &tallies));
        TRUE(tallies.host_instances == 0 && tallies.host_allocations == 0);
        OK(mc_plugin_unload(library));
        EXPECT(mc_plugin_unload(library), MC_ERR_STALE_HANDLE);
        library = NULL;
    }
    printf("c kinds %s: %d checks passed\n", kind, checks - before);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s system|pooled|virtual|shared|vtable|vtable-virtual...\n", argv[0]);
        return 2;
    }
    vt_page = (uint64_t)sysconf(_SC_PAGESIZE);
    for (int i = 1; i < argc; i++) run_kind(argv[i]);
    printf("c kinds: %d checks passed (%d failure messages checked)\n", checks, messages_checked);
    return 0;
}
