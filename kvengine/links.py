"""The link manager: the table of live links, and each link's life after its handshake.

Owns: the link table (cluster id -> :class:`~kvengine.link.Link`), the ids
being linked, ``wait_link`` waiters, the TCP data links' native ids, and each
live link's tasks: the reader (control messages), the heartbeat (and, on shm,
the mover lease it renews), requests and replies (``cache_query``: :meth:`LinkManager.query`),
unlink and link-down. It is the registry's and the key table's ``peers``: it
has the cache tables tell every live link of a cache or key change. The
handshake (kvengine/handshake.py, kvengine/accept.py) hands it a connected
link through :meth:`LinkManager.establish`; the cache tables
(kvengine/tables.py) hold what each peer announced; the scheduler aborts and
fences a link's transfers. Must not touch the registry's caches or the
scheduler's queues itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Awaitable, Callable

from .closing import ShmClosings
from .control import ProtocolError
from .dataplane import DataPlane
from .link import Key, Link, TaskSet, boot_ns, lease_waiters_done, mover_lease_ns
from .native import _native
from .notify import Notifier
from .registry import CacheRegistry, LocalCache
from .scheduler import Scheduler
from .status import LLMStatusCode as S, LinkResult, error_for, to_status
from .tables import CacheTables
from .options import EngineOptions

__all__ = ["LinkManager"]

log = logging.getLogger("kvengine")

class LinkManager:
    """Live links (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, core: _native.Core, options: EngineOptions,
                 cluster_id: int, registry: CacheRegistry, tables: CacheTables, scheduler: Scheduler,
                 notifier: Notifier, tasks: TaskSet) -> None:
        self._loop = loop
        self._core = core
        self._options = options
        self._cluster_id = cluster_id
        self._registry = registry
        self._tables = tables
        self._scheduler = scheduler
        self._notifier = notifier
        self._tasks = tasks
        self._links: dict[int, Link] = {}
        self._linking: set[int] = set()         # cluster ids whose handshake is under way
        self._waiters: dict[int, list[asyncio.Future[S]]] = {}   # wait_link
        self.data = DataPlane(loop, core, options, self._lost_stream)
        self.closings = ShmClosings(loop, core, tasks, options.heartbeat_timeout, options.link_timeout)
        self.closed = False

    def abandon(self, link: Link) -> None:
        """A link that never came up: release what it registered."""
        self._tables.drop(link)
        self.data.close(link, S.LLM_LINK_FAILED)
        _close_pidfd(link)
        link.ch.close()

    def _lost_stream(self, link: Link, why: str) -> None:
        """A data stream of a live link failed (the data plane says why)."""
        if link.up and not link.closing:
            log.warning("link %s <-> %s lost: %s", self._cluster_id, link.cluster_id, why)
            self.link_down(link, S.LLM_LINK_FAILED)
        # closing: an unlink is under way and finishes the link itself (the peer may
        # close its streams before its "ok" reached us)

    def get(self, cluster_id: Any) -> Link | None:
        return self._links.get(cluster_id)

    @property
    def table(self) -> dict[int, Link]:
        """cluster id -> link, for reading only (the native fast path looks links up in it)."""
        return self._links

    def links(self) -> list[Link]:
        return list(self._links.values())

    # ------------------------------------------------------------ reservations

    def busy(self, cluster_id: int) -> tuple[S, str] | None:
        """Why a link with ``cluster_id`` cannot be set up now, or None."""
        if self.closed:
            return S.LLM_LINK_FAILED, "engine closing"
        if cluster_id in self._links:
            return S.LLM_ALREADY_LINK, f"cluster {cluster_id} is already linked"
        if cluster_id in self._linking:
            return S.LLM_PROCESSING_LINK, f"a link with cluster {cluster_id} is being set up"
        return None

    def restarted(self, cluster_id: int, incarnation: str) -> bool:
        """True if ``cluster_id`` is linked, but to another incarnation of it (the peer
        engine restarted under the same id while we still hold its old link)."""
        link = self._links.get(cluster_id)
        return link is not None and link.incarnation != incarnation

    def drop_stale(self, cluster_id: int, incarnation: str) -> None:
        """Drop the link of an earlier incarnation of ``cluster_id`` (call only after the
        new one authenticated): its transfers resolve LLM_LINK_FAILED, its tables go."""
        link = self._links.get(cluster_id)
        if link is not None and link.incarnation != incarnation:
            log.warning("link %s <-> %s lost: cluster %s restarted (incarnation %s, now %s)", self._cluster_id,
                        cluster_id, cluster_id, link.incarnation, incarnation)
            self.link_down(link, S.LLM_LINK_FAILED)

    def reserve(self, cluster_id: int) -> None:
        self._linking.add(cluster_id)

    def release(self, cluster_id: int) -> None:
        self._linking.discard(cluster_id)

    # ----------------------------------------------------------- going live

    async def establish(self, link: Link, client: bool,
                        connect: Callable[[], Awaitable[S]] | None = None) -> S:
        """Exchange cache tables and go live on both ends.

        local/shm and the TCP server side send their table first; the TCP client reads
        the server's table, opens the data streams (``connect``), then sends its own.
        The server records the link, then says "up"; the client records it on "up", so
        when link_clusters returns both ends can transfer.
        """
        t_start = boot_ns()   # before our first message: the peer heard from us after this
        if connect is None:
            await self._tables.announce(link, list(self._registry), ready=True)
        status = await self._tables.read_table(link)
        if status == S.LLM_SUCCESS and connect is not None:
            status = await connect()
            if status == S.LLM_SUCCESS:
                await self._tables.announce(link, list(self._registry), ready=True)
        if status != S.LLM_SUCCESS:
            return status
        if client:
            item = await link.ch.recv()
            if item is None or item[0].get("t") != "up":
                msg = item[0] if item else {}
                log.warning("link to cluster %s refused: %s", link.cluster_id, msg.get("msg", "closed"))
                return to_status(msg.get("status"), S.LLM_LINK_FAILED)
        if self.closed or link.cluster_id in self._links:
            if not client:
                await link.ch.send({"t": "reject", "status": int(S.LLM_ALREADY_LINK), "msg": "already linked"})
            return S.LLM_ALREADY_LINK if not self.closed else S.LLM_ENGINE_FINALIZED
        if link.transport == "shm":
            # the first mover lease counts from before our first message of this exchange:
            # the peer's silence clock starts after it heard one (mover_lease_ns)
            until = t_start + mover_lease_ns(self._options.heartbeat_timeout)
            st, lid = self._core.lease_add(until)
            if st:
                log.warning("link to cluster %s: no mover lease (status %#x)", link.cluster_id, st)
                return to_status(st, S.LLM_LINK_FAILED)
            link.lease_id, link.lease_until = lid, until
        self._links[link.cluster_id] = link
        self.data.live(link)
        link.last_rx = self._loop.time()
        link.reader = self._tasks.spawn(self._read_link(link))
        link.beat = self._tasks.spawn(self._heartbeat(link))
        for fut in self._waiters.pop(link.cluster_id, ()):
            if not fut.done():
                fut.set_result(S.LLM_SUCCESS)
        if not client:   # (not awaited: nothing may run before the resends below, or a new
            link.ch.send_nowait({"t": "up"})   # notification would overtake them: dropped as seen)
        # caches registered while the tables were exchanged (sends only what the peer lacks)
        self._tasks.spawn(self._tables.announce(link, list(self._registry)))
        self._notifier.link_up(link)   # notifications the same peer engine has not acknowledged
        log.info("linked cluster %s <-> %s (%s)", self._cluster_id, link.cluster_id, link.transport)
        return S.LLM_SUCCESS

    async def wait_link(self, cluster_id: int, timeout: float) -> S:
        if cluster_id in self._links:
            return S.LLM_SUCCESS
        fut: asyncio.Future[S] = self._loop.create_future()
        waiters = self._waiters.setdefault(cluster_id, [])
        waiters.append(fut)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise error_for(S.LLM_TIMEOUT, f"cluster {cluster_id!r} did not link within {timeout:g} s") from None
        finally:
            if fut in waiters:
                waiters.remove(fut)
            if not waiters:
                self._waiters.pop(cluster_id, None)

    # ------------------------------------------------------------ a live link

    async def _read_link(self, link: Link) -> None:
        """Serve one link's control messages until it closes."""
        reason = "peer closed the control connection"
        try:
            while True:
                item = await link.ch.recv()
                if item is None:
                    break
                link.last_rx = self._loop.time()
                msg, fds = item
                t = msg["t"]
                if t != "cache_add":
                    for fd in fds:
                        os.close(fd)
                if t == "ping":
                    ts = msg.get("ts")
                    if ts is not None:   # the peer holds a mover lease: echo its clock at once
                        link.ch.send_nowait({"t": "pong", "ts": ts})
                    if "n" in msg:       # the notifications it delivered (notify.py)
                        self._notifier.acked(link.cluster_id, msg["n"])
                elif t == "pong":
                    self._on_pong(link, msg)
                elif t == "cache_add":
                    await self._tables.on_cache_add(link, msg, fds)
                elif t == "key_add":
                    self._tables.on_key_add(link, msg)
                elif t == "key_del":
                    self._tables.on_key_del(link, msg)
                elif t == "cache_query":
                    req, what = self._tables.check_query(link, msg)
                    self._tasks.spawn(self._tables.answer(link, req, what, self._options.link_timeout))
                elif t == "cache_del":
                    self._tasks.spawn(self._on_cache_del(link, msg))
                elif t == "unlink":
                    self._tasks.spawn(self._on_unlink(link, msg))
                elif t == "notify":
                    self._notifier.on_message(link, msg)
                elif t == "ok":
                    req = msg.get("req")
                    fut = link.pending.pop(req, None) if isinstance(req, int) else None
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                else:
                    raise ProtocolError(f"unknown control message {t!r}")
        except ProtocolError as e:
            reason = f"protocol error: {e}"
        except asyncio.CancelledError:
            reason = "engine closing"
            raise
        finally:
            if link.up and not link.closing:
                log.warning("link %s <-> %s lost: %s", self._cluster_id, link.cluster_id, reason)
                self.link_down(link, S.LLM_LINK_FAILED)

    def _on_pong(self, link: Link, msg: dict[str, Any]) -> None:
        """The peer echoed the clock of one of our pings: renew the mover lease from it
        (from when we asked, not from now: a pong read late after a stop is stale)."""
        ts = msg.get("ts")
        if isinstance(ts, bool) or not isinstance(ts, int) or not 0 < ts <= boot_ns():
            raise ProtocolError(f"bad pong {ts!r}")
        until = ts + mover_lease_ns(self._options.heartbeat_timeout)
        if link.lease_id and until > link.lease_until:
            link.lease_until = until
            self._core.lease_renew(link.lease_id, until)
        if link.lease_waiters and link.lease_until > boot_ns():
            lease_waiters_done(link, True)

    def renew_lease(self, link: Link) -> asyncio.Future[bool | None]:
        """Ping now for a mover lease run low (lease_low); True at the pong that renews it,
        None when the link goes down."""
        fut: asyncio.Future[bool | None] = self._loop.create_future()
        if not link.lease_waiters:
            link.ch.send_nowait({"t": "ping", "ts": boot_ns()})
        link.lease_waiters.append(fut)
        return fut

    async def _heartbeat(self, link: Link) -> None:
        """Ping every heartbeat_interval; a peer silent for heartbeat_timeout is lost.

        On a shm link pings carry our clock for the mover lease, and go at least every
        third of the lease, so that it never runs out while the peer answers."""
        interval, limit = self._options.heartbeat_interval, self._options.heartbeat_timeout
        if link.lease_id:
            interval = min(interval, mover_lease_ns(limit) / 3e9)
        loop = self._loop
        while link.up:
            t0 = loop.time()
            await asyncio.sleep(interval)
            if not link.up:
                return
            if loop.time() - t0 > 2 * interval:
                # Our own loop was blocked: the peer's pings may be sitting unread in the
                # socket. Judge the peer only on time this loop was able to listen.
                link.last_rx = max(link.last_rx, loop.time() - interval)
            silent = loop.time() - link.last_rx
            if silent > limit:
                for _ in range(2):   # let the reader take what already arrived
                    await asyncio.sleep(0)
                silent = loop.time() - link.last_rx
            unread = link.control_stalled(loop.time())   # a peer that pings but reads nothing
            if (silent > limit or unread > limit) and link.up:
                log.warning("link %s <-> %s lost: %s for %.2f s (heartbeat_timeout %.2f s)", self._cluster_id,
                            link.cluster_id, "no message" if silent > limit else "none of our messages read",
                            silent if silent > limit else unread, limit)
                self.link_down(link, S.LLM_LINK_FAILED)
                return
            # never awaited: a ping stuck behind what the peer leaves unread must not stall the checks above
            ping: dict[str, Any] = {"t": "ping", "ts": boot_ns()} if link.lease_id else {"t": "ping"}
            delivered = self._notifier.delivered(link)
            if delivered is not None:
                ping["n"] = delivered   # acknowledges the peer's notifications (notify.py)
            link.ch.send_nowait(ping)

    async def query(self, link: Link, msg: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """Ask the peer (``cache_query``): its reply, or None (no answer within ``timeout``,
        or the link went down). The reader has handled everything the peer sent before it."""
        return await self._request(link, dict(msg, t="cache_query"), timeout)

    async def _request(self, link: Link, msg: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        req = next(link.requests)
        fut: asyncio.Future[dict[str, Any] | None] = self._loop.create_future()
        link.pending[req] = fut
        try:
            async with asyncio.timeout(timeout):   # the send too: the peer may not be reading
                if msg["t"] == "cache_del":   # after every key_add of the cache
                    await self._tables.send_cache_del(link, dict(msg, req=req))
                else:
                    await link.ch.send(dict(msg, req=req))
                return await fut
        except (ConnectionError, TimeoutError, ProtocolError):
            return None
        finally:
            link.pending.pop(req, None)

    async def _reply(self, link: Link, msg: dict[str, Any]) -> None:
        """Send an answer, waiting at most link_timeout for the peer to take it."""
        try:
            async with asyncio.timeout(self._options.link_timeout):
                await link.ch.send(msg)
        except (ConnectionError, TimeoutError, ProtocolError):
            pass

    async def _on_cache_del(self, link: Link, msg: dict[str, Any]) -> None:
        await self._tables.on_cache_del(link, msg.get("id"))
        if link.up:
            await self._reply(link, {"t": "ok", "req": msg.get("req")})

    async def _on_unlink(self, link: Link, msg: dict[str, Any]) -> None:
        link.closing = True
        await self._scheduler.fence(list(link.inflight), S.LLM_NOT_YET_LINK)
        await self._reply(link, {"t": "ok", "req": msg.get("req")})
        self.link_down(link, S.LLM_NOT_YET_LINK)

    # ------------------------------------------------------ the registry's peers

    def announce(self, state: LocalCache) -> None:
        for link in self.links():
            if link.up:
                self._tasks.spawn(self._tables.announce(link, [state]))

    def key_changed(self, key: Key) -> None:
        for link in self.links():
            if link.up:
                self._tasks.spawn(self._tables.sync_key(link, key))

    async def forget(self, state: LocalCache) -> None:
        links = [link for link in self.links() if link.up]
        replies = await asyncio.gather(*(self._request(link, {"t": "cache_del", "id": state.cache.cache_id},
                                                       self._options.link_timeout) for link in links))
        # A peer that writes into caller-owned memory over CMA and did not confirm may
        # still be writing: keep the memory until that link is down. (memfd caches stay
        # mapped by the peer anyway; tcp frames are checked against our region table.)
        # Waiting for such a link to go down by itself could take forever (a peer that
        # answers pings but not cache_del): drop it, which fences our side.
        unsure = [link for link, r in zip(links, replies)
                  if r is None and link.up and link.transport == "shm" and state.memfd is None]
        if unsure:
            log.warning("unregister_kv_cache(%s): clusters %s did not confirm within %.2f s; "
                        "dropping their links", state.cache.cache_id,
                        [link.cluster_id for link in unsure], self._options.link_timeout)
            for link in unsure:
                self.link_down(link, S.LLM_LINK_FAILED)
        if state.memfd is None:   # and until every such peer whose link went down says it is out
            await self.closings.wait_writers(state.born, state.cache.cache_id)

    # ------------------------------------------------------------ going down

    def link_down(self, link: Link, status: S) -> None:
        if not link.up:
            return
        link.up = False
        if not link.gone.done():
            link.gone.set_result(status)
        if self._links.get(link.cluster_id) is link:
            del self._links[link.cluster_id]
        self._scheduler.stop_link(link, status)
        lease_id, link.lease_id = link.lease_id, 0
        if lease_id:   # our movers start no more chunks into the peer's memory
            self._core.lease_remove(lease_id)
        lease_waiters_done(link, False)
        self.data.close(link, status)   # the data streams; the link's jobs complete with `status`
        self._tables.drop(link, status)
        for fut in link.pending.values():
            if not fut.done():
                fut.set_result(None)
        _close_pidfd(link)
        if not self.closings.close(link, lease_id):   # shm: once our movers are out (closing.py)
            link.ch.close()
        for task in (link.reader, link.beat):
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    async def unlink(self, link: Link, timeout: float, graceful: bool,
                     fence_status: S = S.LLM_NOT_YET_LINK) -> LinkResult:
        """Fence the link's transfers, tell the peer (``graceful``), drop the link."""
        result = LinkResult(S.LLM_SUCCESS)
        link.closing = True
        await self._scheduler.fence(list(link.inflight), fence_status)
        if graceful and link.up:
            reply = await self._request(link, {"t": "unlink"}, timeout)
            if reply is None:
                result = LinkResult(S.LLM_NOTIFY_PROMPT_UNLINK_FAILED,
                                    f"cluster {link.cluster_id} did not confirm the unlink within {timeout:g} s")
        self.link_down(link, S.LLM_NOT_YET_LINK)
        return result

    async def close(self, timeout: float) -> None:
        """Unlink every peer gracefully within ``timeout`` in all, then drop the rest."""
        self.closed = True
        links = self.links()
        if not links:
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(self.unlink(link, timeout, graceful=True,
                                                   fence_status=S.LLM_ENGINE_FINALIZED)
                                       for link in links), return_exceptions=True)
        except TimeoutError:
            log.warning("close: links %s did not unlink within link_timeout %.2f s; dropping them",
                        [link.cluster_id for link in links if link.up], timeout)
        for link in links:
            self.link_down(link, S.LLM_ENGINE_FINALIZED)

    def summary(self) -> dict[int, dict[str, Any]]:
        return {cid: {"transport": link.transport, "state": "closing" if link.closing else "up",
                      "incarnation": link.incarnation,
                      "remote_caches": len(link.remote), "remote_keys": len(link.keys),
                      "control_backlog_bytes": link.ch.backlog(),
                      **self._scheduler.link_summary(link)} for cid, link in self._links.items()}


def _close_pidfd(link: Link) -> None:
    # After the link's regions were removed: the core holds its own reference (a dup)
    # for regions a job still uses.
    if link.pidfd is not None:
        os.close(link.pidfd)
        link.pidfd = None
