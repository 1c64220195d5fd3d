/* An example allocator plugin for the memory_plugin.h ABI, with a scripted fault mode.
 *
 * Host memory from posix_memalign, one allocation per block with the plugin's books in a
 * header in front of it. Every capability is implemented over plain host memory:
 * virtual backing tracks committed granules, shared mapping tracks which backing each
 * granule of a block maps, deferred release reports a ticket ready after a number of
 * polls. The configuration string (space-separated key=value) scripts the table and
 * faults, so tests can drive every negotiation path and every dishonest answer:
 *
 *   major=N minor=N size=N     the table's header (size: struct_size override)
 *   claim=N                    capability bits to claim (default: all offered)
 *   tier=N index=N name=S      the device and the name
 *   null=SLOT                  leave a slot null (allocate, release, stats, commit, ...)
 *   fault=F at=N               a scripted fault on the Nth call of its operation
 *                              (1-based; at=0: every call)
 *   status=N                   the status alloc_unknown_status answers (default 77)
 *   keep=1                     release refuses every block (MP_ERR_BACKEND): the
 *                              plugin keeps all it handed out
 *   defer_polls=N              polls before a deferred release is ready (default 1)
 *   refuse=1                   the entry point refuses the host
 *   reenter=ADDR               the entry point calls the host's void (*)(void) at ADDR
 *                              first (a plugin calling back into its host)
 *
 * Thread-safe: counters are atomics, per-block and per-instance state is under the
 * instance's mutex. A plain allocate/release pair (no fault scripted, no backing ever
 * made) takes no lock and counts no calls: it is posix_memalign/free plus the live
 * counters, the same work as the Rust system allocator it is benchmarked against.
 *
 * Built with -DEXAMPLE_NO_TALLY it exports no mp_plugin_tally, so the host's own
 * tally is all an unload can go by. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memory_plugin.h"

#define BLOCK_MAGIC 0x706c7567626c6b31ull /* "plugblk1" */
#define GRANULE 4096u
#define MAX_DEFERRED 1024

/* A table newer than the host knows: minor 1 plus two slots of a future minor. */
typedef struct FutureTable {
    MpAllocator table;
    void *future_slot_a;
    void *future_slot_b;
} FutureTable;

typedef struct Backing {
    uint64_t handle;
    uint64_t bytes;
    int dropped;
    uint64_t mapped_granules;
    struct Backing *next;
} Backing;

typedef struct Deferred {
    uint64_t ticket;
    unsigned polls_left;
} Deferred;

typedef struct Instance {
    FutureTable table;
    char name[64];
    MpDevice device;
    uint64_t offered;
    /* script */
    char fault[48];
    unsigned fault_at;
    unsigned defer_polls;
    MpStatus unknown_status;
    int keep;
    /* the last block answered honestly while a fault is scripted (under the lock):
     * what alloc_alias and alloc_overlap hand out again */
    MpBlock last_block;
    /* counters */
    /* live allocations = allocations_total - releases_total (read releases first) */
    atomic_uint_fast64_t releases_total;
    atomic_uint_fast64_t bytes;
    atomic_uint_fast64_t allocations_total;
    atomic_uint_fast64_t failures_total;
    atomic_uint alloc_calls, release_calls, commit_calls, poll_calls;
    /* set (under the lock) once a backing exists; a block release skips the lock
     * while it is clear, since there is then no backing to unmap or sweep */
    atomic_int had_backings;
    /* books under the lock */
    pthread_mutex_t lock;
    Backing *backings;
    uint64_t next_backing;
    uint64_t live_backings;
    Deferred deferred[MAX_DEFERRED];
    size_t deferred_count;
    struct Instance *next_instance;
} Instance;

/* The header in front of every block. */
typedef struct BlockHeader {
    uint64_t magic;
    Instance *owner;
    void *base;
    uint64_t bytes;
    uint8_t *committed;      /* one byte per granule, lazily allocated */
    uint64_t *mapped;        /* backing handle per granule, lazily allocated */
} BlockHeader;

/* Every live instance, for the library-wide tally. */
static pthread_mutex_t instances_lock = PTHREAD_MUTEX_INITIALIZER;
static Instance *instances;
static uint64_t live_instances;
/* What destroyed instances left behind (blocks never released): still held. */
static uint64_t orphaned_allocations, orphaned_bytes;

static void log_line(const MpHost *host, int32_t level, const char *text) {
    if (host->log != NULL) {
        host->log(host->host_data, level, text, strlen(text));
    }
}

/* The number of this call of an operation (1-based) when a fault is scripted; 0
 * otherwise, so the hot path shares no counter when there is nothing to script. */
static unsigned call_number(const Instance *self, atomic_uint *calls) {
    return self->fault[0] == '\0' ? 0 : atomic_fetch_add(calls, 1) + 1;
}

/* Whether the scripted fault `name` fires on call number `call` (1-based). */
static int faulted(const Instance *self, const char *name, unsigned call) {
    if (call == 0 || strcmp(self->fault, name) != 0) {
        return 0;
    }
    return self->fault_at == 0 || self->fault_at == call;
}

/* Blocks issued and not yet released. Releases are read first: every release follows
 * its allocation, so the total read after them is never smaller. */
static uint64_t live_allocations(Instance *self) {
    uint64_t released = atomic_load(&self->releases_total);
    return atomic_load(&self->allocations_total) - released;
}

static uint64_t granules(uint64_t bytes) {
    return (bytes + GRANULE - 1) / GRANULE;
}

static BlockHeader *header_of(const MpBlock *block) {
    BlockHeader *header = (BlockHeader *)(uintptr_t)block->tag;
    if (header == NULL || header->magic != BLOCK_MAGIC) {
        return NULL;
    }
    return header;
}

/* ---- allocation ---- */

static MpStatus plugin_allocate(void *instance, const MpRequest *request, MpBlock *out) {
    Instance *self = instance;
    unsigned call = call_number(self, &self->alloc_calls);
    if (faulted(self, "alloc_oom", call)) {
        atomic_fetch_add(&self->failures_total, 1);
        return MP_ERR_OUT_OF_MEMORY;
    }
    if (faulted(self, "alloc_alias", call) || faulted(self, "alloc_overlap", call)) {
        /* Dishonest: memory already handed out (and still live), with no block of its
         * own behind it (tag 0: release answers MP_ERR_NOT_OWNED for it). */
        pthread_mutex_lock(&self->lock);
        *out = self->last_block;
        pthread_mutex_unlock(&self->lock);
        if (strcmp(self->fault, "alloc_overlap") == 0) {
            out->address += 64;
            out->bytes = request->bytes;
            out->align = 64;
        }
        out->tag = 0;
        return MP_OK;
    }
    uint64_t align = request->align < 64 ? 64 : request->align;
    uint64_t header_room = (sizeof(BlockHeader) + align - 1) / align * align;
    uint64_t bytes = request->bytes == 0 ? 1 : request->bytes;
    void *base = NULL;
    if (posix_memalign(&base, (size_t)align, (size_t)(header_room + bytes)) != 0) {
        atomic_fetch_add(&self->failures_total, 1);
        return MP_ERR_OUT_OF_MEMORY;
    }
    uint8_t *data = (uint8_t *)base + header_room;
    BlockHeader *header = (BlockHeader *)(data - sizeof(BlockHeader));
    header->magic = BLOCK_MAGIC;
    header->owner = self;
    header->base = base;
    header->bytes = request->bytes;
    header->committed = NULL;
    header->mapped = NULL;
    out->address = (uint64_t)(uintptr_t)data;
    out->bytes = request->bytes;
    out->align = align;
    out->device = self->device;
    out->tag = (uint64_t)(uintptr_t)header;
    atomic_fetch_add(&self->bytes, request->bytes);
    atomic_fetch_add(&self->allocations_total, 1);

    if (faulted(self, "alloc_wrong_device", call)) {
        out->device.index += 1;
    } else if (faulted(self, "alloc_misaligned", call)) {
        out->address += 1;
    } else if (faulted(self, "alloc_short", call)) {
        out->bytes = request->bytes / 2;
    } else if (faulted(self, "alloc_null", call)) {
        out->address = 0;
    } else if (faulted(self, "alloc_wraps", call)) {
        /* Its bytes run past the end of the address space: [address, address + bytes)
         * wraps around to [0, request->bytes). */
        out->bytes = (0 - out->address) + request->bytes;
    } else if (faulted(self, "alloc_unknown_status", call)) {
        return self->unknown_status;
    } else if (call != 0) {
        pthread_mutex_lock(&self->lock);
        self->last_block = *out;
        pthread_mutex_unlock(&self->lock);
    }
    return MP_OK;
}

/* Unmaps a released block's granules from their backings and frees the backings the
 * host dropped that nothing maps any more (the lock must not be held). */
static void unmap_and_sweep(Instance *self, const BlockHeader *header) {
    pthread_mutex_lock(&self->lock);
    if (header->mapped != NULL) {
        for (uint64_t g = 0; g < granules(header->bytes); g++) {
            for (Backing *b = self->backings; b != NULL && header->mapped[g] != 0; b = b->next) {
                if (b->handle == header->mapped[g]) {
                    b->mapped_granules--;
                }
            }
        }
    }
    /* Backings dropped by the host and no longer mapped anywhere go now. */
    Backing **link = &self->backings;
    while (*link != NULL) {
        Backing *b = *link;
        if (b->dropped && b->mapped_granules == 0) {
            *link = b->next;
            free(b);
            self->live_backings--;
        } else {
            link = &b->next;
        }
    }
    pthread_mutex_unlock(&self->lock);
}

/* Frees a block's memory and books (the lock must not be held). */
static void free_block(Instance *self, BlockHeader *header) {
    /* No backing ever made: no granule can be mapped and nothing waits for a sweep. */
    if (atomic_load_explicit(&self->had_backings, memory_order_acquire)) {
        unmap_and_sweep(self, header);
    }
    atomic_fetch_add(&self->releases_total, 1);
    atomic_fetch_sub(&self->bytes, header->bytes);
    free(header->committed);
    free(header->mapped);
    header->magic = 0;
    free(header->base);
}

/* What a release gives back: with reserve/commit or mappings, a block is address space
 * and only committed or mapped granules count; otherwise the whole block. */
static uint64_t unmapped_on_release(Instance *self, const BlockHeader *header) {
    if ((self->table.table.capabilities & (MP_CAP_VIRTUAL_BACKING | MP_CAP_SHARED_MAPPING)) == 0) {
        return header->bytes;
    }
    uint64_t bytes = 0;
    pthread_mutex_lock(&self->lock);
    for (uint64_t g = 0; g < granules(header->bytes); g++) {
        int committed = header->committed != NULL && header->committed[g];
        int mapped = header->mapped != NULL && header->mapped[g] != 0;
        bytes += (committed || mapped) ? GRANULE : 0;
    }
    pthread_mutex_unlock(&self->lock);
    return bytes;
}

static MpStatus plugin_release(void *instance, const MpBlock *block, MpReleaseOutcome *out) {
    Instance *self = instance;
    unsigned call = call_number(self, &self->release_calls);
    BlockHeader *header = header_of(block);
    if (header == NULL || header->owner != self) {
        return MP_ERR_NOT_OWNED;
    }
    int structured = (self->table.table.capabilities & MP_CAP_STRUCTURED_RELEASE) != 0;
    if (self->keep || faulted(self, "release_fail", call)) {
        return MP_ERR_BACKEND;
    }
    if (faulted(self, "release_unknown_status", call)) {
        return 77;
    }
    if (structured) {
        memset(out, 0, sizeof *out);
        out->block = *block;
        if (faulted(self, "release_unknown_kind", call)) {
            out->kind = 9;
            return MP_OK;
        }
        if (faulted(self, "release_other_block", call)) {
            out->kind = MP_RELEASE_QUARANTINED;
            out->block.address += 4096;
            out->residual_bytes = block->bytes;
            return MP_OK;
        }
        if (faulted(self, "release_overclaim", call)) {
            out->kind = MP_RELEASE_QUARANTINED;
            out->unmapped_bytes = block->bytes;
            out->residual_bytes = block->bytes;
            return MP_OK;
        }
        if (faulted(self, "release_partial", call)) {
            out->kind = MP_RELEASE_QUARANTINED;
            out->unmapped_bytes = block->bytes / 2;
            out->residual_bytes = block->bytes - block->bytes / 2;
            return MP_OK;
        }
        if (faulted(self, "release_failed_outcome", call)) {
            out->kind = MP_RELEASE_FAILED;
            return MP_OK;
        }
        out->kind = MP_RELEASE_COMPLETE;
        out->unmapped_bytes = unmapped_on_release(self, header);
    }
    free_block(self, header);
    return MP_OK;
}

/* ---- optional slots ---- */

static MpStatus plugin_tally(void *instance, MpTally *out) {
    Instance *self = instance;
    pthread_mutex_lock(&self->lock);
    out->instances = 1;
    out->backings = self->live_backings;
    out->deferred = self->deferred_count;
    pthread_mutex_unlock(&self->lock);
    out->allocations = live_allocations(self);
    out->bytes = atomic_load(&self->bytes);
    return MP_OK;
}

static MpStatus plugin_stats(void *instance, MpStats *out) {
    Instance *self = instance;
    memset(out, 0, sizeof *out);
    out->live_allocations = live_allocations(self);
    out->live_bytes = atomic_load(&self->bytes);
    out->allocations_total = atomic_load(&self->allocations_total);
    out->failures_total = atomic_load(&self->failures_total);
    return MP_OK;
}

static MpStatus plugin_trim(void *instance, uint64_t *returned) {
    (void)instance;
    *returned = 0; /* nothing is cached */
    return MP_OK;
}

static MpStatus plugin_forget_lost(void *instance, const MpBlock *block) {
    Instance *self = instance;
    BlockHeader *header = header_of(block);
    if (header == NULL || header->owner != self) {
        return MP_ERR_NOT_OWNED;
    }
    /* A real device's memory is gone with its context; this host memory is freed so
     * the books (and the test's leak checks) stay exact. */
    free_block(self, header);
    return MP_OK;
}

/* ---- virtual backing ---- */

static MpStatus check_range(const BlockHeader *header, uint64_t offset, uint64_t length) {
    if (offset > header->bytes || length > header->bytes - offset) {
        return MP_ERR_OUT_OF_BOUNDS;
    }
    if (offset % GRANULE != 0 || length % GRANULE != 0) {
        return MP_ERR_MISALIGNED;
    }
    return MP_OK;
}

/* The block's header, when the block is this instance's and the range fits it. */
static MpStatus owned_range(Instance *self, const MpBlock *block, uint64_t offset, uint64_t length,
                            BlockHeader **out) {
    BlockHeader *header = header_of(block);
    if (header == NULL || header->owner != self) {
        return MP_ERR_NOT_OWNED;
    }
    *out = header;
    return check_range(header, offset, length);
}

static MpStatus plugin_commit(void *instance, const MpBlock *block, uint64_t offset, uint64_t length, uint64_t *bytes) {
    Instance *self = instance;
    unsigned call = call_number(self, &self->commit_calls);
    BlockHeader *header = NULL;
    MpStatus status = owned_range(self, block, offset, length, &header);
    if (status != MP_OK) {
        return status;
    }
    pthread_mutex_lock(&self->lock);
    if (header->committed == NULL) {
        header->committed = calloc(granules(header->bytes) + 1, 1);
    }
    uint64_t newly = 0;
    for (uint64_t g = offset / GRANULE; g < (offset + length) / GRANULE; g++) {
        if (!header->committed[g]) {
            header->committed[g] = 1;
            newly += GRANULE;
        }
    }
    pthread_mutex_unlock(&self->lock);
    *bytes = faulted(self, "commit_overclaim", call) ? length + GRANULE : newly;
    return MP_OK;
}

static MpStatus plugin_decommit(void *instance, const MpBlock *block, uint64_t offset, uint64_t length, uint64_t *bytes) {
    Instance *self = instance;
    BlockHeader *header = NULL;
    MpStatus status = owned_range(self, block, offset, length, &header);
    if (status != MP_OK) {
        return status;
    }
    pthread_mutex_lock(&self->lock);
    uint64_t released = 0;
    for (uint64_t g = offset / GRANULE; header->committed != NULL && g < (offset + length) / GRANULE; g++) {
        if (header->committed[g]) {
            header->committed[g] = 0;
            released += GRANULE;
        }
    }
    pthread_mutex_unlock(&self->lock);
    *bytes = released;
    return MP_OK;
}

static MpStatus plugin_committed_bytes(void *instance, const MpBlock *block, uint64_t *bytes) {
    Instance *self = instance;
    BlockHeader *header = header_of(block);
    if (header == NULL || header->owner != self) {
        return MP_ERR_NOT_OWNED;
    }
    pthread_mutex_lock(&self->lock);
    uint64_t committed = 0;
    for (uint64_t g = 0; header->committed != NULL && g < granules(header->bytes); g++) {
        committed += header->committed[g] ? GRANULE : 0;
    }
    pthread_mutex_unlock(&self->lock);
    *bytes = committed;
    return MP_OK;
}

/* ---- shared mapping ---- */

static Backing *find_backing(Instance *self, uint64_t handle) {
    for (Backing *b = self->backings; b != NULL; b = b->next) {
        if (b->handle == handle && !b->dropped) {
            return b;
        }
    }
    return NULL;
}

static MpStatus plugin_create_backing(void *instance, uint64_t bytes, MpBacking *out) {
    Instance *self = instance;
    if (bytes % GRANULE != 0) {
        return MP_ERR_MISALIGNED;
    }
    Backing *backing = calloc(1, sizeof *backing);
    if (backing == NULL) {
        return MP_ERR_OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&self->lock);
    backing->handle = ++self->next_backing;
    backing->bytes = bytes;
    backing->next = self->backings;
    self->backings = backing;
    self->live_backings++;
    atomic_store_explicit(&self->had_backings, 1, memory_order_release);
    pthread_mutex_unlock(&self->lock);
    out->handle = backing->handle;
    out->bytes = bytes;
    return MP_OK;
}

static MpStatus plugin_map(void *instance, uint64_t handle, const MpBlock *block, uint64_t target_offset,
                           uint64_t length, uint64_t backing_offset, MpMapAccess access) {
    Instance *self = instance;
    (void)access;
    BlockHeader *header = header_of(block);
    if (header == NULL || header->owner != self) {
        return MP_ERR_NOT_OWNED;
    }
    MpStatus status = check_range(header, target_offset, length);
    if (status != MP_OK) {
        return status;
    }
    pthread_mutex_lock(&self->lock);
    Backing *backing = find_backing(self, handle);
    if (backing == NULL) {
        pthread_mutex_unlock(&self->lock);
        return MP_ERR_NOT_OWNED;
    }
    if (backing_offset > backing->bytes || length > backing->bytes - backing_offset) {
        pthread_mutex_unlock(&self->lock);
        return MP_ERR_OUT_OF_BOUNDS;
    }
    if (header->mapped == NULL) {
        header->mapped = calloc(granules(header->bytes) + 1, sizeof(uint64_t));
    }
    uint64_t first = target_offset / GRANULE, last = (target_offset + length) / GRANULE;
    for (uint64_t g = first; g < last; g++) {
        if (header->mapped[g] != 0) {
            pthread_mutex_unlock(&self->lock);
            return MP_ERR_ALREADY_MAPPED;
        }
    }
    for (uint64_t g = first; g < last; g++) {
        header->mapped[g] = handle;
    }
    backing->mapped_granules += last - first;
    pthread_mutex_unlock(&self->lock);
    return MP_OK;
}

static MpStatus plugin_unmap(void *instance, const MpBlock *block, uint64_t offset, uint64_t length, uint64_t *bytes) {
    Instance *self = instance;
    BlockHeader *header = NULL;
    MpStatus status = owned_range(self, block, offset, length, &header);
    if (status != MP_OK) {
        return status;
    }
    pthread_mutex_lock(&self->lock);
    uint64_t unmapped = 0;
    for (uint64_t g = offset / GRANULE; header->mapped != NULL && g < (offset + length) / GRANULE; g++) {
        if (header->mapped[g] != 0) {
            for (Backing *b = self->backings; b != NULL; b = b->next) {
                if (b->handle == header->mapped[g]) {
                    b->mapped_granules--;
                }
            }
            header->mapped[g] = 0;
            unmapped += GRANULE;
        }
    }
    pthread_mutex_unlock(&self->lock);
    *bytes = unmapped;
    return MP_OK;
}

static void plugin_drop_backing(void *instance, uint64_t handle) {
    Instance *self = instance;
    pthread_mutex_lock(&self->lock);
    Backing **link = &self->backings;
    while (*link != NULL) {
        Backing *b = *link;
        if (b->handle == handle && !b->dropped) {
            b->dropped = 1;
            if (b->mapped_granules == 0) { /* still mapped: kept until unmapped */
                *link = b->next;
                free(b);
                self->live_backings--;
            }
            break;
        }
        link = &b->next;
    }
    pthread_mutex_unlock(&self->lock);
}

/* ---- deferred release ---- */

static MpStatus plugin_defer_release(void *instance, uint64_t ticket, uint64_t bytes) {
    Instance *self = instance;
    (void)bytes;
    pthread_mutex_lock(&self->lock);
    if (self->deferred_count == MAX_DEFERRED) {
        pthread_mutex_unlock(&self->lock);
        return MP_ERR_REFUSED;
    }
    self->deferred[self->deferred_count].ticket = ticket;
    self->deferred[self->deferred_count].polls_left = self->defer_polls;
    self->deferred_count++;
    pthread_mutex_unlock(&self->lock);
    return MP_OK;
}

static MpStatus plugin_poll_deferred(void *instance, uint64_t *ready, size_t capacity, size_t *count) {
    Instance *self = instance;
    unsigned call = call_number(self, &self->poll_calls);
    size_t n = 0;
    if (faulted(self, "poll_bogus_ticket", call) && capacity > 0) {
        ready[n++] = 0xdeadbeefull;
    }
    pthread_mutex_lock(&self->lock);
    size_t kept = 0;
    for (size_t i = 0; i < self->deferred_count; i++) {
        Deferred entry = self->deferred[i];
        if (entry.polls_left > 0) {
            entry.polls_left--;
        }
        if (entry.polls_left == 0 && n < capacity) {
            ready[n++] = entry.ticket;
            if (faulted(self, "poll_duplicate_ticket", call) && n < capacity) {
                ready[n++] = entry.ticket;
            }
        } else {
            self->deferred[kept++] = entry;
        }
    }
    self->deferred_count = kept;
    pthread_mutex_unlock(&self->lock);
    *count = n;
    return MP_OK;
}

/* ---- instances ---- */

static void plugin_destroy(void *instance) {
    Instance *self = instance;
    pthread_mutex_lock(&instances_lock);
    Instance **link = &instances;
    while (*link != NULL && *link != self) {
        link = &(*link)->next_instance;
    }
    if (*link == self) {
        *link = self->next_instance;
    }
    live_instances--;
    orphaned_allocations += live_allocations(self);
    orphaned_bytes += atomic_load(&self->bytes);
    pthread_mutex_unlock(&instances_lock);
    while (self->backings != NULL) {
        Backing *next = self->backings->next;
        free(self->backings);
        self->backings = next;
    }
    pthread_mutex_destroy(&self->lock);
    free(self);
}

/* tally_fails=1 (in any instance's configuration) makes mp_plugin_tally fail until an
 * instance is configured with tally_fails=0: the library-wide tally cannot be read. */
static atomic_int tally_fails;

#ifndef EXAMPLE_NO_TALLY
MpStatus mp_plugin_tally(MpTally *out) {
    if (atomic_load(&tally_fails)) {
        return MP_ERR_BACKEND;
    }
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&instances_lock);
    out->instances = live_instances;
    out->allocations = orphaned_allocations;
    out->bytes = orphaned_bytes;
    for (Instance *self = instances; self != NULL; self = self->next_instance) {
        MpTally one;
        plugin_tally(self, &one);
        out->allocations += one.allocations;
        out->bytes += one.bytes;
        out->backings += one.backings;
        out->deferred += one.deferred;
    }
    pthread_mutex_unlock(&instances_lock);
    return MP_OK;
}
#endif

/* Reads `key=` from the configuration into `value` (NUL-terminated); 1 if present. */
static int config_value(const char *config, const char *key, char *value, size_t capacity) {
    size_t key_length = strlen(key);
    const char *p = config;
    while (*p != '\0') {
        while (*p == ' ') {
            p++;
        }
        if (strncmp(p, key, key_length) == 0 && p[key_length] == '=') {
            p += key_length + 1;
            size_t n = 0;
            while (p[n] != '\0' && p[n] != ' ' && n + 1 < capacity) {
                value[n] = p[n];
                n++;
            }
            value[n] = '\0';
            return 1;
        }
        while (*p != '\0' && *p != ' ') {
            p++;
        }
    }
    return 0;
}

static unsigned long long config_number(const char *config, const char *key, unsigned long long otherwise) {
    char value[32];
    return config_value(config, key, value, sizeof value) ? strtoull(value, NULL, 0) : otherwise;
}

/* Fills every slot past `size` bytes with a poison pointer: a host that reads past
 * the agreed prefix calls it and crashes the test. */
static void poison_after(MpAllocator *table, size_t size) {
    uint8_t *bytes = (uint8_t *)table;
    for (size_t i = size; i + sizeof(void *) <= sizeof(FutureTable); i += sizeof(void *)) {
        uintptr_t poison = (uintptr_t)0xbad0bad0bad0ull;
        memcpy(bytes + i, &poison, sizeof poison);
    }
}

MpStatus mp_plugin_entry(const MpHost *host, const MpAllocator **out) {
    if (host == NULL || out == NULL) {
        return MP_ERR_INVALID_ARGUMENT;
    }
    if (host->header.abi_major != MP_ABI_MAJOR) {
        return MP_ERR_VERSION_MISMATCH;
    }
    const char *config = host->config != NULL ? host->config : "";
    if (config_number(config, "refuse", 0)) {
        log_line(host, MP_LOG_WARN, "example plugin: refusing the host as scripted");
        return MP_ERR_VERSION_MISMATCH;
    }
    /* reenter=ADDR: calls the host's function at ADDR (a void (*)(void)) from inside
     * this entry call, as a plugin asking its host for a second instance of itself would. */
    unsigned long long reenter = config_number(config, "reenter", 0);
    if (reenter != 0) {
        ((void (*)(void))(uintptr_t)reenter)();
    }
    Instance *self = calloc(1, sizeof *self);
    if (self == NULL) {
        return MP_ERR_OUT_OF_MEMORY;
    }
    pthread_mutex_init(&self->lock, NULL);
    self->offered = host->offered_capabilities;
    self->device.tier = (uint32_t)config_number(config, "tier", MP_TIER_HOST);
    self->device.index = (uint32_t)config_number(config, "index", 0);
    self->defer_polls = (unsigned)config_number(config, "defer_polls", 1);
    self->fault_at = (unsigned)config_number(config, "at", 1);
    self->unknown_status = (MpStatus)config_number(config, "status", 77);
    self->keep = (int)config_number(config, "keep", 0);
    if (config_number(config, "tally_fails", 2) != 2) {
        atomic_store(&tally_fails, (int)config_number(config, "tally_fails", 0));
    }
    if (!config_value(config, "fault", self->fault, sizeof self->fault)) {
        self->fault[0] = '\0';
    }
    if (!config_value(config, "name", self->name, sizeof self->name)) {
        strcpy(self->name, "example-plugin");
    }

    unsigned minor = (unsigned)config_number(config, "minor", MP_ABI_MINOR);
    /* A well-behaved plugin never builds a table newer than the host reads; the
     * script may, to prove the host negotiates down by itself. */
    MpAllocator *t = &self->table.table;
    t->header.abi_major = (uint16_t)config_number(config, "major", MP_ABI_MAJOR);
    t->header.abi_minor = (uint16_t)minor;
    t->header.struct_size = minor == 0 ? MP_ALLOCATOR_SIZE_V1_0 : minor == 1 ? (uint32_t)sizeof(MpAllocator) : (uint32_t)sizeof(FutureTable);
    t->header.struct_size = (uint32_t)config_number(config, "size", t->header.struct_size);
    uint64_t supported = MP_CAP_ALL;
    t->capabilities = config_number(config, "claim", host->offered_capabilities & supported);
    t->instance = self;
    t->name = self->name;
    t->device = self->device;
    t->allocate = plugin_allocate;
    t->release = plugin_release;
    t->destroy = plugin_destroy;
    t->tally = plugin_tally;
    t->stats = plugin_stats;
    t->trim = plugin_trim;
    t->forget_lost = plugin_forget_lost;
    t->virtual_granularity = GRANULE;
    t->commit = plugin_commit;
    t->decommit = plugin_decommit;
    t->committed_bytes = plugin_committed_bytes;
    t->shared_granularity = GRANULE;
    t->create_backing = plugin_create_backing;
    t->map = plugin_map;
    t->unmap = plugin_unmap;
    t->drop_backing = plugin_drop_backing;
    t->defer_release = plugin_defer_release;
    t->poll_deferred = plugin_poll_deferred;

    char slot[32];
    if (config_value(config, "null", slot, sizeof slot)) {
        if (strcmp(slot, "allocate") == 0) t->allocate = NULL;
        if (strcmp(slot, "release") == 0) t->release = NULL;
        if (strcmp(slot, "stats") == 0) t->stats = NULL;
        if (strcmp(slot, "trim") == 0) t->trim = NULL;
        if (strcmp(slot, "tally") == 0) t->tally = NULL;
        if (strcmp(slot, "commit") == 0) t->commit = NULL;
        if (strcmp(slot, "map") == 0) t->map = NULL;
        if (strcmp(slot, "poll_deferred") == 0) t->poll_deferred = NULL;
    }
    if (t->header.struct_size < sizeof(MpAllocator)) {
        poison_after(t, t->header.struct_size);
    }

    pthread_mutex_lock(&instances_lock);
    self->next_instance = instances;
    instances = self;
    live_instances++;
    pthread_mutex_unlock(&instances_lock);
    log_line(host, MP_LOG_INFO, "example plugin: instance created");
    *out = t;
    return MP_OK;
}
