/* The ceiling of a staged landing on this host: one copy against two pipelined ones.
 * A UCX push into kvengine is copied twice at the target (decisions.md #29): UCX's
 * receive (a cma read of the pusher's memory) into a staging buffer, then the landing
 * thread's copy into place, on two threads that overlap. NIXL copies once. Two copies
 * can keep up with one only if each runs faster than the single copy, which they can
 * only where the staging stays in a cache and the memory's bandwidth is not the limit.
 * This measures that, with no UCX and no engine: 256 MiB between touched buffers that
 * start 16 bytes into a page (numpy's), GB/s (1e9 B/s), the median of seven rounds:
 *
 *   one          process_vm_readv of ourselves, src -> dst, in MSG pieces (NIXL's copy)
 *   two MSGxK    thread A: process_vm_readv src -> a staging slot (a memfd, at the
 *                same offset in a page); thread B: pread slot -> dst (the landing);
 *                K slots of MSG bytes in a ring, A waits for a free slot
 *   two serial   the same two copies on one thread (what the overlap is measured against)
 *
 *   cc -O2 -pthread -o /tmp/staging_pipe benchmarks/staging_pipe.c && /tmp/staging_pipe
 *   /tmp/staging_pipe 128x4 512x4 1024x3     # only these: KiB x slots (x0: serial)
 *
 * docs/benchmarks.md, "UCX: the ceiling of two copies", has the figures. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define TOTAL (256u << 20)
#define ROUNDS 7
#define SKEW 16

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static char *big(size_t n) {
    char *p = mmap(NULL, n + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    madvise(p, n + 4096, MADV_HUGEPAGE);
    memset(p, 1, n + 4096);
    return p + SKEW;
}

static void readv_self(char *d, const char *s, size_t n) {
    struct iovec l = {d, n}, r = {(void *)s, n};
    if (process_vm_readv(getpid(), &l, 1, &r, 1, 0) != (ssize_t)n) {
        perror("process_vm_readv");
        exit(1);
    }
}

static void pread_all(int fd, char *d, size_t n, off_t off) {
    if (pread(fd, d, n, off) != (ssize_t)n) {
        perror("pread");
        exit(1);
    }
}

typedef struct {
    char *dst, *ring;
    int fd;
    size_t msg, slots;
    size_t produced, consumed; /* pieces, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
} pipe_t;

static void *lander(void *arg) {
    pipe_t *p = arg;
    size_t n = TOTAL / p->msg;
    for (size_t i = 0; i < n; i++) {
        pthread_mutex_lock(&p->mu);
        while (p->produced <= i)
            pthread_cond_wait(&p->cv, &p->mu);
        pthread_mutex_unlock(&p->mu);
        size_t slot = i % p->slots;
        pread_all(p->fd, p->dst + i * p->msg, p->msg, (off_t)(slot * (p->msg + 4096) + SKEW));
        pthread_mutex_lock(&p->mu);
        p->consumed = i + 1;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    return NULL;
}

static double two(char *src, char *dst, size_t msg, size_t slots, int serial) {
    pipe_t p = {.dst = dst, .msg = msg, .slots = slots};
    size_t span = slots * (msg + 4096);
    p.fd = memfd_create("staging", 0);
    if (p.fd < 0 || ftruncate(p.fd, (off_t)span) != 0) {
        perror("memfd");
        exit(1);
    }
    p.ring = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_SHARED, p.fd, 0);
    memset(p.ring, 1, span);
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    size_t n = TOTAL / msg;
    double t0 = now();
    pthread_t th;
    if (!serial)
        pthread_create(&th, NULL, lander, &p);
    for (size_t i = 0; i < n; i++) {
        size_t slot = i % slots;
        char *st = p.ring + slot * (msg + 4096) + SKEW;
        if (!serial) {
            pthread_mutex_lock(&p.mu);
            while (i >= p.consumed + slots)
                pthread_cond_wait(&p.cv, &p.mu);
            pthread_mutex_unlock(&p.mu);
        }
        readv_self(st, src + i * msg, msg);
        if (serial) {
            pread_all(p.fd, dst + i * msg, msg, (off_t)(slot * (msg + 4096) + SKEW));
            continue;
        }
        pthread_mutex_lock(&p.mu);
        p.produced = i + 1;
        pthread_cond_broadcast(&p.cv);
        pthread_mutex_unlock(&p.mu);
    }
    if (!serial)
        pthread_join(th, NULL);
    double dt = now() - t0;
    munmap(p.ring, span);
    close(p.fd);
    return TOTAL / dt / 1e9;
}

static double one(char *src, char *dst, size_t msg) {
    double t0 = now();
    for (size_t i = 0; i < TOTAL / msg; i++)
        readv_self(dst + i * msg, src + i * msg, msg);
    return TOTAL / (now() - t0) / 1e9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The median of ROUNDS runs of `two` (slots 0: serial), GB/s. */
static double median_two(char *src, char *dst, size_t msg, size_t slots) {
    double r[ROUNDS];
    for (int k = 0; k < ROUNDS; k++)
        r[k] = two(src, dst, msg, slots ? slots : 1, !slots);
    qsort(r, ROUNDS, sizeof r[0], cmp);
    return r[ROUNDS / 2];
}

int main(int argc, char **argv) {
    char *src = big(TOTAL), *dst = big(TOTAL);
    double r[ROUNDS];
    for (int k = 0; k < ROUNDS; k++)
        r[k] = one(src, dst, 1u << 20);
    qsort(r, ROUNDS, sizeof r[0], cmp);
    double base = r[ROUNDS / 2];
    printf("%-22s %8s %8s\n%-22s %8.2f %8s\n", "copy", "GB/s", "x one", "one", base, "1.00x");
    /* the configurations: the arguments (KIBxSLOTS, x0: serial), or these */
    static const char *const all[] = {"256x2",  "256x3",  "256x6",  "256x0",  "1024x2", "1024x3",
                                      "1024x6", "1024x0", "2048x2", "2048x3", "2048x6", "2048x0"};
    int n = argc > 1 ? argc - 1 : (int)(sizeof all / sizeof all[0]);
    for (int a = 0; a < n; a++) {
        const char *arg = argc > 1 ? argv[a + 1] : all[a];
        size_t kib = 0, slots = 0;
        if (sscanf(arg, "%zux%zu", &kib, &slots) != 2 || !kib || TOTAL % (kib << 10)) {
            fprintf(stderr, "bad %s (KIBxSLOTS, KiB dividing 256 MiB)\n", arg);
            return 2;
        }
        char name[64];
        if (slots)
            snprintf(name, sizeof name, "two %zuKx%zu", kib, slots);
        else
            snprintf(name, sizeof name, "two serial %zuK", kib);
        double v = median_two(src, dst, kib << 10, slots);
        printf("%-22s %8.2f %7.2fx\n", name, v, v / base);
    }
    return 0;
}
