"""Load test: deadline scheduling (EDF) against FIFO under mixed load, same run.

    kvengine bench load                    # or: python benchmarks/load.py
    kvengine bench load --quick

A prefill engine here pushes into a decode engine in a child process over the
forced TCP transport (the wire is the contended resource). Arrivals are
Poisson at an offered load given as a fraction of the measured capacity:
mostly one-layer pushes (2 x 32 KiB, deadline 20 ms, as a decode step needs
them) plus whole-cache pushes (32 MiB, deadline 1 s) that carry most of the
bytes. Each offered load runs twice, with EngineOptions(scheduling="edf") and
with scheduling="fifo" (the same engine with ordering off), on the same
arrival sequence. Reported: throughput, p50/p99 latency of each class (a push that missed its
deadline counts at its deadline, which flatters FIFO), deadline misses
(transfers that resolved LLM_TIMEOUT). Writes PREFIX.json and PREFIX.png
(--out PREFIX, default kvengine-bench/load).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import statistics
import sys
import time

import numpy as np

import kvengine as kv
from kvengine._peer import PeerProcess
from .common import Report, out_paths, save_outputs

S = kv.LLMStatusCode
LAYER_HALF = 32 << 10          # K and V of one layer: 2 x 32 KiB
BIG_ROW = 16 << 20             # whole cache: 2 x 16 MiB
LAYER_DEADLINE = 0.020
BIG_DEADLINE = 1.0
BIG_SHARE = 0.05               # fraction of arrivals that are whole caches


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def setup(mode: str, peer: PeerProcess, cluster: int, streams: int, budget: int | None,
                piece: int | None, secret: bytes) -> tuple[kv.KvEngine, kv.Cache, kv.Cache]:
    opts = kv.EngineOptions(transport="tcp", scheduling=mode, secret=secret, tcp_streams=streams,
                            max_inflight_bytes=budget, piece_bytes=piece)
    e = await kv.KvEngine(cluster, kv.Role.PROMPT, None, opts).start()
    st, _ = await e.link_clusters([kv.ClusterInfo(2, peer.address)])
    assert st == S.LLM_SUCCESS, st
    layer_src = e.allocate_cache(kv.CacheDesc(64, (1, LAYER_HALF), np.uint8))
    big_src = e.allocate_cache(kv.CacheDesc(2, (1, BIG_ROW), np.uint8))
    return e, layer_src, big_src


async def capacity(e: kv.KvEngine, big_src: kv.Cache, big_dst: int, reps: int) -> float:
    """Bytes/s of back-to-back whole-cache pushes, two in flight."""
    idx = kv.CacheIndex(2, big_dst, 0)
    await e.push_kv_cache(big_src, idx, timeout=30)
    t0 = time.perf_counter()
    for _ in range(reps):
        await asyncio.gather(e.push_kv_cache(big_src, idx, timeout=30), e.push_kv_cache(big_src, idx, timeout=30))
    return 2 * reps * 2 * BIG_ROW / (time.perf_counter() - t0)


async def run_load(e: kv.KvEngine, layer_src: kv.Cache, big_src: kv.Cache, layer_dst: int, big_dsts: list[int],
                   arrivals: list[tuple[float, int]]) -> Report:
    loop = asyncio.get_running_loop()
    lat: dict[str, list[float]] = {"layer": [], "big": []}
    miss = {"layer": 0, "big": 0}
    count = {"layer": 0, "big": 0}
    done_bytes = 0
    tasks: list[kv.Transfer] = []
    t_start = loop.time()
    exts = [kv.KvCacheExtParam((i, i), (i, i), 2) for i in range(32)]

    clock = time.perf_counter   # uvloop's loop.time() has 1 ms resolution

    def finished(kind: str, t0: float, t: kv.Transfer) -> None:
        nonlocal done_bytes
        # a push that missed its deadline counts at the deadline (it resolved LLM_TIMEOUT then)
        lat[kind].append(clock() - t0)
        if t.status == S.LLM_SUCCESS:
            done_bytes += t.nbytes
        else:
            miss[kind] += 1

    for i, (at, kind) in enumerate(arrivals):
        delay = t_start + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        t0 = clock()
        if kind == 0:
            t = e.submit_push_kv_cache(layer_src, kv.CacheIndex(2, layer_dst, 0), 0, ext_param=exts[i % 32],
                                       timeout=LAYER_DEADLINE)
            name = "layer"
        else:
            t = e.submit_push_kv_cache(big_src, kv.CacheIndex(2, big_dsts[i % len(big_dsts)], 0),
                                       timeout=BIG_DEADLINE)
            name = "big"
        count[name] += 1
        # called in the completion itself (at once if done), without the event-loop hop
        # an awaiting task would add
        def on_done(st: kv.LLMStatusCode, name: str = name, t0: float = t0, t: kv.Transfer = t) -> None:
            finished(name, t0, t)
        t.add_done_callback(on_done)
        tasks.append(t)
    await asyncio.gather(*tasks)
    elapsed = loop.time() - t_start
    return {
        "seconds": elapsed, "throughput_GBps": done_bytes / elapsed / 1e9,
        "layer": {"n": count["layer"], "missed": miss["layer"], "p50_ms": pct(lat["layer"], 0.5) * 1e3,
                  "p99_ms": pct(lat["layer"], 0.99) * 1e3},
        "big": {"n": count["big"], "missed": miss["big"], "p50_ms": pct(lat["big"], 0.5) * 1e3,
                "p99_ms": pct(lat["big"], 0.99) * 1e3},
        "missed": miss["layer"] + miss["big"],
    }


def make_arrivals(rate_bytes: float, seconds: float, seed: int) -> list[tuple[float, int]]:
    mean_bytes = (1 - BIG_SHARE) * 2 * LAYER_HALF + BIG_SHARE * 2 * BIG_ROW
    rate = rate_bytes / mean_bytes      # arrivals per second
    rng = random.Random(seed)
    t, out = 0.0, []
    while t < seconds:
        t += rng.expovariate(rate)
        out.append((t, 1 if rng.random() < BIG_SHARE else 0))
    return out


async def main_async(args: argparse.Namespace) -> Report:
    secret = secrets.token_hex(16).encode()   # authenticated links, as in production (and no warning)
    peer = await PeerProcess.start(cluster_id=2, transport="tcp", tcp_streams=args.streams, secret=secret)
    try:
        layer_dst = (await peer.call("alloc", n=64, shape=[1, LAYER_HALF], dtype="uint8"))["cache_id"]
        big_dsts = [(await peer.call("alloc", n=2, shape=[1, BIG_ROW], dtype="uint8"))["cache_id"]
                    for _ in range(4)]
        engines: dict[str, tuple[kv.KvEngine, kv.Cache, kv.Cache]] = {}
        for cluster, mode in ((11, "edf"), (12, "fifo")):
            engines[mode] = await setup(mode, peer, cluster, args.streams, args.budget, args.piece, secret)
            for cid in [layer_dst] + big_dsts:
                await engines[mode][0].wait_remote_cache(2, cid)
        cap = statistics.median([await capacity(engines["edf"][0], engines["edf"][2], big_dsts[0], args.cap_reps)
                                 for _ in range(3)])
        print(f"capacity (back-to-back 32 MiB pushes over tcp): {cap / 1e9:.2f} GB/s", flush=True)
        loads: list[Report] = []
        results: Report = {"capacity_GBps": cap / 1e9, "loads": loads}
        for li, load in enumerate(args.loads):
            arrivals = make_arrivals(load * cap, args.seconds, seed=li)
            row: Report = {"offered": load, "arrivals": len(arrivals)}
            for mode in ("edf", "fifo") if li % 2 == 0 else ("fifo", "edf"):   # alternate who goes first
                e, ls, bs = engines[mode]
                row[mode] = await run_load(e, ls, bs, layer_dst, big_dsts, arrivals)
            loads.append(row)
            ed, fi = row["edf"], row["fifo"]
            print(f"load {load:.0%}: {len(arrivals)} pushes | "
                  f"EDF: {ed['throughput_GBps']:.2f} GB/s, misses {ed['missed']} "
                  f"(layer {ed['layer']['missed']}/{ed['layer']['n']}, big {ed['big']['missed']}/{ed['big']['n']}), "
                  f"layer p50 {ed['layer']['p50_ms']:.2f} ms p99 {ed['layer']['p99_ms']:.2f} ms | "
                  f"FIFO: {fi['throughput_GBps']:.2f} GB/s, misses {fi['missed']} "
                  f"(layer {fi['layer']['missed']}/{fi['layer']['n']}, big {fi['big']['missed']}/{fi['big']['n']}), "
                  f"layer p50 {fi['layer']['p50_ms']:.2f} ms p99 {fi['layer']['p99_ms']:.2f} ms", flush=True)
        for mode in engines:
            await engines[mode][0].close()
        return results
    finally:
        await peer.close()


def summarize(results: Report) -> None:
    for row in results["loads"]:
        ed, fi = row["edf"], row["fifo"]
        miss_ratio = (fi["missed"] / ed["missed"]) if ed["missed"] else float("inf") if fi["missed"] else 1.0
        p99_ratio = fi["layer"]["p99_ms"] / ed["layer"]["p99_ms"] if ed["layer"]["p99_ms"] > 0 else float("nan")
        row["fifo_over_edf"] = {"misses": miss_ratio, "layer_p99": p99_ratio}
        print(f"load {row['offered']:.0%}: deadline misses FIFO {fi['missed']} / EDF {ed['missed']} = "
              f"{miss_ratio:.1f}x (goal >= 5x at 80%), "
              f"one-layer p99 FIFO/EDF = {p99_ratio:.1f}x (goal >= 3x)")


def plot(results: Report, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    loads = [r["offered"] * 100 for r in results["loads"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style, color in (("edf", "o-", "tab:blue"), ("fifo", "s--", "tab:orange")):
        axes[0].plot(loads, [r[mode]["layer"]["p99_ms"] for r in results["loads"]], style, color=color,
                     label=f"{mode} p99")
        axes[0].plot(loads, [r[mode]["layer"]["p50_ms"] for r in results["loads"]], style, color=color,
                     alpha=0.4, label=f"{mode} p50")
        axes[1].plot(loads, [r[mode]["missed"] for r in results["loads"]], style, color=color, label=mode)
    axes[0].axhline(LAYER_DEADLINE * 1e3, color="grey", ls=":", label="deadline")
    axes[0].set_yscale("log")
    axes[0].set_xlabel("offered load (% of capacity)")
    axes[0].set_ylabel("one-layer push latency (ms)")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("offered load (% of capacity)")
    axes[1].set_ylabel("deadline misses")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"kvengine load test over tcp (capacity {results['capacity_GBps']:.2f} GB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvengine bench load", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seconds", type=float, default=None, help="arrival window per run")
    ap.add_argument("--loads", type=float, nargs="*", default=None, help="offered loads, fractions")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--budget", type=int, default=None, help="EngineOptions.max_inflight_bytes (default: its own)")
    ap.add_argument("--piece", type=int, default=None, help="EngineOptions.piece_bytes (default: its own)")
    ap.add_argument("--out", default=os.path.join("kvengine-bench", "load"), help="path prefix of the outputs")
    args = ap.parse_args(argv)
    args.seconds = args.seconds or (2.0 if args.quick else 5.0)
    args.loads = args.loads or ([0.5, 0.8] if args.quick else [0.4, 0.6, 0.8, 0.9])
    args.cap_reps = 2 if args.quick else 4
    import uvloop
    results = uvloop.run(main_async(args))
    summarize(results)
    results["meta"] = {"argv": sys.argv[1:], "time": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
                       "layer_bytes": 2 * LAYER_HALF, "big_bytes": 2 * BIG_ROW, "big_share": BIG_SHARE,
                       "layer_deadline_s": LAYER_DEADLINE, "big_deadline_s": BIG_DEADLINE}
    print(save_outputs(*out_paths(args.out, None), results, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
