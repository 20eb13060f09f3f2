"""Paged throughput: ``kvengine bench throughput --layout paged``.

    kvengine bench throughput --layout paged --transport shm|tcp|ucx [--quick] [--tables 16,256,1024]

A vLLM-shaped cache: 32 layers, K and V (64 tensors), 16-token blocks of 8 KV
heads x 128 dims in fp16, so 32 KiB per block per tensor, ``--pool`` blocks per
tensor (default: the largest table). A prefill engine here pushes block tables
into a decode engine in a child process (``push_kv_blocks``), over
``--transport``. Per table size (16, 256 and 1024 blocks by default), in the
same run, interleaved repetition by repetition with the order rotating:

- kvengine, paged: random tables (a random permutation of the pool on each
  side, cut to the size; numpy int64 arrays, as a server keeps them), a
  different one for each transfer of a burst;
- kvengine, contiguous: the same bytes, blocks 0..n-1 -> 0..n-1 (one segment
  per tensor, or one for the whole cache when it is all of the pool);
- kvengine, paged pull: as a decode engine pulls a prefill's blocks, the same
  random tables pulled back from there into a cache here (``pull_kv_blocks``;
  over tcp READVs of many blocks each), reported against the contiguous push;
- NIXL and Mooncake (when installed), paged: the same tables as one
  descriptor list each, the very segments kvengine's planner makes (runs of
  consecutive blocks merged), in one buffer per side laid out like the cache
  (``kvengine.bench.peers``: one WRITE handle / one batch per table).

Every engine's push of one table is checked byte for byte before it is timed,
and each configuration moves each of its tables once, untimed (a warm-up).
Reported: median GB/s (1e9 B/s), and per repetition ratios: paged / contiguous,
kvengine paged / each peer, paged pull / contiguous. Goals (issue 12): paged >= 0.9x contiguous at 256
blocks, 1024 no worse per byte; >= 1.5x NIXL same host, >= 1.0x NIXL over tcp.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from . import peers as P
from .common import KiB, MiB, Progress, Report, cpu_snapshot, record_timing
from .harness import KvSide, close_all, footer, gbps, ratio, table, tls_words, ucx_tls_of

if TYPE_CHECKING:
    from kvengine import BlocksCacheKey, Cache

TENSORS, BLOCK_SHAPE = 64, (16, 8, 128)          # 32 layers x (K, V); tokens, KV heads, head dim
BLOCK = 16 * 8 * 128 * 2                         # bytes per block per tensor (fp16): 32 KiB
TABLES, QUICK_TABLES = [16, 256, 1024], [16, 256]
PAGED, CONTIG, PULL = "kvengine paged", "kvengine contiguous", "kvengine paged pull"
GOALS = {"shm": {P.NIXL: 1.5}, "tcp": {P.NIXL: 1.0}}
VARIANTS = 4                                     # random tables per size, cycled


def burst(nbytes: int) -> int:
    return max(1, min(8, (128 * MiB) // nbytes))


def segments(sb: NDArray[np.int64], db: NDArray[np.int64], pool: int) -> list[tuple[int, int, int]]:
    """The table's segments in one buffer per side (tensor t at t * pool * BLOCK):
    (src offset, dst offset, length), consecutive runs merged, as kvengine plans it."""
    from kvengine.plan import run_arrays
    rs, rd, n = run_arrays(sb, db)
    tb = pool * BLOCK
    base = (np.arange(TENSORS, dtype=np.int64) * tb)[:, None]
    so, do, ln = base + rs * BLOCK, base + rd * BLOCK, np.broadcast_to(n * BLOCK, (TENSORS, rs.size))
    return list(zip(so.ravel().tolist(), do.ravel().tolist(), ln.ravel().tolist()))


async def run(args: argparse.Namespace) -> Report:
    import kvengine as kv
    from kvengine._peer import fill_pattern, row_digests
    T, pool = args.transport, args.pool
    say = print
    out: Report = {"transport": T, "layout": "paged", "pool_blocks": pool, "block_bytes": BLOCK,
                   "ucx_tls": ucx_tls_of(T),
                   "tensors": TENSORS, "tables": [], "peers": {}, "loop": args.loop_name}
    size = TENSORS * pool * BLOCK
    say(f"setup: a {size / 2**30:.1f} GiB cache on each side of each engine ({T}) ...", flush=True)
    t_setup = time.perf_counter()
    pairs, missing = P.start_peers(args.peers, size, T, args.peer_log, say)
    out["peers"] = {n: ("ok" if n in pairs else missing[n]) for n in args.peers}
    kvs = KvSide(T, args.movers, heartbeat_timeout=60.0)
    try:
        await kvs.start()
        e, peer = kvs.started()
        desc = kv.CacheDesc(TENSORS, (pool, *BLOCK_SHAPE), np.float16)
        src = await e.allocate_cache_async(desc)
        for i, t in enumerate(src.tensors):
            fill_pattern(t, 41, i)
        back = await e.allocate_cache_async(desc)   # where the paged pulls land
        dst_id = (await peer.call("alloc", n=TENSORS, shape=[pool, *BLOCK_SHAPE], dtype="float16",
                                  timeout=600))["cache_id"]
        await e.wait_remote_cache(2, dst_id, timeout=60)
        key = kv.BlocksCacheKey(2, dst_id)
        rng = np.random.default_rng(12)
        tabs = {nb: [(rng.permutation(pool)[:nb], rng.permutation(pool)[:nb]) for _ in range(VARIANTS)]
                for nb in args.tables}
        contig = {nb: (np.arange(nb), np.arange(nb)) for nb in args.tables}
        P.prepare_peers(pairs, [(f"p{nb}-{k}", segments(sb, db, pool)) for nb in args.tables
                                for k, (sb, db) in enumerate(tabs[nb])], out, say)

        say(f"setup {time.perf_counter() - t_setup:.1f} s; byte-for-byte check of one table per size ...", flush=True)
        srows = row_digests(src.tensors)
        verify: dict[str, list[bool]] = {}
        for nb in args.tables:
            sb, db = tabs[nb][0]
            await peer.call("zero", cache_id=dst_id, timeout=600)
            await e.push_kv_blocks(src, key, sb, db, timeout=600)
            got = (await peer.call("digest", cache_id=dst_id, timeout=600))["rows"]
            ok = all(got[t][d] == srows[t][s] for t in range(TENSORS) for s, d in zip(sb.tolist(), db.tolist()))
            verify.setdefault(PAGED, []).append(ok)
            if not ok:
                raise RuntimeError(f"kvengine: a pushed table of {nb} blocks differs from the source")
            await e.pull_kv_blocks(key, back, db, sb, timeout=600)   # and back: blocks sb here again
            brows = row_digests(back.tensors)
            ok = all(brows[t][s] == srows[t][s] for t in range(TENSORS) for s in sb.tolist())
            verify.setdefault(PULL, []).append(ok)
            if not ok:
                raise RuntimeError(f"kvengine: a pulled table of {nb} blocks differs from the source")
            segs = segments(sb, db, pool)
            src_ranges, dst_ranges = [[s, n] for s, _, n in segs], [[d, n] for _, d, n in segs]
            await P.check_peers(pairs, lambda pair: pair.verify_ranges(f"p{nb}-0", src_ranges, dst_ranges),
                                f"a table of {nb} blocks", out, verify, say)
        out["verify"] = verify
        configs = [PAGED, CONTIG, PULL] + list(pairs)

        async def measure(name: str, nb: int, rep: int) -> float:
            n = burst(TENSORS * nb * BLOCK)
            if name in (PAGED, CONTIG, PULL):
                push, pull, clock = e.push_kv_blocks, e.pull_kv_blocks, time.perf_counter
                t0 = clock()
                for i in range(n):
                    sb, db = tabs[nb][(rep * n + i) % VARIANTS] if name != CONTIG else contig[nb]
                    if name == PULL:
                        await pull(key, back, db, sb, timeout=600)
                    else:
                        await push(src, key, sb, db, timeout=600)
                return (clock() - t0) / n
            keys = [f"p{nb}-{(rep * n + i) % VARIANTS}" for i in range(n)]
            return await asyncio.to_thread(pairs[name].run, keys, n, True) / n

        # Warm-up, untimed: each configuration moves each of its tables once, so no timed
        # transfer is the first into its pages (the contiguous one reuses its blocks at once).
        say("warm-up: every configuration, every table, once ...", flush=True)
        for nb in args.tables:
            for name in configs:
                for rep in range(-(-VARIANTS // burst(TENSORS * nb * BLOCK))):
                    await measure(name, nb, rep)
        secs: dict[tuple[int, str], list[float]] = {(nb, c): [] for nb in args.tables for c in configs}
        bar = Progress(args.reps * len(args.tables) * len(configs), f"paged {T}")
        snap0 = cpu_snapshot()
        t_meas = time.perf_counter()
        try:
            for rep in range(args.reps):
                for k, nb in enumerate(args.tables):
                    r = (rep + k) % len(configs)
                    for name in configs[r:] + configs[:r]:
                        secs[(nb, name)].append(await measure(name, nb, rep))
                        bar.step(f"rep {rep + 1} {nb} blocks {name}")
        finally:
            bar.close()
        record_timing(out, t_setup, t_meas, snap0, configs)
        for nb in args.tables:
            nbytes = TENSORS * nb * BLOCK
            res: Report = {}
            for name in configs:
                s = secs[(nb, name)]
                g = [nbytes / x / 1e9 for x in s]
                res[name] = {"GBps": nbytes / statistics.median(s) / 1e9, "min_GBps": min(g), "max_GBps": max(g),
                             "per_rep_GBps": g}
            kv_s = secs[(nb, PAGED)]
            over = {name: statistics.median(b / a for a, b in zip(kv_s, secs[(nb, name)]))
                    for name in configs if name not in (PAGED, PULL)}
            pull_over = statistics.median(c / p for p, c in zip(secs[(nb, PULL)], secs[(nb, CONTIG)]))
            out["tables"].append({"blocks": nb, "bytes": nbytes, "segments": TENSORS * nb,
                                  "transfers_per_measurement": burst(nbytes), "results": res, "paged_over": over,
                                  "pull_over_contiguous": pull_over})
        here, there = await kvs.stats()
        out["engine_stats"] = {"prefill": here, "decode": there}
    finally:
        await close_all(kvs, pairs)
    return out


def goals(r: Report) -> list[Report]:
    T, out = r["transport"], []
    by = {t["blocks"]: t for t in r["tables"]}
    if 256 in by:
        x = by[256]["paged_over"][CONTIG]
        out.append({"what": "256 random blocks x 64 tensors >= 0.9x the same bytes contiguous", "ratio": x,
                    "status": "MET" if x >= 0.9 else "NOT MET"})
        for name, want in GOALS.get(T, {}).items():
            if name in by[256]["paged_over"]:
                x = by[256]["paged_over"][name]
                out.append({"what": f"256 blocks >= {want}x {name} (same descriptor list)", "ratio": x,
                            "status": "MET" if x >= want else "NOT MET"})
    if 256 in by and 1024 in by:
        x = by[1024]["paged_over"][CONTIG] / by[256]["paged_over"][CONTIG]
        out.append({"what": "1024 blocks no worse per byte (paged/contiguous at 1024 over that at 256)",
                    "ratio": x, "status": "MET" if x >= 0.95 else "NOT MET"})
    return out


def report(r: Report, reps: int) -> list[str]:
    T, cols = r["transport"], r["columns"]
    others = [c for c in cols if c not in (PAGED, PULL)]
    lines = [f"kvengine bench throughput --layout paged --transport {T}{tls_words(r)}: push_kv_blocks of random tables of a "
             f"vLLM-shaped cache ({TENSORS} tensors x {BLOCK // KiB} KiB blocks, pool {r['pool_blocks']}) into "
             f"another process (and pull_kv_blocks of them back), median GB/s of {reps} interleaved repetitions; "
             f"'x col' = kvengine paged / that column, median of the same repetition's ratio", ""]
    head = ["table", "segments", PAGED] + others + [f"x {c}" for c in others] + [PULL, "pull x contiguous"]
    rows = [[f"{t['blocks']} blocks ({t['bytes'] // MiB} MiB)", str(t["segments"]), gbps(t["results"][PAGED]["GBps"])]
            + [gbps(t["results"][c]["GBps"]) for c in others] + [ratio(t["paged_over"][c]) for c in others]
            + [gbps(t["results"][PULL]["GBps"]), ratio(t["pull_over_contiguous"])]
            for t in r["tables"]]
    lines.append(table(rows, head))
    lines.append("")
    for n, why in r["peers"].items():
        if why != "ok":
            lines.append(f"{n}: {why}")
    for g in goals(r):
        lines.append(f"goal: {g['what']}: {g['ratio']:.2f}x, {g['status']}")
    lines.extend(footer(r))
    return lines


def plot(r: Report, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker as mt
    T, cols, tabs = r["transport"], r["columns"], r["tables"]
    x = [t["blocks"] for t in tabs]
    style: dict[str, dict[str, Any]] = {PAGED: dict(color="tab:blue", lw=2.4, marker="o"),
                                        CONTIG: dict(color="black", ls=":", marker="s"),
                                        PULL: dict(color="tab:purple", ls="--", marker="^"),
                                        P.NIXL: dict(color="tab:green", marker="D"),
                                        P.MOONCAKE: dict(color="tab:orange", marker="v")}
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for c in cols:
        a.plot(x, [t["results"][c]["GBps"] for t in tabs], label=c, **style.get(c, {}))
        a.fill_between(x, [t["results"][c]["min_GBps"] for t in tabs], [t["results"][c]["max_GBps"] for t in tabs],
                       color=style.get(c, {}).get("color"), alpha=0.12)
    for c in cols:
        if c not in (PAGED, PULL):
            b.plot(x, [t["paged_over"][c] for t in tabs], label=f"paged / {c}", **style.get(c, {}))
    b.plot(x, [t["pull_over_contiguous"] for t in tabs], label=f"{PULL} / {CONTIG}", **style[PULL])
    b.axhline(1.0, color="k", lw=0.8)
    b.axhline(0.9, color="tab:blue", lw=0.8, ls="--")
    b.set_yscale("log")
    b.yaxis.set_major_formatter(mt.FuncFormatter(lambda v, _: f"{v:g}x"))
    b.yaxis.set_minor_formatter(mt.FuncFormatter(lambda v, _: f"{v:g}x" if str(v)[0] in "25" else ""))
    for ax, yl, title in ((a, "GB/s (median; band: min..max)", f"push_kv_blocks into another process (and pull_kv_blocks back), {T}"),
                          (b, "ratio (same repetition, median)", "kvengine paged / column (> 1: paged faster)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{n} blocks\n{n * TENSORS * BLOCK // MiB} MiB" for n in x], fontsize=8)
        ax.set_ylabel(yl)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"kvengine bench throughput --layout paged --transport {T}  ({r.get('meta', {}).get('time', '')})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
