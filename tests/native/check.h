/* The harness both native test programs share: CHECK and CHECK_EQ (counted in
 * g_checks, fatal on failure), die, now_ms, sleep_us, A. A failure is reported
 * through FAILED_AT(fmt, ...), which the including program defines with its own
 * context (test name; or seed, iteration and session). */
#ifndef KV_TEST_CHECK_H
#define KV_TEST_CHECK_H

#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

static unsigned long g_checks;

static inline void die(void) {
    fflush(stdout);
    fflush(stderr);
    _exit(1);
}

#define CHECK(cond)                                                              \
    do {                                                                         \
        __sync_fetch_and_add(&g_checks, 1); /* CHECK runs on several threads */ \
        if (!(cond)) {                                                           \
            FAILED_AT("CHECK failed: %s", #cond);                                \
            die();                                                               \
        }                                                                        \
    } while (0)

#define CHECK_EQ(a, b)                                                                            \
    do {                                                                                          \
        uint64_t a_ = (uint64_t)(a), b_ = (uint64_t)(b);                                          \
        __sync_fetch_and_add(&g_checks, 1);                                                       \
        if (a_ != b_) {                                                                           \
            FAILED_AT("CHECK failed: %s == %s (0x%" PRIx64 " != 0x%" PRIx64 ")", #a, #b, a_, b_); \
            die();                                                                                \
        }                                                                                         \
    } while (0)

static inline double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static inline void sleep_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static inline uint64_t A(const void *p) { return (uint64_t)(uintptr_t)p; }

#endif
