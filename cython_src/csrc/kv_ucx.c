/* kvengine UCX data plane: one-sided puts and gets through UCP, driven from C.
 *
 * One I/O thread per core owns the UCP worker and every endpoint; it sleeps in
 * epoll on the worker's event fd and its own wake eventfd. API calls that need
 * the worker (endpoint creation, rkey unpacking) are commands the thread runs
 * while the caller waits; jobs reach it through an inbox, like kv_tcp.c.
 *
 * A push is ucp_put_nbx per chunk (at most `window` bytes posted and not yet
 * locally complete per link, most urgent job first), then ucp_ep_flush_nbx:
 * its completion is the remote completion of every put before it, and only
 * then is the job's completion posted. A pull is ucp_get_nbx per chunk and
 * completes when the last get has landed. Abort: no more chunks are posted,
 * then the same flush (push) or the last outstanding get (pull) ends it: no
 * byte of it lands after its status. A flush that does not complete within
 * `fence_ns` of the abort fails the link: the endpoint is closed with
 * UCP_EP_CLOSE_FLAG_FORCE, which completes every outstanding request
 * (cancelled) before the jobs complete LLM_LINK_FAILED. What that does and
 * does not promise on each fabric: docs/protocol.md, "UCX links".
 *
 * Remote memory: every peer region is an entry {link, base, len, rkey}
 * registered by kv_ucx_rkey_add and named by a KV_REGION_UCX region of the
 * same length; every segment is checked at submit against both (the region in
 * kv_core.c, the entry here: same link, offset + length inside), and the
 * address posted is entry base + offset, never a number taken from elsewhere. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kv_internal.h"

#include <stdlib.h>
#include <string.h>

#ifndef KV_HAVE_UCX

int kv_ucx_available(void) { return 0; }
uint32_t kv_ucx_address(kv_core *c, uint8_t *out, size_t *len) { return KV_LLM_FEATURE_NOT_ENABLED; }
uint32_t kv_ucx_mem_map(kv_core *c, uint32_t region_id, uint8_t *out, size_t *len) { return KV_LLM_FEATURE_NOT_ENABLED; }
uint32_t kv_ucx_link_add(kv_core *c, uint32_t link_id, const uint8_t *addr, size_t len, uint64_t window,
                         uint64_t fence_ns) { return KV_LLM_FEATURE_NOT_ENABLED; }
uint32_t kv_ucx_rkey_add(kv_core *c, uint32_t link_id, uint64_t base, uint64_t len, const uint8_t *rkey,
                         size_t rkey_len, uint32_t *region_id) { return KV_LLM_FEATURE_NOT_ENABLED; }
uint32_t kv_ucx_link_close(kv_core *c, uint32_t link_id, uint32_t status) { return KV_LLM_FEATURE_NOT_ENABLED; }

#else

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#define UCX_TICK_NS 100000000ull  /* timers are looked at least this often */
#define UCX_BUSY_TICK_MS 1        /* while requests are outstanding: progress at least every 1 ms */
#define UCX_SPIN_NS 200000ull     /* keep progressing this long after activity before sleeping */
#define UCX_CLOSE_WAIT_NS 2000000000ull /* stop: the most a forced close is waited for */

typedef struct ucx_link ucx_link;

/* A peer's registered memory: what its cache table said, and the unpacked rkey. */
typedef struct ucx_remote {
    uint32_t id;
    uint32_t link_id;
    uint64_t base, len;
    ucp_rkey_h rkey;
    struct ucx_remote *next; /* the link's list */
} ucx_remote;

/* One of our exported regions, mapped for the peers (ucp_mem_map). */
typedef struct ucx_local {
    uint32_t region_id;
    ucp_mem_h memh;
    void *packed;      /* its packed rkey */
    size_t packed_len;
    struct ucx_local *next;
} ucx_local;

typedef struct ucx_job {
    kv_job job;          /* first */
    uint32_t link_id;
    ucx_link *link;      /* set when the I/O thread takes it */
    int is_pull;
    int ops_pending;     /* puts/gets posted and not yet complete */
    uint64_t posted;     /* bytes posted */
    int flush_state;     /* 0: none, 1: flush outstanding, 2: flushed */
    uint64_t due;        /* ABORTING: the fence deadline */
    struct ucx_job *next, *prev; /* inbox (INBOX), else its link's active list */
} ucx_job;

struct ucx_link {
    uint32_t id;
    int dead;
    int closing;          /* 1: close request outstanding, 2: closed (ep gone) */
    int peer_errors;      /* UCP_ERR_HANDLING_MODE_PEER (a forced close is allowed) */
    ucp_ep_h ep;
    uint64_t window, inflight, fence_ns;
    kv_job *send_head, *send_tail; /* jobs with chunks left to post, by rank */
    ucx_job *active;      /* jobs taken off the inbox and not complete */
    ucx_remote *remotes;
    kv_event *down_event;
    uint32_t down_status;
    struct ucx_link *next;
};

/* Per-op context: what a put/get callback must account. */
typedef struct ucx_op {
    ucx_job *job;
    uint64_t len;
} ucx_op;

enum { CMD_LINK_ADD = 1, CMD_RKEY_ADD, CMD_LINK_CLOSE };

typedef struct ucx_cmd {
    int type, done, async;
    uint32_t link_id, status, result, remote_id;
    const uint8_t *buf;
    size_t len;
    uint64_t base, rlen, window, fence_ns;
    kv_event *down_event;
    struct ucx_cmd *next;
} ucx_cmd;

typedef struct kv_ucx {
    kv_transport transport; /* first */
    kv_core *core;
    pthread_t thread;
    int epoll_fd, wake_fd, worker_fd;
    ucp_context_h context;
    ucp_worker_h worker;
    ucp_address_t *address;
    size_t address_len;
    uint64_t uid;          /* our worker's unique id */
    /* under c->lock */
    ucx_link *links;
    ucx_local *locals;
    ucx_remote **remotes; /* by id (0 unused); NULL once destroyed */
    size_t nremotes, remote_cap;
    ucx_cmd *cmds_head, *cmds_tail;
    ucx_job *inbox_head, *inbox_tail;
    int aborts;           /* ABORT_REQ jobs may exist: the round looks for them */
    ucx_local *unmap;     /* released regions to unmap at the next round (freed on the I/O thread) */
    pthread_cond_t cmd_done;
    int stop_requested, stopped;
    /* I/O thread only: it holds c->lock now (UCP may call our callbacks from inside
     * a call made under the lock: a forced close completes requests inline), and
     * the signal those callbacks owe the loop */
    int io_locked, io_sig;
} kv_ucx;

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

static void *io_main(void *arg);

/* ---------------------------------------------------------------- start */

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
    u->epoll_fd = u->wake_fd = -1;
    pthread_cond_init(&u->cmd_done, NULL);
    ucp_params_t params = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP,
        .mt_workers_shared = 1, /* ucp_mem_map/unmap from the API threads, the worker on ours */
    };
    ucp_config_t *config = NULL;
    if (ucp_config_read(NULL, NULL, &config) != UCS_OK)
        goto fail;
    ucs_status_t s = ucp_init(&params, config, &u->context);
    ucp_config_release(config);
    if (s != UCS_OK) {
        u->context = NULL;
        goto fail;
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SINGLE};
    if (ucp_worker_create(u->context, &wp, &u->worker) != UCS_OK) {
        u->worker = NULL;
        goto fail;
    }
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

/* Complete `j` (caller holds c->lock). Returns 1 if the eventfd must be signalled. */
static int job_complete(kv_ucx *u, ucx_job *j, uint32_t status) {
    if (j->job.queued)
        kv__queue_remove(&j->link->send_head, &j->link->send_tail, &j->job);
    if (j->job.state == KV_JS_INBOX) {
        inbox_remove(u, j);
    } else if (j->link) {
        list_del(&j->link->active, j);
    }
    j->job.state = KV_JS_DONE;
    return kv__job_complete(u->core, &j->job, status);
}

/* Is `j` finished: nothing left to post (or no more will be), no request
 * outstanding, and a push's flush done? Caller holds c->lock. */
static int job_maybe_done(kv_ucx *u, ucx_job *j) {
    if (j->job.state == KV_JS_DONE || j->job.queued || j->ops_pending || j->flush_state == 1)
        return 0;
    int stopped = j->job.state == KV_JS_ABORTING || j->job.state == KV_JS_FENCING ||
                  j->job.claim_segment == j->job.nsegments;
    if (!stopped)
        return 0;
    if (j->job.state == KV_JS_FENCING) /* the endpoint is gone: every request was completed (cancelled) */
        return job_complete(u, j, KV_LLM_LINK_FAILED);
    if (!j->is_pull && j->posted && j->flush_state == 0)
        return 0; /* its flush is posted by the I/O round */
    if (!j->is_pull && j->flush_state == 2)
        j->job.bytes_done = j->posted; /* flushed: every posted byte is in place */
    return job_complete(u, j, KV_LLM_SUCCESS); /* an abort's status is in record.status already */
}

/* Callbacks run on the I/O thread, with c->lock held or not: take it if not. */
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

static void op_done(void *request, ucs_status_t status, void *user_data) {
    ucx_op *op = user_data;
    ucx_job *j = op->job;
    kv_ucx *u = (kv_ucx *)j->job.transport;
    int own = cb_lock(u);
    j->ops_pending--;
    j->link->inflight -= op->len;
    if (status != UCS_OK && j->job.record.status == KV_LLM_SUCCESS)
        j->job.record.status = status == UCS_ERR_CANCELED ? KV_LLM_LINK_FAILED : KV_LLM_LINK_FAILED;
    else if (status == UCS_OK && j->is_pull)
        j->job.bytes_done += op->len;
    int sig = job_maybe_done(u, j);
    cb_unlock(u, own, sig);
    free(op);
    ucp_request_free(request);
}

static void flush_done(void *request, ucs_status_t status, void *user_data) {
    ucx_job *j = user_data;
    kv_ucx *u = (kv_ucx *)j->job.transport;
    int own = cb_lock(u);
    j->flush_state = 2;
    if (status != UCS_OK && j->job.record.status == KV_LLM_SUCCESS)
        j->job.record.status = KV_LLM_LINK_FAILED;
    if (status != UCS_OK)
        j->posted = 0; /* not flushed: nothing is known to be in place */
    int sig = job_maybe_done(u, j);
    cb_unlock(u, own, sig);
    ucp_request_free(request);
}

/* Post `j`'s flush (caller holds c->lock; ucp_ep_flush_nbx calls nothing back here). */
static int post_flush(kv_ucx *u, ucx_job *j) {
    ucx_link *l = j->link;
    if (j->flush_state != 0 || l->dead)
        return 0;
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                             .cb.send = flush_done, .user_data = j};
    ucs_status_ptr_t r = ucp_ep_flush_nbx(l->ep, &p);
    if (r == NULL) {
        j->flush_state = 2;
    } else if (UCS_PTR_IS_ERR(r)) {
        j->flush_state = 2;
        j->posted = 0;
        if (j->job.record.status == KV_LLM_SUCCESS)
            j->job.record.status = KV_LLM_LINK_FAILED;
    } else {
        j->flush_state = 1;
    }
    return job_maybe_done(u, j);
}

/* ---------------------------------------------------------------- links */

static void close_done(void *request, ucs_status_t status, void *user_data) {
    ucx_link *l = user_data;
    l->closing = 2; /* I/O thread only */
    ucp_request_free(request);
}

/* The link fails (caller holds c->lock, I/O thread): queued jobs end at once,
 * jobs with requests outstanding when the forced close has completed them. */
static int link_fail(kv_ucx *u, ucx_link *l, uint32_t status, int post_down) {
    kv_core *c = u->core;
    int sig = 0;
    if (l->dead)
        return 0;
    l->dead = 1;
    for (ucx_job *j = l->active, *next; j; j = next) {
        next = j->next;
        if (j->job.record.status == KV_LLM_SUCCESS)
            j->job.record.status = status;
        if (j->job.queued)
            kv__queue_remove(&l->send_head, &l->send_tail, &j->job);
        j->job.state = KV_JS_FENCING;
        if (j->flush_state == 0)
            j->flush_state = 2; /* no flush will come */
        sig |= job_maybe_done(u, j);
    }
    if (l->ep) {
        ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                                                 UCP_OP_ATTR_FIELD_USER_DATA,
                                 .flags = l->peer_errors ? UCP_EP_CLOSE_FLAG_FORCE : 0,
                                 .cb.send = close_done, .user_data = l};
        ucs_status_ptr_t r = ucp_ep_close_nbx(l->ep, &p);
        l->ep = NULL;
        l->closing = (r == NULL || UCS_PTR_IS_ERR(r)) ? 2 : 1;
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
    ucx_link *l = arg;
    l->down_status = KV_LLM_LINK_FAILED; /* acted on by the round (under the lock) */
}

/* Free a dead link whose close completed and whose jobs all ended. Caller holds c->lock. */
static void link_reap(kv_ucx *u) {
    ucx_link **p = &u->links;
    while (*p) {
        ucx_link *l = *p;
        if (!(l->dead && l->closing == 2 && !l->active)) {
            p = &l->next;
            continue;
        }
        *p = l->next;
        while (l->remotes) {
            ucx_remote *r = l->remotes;
            l->remotes = r->next;
            u->remotes[r->id] = NULL;
            ucp_rkey_destroy(r->rkey);
            free(r);
        }
        free(l->down_event);
        free(l);
    }
}

/* Run a command (I/O thread, c->lock held; UCP calls here call nothing back). */
static int run_cmd(kv_ucx *u, ucx_cmd *m) {
    int sig = 0;
    ucx_link *l = link_find(u, m->link_id);
    m->result = KV_LLM_SUCCESS;
    if (m->type == CMD_LINK_ADD) {
        if (l) {
            m->result = KV_LLM_PARAM_INVALID;
            return 0;
        }
        /* the peer's worker must not be ours: an endpoint to ourselves (the self
         * transport) would put the peer's addresses into this process */
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
        ucp_ep_params_t ep = {
            .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                          UCP_EP_PARAM_FIELD_ERR_HANDLER,
            .address = (const ucp_address_t *)m->buf,
            .err_mode = UCP_ERR_HANDLING_MODE_PEER,
            .err_handler = {.cb = ep_error, .arg = l},
        };
        l->peer_errors = 1;
        if (ucp_ep_create(u->worker, &ep, &l->ep) != UCS_OK) {
            /* the transports in use cannot report a peer failure (shared memory:
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
        l->id = m->link_id;
        l->window = m->window;
        l->fence_ns = m->fence_ns;
        l->down_event = m->down_event;
        m->down_event = NULL;
        l->next = u->links;
        u->links = l;
    } else if (m->type == CMD_RKEY_ADD) {
        if (!l || l->dead) {
            m->result = KV_LLM_LINK_FAILED;
            return 0;
        }
        if (u->nremotes >= u->remote_cap) {
            size_t cap = u->remote_cap ? u->remote_cap * 2 : 64;
            ucx_remote **n = cap < UINT32_MAX ? realloc(u->remotes, cap * sizeof *n) : NULL;
            if (!n) {
                m->result = KV_LLM_OUT_OF_MEMORY;
                return 0;
            }
            u->remotes = n;
            u->remote_cap = cap;
            if (u->nremotes == 0)
                u->remotes[u->nremotes++] = NULL; /* id 0 unused */
        }
        ucx_remote *r = calloc(1, sizeof *r);
        if (!r) {
            m->result = KV_LLM_OUT_OF_MEMORY;
            return 0;
        }
        if (ucp_ep_rkey_unpack(l->ep, m->buf, &r->rkey) != UCS_OK) {
            free(r);
            m->result = KV_LLM_PARAM_INVALID; /* not an rkey this endpoint can use */
            return 0;
        }
        r->id = (uint32_t)u->nremotes;
        r->link_id = l->id;
        r->base = m->base;
        r->len = m->rlen;
        r->next = l->remotes;
        l->remotes = r;
        u->remotes[u->nremotes++] = r;
        m->remote_id = r->id;
    } else if (m->type == CMD_LINK_CLOSE) {
        if (l)
            sig |= link_fail(u, l, m->status, 0);
    }
    return sig;
}

/* ------------------------------------------------------------------ posting */

/* Post chunks of the link's most urgent jobs while the window allows. Caller
 * holds c->lock (put/get_nbx call nothing back here). */
static int post_chunks(kv_ucx *u, ucx_link *l) {
    kv_core *c = u->core;
    int sig = 0;
    while (!l->dead && l->send_head && (l->window == 0 || l->inflight < l->window)) {
        ucx_job *j = (ucx_job *)l->send_head;
        if (j->job.state == KV_JS_ABORT_REQ) { /* acted on at the next round */
            kv__queue_remove(&l->send_head, &l->send_tail, &j->job);
            u->aborts = 1;
            continue;
        }
        const kv_segment *s = &j->job.segments[j->job.claim_segment];
        uint64_t off = j->job.claim_offset, n = s->len - off;
        if (n > c->chunk_bytes)
            n = c->chunk_bytes;
        ucx_remote *r = u->remotes[s->remote_region]; /* checked at submit; lives while the link does */
        uint64_t roff = (j->is_pull ? s->src : s->dst) + off;
        uint8_t *local = (uint8_t *)(uintptr_t)((j->is_pull ? s->dst : s->src) + off);
        if (!r || r->link_id != l->id || roff > r->len || n > r->len - roff) { /* cannot happen: checked */
            if (j->job.record.status == KV_LLM_SUCCESS)
                j->job.record.status = KV_LLM_PARAM_INVALID;
            kv__queue_remove(&l->send_head, &l->send_tail, &j->job);
            j->job.state = KV_JS_ABORTING;
            sig |= j->is_pull ? job_maybe_done(u, j) : post_flush(u, j);
            continue;
        }
        ucx_op *op = malloc(sizeof *op);
        if (!op)
            break; /* the next round tries again */
        op->job = j;
        op->len = n;
        ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                                 .user_data = op};
        ucs_status_ptr_t req;
        if (j->is_pull) {
            p.cb.send = op_done;
            req = ucp_get_nbx(l->ep, local, n, r->base + roff, r->rkey, &p);
        } else {
            p.cb.send = op_done;
            req = ucp_put_nbx(l->ep, local, n, r->base + roff, r->rkey, &p);
        }
        j->job.claim_offset += n;
        if (j->job.claim_offset == s->len) {
            j->job.claim_offset = 0;
            if (++j->job.claim_segment == j->job.nsegments) {
                kv__queue_remove(&l->send_head, &l->send_tail, &j->job);
                j->job.state = KV_JS_SENT;
            }
        }
        if (UCS_PTR_IS_ERR(req)) {
            free(op);
            if (j->job.record.status == KV_LLM_SUCCESS)
                j->job.record.status = KV_LLM_LINK_FAILED;
            if (j->job.queued)
                kv__queue_remove(&l->send_head, &l->send_tail, &j->job);
            j->job.state = KV_JS_ABORTING;
            j->due = now_ns() + l->fence_ns;
            sig |= j->is_pull ? job_maybe_done(u, j) : post_flush(u, j);
            continue;
        }
        j->posted += n;
        if (req == NULL) { /* complete already (locally: a put still needs its flush) */
            free(op);
            if (j->is_pull)
                j->job.bytes_done += n;
        } else {
            j->ops_pending++;
            l->inflight += n;
        }
        if (!j->job.queued)
            sig |= j->is_pull ? job_maybe_done(u, j) : post_flush(u, j);
    }
    return sig;
}

/* An abort asked by kv_core_abort: stop posting, then the flush fences it. */
static int handle_abort(kv_ucx *u, ucx_job *j, uint64_t now) {
    ucx_link *l = j->link;
    if (j->job.queued)
        kv__queue_remove(&l->send_head, &l->send_tail, &j->job);
    j->job.state = KV_JS_ABORTING;
    j->due = now + l->fence_ns;
    if (l->dead) {
        j->job.state = KV_JS_FENCING;
        return job_maybe_done(u, j);
    }
    return j->is_pull ? job_maybe_done(u, j) : post_flush(u, j);
}

/* Fence deadlines (aborted jobs whose flush did not complete in time) and
 * endpoint errors. Caller holds c->lock. */
static int timers(kv_ucx *u, uint64_t now) {
    int sig = 0;
    for (ucx_link *l = u->links; l; l = l->next) {
        if (l->dead)
            continue;
        if (l->down_status) {
            sig |= link_fail(u, l, l->down_status, 1);
            continue;
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

static int busy(kv_ucx *u) {
    for (ucx_link *l = u->links; l; l = l->next)
        if (l->active || l->closing == 1)
            return 1;
    return 0;
}

static void *io_main(void *arg) {
    kv_ucx *u = arg;
    kv_core *c = u->core;
    uint64_t last_busy = 0, stop_at = 0;
    for (;;) {
        int sig = 0;
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
        while (u->inbox_head) {
            ucx_job *j = u->inbox_head;
            ucx_link *l = link_find(u, j->link_id);
            if (!l || l->dead || stop) {
                sig |= job_complete(u, j, stop ? KV_LLM_ENGINE_FINALIZED : KV_LLM_LINK_FAILED);
                continue;
            }
            inbox_remove(u, j);
            j->link = l;
            j->job.state = KV_JS_SENDING;
            list_add(&l->active, j);
            kv__rank_insert(&l->send_head, &l->send_tail, &j->job);
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
        while (u->unmap) { /* regions released by a completion on this thread */
            ucx_local *lo = u->unmap;
            u->unmap = lo->next;
            ucp_rkey_buffer_release(lo->packed);
            ucp_mem_unmap(u->context, lo->memh);
            free(lo);
        }
        if (stop && !u->stopped) {
            u->stopped = 1;
            stop_at = now;
            for (ucx_link *l = u->links; l; l = l->next)
                sig |= link_fail(u, l, KV_LLM_ENGINE_FINALIZED, 0);
        }
        sig |= timers(u, now);
        for (ucx_link *l = u->links; l; l = l->next)
            sig |= post_chunks(u, l);
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
        while (ucp_worker_progress(u->worker))
            progressed = 1;
        now = now_ns();
        if (progressed)
            last_busy = now;
        int tmo;
        if (now - last_busy < UCX_SPIN_NS) {
            tmo = 0;
            sched_yield();
        } else if (ucp_worker_arm(u->worker) == UCS_ERR_BUSY) {
            continue;
        } else {
            tmo = working ? UCX_BUSY_TICK_MS : (int)(UCX_TICK_NS / 1000000);
        }
        struct epoll_event evs[4];
        int ne = epoll_wait(u->epoll_fd, evs, 4, tmo);
        for (int i = 0; i < ne; i++) {
            if (evs[i].data.u32 == 0) {
                uint64_t v;
                ssize_t r = read(u->wake_fd, &v, sizeof v);
                (void)r;
            }
            last_busy = now_ns();
        }
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

uint32_t kv_ucx_mem_map(kv_core *c, uint32_t region_id, uint8_t *out, size_t *len) {
    kv_ucx *u;
    uint32_t st = ucx_start(c, &u);
    if (st != KV_LLM_SUCCESS)
        return st;
    pthread_mutex_lock(&c->lock);
    kv_region *rg = kv__region_get(c, region_id);
    ucx_local *lo = u->locals;
    while (lo && lo->region_id != region_id)
        lo = lo->next;
    if (!rg || rg->removed)
        st = KV_LLM_KV_CACHE_NOT_EXIST;
    else if (rg->kind != KV_REGION_LOCAL || !(rg->flags & KV_REGION_F_EXPORT))
        st = KV_LLM_PARAM_INVALID; /* only this engine's own caches are ever exposed */
    uint64_t addr = rg ? rg->addr : 0, rlen = rg ? rg->len : 0;
    if (st == KV_LLM_SUCCESS && !lo) {
        /* mapped under the lock: the region cannot be released (and unmapped) meanwhile */
        lo = calloc(1, sizeof *lo);
        ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                                   .address = (void *)(uintptr_t)addr, .length = (size_t)rlen};
        if (!lo) {
            st = KV_LLM_OUT_OF_MEMORY;
        } else if (ucp_mem_map(u->context, &mp, &lo->memh) != UCS_OK) {
            free(lo);
            lo = NULL;
            st = KV_LLM_FAILED;
        } else if (ucp_rkey_pack(u->context, lo->memh, &lo->packed, &lo->packed_len) != UCS_OK) {
            ucp_mem_unmap(u->context, lo->memh);
            free(lo);
            lo = NULL;
            st = KV_LLM_FAILED;
        } else {
            lo->region_id = region_id;
            lo->next = u->locals;
            u->locals = lo;
        }
    }
    if (st == KV_LLM_SUCCESS) {
        if (*len < lo->packed_len)
            st = KV_LLM_PARAM_INVALID;
        else
            memcpy(out, lo->packed, lo->packed_len);
        *len = lo->packed_len;
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

uint32_t kv_ucx_link_add(kv_core *c, uint32_t link_id, const uint8_t *addr, size_t len, uint64_t window,
                         uint64_t fence_ns) {
    if (link_id == 0 || len == 0 || len > KV_UCX_MAX_BLOB || fence_ns < 1000000ull || fence_ns > 3600000000000ull)
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
                 .fence_ns = fence_ns, .down_event = d};
    uint32_t st = post_cmd(c, &m);
    free(m.down_event); /* NULL once the link took it */
    free(copy);
    return st;
}

uint32_t kv_ucx_rkey_add(kv_core *c, uint32_t link_id, uint64_t base, uint64_t len, const uint8_t *rkey,
                         size_t rkey_len, uint32_t *region_id) {
    if (link_id == 0 || link_id > INT32_MAX || len == 0 || base + len < base || rkey_len == 0 ||
        rkey_len > KV_UCX_MAX_BLOB)
        return KV_LLM_PARAM_INVALID;
    ucx_cmd m = {.type = CMD_RKEY_ADD, .link_id = link_id, .buf = rkey, .len = rkey_len, .base = base, .rlen = len};
    uint32_t st = post_cmd(c, &m);
    if (st != KV_LLM_SUCCESS)
        return st;
    /* the entry lives until its link is reaped; the region names it by id */
    return kv_region_add(c, KV_REGION_UCX, (int32_t)link_id, m.remote_id, len, 0, region_id);
}

uint32_t kv_ucx_link_close(kv_core *c, uint32_t link_id, uint32_t status) {
    pthread_mutex_lock(&c->lock);
    int started = ucx_of(c) != NULL;
    pthread_mutex_unlock(&c->lock);
    if (!started)
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

/* ------------------------------------------------- the transport interface */

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
    /* every remote side against its entry: this link's, offset and length inside */
    for (size_t i = 0; i < job->nsegments; i++) {
        const kv_segment *s = &job->segments[i];
        uint64_t off = j->is_pull ? s->src : s->dst;
        ucx_remote *r = s->remote_region < u->nremotes ? u->remotes[s->remote_region] : NULL;
        if (!r || r->link_id != j->link_id || off > r->len || s->len > r->len - off)
            return KV_LLM_PARAM_INVALID;
    }
    kv__job_hash(u->core, job);
    job->state = KV_JS_INBOX;
    inbox_append(u, j);
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
}

static void ucx_region_freed(kv_transport *t, uint32_t region_id) {
    kv_ucx *u = (kv_ucx *)t;
    for (ucx_local **p = &u->locals; *p; p = &(*p)->next) {
        if ((*p)->region_id != region_id)
            continue;
        ucx_local *lo = *p;
        *p = lo->next;
        if (pthread_equal(pthread_self(), u->thread) && !u->stopped) { /* inside a UCP callback: later */
            lo->next = u->unmap;
            u->unmap = lo;
            return;
        }
        ucp_rkey_buffer_release(lo->packed);
        ucp_mem_unmap(u->context, lo->memh); /* no peer reaches it through UCX any more */
        free(lo);
        return;
    }
}

static void ucx_destroy(kv_transport *t) {
    kv_ucx *u = (kv_ucx *)t;
    while (u->links) {
        ucx_link *l = u->links;
        u->links = l->next;
        while (l->remotes) {
            ucx_remote *r = l->remotes;
            l->remotes = r->next;
            ucp_rkey_destroy(r->rkey);
            free(r);
        }
        free(l->down_event);
        free(l);
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
        ucp_rkey_buffer_release(lo->packed);
        ucp_mem_unmap(u->context, lo->memh);
        free(lo);
    }
    free(u->remotes);
    if (u->address)
        ucp_worker_release_address(u->worker, u->address);
    if (u->worker)
        ucp_worker_destroy(u->worker);
    if (u->context)
        ucp_cleanup(u->context);
    if (u->epoll_fd >= 0)
        close(u->epoll_fd);
    if (u->wake_fd >= 0)
        close(u->wake_fd);
    pthread_cond_destroy(&u->cmd_done);
    free(u);
}

static const kv_transport_ops ucx_ops = {
    .job_size = sizeof(ucx_job),
    .submit = ucx_submit,
    .abort = ucx_abort,
    .stop = ucx_stop,
    .destroy = ucx_destroy,
    .region_freed = ucx_region_freed,
};

#endif
