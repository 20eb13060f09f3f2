"""``LLMDataDist.cache_manager``: registration, keys and transfers, over a SyncKvEngine.

Ids and model ids. LLM-DataDist names a peer's cache by the id its register
call returned (from 1) or, for block caches, by the ``model_id`` of the
``BlocksCacheKey`` it was registered with. kvengine's engine names caches by
its own ids, so each node publishes a small *directory* (its kvengine cache 1:
user id -> kvengine id, model id -> kvengine id) that peers read with one pull
the first time they need it, and again when a name is not in their copy
(LLM-DataDist, too, fetches the peer's table on first use and caches it).
Request keys (``CacheKey``) go to kvengine's own keys (``kv.CacheKey``).
"""

from __future__ import annotations

import struct
import threading
import zlib
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
from numpy.typing import NDArray

import kvengine as kv
from ._memory import check_range, view_at, writable_ranges
from ._types import (U64, BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, LLMException, LLMStatusCode,
                     Placement, dumps, loads, param_invalid, raise_llm)

if TYPE_CHECKING:
    from kvengine.sync import SyncKvEngine
    from ._task import CacheTask, LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig

__all__ = ["Cache", "CacheManager", "DIRECTORY_ID"]

S = LLMStatusCode
DIRECTORY_ID, _SCRATCH_ID = 1, 2
_DIR_BYTES = 1 << 16
_HEAD = struct.Struct("<II")   # body length, crc32


class Cache:
    """A registered cache (LLM-DataDist's V2 ``Cache``): ``cache_id``, ``cache_desc``,
    ``tensor_addrs``, ``is_blocks_cache``. Not built by users, except
    ``Cache.create_cpu_cache`` (a host handle for ``swap_blocks``)."""

    def __init__(self, cache_id: int, cache_desc: CacheDesc, tensor_addrs: list[int], is_blocks_cache: bool,
                 rows: list[NDArray[np.uint8]], buffers: list[Any]) -> None:
        self.cache_id = cache_id
        self.cache_desc = cache_desc
        self.tensor_addrs = tensor_addrs
        self.is_blocks_cache = is_blocks_cache
        self._rows = rows            # per tensor: (dim 0, bytes per row) uint8 view
        self._buffers = buffers      # what kvengine registers (views of the addresses, or our arrays)
        self._kv: kv.Cache | None = None
        self._keys: list[tuple[CacheKey, int]] = []
        self._model: int | None = None

    @staticmethod
    def create_cpu_cache(cache_desc: CacheDesc, addrs: Sequence[int]) -> "Cache":
        """A host cache handle (``cache_id`` -1) over caller memory, for ``swap_blocks``."""
        ints, rows, buffers = _views(cache_desc, addrs, host_only=True)
        return Cache(-1, cache_desc, ints, True, rows, buffers)

    def __repr__(self) -> str:
        return f"Cache(cache_id={self.cache_id}, cache_desc={self.cache_desc}, is_blocks={self.is_blocks_cache})"


def _views(desc: CacheDesc, addrs: Sequence[int], host_only: bool = False
           ) -> tuple[list[int], list[NDArray[np.uint8]], list[Any]]:
    if host_only and desc.placement == Placement.DEVICE:
        desc.to_kv()   # raises LLM_FEATURE_NOT_ENABLED with the message
    if not isinstance(addrs, (list, tuple)) or len(addrs) != desc.num_tensors or not addrs:
        raise param_invalid(f"addrs needs one address per tensor ({desc.num_tensors}), got {addrs!r}")
    ranges = writable_ranges()
    size = desc.size
    ints = [check_range(a, size, f"addrs[{i}]", ranges) for i, a in enumerate(addrs)]
    flat = [view_at(a, size) for a in ints]
    return ints, [f.reshape(desc.shape[0], -1) for f in flat], flat


def _ext(src: Any, dst: Any, tnpl: int) -> kv.KvCacheExtParam | None:
    for name, r in (("src_layer_range", src), ("dst_layer_range", dst)):
        if r is not None and (not isinstance(r, range) or r.step != 1 or not 0 <= r.start < r.stop):
            raise param_invalid(f"{name} must be a range(start, stop) with 0 <= start < stop, got {r!r}")
    if src is None and dst is None and tnpl == 2:
        return None
    return kv.KvCacheExtParam(src if src is not None else (-1, -1), dst if dst is not None else (-1, -1), tnpl)


def kv_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Raise kvengine errors as LLMException (the status code carried over)."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except kv.LLMError as e:
            raise raise_llm(e) from e
    wrapped.__name__, wrapped.__doc__ = fn.__name__, fn.__doc__
    return wrapped


class CacheManager:
    """LLM-DataDist V2's ``CacheManager`` (see the module docstring)."""

    def __init__(self, cluster_id: int, engine: Callable[[], "SyncKvEngine"]) -> None:
        self._cluster_id = cluster_id
        self._engine = engine
        self._lock = threading.RLock()
        self._caches: dict[int, Cache] = {}
        self._next_id = 1
        self._dir = np.zeros((1, _DIR_BYTES), np.uint8)
        self._scratch = np.zeros((1, _DIR_BYTES), np.uint8)
        self._dir_cache: kv.Cache | None = None
        self._scratch_cache: kv.Cache | None = None
        self._remote: dict[int, dict[str, dict[int, int]]] = {}

    # --------------------------------------------------------------- the engine

    def attach(self, e: "SyncKvEngine") -> None:
        """Register the directory, the scratch and every cache with a (new) engine, in order."""
        d = kv.CacheDesc(1, (1, _DIR_BYTES), np.uint8)
        self._dir_cache = e.register_kv_cache(d, [self._dir])
        self._scratch_cache = e.register_kv_cache(d, [self._scratch])
        assert (self._dir_cache.cache_id, self._scratch_cache.cache_id) == (DIRECTORY_ID, _SCRATCH_ID)
        self._remote.clear()
        for c in self._caches.values():
            self._register(e, c)
        self._publish()

    def _register(self, e: "SyncKvEngine", c: Cache) -> None:
        c._kv = e.register_kv_cache(c.cache_desc.to_kv(), c._buffers)
        for key, row in c._keys:
            self._bind(e, c, key, row)

    def forget(self, cluster_id: int) -> None:
        self._remote.pop(cluster_id, None)

    def _publish(self) -> None:
        table = {"ids": {c.cache_id: c._kv.cache_id for c in self._caches.values() if c._kv is not None},
                 "models": {c._model: c._kv.cache_id for c in self._caches.values()
                            if c._kv is not None and c._model is not None}}
        body = dumps(table)
        if len(body) > _DIR_BYTES - _HEAD.size:
            raise LLMException("too many caches for the directory", S.LLM_OUT_OF_MEMORY)
        row = self._dir[0]
        row[:_HEAD.size] = 0
        row[_HEAD.size:_HEAD.size + len(body)] = np.frombuffer(body, np.uint8)
        row[:_HEAD.size] = np.frombuffer(_HEAD.pack(len(body), zlib.crc32(body)), np.uint8)

    def _fetch(self, cluster_id: int) -> dict[str, dict[int, int]]:
        e = self._engine()
        assert self._scratch_cache is not None
        for _ in range(5):
            e.pull_kv_cache(kv.CacheIndex(cluster_id, DIRECTORY_ID, 0), self._scratch_cache, 0)
            raw = self._scratch[0].tobytes()
            n, crc = _HEAD.unpack_from(raw)
            body = raw[_HEAD.size:_HEAD.size + n]
            if n <= len(raw) - _HEAD.size and zlib.crc32(body) == crc:
                table = loads(body) if n else {"ids": {}, "models": {}}
                self._remote[cluster_id] = table
                return table
        raise LLMException(f"cluster {cluster_id}'s cache directory kept changing", S.LLM_FAILED)

    def _remote_id(self, cluster_id: int, kind: str, name: int, refresh: bool = False) -> int:
        with self._lock:
            table = None if refresh else self._remote.get(cluster_id)
            if table is None or name not in table[kind]:
                table = self._fetch(cluster_id)
            if name not in table[kind]:
                what = "cache id" if kind == "ids" else "block cache with model_id"
                raise LLMException(f"cluster {cluster_id} has no {what} {name}", S.LLM_KV_CACHE_NOT_EXIST)
            return table[kind][name]

    def _retrying(self, cluster_id: int, kind: str, name: int, call: Callable[[int], Any]) -> Any:
        """``call(kvengine id)``; once more with a fresh directory if the peer no longer has that id."""
        try:
            return call(self._remote_id(cluster_id, kind, name))
        except kv.LLMKvCacheNotExistError:
            return call(self._remote_id(cluster_id, kind, name, refresh=True))

    def _local(self, cache: Any) -> kv.Cache:
        if not isinstance(cache, Cache):
            raise TypeError(f"expected a Cache, got {type(cache).__name__}")
        c = self._caches.get(cache.cache_id)
        if c is not cache or c._kv is None:
            raise LLMException(f"cache {cache.cache_id} is not registered", S.LLM_KV_CACHE_NOT_EXIST)
        return c._kv

    # ----------------------------------------------------------- registration

    def _add(self, desc: CacheDesc, addrs: Sequence[int] | None, blocks: bool, keys: Sequence[CacheKey],
             model: int | None) -> Cache:
        if not isinstance(desc, CacheDesc):
            raise TypeError("cache_desc must be a CacheDesc")
        kdesc = desc.to_kv()
        keys = list(keys or ())
        if len(keys) > desc.batch_size:
            raise param_invalid(f"{len(keys)} cache keys for {desc.batch_size} rows")
        if len(set(k for k in keys if k.req_id != U64)) != len([k for k in keys if k.req_id != U64]):
            raise param_invalid("a cache key is listed twice")
        if addrs is None:
            arrays = [np.zeros(kdesc.size, np.uint8) for _ in range(desc.num_tensors)]
            ints = [int(a.ctypes.data) for a in arrays]
            rows, buffers = [a.reshape(desc.shape[0], -1) for a in arrays], list(arrays)
        else:
            ints, rows, buffers = _views(desc, addrs)
        with self._lock:
            if model is not None and any(c._model == model for c in self._caches.values()):
                raise param_invalid(f"a block cache with model_id {model} is registered already")
            c = Cache(self._next_id, desc, ints, blocks, rows, buffers)
            c._model = model
            c._keys = [(k, i) for i, k in enumerate(keys) if k.req_id != U64]
            e = self._engine()
            self._register(e, c)
            self._next_id += 1
            self._caches[c.cache_id] = c
            self._publish()
        return c

    def _bind(self, e: "SyncKvEngine", c: Cache, key: CacheKey, row: int) -> None:
        if not isinstance(key, CacheKey):
            raise TypeError(f"cache_keys holds CacheKey objects, got {type(key).__name__}")
        if key.req_id == U64:
            raise LLMException("prefix keys (prefix_id) are not offered", S.LLM_FEATURE_NOT_ENABLED)
        e.call("bind_cache_key", c._kv, _kv_key(key), row)

    @kv_call
    def register_cache(self, cache_desc: CacheDesc, addrs: Sequence[int], cache_keys: Sequence[CacheKey] = (),
                       remote_accessible: bool | None = None) -> Cache:
        """Register caller memory (one address per tensor) as a contiguous cache; key i names row i."""
        return self._add(cache_desc, addrs, False, cache_keys, None)

    @kv_call
    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: Sequence[int],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> Cache:
        """Register caller memory as a block cache; peers name it ``BlocksCacheKey(this cluster, model_id)``."""
        if blocks_cache_key is not None and not isinstance(blocks_cache_key, BlocksCacheKey):
            raise TypeError("blocks_cache_key must be a BlocksCacheKey")
        return self._add(cache_desc, addrs, True, (), blocks_cache_key.model_id if blocks_cache_key else None)

    @kv_call
    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> Cache:
        """A zeroed host cache owned by this manager (freed by ``deallocate_cache``)."""
        return self._add(cache_desc, None, False, cache_keys, None)

    @kv_call
    def allocate_blocks_cache(self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None) -> Cache:
        return self._add(cache_desc, None, True, (), blocks_cache_key.model_id if blocks_cache_key else None)

    @kv_call
    def unregister_cache(self, cache_id: int) -> None:
        """Forget a cache (unknown id: no-op); returns once no peer can touch its memory any more."""
        with self._lock:
            c = self._caches.pop(cache_id, None)
            if c is None or c._kv is None:
                return
            self._publish()
        self._engine().unregister_kv_cache(c._kv.cache_id).result()

    def deallocate_cache(self, cache: Cache) -> None:
        self.unregister_cache(cache.cache_id)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        self.unregister_cache(cache.cache_id)

    @kv_call
    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbind a request key (unknown key: no-op)."""
        with self._lock:
            for c in self._caches.values():
                c._keys = [(k, r) for k, r in c._keys if k != cache_key]
        self._engine().call("remove_cache_key", _kv_key(cache_key))

    # -------------------------------------------------------------- transfers

    @kv_call
    def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache, src_batch_index: int = 0,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None, size: int = -1,
                   tensor_num_per_layer: int = 2) -> None:
        """Write local row ``src_batch_index`` into the peer's cache row named by ``dst_cache_key``."""
        if not isinstance(dst_cache_key, CacheKeyByIdAndIndex):
            raise TypeError("push_cache: dst_cache_key must be a CacheKeyByIdAndIndex")
        if src_cache.is_blocks_cache:
            raise param_invalid("push_cache: the source must not be a block cache (push_blocks)")
        local, ext = self._local(src_cache), _ext(src_layer_range, dst_layer_range, tensor_num_per_layer)
        k = dst_cache_key
        self._retrying(k.cluster_id, "ids", k.cache_id, lambda cid: self._engine().push_kv_cache(
            local, kv.CacheIndex(k.cluster_id, cid, k.batch_index), src_batch_index, size, ext))

    @kv_call
    def pull_cache(self, cache_key: CacheKey | CacheKeyByIdAndIndex, cache: Cache, batch_index: int = 0,
                   size: int = -1, **kwargs: Any) -> None:
        """Read the peer's row (by request key or by id and index) into local row ``batch_index``."""
        ext = _ext(kwargs.pop("src_layer_range", None), kwargs.pop("dst_layer_range", None),
                   kwargs.pop("tensor_num_per_layer", 2))
        if kwargs:
            raise TypeError(f"pull_cache: unexpected arguments {sorted(kwargs)}")
        local = self._local(cache)
        e = self._engine()
        if isinstance(cache_key, CacheKey):
            e.pull_kv_cache(_kv_key(cache_key), local, batch_index, size, ext)
        elif isinstance(cache_key, CacheKeyByIdAndIndex):
            k = cache_key
            self._retrying(k.cluster_id, "ids", k.cache_id, lambda cid: e.pull_kv_cache(
                kv.CacheIndex(k.cluster_id, cid, k.batch_index), local, batch_index, size, ext))
        else:
            raise TypeError("pull_cache: cache_key must be a CacheKey or a CacheKeyByIdAndIndex")

    def _blocks_key(self, key: Any, blocks: Sequence[int], call: Callable[[kv.BlocksCacheKey], Any]) -> Any:
        if isinstance(key, BlocksCacheKey):
            return self._retrying(key.cluster_id, "models", key.model_id,
                                  lambda cid: call(kv.BlocksCacheKey(key.cluster_id, cid)))
        if isinstance(key, CacheKeyByIdAndIndex) and blocks:
            if key.batch_index != 0:
                raise param_invalid("block transfers need batch_index 0")
            return self._retrying(key.cluster_id, "ids", key.cache_id,
                                  lambda cid: call(kv.BlocksCacheKey(key.cluster_id, cid)))
        if isinstance(key, (CacheKey, CacheKeyByIdAndIndex)):
            raise LLMException("pulling a contiguous row into blocks is not offered by kvengine",
                               S.LLM_FEATURE_NOT_ENABLED)
        raise TypeError(f"expected a BlocksCacheKey, got {type(key).__name__}")

    @kv_call
    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache, src_blocks: Sequence[int] = (),
                    dst_blocks: Sequence[int] = (), src_layer_range: range | None = None,
                    dst_layer_range: range | None = None, tensor_num_per_layer: int = 2) -> None:
        """Write local blocks ``src_blocks[i]`` into the peer's ``dst_blocks[i]``."""
        if not src_cache.is_blocks_cache or not dst_blocks:
            raise param_invalid("push_blocks: the source must be a block cache and dst_blocks non-empty")
        local, ext = self._local(src_cache), _ext(src_layer_range, dst_layer_range, tensor_num_per_layer)
        self._blocks_key(dst_cache_key, src_blocks, lambda k: self._engine().push_kv_blocks(
            local, k, list(src_blocks), list(dst_blocks), ext))

    @kv_call
    def pull_blocks(self, src_cache_key: BlocksCacheKey | CacheKeyByIdAndIndex, dst_cache: Cache,
                    src_blocks: Sequence[int] = (), dst_blocks: Sequence[int] = (), **kwargs: Any) -> None:
        """Read the peer's blocks ``src_blocks[i]`` into local ``dst_blocks[i]``."""
        ext = _ext(kwargs.pop("src_layer_range", None), kwargs.pop("dst_layer_range", None),
                   kwargs.pop("tensor_num_per_layer", 2))
        if kwargs:
            raise TypeError(f"pull_blocks: unexpected arguments {sorted(kwargs)}")
        if not dst_cache.is_blocks_cache or not dst_blocks:
            raise param_invalid("pull_blocks: the destination must be a block cache and dst_blocks non-empty")
        local = self._local(dst_cache)
        self._blocks_key(src_cache_key, src_blocks, lambda k: self._engine().pull_kv_blocks(
            k, local, list(src_blocks), list(dst_blocks), ext))

    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: "LayerSynchronizer",
                             transfer_configs: Sequence["TransferConfig | TransferWithCacheKeyConfig"],
                             src_block_indices: Sequence[int] | None = None,
                             dst_block_indices: Sequence[int] | None = None,
                             dst_block_memory_size: int | None = None) -> "CacheTask":
        """Push ``src_cache`` layer by layer as ``layer_synchronizer.synchronize_layer(l)`` allows
        (a background thread, as in LLM-DataDist): a :class:`CacheTask`."""
        from ._task import start_task
        try:
            self._local(src_cache)
            return start_task(self, src_cache, layer_synchronizer, transfer_configs, src_block_indices,
                              dst_block_indices, dst_block_memory_size)
        except kv.LLMError as e:
            raise raise_llm(e) from e

    # ------------------------------------------------------------ local copies

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]) -> None:
        """Copy blocks ``src -> dst`` between two host caches (equal block size and num_tensors)."""
        s, d = src_cache, dst_cache
        if s.cache_desc.num_tensors != d.cache_desc.num_tensors or \
                s._rows[0].shape[1] != d._rows[0].shape[1]:
            raise param_invalid("swap_blocks: both caches need the same num_tensors and block size")
        if not isinstance(src_to_dst, dict):
            raise TypeError("src_to_dst must be a dict {src_block: dst_block}")
        nb_s, nb_d = s._rows[0].shape[0], d._rows[0].shape[0]
        for a, b in src_to_dst.items():
            if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, int) or not isinstance(b, int) \
                    or not 0 <= a < nb_s or not 0 <= b < nb_d:
                raise param_invalid(f"swap_blocks: block pair {a!r} -> {b!r} out of range")
        for rs, rd in zip(s._rows, d._rows):
            for a, b in src_to_dst.items():
                rd[b] = rs[a]

    def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1, req_id: int | None = None) -> None:
        """Copy bytes ``[offset, offset + size)`` of a row of every tensor, ``src`` to ``dst``."""
        a, b = src.cache_desc, dst.cache_desc
        if (a.num_tensors, list(a.shape), a.data_type) != (b.num_tensors, list(b.shape), b.data_type):
            raise param_invalid("copy_cache: the two caches' descriptions differ")
        if src.is_blocks_cache or dst.is_blocks_cache:
            raise param_invalid("copy_cache: block caches are not allowed")
        stride = src._rows[0].shape[1]
        n = stride - offset if size == -1 else size
        if not 0 <= offset < stride or n <= 0 or offset + n > stride:
            raise param_invalid(f"copy_cache: offset {offset} / size {size} outside a row of {stride} bytes")
        for label, idx in (("src_batch_index", src_batch_index), ("dst_batch_index", dst_batch_index)):
            if not 0 <= idx < a.batch_size:
                raise param_invalid(f"copy_cache: {label} {idx} out of range")
        for rs, rd in zip(src._rows, dst._rows):
            rd[dst_batch_index, offset:offset + n] = rs[src_batch_index, offset:offset + n]


def _kv_key(key: CacheKey) -> Any:
    """kvengine's request key for ``key`` (``kv.CacheKey``, from the keys branch)."""
    if not isinstance(key, CacheKey):
        raise TypeError(f"expected a CacheKey, got {type(key).__name__}")
    make = getattr(kv, "CacheKey", None)
    if make is None:
        raise LLMException("request keys need kvengine.CacheKey, which this kvengine does not have yet",
                           S.LLM_FEATURE_NOT_ENABLED)
    return make(key.prompt_cluster_id, key.req_id, key.model_id)
