/* Fuzz test of the kvengine TCP data plane's receive path
 * (cython_src/csrc/kv_tcp.c): random and mutated frames go over real TCP
 * connections into a real core, under AddressSanitizer + UBSan.
 *
 * Usage: fuzz_tcp [iterations [seed]]   (defaults: 2000, about 4 s under ASan;
 * a time-based seed). The seed is printed first and in every failure message:
 * `fuzz_tcp N SEED` replays a run (up to thread timing, which the checks
 * below are built not to depend on).
 *
 * Sessions, one per iteration, picked at random:
 *   preauth  connections that never authenticate: random bytes, frames before
 *            HELLO (CREDIT among them), HELLO with a wrong token / wrong
 *            length / a dead link's token, truncated HELLOs, byte-at-a-time
 *            sends. Each must end as exactly one tcp_refused and bind nothing.
 *   server   a correct HELLO, then a sequence of frames built from valid
 *            templates and mutated (fields set to edge values, bit flips,
 *            oversized lengths, UINT64_MAX-ish offsets, region ids that are
 *            unknown, removed, not exported or a peer's, totals that disagree
 *            with the open transfer, ACK/ABORT/ABORT_ACK/READ/RDATA/RERR/CREDIT
 *            for unknown transfers, CREDITs over 64 MiB (a bad frame), READs of
 *            regions not exported, HELLO again, raw random headers, headers
 *            and payloads in small pieces), then a
 *            cut mid-header or mid-payload, a half-close, a close or a reset; a
 *            second HELLO for the (full) link is refused meanwhile.
 *   multi    the same on two streams of one link, the test ordering the core's
 *            work across them: ABORT on one stream while a DATA payload is
 *            half-way on the other (the rest must be discarded), one transfer
 *            on both streams, a bad frame on one stream killing the other.
 *   notify   an exported KV_REGION_F_NOTIFY region removed while a DATA
 *            payload into it is in flight: the bytes still land,
 *            KV_EVENT_REGION_FREED follows, the buffer is freed (ASan watches).
 *   peer     the core initiates a push or a pull over the link (accepted
 *            streams, or streams handed over with kv_tcp_conn_add, where the
 *            test answers the core's HELLO) and the test plays the remote
 *            engine: it checks every DATA/READ/ABORT frame and answers with
 *            ACK / ABORT_ACK / RDATA / RERR, valid and hostile (RDATA outside
 *            the job, answers to nothing, a READ answered twice while another
 *            answer is in flight, an ACK or ABORT_ACK while a DATA frame is
 *            still half-sent, a CREDIT over 64 MiB); source and destination
 *            buffers are freed as soon as their job completes, so ASan reports
 *            any later access. Some push links have a window: the test CREDITs
 *            the DATA it received (late, in bulk, in parts, naming other
 *            transfers, in excess when it knows the core's count) and checks
 *            that no more than the window plus one chunk is ever unCREDITed, or
 *            withholds its CREDITs until the core stalls and aborts the job
 *            (fenced all the same); a never-CREDITed window holds no READ back.
 *            Links end by a peer's close or by kv_tcp_link_close; dead links
 *            get kv_tcp_conn_add / kv_tcp_link_close once more.
 *   window   (once a run, and now and then) a push window on one stream, where
 *            the test's count of unCREDITed bytes is the core's: a push stops
 *            at exactly the frames the window allows; pushes of lower rank
 *            submitted then go first once CREDITed (equal ranks in submission
 *            order) and complete before it; a push that cannot start (window
 *            full) completes at once on abort with KV_DONE_UNSTARTED while a
 *            pull behind it goes through; the window reopens.
 *   rank     (once a run, and now and then) rank order with no window: a core
 *            with a small send buffer, a big push of rank 100 under way, small
 *            ones of rank 1 overtake it at its next frame.
 *   client   streams handed to the core whose peer answers HELLO wrongly.
 * Once per run: a flood of unauthenticated connections (the 256 pending
 * limit), and the per-link limits (65536 open transfers, 4096 unread READs,
 * 65536 unread control frames, a discarded payload past the 1 MiB scratch).
 *
 * The test carries a model of the receiver (on_header / on_payload: the
 * documented checks) run over the exact bytes it sends, and checks after
 * every session, and inside sessions at sync points (a ping: an ABORT(pull)
 * of an unused transfer, whose ABORT_ACK proves the core processed everything
 * sent before it on that stream):
 *   - the canaries (two registered, non-exported guards around the exported
 *     region, one buffer never registered) are unchanged;
 *   - the exported region equals the model exactly; after an abrupt close
 *     (where the core may stop anywhere) it equals the model after some prefix
 *     of the stream;
 *   - every control frame and READ answer the core sends is the one the model
 *     expects, in order, with the exported bytes as payload (a CREDIT for
 *     every DATA payload consumed, written or discarded, before the ACK it may
 *     complete);
 *   - tcp_refused, tcp_bad_frames, tcp_links_failed move exactly as the model
 *     says, tcp_bytes_received within its bounds, tcp_conns returns to 0;
 *   - every link with a stream gets exactly one KV_EVENT_LINK_DOWN (none after
 *     kv_tcp_link_close), client links one KV_EVENT_LINK_READY;
 *   - every job completes exactly once, with the status, byte count and flags
 *     (KV_DONE_UNSTARTED) its answers call for; an aborted push only after its
 *     last ABORT_ACK; no frame of a job follows its completion; a job's
 *     destination does not change after its completion.
 * At the end a fresh link and the decoy link (declared first, offered only bad
 * HELLOs) each take a valid DATA push that is ACKed and lands exactly; then
 * kv_core_close + kv_core_free (LeakSanitizer checks the rest at exit).
 *
 * Every blocking wait is bounded (poll(2) with a timeout, plus an alarm()
 * watchdog): a bug fails the run, it never hangs. Output ends with
 * "N passed, 0 failed". Built and run by tests/test_native_c.py and by
 * tests/native/run_asan.sh --fuzz.
 */
#include "kv_core.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------- the wire format (kv_tcp.c) */

#define MAGIC 0x3145564Bu
enum { F_HELLO = 1, F_HELLO_ACK, F_DATA, F_ACK, F_ABORT, F_ABORT_ACK, F_READ, F_RDATA, F_RERR, F_CREDIT,
       F_LEASE_REQ, F_LEASE, F_DATAV, F_READV, F_LAST = F_READV };
#define F_PULL 1u
#define F_DATAV_OK 2u /* HELLO, HELLO_ACK flag: this end takes DATAV */
#define F_READ2D_OK 4u /* HELLO, HELLO_ACK flag: this end serves READs of rows */
#define F_ROWS 4u      /* READ: rows of `pad` bytes, `total` apart, from `offset`; `offset2` into them */
#define F_READV_OK 8u  /* HELLO, HELLO_ACK flag: this end serves READV */
#define F_PIECES 8u    /* RDATA: the answer to a READV */
#define F_READVR_OK 16u /* HELLO, HELLO_ACK flag: this end serves READVs of rows (READV + F_ROWS) */
#define F_READS_OK (F_READ2D_OK | F_READV_OK | F_READVR_OK)
#define MAX_ROWS 1024u /* rows one READ of rows may span (kv_tcp.c KV_MAX_PIECES) */
#define MAX_PIECES 1024u /* pieces of one DATAV */
typedef struct {
    uint64_t offset, len;
} piece;
#define MAX_FRAME (64ull << 20) /* payload bytes of one frame */
#define MAX_TOTAL (1ull << 48)  /* bytes of one transfer */
#define MAX_PENDING 256         /* unauthenticated connections at once */
#define MS 1000000ull           /* ns */
/* Leases (the lease is the same both ways on a link): links where the core
 * receives get a long one (granted once, it outlives any session), links where
 * it pushes a short one (a push of a failed link completes at the release:
 * the last grant + lease + margin). */
#define SRV_LEASE (60000 * MS)
#define SRV_FENCE (20000 * MS)
#define PEER_FENCE (5000 * MS)
#define MARGIN (5 * MS)

static uint64_t ns_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts); /* the core's clock: lease offsets are comparable */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

typedef struct {
    uint32_t magic;
    uint16_t type;
    uint16_t flags;
    uint32_t status;
    uint32_t region;
    uint64_t xfer;
    uint64_t offset;
    uint64_t length;
    uint64_t total;
    uint32_t region2;
    uint32_t pad;
    uint64_t offset2;
} fr;
typedef char fr_is_64_bytes[sizeof(fr) == 64 ? 1 : -1];

/* ------------------------------------------------------------------ harness */

#define KiB ((uint64_t)1024)
#define WATCHDOG_SECONDS 90 /* plus 1 s per 100 iterations */
#define WAIT_MS 5000 /* the most any single wait may take */
#define DEFAULT_ITERS 2000

#define EXP_LEN (64 * KiB)   /* the exported region */
#define GUARD_LEN (4 * KiB)  /* registered, not exported, on each side of it */
#define CANARY_LEN (16 * KiB)
#define CHUNK (16 * KiB)     /* the core's chunk: a push or pull frame's size */
#define PEER_LEN (64 * 1024 * KiB) /* the remote region of peer jobs (never memory here) */

static uint64_t g_seed;
static long g_iter = -1;
static const char *g_what = "setup";

#define FAILED_AT(fmt, ...)                                                                       \
    fprintf(stderr, "%s:%d: [seed %" PRIu64 " iteration %ld %s] " fmt "\n", __FILE__, __LINE__, \
            g_seed, g_iter, g_what, __VA_ARGS__)
#include "check.h"

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    CHECK(p != NULL);
    return p;
}

/* splitmix64: the only source of randomness, so a seed replays a run. */
static uint64_t g_rng;
static uint64_t rnd(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static uint64_t below(uint64_t n) { return n ? rnd() % n : 0; }
static int chance(int pct) { return below(100) < (uint64_t)pct; }
static void rnd_bytes(uint8_t *p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = rnd();
        memcpy(p + i, &v, 8);
    }
    if (i < n) {
        uint64_t v = rnd();
        memcpy(p + i, &v, n - i);
    }
}

/* A byte that is not b. */
static uint8_t other(uint8_t b) { return (uint8_t)(b + 1 + below(255)); }

/* ------------------------------------------------------------- core state */

static kv_core *g_core;
static uint16_t g_port;

static uint8_t *g_arena;  /* guard | exported | guard */
static uint8_t *g_exp;    /* the exported region */
static uint8_t *g_shadow; /* what it must hold */
static uint8_t *g_canary; /* never registered */
static uint32_t g_guard1, g_exp_id, g_guard2, g_removed_id, g_tcp_kind_id;

#define GUARD_BYTE(i) ((uint8_t)(0xA5 ^ (i) * 7))
#define CANARY_BYTE(i) ((uint8_t)(0x3C ^ (i) * 13))

static void check_canaries(void) {
    for (uint64_t i = 0; i < GUARD_LEN; i++) {
        if (g_arena[i] != GUARD_BYTE(i) || g_arena[GUARD_LEN + EXP_LEN + i] != GUARD_BYTE(i)) {
            FAILED_AT("guard byte %" PRIu64 " changed", i);
            die();
        }
    }
    for (uint64_t i = 0; i < CANARY_LEN; i++) {
        if (g_canary[i] != CANARY_BYTE(i)) {
            FAILED_AT("canary byte %" PRIu64 " changed", i);
            die();
        }
    }
    g_checks++;
}

static void check_exp_exact(void) {
    if (memcmp(g_exp, g_shadow, EXP_LEN) != 0) {
        uint64_t i = 0;
        while (g_exp[i] == g_shadow[i])
            i++;
        FAILED_AT("exported region differs from the model at byte %" PRIu64 " (0x%02x, want 0x%02x)", i,
                  g_exp[i], g_shadow[i]);
        die();
    }
    g_checks++;
}

/* ------------------------------------------------------- events and jobs */

typedef struct {
    uint32_t id;
    uint8_t tok[32];
    int nstreams, bound, down;
    int client, ready; /* streams handed to the core with kv_tcp_conn_add; LINK_READY seen */
    int closed;        /* kv_tcp_link_close called: no LINK_DOWN after that */
    uint64_t lease, fence, margin; /* ns */
    double down_ms;    /* when LINK_DOWN was seen */
} linkrec;

#define LINK_BASE 1000u
static linkrec *g_links;
static size_t g_nlinks, g_links_cap;

typedef struct {
    uint64_t id;
    int done;
    double done_ms; /* when its completion was seen */
    uint32_t status;
    uint64_t nbytes;
    uint32_t flags; /* KV_DONE_* */
} jobrec;

#define MAX_JOBS 64
static jobrec g_jobs[MAX_JOBS];
static size_t g_njobs;
static uint64_t g_next_job = 1;

#define MAX_REGIONS (1 << 22) /* region ids ever used: a few per session */
static uint8_t g_freed[MAX_REGIONS]; /* KV_EVENT_REGION_FREED seen */

static void on_completion(const kv_completion *cp) {
    if (cp->job_id & KV_EVENT) {
        uint64_t kind = cp->job_id & KV_EVENT_KIND_MASK, id = cp->job_id & KV_EVENT_ID_MASK;
        if (kind == KV_EVENT_LINK_DOWN) {
            CHECK(id >= LINK_BASE && id < LINK_BASE + g_nlinks);
            linkrec *l = &g_links[id - LINK_BASE];
            CHECK(l->bound);
            CHECK(!l->down); /* exactly once */
            CHECK(!l->closed);
            CHECK_EQ(cp->status, KV_LLM_LINK_FAILED);
            l->down = 1;
            l->down_ms = now_ms();
        } else if (kind == KV_EVENT_LINK_READY) { /* client streams, once all are acknowledged */
            CHECK(id >= LINK_BASE && id < LINK_BASE + g_nlinks);
            linkrec *l = &g_links[id - LINK_BASE];
            CHECK(l->client && !l->ready && !l->down);
            CHECK_EQ(cp->status, KV_LLM_SUCCESS);
            l->ready = 1;
        } else if (kind == KV_EVENT_REGION_FREED) {
            CHECK(id < MAX_REGIONS);
            CHECK(!g_freed[id]);
            g_freed[id] = 1;
        } else {
            FAILED_AT("unexpected event 0x%" PRIx64, cp->job_id);
            die();
        }
        return;
    }
    for (size_t i = 0; i < g_njobs; i++) {
        if (g_jobs[i].id == cp->job_id) {
            CHECK(!g_jobs[i].done); /* exactly once */
            g_jobs[i].done = 1;
            g_jobs[i].done_ms = now_ms();
            g_jobs[i].status = cp->status;
            g_jobs[i].nbytes = cp->nbytes;
            g_jobs[i].flags = cp->flags;
            CHECK((cp->flags & ~KV_DONE_UNSTARTED) == 0);
            return;
        }
    }
    FAILED_AT("completion of unknown job 0x%" PRIx64, cp->job_id);
    die();
}

/* Wait up to timeout_ms for the eventfd, then drain every completion. */
static void pump_events(int timeout_ms) {
    struct pollfd p = {kv_core_fileno(g_core), POLLIN, 0};
    int r = poll(&p, 1, timeout_ms);
    if (r < 0) {
        CHECK(errno == EINTR);
        return;
    }
    kv_completion cp[32];
    size_t n;
    while ((n = kv_core_poll(g_core, cp, 32)) > 0)
        for (size_t i = 0; i < n; i++)
            on_completion(&cp[i]);
}

/* A link with a push window of `window` bytes (0: none) and the lease, fence
 * and margin given (ns). */
static linkrec *link_new_lw(int nstreams, uint64_t window, uint64_t lease, uint64_t fence, uint64_t margin) {
    CHECK(g_nlinks < g_links_cap);
    linkrec *l = &g_links[g_nlinks];
    memset(l, 0, sizeof *l);
    l->id = LINK_BASE + (uint32_t)g_nlinks++;
    l->nstreams = nstreams;
    l->lease = lease;
    l->fence = fence;
    l->margin = margin;
    rnd_bytes(l->tok, sizeof l->tok);
    CHECK_EQ(kv_tcp_link_add(g_core, l->id, l->tok, nstreams, window, lease, fence, margin), KV_LLM_SUCCESS);
    return l;
}

/* A link where the core receives. */
static linkrec *link_new_w(int nstreams, uint64_t window) {
    return link_new_lw(nstreams, window, SRV_LEASE, SRV_FENCE, MARGIN);
}

/* Mostly no window; sometimes one (it only paces the core's pushes: as a
 * receiver the core's behaviour must not change). */
static linkrec *link_new(int nstreams) {
    static const uint64_t w[] = {1, 4096, 16384, 1ull << 20, UINT64_MAX};
    return link_new_w(nstreams, chance(90) ? 0 : w[below(sizeof w / sizeof w[0])]);
}

static void wait_link_down(linkrec *l) {
    double end = now_ms() + WAIT_MS;
    while (!l->down) {
        CHECK(now_ms() < end);
        pump_events(10);
    }
}

static jobrec *job_new(void) {
    CHECK(g_njobs < MAX_JOBS);
    jobrec *j = &g_jobs[g_njobs++];
    memset(j, 0, sizeof *j);
    j->id = g_next_job++;
    return j;
}

static void job_forget(jobrec *j) {
    CHECK(j->done);
    *j = g_jobs[--g_njobs];
}

static void wait_job(jobrec *j) {
    double end = now_ms() + WAIT_MS;
    while (!j->done) {
        CHECK(now_ms() < end);
        pump_events(10);
    }
}

static void wait_freed(uint32_t rid) {
    double end = now_ms() + WAIT_MS;
    while (!g_freed[rid]) {
        CHECK(now_ms() < end);
        pump_events(10);
    }
}

/* ------------------------------------------------------------------ stats */

static uint64_t e_refused, e_failed, e_bad, e_rx_lo, e_rx_hi, e_lease, e_fence, e_stalled; /* what the core's counters must say */

static kv_stats stats(void) {
    kv_stats s;
    memset(&s, 0xEE, sizeof s);
    kv_core_stats(g_core, &s);
    return s;
}

static int stats_match(const kv_stats *s) {
    return s->tcp_refused == e_refused && s->tcp_links_failed == e_failed && s->tcp_bad_frames == e_bad &&
           s->tcp_bytes_received >= e_rx_lo && s->tcp_bytes_received <= e_rx_hi && s->tcp_conns == 0 &&
           s->tcp_lease_expired == e_lease && s->tcp_fence_expired == e_fence && s->tcp_stalled == e_stalled;
}

/* The I/O thread publishes its counters once per round: wait for them. */
static void check_stats(void) {
    double end = now_ms() + WAIT_MS;
    kv_stats s = stats();
    while (!stats_match(&s) && now_ms() < end) {
        pump_events(1);
        s = stats();
    }
    if (!stats_match(&s)) {
        FAILED_AT("stats: refused %" PRIu64 " (want %" PRIu64 "), links_failed %" PRIu64 " (want %" PRIu64
                  "), bad_frames %" PRIu64 " (want %" PRIu64 "), bytes_received %" PRIu64 " (want %" PRIu64
                  "..%" PRIu64 "), conns %" PRIu64 " (want 0), lease_expired %" PRIu64 " (want %" PRIu64
                  "), fence_expired %" PRIu64 " (want %" PRIu64 "), stalled %" PRIu64 " (want %" PRIu64 ")",
                  s.tcp_refused, e_refused, s.tcp_links_failed, e_failed, s.tcp_bad_frames, e_bad,
                  s.tcp_bytes_received, e_rx_lo, e_rx_hi, s.tcp_conns, s.tcp_lease_expired, e_lease,
                  s.tcp_fence_expired, e_fence, s.tcp_stalled, e_stalled);
        die();
    }
    g_checks++;
}

/* ------------------------------------------------------- our side of a stream */

typedef struct {
    int fd;
    uint8_t *in; /* bytes from the core not yet parsed: in[off, len) */
    size_t off, len, cap;
    uint8_t *pay; /* the payload of the last frame returned */
    size_t paycap;
    int eof; /* the core closed it (EOF or reset) */
    /* the core's LEASE_REQs (on its own timer: taken out of the frame stream here) */
    long nreq;
    uint64_t req_last;
} pconn;

static void pc_open(pconn *c, int rcvbuf) {
    memset(c, 0, sizeof *c);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    if (rcvbuf)
        CHECK(setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf) == 0);
    int one = 1;
    CHECK(setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons(g_port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
        CHECK_EQ(errno, EINPROGRESS);
        struct pollfd p = {fd, POLLOUT, 0};
        int r;
        do
            r = poll(&p, 1, WAIT_MS);
        while (r < 0 && errno == EINTR);
        CHECK_EQ(r, 1);
        int err = -1;
        socklen_t sl = sizeof err;
        CHECK(getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl) == 0);
        CHECK_EQ(err, 0);
    }
    c->fd = fd;
}

/* The test's own listener: the far end of streams the core opens as a client. */
static int g_lfd = -1;
static uint16_t g_lport;

/* A connected pair: returns our end (as a pconn), *core_fd the end for kv_tcp_conn_add. */
static void pc_pair(pconn *c, int *core_fd) {
    if (g_lfd < 0) {
        g_lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        CHECK(g_lfd >= 0);
        struct sockaddr_in a;
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t sl = sizeof a;
        CHECK(bind(g_lfd, (struct sockaddr *)&a, sl) == 0 && listen(g_lfd, 16) == 0);
        CHECK(getsockname(g_lfd, (struct sockaddr *)&a, &sl) == 0);
        g_lport = ntohs(a.sin_port);
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons(g_lport);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(connect(fd, (struct sockaddr *)&a, sizeof a) == 0); /* loopback, backlog free: immediate */
    int our = accept4(g_lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    CHECK(our >= 0);
    int one = 1;
    setsockopt(our, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    memset(c, 0, sizeof *c);
    c->fd = our;
    *core_fd = fd;
}

/* Close; rst: with SO_LINGER 0, so the core gets a reset. */
static void pc_close(pconn *c, int rst) {
    if (c->fd >= 0) {
        if (rst) {
            struct linger lg = {1, 0};
            setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        }
        close(c->fd);
    }
    c->fd = -1;
    c->eof = 1;
    free(c->in);
    free(c->pay);
    c->in = c->pay = NULL;
    c->off = c->len = c->cap = c->paycap = 0;
}

/* Read whatever is there (waiting up to timeout_ms for something). Returns 1 if
 * anything came (or the stream ended). */
static int pc_fill(pconn *c, int timeout_ms) {
    if (c->eof)
        return 0;
    struct pollfd p = {c->fd, POLLIN, 0};
    int r = poll(&p, 1, timeout_ms);
    if (r <= 0) {
        CHECK(r == 0 || errno == EINTR);
        return 0;
    }
    int got = 0;
    for (int rounds = 0; rounds < 16; rounds++) {
        if (c->off && c->off == c->len)
            c->off = c->len = 0;
        if (c->cap - c->len < 64 * KiB) {
            if (c->off) {
                memmove(c->in, c->in + c->off, c->len - c->off);
                c->len -= c->off;
                c->off = 0;
            }
            if (c->cap - c->len < 64 * KiB) {
                c->cap = c->cap ? c->cap * 2 : 256 * KiB;
                c->in = realloc(c->in, c->cap);
                CHECK(c->in != NULL);
            }
        }
        ssize_t n = recv(c->fd, c->in + c->len, c->cap - c->len, MSG_DONTWAIT);
        if (n > 0) {
            c->len += (size_t)n;
            got = 1;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        c->eof = 1; /* 0: EOF; ECONNRESET and friends: reset */
        return 1;
    }
    return got;
}

static int has_payload(const fr *h) { return h->type == F_DATA || h->type == F_RDATA || h->type == F_HELLO; }

/* The next whole frame from the core within timeout_ms: 1; 0 if the stream
 * ended first (a partial frame may be left); -1 on timeout if allowed
 * (may_time_out), else the check fails. */
static int pc_frame_t(pconn *c, fr *h, int timeout_ms, int may_time_out) {
    double end = now_ms() + timeout_ms;
    for (;;) {
        size_t avail = c->len - c->off;
        if (avail >= sizeof *h) {
            memcpy(h, c->in + c->off, sizeof *h);
            uint64_t pl = has_payload(h) ? h->length : 0;
            if (pl > 64 * 1024 * KiB) {
                FAILED_AT("frame from the core with a %" PRIu64 "-byte payload (type %u)", pl, h->type);
                die();
            }
            if (avail >= sizeof *h + pl && h->type == F_LEASE_REQ) {
                /* the core asks for a lease (on a stream going up, then every lease/4):
                 * its clock, now or a moment ago, increasing; nothing else set */
                fr want = *h;
                want.offset = 0;
                fr z;
                memset(&z, 0, sizeof z);
                z.magic = MAGIC;
                z.type = F_LEASE_REQ;
                if (memcmp(&want, &z, sizeof z) != 0 || h->offset > ns_now() || h->offset < c->req_last) {
                    FAILED_AT("bad LEASE_REQ from the core (offset %" PRIu64 ", previous %" PRIu64 ")", h->offset,
                              c->req_last);
                    die();
                }
                c->nreq++;
                c->req_last = h->offset;
                c->off += sizeof *h;
                continue;
            }
            if (avail >= sizeof *h + pl) {
                if (pl > c->paycap) {
                    free(c->pay);
                    c->pay = xmalloc((size_t)pl);
                    c->paycap = (size_t)pl;
                }
                if (pl)
                    memcpy(c->pay, c->in + c->off + sizeof *h, (size_t)pl);
                c->off += sizeof *h + (size_t)pl;
                return 1;
            }
        }
        if (c->eof)
            return 0;
        double left = end - now_ms();
        if (left <= 0) {
            if (may_time_out)
                return -1;
            FAILED_AT("no frame from the core within %d ms (%zu bytes buffered)", timeout_ms, avail);
            die();
        }
        pc_fill(c, (int)left + 1);
    }
}

static int pc_frame(pconn *c, fr *h) { return pc_frame_t(c, h, WAIT_MS, 0); }

/* Send all of p. Returns 1, or 0 if the core has closed the stream. Reads
 * whatever arrives meanwhile (the core never stops reading, but keep both
 * directions moving). */
static int pc_send(pconn *c, const void *p, size_t n) {
    const uint8_t *b = p;
    double end = now_ms() + WAIT_MS;
    while (n) {
        ssize_t r = send(c->fd, b, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r > 0) {
            b += r;
            n -= (size_t)r;
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            CHECK(now_ms() < end);
            struct pollfd p2 = {c->fd, POLLOUT | (c->eof ? 0 : POLLIN), 0};
            int pr = poll(&p2, 1, 10);
            if (pr > 0 && (p2.revents & POLLIN))
                pc_fill(c, 0);
            continue;
        }
        CHECK(r < 0);
        return 0; /* EPIPE, ECONNRESET: the core closed it */
    }
    return 1;
}

/* Send in small random pieces with short pauses: the core must assemble
 * headers and payloads across reads. */
static int pc_send_split(pconn *c, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n) {
        size_t k = 1 + (size_t)below(n < 24 ? n : 24);
        if (!pc_send(c, b, k))
            return 0;
        b += k;
        n -= k;
        if (chance(30))
            sleep_us(50);
    }
    return 1;
}

/* Wait until the core closed the stream; frames still arriving are handed to
 * `on` (if set). */
static void pc_wait_eof(pconn *c, void (*on)(void *, const fr *, pconn *), void *arg) {
    fr h;
    int r;
    while ((r = pc_frame(c, &h)) == 1)
        if (on)
            on(arg, &h, c);
    CHECK(c->eof);
}

static fr mkf(uint16_t type, uint16_t flags, uint64_t xfer) {
    fr f;
    memset(&f, 0, sizeof f);
    f.magic = MAGIC;
    f.type = type;
    f.flags = flags;
    f.xfer = xfer;
    return f;
}

static int fr_eq(const fr *a, const fr *b) { return memcmp(a, b, sizeof *a) == 0; }

static void fr_print(const char *what, const fr *f) {
    fprintf(stderr,
            "  %s: magic %08x type %u flags %u status %08x region %u xfer 0x%" PRIx64 " offset 0x%" PRIx64
            " length 0x%" PRIx64 " total 0x%" PRIx64 " region2 %u pad %u offset2 0x%" PRIx64 "\n",
            what, f->magic, f->type, f->flags, f->status, f->region, f->xfer, f->offset, f->length, f->total,
            f->region2, f->pad, f->offset2);
}

/* HELLO with token `tok`. Returns 0 if the core had closed the stream already. */
static int hello_send(pconn *c, const uint8_t *tok, int split) {
    uint8_t b[64 + 32];
    fr h = mkf(F_HELLO, 0, 0);
    h.length = 32;
    if (chance(20)) { /* only type, length and the DATAV flag matter */
        h.flags = (uint16_t)(rnd() & ~(uint64_t)(F_DATAV_OK | F_READS_OK)); /* DATA, READ only */
        h.status = (uint32_t)rnd();
        h.xfer = rnd();
        h.offset2 = rnd();
    }
    memcpy(b, &h, 64);
    memcpy(b + 64, tok, 32);
    return split ? pc_send_split(c, b, sizeof b) : pc_send(c, b, sizeof b);
}

static void expect_hello_ack(pconn *c) {
    fr h, want = mkf(F_HELLO_ACK, F_DATAV_OK | F_READS_OK, 0);
    CHECK_EQ(pc_frame(c, &h), 1);
    if (!fr_eq(&h, &want)) {
        fr_print("got", &h);
        CHECK(fr_eq(&h, &want));
    }
}

/* ------------------------------------------------------- edge values */

static uint64_t special64(void) {
    static const uint64_t v[] = {0,
                                 1,
                                 2,
                                 31,
                                 32,
                                 33,
                                 64,
                                 4095,
                                 4096,
                                 EXP_LEN - 1,
                                 EXP_LEN,
                                 EXP_LEN + 1,
                                 2 * EXP_LEN,
                                 MAX_FRAME - 1,
                                 MAX_FRAME,
                                 MAX_FRAME + 1,
                                 MAX_TOTAL - 1,
                                 MAX_TOTAL,
                                 MAX_TOTAL + 1,
                                 UINT32_MAX,
                                 (uint64_t)UINT32_MAX + 1,
                                 (uint64_t)INT64_MAX,
                                 (uint64_t)INT64_MAX + 1,
                                 UINT64_MAX - EXP_LEN,
                                 UINT64_MAX - EXP_LEN + 1,
                                 UINT64_MAX - 64,
                                 UINT64_MAX - 1,
                                 UINT64_MAX};
    if (chance(15))
        return rnd();
    if (chance(15))
        return below(EXP_LEN + 2);
    return v[below(sizeof v / sizeof v[0])];
}

static uint32_t g_rid_pool[16];
static size_t g_rid_n;

static uint32_t special_rid(void) {
    switch (below(5)) {
    case 0:
        return g_exp_id;
    case 1:
        return (uint32_t)below(12);
    case 2:
        return UINT32_MAX - (uint32_t)below(2);
    case 3:
        return (uint32_t)rnd();
    default:
        return g_rid_pool[below(g_rid_n)];
    }
}

/* ------------------------------------------- model of the receiving core
 *
 * One session: a link whose streams are ours. The model follows on_header /
 * on_payload of kv_tcp.c (the documented checks) over the bytes sent, in the
 * order the core processes them (one stream: stream order; several: the test
 * orders them with pings and by waiting for payload bytes to land). */

typedef struct {
    uint64_t xfer, total, received, claimed; /* claimed: DATA headers accepted (kv_tcp.c checks it) */
    int aborted, aborts_seen;
} mrx;

typedef struct {
    fr f;                  /* the RDATA header expected */
    uint8_t *snap;         /* the exported bytes when the READ was processed; NULL: overwritten since */
    const uint8_t *src;    /* where they came from (region memory) */
    uint64_t span;         /* bytes from src they came from (more than the length for rows) */
    uint64_t abort_seq;    /* an ABORT(pull) sent after the READ may drop it: that ABORT's position */
} mserve;

#define CT_MAX 512
#define SV_MAX 48
#define RX_MAX 96
#define LOG_MAX 512
#define MAXC 2

typedef struct {
    pconn pc;
    uint64_t seq; /* frames sent */
    fr ct[CT_MAX]; /* control frames expected, FIFO */
    uint64_t ct_seq[CT_MAX];
    size_t ct_head, ct_n;
    mserve sv[SV_MAX]; /* RDATA expected, FIFO (some may be dropped by an ABORT(pull)) */
    size_t nsv;
    /* the core's receive state, as modelled */
    int in_pay, pay_discard;
    uint8_t *pay_base; /* region memory and shadow of the payload's destination */
    uint8_t *pay_shadow;
    uint64_t pay_off, pay_len, pay_done, pay_xfer;
    int pay_log; /* payload goes to the exported region: log it */
    size_t pay_logi;
    uint64_t lease_until; /* the core may write our DATA into place until then (0: no grant yet) */
    /* DATAV: its piece list is read as a payload (pay_list, discarded), then its data
     * scattered over the pieces (pay_np > 0) */
    int pay_list;
    uint32_t pay_np;
    fr vh; /* the DATAV header */
    piece list[MAX_PIECES];
} mconn;

typedef struct {
    uint64_t off, len;
    uint8_t *data;
} mwrite;

typedef struct {
    linkrec *l;
    mconn k[MAXC];
    int nk;     /* our streams */
    int nconns; /* streams the core bound to the link */
    mrx rx[RX_MAX];
    int nrx;
    int dead; /* the core failed the link (as far as the model knows: a bad frame, an expired lease) */
    int bad;
    int lease_failed; /* DATA into place without a valid lease */
    uint64_t rx_all, rx_synced; /* tcp_bytes_received: every completed payload; those before the last sync */
    mwrite log[LOG_MAX];        /* writes into the exported region */
    int nlog;
    uint8_t *pre; /* the exported region at the start */
    /* exported regions the model knows besides g_exp */
    uint32_t x_id;
    uint8_t *x_base, *x_shadow;
    uint64_t x_len;
    int x_live;
} msess;

static mrx *m_rx_find(msess *s, uint64_t x) {
    for (int i = 0; i < s->nrx; i++)
        if (s->rx[i].xfer == x)
            return &s->rx[i];
    return NULL;
}

static mrx *m_rx_new(msess *s, uint64_t x) {
    CHECK(s->nrx < RX_MAX);
    mrx *r = &s->rx[s->nrx++];
    memset(r, 0, sizeof *r);
    r->xfer = x;
    return r;
}

static void m_rx_del(msess *s, mrx *r) { *r = s->rx[--s->nrx]; }

static void m_expect(mconn *k, fr f) {
    CHECK(k->ct_n < CT_MAX);
    size_t i = (k->ct_head + k->ct_n++) % CT_MAX;
    k->ct[i] = f;
    k->ct_seq[i] = k->seq;
}

static void m_bad(msess *s) {
    s->dead = 1;
    s->bad = 1;
}

/* Length of the exported region `id` (and its memory), or 0 if not exported. */
static uint64_t m_exported(msess *s, uint32_t id, uint8_t **base, uint8_t **shadow) {
    if (id == g_exp_id) {
        *base = g_exp;
        *shadow = g_shadow;
        return EXP_LEN;
    }
    if (s->x_live && id == s->x_id) {
        *base = s->x_base;
        *shadow = s->x_shadow;
        return s->x_len;
    }
    return 0;
}

/* Pending READ answers overlapping bytes that are about to change can no longer be compared. */
static void m_dirty(msess *s, const uint8_t *p, uint64_t n) {
    for (int c = 0; c < s->nk; c++)
        for (size_t i = 0; i < s->k[c].nsv; i++) {
            mserve *v = &s->k[c].sv[i];
            if (v->snap && p < v->src + v->span && v->src < p + n) {
                free(v->snap);
                v->snap = NULL;
            }
        }
}

/* A LEASE's offset is the core's clock: in the past (a grant, perhaps stale) or
 * in the future (a bad frame). Offsets within 2 s after now would depend on
 * when the core reads the frame: moved out of that window, so the model can say. */
static void lease_offset_fix(fr *h) {
    if (h->type != F_LEASE)
        return;
    uint64_t t = ns_now();
    if (h->offset > t && h->offset - t < 2000 * MS)
        h->offset = t + 2000 * MS;
}

/* data_accept: a DATA (np 0) or DATAV (np pieces in k->list) header `h`
 * checked against the exported region at base/shadow. Returns the payload bytes. */
static uint64_t m_data_accept(msess *s, mconn *k, const fr *h, uint8_t *base, uint8_t *shadow, uint32_t np) {
    mrx *x = m_rx_find(s, h->xfer);
    if (!x) {
        x = m_rx_new(s, h->xfer);
        x->total = h->total;
    }
    if (!x->aborted && (x->total != h->total || h->length > x->total - x->claimed))
        return m_bad(s), 0;
    if (!x->aborted && ns_now() >= k->lease_until) { /* no write without a lease: the link fails */
        s->dead = 1;
        s->lease_failed = 1;
        return 0;
    }
    if (!x->aborted)
        x->claimed += h->length;
    k->in_pay = 1;
    k->pay_list = 0;
    k->pay_np = np;
    k->pay_discard = x->aborted;
    k->pay_base = base;
    k->pay_shadow = shadow;
    k->pay_off = h->offset;
    k->pay_len = h->length;
    k->pay_done = 0;
    k->pay_xfer = h->xfer;
    k->pay_log = base == g_exp && !x->aborted;
    if (k->pay_log) { /* one write per piece (DATAV), in order */
        uint32_t nw = np ? np : 1;
        CHECK(s->nlog + (int)nw <= LOG_MAX);
        k->pay_logi = (size_t)s->nlog;
        for (uint32_t i = 0; i < nw; i++) {
            mwrite *w = &s->log[s->nlog++];
            w->off = np ? k->list[i].offset : h->offset;
            w->len = 0;
            w->data = xmalloc((size_t)(np ? k->list[i].len : h->length));
        }
    }
    return h->length;
}

static uint64_t m_readv_done(msess *s, mconn *k, uint8_t *base, uint8_t *shadow, uint64_t rlen);

/* read_refused: a READ(V) of a region not exported is answered RERR; nothing more read. */
static uint64_t m_read_refused(mconn *k, const fr *h) {
    fr e = mkf(F_RERR, 0, h->xfer);
    e.status = KV_LLM_KV_CACHE_NOT_EXIST;
    e.length = h->length;
    m_expect(k, e);
    return 0;
}

/* pieces_fit: the list's pieces inside a region of rlen bytes, none empty, adding up to
 * exactly the frame's length (overflow-safe). */
static int m_pieces_fit(const mconn *k, uint64_t rlen) {
    uint64_t sum = 0;
    for (uint32_t i = 0; i < k->vh.region2; i++) {
        const piece *p = &k->list[i];
        if (p->len == 0 || p->offset > rlen || p->len > rlen - p->offset || p->len > k->vh.length - sum)
            return 0;
        sum += p->len;
    }
    return sum == k->vh.length;
}

/* on_datav_list / on_readv_list: the list is in. Returns the data bytes the core now
 * reads (0: bad, or a READV's, which has none). */
static uint64_t m_list_done(msess *s, mconn *k) {
    const fr *h = &k->vh;
    uint8_t *base = NULL, *shadow = NULL;
    uint64_t rlen = m_exported(s, h->region, &base, &shadow);
    k->in_pay = 0;
    k->pay_list = 0;
    if (h->type == F_READV)
        return m_readv_done(s, k, base, shadow, rlen);
    if (!rlen || !m_pieces_fit(k, rlen))
        return m_bad(s), 0;
    return m_data_accept(s, k, h, base, shadow, h->region2);
}

/* list_next: a DATAV's or READV's piece list is read next (as a payload, discarded). */
static uint64_t m_list_next(mconn *k, const fr *h) {
    k->vh = *h;
    k->in_pay = 1;
    k->pay_list = 1;
    k->pay_discard = 1;
    k->pay_log = 0;
    k->pay_np = 0;
    k->pay_len = (uint64_t)h->region2 * sizeof(piece);
    k->pay_done = 0;
    k->pay_xfer = h->xfer;
    return k->pay_len;
}

/* on_header, for a stream in C_UP. Returns the payload bytes the core now reads. */
static uint64_t m_header(msess *s, mconn *k, fr *h) {
    k->seq++;
    lease_offset_fix(h);
    if (s->dead)
        return 0;
    if (h->magic != MAGIC || h->type < F_HELLO || h->type > F_LAST)
        return m_bad(s), 0;
    switch (h->type) {
    case F_DATA: {
        uint8_t *base = NULL, *shadow = NULL;
        uint64_t rlen = m_exported(s, h->region, &base, &shadow);
        if (h->length == 0 || h->length > MAX_FRAME || h->total > MAX_TOTAL || h->length > h->total || !rlen ||
            h->offset > rlen || h->length > rlen - h->offset)
            return m_bad(s), 0;
        return m_data_accept(s, k, h, base, shadow, 0);
    }
    case F_DATAV: /* on_datav: the list is read whole, then checked (m_list_done) */
        if (h->length == 0 || h->length > MAX_FRAME || h->total > MAX_TOTAL || h->length > h->total ||
            h->region2 == 0 || h->region2 > MAX_PIECES || h->region2 > h->length || h->offset || h->offset2)
            return m_bad(s), 0;
        return m_list_next(k, h);
    case F_READV: /* on_readv: the list is read whole, then checked (m_readv_done); of rows
                   * (F_ROWS): rows of `pad` bytes, `total` apart */
        if (h->length == 0 || h->length > MAX_FRAME || h->region2 < 2 || h->region2 > MAX_PIECES ||
            h->region2 > h->length || h->offset || h->offset2 > UINT32_MAX ||
            ((h->flags & F_ROWS) ? h->pad == 0 || h->total < h->pad : h->pad != 0))
            return m_bad(s), 0;
        return m_list_next(k, h);
    case F_RDATA:
    case F_ACK:
    case F_ABORT_ACK:
    case F_RERR:
        return m_bad(s), 0; /* about no job (no tombstone) of this core: an answer to nothing */
    case F_LEASE_REQ: { /* granted: the offset echoed */
        fr g = mkf(F_LEASE, 0, 0);
        g.offset = h->offset;
        m_expect(k, g);
        return 0;
    }
    case F_LEASE: {
        uint64_t t = ns_now();
        if (h->offset > t) /* (lease_offset_fix: at least 2 s ahead) */
            return m_bad(s), 0;
        uint64_t until = h->offset + s->l->lease < h->offset ? UINT64_MAX : h->offset + s->l->lease;
        if (until > k->lease_until)
            k->lease_until = until;
        return 0;
    }
    case F_CREDIT: /* moves the link's push window (nothing pushed here: clamped at 0), any xfer */
        if (h->length > MAX_FRAME)
            return m_bad(s), 0;
        return 0;
    case F_ABORT: {
        fr ack = mkf(F_ABORT_ACK, h->flags & F_PULL, h->xfer);
        if (!(h->flags & F_PULL)) {
            mrx *x = m_rx_find(s, h->xfer);
            if (!x)
                x = m_rx_new(s, h->xfer);
            x->aborted = 1;
            for (int i = 0; i < s->nk; i++) { /* discard_payloads */
                mconn *o = &s->k[i];
                if (o->in_pay && o->pay_xfer == h->xfer && !o->pay_discard)
                    o->pay_discard = 1;
            }
            if (++x->aborts_seen >= s->nconns)
                m_rx_del(s, x);
        } else {
            /* the serves of that transfer still queued are dropped; which ones
             * were already sent is only known when the ABORT_ACK arrives */
            for (size_t i = 0; i < k->nsv; i++)
                if (k->sv[i].f.xfer == h->xfer && k->sv[i].abort_seq == 0)
                    k->sv[i].abort_seq = k->seq;
        }
        m_expect(k, ack);
        return 0;
    }
    case F_READ: {
        if (h->length == 0 || h->length > MAX_FRAME)
            return m_bad(s), 0;
        uint8_t *base = NULL, *shadow = NULL;
        uint64_t rlen = m_exported(s, h->region, &base, &shadow);
        if (!rlen)
            return m_read_refused(k, h);
        uint64_t rl = h->pad, st = h->total, first = 0, last = 0;
        if (h->flags & F_ROWS) { /* the rows first..last: at most MAX_ROWS, the last inside the region */
            if (rl == 0 || st < rl || h->offset2 > UINT64_MAX - h->length)
                return m_bad(s), 0;
            first = h->offset2 / rl;
            last = (h->offset2 + h->length - 1) / rl;
            if (last - first >= MAX_ROWS || h->offset > rlen || rl > rlen - h->offset ||
                last > (rlen - h->offset - rl) / st)
                return m_bad(s), 0;
        } else if (h->offset > rlen || h->length > rlen - h->offset) {
            return m_bad(s), 0;
        }
        CHECK(k->nsv < SV_MAX);
        mserve *v = &k->sv[k->nsv++];
        v->f = mkf(F_RDATA, 0, h->xfer);
        v->f.region = h->region2;
        v->f.offset = h->offset2;
        v->f.length = h->length;
        v->f.total = h->total;
        v->abort_seq = 0;
        v->snap = xmalloc((size_t)h->length);
        if (h->flags & F_ROWS) { /* gathered: row r at offset + r * stride */
            uint64_t col = h->offset2 % rl, got = 0;
            v->src = base + h->offset + first * st;
            v->span = (last - first) * st + rl;
            for (uint64_t r = first; got < h->length; r++, col = 0) {
                uint64_t t = rl - col < h->length - got ? rl - col : h->length - got;
                memcpy(v->snap + got, shadow + h->offset + r * st + col, (size_t)t);
                got += t;
            }
        } else {
            v->src = base + h->offset;
            v->span = h->length;
            memcpy(v->snap, shadow + h->offset, (size_t)h->length);
        }
        return 0;
    }
    default: /* HELLO, HELLO_ACK on an authenticated stream */
        return m_bad(s), 0;
    }
}

/* n payload bytes of the current DATA frame were sent on k (on_payload at the
 * end). Returns the bytes the core reads next for the same frame (a DATAV's
 * data once its list is in and good), else 0. */
static uint64_t m_payload(msess *s, mconn *k, const uint8_t *p, uint64_t n) {
    if (s->dead || n == 0)
        return 0;
    CHECK(k->in_pay && k->pay_done + n <= k->pay_len);
    if (k->pay_list) {
        memcpy((uint8_t *)k->list + k->pay_done, p, (size_t)n);
        k->pay_done += n;
        return k->pay_done < k->pay_len ? 0 : m_list_done(s, k);
    }
    if (!k->pay_discard && k->pay_np) { /* scattered over the pieces, in order */
        uint64_t at = k->pay_done, done = 0;
        for (uint32_t i = 0; i < k->pay_np && done < n; i++) {
            const piece *pc = &k->list[i];
            if (at >= pc->len) {
                at -= pc->len;
                continue;
            }
            uint64_t t = pc->len - at < n - done ? pc->len - at : n - done;
            m_dirty(s, k->pay_base + pc->offset + at, t);
            memcpy(k->pay_shadow + pc->offset + at, p + done, (size_t)t);
            if (k->pay_log) {
                mwrite *w = &s->log[k->pay_logi + i];
                memcpy(w->data + at, p + done, (size_t)t);
                w->len = at + t;
            }
            done += t;
            at = 0;
        }
    } else if (!k->pay_discard) {
        uint8_t *dst = k->pay_base + k->pay_off + k->pay_done;
        m_dirty(s, dst, n);
        memcpy(k->pay_shadow + k->pay_off + k->pay_done, p, (size_t)n);
        if (k->pay_log) {
            mwrite *w = &s->log[k->pay_logi];
            memcpy(w->data + k->pay_done, p, (size_t)n);
            w->len = k->pay_done + n;
        }
    }
    k->pay_done += n;
    if (k->pay_done < k->pay_len)
        return 0;
    k->in_pay = 0;
    k->pay_np = 0;
    if (!k->pay_discard)
        s->rx_all += k->pay_len;
    /* every DATA payload consumed, written or discarded, is CREDITed on its
     * stream (before the transfer's ACK, if it completes it) */
    fr cr = mkf(F_CREDIT, 0, k->pay_xfer);
    cr.length = k->pay_len;
    m_expect(k, cr);
    /* As kv_tcp.c does: the transfer is looked up again when the payload ends
     * and the payload counts towards it even if it was discarded. (So if the
     * transfer was aborted on every stream and a new one with the same id was
     * opened meanwhile, discarded bytes count towards the new one: only a peer
     * breaking the protocol can arrange that, and it only fools itself, with an
     * early ACK; the exported bytes stay as the checks allow.) */
    mrx *x = m_rx_find(s, k->pay_xfer);
    if (x && !x->aborted) {
        x->received += k->pay_len;
        if (x->received == x->total) {
            m_expect(k, mkf(F_ACK, 0, k->pay_xfer));
            m_rx_del(s, x);
        }
    }
    return 0;
}

/* rows_fit: every piece whole rows of `rl` bytes, `st` apart, the last row of each
 * inside a region of rlen bytes, at most MAX_ROWS rows in all, adding up to exactly
 * the frame's length; computed here in 128 bits (no overflow to guard against). */
static int m_rows_fit(const mconn *k, uint64_t rlen, uint64_t rl, uint64_t st) {
    unsigned __int128 sum = 0, rows = 0;
    for (uint32_t i = 0; i < k->vh.region2; i++) {
        const piece *p = &k->list[i];
        if (p->len == 0 || p->len % rl)
            return 0;
        uint64_t m = p->len / rl;
        if ((unsigned __int128)p->offset + (unsigned __int128)(m - 1) * st + rl > rlen)
            return 0;
        sum += p->len;
        rows += m;
    }
    return rows <= MAX_ROWS && sum == k->vh.length;
}

/* on_readv_list: RERR if the region is not exported; else the pieces checked as a
 * DATAV's (or as rows: m_rows_fit), and one RDATA of them (F_PIECES) expected,
 * gathered in order. */
static uint64_t m_readv_done(msess *s, mconn *k, uint8_t *base, uint8_t *shadow, uint64_t rlen) {
    const fr *h = &k->vh;
    int rows = (h->flags & F_ROWS) != 0;
    uint64_t rl = h->pad, st = h->total;
    if (!rlen)
        return m_read_refused(k, h);
    if (rows ? !m_rows_fit(k, rlen, rl, st) : !m_pieces_fit(k, rlen))
        return m_bad(s), 0;
    uint64_t sum = 0, lo = UINT64_MAX, hi = 0;
    for (uint32_t i = 0; i < h->region2; i++) {
        const piece *p = &k->list[i];
        uint64_t end = rows ? p->offset + (p->len / rl - 1) * st + rl : p->offset + p->len;
        lo = p->offset < lo ? p->offset : lo;
        hi = end > hi ? end : hi;
    }
    CHECK(k->nsv < SV_MAX);
    mserve *v = &k->sv[k->nsv++];
    v->f = mkf(F_RDATA, F_PIECES, h->xfer);
    v->f.region = (uint32_t)h->offset2;
    v->f.length = h->length;
    v->f.total = h->total;
    v->f.region2 = h->region2;
    v->abort_seq = 0;
    v->src = base + lo;
    v->span = hi - lo;
    v->snap = xmalloc((size_t)h->length);
    sum = 0;
    for (uint32_t i = 0; i < h->region2; i++) {
        const piece *p = &k->list[i];
        for (uint64_t r = 0, m = rows ? p->len / rl : 1; r < m; r++) {
            memcpy(v->snap + sum, shadow + p->offset + r * st, (size_t)(rows ? rl : p->len));
            sum += rows ? rl : p->len;
        }
    }
    return 0;
}

static void serve_del(mconn *k, size_t i) {
    free(k->sv[i].snap);
    memmove(&k->sv[i], &k->sv[i + 1], (k->nsv - i - 1) * sizeof k->sv[0]);
    k->nsv--;
}

/* A frame from the core on stream k: it must be the next control frame
 * expected, or the answer to a READ still queued. */
static void m_on_frame(mconn *k, const fr *h) {
    if (h->type == F_RDATA) {
        size_t i = 0;
        while (i < k->nsv) {
            fr want = k->sv[i].f;
            if (fr_eq(h, &want))
                break;
            if (!k->sv[i].abort_seq) { /* only an ABORT(pull) may drop a queued READ */
                fr_print("got", h);
                fr_print("want", &want);
                FAILED_AT("%s", "RDATA out of order");
                die();
            }
            i++;
        }
        if (i == k->nsv) {
            fr_print("got", h);
            FAILED_AT("%s", "RDATA for no READ");
            die();
        }
        mserve *v = &k->sv[i];
        if (v->snap && memcmp(v->snap, k->pc.pay, (size_t)h->length) != 0) {
            fr_print("RDATA", h);
            FAILED_AT("%s", "RDATA payload is not the exported bytes");
            die();
        }
        g_checks++;
        serve_del(k, i);
        return;
    }
    if (k->ct_n == 0) {
        fr_print("got", h);
        FAILED_AT("%s", "unexpected frame from the core");
        die();
    }
    size_t hi = k->ct_head;
    fr want = k->ct[hi];
    if (want.type == F_ABORT_ACK && (want.flags & F_PULL)) {
        /* length: bytes of the READs it dropped, i.e. those still unanswered */
        uint64_t seq = k->ct_seq[hi], sum = 0;
        for (size_t i = 0; i < k->nsv;) {
            if (k->sv[i].abort_seq == seq) {
                sum += k->sv[i].f.length;
                serve_del(k, i);
            } else {
                i++;
            }
        }
        want.length = sum;
    }
    size_t merged = 1;
    if (h->type == F_CREDIT && want.type == F_CREDIT && h->xfer == want.xfer && h->length > want.length) {
        /* the core merges CREDITs of back-to-back DATA frames of one push (at most
         * KV_CREDIT_BATCH): the expected ones, in order, must add up to it exactly */
        uint64_t sum = want.length;
        while (sum < h->length && merged < k->ct_n) {
            const fr *nx = &k->ct[(hi + merged) % CT_MAX];
            if (nx->type != F_CREDIT || nx->xfer != want.xfer)
                break;
            sum += nx->length;
            merged++;
        }
        if (sum == h->length)
            want.length = sum;
        else
            merged = 1;
    }
    if (!fr_eq(h, &want)) {
        fr_print("got", h);
        fr_print("want", &want);
        FAILED_AT("%s", "control frame differs from the model");
        die();
    }
    g_checks++;
    k->ct_head = (k->ct_head + merged) % CT_MAX;
    k->ct_n -= merged;
}

static void m_on_frame_cb(void *arg, const fr *h, pconn *c) {
    msess *s = arg;
    for (int i = 0; i < s->nk; i++)
        if (&s->k[i].pc == c)
            m_on_frame(&s->k[i], h);
}

/* Handle what has arrived on k, without waiting. */
static void m_poll(mconn *k) {
    if (k->pc.fd < 0)
        return;
    pc_fill(&k->pc, 0);
    fr h;
    while (pc_frame_t(&k->pc, &h, 0, 1) == 1)
        m_on_frame(k, &h);
}

static uint64_t g_ping = 0x7000000000000000ull;

/* Ping: an ABORT(pull) of a transfer nobody uses; its ABORT_ACK proves the core
 * processed every byte sent before it on this stream. */
static void m_sync(msess *s, mconn *k) {
    CHECK(!s->dead && !k->in_pay);
    fr f = mkf(F_ABORT, F_PULL, g_ping++);
    m_header(s, k, &f);
    CHECK(pc_send(&k->pc, &f, sizeof f));
    while (k->ct_n) {
        fr h;
        CHECK_EQ(pc_frame(&k->pc, &h), 1);
        m_on_frame(k, &h);
    }
    s->rx_synced = s->rx_all;
}

/* Exported region after an abrupt end: the core processed some prefix of
 * the stream, so it must equal the start state plus the first c writes plus a
 * prefix of write c, for some c. */
static void check_exp_prefix(msess *s) {
    uint8_t *t = xmalloc(EXP_LEN);
    memcpy(t, s->pre, EXP_LEN);
    int ok = 0;
    for (int c = 0; c <= s->nlog && !ok; c++) {
        if (c == s->nlog) {
            ok = memcmp(t, g_exp, EXP_LEN) == 0;
            break;
        }
        mwrite *w = &s->log[c];
        uint64_t p = 0;
        while (p < w->len && g_exp[w->off + p] == w->data[p])
            p++;
        if (memcmp(t, g_exp, (size_t)w->off) == 0 &&
            memcmp(t + w->off + p, g_exp + w->off + p, (size_t)(EXP_LEN - w->off - p)) == 0)
            ok = 1;
        memcpy(t + w->off, w->data, (size_t)w->len);
    }
    free(t);
    if (!ok) {
        FAILED_AT("exported region is no prefix of the %d writes sent", s->nlog);
        die();
    }
    g_checks++;
    memcpy(g_shadow, g_exp, EXP_LEN);
}

/* A session on link l (NULL: a new link of nstreams streams). */
static msess *sess_new(linkrec *l, int nstreams) {
    msess *s = calloc(1, sizeof *s);
    CHECK(s != NULL);
    s->l = l ? l : link_new(nstreams);
    s->pre = xmalloc(EXP_LEN);
    memcpy(s->pre, g_shadow, EXP_LEN);
    for (int i = 0; i < MAXC; i++)
        s->k[i].pc.fd = -1;
    return s;
}

/* A LEASE on k granting the core a lease from `offset` (its clock): now (a
 * fresh one), long ago (stale: nothing), or later (a bad frame). */
static int lease_send(msess *s, mconn *k, uint64_t offset) {
    fr g = mkf(F_LEASE, 0, 0);
    g.offset = offset;
    if (chance(10)) { /* only the type and the offset matter */
        g.xfer = rnd();
        g.length = rnd();
        g.status = (uint32_t)rnd();
    }
    m_header(s, k, &g);
    return pc_send(&k->pc, &g, sizeof g);
}

/* Open stream i of the session and authenticate it; grant: then a lease (else
 * DATA into place fails the link). */
static void sess_connect_g(msess *s, int wait_ack, int grant) {
    mconn *k = &s->k[s->nk++];
    pc_open(&k->pc, 0);
    CHECK(hello_send(&k->pc, s->l->tok, chance(10)));
    s->l->bound = 1;
    s->nconns++;
    m_expect(k, mkf(F_HELLO_ACK, F_DATAV_OK | F_READS_OK, 0));
    if (grant)
        CHECK(lease_send(s, k, ns_now()));
    if (wait_ack)
        while (k->ct_n) {
            fr h;
            CHECK_EQ(pc_frame(&k->pc, &h), 1);
            m_on_frame(k, &h);
        }
}

static void sess_connect(msess *s, int wait_ack) { sess_connect_g(s, wait_ack, 1); }

static void sess_free(msess *s) {
    for (int i = 0; i < s->nk; i++) {
        mconn *k = &s->k[i];
        for (size_t j = 0; j < k->nsv; j++)
            free(k->sv[j].snap);
        if (k->pc.fd >= 0)
            pc_close(&k->pc, 0);
    }
    for (int i = 0; i < s->nlog; i++)
        free(s->log[i].data);
    free(s->pre);
    free(s);
}

/* The link is down: account for it and check everything. exact: the core
 * processed every byte sent (or stopped at the bad frame the model knows). */
static void sess_finish(msess *s, int exact) {
    wait_link_down(s->l);
    e_failed++;
    e_bad += (uint64_t)s->bad;
    e_lease += (uint64_t)s->lease_failed;
    e_rx_hi += s->rx_all;
    e_rx_lo += exact ? s->rx_all : s->rx_synced;
    check_stats();
    if (!exact) { /* re-anchor: the counter is within bounds, take it */
        e_rx_lo = e_rx_hi = stats().tcp_bytes_received;
        check_exp_prefix(s);
    } else {
        check_exp_exact();
    }
    check_canaries();
    sess_free(s);
}

/* ----------------------------------------------------- frame generation */

static uint64_t g_xfer = 1;

static uint64_t new_xfer(void) {
    if (chance(10))
        return special64();
    return g_xfer++ * 0x10001ull;
}

static uint64_t rnd_len(uint64_t max) {
    uint64_t m;
    switch (below(4)) {
    case 0:
        m = 16;
        break;
    case 1:
        m = 512;
        break;
    case 2:
        m = 8 * KiB;
        break;
    default:
        m = max;
        break;
    }
    if (m > max)
        m = max;
    return 1 + below(m);
}

/* A DATA frame that passes the checks (unless the model says otherwise: it
 * is the model that decides, from the bytes). */
static fr gen_data(msess *s) {
    fr f;
    mrx *open = NULL;
    if (s->nrx && chance(50)) {
        open = &s->rx[below((uint64_t)s->nrx)];
        if (open->aborted || open->total - open->claimed == 0 || open->total < open->claimed)
            open = NULL;
    }
    uint64_t len, total, x;
    if (open) {
        uint64_t left = open->total - open->claimed;
        len = rnd_len(left < EXP_LEN ? left : EXP_LEN);
        if (chance(50) && left <= EXP_LEN)
            len = left;
        total = open->total;
        x = open->xfer;
    } else {
        len = rnd_len(EXP_LEN);
        total = len;
        if (chance(30))
            total = len + 1 + below(3 * EXP_LEN);
        else if (chance(5))
            total = MAX_TOTAL - below(2);
        x = new_xfer();
    }
    f = mkf(F_DATA, 0, x);
    f.region = g_exp_id;
    f.length = len;
    f.total = total;
    f.offset = chance(10) ? EXP_LEN - len : below(EXP_LEN - len + 1);
    return f;
}

/* A READ; `exported` 2: of the exported region, sometimes of rows (F_ROWS). */
static fr gen_read(int exported) {
    fr f = mkf(F_READ, 0, new_xfer());
    f.length = rnd_len(exported ? 4 * KiB : MAX_FRAME);
    f.region = exported ? g_exp_id : g_rid_pool[1 + below(g_rid_n - 1)];
    if (!exported && chance(30))
        f.region = chance(50) ? 0 : UINT32_MAX;
    f.offset = exported ? below(EXP_LEN - f.length + 1) : special64();
    f.total = chance(50) ? f.length : rnd();
    f.region2 = (uint32_t)below(4);
    f.offset2 = below(1 << 20);
    if (exported == 2 && chance(35)) { /* rows: mostly inside the region, some past its end or too many */
        f.flags = F_ROWS;
        f.pad = chance(5) ? 0 : (uint32_t)(1 + below(chance(20) ? 4 * KiB : 96));
        f.total = chance(10) ? below(f.pad + 1) : f.pad + below(chance(20) ? 8 * KiB : 160);
        f.offset = below(chance(90) ? 4 * KiB : EXP_LEN + 1);
        f.offset2 = chance(10) ? special64() : below(8 * KiB);
        f.length = chance(10) ? rnd_len(MAX_FRAME) : 1 + below(chance(80) ? 2 * KiB : 64 * KiB);
    }
    return f;
}

static uint64_t pick_xfer(msess *s, mconn *k) {
    if (s->nrx && chance(50))
        return s->rx[below((uint64_t)s->nrx)].xfer;
    if (k->nsv && chance(50))
        return k->sv[below(k->nsv)].f.xfer;
    return new_xfer();
}

static fr gen_misc(msess *s, mconn *k) {
    static const uint16_t types[] = {F_ACK,   F_ABORT_ACK, F_RERR,   F_RDATA,     F_HELLO, F_HELLO_ACK,
                                     F_ABORT, F_READ,      F_CREDIT, F_LEASE_REQ, F_LEASE};
    fr f = mkf(types[below(sizeof types / sizeof types[0])], (uint16_t)below(4), pick_xfer(s, k));
    f.status = chance(50) ? 0 : (uint32_t)rnd();
    f.length = chance(50) ? below(64) : special64();
    f.region = special_rid();
    f.offset = special64();
    f.total = special64();
    return f;
}

static void mutate(fr *f, msess *s, mconn *k) {
    int n = 1 + (int)below(3);
    while (n--) {
        switch (below(11)) {
        case 0: {
            int bits = 1 + (int)below(4);
            while (bits--) {
                unsigned b = (unsigned)below(512);
                ((uint8_t *)f)[b / 8] ^= (uint8_t)(1u << (b % 8));
            }
            break;
        }
        case 1:
            f->region = special_rid();
            break;
        case 2:
            f->offset = special64();
            break;
        case 3:
            f->length = special64();
            break;
        case 4:
            f->total = special64();
            break;
        case 5:
            f->type = chance(80) ? (uint16_t)below(F_LAST + 2) : (uint16_t)rnd();
            break;
        case 6:
            f->magic = chance(50) ? f->magic ^ (1u << below(32)) : (uint32_t)rnd();
            break;
        case 7:
            f->xfer = pick_xfer(s, k);
            break;
        case 8:
            f->flags = (uint16_t)rnd();
            f->status = (uint32_t)rnd();
            break;
        case 9:
            f->region2 = (uint32_t)rnd();
            f->pad = (uint32_t)rnd();
            f->offset2 = rnd();
            break;
        default: /* a total that disagrees with the open transfer */
            f->total += chance(50) ? 1 : (uint64_t)-1;
            break;
        }
    }
}

/* Payload bytes: random, or one repeated value. */
static uint8_t *gen_payload(uint64_t n) {
    uint8_t *p = xmalloc((size_t)n);
    if (chance(20))
        memset(p, (int)below(256), (size_t)n);
    else
        rnd_bytes(p, (size_t)n);
    return p;
}

/* Wait until the byte at `at` holds v (the core wrote it). */
static void wait_landed(const volatile uint8_t *at, uint8_t v) {
    double end = now_ms() + WAIT_MS;
    while (*at != v) {
        if (now_ms() > end) {
            FAILED_AT("%s", "payload bytes never landed");
            die();
        }
        sleep_us(100);
    }
}

/* ------------------------------------------------------------ sessions */

static long g_stuck, g_stuck_refused, g_tolerant, g_bad_sessions, g_dup_rdata, g_premature_bad, g_lease_waits;
static uint64_t g_rank_ahead; /* peer-rank: most frames of the big push before the small ones */
enum { K_PREAUTH, K_SERVER, K_MULTI, K_NOTIFY, K_PEER, K_CLIENT, K_WINDOW, K_RANK, K_PREMATURE, K_LEASE,
       K_STALL, K_FLOOD, K_LIMITS, K_FINAL };
static const char *const g_kind_names[] = {"preauth", "server",    "multi", "notify", "peer",  "client", "window",
                                           "rank",    "premature", "lease", "stall",  "flood", "limits", "final"};
static long g_counts[K_FINAL + 1];
static double g_ms[K_FINAL + 1]; /* time spent per kind */

/* Connections that never authenticate: each ends as exactly one refusal. */
static void sess_preauth(void) {
    g_what = "preauth";
    pconn c;
    pc_open(&c, 0);
    uint8_t buf[512];
    size_t n = 0;
    int complete_bad = 1; /* the core has a whole bad header (or token) and closes */
    fr h = mkf(F_HELLO, 0, 0);
    h.length = 32;
    const uint8_t *tok = g_links[0].tok; /* the decoy link: declared, never bound */
    int v = (int)below(10);
    switch (v) {
    case 0: /* connect, close */
        complete_bad = 0;
        break;
    case 1: /* random bytes */
        n = (size_t)below(sizeof buf);
        rnd_bytes(buf, n);
        if (n >= 4 && chance(30)) {
            uint32_t m = MAGIC;
            memcpy(buf, &m, 4);
        }
        complete_bad = n >= 64;
        if (n >= 64) { /* a random header that happens to be a HELLO would wait for its token */
            fr t;
            memcpy(&t, buf, 64);
            if (t.magic == MAGIC && t.type == F_HELLO && t.length == 32)
                complete_bad = n >= 96;
        }
        break;
    case 2: /* a frame other than HELLO (a CREDIT often: it has no payload, any length) */
        h.type = (uint16_t)(chance(80) ? 2 + below(F_LAST - 1) : (chance(50) ? 0 : F_LAST + 1 + below(60000)));
        if (chance(20))
            h.type = F_CREDIT;
        h.length = chance(50) ? 32 : special64();
        h.xfer = rnd();
        h.region = special_rid();
        memcpy(buf, &h, 64);
        n = 64;
        if (chance(50)) {
            rnd_bytes(buf + 64, 100);
            n += 100;
        }
        break;
    case 3: /* HELLO of a wrong length, with the right token */
        do
            h.length = special64();
        while (h.length == 32);
        memcpy(buf, &h, 64);
        memcpy(buf + 64, tok, 32);
        n = 96;
        break;
    case 4: /* a wrong token */
    case 5: {
        memcpy(buf, &h, 64);
        memcpy(buf + 64, tok, 32);
        if (v == 4) {
            unsigned b = (unsigned)below(256);
            buf[64 + b / 8] ^= (uint8_t)(1u << (b % 8));
        } else {
            rnd_bytes(buf + 64, 32);
        }
        n = 96;
        break;
    }
    case 6: { /* the token of a dead link */
        const linkrec *d = NULL;
        for (int tries = 0; tries < 8 && !d; tries++) {
            const linkrec *l = &g_links[below(g_nlinks)];
            if (l->down)
                d = l;
        }
        memcpy(buf, &h, 64);
        memcpy(buf + 64, d ? d->tok : buf, 32);
        if (!d)
            rnd_bytes(buf + 64, 32);
        n = 96;
        break;
    }
    case 7: /* truncated HELLO: part of the header or of the token */
        memcpy(buf, &h, 64);
        memcpy(buf + 64, tok, 32);
        n = (size_t)below(96);
        complete_bad = 0;
        break;
    case 8: /* valid magic, junk everywhere else */
        rnd_bytes(buf, 64);
        memcpy(buf, &h.magic, 4);
        n = 64;
        {
            fr t;
            memcpy(&t, buf, 64);
            if (t.type == F_HELLO && t.length == 32)
                complete_bad = 0; /* would wait for a token: we just close */
        }
        break;
    default: { /* a wrong token, sent a byte at a time */
        memcpy(buf, &h, 64);
        rnd_bytes(buf + 64, 32);
        n = 96;
        break;
    }
    }
    if (n) {
        int sent = v == 9 || chance(10) ? pc_send_split(&c, buf, n) : pc_send(&c, buf, n);
        (void)sent; /* the core may close before the last bytes */
    }
    if (complete_bad && chance(70)) {
        fr t;
        CHECK_EQ(pc_frame(&c, &t), 0); /* nothing comes back, then EOF */
    }
    pc_close(&c, chance(30));
    e_refused++;
    check_stats();
}

/* A second stream presenting a link's token when the link has no room left. */
static void probe_full(const linkrec *l) {
    pconn c;
    pc_open(&c, 0);
    hello_send(&c, l->tok, 0); /* refused after reading it */
    fr t;
    CHECK_EQ(pc_frame(&c, &t), 0);
    pc_close(&c, 0);
    e_refused++;
}

/* Send one frame on k; the model decides what the core does with it. The
 * payload (if the core expects one) is sent whole, or cut short (returns 0:
 * the session must end). */
static int send_frame_l(msess *s, mconn *k, fr *f, int split, int may_cut, const piece *list, size_t list_n) {
    uint64_t pl = m_header(s, k, f);
    int ok = split ? pc_send_split(&k->pc, f, sizeof *f) : pc_send(&k->pc, f, sizeof *f);
    if (!ok) {
        CHECK(s->dead); /* only a bad frame makes the core close */
        return 0;
    }
    if (s->dead && list && list_n) {
        /* a bad DATAV or READV header: its list follows anyway, so that a core that took
         * the header would read it and act (answer a READV: "RDATA for no READ") */
        (void)pc_send(&k->pc, list, list_n * sizeof *list);
        return 1;
    }
    int first = 1;
    while (pl) { /* the payload; a DATAV: its list (ours, if given), then its data */
        uint8_t *p = gen_payload(pl);
        if (first && k->pay_list && list)
            memcpy(p, list, (size_t)(list_n * sizeof *list < pl ? list_n * sizeof *list : pl));
        first = 0;
        uint64_t n = pl;
        int cut = may_cut && chance(4);
        if (cut)
            n = below(pl);
        ok = split && n < 4096 ? pc_send_split(&k->pc, p, (size_t)n) : pc_send(&k->pc, p, (size_t)n);
        CHECK(ok || s->dead); /* (a DATAV's list may be refused before all of it is sent) */
        pl = m_payload(s, k, p, n);
        free(p);
        if (cut)
            return 0;
    }
    return 1;
}

static int send_frame(msess *s, mconn *k, fr *f, int split, int may_cut) {
    return send_frame_l(s, k, f, split, may_cut, NULL, 0);
}

/* n pieces of the exported region, of at most `most` bytes each, adding up to len (>= n). */
static void gen_pieces(piece *list, uint64_t n, uint64_t len, uint64_t most) {
    uint64_t left = len;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t room = left - (n - i - 1), l = i + 1 == n ? left : 1 + below(room < most ? room : most);
        list[i].len = l;
        list[i].offset = chance(10) ? EXP_LEN - l : below(EXP_LEN - l + 1);
        left -= l;
    }
}

/* A mutation of a piece list's frame, 0..8: 0-3 make one piece bad here (empty, past
 * the region's end, an offset or a length that overflows); 4-8 are the caller's. */
static unsigned bad_piece(piece *list, uint64_t n) {
    unsigned which = (unsigned)below(9);
    piece *p = &list[below(n)];
    switch (which) {
    case 0: p->len = 0; break;
    case 1: p->offset = EXP_LEN - p->len + 1 + below(4); break;
    case 2: p->offset = UINT64_MAX - below(p->len + 2); break;
    case 3: p->len = UINT64_MAX - below(4); break;
    default: break;
    }
    return which;
}

/* A DATAV that passes the checks (into *list, *np pieces over the exported
 * region) unless mutated: malformed lists, pieces out of range or empty,
 * offsets that overflow, lengths that do not add up, zero or huge counts. */
static fr gen_datav(msess *s, piece *list, size_t *np) {
    fr f = gen_data(s);
    f.type = F_DATAV;
    f.offset = 0;
    uint64_t len = f.length, n = 1 + below(len < 8 ? len : 8);
    gen_pieces(list, n, len, len);
    f.region2 = (uint32_t)n;
    *np = (size_t)n;
    if (chance(25)) {
        switch (bad_piece(list, n)) {
        case 4: f.length += chance(50) ? 1 : (uint64_t)-1; break;
        case 5: f.region2 = chance(50) ? 0 : (chance(50) ? MAX_PIECES + 1 + (uint32_t)below(8) : UINT32_MAX - (uint32_t)below(2)); break;
        case 6: f.region2 = (uint32_t)(n + 1 + below(3)); break; /* more than we send: the next bytes are read as pieces */
        case 7: f.offset = 1 + below(EXP_LEN); break;
        case 8: f.region = special_rid(); break;
        default: break; /* a piece (bad_piece) */
        }
    }
    return f;
}

/* A READV that passes the checks (into *list, *np pieces of the exported region)
 * unless mutated: pieces out of range, empty or overflowing, lengths that do not
 * add up, too few or too many pieces, a field that must be 0, an unknown region. */
static fr gen_readv(msess *s, piece *list, size_t *np) {
    fr f = gen_read(1);
    f.type = F_READV;
    f.flags = 0;
    f.offset = 0;
    f.pad = 0;
    f.total = rnd();
    f.offset2 = below((uint64_t)UINT32_MAX + 1);
    uint64_t n = 2 + below(7), len = n + below(3 * 4096);
    gen_pieces(list, n, len, 4096);
    if (chance(40)) { /* of rows: 1..96 bytes, up to 160 more apart, 1..200 rows a piece */
        uint64_t rl = 1 + below(96), st = rl + below(160);
        f.flags = F_ROWS;
        f.pad = (uint32_t)rl;
        f.total = st;
        len = 0;
        for (uint64_t i = 0; i < n; i++) {
            uint64_t m = 1 + below(200), span = (m - 1) * st + rl;
            list[i].len = m * rl;
            list[i].offset = chance(10) ? EXP_LEN - span : below(EXP_LEN - span + 1);
            len += list[i].len;
        }
        if (chance(30)) {
            piece *p = &list[below(n)];
            switch (below(6)) {
            case 0: p->len += 1 + below(rl > 1 ? rl - 1 : 1); len = 0; break; /* not whole rows */
            case 1: p->offset += 1 + below(st); break;                       /* the last row past the end */
            case 2: f.pad = 0; break;
            case 3: f.total = below(rl); break;                               /* stride < row */
            case 4: p->len = rl * (1025 + below(4)); p->offset = 0; f.total = rl; break; /* > 1024 rows */
            default: f.total = UINT64_MAX - below(4); break;                  /* huge stride */
            }
            if (!len)
                for (uint64_t i = 0; i < n; i++)
                    len += list[i].len;
        }
    }
    f.length = len;
    f.region2 = (uint32_t)n;
    *np = (size_t)n;
    if (chance(40)) {
        switch (bad_piece(list, n)) {
        case 4: f.length += chance(50) ? 1 : (uint64_t)-1; break;
        case 5: f.region2 = chance(50) ? (uint32_t)below(2) : MAX_PIECES + 1 + (uint32_t)below(8); break;
        case 6: f.offset2 = (uint64_t)UINT32_MAX + 1 + below(4); break;
        case 7: if (chance(50)) f.offset = 1 + below(EXP_LEN); else f.pad = 1 + (uint32_t)below(9); break;
        case 8: f.region = special_rid(); break;
        default: break; /* a piece (bad_piece) */
        }
    }
    (void)s;
    return f;
}

/* One authenticated stream, a sequence of valid and mutated frames. */
static void sess_server(void) {
    g_what = "server";
    msess *s = sess_new(NULL, 1);
    sess_connect_g(s, chance(50), chance(95)); /* (no lease: DATA into place fails the link) */
    mconn *k = &s->k[0];
    int steps = 1 + (int)below(24), open = 1;
    for (int step = 0; step < steps && open && !s->dead; step++) {
        m_poll(k);
        if (k->ct_n > CT_MAX / 2 || k->nsv > SV_MAX / 2) {
            m_sync(s, k);
            continue;
        }
        int r = (int)below(100);
        fr f;
        if (r < 20) {
            f = gen_data(s);
            if (chance(12))
                mutate(&f, s, k);
            open = send_frame(s, k, &f, chance(5), 1);
        } else if (r < 32 || (r < 40 && chance(40))) { /* a DATAV, or a READV */
            static piece list[8];
            size_t np = 0;
            f = r < 32 ? gen_datav(s, list, &np) : gen_readv(s, list, &np);
            if (chance(8))
                mutate(&f, s, k);
            open = send_frame_l(s, k, &f, chance(5), 1, list, np);
        } else if (r < 40) {
            f = gen_read(2);
            if (chance(15))
                mutate(&f, s, k);
            open = send_frame(s, k, &f, 0, 1);
        } else if (r < 44) {
            f = gen_read(0);
            open = send_frame(s, k, &f, 0, 1);
        } else if (r < 52) {
            f = mkf(F_ABORT, chance(50) ? F_PULL : (uint16_t)(chance(80) ? 0 : 2 * below(100)), pick_xfer(s, k));
            open = send_frame(s, k, &f, 0, 1);
        } else if (r < 60) { /* frames the link survives (CREDIT: nothing pushed here; LEASE_REQ;
                              * LEASE fresh or stale), or anything */
            int v = (int)below(5);
            uint64_t t = ns_now();
            if (v == 0) {
                f = mkf(F_CREDIT, 0, pick_xfer(s, k));
                f.length = chance(50) ? below(MAX_FRAME + 1) : below(64);
            } else if (v == 1) {
                f = mkf(F_LEASE_REQ, (uint16_t)below(2), chance(50) ? 0 : rnd());
                f.offset = chance(50) ? t : rnd();
            } else if (v == 2) {
                f = mkf(F_LEASE, 0, 0);
                f.offset = chance(50) ? t : chance(50) || t <= s->l->lease ? t - below(t) : t - s->l->lease - below(t - s->l->lease);
            } else {
                f = gen_misc(s, k);
            }
            open = send_frame(s, k, &f, 0, 1);
        } else if (r < 68) {
            m_sync(s, k);
            check_exp_exact();
            check_canaries();
        } else if (r < 82) {
            f = chance(50) ? gen_data(s) : gen_misc(s, k);
            mutate(&f, s, k);
            open = send_frame(s, k, &f, chance(5), 1);
        } else if (r < 85) {
            rnd_bytes((uint8_t *)&f, sizeof f);
            if (chance(50))
                f.magic = MAGIC;
            open = send_frame(s, k, &f, 0, 1);
        } else if (r < 88) {
            f = gen_misc(s, k); /* RDATA for nothing, HELLO, HELLO_ACK: all bad here */
            f.type = (uint16_t)(chance(50) ? F_RDATA : (chance(50) ? F_HELLO : F_HELLO_ACK));
            f.length = chance(50) ? 32 : f.length;
            open = send_frame(s, k, &f, 0, 1);
        } else if (r < 90) {
            m_sync(s, k); /* our HELLO first: else the probe could take the link */
            probe_full(s->l);
        } else if (r < 93) { /* cut mid-header: the core waits for the rest, then sees the end */
            f = gen_data(s);
            CHECK(pc_send(&k->pc, &f, (size_t)below(sizeof f)));
            open = 0;
        } else {
            f = gen_data(s);
            open = send_frame(s, k, &f, 1, 1);
        }
    }
    int exact = 1;
    if (s->dead) {
        if (chance(30)) { /* junk after the bad frame: never looked at */
            uint8_t junk[256];
            rnd_bytes(junk, sizeof junk);
            pc_send(&k->pc, junk, (size_t)below(sizeof junk));
        }
        pc_wait_eof(&k->pc, m_on_frame_cb, s);
    } else if (chance(50)) { /* half-close: the core reads to the end, then closes */
        CHECK(shutdown(k->pc.fd, SHUT_WR) == 0);
        pc_wait_eof(&k->pc, m_on_frame_cb, s);
    } else { /* close or reset: the core may stop anywhere */
        m_poll(k);
        pc_close(&k->pc, chance(50));
        exact = 0;
        g_tolerant++;
    }
    g_bad_sessions += s->bad;
    sess_finish(s, exact);
}

/* Send part of k's current payload (not discarded) and wait until its last byte
 * is in memory: from then on the core's order of events is known. Needs
 * everything sent before the frame's header processed (memory == model), or a
 * byte written by an earlier frame could pass for it. */
static void send_partial_landed(msess *s, mconn *k, uint64_t n) {
    CHECK(k->in_pay && !k->pay_discard && n >= 1 && k->pay_done + n < k->pay_len);
    uint8_t *p = gen_payload(n);
    uint64_t last = k->pay_off + k->pay_done + n - 1;
    p[n - 1] = other(k->pay_shadow[last]);
    CHECK(pc_send(&k->pc, p, (size_t)n));
    m_payload(s, k, p, n);
    wait_landed(k->pay_base + last, p[n - 1]);
    free(p);
}

static void send_rest(msess *s, mconn *k) {
    uint64_t n = k->pay_len - k->pay_done;
    uint8_t *p = gen_payload(n);
    int ok = pc_send(&k->pc, p, (size_t)n);
    CHECK(ok || s->dead);
    m_payload(s, k, p, n);
    free(p);
}

/* Two streams of one link. The test orders what the core does across them:
 * before it sends on one stream, everything sent on the other was processed
 * (a ping, or the last byte of a partial payload seen in memory). */
static void sess_multi(void) {
    g_what = "multi";
    msess *s = sess_new(NULL, 2);
    sess_connect(s, 1);
    sess_connect(s, 1);
    int synced[2] = {1, 1};
    int steps = 4 + (int)below(20);
    for (int step = 0; step < steps && !s->dead; step++) {
        int c = (int)below(2);
        mconn *k = &s->k[c], *o = &s->k[1 - c];
        if (!synced[1 - c]) {
            m_sync(s, o);
            synced[1 - c] = 1;
        }
        m_poll(k);
        if (k->in_pay) {
            uint64_t left = k->pay_len - k->pay_done;
            if (!k->pay_discard && left > 1 && chance(40)) {
                send_partial_landed(s, k, 1 + below(left - 1));
                synced[c] = 1;
            } else {
                send_rest(s, k);
                synced[c] = 0;
            }
            continue;
        }
        int r = (int)below(100);
        fr f;
        if (r < 45) {
            if (!synced[c]) { /* for send_partial_landed */
                m_sync(s, k);
                synced[c] = 1;
            }
            f = gen_data(s);
            if (chance(40) && o->in_pay && o->pay_len <= EXP_LEN) { /* the same transfer, on both streams */
                f.xfer = o->pay_xfer;
                mrx *x = m_rx_find(s, f.xfer);
                if (x) {
                    f.total = x->total;
                    if (x->total - x->claimed < f.length)
                        f.length = x->total - x->claimed ? x->total - x->claimed : 1;
                    if (f.offset + f.length > EXP_LEN)
                        f.offset = EXP_LEN - f.length;
                }
            }
            uint64_t pl = m_header(s, k, &f);
            CHECK(pc_send(&k->pc, &f, sizeof f) || s->dead);
            synced[c] = 0;
            if (pl && !k->pay_discard && pl > 1 && chance(60)) {
                send_partial_landed(s, k, 1 + below(pl - 1));
                synced[c] = 1;
            } else if (pl) {
                send_rest(s, k);
            }
        } else if (r < 65) {
            uint64_t x = o->in_pay && chance(60) ? o->pay_xfer : pick_xfer(s, k);
            f = mkf(F_ABORT, 0, x);
            send_frame(s, k, &f, 0, 0);
            synced[c] = 0;
        } else if (r < 72) {
            f = gen_read(1);
            send_frame(s, k, &f, 0, 0);
            synced[c] = 0;
        } else if (r < 80) {
            m_sync(s, k);
            synced[c] = 1;
            check_exp_exact();
        } else if (r < 86) { /* a bad frame on one stream fails the link, the other stream mid-payload too */
            f = chance(50) ? gen_data(s) : gen_misc(s, k);
            mutate(&f, s, k);
            send_frame(s, k, &f, 0, 0);
            synced[c] = 0;
        } else { /* frames the link survives */
            f = chance(50) ? mkf(F_LEASE_REQ, 0, 0) : mkf(F_CREDIT, 0, pick_xfer(s, k));
            f.offset = ns_now();
            f.length = below(4096);
            send_frame(s, k, &f, 0, 0);
            synced[c] = 0;
        }
    }
    if (!s->dead) {
        for (int c = 0; c < 2; c++)
            if (!synced[c] && !s->k[c].in_pay)
                m_sync(s, &s->k[c]);
        /* a stream mid-payload has its last bytes in memory already */
        CHECK(shutdown(s->k[below(2)].pc.fd, SHUT_WR) == 0);
    }
    for (int c = 0; c < 2; c++)
        pc_wait_eof(&s->k[c].pc, m_on_frame_cb, s);
    sess_finish(s, 1);
}

/* An exported region removed while a DATA payload into it is in flight. */
static void sess_notify(void) {
    g_what = "notify";
    const uint64_t margin = 256;
    uint64_t xl = 2 * KiB + below(14 * KiB);
    uint8_t *buf = xmalloc((size_t)(xl + 2 * margin));
    for (uint64_t i = 0; i < margin; i++)
        buf[i] = buf[margin + xl + i] = GUARD_BYTE(i);
    rnd_bytes(buf + margin, (size_t)xl);
    uint32_t xid = 0;
    CHECK_EQ(kv_region_add(g_core, KV_REGION_LOCAL, 0, A(buf + margin), xl,
                           KV_REGION_F_EXPORT | KV_REGION_F_NOTIFY, &xid),
             KV_LLM_SUCCESS);
    CHECK(xid < MAX_REGIONS);
    msess *s = sess_new(NULL, 1);
    s->x_id = xid;
    s->x_base = buf + margin;
    s->x_shadow = xmalloc((size_t)xl);
    memcpy(s->x_shadow, s->x_base, (size_t)xl);
    s->x_len = xl;
    s->x_live = 1;
    sess_connect(s, 1);
    mconn *k = &s->k[0];
    for (int i = (int)below(4); i > 0; i--) { /* some traffic into it first */
        fr f;
        if (chance(60)) {
            f = gen_data(s);
            f.region = xid;
            f.total = f.length = rnd_len(xl);
            f.offset = below(xl - f.length + 1);
        } else {
            f = gen_read(1);
            f.region = xid;
            f.length = rnd_len(xl);
            f.offset = below(xl - f.length + 1);
        }
        send_frame(s, k, &f, 0, 0);
    }
    m_sync(s, k); /* for send_partial_landed */
    fr f = mkf(F_DATA, 0, new_xfer());
    f.region = xid;
    f.length = f.total = 2 + below(xl - 1);
    f.offset = below(xl - f.length + 1);
    CHECK(m_header(s, k, &f) == f.length);
    CHECK(pc_send(&k->pc, &f, sizeof f));
    send_partial_landed(s, k, 1 + below(f.length - 1));

    CHECK_EQ(kv_region_remove(g_core, xid), KV_LLM_SUCCESS);
    s->x_live = 0; /* no longer exported: frames naming it are bad (DATA) or answered RERR (READ) */
    pump_events(0);
    CHECK(!g_freed[xid]); /* the frame in flight holds it */
    if (chance(50)) {
        send_rest(s, k);
        m_sync(s, k);
    } else { /* half-close mid-payload: the core drops the frame and its ref */
        CHECK(shutdown(k->pc.fd, SHUT_WR) == 0);
    }
    wait_freed(xid); /* after the payload and every queued READ answer */
    CHECK(memcmp(s->x_base, s->x_shadow, (size_t)xl) == 0);
    for (uint64_t i = 0; i < margin; i++)
        CHECK(buf[i] == GUARD_BYTE(i) && buf[margin + xl + i] == GUARD_BYTE(i));
    for (size_t i = 0; i < k->nsv; i++) /* their source is about to go */
        if (k->sv[i].src >= s->x_base && k->sv[i].src < s->x_base + xl)
            k->sv[i].src = NULL;
    free(buf); /* from here on ASan reports any access by the core */
    s->x_base = NULL;
    if (!s->dead && !k->in_pay && k->pc.fd >= 0 && chance(70)) {
        fr g = chance(50) ? gen_data(s) : gen_read(1);
        g.region = xid;
        send_frame(s, k, &g, 0, 0);
        if (!s->dead)
            CHECK(shutdown(k->pc.fd, SHUT_WR) == 0);
    } else if (!s->dead && !k->in_pay) {
        CHECK(shutdown(k->pc.fd, SHUT_WR) == 0);
    }
    pc_wait_eof(&k->pc, m_on_frame_cb, s);
    free(s->x_shadow);
    sess_finish(s, 1);
}

/* ------------------------------------------- the core as initiator: push/pull */

typedef struct {
    uint64_t src, dst, len;
} pseg;

typedef struct {
    int seg;
    uint64_t off, len;
    int seen, conn, answered;
    uint64_t seq; /* push: its place among the link's DATA frames, in arrival order */
} pchunk;

#define MAX_CHUNKS 1024
#define MAX_VIEWS 2

typedef struct peer {
    linkrec *l;
    pconn c[MAXC];
    int nc;
    uint32_t prid, tid;
    int bad;
    uint64_t rx_sure, rx_maybe; /* RDATA payload bytes the core counts surely / perhaps */
    /* the current job */
    jobrec *j;
    int pull;
    pseg sg[4];
    int nsegs;
    uint64_t total;
    pchunk ch[MAX_CHUNKS];
    int nch, nseen;
    const uint8_t *src; /* push: the source bytes */
    int aborts[MAXC];   /* ABORTs of the job seen per stream */
    int aborted;        /* kv_core_abort called */
    uint64_t ping[MAXC];
    int acked[MAXC];    /* ABORT_ACKs sent per stream */
    int want_seen;
    int link_failed; /* frames sent before the failure may still be read after the completion */
    int late_ok;     /* DATA the core handed to the kernel before the completion may be read after it */
    /* the link's push window, and our CREDITs (in the peer holding the streams) */
    uint64_t win;    /* kv_tcp_link_add's window (0: none) */
    uint64_t rcvd;   /* payload bytes of the core's DATA frames received on the link, every job */
    uint64_t cred;   /* of them, CREDITed as far as the core can tell (see peer_credit) */
    uint64_t last_len, last_xfer; /* the last DATA frame received */
    uint64_t nframes; /* DATA frames received */
    int credit;      /* 0: no CREDITs; 1: CREDITs as a receiver sends them (peer_credit); 2: withheld */
    /* more jobs at once on the link: views sharing its streams (only j, sg, ch, src are theirs) */
    struct peer *owner;             /* a view's: the peer holding the streams */
    struct peer *views[MAX_VIEWS];  /* the owner's */
    int cdup[MAXC]; /* our dup of the core's end of a stream with a small send buffer (0: none) */
    /* our LEASE_REQs per stream (offsets: our clock, = the core's) and the LEASEs answering them */
    uint64_t lq[MAXC][8];
    int lq_head[MAXC], lq_n[MAXC];
    uint64_t lreq_last[MAXC]; /* the last one answered */
    int granted[MAXC];        /* a LEASE came on that stream: DATA may follow */
} peer;

static void peer_chunks(peer *p) {
    p->nch = 0;
    p->nseen = 0;
    p->total = 0;
    for (int i = 0; i < p->nsegs; i++) {
        p->total += p->sg[i].len;
        for (uint64_t off = 0; off < p->sg[i].len; off += CHUNK) {
            CHECK(p->nch < MAX_CHUNKS);
            pchunk *c = &p->ch[p->nch++];
            memset(c, 0, sizeof *c);
            c->seg = i;
            c->off = off;
            c->len = p->sg[i].len - off < CHUNK ? p->sg[i].len - off : CHUNK;
        }
    }
}

static fr chunk_frame(const peer *p, const pchunk *c) {
    fr f = mkf(p->pull ? F_READ : F_DATA, 0, p->j->id);
    f.region = p->prid;
    f.offset = (p->pull ? p->sg[c->seg].src : p->sg[c->seg].dst) + c->off;
    f.length = c->len;
    f.total = p->total;
    if (p->pull) {
        f.region2 = (uint32_t)c->seg;
        f.offset2 = c->off;
    }
    return f;
}

static void peer_on_frame(peer *p, int i, const fr *h) {
    for (int v = 0; v < MAX_VIEWS && !p->owner; v++) /* a frame of another job on the link */
        if (p->views[v] && p->views[v]->j && h->xfer == p->views[v]->j->id &&
            (h->type == F_DATA || h->type == F_READ || h->type == F_ABORT)) {
            peer_on_frame(p->views[v], i, h);
            return;
        }
    peer *o = p->owner ? p->owner : p; /* its streams and the link's window */
    pconn *c = &o->c[i];
    if (h->type == F_LEASE) { /* the core grants what we asked for, in order, echoing our clock */
        CHECK(o->lq_n[i] > 0);
        fr want = mkf(F_LEASE, 0, 0);
        want.offset = o->lq[i][o->lq_head[i]];
        if (!fr_eq(h, &want)) {
            fr_print("got", h);
            fr_print("want", &want);
            CHECK(fr_eq(h, &want));
        }
        o->lq_head[i] = (o->lq_head[i] + 1) % 8;
        o->lq_n[i]--;
        o->lreq_last[i] = want.offset;
        o->granted[i] = 1;
        return;
    }
    if (h->type == F_ABORT_ACK && o->ping[i] && h->xfer == o->ping[i]) {
        fr want = mkf(F_ABORT_ACK, F_PULL, o->ping[i]);
        CHECK(fr_eq(h, &want));
        o->ping[i] = 0;
        return;
    }
    if (p->j && (h->type == F_DATA || h->type == F_READ) && h->xfer == p->j->id) {
        CHECK(!p->j->done || p->link_failed || p->late_ok); /* nothing of a job after its completion */
        CHECK(h->type == F_READ || o->granted[i]);  /* no DATA before the core granted us a lease there */
        CHECK(!p->aborts[i]);                  /* nor after its ABORT on that stream */
        for (int k = 0; k < p->nch; k++) {
            fr want = chunk_frame(p, &p->ch[k]);
            if (!p->ch[k].seen && fr_eq(h, &want)) {
                if (!p->pull && p->src &&
                    memcmp(c->pay, p->src + p->sg[p->ch[k].seg].src + p->ch[k].off, (size_t)h->length) != 0) {
                    FAILED_AT("%s", "DATA payload is not the source bytes");
                    die();
                }
                p->ch[k].seen = 1;
                p->ch[k].conn = i;
                p->nseen++;
                g_checks++;
                if (!p->pull) {
                    p->ch[k].seq = o->nframes++;
                    o->last_len = h->length;
                    o->last_xfer = h->xfer;
                    uint64_t before = o->rcvd - o->cred; /* unCREDITed before this frame */
                    o->rcvd += h->length;
                    /* The core starts a push frame only while less than its window
                     * is unCREDITed. One stream: frames arrive in the order claimed,
                     * so before this one less than the window was unCREDITed (our
                     * CREDITs are at least what the core had applied). Two: the
                     * last-claimed frame received may be another one, so this bound
                     * holds with one chunk more. */
                    if (o->win && (o->nc == 1 ? before >= o->win : o->rcvd - o->cred >= o->win + CHUNK)) {
                        fr_print("got", h);
                        FAILED_AT("push window exceeded: %" PRIu64 " bytes unCREDITed before this frame, "
                                  "window %" PRIu64 ", %d stream(s)",
                                  before, o->win, o->nc);
                        die();
                    }
                }
                return;
            }
        }
        fr_print("got", h);
        FAILED_AT("%s", "DATA/READ matching no chunk of the job (or twice)");
        die();
    }
    if (p->j && h->type == F_ABORT && h->xfer == p->j->id) {
        fr want = mkf(F_ABORT, p->pull ? F_PULL : 0, p->j->id);
        CHECK(fr_eq(h, &want));
        CHECK(!p->aborts[i]);
        /* push: the completion waits for every ABORT_ACK, so no ABORT follows it;
         * pull: completes at once, the ABORTs follow */
        CHECK(p->pull || !p->j->done || p->link_failed || p->late_ok);
        p->aborts[i] = 1;
        return;
    }
    fr_print("got", h);
    FAILED_AT("unexpected frame on stream %d of a peer link", i);
    die();
}

/* A CREDIT of n bytes on stream i (any stream: the window is the link's). */
static void credit_send(peer *p, int i, uint64_t n) {
    fr f = mkf(F_CREDIT, 0, p->last_xfer);
    if (chance(15)) /* naming another transfer, or none: counted all the same */
        f.xfer = chance(50) ? rnd() : 0;
    f.length = n;
    if (chance(10)) { /* only the type and the length matter */
        f.flags = (uint16_t)rnd();
        f.status = (uint32_t)rnd();
        f.region = (uint32_t)rnd();
        f.offset = rnd();
        f.total = rnd();
        f.offset2 = rnd();
    }
    if (p->c[i].fd < 0 || !pc_send(&p->c[i], &f, sizeof f))
        CHECK(p->link_failed);
}

/* Our CREDITs when p->credit == 1, as a receiver may send them: now or later
 * (then several frames in one), one frame's worth or any part of what is
 * unCREDITed, on any stream. With the window unCREDITed the core must be
 * stalled: something is always CREDITed then. On one stream the core then has
 * nothing under way (any frame it started would have come first), so our count
 * is exactly its own: an excess CREDIT (up to 64 MiB, clamped by the core to
 * what is on the wire) sets both to zero. */
static void peer_credit(peer *p) {
    if (p->credit != 1 || p->rcvd == p->cred)
        return;
    uint64_t un = p->rcvd - p->cred, n;
    int stalled = p->win && un >= p->win;
    if (!stalled && !chance(30))
        return; /* later */
    switch (below(3)) {
    case 0:
        n = un;
        break;
    case 1:
        n = p->last_len < un ? p->last_len : un;
        break;
    default:
        n = 1 + below(un);
        break;
    }
    if (stalled && p->nc == 1 && chance(25)) {
        n = chance(50) ? un + 1 + below(4 * CHUNK) : MAX_FRAME;
        p->cred = p->rcvd;
    } else {
        p->cred += n;
    }
    credit_send(p, (int)below((uint64_t)p->nc), n);
}

/* Handle frames from the core until done(p) or the timeout. skip: a stream not to read. */
static int peer_wait(peer *p, int (*done)(peer *), int skip, int timeout_ms) {
    double end = now_ms() + timeout_ms;
    for (;;) {
        pump_events(0);
        if (done(p))
            return 1;
        int got = 0;
        struct pollfd pf[MAXC + 1]; /* and the core's eventfd: a completion ends the wait at once */
        for (int i = 0; i < p->nc; i++) {
            pf[i].fd = i == skip ? -1 : p->c[i].fd;
            pf[i].events = POLLIN;
            pf[i].revents = 0;
            if (pf[i].fd < 0)
                continue;
            fr h;
            while (pc_frame_t(&p->c[i], &h, 0, 1) == 1) {
                peer_on_frame(p, i, &h);
                got = 1;
            }
            if (p->c[i].eof)
                pf[i].fd = -1;
        }
        peer_credit(p);
        if (got)
            continue;
        double left = end - now_ms();
        if (left <= 0)
            return 0;
        pf[p->nc].fd = kv_core_fileno(g_core);
        pf[p->nc].events = POLLIN;
        pf[p->nc].revents = 0;
        poll(pf, (nfds_t)p->nc + 1, left < 10 ? (int)left + 1 : 10);
        for (int i = 0; i < p->nc; i++)
            if (pf[i].fd >= 0 && pf[i].revents)
                pc_fill(&p->c[i], 0);
    }
}

static int all_seen(peer *p) { return p->nseen == p->nch; }
static int leases_answered(peer *p) {
    for (int i = 0; i < p->nc; i++)
        if (p->lq_n[i] && !p->c[i].eof)
            return 0;
    return 1;
}

/* Ask the core for a lease on stream i (offset: now). */
static void peer_lease_req(peer *p, int i) {
    CHECK(p->lq_n[i] < 8);
    fr f = mkf(F_LEASE_REQ, 0, 0);
    f.offset = ns_now();
    p->lq[i][(p->lq_head[i] + p->lq_n[i]++) % 8] = f.offset;
    if (chance(10)) { /* only the type and the offset matter */
        f.xfer = rnd();
        f.length = rnd();
    }
    CHECK(pc_send(&p->c[i], &f, sizeof f));
}
static int unanswered(peer *p) {
    for (int k = 0; k < p->nch; k++)
        if (p->ch[k].seen && !p->ch[k].answered)
            return 1;
    return 0;
}
static int job_done(peer *p) { return p->j->done; }
static int pings_done(peer *p) {
    for (int i = 0; i < p->nc; i++)
        if (p->ping[i] && !p->c[i].eof)
            return 0;
    return 1;
}
static int aborts_all(peer *p) {
    for (int i = 0; i < p->nc; i++)
        if (!p->aborts[i])
            return 0;
    return 1;
}

static void peer_ping(peer *p, int i) {
    p->ping[i] = g_ping++;
    fr f = mkf(F_ABORT, F_PULL, p->ping[i]);
    CHECK(pc_send(&p->c[i], &f, sizeof f));
    CHECK(peer_wait(p, pings_done, -1, WAIT_MS));
}

/* A link whose nc streams are ours. client: the core is the client (streams
 * handed over with kv_tcp_conn_add; it sends HELLO, the test answers HELLO_ACK,
 * LINK_READY follows); else it accepted them. */
static int peer_wait(peer *p, int (*done)(peer *), int skip, int timeout_ms);

/* grant: ask the core for a lease on every stream (without one it sends no DATA there). */
static peer *peer_open3(int nc, int small_rcvbuf, int client, uint64_t win, int small_sndbuf, uint64_t lease,
                        uint64_t fence, uint64_t margin, int grant) {
    peer *p = calloc(1, sizeof *p);
    CHECK(p != NULL);
    p->l = link_new_lw(nc, win, lease, fence, margin);
    p->win = win;
    p->nc = nc;
    if (!client) {
        for (int i = 0; i < nc; i++) {
            pc_open(&p->c[i], small_rcvbuf == i + 1 ? 4096 : 0);
            CHECK(hello_send(&p->c[i], p->l->tok, 0));
            expect_hello_ack(&p->c[i]);
        }
        p->l->bound = 1;
    } else {
        p->l->client = 1;
        p->l->bound = 1;
        for (int i = 0; i < nc; i++) {
            int cfd = -1;
            pc_pair(&p->c[i], &cfd);
            if (small_sndbuf) { /* the core's end sends into a small buffer (until sndbuf_restore) */
                int b = 4096;
                CHECK(setsockopt(cfd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b) == 0);
                p->cdup[i] = fcntl(cfd, F_DUPFD_CLOEXEC, 3);
                CHECK(p->cdup[i] >= 3);
            }
            CHECK_EQ(kv_tcp_conn_add(g_core, cfd, p->l->id), KV_LLM_SUCCESS);
        }
        for (int i = 0; i < nc; i++) {
            fr h, want = mkf(F_HELLO, F_DATAV_OK | F_READS_OK, 0);
            want.length = 32;
            CHECK_EQ(pc_frame(&p->c[i], &h), 1);
            CHECK(fr_eq(&h, &want));
            CHECK(memcmp(p->c[i].pay, p->l->tok, 32) == 0);
            pump_events(0);
            CHECK(!p->l->ready);
            fr a = mkf(F_HELLO_ACK, 0, 0);
            if (chance(20)) { /* only the type matters */
                a.xfer = rnd();
                a.status = (uint32_t)rnd();
            }
            CHECK(pc_send(&p->c[i], &a, sizeof a));
        }
        double end = now_ms() + WAIT_MS;
        while (!p->l->ready) {
            CHECK(now_ms() < end);
            pump_events(10);
        }
    }
    p->prid = (uint32_t)(1 + below(UINT32_MAX));
    CHECK_EQ(kv_region_add(g_core, KV_REGION_TCP, (int32_t)p->l->id, p->prid, PEER_LEN, 0, &p->tid),
             KV_LLM_SUCCESS);
    if (grant) {
        for (int i = 0; i < nc; i++)
            peer_lease_req(p, i);
        if (chance(50)) /* or they come along with the first frames */
            CHECK(peer_wait(p, leases_answered, -1, WAIT_MS));
    }
    return p;
}

/* A short lease: a push of a failed link completes (last grant + lease + margin) soon after. */
static peer *peer_open2(int nc, int small_rcvbuf, int client, uint64_t win, int small_sndbuf) {
    return peer_open3(nc, small_rcvbuf, client, win, small_sndbuf, (2 + below(8)) * MS, PEER_FENCE, MS, 1);
}

static peer *peer_open(int nc, int small_rcvbuf, int client) { return peer_open2(nc, small_rcvbuf, client, 0, 0); }

/* The core's end of stream i gets a large send buffer again (slow transfers
 * otherwise); our dup of its socket goes. */
static void sndbuf_restore(peer *p, int i) {
    int b = 1 << 20;
    CHECK(p->cdup[i] > 0);
    CHECK(setsockopt(p->cdup[i], SOL_SOCKET, SO_SNDBUF, &b, sizeof b) == 0);
    close(p->cdup[i]);
    p->cdup[i] = 0;
}

/* A second job on p's link: a view sharing its streams and remote region. */
static peer *peer_view(peer *p, int v) {
    CHECK(v < MAX_VIEWS && !p->views[v]);
    peer *q = calloc(1, sizeof *q);
    CHECK(q != NULL);
    q->owner = p;
    q->l = p->l;
    q->nc = p->nc;
    q->prid = p->prid;
    q->tid = p->tid;
    p->views[v] = q;
    return q;
}

/* After a link failed: a new stream for it is refused (the core closes it), and
 * closing it is harmless. Both touch the dead link's state in the core. */
static void poke_dead_link(linkrec *l) {
    if (chance(40)) {
        pconn x;
        int cfd = -1;
        pc_pair(&x, &cfd);
        CHECK_EQ(kv_tcp_conn_add(g_core, cfd, l->id), KV_LLM_SUCCESS);
        fr h;
        CHECK_EQ(pc_frame(&x, &h), 0);
        pc_close(&x, 0);
    }
    if (chance(40)) {
        CHECK_EQ(kv_tcp_link_close(g_core, l->id, chance(50) ? 0 : KV_LLM_CANCELLED), KV_LLM_SUCCESS);
        l->closed = 1;
    }
}

static void submit_job_ranked(peer *p, uint32_t local_rid, uint64_t rank) {
    p->j = job_new();
    uint64_t w[4 * KV_SEG_WORDS];
    for (int i = 0; i < p->nsegs; i++) {
        uint64_t *x = w + i * KV_SEG_WORDS;
        x[0] = p->pull ? p->tid : local_rid;
        x[1] = p->sg[i].src;
        x[2] = p->pull ? local_rid : p->tid;
        x[3] = p->sg[i].dst;
        x[4] = p->sg[i].len;
    }
    int done = -1;
    uint64_t nb = 99;
    if (rank || chance(20))
        CHECK_EQ(kv_core_submit_ranked(g_core, p->j->id, w, (size_t)p->nsegs, 1ull << 40, rank, &done, &nb),
                 KV_LLM_SUCCESS);
    else
        CHECK_EQ(kv_core_submit(g_core, p->j->id, w, (size_t)p->nsegs, 1ull << 40, &done, &nb), KV_LLM_SUCCESS);
    CHECK_EQ(done, 0); /* a TCP job is never inline */
}

static void submit_job(peer *p, uint32_t local_rid) { submit_job_ranked(p, local_rid, 0); }

/* The end of a peer session: the link goes down (if it is not already), or is
 * closed with kv_tcp_link_close (no LINK_DOWN, not counted as failed). */
static void peer_close(peer *p) {
    for (int i = 0; i < p->nc; i++)
        if (p->cdup[i] > 0)
            close(p->cdup[i]);
    int via_close = !p->l->down && chance(25);
    if (via_close) {
        CHECK_EQ(kv_tcp_link_close(g_core, p->l->id, chance(50) ? 0 : KV_LLM_CANCELLED), KV_LLM_SUCCESS);
        p->l->closed = 1;
    } else {
        for (int i = 0; i < p->nc; i++)
            if (p->c[i].fd >= 0 && !p->c[i].eof)
                shutdown(p->c[i].fd, SHUT_WR);
    }
    for (int i = 0; i < p->nc; i++) {
        if (p->c[i].fd < 0)
            continue;
        fr h;
        while (pc_frame(&p->c[i], &h) == 1)
            peer_on_frame(p, i, &h);
        pc_close(&p->c[i], 0);
    }
    if (!via_close) {
        wait_link_down(p->l);
        e_failed++;
        poke_dead_link(p->l);
    }
    CHECK_EQ(kv_region_remove(g_core, p->tid), KV_LLM_SUCCESS);
    e_bad += (uint64_t)p->bad;
    e_rx_lo += p->rx_sure;
    e_rx_hi += p->rx_sure + p->rx_maybe;
    check_stats();
    pump_events(0);
    CHECK(!via_close || !p->l->down);
    e_rx_lo = e_rx_hi = stats().tcp_bytes_received;
    check_canaries();
    free(p);
}

/* Client streams whose peer answers the HELLO with something else than a
 * HELLO_ACK (on one stream; others may have been acknowledged). */
static void sess_client_bad(void) {
    g_what = "client-hello";
    int nc = 1 + (int)below(2);
    linkrec *l = link_new(nc);
    l->client = 1;
    l->bound = 1;
    pconn c[MAXC];
    for (int i = 0; i < nc; i++) {
        int cfd = -1;
        pc_pair(&c[i], &cfd);
        CHECK_EQ(kv_tcp_conn_add(g_core, cfd, l->id), KV_LLM_SUCCESS);
    }
    int badi = (int)below((uint64_t)nc);
    for (int i = 0; i < nc; i++) {
        fr h;
        CHECK_EQ(pc_frame(&c[i], &h), 1);
        CHECK(h.type == F_HELLO && memcmp(c[i].pay, l->tok, 32) == 0);
    }
    for (int i = 0; i < nc; i++) {
        if (i == badi)
            continue;
        fr a = mkf(F_HELLO_ACK, 0, 0);
        CHECK(pc_send(&c[i], &a, sizeof a));
    }
    fr b = mkf((uint16_t)(chance(50) ? F_HELLO : F_DATA + below(F_LAST - F_DATA + 1)), 0, rnd());
    b.length = below(64);
    if (chance(30))
        b.magic = (uint32_t)rnd();
    if (chance(20))
        b.type = (uint16_t)(F_LAST + 1 + below(100));
    uint8_t junk[64 + 64];
    memcpy(junk, &b, 64);
    rnd_bytes(junk + 64, 64);
    pc_send(&c[badi], junk, 64 + (size_t)below(65));
    for (int i = 0; i < nc; i++) {
        fr h;
        while (pc_frame(&c[i], &h) == 1) {
        }
        pc_close(&c[i], 0);
    }
    wait_link_down(l);
    e_failed++;
    e_bad++;
    poke_dead_link(l);
    check_stats();
    pump_events(0);
    CHECK(!l->ready); /* one stream never acknowledged: never ready */
    check_canaries();
}

/* A frame the core must reject as malformed, whatever state the link is in. */
static fr bad_frame(void) {
    fr f = mkf(F_HELLO, 0, 0);
    switch (below(5)) {
    case 4: /* a CREDIT for more than a frame can carry */
        f.type = F_CREDIT;
        f.xfer = rnd();
        f.length = chance(50) ? MAX_FRAME + 1 + below(1000) : UINT64_MAX - below(1000);
        break;
    case 0:
        f.length = 32;
        break;
    case 1:
        f.type = F_HELLO_ACK;
        break;
    case 2:
        f.type = F_RDATA; /* for a transfer nobody asked for */
        f.xfer = 0x6000000000000000ull + below(1000);
        f.length = 1 + below(100);
        break;
    default:
        f.magic ^= 1u << below(32);
        f.type = F_ACK;
        break;
    }
    return f;
}

static int seen_enough(peer *p) { return p->nseen >= p->want_seen; }

/* ABORT_ACK every ABORT seen; the job of an aborted push completes only after
 * the last one (the fence). */
static int push_abort_progress(peer *p) {
    for (int i = 0; i < p->nc; i++) {
        if (!p->aborts[i] || p->acked[i])
            continue;
        int last = 1;
        for (int k = 0; k < p->nc; k++)
            if (k != i && !p->acked[k])
                last = 0;
        if (last) {
            pump_events(0);
            CHECK(!p->j->done);
        }
        fr a = mkf(F_ABORT_ACK, 0, p->j->id);
        CHECK(pc_send(&p->c[i], &a, sizeof a));
        p->acked[i] = 1;
    }
    if (p->j->done) { /* every stream that saw an ABORT was answered; no ABORT: nothing had gone out */
        int any = 0;
        for (int k = 0; k < p->nc; k++)
            any |= p->aborts[k];
        for (int k = 0; k < p->nc && any; k++)
            CHECK(p->acked[k]);
        return 1;
    }
    return 0;
}

/* Read every stream to its end, handing frames to peer_on_frame. */
static void peer_drain_eof(peer *p) {
    for (int i = 0; i < p->nc; i++) {
        fr h;
        while (p->c[i].fd >= 0 && pc_frame(&p->c[i], &h) == 1)
            peer_on_frame(p, i, &h);
    }
}

/* A push window: tiny, about one chunk, a few chunks (not always a multiple). */
static uint64_t pick_window(void) {
    switch (below(4)) {
    case 0:
        return 1 + below(64);
    case 1:
        return CHUNK - 1 + below(3);
    case 2:
        return (2 + below(2)) * CHUNK;
    default:
        return 1 + below(3 * CHUNK);
    }
}

static int win_stalled(peer *p) { return p->rcvd - p->cred >= p->win || all_seen(p); }

/* slen random bytes registered as a local region (a push source): the buffer; *sid its id. */
static uint8_t *src_region(uint64_t slen, uint32_t *sid) {
    uint8_t *sb = xmalloc((size_t)slen);
    rnd_bytes(sb, (size_t)slen);
    CHECK_EQ(kv_region_add(g_core, KV_REGION_LOCAL, 0, A(sb), slen, 0, sid), KV_LLM_SUCCESS);
    return sb;
}

/* The core pushes; the test receives and answers. Some links have a push
 * window: the test CREDITs what it received (see peer_credit), or withholds
 * its CREDITs until the core stalls, then aborts the job. */
static void sess_push(void) {
    g_what = "peer-push";
    uint64_t win = chance(30) ? pick_window() : 0;
    peer *p = peer_open2(1 + (int)below(2), 0, chance(30), win, 0);
    p->credit = win || chance(50); /* with no window CREDITs change nothing */
    uint64_t slen = 4 * KiB + below(60 * KiB);
    uint32_t sid = 0;
    uint8_t *sb = src_region(slen, &sid);
    p->src = sb;
    p->nsegs = 1 + (int)below(3);
    for (int i = 0; i < p->nsegs; i++) {
        uint64_t len = 1 + below(slen < 24 * KiB ? slen : 24 * KiB);
        p->sg[i].len = len;
        p->sg[i].src = below(slen - len + 1);
        p->sg[i].dst = below(PEER_LEN - len + 1);
    }
    peer_chunks(p);
    submit_job(p, sid);
    int v = (int)below(6), i = (int)below((uint64_t)p->nc);
    uint32_t want_status = KV_LLM_SUCCESS;
    uint64_t want_bytes = 0;
    if (v <= 2) { /* every DATA, then the ACK */
        CHECK(peer_wait(p, all_seen, -1, WAIT_MS));
        if (v == 2) { /* about no job, or impossible for this one (not aborted; a push): the
                       * link fails (bad frame) and the push, unfenced, completes LINK_FAILED */
            fr junk[5] = {mkf(F_ACK, 0, p->j->id + (1ull << 40)), mkf(F_ABORT_ACK, 0, p->j->id),
                          mkf(F_RERR, 0, p->j->id), mkf(F_ABORT_ACK, F_PULL, p->j->id),
                          mkf(F_RDATA, 0, p->j->id)};
            junk[2].status = KV_LLM_FAILED;
            junk[4].length = 1 + below(64);
            CHECK(pc_send(&p->c[i], &junk[below(5)], sizeof junk[0]));
            p->bad = 1;
            p->link_failed = 1;
            wait_job(p->j);
            want_status = KV_LLM_LINK_FAILED;
            peer_drain_eof(p);
        } else {
            fr ack = mkf(F_ACK, 0, p->j->id);
            if (v == 1)
                ack.status = (uint32_t)(1 + below(UINT32_MAX));
            CHECK(pc_send(&p->c[i], &ack, sizeof ack));
            want_status = ack.status;
            want_bytes = ack.status ? 0 : p->total;
            CHECK(peer_wait(p, job_done, -1, WAIT_MS));
        }
        CHECK_EQ(p->j->flags, 0);
    } else {
        p->want_seen = (int)below((uint64_t)p->nch + 1);
        if (v == 3 && win && chance(50)) { /* the window fills up and stays full: the core stalls */
            p->credit = 2;
            CHECK(peer_wait(p, win_stalled, -1, WAIT_MS));
        } else {
            CHECK(peer_wait(p, seen_enough, -1, WAIT_MS));
        }
        if (v == 3) { /* abort: ABORT on every stream that carried anything, then the fence */
            CHECK_EQ(kv_core_abort(g_core, p->j->id, KV_LLM_CANCELLED), KV_LLM_SUCCESS);
            p->aborted = 1;
            CHECK(peer_wait(p, push_abort_progress, -1, WAIT_MS));
            want_status = KV_LLM_CANCELLED;
            /* nothing started: no ABORT, completed at once, flagged; else flags 0 */
            int any = 0;
            for (int k = 0; k < p->nc; k++)
                any |= p->aborts[k];
            CHECK_EQ(p->j->flags, p->nseen ? 0 : KV_DONE_UNSTARTED);
            CHECK_EQ(any, p->nseen != 0);
        } else { /* the stream breaks, or carries a bad frame: the link fails */
            p->link_failed = 1;
            if (v == 4) {
                pc_close(&p->c[i], chance(50));
            } else {
                fr b = bad_frame();
                pc_send(&p->c[i], &b, sizeof b);
                p->bad = 1;
            }
            wait_job(p->j);
            want_status = KV_LLM_LINK_FAILED;
            peer_drain_eof(p);
        }
    }
    wait_job(p->j);
    CHECK_EQ(p->j->status, want_status);
    CHECK_EQ(p->j->nbytes, want_bytes);
    /* the job is over: its source may go (ASan reports any later read) */
    CHECK_EQ(kv_region_remove(g_core, sid), KV_LLM_SUCCESS);
    free(sb);
    p->src = NULL;
    job_forget(p->j);
    p->j = NULL;
    peer_close(p);
}

static int last_seen(peer *p) { return p->ch[p->nch - 1].seen; }
static int abort1_seen(peer *p) { return p->aborts[1]; }

/* A hostile peer: stream 0 is not read (and has a small receive buffer), so a
 * DATA frame of the push stays half-sent on it, while stream 1 takes every
 * other chunk; then stream 1 answers as if everything had arrived: an ACK, or
 * (after kv_core_abort) two ABORT_ACKs. Whatever the core decides, once the job
 * has completed its source is freed: the core must not read it any more
 * (ASan checks sendmsg). A correct core refuses the early answer as a bad
 * frame (the link fails); if stream 0 happened to have nothing in flight, the
 * answer completes the job. */
static void sess_push_stuck(void) {
    g_what = "peer-push-stuck";
    peer *p = peer_open(2, 1, 0);
    uint64_t slen = 8 * 1024 * KiB;
    uint32_t sid = 0;
    uint8_t *sb = src_region(slen, &sid);
    p->src = sb;
    p->nsegs = 1;
    p->sg[0].len = slen;
    p->sg[0].dst = below(PEER_LEN - slen + 1);
    peer_chunks(p);
    submit_job(p, sid);
    int abort = chance(50);
    for (;;) { /* until stream 1 has the last chunk, or stalls */
        int before = p->nseen;
        if (peer_wait(p, last_seen, 0, 300) || p->nseen == before)
            break;
    }
    int stuck = last_seen(p) && p->ch[p->nch - 1].conn == 1;
    if (!stuck) { /* stream 0 took the last chunk: nothing to provoke; end plainly */
        CHECK(peer_wait(p, all_seen, -1, WAIT_MS));
        fr ack = mkf(F_ACK, 0, p->j->id);
        CHECK(pc_send(&p->c[1], &ack, sizeof ack));
        CHECK(peer_wait(p, job_done, -1, WAIT_MS));
        CHECK_EQ(p->j->status, KV_LLM_SUCCESS);
    } else if (!abort) {
        fr ack = mkf(F_ACK, 0, p->j->id);
        CHECK(pc_send(&p->c[1], &ack, sizeof ack));
        CHECK(peer_wait(p, job_done, 0, WAIT_MS));
        CHECK(p->j->status == KV_LLM_SUCCESS || p->j->status == KV_LLM_LINK_FAILED);
    } else {
        CHECK_EQ(kv_core_abort(g_core, p->j->id, KV_LLM_CANCELLED), KV_LLM_SUCCESS);
        p->aborted = 1;
        CHECK(peer_wait(p, abort1_seen, 0, WAIT_MS)); /* stream 0's ABORT is stuck behind its frame */
        fr a = mkf(F_ABORT_ACK, 0, p->j->id);
        CHECK(pc_send(&p->c[1], &a, sizeof a));
        CHECK(pc_send(&p->c[1], &a, sizeof a)); /* a second one, for the stream whose ABORT never came */
        CHECK(peer_wait(p, job_done, 0, WAIT_MS));
        /* stream 1 answered twice: a bad frame; the push, unfenced (stream 0 never
         * answered), completes LINK_FAILED (at its lease release) */
        CHECK_EQ(p->j->status, KV_LLM_LINK_FAILED);
    }
    pump_events(20);
    int failed = p->l->down;
    g_stuck += stuck;
    g_stuck_refused += stuck && failed;
    p->bad = failed;
    p->link_failed = failed;
    /* the job is over: its source goes, then stream 0 is read (where the core
     * would resume sending a half-sent frame) */
    CHECK_EQ(kv_region_remove(g_core, sid), KV_LLM_SUCCESS);
    free(sb);
    p->src = NULL;
    p->late_ok = 1;
    if (failed)
        peer_drain_eof(p);
    else if (!abort || !stuck) /* completed: every chunk still arrives (from the kernel's buffers) */
        CHECK(peer_wait(p, all_seen, -1, WAIT_MS));
    else /* and stream 0's ABORT after them */
        CHECK(peer_wait(p, aborts_all, -1, WAIT_MS));
    job_forget(p->j);
    p->j = NULL;
    peer_close(p);
}

static uint8_t content(uint64_t j, int seg, uint64_t off) {
    return (uint8_t)(j * 131 + (uint64_t)seg * 17 + off * 7 + (off >> 9));
}

/* RDATA answering [off, off+len) of segment seg (flip: other bytes than asked). */
static int send_rdata(peer *p, int i, int seg, uint64_t off, uint64_t len, uint8_t *dsh, uint8_t flip,
                      uint64_t send_len) {
    fr f = mkf(F_RDATA, 0, p->j->id);
    f.region = (uint32_t)seg;
    f.offset = off;
    f.length = len;
    f.total = p->total;
    uint8_t *b = xmalloc((size_t)(sizeof f + len));
    memcpy(b, &f, sizeof f);
    for (uint64_t q = 0; q < len; q++)
        b[sizeof f + q] = content(p->j->id, seg, off + q) ^ flip;
    if (dsh)
        memcpy(dsh + p->sg[seg].dst + off, b + sizeof f, (size_t)len);
    int ok = pc_send(&p->c[i], b, (size_t)(sizeof f + send_len));
    free(b);
    return ok;
}

/* The core pulls; the test answers its READs. */
static void sess_pull(void) {
    g_what = "peer-pull";
    int nc = 1 + (int)below(2);
    /* a push window, never CREDITed, must not hold READs back */
    peer *p = peer_open2(nc, 0, chance(30), chance(20) ? pick_window() : 0, 0);
    p->pull = 1;
    int v = (int)below(nc == 2 ? 5 : 4);
    uint64_t seg_max = v == 0 ? 96 * KiB : 20 * KiB; /* v 0: past the READ window, answered as READs come */
    const uint64_t margin = 256;
    uint64_t dlen = 4 * KiB + below(v == 0 ? 300 * KiB : 60 * KiB);
    uint8_t *db = xmalloc((size_t)(dlen + 2 * margin)), *dst = db + margin;
    for (uint64_t q = 0; q < margin; q++)
        db[q] = dst[dlen + q] = GUARD_BYTE(q);
    rnd_bytes(dst, (size_t)dlen);
    uint8_t *dsh = xmalloc((size_t)dlen);
    memcpy(dsh, dst, (size_t)dlen);
    uint32_t did = 0;
    CHECK_EQ(kv_region_add(g_core, KV_REGION_LOCAL, 0, A(dst), dlen, 0, &did), KV_LLM_SUCCESS);
    uint64_t cur = 0;
    int want_segs = 1 + (int)below(3);
    p->nsegs = 0;
    while (p->nsegs < want_segs && cur < dlen) { /* disjoint destinations, at most 60 KiB (one READ window) */
        uint64_t room = dlen - cur, gap = below(room < 2 * KiB ? room : 2 * KiB);
        if (room - gap < 1)
            break;
        uint64_t len = 1 + below(room - gap < seg_max ? room - gap : seg_max);
        pseg *g = &p->sg[p->nsegs++];
        g->dst = cur + gap;
        g->len = len;
        g->src = below(PEER_LEN - len + 1);
        cur = g->dst + len;
    }
    peer_chunks(p);
    submit_job(p, did);
    if (v != 0)
        CHECK(peer_wait(p, all_seen, -1, WAIT_MS)); /* every READ, at once (within one window) */
    uint32_t want_status = KV_LLM_SUCCESS;
    uint64_t answered = 0;
    int c0 = -1;
    if (v == 4) {
        for (int k = 0; k < p->nch && c0 < 0; k++)
            if (p->ch[k].len >= 2)
                c0 = k;
        if (c0 < 0)
            v = 0;
    }
    if (v == 0) { /* every READ answered as it comes (the window holds the rest back), in any
                   * order, on its stream (answers on another stream: v 3), in one or two pieces */
        for (int left = p->nch; left > 0;) {
            CHECK(peer_wait(p, unanswered, -1, WAIT_MS));
            int idx[MAX_CHUNKS], n = 0;
            for (int k = 0; k < p->nch; k++)
                if (p->ch[k].seen && !p->ch[k].answered)
                    idx[n++] = k;
            for (; n > 0; n--) {
                int r = (int)below((uint64_t)n), k = idx[r];
                idx[r] = idx[n - 1];
                pchunk *t = &p->ch[k];
                int i = t->conn;
                uint64_t cut = t->len > 1 && chance(40) ? 1 + below(t->len - 1) : t->len;
                CHECK(send_rdata(p, i, t->seg, t->off, cut, dsh, 0, cut));
                if (cut < t->len)
                    CHECK(send_rdata(p, i, t->seg, t->off + cut, t->len - cut, dsh, 0, t->len - cut));
                t->answered = 1;
                left--;
            }
        }
        CHECK(peer_wait(p, job_done, -1, WAIT_MS));
        answered = p->total;
        p->rx_sure += p->total;
    } else if (v == 4) { /* a hostile peer answers one READ twice: the chunks before c0 on their
                          * streams, chunk c0's RDATA half-way on its stream, then c0 again on
                          * the other stream. The repeat (misrouted, too) fails the link (else a
                          * pull could complete with bytes never written); the rest of the first
                          * payload never lands. */
        pchunk *t = &p->ch[c0];
        int s0 = t->conn, s1 = 1 - s0;
        for (int k = 0; k < c0; k++) {
            CHECK(send_rdata(p, p->ch[k].conn, p->ch[k].seg, p->ch[k].off, p->ch[k].len, dsh, 0, p->ch[k].len));
            answered += p->ch[k].len;
        }
        uint64_t part = 1 + below(t->len - 1);
        uint8_t flip = (uint8_t)(1 + below(255));
        fr f = mkf(F_RDATA, 0, p->j->id);
        f.region = (uint32_t)t->seg;
        f.offset = t->off;
        f.length = t->len;
        f.total = p->total;
        CHECK(pc_send(&p->c[s0], &f, sizeof f));
        uint8_t *pay = xmalloc((size_t)t->len);
        for (uint64_t q = 0; q < t->len; q++)
            pay[q] = content(p->j->id, t->seg, t->off + q) ^ flip;
        uint8_t *at = dst + p->sg[t->seg].dst + t->off + part - 1;
        pay[part - 1] = other(*at);
        CHECK(pc_send(&p->c[s0], pay, (size_t)part));
        wait_landed(at, pay[part - 1]);
        memcpy(dsh + p->sg[t->seg].dst + t->off, pay, (size_t)part);
        peer_ping(p, s1); /* the chunks before c0 on the other stream have landed too */
        p->rx_sure += answered;
        f.length = t->len - (chance(50) ? below(t->len) : 0); /* all of c0 again, or its start */
        CHECK(pc_send(&p->c[s1], &f, sizeof f));
        p->bad = 1;
        p->link_failed = 1;
        want_status = KV_LLM_LINK_FAILED;
        CHECK(peer_wait(p, job_done, -1, WAIT_MS));
        g_dup_rdata++;
        pc_send(&p->c[s0], pay + part, (size_t)(t->len - part)); /* the connection may be closed */
        free(pay);
        wait_link_down(p->l);
    } else { /* some READs answered, then RERR / abort / a bad RDATA */
        int stop = (int)below((uint64_t)p->nch);
        for (int k = 0; k < stop; k++) {
            CHECK(send_rdata(p, p->ch[k].conn, p->ch[k].seg, p->ch[k].off, p->ch[k].len, dsh, 0, p->ch[k].len));
            answered += p->ch[k].len;
        }
        for (int k = 0; k < nc; k++)
            peer_ping(p, k);
        p->rx_sure += answered;
        pump_events(0);
        CHECK(!p->j->done);
        if (v == 1 || v == 2) {
            if (v == 1) {
                fr e = mkf(F_RERR, 0, p->j->id);
                e.status = chance(20) ? 0 : (uint32_t)(1 + below(UINT32_MAX));
                e.length = below(CHUNK);
                CHECK(pc_send(&p->c[below((uint64_t)nc)], &e, sizeof e));
                want_status = e.status ? e.status : KV_LLM_FAILED;
            } else {
                CHECK_EQ(kv_core_abort(g_core, p->j->id, KV_LLM_CANCELLED), KV_LLM_SUCCESS);
                want_status = KV_LLM_CANCELLED;
            }
            CHECK(peer_wait(p, job_done, -1, WAIT_MS)); /* a pull completes at once, a tombstone stays */
            CHECK(memcmp(dst, dsh, (size_t)dlen) == 0);
            CHECK(peer_wait(p, aborts_all, -1, WAIT_MS));
            /* late answers before our ABORT_ACKs: discarded, the link lives */
            pchunk *t = &p->ch[stop];
            CHECK(send_rdata(p, t->conn, t->seg, t->off, t->len, NULL, 0, t->len));
            p->rx_maybe += t->len; /* not counted, unless discarding is broken (then the bytes show) */
            for (int k = 0; k < nc; k++) {
                fr a = mkf(F_ABORT_ACK, F_PULL, p->j->id);
                CHECK(pc_send(&p->c[k], &a, sizeof a));
            }
            for (int k = 0; k < nc; k++)
                peer_ping(p, k);
            CHECK(memcmp(dst, dsh, (size_t)dlen) == 0);
            if (chance(30)) { /* the tombstone is gone: an answer now is to nothing */
                CHECK(send_rdata(p, t->conn, t->seg, t->off, t->len, NULL, 0, t->len) || 1);
                p->bad = 1;
                p->link_failed = 1;
                wait_link_down(p->l);
            }
        } else { /* v == 3: an RDATA outside what the job can take */
            int i = (int)below((uint64_t)nc), seg = (int)below((uint64_t)p->nsegs);
            uint64_t slen = p->sg[seg].len;
            fr f = mkf(F_RDATA, 0, p->j->id);
            f.region = (uint32_t)seg;
            f.offset = below(slen);
            f.length = 1;
            f.total = p->total;
            switch (below(9)) {
            case 8: /* the next bytes of an unanswered chunk, on the other stream than its READ's */
                if (nc == 2) {
                    pchunk *t = &p->ch[stop];
                    f.region = (uint32_t)t->seg;
                    f.offset = t->off;
                    f.length = 1 + below(t->len);
                    i = 1 - t->conn;
                    break;
                }
                /* fall through */
            case 6: /* an answered chunk again (every answer counts once) */
                if (stop > 0) {
                    pchunk *t = &p->ch[below((uint64_t)stop)];
                    f.region = (uint32_t)t->seg;
                    f.offset = t->off;
                    f.length = 1 + below(t->len);
                    break;
                }
                /* fall through */
            case 7: /* an unanswered chunk, not from its start (answers come in order) */
                if (p->ch[stop].len >= 2) {
                    pchunk *t = &p->ch[stop];
                    f.region = (uint32_t)t->seg;
                    f.offset = t->off + 1 + below(t->len - 1);
                    f.length = 1;
                    break;
                }
                /* fall through */
            case 0:
                f.region = (uint32_t)p->nsegs + (chance(50) ? (uint32_t)below(4) : UINT32_MAX - (uint32_t)p->nsegs);
                break;
            case 1:
                f.offset = chance(50) ? slen + 1 + below(1000) : UINT64_MAX - below(slen + 2);
                break;
            case 2:
                f.length = slen - f.offset + 1 + (chance(50) ? below(100) : UINT64_MAX - slen);
                break;
            case 3:
                f.length = 0;
                break;
            case 4:
                f.length = chance(50) ? MAX_FRAME + 1 : UINT64_MAX;
                break;
            default:
                f.xfer = p->j->id + (1ull << 44);
                break;
            }
            pc_send(&p->c[i], &f, sizeof f);
            p->bad = 1;
            p->link_failed = 1;
            want_status = KV_LLM_LINK_FAILED;
            CHECK(peer_wait(p, job_done, -1, WAIT_MS));
        }
    }
    wait_job(p->j);
    CHECK_EQ(p->j->status, want_status);
    CHECK_EQ(p->j->nbytes, answered);
    if (p->link_failed)
        peer_drain_eof(p);
    CHECK(memcmp(dst, dsh, (size_t)dlen) == 0);
    for (uint64_t q = 0; q < margin; q++)
        CHECK(db[q] == GUARD_BYTE(q) && dst[dlen + q] == GUARD_BYTE(q));
    /* the job is over: its destination may go (ASan reports any later write) */
    CHECK_EQ(kv_region_remove(g_core, did), KV_LLM_SUCCESS);
    free(db);
    free(dsh);
    job_forget(p->j);
    p->j = NULL;
    peer_close(p);
}

/* One stream: a first pull fills the stream's READ window (4 chunks, left
 * unanswered), so a second pull sends no READ at all (frames == 0). The peer
 * answers it anyway: an answer to nothing asked fails the link at its header;
 * both pulls complete LINK_FAILED and none of the payload lands. */
static void sess_pull_unasked(void) {
    g_what = "peer-pull-unasked";
    peer *p = peer_open(1, 0, chance(30));
    p->pull = 1;
    const uint64_t margin = 256, l1 = 4 * CHUNK, l2 = 2 + below(8 * KiB);
    uint64_t dlen = l1 + l2;
    uint8_t *db = xmalloc((size_t)(dlen + 2 * margin)), *dst = db + margin;
    for (uint64_t q = 0; q < margin; q++)
        db[q] = dst[dlen + q] = GUARD_BYTE(q);
    rnd_bytes(dst, (size_t)dlen);
    uint8_t *dsh = xmalloc((size_t)dlen);
    memcpy(dsh, dst, (size_t)dlen);
    uint32_t did = 0;
    CHECK_EQ(kv_region_add(g_core, KV_REGION_LOCAL, 0, A(dst), dlen, 0, &did), KV_LLM_SUCCESS);
    p->nsegs = 1;
    p->sg[0].src = below(PEER_LEN - l1 + 1);
    p->sg[0].dst = 0;
    p->sg[0].len = l1;
    peer_chunks(p);
    submit_job(p, did);
    CHECK(peer_wait(p, all_seen, -1, WAIT_MS));
    /* set the first job aside (its jobrec stays put: only the later one is forgotten) */
    jobrec *j1 = p->j;
    CHECK_EQ(p->nch, 4);
    p->sg[0].src = below(PEER_LEN - l2 + 1);
    p->sg[0].dst = l1;
    p->sg[0].len = l2;
    peer_chunks(p);
    submit_job(p, did);
    jobrec *j2 = p->j;
    peer_ping(p, 0); /* no READ of it comes (the window is full) */
    CHECK_EQ(p->nseen, 0);
    /* an answer to a READ never sent: a protocol violation (nothing of it may land, or a
     * peer could write a pull's destination before it asked, or complete it unasked) */
    uint64_t part = below(l2);
    fr f = mkf(F_RDATA, 0, j2->id);
    f.length = l2;
    f.total = l2;
    uint8_t *pay = xmalloc((size_t)l2);
    rnd_bytes(pay, (size_t)l2);
    CHECK(pc_send(&p->c[0], &f, sizeof f));
    if (part)
        pc_send(&p->c[0], pay, (size_t)part); /* may find the connection closed already */
    p->bad = 1;
    p->link_failed = 1;
    wait_job(j2);
    wait_job(j1);
    CHECK_EQ(j2->status, KV_LLM_LINK_FAILED);
    CHECK_EQ(j2->nbytes, 0);
    CHECK_EQ(j2->flags, KV_DONE_UNSTARTED); /* no READ of it ever went out */
    CHECK_EQ(j1->status, KV_LLM_LINK_FAILED);
    CHECK_EQ(j1->nbytes, 0);
    CHECK_EQ(j1->flags, 0);
    pc_send(&p->c[0], pay + part, (size_t)(l2 - part));
    free(pay);
    wait_link_down(p->l);
    peer_drain_eof(p);
    if (memcmp(dst, dsh, (size_t)dlen) != 0) {
        FAILED_AT("%s", "an unasked RDATA wrote a pull's destination");
        die();
    }
    for (uint64_t q = 0; q < margin; q++)
        CHECK(db[q] == GUARD_BYTE(q) && dst[dlen + q] == GUARD_BYTE(q));
    job_forget(j2);
    p->j = j1;
    job_forget(j1);
    p->j = NULL;
    CHECK_EQ(kv_region_remove(g_core, did), KV_LLM_SUCCESS);
    free(db);
    free(dsh);
    peer_close(p);
}

/* ------------------------------------- push window and rank order, exactly */

static int views_seen(peer *p) {
    for (int v = 0; v < MAX_VIEWS; v++)
        if (p->views[v] && !all_seen(p->views[v]))
            return 0;
    return 1;
}

static int views_done(peer *p) {
    for (int v = 0; v < MAX_VIEWS; v++)
        if (p->views[v] && !p->views[v]->j->done)
            return 0;
    return 1;
}

/* Segments of a push of `len` bytes (1..3 of them; full: every chunk CHUNK bytes)
 * from a source of slen bytes. */
static void push_segs(peer *p, const uint8_t *sb, uint64_t slen, uint64_t len, int full) {
    p->src = sb;
    p->nsegs = 0;
    while (len) {
        uint64_t l = p->nsegs == 2 || chance(50) ? len : 1 + below(len);
        if (full)
            l = l < CHUNK ? CHUNK : l / CHUNK * CHUNK;
        if (l > len)
            l = len;
        pseg *g = &p->sg[p->nsegs++];
        g->len = l;
        g->src = below(slen - l + 1);
        g->dst = below(PEER_LEN - l + 1);
        len -= l;
    }
    peer_chunks(p);
}

static void push_ack(peer *p) {
    fr ack = mkf(F_ACK, 0, p->j->id);
    peer *o = p->owner ? p->owner : p;
    CHECK(pc_send(&o->c[0], &ack, sizeof ack));
}

/* A job done with every byte ACKed, and something of it started. */
static void check_pushed(peer *p) {
    CHECK_EQ(p->j->status, KV_LLM_SUCCESS);
    CHECK_EQ(p->j->nbytes, p->total);
    CHECK_EQ(p->j->flags, 0);
}

/* The jobs of views 0 and 1 (ranks 1, then 1 or 50: after it either way) of the
 * owner's job (rank 100) on a link of one stream: view 0's frames are the next
 * ones from `base` on, all together, then view 1's, all together (strict: right
 * after view 0's; else some of the owner's may come between if view 1 joined
 * the queue once view 0's were all under way). Returns the place of the last. */
static uint64_t check_overtook(peer *p, uint64_t base, int strict) {
    peer *a = p->views[0], *b = p->views[1];
    for (int k = 0; k < a->nch; k++)
        CHECK_EQ(a->ch[k].seq, base + (uint64_t)k);
    uint64_t last = base + (uint64_t)a->nch - 1;
    if (b) {
        uint64_t b0 = b->ch[0].seq;
        CHECK(b0 > last);
        if (strict)
            CHECK_EQ(b0, last + 1);
        for (int k = 0; k < b->nch; k++)
            CHECK_EQ(b->ch[k].seq, b0 + (uint64_t)k);
        last = b0 + (uint64_t)b->nch - 1;
    }
    if (strict) /* none of the owner's among them */
        for (int k = 0; k < p->nch; k++)
            CHECK(!p->ch[k].seen || p->ch[k].seq < base || p->ch[k].seq > last);
    return last;
}

/* Views 0 and 1 of p: small pushes of ranks 1, and 1 or 50. */
static void submit_small_views(peer *p, const uint8_t *sb, uint64_t slen, uint32_t sid) {
    peer *a = peer_view(p, 0);
    push_segs(a, sb, slen, 1 + below(2 * CHUNK), 0);
    submit_job_ranked(a, sid, 1);
    if (chance(60)) {
        peer *b = peer_view(p, 1);
        push_segs(b, sb, slen, 1 + below(CHUNK), 0);
        submit_job_ranked(b, sid, chance(50) ? 1 : 50);
    }
}

/* ACK the views' jobs: they complete while the owner's job (never ACKed yet) goes on. */
static void finish_views(peer *p) {
    for (int v = 0; v < MAX_VIEWS; v++)
        if (p->views[v])
            push_ack(p->views[v]);
    CHECK(peer_wait(p, views_done, -1, WAIT_MS));
    CHECK(!p->j->done);
    for (int v = 0; v < MAX_VIEWS; v++) {
        peer *q = p->views[v];
        if (!q)
            continue;
        check_pushed(q);
        job_forget(q->j);
        p->views[v] = NULL;
        free(q);
    }
}

/* A pull (rank 200) on p's link, answered: its READs go out even behind a push
 * held back by a full window. */
static void pull_through(peer *p) {
    uint64_t len = 1 + below(3 * CHUNK); /* within one READ window */
    uint8_t *d = xmalloc((size_t)len);
    memset(d, 0, (size_t)len);
    uint32_t did = 0;
    CHECK_EQ(kv_region_add(g_core, KV_REGION_LOCAL, 0, A(d), len, 0, &did), KV_LLM_SUCCESS);
    peer *q = peer_view(p, 0);
    q->pull = 1;
    q->nsegs = 1;
    q->sg[0].src = below(PEER_LEN - len + 1);
    q->sg[0].dst = 0;
    q->sg[0].len = len;
    peer_chunks(q);
    submit_job_ranked(q, did, 200);
    CHECK(peer_wait(p, views_seen, -1, WAIT_MS));
    for (int k = 0; k < q->nch; k++) {
        pchunk *t = &q->ch[k];
        fr f = mkf(F_RDATA, 0, q->j->id);
        f.offset = t->off;
        f.length = t->len;
        f.total = q->total;
        uint8_t *b = xmalloc((size_t)(sizeof f + t->len));
        memcpy(b, &f, sizeof f);
        for (uint64_t i = 0; i < t->len; i++)
            b[sizeof f + i] = content(q->j->id, 0, t->off + i);
        CHECK(pc_send(&p->c[0], b, (size_t)(sizeof f + t->len)));
        free(b);
    }
    CHECK(peer_wait(p, views_done, -1, WAIT_MS));
    CHECK_EQ(q->j->status, KV_LLM_SUCCESS);
    CHECK_EQ(q->j->nbytes, len);
    CHECK_EQ(q->j->flags, 0);
    for (uint64_t i = 0; i < len; i++)
        CHECK(d[i] == content(q->j->id, 0, i));
    p->rx_sure += len;
    job_forget(q->j);
    p->views[0] = NULL;
    free(q);
    CHECK_EQ(kv_region_remove(g_core, did), KV_LLM_SUCCESS);
    free(d);
}

static void peer_next_job(peer *p) {
    job_forget(p->j);
    p->j = NULL;
    p->aborted = 0;
    memset(p->aborts, 0, sizeof p->aborts);
    memset(p->acked, 0, sizeof p->acked);
}

/* The rest of a push the peer takes honestly: every frame, the ACK, the completion, the bytes. */
static void push_to_end(peer *p) {
    CHECK(peer_wait(p, all_seen, -1, WAIT_MS));
    push_ack(p);
    CHECK(peer_wait(p, job_done, -1, WAIT_MS));
    check_pushed(p);
}

/* End of a window/rank session: the source region, its buffer, the link. */
static void sess_close(peer *p, uint32_t sid, uint8_t *sb) {
    CHECK_EQ(kv_region_remove(g_core, sid), KV_LLM_SUCCESS);
    free(sb);
    peer_close(p);
}

/* The push window on one stream, where the core's frames arrive in the order it
 * claims them, so that our count of unCREDITed bytes is exactly the core's:
 *  1. a big push (rank 100) runs into the window: exactly the frames started
 *     while less than the window was unCREDITed come, then nothing (a ping);
 *  2. one or two small pushes (rank 1, then 1 or 50) join the send queue; once
 *     CREDITed (honestly or in excess), their frames go out first, all of them
 *     before the big push's next; ACKed, they complete while it goes on;
 *  3. the big push is either CREDITed to the end and ACKed, or stalled again
 *     and aborted: ABORT, ABORT_ACK, CANCELLED (the fence needs no CREDIT);
 *  4. if the window is full, a push can start nothing, while a pull queued
 *     behind it goes through; aborted, the push completes at once with
 *     KV_DONE_UNSTARTED, no ABORT on the wire;
 *  5. everything CREDITed (perhaps in excess: clamped at zero), a last push
 *     goes through. */
static void sess_window(void) {
    g_what = "peer-window";
    uint64_t win = (2 + below(2)) * CHUNK - (chance(50) ? below(CHUNK) : 0);
    peer *p = peer_open2(1, 0, chance(30), win, 0);
    uint64_t slen = 32 * CHUNK;
    uint32_t sid = 0;
    uint8_t *sb = src_region(slen, &sid);

    /* 1 */
    push_segs(p, sb, slen, (8 + below(17)) * CHUNK, 1);
    p->credit = 2;
    submit_job_ranked(p, sid, 100);
    CHECK(peer_wait(p, win_stalled, -1, WAIT_MS));
    int at_stall = p->nseen;
    CHECK_EQ(at_stall, (win + CHUNK - 1) / CHUNK);
    CHECK(!all_seen(p));
    peer_ping(p, 0);
    CHECK_EQ(p->nseen, at_stall);

    /* 2 */
    submit_small_views(p, sb, slen, sid);
    peer_ping(p, 0); /* they are in the send queue (taken before the ping is read) */
    CHECK_EQ(p->views[0]->nseen, 0);
    uint64_t base = p->nframes, un = p->rcvd - p->cred;
    CHECK(un >= win);
    uint64_t n = chance(30) ? MAX_FRAME : un - win + 1 + below(win); /* room for one frame at least */
    p->cred = n > un ? p->rcvd : p->cred + n;
    credit_send(p, 0, n);
    p->credit = 1;
    CHECK(peer_wait(p, views_seen, -1, WAIT_MS));
    check_overtook(p, base, 1);
    finish_views(p);

    /* 3 */
    int abort = chance(50);
    if (abort) {
        p->credit = 2;
        CHECK(peer_wait(p, win_stalled, -1, WAIT_MS));
        abort = !all_seen(p);
    }
    if (!abort) {
        p->credit = 1;
        push_to_end(p);
    } else {
        CHECK_EQ(kv_core_abort(g_core, p->j->id, KV_LLM_CANCELLED), KV_LLM_SUCCESS);
        p->aborted = 1;
        CHECK(peer_wait(p, push_abort_progress, -1, WAIT_MS));
        CHECK(p->aborts[0]);
        CHECK_EQ(p->j->status, KV_LLM_CANCELLED);
        CHECK_EQ(p->j->nbytes, 0);
        CHECK_EQ(p->j->flags, 0);
    }
    peer_next_job(p);

    /* 4 */
    if (p->rcvd - p->cred >= win) {
        p->credit = 2;
        push_segs(p, sb, slen, 1 + below(2 * CHUNK), 0);
        submit_job(p, sid);
        if (chance(70))
            pull_through(p);
        peer_ping(p, 0); /* in the send queue, and stuck there */
        CHECK_EQ(kv_core_abort(g_core, p->j->id, KV_LLM_TIMEOUT), KV_LLM_SUCCESS);
        p->aborted = 1;
        CHECK(peer_wait(p, job_done, -1, WAIT_MS));
        CHECK_EQ(p->j->status, KV_LLM_TIMEOUT);
        CHECK_EQ(p->j->nbytes, 0);
        CHECK_EQ(p->j->flags, KV_DONE_UNSTARTED);
        peer_ping(p, 0);
        CHECK_EQ(p->nseen, 0);
        CHECK(!p->aborts[0]);
        peer_next_job(p);
    }

    /* 5: nothing is under way, so our count is the core's and any excess is clamped;
     * the ping makes the core apply the CREDIT before the next push can claim a frame
     * (an excess CREDIT read after that would also cancel the new frames: the window
     * only bounds honest receivers) */
    un = p->rcvd - p->cred;
    if (un || chance(50)) {
        n = chance(50) && un ? un : un + 1 + below(MAX_FRAME - un);
        p->cred = p->rcvd;
        credit_send(p, 0, n);
        peer_ping(p, 0);
    }
    p->credit = 1;
    push_segs(p, sb, slen, 1 + below(4 * CHUNK), 0);
    submit_job(p, sid);
    push_to_end(p);
    peer_next_job(p);
    sess_close(p, sid, sb);
}

/* Rank order without a window: the core's end of the one stream (a client
 * stream) has a small send buffer and we read nothing, so a big push (rank 100,
 * 64 chunks) is only a few frames ahead when one or two small ones are
 * submitted (rank 1, then 1 or 50). Their frames come next, each job's
 * together, long before the big push's last; ACKed, they complete while it goes
 * on. */
static void sess_rank(void) {
    g_what = "peer-rank";
    peer *p = peer_open2(1, 0, 1, 0, 1);
    p->credit = chance(50);
    uint64_t slen = 64 * CHUNK;
    uint32_t sid = 0;
    uint8_t *sb = src_region(slen, &sid);
    p->src = sb;
    p->nsegs = 1;
    p->sg[0].len = slen - below(CHUNK);
    p->sg[0].src = 0;
    p->sg[0].dst = below(PEER_LEN - p->sg[0].len + 1);
    peer_chunks(p);
    submit_job_ranked(p, sid, 100);
    struct pollfd pf = {p->c[0].fd, POLLIN, 0}; /* it is under way (and soon blocked) */
    CHECK_EQ(poll(&pf, 1, WAIT_MS), 1);
    submit_small_views(p, sb, slen, sid);
    CHECK(peer_wait(p, views_seen, -1, WAIT_MS));
    uint64_t base = p->views[0]->ch[0].seq, last = check_overtook(p, base, 0);
    uint64_t ahead = last + 1 - (uint64_t)p->views[0]->nch - (p->views[1] ? (uint64_t)p->views[1]->nch : 0);
    g_rank_ahead = ahead > g_rank_ahead ? ahead : g_rank_ahead;
    /* frames of the big push before the small ones': a few at most (the buffers) */
    CHECK(ahead + 16 <= (uint64_t)p->nch);
    sndbuf_restore(p, 0);
    finish_views(p);
    push_to_end(p);
    peer_next_job(p);
    sess_close(p, sid, sb);
}

/* ------------------------------------------- per-link limits, once a run */

#define MAX_RX 65536     /* open incoming transfers per link (kv_tcp.c KV_MAX_RX) */
#define MAX_SERVE 4096   /* queued READs per stream (KV_MAX_SERVE) */
#define SCRATCH (1u << 20) /* discarded payloads go through a scratch buffer this big */

static void sess_limits(void) {
    /* 1. MAX_RX transfers left open on a link, then one more (a DATA or an ABORT).
     * Two streams: some transfers opened by a DATA frame on stream 0 (1 byte of
     * 2: CREDITed, and open), the others by an ABORT on stream 1 (one of two
     * streams: the aborted transfer stays). Stream 1 is not read (a small receive
     * buffer): the core queues its ABORT_ACKs, and takes the one more after them.
     * (Every DATA frame and ABORT is answered, one sendmsg per control frame,
     * and a DATA frame's CREDIT ends the core's read round: 65536 DATA frames
     * read and answered one by one would add about a second under ASan.) */
    g_what = "limits-rx";
    msess *s = sess_new(NULL, 2);
    sess_connect(s, 1);
    mconn *k = &s->k[0], *k1 = &s->k[s->nk++];
    pc_open(&k1->pc, 4096);
    CHECK(hello_send(&k1->pc, s->l->tok, 0));
    expect_hello_ack(&k1->pc);
    s->nconns++;
    uint32_t nd = 1024 + (uint32_t)below(2048);
    size_t per = sizeof(fr) + 1, nb = (size_t)nd * per;
    uint8_t *b = xmalloc(nb);
    for (uint32_t i = 0; i < nd; i++) {
        fr f = mkf(F_DATA, 0, 0x4000000000ull + i);
        f.region = g_exp_id;
        f.offset = (i * 7919u) % EXP_LEN;
        f.length = 1;
        f.total = 2; /* stays open */
        memcpy(b + i * per, &f, sizeof f);
        b[i * per + sizeof f] = (uint8_t)rnd();
        g_shadow[f.offset] = b[i * per + sizeof f];
    }
    CHECK(pc_send(&k->pc, b, nb));
    free(b);
    s->rx_all += nd; /* (the model keeps no table this big: the shadow was updated above) */
    for (uint32_t i = 0; i < nd; i++) { /* one CREDIT per DATA frame, in order */
        fr h, want = mkf(F_CREDIT, 0, 0x4000000000ull + i);
        want.length = 1;
        CHECK_EQ(pc_frame(&k->pc, &h), 1);
        if (!fr_eq(&h, &want)) {
            fr_print("got", &h);
            fr_print("want", &want);
            CHECK(fr_eq(&h, &want));
        }
    }
    m_sync(s, k);
    check_exp_exact();
    uint32_t na = MAX_RX - nd;
    fr *ab = xmalloc(((size_t)na + 1) * sizeof *ab);
    for (uint32_t i = 0; i < na; i++)
        ab[i] = mkf(F_ABORT, 0, 0x4100000000ull + i);
    fr *f = &ab[na];
    *f = chance(50) ? mkf(F_ABORT, 0, 0x5000000000ull) : mkf(F_DATA, 0, 0x5000000000ull);
    f->region = g_exp_id;
    f->length = f->total = 1;
    { /* without reading meanwhile (pc_send would) */
        const uint8_t *q = (const uint8_t *)ab;
        size_t left = ((size_t)na + 1) * sizeof *ab;
        double end = now_ms() + WAIT_MS;
        while (left) {
            ssize_t w = send(k1->pc.fd, q, left, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w > 0) {
                q += w;
                left -= (size_t)w;
            } else {
                CHECK(w < 0 && (errno == EAGAIN || errno == EINTR)); /* the core reads all of it */
                struct pollfd pf = {k1->pc.fd, POLLOUT, 0};
                CHECK(now_ms() < end);
                poll(&pf, 1, 10);
            }
        }
    }
    free(ab);
    s->dead = s->bad = 1; /* no room for the last one: a bad frame */
    pc_wait_eof(&k->pc, m_on_frame_cb, s);
    {
        fr h;
        uint32_t acks = 0;
        while (pc_frame(&k1->pc, &h) == 1) { /* the ABORT_ACKs that went out: in order */
            fr want = mkf(F_ABORT_ACK, 0, 0x4100000000ull + acks++);
            CHECK(fr_eq(&h, &want));
        }
        CHECK(acks <= na);
    }
    sess_finish(s, 1);

    /* 2. READs nobody reads the answers of: at most MAX_SERVE queue, then the link fails */
    g_what = "limits-serve";
    s = sess_new(NULL, 1);
    k = &s->k[0];
    s->nk = 1;
    pc_open(&k->pc, 4096);
    CHECK(hello_send(&k->pc, s->l->tok, 0));
    expect_hello_ack(&k->pc);
    s->l->bound = 1;
    size_t nr = MAX_SERVE + 1024;
    fr *rd = xmalloc(nr * sizeof *rd);
    for (size_t i = 0; i < nr; i++) {
        rd[i] = mkf(F_READ, 0, 0x6100000000ull + i);
        rd[i].region = g_exp_id;
        rd[i].length = rd[i].total = EXP_LEN;
    }
    { /* without reading meanwhile (pc_send would, and let answers drain) */
        const uint8_t *q = (const uint8_t *)rd;
        size_t left = nr * sizeof *rd;
        double end = now_ms() + WAIT_MS;
        while (left) {
            ssize_t w = send(k->pc.fd, q, left, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w > 0) {
                q += w;
                left -= (size_t)w;
            } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
                struct pollfd pf = {k->pc.fd, POLLOUT, 0};
                CHECK(now_ms() < end);
                poll(&pf, 1, 10);
            } else {
                break; /* the core closed it */
            }
        }
    }
    free(rd);
    fr h;
    uint64_t answers = 0;
    while (pc_frame(&k->pc, &h) == 1) { /* the answers that did go out are the exported bytes */
        CHECK(h.type == F_RDATA && h.length == EXP_LEN && memcmp(k->pc.pay, g_shadow, EXP_LEN) == 0);
        answers++;
    }
    CHECK(answers < nr - MAX_SERVE); /* it failed before taking them all */
    s->dead = s->bad = 1;
    sess_finish(s, 1);

    /* 3. pings nobody reads the answers of: the control queue (grown, wrapped)
     * holds at most 65536, then the link fails */
    g_what = "limits-ctrl";
    s = sess_new(NULL, 1);
    k = &s->k[0];
    s->nk = 1;
    pc_open(&k->pc, 4096);
    CHECK(hello_send(&k->pc, s->l->tok, 0));
    expect_hello_ack(&k->pc);
    s->l->bound = 1;
    {
        enum { BATCH = 4096 };
        fr *pg = xmalloc(BATCH * sizeof *pg);
        uint64_t first = g_ping, sent_frames = 0;
        int open = 1;
        double end = now_ms() + 4 * WAIT_MS;
        while (open && sent_frames < 64 * BATCH * 8) { /* 2 Mi frames: far past any buffering */
            for (int i = 0; i < BATCH; i++)
                pg[i] = mkf(F_ABORT, F_PULL, g_ping++);
            const uint8_t *q = (const uint8_t *)pg;
            size_t left = BATCH * sizeof *pg;
            while (left && open) {
                ssize_t w = send(k->pc.fd, q, left, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (w > 0) {
                    q += w;
                    left -= (size_t)w;
                } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
                    struct pollfd pf = {k->pc.fd, POLLOUT, 0};
                    CHECK(now_ms() < end);
                    poll(&pf, 1, 10);
                } else {
                    open = 0; /* the core closed it */
                }
            }
            sent_frames += BATCH;
        }
        free(pg);
        CHECK(!open);
        fr h;
        uint64_t next = first;
        while (pc_frame(&k->pc, &h) == 1) { /* the answers that went out: in order */
            fr want = mkf(F_ABORT_ACK, F_PULL, next++);
            CHECK(fr_eq(&h, &want));
        }
        CHECK(next - first < sent_frames);
    }
    s->dead = s->bad = 1;
    sess_finish(s, 1);

    /* 4. a discarded payload bigger than the scratch buffer, on a 2 MiB exported region */
    g_what = "limits-scratch";
    uint64_t bl = 2 * SCRATCH;
    uint8_t *big = xmalloc((size_t)bl);
    rnd_bytes(big, (size_t)bl);
    uint32_t bid = 0;
    CHECK_EQ(kv_region_add(g_core, KV_REGION_LOCAL, 0, A(big), bl, KV_REGION_F_EXPORT, &bid), KV_LLM_SUCCESS);
    s = sess_new(NULL, 2);
    s->x_id = bid;
    s->x_base = big;
    s->x_shadow = xmalloc((size_t)bl);
    memcpy(s->x_shadow, big, (size_t)bl);
    s->x_len = bl;
    s->x_live = 1;
    sess_connect(s, 1);
    sess_connect(s, 1);
    uint64_t x = 0x6200000000ull;
    fr a = mkf(F_ABORT, 0, x);
    send_frame(s, &s->k[1], &a, 0, 0); /* one of two ABORTs: the transfer is aborted, not forgotten */
    m_sync(s, &s->k[1]);
    for (int round = 0; round < 2; round++) { /* discarded, then (a new transfer) landing */
        fr d = mkf(F_DATA, 0, round ? x + 1 : x);
        d.region = bid;
        d.length = d.total = SCRATCH + SCRATCH / 2 + below(SCRATCH / 2);
        d.offset = below(bl - d.length + 1);
        CHECK(send_frame(s, &s->k[0], &d, 0, 0));
        CHECK_EQ(s->k[0].pay_discard, round == 0);
        m_sync(s, &s->k[0]);
        CHECK(memcmp(big, s->x_shadow, (size_t)bl) == 0);
    }
    CHECK(shutdown(s->k[0].pc.fd, SHUT_WR) == 0);
    for (int c = 0; c < 2; c++)
        pc_wait_eof(&s->k[c].pc, m_on_frame_cb, s);
    free(s->x_shadow);
    sess_finish(s, 1);
    CHECK_EQ(kv_region_remove(g_core, bid), KV_LLM_SUCCESS); /* no frame holds it: released now */
    free(big);
}

/* ------------------------------------------- the lease: the core as receiver */

/* Wait (reading nothing) until our clock passes t (ns). */
static void wait_until_ns(uint64_t t) {
    while (ns_now() <= t)
        sleep_us(1000);
}

/* The core writes our DATA into place only under a lease we granted (a LEASE
 * echoing the offset of a LEASE_REQ: its clock, so a stale grant gives a stale
 * lease). Variants:
 *  0  granted, DATA lands; the lease runs out (we answer no renewal): the next
 *     DATA fails the link (tcp_lease_expired), nothing of it written;
 *  1  the same with a payload under way: its first part lands while the lease
 *     holds, the rest (sent once it is over) is never written;
 *  2  a stale LEASE (offset more than a lease ago): no lease, DATA fails the link;
 *  3  a LEASE from the future (offset after now): a bad frame;
 *  4  the core asks again every lease/4 (we count its LEASE_REQs, offsets
 *     increasing, never ahead of our clock); answering one of them (an echo) is
 *     a lease: DATA lands. */
static void sess_lease_recv(void) {
    g_what = "lease-recv";
    int v = (int)below(5);
    uint64_t L = (v == 4 ? 400 : 500) * MS;
    msess *s = sess_new(link_new_lw(1, 0, L, SRV_FENCE, MARGIN), 1);
    sess_connect_g(s, 1, v <= 1);
    mconn *k = &s->k[0];
    fr f;
    if (v <= 1) {
        f = gen_data(s);
        CHECK(send_frame(s, k, &f, 0, 0));
        m_sync(s, k);
        CHECK(!s->dead);
        check_exp_exact();
        f = mkf(F_DATA, 0, g_xfer++ * 0x10001ull); /* a new transfer: valid but for the lease */
        f.region = g_exp_id;
        f.length = f.total = 2 + below(EXP_LEN - 1);
        f.offset = below(EXP_LEN - f.length + 1);
        if (v == 0) {
            wait_until_ns(k->lease_until + MS);
            send_frame(s, k, &f, 0, 0); /* (the model sends no payload: the header ends it) */
            CHECK(s->dead && s->lease_failed);
        } else {
            m_sync(s, k); /* for send_partial_landed */
            CHECK(m_header(s, k, &f) == f.length);
            CHECK(pc_send(&k->pc, &f, sizeof f));
            send_partial_landed(s, k, 1 + below(f.length - 1));
            wait_until_ns(k->lease_until + MS);
            s->dead = s->lease_failed = 1; /* the rest is not written (the model: not applied) */
            uint64_t rest = k->pay_len - k->pay_done;
            uint8_t *p = gen_payload(rest);
            pc_send(&k->pc, p, (size_t)rest); /* the core may have closed it */
            free(p);
        }
    } else if (v == 2 || v == 3) {
        uint64_t t = ns_now();
        CHECK(lease_send(s, k, v == 2 ? t - L - MS - below(t - L - MS) : t + 2000 * MS + below(1ull << 50)));
        CHECK_EQ(s->dead, v == 3);
        if (v == 2) {
            f = mkf(F_DATA, 0, g_xfer++ * 0x10001ull);
            f.region = g_exp_id;
            f.length = f.total = 1 + below(EXP_LEN);
            f.offset = below(EXP_LEN - f.length + 1);
            send_frame(s, k, &f, 0, 0);
            CHECK(s->dead && s->lease_failed);
        }
    } else {
        double end = now_ms() + 350;
        while (now_ms() < end) { /* only LEASE_REQs come: counted, checked (pc_frame_t) */
            fr h;
            CHECK_EQ(pc_frame_t(&k->pc, &h, (int)(end - now_ms()) + 1, 1), -1);
        }
        CHECK(k->pc.nreq >= 3);
        CHECK(lease_send(s, k, k->pc.req_last));
        CHECK(k->lease_until > ns_now()); /* an echo of a recent request: a lease for a while */
        f = gen_data(s);
        CHECK(send_frame(s, k, &f, 0, 0));
        m_sync(s, k);
        CHECK(!s->dead);
        check_exp_exact();
        CHECK(shutdown(k->pc.fd, SHUT_WR) == 0);
    }
    pc_wait_eof(&k->pc, m_on_frame_cb, s);
    sess_finish(s, 1);
}

/* ------------------------------------------- the lease: the core as pusher */

static int first_seen(peer *p) { return p->nseen > 0; }

/* Streams closed with kv_tcp_link_close (no LINK_DOWN): the end of the session. */
static void peer_end_closed(peer *p) {
    for (int i = 0; i < p->nc; i++) {
        fr h;
        while (p->c[i].fd >= 0 && pc_frame(&p->c[i], &h) == 1)
            peer_on_frame(p, i, &h);
        pc_close(&p->c[i], 0);
    }
    CHECK_EQ(kv_region_remove(g_core, p->tid), KV_LLM_SUCCESS);
    check_stats();
    pump_events(0);
    CHECK(!p->l->down);
    e_rx_lo = e_rx_hi = stats().tcp_bytes_received;
    check_canaries();
    free(p);
}

/* A push the receiver does not fence completes only once the receiver's lease
 * is over: at (last grant) + lease + margin, never before (the receiver's own
 * clock ran the lease from its request, sent before our grant). Variants:
 *  0  aborted; no ABORT_ACK ever comes: at abort + fence the link fails
 *     (tcp_fence_expired), the push completes LINK_FAILED at the release;
 *  1  the link fails (a stream reset) while the push is under way: the same;
 *  2  kv_tcp_link_close(status): the push completes with that status at the
 *     release, no LINK_DOWN;
 *  3  no lease asked for: the core sends no DATA; once it granted one, it does. */
static void sess_lease_push(void) {
    g_what = "lease-push";
    int v = (int)below(4);
    uint64_t F = (40 + below(60)) * MS, L = F + (60 + below(100)) * MS, M = (5 + below(20)) * MS;
    peer *p = peer_open3(1 + (int)below(2), 0, chance(30), 0, 0, L, F, M, v != 3);
    uint64_t slen = 16 * CHUNK;
    uint32_t sid = 0;
    uint8_t *sb = src_region(slen, &sid);
    p->src = sb;
    p->nsegs = 1;
    p->sg[0].len = (4 + below(12)) * CHUNK - below(CHUNK);
    p->sg[0].src = below(slen - p->sg[0].len + 1);
    p->sg[0].dst = below(PEER_LEN - p->sg[0].len + 1);
    peer_chunks(p);
    if (v == 3) {
        submit_job(p, sid);
        for (int i = 0; i < p->nc; i++)
            peer_ping(p, i); /* the job is queued by now (the ping came after it) */
        CHECK_EQ(p->nseen, 0);
        CHECK(!p->j->done);
        for (int i = 0; i < p->nc; i++)
            peer_lease_req(p, i);
        CHECK(peer_wait(p, all_seen, -1, WAIT_MS));
        push_ack(p);
        CHECK(peer_wait(p, job_done, -1, WAIT_MS));
        check_pushed(p);
        peer_next_job(p);
        CHECK_EQ(kv_region_remove(g_core, sid), KV_LLM_SUCCESS);
        free(sb);
        peer_close(p);
        return;
    }
    CHECK(peer_wait(p, leases_answered, -1, WAIT_MS));
    submit_job(p, sid);
    CHECK(peer_wait(p, first_seen, -1, WAIT_MS));
    if (chance(50)) { /* a renewal: the release moves with the last grant */
        for (int i = 0; i < p->nc; i++)
            peer_lease_req(p, i);
        CHECK(peer_wait(p, leases_answered, -1, WAIT_MS));
    }
    uint64_t last = 0; /* our last request answered: the core granted it after we sent it */
    for (int i = 0; i < p->nc; i++)
        last = p->lreq_last[i] > last ? p->lreq_last[i] : last;
    double release_ms = (double)(last + L + M) / 1e6, t_fail = now_ms();
    uint32_t want = KV_LLM_LINK_FAILED;
    p->link_failed = 1;
    if (v == 0) {
        CHECK_EQ(kv_core_abort(g_core, p->j->id, KV_LLM_TIMEOUT), KV_LLM_SUCCESS);
        p->aborted = 1;
        t_fail = now_ms();
        e_fence++;
        CHECK(peer_wait(p, job_done, -1, WAIT_MS)); /* reading (the ABORTs too), never answering */
        CHECK(p->l->down);
        CHECK(p->l->down_ms >= t_fail + (double)F / 1e6); /* the fence */
    } else if (v == 1) {
        pc_close(&p->c[below((uint64_t)p->nc)], 1);
        wait_job(p->j);
        CHECK(p->l->down);
    } else {
        want = chance(50) ? KV_LLM_CANCELLED : KV_LLM_LINK_FAILED;
        CHECK_EQ(kv_tcp_link_close(g_core, p->l->id, want), KV_LLM_SUCCESS);
        p->l->closed = 1;
        wait_job(p->j);
    }
    /* never before the release; then promptly (a generous bound: a noisy machine) */
    if (p->j->done_ms < release_ms) {
        FAILED_AT("an unfenced push completed %.1f ms before the receiver's lease ended", release_ms - p->j->done_ms);
        die();
    }
    double t_due = release_ms > t_fail + (double)F / 1e6 ? release_ms : t_fail + (double)F / 1e6;
    CHECK(p->j->done_ms < t_due + 2000);
    CHECK_EQ(p->j->status, want);
    CHECK_EQ(p->j->nbytes, 0);
    CHECK_EQ(p->j->flags, 0);
    g_lease_waits++;
    peer_drain_eof(p); /* the streams were reset: frames sent before may still be read */
    CHECK_EQ(kv_region_remove(g_core, sid), KV_LLM_SUCCESS);
    free(sb);
    p->src = NULL;
    job_forget(p->j);
    p->j = NULL;
    if (v == 2)
        peer_end_closed(p);
    else
        peer_close(p);
}

/* ---------------------- answers naming a job before it could exist, or never */

/* The core must not take an answer for a job it has no frame of on the wire
 * (a pull whose READ has not gone out, a push not aborted), nor one naming no
 * job at all: the link fails (a bad frame). A flood of CREDITs (64 bytes each,
 * read one by one) keeps the I/O thread reading while the job is submitted,
 * so the answer is often read while the job is still in the I/O thread's
 * inbox (the window of a use-after-free: a job completed there and freed
 * while still listed). Variants: 0 RERR (pull), 1 RDATA answering its chunk
 * (pull), 2 ABORT_ACK (push), 3 ABORT_ACK (pull flag, pull), 4 ACK / ABORT_ACK /
 * RERR / RDATA naming no job. An answer read after the READ went out is valid
 * (0: the pull fails with its status; 1: the bytes land). */
static void sess_premature(void) {
    g_what = "premature";
    int v = (int)below(5);
    peer *p = peer_open(1, 0, chance(30));
    if (v == 4) {
        static const uint16_t t[] = {F_ACK, F_ABORT_ACK, F_RERR, F_RDATA};
        fr f = mkf(t[below(4)], (uint16_t)below(2), 0x6600000000000000ull + below(1000));
        f.length = f.type == F_RDATA ? 1 + below(64) : below(64);
        f.status = (uint32_t)rnd();
        CHECK(pc_send(&p->c[0], &f, sizeof f));
        p->bad = 1;
        p->link_failed = 1;
        wait_link_down(p->l);
        peer_drain_eof(p);
        peer_close(p);
        return;
    }
    p->pull = v != 2;
    uint64_t len = 1 + below(CHUNK), dlen = len + 64;
    uint8_t *buf = xmalloc((size_t)dlen);
    rnd_bytes(buf, (size_t)dlen);
    uint8_t *orig = xmalloc((size_t)dlen);
    memcpy(orig, buf, (size_t)dlen);
    uint32_t rid = 0;
    CHECK_EQ(kv_region_add(g_core, KV_REGION_LOCAL, 0, A(buf), dlen, 0, &rid), KV_LLM_SUCCESS);
    p->src = buf;
    p->nsegs = 1;
    p->sg[0].len = len;
    p->sg[0].src = p->pull ? below(PEER_LEN - len + 1) : below(dlen - len + 1);
    p->sg[0].dst = p->pull ? below(dlen - len + 1) : below(PEER_LEN - len + 1);
    peer_chunks(p);
    enum { NCR1 = 40000, NCR = 16 }; /* as many as the socket buffers take at once; then a few */
    size_t n1 = NCR1 * sizeof(fr), n2 = NCR * sizeof(fr) + sizeof(fr) + (size_t)len;
    uint8_t *b1 = xmalloc(n1), *b2 = xmalloc(n2);
    for (int q = 0; q < NCR1 + NCR; q++) {
        fr c = mkf(F_CREDIT, 0, rnd());
        memcpy(q < NCR1 ? b1 + (size_t)q * sizeof c : b2 + (size_t)(q - NCR1) * sizeof c, &c, sizeof c);
    }
    p->j = job_new(); /* its id is known before it exists */
    fr x = mkf(v == 0 ? F_RERR : v == 1 ? F_RDATA : F_ABORT_ACK, v == 3 ? F_PULL : 0, p->j->id);
    x.status = v == 0 ? (uint32_t)(1 + below(UINT32_MAX)) : 0;
    x.length = v == 1 ? len : 0;
    x.total = len;
    memcpy(b2 + NCR * sizeof(fr), &x, sizeof x);
    for (uint64_t q = 0; q < len; q++)
        b2[(NCR + 1) * sizeof(fr) + q] = content(p->j->id, 0, q);
    /* fill the socket buffers without waiting: the core has a backlog of CREDITs to read (one
     * recv each) when the job is submitted, and more follow right after, then the answer */
    size_t sent1 = 0;
    while (sent1 < n1) {
        ssize_t w = send(p->c[0].fd, b1 + sent1, n1 - sent1, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w <= 0)
            break;
        sent1 += (size_t)w;
    }
    {   /* submit_job, with the jobrec made above */
        uint64_t w[KV_SEG_WORDS] = {p->pull ? p->tid : rid, p->sg[0].src, p->pull ? rid : p->tid, p->sg[0].dst, len};
        int done = -1;
        uint64_t nb = 0;
        CHECK_EQ(kv_core_submit(g_core, p->j->id, w, 1, 1ull << 40, &done, &nb), KV_LLM_SUCCESS);
        CHECK_EQ(done, 0);
    }
    p->late_ok = 1; /* frames sent before the completion may be read after it */
    pc_send(&p->c[0], b2, n2 - (v == 1 ? 0 : (size_t)len)); /* the core may close it on the way */
    free(b1);
    free(b2);
    wait_job(p->j);
    pump_events(20);
    int failed = p->l->down || v >= 2;
    if (failed) {
        wait_link_down(p->l);
        p->bad = 1;
        p->link_failed = 1;
        g_premature_bad++;
        CHECK_EQ(p->j->status, KV_LLM_LINK_FAILED);
        CHECK_EQ(p->j->nbytes, 0);
        peer_drain_eof(p);
        if (p->pull)
            CHECK(memcmp(buf, orig, (size_t)dlen) == 0);
    } else { /* the READ had gone out: a valid answer */
        CHECK(peer_wait(p, all_seen, -1, WAIT_MS));
        if (v == 0) {
            CHECK_EQ(p->j->status, x.status);
            CHECK_EQ(p->j->nbytes, 0);
            CHECK(peer_wait(p, aborts_all, -1, WAIT_MS)); /* the pull's ABORT; our ABORT_ACK ends the tombstone */
            fr a = mkf(F_ABORT_ACK, F_PULL, p->j->id);
            CHECK(pc_send(&p->c[0], &a, sizeof a));
            peer_ping(p, 0);
            CHECK(memcmp(buf, orig, (size_t)dlen) == 0);
        } else {
            CHECK_EQ(p->j->status, KV_LLM_SUCCESS);
            CHECK_EQ(p->j->nbytes, len);
            for (uint64_t q = 0; q < len; q++)
                CHECK(buf[p->sg[0].dst + q] == content(p->j->id, 0, q));
            p->rx_sure += len;
        }
    }
    CHECK_EQ(kv_region_remove(g_core, rid), KV_LLM_SUCCESS);
    free(buf);
    free(orig);
    p->src = NULL;
    p->late_ok = 1;
    job_forget(p->j);
    p->j = NULL;
    peer_close(p);
}

/* ---------------------------------- the idle bound: a peer pinning a region */

/* On a link with a short fence F, a DATA payload left unfinished, or READ
 * answers left unread (a small receive buffer), for 2 F fails the link
 * (tcp_stalled): the frame's region reference goes (a notifying region removed
 * meanwhile is freed), nothing more is written. Before that, the link holds. */
static void sess_stall(void) {
    g_what = "stall";
    int v = (int)below(2);
    uint64_t F = (30 + below(40)) * MS;
    uint64_t xl = 64 * KiB;
    uint8_t *buf = xmalloc((size_t)xl);
    rnd_bytes(buf, (size_t)xl);
    uint32_t xid = 0;
    CHECK_EQ(kv_region_add(g_core, KV_REGION_LOCAL, 0, A(buf), xl, KV_REGION_F_EXPORT | KV_REGION_F_NOTIFY, &xid),
             KV_LLM_SUCCESS);
    CHECK(xid < MAX_REGIONS);
    msess *s = sess_new(link_new_lw(1, 0, SRV_LEASE, F, MARGIN), 1);
    s->x_id = xid;
    s->x_base = buf;
    s->x_shadow = xmalloc((size_t)xl);
    memcpy(s->x_shadow, buf, (size_t)xl);
    s->x_len = xl;
    s->x_live = 1;
    mconn *k = &s->k[0];
    if (v == 0) {
        sess_connect(s, 1);
        fr f = mkf(F_DATA, 0, new_xfer());
        f.region = xid;
        f.length = f.total = 2 + below(xl - 1);
        f.offset = below(xl - f.length + 1);
        CHECK(m_header(s, k, &f) == f.length);
        CHECK(pc_send(&k->pc, &f, sizeof f));
        send_partial_landed(s, k, 1 + below(f.length - 1));
    } else { /* READs of the whole region, answers never read */
        s->nk = 1;
        pc_open(&k->pc, 4096);
        CHECK(hello_send(&k->pc, s->l->tok, 0));
        s->l->bound = 1;
        s->nconns = 1;
        fr r[64];
        for (int i = 0; i < 64; i++) {
            r[i] = mkf(F_READ, 0, new_xfer());
            r[i].region = xid;
            r[i].length = r[i].total = xl;
        }
        uint64_t sent0 = stats().tcp_bytes_sent;
        CHECK(pc_send(&k->pc, r, sizeof r));
        /* read in one go, so all of them are queued once the first answer goes out */
        double end = now_ms() + WAIT_MS;
        while (stats().tcp_bytes_sent == sent0) {
            CHECK(now_ms() < end);
            sleep_us(200);
        }
    }
    double t0 = now_ms();
    CHECK_EQ(kv_region_remove(g_core, xid), KV_LLM_SUCCESS);
    s->x_live = 0;
    pump_events(0);
    CHECK(!g_freed[xid]); /* still pinned */
    CHECK(!s->l->down);   /* still linked */
    wait_link_down(s->l);
    CHECK(now_ms() - t0 >= 2 * (double)F / 1e6 - 1); /* not before the bound */
    wait_freed(xid);                                  /* the reference went with the link */
    CHECK(memcmp(buf, s->x_shadow, (size_t)xl) == 0); /* nothing more landed */
    s->dead = 1;
    e_stalled++;
    if (v == 1) { /* answers that went out: the region's bytes (the model kept none) */
        fr h;
        while (pc_frame(&k->pc, &h) == 1)
            CHECK(h.type == F_RDATA || h.type == F_HELLO_ACK);
    } else {
        pc_wait_eof(&k->pc, m_on_frame_cb, s);
    }
    free(buf);
    free(s->x_shadow);
    sess_finish(s, 1);
}

/* ------------------------------------------- unauthenticated flood */

static void sess_flood(void) {
    g_what = "flood";
    struct rlimit rl;
    CHECK(getrlimit(RLIMIT_NOFILE, &rl) == 0);
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < 2 * (MAX_PENDING + 16) + 64) {
        printf("flood skipped: RLIMIT_NOFILE %llu\n", (unsigned long long)rl.rlim_cur);
        return;
    }
    int n = MAX_PENDING + 4;
    pconn *c = calloc((size_t)n + 1, sizeof *c);
    CHECK(c != NULL);
    for (int i = 0; i < n; i++) {
        pc_open(&c[i], 0);
        if (i % 32 == 31 || i == n - 1) { /* let the core accept them (the backlog is 128) */
            double end = now_ms() + WAIT_MS;
            uint64_t want = (uint64_t)(i + 1 < MAX_PENDING ? i + 1 : MAX_PENDING);
            while (stats().tcp_conns != want || stats().tcp_refused != e_refused + (uint64_t)(i + 1) - want) {
                CHECK(now_ms() < end);
                sleep_us(200);
            }
        }
    }
    e_refused += (uint64_t)n - MAX_PENDING;
    /* even the right token is refused while the pending table is full */
    pc_open(&c[n], 0);
    hello_send(&c[n], g_links[0].tok, 0); /* may be closed already */
    fr t;
    CHECK_EQ(pc_frame(&c[n], &t), 0);
    e_refused++;
    for (int i = 0; i <= n; i++)
        pc_close(&c[i], chance(50));
    e_refused += MAX_PENDING;
    free(c);
    check_stats();
}

/* ------------------------------------------------------------ the end */

/* On a link declared here: HELLO, one valid DATA push, its ACK, the bytes in
 * place, a READ of them answered with them, then a clean end. */
static void serve_once(linkrec *l) {
    msess *s = sess_new(l, 1);
    sess_connect(s, 1);
    mconn *k = &s->k[0];
    fr f = mkf(F_DATA, 0, 0x5EED);
    f.region = g_exp_id;
    f.length = f.total = 1 + below(EXP_LEN);
    f.offset = below(EXP_LEN - f.length + 1);
    CHECK(send_frame(s, k, &f, 0, 0));
    CHECK(!s->dead);
    CHECK_EQ(k->ct_n, 2); /* its CREDIT, then the ACK are expected */
    m_sync(s, k);
    check_exp_exact();
    fr r = mkf(F_READ, 0, 0x5EEE);
    r.region = g_exp_id;
    r.offset = f.offset;
    r.length = r.total = f.length < 4096 ? f.length : 4096;
    CHECK(send_frame(s, k, &r, 0, 0));
    while (k->nsv) {
        fr h;
        CHECK_EQ(pc_frame(&k->pc, &h), 1);
        m_on_frame(k, &h);
    }
    CHECK(shutdown(k->pc.fd, SHUT_WR) == 0);
    pc_wait_eof(&k->pc, m_on_frame_cb, s);
    CHECK_EQ(s->bad, 0);
    sess_finish(s, 1);
}

static void setup(void) {
    CHECK_EQ(kv_core_new(&g_core, 2, CHUNK), KV_LLM_SUCCESS);
    g_arena = xmalloc(GUARD_LEN + EXP_LEN + GUARD_LEN);
    for (uint64_t i = 0; i < GUARD_LEN; i++)
        g_arena[i] = g_arena[GUARD_LEN + EXP_LEN + i] = GUARD_BYTE(i);
    g_exp = g_arena + GUARD_LEN;
    rnd_bytes(g_exp, EXP_LEN);
    g_shadow = xmalloc(EXP_LEN);
    memcpy(g_shadow, g_exp, EXP_LEN);
    g_canary = xmalloc(CANARY_LEN);
    for (uint64_t i = 0; i < CANARY_LEN; i++)
        g_canary[i] = CANARY_BYTE(i);
    CHECK_EQ(kv_region_add(g_core, KV_REGION_LOCAL, 0, A(g_arena), GUARD_LEN, 0, &g_guard1), KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_add(g_core, KV_REGION_LOCAL, 0, A(g_exp), EXP_LEN, KV_REGION_F_EXPORT, &g_exp_id),
             KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_add(g_core, KV_REGION_LOCAL, 0, A(g_exp + EXP_LEN), GUARD_LEN, 0, &g_guard2),
             KV_LLM_SUCCESS);
    /* exported once, removed: unknown from then on */
    static uint8_t gone[4096];
    CHECK_EQ(kv_region_add(g_core, KV_REGION_LOCAL, 0, A(gone), sizeof gone, KV_REGION_F_EXPORT, &g_removed_id),
             KV_LLM_SUCCESS);
    CHECK_EQ(kv_region_remove(g_core, g_removed_id), KV_LLM_SUCCESS);
    /* a peer's region: never exported */
    CHECK_EQ(kv_region_add(g_core, KV_REGION_TCP, (int32_t)LINK_BASE - 1, 5, EXP_LEN, 0, &g_tcp_kind_id),
             KV_LLM_SUCCESS);
    uint32_t pool[] = {g_exp_id, g_guard1, g_guard2, g_removed_id, g_tcp_kind_id, g_tcp_kind_id + 1, 0, UINT32_MAX};
    memcpy(g_rid_pool, pool, sizeof pool);
    g_rid_n = sizeof pool / sizeof pool[0];
    CHECK_EQ(kv_tcp_listen(g_core, "127.0.0.1", 0, &g_port), KV_LLM_SUCCESS);
    CHECK(g_port != 0);
    link_new(1); /* the decoy: only bad HELLOs until the end */
}

int main(int argc, char **argv) {
    long iters = DEFAULT_ITERS;
    g_seed = (uint64_t)time(NULL) * 1000003u ^ (uint64_t)getpid() ^ (uint64_t)(now_ms() * 1000);
    if (argc > 1)
        iters = strtol(argv[1], NULL, 0);
    if (argc > 2)
        g_seed = strtoull(argv[2], NULL, 0);
    if (iters < 0 || argc > 3) {
        fprintf(stderr, "usage: %s [iterations [seed]]\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGPIPE, SIG_IGN);
    alarm(WATCHDOG_SECONDS + (unsigned)(iters / 100)); /* default action: terminate, so a hang fails */
    printf("fuzz_tcp: seed %" PRIu64 ", %ld iterations (rerun: %s %ld %" PRIu64 ")\n", g_seed, iters, argv[0],
           iters, g_seed);
    g_rng = g_seed;
    g_links_cap = (size_t)iters + 16;
    g_links = calloc(g_links_cap, sizeof *g_links);
    CHECK(g_links != NULL);
    double t0 = now_ms();
    setup();
    typedef struct {
        void (*run)(void);
        int kind;
        int upto; /* mix: the session of an iteration whose draw in [0, 1000) is below this */
    } session;
    /* sessions that run once at a random iteration (and now and then in the mix) */
    static const session once[] = {{sess_flood, K_FLOOD, 0},        {sess_limits, K_LIMITS, 0},
                                   {sess_window, K_WINDOW, 0},      {sess_rank, K_RANK, 0},
                                   {sess_lease_recv, K_LEASE, 0},   {sess_lease_push, K_LEASE, 0},
                                   {sess_premature, K_PREMATURE, 0}, {sess_stall, K_STALL, 0}};
    static const session mix[] = {
        {sess_preauth, K_PREAUTH, 220},       {sess_server, K_SERVER, 680},         {sess_multi, K_MULTI, 780},
        {sess_notify, K_NOTIFY, 820},         {sess_client_bad, K_CLIENT, 840},     {sess_push, K_PEER, 900},
        {sess_pull, K_PEER, 960},             {sess_pull_unasked, K_PEER, 970},     {sess_push_stuck, K_PEER, 980},
        {sess_premature, K_PREMATURE, 993},   {sess_stall, K_STALL, 994},           {sess_lease_recv, K_LEASE, 995},
        {sess_lease_push, K_LEASE, 996},      {sess_window, K_WINDOW, 998},         {sess_rank, K_RANK, 1000}};
    long once_at[sizeof once / sizeof once[0]];
    for (size_t i = 0; i < sizeof once / sizeof once[0]; i++)
        once_at[i] = iters >= 40 ? (long)below((uint64_t)iters) : -1;
    for (g_iter = 0; g_iter < iters; g_iter++) {
        for (size_t i = 0; i < sizeof once / sizeof once[0]; i++)
            if (g_iter == once_at[i]) {
                double t1 = now_ms();
                once[i].run();
                g_counts[once[i].kind]++;
                g_ms[once[i].kind] += now_ms() - t1;
            }
        int r = (int)below(1000);
        const session *m = mix;
        while (r >= m->upto)
            m++;
        double t1 = now_ms();
        m->run();
        g_counts[m->kind]++;
        g_ms[m->kind] += now_ms() - t1;
    }
    g_what = "final";
    serve_once(link_new(1)); /* a fresh link */
    serve_once(&g_links[0]); /* the decoy, offered only bad HELLOs so far */
    g_counts[K_FINAL]++;
    kv_stats st = stats();
    if (g_counts[K_SERVER] >= 20)
        CHECK(st.tcp_bad_frames > 0);
    if (g_counts[K_PREAUTH] > 0)
        CHECK(st.tcp_refused > 0);
    CHECK_EQ(st.jobs_live, 0);
    kv_core_close(g_core);
    kv_core_free(g_core);
    check_canaries();
    check_exp_exact();
    printf("stats: refused %" PRIu64 ", bad frames %" PRIu64 ", links failed %" PRIu64 ", bytes received %" PRIu64
           "\n",
           st.tcp_refused, st.tcp_bad_frames, st.tcp_links_failed, st.tcp_bytes_received);
    printf("server sessions ended by a bad frame %ld, by close/reset %ld; pulls failed by a READ answered "
           "twice %ld; pushes with a frame stuck %ld (early answer refused %ld); rank: big push frames "
           "ahead %" PRIu64 " at most; answers refused before their job's first frame %ld; unfenced pushes "
           "held to the lease release %ld\n",
           g_bad_sessions, g_tolerant, g_dup_rdata, g_stuck, g_stuck_refused, g_rank_ahead, g_premature_bad,
           g_lease_waits);
    int passed = 0;
    for (int k = 0; k <= K_FINAL; k++) {
        printf("ok %-9s %5ld %8.1f ms\n", g_kind_names[k], g_counts[k], g_ms[k]);
        passed += (int)g_counts[k];
    }
    if (g_lfd >= 0)
        close(g_lfd);
    free(g_arena);
    free(g_shadow);
    free(g_canary);
    free(g_links);
    printf("%d passed, 0 failed (%lu checks, %.1f ms)\n", passed, g_checks, now_ms() - t0);
    return 0;
}
