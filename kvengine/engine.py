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
import mmap
import os
import socket
import threading
from typing import Any, Iterable, Sequence

import numpy as np

from . import control, plan
from .native import _native
from .links import LOCAL_ENGINES, _Links, group_regions, wait_idle
from .scheduler import _Scheduler, _new_hists
from .notify import Notification, _Notifications
from .status import LLMError, LLMStatusCode as S, error_for
from .transfer import Transfer
from .types import (BlocksCacheKey, Cache, CacheDesc, CacheIndex, EngineOptions, KvCacheExtParam,
                    Placement, Role, check_timeout, param_invalid)


__all__ = ["KvEngine"]

log = logging.getLogger("kvengine")

_U64 = 2**64 - 1
_serials = itertools.count(1)
_warned_no_secret = False
_warned_insecure = False
_LOCAL_FLAGS = _native.F_EXPORT | _native.F_NOTIFY  # this engine's caches: TCP peers may name them
_MAX_NOTIFY = 4096                                    # bytes of one push notification


class _LocalState:
    """Engine-side bookkeeping of one local cache."""

    __slots__ = ("cache", "serial", "regions", "memfd", "_inflight", "_idle", "unfreed", "released")

    def __init__(self, cache: Cache, regions: list[tuple[int, int]], memfd: int | None) -> None:
        self.cache = cache
        self.serial = next(_serials)
        self.regions = regions            # (native region id, length)
        self.memfd = memfd
        self._inflight = 0
        self._idle = None
        self.unfreed: set[int] = set()    # regions removed, not yet released by the core
        self.released: asyncio.Future | None = None

    @property
    def region_ids(self) -> list[int]:
        return [rid for rid, _ in self.regions]


class KvEngine(_Links, _Scheduler, _Notifications):
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
        self._close_task: asyncio.Task | None = None
        self._host = control.host_identity()
        self._token = control.new_nonce()
        self._caches: dict[int, _LocalState] = {}
        self._cache_ids = itertools.count(1)  # LLM-DataDist ids start at 1
        self._links: dict = {}
        self._linking: set[int] = set()
        self._joins: dict = {}            # one-time join tokens (Unix socket) -> _Joining
        self._preauth: dict = {}          # source -> {close function of an unauthenticated connection}
        self._preauth_count = 0
        self._tcp_ids = itertools.count(1)
        self._tcp_ready: dict[int, asyncio.Future] = {}
        self._tcp_links: dict = {}
        self._down_counts: dict[str, int] = {}   # native failure counters at the last link failure
        self._data_port: int | None = None
        self._freeing: dict[int, _LocalState] = {}
        self._link_waiters: dict[int, list[asyncio.Future]] = {}
        self._jobs = itertools.count(1)
        self._pending: dict[int, Transfer] = {}
        self._plans: dict[tuple, array.array] = {}
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.AbstractServer | None = None
        self._unix: socket.socket | None = None
        self._unix_name: str | None = None
        self._counts = {"transfers": 0, "bytes": 0, "by_status": {}, "control_refused": 0}
        self._queued = 0                 # transfers waiting in link queues or in flight
        self._hists = _new_hists()       # latency histograms, every link
        self._per_link: dict = {}        # (cluster id, transport) -> counters and histograms
        self._notes_init()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> "KvEngine":
        """Start the native core and, with ``listen``, the control servers."""
        if self._started or self._closed:
            self._check_open()   # closed, or started on another loop: say so
            return self
        global _warned_no_secret, _warned_insecure
        self._loop = asyncio.get_running_loop()
        self._core = _native.Core(self.options.movers, self.options.chunk_bytes)
        self._loop.add_reader(self._core.fileno(), self._drain)
        self._started = True
        LOCAL_ENGINES[self._token] = self
        if self.options.secret is None and self.options.insecure and not _warned_insecure:
            _warned_insecure = True
            log.warning("kvengine: no secret and insecure=True: any host that reaches this engine's "
                        "port can link to it and read and write its registered caches")
        elif self.options.secret is None and not _warned_no_secret:
            _warned_no_secret = True
            log.warning("kvengine: no secret configured (EngineOptions.secret or KVENGINE_SECRET): "
                        "links are not authenticated; only engines on this host can link")
        try:
            self._unix, self._unix_name = control.unix_listener()
            self._loop.add_reader(self._unix.fileno(), self._on_unix_accept)
            if self._listen is not None:
                host, port = control.parse_address(self._listen)
                # the backlog takes a burst of connections; unauthenticated ones are bounded
                # once accepted (links.py, "server side")
                try:
                    self._server = await asyncio.start_server(self._on_tcp, host, port, backlog=1024)
                except OSError as e:   # port in use, address not on this host, unresolvable name
                    raise error_for(S.LLM_LINK_FAILED,
                                    f"cannot listen on {self._listen!r}: {_os_error(e)}") from e
                sockname = self._server.sockets[0].getsockname()
                h = sockname[0]
                self.address = f"[{h}]:{sockname[1]}" if ":" in h else f"{h}:{sockname[1]}"
                st, self._data_port = self._core.tcp_listen(h, 0)   # the TCP data plane
                if st:
                    raise error_for(st, f"cannot listen for data connections on {h}")
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self) -> "KvEngine":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Unlink every peer, abort every transfer (fenced), stop the core. Idempotent.

        Transfers still in flight resolve ``LLM_ENGINE_FINALIZED`` (or, if the peer
        could not fence them, ``LLM_LINK_FAILED`` once its lease on them expired).
        Bounded: the graceful unlinks get ``link_timeout`` in all; links still up
        then are dropped, and unfenced transfers resolve within ``heartbeat_timeout``
        of their abort. Cancel-safe: the closing runs in its own task, so a cancelled
        ``close()`` keeps closing and a second call waits for the same task.
        """
        if self._loop is not None:
            self._check_loop()
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        LOCAL_ENGINES.pop(self._token, None)
        if self._server is not None:
            self._server.close()
        if self._unix is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._unix.fileno())
            self._unix.close()
        self._notes_close()
        links = list(self._links.values())
        if links:
            opts = self.options
            try:
                async with asyncio.timeout(opts.link_timeout):
                    await asyncio.gather(*(self._unlink_one(link, opts.link_timeout, graceful=True,
                                                            fence_status=S.LLM_ENGINE_FINALIZED)
                                           for link in links), return_exceptions=True)
            except TimeoutError:
                log.warning("close: links %s did not unlink within link_timeout %.2f s; dropping them",
                            [link.cluster_id for link in links if link.up], opts.link_timeout)
            for link in links:
                self._link_down(link, S.LLM_ENGINE_FINALIZED)
            # a transfer whose peer did not fence it resolves when the peer's lease on
            # it has expired: natively, within heartbeat_timeout of its abort
            waits = [asyncio.ensure_future(t._fenced()) for t in set(self._pending.values())
                     if t._status is None]
            if waits:
                _, late = await asyncio.wait(waits, timeout=opts.heartbeat_timeout)
                for w in late:
                    w.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._core is not None:
            self._core.close()          # aborts every job, joins the movers and the I/O thread
            self._loop.remove_reader(self._core.fileno())
            self._drain()
            for t in list(self._pending.values()):  # nothing should be left; never leave a waiter
                t._jobs.clear()
                t._finish(S.LLM_ENGINE_FINALIZED, t.nbytes)
            self._pending.clear()
        for st in self._caches.values():   # the core is closed: no thread touches them any more
            self._release_local(st)
            st.cache._keep = None
        self._caches.clear()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except (asyncio.TimeoutError, RuntimeError):
                pass

    def _check_open(self) -> None:
        if self._closed:
            raise error_for(S.LLM_ENGINE_FINALIZED, "the engine is closed")
        if not self._started:
            raise error_for(S.LLM_FAILED, "the engine is not started: use `async with` or `await engine.start()`")
        self._check_loop()

    def _check_loop(self) -> None:
        """Raise unless the caller runs on the loop that started the engine.

        The engine's futures, readers and timers belong to that loop: a call from
        another thread or loop would fail deep inside asyncio ("attached to a
        different loop") or wait forever.
        """
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return
        where = ("a thread with no running event loop" if running is None
                 else f"another event loop ({type(running).__name__} in thread "
                      f"{threading.current_thread().name!r})")
        raise error_for(S.LLM_FAILED,
                        f"KvEngine {self.cluster_id} was called from {where}; it runs on the event loop "
                        f"that started it ({type(self._loop).__name__}): call it there, or from another "
                        f"thread submit the coroutine to that loop: "
                        f"asyncio.run_coroutine_threadsafe(coro, engine_loop).result() "
                        f"(plain methods: engine_loop.call_soon_threadsafe)")

    def _spawn(self, coro) -> asyncio.Task:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -------------------------------------------------------------- completions

    def _drain(self) -> None:
        """eventfd readable: resolve every transfer whose native job finished."""
        done = self._core.poll()
        jobs = [c for c in done if not c[0] & _native.EVENT] if done else done
        if len(jobs) != len(done):
            for job_id, status, _, _ in done:
                if job_id & _native.EVENT:
                    self._on_event(job_id & _native.EVENT_KIND_MASK, job_id & _native.EVENT_ID_MASK, status)
        if jobs:
            self._on_completions(jobs)

    def _on_event(self, kind: int, ident: int, status: int) -> None:
        if kind == _native.EVENT_REGION_FREED:
            state = self._freeing.pop(ident, None)
            if state is not None:
                state.unfreed.discard(ident)
                if not state.unfreed:
                    state.cache._keep = None   # no job, frame or peer uses the memory any more
                    if state.released is not None and not state.released.done():
                        state.released.set_result(None)
        else:
            self._on_link_event(kind, ident, status)

    # ------------------------------------------------------------------- caches

    def allocate_cache(self, desc: CacheDesc) -> Cache:
        """Engine-owned cache in shared memory (memfd), pre-faulted.

        Peers on this host map it and write straight into it. ``cache.tensors``
        are numpy views; keep using them until you unregister the cache.
        Pre-faulting runs on the calling thread (~0.3-2 s per GiB on these VMs): for
        large caches on a live engine use :meth:`allocate_cache_async`, which keeps
        the loop (and so the links' heartbeats) running meanwhile.
        """
        self._check_open()
        desc = self._check_desc(desc)
        return self._register_allocated(desc, *_allocate_memory(desc, self.cluster_id))

    async def allocate_cache_async(self, desc: CacheDesc) -> Cache:
        """:meth:`allocate_cache`, with the pre-faulting in a worker thread."""
        self._check_open()
        desc = self._check_desc(desc)
        mem = await self._loop.run_in_executor(None, _allocate_memory, desc, self.cluster_id)
        if self._closed:
            os.close(mem[0])
            self._check_open()
        return self._register_allocated(desc, *mem)

    def _register_allocated(self, desc: CacheDesc, fd: int, mm: mmap.mmap, length: int, stride: int) -> Cache:
        base = np.frombuffer(mm, dtype=np.uint8)
        addr = base.__array_interface__["data"][0]
        npd = desc.dtype.numpy_dtype
        count = desc.size // npd.itemsize
        tensors = [np.frombuffer(mm, dtype=npd, count=count, offset=t * stride).reshape(desc.shape)
                   for t in range(desc.num_tensors)]
        st, rid = self._core.region_add(_native.REGION_LOCAL, 0, addr, length, _LOCAL_FLAGS)
        if st:
            os.close(fd)
            raise error_for(st, "cannot register the allocated cache")
        cache_id = next(self._cache_ids)
        cache = Cache(cache_id, desc, tensors, [addr + t * stride for t in range(desc.num_tensors)],
                      [(rid, t * stride) for t in range(desc.num_tensors)], keep=(mm, base),
                      shared=(fd, length, stride))
        self._add_cache(cache, [(rid, length)], fd)
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
        regions, placement = group_regions(addrs, desc.size)
        rids = []
        for base, length in regions:
            st, rid = self._core.region_add(_native.REGION_LOCAL, 0, base, length, _LOCAL_FLAGS)
            if st:
                for r in rids:
                    self._core.region_remove(r)
                raise error_for(st, "cannot register the buffers")
            rids.append(rid)
        npd = desc.dtype.numpy_dtype
        views = [a.view(npd).reshape(desc.shape) if a.dtype.itemsize and a.nbytes == desc.size else a
                 for a in arrays]
        cache = Cache(next(self._cache_ids), desc, views, addrs,
                      [(rids[ri], off) for ri, off in placement], keep=(list(tensors), arrays))
        self._add_cache(cache, [(rid, length) for rid, (_, length) in zip(rids, regions)], None)
        return cache

    def _check_desc(self, desc: Any) -> CacheDesc:
        if not isinstance(desc, CacheDesc):
            raise param_invalid(f"desc must be a CacheDesc, got {type(desc).__name__}")
        if desc.placement != Placement.HOST:
            raise error_for(S.LLM_FEATURE_NOT_ENABLED, "only Placement.HOST caches exist on this machine")
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

    def _add_cache(self, cache: Cache, regions: list[tuple[int, int]], memfd: int | None) -> None:
        state = _LocalState(cache, regions, memfd)
        self._caches[cache.cache_id] = state
        for link in list(self._links.values()):
            if link.up:
                self._spawn(self._announce(link, [state]))

    def unregister_kv_cache(self, cache_id: int) -> asyncio.Future:
        """Forget a cache (an unknown id is a no-op, as in LLM-DataDist).

        New transfers naming it fail at once with ``LLM_KV_CACHE_NOT_EXIST``.
        The memory stays referenced until transfers in flight on it have finished
        (bounded by their deadlines and fences) and every linked peer has confirmed it
        will not touch it any more; a peer that does not confirm within ``link_timeout``
        is unlinked. Returns a future that is done then; awaiting it is optional.
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
            replies = await asyncio.gather(*(self._request(link, {"t": "cache_del", "id": state.cache.cache_id},
                                                           self.options.link_timeout) for link in links),
                                           return_exceptions=True)
            await wait_idle(state)
            # A peer that writes into caller-owned memory over CMA and did not confirm may
            # still be writing: keep the memory until that link is down. (memfd caches stay
            # mapped by the peer anyway; tcp frames are checked against our region table.)
            unsure = [link for link, r in zip(links, replies)
                      if r is None and link.up and link.transport == "shm" and state.memfd is None]
            if unsure:
                # Waiting for such a link to go down by itself could take forever (a peer
                # that answers pings but not cache_del): drop it, which fences our side.
                log.warning("unregister_kv_cache(%s): clusters %s did not confirm within %.2f s; "
                            "dropping their links", state.cache.cache_id,
                            [link.cluster_id for link in unsure], self.options.link_timeout)
                for link in unsure:
                    self._link_down(link, S.LLM_LINK_FAILED)
        finally:
            self._release_local(state)
        if state.released is not None:
            await state.released   # the core released every region (no frame writes into it)

    def _release_local(self, state: _LocalState) -> None:
        """Remove the cache's regions; the memory stays referenced until the core
        reports each region released (KV_EVENT_REGION_FREED)."""
        if self._core is not None and not self._closed:
            state.released = self._loop.create_future()
            for rid in state.region_ids:
                state.unfreed.add(rid)
                self._freeing[rid] = state
                self._core.region_remove(rid)
        if state.memfd is not None:
            os.close(state.memfd)
            state.memfd = None
        state.cache._valid = False

    # -------------------------------------------------------------------- links

    # ---------------------------------------------------------------- transfers

    def _local(self, cache: Any) -> _LocalState:
        if not isinstance(cache, Cache):
            raise param_invalid(f"expected a Cache from this engine, got {type(cache).__name__}")
        state = self._caches.get(cache.cache_id)
        if state is None or state.cache is not cache:
            raise error_for(S.LLM_KV_CACHE_NOT_EXIST,
                             f"cache {cache.cache_id} is not registered with this engine")
        return state

    def _remote(self, cluster_id: Any, cache_id: Any) -> tuple:
        link = self._links.get(cluster_id)
        if link is None:
            if cluster_id == self.cluster_id:
                raise param_invalid(f"cluster {cluster_id} is this engine: transfers need a peer")
            raise error_for(S.LLM_NOT_YET_LINK, f"cluster {cluster_id!r} is not linked")
        rc = link.remote.get(cache_id)
        if rc is None:
            raise error_for(S.LLM_KV_CACHE_NOT_EXIST, f"cluster {cluster_id} has no cache {cache_id!r}")
        return link, rc

    def _deadline(self, timeout: Any) -> float:
        return check_timeout(timeout, self.options.sync_kv_timeout)

    def _segments(self, key: tuple | None, make, src_regions, dst_regions) -> tuple[array.array, int]:
        """The packed plan and its byte count (memoized for exact-typed keys)."""
        if key is not None:
            if not _plain_key(key):   # only exact ints hit the memo: True == 1, 0.0 == 0
                key = None
            else:
                hit = self._plans.get(key)
                if hit is not None:
                    return hit
        mapped = [(src_regions[s][0], src_regions[s][1] + so, dst_regions[d][0], dst_regions[d][1] + do, n)
                  for s, so, d, do, n in make()]
        merged = plan.coalesce(mapped)
        hit = (array.array("Q", [w for seg in merged for w in seg]), sum(seg[4] for seg in merged))
        if key is not None:
            if len(self._plans) >= 4096:
                self._plans.clear()
            self._plans[key] = hit
        return hit

    def _options(self, timeout: Any, priority: Any, notify: Any) -> tuple[float, int, bytes | None]:
        tmo = self._deadline(timeout)
        if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
            raise param_invalid(f"priority must be an int in [-1000, 1000], got {priority!r}")
        if notify is not None:
            if not isinstance(notify, (bytes, bytearray)) or len(notify) > _MAX_NOTIFY:
                raise param_invalid(f"notify must be bytes of at most {_MAX_NOTIFY}, got {type(notify).__name__}"
                                    + (f" of {len(notify)}" if isinstance(notify, (bytes, bytearray)) else ""))
            notify = bytes(notify)
        return tmo, priority, notify

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
                             timeout: float | None = None, priority: int = 0,
                             notify: bytes | None = None) -> Transfer:
        """Start writing row ``src_batch_index`` of local ``cache`` into the peer's
        ``dst_index`` row; returns a :class:`Transfer` (awaiting it never raises)."""
        def go() -> Transfer:
            local = self._local(cache)
            if not isinstance(dst_index, CacheIndex):
                raise param_invalid(f"dst_index must be a CacheIndex, got {type(dst_index).__name__}")
            link, rc = self._remote(dst_index.cluster_id, dst_index.cache_id)
            tmo, prio, note = self._options(timeout, priority, notify)
            key = ("pc", local.serial, rc.serial, src_batch_index, dst_index.batch_index, size, ext_param)
            segs = self._segments(key, lambda: plan.plan_cache(
                local.cache.desc, rc.desc, src_batch_index, dst_index.batch_index, size, ext_param, op="push"),
                local.cache._regions, rc.regions)
            return self._launch(link, local, rc, *segs, tmo, prio, note,
                                f"push_kv_cache to cluster {dst_index.cluster_id} cache {dst_index.cache_id}",
                                link.lease_id)
        return self._transfer("push_kv_cache", go)

    def submit_pull_kv_cache(self, src_index: CacheIndex, cache: Cache, batch_index: int = 0,
                             size: int = -1, ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None, priority: int = 0) -> Transfer:
        """Start reading the peer's ``src_index`` row into row ``batch_index`` of local
        ``cache``; ``size`` is bytes per tensor or -1 for the whole row."""
        def go() -> Transfer:
            local = self._local(cache)
            if not isinstance(src_index, CacheIndex):
                raise param_invalid(f"src_index must be a CacheIndex, got {type(src_index).__name__}")
            link, rc = self._remote(src_index.cluster_id, src_index.cache_id)
            tmo, prio, note = self._options(timeout, priority, None)
            key = ("lc", local.serial, rc.serial, src_index.batch_index, batch_index, size, ext_param)
            segs = self._segments(key, lambda: plan.plan_cache(
                rc.desc, local.cache.desc, src_index.batch_index, batch_index, size, ext_param, op="pull"),
                rc.regions, local.cache._regions)
            return self._launch(link, local, rc, *segs, tmo, prio, note,
                                f"pull_kv_cache from cluster {src_index.cluster_id} cache {src_index.cache_id}")
        return self._transfer("pull_kv_cache", go)

    def submit_push_kv_blocks(self, cache: Cache, dst_key: BlocksCacheKey, src_blocks: Sequence[int],
                              dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None,
                              timeout: float | None = None, priority: int = 0,
                             notify: bytes | None = None) -> Transfer:
        """Start writing local blocks ``src_blocks[i]`` into the peer's ``dst_blocks[i]``."""
        def go() -> Transfer:
            local = self._local(cache)
            if not isinstance(dst_key, BlocksCacheKey):
                raise param_invalid(f"dst_key must be a BlocksCacheKey, got {type(dst_key).__name__}")
            link, rc = self._remote(dst_key.cluster_id, dst_key.cache_id)
            tmo, prio, note = self._options(timeout, priority, notify)
            segs = self._segments(None, lambda: plan.plan_blocks(
                local.cache.desc, rc.desc, src_blocks, dst_blocks, ext_param, op="push"),
                local.cache._regions, rc.regions)
            return self._launch(link, local, rc, *segs, tmo, prio, note,
                                f"push_kv_blocks to cluster {dst_key.cluster_id} cache {dst_key.cache_id}",
                                link.lease_id)
        return self._transfer("push_kv_blocks", go)

    def submit_pull_kv_blocks(self, src_key: BlocksCacheKey, cache: Cache, src_blocks: Sequence[int],
                              dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None,
                              timeout: float | None = None, priority: int = 0) -> Transfer:
        """Start reading the peer's blocks ``src_blocks[i]`` into local ``dst_blocks[i]``."""
        def go() -> Transfer:
            local = self._local(cache)
            if not isinstance(src_key, BlocksCacheKey):
                raise param_invalid(f"src_key must be a BlocksCacheKey, got {type(src_key).__name__}")
            link, rc = self._remote(src_key.cluster_id, src_key.cache_id)
            tmo, prio, note = self._options(timeout, priority, None)
            segs = self._segments(None, lambda: plan.plan_blocks(
                rc.desc, local.cache.desc, src_blocks, dst_blocks, ext_param, op="pull"),
                rc.regions, local.cache._regions)
            return self._launch(link, local, rc, *segs, tmo, prio, note,
                                f"pull_kv_blocks from cluster {src_key.cluster_id} cache {src_key.cache_id}")
        return self._transfer("pull_kv_blocks", go)

    async def push_kv_cache(self, cache: Cache, dst_index: CacheIndex, src_batch_index: int = 0,
                            size: int = -1, ext_param: KvCacheExtParam | None = None,
                            timeout: float | None = None, priority: int = 0,
                            notify: bytes | None = None) -> S:
        """PushKvCache: ``LLM_SUCCESS`` or raise the :class:`LLMError` subclass of the status.

        ``priority`` (-1000..1000, higher first) and the deadline order the link's queue;
        ``notify`` bytes reach the destination engine after the last byte landed.
        """
        return await self.submit_push_kv_cache(cache, dst_index, src_batch_index, size, ext_param,
                                               timeout, priority, notify)._result()

    async def pull_kv_cache(self, src_index: CacheIndex, cache: Cache, batch_index: int = 0,
                            size: int = -1, ext_param: KvCacheExtParam | None = None,
                            timeout: float | None = None, priority: int = 0) -> S:
        """PullKvCache: ``LLM_SUCCESS`` or raise the :class:`LLMError` subclass of the status."""
        return await self.submit_pull_kv_cache(src_index, cache, batch_index, size, ext_param,
                                               timeout, priority)._result()

    async def push_kv_blocks(self, cache: Cache, dst_key: BlocksCacheKey, src_blocks: Sequence[int],
                             dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None, priority: int = 0,
                             notify: bytes | None = None) -> S:
        """PushKvBlocks: ``LLM_SUCCESS`` or raise."""
        return await self.submit_push_kv_blocks(cache, dst_key, src_blocks, dst_blocks, ext_param,
                                                timeout, priority, notify)._result()

    async def pull_kv_blocks(self, src_key: BlocksCacheKey, cache: Cache, src_blocks: Sequence[int],
                             dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None, priority: int = 0) -> S:
        """PullKvBlocks: ``LLM_SUCCESS`` or raise."""
        return await self.submit_pull_kv_blocks(src_key, cache, src_blocks, dst_blocks, ext_param,
                                                timeout, priority)._result()

    def layer_stream(self, cache: Cache, dsts: Sequence[Any], src_batch_index: int = 0,
                     tensor_num_per_layer: int = 2, timeout: float | None = None,
                     notify: bytes | None = None, priority: int = 0,
                     src_blocks: Sequence[int] | None = None,
                     dst_blocks: Sequence[Sequence[int]] | None = None):
        """Push ``cache`` layer by layer as layers become ready (see kvengine/layers.py).

        ``dsts``: ``CacheIndex`` rows (source row ``src_batch_index``), or
        ``BlocksCacheKey`` caches with ``src_blocks`` and ``dst_blocks`` (one list, or
        one per destination). ``timeout`` covers the whole stream. ``notify`` reaches
        each destination once all its layers landed.
        """
        from .layers import open_stream
        return open_stream(self, cache, dsts, src_batch_index, tensor_num_per_layer, timeout, notify,
                           priority, src_blocks, dst_blocks)

    # ---------------------------------------------------------------- inspection

    def stats(self) -> dict:
        """Counters and latency summaries (see docs/api.md, "Inspection").

        ``latency`` phases: ``queue`` (submit to first byte handed to the core),
        ``transfer`` (first piece to completion), ``total``; each with count, mean
        and p50/p90/p99 in seconds. ``peers`` holds the same per ``"cluster/transport"``.
        """
        def live(heap):
            return sum(1 for _, t in heap if t._status is None and t._left)

        out = {
            "transfers": self._counts["transfers"],
            "bytes": self._counts["bytes"],
            "by_status": dict(self._counts["by_status"]),
            "queued": self._queued,
            "in_flight": len(self._pending),
            "latency": {k: h.summary() for k, h in self._hists.items()},
            "links": {cid: {"transport": l.transport, "remote_caches": len(l.remote),
                            "in_flight": len(l.inflight), "queue_depth": live(l.heap),
                            "inflight_bytes": l.inflight_bytes} for cid, l in self._links.items()},
            "peers": {f"{cid}/{tr}": {"transfers": p["transfers"], "bytes": p["bytes"],
                                      "by_status": dict(p["by_status"]),
                                      "latency": {k: p[k].summary() for k in ("queue", "transfer", "total")}}
                      for (cid, tr), p in self._per_link.items()},
            "notifications": self._notes_stats(),
            "control_refused": self._counts["control_refused"],
            "control_pending": self._preauth_count,
            "caches": len(self._caches),
        }
        if self._core is not None:
            out["native"] = self._core.stats()
        return out

    def metrics_text(self) -> str:
        """The counters and histograms in Prometheus text exposition format."""
        from .metrics import render
        return render(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "started" if self._started else "new"
        return f"<KvEngine cluster={self.cluster_id} role={self.role.name} address={self.address} {state}>"


def _os_error(e: OSError) -> str:
    """``[Errno 98] Address already in use`` style text of an OSError."""
    if e.errno and e.errno > 0 and not isinstance(e, socket.gaierror):
        return f"[Errno {e.errno}] {os.strerror(e.errno)}"
    return str(e) or type(e).__name__


def _allocate_memory(desc: CacheDesc, cluster_id: int) -> tuple[int, mmap.mmap, int, int]:
    """A pre-faulted shared mapping for ``desc``: (memfd, mmap, length, tensor stride)."""
    stride = control.memfd_stride(desc.size)
    length = stride * desc.num_tensors
    fd = os.memfd_create(f"kvengine-cache-{cluster_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, length)
        mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # Sealed before any peer sees it: a peer that keeps the fd cannot shrink it (our
        # mapping would SIGBUS) or grow it, nor add seals (control.check_memfd).
        control.seal_memfd(fd)
    except OSError as e:
        os.close(fd)
        raise error_for(S.LLM_OUT_OF_MEMORY, f"cannot allocate {length} bytes of shared memory: {e}")
    return fd, mm, length, stride


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

