/* kvengine TCP data plane: one epoll I/O thread per core.
 *
 * The thread owns every data connection. Push: DATA frames carry payload
 * straight from the registered source (sendmsg, no staging copy), striped over
 * the link's streams; the receiver checks each header against its region
 * table (exported region, offset and length in bounds, transfer consistent)
 * and recv()s the payload straight into place, under a lease the pusher
 * granted, then ACKs the transfer once every byte landed. Pull: READ requests
 * answered by RDATA frames. Abort is fenced: ABORT on every stream, completion
 * only after every ABORT_ACK (push; bounded by the fence, then the link fails
 * and the push completes at the lease release), or at once with a tombstone
 * that discards late RDATA (pull). Frames and fields: docs/protocol.md. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kv_internal.h"

#include <arpa/inet.h>
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the frame format is little-endian; add byte swaps for this target"
#endif

#define KV_MAGIC 0x3145564Bu /* "KVE1" */
enum { F_HELLO = 1, F_HELLO_ACK, F_DATA, F_ACK, F_ABORT, F_ABORT_ACK, F_READ, F_RDATA, F_RERR, F_CREDIT,
       F_LEASE_REQ, F_LEASE, F_LAST = F_LEASE };
#define F_FLAG_PULL 1u

#define KV_MAX_FRAME (64ull << 20)   /* payload bytes of one frame */
#define KV_MAX_TOTAL (1ull << 48)    /* bytes of one transfer */
#define KV_HELLO_NS 5000000000ull    /* an unauthenticated connection lives at most 5 s */
#define KV_MAX_PENDING 256           /* unauthenticated connections at once */
#define KV_MAX_CTRL 65536            /* queued control frames per connection */
#define KV_MAX_SERVE 4096            /* queued READs per connection */
#define KV_MAX_RX 65536              /* per link: open incoming transfers and pull tombstones */
#define KV_RX_BUCKETS 4096u          /* open incoming transfers per link: hash buckets */
#define KV_CTRL_BATCH 64             /* control frames written by one sendmsg */
#define KV_READ_WINDOW 4             /* chunks of READ outstanding per connection */
#define KV_SCRATCH (1u << 20)
#define KV_RECV_BUDGET (16u << 20)   /* bytes read from one connection per wake-up */
#ifndef KV_RECV_PLACE
#define KV_RECV_PLACE (256u << 10)   /* most DATA one recv() writes into place: what a receiver stalled
                                        inside that recv (page fault, preemption, SIGSTOP right after
                                        its lease check) can still land after its lease ended */
#endif
#define KV_TICK_NS 100000000ull      /* the I/O thread looks at its timers at least this often */
#define KV_ACCEPT_PAUSE_NS 100000000ull /* accept() out of descriptors/memory: stop listening this long */
#define KV_MIN_LEASE_NS 1000000ull      /* lease and fence: 1 ms .. 1 h */
#define KV_MAX_LEASE_NS 3600000000000ull
#ifndef KV_SPIN_NS
#define KV_SPIN_NS 300000ull         /* keep polling this long after the last event */
#endif

typedef struct {
    uint32_t magic;
    uint16_t type;
    uint16_t flags;
    uint32_t status;
    uint32_t region;  /* DATA/READ: region id on the frame's receiver; RDATA: segment index */
    uint64_t xfer;    /* the initiator's job id */
    uint64_t offset;  /* DATA/READ: offset in that region; RDATA: offset in the segment;
                         LEASE_REQ/LEASE: the requester's CLOCK_BOOTTIME ns when it asked */
    uint64_t length;  /* payload bytes (DATA/RDATA/HELLO), bytes asked (READ, RERR), bytes dropped
                         (ABORT_ACK), bytes of one DATA frame consumed (CREDIT) */
    uint64_t total;   /* bytes of the whole transfer */
    uint32_t region2; /* READ: the requester's segment index, echoed in RDATA */
    uint32_t pad;
    uint64_t offset2; /* READ: offset in that segment, echoed in RDATA */
} kv_frame;
typedef char kv_frame_is_64_bytes[sizeof(kv_frame) == 64 ? 1 : -1];

/* A TCP pull's answer tracking, allocated at submit (before the job can be
 * named by a frame) and handed to the pull's tombstone if it is aborted. Chunk
 * k is the k-th READ sent (segments in order, each cut at `chunk_bytes`). */
typedef struct kv_pull_tracking {
    size_t nsegments;
    uint64_t chunk_bytes;
    uint64_t nchunks;      /* chunks in all */
    uint64_t reads_sent;   /* READs sent: chunks 0 .. reads_sent-1 */
    uint64_t *segment_len; /* nsegments */
    uint64_t *first_chunk; /* chunks before each segment (nsegments + 1) */
    uint32_t *answered;    /* per chunk: bytes answered (RDATA header accepted) or given up */
    uint8_t *stream;       /* per chunk: the stream (index in the link) its READ went out on */
} kv_pull_tracking;

/* A push or pull over one link. Owned by the I/O thread once it leaves the
 * inbox, except the abort request (kv_core_abort, under c->mu). */
typedef struct kv_tcp_job {
    kv_job job;              /* first */
    uint32_t link_id;
    int is_pull;
    uint64_t frames;         /* frames (DATA or READ) started on the wire: claimed with the cursor */
    kv_pull_tracking *pull;  /* pull: answer tracking */
    uint32_t abort_acks_awaited; /* push, ABORTING: streams (bit = index in the link) whose ABORT_ACK is due */
    int acked;               /* push, ABORTING: the receiver ACKed every byte meanwhile */
    uint64_t due;            /* ABORTING: the fence deadline; FENCING: the release time (ns, CLOCK_BOOTTIME) */
    struct kv_tcp_job *inbox_next, *inbox_prev; /* the I/O inbox (INBOX) */
    struct kv_tcp_job *list_next, *list_prev;   /* the abort list (ABORT_REQ) or timed list (ABORTING, FENCING) */
} kv_tcp_job;

typedef struct kv_serve {
    uint64_t xfer, src, len, total, dst_off;
    uint32_t rid, dst_seg;
    struct kv_serve *next;
} kv_serve;

typedef struct kv_rx {
    uint64_t xfer, total, received;
    uint64_t claimed;  /* bytes of DATA headers accepted; received catches up as payloads end */
    int pull;          /* 1: tombstone of our aborted pull, 0: a push we receive */
    int aborted;
    int aborts_seen;   /* push: ABORTs received */
    uint32_t ack_wait; /* pull tombstone: streams whose ABORT_ACK is awaited */
    kv_pull_tracking *tracking; /* pull tombstone: the pull's answer tracking (late RDATA must still fit it) */
    struct kv_rx *next;
} kv_rx;

enum { C_HELLO_WAIT, C_HELLO_SENT, C_UP };
enum { RX_HDR, RX_PAYLOAD };

struct kv_link;

typedef struct kv_conn {
    int fd, state, out_armed, dead;
    int broken;   /* epoll_ctl failed on it: fail it at the next timer scan */
    int idx;      /* its index in link->conns */
    struct kv_link *link;
    uint64_t born;
    struct kv_conn *next;
    /* the lease (docs/protocol.md) */
    uint64_t lease_until; /* we may write the peer's DATA into place until then (0: never granted) */
    uint64_t granted_at;  /* the last LEASE we queued for the peer (0: never: no DATA of ours yet) */
    /* progress (the idle bound), at the round's time */
    uint64_t rx_mark, tx_mark;
    /* send */
    kv_frame *ctrl;
    size_t ch, cn, ccap;
    kv_frame cur;
    size_t cur_hsent;
    const uint8_t *cur_pay;
    uint64_t cur_len, cur_psent;
    int cur_on;
    uint32_t cur_ref; /* region ref held while an RDATA payload is sent */
    kv_serve *sq, *sq_tail;
    size_t sn;
    uint64_t reads_out; /* bytes of READ sent on this stream not yet answered (or given up) */
    /* receive */
    kv_frame rh;
    size_t rh_got;
    int rx_state, ptype, pdiscard;
    int pwin;         /* RDATA payload: its bytes return to this stream's READ window */
    uint8_t *pdst;
    uint64_t pleft, plen, pxfer;
    uint32_t pref;
    uint8_t tok[KV_TOKEN_BYTES];
} kv_conn;

typedef struct kv_link {
    uint32_t id;
    uint8_t token[KV_TOKEN_BYTES];
    int nstreams, nup, dead;
    kv_conn *conns[KV_MAX_STREAMS];
    int nconns;
    kv_job *sq_head, *sq_tail; /* jobs with frames left to claim, by rank */
    size_t sq_pulls;           /* pull jobs among them */
    uint64_t window;           /* push bytes on the wire (sent, not yet CREDITed) allowed; 0: no limit */
    uint64_t wire;             /* push bytes on the wire now */
    uint64_t lease, fence, margin; /* ns: kv_tcp_link_add */
    uint64_t renew_at;         /* next LEASE_REQ on every stream */
    uint64_t last_grant;       /* the last LEASE we queued on any stream (0: none) */
    kv_rx *rx[KV_RX_BUCKETS];
    size_t nrx;
    kv_event *ev_ready, *ev_down;
    struct kv_link *next;
} kv_link;

enum { CMD_LINK_ADD = 1, CMD_CONN_ADD, CMD_LINK_CLOSE };

typedef struct kv_cmd {
    int type, fd, nstreams;
    uint64_t window, lease, fence, margin;
    uint32_t link_id, status;
    uint8_t token[KV_TOKEN_BYTES];
    kv_event *ev_ready, *ev_down;
    struct kv_cmd *next;
} kv_cmd;

typedef struct kv_net {
    kv_transport transport; /* first: the core holds &transport */
    kv_core *c;
    pthread_t thread;
    int ep, wake;
    kv_link *links; /* changed under c->mu only */
    kv_conn *conns;
    int npending;
    uint8_t *scratch;
    uint64_t sent, received; /* payload bytes, flushed into c->st once per round */
    uint64_t now;            /* the round's time */
    int accept_paused;
    uint64_t accept_resume;
    int stopped;             /* stop acted on: links failed, waiting for the fenced pushes */
    /* under c->mu */
    int lfd;
    kv_cmd *cmd_head, *cmd_tail;
    kv_tcp_job *in_head, *in_tail; /* INBOX jobs, in submission order */
    kv_tcp_job *ab_head;           /* ABORT_REQ jobs */
    kv_tcp_job *tm_head;           /* ABORTING and FENCING jobs (their `due`) */
    int stop;
} kv_net;

/* `j` as a job of this transport, or NULL (none, or a mover job). */
static kv_tcp_job *tcp_job(kv_net *n, kv_job *j) {
    return j && j->transport == &n->transport ? (kv_tcp_job *)j : NULL;
}

/* Every time here, lease offsets included: CLOCK_BOOTTIME, which unlike
 * CLOCK_MONOTONIC keeps counting while the machine is suspended, so a lease
 * held across a suspend has expired on resume. Never compared across hosts. */
static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t sat_add(uint64_t a, uint64_t b) { return a + b < a ? UINT64_MAX : a + b; }

static void wake(kv_net *n) {
    uint64_t one = 1;
    ssize_t r;
    do
        r = write(n->wake, &one, sizeof one);
    while (r < 0 && errno == EINTR);
}

static void *io_main(void *arg);

static const kv_transport_ops tcp_ops;

/* The core's TCP transport, or NULL before the first use. Caller holds c->mu. */
static kv_net *net_of(kv_core *c) { return (kv_net *)kv__transport_get(c, KV_REGION_TCP); }

/* Start the I/O thread on first use. Caller holds c->mu. */
static uint32_t net_get(kv_core *c, kv_net **out) {
    if (c->closed)
        return KV_LLM_ENGINE_FINALIZED;
    if (net_of(c)) {
        *out = net_of(c);
        return KV_LLM_SUCCESS;
    }
    kv_net *n = calloc(1, sizeof *n);
    if (!n)
        return KV_LLM_OUT_OF_MEMORY;
    n->transport.ops = &tcp_ops;
    n->c = c;
    n->lfd = -1;
    n->scratch = malloc(KV_SCRATCH);
    n->ep = epoll_create1(EPOLL_CLOEXEC);
    n->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (!n->scratch || n->ep < 0 || n->wake < 0 || epoll_ctl(n->ep, EPOLL_CTL_ADD, n->wake, &ev) < 0)
        goto fail;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(&n->thread, NULL, io_main, n);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0)
        goto fail;
    kv__transport_register(c, KV_REGION_TCP, &n->transport);
    *out = n;
    return KV_LLM_SUCCESS;
fail:
    if (n->ep >= 0)
        close(n->ep);
    if (n->wake >= 0)
        close(n->wake);
    free(n->scratch);
    free(n);
    return KV_LLM_FAILED;
}

/* --------------------------------------------------------------- job states */

#ifndef NDEBUG
#define JS(x) (1u << KV_JS_##x)
static const unsigned js_next[KV_JS_DONE] = {
    [KV_JS_INBOX] = JS(SENDING) | JS(DONE),
    [KV_JS_SENDING] = JS(SENT) | JS(ABORT_REQ) | JS(FENCING) | JS(DONE),
    [KV_JS_SENT] = JS(ABORT_REQ) | JS(FENCING) | JS(DONE),
    [KV_JS_ABORT_REQ] = JS(ABORTING) | JS(FENCING) | JS(DONE),
    [KV_JS_ABORTING] = JS(FENCING) | JS(DONE),
    [KV_JS_FENCING] = JS(DONE),
};
#undef JS
#endif

/* The one place a TCP job changes state: checked (unless NDEBUG). */
static void js_to(kv_tcp_job *j, int to) {
#ifndef NDEBUG
    assert(j->job.state >= KV_JS_INBOX && j->job.state < KV_JS_DONE && (js_next[j->job.state] & (1u << to)));
#endif
    j->job.state = to;
}

/* The abort list (ABORT_REQ) and the timed list (ABORTING, FENCING) share list_next/list_prev. */
static void alist_add(kv_tcp_job **head, kv_tcp_job *j) {
    j->list_prev = NULL;
    j->list_next = *head;
    if (*head)
        (*head)->list_prev = j;
    *head = j;
}

static void alist_del(kv_tcp_job **head, kv_tcp_job *j) {
    if (j->list_prev)
        j->list_prev->list_next = j->list_next;
    else
        *head = j->list_next;
    if (j->list_next)
        j->list_next->list_prev = j->list_prev;
    j->list_next = j->list_prev = NULL;
}

static void inbox_del(kv_net *n, kv_tcp_job *j) {
    if (j->inbox_prev)
        j->inbox_prev->inbox_next = j->inbox_next;
    else
        n->in_head = j->inbox_next;
    if (j->inbox_next)
        j->inbox_next->inbox_prev = j->inbox_prev;
    else
        n->in_tail = j->inbox_prev;
    j->inbox_next = j->inbox_prev = NULL;
}

/* --------------------------------------------------------------- helpers */

static kv_link *link_find(kv_net *n, uint32_t id) {
    for (kv_link *l = n->links; l; l = l->next)
        if (l->id == id)
            return l;
    return NULL;
}

static unsigned rx_bucket(uint64_t x) { return (unsigned)((x * 0x9E3779B97F4A7C15ull) >> 52) & (KV_RX_BUCKETS - 1); }

static kv_rx *rx_find(kv_link *l, uint64_t xfer, int pull) {
    for (kv_rx *r = l->rx[rx_bucket(xfer)]; r; r = r->next)
        if (r->xfer == xfer && r->pull == pull)
            return r;
    return NULL;
}

static kv_rx *rx_new(kv_link *l, uint64_t xfer, int pull) {
    if (l->nrx >= KV_MAX_RX)
        return NULL;
    kv_rx *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->xfer = xfer;
    r->pull = pull;
    unsigned b = rx_bucket(xfer);
    r->next = l->rx[b];
    l->rx[b] = r;
    l->nrx++;
    return r;
}

static void rx_del(kv_link *l, kv_rx *r) {
    kv_rx **p = &l->rx[rx_bucket(r->xfer)];
    while (*p != r)
        p = &(*p)->next;
    *p = r->next;
    l->nrx--;
    free(r->tracking);
    free(r);
}

static void sq_remove(kv_link *l, kv_tcp_job *j) {
    if (kv__queue_remove(&l->sq_head, &l->sq_tail, &j->job))
        l->sq_pulls -= j->is_pull;
}

static void sq_insert(kv_link *l, kv_tcp_job *j) {
    kv__rank_insert(&l->sq_head, &l->sq_tail, &j->job);
    l->sq_pulls += j->is_pull;
}

/* A pull's answer tracking (one allocation), or NULL if out of memory. */
static kv_pull_tracking *ptrack_new(const kv_tcp_job *j, uint64_t chunk) {
    uint64_t nch = 0;
    for (size_t i = 0; i < j->job.nsegments; i++)
        nch += (j->job.segments[i].len + chunk - 1) / chunk; /* total < 2^64: no overflow */
    size_t ns = j->job.nsegments;
    if (nch > (SIZE_MAX / 2 - 8 * (2 * ns + 1) - sizeof(kv_pull_tracking)) / 5)
        return NULL;
    size_t sz = sizeof(kv_pull_tracking) + 8 * (2 * ns + 1) + 4 * (size_t)nch + (size_t)nch;
    kv_pull_tracking *pt = calloc(1, sz);
    if (!pt)
        return NULL;
    pt->nsegments = ns;
    pt->chunk_bytes = chunk;
    pt->nchunks = nch;
    pt->segment_len = (uint64_t *)(pt + 1);
    pt->first_chunk = pt->segment_len + ns;
    pt->answered = (uint32_t *)(pt->first_chunk + ns + 1);
    pt->stream = (uint8_t *)(pt->answered + nch);
    pt->first_chunk[0] = 0;
    for (size_t i = 0; i < ns; i++) {
        pt->segment_len[i] = j->job.segments[i].len;
        pt->first_chunk[i + 1] = pt->first_chunk[i] + (j->job.segments[i].len + chunk - 1) / chunk;
    }
    return pt;
}

/* Does RDATA header `h`, read on stream `idx`, answer the next bytes of a READ
 * this pull sent on that stream? If so, they are claimed and its chunk index
 * returned; else -1. A repeated, overlapping, out-of-order, unasked or
 * misrouted answer is a protocol violation (else a peer could complete a pull
 * with bytes unwritten; and a READ's window returns exactly once). */
static int64_t pull_claim(kv_pull_tracking *pt, const kv_frame *h, int idx) {
    if (h->region >= pt->nsegments || h->offset > pt->segment_len[h->region] ||
        h->length > pt->segment_len[h->region] - h->offset)
        return -1;
    uint64_t k = pt->first_chunk[h->region] + h->offset / pt->chunk_bytes, at = h->offset % pt->chunk_bytes;
    uint64_t clen = pt->segment_len[h->region] - (h->offset - at);
    if (clen > pt->chunk_bytes)
        clen = pt->chunk_bytes;
    if (k >= pt->reads_sent || pt->stream[k] != idx || at != pt->answered[k] || h->length > clen - at)
        return -1;
    pt->answered[k] += (uint32_t)h->length;
    return (int64_t)k;
}

/* Every READ of `pt` sent on stream `idx` is answered or dropped (its ABORT_ACK
 * came): what was not answered returns to that stream's READ window, and no
 * answer to it is accepted any more. */
static void pull_give_up(kv_pull_tracking *pt, kv_conn *k, int idx) {
    for (size_t i = 0; i < pt->nsegments; i++) {
        for (uint64_t q = pt->first_chunk[i]; q < pt->first_chunk[i + 1] && q < pt->reads_sent; q++) {
            if (pt->stream[q] != idx)
                continue;
            uint64_t off = (q - pt->first_chunk[i]) * pt->chunk_bytes, clen = pt->segment_len[i] - off;
            if (clen > pt->chunk_bytes)
                clen = pt->chunk_bytes;
            uint64_t left = clen - pt->answered[q];
            k->reads_out -= left < k->reads_out ? left : k->reads_out;
            pt->answered[q] = (uint32_t)clen;
        }
    }
}

static void discard_payloads(kv_link *l, kv_core *c, int ptype, uint64_t xfer);

/* Complete a TCP job (any state but DONE). Caller holds c->mu; returns 1 if the
 * loop must be signalled. */
static int tcp_complete(kv_net *n, kv_link *l, kv_tcp_job *j, uint32_t status) {
    if (j->job.queued) {
        assert(l);
        sq_remove(l, j);
    }
    /* RDATA payloads of a pull still arriving on other streams write into its
     * destination without a region ref: stop them now, or they land after the
     * completion, possibly in freed memory (e.g. a peer answering a READ twice,
     * or an abort with frames == 0; found by tests/native/fuzz_tcp.c). */
    if (l && !l->dead && j->is_pull)
        discard_payloads(l, n->c, F_RDATA, j->job.record.id);
    if (j->job.state == KV_JS_INBOX)
        inbox_del(n, j);
    else if (j->job.state == KV_JS_ABORT_REQ)
        alist_del(&n->ab_head, j);
    else if (j->job.state == KV_JS_ABORTING || j->job.state == KV_JS_FENCING)
        alist_del(&n->tm_head, j);
    js_to(j, KV_JS_DONE);
    free(j->pull);
    j->pull = NULL;
    return kv__job_complete(n->c, &j->job, status);
}

static int ctrl_push(kv_conn *k, const kv_frame *f) {
    if (k->cn == k->ccap) {
        if (k->ccap >= KV_MAX_CTRL)
            return -1;
        size_t cap = k->ccap ? k->ccap * 2 : 16;
        kv_frame *nf = malloc(cap * sizeof *nf);
        if (!nf)
            return -1;
        for (size_t i = 0; i < k->cn; i++)
            nf[i] = k->ctrl[(k->ch + i) % k->ccap];
        free(k->ctrl);
        k->ctrl = nf;
        k->ch = 0;
        k->ccap = cap;
    }
    k->ctrl[(k->ch + k->cn) % k->ccap] = *f;
    k->cn++;
    return 0;
}

static kv_frame frame(uint16_t type, uint16_t flags, uint64_t xfer) {
    kv_frame f;
    memset(&f, 0, sizeof f);
    f.magic = KV_MAGIC;
    f.type = type;
    f.flags = flags;
    f.xfer = xfer;
    return f;
}

/* Ask the peer for a lease on stream k (it echoes `offset`, our clock, in a LEASE). */
static int lease_request(kv_conn *k, uint64_t now) {
    kv_frame f = frame(F_LEASE_REQ, 0, 0);
    f.offset = now;
    return ctrl_push(k, &f);
}

static void arm(kv_net *n, kv_conn *k, int out) {
    if (k->dead || k->out_armed == out)
        return;
    struct epoll_event ev = {.events = EPOLLIN | (out ? EPOLLOUT : 0u), .data.ptr = k};
    if (epoll_ctl(n->ep, EPOLL_CTL_MOD, k->fd, &ev) < 0) {
        k->broken = 1; /* failed at the next timer scan (we may not hold the lock here) */
        return;
    }
    k->out_armed = out;
}

/* Close a connection and drop every region ref it holds. Caller holds c->mu.
 * A stream of a link is reset (SO_LINGER 0): the kernel drops what it still
 * holds for either side, so no frame of ours lands after the link failed.
 * The struct is freed at the end of the I/O iteration (it may be on the stack of a caller). */
static void conn_kill(kv_net *n, kv_conn *k) {
    if (k->dead)
        return;
    k->dead = 1;
    epoll_ctl(n->ep, EPOLL_CTL_DEL, k->fd, NULL); /* close() removes it anyway */
    if (k->link) {
        struct linger lg = {1, 0};
        setsockopt(k->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg); /* if it fails: a FIN; the lease still holds */
    }
    close(k->fd);
    if (k->cur_ref)
        kv__region_unref(n->c, k->cur_ref);
    if (k->pref)
        kv__region_unref(n->c, k->pref);
    k->cur_ref = k->pref = 0;
    while (k->sq) {
        kv_serve *s = k->sq;
        k->sq = s->next;
        kv__region_unref(n->c, s->rid);
        free(s);
    }
    if (k->state == C_HELLO_WAIT)
        n->npending--;
}

/* Close every stream of a link (reset) and end its jobs with `status`: pulls,
 * pushes with nothing on the wire and pushes the peer fenced (ACK) at once;
 * other pushes (the peer may still write their bytes under its lease) at the
 * lease release: the last lease we granted on the link + lease + margin.
 * Caller holds c->mu. */
static int link_fail(kv_net *n, kv_link *l, uint32_t status, int post_down) {
    int sig = 0;
    if (!l->dead) {
        l->dead = 1;
        if (post_down)
            n->c->st.tcp_links_failed++; /* counters: at once, under the lock (tests read them) */
        /* Only here: a dead link's streams were killed when it died and reap()
         * freed them at the end of that round, so a later link_fail of the same
         * link (kv_core_close, link_close or conn_add after a failure) must not
         * touch l->conns (heap-use-after-free found by tests/native/fuzz_tcp.c). */
        for (int i = 0; i < l->nconns; i++)
            conn_kill(n, l->conns[i]);
    }
    kv_core *c = n->c;
    uint64_t now = now_ns();
    uint64_t release = l->last_grant ? sat_add(l->last_grant, sat_add(l->lease, l->margin)) : 0;
    for (unsigned b = 0; b < KV_HASH_BUCKETS; b++) {
        kv_job *job = c->hash[b];
        while (job) {
            kv_job *next = job->hash_next;
            kv_tcp_job *j = tcp_job(n, job);
            if (!j || j->link_id != l->id || job->state == KV_JS_INBOX || job->state == KV_JS_FENCING) {
                job = next; /* inbox jobs: next round; fencing ones: already */
                continue;
            }
            if (j->is_pull || j->frames == 0 || j->acked) {
                sig |= tcp_complete(n, l, j, status);
            } else { /* a push the peer did not fence: its status says so, once its lease is over */
                j->job.record.status = status;
                if (release <= now) {
                    sig |= tcp_complete(n, l, j, status);
                } else {
                    if (j->job.queued)
                        sq_remove(l, j);
                    if (j->job.state == KV_JS_ABORT_REQ)
                        alist_del(&n->ab_head, j);
                    else if (j->job.state == KV_JS_ABORTING)
                        alist_del(&n->tm_head, j);
                    js_to(j, KV_JS_FENCING);
                    j->due = release;
                    alist_add(&n->tm_head, j);
                }
            }
            job = next;
        }
    }
    for (unsigned b = 0; b < KV_RX_BUCKETS; b++)
        while (l->rx[b])
            rx_del(l, l->rx[b]);
    if (post_down && l->ev_down) {
        l->ev_down->record.status = status;
        sig |= kv__post_event(c, l->ev_down);
        l->ev_down = NULL;
    }
    return sig;
}

/* Drop a connection: before authentication it is just closed (counted as
 * refused); after, its whole link fails. `bad`: a malformed frame. Caller holds c->mu. */
static int fail_conn(kv_net *n, kv_conn *k, int bad) {
    if (k->dead)
        return 0;
    if (!k->link) {
        n->c->st.tcp_refused++;
        conn_kill(n, k);
        return 0;
    }
    if (bad)
        n->c->st.tcp_bad_frames++;
    return link_fail(n, k->link, KV_LLM_LINK_FAILED, 1);
}

/* DATA was to be written into place on k without a valid lease. Caller holds c->mu. */
static int lease_fail(kv_net *n, kv_conn *k) {
    n->c->st.tcp_lease_expired++;
    return link_fail(n, k->link, KV_LLM_LINK_FAILED, 1);
}

/* ------------------------------------------------------------------ sending */

/* Pick the next frame for `k`. Caller holds c->mu. */
static int next_frame(kv_net *n, kv_conn *k) {
    if (k->cn) {
        k->cur = k->ctrl[k->ch];
        k->ch = (k->ch + 1) % k->ccap;
        k->cn--;
        k->cur_pay = k->cur.type == F_HELLO ? k->link->token : NULL;
        k->cur_len = k->cur.type == F_HELLO ? KV_TOKEN_BYTES : 0;
        goto start;
    }
    if (k->state != C_UP)
        return 0;
    if (k->sq) {
        kv_serve *s = k->sq;
        k->sq = s->next;
        if (!k->sq)
            k->sq_tail = NULL;
        k->sn--;
        k->cur = frame(F_RDATA, 0, s->xfer);
        k->cur.region = s->dst_seg;
        k->cur.offset = s->dst_off;
        k->cur.length = s->len;
        k->cur.total = s->total;
        k->cur_pay = (const uint8_t *)(uintptr_t)s->src;
        k->cur_len = s->len;
        k->cur_ref = s->rid; /* the ref moves from the task to the frame */
        free(s);
        goto start;
    }
    kv_link *l = k->link;
    uint64_t chunk = n->c->chunk;
    /* pushes wait while the window is full (the receiver has not consumed enough:
     * its CREDITs reopen it), and on a stream where we never granted the peer a
     * lease (its LEASE_REQ comes first: the LEASE then precedes our DATA in the
     * stream); then only pulls can go, if any are queued */
    int push_ok = (!l->window || l->wire < l->window) && k->granted_at;
    if (!push_ok && !l->sq_pulls)
        return 0;
    for (kv_tcp_job *j = (kv_tcp_job *)l->sq_head; j; j = (kv_tcp_job *)j->job.queue_next) {
        if (j->job.state != KV_JS_SENDING) /* ABORT_REQ: the I/O thread acts on it this round */
            continue;
        if (j->is_pull && k->reads_out >= KV_READ_WINDOW * chunk)
            continue;
        if (!j->is_pull && !push_ok)
            continue;
        const kv_segment *s = &j->job.segments[j->job.claim_segment];
        uint64_t off = j->job.claim_offset, len = s->len - off;
        if (len > chunk)
            len = chunk;
        size_t seg = j->job.claim_segment;
        j->job.claim_offset += len;
        if (j->job.claim_offset == s->len) {
            j->job.claim_offset = 0;
            if (++j->job.claim_segment == j->job.nsegments) {
                sq_remove(l, j);
                js_to(j, KV_JS_SENT);
            }
        }
        if (j->is_pull) {
            j->pull->stream[j->frames] = (uint8_t)k->idx; /* READ k is chunk k */
            j->pull->reads_sent = j->frames + 1;
            k->cur = frame(F_READ, 0, j->job.record.id);
            k->cur.region = s->remote_region;
            k->cur.offset = s->src + off;
            k->cur.length = len;
            k->cur.total = j->job.total_bytes;
            k->cur.region2 = (uint32_t)seg;
            k->cur.offset2 = off;
            k->cur_pay = NULL;
            k->cur_len = 0;
            k->reads_out += len;
        } else {
            l->wire += len;
            k->cur = frame(F_DATA, 0, j->job.record.id);
            k->cur.region = s->remote_region;
            k->cur.offset = s->dst + off;
            k->cur.length = len;
            k->cur.total = j->job.total_bytes;
            k->cur_pay = (const uint8_t *)(uintptr_t)(s->src + off);
            k->cur_len = len;
        }
        j->frames++;
        goto start;
    }
    return 0;
start:
    k->cur_on = 1;
    k->cur_hsent = 0;
    k->cur_psent = 0;
    return 1;
}

/* Write queued payload-less control frames (CREDIT, ACK, ABORT, ...) in one
 * sendmsg, when no frame is half-sent on this connection. A frame cut short
 * becomes the connection's current frame. Returns 1 if the loop must be
 * signalled; arms EPOLLOUT when the socket is full. */
static int send_ctrl(kv_net *n, kv_conn *k) {
    if (k->dead || k->cur_on || k->cn == 0)
        return 0;
    struct iovec iov[KV_CTRL_BATCH];
    int cnt = 0;
    while (cnt < KV_CTRL_BATCH && (size_t)cnt < k->cn) {
        kv_frame *f = &k->ctrl[(k->ch + (size_t)cnt) % k->ccap];
        if (f->type == F_HELLO)
            break; /* has a payload: conn_send sends it */
        iov[cnt].iov_base = f;
        iov[cnt++].iov_len = sizeof *f;
    }
    if (cnt == 0)
        return 0;
    struct msghdr m;
    memset(&m, 0, sizeof m);
    m.msg_iov = iov;
    m.msg_iovlen = (size_t)cnt;
    ssize_t r;
    do
        r = sendmsg(k->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (r < 0 && errno == EINTR);
    if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            arm(n, k, 1);
            return 0;
        }
        pthread_mutex_lock(&n->c->mu);
        int sig = fail_conn(n, k, 0);
        pthread_mutex_unlock(&n->c->mu);
        return sig;
    }
    k->tx_mark = n->now;
    size_t whole = (size_t)r / sizeof(kv_frame), part = (size_t)r % sizeof(kv_frame);
    k->ch = (k->ch + whole) % k->ccap;
    k->cn -= whole;
    if (part) { /* the rest of this frame goes out first, through conn_send */
        k->cur = k->ctrl[k->ch];
        k->ch = (k->ch + 1) % k->ccap;
        k->cn--;
        k->cur_pay = NULL;
        k->cur_len = 0;
        k->cur_psent = 0;
        k->cur_hsent = part;
        k->cur_on = 1;
    }
    if (k->cn || k->cur_on)
        arm(n, k, 1);
    return 0;
}

static int conn_send(kv_net *n, kv_conn *k) {
    kv_core *c = n->c;
    int sig = send_ctrl(n, k);
    for (int budget = 0; budget < 256 && !k->dead; budget++) {
        if (!k->cur_on) {
            pthread_mutex_lock(&c->mu);
            int got = next_frame(n, k);
            pthread_mutex_unlock(&c->mu);
            if (!got) {
                arm(n, k, 0);
                return sig;
            }
        }
        struct iovec iov[2];
        int cnt = 0;
        if (k->cur_hsent < sizeof k->cur) {
            iov[cnt].iov_base = (char *)&k->cur + k->cur_hsent;
            iov[cnt++].iov_len = sizeof k->cur - k->cur_hsent;
        }
        if (k->cur_psent < k->cur_len) {
            iov[cnt].iov_base = (void *)(uintptr_t)(k->cur_pay + k->cur_psent);
            iov[cnt++].iov_len = (size_t)(k->cur_len - k->cur_psent);
        }
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)cnt;
        ssize_t r = sendmsg(k->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                arm(n, k, 1);
                return sig;
            }
            pthread_mutex_lock(&c->mu);
            sig |= fail_conn(n, k, 0);
            pthread_mutex_unlock(&c->mu);
            return sig;
        }
        k->tx_mark = n->now;
        uint64_t got = (uint64_t)r;
        uint64_t h = sizeof k->cur - k->cur_hsent;
        if (got < h) {
            k->cur_hsent += (size_t)got;
            continue;
        }
        k->cur_hsent = sizeof k->cur;
        got -= h;
        k->cur_psent += got;
        if (k->cur.type == F_DATA || k->cur.type == F_RDATA)
            n->sent += got;
        if (k->cur_psent == k->cur_len) {
            k->cur_on = 0;
            if (k->cur_ref) {
                pthread_mutex_lock(&c->mu);
                kv__region_unref(c, k->cur_ref);
                pthread_mutex_unlock(&c->mu);
                k->cur_ref = 0;
            }
        }
    }
    arm(n, k, 1); /* budget used up: come back when writable */
    return sig;
}

/* ---------------------------------------------------------------- receiving */

/* A region this engine exports, or NULL. Caller holds c->mu. */
static kv_region *exported(kv_core *c, uint32_t id) {
    kv_region *r = kv__region_get(c, id);
    if (!r || r->removed || r->kind != KV_REGION_LOCAL || !(r->flags & KV_REGION_F_EXPORT))
        return NULL;
    return r;
}

/* A DATA frame of push `xfer` is part-way out on one of l's streams: its payload
 * is still read from the source by sendmsg. Caller holds c->mu. */
static int data_in_flight(kv_link *l, uint64_t xfer) {
    for (int i = 0; i < l->nconns; i++) {
        kv_conn *k = l->conns[i];
        if (!k->dead && k->cur_on && k->cur.type == F_DATA && k->cur.xfer == xfer)
            return 1;
    }
    return 0;
}

static void discard_payloads(kv_link *l, kv_core *c, int ptype, uint64_t xfer) {
    for (int i = 0; i < l->nconns; i++) {
        kv_conn *k = l->conns[i];
        if (!k->dead && k->rx_state == RX_PAYLOAD && k->ptype == ptype && k->pxfer == xfer && !k->pdiscard) {
            k->pdiscard = 1;
            if (k->pref) {
                kv__region_unref(c, k->pref);
                k->pref = 0;
            }
        }
    }
}

/* Act on an ABORT_REQ job: complete it now if nothing of it went out; else
 * ABORT on every stream, then push: ABORTING until every ABORT_ACK (or the
 * fence: the link fails); pull: a tombstone (late RDATA is checked, then
 * discarded) and complete now. Caller holds c->mu. */
static int handle_abort(kv_net *n, kv_tcp_job *j) {
    kv_link *l = link_find(n, j->link_id);
    if (!l || l->dead) /* (link_fail ends every job of its link: not reached) */
        return tcp_complete(n, l, j, KV_LLM_LINK_FAILED);
    if (j->job.queued)
        sq_remove(l, j);
    if (j->frames == 0)
        return tcp_complete(n, l, j, j->job.record.status);
    kv_frame f = frame(F_ABORT, j->is_pull ? F_FLAG_PULL : 0, j->job.record.id);
    uint32_t wait = 0;
    for (int i = 0; i < l->nconns; i++) {
        kv_conn *k = l->conns[i];
        if (k->dead || k->state != C_UP)
            continue;
        if (ctrl_push(k, &f) < 0)
            return link_fail(n, l, KV_LLM_LINK_FAILED, 1);
        wait |= 1u << i;
    }
    if (j->is_pull) {
        discard_payloads(l, n->c, F_RDATA, j->job.record.id);
        if (wait) {
            kv_rx *t = rx_new(l, j->job.record.id, 1);
            if (!t) /* KV_MAX_RX: a peer that never answers our ABORTs */
                return link_fail(n, l, KV_LLM_LINK_FAILED, 1);
            t->ack_wait = wait;
            t->tracking = j->pull; /* late answers must still be answers to what we asked */
            j->pull = NULL;
        }
        return tcp_complete(n, l, j, j->job.record.status);
    }
    if (!wait)
        return tcp_complete(n, l, j, j->job.record.status);
    j->abort_acks_awaited = wait;
    alist_del(&n->ab_head, j);
    js_to(j, KV_JS_ABORTING);
    j->due = sat_add(now_ns(), l->fence);
    alist_add(&n->tm_head, j);
    return 0;
}

#define BAD() (*sig |= fail_conn(n, k, 1), 0)

/* The frame handlers: the header is in k->rh, the stream is up (C_UP).
 * Each returns 0 if the connection was dropped. Caller holds c->mu. */

static int on_data(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->rh;
    kv_core *c = n->c;
    kv_link *l = k->link;
    kv_region *r = exported(c, h->region);
    if (h->length == 0 || h->length > KV_MAX_FRAME || h->total > KV_MAX_TOTAL || h->length > h->total || !r ||
        h->offset > r->len || h->length > r->len - h->offset)
        return BAD();
    kv_rx *x = rx_find(l, h->xfer, 0);
    if (!x) {
        if (!(x = rx_new(l, h->xfer, 0)))
            return BAD();
        x->total = h->total;
    }
    /* claimed, not received: two streams with payloads under way must not both
     * fit in what is left of the total */
    if (!x->aborted && (x->total != h->total || h->length > x->total - x->claimed))
        return BAD();
    if (!x->aborted && now_ns() >= k->lease_until) /* checked again before every recv into place */
        return *sig |= lease_fail(n, k), 0;
    k->pdiscard = x->aborted;
    if (!x->aborted) {
        x->claimed += h->length;
        kv__region_ref(c, h->region);
        k->pref = h->region;
        k->pdst = (uint8_t *)(uintptr_t)(r->addr + h->offset);
    }
    return 1;
}

static int on_rdata(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->rh;
    kv_link *l = k->link;
    if (h->length == 0 || h->length > KV_MAX_FRAME)
        return BAD();
    kv_tcp_job *j = tcp_job(n, kv__job_find(n->c, h->xfer));
    kv_rx *t;
    int64_t q;
    if (j && j->is_pull && j->link_id == l->id &&
        (j->job.state == KV_JS_SENDING || j->job.state == KV_JS_SENT || j->job.state == KV_JS_ABORT_REQ)) {
        if ((q = pull_claim(j->pull, h, k->idx)) < 0)
            return BAD();
        k->pdst = (uint8_t *)(uintptr_t)(j->job.segments[h->region].dst + h->offset);
        k->pdiscard = 0;
        k->pwin = 1;
    } else if ((t = rx_find(l, h->xfer, 1))) { /* our aborted pull: checked, then discarded */
        if ((q = pull_claim(t->tracking, h, k->idx)) < 0)
            return BAD();
        k->pdiscard = 1;
        k->pwin = 1;
    } else { /* an answer to nothing we asked (INBOX: nothing asked yet) */
        return BAD();
    }
    return 1;
}

static int on_ack(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->rh;
    kv_link *l = k->link;
    kv_tcp_job *j = tcp_job(n, kv__job_find(n->c, h->xfer));
    if (!j || j->is_pull || j->link_id != l->id)
        return BAD(); /* about no push of ours on this link */
    /* every frame must have been claimed (SENT, perhaps aborted since), and none
     * may be still going out: no honest receiver ACKs bytes not even sent yet,
     * and completing now would release the source while sendmsg still reads it
     * (heap-use-after-free found by tests/native/fuzz_tcp.c) */
    int all = j->job.claim_segment == j->job.nsegments;
    if (!all || !(j->job.state == KV_JS_SENT || j->job.state == KV_JS_ABORT_REQ || j->job.state == KV_JS_ABORTING) ||
        (j->job.state == KV_JS_ABORTING && j->acked) || data_in_flight(l, j->job.record.id))
        return BAD();
    if (!h->status)
        j->job.bytes_done = j->job.total_bytes; /* the receiver counted every byte in place */
    if (j->job.state == KV_JS_ABORTING) { /* fenced by ACK; its ABORT_ACKs still come: wait for them */
        j->acked = 1;
        return 1;
    }
    *sig |= tcp_complete(n, l, j, h->status ? h->status : KV_LLM_SUCCESS);
    return 1;
}

static int on_abort(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->rh;
    kv_link *l = k->link;
    kv_frame ack = frame(F_ABORT_ACK, h->flags & F_FLAG_PULL, h->xfer);
    if (h->flags & F_FLAG_PULL) { /* stop serving READs of that pull on this stream */
        kv_serve **p = &k->sq;
        k->sq_tail = NULL;
        while (*p) {
            kv_serve *s = *p;
            if (s->xfer == h->xfer) {
                *p = s->next;
                ack.length += s->len;
                kv__region_unref(n->c, s->rid);
                free(s);
                k->sn--;
            } else {
                k->sq_tail = s;
                p = &s->next;
            }
        }
    } else {
        kv_rx *x = rx_find(l, h->xfer, 0);
        if (!x && !(x = rx_new(l, h->xfer, 0)))
            return BAD();
        x->aborted = 1;
        discard_payloads(l, n->c, F_DATA, h->xfer);
        if (++x->aborts_seen >= l->nconns)
            rx_del(l, x);
    }
    if (ctrl_push(k, &ack) < 0)
        return BAD();
    return 1;
}

static int on_abort_ack(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->rh;
    kv_link *l = k->link;
    uint32_t bit = 1u << k->idx;
    if (h->flags & F_FLAG_PULL) {
        kv_rx *t = rx_find(l, h->xfer, 1);
        if (!t || !(t->ack_wait & bit))
            return BAD(); /* no ABORT of ours awaits it on this stream */
        /* the READs this stream carried are answered or dropped: the window gets
         * back exactly what we asked and saw no answer to (not the peer's length) */
        pull_give_up(t->tracking, k, k->idx);
        t->ack_wait &= ~bit;
        if (!t->ack_wait)
            rx_del(l, t);
        return 1;
    }
    kv_tcp_job *j = tcp_job(n, kv__job_find(n->c, h->xfer));
    if (!j || j->is_pull || j->link_id != l->id || j->job.state != KV_JS_ABORTING || !(j->abort_acks_awaited & bit))
        return BAD();
    j->abort_acks_awaited &= ~bit;
    if (j->abort_acks_awaited)
        return 1;
    /* the fence: every stream's ABORT (sent after its DATA) was answered; an
     * early ABORT_ACK must not complete the job under a frame still going out
     * (same use-after-free as an early ACK) */
    if (data_in_flight(l, j->job.record.id))
        return BAD();
    *sig |= tcp_complete(n, l, j, j->job.record.status);
    return 1;
}

static int on_read(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->rh;
    kv_core *c = n->c;
    if (h->length == 0 || h->length > KV_MAX_FRAME || k->sn >= KV_MAX_SERVE)
        return BAD();
    kv_region *r = exported(c, h->region);
    if (!r) { /* unregistered meanwhile: the requester gets a status, the link lives */
        kv_frame e = frame(F_RERR, 0, h->xfer);
        e.status = KV_LLM_KV_CACHE_NOT_EXIST;
        e.length = h->length;
        if (ctrl_push(k, &e) < 0)
            return BAD();
        return 1;
    }
    if (h->offset > r->len || h->length > r->len - h->offset)
        return BAD();
    kv_serve *s = calloc(1, sizeof *s);
    if (!s)
        return *sig |= fail_conn(n, k, 0), 0;
    s->xfer = h->xfer;
    s->src = r->addr + h->offset;
    s->len = h->length;
    s->total = h->total;
    s->rid = h->region;
    s->dst_seg = h->region2;
    s->dst_off = h->offset2;
    kv__region_ref(c, h->region);
    if (k->sq_tail)
        k->sq_tail->next = s;
    else
        k->sq = s;
    k->sq_tail = s;
    k->sn++;
    return 1;
}

static int on_rerr(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->rh;
    kv_link *l = k->link;
    kv_tcp_job *j = tcp_job(n, kv__job_find(n->c, h->xfer));
    if (j && j->is_pull && j->link_id == l->id &&
        (j->job.state == KV_JS_SENDING || j->job.state == KV_JS_SENT || j->job.state == KV_JS_ABORT_REQ) && j->frames) {
        /* a READ named a region the peer no longer exports: the pull ends with
         * that status (aborted: tombstone; the READ's window returns with the
         * stream's ABORT_ACK, not by this frame's length) */
        if (j->job.record.status == KV_LLM_SUCCESS)
            j->job.record.status = h->status ? h->status : KV_LLM_FAILED;
        if (j->job.state != KV_JS_ABORT_REQ) {
            js_to(j, KV_JS_ABORT_REQ);
            alist_add(&n->ab_head, j);
        }
        *sig |= handle_abort(n, j);
        return !k->dead;
    }
    if (rx_find(l, h->xfer, 1)) /* a READ of our aborted pull, refused before our ABORT came */
        return 1;
    return BAD(); /* about nothing we asked */
}

static int on_lease_req(kv_net *n, kv_conn *k, int *sig) {
    kv_frame g = frame(F_LEASE, 0, 0);
    g.offset = k->rh.offset; /* the requester's clock, echoed: its lease runs from there */
    if (ctrl_push(k, &g) < 0)
        return BAD();
    uint64_t t = now_ns();
    k->granted_at = t; /* from now on our DATA may go on this stream */
    k->link->last_grant = t;
    return 1;
}

static int on_lease(kv_net *n, kv_conn *k, int *sig) {
    uint64_t t = now_ns(), off = k->rh.offset;
    if (off > t) /* our clock, from a LEASE_REQ of ours: never in the future */
        return BAD();
    uint64_t until = sat_add(off, k->link->lease); /* a stale grant (read late) gives a stale lease */
    if (until > k->lease_until)
        k->lease_until = until;
    return 1;
}

/* Validate a received header and set up its payload. Returns 0 if the
 * connection was dropped. Caller holds c->mu. */
static int on_header(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->rh;
    kv_core *c = n->c;
    if (h->magic != KV_MAGIC || h->type < F_HELLO || h->type > F_LAST)
        return BAD();
    if (k->state == C_HELLO_WAIT) {
        if (h->type != F_HELLO || h->length != KV_TOKEN_BYTES)
            return BAD();
        k->ptype = F_HELLO;
        k->pdst = k->tok;
        k->pleft = k->plen = KV_TOKEN_BYTES;
        k->pdiscard = 0;
        k->rx_state = RX_PAYLOAD;
        return 1;
    }
    kv_link *l = k->link;
    if (k->state == C_HELLO_SENT) {
        if (h->type != F_HELLO_ACK)
            return BAD();
        k->state = C_UP;
        if (lease_request(k, now_ns()) < 0)
            return *sig |= fail_conn(n, k, 0), 0;
        if (++l->nup == l->nstreams && l->ev_ready) {
            *sig |= kv__post_event(c, l->ev_ready);
            l->ev_ready = NULL;
        }
        return 1;
    }
    switch (h->type) {
    case F_DATA:
        if (!on_data(n, k, sig))
            return 0;
        break;
    case F_RDATA:
        if (!on_rdata(n, k, sig))
            return 0;
        break;
    case F_ACK:
        return on_ack(n, k, sig);
    case F_ABORT:
        return on_abort(n, k, sig);
    case F_ABORT_ACK:
        return on_abort_ack(n, k, sig);
    case F_READ:
        return on_read(n, k, sig);
    case F_RERR:
        return on_rerr(n, k, sig);
    case F_CREDIT: /* the receiver consumed one of our DATA frames: the window moves */
        if (h->length > KV_MAX_FRAME)
            return BAD();
        l->wire -= h->length < l->wire ? h->length : l->wire;
        return 1;
    case F_LEASE_REQ:
        return on_lease_req(n, k, sig);
    case F_LEASE:
        return on_lease(n, k, sig);
    default: /* HELLO, HELLO_ACK on an authenticated stream */
        return BAD();
    }
    k->ptype = h->type;
    k->pxfer = h->xfer;
    k->pleft = k->plen = h->length;
    k->rx_state = RX_PAYLOAD;
    return 1;
}

static int tokens_equal(const uint8_t *a, const uint8_t *b) {
    uint8_t d = 0;
    for (int i = 0; i < KV_TOKEN_BYTES; i++)
        d |= (uint8_t)(a[i] ^ b[i]);
    return d == 0;
}

/* A frame's payload is in place. Caller holds c->mu. Returns 0 if the connection was dropped. */
static int on_payload(kv_net *n, kv_conn *k, int *sig) {
    kv_core *c = n->c;
    k->rx_state = RX_HDR;
    if (k->pref) {
        kv__region_unref(c, k->pref);
        k->pref = 0;
    }
    if (k->ptype == F_HELLO) {
        kv_link *l = n->links;
        while (l && (l->dead || !tokens_equal(l->token, k->tok) || l->nconns >= l->nstreams))
            l = l->next;
        if (!l)
            return BAD();
        k->idx = l->nconns;
        l->conns[l->nconns++] = k;
        k->link = l;
        k->state = C_UP;
        n->npending--;
        kv_frame ack = frame(F_HELLO_ACK, 0, 0);
        if (ctrl_push(k, &ack) < 0 || lease_request(k, now_ns()) < 0)
            return *sig |= fail_conn(n, k, 0), 0;
        return 1;
    }
    kv_link *l = k->link;
    if (k->ptype == F_DATA) {
        /* every DATA frame consumed, written or discarded, is CREDITed on its
         * stream: the sender keeps at most its window on the wire, paced here
         * with no Python round trip (unbounded, a large push ran ~8% slower:
         * docs/tuning.md, tcp_window_bytes) */
        kv_frame cr = frame(F_CREDIT, 0, k->pxfer);
        cr.length = k->plen;
        if (ctrl_push(k, &cr) < 0)
            return BAD();
        kv_rx *x = rx_find(l, k->pxfer, 0);
        if (!k->pdiscard)
            n->received += k->plen;
        if (x && !x->aborted) {
            x->received += k->plen;
            if (x->received == x->total) {
                kv_frame ack = frame(F_ACK, 0, k->pxfer);
                rx_del(l, x);
                if (ctrl_push(k, &ack) < 0)
                    return BAD();
            }
        }
        return 1;
    }
    if (k->ptype == F_RDATA) {
        if (k->pwin) { /* the READ it answers (asked on this stream) leaves the window */
            k->reads_out -= k->plen < k->reads_out ? k->plen : k->reads_out;
            k->pwin = 0;
        }
        if (k->pdiscard)
            return 1;
        n->received += k->plen;
        kv_tcp_job *j = tcp_job(n, kv__job_find(c, k->pxfer));
        if (j && j->is_pull && j->job.state != KV_JS_DONE) {
            j->job.bytes_done += k->plen;
            if (j->job.bytes_done >= j->job.total_bytes)
                *sig |= tcp_complete(n, l, j, KV_LLM_SUCCESS);
        }
    }
    return 1;
}

static int conn_recv(kv_net *n, kv_conn *k) {
    kv_core *c = n->c;
    int sig = 0;
    uint64_t budget = KV_RECV_BUDGET;
    while (!k->dead && budget) {
        ssize_t r;
        if (k->rx_state == RX_HDR) {
            r = recv(k->fd, (char *)&k->rh + k->rh_got, sizeof k->rh - k->rh_got, MSG_DONTWAIT);
        } else {
            uint64_t want = k->pleft;
            void *dst = k->pdst;
            if (k->pdiscard) {
                dst = n->scratch;
                if (want > KV_SCRATCH)
                    want = KV_SCRATCH;
            } else if (k->ptype == F_DATA) {
                if (want > KV_RECV_PLACE)
                    want = KV_RECV_PLACE;
                if (now_ns() >= k->lease_until) {
                    /* the lease, right before the write: once it is over the pusher may
                     * have reported the push failed (docs/protocol.md, "Leases") */
                    pthread_mutex_lock(&c->mu);
                    sig |= lease_fail(n, k);
                    pthread_mutex_unlock(&c->mu);
                    break;
                }
            }
            r = recv(k->fd, dst, (size_t)want, MSG_DONTWAIT);
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        if (r <= 0) { /* EOF or error */
            pthread_mutex_lock(&c->mu);
            sig |= fail_conn(n, k, 0);
            pthread_mutex_unlock(&c->mu);
            break;
        }
        k->rx_mark = n->now;
        budget = (uint64_t)r >= budget ? 0 : budget - (uint64_t)r;
        if (k->rx_state == RX_HDR) {
            k->rh_got += (size_t)r;
            if (k->rh_got < sizeof k->rh)
                continue;
            k->rh_got = 0;
            pthread_mutex_lock(&c->mu);
            int ok = on_header(n, k, &sig);
            pthread_mutex_unlock(&c->mu);
            if (!ok)
                break;
        } else {
            if (!k->pdiscard)
                k->pdst += r;
            k->pleft -= (uint64_t)r;
            if (k->pleft == 0) {
                pthread_mutex_lock(&c->mu);
                int ok = on_payload(n, k, &sig);
                pthread_mutex_unlock(&c->mu);
                if (!ok)
                    break;
                if (k->cn) /* CREDIT/ACK: out now, not after the read budget */
                    sig |= send_ctrl(n, k);
            }
        }
    }
    return sig;
}

/* ---------------------------------------------------------------- the thread */

static kv_conn *conn_new(kv_net *n, int fd, int state) {
    int one = 1, fl = fcntl(fd, F_GETFL);
    /* TCP_NODELAY also proves it is a TCP socket */
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 ||
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0)
        return NULL;
    kv_conn *k = calloc(1, sizeof *k);
    if (!k)
        return NULL;
    k->fd = fd;
    k->state = state;
    k->born = now_ns();
    k->rx_mark = k->tx_mark = k->born;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = k};
    if (epoll_ctl(n->ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
        free(k);
        return NULL;
    }
    k->next = n->conns;
    n->conns = k;
    return k;
}

static void link_free(kv_link *l) {
    free(l->ev_ready);
    free(l->ev_down);
    free(l);
}

/* Caller holds c->mu. */
static int run_cmd(kv_net *n, kv_cmd *m) {
    int sig = 0;
    if (m->type == CMD_LINK_ADD) {
        kv_link *l = calloc(1, sizeof *l);
        if (!l || link_find(n, m->link_id)) {
            free(l);
            free(m->ev_ready);
            free(m->ev_down);
            return 0;
        }
        l->id = m->link_id;
        memcpy(l->token, m->token, KV_TOKEN_BYTES);
        l->nstreams = m->nstreams;
        l->window = m->window;
        l->lease = m->lease;
        l->fence = m->fence;
        l->margin = m->margin;
        l->ev_ready = m->ev_ready;
        l->ev_down = m->ev_down;
        l->next = n->links;
        n->links = l;
    } else if (m->type == CMD_CONN_ADD) {
        kv_link *l = link_find(n, m->link_id);
        kv_conn *k = (l && !l->dead && l->nconns < l->nstreams) ? conn_new(n, m->fd, C_HELLO_SENT) : NULL;
        if (!k) {
            close(m->fd);
            if (l)
                sig |= link_fail(n, l, KV_LLM_LINK_FAILED, 1);
            return sig;
        }
        k->link = l;
        k->idx = l->nconns;
        l->conns[l->nconns++] = k;
        kv_frame h = frame(F_HELLO, 0, 0);
        h.length = KV_TOKEN_BYTES;
        if (ctrl_push(k, &h) < 0)
            sig |= link_fail(n, l, KV_LLM_LINK_FAILED, 1);
    } else if (m->type == CMD_LINK_CLOSE) {
        kv_link **p = &n->links;
        while (*p && (*p)->id != m->link_id)
            p = &(*p)->next;
        if (*p) {
            kv_link *l = *p;
            sig |= link_fail(n, l, m->status, 0);
            *p = l->next;
            for (kv_conn *k = n->conns; k; k = k->next)
                if (k->link == l)
                    k->link = NULL;
            link_free(l);
        }
    }
    return sig;
}

static void reap(kv_net *n) {
    kv_conn **p = &n->conns;
    while (*p) {
        kv_conn *k = *p;
        if (k->dead) {
            *p = k->next;
            free(k->ctrl);
            free(k);
        } else {
            p = &k->next;
        }
    }
}

static int accept_conns(kv_net *n, int lfd) {
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            /* EMFILE, ENFILE, ENOBUFS, ENOMEM...: the connection stays queued, so the
             * (level-triggered) listener would wake us at once, forever. Stop
             * listening for a while instead of spinning. */
            epoll_ctl(n->ep, EPOLL_CTL_DEL, lfd, NULL);
            n->accept_paused = 1;
            n->accept_resume = now_ns() + KV_ACCEPT_PAUSE_NS;
            pthread_mutex_lock(&n->c->mu);
            n->c->st.tcp_accept_paused++;
            pthread_mutex_unlock(&n->c->mu);
            return 0;
        }
        if (n->npending >= KV_MAX_PENDING) {
            close(fd);
            pthread_mutex_lock(&n->c->mu);
            n->c->st.tcp_refused++;
            pthread_mutex_unlock(&n->c->mu);
            continue;
        }
        if (conn_new(n, fd, C_HELLO_WAIT))
            n->npending++;
        else
            close(fd);
    }
}

/* The timers, once a round: unauthenticated connections' lifetime, the idle
 * bound, lease renewals, abort fences, lease releases, the accept pause.
 * Caller holds c->mu. Returns the signal flag; *next: when to look again. */
static int timers(kv_net *n, uint64_t t, uint64_t *next) {
    kv_core *c = n->c;
    int sig = 0;
    uint64_t nx = t + KV_TICK_NS;
    for (kv_conn *k = n->conns; k; k = k->next) {
        if (k->dead)
            continue;
        if (k->broken) {
            sig |= fail_conn(n, k, 0);
            continue;
        }
        if (k->state == C_HELLO_WAIT) {
            if (t - k->born > KV_HELLO_NS)
                sig |= fail_conn(n, k, 0);
            continue;
        }
        if (!k->link)
            continue;
        /* the idle bound: a payload under way or output waiting that moves no byte
         * for 2 * fence (an authenticated peer pinning a region, or not reading) */
        uint64_t idle = sat_add(k->link->fence, k->link->fence);
        if (k->rx_state != RX_PAYLOAD)
            k->rx_mark = t;
        if (!k->cur_on && !k->cn && !k->sq)
            k->tx_mark = t;
        if (t - k->rx_mark > idle || t - k->tx_mark > idle) {
            c->st.tcp_stalled++;
            sig |= link_fail(n, k->link, KV_LLM_LINK_FAILED, 1);
        }
    }
    for (kv_link *l = n->links; l; l = l->next) {
        if (l->dead)
            continue;
        if (t >= l->renew_at) { /* every lease / 4 */
            for (int i = 0; i < l->nconns && !l->dead; i++) {
                kv_conn *k = l->conns[i];
                if (!k->dead && k->state == C_UP && lease_request(k, t) < 0)
                    sig |= fail_conn(n, k, 0); /* its control queue is full: the peer reads nothing */
            }
            l->renew_at = t + (l->lease / 4 ? l->lease / 4 : 1);
        }
        if (!l->dead && l->renew_at < nx)
            nx = l->renew_at;
    }
    /* a push aborted here whose ABORT_ACKs are not all in by its fence: the link fails */
    for (kv_tcp_job *j = n->tm_head; j;) {
        if (j->job.state == KV_JS_ABORTING && t >= j->due) {
            kv_link *l = link_find(n, j->link_id);
            c->st.tcp_fence_expired++;
            sig |= l ? link_fail(n, l, KV_LLM_LINK_FAILED, 1) : tcp_complete(n, NULL, j, KV_LLM_LINK_FAILED);
            j = n->tm_head; /* the list changed */
            continue;
        }
        j = j->list_next;
    }
    /* pushes of failed links whose peer's lease is over */
    for (kv_tcp_job *j = n->tm_head; j;) {
        kv_tcp_job *nj = j->list_next;
        if (j->job.state == KV_JS_FENCING && t >= j->due)
            sig |= tcp_complete(n, NULL, j, j->job.record.status);
        else if (j->due < nx)
            nx = j->due;
        j = nj;
    }
    if (n->accept_paused) {
        if (t >= n->accept_resume) {
            struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &n->lfd};
            if (n->lfd < 0 || epoll_ctl(n->ep, EPOLL_CTL_ADD, n->lfd, &ev) == 0 || errno == EEXIST)
                n->accept_paused = 0;
            else
                n->accept_resume = t + KV_ACCEPT_PAUSE_NS;
        }
        if (n->accept_paused && n->accept_resume < nx)
            nx = n->accept_resume;
    }
    *next = nx;
    return sig;
}

static void *io_main(void *arg) {
    kv_net *n = arg;
    kv_core *c = n->c;
    struct epoll_event evs[64];
    uint64_t last_busy = 0, next_due = 0;
    for (;;) {
        /* Spin (poll without sleeping) for a short while after activity: a sleeping
         * thread takes tens of microseconds to wake on these VMs, once per frame.
         * Each empty poll yields the core, so a woken event loop sharing it runs at
         * once (64 KiB push p99 354 -> 87 us on 2 vCPUs, throughput unchanged).
         * Otherwise sleep until the next timer (lease renewal, fence, release). */
        uint64_t t0 = now_ns();
        int spin = KV_SPIN_NS && t0 - last_busy < KV_SPIN_NS;
        int tmo = 0;
        if (!spin)
            tmo = next_due <= t0 ? 0 : (int)((next_due - t0 + 999999) / 1000000);
        int ne = epoll_wait(n->ep, evs, 64, tmo);
        if (ne < 0)
            ne = 0;
        n->now = now_ns();
        if (ne > 0)
            last_busy = n->now;
        else if (spin) /* nothing yet: let a runnable thread (the event loop) have the core */
            sched_yield();
        int sig = 0;
        pthread_mutex_lock(&c->mu);
        kv_cmd *cmds = n->cmd_head;
        n->cmd_head = n->cmd_tail = NULL;
        int stop = n->stop, lfd = n->lfd;
        /* commands first (a link is declared before jobs on it), then new jobs,
         * then aborts: one critical section, so nothing comes between them */
        while (cmds) {
            kv_cmd *m = cmds;
            cmds = m->next;
            if (!stop) {
                sig |= run_cmd(n, m);
            } else {
                if (m->type == CMD_CONN_ADD)
                    close(m->fd);
                if (m->type == CMD_LINK_ADD) {
                    free(m->ev_ready);
                    free(m->ev_down);
                }
            }
            free(m);
        }
        while (n->in_head) { /* new jobs join their link's send queue */
            kv_tcp_job *j = n->in_head;
            kv_link *l = stop ? NULL : link_find(n, j->link_id);
            if (!l || l->dead) {
                sig |= tcp_complete(n, NULL, j, stop ? KV_LLM_ENGINE_FINALIZED : KV_LLM_LINK_FAILED);
                continue;
            }
            inbox_del(n, j);
            js_to(j, KV_JS_SENDING);
            sq_insert(l, j);
        }
        while (n->ab_head) /* aborts requested since the last round */
            sig |= handle_abort(n, n->ab_head);
        if (stop && !n->stopped) { /* every link fails; pushes not fenced wait for their release */
            n->stopped = 1;
            for (kv_link *l = n->links; l; l = l->next)
                sig |= link_fail(n, l, KV_LLM_ENGINE_FINALIZED, 0);
            for (kv_conn *k = n->conns; k; k = k->next)
                conn_kill(n, k);
            if (n->lfd >= 0 && !n->accept_paused)
                epoll_ctl(n->ep, EPOLL_CTL_DEL, n->lfd, NULL);
            n->accept_paused = 0;
        }
        pthread_mutex_unlock(&c->mu);
        for (int i = 0; i < ne; i++) {
            void *p = evs[i].data.ptr;
            if (p == NULL) {
                uint64_t v;
                ssize_t r = read(n->wake, &v, sizeof v);
                (void)r;
            } else if (p == &n->lfd) {
                if (!stop)
                    sig |= accept_conns(n, lfd);
            } else {
                kv_conn *k = p;
                if (!k->dead && (evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)))
                    sig |= conn_recv(n, k);
                if (!k->dead && (evs[i].events & EPOLLOUT))
                    sig |= conn_send(n, k);
            }
        }
        uint64_t t = now_ns();
        pthread_mutex_lock(&c->mu);
        sig |= timers(n, t, &next_due);
        int done = stop && !n->tm_head;
        pthread_mutex_unlock(&c->mu);
        if (sig) { /* completions first: the loop refills the queue while this thread sends */
            kv__signal_loop(c);
            sig = 0;
        }
        for (kv_conn *k = n->conns; k; k = k->next) /* start whatever became sendable */
            if (!k->dead && !k->out_armed)
                sig |= conn_send(n, k);
        pthread_mutex_lock(&c->mu);
        c->st.tcp_bytes_sent += n->sent;
        c->st.tcp_bytes_received += n->received;
        n->sent = n->received = 0;
        uint64_t open = 0;
        for (kv_conn *k = n->conns; k; k = k->next)
            open += !k->dead;
        c->st.tcp_conns = open;
        pthread_mutex_unlock(&c->mu);
        reap(n);
        if (sig)
            kv__signal_loop(c);
        if (done)
            break;
    }
    reap(n);
    return NULL;
}

/* ------------------------------------------------------------------- API */

static uint32_t post_cmd(kv_core *c, kv_cmd *m) {
    kv_net *n;
    pthread_mutex_lock(&c->mu);
    uint32_t st = net_get(c, &n);
    if (st == KV_LLM_SUCCESS) {
        if (n->cmd_tail)
            n->cmd_tail->next = m;
        else
            n->cmd_head = m;
        n->cmd_tail = m;
        wake(n);
    }
    pthread_mutex_unlock(&c->mu);
    return st;
}

uint32_t kv_tcp_listen(kv_core *c, const char *ip, uint16_t port, uint16_t *bound) {
    struct sockaddr_storage ss;
    socklen_t sl;
    memset(&ss, 0, sizeof ss);
    struct sockaddr_in *a4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, ip, &a4->sin_addr) == 1) {
        a4->sin_family = AF_INET;
        a4->sin_port = htons(port);
        sl = sizeof *a4;
    } else if (inet_pton(AF_INET6, ip, &a6->sin6_addr) == 1) {
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons(port);
        sl = sizeof *a6;
    } else {
        return KV_LLM_PARAM_INVALID;
    }
    pthread_mutex_lock(&c->mu); /* once per core (a second listener would leak the first) */
    int again = net_of(c) && net_of(c)->lfd >= 0;
    pthread_mutex_unlock(&c->mu);
    if (again)
        return KV_LLM_PARAM_INVALID;
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return KV_LLM_FAILED;
    int one = 1;
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 || bind(fd, (struct sockaddr *)&ss, sl) < 0 ||
        listen(fd, 128) < 0 || getsockname(fd, (struct sockaddr *)&ss, &sl) < 0) {
        close(fd);
        return KV_LLM_FAILED;
    }
    kv_net *n;
    pthread_mutex_lock(&c->mu);
    uint32_t st = net_get(c, &n);
    if (st == KV_LLM_SUCCESS && n->lfd >= 0)
        st = KV_LLM_PARAM_INVALID; /* a concurrent call won */
    if (st == KV_LLM_SUCCESS) {
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &n->lfd};
        n->lfd = fd; /* before the I/O thread can see an event of it */
        if (epoll_ctl(n->ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
            n->lfd = -1;
            st = KV_LLM_FAILED;
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (st != KV_LLM_SUCCESS) {
        close(fd);
        return st;
    }
    *bound = ntohs(ss.ss_family == AF_INET ? a4->sin_port : a6->sin6_port);
    return KV_LLM_SUCCESS;
}

uint32_t kv_tcp_link_add(kv_core *c, uint32_t link_id, const uint8_t *token, int nstreams, uint64_t window,
                         uint64_t lease_ns, uint64_t fence_ns, uint64_t margin_ns) {
    if (link_id == 0 || nstreams < 1 || nstreams > KV_MAX_STREAMS || lease_ns < KV_MIN_LEASE_NS ||
        lease_ns > KV_MAX_LEASE_NS || fence_ns < KV_MIN_LEASE_NS || fence_ns > KV_MAX_LEASE_NS ||
        margin_ns > KV_MAX_LEASE_NS)
        return KV_LLM_PARAM_INVALID;
    kv_cmd *m = calloc(1, sizeof *m);
    kv_event *r = calloc(1, sizeof *r), *d = calloc(1, sizeof *d);
    if (!m || !r || !d) {
        free(m);
        free(r);
        free(d);
        return KV_LLM_OUT_OF_MEMORY;
    }
    r->record.kind = d->record.kind = KV_RECORD_EVENT;
    r->record.id = KV_EVENT_LINK_READY | link_id;
    d->record.id = KV_EVENT_LINK_DOWN | link_id;
    m->type = CMD_LINK_ADD;
    m->link_id = link_id;
    m->nstreams = nstreams;
    m->window = window;
    m->lease = lease_ns;
    m->fence = fence_ns;
    m->margin = margin_ns;
    memcpy(m->token, token, KV_TOKEN_BYTES);
    m->ev_ready = r;
    m->ev_down = d;
    uint32_t st = post_cmd(c, m);
    if (st != KV_LLM_SUCCESS) {
        free(m);
        free(r);
        free(d);
    }
    return st;
}

uint32_t kv_tcp_conn_add(kv_core *c, int fd, uint32_t link_id) {
    kv_cmd *m = calloc(1, sizeof *m);
    if (!m) {
        close(fd);
        return KV_LLM_OUT_OF_MEMORY;
    }
    m->type = CMD_CONN_ADD;
    m->fd = fd;
    m->link_id = link_id;
    uint32_t st = post_cmd(c, m);
    if (st != KV_LLM_SUCCESS) {
        close(fd);
        free(m);
    }
    return st;
}

uint32_t kv_tcp_link_close(kv_core *c, uint32_t link_id, uint32_t status) {
    kv_cmd *m = calloc(1, sizeof *m);
    if (!m)
        return KV_LLM_OUT_OF_MEMORY;
    m->type = CMD_LINK_CLOSE;
    m->link_id = link_id;
    m->status = status ? status : KV_LLM_LINK_FAILED;
    uint32_t st = post_cmd(c, m);
    if (st != KV_LLM_SUCCESS)
        free(m);
    return st;
}

/* ------------------------------------------------- the transport interface */

static uint32_t tcp_submit(kv_transport *t, kv_job *job) {
    kv_net *n = (kv_net *)t;
    kv_tcp_job *j = (kv_tcp_job *)job; /* allocated tcp_ops.job_size */
    kv_core *c = n->c;
    if (n->stop)
        return KV_LLM_LINK_FAILED;
    /* resolve() put the link and the peer's side in every segment alike */
    j->link_id = (uint32_t)job->segments[0].pid;
    j->is_pull = job->segments[0].src_kind == KV_REGION_TCP;
    /* a pull's answer tracking exists before any frame can name the job */
    if (j->is_pull && !(j->pull = ptrack_new(j, c->chunk)))
        return KV_LLM_OUT_OF_MEMORY;
    kv__job_hash(c, job);
    j->job.state = KV_JS_INBOX;
    j->inbox_next = NULL;
    j->inbox_prev = n->in_tail;
    if (n->in_tail)
        n->in_tail->inbox_next = j;
    else
        n->in_head = j;
    n->in_tail = j;
    wake(n);
    return KV_LLM_SUCCESS;
}

static uint32_t tcp_abort(kv_transport *t, kv_job *job, uint32_t status, int *sig) {
    kv_net *n = (kv_net *)t;
    kv_tcp_job *j = (kv_tcp_job *)job;
    kv_core *c = n->c;
    if (j->job.state != KV_JS_INBOX && j->job.state != KV_JS_SENDING && j->job.state != KV_JS_SENT)
        return KV_LLM_PARAM_INVALID; /* aborting, fencing: its completion is on its way */
    if (j->job.record.status == KV_LLM_SUCCESS)
        j->job.record.status = status;
    c->st.jobs_aborted++;
    if (j->job.state == KV_JS_INBOX) { /* nothing of it exists on the wire: done */
        *sig = tcp_complete(n, NULL, j, status);
        return KV_LLM_SUCCESS;
    }
    js_to(j, KV_JS_ABORT_REQ);
    alist_add(&n->ab_head, j);
    wake(n);
    return KV_LLM_SUCCESS;
}

static void tcp_stop(kv_transport *t) {
    kv_net *n = (kv_net *)t;
    kv_core *c = n->c;
    pthread_mutex_lock(&c->mu);
    if (n->stop) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    n->stop = 1;
    wake(n);
    pthread_mutex_unlock(&c->mu);
    pthread_join(n->thread, NULL);
}

static void tcp_destroy(kv_transport *t) {
    kv_net *n = (kv_net *)t;
    while (n->links) {
        kv_link *l = n->links;
        n->links = l->next;
        for (unsigned b = 0; b < KV_RX_BUCKETS; b++)
            while (l->rx[b])
                rx_del(l, l->rx[b]);
        link_free(l);
    }
    if (n->lfd >= 0)
        close(n->lfd);
    close(n->ep);
    close(n->wake);
    free(n->scratch);
    free(n);
}

static const kv_transport_ops tcp_ops = {
    .job_size = sizeof(kv_tcp_job),
    .submit = tcp_submit,
    .abort = tcp_abort,
    .stop = tcp_stop,
    .destroy = tcp_destroy,
};
