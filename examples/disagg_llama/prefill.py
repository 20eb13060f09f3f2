"""Prefill side: run the prompt through the model and push each layer's K/V to the
decode engine as soon as that layer is computed.

The forward pass runs in a worker thread (``loop.run_in_executor``) so the event
loop keeps driving kvengine's transfers while later layers compute. A forward
hook on every decoder layer (``model.model.layers[i]``) fires right after layer
``i`` appended its K/V to the DynamicCache; it copies them into the kvengine
source cache and calls ``stream.layer_ready(i)`` (thread-safe), which starts
that layer's push. The stream's notification (``notify=<request id>``) tells
the decode engine once every layer of that request landed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from typing import Any, Awaitable, Callable, Sequence

import torch

import kvengine as kv

from model import forward, layer_kv, new_dynamic_cache, write_blocks

__all__ = ["PrefillResult", "Prefiller"]


@dataclasses.dataclass
class PrefillResult:
    request_id: str
    prompt_len: int
    first_token: int
    statuses: list           # per destination, from stream.wait()
    t_forward_start: float   # time.monotonic() (CLOCK_MONOTONIC: comparable across processes)
    t_first_ready: float     # first layer_ready
    t_forward_end: float     # model forward returned (logits computed)
    t_stream_done: float     # every layer landed (stream.wait() resolved)
    t_layer0_done: float     # layer 0 landed (stream.wait_layer(0) resolved)

    @property
    def forward_s(self) -> float:
        return self.t_forward_end - self.t_forward_start

    @property
    def transfer_total_s(self) -> float:
        """First layer_ready until the last layer landed."""
        return self.t_stream_done - self.t_first_ready

    @property
    def exposed_s(self) -> float:
        """Transfer time left after the forward finished (0 if it was all hidden)."""
        return max(0.0, self.t_stream_done - self.t_forward_end)

    @property
    def done_after_forward_s(self) -> float:
        """Signed: < 0 when every layer had landed before the forward even returned."""
        return self.t_stream_done - self.t_forward_end


class Prefiller:
    """Owns the model, the kvengine source cache and the forward thread.

    ``cache`` is the source: rows (``run``) or a block pool (``run_paged``,
    ``model.paged_cache_desc``)."""

    def __init__(self, engine: kv.KvEngine, model, cache: kv.Cache, max_seq: int | None = None) -> None:
        self.engine = engine
        self.model = model
        self.cache = cache                          # kvengine source cache (K0, V0, K1, V1, ...)
        self.tensors = [torch.from_numpy(t) for t in cache.tensors]
        self.layers = list(model.model.layers)
        assert cache.desc.num_tensors == 2 * len(self.layers)
        self.max_seq = cache.desc.shape[2] if max_seq is None else max_seq
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefill-forward")
        # one forward at a time: the hooks are on the shared model's layers
        self._forward_lock = asyncio.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    async def run(self, request_id: str, prompt: Sequence[int], dst: kv.CacheIndex, row: int,
                  on_forward_done: Callable[[int], None] | None = None, layerwise: bool = True,
                  timeout: float = 10.0) -> PrefillResult:
        """Prefill ``prompt`` into source row ``row`` and push it to ``dst``, layer by layer.

        ``on_forward_done(first_token)`` is called as soon as the forward returned
        (the KV may still be in flight), e.g. to hand the request to the decode side.
        Returns once every layer landed (or failed: see ``statuses``).
        ``layerwise=False`` marks every layer ready only after the forward finished
        (the baseline without overlap).
        """
        n = len(prompt)

        # notify: the decode side waits for exactly this payload; it arrives once every
        # layer landed. It is fixed when the stream opens, before the forward has
        # computed the first token, so the first token travels with the decode request
        # instead (see on_forward_done and run.py).
        def open_streams() -> list[kv.LayerStream]:
            return [self.engine.layer_stream(self.cache, [dst], src_batch_index=row, tensor_num_per_layer=2,
                                             timeout=timeout, notify=request_id.encode())]

        def copy_layer(i: int, k: torch.Tensor, v: torch.Tensor) -> None:   # (1, kv_heads, n, head_dim)
            self.tensors[2 * i][row, :, :n].copy_(k[0])
            self.tensors[2 * i + 1][row, :, :n].copy_(v[0])

        return await self._run(request_id, prompt, open_streams, copy_layer, on_forward_done, layerwise)

    async def run_paged(self, request_id: str, prompt: Sequence[int], table: torch.Tensor,
                        open_streams: Callable[[], list[kv.LayerStream]],
                        on_forward_done: Callable[[int], None] | None = None, layerwise: bool = True
                        ) -> PrefillResult:
        """Prefill ``prompt`` into the pool blocks ``table`` (an int64 tensor: the request's
        block table here) and push them with the layer streams ``open_streams()`` opens
        (block destinations: one stream, or one per decode rank for a head split)."""
        def copy_layer(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            write_blocks(self.tensors[2 * i], self.tensors[2 * i + 1], table, k, v)
        return await self._run(request_id, prompt, open_streams, copy_layer, on_forward_done, layerwise)

    async def _run(self, request_id: str, prompt: Sequence[int], open_streams: Callable[[], list[kv.LayerStream]],
                   copy_layer: Callable[[int, torch.Tensor, torch.Tensor], None],
                   on_forward_done: Callable[[int], None] | None, layerwise: bool) -> PrefillResult:
        n = len(prompt)
        if not 0 < n <= self.max_seq:
            raise ValueError(f"prompt length {n} not in [1, {self.max_seq}]")
        loop = asyncio.get_running_loop()
        input_ids = torch.tensor([list(prompt)])
        dyn = new_dynamic_cache()
        first_ready: list[float] = []
        streams = open_streams()

        async def wait_all() -> list:
            return [st for s in streams for st in await s.wait()]

        async def wait_layer0() -> list:
            return [st for s in streams for st in await s.wait_layer(0)]
        waiter = asyncio.ensure_future(_timed(wait_all()))           # -> (statuses, when)
        layer0 = asyncio.ensure_future(_timed(wait_layer0()))

        def ready(i: int) -> None:
            for s in streams:
                s.layer_ready(i)                    # thread-safe: its push starts now

        def hook(i: int):
            def after_layer(_module, _args, _output) -> None:
                k, v = layer_kv(dyn, i)             # (1, kv_heads, n, head_dim)
                copy_layer(i, k, v)
                if layerwise:
                    if not first_ready:
                        first_ready.append(time.monotonic())
                    ready(i)
            return after_layer

        await self._forward_lock.acquire()
        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(self.layers)]
        try:
            def run_forward() -> tuple[float, float, int]:
                t0 = time.monotonic()
                logits = forward(self.model, input_ids, dyn)
                t1 = time.monotonic()
                if not layerwise:                   # baseline: push everything now
                    first_ready.append(t1)
                    for i in range(len(self.layers)):
                        ready(i)
                return t0, t1, int(logits.argmax())
            t_start, t_end, first_token = await loop.run_in_executor(self._pool, run_forward)
        except BaseException:
            for s in streams:
                s.cancel()
            waiter.cancel()
            layer0.cancel()                         # wait_layer(0) never resolves if 0 was never marked
            raise
        finally:
            for h in handles:
                h.remove()
            self._forward_lock.release()
        if on_forward_done is not None:
            on_forward_done(first_token)
        statuses, t_done = await waiter
        _, t_layer0 = await layer0
        return PrefillResult(request_id, n, first_token, statuses, t_start, first_ready[0], t_end, t_done, t_layer0)


async def _timed(aw: Awaitable[Any]) -> tuple[Any, float]:
    """The result of ``aw`` and when it was there (time.monotonic())."""
    result = await aw
    return result, time.monotonic()
