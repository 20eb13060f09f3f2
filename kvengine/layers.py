"""Layer-wise pushes: LLM-DataDist's ``transfer_cache_async`` + ``LayerSynchronizer``,
as asyncio.

The prefill side opens a stream for one source row (or block list) towards
one or more destinations, and marks layers ready as it computes them; each
layer's push starts at once, so the transfer overlaps the rest of the
prefill. A failed layer stops that destination; the others go on.

    stream = engine.layer_stream(cache, [kv.CacheIndex(2, 7, 0), kv.CacheIndex(3, 9, 0)],
                                 src_batch_index=0, timeout=5.0, notify=b"req-42")
    for i in range(num_layers):
        ...                        # compute layer i (any thread)
        stream.layer_ready(i)      # thread-safe; that layer's push starts now
    statuses = await stream.wait() # one LLMStatusCode per destination

Owns: the stream's per-destination progress. It starts layer pushes through
the engine's public ``submit_push_*`` methods and learns their end through
``Transfer.add_done_callback``; it touches no engine state.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any, Callable, Protocol, Sequence

import numpy as np
from numpy.typing import NDArray

from . import plan
from .status import LLMStatusCode as S, error_for
from .transfer import Transfer
from .types import BlockTable, BlocksCacheKey, Cache, CacheIndex, CacheKey, KvCacheExtParam, param_invalid

__all__ = ["LayerStream"]


class Pusher(Protocol):
    """What a layer stream needs of the engine: its public push methods."""

    def submit_push_kv_cache(self, cache: Cache, dst_index: CacheIndex | CacheKey, src_batch_index: int = 0,
                             size: int = -1, ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None, priority: int = 0,
                             notify: bytes | None = None) -> Transfer: ...

    def submit_push_kv_blocks(self, cache: Cache, dst_key: BlocksCacheKey, src_blocks: BlockTable,
                              dst_blocks: BlockTable, ext_param: KvCacheExtParam | None = None,
                              timeout: float | None = None, priority: int = 0,
                              notify: bytes | None = None) -> Transfer: ...


Heads = tuple[Any, Any]   # (src_head_range, dst_head_range) of KvCacheExtParam
_ALL: Heads = ((-1, -1), (-1, -1))


def _one_range(r: Any) -> bool:
    return isinstance(r, range) or (isinstance(r, tuple) and len(r) == 2 and not isinstance(r[0], (tuple, range)))


def _per_dest(name: str, value: Any, n: int) -> list[Any]:
    """One head range for every destination, or a list of one per destination."""
    if _one_range(value):
        return [value] * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise param_invalid(f"{name} must be one head range or a list of one per destination ({n})")
    return list(value)


def _one_table(tables: Any) -> bool:
    """``dst_blocks`` is one table (for every destination), not one per destination: a
    1-D array or tensor, or a sequence whose first entry is an int."""
    ndim = getattr(tables, "ndim", None)
    if ndim is not None:
        return bool(ndim == 1)
    try:
        first = tables[0]
    except (TypeError, IndexError, KeyError):
        return True                        # empty or not indexable: block_ids says what is wrong
    return isinstance(first, (int, np.integer)) or getattr(first, "ndim", 1) == 0


class _Dest:
    __slots__ = ("key", "blocks", "heads", "status", "pending", "done_layers", "transfers")

    def __init__(self, key: Any, blocks: NDArray[np.int64] | None, heads: Heads) -> None:
        self.key = key
        self.blocks = blocks
        self.heads = heads
        self.status: S | None = None       # final status, once known
        self.pending = 0                   # layer pushes in flight
        self.done_layers = 0               # layers landed
        self.transfers: list[Transfer] = []


class LayerStream:
    """Pushes of one source, layer by layer, to several destinations (see module docstring)."""

    def __init__(self, engine: Pusher, loop: asyncio.AbstractEventLoop,
                 notify_peer: Callable[[int, bytes], None], cache: Cache, dsts: Sequence[Any],
                 src_batch_index: int, tnpl: int, timeout: float, notify: bytes | None, priority: int,
                 src_blocks: BlockTable | None, dst_blocks: Any, heads: Heads = _ALL) -> None:
        """Made by ``KvEngine.layer_stream``, which checked the cache, ``tnpl``, the timeout,
        priority and notification; ``notify_peer(cluster_id, payload)`` sends the latter."""
        if not isinstance(dsts, (list, tuple)) or not dsts:
            raise param_invalid("layer_stream needs a non-empty list of destinations")
        self._tmo, self._prio, self._notify = timeout, priority, notify
        blocks = all(isinstance(d, BlocksCacheKey) for d in dsts)
        if not blocks and not all(isinstance(d, (CacheIndex, CacheKey)) for d in dsts):
            raise param_invalid("destinations must all be CacheIndex or CacheKey (rows), or all BlocksCacheKey "
                                "(blocks)")
        per: list[NDArray[np.int64] | None]
        if blocks:
            if src_blocks is None or dst_blocks is None:
                raise param_invalid("block destinations need src_blocks and dst_blocks")
            # block tables: lists, numpy int arrays or CPU tensors (plan.block_ids), copied
            # (the caller may reuse its table while layers are pending); the ids are
            # checked per push (plan.check_blocks)
            src_ids = plan.block_ids("src_blocks", src_blocks).copy()
            lists: Sequence[Any] = dst_blocks
            if _one_table(dst_blocks):
                lists = [dst_blocks] * len(dsts)   # one block table for every destination
            if len(lists) != len(dsts):
                raise param_invalid("dst_blocks needs one block table per destination")
            per = [plan.block_ids("dst_blocks", b).copy() for b in lists]
        else:
            if src_blocks is not None or dst_blocks is not None:
                raise param_invalid("src_blocks/dst_blocks go with BlocksCacheKey destinations")
            if heads != _ALL:
                raise param_invalid("head ranges go with BlocksCacheKey destinations")
            per = [None] * len(dsts)
            src_ids = None
        hs = zip(_per_dest("src_head_range", heads[0], len(dsts)), _per_dest("dst_head_range", heads[1], len(dsts)))
        self._notify_peer = notify_peer
        self._engine = engine
        self._cache = cache
        self._batch = src_batch_index
        self._src_blocks = src_ids
        self._tnpl = tnpl
        self.num_layers = cache.desc.num_tensors // tnpl
        self._dests = [_Dest(d, b, h) for d, b, h in zip(dsts, per, hs)]
        self._loop = loop
        self._lock = threading.Lock()
        self._marked: set[int] = set()
        self._layer_futs: dict[int, asyncio.Future[list[S | None]]] = {}   # None: that destination stopped earlier
        self._done = self._loop.create_future()
        self._finished = False       # read from producer threads: set once, on the loop
        self._final: list[S] = []
        self._notified = False
        self._deadline = self._loop.time() + self._tmo
        self._timer = self._loop.call_at(self._deadline, self._on_deadline)

    # --------------------------------------------------------------- producer

    def layer_ready(self, layer: int) -> None:
        """Layer ``layer`` of the source is computed: push it now. Thread-safe.

        Raises ``LLMParamInvalidError`` for a layer out of range or marked twice.
        """
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise param_invalid(f"layer {layer!r} out of range [0, {self.num_layers})")
        with self._lock:
            if layer in self._marked:
                raise param_invalid(f"layer {layer} was already marked ready")
            if self._finished:
                st = next((x for x in self._final if x != S.LLM_SUCCESS), S.LLM_FAILED)
                raise error_for(st, f"the layer stream is finished ({[x.name for x in self._final]})")
            self._marked.add(layer)
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._start(layer)
        else:
            self._loop.call_soon_threadsafe(self._start, layer)

    def _start(self, layer: int) -> None:
        e = self._engine
        remaining = self._deadline - self._loop.time()
        futs: list[asyncio.Future[S]] = []
        for d in self._dests:
            ext = KvCacheExtParam((layer, layer), (layer, layer), self._tnpl, *d.heads)
            if d.status is not None:
                continue
            if remaining <= 0:
                self._settle(d, S.LLM_TIMEOUT)
                continue
            if isinstance(d.key, (CacheIndex, CacheKey)):
                t = e.submit_push_kv_cache(self._cache, d.key, self._batch, ext_param=ext, timeout=remaining,
                                           priority=self._prio)
            else:
                assert self._src_blocks is not None and d.blocks is not None
                t = e.submit_push_kv_blocks(self._cache, d.key, self._src_blocks, d.blocks, ext_param=ext,
                                            timeout=remaining, priority=self._prio)
            d.pending += 1
            d.transfers.append(t)
            one: asyncio.Future[S] = self._loop.create_future()
            futs.append(one)
            t.add_done_callback(functools.partial(self._layer_done, d, fut=one))
        fut = self._layer_futs.setdefault(layer, self._loop.create_future())
        if futs:
            def all_done(g: asyncio.Future[list[S]]) -> None:
                if not fut.done():
                    fut.set_result(list(g.result()))
            asyncio.gather(*futs).add_done_callback(all_done)
        elif not fut.done():
            fut.set_result([d.status for d in self._dests])

    def _layer_done(self, d: _Dest, status: S, *, fut: asyncio.Future[S]) -> None:
        d.pending -= 1
        if not fut.done():
            fut.set_result(status)
        if d.status is None:
            if status != S.LLM_SUCCESS:
                self._settle(d, status)
            else:
                d.done_layers += 1
                if d.done_layers == self.num_layers:
                    self._settle(d, S.LLM_SUCCESS)
        self._check_done()

    def _settle(self, d: _Dest, status: S) -> None:
        """Final status of one destination; its other layers stop."""
        if d.status is not None:
            return
        d.status = status
        if status != S.LLM_SUCCESS:
            for t in d.transfers:
                t.cancel()
        elif self._notify is not None:
            self._notified = True
            self._notify_peer(d.key.cluster_id, self._notify)
        self._check_done()

    def _check_done(self) -> None:
        """Resolve wait() once every destination is settled and no push of it is in flight."""
        if all(x.status is not None and x.pending == 0 for x in self._dests):
            self._timer.cancel()
            final = [x.status for x in self._dests if x.status is not None]
            self._final, self._finished = final, True
            if not self._done.done():
                self._done.set_result(final)
            for fut in self._layer_futs.values():   # layers never marked ready: the final word
                if not fut.done():
                    fut.set_result(list(final))

    def _on_deadline(self) -> None:
        for d in self._dests:
            if d.status is None and d.pending == 0:
                self._settle(d, S.LLM_TIMEOUT)   # layers never marked ready in time
            # layers in flight carry the same deadline and settle on their own

    # --------------------------------------------------------------- consumer

    def set_notify(self, payload: bytes | None) -> None:
        """Replace the notification (e.g. with something the forward pass computed);
        allowed until a destination has received it. Call it from the loop thread."""
        if self._notified:
            raise param_invalid("the notification was already sent")
        self._notify = plan.check_notify(payload)

    async def wait_layer(self, layer: int) -> list[S | None]:
        """Statuses, per destination, of layer ``layer``'s pushes; for a layer that was
        never marked ready, the stream's final statuses once it is finished."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise param_invalid(f"layer {layer!r} out of range [0, {self.num_layers})")
        fut = self._layer_futs.setdefault(layer, self._loop.create_future())
        if self._finished and not fut.done():
            fut.set_result(list(self._final))
        return list(await asyncio.shield(fut))

    async def wait(self) -> list[S | None]:
        """One final status per destination: ``LLM_SUCCESS`` once every layer landed there."""
        return list(await asyncio.shield(self._done))

    def statuses(self) -> list[S | None]:
        return [d.status for d in self._dests]

    def cancel(self) -> None:
        """Stop every destination (``LLM_CANCELLED``; layers in flight are fenced)."""
        for d in self._dests:
            self._settle(d, S.LLM_CANCELLED)

