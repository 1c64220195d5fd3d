/*
 * A fake CUDA driver (libcuda.so) for testing allocator-cuda without a GPU.
 *
 * It exports the driver entry points allocator-cuda calls (and the copies its tests
 * use), with the CUDA 12 ABI, backed by host memory:
 *   - device memory (cuMemAlloc, pools) is aligned host memory; the "device address"
 *     is the host address, so copies are memcpy;
 *   - VMM reservations are PROT_NONE mappings, physical handles are memfds, cuMemMap
 *     maps the memfd into the reservation (so one handle mapped twice really shares
 *     its bytes) and cuMemSetAccess is mprotect;
 *   - streams run everything immediately; events complete at once unless held;
 *   - like CUDA, a pool keeps freed memory until a synchronisation (cuStreamSynchronize,
 *     cuEventSynchronize): only then does it give back what lies above its release
 *     threshold; cuMemFreeAsync only returns the block to the pool's cache.
 * It checks what the real driver checks where allocator-cuda relies on it: a current
 * context for memory calls, exact frees, whole-mapping unmaps, no address free while
 * mapped, copies only into live memory with the right access. Handles are validated
 * by lookup, never by reading freed memory; a free, release or destroy of a handle
 * that is not live (a double free) fails and is counted (fake_cuda_invalid_frees).
 *
 * Error injection (controlled from the test process through exported functions, or
 * from the environment before the first call):
 *   FAKE_CUDA_DEVICES=N        number of devices (default 1; 0: cuInit says NO_DEVICE)
 *   FAKE_CUDA_MEM_BYTES=N      device memory per process (default 1 GiB)
 *   FAKE_CUDA_GRANULARITY=N    VMM granularity (default 2 MiB)
 *   FAKE_CUDA_NO_VMM=1, FAKE_CUDA_NO_POOLS=1   report the feature unsupported
 *   FAKE_CUDA_INJECT="fn:skip:count:code;..."  as fake_cuda_inject below
 *   fake_cuda_inject(fn, skip, count, code): after `skip` more calls of `fn` succeed
 *       normally, the next `count` calls (-1: all) return `code` and do nothing. Every
 *       exported driver entry point honours it (each starts with GUARD or SYNC_GUARD);
 *       fake_cuda_injected(fn) counts the injected failures actually returned.
 *   fake_cuda_set_sticky(code): every later call returns `code` (a destroyed context).
 *   fake_cuda_fault(code): an asynchronous fault (a kernel hit an illegal address):
 *       calls keep working until the next synchronising call (stream or event
 *       synchronise, event query, cuMemFree, cuMemFreeHost, synchronous copies), which
 *       reports `code`; from then on it is sticky, as real drivers usually behave.
 *   fake_cuda_hold_events(1): recorded events stay pending until
 *       fake_cuda_complete_events() (cuEventSynchronize completes the event it waits on).
 *   fake_cuda_calls(fn), fake_cuda_injected(fn), fake_cuda_used_bytes(),
 *   fake_cuda_live_handles(), fake_cuda_live_pools(), fake_cuda_live_streams(),
 *   fake_cuda_live_events(), fake_cuda_live_reservations(), fake_cuda_live_mappings(),
 *   fake_cuda_live_host_blocks(), fake_cuda_invalid_frees(), fake_cuda_context_depth():
 *   counters.
 *
 * Every code returned is a valid CUresult of CUDA 12.8: cudarc declares the return
 * type as a Rust enum, so any other value would be undefined behaviour there.
 *
 * Build: cc -shared -fPIC -O1 -o libcuda.so fake_cuda.c -lpthread
 *        (-DFAKE_CUDA_OLD_DRIVER leaves out the VMM entry points, like an old driver).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
} CUmemAllocFlags;
typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    CUmemAllocFlags allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
typedef struct {
    int allocType;
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;

/* ---------------------------------------------------------------- state ---- */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int devices = 1;
static unsigned long long total_memory = 1ull << 30;
static unsigned long long used_memory = 0;
static size_t granularity = 2u << 20;
static int no_vmm = 0, no_pools = 0;
static int initialised = 0;
static int sticky = 0;
static int pending_fault = 0;
static int hold_events = 0;
static unsigned long long invalid_frees = 0;

struct counter { char name[64]; unsigned long long calls, injected; };
static struct counter counters[128];
static int counter_count = 0;

struct rule { char name[64]; long skip; long count; int code; };
static struct rule rules[64];
static int rule_count = 0;

struct context { int device; int retained; };
static struct context contexts[16];
static __thread struct context *stack[32];
static __thread int depth = 0;

enum { KIND_DEVICE, KIND_POOL, KIND_HOST };
struct block {
    uintptr_t addr;
    size_t size;
    int kind;
    int in_use;          /* pool blocks: 0 when cached */
    struct pool *pool;
    struct block *next;
};
static struct block *blocks = NULL;

struct pool {
    unsigned long long threshold, reserved, reserved_high, used, used_high;
    int device;
    struct pool *next;
};
static struct pool *pools = NULL;

struct reservation { uintptr_t addr; size_t size; struct reservation *next; };
static struct reservation *reservations = NULL;

struct handle {
    unsigned long long id;
    size_t size;
    int fd;
    int released;
    int maps;
    struct handle *next;
};
static struct handle *handles = NULL;
static unsigned long long next_handle = 1;

struct mapping {
    uintptr_t addr;
    size_t size;
    size_t offset;
    struct handle *handle;
    int prot;
    struct mapping *next;
};
static struct mapping *mappings = NULL;

struct stream { struct stream *next; };
static struct stream *streams = NULL;
struct event { int complete; struct event *next; };
static struct event *events = NULL;

static unsigned long long env_number(const char *name, unsigned long long fallback) {
    const char *value = getenv(name);
    if (!value || !*value) return fallback;
    return strtoull(value, NULL, 0);
}

static void add_rule(const char *name, long skip, long count, int code) {
    if (rule_count >= 64) return;
    struct rule *r = &rules[rule_count++];
    snprintf(r->name, sizeof r->name, "%s", name);
    r->skip = skip;
    r->count = count;
    r->code = code;
}

static void configure(void) {
    devices = (int)env_number("FAKE_CUDA_DEVICES", 1);
    total_memory = env_number("FAKE_CUDA_MEM_BYTES", 1ull << 30);
    granularity = (size_t)env_number("FAKE_CUDA_GRANULARITY", 2u << 20);
    no_vmm = (int)env_number("FAKE_CUDA_NO_VMM", 0);
    no_pools = (int)env_number("FAKE_CUDA_NO_POOLS", 0);
    for (int i = 0; i < 16; i++) contexts[i].device = i;
    const char *inject = getenv("FAKE_CUDA_INJECT");
    if (inject) {
        char *copy = strdup(inject), *save = NULL;
        for (char *item = strtok_r(copy, ";", &save); item; item = strtok_r(NULL, ";", &save)) {
            char name[64];
            long skip, count;
            int code;
            if (sscanf(item, "%63[^:]:%ld:%ld:%d", name, &skip, &count, &code) == 4) add_rule(name, skip, count, code);
        }
        free(copy);
    }
}

static struct counter *counter_for(const char *name) {
    for (int i = 0; i < counter_count; i++)
        if (strcmp(counters[i].name, name) == 0) return &counters[i];
    if (counter_count == 128) return NULL;
    struct counter *c = &counters[counter_count++];
    snprintf(c->name, sizeof c->name, "%s", name);
    return c;
}

/* Counts the call and applies sticky errors, a pending fault (at a synchronising
 * call) and injections; 0 means "go ahead". */
static int enter(const char *name, int synchronising) {
    pthread_once(&once, configure);
    pthread_mutex_lock(&lock);
    struct counter *counter = counter_for(name);
    if (counter) counter->calls++;
    if (!sticky && pending_fault && synchronising) {
        sticky = pending_fault;
        pending_fault = 0;
    }
    int code = sticky;
    for (int i = 0; !code && i < rule_count; i++) {
        struct rule *r = &rules[i];
        if (strcmp(r->name, name) != 0 || r->count == 0) continue;
        if (r->skip > 0) {
            r->skip--;
            continue;
        }
        if (r->count > 0) r->count--;
        code = r->code;
        if (counter) counter->injected++;
    }
    pthread_mutex_unlock(&lock);
    return code;
}

#define GUARD_AS(name, synchronising)                   \
    do {                                                \
        int injected_ = enter(name, synchronising);     \
        if (injected_) return injected_;                \
    } while (0)
/* An entry point that only queues work or touches host-side state. */
#define GUARD(name) GUARD_AS(name, 0)
/* An entry point that waits for the device, so it reports an asynchronous fault. */
#define SYNC_GUARD(name) GUARD_AS(name, 1)

/* A free, release or destroy of something that is not live. Lock held. */
static CUresult invalid_free(CUresult code) {
    invalid_frees++;
    return code;
}

/* Memory calls need a current context and an initialised driver. */
#define NEED_CONTEXT()                                   \
    do {                                                 \
        if (!initialised) return CUDA_ERROR_NOT_INITIALIZED; \
        if (depth == 0 || !stack[depth - 1]) return CUDA_ERROR_INVALID_CONTEXT; \
    } while (0)

static struct block *find_block(uintptr_t addr) {
    for (struct block *b = blocks; b; b = b->next)
        if (b->addr == addr) return b;
    return NULL;
}

static void unlink_block(struct block *gone) {
    for (struct block **b = &blocks; *b; b = &(*b)->next) {
        if (*b == gone) {
            *b = gone->next;
            return;
        }
    }
}

static int reserve_memory(unsigned long long bytes) {
    if (used_memory + bytes > total_memory) return 0;
    used_memory += bytes;
    return 1;
}

static size_t round_up(size_t value, size_t to) { return (value + to - 1) / to * to; }

/* ---------------------------------------------------- control functions ---- */

EXPORT int fake_cuda_inject(const char *name, long skip, long count, int code) {
    pthread_once(&once, configure);
    pthread_mutex_lock(&lock);
    add_rule(name, skip, count, code);
    pthread_mutex_unlock(&lock);
    return 0;
}

EXPORT void fake_cuda_clear_injections(void) {
    pthread_mutex_lock(&lock);
    rule_count = 0;
    pthread_mutex_unlock(&lock);
}

EXPORT void fake_cuda_set_sticky(int code) {
    pthread_mutex_lock(&lock);
    sticky = code;
    pthread_mutex_unlock(&lock);
}

EXPORT void fake_cuda_fault(int code) {
    pthread_once(&once, configure);
    pthread_mutex_lock(&lock);
    pending_fault = code;
    pthread_mutex_unlock(&lock);
}

EXPORT void fake_cuda_hold_events(int hold) {
    pthread_mutex_lock(&lock);
    hold_events = hold;
    pthread_mutex_unlock(&lock);
}

EXPORT void fake_cuda_complete_events(void) {
    pthread_mutex_lock(&lock);
    for (struct event *e = events; e; e = e->next) e->complete = 1;
    pthread_mutex_unlock(&lock);
}

EXPORT unsigned long long fake_cuda_calls(const char *name) {
    unsigned long long calls = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < counter_count; i++)
        if (strcmp(counters[i].name, name) == 0) calls = counters[i].calls;
    pthread_mutex_unlock(&lock);
    return calls;
}

EXPORT unsigned long long fake_cuda_injected(const char *name) {
    unsigned long long injected = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < counter_count; i++)
        if (strcmp(counters[i].name, name) == 0) injected = counters[i].injected;
    pthread_mutex_unlock(&lock);
    return injected;
}

EXPORT unsigned long long fake_cuda_invalid_frees(void) {
    pthread_mutex_lock(&lock);
    unsigned long long count = invalid_frees;
    pthread_mutex_unlock(&lock);
    return count;
}

EXPORT unsigned long long fake_cuda_used_bytes(void) {
    pthread_mutex_lock(&lock);
    unsigned long long used = used_memory;
    pthread_mutex_unlock(&lock);
    return used;
}

EXPORT int fake_cuda_live_handles(void) {
    int live = 0;
    pthread_mutex_lock(&lock);
    for (struct handle *h = handles; h; h = h->next) live++;
    pthread_mutex_unlock(&lock);
    return live;
}

EXPORT int fake_cuda_live_pools(void) {
    int live = 0;
    pthread_mutex_lock(&lock);
    for (struct pool *p = pools; p; p = p->next) live++;
    pthread_mutex_unlock(&lock);
    return live;
}

EXPORT int fake_cuda_live_events(void) {
    int live = 0;
    pthread_mutex_lock(&lock);
    for (struct event *e = events; e; e = e->next) live++;
    pthread_mutex_unlock(&lock);
    return live;
}

EXPORT int fake_cuda_live_streams(void) {
    int live = 0;
    pthread_mutex_lock(&lock);
    for (struct stream *s = streams; s; s = s->next) live++;
    pthread_mutex_unlock(&lock);
    return live;
}

EXPORT int fake_cuda_live_reservations(void) {
    int live = 0;
    pthread_mutex_lock(&lock);
    for (struct reservation *r = reservations; r; r = r->next) live++;
    pthread_mutex_unlock(&lock);
    return live;
}

EXPORT int fake_cuda_live_mappings(void) {
    int live = 0;
    pthread_mutex_lock(&lock);
    for (struct mapping *m = mappings; m; m = m->next) live++;
    pthread_mutex_unlock(&lock);
    return live;
}

EXPORT int fake_cuda_live_host_blocks(void) {
    int live = 0;
    pthread_mutex_lock(&lock);
    for (struct block *b = blocks; b; b = b->next) live += b->kind == KIND_HOST;
    pthread_mutex_unlock(&lock);
    return live;
}

EXPORT int fake_cuda_context_depth(void) { return depth; }

EXPORT int fake_cuda_primary_retains(int device) {
    if (device < 0 || device >= 16) return -1;
    pthread_mutex_lock(&lock);
    int retained = contexts[device].retained;
    pthread_mutex_unlock(&lock);
    return retained;
}

/* ------------------------------------------------- init, devices, contexts ---- */

EXPORT CUresult cuInit(unsigned int flags) {
    GUARD("cuInit");
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (devices <= 0) return CUDA_ERROR_NO_DEVICE;
    initialised = 1;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int *version) {
    GUARD("cuDriverGetVersion");
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = 12080;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *count) {
    GUARD("cuDeviceGetCount");
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = devices;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    GUARD("cuDeviceGet");
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= devices || ordinal >= 16) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
    GUARD("cuDeviceGetAttribute");
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= devices) return CUDA_ERROR_INVALID_DEVICE;
    switch (attribute) {
    case 102: *value = !no_vmm; break;   /* VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED */
    case 115: *value = !no_pools; break; /* MEMORY_POOLS_SUPPORTED */
    default: *value = 0;
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(struct context **context, CUdevice device) {
    GUARD("cuDevicePrimaryCtxRetain");
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!context) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= devices || device >= 16) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    contexts[device].retained++;
    pthread_mutex_unlock(&lock);
    *context = &contexts[device];
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    GUARD("cuDevicePrimaryCtxRelease_v2");
    if (device < 0 || device >= devices || device >= 16) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    CUresult result = CUDA_SUCCESS;
    if (contexts[device].retained > 0) contexts[device].retained--;
    else result = invalid_free(CUDA_ERROR_INVALID_CONTEXT);
    pthread_mutex_unlock(&lock);
    return result;
}

EXPORT CUresult cuCtxPushCurrent_v2(struct context *context) {
    GUARD("cuCtxPushCurrent_v2");
    if (!context || context < contexts || context >= contexts + 16 || context->retained == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (depth >= 32) return CUDA_ERROR_INVALID_VALUE;
    stack[depth++] = context;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(struct context **context) {
    GUARD("cuCtxPopCurrent_v2");
    if (depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    struct context *top = stack[--depth];
    if (context) *context = top;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ errors ---- */

EXPORT CUresult cuGetErrorString(CUresult error, const char **text) {
    (void)error;
    if (!text) return CUDA_ERROR_INVALID_VALUE;
    *text = "fake CUDA driver error";
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorName(CUresult error, const char **text) {
    (void)error;
    if (!text) return CUDA_ERROR_INVALID_VALUE;
    *text = "CUDA_ERROR_FAKE";
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ memory ---- */

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    GUARD("cuMemGetInfo_v2");
    NEED_CONTEXT();
    if (!free_bytes || !total_bytes) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    *free_bytes = (size_t)(total_memory - used_memory);
    *total_bytes = (size_t)total_memory;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

static CUresult new_block(uintptr_t *out, size_t bytes, size_t align, int kind, struct pool *pool, int account) {
    size_t size = round_up(bytes, align);
    if (account && !reserve_memory(size)) return CUDA_ERROR_OUT_OF_MEMORY;
    void *memory = NULL;
    if (posix_memalign(&memory, align, size) != 0) {
        if (account) used_memory -= size;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    memset(memory, 0xA5, size);
    struct block *b = calloc(1, sizeof *b);
    b->addr = (uintptr_t)memory;
    b->size = size;
    b->kind = kind;
    b->in_use = 1;
    b->pool = pool;
    b->next = blocks;
    blocks = b;
    *out = b->addr;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    GUARD("cuMemAlloc_v2");
    NEED_CONTEXT();
    if (!dptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    uintptr_t addr = 0;
    CUresult result = new_block(&addr, bytes, 512, KIND_DEVICE, NULL, 1);
    pthread_mutex_unlock(&lock);
    if (result == CUDA_SUCCESS) *dptr = addr;
    return result;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    SYNC_GUARD("cuMemFree_v2");
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    struct block *b = find_block((uintptr_t)dptr);
    if (!b || b->kind != KIND_DEVICE) {
        CUresult result = invalid_free(CUDA_ERROR_INVALID_VALUE);
        pthread_mutex_unlock(&lock);
        return result;
    }
    unlink_block(b);
    used_memory -= b->size;
    pthread_mutex_unlock(&lock);
    free((void *)b->addr);
    free(b);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemHostAlloc(void **pointer, size_t bytes, unsigned int flags) {
    GUARD("cuMemHostAlloc");
    NEED_CONTEXT();
    if (!pointer || bytes == 0 || (flags & ~0x7u)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    uintptr_t addr = 0;
    CUresult result = new_block(&addr, bytes, 4096, KIND_HOST, NULL, 0);
    pthread_mutex_unlock(&lock);
    if (result == CUDA_SUCCESS) *pointer = (void *)addr;
    return result;
}

EXPORT CUresult cuMemFreeHost(void *pointer) {
    SYNC_GUARD("cuMemFreeHost");
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    struct block *b = find_block((uintptr_t)pointer);
    if (!b || b->kind != KIND_HOST) {
        CUresult result = invalid_free(CUDA_ERROR_INVALID_VALUE);
        pthread_mutex_unlock(&lock);
        return result;
    }
    unlink_block(b);
    pthread_mutex_unlock(&lock);
    free(pointer);
    free(b);
    return CUDA_SUCCESS;
}

/* Whether [addr, addr+len) lies in live memory with at least `prot` access. */
static int accessible(uintptr_t addr, size_t len, int prot) {
    if (len == 0) return 1;
    for (struct block *b = blocks; b; b = b->next) {
        if (b->in_use && addr >= b->addr && addr + len <= b->addr + b->size) return 1;
    }
    /* VMM: every byte must be covered by mappings with the access. */
    uintptr_t at = addr, end = addr + len;
    while (at < end) {
        struct mapping *found = NULL;
        for (struct mapping *m = mappings; m; m = m->next)
            if (at >= m->addr && at < m->addr + m->size) found = m;
        if (!found || (found->prot & prot) != prot) return 0;
        at = found->addr + found->size;
    }
    return 1;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes) {
    SYNC_GUARD("cuMemcpyHtoD_v2");
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    int ok = accessible((uintptr_t)dst, bytes, PROT_READ | PROT_WRITE) && (src || bytes == 0);
    pthread_mutex_unlock(&lock);
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    memcpy((void *)(uintptr_t)dst, src, bytes);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes) {
    SYNC_GUARD("cuMemcpyDtoH_v2");
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    int ok = accessible((uintptr_t)src, bytes, PROT_READ) && (dst || bytes == 0);
    pthread_mutex_unlock(&lock);
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    memcpy(dst, (const void *)(uintptr_t)src, bytes);
    return CUDA_SUCCESS;
}

/* Whether `stream` is live (NULL is the legacy default stream). Lock held. */
static int live_stream(struct stream *stream) {
    if (!stream) return 1;
    for (struct stream *s = streams; s; s = s->next)
        if (s == stream) return 1;
    return 0;
}

static int valid_stream(struct stream *stream) {
    pthread_mutex_lock(&lock);
    int live = live_stream(stream);
    pthread_mutex_unlock(&lock);
    return live;
}

/* Whether `event` is live. Lock held. */
static int live_event(struct event *event) {
    for (struct event *e = events; e; e = e->next)
        if (e == event) return 1;
    return 0;
}

static void release_pools_above_threshold(void);

EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t bytes, struct stream *stream) {
    GUARD("cuMemsetD8Async");
    NEED_CONTEXT();
    if (!valid_stream(stream)) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    int ok = accessible((uintptr_t)dst, bytes, PROT_READ | PROT_WRITE);
    pthread_mutex_unlock(&lock);
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    memset((void *)(uintptr_t)dst, value, bytes);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------- streams, events ---- */

EXPORT CUresult cuStreamCreate(struct stream **stream, unsigned int flags) {
    GUARD("cuStreamCreate");
    NEED_CONTEXT();
    if (!stream || flags > 1) return CUDA_ERROR_INVALID_VALUE;
    struct stream *s = calloc(1, sizeof *s);
    pthread_mutex_lock(&lock);
    s->next = streams;
    streams = s;
    pthread_mutex_unlock(&lock);
    *stream = s;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamDestroy_v2(struct stream *stream) {
    GUARD("cuStreamDestroy_v2");
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    struct stream **link = &streams;
    while (*link && *link != stream) link = &(*link)->next;
    if (!stream || !*link) {
        CUresult result = invalid_free(CUDA_ERROR_INVALID_HANDLE);
        pthread_mutex_unlock(&lock);
        return result;
    }
    *link = stream->next;
    pthread_mutex_unlock(&lock);
    free(stream);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(struct stream *stream) {
    SYNC_GUARD("cuStreamSynchronize");
    NEED_CONTEXT();
    if (!valid_stream(stream)) return CUDA_ERROR_INVALID_HANDLE;
    release_pools_above_threshold();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventCreate(struct event **event, unsigned int flags) {
    GUARD("cuEventCreate");
    NEED_CONTEXT();
    if (!event || flags > 0xF) return CUDA_ERROR_INVALID_VALUE;
    struct event *e = calloc(1, sizeof *e);
    e->complete = 1;
    pthread_mutex_lock(&lock);
    e->next = events;
    events = e;
    pthread_mutex_unlock(&lock);
    *event = e;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(struct event *event, struct stream *stream) {
    GUARD("cuEventRecord");
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    CUresult result = CUDA_SUCCESS;
    if (!live_event(event) || !live_stream(stream)) result = CUDA_ERROR_INVALID_HANDLE;
    else event->complete = !hold_events;
    pthread_mutex_unlock(&lock);
    return result;
}

EXPORT CUresult cuEventQuery(struct event *event) {
    SYNC_GUARD("cuEventQuery");
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    CUresult result = CUDA_ERROR_INVALID_HANDLE;
    if (live_event(event)) result = event->complete ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
    pthread_mutex_unlock(&lock);
    return result;
}

EXPORT CUresult cuEventSynchronize(struct event *event) {
    SYNC_GUARD("cuEventSynchronize");
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    int live = live_event(event);
    if (live) event->complete = 1; /* waiting lets the (simulated) device finish */
    pthread_mutex_unlock(&lock);
    if (!live) return CUDA_ERROR_INVALID_HANDLE;
    release_pools_above_threshold();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventDestroy_v2(struct event *event) {
    GUARD("cuEventDestroy_v2");
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    struct event **link = &events;
    while (*link && *link != event) link = &(*link)->next;
    if (!event || !*link) {
        CUresult result = invalid_free(CUDA_ERROR_INVALID_HANDLE);
        pthread_mutex_unlock(&lock);
        return result;
    }
    *link = event->next;
    pthread_mutex_unlock(&lock);
    free(event);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------- pools ---- */

static int valid_pool(struct pool *pool) {
    for (struct pool *p = pools; p; p = p->next)
        if (p == pool) return 1;
    return 0;
}

/* Frees cached blocks of `pool` until it holds at most `keep` bytes. */
static void shrink_pool(struct pool *pool, unsigned long long keep) {
    struct block **link = &blocks;
    while (*link && pool->reserved > keep) {
        struct block *b = *link;
        if (b->kind == KIND_POOL && b->pool == pool && !b->in_use) {
            *link = b->next;
            pool->reserved -= b->size;
            used_memory -= b->size;
            free((void *)b->addr);
            free(b);
        } else {
            link = &b->next;
        }
    }
}

/* A synchronisation: every pool gives back the cached memory above its release
 * threshold (the fake's streams have already run everything queued). */
static void release_pools_above_threshold(void) {
    pthread_mutex_lock(&lock);
    for (struct pool *p = pools; p; p = p->next) shrink_pool(p, p->threshold);
    pthread_mutex_unlock(&lock);
}

EXPORT CUresult cuMemPoolCreate(struct pool **pool, const CUmemPoolProps *props) {
    GUARD("cuMemPoolCreate");
    NEED_CONTEXT();
    if (!pool || !props || props->allocType != 1 || props->location.type != 1) return CUDA_ERROR_INVALID_VALUE;
    if (props->location.id < 0 || props->location.id >= devices) return CUDA_ERROR_INVALID_DEVICE;
    if (no_pools) return CUDA_ERROR_NOT_SUPPORTED;
    struct pool *p = calloc(1, sizeof *p);
    p->device = props->location.id;
    pthread_mutex_lock(&lock);
    p->next = pools;
    pools = p;
    pthread_mutex_unlock(&lock);
    *pool = p;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemPoolDestroy(struct pool *pool) {
    GUARD("cuMemPoolDestroy");
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    if (!valid_pool(pool)) {
        CUresult result = invalid_free(CUDA_ERROR_INVALID_VALUE);
        pthread_mutex_unlock(&lock);
        return result;
    }
    shrink_pool(pool, 0);
    for (struct pool **p = &pools; *p; p = &(*p)->next) {
        if (*p == pool) {
            *p = pool->next;
            break;
        }
    }
    /* Blocks still in use outlive the pool, as with the real driver (which finishes
     * destroying it once they are freed); they can no longer be freed here. */
    for (struct block *b = blocks; b; b = b->next)
        if (b->kind == KIND_POOL && b->pool == pool) b->pool = NULL;
    pthread_mutex_unlock(&lock);
    free(pool);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemPoolSetAttribute(struct pool *pool, int attribute, void *value) {
    GUARD("cuMemPoolSetAttribute");
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    CUresult result = CUDA_SUCCESS;
    if (!valid_pool(pool)) {
        result = CUDA_ERROR_INVALID_VALUE;
    } else if (attribute == 4) { /* RELEASE_THRESHOLD */
        pool->threshold = *(unsigned long long *)value;
    } else if (attribute == 6 || attribute == 8) { /* high marks: reset to current */
        if (attribute == 6) pool->reserved_high = pool->reserved;
        else pool->used_high = pool->used;
    } else {
        result = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&lock);
    return result;
}

EXPORT CUresult cuMemPoolGetAttribute(struct pool *pool, int attribute, void *value) {
    GUARD("cuMemPoolGetAttribute");
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    CUresult result = CUDA_SUCCESS;
    unsigned long long *out = value;
    if (!valid_pool(pool)) result = CUDA_ERROR_INVALID_VALUE;
    else if (attribute == 4) *out = pool->threshold;
    else if (attribute == 5) *out = pool->reserved;
    else if (attribute == 6) *out = pool->reserved_high;
    else if (attribute == 7) *out = pool->used;
    else if (attribute == 8) *out = pool->used_high;
    else result = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&lock);
    return result;
}

EXPORT CUresult cuMemPoolTrimTo(struct pool *pool, size_t keep) {
    GUARD("cuMemPoolTrimTo");
    pthread_mutex_lock(&lock);
    if (!valid_pool(pool)) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    shrink_pool(pool, keep);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, struct pool *pool, struct stream *stream) {
    GUARD("cuMemAllocFromPoolAsync");
    NEED_CONTEXT();
    if (!dptr || bytes == 0 || !valid_stream(stream)) return CUDA_ERROR_INVALID_VALUE;
    size_t size = round_up(bytes, 512);
    pthread_mutex_lock(&lock);
    if (!valid_pool(pool)) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct block *hit = NULL;
    for (struct block *b = blocks; b && !hit; b = b->next)
        if (b->kind == KIND_POOL && b->pool == pool && !b->in_use && b->size == size) hit = b;
    CUresult result = CUDA_SUCCESS;
    if (hit) {
        hit->in_use = 1;
        *dptr = hit->addr;
    } else {
        uintptr_t addr = 0;
        result = new_block(&addr, size, 512, KIND_POOL, pool, 1);
        if (result == CUDA_SUCCESS) {
            pool->reserved += size;
            if (pool->reserved > pool->reserved_high) pool->reserved_high = pool->reserved;
            *dptr = addr;
        }
    }
    if (result == CUDA_SUCCESS) {
        pool->used += size;
        if (pool->used > pool->used_high) pool->used_high = pool->used;
    }
    pthread_mutex_unlock(&lock);
    return result;
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, struct stream *stream) {
    GUARD("cuMemFreeAsync");
    NEED_CONTEXT();
    if (!valid_stream(stream)) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    struct block *b = find_block((uintptr_t)dptr);
    if (!b || b->kind != KIND_POOL || !b->in_use || !b->pool) {
        CUresult result = invalid_free(CUDA_ERROR_INVALID_VALUE);
        pthread_mutex_unlock(&lock);
        return result;
    }
    b->in_use = 0;
    b->pool->used -= b->size;
    /* The block goes back to the pool's cache; memory above the release threshold
     * leaves the pool only at the next synchronisation, as with CUDA. */
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* --------------------------------------------------------------- VMM ---- */

EXPORT CUresult cuMemGetAllocationGranularity(size_t *out, const CUmemAllocationProp *prop, int option) {
    GUARD("cuMemGetAllocationGranularity");
    if (!out || !prop || prop->type != 1 || prop->location.type != 1 || option < 0 || option > 1)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.id < 0 || prop->location.id >= devices) return CUDA_ERROR_INVALID_DEVICE;
    *out = granularity;
    return CUDA_SUCCESS;
}

#ifndef FAKE_CUDA_OLD_DRIVER
EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
    GUARD("cuMemAddressReserve");
    NEED_CONTEXT();
    if (!ptr || size == 0 || size % granularity || addr || flags) return CUDA_ERROR_INVALID_VALUE;
    if (align == 0) align = granularity;
    if (align & (align - 1)) return CUDA_ERROR_INVALID_VALUE;
    size_t span = size + align;
    void *raw = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t start = round_up((uintptr_t)raw, align);
    if (start > (uintptr_t)raw) munmap(raw, start - (uintptr_t)raw);
    uintptr_t tail = start + size, end = (uintptr_t)raw + span;
    if (end > tail) munmap((void *)tail, end - tail);
    struct reservation *r = calloc(1, sizeof *r);
    r->addr = start;
    r->size = size;
    pthread_mutex_lock(&lock);
    r->next = reservations;
    reservations = r;
    pthread_mutex_unlock(&lock);
    *ptr = start;
    return CUDA_SUCCESS;
}
#endif

EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    GUARD("cuMemAddressFree");
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    struct reservation **link = &reservations;
    while (*link && !((*link)->addr == ptr && (*link)->size == size)) link = &(*link)->next;
    int mapped = 0;
    for (struct mapping *m = mappings; m; m = m->next)
        if (m->addr >= ptr && m->addr < ptr + size) mapped = 1;
    if (!*link || mapped) {
        CUresult result = !*link ? invalid_free(CUDA_ERROR_INVALID_VALUE) : CUDA_ERROR_INVALID_VALUE;
        pthread_mutex_unlock(&lock);
        return result;
    }
    struct reservation *r = *link;
    *link = r->next;
    pthread_mutex_unlock(&lock);
    munmap((void *)r->addr, r->size);
    free(r);
    return CUDA_SUCCESS;
}

static struct handle *find_handle(unsigned long long id) {
    for (struct handle *h = handles; h; h = h->next)
        if (h->id == id) return h;
    return NULL;
}

/* Frees a handle once it is released and unmapped. Called with the lock held. */
static void maybe_free_handle(struct handle *gone) {
    if (!gone->released || gone->maps > 0) return;
    for (struct handle **h = &handles; *h; h = &(*h)->next) {
        if (*h == gone) {
            *h = gone->next;
            break;
        }
    }
    used_memory -= gone->size;
    close(gone->fd);
    free(gone);
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
    GUARD("cuMemCreate");
    NEED_CONTEXT();
    if (!handle || !prop || size == 0 || size % granularity || flags || prop->type != 1 || prop->location.type != 1)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.id < 0 || prop->location.id >= devices) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    if (!reserve_memory(size)) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&lock);
    int fd = memfd_create("fake-cuda-physical", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        pthread_mutex_lock(&lock);
        used_memory -= size;
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct handle *h = calloc(1, sizeof *h);
    h->size = size;
    h->fd = fd;
    pthread_mutex_lock(&lock);
    h->id = next_handle++;
    h->next = handles;
    handles = h;
    pthread_mutex_unlock(&lock);
    *handle = h->id;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle id) {
    GUARD("cuMemRelease");
    pthread_mutex_lock(&lock);
    struct handle *h = find_handle(id);
    if (!h || h->released) {
        CUresult result = invalid_free(CUDA_ERROR_INVALID_VALUE);
        pthread_mutex_unlock(&lock);
        return result;
    }
    h->released = 1;
    maybe_free_handle(h);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

static int inside_reservation(uintptr_t addr, size_t size) {
    for (struct reservation *r = reservations; r; r = r->next)
        if (addr >= r->addr && addr + size <= r->addr + r->size) return 1;
    return 0;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle id,
                         unsigned long long flags) {
    GUARD("cuMemMap");
    NEED_CONTEXT();
    if (size == 0 || size % granularity || offset % granularity || ptr % granularity || flags)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct handle *h = find_handle(id);
    CUresult result = CUDA_SUCCESS;
    if (!h || h->released || offset + size > h->size || !inside_reservation(ptr, size)) result = CUDA_ERROR_INVALID_VALUE;
    for (struct mapping *m = mappings; m && result == CUDA_SUCCESS; m = m->next)
        if (ptr < m->addr + m->size && m->addr < ptr + size) result = 208; /* CUDA_ERROR_ALREADY_MAPPED */
    if (result == CUDA_SUCCESS) {
        void *at = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, (off_t)offset);
        if (at == MAP_FAILED) {
            result = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            struct mapping *m = calloc(1, sizeof *m);
            m->addr = ptr;
            m->size = size;
            m->offset = offset;
            m->handle = h;
            m->prot = PROT_NONE;
            m->next = mappings;
            mappings = m;
            h->maps++;
        }
    }
    pthread_mutex_unlock(&lock);
    return result;
}

/* Collects the mappings that exactly tile [ptr, ptr+size); 0 if they do not. */
static int tile(uintptr_t ptr, size_t size, struct mapping **out, int max) {
    int n = 0;
    uintptr_t at = ptr;
    while (at < ptr + size) {
        struct mapping *found = NULL;
        for (struct mapping *m = mappings; m; m = m->next)
            if (m->addr == at) found = m;
        if (!found || found->addr + found->size > ptr + size || n == max) return 0;
        out[n++] = found;
        at += found->size;
    }
    return n;
}

EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    GUARD("cuMemSetAccess");
    NEED_CONTEXT();
    if (!desc || count != 1 || size == 0 || desc->location.type != 1) return CUDA_ERROR_INVALID_VALUE;
    if (desc->location.id < 0 || desc->location.id >= devices) return CUDA_ERROR_INVALID_DEVICE;
    int prot;
    switch (desc->flags) {
    case 0: prot = PROT_NONE; break;
    case 1: prot = PROT_READ; break;
    case 3: prot = PROT_READ | PROT_WRITE; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    static struct mapping *found[1 << 16];
    pthread_mutex_lock(&lock);
    int n = tile((uintptr_t)ptr, size, found, 1 << 16);
    if (n == 0) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (int i = 0; i < n; i++) found[i]->prot = prot;
    pthread_mutex_unlock(&lock);
    mprotect((void *)(uintptr_t)ptr, size, prot);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    GUARD("cuMemUnmap");
    NEED_CONTEXT();
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    static struct mapping *found[1 << 16];
    pthread_mutex_lock(&lock);
    int n = tile((uintptr_t)ptr, size, found, 1 << 16);
    if (n == 0) {
        CUresult result = invalid_free(CUDA_ERROR_INVALID_VALUE);
        pthread_mutex_unlock(&lock);
        return result;
    }
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    for (int i = 0; i < n; i++) {
        struct mapping *gone = found[i];
        for (struct mapping **m = &mappings; *m; m = &(*m)->next) {
            if (*m == gone) {
                *m = gone->next;
                break;
            }
        }
        gone->handle->maps--;
        maybe_free_handle(gone->handle);
        free(gone);
    }
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
