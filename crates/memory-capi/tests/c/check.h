/* Checks shared by the C test programs: every status is compared with the one
 * expected, and every failure's message is checked to name no Rust item (a C caller
 * is told which C function to call, never `Governor::set_quota` or "call select"). */
#ifndef MEMORY_CAPI_TEST_CHECK_H
#define MEMORY_CAPI_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memory_capi.h"

static int checks;
static int messages_checked;

/* What a message reaching C must not contain: Rust paths, and the advice that named
 * Rust methods before it was put in C terms (issue 23, item 6). */
static const char *const RUST_ITEMS[] = {
    "::",        "Governor",   "call select",          "call invalidate_device", "confirm_context_terminated",
    "ReclaimThenFail",         "register_trusted_composite",   "BoundAllocation",        "MemoryBinding",
    "BindingRegistry",         "Rejected",   "Some(",  "None)",
};

static void check_message(const char *file, int line, const char *call, McStatus status) {
    const char *message = mc_last_error_message();
    messages_checked++;
#ifdef PRINT_MESSAGES /* to read them all: build with -DPRINT_MESSAGES */
    printf("%s:%d: %s\n", file, line, message);
#endif
    if (status != MC_OK && message[0] == '\0') {
        fprintf(stderr, "%s:%d: %s failed with %s and left no message\n", file, line, call, mc_status_name(status));
        exit(1);
    }
    for (size_t i = 0; i < sizeof RUST_ITEMS / sizeof RUST_ITEMS[0]; i++) {
        /* Capitalised, "Governor" is the Rust type; the C functions are mc_governor_*. */
        const char *found = strstr(message, RUST_ITEMS[i]);
        if (found != NULL) {
            fprintf(stderr, "%s:%d: the message of %s names a Rust item (\"%s\"): %s\n", file, line, call,
                    RUST_ITEMS[i], message);
            exit(1);
        }
    }
}

#define EXPECT(call, expected)                                                                          \
    do {                                                                                                \
        McStatus status_ = (call);                                                                      \
        checks++;                                                                                       \
        if (status_ != (expected)) {                                                                    \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s: %s\n", __FILE__, __LINE__, #call,      \
                    mc_status_name(status_), mc_status_name(expected), mc_last_error_message());         \
            exit(1);                                                                                    \
        }                                                                                               \
        if (status_ != MC_OK) check_message(__FILE__, __LINE__, #call, status_);                        \
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
/* The last failure's message contains `text`. */
#define SAYS(text)                                                                                      \
    do {                                                                                                \
        checks++;                                                                                       \
        if (strstr(mc_last_error_message(), (text)) == NULL) {                                          \
            fprintf(stderr, "%s:%d: the message does not say \"%s\": %s\n", __FILE__, __LINE__, (text), \
                    mc_last_error_message());                                                           \
            exit(1);                                                                                    \
        }                                                                                               \
    } while (0)

#endif
