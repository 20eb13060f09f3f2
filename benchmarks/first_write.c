/* The first copy into a memfd's pages, by how the mapping was faulted in.
 *
 * kvengine maps caches as memfds: the owner's mapping (registry.allocate_memory) and, on
 * the same host, the peer's (kv_core.c kv_map_fd), which its movers write through. Both
 * were MAP_POPULATE (pages faulted in for reading); now both are MADV_POPULATE_WRITE
 * (Linux 5.14). This times three copies of 512 MiB into a fresh memfd, the first against
 * the later ones, for each way:
 *
 *   peer  MAP_POPULATE      the owner maps with MAP_POPULATE, a second mapping (the
 *   peer  POPULATE_WRITE    peer's) is faulted in one way or the other; streaming-store
 *                           copies (as the movers' copy_stream) through the second
 *   own   MAP_POPULATE      one mapping, faulted in one way, or MAP_POPULATE and then
 *   own   POPULATE_WRITE    MADV_POPULATE_WRITE; streaming-store copies through it
 *   own   both
 *   pread MAP_POPULATE      one mapping; the copies are pread()s from another memfd in
 *   pread POPULATE_WRITE    1 MiB calls (the kernel's copy, as a tcp receive into place)
 *
 *   cc -O2 -o /tmp/first_write benchmarks/first_write.c && /tmp/first_write
 *
 * Figures: docs/benchmarks.md, "The first write into a page". */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#define N ((size_t)512 << 20)
#define COPIES 3

enum { READ_ONLY, WRITE, BOTH };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

__attribute__((target("avx2"))) static void stream_copy(char *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(const void *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(const void *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(void *)(d + i), a);
        _mm256_stream_si256((__m256i *)(void *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(void *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(void *)(d + i + 96), e);
    }
    _mm_sfence();
}

static char *map(int fd, int how) {
    char *p = mmap(NULL, N, PROT_READ | PROT_WRITE, MAP_SHARED | (how == WRITE ? 0 : MAP_POPULATE), fd, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    if (how != READ_ONLY && madvise(p, N, MADV_POPULATE_WRITE) != 0) {
        perror("madvise(MADV_POPULATE_WRITE)");
        exit(1);
    }
    return p;
}

static int memfd(void) {
    int fd = memfd_create("first-write", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)N) != 0) {
        perror("memfd");
        exit(1);
    }
    return fd;
}

static const char *names[] = {"MAP_POPULATE", "POPULATE_WRITE", "both"};

/* kind 0: peer mapping, 1: own mapping, 2: pread into own mapping */
static void run(int kind, int how, int src_fd, const char *src) {
    int fd = memfd();
    char *owner = kind == 0 ? map(fd, READ_ONLY) : NULL, *d = map(fd, how);
    double gbps[COPIES];
    for (int i = 0; i < COPIES; i++) {
        double t = now();
        if (kind == 2) {
            for (size_t o = 0; o < N; o += 1u << 20)
                if (pread(src_fd, d + o, 1u << 20, (off_t)o) != 1 << 20) {
                    perror("pread");
                    exit(1);
                }
        } else {
            stream_copy(d, src, N);
        }
        gbps[i] = (double)N / (now() - t) / 1e9;
    }
    printf("%-5s %-15s", kind == 0 ? "peer" : kind == 1 ? "own" : "pread", names[how]);
    for (int i = 0; i < COPIES; i++)
        printf(" %6.2f", gbps[i]);
    printf("  first / later: %.2fx\n", gbps[0] / ((gbps[1] + gbps[2]) / 2));
    munmap(d, N);
    if (owner)
        munmap(owner, N);
    close(fd);
}

int main(void) {
    int src_fd = memfd();
    char *src = map(src_fd, WRITE);
    memset(src, 1, N);
    printf("copies of 512 MiB into a fresh memfd, GB/s (1e9 B/s): first, second, third\n");
    for (int round = 0; round < 2; round++) {
        run(0, READ_ONLY, src_fd, src);
        run(0, WRITE, src_fd, src);
        run(1, READ_ONLY, src_fd, src);
        run(1, WRITE, src_fd, src);
        run(1, BOTH, src_fd, src);
        run(2, READ_ONLY, src_fd, src);
        run(2, WRITE, src_fd, src);
    }
    return 0;
}
