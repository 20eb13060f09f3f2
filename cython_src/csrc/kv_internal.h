/* Internals shared by kv_core.c (regions, jobs, movers, completions) and
 * kv_tcp.c (the TCP data plane). Not part of the API: see kv_core.h. */
#ifndef KV_INTERNAL_H
#define KV_INTERNAL_H

#include <pthread.h>

#include "kv_core.h"

#define KV_MAX_MOVERS 64
#define KV_HASH_BUCKETS 4096u

typedef struct kv_event kv_event;         /* below */
typedef struct kv_job kv_job;
typedef struct kv_transport kv_transport; /* below */

/* One duplicate of a peer's pidfd, shared by the regions given the same key
 * (a link's CMA regions: one descriptor per link, not per region). */
typedef struct kv_pidref {
    uint64_t key;
    int fd;
    uint64_t refs; /* regions holding it */
    struct kv_pidref *next;
} kv_pidref;

typedef struct {
    uint64_t addr;   /* LOCAL/PROCESS: address; TCP: the peer's region id */
    uint64_t len;
    int32_t pid;     /* PROCESS: peer pid; TCP: link id */
    int kind;
    unsigned flags;  /* KV_REGION_F_* */
    int removed;
    uint64_t refs;   /* jobs and frames using it */
    kv_pidref *pidref; /* PROCESS: the peer's pidfd (kv_region_pidfd), released with the region; NULL: none */
    kv_event *freed_event; /* F_NOTIFY: posted (KV_EVENT_REGION_FREED) when it is released */
} kv_region;

/* One segment of a job, resolved at submit: `rows` rows of `len` bytes, row r
 * at src + r * src_stride and dst + r * dst_stride (1-D: rows 1). Claim
 * cursors (kv_job.claim_offset) count bytes in row order: kv_seg_bytes() in all. */
typedef struct {
    uint64_t src, dst, len;  /* resolved addresses; for a transport side: offset in the peer's region; len: of a row */
    uint64_t rows, src_stride, dst_stride;
    int32_t pid;             /* PROCESS: peer pid; transport (TCP): link id */
    int pidfd;               /* PROCESS: a pidfd of that process (kv_region_pidfd), or -1 */
    uint32_t remote_region;  /* transport side: the peer's region id */
    int8_t src_kind, dst_kind;
} kv_segment;

static inline uint64_t kv_seg_bytes(const kv_segment *s) { return s->len * s->rows; }

/* The contiguous run of segment `s` at byte `off` (row order) of at most `max`
 * bytes: its source and destination (addresses or remote offsets); returns its
 * length (the rest of that row, or max). */
static inline uint64_t kv_seg_run(const kv_segment *s, uint64_t off, uint64_t max, uint64_t *src, uint64_t *dst) {
    uint64_t row = s->rows > 1 ? off / s->len : 0, col = off - row * s->len, n = s->len - col;
    *src = s->src + row * s->src_stride + col;
    *dst = s->dst + row * s->dst_stride + col;
    return n < max ? n : max;
}

/* ---- records: what the completion list holds. Every record starts with a
 * kv_record: an event is nothing more; a job is a kv_job, itself first in its
 * kind's struct (kv_mover_job here, kv_tcp_job in kv_tcp.c), so kv_core_poll
 * frees any record with one free(). */

enum {
    KV_RECORD_EVENT = 1,     /* kv_event */
    KV_RECORD_MOVER_JOB,     /* kv_mover_job: local and process (CMA) copies */
    KV_RECORD_TRANSPORT_JOB, /* a transport's job (kv_job.transport) */
    KV_RECORD_ABANDONED,     /* kv_event: a mover job kv_core_reap completed for the caller */
};

typedef struct kv_record {
    uint64_t id;       /* a job id (below 2**63), or KV_EVENT_* | id */
    int kind;          /* KV_RECORD_* */
    uint32_t status;   /* a job's first failure or abort status; LINK_DOWN: why */
    struct kv_record *done_next; /* completion list, once posted */
} kv_record;

/* Link ready/down, region freed: allocated with what it reports on, so posting
 * it cannot fail; posted at most once, freed by kv_core_poll. */
struct kv_event {
    kv_record record;
};

/* Job states (kv_job.state), one per job. Transport (TCP) jobs: INBOX ..
 * FENCING, then DONE; the I/O thread owns every transition except INBOX ->
 * DONE and INBOX/SENDING/SENT -> ABORT_REQ (kv_core_abort). Mover jobs: QUEUED
 * -> DRAINING -> DONE, under c->lock. */
enum {
    KV_JS_INBOX = 1, /* handed to the I/O thread, not yet taken: no frame of it exists */
    KV_JS_SENDING,   /* in the link's send queue: frames (DATA or READ) being claimed */
    KV_JS_SENT,      /* every frame claimed: push awaits its ACK, pull its RDATA */
    KV_JS_ABORT_REQ, /* kv_core_abort asked; the I/O thread has not acted yet */
    KV_JS_ABORTING,  /* push: ABORT queued on every stream, ABORT_ACKs awaited until `due` */
    KV_JS_FENCING,   /* push: its link failed unfenced; completes at `due` (the lease release) */
    KV_JS_QUEUED,    /* mover job: in the movers' queue, chunks left to claim */
    KV_JS_DRAINING,  /* mover job: nothing more to claim (all claimed, failed or aborted); completes
                        when the last chunk in progress (`chunks_active`) ends: the fence */
    KV_JS_DONE       /* completed (posted) */
};

/* What every job has, whoever moves its bytes. Live jobs are in the id hash
 * and hold a reference on both regions of each segment until they complete. */
struct kv_job {
    kv_record record;         /* first */
    kv_transport *transport;  /* KV_RECORD_TRANSPORT_JOB: the transport that owns it; else NULL */
    kv_segment *segments;
    size_t nsegments;
    uint32_t *region_refs;    /* region refs held: 2 per segment */
    size_t claim_segment;     /* claim cursor: the next chunk (mover) or frame (TCP) starts here; */
    uint64_t claim_offset;    /*  claim_segment == nsegments: every one claimed */
    uint64_t bytes_done;      /* bytes in place at the destination */
    uint64_t total_bytes;
    uint64_t rank;            /* queue order: lowest first (equal ranks FIFO) */
    int state;                /* KV_JS_* */
    int queued;               /* in a rank queue (the movers' or a TCP link's send queue) */
    kv_job *queue_next, *queue_prev; /* that queue */
    kv_job *hash_next;        /* id hash chain */
};

/* A job the movers copy. */
typedef struct kv_mover_job {
    kv_job job;         /* first */
    uint32_t lease;     /* mover lease (kv_lease_add), 0: none */
    int chunks_active;  /* movers copying a chunk of it now */
    int abandoned;      /* kv_core_reap completed it for the caller (LINK_FAILED) while a
                           chunk of it was still inside its copy: its own completion, once
                           that copy returns, is of an id the caller no longer knows */
    uint64_t claimed;   /* bytes claimed so far */
    int paired;         /* a head-split pair's second job (kv_core.c pairable): copied in one
                           pass with job `pair_id` while that one is right before it in the queue */
    uint64_t pair_id;
} kv_mover_job;

/* A mover thread's slot. A mover whose chunk stays inside its copy (a CMA page of
 * the peer held by userfaultfd, or swapped out) longer than kv_core_reap's bound is
 * retired: the core stops counting on it (a fresh mover takes its place) and it
 * exits when its copy returns. */
typedef struct kv_mover {
    kv_core *core;
    pthread_t thread;
    kv_mover_job *job; /* whose chunk it copies now, or NULL */
    kv_mover_job *job2; /* ...and the same chunk of the second job of a head-split pair, or NULL */
    uint64_t since_ns; /* CLOCK_BOOTTIME when that chunk began */
    uint64_t busy_ns;  /* when its last chunk ended (0: polled since) */
    int retired;       /* reaped (detached): exits after its copy, replaced */
    int running;       /* the thread has not returned from mover_main yet */
    int landing;       /* copying a CMA pull's bytes from `bounce` into place (ours, not held) */
    uint8_t *bounce;   /* CMA pulls read into this first (KV_BOUNCE_BYTES), lazily allocated */
} kv_mover;

#define KV_REGION_KINDS 4 /* KV_REGION_LOCAL, _PROCESS, _TCP, _UCX */
#define KV_UCX_MAX_BLOB 16384 /* a worker address from a peer: at most this */

struct kv_core {
    pthread_mutex_t lock;          /* guards everything below and every job */
    pthread_cond_t work_ready;     /* movers wait here for a job or stopping */
    pthread_cond_t mover_exit;     /* a mover returned (kv_core_close waits, bounded) */
    kv_mover movers[KV_MAX_MOVERS]; /* slots; a retired mover keeps its slot until the engine is freed */
    int nmovers;                   /* slots used */
    int stopping;
    int closed;
    int event_fd;                  /* readable when completions are ready */
    uint64_t chunk_bytes;          /* most a mover copies (or a TCP frame carries) at once */

    kv_region **regions; /* index = id; NULL once released */
    kv_pidref *pidrefs;  /* every live pidref */
    size_t nregions;     /* next id */
    size_t region_cap;

    kv_job *mover_queue_head, *mover_queue_tail; /* mover jobs with chunks to claim, by rank */
    uint64_t mover_queued;         /* mover jobs queued so far (atomic: a polling mover reads it) */
    int movers_polling;            /* movers in their poll after a chunk: each looks at the queue
                                      again, under the lock, before it sleeps */
    kv_job *jobs_by_id[KV_HASH_BUCKETS]; /* every live job */

    kv_record *done_head, *done_tail; /* finished jobs and events not yet polled */
    uint64_t posted;                  /* records posted so far (atomic: kv_core_wait_take) */
    uint64_t take_job;                /* kv_core_wait_take waits for this job's completion (0: none):
                                         posting it does not signal the eventfd */

    kv_transport *transports[KV_REGION_KINDS]; /* by region kind; NULL until first used */

    uint64_t *lease_until; /* mover leases: index = id (0 unused); 0 once removed */
    size_t nleases, lease_cap;

    kv_stats stats;
};

/* All of these need c->lock held. */
kv_region *kv__region_get(kv_core *c, uint32_t id);
void kv__region_ref(kv_core *c, uint32_t id);
void kv__region_unref(kv_core *c, uint32_t id);
kv_job *kv__job_find(kv_core *c, uint64_t id);
void kv__job_hash(kv_core *c, kv_job *j);
/* Unhash `j`, drop its region refs and append it to the completion list with
 * `status` (unless it failed already). Its transport frees what it added first.
 * Returns 1 if the eventfd must be signalled (after unlocking). */
int kv__job_complete(kv_core *c, kv_job *j, uint32_t status);
/* Append an event to the completion list (no allocation: it cannot be lost).
 * Returns 1 if the eventfd must be signalled. */
int kv__post_event(kv_core *c, kv_event *ev);
void kv__signal_loop(kv_core *c);
/* kv_core_wait_take, calling `drive(arg)` (which returns nonzero if it made progress)
 * instead of only spinning while the completion has not come: a transport that lets
 * the waiting thread make its job's progress itself (kv_ucx_drive). */
int kv__wait_take_driving(kv_core *c, uint64_t job_id, uint64_t bound_ns, kv_completion *out,
                          int (*drive)(void *), void *arg);
/* Try `m` for at most `bound_ns`, spinning (a driver taking its transport's lock from the
 * I/O thread, which holds it a round at a time): 1 if taken. */
int kv__trylock_within(pthread_mutex_t *m, uint64_t bound_ns);
/* Into a queue_next/queue_prev queue by rank, after the jobs of equal rank (FIFO among
 * them): the movers' queue, a TCP link's send queue. Usually at the tail. */
void kv__rank_insert(kv_job **head, kv_job **tail, kv_job *j);
/* Out of such a queue; returns 0 if `j` was not queued. */
int kv__queue_remove(kv_job **head, kv_job **tail, kv_job *j);

/* ---- transports: the data planes of regions the movers cannot reach (a peer's
 * memory over the network: KV_REGION_TCP). A transport fills in its ops and
 * registers itself with the core (kv__transport_register, on first use); the
 * core calls it only through them. Transport -> core goes through the
 * functions above. */

typedef struct kv_transport_ops {
    size_t job_size; /* its job struct: a kv_job first */
    /* Take over job `j`, job_size bytes zeroed with the kv_job filled in (its
     * segments all name regions of this transport, on one link): hash it
     * (kv__job_hash) and start it. A failure status leaves `j` as it was: the
     * core releases it. c->lock held. */
    uint32_t (*submit)(kv_transport *t, kv_job *j);
    /* Abort a job it owns with `status`: KV_LLM_SUCCESS (*signal: the eventfd
     * must be signalled after unlocking), or KV_LLM_PARAM_INVALID if it is past
     * being aborted (its completion is on its way). c->lock held. */
    uint32_t (*abort)(kv_transport *t, kv_job *j, uint32_t status, int *signal);
    /* Stop taking work and complete every job it owns (fenced: may wait for a
     * lease release); returns once that is done. No lock held; kv_core_close,
     * after the core refuses new work. */
    void (*stop)(kv_transport *t);
    /* Free everything it holds; kv_core_free, after stop. No lock held. */
    void (*destroy)(kv_transport *t);
    /* Optional: region `id` (this process's memory) is being released: forget
     * any registration of it (UCX: ucp_mem_unmap). c->lock held. */
    void (*region_freed)(kv_transport *t, uint32_t id);
    /* KV_T2D_*: which jobs it takes with 2-D segments (rows > 1). The core
     * expands the 2-D segments of any other job into 1-D rows at submit. */
    unsigned seg2d;
    /* Optional, for a pull not in seg2d: does it take this pull's 2-D segments
     * (`rs`, its region on the source side) as they are? c->lock held. */
    int (*pull_2d)(kv_transport *t, const kv_segment *rs, size_t nsegs);
} kv_transport_ops;

#define KV_T2D_PUSH 1u /* its region is the destination */
#define KV_T2D_PULL 2u /* its region is the source */

/* Embedded first in the transport's own state. */
struct kv_transport {
    const kv_transport_ops *ops;
};

/* The transport of regions of `kind`, registered once (caller holds c->lock),
 * or NULL if none has been started. */
void kv__transport_register(kv_core *c, int kind, kv_transport *t);
kv_transport *kv__transport_get(kv_core *c, int kind);

#endif
