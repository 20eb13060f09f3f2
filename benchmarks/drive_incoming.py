"""Pushes into an engine whose loop thread drives its own: how long they wait for it.

    python benchmarks/drive_incoming.py                      # tcp; writes benchmarks/results/drive_incoming-tcp.{json,png}
    UCX_TLS=sm,self KVENGINE_UCX_PEER_ERRORS=0 python benchmarks/drive_incoming.py --transport ucx

An engine whose loop thread drives one-layer pushes (decisions.md #33, #35) keeps its
I/O thread from watching the sockets (tcp) or UCX's worker while a drive runs. Traffic
that comes in for it meanwhile, or between two drives, is a peer's push into it or a
pull from it: this measures how long such a push takes. Engine A (this process) pushes
one layer (2 x 32 KiB) into a decode engine B (a child process) every PERIOD ms (0:
back to back), its pushes awaited; B pushes 2 x 32 KiB into A, one after another 0.7 ms apart, timed in B.
Columns, interleaved round by round (the order rotating): "A idle" (A pushes nothing:
the baseline of the same run) and one per period. Printed: B's push p50 / p90 / p99 in
us, its p50 over the baseline's, and how many of A's pushes its loop thread drove.

Figures: docs/benchmarks.md, "Traffic in while the loop thread drives"."""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from typing import Any

import numpy as np

import kvengine as kv
from kvengine._peer import PeerProcess
from kvengine.bench.common import cpu_model, meta, pct, save_outputs

SECRET = b"drive-incoming"
LAYERS, HALF = 8, 32 << 10
IDLE = "A idle"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    T = args.transport
    peer = await PeerProcess.start(cluster_id=2, transport=T, secret=SECRET)
    a = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", kv.EngineOptions(transport=T, secret=SECRET)).start()
    try:
        dst = (await peer.call("alloc", n=2 * LAYERS, shape=[1, HALF], dtype="uint8"))["cache_id"]
        theirs = (await peer.call("alloc", n=2, shape=[1, HALF], dtype="uint8", fill=3))["cache_id"]
        mine = a.allocate_cache(kv.CacheDesc(2, (1, HALF), np.uint8))
        st, per = await a.link_clusters([kv.ClusterInfo(2, peer.address)])
        if st != kv.LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link: {per}")
        await a.wait_remote_cache(2, dst)
        src = a.allocate_cache(kv.CacheDesc(2 * LAYERS, (1, HALF), np.uint8))
        idx = kv.CacheIndex(2, dst, 0)
        ext = [kv.KvCacheExtParam((i, i), (i, i), 2) for i in range(LAYERS)]
        for e in ext:   # planned once (the first push of each layer takes the Python path)
            await a.push_kv_cache(src, idx, 0, ext_param=e, timeout=10)

        async def b_pushes(n: int) -> list[float]:
            r = await peer.call("push_times", cluster_id=1, dst_cache_id=mine.cache_id, cache_id=theirs, n=n,
                                gap=0.0007, timeout=10)
            if r["status"] != 0:
                raise RuntimeError(f"B's push: status {r['status']}")
            return [float(x) for x in r["us"]]

        async def column(period_ms: float | None, n: int) -> tuple[list[float], int]:
            if period_ms is None:
                return await b_pushes(n), 0
            stop = asyncio.Event()
            pushes = 0

            async def drive() -> None:
                nonlocal pushes
                while not stop.is_set():
                    await a.push_kv_cache(src, idx, 0, ext_param=ext[pushes % LAYERS], timeout=10)
                    pushes += 1
                    if not period_ms:
                        await asyncio.sleep(0)   # (B's answers are read on this loop)
                        continue
                    try:   # (uvloop's timers have a resolution of 1 ms)
                        await asyncio.wait_for(stop.wait(), period_ms / 1e3)
                    except asyncio.TimeoutError:
                        pass
            d0 = a.stats()["native"][f"{T}_driven"]
            task = asyncio.ensure_future(drive())
            try:
                us = await b_pushes(n)
            finally:
                stop.set()
                await task
            return us, a.stats()["native"][f"{T}_driven"] - d0

        await b_pushes(20)   # warm-up (B plans its push)
        configs: list[tuple[str, float | None]] = [(IDLE, None)] + [
            (f"A drives every {p:g} ms" if p else "A drives back to back", p) for p in args.periods]
        samples: dict[str, list[float]] = {c: [] for c, _ in configs}
        driven: dict[str, int] = {c: 0 for c, _ in configs}
        per_round = max(1, args.n // args.rounds)
        for r in range(args.rounds):
            for name, period in configs[r % len(configs):] + configs[:r % len(configs)]:
                us, d = await column(period, per_round)
                samples[name] += us
                driven[name] += d
            print(f"\rround {r + 1}/{args.rounds}", end="", flush=True)
        print()
        base = statistics.median(samples[IDLE])
        cols = {name: {"p50_us": statistics.median(s), "p90_us": pct(s, 0.9), "p99_us": pct(s, 0.99),
                       "over_idle_p50": statistics.median(s) / base, "a_pushes_driven": driven[name], "n": len(s)}
                for name, s in samples.items()}
        return {"transport": T, "ucx_tls": os.environ.get("UCX_TLS"), "cpu": cpu_model(), "columns": cols,
                "samples_us": samples}
    finally:
        await a.close()
        await peer.close()


def plot(r: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(r["columns"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.boxplot([r["samples_us"][n] for n in names], showfliers=False)
    ax.set_xticks(range(1, len(names) + 1), names, fontsize=8)
    ax.set_ylabel("B's push into A, us")
    ax.set_title(f"Pushes into an engine that drives its own ({r['transport']}; {r['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transport", choices=["tcp", "ucx"], default="tcp")
    ap.add_argument("--periods", default="0,2", help="A's push periods in ms, comma-separated (0: back to back)")
    ap.add_argument("--n", type=int, default=400, help="B's pushes per column")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=None, help="output prefix (default benchmarks/results/drive_incoming-TRANSPORT)")
    args = ap.parse_args()
    args.periods = [float(x) for x in args.periods.split(",") if x]
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"drive_incoming-{args.transport}")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    import uvloop
    r = uvloop.run(run(args))
    print(f"{r['cpu']}, {r['transport']}" + (f" (UCX_TLS={r['ucx_tls']})" if r["ucx_tls"] else "")
          + ": B's push of 2 x 32 KiB into A, us")
    print(f"{'column':24s} {'p50':>7s} {'p90':>7s} {'p99':>7s} {'p50 x idle':>10s} {'A driven':>9s}")
    for name, c in r["columns"].items():
        print(f"{name:24s} {c['p50_us']:7.0f} {c['p90_us']:7.0f} {c['p99_us']:7.0f} {c['over_idle_p50']:9.2f}x "
              f"{c['a_pushes_driven']:9d}")
    print(save_outputs(out + ".json", out + ".png", {"meta": meta(None), **r}, plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
