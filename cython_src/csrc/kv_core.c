/* kvengine native core. See kv_core.h for the contract. */
/* Guarded: setup.py and the tests pass -D_GNU_SOURCE (=1); an unguarded
 * redefinition warns, and is an error under -Werror. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kv_internal.h"

#include <assert.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <fcntl.h>
#include <unistd.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KV_HAVE_STREAM 1
#endif

/* ------------------------------------------------------------------ regions */

kv_region *kv__region_get(kv_core *c, uint32_t id) {
    if (id == 0 || id >= c->nregions)
        return NULL;
    return c->regions[id];
}

static void pidref_put(kv_core *c, kv_pidref *p) {
    if (!p || --p->refs > 0)
        return;
    kv_pidref **pp = &c->pidrefs;
    while (*pp != p)
        pp = &(*pp)->next;
    *pp = p->next;
    close(p->fd);
    free(p);
}

static int region_release(kv_core *c, uint32_t id) {
    kv_region *r = c->regions[id];
    int sig = 0;
    if (r->kind == KV_REGION_LOCAL) /* a transport may have registered it (UCX) */
        for (int k = 0; k < KV_REGION_KINDS; k++)
            if (c->transports[k] && c->transports[k]->ops->region_freed)
                c->transports[k]->ops->region_freed(c->transports[k], id);
    if (r->flags & KV_REGION_F_UNMAP)
        munmap((void *)(uintptr_t)r->addr, (size_t)r->len); /* nothing to do on failure */
    pidref_put(c, r->pidref);
    if (r->freed_event) {
        sig = kv__post_event(c, r->freed_event);
        r->freed_event = NULL;
    }
    free(r);
    c->regions[id] = NULL;
    c->stats.regions_live--;
    return sig;
}

void kv__region_ref(kv_core *c, uint32_t id) { c->regions[id]->refs++; }

static int region_unref_sig(kv_core *c, uint32_t id) {
    kv_region *r = c->regions[id];
    if (--r->refs == 0 && r->removed)
        return region_release(c, id);
    return 0;
}

/* An unref that releases a notifying region signals the loop itself: callers
 * hold the lock, so the eventfd write happens here (a write under the lock is
 * harmless, just not free). */
void kv__region_unref(kv_core *c, uint32_t id) {
    if (region_unref_sig(c, id))
        kv__signal_loop(c);
}

uint32_t kv_region_add(kv_core *c, int kind, int32_t pid, uint64_t addr, uint64_t len,
                       unsigned flags, uint32_t *region_id) {
    if (len == 0 || addr + len < addr || (flags & ~7u))
        return KV_LLM_PARAM_INVALID;
    if (kind == KV_REGION_LOCAL) {
        if (addr == 0)
            return KV_LLM_PARAM_INVALID;
    } else if (kind == KV_REGION_PROCESS) {
        if (addr == 0 || pid <= 0 || (flags & (KV_REGION_F_UNMAP | KV_REGION_F_EXPORT)))
            return KV_LLM_PARAM_INVALID;
    } else if (kind == KV_REGION_TCP || kind == KV_REGION_UCX) {
        if (pid <= 0 || addr == 0 || addr > UINT32_MAX || (flags & (KV_REGION_F_UNMAP | KV_REGION_F_EXPORT)))
            return KV_LLM_PARAM_INVALID;
    } else {
        return KV_LLM_PARAM_INVALID;
    }
    kv_region *r = calloc(1, sizeof *r);
    kv_event *ev = (flags & KV_REGION_F_NOTIFY) ? calloc(1, sizeof *ev) : NULL;
    if (!r || ((flags & KV_REGION_F_NOTIFY) && !ev)) {
        free(r);
        free(ev);
        return KV_LLM_OUT_OF_MEMORY;
    }
    r->addr = addr;
    r->len = len;
    r->pid = pid;
    r->kind = kind;
    r->flags = flags;
    r->freed_event = ev;
    pthread_mutex_lock(&c->lock);
    if (c->closed) {
        pthread_mutex_unlock(&c->lock);
        free(r);
        free(ev);
        return KV_LLM_ENGINE_FINALIZED;
    }
    if (c->nregions >= c->region_cap) {
        size_t cap = c->region_cap ? c->region_cap * 2 : 64;
        kv_region **n = realloc(c->regions, cap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&c->lock);
            free(r);
            free(ev);
            return KV_LLM_OUT_OF_MEMORY;
        }
        c->regions = n;
        c->region_cap = cap;
    }
    if (c->nregions > UINT32_MAX - 1) {
        pthread_mutex_unlock(&c->lock);
        free(r);
        free(ev);
        return KV_LLM_OUT_OF_MEMORY;
    }
    *region_id = (uint32_t)c->nregions;
    if (ev) {
        ev->record.id = KV_EVENT_REGION_FREED | *region_id;
        ev->record.kind = KV_RECORD_EVENT;
    }
    c->regions[c->nregions++] = r;
    c->stats.regions_live++;
    pthread_mutex_unlock(&c->lock);
    return KV_LLM_SUCCESS;
}

uint32_t kv_region_remove(kv_core *c, uint32_t id) {
    pthread_mutex_lock(&c->lock);
    kv_region *r = kv__region_get(c, id);
    if (!r || r->removed) {
        pthread_mutex_unlock(&c->lock);
        return KV_LLM_KV_CACHE_NOT_EXIST;
    }
    r->removed = 1;
    int sig = r->refs == 0 ? region_release(c, id) : 0;
    pthread_mutex_unlock(&c->lock);
    if (sig)
        kv__signal_loop(c);
    return KV_LLM_SUCCESS;
}

uint32_t kv_region_pidfd(kv_core *c, uint32_t id, int pidfd, uint64_t key) {
    if (pidfd < 0)
        return KV_LLM_PARAM_INVALID;
    pthread_mutex_lock(&c->lock);
    kv_region *r = kv__region_get(c, id);
    uint32_t st = KV_LLM_SUCCESS;
    kv_pidref *p = NULL;
    if (!r || r->removed)
        st = KV_LLM_KV_CACHE_NOT_EXIST;
    else if (r->kind != KV_REGION_PROCESS || r->pidref)
        st = KV_LLM_PARAM_INVALID; /* once: jobs may hold the first one */
    if (st == KV_LLM_SUCCESS && key)
        for (p = c->pidrefs; p && p->key != key; p = p->next)
            ;
    if (st == KV_LLM_SUCCESS && !p) {
        p = calloc(1, sizeof *p);
        int fd = p ? fcntl(pidfd, F_DUPFD_CLOEXEC, 3) : -1;
        if (fd < 0) {
            st = !p || errno == EMFILE || errno == ENFILE ? KV_LLM_OUT_OF_MEMORY : KV_LLM_PARAM_INVALID;
            free(p);
            p = NULL;
        } else {
            p->key = key;
            p->fd = fd;
            p->next = c->pidrefs;
            c->pidrefs = p;
        }
    }
    if (st == KV_LLM_SUCCESS) {
        p->refs++;
        r->pidref = p;
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

int kv_populate_write(void *addr, uint64_t len) {
    return madvise(addr, (size_t)len, MADV_POPULATE_WRITE) == 0 ? 0 : errno;
}

uint32_t kv_map_fd(int fd, uint64_t len, uint64_t *addr) {
    if (fd < 0 || len == 0 || len > (uint64_t)SIZE_MAX)
        return KV_LLM_PARAM_INVALID;
    void *p = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return errno == ENOMEM ? KV_LLM_OUT_OF_MEMORY : KV_LLM_FAILED;
    int e = kv_populate_write(p, len);
    if (e) {
        munmap(p, (size_t)len);
        if (e != EINVAL) /* ENOMEM; EFAULT: fewer pages than `len` (the caller checked the size) */
            return e == ENOMEM ? KV_LLM_OUT_OF_MEMORY : KV_LLM_FAILED;
        p = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        if (p == MAP_FAILED)
            return errno == ENOMEM ? KV_LLM_OUT_OF_MEMORY : KV_LLM_FAILED;
    }
    *addr = (uint64_t)(uintptr_t)p;
    return KV_LLM_SUCCESS;
}

/* ----------------------------------------------------------- mover leases */

/* CLOCK_BOOTTIME: like CLOCK_MONOTONIC, but it also counts time suspended, so a
 * lease taken before a suspend has expired after it (time.clock_gettime_ns(
 * time.CLOCK_BOOTTIME) in Python). */
static uint64_t boottime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint32_t kv_lease_add(kv_core *c, uint64_t until_ns, uint32_t *lease_id) {
    pthread_mutex_lock(&c->lock);
    uint32_t st = c->closed ? KV_LLM_ENGINE_FINALIZED : KV_LLM_SUCCESS;
    if (st == KV_LLM_SUCCESS && c->nleases >= c->lease_cap) {
        size_t cap = c->lease_cap ? c->lease_cap * 2 : 64;
        uint64_t *n = cap <= UINT32_MAX ? realloc(c->lease_until, cap * sizeof *n) : NULL;
        if (n) {
            c->lease_until = n;
            c->lease_cap = cap;
        } else {
            st = KV_LLM_OUT_OF_MEMORY;
        }
    }
    if (st == KV_LLM_SUCCESS) {
        if (c->nleases == 0)
            c->lease_until[c->nleases++] = 0; /* id 0: no lease */
        *lease_id = (uint32_t)c->nleases;
        c->lease_until[c->nleases++] = until_ns;
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

uint32_t kv_lease_renew(kv_core *c, uint32_t id, uint64_t until_ns) {
    pthread_mutex_lock(&c->lock);
    uint32_t st = KV_LLM_PARAM_INVALID;
    if (id && id < c->nleases && c->lease_until[id]) {
        c->lease_until[id] = until_ns ? until_ns : 1; /* (0 would read as removed) */
        st = KV_LLM_SUCCESS;
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

uint32_t kv_lease_remove(kv_core *c, uint32_t id) {
    pthread_mutex_lock(&c->lock);
    uint32_t st = KV_LLM_PARAM_INVALID;
    if (id && id < c->nleases && c->lease_until[id]) {
        c->lease_until[id] = 0;
        st = KV_LLM_SUCCESS;
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

int kv_lease_busy(kv_core *c, uint32_t id) {
    int n = 0;
    pthread_mutex_lock(&c->lock);
    for (int i = 0; id && i < c->nmovers; i++) {
        const kv_mover *mv = &c->movers[i];
        n += mv->running && ((mv->job && mv->job->lease == id) || (mv->job2 && mv->job2->lease == id));
    }
    pthread_mutex_unlock(&c->lock);
    return n;
}

/* May a job under lease `id` move another chunk? Caller holds c->lock. */
static int lease_ok(kv_core *c, uint32_t id) { return id == 0 || c->lease_until[id] > boottime_ns(); }

/* ---------------------------------------------------------------- copying */

static uint32_t status_from_errno(int e) {
    switch (e) {
    case ESRCH:
        return KV_LLM_LINK_FAILED; /* the peer process is gone */
    case ENOMEM:
        return KV_LLM_OUT_OF_MEMORY;
    default:
        return KV_LLM_FAILED;
    }
}

/* Has the process behind `pidfd` exited? (Then its pid may already name
 * another process.) */
static int process_gone(int pidfd) {
    struct pollfd p = {pidfd, POLLIN, 0};
    int r;
    do
        r = poll(&p, 1, 0);
    while (r < 0 && errno == EINTR);
    return r != 0; /* exited (POLLIN), or the pidfd is unusable: either way, no CMA through that pid */
}

#define KV_MOVER_POLL_NS 100000ull /* a mover polls the queue this long after its last chunk */
#define KV_CLOSE_MOVER_NS 2000000000ull /* kv_core_close waits this long for movers to return */
#define KV_BOUNCE_BYTES (1u << 20) /* a mover's CMA pull buffer: one process_vm_readv at most */
#define KV_CMA_IOV 256 /* rows one process_vm_{read,write}v call moves at most */

/* Streaming (non-temporal) stores for the movers' local copies of large jobs
 * (AVX2, checked at run time): the destination is a cache another process
 * reads later, not this thread, so writing around the cache leaves it to the
 * source's reads. On this VM's EPYC: contiguous 256 MiB pushes about 1.3x
 * faster, paged (random 32 KiB blocks) about 1.05x (docs/benchmarks.md, issue
 * 12). Runs below KV_STREAM_MIN_RUN (unless they are whole, aligned cache lines
 * of at least KV_STREAM_MIN_LINES) and jobs below KV_STREAM_MIN_JOB (and inline
 * copies) use memmove, as do overlapping runs. Build with
 * -DKV_STREAM_MIN_JOB=UINT64_MAX to turn it off. */
#ifndef KV_STREAM_MIN_JOB
#define KV_STREAM_MIN_JOB (8ull << 20)
#endif
#define KV_STREAM_MIN_RUN 4096u
#define KV_STREAM_MIN_LINES 256u /* a run of whole, aligned cache lines from this size on */
/* Streamed copies read this far ahead in software, across the end of a run
 * into the next one (the next row, or the next segment): a paged job's runs
 * start at scattered blocks, where the hardware prefetcher would learn each
 * block's stream anew and the first misses of every block wait in full.
 * Within a run only the first two lines of each 4 KiB page are prefetched
 * (the hardware prefetcher follows a stream inside a page, not across one);
 * rows of a 2-D segment are prefetched whole, into L2. Every line into L1
 * made the Intel Xeon VM's paged pushes 5-15% slower (inferred: the misses
 * it starts hold fill buffers the streaming stores need): docs/benchmarks.md,
 * "Prefetching less". */
#define KV_PREFETCH_AHEAD 4096u

/* Stream this run? Long runs always; shorter ones (a head range's rows, 1 KiB
 * for 4 of 8 heads of 128 fp16) when they are whole cache lines, so no line is
 * written partly around the cache (that would cost a read of the line). */
static inline int stream_run(uint64_t dst, uint64_t t) {
    return t >= KV_STREAM_MIN_RUN || (t >= KV_STREAM_MIN_LINES && ((dst | t) & 63) == 0);
}

#ifdef KV_HAVE_STREAM
static pthread_once_t g_stream_once = PTHREAD_ONCE_INIT;
static int g_stream_ok; /* AVX2 on this CPU */

static void stream_probe(void) {
    __builtin_cpu_init();
    g_stream_ok = __builtin_cpu_supports("avx2") ? 1 : 0;
}

static int stream_available(void) {
    pthread_once(&g_stream_once, stream_probe);
    return g_stream_ok;
}

/* 128 bytes from s to d, d 32-byte aligned, around the cache. */
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

/* p is in the first 128 bytes of a 4 KiB page (a 128-byte step lands there once a page) */
static inline int page_start(const uint8_t *p) { return ((uintptr_t)p & 4095) < 128; }

/* n bytes from s to d with 32-byte aligned streaming stores (the ragged ends
 * with memcpy), reading KV_PREFETCH_AHEAD bytes ahead: in this run the start
 * of each page, then in the next run (`next_len` bytes at `next`; 0 for none),
 * every line. A prefetch never faults. The caller
 * fences (sfence) before anyone is told. */
__attribute__((target("avx2"))) static void copy_stream(uint8_t *d, const uint8_t *s, size_t n, const uint8_t *next, size_t next_len) {
    size_t head = (32 - ((uintptr_t)d & 31)) & 31;
    if (head) {
        if (head > n)
            head = n;
        memcpy(d, s, head);
        d += head;
        s += head;
        n -= head;
    }
    for (; n >= 128 + KV_PREFETCH_AHEAD; d += 128, s += 128, n -= 128) {
        if (page_start(s + KV_PREFETCH_AHEAD)) {
            _mm_prefetch((const char *)s + KV_PREFETCH_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)s + KV_PREFETCH_AHEAD + 64, _MM_HINT_T0);
        }
        stream_128(d, s);
    }
    for (; n >= 128; d += 128, s += 128, n -= 128) {
        /* the ahead point: still in this run (a page's start), or (near its end)
         * in the next (not past the next run's end: a short row's neighbour is not read) */
        const uint8_t *ahead = s + KV_PREFETCH_AHEAD;
        const char *p = n > KV_PREFETCH_AHEAD ? (page_start(ahead) ? (const char *)ahead : NULL)
                        : KV_PREFETCH_AHEAD - n < next_len ? (const char *)next + (KV_PREFETCH_AHEAD - n) : NULL;
        if (p) {
            _mm_prefetch(p, _MM_HINT_T0);
            _mm_prefetch(p + 64, _MM_HINT_T0);
        }
        stream_128(d, s);
    }
    for (; n >= 32; d += 32, s += 32, n -= 32)
        _mm256_stream_si256((__m256i *)(void *)d, _mm256_loadu_si256((const __m256i *)(const void *)s));
    if (n)
        memcpy(d, s, n);
}

/* May `rows` whole rows of segment `s`, from `src` to `dst`, go through copy_rows_stream
 * (or copy_rows_pair): short rows of whole cache lines to 64-byte aligned destination
 * rows, the source and destination rows apart. */
static inline int rows_streamable(const kv_segment *s, uint64_t src, uint64_t dst, uint64_t rows) {
    return rows >= 2 && s->len >= KV_STREAM_MIN_LINES && s->len < KV_STREAM_MIN_RUN &&
           ((dst | s->len | s->dst_stride) & 63) == 0 &&
           (dst >= src + (rows - 1) * s->src_stride + s->len || src >= dst + (rows - 1) * s->dst_stride + s->len);
}

/* Whole rows of a 2-D segment whose rows are short whole cache lines (a head
 * range's 1 KiB rows: `len` a multiple of 64, below KV_STREAM_MIN_RUN, every
 * destination row 64-byte aligned): one tight loop, not a copy_stream call per
 * row, reading the row KV_PREFETCH_AHEAD bytes ahead into L2 (near the end, the first
 * rows of the next segment: `next` rows of `next_len` bytes `next_stride`
 * apart; next_rows 0 for none). 1.2-1.3x copy_stream row by row in a C loop of
 * vLLM-shaped head-split blocks on this VM. The caller fences. */
__attribute__((target("avx2"))) static void copy_rows_stream(uint8_t *d, const uint8_t *s, size_t len, uint64_t ss,
                                                             uint64_t ds, uint64_t rows, const uint8_t *next,
                                                             size_t next_len, uint64_t next_stride, uint64_t next_rows) {
    uint64_t k = (KV_PREFETCH_AHEAD + len - 1) / len; /* rows ahead */
    for (uint64_t r = 0; r < rows; r++, d += ds, s += ss) {
        const uint8_t *p = NULL;
        size_t plen = len;
        if (r + k < rows) {
            p = s + k * ss;
        } else if (r + k - rows < next_rows) {
            p = next + (r + k - rows) * next_stride;
            plen = next_len < len ? next_len : len;
        }
        size_t o = 0;
        for (; o + 128 <= len; o += 128) {
            if (p && o < plen) {
                _mm_prefetch((const char *)p + o, _MM_HINT_T2);
                _mm_prefetch((const char *)p + o + 64, _MM_HINT_T2);
            }
            stream_128(d + o, s + o);
        }
        if (o < len) { /* the last 64 bytes */
            if (p && o < plen)
                _mm_prefetch((const char *)p + o, _MM_HINT_T2);
            _mm256_stream_si256((__m256i *)(void *)(d + o), _mm256_loadu_si256((const __m256i *)(const void *)(s + o)));
            _mm256_stream_si256((__m256i *)(void *)(d + o + 32),
                                _mm256_loadu_si256((const __m256i *)(const void *)(s + o + 32)));
        }
    }
}

/* The rows of two segments that take two parts of the same source rows (a
 * head-split pair, kv_core.c pairable: both `len`, whole cache lines, `ss` apart
 * in both sources), in one pass: row r of `s` to `d`, then row r of `t` to `e`.
 * Copied one job after the other, each source row was read from memory twice,
 * the hardware prefetcher bringing in the other part with the first
 * (benchmarks/paged_copy.c: 2 ranks in turn 14.3, paired 20.6 GB/s on an AMD
 * EPYC VM, whole blocks 20.6). The caller fences. */
__attribute__((target("avx2"))) static void copy_rows_pair(uint8_t *d, uint8_t *e, const uint8_t *s, const uint8_t *t,
                                                           size_t len, uint64_t ss, uint64_t ds, uint64_t es,
                                                           uint64_t rows) {
    uint64_t k = (KV_PREFETCH_AHEAD + 2 * len - 1) / (2 * len); /* rows ahead */
    for (uint64_t r = 0; r < rows; r++, d += ds, e += es, s += ss, t += ss) {
        int ahead = r + k < rows;
        size_t o = 0;
        for (; o + 128 <= len; o += 128) {
            if (ahead) {
                _mm_prefetch((const char *)s + k * ss + o, _MM_HINT_T2);
                _mm_prefetch((const char *)s + k * ss + o + 64, _MM_HINT_T2);
                _mm_prefetch((const char *)t + k * ss + o, _MM_HINT_T2);
                _mm_prefetch((const char *)t + k * ss + o + 64, _MM_HINT_T2);
            }
            stream_128(d + o, s + o);
            stream_128(e + o, t + o);
        }
        if (o < len) { /* the last 64 bytes of each */
            _mm256_stream_si256((__m256i *)(void *)(d + o), _mm256_loadu_si256((const __m256i *)(const void *)(s + o)));
            _mm256_stream_si256((__m256i *)(void *)(d + o + 32),
                                _mm256_loadu_si256((const __m256i *)(const void *)(s + o + 32)));
            _mm256_stream_si256((__m256i *)(void *)(e + o), _mm256_loadu_si256((const __m256i *)(const void *)(t + o)));
            _mm256_stream_si256((__m256i *)(void *)(e + o + 32),
                                _mm256_loadu_si256((const __m256i *)(const void *)(t + o + 32)));
        }
    }
}

static void stream_fence(void) { _mm_sfence(); }
#else
static int stream_available(void) { return 0; }
static void copy_stream(uint8_t *d, const uint8_t *s, size_t n, const uint8_t *next, size_t next_len) {
    (void)next;
    (void)next_len;
    memcpy(d, s, n);
}
static void stream_fence(void) {}
#endif

/* Copy `n` bytes from byte `off` (row order) of segment `s`. `stream`: with
 * streaming stores where a run is long enough (the caller fences); `next`: the
 * segment copied after this one (for the read-ahead), or NULL. No locks held. */
static uint32_t cma_pull(kv_mover *mv, const kv_segment *s, uint64_t off, uint64_t n);

/* One process_vm_writev (`to_peer`) or process_vm_readv with the process of `s`, once
 * its pidfd says it is still there, again on EINTR: the bytes moved (> 0), or -1 with
 * the status in *st (LINK_FAILED: gone; an errno's; FAILED: nothing moved). */
static ssize_t cma_call(const kv_segment *s, int to_peer, const struct iovec *local, size_t nlocal,
                        const struct iovec *remote, size_t nremote, uint32_t *st) {
    for (;;) {
        if (s->pidfd >= 0 && process_gone(s->pidfd)) {
            *st = KV_LLM_LINK_FAILED;
            return -1;
        }
        ssize_t r = to_peer ? process_vm_writev(s->pid, local, nlocal, remote, nremote, 0)
                            : process_vm_readv(s->pid, local, nlocal, remote, nremote, 0);
        if (r > 0)
            return r;
        if (r < 0 && errno == EINTR)
            continue;
        *st = r < 0 ? status_from_errno(errno) : KV_LLM_FAILED;
        return -1;
    }
}

static uint32_t copy_chunk(const kv_segment *s, uint64_t off, uint64_t n, int stream, const kv_segment *next,
                           kv_mover *mv) {
    uint64_t src, dst, t;
    if (s->src_kind == KV_REGION_LOCAL && s->dst_kind == KV_REGION_LOCAL) {
        /* row by row from the run at `off` on (one division, not one per row:
         * a head range's rows are 1 KiB) */
        uint64_t next_src = next && next->src_kind == KV_REGION_LOCAL ? next->src : 0;
        size_t next_len = next_src ? (size_t)next->len : 0;
        t = kv_seg_run(s, off, n, &src, &dst);
        for (;;) {
#ifdef KV_HAVE_STREAM
            /* whole rows of short whole lines from here on: one tight loop */
            uint64_t wr = t == s->len ? n / s->len : 0;
            if (stream && rows_streamable(s, src, dst, wr)) {
                copy_rows_stream((uint8_t *)(uintptr_t)dst, (const uint8_t *)(uintptr_t)src, (size_t)s->len,
                                 s->src_stride, s->dst_stride, wr, (const uint8_t *)(uintptr_t)next_src, next_len,
                                 next_src ? next->src_stride : 0, next_src ? next->rows : 0);
                if (!(n -= wr * s->len))
                    return KV_LLM_SUCCESS;
                src += wr * s->src_stride;
                dst += wr * s->dst_stride;
                t = n; /* less than a row */
            }
#endif
            /* the next row's start (if this run ends its row and more is left) */
            uint64_t nsrc = src + t + s->src_stride - s->len, ndst = dst + t + s->dst_stride - s->len;
            if (stream && stream_run(dst, t) && (dst >= src + t || src >= dst + t))
                copy_stream((uint8_t *)(uintptr_t)dst, (const uint8_t *)(uintptr_t)src, (size_t)t,
                            (const uint8_t *)(uintptr_t)(n > t ? nsrc : next_src), n > t ? (size_t)s->len : next_len);
            else /* regions may be one and the same */
                memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)t);
            if (!(n -= t))
                return KV_LLM_SUCCESS;
            src = nsrc;
            dst = ndst;
            t = n < s->len ? n : s->len;
        }
    }
    /* CMA: one call for up to KV_CMA_IOV rows (local and remote iovecs pair up) */
    struct iovec local[KV_CMA_IOV], remote[KV_CMA_IOV];
    int to_peer = s->dst_kind == KV_REGION_PROCESS;
    if (!to_peer && mv)
        return cma_pull(mv, s, off, n);
    while (n) {
        size_t cnt = 0;
        for (uint64_t o = off, left = n; left && cnt < KV_CMA_IOV; cnt++, o += t, left -= t) {
            t = kv_seg_run(s, o, left, &src, &dst);
            local[cnt].iov_base = (void *)(uintptr_t)(to_peer ? src : dst);
            remote[cnt].iov_base = (void *)(uintptr_t)(to_peer ? dst : src);
            local[cnt].iov_len = remote[cnt].iov_len = (size_t)t;
        }
        uint32_t st;
        ssize_t r = cma_call(s, to_peer, local, cnt, remote, cnt, &st);
        if (r < 0)
            return st;
        off += (uint64_t)r;
        n -= (uint64_t)r;
    }
    return KV_LLM_SUCCESS;
}

/* `n` bytes from byte `off` of segment `first` on of the jobs of a head-split pair
 * (pairable: the same shapes, so the same bytes of both), whole rows in one pass
 * over their source rows where they can be streamed, the rest one job after the
 * other. Local copies: they cannot fail. No locks held; the caller fences. */
static void copy_pair(const kv_job *a, const kv_job *b, size_t first, uint64_t off, uint64_t n, int stream) {
    for (size_t i = first; n; i++, off = 0) {
        const kv_segment *s = &a->segments[i], *t = &b->segments[i];
        uint64_t take = kv_seg_bytes(s) - off;
        if (take > n)
            take = n;
#ifdef KV_HAVE_STREAM
        uint64_t r0 = off / s->len, rows = take / s->len;
        uint64_t sd = s->dst + r0 * s->dst_stride, td = t->dst + r0 * t->dst_stride;
        uint64_t ss = s->src + r0 * s->src_stride, ts = t->src + r0 * s->src_stride;
        if (stream && off % s->len == 0 && take % s->len == 0 && rows_streamable(s, ss, sd, rows) &&
            rows_streamable(t, ts, td, rows)) {
            copy_rows_pair((uint8_t *)(uintptr_t)sd, (uint8_t *)(uintptr_t)td, (const uint8_t *)(uintptr_t)ss,
                           (const uint8_t *)(uintptr_t)ts, (size_t)s->len, s->src_stride, s->dst_stride,
                           t->dst_stride, rows);
        } else
#endif
        {
            copy_chunk(s, off, take, stream, i + 1 < a->nsegments ? s + 1 : NULL, NULL);
            copy_chunk(t, off, take, stream, i + 1 < b->nsegments ? t + 1 : NULL, NULL);
        }
        n -= take;
    }
}

/* Spin (pausing) until the atomic `*counter` differs from `seen`: 1; or 0 once
 * CLOCK_BOOTTIME reaches `end_ns` or after `max_spins` pauses. */
static int spin_until_changed(const uint64_t *counter, uint64_t seen, uint64_t end_ns, unsigned max_spins) {
    for (unsigned k = 0; k < max_spins; k++) {
        if (__atomic_load_n(counter, __ATOMIC_ACQUIRE) != seen)
            return 1;
        if ((k & 63) == 63 && boottime_ns() >= end_ns)
            return 0;
#ifdef KV_HAVE_STREAM
        _mm_pause();
#endif
    }
    return 0;
}

/* A CMA pull's chunk through the mover's bounce buffer: process_vm_readv into it,
 * then, unless the mover was retired meanwhile (kv_core_reap: the peer held the read
 * past the bound, and the job was completed for the caller), a memcpy into place.
 * So a read the peer holds never writes our memory after the pull's status; what it
 * costs is one more copy of every CMA pull byte, from a buffer the read left in cache. */
static uint32_t cma_pull(kv_mover *mv, const kv_segment *s, uint64_t off, uint64_t n) {
    kv_core *c = mv->core;
    if (!mv->bounce && !(mv->bounce = malloc(KV_BOUNCE_BYTES)))
        return KV_LLM_OUT_OF_MEMORY;
    struct iovec remote[KV_CMA_IOV];
    uint64_t to[KV_CMA_IOV], src, dst, t;
    while (n) {
        size_t cnt = 0;
        uint64_t got = 0;
        for (uint64_t o = off, left = n; left && cnt < KV_CMA_IOV && got < KV_BOUNCE_BYTES; cnt++) {
            t = kv_seg_run(s, o, left < KV_BOUNCE_BYTES - got ? left : KV_BOUNCE_BYTES - got, &src, &dst);
            remote[cnt].iov_base = (void *)(uintptr_t)src;
            remote[cnt].iov_len = (size_t)t;
            to[cnt] = dst;
            got += t;
            o += t;
            left -= t;
        }
        struct iovec lo = {mv->bounce, (size_t)got};
        uint32_t st;
        ssize_t r = cma_call(s, 0, &lo, 1, remote, cnt, &st);
        if (r < 0)
            return st;
        pthread_mutex_lock(&c->lock);
        int ok = !mv->retired;
        mv->landing = ok;
        pthread_mutex_unlock(&c->lock);
        if (!ok)
            return KV_LLM_LINK_FAILED; /* completed for the caller already: nothing lands */
        uint64_t at = 0;
        for (size_t i = 0; i < cnt && at < (uint64_t)r; i++) {
            uint64_t k = remote[i].iov_len < (uint64_t)r - at ? remote[i].iov_len : (uint64_t)r - at;
            memcpy((void *)(uintptr_t)to[i], mv->bounce + at, (size_t)k);
            at += k;
        }
        pthread_mutex_lock(&c->lock);
        mv->landing = 0;
        pthread_mutex_unlock(&c->lock);
        off += (uint64_t)r;
        n -= (uint64_t)r;
    }
    return KV_LLM_SUCCESS;
}

/* ------------------------------------------------------------------- jobs */

static unsigned id_bucket(uint64_t id) {
    return (unsigned)((id * 0x9E3779B97F4A7C15ull) >> 52) & (KV_HASH_BUCKETS - 1);
}

void kv__job_hash(kv_core *c, kv_job *j) {
    unsigned b = id_bucket(j->record.id);
    j->hash_next = c->jobs_by_id[b];
    c->jobs_by_id[b] = j;
}

kv_job *kv__job_find(kv_core *c, uint64_t id) {
    for (kv_job *j = c->jobs_by_id[id_bucket(id)]; j; j = j->hash_next)
        if (j->record.id == id)
            return j;
    return NULL;
}

static void job_unhash(kv_core *c, kv_job *j) {
    kv_job **p = &c->jobs_by_id[id_bucket(j->record.id)];
    while (*p != j)
        p = &(*p)->hash_next;
    *p = j->hash_next;
}

int kv__queue_remove(kv_job **head, kv_job **tail, kv_job *j) {
    if (!j->queued)
        return 0;
    if (j->queue_prev)
        j->queue_prev->queue_next = j->queue_next;
    else
        *head = j->queue_next;
    if (j->queue_next)
        j->queue_next->queue_prev = j->queue_prev;
    else
        *tail = j->queue_prev;
    j->queue_next = j->queue_prev = NULL;
    j->queued = 0;
    return 1;
}

void kv__rank_insert(kv_job **head, kv_job **tail, kv_job *j) {
    kv_job *after = *tail;
    while (after && after->rank > j->rank)
        after = after->queue_prev;
    j->queue_prev = after;
    j->queue_next = after ? after->queue_next : *head;
    if (j->queue_next)
        j->queue_next->queue_prev = j;
    else
        *tail = j;
    if (after)
        after->queue_next = j;
    else
        *head = j;
    j->queued = 1;
}

/* Drop the first `nrefs` region refs of `j` and free its segments. Returns 1
 * if the eventfd must be signalled (a notifying region was released). */
static int job_release_refs(kv_core *c, kv_job *j, size_t nrefs) {
    int sig = 0;
    for (size_t i = 0; i < nrefs; i++)
        sig |= region_unref_sig(c, j->region_refs[i]);
    free(j->region_refs);
    free(j->segments);
    j->region_refs = NULL;
    j->segments = NULL;
    return sig;
}

void kv__signal_loop(kv_core *c) {
    uint64_t one = 1;
    ssize_t r;
    do
        r = write(c->event_fd, &one, sizeof one);
    while (r < 0 && errno == EINTR);
    /* EAGAIN means the counter is saturated: the loop is already woken. */
}

/* Append a finished job or an event to the completion list (no allocation: a
 * completion cannot be lost). Returns 1 if the eventfd must be signalled. */
static int post_record(kv_core *c, kv_record *r) {
    __atomic_add_fetch(&c->posted, 1, __ATOMIC_RELEASE); /* kv_core_wait_take spins on it */
    r->done_next = NULL;
    int was_empty = c->done_head == NULL;
    if (c->done_tail)
        c->done_tail->done_next = r;
    else
        c->done_head = r;
    c->done_tail = r;
    uint64_t take = __atomic_load_n(&c->take_job, __ATOMIC_RELAXED);
    if (was_empty && take && r->id == take && r->kind != KV_RECORD_EVENT && r->kind != KV_RECORD_ABANDONED)
        return 0; /* its waiter takes it (kv_core_wait_take), or signals when it gives up */
    if (was_empty)
        c->stats.wakeups++; /* the reader drains everything on one wake-up */
    return was_empty;
}

int kv__post_event(kv_core *c, kv_event *ev) { return post_record(c, &ev->record); }

int kv__job_complete(kv_core *c, kv_job *j, uint32_t status) {
    if (j->record.status == KV_LLM_SUCCESS)
        j->record.status = status;
    job_unhash(c, j);
    int sig = job_release_refs(c, j, j->nsegments * 2);
    c->stats.jobs_live--;
    c->stats.jobs_completed++;
    return post_record(c, &j->record) | sig;
}

/* ------------------------------------------------------------------ movers */

static void mover_queue_remove(kv_core *c, kv_mover_job *m) { kv__queue_remove(&c->mover_queue_head, &c->mover_queue_tail, &m->job); }

/* If nothing more will be copied for `m`, complete it.
 * Caller holds the lock. Returns 1 if the eventfd must be signalled. */
static int mover_job_maybe_finish(kv_core *c, kv_mover_job *m) {
    if (m->job.state != KV_JS_DRAINING || m->chunks_active)
        return 0;
    m->job.state = KV_JS_DONE;
    return kv__job_complete(c, &m->job, KV_LLM_SUCCESS);
}

/* A mover job stops handing out chunks (all claimed, failed or aborted). */
static void mover_job_drain(kv_core *c, kv_mover_job *m) {
    assert(m->job.state == KV_JS_QUEUED || m->job.state == KV_JS_DRAINING);
    m->job.state = KV_JS_DRAINING;
    mover_queue_remove(c, m);
}

/* A mover job fails (or is aborted) with `status`, unless it failed already: no
 * more chunks; it completes once the chunks in progress end. */
static void mover_job_fail(kv_core *c, kv_mover_job *m, uint32_t status) {
    if (m->job.record.status == KV_LLM_SUCCESS)
        m->job.record.status = status;
    mover_job_drain(c, m);
}

/* A mover's step ended: complete `m` if nothing more will be copied for it,
 * signalling the loop outside the lock. Caller holds the lock. */
static void mover_maybe_finish(kv_core *c, kv_mover_job *m) {
    if (mover_job_maybe_finish(c, m)) {
        pthread_mutex_unlock(&c->lock);
        kv__signal_loop(c);
        pthread_mutex_lock(&c->lock);
    }
}

/* Claim up to `max` (> 0) bytes of `m` from its claim point on, across segments (a
 * paged job's segments are often a block each: one claim per segment would take the
 * lock, and hand the job between movers, per block); all claimed, it leaves the
 * queue. Returns the bytes; *first, *off: where they start. Caller holds the lock. */
static uint64_t claim(kv_core *c, kv_mover_job *m, uint64_t max, size_t *first, uint64_t *off) {
    kv_job *j = &m->job;
    uint64_t n = 0;
    *first = j->claim_segment;
    *off = j->claim_offset;
    while (n < max) {
        const kv_segment *s = &j->segments[j->claim_segment];
        uint64_t take = kv_seg_bytes(s) - j->claim_offset;
        if (take > max - n)
            take = max - n;
        n += take;
        j->claim_offset += take;
        if (j->claim_offset < kv_seg_bytes(s))
            break;
        j->claim_offset = 0;
        if (++j->claim_segment == j->nsegments) {
            mover_job_drain(c, m);
            break;
        }
    }
    m->claimed += n;
    m->chunks_active++;
    return n;
}

/* A pair's second job may rank this much after the first (kvengine/scheduler.py rank(): the
 * same priority, deadlines at most 100 ms apart, as two pushes submitted together with one
 * timeout, the planning of the first between them): the first then shares the movers with
 * the second only where its deadline is not the more urgent by much. */
#define KV_PAIR_RANK_SLACK 100000u

/* Are `a` and `b` a head-split pair: one job's segments, one for one, the same rows
 * of the same source rows as the other's, a fixed distance apart within each row (a
 * TP=1 prefill's pushes of one block table to two TP=2 ranks, heads [0, h/2) and
 * [h/2, h)), short rows of whole cache lines, local memory, large enough to be
 * streamed? The movers then copy both in one pass (copy_pair). */
static int pairable(const kv_job *a, const kv_job *b) {
    if (a->nsegments != b->nsegments || a->total_bytes != b->total_bytes || a->total_bytes < KV_STREAM_MIN_JOB ||
        b->rank < a->rank || b->rank - a->rank > KV_PAIR_RANK_SLACK)
        return 0;
    uint64_t d = b->segments[0].src - a->segments[0].src;
    for (size_t i = 0; i < a->nsegments; i++) {
        const kv_segment *s = &a->segments[i], *t = &b->segments[i];
        if (s->src_kind != KV_REGION_LOCAL || s->dst_kind != KV_REGION_LOCAL || t->src_kind != KV_REGION_LOCAL ||
            t->dst_kind != KV_REGION_LOCAL || s->rows < 2 || t->rows != s->rows || t->len != s->len ||
            t->src_stride != s->src_stride || s->len < KV_STREAM_MIN_LINES || s->len >= KV_STREAM_MIN_RUN ||
            (s->len & 63) || t->src - s->src != d)
            return 0;
    }
    uint64_t ad = d >> 63 ? -d : d, len = a->segments[0].len;
    return ad >= len && ad <= a->segments[0].src_stride - len; /* apart, within a row's stride */
}

/* The second job of the head job's head-split pair, if it is right behind it. Caller holds the lock. */
static kv_mover_job *pair_of(const kv_mover_job *m) {
    kv_mover_job *b = (kv_mover_job *)m->job.queue_next;
    return b && b->paired && b->pair_id == m->job.record.id ? b : NULL;
}

/* The movers' queue holds mover jobs only: the head job's next chunk is claimed. */
static void *mover_main(void *arg) {
    kv_mover *mv = arg;
    kv_core *c = mv->core;
    pthread_mutex_lock(&c->lock);
    for (;;) {
        kv_mover_job *m = (kv_mover_job *)c->mover_queue_head;
        if (c->stopping || mv->retired)
            break;
        if (!m) {
            /* a mover that just copied polls a moment before it sleeps: the next small
             * job (a layer's CMA copy, which the loop waits for: kv_core_wait_take)
             * then starts without a wake-up */
            uint64_t t0 = mv->busy_ns ? boottime_ns() : 0;
            if (t0 && t0 - mv->busy_ns < KV_MOVER_POLL_NS) {
                uint64_t queued = c->mover_queued;
                c->movers_polling++;
                pthread_mutex_unlock(&c->lock);
                spin_until_changed(&c->mover_queued, queued, t0 + KV_MOVER_POLL_NS, 4096);
                pthread_mutex_lock(&c->lock);
                c->movers_polling--;
                mv->busy_ns = 0; /* one poll per burst of work */
                continue;
            }
            pthread_cond_wait(&c->work_ready, &c->lock);
            continue;
        }
        kv_job *j = &m->job;
        if (!lease_ok(c, m->lease)) { /* its peer may have stopped answering: no more chunks */
            mover_job_fail(c, m, KV_LLM_LINK_FAILED);
            mover_maybe_finish(c, m);
            continue;
        }
        /* a head-split pair: the same chunk of both, in one pass; the second job, queued
         * after the movers began the first, first catches up alone */
        uint64_t max = c->chunk_bytes;
        kv_mover_job *m2 = pair_of(m);
        if (m2 && !lease_ok(c, m2->lease)) {
            mover_job_fail(c, m2, KV_LLM_LINK_FAILED);
            mover_maybe_finish(c, m2);
            continue;
        }
        if (m2 && m2->claimed < m->claimed) {
            if (m->claimed - m2->claimed < max)
                max = m->claimed - m2->claimed;
            m = m2;
            j = &m->job;
            m2 = NULL;
        } else if (m2 && m2->claimed > m->claimed) {
            m2 = NULL;
        } else if (m2) {
            max /= 2; /* as many bytes copied between two abort checks as alone */
        }
        size_t first, first2;
        uint64_t off, off2, n = claim(c, m, max, &first, &off);
        if (m2) { /* the same shapes, as much claimed: the same bytes of it */
            uint64_t n2 = claim(c, m2, n, &first2, &off2);
            assert(n2 == n && first2 == first && off2 == off);
            (void)n2;
        }
        c->stats.chunks_paired += m2 != NULL;
        mv->job = m;
        mv->job2 = m2;
        mv->since_ns = boottime_ns();
        pthread_mutex_unlock(&c->lock);

        uint32_t st = KV_LLM_SUCCESS;
        uint64_t done = 0, o = off;
        int stream = j->total_bytes >= KV_STREAM_MIN_JOB && stream_available();
        if (m2) {
            copy_pair(j, &m2->job, first, off, n, stream);
            done = n;
        }
        for (size_t i = first; !m2 && done < n; i++, o = 0) {
            uint64_t take = kv_seg_bytes(&j->segments[i]) - o;
            if (take > n - done)
                take = n - done;
            st = copy_chunk(&j->segments[i], o, take, stream, i + 1 < j->nsegments ? &j->segments[i + 1] : NULL, mv);
            if (st != KV_LLM_SUCCESS)
                break;
            done += take;
        }
        if (stream)
            stream_fence(); /* the chunk's streamed bytes are visible before it is counted done */

        pthread_mutex_lock(&c->lock);
        mv->job = mv->job2 = NULL;
        mv->busy_ns = boottime_ns();
        m->chunks_active--;
        c->stats.bytes_moved += done;
        j->bytes_done += done;
        if (st != KV_LLM_SUCCESS)
            mover_job_fail(c, m, st);
        mover_maybe_finish(c, m); /* (m2 cannot complete meanwhile: its chunk is still active) */
        if (m2) {
            m2->chunks_active--;
            c->stats.bytes_moved += done;
            m2->job.bytes_done += done;
            mover_maybe_finish(c, m2);
        }
    }
    if (mv->retired)
        c->stats.movers_stuck--;
    free(mv->bounce);
    mv->bounce = NULL;
    mv->running = 0;
    pthread_cond_broadcast(&c->mover_exit);
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

/* Movers whose thread has not returned yet, retired ones too. Caller holds the lock. */
static int movers_running(const kv_core *c) {
    int n = 0;
    for (int i = 0; i < c->nmovers; i++)
        n += c->movers[i].running;
    return n;
}

/* Start the mover of slot `i` (c->nmovers must be i). Movers take no signals:
 * Python handles them on the main thread. Returns 0, or -1 if no thread. */
static int mover_start(kv_core *c, int i) {
    kv_mover *mv = &c->movers[i];
    memset(mv, 0, sizeof *mv);
    mv->core = c;
    mv->running = 1;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int r = pthread_create(&mv->thread, NULL, mover_main, mv);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (r != 0) {
        mv->running = 0;
        return -1;
    }
    char name[16]; /* what top -H and py-spy show (15 characters at most) */
    snprintf(name, sizeof name, "kv-mover-%u", (unsigned)(unsigned char)i); /* i < KV_MAX_MOVERS */
    pthread_setname_np(mv->thread, name);
    c->nmovers++;
    return 0;
}

size_t kv_core_reap(kv_core *c, uint64_t bound_ns, uint64_t *ids, size_t max) {
    size_t n = 0;
    int sig = 0;
    pthread_mutex_lock(&c->lock);
    uint64_t now = boottime_ns();
    int slots = c->nmovers;
    for (int i = 0; i < slots && !c->stopping; i++) {
        kv_mover *mv = &c->movers[i];
        if (mv->retired || !mv->job || mv->landing || now - mv->since_ns < bound_ns)
            continue;
        kv_event *ev[2] = {NULL, NULL};
        kv_mover_job *ms[2] = {mv->job, mv->job2};
        int k, ok = 1;
        for (k = 0; k < 2; k++)
            if (ms[k] && !ms[k]->abandoned && !(ev[k] = malloc(sizeof *ev[k])))
                ok = 0;
        if (!ok) {
            free(ev[0]);
            free(ev[1]);
            continue; /* the next call tries again */
        }
        for (k = 0; k < 2; k++) {
            kv_mover_job *m = ms[k];
            if (!ev[k])
                continue;
            m->abandoned = 1;
            if (m->job.state == KV_JS_QUEUED)
                mover_job_fail(c, m, KV_LLM_LINK_FAILED); /* no more chunks of it */
            else if (m->job.record.status == KV_LLM_SUCCESS)
                m->job.record.status = KV_LLM_LINK_FAILED;
            ev[k]->record = (kv_record){.id = m->job.record.id, .kind = KV_RECORD_ABANDONED,
                                        .status = KV_LLM_LINK_FAILED};
            sig |= post_record(c, &ev[k]->record);
            c->stats.jobs_abandoned++;
            if (n < max)
                ids[n++] = m->job.record.id;
        }
        mv->retired = 1; /* it exits once its copy returns */
        pthread_detach(mv->thread);
        c->stats.movers_stuck++;
        if (c->nmovers < KV_MAX_MOVERS)
            mover_start(c, c->nmovers); /* keep the pool's size (no thread: one mover fewer) */
    }
    pthread_mutex_unlock(&c->lock);
    if (sig)
        kv__signal_loop(c);
    return n;
}

/* Regions the movers cannot reach: a transport carries their bytes. */
static int transport_kind(int kind) { return kind != KV_REGION_LOCAL && kind != KV_REGION_PROCESS; }

/* Do `rows` rows of `row` bytes, `stride` apart, from `off` fit in `rlen` bytes? Overflow-safe. */
static int rows_fit(uint64_t off, uint64_t row, uint64_t rows, uint64_t stride, uint64_t rlen) {
    if (row > rlen || off > rlen - row)
        return 0;
    return rows == 1 || rows - 1 <= (rlen - row - off) / stride; /* stride >= row >= 1 */
}

int kv_pieces_ok(const void *list, uint64_t n, uint64_t rlen, uint64_t len, uint64_t row, uint64_t stride,
                 uint64_t max_rows) {
    uint64_t sum = 0, nrows = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t p[2]; /* offset, len */
        memcpy(p, (const uint8_t *)list + i * sizeof p, sizeof p); /* a transport's buffer need not be aligned */
        uint64_t rl = row ? row : p[1], m = rl ? p[1] / rl : 0; /* 1-D: one row */
        if (p[1] == 0 || p[1] % rl || m > max_rows - nrows || p[1] > len - sum ||
            !rows_fit(p[0], rl, m, row ? stride : rl, rlen))
            return 0;
        sum += p[1];
        nrows += m;
    }
    return sum == len;
}

/* Resolve and bounds-check `segs` into `out`, taking region refs into `refs`.
 * Every segment has a local side; either every segment's other side is local
 * or a process (a mover job: *remote_kind = -1), or every one is a region of
 * one transport kind on one link (*remote_kind = that kind). Caller holds the
 * lock. On failure no ref is held. */
static uint32_t resolve_segments(kv_core *c, const uint64_t *segs, size_t nsegs, unsigned words, kv_segment *out,
                        uint32_t *refs, uint64_t *total, int *remote_kind) {
    uint64_t sum = 0;
    size_t i;
    uint32_t st = KV_LLM_SUCCESS;
    int32_t first_link = 0;
    for (i = 0; i < nsegs; i++) {
        const uint64_t *w = segs + i * words;
        uint64_t row = w[4], rows = 1, sstride = row, dstride = row;
        if (words == KV_SEG2_WORDS && w[5] != 1) {
            rows = w[5];
            sstride = w[6];
            dstride = w[7];
        }
        if (w[0] > UINT32_MAX || w[2] > UINT32_MAX) {
            st = KV_LLM_KV_CACHE_NOT_EXIST;
            break;
        }
        kv_region *sr = kv__region_get(c, (uint32_t)w[0]);
        kv_region *dr = kv__region_get(c, (uint32_t)w[2]);
        if (!sr || !dr || sr->removed || dr->removed) {
            st = KV_LLM_KV_CACHE_NOT_EXIST;
            break;
        }
        /* bounds: every byte of every row inside its region, without overflow;
         * rows do not overlap (stride >= row) */
        if (row == 0 || rows == 0 || (rows > 1 && (sstride < row || dstride < row)) ||
            !rows_fit(w[1], row, rows, sstride, sr->len) || !rows_fit(w[3], row, rows, dstride, dr->len)) {
            st = KV_LLM_PARAM_INVALID;
            break;
        }
        uint64_t len = row * rows; /* <= the region's length: rows_fit */
        if (sum + len < sum) {
            st = KV_LLM_PARAM_INVALID;
            break;
        }
        if (sr->kind != KV_REGION_LOCAL && dr->kind != KV_REGION_LOCAL) {
            st = KV_LLM_PARAM_INVALID; /* one side must be this process's memory */
            break;
        }
        const kv_region *remote = transport_kind(sr->kind) ? sr : transport_kind(dr->kind) ? dr : NULL;
        int kind = remote ? remote->kind : -1;
        if ((i > 0 && kind != *remote_kind) || (remote && i > 0 && remote->pid != first_link)) {
            st = KV_LLM_PARAM_INVALID; /* one job, one way: all segments local or all on one link */
            break;
        }
        *remote_kind = kind;
        if (remote)
            first_link = remote->pid;
        out[i].src = transport_kind(sr->kind) ? w[1] : sr->addr + w[1];
        out[i].dst = transport_kind(dr->kind) ? w[3] : dr->addr + w[3];
        out[i].len = row;
        out[i].rows = rows;
        out[i].src_stride = sstride;
        out[i].dst_stride = dstride;
        out[i].src_kind = (int8_t)sr->kind;
        out[i].dst_kind = (int8_t)dr->kind;
        out[i].pid = sr->kind != KV_REGION_LOCAL ? sr->pid : dr->pid;
        const kv_region *pr = sr->kind == KV_REGION_PROCESS ? sr : dr->kind == KV_REGION_PROCESS ? dr : NULL;
        out[i].pidfd = pr && pr->pidref ? pr->pidref->fd : -1; /* lives while the job holds the region */
        out[i].remote_region = (uint32_t)(transport_kind(sr->kind) ? sr->addr : dr->addr);
        sr->refs++;
        dr->refs++;
        refs[2 * i] = (uint32_t)w[0];
        refs[2 * i + 1] = (uint32_t)w[2];
        sum += len;
    }
    if (st != KV_LLM_SUCCESS) {
        for (size_t k = 0; k < 2 * i; k++)
            kv__region_unref(c, refs[k]);
        return st;
    }
    *total = sum;
    return KV_LLM_SUCCESS;
}

uint32_t kv_core_submit(kv_core *c, uint64_t job_id, const uint64_t *segs, size_t nsegs,
                        uint64_t inline_max, int *done, uint64_t *nbytes) {
    return kv_core_submit_ranked(c, job_id, segs, nsegs, inline_max, 0, done, nbytes);
}

uint32_t kv_core_submit_ranked(kv_core *c, uint64_t job_id, const uint64_t *segs, size_t nsegs,
                               uint64_t inline_max, uint64_t rank, int *done, uint64_t *nbytes) {
    return kv_core_submit_leased(c, job_id, segs, nsegs, inline_max, rank, 0, done, nbytes);
}

/* Copy a job's segments on the calling thread. Called without the lock. */
static uint32_t copy_inline(const kv_segment *segs, size_t nsegs, uint64_t *nbytes) {
    uint32_t st = KV_LLM_SUCCESS;
    for (size_t i = 0; i < nsegs && st == KV_LLM_SUCCESS; i++) {
        st = copy_chunk(&segs[i], 0, kv_seg_bytes(&segs[i]), 0, NULL, NULL);
        if (st == KV_LLM_SUCCESS)
            *nbytes += kv_seg_bytes(&segs[i]);
    }
    return st;
}

/* The 2-D segments of a job for a transport that takes only 1-D ones: one
 * segment per row, with a pair of region refs each (row 0 keeps the original
 * pair). Replaces *rs and *refs; on failure (out of memory) leaves them as
 * they were. Caller holds the lock. */
static uint32_t expand_rows(kv_core *c, kv_segment **rs, uint32_t **refs, size_t *nsegs) {
    size_t n = 0;
    for (size_t i = 0; i < *nsegs; i++) {
        if ((*rs)[i].rows > SIZE_MAX / sizeof(kv_segment) / 2 - n)
            return KV_LLM_OUT_OF_MEMORY;
        n += (size_t)(*rs)[i].rows;
    }
    kv_segment *ns = malloc(n * sizeof *ns);
    uint32_t *nr = malloc(2 * n * sizeof *nr);
    if (!ns || !nr) {
        free(ns);
        free(nr);
        return KV_LLM_OUT_OF_MEMORY;
    }
    size_t k = 0;
    for (size_t i = 0; i < *nsegs; i++) {
        const kv_segment *s = &(*rs)[i];
        for (uint64_t r = 0; r < s->rows; r++, k++) {
            ns[k] = *s;
            ns[k].src = s->src + r * s->src_stride;
            ns[k].dst = s->dst + r * s->dst_stride;
            ns[k].rows = 1;
            ns[k].src_stride = ns[k].dst_stride = s->len;
            nr[2 * k] = (*refs)[2 * i];
            nr[2 * k + 1] = (*refs)[2 * i + 1];
            if (r > 0) {
                kv__region_ref(c, nr[2 * k]);
                kv__region_ref(c, nr[2 * k + 1]);
            }
        }
    }
    free(*rs);
    free(*refs);
    *rs = ns;
    *refs = nr;
    *nsegs = n;
    return KV_LLM_SUCCESS;
}

/* Must the 2-D segments of a job of `t` be expanded into rows? */
static int needs_rows(kv_transport *t, const kv_segment *rs, size_t nsegs, int remote_kind) {
    unsigned need = rs[0].dst_kind == remote_kind ? KV_T2D_PUSH : KV_T2D_PULL;
    if (t && ((t->ops->seg2d & need) || (need == KV_T2D_PULL && t->ops->pull_2d && t->ops->pull_2d(t, rs, nsegs))))
        return 0;
    for (size_t i = 0; i < nsegs; i++)
        if (rs[i].rows > 1)
            return 1;
    return 0;
}

uint32_t kv_core_submit_leased(kv_core *c, uint64_t job_id, const uint64_t *segs, size_t nsegs,
                               uint64_t inline_max, uint64_t rank, uint32_t lease, int *done, uint64_t *nbytes) {
    return kv_core_submit_job(c, job_id, segs, nsegs, KV_SEG_WORDS, inline_max, rank, lease, done, nbytes);
}

uint32_t kv_core_submit_job(kv_core *c, uint64_t job_id, const uint64_t *segs, size_t nsegs, unsigned words,
                            uint64_t inline_max, uint64_t rank, uint32_t lease, int *done, uint64_t *nbytes) {
    *done = 0;
    *nbytes = 0;
    if ((words != KV_SEG_WORDS && words != KV_SEG2_WORDS) || nsegs == 0 ||
        nsegs > SIZE_MAX / (2 * sizeof(uint32_t)) / KV_SEG2_WORDS || nsegs > SIZE_MAX / sizeof(kv_segment))
        return KV_LLM_PARAM_INVALID;
    kv_segment *rs = malloc(nsegs * sizeof *rs);
    uint32_t *refs = malloc(2 * nsegs * sizeof *refs);
    if (!rs || !refs) {
        free(rs);
        free(refs);
        return KV_LLM_OUT_OF_MEMORY;
    }
    uint64_t total = 0;
    int remote_kind = -1;
    pthread_mutex_lock(&c->lock);
    uint32_t st = c->closed ? KV_LLM_ENGINE_FINALIZED : KV_LLM_SUCCESS;
    if (st == KV_LLM_SUCCESS && (kv__job_find(c, job_id) || (job_id & KV_EVENT) || lease >= c->nleases + !lease))
        st = KV_LLM_PARAM_INVALID; /* job ids are unique among live jobs, below 2**63; a lease must exist */
    if (st == KV_LLM_SUCCESS)
        st = resolve_segments(c, segs, nsegs, words, rs, refs, &total, &remote_kind);
    if (st == KV_LLM_SUCCESS && remote_kind >= 0 && words == KV_SEG2_WORDS &&
        needs_rows(c->transports[remote_kind], rs, nsegs, remote_kind)) {
        st = expand_rows(c, &rs, &refs, &nsegs);
        if (st != KV_LLM_SUCCESS) {
            kv_job tmp = {.segments = rs, .region_refs = refs};
            int sig = job_release_refs(c, &tmp, 2 * nsegs); /* frees rs and refs */
            pthread_mutex_unlock(&c->lock);
            if (sig)
                kv__signal_loop(c);
            return st;
        }
    }
    if (st != KV_LLM_SUCCESS) {
        pthread_mutex_unlock(&c->lock);
        free(rs);
        free(refs);
        return st;
    }
    /* the common part; copied into the kind's struct once one is needed */
    kv_job fields = {.record = {.id = job_id}, .segments = rs, .nsegments = nsegs, .region_refs = refs,
                     .total_bytes = total, .rank = rank};
    if (remote_kind >= 0) {
        kv_transport *t = c->transports[remote_kind];
        kv_job *j = t ? calloc(1, t->ops->job_size) : NULL;
        st = !t ? KV_LLM_LINK_FAILED : !j ? KV_LLM_OUT_OF_MEMORY : KV_LLM_SUCCESS;
        if (st == KV_LLM_SUCCESS) {
            *j = fields;
            j->record.kind = KV_RECORD_TRANSPORT_JOB;
            j->transport = t;
            st = t->ops->submit(t, j); /* hashes and starts it, or fails */
        }
        if (st != KV_LLM_SUCCESS) {
            int sig = job_release_refs(c, &fields, 2 * nsegs);
            pthread_mutex_unlock(&c->lock);
            if (sig) /* it held the last reference of a removed region: REGION_FREED is posted */
                kv__signal_loop(c);
            free(j);
            return st;
        }
        c->stats.jobs_submitted++;
        c->stats.jobs_live++;
        pthread_mutex_unlock(&c->lock);
        return KV_LLM_SUCCESS;
    }
    if (total <= inline_max) {
        for (size_t i = 0; i < nsegs; i++) {
            if (rs[i].src_kind == KV_REGION_PROCESS || rs[i].dst_kind == KV_REGION_PROCESS) {
                /* CMA: the other process may hold the copy (kv_core.h); the movers take it */
                int sig = job_release_refs(c, &fields, 2 * nsegs);
                pthread_mutex_unlock(&c->lock);
                if (sig)
                    kv__signal_loop(c);
                return KV_INLINE_REFUSED;
            }
        }
        c->stats.jobs_inline++;
        if (!lease_ok(c, lease))
            st = KV_LLM_LINK_FAILED;
        pthread_mutex_unlock(&c->lock);
        if (st == KV_LLM_SUCCESS)
            st = copy_inline(rs, nsegs, nbytes);
        pthread_mutex_lock(&c->lock);
        c->stats.bytes_moved += *nbytes;
        int sig = job_release_refs(c, &fields, 2 * nsegs);
        pthread_mutex_unlock(&c->lock);
        if (sig)
            kv__signal_loop(c);
        *done = 1;
        return st;
    }
    kv_mover_job *m = calloc(1, sizeof *m);
    if (!m) {
        int sig = job_release_refs(c, &fields, 2 * nsegs);
        pthread_mutex_unlock(&c->lock);
        if (sig)
            kv__signal_loop(c);
        return KV_LLM_OUT_OF_MEMORY;
    }
    m->job = fields;
    m->job.record.kind = KV_RECORD_MOVER_JOB;
    m->job.state = KV_JS_QUEUED;
    m->lease = lease;
    kv__job_hash(c, &m->job);
    int backlog = c->mover_queue_head != NULL; /* the movers have other work already */
    kv__rank_insert(&c->mover_queue_head, &c->mover_queue_tail, &m->job); /* movers claim chunks of the head job */
    if (m->job.queue_prev && pairable(m->job.queue_prev, &m->job)) {
        m->paired = 1;
        m->pair_id = m->job.queue_prev->record.id;
    }
    __atomic_add_fetch(&c->mover_queued, 1, __ATOMIC_RELEASE); /* a polling mover sees it */
    c->stats.jobs_submitted++;
    c->stats.jobs_live++;
    /* A mover in its poll takes a lone one-chunk job without a wake-up (it looks at the
     * queue under the lock before it sleeps); waking the idle ones too would cost this
     * thread a futex call and have them contend for the lock, for nothing. A job of
     * several chunks, or one behind others, wakes them all. */
    if (!c->movers_polling || backlog || fields.total_bytes > c->chunk_bytes)
        pthread_cond_broadcast(&c->work_ready);
    pthread_mutex_unlock(&c->lock);
    return KV_LLM_SUCCESS;
}

/* A mover job (transport jobs: their ops->abort). */
static int mover_job_abort(kv_core *c, kv_mover_job *m, uint32_t status) {
    mover_job_fail(c, m, status);
    c->stats.jobs_aborted++;
    return mover_job_maybe_finish(c, m);
}

uint32_t kv_core_abort(kv_core *c, uint64_t job_id, uint32_t status) {
    if (status == KV_LLM_SUCCESS)
        return KV_LLM_PARAM_INVALID;
    pthread_mutex_lock(&c->lock);
    kv_job *j = kv__job_find(c, job_id);
    uint32_t st = KV_LLM_SUCCESS;
    int sig = 0;
    if (!j)
        st = KV_LLM_PARAM_INVALID;
    else if (j->transport) /* its transport fences it (TCP: ABORT, then ABORT_ACK from the peer) */
        st = j->transport->ops->abort(j->transport, j, status, &sig);
    else if (j->state == KV_JS_DRAINING && j->record.status != KV_LLM_SUCCESS)
        st = KV_LLM_PARAM_INVALID;
    else
        sig = mover_job_abort(c, (kv_mover_job *)j, status);
    pthread_mutex_unlock(&c->lock);
    if (sig)
        kv__signal_loop(c);
    return st;
}

/* --------------------------------------------------------------- transports */

void kv__transport_register(kv_core *c, int kind, kv_transport *t) {
    assert(kind >= 0 && kind < KV_REGION_KINDS && !c->transports[kind] && !c->closed);
    c->transports[kind] = t;
}

kv_transport *kv__transport_get(kv_core *c, int kind) { return c->transports[kind]; }

/* --------------------------------------------------------------- lifecycle */

uint32_t kv_core_new(kv_core **out, int movers, uint64_t chunk_bytes) {
    if (movers < 1 || movers > KV_MAX_MOVERS || chunk_bytes < 4096)
        return KV_LLM_PARAM_INVALID;
    kv_core *c = calloc(1, sizeof *c);
    if (!c)
        return KV_LLM_OUT_OF_MEMORY;
    c->chunk_bytes = chunk_bytes;
    c->nregions = 1; /* id 0 is never valid */
    c->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (c->event_fd < 0) {
        free(c);
        return KV_LLM_FAILED;
    }
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->work_ready, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->mover_exit, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_lock(&c->lock);
    for (int i = 0; i < movers; i++)
        if (mover_start(c, i) != 0)
            break;
    pthread_mutex_unlock(&c->lock);
    if (c->nmovers != movers) {
        kv_core_close(c);
        kv_core_free(c);
        return KV_LLM_FAILED;
    }
    *out = c;
    return KV_LLM_SUCCESS;
}

int kv_core_fileno(const kv_core *c) { return c->event_fd; }

/* Job `job_id`'s completion, unlinked from the queue, into `out`: 1; 0 if not
 * posted. Caller holds the lock. */
static int take_locked(kv_core *c, uint64_t job_id, kv_completion *out) {
    kv_record *prev = NULL;
    for (kv_record *x = c->done_head; x; prev = x, x = x->done_next) {
        if (x->id != job_id || x->kind == KV_RECORD_EVENT || x->kind == KV_RECORD_ABANDONED)
            continue;
        if (prev)
            prev->done_next = x->done_next;
        else
            c->done_head = x->done_next;
        if (c->done_tail == x)
            c->done_tail = prev;
        const kv_job *j = (const kv_job *)x;
        out->job_id = x->id;
        out->status = x->status;
        out->nbytes = j->bytes_done;
        out->flags = j->claim_segment == 0 && j->claim_offset == 0 ? KV_DONE_UNSTARTED : 0;
        free(x);
        return 1;
    }
    return 0;
}

/* Take the core's lock, spinning a moment first: a waiter that blocked on it while a
 * mover posts would sleep in the kernel, and wake tens of microseconds later. */
static void lock_spinning(kv_core *c) {
    for (int k = 0; k < 256; k++) {
        if (pthread_mutex_trylock(&c->lock) == 0)
            return;
#ifdef KV_HAVE_STREAM
        _mm_pause();
#endif
    }
    pthread_mutex_lock(&c->lock);
}

int kv__trylock_within(pthread_mutex_t *m, uint64_t bound_ns) {
    uint64_t t0 = boottime_ns();
    for (unsigned k = 1; pthread_mutex_trylock(m) != 0; k++) {
#ifdef KV_HAVE_STREAM
        _mm_pause();
#endif
        if ((k & 63) == 0 && boottime_ns() - t0 >= bound_ns)
            return 0;
    }
    return 1;
}

int kv_core_wait_take(kv_core *c, uint64_t job_id, uint64_t bound_ns, kv_completion *out) {
    return kv__wait_take_driving(c, job_id, bound_ns, out, NULL, NULL);
}

int kv__wait_take_driving(kv_core *c, uint64_t job_id, uint64_t bound_ns, kv_completion *out,
                          int (*drive)(void *), void *arg) {
    uint64_t end = boottime_ns() + bound_ns;
    int found = 0;
    __atomic_store_n(&c->take_job, job_id, __ATOMIC_RELAXED); /* (a post before this signals: a spare wake-up) */
    for (;;) {
        lock_spinning(c);
        uint64_t seen = __atomic_load_n(&c->posted, __ATOMIC_ACQUIRE);
        if ((found = take_locked(c, job_id, out)) != 0 || boottime_ns() >= end)
            break;
        pthread_mutex_unlock(&c->lock);
        if (drive) {
            for (unsigned k = 1; __atomic_load_n(&c->posted, __ATOMIC_ACQUIRE) == seen; k++) {
                if (!drive(arg)) {
#ifdef KV_HAVE_STREAM
                    _mm_pause();
#endif
                }
                if ((k & 15) == 0 && boottime_ns() >= end)
                    break;
            }
        } else {
            spin_until_changed(&c->posted, seen, end, UINT_MAX);
        }
    }
    __atomic_store_n(&c->take_job, 0, __ATOMIC_RELAXED);
    /* Its posting did not signal; nor did a post that found it at the head: whatever
     * waits now must be signalled (at worst a spare wake-up of the reader). */
    int sig = c->done_head != NULL;
    pthread_mutex_unlock(&c->lock);
    if (sig)
        kv__signal_loop(c);
    return found;
}

size_t kv_core_poll(kv_core *c, kv_completion *out, size_t max) {
    uint64_t v;
    ssize_t r;
    do /* reset first, then drain: a completion posted after this read signals again */
        r = read(c->event_fd, &v, sizeof v);
    while (r < 0 && errno == EINTR);
    size_t n = 0;
    pthread_mutex_lock(&c->lock);
    while (n < max && c->done_head) {
        kv_record *r = c->done_head;
        c->done_head = r->done_next;
        out[n].job_id = r->id;
        out[n].status = r->status;
        out[n].nbytes = 0;
        out[n].flags = KV_DONE_UNSTARTED; /* an event moves nothing */
        if (r->kind == KV_RECORD_ABANDONED)
            out[n].flags = 0; /* its job's bytes went out; some may still land (kv_core_reap) */
        else if (r->kind != KV_RECORD_EVENT) {
            const kv_job *j = (const kv_job *)r;
            out[n].nbytes = j->bytes_done;
            /* nothing of it went out: no chunk (mover) or frame (TCP) claimed */
            out[n].flags = j->claim_segment == 0 && j->claim_offset == 0 ? KV_DONE_UNSTARTED : 0;
        }
        n++;
        free(r);
    }
    if (!c->done_head)
        c->done_tail = NULL;
    int more = c->done_head != NULL;
    pthread_mutex_unlock(&c->lock);
    if (more)
        kv__signal_loop(c); /* the caller's buffer was too small: stay readable */
    return n;
}

void kv_core_close(kv_core *c) {
    pthread_mutex_lock(&c->lock);
    if (c->closed) {
        pthread_mutex_unlock(&c->lock);
        return;
    }
    c->closed = 1; /* from here no transport is registered: the array is read once */
    kv_transport *transports[KV_REGION_KINDS];
    memcpy(transports, c->transports, sizeof transports);
    pthread_mutex_unlock(&c->lock);
    for (int kind = 0; kind < KV_REGION_KINDS; kind++) /* their jobs complete ENGINE_FINALIZED (fenced) */
        if (transports[kind])
            transports[kind]->ops->stop(transports[kind]);
    pthread_mutex_lock(&c->lock);
    for (unsigned b = 0; b < KV_HASH_BUCKETS; b++) {
        kv_job *j = c->jobs_by_id[b];
        while (j) {
            kv_job *next = j->hash_next;
            if (j->record.kind == KV_RECORD_MOVER_JOB && j->state == KV_JS_QUEUED) /* jobs on their last
                                                                                      chunks finish normally */
                mover_job_abort(c, (kv_mover_job *)j, KV_LLM_ENGINE_FINALIZED);
            j = next;
        }
    }
    c->stopping = 1;
    pthread_cond_broadcast(&c->work_ready);
    /* Wait for every mover (retired ones too) to return, bounded: one stuck in a
     * copy another process holds may never return (kv_core_reap). */
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)(KV_CLOSE_MOVER_NS / 1000000000ull);
    until.tv_nsec += (long)(KV_CLOSE_MOVER_NS % 1000000000ull);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    while (movers_running(c))
        if (pthread_cond_timedwait(&c->mover_exit, &c->lock, &until) == ETIMEDOUT)
            break;
    int nmovers = c->nmovers;
    for (int i = 0; i < nmovers; i++) {
        kv_mover *mv = &c->movers[i];
        if (mv->retired)
            continue; /* detached when it was retired */
        if (mv->running) { /* it touches the core when its copy returns: kv_core_free leaves it */
            mv->retired = 1;
            pthread_detach(mv->thread);
            c->stats.movers_stuck++;
        } else {
            pthread_mutex_unlock(&c->lock);
            pthread_join(mv->thread, NULL);
            pthread_mutex_lock(&c->lock);
        }
    }
    pthread_mutex_unlock(&c->lock);
    /* A mover that was copying finished its chunk and posted before exiting. */
    kv__signal_loop(c);
}

void kv_core_free(kv_core *c) {
    if (!c)
        return;
    kv_core_close(c);
    pthread_mutex_lock(&c->lock);
    int running = movers_running(c);
    pthread_mutex_unlock(&c->lock);
    if (running)
        return; /* a mover stuck in a copy still uses it (kv_core_close): left as it is */
    for (int kind = 0; kind < KV_REGION_KINDS; kind++) {
        if (c->transports[kind])
            c->transports[kind]->ops->destroy(c->transports[kind]);
        c->transports[kind] = NULL;
    }
    for (size_t id = 1; id < c->nregions; id++) {
        kv_region *r = c->regions[id];
        if (!r)
            continue;
        if (r->flags & KV_REGION_F_UNMAP)
            munmap((void *)(uintptr_t)r->addr, (size_t)r->len);
        pidref_put(c, r->pidref);
        free(r->freed_event);
        free(r);
    }
    free(c->regions);
    free(c->lease_until);
    while (c->done_head) {
        kv_record *r = c->done_head;
        c->done_head = r->done_next;
        free(r);
    }
    close(c->event_fd);
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->work_ready);
    pthread_cond_destroy(&c->mover_exit);
    free(c);
}

void kv_core_stats(kv_core *c, kv_stats *out) {
    pthread_mutex_lock(&c->lock);
    *out = c->stats;
    pthread_mutex_unlock(&c->lock);
}
