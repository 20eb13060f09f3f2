/* The system calls a staged UCX piece can land with (kv_ucx.c land_how), and the cma
 * read that fills the staging, timed on this machine: 256 MiB in 1 MiB pieces into a
 * destination of transparent huge pages (argument 1, as numpy's large arrays) or of
 * 4 KiB pages (argument 0), five rounds, GB/s (1e9 B/s):
 *
 *   pread(memfd)      the staging memfd into place (one system call a piece)
 *   pvw(thp|4k stage) process_vm_writev into ourselves from a THP / 4 KiB staging buffer
 *   pvr(thp stage)    process_vm_readv of a THP staging buffer into place (the staging
 *                     pinned, the destination written as by read(2): no pinning of it)
 *   memcpy            the bound (not a candidate: a stop can cut it in two)
 *   pvr->memfd|thp    process_vm_readv from the destination (as UCX's cma get reads a
 *                     pusher's cache) into a memfd / THP staging buffer
 *
 *   cc -O2 -o /tmp/land_copy benchmarks/land_copy.c && /tmp/land_copy 1 && /tmp/land_copy 0
 *
 * docs/benchmarks.md, "UCX: the landing's system call", has the figures. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* n bytes of anonymous memory, 2 MiB aligned, with or without huge pages, touched */
static uint8_t *anon(size_t n, int huge) {
    uint8_t *p = mmap(NULL, n + (2u << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    p = (uint8_t *)(((uintptr_t)p + (2u << 20) - 1) & ~(uintptr_t)((2u << 20) - 1));
    madvise(p, n, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    memset(p, 1, n);
    return p;
}

int main(int argc, char **argv) {
    const size_t T = 256u << 20, S = 2u << 20, P = 1u << 20;
    int huge = argc > 1 ? atoi(argv[1]) : 1;
    uint8_t *dst = anon(T, huge), *sth = anon(S, 1), *st4 = anon(S, 0);
    int fd = memfd_create("land_copy", 0);
    if (fd < 0 || ftruncate(fd, (off_t)S) != 0) {
        perror("memfd");
        return 1;
    }
    uint8_t *st = mmap(NULL, S, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (st == MAP_FAILED) {
        perror("mmap memfd");
        return 1;
    }
    memset(st, 2, S);
    pid_t me = getpid();
    printf("destination: %s pages\n", huge ? "transparent huge" : "4 KiB");
    for (int r = 0; r < 5; r++) {
        double t[8];
        t[0] = now();
        for (size_t o = 0; o < T; o += P)
            if (pread(fd, dst + o, P, (off_t)(o % S)) != (ssize_t)P)
                perror("pread");
        t[1] = now();
        for (size_t o = 0; o < T; o += P) {
            struct iovec l = {sth + o % S, P}, d = {dst + o, P};
            if (process_vm_writev(me, &l, 1, &d, 1, 0) != (ssize_t)P)
                perror("process_vm_writev");
        }
        t[2] = now();
        for (size_t o = 0; o < T; o += P) {
            struct iovec l = {st4 + o % S, P}, d = {dst + o, P};
            if (process_vm_writev(me, &l, 1, &d, 1, 0) != (ssize_t)P)
                perror("process_vm_writev");
        }
        t[3] = now();
        for (size_t o = 0; o < T; o += P)
            memcpy(dst + o, sth + o % S, P);
        t[4] = now();
        for (size_t o = 0; o < T; o += S) {
            struct iovec l = {st, S}, rm = {dst + o, S};
            if (process_vm_readv(me, &l, 1, &rm, 1, 0) != (ssize_t)S)
                perror("process_vm_readv");
        }
        t[5] = now();
        for (size_t o = 0; o < T; o += S) {
            struct iovec l = {sth, S}, rm = {dst + o, S};
            if (process_vm_readv(me, &l, 1, &rm, 1, 0) != (ssize_t)S)
                perror("process_vm_readv");
        }
        t[6] = now();
        for (size_t o = 0; o < T; o += P) {
            struct iovec d = {dst + o, P}, rm = {sth + o % S, P};
            if (process_vm_readv(me, &d, 1, &rm, 1, 0) != (ssize_t)P)
                perror("process_vm_readv");
        }
        t[7] = now();
        printf("land: pread(memfd) %5.1f  pvw(thp stage) %5.1f  pvw(4k stage) %5.1f  pvr(thp stage) %5.1f  memcpy %5.1f"
               "  | get: pvr->memfd %5.1f  pvr->thp %5.1f GB/s\n",
               T / (t[1] - t[0]) / 1e9, T / (t[2] - t[1]) / 1e9, T / (t[3] - t[2]) / 1e9, T / (t[7] - t[6]) / 1e9, T / (t[4] - t[3]) / 1e9,
               T / (t[5] - t[4]) / 1e9, T / (t[6] - t[5]) / 1e9);
    }
    return 0;
}
