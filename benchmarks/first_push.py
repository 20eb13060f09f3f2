"""The first push into a fresh cache against the pushes after it.

    python benchmarks/first_push.py                  # shm; writes benchmarks/results/first_push-shm.{json,png}
    python benchmarks/first_push.py --transport tcp

A decode engine (a child process) allocates a cache it has never written; the engine
here pushes a model-shaped cache (64 tensors, 2 GiB: ``--mib``) into it once ("first"),
then WARM more times ("warm": the baseline of the same round), and the child drops the
cache. ROUNDS rounds, each with a cache of its own. ``--owner-writes``: the child
zeroes the cache once this engine has mapped it (before the first push), as a decode
engine writes its own KV. Over shm the bytes are written
through this process's mapping of the child's memfd; over tcp by the child's receives
into its own mapping. A page that mapping faulted in for reading only makes the first
write into it pay the processor's dirty-bit update (kv_core.c ``kv_map_fd``). Printed:
per round the first push's GB/s and the warm median, and the median of first / warm.

Figures: docs/benchmarks.md, "The first write into a page"."""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import kvengine as kv
from kvengine.bench.common import cpu_model, meta, save_outputs
from kvengine.bench.harness import KvSide

TENSORS = 64


async def run(a: argparse.Namespace) -> dict[str, Any]:
    side = KvSide(a.transport, 2, heartbeat_timeout=60.0)   # the child allocates GiBs on its loop
    await side.start()
    rounds: list[dict[str, float]] = []
    try:
        engine, peer = side.started()
        ROW = a.mib * (1 << 20) // TENSORS
        src, idx = await side.alloc(TENSORS, ROW, 5)
        if not await side.verify(src, idx):
            raise RuntimeError("kvengine: the pushed cache differs from the source")
        nbytes = TENSORS * ROW
        for r in range(a.rounds):
            dst = (await peer.call("alloc", n=TENSORS, shape=[1, ROW], dtype="uint8", one_buffer=True,
                                   timeout=300))["cache_id"]
            await engine.wait_remote_cache(2, dst, timeout=60)
            if a.owner_writes:   # the decode engine writes its cache (its own KV) after we mapped it
                await peer.call("zero", cache_id=dst, timeout=120)
            at = kv.CacheIndex(2, dst, 0)
            secs = []
            for _ in range(1 + a.warm):
                t0 = time.perf_counter()
                st = await engine.push_kv_cache(src, at, 0, timeout=60)
                secs.append(time.perf_counter() - t0)
                if st != kv.LLMStatusCode.LLM_SUCCESS:
                    raise RuntimeError(f"kvengine: push failed: {st!r}")
            await peer.call("unregister", cache_id=dst, timeout=60)
            first, warm = nbytes / secs[0] / 1e9, nbytes / statistics.median(secs[1:]) / 1e9
            rounds.append({"first_GBps": first, "warm_GBps": warm, "first_over_warm": first / warm})
            print(f"round {r + 1}: first {first:5.2f} GB/s, warm {warm:5.2f} GB/s: {first / warm:.2f}x", flush=True)
    finally:
        await side.close()
    return {"transport": a.transport, "owner_writes": a.owner_writes, "bytes": nbytes, "cpu": cpu_model(), "rounds": rounds,
            "median_first_over_warm": statistics.median(x["first_over_warm"] for x in rounds)}


def plot(r: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    n = len(r["rounds"])
    xs = range(1, n + 1)
    ax.bar([x - 0.2 for x in xs], [x["first_GBps"] for x in r["rounds"]], 0.4, label="first push")
    ax.bar([x + 0.2 for x in xs], [x["warm_GBps"] for x in r["rounds"]], 0.4, label="warm (median)")
    ax.set_xlabel("round (a fresh destination cache each)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"{r['bytes'] >> 20} MiB push into a fresh cache, {r['transport']} ({r['cpu']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=int, default=2048, help="cache size (64 tensors)")
    ap.add_argument("--warm", type=int, default=5, help="pushes after the first, per round")
    ap.add_argument("--owner-writes", action="store_true",
                    help="the decode engine zeroes its cache after this engine mapped it (shm)")
    ap.add_argument("--out", default=None, help="path prefix (default benchmarks/results/first_push-TRANSPORT)")
    a = ap.parse_args()
    r = asyncio.run(run(a))
    print(f"first push / warm push, median of {len(r['rounds'])} rounds: {r['median_first_over_warm']:.2f}x "
          f"({r['transport']}, {r['cpu']})")
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"first_push-{a.transport}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    print(save_outputs(out + ".json", out + ".png", {"meta": meta(None), **r}, plot))


if __name__ == "__main__":
    main()
