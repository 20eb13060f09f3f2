/* The movers' streamed copy (kv_core.c copy_stream, copy_rows_stream) outside kvengine,
 * on the paged bench's patterns, with two read-ahead policies:
 *
 *   every line   (kv_core.c until 2026-12-05) every line 4 KiB ahead into L1, rows too
 *   page starts  (since) within a run only the first two lines of each 4 KiB page 4 KiB
 *                ahead, a 2-D segment's rows into L2
 *
 * Both read the next run's first 4 KiB near a run's end. Patterns: 256 random 16-token
 * blocks x 64 tensors (32 KiB each, 512 MiB) out of a pool of 1024 blocks per tensor into
 * random blocks of another pool ("paged"); the same bytes as one 8 MiB run per tensor
 * ("contiguous"); a TP=2 rank's half of each random block (16 rows of 1 KiB at a 2 KiB
 * stride, 256 MiB) into a pool of half blocks ("head-split"); both TP=2 ranks' halves
 * (512 MiB), rank 0's whole table first and then rank 1's, as the movers take two queued
 * jobs ("2 ranks in turn"), or 64 blocks of one rank and then the same 64 of the other,
 * so the second reads lines the first brought in ("2 ranks in step"), or each row's two
 * halves in one pass, into both ranks' pools ("2 ranks paired", as the movers copy a
 * head-split pair since 2026-12-06: kv_core.c copy_rows_pair). Two threads take
 * 1 MiB at a time, as the movers do. The pools are shared anonymous memory of one process
 * (the engine's are memfds of two). 11 rounds, a new random table each; medians, GB/s
 * (1e9 B/s) of the bytes copied.
 *
 *   cc -O2 -pthread -o /tmp/paged_copy benchmarks/paged_copy.c && /tmp/paged_copy
 *
 * docs/benchmarks.md, "Prefetching less", "Tried, not kept: head-split ranks copied in
 * step" and "Head-split pairs", have the figures. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define BLOCK (32u << 10)
#define POOL 1024 /* blocks per tensor */
#define TENSORS 64
#define TABLE 256 /* blocks pushed per tensor */
#define AHEAD 4096
#define CLAIM (1u << 20) /* bytes a thread takes at a time, as chunk_bytes */
#define ROUNDS 11
#define STEP 64 /* blocks of one rank before the other's ("in step": a 1 MiB claim of half blocks) */
#define KINDS 6

typedef struct {
    size_t src, dst, len, rows, src_stride, dst_stride, dst2;
} run_t;

static uint8_t *src_pool, *dst_pool;
static const run_t *runs;
static int nruns, next_run, page_starts;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

__attribute__((target("avx2"))) static inline void stream_128(uint8_t *d, const uint8_t *s) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)s);
    __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(s + 32));
    __m256i c = _mm256_loadu_si256((const __m256i *)(const void *)(s + 64));
    __m256i e = _mm256_loadu_si256((const __m256i *)(const void *)(s + 96));
    _mm256_stream_si256((__m256i *)(void *)d, a);
    _mm256_stream_si256((__m256i *)(void *)(d + 32), b);
    _mm256_stream_si256((__m256i *)(void *)(d + 64), c);
    _mm256_stream_si256((__m256i *)(void *)(d + 96), e);
}

#define PREFETCH2(p, hint)                                                                                   \
    do {                                                                                                     \
        _mm_prefetch((const char *)(p), hint);                                                               \
        _mm_prefetch((const char *)(p) + 64, hint);                                                          \
    } while (0)

/* a run (32-byte aligned destination, a multiple of 128 bytes); `next`: the next run's source */
#define COPY_RUN(name, IN_RUN)                                                                               \
    __attribute__((target("avx2"))) static void name(uint8_t *d, const uint8_t *s, size_t n, const uint8_t *next, \
                                                     size_t next_len) {                                      \
        for (; n >= 128; d += 128, s += 128, n -= 128) {                                                     \
            if (n > AHEAD) {                                                                                 \
                if (IN_RUN(s + AHEAD))                                                                       \
                    PREFETCH2(s + AHEAD, _MM_HINT_T0);                                                       \
            } else if (AHEAD - n < next_len) {                                                               \
                PREFETCH2(next + (AHEAD - n), _MM_HINT_T0);                                                  \
            }                                                                                                \
            stream_128(d, s);                                                                                \
        }                                                                                                    \
    }
#define EVERY_LINE(p) 1
#define PAGE_START(p) (((uintptr_t)(p) & 4095) < 128)
COPY_RUN(copy_every_line, EVERY_LINE)
COPY_RUN(copy_page_starts, PAGE_START)

/* whole rows of whole lines, the row AHEAD bytes ahead (then the next run's rows) */
#define COPY_ROWS(name, HINT)                                                                                \
    __attribute__((target("avx2"))) static void name(uint8_t *d, const uint8_t *s, const run_t *r, const uint8_t *next, \
                                                     const run_t *nr) {                                      \
        size_t k = (AHEAD + r->len - 1) / r->len;                                                            \
        for (size_t i = 0; i < r->rows; i++, d += r->dst_stride, s += r->src_stride) {                       \
            const uint8_t *p = i + k < r->rows ? s + k * r->src_stride                                       \
                               : nr && i + k - r->rows < nr->rows ? next + (i + k - r->rows) * nr->src_stride \
                                                                   : NULL;                                   \
            for (size_t o = 0; o + 128 <= r->len; o += 128) {                                                \
                if (p)                                                                                       \
                    PREFETCH2(p + o, HINT);                                                                  \
                stream_128(d + o, s + o);                                                                    \
            }                                                                                                \
        }                                                                                                    \
    }
COPY_ROWS(rows_l1, _MM_HINT_T0)
COPY_ROWS(rows_l2, _MM_HINT_T2)

/* both ranks' halves of each row in one pass, as the movers copy a head-split pair
 * (kv_core.c copy_rows_pair): s[0:len] -> d, s[len:2len] -> d2 */
__attribute__((target("avx2"))) static void rows_paired(uint8_t *d, uint8_t *d2, const uint8_t *s, const run_t *r) {
    size_t k = (AHEAD + 2 * r->len - 1) / (2 * r->len);
    for (size_t i = 0; i < r->rows; i++, d += r->dst_stride, d2 += r->dst_stride, s += r->src_stride) {
        const uint8_t *p = i + k < r->rows ? s + k * r->src_stride : NULL;
        for (size_t o = 0; o + 128 <= r->len; o += 128) {
            if (p) {
                PREFETCH2(p + o, _MM_HINT_T2);
                PREFETCH2(p + r->len + o, _MM_HINT_T2);
            }
            stream_128(d + o, s + o);
            stream_128(d2 + o, s + r->len + o);
        }
    }
}

static void *mover(void *arg) {
    (void)arg;
    for (;;) {
        /* a claim: whole runs up to CLAIM bytes (a contiguous 8 MiB run is cut in CLAIM pieces) */
        int i = __atomic_fetch_add(&next_run, 1, __ATOMIC_RELAXED);
        if (i >= nruns)
            break;
        const run_t *r = &runs[i], *nr = i + 1 < nruns ? &runs[i + 1] : NULL;
        const uint8_t *next = nr ? src_pool + nr->src : NULL;
        if (r->dst2)
            rows_paired(dst_pool + r->dst, dst_pool + r->dst2, src_pool + r->src, r);
        else if (r->rows > 1)
            (page_starts ? rows_l2 : rows_l1)(dst_pool + r->dst, src_pool + r->src, r, next, nr);
        else
            (page_starts ? copy_page_starts : copy_every_line)(dst_pool + r->dst, src_pool + r->src, r->len, next,
                                                               nr ? nr->len : 0);
        _mm_sfence();
    }
    return NULL;
}

static double timed(const run_t *r, int n) {
    pthread_t t[2];
    runs = r;
    nruns = n;
    next_run = 0;
    double t0 = now();
    for (int i = 0; i < 2; i++)
        pthread_create(&t[i], NULL, mover, NULL);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    return now() - t0;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* the first TABLE entries of `perm` become a random choice of distinct blocks */
static void shuffle(int *perm) {
    for (int i = 0; i < POOL; i++)
        perm[i] = i;
    for (int i = 0; i < TABLE; i++) {
        int j = i + rand() % (POOL - i), x = perm[i];
        perm[i] = perm[j];
        perm[j] = x;
    }
}

int main(void) {
    size_t pool = (size_t)POOL * TENSORS * BLOCK;
    src_pool = mmap(NULL, pool, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    dst_pool = mmap(NULL, pool, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (src_pool == MAP_FAILED || dst_pool == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    memset(src_pool, 1, pool);
    memset(dst_pool, 2, pool);
    const int n = TABLE * TENSORS, pieces = (int)((size_t)TABLE * BLOCK / CLAIM);
    run_t *paged = calloc(n, sizeof *paged), *split = calloc(n, sizeof *split);
    run_t *in_turn = calloc(2 * (size_t)n, sizeof *in_turn), *in_step = calloc(2 * (size_t)n, sizeof *in_step);
    run_t *paired = calloc(n, sizeof *paired);
    run_t *contiguous = calloc((size_t)TENSORS * pieces, sizeof *contiguous);
    static int ps[POOL], pd[POOL];
    const char *names[KINDS] = {"paged",           "contiguous",      "head-split",
                                "2 ranks in turn", "2 ranks in step", "2 ranks paired"};
    double secs[2][KINDS][ROUNDS];
    for (int r = 0; r < ROUNDS; r++) {
        for (int t = 0; t < TENSORS; t++) {
            shuffle(ps);
            shuffle(pd);
            for (int i = 0; i < TABLE; i++) {
                size_t s = ((size_t)t * POOL + ps[i]) * BLOCK;
                paged[t * TABLE + i] = (run_t){s, ((size_t)t * POOL + pd[i]) * BLOCK, BLOCK, 1, 0, 0, 0};
                int k = t * TABLE + i;
                split[k] = (run_t){s, ((size_t)t * POOL + pd[i]) * (BLOCK / 2), 1024, 16, 2048, 1024, 0};
                run_t other = split[k]; /* rank 1: the other half of each row, into its own pool */
                other.src += 1024;
                other.dst += pool / 2;
                in_turn[k] = split[k];
                in_turn[n + k] = other;
                in_step[k / STEP * 2 * STEP + k % STEP] = split[k];
                in_step[k / STEP * 2 * STEP + STEP + k % STEP] = other;
                paired[k] = split[k];
                paired[k].dst2 = other.dst;
            }
            for (int i = 0; i < pieces; i++) {
                size_t at = (size_t)t * POOL * BLOCK + (size_t)i * CLAIM;
                contiguous[t * pieces + i] = (run_t){at, at, CLAIM, 1, 0, 0, 0};
            }
        }
        for (page_starts = 0; page_starts < 2; page_starts++) {
            secs[page_starts][0][r] = timed(paged, n);
            secs[page_starts][1][r] = timed(contiguous, TENSORS * pieces);
            secs[page_starts][2][r] = timed(split, n);
            secs[page_starts][3][r] = timed(in_turn, 2 * n);
            secs[page_starts][4][r] = timed(in_step, 2 * n);
            secs[page_starts][5][r] = timed(paired, n);
        }
    }
    double bytes[KINDS] = {(double)n * BLOCK, (double)n * BLOCK, (double)n * BLOCK / 2, (double)n * BLOCK,
                           (double)n * BLOCK, (double)n * BLOCK};
    for (int p = 0; p < 2; p++) {
        printf("%-12s", p ? "page starts" : "every line");
        for (int k = 0; k < KINDS; k++) {
            qsort(secs[p][k], ROUNDS, sizeof(double), by_value);
            printf("  %s %.2f GB/s", names[k], bytes[k] / secs[p][k][ROUNDS / 2] / 1e9);
        }
        printf("\n");
    }
    return 0;
}
