"""Transfer: the handle of one push or pull.

``await transfer`` gives the final :class:`LLMStatusCode` and never raises a
status (cancelling the awaiting task does not cancel the transfer; call
``transfer.cancel()`` for that). The raising API (``engine.push_kv_cache``
...) awaits :meth:`Transfer._result`, where cancelling the awaiting task
*does* abort the transfer, and ``CancelledError`` propagates only after the
abort is fenced: no byte of the transfer can land after that.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .status import LLMStatusCode as S, error_for

__all__ = ["Transfer"]


class Transfer:
    """One push or pull in flight (or finished).

    ``status`` is ``None`` until done; ``nbytes`` counts bytes written into the
    destination; ``done()``, ``cancel()`` as for futures.
    """

    __slots__ = ("_engine", "_what", "_job", "_status", "_fut", "_timer", "_link", "_refs",
                 "_timeout", "_message", "nbytes", "__weakref__")

    def __init__(self, engine: Any, what: str) -> None:
        self._engine = engine
        self._what = what
        self._job = 0
        self._status: S | None = None
        self._fut: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._link = None
        self._refs: tuple = ()
        self._timeout = 0.0
        self._message = ""
        self.nbytes = 0

    # ------------------------------------------------------------------ engine side

    def _start(self, job: int, link: Any, refs: tuple, timeout: float) -> None:
        self._job = job
        self._link = link
        self._refs = refs
        self._timeout = timeout
        link.inflight.add(self)
        for r in refs:
            r._inflight += 1
        self._timer = self._engine._loop.call_later(timeout, self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer = None
        self._abort(S.LLM_TIMEOUT)

    def _abort(self, status: S) -> None:
        """Ask the native core to stop; the fenced completion finishes the transfer."""
        if self._status is None and self._job:
            self._engine._core.abort(self._job, int(status))

    def _finish(self, status: int, nbytes: int, message: str = "") -> None:
        if self._status is not None:
            return
        try:
            st = S(status)
        except ValueError:
            st = S.LLM_FAILED
        self._status = st
        self.nbytes = nbytes
        self._message = message
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        link = self._link
        if link is not None:
            link.inflight.discard(self)
            self._link = None
            if st == S.LLM_LINK_FAILED and link.up:
                # the peer is gone (e.g. CMA found no such process): the whole link is
                self._engine._link_down(link, S.LLM_LINK_FAILED)
        for r in self._refs:
            r._inflight -= 1
            if r._inflight == 0 and r._idle is not None:
                if not r._idle.done():
                    r._idle.set_result(None)
                r._idle = None
        self._refs = ()
        self._engine._account(st, nbytes)
        if self._fut is not None and not self._fut.done():
            self._fut.set_result(st)

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
            return (f"{self._what} did not finish within {self._timeout:g} s; it was aborted and no "
                    f"byte of it lands after this status ({self.nbytes} bytes had landed)")
        if self._status == S.LLM_CANCELLED:
            return f"{self._what} was cancelled; no byte of it lands after this status"
        if self._status == S.LLM_LINK_FAILED:
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
                while self._status is None:  # the fence: bounded by one native chunk
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
