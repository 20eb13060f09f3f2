"""KvEngine: the public object. Lifecycle, cache registry, links, push and pull.

Threading: every method runs on the event loop thread, except the native
movers, which copy bytes without the GIL and report through one eventfd
(``loop.add_reader``); :meth:`KvEngine._drain` resolves the transfers.
Small transfers (``EngineOptions.inline_threshold``) are copied on the calling
thread, because handing them to a mover costs more than the copy.
"""

from __future__ import annotations

import array
import asyncio
import itertools
import logging
import math
import mmap
import os
import socket
import weakref
from typing import Any, Iterable, Sequence

import numpy as np

from . import control, plan
from .control import ProtocolError, SeqpacketChannel, StreamChannel
from .status import LLMError, LLMStatusCode as S, error_for
from .transfer import Transfer
from .types import (BlocksCacheKey, Cache, CacheDesc, CacheIndex, ClusterInfo, EngineOptions,
                    KvCacheExtParam, Placement, Role, param_invalid)

try:
    from . import _native
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "kvengine's native extension is not built: run `pip install -e .` in the source tree "
        f"(or `pip install kvengine`) ({e})") from e

__all__ = ["KvEngine"]

log = logging.getLogger("kvengine")

_PAGE = mmap.PAGESIZE
_U64 = 2**64 - 1
_serials = itertools.count(1)
_warned_no_secret = False
# Engines of this process by token, for the in-process ("local") transport.
_LOCAL_ENGINES: "weakref.WeakValueDictionary[str, KvEngine]" = weakref.WeakValueDictionary()


def _now_error(status: S, message: str) -> LLMError:
    return error_for(status, message)


def _group_regions(addrs: Sequence[int], size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Merge tensors that sit back to back into one region.

    Returns ``(regions, placement)``: regions as ``(base, length)`` and, per tensor,
    ``(region index, offset in region)``.
    """
    regions: list[list[int]] = []
    placement: list[tuple[int, int]] = []
    for a in addrs:
        if regions and regions[-1][0] + regions[-1][1] == a:
            placement.append((len(regions) - 1, regions[-1][1]))
            regions[-1][1] += size
        else:
            placement.append((len(regions), 0))
            regions.append([a, size])
    return [tuple(r) for r in regions], placement


async def _wait_idle(obj) -> None:
    if obj._inflight:
        if obj._idle is None:
            obj._idle = asyncio.get_running_loop().create_future()
        await asyncio.shield(obj._idle)


class _LocalState:
    """Engine-side bookkeeping of one local cache."""

    __slots__ = ("cache", "serial", "region_ids", "memfd", "_inflight", "_idle")

    def __init__(self, cache: Cache, region_ids: list[int], memfd: int | None) -> None:
        self.cache = cache
        self.serial = next(_serials)
        self.region_ids = region_ids
        self.memfd = memfd
        self._inflight = 0
        self._idle = None


class _RemoteCache:
    """A peer's cache as this engine reaches it: regions in this engine's core."""

    __slots__ = ("cache_id", "desc", "regions", "region_ids", "keep", "serial", "_inflight", "_idle")

    def __init__(self, cache_id: int, desc: CacheDesc, regions: list[tuple[int, int]],
                 region_ids: list[int], keep: Any) -> None:
        self.cache_id = cache_id
        self.desc = desc
        self.regions = regions        # per tensor: (region id, offset)
        self.region_ids = region_ids
        self.keep = keep              # the peer's Cache object (local transport) or None
        self.serial = next(_serials)
        self._inflight = 0
        self._idle = None


class _Link:
    __slots__ = ("cluster_id", "ch", "transport", "peer_pid", "peer_token", "remote", "inflight",
                 "reader", "pending", "up", "closing", "address", "_reqs", "waiters")

    def __init__(self, cluster_id: int, ch: SeqpacketChannel, transport: str, peer_pid: int,
                 peer_token: str, address: str) -> None:
        self.cluster_id = cluster_id
        self.ch = ch
        self.transport = transport
        self.peer_pid = peer_pid
        self.peer_token = peer_token
        self.address = address
        self.remote: dict[int, _RemoteCache] = {}
        self.inflight: set[Transfer] = set()
        self.reader: asyncio.Task | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.up = True
        self.closing = False  # an unlink is under way: EOF is expected
        self._reqs = itertools.count(1)
        self.waiters: dict[int, list[asyncio.Future]] = {}  # cache id -> wait_remote_cache futures


class KvEngine:
    """One cluster's KV-cache transfer engine (LLM-DataDist's ``LLMDataDist`` + cache manager).

    Use ``async with KvEngine(cluster_id, role, listen="127.0.0.1:0") as engine:``.
    ``listen=None`` makes a client-only engine (it can link to others, nobody links to it).
    """

    def __init__(self, cluster_id: int, role: Role = Role.PROMPT, listen: str | None = None,
                 options: EngineOptions | None = None) -> None:
        if isinstance(cluster_id, bool) or not isinstance(cluster_id, int) or not 0 <= cluster_id <= _U64:
            raise param_invalid(f"cluster_id must be an int in [0, 2**64-1], got {cluster_id!r}")
        try:
            role = Role(role)
        except ValueError:
            raise param_invalid(f"role must be a kvengine.Role, got {role!r}") from None
        if listen is not None:
            try:
                control.parse_address(listen)
            except ValueError as e:
                raise param_invalid(str(e)) from None
        if options is None:
            options = EngineOptions()
        elif not isinstance(options, EngineOptions):
            raise param_invalid("options must be an EngineOptions")
        self.cluster_id = cluster_id
        self.role = role
        self.options = options
        self._listen = listen
        self.address: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._core = None
        self._started = False
        self._closed = False
        self._host = control.host_identity()
        self._token = control.new_nonce()
        self._caches: dict[int, _LocalState] = {}
        self._cache_ids = itertools.count(1)  # LLM-DataDist ids start at 1
        self._links: dict[int, _Link] = {}
        self._linking: set[int] = set()
        self._attach: dict[str, tuple] = {}
        self._jobs = itertools.count(1)
        self._pending: dict[int, Transfer] = {}
        self._plans: dict[tuple, array.array] = {}
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.AbstractServer | None = None
        self._unix: socket.socket | None = None
        self._unix_name: str | None = None
        self._counts = {"transfers": 0, "bytes": 0, "by_status": {}}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> "KvEngine":
        """Start the native core and, with ``listen``, the control servers."""
        if self._started:
            return self
        global _warned_no_secret
        self._loop = asyncio.get_running_loop()
        self._core = _native.Core(self.options.movers, self.options.chunk_bytes)
        self._loop.add_reader(self._core.fileno(), self._drain)
        self._started = True
        _LOCAL_ENGINES[self._token] = self
        if self.options.secret is None and not _warned_no_secret:
            _warned_no_secret = True
            log.warning("kvengine: no secret configured (EngineOptions.secret or KVENGINE_SECRET): "
                        "links are not authenticated")
        try:
            self._unix, self._unix_name = control.unix_listener()
            self._loop.add_reader(self._unix.fileno(), self._on_unix_accept)
            if self._listen is not None:
                host, port = control.parse_address(self._listen)
                self._server = await asyncio.start_server(self._on_tcp, host, port)
                sockname = self._server.sockets[0].getsockname()
                h = sockname[0]
                self.address = f"[{h}]:{sockname[1]}" if ":" in h else f"{h}:{sockname[1]}"
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self) -> "KvEngine":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Unlink every peer, abort every transfer (fenced), stop the movers. Idempotent.

        Transfers still in flight resolve ``LLM_ENGINE_FINALIZED``.
        """
        if self._closed:
            return
        self._closed = True
        _LOCAL_ENGINES.pop(self._token, None)
        if self._server is not None:
            self._server.close()
        if self._unix is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._unix.fileno())
            self._unix.close()
        if self._links:
            await asyncio.gather(*(self._unlink_one(link, self.options.link_timeout, graceful=True)
                                   for link in list(self._links.values())),
                                 return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        if self._core is not None:
            self._core.close()          # aborts every job, joins the movers
            self._loop.remove_reader(self._core.fileno())
            self._drain()
            for t in list(self._pending.values()):  # nothing should be left; never leave a waiter
                t._finish(S.LLM_ENGINE_FINALIZED, 0)
            self._pending.clear()
        for st in self._caches.values():
            self._release_local(st)
        self._caches.clear()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except (asyncio.TimeoutError, RuntimeError):
                pass

    def _check_open(self) -> None:
        if self._closed:
            raise _now_error(S.LLM_ENGINE_FINALIZED, "the engine is closed")
        if not self._started:
            raise _now_error(S.LLM_FAILED, "the engine is not started: use `async with` or `await engine.start()`")

    def _spawn(self, coro) -> asyncio.Task:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -------------------------------------------------------------- completions

    def _drain(self) -> None:
        """eventfd readable: resolve every transfer whose native job finished."""
        pending = self._pending
        for job_id, status, nbytes in self._core.poll():
            t = pending.pop(job_id, None)
            if t is not None:
                t._finish(status, nbytes)

    # ------------------------------------------------------------------- caches

    def allocate_cache(self, desc: CacheDesc) -> Cache:
        """Engine-owned cache in shared memory (memfd), pre-faulted.

        Peers on this host map it and write straight into it. ``cache.tensors``
        are numpy views; keep using them until you unregister the cache.
        """
        self._check_open()
        desc = self._check_desc(desc)
        stride = -(-desc.size // _PAGE) * _PAGE
        length = stride * desc.num_tensors
        fd = os.memfd_create(f"kvengine-cache-{self.cluster_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, length)
            mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            raise _now_error(S.LLM_OUT_OF_MEMORY, f"cannot allocate {length} bytes of shared memory: {e}")
        base = np.frombuffer(mm, dtype=np.uint8)
        addr = base.__array_interface__["data"][0]
        npd = desc.dtype.numpy_dtype
        count = desc.size // npd.itemsize
        tensors = [np.frombuffer(mm, dtype=npd, count=count, offset=t * stride).reshape(desc.shape)
                   for t in range(desc.num_tensors)]
        st, rid = self._core.region_add(_native.REGION_LOCAL, 0, addr, length)
        if st:
            os.close(fd)
            raise _now_error(S(st), "cannot register the allocated cache")
        cache_id = next(self._cache_ids)
        cache = Cache(cache_id, desc, tensors, [addr + t * stride for t in range(desc.num_tensors)],
                      [(rid, t * stride) for t in range(desc.num_tensors)], keep=(mm, base),
                      shared=(fd, length, stride))
        self._add_cache(cache, [rid], fd)
        return cache

    def register_kv_cache(self, desc: CacheDesc, tensors: Sequence[Any]) -> Cache:
        """Register caller-owned buffers, one per tensor (LLM-DataDist's RegisterKvCache).

        Each must be C-contiguous, writable, exactly ``desc.size`` bytes: numpy
        arrays, memoryviews, bytearrays, anything with the buffer protocol or
        ``__dlpack__`` (CPU torch tensors). They stay referenced until unregistered.
        """
        self._check_open()
        desc = self._check_desc(desc)
        if isinstance(tensors, (bytes, bytearray, memoryview, np.ndarray)) or not hasattr(tensors, "__len__"):
            raise param_invalid("register_kv_cache takes a list of buffers, one per tensor")
        if len(tensors) != desc.num_tensors:
            raise param_invalid(f"got {len(tensors)} buffers for num_tensors {desc.num_tensors}")
        arrays = [self._as_array(i, t, desc) for i, t in enumerate(tensors)]
        addrs = [a.__array_interface__["data"][0] for a in arrays]
        regions, placement = _group_regions(addrs, desc.size)
        rids = []
        for base, length in regions:
            st, rid = self._core.region_add(_native.REGION_LOCAL, 0, base, length)
            if st:
                for r in rids:
                    self._core.region_remove(r)
                raise _now_error(S(st), "cannot register the buffers")
            rids.append(rid)
        npd = desc.dtype.numpy_dtype
        views = [a.view(npd).reshape(desc.shape) if a.dtype.itemsize and a.nbytes == desc.size else a
                 for a in arrays]
        cache = Cache(next(self._cache_ids), desc, views, addrs,
                      [(rids[ri], off) for ri, off in placement], keep=(list(tensors), arrays))
        self._add_cache(cache, rids, None)
        return cache

    def _check_desc(self, desc: Any) -> CacheDesc:
        if not isinstance(desc, CacheDesc):
            raise param_invalid(f"desc must be a CacheDesc, got {type(desc).__name__}")
        if desc.placement != Placement.HOST:
            raise _now_error(S.LLM_FEATURE_NOT_ENABLED, "only Placement.HOST caches exist on this machine")
        return desc

    @staticmethod
    def _as_array(i: int, obj: Any, desc: CacheDesc) -> np.ndarray:
        if isinstance(obj, np.ndarray):
            arr = obj
        else:
            try:
                arr = np.asarray(memoryview(obj))
            except TypeError:
                if hasattr(obj, "__dlpack__"):
                    try:
                        arr = np.from_dlpack(obj)
                    except (TypeError, RuntimeError, BufferError) as e:
                        raise param_invalid(f"tensor {i}: not a CPU buffer ({e})") from None
                else:
                    raise param_invalid(
                        f"tensor {i}: {type(obj).__name__} has neither the buffer protocol nor __dlpack__") from None
        if not arr.flags.c_contiguous:
            raise param_invalid(f"tensor {i} is not C-contiguous")
        if not arr.flags.writeable:
            raise param_invalid(f"tensor {i} is read-only")
        if arr.nbytes != desc.size:
            raise param_invalid(f"tensor {i} has {arr.nbytes} bytes, the desc needs {desc.size}")
        return arr.reshape(-1).view(np.uint8)

    def _add_cache(self, cache: Cache, rids: list[int], memfd: int | None) -> None:
        state = _LocalState(cache, rids, memfd)
        self._caches[cache.cache_id] = state
        for link in list(self._links.values()):
            if link.up:
                self._spawn(self._announce(link, [state]))

    def unregister_kv_cache(self, cache_id: int) -> asyncio.Future:
        """Forget a cache (an unknown id is a no-op, as in LLM-DataDist).

        New transfers naming it fail at once with ``LLM_KV_CACHE_NOT_EXIST``.
        The memory stays referenced until transfers in flight on it have finished
        (bounded by their deadlines) and every linked peer has confirmed it will not
        touch it any more. Returns a future that is done then; awaiting it is optional.
        """
        self._check_open()
        state = self._caches.pop(cache_id, None)
        fut = self._loop.create_future()
        if state is None:
            fut.set_result(None)
            return fut
        state.cache._valid = False
        task = self._spawn(self._retire(state))
        task.add_done_callback(lambda t: fut.done() or fut.set_result(None))
        return fut

    async def _retire(self, state: _LocalState) -> None:
        try:
            links = [link for link in self._links.values() if link.up]
            await asyncio.gather(*(self._request(link, {"t": "cache_del", "id": state.cache.cache_id},
                                                 self.options.link_timeout) for link in links),
                                 return_exceptions=True)
            await _wait_idle(state)
        finally:
            self._release_local(state)

    def _release_local(self, state: _LocalState) -> None:
        if self._core is not None:  # native refcounts keep regions a job still uses
            for rid in state.region_ids:
                self._core.region_remove(rid)
        if state.memfd is not None:
            os.close(state.memfd)
            state.memfd = None
        state.cache._valid = False

    # -------------------------------------------------------------------- links

    async def link_clusters(self, clusters: Sequence[ClusterInfo], timeout: float | None = None
                            ) -> tuple[S, list[S]]:
        """Link to each peer (in parallel): ``(overall status, [status per cluster])``.

        Per cluster: ``LLM_SUCCESS``, ``LLM_ALREADY_LINK``, ``LLM_PROCESSING_LINK``
        (a link to that cluster is being set up), ``LLM_LINK_FAILED`` (unreachable,
        refused, authentication failed), ``LLM_TIMEOUT`` or ``LLM_PARAM_INVALID``.
        The overall status is ``LLM_SUCCESS`` only if every cluster linked.
        """
        self._check_open()
        timeout = self._link_timeout(timeout)
        if isinstance(clusters, ClusterInfo) or not isinstance(clusters, (list, tuple)) or not clusters:
            return S.LLM_PARAM_INVALID, []
        ids = [c.remote_cluster_id for c in clusters if isinstance(c, ClusterInfo)]
        dup = {i for i in ids if ids.count(i) > 1}
        results = await asyncio.gather(*(
            self._link_one(c, timeout) if isinstance(c, ClusterInfo) and c.remote_cluster_id not in dup
            else _const(S.LLM_PARAM_INVALID) for c in clusters))
        return _overall(results), results

    def _link_timeout(self, timeout: Any) -> float:
        if timeout is None:
            return self.options.link_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise param_invalid(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)

    async def _link_one(self, info: ClusterInfo, timeout: float) -> S:
        cid = info.remote_cluster_id
        try:
            host, port = control.parse_address(info.address)
        except (ValueError, TypeError) as e:
            log.warning("link to cluster %s: %s", cid, e)
            return S.LLM_PARAM_INVALID
        if not isinstance(cid, int) or cid == self.cluster_id or not 0 <= cid <= _U64:
            return S.LLM_PARAM_INVALID
        if cid in self._links:
            return S.LLM_ALREADY_LINK
        if cid in self._linking:
            return S.LLM_PROCESSING_LINK
        self._linking.add(cid)
        tcp = uch = None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port)
                tcp = StreamChannel(reader, writer)
                nonce = control.new_nonce()
                await tcp.send({"t": "hello", "v": control.PROTOCOL_VERSION, "cluster": self.cluster_id,
                                "role": int(self.role), "host": self._host, "pid": os.getpid(),
                                "token": self._token, "transport": self.options.transport,
                                "auth": self.options.secret is not None, "nonce": nonce})
                w = await tcp.recv()
                if w is None:
                    log.warning("link to cluster %s at %s: connection closed during hello", cid, info.address)
                    return S.LLM_LINK_FAILED
                if w["t"] == "reject":
                    log.warning("link to cluster %s refused: %s", cid, w.get("msg"))
                    return _status_or(w.get("status"), S.LLM_LINK_FAILED)
                if w["t"] != "welcome" or w.get("v") != control.PROTOCOL_VERSION:
                    log.warning("link to cluster %s: unexpected reply %r", cid, w.get("t"))
                    return S.LLM_LINK_FAILED
                if w.get("cluster") != cid:
                    log.warning("link to cluster %s: the engine at %s is cluster %s", cid, info.address,
                                w.get("cluster"))
                    return S.LLM_LINK_FAILED
                if not control.check_proof(self.options.secret, w.get("proof"), "server", nonce,
                                           str(w.get("nonce"))):
                    log.warning("link to cluster %s: peer failed authentication", cid)
                    return S.LLM_LINK_FAILED
                transport = w.get("transport")
                uch = await control.unix_connect(str(w["unix"]), self._loop)
                proof = (control.proof(self.options.secret, "client", str(w["nonce"]), nonce)
                         if self.options.secret is not None else None)
                await uch.send({"t": "attach", "token": w["token"], "proof": proof})
                link = _Link(cid, uch, transport, int(w["pid"]), str(w["ptoken"]), info.address)
                # TCP stays open until the link is up: its EOF tells the server to drop a
                # reservation we abandoned.
                status = await self._establish(link)
                if status != S.LLM_SUCCESS:
                    return status
                uch = None
                return S.LLM_SUCCESS
        except TimeoutError:
            log.warning("link to cluster %s at %s timed out after %.3f s", cid, info.address, timeout)
            return S.LLM_TIMEOUT
        except (OSError, ProtocolError, KeyError, ValueError, TypeError) as e:
            log.warning("link to cluster %s at %s failed: %s", cid, info.address, e)
            return S.LLM_LINK_FAILED
        finally:
            self._linking.discard(cid)
            if tcp is not None:
                tcp.close()
            if uch is not None:
                uch.close()

    async def _establish(self, link: _Link) -> S:
        """Both sides: send our cache table, read the peer's until "ready", go live."""
        await self._announce(link, list(self._caches.values()), ready=True)
        while True:
            item = await link.ch.recv()
            if item is None:
                return S.LLM_LINK_FAILED
            msg, fds = item
            if msg["t"] == "reject":
                log.warning("link to cluster %s refused: %s", link.cluster_id, msg.get("msg"))
                return _status_or(msg.get("status"), S.LLM_LINK_FAILED)
            if msg["t"] == "ready":
                break
            if msg["t"] != "cache_add":
                raise ProtocolError(f"unexpected {msg['t']!r} while linking")
            self._on_cache_add(link, msg, fds)
        if self._closed or link.cluster_id in self._links:
            self._drop_remote(link)
            return S.LLM_ALREADY_LINK if not self._closed else S.LLM_ENGINE_FINALIZED
        self._links[link.cluster_id] = link
        link.reader = self._spawn(self._read_link(link))
        log.info("linked cluster %s <-> %s (%s)", self.cluster_id, link.cluster_id, link.transport)
        return S.LLM_SUCCESS

    async def _announce(self, link: _Link, states: list[_LocalState], ready: bool = False) -> None:
        """Send cache descriptors (and memfds) to the peer."""
        for state in states:
            if state.cache.cache_id not in self._caches:
                continue
            c = state.cache
            msg: dict[str, Any] = {"t": "cache_add", "id": c.cache_id, "desc": c.desc.to_wire()}
            fds: list[int] = []
            if link.transport == "local":
                msg["kind"] = "local"
            elif state.memfd is not None:
                fd, length, stride = c._shared
                msg.update(kind="memfd", len=length, stride=stride)
                fds = [fd]
            else:
                msg.update(kind="cma", addrs=c.tensor_addrs)
            try:
                await link.ch.send(msg, fds)
            except (ConnectionError, ProtocolError) as e:
                log.warning("cannot announce cache %s to cluster %s: %s", c.cache_id, link.cluster_id, e)
                return
        if ready:
            await link.ch.send({"t": "ready"})

    def _on_cache_add(self, link: _Link, msg: dict, fds: list[int]) -> None:
        """Map a peer's cache into this engine's core. Bad descriptors are a protocol error."""
        try:
            cache_id = msg["id"]
            if not isinstance(cache_id, int) or cache_id in link.remote:
                raise ProtocolError(f"bad or repeated cache id {cache_id!r}")
            try:
                desc = CacheDesc.from_wire(msg["desc"])
            except (LLMError, KeyError, TypeError, ValueError) as e:
                raise ProtocolError(f"bad cache descriptor: {e}") from None
            kind = msg.get("kind")
            n, size = desc.num_tensors, desc.size
            keep = None
            if kind == "local":
                peer = _LOCAL_ENGINES.get(link.peer_token)
                state = peer._caches.get(cache_id) if peer is not None else None
                if state is None:
                    raise ProtocolError(f"local cache {cache_id} not found in the peer engine")
                keep = state.cache
                regions, placement = _group_regions(keep.tensor_addrs, size)
                kinds = (_native.REGION_LOCAL, 0, False)
            elif kind == "cma":
                addrs = msg.get("addrs")
                if not isinstance(addrs, list) or len(addrs) != n or \
                        not all(isinstance(a, int) and 0 < a < 2**64 - size for a in addrs):
                    raise ProtocolError("bad tensor addresses")
                regions, placement = _group_regions(addrs, size)
                kinds = (_native.REGION_PROCESS, link.peer_pid, False)
            elif kind == "memfd":
                length, stride = msg.get("len"), msg.get("stride")
                if len(fds) != 1 or not isinstance(length, int) or not isinstance(stride, int) \
                        or stride < size or length != stride * n:
                    raise ProtocolError("bad memfd cache descriptor")
                if os.fstat(fds[0]).st_size < length:
                    raise ProtocolError("memfd smaller than announced")
                st, addr = _native.map_fd(fds[0], length)
                if st:
                    raise ProtocolError(f"cannot map the peer's cache (status {st:#x})")
                regions = [(addr, length)]
                placement = [(0, t * stride) for t in range(n)]
                kinds = (_native.REGION_LOCAL, 0, True)
            else:
                raise ProtocolError(f"unknown cache kind {kind!r}")
            rids = []
            for base, length in regions:
                st, rid = self._core.region_add(kinds[0], kinds[1], base, length, kinds[2])
                if st:
                    for r in rids:
                        self._core.region_remove(r)
                    raise ProtocolError(f"cannot register the peer's cache (status {st:#x})")
                rids.append(rid)
            link.remote[cache_id] = _RemoteCache(cache_id, desc, [(rids[ri], off) for ri, off in placement],
                                                 rids, keep)
            for fut in link.waiters.pop(cache_id, ()):
                if not fut.done():
                    fut.set_result(S.LLM_SUCCESS)
        finally:
            for fd in fds:
                os.close(fd)

    async def _read_link(self, link: _Link) -> None:
        """Serve one link's control messages until it closes."""
        reason = "peer closed the control connection"
        try:
            while True:
                item = await link.ch.recv()
                if item is None:
                    break
                msg, fds = item
                t = msg["t"]
                if t == "cache_add":
                    self._on_cache_add(link, msg, fds)
                elif t == "cache_del":
                    self._spawn(self._on_cache_del(link, msg))
                elif t == "unlink":
                    self._spawn(self._on_unlink(link, msg))
                elif t in ("ok",):
                    fut = link.pending.pop(msg.get("req"), None)
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
                log.warning("link %s <-> %s lost: %s", self.cluster_id, link.cluster_id, reason)
                self._link_down(link, S.LLM_LINK_FAILED)

    async def _request(self, link: _Link, msg: dict, timeout: float) -> dict | None:
        req = next(link._reqs)
        fut = self._loop.create_future()
        link.pending[req] = fut
        try:
            await link.ch.send(dict(msg, req=req))
            return await asyncio.wait_for(fut, timeout)
        except (ConnectionError, asyncio.TimeoutError, ProtocolError):
            return None
        finally:
            link.pending.pop(req, None)

    async def _on_cache_del(self, link: _Link, msg: dict) -> None:
        rc = link.remote.pop(msg.get("id"), None)
        if rc is not None:
            await _wait_idle(rc)  # bounded: each transfer has a deadline
            for rid in rc.region_ids:
                self._core.region_remove(rid)
            rc.keep = None
        if link.up:
            try:
                await link.ch.send({"t": "ok", "req": msg.get("req")})
            except ConnectionError:
                pass

    async def _on_unlink(self, link: _Link, msg: dict) -> None:
        link.closing = True
        await self._fence_link(link, S.LLM_NOT_YET_LINK)
        try:
            await link.ch.send({"t": "ok", "req": msg.get("req")})
        except ConnectionError:
            pass
        self._link_down(link, S.LLM_NOT_YET_LINK)

    async def _fence_link(self, link: _Link, status: S) -> None:
        """Abort every transfer on the link and wait until none can write any more."""
        transfers = list(link.inflight)
        for t in transfers:
            t._abort(status)
        for t in transfers:
            await t._fenced()

    def _link_down(self, link: _Link, status: S) -> None:
        if not link.up:
            return
        link.up = False
        if self._links.get(link.cluster_id) is link:
            del self._links[link.cluster_id]
        for t in list(link.inflight):
            t._abort(status)
        self._drop_remote(link)
        for fut in link.pending.values():
            if not fut.done():
                fut.set_result(None)
        for futs in link.waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_result(status)
        link.waiters.clear()
        link.ch.close()
        if link.reader is not None and link.reader is not asyncio.current_task():
            link.reader.cancel()

    def _drop_remote(self, link: _Link) -> None:
        # Regions are refcounted natively: a mapping a job still uses survives until it ends.
        for rc in link.remote.values():
            for rid in rc.region_ids:
                self._core.region_remove(rid)
        link.remote.clear()

    async def unlink_clusters(self, clusters: Sequence[ClusterInfo], timeout: float | None = None,
                              force: bool = False) -> tuple[S, list[S]]:
        """Tear links down: ``(overall status, [status per cluster])``.

        Normal unlink tells the peer, which aborts (fenced) its transfers to us
        first; ``force=True`` only drops this end. Unknown cluster: ``LLM_NOT_YET_LINK``.
        """
        self._check_open()
        timeout = self._link_timeout(timeout)
        if isinstance(clusters, ClusterInfo) or not isinstance(clusters, (list, tuple)) or not clusters:
            return S.LLM_PARAM_INVALID, []
        results = []
        for c in clusters:
            link = self._links.get(c.remote_cluster_id) if isinstance(c, ClusterInfo) else None
            results.append(self._unlink_one(link, timeout, graceful=not force) if link else None)
        done = await asyncio.gather(*(r if r is not None else _const(S.LLM_NOT_YET_LINK) for r in results))
        return _overall(done), done

    async def _unlink_one(self, link: _Link, timeout: float, graceful: bool) -> S:
        status = S.LLM_SUCCESS
        link.closing = True
        await self._fence_link(link, S.LLM_NOT_YET_LINK)
        if graceful and link.up:
            reply = await self._request(link, {"t": "unlink"}, timeout)
            if reply is None:
                status = S.LLM_NOTIFY_PROMPT_UNLINK_FAILED
        self._link_down(link, S.LLM_NOT_YET_LINK)
        return status

    # ------------------------------------------------------------ server side

    async def _on_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ch = StreamChannel(reader, writer)
        reply = None
        try:
            async with asyncio.timeout(self.options.link_timeout):
                hello = await ch.recv()
                if hello is None:
                    return
                reply = self._answer_hello(hello)
                await ch.send(reply)
                if reply["t"] == "welcome":
                    await ch.recv()   # EOF: the client attached over Unix, or gave up
        except (TimeoutError, ProtocolError, OSError, KeyError, TypeError, ValueError) as e:
            log.info("control connection dropped during hello: %s", e)
        finally:
            ch.close()
            if reply is not None and reply["t"] == "welcome":
                self._expire_attach(reply["token"])

    def _answer_hello(self, h: dict) -> dict:
        def reject(status: S, msg: str) -> dict:
            log.warning("refusing link from cluster %s: %s", h.get("cluster"), msg)
            return {"t": "reject", "status": int(status), "msg": msg}

        if h.get("t") != "hello" or h.get("v") != control.PROTOCOL_VERSION:
            return reject(S.LLM_LINK_FAILED, f"protocol version {h.get('v')!r} not supported "
                                             f"(this engine speaks {control.PROTOCOL_VERSION})")
        cid = h.get("cluster")
        if isinstance(cid, bool) or not isinstance(cid, int) or not 0 <= cid <= _U64:
            return reject(S.LLM_PARAM_INVALID, "bad cluster id")
        if cid == self.cluster_id:
            return reject(S.LLM_PARAM_INVALID, f"cluster id {cid} is this engine's own")
        if self._closed:
            return reject(S.LLM_LINK_FAILED, "engine closing")
        if cid in self._links:
            return reject(S.LLM_ALREADY_LINK, f"cluster {cid} is already linked")
        if cid in self._linking:
            return reject(S.LLM_PROCESSING_LINK, f"a link with cluster {cid} is being set up")
        if bool(h.get("auth")) != (self.options.secret is not None):
            return reject(S.LLM_LINK_FAILED, "authentication mismatch: one engine has a secret, the other not")
        if h.get("host") != self._host:
            return reject(S.LLM_LINK_FAILED, "peer is on another host; the tcp transport is not available yet")
        same_process = h.get("pid") == os.getpid() and h.get("token") in _LOCAL_ENGINES
        prefs = {h.get("transport"), self.options.transport}
        if "local" in prefs:
            if not same_process:
                return reject(S.LLM_LINK_FAILED, "transport 'local' needs both engines in one process")
            transport = "local"
        elif "shm" in prefs or not same_process:
            transport = "shm"
        else:
            transport = "local"
        token = control.new_nonce()
        nonce = control.new_nonce()
        self._linking.add(cid)
        expiry = self._loop.call_later(self.options.link_timeout, self._expire_attach, token)
        self._attach[token] = (cid, h, transport, nonce, expiry)
        return {"t": "welcome", "v": control.PROTOCOL_VERSION, "cluster": self.cluster_id,
                "pid": os.getpid(), "ptoken": self._token, "transport": transport,
                "unix": self._unix_name, "token": token, "nonce": nonce,
                "proof": (control.proof(self.options.secret, "server", str(h.get("nonce")), nonce)
                          if self.options.secret is not None else None)}

    def _expire_attach(self, token: str) -> None:
        entry = self._attach.pop(token, None)
        if entry is not None:
            self._linking.discard(entry[0])

    def _on_unix_accept(self) -> None:
        while True:
            try:
                sock, _ = self._unix.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("unix accept failed: %s", e)
                return
            self._spawn(self._on_attach(SeqpacketChannel(sock, self._loop)))

    async def _on_attach(self, ch: SeqpacketChannel) -> None:
        entry = None
        try:
            async with asyncio.timeout(self.options.link_timeout):
                item = await ch.recv()
                if item is None:
                    return
                msg, fds = item
                for fd in fds:
                    os.close(fd)
                entry = self._attach.pop(msg.get("token"), None) if msg.get("t") == "attach" else None
                if entry is None:
                    await ch.send({"t": "reject", "status": int(S.LLM_LINK_FAILED), "msg": "unknown link token"})
                    return
                cid, hello, transport, nonce, expiry = entry
                expiry.cancel()
                if not control.check_proof(self.options.secret, msg.get("proof"), "client", nonce,
                                           str(hello.get("nonce"))):
                    log.warning("refusing link from cluster %s: authentication failed", cid)
                    await ch.send({"t": "reject", "status": int(S.LLM_LINK_FAILED),
                                   "msg": "authentication failed"})
                    return
                link = _Link(cid, ch, transport, int(hello["pid"]), str(hello["token"]), "")
                if await self._establish(link) == S.LLM_SUCCESS:
                    ch = None
        except (TimeoutError, ProtocolError, OSError, KeyError, TypeError, ValueError) as e:
            log.warning("link attach failed: %s", e)
        finally:
            if entry is not None:
                self._linking.discard(entry[0])
            if ch is not None:
                ch.close()

    async def wait_remote_cache(self, cluster_id: int, cache_id: int, timeout: float | None = None) -> S:
        """Wait until linked peer ``cluster_id`` has announced cache ``cache_id``.

        Caches a peer registers after linking reach this engine asynchronously;
        this is how a prefill worker waits for a decode worker's new cache.
        Returns ``LLM_SUCCESS`` or raises (``LLM_NOT_YET_LINK``, ``LLM_TIMEOUT``, or
        ``LLM_LINK_FAILED`` / ``LLM_NOT_YET_LINK`` if the link goes down meanwhile).
        """
        self._check_open()
        tmo = self._deadline(timeout)
        link = self._links.get(cluster_id)
        if link is None:
            raise _now_error(S.LLM_NOT_YET_LINK, f"cluster {cluster_id!r} is not linked")
        if cache_id in link.remote:
            return S.LLM_SUCCESS
        fut = self._loop.create_future()
        link.waiters.setdefault(cache_id, []).append(fut)
        try:
            st = await asyncio.wait_for(asyncio.shield(fut), tmo)
        except asyncio.TimeoutError:
            raise _now_error(S.LLM_TIMEOUT, f"cluster {cluster_id} did not announce cache {cache_id} "
                                            f"within {tmo:g} s") from None
        finally:
            futs = link.waiters.get(cache_id)
            if futs and fut in futs:
                futs.remove(fut)
                if not futs:
                    del link.waiters[cache_id]
        if st != S.LLM_SUCCESS:
            raise _now_error(st, f"the link to cluster {cluster_id} went down")
        return st

    # ---------------------------------------------------------------- transfers

    def _local(self, cache: Any) -> _LocalState:
        if not isinstance(cache, Cache):
            raise param_invalid(f"expected a Cache from this engine, got {type(cache).__name__}")
        state = self._caches.get(cache.cache_id)
        if state is None or state.cache is not cache:
            raise _now_error(S.LLM_KV_CACHE_NOT_EXIST,
                             f"cache {cache.cache_id} is not registered with this engine")
        return state

    def _remote(self, cluster_id: Any, cache_id: Any) -> tuple[_Link, _RemoteCache]:
        link = self._links.get(cluster_id)
        if link is None:
            if cluster_id == self.cluster_id:
                raise param_invalid(f"cluster {cluster_id} is this engine: transfers need a peer")
            raise _now_error(S.LLM_NOT_YET_LINK, f"cluster {cluster_id!r} is not linked")
        rc = link.remote.get(cache_id)
        if rc is None:
            raise _now_error(S.LLM_KV_CACHE_NOT_EXIST, f"cluster {cluster_id} has no cache {cache_id!r}")
        return link, rc

    def _deadline(self, timeout: Any) -> float:
        if timeout is None:
            return self.options.sync_kv_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 \
                or math.isinf(timeout):
            raise param_invalid(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)

    def _segments(self, key: tuple | None, make, src_regions, dst_regions) -> array.array:
        if key is not None:
            if not _plain_key(key):   # only exact ints hit the memo: True == 1, 0.0 == 0
                key = None
            else:
                segs = self._plans.get(key)
                if segs is not None:
                    return segs
        mapped = [(src_regions[s][0], src_regions[s][1] + so, dst_regions[d][0], dst_regions[d][1] + do, n)
                  for s, so, d, do, n in make()]
        segs = array.array("Q", [w for seg in plan.coalesce(mapped) for w in seg])
        if key is not None:
            if len(self._plans) >= 4096:
                self._plans.clear()
            self._plans[key] = segs
        return segs

    def _launch(self, op: str, link: _Link, local: _LocalState, remote: _RemoteCache,
                segs: array.array, timeout: float, what: str) -> Transfer:
        t = Transfer(self, what)
        job = next(self._jobs)
        st, done, nbytes = self._core.submit(job, segs, self.options.inline_threshold)
        if done or st:
            t._finish(st, nbytes)
            return t
        t._start(job, link, (local, remote), timeout)
        self._pending[job] = t
        return t

    def _transfer(self, op: str, fn) -> Transfer:
        """Run ``fn`` (validation + launch); turn a raised LLMError into a finished Transfer."""
        try:
            self._check_open()
            return fn()
        except LLMError as e:
            t = Transfer(self, op)
            t._finish(e.status, 0, e.message)
            return t

    def submit_push_kv_cache(self, cache: Cache, dst_index: CacheIndex, src_batch_index: int = 0,
                             size: int = -1, ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None) -> Transfer:
        """Start writing row ``src_batch_index`` of local ``cache`` into the peer's
        ``dst_index`` row; returns a :class:`Transfer` (awaiting it never raises)."""
        def go() -> Transfer:
            local = self._local(cache)
            if not isinstance(dst_index, CacheIndex):
                raise param_invalid(f"dst_index must be a CacheIndex, got {type(dst_index).__name__}")
            link, rc = self._remote(dst_index.cluster_id, dst_index.cache_id)
            tmo = self._deadline(timeout)
            key = ("pc", local.serial, rc.serial, src_batch_index, dst_index.batch_index, size, ext_param)
            segs = self._segments(key, lambda: plan.plan_cache(
                local.cache.desc, rc.desc, src_batch_index, dst_index.batch_index, size, ext_param, op="push"),
                local.cache._regions, rc.regions)
            return self._launch("push", link, local, rc, segs, tmo,
                                f"push_kv_cache to cluster {dst_index.cluster_id} cache {dst_index.cache_id}")
        return self._transfer("push_kv_cache", go)

    def submit_pull_kv_cache(self, src_index: CacheIndex, cache: Cache, batch_index: int = 0,
                             size: int = -1, ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None) -> Transfer:
        """Start reading the peer's ``src_index`` row into row ``batch_index`` of local
        ``cache``; ``size`` is bytes per tensor or -1 for the whole row."""
        def go() -> Transfer:
            local = self._local(cache)
            if not isinstance(src_index, CacheIndex):
                raise param_invalid(f"src_index must be a CacheIndex, got {type(src_index).__name__}")
            link, rc = self._remote(src_index.cluster_id, src_index.cache_id)
            tmo = self._deadline(timeout)
            key = ("lc", local.serial, rc.serial, src_index.batch_index, batch_index, size, ext_param)
            segs = self._segments(key, lambda: plan.plan_cache(
                rc.desc, local.cache.desc, src_index.batch_index, batch_index, size, ext_param, op="pull"),
                rc.regions, local.cache._regions)
            return self._launch("pull", link, local, rc, segs, tmo,
                                f"pull_kv_cache from cluster {src_index.cluster_id} cache {src_index.cache_id}")
        return self._transfer("pull_kv_cache", go)

    def submit_push_kv_blocks(self, cache: Cache, dst_key: BlocksCacheKey, src_blocks: Sequence[int],
                              dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None,
                              timeout: float | None = None) -> Transfer:
        """Start writing local blocks ``src_blocks[i]`` into the peer's ``dst_blocks[i]``."""
        def go() -> Transfer:
            local = self._local(cache)
            if not isinstance(dst_key, BlocksCacheKey):
                raise param_invalid(f"dst_key must be a BlocksCacheKey, got {type(dst_key).__name__}")
            link, rc = self._remote(dst_key.cluster_id, dst_key.cache_id)
            tmo = self._deadline(timeout)
            segs = self._segments(None, lambda: plan.plan_blocks(
                local.cache.desc, rc.desc, src_blocks, dst_blocks, ext_param, op="push"),
                local.cache._regions, rc.regions)
            return self._launch("push", link, local, rc, segs, tmo,
                                f"push_kv_blocks to cluster {dst_key.cluster_id} cache {dst_key.cache_id}")
        return self._transfer("push_kv_blocks", go)

    def submit_pull_kv_blocks(self, src_key: BlocksCacheKey, cache: Cache, src_blocks: Sequence[int],
                              dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None,
                              timeout: float | None = None) -> Transfer:
        """Start reading the peer's blocks ``src_blocks[i]`` into local ``dst_blocks[i]``."""
        def go() -> Transfer:
            local = self._local(cache)
            if not isinstance(src_key, BlocksCacheKey):
                raise param_invalid(f"src_key must be a BlocksCacheKey, got {type(src_key).__name__}")
            link, rc = self._remote(src_key.cluster_id, src_key.cache_id)
            tmo = self._deadline(timeout)
            segs = self._segments(None, lambda: plan.plan_blocks(
                rc.desc, local.cache.desc, src_blocks, dst_blocks, ext_param, op="pull"),
                rc.regions, local.cache._regions)
            return self._launch("pull", link, local, rc, segs, tmo,
                                f"pull_kv_blocks from cluster {src_key.cluster_id} cache {src_key.cache_id}")
        return self._transfer("pull_kv_blocks", go)

    async def push_kv_cache(self, cache: Cache, dst_index: CacheIndex, src_batch_index: int = 0,
                            size: int = -1, ext_param: KvCacheExtParam | None = None,
                            timeout: float | None = None) -> S:
        """PushKvCache: ``LLM_SUCCESS`` or raise the :class:`LLMError` subclass of the status."""
        return await self.submit_push_kv_cache(cache, dst_index, src_batch_index, size, ext_param,
                                               timeout)._result()

    async def pull_kv_cache(self, src_index: CacheIndex, cache: Cache, batch_index: int = 0,
                            size: int = -1, ext_param: KvCacheExtParam | None = None,
                            timeout: float | None = None) -> S:
        """PullKvCache: ``LLM_SUCCESS`` or raise the :class:`LLMError` subclass of the status."""
        return await self.submit_pull_kv_cache(src_index, cache, batch_index, size, ext_param,
                                               timeout)._result()

    async def push_kv_blocks(self, cache: Cache, dst_key: BlocksCacheKey, src_blocks: Sequence[int],
                             dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None) -> S:
        """PushKvBlocks: ``LLM_SUCCESS`` or raise."""
        return await self.submit_push_kv_blocks(cache, dst_key, src_blocks, dst_blocks, ext_param,
                                                timeout)._result()

    async def pull_kv_blocks(self, src_key: BlocksCacheKey, cache: Cache, src_blocks: Sequence[int],
                             dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None) -> S:
        """PullKvBlocks: ``LLM_SUCCESS`` or raise."""
        return await self.submit_pull_kv_blocks(src_key, cache, src_blocks, dst_blocks, ext_param,
                                                timeout)._result()

    # ---------------------------------------------------------------- inspection

    def _account(self, status: int, nbytes: int) -> None:
        c = self._counts
        c["transfers"] += 1
        c["bytes"] += nbytes
        name = S(status).name if status in S._value2member_map_ else str(status)
        c["by_status"][name] = c["by_status"].get(name, 0) + 1

    def stats(self) -> dict:
        """Counters: transfers by status, bytes, links, caches, in flight, native core."""
        out = {
            "transfers": self._counts["transfers"],
            "bytes": self._counts["bytes"],
            "by_status": dict(self._counts["by_status"]),
            "in_flight": len(self._pending),
            "links": {cid: {"transport": l.transport, "remote_caches": len(l.remote),
                            "in_flight": len(l.inflight)} for cid, l in self._links.items()},
            "caches": len(self._caches),
        }
        if self._core is not None:
            out["native"] = self._core.stats()
        return out

    def __repr__(self) -> str:
        state = "closed" if self._closed else "started" if self._started else "new"
        return f"<KvEngine cluster={self.cluster_id} role={self.role.name} address={self.address} {state}>"


def _plain_range(r: Any) -> bool:
    return type(r) is range or (type(r) is tuple and len(r) == 2 and type(r[0]) is int and type(r[1]) is int)


def _plain_key(key: tuple) -> bool:
    """True if every part of a plan memo key has an exact type (so equal means identical)."""
    *head, ext = key
    if not all(type(v) is int or type(v) is str for v in head):
        return False
    if ext is None:
        return True
    return (type(ext) is KvCacheExtParam and type(ext.tensor_num_per_layer) is int
            and _plain_range(ext.src_layer_range) and _plain_range(ext.dst_layer_range))


async def _const(value):
    return value


def _status_or(value: Any, default: S) -> S:
    try:
        return S(value)
    except ValueError:
        return default


def _overall(results: Iterable[S]) -> S:
    for r in results:
        if r != S.LLM_SUCCESS:
            return r
    return S.LLM_SUCCESS
