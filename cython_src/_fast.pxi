# Included by _native.pyx (uvloop's layout: one extension, several source files), so the
# fast path reaches Core's kv_core pointer and the C submit with no Python call between.
#
# The loop thread's hot path of small transfers, in C:
#
# - Histogram, Counts: the accounting's latency histograms and counters (kvengine/stats.py
#   builds on them); a record is a few C additions, never a Python call.
# - FastPath: an awaited push_kv_cache / pull_kv_cache of the common case, whole: the
#   checks of that case, the planned segments (the Planner's memo, kvengine/plan.py, is
#   the only source: a shape the Planner has not planned and memoized goes the Python
#   way), the inline submit and the accounting. Over tcp and ucx the same checks and memo, then
#   the scheduler's launch (kvengine/scheduler.py) with what Targets.submit would have
#   passed it: the checks and the plan lookup of the Python path, skipped; except a ucx
#   push of at most 64 KiB with nothing else of its link in flight (one layer), which this
#   thread drives itself (kv_ucx_submit_driven: posted, UCX's worker progressed here until
#   the target's ACK, at most 200 us, then handed to the scheduler). Anything else
#   (a failure, an unusual argument, a local/shm transfer that is not inline) is answered
#   "not mine" and the Python path (kvengine/targets.py, scheduler.py) runs it, with every
#   rule and message it has.

from libc.math cimport frexp, pow, isfinite
from libc.string cimport memcpy
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

cdef extern from "<time.h>" nogil:
    enum: CLOCK_BOOTTIME
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.dict cimport PyDict_GetItem
from cpython.ref cimport PyObject

DEF HIST_N = 128
DEF MEMO_MAX = 4096

cdef double _H_BASE = 1e-6
cdef double _H_STEP = pow(2.0, 0.25)


cdef inline double _now() noexcept nogil:
    """time.perf_counter()'s clock (CLOCK_MONOTONIC on Linux), in seconds."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


cdef inline long long _boot_ns() noexcept nogil:
    """The mover leases' clock (kvengine/link.py, boot_ns), in ns."""
    cdef timespec ts
    clock_gettime(CLOCK_BOOTTIME, &ts)
    return <long long>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef class Histogram:
    """Latency histogram with log buckets (ratio 2**0.25, from 1 us to ~1.2 h), in a C array.

    Bucket i holds (1e-6 * STEP**(i-1), 1e-6 * STEP**i]; an exact power of two belongs to
    the bucket below; at most 1 us (or not finite) is bucket 0."""
    cdef uint64_t c[HIST_N]
    cdef readonly uint64_t n
    cdef readonly double total

    cdef inline void add(self, double seconds) noexcept:
        cdef int e = 0, i
        cdef double m
        if not (seconds > _H_BASE) or not isfinite(seconds):
            i = 0
        else:
            m = frexp(seconds / _H_BASE, &e)   # m in [0.5, 1)
            i = 4 * (e - 1) + (1 if m <= 0.5946035575013605 else 2 if m <= 0.7071067811865476
                               else 3 if m <= 0.8408964152537145 else 4)
            if m == 0.5:
                i -= 1
            if i >= HIST_N:
                i = HIST_N - 1
        self.c[i] += 1
        self.n += 1
        self.total += seconds

    def record(self, double seconds):
        self.add(seconds)

    @property
    def counts(self):
        """The bucket counts, a list of HIST_N ints."""
        return [self.c[i] for i in range(HIST_N)]

    def upper(self, int i):
        """Upper edge of bucket ``i`` (seconds)."""
        return _H_BASE * pow(_H_STEP, i)

    def quantile(self, double q):
        """Upper edge of the bucket holding the q-quantile (seconds); 0 when empty."""
        if not self.n:
            return 0.0
        cdef double rank = q * self.n
        cdef uint64_t seen = 0
        cdef int i
        for i in range(HIST_N):
            seen += self.c[i]
            if seen >= rank and self.c[i]:
                return self.upper(i)
        return self.upper(HIST_N - 1)

    def summary(self):
        return {"count": self.n, "mean_s": self.total / self.n if self.n else 0.0,
                "p50_s": self.quantile(0.5), "p90_s": self.quantile(0.9), "p99_s": self.quantile(0.99)}


cdef class Counts:
    """Counters and histograms of finished transfers (every transfer, or one peer's).

    ``by_status`` is a dict name -> count in the order the statuses first occurred; the
    successes of the fast path are counted in C and folded into it when it is read."""
    cdef uint64_t _transfers, _bytes, _succ
    cdef bint _succ_keyed
    cdef dict _by_status
    cdef readonly Histogram queue, transfer, total
    cdef readonly dict hists

    def __cinit__(self):
        self._by_status = {}
        self.queue, self.transfer, self.total = Histogram(), Histogram(), Histogram()
        self.hists = {"queue": self.queue, "transfer": self.transfer, "total": self.total}

    cdef inline void success(self, uint64_t nbytes, double transfer_s) noexcept:
        """One inline transfer succeeded (queue time 0)."""
        self._transfers += 1
        self._bytes += nbytes
        if self._succ_keyed:
            self._succ += 1
        else:
            self._by_status["LLM_SUCCESS"] = self._by_status.get("LLM_SUCCESS", 0) + 1
            self._succ_keyed = True
        self.queue.add(0.0)
        self.transfer.add(transfer_s)
        self.total.add(transfer_s)

    def add(self, str name, uint64_t nbytes):
        """One finished transfer with status ``name`` and ``nbytes`` written."""
        self._transfers += 1
        self._bytes += nbytes
        self._by_status[name] = self._by_status.get(name, 0) + 1

    def times(self, double queue_s, double transfer_s, double total_s):
        """Its latency: the three phases, in seconds."""
        self.queue.add(queue_s)
        self.transfer.add(transfer_s)
        self.total.add(total_s)

    def _bench(self, uint64_t n, double seconds):
        """``n`` inline successes recorded as the fast path records one (kvengine bench loopcost)."""
        cdef uint64_t i
        for i in range(n):
            self.success(65536, seconds)

    @property
    def transfers(self):
        return self._transfers

    @property
    def bytes(self):
        return self._bytes

    @property
    def by_status(self):
        if self._succ:
            self._by_status["LLM_SUCCESS"] += self._succ
            self._succ = 0
        return self._by_status

    def summary(self):
        return {"transfers": self.transfers, "bytes": self.bytes, "by_status": dict(self.by_status),
                "latency": {k: h.summary() for k, h in self.hists.items()}}


cdef class _Plan:
    """A memoized packed plan, copied once into C memory."""
    cdef uint64_t *words
    cdef size_t nsegs
    cdef uint64_t total
    cdef object packed   # the memo's array (Scheduler.launch takes it)

    def __dealloc__(self):
        free(self.words)


cdef _Plan _plan_of(object packed, uint64_t total):
    cdef const uint64_t[::1] w = packed
    cdef _Plan p = _Plan.__new__(_Plan)
    cdef size_t n = w.shape[0]
    if n == 0 or n % kvc.KV_SEG_WORDS:
        return None
    p.words = <uint64_t *>malloc(n * sizeof(uint64_t))
    if p.words == NULL:
        raise MemoryError()
    memcpy(p.words, &w[0], n * sizeof(uint64_t))
    p.nsegs = n // kvc.KV_SEG_WORDS
    p.total = total
    p.packed = packed
    return p


cdef uint64_t _DRIVE_MAX = 65536   # tcp and ucx pushes up to this size the loop thread drives itself (one layer)
cdef long long _CMA_WAIT_NS = 200000   # how long the loop waits for a small CMA copy: what a peer holding it costs us
SMALL_CMA_WAIT_NS = _CMA_WAIT_NS      # (kvengine/scheduler.py waits as long)
cdef tuple _ALL_HEADS = (-1, -1)   # KvCacheExtParam head ranges by default (plan.py _ALL)


cdef inline tuple _what(bint pull, object cid, object cache_id, object row):
    """The transfer's description (kvengine/transfer.py What) for a push or pull of cache rows."""
    return ("pull_kv_cache" if pull else "push_kv_cache", cid, cache_id, None, row)


cdef inline bint _plain_range(object r):
    # the Planner memo's rule (plan._plain_range): exact types, so equal means identical
    return type(r) is range or (type(r) is tuple and len(<tuple>r) == 2 and type((<tuple>r)[0]) is int
                                and type((<tuple>r)[1]) is int)


cdef class FastPath:
    """An engine's hot path for awaited small pushes and pulls (see the top of _fast.pxi).

    ``push``/``pull`` answer None ("not mine": run the Python path), 0 (done: every byte
    landed, accounted), or the finished Transfer of a failed inline job (``failed``).
    """
    cdef Core core
    cdef object loop, get_loop, jobs, options, peer, failed, launch, adopt, direct
    cdef object t_cache, t_index, t_ext
    cdef dict caches, links, memo, plans, by_link
    cdef Counts whole
    cdef readonly uint64_t taken       # transfers the fast path ran
    cdef long long lease_low_ns        # a shm push with less mover lease left goes the Python way
    cdef readonly uint64_t launched    # tcp and ucx transfers it handed to the scheduler's launch

    def __init__(self, loop, Core core, options, jobs, caches, links, memo, Counts whole, peer, failed,
                 sched, long long lease_low_ns, t_cache, t_index, t_ext):
        """``jobs``: the scheduler's job-id iterator; ``caches``/``links``/``memo``: the
        registry's, the link manager's and the Planner's dicts (read only);
        ``peer(key)``: the accounting's Counts of ``(cluster id, transport)``;
        ``failed(link, what, lease, status, done, nbytes, t0)``: the finished Transfer;
        ``sched``: the Scheduler (its ``launch``, tcp and ucx links; ``direct`` and ``adopt``, a
        small CMA copy the movers did not finish within _CMA_WAIT_NS); ``lease_low_ns``: kvengine/link.py's
        lease_low_ns (a shm push with less mover lease left goes the Python way)."""
        import asyncio.events
        self.loop, self.core, self.options, self.jobs = loop, core, options, jobs
        self.get_loop = asyncio.events._get_running_loop
        self.caches, self.links, self.memo = caches, links, memo
        self.plans, self.by_link = {}, {}
        self.whole, self.peer, self.failed = whole, peer, failed
        self.launch, self.adopt, self.direct = sched.launch, sched.adopt, sched.direct
        self.t_cache, self.t_index, self.t_ext = t_cache, t_index, t_ext
        self.lease_low_ns = lease_low_ns

    def push(self, cache, where, src_batch_index, size, ext_param, timeout, priority, notify):
        if notify is not None:
            return None
        return self._go(False, cache, where, src_batch_index, size, ext_param, timeout, priority)

    def pull(self, where, cache, batch_index, size, ext_param, timeout, priority):
        return self._go(True, cache, where, batch_index, size, ext_param, timeout, priority)

    def forget(self):
        """Drop the plans copied from the memo (tests; the memo keys never repeat anyway)."""
        self.plans.clear()
        self.by_link.clear()

    cdef _Plan _plan_for(self, object key):
        """The native plan of memo ``key`` (copied from the Planner's memo once), or None:
        not planned yet (the Planner checks and memoizes it first), or not 1-D."""
        cdef PyObject *o = PyDict_GetItem(self.plans, key)
        if o != NULL:
            return <_Plan>o
        o = PyDict_GetItem(self.memo, key)
        if o == NULL:
            return None
        hit = <object>o
        cdef _Plan plan = _plan_of(hit[0], hit[1])
        if plan is None:
            return None
        if len(self.plans) >= MEMO_MAX:
            self.plans.clear()
        self.plans[key] = plan
        return plan

    cdef void _succeeded(self, object link, str transport, uint64_t nbytes, double dt):
        """Account a transfer this path finished: the engine's and the peer's counters."""
        cdef PyObject *o = PyDict_GetItem(self.by_link, link)
        cdef Counts per
        if o != NULL:
            per = <Counts>o
        else:
            per = self.peer((link.cluster_id, transport))
            if len(self.by_link) >= 256:
                self.by_link.clear()
            self.by_link[link] = per
        self.whole.success(nbytes, dt)
        per.success(nbytes, dt)
        self.taken += 1

    cdef object _driven(self, bint tcp, link, state, rc, cid, row, key, timeout, priority):
        """A small tcp or ucx push with nothing else of its link in flight, driven by this
        thread (kv_tcp_submit_driven: the I/O thread's round run here, its frame sent and
        the ACK read; kv_ucx_submit_driven: its message posted and UCX's worker progressed
        here; either until the target's ACK, at most _CMA_WAIT_NS): 0 when it succeeded
        (accounted, no Transfer, no eventfd wake-up); a finished Transfer if it failed; the
        scheduler's Transfer of it (``adopt``) if it was not done in time; None: not this
        path."""
        cdef _Plan plan = self._plan_for(key)
        if plan is None:
            return None
        # nothing of the link in flight: the job goes out at once, whatever its rank
        if plan.total > _DRIVE_MAX or link.inflight or not self.direct(link):
            return None
        cdef uint32_t lease = link.lease_id
        cdef uint64_t job = next(self.jobs)
        cdef uint32_t st = 0
        cdef int r
        cdef kvc.kv_completion comp
        cdef double t0 = _now()
        with nogil:
            if tcp:
                r = kvc.kv_tcp_submit_driven(self.core.c, job, plan.words, plan.nsegs, lease, _CMA_WAIT_NS, &comp, &st)
            else:
                r = kvc.kv_ucx_submit_driven(self.core.c, job, plan.words, plan.nsegs, lease, _CMA_WAIT_NS, &comp, &st)
        if r < 0:
            return self.failed(link, _what(False, cid, rc.cache_id, row), lease, st, False, 0, t0)
        if r == 0:
            self.launched += 1
            return self.adopt(link, (state, rc), plan.packed, plan.total,
                              self.options.sync_kv_timeout if timeout is None else float(timeout), priority,
                              _what(False, cid, rc.cache_id, row), lease, job, t0)
        if comp.status != 0:
            return self.failed(link, _what(False, cid, rc.cache_id, row), lease, comp.status, True, comp.nbytes, t0)
        self._succeeded(link, "tcp" if tcp else "ucx", comp.nbytes, _now() - t0)
        return 0

    cdef object _go(self, bint pull, object cache, object where, object batch, object size, object ext,
                    object timeout, object priority):
        cdef int ovf = 0
        cdef long long v
        cdef double tmo
        if self.core.c == NULL:
            return None
        if type(cache) is not self.t_cache or type(where) is not self.t_index:
            return None
        if type(batch) is not int or type(size) is not int or type(priority) is not int:
            return None
        v = PyLong_AsLongLongAndOverflow(priority, &ovf)
        if ovf or v < -1000 or v > 1000:
            return None
        if timeout is not None:   # types.check_timeout's rule, the plain cases only
            if type(timeout) is float:
                tmo = timeout
                if not (tmo > 0 and isfinite(tmo)):
                    return None
            elif type(timeout) is int:
                v = PyLong_AsLongLongAndOverflow(timeout, &ovf)
                if ovf or v <= 0:
                    return None
            else:
                return None
        v = PyLong_AsLongLongAndOverflow(size, &ovf)
        if ovf or (not pull and v != -1):
            return None
        cid, cache_id, row = where.cluster_id, where.cache_id, where.batch_index
        if type(cid) is not int or type(cache_id) is not int or type(row) is not int:
            return None
        cdef PyObject *o = PyDict_GetItem(self.caches, cache.cache_id)
        if o == NULL:
            return None
        state = <object>o
        if state.cache is not cache:
            return None
        o = PyDict_GetItem(self.links, cid)
        if o == NULL:
            return None
        link = <object>o
        transport = link.transport
        if link.up is not True or (transport != "local" and transport != "shm" and transport != "tcp"
                                   and transport != "ucx"):
            return None
        if self.get_loop() is not self.loop:   # on the engine's loop thread only
            return None
        o = PyDict_GetItem(link.remote, cache_id)
        if o == NULL:
            return None
        rc = <object>o
        if ext is None:
            ek = None
        else:
            if type(ext) is not self.t_ext:
                return None
            sr, dr, tn = ext.src_layer_range, ext.dst_layer_range, ext.tensor_num_per_layer
            if not (_plain_range(sr) and _plain_range(dr) and type(tn) is int):
                return None
            if ext.src_head_range != _ALL_HEADS or ext.dst_head_range != _ALL_HEADS:
                return None   # rows refuse head ranges: the Python path says so (plan.py)
            ek = (sr, dr, tn)
        if pull:
            key = ("lc", state.serial, rc.serial, row, batch, size, ek)
        else:
            key = ("pc", state.serial, rc.serial, batch, row, size, ek)
        if (transport == "tcp" or transport == "ucx") and not pull:
            r = self._driven(transport == "tcp", link, state, rc, cid, row, key, timeout, priority)
            if r is not None:
                return r
        if transport == "tcp" or transport == "ucx":   # Targets.submit's launch, its checks done above
            o = PyDict_GetItem(self.memo, key)
            if o == NULL:
                return None   # not planned yet: the Planner checks and memoizes it first
            hit = <object>o
            what = _what(pull, cid, rc.cache_id, row)
            self.launched += 1
            return self.launch(link, (state, rc), hit[0], hit[1],
                               self.options.sync_kv_timeout if timeout is None else float(timeout),
                               priority, None, what, 0 if pull else link.lease_id)
        cdef _Plan plan = self._plan_for(key)
        if plan is None:
            return None
        cdef uint64_t inline_max = self.options.inline_threshold
        if plan.total > inline_max:
            return None
        cdef uint32_t lease = 0 if pull else link.lease_id
        if lease and <long long>link.lease_until - _boot_ns() < self.lease_low_ns:
            return None   # after a stall of our loop: Targets renews the lease first
        cdef uint64_t job = next(self.jobs)
        cdef int done = 0
        cdef uint64_t nbytes = 0
        cdef uint32_t st
        cdef double t0 = _now()
        with nogil:   # the inline copy
            st = kvc.kv_core_submit_leased(self.core.c, job, plan.words, plan.nsegs, inline_max, 0, lease,
                                           &done, &nbytes)
        cdef kvc.kv_completion comp
        cdef int took = 0
        if st == kvc.KV_INLINE_REFUSED:
            # CMA: never copied on this thread (a peer can hold it in the kernel: kv_core.h).
            # The movers copy it; this thread waits for it at most _CMA_WAIT_NS and takes its
            # completion itself (no eventfd wake-up, no Transfer); past that, the scheduler
            # adopts the job (decisions.md #31)
            what = _what(pull, cid, rc.cache_id, row)
            tmo = self.options.sync_kv_timeout if timeout is None else float(timeout)
            if not self.direct(link):
                self.launched += 1
                return self.launch(link, (state, rc), plan.packed, plan.total, tmo, priority, None, what, lease)
            with nogil:
                st = kvc.kv_core_submit_leased(self.core.c, job, plan.words, plan.nsegs, 0, 0, lease,
                                               &done, &nbytes)
                if st == 0 and not done:
                    took = kvc.kv_core_wait_take(self.core.c, job, _CMA_WAIT_NS, &comp)
            if st != 0 or done:
                return self.failed(link, what, lease, st, done != 0, nbytes, t0)
            if not took:
                self.launched += 1
                return self.adopt(link, (state, rc), plan.packed, plan.total, tmo, priority, what, lease, job, t0)
            st, nbytes = comp.status, comp.nbytes
            done = 1
        if st != 0 or not done:
            what = _what(pull, cid, rc.cache_id, row)
            return self.failed(link, what, lease, st, done != 0, nbytes, t0)
        self._succeeded(link, transport, nbytes, _now() - t0)
        return 0


# ------------------------------------------------------------------ block tables, planned in C

from libc.stdint cimport int64_t
from libc.stdlib cimport qsort


cdef int _cmp_i64(const void *a, const void *b) noexcept nogil:
    cdef int64_t x = (<const int64_t *>a)[0], y = (<const int64_t *>b)[0]
    return (x > y) - (x < y)


def plan_blocks_packed(const int64_t[::1] sbl, const int64_t[::1] dbl, int64_t src_blocks, int64_t dst_blocks,
                       const uint64_t[:, ::1] reg, uint64_t src_stride, uint64_t dst_stride, uint64_t nbytes,
                       bint runs):
    """kvengine/plan.py's ``Planner.blocks`` for whole blocks, in one pass of C: the tables
    ``sbl -> dbl`` (int64, equal lengths) checked (ids in ``[0, *_blocks)``, no destination
    block twice), cut into runs where both advance by one (``runs``; else a segment per
    block: strided layouts), packed per tensor pair (``reg``: rows ``(src region, src
    offset, dst region, dst offset)``) into 5-word segments ``count * nbytes`` long,
    blocks ``*_stride`` bytes apart, a pair's last run merged with the next pair's first
    where they touch. Returns ``(flat uint64 array, bytes)``, or None if a rule is broken:
    plan.py then checks the tables itself and says which (it is the one place for the
    rules' messages)."""
    import numpy as _np
    cdef Py_ssize_t n = sbl.shape[0], p = reg.shape[0], i, k, m = 0, nr = 0
    cdef int64_t *srt
    if n == 0 or dbl.shape[0] != n or p == 0:
        return None
    for i in range(n):
        if sbl[i] < 0 or sbl[i] >= src_blocks or dbl[i] < 0 or dbl[i] >= dst_blocks:
            return None
    if n > 1:
        srt = <int64_t *>malloc(n * sizeof(int64_t))
        if srt == NULL:
            raise MemoryError()
        memcpy(srt, &dbl[0], n * sizeof(int64_t))
        qsort(srt, n, sizeof(int64_t), _cmp_i64)
        for i in range(1, n):
            if srt[i] == srt[i - 1]:
                free(srt)
                return None
        free(srt)
    for i in range(n):   # runs: a new one where either table does not advance by one
        if i == 0 or not runs or sbl[i] != sbl[i - 1] + 1 or dbl[i] != dbl[i - 1] + 1:
            nr += 1
    out = _np.empty(p * nr * 5, _np.uint64)
    cdef uint64_t[::1] o = out
    cdef uint64_t so, do_, ln
    cdef Py_ssize_t j
    for k in range(p):
        i = 0
        while i < n:
            j = i + 1
            if runs:
                while j < n and sbl[j] == sbl[j - 1] + 1 and dbl[j] == dbl[j - 1] + 1:
                    j += 1
            so = reg[k, 1] + <uint64_t>sbl[i] * src_stride
            do_ = reg[k, 3] + <uint64_t>dbl[i] * dst_stride
            ln = <uint64_t>(j - i) * nbytes
            if (i == 0 and m > 0 and o[5 * (m - 1)] == reg[k, 0] and o[5 * (m - 1) + 2] == reg[k, 2]
                    and o[5 * (m - 1) + 1] + o[5 * (m - 1) + 4] == so
                    and o[5 * (m - 1) + 3] + o[5 * (m - 1) + 4] == do_):
                o[5 * (m - 1) + 4] += ln   # touches the previous pair's last run: one segment
            else:
                o[5 * m] = reg[k, 0]
                o[5 * m + 1] = so
                o[5 * m + 2] = reg[k, 2]
                o[5 * m + 3] = do_
                o[5 * m + 4] = ln
                m += 1
            i = j
    return out[:5 * m], <uint64_t>n * nbytes * <uint64_t>p
