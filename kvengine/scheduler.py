"""The transfer scheduler: what moves next, in which order.

Every push and pull that does not run inline joins its link's queue, a heap
ordered by ``(-priority, deadline, arrival)`` (earliest deadline first within
a priority class; ``EngineOptions(scheduling="fifo")`` orders by arrival only,
the baseline of the load benchmark), and is handed to the native core from the
head of it with a rank: the same key packed in 64 bits (``rank()``). The core
keeps that order: the movers claim chunks, and a tcp link's I/O thread sends
frames, of the lowest rank first, so an urgent transfer overtakes a running one
at the next chunk or frame (``chunk_bytes``), never waiting for the rest of a
1 GiB push that started before it; tcp's wire is paced by ``tcp_window_bytes``.
So by default a transfer is handed over whole, at once: a Python wake-up per
piece would cost CPU the movers and I/O threads need (decisions.md #14). With
``max_inflight_bytes`` / ``piece_bytes`` set, the scheduler hands over pieces
of at most ``piece_bytes`` while the link's bytes in flight stay under the
budget. A transfer whose deadline passes before any of it went out resolves
``LLM_TIMEOUT`` without a byte moved. Cost per transfer: one heap push and pop,
one timer; no task per transfer.

Links are independent: each has its own queue (and budget, if set), and each
tcp link its own send queue and window, so a slow or dead tcp peer never holds
another link's work; local/shm copies of all links share the movers in rank
order.
"""

from __future__ import annotations

import array
import heapq
import itertools
import math
from time import perf_counter
from typing import Any

from .native import _native
from .status import LLMStatusCode as S, to_status
from .transfer import Transfer

__all__ = ["Histogram"]

_seq = itertools.count()
_NO_LIMIT = 1 << 62   # default budget and piece: the native queues keep the order
_UNSTARTED = _native.DONE_UNSTARTED
_RANK_DEADLINE = (1 << 52) - 1   # deadline in microseconds of the loop clock (142 years)


def rank(key: tuple) -> int:
    """A queue key packed for the native queue: FIFO keys (seq,) rank 0 (submission
    order); EDF keys (-priority, deadline, seq) rank by priority, then deadline (1 us)."""
    if len(key) == 1:
        return 0
    us = min(max(int(key[1] * 1e6), 0), _RANK_DEADLINE)
    return ((key[0] + 1000) << 52) | us


class Histogram:
    """Latency histogram with log buckets (ratio 2**0.25, from 1 us to ~1.2 h)."""

    __slots__ = ("counts", "n", "total")
    _BASE = 1e-6
    _STEP = 2 ** 0.25
    _N = 128

    def __init__(self) -> None:
        self.counts = [0] * self._N
        self.n = 0
        self.total = 0.0

    def record(self, seconds: float) -> None:
        # bucket i holds (BASE * STEP**(i-1), BASE * STEP**i]; frexp instead of log: this
        # runs three times per transfer, inline pushes included
        if seconds <= self._BASE:
            i = 0
        else:
            m, e = math.frexp(seconds / self._BASE)   # m in [0.5, 1)
            i = 4 * (e - 1) + (1 if m <= 0.5946035575013605 else 2 if m <= 0.7071067811865476
                               else 3 if m <= 0.8408964152537145 else 4)
            if m == 0.5:
                i -= 1   # an exact power of two belongs to the bucket below
            if i >= self._N:
                i = self._N - 1
        self.counts[i] += 1
        self.n += 1
        self.total += seconds

    def upper(self, i: int) -> float:
        return self._BASE * self._STEP ** i

    def quantile(self, q: float) -> float:
        """Upper edge of the bucket holding the q-quantile (seconds); 0 when empty."""
        if not self.n:
            return 0.0
        rank = q * self.n
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return self.upper(i)
        return self.upper(self._N - 1)

    def summary(self) -> dict:
        return {"count": self.n, "mean_s": self.total / self.n if self.n else 0.0,
                "p50_s": self.quantile(0.5), "p90_s": self.quantile(0.9), "p99_s": self.quantile(0.99)}


class _Scheduler:
    """Queueing half of KvEngine (mixin: uses the engine's core, loop and options)."""

    def _launch(self, link: Any, local: Any, remote: Any, segs: array.array, total: int, timeout: float,
                priority: int, notify: bytes | None, what: str, lease: int = 0) -> Transfer:
        """``lease``: the link's mover lease (shm pushes write into the peer's memory only
        while the peer keeps renewing it; links.py, "mover lease"), 0 for none."""
        t = Transfer(self, what)
        t._lease = lease
        opts = self.options
        now = self._loop.time()   # deadlines: the loop's clock (timers use it)
        if total <= opts.inline_threshold and link.transport != "tcp":
            # below a thread hand-off's cost: copy now, on this thread (local and shm only)
            t._link, t._notify = link, notify
            t._t_queued = t._t_started = perf_counter()   # latency: a fine clock (uvloop's ticks in ms)
            st, done, nbytes = self._core.submit(next(self._jobs), segs, opts.inline_threshold, 0, lease)
            assert done or st, "kv_core_submit copies a local job of at most inline_max bytes inline"
            t._finish(st, nbytes)
            return t
        if self._queued >= opts.max_queued:
            t._finish(S.LLM_OUT_OF_MEMORY, 0,
                      f"{what}: {self._queued} transfers queued already (EngineOptions.max_queued)")
            return t
        t._queue(link, (local, remote), segs, total, timeout, priority, notify, now)
        t._inq = True
        self._queued += 1
        seq = next(_seq)
        t._key = (seq,) if opts.scheduling == "fifo" else (-priority, t.deadline, seq)
        t._rank = rank(t._key)
        heapq.heappush(link.heap, (t._key, t))
        self._dispatch(link)
        return t

    def _dispatch(self, link: Any) -> None:
        """Feed the core from the head of the link's queue while the budget allows."""
        heap = link.heap
        budget = self.options.max_inflight_bytes or _NO_LIMIT
        piece = self.options.piece_bytes or _NO_LIMIT
        core, pending, jobs = self._core, self._pending, self._jobs
        while heap and link.inflight_bytes < budget and link.up:
            t = heap[0][1]
            if t._status is not None or t._left == 0:
                heapq.heappop(heap)
                continue
            segs, n = t._next_piece(piece)
            job = next(jobs)
            st, _, _ = core.submit(job, segs, 0, t._rank, t._lease)
            if not t._t_started:
                t._t_started = perf_counter()
            if st:
                t._left = 0
                t._abort(to_status(st))
                continue
            t._jobs[job] = n
            pending[job] = t
            link.inflight_bytes += n
            if t._left == 0:
                heapq.heappop(heap)

    def _on_completions(self, done: list) -> None:
        links = set()
        pending = self._pending
        for job_id, status, nbytes, flags in done:
            t = pending.pop(job_id, None)
            if t is not None:
                link = t._link
                t._piece_done(job_id, status, nbytes, not flags & _UNSTARTED)
                if link is not None:
                    links.add(link)
        for link in links:
            if link.heap:
                self._dispatch(link)

    # ------------------------------------------------------------- accounting

    def _account(self, t: Transfer, status: S, nbytes: int, link: Any) -> None:
        c = self._counts
        c["transfers"] += 1
        c["bytes"] += nbytes
        name = status.name
        c["by_status"][name] = c["by_status"].get(name, 0) + 1
        if link is None:
            return
        key = (link.cluster_id, link.transport)
        per = self._per_link.get(key)
        if per is None:
            per = self._per_link[key] = {"transfers": 0, "bytes": 0, "by_status": {}, **_new_hists()}
        per["transfers"] += 1
        per["bytes"] += nbytes
        per["by_status"][name] = per["by_status"].get(name, 0) + 1
        if t._t_queued:
            now = perf_counter()
            started = t._t_started or now
            for h in (self._hists, per):
                h["queue"].record(started - t._t_queued)
                h["transfer"].record(now - started)
                h["total"].record(now - t._t_queued)


def _new_hists() -> dict:
    return {"queue": Histogram(), "transfer": Histogram(), "total": Histogram()}
