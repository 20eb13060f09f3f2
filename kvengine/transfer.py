"""Transfer: the handle of one push or pull.

``await transfer`` gives the final :class:`LLMStatusCode` and never raises a
status (cancelling the awaiting task does not cancel the transfer; call
``transfer.cancel()`` for that). The raising API (``engine.push_kv_cache``
...) awaits :meth:`Transfer._result`, where cancelling the awaiting task
*does* abort the transfer, and ``CancelledError`` propagates only after the
abort is fenced: no byte of the transfer can land after that.

A transfer moves as one or more native jobs ("pieces", at most
``EngineOptions.piece_bytes`` each) that the scheduler (kvengine/scheduler.py)
hands to the core in deadline order; it finishes when its last piece has.
"""

from __future__ import annotations

import array
import asyncio
from time import perf_counter
from typing import Any

from .status import LLMStatusCode as S, error_for, to_status

__all__ = ["Transfer"]

_SEG = 5  # words per segment: src_region, src_off, dst_region, dst_off, nbytes


class Transfer:
    """One push or pull in flight (or finished).

    ``status`` is ``None`` until done; ``nbytes`` counts bytes written into the
    destination; ``done()``, ``cancel()`` as for futures.
    """

    __slots__ = ("_engine", "_what", "_status", "_fut", "_timer", "_link", "_refs", "_timeout",
                 "_message", "nbytes", "_segs", "_cur", "_off", "_left", "_jobs", "_fail", "_key",
                 "_notify", "_t_queued", "_t_started", "_total", "_inq", "_on_done", "priority", "deadline",
                 "_rank", "_ran", "_lease", "__weakref__")

    def __init__(self, engine: Any, what: str) -> None:
        self._engine = engine
        self._what = what
        self._status: S | None = None
        self._fut: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._link = None
        self._refs: tuple = ()
        self._timeout = 0.0
        self._message = ""
        self.nbytes = 0
        self._segs: array.array | None = None
        self._cur = 0          # word index of the next undispatched segment
        self._off = 0          # bytes of that segment already dispatched
        self._left = 0         # bytes not yet dispatched
        self._total = 0
        self._jobs: dict[int, int] = {}   # native job id -> bytes, pieces in flight
        self._fail: S | None = None       # first failure (or abort) status
        self._key: tuple = ()
        self._notify: bytes | None = None
        self._t_queued = 0.0
        self._t_started = 0.0
        self._inq = False      # counted in the engine's queued total
        self._on_done = None   # callable(status), e.g. a layer stream's bookkeeping
        self.priority = 0
        self.deadline = 0.0
        self._rank = 0         # the native queue's order (scheduler.rank)
        self._ran = False      # some piece went out (not aborted unstarted)
        self._lease = 0        # the link's mover lease (shm pushes), 0 for none

    # ------------------------------------------------------------- scheduler side

    def _queue(self, link: Any, refs: tuple, segs: array.array, total: int, timeout: float,
               priority: int, notify: bytes | None, now: float) -> None:
        self._link = link
        self._refs = refs
        self._segs = segs
        self._total = self._left = total
        self._timeout = timeout
        self.priority = priority
        self.deadline = now + timeout
        self._notify = notify
        self._t_queued = perf_counter()   # stats clock; `now` is the loop's, for the deadline
        link.inflight.add(self)
        for r in refs:
            r._inflight += 1
        self._timer = self._engine._loop.call_at(self.deadline, self._on_deadline)

    def _next_piece(self, limit: int) -> tuple[array.array, int]:
        """Cut the next piece of at most ``limit`` bytes (whole segments, or a slice of one)."""
        segs, i, off = self._segs, self._cur, self._off
        out = array.array("Q")
        n = 0
        while i < len(segs) and n < limit:
            seg_len = segs[i + 4] - off
            take = min(seg_len, limit - n)
            out.extend((segs[i], segs[i + 1] + off, segs[i + 2], segs[i + 3] + off, take))
            n += take
            if take == seg_len:
                i += _SEG
                off = 0
            else:
                off += take
        self._cur, self._off = i, off
        self._left -= n
        return out, n

    def _on_deadline(self) -> None:
        self._timer = None
        self._abort(S.LLM_TIMEOUT)

    def _abort(self, status: S) -> None:
        """Stop: queued bytes are never sent; pieces in flight are aborted natively, and
        the transfer finishes once the last of them reported (the fence)."""
        if self._status is not None:
            return
        if self._fail is None:
            self._fail = status
        self._left = 0
        if not self._jobs:
            self._finish(self._fail, self.nbytes)
            return
        core = self._engine._core
        for job in self._jobs:
            core.abort(job, int(status))

    def _piece_done(self, job: int, status: int, nbytes: int, ran: bool) -> None:
        """A piece finished; ``ran``: some of it went out (False: aborted before it started)."""
        size = self._jobs.pop(job, 0)
        if ran:
            self._ran = True
        link = self._link
        if link is not None:
            link.inflight_bytes -= size
        self.nbytes += nbytes
        if status == S.LLM_LINK_FAILED and ran:
            # the core could not fence this piece (the peer never acknowledged the
            # abort): it completed once the peer's lease expired, and the link is gone.
            # Not LLM_TIMEOUT/LLM_CANCELLED, which promise a usable link.
            self._fail = S.LLM_LINK_FAILED
        if status and self._fail is None:
            self._abort(to_status(status))   # the other pieces stop too
            return
        if not self._jobs and (self._left == 0 or self._fail is not None) and self._status is None:
            self._finish(self._fail or S.LLM_SUCCESS, self.nbytes)

    def _finish(self, status: int, nbytes: int, message: str = "") -> None:
        if self._status is not None:
            return
        st = to_status(status)
        self._status = st
        self.nbytes = nbytes
        self._message = message
        engine = self._engine
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        link = self._link
        if self._inq:
            engine._queued -= 1
            self._inq = False
        if link is not None:
            link.inflight.discard(self)
            self._link = None
            if st == S.LLM_SUCCESS and self._notify is not None:
                engine._send_notify(link, self._notify)
            if st == S.LLM_LINK_FAILED and link.up:
                # the peer is gone (e.g. CMA found no such process): the whole link is
                engine._link_down(link, S.LLM_LINK_FAILED)
        for r in self._refs:
            r._inflight -= 1
            if r._inflight == 0 and r._idle is not None:
                if not r._idle.done():
                    r._idle.set_result(None)
                r._idle = None
        self._refs = ()
        self._segs = None
        engine._account(self, st, nbytes, link)
        if self._fut is not None and not self._fut.done():
            self._fut.set_result(st)
        if self._on_done is not None:
            cb, self._on_done = self._on_done, None
            cb(st)

    # ---------------------------------------------------------------- public

    @property
    def status(self) -> S | None:
        return self._status

    def done(self) -> bool:
        return self._status is not None

    def cancel(self) -> bool:
        """Abort the transfer; it resolves ``LLM_CANCELLED`` once fenced. False if already done."""
        if self._status is not None:
            return False
        self._abort(S.LLM_CANCELLED)
        return True

    def message(self) -> str:
        """Why the transfer failed, in words ("" while running or on success)."""
        if self._status is None or self._status == S.LLM_SUCCESS:
            return ""
        if self._message:
            return self._message
        if self._status == S.LLM_TIMEOUT:
            started = "it had not started" if not self._ran else \
                f"it was aborted and no byte of it lands after this status ({self.nbytes} bytes had landed)"
            return f"{self._what} did not finish within {self._timeout:g} s; {started}"
        if self._status == S.LLM_CANCELLED:
            return f"{self._what} was cancelled; no byte of it lands after this status"
        if self._status == S.LLM_LINK_FAILED:
            if self._ran:
                return (f"{self._what}: the link to the peer was lost; no byte of it lands after this "
                        f"status (the peer acknowledged the abort, or its lease on the link expired)")
            return f"{self._what}: the link to the peer was lost"
        if self._status == S.LLM_NOT_YET_LINK:
            return f"{self._what}: the link was torn down"
        if self._status == S.LLM_ENGINE_FINALIZED:
            return f"{self._what}: the engine was closed"
        return f"{self._what} failed"

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self) -> S:
        if self._status is None:
            await self._fenced()
        return self._status

    async def _fenced(self) -> None:
        """Wait for the completion without letting a cancellation of the waiter cancel it."""
        if self._status is None:
            if self._fut is None:
                self._fut = self._engine._loop.create_future()
            await asyncio.shield(self._fut)

    async def _result(self) -> S:
        if self._status is None:
            try:
                await self._fenced()
            except asyncio.CancelledError:
                self._abort(S.LLM_CANCELLED)
                while self._status is None:  # the fence: bounded (heartbeat_timeout at most)
                    try:
                        await self._fenced()
                    except asyncio.CancelledError:
                        continue
                raise
        if self._status == S.LLM_SUCCESS:
            return S.LLM_SUCCESS
        raise error_for(self._status, self.message())

    def __repr__(self) -> str:
        st = self._status.name if self._status is not None else "running"
        return f"<Transfer {self._what}: {st}, {self.nbytes} bytes>"
