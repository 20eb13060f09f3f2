"""The records a link is made of, and the clocks of its leases.

A :class:`Link` is one peer, linked. It is a record, not an actor: its fields
are grouped by the part that writes them (the link manager, kvengine/links.py;
the cache tables, kvengine/tables.py; the scheduler, kvengine/scheduler.py),
and no other part writes them. Nothing here does I/O.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import TYPE_CHECKING, Any, Coroutine, Protocol

from .status import LLMStatusCode as S
from .types import CacheDesc

if TYPE_CHECKING:
    from .transfer import Counted, Transfer

Message = dict[str, Any]
Key = tuple[int, int, int]   # a CacheKey on the wire and in tables: (cluster_id, req_id, model_id)


class Channel(Protocol):
    """A link's control channel (channels.SeqpacketChannel or channels.StreamChannel)."""

    async def send(self, msg: Message, fds: list[int] | tuple[int, ...] = ()) -> None: ...
    def send_nowait(self, msg: Message) -> None: ...
    async def recv(self) -> tuple[Message, list[int]] | None: ...
    def backlog(self) -> int: ...
    def progress(self) -> tuple[int, int]: ...
    def close(self) -> None: ...

__all__ = ["Link", "Key", "Channel", "RemoteCache", "Detached", "TaskSet", "wait_idle", "boot_ns", "mover_lease_ns",
           "lease_low", "lease_low_ns", "lease_waiters_done"]

_serials = itertools.count(1)


class RemoteCache:
    """A peer's cache as this engine reaches it: regions in this engine's core."""

    __slots__ = ("cache_id", "desc", "regions", "region_ids", "keep", "serial", "keys", "users", "idle")

    def __init__(self, cache_id: int, desc: CacheDesc, regions: list[tuple[int, int]],
                 region_ids: list[int], keep: Any) -> None:
        self.cache_id = cache_id
        self.desc = desc
        self.regions = regions        # per tensor: (region id, offset)
        self.region_ids = region_ids
        self.keep = keep              # the peer's Cache object (local transport) or None
        self.serial = next(_serials)
        self.keys: set[Key] = set()   # the peer's keys bound to rows of it (Link.keys)
        self.users = 0                # transfers using it (Transfer keeps the count)
        self.idle: asyncio.Future[None] | None = None


class Link:
    """One linked peer (see the module docstring for who writes what)."""

    __slots__ = ("cluster_id", "ch", "transport", "peer_pid", "peer_token", "pidfd", "address", "incarnation",
                 "serial",
                 "up", "closing", "gone", "reader", "beat", "pending", "requests", "last_rx", "tcp_id",
                 "ctl_handed", "ctl_since",
                 "lease_id", "lease_until", "lease_waiters",
                 "remote", "waiters", "keys", "told", "told_keys", "table_lock", "answering",
                 "heap", "inflight", "inflight_bytes")

    def __init__(self, cluster_id: int, ch: Channel, transport: str,
                 peer_pid: int, peer_token: str, address: str, pidfd: int | None = None,
                 incarnation: str = "") -> None:
        # set up by the handshake (kvengine/handshake.py, kvengine/accept.py)
        self.cluster_id = cluster_id
        self.ch = ch                  # SeqpacketChannel (local, shm) or StreamChannel (tcp)
        self.transport = transport
        self.peer_pid = peer_pid      # shm/local: from SO_PEERCRED on the Unix socket; tcp: 0
        self.peer_token = peer_token  # local: the peer engine's token (LOCAL_REGISTRIES); else ""
        self.pidfd = pidfd            # shm: a pidfd of the peer process (CMA regions name it)
        self.address = address
        self.incarnation = incarnation   # the peer engine's, from its hello or welcome
        self.serial = next(_serials)  # never reused: names this link's pidfd in the core
        # the link manager (kvengine/links.py)
        self.up = True
        self.closing = False          # an unlink is under way: EOF is expected
        self.gone: asyncio.Future[S] = asyncio.get_running_loop().create_future()   # done when down
        self.reader: asyncio.Task[None] | None = None
        self.beat: asyncio.Task[None] | None = None
        self.pending: dict[int, asyncio.Future[dict[str, Any] | None]] = {}   # request id -> reply
        self.requests = itertools.count(1)
        self.last_rx = 0.0
        self.ctl_handed, self.ctl_since = -1, 0.0   # control_stalled: bytes taken (-1: not looked yet), since
        self.tcp_id = 0               # native link id of the TCP or UCX data plane
        self.lease_id = 0             # shm: the core's mover lease for pushes into the peer (0: none)
        self.lease_until = 0          # its end, CLOCK_BOOTTIME ns
        self.lease_waiters: list[asyncio.Future[bool | None]] = []   # pushes waiting for it to be renewed
        # the cache tables (kvengine/tables.py)
        self.remote: dict[int, RemoteCache] = {}
        self.waiters: dict[int, list[asyncio.Future[S]]] = {}  # cache id -> wait_remote_cache futures
        self.keys: dict[Key, tuple[RemoteCache, int]] = {}     # the peer's keys -> (its cache, row)
        self.told: dict[int, set[Key]] = {}       # our caches the peer was told of -> their keys told
        self.told_keys: dict[Key, tuple[int, int]] = {}        # our keys the peer was told of -> (cache, row)
        self.table_lock = asyncio.Lock()          # orders what we tell the peer (tables.py)
        self.answering = 0                        # the peer's cache_query being answered
        # the scheduler (kvengine/scheduler.py)
        self.heap: list[tuple[tuple[float, ...], Transfer]] = []   # the link's queue
        self.inflight: set[Transfer] = set()
        self.inflight_bytes = 0       # bytes handed to the core, not yet completed

    def control_stalled(self, now: float) -> float:
        """Seconds our control messages have waited in our own queue while the peer took
        none of them (0.0: nothing waits, or the peer took some since the last look). A
        peer that pings but never reads would otherwise leave our senders waiting forever."""
        handed, waiting = self.ch.progress()
        if not waiting or handed != self.ctl_handed:
            self.ctl_handed, self.ctl_since = handed, now
            return 0.0
        return now - self.ctl_since


class Detached:
    """Stands in for a channel its caller still owns (closing it is the caller's job)."""

    def __init__(self, ch: Channel) -> None:
        self._ch = ch

    async def send(self, msg: Message, fds: list[int] | tuple[int, ...] = ()) -> None:
        raise ConnectionError("detached channel")

    def send_nowait(self, msg: Message) -> None:
        pass

    async def recv(self) -> tuple[Message, list[int]] | None:
        return None

    def backlog(self) -> int:
        return 0

    def progress(self) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None:
        pass


async def wait_idle(obj: "Counted") -> None:
    """Wait until no transfer is in flight on a cache (``users`` / ``idle``: transfer.Counted)."""
    if obj.users:
        if obj.idle is None:
            obj.idle = asyncio.get_running_loop().create_future()
        await asyncio.shield(obj.idle)


def boot_ns() -> int:
    """The mover leases' clock (the core's): CLOCK_BOOTTIME, which counts suspended time too."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def mover_lease_ns(heartbeat_timeout: float) -> int:
    """How long one echoed ping lets our movers write into a shm peer.

    The mover lease: on a shm link our movers write straight into the peer's
    memory, so a pushing process that was stopped mid-push and resumes after the
    peer dropped the link would go on writing rows the peer may already reuse.
    Each ping we send carries our clock; the peer echoes it in a pong; the lease
    then runs until that clock + this. The peer drops a silent link only after
    heartbeat_timeout without a message from us, and its last echo answered a ping
    it received (so after we sent it): by then the lease, shorter than
    heartbeat_timeout, is over, and our movers start no new chunk (the one in
    progress, at most chunk_bytes per mover, is the residue; docs/security.md).
    """
    return int(0.75 * heartbeat_timeout * 1e9)


def lease_low_ns(heartbeat_timeout: float) -> int:
    """Less mover lease left than this is low (lease_low; the fast path reads the same)."""
    return mover_lease_ns(heartbeat_timeout) // 2


def lease_low(link: Link, heartbeat_timeout: float) -> bool:
    """Has less than half of the mover lease on a shm link left? Only after a stall of our
    loop (pings renew it every third of it): a push then waits for a renewal first
    (Targets), or its movers would refuse it and fail a healthy link."""
    return bool(link.lease_id) and link.lease_until - boot_ns() < lease_low_ns(heartbeat_timeout)


def lease_waiters_done(link: Link, renewed: bool) -> None:
    """Wake the pushes that waited for the mover lease: True, renewed; None, the link is down."""
    waiters, link.lease_waiters = link.lease_waiters, []
    for fut in waiters:
        if not fut.done():
            fut.set_result(True if renewed else None)


class TaskSet:
    """Background tasks of an engine: each is cancelled when the engine closes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
