#!/usr/bin/env python3
"""What a small push into a same-host peer's registered memory (CMA, a mover's copy) costs
the movers: mean time per awaited one-layer push (2 x 32 KiB, 20,000 of them) and each
mover thread's CPU ticks and voluntary context switches meanwhile (a switch: the thread
slept and was woken); then 8 concurrent 512 KiB pushes (1500 rounds), GB/s. Compare two
trees, alternated:

    PYTHONPATH=<tree> python benchmarks/mover_wakeups.py
"""
import asyncio, os, time
import numpy as np
import kvengine as kv
from kvengine._peer import PeerProcess
def movers():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            st = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            if name.startswith("kv-mover"):
                out[name] = (int(st[11]) + int(st[12]), int(open(f"/proc/self/task/{tid}/status").read().split("nonvoluntary_ctxt_switches:")[0].split("voluntary_ctxt_switches:")[1]))
        except OSError:
            pass
    return out
async def main():
    e = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", kv.EngineOptions(transport="shm")).start()
    peer = await PeerProcess.start(cluster_id=2, transport="shm")
    try:
        await e.link_clusters([kv.ClusterInfo(2, peer.address)])
        sd = (await peer.call("register", n=2, shape=[1, 32 << 10], dtype="uint8"))["cache_id"]
        await e.wait_remote_cache(2, sd, timeout=10)
        ss = e.allocate_cache(kv.CacheDesc(2, (1, 32 << 10), np.uint8))
        await e.push_kv_cache(ss, kv.CacheIndex(2, sd, 0))
        a = movers(); t0 = time.perf_counter()
        for i in range(20000):
            await e.push_kv_cache(ss, kv.CacheIndex(2, sd, 0))
        dt = time.perf_counter() - t0; b = movers()
        print(kv.__file__.split("/kvengine/")[0], f"{dt/20000*1e6:.1f} us/push", {k: (b[k][0]-a[k][0], b[k][1]-a[k][1]) for k in b}, "(cpu ticks, voluntary switches)")
        # 8 concurrent 512 KiB pushes (one per layer), 1500 rounds
        big = (await peer.call("register", n=16, shape=[1, 256 << 10], dtype="uint8", one_buffer=True))["cache_id"]
        await e.wait_remote_cache(2, big, timeout=10)
        bs = e.allocate_cache(kv.CacheDesc(16, (1, 256 << 10), np.uint8))
        exts = [kv.KvCacheExtParam((i, i), (i, i), 2) for i in range(8)]
        for x in exts:
            await e.push_kv_cache(bs, kv.CacheIndex(2, big, 0), 0, ext_param=x)
        t0, rounds = time.perf_counter(), 1500
        for r in range(rounds):
            ts = [e.submit_push_kv_cache(bs, kv.CacheIndex(2, big, 0), 0, ext_param=x, timeout=10) for x in exts]
            for t in ts:
                await t
        dt = time.perf_counter() - t0
        print(f"  8 concurrent 512 KiB pushes: {rounds * 8 * (512 << 10) / dt / 1e9:.2f} GB/s")
    finally:
        await e.close(); await peer.close()
asyncio.run(main())
