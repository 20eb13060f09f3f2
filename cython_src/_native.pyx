# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False
"""kvengine._native: the compiled core (one Core object per engine).

A thin, synchronous wrapper: no asyncio here. The engine registers
``Core.fileno()`` with ``loop.add_reader`` and calls ``Core.poll()`` when it
becomes readable. Every method returns LLM status codes as ints; the Python
layer turns them into exceptions (kvengine/status.py).

GIL: released only around calls that may copy bytes (``submit``, which copies
inline below the threshold), map memory (``map_fd``) or join threads (``close``).
"""

from libc.stdint cimport uint16_t, uint32_t, uint64_t, int32_t
from libc.stdlib cimport malloc, free
cimport kvc

import os
import warnings

REGION_LOCAL = kvc.KV_REGION_LOCAL
REGION_PROCESS = kvc.KV_REGION_PROCESS
REGION_TCP = kvc.KV_REGION_TCP
REGION_UCX = kvc.KV_REGION_UCX
UCX = kvc.kv_ucx_available() != 0   # built with the UCX transport
UCX_TOKEN = kvc.KV_UCX_TOKEN
SEG_WORDS = kvc.KV_SEG_WORDS
SEG2_WORDS = kvc.KV_SEG2_WORDS
F_UNMAP = kvc.KV_REGION_F_UNMAP
F_EXPORT = kvc.KV_REGION_F_EXPORT
F_NOTIFY = kvc.KV_REGION_F_NOTIFY
DONE_UNSTARTED = kvc.KV_DONE_UNSTARTED
INLINE_REFUSED = kvc.KV_INLINE_REFUSED
EVENT = kvc.KV_EVENT
EVENT_LINK_READY = kvc.KV_EVENT_LINK_READY
EVENT_LINK_DOWN = kvc.KV_EVENT_LINK_DOWN
EVENT_REGION_FREED = kvc.KV_EVENT_REGION_FREED
EVENT_ID_MASK = kvc.KV_EVENT_ID_MASK
EVENT_KIND_MASK = kvc.KV_EVENT_KIND_MASK
MAX_STREAMS = kvc.KV_MAX_STREAMS
TOKEN_BYTES = kvc.KV_TOKEN_BYTES

DEF POLL_BATCH = 512
DEF UCX_BLOB = 16384   # KV_UCX_MAX_BLOB


def map_fd(int fd, uint64_t length):
    """mmap a shared read-write view of ``fd``, faulted in for writing: ``(status, addr)``."""
    cdef uint64_t addr = 0
    cdef uint32_t st
    with nogil:  # MAP_POPULATE faults every page: long for large maps
        st = kvc.kv_map_fd(fd, length, &addr)
    return st, addr


def populate_write(unsigned char[::1] buf):
    """Fault every page of ``buf`` (a shared mapping) in for writing, the GIL released
    (kv_core.h ``kv_populate_write``): 0, or the errno (EINVAL: a kernel before 5.14)."""
    cdef int e = 0
    if buf.shape[0]:
        with nogil:
            e = kvc.kv_populate_write(&buf[0], buf.shape[0])
    return e


cdef class Core:
    """One native core: region table, mover threads, completion eventfd.

    Invariants: ``close()`` is idempotent and joins every mover; after it, only
    ``poll()`` and ``stats()`` are meaningful; ``release()`` (after the last
    ``poll()``) frees the core and its descriptors at once, and every method
    then answers LLM_ENGINE_FINALIZED (``stats()`` the last counters);
    ``__dealloc__`` of an unclosed core closes it and warns (uvloop's
    ResourceWarning rule).
    """
    cdef kvc.kv_core *c
    cdef bint closed
    cdef kvc.kv_completion *buf
    cdef object final_stats

    def __cinit__(self, int movers=2, uint64_t chunk_bytes=1 << 20):
        cdef uint32_t st = kvc.kv_core_new(&self.c, movers, chunk_bytes)
        if st != 0:
            self.c = NULL
            raise OSError(f"kv_core_new failed with status {st:#x}")
        self.buf = <kvc.kv_completion *>malloc(POLL_BATCH * sizeof(kvc.kv_completion))
        if self.buf == NULL:
            kvc.kv_core_free(self.c)
            self.c = NULL
            raise MemoryError()

    def __dealloc__(self):
        if self.c != NULL:
            if not self.closed:
                warnings.warn("unclosed kvengine Core", ResourceWarning)
            with nogil:
                kvc.kv_core_free(self.c)
            self.c = NULL
        free(self.buf)

    def fileno(self):
        return kvc.kv_core_fileno(self.c) if self.c != NULL else -1

    def region_add(self, int kind, int32_t pid, uint64_t addr, uint64_t length, unsigned flags=0):
        """Register memory (flags: F_UNMAP, F_EXPORT, F_NOTIFY); returns ``(status, region_id)``."""
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED, 0
        cdef uint32_t rid = 0
        cdef uint32_t st = kvc.kv_region_add(self.c, kind, pid, addr, length, flags, &rid)
        return st, rid

    def region_remove(self, uint32_t region_id):
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED
        return kvc.kv_region_remove(self.c, region_id)

    def region_pidfd(self, uint32_t region_id, int pidfd, uint64_t key=0):
        """Attach a pidfd of a REGION_PROCESS region's process (the core keeps a dup, one per
        nonzero ``key``: a link's regions share it): once that process has exited, CMA through
        its pid fails LLM_LINK_FAILED instead. Returns a status."""
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED
        return kvc.kv_region_pidfd(self.c, region_id, pidfd, key)

    def submit(self, uint64_t job_id, const uint64_t[::1] segs, uint64_t inline_max, uint64_t rank=0,
               uint32_t lease=0, unsigned words=kvc.KV_SEG_WORDS):
        """Start a job (TCP links send lower ``rank`` first; movers claim no chunk once ``lease``,
        from lease_add, has run out). ``words``: SEG_WORDS (1-D segments) or SEG2_WORDS (2-D:
        row_bytes, rows, src_stride, dst_stride after the offsets). Returns ``(status, done_inline,
        nbytes)``."""
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED, False, 0
        cdef int done = 0
        cdef uint64_t nbytes = 0
        cdef uint32_t st
        if (words != <unsigned>kvc.KV_SEG_WORDS and words != <unsigned>kvc.KV_SEG2_WORDS) or \
                segs.shape[0] == 0 or segs.shape[0] % words:
            return kvc.KV_LLM_PARAM_INVALID, True, 0
        cdef size_t nsegs = segs.shape[0] // words
        with nogil:  # may copy up to inline_max bytes on this thread
            st = kvc.kv_core_submit_job(self.c, job_id, &segs[0], nsegs, words, inline_max, rank, lease,
                                        &done, &nbytes)
        return st, done != 0, nbytes

    def lease_add(self, uint64_t until_ns):
        """A mover lease until ``until_ns`` (``time.clock_gettime_ns(time.CLOCK_BOOTTIME)``): returns ``(status, lease_id)``."""
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED, 0
        cdef uint32_t lid = 0
        cdef uint32_t st = kvc.kv_lease_add(self.c, until_ns, &lid)
        return st, lid

    def lease_renew(self, uint32_t lease_id, uint64_t until_ns):
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED
        return kvc.kv_lease_renew(self.c, lease_id, until_ns)

    def lease_remove(self, uint32_t lease_id):
        """Jobs under the lease claim no more chunks (they fail LLM_LINK_FAILED)."""
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED
        return kvc.kv_lease_remove(self.c, lease_id)

    def lease_busy(self, uint32_t lease_id):
        """Movers copying a chunk under the lease now (0 after lease_remove: none of our
        bytes can reach the peer any more)."""
        if self.c == NULL:
            return 0
        return kvc.kv_lease_busy(self.c, lease_id)

    def abort(self, uint64_t job_id, uint32_t status):
        """Fenced abort: the job's completion (with ``status``) follows once no byte can land."""
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED
        return kvc.kv_core_abort(self.c, job_id, status)

    def wait_take(self, uint64_t job_id, uint64_t bound_ns):
        """Wait (spinning, without the GIL) at most ``bound_ns`` for job ``job_id``'s
        completion and take it out of the queue ``poll`` drains: ``(job_id, status, nbytes,
        flags)``, or None at the bound (kv_core_wait_take)."""
        cdef kvc.kv_completion cp
        cdef int got = 0
        if self.c == NULL:
            return None
        with nogil:
            got = kvc.kv_core_wait_take(self.c, job_id, bound_ns, &cp)
        return (cp.job_id, cp.status, cp.nbytes, cp.flags) if got else None

    def reap(self, uint64_t bound_ns):
        """Movers whose copy has not returned for ``bound_ns`` (another process holds it):
        retired, their jobs completed LLM_LINK_FAILED now (kv_core_reap). Returns those
        job ids."""
        cdef uint64_t ids[64]
        cdef size_t n
        if self.c == NULL:
            return []
        with nogil:
            n = kvc.kv_core_reap(self.c, bound_ns, ids, 64)
        return [ids[i] for i in range(n)]

    def poll(self):
        """Reset the eventfd and return ready completions as ``[(job_id, status, nbytes, flags), ...]``."""
        if self.c == NULL:
            return []
        cdef size_t n, i
        out = []
        while True:
            n = kvc.kv_core_poll(self.c, self.buf, POLL_BATCH)
            for i in range(n):
                out.append((self.buf[i].job_id, self.buf[i].status, self.buf[i].nbytes, self.buf[i].flags))
            if n < POLL_BATCH:
                return out

    def close(self):
        """Abort every job (LLM_ENGINE_FINALIZED) and join the movers. Idempotent."""
        if self.c != NULL and not self.closed:
            self.closed = True
            with nogil:  # joins threads that finish their current chunk
                kvc.kv_core_close(self.c)

    def tcp_listen(self, str ip, uint16_t port):
        """Listen for data connections; returns ``(status, bound_port)``."""
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED, 0
        cdef uint16_t bound = 0
        cdef bytes b = ip.encode()
        cdef uint32_t st = kvc.kv_tcp_listen(self.c, b, port, &bound)
        return st, bound

    def tcp_link_add(self, uint32_t link_id, bytes token, int nstreams, uint64_t window=0,
                     double lease=0.8, double fence=1.0, double margin=0.1):
        """Declare a TCP link. ``lease``, ``fence``, ``margin`` in seconds (kvengine passes
        0.4, 0.5 and 0.05 * heartbeat_timeout; the defaults are those of the default 2 s)."""
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED
        if len(token) != kvc.KV_TOKEN_BYTES or not (0 <= lease <= 3600 and 0 <= fence <= 3600 and 0 <= margin <= 3600):
            return kvc.KV_LLM_PARAM_INVALID
        return kvc.kv_tcp_link_add(self.c, link_id, <const unsigned char *>token, nstreams, window,
                                   <uint64_t>(lease * 1e9), <uint64_t>(fence * 1e9), <uint64_t>(margin * 1e9))

    def tcp_conn_add(self, int fd, uint32_t link_id):
        """Hand a connected socket to the core (it owns ``fd`` from now on, also on failure)."""
        if self.c == NULL:
            os.close(fd)   # the core owned it from this call on
            return kvc.KV_LLM_ENGINE_FINALIZED
        return kvc.kv_tcp_conn_add(self.c, fd, link_id)

    def tcp_link_close(self, uint32_t link_id, uint32_t status):
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED
        return kvc.kv_tcp_link_close(self.c, link_id, status)

    def ucx_address(self):
        """This engine's UCP worker address (starts the UCX I/O thread): ``(status, bytes)``."""
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED, b""
        cdef unsigned char buf[UCX_BLOB]
        cdef size_t n = UCX_BLOB
        cdef uint32_t st
        with nogil:   # the first call creates the UCP context and worker
            st = kvc.kv_ucx_address(self.c, buf, &n)
        return st, (buf[:n] if st == 0 else b"")

    def ucx_mem_map(self, uint32_t region_id):
        """Register one of our exported regions with UCP for zero-copy messages (nothing
        is given to a peer): a status."""
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED
        cdef uint32_t st
        with nogil:
            st = kvc.kv_ucx_mem_map(self.c, region_id)
        return st

    def ucx_link_add(self, uint32_t link_id, bytes address, bytes rx_token, bytes tx_token,
                     uint64_t window=0, double fence=1.0, double lease=1.0, double margin=0.05,
                     bint peer_pull2d=False, bint peer_pullv=False, bint peer_pushv=False):
        """Declare a UCX link to the peer's worker ``address``: messages to us must carry
        ``rx_token``, ours carry ``tx_token`` (UCX_TOKEN bytes each); ``fence``, ``lease``
        and ``margin`` in seconds; ``peer_pull2d``: the peer answers PULL_REQ2D, so pulls
        ask for a 2-D segment's rows in one message; ``peer_pullv``: it answers PULL_REQV,
        so pulls ask for several small segments in one message; ``peer_pushv``: it takes
        PUSHV, so pushes send several small segments packed in one message (kv_core.h,
        kv_ucx_link_add)."""
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED
        if not (0.001 <= fence <= 3600 and 0.001 <= lease <= 3600 and 0 <= margin <= 3600) or not address \
                or len(rx_token) != UCX_TOKEN or len(tx_token) != UCX_TOKEN:
            return kvc.KV_LLM_PARAM_INVALID
        cdef const unsigned char *p = address
        cdef const unsigned char *rt = rx_token
        cdef const unsigned char *tt = tx_token
        cdef size_t n = len(address)
        cdef uint64_t f = <uint64_t>(fence * 1e9), ls = <uint64_t>(lease * 1e9), mg = <uint64_t>(margin * 1e9)
        cdef uint32_t st
        cdef unsigned flags = (kvc.KV_UCX_PEER_PULL2D if peer_pull2d else 0) | \
            (kvc.KV_UCX_PEER_PULLV if peer_pullv else 0) | (kvc.KV_UCX_PEER_PUSHV if peer_pushv else 0)
        with nogil:
            st = kvc.kv_ucx_link_add(self.c, link_id, p, n, rt, tt, window, ls, f, mg, flags)
        return st

    def ucx_test_send(self, uint32_t link_id, bytes header, bytes data=b"", bint rndv=False):
        """Tests only (a hostile peer): send one raw active message on a UCX link, the
        header and payload exactly as given."""
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED
        cdef const unsigned char *h = header
        cdef const unsigned char *d = data
        cdef size_t hn = len(header), dn = len(data)
        cdef uint32_t st
        with nogil:
            st = kvc.kv_ucx_test_send(self.c, link_id, h, hn, d, dn, rndv)
        return st

    def ucx_link_close(self, uint32_t link_id, uint32_t status):
        if self.c == NULL:
            return kvc.KV_LLM_ENGINE_FINALIZED
        return kvc.kv_ucx_link_close(self.c, link_id, status)

    def release(self):
        """Free a closed core now (its eventfd, listener, epoll, streams, peer mappings),
        rather than when the object is collected. Call it after the last ``poll()``."""
        if self.c != NULL and self.closed:
            self.final_stats = self.stats()
            with nogil:
                kvc.kv_core_free(self.c)
            self.c = NULL
            self.final_stats.update(regions_live=0, tcp_conns=0)   # freed with the core

    def stats(self):
        cdef kvc.kv_stats s
        if self.c == NULL:
            return dict(self.final_stats) if self.final_stats is not None else {}
        kvc.kv_core_stats(self.c, &s)
        return {
            "jobs_submitted": s.jobs_submitted, "jobs_inline": s.jobs_inline,
            "jobs_completed": s.jobs_completed, "jobs_aborted": s.jobs_aborted,
            "jobs_live": s.jobs_live, "bytes_moved": s.bytes_moved,
            "regions_live": s.regions_live, "wakeups": s.wakeups,
            "tcp_conns": s.tcp_conns, "tcp_bytes_sent": s.tcp_bytes_sent,
            "tcp_bytes_received": s.tcp_bytes_received, "tcp_bad_frames": s.tcp_bad_frames,
            "tcp_refused": s.tcp_refused, "tcp_links_failed": s.tcp_links_failed,
            "tcp_lease_expired": s.tcp_lease_expired, "tcp_fence_expired": s.tcp_fence_expired,
            "tcp_stalled": s.tcp_stalled, "tcp_accept_paused": s.tcp_accept_paused,
            "ucx_bad_msgs": s.ucx_bad_msgs, "ucx_refused": s.ucx_refused, "ucx_dropped": s.ucx_dropped,
            "ucx_bytes_sent": s.ucx_bytes_sent, "ucx_bytes_received": s.ucx_bytes_received,
            "ucx_lease_grants": s.ucx_lease_grants, "ucx_late_dropped": s.ucx_late_dropped,
            "ucx_rx_pending": s.ucx_rx_pending, "ucx_rx_orphans": s.ucx_rx_orphans,
            "ucx_stage_bytes": s.ucx_stage_bytes,
            "ucx_rx_staged": s.ucx_rx_staged,
            "ucx_rx_rows": s.ucx_rx_rows, "ucx_land_pread": s.ucx_land_pread, "ucx_land_pvw": s.ucx_land_pvw,
            "ucx_ep_closes": s.ucx_ep_closes, "ucx_ep_closing": s.ucx_ep_closing, "ucx_ep_kept": s.ucx_ep_kept,
            "ucx_ep_parked": s.ucx_ep_parked,
            "ucx_driven": s.ucx_driven,
            "ucx_drive_handed": s.ucx_drive_handed,
            "tcp_driven": s.tcp_driven, "tcp_drive_handed": s.tcp_drive_handed,
            "jobs_abandoned": s.jobs_abandoned, "movers_stuck": s.movers_stuck,
            "chunks_paired": s.chunks_paired, "tcp_row_reads": s.tcp_row_reads, "tcp_readv": s.tcp_readv, "ucx_row_pulls": s.ucx_row_pulls,
            "ucx_pullv": s.ucx_pullv,
            "ucx_pushv": s.ucx_pushv,
        }


include "_fast.pxi"   # the loop thread's hot path of small transfers, and the accounting's counters
