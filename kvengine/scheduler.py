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
``LLM_TIMEOUT`` without a byte moved. Deadlines share one loop timer, armed for
the earliest: a transfer joins a heap of deadlines (``_deadlines``) and leaves it
when it is at the head and finished, so with deadlines in submission order a
transfer costs a heap push and pop and no timer of its own (a uvloop ``call_at``
and ``cancel`` cost ~2 us of the loop thread, a tenth of a tcp push's).
Cost per transfer: two heap pushes and pops; no task or timer per transfer.

Links are independent: each has its own queue (and budget, if set), and each
tcp link its own send queue and window, so a slow or dead tcp peer never holds
another link's work; local/shm copies of all links share the movers in rank
order.

Owns: the native job ids, the transfers in flight (job id -> Transfer), each
link's queue (``Link.heap``, ``Link.inflight``, ``Link.inflight_bytes``), the
queued count, the deadline heap and its timer. It is every Transfer's owner: a
finished transfer reports here once, and the scheduler does the accounting
(kvengine/stats.py), the push notification (the notifier) and the link-down a
lost peer calls for (the link manager, through ``on_link_failed``). Must not
touch the link table, the handshake or the cache registry.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from time import perf_counter
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from .layout import submit_form
from .native import _native
from .stats import Accounting
from .status import LLMStatusCode as S, to_status
from .transfer import Counted, Transfer, What
from .options import EngineOptions

if TYPE_CHECKING:
    from .link import Link
    from .plan import Packed

__all__ = ["Scheduler", "rank"]

log = logging.getLogger("kvengine")

_seq = itertools.count()
_NO_LIMIT = 1 << 62   # default budget and piece: the native queues keep the order
_UNSTARTED = _native.DONE_UNSTARTED
_INLINE_REFUSED = _native.INLINE_REFUSED
_SMALL_CMA_WAIT_NS = _native.SMALL_CMA_WAIT_NS   # the loop waits this long at most for a small CMA copy's completion
_RANK_DEADLINE = (1 << 52) - 1   # deadline in microseconds of the loop clock (142 years)


def rank(key: tuple[float, ...]) -> int:
    """A queue key packed for the native queue: FIFO keys (seq,) rank 0 (submission
    order); EDF keys (-priority, deadline, seq) rank by priority, then deadline (1 us)."""
    if len(key) == 1:
        return 0
    us = min(max(int(key[1] * 1e6), 0), _RANK_DEADLINE)
    return ((int(key[0]) + 1000) << 52) | us


class Notifier(Protocol):
    def send(self, link: "Link", payload: bytes) -> None:
        """A push with ``notify`` succeeded: tell its destination."""


class Scheduler:
    """Queues, native submission and completion of transfers (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, core: _native.Core, options: EngineOptions,
                 notifier: Notifier, accounting: Accounting) -> None:
        self._loop = loop
        self._core = core
        self._options = options
        self._notifier = notifier
        self._accounting = accounting
        self._jobs = itertools.count(1)
        self.pending: dict[int, Transfer] = {}   # native job id -> its transfer
        self.queued = 0                          # transfers waiting in link queues or in flight
        # the link manager's link_down(link, LLM_LINK_FAILED): a transfer found the peer gone
        self.on_link_failed: Callable[["Link"], None] = lambda link: None
        self._reaper: asyncio.TimerHandle | None = None   # armed while copies are in flight (_reap)
        # (deadline, id, transfer) of queued transfers; finished ones leave from the head
        self._deadlines: list[tuple[float, int, Transfer]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0   # the loop time the timer is armed for

    # ------------------------------------------------------- TransferOwner

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def abort_job(self, job: int, status: int) -> None:
        self._core.abort(job, status)

    def finished(self, t: Transfer, status: S, link: "Link | None") -> None:
        if t._inq:
            self.queued -= 1
            t._inq = False
            dl = self._deadlines
            while dl and dl[0][2]._status is not None:
                heapq.heappop(dl)
            if len(dl) > 64 + 2 * self.queued:   # finished ones behind a live head: drop them
                dl[:] = [e for e in dl if e[2]._status is None]
                heapq.heapify(dl)
        if link is not None:
            link.inflight.discard(t)
            if status == S.LLM_SUCCESS and t._notify is not None:
                self._notifier.send(link, t._notify)
            if status == S.LLM_LINK_FAILED and link.up:
                # the peer is gone (e.g. CMA found no such process): the whole link is
                self.on_link_failed(link)
        self._accounting.record(status, t.nbytes, None if link is None else (link.cluster_id, link.transport),
                                t._t_queued, t._t_started)

    # ------------------------------------------------------------ submission

    @property
    def jobs(self) -> "itertools.count[int]":
        """The native job ids (the fast path draws from the same counter)."""
        return self._jobs

    def inline_done(self, link: "Link", what: What, lease: int, status: int, done: bool, nbytes: int,
                    t0: float) -> Transfer:
        """An inline job the native fast path ran did not succeed: its Transfer, finished
        as :meth:`launch` finishes one (accounting, link-down, message)."""
        t = Transfer(self, what)
        t._lease, t._link = lease, link
        t._t_queued = t._t_started = t0
        assert done or status, "kv_core_submit copies a local job of at most inline_max bytes inline"
        t._finish(status, nbytes)
        return t

    def launch(self, link: "Link", refs: tuple[Counted, ...], segs: "Packed", total: int,
               timeout: float, priority: int, notify: bytes | None, what: "str | What", lease: int = 0) -> Transfer:
        """Start a transfer of the packed ``segs`` (``total`` bytes) on ``link``.

        ``refs``: the caches it keeps busy. ``lease``: the link's mover lease (shm
        pushes write into the peer's memory only while the peer keeps renewing it;
        kvengine/link.py, "mover lease"), 0 for none."""
        t = Transfer(self, what)
        t._lease = lease
        if isinstance(segs, np.ndarray) and segs.ndim == 2:   # 2-D segments (kvengine/layout.py)
            segs, t._words = submit_form(segs)
        opts = self._options
        if total <= opts.inline_threshold and link.transport not in ("tcp", "ucx"):
            # below a thread hand-off's cost: copy now, on this thread (local and shm only)
            t._link, t._notify = link, notify
            t._t_queued = t._t_started = perf_counter()   # latency: a fine clock (uvloop's ticks in ms)
            st, done, nbytes = self._core.submit(next(self._jobs), segs, opts.inline_threshold, 0, lease, t._words)
            if st != _INLINE_REFUSED:   # (CMA is never copied on this thread: the movers take it)
                assert done or st, "kv_core_submit copies a local job of at most inline_max bytes inline"
                t._finish(st, nbytes)
                return t
            t._link = t._notify = None
            small_cma = True
        else:
            small_cma = False
        if self.queued >= opts.max_queued:
            t._finish(S.LLM_OUT_OF_MEMORY, 0,
                      f"{t.what}: {self.queued} transfers queued already (EngineOptions.max_queued)")
            return t
        direct = self.direct(link)
        self._enqueue(t, link, refs, segs, total, timeout, priority, notify)
        if direct:
            segs, n = t._next_piece(_NO_LIMIT)   # nothing waits before it: no heap
            job = self._hand_over(link, t, segs, n)
            if job and small_cma:
                # a copy this thread would have made inline if the peer could not hold it:
                # wait for it a bounded moment and take its completion, without the
                # eventfd's wake-up (decisions.md #31)
                taken = self._core.wait_take(job, _SMALL_CMA_WAIT_NS)
                if taken is not None:
                    self.on_completions([taken])
            return t
        heapq.heappush(link.heap, (t._key, t))
        self._dispatch(link)
        return t

    def adopt(self, link: "Link", refs: tuple[Counted, ...], segs: "Packed", total: int, timeout: float,
              priority: int, what: What, lease: int, job: int, t0: float) -> Transfer:
        """The Transfer of ``job``, which the native fast path handed to the movers itself
        (a small CMA copy, kv_core.h KV_INLINE_REFUSED) and waited for in vain: in flight
        from now on, as if :meth:`launch` had handed it over. The fast path calls it only
        where launch would hand over at once (:meth:`direct`)."""
        t = Transfer(self, what)
        t._lease = lease
        self._enqueue(t, link, refs, segs, total, timeout, priority, None)
        segs, n = t._next_piece(_NO_LIMIT)
        t._t_queued = t._t_started = t0   # (the stats' clock: queued and handed over at once)
        self._adopted(link, t, job, n)
        return t

    def direct(self, link: "Link") -> bool:
        """Would :meth:`launch` hand a transfer on ``link`` to the core at once?"""
        opts = self._options
        return (not link.heap and not opts.max_inflight_bytes and not opts.piece_bytes and link.up
                and self.queued < opts.max_queued)

    def _enqueue(self, t: Transfer, link: "Link", refs: tuple[Counted, ...], segs: "Packed", total: int,
                 timeout: float, priority: int, notify: bytes | None) -> None:
        t._queue(link, refs, segs, total, timeout, priority, notify, self._loop.time())  # deadlines: the loop's clock
        dl = self._deadlines
        heapq.heappush(dl, (t.deadline, id(t), t))
        if self._timer is None or dl[0][0] < self._timer_at:
            self._arm(dl[0][0])
        link.inflight.add(t)
        t._inq = True
        self.queued += 1
        seq = next(_seq)
        t._key = (seq,) if self._options.scheduling == "fifo" else (-priority, t.deadline, seq)
        t._rank = rank(t._key)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        """The timer fired for ``_timer_at``: abort the transfers due by then (each as its
        own timer at its deadline would have), re-arm for the earliest one left."""
        self._timer = None
        dl, due = self._deadlines, []
        while dl and (dl[0][2]._status is not None or dl[0][0] <= self._timer_at):
            t = heapq.heappop(dl)[2]
            if t._status is None:
                due.append(t)
        for t in due:
            t._on_deadline()
        while dl and dl[0][2]._status is not None:
            heapq.heappop(dl)
        if dl and (self._timer is None or dl[0][0] < self._timer_at):
            self._arm(dl[0][0])

    def _hand_over(self, link: "Link", t: Transfer, segs: "Packed", n: int) -> int:
        """Give the core one piece (``n`` bytes) of ``t``: its job id; 0 if the core refused
        it (``t`` aborts)."""
        job = next(self._jobs)
        st, _, _ = self._core.submit(job, segs, 0, t._rank, t._lease, t._words)
        if not t._t_started:
            t._t_started = perf_counter()
        if st:
            t._left = 0
            t._abort(to_status(st))
            return 0
        self._adopted(link, t, job, n)
        return job

    def _adopted(self, link: "Link", t: Transfer, job: int, n: int) -> None:
        """``job`` (``n`` bytes of ``t``) is in the core: its completion finishes it."""
        t._jobs[job] = n
        self.pending[job] = t
        link.inflight_bytes += n
        if self._reaper is None and link.transport not in ("tcp", "ucx"):
            self._reaper = self._loop.call_later(self._options.heartbeat_interval, self._reap)

    def _reap(self) -> None:
        """Every heartbeat_interval while mover copies are in flight. A copy into or out of
        a peer's memory (CMA) that has not returned for heartbeat_timeout is held by that
        peer (its page under userfaultfd, or swapped out) and cannot be interrupted: the
        core retires its mover (a new one takes its place) and completes the job
        LLM_LINK_FAILED now, and the link fails (docs/reliability.md, "A peer that holds
        our copy")."""
        self._reaper = None
        bound = self._options.heartbeat_timeout
        for job in self._core.reap(int(bound * 1e9)):
            t = self.pending.get(job)
            link = t._link if t is not None else None
            if link is not None and link.up:
                log.warning("link %s: a copy into or out of the peer's memory has not returned for %.2f s "
                            "(heartbeat_timeout; the peer holds its pages): link failed, the copy thread "
                            "abandoned", link.cluster_id, bound)
                self.on_link_failed(link)
        if self.pending:
            self._reaper = self._loop.call_later(self._options.heartbeat_interval, self._reap)

    def _dispatch(self, link: "Link") -> None:
        """Feed the core from the head of the link's queue while the budget allows."""
        heap = link.heap
        budget = self._options.max_inflight_bytes or _NO_LIMIT
        piece = self._options.piece_bytes or _NO_LIMIT
        while heap and link.inflight_bytes < budget and link.up:
            t = heap[0][1]
            if t._status is not None or t._left == 0:
                heapq.heappop(heap)
                continue
            segs, n = t._next_piece(piece)
            if self._hand_over(link, t, segs, n) and t._left == 0:
                heapq.heappop(heap)

    def on_completions(self, done: list[tuple[int, int, int, int]]) -> None:
        """Native jobs finished: ``(job id, status, bytes, flags)`` each."""
        links = set()
        pending = self.pending
        for job_id, status, nbytes, flags in done:
            t = pending.pop(job_id, None)
            if t is not None:
                link = t._link
                if link is not None:
                    link.inflight_bytes -= t._jobs.get(job_id, 0)
                    links.add(link)
                t._piece_done(job_id, status, nbytes, not flags & _UNSTARTED)
        for link in links:
            if link.heap:
                self._dispatch(link)

    # ---------------------------------------------------------- links ending

    def stop_link(self, link: "Link", status: S) -> None:
        """The link is down: abort its transfers (fenced natively), forget its queue."""
        for t in list(link.inflight):
            t._abort(status)
        link.heap.clear()

    async def fence(self, transfers: list[Transfer], status: S) -> None:
        """Abort ``transfers`` and wait until none of them can write any more."""
        for t in transfers:
            t._abort(status)
        for t in transfers:
            await t._fenced()

    async def settle(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for transfers aborted without a fence: they resolve
        when the peer's lease on them has expired (natively, within heartbeat_timeout)."""
        waits = [asyncio.ensure_future(t._fenced()) for t in set(self.pending.values()) if t._status is None]
        if waits:
            _, late = await asyncio.wait(waits, timeout=timeout)
            for w in late:
                w.cancel()

    def close(self) -> None:
        """The core is closed and drained: nothing may be left; never leave a waiter."""
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for t in list(self.pending.values()):
            t._jobs.clear()
            t._finish(S.LLM_ENGINE_FINALIZED, t.nbytes)
        self.pending.clear()

    def link_summary(self, link: "Link") -> dict[str, int]:
        live = sum(1 for _, t in link.heap if t._status is None and t._left)
        return {"in_flight": len(link.inflight), "queue_depth": live, "inflight_bytes": link.inflight_bytes}
