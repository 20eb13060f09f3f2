"""Micro-measure of transport="ucx" (not the benchmark: `kvengine bench` has that):
a 256 MiB push (64 tensors x 4 MiB, memfd caches) from this process to a decode
engine in a child process, 7 times, and 300 one-layer (2 x 32 KiB) pushes awaited
one at a time; prints the medians. One line per UCX_TLS given (default: sm,self tcp).

    PYTHONPATH=<tree> python benchmarks/ucx_am_vs_put.py sm,self tcp

docs/benchmarks.md, "UCX: active messages", compares two trees this way, run
alternately (A B A B ...) on the same machine."""
import asyncio, os, sys, time, statistics
import numpy as np
import kvengine as kv
from kvengine._peer import PeerProcess

async def main(tls, reps=7):
    os.environ["UCX_TLS"] = tls
    os.environ.setdefault("UCX_NET_DEVICES", "lo")   # both ends on this host: 127.0.0.1 only
    o = kv.EngineOptions(transport="ucx", secret=b"s")
    p = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", o).start()
    d = await PeerProcess.start(cluster_id=2, secret=b"s", transport="ucx")
    try:
        desc = kv.CacheDesc(64, (1, 4 << 20), np.uint8)
        dst = (await d.call("alloc", n=64, shape=[1, 4 << 20], dtype="uint8"))["cache_id"]
        src = p.allocate_cache(desc)
        for t in src.tensors: t[:] = 3
        st, per = await p.link_clusters([kv.ClusterInfo(2, d.address)])
        assert st == 0, per
        await p.wait_remote_cache(2, dst)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            await p.push_kv_cache(src, kv.CacheIndex(2, dst, 0), timeout=60)
            ts.append(time.perf_counter() - t0)
        small = kv.CacheDesc(2, (1, 32 << 10), np.uint8)
        s_src = p.allocate_cache(small)
        s_dst = (await d.call("alloc", n=2, shape=[1, 32 << 10], dtype="uint8"))["cache_id"]
        await p.wait_remote_cache(2, s_dst)
        lat = []
        for _ in range(300):
            t0 = time.perf_counter()
            await p.push_kv_cache(s_src, kv.CacheIndex(2, s_dst, 0), timeout=5)
            lat.append(time.perf_counter() - t0)
        m = statistics.median(ts)
        print(f"UCX_TLS={tls}: 256 MiB push median {m*1e3:.1f} ms = {(256<<20)/m/1e9:.2f} GB/s "
              f"(runs {[round(x*1e3) for x in ts]}); 64 KiB push p50 {statistics.median(lat)*1e6:.0f} us")
    finally:
        await p.close()
        await d.close()

for tls in sys.argv[1:] or ["sm,self", "tcp"]:
    asyncio.run(main(tls))
