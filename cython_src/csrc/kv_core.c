/* kvengine native core. See kv_core.h for the contract. */
/* Guarded: setup.py and the tests pass -D_GNU_SOURCE (=1); an unguarded
 * redefinition warns, and is an error under -Werror. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kv_core.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#define KV_MAX_MOVERS 64
#define KV_HASH_BUCKETS 4096u

typedef struct {
    uint64_t addr;
    uint64_t len;
    int32_t pid;
    int kind;
    int unmap;
    int removed;
    uint64_t refs; /* jobs using it */
} kv_region;

typedef struct {
    uint64_t src, dst, len; /* resolved addresses */
    int32_t pid;            /* peer pid when one side is KV_REGION_PROCESS */
    int8_t src_kind, dst_kind;
} kv_rseg;

typedef struct kv_job {
    uint64_t id;
    kv_rseg *segs;
    size_t nsegs;
    uint32_t *regions; /* region refs held: 2 per segment */
    size_t cur_seg;    /* claim cursor */
    uint64_t cur_off;
    uint64_t done_bytes;
    int active;        /* movers copying a chunk of this job */
    int claimed_all;   /* no more chunks to hand out (done, failed or aborted) */
    int queued;
    uint32_t status;   /* first failure, or the abort status */
    struct kv_job *qnext, *qprev; /* mover queue */
    struct kv_job *hnext;         /* id hash chain */
    struct kv_job *dnext;         /* completion list, once finished */
} kv_job;

struct kv_core {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t threads[KV_MAX_MOVERS];
    int nthreads;
    int stopping;
    int closed;
    int efd;
    uint64_t chunk;

    kv_region **regions; /* index = id; NULL once released */
    size_t nregions;     /* next id */
    size_t region_cap;

    kv_job *qhead, *qtail;
    kv_job *hash[KV_HASH_BUCKETS];

    kv_job *done_head, *done_tail; /* finished jobs not yet polled */

    kv_stats st;
};

/* ------------------------------------------------------------------ regions */

static kv_region *region_get(kv_core *c, uint32_t id) {
    if (id == 0 || id >= c->nregions)
        return NULL;
    return c->regions[id];
}

static void region_release(kv_core *c, uint32_t id) {
    kv_region *r = c->regions[id];
    if (r->unmap)
        munmap((void *)(uintptr_t)r->addr, (size_t)r->len); /* nothing to do on failure */
    free(r);
    c->regions[id] = NULL;
    c->st.regions_live--;
}

static void region_unref(kv_core *c, uint32_t id) {
    kv_region *r = c->regions[id];
    if (--r->refs == 0 && r->removed)
        region_release(c, id);
}

uint32_t kv_region_add(kv_core *c, int kind, int32_t pid, uint64_t addr, uint64_t len,
                       int unmap_on_release, uint32_t *region_id) {
    if (addr == 0 || len == 0 || addr + len < addr)
        return KV_LLM_PARAM_INVALID;
    if (kind != KV_REGION_LOCAL && kind != KV_REGION_PROCESS)
        return KV_LLM_PARAM_INVALID;
    if (kind == KV_REGION_PROCESS && (pid <= 0 || unmap_on_release))
        return KV_LLM_PARAM_INVALID;
    kv_region *r = calloc(1, sizeof *r);
    if (!r)
        return KV_LLM_OUT_OF_MEMORY;
    r->addr = addr;
    r->len = len;
    r->pid = pid;
    r->kind = kind;
    r->unmap = unmap_on_release;
    pthread_mutex_lock(&c->mu);
    if (c->closed) {
        pthread_mutex_unlock(&c->mu);
        free(r);
        return KV_LLM_ENGINE_FINALIZED;
    }
    if (c->nregions >= c->region_cap) {
        size_t cap = c->region_cap ? c->region_cap * 2 : 64;
        kv_region **n = realloc(c->regions, cap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&c->mu);
            free(r);
            return KV_LLM_OUT_OF_MEMORY;
        }
        c->regions = n;
        c->region_cap = cap;
    }
    if (c->nregions > UINT32_MAX - 1) {
        pthread_mutex_unlock(&c->mu);
        free(r);
        return KV_LLM_OUT_OF_MEMORY;
    }
    *region_id = (uint32_t)c->nregions;
    c->regions[c->nregions++] = r;
    c->st.regions_live++;
    pthread_mutex_unlock(&c->mu);
    return KV_LLM_SUCCESS;
}

uint32_t kv_region_remove(kv_core *c, uint32_t id) {
    pthread_mutex_lock(&c->mu);
    kv_region *r = region_get(c, id);
    if (!r || r->removed) {
        pthread_mutex_unlock(&c->mu);
        return KV_LLM_KV_CACHE_NOT_EXIST;
    }
    r->removed = 1;
    if (r->refs == 0)
        region_release(c, id);
    pthread_mutex_unlock(&c->mu);
    return KV_LLM_SUCCESS;
}

uint32_t kv_map_fd(int fd, uint64_t len, uint64_t *addr) {
    if (fd < 0 || len == 0 || len > (uint64_t)SIZE_MAX)
        return KV_LLM_PARAM_INVALID;
    void *p = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED)
        return errno == ENOMEM ? KV_LLM_OUT_OF_MEMORY : KV_LLM_FAILED;
    *addr = (uint64_t)(uintptr_t)p;
    return KV_LLM_SUCCESS;
}

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

/* Copy `n` bytes at offset `off` of segment `s`. No locks held. */
static uint32_t copy_chunk(const kv_rseg *s, uint64_t off, uint64_t n) {
    void *dst = (void *)(uintptr_t)(s->dst + off);
    void *src = (void *)(uintptr_t)(s->src + off);
    if (s->src_kind == KV_REGION_LOCAL && s->dst_kind == KV_REGION_LOCAL) {
        memmove(dst, src, (size_t)n); /* regions may be one and the same */
        return KV_LLM_SUCCESS;
    }
    uint64_t moved = 0;
    while (moved < n) {
        struct iovec local, remote;
        ssize_t r;
        if (s->dst_kind == KV_REGION_PROCESS) {
            local.iov_base = (char *)src + moved;
            remote.iov_base = (char *)dst + moved;
            local.iov_len = remote.iov_len = (size_t)(n - moved);
            r = process_vm_writev(s->pid, &local, 1, &remote, 1, 0);
        } else {
            local.iov_base = (char *)dst + moved;
            remote.iov_base = (char *)src + moved;
            local.iov_len = remote.iov_len = (size_t)(n - moved);
            r = process_vm_readv(s->pid, &local, 1, &remote, 1, 0);
        }
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return status_from_errno(errno);
        }
        if (r == 0)
            return KV_LLM_FAILED;
        moved += (uint64_t)r;
    }
    return KV_LLM_SUCCESS;
}

/* ------------------------------------------------------------------- jobs */

static unsigned bucket(uint64_t id) {
    return (unsigned)((id * 0x9E3779B97F4A7C15ull) >> 52) & (KV_HASH_BUCKETS - 1);
}

static kv_job *job_find(kv_core *c, uint64_t id) {
    for (kv_job *j = c->hash[bucket(id)]; j; j = j->hnext)
        if (j->id == id)
            return j;
    return NULL;
}

static void job_unhash(kv_core *c, kv_job *j) {
    kv_job **p = &c->hash[bucket(j->id)];
    while (*p != j)
        p = &(*p)->hnext;
    *p = j->hnext;
}

static void queue_remove(kv_core *c, kv_job *j) {
    if (!j->queued)
        return;
    if (j->qprev)
        j->qprev->qnext = j->qnext;
    else
        c->qhead = j->qnext;
    if (j->qnext)
        j->qnext->qprev = j->qprev;
    else
        c->qtail = j->qprev;
    j->qnext = j->qprev = NULL;
    j->queued = 0;
}

static void job_release_refs(kv_core *c, kv_job *j, size_t nrefs) {
    for (size_t i = 0; i < nrefs; i++)
        region_unref(c, j->regions[i]);
    free(j->regions);
    free(j->segs);
    j->regions = NULL;
    j->segs = NULL;
}

static void signal_loop(kv_core *c) {
    uint64_t one = 1;
    ssize_t r;
    do
        r = write(c->efd, &one, sizeof one);
    while (r < 0 && errno == EINTR);
    /* EAGAIN means the counter is saturated: the loop is already woken. */
}

/* If nothing more will be copied for `j`, drop its region refs and append it
 * to the completion list (no allocation: a completion cannot be lost).
 * Caller holds the lock. Returns 1 if the eventfd must be signalled. */
static int job_maybe_finish(kv_core *c, kv_job *j) {
    if (!j->claimed_all || j->active)
        return 0;
    job_unhash(c, j);
    job_release_refs(c, j, j->nsegs * 2);
    c->st.jobs_live--;
    c->st.jobs_completed++;
    j->dnext = NULL;
    int was_empty = c->done_head == NULL;
    if (c->done_tail)
        c->done_tail->dnext = j;
    else
        c->done_head = j;
    c->done_tail = j;
    if (was_empty)
        c->st.wakeups++; /* the reader drains everything on one wake-up */
    return was_empty;
}

static void *mover_main(void *arg) {
    kv_core *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        kv_job *j = c->qhead;
        if (c->stopping)
            break;
        if (!j) {
            pthread_cond_wait(&c->cv, &c->mu);
            continue;
        }
        const kv_rseg *s = &j->segs[j->cur_seg];
        uint64_t off = j->cur_off;
        uint64_t n = s->len - off;
        if (n > c->chunk)
            n = c->chunk;
        j->cur_off += n;
        if (j->cur_off == s->len) {
            j->cur_off = 0;
            if (++j->cur_seg == j->nsegs) {
                j->claimed_all = 1;
                queue_remove(c, j);
            }
        }
        j->active++;
        pthread_mutex_unlock(&c->mu);

        uint32_t st = copy_chunk(s, off, n);

        pthread_mutex_lock(&c->mu);
        j->active--;
        c->st.bytes_moved += st == KV_LLM_SUCCESS ? n : 0;
        if (st == KV_LLM_SUCCESS) {
            j->done_bytes += n;
        } else if (j->status == KV_LLM_SUCCESS) {
            j->status = st;
            j->claimed_all = 1;
            queue_remove(c, j);
        }
        if (job_maybe_finish(c, j)) {
            pthread_mutex_unlock(&c->mu);
            signal_loop(c);
            pthread_mutex_lock(&c->mu);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Resolve and bounds-check `segs` into `out`, taking region refs into `refs`.
 * Caller holds the lock. On failure no ref is held. */
static uint32_t resolve(kv_core *c, const uint64_t *segs, size_t nsegs, kv_rseg *out,
                        uint32_t *refs, uint64_t *total) {
    uint64_t sum = 0;
    size_t i;
    uint32_t st = KV_LLM_SUCCESS;
    for (i = 0; i < nsegs; i++) {
        const uint64_t *w = segs + i * KV_SEG_WORDS;
        uint64_t len = w[4];
        if (w[0] > UINT32_MAX || w[2] > UINT32_MAX) {
            st = KV_LLM_KV_CACHE_NOT_EXIST;
            break;
        }
        kv_region *sr = region_get(c, (uint32_t)w[0]);
        kv_region *dr = region_get(c, (uint32_t)w[2]);
        if (!sr || !dr || sr->removed || dr->removed) {
            st = KV_LLM_KV_CACHE_NOT_EXIST;
            break;
        }
        /* bounds: off + len <= region len, without overflow */
        if (len == 0 || w[1] > sr->len || len > sr->len - w[1] || w[3] > dr->len ||
            len > dr->len - w[3] || sum + len < sum) {
            st = KV_LLM_PARAM_INVALID;
            break;
        }
        if (sr->kind == KV_REGION_PROCESS && dr->kind == KV_REGION_PROCESS) {
            st = KV_LLM_PARAM_INVALID; /* one side must be this process */
            break;
        }
        out[i].src = sr->addr + w[1];
        out[i].dst = dr->addr + w[3];
        out[i].len = len;
        out[i].src_kind = (int8_t)sr->kind;
        out[i].dst_kind = (int8_t)dr->kind;
        out[i].pid = sr->kind == KV_REGION_PROCESS ? sr->pid : dr->pid;
        sr->refs++;
        dr->refs++;
        refs[2 * i] = (uint32_t)w[0];
        refs[2 * i + 1] = (uint32_t)w[2];
        sum += len;
    }
    if (st != KV_LLM_SUCCESS) {
        for (size_t k = 0; k < 2 * i; k++)
            region_unref(c, refs[k]);
        return st;
    }
    *total = sum;
    return KV_LLM_SUCCESS;
}

uint32_t kv_core_submit(kv_core *c, uint64_t job_id, const uint64_t *segs, size_t nsegs,
                        uint64_t inline_max, int *done, uint64_t *nbytes) {
    *done = 0;
    *nbytes = 0;
    if (nsegs == 0 || nsegs > SIZE_MAX / (2 * sizeof(uint32_t)) / KV_SEG_WORDS)
        return KV_LLM_PARAM_INVALID;
    kv_job *j = calloc(1, sizeof *j);
    kv_rseg *rs = malloc(nsegs * sizeof *rs);
    uint32_t *refs = malloc(2 * nsegs * sizeof *refs);
    if (!j || !rs || !refs) {
        free(j);
        free(rs);
        free(refs);
        return KV_LLM_OUT_OF_MEMORY;
    }
    uint64_t total = 0;
    pthread_mutex_lock(&c->mu);
    uint32_t st = c->closed ? KV_LLM_ENGINE_FINALIZED : KV_LLM_SUCCESS;
    if (st == KV_LLM_SUCCESS && job_find(c, job_id))
        st = KV_LLM_PARAM_INVALID; /* job ids are unique among live jobs */
    if (st == KV_LLM_SUCCESS)
        st = resolve(c, segs, nsegs, rs, refs, &total);
    if (st != KV_LLM_SUCCESS) {
        pthread_mutex_unlock(&c->mu);
        free(j);
        free(rs);
        free(refs);
        return st;
    }
    j->id = job_id;
    j->segs = rs;
    j->nsegs = nsegs;
    j->regions = refs;
    if (total <= inline_max) {
        c->st.jobs_inline++;
        pthread_mutex_unlock(&c->mu);
        for (size_t i = 0; i < nsegs && st == KV_LLM_SUCCESS; i++) {
            st = copy_chunk(&rs[i], 0, rs[i].len);
            if (st == KV_LLM_SUCCESS)
                *nbytes += rs[i].len;
        }
        pthread_mutex_lock(&c->mu);
        c->st.bytes_moved += *nbytes;
        job_release_refs(c, j, 2 * nsegs);
        pthread_mutex_unlock(&c->mu);
        free(j);
        *done = 1;
        return st;
    }
    unsigned b = bucket(job_id);
    j->hnext = c->hash[b];
    c->hash[b] = j;
    j->queued = 1;
    j->qprev = c->qtail;
    if (c->qtail)
        c->qtail->qnext = j;
    else
        c->qhead = j;
    c->qtail = j;
    c->st.jobs_submitted++;
    c->st.jobs_live++;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return KV_LLM_SUCCESS;
}

static int abort_locked(kv_core *c, kv_job *j, uint32_t status) {
    if (j->status == KV_LLM_SUCCESS)
        j->status = status;
    j->claimed_all = 1;
    queue_remove(c, j);
    c->st.jobs_aborted++;
    return job_maybe_finish(c, j);
}

uint32_t kv_core_abort(kv_core *c, uint64_t job_id, uint32_t status) {
    if (status == KV_LLM_SUCCESS)
        return KV_LLM_PARAM_INVALID;
    pthread_mutex_lock(&c->mu);
    kv_job *j = job_find(c, job_id);
    if (!j || (j->claimed_all && j->status != KV_LLM_SUCCESS)) {
        pthread_mutex_unlock(&c->mu);
        return KV_LLM_PARAM_INVALID;
    }
    int sig = abort_locked(c, j, status);
    pthread_mutex_unlock(&c->mu);
    if (sig)
        signal_loop(c);
    return KV_LLM_SUCCESS;
}

/* --------------------------------------------------------------- lifecycle */

uint32_t kv_core_new(kv_core **out, int movers, uint64_t chunk_bytes) {
    if (movers < 1 || movers > KV_MAX_MOVERS || chunk_bytes < 4096)
        return KV_LLM_PARAM_INVALID;
    kv_core *c = calloc(1, sizeof *c);
    if (!c)
        return KV_LLM_OUT_OF_MEMORY;
    c->chunk = chunk_bytes;
    c->nregions = 1; /* id 0 is never valid */
    c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (c->efd < 0) {
        free(c);
        return KV_LLM_FAILED;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    /* Movers take no signals: Python handles them on the main thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    for (int i = 0; i < movers; i++) {
        if (pthread_create(&c->threads[i], NULL, mover_main, c) != 0)
            break;
        c->nthreads++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (c->nthreads != movers) {
        kv_core_close(c);
        kv_core_free(c);
        return KV_LLM_FAILED;
    }
    *out = c;
    return KV_LLM_SUCCESS;
}

int kv_core_fileno(const kv_core *c) { return c->efd; }

size_t kv_core_poll(kv_core *c, kv_completion *out, size_t max) {
    uint64_t v;
    ssize_t r;
    do /* reset first, then drain: a completion posted after this read signals again */
        r = read(c->efd, &v, sizeof v);
    while (r < 0 && errno == EINTR);
    size_t n = 0;
    pthread_mutex_lock(&c->mu);
    while (n < max && c->done_head) {
        kv_job *j = c->done_head;
        c->done_head = j->dnext;
        out[n].job_id = j->id;
        out[n].status = j->status;
        out[n].nbytes = j->done_bytes;
        n++;
        free(j);
    }
    if (!c->done_head)
        c->done_tail = NULL;
    int more = c->done_head != NULL;
    pthread_mutex_unlock(&c->mu);
    if (more)
        signal_loop(c); /* the caller's buffer was too small: stay readable */
    return n;
}

void kv_core_close(kv_core *c) {
    pthread_mutex_lock(&c->mu);
    if (c->closed) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    c->closed = 1;
    for (unsigned b = 0; b < KV_HASH_BUCKETS; b++) {
        kv_job *j = c->hash[b];
        while (j) {
            kv_job *next = j->hnext;
            if (!j->claimed_all) /* jobs on their last chunks finish normally */
                abort_locked(c, j, KV_LLM_ENGINE_FINALIZED);
            j = next;
        }
    }
    c->stopping = 1;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < c->nthreads; i++)
        pthread_join(c->threads[i], NULL);
    /* A mover that was copying finished its chunk and posted before exiting. */
    signal_loop(c);
}

void kv_core_free(kv_core *c) {
    if (!c)
        return;
    kv_core_close(c);
    for (size_t id = 1; id < c->nregions; id++) {
        kv_region *r = c->regions[id];
        if (!r)
            continue;
        if (r->unmap)
            munmap((void *)(uintptr_t)r->addr, (size_t)r->len);
        free(r);
    }
    free(c->regions);
    while (c->done_head) {
        kv_job *j = c->done_head;
        c->done_head = j->dnext;
        free(j);
    }
    close(c->efd);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
}

void kv_core_stats(kv_core *c, kv_stats *out) {
    pthread_mutex_lock(&c->mu);
    *out = c->st;
    pthread_mutex_unlock(&c->mu);
}
