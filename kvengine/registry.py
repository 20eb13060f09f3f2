"""The cache registry: this engine's own caches.

Owns: every local cache (:class:`LocalCache`: the user's ``Cache``, its native
regions, its memfd), their ids, and the release of their memory once the core
says no job, frame or peer uses it (``KV_EVENT_REGION_FREED``). Peers learn of
caches through :class:`CachePeers` (the cache tables and link manager); the
registry never touches a link.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import mmap
import os
import weakref
from typing import Any, Iterator, Protocol, Sequence

import numpy as np

from . import kernel, layout
from .link import wait_idle
from .native import _native
from .status import LLMStatusCode as S, error_for
from .types import Cache, CacheDesc, Placement, param_invalid

__all__ = ["CacheRegistry", "LocalCache", "LOCAL_REGISTRIES", "group_regions"]

_serials = itertools.count(1)
_LOCAL_FLAGS = _native.F_EXPORT | _native.F_NOTIFY   # this engine's caches: TCP peers may name them
# Registries of this process by engine token, for the in-process ("local") transport.
LOCAL_REGISTRIES: "weakref.WeakValueDictionary[str, CacheRegistry]" = weakref.WeakValueDictionary()


class LocalCache:
    """Registry-side bookkeeping of one local cache."""

    __slots__ = ("cache", "serial", "regions", "memfd", "users", "idle", "unfreed", "released", "born")

    def __init__(self, cache: Cache, regions: list[tuple[int, int]], memfd: int | None) -> None:
        self.cache = cache
        self.serial = next(_serials)
        self.regions = regions            # (native region id, length)
        self.memfd = memfd
        self.users = 0                # transfers using it (Transfer keeps the count)
        self.idle: asyncio.Future[None] | None = None
        self.unfreed: set[int] = set()    # regions removed, not yet released by the core
        self.released: asyncio.Future[None] | None = None
        self.born = 0.0                   # loop time of the registration (links down before it never had it)

    @property
    def region_ids(self) -> list[int]:
        return [rid for rid, _ in self.regions]


class CachePeers(Protocol):
    """What the registry needs from the links."""

    def announce(self, state: LocalCache) -> None:
        """A cache was added: tell every linked peer."""

    async def forget(self, state: LocalCache) -> None:
        """A cache is being removed: ask every linked peer to stop using it (bounded)."""


class _NoPeers:
    def announce(self, state: LocalCache) -> None:
        pass

    async def forget(self, state: LocalCache) -> None:
        pass


def group_regions(addrs: Sequence[int], span: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Tensors at ``addrs``, each reaching ``span`` bytes (``CacheDesc.span``), as regions:
    overlapping or touching tensors share one (back to back, or FlashInfer's interleaved K
    and V). Returns ``(regions, placement)``: regions as ``(base, length)`` and, per
    tensor, ``(region index, offset in region)`` (kvengine/layout.py)."""
    return layout.union_spans(addrs, span)


class CacheRegistry:
    """This engine's caches (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, core: _native.Core, cluster_id: int, token: str) -> None:
        self._loop = loop
        self._core = core
        self._cluster_id = cluster_id
        self._caches: dict[int, LocalCache] = {}
        self._ids = itertools.count(1)   # LLM-DataDist ids start at 1
        self._freeing: dict[int, LocalCache] = {}   # region id -> its cache, until the core freed it
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.peers: CachePeers = _NoPeers()
        self._token = token
        LOCAL_REGISTRIES[token] = self

    def unpublish(self) -> None:
        """Engines of this process can no longer find these caches (the engine is closing)."""
        LOCAL_REGISTRIES.pop(self._token, None)

    def __len__(self) -> int:
        return len(self._caches)

    def __iter__(self) -> Iterator[LocalCache]:
        return iter(list(self._caches.values()))

    def __contains__(self, cache_id: object) -> bool:
        return cache_id in self._caches

    @property
    def table(self) -> dict[int, LocalCache]:
        """cache id -> state, for reading only (the native fast path looks caches up in it)."""
        return self._caches

    def by_id(self, cache_id: int) -> LocalCache | None:
        return self._caches.get(cache_id)

    def get(self, cache: Any) -> LocalCache:
        """The registered state of ``cache`` (a Cache of this engine), or raise."""
        if not isinstance(cache, Cache):
            raise param_invalid(f"expected a Cache from this engine, got {type(cache).__name__}")
        state = self._caches.get(cache.cache_id)
        if state is None or state.cache is not cache:
            raise error_for(S.LLM_KV_CACHE_NOT_EXIST, f"cache {cache.cache_id} is not registered with this engine")
        return state

    # ------------------------------------------------------------------ adding

    def allocate(self, desc: Any) -> Cache:
        desc = check_desc(desc, allocate=True)
        return self._register_allocated(desc, *allocate_memory(desc, self._cluster_id))

    async def allocate_async(self, desc: Any) -> Cache:
        desc = check_desc(desc, allocate=True)
        mem = await self._loop.run_in_executor(None, allocate_memory, desc, self._cluster_id)
        if self._closed:
            os.close(mem[0])
            raise error_for(S.LLM_ENGINE_FINALIZED, "the engine is closed")
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
        cache = Cache(next(self._ids), desc, tensors, [addr + t * stride for t in range(desc.num_tensors)],
                      [(rid, t * stride) for t in range(desc.num_tensors)], keep=(mm, base),
                      shared=(fd, length, stride))
        self._add(cache, [(rid, length)], fd)
        return cache

    def register(self, desc: Any, tensors: Sequence[Any]) -> Cache:
        desc = check_desc(desc)
        if isinstance(tensors, (bytes, bytearray, memoryview, np.ndarray)) or not hasattr(tensors, "__len__"):
            raise param_invalid("register_kv_cache takes a list of buffers, one per tensor")
        if len(tensors) != desc.num_tensors:
            raise param_invalid(f"got {len(tensors)} buffers for num_tensors {desc.num_tensors}")
        checked = [layout.check_tensor(i, layout.as_strided_array(i, t), desc) for i, t in enumerate(tensors)]
        addrs = [a for a, _ in checked]
        regions, placement = group_regions(addrs, desc.span)
        rids: list[int] = []
        for base, length in regions:
            st, rid = self._core.region_add(_native.REGION_LOCAL, 0, base, length, _LOCAL_FLAGS)
            if st:
                for r in rids:
                    self._core.region_remove(r)
                raise error_for(st, "cannot register the buffers")
            rids.append(rid)
        views = [v for _, v in checked]
        cache = Cache(next(self._ids), desc, views, addrs,
                      [(rids[ri], off) for ri, off in placement], keep=(list(tensors), views))
        self._add(cache, [(rid, length) for rid, (_, length) in zip(rids, regions)], None)
        return cache

    def _add(self, cache: Cache, regions: list[tuple[int, int]], memfd: int | None) -> None:
        state = LocalCache(cache, regions, memfd)
        state.born = self._loop.time()
        self._caches[cache.cache_id] = state
        self.peers.announce(state)

    # ---------------------------------------------------------------- removing

    def unregister(self, cache_id: int) -> asyncio.Future[None]:
        """Forget a cache now; the future is done once no peer or job uses its memory."""
        state = self._caches.pop(cache_id, None)
        fut: asyncio.Future[None] = self._loop.create_future()
        if state is None:
            fut.set_result(None)
            return fut
        state.cache._valid = False
        task = self._loop.create_task(self._retire(state))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        def done(_: asyncio.Task[None]) -> None:
            if not fut.done():
                fut.set_result(None)
        task.add_done_callback(done)
        return fut

    async def _retire(self, state: LocalCache) -> None:
        try:
            await self.peers.forget(state)
            await wait_idle(state)   # bounded: each transfer has a deadline
        finally:
            self._release(state)
        if state.released is not None:
            await state.released   # the core released every region (no frame writes into it)

    def _release(self, state: LocalCache) -> None:
        """Remove the cache's regions; the memory stays referenced until the core
        reports each region released (KV_EVENT_REGION_FREED)."""
        if not self._closed:
            state.released = self._loop.create_future()
            for rid in state.region_ids:
                state.unfreed.add(rid)
                self._freeing[rid] = state
                self._core.region_remove(rid)
        if state.memfd is not None:
            os.close(state.memfd)
            state.memfd = None
        state.cache._valid = False

    def on_region_freed(self, rid: int) -> None:
        state = self._freeing.pop(rid, None)
        if state is not None:
            state.unfreed.discard(rid)
            if not state.unfreed:
                state.cache._keep = None   # no job, frame or peer uses the memory any more
                if state.released is not None and not state.released.done():
                    state.released.set_result(None)

    def close(self) -> None:
        """The core is closed: no thread touches the caches any more."""
        self.unpublish()
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for state in self._caches.values():
            self._release(state)
            state.cache._keep = None
        self._caches.clear()


def check_desc(desc: Any, allocate: bool = False) -> CacheDesc:
    if not isinstance(desc, CacheDesc):
        raise param_invalid(f"desc must be a CacheDesc, got {type(desc).__name__}")
    if allocate and desc.block_stride is not None:
        raise param_invalid("allocate_cache lays tensors out contiguously: a desc with a block_stride "
                            "describes memory the caller registers (register_kv_cache)")
    if desc.placement != Placement.HOST:
        raise error_for(S.LLM_FEATURE_NOT_ENABLED, "only Placement.HOST caches exist on this machine")
    return desc


def _map_for_writing(fd: int, length: int) -> mmap.mmap:
    """``length`` bytes of ``fd`` mapped shared, every page faulted in for writing (GIL
    released). A page faulted in for reading first (MAP_POPULATE) takes its first copy at
    a third to a half of the speed of later ones on this project's VMs (kv_core.h
    ``kv_populate_write``); kernels before 5.14 lack the advice and get MAP_POPULATE."""
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=rw)
    e = _native.populate_write(mm)
    if e == 0:
        return mm
    mm.close()
    if e != errno.EINVAL:   # ENOMEM: said now, where MAP_POPULATE said nothing (a SIGBUS later)
        raise OSError(e, os.strerror(e))
    return mmap.mmap(fd, length, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=rw)


def allocate_memory(desc: CacheDesc, cluster_id: int) -> tuple[int, mmap.mmap, int, int]:
    """A pre-faulted shared mapping for ``desc``: (memfd, mmap, length, tensor stride)."""
    stride = kernel.memfd_stride(desc.size)
    length = stride * desc.num_tensors
    fd = os.memfd_create(f"kvengine-cache-{cluster_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, length)
        mm = _map_for_writing(fd, length)
        # Sealed before any peer sees it: a peer that keeps the fd cannot shrink it (our
        # mapping would SIGBUS) or grow it, nor add seals (kernel.check_memfd).
        kernel.seal_memfd(fd)
    except OSError as e:
        os.close(fd)
        raise error_for(S.LLM_OUT_OF_MEMORY, f"cannot allocate {length} bytes of shared memory: {e}")
    return fd, mm, length, stride
