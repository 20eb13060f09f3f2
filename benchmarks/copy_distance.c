/* How fast the copies kvengine leaves to the kernel run, by the distance between the
 * destination and the source modulo 4 KiB. The kernel copies to and from user memory
 * with `rep movsb` where the CPU has fast string moves (FSRM): on AMD EPYC (Zen) that
 * runs at about a quarter of its speed when the destination lies 1-31 bytes past the
 * source modulo a page, and numpy's large arrays begin 16 bytes into a page. 256 MiB in
 * 1 MiB pieces between touched anonymous buffers, the best of five rounds, GB/s (1e9 B/s):
 *
 *   rep movsb  the instruction itself, in user space
 *   memcpy     glibc's (it may avoid `rep movsb` at short distances)
 *   pread      a memfd's pages (page-aligned) into the destination, as a staged UCX
 *              piece lands; the distance is the destination's offset in a page
 *   pvw        process_vm_writev into ourselves, as the other landing way and CMA
 *
 *   cc -O2 -o /tmp/copy_distance benchmarks/copy_distance.c && /tmp/copy_distance
 *
 * docs/benchmarks.md, "Landing at the destination's offset in a page", has the figures. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define TOTAL (256u << 20)
#define PIECE (1u << 20)
#define ROUNDS 5

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void rep_movsb(void *d, const void *s, size_t n) {
    __asm__ volatile("rep movsb" : "+D"(d), "+S"(s), "+c"(n) : : "memory");
}

static uint8_t *anon(size_t n) {
    uint8_t *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    memset(p, 1, n);
    return p;
}

int main(void) {
    static const unsigned dist[] = {0, 1, 8, 16, 31, 32, 33, 64, 2048, 4080};
    uint8_t *src = anon(TOTAL), *dst = anon(TOTAL + 4096);
    int fd = memfd_create("copy_distance", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, TOTAL) != 0 || pwrite(fd, src, TOTAL, 0) != (ssize_t)TOTAL) {
        perror("memfd");
        return 1;
    }
    printf("dst - src mod 4096   rep movsb   memcpy   pread   pvw   (GB/s)\n");
    for (size_t k = 0; k < sizeof dist / sizeof *dist; k++) {
        double gbps[4];
        for (int how = 0; how < 4; how++) {
            double best = 1e9;
            for (int r = 0; r < ROUNDS; r++) {
                double t0 = now();
                for (size_t o = 0; o < TOTAL; o += PIECE) {
                    uint8_t *d = dst + dist[k] + o;
                    if (how == 0) {
                        rep_movsb(d, src + o, PIECE);
                    } else if (how == 1) {
                        memcpy(d, src + o, PIECE);
                    } else if (how == 2) {
                        if (pread(fd, d, PIECE, (off_t)o) != (ssize_t)PIECE)
                            return 1;
                    } else {
                        struct iovec lo = {src + o, PIECE}, re = {d, PIECE};
                        if (process_vm_writev(getpid(), &lo, 1, &re, 1, 0) != (ssize_t)PIECE)
                            return 1;
                    }
                }
                double t = now() - t0;
                best = t < best ? t : best;
            }
            gbps[how] = TOTAL / best / 1e9;
        }
        printf("%18u   %9.2f   %6.2f   %5.2f   %4.2f\n", dist[k], gbps[0], gbps[1], gbps[2], gbps[3]);
    }
    return 0;
}
