"""The loop thread behind kvengine.sync, and the future it hands to threads.

Owns: starting an event loop on a daemon thread, stopping it with a bound
(``_shutdown``, also the facade's finalizer), and :class:`TransferFuture`, a
``concurrent.futures.Future`` bound to one Transfer on that loop. Touches no
engine state: it calls ``KvEngine.close()`` and the Transfer's public methods.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from .engine import KvEngine
from .status import LLMError, LLMStatusCode as S, error_for
from .transfer import Transfer

__all__ = ["TransferFuture", "new_loop"]


def new_loop(kind: str = "auto") -> tuple[str, asyncio.AbstractEventLoop]:
    """A fresh event loop: uvloop when installed (``"auto"``), or the one named."""
    if kind not in ("auto", "uvloop", "asyncio"):
        raise error_for(S.LLM_PARAM_INVALID, f"loop must be 'auto', 'uvloop' or 'asyncio', got {kind!r}")
    if kind != "asyncio":
        try:
            import uvloop
            return "uvloop", uvloop.new_event_loop()
        except ImportError:
            if kind == "uvloop":
                raise error_for(S.LLM_PARAM_INVALID, "loop='uvloop': uvloop is not installed") from None
    return "asyncio", asyncio.new_event_loop()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        asyncio.set_event_loop(None)


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, engine: KvEngine, bound: float) -> None:
    """Close ``engine`` on ``loop`` (at most ``bound`` seconds), stop the loop, join the thread.

    A module function holding no reference to the facade: it is the facade's
    ``weakref.finalize`` callback as well as the end of ``close()``.
    """
    if loop.is_closed():
        return
    if threading.current_thread() is thread:   # collected on its own loop thread: cannot wait here
        def stop(_: object = None) -> None:
            loop.stop()
        try:
            loop.create_task(engine.close()).add_done_callback(stop)
        except RuntimeError:
            loop.stop()
        return
    if loop.is_running():
        try:
            asyncio.run_coroutine_threadsafe(engine.close(), loop).result(bound)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError, RuntimeError, LLMError):
            pass
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:
            pass
    thread.join(bound if thread.is_alive() else None)
    if not thread.is_alive() and not loop.is_running():
        loop.close()


class TransferFuture(concurrent.futures.Future[S]):
    """A transfer started from a thread: resolves to its final ``LLMStatusCode`` (never raises one).

    ``cancel()`` aborts the transfer (as ``Transfer.cancel()``): the future then
    resolves ``LLM_CANCELLED`` once the abort is fenced; it is never in the
    ``cancelled()`` state. ``message()`` says why it failed, once done.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._loop = loop
        self._transfer: Transfer | None = None
        self._cancel_asked = False
        self._message = ""

    def _bind(self, t: Transfer) -> None:   # loop thread
        self._transfer = t
        if self._cancel_asked:
            t.cancel()
        t.add_done_callback(self._done)

    def _done(self, status: S) -> None:     # loop thread
        t = self._transfer
        if t is not None:
            self._message = t.message()
        self.set_result(status)

    def cancel(self) -> bool:
        if self.done():
            return False
        self._cancel_asked = True

        def abort() -> None:
            if self._transfer is not None:
                self._transfer.cancel()
        try:
            self._loop.call_soon_threadsafe(abort)
        except RuntimeError:   # loop stopped: the engine is closed, the transfer resolved with it
            return False
        return True

    def message(self) -> str:
        """Why the transfer failed ("" while running or on success)."""
        return self._message

    @property
    def nbytes(self) -> int:
        """Bytes written into the destination (final once done)."""
        t = self._transfer
        return t.nbytes if t is not None else 0
