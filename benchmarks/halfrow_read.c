/* Why a head-split push reads its source at half speed: half rows against whole ones.
 * A TP=1 -> TP=2 head-split sends each rank the first or the second 1 KiB of every
 * 2 KiB source row (4 of 8 heads). Read alone, a half row costs about a whole row of
 * memory traffic; read back to back with the other half (a pair), it costs half. The
 * movers copy a pair in one pass (decisions.md #37); a TCP push's rows are read by the
 * kernel's copy in sendmsg, one rank at a time. This measures, with no engine, GB/s of
 * payload (1e9 B/s) copied with `rep movsb` (the kernel's copy) from a 512 MiB source
 * (transparent huge pages) into a 256 KiB ring (an skb's pages stand in for it), one
 * round per line, five rounds:
 *
 *   whole 32K    contiguous source, 32 KiB per copy (a contiguous push)
 *   whole 1K     contiguous source, 1 KiB per copy (the per-copy cost alone)
 *   half 1K      the first 1 KiB of each 2 KiB row (one rank's head-split)
 *   pair 1K      both halves of each row, one after the other, to two rings
 *   G rows       both ranks' halves, G rows of one, then the same G rows of the other
 *   prefetch     half 1K, each group of 64 rows prefetched before it is copied
 *
 *   cc -O2 -o /tmp/halfrow_read benchmarks/halfrow_read.c && /tmp/halfrow_read
 *
 * docs/benchmarks.md, "Head-split over TCP: half rows", has the figures. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define SRC (512ul << 20)
#define RING (256u << 10)
#define ROW 2048u
#define HALF 1024u

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static inline void copy(void *d, const void *s, size_t n) {
    __asm__ volatile("rep movsb" : "+D"(d), "+S"(s), "+c"(n) : : "memory");
}

static char *src, *ring, *ring2;

/* rows [0, SRC / ROW): G rows' first halves, then the same rows' second halves */
static double interleaved(size_t g) {
    double t = now();
    size_t r = 0, r2 = 0;
    for (size_t o = 0; o < SRC; o += ROW * g) {
        for (size_t k = 0; k < g; k++, r = (r + HALF) % RING)
            copy(ring + r, src + o + k * ROW, HALF);
        for (size_t k = 0; k < g; k++, r2 = (r2 + HALF) % RING)
            copy(ring2 + r2, src + o + k * ROW + HALF, HALF);
    }
    return SRC / (now() - t) / 1e9;
}

int main(void) {
    src = mmap(NULL, SRC, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ring = aligned_alloc(4096, RING);
    ring2 = aligned_alloc(4096, RING);
    if (src == MAP_FAILED || !ring || !ring2)
        return 1;
    madvise(src, SRC, MADV_HUGEPAGE);
    memset(src, 1, SRC);
    memset(ring, 0, RING);
    memset(ring2, 0, RING);
    printf("GB/s of payload: whole 32K | whole 1K | half 1K | pair 1K | G=16 | G=256 | G=1024 | prefetch\n");
    for (int round = 0; round < 5; round++) {
        double t = now(), g[8];
        size_t r = 0;
        for (size_t o = 0; o < SRC / 2; o += 32768, r = (r + 32768) % RING)
            copy(ring + r, src + o, 32768);
        g[0] = SRC / 2 / (now() - t) / 1e9;
        t = now();
        for (size_t o = 0; o < SRC / 2; o += HALF, r = (r + HALF) % RING)
            copy(ring + r, src + o, HALF);
        g[1] = SRC / 2 / (now() - t) / 1e9;
        t = now();
        for (size_t o = 0; o < SRC; o += ROW, r = (r + HALF) % RING)
            copy(ring + r, src + o, HALF);
        g[2] = SRC / 2 / (now() - t) / 1e9;
        g[3] = interleaved(1);
        g[4] = interleaved(16);
        g[5] = interleaved(256);
        g[6] = interleaved(1024);
        t = now();
        for (size_t o = 0; o < SRC; o += ROW * 64) {
            for (size_t k = 0; k < 64; k++)
                for (size_t l = 0; l < HALF; l += 64)
                    __builtin_prefetch(src + o + k * ROW + l, 0, 3);
            for (size_t k = 0; k < 64; k++, r = (r + HALF) % RING)
                copy(ring + r, src + o + k * ROW, HALF);
        }
        g[7] = SRC / 2 / (now() - t) / 1e9;
        printf("%.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f\n", g[0], g[1], g[2], g[3], g[4], g[5], g[6],
               g[7]);
    }
    return 0;
}
