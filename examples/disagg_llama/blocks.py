"""Paged KV for the example (``run.py --layout paged``): a block allocator per side,
block tables per request, and the head split of a pool for a TP decode pair.

Each side keeps one block pool (``model.paged_cache_desc``: dim 0 is the block
id, a block is ``(kv_heads, block_size, head_dim)``). A request owns a block
table (a CPU ``torch.int64`` tensor, as a server keeps it); the prefill pushes
its blocks layer by layer with ``engine.layer_stream(..., src_blocks=<its table
here>, dst_blocks=<its table there>)``.

Head split (TP=2 emulated, ``--tp 2``): decode rank ``r`` of ``R`` registers a
pool of ``kv_heads / R`` heads per block. Heads are outermost in a block, so
heads ``[r * h, (r + 1) * h)`` of prefill block ``b`` are one contiguous range,
and the prefill's pool, registered a second time over the same memory as
``(R * num_blocks, kv_heads / R, block_size, head_dim)`` (``head_split_view``), has
that range as whole block ``b * R + r``. So each rank gets only its heads through
today's ``push_kv_blocks`` / ``layer_stream`` (whole blocks of the view): no
engine change, no copy, half the bytes per rank (``push_heads``).
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

import kvengine as kv

__all__ = ["BlockAllocator", "blocks_needed", "head_split_view", "head_table", "push_heads"]


def blocks_needed(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockAllocator:
    """Free list of one pool's blocks. ``alloc_interleaved`` hands several requests
    blocks that alternate in the pool (A, B, A, B, ... in block-id order) and lie in
    a random order within each table, so that neither the pool nor any table has
    runs of consecutive blocks: nothing coalesces by accident."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.num_blocks = num_blocks
        self._free = set(range(num_blocks))
        self._rng = random.Random(seed)

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc_interleaved(self, sizes: Sequence[int]) -> list[torch.Tensor]:
        """One block table (int64 tensor) per request, of ``sizes[j]`` blocks each."""
        total = sum(sizes)
        if total > len(self._free):
            raise MemoryError(f"{total} blocks asked, {len(self._free)} free")
        picked = sorted(self._rng.sample(sorted(self._free), total))
        need = list(sizes)
        tables: list[list[int]] = [[] for _ in sizes]
        j = 0
        for b in picked:                       # round robin over the requests still needing blocks
            while need[j % len(sizes)] == 0:
                j += 1
            tables[j % len(sizes)].append(b)
            need[j % len(sizes)] -= 1
            j += 1
        for t in tables:
            self._rng.shuffle(t)               # non-monotone within the table
        self._free.difference_update(picked)
        return [torch.tensor(t, dtype=torch.int64) for t in tables]

    def release(self, table: torch.Tensor | Sequence[int]) -> None:
        ids = [int(b) for b in table]
        if any(b in self._free or not 0 <= b < self.num_blocks for b in ids):
            raise ValueError(f"freeing blocks not allocated: {ids}")
        self._free.update(ids)


def head_split_view(engine: kv.KvEngine, pool: kv.Cache, ranks: int) -> kv.Cache:
    """The prefill pool registered a second time, over the same memory, as ``ranks``
    times as many blocks of ``kv_heads / ranks`` heads: block ``b * ranks + r`` of the
    view is heads ``[r * h, (r + 1) * h)`` of pool block ``b`` (heads are outermost in
    a block)."""
    nb, heads, bs, dim = pool.desc.shape
    if heads % ranks:
        raise ValueError(f"{heads} KV heads do not split over {ranks} ranks")
    desc = kv.CacheDesc(pool.desc.num_tensors, (nb * ranks, heads // ranks, bs, dim), pool.desc.dtype)
    return engine.register_kv_cache(desc, pool.tensors)


def head_table(table: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """Rank ``rank``'s share of a request's pool blocks, as blocks of the head-split view."""
    return table * ranks + rank


def push_heads(engine: kv.KvEngine, view: kv.Cache, table: torch.Tensor, rank_keys: Sequence[kv.BlocksCacheKey],
               rank_tables: Sequence[torch.Tensor], timeout: float, notify: bytes | None) -> list:
    """One layer stream per decode rank, each carrying only that rank's KV heads of the
    request's blocks ``table`` into the rank's pool blocks ``rank_tables[r]``."""
    ranks = len(rank_keys)
    return [engine.layer_stream(view, [key], tensor_num_per_layer=2, timeout=timeout, notify=notify,
                                src_blocks=head_table(table, r, ranks), dst_blocks=dst)
            for r, (key, dst) in enumerate(zip(rank_keys, rank_tables))]
