/* Internals shared by kv_core.c (regions, jobs, movers, completions) and
 * kv_tcp.c (the TCP data plane). Not part of the API: see kv_core.h. */
#ifndef KV_INTERNAL_H
#define KV_INTERNAL_H

#include <pthread.h>

#include "kv_core.h"

#define KV_MAX_MOVERS 64
#define KV_HASH_BUCKETS 4096u

typedef struct kv_job kv_job;

typedef struct {
    uint64_t addr;   /* LOCAL/PROCESS: address; TCP: the peer's region id */
    uint64_t len;
    int32_t pid;     /* PROCESS: peer pid; TCP: link id */
    int kind;
    unsigned flags;  /* KV_REGION_F_* */
    int removed;
    uint64_t refs;   /* jobs and frames using it */
    kv_job *notify;  /* preallocated KV_EVENT_REGION_FREED record (F_NOTIFY) */
} kv_region;

typedef struct {
    uint64_t src, dst, len; /* resolved addresses; for a TCP side: offset in the peer's region */
    int32_t pid;            /* PROCESS: peer pid; TCP: link id */
    uint32_t rrid;          /* TCP: the peer's region id */
    int8_t src_kind, dst_kind;
} kv_rseg;

struct kv_link;

struct kv_job {
    uint64_t id;
    kv_rseg *segs;
    size_t nsegs;
    uint32_t *regions; /* region refs held: 2 per segment */
    size_t cur_seg;    /* claim cursor */
    uint64_t cur_off;
    uint64_t done_bytes;
    uint64_t total;
    uint64_t rank;     /* TCP send order: lowest first */
    int active;        /* movers copying a chunk of this job */
    int claimed_all;   /* no more chunks to hand out (done, failed or aborted) */
    int queued;
    uint32_t status;   /* first failure, or the abort status */
    /* TCP jobs (owned by the I/O thread once handed over) */
    uint32_t link_id;
    int tcp, is_pull;
    int abort_req;     /* set under the lock by kv_core_abort */
    int abort_done;    /* the I/O thread has acted on it */
    uint64_t frames;   /* frames (DATA or READ) started on the wire */
    uint64_t *rbase;   /* TCP pull: chunks before each segment (nsegs + 1), from the I/O thread */
    uint32_t *rnext;   /* TCP pull: per chunk, the next byte an RDATA may answer */
    int acks_left;     /* ABORT_ACKs still awaited */
    int event;         /* an event record, not a job */
    struct kv_job *qnext, *qprev; /* mover queue, or the link's send queue */
    struct kv_job *hnext;         /* id hash chain */
    struct kv_job *dnext;         /* completion list, once finished */
    struct kv_job *inext;         /* I/O inbox */
    struct kv_job *anext, *aprev; /* I/O abort list */
    int alisted;
    int inbox;                    /* handed over, not yet taken by the I/O thread */
};

struct kv_net;

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

    kv_job *done_head, *done_tail; /* finished jobs and events not yet polled */

    struct kv_net *net; /* TCP data plane; NULL until first used */

    kv_stats st;
};

/* All of these need c->mu held. */
kv_region *kv__region_get(kv_core *c, uint32_t id);
void kv__region_ref(kv_core *c, uint32_t id);
void kv__region_unref(kv_core *c, uint32_t id);
kv_job *kv__job_find(kv_core *c, uint64_t id);
void kv__job_hash(kv_core *c, kv_job *j);
/* Unhash `j`, drop its region refs and append it to the completion list with
 * `status`. Returns 1 if the eventfd must be signalled (after unlocking). */
int kv__job_complete(kv_core *c, kv_job *j, uint32_t status);
/* Append an event record (preallocated; never freed by poll if it is reused). */
int kv__post_event(kv_core *c, kv_job *ev);
void kv__signal_loop(kv_core *c);
/* Into a qnext/qprev queue by rank, after the jobs of equal rank (FIFO among
 * them): the movers' queue, a TCP link's send queue. Usually at the tail. */
void kv__rank_insert(kv_job **head, kv_job **tail, kv_job *j);
/* Out of such a queue; returns 0 if `j` was not queued. */
int kv__queue_remove(kv_job **head, kv_job **tail, kv_job *j);

/* kv_tcp.c, called by kv_core.c with c->mu held */
uint32_t kv__tcp_submit(kv_core *c, kv_job *j); /* hand a TCP job to the I/O thread */
void kv__tcp_abort(kv_core *c, kv_job *j);
/* called without the lock */
void kv__tcp_close(kv_core *c);
void kv__tcp_free(kv_core *c);

#endif
