"""Where a push or pull goes: the peer's cache and row its caller named, and launching it.

A transfer names the peer's side with a :class:`~kvengine.types.CacheIndex`
(cluster, cache id, row), a :class:`~kvengine.types.CacheKey` (the row the
cluster ``key.cluster_id`` bound to that key and announced; a key always names
a row of the cluster that bound it, whichever way the bytes go) or a
:class:`~kvengine.types.BlocksCacheKey` (cluster, cache id). This part
resolves the name against the link's tables (kvengine/tables.py) and hands
the planned transfer to the scheduler.

Ask once: a name the peer has not announced (yet: a cache or key announced a
moment ago may still be on the wire) makes the transfer ask the peer
(``cache_query``, one question per link and name in flight, shared by every
transfer that waits on it). The answer follows the announcement on the
channel, so after it the name resolves, or the transfer fails
``LLM_KV_CACHE_NOT_EXIST``; no answer within the transfer's timeout:
``LLM_TIMEOUT``. Such a transfer is a :class:`_Asking` handle returned at once;
it runs the real transfer after the answer, within what is left of its
timeout, and relays that transfer's status (and its fenced cancel). A name
that is known costs nothing more than before.

Owns: the questions in flight. Touches no table itself: the link manager
asks, the tables hold the answers, the scheduler runs the transfers.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import numpy as np

from . import plan
from .link import Key, Link, RemoteCache, lease_low
from .links import LinkManager
from .plan import Packed, Planner
from .registry import CacheRegistry, LocalCache
from .scheduler import Scheduler
from .status import LLMError, LLMStatusCode as S, error_for
from .tables import int_in
from .transfer import Transfer
from .options import EngineOptions
from .types import BlocksCacheKey, CacheIndex, CacheKey, param_invalid

__all__ = ["Targets", "Segments"]

_U64 = 2**64 - 1
# (planner, local cache, peer's cache, peer's row) -> (packed segments, bytes)
Segments = Callable[[Planner, LocalCache, RemoteCache, int], "tuple[Packed, int]"]
Name = tuple[str, Any]    # ("id", cache id) or ("key", key): what a cache_query asks for


class _Unannounced(Exception):
    def __init__(self, link: Link, name: Name) -> None:
        self.link, self.name = link, name


class Targets:
    """Resolve and launch transfers (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, cluster_id: int, options: EngineOptions,
                 registry: CacheRegistry, links: LinkManager, scheduler: Scheduler, planner: Planner) -> None:
        self._loop = loop
        self._cluster_id = cluster_id
        self._options = options
        self._registry = registry
        self._links = links
        self._scheduler = scheduler
        self._planner = planner
        self._asking: dict[tuple[int, str, Any], asyncio.Future[bool | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, op: str, cache: Any, where: Any, name: str, kinds: tuple[type, ...], timeout: Any,
               priority: Any, notify: Any, segments: Segments, asked: bool = False,
               renewed: bool = False) -> Transfer:
        """Check, resolve, plan and launch one push or pull; a failed check is a finished
        Transfer, an unannounced name one that asks first (``asked``: it did), a push whose
        mover lease ran low after a stall of ours one that renews it first (``renewed``)."""
        try:
            local = self._registry.get(cache)
            target: CacheIndex | CacheKey | BlocksCacheKey = where   # checked just below
            if not isinstance(where, kinds):
                raise param_invalid(f"{name} must be a {' or '.join(k.__name__ for k in kinds)}, "
                                    f"got {type(where).__name__}")
            tmo, prio, note = plan.transfer_options(timeout, self._options.sync_kv_timeout, priority, notify)
            link, rc, row, key = self._resolve(target, asked)
            segs, total = segments(self._planner, local, rc, row)
            push = op.startswith("push")
            if push and not renewed and lease_low(link, self._options.heartbeat_timeout):
                def renew(left: float) -> Transfer:
                    return self.submit(op, cache, where, name, kinds, left, priority, notify, segments,
                                       asked, renewed=True)
                return self._renew_first(op, link, tmo, renew)
            return self._scheduler.launch(link, (local, rc), segs, total, tmo, prio, note,
                                          (op, link.cluster_id, rc.cache_id, key, row),
                                          link.lease_id if push else 0)
        except _Unannounced as u:
            def again(left: float) -> Transfer:
                return self.submit(op, cache, where, name, kinds, left, priority, notify, segments, asked=True)
            return self._ask_first(op, u.link, u.name, tmo, again)
        except LLMError as e:
            return Transfer.failed(self._scheduler, op, e.status, e.message)

    def _resolve(self, where: CacheIndex | CacheKey | BlocksCacheKey, asked: bool
                 ) -> tuple[Link, RemoteCache, int, CacheKey | None]:
        """``(link, peer's cache, row, the key named or None)`` of a name, or raise
        (_Unannounced: ask)."""
        cluster_id = where.cluster_id
        link = self._links.get(cluster_id)
        if link is None:
            if cluster_id == self._cluster_id:
                raise param_invalid(f"cluster {cluster_id} is this engine: transfers need a peer")
            raise error_for(S.LLM_NOT_YET_LINK, f"cluster {cluster_id!r} is not linked")
        if isinstance(where, CacheKey):
            if where.is_padding:
                raise param_invalid(f"{where} is a padding key (req_id 2**64-1): it names no row")
            key: Key = where.wire()
            bound = link.keys.get(key)
            if bound is None:
                if asked or not link.up:
                    raise error_for(S.LLM_KV_CACHE_NOT_EXIST,
                                    f"cluster {cluster_id} has no row bound to {where} (asked it)")
                raise _Unannounced(link, ("key", key))
            rc, row = bound
            return link, rc, row, where
        cache_id = where.cache_id
        try:
            rc_or_none = link.remote.get(cache_id)   # numpy ints hash as ints
        except TypeError:
            rc_or_none = None
        if rc_or_none is None:
            ident = int(cache_id) if isinstance(cache_id, (int, np.integer)) and not isinstance(cache_id, bool) \
                else -1
            if asked or not link.up or not int_in(ident, 0, _U64):
                raise error_for(S.LLM_KV_CACHE_NOT_EXIST, f"cluster {cluster_id} has no cache {cache_id!r}"
                                                          + (" (asked it)" if asked else ""))
            raise _Unannounced(link, ("id", ident))
        row = where.batch_index if isinstance(where, CacheIndex) else 0
        return link, rc_or_none, row, None

    # ------------------------------------------------------------- asking

    def _ask_first(self, op: str, link: Link, name: Name, timeout: float,
                   again: Callable[[float], Transfer]) -> Transfer:
        what = f"cache {name[1]}" if name[0] == "id" else f"key {list(name[1])}"
        t = _Asking(_AskingOwner(self._scheduler),
                    f"{op} {'to' if op.startswith('push') else 'from'} cluster {link.cluster_id} {what}")
        t._timeout = timeout
        t.deadline = self._loop.time() + timeout
        fut = self._ask(link, name, timeout)
        task = self._loop.create_task(self._then(t, link, f"the peer did not say whether it has {what}", fut,
                                                 again))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return t

    def _renew_first(self, op: str, link: Link, timeout: float, again: Callable[[float], Transfer]) -> Transfer:
        """A push after a stall of our loop: the mover lease is renewed (a ping's pong, or
        the link goes down) before it starts, within its timeout."""
        t = _Asking(_AskingOwner(self._scheduler), f"{op} to cluster {link.cluster_id}")
        t._timeout = timeout
        t.deadline = self._loop.time() + timeout
        silent = "the peer did not renew our mover lease (run low after a stall of this process)"
        task = self._loop.create_task(self._then(t, link, silent, self._links.renew_lease(link), again))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return t

    def _ask(self, link: Link, name: Name, timeout: float) -> asyncio.Future[bool | None]:
        """The question in flight for ``name`` on ``link`` (asked now if none is)."""
        k = (link.serial, name[0], name[1])
        fut = self._asking.get(k)
        if fut is None:
            msg = {"id": name[1]} if name[0] == "id" else {"key": list(name[1])}
            fut = self._asking[k] = asyncio.ensure_future(
                self._question(link, msg, max(timeout, self._options.link_timeout)))
            fut.add_done_callback(lambda _: self._asking.pop(k, None))
        return fut

    async def _question(self, link: Link, msg: dict[str, Any], timeout: float) -> bool | None:
        reply = await self._links.query(link, msg, timeout)
        return None if reply is None else reply.get("found") is True

    async def _then(self, t: _Asking, link: Link, silent: str, fut: asyncio.Future[bool | None],
                    again: Callable[[float], Transfer]) -> None:
        """After the answer (or the deadline): launch the transfer, or fail it (``silent``: what
        the peer did not do in time). ``fut``: a question's answer, or a lease renewal (True:
        renewed); None while the link is up: no answer."""
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(t.deadline - self._loop.time(), 0.0))
        except asyncio.TimeoutError:
            pass
        if t.done():
            return   # cancelled while asking: nothing was launched
        left = t.deadline - self._loop.time()
        if not fut.done() or (fut.result() is None and link.up) or left <= 0:
            t._finish(S.LLM_TIMEOUT, 0, f"{t.what}: {silent} within the transfer's timeout "
                                        f"({t._timeout:g} s); nothing was sent")
            return
        inner = again(left)   # the link went down meanwhile: it says so
        t._inner = inner
        inner.add_done_callback(lambda st: t._finish(st, inner.nbytes, inner.message()))


class _Asking(Transfer):
    """A transfer that asks the peer before it starts; then relays the real one."""

    __slots__ = ("_inner", "_task")

    def __init__(self, owner: "_AskingOwner", what: str) -> None:
        super().__init__(owner, what)
        self._inner: Transfer | None = None
        self._task: asyncio.Task[None] | None = None

    def _abort(self, status: S) -> None:
        if self._status is not None:
            return
        if self._inner is not None:
            self._inner._abort(status)   # resolves through the relay, once fenced
        else:
            self._finish(status, 0)      # nothing launched: the answer will be ignored


class _AskingOwner:
    """The owner of an :class:`_Asking` transfer: the transfer it launched is the
    scheduler's (accounted there); one that ends before launching is accounted here."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._scheduler.loop

    def abort_job(self, job: int, status: int) -> None:
        pass

    def finished(self, t: Transfer, status: S, link: Link | None) -> None:
        if getattr(t, "_inner", None) is None:
            self._scheduler.finished(t, status, None)
