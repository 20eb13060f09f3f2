/* Standalone test of the kvengine native core (cython_src/csrc/kv_core.c).
 *
 * No Python, no framework: CHECK prints file:line and exits 1 on the first
 * failure; a clean run ends with "N passed, 0 failed". Built and run by
 * tests/test_native_c.py (ASan+UBSan, and plain -O2) and by
 * tests/native/run_asan.sh.
 *
 * Every wait is bounded (poll(2) with a timeout, plus a SIGALRM watchdog), so
 * a core bug fails the run instead of hanging it.
 */
#include "kv_core.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------ harness */

#define KiB ((uint64_t)1024)
#define MiB (1024 * KiB)
#define WATCHDOG_SECONDS 90
#define WAIT_MS 10000 /* the most any single wait for completions may take */

static const char *g_test = "?";

#define FAILED_AT(fmt, ...) fprintf(stderr, "%s:%d: [%s] " fmt "\n", __FILE__, __LINE__, g_test, __VA_ARGS__)
#include "check.h"

static uint8_t *xmap(uint64_t n) {
    void *p = mmap(NULL, (size_t)n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(p != MAP_FAILED);
    return p;
}

static void xunmap(void *p, uint64_t n) { CHECK(munmap(p, (size_t)n) == 0); }

/* Deterministic, seed-dependent bytes (no two seeds alike). */
static void fill(uint8_t *p, uint64_t n, uint64_t seed) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(p + i, &x, 8);
    }
    for (; i < n; i++)
        p[i] = (uint8_t)(seed + i);
}

/* 1 if all n bytes at p equal v. */
static int all_eq(const uint8_t *p, uint64_t n, uint8_t v) {
    static uint8_t ref[64 * 1024];
    memset(ref, v, sizeof ref);
    while (n) {
        size_t k = n < sizeof ref ? (size_t)n : sizeof ref;
        if (memcmp(p, ref, k) != 0)
            return 0;
        p += k;
        n -= k;
    }
    return 1;
}

static void seg(uint64_t *w, uint32_t sr, uint64_t so, uint32_t dr, uint64_t dof, uint64_t n) {
    w[0] = sr;
    w[1] = so;
    w[2] = dr;
    w[3] = dof;
    w[4] = n;
}

static kv_core *mk(int movers, uint64_t chunk) {
    kv_core *c = NULL;
    CHECK_EQ(kv_core_new(&c, movers, chunk), KV_LLM_SUCCESS);
    CHECK(c != NULL);
    return c;
}

static uint32_t add_region(kv_core *c, int kind, int32_t pid, const void *p, uint64_t n,
                           int unmap) {
    uint32_t id = 0;
    CHECK_EQ(kv_region_add(c, kind, pid, A(p), n, unmap, &id), KV_LLM_SUCCESS);
    CHECK(id != 0);
    return id;
}

static uint32_t add_local(kv_core *c, const void *p, uint64_t n) {
    return add_region(c, KV_REGION_LOCAL, 0, p, n, 0);
}

static uint32_t add_proc(kv_core *c, pid_t pid, const void *p, uint64_t n) {
    return add_region(c, KV_REGION_PROCESS, (int32_t)pid, p, n, 0);
}

/* Submit a job that must go to the movers. */
static void submit_async(kv_core *c, uint64_t id, const uint64_t *segs, size_t nsegs) {
    int done = -1;
    uint64_t nb = 99;
    CHECK_EQ(kv_core_submit(c, id, segs, nsegs, 0, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(done, 0);
    CHECK_EQ(nb, 0);
}

static int readable_now(kv_core *c) {
    struct pollfd p = {kv_core_fileno(c), POLLIN, 0};
    int r;
    do
        r = poll(&p, 1, 0);
    while (r < 0 && errno == EINTR);
    CHECK(r >= 0);
    return r > 0 && (p.revents & POLLIN);
}

/* Wait (poll(2) on the eventfd) and drain until `want` completions arrived or
 * timeout_ms passed. Returns how many arrived. */
static size_t drain(kv_core *c, kv_completion *out, size_t want, int timeout_ms) {
    size_t got = 0;
    double end = now_ms() + timeout_ms;
    while (got < want) {
        double left = end - now_ms();
        if (left <= 0)
            break;
        struct pollfd p = {kv_core_fileno(c), POLLIN, 0};
        int r = poll(&p, 1, (int)left + 1);
        if (r < 0 && errno == EINTR)
            continue;
        CHECK(r >= 0);
        if (r == 0)
            continue;
        CHECK(p.revents & POLLIN);
        got += kv_core_poll(c, out + got, want - got);
    }
    return got;
}

/* Exactly one completion, for `id`. */
static kv_completion wait_one(kv_core *c, uint64_t id) {
    kv_completion cp;
    memset(&cp, 0, sizeof cp);
    CHECK_EQ(drain(c, &cp, 1, WAIT_MS), 1);
    CHECK_EQ(cp.job_id, id);
    return cp;
}

/* No further completion turns up (give stragglers a moment). */
static void check_no_more(kv_core *c) {
    kv_completion cp;
    sleep_us(5000);
    CHECK_EQ(kv_core_poll(c, &cp, 1), 0);
}

static kv_stats stats(kv_core *c) {
    kv_stats s;
    memset(&s, 0xEE, sizeof s);
    kv_core_stats(c, &s);
    return s;
}

/* Counters that must hold whenever nothing is in flight. */
static void check_quiet_stats(kv_core *c) {
    kv_stats s = stats(c);
    CHECK_EQ(s.jobs_live, 0);
    CHECK_EQ(s.jobs_completed, s.jobs_submitted);
    CHECK(s.jobs_aborted <= s.jobs_submitted);
}

/* Entries of a /proc directory (threads in task/, descriptors in fd/). */
static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    CHECK(d != NULL);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n;
}

static int count_tasks(void) { return count_entries("/proc/self/task"); }

/* A joined thread can linger in /proc/self/task for a moment after join. */
static int wait_tasks(int want) {
    double end = now_ms() + 2000;
    int n;
    while ((n = count_tasks()) != want && now_ms() < end)
        sleep_us(1000);
    return n;
}

static int is_mapped(uint64_t addr) {
    unsigned char v;
    long pg = sysconf(_SC_PAGESIZE);
    if (mincore((void *)(uintptr_t)addr, (size_t)pg, &v) == 0)
        return 1;
    CHECK_EQ(errno, ENOMEM); /* ENOMEM: the page is not mapped */
    return 0;
}

/* ------------------------------------------------------------- tests */

static void test_new_params(void) {
    int base = count_tasks();
    static const struct {
        int movers;
        uint64_t chunk;
    } bad[] = {{0, 65536}, {-1, 65536}, {65, 65536}, {1000, 65536}, {1, 0}, {1, 4095}, {0, 0}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kv_core *c = NULL;
        CHECK_EQ(kv_core_new(&c, bad[i].movers, bad[i].chunk), KV_LLM_PARAM_INVALID);
        CHECK(c == NULL);
    }
    CHECK_EQ(count_tasks(), base);

    kv_core *c = mk(1, 4096);
    int fd = kv_core_fileno(c);
    CHECK(fd >= 0);
    CHECK(fcntl(fd, F_GETFL) & O_NONBLOCK);
    CHECK(fcntl(fd, F_GETFD) & FD_CLOEXEC);
    CHECK(!readable_now(c));
    CHECK_EQ(wait_tasks(base + 1), base + 1);
    kv_stats s = stats(c);
    CHECK_EQ(s.jobs_submitted, 0);
    CHECK_EQ(s.jobs_inline, 0);
    CHECK_EQ(s.jobs_completed, 0);
    CHECK_EQ(s.jobs_aborted, 0);
    CHECK_EQ(s.jobs_live, 0);
    CHECK_EQ(s.bytes_moved, 0);
    CHECK_EQ(s.regions_live, 0);
    CHECK_EQ(s.wakeups, 0);
    kv_core_close(c);
    kv_core_close(c); /* idempotent */
    CHECK_EQ(wait_tasks(base), base);
    kv_core_free(c);

    c = mk(64, 1 << 20); /* the maximum */
    CHECK_EQ(wait_tasks(base + 64), base + 64);
    kv_core_free(c); /* free without close closes */
    CHECK_EQ(wait_tasks(base), base);
    kv_core_free(NULL);
}

static void test_regions(void) {
    kv_core *c = mk(1, 65536);
    static uint8_t buf[8192];
    uint64_t a = A(buf);
    uint32_t id = 12345;
    /* bad arguments; *region_id untouched */
    CHECK_EQ(kv_region_add(c, KV_REGION_LOCAL, 0, 0, 10, 0, &id), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_region_add(c, KV_REGION_LOCAL, 0, a, 0, 0, &id), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_region_add(c, KV_REGION_LOCAL, 0, UINT64_MAX - 9, 10, 0, &id),
             KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_region_add(c, KV_REGION_LOCAL, 0, UINT64_MAX, 1, 0, &id), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_region_add(c, KV_REGION_LOCAL, 0, 1, UINT64_MAX, 0, &id), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_region_add(c, 2, 0, a, 10, 0, &id), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_region_add(c, -1, 0, a, 10, 0, &id), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_region_add(c, KV_REGION_PROCESS, 0, a, 10, 0, &id), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_region_add(c, KV_REGION_PROCESS, -5, a, 10, 0, &id), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_region_add(c, KV_REGION_PROCESS, (int32_t)getpid(), a, 10, 1, &id),
             KV_LLM_PARAM_INVALID);
    CHECK_EQ(id, 12345);
    CHECK_EQ(stats(c).regions_live, 0);

    /* 300 regions: the table grows several times; ids start at 1, strictly increase */
    enum { NR = 300 };
    uint32_t ids[NR];
    for (int i = 0; i < NR; i++) {
        ids[i] = add_local(c, buf + i, sizeof buf - (size_t)i);
        CHECK(ids[i] >= 1);
        if (i)
            CHECK(ids[i] > ids[i - 1]);
    }
    CHECK_EQ(stats(c).regions_live, NR);
    for (int i = 0; i < NR; i += 2)
        CHECK_EQ(kv_region_remove(c, ids[i]), KV_LLM_SUCCESS);
    for (int i = 0; i < NR; i += 2) /* remove twice */
        CHECK_EQ(kv_region_remove(c, ids[i]), KV_LLM_KV_CACHE_NOT_EXIST);
    CHECK_EQ(stats(c).regions_live, NR / 2);
    CHECK_EQ(kv_region_remove(c, 0), KV_LLM_KV_CACHE_NOT_EXIST);
    CHECK_EQ(kv_region_remove(c, ids[NR - 1] + 1), KV_LLM_KV_CACHE_NOT_EXIST);
    CHECK_EQ(kv_region_remove(c, UINT32_MAX), KV_LLM_KV_CACHE_NOT_EXIST);
    /* ids are never reused */
    uint32_t fresh = add_local(c, buf, sizeof buf);
    CHECK(fresh > ids[NR - 1]);
    uint32_t pr = add_proc(c, getpid(), buf, sizeof buf);
    CHECK(pr > fresh);
    CHECK_EQ(kv_region_remove(c, pr), KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_remove(c, pr), KV_LLM_KV_CACHE_NOT_EXIST);
    /* a removed id stays unusable */
    uint64_t w[KV_SEG_WORDS];
    int done;
    uint64_t nb;
    seg(w, ids[0], 0, fresh, 0, 16);
    CHECK_EQ(kv_core_submit(c, 1, w, 1, UINT64_MAX, &done, &nb), KV_LLM_KV_CACHE_NOT_EXIST);
    CHECK_EQ(stats(c).regions_live, NR / 2 + 1);
    kv_core_free(c); /* frees the live regions (LSan checks) */
}

static void test_submit_validation(void) {
    kv_core *c = mk(2, 65536);
    const uint64_t n = 65536;
    uint8_t *src = xmap(n), *dst = xmap(n), *src_ref = xmap(n);
    fill(src, n, 1);
    memcpy(src_ref, src, (size_t)n);
    memset(dst, 0x5A, (size_t)n);
    uint32_t rs = add_local(c, src, n), rd = add_local(c, dst, n);
    uint32_t rgone = add_local(c, src, n);
    CHECK_EQ(kv_region_remove(c, rgone), KV_LLM_SUCCESS);
    uint32_t rp1 = add_proc(c, getpid(), src, n), rp2 = add_proc(c, getpid(), dst, n);
    /* a huge fake region (never touched: only used by jobs that must be rejected) */
    uint32_t rbig = add_region(c, KV_REGION_LOCAL, 0, (const void *)(uintptr_t)4096,
                               UINT64_MAX - 4096, 0);
    const uint64_t H = 1ull << 63;
    const uint64_t M = UINT64_MAX;

    static struct {
        uint64_t w[2][KV_SEG_WORDS];
        size_t nsegs;
        uint32_t want;
    } cases[32];
    size_t nc = 0;
#define CASE1(a, b, c_, d, e, st)                                                            \
    do {                                                                                     \
        seg(cases[nc].w[0], 0, 0, 0, 0, 0);                                                  \
        cases[nc].w[0][0] = (a);                                                             \
        cases[nc].w[0][1] = (b);                                                             \
        cases[nc].w[0][2] = (c_);                                                            \
        cases[nc].w[0][3] = (d);                                                             \
        cases[nc].w[0][4] = (e);                                                             \
        cases[nc].nsegs = 1;                                                                 \
        cases[nc].want = (st);                                                               \
        nc++;                                                                                \
    } while (0)
#define CASE2(first, a, b, c_, d, e, st)                                                     \
    do {                                                                                     \
        CASE1(a, b, c_, d, e, st);                                                           \
        memcpy(cases[nc - 1].w[1], cases[nc - 1].w[0], sizeof cases[0].w[0]);                \
        memcpy(cases[nc - 1].w[0], (first), sizeof cases[0].w[0]);                          \
        cases[nc - 1].nsegs = 2;                                                             \
    } while (0)
    uint64_t valid[KV_SEG_WORDS], valid_proc[KV_SEG_WORDS], big[KV_SEG_WORDS];
    seg(valid, rs, 0, rd, 0, 4096);
    seg(valid_proc, rs, 0, rp2, 4096, 4096);
    seg(big, rbig, 0, rbig, 0, H);

    CASE1(999, 0, rd, 0, 16, KV_LLM_KV_CACHE_NOT_EXIST);
    CASE1(rs, 0, 999, 0, 16, KV_LLM_KV_CACHE_NOT_EXIST);
    CASE1(0, 0, rd, 0, 16, KV_LLM_KV_CACHE_NOT_EXIST);
    CASE1(rs, 0, 0, 0, 16, KV_LLM_KV_CACHE_NOT_EXIST);
    CASE1((1ull << 32) | rs, 0, rd, 0, 16, KV_LLM_KV_CACHE_NOT_EXIST); /* no truncation */
    CASE1(rs, 0, (1ull << 32) | rd, 0, 16, KV_LLM_KV_CACHE_NOT_EXIST);
    CASE1(rgone, 0, rd, 0, 16, KV_LLM_KV_CACHE_NOT_EXIST);
    CASE1(rs, 0, rgone, 0, 16, KV_LLM_KV_CACHE_NOT_EXIST);
    CASE1(rs, n, rd, 0, 1, KV_LLM_PARAM_INVALID);
    CASE1(rs, n - 8, rd, 0, 9, KV_LLM_PARAM_INVALID);
    CASE1(rs, 0, rd, n - 8, 9, KV_LLM_PARAM_INVALID);
    CASE1(rs, 0, rd, n, 1, KV_LLM_PARAM_INVALID);
    CASE1(rs, 0, rd, 0, n + 1, KV_LLM_PARAM_INVALID);
    CASE1(rs, M - 1, rd, 0, 2, KV_LLM_PARAM_INVALID);
    CASE1(rs, M - 1, rd, 0, 4, KV_LLM_PARAM_INVALID);
    CASE1(rs, 0, rd, M - 1, 2, KV_LLM_PARAM_INVALID);
    CASE1(rs, 0, rd, M, 1, KV_LLM_PARAM_INVALID);
    CASE1(rs, 8, rd, 0, M, KV_LLM_PARAM_INVALID);
    CASE1(rs, 0, rd, 8, M - 7, KV_LLM_PARAM_INVALID);
    CASE1(rs, 0, rd, 0, 0, KV_LLM_PARAM_INVALID); /* len 0 */
    CASE1(rp1, 0, rp2, 0, 16, KV_LLM_PARAM_INVALID); /* two PROCESS regions */
    /* a valid first segment must not be copied when a later one is rejected */
    CASE2(valid, rs, 0, rd, 0, n + 1, KV_LLM_PARAM_INVALID);
    CASE2(valid, rs, 0, 999, 0, 16, KV_LLM_KV_CACHE_NOT_EXIST);
    CASE2(valid, rs, 0, rd, 0, 0, KV_LLM_PARAM_INVALID);
    CASE2(valid_proc, rs, M - 1, rd, 0, 2, KV_LLM_PARAM_INVALID);
    CASE2(valid_proc, rp1, 0, rp2, 0, 16, KV_LLM_PARAM_INVALID);
    CASE2(valid, rs, 0, rgone, 0, 16, KV_LLM_KV_CACHE_NOT_EXIST);
    /* total bytes overflow uint64: 2^63 + 2^63 */
    CASE2(big, rbig, 0, rbig, 0, H, KV_LLM_PARAM_INVALID);
#undef CASE1
#undef CASE2
    CHECK(nc <= sizeof cases / sizeof cases[0]);

    const uint64_t inline_max[] = {0, 1 << 20, UINT64_MAX};
    for (size_t k = 0; k < 3; k++) {
        for (size_t i = 0; i < nc; i++) {
            int done = -1;
            uint64_t nb = 99;
            uint32_t st = kv_core_submit(c, 100 + i, &cases[i].w[0][0], cases[i].nsegs,
                                         inline_max[k], &done, &nb);
            if (st != cases[i].want)
                fprintf(stderr, "case %zu inline_max %" PRIu64 "\n", i, inline_max[k]);
            CHECK_EQ(st, cases[i].want);
            CHECK_EQ(done, 0);
            CHECK_EQ(nb, 0);
            CHECK(all_eq(dst, n, 0x5A)); /* nothing written */
            CHECK(memcmp(src, src_ref, (size_t)n) == 0);
        }
        /* nsegs 0, and an nsegs whose allocation size would overflow */
        int done = -1;
        uint64_t nb = 99;
        CHECK_EQ(kv_core_submit(c, 7, valid, 0, inline_max[k], &done, &nb),
                 KV_LLM_PARAM_INVALID);
        CHECK_EQ(done, 0);
        CHECK_EQ(kv_core_submit(c, 7, valid, SIZE_MAX / 8, inline_max[k], &done, &nb),
                 KV_LLM_PARAM_INVALID);
        CHECK_EQ(kv_core_submit(c, 7, valid, SIZE_MAX, inline_max[k], &done, &nb),
                 KV_LLM_PARAM_INVALID);
    }
    check_no_more(c);
    CHECK(!readable_now(c));
    kv_stats s = stats(c);
    CHECK_EQ(s.jobs_submitted, 0);
    CHECK_EQ(s.jobs_inline, 0);
    CHECK_EQ(s.jobs_live, 0);
    CHECK_EQ(s.jobs_completed, 0);
    CHECK_EQ(s.bytes_moved, 0);
    /* rejected jobs hold no region reference: removal releases at once */
    CHECK_EQ(s.regions_live, 5);
    CHECK_EQ(kv_region_remove(c, rs), KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_remove(c, rd), KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_remove(c, rp1), KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_remove(c, rp2), KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_remove(c, rbig), KV_LLM_SUCCESS);
    CHECK_EQ(stats(c).regions_live, 0);
    kv_core_free(c);
    xunmap(src, n);
    xunmap(dst, n);
    xunmap(src_ref, n);
}

static void test_inline(void) {
    kv_core *c = mk(1, 65536);
    const uint64_t n = 65536;
    uint8_t *src = xmap(n), *dst = xmap(n), *ref = xmap(n);
    fill(src, n, 2);
    uint32_t rs = add_local(c, src, n), rd = add_local(c, dst, n);
    uint64_t w[3 * KV_SEG_WORDS];
    seg(w, rs, 100, rd, 5000, 4000);
    seg(w + 5, rs, 30000, rd, 0, 4096);
    seg(w + 10, rs, 0, rd, 20000, 4192);
    memcpy(ref + 5000, src + 100, 4000);
    memcpy(ref + 0, src + 30000, 4096);
    memcpy(ref + 20000, src + 0, 4192);
    int done = -1;
    uint64_t nb = 0;
    /* total == inline_max: inline */
    CHECK_EQ(kv_core_submit(c, 1, w, 3, 12288, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(done, 1);
    CHECK_EQ(nb, 12288);
    CHECK(memcmp(dst, ref, (size_t)n) == 0);
    CHECK(!readable_now(c)); /* no completion posted */
    check_no_more(c);
    kv_stats s = stats(c);
    CHECK_EQ(s.jobs_inline, 1);
    CHECK_EQ(s.jobs_submitted, 0);
    CHECK_EQ(s.jobs_completed, 0);
    CHECK_EQ(s.jobs_live, 0);
    CHECK_EQ(s.bytes_moved, 12288);
    /* inline ids are not tracked: the same id again is fine */
    CHECK_EQ(kv_core_submit(c, 1, w, 3, 12288, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(done, 1);

    /* overlapping source and destination in one region: the inline path copies a
     * segment with memmove (kv_core.h leaves overlap unspecified for mover jobs) */
    uint32_t rsame = add_local(c, dst, n);
    fill(dst, n, 3);
    memcpy(ref, dst, (size_t)n);
    memmove(ref + 100, ref, 10000);
    memmove(ref + 30000, ref + 30100, 10000);
    seg(w, rsame, 0, rsame, 100, 10000);
    seg(w + 5, rsame, 30100, rsame, 30000, 10000);
    CHECK_EQ(kv_core_submit(c, 2, w, 2, UINT64_MAX, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(done, 1);
    CHECK_EQ(nb, 20000);
    CHECK(memcmp(dst, ref, (size_t)n) == 0);

    /* total == inline_max + 1: goes to the movers */
    memset(dst, 0, (size_t)n);
    seg(w, rs, 0, rd, 0, 12289);
    CHECK_EQ(kv_core_submit(c, 3, w, 1, 12288, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(done, 0);
    kv_completion cp = wait_one(c, 3);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, 12289);
    CHECK(memcmp(dst, src, 12289) == 0);
    CHECK(all_eq(dst + 12289, n - 12289, 0));

    /* a job that reads or writes another process's memory (CMA) is never copied on
     * the calling thread, whatever its size (that process may hold the copy in the
     * kernel: kv_core.h): refused, nothing of it moves, nothing is posted or kept */
    long pg = sysconf(_SC_PAGESIZE);
    void *noacc = mmap(NULL, (size_t)pg, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(noacc != MAP_FAILED);
    uint32_t rbad = add_proc(c, getpid(), noacc, (uint64_t)pg);
    memset(dst, 0, (size_t)n);
    seg(w, rs, 0, rd, 0, 4096);
    seg(w + 5, rs, 0, rbad, 0, 64);
    nb = 7;
    CHECK_EQ(kv_core_submit(c, 4, w, 2, UINT64_MAX, &done, &nb), KV_INLINE_REFUSED);
    CHECK_EQ(done, 0);
    CHECK_EQ(nb, 0);
    CHECK(all_eq(dst, 4096, 0)); /* not even its local segment */
    CHECK(!readable_now(c));
    check_no_more(c);
    check_quiet_stats(c);
    /* the movers take it (inline_max 0): the copy that fails part-way completes with
     * the status and the bytes of the good segment */
    CHECK_EQ(kv_core_submit(c, 4, w, 2, 0, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(done, 0);
    cp = wait_one(c, 4);
    CHECK_EQ(cp.status, KV_LLM_FAILED);
    CHECK_EQ(cp.nbytes, 4096);
    CHECK(memcmp(dst, src, 4096) == 0);
    check_quiet_stats(c);
    s = stats(c);
    CHECK_EQ(s.jobs_inline, 3);
    CHECK_EQ(s.jobs_submitted, 2);
    CHECK_EQ(s.regions_live, 4);
    kv_core_free(c);
    CHECK(munmap(noacc, (size_t)pg) == 0);
    xunmap(src, n);
    xunmap(dst, n);
    xunmap(ref, n);
}

static void test_mover(void) {
    kv_core *c = mk(2, 64 * KiB);
    const uint64_t N = 8 * MiB;
    uint8_t *src = xmap(N), *dst = xmap(N), *dst2 = xmap(N), *ref = xmap(N);
    fill(src, N, 4);
    uint32_t rs = add_local(c, src, N), rd = add_local(c, dst, N), rd2 = add_local(c, dst2, N);
    /* dst pieces [B[k], B[k+1]) come from src [N - B[k+1], N - B[k]); job 1 takes the
     * even pieces, job 2 the odd ones: both multi-segment, ~4 MiB = 64+ chunks */
    static const uint64_t B[] = {0,         1 * MiB + 17, 3 * MiB + 4099, 3 * MiB + 70000,
                                 5 * MiB,   6 * MiB + 1,  7 * MiB + 3,    8 * MiB};
    enum { NP = sizeof B / sizeof B[0] - 1 };
    uint64_t w1[NP * KV_SEG_WORDS], w2[NP * KV_SEG_WORDS];
    size_t n1 = 0, n2 = 0;
    uint64_t t1 = 0, t2 = 0;
    for (int k = 0; k < NP; k++) {
        uint64_t len = B[k + 1] - B[k];
        memcpy(ref + B[k], src + (N - B[k + 1]), (size_t)len);
        if (k % 2 == 0) {
            seg(w1 + KV_SEG_WORDS * n1++, rs, N - B[k + 1], rd, B[k], len);
            t1 += len;
        } else {
            seg(w2 + KV_SEG_WORDS * n2++, rs, N - B[k + 1], rd, B[k], len);
            t2 += len;
        }
    }
    uint64_t w3[KV_SEG_WORDS];
    seg(w3, rs, 0, rd2, 0, N);
    submit_async(c, 11, w1, n1);
    submit_async(c, 12, w2, n2);
    submit_async(c, 13, w3, 1);
    kv_completion out[4];
    CHECK_EQ(drain(c, out, 3, WAIT_MS), 3);
    int seen[3] = {0, 0, 0};
    for (int i = 0; i < 3; i++) {
        CHECK(out[i].job_id >= 11 && out[i].job_id <= 13);
        CHECK_EQ(seen[out[i].job_id - 11]++, 0);
        CHECK_EQ(out[i].status, KV_LLM_SUCCESS);
        uint64_t want = out[i].job_id == 11 ? t1 : out[i].job_id == 12 ? t2 : N;
        CHECK_EQ(out[i].nbytes, want);
        CHECK_EQ(out[i].flags, 0);
    }
    CHECK(memcmp(dst, ref, (size_t)N) == 0);
    CHECK(memcmp(dst2, src, (size_t)N) == 0);
    check_no_more(c);

    /* chunk boundaries: exactly one chunk, one chunk + 1 byte, one byte short */
    static const uint64_t lens[] = {64 * KiB, 64 * KiB + 1, 64 * KiB - 1, 3 * 64 * KiB};
    for (size_t i = 0; i < 4; i++) {
        memset(dst, 0, (size_t)(N));
        seg(w3, rs, 1, rd, 3, lens[i]);
        submit_async(c, 20 + i, w3, 1);
        kv_completion cp = wait_one(c, 20 + i);
        CHECK_EQ(cp.status, KV_LLM_SUCCESS);
        CHECK_EQ(cp.nbytes, lens[i]);
        CHECK(all_eq(dst, 3, 0));
        CHECK(memcmp(dst + 3, src + 1, (size_t)lens[i]) == 0);
        CHECK(all_eq(dst + 3 + lens[i], N - 3 - lens[i], 0));
    }
    check_quiet_stats(c);
    kv_stats s = stats(c);
    CHECK_EQ(s.jobs_submitted, 7);
    CHECK_EQ(s.jobs_completed, 7);
    CHECK_EQ(s.jobs_inline, 0);
    CHECK_EQ(s.jobs_aborted, 0);
    CHECK_EQ(s.bytes_moved, 2 * N + lens[0] + lens[1] + lens[2] + lens[3]);
    CHECK(s.wakeups >= 5 && s.wakeups <= 7);
    CHECK_EQ(s.regions_live, 3);
    kv_core_free(c);
    xunmap(src, N);
    xunmap(dst, N);
    xunmap(dst2, N);
    xunmap(ref, N);
}

/* Fail with a clear message if this environment forbids process_vm_readv on
 * `pid` (seccomp, Yama ptrace_scope, missing CAP_SYS_PTRACE), rather than
 * with a puzzling job status later. */
static void probe_process_vm(pid_t pid, const void *remote) {
    char b[8];
    struct iovec l = {b, sizeof b}, r = {(void *)(uintptr_t)remote, sizeof b};
    if (process_vm_readv(pid, &l, 1, &r, 1, 0) != (ssize_t)sizeof b) {
        fprintf(stderr,
                "[%s] process_vm_readv(pid %d) failed: %s. The KV_REGION_PROCESS path needs "
                "it (seccomp profile, Yama ptrace_scope or CAP_SYS_PTRACE may forbid it).\n",
                g_test, (int)pid, strerror(errno));
        die();
    }
}

static void test_process_self(void) {
    kv_core *c = mk(2, 64 * KiB);
    const uint64_t N = 2 * MiB;
    uint8_t *src = xmap(N), *dst = xmap(N), *dst2 = xmap(N);
    fill(src, N, 5);
    pid_t me = getpid();
    probe_process_vm(me, src);
    uint32_t rls = add_local(c, src, N), rpd = add_proc(c, me, dst, N);
    uint32_t rps = add_proc(c, me, src, N), rld = add_local(c, dst2, N);
    uint64_t w[2 * KV_SEG_WORDS];
    /* process_vm_writev, mover path, two swapped halves */
    seg(w, rls, 0, rpd, N / 2, N / 2);
    seg(w + 5, rls, N / 2, rpd, 0, N / 2);
    submit_async(c, 1, w, 2);
    kv_completion cp = wait_one(c, 1);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, N);
    CHECK(memcmp(dst + N / 2, src, (size_t)(N / 2)) == 0);
    CHECK(memcmp(dst, src + N / 2, (size_t)(N / 2)) == 0);
    /* process_vm_readv, mover path */
    seg(w, rps, 0, rld, 0, N);
    submit_async(c, 2, w, 1);
    cp = wait_one(c, 2);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, N);
    CHECK(memcmp(dst2, src, (size_t)N) == 0);
    /* both directions, small: never inline (CMA), refused, nothing moved; the movers
     * take it (a pull's bytes through the mover's bounce buffer, unaligned) */
    int done = -1;
    uint64_t nb = 0;
    memset(dst, 0, (size_t)N);
    memset(dst2, 0, (size_t)N);
    seg(w, rls, 7, rpd, 9, 8192);
    seg(w + 5, rps, 11, rld, 13, 8192);
    CHECK_EQ(kv_core_submit(c, 3, w, 2, 16384, &done, &nb), KV_INLINE_REFUSED);
    CHECK_EQ(done, 0);
    CHECK(all_eq(dst, N, 0) && all_eq(dst2, N, 0));
    submit_async(c, 3, w, 2);
    cp = wait_one(c, 3);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, 16384);
    CHECK(memcmp(dst + 9, src + 7, 8192) == 0);
    CHECK(memcmp(dst2 + 13, src + 11, 8192) == 0);
    CHECK(all_eq(dst, 9, 0) && all_eq(dst + 9 + 8192, N - 9 - 8192, 0));

    /* an inaccessible address behind a PROCESS region: EFAULT -> KV_LLM_FAILED, no crash */
    void *noacc = mmap(NULL, (size_t)MiB, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(noacc != MAP_FAILED);
    uint32_t rbad = add_proc(c, me, noacc, MiB);
    seg(w, rls, 0, rbad, 0, MiB);
    submit_async(c, 4, w, 1);
    cp = wait_one(c, 4);
    CHECK_EQ(cp.status, KV_LLM_FAILED);
    CHECK_EQ(cp.nbytes, 0);
    memset(dst2, 0x33, (size_t)MiB);
    seg(w, rbad, 0, rld, 0, MiB);
    submit_async(c, 5, w, 1);
    cp = wait_one(c, 5);
    CHECK_EQ(cp.status, KV_LLM_FAILED);
    CHECK_EQ(cp.nbytes, 0);
    CHECK(all_eq(dst2, MiB, 0x33));
    check_no_more(c);
    check_quiet_stats(c);
    kv_core_free(c);
    CHECK(munmap(noacc, (size_t)MiB) == 0);
    xunmap(src, N);
    xunmap(dst, N);
    xunmap(dst2, N);
}

static void test_process_child(void) {
    const uint64_t N = 4 * MiB, P = 64 * KiB;
    uint8_t *shared = mmap(NULL, (size_t)N, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                           -1, 0);
    CHECK(shared != MAP_FAILED);
    uint8_t *priv = xmap(P);
    fill(priv, P, 9); /* the child keeps this content */
    pid_t parent = getpid();
    fflush(stdout);
    fflush(stderr);
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(0);
        alarm(WATCHDOG_SECONDS);
        for (;;)
            pause();
    }
    fill(priv, P, 10); /* our copy diverges (copy-on-write) */
    probe_process_vm(child, priv);

    kv_core *c = mk(2, 64 * KiB);
    uint8_t *src = xmap(N), *dst = xmap(N);
    fill(src, N, 7);
    uint32_t rls = add_local(c, src, N), rld = add_local(c, dst, N);
    uint32_t rcs = add_proc(c, child, shared, N), rcp = add_proc(c, child, priv, P);
    uint64_t w[KV_SEG_WORDS];
    /* write into the child; the shared mapping shows it */
    seg(w, rls, 0, rcs, 0, N);
    submit_async(c, 1, w, 1);
    kv_completion cp = wait_one(c, 1);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, N);
    CHECK(memcmp(shared, src, (size_t)N) == 0);
    /* read from the child */
    fill(shared, N, 8);
    seg(w, rcs, 0, rld, 0, N);
    submit_async(c, 2, w, 1);
    cp = wait_one(c, 2);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK(memcmp(dst, shared, (size_t)N) == 0);
    /* really the child's memory: its private copy still holds seed 9 */
    seg(w, rcp, 0, rld, 0, P);
    submit_async(c, 3, w, 1);
    cp = wait_one(c, 3);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    fill(src, P, 9);
    CHECK(memcmp(dst, src, (size_t)P) == 0);

    /* the child dies: a job to it fails with KV_LLM_LINK_FAILED (ESRCH), no crash */
    int wst = 0;
    CHECK(kill(child, SIGKILL) == 0);
    CHECK_EQ(waitpid(child, &wst, 0), child);
    CHECK(WIFSIGNALED(wst) && WTERMSIG(wst) == SIGKILL);
    fill(src, N, 7);
    memset(shared, 0, (size_t)N);
    seg(w, rls, 0, rcs, 0, N);
    submit_async(c, 4, w, 1);
    cp = wait_one(c, 4);
    CHECK_EQ(cp.status, KV_LLM_LINK_FAILED);
    CHECK_EQ(cp.nbytes, 0);
    CHECK(all_eq(shared, N, 0));
    memset(dst, 0x44, (size_t)N);
    seg(w, rcs, 0, rld, 0, N);
    submit_async(c, 5, w, 1);
    cp = wait_one(c, 5);
    CHECK_EQ(cp.status, KV_LLM_LINK_FAILED);
    CHECK(all_eq(dst, N, 0x44));
    int done = -1;
    uint64_t nb = 99;
    seg(w, rls, 0, rcs, 0, 4096);
    CHECK_EQ(kv_core_submit(c, 6, w, 1, UINT64_MAX, &done, &nb), KV_INLINE_REFUSED); /* CMA: never inline */
    CHECK_EQ(done, 0);
    CHECK_EQ(nb, 0);
    submit_async(c, 6, w, 1);
    cp = wait_one(c, 6);
    CHECK_EQ(cp.status, KV_LLM_LINK_FAILED);
    CHECK_EQ(cp.nbytes, 0);
    check_no_more(c);
    check_quiet_stats(c);
    kv_core_free(c);
    xunmap(src, N);
    xunmap(dst, N);
    xunmap(priv, P);
    CHECK(munmap(shared, (size_t)N) == 0);
}

static void test_abort(void) {
    const uint64_t BIG = 256 * MiB, CH = 64 * KiB, Q = 8 * MiB;
    kv_core *c = mk(2, CH);
    uint8_t *src = xmap(BIG), *dst = xmap(BIG), *dst2 = xmap(Q);
    memset(src, 0xAB, (size_t)BIG);
    uint32_t rs = add_local(c, src, BIG), rd = add_local(c, dst, BIG), rd2 = add_local(c, dst2, Q);
    uint64_t w[KV_SEG_WORDS], wq[KV_SEG_WORDS];
    seg(w, rs, 0, rd, 0, BIG);
    seg(wq, rs, 0, rd2, 0, Q);
    uint64_t aborts = 0;

    /* abort right after submit, and after a short head start */
    static const long delays_us[] = {0, 0, 300, 3000};
    static const uint32_t abort_st[] = {KV_LLM_CANCELLED, KV_LLM_TIMEOUT, KV_LLM_CANCELLED,
                                        KV_LLM_CANCELLED};
    for (size_t k = 0; k < 4; k++) {
        uint64_t id = 1000 + k;
        submit_async(c, id, w, 1);
        if (delays_us[k])
            sleep_us(delays_us[k]);
        CHECK_EQ(kv_core_abort(c, id, abort_st[k]), KV_LLM_SUCCESS);
        aborts++;
        CHECK_EQ(kv_core_abort(c, id, KV_LLM_CANCELLED), KV_LLM_PARAM_INVALID); /* twice */
        kv_completion cp = wait_one(c, id);
        CHECK_EQ(cp.status, abort_st[k]);
        CHECK(cp.nbytes < BIG);
        CHECK_EQ(cp.nbytes % CH, 0);
        CHECK_EQ(cp.flags, cp.nbytes ? 0 : KV_DONE_UNSTARTED); /* a claimed chunk is copied before the completion */
        /* every claimed chunk finished before the completion: exactly a prefix */
        CHECK(all_eq(dst, cp.nbytes, 0xAB));
        CHECK(all_eq(dst + cp.nbytes, BIG - cp.nbytes, 0));
        /* the fence: nothing writes after the completion */
        sleep_us(30000);
        CHECK(all_eq(dst, cp.nbytes, 0xAB));
        CHECK(all_eq(dst + cp.nbytes, BIG - cp.nbytes, 0));
        check_no_more(c); /* posted exactly once */
        CHECK_EQ(kv_core_abort(c, id, KV_LLM_CANCELLED), KV_LLM_PARAM_INVALID); /* finished */
        memset(dst, 0, (size_t)cp.nbytes);
    }

    /* bad aborts */
    CHECK_EQ(kv_core_abort(c, 99999, KV_LLM_CANCELLED), KV_LLM_PARAM_INVALID);
    submit_async(c, 2000, wq, 1);
    CHECK_EQ(kv_core_abort(c, 2000, KV_LLM_SUCCESS), KV_LLM_PARAM_INVALID);
    kv_completion cp = wait_one(c, 2000); /* unaffected */
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, Q);
    CHECK(all_eq(dst2, Q, 0xAB));
    CHECK_EQ(kv_core_abort(c, 2000, KV_LLM_CANCELLED), KV_LLM_PARAM_INVALID); /* finished */
    memset(dst2, 0, (size_t)Q);

    /* a queued job (behind a 256 MiB one): duplicate id rejected, then aborted */
    submit_async(c, 3000, w, 1);
    submit_async(c, 3001, wq, 1);
    int done = -1;
    uint64_t nb = 99;
    CHECK_EQ(kv_core_submit(c, 3001, wq, 1, 0, &done, &nb), KV_LLM_PARAM_INVALID);
    CHECK_EQ(done, 0);
    CHECK_EQ(kv_core_submit(c, 3001, wq, 1, UINT64_MAX, &done, &nb), KV_LLM_PARAM_INVALID);
    CHECK_EQ(done, 0);
    CHECK_EQ(kv_core_submit(c, 3000, wq, 1, UINT64_MAX, &done, &nb), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_core_abort(c, 3001, KV_LLM_CANCELLED), KV_LLM_SUCCESS);
    CHECK_EQ(kv_core_abort(c, 3000, KV_LLM_CANCELLED), KV_LLM_SUCCESS);
    aborts += 2;
    kv_completion out[2];
    CHECK_EQ(drain(c, out, 2, WAIT_MS), 2);
    CHECK(out[0].job_id != out[1].job_id);
    for (int i = 0; i < 2; i++) {
        CHECK(out[i].job_id == 3000 || out[i].job_id == 3001);
        CHECK_EQ(out[i].status, KV_LLM_CANCELLED);
        if (out[i].job_id == 3001) {
            CHECK_EQ(out[i].nbytes, 0); /* never started */
            CHECK_EQ(out[i].flags, KV_DONE_UNSTARTED);
        } else {
            CHECK_EQ(out[i].flags, out[i].nbytes ? 0 : KV_DONE_UNSTARTED);
            memset(dst, 0, (size_t)out[i].nbytes);
        }
    }
    sleep_us(10000);
    CHECK(all_eq(dst2, Q, 0));
    CHECK(all_eq(dst, BIG, 0));
    check_no_more(c);
    /* a finished job's id can be used again */
    submit_async(c, 3001, wq, 1);
    cp = wait_one(c, 3001);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK(all_eq(dst2, Q, 0xAB));

    check_quiet_stats(c);
    kv_stats s = stats(c);
    CHECK_EQ(s.jobs_aborted, aborts);
    CHECK_EQ(s.jobs_submitted, 4 + 1 + 2 + 1);
    CHECK_EQ(s.regions_live, 3);
    kv_core_free(c);
    xunmap(src, BIG);
    xunmap(dst, BIG);
    xunmap(dst2, Q);
}

/* Wait (bounded) until *p holds v: a mover has copied that byte. */
static void wait_byte(const volatile uint8_t *p, uint8_t v) {
    double end = now_ms() + WAIT_MS;
    while (*p != v) {
        CHECK(now_ms() < end);
        sleep_us(100);
    }
}

/* Completion flags, and the rank order of mover jobs. One mover, busy with a
 * long job (rank 100, 2 GiB: it never runs out of chunks here):
 *  - a job of equal rank queued behind it, aborted, never had a chunk claimed:
 *    KV_DONE_UNSTARTED, nbytes 0, nothing written;
 *  - jobs of lower rank overtake it at its next chunk, lowest rank first, equal
 *    ranks in submission order: ranks 1, 1 complete (in that order) before
 *    another long job, of rank 50, submitted just before them;
 *  - jobs that moved bytes, completed or aborted, carry no flag. */
static void test_done_flags(void) {
    const uint64_t N = 32 * MiB, CH = 64 * KiB, S = 256 * KiB;
    enum { LONG_SEGS = 64 };
    kv_core *c = mk(1, CH);
    uint8_t *src = xmap(N), *dst = xmap(N), *d3 = xmap(N), *ds = xmap(4 * S);
    memset(src, 0xC3, (size_t)N);
    uint32_t rs = add_local(c, src, N), rd = add_local(c, dst, N), r3 = add_local(c, d3, N),
             rds = add_local(c, ds, 4 * S);
    static uint64_t wl[LONG_SEGS * KV_SEG_WORDS], w3[LONG_SEGS * KV_SEG_WORDS];
    for (int k = 0; k < LONG_SEGS; k++) { /* the same bytes again and again */
        seg(wl + k * KV_SEG_WORDS, rs, 0, rd, 0, N);
        seg(w3 + k * KV_SEG_WORDS, rs, 0, r3, 0, N);
    }
    uint64_t ws[4][KV_SEG_WORDS];
    for (int k = 0; k < 4; k++)
        seg(ws[k], rs, 0, rds, (uint64_t)k * S, S);
    int done = -1;
    uint64_t nb = 99;

    CHECK_EQ(kv_core_submit_ranked(c, 1, wl, LONG_SEGS, 0, 100, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(done, 0);
    wait_byte(dst, 0xC3); /* the mover is on it */

    /* equal rank: queued behind it, never claimed */
    CHECK_EQ(kv_core_submit_ranked(c, 2, ws[0], 1, 0, 100, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(kv_core_abort(c, 2, KV_LLM_CANCELLED), KV_LLM_SUCCESS);
    kv_completion cp = wait_one(c, 2);
    CHECK_EQ(cp.status, KV_LLM_CANCELLED);
    CHECK_EQ(cp.nbytes, 0);
    CHECK_EQ(cp.flags, KV_DONE_UNSTARTED);
    CHECK(all_eq(ds, S, 0));

    /* lower ranks overtake */
    CHECK_EQ(kv_core_submit_ranked(c, 3, w3, LONG_SEGS, 0, 50, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(kv_core_submit_ranked(c, 4, ws[1], 1, 0, 1, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(kv_core_submit_ranked(c, 5, ws[2], 1, 0, 1, &done, &nb), KV_LLM_SUCCESS);
    kv_completion out[2];
    CHECK_EQ(drain(c, out, 2, WAIT_MS), 2);
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(out[i].job_id, 4 + i); /* 4 then 5: neither waited for 3 */
        CHECK_EQ(out[i].status, KV_LLM_SUCCESS);
        CHECK_EQ(out[i].nbytes, S);
        CHECK_EQ(out[i].flags, 0);
    }
    CHECK(all_eq(ds + S, 2 * S, 0xC3));
    /* 3 goes on now (rank 50 before 100): aborted, as is 1 */
    CHECK_EQ(kv_core_abort(c, 3, KV_LLM_CANCELLED), KV_LLM_SUCCESS);
    cp = wait_one(c, 3);
    CHECK_EQ(cp.status, KV_LLM_CANCELLED);
    CHECK_EQ(cp.nbytes % CH, 0);
    CHECK_EQ(cp.flags, cp.nbytes ? 0 : KV_DONE_UNSTARTED);
    CHECK_EQ(kv_core_abort(c, 1, KV_LLM_TIMEOUT), KV_LLM_SUCCESS);
    cp = wait_one(c, 1);
    CHECK_EQ(cp.status, KV_LLM_TIMEOUT);
    CHECK(cp.nbytes > 0 && cp.nbytes < LONG_SEGS * N);
    CHECK_EQ(cp.flags, 0);

    /* a completed job: no flag */
    submit_async(c, 6, ws[3], 1);
    cp = wait_one(c, 6);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, S);
    CHECK_EQ(cp.flags, 0);
    check_no_more(c);
    check_quiet_stats(c);
    CHECK_EQ(stats(c).jobs_aborted, 3);
    kv_core_free(c);
    xunmap(src, N);
    xunmap(dst, N);
    xunmap(d3, N);
    xunmap(ds, 4 * S);
}

static void test_remove_in_use(void) {
    kv_core *c = mk(1, 64 * KiB);
    const uint64_t N = 32 * MiB;
    uint8_t *src = xmap(N), *dst = xmap(N), *tmp = xmap(N);
    fill(src, N, 11);
    uint32_t rs = add_local(c, src, N), rd = add_local(c, dst, N);
    uint64_t w[KV_SEG_WORDS];
    int done;
    uint64_t nb;

    /* plain regions removed while the job runs */
    seg(w, rs, 0, rd, 0, N);
    submit_async(c, 1, w, 1);
    CHECK_EQ(kv_region_remove(c, rs), KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_remove(c, rd), KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_remove(c, rs), KV_LLM_KV_CACHE_NOT_EXIST);
    CHECK_EQ(kv_core_submit(c, 2, w, 1, UINT64_MAX, &done, &nb), KV_LLM_KV_CACHE_NOT_EXIST);
    kv_stats s = stats(c); /* one consistent snapshot */
    CHECK_EQ(s.regions_live, s.jobs_live ? 2 : 0);
    kv_completion cp = wait_one(c, 1);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, N);
    CHECK(memcmp(dst, src, (size_t)N) == 0);
    CHECK_EQ(stats(c).regions_live, 0);

    /* kv_map_fd argument checks */
    uint64_t maddr = 0;
    CHECK_EQ(kv_map_fd(-1, 4096, &maddr), KV_LLM_PARAM_INVALID);
    int fd = memfd_create("kv_core_test_src", MFD_CLOEXEC);
    CHECK(fd >= 0);
    CHECK_EQ(kv_map_fd(fd, 0, &maddr), KV_LLM_PARAM_INVALID);
    CHECK_EQ(maddr, 0);

    /* a memfd mapping as the source, unmap_on_release, removed while in use */
    CHECK(ftruncate(fd, (off_t)N) == 0);
    CHECK_EQ(kv_map_fd(fd, N, &maddr), KV_LLM_SUCCESS);
    CHECK(maddr != 0 && is_mapped(maddr));
    fill((uint8_t *)(uintptr_t)maddr, N, 12);
    uint32_t rm = add_region(c, KV_REGION_LOCAL, 0, (void *)(uintptr_t)maddr, N, 1);
    rd = add_local(c, dst, N);
    memset(dst, 0, (size_t)N);
    seg(w, rm, 0, rd, 0, N);
    submit_async(c, 3, w, 1);
    CHECK_EQ(kv_region_remove(c, rm), KV_LLM_SUCCESS);
    int mapped = is_mapped(maddr);
    s = stats(c);
    if (s.jobs_live) /* still running after the check: it must have been mapped */
        CHECK(mapped);
    cp = wait_one(c, 3);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, N);
    CHECK(!is_mapped(maddr)); /* unmapped once the job let go */
    CHECK(!is_mapped(maddr + N - 4096));
    fill(tmp, N, 12);
    CHECK(memcmp(dst, tmp, (size_t)N) == 0);
    CHECK_EQ(kv_region_remove(c, rd), KV_LLM_SUCCESS);

    /* a memfd mapping as the destination: the bytes land in the file */
    int fd2 = memfd_create("kv_core_test_dst", MFD_CLOEXEC);
    CHECK(fd2 >= 0);
    CHECK(ftruncate(fd2, (off_t)N) == 0);
    uint64_t maddr2 = 0;
    CHECK_EQ(kv_map_fd(fd2, N, &maddr2), KV_LLM_SUCCESS);
    rs = add_local(c, src, N);
    uint32_t rm2 = add_region(c, KV_REGION_LOCAL, 0, (void *)(uintptr_t)maddr2, N, 1);
    seg(w, rs, 0, rm2, 0, N);
    submit_async(c, 4, w, 1);
    CHECK_EQ(kv_region_remove(c, rm2), KV_LLM_SUCCESS);
    cp = wait_one(c, 4);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK(!is_mapped(maddr2));
    CHECK_EQ(pread(fd2, tmp, (size_t)N, 0), (ssize_t)N);
    CHECK(memcmp(tmp, src, (size_t)N) == 0);

    /* idle unmap region: removal unmaps at once */
    uint64_t maddr3 = 0;
    CHECK_EQ(kv_map_fd(fd2, MiB, &maddr3), KV_LLM_SUCCESS);
    uint32_t rm3 = add_region(c, KV_REGION_LOCAL, 0, (void *)(uintptr_t)maddr3, MiB, 1);
    CHECK(is_mapped(maddr3));
    CHECK_EQ(kv_region_remove(c, rm3), KV_LLM_SUCCESS);
    CHECK(!is_mapped(maddr3));
    /* never removed: kv_core_free unmaps it */
    CHECK_EQ(kv_map_fd(fd2, MiB, &maddr3), KV_LLM_SUCCESS);
    add_region(c, KV_REGION_LOCAL, 0, (void *)(uintptr_t)maddr3, MiB, 1);
    check_no_more(c);
    check_quiet_stats(c);
    CHECK_EQ(stats(c).regions_live, 2);
    kv_core_free(c);
    CHECK(!is_mapped(maddr3));
    close(fd);
    close(fd2);
    xunmap(src, N);
    xunmap(dst, N);
    xunmap(tmp, N);
}

static void test_close(void) {
    int base = count_tasks();
    enum { NJ = 400 };
    const uint64_t J = MiB, D = 64 * MiB;
    kv_core *c = mk(2, 64 * KiB);
    CHECK_EQ(wait_tasks(base + 2), base + 2);
    uint8_t *src = xmap(J), *dst = xmap(D), *snap = xmap(D);
    fill(src, J, 13);
    uint32_t rs = add_local(c, src, J), rd = add_local(c, dst, D);
    uint64_t w[KV_SEG_WORDS];
    for (int i = 0; i < NJ; i++) {
        seg(w, rs, 0, rd, (uint64_t)(i % 64) * MiB, J);
        submit_async(c, (uint64_t)i + 1, w, 1);
    }
    kv_core_close(c);
    CHECK_EQ(wait_tasks(base), base); /* movers joined */
    memcpy(snap, dst, (size_t)D);
    /* every job has its completion already, exactly one each */
    CHECK(readable_now(c));
    static kv_completion out[NJ + 8];
    static unsigned char seen[NJ + 1];
    memset(seen, 0, sizeof seen);
    size_t got = kv_core_poll(c, out, NJ + 8);
    CHECK_EQ(got, NJ);
    CHECK(!readable_now(c));
    uint64_t nfin = 0, nok = 0;
    for (size_t i = 0; i < got; i++) {
        CHECK(out[i].job_id >= 1 && out[i].job_id <= NJ);
        CHECK_EQ(seen[out[i].job_id]++, 0);
        if (out[i].status == KV_LLM_SUCCESS) {
            nok++;
            CHECK_EQ(out[i].nbytes, J);
        } else {
            CHECK_EQ(out[i].status, KV_LLM_ENGINE_FINALIZED);
            CHECK(out[i].nbytes < J);
            nfin++;
        }
    }
    CHECK(nfin > 0);
    /* a finished job's slice is whole (every writer of a slice writes the same bytes) */
    for (size_t i = 0; i < got; i++)
        if (out[i].status == KV_LLM_SUCCESS)
            CHECK(memcmp(dst + ((out[i].job_id - 1) % 64) * MiB, src, (size_t)J) == 0);
    kv_stats s = stats(c);
    CHECK_EQ(s.jobs_submitted, NJ);
    CHECK_EQ(s.jobs_completed, NJ);
    CHECK_EQ(s.jobs_live, 0);
    CHECK_EQ(s.jobs_aborted, nfin);

    /* closed: nothing new is accepted, nothing moves */
    int done = -1;
    uint64_t nb = 99;
    seg(w, rs, 0, rd, 0, 4096);
    CHECK_EQ(kv_core_submit(c, 9999, w, 1, 0, &done, &nb), KV_LLM_ENGINE_FINALIZED);
    CHECK_EQ(done, 0);
    CHECK_EQ(kv_core_submit(c, 9999, w, 1, UINT64_MAX, &done, &nb), KV_LLM_ENGINE_FINALIZED);
    CHECK_EQ(done, 0);
    uint32_t id = 0;
    CHECK_EQ(kv_region_add(c, KV_REGION_LOCAL, 0, A(src), J, 0, &id), KV_LLM_ENGINE_FINALIZED);
    CHECK_EQ(kv_core_abort(c, 1, KV_LLM_CANCELLED), KV_LLM_PARAM_INVALID);
    kv_core_close(c);
    sleep_us(20000);
    CHECK(memcmp(snap, dst, (size_t)D) == 0);
    CHECK_EQ(kv_core_poll(c, out, NJ), 0);
    kv_core_free(c);

    /* free with queued jobs and unpolled completions (LSan: nothing leaks) */
    c = mk(2, 64 * KiB);
    rs = add_local(c, src, J);
    rd = add_local(c, dst, D);
    for (int i = 0; i < 50; i++) {
        seg(w, rs, 0, rd, (uint64_t)(i % 64) * MiB, J);
        submit_async(c, (uint64_t)i + 1, w, 1);
    }
    kv_core_free(c);
    CHECK_EQ(wait_tasks(base), base);
    xunmap(src, J);
    xunmap(dst, D);
    xunmap(snap, D);
}

static void test_poll_small_max(void) {
    kv_core *c = mk(1, 64 * KiB);
    const uint64_t J = 128 * KiB;
    uint8_t *src = xmap(J), *dst = xmap(J);
    fill(src, J, 14);
    uint32_t rs = add_local(c, src, J), rd = add_local(c, dst, J);
    uint64_t w[KV_SEG_WORDS];
    seg(w, rs, 0, rd, 0, J);
    for (uint64_t i = 1; i <= 10; i++)
        submit_async(c, i, w, 1);
    double end = now_ms() + WAIT_MS;
    while (stats(c).jobs_completed < 10 && now_ms() < end)
        sleep_us(1000);
    CHECK_EQ(stats(c).jobs_completed, 10);
    CHECK(readable_now(c));
    kv_completion out[10];
    CHECK_EQ(kv_core_poll(c, out, 0), 0);
    CHECK(readable_now(c)); /* max 0 keeps it readable */
    size_t got = 0;
    for (int round = 0; round < 3; round++) {
        CHECK_EQ(kv_core_poll(c, out + got, 3), 3);
        got += 3;
        CHECK(readable_now(c)); /* more left: still readable */
    }
    CHECK_EQ(kv_core_poll(c, out + got, 3), 1);
    got += 1;
    CHECK(!readable_now(c)); /* drained: reset */
    for (size_t i = 0; i < got; i++) { /* one mover, FIFO queue: completion order */
        CHECK_EQ(out[i].job_id, i + 1);
        CHECK_EQ(out[i].status, KV_LLM_SUCCESS);
        CHECK_EQ(out[i].nbytes, J);
    }
    CHECK_EQ(kv_core_poll(c, out, 10), 0);
    CHECK(memcmp(dst, src, (size_t)J) == 0);
    check_quiet_stats(c);
    kv_core_free(c);
    xunmap(src, J);
    xunmap(dst, J);
}

/* ---- concurrent submitters */

enum { NT = 4, PER = 1000 };
#define CONC_SRC (1 * MiB)
#define CONC_INLINE (16 * KiB)

typedef struct {
    kv_core *c;
    int t;
    uint32_t rs, rd;
    uint64_t async_jobs, inline_jobs, aborts_ok, inline_bytes;
} conc_arg;

static pthread_mutex_t g_conc_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_conc_done;
static uint64_t g_conc_expected;

static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static uint64_t conc_len(int t, uint64_t i) {
    return 1 + mix((uint64_t)t * 1000003u + i) % (192 * KiB);
}

static uint64_t conc_off(int t, uint64_t i, uint64_t len) {
    return mix((uint64_t)t * 7919u + i * 31u + 5u) % (CONC_SRC - len + 1);
}

static void *conc_main(void *p) {
    conc_arg *a = p;
    static uint8_t churn_buf[4096];
    for (uint64_t i = 0; i < PER; i++) {
        uint64_t len = conc_len(a->t, i), off = conc_off(a->t, i, len);
        uint64_t w[KV_SEG_WORDS];
        seg(w, a->rs, off, a->rd, off, len);
        uint64_t id = ((uint64_t)(a->t + 1) << 32) | i;
        int done = -1;
        uint64_t nb = 0;
        CHECK_EQ(kv_core_submit(a->c, id, w, 1, CONC_INLINE, &done, &nb), KV_LLM_SUCCESS);
        if (done) {
            CHECK(len <= CONC_INLINE);
            CHECK_EQ(nb, len);
            a->inline_jobs++;
            a->inline_bytes += nb;
        } else {
            CHECK(len > CONC_INLINE);
            a->async_jobs++;
            pthread_mutex_lock(&g_conc_mu);
            g_conc_expected++;
            pthread_mutex_unlock(&g_conc_mu);
            if (i % 7 == 0) {
                uint32_t st = kv_core_abort(a->c, id, KV_LLM_CANCELLED);
                CHECK(st == KV_LLM_SUCCESS || st == KV_LLM_PARAM_INVALID);
                a->aborts_ok += st == KV_LLM_SUCCESS;
            }
        }
        if (i % 50 == 0) { /* region churn: the table grows while others submit */
            uint32_t rid = 0;
            CHECK_EQ(kv_region_add(a->c, KV_REGION_LOCAL, 0, A(churn_buf), sizeof churn_buf, 0,
                                   &rid),
                     KV_LLM_SUCCESS);
            CHECK_EQ(kv_region_remove(a->c, rid), KV_LLM_SUCCESS);
        }
    }
    pthread_mutex_lock(&g_conc_mu);
    g_conc_done++;
    pthread_mutex_unlock(&g_conc_mu);
    return NULL;
}

static void test_concurrent(void) {
    kv_core *c = mk(3, 64 * KiB);
    uint8_t *src = xmap(CONC_SRC);
    fill(src, CONC_SRC, 15);
    uint8_t *dst[NT];
    conc_arg args[NT];
    pthread_t th[NT];
    uint32_t rs = add_local(c, src, CONC_SRC);
    g_conc_done = 0;
    g_conc_expected = 0;
    for (int t = 0; t < NT; t++) {
        dst[t] = xmap(CONC_SRC);
        memset(&args[t], 0, sizeof args[t]);
        args[t].c = c;
        args[t].t = t;
        args[t].rs = rs;
        args[t].rd = add_local(c, dst[t], CONC_SRC);
    }
    for (int t = 0; t < NT; t++)
        CHECK(pthread_create(&th[t], NULL, conc_main, &args[t]) == 0);

    static unsigned char seen[NT][PER];
    memset(seen, 0, sizeof seen);
    static kv_completion out[256];
    uint64_t received = 0, cancelled = 0;
    double end = now_ms() + 20000;
    for (;;) {
        pthread_mutex_lock(&g_conc_mu);
        int fin = g_conc_done == NT && received == g_conc_expected;
        pthread_mutex_unlock(&g_conc_mu);
        if (fin)
            break;
        CHECK(now_ms() < end);
        struct pollfd pfd = {kv_core_fileno(c), POLLIN, 0};
        int r = poll(&pfd, 1, 50);
        CHECK(r >= 0 || errno == EINTR);
        if (r <= 0)
            continue;
        size_t n = kv_core_poll(c, out, 256);
        for (size_t k = 0; k < n; k++) {
            uint64_t id = out[k].job_id;
            uint64_t t = (id >> 32) - 1, i = id & 0xFFFFFFFFu;
            CHECK(t < NT && i < PER);
            CHECK_EQ(seen[t][i]++, 0);
            uint64_t len = conc_len((int)t, i);
            CHECK(len > CONC_INLINE);
            if (out[k].status == KV_LLM_SUCCESS) {
                CHECK_EQ(out[k].nbytes, len);
            } else {
                CHECK_EQ(out[k].status, KV_LLM_CANCELLED);
                CHECK_EQ(i % 7, 0);
                /* an abort that lands while the last chunk is in flight is still
                 * accepted: the status says cancelled, every byte may be there */
                CHECK(out[k].nbytes <= len);
                cancelled++;
            }
            received++;
        }
    }
    uint64_t async_jobs = 0, inline_jobs = 0, aborts_ok = 0, inline_bytes = 0;
    for (int t = 0; t < NT; t++) {
        CHECK(pthread_join(th[t], NULL) == 0);
        async_jobs += args[t].async_jobs;
        inline_jobs += args[t].inline_jobs;
        aborts_ok += args[t].aborts_ok;
        inline_bytes += args[t].inline_bytes;
    }
    CHECK_EQ(async_jobs + inline_jobs, NT * PER);
    CHECK_EQ(received, async_jobs);
    CHECK(inline_jobs > 0 && async_jobs > 0);
    CHECK_EQ(cancelled, aborts_ok); /* an accepted abort always shows in the completion */
    for (int t = 0; t < NT; t++)
        for (uint64_t i = 0; i < PER; i++)
            CHECK_EQ(seen[t][i], conc_len(t, i) > CONC_INLINE ? 1 : 0);
    check_no_more(c);
    check_quiet_stats(c);
    kv_stats s = stats(c);
    CHECK_EQ(s.jobs_submitted, async_jobs);
    CHECK_EQ(s.jobs_inline, inline_jobs);
    CHECK_EQ(s.jobs_completed, async_jobs);
    CHECK_EQ(s.jobs_aborted, aborts_ok);
    CHECK_EQ(s.regions_live, 1 + NT);
    CHECK(s.bytes_moved >= inline_bytes);
    /* every destination byte is either untouched or the source byte */
    for (int t = 0; t < NT; t++) {
        for (uint64_t k = 0; k < CONC_SRC; k++)
            if (dst[t][k] != src[k])
                CHECK_EQ(dst[t][k], 0);
        xunmap(dst[t], CONC_SRC);
    }
    kv_core_free(c);
    xunmap(src, CONC_SRC);
}

/* Mover leases: a job under a lease claims no chunk once the lease ran out or
 * was removed (KV_LLM_LINK_FAILED, nothing more copied); inline jobs check it
 * before copying; a renewed lease keeps jobs going. */
static void test_mover_lease(void) {
    kv_core *c = mk(2, 64 * KiB);
    const uint64_t N = 8 * MiB;
    uint8_t *src = xmap(N), *dst = xmap(N);
    fill(src, N, 31);
    uint32_t rs = add_local(c, src, N), rd = add_local(c, dst, N);
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts); /* the mover leases' clock */
    uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    uint32_t past = 0, live = 0, gone = 0;
    CHECK_EQ(kv_lease_add(c, now - 1, &past), KV_LLM_SUCCESS);
    CHECK_EQ(kv_lease_add(c, now + 60000000000ull, &live), KV_LLM_SUCCESS);
    CHECK_EQ(kv_lease_add(c, now + 60000000000ull, &gone), KV_LLM_SUCCESS);
    CHECK(past && live && gone && past != live && live != gone);
    CHECK_EQ(kv_lease_remove(c, gone), KV_LLM_SUCCESS);
    CHECK_EQ(kv_lease_remove(c, gone), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_lease_renew(c, gone, now), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_lease_renew(c, 9999, now), KV_LLM_PARAM_INVALID);
    uint64_t w[KV_SEG_WORDS];
    int done = -1;
    uint64_t nb = 99;
    seg(w, rs, 0, rd, 0, N);
    CHECK_EQ(kv_core_submit_leased(c, 1, w, 1, 0, 0, 9999, &done, &nb), KV_LLM_PARAM_INVALID); /* no such lease */
    /* run out, or removed: nothing moves (movers, inline) */
    for (uint32_t l = 0; l < 2; l++) {
        uint32_t id = l ? gone : past;
        CHECK_EQ(kv_core_submit_leased(c, 2 + l, w, 1, 0, 0, id, &done, &nb), KV_LLM_SUCCESS);
        kv_completion cp = wait_one(c, 2 + l);
        CHECK_EQ(cp.status, KV_LLM_LINK_FAILED);
        CHECK_EQ(cp.nbytes, 0);
        CHECK_EQ(cp.flags, KV_DONE_UNSTARTED);
        CHECK_EQ(kv_core_submit_leased(c, 4 + l, w, 1, UINT64_MAX, 0, id, &done, &nb), KV_LLM_LINK_FAILED);
        CHECK_EQ(done, 1);
        CHECK_EQ(nb, 0);
    }
    CHECK(all_eq(dst, N, 0));
    /* a live lease: everything moves; renewed into the past: the next job moves nothing */
    CHECK_EQ(kv_core_submit_leased(c, 6, w, 1, 0, 0, live, &done, &nb), KV_LLM_SUCCESS);
    kv_completion cp = wait_one(c, 6);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK(memcmp(dst, src, (size_t)N) == 0);
    CHECK_EQ(kv_lease_renew(c, live, now - 1), KV_LLM_SUCCESS);
    memset(dst, 0, (size_t)N);
    CHECK_EQ(kv_core_submit_leased(c, 7, w, 1, 0, 0, live, &done, &nb), KV_LLM_SUCCESS);
    cp = wait_one(c, 7);
    CHECK_EQ(cp.status, KV_LLM_LINK_FAILED);
    CHECK(all_eq(dst, N, 0));
    /* removed while a job runs: it stops at a chunk boundary (all of it, or a prefix of whole chunks) */
    CHECK_EQ(kv_lease_renew(c, live, now + 60000000000ull), KV_LLM_SUCCESS);
    CHECK_EQ(kv_core_submit_leased(c, 8, w, 1, 0, 0, live, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(kv_lease_remove(c, live), KV_LLM_SUCCESS);
    cp = wait_one(c, 8);
    CHECK(cp.status == KV_LLM_LINK_FAILED || (cp.status == KV_LLM_SUCCESS && cp.nbytes == N));
    CHECK_EQ(cp.nbytes % (64 * KiB), 0);
    check_no_more(c);
    check_quiet_stats(c);
    kv_core_free(c);
    xunmap(src, N);
    xunmap(dst, N);
}

/* ------------------------------------------------- CMA through a pidfd */

static int xpidfd_open(pid_t pid) {
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
    return (int)syscall(SYS_pidfd_open, pid, 0);
}

static int count_fds(void) { return count_entries("/proc/self/fd"); }

/* A KV_REGION_PROCESS region names its process by pid; once that process has
 * exited the pid may be another process's. Here the region's pid is our own
 * (standing for the process that got the pid) and its pidfd that of a child
 * that has exited: no byte may move, the job fails KV_LLM_LINK_FAILED (mover
 * and inline, both directions). With a live process's pidfd, CMA works. The
 * core keeps its own dup of the pidfd and closes it when the region goes. */
static void test_pidfd(void) {
    int probe = xpidfd_open(getpid());
    if (probe < 0 && errno == ENOSYS) {
        printf("pidfd skipped: pidfd_open not supported by this kernel\n");
        return;
    }
    CHECK(probe >= 0);
    close(probe);
    kv_core *c = mk(2, 64 * KiB);
    const uint64_t N = 256 * KiB;
    uint8_t *src = xmap(N), *dst = xmap(N);
    fill(src, N, 21);
    memset(dst, 0x5A, (size_t)N);
    probe_process_vm(getpid(), dst);
    int pfd[2];
    CHECK(pipe(pfd) == 0);
    fflush(stdout);
    fflush(stderr);
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        char b;
        close(pfd[1]);
        while (read(pfd[0], &b, 1) < 0 && errno == EINTR) {
        }
        _exit(0);
    }
    close(pfd[0]);
    int dead = xpidfd_open(child);
    CHECK(dead >= 0);
    int fds0 = count_fds();
    uint32_t rl = add_local(c, src, N), rld = add_local(c, dst, N);
    uint32_t rp = add_proc(c, getpid(), dst, N), rps = add_proc(c, getpid(), src, N);
    uint32_t rp0 = add_proc(c, getpid(), dst, N);
    /* validation */
    CHECK_EQ(kv_region_pidfd(c, rl, dead, 7), KV_LLM_PARAM_INVALID);   /* not a PROCESS region */
    CHECK_EQ(kv_region_pidfd(c, 9999, dead, 7), KV_LLM_KV_CACHE_NOT_EXIST);
    CHECK_EQ(kv_region_pidfd(c, rp, -1, 7), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_region_pidfd(c, rp, dead, 7), KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_pidfd(c, rp, dead, 7), KV_LLM_PARAM_INVALID);   /* once */
    CHECK_EQ(kv_region_pidfd(c, rps, dead, 7), KV_LLM_SUCCESS);
    CHECK_EQ(count_fds(), fds0 + 1); /* one dup, shared by the regions of key 7 (one per link) */
    CHECK_EQ(kv_region_pidfd(c, rp0, dead, 0), KV_LLM_SUCCESS);
    CHECK_EQ(count_fds(), fds0 + 2); /* key 0: a dup of its own */
    /* the child is alive: CMA goes through (to our own pid, here) */
    uint64_t w[KV_SEG_WORDS];
    seg(w, rl, 0, rp, 0, N);
    submit_async(c, 1, w, 1);
    kv_completion cp = wait_one(c, 1);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK(memcmp(dst, src, (size_t)N) == 0);
    /* the child exits (reaped: its pid is free for anyone) */
    close(pfd[1]);
    int wst = 0;
    CHECK_EQ(waitpid(child, &wst, 0), child);
    close(dead); /* the core's dups stay */
    memset(dst, 0x5A, (size_t)N);
    submit_async(c, 2, w, 1); /* write, movers */
    cp = wait_one(c, 2);
    CHECK_EQ(cp.status, KV_LLM_LINK_FAILED);
    CHECK_EQ(cp.nbytes, 0);
    int done = -1;
    uint64_t nb = 99;
    CHECK_EQ(kv_core_submit(c, 3, w, 1, UINT64_MAX, &done, &nb), KV_INLINE_REFUSED); /* CMA: never inline */
    CHECK_EQ(done, 0);
    CHECK_EQ(nb, 0);
    CHECK(all_eq(dst, N, 0x5A));
    uint8_t *dst2 = xmap(N);
    memset(dst2, 0x6B, (size_t)N);
    uint32_t rld2 = add_local(c, dst2, N);
    seg(w, rps, 0, rld2, 0, N); /* read, movers */
    submit_async(c, 4, w, 1);
    cp = wait_one(c, 4);
    CHECK_EQ(cp.status, KV_LLM_LINK_FAILED);
    CHECK(all_eq(dst2, N, 0x6B));
    (void)rld;
    check_no_more(c);
    check_quiet_stats(c);
    CHECK_EQ(kv_region_remove(c, rp0), KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_remove(c, rp), KV_LLM_SUCCESS);
    CHECK_EQ(count_fds(), fds0 - 2 + 1); /* ours are closed (the pipe and the pidfd); rps still holds the shared dup */
    CHECK_EQ(kv_region_remove(c, rps), KV_LLM_SUCCESS);
    CHECK_EQ(count_fds(), fds0 - 2); /* the last region of key 7 released it */
    kv_core_free(c);
    xunmap(src, N);
    xunmap(dst, N);
    xunmap(dst2, N);
}

/* ------------------------------------------------- the TCP listener */

static uint16_t tcp_listen_local(kv_core *c) {
    uint16_t port = 0;
    CHECK_EQ(kv_tcp_listen(c, "127.0.0.1", 0, &port), KV_LLM_SUCCESS);
    CHECK(port != 0);
    return port;
}

static int tcp_connect(uint16_t port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(connect(fd, (struct sockaddr *)&a, sizeof a) == 0); /* loopback, backlog free: at once */
    return fd;
}

/* Link `a` (listening) and `b` as link `id` over loopback: `streams` connections from b,
 * b's push window `window` (a's: none), lease and fence `lease_ms`, margin `margin_ms`;
 * returns once b's link is ready. */
static void tcp_pair(kv_core *a, kv_core *b, uint32_t id, int streams, uint64_t window, uint64_t lease_ms,
                     uint64_t margin_ms) {
    const uint64_t ms = 1000000;
    uint16_t port = tcp_listen_local(a);
    uint8_t tok[KV_TOKEN_BYTES];
    for (int i = 0; i < KV_TOKEN_BYTES; i++)
        tok[i] = (uint8_t)(i * 5 + 3);
    CHECK_EQ(kv_tcp_link_add(a, id, tok, streams, 0, lease_ms * ms, lease_ms * ms, margin_ms * ms), KV_LLM_SUCCESS);
    CHECK_EQ(kv_tcp_link_add(b, id, tok, streams, window, lease_ms * ms, lease_ms * ms, margin_ms * ms),
             KV_LLM_SUCCESS);
    for (int i = 0; i < streams; i++)
        CHECK_EQ(kv_tcp_conn_add(b, tcp_connect(port), id), KV_LLM_SUCCESS);
    CHECK_EQ(wait_one(b, KV_EVENT_LINK_READY | id).status, KV_LLM_SUCCESS);
}

static void wait_conns(kv_core *c, uint64_t want) {
    double end = now_ms() + WAIT_MS;
    while (stats(c).tcp_conns != want) {
        CHECK(now_ms() < end);
        sleep_us(1000);
    }
}

/* One listener per core: a second kv_tcp_listen is refused and leaks nothing;
 * the first still accepts. kv_tcp_link_add checks its durations. */
static void test_tcp_api(void) {
    kv_core *c = mk(1, 64 * KiB);
    uint16_t port = tcp_listen_local(c);
    int fds = count_fds();
    uint16_t p2 = 0;
    CHECK_EQ(kv_tcp_listen(c, "127.0.0.1", 0, &p2), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_tcp_listen(c, "::1", 0, &p2), KV_LLM_PARAM_INVALID);
    CHECK_EQ(p2, 0);
    CHECK_EQ(count_fds(), fds);
    int s = tcp_connect(port);
    wait_conns(c, 1);
    uint8_t tok[KV_TOKEN_BYTES] = {1};
    const uint64_t ms = 1000000;
    CHECK_EQ(kv_tcp_link_add(c, 7, tok, 1, 0, 0, 500 * ms, 0), KV_LLM_PARAM_INVALID);            /* lease 0 */
    CHECK_EQ(kv_tcp_link_add(c, 7, tok, 1, 0, 400 * ms, 0, 0), KV_LLM_PARAM_INVALID);            /* fence 0 */
    CHECK_EQ(kv_tcp_link_add(c, 7, tok, 1, 0, 4000000 * ms, 500 * ms, 0), KV_LLM_PARAM_INVALID); /* > 1 h */
    CHECK_EQ(kv_tcp_link_add(c, 7, tok, 1, 0, 400 * ms, 500 * ms, 50 * ms), KV_LLM_SUCCESS);
    close(s);
    kv_core_free(c);
    CHECK_EQ(count_fds(), fds - 1 - 4); /* the listener, the two epoll sets, eventfd and the core's eventfd went */
}

/* accept() failing for want of descriptors must not make the I/O thread spin
 * (the queued connection keeps a level-triggered listener readable): it stops
 * listening for a while (tcp_accept_paused), then takes the connections once
 * descriptors are free again. In a child process (its own descriptor limit). */
static void test_accept_emfile(void) {
    int sync[2], back[2];
    CHECK(pipe(sync) == 0 && pipe(back) == 0);
    fflush(stdout);
    fflush(stderr);
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        g_test = "accept_emfile (child)";
        close(sync[0]);
        close(back[1]);
        kv_core *c = mk(1, 64 * KiB);
        uint16_t port = tcp_listen_local(c);
        /* use up every descriptor */
        struct rlimit rl;
        CHECK(getrlimit(RLIMIT_NOFILE, &rl) == 0);
        rl.rlim_cur = (rlim_t)count_fds() + 16;
        CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);
        int fill[64], nfill = 0;
        while (nfill < 64 && (fill[nfill] = dup(2)) >= 0)
            nfill++;
        CHECK(nfill < 64 && errno == EMFILE);
        CHECK(write(sync[1], &port, sizeof port) == (ssize_t)sizeof port);
        char b;
        CHECK(read(back[0], &b, 1) == 1); /* the parent connected */
        double end = now_ms() + WAIT_MS;
        while (stats(c).tcp_accept_paused == 0) {
            CHECK(now_ms() < end);
            sleep_us(1000);
        }
        struct rusage r0, r1;
        CHECK(getrusage(RUSAGE_SELF, &r0) == 0);
        double t0 = now_ms();
        sleep_us(400000);
        CHECK(getrusage(RUSAGE_SELF, &r1) == 0);
        double wall = now_ms() - t0;
        double cpu = (double)(r1.ru_utime.tv_sec - r0.ru_utime.tv_sec + r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) * 1e3 +
                     (double)(r1.ru_utime.tv_usec - r0.ru_utime.tv_usec + r1.ru_stime.tv_usec - r0.ru_stime.tv_usec) / 1e3;
        if (cpu > wall / 4) {
            FAILED_AT("the I/O thread spins on accept() failures: %.0f ms of CPU in %.0f ms", cpu, wall);
            die();
        }
        CHECK(stats(c).tcp_accept_paused >= 2); /* it tries again every 100 ms */
        CHECK_EQ(stats(c).tcp_conns, 0);
        for (int i = 0; i < nfill; i++)
            close(fill[i]);
        wait_conns(c, 3); /* descriptors again: the queued connections are taken */
        kv_core_free(c);
        fflush(stdout);
        _exit(0);
    }
    close(sync[1]);
    close(back[0]);
    uint16_t port = 0;
    CHECK(read(sync[0], &port, sizeof port) == (ssize_t)sizeof port);
    int s[3];
    for (int i = 0; i < 3; i++)
        s[i] = tcp_connect(port);
    CHECK(write(back[1], "x", 1) == 1);
    int wst = 0;
    CHECK_EQ(waitpid(child, &wst, 0), child);
    CHECK(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
    for (int i = 0; i < 3; i++)
        close(s[i]);
    close(sync[0]);
    close(back[1]);
}

/* ---------------------------------------------------------------- main */

typedef struct {
    const char *name;
    void (*fn)(void);
} test_case;

static void *noop_thread(void *arg) { return arg; }


/* ------------------------------------------------------- 2-D segments */

static void seg2(uint64_t *w, uint32_t sr, uint64_t so, uint32_t dr, uint64_t dof, uint64_t row, uint64_t rows,
                 uint64_t ss, uint64_t ds) {
    seg(w, sr, so, dr, dof, row);
    w[5] = rows;
    w[6] = ss;
    w[7] = ds;
}

/* What a 2-D copy must leave in `want` (a copy of the destination before). */
static void model2(uint8_t *want, const uint8_t *src, const uint64_t *w) {
    for (uint64_t r = 0; r < w[5]; r++)
        memcpy(want + w[3] + r * (w[5] > 1 ? w[7] : 0), src + w[1] + r * (w[5] > 1 ? w[6] : 0), (size_t)w[4]);
}

static uint32_t submit2(kv_core *c, uint64_t id, const uint64_t *segs, size_t n, uint64_t inline_max, int *done,
                        uint64_t *nb) {
    return kv_core_submit_job(c, id, segs, n, KV_SEG2_WORDS, inline_max, 0, 0, done, nb);
}

/* Every rule of a 2-D segment, at the edge and one past it (overflow included):
 * a refused job moves nothing and holds nothing. */
static void test_seg2d_validation(void) {
    const uint64_t N = 64 * KiB;
    kv_core *c = mk(1, 64 * KiB);
    uint8_t *src = xmap(N), *dst = xmap(N);
    fill(src, N, 21);
    memset(dst, 0x5A, (size_t)N);
    uint32_t rs = add_local(c, src, N), rd = add_local(c, dst, N);
    uint64_t w[2 * KV_SEG2_WORDS];
    int done = -1;
    uint64_t nb = 99;
    struct {
        uint64_t so, dof, row, rows, ss, ds;
        uint32_t want;
    } cases[] = {
        {0, 0, 0, 4, 64, 64, KV_LLM_PARAM_INVALID},                       /* row_bytes 0 */
        {0, 0, 16, 0, 64, 64, KV_LLM_PARAM_INVALID},                      /* rows 0 */
        {0, 0, 64, 4, 63, 64, KV_LLM_PARAM_INVALID},                      /* src rows overlap */
        {0, 0, 64, 4, 64, 63, KV_LLM_PARAM_INVALID},                      /* dst rows overlap */
        {0, 0, 64, 4, 0, 0, KV_LLM_PARAM_INVALID},                        /* stride 0 */
        {0, 0, 1024, 64, 1024, 1024, KV_LLM_SUCCESS},                     /* exactly the region */
        {1, 0, 1024, 64, 1024, 1024, KV_LLM_PARAM_INVALID},               /* src: one byte past */
        {0, 1, 1024, 64, 1024, 1024, KV_LLM_PARAM_INVALID},               /* dst: one byte past */
        {0, 0, 1024, 65, 1000, 1024, KV_LLM_PARAM_INVALID},               /* dst: one row past */
        {N - 100, 0, 100, 2, 100, 100, KV_LLM_PARAM_INVALID},             /* second row past */
        {0, 0, 8, 2, UINT64_MAX, 8, KV_LLM_PARAM_INVALID},                /* stride overflows */
        {0, 0, 8, UINT64_MAX, 8, 8, KV_LLM_PARAM_INVALID},                /* rows overflow */
        {0, 0, 8, (1ull << 61) + 1, 8, 8, KV_LLM_PARAM_INVALID},          /* rows * stride wraps */
        {UINT64_MAX - 7, 0, 8, 1, 8, 8, KV_LLM_PARAM_INVALID},            /* offset + row wraps */
        {0, 0, UINT64_MAX, 1, 0, 0, KV_LLM_PARAM_INVALID},                /* row over the region */
        {0, 0, N, 1, 0, 0, KV_LLM_SUCCESS},                               /* one row: strides unused */
        {N - 8, N - 8, 8, 1, UINT64_MAX, UINT64_MAX, KV_LLM_SUCCESS},     /* one row at the end */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        memset(dst, 0x5A, (size_t)N);
        seg2(w, rs, cases[i].so, rd, cases[i].dof, cases[i].row, cases[i].rows, cases[i].ss, cases[i].ds);
        /* the bad segment second: the first (good) one must not move either */
        seg2(w + KV_SEG2_WORDS, rs, 0, rd, 0, 16, 2, 32, 32);
        uint64_t two[2 * KV_SEG2_WORDS];
        memcpy(two, w + KV_SEG2_WORDS, sizeof(uint64_t) * KV_SEG2_WORDS);
        memcpy(two + KV_SEG2_WORDS, w, sizeof(uint64_t) * KV_SEG2_WORDS);
        uint32_t st = submit2(c, 100 + i, two, 2, UINT64_MAX, &done, &nb);
        CHECK_EQ(st, cases[i].want);
        if (st != KV_LLM_SUCCESS)
            CHECK(all_eq(dst, N, 0x5A));
        else
            CHECK_EQ(done, 1);
    }
    /* words other than 5 and 8; mixed lengths are the caller's business (one words per job) */
    seg2(w, rs, 0, rd, 0, 16, 2, 32, 32);
    CHECK_EQ(kv_core_submit_job(c, 1, w, 1, 6, UINT64_MAX, 0, 0, &done, &nb), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_core_submit_job(c, 1, w, 1, 0, UINT64_MAX, 0, 0, &done, &nb), KV_LLM_PARAM_INVALID);
    CHECK_EQ(kv_core_submit_job(c, 1, w, 0, 8, UINT64_MAX, 0, 0, &done, &nb), KV_LLM_PARAM_INVALID);
    /* an unknown region: not-exist, as for 1-D */
    seg2(w, rs, 0, 999, 0, 16, 2, 32, 32);
    CHECK_EQ(submit2(c, 1, w, 1, UINT64_MAX, &done, &nb), KV_LLM_KV_CACHE_NOT_EXIST);
    kv_stats st = stats(c);
    CHECK_EQ(st.jobs_live, 0);
    /* every ref taken by refused jobs was dropped: the regions go at once */
    CHECK_EQ(kv_region_remove(c, rs), KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_remove(c, rd), KV_LLM_SUCCESS);
    CHECK_EQ(stats(c).regions_live, 0);
    kv_core_free(c);
    xunmap(src, N);
    xunmap(dst, N);
}

/* 2-D copies land byte-exact (guards between and around the rows untouched):
 * inline, by movers (chunks cut mid-row and across rows and segments), and
 * through CMA (more rows than one process_vm_writev takes). */
static void test_seg2d_copy(void) {
    const uint64_t N = 4 * MiB;
    kv_core *c = mk(2, 16 * KiB);
    uint8_t *src = xmap(N), *dst = xmap(N), *want = xmap(N);
    fill(src, N, 31);
    uint32_t rs = add_local(c, src, N), rd = add_local(c, dst, N);
    uint32_t rp = add_proc(c, getpid(), dst, N); /* the same memory, through CMA */
    uint32_t rps = add_proc(c, getpid(), src, N);
    struct {
        uint64_t so, dof, row, rows, ss, ds;
    } shapes[] = {
        {0, 0, 1000, 3, 1000, 1000},      /* packed both sides */
        {7, 3, 100, 1000, 300, 257},      /* many short rows, gaps */
        {0, 64, 5000, 40, 9000, 5001},    /* rows longer than a third of a chunk */
        {123, 456, 40000, 7, 50000, 40000}, /* rows longer than a chunk */
        {0, 0, 1, 3000, 3, 2},            /* one-byte rows */
    };
    int done;
    uint64_t nb;
    for (int mode = 0; mode < 4; mode++) { /* inline, movers, CMA write, CMA read */
        uint64_t w[5 * KV_SEG2_WORDS], total = 0;
        size_t n = sizeof shapes / sizeof shapes[0];
        memset(dst, 0x5A, (size_t)N);
        memcpy(want, dst, (size_t)N);
        uint64_t base = 0;
        for (size_t i = 0; i < n; i++) { /* the shapes one after another in dst, not overlapping */
            uint32_t sr = mode == 3 ? rps : rs, dr = mode == 2 ? rp : rd;
            uint64_t ext = (shapes[i].rows - 1) * shapes[i].ds + shapes[i].row;
            seg2(w + i * KV_SEG2_WORDS, sr, shapes[i].so, dr, base + shapes[i].dof, shapes[i].row, shapes[i].rows,
                 shapes[i].ss, shapes[i].ds);
            model2(want, src, w + i * KV_SEG2_WORDS);
            base += shapes[i].dof + ext + 1;
            total += shapes[i].row * shapes[i].rows;
        }
        CHECK(base < N);
        if (mode == 3) { /* read from "another process": dst must be local */
            for (size_t i = 0; i < n; i++)
                w[i * KV_SEG2_WORDS + 2] = rd;
        }
        uint64_t id = 10 + (uint64_t)mode;
        CHECK_EQ(submit2(c, id, w, n, mode == 0 ? UINT64_MAX : 0, &done, &nb), KV_LLM_SUCCESS);
        if (mode == 0) {
            CHECK_EQ(done, 1);
            CHECK_EQ(nb, total);
        } else {
            CHECK_EQ(done, 0);
            kv_completion cp = wait_one(c, id);
            CHECK_EQ(cp.status, KV_LLM_SUCCESS);
            CHECK_EQ(cp.nbytes, total);
        }
        CHECK(memcmp(dst, want, (size_t)N) == 0);
    }
    /* the 1-D wrappers still take 5-word segments */
    uint64_t w1[KV_SEG_WORDS];
    seg(w1, rs, 0, rd, 0, 4096);
    CHECK_EQ(kv_core_submit(c, 20, w1, 1, UINT64_MAX, &done, &nb), KV_LLM_SUCCESS);
    CHECK(memcmp(dst, src, 4096) == 0);
    check_no_more(c);
    check_quiet_stats(c);
    kv_core_free(c);
    xunmap(src, N);
    xunmap(dst, N);
    xunmap(want, N);
}

/* Two completions, of `a` (`na` bytes) and `b` (`nb` bytes) in either order, both successful. */
static void wait_both(kv_core *c, uint64_t a, uint64_t na, uint64_t b, uint64_t nb) {
    kv_completion cp[2];
    memset(cp, 0, sizeof cp);
    CHECK_EQ(drain(c, cp, 2, WAIT_MS), 2);
    CHECK((cp[0].job_id == a && cp[1].job_id == b) || (cp[0].job_id == b && cp[1].job_id == a));
    for (int k = 0; k < 2; k++) {
        CHECK_EQ(cp[k].status, KV_LLM_SUCCESS);
        CHECK_EQ(cp[k].nbytes, cp[k].job_id == a ? na : nb);
    }
}

/* A head-split pair: two 2-D jobs taking the two halves (1 KiB each) of the same 2 KiB
 * rows of random 16-row blocks, submitted back to back, are copied as a pair (both
 * halves of a source row in one pass: kv_core.c pairable, copy_pair) and land
 * byte-exact, with chunks that end on a row (1 MiB) and in the middle of one (1 MiB
 * + 192: those pieces take the unpaired way). A job of another shape, one ranked more
 * than KV_PAIR_RANK_SLACK after the first, or rows that are not whole cache lines (992
 * bytes into 1 KiB destination rows, whose last 32 bytes must stay as they were) are
 * not paired, and land byte-exact. */
static void test_seg2d_pair(void) {
    const uint64_t ROW = 1024, BLK = 16, NBLK = 640, NSEG = 512; /* 8 MiB a job */
    const uint64_t NS = NBLK * BLK * 2 * ROW, ND = NBLK * BLK * ROW;
    uint8_t *src = xmap(NS), *dst[2] = {xmap(ND), xmap(ND)}, *want[2] = {xmap(ND), xmap(ND)};
    fill(src, NS, 41);
    static const uint64_t chunks[] = {MiB, MiB + 192};
    uint64_t *w[2] = {malloc(NSEG * KV_SEG2_WORDS * sizeof(uint64_t)), malloc(NSEG * KV_SEG2_WORDS * sizeof(uint64_t))};
    CHECK(w[0] && w[1]);
    for (size_t k = 0; k < sizeof chunks / sizeof chunks[0]; k++) {
        kv_core *c = mk(2, chunks[k]);
        uint32_t rs = add_local(c, src, NS), rd[2] = {add_local(c, dst[0], ND), add_local(c, dst[1], ND)};
        uint64_t paired = 0;
        for (int attempt = 0; attempt < 32 && !paired; attempt++) {
            /* a block table: NSEG distinct source blocks into NSEG distinct destination blocks */
            uint64_t sb[NBLK], db[NBLK];
            for (uint64_t i = 0; i < NBLK; i++)
                sb[i] = db[i] = i;
            uint64_t x = 0x9E3779B97F4A7C15ull * (k * 8 + (uint64_t)attempt + 1);
            for (uint64_t i = 0; i < NSEG; i++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                uint64_t a = i + x % (NBLK - i), t = sb[i];
                sb[i] = sb[a], sb[a] = t;
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                a = i + x % (NBLK - i), t = db[i];
                db[i] = db[a], db[a] = t;
            }
            for (int r = 0; r < 2; r++) {
                memset(dst[r], 0x5A, (size_t)ND);
                memcpy(want[r], dst[r], (size_t)ND);
                for (uint64_t i = 0; i < NSEG; i++) {
                    uint64_t *wi = w[r] + i * KV_SEG2_WORDS;
                    seg2(wi, rs, sb[i] * BLK * 2 * ROW + (uint64_t)r * ROW, rd[r], db[i] * BLK * ROW, ROW, BLK,
                         2 * ROW, ROW);
                    model2(want[r], src, wi);
                }
            }
            uint64_t before = stats(c).chunks_paired;
            int done;
            uint64_t nb;
            uint64_t id = 100 + (uint64_t)attempt * 2;
            CHECK_EQ(submit2(c, id, w[0], NSEG, 0, &done, &nb), KV_LLM_SUCCESS);
            CHECK_EQ(submit2(c, id + 1, w[1], NSEG, 0, &done, &nb), KV_LLM_SUCCESS);
            wait_both(c, id, NSEG * BLK * ROW, id + 1, NSEG * BLK * ROW);
            for (int r = 0; r < 2; r++)
                CHECK(memcmp(dst[r], want[r], (size_t)ND) == 0);
            paired = stats(c).chunks_paired - before;
        }
        CHECK(paired > 0); /* (the movers may finish the first job before the second comes, more often on a
                              * busy machine, where 8 tries once all missed: up to 32) */
        /* not a pair: the second job ranks more than 100 ms of deadline later; then its
         * rows are one line shorter */
        uint64_t before = stats(c).chunks_paired;
        int done;
        uint64_t nb;
        CHECK_EQ(kv_core_submit_job(c, 200, w[0], NSEG, KV_SEG2_WORDS, 0, 5000, 0, &done, &nb), KV_LLM_SUCCESS);
        CHECK_EQ(kv_core_submit_job(c, 201, w[1], NSEG, KV_SEG2_WORDS, 0, 105001, 0, &done, &nb), KV_LLM_SUCCESS);
        wait_both(c, 200, NSEG * BLK * ROW, 201, NSEG * BLK * ROW);
        for (uint64_t i = 0; i < NSEG; i++)
            w[1][i * KV_SEG2_WORDS + 4] = ROW - 64;
        CHECK_EQ(submit2(c, 202, w[0], NSEG, 0, &done, &nb), KV_LLM_SUCCESS);
        CHECK_EQ(submit2(c, 203, w[1], NSEG, 0, &done, &nb), KV_LLM_SUCCESS);
        wait_both(c, 202, NSEG * BLK * ROW, 203, NSEG * BLK * (ROW - 64));
        const uint64_t PART = 992, RS = NBLK * BLK / NSEG; /* 15.5 lines; 20 rows a segment, 10 MB a job */
        for (int r = 0; r < 2; r++) {
            memset(dst[r], 0x5A, (size_t)ND);
            memcpy(want[r], dst[r], (size_t)ND);
            for (uint64_t i = 0; i < NSEG; i++) {
                uint64_t *wi = w[r] + i * KV_SEG2_WORDS;
                seg2(wi, rs, i * RS * 2 * ROW + (uint64_t)r * PART, rd[r], i * RS * ROW, PART, RS, 2 * ROW, ROW);
                model2(want[r], src, wi);
            }
        }
        CHECK_EQ(submit2(c, 204, w[0], NSEG, 0, &done, &nb), KV_LLM_SUCCESS);
        CHECK_EQ(submit2(c, 205, w[1], NSEG, 0, &done, &nb), KV_LLM_SUCCESS);
        wait_both(c, 204, NSEG * RS * PART, 205, NSEG * RS * PART);
        for (int r = 0; r < 2; r++)
            CHECK(memcmp(dst[r], want[r], (size_t)ND) == 0);
        CHECK_EQ(stats(c).chunks_paired, before);
        check_no_more(c);
        check_quiet_stats(c);
        kv_core_free(c);
    }
    free(w[0]);
    free(w[1]);
    xunmap(src, NS);
    for (int r = 0; r < 2; r++) {
        xunmap(dst[r], ND);
        xunmap(want[r], ND);
    }
}

/* Abort of a 2-D job under way: its completion carries the abort status once no
 * mover writes any more, never more than its bytes, and nothing outside its rows
 * changes. */
static void test_seg2d_abort(void) {
    const uint64_t ROW = 48 * KiB, ROWS = 2048, SS = 64 * KiB, DS = 56 * KiB;
    const uint64_t NS = SS * ROWS, ND = DS * ROWS;
    kv_core *c = mk(2, 64 * KiB);
    uint8_t *src = xmap(NS), *dst = xmap(ND);
    memset(src, 0x11, (size_t)NS);
    memset(dst, 0x5A, (size_t)ND);
    uint32_t rs = add_local(c, src, NS), rd = add_local(c, dst, ND);
    uint64_t w[KV_SEG2_WORDS];
    seg2(w, rs, 0, rd, 0, ROW, ROWS, SS, DS);
    int done;
    uint64_t nb;
    CHECK_EQ(submit2(c, 1, w, 1, 0, &done, &nb), KV_LLM_SUCCESS);
    /* 96 MiB: the abort nearly always lands while the movers copy; on a loaded host
     * this thread may lose its CPU until the job is done (the abort then finds no
     * live job, and the job completed whole) */
    uint32_t ab = kv_core_abort(c, 1, KV_LLM_TIMEOUT);
    CHECK(ab == KV_LLM_SUCCESS || ab == KV_LLM_PARAM_INVALID);
    kv_completion cp = wait_one(c, 1);
    CHECK_EQ(cp.status, ab == KV_LLM_SUCCESS ? KV_LLM_TIMEOUT : KV_LLM_SUCCESS);
    CHECK(ab == KV_LLM_SUCCESS ? cp.nbytes <= ROW * ROWS : cp.nbytes == ROW * ROWS);
    for (uint64_t r = 0; r < ROWS; r++) { /* the gaps between rows: never written */
        CHECK(all_eq(dst + r * DS + ROW, DS - ROW, 0x5A));
        CHECK(all_eq(dst + r * DS, ROW, 0x5A) || all_eq(dst + r * DS, ROW, 0x11) || r * ROW < cp.nbytes + 2 * 64 * KiB);
    }
    check_no_more(c);
    check_quiet_stats(c);
    kv_core_free(c);
    xunmap(src, NS);
    xunmap(dst, ND);
}


/* A large mover job (streaming stores where the CPU has AVX2, reading ahead
 * across rows and segments): runs at odd alignments and lengths, short ones,
 * 2-D rows (short whole-line rows too; 1 MiB chunks cut them), land byte-exact. */
static void test_large_copy(void) {
    const uint64_t N = 24 * MiB;
    kv_core *c = mk(2, 1 * MiB);
    uint8_t *src = xmap(N), *dst = xmap(N), *want = xmap(N);
    fill(src, N, 51);
    memset(dst, 0x5A, (size_t)N);
    memcpy(want, dst, (size_t)N);
    uint32_t rs = add_local(c, src, N), rd = add_local(c, dst, N);
    const size_t NS = 1500;
    uint64_t *w = malloc(NS * KV_SEG2_WORDS * sizeof *w);
    CHECK(w != NULL);
    uint64_t total = 0, at = 1;
    for (size_t i = 0; i < NS; i++) {
        uint64_t len = i % 10 == 0 ? 1 + i % 97 : 4096 + (i * 7919) % 12000, rows = i % 7 == 3 ? 3 : 1;
        uint64_t so = (i * 104729) % (N - 3 * 20000), ds = len + (i % 5);
        if (i % 13 == 6) { /* a head range's rows: whole cache lines (streamed when aligned), 16 of them */
            len = 256 * (1 + i % 8) + (i % 4 == 1 ? 64 : 0); /* some end in half a 128-byte step */
            rows = i % 26 == 6 ? 16 : 3 + i % 5; /* whole rows in one loop, cut by the 1 MiB chunks */
            ds = i % 2 ? len : len + 64;
            at = (at + 63) & ~(uint64_t)63;
            at += i % 3 == 0 ? 32 : 0; /* and some not line-aligned (not streamed) */
            so = (i * 104729) % (N - 16 * 20000);
        }
        seg2(w + i * KV_SEG2_WORDS, rs, so, rd, at, len, rows, len + 3, ds);
        model2(want, src, w + i * KV_SEG2_WORDS);
        at += (rows - 1) * ds + len + 1 + i % 33;
        total += len * rows;
    }
    CHECK(at < N && total >= 8 * MiB);
    int done;
    uint64_t nb;
    CHECK_EQ(submit2(c, 1, w, NS, 0, &done, &nb), KV_LLM_SUCCESS);
    kv_completion cp = wait_one(c, 1);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, total);
    CHECK(memcmp(dst, want, (size_t)N) == 0);
    free(w);
    check_quiet_stats(c);
    kv_core_free(c);
    xunmap(src, N);
    xunmap(dst, N);
    xunmap(want, N);
}

/* Two cores over TCP (loopback): pushes of many small segments (DATAV frames,
 * many pieces a frame), of 2-D segments (native rows), pulls of 2-D segments
 * (READs of rows, or one row a READ from a peer without READ2D), pulls of many small
 * segments (READVs, or one READ a segment from a peer without them): byte-exact,
 * guards untouched. */
extern int kv_test_no_read2d;

/* The READVs a pull of these 1-D segments (KV_SEG_WORDS each) sends (kv_tcp.c
 * readv_claim): from each segment start, the segments of one peer region that fit
 * in `chunk` bytes together, at most 1024, when there are two or more. */
static uint64_t readvs_of(const uint64_t *w, size_t n, uint64_t chunk) {
    uint64_t readvs = 0;
    for (size_t i = 0; i < n;) {
        size_t j = i;
        uint64_t bytes = 0;
        while (j < n && j - i < 1024 && w[j * KV_SEG_WORDS] == w[i * KV_SEG_WORDS] &&
               w[j * KV_SEG_WORDS + 4] <= chunk - bytes)
            bytes += w[j++ * KV_SEG_WORDS + 4];
        if (j - i >= 2) {
            readvs++;
            i = j;
        } else {
            i++;
        }
    }
    return readvs;
}

/* b runs pull `job` of the n segments `w` (`words` each): it succeeds with `total` bytes,
 * and `dst` (N bytes) is then `want`. */
static void pull_exact(kv_core *b, uint64_t job, const uint64_t *w, size_t n, size_t words, uint64_t total,
                       const uint8_t *dst, const uint8_t *want, uint64_t N) {
    int done;
    uint64_t nb;
    CHECK_EQ(kv_core_submit_job(b, job, w, n, words, 0, 0, 0, &done, &nb), KV_LLM_SUCCESS);
    kv_completion cp = wait_one(b, job);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, total);
    CHECK(memcmp(dst, want, (size_t)N) == 0);
}

/* b pulls n (<= 2048) random segments (1 KiB..3 KiB, some back to back, one longer than a chunk, one
 * of another region of the peer) of `src` (its regions rr_src and rr_other, at `other`)
 * into `dst` (its region rb_dst): byte-exact; returns the READVs it sent. */
static uint64_t pull_pieces(kv_core *b, uint64_t job, uint32_t rr_src, uint32_t rr_other, uint32_t rb_dst,
                            const uint8_t *src, const uint8_t *other, uint8_t *dst, uint8_t *want, uint64_t N,
                            uint64_t *w, size_t n) {
    memset(dst, 0x5A, (size_t)N);
    memcpy(want, dst, (size_t)N);
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t len = 1024 + (i * 53 % 2048), so = (i * 7919) % (N / 2), dof = i * 3200 + (i % 7);
        uint32_t reg = rr_src;
        if (i % 5 == 2) { /* back to back with the previous one at the source */
            so = w[(i - 1) * KV_SEG_WORDS + 1] + w[(i - 1) * KV_SEG_WORDS + 4];
        }
        if (i == n / 2) { /* longer than a chunk: READs */
            len = 600 * KiB;
            dof = 7 * MiB;
        }
        if (i == n / 3) /* another region of the peer: the READV before it ends there */
            reg = rr_other;
        seg(w + i * KV_SEG_WORDS, reg, so, rb_dst, dof, len);
        memcpy(want + dof, (reg == rr_src ? src : other) + so, (size_t)len);
        total += len;
    }
    uint64_t before = stats(b).tcp_readv;
    pull_exact(b, job, w, n, KV_SEG_WORDS, total, dst, want, N);
    return stats(b).tcp_readv - before;
}

/* The READVs (and, in *row_reads, the READs of rows) a pull of the n 2-D segments `w`
 * sends, chunk `chunk`, to a peer that serves (`kinds`) READ2D, READV and READVs of rows
 * (2), all but READVs of rows (1) or none of them (0: rows one by one): as readv_claim
 * groups them. */
static uint64_t readv_rows_of(const uint64_t *w, size_t n, uint64_t chunk, int kinds, uint64_t *row_reads) {
    uint64_t readvs = 0;
    int vr = kinds == 2;
    *row_reads = 0;
    if (kinds == 0)
        return 0;
    for (size_t i = 0; i < n;) {
        const uint64_t *s0 = w + i * KV_SEG2_WORDS;
        int rows = s0[5] > 1;
        size_t j = i;
        uint64_t bytes = 0, nrows = 0;
        while ((vr || !rows) && j < n && j - i < 1024) {
            const uint64_t *s = w + j * KV_SEG2_WORDS;
            if (s[0] != s0[0] || s[4] * s[5] > chunk - bytes)
                break;
            if (rows ? s[5] < 2 || s[4] != s0[4] || s[6] != s0[6] || s[5] > 1024 - nrows || s[5] > 1023 : s[5] > 1)
                break;
            bytes += s[4] * s[5];
            nrows += s[5];
            j++;
        }
        if (j - i >= 2) {
            readvs++;
            *row_reads += (uint64_t)rows;
            i = j;
        } else {
            if (rows) { /* READs of rows: read_unit bytes each */
                uint64_t u = s0[4] * 1023 < chunk ? s0[4] * 1023 : chunk;
                *row_reads += (s0[4] * s0[5] + u - 1) / u;
            }
            i++;
        }
    }
    return readvs;
}

/* b pulls n (<= 180) 2-D segments of `src` (its regions rr_src and rr_other, at `other`)
 * into `dst` (its region rb_dst) from a peer serving `kinds` (readv_rows_of), head-split shaped (16 rows of 1000 bytes, 2000 apart
 * there; back to back or 24 bytes apart here), with segments of another row length,
 * of another stride, 1-D, of many one-byte rows (up to KV_MAX_PIECES rows a READV),
 * longer than a chunk and of another region among them: byte-exact, the READVs and
 * READs of rows as readv_rows_of counts them (chunk 256 KiB); returns the READVs. */
static uint64_t pull_row_pieces(kv_core *b, uint64_t job, uint32_t rr_src, uint32_t rr_other, uint32_t rb_dst,
                                const uint8_t *src, const uint8_t *other, uint8_t *dst, uint8_t *want, uint64_t N,
                                uint64_t *w, size_t n, int kinds) {
    memset(dst, 0x5A, (size_t)N);
    memcpy(want, dst, (size_t)N);
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t len = 1000, rows = 16, ss = 2000, ds = i % 3 ? 1000 : 1024;
        uint64_t so = (i * 63352) % (N - MiB), dof = i * 36 * KiB + (i % 5);
        uint32_t reg = rr_src;
        if (i % 37 == 5)
            len = 999;
        if (i % 41 == 7)
            ss = 2048;
        if (i % 43 == 9 || i % 43 == 10)
            rows = 1;
        if (i >= 100 && i < 130) { /* one-byte rows: 1024 rows of them a READV at most */
            len = 1;
            rows = 100;
            ss = 3;
            ds = i % 2 ? 1 : 2;
        }
        if (i == n / 2) { /* longer than a chunk: READs of rows */
            rows = 300;
            ds = 1024;
            dof = 7 * MiB;
        }
        if (i == n / 3) /* another region of the peer: the READV before it ends there */
            reg = rr_other;
        seg2(w + i * KV_SEG2_WORDS, reg, so, rb_dst, dof, len, rows, ss, rows > 1 ? ds : len);
        model2(want, reg == rr_src ? src : other, w + i * KV_SEG2_WORDS);
        total += len * rows;
    }
    uint64_t before = stats(b).tcp_readv, reads = stats(b).tcp_row_reads, want_reads;
    pull_exact(b, job, w, n, KV_SEG2_WORDS, total, dst, want, N);
    uint64_t readvs = stats(b).tcp_readv - before;
    CHECK_EQ(readvs, readv_rows_of(w, n, 256 * KiB, kinds, &want_reads));
    CHECK_EQ(stats(b).tcp_row_reads - reads, want_reads);
    return readvs;
}

static void test_tcp_2d(void) {
    const uint64_t N = 8 * MiB;
    kv_core *a = mk(1, 256 * KiB), *b = mk(1, 256 * KiB); /* a receives (listens), b pushes */
    tcp_pair(a, b, 5, 2, 1 * MiB, 2000, 50);
    uint8_t *asrc = xmap(N), *adst = xmap(N), *bsrc = xmap(N), *bdst = xmap(N), *want = xmap(N);
    fill(asrc, N, 41);
    fill(bsrc, N, 42);
    uint32_t ra_dst = add_region(a, KV_REGION_LOCAL, 0, adst, N, KV_REGION_F_EXPORT);
    uint32_t ra_src = add_region(a, KV_REGION_LOCAL, 0, asrc, N, KV_REGION_F_EXPORT);
    uint32_t rb_src = add_local(b, bsrc, N), rb_dst = add_local(b, bdst, N);
    uint32_t rr_dst = 0, rr_src = 0; /* a's regions, as b names them */
    CHECK_EQ(kv_region_add(b, KV_REGION_TCP, 5, ra_dst, N, 0, &rr_dst), KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_add(b, KV_REGION_TCP, 5, ra_src, N, 0, &rr_src), KV_LLM_SUCCESS);
    int done;
    uint64_t nb;
    /* 1-D: 2048 random 1 KiB..3 KiB blocks (several pieces a frame), some back to back on both sides */
    const size_t NB = 2048;
    uint64_t *w = malloc(NB * KV_SEG2_WORDS * sizeof *w);
    CHECK(w != NULL);
    memset(adst, 0x5A, (size_t)N);
    memcpy(want, adst, (size_t)N);
    uint64_t total = 0;
    for (size_t i = 0; i < NB; i++) {
        uint64_t len = 1024 + (i * 37 % 2048), so = (i * 4099) % (N - 4096), dof = i * 4096 + (i % 3);
        if (i % 5 == 1) { /* contiguous with the previous one on both sides: one piece, one run */
            so = w[(i - 1) * KV_SEG_WORDS + 1] + w[(i - 1) * KV_SEG_WORDS + 4];
            dof = w[(i - 1) * KV_SEG_WORDS + 3] + w[(i - 1) * KV_SEG_WORDS + 4];
        }
        seg(w + i * KV_SEG_WORDS, rb_src, so, rr_dst, dof, len);
        memcpy(want + dof, bsrc + so, (size_t)len);
        total += len;
    }
    CHECK_EQ(kv_core_submit(b, 1, w, NB, 0, &done, &nb), KV_LLM_SUCCESS);
    kv_completion cp = wait_one(b, 1);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, total);
    CHECK(memcmp(adst, want, (size_t)N) == 0);
    /* 2-D push: short rows, rows longer than a frame, one-byte rows */
    memset(adst, 0x5A, (size_t)N);
    memcpy(want, adst, (size_t)N);
    seg2(w, rb_src, 5, rr_dst, 3, 256, 4000, 512, 300);
    seg2(w + KV_SEG2_WORDS, rb_src, 0, rr_dst, 2 * MiB, 300 * KiB, 5, 310 * KiB, 301 * KiB);
    seg2(w + 2 * KV_SEG2_WORDS, rb_src, 77, rr_dst, 4 * MiB, 1, 5000, 3, 2);
    total = 0;
    for (int i = 0; i < 3; i++) {
        model2(want, bsrc, w + i * KV_SEG2_WORDS);
        total += w[i * KV_SEG2_WORDS + 4] * w[i * KV_SEG2_WORDS + 5];
    }
    CHECK_EQ(submit2(b, 2, w, 3, 0, &done, &nb), KV_LLM_SUCCESS);
    cp = wait_one(b, 2);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, total);
    CHECK(memcmp(adst, want, (size_t)N) == 0);
    /* 2-D pulls: READs of rows (tcp_pull_2d), answered gathered (256 KiB chunks): rows apart
     * at the destination (scattered), back to back there (one run), longer than a chunk;
     * one-byte rows: READs of 1023 rows (read_unit: the most one RDATA gathers) */
    memset(bdst, 0x5A, (size_t)N);
    memcpy(want, bdst, (size_t)N);
    seg2(w, rr_src, 9, rb_dst, 1, 1000, 300, 1500, 1200);
    seg2(w + KV_SEG2_WORDS, rr_src, 600000, rb_dst, 400000, 1024, 700, 2048, 1024);
    seg2(w + 2 * KV_SEG2_WORDS, rr_src, 2 * MiB + 3, rb_dst, 2 * MiB, 300 * KiB, 4, 310 * KiB, 301 * KiB);
    total = 0;
    for (int i = 0; i < 3; i++) {
        model2(want, asrc, w + i * KV_SEG2_WORDS);
        total += w[i * KV_SEG2_WORDS + 4] * w[i * KV_SEG2_WORDS + 5];
    }
    uint64_t row_reads = stats(b).tcp_row_reads;
    CHECK_EQ(submit2(b, 3, w, 3, 0, &done, &nb), KV_LLM_SUCCESS);
    cp = wait_one(b, 3);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, total);
    CHECK(memcmp(bdst, want, (size_t)N) == 0);
    /* one READ per chunk of each segment: 300000, 716800 and 1228800 bytes of rows */
    CHECK_EQ(stats(b).tcp_row_reads - row_reads, 2 + 3 + 5);
    seg2(w, rr_src, 5, rb_dst, 6 * MiB, 1, 3000, 3, 2);
    model2(want, asrc, w);
    row_reads = stats(b).tcp_row_reads;
    CHECK_EQ(submit2(b, 5, w, 1, 0, &done, &nb), KV_LLM_SUCCESS);
    cp = wait_one(b, 5);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, 3000);
    CHECK(memcmp(bdst, want, (size_t)N) == 0);
    CHECK_EQ(stats(b).tcp_row_reads - row_reads, 3);
    /* 1-D pulls of 2048 small segments: READVs of up to a chunk (256 KiB) of them */
    uint64_t rv = pull_pieces(b, 6, rr_src, rr_dst, rb_dst, asrc, adst, bdst, want, N, w, NB);
    CHECK_EQ(rv, readvs_of(w, NB, 256 * KiB));
    CHECK(rv >= 10);
    /* 2-D pulls of many small segments: READVs of rows */
    uint64_t *w2 = malloc(180 * KV_SEG2_WORDS * sizeof *w2);
    CHECK(w2 != NULL);
    CHECK(pull_row_pieces(b, 8, rr_src, rr_dst, rb_dst, asrc, adst, bdst, want, N, w2, 180, 2) >= 10);
    /* from a peer that does not announce READ2D (an older build): the same pulls, one READ a row */
    kv_core *c2 = mk(1, 256 * KiB);
    kv_test_no_read2d = 1;
    tcp_pair(c2, a, 7, 2, 0, 2000, 50); /* c2 listens: its HELLO_ACK says no READ2D */
    kv_test_no_read2d = 0;
    uint8_t *cdst = xmap(N);
    memset(cdst, 0x5A, (size_t)N);
    memcpy(want, cdst, (size_t)N);
    uint32_t rc_src = add_region(c2, KV_REGION_LOCAL, 0, asrc, N, KV_REGION_F_EXPORT);
    uint32_t ra_cdst = add_local(a, cdst, N), rr2 = 0;
    CHECK_EQ(kv_region_add(a, KV_REGION_TCP, 7, rc_src, N, 0, &rr2), KV_LLM_SUCCESS);
    seg2(w, rr2, 9, ra_cdst, 1, 1000, 300, 1500, 1200);
    seg2(w + KV_SEG2_WORDS, rr2, 600000, ra_cdst, 400000, 1024, 700, 2048, 1024);
    for (int i = 0; i < 2; i++)
        model2(want, asrc, w + i * KV_SEG2_WORDS);
    row_reads = stats(a).tcp_row_reads;
    CHECK_EQ(submit2(a, 1, w, 2, 0, &done, &nb), KV_LLM_SUCCESS);
    cp = wait_one(a, 1);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, 300000 + 716800);
    CHECK(memcmp(cdst, want, (size_t)N) == 0);
    CHECK_EQ(stats(a).tcp_row_reads, row_reads);
    /* ...and small segments one READ each (no READV to it) */
    uint32_t rc_other = add_region(c2, KV_REGION_LOCAL, 0, adst, N, KV_REGION_F_EXPORT), rr3 = 0;
    CHECK_EQ(kv_region_add(a, KV_REGION_TCP, 7, rc_other, N, 0, &rr3), KV_LLM_SUCCESS);
    CHECK_EQ(pull_pieces(a, 2, rr2, rr3, ra_cdst, asrc, adst, cdst, want, N, w, NB), 0);
    CHECK_EQ(pull_row_pieces(a, 3, rr2, rr3, ra_cdst, asrc, adst, cdst, want, N, w2, 180, 0), 0);
    /* from a peer that serves READ2D and READV but not READVs of rows: READVs of 1-D segments only */
    kv_core *c3 = mk(1, 256 * KiB);
    kv_test_no_read2d = 2;
    tcp_pair(c3, a, 8, 2, 0, 2000, 50);
    kv_test_no_read2d = 0;
    uint32_t rc3_src = add_region(c3, KV_REGION_LOCAL, 0, asrc, N, KV_REGION_F_EXPORT);
    uint32_t rc3_other = add_region(c3, KV_REGION_LOCAL, 0, adst, N, KV_REGION_F_EXPORT), rr4 = 0, rr5 = 0;
    CHECK_EQ(kv_region_add(a, KV_REGION_TCP, 8, rc3_src, N, 0, &rr4), KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_add(a, KV_REGION_TCP, 8, rc3_other, N, 0, &rr5), KV_LLM_SUCCESS);
    CHECK(pull_row_pieces(a, 4, rr4, rr5, ra_cdst, asrc, adst, cdst, want, N, w2, 180, 1) >= 1);
    CHECK(pull_pieces(a, 5, rr4, rr5, ra_cdst, asrc, adst, cdst, want, N, w, NB) >= 10);
    /* a 2-D push out of a's region is refused at submit, nothing sent */
    seg2(w, rb_src, 0, rr_dst, N - 100, 100, 2, 100, 100);
    CHECK_EQ(submit2(b, 4, w, 1, 0, &done, &nb), KV_LLM_PARAM_INVALID);
    CHECK_EQ(stats(a).tcp_bad_frames, 0);
    CHECK_EQ(stats(b).tcp_links_failed, 0);
    free(w);
    free(w2);
    kv_core_free(c3);
    kv_core_free(c2);
    kv_core_free(b);
    kv_core_free(a);
    xunmap(asrc, N);
    xunmap(adst, N);
    xunmap(bsrc, N);
    xunmap(bdst, N);
    xunmap(cdst, N);
    xunmap(want, N);
}

/* kv_tcp_submit_driven: one-layer pushes the calling thread drives (decisions.md #35),
 * each landed byte for byte and counted driven or handed back (none lost: a handed-back
 * one completes as any other); one beside a large push in flight; and the sockets shared
 * with the I/O thread, which keeps the link (a push of the peer's way, b's pull) going. */
static void test_tcp_driven(void) {
    const uint64_t N = 8 * MiB, L = 64 * KiB;
    kv_core *a = mk(1, 256 * KiB), *b = mk(1, 256 * KiB); /* a receives (listens), b pushes */
    tcp_pair(a, b, 6, 1, 0, 2000, 50);
    uint8_t *src = xmap(N), *dst = xmap(N), *back = xmap(L);
    fill(src, N, 51);
    memset(dst, 0x5A, (size_t)N);
    uint32_t ra = add_region(a, KV_REGION_LOCAL, 0, dst, N, KV_REGION_F_EXPORT);
    uint32_t rs = add_local(b, src, N), rback = add_local(b, back, L), rr = 0;
    CHECK_EQ(kv_region_add(b, KV_REGION_TCP, 6, ra, N, 0, &rr), KV_LLM_SUCCESS);
    uint64_t w[KV_SEG_WORDS], driven = 0, handed = 0;
    for (uint64_t i = 0; i < 200; i++) {
        uint64_t off = (i % 64) * L;
        src[off] = (uint8_t)i; /* each push's bytes differ */
        seg(w, rs, off, rr, off, L);
        kv_completion out;
        uint32_t st = 0;
        int r = kv_tcp_submit_driven(b, 100 + i, w, 1, 0, 200000, &out, &st);
        CHECK(r >= 0);
        if (r == 0)
            out = wait_one(b, 100 + i);
        *(r ? &driven : &handed) += 1;
        CHECK_EQ(out.job_id, 100 + i);
        CHECK_EQ(out.status, KV_LLM_SUCCESS);
        CHECK_EQ(out.nbytes, L);
        CHECK(memcmp(dst + off, src + off, (size_t)L) == 0);
    }
    CHECK(driven > 0);
    CHECK_EQ(stats(b).tcp_driven + stats(b).tcp_drive_handed, 200);
    /* beside a large push in flight, and a pull through the same sockets afterwards */
    int done;
    uint64_t nb;
    seg(w, rs, 0, rr, 0, N);
    CHECK_EQ(kv_core_submit(b, 1, w, 1, 0, &done, &nb), KV_LLM_SUCCESS);
    kv_completion out;
    uint32_t st = 0;
    seg(w, rs, 0, rr, 0, L);
    int r = kv_tcp_submit_driven(b, 2, w, 1, 0, 200000, &out, &st);
    CHECK(r >= 0);
    if (r)
        CHECK_EQ(out.status, KV_LLM_SUCCESS);
    kv_completion two[2]; /* the large push's, and the small one's if it was handed back: either order */
    size_t left = r ? 1 : 2;
    CHECK_EQ(drain(b, two, left, WAIT_MS), left);
    for (size_t k = 0; k < left; k++) {
        CHECK(two[k].job_id == 1 || (!r && two[k].job_id == 2));
        CHECK_EQ(two[k].status, KV_LLM_SUCCESS);
    }
    CHECK(memcmp(dst, src, (size_t)N) == 0);
    uint32_t rr_src = 0;
    CHECK_EQ(kv_region_add(b, KV_REGION_TCP, 6, ra, N, 0, &rr_src), KV_LLM_SUCCESS);
    seg(w, rr_src, 3 * L, rback, 0, L);
    CHECK_EQ(kv_core_submit(b, 3, w, 1, 0, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(wait_one(b, 3).status, KV_LLM_SUCCESS);
    CHECK(memcmp(back, src + 3 * L, (size_t)L) == 0);
    CHECK_EQ(stats(a).tcp_bad_frames, 0);
    CHECK_EQ(stats(b).tcp_links_failed, 0);
    CHECK_EQ(stats(b).jobs_live, 0);
    kv_core_free(b);
    kv_core_free(a);
    xunmap(src, N);
    xunmap(dst, N);
    xunmap(back, L);
}

/* ------------------------------------------- the close fence (tcp, hooks) */

/* kv_tcp.c's test hook (built with -DKV_TEST_HOOKS): the receiving I/O thread calls
 * it before it publishes the link it writes a payload into place for (stage 0) and
 * between its check of the link's `refused` mark and the recv (stage 1). */
extern void (*kv_test_place_hook)(int stage, const int *refused);

static pthread_mutex_t g_hook_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_hook_cv = PTHREAD_COND_INITIALIZER;
static int g_hook_stage = -1, g_hook_held, g_hook_release, g_hook_saw_mark;

/* Holds the I/O thread the first time it reaches g_hook_stage: at stage 0 until the
 * test releases it; at stage 1 until the link is marked refused (kv_tcp_link_close
 * marks it, then waits for this recv), and 5 ms longer, so a close that did not
 * wait for the recv under way would return before its bytes land. */
static void place_hook(int stage, const int *refused) {
    if (stage != g_hook_stage)
        return;
    pthread_mutex_lock(&g_hook_mu);
    if (g_hook_held) {
        pthread_mutex_unlock(&g_hook_mu);
        return;
    }
    g_hook_held = 1;
    pthread_cond_broadcast(&g_hook_cv);
    while (stage == 0 && !g_hook_release)
        pthread_cond_wait(&g_hook_cv, &g_hook_mu);
    pthread_mutex_unlock(&g_hook_mu);
    if (stage == 1) {
        double end = now_ms() + WAIT_MS;
        while (!__atomic_load_n(refused, __ATOMIC_SEQ_CST) && now_ms() < end)
            sched_yield();
        g_hook_saw_mark = __atomic_load_n(refused, __ATOMIC_SEQ_CST);
        for (double until = now_ms() + 5; now_ms() < until;)
            ;
    }
}

/* Nothing of a link lands after kv_tcp_link_close returns (its caller reports the
 * link down next, and the application may reuse the memory): a payload the I/O
 * thread was about to write into place (stage 0) stays in the socket; the one recv
 * already past the check (stage 1) ends before the close returns. */
static void test_tcp_close_fence(void) {
    const uint64_t N = 8 * MiB;
    uint8_t *src = xmap(N), *dst = xmap(N), *seen = xmap(N);
    fill(src, N, 77);
    kv_test_place_hook = place_hook;
    for (int stage = 0; stage < 2; stage++) {
        kv_core *a = mk(1, 256 * KiB), *b = mk(1, 256 * KiB); /* a receives, b pushes */
        tcp_pair(a, b, 5, 1, 0, 200, 20);
        memset(dst, 0x5A, (size_t)N);
        uint32_t ra = add_region(a, KV_REGION_LOCAL, 0, dst, N, KV_REGION_F_EXPORT);
        uint32_t rs = add_local(b, src, N), rd = 0;
        CHECK_EQ(kv_region_add(b, KV_REGION_TCP, 5, ra, N, 0, &rd), KV_LLM_SUCCESS);
        pthread_mutex_lock(&g_hook_mu);
        g_hook_stage = stage;
        g_hook_held = g_hook_release = g_hook_saw_mark = 0;
        pthread_mutex_unlock(&g_hook_mu);
        uint64_t w[KV_SEG_WORDS];
        seg(w, rs, 0, rd, 0, N);
        int done;
        uint64_t nb;
        CHECK_EQ(kv_core_submit(b, 1, w, 1, 0, &done, &nb), KV_LLM_SUCCESS);
        pthread_mutex_lock(&g_hook_mu);
        while (!g_hook_held)
            pthread_cond_wait(&g_hook_cv, &g_hook_mu);
        pthread_mutex_unlock(&g_hook_mu);
        CHECK_EQ(kv_tcp_link_close(a, 5, 0), KV_LLM_SUCCESS);
        memcpy(seen, dst, (size_t)N); /* what had landed when the close returned */
        pthread_mutex_lock(&g_hook_mu);
        g_hook_release = 1;
        pthread_cond_broadcast(&g_hook_cv);
        pthread_mutex_unlock(&g_hook_mu);
        wait_conns(a, 0); /* the close's command ran: the stream is gone */
        kv_completion cp[2]; /* b: its link down (the reset) and the push, failed */
        CHECK_EQ(drain(b, cp, 2, WAIT_MS), 2);
        int push = cp[0].job_id == 1 ? 0 : 1;
        CHECK_EQ(cp[push].job_id, 1);
        CHECK_EQ(cp[1 - push].job_id, KV_EVENT_LINK_DOWN | 5);
        g_hook_stage = -1;
        if (stage == 0)
            CHECK(all_eq(dst, N, 0x5A)); /* held before its first recv: nothing ever landed */
        else
            CHECK(g_hook_saw_mark);
        CHECK(memcmp(seen, dst, (size_t)N) == 0); /* nothing landed after the close returned */
        CHECK(cp[push].status != KV_LLM_SUCCESS);
        kv_core_free(b);
        kv_core_free(a);
    }
    kv_test_place_hook = NULL;
    xunmap(src, N);
    xunmap(dst, N);
    xunmap(seen, N);
}

/* ---- a copy another process holds (kv_core_reap) */

/* Anonymous memory under userfaultfd (missing mode): every fault is served with a
 * page of `byte`, but only once `open` is set (held_release); until then a fault (here:
 * a mover's process_vm_writev/readv into this process, as another process's
 * held page would hold it) waits in the kernel, which no signal but a fatal one
 * interrupts. */
typedef struct {
    int fd;
    uint8_t *mem;
    uint64_t len;
    uint8_t *page;
    pthread_mutex_t mu;
    int open, faults;
    uint64_t held[16]; /* pages of the faults held so far */
    int stop[2];       /* a pipe: held_free ends the server */
    pthread_t th;
} held_mem;

/* <linux/userfaultfd.h>, spelled out (the x86-64 ABI) */
struct kv_uffdio_api { uint64_t api, features, ioctls; };
struct kv_uffdio_register { uint64_t start, len, mode, ioctls; };
struct kv_uffdio_copy { uint64_t dst, src, len, mode; int64_t copy; };
#define KV_UFFDIO_API 0xC018AA3Ful
#define KV_UFFDIO_REGISTER 0xC020AA00ul
#define KV_UFFDIO_COPY 0xC028AA03ul

static void held_serve_page(held_mem *h, uint64_t addr) {
    struct kv_uffdio_copy cp = {addr, A(h->page), (uint64_t)sysconf(_SC_PAGESIZE), 0, 0};
    ioctl(h->fd, KV_UFFDIO_COPY, &cp); /* EEXIST: served already */
}

static void *held_serve(void *arg) {
    held_mem *h = arg;
    uint8_t msg[32];
    for (;;) {
        struct pollfd p[2] = {{h->fd, POLLIN, 0}, {h->stop[0], POLLIN, 0}};
        if (poll(p, 2, -1) < 0 || p[1].revents)
            return NULL; /* held_free */
        ssize_t r = read(h->fd, msg, sizeof msg);
        if (r < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (r != (ssize_t)sizeof msg)
            return NULL;
        if (msg[0] != 0x12) /* UFFD_EVENT_PAGEFAULT */
            continue;
        uint64_t addr;
        memcpy(&addr, msg + 16, sizeof addr);
        addr &= ~(uint64_t)(sysconf(_SC_PAGESIZE) - 1);
        pthread_mutex_lock(&h->mu);
        if (h->open)
            held_serve_page(h, addr);
        else if (h->faults < 16)
            h->held[h->faults++] = addr; /* served by held_release */
        pthread_mutex_unlock(&h->mu);
    }
}

/* 0 if userfaultfd is not available here (the test then says so and fails). */
static int held_init(held_mem *h, uint64_t len, uint8_t byte) {
    memset(h, 0, sizeof *h);
    long pg = sysconf(_SC_PAGESIZE);
    h->len = len;
    h->fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (h->fd < 0)
        return 0;
    struct kv_uffdio_api api = {0xAA, 0, 0};
    CHECK(ioctl(h->fd, KV_UFFDIO_API, &api) == 0);
    h->mem = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(h->mem != MAP_FAILED);
    struct kv_uffdio_register reg = {A(h->mem), len, 1 /* MISSING */, 0};
    CHECK(ioctl(h->fd, KV_UFFDIO_REGISTER, &reg) == 0);
    h->page = xmap((uint64_t)pg);
    memset(h->page, byte, (size_t)pg);
    pthread_mutex_init(&h->mu, NULL);
    CHECK(pipe(h->stop) == 0);
    CHECK(pthread_create(&h->th, NULL, held_serve, h) == 0);
    return 1;
}

/* Wait (bounded) until `n` faults are held. */
static void held_wait(held_mem *h, int n) {
    double end = now_ms() + WAIT_MS;
    pthread_mutex_lock(&h->mu);
    while (h->faults < n && now_ms() < end) {
        pthread_mutex_unlock(&h->mu);
        sleep_us(1000); /* polling a condition, bounded */
        pthread_mutex_lock(&h->mu);
    }
    int got = h->faults;
    pthread_mutex_unlock(&h->mu);
    CHECK(got >= n);
}

static void held_release(held_mem *h) {
    pthread_mutex_lock(&h->mu);
    h->open = 1;
    for (int i = 0; i < h->faults; i++)
        held_serve_page(h, h->held[i]);
    pthread_mutex_unlock(&h->mu);
}

static void held_free(held_mem *h) {
    held_release(h);
    CHECK(write(h->stop[1], "x", 1) == 1);
    CHECK(pthread_join(h->th, NULL) == 0);
    close(h->stop[0]);
    close(h->stop[1]);
    close(h->fd);
    CHECK(munmap(h->mem, (size_t)h->len) == 0);
    xunmap(h->page, (uint64_t)sysconf(_SC_PAGESIZE));
    pthread_mutex_destroy(&h->mu);
}

/* Wait (bounded) until no retired mover is left in its copy. */
static void wait_unstuck(kv_core *c) {
    double end = now_ms() + WAIT_MS;
    while (stats(c).movers_stuck && now_ms() < end)
        sleep_us(1000);
    CHECK_EQ(stats(c).movers_stuck, 0);
}

/* Four pages under userfaultfd (held_init), or the test fails saying why. */
static void held_required(held_mem *h, uint64_t pg) {
    if (!held_init(h, 4 * pg, 0xAB)) {
        FAILED_AT("userfaultfd: %s (the test needs it: vm.unprivileged_userfaultfd, or root)", strerror(errno));
        die();
    }
}

/* kv_lease_busy counts the movers inside a chunk under a lease, also after the
 * lease was removed and after the mover was reaped: until its copy returns, our
 * bytes may still reach the peer (kvengine keeps the link's socket open till then). */
static void test_lease_busy(void) {
    const uint64_t N = 64 * KiB;
    long pg = sysconf(_SC_PAGESIZE);
    held_mem h;
    held_required(&h, (uint64_t)pg);
    kv_core *c = mk(2, N);
    uint8_t *src = xmap(N);
    fill(src, N, 5);
    uint32_t rs = add_local(c, src, N), rh = add_proc(c, getpid(), h.mem, h.len);
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    uint32_t lid = 0, other = 0;
    CHECK_EQ(kv_lease_add(c, now + 60000000000ull, &lid), KV_LLM_SUCCESS);
    CHECK_EQ(kv_lease_add(c, now + 60000000000ull, &other), KV_LLM_SUCCESS);
    CHECK_EQ(kv_lease_busy(c, lid), 0);
    uint64_t w[KV_SEG_WORDS], ids[2];
    int done = -1;
    uint64_t nb = 0;
    seg(w, rs, 0, rh, 0, 100);
    CHECK_EQ(kv_core_submit_leased(c, 1, w, 1, 0, 0, lid, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(done, 0);
    held_wait(&h, 1); /* its mover is inside process_vm_writev */
    CHECK_EQ(kv_lease_busy(c, lid), 1);
    CHECK_EQ(kv_lease_busy(c, other), 0);
    CHECK_EQ(kv_lease_busy(c, 0), 0);
    CHECK_EQ(kv_lease_remove(c, lid), KV_LLM_SUCCESS);
    CHECK_EQ(kv_lease_busy(c, lid), 1); /* removed: no new chunk, but this one runs */
    CHECK_EQ(kv_core_reap(c, 0, ids, 2), 1);
    CHECK_EQ(wait_one(c, 1).status, KV_LLM_LINK_FAILED);
    CHECK_EQ(kv_lease_busy(c, lid), 1); /* reaped: the copy has still not returned */
    held_release(&h);
    wait_unstuck(c);
    CHECK_EQ(kv_lease_busy(c, lid), 0);
    kv_completion late;
    CHECK_EQ(drain(c, &late, 1, WAIT_MS), 1); /* the job's own completion */
    check_no_more(c);
    kv_core_free(c);
    held_free(&h);
    xunmap(src, N);
}

static void test_reap(void) {
    const uint64_t N = 64 * KiB;
    long pg = sysconf(_SC_PAGESIZE);
    held_mem h;
    held_required(&h, (uint64_t)pg);
    kv_core *c = mk(1, N); /* one mover: its replacement must run the next job */
    uint8_t *src = xmap(N), *dst = xmap(N), *dst2 = xmap(N);
    fill(src, N, 9);
    memset(dst2, 0x77, (size_t)N);
    uint32_t rs = add_local(c, src, N), rd = add_local(c, dst, N), rd2 = add_local(c, dst2, N);
    uint32_t rh = add_proc(c, getpid(), h.mem, h.len);
    uint64_t w[KV_SEG_WORDS];
    uint64_t ids[4];

    /* a push whose destination page is held: its mover stays in process_vm_writev */
    seg(w, rs, 0, rh, 0, 100);
    submit_async(c, 1, w, 1);
    held_wait(&h, 1);
    CHECK_EQ(kv_core_reap(c, 60ull * 1000000000ull, ids, 4), 0); /* not that long yet */
    CHECK(!readable_now(c));
    CHECK_EQ(kv_core_reap(c, 0, ids, 4), 1);
    CHECK_EQ(ids[0], 1);
    kv_completion cp = wait_one(c, 1); /* completed for the caller now */
    CHECK_EQ(cp.status, KV_LLM_LINK_FAILED);
    CHECK_EQ(cp.flags, 0);             /* bytes of it went out */
    CHECK_EQ(kv_core_reap(c, 0, ids, 4), 0); /* retired once */
    kv_stats s = stats(c);
    CHECK_EQ(s.jobs_abandoned, 1);
    CHECK_EQ(s.movers_stuck, 1);
    CHECK_EQ(s.jobs_live, 1); /* its copy has not returned: it keeps its regions */
    CHECK_EQ(kv_core_abort(c, 1, KV_LLM_TIMEOUT), KV_LLM_PARAM_INVALID); /* failed already */

    /* the pool still copies: a fresh mover took the stuck one's place */
    seg(w, rs, 0, rd, 0, N);
    submit_async(c, 2, w, 1);
    cp = wait_one(c, 2);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK(memcmp(dst, src, (size_t)N) == 0);

    /* a pull whose source page is held (another page: another fault) */
    seg(w, rh, 2 * (uint64_t)pg, rd2, 0, 2 * (uint64_t)pg);
    submit_async(c, 3, w, 1);
    held_wait(&h, 2);
    CHECK_EQ(kv_core_reap(c, 0, ids, 4), 1);
    CHECK_EQ(ids[0], 3);
    cp = wait_one(c, 3);
    CHECK_EQ(cp.status, KV_LLM_LINK_FAILED);
    CHECK_EQ(stats(c).movers_stuck, 2);

    /* the held pages come in: both copies return. The push's bytes land in the
     * memory that held them (that process's own); the pull's read lands nothing here */
    held_release(&h);
    wait_unstuck(c);
    kv_completion late[2];
    CHECK_EQ(drain(c, late, 2, WAIT_MS), 2); /* the jobs' own completions, ids the caller dropped */
    CHECK((late[0].job_id == 1 && late[1].job_id == 3) || (late[0].job_id == 3 && late[1].job_id == 1));
    CHECK(late[0].status == KV_LLM_LINK_FAILED && late[1].status == KV_LLM_LINK_FAILED);
    CHECK(all_eq(dst2, N, 0x77)); /* nothing of the pull after its status */
    CHECK(memcmp(h.mem, src, 100) == 0);
    check_no_more(c);
    check_quiet_stats(c);
    s = stats(c);
    CHECK_EQ(s.jobs_abandoned, 2);
    (void)rd2;
    kv_core_free(c);

    /* close with a mover still held: bounded (KV_CLOSE_MOVER_NS, 2 s), the core
     * left for that mover; freed once it returned */
    c = mk(1, N);
    rs = add_local(c, src, N);
    held_free(&h);
    CHECK(held_init(&h, 4 * (uint64_t)pg, 0xCD));
    rh = add_proc(c, getpid(), h.mem, h.len);
    seg(w, rs, 0, rh, 0, 100);
    submit_async(c, 4, w, 1);
    held_wait(&h, 1);
    double t0 = now_ms();
    kv_core_close(c);
    double took = now_ms() - t0;
    CHECK(took >= 1500 && took < 5000);
    CHECK_EQ(stats(c).movers_stuck, 1);
    kv_core_free(c); /* returns: the mover still uses it */
    held_release(&h);
    wait_unstuck(c);
    kv_core_free(c); /* now it frees */
    held_free(&h);
    xunmap(src, N);
    xunmap(dst, N);
    xunmap(dst2, N);
}

/* kv_core_wait_take: the loop thread waits for its own small job and takes that
 * job's completion out of the queue (its posting during the wait signals nobody); the other
 * completions stay, to be polled, with the eventfd readable for them; past the
 * bound the job completes as any other (polled, signalled). */
static void test_wait_take(void) {
    const uint64_t n = 64 * KiB;
    long pg = sysconf(_SC_PAGESIZE);
    held_mem h;
    held_required(&h, (uint64_t)pg);
    kv_core *c = mk(1, 64 * KiB);
    uint8_t *src = xmap(3 * n), *dst = xmap(3 * n);
    fill(src, 3 * n, 6);
    uint32_t rs = add_local(c, src, 3 * n), rd = add_local(c, dst, 3 * n);
    uint32_t rh = add_proc(c, getpid(), h.mem, h.len);
    uint64_t w[KV_SEG_WORDS];
    kv_completion cp, got[3];
    memset(&cp, 0, sizeof cp);
    double t0 = now_ms();
    CHECK_EQ(kv_core_wait_take(c, 1, 2000000, &cp), 0); /* nothing posts: the bound, 2 ms */
    CHECK(now_ms() - t0 >= 1.9);
    /* alone: taken */
    seg(w, rs, 0, rd, 0, n);
    submit_async(c, 1, w, 1);
    CHECK_EQ(kv_core_wait_take(c, 1, 5000000000ull, &cp), 1);
    CHECK_EQ(cp.job_id, 1);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK_EQ(cp.nbytes, n);
    CHECK_EQ(cp.flags, 0);
    CHECK_EQ(kv_core_poll(c, got, 3), 0); /* (readable only if it completed before the wait began) */
    /* among others: the others are polled, after a wake-up */
    for (uint64_t i = 0; i < 3; i++) {
        seg(w, rs, i * n, rd, i * n, n);
        submit_async(c, 2 + i, w, 1);
    }
    CHECK_EQ(kv_core_wait_take(c, 3, 5000000000ull, &cp), 1);
    CHECK_EQ(cp.job_id, 3);
    CHECK_EQ(drain(c, got, 2, WAIT_MS), 2);
    CHECK((got[0].job_id == 2 && got[1].job_id == 4) || (got[0].job_id == 4 && got[1].job_id == 2));
    CHECK(memcmp(dst, src, (size_t)(3 * n)) == 0);
    /* past the bound (the peer holds the copy): polled as any other once it completes */
    seg(w, rs, 0, rh, 0, 100);
    submit_async(c, 5, w, 1);
    held_wait(&h, 1);
    CHECK_EQ(kv_core_wait_take(c, 5, 2000000, &cp), 0);
    held_release(&h);
    cp = wait_one(c, 5);
    CHECK_EQ(cp.status, KV_LLM_SUCCESS);
    CHECK(memcmp(h.mem, src, 100) == 0);
    CHECK_EQ(kv_core_wait_take(c, 5, 0, &cp), 0); /* polled already */
    check_no_more(c);
    check_quiet_stats(c);
    kv_core_free(c);
    held_free(&h);
    xunmap(src, 3 * n);
    xunmap(dst, 3 * n);
}

int main(int argc, char **argv) {
    static const test_case tests[] = {
        {"new_params", test_new_params},
        {"regions", test_regions},
        {"submit_validation", test_submit_validation},
        {"inline", test_inline},
        {"mover", test_mover},
        {"process_self", test_process_self},
        {"process_child", test_process_child},
        {"abort", test_abort},
        {"done_flags", test_done_flags},
        {"remove_in_use", test_remove_in_use},
        {"close", test_close},
        {"poll_small_max", test_poll_small_max},
        {"concurrent", test_concurrent},
        {"pidfd", test_pidfd},
        {"mover_lease", test_mover_lease},
        {"tcp_api", test_tcp_api},
        {"accept_emfile", test_accept_emfile},
        {"seg2d_validation", test_seg2d_validation},
        {"seg2d_copy", test_seg2d_copy},
        {"seg2d_abort", test_seg2d_abort},
        {"seg2d_pair", test_seg2d_pair},
        {"large_copy", test_large_copy},
        {"tcp_2d", test_tcp_2d},
        {"tcp_driven", test_tcp_driven},
        {"tcp_close_fence", test_tcp_close_fence},
        {"reap", test_reap},
        {"lease_busy", test_lease_busy},
        {"wait_take", test_wait_take},
    };
    const size_t nt = sizeof tests / sizeof tests[0];
    setvbuf(stdout, NULL, _IOLBF, 0);
    alarm(WATCHDOG_SECONDS); /* default action: terminate, so a hang fails */
    /* Some runtimes (e.g. TSan) start a helper thread with the first
     * pthread_create; start it now so the thread counts below are stable. */
    pthread_t warm;
    CHECK(pthread_create(&warm, NULL, noop_thread, NULL) == 0);
    CHECK(pthread_join(warm, NULL) == 0);
    for (int k = 1; k < argc; k++) {
        size_t i = 0;
        while (i < nt && strcmp(argv[k], tests[i].name) != 0)
            i++;
        if (i == nt) {
            fprintf(stderr, "unknown test %s; tests:", argv[k]);
            for (i = 0; i < nt; i++)
                fprintf(stderr, " %s", tests[i].name);
            fprintf(stderr, "\n");
            return 2;
        }
    }
    int passed = 0;
    double t0 = now_ms();
    for (size_t i = 0; i < nt; i++) {
        int selected = argc < 2;
        for (int k = 1; k < argc; k++)
            selected |= strcmp(argv[k], tests[i].name) == 0;
        if (!selected)
            continue;
        g_test = tests[i].name;
        double t = now_ms();
        tests[i].fn();
        printf("ok %-18s %7.1f ms\n", tests[i].name, now_ms() - t);
        passed++;
    }
    printf("%d passed, 0 failed (%lu checks, %.1f ms)\n", passed, g_checks, now_ms() - t0);
    return 0;
}
