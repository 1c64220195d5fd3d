/* A runtime that loads libmemory_capi.so with dlopen, calls it from a worker thread and
 * dlcloses it while that thread still runs (a plugin host unloading the memory layer it
 * loaded, say). The library hands what a thread kept back from a pthread key destructor
 * when the thread exits (docs/C-ABI.md §3); glibc calls that destructor through its
 * address whether or not the object holding it is still mapped, so the library must stay
 * mapped: before the fix the worker's exit jumped into unmapped memory (SIGSEGV in
 * __nptl_deallocate_tsd). Usage: dlclose PATH-TO-libmemory_capi.so. */
#define _DEFAULT_SOURCE /* pthread_barrier_t */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memory_capi.h"

typedef McStatus (*registry_destroy_fn)(McRegistry *registry);
typedef McStatus (*registry_create_fn)(McRegistry **out);
typedef McStatus (*api_version_fn)(uint32_t *major, uint32_t *minor);

static const char *path;
static void *library;
static pthread_barrier_t step;

/* dlsym's object pointer as a function pointer (ISO C has no cast between them; POSIX
 * guarantees the representation). */
#define SYMBOL(function, handle, name)                                            \
    do {                                                                          \
        void *found_ = dlsym((handle), (name));                                   \
        if (found_ == NULL) {                                                     \
            fprintf(stderr, "dlsym %s: %s\n", (name), dlerror());                 \
            exit(1);                                                              \
        }                                                                         \
        memcpy(&(function), &found_, sizeof(function));                           \
    } while (0)

static void *worker(void *argument) {
    (void)argument;
    registry_destroy_fn destroy;
    SYMBOL(destroy, library, "mc_registry_destroy");
    /* A made-up registry handle: refused, but the call borrows, so this thread now has
     * a hazard slot and its hand-over armed. */
    McStatus status = destroy((McRegistry *)(uintptr_t)0x0100000100000007ull);
    if (status != MC_ERR_STALE_HANDLE && status != MC_ERR_INVALID_HANDLE) {
        fprintf(stderr, "mc_registry_destroy of a made-up handle returned %d\n", status);
        exit(1);
    }
    pthread_barrier_wait(&step); /* the main thread dlcloses the library now */
    pthread_barrier_wait(&step);
    return NULL; /* the library's key destructor runs as this thread exits */
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s PATH-TO-libmemory_capi.so\n", argv[0]);
        return 2;
    }
    path = argv[1];
    library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
        fprintf(stderr, "dlopen %s: %s\n", path, dlerror());
        return 1;
    }
    pthread_barrier_init(&step, NULL, 2);
    pthread_t thread;
    if (pthread_create(&thread, NULL, worker, NULL) != 0) return 1;
    pthread_barrier_wait(&step);
    if (dlclose(library) != 0) {
        fprintf(stderr, "dlclose: %s\n", dlerror());
        return 1;
    }
    void *still = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    printf("c dlclose: the library is %s after dlclose\n", still != NULL ? "still mapped" : "unmapped");
    pthread_barrier_wait(&step);
    pthread_join(thread, NULL); /* crashed here before: the key destructor was unmapped */
    printf("c dlclose: the worker thread exited\n");
    if (still == NULL) return 1;
    /* The library still works: a new call on this thread and a registry. */
    uint32_t major = 0, minor = 0;
    registry_create_fn create;
    registry_destroy_fn destroy;
    api_version_fn version;
    SYMBOL(create, still, "mc_registry_create");
    SYMBOL(destroy, still, "mc_registry_destroy");
    SYMBOL(version, still, "mc_api_version");
    McRegistry *registry = NULL;
    if (version(&major, &minor) != MC_OK || major != MC_API_MAJOR) return 1;
    if (create(&registry) != MC_OK || destroy(registry) != MC_OK) return 1;
    dlclose(still);
    pthread_barrier_destroy(&step);
    printf("c dlclose: checks passed\n");
    return 0;
}
