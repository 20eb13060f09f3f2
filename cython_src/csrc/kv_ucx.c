/* kvengine UCX data plane: UCP active messages checked by the target, driven from C.
 *
 * One I/O thread per core owns the UCP worker and every endpoint; it sleeps in
 * epoll on the worker's event fd and its own wake eventfd. API calls that need
 * the worker (endpoint creation) are commands the thread runs while the caller
 * waits; jobs reach it through an inbox, like kv_tcp.c.
 * A target's staged push payloads land on a landing thread (land_main), so
 * that the landing overlaps the next receive; the I/O thread settles them
 * (one of at most UCX_LAND_INLINE_MAX with nothing of its link to overlap it
 * lands on the I/O thread: the hand-offs would cost more than the copy).
 *
 * Nothing is one-sided (docs/decisions.md #27): the UCP context has no RMA
 * feature and no rkey is ever packed for a peer. A push is one active message
 * (ucp_am_send_nbx, UCP_AM_SEND_FLAG_RNDV above UCX_EAGER_MAX bytes, or above
 * UCX_SHM_ZC_EAGER_MAX where the AM lane is shared memory and there is also a
 * zero-copy lane: push_rndv) per chunk,
 * each with a kv_ucx_hdr naming the TARGET's region, offset and length; the
 * target's handler (am_recv) finds the link by the header's token, checks the
 * header against its own region table (kv_ucx_check: exported regions of its
 * own caches only, overflow-safe bounds) and only then copies the eager payload
 * into place or receives the rendezvous payload straight into it
 * (ucp_am_recv_data_nbx). A bad header fails the link (ucx_bad_msgs), a
 * header with an unknown token is dropped (ucx_refused); neither writes. The
 * target ACKs a push once all of its bytes landed. A pull is PULL_REQ messages
 * (PULL_REQ2D for whole rows apart at the source, to a peer that serves them;
 * the source checks them the same way) answered by PULL_DATA, which the
 * requester writes only into the destination of the pull request it has
 * outstanding under that tag (the header picks the request, never an address).
 *
 * Abort: a push stops posting and sends ABORT; the target marks the job
 * aborted (a tombstone: later data of it is dropped), waits for its rendezvous
 * receives in progress and answers ABORT_ACK; the push completes then (and
 * once its own sends ended). A pull abort drops the requests (late answers
 * are discarded) and completes once no receive of it is in progress. No
 * ABORT_ACK within `fence_ns` fails the link. A link that failed (close
 * command, endpoint error, stop) writes nothing more: the handler drops every
 * message whose token names a dead link. The lease (tcp's rule): a target
 * writes a push's message only before (when it sent the LEASE_REQ the pusher
 * answered last) + lease_ns, asking every lease_ns / 4; a push of a failed link
 * that was not fenced completes at (our last grant) + lease_ns + margin_ns.
 * What holds on each fabric: docs/protocol.md, "UCX links". */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kv_internal.h"

typedef struct kv_ucx kv_ucx;

#include <stdlib.h>
#include <string.h>

/* The header check, without UCX: a pure function of the header, the payload
 * length and this core's region table (caller holds c->lock). */
uint32_t kv_ucx_check(kv_core *c, const void *hdr, size_t hdr_len, const void *data, uint64_t data_len,
                      kv_ucx_hdr2d *out, uint64_t *addr) {
    kv_ucx_hdr2d g;
    kv_ucx_hdr h;
    if (!hdr || hdr_len < sizeof h)
        return KV_LLM_PARAM_INVALID;
    memcpy(&h, hdr, sizeof h); /* the transport's buffer need not be aligned */
    int vec = h.type == KV_UCX_PULL_REQV || h.type == KV_UCX_PUSHV; /* of rows with the 2-D header, else of runs */
    int two = h.type == KV_UCX_PUSH2D || h.type == KV_UCX_PULL_REQ2D || (vec && hdr_len == sizeof g);
    if (hdr_len != (two ? sizeof g : sizeof h))
        return KV_LLM_PARAM_INVALID;
    if (two) {
        memcpy(&g, hdr, sizeof g);
    } else {
        g.h = h;
        g.row_len = g.dst_stride = h.len; /* one row */
    }
    *out = g;
    *addr = 0;
    uint64_t extent = h.len; /* the bytes from offset on that the message covers in the region */
    switch (h.type) {
    case KV_UCX_PUSH:
        if (h.len == 0 || h.len != data_len || h.total < h.len)
            return KV_LLM_PARAM_INVALID;
        break;
    case KV_UCX_PUSH2D:
        if (h.len == 0 || h.len != data_len || h.total < h.len)
            return KV_LLM_PARAM_INVALID;
        break;
    case KV_UCX_PULL_REQ:
        if (h.len == 0 || data_len != 0 || h.len > KV_UCX_MAX_PULL)
            return KV_LLM_PARAM_INVALID;
        break;
    case KV_UCX_PULL_REQ2D:
        if (h.len == 0 || data_len != 0 || h.len > KV_UCX_MAX_PULL2D)
            return KV_LLM_PARAM_INVALID;
        break;
    case KV_UCX_PULL_REQV: /* its list, checked below once the region is known; offset 0 */
        if (h.len == 0 || h.len > KV_UCX_MAX_PULL2D || h.offset || !data || data_len % sizeof(kv_ucx_piece) ||
            data_len < 2 * sizeof(kv_ucx_piece) || data_len > KV_UCX_MAX_PIECES * sizeof(kv_ucx_piece))
            return KV_LLM_PARAM_INVALID;
        extent = 0;
        break;
    case KV_UCX_PUSHV: /* h.tag pieces listed before the data; the list checked below where it is
                        * here (eager; a rendezvous one's once received: recv_done) */
        if (h.len == 0 || h.len > KV_UCX_MAX_PULL2D || h.total < h.len || h.tag < 2 || h.tag > KV_UCX_MAX_PIECES ||
            data_len != h.tag * sizeof(kv_ucx_piece) + h.len)
            return KV_LLM_PARAM_INVALID;
        extent = 0;
        break;
    case KV_UCX_PULL_DATA:
        return h.len != 0 && h.len == data_len && h.region == 0 ? KV_LLM_SUCCESS : KV_LLM_PARAM_INVALID;
    case KV_UCX_ACK:
    case KV_UCX_ABORT:
    case KV_UCX_ABORT_ACK:
    case KV_UCX_LEASE_REQ:
    case KV_UCX_LEASE:
        return data_len == 0 && h.len == 0 && h.region == 0 ? KV_LLM_SUCCESS : KV_LLM_PARAM_INVALID;
    default:
        return KV_LLM_PARAM_INVALID;
    }
    if (two && (g.row_len == 0 || g.dst_stride < g.row_len))
        return KV_LLM_PARAM_INVALID;
    if (two && !vec) { /* whole rows; the last one ends at (rows - 1) * dst_stride + row_len, or past any region */
        if (h.len % g.row_len != 0 || (h.len / g.row_len - 1) > (UINT64_MAX - g.row_len) / g.dst_stride)
            return KV_LLM_PARAM_INVALID;
        extent = (h.len / g.row_len - 1) * g.dst_stride + g.row_len;
    }
    /* PUSH, PUSH2D, PUSHV, PULL_REQ, PULL_REQ2D, PULL_REQV: one of our own exported regions, every byte inside it */
    kv_region *rg = kv__region_get(c, h.region);
    if (!rg || rg->removed || rg->kind != KV_REGION_LOCAL || !(rg->flags & KV_REGION_F_EXPORT))
        return KV_LLM_KV_CACHE_NOT_EXIST;
    if (h.offset > rg->len || extent > rg->len - h.offset)
        return KV_LLM_PARAM_INVALID;
    if (vec && data) { /* every piece inside the region (of rows: whole rows, the last one inside), none
                        * empty, adding up to len; a PUSHV's first piece at offset */
        int push = h.type == KV_UCX_PUSHV;
        kv_ucx_piece p0;
        memcpy(&p0, data, sizeof p0);
        if (!kv_pieces_ok(data, push ? h.tag : data_len / sizeof(kv_ucx_piece), rg->len, h.len,
                          two ? g.row_len : 0, g.dst_stride, UINT64_MAX) ||
            (push && p0.offset != h.offset))
            return KV_LLM_PARAM_INVALID;
    }
    *addr = rg->addr + h.offset;
    return KV_LLM_SUCCESS;
}

#ifndef KV_HAVE_UCX

/* Built without UCX: every call says so (the parameters are unused on purpose). */
int kv_ucx_available(void) { return 0; }
uint32_t kv_ucx_address(kv_core *c, uint8_t *out, size_t *len) {
    (void)c, (void)out, (void)len;
    return KV_LLM_FEATURE_NOT_ENABLED;
}
uint32_t kv_ucx_mem_map(kv_core *c, uint32_t region_id) {
    (void)c, (void)region_id;
    return KV_LLM_FEATURE_NOT_ENABLED;
}
uint32_t kv_ucx_link_add(kv_core *c, uint32_t link_id, const uint8_t *addr, size_t len, const uint8_t *rx_token,
                         const uint8_t *tx_token, uint64_t window, uint64_t lease_ns, uint64_t fence_ns,
                         uint64_t margin_ns, unsigned peer_flags) {
    (void)c, (void)link_id, (void)addr, (void)len, (void)rx_token, (void)tx_token, (void)window, (void)fence_ns;
    (void)lease_ns, (void)margin_ns, (void)peer_flags;
    return KV_LLM_FEATURE_NOT_ENABLED;
}
uint32_t kv_ucx_link_close(kv_core *c, uint32_t link_id, uint32_t status) {
    (void)c, (void)link_id, (void)status;
    return KV_LLM_FEATURE_NOT_ENABLED;
}
uint32_t kv_ucx_test_send(kv_core *c, uint32_t link_id, const uint8_t *hdr, size_t hdr_len, const uint8_t *data,
                          size_t data_len, int rndv) {
    (void)c, (void)link_id, (void)hdr, (void)hdr_len, (void)data, (void)data_len, (void)rndv;
    return KV_LLM_FEATURE_NOT_ENABLED;
}
int kv_ucx_submit_driven(kv_core *c, uint64_t job_id, const uint64_t *segs, size_t nsegs, uint32_t lease,
                         uint64_t bound_ns, kv_completion *out, uint32_t *status) {
    (void)c, (void)job_id, (void)segs, (void)nsegs, (void)lease, (void)bound_ns, (void)out;
    *status = KV_LLM_FEATURE_NOT_ENABLED;
    return -1;
}

#else

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <stdarg.h>
#include <ucp/api/ucp.h>

/* UCX's log handler chain, from ucs/debug/log_def.h (not includable under -std=c99:
 * the headers it pulls in use `asm`): a handler returns STOP (0) or CONTINUE (1). */
typedef enum { KV_UCS_LOG_STOP, KV_UCS_LOG_CONTINUE } kv_ucs_log_rc;
typedef kv_ucs_log_rc (*kv_ucs_log_func)(const char *file, unsigned line, const char *function,
                                         ucs_log_level_t level, const ucs_log_component_config_t *comp_conf,
                                         const char *message, va_list ap);
void ucs_log_push_handler(kv_ucs_log_func handler);

#define UCX_TICK_NS 100000000ull  /* timers are looked at least this often */
#define UCX_BUSY_TICK_MS 1        /* while requests are outstanding: progress at least every 1 ms */
#define UCX_SPIN_NS 200000ull     /* keep progressing this long after activity before sleeping */
#define UCX_DRIVE_LOCK_NS 50000ull /* a driver waits this long at most for the worker */
#define UCX_DRIVE_YIELD 32        /* a driver yields its CPU after this many empty progress calls */
#define UCX_DRIVE_SKIPS 4         /* ...and runs its round at least every this many ticks */
#define UCX_DRIVE_QUIET_NS 250000ull /* the I/O thread leaves the worker to the loop thread's drives
                                      * this long after the last: what a message for us waits at most
                                      * meanwhile (a drive progresses the worker: its own wait is less) */
#define UCX_QUIET_MIN_NS 20000ull    /* ...and sleeps at least this long at a time meanwhile */
#define UCX_CLOSE_WAIT_NS 2000000000ull /* stop: the most a forced close is waited for */
#define UCX_CLOSE_PIECE_WAIT_NS 50000000ull /* kv_ucx_link_close waits this long at most for a piece */
#define UCX_AM_ID 7               /* our one active message id */
#define UCX_PARKED_MAX 64         /* endpoints of closed links kept for the next link to their peer */
#ifdef KV_TEST_HOOKS
unsigned kv_test_parked_max = UCX_PARKED_MAX; /* tests/native only: a smaller limit, to reach the eviction */
#define PARKED_MAX kv_test_parked_max
#else
#define PARKED_MAX UCX_PARKED_MAX
#endif
#define UCX_RNDV_MIN (64u << 10)  /* pull answers from this size go rendezvous */
#define UCX_EAGER_MAX (64u << 10) /* push messages up to this size (one layer) go eager: copied in by the
                                   * handler, no rendezvous round trip, staging or landing thread; over
                                   * tcp that takes segments that hold one (UCX_TCP_SEG) */
#define UCX_SHM_ZC_EAGER_MAX (32u << 10) /* ...but only up to this where the AM lane is shared memory and
                                          * there is a zero-copy lane (cma, knem, xpmem): a larger message
                                          * is read by the target from the pusher's memory in one copy,
                                          * where an eager one is copied into UCX's FIFO and out of it
                                          * again, across the CPUs (a one-layer push driven by the loop
                                          * thread: 12.3 -> 9.7-10.0 us p50) */
#define UCX_TCP_SEG "72K" /* UCX's tcp segments (UCX_TCP_TX_SEG_SIZE / RX_SEG_SIZE, 8K / 64K by
                           * default) unless the environment sets them: an eager push message of
                           * UCX_EAGER_MAX and its headers in one segment, one send (a one-layer
                           * push over UCX_TLS=tcp: p50 52-56 -> 30 us; in 8 KiB fragments 45) */
#define UCX_RX_MAX 65536          /* push states a target keeps per link (live + tombstones) */
#define UCX_TOMBSTONES 4096       /* aborted pushes remembered per link (oldest forgotten first) */
#define UCX_RX_BUCKETS 64
#define UCX_LAND_PIECE (1u << 20)        /* a push payload lands in pieces of this, the lease checked before each */
#define UCX_LAND_IOV 1024                /* the most rows one landing piece writes (one preadv / process_vm_writev) */
#define UCX_SEND2D_MAX (256u << 10)      /* a push's rows of a 2-D segment go in PUSH2D messages of at most this
                                          * (rows of up to half of it; longer rows go as PUSH each), packed by
                                          * the I/O thread under the core's lock */
#define UCX_PUSHV_PIECE_MAX (256u << 10) /* push segments of up to this go several to a PUSHV, packed by the
                                           * I/O thread (larger ones: a PUSH each, zero copy) */
#define UCX_LAND_INLINE_MAX (64u << 10)  /* a staged payload up to this size, with no other receive of its link
                                          * in progress, lands on the I/O thread (one piece): the two thread
                                          * hand-offs cost more than its copy, and nothing would overlap it */
#define UCX_PICK_MIN (256u << 10)        /* staged pieces from this size choose their way (land_how) */
#define UCX_PICK_PROBE 32                /* every this many pieces, the other way is timed again */
#define UCX_STAGE_CACHE (32ull << 20)    /* staging buffers kept for reuse, per core */
#define UCX_STAGE_NO_WINDOW (64ull << 20) /* a link's staging budget when it has no window */

typedef struct ucx_link ucx_link;
typedef struct ucx_job ucx_job;
typedef struct ucx_op ucx_op;

/* A staging buffer: a rendezvous payload is received here, not into place, and
 * copied into place only under the lease (docs/decisions.md #29). */
typedef struct ucx_stage {
    void *buf;
    size_t cap;
    size_t skew;            /* the payload starts here in `buf` (and in the memfd): its destination's
                               offset in a page (stage_get) */
    int fd;                 /* the memfd `buf` maps (landed with pread), or -1 */
    int mapped;             /* `buf` is a mapping (of the memfd, closed once released), not malloc's */
    int live;               /* counted in ucx_stage_bytes: a receive holds it */
    int released;           /* an orphan's: its memory given back (stage_release), never reused */
    struct ucx_stage *next; /* the core's free list */
} ucx_stage;

/* One of our exported regions, mapped once (ucp_mem_map) so that messages from
 * and into it are zero copy: its memh goes into the nbx params. */
typedef struct ucx_local {
    uint32_t region_id;
    uint64_t addr, len;
    ucp_mem_h memh;
    struct ucx_local *next;
} ucx_local;

struct ucx_job {
    kv_job job;          /* first */
    uint32_t link_id;
    ucx_link *link;      /* set when the I/O thread takes it */
    int is_pull;
    int ops_pending;     /* push: sends not complete; pull: requests not answered (or receives in progress) */
    uint64_t posted;     /* bytes posted */
    int acked;           /* push: the target's ACK (every byte landed) */
    int driven;          /* in the inbox for its driver (kv_ucx_submit_driven): the round leaves it there */
    int abort_state;     /* push: 0, 1 ABORT to send, 2 sent, 3 ABORT_ACK received */
    uint64_t due;        /* ABORTING: the fence deadline */
    struct ucx_job *next, *prev; /* inbox (INBOX), else its link's active list */
};

/* A pull request we sent (requester side): its answer goes to `dst` only. */
typedef struct ucx_pull {
    uint64_t tag;
    ucx_job *job;        /* NULL once dropped (its job aborted or failed): the answer is discarded */
    uint64_t dst, len;
    uint64_t row, stride; /* the answer's rows of `row` bytes land `stride` apart from dst (1-D: both len) */
    uint32_t region;     /* our destination region (its memh) */
    int receiving;       /* a rendezvous receive into dst is in progress */
    struct ucx_pull *next;
    uint32_t npieces;    /* a PULL_REQV's: the answer lands in these, in order (offset: our address) */
    kv_ucx_piece pieces[];
} ucx_pull;

/* A push we are the target of (per link, by the pusher's job id). */
typedef struct ucx_rx {
    uint64_t job, total, claimed, landed; /* claimed: bytes of messages accepted (landed or being received) */
    int receiving;       /* rendezvous receives in progress */
    int aborted;         /* tombstone: data of it is dropped; ABORT_ACK once receiving == 0 */
    int ack_owed;
    struct ucx_rx *next; /* bucket chain */
    struct ucx_rx *tnext; /* tombstone FIFO */
} ucx_rx;

struct ucx_link {
    kv_ucx *u;            /* its engine's (for close_done) */
    uint32_t id;
    int dead;
    int refused;          /* kv_ucx_link_close was called (under c->lock): nothing of it lands any more */
    int closing;          /* 1: close request outstanding, 2: closed (ep gone) */
    int peer_errors;      /* UCP_ERR_HANDLING_MODE_PEER (a forced close is allowed) */
    int shm_am;           /* the endpoint has a shared-memory transport (its AM lane) */
    int shm_zc;           /* ...and a zero-copy one for rendezvous (cma, knem, xpmem): UCX_SHM_ZC_EAGER_MAX */
    int peer_pull2d;      /* the peer answers PULL_REQ2D (KV_UCX_PEER_PULL2D): ucx_pull_2d */
    int peer_pullv;       /* the peer answers PULL_REQV (KV_UCX_PEER_PULLV) */
    int peer_pushv;       /* the peer takes PUSHV (KV_UCX_PEER_PUSHV) */
    ucp_ep_h ep;
    uint64_t peer_uid;    /* the peer's worker (its address's uid): an endpoint parked for it is reused */
    uint8_t rx_token[KV_UCX_TOKEN]; /* what the peer's headers must carry */
    uint8_t tx_token[KV_UCX_TOKEN]; /* what ours carry */
    uint64_t window, fence_ns;
    uint64_t inflight, pull_inflight; /* push bytes posted and not done (the peer stages them), and
                                         pull bytes asked for and not landed (we stage them): each
                                         kept to the window on its own */
    /* the lease (docs/protocol.md, "UCX links"): as a target we write a push's
     * bytes only before lease_until (our clock), set from the time we asked for
     * the grant; as a pusher, last_grant is when we last granted one */
    uint64_t lease_ns, margin_ns, lease_until, last_grant, next_lease_req;
    uint64_t lease_seq;                 /* our last LEASE_REQ */
    uint64_t lease_asked[8];            /* when we sent LEASE_REQ seq (by seq % 8) */
    uint64_t lease_seen;                /* the highest seq granted */
    int peer_leased;                    /* the peer said (in a LEASE_REQ) that it holds a grant of ours */
    kv_job *send_head, *send_tail; /* pushes with chunks left to post, by rank */
    kv_job *pull_head, *pull_tail; /* pulls with chunks left to ask for, by rank */
    ucx_job *active;      /* jobs taken off the inbox and not complete */
    ucx_pull *pulls;      /* our pull requests outstanding */
    uint64_t next_tag;
    ucx_rx *rx[UCX_RX_BUCKETS];
    size_t nrx, ntomb;
    ucx_rx *tomb_head, *tomb_tail;
    int rx_ops;           /* receives into our memory in progress, and sends from it (PULL_DATA) */
    ucx_op *sends;        /* push sends not complete */
    ucx_op *recvs;        /* rendezvous receives into staging in progress */
    ucx_op *defer_head, *defer_tail; /* rendezvous messages waiting for staging (UCX keeps them) */
    uint64_t staged;      /* bytes of staging the receives in progress use */
    kv_event *down_event;
    uint32_t down_status;
    struct ucx_link *next;
};

/* Per-request context of a data send or a receive. */
struct ucx_op {
    kv_ucx *u;
    ucx_link *link;
    ucx_job *job;        /* push send: its job */
    ucx_pull *pull;      /* PULL_DATA receive: its request */
    ucx_rx *rx;          /* push receive: the push's state */
    uint32_t region;     /* a region ref held for the request (0: none) */
    int landing;         /* push receive, received: 1 queued for the landing thread, 2 being landed by
                          * it, 3 landed in part, 4 every byte landed (3, 4: waiting for the round,
                          * land_drain); 0 otherwise */
    uint64_t len;
    uint64_t dst;        /* receive: where the payload lands (checked by am_recv): its first row */
    uint64_t row, stride; /* push receive: the payload's rows (row bytes each, landing stride apart; 1-D: len;
                           * a PUSHV's: its pieces' rows, row 0 for pieces of one run each) */
    uint64_t vlist;      /* push receive of a PUSHV: the bytes of the list its payload begins with (else 0) */
    uint64_t base, rlen; /* ...and its region's address and bytes (the list's offsets are in it) */
    ucx_stage *stage;    /* receive: where UCX writes it */
    union {
        void *desc;      /* receive waiting for staging: UCX's descriptor of the message */
        struct ucx_op *qnext; /* landing 1: the landing queue; 3, 4: the done list (posted: desc unused) */
    };
    union {
        kv_ucx_hdr hdr;      /* a send's header (valid until the send completes) */
        kv_ucx_hdr2d hdr2;   /* a PUSH2D's (its rows packed after the op: a push of a 2-D segment's rows) */
    };
    struct ucx_op *lnext, *lprev; /* push sends: the link's list (job NULL once detached); receives:
                                   * the link's list, or the core's orphans once abandoned (link NULL);
                                   * receives waiting for staging: the link's FIFO (lnext) */
};

enum { CMD_LINK_ADD = 1, CMD_LINK_CLOSE, CMD_TEST_SEND };

typedef struct ucx_cmd {
    int type, done, async, rndv;
    uint32_t link_id, status, result;
    const uint8_t *buf, *buf2;
    size_t len, len2;
    uint8_t rx_token[KV_UCX_TOKEN], tx_token[KV_UCX_TOKEN];
    uint64_t window, lease_ns, fence_ns, margin_ns;
    unsigned peer_flags;
    kv_event *down_event;
    struct ucx_cmd *next;
} ucx_cmd;

/* How the landing thread lands a large staged 1-D piece (land_how): a pread from the
 * staging memfd, or a process_vm_writev into ourselves from its mapping. Both are one
 * system call (the fence, decisions.md #29); which is faster depends on the destination's
 * memory: on this VM pread copies 13-15 GB/s into transparent huge pages (numpy's large
 * arrays) and 9-13 into 4 KiB pages, process_vm_writev (which pins the destination's
 * pages) 17-23 and 6-8.5 (docs/benchmarks.md, "UCX: the landing's system call"). An
 * engine's caches are mostly of one kind, so one choice per engine is learned. */
typedef struct {
    uint32_t pieces; /* pieces timed */
    uint32_t n[2];   /* per way (0: pread, 1: process_vm_writev) */
    double ns_per_b[2];
} ucx_land_pick;

struct kv_ucx {
    kv_transport transport; /* first */
    kv_core *core;
    pthread_t thread;
    pthread_mutex_t wlock;  /* the worker: held by the thread that calls into it (the I/O thread for
                             * its rounds, the loop thread while it drives a push:
                             * kv_ucx_submit_driven); taken before c->lock */
    int epoll_fd, wake_fd, worker_fd;
    ucp_context_h context;
    ucp_worker_h worker;
    ucp_address_t *address;
    size_t address_len;
    uint64_t uid;          /* our worker's unique id */
    int peer_errors;       /* endpoints ask for UCP_ERR_HANDLING_MODE_PEER (else NONE) */
    /* under c->lock */
    ucx_link *links;
    ucx_local *locals;
    ucx_cmd *cmds_head, *cmds_tail;
    ucx_job *inbox_head, *inbox_tail;
    int aborts;           /* ABORT_REQ jobs may exist: the round looks for them */
    ucx_local *unmap;     /* released regions to unmap at the next round (on the I/O thread) */
    ucx_op *orphans;      /* receives of failed links UCX has not ended: they land nothing */
    ucx_stage *stages;    /* staging buffers for reuse */
    /* endpoints without error handling of closed links, by peer worker, oldest first
     * (the worker's holder only: wlock): UCP would keep them anyway (park_ep) */
    struct {
        uint64_t uid;
        ucp_ep_h ep;
    } parked[UCX_PARKED_MAX];
    unsigned nparked;
    pid_t pid;            /* ours (copy_rows_into) */
    int self_copy;        /* copy_rows_into may use process_vm_writev */
    int rows_fd;          /* the worker's holder's: a memfd an eager PUSH2D payload passes through (-1: none) */
    uint64_t rows_len;    /* its size */
    uint64_t stage_bytes; /* their capacity */
    pthread_cond_t cmd_done;
    int stop_requested, stopped;
    /* the landing thread (land_main): staged push payloads land there, off the I/O
     * thread, so that a landing overlaps the next receive (under c->lock) */
    pthread_t land_thread;
    int land_started, land_stop;
    pthread_cond_t land_cond;
    ucx_op *land_head, *land_tail; /* received, to land (FIFO) */
    ucx_op *land_done;             /* landed: the round settles them (land_drain) */
    ucx_op *land_piece;            /* the op whose piece is being copied now (atomic: cleared
                                    * without the lock when the piece's system call returned) */
    ucx_land_pick pick;            /* landing thread only: the faster way a large piece lands */
    /* the worker's holder only (the I/O thread, or a driver): it holds c->lock now (UCP
     * may call our callbacks from inside a call made under the lock: a forced close
     * completes requests inline), and the signal those callbacks owe the loop */
    int io_locked, io_sig;
    uint64_t drove_ns;    /* (atomic) when the loop thread last drove a push (kv_ucx_submit_driven) */
    int efd_off;          /* I/O thread only: the worker's fd is out of its epoll set (a driver at work) */
    int drive_wanted;     /* (atomic) a driver waits for the worker: the I/O thread's ticks leave it */
};

static const kv_transport_ops ucx_ops;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void wake(kv_ucx *u) {
    uint64_t one = 1;
    ssize_t r;
    do
        r = write(u->wake_fd, &one, sizeof one);
    while (r < 0 && errno == EINTR);
}

static kv_ucx *ucx_of(kv_core *c) { return (kv_ucx *)kv__transport_get(c, KV_REGION_UCX); }

static void list_add(ucx_job **head, ucx_job *j) {
    j->prev = NULL;
    j->next = *head;
    if (*head)
        (*head)->prev = j;
    *head = j;
}

static void list_del(ucx_job **head, ucx_job *j) {
    if (j->prev)
        j->prev->next = j->next;
    else
        *head = j->next;
    if (j->next)
        j->next->prev = j->prev;
    j->next = j->prev = NULL;
}

static ucx_link *link_find(kv_ucx *u, uint32_t id) {
    for (ucx_link *l = u->links; l; l = l->next)
        if (l->id == id)
            return l;
    return NULL;
}

/* The link whose rx token `t` is (constant time per link). */
static ucx_link *link_by_token(kv_ucx *u, const uint8_t *t) {
    ucx_link *found = NULL;
    for (ucx_link *l = u->links; l; l = l->next) {
        unsigned diff = 0;
        for (int i = 0; i < KV_UCX_TOKEN; i++)
            diff |= (unsigned)(l->rx_token[i] ^ t[i]);
        if (diff == 0)
            found = l;
    }
    return found;
}

static ucp_mem_h memh_of(kv_ucx *u, uint32_t region_id) {
    for (ucx_local *lo = u->locals; lo; lo = lo->next)
        if (lo->region_id == region_id)
            return lo->memh;
    return NULL;
}

static void *io_main(void *arg);
static void *land_main(void *arg);
/* 1: this thread submits a job it will drive itself (no wake-up of the I/O thread);
 * 2: it progresses the worker (kv_ucx_submit_driven): UCP callbacks run on it */
static __thread int driving;
static int take_job(kv_ucx *u, ucx_job *j, int stop);
static ucs_status_t am_recv(void *arg, const void *header, size_t header_length, void *data, size_t length,
                            const ucp_am_recv_param_t *param);

/* ---------------------------------------------------------------- start */

/* An endpoint is first asked for with UCX's peer-failure reports; where the transports
 * cannot give them (shared memory: posix, sysv, cma) UCP refuses and logs an ERROR
 * ("no active messages transport to ...: ... no peer failure handler"), and run_cmd
 * creates the endpoint without them. That refusal is expected, so UCX's errors and
 * warnings logged by this thread during that first attempt are dropped (a retry that
 * fails too logs as usual). The handler goes first in UCX's chain, once a process. */
static __thread int quiet_attempt;

static kv_ucs_log_rc quiet_log(const char *file, unsigned line, const char *function, ucs_log_level_t level,
                               const ucs_log_component_config_t *comp_conf, const char *message, va_list ap) {
    (void)file;
    (void)line;
    (void)function;
    (void)comp_conf;
    (void)message;
    (void)ap;
    return quiet_attempt && (level == UCS_LOG_LEVEL_ERROR || level == UCS_LOG_LEVEL_WARN) ? KV_UCS_LOG_STOP
                                                                                           : KV_UCS_LOG_CONTINUE;
}

/* Does a UCX_TLS list name tcp and nothing else but self ("tcp", "tcp,self")? */
static int tls_tcp_only(const char *tls) {
    int tcp = 0;
    for (const char *p = tls; p && *p;) {
        size_t k = strcspn(p, ",");
        if (k == 3 && strncmp(p, "tcp", 3) == 0)
            tcp = 1;
        else if (!(k == 4 && strncmp(p, "self", 4) == 0))
            return 0;
        p += k + (p[k] == ',');
    }
    return tcp;
}

static pthread_once_t quiet_once = PTHREAD_ONCE_INIT;

static void quiet_install(void) { ucs_log_push_handler(quiet_log); }

static uint32_t ucx_start(kv_core *c, kv_ucx **out) {
    pthread_mutex_lock(&c->lock);
    kv_ucx *u = c->closed ? NULL : ucx_of(c);
    uint32_t st = c->closed ? KV_LLM_ENGINE_FINALIZED : KV_LLM_SUCCESS;
    pthread_mutex_unlock(&c->lock);
    if (st != KV_LLM_SUCCESS || u) {
        *out = u;
        return st;
    }
    /* UCP setup outside the lock (it reads its configuration, opens transports) */
    u = calloc(1, sizeof *u);
    if (!u)
        return KV_LLM_OUT_OF_MEMORY;
    u->transport.ops = &ucx_ops;
    u->core = c;
    u->epoll_fd = u->wake_fd = u->rows_fd = -1;
    pthread_cond_init(&u->cmd_done, NULL);
    pthread_cond_init(&u->land_cond, NULL);
    pthread_mutex_init(&u->wlock, NULL);
    u->pid = getpid();
    u->self_copy = 1;
    /* no UCP_FEATURE_RMA: UCP then installs no handler that would put or get at
     * an address a peer names (its software RMA emulation); every byte a peer
     * sends us goes through am_recv's checks */
    ucp_params_t params = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
        .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .mt_workers_shared = 1, /* ucp_mem_map/unmap from the API threads, the worker on ours */
    };
    /* error handling mode PEER makes UCP leave out every rendezvous lane whose
     * memory domain cannot invalidate (cma, tcp): rendezvous payloads then go as
     * copied fragments over the tcp lane, 4-5x slower. KVENGINE_UCX_PEER_ERRORS=0
     * trades UCX's own peer-failure reports for the zero-copy protocols */
    const char *pe = getenv("KVENGINE_UCX_PEER_ERRORS");
    u->peer_errors = !(pe && strcmp(pe, "0") == 0);
    if (u->peer_errors)
        pthread_once(&quiet_once, quiet_install);
    ucp_config_t *config = NULL;
    if (ucp_config_read(NULL, NULL, &config) != UCS_OK)
        goto fail;
    /* UCX's own tcp transport executes raw PUT requests from anyone who connects to
     * its port, below every check of ours (docs/security.md): it is used only when
     * UCX_TLS names it explicitly */
    if (!getenv("UCX_TLS") && ucp_config_modify(config, "TLS", "^tcp") != UCS_OK) {
        ucp_config_release(config);
        goto fail;
    }
    /* where tcp is used, a one-layer push message in one segment (UCX_TCP_SEG); a
     * UCX that does not know the setting keeps its own */
    if (!getenv("UCX_TCP_TX_SEG_SIZE") && !getenv("UCX_TCP_RX_SEG_SIZE")) {
        (void)ucp_config_modify(config, "TCP_TX_SEG_SIZE", UCX_TCP_SEG);
        (void)ucp_config_modify(config, "TCP_RX_SEG_SIZE", UCX_TCP_SEG);
    }
    /* over tcp alone, the zero-copy rendezvous (a put into the target's staging) where
     * UCX may use it (no error handling): UCX 1.22 picks copied fragments by itself on
     * one tcp device (decisions.md #34) */
    if (!getenv("UCX_RNDV_SCHEME") && tls_tcp_only(getenv("UCX_TLS")))
        (void)ucp_config_modify(config, "RNDV_SCHEME", "put_zcopy");
    ucs_status_t s = ucp_init(&params, config, &u->context);
    ucp_config_release(config);
    if (s != UCS_OK) {
        u->context = NULL;
        goto fail;
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    if (ucp_worker_create(u->context, &wp, &u->worker) != UCS_OK) {
        u->worker = NULL;
        goto fail;
    }
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                      UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = UCX_AM_ID, .flags = UCP_AM_FLAG_WHOLE_MSG, .cb = am_recv, .arg = u,
    };
    if (ucp_worker_set_am_recv_handler(u->worker, &hp) != UCS_OK)
        goto fail;
    if (ucp_worker_get_address(u->worker, &u->address, &u->address_len) != UCS_OK) {
        u->address = NULL;
        goto fail;
    }
    ucp_worker_address_attr_t aa = {.field_mask = UCP_WORKER_ADDRESS_ATTR_FIELD_UID};
    if (ucp_worker_address_query(u->address, &aa) != UCS_OK)
        goto fail;
    u->uid = aa.worker_uid;
    if (ucp_worker_get_efd(u->worker, &u->worker_fd) != UCS_OK)
        goto fail;
    u->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    u->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event ev1 = {.events = EPOLLIN, .data.u32 = 0}, ev2 = {.events = EPOLLIN, .data.u32 = 1};
    if (u->epoll_fd < 0 || u->wake_fd < 0 || epoll_ctl(u->epoll_fd, EPOLL_CTL_ADD, u->wake_fd, &ev1) < 0 ||
        epoll_ctl(u->epoll_fd, EPOLL_CTL_ADD, u->worker_fd, &ev2) < 0)
        goto fail;
    pthread_mutex_lock(&c->lock);
    if (c->closed || ucx_of(c)) { /* closed, or a concurrent call won */
        kv_ucx *won = c->closed ? NULL : ucx_of(c);
        st = c->closed ? KV_LLM_ENGINE_FINALIZED : KV_LLM_SUCCESS;
        pthread_mutex_unlock(&c->lock);
        ucx_ops.destroy(&u->transport);
        *out = won;
        return st;
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(&u->thread, NULL, io_main, u);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        pthread_mutex_unlock(&c->lock);
        ucx_ops.destroy(&u->transport);
        return KV_LLM_FAILED;
    }
    pthread_setname_np(u->thread, "kv-ucx-io");
    kv__transport_register(c, KV_REGION_UCX, &u->transport);
    pthread_mutex_unlock(&c->lock);
    *out = u;
    return KV_LLM_SUCCESS;
fail:
    ucx_ops.destroy(&u->transport);
    return KV_LLM_FAILED;
}

/* ------------------------------------------------------------- completion */

/* The inbox: jobs submitted, not yet taken by the I/O thread (caller holds c->lock). */
static void inbox_append(kv_ucx *u, ucx_job *j) {
    j->next = NULL;
    j->prev = u->inbox_tail;
    if (u->inbox_tail)
        u->inbox_tail->next = j;
    else
        u->inbox_head = j;
    u->inbox_tail = j;
}

static void inbox_remove(kv_ucx *u, ucx_job *j) {
    if (j->prev)
        j->prev->next = j->next;
    else
        u->inbox_head = j->next;
    if (j->next)
        j->next->prev = j->prev;
    else
        u->inbox_tail = j->prev;
}

/* Drop `j`'s pull requests not being received: answers to them are discarded
 * from now on. A receive in progress ends first (it writes `j`'s own
 * destination): `j` completes after it, which is its fence. */
static void pulls_drop(ucx_link *l, ucx_job *j) {
    for (ucx_pull **p = &l->pulls; *p;) {
        ucx_pull *q = *p;
        if (q->job != j || q->receiving) {
            p = &q->next;
        } else {
            *p = q->next;
            l->pull_inflight -= q->len;
            j->ops_pending--;
            free(q);
        }
    }
}

/* A job's queue on its link: pushes and pulls apart, so that neither direction waits
 * for the other's window (a push's bytes wait in the peer's staging, a pull's answers
 * in ours). */
static void queue_add(ucx_link *l, ucx_job *j) {
    if (j->is_pull)
        kv__rank_insert(&l->pull_head, &l->pull_tail, &j->job);
    else
        kv__rank_insert(&l->send_head, &l->send_tail, &j->job);
}

static void queue_del(ucx_link *l, ucx_job *j) {
    if (j->is_pull)
        kv__queue_remove(&l->pull_head, &l->pull_tail, &j->job);
    else
        kv__queue_remove(&l->send_head, &l->send_tail, &j->job);
}

/* Complete `j` (caller holds c->lock). Returns 1 if the eventfd must be signalled. */
static int job_complete(kv_ucx *u, ucx_job *j, uint32_t status) {
    if (j->job.queued)
        queue_del(j->link, j);
    if (j->job.state == KV_JS_INBOX) {
        inbox_remove(u, j);
    } else if (j->link) {
        list_del(&j->link->active, j);
    }
    j->job.state = KV_JS_DONE;
    return kv__job_complete(u->core, &j->job, status);
}

/* Is `j` finished? Caller holds c->lock.
 * Push: every chunk posted (or no more will be) and every send complete, and the
 * target's ACK, or (aborted) its ABORT_ACK, or nothing of it was ever posted, or
 * the link failed. Pull: every request answered (or dropped) and no receive of
 * it in progress. */
static int job_maybe_done(kv_ucx *u, ucx_job *j) {
    if (j->job.state == KV_JS_DONE || j->job.queued || j->ops_pending)
        return 0;
    int st = j->job.state;
    if (st != KV_JS_ABORTING && st != KV_JS_FENCING && st != KV_JS_SENT)
        return 0;
    if (st == KV_JS_FENCING) /* the link failed: its endpoint completed every send (cancelled) */
        return job_complete(u, j, KV_LLM_LINK_FAILED);
    if (j->is_pull)
        return job_complete(u, j, KV_LLM_SUCCESS); /* an abort's status is in record.status already */
    if (j->acked) {
        j->job.bytes_done = j->posted;
        return job_complete(u, j, KV_LLM_SUCCESS);
    }
    if (st == KV_JS_ABORTING && (j->posted == 0 || j->abort_state == 3))
        return job_complete(u, j, KV_LLM_SUCCESS);
    return 0;
}

/* Callbacks run on the thread that holds the worker (the I/O thread, or the loop
 * thread driving a push), with c->lock held or not: take it if not. */
static int cb_lock(kv_ucx *u) {
    if (u->io_locked)
        return 0;
    pthread_mutex_lock(&u->core->lock);
    u->io_locked = 1;
    return 1;
}

static void cb_unlock(kv_ucx *u, int own, int sig) {
    u->io_sig |= sig;
    if (!own)
        return; /* the holder signals after it unlocks */
    sig = u->io_sig;
    u->io_sig = 0;
    u->io_locked = 0;
    pthread_mutex_unlock(&u->core->lock);
    if (sig)
        kv__signal_loop(u->core);
}

static void ctl_done(void *request, ucs_status_t status, void *user_data) {
    (void)status; /* a control message that failed: its link is failing too */
    free(user_data);
    ucp_request_free(request);
}

/* Send a message without payload (ACK, ABORT, ABORT_ACK, PULL_REQ, PULL_REQ2D), or a
 * PULL_REQV, on `l`: a PULL_REQ2D's (or a PULL_REQV's) rows of `row_len` bytes,
 * `stride` apart at the source (else both 0: the 64-byte header); a PULL_REQV's list,
 * eager after its header: the offsets and bytes there of the `m` segments `segs`
 * (else m 0). Caller holds c->lock;
 * ucp_am_send_nbx calls nothing back here. Returns 0, or -1 if it could not be sent
 * (the link is failing). */
static int send_req(ucx_link *l, uint32_t type, uint64_t job, uint32_t region, uint64_t offset, uint64_t len,
                    uint64_t tag, uint64_t row_len, uint64_t stride, const kv_segment *segs, size_t m) {
    if (l->dead || !l->ep)
        return -1;
    kv_ucx_hdr2d *g = calloc(1, sizeof *g + m * sizeof(kv_ucx_piece));
    if (!g)
        return -1;
    kv_ucx_hdr *h = &g->h;
    kv_ucx_piece *list = (kv_ucx_piece *)(g + 1);
    memcpy(h->token, l->tx_token, KV_UCX_TOKEN);
    h->type = type;
    h->region = region;
    h->job = job;
    h->offset = offset;
    h->len = len;
    h->tag = tag;
    g->row_len = row_len;
    g->dst_stride = stride;
    for (size_t i = 0; i < m; i++) {
        list[i].offset = segs[i].src;
        list[i].len = kv_seg_bytes(&segs[i]);
    }
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                             UCP_OP_ATTR_FIELD_FLAGS,
                             .cb.send = ctl_done, .user_data = g, .flags = UCP_AM_SEND_FLAG_EAGER};
    ucs_status_ptr_t r = ucp_am_send_nbx(l->ep, UCX_AM_ID, g, type == KV_UCX_PULL_REQ2D || row_len ? sizeof *g : sizeof *h,
                                         m ? list : NULL, m * sizeof *list, &p);
    if (r == NULL) {
        free(g);
        return 0;
    }
    if (UCS_PTR_IS_ERR(r)) {
        free(g);
        return -1;
    }
    return 0;
}

/* The same, one of the 64-byte header's messages. */
static int send_ctl(ucx_link *l, uint32_t type, uint64_t job, uint32_t region, uint64_t offset, uint64_t len,
                    uint64_t tag) {
    return send_req(l, type, job, region, offset, len, tag, 0, 0, NULL, 0);
}

/* A push's data send completed (rendezvous: the target has received it, or
 * refused it; eager: handed to the transport). */
static void push_sent(void *request, ucs_status_t status, void *user_data) {
    ucx_op *op = user_data;
    ucx_job *j = op->job;
    kv_ucx *u = op->u;
    int own = cb_lock(u);
    int sig = 0;
    ucx_link *l = op->link;
    if (op->lprev)
        op->lprev->lnext = op->lnext;
    else
        l->sends = op->lnext;
    if (op->lnext)
        op->lnext->lprev = op->lprev;
    l->inflight -= op->len;
    if (j) { /* not detached (its job ended without it: link failure) */
        j->ops_pending--;
        if (status != UCS_OK && j->job.record.status == KV_LLM_SUCCESS && j->job.state != KV_JS_ABORTING)
            j->job.record.status = KV_LLM_LINK_FAILED;
        sig = job_maybe_done(u, j);
    }
    if (op->region)
        kv__region_unref(u->core, op->region);
    cb_unlock(u, own, sig);
    free(op);
    ucp_request_free(request);
}

/* ---------------------------------------------------------------- links */

static void close_done(void *request, ucs_status_t status, void *user_data) {
    (void)status;
    ucx_link *l = user_data;
    kv_ucx *u = l->u;
    int own = cb_lock(u);
    l->closing = 2; /* I/O thread only */
    u->core->stats.ucx_ep_closing--;
    cb_unlock(u, own, 0);
    ucp_request_free(request);
}

static void rx_free_all(ucx_link *l) {
    for (int b = 0; b < UCX_RX_BUCKETS; b++)
        while (l->rx[b]) {
            ucx_rx *r = l->rx[b];
            l->rx[b] = r->next;
            free(r);
        }
    l->nrx = l->ntomb = 0;
    l->tomb_head = l->tomb_tail = NULL;
}

/* A job of a failed link whose requests did not end within the fence: it stops
 * waiting for them. Its sends' and receives' contexts stay until UCX ends them
 * (they hold their own region refs where they write); pull answers are discarded. */
static void job_detach(ucx_link *l, ucx_job *j) {
    for (ucx_op *op = l->sends; op; op = op->lnext)
        if (op->job == j)
            op->job = NULL;
    for (ucx_pull *q = l->pulls; q; q = q->next)
        if (q->job == j)
            q->job = NULL;
    j->ops_pending = 0;
}

static ucx_stage *stage_new(uint64_t len);

/* Where a stage's payload begins (stage_get). */
static inline uint8_t *stage_at(const ucx_stage *st) { return (uint8_t *)st->buf + st->skew; }

/* A staging buffer for a payload of `len` bytes bound for `dst` (reused when one
 * is free), counted in ucx_stage_bytes until the receive gives it back. The
 * payload goes at the destination's offset in a page (stage_at), so that each
 * landing copy reads and writes at the same offset in a page: the kernel copies
 * with `rep movsb`, which on AMD EPYC (Zen) runs at a quarter of its speed when
 * the destination lies 1-31 bytes past the source modulo 4 KiB, and numpy arrays
 * begin 16 bytes into a page (docs/benchmarks.md, "Landing at the destination's
 * offset in a page"). */
static ucx_stage *stage_get(kv_ucx *u, uint64_t len, uint64_t dst) {
    ucx_stage *st = NULL;
    size_t skew = (size_t)(dst & 4095);
    len += skew;
    for (ucx_stage **p = &u->stages; *p; p = &(*p)->next)
        if ((*p)->cap >= len) {
            st = *p;
            *p = st->next;
            u->stage_bytes -= st->cap;
            break;
        }
    if (!st && !(st = stage_new(len)))
        return NULL;
    st->skew = skew;
    st->live = 1;
    u->core->stats.ucx_stage_bytes += st->cap;
    return st;
}

/* A new staging buffer: a memfd mapping, else page-aligned heap memory. */
static ucx_stage *stage_new(uint64_t len) {
    ucx_stage *st = calloc(1, sizeof *st);
    size_t cap = (size_t)((len + 4095) & ~4095ull);
    if (!st)
        return NULL;
    st->cap = cap;
    /* a memfd, so that a piece lands with one pread / preadv (copy_rows_into) */
    st->fd = memfd_create("kvengine-ucx-stage", MFD_CLOEXEC);
    if (st->fd >= 0) {
        void *m = MAP_FAILED;
        if (ftruncate(st->fd, (off_t)cap) == 0)
            m = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_SHARED, st->fd, 0);
        if (m != MAP_FAILED) {
            st->buf = m;
            st->mapped = 1;
            return st;
        }
        close(st->fd);
        st->fd = -1;
    }
    st->fd = -1;
    if (posix_memalign(&st->buf, 4096, cap) != 0) {
        free(st);
        return NULL;
    }
    return st;
}

static void stage_free(ucx_stage *st) {
    if (st->mapped)
        munmap(st->buf, st->cap);
    else
        free(st->buf);
    if (st->fd >= 0)
        close(st->fd);
    free(st);
}

/* No receive holds it any more (counted out of ucx_stage_bytes). */
static void stage_unlive(kv_ucx *u, ucx_stage *st) {
    if (st->live) {
        st->live = 0;
        u->core->stats.ucx_stage_bytes -= st->cap;
    }
}

/* An orphan's buffer (its link failed, UCX has not ended the receive and may
 * still write it): its memory goes back to the kernel and its memfd is closed
 * (the mapping stays for UCX; a page it writes again is a new page). Freed, not
 * reused, when UCX ends the receive; with the engine otherwise. A dead pusher
 * then leaves only UCX's requests and bookkeeping behind, no staging memory. */
static void stage_release(kv_ucx *u, ucx_stage *st) {
    if (!st)
        return;
    stage_unlive(u, st);
    if (st->fd >= 0) {
        (void)fallocate(st->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)st->cap);
        close(st->fd);
        st->fd = -1;
    } else {
        (void)madvise(st->buf, st->cap, MADV_DONTNEED); /* page-aligned, whole pages */
    }
    st->released = 1;
}

static void stage_put(kv_ucx *u, ucx_stage *st) {
    if (!st)
        return;
    stage_unlive(u, st);
    if (!st->released && u->stage_bytes + st->cap <= UCX_STAGE_CACHE) {
        st->next = u->stages;
        u->stages = st;
        u->stage_bytes += st->cap;
        return;
    }
    stage_free(st);
}

static void op_push(ucx_op **head, ucx_op *op) {
    op->lprev = NULL;
    op->lnext = *head;
    if (*head)
        (*head)->lprev = op;
    *head = op;
}

static void op_del(ucx_op **head, ucx_op *op) {
    if (op->lprev)
        op->lprev->lnext = op->lnext;
    else
        *head = op->lnext;
    if (op->lnext)
        op->lnext->lprev = op->lprev;
    op->lnext = op->lprev = NULL;
}

static void op_unqueue(ucx_op **head, ucx_op **tail, ucx_op *op) {
    ucx_op *prev = NULL;
    for (ucx_op **p = head; *p; prev = *p, p = &(*p)->qnext)
        if (*p == op) {
            *p = op->qnext;
            if (tail && *tail == op)
                *tail = prev;
            op->qnext = NULL;
            return;
        }
}

/* The link failed: its receives stop counting. Messages waiting for staging are
 * released to UCX unreceived; receives in progress become orphans: UCX may still
 * write their staging buffers (until it ends them), but they land nothing, hold
 * no region and no push or pull waits for them. Received payloads waiting for the
 * landing thread (or landed, waiting for the round) are dropped; the one it is
 * landing now stops after its current piece and keeps its region until then
 * (land_main frees it). Caller holds c->lock. */
static void recvs_abandon(kv_ucx *u, ucx_link *l) {
    kv_core *c = u->core;
    while (l->defer_head || l->recvs) {
        ucx_op *op = l->defer_head;
        if (op) {
            l->defer_head = op->lnext;
            if (!l->defer_head)
                l->defer_tail = NULL;
        } else {
            op = l->recvs;
            op_del(&l->recvs, op);
            l->staged -= op->len;
        }
        l->rx_ops--;
        c->stats.ucx_rx_pending--;
        if (op->rx)
            op->rx->receiving--;
        if (op->pull)
            op->pull->receiving = 0; /* dropped with its job below */
        op->rx = NULL;
        op->pull = NULL;
        if (op->landing == 2) { /* being landed: land_main sees link NULL before its next piece */
            op->link = NULL;
            /* and the piece being copied now ends before the link counts as failed (nothing
             * lands after): one system call of at most UCX_LAND_PIECE bytes */
            while (__atomic_load_n(&u->land_piece, __ATOMIC_ACQUIRE) == op)
                sched_yield();
            continue;
        }
        if (op->region)
            kv__region_unref(c, op->region);
        op->region = 0;
        if (op->landing) { /* received: UCX is done with it */
            if (op->landing == 1) {
                op_unqueue(&u->land_head, &u->land_tail, op);
                c->stats.ucx_late_dropped++; /* its bytes never land */
            } else {
                op_unqueue(&u->land_done, NULL, op);
            }
            stage_put(u, op->stage);
            free(op);
            continue;
        }
        if (op->desc) { /* never posted */
            ucp_am_data_release(u->worker, op->desc);
            free(op);
            continue;
        }
        op->link = NULL;
        c->stats.ucx_rx_orphans++;
        stage_release(u, op->stage); /* UCX may still write it; nothing reads it any more */
        op_push(&u->orphans, op);
    }
}

/* Does endpoint `ep` have a lane over one of the transports `names` (NULL-ended)?
 * `unknown`: the answer when UCX cannot say. */
static int ep_has_transport(ucp_ep_h ep, const char *const *names, int unknown) {
    ucp_transport_entry_t tl[16];
    ucp_ep_attr_t a = {.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS,
                       .transports = {.entries = tl, .num_entries = 16, .entry_size = sizeof tl[0]}};
    if (ucp_ep_query(ep, &a) != UCS_OK)
        return unknown;
    for (unsigned i = 0; i < a.transports.num_entries && i < 16; i++)
        for (const char *const *n = names; *n; n++)
            if (tl[i].transport_name && strcmp(tl[i].transport_name, *n) == 0)
                return 1;
    return 0;
}

static const char *const UCX_TCP_TLS[] = {"tcp", NULL};
/* UCX's shared-memory transports: active messages over them go through shared
 * memory, where an eager 64 KiB message (a multi-fragment copy) is faster than a
 * rendezvous round trip; over tcp (UCX_TLS=tcp, or cma,tcp,self: cma carries no
 * AM) it is slower (docs/benchmarks.md, "UCX: one layer"). */
static const char *const UCX_SHM_TLS[] = {"posix", "sysv", "xpmem", NULL};
/* ...and those a rendezvous payload crosses in one copy (the target reads the pusher's memory) */
static const char *const UCX_ZCOPY_TLS[] = {"cma", "knem", "xpmem", NULL};

/* Is the close of `l`'s endpoint forced? Only with UCX's error handling (UCX 1.22 refuses
 * it without), and over UCX's tcp transport only once UCX reported the endpoint failed:
 * a forced close of a healthy tcp endpoint with bytes it could not write yet (a stopped
 * peer) leaves UCX's tcp endpoint alive for receiving, waiting to write; when the peer
 * then closes its side, UCX 1.22 (uct_tcp_iface_handle_events) frees that endpoint in
 * its read handler on the peer's CONN_FIN and runs its write handler on the freed
 * memory: a crash or a corrupted heap. A flush close writes those bytes first and
 * ends when the peer resumes, or fails when it dies (docs/decisions.md #29). */
static int close_forced(ucx_link *l) {
    return l->peer_errors && (l->down_status || !ep_has_transport(l->ep, UCX_TCP_TLS, 1)); /* unknown: as tcp */
}

static void kept_close_done(void *request, ucs_status_t status, void *user_data) {
    (void)status;
    (void)user_data;
    ucp_request_free(request);
}

/* Park the endpoint of closing link `l` for the next link to the same peer worker,
 * instead of closing it: 1 if parked (l->ep is NULL then). UCP destroys an endpoint
 * the peer has connected to (which any traffic makes it) only on a forced close or
 * with the worker (ucp_ep.c ucp_ep_disconnected: "TODO negotiate disconnect"), and
 * without UCX's error handling (shared memory; KVENGINE_UCX_PEER_ERRORS=0) there is no
 * forced close: closed, it would stay until the engine closes, with the peer's FIFO
 * and buffers mapped here, one per link (docs/reliability.md, "UCX links"). Parked,
 * the peer's next link reuses it. Nothing of the old link can arrive through it: a
 * message names its link by token, and that link is closed (refused); its sends still
 * outstanding complete as they would have in a flush close (the link is freed after
 * them, link_reap). At most UCX_PARKED_MAX: the oldest is then closed as before (kept
 * by UCP until the engine closes: ucx_ep_kept). Not while the engine stops (the
 * worker goes next), nor for endpoints with error handling (closed with force where
 * allowed), nor over UCX's tcp transport (a flush close, bounded and idle against a
 * stopped peer: decisions.md #29, #30; kept). Caller holds c->lock. */
static int park_ep(kv_ucx *u, ucx_link *l) {
    kv_core *c = u->core;
    if (l->peer_errors || u->stopped || !l->peer_uid || ep_has_transport(l->ep, UCX_TCP_TLS, 1))
        return 0;
    if (u->nparked >= PARKED_MAX) {
        ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK, .cb.send = kept_close_done};
        ucs_status_ptr_t r = ucp_ep_close_nbx(u->parked[0].ep, &p);
        (void)r; /* a request (freed by its callback), NULL or an error: UCP keeps the endpoint either way */
        c->stats.ucx_ep_closes++;
        c->stats.ucx_ep_kept++;
        memmove(&u->parked[0], &u->parked[1], (u->nparked - 1) * sizeof u->parked[0]);
        u->nparked--;
    }
    u->parked[u->nparked].uid = l->peer_uid;
    u->parked[u->nparked++].ep = l->ep;
    l->ep = NULL;
    c->stats.ucx_ep_parked = u->nparked;
    return 1;
}

/* The endpoint parked for peer worker `uid` (taken: no longer parked), or NULL. */
static ucp_ep_h unpark_ep(kv_ucx *u, uint64_t uid) {
    for (unsigned i = u->nparked; i-- > 0;) {
        if (u->parked[i].uid != uid)
            continue;
        ucp_ep_h ep = u->parked[i].ep;
        memmove(&u->parked[i], &u->parked[i + 1], (u->nparked - i - 1) * sizeof u->parked[0]);
        u->core->stats.ucx_ep_parked = --u->nparked;
        return ep;
    }
    return NULL;
}

/* The link fails (caller holds c->lock, I/O thread): from now on the handler
 * writes nothing for it; queued jobs end at once, jobs with requests
 * outstanding when UCX ended them (a forced close does at once) or at their
 * due time (timers: the lease bound, or the fence). */
static int link_fail(kv_ucx *u, ucx_link *l, uint32_t status, int post_down) {
    kv_core *c = u->core;
    int sig = 0;
    if (l->dead)
        return 0;
    l->dead = 1;
    recvs_abandon(u, l); /* before the jobs: a pull no longer waits for its receive */
    for (ucx_job *j = l->active, *next; j; j = next) {
        next = j->next;
        if (j->job.record.status == KV_LLM_SUCCESS)
            j->job.record.status = status;
        if (!j->is_pull && j->job.state == KV_JS_ABORTING && j->posted && !j->acked && j->abort_state != 3)
            j->job.record.status = KV_LLM_LINK_FAILED; /* an abort the target never acknowledged: not a
                                                          timeout or cancel on a usable link, tcp's rule */
        if (j->job.queued)
            queue_del(l, j);
        j->job.state = KV_JS_FENCING;
        /* at the latest then it stops waiting for UCX: a push with bytes on the way
         * once the peer's lease from our last grant has surely run out (the peer,
         * stopped now, may resume with them in its buffers), else after the fence */
        uint64_t t = now_ns();
        j->due = t + l->fence_ns;
        if (!j->is_pull && j->posted && !j->acked && j->abort_state != 3)
            j->due = l->last_grant ? l->last_grant + l->lease_ns + l->margin_ns : t;
        if (j->is_pull)
            pulls_drop(l, j);
        sig |= job_maybe_done(u, j);
    }
    if (l->ep && park_ep(u, l)) {
        l->closing = 2;
    } else if (l->ep) {
        /* forced where the endpoint has UCX's error handling: UCX 1.22 refuses a forced
         * close without it (UCS_ERR_INVALID_PARAM, the endpoint left open), and its
         * flush then waits for a dead peer for good; the receives were abandoned above,
         * so all that stays is UCX's requests and their staging (docs/decisions.md #29).
         * Not over UCX's tcp transport while UCX reported no error (close_forced) */
        int forced = close_forced(l);
        ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                                                 UCP_OP_ATTR_FIELD_USER_DATA,
                                 .flags = forced ? UCP_EP_CLOSE_FLAG_FORCE : 0,
                                 .cb.send = close_done, .user_data = l};
        ucs_status_ptr_t r = ucp_ep_close_nbx(l->ep, &p);
        l->ep = NULL;
        l->closing = (r == NULL || UCS_PTR_IS_ERR(r)) ? 2 : 1;
        c->stats.ucx_ep_closes++;
        /* UCP destroys an endpoint the peer connected to (after any traffic) only on a
         * forced close or with the worker: without force it stays, with its transports'
         * resources (over shared memory the peer's FIFO and buffers stay mapped here),
         * until the engine closes (ucp_ep.c ucp_ep_disconnected, "TODO negotiate
         * disconnect"; docs/reliability.md, "UCX links") */
        c->stats.ucx_ep_kept += !forced;
        c->stats.ucx_ep_closing += l->closing == 1;
    } else {
        l->closing = 2;
    }
    if (post_down && l->down_event) {
        c->stats.tcp_links_failed++;
        l->down_event->record.status = status;
        sig |= kv__post_event(c, l->down_event);
        l->down_event = NULL;
    }
    return sig;
}

static void ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep, (void)status;
    ucx_link *l = arg;
    l->down_status = KV_LLM_LINK_FAILED; /* acted on by the round (under the lock) */
}

/* Free a dead link whose close completed, whose jobs all ended and whose
 * receives all finished. Caller holds c->lock. */
static void link_reap(kv_ucx *u) {
    ucx_link **p = &u->links;
    while (*p) {
        ucx_link *l = *p;
        if (!(l->dead && l->closing == 2 && !l->active && !l->rx_ops && !l->pulls && !l->sends)) {
            p = &l->next;
            continue;
        }
        *p = l->next;
        rx_free_all(l);
        free(l->down_event);
        free(l);
    }
}

/* ------------------------------------------------------------- the target */

static ucx_rx *rx_find(ucx_link *l, uint64_t job) {
    for (ucx_rx *r = l->rx[job % UCX_RX_BUCKETS]; r; r = r->next)
        if (r->job == job)
            return r;
    return NULL;
}

static void rx_unlink(ucx_link *l, ucx_rx *r) {
    for (ucx_rx **p = &l->rx[r->job % UCX_RX_BUCKETS]; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            l->nrx--;
            return;
        }
}

static ucx_rx *rx_add(ucx_link *l, uint64_t job) {
    if (l->nrx >= UCX_RX_MAX)
        return NULL;
    ucx_rx *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->job = job;
    r->next = l->rx[job % UCX_RX_BUCKETS];
    l->rx[job % UCX_RX_BUCKETS] = r;
    l->nrx++;
    return r;
}

/* `r` is aborted: remember it (dropping the oldest tombstone beyond UCX_TOMBSTONES). */
static void rx_tombstone(ucx_link *l, ucx_rx *r) {
    r->aborted = 1;
    r->tnext = NULL;
    if (l->tomb_tail)
        l->tomb_tail->tnext = r;
    else
        l->tomb_head = r;
    l->tomb_tail = r;
    if (++l->ntomb > UCX_TOMBSTONES) {
        ucx_rx *old = l->tomb_head;
        if (old->receiving == 0 && !old->ack_owed) {
            l->tomb_head = old->tnext;
            if (!l->tomb_head)
                l->tomb_tail = NULL;
            l->ntomb--;
            rx_unlink(l, old);
            free(old);
        }
    }
}

/* A push's bytes landed, or a receive of it ended: ACK or ABORT_ACK when due. */
static void rx_settle(ucx_link *l, ucx_rx *r) {
    if (r->receiving)
        return;
    if (r->aborted) {
        if (r->ack_owed) {
            r->ack_owed = 0;
            send_ctl(l, KV_UCX_ABORT_ACK, r->job, 0, 0, 0, 0);
        }
        return;
    }
    if (r->landed == r->total) {
        send_ctl(l, KV_UCX_ACK, r->job, 0, 0, 0, 0);
        rx_unlink(l, r);
        free(r);
    }
}

/* Copy `n` bytes into place with one system call where it can: a stop (SIGSTOP,
 * a paused VM) takes effect only when the call returns, so a copy is never cut
 * in two by one, half before and half after the resume, as a memcpy can be.
 * From a staging memfd (`fd` >= 0, `sp` its mapping at `foff`): pread, about
 * half of memcpy's speed here; else process_vm_writev into our own process
 * (eager payloads, in UCX's buffers), about a third; where the kernel refuses
 * that (a sandbox), memcpy. */
static void copy_into(pid_t pid, int *self_copy, uint8_t *d, const uint8_t *sp, uint64_t n, int fd,
                      uint64_t foff) {
    uint64_t done = 0;
    if (fd >= 0) {
        ssize_t r = pread(fd, d, n, (off_t)foff);
        if (r > 0)
            done = (uint64_t)r;
    } else if (*self_copy) {
        struct iovec lo = {.iov_base = (void *)(uintptr_t)sp, .iov_len = n}, re = {.iov_base = d, .iov_len = n};
        ssize_t r = process_vm_writev(pid, &lo, 1, &re, 1, 0);
        if (r > 0)
            done = (uint64_t)r;
        else if (errno == EPERM || errno == ENOSYS)
            *self_copy = 0;
    }
    if (done < n)
        memcpy(d + done, sp + done, n - done);
}

/* Bytes [off, off + n) of a payload of rows `row` bytes long (packed at `sp`, or in
 * `fd` from offset `fbase`: a stage's skew), landing `stride` apart from `d` (row >=
 * the payload: 1-D, into d + off): one system call (preadv, or process_vm_writev into
 * ourselves) for all of it, as copy_into. `off` and `n` are whole rows unless 1-D;
 * n / row <= UCX_LAND_IOV.
 * An eager payload's rows (`scratch`: the caller's memfd, NULL for none) go through
 * that memfd first, and land with one preadv from it: a process_vm_writev of one
 * iovec per row pins each row's page anew (gather over shared memory: 0.28x -> 0.60x
 * contiguous, docs/benchmarks.md); writing the memfd lands nothing. */
static void copy_iov_into(pid_t pid, int *self_copy, const struct iovec *iov, size_t k, uint64_t n,
                          const uint8_t *sp, int fd, uint64_t foff, int *scratch, uint64_t *scratch_len);
static void copy_rows_into(pid_t pid, int *self_copy, uint8_t *d, uint64_t row, uint64_t stride, const uint8_t *sp,
                           uint64_t off, uint64_t n, int fd, uint64_t fbase, int *scratch, uint64_t *scratch_len) {
    if (row >= off + n) { /* one row: as ever */
        copy_into(pid, self_copy, d + off, sp ? sp + off : NULL, n, fd, fbase + off);
        return;
    }
    struct iovec iov[UCX_LAND_IOV];
    uint64_t r0 = off / row, k = n / row;
    for (uint64_t i = 0; i < k; i++) {
        iov[i].iov_base = d + (r0 + i) * stride;
        iov[i].iov_len = (size_t)row;
    }
    copy_iov_into(pid, self_copy, iov, k, n, sp + off, fd, fbase + off, scratch, scratch_len);
}

/* `n` bytes packed at `sp` (or in `fd` from `foff`) into the `k` runs of `iov`, in
 * order, with one system call, as copy_rows_into; what the kernel refused is copied
 * with memcpy. */
static void copy_iov_into(pid_t pid, int *self_copy, const struct iovec *iov, size_t k, uint64_t n,
                          const uint8_t *sp, int fd, uint64_t foff, int *scratch, uint64_t *scratch_len) {
    uint64_t done = 0;
    if (fd < 0 && scratch && n <= UCX_LAND_PIECE) { /* at most a piece: that much memory kept */
        if (*scratch < 0)
            *scratch = memfd_create("kv-ucx-rows", MFD_CLOEXEC);
        if (*scratch >= 0 && *scratch_len < n && ftruncate(*scratch, (off_t)n) == 0)
            *scratch_len = n;
        if (*scratch >= 0 && *scratch_len >= n && pwrite(*scratch, sp, n, 0) == (ssize_t)n) {
            fd = *scratch;
            foff = 0;
        }
    }
    if (fd >= 0) {
        ssize_t r = preadv(fd, iov, (int)k, (off_t)foff);
        if (r > 0)
            done = (uint64_t)r;
    } else if (*self_copy) {
        struct iovec lo = {.iov_base = (void *)(uintptr_t)sp, .iov_len = (size_t)n};
        ssize_t r = process_vm_writev(pid, &lo, 1, iov, k, 0);
        if (r > 0)
            done = (uint64_t)r;
        else if (errno == EPERM || errno == ENOSYS)
            *self_copy = 0;
    }
    for (uint64_t i = 0, at = 0; i < k && done < n; at += iov[i].iov_len, i++) { /* what the call did not copy */
        if (at + iov[i].iov_len <= done)
            continue;
        uint64_t from = done > at ? done - at : 0;
        memcpy((uint8_t *)iov[i].iov_base + from, sp + at + from, iov[i].iov_len - from);
    }
}

/* The next landing piece of a PUSHV's payload, from its cursor (*pi: the piece, *po:
 * bytes into it; advanced): the runs its bytes land in (the `n` pieces of `list`,
 * offsets from `base`; of rows of `row` bytes `stride` apart, row 0: one run each),
 * at most UCX_LAND_PIECE bytes and UCX_LAND_IOV runs, into `iov` (*k). Returns the
 * piece's bytes. The list was checked (kv_pieces_ok). */
static uint64_t pieces_iov(struct iovec *iov, size_t *k, const uint8_t *list, uint64_t n, uint64_t base,
                           uint64_t row, uint64_t stride, uint64_t *pi, uint64_t *po) {
    uint64_t got = 0;
    *k = 0;
    while (*pi < n && *k < UCX_LAND_IOV && got < UCX_LAND_PIECE) {
        kv_ucx_piece p;
        memcpy(&p, list + *pi * sizeof p, sizeof p);
        uint64_t rl = row ? row : p.len, r = *po / rl, col = *po % rl, t = rl - col;
        t = t < UCX_LAND_PIECE - got ? t : UCX_LAND_PIECE - got;
        iov[*k].iov_base = (void *)(uintptr_t)(base + p.offset + r * (row ? stride : 0) + col);
        iov[(*k)++].iov_len = (size_t)t;
        got += t;
        if ((*po += t) == p.len) {
            (*pi)++;
            *po = 0;
        }
    }
    return got;
}

/* The bytes of a payload of rows `row` bytes long (1-D: its length) a landing piece takes:
 * UCX_LAND_PIECE, in whole rows (at least one, at most UCX_LAND_IOV) where it has several. */
static uint64_t piece_bytes(uint64_t row, uint64_t len) {
    if (row >= len)
        return UCX_LAND_PIECE;
    uint64_t k = UCX_LAND_PIECE / row;
    if (k == 0)
        k = 1;
    if (k > UCX_LAND_IOV)
        k = UCX_LAND_IOV;
    return k * row;
}

/* The way the next large staged 1-D piece lands (0: pread, 1: process_vm_writev): each
 * way is timed on its first 3 pieces (alternately), then the faster is taken and the
 * other timed again every UCX_PICK_PROBE pieces, so a change of the caches' memory (or a
 * noisy first measure) is learned again. Landing thread only. */
static int land_how(const ucx_land_pick *p) {
    if (p->n[0] < 3 || p->n[1] < 3)
        return p->n[1] < p->n[0];
    int best = p->ns_per_b[1] < p->ns_per_b[0];
    return p->pieces % UCX_PICK_PROBE == UCX_PICK_PROBE - 1 ? !best : best;
}

static void land_timed(ucx_land_pick *p, int how, uint64_t ns, uint64_t n) {
    double r = (double)ns / (double)n;
    p->ns_per_b[how] = p->n[how] ? 0.75 * p->ns_per_b[how] + 0.25 * r : r;
    p->n[how]++;
    p->pieces++;
}

/* May the next piece of a push on link `l` (NULL: abandoned) land now: the link
 * alive and our lease from the pusher held? If not, the drop is counted and a live
 * link is marked to fail at the next round (*marked = 1: marked by this call; the
 * round fails it, not a UCX callback). Caller holds c->lock. */
static int piece_may_land(kv_core *c, ucx_link *l, int *marked) {
    if (l && !l->dead && !l->refused && now_ns() < l->lease_until)
        return 1;
    c->stats.ucx_late_dropped++;
    if (l && !l->dead && !l->refused && !l->down_status) {
        c->stats.tcp_lease_expired++;
        l->down_status = KV_LLM_LINK_FAILED;
        *marked = 1;
    }
    return 0;
}

/* Land `len` bytes of a push at `dst` (checked by am_recv; rows of `row` bytes landing
 * `stride` apart, 1-D: row = len) from `src` (an eager payload, or the staging buffer
 * `st`): piece by piece, each copied only while
 * our lease from the pusher holds (the pusher may report the push failed from
 * then on), each one system call (copy_rows_into). Returns 1 if every byte landed; 0 if
 * the lease ran out first (the rest is dropped and the link fails at the next
 * round). Caller holds c->lock. */
static int land_checked(kv_ucx *u, ucx_link *l, uint64_t dst, uint64_t row, uint64_t stride, const void *src,
                        uint64_t len, const ucx_stage *st) {
    uint8_t *d = (uint8_t *)(uintptr_t)dst;
    uint64_t piece = piece_bytes(row, len);
    for (uint64_t off = 0; off < len; off += piece) {
        uint64_t n = len - off < piece ? len - off : piece;
        int marked = 0;
        if (!piece_may_land(u->core, l, &marked))
            return 0;
        copy_rows_into(u->pid, &u->self_copy, d, row, stride, src, off, n, st ? st->fd : -1, st ? st->skew : 0,
                       &u->rows_fd, &u->rows_len);
    }
    return 1;
}

/* Land a PUSHV's `len` bytes packed at `src` (or in `fd` from `fbase`) into its pieces
 * (`list`, `n` of them: pieces_iov), piece by piece as land_checked, each one system
 * call while our lease from the pusher holds. Returns 1 if every byte landed, 0 if the
 * lease ran out first. Caller holds c->lock. */
static int land_pieces_checked(kv_ucx *u, ucx_link *l, const uint8_t *list, uint64_t n, uint64_t base, uint64_t row,
                               uint64_t stride, const uint8_t *src, uint64_t len, int fd, uint64_t fbase) {
    struct iovec iov[UCX_LAND_IOV];
    uint64_t pi = 0, po = 0;
    for (uint64_t off = 0; off < len;) {
        int marked = 0;
        size_t k;
        if (!piece_may_land(u->core, l, &marked))
            return 0;
        uint64_t m = pieces_iov(iov, &k, list, n, base, row, stride, &pi, &po);
        copy_iov_into(u->pid, &u->self_copy, iov, k, m, src + off, fd, fbase + off, fd < 0 ? &u->rows_fd : NULL,
                      &u->rows_len);
        off += m;
    }
    return 1;
}

#ifdef KV_TEST_HOOKS
/* tests/native only (never in the extension): called by the landing thread between its
 * checks of a piece (piece_may_land, under c->lock) and the piece's copy, with the link's
 * `refused` mark, so a test can hold a piece there while it closes the link. */
void (*kv_test_land_hook)(const int *refused);
/* ...and by the I/O thread while it packs a PUSHV without c->lock (post_queue), with
 * the push's job id, so a test can abort the push right then. */
void (*kv_test_pack_hook)(uint64_t job_id);
#endif

/* The landing thread: a push's staged payload (recv_done queued it) lands piece
 * by piece as land_checked does (each copied only while the link is alive, its
 * push not aborted and our lease holds, checked under c->lock right before the
 * piece's one system call), while the I/O thread receives the next one. The op
 * stays a receive in progress of its link and push and keeps its region ref
 * until the round settles it (land_drain: ACK when due, on the I/O thread, the
 * only one that sends); a link that fails meanwhile drops what is queued
 * (recvs_abandon) and the op being landed stops after its current piece. */
static void *land_main(void *arg) {
    kv_ucx *u = arg;
    kv_core *c = u->core;
    pthread_mutex_lock(&c->lock);
    for (;;) {
        while (!u->land_head && !u->land_stop)
            pthread_cond_wait(&u->land_cond, &c->lock); /* land_join wakes it */
        if (u->land_stop)
            break; /* the I/O thread stopped: every link failed, the queue was dropped */
        ucx_op *op = u->land_head;
        u->land_head = op->qnext;
        if (!u->land_head)
            u->land_tail = NULL;
        op->qnext = NULL;
        op->landing = 2;
        uint8_t *d = (uint8_t *)(uintptr_t)op->dst;
        int self_copy = u->self_copy;
        int ok = 1;
        uint64_t piece = op->vlist ? UCX_LAND_PIECE : piece_bytes(op->row, op->len), data = op->len - op->vlist;
        uint64_t pi = 0, po = 0;
        const uint8_t *list = stage_at(op->stage), *sp = list + op->vlist; /* (a PUSHV's payload: its list first) */
        struct iovec iov[UCX_LAND_IOV];
        for (uint64_t off = 0; off < data;) {
            uint64_t n = data - off < piece ? data - off : piece, npi = pi, npo = po;
            size_t k = 0;
            ucx_link *l = op->link; /* NULL: abandoned (the link and its push states may be gone) */
            if (l && op->rx->aborted) {
                c->stats.ucx_dropped++; /* aborted while it landed: the rest is dropped */
                ok = 0;
                break;
            }
            int marked = 0;
            if (!piece_may_land(c, l, &marked)) {
                if (marked)
                    wake(u); /* the round fails the link */
                ok = 0;
                break;
            }
            if (op->vlist) /* this piece's runs (the cursor moves once it landed) */
                n = pieces_iov(iov, &k, list, op->vlist / sizeof(kv_ucx_piece), op->base, op->row, op->stride, &npi,
                               &npo);
            __atomic_store_n(&u->land_piece, op, __ATOMIC_RELEASE);
            pthread_mutex_unlock(&c->lock);
#ifdef KV_TEST_HOOKS
            if (kv_test_land_hook)
                kv_test_land_hook(l ? &l->refused : NULL);
#endif
            /* The lease once more, unlocked, right before the piece's system call: the
             * unlock above may itself have been one (a waiter on c->lock), where a
             * SIGSTOP takes effect; resumed after the lease ran out, the piece must not
             * land (tests/test_ucx_more.py's stopped peer saw 1 MiB land so in CI). */
            if (l && now_ns() >= __atomic_load_n(&l->lease_until, __ATOMIC_ACQUIRE)) {
                __atomic_store_n(&u->land_piece, NULL, __ATOMIC_RELEASE);
                pthread_mutex_lock(&c->lock);
                continue; /* this piece again: the checks above, under the lock, decide */
            }
            int way = -1; /* counted under the lock below */
            if (op->vlist) {
                copy_iov_into(u->pid, &self_copy, iov, k, n, sp + off, op->stage->fd,
                              op->stage->skew + op->vlist + off, NULL, NULL);
            } else if (op->row >= op->len && n >= UCX_PICK_MIN && op->stage->fd >= 0 && op->stage->mapped &&
                       self_copy) {
                /* a large 1-D piece: the faster way (land_how), timed */
                ucx_land_pick *p = &u->pick;
                int how = land_how(p);
                uint64_t t0 = now_ns();
                copy_into(u->pid, &self_copy, d + off, stage_at(op->stage) + off, n, how ? -1 : op->stage->fd,
                          op->stage->skew + off);
                land_timed(p, how, now_ns() - t0, n);
                way = how;
            } else {
                copy_rows_into(u->pid, &self_copy, d, op->row, op->stride, stage_at(op->stage), off, n, op->stage->fd,
                               op->stage->skew, NULL, NULL);
            }
            __atomic_store_n(&u->land_piece, NULL, __ATOMIC_RELEASE); /* recvs_abandon may wait for this */
            pthread_mutex_lock(&c->lock);
            if (way >= 0)
                (*(way ? &c->stats.ucx_land_pvw : &c->stats.ucx_land_pread))++;
            off += n;
            pi = npi;
            po = npo;
        }
        if (!op->link) { /* abandoned while it landed: recvs_abandon left its region to us */
            if (op->region)
                kv__region_unref(c, op->region);
            stage_put(u, op->stage);
            free(op);
            continue;
        }
        op->landing = ok ? 4 : 3;
        op->qnext = u->land_done;
        u->land_done = op;
        wake(u);
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

/* The round (c->lock held, I/O thread): payloads the landing thread is done with
 * end their receive; the push is settled (ACK when every byte landed). */
static void land_drain(kv_ucx *u) {
    kv_core *c = u->core;
    while (u->land_done) {
        ucx_op *op = u->land_done;
        u->land_done = op->qnext;
        ucx_link *l = op->link;
        ucx_rx *r = op->rx;
        op_del(&l->recvs, op);
        l->staged -= op->len;
        l->rx_ops--;
        c->stats.ucx_rx_pending--;
        r->receiving--;
        if (op->landing == 4)
            r->landed += op->len - op->vlist;
        if (!l->dead)
            rx_settle(l, r);
        if (op->region)
            kv__region_unref(c, op->region);
        stage_put(u, op->stage);
        free(op);
    }
}

/* The landing thread, started by the I/O thread when a target first has a
 * payload to land (a pusher never starts one). 0: it could not be started, or
 * the engine stops: the caller lands on its own thread as before. */
static int land_thread_ok(kv_ucx *u) {
    if (u->land_started)
        return 1;
    if (u->stop_requested)
        return 0;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    u->land_started = pthread_create(&u->land_thread, NULL, land_main, u) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (u->land_started)
        pthread_setname_np(u->land_thread, "kv-ucx-land");
    return u->land_started;
}

/* Stop and join the landing thread (after the I/O thread, which starts it: its
 * stop failed every link, so nothing is queued and the op being landed stops
 * after one piece). */
static void land_join(kv_ucx *u) {
    if (!u->land_started)
        return;
    pthread_mutex_lock(&u->core->lock);
    u->land_stop = 1;
    pthread_cond_broadcast(&u->land_cond);
    pthread_mutex_unlock(&u->core->lock);
    pthread_join(u->land_thread, NULL);
    u->land_started = 0;
}

/* `len` bytes of rows of `row` bytes, `stride` apart from `src`, packed into `out`
 * (a push's rows apart at the source, a PULL_REQ2D's answer); returns `out`. */
static void *pack_rows(void *out, uint64_t src, uint64_t len, uint64_t row, uint64_t stride) {
    uint8_t *pk = out;
    for (uint64_t off = 0; off < len; off += row, src += stride)
        memcpy(pk + off, (const void *)(uintptr_t)src, row);
    return out;
}

/* The `n` pieces of a PULL_REQV's list (kv_ucx_check checked them in the region at
 * `base`) packed into `out` in order, each one run or (row_len > 0) whole rows of
 * row_len bytes, `stride` apart; returns `out`. */
static void *pack_pieces(void *out, uint64_t base, const void *list, uint64_t n, uint64_t row_len,
                         uint64_t stride) {
    uint8_t *pk = out;
    for (uint64_t i = 0; i < n; i++) {
        kv_ucx_piece p;
        memcpy(&p, (const uint8_t *)list + i * sizeof p, sizeof p);
        pack_rows(pk, base + p.offset, p.len, row_len ? row_len : p.len, stride); /* 1-D: one row */
        pk += p.len;
    }
    return out;
}

/* A pull's answer (q->len bytes, its rows packed) into place: each row where its
 * request said (ucx_pull row, stride), or in one copy where they are one run. */
static void pull_land(const ucx_pull *q, const uint8_t *data) {
    uint8_t *d = (uint8_t *)(uintptr_t)q->dst;
    if (q->npieces) { /* a PULL_REQV's: its pieces in order */
        for (uint32_t i = 0; i < q->npieces; data += q->pieces[i++].len)
            memcpy((void *)(uintptr_t)q->pieces[i].offset, data, q->pieces[i].len);
        return;
    }
    if (q->stride == q->row) {
        memcpy(d, data, q->len);
        return;
    }
    for (uint64_t off = 0; off < q->len; off += q->row, d += q->stride)
        memcpy(d, data + off, q->row);
}

/* A PUSHV received into staging: its list (checked now, as kv_ucx_check checks an
 * eager one's) inside its region, the first piece where its header said (op->dst,
 * less the list: the staging's skew). */
static int vlist_ok(const ucx_op *op) {
    kv_ucx_piece p0;
    const uint8_t *list = stage_at(op->stage);
    memcpy(&p0, list, sizeof p0);
    return kv_pieces_ok(list, op->vlist / sizeof p0, op->rlen, op->len - op->vlist, op->row, op->stride,
                        UINT64_MAX) &&
           op->base + p0.offset == op->dst + op->vlist;
}

/* A rendezvous receive into staging ended (push data or a pull's answer): a
 * push's payload is queued for the landing thread, a pull's answer lands now. */
static void recv_done(void *request, ucs_status_t status, size_t length, void *user_data) {
    (void)length; /* the receive was posted for exactly op->len bytes */
    ucx_op *op = user_data;
    kv_ucx *u = op->u;
    kv_core *c = u->core;
    int own = cb_lock(u);
    ucx_link *l = op->link;
    int sig = 0;
    if (!l) { /* abandoned when its link failed: nothing lands */
        op_del(&u->orphans, op);
        c->stats.ucx_rx_orphans--;
        goto out;
    }
    op_del(&l->recvs, op);
    l->staged -= op->len;
    l->rx_ops--;
    c->stats.ucx_rx_pending--;
    if (op->rx) {
        ucx_rx *r = op->rx;
        r->receiving--;
        if (status == UCS_OK && op->vlist && !l->dead && !vlist_ok(op)) {
            c->stats.ucx_bad_msgs++; /* a PUSHV whose list is bad: nothing of it lands, the link fails */
            sig |= link_fail(u, l, KV_LLM_LINK_FAILED, 1);
        } else if (status == UCS_OK && r->aborted) {
            c->stats.ucx_dropped++; /* data of a push aborted while it was received */
        } else if (status == UCS_OK && !l->dead && (op->len > UCX_LAND_INLINE_MAX || l->recvs || l->defer_head) &&
                   land_thread_ok(u)) {
            /* it lands on the landing thread (land_main), the next receive meanwhile on
             * ours; it stays a receive in progress (its link's, its push's, its staging
             * budget's, its region ref) until the round settles it (land_drain). A small
             * one with nothing of its link to overlap lands here, below */
            r->receiving++;
            l->rx_ops++;
            c->stats.ucx_rx_pending++;
            l->staged += op->len;
            op_push(&l->recvs, op);
            op->landing = 1;
            op->qnext = NULL; /* desc: NULL since recv_post */
            if (u->land_tail)
                u->land_tail->qnext = op;
            else
                u->land_head = op;
            u->land_tail = op;
            pthread_cond_signal(&u->land_cond);
            cb_unlock(u, own, sig);
            if (request)
                ucp_request_free(request);
            return;
        } else if (status == UCS_OK && op->vlist) { /* (its list checked above unless the link is dead) */
            const uint8_t *list = stage_at(op->stage);
            if (!l->dead && land_pieces_checked(u, l, list, op->vlist / sizeof(kv_ucx_piece), op->base, op->row,
                                                op->stride, list + op->vlist, op->len - op->vlist, op->stage->fd,
                                                op->stage->skew + op->vlist))
                r->landed += op->len - op->vlist;
        } else if (status == UCS_OK && !op->vlist &&
                   land_checked(u, l, op->dst, op->row, op->stride, stage_at(op->stage), op->len, op->stage)) {
            r->landed += op->len; /* small, or no landing thread: landed here (the lease checked first) */
        }
        if (!l->dead)
            rx_settle(l, r);
    } else if (op->pull) {
        /* a pull's answer: its job still waits for it (a job stops waiting only when
         * its link fails, and that abandoned this receive) */
        ucx_pull *q = op->pull;
        for (ucx_pull **p = &l->pulls; *p; p = &(*p)->next)
            if (*p == q) {
                *p = q->next;
                break;
            }
        l->pull_inflight -= q->len;
        if (q->job) {
            q->job->ops_pending--;
            if (status == UCS_OK) {
                pull_land(q, stage_at(op->stage));
                q->job->job.bytes_done += q->len;
            } else if (q->job->job.record.status == KV_LLM_SUCCESS) {
                q->job->job.record.status = KV_LLM_LINK_FAILED;
            }
            sig |= job_maybe_done(u, q->job);
        }
        free(q);
    }
    if (op->region)
        kv__region_unref(c, op->region);
out:
    stage_put(u, op->stage);
    cb_unlock(u, own, sig);
    free(op);
    if (request)
        ucp_request_free(request);
}

/* Its link's staging budget: the window the pusher keeps to (and one message
 * over it), or UCX_STAGE_NO_WINDOW. A message waits (UCX holds it) while the
 * budget is used, unless nothing is staged. */
static uint64_t stage_budget(kv_ucx *u, ucx_link *l);

/* Post the receive of `op` (its descriptor) into a staging buffer. Caller holds c->lock. */
static void recv_post(kv_ucx *u, ucx_op *op) {
    ucx_link *l = op->link;
    void *desc = op->desc;
    op->desc = NULL;
    op->stage = stage_get(u, op->len, op->dst);
    op_push(&l->recvs, op);
    l->staged += op->len;
    if (!op->stage) {
        ucp_am_data_release(u->worker, desc);
        recv_done(NULL, UCS_ERR_NO_MEMORY, 0, op);
        return;
    }
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                             .cb.recv_am = recv_done, .user_data = op};
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(u->worker, desc, stage_at(op->stage), op->len, &p);
    if (r == NULL)
        recv_done(NULL, UCS_OK, op->len, op); /* under the lock: recv_done sees io_locked */
    else if (UCS_PTR_IS_ERR(r))
        recv_done(NULL, UCS_PTR_STATUS(r), 0, op);
}

/* Post the messages that waited for staging, as the budget allows (the round). */
static void recv_post_deferred(kv_ucx *u, ucx_link *l) {
    while (l->defer_head && (!l->staged || l->staged + l->defer_head->len <= stage_budget(u, l))) {
        ucx_op *op = l->defer_head;
        l->defer_head = op->lnext;
        if (!l->defer_head)
            l->defer_tail = NULL;
        op->lnext = NULL;
        recv_post(u, op);
    }
}

/* A PUSHV being received: its list's bytes (the payload begins with it), and the
 * region its pieces are in (address, bytes). */
typedef struct ucx_vmsg {
    uint64_t vlist, base, rlen;
} ucx_vmsg;

/* Receive `len` bytes of a message for `dst` (checked by the caller): eager
 * payloads are copied into place here (the caller checked the lease just
 * before), rendezvous ones are received into staging and land when complete
 * (recv_done), never straight into place: UCX would go on writing a receive it
 * started whatever our lease says (a target stopped and resumed), and it cannot
 * cancel one. Returns the handler's status. Caller holds c->lock. */
static ucs_status_t land(kv_ucx *u, ucx_link *l, void *data, uint64_t len, const ucp_am_recv_param_t *param,
                         uint64_t dst, uint64_t row, uint64_t stride, uint32_t region, ucx_rx *rx, ucx_pull *pull,
                         const ucx_vmsg *v) {
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        if (rx && v) { /* a PUSHV's list (checked by am_recv), then its data */
            const uint8_t *list = data;
            if (land_pieces_checked(u, l, list, v->vlist / sizeof(kv_ucx_piece), v->base, row, stride,
                                    list + v->vlist, len - v->vlist, -1, 0))
                rx->landed += len - v->vlist;
        } else if (rx && land_checked(u, l, dst, row, stride, data, len, NULL)) {
            rx->landed += len;
        }
        return UCS_OK;
    }
    ucx_op *op = calloc(1, sizeof *op);
    if (!op)
        return UCS_ERR_NO_MEMORY;
    op->u = u;
    op->link = l;
    op->rx = rx;
    op->pull = pull;
    op->len = len;
    op->dst = dst;
    op->row = row;
    op->stride = stride;
    op->region = region;
    op->desc = data;
    if (v) {
        op->vlist = v->vlist;
        op->base = v->base;
        op->rlen = v->rlen;
    }
    kv__region_ref(u->core, region); /* the memory stays mapped until the payload landed */
    l->rx_ops++;
    u->core->stats.ucx_rx_pending++;
    u->core->stats.ucx_rx_staged++;
    if (rx)
        rx->receiving++;
    if (pull)
        pull->receiving = 1;
    if (l->defer_head || (l->staged && l->staged + len > stage_budget(u, l))) {
        if (l->defer_tail) /* wait for staging: recv_post_deferred */
            l->defer_tail->lnext = op;
        else
            l->defer_head = op;
        l->defer_tail = op;
        return UCS_INPROGRESS;
    }
    recv_post(u, op);
    return UCS_INPROGRESS;
}

/* PULL_DATA's send completed: the region ref (a send from the region) is dropped. */
static void pull_data_sent(void *request, ucs_status_t status, void *user_data) {
    (void)status; /* the requester sees a failed answer as its link failing */
    ucx_op *op = user_data;
    kv_ucx *u = op->u;
    int own = cb_lock(u);
    op->link->rx_ops--;
    if (op->region)
        kv__region_unref(u->core, op->region);
    cb_unlock(u, own, 0);
    free(op);
    ucp_request_free(request);
}

/* A bad message on a live link: the link fails, nothing is written. */
static ucs_status_t bad(kv_ucx *u, ucx_link *l) {
    u->core->stats.ucx_bad_msgs++;
    u->io_sig |= link_fail(u, l, KV_LLM_LINK_FAILED, 1);
    return UCS_ERR_INVALID_PARAM;
}

/* Our job `id` if it is a live job of ours on link `l`. */
static ucx_job *our_job(kv_ucx *u, ucx_link *l, uint64_t id) {
    kv_job *j = (id & KV_EVENT) ? NULL : kv__job_find(u->core, id);
    if (!j || j->transport != &u->transport || ((ucx_job *)j)->link != l)
        return NULL;
    return (ucx_job *)j;
}

static ucs_status_t am_recv(void *arg, const void *header, size_t header_length, void *data, size_t length,
                            const ucp_am_recv_param_t *param) {
    kv_ucx *u = arg;
    kv_core *c = u->core;
    int own = cb_lock(u);
    int sig = 0;
    ucs_status_t ret = UCS_OK;
    kv_ucx_hdr2d g;
    kv_ucx_hdr h;
    uint64_t addr = 0;
    ucx_link *l = NULL;
    /* the link first: a message with no live link's token is a stranger's and is
     * dropped; one with a link's token and anything wrong after it fails that link */
    if (header && header_length >= KV_UCX_TOKEN)
        l = link_by_token(u, (const uint8_t *)header);
    if (!l || l->dead || l->refused || u->stopped) {
        c->stats.ucx_refused++;
        ret = UCS_ERR_CANCELED;
        goto out;
    }
    /* a PULL_REQV's list must be here (eager): a rendezvous one fails the check; a
     * rendezvous PUSHV's is checked once received (recv_done) */
    const void *list = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV ? NULL : data;
    uint32_t st = kv_ucx_check(c, header, header_length, list, length, &g, &addr);
    if (st != KV_LLM_SUCCESS) {
        ret = bad(u, l);
        goto out;
    }
    h = g.h;
    switch (h.type) {
    case KV_UCX_PUSH:
    case KV_UCX_PUSH2D:
    case KV_UCX_PUSHV: {
        ucx_rx *r = rx_find(l, h.job);
        if (r && r->aborted) { /* late data of an aborted push: never written */
            c->stats.ucx_dropped++;
            ret = UCS_ERR_CANCELED;
            break;
        }
        if (now_ns() >= l->lease_until) { /* no lease from the pusher: nothing lands */
            if (l->lease_until == 0) { /* never granted yet (the first grant is on its way) */
                c->stats.ucx_dropped++;
                ret = UCS_ERR_CANCELED;
                break;
            }
            c->stats.tcp_lease_expired++;
            u->io_sig |= link_fail(u, l, KV_LLM_LINK_FAILED, 1);
            ret = UCS_ERR_CANCELED;
            break;
        }
        if (!r && !(r = rx_add(l, h.job))) {
            ret = bad(u, l);
            break;
        }
        if (r->total == 0)
            r->total = h.total;
        if (r->total != h.total || h.len > r->total - r->claimed) {
            ret = bad(u, l); /* more bytes than the push announced */
            break;
        }
        r->claimed += h.len;
        c->stats.ucx_rx_rows += h.type == KV_UCX_PUSH2D;
        if (h.type == KV_UCX_PUSHV) { /* its pieces, of rows with the 2-D header (else row 0: runs) */
            kv_region *rg = kv__region_get(c, h.region); /* checked by kv_ucx_check */
            ucx_vmsg v = {.vlist = h.tag * sizeof(kv_ucx_piece), .base = rg->addr, .rlen = rg->len};
            int rows = header_length == sizeof g;
            ret = land(u, l, data, length, param, addr - v.vlist, rows ? g.row_len : 0, rows ? g.dst_stride : 0,
                       h.region, r, NULL, &v);
        } else {
            ret = land(u, l, data, h.len, param, addr, g.row_len, g.dst_stride, h.region, r, NULL, NULL);
        }
        c->stats.ucx_bytes_received += h.len;
        if (ret == UCS_OK) /* eager: landed (a rendezvous receive settles `r` when it ends; `r` may be gone) */
            rx_settle(l, r);
        break;
    }
    case KV_UCX_ABORT: {
        ucx_rx *r = rx_find(l, h.job);
        if (!r && !(r = rx_add(l, h.job))) {
            ret = bad(u, l);
            break;
        }
        if (!r->aborted)
            rx_tombstone(l, r);
        r->ack_owed = 1;
        rx_settle(l, r);
        break;
    }
    case KV_UCX_ACK:
    case KV_UCX_ABORT_ACK: {
        /* an answer to a push that ended already (an ABORT crossed its ACK) is
         * dropped; a pull's job id here is an impossible message */
        ucx_job *j = our_job(u, l, h.job);
        if (j && j->is_pull) {
            ret = bad(u, l);
            break;
        }
        if (!j)
            break;
        if (h.type == KV_UCX_ACK)
            j->acked = 1;
        else if (j->abort_state == 2)
            j->abort_state = 3;
        sig |= job_maybe_done(u, j);
        break;
    }
    case KV_UCX_LEASE_REQ: /* the peer asks us for a lease: granted now, by our clock */
        l->last_grant = now_ns();
        if (h.offset) /* the highest of our grants it has received: it will take our pushes */
            l->peer_leased = 1;
        c->stats.ucx_lease_grants++;
        send_ctl(l, KV_UCX_LEASE, 0, 0, 0, 0, h.tag);
        break;
    case KV_UCX_LEASE: { /* our lease runs from when we asked for it */
        if (h.tag == 0 || h.tag > l->lease_seq || l->lease_seq - h.tag >= 8) {
            ret = bad(u, l); /* a grant we never asked for */
            break;
        }
        if (h.tag > l->lease_seen) {
            if (!l->lease_seen)
                l->next_lease_req = 0; /* tell the peer at once (the next round's LEASE_REQ) */
            l->lease_seen = h.tag;
            __atomic_store_n(&l->lease_until, l->lease_asked[h.tag % 8] + l->lease_ns,
                             __ATOMIC_RELEASE); /* the landing thread reads it unlocked too */
        }
        break;
    }
    case KV_UCX_PULL_REQ:
    case KV_UCX_PULL_REQ2D:
    case KV_UCX_PULL_REQV: {
        /* answer from our region (checked): the peer's tag and job name its request. Rows
         * apart (PULL_REQ2D) or pieces (PULL_REQV; at most KV_UCX_MAX_PULL2D) are packed
         * after the op first, else the answer goes from the region, which stays referenced
         * until it is sent */
        int pack = g.dst_stride != g.row_len || h.type == KV_UCX_PULL_REQV;
        ucx_op *op = calloc(1, sizeof *op + (pack ? h.len : 0));
        if (!op) {
            ret = bad(u, l);
            break;
        }
        op->u = u;
        op->link = l;
        memcpy(op->hdr.token, l->tx_token, KV_UCX_TOKEN);
        op->hdr.type = KV_UCX_PULL_DATA;
        op->hdr.job = h.job;
        op->hdr.tag = h.tag;
        op->hdr.len = h.len;
        void *payload = (void *)(uintptr_t)addr;
        if (h.type == KV_UCX_PULL_REQV) {
            /* up to a message of pieces (msg_max), packed without c->lock where this callback
             * took it, so that no other thread of the engine waits for the copy: the region
             * stays referenced, the link is not reaped meanwhile (link_reap runs on the
             * worker's holder: us), and it is looked at again after */
            kv__region_ref(c, h.region);
            if (own) {
                u->io_locked = 0;
                pthread_mutex_unlock(&c->lock);
            }
            payload = pack_pieces(op + 1, addr, data, length / sizeof(kv_ucx_piece),
                                  header_length == sizeof g ? g.row_len : 0, g.dst_stride);
            if (own) {
                pthread_mutex_lock(&c->lock);
                u->io_locked = 1;
            }
            kv__region_unref(c, h.region);
            if (l->dead || l->refused || u->stopped) {
                free(op);
                ret = UCS_ERR_CANCELED;
                break;
            }
        } else if (pack) {
            payload = pack_rows(op + 1, addr, h.len, g.row_len, g.dst_stride);
        } else {
            op->region = h.region;
            kv__region_ref(c, h.region);
        }
        l->rx_ops++;
        ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                                 UCP_OP_ATTR_FIELD_FLAGS,
                                 .cb.send = pull_data_sent, .user_data = op,
                                 .flags = h.len >= UCX_RNDV_MIN ? UCP_AM_SEND_FLAG_RNDV : 0};
        ucp_mem_h mh = pack ? NULL : memh_of(u, h.region);
        if (mh) {
            p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
            p.memh = mh;
        }
        c->stats.ucx_bytes_sent += h.len;
        ucs_status_ptr_t r = ucp_am_send_nbx(l->ep, UCX_AM_ID, &op->hdr, sizeof op->hdr, payload, h.len, &p);
        if (r == NULL || UCS_PTR_IS_ERR(r)) {
            l->rx_ops--;
            if (op->region)
                kv__region_unref(c, op->region);
            free(op);
        }
        break;
    }
    case KV_UCX_PULL_DATA: {
        ucx_job *j = our_job(u, l, h.job);
        ucx_pull *q = l->pulls;
        while (q && q->tag != h.tag)
            q = q->next;
        if (!q && h.tag != 0 && h.tag < l->next_tag && (!j || !j->is_pull || j->job.state == KV_JS_ABORTING)) {
            /* a request we made, then dropped and freed (its pull aborted): late, discarded */
            c->stats.ucx_dropped++;
            ret = UCS_ERR_CANCELED;
            break;
        }
        if (!q || q->receiving || h.len != q->len || (q->job && q->job != j)) {
            ret = bad(u, l); /* not the answer to a request of ours */
            break;
        }
        if (!q->job) { /* dropped (aborted): discard */
            c->stats.ucx_dropped++;
            ret = UCS_ERR_CANCELED;
            break;
        }
        c->stats.ucx_bytes_received += h.len;
        if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
            ret = land(u, l, data, h.len, param, q->dst, h.len, h.len, q->region, NULL, q, NULL);
            break;
        }
        pull_land(q, data);
        for (ucx_pull **p = &l->pulls; *p; p = &(*p)->next)
            if (*p == q) {
                *p = q->next;
                break;
            }
        l->pull_inflight -= q->len;
        j->ops_pending--;
        j->job.bytes_done += q->len;
        free(q);
        sig |= job_maybe_done(u, j);
        break;
    }
    }
out:
    if (ret != UCS_INPROGRESS && !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV))
        ret = UCS_OK; /* eager data is released by UCX; an error status is for rendezvous only */
    cb_unlock(u, own, sig);
    return ret;
}

/* Run a command (I/O thread, c->lock held; UCP calls here call nothing back). */
static int run_cmd(kv_ucx *u, ucx_cmd *m) {
    int sig = 0;
    ucx_link *l = link_find(u, m->link_id);
    m->result = KV_LLM_SUCCESS;
    if (m->type == CMD_LINK_ADD) {
        if (l || link_by_token(u, m->rx_token)) {
            m->result = KV_LLM_PARAM_INVALID;
            return 0;
        }
        /* the peer's worker must not be ours: an endpoint to ourselves (the self
         * transport) would loop a peer's messages back into this process */
        ucp_worker_address_attr_t aa = {.field_mask = UCP_WORKER_ADDRESS_ATTR_FIELD_UID};
        if (ucp_worker_address_query((ucp_address_t *)m->buf, &aa) != UCS_OK || aa.worker_uid == u->uid) {
            m->result = KV_LLM_PARAM_INVALID;
            return 0;
        }
        l = calloc(1, sizeof *l);
        if (!l) {
            m->result = KV_LLM_OUT_OF_MEMORY;
            return 0;
        }
        l->u = u;
        l->peer_uid = aa.worker_uid;
        if ((l->ep = unpark_ep(u, aa.worker_uid)) != NULL) {
            l->peer_errors = 0; /* only endpoints without error handling are parked */
            goto have_ep;
        }
        ucp_ep_params_t ep = {
            .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                          UCP_EP_PARAM_FIELD_ERR_HANDLER,
            .address = (const ucp_address_t *)m->buf,
            .err_mode = UCP_ERR_HANDLING_MODE_PEER,
            .err_handler = {.cb = ep_error, .arg = l},
        };
        l->peer_errors = 1;
        ucs_status_t first = UCS_ERR_UNSUPPORTED;
        if (u->peer_errors) {
            quiet_attempt = 1;
            first = ucp_ep_create(u->worker, &ep, &l->ep);
            quiet_attempt = 0;
        }
        if (first != UCS_OK) {
            /* asked for (KVENGINE_UCX_PEER_ERRORS=0: UCX then picks its zero-copy
             * rendezvous, docs/benchmarks.md "UCX throughput, tuned"), or the
             * transports in use cannot report a peer failure (shared memory:
             * posix, sysv): an endpoint without error handling; the control
             * channel reports the peer's death then (docs/protocol.md, "UCX links") */
            ep.field_mask &= ~(uint64_t)UCP_EP_PARAM_FIELD_ERR_HANDLER;
            ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
            l->peer_errors = 0;
            if (ucp_ep_create(u->worker, &ep, &l->ep) != UCS_OK) {
                free(l);
                m->result = KV_LLM_LINK_FAILED;
                return 0;
            }
        }
    have_ep:
        l->shm_am = ep_has_transport(l->ep, UCX_SHM_TLS, 0); /* a protocol hint: every message is checked alike */
        l->shm_zc = l->shm_am && ep_has_transport(l->ep, UCX_ZCOPY_TLS, 0);
        l->id = m->link_id;
        memcpy(l->rx_token, m->rx_token, KV_UCX_TOKEN);
        memcpy(l->tx_token, m->tx_token, KV_UCX_TOKEN);
        l->window = m->window;
        l->fence_ns = m->fence_ns;
        l->lease_ns = m->lease_ns;
        l->margin_ns = m->margin_ns;
        l->peer_pull2d = !!(m->peer_flags & KV_UCX_PEER_PULL2D);
        l->peer_pullv = !!(m->peer_flags & KV_UCX_PEER_PULLV);
        l->peer_pushv = !!(m->peer_flags & KV_UCX_PEER_PUSHV);
        l->next_tag = 1;
        l->down_event = m->down_event;
        m->down_event = NULL;
        l->next = u->links;
        u->links = l;
    } else if (m->type == CMD_LINK_CLOSE) {
        if (l)
            sig |= link_fail(u, l, m->status, 0);
    } else if (m->type == CMD_TEST_SEND) {
        if (!l || l->dead || !l->ep) {
            m->result = KV_LLM_LINK_FAILED;
            return 0;
        }
        ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                 .flags = UCP_AM_SEND_FLAG_COPY_HEADER |
                                          (m->rndv ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER)};
        ucs_status_ptr_t r = ucp_am_send_nbx(l->ep, UCX_AM_ID, m->buf, m->len, m->buf2, m->len2, &p);
        if (UCS_PTR_IS_ERR(r)) {
            m->result = KV_LLM_FAILED;
        } else if (r != NULL) {
            /* the caller's payload must outlive the send: progress until it completed */
            pthread_mutex_unlock(&u->core->lock);
            u->io_locked = 0;
            while (ucp_request_check_status(r) == UCS_INPROGRESS)
                ucp_worker_progress(u->worker);
            pthread_mutex_lock(&u->core->lock);
            u->io_locked = 1;
            ucp_request_free(r);
        }
    }
    return sig;
}

/* ------------------------------------------------------------------ posting */

/* The largest message: a chunk, or half the window if that is more (each
 * rendezvous message costs a round trip: fewer, larger ones are faster, and two
 * keep the pipe busy; an abort waits for the messages in flight, at most the
 * window either way). */
static uint64_t msg_max(kv_ucx *u, ucx_link *l) {
    uint64_t n = u->core->chunk_bytes, w = l->window / 2;
    return w > n ? w : n;
}

/* Does a push message of `n` bytes on `l` go rendezvous (else eager)? */
static int push_rndv(const ucx_link *l, uint64_t n) {
    return n > (l->shm_zc ? UCX_SHM_ZC_EAGER_MAX : UCX_EAGER_MAX);
}

static uint64_t stage_budget(kv_ucx *u, ucx_link *l) {
    return l->window ? l->window + msg_max(u, l) : UCX_STAGE_NO_WINDOW;
}

/* Post chunks of the link's most urgent pushes, and ask for chunks of its most
 * urgent pulls, each while its window allows. Caller holds c->lock
 * (ucp_am_send_nbx calls nothing back here). */
static int post_queue(kv_ucx *u, ucx_link *l, int pulls);
static int post_chunks(kv_ucx *u, ucx_link *l) {
    return post_queue(u, l, 0) | post_queue(u, l, 1);
}

/* `n` more bytes of `j` posted, claimed across its segments; claimed whole, the job
 * leaves its queue (`head`, `tail`) and is SENT. Returns 1 if the loop must be signalled. */
static int claim_bytes(kv_ucx *u, kv_job **head, kv_job **tail, ucx_job *j, uint64_t n) {
    j->posted += n;
    while (n) {
        const kv_segment *s = &j->job.segments[j->job.claim_segment];
        uint64_t t = kv_seg_bytes(s) - j->job.claim_offset;
        t = t < n ? t : n;
        j->job.claim_offset += t;
        n -= t;
        if (j->job.claim_offset == kv_seg_bytes(s)) {
            j->job.claim_offset = 0;
            if (++j->job.claim_segment == j->job.nsegments) {
                kv__queue_remove(head, tail, &j->job);
                j->job.state = KV_JS_SENT;
                return job_maybe_done(u, j);
            }
        }
    }
    return 0;
}

/* How many whole segments of pull `j` from its claim point (at a segment's start) go
 * in one PULL_REQV: those of one region of the peer and one of ours, 1-D, or 2-D with
 * the first one's row length and stride there, at most `cap` bytes (*bytes) and
 * KV_UCX_MAX_PIECES of them; 0 unless two or more. *lpieces: the runs they are here
 * (a segment's rows apart here: one a row). *bytes and *lpieces are set only then. */
static size_t pullv_count(const ucx_job *j, uint64_t cap, uint64_t *bytes, size_t *lpieces) {
    const kv_segment *segs = j->job.segments, *s0 = &segs[j->job.claim_segment];
    size_t i0 = j->job.claim_segment, i = i0, lp = 0;
    int rows = s0->rows > 1;
    uint64_t sum = 0;
    if (j->job.claim_offset)
        return 0;
    while (i < j->job.nsegments && i - i0 < KV_UCX_MAX_PIECES && segs[i].remote_region == s0->remote_region &&
           j->job.region_refs[2 * i + 1] == j->job.region_refs[2 * i0 + 1] && kv_seg_bytes(&segs[i]) <= cap - sum) {
        const kv_segment *t = &segs[i];
        if (rows ? t->rows < 2 || t->len != s0->len || t->src_stride != s0->src_stride : t->rows > 1)
            break;
        lp += rows && t->dst_stride != t->len ? t->rows : 1;
        sum += kv_seg_bytes(t);
        i++;
    }
    if (i - i0 < 2)
        return 0;
    *bytes = sum;
    *lpieces = lp;
    return i - i0;
}

/* How many whole segments of push `j` from its claim point (at a segment's start) go in
 * one PUSHV: those for one region of the peer, each at most UCX_PUSHV_PIECE_MAX, one run
 * there (1-D, or rows back to back) or, as the first one, rows of one length and stride
 * there (*apart), at most `cap` bytes (*bytes) and KV_UCX_MAX_PIECES of them; 0 unless
 * two or more. *bytes and *apart are set only then. */
static size_t pushv_count(const ucx_job *j, uint64_t cap, uint64_t *bytes, int *apart) {
    const kv_segment *segs = j->job.segments, *s0 = &segs[j->job.claim_segment];
    size_t i0 = j->job.claim_segment, i = i0;
    int ap = s0->rows > 1 && s0->dst_stride != s0->len;
    uint64_t sum = 0;
    if (j->job.claim_offset)
        return 0;
    while (i < j->job.nsegments && i - i0 < KV_UCX_MAX_PIECES && segs[i].remote_region == s0->remote_region) {
        const kv_segment *t = &segs[i];
        uint64_t b = kv_seg_bytes(t);
        if (b > UCX_PUSHV_PIECE_MAX || b > cap - sum || (t->rows > 1 && t->dst_stride != t->len) != ap ||
            (ap && (t->len != s0->len || t->dst_stride != s0->dst_stride)))
            break;
        sum += b;
        i++;
    }
    if (i - i0 < 2)
        return 0;
    *bytes = sum;
    *apart = ap;
    return i - i0;
}

/* The `m` segments `s` of a PUSHV into `out`: their pieces in the peer's region (one a
 * segment: its rows there with the header's row_len and dst_stride, or one run), then
 * their bytes packed in order. */
static void pack_pushv(uint8_t *out, const kv_segment *s, size_t m) {
    uint8_t *pk = out + m * sizeof(kv_ucx_piece);
    for (size_t i = 0; i < m; i++) {
        kv_ucx_piece p = {.offset = s[i].dst, .len = kv_seg_bytes(&s[i])};
        memcpy(out + i * sizeof p, &p, sizeof p);
        int apart = s[i].rows > 1 && s[i].src_stride != s[i].len; /* rows apart here */
        pack_rows(pk, s[i].src, p.len, apart ? s[i].len : p.len, apart ? s[i].src_stride : p.len);
        pk += p.len;
    }
}

static int post_queue(kv_ucx *u, ucx_link *l, int pulls) {
    kv_core *c = u->core;
    kv_job **head = pulls ? &l->pull_head : &l->send_head, **tail = pulls ? &l->pull_tail : &l->send_tail;
    uint64_t *inflight = pulls ? &l->pull_inflight : &l->inflight;
    int sig = 0;
    while (!l->dead && *head && (l->window == 0 || *inflight < l->window)) {
        ucx_job *j = (ucx_job *)*head;
        if (j->job.state == KV_JS_ABORT_REQ) { /* acted on at the next round */
            kv__queue_remove(head, tail, &j->job);
            u->aborts = 1;
            continue;
        }
        if (!j->is_pull && !l->peer_leased)
            break; /* the peer holds no lease of ours yet: it would drop the data. A grant is not
                      enough: UCX may deliver our first PUSH before the LEASE (another lane) */
        size_t si = j->job.claim_segment;
        const kv_segment *s = &j->job.segments[si];
        uint64_t off = j->job.claim_offset, src_run, dst_run, mm = msg_max(u, l);
        uint64_t n = kv_seg_run(s, off, mm, &src_run, &dst_run); /* within one row */
        uint64_t rows = 1, cap = mm < UCX_SEND2D_MAX ? mm : UCX_SEND2D_MAX;
        if (s->rows > 1 && n == s->len && s->len <= cap / 2) {
            /* whole rows of a 2-D segment: a push's go as one PUSH2D (packed here), a pull
             * asks for them in one PULL_REQ2D (a pull has 2-D segments only where the peer
             * answers those: ucx_pull_2d) */
            uint64_t k = cap / s->len, left = s->rows - off / s->len;
            rows = k < left ? k : left;
            n = rows * s->len;
        }
        uint64_t roff = j->is_pull ? src_run : dst_run;
        uint64_t local = j->is_pull ? dst_run : src_run;
        uint32_t local_region = j->job.region_refs[2 * si + (j->is_pull ? 1 : 0)];
        ucx_op *op = NULL;
        ucx_pull *q = NULL;
        int failed = 0;
        if (j->is_pull) {
            /* a pull's small segments (1-D, or a head range's rows of a block) go several to
             * a PULL_REQV (a message's worth: a rendezvous costs the same for 256 KiB as for
             * 2 MiB), to a peer that answers it */
            uint64_t vcap = mm < KV_UCX_MAX_PULL2D ? mm : KV_UCX_MAX_PULL2D;
            size_t lp = 0, m = l->peer_pullv ? pullv_count(j, vcap, &n, &lp) : 0;
            q = calloc(1, sizeof *q + lp * sizeof(kv_ucx_piece));
            if (!q)
                break; /* the next round tries again */
            q->tag = l->next_tag++;
            q->job = j;
            q->dst = local;
            q->len = n;
            q->row = q->stride = n;
            q->region = local_region;
            int sent;
            if (m) { /* the answer lands in these segments (their rows), in order */
                for (size_t i = 0; i < m; i++) {
                    int apart = s[i].rows > 1 && s[i].dst_stride != s[i].len;
                    for (uint64_t r = 0; r < (apart ? s[i].rows : 1); r++, q->npieces++) {
                        q->pieces[q->npieces].offset = s[i].dst + r * s[i].dst_stride;
                        q->pieces[q->npieces].len = apart ? s[i].len : kv_seg_bytes(&s[i]);
                    }
                }
                c->stats.ucx_pullv++;
                c->stats.ucx_row_pulls += (uint64_t)(s->rows > 1);
                sent = send_req(l, KV_UCX_PULL_REQV, j->job.record.id, s->remote_region, 0, n, q->tag,
                                s->rows > 1 ? s->len : 0, s->rows > 1 ? s->src_stride : 0, s, m);
            } else {
                if (rows > 1) { /* the answer's rows land dst_stride apart */
                    q->row = s->len;
                    q->stride = s->dst_stride;
                }
                int two = rows > 1 && s->src_stride != s->len; /* rows apart at the source */
                c->stats.ucx_row_pulls += (uint64_t)two;
                sent = send_req(l, two ? KV_UCX_PULL_REQ2D : KV_UCX_PULL_REQ, j->job.record.id, s->remote_region,
                                roff, n, q->tag, two ? s->len : 0, two ? s->src_stride : 0, NULL, 0);
            }
            if (sent != 0) {
                free(q);
                failed = 1;
            } else {
                q->next = l->pulls;
                l->pulls = q;
                j->ops_pending++;
                l->pull_inflight += n;
            }
        } else {
            /* a push's small segments (blocks of a table, a head range's rows of a block) go
             * several to a PUSHV, packed here, to a peer that takes it */
            uint64_t vcap = mm < KV_UCX_MAX_PULL2D ? mm : KV_UCX_MAX_PULL2D, vn = 0;
            int vapart = 0;
            size_t m = l->peer_pushv ? pushv_count(j, vcap, &vn, &vapart) : 0, vlist = m * sizeof(kv_ucx_piece);
            if (m)
                n = vn;
            int pack = m || (rows > 1 && s->src_stride != s->len); /* rows apart at the source: packed here */
            op = malloc(sizeof *op + (pack ? vlist + n : 0));
            if (!op)
                break;
            memset(op, 0, sizeof *op);
            op->u = u;
            op->link = l;
            op->job = j;
            op->len = n;
            memcpy(op->hdr.token, l->tx_token, KV_UCX_TOKEN);
            op->hdr.type = KV_UCX_PUSH;
            op->hdr.region = s->remote_region;
            op->hdr.job = j->job.record.id;
            op->hdr.offset = roff;
            op->hdr.len = n;
            op->hdr.total = j->job.total_bytes;
            size_t hlen = sizeof op->hdr;
            uint64_t plen = n;
            void *payload = (void *)(uintptr_t)local;
            if (m) { /* the list and the segments' bytes, packed after the op */
                op->hdr.type = KV_UCX_PUSHV;
                op->hdr.offset = s->dst;
                op->hdr.tag = m;
                /* up to a message, packed without c->lock, so that no submit or completion
                 * on another thread waits for the copy: we hold the worker, so no other
                 * post_queue runs meanwhile; the job cannot complete while it has bytes
                 * left to claim, so its segments and their regions stay; an abort or a
                 * link failure meanwhile is looked for after */
                u->io_locked = 0;
                pthread_mutex_unlock(&c->lock);
                pack_pushv((uint8_t *)(op + 1), s, m);
#ifdef KV_TEST_HOOKS
                if (kv_test_pack_hook)
                    kv_test_pack_hook(j->job.record.id);
#endif
                pthread_mutex_lock(&c->lock);
                u->io_locked = 1;
                if (l->dead || j->job.state != KV_JS_SENDING) {
                    free(op); /* the round acts on it */
                    break;
                }
                payload = op + 1;
                plen = vlist + n;
                c->stats.ucx_pushv++;
                if (vapart) {
                    op->hdr2.row_len = s->len;
                    op->hdr2.dst_stride = s->dst_stride;
                    hlen = sizeof op->hdr2;
                }
            } else if (pack) { /* the rows, packed after the op (it lives until UCX is done with the send) */
                payload = pack_rows(op + 1, local, n, s->len, s->src_stride);
            }
            if (!m && rows > 1 && s->dst_stride != s->len) { /* rows apart at the target (else one run: a PUSH) */
                op->hdr.type = KV_UCX_PUSH2D;
                op->hdr2.row_len = s->len;
                op->hdr2.dst_stride = s->dst_stride;
                hlen = sizeof op->hdr2;
            }
            ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                                     UCP_OP_ATTR_FIELD_FLAGS,
                                     .cb.send = push_sent, .user_data = op,
                                     .flags = push_rndv(l, plen) ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER};
            ucp_mem_h mh = pack ? NULL : memh_of(u, local_region);
            if (mh) {
                p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
                p.memh = mh;
            }
            ucs_status_ptr_t req = ucp_am_send_nbx(l->ep, UCX_AM_ID, &op->hdr, hlen, payload, plen, &p);
            if (UCS_PTR_IS_ERR(req)) {
                free(op);
                failed = 1;
            } else if (req == NULL) {
                free(op);
            } else {
                /* the source (and its memh) stays registered until UCX is done with the
                 * request, also if its job completes first (detached at a link failure) */
                op->region = local_region;
                kv__region_ref(c, local_region);
                j->ops_pending++;
                l->inflight += n;
                op->lnext = l->sends;
                if (l->sends)
                    l->sends->lprev = op;
                l->sends = op;
            }
            if (!failed)
                c->stats.ucx_bytes_sent += n;
        }
        if (failed) {
            if (j->job.record.status == KV_LLM_SUCCESS)
                j->job.record.status = KV_LLM_LINK_FAILED;
            sig |= link_fail(u, l, KV_LLM_LINK_FAILED, 1);
            break;
        }
        sig |= claim_bytes(u, head, tail, j, n);
    }
    return sig;
}

/* An abort asked by kv_core_abort: stop posting; a push tells the target
 * (ABORT) and waits for its ABORT_ACK, a pull drops its requests. */
static int handle_abort(kv_ucx *u, ucx_job *j, uint64_t now) {
    ucx_link *l = j->link;
    if (j->job.queued)
        queue_del(l, j);
    j->job.state = KV_JS_ABORTING;
    j->due = now + l->fence_ns;
    if (l->dead) {
        j->job.state = KV_JS_FENCING;
        return job_maybe_done(u, j);
    }
    if (j->is_pull) {
        pulls_drop(l, j);
    } else if (j->posted && !j->acked) {
        j->abort_state = 2;
        if (send_ctl(l, KV_UCX_ABORT, j->job.record.id, 0, 0, 0, 0) != 0)
            return link_fail(u, l, KV_LLM_LINK_FAILED, 1);
    }
    return job_maybe_done(u, j);
}

/* Fence deadlines (aborted jobs not fenced in time) and endpoint errors.
 * Caller holds c->lock. */
static int timers(kv_ucx *u, uint64_t now) {
    int sig = 0;
    for (ucx_link *l = u->links; l; l = l->next) {
        if (l->dead) {
            for (ucx_job *j = l->active, *next; j; j = next) {
                next = j->next;
                if (j->job.state == KV_JS_FENCING && j->due <= now) {
                    job_detach(l, j);
                    sig |= job_maybe_done(u, j);
                }
            }
            continue;
        }
        if (l->down_status) {
            sig |= link_fail(u, l, l->down_status, 1);
            continue;
        }
        if (now >= l->next_lease_req) { /* ask the peer to renew our lease, every lease / 4 */
            l->next_lease_req = now + l->lease_ns / 4;
            l->lease_seq++;
            l->lease_asked[l->lease_seq % 8] = now;
            send_ctl(l, KV_UCX_LEASE_REQ, 0, 0, l->lease_seen, 0, l->lease_seq); /* offset: our last grant */
        }
        for (ucx_job *j = l->active; j; j = j->next)
            if (j->job.state == KV_JS_ABORTING && j->due && j->due <= now) {
                u->core->stats.tcp_fence_expired++;
                sig |= link_fail(u, l, KV_LLM_LINK_FAILED, 1);
                break;
            }
    }
    return sig;
}

/* 2: requests outstanding (progressed every UCX_BUSY_TICK_MS); 1: only endpoint closes
 * outstanding: UCX's events wake us for them (a flush close against a stopped peer stays
 * outstanding until the peer resumes or dies, and a 1 ms tick for it woke the thread ~900
 * times a second for as long: docs/decisions.md #30), so they are ticked at 1 ms only
 * while stopping; 0: idle. A stop waits for both, UCX_CLOSE_WAIT_NS at most. */
static int busy(kv_ucx *u) {
    int b = 0;
    for (ucx_link *l = u->links; l; l = l->next) {
        if (l->active || l->rx_ops)
            return 2;
        if (l->closing == 1)
            b = 1;
    }
    return b;
}

/* Unmap the regions released inside a UCP callback (ucx_region_freed deferred them), now
 * that no callback runs. Caller holds the worker and c->lock. */
static void unmap_released(kv_ucx *u) {
    while (u->unmap) {
        ucx_local *lo = u->unmap;
        u->unmap = lo->next;
        ucp_mem_unmap(u->context, lo->memh);
        free(lo);
    }
}

/* Sleep at most `tmo_ns`: 1 if our wake fd fired (work handed to this thread). The
 * worker's fd stays readable until the next arm (shared memory's signal socket):
 * only our own wake-ups and progress made count as activity. */
static int io_sleep_ns(kv_ucx *u, uint64_t tmo_ns) {
    struct epoll_event evs[4];
    struct timespec ts = {(time_t)(tmo_ns / 1000000000u), (long)(tmo_ns % 1000000000u)};
    int ne = epoll_pwait2(u->epoll_fd, evs, 4, &ts, NULL), woke = 0;
    for (int i = 0; i < ne; i++) {
        if (evs[i].data.u32 == 0) {
            uint64_t v;
            ssize_t r = read(u->wake_fd, &v, sizeof v);
            (void)r;
            woke = 1;
        }
    }
    return woke;
}

/* How long the I/O thread sleeps while it leaves the worker to a driver (its fd out of the
 * set, or the driver holding the lock): to the end of the quiet window, at most a busy
 * tick. A drive progresses every message that comes in while it runs; this bounds how
 * long one that comes in after it waits for this thread. */
static uint64_t quiet_left_ns(kv_ucx *u, uint64_t now) {
    uint64_t end = __atomic_load_n(&u->drove_ns, __ATOMIC_RELAXED) + UCX_DRIVE_QUIET_NS;
    uint64_t t = end > now ? end - now : 0;
    return t < UCX_QUIET_MIN_NS ? UCX_QUIET_MIN_NS : t > UCX_BUSY_TICK_MS * 1000000ull ? UCX_BUSY_TICK_MS * 1000000ull : t;
}

static void *io_main(void *arg) {
    kv_ucx *u = arg;
    kv_core *c = u->core;
    uint64_t last_busy = 0, stop_at = 0;
    int woke = 1, skipped = 0, skip_max = 0;
    for (;;) {
        int sig = 0;
        /* while the loop thread drives its pushes it holds the worker most of the time: a
         * tick (nothing handed to us) that finds it taken sleeps again rather than wait
         * for it (a futex wake-up for the driver and a context switch here, every ms),
         * at most skip_max ticks in a row (the round's timers) */
        int tick = (u->efd_off || __atomic_load_n(&u->drive_wanted, __ATOMIC_ACQUIRE)) && !woke &&
                   skipped < skip_max;
        if (tick && (__atomic_load_n(&u->drive_wanted, __ATOMIC_ACQUIRE) || pthread_mutex_trylock(&u->wlock) != 0)) {
            skipped++;
            if ((woke = io_sleep_ns(u, quiet_left_ns(u, now_ns()))) != 0)
                last_busy = now_ns();
            continue;
        }
        /* Never block on the worker's lock: a thread blocked on it is woken by every drive's
         * unlock and loses it to the next drive, and on two vCPUs that wake-up took the CPU
         * from the peer's I/O thread once a push (a one-layer push 10 -> 31-35 us for
         * seconds at a time: docs/benchmarks.md, "The slow state"). The driver progresses
         * the worker meanwhile; wait for new work or a tick instead, on the eventfd alone
         * (the worker's fd stays readable while the driver has not re-armed it). */
        if (!tick)
            while (pthread_mutex_trylock(&u->wlock) != 0) {
                struct pollfd pf = {.fd = u->wake_fd, .events = POLLIN};
                uint64_t left = quiet_left_ns(u, now_ns());
                struct timespec ts = {0, (long)left};
                if (ppoll(&pf, 1, &ts, NULL) > 0) {
                    uint64_t v;
                    ssize_t r = read(u->wake_fd, &v, sizeof v);
                    (void)r;
                    last_busy = now_ns();
                }
            }
        skipped = woke = 0;
        uint64_t now = now_ns();
        pthread_mutex_lock(&c->lock);
        u->io_locked = 1;
        int stop = u->stop_requested;
        while (u->cmds_head) {
            ucx_cmd *m = u->cmds_head;
            u->cmds_head = m->next;
            if (!u->cmds_head)
                u->cmds_tail = NULL;
            if (stop)
                m->result = KV_LLM_ENGINE_FINALIZED;
            else
                sig |= run_cmd(u, m);
            if (m->async) {
                free(m->down_event);
                free(m);
            } else {
                m->done = 1;
            }
        }
        pthread_cond_broadcast(&u->cmd_done);
        for (ucx_job *j = u->inbox_head, *next; j; j = next) {
            next = j->next;
            if (!j->driven || stop)
                sig |= take_job(u, j, stop);
        }
        if (u->aborts) { /* aborts requested since the last round */
            u->aborts = 0;
            for (ucx_link *l = u->links; l; l = l->next)
                for (ucx_job *j = l->active, *next; j; j = next) {
                    next = j->next;
                    if (j->job.state == KV_JS_ABORT_REQ)
                        sig |= handle_abort(u, j, now);
                }
        }
        land_drain(u);
        unmap_released(u);
        if (stop && !u->stopped) {
            u->stopped = 1;
            stop_at = now;
            for (ucx_link *l = u->links; l; l = l->next)
                sig |= link_fail(u, l, KV_LLM_ENGINE_FINALIZED, 0);
        }
        sig |= timers(u, now);
        for (ucx_link *l = u->links; l; l = l->next) {
            if (!l->dead)
                recv_post_deferred(u, l);
            sig |= post_chunks(u, l);
        }
        int working = busy(u);
        if (stop && (!working || now - stop_at > UCX_CLOSE_WAIT_NS)) {
            /* every job ended (or a close never completed: complete what is left) */
            for (ucx_link *l = u->links; l; l = l->next)
                while (l->active)
                    sig |= job_complete(u, l->active, KV_LLM_ENGINE_FINALIZED);
            link_reap(u);
            sig |= u->io_sig;
            u->io_sig = u->io_locked = 0;
            pthread_mutex_unlock(&c->lock);
            pthread_mutex_unlock(&u->wlock);
            if (sig)
                kv__signal_loop(c);
            break;
        }
        link_reap(u);
        sig |= u->io_sig;
        u->io_sig = u->io_locked = 0;
        pthread_mutex_unlock(&c->lock);
        if (sig)
            kv__signal_loop(c);

        /* progress until idle, then arm the worker's event fd and sleep */
        int progressed = 0;
        /* bounded: the round's timers (lease requests every lease / 4, fences) must run
         * while a large transfer keeps progress busy (each call: at most one message) */
        for (int k = 0; k < 64 && ucp_worker_progress(u->worker); k++)
            progressed = 1;
        now = now_ns();
        if (progressed)
            last_busy = now;
        uint64_t tmo_ns;
        /* the loop thread drives its small pushes (kv_ucx_submit_driven) and nothing else
         * is in flight: it progresses the worker itself, which this thread then need not
         * watch (a wake-up per push, on the CPU the peer's I/O thread needs) */
        int recent = !stop && now - __atomic_load_n(&u->drove_ns, __ATOMIC_RELAXED) < UCX_DRIVE_QUIET_NS;
        int drivers = recent && !working;
        if (drivers != u->efd_off) {
            struct epoll_event ev = {.events = drivers ? 0 : EPOLLIN, .data.u32 = 1};
            if (epoll_ctl(u->epoll_fd, EPOLL_CTL_MOD, u->worker_fd, &ev) == 0)
                u->efd_off = drivers;
        }
        uint64_t lease_ms = UINT64_MAX; /* the lease requests: every lease / 8 at least */
        for (ucx_link *l = u->links; l; l = l->next)
            if (!l->dead && l->lease_ns / 8000000 < lease_ms)
                lease_ms = l->lease_ns / 8000000;
        /* ticks a driver may take from this thread in a row */
        skip_max = lease_ms < UCX_DRIVE_SKIPS ? (int)lease_ms : UCX_DRIVE_SKIPS;
        if (u->efd_off) { /* no spin either (it would wait for the worker the driver holds): until the
                           * quiet window ends (the next drive extends it) */
            pthread_mutex_unlock(&u->wlock);
            tmo_ns = quiet_left_ns(u, now);
        } else if (now - last_busy < UCX_SPIN_NS && !recent) { /* (beside a driver: it is the one polling) */
            tmo_ns = 0;
            pthread_mutex_unlock(&u->wlock);
            sched_yield();
        } else if (ucp_worker_arm(u->worker) == UCS_ERR_BUSY) {
            pthread_mutex_unlock(&u->wlock);
            continue;
        } else {
            pthread_mutex_unlock(&u->wlock);
            int tmo = working == 2 || (stop && working) ? UCX_BUSY_TICK_MS : (int)(UCX_TICK_NS / 1000000);
            if (tmo > UCX_BUSY_TICK_MS && lease_ms < (uint64_t)tmo)
                tmo = (int)lease_ms + 1;
            tmo_ns = (uint64_t)tmo * 1000000u;
        }
        if ((woke = io_sleep_ns(u, tmo_ns)) != 0)
            last_busy = now_ns();
    }
    return NULL;
}

/* ------------------------------------------------------------------- API */

int kv_ucx_available(void) { return 1; }

/* Run `m` on the I/O thread; waits for it unless async (then `m` is the thread's). */
static uint32_t post_cmd(kv_core *c, ucx_cmd *m) {
    kv_ucx *u;
    uint32_t st = ucx_start(c, &u);
    if (st != KV_LLM_SUCCESS)
        return st;
    pthread_mutex_lock(&c->lock);
    if (u->stop_requested) {
        pthread_mutex_unlock(&c->lock);
        return KV_LLM_ENGINE_FINALIZED;
    }
    m->next = NULL;
    if (u->cmds_tail)
        u->cmds_tail->next = m;
    else
        u->cmds_head = m;
    u->cmds_tail = m;
    wake(u);
    if (m->async) {
        pthread_mutex_unlock(&c->lock);
        return KV_LLM_SUCCESS;
    }
    while (!m->done)
        pthread_cond_wait(&u->cmd_done, &c->lock); /* the thread runs every command before it stops */
    pthread_mutex_unlock(&c->lock);
    return m->result;
}

uint32_t kv_ucx_address(kv_core *c, uint8_t *out, size_t *len) {
    kv_ucx *u;
    uint32_t st = ucx_start(c, &u);
    if (st != KV_LLM_SUCCESS)
        return st;
    if (*len < u->address_len) {
        *len = u->address_len;
        return KV_LLM_PARAM_INVALID;
    }
    memcpy(out, u->address, u->address_len);
    *len = u->address_len;
    return KV_LLM_SUCCESS;
}

uint32_t kv_ucx_mem_map(kv_core *c, uint32_t region_id) {
    kv_ucx *u;
    uint32_t st = ucx_start(c, &u);
    if (st != KV_LLM_SUCCESS)
        return st;
    pthread_mutex_lock(&c->lock);
    kv_region *rg = kv__region_get(c, region_id);
    if (!rg || rg->removed)
        st = KV_LLM_KV_CACHE_NOT_EXIST;
    else if (rg->kind != KV_REGION_LOCAL || !(rg->flags & KV_REGION_F_EXPORT))
        st = KV_LLM_PARAM_INVALID; /* only this engine's own caches */
    if (st == KV_LLM_SUCCESS && !memh_of(u, region_id)) {
        /* mapped under the lock: the region cannot be released (and unmapped) meanwhile.
         * Nothing is packed: no peer ever gets an rkey of it */
        ucx_local *lo = calloc(1, sizeof *lo);
        ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                                   .address = (void *)(uintptr_t)rg->addr, .length = (size_t)rg->len};
        if (!lo) {
            st = KV_LLM_OUT_OF_MEMORY;
        } else if (ucp_mem_map(u->context, &mp, &lo->memh) != UCS_OK) {
            free(lo);
            st = KV_LLM_FAILED;
        } else {
            lo->region_id = region_id;
            lo->addr = rg->addr;
            lo->len = rg->len;
            lo->next = u->locals;
            u->locals = lo;
        }
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

uint32_t kv_ucx_link_add(kv_core *c, uint32_t link_id, const uint8_t *addr, size_t len, const uint8_t *rx_token,
                         const uint8_t *tx_token, uint64_t window, uint64_t lease_ns, uint64_t fence_ns,
                         uint64_t margin_ns, unsigned peer_flags) {
    const uint64_t lo = 1000000ull, hi = 3600000000000ull;
    if (link_id == 0 || link_id > INT32_MAX || len == 0 || len > KV_UCX_MAX_BLOB || fence_ns < lo || fence_ns > hi ||
        lease_ns < lo || lease_ns > hi || margin_ns > hi || !rx_token || !tx_token)
        return KV_LLM_PARAM_INVALID;
    kv_event *d = calloc(1, sizeof *d);
    if (!d)
        return KV_LLM_OUT_OF_MEMORY;
    d->record.kind = KV_RECORD_EVENT;
    d->record.id = KV_EVENT_LINK_DOWN | link_id;
    uint8_t *copy = malloc(len); /* ucp_worker_address_query takes a non-const pointer */
    if (!copy) {
        free(d);
        return KV_LLM_OUT_OF_MEMORY;
    }
    memcpy(copy, addr, len);
    ucx_cmd m = {.type = CMD_LINK_ADD, .link_id = link_id, .buf = copy, .len = len, .window = window,
                 .lease_ns = lease_ns, .fence_ns = fence_ns, .margin_ns = margin_ns, .peer_flags = peer_flags,
                 .down_event = d};
    memcpy(m.rx_token, rx_token, KV_UCX_TOKEN);
    memcpy(m.tx_token, tx_token, KV_UCX_TOKEN);
    uint32_t st = post_cmd(c, &m);
    free(m.down_event); /* NULL once the link took it */
    free(copy);
    return st;
}

uint32_t kv_ucx_link_close(kv_core *c, uint32_t link_id, uint32_t status) {
    /* Nothing of the link lands from now on, before the (asynchronous) command fails it:
     * its caller reports the link down next, and a staged payload of a dead peer's must
     * not land in memory the application may already reuse. Every landing checks
     * `refused` under c->lock (piece_may_land); a piece being copied now (the landing
     * thread's, one system call) ends first. */
    pthread_mutex_lock(&c->lock);
    kv_ucx *u = ucx_of(c);
    ucx_link *l = u ? link_find(u, link_id) : NULL;
    if (l) {
        __atomic_store_n(&l->refused, 1, __ATOMIC_SEQ_CST); /* atomic for the test hook's read */
        ucx_op *op; /* land_main clears land_piece before it takes the lock again; a piece stalled
                     * (a page fault) longer than the bound may land after, the one piece the
                     * fence cannot stop */
        for (uint64_t until = now_ns() + UCX_CLOSE_PIECE_WAIT_NS;
             (op = __atomic_load_n(&u->land_piece, __ATOMIC_ACQUIRE)) && op->link == l && now_ns() < until;)
            sched_yield();
    }
    pthread_mutex_unlock(&c->lock);
    if (!u)
        return KV_LLM_SUCCESS;
    ucx_cmd *m = calloc(1, sizeof *m);
    if (!m)
        return KV_LLM_OUT_OF_MEMORY;
    m->type = CMD_LINK_CLOSE;
    m->async = 1;
    m->link_id = link_id;
    m->status = status ? status : KV_LLM_LINK_FAILED;
    uint32_t st = post_cmd(c, m);
    if (st != KV_LLM_SUCCESS)
        free(m);
    return st;
}

uint32_t kv_ucx_test_send(kv_core *c, uint32_t link_id, const uint8_t *hdr, size_t hdr_len, const uint8_t *data,
                          size_t data_len, int rndv) {
    ucx_cmd m = {.type = CMD_TEST_SEND, .link_id = link_id, .buf = hdr, .len = hdr_len, .buf2 = data,
                 .len2 = data_len, .rndv = rndv};
    return post_cmd(c, &m);
}

/* ------------------------------------------------- the transport interface */


typedef struct {
    kv_ucx *u;
    ucx_link *l;   /* the driven job's (NULL: it completed at its take) */
    unsigned idle; /* progress calls in a row that found nothing */
} ucx_drive;

/* The driver's round: the worker's progress, and the link's chunks posted once they may
 * go (the first push of a link waits for the peer's lease: its grant arrives here). */
static int drive_progress(void *arg) {
    ucx_drive *d = arg;
    kv_ucx *u = d->u;
    int n = (int)ucp_worker_progress(u->worker);
    /* the answer comes from the peer's I/O thread: where it shares our CPU (two vCPUs and
     * three busy threads here), a driver that never yields keeps it off the CPU for a
     * whole time slice (a one-layer push took 270 us with the two pinned together, 16 us
     * yielding every UCX_DRIVE_YIELD empty calls) */
    if (n)
        d->idle = 0;
    else if (++d->idle % UCX_DRIVE_YIELD == 0)
        sched_yield();
    ucx_link *l = d->l;
    if (l && l->send_head && !l->dead && l->peer_leased) { /* as a callback would: cb_lock */
        int own = cb_lock(u);
        cb_unlock(u, own, post_chunks(u, l));
        n = 1;
    }
    return n;
}

/* Take job `j` off the inbox onto its link's send queue. Caller holds the worker
 * and c->lock. Returns 1 if the eventfd must be signalled. */
static int take_job(kv_ucx *u, ucx_job *j, int stop) {
    ucx_link *l = link_find(u, j->link_id);
    if (!l || l->dead || stop)
        return job_complete(u, j, stop ? KV_LLM_ENGINE_FINALIZED : KV_LLM_LINK_FAILED);
    inbox_remove(u, j);
    j->link = l;
    j->job.state = KV_JS_SENDING;
    list_add(&l->active, j);
    queue_add(l, j);
    return 0;
}

int kv_ucx_submit_driven(kv_core *c, uint64_t job_id, const uint64_t *segs, size_t nsegs, uint32_t lease,
                         uint64_t bound_ns, kv_completion *out, uint32_t *status) {
    kv_ucx *u = ucx_of(c);
    int done = 0;
    uint64_t nbytes = 0;
    driving = 1; /* ucx_submit: no wake-up of the I/O thread */
    *status = kv_core_submit_leased(c, job_id, segs, nsegs, 0, 0, lease, &done, &nbytes);
    driving = 0;
    if (*status != KV_LLM_SUCCESS || done || !u)
        return -1;
    /* the worker: the I/O thread holds it for one round at a time (microseconds), and
     * takes it again only after a tick while we want it */
    uint64_t t0 = now_ns();
    __atomic_store_n(&u->drive_wanted, 1, __ATOMIC_RELEASE);
    int got = kv__trylock_within(&u->wlock, bound_ns < UCX_DRIVE_LOCK_NS ? bound_ns : UCX_DRIVE_LOCK_NS);
    __atomic_store_n(&u->drive_wanted, 0, __ATOMIC_RELEASE);
    pthread_mutex_lock(&c->lock);
    kv_job *kj = kv__job_find(c, job_id); /* live (completed if its link failed meanwhile) */
    ucx_job *j = kj && kj->transport == &u->transport ? (ucx_job *)kj : NULL;
    ucx_link *jl = j ? link_find(u, j->link_id) : NULL;
    /* the worker busy, or the I/O thread's commands (a link's close) must go first, or its
     * link closed already: the I/O thread carries the job (in flight, it watches the worker
     * again; on a closed link it fails it), and nothing was driven */
    if (!got || u->cmds_head || !jl || jl->refused || jl->dead) {
        if (j)
            j->driven = 0;
        c->stats.ucx_drive_handed++;
        pthread_mutex_unlock(&c->lock);
        if (got)
            pthread_mutex_unlock(&u->wlock);
        wake(u);
        uint64_t spent = now_ns() - t0;
        return kv_core_wait_take(c, job_id, bound_ns > spent ? bound_ns - spent : 0, out);
    }
    u->io_locked = 1;
    int sig = 0;
    ucx_drive d = {.u = u, .l = NULL, .idle = 0};
    if (j && j->job.state == KV_JS_INBOX)
        sig |= take_job(u, j, u->stop_requested);
    if (j && jl && !jl->dead) {
        sig |= post_chunks(u, jl);
        d.l = jl;
    }
    sig |= u->io_sig;
    u->io_sig = u->io_locked = 0;
    pthread_mutex_unlock(&c->lock);
    if (sig)
        kv__signal_loop(c);
    __atomic_store_n(&u->drove_ns, now_ns(), __ATOMIC_RELAXED);
    driving = 2; /* callbacks run here now: what must wait for the I/O thread, waits (ucx_region_freed) */
    int found = kv__wait_take_driving(c, job_id, bound_ns, out, drive_progress, &d);
    driving = 0;
    __atomic_store_n(&u->drove_ns, now_ns(), __ATOMIC_RELAXED); /* (the quiet window: from its end) */
    pthread_mutex_lock(&c->lock);
    if (found)
        c->stats.ucx_driven++;
    else
        c->stats.ucx_drive_handed++;
    unmap_released(u);
    pthread_mutex_unlock(&c->lock);
    pthread_mutex_unlock(&u->wlock);
    if (!found) /* the I/O thread carries it on (in flight, it watches the worker again) */
        wake(u);
    return found;
}

static uint32_t ucx_submit(kv_transport *t, kv_job *job) {
    kv_ucx *u = (kv_ucx *)t;
    ucx_job *j = (ucx_job *)job;
    if (u->stop_requested)
        return KV_LLM_ENGINE_FINALIZED;
    j->link_id = (uint32_t)job->segments[0].pid;
    j->is_pull = job->segments[0].src_kind == KV_REGION_UCX;
    ucx_link *l = link_find(u, j->link_id);
    if (!l || l->dead)
        return KV_LLM_LINK_FAILED;
    /* the core checked every segment against its regions (one link, offset + length
     * inside the peer's region as announced); the peer checks them again against its own */
    kv__job_hash(u->core, job);
    job->state = KV_JS_INBOX;
    j->driven = driving == 1;
    inbox_append(u, j);
    if (!driving)
        wake(u);
    return KV_LLM_SUCCESS;
}

static uint32_t ucx_abort(kv_transport *t, kv_job *job, uint32_t status, int *sig) {
    kv_ucx *u = (kv_ucx *)t;
    ucx_job *j = (ucx_job *)job;
    if (job->state != KV_JS_INBOX && job->state != KV_JS_SENDING && job->state != KV_JS_SENT)
        return KV_LLM_PARAM_INVALID;
    if (job->record.status == KV_LLM_SUCCESS)
        job->record.status = status;
    u->core->stats.jobs_aborted++;
    if (job->state == KV_JS_INBOX) {
        *sig = job_complete(u, j, status);
        return KV_LLM_SUCCESS;
    }
    job->state = KV_JS_ABORT_REQ; /* stays in its link's active list; the round acts on it */
    u->aborts = 1;
    wake(u);
    return KV_LLM_SUCCESS;
}

static void ucx_stop(kv_transport *t) {
    kv_ucx *u = (kv_ucx *)t;
    kv_core *c = u->core;
    pthread_mutex_lock(&c->lock);
    if (u->stop_requested) {
        pthread_mutex_unlock(&c->lock);
        return;
    }
    u->stop_requested = 1;
    wake(u);
    pthread_mutex_unlock(&c->lock);
    pthread_join(u->thread, NULL);
    land_join(u);
}

static void ucx_region_freed(kv_transport *t, uint32_t region_id) {
    kv_ucx *u = (kv_ucx *)t;
    for (ucx_local **p = &u->locals; *p; p = &(*p)->next) {
        if ((*p)->region_id != region_id)
            continue;
        ucx_local *lo = *p;
        *p = lo->next;
        if ((pthread_equal(pthread_self(), u->thread) || driving) && !u->stopped) { /* inside a UCP callback: later */
            lo->next = u->unmap;
            u->unmap = lo;
            return;
        }
        ucp_mem_unmap(u->context, lo->memh);
        free(lo);
        return;
    }
}

static void ucx_destroy(kv_transport *t) {
    kv_ucx *u = (kv_ucx *)t;
    land_join(u); /* joined by ucx_stop already (a no-op then) */
    /* the worker first: destroying it may complete requests whose contexts name links */
    if (u->address)
        ucp_worker_release_address(u->worker, u->address);
    if (u->worker)
        ucp_worker_destroy(u->worker);
    while (u->links) {
        ucx_link *l = u->links;
        u->links = l->next;
        while (l->pulls) {
            ucx_pull *q = l->pulls;
            l->pulls = q->next;
            free(q);
        }
        while (l->sends) {
            ucx_op *op = l->sends;
            l->sends = op->lnext;
            free(op);
        }
        while (l->recvs || l->defer_head) { /* left by a stop that did not end them */
            ucx_op *op = l->recvs ? l->recvs : l->defer_head;
            if (op == l->recvs)
                l->recvs = op->lnext;
            else
                l->defer_head = op->lnext;
            if (op->stage)
                stage_free(op->stage);
            free(op);
        }
        rx_free_all(l);
        free(l->down_event);
        free(l);
    }
    while (u->orphans) {
        ucx_op *op = u->orphans;
        u->orphans = op->lnext;
        stage_put(u, op->stage);
        free(op);
    }
    while (u->stages) {
        ucx_stage *st = u->stages;
        u->stages = st->next;
        stage_free(st);
    }
    while (u->unmap) {
        ucx_local *lo = u->unmap;
        u->unmap = lo->next;
        lo->next = u->locals;
        u->locals = lo;
    }
    while (u->locals) {
        ucx_local *lo = u->locals;
        u->locals = lo->next;
        ucp_mem_unmap(u->context, lo->memh);
        free(lo);
    }
    if (u->context)
        ucp_cleanup(u->context);
    if (u->epoll_fd >= 0)
        close(u->epoll_fd);
    if (u->wake_fd >= 0)
        close(u->wake_fd);
    if (u->rows_fd >= 0)
        close(u->rows_fd);
    pthread_cond_destroy(&u->cmd_done);
    pthread_cond_destroy(&u->land_cond);
    free(u);
}

/* Does this pull take its 2-D segments as they are (kv_transport_ops.pull_2d)? Its
 * whole rows are then asked for in PULL_REQ2D messages of at most UCX_SEND2D_MAX,
 * which the peer answers with the rows packed: if the peer said it serves them
 * (KV_UCX_PEER_PULL2D; an older one does not, and the core pulls the rows one by
 * one). Caller holds c->lock. */
static int ucx_pull_2d(kv_transport *t, const kv_segment *rs, size_t nsegs) {
    (void)nsegs;
    ucx_link *l = link_find((kv_ucx *)t, (uint32_t)rs[0].pid);
    return l && !l->dead && l->peer_pull2d;
}

static const kv_transport_ops ucx_ops = {
    .job_size = sizeof(ucx_job),
    .seg2d = KV_T2D_PUSH, /* pushes: a 2-D segment's rows in PUSH2D messages */
    .pull_2d = ucx_pull_2d, /* pulls: PULL_REQ2D, or expanded into one segment per row */
    .submit = ucx_submit,
    .abort = ucx_abort,
    .stop = ucx_stop,
    .destroy = ucx_destroy,
    .region_freed = ucx_region_freed,
};

#endif
