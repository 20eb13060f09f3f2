"""Paged latency: ``kvengine bench latency --layout paged``.

    kvengine bench latency --layout paged --transport shm|tcp [--quick] [--blocks 64] [--n N]

One layer of a ``--blocks``-block request (64 by default: the granularity of a
decode step's layer-wise hand-over) pushed from a prefill engine here into a
decode engine in a child process, awaited one at a time, beside a one-layer
contiguous push of the same bytes, in the same run, in interleaved rounds (the
order alternates every round):

- paged: ``push_kv_blocks(src, BlocksCacheKey, src_table, dst_table,
  ext_param=layer i)`` of a pool of vLLM-shaped blocks (16 tokens x 8 KV heads
  x 128 dims, fp16: 32 KiB per block per tensor; K and V per layer), random
  non-monotone tables (a permutation of the pool on each side, cut to
  ``--blocks``; numpy int64 arrays), a different one for each push (cycling);
- contiguous: ``push_kv_cache(src, CacheIndex, ext_param=layer i)`` of a
  one-row cache whose row is the request's ``--blocks`` x 32 KiB per tensor.

Both push K and V of one layer (2 x blocks x 32 KiB; 4 MiB at 64 blocks),
cycling over the layers. Both are checked byte for byte before they are timed.
Reported: p50/p99/p99.9 per column and paged p50 / contiguous p50. Goal
(issue 12): paged p50 within 2x of contiguous, shm and tcp. Writes PREFIX.json
and PREFIX.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from .common import KiB, MiB, Report, busy_processes, fmt_seconds, get_runner, interleaved_rounds, meta, \
    save_outputs
from .harness import KvSide, close_all, footer, latency_results, table, us
from .throughput import add_common_args, resolve_common

LAYERS = 4                                  # layers in the pool (a push moves one; cycled)
BLOCK_SHAPE = (16, 8, 128)                  # tokens, KV heads, head dim (fp16)
BLOCK = 16 * 8 * 128 * 2                    # bytes per block per tensor: 32 KiB
PAGED, CONTIG = "kvengine paged", "kvengine contiguous"
ROUNDS = 10
TABLES = 16                                 # random tables, cycled
GOAL = 2.0                                  # paged p50 <= 2x contiguous p50


async def run(args: argparse.Namespace) -> Report:
    import kvengine as kv
    from kvengine._peer import fill_pattern, row_digests
    T, nb, pool = args.transport, args.blocks, args.pool
    layer_bytes = 2 * nb * BLOCK
    out: Report = {"transport": T, "layout": "paged", "blocks": nb, "pool_blocks": pool, "block_bytes": BLOCK,
                   "layer_bytes": layer_bytes, "layers": LAYERS, "loop": args.loop_name}
    say = print
    t_setup = time.perf_counter()
    say(f"setup: decode engine in a child process ({T}), a pool of {pool} blocks x {2 * LAYERS} tensors and a "
        f"{nb}-block row on each side ...", flush=True)
    kvs = KvSide(T, args.movers)
    try:
        await kvs.start()
        e, peer = kvs.started()
        src = await e.allocate_cache_async(kv.CacheDesc(2 * LAYERS, (pool, *BLOCK_SHAPE), np.float16))
        row_src = await e.allocate_cache_async(kv.CacheDesc(2 * LAYERS, (1, nb * BLOCK), np.uint8))
        for i in range(2 * LAYERS):
            fill_pattern(src.tensors[i], 43, i)
            fill_pattern(row_src.tensors[i], 44, i)
        dst_id = (await peer.call("alloc", n=2 * LAYERS, shape=[pool, *BLOCK_SHAPE], dtype="float16",
                                  timeout=120))["cache_id"]
        row_dst = (await peer.call("alloc", n=2 * LAYERS, shape=[1, nb * BLOCK], dtype="uint8",
                                   timeout=120))["cache_id"]
        for c in (dst_id, row_dst):
            await e.wait_remote_cache(2, c, timeout=30)
        key, idx = kv.BlocksCacheKey(2, dst_id), kv.CacheIndex(2, row_dst, 0)
        rng = np.random.default_rng(21)
        tabs = [(rng.permutation(pool)[:nb], rng.permutation(pool)[:nb]) for _ in range(TABLES)]
        exts = [kv.KvCacheExtParam((i, i), (i, i), 2) for i in range(LAYERS)]

        # byte for byte: one layer of each, the rest of the destination untouched
        await peer.call("zero", cache_id=dst_id, timeout=120)
        sb, db = tabs[0]
        await e.push_kv_blocks(src, key, sb, db, ext_param=exts[1], timeout=60)
        got = (await peer.call("digest", cache_id=dst_id, timeout=120))["rows"]
        want = row_digests(src.tensors)
        ok_paged = all(got[t][d] == want[t][s] for t in (2, 3) for s, d in zip(sb.tolist(), db.tolist()))
        await peer.call("zero", cache_id=row_dst, timeout=120)
        await e.push_kv_cache(row_src, idx, 0, ext_param=exts[1], timeout=60)
        got_row = (await peer.call("digest", cache_id=row_dst, timeout=120))["rows"]
        want_row = row_digests(row_src.tensors)
        zero = row_digests([np.zeros((1, nb * BLOCK), np.uint8)])[0][0]
        ok_row = all(got_row[t][0] == want_row[t][0] for t in (2, 3)) and got_row[0][0] == zero
        out["verify"] = {PAGED: ok_paged, CONTIG: ok_row}
        if not (ok_paged and ok_row):
            raise RuntimeError(f"kvengine: a pushed layer differs from the source: {out['verify']}")

        clock = time.perf_counter

        async def samples(name: str, n: int, start: int) -> list[float]:
            s = []
            if name == PAGED:
                push = e.push_kv_blocks
                for i in range(start, start + n):
                    sb, db = tabs[i % TABLES]
                    t0 = clock()
                    await push(src, key, sb, db, ext_param=exts[i % LAYERS], timeout=30)
                    s.append(clock() - t0)
            else:
                rpush = e.push_kv_cache
                for i in range(start, start + n):
                    t0 = clock()
                    await rpush(row_src, idx, 0, ext_param=exts[i % LAYERS], timeout=30)
                    s.append(clock() - t0)
            return s

        configs = [PAGED, CONTIG]
        per = max(1, args.n // ROUNDS)
        say(f"setup {time.perf_counter() - t_setup:.1f} s; measuring: 2 columns x {ROUNDS} rounds x {per} samples, "
            f"interleaved; one layer = {layer_bytes // KiB} KiB", flush=True)

        async def round_of(name: str, r: int) -> list[float]:
            await samples(name, 50 if r == 0 else 5, 0)           # warm-up
            return await samples(name, per, r * per)

        lat = await interleaved_rounds(out, t_setup, configs, ROUNDS, f"paged latency {T}", round_of, reverse=True)
        latency_results(out, lat)
        res = out["results"]
        out["paged_over_contiguous"] = {q: res[PAGED][q] / res[CONTIG][q] for q in ("p50_us", "p99_us", "p999_us")}
        x = out["paged_over_contiguous"]["p50_us"]
        out["goals"] = [{"what": f"one-layer push of a {nb}-block request: p50 within {GOAL:g}x of a one-layer "
                                 f"contiguous push of the same bytes", "ratio": x,
                         "status": "MET" if x <= GOAL else "NOT MET"}]
        here, there = await kvs.stats()
        out["engine_stats"] = {"prefill": here, "decode": there}
    finally:
        await close_all(kvs, {})
    return out


def report(r: Report) -> list[str]:
    T, res, nb = r["transport"], r["results"], r["blocks"]
    lines = [f"kvengine bench latency --layout paged --transport {T}: one layer (K + V) of a {nb}-block request, "
             f"{2 * nb} x {r['block_bytes'] // KiB} KiB = {r['layer_bytes'] / MiB:g} MiB, awaited one at a time, "
             f"{res[PAGED]['n']} samples per column in {ROUNDS} interleaved rounds ({r['loop']} here)", ""]
    what = {PAGED: f"push_kv_blocks, random table of {nb} blocks (pool {r['pool_blocks']}), one layer",
            CONTIG: f"push_kv_cache of a {nb * r['block_bytes'] // KiB} KiB row per tensor, one layer"}
    rows = [[c, us(res[c]["p50_us"]), us(res[c]["p99_us"]), us(res[c]["p999_us"]), us(res[c]["max_us"]), what[c]]
            for c in r["columns"]]
    lines.append(table(rows, ["column", "p50 us", "p99 us", "p99.9 us", "max us", "what"], align="lrrrrl"))
    x = r["paged_over_contiguous"]
    lines.append("")
    lines.append(f"paged / contiguous: p50 {x['p50_us']:.2f}x, p99 {x['p99_us']:.2f}x, p99.9 {x['p999_us']:.2f}x")
    for g in r["goals"]:
        lines.append(f"goal: {g['what']}: {g['ratio']:.2f}x, {g['status']}")
    lines.extend(footer(r))
    return lines


def plot(r: Report, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    T = r["transport"]
    color = {PAGED: "tab:blue", CONTIG: "black"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for c in r["columns"]:
        s = r["samples_us"][c]
        res = r["results"][c]
        a.plot(s, np.linspace(0, 1, len(s)), color=color[c], lw=2.2 if c == PAGED else 1.4,
               ls="-" if c == PAGED else ":", label=f"{c}: p50 {us(res['p50_us'])}, p99 {us(res['p99_us'])} us")
    a.set_xscale("log")
    a.set_xlabel(f"one-layer push of {r['blocks']} blocks ({r['layer_bytes'] / MiB:g} MiB), awaited (us)")
    a.set_ylabel("CDF")
    a.grid(True, which="both", alpha=0.3)
    a.legend(fontsize=8)
    qs = ("p50_us", "p99_us", "p999_us")
    x = r["paged_over_contiguous"]
    b.bar(range(3), [x[q] for q in qs], color="tab:blue")
    b.axhline(1.0, color="k", lw=0.8)
    b.axhline(GOAL, color="tab:red", lw=0.8, ls="--", label=f"goal: p50 <= {GOAL:g}x")
    b.set_xticks(range(3), ["p50", "p99", "p99.9"])
    b.set_ylabel("paged / contiguous")
    b.grid(True, axis="y", alpha=0.3)
    b.legend(fontsize=8)
    fig.suptitle(f"kvengine bench latency --layout paged --transport {T}  ({r.get('meta', {}).get('time', '')})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvengine bench latency --layout paged", description=__doc__.split("\n")[0],
                                 epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, "latency-paged")
    ap.add_argument("--layout", choices=["paged"], default="paged")
    ap.add_argument("--blocks", type=int, default=64, help="blocks of the request (default 64)")
    ap.add_argument("--pool", type=int, default=None, help="blocks per tensor in the pool (default 4 x --blocks)")
    ap.add_argument("--n", type=int, default=None, help="samples per column (default 3000, --quick 400)")
    args = ap.parse_args(argv)
    args.peers = "none"                      # no peer engine column here
    resolve_common(ap, args, "latency-paged")
    args.n = args.n or (400 if args.quick else 3000)
    args.pool = args.pool or 4 * args.blocks
    if args.pool < args.blocks:
        ap.error("--pool must hold --blocks")
    args.loop_name, runner = get_runner(args.loop)
    busy = busy_processes()
    if busy:
        print("warning: the machine is not idle; figures will be depressed and noisier:\n  " + "\n  ".join(busy))
    t0 = time.perf_counter()
    r: dict[str, Any] = runner(run(args))
    r["meta"] = meta(argv)
    r["meta"]["wall_s"] = time.perf_counter() - t0
    print()
    lines = report(r)
    print("\n".join(lines))
    print(f"total {fmt_seconds(r['meta']['wall_s'])}")
    r["report"] = lines
    slim = {k: v for k, v in r.items() if k != "samples_us"}
    print(save_outputs(args.json_path, args.png_path, slim, plot, r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
