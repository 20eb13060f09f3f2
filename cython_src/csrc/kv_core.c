/* kvengine native core. See kv_core.h for the contract. */
/* Guarded: setup.py and the tests pass -D_GNU_SOURCE (=1); an unguarded
 * redefinition warns, and is an error under -Werror. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kv_internal.h"

#include <assert.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <fcntl.h>
#include <unistd.h>

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
    if (r->flags & KV_REGION_F_UNMAP)
        munmap((void *)(uintptr_t)r->addr, (size_t)r->len); /* nothing to do on failure */
    pidref_put(c, r->pidref);
    if (r->notify) {
        sig = kv__post_event(c, r->notify);
        r->notify = NULL;
    }
    free(r);
    c->regions[id] = NULL;
    c->st.regions_live--;
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
    } else if (kind == KV_REGION_TCP) {
        if (pid <= 0 || addr == 0 || addr > UINT32_MAX || (flags & (KV_REGION_F_UNMAP | KV_REGION_F_EXPORT)))
            return KV_LLM_PARAM_INVALID;
    } else {
        return KV_LLM_PARAM_INVALID;
    }
    kv_region *r = calloc(1, sizeof *r);
    kv_job *ev = (flags & KV_REGION_F_NOTIFY) ? calloc(1, sizeof *ev) : NULL;
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
    r->notify = ev;
    pthread_mutex_lock(&c->mu);
    if (c->closed) {
        pthread_mutex_unlock(&c->mu);
        free(r);
        free(ev);
        return KV_LLM_ENGINE_FINALIZED;
    }
    if (c->nregions >= c->region_cap) {
        size_t cap = c->region_cap ? c->region_cap * 2 : 64;
        kv_region **n = realloc(c->regions, cap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&c->mu);
            free(r);
            free(ev);
            return KV_LLM_OUT_OF_MEMORY;
        }
        c->regions = n;
        c->region_cap = cap;
    }
    if (c->nregions > UINT32_MAX - 1) {
        pthread_mutex_unlock(&c->mu);
        free(r);
        free(ev);
        return KV_LLM_OUT_OF_MEMORY;
    }
    *region_id = (uint32_t)c->nregions;
    if (ev) {
        ev->id = KV_EVENT_REGION_FREED | *region_id;
        ev->event = 1;
    }
    c->regions[c->nregions++] = r;
    c->st.regions_live++;
    pthread_mutex_unlock(&c->mu);
    return KV_LLM_SUCCESS;
}

uint32_t kv_region_remove(kv_core *c, uint32_t id) {
    pthread_mutex_lock(&c->mu);
    kv_region *r = kv__region_get(c, id);
    if (!r || r->removed) {
        pthread_mutex_unlock(&c->mu);
        return KV_LLM_KV_CACHE_NOT_EXIST;
    }
    r->removed = 1;
    int sig = r->refs == 0 ? region_release(c, id) : 0;
    pthread_mutex_unlock(&c->mu);
    if (sig)
        kv__signal_loop(c);
    return KV_LLM_SUCCESS;
}

uint32_t kv_region_pidfd(kv_core *c, uint32_t id, int pidfd, uint64_t key) {
    if (pidfd < 0)
        return KV_LLM_PARAM_INVALID;
    pthread_mutex_lock(&c->mu);
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
    pthread_mutex_unlock(&c->mu);
    return st;
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

/* ----------------------------------------------------------- mover leases */

/* CLOCK_BOOTTIME: like CLOCK_MONOTONIC, but it also counts time suspended, so a
 * lease taken before a suspend has expired after it (time.clock_gettime_ns(
 * time.CLOCK_BOOTTIME) in Python). */
static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint32_t kv_lease_add(kv_core *c, uint64_t until_ns, uint32_t *lease_id) {
    pthread_mutex_lock(&c->mu);
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
    pthread_mutex_unlock(&c->mu);
    return st;
}

uint32_t kv_lease_renew(kv_core *c, uint32_t id, uint64_t until_ns) {
    pthread_mutex_lock(&c->mu);
    uint32_t st = KV_LLM_PARAM_INVALID;
    if (id && id < c->nleases && c->lease_until[id]) {
        c->lease_until[id] = until_ns ? until_ns : 1; /* (0 would read as removed) */
        st = KV_LLM_SUCCESS;
    }
    pthread_mutex_unlock(&c->mu);
    return st;
}

uint32_t kv_lease_remove(kv_core *c, uint32_t id) {
    pthread_mutex_lock(&c->mu);
    uint32_t st = KV_LLM_PARAM_INVALID;
    if (id && id < c->nleases && c->lease_until[id]) {
        c->lease_until[id] = 0;
        st = KV_LLM_SUCCESS;
    }
    pthread_mutex_unlock(&c->mu);
    return st;
}

/* May a job under lease `id` move another chunk? Caller holds c->mu. */
static int lease_ok(kv_core *c, uint32_t id) { return id == 0 || c->lease_until[id] > mono_ns(); }

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
        if (s->pidfd >= 0 && process_gone(s->pidfd))
            return KV_LLM_LINK_FAILED;
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

static unsigned bucket(uint64_t id);

void kv__job_hash(kv_core *c, kv_job *j) {
    unsigned b = bucket(j->id);
    j->hnext = c->hash[b];
    c->hash[b] = j;
}

static unsigned bucket(uint64_t id) {
    return (unsigned)((id * 0x9E3779B97F4A7C15ull) >> 52) & (KV_HASH_BUCKETS - 1);
}

kv_job *kv__job_find(kv_core *c, uint64_t id) {
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

int kv__queue_remove(kv_job **head, kv_job **tail, kv_job *j) {
    if (!j->queued)
        return 0;
    if (j->qprev)
        j->qprev->qnext = j->qnext;
    else
        *head = j->qnext;
    if (j->qnext)
        j->qnext->qprev = j->qprev;
    else
        *tail = j->qprev;
    j->qnext = j->qprev = NULL;
    j->queued = 0;
    return 1;
}

static void queue_remove(kv_core *c, kv_job *j) { kv__queue_remove(&c->qhead, &c->qtail, j); }

void kv__rank_insert(kv_job **head, kv_job **tail, kv_job *j) {
    kv_job *after = *tail;
    while (after && after->rank > j->rank)
        after = after->qprev;
    j->qprev = after;
    j->qnext = after ? after->qnext : *head;
    if (j->qnext)
        j->qnext->qprev = j;
    else
        *tail = j;
    if (after)
        after->qnext = j;
    else
        *head = j;
    j->queued = 1;
}

static int job_release_refs(kv_core *c, kv_job *j, size_t nrefs) {
    int sig = 0;
    for (size_t i = 0; i < nrefs; i++)
        sig |= region_unref_sig(c, j->regions[i]);
    free(j->regions);
    free(j->segs);
    free(j->pt);
    j->pt = NULL;
    j->regions = NULL;
    j->segs = NULL;
    return sig;
}

void kv__signal_loop(kv_core *c) {
    uint64_t one = 1;
    ssize_t r;
    do
        r = write(c->efd, &one, sizeof one);
    while (r < 0 && errno == EINTR);
    /* EAGAIN means the counter is saturated: the loop is already woken. */
}

/* Append a finished job or an event to the completion list (no allocation: a
 * completion cannot be lost). Returns 1 if the eventfd must be signalled. */
int kv__post_event(kv_core *c, kv_job *j) {
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

int kv__job_complete(kv_core *c, kv_job *j, uint32_t status) {
    if (j->status == KV_LLM_SUCCESS)
        j->status = status;
    job_unhash(c, j);
    int sig = job_release_refs(c, j, j->nsegs * 2);
    c->st.jobs_live--;
    c->st.jobs_completed++;
    return kv__post_event(c, j) | sig;
}

/* If nothing more will be copied for `j`, complete it.
 * Caller holds the lock. Returns 1 if the eventfd must be signalled. */
static int job_maybe_finish(kv_core *c, kv_job *j) {
    if (j->state != KV_JS_DRAINING || j->active)
        return 0;
    j->state = KV_JS_DONE;
    return kv__job_complete(c, j, KV_LLM_SUCCESS);
}

/* A mover job stops handing out chunks (all claimed, failed or aborted). */
static void job_drain(kv_core *c, kv_job *j) {
    assert(j->state == KV_JS_QUEUED || j->state == KV_JS_DRAINING);
    j->state = KV_JS_DRAINING;
    queue_remove(c, j);
}

/* A mover job fails (or is aborted) with `status`, unless it failed already: no
 * more chunks; it completes once the chunks in progress end. */
static void job_fail(kv_core *c, kv_job *j, uint32_t status) {
    if (j->status == KV_LLM_SUCCESS)
        j->status = status;
    job_drain(c, j);
}

/* A mover's step ended: complete `j` if nothing more will be copied for it,
 * signalling the loop outside the lock. Caller holds the lock. */
static void mover_maybe_finish(kv_core *c, kv_job *j) {
    if (job_maybe_finish(c, j)) {
        pthread_mutex_unlock(&c->mu);
        kv__signal_loop(c);
        pthread_mutex_lock(&c->mu);
    }
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
        if (!lease_ok(c, j->lease)) { /* its peer may have stopped answering: no more chunks */
            job_fail(c, j, KV_LLM_LINK_FAILED);
            mover_maybe_finish(c, j);
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
                job_drain(c, j);
            }
        }
        j->active++;
        pthread_mutex_unlock(&c->mu);

        uint32_t st = copy_chunk(s, off, n);

        pthread_mutex_lock(&c->mu);
        j->active--;
        c->st.bytes_moved += st == KV_LLM_SUCCESS ? n : 0;
        if (st == KV_LLM_SUCCESS)
            j->done_bytes += n;
        else
            job_fail(c, j, st);
        mover_maybe_finish(c, j);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Resolve and bounds-check `segs` into `out`, taking region refs into `refs`.
 * Caller holds the lock. On failure no ref is held. */
static uint32_t resolve(kv_core *c, const uint64_t *segs, size_t nsegs, kv_rseg *out,
                        uint32_t *refs, uint64_t *total, int32_t *tcp_link) {
    uint64_t sum = 0;
    size_t i;
    uint32_t st = KV_LLM_SUCCESS;
    int tcp = -1; /* -1 undecided, 0 local/process job, 1 TCP job */
    for (i = 0; i < nsegs; i++) {
        const uint64_t *w = segs + i * KV_SEG_WORDS;
        uint64_t len = w[4];
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
        /* bounds: off + len <= region len, without overflow */
        if (len == 0 || w[1] > sr->len || len > sr->len - w[1] || w[3] > dr->len ||
            len > dr->len - w[3] || sum + len < sum) {
            st = KV_LLM_PARAM_INVALID;
            break;
        }
        if (sr->kind != KV_REGION_LOCAL && dr->kind != KV_REGION_LOCAL) {
            st = KV_LLM_PARAM_INVALID; /* one side must be this process's memory */
            break;
        }
        int seg_tcp = sr->kind == KV_REGION_TCP || dr->kind == KV_REGION_TCP;
        int32_t link = sr->kind == KV_REGION_TCP ? sr->pid : dr->pid;
        if ((tcp >= 0 && tcp != seg_tcp) || (seg_tcp && i > 0 && link != *tcp_link)) {
            st = KV_LLM_PARAM_INVALID; /* one job, one way: all segments local or all on one link */
            break;
        }
        tcp = seg_tcp;
        if (seg_tcp)
            *tcp_link = link;
        out[i].src = sr->kind == KV_REGION_TCP ? w[1] : sr->addr + w[1];
        out[i].dst = dr->kind == KV_REGION_TCP ? w[3] : dr->addr + w[3];
        out[i].len = len;
        out[i].src_kind = (int8_t)sr->kind;
        out[i].dst_kind = (int8_t)dr->kind;
        out[i].pid = sr->kind != KV_REGION_LOCAL ? sr->pid : dr->pid;
        const kv_region *pr = sr->kind == KV_REGION_PROCESS ? sr : dr->kind == KV_REGION_PROCESS ? dr : NULL;
        out[i].pidfd = pr && pr->pidref ? pr->pidref->fd : -1; /* lives while the job holds the region */
        out[i].rrid = (uint32_t)(sr->kind == KV_REGION_TCP ? sr->addr : dr->addr);
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

uint32_t kv_core_submit_leased(kv_core *c, uint64_t job_id, const uint64_t *segs, size_t nsegs,
                               uint64_t inline_max, uint64_t rank, uint32_t lease, int *done, uint64_t *nbytes) {
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
    int32_t link = 0;
    pthread_mutex_lock(&c->mu);
    uint32_t st = c->closed ? KV_LLM_ENGINE_FINALIZED : KV_LLM_SUCCESS;
    if (st == KV_LLM_SUCCESS && (kv__job_find(c, job_id) || (job_id & KV_EVENT) || lease >= c->nleases + !lease))
        st = KV_LLM_PARAM_INVALID; /* job ids are unique among live jobs, below 2**63; a lease must exist */
    if (st == KV_LLM_SUCCESS)
        st = resolve(c, segs, nsegs, rs, refs, &total, &link);
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
    j->total = total;
    j->rank = rank;
    j->lease = lease;
    if (rs[0].src_kind == KV_REGION_TCP || rs[0].dst_kind == KV_REGION_TCP) {
        j->tcp = 1;
        j->is_pull = rs[0].src_kind == KV_REGION_TCP;
        j->link_id = (uint32_t)link;
        kv_transport *t = c->transports[KV_REGION_TCP];
        st = t ? t->ops->submit(t, j) : KV_LLM_LINK_FAILED; /* hashes and starts it, or fails */
        if (st != KV_LLM_SUCCESS) {
            job_release_refs(c, j, 2 * nsegs);
            pthread_mutex_unlock(&c->mu);
            free(j);
            return st;
        }
        c->st.jobs_submitted++;
        c->st.jobs_live++;
        pthread_mutex_unlock(&c->mu);
        return KV_LLM_SUCCESS;
    }
    if (total <= inline_max) {
        c->st.jobs_inline++;
        if (!lease_ok(c, lease))
            st = KV_LLM_LINK_FAILED;
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
    j->state = KV_JS_QUEUED;
    kv__rank_insert(&c->qhead, &c->qtail, j); /* movers claim chunks of the head job */
    c->st.jobs_submitted++;
    c->st.jobs_live++;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return KV_LLM_SUCCESS;
}

/* A mover job (transport jobs: their ops->abort). */
static int abort_locked(kv_core *c, kv_job *j, uint32_t status) {
    job_fail(c, j, status);
    c->st.jobs_aborted++;
    return job_maybe_finish(c, j);
}

uint32_t kv_core_abort(kv_core *c, uint64_t job_id, uint32_t status) {
    if (status == KV_LLM_SUCCESS)
        return KV_LLM_PARAM_INVALID;
    pthread_mutex_lock(&c->mu);
    kv_job *j = kv__job_find(c, job_id);
    uint32_t st = KV_LLM_SUCCESS;
    int sig = 0;
    if (!j)
        st = KV_LLM_PARAM_INVALID;
    else if (j->tcp) /* its transport fences it (TCP: ABORT, then ABORT_ACK from the peer) */
        st = c->transports[KV_REGION_TCP]->ops->abort(c->transports[KV_REGION_TCP], j, status, &sig);
    else if (j->state == KV_JS_DRAINING && j->status != KV_LLM_SUCCESS)
        st = KV_LLM_PARAM_INVALID;
    else
        sig = abort_locked(c, j, status);
    pthread_mutex_unlock(&c->mu);
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
        /* nothing of it went out: a TCP job with no frame started, a mover job with no chunk claimed */
        out[n].flags = (j->tcp ? j->frames == 0 : j->cur_seg == 0 && j->cur_off == 0) ? KV_DONE_UNSTARTED : 0;
        n++;
        free(j);
    }
    if (!c->done_head)
        c->done_tail = NULL;
    int more = c->done_head != NULL;
    pthread_mutex_unlock(&c->mu);
    if (more)
        kv__signal_loop(c); /* the caller's buffer was too small: stay readable */
    return n;
}

void kv_core_close(kv_core *c) {
    pthread_mutex_lock(&c->mu);
    if (c->closed) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    c->closed = 1; /* from here no transport is registered: the array is read once */
    kv_transport *transports[KV_REGION_KINDS];
    memcpy(transports, c->transports, sizeof transports);
    pthread_mutex_unlock(&c->mu);
    for (int kind = 0; kind < KV_REGION_KINDS; kind++) /* their jobs complete ENGINE_FINALIZED (fenced) */
        if (transports[kind])
            transports[kind]->ops->stop(transports[kind]);
    pthread_mutex_lock(&c->mu);
    for (unsigned b = 0; b < KV_HASH_BUCKETS; b++) {
        kv_job *j = c->hash[b];
        while (j) {
            kv_job *next = j->hnext;
            if (!j->tcp && j->state == KV_JS_QUEUED) /* jobs on their last chunks finish normally */
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
    kv__signal_loop(c);
}

void kv_core_free(kv_core *c) {
    if (!c)
        return;
    kv_core_close(c);
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
        free(r->notify);
        free(r);
    }
    free(c->regions);
    free(c->lease_until);
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
