#!/usr/bin/env python3
"""Cost of decisions.md #31: pushes and pulls into / out of a same-host peer's registered
(numpy, CMA) cache. Prints p50/p90/p99 of awaited one-layer (2 x 32 KiB) pushes (the first
sixth left out) and eventfd wake-ups per push, and median GB/s
of 256 MiB pushes and pulls (9 each), as one JSON line, after the tree it imported.

    PYTHONPATH=<tree> python benchmarks/cma_cost.py     # compare two trees, alternated
    KV_N=19000 python benchmarks/cma_cost.py            # more one-layer pushes (default 3000)
"""
import asyncio, os, statistics, sys, time, json
import numpy as np
import kvengine as kv
from kvengine._peer import PeerProcess

async def main():
    e = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", kv.EngineOptions(transport="shm")).start()
    peer = await PeerProcess.start(cluster_id=2, transport="shm")
    out = {}
    try:
        st, per = await e.link_clusters([kv.ClusterInfo(2, peer.address)])
        assert st == kv.LLMStatusCode.LLM_SUCCESS, per
        small = kv.CacheDesc(2, (1, 32 << 10), np.uint8)
        big = kv.CacheDesc(2, (1, 128 << 20), np.uint8)
        sd = (await peer.call("register", n=2, shape=[1, 32 << 10], dtype="uint8"))["cache_id"]
        bd = (await peer.call("register", n=2, shape=[1, 128 << 20], dtype="uint8", fill=5))["cache_id"]
        for c in (sd, bd):
            await e.wait_remote_cache(2, c, timeout=10)
        ss, bs = e.allocate_cache(small), e.allocate_cache(big)
        for t in ss.tensors: t[...] = 1
        for t in bs.tensors: t[...] = 2
        lat = []
        n = int(os.environ.get("KV_N", "3000"))
        native0 = e.stats()["native"]
        for i in range(n):
            t0 = time.perf_counter()
            await e.push_kv_cache(ss, kv.CacheIndex(2, sd, 0))
            lat.append(time.perf_counter() - t0)
        lat = sorted(lat[n // 6:])
        out["push 64 KiB p50 us"] = lat[len(lat) // 2] * 1e6
        out["p90 us"] = lat[int(len(lat) * 0.9)] * 1e6
        out["p99 us"] = lat[int(len(lat) * 0.99)] * 1e6
        out["eventfd wake-ups per push"] = (e.stats()["native"]["wakeups"] - native0["wakeups"]) / n
        for name in ("push", "pull"):
            xs = []
            for r in range(9):
                t0 = time.perf_counter()
                if name == "push":
                    await e.push_kv_cache(bs, kv.CacheIndex(2, bd, 0), timeout=60)
                else:
                    await e.pull_kv_cache(kv.CacheIndex(2, bd, 0), bs, timeout=60)
                xs.append(time.perf_counter() - t0)
            out[f"{name} 256 MiB GB/s"] = (256 << 20) / statistics.median(xs) / 1e9
    finally:
        await e.close()
        await peer.close()
    print(kv.__file__.split("/kvengine/")[0], json.dumps({k: round(v, 2) for k, v in out.items()}))

asyncio.run(main())
