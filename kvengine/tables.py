"""Cache tables: what each linked peer has told us of its caches and keys, and what we tell it.

Owns: ``Link.remote`` (a peer's caches, as regions in our core), ``Link.keys``
(the peer's request keys -> its cache and row), ``Link.waiters``
(``wait_remote_cache``), and what we told the peer: ``Link.told`` /
``Link.told_keys``, under ``Link.table_lock``, which orders every message of
our table on the channel (a key_add always follows its cache_add, a cache_del
follows both, and the answer to a ``cache_query`` follows the announcement it
made). Telling is idempotent: :meth:`CacheTables.sync_cache` and
:meth:`CacheTables.sync_key` send only what the peer does not have yet.
It encodes our caches for each transport (local, memfd, cma, tcp, ucx), checks
every descriptor and key a peer sends before one region or key is recorded
(bounded: ``MAX_REMOTE_CACHES`` caches, ``MAX_REMOTE_KEYS`` keys per link; a
bad one is a protocol error that fails the link), and removes a peer's
regions and keys when it forgets a cache or the link ends. It reads the
registry and our key table; it never changes them, and it does not decide
when a link is up or down (kvengine/links.py does).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from . import control, kernel
from .control import ProtocolError
from .keys import KeyTable
from .link import Key, Link, RemoteCache, wait_idle
from .native import _native
from .registry import LOCAL_REGISTRIES, CacheRegistry, LocalCache, group_regions
from .status import LLMError, LLMStatusCode as S, error_for, to_status
from .types import PADDING_REQ_ID, CacheDesc

__all__ = ["CacheTables", "int_in", "wire_key"]

log = logging.getLogger("kvengine")
_U64 = 2**64 - 1
MAX_REMOTE_KEYS = 1 << 18     # keys one peer may have announced at once on a link
MAX_ANSWERING = 4096          # a peer's cache_query being answered at once on a link


def int_in(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def wire_key(v: Any) -> Key:
    """A key a peer sent (``[cluster, req, model]``, uint64 each), or a ProtocolError."""
    if not isinstance(v, list) or len(v) != 3 or not all(int_in(x, 0, _U64) for x in v):
        raise ProtocolError(f"bad cache key {v!r}")
    return (v[0], v[1], v[2])


class CacheTables:
    """The per-link cache tables (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, core: _native.Core, registry: CacheRegistry,
                 keys: KeyTable) -> None:
        self._loop = loop
        self._core = core
        self._registry = registry
        self._keys = keys

    # ---------------------------------------------------------------- ours

    async def announce(self, link: Link, states: list[LocalCache], ready: bool = False) -> None:
        """Tell the peer of caches (descriptors, memfds) and their keys it does not know
        yet; ``ready`` ends our table (then a failed send raises, for the handshake)."""
        try:
            async with link.table_lock:
                for state in states:
                    await self._sync_cache(link, state)
                if ready:
                    await link.ch.send({"t": "ready"})
        except (ConnectionError, ProtocolError) as e:
            if ready:
                raise
            log.warning("cannot announce caches to cluster %s: %s", link.cluster_id, e)

    async def sync_key(self, link: Link, key: Key) -> None:
        """Bring the peer's view of one of our keys up to date (key_add / key_del)."""
        try:
            async with link.table_lock:
                await self._sync_key(link, key)
        except (ConnectionError, ProtocolError) as e:
            log.warning("cannot announce a key to cluster %s: %s", link.cluster_id, e)

    async def _sync_cache(self, link: Link, state: LocalCache) -> None:
        cid = state.cache.cache_id
        if self._registry.by_id(cid) is not state:
            return                      # unregistered meanwhile: the peer need not know
        if cid not in link.told:
            await link.ch.send(*self._describe(link, state, self._core))
            link.told[cid] = set()
        for key, _ in self._keys.of_cache(cid):
            await self._sync_key(link, key)

    async def _sync_key(self, link: Link, key: Key) -> None:
        want = self._keys.lookup(key)
        if want is not None and want[0] not in self._registry:
            want = None
        have = link.told_keys.get(key)
        if have == want:
            return
        if have is not None:
            del link.told_keys[key]
            link.told.get(have[0], set()).discard(key)
            await link.ch.send({"t": "key_del", "key": list(key)})
        if want is not None:
            state = self._registry.by_id(want[0])
            if state is not None and want[0] not in link.told:
                await link.ch.send(*self._describe(link, state, self._core))
                link.told[want[0]] = set()
            await link.ch.send({"t": "key_add", "key": list(key), "cache": want[0], "row": want[1]})
            link.told_keys[key] = want
            link.told.setdefault(want[0], set()).add(key)   # (the link may have dropped its record)

    async def send_cache_del(self, link: Link, msg: dict[str, Any]) -> None:
        """Send a cache_del after everything told of that cache (its keys go with it)."""
        async with link.table_lock:
            for key in link.told.pop(msg["id"], set()):
                link.told_keys.pop(key, None)
            await link.ch.send(msg)

    def check_query(self, link: Link, msg: dict[str, Any]) -> tuple[Any, tuple[str, Any]]:
        """``(req, ("id", cache id) | ("key", key))`` of a peer's cache_query, or a ProtocolError."""
        req = msg.get("req")
        if not int_in(req, 0, _U64):
            raise ProtocolError(f"bad cache_query request id {req!r}")
        if link.answering >= MAX_ANSWERING:
            raise ProtocolError(f"more than {MAX_ANSWERING} cache_query unanswered")
        if "key" in msg:
            return req, ("key", wire_key(msg["key"]))
        if not int_in(msg.get("id"), 0, _U64):
            raise ProtocolError(f"bad cache_query {msg!r}")
        return req, ("id", msg["id"])

    async def answer(self, link: Link, req: int, what: tuple[str, Any], timeout: float) -> None:
        """Answer a cache_query: announce the cache (and its keys) if the peer lacks it, then
        say whether it exists; the announcement is on the channel before the answer."""
        link.answering += 1
        try:
            async with asyncio.timeout(timeout):
                async with link.table_lock:
                    if what[0] == "id":
                        state = self._registry.by_id(what[1])
                    else:
                        bound = self._keys.lookup(what[1])
                        state = self._registry.by_id(bound[0]) if bound is not None else None
                    if state is not None:
                        await self._sync_cache(link, state)
                    await link.ch.send({"t": "ok", "req": req, "found": state is not None})
        except (ConnectionError, ProtocolError, TimeoutError) as e:
            log.warning("cannot answer cluster %s's cache_query: %s", link.cluster_id, e)
        finally:
            link.answering -= 1

    @staticmethod
    def _describe(link: Link, state: LocalCache, core: _native.Core) -> tuple[dict[str, Any], list[int]]:
        c = state.cache
        msg: dict[str, Any] = {"t": "cache_add", "id": c.cache_id, "desc": c.desc.to_wire()}
        fds: list[int] = []
        if link.transport == "local":
            msg["kind"] = "local"
        elif link.transport == "tcp":
            index = {rid: i for i, (rid, _) in enumerate(state.regions)}
            msg.update(kind="tcp", regions=[list(r) for r in state.regions],
                       placement=[[index[rid], off] for rid, off in c._regions])
        elif link.transport == "ucx":
            # as for tcp: our region ids, which the peer names in its messages and we check
            # (no rkey: nothing is one-sided); each region is mapped with UCP once, for zero copy
            index = {rid: i for i, (rid, _) in enumerate(state.regions)}
            for rid, _ in state.regions:
                st = core.ucx_mem_map(rid)
                if st:
                    raise ProtocolError(f"cannot register cache {c.cache_id} with UCX (status {st:#x})")
            msg.update(kind="ucx", regions=[list(r) for r in state.regions],
                       placement=[[index[rid], off] for rid, off in c._regions])
        elif state.memfd is not None and c._shared is not None:
            fd, length, stride = c._shared
            msg.update(kind="memfd", len=length, stride=stride)
            fds = [fd]
        else:
            msg.update(kind="cma", addrs=c.tensor_addrs)
        return msg, fds

    async def read_table(self, link: Link) -> S:
        """The peer's table, up to its "ready" (or the status it rejected us with)."""
        while True:
            item = await link.ch.recv()
            if item is None:
                return S.LLM_LINK_FAILED
            msg, fds = item
            if msg["t"] == "reject":
                log.warning("link to cluster %s refused: %s", link.cluster_id, msg.get("msg"))
                return to_status(msg.get("status"), S.LLM_LINK_FAILED)
            if msg["t"] == "ready":
                return S.LLM_SUCCESS
            if msg["t"] != "cache_add":
                for fd in fds:
                    os.close(fd)
                if msg["t"] != "key_add":
                    raise ProtocolError(f"unexpected {msg['t']!r} while linking")
                self.on_key_add(link, msg)
                continue
            await self.on_cache_add(link, msg, fds)

    # -------------------------------------------------------------- theirs

    async def on_cache_add(self, link: Link, msg: dict[str, Any], fds: list[int]) -> None:
        """Register a peer's cache in this engine's core. Bad descriptors are a protocol error.

        A memfd is mapped (and pre-faulted) in a worker thread: the loop keeps serving."""
        try:
            cache_id = msg["id"]
            if not int_in(cache_id, 0, _U64) or cache_id in link.remote:
                raise ProtocolError(f"bad or repeated cache id {cache_id!r}")
            if len(link.remote) >= control.MAX_REMOTE_CACHES:
                raise ProtocolError(f"more than {control.MAX_REMOTE_CACHES} caches announced")
            try:
                desc = CacheDesc.from_wire(msg["desc"])
            except (LLMError, KeyError, TypeError, ValueError) as e:
                raise ProtocolError(f"bad cache descriptor: {e}") from None
            kind = msg.get("kind")
            if any((kind == k) != (link.transport == k) for k in ("tcp", "ucx", "local")):
                raise ProtocolError(f"cache kind {kind!r} on a {link.transport} link")
            keep, regions, placement, kinds = await self._layout(link, kind, cache_id, msg, fds,
                                                                 desc.num_tensors, desc.span)
            rids = self._add_regions(link, regions, kinds)
            link.remote[cache_id] = RemoteCache(cache_id, desc, [(rids[ri], off) for ri, off in placement],
                                                rids, keep)
            for fut in link.waiters.pop(cache_id, ()):
                if not fut.done():
                    fut.set_result(S.LLM_SUCCESS)
        finally:
            for fd in fds:
                os.close(fd)

    async def _layout(self, link: Link, kind: Any, cache_id: int, msg: dict[str, Any], fds: list[int],
                      n: int, size: int) -> tuple[Any, list[tuple[int, int]], list[tuple[int, int]],
                                                  tuple[int, int, int]]:
        """``(keep, regions, placement, (region kind, pid or link, flags))`` of a cache_add."""
        if kind == "local":
            peer = LOCAL_REGISTRIES.get(link.peer_token)
            state = peer.by_id(cache_id) if peer is not None else None
            if state is None:
                raise ProtocolError(f"local cache {cache_id} not found in the peer engine")
            regions, placement = group_regions(state.cache.tensor_addrs, size)
            return state.cache, regions, placement, (_native.REGION_LOCAL, 0, 0)
        if kind == "cma":
            addrs = msg.get("addrs")
            if not isinstance(addrs, list) or len(addrs) != n or \
                    not all(isinstance(a, int) and 0 < a < 2**64 - size for a in addrs):
                raise ProtocolError("bad tensor addresses")
            if link.pidfd is None:
                raise ProtocolError("a 'cma' cache on a link without a peer process")
            return (None, *group_regions(addrs, size), (_native.REGION_PROCESS, link.peer_pid, 0))
        if kind == "memfd":
            length, stride = msg.get("len"), msg.get("stride")
            # the layout is fixed by the descriptor (so is the size we map), and the
            # memfd must be sealed at exactly that size and fully allocated
            if len(fds) != 1 or stride != kernel.memfd_stride(size) or length != stride * n:
                raise ProtocolError("bad memfd cache descriptor")
            kernel.check_memfd(fds[0], length)
            st, addr = await self._loop.run_in_executor(None, _native.map_fd, fds[0], length)
            if st:
                raise ProtocolError(f"cannot map the peer's cache (status {st:#x})")
            return None, [(addr, length)], [(0, t * stride) for t in range(n)], \
                (_native.REGION_LOCAL, 0, _native.F_UNMAP)
        if kind in ("tcp", "ucx"):
            wire_regions, wire_placement = msg.get("regions"), msg.get("placement")
            ok = (isinstance(wire_regions, list) and isinstance(wire_placement, list)
                  and len(wire_placement) == n and 1 <= len(wire_regions) <= n
                  and all(isinstance(r, list) and len(r) == 2 and all(isinstance(v, int) for v in r)
                          and 0 < r[0] < 2**32 and 0 < r[1] < 2**63 for r in wire_regions)
                  and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], int)
                          and isinstance(p[1], int) and 0 <= p[0] < len(wire_regions)
                          and 0 <= p[1] <= wire_regions[p[0]][1] - size for p in wire_placement))
            if not ok:
                raise ProtocolError(f"bad {kind} cache descriptor")
            assert isinstance(wire_regions, list) and isinstance(wire_placement, list)
            return None, [(r[0], r[1]) for r in wire_regions], [(p[0], p[1]) for p in wire_placement], \
                (_native.REGION_TCP if kind == "tcp" else _native.REGION_UCX, link.tcp_id, 0)
        raise ProtocolError(f"unknown cache kind {kind!r}")

    def _add_regions(self, link: Link, regions: list[tuple[int, int]], kinds: tuple[int, int, int]) -> list[int]:
        rids: list[int] = []
        for base, length in regions:
            st, rid = self._core.region_add(kinds[0], kinds[1], base, length, kinds[2])
            if not st and kinds[0] == _native.REGION_PROCESS:
                # CMA names the peer by the pidfd of the process that connected, not by a
                # pid that another process could get once the peer is gone (one duplicate
                # per link in the core, keyed by the link's serial)
                st = self._core.region_pidfd(rid, -1 if link.pidfd is None else link.pidfd, link.serial)
                if st:
                    self._core.region_remove(rid)
            if st:
                for r in rids:
                    self._core.region_remove(r)
                raise ProtocolError(f"cannot register the peer's cache (status {st:#x})")
            rids.append(rid)
        return rids

    def on_key_add(self, link: Link, msg: dict[str, Any]) -> None:
        """The peer bound a key to a row of a cache it announced. Bad input is a protocol error."""
        key = wire_key(msg.get("key"))
        if key[0] != link.cluster_id or key[1] == PADDING_REQ_ID:
            raise ProtocolError(f"key {list(key)} does not name a row of cluster {link.cluster_id}")
        cache_id: Any = msg.get("cache")
        row: Any = msg.get("row")
        rc = link.remote.get(cache_id) if int_in(cache_id, 0, _U64) else None
        if rc is None:
            raise ProtocolError(f"key {list(key)} names cache {cache_id!r}, not announced")
        if not int_in(row, 0, rc.desc.batch_size - 1):
            raise ProtocolError(f"key {list(key)} names row {row!r} of a cache of {rc.desc.batch_size} rows")
        if key in link.keys:
            raise ProtocolError(f"key {list(key)} announced twice")
        if len(link.keys) >= MAX_REMOTE_KEYS:
            raise ProtocolError(f"more than {MAX_REMOTE_KEYS} keys announced")
        link.keys[key] = (rc, row)
        rc.keys.add(key)

    def on_key_del(self, link: Link, msg: dict[str, Any]) -> None:
        """The peer unbound a key (an unknown one is a no-op: it may have gone with its cache)."""
        key = wire_key(msg.get("key"))
        bound = link.keys.pop(key, None)
        if bound is not None:
            bound[0].keys.discard(key)

    async def on_cache_del(self, link: Link, cache_id: Any) -> None:
        """The peer forgets a cache: its keys at once; its regions once our transfers on it ended."""
        rc = link.remote.pop(cache_id, None) if int_in(cache_id, 0, _U64) else None
        if rc is not None:
            for key in rc.keys:
                link.keys.pop(key, None)
            rc.keys.clear()
            await wait_idle(rc)  # bounded: each transfer has a deadline
            for rid in rc.region_ids:
                self._core.region_remove(rid)
            rc.keep = None

    async def wait_remote(self, link: Link, cache_id: int, timeout: float) -> S:
        if cache_id in link.remote:
            return S.LLM_SUCCESS
        fut: asyncio.Future[S] = self._loop.create_future()
        link.waiters.setdefault(cache_id, []).append(fut)
        try:
            st = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise error_for(S.LLM_TIMEOUT, f"cluster {link.cluster_id} did not announce cache {cache_id} "
                                           f"within {timeout:g} s") from None
        finally:
            futs = link.waiters.get(cache_id)
            if futs and fut in futs:
                futs.remove(fut)
                if not futs:
                    del link.waiters[cache_id]
        if st != S.LLM_SUCCESS:
            raise error_for(st, f"the link to cluster {link.cluster_id} went down")
        return st

    def drop(self, link: Link, status: S | None = None) -> None:
        """The link is gone (or never came up): its regions go, its waiters end with ``status``."""
        # Regions are refcounted natively: a mapping a job still uses survives until it ends.
        for rc in link.remote.values():
            for rid in rc.region_ids:
                self._core.region_remove(rid)
        link.remote.clear()
        link.keys.clear()
        link.told.clear()
        link.told_keys.clear()
        for futs in link.waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_result(status or S.LLM_LINK_FAILED)
        link.waiters.clear()


