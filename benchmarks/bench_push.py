"""Same-host push benchmark: kvengine against memcpy, measured in the same run.

    python benchmarks/bench_push.py            # writes benchmarks/results/push.{json,png}
    python benchmarks/bench_push.py --quick    # fewer repetitions

Three measurements, each beside its baseline:
1. throughput: a model-shaped KV row (64 tensors x 2 MiB) pushed into a decode
   engine in another process, vs single-thread memcpy (numpy copyto) of the same
   bytes into a pre-faulted buffer, interleaved run by run;
2. latency: one-layer pushes (K+V, 2 x 32 KiB = 64 KiB) awaited one at a time
   through the asyncio API, p50/p99, under asyncio and uvloop;
3. the inline threshold: push latency by size with every job copied inline on
   the loop thread vs handed to a mover thread (the crossover sets
   EngineOptions.inline_threshold).
The machine is noisy (2 vCPUs): medians and ratios only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

import kvengine as kv
from kvengine._peer import PeerProcess, fill_pattern
from kvengine.bench.baselines import memcpy_seconds   # shared with `kvengine bench throughput`
from kvengine.bench.common import save_outputs

S = kv.LLMStatusCode
MiB = 1 << 20


async def throughput(engine, peer, reps: int, tensors: int, row_mib: int) -> dict:
    desc = kv.CacheDesc(tensors, (2, row_mib * MiB), np.uint8)
    src = engine.allocate_cache(desc)
    for i, t in enumerate(src.tensors):
        fill_pattern(t, 1, i)
    dst_id = (await peer.call("alloc", n=tensors, shape=[2, row_mib * MiB], dtype="uint8"))["cache_id"]
    await engine.wait_remote_cache(2, dst_id)
    base_dst = [np.ones(row_mib * MiB, np.uint8) for _ in range(tensors)]   # pre-faulted
    src_rows = [t[0] for t in src.tensors]
    nbytes = tensors * row_mib * MiB
    push_s, copy_s = [], []
    await engine.push_kv_cache(src, kv.CacheIndex(2, dst_id, 1), 0, timeout=60)   # warm-up
    memcpy_seconds(src_rows, base_dst)
    for _ in range(reps):
        t0 = time.perf_counter()
        await engine.push_kv_cache(src, kv.CacheIndex(2, dst_id, 0), 0, timeout=60)
        push_s.append(time.perf_counter() - t0)
        copy_s.append(memcpy_seconds(src_rows, base_dst))
    await engine.unregister_kv_cache(src.cache_id)
    await peer.call("unregister", cache_id=dst_id)
    push = nbytes / statistics.median(push_s) / 1e9
    copy = nbytes / statistics.median(copy_s) / 1e9
    return {"bytes": nbytes, "tensors": tensors, "row_bytes": row_mib * MiB,
            "push_GBps": push, "memcpy_GBps": copy, "ratio": push / copy,
            "push_s": push_s, "memcpy_s": copy_s}


async def latency(engine, peer, n: int, layer_bytes: int, layers: int = 32) -> dict:
    half = layer_bytes // 2
    desc = kv.CacheDesc(2 * layers, (1, half), np.uint8)
    src = engine.allocate_cache(desc)
    dst_id = (await peer.call("alloc", n=2 * layers, shape=[1, half], dtype="uint8"))["cache_id"]
    await engine.wait_remote_cache(2, dst_id)
    idx = kv.CacheIndex(2, dst_id, 0)
    exts = [kv.KvCacheExtParam((i, i), (i, i), 2) for i in range(layers)]
    for i in range(200):   # warm-up (plans cached, pages touched)
        await engine.push_kv_cache(src, idx, 0, ext_param=exts[i % layers])
    lat = []
    push = engine.push_kv_cache
    for i in range(n):
        t0 = time.perf_counter()
        await push(src, idx, 0, ext_param=exts[i % layers])
        lat.append(time.perf_counter() - t0)
    await engine.unregister_kv_cache(src.cache_id)
    await peer.call("unregister", cache_id=dst_id)
    us = sorted(x * 1e6 for x in lat)
    return {"layer_bytes": layer_bytes, "n": n, "p50_us": us[len(us) // 2], "p90_us": us[int(len(us) * 0.9)],
            "p99_us": us[int(len(us) * 0.99)], "samples_us": us}


async def sweep(engine_inline, engine_mover, peer, sizes: list[int], n: int) -> list[dict]:
    out = []
    for size in sizes:
        row = {"bytes": size}
        for name, e in (("inline", engine_inline), ("mover", engine_mover)):
            desc = kv.CacheDesc(1, (1, size), np.uint8)
            src = e.allocate_cache(desc)
            dst_id = (await peer.call("alloc", n=1, shape=[1, size], dtype="uint8"))["cache_id"]
            await e.wait_remote_cache(2, dst_id)
            idx = kv.CacheIndex(2, dst_id, 0)
            for _ in range(50):
                await e.push_kv_cache(src, idx)
            lat = []
            for _ in range(n):
                t0 = time.perf_counter()
                await e.push_kv_cache(src, idx)
                lat.append(time.perf_counter() - t0)
            row[f"{name}_p50_us"] = statistics.median(lat) * 1e6
            await e.unregister_kv_cache(src.cache_id)
            await peer.call("unregister", cache_id=dst_id)
        out.append(row)
    return out


async def run(args) -> dict:
    peer = await PeerProcess.start(cluster_id=2, movers=args.movers)
    results: dict = {"loop": args.loop_name}
    try:
        opts = kv.EngineOptions(movers=args.movers, secret=None)
        async with kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", opts) as engine:
            st, _ = await engine.link_clusters([kv.ClusterInfo(2, peer.address)])
            assert st == S.LLM_SUCCESS, st
            if args.part in ("all", "throughput"):
                results["throughput"] = await throughput(engine, peer, args.reps, 64, 2)
            if args.part in ("all", "latency"):
                results["latency"] = await latency(engine, peer, args.n, 64 * 1024)
            if args.part in ("all", "sweep"):
                inline = kv.EngineOptions(movers=args.movers, inline_threshold=1 << 30, secret=None)
                mover = kv.EngineOptions(movers=args.movers, inline_threshold=0, secret=None)
                async with kv.KvEngine(3, listen=None, options=inline) as ei, \
                        kv.KvEngine(4, listen=None, options=mover) as em:
                    for e in (ei, em):
                        st, _ = await e.link_clusters([kv.ClusterInfo(2, peer.address)])
                        assert st == S.LLM_SUCCESS
                    sizes = [4096 << k for k in range(0, 10)]   # 4 KiB .. 2 MiB
                    results["sweep"] = await sweep(ei, em, peer, sizes, max(100, args.n // 10))
    finally:
        await peer.close()
    return results


def plot(all_results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(all_results)
    ax = axes[0]
    xs = np.arange(len(names))
    if all("throughput" in all_results[n] for n in names):
        ax.bar(xs - 0.2, [all_results[n]["throughput"]["push_GBps"] for n in names], 0.4, label="kvengine push (other process)")
        ax.bar(xs + 0.2, [all_results[n]["throughput"]["memcpy_GBps"] for n in names], 0.4, label="memcpy, 1 thread")
        ax.set_xticks(xs, names)
        ax.set_ylabel("GB/s")
        ax.set_title("64 x 2 MiB KV row, same host")
        ax.legend(fontsize=8)
    ax = axes[1]
    for n in names:
        if "latency" not in all_results[n]:
            continue
        us = all_results[n]["latency"]["samples_us"]
        ax.plot(us, np.linspace(0, 1, len(us)), label=f"{n}: p50 {all_results[n]['latency']['p50_us']:.1f} us")
    ax.axvline(30, color="grey", ls=":", label="goal p50 30 us")
    ax.set_xscale("log")
    # plain numbers on the decades only: minor labels (3x10^1, 4x10^1, ...) overlap
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("await push_kv_cache, 64 KiB layer (us)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=8)
    ax = axes[2]
    sw = all_results[names[0]].get("sweep")
    if sw:
        b = [r["bytes"] / 1024 for r in sw]
        ax.plot(b, [r["inline_p50_us"] for r in sw], "o-", label="inline (loop thread)")
        ax.plot(b, [r["mover_p50_us"] for r in sw], "s-", label="mover thread + eventfd")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("push size (KiB)")
        ax.set_ylabel("p50 latency (us)")
        ax.set_title(f"inline threshold ({names[0]})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--n", type=int, default=None, help="latency samples")
    ap.add_argument("--movers", type=int, default=2)
    ap.add_argument("--part", default="all", choices=["all", "throughput", "latency", "sweep"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "push"))
    args = ap.parse_args()
    args.reps = args.reps or (3 if args.quick else 9)
    args.n = args.n or (500 if args.quick else 5000)
    import uvloop
    all_results = {}
    for name, runner in (("asyncio", asyncio.run), ("uvloop", uvloop.run)):
        args.loop_name = name
        if name == "asyncio" and args.part == "sweep":
            continue
        print(f"[{name}] running ...", flush=True)
        all_results[name] = r = runner(run(args))
        if "throughput" in r:
            t = r["throughput"]
            print(f"[{name}] push 64 x 2 MiB to another process: {t['push_GBps']:.2f} GB/s; "
                  f"memcpy same bytes: {t['memcpy_GBps']:.2f} GB/s; ratio {t['ratio']:.2f}x (goal >= 0.9x)")
        if "latency" in r:
            la = r["latency"]
            print(f"[{name}] one-layer 64 KiB push through await: p50 {la['p50_us']:.1f} us, "
                  f"p90 {la['p90_us']:.1f} us, p99 {la['p99_us']:.1f} us (goal p50 <= 30 us)")
        for row in r.get("sweep", []):
            print(f"[{name}] {row['bytes'] // 1024:5d} KiB: inline p50 {row['inline_p50_us']:8.1f} us, "
                  f"mover p50 {row['mover_p50_us']:8.1f} us, inline/mover {row['inline_p50_us'] / row['mover_p50_us']:.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    meta = {"python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count(),
            "kvengine": kv.__version__, "argv": sys.argv[1:], "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    slim = json.loads(json.dumps(all_results))
    for r in slim.values():
        if "latency" in r:
            r["latency"].pop("samples_us")
    print(save_outputs(args.out + ".json", args.out + ".png", {"meta": meta, "results": slim}, plot,
                       all_results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
