"""``transfer_cache_async``: LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig, CacheTask.

As in LLM-DataDist, one background thread walks the source layers in order:
it skips a layer no config wants, calls the user's
``layer_synchronizer.synchronize_layer(layer, None)`` (``False`` gives the
configs still running ``LLM_PARAM_INVALID`` and stops), then pushes that
layer to every config that covers it (concurrently, through kvengine's
``submit_push_*``). The first failure stops the whole task. A config becomes
``LLM_SUCCESS`` when its last layer has landed.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Sequence

import kvengine as kv
from ._types import (BlocksCacheKey, CacheKeyByIdAndIndex, LLMException, LLMStatusCode, check_int,
                     param_invalid)

if TYPE_CHECKING:
    from ._cache_manager import Cache, CacheManager

__all__ = ["LayerSynchronizer", "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask", "start_task"]

S = LLMStatusCode


class LayerSynchronizer:
    """Subclass it: ``synchronize_layer(layer_index, timeout_in_millis)`` returns once layer
    ``layer_index`` is computed (True), or False to stop the task."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        raise NotImplementedError


class TransferConfig:
    """Raw remote addresses (LLM-DataDist with remote-cache-accessible off): not offered by kvengine."""

    def __init__(self, dst_cluster_id: int, dst_addrs: Sequence[int], src_layer_range: range | None = None,
                 src_batch_index: int = 0) -> None:
        self.dst_cluster_id, self.dst_addrs = dst_cluster_id, list(dst_addrs)
        self.src_layer_range, self.src_batch_index = src_layer_range, src_batch_index


class TransferWithCacheKeyConfig:
    """A destination cache by key: layers ``src_layer_range[i]`` go to ``dst_layer_range[i]``."""

    def __init__(self, cache_key: BlocksCacheKey | CacheKeyByIdAndIndex, src_layer_range: range,
                 dst_layer_range: range, src_batch_index: int = 0) -> None:
        if not isinstance(cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex)):
            raise TypeError("cache_key must be a BlocksCacheKey or a CacheKeyByIdAndIndex")
        for name, r in (("src_layer_range", src_layer_range), ("dst_layer_range", dst_layer_range)):
            if not isinstance(r, range) or r.step != 1 or not 0 <= r.start < r.stop:
                raise param_invalid(f"{name} must be a range(start, stop), 0 <= start < stop")
        if len(src_layer_range) != len(dst_layer_range):
            raise param_invalid("src_layer_range and dst_layer_range must be equally long")
        self.cache_key, self.src_layer_range, self.dst_layer_range = cache_key, src_layer_range, dst_layer_range
        self.src_batch_index = check_int("src_batch_index", src_batch_index, 0, 2**32 - 1)
        self.dst_cluster_id = cache_key.cluster_id


class CacheTask:
    """The handle of ``transfer_cache_async``: ``synchronize()`` and ``get_results()``."""

    def __init__(self, n: int) -> None:
        self._results: list[LLMStatusCode | None] = [None] * n
        self._thread: threading.Thread | None = None

    def _join(self, timeout_in_millis: int | None) -> bool:
        assert self._thread is not None
        if timeout_in_millis is not None:
            check_int("timeout_in_millis", timeout_in_millis, 0, 2**31 - 1)
        self._thread.join(None if timeout_in_millis is None else timeout_in_millis / 1000)
        return not self._thread.is_alive()

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait (``None``: until done): the first failure, else ``LLM_SUCCESS``; ``LLM_TIMEOUT`` if
        still running after the timeout (the task goes on)."""
        if not self._join(timeout_in_millis):
            return S.LLM_TIMEOUT
        return next((r for r in self._results if r is not None and r != S.LLM_SUCCESS), S.LLM_SUCCESS)

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """One status per config (``None``: its layers never started); all ``LLM_TIMEOUT`` on timeout."""
        if not self._join(timeout_in_millis):
            return [S.LLM_TIMEOUT] * len(self._results)
        return list(self._results)


def start_task(mgr: "CacheManager", src: "Cache", sync: LayerSynchronizer,
               configs: Sequence[TransferConfig | TransferWithCacheKeyConfig], src_blocks: Sequence[int] | None,
               dst_blocks: Sequence[int] | None, dst_block_memory_size: int | None) -> CacheTask:
    if not isinstance(sync, LayerSynchronizer) and not callable(getattr(sync, "synchronize_layer", None)):
        raise TypeError("layer_synchronizer must have synchronize_layer(layer_index, timeout_in_millis)")
    if not isinstance(configs, (list, tuple)) or not configs:
        raise param_invalid("transfer_configs must be a non-empty list")
    if any(isinstance(c, TransferConfig) for c in configs):
        raise LLMException("TransferConfig (raw remote addresses) is not offered: kvengine writes only into "
                           "caches a peer registered; use TransferWithCacheKeyConfig",
                           S.LLM_FEATURE_NOT_ENABLED)
    if dst_block_memory_size:
        raise LLMException("contiguous -> blocks (dst_block_memory_size) is not offered",
                           S.LLM_FEATURE_NOT_ENABLED)
    layers = src.cache_desc.num_tensors // 2
    if src.cache_desc.num_tensors % 2:
        raise param_invalid("transfer_cache_async needs an even num_tensors (2 tensors per layer)")
    cfgs: list[TransferWithCacheKeyConfig] = []
    for c in configs:
        if not isinstance(c, TransferWithCacheKeyConfig):
            raise TypeError(f"expected TransferWithCacheKeyConfig, got {type(c).__name__}")
        if c.src_layer_range.stop > layers:
            raise param_invalid(f"src_layer_range {c.src_layer_range} beyond the cache's {layers} layers")
        if src.is_blocks_cache and c.src_batch_index != 0:
            raise param_invalid("a block source needs src_batch_index 0")
        cfgs.append(c)
    if src.is_blocks_cache:
        nb = src.cache_desc.batch_size
        s_blocks = list(src_blocks) if src_blocks is not None else list(range(nb))
        d_blocks = list(dst_blocks) if dst_blocks is not None else list(s_blocks)
        if len(s_blocks) != len(d_blocks) or not s_blocks:
            raise param_invalid("src_block_indices and dst_block_indices must be non-empty and equally long")
    elif src_blocks is not None or dst_blocks is not None:
        raise param_invalid("block indices go with a block source")
    task = CacheTask(len(cfgs))
    local = mgr._local(src)

    def push(c: TransferWithCacheKeyConfig, layer: int) -> Any:
        dl = c.dst_layer_range[c.src_layer_range.index(layer)]
        ext = kv.KvCacheExtParam((layer, layer), (dl, dl), 2)
        e = mgr._engine()
        k = c.cache_key
        if src.is_blocks_cache:
            kind, name = ("models", k.model_id) if isinstance(k, BlocksCacheKey) else ("ids", k.cache_id)
            return e.submit_push_kv_blocks(local, kv.BlocksCacheKey(k.cluster_id, mgr._remote_id(
                k.cluster_id, kind, name)), s_blocks, d_blocks, ext)
        if not isinstance(k, CacheKeyByIdAndIndex):
            raise param_invalid("a contiguous source needs CacheKeyByIdAndIndex destinations")
        return e.submit_push_kv_cache(local, kv.CacheIndex(k.cluster_id, mgr._remote_id(
            k.cluster_id, "ids", k.cache_id), k.batch_index), c.src_batch_index, -1, ext)

    def run() -> None:
        res = task._results
        for layer in range(layers):
            want = [i for i, c in enumerate(cfgs) if layer in c.src_layer_range]
            if not want:
                continue
            try:
                ok = bool(sync.synchronize_layer(layer, None))
            except Exception:
                ok = False
            if not ok:
                for i in want:
                    res[i] = S.LLM_PARAM_INVALID
                return
            futs, failed = [], False
            for i in want:
                try:
                    futs.append((i, push(cfgs[i], layer)))
                except (kv.LLMError, LLMException) as e:
                    res[i], failed = kv.status.to_status(getattr(e, "status_code", S.LLM_FAILED)), True
            for i, f in futs:
                st = f.result()
                if st != S.LLM_SUCCESS:
                    res[i], failed = st, True
                elif layer == cfgs[i].src_layer_range[-1]:
                    res[i] = S.LLM_SUCCESS
            if failed:
                return

    task._thread = threading.Thread(target=run, daemon=True, name="llm_datadist-transfer_cache_async")
    task._thread.start()
    return task
