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
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the frame format is little-endian; add byte swaps for this target"
#endif

#define KV_MAGIC 0x3145564Bu /* "KVE1" */
enum { F_HELLO = 1, F_HELLO_ACK, F_DATA, F_ACK, F_ABORT, F_ABORT_ACK, F_READ, F_RDATA, F_RERR, F_CREDIT,
       F_LEASE_REQ, F_LEASE, F_DATAV, F_READV, F_LAST = F_READV };
#define F_FLAG_PULL 1u
#define F_FLAG_DATAV 2u /* HELLO, HELLO_ACK: this end takes DATAV frames */
#define F_FLAG_READ2D 4u /* HELLO, HELLO_ACK: this end serves READs of rows (F_FLAG_ROWS) */
#define F_FLAG_ROWS 4u   /* READ: rows of `pad` bytes, `total` apart, from `offset`; `offset2` bytes
                          * into them (row order) start the `length` asked */
#define F_FLAG_READV 8u  /* HELLO, HELLO_ACK: this end serves READV frames */
#define F_FLAG_PIECES 8u /* RDATA: the answer to a READV (its pieces' bytes, in order) */
#define F_FLAG_READVR 16u /* HELLO, HELLO_ACK: this end serves READVs of rows (READV + F_FLAG_ROWS:
                           * each piece rows of `pad` bytes, `total` apart) */
#define F_READ_KINDS (F_FLAG_READ2D | F_FLAG_READV | F_FLAG_READVR)

/* DATAV: one payload scattered over a list of pieces of one region */
#define KV_MAX_PIECES 1024u /* pieces of one DATAV frame */
typedef struct {
    uint64_t offset, len; /* in the frame's region */
} kv_piece;
#define KV_SEND_IOV 1024 /* iovecs one sendmsg takes at most (IOV_MAX) */
#ifndef KV_SEND_MAX
#define KV_SEND_MAX (256u << 10)        /* a push of at most KV_SEND_SMALL: payload bytes per sendmsg */
#endif
#ifndef KV_SMALL_FRAME
#define KV_SMALL_FRAME (512u << 10)     /* a push of at most KV_SEND_SMALL: payload bytes per frame (frame_bytes) */
#endif
#define KV_SEND_SMALL (4ull << 20)      /* (docs/tuning.md, "sendmsg size") */
#define KV_RECV_IOV 64   /* pieces one readv scatters into at most */

#define KV_MAX_FRAME (64ull << 20)   /* payload bytes of one frame */
#define KV_MAX_TOTAL (1ull << 48)    /* bytes of one transfer */
#define KV_HELLO_NS 5000000000ull    /* an unauthenticated connection lives at most 5 s */
#define KV_MAX_PENDING 256           /* unauthenticated connections at once */
#define KV_MAX_CTRL 65536            /* queued control frames per connection */
#define KV_MAX_SERVE 4096            /* queued READs per connection */
#define KV_MAX_INCOMING 65536        /* per link: open incoming transfers and pull tombstones */
#define KV_INCOMING_BUCKETS 4096u    /* open incoming transfers per link: hash buckets */
#define KV_CTRL_BATCH 64             /* control frames written by one sendmsg */
#define KV_CREDIT_BATCH (256u << 10) /* DATA bytes of one push one CREDIT may stand for (small frames) */
#define KV_READ_WINDOW 4             /* chunks of READ outstanding per connection */
#define KV_SCRATCH (1u << 20)
#define KV_RECV_BUDGET (16u << 20)   /* bytes read from one connection per wake-up */
#define KV_DRIVE_RECV_BUDGET (256u << 10) /* ...per round of a driver: the loop thread's time bounded */
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
#define KV_CLOSE_PLACE_WAIT_NS 50000000ull /* kv_tcp_link_close waits this long at most for a recv into place */
#define KV_DRIVE_LOCK_NS 50000ull      /* a driver waits this long at most for the sockets */
#define KV_DRIVE_YIELD 32              /* a driver yields its CPU after this many empty rounds */
#define KV_DRIVE_QUIET_NS 2000000ull   /* the I/O thread leaves the sockets to the loop thread's drives this
                                        * long after the last (io_quiet) */

#ifdef KV_TEST_HOOKS
/* tests/native only (never in the extension): called by the I/O thread before it
 * publishes the link it receives a payload into place for (stage 0), and between the
 * check of the link's `refused` mark and the recv into place (stage 1, with the mark's
 * address), so a test can hold the thread at either point while it closes the link. */
void (*kv_test_place_hook)(int stage, const int *refused);
#define PLACE_HOOK(stage, refused)                                                                   \
    do {                                                                                             \
        if (kv_test_place_hook)                                                                      \
            kv_test_place_hook(stage, refused);                                                      \
    } while (0)
/* tests/native only: engines of this process announce, as an older build, no READ2D, READV
 * nor READVR (1), or no READVR (2) */
int kv_test_no_read2d;
#define READ_FLAGS (kv_test_no_read2d == 1 ? 0u : kv_test_no_read2d == 2 ? F_READ_KINDS & ~F_FLAG_READVR : F_READ_KINDS)
#else
#define PLACE_HOOK(stage, refused) ((void)0)
#define READ_FLAGS F_READ_KINDS /* HELLO, HELLO_ACK: the READs this end serves */
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
    uint64_t *unit;        /* nsegments: the bytes of each READ of the segment (read_unit) */
    uint64_t *first_chunk; /* chunks before each segment (nsegments + 1) */
    uint32_t *answered;    /* per chunk: bytes answered (RDATA header accepted) or given up */
    uint16_t *vcount;      /* per chunk asked by a READV: the first one's, the chunks it asked; the
                              others' UINT16_MAX; 0 for a chunk asked by a READ */
    uint8_t *stream;       /* per chunk: the stream (index in the link) its READ went out on */
} kv_pull_tracking;

/* A push or pull over one link. Owned by the I/O thread once it leaves the
 * inbox, except the abort request (kv_core_abort, under c->lock). */
typedef struct kv_tcp_job {
    kv_job job;              /* first */
    uint32_t link_id;
    int is_pull;
    uint64_t frames;         /* frames (DATA or READ) started on the wire: claimed with the cursor */
    kv_pull_tracking *pull;  /* pull: answer tracking */
    uint32_t abort_acks_awaited; /* push, ABORTING: streams (bit = index in the link) whose ABORT_ACK is due */
    int acked;               /* push, ABORTING: the receiver ACKed every byte meanwhile */
    int driven;              /* its driver's (kv_tcp_submit_driven) until it completes or is handed back:
                              * not counted in live_jobs */
    uint64_t due;            /* ABORTING: the fence deadline; FENCING: the release time (ns, CLOCK_BOOTTIME) */
    struct kv_tcp_job *inbox_next, *inbox_prev; /* the I/O inbox (INBOX) */
    struct kv_tcp_job *list_next, *list_prev;   /* the abort list (ABORT_REQ) or timed list (ABORTING, FENCING) */
} kv_tcp_job;

/* A READ the peer asked on a stream, queued to be answered by RDATA. Holds a
 * ref on the region it reads from until its frame is sent (or dropped). */
typedef struct kv_serve {
    uint64_t xfer, src, len, total, dst_offset;
    uint64_t row_len, stride; /* F_FLAG_ROWS (row_len > 0): src is row 0, dst_offset where it starts */
    uint32_t region_id, dst_segment; /* dst_*: where the requester wants it, echoed in RDATA */
    uint32_t npieces, weight;        /* READV: its pieces (below; src is the region's base); its
                                        weight in the connection's serve_count */
    struct kv_serve *next;
    kv_piece pieces[];
} kv_serve;

/* A transfer arriving on a link: a push we receive, or the tombstone of a pull
 * of ours that was aborted (its late RDATA is checked, then discarded). */
typedef struct kv_incoming {
    uint64_t xfer, total, received;
    uint64_t claimed;  /* bytes of DATA headers accepted; received catches up as payloads end */
    int tombstone;     /* 1: tombstone of our aborted pull, 0: a push we receive */
    int aborted;
    int aborts_seen;   /* push: ABORTs received */
    uint32_t abort_acks_awaited; /* tombstone: streams whose ABORT_ACK is awaited */
    kv_pull_tracking *tracking;  /* tombstone: the pull's answer tracking (late RDATA must still fit it) */
    struct kv_incoming *next;
} kv_incoming;

enum { C_HELLO_WAIT, C_HELLO_SENT, C_UP };
enum { IN_HEADER, IN_LIST, IN_PAYLOAD }; /* IN_LIST: a DATAV's piece list */

struct kv_link;

/* One TCP connection: a stream of a link once authenticated. */
typedef struct kv_conn {
    int fd, state, dead;
    int out_armed; /* EPOLLOUT is armed */
    int broken;    /* epoll_ctl failed on it: fail it at the next timer scan */
    int index;     /* its index in link->conns */
    struct kv_link *link;
    uint64_t born_ns;
    struct kv_conn *next;
    /* the lease (docs/protocol.md) */
    uint64_t lease_until; /* we may write the peer's DATA into place until then (0: never granted) */
    uint64_t granted_at;  /* the last LEASE we queued for the peer (0: never: no DATA of ours yet) */
    /* progress (the idle bound): the round's time when a byte last moved */
    uint64_t rx_progress_ns, tx_progress_ns;
    /* send: control frames queued (a ring), the frame going out, READs to answer */
    kv_frame *ctrl_ring;
    size_t ctrl_head, ctrl_count, ctrl_capacity;
    kv_frame out;             /* the frame being sent (out_busy) */
    size_t out_header_sent;
    const uint8_t *out_payload;
    uint64_t out_payload_len, out_payload_sent;
    int out_busy;
    uint32_t out_region_ref;  /* region ref held while an RDATA payload is sent */
    kv_serve *serve_head, *serve_tail;
    size_t serve_count;
    uint64_t read_bytes_out;  /* bytes of READ sent on this stream not yet answered (or given up) */
    /* receive: the header being read, then its payload */
    kv_frame in_header;
    size_t in_header_got;
    int in_state, in_type;    /* IN_*; the type of the frame whose payload is read */
    int in_discard;           /* the payload goes to scratch, not into place */
    int in_returns_window;    /* RDATA payload: its bytes return to this stream's READ window */
    uint8_t *in_dest;
    uint64_t in_left, in_length, in_xfer;
    uint32_t in_region_ref;   /* region ref held while a DATA payload is written into place */
    uint8_t hello_token[KV_TOKEN_BYTES];
    int peer_datav;           /* the peer takes DATAV (F_FLAG_DATAV in its HELLO or HELLO_ACK) */
    unsigned peer_reads;      /* its HELLO's READ_FLAGS (the link's, once it joins one) */
    /* a DATAV frame going out (out_vn > 0): header, piece list, payload runs;
     * sent iovecs are consumed in place */
    struct iovec *out_vec;    /* KV_MAX_PIECES + 2, allocated at the first DATAV */
    kv_piece *out_list;       /* KV_MAX_PIECES */
    size_t out_vn, out_vi;    /* iovecs in all; the first not sent in full */
    uint64_t out_vhead;       /* header and list bytes not sent yet */
    /* a DATAV frame coming in: its piece list (IN_LIST), then the scatter cursor */
    kv_piece *in_list;        /* KV_MAX_PIECES, allocated at the first DATAV */
    uint32_t in_npieces, in_pi; /* pieces (0: not a DATAV); the one being filled */
    uint64_t in_poff;         /* bytes of piece in_pi already in place */
    size_t in_list_got;       /* list bytes read */
    uint64_t in_base;         /* the region's address */
} kv_conn;

typedef struct kv_link {
    uint32_t id;
    uint8_t token[KV_TOKEN_BYTES];
    int nstreams, nstreams_up, dead;
    unsigned peer_reads;           /* the READs the peer serves: READ_FLAGS of its HELLO or HELLO_ACK */
    int refused; /* atomic: kv_tcp_link_close was called: nothing of it is received into place any more */
    kv_conn *conns[KV_MAX_STREAMS];
    int nconns;
    kv_job *send_head, *send_tail; /* jobs with frames left to claim, by rank */
    size_t send_pulls;             /* pull jobs among them */
    uint64_t window;               /* push bytes on the wire (sent, not yet CREDITed) allowed; 0: no limit */
    uint64_t wire_bytes;           /* push bytes on the wire now */
    uint64_t lease_ns, fence_ns, margin_ns; /* kv_tcp_link_add */
    uint64_t renew_at;             /* next LEASE_REQ on every stream */
    uint64_t last_grant;           /* the last LEASE we queued on any stream (0: none) */
    kv_incoming *incoming[KV_INCOMING_BUCKETS];
    size_t nincoming;
    kv_event *ready_event, *down_event;
    struct kv_link *next;
} kv_link;

enum { CMD_LINK_ADD = 1, CMD_CONN_ADD, CMD_LINK_CLOSE };

/* A request from an API call to the I/O thread, run at its next round. */
typedef struct kv_command {
    int type, fd, nstreams;
    uint64_t window, lease_ns, fence_ns, margin_ns;
    uint32_t link_id, status;
    uint8_t token[KV_TOKEN_BYTES];
    kv_event *ready_event, *down_event;
    struct kv_command *next;
} kv_command;

typedef struct kv_net {
    kv_transport transport; /* first: the core holds &transport */
    kv_core *core;
    pthread_t thread;
    int epoll_fd, wake_fd;
    kv_link *links; /* changed under c->lock only */
    kv_link *placing; /* atomic: the link whose payload a recv is writing into place right now (else NULL) */
    kv_conn *conns;
    int npending;
    uint8_t *scratch;
    uint64_t sent, received; /* payload bytes, flushed into c->stats once per round */
    uint64_t round_ns;       /* the round's time */
    int accept_paused;
    uint64_t accept_resume;
    int stopped;             /* stop acted on: links failed, waiting for the fenced pushes */
    /* the sockets and everything of a round (conns, frames, epoll): held by the I/O thread
     * for each round, by the loop thread while it drives a push (kv_tcp_submit_driven);
     * taken before c->lock */
    pthread_mutex_t wlock;
    int quiet_fd;            /* the I/O thread's epoll set while drives go on: wake_fd, and epoll_fd
                              * (the sockets) except while a drive runs (quiet_watch) */
    uint64_t drive_epoch;    /* drives so far (under wlock): the I/O thread's events are stale after one */
    int driving;             /* under wlock: the round running is a driver's (conn_recv's smaller budget) */
    uint64_t drove_ns;       /* atomic: when the last drive ended */
    uint64_t last_busy, next_due; /* the round's: last activity, next timer */
    /* under c->lock */
    size_t live_jobs;        /* jobs submitted, not completed, but a drive's */
    kv_tcp_job *drive_job;   /* INBOX, outside the inbox: the driver's, until its first round or hand-back */
    int sleeping;            /* the I/O thread is (about to be) blocked in epoll_wait: wake_io_thread writes */
    int listen_fd;
    kv_command *commands_head, *commands_tail;
    kv_tcp_job *inbox_head, *inbox_tail; /* INBOX jobs, in submission order */
    kv_tcp_job *abort_head;              /* ABORT_REQ jobs */
    kv_tcp_job *timed_head;              /* ABORTING and FENCING jobs (their `due`) */
    int stop_requested;
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

static uint64_t add_saturating(uint64_t a, uint64_t b) { return a + b < a ? UINT64_MAX : a + b; }

/* Commands, jobs or aborts wait for the I/O thread's round. Caller holds c->lock. */
static int work_queued(const kv_net *n) { return n->commands_head || n->inbox_head || n->abort_head; }

/* Caller holds c->lock. A polling I/O thread takes the lock every round and sees
 * the new work then, so only a sleeping one is woken (a write and a read saved
 * per submit while it polls). */
static void wake_io_thread(kv_net *n) {
    if (!n->sleeping)
        return;
    n->sleeping = 0;
    uint64_t one = 1;
    ssize_t r;
    do
        r = write(n->wake_fd, &one, sizeof one);
    while (r < 0 && errno == EINTR);
}

static void *io_main(void *arg);

static const kv_transport_ops tcp_ops;

static __thread int tcp_driving; /* kv_tcp_submit_driven's submit: no wake-up of the I/O thread */

/* The core's TCP transport, or NULL before the first use. Caller holds c->lock. */
static kv_net *net_of(kv_core *c) { return (kv_net *)kv__transport_get(c, KV_REGION_TCP); }

/* Start the I/O thread on first use. Caller holds c->lock. */
static uint32_t net_start(kv_core *c, kv_net **out) {
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
    n->core = c;
    n->listen_fd = -1;
    n->scratch = malloc(KV_SCRATCH);
    n->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    n->quiet_fd = epoll_create1(EPOLL_CLOEXEC);
    n->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    pthread_mutex_init(&n->wlock, NULL);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (!n->scratch || n->epoll_fd < 0 || n->quiet_fd < 0 || n->wake_fd < 0 ||
        epoll_ctl(n->epoll_fd, EPOLL_CTL_ADD, n->wake_fd, &ev) < 0 ||
        epoll_ctl(n->quiet_fd, EPOLL_CTL_ADD, n->wake_fd, &ev) < 0)
        goto fail;
    ev.data.ptr = n; /* (any events: the quiet I/O thread polls epoll_fd itself) */
    if (epoll_ctl(n->quiet_fd, EPOLL_CTL_ADD, n->epoll_fd, &ev) < 0)
        goto fail;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(&n->thread, NULL, io_main, n);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0)
        goto fail;
    pthread_setname_np(n->thread, "kv-tcp-io");
    kv__transport_register(c, KV_REGION_TCP, &n->transport);
    *out = n;
    return KV_LLM_SUCCESS;
fail:
    if (n->epoll_fd >= 0)
        close(n->epoll_fd);
    if (n->quiet_fd >= 0)
        close(n->quiet_fd);
    pthread_mutex_destroy(&n->wlock);
    if (n->wake_fd >= 0)
        close(n->wake_fd);
    free(n->scratch);
    free(n);
    return KV_LLM_FAILED;
}

/* --------------------------------------------------------------- job states */

#ifndef NDEBUG
#define STATE_BIT(x) (1u << KV_JS_##x)
static const unsigned job_next_states[KV_JS_DONE] = {
    [KV_JS_INBOX] = STATE_BIT(SENDING) | STATE_BIT(DONE),
    [KV_JS_SENDING] = STATE_BIT(SENT) | STATE_BIT(ABORT_REQ) | STATE_BIT(FENCING) | STATE_BIT(DONE),
    [KV_JS_SENT] = STATE_BIT(ABORT_REQ) | STATE_BIT(FENCING) | STATE_BIT(DONE),
    [KV_JS_ABORT_REQ] = STATE_BIT(ABORTING) | STATE_BIT(FENCING) | STATE_BIT(DONE),
    [KV_JS_ABORTING] = STATE_BIT(FENCING) | STATE_BIT(DONE),
    [KV_JS_FENCING] = STATE_BIT(DONE),
};
#undef STATE_BIT
#endif

/* The one place a TCP job changes state: checked (unless NDEBUG). */
static void job_set_state(kv_tcp_job *j, int to) {
#ifndef NDEBUG
    assert(j->job.state >= KV_JS_INBOX && j->job.state < KV_JS_DONE && (job_next_states[j->job.state] & (1u << to)));
#endif
    j->job.state = to;
}

/* The abort list (ABORT_REQ) and the timed list (ABORTING, FENCING) share list_next/list_prev. */
static void list_add(kv_tcp_job **head, kv_tcp_job *j) {
    j->list_prev = NULL;
    j->list_next = *head;
    if (*head)
        (*head)->list_prev = j;
    *head = j;
}

static void list_del(kv_tcp_job **head, kv_tcp_job *j) {
    if (j->list_prev)
        j->list_prev->list_next = j->list_next;
    else
        *head = j->list_next;
    if (j->list_next)
        j->list_next->list_prev = j->list_prev;
    j->list_next = j->list_prev = NULL;
}

/* Append `j` to the inbox. Caller holds c->lock. */
static void inbox_add(kv_net *n, kv_tcp_job *j) {
    j->inbox_next = NULL;
    j->inbox_prev = n->inbox_tail;
    if (n->inbox_tail)
        n->inbox_tail->inbox_next = j;
    else
        n->inbox_head = j;
    n->inbox_tail = j;
}

static void inbox_del(kv_net *n, kv_tcp_job *j) {
    if (j->inbox_prev)
        j->inbox_prev->inbox_next = j->inbox_next;
    else
        n->inbox_head = j->inbox_next;
    if (j->inbox_next)
        j->inbox_next->inbox_prev = j->inbox_prev;
    else
        n->inbox_tail = j->inbox_prev;
    j->inbox_next = j->inbox_prev = NULL;
}

/* --------------------------------------------------------------- helpers */

static kv_link *link_find(kv_net *n, uint32_t id) {
    for (kv_link *l = n->links; l; l = l->next)
        if (l->id == id)
            return l;
    return NULL;
}

static unsigned incoming_bucket(uint64_t x) { return (unsigned)((x * 0x9E3779B97F4A7C15ull) >> 52) & (KV_INCOMING_BUCKETS - 1); }

static kv_incoming *incoming_find(kv_link *l, uint64_t xfer, int pull) {
    for (kv_incoming *r = l->incoming[incoming_bucket(xfer)]; r; r = r->next)
        if (r->xfer == xfer && r->tombstone == pull)
            return r;
    return NULL;
}

static kv_incoming *incoming_new(kv_link *l, uint64_t xfer, int pull) {
    if (l->nincoming >= KV_MAX_INCOMING)
        return NULL;
    kv_incoming *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->xfer = xfer;
    r->tombstone = pull;
    unsigned b = incoming_bucket(xfer);
    r->next = l->incoming[b];
    l->incoming[b] = r;
    l->nincoming++;
    return r;
}

static void incoming_del(kv_link *l, kv_incoming *r) {
    kv_incoming **p = &l->incoming[incoming_bucket(r->xfer)];
    while (*p != r)
        p = &(*p)->next;
    *p = r->next;
    l->nincoming--;
    free(r->tracking);
    free(r);
}

static void send_queue_remove(kv_link *l, kv_tcp_job *j) {
    if (kv__queue_remove(&l->send_head, &l->send_tail, &j->job))
        l->send_pulls -= j->is_pull;
}

static void send_queue_insert(kv_link *l, kv_tcp_job *j) {
    kv__rank_insert(&l->send_head, &l->send_tail, &j->job);
    l->send_pulls += j->is_pull;
}

/* The bytes each READ of pull segment `s` asks (READ k of it: [k * unit, (k + 1) * unit)
 * of its bytes in row order): `chunk`, or for short rows (a 2-D segment: tcp_pull_2d)
 * KV_MAX_PIECES - 1 whole rows, which one RDATA gathers. */
static uint64_t read_unit(const kv_segment *s, uint64_t chunk) {
    return s->rows > 1 && s->len * (KV_MAX_PIECES - 1) < chunk ? s->len * (KV_MAX_PIECES - 1) : chunk;
}

/* A pull's answer tracking (one allocation), or NULL if out of memory. */
static kv_pull_tracking *pull_tracking_new(const kv_tcp_job *j, uint64_t chunk) {
    uint64_t nch = 0;
    for (size_t i = 0; i < j->job.nsegments; i++) { /* total < 2^64, unit >= 1: no overflow */
        uint64_t u = read_unit(&j->job.segments[i], chunk);
        nch += (kv_seg_bytes(&j->job.segments[i]) + u - 1) / u;
    }
    size_t ns = j->job.nsegments;
    if (nch > (SIZE_MAX / 2 - 8 * (3 * ns + 1) - sizeof(kv_pull_tracking)) / 7)
        return NULL;
    size_t sz = sizeof(kv_pull_tracking) + 8 * (3 * ns + 1) + 7 * (size_t)nch;
    kv_pull_tracking *tracking = calloc(1, sz);
    if (!tracking)
        return NULL;
    tracking->nsegments = ns;
    tracking->chunk_bytes = chunk;
    tracking->nchunks = nch;
    tracking->segment_len = (uint64_t *)(tracking + 1);
    tracking->unit = tracking->segment_len + ns;
    tracking->first_chunk = tracking->unit + ns;
    tracking->answered = (uint32_t *)(tracking->first_chunk + ns + 1);
    tracking->vcount = (uint16_t *)(tracking->answered + nch);
    tracking->stream = (uint8_t *)(tracking->vcount + nch);
    tracking->first_chunk[0] = 0;
    for (size_t i = 0; i < ns; i++) {
        tracking->segment_len[i] = kv_seg_bytes(&j->job.segments[i]); /* rows in row order (tcp_pull_2d) */
        tracking->unit[i] = read_unit(&j->job.segments[i], chunk);
        tracking->first_chunk[i + 1] =
            tracking->first_chunk[i] + (tracking->segment_len[i] + tracking->unit[i] - 1) / tracking->unit[i];
    }
    return tracking;
}

/* Does RDATA header `h`, read on stream `idx`, answer the next bytes of a READ
 * this pull sent on that stream? If so, they are claimed and its chunk index
 * returned; else -1. A repeated, overlapping, out-of-order, unasked or
 * misrouted answer is a protocol violation (else a peer could complete a pull
 * with bytes unwritten; and a READ's window returns exactly once). */
static int64_t pull_claim(kv_pull_tracking *tracking, const kv_frame *h, int idx) {
    if (h->flags & F_FLAG_PIECES) {
        /* a READV's answer: `region` its first segment, `region2` its segments (one
         * chunk each), their bytes in all `length`; the READV that asked exactly
         * those went out on this stream, and none of them is answered yet */
        size_t i0 = h->region, m = h->region2;
        if (i0 >= tracking->nsegments || h->offset || m < 2 || m > tracking->nsegments - i0)
            return -1;
        uint64_t k0 = tracking->first_chunk[i0], sum = 0;
        if (k0 >= tracking->reads_sent || tracking->vcount[k0] != m)
            return -1;
        for (size_t i = i0; i < i0 + m; i++) { /* (readv_claim: consecutive chunks, one a segment) */
            uint64_t q = tracking->first_chunk[i];
            if (q != k0 + (i - i0) || tracking->stream[q] != idx || tracking->answered[q] ||
                tracking->vcount[q] != (i == i0 ? m : UINT16_MAX))
                return -1;
            sum += tracking->segment_len[i];
        }
        if (sum != h->length)
            return -1;
        for (size_t i = i0; i < i0 + m; i++)
            tracking->answered[k0 + (i - i0)] = (uint32_t)tracking->segment_len[i];
        return (int64_t)k0;
    }
    if (h->region >= tracking->nsegments || h->offset > tracking->segment_len[h->region] ||
        h->length > tracking->segment_len[h->region] - h->offset)
        return -1;
    uint64_t u = tracking->unit[h->region];
    uint64_t k = tracking->first_chunk[h->region] + h->offset / u, at = h->offset % u;
    if (k < tracking->reads_sent && tracking->vcount[k])
        return -1; /* asked by a READV: only its RDATA of pieces answers it */
    uint64_t clen = tracking->segment_len[h->region] - (h->offset - at);
    if (clen > u)
        clen = u;
    if (k >= tracking->reads_sent || tracking->stream[k] != idx || at != tracking->answered[k] || h->length > clen - at)
        return -1;
    tracking->answered[k] += (uint32_t)h->length;
    return (int64_t)k;
}

/* Every READ of `tracking` sent on stream `idx` is answered or dropped (its ABORT_ACK
 * came): what was not answered returns to that stream's READ window, and no
 * answer to it is accepted any more. */
static void pull_give_up(kv_pull_tracking *tracking, kv_conn *k, int idx) {
    for (size_t i = 0; i < tracking->nsegments; i++) {
        for (uint64_t q = tracking->first_chunk[i]; q < tracking->first_chunk[i + 1] && q < tracking->reads_sent; q++) {
            if (tracking->stream[q] != idx)
                continue;
            uint64_t off = (q - tracking->first_chunk[i]) * tracking->unit[i], clen = tracking->segment_len[i] - off;
            if (clen > tracking->unit[i])
                clen = tracking->unit[i];
            uint64_t left = clen - tracking->answered[q];
            k->read_bytes_out -= left < k->read_bytes_out ? left : k->read_bytes_out;
            tracking->answered[q] = (uint32_t)clen;
        }
    }
}

static void discard_payloads(kv_link *l, kv_core *c, int ptype, uint64_t xfer);

/* Complete a TCP job (any state but DONE). Caller holds c->lock; returns 1 if the
 * loop must be signalled. */
static int tcp_complete(kv_net *n, kv_link *l, kv_tcp_job *j, uint32_t status) {
    if (j->job.queued) {
        assert(l);
        send_queue_remove(l, j);
    }
    /* RDATA payloads of a pull still arriving on other streams write into its
     * destination without a region ref: no byte of a pull lands after its
     * completion (a peer answering a READ twice, an abort with frames == 0),
     * so they are discarded from here on. */
    if (l && !l->dead && j->is_pull)
        discard_payloads(l, n->core, F_RDATA, j->job.record.id);
    if (j->job.state == KV_JS_INBOX && j == n->drive_job)
        n->drive_job = NULL;
    else if (j->job.state == KV_JS_INBOX)
        inbox_del(n, j);
    else if (j->job.state == KV_JS_ABORT_REQ)
        list_del(&n->abort_head, j);
    else if (j->job.state == KV_JS_ABORTING || j->job.state == KV_JS_FENCING)
        list_del(&n->timed_head, j);
    job_set_state(j, KV_JS_DONE);
    free(j->pull);
    j->pull = NULL;
    if (!j->driven)
        n->live_jobs--;
    return kv__job_complete(n->core, &j->job, status);
}

static int ctrl_push(kv_conn *k, const kv_frame *f) {
    if (k->ctrl_count == k->ctrl_capacity) {
        if (k->ctrl_capacity >= KV_MAX_CTRL)
            return -1;
        size_t cap = k->ctrl_capacity ? k->ctrl_capacity * 2 : 16;
        kv_frame *nf = malloc(cap * sizeof *nf);
        if (!nf)
            return -1;
        for (size_t i = 0; i < k->ctrl_count; i++)
            nf[i] = k->ctrl_ring[(k->ctrl_head + i) % k->ctrl_capacity];
        free(k->ctrl_ring);
        k->ctrl_ring = nf;
        k->ctrl_head = 0;
        k->ctrl_capacity = cap;
    }
    k->ctrl_ring[(k->ctrl_head + k->ctrl_count) % k->ctrl_capacity] = *f;
    k->ctrl_count++;
    return 0;
}

/* Must the queued control frames go out now? Anything but one CREDIT of less than
 * KV_CREDIT_BATCH may wait for more DATA of the same push (the receive loop sends
 * it at the latest when the socket has nothing more to read). */
static int ctrl_due(const kv_conn *k) {
    const kv_frame *last = &k->ctrl_ring[(k->ctrl_head + k->ctrl_count - 1) % k->ctrl_capacity];
    return k->ctrl_count > 1 || last->type != F_CREDIT || last->length >= KV_CREDIT_BATCH;
}

static kv_frame frame_new(uint16_t type, uint16_t flags, uint64_t xfer) {
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
    kv_frame f = frame_new(F_LEASE_REQ, 0, 0);
    f.offset = now;
    return ctrl_push(k, &f);
}

static void arm_output(kv_net *n, kv_conn *k, int out) {
    if (k->dead || k->out_armed == out)
        return;
    struct epoll_event ev = {.events = EPOLLIN | (out ? EPOLLOUT : 0u), .data.ptr = k};
    if (epoll_ctl(n->epoll_fd, EPOLL_CTL_MOD, k->fd, &ev) < 0) {
        k->broken = 1; /* failed at the next timer scan (we may not hold the lock here) */
        return;
    }
    k->out_armed = out;
}

/* Close a connection and drop every region ref it holds. Caller holds c->lock.
 * A stream of a link is reset (SO_LINGER 0): the kernel drops what it still
 * holds for either side, so no frame of ours lands after the link failed.
 * The struct is freed at the end of the I/O iteration (it may be on the stack of a caller). */
static void conn_kill(kv_net *n, kv_conn *k) {
    if (k->dead)
        return;
    k->dead = 1;
    epoll_ctl(n->epoll_fd, EPOLL_CTL_DEL, k->fd, NULL); /* close() removes it anyway */
    if (k->link) {
        struct linger lg = {1, 0};
        setsockopt(k->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg); /* if it fails: a FIN; the lease still holds */
    }
    close(k->fd);
    if (k->out_region_ref)
        kv__region_unref(n->core, k->out_region_ref);
    if (k->in_region_ref)
        kv__region_unref(n->core, k->in_region_ref);
    k->out_region_ref = k->in_region_ref = 0;
    while (k->serve_head) {
        kv_serve *s = k->serve_head;
        k->serve_head = s->next;
        kv__region_unref(n->core, s->region_id);
        free(s);
    }
    if (k->state == C_HELLO_WAIT)
        n->npending--;
}

/* Close every stream of a link (reset) and end its jobs with `status`: pulls,
 * pushes with nothing on the wire and pushes the peer fenced (ACK) at once;
 * other pushes (the peer may still write their bytes under its lease) at the
 * lease release: the last lease we granted on the link + lease + margin.
 * Caller holds c->lock. */
static int link_fail(kv_net *n, kv_link *l, uint32_t status, int post_down) {
    int sig = 0;
    if (!l->dead) {
        l->dead = 1;
        if (post_down)
            n->core->stats.tcp_links_failed++; /* counters: at once, under the lock (tests read them) */
        /* Only here: a dead link's streams were killed when it died and reap_dead_conns()
         * freed them at the end of that round, so a later link_fail of the same
         * link (kv_core_close, link_close or conn_add after a failure) never
         * touches l->conns. */
        for (int i = 0; i < l->nconns; i++)
            conn_kill(n, l->conns[i]);
    }
    kv_core *c = n->core;
    uint64_t now = now_ns();
    uint64_t release = l->last_grant ? add_saturating(l->last_grant, add_saturating(l->lease_ns, l->margin_ns)) : 0;
    for (unsigned b = 0; b < KV_HASH_BUCKETS; b++) {
        kv_job *job = c->jobs_by_id[b];
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
                        send_queue_remove(l, j);
                    if (j->job.state == KV_JS_ABORT_REQ)
                        list_del(&n->abort_head, j);
                    else if (j->job.state == KV_JS_ABORTING)
                        list_del(&n->timed_head, j);
                    job_set_state(j, KV_JS_FENCING);
                    j->due = release;
                    list_add(&n->timed_head, j);
                }
            }
            job = next;
        }
    }
    for (unsigned b = 0; b < KV_INCOMING_BUCKETS; b++)
        while (l->incoming[b])
            incoming_del(l, l->incoming[b]);
    if (post_down && l->down_event) {
        l->down_event->record.status = status;
        sig |= kv__post_event(c, l->down_event);
        l->down_event = NULL;
    }
    return sig;
}

/* Drop a connection: before authentication it is just closed (counted as
 * refused); after, its whole link fails. `bad`: a malformed frame. Caller holds c->lock. */
static int fail_conn(kv_net *n, kv_conn *k, int bad) {
    if (k->dead)
        return 0;
    if (!k->link) {
        n->core->stats.tcp_refused++;
        conn_kill(n, k);
        return 0;
    }
    if (bad)
        n->core->stats.tcp_bad_frames++;
    return link_fail(n, k->link, KV_LLM_LINK_FAILED, 1);
}

/* DATA was to be written into place on k without a valid lease. Caller holds c->lock. */
static int lease_fail(kv_net *n, kv_conn *k) {
    n->core->stats.tcp_lease_expired++;
    return link_fail(n, k->link, KV_LLM_LINK_FAILED, 1);
}

/* ------------------------------------------------------------------ sending */

/* `len` more bytes of `j` are claimed for a frame: move its cursor; SENT once
 * every byte is. Caller holds c->lock. */
static void claim_advance(kv_link *l, kv_tcp_job *j, uint64_t len) {
    j->job.claim_offset += len;
    if (j->job.claim_offset == kv_seg_bytes(&j->job.segments[j->job.claim_segment])) {
        j->job.claim_offset = 0;
        if (++j->job.claim_segment == j->job.nsegments) {
            send_queue_remove(l, j);
            job_set_state(j, KV_JS_SENT);
        }
    }
}

/* The most payload one DATA/DATAV frame of a push of `total` bytes carries: a
 * chunk; for a push of at most KV_SEND_SMALL, KV_SMALL_FRAME (each frame is
 * CREDITed by the receiver as soon as it is in). On loopback under BBR a 1 MiB
 * push in one frame took 233-298 us and TCP retransmitted ~20 segments
 * (spuriously) per 4,000 pushes; in two frames of 512 KiB it took 127-188 us
 * with none; under cubic 125-130 us either way (docs/benchmarks.md, "1 MiB
 * pushes in two frames"). Pushes of 512 KiB and 2-4 MiB did not move, and
 * large pushes keep whole chunks: 256 KiB frames made a 64 MiB push ~25%
 * slower, and 256 KiB frames cost a 1 MiB push ~20% under cubic. */
static uint64_t frame_bytes(uint64_t chunk, uint64_t total) {
    return total <= KV_SEND_SMALL && KV_SMALL_FRAME < chunk ? KV_SMALL_FRAME : chunk;
}

/* k's gathered frames' iovecs and piece list (DATAV, RDATA of rows), allocated at the
 * first: 0 if out of memory. */
static int out_vec_alloc(kv_conn *k) {
    if (!k->out_vec) {
        k->out_vec = malloc((KV_MAX_PIECES + 2) * sizeof *k->out_vec);
        k->out_list = malloc(KV_MAX_PIECES * sizeof *k->out_list);
        if (!k->out_vec || !k->out_list) {
            free(k->out_vec);
            free(k->out_list);
            k->out_vec = NULL;
            k->out_list = NULL;
            return 0;
        }
    }
    return 1;
}

/* The next frame of push `j` for a peer that takes DATAV: up to `most` bytes
 * (frame_bytes) from the claim point, across rows and segments while they name
 * one region of the peer, as one DATAV (a piece list, the payload gathered by
 * sendmsg), or as one DATA if that is a single run on both sides. Returns 0 (nothing claimed)
 * if it is a single run of at most a row: the caller sends DATA as before; or if
 * out of memory (the same). Caller holds c->lock. */
static int datav_claim(kv_conn *k, kv_link *l, kv_tcp_job *j, uint64_t most) {
    if (!out_vec_alloc(k))
        return 0;
    const kv_segment *segs = j->job.segments;
    uint64_t bytes = 0, off = j->job.claim_offset, src, dst;
    size_t seg = j->job.claim_segment, np = 0, nv = 2;
    uint32_t region = segs[seg].remote_region;
    kv_piece *list = k->out_list;
    struct iovec *vec = k->out_vec;
    while (bytes < most && np < KV_MAX_PIECES && nv < KV_MAX_PIECES + 2 && segs[seg].remote_region == region) {
        uint64_t t = kv_seg_run(&segs[seg], off, most - bytes, &src, &dst);
        if (np && list[np - 1].offset + list[np - 1].len == dst) {
            list[np - 1].len += t;
        } else {
            list[np].offset = dst;
            list[np++].len = t;
        }
        if (nv > 2 && (uintptr_t)vec[nv - 1].iov_base + vec[nv - 1].iov_len == src) {
            vec[nv - 1].iov_len += (size_t)t;
        } else {
            vec[nv].iov_base = (void *)(uintptr_t)src;
            vec[nv++].iov_len = (size_t)t;
        }
        bytes += t;
        off += t;
        if (off == kv_seg_bytes(&segs[seg])) {
            off = 0;
            if (++seg == j->job.nsegments)
                break;
        }
    }
    if (np == 1 && nv == 3 && bytes <= segs[j->job.claim_segment].len - j->job.claim_offset % segs[j->job.claim_segment].len)
        return 0; /* within one row: DATA, as for a peer without DATAV */
    /* commit the claim */
    while (bytes) {
        uint64_t t = kv_seg_bytes(&j->job.segments[j->job.claim_segment]) - j->job.claim_offset;
        if (t > bytes)
            t = bytes;
        claim_advance(l, j, t);
        bytes -= t;
    }
    bytes = 0;
    for (size_t i = 0; i < np; i++)
        bytes += list[i].len;
    l->wire_bytes += bytes;
    if (np == 1 && nv == 3) { /* one run on both sides (segments back to back): one DATA */
        k->out = frame_new(F_DATA, 0, j->job.record.id);
        k->out.region = region;
        k->out.offset = list[0].offset;
        k->out.length = bytes;
        k->out.total = j->job.total_bytes;
        k->out_payload = vec[2].iov_base;
        k->out_payload_len = bytes;
        return 1;
    }
    k->out = frame_new(F_DATAV, 0, j->job.record.id);
    k->out.region = region;
    k->out.length = bytes;
    k->out.total = j->job.total_bytes;
    k->out.region2 = (uint32_t)np;
    vec[0].iov_base = &k->out;
    vec[0].iov_len = sizeof k->out;
    vec[1].iov_base = list;
    vec[1].iov_len = np * sizeof *list;
    k->out_vn = nv;
    k->out_vi = 0;
    k->out_vhead = sizeof k->out + np * sizeof *list;
    k->out_payload = NULL;
    k->out_payload_len = 0;
    return 1;
}

/* The next READ of pull `j` for a peer that serves READV: whole segments from the
 * claim point (each one chunk: at most `chunk` bytes), while they name one region of
 * the peer, up to `chunk` bytes and KV_MAX_PIECES of them, as one READV (their offsets
 * and lengths there in its piece list), which the peer answers with one RDATA of
 * pieces, scattered into those segments (on_rdata). The segments are 1-D, or, for a
 * peer that serves READVs of rows, 2-D with the first one's row length and stride
 * there (F_FLAG_ROWS: each piece its segment's rows there, at most KV_MAX_PIECES rows
 * in all, which the peer gathers). Returns 0 (nothing claimed) unless two segments or
 * more qualify: the caller sends a READ as before; or if out of memory (the same).
 * Caller holds c->lock. */
static int readv_claim(kv_net *n, kv_conn *k, kv_link *l, kv_tcp_job *j, uint64_t chunk) {
    const kv_segment *segs = j->job.segments, *s0 = &segs[j->job.claim_segment];
    size_t i0 = j->job.claim_segment, i = i0;
    kv_pull_tracking *t = j->pull;
    int rows = s0->rows > 1;
    if (j->job.claim_offset || i0 > UINT32_MAX || t->first_chunk[i0] != j->frames ||
        (rows && !(l->peer_reads & F_FLAG_READVR)) || !out_vec_alloc(k))
        return 0;
    uint64_t bytes = 0, nrows = 0;
    while (i < j->job.nsegments && i - i0 < KV_MAX_PIECES && segs[i].remote_region == s0->remote_region &&
           kv_seg_bytes(&segs[i]) <= chunk - bytes) {
        const kv_segment *s = &segs[i];
        if (rows ? s->rows < 2 || s->len != s0->len || s->src_stride != s0->src_stride ||
                       s->rows > KV_MAX_PIECES - nrows || t->first_chunk[i + 1] != t->first_chunk[i] + 1
                 : s->rows > 1)
            break;
        k->out_list[i - i0].offset = s->src;
        k->out_list[i - i0].len = kv_seg_bytes(s);
        bytes += kv_seg_bytes(s);
        nrows += s->rows;
        i++;
    }
    size_t m = i - i0;
    if (m < 2)
        return 0;
    uint64_t k0 = j->frames; /* READ k is chunk k: here one chunk a segment */
    for (size_t q = 0; q < m; q++) {
        t->stream[k0 + q] = (uint8_t)k->index;
        t->vcount[k0 + q] = q ? UINT16_MAX : (uint16_t)m;
        claim_advance(l, j, kv_seg_bytes(&segs[i0 + q]));
    }
    t->reads_sent = k0 + m;
    j->frames += m;
    k->out = frame_new(F_READV, rows ? F_FLAG_ROWS : 0, j->job.record.id);
    k->out.region = s0->remote_region;
    k->out.length = bytes;
    k->out.total = rows ? s0->src_stride : j->job.total_bytes;
    k->out.pad = rows ? (uint32_t)s0->len : 0; /* (tcp_pull_2d: a row fits) */
    k->out.region2 = (uint32_t)m;
    k->out.offset2 = i0;
    k->out_vec[0].iov_base = &k->out;
    k->out_vec[0].iov_len = sizeof k->out;
    k->out_vec[1].iov_base = k->out_list;
    k->out_vec[1].iov_len = m * sizeof *k->out_list;
    k->out_vn = 2;
    k->out_vi = 0;
    k->out_vhead = sizeof k->out + m * sizeof *k->out_list;
    k->out_payload = NULL;
    k->out_payload_len = 0;
    k->read_bytes_out += bytes;
    n->core->stats.tcp_readv++;
    n->core->stats.tcp_row_reads += (uint64_t)rows;
    return 1;
}

/* Iovecs from v[nv] on for the bytes [at, at + len) in row order of rows of `row_len`
 * bytes, `stride` apart from `base` (checked by the caller: on_read, on_readv_list);
 * returns the index after the last. */
static size_t rows_iov(struct iovec *v, size_t nv, uint64_t base, uint64_t at, uint64_t len, uint64_t row_len,
                       uint64_t stride) {
    for (uint64_t row = at / row_len, col = at % row_len; len; row++, col = 0) {
        uint64_t t = row_len - col < len ? row_len - col : len;
        v[nv].iov_base = (void *)(uintptr_t)(base + row * stride + col);
        v[nv++].iov_len = (size_t)t;
        len -= t;
    }
    return nv;
}

/* Pick the next frame for `k`. Caller holds c->lock. */
static int next_frame(kv_net *n, kv_conn *k) {
    if (k->ctrl_count) {
        k->out = k->ctrl_ring[k->ctrl_head];
        k->ctrl_head = (k->ctrl_head + 1) % k->ctrl_capacity;
        k->ctrl_count--;
        k->out_payload = k->out.type == F_HELLO ? k->link->token : NULL;
        k->out_payload_len = k->out.type == F_HELLO ? KV_TOKEN_BYTES : 0;
        goto start;
    }
    if (k->state != C_UP)
        return 0;
    if (k->serve_head) {
        kv_serve *s = k->serve_head;
        k->serve_head = s->next;
        if (!k->serve_head)
            k->serve_tail = NULL;
        k->serve_count -= s->weight;
        k->out = frame_new(F_RDATA, 0, s->xfer);
        k->out.region = s->dst_segment;
        k->out.offset = s->dst_offset;
        k->out.length = s->len;
        k->out.total = s->total;
        k->out_payload = (const uint8_t *)(uintptr_t)s->src;
        k->out_payload_len = s->len;
        k->out_region_ref = s->region_id; /* the ref moves from the task to the frame */
        if (s->row_len || s->npieces) {
            /* rows (on_read checked them) or a READV's pieces (on_readv_list checked them),
             * gathered by sendmsg; both allocated out_vec */
            size_t nv = 1;
            k->out_vec[0].iov_base = &k->out;
            k->out_vec[0].iov_len = sizeof k->out;
            if (s->npieces) { /* each piece one run, or whole rows (a READV of rows) */
                k->out.flags = F_FLAG_PIECES;
                k->out.region2 = s->npieces;
                for (uint32_t i = 0; i < s->npieces; i++) {
                    uint64_t rl = s->row_len ? s->row_len : s->pieces[i].len;
                    nv = rows_iov(k->out_vec, nv, s->src + s->pieces[i].offset, 0, s->pieces[i].len, rl,
                                  s->row_len ? s->stride : rl);
                }
            } else {
                nv = rows_iov(k->out_vec, nv, s->src, s->dst_offset, s->len, s->row_len, s->stride);
            }
            k->out_vn = nv;
            k->out_vi = 0;
            k->out_vhead = sizeof k->out;
            k->out_payload = NULL;
            k->out_payload_len = 0;
        }
        free(s);
        goto start;
    }
    kv_link *l = k->link;
    uint64_t chunk = n->core->chunk_bytes;
    /* pushes wait while the window is full (the receiver has not consumed enough:
     * its CREDITs reopen it), and on a stream where we never granted the peer a
     * lease (its LEASE_REQ comes first: the LEASE then precedes our DATA in the
     * stream); then only pulls can go, if any are queued */
    int push_ok = (!l->window || l->wire_bytes < l->window) && k->granted_at;
    if (!push_ok && !l->send_pulls)
        return 0;
    for (kv_tcp_job *j = (kv_tcp_job *)l->send_head; j; j = (kv_tcp_job *)j->job.queue_next) {
        if (j->job.state != KV_JS_SENDING) /* ABORT_REQ: the I/O thread acts on it this round */
            continue;
        if (j->is_pull && k->read_bytes_out >= KV_READ_WINDOW * chunk)
            continue;
        if (!j->is_pull && !push_ok)
            continue;
        uint64_t most = j->is_pull ? chunk : frame_bytes(chunk, j->job.total_bytes);
        if (!j->is_pull && k->peer_datav && datav_claim(k, l, j, most)) {
            j->frames++;
            goto start;
        }
        if (j->is_pull && (l->peer_reads & F_FLAG_READV) && readv_claim(n, k, l, j, chunk))
            goto start;
        const kv_segment *s = &j->job.segments[j->job.claim_segment];
        uint64_t off = j->job.claim_offset, src, dst, len = kv_seg_run(s, off, most, &src, &dst); /* one row at most */
        size_t seg = j->job.claim_segment;
        int rows = j->is_pull && s->rows > 1; /* a 2-D pull segment (tcp_pull_2d): READs of rows */
        if (rows) {
            uint64_t u = read_unit(s, chunk);
            len = kv_seg_bytes(s) - off < u ? kv_seg_bytes(s) - off : u;
        }
        claim_advance(l, j, len);
        if (j->is_pull) {
            j->pull->stream[j->frames] = (uint8_t)k->index; /* READ k is chunk k */
            j->pull->reads_sent = j->frames + 1;
            k->out = frame_new(F_READ, rows ? F_FLAG_ROWS : 0, j->job.record.id);
            k->out.region = s->remote_region;
            k->out.offset = rows ? s->src : src;
            k->out.length = len;
            k->out.total = rows ? s->src_stride : j->job.total_bytes;
            k->out.pad = rows ? (uint32_t)s->len : 0;
            n->core->stats.tcp_row_reads += (uint64_t)rows;
            k->out.region2 = (uint32_t)seg;
            k->out.offset2 = off;
            k->out_payload = NULL;
            k->out_payload_len = 0;
            k->read_bytes_out += len;
        } else {
            l->wire_bytes += len;
            k->out = frame_new(F_DATA, 0, j->job.record.id);
            k->out.region = s->remote_region;
            k->out.offset = dst;
            k->out.length = len;
            k->out.total = j->job.total_bytes;
            k->out_payload = (const uint8_t *)(uintptr_t)src;
            k->out_payload_len = len;
        }
        j->frames++;
        goto start;
    }
    return 0;
start:
    k->out_busy = 1;
    k->out_header_sent = 0;
    k->out_payload_sent = 0;
    return 1;
}

/* One non-blocking sendmsg of `cnt` iovecs on `k` (EINTR retried). Returns the
 * bytes sent (progress noted), or -1 when nothing can go now: the socket is full
 * (EPOLLOUT armed), or the connection failed (fail_conn; its signal or-ed into *sig). */
static ssize_t conn_write(kv_net *n, kv_conn *k, struct iovec *iov, size_t cnt, int *sig) {
    struct msghdr m;
    memset(&m, 0, sizeof m);
    m.msg_iov = iov;
    m.msg_iovlen = cnt;
    ssize_t r;
    do
        r = sendmsg(k->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (r < 0 && errno == EINTR);
    if (r >= 0) {
        k->tx_progress_ns = n->round_ns;
        return r;
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
        arm_output(n, k, 1);
    } else {
        pthread_mutex_lock(&n->core->lock);
        *sig |= fail_conn(n, k, 0);
        pthread_mutex_unlock(&n->core->lock);
    }
    return -1;
}

/* Write queued payload-less control frames (CREDIT, ACK, ABORT, ...) in one
 * sendmsg, when no frame is half-sent on this connection. A frame cut short
 * becomes the connection's current frame. Returns 1 if the loop must be
 * signalled; arms EPOLLOUT when the socket is full. */
static int send_ctrl(kv_net *n, kv_conn *k) {
    if (k->dead || k->out_busy || k->ctrl_count == 0)
        return 0;
    struct iovec iov[KV_CTRL_BATCH];
    int cnt = 0;
    while (cnt < KV_CTRL_BATCH && (size_t)cnt < k->ctrl_count) {
        kv_frame *f = &k->ctrl_ring[(k->ctrl_head + (size_t)cnt) % k->ctrl_capacity];
        if (f->type == F_HELLO)
            break; /* has a payload: conn_send sends it */
        iov[cnt].iov_base = f;
        iov[cnt++].iov_len = sizeof *f;
    }
    if (cnt == 0)
        return 0;
    int sig = 0;
    ssize_t r = conn_write(n, k, iov, (size_t)cnt, &sig);
    if (r < 0)
        return sig;
    size_t whole = (size_t)r / sizeof(kv_frame), part = (size_t)r % sizeof(kv_frame);
    k->ctrl_head = (k->ctrl_head + whole) % k->ctrl_capacity;
    k->ctrl_count -= whole;
    if (part) { /* the rest of this frame goes out first, through conn_send */
        k->out = k->ctrl_ring[k->ctrl_head];
        k->ctrl_head = (k->ctrl_head + 1) % k->ctrl_capacity;
        k->ctrl_count--;
        k->out_payload = NULL;
        k->out_payload_len = 0;
        k->out_payload_sent = 0;
        k->out_header_sent = part;
        k->out_busy = 1;
    }
    if (k->ctrl_count || k->out_busy)
        arm_output(n, k, 1);
    return 0;
}

/* Payload bytes one sendmsg of k's current frame may take: a push of at most
 * KV_SEND_SMALL goes out in KV_SEND_MAX pieces, so the receiver copies the
 * first while the sender copies the next (docs/tuning.md, "sendmsg size");
 * larger pushes and pull answers whole. */
static uint64_t send_max(const kv_conn *k) {
    return (k->out.type == F_DATA || k->out.type == F_DATAV) && k->out.total <= KV_SEND_SMALL ? KV_SEND_MAX : UINT64_MAX;
}

static int conn_send(kv_net *n, kv_conn *k) {
    kv_core *c = n->core;
    int sig = send_ctrl(n, k);
    for (int budget = 0; budget < 256 && !k->dead; budget++) {
        if (!k->out_busy) {
            pthread_mutex_lock(&c->lock);
            int got = next_frame(n, k);
            pthread_mutex_unlock(&c->lock);
            if (!got) {
                arm_output(n, k, 0);
                return sig;
            }
        }
        if (k->out_vn) { /* DATAV: header, list and payload runs, gathered */
            /* at most KV_SEND_IOV iovecs and send_max() payload bytes: the last
             * iovec taken is shortened for this call and restored after it */
            size_t left = k->out_vn - k->out_vi, cnt = 0, cut_len = 0;
            uint64_t bytes = 0, most = send_max(k);
            most = most > UINT64_MAX - k->out_vhead ? UINT64_MAX : most + k->out_vhead;
            struct iovec *v0 = k->out_vec + k->out_vi;
            while (cnt < left && cnt < KV_SEND_IOV && bytes < most)
                bytes += v0[cnt++].iov_len;
            if (bytes > most) {
                cut_len = v0[cnt - 1].iov_len;
                v0[cnt - 1].iov_len -= (size_t)(bytes - most);
            }
            ssize_t r = conn_write(n, k, v0, cnt, &sig);
            if (cut_len)
                v0[cnt - 1].iov_len = cut_len;
            if (r < 0)
                return sig;
            uint64_t got = (uint64_t)r, head = got < k->out_vhead ? got : k->out_vhead;
            k->out_vhead -= head;
            n->sent += got - head;
            while (got) {
                struct iovec *v = &k->out_vec[k->out_vi];
                size_t t = got < v->iov_len ? (size_t)got : v->iov_len;
                v->iov_base = (char *)v->iov_base + t;
                v->iov_len -= t;
                got -= t;
                if (v->iov_len == 0)
                    k->out_vi++;
            }
            while (k->out_vi < k->out_vn && k->out_vec[k->out_vi].iov_len == 0)
                k->out_vi++;
            if (k->out_vi == k->out_vn) {
                k->out_busy = 0;
                k->out_vn = 0;
                if (k->out_region_ref) { /* RDATA of rows */
                    pthread_mutex_lock(&c->lock);
                    kv__region_unref(c, k->out_region_ref);
                    pthread_mutex_unlock(&c->lock);
                    k->out_region_ref = 0;
                }
            }
            continue;
        }
        struct iovec iov[2];
        int cnt = 0;
        if (k->out_header_sent < sizeof k->out) {
            iov[cnt].iov_base = (char *)&k->out + k->out_header_sent;
            iov[cnt++].iov_len = sizeof k->out - k->out_header_sent;
        }
        if (k->out_payload_sent < k->out_payload_len) {
            uint64_t rest = k->out_payload_len - k->out_payload_sent, most = send_max(k);
            iov[cnt].iov_base = (void *)(uintptr_t)(k->out_payload + k->out_payload_sent);
            iov[cnt++].iov_len = (size_t)(rest < most ? rest : most);
        }
        ssize_t r = conn_write(n, k, iov, (size_t)cnt, &sig);
        if (r < 0)
            return sig;
        uint64_t got = (uint64_t)r;
        uint64_t h = sizeof k->out - k->out_header_sent;
        if (got < h) {
            k->out_header_sent += (size_t)got;
            continue;
        }
        k->out_header_sent = sizeof k->out;
        got -= h;
        k->out_payload_sent += got;
        if (k->out.type == F_DATA || k->out.type == F_RDATA)
            n->sent += got;
        if (k->out_payload_sent == k->out_payload_len) {
            k->out_busy = 0;
            if (k->out_region_ref) {
                pthread_mutex_lock(&c->lock);
                kv__region_unref(c, k->out_region_ref);
                pthread_mutex_unlock(&c->lock);
                k->out_region_ref = 0;
            }
        }
    }
    arm_output(n, k, 1); /* budget used up: come back when writable */
    return sig;
}

/* ---------------------------------------------------------------- receiving */

/* A region this engine exports, or NULL. Caller holds c->lock. */
static kv_region *exported(kv_core *c, uint32_t id) {
    kv_region *r = kv__region_get(c, id);
    if (!r || r->removed || r->kind != KV_REGION_LOCAL || !(r->flags & KV_REGION_F_EXPORT))
        return NULL;
    return r;
}

/* A DATA frame of push `xfer` is part-way out on one of l's streams: its payload
 * is still read from the source by sendmsg. Caller holds c->lock. */
static int data_in_flight(kv_link *l, uint64_t xfer) {
    for (int i = 0; i < l->nconns; i++) {
        kv_conn *k = l->conns[i];
        if (!k->dead && k->out_busy && (k->out.type == F_DATA || k->out.type == F_DATAV) && k->out.xfer == xfer)
            return 1;
    }
    return 0;
}

static void discard_payloads(kv_link *l, kv_core *c, int ptype, uint64_t xfer) {
    for (int i = 0; i < l->nconns; i++) {
        kv_conn *k = l->conns[i];
        if (!k->dead && k->in_state == IN_PAYLOAD && k->in_type == ptype && k->in_xfer == xfer && !k->in_discard) {
            k->in_discard = 1;
            if (k->in_region_ref) {
                kv__region_unref(c, k->in_region_ref);
                k->in_region_ref = 0;
            }
        }
    }
}

/* Act on an ABORT_REQ job: complete it now if nothing of it went out; else
 * ABORT on every stream, then push: ABORTING until every ABORT_ACK (or the
 * fence: the link fails); pull: a tombstone (late RDATA is checked, then
 * discarded) and complete now. Caller holds c->lock. */
static int handle_abort(kv_net *n, kv_tcp_job *j) {
    kv_link *l = link_find(n, j->link_id);
    if (!l || l->dead) /* (link_fail ends every job of its link: not reached) */
        return tcp_complete(n, l, j, KV_LLM_LINK_FAILED);
    if (j->job.queued)
        send_queue_remove(l, j);
    if (j->frames == 0)
        return tcp_complete(n, l, j, j->job.record.status);
    kv_frame f = frame_new(F_ABORT, j->is_pull ? F_FLAG_PULL : 0, j->job.record.id);
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
        discard_payloads(l, n->core, F_RDATA, j->job.record.id);
        if (wait) {
            kv_incoming *t = incoming_new(l, j->job.record.id, 1);
            if (!t) /* KV_MAX_INCOMING: a peer that never answers our ABORTs */
                return link_fail(n, l, KV_LLM_LINK_FAILED, 1);
            t->abort_acks_awaited = wait;
            t->tracking = j->pull; /* late answers must still be answers to what we asked */
            j->pull = NULL;
        }
        return tcp_complete(n, l, j, j->job.record.status);
    }
    if (!wait)
        return tcp_complete(n, l, j, j->job.record.status);
    j->abort_acks_awaited = wait;
    list_del(&n->abort_head, j);
    job_set_state(j, KV_JS_ABORTING);
    j->due = add_saturating(now_ns(), l->fence_ns);
    list_add(&n->timed_head, j);
    return 0;
}

#define BAD_FRAME() (*sig |= fail_conn(n, k, 1), 0)

/* The frame handlers: the header is in k->in_header, the stream is up (C_UP).
 * Each returns 0 if the connection was dropped. Caller holds c->lock. */

/* A DATA or DATAV frame (header `h`, its bytes checked against region `r`)
 * joins its transfer: the payload goes into place, or to scratch if the push
 * was aborted. Caller holds c->lock. */
static int data_accept(kv_net *n, kv_conn *k, kv_region *r, int *sig) {
    kv_frame *h = &k->in_header;
    kv_core *c = n->core;
    kv_link *l = k->link;
    kv_incoming *x = incoming_find(l, h->xfer, 0);
    if (!x) {
        if (!(x = incoming_new(l, h->xfer, 0)))
            return BAD_FRAME();
        x->total = h->total;
    }
    /* claimed, not received: two streams with payloads under way must not both
     * fit in what is left of the total */
    if (!x->aborted && (x->total != h->total || h->length > x->total - x->claimed))
        return BAD_FRAME();
    if (!x->aborted && now_ns() >= k->lease_until) /* checked again before every recv into place */
        return *sig |= lease_fail(n, k), 0;
    k->in_discard = x->aborted;
    if (!x->aborted) {
        x->claimed += h->length;
        kv__region_ref(c, h->region);
        k->in_region_ref = h->region;
        k->in_dest = (uint8_t *)(uintptr_t)(r->addr + h->offset);
    }
    k->in_type = F_DATA;
    k->in_xfer = h->xfer;
    k->in_left = k->in_length = h->length;
    k->in_state = IN_PAYLOAD;
    return 1;
}

static int on_data(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->in_header;
    kv_region *r = exported(n->core, h->region);
    if (h->length == 0 || h->length > KV_MAX_FRAME || h->total > KV_MAX_TOTAL || h->length > h->total || !r ||
        h->offset > r->len || h->length > r->len - h->offset)
        return BAD_FRAME();
    return data_accept(n, k, r, sig);
}

/* k's incoming piece list (DATAV, READV; a scattered RDATA's pieces), allocated at the
 * first: 0 if out of memory. */
static int in_list_alloc(kv_conn *k) {
    return k->in_list || (k->in_list = malloc(KV_MAX_PIECES * sizeof *k->in_list)) != NULL;
}

/* A DATAV's or READV's header was checked: its piece list (`region2` pieces) is read next. */
static int list_next(kv_net *n, kv_conn *k, int *sig) {
    if (!in_list_alloc(k))
        return *sig |= fail_conn(n, k, 0), 0;
    k->in_npieces = k->in_header.region2;
    k->in_list_got = 0;
    k->in_state = IN_LIST;
    return 1;
}

/* Are the `np` pieces of k's list whole rows of `row_len` bytes, `stride` apart (0:
 * each piece one row), in `r`, at most KV_MAX_PIECES rows in all, adding up to
 * `length` (kv_pieces_ok)? */
static int rows_fit(const kv_conn *k, uint32_t np, const kv_region *r, uint64_t length, uint64_t row_len,
                    uint64_t stride) {
    return kv_pieces_ok(k->in_list, np, r->len, length, row_len, stride, KV_MAX_PIECES);
}

/* A DATAV header: its piece list is read next, then checked whole (on_datav_list). */
static int on_datav(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->in_header;
    if (h->length == 0 || h->length > KV_MAX_FRAME || h->total > KV_MAX_TOTAL || h->length > h->total ||
        h->region2 == 0 || h->region2 > KV_MAX_PIECES || h->region2 > h->length || h->offset || h->offset2)
        return BAD_FRAME();
    return list_next(n, k, sig);
}

/* A DATAV's piece list is in: every piece inside the exported region, none
 * empty, their lengths adding up to the payload's (overflow-safe), before a
 * byte of it lands; then as DATA. Caller holds c->lock. */
static int on_datav_list(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->in_header;
    kv_region *r = exported(n->core, h->region);
    if (!r || !rows_fit(k, k->in_npieces, r, h->length, 0, 0))
        return BAD_FRAME();
    if (!data_accept(n, k, r, sig)) /* in_dest: the region's base (offset 0) */
        return 0;
    k->in_base = r->addr;
    k->in_pi = 0;
    k->in_poff = 0;
    return 1;
}

static int on_rdata(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->in_header;
    kv_link *l = k->link;
    if (h->length == 0 || h->length > KV_MAX_FRAME)
        return BAD_FRAME();
    kv_tcp_job *j = tcp_job(n, kv__job_find(n->core, h->xfer));
    kv_incoming *t;
    int64_t q;
    if (j && j->is_pull && j->link_id == l->id &&
        (j->job.state == KV_JS_SENDING || j->job.state == KV_JS_SENT || j->job.state == KV_JS_ABORT_REQ)) {
        if ((q = pull_claim(j->pull, h, k->index)) < 0)
            return BAD_FRAME();
        const kv_segment *s = &j->job.segments[h->region];
        k->in_dest = (uint8_t *)(uintptr_t)(s->dst + h->offset);
        int pieces = (h->flags & F_FLAG_PIECES) != 0; /* a READV's answer: into its segments, in order */
        if (pieces || (s->rows > 1 && s->dst_stride != s->len)) { /* or rows apart (pull_2d): scattered like DATAV's */
            if (!in_list_alloc(k))
                return *sig |= fail_conn(n, k, 0), 0;
            uint32_t np = 0;
            if (pieces) { /* each segment's rows here (readv_claim: at most KV_MAX_PIECES in all) */
                for (uint32_t i = 0; i < h->region2; i++) {
                    int apart = s[i].rows > 1 && s[i].dst_stride != s[i].len;
                    for (uint64_t r = 0; r < (apart ? s[i].rows : 1); r++, np++) {
                        if (np == KV_MAX_PIECES)
                            return BAD_FRAME();
                        k->in_list[np].offset = s[i].dst + r * s[i].dst_stride;
                        k->in_list[np].len = apart ? s[i].len : kv_seg_bytes(&s[i]);
                    }
                }
            } else {
                uint64_t row = h->offset / s->len, col = h->offset % s->len, left = h->length;
                for (; left; row++, col = 0, np++) { /* (pull_claim: within one READ, at most KV_MAX_PIECES rows) */
                    if (np == KV_MAX_PIECES)
                        return BAD_FRAME();
                    uint64_t t = s->len - col < left ? s->len - col : left;
                    k->in_list[np].offset = s->dst + row * s->dst_stride + col;
                    k->in_list[np].len = t;
                    left -= t;
                }
            }
            k->in_npieces = np;
            k->in_pi = 0;
            k->in_poff = 0;
            k->in_base = 0;
        }
        k->in_discard = 0;
        k->in_returns_window = 1;
    } else if ((t = incoming_find(l, h->xfer, 1))) { /* our aborted pull: checked, then discarded */
        if ((q = pull_claim(t->tracking, h, k->index)) < 0)
            return BAD_FRAME();
        k->in_discard = 1;
        k->in_returns_window = 1;
    } else { /* an answer to nothing we asked (INBOX: nothing asked yet) */
        return BAD_FRAME();
    }
    return 1;
}

static int on_ack(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->in_header;
    kv_link *l = k->link;
    kv_tcp_job *j = tcp_job(n, kv__job_find(n->core, h->xfer));
    if (!j || j->is_pull || j->link_id != l->id)
        return BAD_FRAME(); /* about no push of ours on this link */
    /* every frame must have been claimed (SENT, perhaps aborted since), and none
     * may be still going out: no honest receiver ACKs bytes not even sent yet,
     * and a push completes only once sendmsg reads nothing more of its source */
    int all = j->job.claim_segment == j->job.nsegments;
    if (!all || !(j->job.state == KV_JS_SENT || j->job.state == KV_JS_ABORT_REQ || j->job.state == KV_JS_ABORTING) ||
        (j->job.state == KV_JS_ABORTING && j->acked) || data_in_flight(l, j->job.record.id))
        return BAD_FRAME();
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
    kv_frame *h = &k->in_header;
    kv_link *l = k->link;
    kv_frame ack = frame_new(F_ABORT_ACK, h->flags & F_FLAG_PULL, h->xfer);
    if (h->flags & F_FLAG_PULL) { /* stop serving READs of that pull on this stream */
        kv_serve **p = &k->serve_head;
        k->serve_tail = NULL;
        while (*p) {
            kv_serve *s = *p;
            if (s->xfer == h->xfer) {
                *p = s->next;
                ack.length += s->len;
                kv__region_unref(n->core, s->region_id);
                k->serve_count -= s->weight;
                free(s);
            } else {
                k->serve_tail = s;
                p = &s->next;
            }
        }
    } else {
        kv_incoming *x = incoming_find(l, h->xfer, 0);
        if (!x && !(x = incoming_new(l, h->xfer, 0)))
            return BAD_FRAME();
        x->aborted = 1;
        discard_payloads(l, n->core, F_DATA, h->xfer);
        if (++x->aborts_seen >= l->nconns)
            incoming_del(l, x);
    }
    if (ctrl_push(k, &ack) < 0)
        return BAD_FRAME();
    return 1;
}

static int on_abort_ack(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->in_header;
    kv_link *l = k->link;
    uint32_t bit = 1u << k->index;
    if (h->flags & F_FLAG_PULL) {
        kv_incoming *t = incoming_find(l, h->xfer, 1);
        if (!t || !(t->abort_acks_awaited & bit))
            return BAD_FRAME(); /* no ABORT of ours awaits it on this stream */
        /* the READs this stream carried are answered or dropped: the window gets
         * back exactly what we asked and saw no answer to (not the peer's length) */
        pull_give_up(t->tracking, k, k->index);
        t->abort_acks_awaited &= ~bit;
        if (!t->abort_acks_awaited)
            incoming_del(l, t);
        return 1;
    }
    kv_tcp_job *j = tcp_job(n, kv__job_find(n->core, h->xfer));
    if (!j || j->is_pull || j->link_id != l->id || j->job.state != KV_JS_ABORTING || !(j->abort_acks_awaited & bit))
        return BAD_FRAME();
    j->abort_acks_awaited &= ~bit;
    if (j->abort_acks_awaited)
        return 1;
    /* the fence: every stream's ABORT (sent after its DATA) was answered; an
     * early ABORT_ACK never completes the job under a frame still going out
     * (as for an early ACK) */
    if (data_in_flight(l, j->job.record.id))
        return BAD_FRAME();
    *sig |= tcp_complete(n, l, j, j->job.record.status);
    return 1;
}

/* A READ's or READV's answer queued on `k` (`np` pieces: a READV's, copied in by
 * the caller), holding a ref on the frame's region: xfer, length and total from the
 * frame; the rest is the caller's. NULL if out of memory. Caller holds c->lock. */
static kv_serve *serve_new(kv_net *n, kv_conn *k, uint32_t np) {
    kv_frame *h = &k->in_header;
    kv_serve *s = calloc(1, sizeof *s + np * sizeof(kv_piece));
    if (!s)
        return NULL;
    s->xfer = h->xfer;
    s->len = h->length;
    s->total = h->total;
    s->region_id = h->region;
    s->npieces = np;
    s->weight = 1 + np / 16; /* a READV's list counts: at most ~64K pieces queued per connection */
    kv__region_ref(n->core, h->region);
    if (k->serve_tail)
        k->serve_tail->next = s;
    else
        k->serve_head = s;
    k->serve_tail = s;
    k->serve_count += s->weight;
    return s;
}

/* A READ(V) named a region not (or no longer) exported: the requester gets a status
 * (RERR), the link lives. Returns 1, or 0 (BAD_FRAME) if the control ring is full. */
static int read_refused(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->in_header;
    kv_frame e = frame_new(F_RERR, 0, h->xfer);
    e.status = KV_LLM_KV_CACHE_NOT_EXIST;
    e.length = h->length;
    if (ctrl_push(k, &e) < 0)
        return BAD_FRAME();
    return 1;
}

static int on_read(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->in_header;
    kv_core *c = n->core;
    if (h->length == 0 || h->length > KV_MAX_FRAME || k->serve_count >= KV_MAX_SERVE)
        return BAD_FRAME();
    kv_region *r = exported(c, h->region);
    if (!r) /* unregistered meanwhile: the requester gets a status, the link lives */
        return read_refused(n, k, sig);
    uint64_t row_len = 0, stride = 0;
    if (h->flags & F_FLAG_ROWS) {
        /* rows of `pad` bytes, `total` apart, from `offset`; the bytes [offset2, offset2 +
         * length) of them in row order: rows first..last, at most KV_MAX_PIECES, the last
         * inside the region (no product computed before it is known to fit) */
        row_len = h->pad;
        stride = h->total;
        if (row_len == 0 || stride < row_len || h->offset2 > UINT64_MAX - h->length)
            return BAD_FRAME();
        uint64_t first = h->offset2 / row_len, last = (h->offset2 + h->length - 1) / row_len;
        if (last - first >= KV_MAX_PIECES || h->offset > r->len || row_len > r->len - h->offset ||
            last > (r->len - h->offset - row_len) / stride)
            return BAD_FRAME();
        if (!out_vec_alloc(k))
            return *sig |= fail_conn(n, k, 0), 0;
    } else if (h->offset > r->len || h->length > r->len - h->offset) {
        return BAD_FRAME();
    }
    kv_serve *s = serve_new(n, k, 0);
    if (!s)
        return *sig |= fail_conn(n, k, 0), 0;
    s->src = r->addr + h->offset;
    s->row_len = row_len;
    s->stride = stride;
    s->dst_segment = h->region2;
    s->dst_offset = h->offset2;
    return 1;
}

/* A READV header: its piece list is read next, then checked whole (on_readv_list).
 * Of rows (F_FLAG_ROWS): rows of `pad` bytes, `total` apart, each piece whole rows. */
static int on_readv(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->in_header;
    int rows = (h->flags & F_FLAG_ROWS) != 0;
    if (h->length == 0 || h->length > KV_MAX_FRAME || h->region2 < 2 || h->region2 > KV_MAX_PIECES ||
        h->region2 > h->length || h->offset || h->offset2 > UINT32_MAX ||
        (rows ? h->pad == 0 || h->total < h->pad : h->pad != 0) || k->serve_count >= KV_MAX_SERVE)
        return BAD_FRAME();
    return list_next(n, k, sig);
}

/* A READV's piece list is in. Its region no longer exported: RERR, as for a READ.
 * Else every piece inside it, none empty, their lengths adding up to `length`
 * (overflow-safe), or the link fails; then it is queued, to be answered by one
 * RDATA (F_FLAG_PIECES) gathered from the pieces in order. Caller holds c->lock. */
static int on_readv_list(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->in_header;
    uint32_t np = k->in_npieces;
    k->in_npieces = 0; /* no payload follows: the next frame's header */
    k->in_state = IN_HEADER;
    kv_region *r = exported(n->core, h->region);
    if (!r)
        return read_refused(n, k, sig);
    int rows = (h->flags & F_FLAG_ROWS) != 0;
    if (!rows_fit(k, np, r, h->length, rows ? h->pad : 0, rows ? h->total : 0))
        return BAD_FRAME();
    kv_serve *s;
    if (!out_vec_alloc(k) || !(s = serve_new(n, k, np)))
        return *sig |= fail_conn(n, k, 0), 0;
    s->src = r->addr;
    s->row_len = rows ? h->pad : 0;
    s->stride = rows ? h->total : 0;
    s->dst_segment = (uint32_t)h->offset2;
    memcpy(s->pieces, k->in_list, np * sizeof *k->in_list);
    return 1;
}

static int on_rerr(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->in_header;
    kv_link *l = k->link;
    kv_tcp_job *j = tcp_job(n, kv__job_find(n->core, h->xfer));
    if (j && j->is_pull && j->link_id == l->id &&
        (j->job.state == KV_JS_SENDING || j->job.state == KV_JS_SENT || j->job.state == KV_JS_ABORT_REQ) && j->frames) {
        /* a READ named a region the peer no longer exports: the pull ends with
         * that status (aborted: tombstone; the READ's window returns with the
         * stream's ABORT_ACK, not by this frame's length) */
        if (j->job.record.status == KV_LLM_SUCCESS)
            j->job.record.status = h->status ? h->status : KV_LLM_FAILED;
        if (j->job.state != KV_JS_ABORT_REQ) {
            job_set_state(j, KV_JS_ABORT_REQ);
            list_add(&n->abort_head, j);
        }
        *sig |= handle_abort(n, j);
        return !k->dead;
    }
    if (incoming_find(l, h->xfer, 1)) /* a READ of our aborted pull, refused before our ABORT came */
        return 1;
    return BAD_FRAME(); /* about nothing we asked */
}

static int on_lease_req(kv_net *n, kv_conn *k, int *sig) {
    kv_frame g = frame_new(F_LEASE, 0, 0);
    g.offset = k->in_header.offset; /* the requester's clock, echoed: its lease runs from there */
    if (ctrl_push(k, &g) < 0)
        return BAD_FRAME();
    uint64_t t = now_ns();
    k->granted_at = t; /* from now on our DATA may go on this stream */
    k->link->last_grant = t;
    return 1;
}

static int on_lease(kv_net *n, kv_conn *k, int *sig) {
    uint64_t t = now_ns(), off = k->in_header.offset;
    if (off > t) /* our clock, from a LEASE_REQ of ours: never in the future */
        return BAD_FRAME();
    uint64_t until = add_saturating(off, k->link->lease_ns); /* a stale grant (read late) gives a stale lease */
    if (until > k->lease_until)
        k->lease_until = until;
    return 1;
}

/* Validate a received header and set up its payload. Returns 0 if the
 * connection was dropped. Caller holds c->lock. */
static int on_header(kv_net *n, kv_conn *k, int *sig) {
    kv_frame *h = &k->in_header;
    kv_core *c = n->core;
    if (h->magic != KV_MAGIC || h->type < F_HELLO || h->type > F_LAST)
        return BAD_FRAME();
    if (k->state == C_HELLO_WAIT) {
        if (h->type != F_HELLO || h->length != KV_TOKEN_BYTES)
            return BAD_FRAME();
        k->peer_datav = (h->flags & F_FLAG_DATAV) != 0; /* old peers send 0: DATA only */
        k->peer_reads = h->flags & F_READ_KINDS;
        k->in_type = F_HELLO;
        k->in_dest = k->hello_token;
        k->in_left = k->in_length = KV_TOKEN_BYTES;
        k->in_discard = 0;
        k->in_state = IN_PAYLOAD;
        return 1;
    }
    kv_link *l = k->link;
    if (k->state == C_HELLO_SENT) {
        if (h->type != F_HELLO_ACK)
            return BAD_FRAME();
        k->peer_datav = (h->flags & F_FLAG_DATAV) != 0;
        l->peer_reads = h->flags & F_READ_KINDS;
        k->state = C_UP;
        if (lease_request(k, now_ns()) < 0)
            return *sig |= fail_conn(n, k, 0), 0;
        if (++l->nstreams_up == l->nstreams && l->ready_event) {
            *sig |= kv__post_event(c, l->ready_event);
            l->ready_event = NULL;
        }
        return 1;
    }
    switch (h->type) {
    case F_DATA:
        return on_data(n, k, sig);
    case F_DATAV:
        return on_datav(n, k, sig);
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
    case F_READV:
        return on_readv(n, k, sig);
    case F_RERR:
        return on_rerr(n, k, sig);
    case F_CREDIT: /* the receiver consumed one of our DATA frames: the window moves */
        if (h->length > KV_MAX_FRAME)
            return BAD_FRAME();
        l->wire_bytes -= h->length < l->wire_bytes ? h->length : l->wire_bytes;
        return 1;
    case F_LEASE_REQ:
        return on_lease_req(n, k, sig);
    case F_LEASE:
        return on_lease(n, k, sig);
    default: /* HELLO, HELLO_ACK on an authenticated stream */
        return BAD_FRAME();
    }
    k->in_type = h->type;
    k->in_xfer = h->xfer;
    k->in_left = k->in_length = h->length;
    k->in_state = IN_PAYLOAD;
    return 1;
}

static int tokens_equal(const uint8_t *a, const uint8_t *b) {
    uint8_t d = 0;
    for (int i = 0; i < KV_TOKEN_BYTES; i++)
        d |= (uint8_t)(a[i] ^ b[i]);
    return d == 0;
}

/* A frame's payload is in place. Caller holds c->lock. Returns 0 if the connection was dropped. */
static int on_payload(kv_net *n, kv_conn *k, int *sig) {
    kv_core *c = n->core;
    k->in_state = IN_HEADER;
    k->in_npieces = 0;
    if (k->in_region_ref) {
        kv__region_unref(c, k->in_region_ref);
        k->in_region_ref = 0;
    }
    if (k->in_type == F_HELLO) {
        kv_link *l = n->links;
        while (l && (l->dead || !tokens_equal(l->token, k->hello_token) || l->nconns >= l->nstreams))
            l = l->next;
        if (!l)
            return BAD_FRAME();
        k->index = l->nconns;
        l->conns[l->nconns++] = k;
        k->link = l;
        l->peer_reads = k->peer_reads;
        k->state = C_UP;
        n->npending--;
        kv_frame ack = frame_new(F_HELLO_ACK, F_FLAG_DATAV | READ_FLAGS, 0);
        if (ctrl_push(k, &ack) < 0 || lease_request(k, now_ns()) < 0)
            return *sig |= fail_conn(n, k, 0), 0;
        return 1;
    }
    kv_link *l = k->link;
    if (k->in_type == F_DATA) {
        /* every DATA frame consumed, written or discarded, is CREDITed on its
         * stream: the sender keeps at most its window on the wire, paced here
         * with no Python round trip (why a window: docs/tuning.md, tcp_window_bytes) */
        kv_frame *last = k->ctrl_count ? &k->ctrl_ring[(k->ctrl_head + k->ctrl_count - 1) % k->ctrl_capacity] : NULL;
        if (last && last->type == F_CREDIT && last->xfer == k->in_xfer && last->length + k->in_length <= KV_CREDIT_BATCH) {
            last->length += k->in_length; /* frames of one push back to back (small segments): one CREDIT */
        } else {
            kv_frame cr = frame_new(F_CREDIT, 0, k->in_xfer);
            cr.length = k->in_length;
            if (ctrl_push(k, &cr) < 0)
                return BAD_FRAME();
        }
        kv_incoming *x = incoming_find(l, k->in_xfer, 0);
        if (!k->in_discard)
            n->received += k->in_length;
        if (x && !x->aborted) {
            x->received += k->in_length;
            if (x->received == x->total) {
                kv_frame ack = frame_new(F_ACK, 0, k->in_xfer);
                incoming_del(l, x);
                if (ctrl_push(k, &ack) < 0)
                    return BAD_FRAME();
            }
        }
        return 1;
    }
    if (k->in_type == F_RDATA) {
        if (k->in_returns_window) { /* the READ it answers (asked on this stream) leaves the window */
            k->read_bytes_out -= k->in_length < k->read_bytes_out ? k->in_length : k->read_bytes_out;
            k->in_returns_window = 0;
        }
        if (k->in_discard)
            return 1;
        n->received += k->in_length;
        kv_tcp_job *j = tcp_job(n, kv__job_find(c, k->in_xfer));
        if (j && j->is_pull && j->job.state != KV_JS_DONE) {
            j->job.bytes_done += k->in_length;
            if (j->job.bytes_done >= j->job.total_bytes)
                *sig |= tcp_complete(n, l, j, KV_LLM_SUCCESS);
        }
    }
    return 1;
}

static int conn_recv(kv_net *n, kv_conn *k) {
    kv_core *c = n->core;
    int sig = 0;
    uint64_t budget = n->driving ? KV_DRIVE_RECV_BUDGET : KV_RECV_BUDGET;
    while (!k->dead && budget) {
        ssize_t r;
        if (k->in_state == IN_HEADER) {
            r = recv(k->fd, (char *)&k->in_header + k->in_header_got, sizeof k->in_header - k->in_header_got, MSG_DONTWAIT);
        } else if (k->in_state == IN_LIST) {
            r = recv(k->fd, (char *)k->in_list + k->in_list_got, k->in_npieces * sizeof(kv_piece) - k->in_list_got,
                     MSG_DONTWAIT);
        } else {
            uint64_t want = k->in_left;
            void *dst = k->in_dest;
            if (k->in_discard) {
                dst = n->scratch;
                if (want > KV_SCRATCH)
                    want = KV_SCRATCH;
            } else if (k->in_type == F_DATA) {
                if (want > KV_RECV_PLACE)
                    want = KV_RECV_PLACE;
                if (now_ns() >= k->lease_until) {
                    /* the lease, right before the write: once it is over the pusher may
                     * have reported the push failed (docs/protocol.md, "Leases") */
                    pthread_mutex_lock(&c->lock);
                    sig |= lease_fail(n, k);
                    pthread_mutex_unlock(&c->lock);
                    break;
                }
            }
            if (!k->in_discard) {
                /* a closed link's payload stays in the socket (the close's command kills the
                 * stream next): kv_tcp_link_close set `refused`, and waits for a recv that
                 * saw it unset (seq_cst on both sides: one of the two sees the other) */
                PLACE_HOOK(0, NULL);
                __atomic_store_n(&n->placing, k->link, __ATOMIC_SEQ_CST);
                if (k->link && __atomic_load_n(&k->link->refused, __ATOMIC_SEQ_CST)) {
                    __atomic_store_n(&n->placing, NULL, __ATOMIC_SEQ_CST);
                    break;
                }
                PLACE_HOOK(1, k->link ? &k->link->refused : NULL);
            }
            if (k->in_npieces && !k->in_discard) { /* DATAV: scattered into its pieces */
                struct iovec iov[KV_RECV_IOV];
                int cnt = 0;
                uint64_t off = k->in_poff;
                for (uint32_t i = k->in_pi; i < k->in_npieces && cnt < KV_RECV_IOV && want; i++, off = 0) {
                    uint64_t t = k->in_list[i].len - off;
                    if (t > want)
                        t = want;
                    iov[cnt].iov_base = (void *)(uintptr_t)(k->in_base + k->in_list[i].offset + off);
                    iov[cnt++].iov_len = (size_t)t;
                    want -= t;
                }
                r = readv(k->fd, iov, cnt);
            } else {
                r = recv(k->fd, dst, (size_t)want, MSG_DONTWAIT);
            }
            __atomic_store_n(&n->placing, NULL, __ATOMIC_SEQ_CST);
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        if (r <= 0) { /* EOF or error */
            pthread_mutex_lock(&c->lock);
            sig |= fail_conn(n, k, 0);
            pthread_mutex_unlock(&c->lock);
            break;
        }
        k->rx_progress_ns = n->round_ns;
        budget = (uint64_t)r >= budget ? 0 : budget - (uint64_t)r;
        if (k->in_state == IN_HEADER) {
            k->in_header_got += (size_t)r;
            if (k->in_header_got < sizeof k->in_header)
                continue;
            k->in_header_got = 0;
            pthread_mutex_lock(&c->lock);
            int ok = on_header(n, k, &sig);
            pthread_mutex_unlock(&c->lock);
            if (!ok)
                break;
        } else if (k->in_state == IN_LIST) {
            k->in_list_got += (size_t)r;
            if (k->in_list_got < k->in_npieces * sizeof(kv_piece))
                continue;
            pthread_mutex_lock(&c->lock);
            int ok = k->in_header.type == F_READV ? on_readv_list(n, k, &sig) : on_datav_list(n, k, &sig);
            pthread_mutex_unlock(&c->lock);
            if (!ok)
                break;
        } else {
            if (k->in_npieces && !k->in_discard) { /* the scatter cursor */
                for (uint64_t left = (uint64_t)r; left;) {
                    uint64_t t = k->in_list[k->in_pi].len - k->in_poff;
                    if (t > left)
                        t = left;
                    k->in_poff += t;
                    left -= t;
                    if (k->in_poff == k->in_list[k->in_pi].len) {
                        k->in_pi++;
                        k->in_poff = 0;
                    }
                }
            } else if (!k->in_discard) {
                k->in_dest += r;
            }
            k->in_left -= (uint64_t)r;
            if (k->in_left == 0) {
                pthread_mutex_lock(&c->lock);
                int ok = on_payload(n, k, &sig);
                pthread_mutex_unlock(&c->lock);
                if (!ok)
                    break;
                if (k->ctrl_count && ctrl_due(k)) /* CREDIT/ACK: out now, not after the read budget */
                    sig |= send_ctrl(n, k);
            }
        }
    }
    if (k->ctrl_count && !k->dead) /* CREDITs held back for a batch: nothing more to read now */
        sig |= send_ctrl(n, k);
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
    k->born_ns = now_ns();
    k->rx_progress_ns = k->tx_progress_ns = k->born_ns;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = k};
    if (epoll_ctl(n->epoll_fd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        free(k);
        return NULL;
    }
    k->next = n->conns;
    n->conns = k;
    return k;
}

static void link_free(kv_link *l) {
    free(l->ready_event);
    free(l->down_event);
    free(l);
}

/* Caller holds c->lock. */
static int run_command(kv_net *n, kv_command *m) {
    int sig = 0;
    if (m->type == CMD_LINK_ADD) {
        kv_link *l = calloc(1, sizeof *l);
        if (!l || link_find(n, m->link_id)) {
            free(l);
            free(m->ready_event);
            free(m->down_event);
            return 0;
        }
        l->id = m->link_id;
        memcpy(l->token, m->token, KV_TOKEN_BYTES);
        l->nstreams = m->nstreams;
        l->window = m->window;
        l->lease_ns = m->lease_ns;
        l->fence_ns = m->fence_ns;
        l->margin_ns = m->margin_ns;
        l->ready_event = m->ready_event;
        l->down_event = m->down_event;
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
        k->index = l->nconns;
        l->conns[l->nconns++] = k;
        kv_frame h = frame_new(F_HELLO, F_FLAG_DATAV | READ_FLAGS, 0);
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

static void reap_dead_conns(kv_net *n) {
    kv_conn **p = &n->conns;
    while (*p) {
        kv_conn *k = *p;
        if (k->dead) {
            *p = k->next;
            free(k->ctrl_ring);
            free(k->out_vec);
            free(k->out_list);
            free(k->in_list);
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
            epoll_ctl(n->epoll_fd, EPOLL_CTL_DEL, lfd, NULL);
            n->accept_paused = 1;
            n->accept_resume = now_ns() + KV_ACCEPT_PAUSE_NS;
            pthread_mutex_lock(&n->core->lock);
            n->core->stats.tcp_accept_paused++;
            pthread_mutex_unlock(&n->core->lock);
            return 0;
        }
        if (n->npending >= KV_MAX_PENDING) {
            close(fd);
            pthread_mutex_lock(&n->core->lock);
            n->core->stats.tcp_refused++;
            pthread_mutex_unlock(&n->core->lock);
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
 * Caller holds c->lock. Returns the signal flag; *next: when to look again. */
static int timers(kv_net *n, uint64_t t, uint64_t *next) {
    kv_core *c = n->core;
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
            if (t - k->born_ns > KV_HELLO_NS)
                sig |= fail_conn(n, k, 0);
            continue;
        }
        if (!k->link)
            continue;
        /* the idle bound: a payload under way or output waiting that moves no byte
         * for 2 * fence (an authenticated peer pinning a region, or not reading) */
        uint64_t idle = add_saturating(k->link->fence_ns, k->link->fence_ns);
        if (k->in_state == IN_HEADER)
            k->rx_progress_ns = t;
        if (!k->out_busy && !k->ctrl_count && !k->serve_head)
            k->tx_progress_ns = t;
        if (t - k->rx_progress_ns > idle || t - k->tx_progress_ns > idle) {
            c->stats.tcp_stalled++;
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
            l->renew_at = t + (l->lease_ns / 4 ? l->lease_ns / 4 : 1);
        }
        if (!l->dead && l->renew_at < nx)
            nx = l->renew_at;
    }
    /* a push aborted here whose ABORT_ACKs are not all in by its fence: the link fails */
    for (kv_tcp_job *j = n->timed_head; j;) {
        if (j->job.state == KV_JS_ABORTING && t >= j->due) {
            kv_link *l = link_find(n, j->link_id);
            c->stats.tcp_fence_expired++;
            sig |= l ? link_fail(n, l, KV_LLM_LINK_FAILED, 1) : tcp_complete(n, NULL, j, KV_LLM_LINK_FAILED);
            j = n->timed_head; /* the list changed */
            continue;
        }
        j = j->list_next;
    }
    /* pushes of failed links whose peer's lease is over */
    for (kv_tcp_job *j = n->timed_head; j;) {
        kv_tcp_job *nj = j->list_next;
        if (j->job.state == KV_JS_FENCING && t >= j->due)
            sig |= tcp_complete(n, NULL, j, j->job.record.status);
        else if (j->due < nx)
            nx = j->due;
        j = nj;
    }
    if (n->accept_paused) {
        if (t >= n->accept_resume) {
            struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &n->listen_fd};
            if (n->listen_fd < 0 || epoll_ctl(n->epoll_fd, EPOLL_CTL_ADD, n->listen_fd, &ev) == 0 || errno == EEXIST)
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

/* Anything of the engine's tcp under way but a drive's job: a job, a command or an abort,
 * a fence, a connection being set up, a transfer coming in, a stop. Caller holds c->lock. */
static int others_under_way(const kv_net *n) {
    if (n->live_jobs || work_queued(n) || n->timed_head || n->npending || n->stop_requested)
        return 1;
    for (const kv_link *l = n->links; l; l = l->next)
        if (l->nincoming)
            return 1;
    return 0;
}

/* Leave the sockets to the loop thread's drives while they run (quiet_watch), and do
 * not spin between them: a drive ended within KV_DRIVE_QUIET_NS
 * and nothing else of ours is under way (a job, a command, a fence, a transfer coming
 * in, a connection being set up or with output queued). Otherwise every ACK would wake
 * the I/O thread, which on two vCPUs takes the CPU from the peer's. Caller holds wlock
 * and c->lock. */
static int io_quiet(kv_net *n, uint64_t t) {
    if (t - __atomic_load_n(&n->drove_ns, __ATOMIC_RELAXED) >= KV_DRIVE_QUIET_NS || others_under_way(n))
        return 0;
    for (kv_conn *k = n->conns; k; k = k->next)
        if (!k->dead && k->out_armed)
            return 0;
    return 1;
}

/* A new job (INBOX: in the inbox or the drive slot) joins its link's send queue, or
 * completes if its link is gone. Caller holds c->lock. Returns 1 to signal the loop. */
static int job_take(kv_net *n, kv_tcp_job *j, int stop) {
    kv_link *l = stop ? NULL : link_find(n, j->link_id);
    if (!l || l->dead) /* (tcp_complete takes it out of the inbox or the slot) */
        return tcp_complete(n, NULL, j, stop ? KV_LLM_ENGINE_FINALIZED : KV_LLM_LINK_FAILED);
    if (j == n->drive_job)
        n->drive_job = NULL;
    else
        inbox_del(n, j);
    job_set_state(j, KV_JS_SENDING);
    send_queue_insert(l, j);
    return 0;
}

/* One round, by the I/O thread or a driver (the caller holds wlock): the commands, new
 * jobs and aborts, the `ne` events epoll reported, the timers, whatever became sendable.
 * Returns 1 once a stop was acted on and nothing is left to fence (the thread ends). */
static int io_round(kv_net *n, struct epoll_event *evs, int ne, int io_thread) {
    kv_core *c = n->core;
    n->round_ns = now_ns();
    if (ne > 0)
        n->last_busy = n->round_ns;
    n->driving = !io_thread;
    int sig = 0;
    pthread_mutex_lock(&c->lock);
    if (io_thread) /* (a driver's round leaves the I/O thread's sleep as it is: wake_io_thread) */
        n->sleeping = 0;
    if (work_queued(n)) /* new work is activity: keep polling */
        n->last_busy = n->round_ns;
    kv_command *cmds = n->commands_head;
    n->commands_head = n->commands_tail = NULL;
    int stop = n->stop_requested, lfd = n->listen_fd;
    /* commands first (a link is declared before jobs on it), then new jobs,
     * then aborts: one critical section, so nothing comes between them */
    while (cmds) {
        kv_command *m = cmds;
        cmds = m->next;
        if (!stop) {
            sig |= run_command(n, m);
        } else {
            if (m->type == CMD_CONN_ADD)
                close(m->fd);
            if (m->type == CMD_LINK_ADD) {
                free(m->ready_event);
                free(m->down_event);
            }
        }
        free(m);
    }
    if (!io_thread && n->drive_job) /* the driver's job, first */
        sig |= job_take(n, n->drive_job, stop);
    while (n->inbox_head) /* new jobs join their link's send queue */
        sig |= job_take(n, n->inbox_head, stop);
    while (n->abort_head) /* aborts requested since the last round */
        sig |= handle_abort(n, n->abort_head);
    if (stop && !n->stopped) { /* every link fails; pushes not fenced wait for their release */
        n->stopped = 1;
        for (kv_link *l = n->links; l; l = l->next)
            sig |= link_fail(n, l, KV_LLM_ENGINE_FINALIZED, 0);
        for (kv_conn *k = n->conns; k; k = k->next)
            conn_kill(n, k);
        if (n->listen_fd >= 0 && !n->accept_paused)
            epoll_ctl(n->epoll_fd, EPOLL_CTL_DEL, n->listen_fd, NULL);
        n->accept_paused = 0;
    }
    pthread_mutex_unlock(&c->lock);
    for (int i = 0; i < ne; i++) {
        void *p = evs[i].data.ptr;
        if (p == NULL) {
            uint64_t v;
            ssize_t r = read(n->wake_fd, &v, sizeof v);
            (void)r;
        } else if (p == &n->listen_fd) {
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
    pthread_mutex_lock(&c->lock);
    sig |= timers(n, t, &n->next_due);
    int done = stop && !n->timed_head;
    pthread_mutex_unlock(&c->lock);
    if (sig) { /* completions first: the loop refills the queue while this thread sends */
        kv__signal_loop(c);
        sig = 0;
    }
    for (kv_conn *k = n->conns; k; k = k->next) /* start whatever became sendable */
        if (!k->dead && !k->out_armed)
            sig |= conn_send(n, k);
    pthread_mutex_lock(&c->lock);
    c->stats.tcp_bytes_sent += n->sent;
    c->stats.tcp_bytes_received += n->received;
    n->sent = n->received = 0;
    uint64_t open = 0;
    for (kv_conn *k = n->conns; k; k = k->next)
        open += !k->dead;
    c->stats.tcp_conns = open;
    pthread_mutex_unlock(&c->lock);
    reap_dead_conns(n);
    if (sig)
        kv__signal_loop(c);
    return done;
}

static void *io_main(void *arg) {
    kv_net *n = arg;
    kv_core *c = n->core;
    struct epoll_event evs[64];
    pthread_mutex_lock(&n->wlock);
    for (;;) {
        /* Spin (poll without sleeping) for KV_SPIN_NS after activity, so a frame
         * does not wait for a sleeping thread to wake (docs/tuning.md, KV_SPIN_NS).
         * Each empty poll yields the core, so a woken event loop sharing it runs at
         * once. Otherwise sleep until the next timer (lease renewal, fence, release),
         * new work or a socket's event; while the loop thread drives pushes (io_quiet),
         * without spinning, and not for the sockets while a drive runs (quiet_watch). */
        uint64_t t0 = now_ns();
        pthread_mutex_lock(&c->lock);
        int quiet = io_quiet(n, t0);
        int spin = !quiet && KV_SPIN_NS && t0 - n->last_busy < KV_SPIN_NS;
        int tmo = 0;
        if (!spin)
            tmo = n->next_due <= t0 ? 0 : (int)((n->next_due - t0 + 999999) / 1000000);
        if (tmo) { /* about to block: from here on a submit, command or abort writes wake_fd */
            if (work_queued(n) || (n->stop_requested && !n->stopped))
                tmo = 0;
            else
                n->sleeping = 1;
        }
        pthread_mutex_unlock(&c->lock);
        uint64_t epoch = n->drive_epoch;
        pthread_mutex_unlock(&n->wlock);
        int ne = epoll_wait(quiet && tmo ? n->quiet_fd : n->epoll_fd, evs, 64, tmo);
        if (ne < 0)
            ne = 0;
        if (ne == 0 && spin) /* nothing yet: let a runnable thread (the event loop) have the core */
            sched_yield();
        /* The sockets, unless a driver holds them: it runs this round itself meanwhile, so
         * wait for new work or a tick, not for the lock. A thread blocked on the lock is
         * woken by every drive's unlock, and lost it again to the next drive: on two vCPUs
         * that wake-up took the CPU from the peer's I/O thread once a push (a one-layer
         * push 21 -> 35 us, for whole seconds at a time). (Its own event: `evs` holds this
         * round's, and the quiet set's entry for the sockets' set is no connection.) */
        while (pthread_mutex_trylock(&n->wlock) != 0) {
            struct epoll_event qev;
            pthread_mutex_lock(&c->lock);
            n->sleeping = 1; /* a hand-back or new work writes wake_fd */
            pthread_mutex_unlock(&c->lock);
            if (epoll_wait(n->quiet_fd, &qev, 1, 1) > 0) {
                uint64_t v;
                ssize_t r = read(n->wake_fd, &v, sizeof v);
                (void)r;
            }
        }
        if (quiet || n->drive_epoch != epoch) { /* the quiet set names no socket, or a drive ran
                                                 * meanwhile (these events may be stale): look now */
            ne = epoll_wait(n->epoll_fd, evs, 64, 0);
            if (ne < 0)
                ne = 0;
        }
        if (io_round(n, evs, ne, 1))
            break;
    }
    pthread_mutex_unlock(&n->wlock);
    reap_dead_conns(n);
    return NULL;
}

/* ------------------------------------------------------------------- API */

static uint32_t post_command(kv_core *c, kv_command *m) {
    kv_net *n;
    pthread_mutex_lock(&c->lock);
    uint32_t st = net_start(c, &n);
    if (st == KV_LLM_SUCCESS) {
        if (n->commands_tail)
            n->commands_tail->next = m;
        else
            n->commands_head = m;
        n->commands_tail = m;
        wake_io_thread(n);
    }
    pthread_mutex_unlock(&c->lock);
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
    pthread_mutex_lock(&c->lock); /* once per core (a second listener would leak the first) */
    int again = net_of(c) && net_of(c)->listen_fd >= 0;
    pthread_mutex_unlock(&c->lock);
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
    pthread_mutex_lock(&c->lock);
    uint32_t st = net_start(c, &n);
    if (st == KV_LLM_SUCCESS && n->listen_fd >= 0)
        st = KV_LLM_PARAM_INVALID; /* a concurrent call won */
    if (st == KV_LLM_SUCCESS) {
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &n->listen_fd};
        n->listen_fd = fd; /* before the I/O thread can see an event of it */
        if (epoll_ctl(n->epoll_fd, EPOLL_CTL_ADD, fd, &ev) < 0) {
            n->listen_fd = -1;
            st = KV_LLM_FAILED;
        }
    }
    pthread_mutex_unlock(&c->lock);
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
    kv_command *m = calloc(1, sizeof *m);
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
    m->lease_ns = lease_ns;
    m->fence_ns = fence_ns;
    m->margin_ns = margin_ns;
    memcpy(m->token, token, KV_TOKEN_BYTES);
    m->ready_event = r;
    m->down_event = d;
    uint32_t st = post_command(c, m);
    if (st != KV_LLM_SUCCESS) {
        free(m);
        free(r);
        free(d);
    }
    return st;
}

uint32_t kv_tcp_conn_add(kv_core *c, int fd, uint32_t link_id) {
    kv_command *m = calloc(1, sizeof *m);
    if (!m) {
        close(fd);
        return KV_LLM_OUT_OF_MEMORY;
    }
    m->type = CMD_CONN_ADD;
    m->fd = fd;
    m->link_id = link_id;
    uint32_t st = post_command(c, m);
    if (st != KV_LLM_SUCCESS) {
        close(fd);
        free(m);
    }
    return st;
}

uint32_t kv_tcp_link_close(kv_core *c, uint32_t link_id, uint32_t status) {
    /* Nothing of the link lands from now on, before the (asynchronous) command fails it:
     * its caller reports the link down next, and a push of the peer's still in our
     * socket must not land in memory the application may already reuse. */
    pthread_mutex_lock(&c->lock);
    kv_net *n = net_of(c);
    kv_link *l = n ? link_find(n, link_id) : NULL; /* links are freed under c->lock, by the command */
    if (l)
        __atomic_store_n(&l->refused, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&c->lock);
    /* the recv under way (one system call, at most KV_RECV_PLACE) ends first, within a bound:
     * a write stalled on a page fault (tests/test_fencing.py) may land after it, as the one
     * write the fence cannot stop (docs/protocol.md, "Leases") */
    for (uint64_t until = now_ns() + KV_CLOSE_PLACE_WAIT_NS;
         l && __atomic_load_n(&n->placing, __ATOMIC_SEQ_CST) == l && now_ns() < until;)
        sched_yield();
    kv_command *m = calloc(1, sizeof *m);
    if (!m)
        return KV_LLM_OUT_OF_MEMORY;
    m->type = CMD_LINK_CLOSE;
    m->link_id = link_id;
    m->status = status ? status : KV_LLM_LINK_FAILED;
    uint32_t st = post_command(c, m);
    if (st != KV_LLM_SUCCESS)
        free(m);
    return st;
}

typedef struct {
    kv_net *n;
    unsigned idle; /* rounds in a row that found nothing */
} tcp_drive;

/* Whether the quiet I/O thread wakes for the sockets. Off while a drive runs: its ACK
 * would wake the thread, on the CPU the peer's I/O thread needs, for a frame the driver
 * reads itself. On between drives: whatever comes in meanwhile (a peer's push, a READ
 * of a pull from us) is the I/O thread's at once, not at its next tick (before, it was
 * left for up to 1 ms: docs/benchmarks.md, "Traffic in while the loop thread drives"). */
static void quiet_watch(kv_net *n, int on) {
    struct epoll_event ev = {.events = on ? EPOLLIN : 0, .data.ptr = n};
    (void)epoll_ctl(n->quiet_fd, EPOLL_CTL_MOD, n->epoll_fd, &ev);
}

/* A driven job the driver gives up (not begun, or not complete in time): the I/O thread's
 * from now on, counted and watched as any other. Caller holds c->lock. */
static void drive_hand_back(kv_net *n, uint64_t job_id) {
    kv_core *c = n->core;
    kv_tcp_job *j = tcp_job(n, kv__job_find(c, job_id));
    c->stats.tcp_drive_handed++;
    if (j && j->driven) {
        j->driven = 0;
        n->live_jobs++;
        if (j == n->drive_job) { /* not begun: into the inbox */
            n->drive_job = NULL;
            inbox_add(n, j);
        }
    }
    wake_io_thread(n);
}

/* The driver's round: the I/O thread's, on what epoll reports now. */
static int drive_round(void *arg) {
    tcp_drive *d = arg;
    kv_net *n = d->n;
    struct epoll_event evs[64];
    int ne = epoll_wait(n->epoll_fd, evs, 64, 0);
    if (ne < 0)
        ne = 0;
    (void)io_round(n, evs, ne, 0);
    /* the ACK comes from the peer's I/O thread, which may share our CPU: yield now and
     * then (the same lesson as kv_ucx.c's drive_progress) */
    if (ne)
        d->idle = 0;
    else if (++d->idle % KV_DRIVE_YIELD == 0)
        sched_yield();
    return ne > 0;
}

int kv_tcp_submit_driven(kv_core *c, uint64_t job_id, const uint64_t *segs, size_t nsegs, uint32_t lease,
                         uint64_t bound_ns, kv_completion *out, uint32_t *status) {
    pthread_mutex_lock(&c->lock);
    kv_net *n = net_of(c);
    pthread_mutex_unlock(&c->lock);
    int done = 0;
    uint64_t nbytes = 0;
    tcp_driving = 1; /* tcp_submit: no wake-up of the I/O thread */
    *status = kv_core_submit_leased(c, job_id, segs, nsegs, 0, 0, lease, &done, &nbytes);
    tcp_driving = 0;
    if (*status != KV_LLM_SUCCESS || done || !n)
        return -1;
    /* the sockets: the I/O thread holds them for one round at a time (microseconds) */
    uint64_t t0 = now_ns();
    int got = kv__trylock_within(&n->wlock, bound_ns < KV_DRIVE_LOCK_NS ? bound_ns : KV_DRIVE_LOCK_NS);
    pthread_mutex_lock(&c->lock);
    if (!got || others_under_way(n)) {
        /* the sockets busy, other transfers under way (their bytes are the I/O thread's to
         * move, not the loop thread's), or the I/O thread's commands (a link's close) go
         * first: it carries the job */
        drive_hand_back(n, job_id);
        pthread_mutex_unlock(&c->lock);
        if (got)
            pthread_mutex_unlock(&n->wlock);
        uint64_t spent = now_ns() - t0;
        return kv_core_wait_take(c, job_id, bound_ns > spent ? bound_ns - spent : 0, out);
    }
    pthread_mutex_unlock(&c->lock);
    quiet_watch(n, 0);
    n->drive_epoch++;
    tcp_drive d = {.n = n, .idle = 0};
    uint64_t spent = now_ns() - t0;
    int found = kv__wait_take_driving(c, job_id, bound_ns > spent ? bound_ns - spent : 0, out, drive_round, &d);
    __atomic_store_n(&n->drove_ns, now_ns(), __ATOMIC_RELAXED);
    pthread_mutex_lock(&c->lock);
    if (found)
        c->stats.tcp_driven++;
    else /* the I/O thread carries it on */
        drive_hand_back(n, job_id);
    pthread_mutex_unlock(&c->lock);
    pthread_mutex_unlock(&n->wlock);
    quiet_watch(n, 1); /* (a frame already in: the thread wakes now) */
    return found;
}

/* ------------------------------------------------- the transport interface */

static uint32_t tcp_submit(kv_transport *t, kv_job *job) {
    kv_net *n = (kv_net *)t;
    kv_tcp_job *j = (kv_tcp_job *)job; /* allocated tcp_ops.job_size */
    kv_core *c = n->core;
    if (n->stop_requested)
        return KV_LLM_LINK_FAILED;
    /* resolve() put the link and the peer's side in every segment alike */
    j->link_id = (uint32_t)job->segments[0].pid;
    j->is_pull = job->segments[0].src_kind == KV_REGION_TCP;
    /* a pull's answer tracking exists before any frame can name the job */
    if (j->is_pull && !(j->pull = pull_tracking_new(j, c->chunk_bytes)))
        return KV_LLM_OUT_OF_MEMORY;
    kv__job_hash(c, job);
    j->job.state = KV_JS_INBOX;
    if (tcp_driving) { /* its driver takes it in its first round: the I/O thread neither sees nor counts it */
        j->driven = 1;
        n->drive_job = j;
        return KV_LLM_SUCCESS;
    }
    inbox_add(n, j);
    n->live_jobs++;
    wake_io_thread(n);
    return KV_LLM_SUCCESS;
}

static uint32_t tcp_abort(kv_transport *t, kv_job *job, uint32_t status, int *sig) {
    kv_net *n = (kv_net *)t;
    kv_tcp_job *j = (kv_tcp_job *)job;
    kv_core *c = n->core;
    if (j->job.state != KV_JS_INBOX && j->job.state != KV_JS_SENDING && j->job.state != KV_JS_SENT)
        return KV_LLM_PARAM_INVALID; /* aborting, fencing: its completion is on its way */
    if (j->job.record.status == KV_LLM_SUCCESS)
        j->job.record.status = status;
    c->stats.jobs_aborted++;
    if (j->job.state == KV_JS_INBOX) { /* nothing of it exists on the wire: done */
        *sig = tcp_complete(n, NULL, j, status);
        return KV_LLM_SUCCESS;
    }
    job_set_state(j, KV_JS_ABORT_REQ);
    list_add(&n->abort_head, j);
    wake_io_thread(n);
    return KV_LLM_SUCCESS;
}

static void tcp_stop(kv_transport *t) {
    kv_net *n = (kv_net *)t;
    kv_core *c = n->core;
    pthread_mutex_lock(&c->lock);
    if (n->stop_requested) {
        pthread_mutex_unlock(&c->lock);
        return;
    }
    n->stop_requested = 1;
    wake_io_thread(n);
    pthread_mutex_unlock(&c->lock);
    pthread_join(n->thread, NULL);
}

static void tcp_destroy(kv_transport *t) {
    kv_net *n = (kv_net *)t;
    while (n->links) {
        kv_link *l = n->links;
        n->links = l->next;
        for (unsigned b = 0; b < KV_INCOMING_BUCKETS; b++)
            while (l->incoming[b])
                incoming_del(l, l->incoming[b]);
        link_free(l);
    }
    if (n->listen_fd >= 0)
        close(n->listen_fd);
    close(n->epoll_fd);
    close(n->quiet_fd);
    close(n->wake_fd);
    pthread_mutex_destroy(&n->wlock);
    free(n->scratch);
    free(n);
}

/* Does this pull take its 2-D segments as they are (kv_transport_ops.pull_2d)? Each
 * READ then asks up to `chunk_bytes` of a segment's rows, at most KV_MAX_PIECES of them
 * (read_unit; F_FLAG_ROWS), which the peer gathers into one RDATA: if the peer serves
 * such READs (an older one does not: the core then pulls the rows one by one) and the
 * rows' length fits the frame's field. Caller holds c->lock. */
static int tcp_pull_2d(kv_transport *t, const kv_segment *rs, size_t nsegs) {
    kv_net *n = (kv_net *)t;
    kv_link *l = link_find(n, (uint32_t)rs[0].pid);
    if (!l || l->dead || !(l->peer_reads & F_FLAG_READ2D))
        return 0;
    for (size_t i = 0; i < nsegs; i++)
        if (rs[i].rows > 1 && rs[i].len > UINT32_MAX)
            return 0;
    return 1;
}

static const kv_transport_ops tcp_ops = {
    .job_size = sizeof(kv_tcp_job),
    .submit = tcp_submit,
    .abort = tcp_abort,
    .stop = tcp_stop,
    .destroy = tcp_destroy,
    .seg2d = KV_T2D_PUSH, /* pushes: rows gathered into DATAV (or one DATA per row) */
    .pull_2d = tcp_pull_2d, /* pulls: READs of rows, or expanded into one segment per row */
};
