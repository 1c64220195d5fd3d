/* A C runtime that exits without tearing down: one of every kind of handle (registry,
 * governor, context, authority, account, mechanism, binding, allocation) is still live
 * when main returns. docs/C-ABI.md section 2 says what a leak checker reports then: no
 * block definitely or indirectly lost; what it reports as "possibly lost" (blocks the
 * live handles reach only through pointers into them) or still reachable is memory the
 * handles still own. tests/programs.rs runs it under valgrind. */
#include <stdint.h>
#include <stdio.h>

#include "memory_capi.h"

#define HOST ((MpDevice){MP_TIER_HOST, 0})
#define OK(call)                                                                              \
    do {                                                                                      \
        McStatus status_ = (call);                                                            \
        if (status_ != MC_OK) {                                                               \
            fprintf(stderr, "%s: %s: %s\n", #call, mc_status_name(status_), mc_last_error_message()); \
            return 1;                                                                         \
        }                                                                                     \
    } while (0)

int main(void) {
    McRegistry *registry;
    McGovernor *governor;
    McContext *context;
    McAuthority *authority;
    McMechanism *mechanism;
    McBinding *binding;
    McAllocation *allocation;
    OK(mc_registry_create(&registry));
    OK(mc_governor_create(&governor));
    OK(mc_context_register(registry, HOST, NULL, NULL, &context));
    OK(mc_authority_register(registry, HOST, NULL, NULL, &authority));
    OK(mc_governor_open_account(governor, authority, UINT64_MAX, "live at exit"));
    OK(mc_register_cpu_allocator(registry, governor, context, authority, MC_CPU_POOLED, &mechanism));
    OK(mc_bind(registry, HOST, &binding));
    OK(mc_allocate(binding, 4096, 64, MP_ROLE_ACTIVATIONS, &allocation));
    printf("live at exit: 8 handles left live\n");
    return 0;
}
