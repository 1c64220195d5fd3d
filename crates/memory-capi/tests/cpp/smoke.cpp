// The C API from C++17, with the runtime's own allocator handed over as a vtable (the
// plugin ABI's MpAllocator): register -> bind -> allocate -> release -> invalidate ->
// confirm -> snapshot, checking every status.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "memory_capi.h"

namespace {

int checks = 0;

void expect(McStatus status, McStatus expected, const char *what, int line) {
    ++checks;
    if (status != expected) {
        std::fprintf(stderr, "smoke.cpp:%d: %s returned %s, expected %s: %s\n", line, what, mc_status_name(status),
                     mc_status_name(expected), mc_last_error_message());
        std::exit(1);
    }
}

#define EXPECT(call, expected) expect((call), (expected), #call, __LINE__)
#define OK(call) EXPECT(call, MC_OK)
#define TRUE(condition) expect((condition) ? MC_OK : MC_ERR_STATE, MC_OK, #condition, __LINE__)

// The runtime's allocator: host memory from aligned_alloc, counted.
struct Arena {
    std::atomic<uint64_t> live{0};
    std::atomic<uint64_t> destroyed{0};
    MpDevice device{MP_TIER_HOST, 7};
};

MpStatus arena_allocate(void *instance, const MpRequest *request, MpBlock *out) {
    auto *arena = static_cast<Arena *>(instance);
    uint64_t align = request->align < 16 ? 16 : request->align;
    uint64_t bytes = (request->bytes + align - 1) / align * align;
    void *memory = std::aligned_alloc(align, bytes == 0 ? align : bytes);
    if (memory == nullptr) {
        return MP_ERR_OUT_OF_MEMORY;
    }
    *out = MpBlock{reinterpret_cast<uint64_t>(memory), request->bytes, align, arena->device, 0};
    arena->live++;
    return MP_OK;
}

MpStatus arena_release(void *instance, const MpBlock *block, MpReleaseOutcome *) {
    std::free(reinterpret_cast<void *>(block->address));
    static_cast<Arena *>(instance)->live--;
    return MP_OK;
}

// Blocks lost with their device: this host memory is still ours to free.
MpStatus arena_forget(void *instance, const MpBlock *block) { return arena_release(instance, block, nullptr); }

void arena_destroy(void *instance) { static_cast<Arena *>(instance)->destroyed++; }

}  // namespace

int main() {
    Arena arena;
    MpAllocator table{};
    table.header = MpHeader{static_cast<uint32_t>(sizeof(MpAllocator)), MP_ABI_MAJOR, MP_ABI_MINOR};
    table.capabilities = 0;
    table.instance = &arena;
    table.name = "cpp-arena";
    table.device = arena.device;
    table.allocate = arena_allocate;
    table.release = arena_release;
    table.destroy = arena_destroy;
    table.forget_lost = arena_forget;

    McRegistry *registry = nullptr;
    McGovernor *governor = nullptr;
    McContext *context = nullptr;
    McAuthority *tenant = nullptr;
    McMechanism *mechanism = nullptr;
    McBinding *binding = nullptr;
    OK(mc_registry_create(&registry));
    OK(mc_governor_create(&governor));
    OK(mc_context_register(registry, arena.device, nullptr, nullptr, &context));
    OK(mc_authority_register(registry, arena.device, nullptr, nullptr, &tenant));
    OK(mc_governor_open_account(governor, tenant, UINT64_MAX, "cpp-tenant"));

    // A table that is too short is refused, and nothing of it is called.
    MpAllocator short_table = table;
    short_table.header.struct_size = MP_ALLOCATOR_SIZE_V1_0 - 8;
    EXPECT(mc_register_vtable(registry, governor, context, tenant, &short_table, &mechanism), MC_ERR_PLUGIN);
    TRUE(std::string(mc_last_error_message()).find("needs at least") != std::string::npos);

    // A refused registration leaves the instance the caller's: `destroy` is not called,
    // whether the table's content is refused (no allocate slot) or the registry refuses
    // it after negotiation (a context of another registry).
    MpAllocator no_allocate = table;
    no_allocate.allocate = nullptr;
    EXPECT(mc_register_vtable(registry, governor, context, tenant, &no_allocate, &mechanism), MC_ERR_PLUGIN);
    TRUE(arena.destroyed == 0);
    McRegistry *other_registry = nullptr;
    McContext *other_context = nullptr;
    OK(mc_registry_create(&other_registry));
    OK(mc_context_register(other_registry, arena.device, nullptr, nullptr, &other_context));
    EXPECT(mc_register_vtable(registry, governor, other_context, tenant, &table, &mechanism), MC_ERR_FOREIGN);
    TRUE(arena.destroyed == 0);
    TRUE(mechanism == nullptr);

    OK(mc_register_vtable(registry, governor, context, tenant, &table, &mechanism));
    OK(mc_bind_mechanism(registry, mechanism, &binding));

    std::vector<McAllocation *> blocks(8, nullptr);
    for (McAllocation *&block : blocks) {
        OK(mc_allocate(binding, 1000, 64, MP_ROLE_ACTIVATIONS, &block));
    }
    TRUE(arena.live == 8);
    McAllocationInfo info{};
    OK(mc_allocation_info(blocks[0], &info));
    TRUE(info.address % 64 == 0 && info.device.index == 7);
    for (int i = 0; i < 6; ++i) {
        McReleaseReport report{};
        OK(mc_release(binding, blocks[i], &report));
        TRUE(report.kind == MC_RELEASE_COMPLETE);
        EXPECT(mc_release(binding, blocks[i], &report), MC_ERR_STALE_HANDLE);
    }
    TRUE(arena.live == 2);

    // Without the capability, a plugin queue is unsupported.
    McQueue *queue = nullptr;
    EXPECT(mc_plugin_queue_create(mechanism, 4, &queue), MC_ERR_UNSUPPORTED);

    McInvalidation invalidation{};
    McTermination termination{};
    OK(mc_invalidate_device(registry, arena.device, nullptr, &invalidation));
    TRUE(invalidation.mechanisms == 1);
    EXPECT(mc_release(binding, blocks[6], nullptr), MC_ERR_DEVICE_LOST);
    OK(mc_confirm_terminated(registry, context, &termination));
    TRUE(termination.lost_allocations == 2);
    TRUE(arena.live == 0);

    size_t length = 0;
    EXPECT(mc_snapshot_json(registry, governor, nullptr, 0, &length), MC_ERR_BUFFER_TOO_SMALL);
    std::string json(length + 1, '\0');
    OK(mc_snapshot_json(registry, governor, json.data(), json.size(), &length));
    TRUE(json.find("cpp-arena") != std::string::npos && json.find("cpp-tenant") != std::string::npos);

    OK(mc_allocation_drop(blocks[6]));
    OK(mc_allocation_drop(blocks[7]));
    OK(mc_binding_destroy(binding));
    OK(mc_mechanism_remove(registry, mechanism));
    OK(mc_context_remove(registry, context));
    OK(mc_authority_remove(registry, tenant));
    OK(mc_registry_destroy(registry));
    OK(mc_governor_destroy(governor));
    OK(mc_context_remove(other_registry, other_context));
    OK(mc_registry_destroy(other_registry));
    TRUE(arena.destroyed == 1);
    std::printf("c++ smoke: %d checks passed\n", checks);
    return 0;
}
