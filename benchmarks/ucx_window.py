"""Micro-measure of transport="ucx" for tuning (not the benchmark: `kvengine bench` has that):
a 256 MiB push (64 tensors x 4 MiB) from this process to a decode engine in a child
process, REPS times (default 9), both ends on numpy memory given to register_kv_cache
(MEM=engine: allocate_cache's memfds), with ``tcp_window_bytes`` = W MiB on both ends
(default 4); prints the median GB/s and every figure. UCX_TLS and
KVENGINE_UCX_PEER_ERRORS come from the environment.

    UCX_TLS=tcp KVENGINE_UCX_PEER_ERRORS=0 W=16 PYTHONPATH=<tree> python benchmarks/ucx_window.py

docs/benchmarks.md, "UCX throughput on the same memory", ran it with W = 4, 16, 64."""
import asyncio
import os
import statistics
import time

import numpy as np

import kvengine as kv
from kvengine._peer import PeerProcess


async def main() -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")   # both ends on this host: 127.0.0.1 only
    w = int(float(os.environ.get("W", "4")) * (1 << 20))
    mem = os.environ.get("MEM", "numpy")
    o = kv.EngineOptions(transport="ucx", secret=b"s", tcp_window_bytes=w)
    p = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", o).start()
    d = await PeerProcess.start(cluster_id=2, secret=b"s", transport="ucx", options={"tcp_window_bytes": w})
    try:
        desc = kv.CacheDesc(64, (1, 4 << 20), np.uint8)
        if mem == "numpy":
            flat = np.empty(64 << 22, np.uint8)
            src = p.register_kv_cache(desc, [flat[i << 22:(i + 1) << 22].reshape(1, -1) for i in range(64)])
            dst = (await d.call("register", n=64, shape=[1, 4 << 20], dtype="uint8", one_buffer=True))["cache_id"]
        else:
            src = p.allocate_cache(desc)
            dst = (await d.call("alloc", n=64, shape=[1, 4 << 20], dtype="uint8"))["cache_id"]
        for t in src.tensors:
            t[:] = 3
        st, per = await p.link_clusters([kv.ClusterInfo(2, d.address)])
        assert st == 0, per
        await p.wait_remote_cache(2, dst)
        ts = []
        for _ in range(int(os.environ.get("REPS", "9"))):
            t0 = time.perf_counter()
            await p.push_kv_cache(src, kv.CacheIndex(2, dst, 0), timeout=60)
            ts.append(time.perf_counter() - t0)
        g = sorted((256 << 20) / t / 1e9 for t in ts)
        print(f"UCX_TLS={os.environ.get('UCX_TLS')} W={w >> 20}MiB mem={mem}: median {statistics.median(g):.2f} GB/s "
              f"{[round(x, 2) for x in g]}", flush=True)
    finally:
        await p.close()
        await d.close()

asyncio.run(main())
