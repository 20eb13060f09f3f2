"""Destination notifications: a push's ``notify=b"..."`` reaches the destination
engine after the last byte of that push landed, and only if it succeeded.

The sender sends the notification on the link's control channel when the push
completes: for shm the bytes are in the destination's memory by then, for tcp
the destination's ACK said so. Decode workers use it to learn their KV arrived
without polling.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from .control import ProtocolError
from .status import LLMStatusCode as S, error_for

__all__ = ["Notification"]


@dataclass(frozen=True, slots=True)
class Notification:
    """A push's notify payload, as the destination engine received it."""
    payload: bytes
    cluster_id: int          # the engine that pushed
    received_at: float       # time.monotonic() on arrival


class _Notifications:
    """Notification half of KvEngine (mixin)."""

    def _notes_init(self) -> None:
        self._notes: collections.deque[Notification] = collections.deque()
        self._note_waiters: list[tuple[bytes | None, asyncio.Future]] = []
        self._note_counts = {"sent": 0, "received": 0, "dropped": 0}

    def _notes_stats(self) -> dict:
        return dict(self._note_counts, pending=len(self._notes))

    def _notes_close(self) -> None:
        """The engine is closing: every waiter ends (``wait_notification`` raises
        ``LLM_ENGINE_FINALIZED``, ``notifications()`` stops)."""
        waiters, self._note_waiters = self._note_waiters, []
        for _, fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _send_notify(self, link: Any, payload: bytes) -> None:
        """Tell the destination; called when the push completed successfully."""
        if not link.up:
            return
        msg = {"t": "notify", "p": payload.hex()}
        self._note_counts["sent"] += 1
        if not link.ch.send_nowait(msg):
            self._spawn(self._send_later(link, msg))

    async def _send_later(self, link: Any, msg: dict) -> None:
        try:
            await link.ch.send(msg)
        except (ConnectionError, ProtocolError):
            pass

    def _on_notify(self, link: Any, msg: dict) -> None:
        try:
            payload = bytes.fromhex(msg["p"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("bad notify message") from None
        note = Notification(payload, link.cluster_id, time.monotonic())
        self._note_counts["received"] += 1
        for i, (match, fut) in enumerate(self._note_waiters):
            if not fut.done() and (match is None or match == payload):
                del self._note_waiters[i]
                fut.set_result(note)
                return
        if len(self._notes) >= self.options.max_notifications:
            self._notes.popleft()
            self._note_counts["dropped"] += 1
        self._notes.append(note)

    async def wait_notification(self, match: bytes | None = None, timeout: float | None = None) -> Notification:
        """The next notification whose payload equals ``match`` (any, if None).

        Returns one already received if there is one. Raises ``LLMTimeoutError``
        after ``timeout`` seconds (default ``sync_kv_timeout``).
        """
        self._check_open()
        tmo = self._deadline(timeout)
        if match is not None and not isinstance(match, (bytes, bytearray)):
            raise error_for(S.LLM_PARAM_INVALID, "match must be bytes or None")
        match = bytes(match) if match is not None else None
        for i, note in enumerate(self._notes):
            if match is None or note.payload == match:
                del self._notes[i]
                return note
        fut = self._loop.create_future()
        entry = (match, fut)
        self._note_waiters.append(entry)
        try:
            note = await asyncio.wait_for(asyncio.shield(fut), tmo)
            if note is None:
                raise error_for(S.LLM_ENGINE_FINALIZED, "the engine was closed")
            return note
        except asyncio.TimeoutError:
            raise error_for(S.LLM_TIMEOUT, f"no notification {match!r} within {tmo:g} s") from None
        finally:
            if entry in self._note_waiters:
                self._note_waiters.remove(entry)
            if fut.done() and not fut.cancelled() and fut.result() is not None \
                    and asyncio.current_task().cancelling():
                self._notes.appendleft(fut.result())   # cancelled after delivery: keep it

    async def notifications(self) -> AsyncIterator[Notification]:
        """``async for note in engine.notifications():`` every notification, as it arrives
        (shares the buffer with :meth:`wait_notification`: each is delivered once).
        The iteration ends when the engine closes."""
        self._check_open()   # also: called from the engine's own loop
        while not self._closed:
            fut = self._loop.create_future()
            if self._notes:
                yield self._notes.popleft()
                continue
            entry = (None, fut)
            self._note_waiters.append(entry)
            try:
                note = await fut
            finally:
                if entry in self._note_waiters:
                    self._note_waiters.remove(entry)
            if note is None:   # the engine closed
                return
            yield note
