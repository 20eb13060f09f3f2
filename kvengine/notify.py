"""Destination notifications: a push's ``notify=b"..."`` reaches the destination
engine after the last byte of that push landed, and only if it succeeded.

The sender sends the notification on the link's control channel when the push
completes: for shm the bytes are in the destination's memory by then, for tcp
the destination's ACK said so. Decode workers use it to learn their KV arrived
without polling.

Delivery survives a failed link: each notification to a peer carries a sequence
number, and the sender keeps it until the peer's pings acknowledge it (``n``:
the highest delivered). When a link to the same peer engine (the same
incarnation) comes up again, the unacknowledged ones are sent again, and the
receiver delivers each sequence number once. So a success's notification
reaches the destination exactly once if the two engines link again; never for
a failure, never twice. Peers that restarted start over (their memory is gone).

Owns: the received notifications not yet taken, their waiters, the counters,
the unacknowledged notifications per peer and the last delivered per sender.
The link manager hands it each "notify" message; the scheduler asks it to send
one when a push succeeded. Touches no link state beyond sending on ``link.ch``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from .control import ProtocolError
from .plan import MAX_NOTIFY
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

    def __init__(self, loop: asyncio.AbstractEventLoop, max_buffered: int) -> None:
        self._loop = loop
        self._max = max_buffered
        self._notes: collections.deque[Notification] = collections.deque()
        self._waiters: list[tuple[bytes | None, asyncio.Future[Notification | None]]] = []
        self._counts = {"sent": 0, "received": 0, "dropped": 0, "resent": 0, "duplicates": 0, "lost": 0}
        self._closed = False
        self._out: dict[int, _Outbox] = {}               # peer cluster id -> what we sent it
        self._delivered: dict[int, tuple[str, int]] = {}  # sender cluster id -> (its incarnation, last seq)

    def stats(self) -> dict[str, int]:
        return dict(self._counts, pending=len(self._notes),
                    unacked=sum(len(ob.unacked) for ob in self._out.values()))

    def close(self) -> None:
        """The engine is closing: every waiter ends (``wait`` raises
        ``LLM_ENGINE_FINALIZED``, ``iterate()`` stops)."""
        self._closed = True
        waiters, self._waiters = self._waiters, []
        for _, fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _outbox(self, link: "Link") -> "_Outbox":
        ob = self._out.get(link.cluster_id)
        if ob is None or ob.incarnation != link.incarnation:
            if ob is not None:
                self._counts["lost"] += len(ob.unacked)   # the peer restarted: its memory is gone
            ob = self._out[link.cluster_id] = _Outbox(link.incarnation)
        return ob

    def send(self, link: "Link", payload: bytes) -> None:
        """Tell the destination; called when the push completed successfully."""
        if not link.up:
            return
        ob = self._outbox(link)
        ob.seq += 1
        msg = {"t": "notify", "p": payload.hex(), "s": ob.seq}
        ob.unacked.append((ob.seq, msg))
        if len(ob.unacked) > self._max:   # bounded: the oldest unacknowledged one is given up
            ob.unacked.popleft()
            self._counts["lost"] += 1
        self._counts["sent"] += 1
        self._put(link, msg)

    def _put(self, link: "Link", msg: dict[str, Any]) -> None:
        link.ch.send_nowait(msg)   # (in order behind what the channel holds: the receiver needs it)

    def acked(self, cluster_id: int, upto: Any) -> None:
        """The peer's ping said it delivered every notification up to ``upto``."""
        if isinstance(upto, bool) or not isinstance(upto, int) or upto < 0:
            raise ProtocolError(f"bad notification acknowledgement {upto!r}")
        ob = self._out.get(cluster_id)
        while ob is not None and ob.unacked and ob.unacked[0][0] <= upto:
            ob.unacked.popleft()

    def delivered(self, link: "Link") -> int | None:
        """What our pings acknowledge to the peer of ``link`` (None: nothing yet)."""
        d = self._delivered.get(link.cluster_id)
        return d[1] if d is not None and d[0] == link.incarnation else None

    def link_up(self, link: "Link") -> None:
        """A link is up: send again what the same peer engine has not acknowledged."""
        ob = self._out.get(link.cluster_id)
        if ob is None:
            return
        if ob.incarnation != link.incarnation:
            self._outbox(link)   # another engine under that id: start over
            return
        for _, msg in ob.unacked:
            self._counts["resent"] += 1
            self._put(link, msg)

    def on_message(self, link: "Link", msg: dict[str, Any]) -> None:
        """A "notify" message from the peer of ``link``: delivered once per sequence number."""
        p = msg.get("p")
        if not isinstance(p, str) or len(p) > 2 * MAX_NOTIFY:   # no buffering a peer's megabytes
            raise ProtocolError(f"bad notify payload (hex of at most {MAX_NOTIFY} bytes)")
        try:
            payload = bytes.fromhex(p)
        except ValueError:
            raise ProtocolError("bad notify message") from None
        seq = msg.get("s")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            raise ProtocolError(f"bad notify sequence number {seq!r}")
        cluster_id = link.cluster_id
        last = self._delivered.get(cluster_id)
        if last is not None and last[0] == link.incarnation and seq <= last[1]:
            self._counts["duplicates"] += 1   # sent again after a relink; delivered already
            return
        self._delivered[cluster_id] = (link.incarnation, seq)
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


class _Outbox:
    """Notifications sent to one peer engine and not acknowledged yet."""

    __slots__ = ("incarnation", "seq", "unacked")

    def __init__(self, incarnation: str) -> None:
        self.incarnation = incarnation
        self.seq = 0
        self.unacked: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()
