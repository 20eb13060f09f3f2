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

Owns: the transfer's own progress (pieces in flight, status, deadline,
waiters); the scheduler's one timer calls ``_on_deadline`` when the deadline passes. It reports "finished" exactly once, to its owner (the scheduler,
through :class:`TransferOwner`), which does the accounting, the notification
and any link-down. Touches no engine state.
"""

from __future__ import annotations

import array
import asyncio
from time import perf_counter
from typing import TYPE_CHECKING, Any, Callable, Generator, Protocol

from .status import LLMStatusCode as S, error_for, to_status

if TYPE_CHECKING:
    from .link import Link
    from .plan import Packed

__all__ = ["Transfer", "TransferOwner", "What"]


# (operation, cluster id, cache id, request key or None, row): a transfer's words, unformatted
What = tuple[str, int, Any, Any, int]


class TransferOwner(Protocol):
    """What a transfer needs from the part that runs it (the scheduler)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def abort_job(self, job: int, status: int) -> None:
        """Abort a piece handed to the native core (it completes later, fenced)."""

    def finished(self, t: "Transfer", status: S, link: "Link | None") -> None:
        """Called once, when the transfer has its final status."""


class Counted(Protocol):
    """A cache a transfer keeps busy (local or remote: the in-flight count)."""
    users: int
    idle: asyncio.Future[None] | None

_SEG = 5  # words per segment: src_region, src_off, dst_region, dst_off, nbytes


class Transfer:
    """One push or pull in flight (or finished).

    ``status`` is ``None`` until done; ``nbytes`` counts bytes written into the
    destination; ``done()``, ``cancel()`` as for futures.
    """

    __slots__ = ("_owner", "_what", "_status", "_fut", "_link", "_refs", "_timeout",
                 "_message", "nbytes", "_segs", "_cur", "_off", "_left", "_jobs", "_fail", "_key",
                 "_notify", "_t_queued", "_t_started", "_total", "_inq", "_callbacks", "priority", "deadline",
                 "_rank", "_ran", "_lease", "_words", "_direct", "__weakref__")

    def __init__(self, owner: TransferOwner, what: "str | What") -> None:
        self._owner = owner
        self._what = what        # words for messages, formatted only when one is needed
        self._status: S | None = None
        self._fut: asyncio.Future[S] | None = None
        self._link: Link | None = None
        self._refs: tuple[Counted, ...] = ()
        self._timeout = 0.0
        self._message = ""
        self.nbytes = 0
        self._segs: Packed | None = None
        self._cur = 0          # word index of the next undispatched segment
        self._off = 0          # bytes of that segment already dispatched
        self._left = 0         # bytes not yet dispatched
        self._total = 0
        self._jobs: dict[int, int] = {}   # native job id -> bytes, pieces in flight
        self._fail: S | None = None       # first failure (or abort) status
        self._key: tuple[float, ...] = ()
        self._notify: bytes | None = None
        self._t_queued = 0.0
        self._t_started = 0.0
        self._inq = False      # counted in the scheduler's queued total
        self._callbacks: list[Callable[[S], None]] = []
        self.priority = 0
        self.deadline = 0.0
        self._rank = 0         # the native queue's order (scheduler.rank)
        self._ran = False      # some piece went out (not aborted unstarted)
        self._lease = 0        # the link's mover lease (shm pushes), 0 for none
        self._words = _SEG     # words per segment of _segs: 5, or 8 (2-D, kvengine/layout.py)
        self._direct: asyncio.Future[S] | None = None   # the raising API's own waiter (_result)

    @classmethod
    def failed(cls, owner: TransferOwner | None, what: str, status: int, message: str) -> "Transfer":
        """A transfer that failed before it reached a link (bad parameters, no link, an
        engine not started: ``owner`` None)."""
        t = cls(owner if owner is not None else _NO_OWNER, what)
        t._finish(status, 0, message)
        return t

    # ------------------------------------------------------------- scheduler side

    def _queue(self, link: Link, refs: tuple[Counted, ...], segs: Packed, total: int, timeout: float,
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
        for r in refs:
            r.users += 1

    def _next_piece(self, limit: int) -> tuple[Packed, int]:
        """Cut the next piece of at most ``limit`` bytes (whole segments, or a slice of one).
        All that is left, from the start: the packed plan itself, not a copy (O(1))."""
        segs, i, off = self._segs, self._cur, self._off
        assert segs is not None
        if i == 0 and off == 0 and self._left <= limit:
            n, self._cur, self._left = self._left, len(segs), 0
            return segs, n
        if self._words != _SEG:   # 2-D segments (a block's rows each) go whole: cut between them
            w, j, n = self._words, i, 0
            while j < len(segs) and (n == 0 or n + int(segs[j + 4]) * int(segs[j + 5]) <= limit):
                n += int(segs[j + 4]) * int(segs[j + 5])
                j += w
            self._cur, self._left = j, self._left - n
            return segs[i:j], n
        out = array.array("Q")
        n = 0
        while i < len(segs) and n < limit:
            seg_len = int(segs[i + 4]) - off
            take = min(seg_len, limit - n)
            out.extend((int(segs[i]), int(segs[i + 1]) + off, int(segs[i + 2]), int(segs[i + 3]) + off, take))
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
        """The deadline passed (the owner's timer): abort, ``LLM_TIMEOUT``."""
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
        for job in self._jobs:
            self._owner.abort_job(job, int(status))

    def _piece_done(self, job: int, status: int, nbytes: int, ran: bool) -> None:
        """A piece finished; ``ran``: some of it went out (False: aborted before it started)."""
        self._jobs.pop(job, None)
        if ran:
            self._ran = True
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
        if type(status) is S:   # the common cases without the general conversion
            st = status
        elif type(status) is int and status == 0:
            st = S.LLM_SUCCESS
        else:
            st = to_status(status)
        self._status = st
        self.nbytes = nbytes
        self._message = message
        link, self._link = self._link, None
        for r in self._refs:
            r.users -= 1
            if r.users == 0 and r.idle is not None:
                if not r.idle.done():
                    r.idle.set_result(None)
                r.idle = None
        self._refs = ()
        self._segs = None
        self._owner.finished(self, st, link)
        if self._fut is not None and not self._fut.done():
            self._fut.set_result(st)
        if self._direct is not None and not self._direct.done():
            self._direct.set_result(st)
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(st)

    # ---------------------------------------------------------------- public

    @property
    def what(self) -> str:
        """What the transfer is, in words ("push_kv_cache to cluster 2 cache 7")."""
        w = self._what
        if isinstance(w, str):
            return w
        op, cluster_id, cache_id, key, row = w
        where = (f"{key} (cluster {cluster_id} cache {cache_id} row {row})" if key is not None
                 else f"cluster {cluster_id} cache {cache_id}")
        return f"{op} {'to' if op.startswith('push') else 'from'} {where}"

    @property
    def status(self) -> S | None:
        return self._status

    def done(self) -> bool:
        return self._status is not None

    def add_done_callback(self, fn: Callable[[S], None]) -> None:
        """Call ``fn(status)`` when the transfer finishes (at once, if it has), on the
        loop thread."""
        if self._status is not None:
            fn(self._status)
        else:
            self._callbacks.append(fn)

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
            return f"{self.what} did not finish within {self._timeout:g} s; {started}"
        if self._status == S.LLM_CANCELLED:
            return f"{self.what} was cancelled; no byte of it lands after this status"
        if self._status == S.LLM_LINK_FAILED:
            if self._ran:
                return (f"{self.what}: the link to the peer was lost; no byte of it lands after this "
                        f"status (the peer acknowledged the abort, or its lease on the link expired)")
            return f"{self.what}: the link to the peer was lost"
        if self._status == S.LLM_NOT_YET_LINK:
            return f"{self.what}: the link was torn down"
        if self._status == S.LLM_ENGINE_FINALIZED:
            return f"{self.what}: the engine was closed"
        return f"{self.what} failed"

    def __await__(self) -> Generator[Any, None, S]:
        return self._wait().__await__()

    async def _wait(self) -> S:
        if self._status is None:
            await self._fenced()
        assert self._status is not None
        return self._status

    async def _fenced(self) -> None:
        """Wait for the completion without letting a cancellation of the waiter cancel it."""
        if self._status is None:
            if self._fut is None:
                self._fut = self._owner.loop.create_future()
            await asyncio.shield(self._fut)

    async def _result(self) -> S:
        if self._status is None:
            try:
                if self._direct is None:
                    # the first raising waiter awaits a future of its own, unshielded: a
                    # cancellation cancels only that future (one loop pass less than shield)
                    self._direct = self._owner.loop.create_future()
                    await self._direct
                else:
                    await self._fenced()
            except asyncio.CancelledError:
                self._abort(S.LLM_CANCELLED)
                while self._status is None:  # the fence: bounded (heartbeat_timeout at most)
                    try:
                        await self._fenced()
                    except asyncio.CancelledError:
                        continue
                raise
        st = self._status
        assert st is not None
        if st == S.LLM_SUCCESS:
            return S.LLM_SUCCESS
        raise error_for(st, self.message())

    def __repr__(self) -> str:
        st = self._status.name if self._status is not None else "running"
        return f"<Transfer {self.what}: {st}, {self.nbytes} bytes>"


class _NoOwner:
    """The owner of transfers that failed before an engine ran them."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def abort_job(self, job: int, status: int) -> None:
        pass

    def finished(self, t: Transfer, status: S, link: "Link | None") -> None:
        pass


_NO_OWNER = _NoOwner()
