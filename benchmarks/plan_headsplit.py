"""Loop-thread cost of head-split block plans (issue 12), planner and submit.

    python benchmarks/plan_headsplit.py

A vLLM-shaped cache (64 tensors, 16-token blocks of 8 KV heads x 128 dims, fp16)
and a TP=2 rank's (4 heads): medians of 30 calls of
1. plan.Planner.blocks alone for random tables of 256 and 1024 blocks: whole
   blocks (5-word segments) and src_head_range=range(4) (one 8-word 2-D segment
   per block and tensor), tables as numpy arrays and as lists, and from a
   FlashInfer-strided source;
2. layout.expand_rows, the shim that runs 2-D segments as rows until the core
   takes them (16 rows per block);
3. submit_push_kv_blocks (planning + the native submit, shm link in one
   process), whole blocks and head-split, medians of 9.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any, Callable

import numpy as np

import kvengine as kv
from kvengine import layout, plan
from kvengine.types import CacheDesc, KvCacheExtParam as Ext


def med(f: Callable[[], Any], n: int = 30) -> float:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def planner() -> None:
    pool = 1024
    src = CacheDesc(64, (pool, 16, 8, 128), np.float16, head_axis=2)
    dst = CacheDesc(64, (pool, 16, 4, 128), np.float16, head_axis=2)
    fi = CacheDesc(64, (pool, 16, 8, 128), np.float16, head_axis=2, block_stride=2 * 16 * 8 * 128)
    rs, rd = [(1, t * src.size) for t in range(64)], [(2, t * dst.size) for t in range(64)]
    rng = np.random.default_rng(1)
    ext = Ext(src_head_range=range(0, 4))
    for nb in (256, 1024):
        sb, db = rng.permutation(pool)[:nb], rng.permutation(pool)[:nb]
        segs = plan.Planner.blocks(src, dst, sb, db, ext, "push", rs, rd)[0]
        n = segs.shape[0]
        t2 = med(lambda: plan.Planner.blocks(src, dst, sb, db, ext, "push", rs, rd))
        tl = med(lambda: plan.Planner.blocks(src, dst, sb.tolist(), db.tolist(), ext, "push", rs, rd))
        tf = med(lambda: plan.Planner.blocks(fi, dst, sb, db, ext, "push", rs, rd))
        tw = med(lambda: plan.Planner.blocks(src, src, sb, db, None, "push", rs, rs))
        te = med(lambda: layout.expand_rows(segs))
        print(f"{nb} blocks x 64 tensors: 2-D plan of {n} segments {t2 * 1e6:.0f} us = {t2 / n * 1e9:.1f} ns/segment "
              f"(lists {tl / n * 1e9:.1f}, FlashInfer source {tf / n * 1e9:.1f}); whole blocks {tw * 1e6:.0f} us; "
              f"shim expand_rows {te * 1e6:.0f} us for {n * 16} rows = {te / (n * 16) * 1e9:.1f} ns/row")


async def submit() -> None:
    o = kv.EngineOptions(transport="shm", secret=b"plan-headsplit")
    async with kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", o) as p, \
            kv.KvEngine(2, kv.Role.DECODER, "127.0.0.1:0", o) as d:
        await p.link_clusters([kv.ClusterInfo(2, d.address)])
        pool = 256
        src = p.allocate_cache(CacheDesc(64, (pool, 16, 8, 128), np.float16, head_axis=2))
        half = d.allocate_cache(CacheDesc(64, (pool, 16, 4, 128), np.float16, head_axis=2))
        whole = d.allocate_cache(CacheDesc(64, (pool, 16, 8, 128), np.float16, head_axis=2))
        for c in (half, whole):
            await p.wait_remote_cache(2, c.cache_id)
        rng = np.random.default_rng(1)
        sb, db = rng.permutation(pool), rng.permutation(pool)
        for name, dst, ext in (("head-split", half, Ext(src_head_range=range(4))), ("whole blocks", whole, None)):
            xs = []
            for _ in range(9):
                t0 = time.perf_counter()
                t = p.submit_push_kv_blocks(src, kv.BlocksCacheKey(2, dst.cache_id), sb, db, ext, timeout=60)
                xs.append(time.perf_counter() - t0)
                assert await t == kv.LLMStatusCode.LLM_SUCCESS
            m = statistics.median(xs)
            print(f"submit_push_kv_blocks, 256 blocks x 64 tensors, {name}: {m * 1e3:.2f} ms = "
                  f"{m / 16384 * 1e9:.0f} ns per block and tensor")


if __name__ == "__main__":
    planner()
    asyncio.run(submit())
