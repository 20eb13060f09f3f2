"""Head-split throughput: ``kvengine bench throughput --layout paged --head-split N``.

    kvengine bench throughput --layout paged --head-split 2 --transport shm|tcp [--quick] [--tables 256]

Disaggregated serving at different tensor-parallel sizes (issue 12): a TP=1
prefill engine here holds a vLLM-shaped cache (64 tensors: 32 layers x K, V;
16-token blocks of 8 KV heads x 128 dims, fp16: 32 KiB per block per tensor,
``head_axis=2``); N TP=N decode ranks' caches in a child process hold 8/N heads
per block. Per table size, in the same run, interleaved repetition by
repetition with the order rotating:

- head-split: a random table (numpy int64 arrays) pushed to every rank with
  its head range (``KvCacheExtParam(src_head_range=...)``), the N pushes
  concurrent: one 2-D segment per block and tensor per rank (16 rows of
  ``2 * 128 * 8 / N`` bytes);
- gather: N TP=N prefill ranks' caches here (each holding its heads of the
  same blocks) push into a TP=1 cache there, each with its
  ``dst_head_range``, concurrently;
- contiguous: the same bytes, blocks 0..n-1 -> 0..n-1 of a TP=1 cache there
  (one segment per tensor);
- pull: as a decode rank would, the N TP=N caches here pull their heads of a
  table of the TP=1 cache there (``src_head_range``), concurrently.

Before timing, each rank's blocks are checked byte for byte against numpy
slicing of the source (``src[t][blocks][:, :, h0:h1]``), and the gathered TP=1
blocks against the source's. Reported: median GB/s of the table's bytes (1e9
B/s) and the medians of the per-repetition ratios to contiguous. Goal (issue
12): head-split >= 0.7x.

Each block's head range is one 2-D segment (rows x stride) that the movers,
TCP DATAV frames and READ(V)s of rows, and UCX PUSH2D and PULL_REQ2D messages carry
natively (decisions.md #38).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

from .common import MiB, Progress, Report, cpu_snapshot, record_timing
from .harness import KvSide, footer, gbps, ratio, table, tls_words, ucx_tls_of

TENSORS, TOKENS, HEADS, DIM = 64, 16, 8, 128
BLOCK = TOKENS * HEADS * DIM * 2
TABLES, QUICK_TABLES = [256], [64]
SPLIT, GATHER, CONTIG, PULL = "head-split", "gather", "contiguous", "pull"
VARIANTS = 4


async def run(args: argparse.Namespace) -> Report:
    import kvengine as kv
    from kvengine._peer import fill_pattern, row_digests
    T, pool, N = args.transport, args.pool, args.head_split
    if HEADS % N:
        raise SystemExit(f"--head-split must divide the {HEADS} KV heads")
    out: Report = {"transport": T, "layout": "paged", "head_split": N, "pool_blocks": pool, "block_bytes": BLOCK,
                   "ucx_tls": ucx_tls_of(T),
                   "tensors": TENSORS, "tables": [], "loop": args.loop_name}
    t_setup = time.perf_counter()
    kvs = KvSide(T, args.movers, heartbeat_timeout=60.0)
    try:
        await kvs.start()
        e, peer = kvs.started()
        src = await e.allocate_cache_async(kv.CacheDesc(TENSORS, (pool, TOKENS, HEADS, DIM), np.float16, head_axis=2))
        for i, t in enumerate(src.tensors):
            fill_pattern(t, 43, i)
        ranks = [(await peer.call("alloc", n=TENSORS, shape=[pool, TOKENS, HEADS // N, DIM], head_axis=2,
                                  timeout=600))["cache_id"] for _ in range(N)]
        whole = (await peer.call("alloc", n=TENSORS, shape=[pool, TOKENS, HEADS, DIM], head_axis=2,
                                 timeout=600))["cache_id"]
        for c in (*ranks, whole):
            await e.wait_remote_cache(2, c, timeout=60)
        heads = [range(r * HEADS // N, (r + 1) * HEADS // N) for r in range(N)]
        exts = [kv.KvCacheExtParam(src_head_range=h) for h in heads]
        gexts = [kv.KvCacheExtParam(dst_head_range=h) for h in heads]
        parts = []   # the TP=N prefill ranks: their heads of every block of the source
        for h in heads:
            part = await e.allocate_cache_async(kv.CacheDesc(TENSORS, (pool, TOKENS, HEADS // N, DIM), np.float16,
                                                             head_axis=2))
            for t, whole_t in zip(part.tensors, src.tensors):
                t[...] = whole_t[:, :, h.start:h.stop]
            parts.append(part)
        rng = np.random.default_rng(13)
        tabs = {nb: [(rng.permutation(pool)[:nb], rng.permutation(pool)[:nb]) for _ in range(VARIANTS)]
                for nb in args.tables}
        verify, gathered, pulled = [], [], []
        for nb in args.tables:
            sb, db = tabs[nb][0]
            for r, c in enumerate(ranks):
                await e.push_kv_blocks(src, kv.BlocksCacheKey(2, c), sb, db, exts[r], timeout=600)
                got = (await peer.call("digest", cache_id=c, timeout=600))["rows"]
                want = row_digests([np.ascontiguousarray(t[sb][:, :, heads[r].start:heads[r].stop])
                                    for t in src.tensors])
                ok = [[got[t][d] for d in db.tolist()] for t in range(TENSORS)] == want
                verify.append(ok)
                if not ok:
                    raise RuntimeError(f"kvengine: rank {r}'s heads of a table of {nb} blocks differ from the source")
            await peer.call("zero", cache_id=whole, timeout=600)
            for r, part in enumerate(parts):
                await e.push_kv_blocks(part, kv.BlocksCacheKey(2, whole), sb, db, gexts[r], timeout=600)
            got = (await peer.call("digest", cache_id=whole, timeout=600))["rows"]
            gathered.append([[got[t][d] for d in db.tolist()] for t in range(TENSORS)]
                            == row_digests([np.ascontiguousarray(t[sb]) for t in src.tensors]))
            if not gathered[-1]:
                raise RuntimeError(f"kvengine: the gathered blocks of a table of {nb} blocks differ from the source")
            # the TP=N caches here pull their heads of `whole`'s blocks db (the source's sb) back into sb
            for part in parts:
                for t in part.tensors:
                    t[sb] = 0
            for r, part in enumerate(parts):
                await e.pull_kv_blocks(kv.BlocksCacheKey(2, whole), part, db, sb, exts[r], timeout=600)
            pulled.append(all(np.array_equal(t[sb].view(np.uint16), w[sb][:, :, h.start:h.stop].view(np.uint16))
                              for part, h in zip(parts, heads) for t, w in zip(part.tensors, src.tensors)))
            if not pulled[-1]:
                raise RuntimeError(f"kvengine: the pulled heads of a table of {nb} blocks differ from the source")
        out["verify"] = {SPLIT: verify, GATHER: gathered, PULL: pulled}

        async def measure(name: str, nb: int, rep: int) -> float:
            n = max(1, min(8, (128 * MiB) // (TENSORS * nb * BLOCK)))
            t0 = time.perf_counter()
            for i in range(n):
                if name == SPLIT:
                    sb, db = tabs[nb][(rep * n + i) % VARIANTS]
                    ts = [e.submit_push_kv_blocks(src, kv.BlocksCacheKey(2, c), sb, db, exts[r], timeout=600)
                          for r, c in enumerate(ranks)]
                    sts = await asyncio.gather(*ts)
                elif name == PULL:
                    sb, db = tabs[nb][(rep * n + i) % VARIANTS]
                    ts = [e.submit_pull_kv_blocks(kv.BlocksCacheKey(2, whole), part, db, sb, exts[r], timeout=600)
                          for r, part in enumerate(parts)]
                    sts = await asyncio.gather(*ts)
                elif name == GATHER:
                    sb, db = tabs[nb][(rep * n + i) % VARIANTS]
                    ts = [e.submit_push_kv_blocks(part, kv.BlocksCacheKey(2, whole), sb, db, gexts[r], timeout=600)
                          for r, part in enumerate(parts)]
                    sts = await asyncio.gather(*ts)
                else:
                    blocks = np.arange(nb)
                    sts = [await e.submit_push_kv_blocks(src, kv.BlocksCacheKey(2, whole), blocks, blocks, timeout=600)]
                if any(s != kv.LLMStatusCode.LLM_SUCCESS for s in sts):
                    raise RuntimeError(f"{name}: {sts}")
            return (time.perf_counter() - t0) / n

        configs = [SPLIT, GATHER, CONTIG, PULL]
        secs: dict[tuple[int, str], list[float]] = {(nb, c): [] for nb in args.tables for c in configs}
        bar = Progress(args.reps * len(args.tables) * len(configs), f"head-split {T}")
        snap0, t_meas = cpu_snapshot(), time.perf_counter()
        try:
            for rep in range(args.reps):
                for nb in args.tables:
                    for name in configs[rep % 4:] + configs[:rep % 4]:
                        secs[(nb, name)].append(await measure(name, nb, rep))
                        bar.step(f"rep {rep + 1} {nb} blocks {name}")
        finally:
            bar.close()
        record_timing(out, t_setup, t_meas, snap0, configs)
        for nb in args.tables:
            nbytes = TENSORS * nb * BLOCK
            res = {c: {"GBps": nbytes / statistics.median(secs[(nb, c)]) / 1e9,
                       "per_rep_GBps": [nbytes / x / 1e9 for x in secs[(nb, c)]]} for c in configs}
            over = {c: statistics.median(x / s for s, x in zip(secs[(nb, c)], secs[(nb, CONTIG)]))
                    for c in (SPLIT, GATHER, PULL)}
            out["tables"].append({"blocks": nb, "bytes": nbytes, "segments_2d": TENSORS * nb * N,
                                  "rows": TENSORS * nb * N * TOKENS, "results": res,
                                  "split_over_contiguous": over[SPLIT], "gather_over_contiguous": over[GATHER],
                                  "pull_over_contiguous": over[PULL]})
        here, there = await kvs.stats()
        out["engine_stats"] = {"prefill": here, "decode": there}
    finally:
        await kvs.close()
    return out


def goals(r: Report) -> list[Report]:
    return [{"what": f"{t['blocks']} blocks, TP=1 -> {r['head_split']} TP={r['head_split']} ranks (heads split) "
                     ">= 0.7x the same bytes contiguous", "ratio": t["split_over_contiguous"],
             "status": "MET" if t["split_over_contiguous"] >= 0.7 else "NOT MET"} for t in r["tables"]]


def report(r: Report, reps: int) -> list[str]:
    N, T = r["head_split"], r["transport"]
    lines = [f"kvengine bench throughput --layout paged --head-split {N} --transport {T}{tls_words(r)}: push_kv_blocks of random "
             f"tables of a TP=1 vLLM-shaped cache ({TENSORS} tensors x {BLOCK // 1024} KiB blocks of {HEADS} heads) "
             f"into {N} TP={N} ranks' caches in another process, each its {HEADS // N} heads, beside the same bytes "
             f"contiguous (and pulled back by {N} TP={N} caches here); median GB/s of {reps} interleaved repetitions, "
             "ratio: median of the same repetition's",
             ""]
    rows = [[f"{t['blocks']} blocks ({t['bytes'] // MiB} MiB)", str(t["segments_2d"]), str(t["rows"]),
             gbps(t["results"][SPLIT]["GBps"]), gbps(t["results"][GATHER]["GBps"]), gbps(t["results"][CONTIG]["GBps"]),
             ratio(t["split_over_contiguous"]), ratio(t["gather_over_contiguous"]),
             gbps(t["results"][PULL]["GBps"]), ratio(t["pull_over_contiguous"])]
            for t in r["tables"]]
    lines.append(table(rows, ["table", "2-D segments", "rows", SPLIT, GATHER, CONTIG, "split x contiguous",
                              "gather x contiguous", PULL, "pull x contiguous"]))
    lines.append("")
    paired = r.get("engine_stats", {}).get("prefill", {}).get("native", {}).get("chunks_paired")
    if paired is not None and T == "shm":
        lines.append(f"the movers copied {paired} chunks as head-split pairs, both ranks' heads of a source row in one "
                     "pass (decisions.md #37)")
    for g in goals(r):
        lines.append(f"goal: {g['what']}: {g['ratio']:.2f}x, {g['status']}")
    lines.extend(footer(r))
    return lines


def plot(r: Report, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    tabs = r["tables"]
    x = np.arange(len(tabs))
    for k, (c, color) in enumerate(((SPLIT, "tab:blue"), (GATHER, "tab:green"), (CONTIG, "black"),
                                    (PULL, "tab:orange"))):
        style: dict[str, Any] = {"color": color, "alpha": 0.8}
        ax.bar(x + (k - 1.5) * 0.2, [t["results"][c]["GBps"] for t in tabs], 0.2, label=c, **style)
    for i, t in enumerate(tabs):
        ax.annotate(f"split {t['split_over_contiguous']:.2f}x, gather {t['gather_over_contiguous']:.2f}x, "
                    f"pull {t['pull_over_contiguous']:.2f}x",
                    (i, max(t["results"][c]["GBps"] for c in (SPLIT, GATHER, CONTIG, PULL))), ha="center",
                    va="bottom")
    ax.set_xticks(x, [f"{t['blocks']} blocks" for t in tabs])
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"TP=1 <-> {r['head_split']} x TP={r['head_split']}: head-split, gather, pull, {r['transport']}",
                 fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
