"""Destination notifications: a push's ``notify=b"..."`` reaches the destination
engine after the last byte of that push landed, and only if it succeeded.

The sender sends the notification on the link's control channel when the push
completes: for shm the bytes are in the destination's memory by then, for tcp
the destination's ACK said so. Decode workers use it to learn their KV arrived
without polling.

Owns: the received notifications not yet taken, their waiters, the counters.
The link manager hands it each "notify" message; the scheduler asks it to send
one when a push succeeded. Touches no link state beyond sending on ``link.ch``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Coroutine

from .control import ProtocolError
from .status import LLMStatusCode as S, error_for

if TYPE_CHECKING:
    from .link import Link

__all__ = ["Notification", "Notifier"]


@dataclass(frozen=True, slots=True)
class Notification:
    """A push's notify payload, as the destination engine received it."""
    payload: bytes
    cluster_id: int          # the engine that pushed
    received_at: float       # time.monotonic() on arrival


class Notifier:
    """Sends and receives push notifications (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_buffered: int,
                 spawn: Callable[[Coroutine[Any, Any, None]], object]) -> None:
        self._loop = loop
        self._max = max_buffered
        self._spawn = spawn
        self._notes: collections.deque[Notification] = collections.deque()
        self._waiters: list[tuple[bytes | None, asyncio.Future[Notification | None]]] = []
        self._counts = {"sent": 0, "received": 0, "dropped": 0}
        self._closed = False

    def stats(self) -> dict[str, int]:
        return dict(self._counts, pending=len(self._notes))

    def close(self) -> None:
        """The engine is closing: every waiter ends (``wait`` raises
        ``LLM_ENGINE_FINALIZED``, ``iterate()`` stops)."""
        self._closed = True
        waiters, self._waiters = self._waiters, []
        for _, fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def send(self, link: "Link", payload: bytes) -> None:
        """Tell the destination; called when the push completed successfully."""
        if not link.up:
            return
        msg = {"t": "notify", "p": payload.hex()}
        self._counts["sent"] += 1
        if not link.ch.send_nowait(msg):
            self._spawn(self._send_later(link, msg))

    @staticmethod
    async def _send_later(link: "Link", msg: dict[str, Any]) -> None:
        try:
            await link.ch.send(msg)
        except (ConnectionError, ProtocolError):
            pass

    def on_message(self, cluster_id: int, msg: dict[str, Any]) -> None:
        """A "notify" message from linked peer ``cluster_id``."""
        try:
            payload = bytes.fromhex(msg["p"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("bad notify message") from None
        note = Notification(payload, cluster_id, time.monotonic())
        self._counts["received"] += 1
        for i, (match, fut) in enumerate(self._waiters):
            if not fut.done() and (match is None or match == payload):
                del self._waiters[i]
                fut.set_result(note)
                return
        if len(self._notes) >= self._max:
            self._notes.popleft()
            self._counts["dropped"] += 1
        self._notes.append(note)

    async def wait(self, match: bytes | None, timeout: float) -> Notification:
        """The next notification whose payload equals ``match`` (any, if None)."""
        for i, note in enumerate(self._notes):
            if match is None or note.payload == match:
                del self._notes[i]
                return note
        fut: asyncio.Future[Notification | None] = self._loop.create_future()
        entry = (match, fut)
        self._waiters.append(entry)
        try:
            got = await asyncio.wait_for(asyncio.shield(fut), timeout)
            if got is None:
                raise error_for(S.LLM_ENGINE_FINALIZED, "the engine was closed")
            return got
        except asyncio.TimeoutError:
            raise error_for(S.LLM_TIMEOUT, f"no notification {match!r} within {timeout:g} s") from None
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
            task = asyncio.current_task()
            if fut.done() and not fut.cancelled() and task is not None and task.cancelling():
                kept = fut.result()
                if kept is not None:
                    self._notes.appendleft(kept)   # cancelled after delivery: keep it

    async def iterate(self) -> AsyncIterator[Notification]:
        """Every notification as it arrives, until the engine closes."""
        while not self._closed:
            if self._notes:
                yield self._notes.popleft()
                continue
            fut: asyncio.Future[Notification | None] = self._loop.create_future()
            entry = (None, fut)
            self._waiters.append(entry)
            try:
                note = await fut
            finally:
                if entry in self._waiters:
                    self._waiters.remove(entry)
            if note is None:   # the engine closed
                return
            yield note
