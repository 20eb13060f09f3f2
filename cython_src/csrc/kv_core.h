/* kvengine native core: region table, scatter-gather copy jobs, mover
 * threads, completion queue signalled through one eventfd.
 *
 * C99 + POSIX, no Python.h. Every function returns an LLM status code
 * (kv_status.h) or a plain value; none blocks except kv_core_close (joins the
 * movers) and kv_core_submit when it copies inline (bounded by the inline
 * threshold).
 *
 * Rules:
 * - Every segment of a job names registered regions; offsets and lengths are
 *   checked against the region bounds at submit, before any byte moves.
 * - Movers never touch the region table: a job carries resolved addresses
 *   and holds a reference on each region it uses, so a removed region is
 *   unmapped only after the last job using it has finished.
 * - Abort is fenced: the completion of an aborted job is posted only after
 *   every mover working on it has finished its current chunk. A job's
 *   completion is posted exactly once.
 */
#ifndef KV_CORE_H
#define KV_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "kv_status.h"

#define KV_REGION_LOCAL   0 /* memory mapped in this process */
#define KV_REGION_PROCESS 1 /* memory of another process, reached with process_vm_{read,write}v */
#define KV_REGION_TCP     2 /* a peer's region over a TCP link: pid = link id, addr = the peer's region id */
#define KV_REGION_UCX     3 /* a peer's region over a UCX link: pid = link id, addr = the peer's region id */

/* kv_region_add flags */
#define KV_REGION_F_UNMAP  1u /* munmap on release (a mapping the core owns) */
#define KV_REGION_F_EXPORT 2u /* TCP and UCX peers may name it in frames/messages (this engine's caches only) */
#define KV_REGION_F_NOTIFY 4u /* post KV_EVENT_REGION_FREED when released */

/* Completions whose job_id has bit 63 set are events: kind in bits 56..62, id below. */
#define KV_EVENT              (1ull << 63)
#define KV_EVENT_LINK_READY   (KV_EVENT | (1ull << 56)) /* every stream of a link is up */
#define KV_EVENT_LINK_DOWN    (KV_EVENT | (2ull << 56)) /* a stream failed: the link is closed */
#define KV_EVENT_REGION_FREED (KV_EVENT | (3ull << 56)) /* no job or frame uses it any more */
#define KV_EVENT_ID_MASK      ((1ull << 56) - 1)
#define KV_EVENT_KIND_MASK    (KV_EVENT | (0x7Full << 56))

#define KV_MAX_STREAMS 16
#define KV_TOKEN_BYTES 32

#define KV_SEG_WORDS 5 /* a segment: src_region, src_offset, dst_region, dst_offset, nbytes */
/* A 2-D segment: src_region, src_offset, dst_region, dst_offset, row_bytes, rows,
 * src_stride, dst_stride: row r is row_bytes at src_offset + r * src_stride,
 * written at dst_offset + r * dst_stride. */
#define KV_SEG2_WORDS 8

typedef struct kv_core kv_core;

/* kv_completion flags */
#define KV_DONE_UNSTARTED 1u /* aborted before any of its bytes was copied or sent */
/* kv_core_submit_job: a job that may not be copied on the calling thread (CMA); not a status */
#define KV_INLINE_REFUSED 0xFFFFFFFEu

typedef struct {
    uint64_t job_id;
    uint64_t nbytes; /* bytes written into the destination */
    uint32_t status;
    uint32_t flags;  /* KV_DONE_* */
} kv_completion;

typedef struct {
    uint64_t jobs_submitted;  /* queued for movers */
    uint64_t jobs_inline;     /* copied on the calling thread */
    uint64_t jobs_completed;  /* completions posted */
    uint64_t jobs_aborted;
    uint64_t jobs_live;       /* queued or running */
    uint64_t bytes_moved;
    uint64_t regions_live;
    uint64_t wakeups;         /* eventfd writes */
    uint64_t tcp_conns;       /* data connections open */
    uint64_t tcp_bytes_sent;  /* payload bytes */
    uint64_t tcp_bytes_received;
    uint64_t tcp_bad_frames;  /* connections dropped for a malformed or out-of-bounds frame */
    uint64_t tcp_refused;     /* connections dropped before authentication (bad token, timeout, limit) */
    uint64_t tcp_links_failed;
    uint64_t tcp_lease_expired; /* links failed because DATA was to be written without a valid lease */
    uint64_t tcp_fence_expired; /* links failed because an aborted push's ABORT_ACKs did not come within the fence */
    uint64_t tcp_stalled;       /* links failed because a payload in progress or pending output made no progress */
    uint64_t tcp_accept_paused; /* accept() failed for lack of descriptors or memory: listening paused 100 ms */
    uint64_t ucx_bad_msgs;      /* UCX links failed for a message that failed the target's checks */
    uint64_t ucx_refused;       /* UCX messages dropped: no live link has their token (a stranger, or a dead link) */
    uint64_t ucx_dropped;       /* UCX data dropped on purpose: an aborted push's or pull's late bytes */
    uint64_t ucx_bytes_sent;    /* UCX payload bytes */
    uint64_t ucx_bytes_received;
    uint64_t ucx_lease_grants;  /* UCX lease requests we granted (a peer may write our pushes) */
    uint64_t ucx_late_dropped;  /* UCX push payloads (eager, or received into staging) not or not all
                                   landed: our lease from the pusher ran out first (the link fails) */
    uint64_t ucx_rx_pending;    /* now: UCX rendezvous receives of live links in progress or waiting */
    uint64_t ucx_rx_orphans;    /* now: receives of failed links UCX has not ended (they land nothing) */
    uint64_t ucx_stage_bytes;   /* now: staging memory UCX receives hold (in progress or landing; an
                                   orphan's is given back to the kernel); the reuse cache not counted */
    uint64_t ucx_rx_staged;     /* UCX rendezvous payloads received (through staging); eager ones are not */
    uint64_t ucx_rx_rows;       /* UCX PUSH2D messages accepted (a 2-D segment's rows in one message) */
    uint64_t ucx_land_pread;    /* staged pieces of 256 KiB+ landed by pread from staging (kv_ucx.c land_how) */
    uint64_t ucx_land_pvw;      /* ... and by process_vm_writev into ourselves */
    uint64_t ucx_ep_closes;     /* UCX endpoint closes started (a link failed, or the engine closes) */
    uint64_t ucx_ep_closing;    /* now: closes UCX has not completed (a flush waiting for a stopped peer) */
    uint64_t ucx_ep_kept;       /* closes without force: UCX keeps such an endpoint (and its transports'
                                 * resources) until the engine closes once the peer connected to it */
    uint64_t ucx_ep_parked;     /* now: endpoints of closed links parked for the peer's next link */
    uint64_t ucx_driven;        /* pushes the loop thread posted and saw complete itself (kv_ucx_submit_driven) */
    uint64_t ucx_drive_handed;  /* ...and those it handed to the I/O thread (worker busy, or not done in time) */
    uint64_t tcp_driven;        /* tcp pushes the loop thread sent and saw ACKed itself (kv_tcp_submit_driven) */
    uint64_t tcp_drive_handed;  /* ...and those it handed to the I/O thread (sockets busy, or not done in time) */
    uint64_t jobs_abandoned;    /* mover jobs kv_core_reap completed LINK_FAILED, a copy of theirs stuck */
    uint64_t movers_stuck;      /* now: retired movers whose copy has not returned */
    uint64_t chunks_paired;     /* mover chunks copied as a head-split pair (two jobs, one pass) */
    uint64_t tcp_row_reads;     /* READs of a 2-D pull segment's rows sent (kv_tcp.c tcp_pull_2d) */
    uint64_t tcp_readv;         /* READVs sent (kv_tcp.c readv_claim: a pull's segments in one READ) */
    uint64_t ucx_row_pulls;     /* UCX PULL_REQ2D sent (a 2-D pull segment's rows asked in one message) */
    uint64_t ucx_pullv;         /* UCX PULL_REQV sent (several 1-D pull segments asked in one message) */
    uint64_t ucx_pushv;         /* UCX PUSHV sent (several small push segments, packed, in one message) */
} kv_stats;

/* Create a core with `movers` threads (1..64); `chunk_bytes` is the most a
 * mover copies between two abort checks. */
uint32_t kv_core_new(kv_core **out, int movers, uint64_t chunk_bytes);
/* The eventfd that becomes readable when completions are ready. */
int kv_core_fileno(const kv_core *core);
/* Wait on the calling thread (spinning) at most `bound_ns` for job `job_id`'s
 * completion and take it out of the queue kv_core_poll drains: 1 and `out` filled,
 * or 0 at the bound (the completion is then polled as any other). Its posting does
 * not signal the eventfd meanwhile (no wake-up of the reader for a completion the
 * caller takes itself). For a small job handed to the movers that the caller would
 * otherwise have copied itself (KV_INLINE_REFUSED): the bound is what a peer that
 * holds that copy can take from the caller. One waiter at a time (the loop thread). */
int kv_core_wait_take(kv_core *core, uint64_t job_id, uint64_t bound_ns, kv_completion *out);
/* Reset the eventfd, then move up to `max` completions into `out`. */
size_t kv_core_poll(kv_core *core, kv_completion *out, size_t max);
/* Abort every job with KV_LLM_ENGINE_FINALIZED, join the movers. Idempotent.
 * TCP pushes not fenced by their peer complete at their lease release (at most
 * lease + margin from now: kv_tcp_link_add), so this may wait that long.
 * A mover whose copy has not returned within KV_CLOSE_MOVER_NS (another process
 * holds it: kv_core_reap) is left running, detached; kv_core_free then leaves
 * the core as it is (that mover touches it when its copy returns), unless every
 * mover has returned by the time it is called (it may be called again).
 * Completions stay pollable until kv_core_free. */
void kv_core_close(kv_core *core);
void kv_core_free(kv_core *core);
void kv_core_stats(kv_core *core, kv_stats *out);

/* Register [addr, addr+len) (KV_REGION_TCP: the peer's region `addr` of `len`
 * bytes on link `pid`). `flags`: KV_REGION_F_*. Ids are never reused. */
uint32_t kv_region_add(kv_core *core, int kind, int32_t pid, uint64_t addr, uint64_t len,
                       unsigned flags, uint32_t *region_id);
uint32_t kv_region_remove(kv_core *core, uint32_t region_id);
/* Attach a pidfd (pidfd_open) of the process a KV_REGION_PROCESS region lives
 * in: the core dup()s it (the caller keeps `pidfd`) and closes its copy when
 * the last region holding it is released. Regions given the same nonzero `key`
 * share the first call's duplicate (one descriptor per link rather than per
 * region: a peer with many caches cannot exhaust our descriptors); a key must
 * never name another process later (0: a private duplicate). Before each
 * process_vm_readv/writev a mover polls it: once that process has exited (its
 * pid may name another process by then) the job fails KV_LLM_LINK_FAILED
 * instead of touching that pid. Once per region, before jobs use it (jobs
 * submitted earlier do not see it). */
uint32_t kv_region_pidfd(kv_core *core, uint32_t region_id, int pidfd, uint64_t key);

/* Fault `len` bytes of a mapping at `addr` in for writing (MADV_POPULATE_WRITE, Linux
 * 5.14): 0, or the errno (EINVAL: an older kernel; ENOMEM). On this project's VMs a page
 * first faulted in for reading (MAP_POPULATE) took the first copy into it at a third to
 * a half of the speed of every later one, even after a MADV_POPULATE_WRITE; a page first
 * faulted in for writing did not (docs/benchmarks.md, "The first write into a page"). */
int kv_populate_write(void *addr, uint64_t len);

/* mmap `len` bytes of `fd` shared, read-write, every page faulted in for writing
 * (kv_populate_write; MAP_POPULATE where the kernel refuses that). */
uint32_t kv_map_fd(int fd, uint64_t len, uint64_t *addr);

/* Validate and start a job of `nsegs` segments (KV_SEG_WORDS words each).
 * If the job moves at most `inline_max` bytes it is copied now, on this
 * thread: *done is set to 1, the status is returned and no completion is
 * posted. Otherwise *done is 0, KV_LLM_SUCCESS is returned and a completion
 * follows. A validation failure returns its status and starts nothing.
 * A job of at most `inline_max` bytes that reads or writes another process's
 * memory (a KV_REGION_PROCESS region: CMA) is not copied on the calling thread:
 * that process can hold the copy inside the kernel for as long as it likes (a
 * page under its userfaultfd, or swapped out), and the caller is an event
 * loop. Nothing starts and KV_INLINE_REFUSED is returned (*done 0): submit it
 * again with inline_max 0, for the movers, whose stuck copies kv_core_reap
 * bounds.
 * A job's source and destination bytes should not overlap (same memory, within
 * one segment or across segments): movers copy chunk by chunk, concurrently, so
 * overlapping bytes come out unspecified (not checked; an inline job happens to
 * get memmove semantics per segment). */
uint32_t kv_core_submit(kv_core *core, uint64_t job_id, const uint64_t *segs, size_t nsegs,
                        uint64_t inline_max, int *done, uint64_t *nbytes);
/* The same, with a rank: movers claim chunks, and a TCP link sends frames, of
 * the lowest-rank job first (equal ranks in submission order), so an urgent job
 * overtakes a large one at the next chunk or frame. kv_core_submit is rank 0.
 * Movers serve every local/process job in one queue; each TCP link has its own. */
uint32_t kv_core_submit_ranked(kv_core *core, uint64_t job_id, const uint64_t *segs, size_t nsegs,
                               uint64_t inline_max, uint64_t rank, int *done, uint64_t *nbytes);

/* Mover leases (shm and CMA pushes, whose movers write into another process's
 * memory with no answer from it): a job submitted with a lease claims no chunk
 * once the lease has run out (`until_ns`, CLOCK_BOOTTIME) or was removed: it
 * fails KV_LLM_LINK_FAILED; chunks under way finish (at most one per mover).
 * An inline job checks it once, before copying. Ids start at 1, are never
 * reused; 0 means no lease. */
uint32_t kv_lease_add(kv_core *core, uint64_t until_ns, uint32_t *lease_id);
uint32_t kv_lease_renew(kv_core *core, uint32_t lease_id, uint64_t until_ns);
uint32_t kv_lease_remove(kv_core *core, uint32_t lease_id);
/* Movers copying a chunk of a job under the lease right now (reaped ones too:
 * their copy has not returned). After kv_lease_remove, 0 means no byte of ours
 * can reach the peer's memory any more (kvengine tells the peer so: protocol.md,
 * "Closing a shm link"). */
int kv_lease_busy(kv_core *core, uint32_t lease_id);
/* kv_core_submit_ranked with a lease (0: none; TCP jobs ignore it: their
 * link has its own, see kv_tcp_link_add). */
uint32_t kv_core_submit_leased(kv_core *core, uint64_t job_id, const uint64_t *segs, size_t nsegs,
                               uint64_t inline_max, uint64_t rank, uint32_t lease_id, int *done,
                               uint64_t *nbytes);
/* The general form (the three above are it with words = 5): `segs` holds
 * `nsegs` segments of `words` words each, KV_SEG_WORDS (1-D) or KV_SEG2_WORDS
 * (2-D: every segment of the job). A 2-D segment needs rows >= 1, row_bytes >=
 * 1 and, when rows > 1, src_stride >= row_bytes and dst_stride >= row_bytes
 * (rows never overlap), and every byte of every row inside its region
 * (overflow-safe); else KV_LLM_PARAM_INVALID and nothing moves. Movers copy
 * rows natively (chunks of up to chunk_bytes across rows; CMA with one
 * iovec per row, many rows a call), TCP pushes carry them natively; a
 * transport that does not declare 2-D support (UCX; TCP pulls) gets the
 * job's segments expanded into one 1-D segment per row at submit. */
uint32_t kv_core_submit_job(kv_core *core, uint64_t job_id, const uint64_t *segs, size_t nsegs, unsigned words,
                            uint64_t inline_max, uint64_t rank, uint32_t lease_id, int *done, uint64_t *nbytes);

/* Abort a queued or running job: its completion carries `status` (unless it
 * already failed) and is posted once no mover writes for it any more.
 * Returns KV_LLM_SUCCESS, or KV_LLM_PARAM_INVALID if the job is not live.
 * An abort that lands while the last chunks are being copied still succeeds:
 * the completion then carries `status` with nbytes up to the full size. */
uint32_t kv_core_abort(kv_core *core, uint64_t job_id, uint32_t status);

/* Movers whose current chunk has been inside its copy for `bound_ns` or more
 * (CLOCK_BOOTTIME): a process_vm_readv/writev that another process holds (its
 * page under userfaultfd, swapped out, or its memory being migrated) cannot be
 * interrupted, so the core stops waiting for it. Each such mover is retired (it
 * exits once its copy returns; a new mover takes its slot's place, while slots
 * last), and its job is completed for the caller now: a completion with
 * KV_LLM_LINK_FAILED is posted (flags 0: bytes of it went out), and a copy still
 * under way may finish later, in the other process's memory (push) or in this
 * process's destination rows (pull): at most one chunk per retired mover. The
 * job's own completion follows when its copies return (the caller, which
 * dropped the id, ignores it); until then it keeps its region references.
 * Writes up to `max` job ids (each once) into `ids`; returns how many. */
size_t kv_core_reap(kv_core *core, uint64_t bound_ns, uint64_t *ids, size_t max);

/* ---- TCP data plane (kv_tcp.c). One epoll I/O thread per core, started by
 * the first call below. Frames: docs/protocol.md. */

/* Listen for data connections on ip:port (port 0 picks one). Once per core:
 * a second call returns KV_LLM_PARAM_INVALID. */
uint32_t kv_tcp_listen(kv_core *core, const char *ip, uint16_t port, uint16_t *bound_port);
/* Declare link `link_id`: data connections presenting `token` are bound to it,
 * at most `nstreams` of them. Pushes keep at most `window` bytes (0: no limit)
 * sent but not yet CREDITed by the receiver (one chunk more at most).
 * The fence (docs/protocol.md, "Lease"): this end writes a peer's DATA into
 * place only under a lease the peer granted, `lease_ns` from when this end
 * asked (renewed every lease_ns / 4); a push aborted here whose ABORT_ACKs do
 * not all arrive within `fence_ns` fails the link; a push of a failed link
 * that was not fenced completes only at (last lease granted to the peer) +
 * lease_ns + margin_ns. A payload in progress or pending output that makes no
 * progress for 2 * fence_ns fails the link. Both ends should agree on lease_ns
 * (kvengine: 0.4, 0.5, 0.05 * heartbeat_timeout). lease_ns and fence_ns: 1 ms .. 1 h. */
uint32_t kv_tcp_link_add(kv_core *core, uint32_t link_id, const uint8_t *token, int nstreams,
                         uint64_t window, uint64_t lease_ns, uint64_t fence_ns, uint64_t margin_ns);
/* Hand a connected TCP socket to the core as a stream of `link_id` (client
 * side). The core owns `fd` from here on, also on failure. When every stream
 * of the link is acknowledged, KV_EVENT_LINK_READY|link_id is posted. */
uint32_t kv_tcp_conn_add(kv_core *core, int fd, uint32_t link_id);
/* Close a link's streams (reset); its jobs complete with `status` (pushes not
 * fenced by the peer only at the lease release, see kv_tcp_link_add). */
uint32_t kv_tcp_link_close(kv_core *core, uint32_t link_id, uint32_t status);
/* Submit a tcp job (as kv_core_submit_leased) and drive it on the calling thread: the
 * I/O thread's round (its frames sent, the ACK read) run here, at most `bound_ns`, until
 * its completion, which is taken as kv_core_wait_take takes one (1, `out` filled). 0: not
 * complete within the bound, or the sockets were busy (the I/O thread carries it on; its
 * completion is polled as any other). -1: the submit failed or completed it at once
 * (*status). One driver at a time (the loop thread). */
int kv_tcp_submit_driven(kv_core *core, uint64_t job_id, const uint64_t *segs, size_t nsegs, uint32_t lease,
                         uint64_t bound_ns, kv_completion *out, uint32_t *status);

/* ---- UCX data plane (kv_ucx.c; built with -DKV_HAVE_UCX, otherwise every
 * call answers KV_LLM_FEATURE_NOT_ENABLED). One I/O thread per core owns the
 * UCP worker, started by the first call. Two-sided: every byte goes as a UCP
 * active message whose header (kv_ucx_hdr) the TARGET checks against its own
 * region table before a byte lands (docs/protocol.md, "UCX links"). No rkey is
 * ever given to a peer, and the UCP context has no RMA feature. */

#define KV_UCX_TOKEN 16            /* link token bytes (each direction has its own) */
#define KV_UCX_MAX_PULL (1ull << 30) /* the most one PULL_REQ may ask for */
#define KV_UCX_MAX_PULL2D (4ull << 20) /* ...and one PULL_REQ2D (the source packs its rows) */
#define KV_UCX_PEER_PULL2D 1u       /* kv_ucx_link_add peer_flags: the peer answers PULL_REQ2D */
#define KV_UCX_PEER_PULLV 2u        /* ...and PULL_REQV */
#define KV_UCX_PEER_PUSHV 4u        /* ...and takes PUSHV */
#define KV_UCX_MAX_PIECES 1024u     /* pieces of one PULL_REQV or PUSHV */

/* kv_ucx_hdr.type */
enum {
    KV_UCX_PUSH = 1,  /* payload for region/offset of the target; job: the pusher's; total: the push's bytes */
    KV_UCX_ACK,       /* target -> pusher: every byte of push `job` landed */
    KV_UCX_ABORT,     /* pusher -> target: drop push `job`'s data from now on */
    KV_UCX_ABORT_ACK, /* target -> pusher: nothing of push `job` lands any more */
    KV_UCX_PULL_REQ,  /* requester -> source: send len bytes at region/offset; job, tag: the requester's */
    KV_UCX_PULL_DATA, /* source -> requester: the answer to (job, tag); len bytes of payload */
    KV_UCX_LEASE_REQ, /* a target asks the peer for a lease; tag: its request number */
    KV_UCX_LEASE,     /* the grant of LEASE_REQ `tag`: the target may write pushes until (asked + lease) */
    KV_UCX_PUSH2D,    /* PUSH of whole rows (a kv_ucx_hdr2d): len bytes of rows of row_len bytes, packed,
                       * landing dst_stride apart from region/offset (a head range's rows of a block) */
    KV_UCX_PULL_REQ2D, /* PULL_REQ of whole rows (a kv_ucx_hdr2d): len bytes of rows of row_len bytes,
                        * dst_stride apart from region/offset in the SOURCE's region, answered by one
                        * PULL_DATA of the rows packed (len <= KV_UCX_MAX_PULL2D); sent only to a peer
                        * that announced it (KV_UCX_PEER_PULL2D) */
    KV_UCX_PULL_REQV, /* PULL_REQ of pieces: its payload 2..KV_UCX_MAX_PIECES kv_ucx_piece of region (offset
                       * 0), len their bytes in all (<= KV_UCX_MAX_PULL2D), answered by one PULL_DATA of
                       * them packed in order; sent only to a peer that announced it (KV_UCX_PEER_PULLV) */
    KV_UCX_PUSHV,     /* PUSH of pieces: its payload h.tag (2..KV_UCX_MAX_PIECES) kv_ucx_piece of region, then
                       * their len (<= KV_UCX_MAX_PULL2D) bytes packed in order; offset: the first piece's;
                       * with the 2-D header each piece is whole rows (row_len, dst_stride) there; sent
                       * only to a peer that announced it (KV_UCX_PEER_PUSHV) */
};

/* One piece of a PULL_REQV's or PUSHV's list, in the region of the message's receiver. */
typedef struct kv_ucx_piece {
    uint64_t offset, len;
} kv_ucx_piece;

/* The header of every message, 64 bytes, little-endian (host order: same-arch peers). */
typedef struct kv_ucx_hdr {
    uint8_t token[KV_UCX_TOKEN]; /* the receiver's token for this link */
    uint32_t type;               /* KV_UCX_* */
    uint32_t region;             /* PUSH(2D), PULL_REQ(2D): the receiver's region id (as announced); else 0 */
    uint64_t job;                /* the job id of the side that started the transfer */
    uint64_t offset;             /* PUSH(2D), PULL_REQ(2D): offset in that region (of the first row) */
    uint64_t len;                /* payload bytes (PUSH, PULL_DATA) or bytes asked for (PULL_REQ) */
    uint64_t total;              /* PUSH: the push's total bytes; else 0 */
    uint64_t tag;                /* PULL_REQ, PULL_DATA: the requester's request tag; LEASE_REQ, LEASE: seq */
} kv_ucx_hdr;

/* The header of KV_UCX_PUSH2D and KV_UCX_PULL_REQ2D, 80 bytes: the PUSH (PULL_REQ)
 * header, then the rows' geometry (rows = len / row_len; dst_stride >= row_len: the
 * rows' stride in the region of the message's receiver). kv_ucx_check gives every
 * PUSH and PULL_REQ this form: a 1-D one as one row (row_len = dst_stride = len). */
typedef struct kv_ucx_hdr2d {
    kv_ucx_hdr h;
    uint64_t row_len;
    uint64_t dst_stride;
} kv_ucx_hdr2d;

/* 1 if this build has the UCX transport. */
int kv_ucx_available(void);
/* This core's UCP worker address into `out` (capacity *len; *len set to its size). */
uint32_t kv_ucx_address(kv_core *core, uint8_t *out, size_t *len);
/* Register one of this engine's own caches' regions (LOCAL, F_EXPORT) with UCP
 * (ucp_mem_map, once; unmapped when the region is released), so that messages
 * from and into it are zero copy. Nothing is given to any peer. */
uint32_t kv_ucx_mem_map(kv_core *core, uint32_t region_id);
/* Declare link `link_id`: an endpoint to the peer's worker `addr`. Messages to
 * us must carry `rx_token`, ours carry `tx_token` (KV_UCX_TOKEN bytes each,
 * exchanged on the authenticated control channel; rx tokens are unique per
 * core). At most `window` bytes of data messages outstanding (0: no limit); an
 * aborted push whose ABORT_ACK does not come within `fence_ns` fails the link.
 * The lease, as tcp's (kv_tcp_link_add): this end writes a peer's push only
 * before (when it asked for the grant) + `lease_ns`, asking every lease_ns / 4;
 * a push of a failed link that was not fenced completes only at (our last grant
 * to the peer) + lease_ns + `margin_ns`. Both ends should agree on lease_ns.
 * lease_ns, fence_ns: 1 ms .. 1 h. `peer_flags`: what the peer said it serves
 * (KV_UCX_PEER_PULL2D: this end's pulls then ask for a 2-D segment's rows in
 * PULL_REQ2D, else the core expands them into rows; KV_UCX_PEER_PULLV: several
 * small 1-D segments in one PULL_REQV, else one PULL_REQ each; KV_UCX_PEER_PUSHV: several
 * small push segments packed in one PUSHV, else one PUSH or PUSH2D each). A failure of the link posts
 * KV_EVENT_LINK_DOWN|link_id. A peer's regions are KV_REGION_UCX regions
 * (kv_region_add: pid = link id, addr = the peer's region id). */
uint32_t kv_ucx_link_add(kv_core *core, uint32_t link_id, const uint8_t *addr, size_t len, const uint8_t *rx_token,
                         const uint8_t *tx_token, uint64_t window, uint64_t lease_ns, uint64_t fence_ns,
                         uint64_t margin_ns, unsigned peer_flags);
/* Close a link (forced): from now on nothing a peer sends on it is written;
 * its jobs complete with `status`. */
uint32_t kv_ucx_link_close(kv_core *core, uint32_t link_id, uint32_t status);
/* The target's check of one message (pure; caller holds the core's lock):
 * the header's size and type, its lengths against `data_len`, and for PUSH,
 * PUSH2D, PUSHV, PULL_REQ, PULL_REQ2D and PULL_REQV the region (this core's, LOCAL, F_EXPORT, not
 * removed) and every byte written or read inside it (the 2-D ones: each row; row_len divides len,
 * dst_stride >= row_len; a PULL_REQV: every piece of its list `data`, which must be
 * there: none empty, adding up to len; a PUSHV: the same of the list its payload `data`
 * begins with, the first piece at offset; a rendezvous PUSHV's payload is not at hand
 * (data NULL): its list is checked with kv_pieces_ok once received), overflow-safe. KV_LLM_SUCCESS with *out (the header;
 * row_len and dst_stride as for one row unless 2-D) and *addr (where the bytes
 * go or come from: the first row), else PARAM_INVALID or KV_CACHE_NOT_EXIST. The
 * token is checked by the caller (it picks the link). */
uint32_t kv_ucx_check(kv_core *core, const void *hdr, size_t hdr_len, const void *data, uint64_t data_len,
                      kv_ucx_hdr2d *out, uint64_t *addr);
/* 1 if every one of the `n` pieces {u64 offset, u64 len} at `list` (any alignment) lies
 * inside a region of `rlen` bytes: none empty; of rows (row > 0): whole rows of `row`
 * bytes, `stride` (>= row) apart, the last one inside (no product computed before it is
 * known to fit); else one run each; at most `max_rows` rows in all; their bytes adding
 * up to exactly `len`; overflow-safe (pure). The one check of a piece list on the wire:
 * tcp's DATAV and READV, UCX's PULL_REQV and PUSHV. */
int kv_pieces_ok(const void *list, uint64_t n, uint64_t rlen, uint64_t len, uint64_t row, uint64_t stride,
                 uint64_t max_rows);
/* Submit a ucx job (as kv_core_submit_leased, never inline) and drive it on the
 * calling thread: its messages posted and the worker progressed here, at most
 * `bound_ns`, until its completion, which is taken as kv_core_wait_take takes one
 * (1, `out` filled). 0: not complete within the bound, or the worker was busy (the
 * I/O thread carries it on; its completion is polled as any other). -1: the submit
 * failed or completed it at once (*status). One driver at a time (the loop thread). */
int kv_ucx_submit_driven(kv_core *core, uint64_t job_id, const uint64_t *segs, size_t nsegs, uint32_t lease,
                         uint64_t bound_ns, kv_completion *out, uint32_t *status);
/* Tests only: send a raw message (header and payload as given) on link
 * `link_id`, eager or rendezvous; returns once it was sent. */
uint32_t kv_ucx_test_send(kv_core *core, uint32_t link_id, const uint8_t *hdr, size_t hdr_len, const uint8_t *data,
                          size_t data_len, int rndv);

#endif
