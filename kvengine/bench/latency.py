"""Latency: one-layer pushes awaited one at a time, beside baselines and the peer engines.

    kvengine bench latency --transport shm [--quick] [--json PATH] [--out PREFIX]
    kvengine bench latency --transport tcp
    kvengine bench latency --transport ucx --ucx-tls tcp|sm|cma   (kvengine/bench/ucxbench.py)
    kvengine bench latency --layout paged --transport shm|tcp    (kvengine/bench/paged_latency.py)

One layer of a 32-layer model-shaped cache (K + V: 2 x 32 KiB = 64 KiB, cycling
over the layers) pushed from a prefill engine in this process into a decode
engine in a child process with ``await engine.push_kv_cache(...)``, one at a
time; p50/p99/p99.9. Beside it, in the same run, in interleaved rounds (the
order rotates every round):

- shm: memcpy of the same two rows (numpy copyto, one thread);
- tcp: a 64 KiB send + 1-byte ack through a raw socket (sendall / recv_into,
  TCP_NODELAY) and through uvloop streams, to another process;
- NIXL (UCX; ``UCX_TLS=tcp`` for tcp): WRITE of the layer's two descriptors,
  polled until DONE; Mooncake TE (TCP): a batch write of the two, when installed.

``--api sync`` adds the column "kvengine sync": the same push through
``kvengine.sync`` (``SyncKvEngine.push_kv_cache``) from a worker thread, into
the same engine on this loop: the per-call cost of the thread hand-off.

Every sample is one transfer's wall time in the process that issued it. The
ratios are the column's percentile / kvengine's (> 1: kvengine faster).
Writes PREFIX.json and PREFIX.png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import numpy as np
from numpy.typing import NDArray

from . import peers as P
from .baselines import RawSocket, Streams
from .common import (KiB, Report, busy_processes, fmt_seconds, get_runner, interleaved_rounds, meta,
                     save_outputs)
from .harness import KvSide, close_all, footer, latency_results, ratio, table, us
from .throughput import KV, MEMCPY, RAW, STREAMS, add_common_args, col_name, resolve_common

LAYERS = 32
HALF = 32 * KiB                 # K and V of one layer: 2 x 32 KiB = 64 KiB
ROUNDS = 10
KV_SYNC = "kvengine sync"


async def run(args: argparse.Namespace) -> Report:
    T = args.transport
    say = print
    layer_bytes = 2 * HALF
    total = 2 * LAYERS * HALF
    out: Report = {"transport": T, "layer_bytes": layer_bytes, "layers": LAYERS, "loop": args.loop_name}
    t_setup = time.perf_counter()
    say(f"setup: decode engine in a child process ({T}), baselines, peers ...", flush=True)
    pairs, missing = P.start_peers(args.peers, total, T, args.peer_log, say)
    out["peers"] = {n: ("ok" if n in pairs else missing[n]) for n in args.peers}
    for n in P.ENGINES:
        if n not in args.peers:
            out["peers"][n] = "not run (--peers)"
    kvs = KvSide(T, args.movers)
    raw: RawSocket | None = None
    streams: Streams | None = None
    try:
        await kvs.start()
        import kvengine as kv
        out["memory"] = args.memory or "engine"
        src, idx = await kvs.alloc(2 * LAYERS, HALF, seed=5, memory=out["memory"])
        exts = [kv.KvCacheExtParam((i, i), (i, i), 2) for i in range(LAYERS)]
        rows = [t[0] for t in src.tensors]
        dst_rows: list[NDArray[np.uint8]] = []
        if T == "shm":
            dst_rows = [np.ones(HALF, np.uint8) for _ in range(2 * LAYERS)]
        else:
            raw = RawSocket(layer_bytes)
            streams = Streams()
            await streams.connect()
        payload = np.ascontiguousarray(np.concatenate(rows[:2])).data
        plans = [(f"l{i}", [(2 * i * HALF, HALF), ((2 * i + 1) * HALF, HALF)]) for i in range(LAYERS)]
        keys = [k for k, _ in plans]
        P.prepare_peers(pairs, plans, out, say)
        await P.check_peers(pairs, lambda pair: pair.verify(keys, 2 * HALF), "the layer", out, {}, say)
        if not await kvs.verify(src, idx):
            raise RuntimeError("kvengine: pushed cache differs from the source")

        engine, _ = kvs.started()
        push, clock = engine.push_kv_cache, time.perf_counter

        async def kv_samples(n: int) -> list[float]:
            s = []
            for i in range(n):
                t0 = clock()
                await push(src, idx, 0, ext_param=exts[i % LAYERS], timeout=10)
                s.append(clock() - t0)
            return s

        def memcpy_samples(n: int) -> list[float]:
            s = []
            for i in range(n):
                a, b = 2 * (i % LAYERS), 2 * (i % LAYERS) + 1
                t0 = clock()
                np.copyto(dst_rows[a], rows[a])
                np.copyto(dst_rows[b], rows[b])
                s.append(clock() - t0)
            return s

        sync_engine = None
        if args.api == "sync":
            from ..sync import SyncKvEngine
            sync_engine = SyncKvEngine.wrap(engine, asyncio.get_running_loop())

        def sync_samples(n: int) -> list[float]:
            assert sync_engine is not None
            spush, s = sync_engine.push_kv_cache, []
            for i in range(n):
                t0 = clock()
                spush(src, idx, 0, ext_param=exts[i % LAYERS], timeout=10)
                s.append(clock() - t0)
            return s

        async def streams_samples(n: int) -> list[float]:
            assert streams is not None   # a tcp column
            return [await streams.send(payload) for _ in range(n)]

        async def samples(name: str, n: int) -> list[float]:
            if name == KV:
                return await kv_samples(n)
            if name == KV_SYNC:
                return await asyncio.to_thread(sync_samples, n)
            if name == MEMCPY:
                return memcpy_samples(n)
            if name == RAW:
                assert raw is not None   # a tcp column
                sock = raw
                return await asyncio.to_thread(lambda: [sock.send(payload) for _ in range(n)])
            if name == STREAMS:
                return await streams_samples(n)
            return await asyncio.to_thread(pairs[name].run, keys, n)

        configs = [KV] + ([KV_SYNC] if sync_engine is not None else []) + ([MEMCPY] if T == "shm" else [RAW, STREAMS]) + list(pairs)
        per = max(1, args.n // ROUNDS)
        say(f"setup {time.perf_counter() - t_setup:.1f} s; measuring: {len(configs)} columns x {ROUNDS} rounds x "
            f"{per} samples, interleaved (columns: {', '.join(col_name(n, T) for n in configs)})", flush=True)

        async def round_of(name: str, r: int) -> list[float]:
            await samples(name, 200 if r == 0 else 20)          # warm-up
            return list(await samples(name, per))

        lat = await interleaved_rounds(out, t_setup, configs, ROUNDS, f"latency {T}", round_of)
        latency_results(out, lat, KV)
        here, there = await kvs.stats()
        out["engine_stats"] = {"prefill": here, "decode": there}
        out["peer_env"] = {n: p.env for n, p in pairs.items()}
    finally:
        await close_all(kvs, pairs, raw, streams)
    return out


def report(r: Report) -> list[str]:
    T = r["transport"]
    res, cols = r["results"], r["columns"]
    tls = f" (UCX_TLS={r['ucx_tls']}; kvengine's caches: {r.get('memory', 'numpy')} memory)" if "ucx_tls" in r else \
        (" --memory numpy (register_kv_cache of numpy arrays)" if r.get("memory") == "numpy" else "")
    lines = [f"kvengine bench latency --transport {T}{tls}: one-layer push (K + V = 2 x 32 KiB = 64 KiB), awaited one "
             f"at a time, {res[KV]['n']} samples per column in {ROUNDS} interleaved rounds ({r['loop']} here); "
             f"'x kv' = that column's percentile / kvengine's (> 1: kvengine faster)", ""]
    what = {KV: "push_kv_cache into another process",
            KV_SYNC: "SyncKvEngine.push_kv_cache from a thread, same engine", MEMCPY: "np.copyto of the 2 rows, this process",
            RAW: "64 KiB sendall + 1-byte ack", STREAMS: "64 KiB write/drain + 1-byte ack",
            P.NIXL: "WRITE of 2 descriptors, until DONE", P.MOONCAKE: "batch write of 2, sync (local completion)"}
    rows = []
    for c in cols:
        s = res[c]
        x = r["kv_over"].get(c)
        rows.append([col_name(c, T), us(s["p50_us"]), us(s["p99_us"]), us(s["p999_us"]), us(s["max_us"]),
                     ratio(x["p50_us"]) if x else "", ratio(x["p99_us"]) if x else "",
                     ratio(x["p999_us"]) if x else "", what.get(c, "")])
    for n in P.ENGINES:
        if n not in cols:
            rows.append([col_name(n, T), "-", "-", "-", "-", "", "", "", r["peers"].get(n, "")])
    lines.append(table(rows, ["column", "p50 us", "p99 us", "p99.9 us", "max us", "x kv p50", "x kv p99",
                              "x kv p99.9", "what"], align="lrrrrrrrl"))
    if r.get("load"):
        lines.append("")
    lines.extend(footer(r))
    return lines


def plot(r: Report, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    T = r["transport"]
    color = {KV: "tab:blue", KV_SYNC: "tab:purple", MEMCPY: "grey", RAW: "grey", STREAMS: "tab:brown", P.NIXL: "tab:green",
             P.MOONCAKE: "tab:orange", "kvengine tcp": "tab:purple", "UCXX": "tab:red"}
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    ax = axes[0]
    for c in r["columns"]:
        s = r["samples_us"][c]
        res = r["results"][c]
        ax.plot(s, np.linspace(0, 1, len(s)), color=color.get(c), lw=2.4 if c == KV else 1.4,
                ls=":" if c in (MEMCPY, RAW) else "-",
                label=f"{col_name(c, T)}: p50 {us(res['p50_us'])}, p99 {us(res['p99_us'])} us")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("64 KiB one-layer transfer, awaited one at a time (us)")
    ax.set_ylabel("CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"latency, {T}", fontsize=10)
    ax = axes[1]
    cols = r["columns"]
    qs = ("p50_us", "p99_us", "p999_us")
    w = 0.8 / len(cols)
    for i, c in enumerate(cols):
        ax.bar(np.arange(3) + (i - (len(cols) - 1) / 2) * w, [r["results"][c][q] for q in qs], w,
               color=color.get(c), label=col_name(c, T), hatch="//" if c in (MEMCPY, RAW) else None)
    ax.set_xticks(range(3), ["p50", "p99", "p99.9"])
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    ax.set_ylabel("us")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"kvengine bench latency --transport {T}  ({r.get('meta', {}).get('time', '')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    layout = argparse.ArgumentParser(add_help=False)
    layout.add_argument("--layout", choices=["rows", "paged"], default="rows")
    if layout.parse_known_args(sys.argv[1:] if argv is None else argv)[0].layout == "paged":
        from . import paged_latency   # one layer of a 64-block request beside the same bytes contiguous
        return paged_latency.main(argv)
    ap = argparse.ArgumentParser(prog="kvengine bench latency", description=__doc__.split("\n")[0],
                                 epilog="Peers: pip install -e '.[peers]' or benchmarks/install_peers.sh; see docs/benchmarks.md.")
    add_common_args(ap, "latency")
    ap.add_argument("--layout", choices=["rows", "paged"], default="rows",
                    help="paged: one layer of a 64-block request, push_kv_blocks vs contiguous "
                         "(kvengine/bench/paged_latency.py)")
    ap.add_argument("--api", choices=["async", "sync"], default="async",
                    help="sync: add a column pushing through kvengine.sync from a worker thread")
    ap.add_argument("--n", type=int, default=None, help="samples per column (default 50000, --quick 3000)")
    args = ap.parse_args(argv)
    resolve_common(ap, args, "latency")
    args.n = args.n or (3000 if args.quick else 50000)
    args.loop_name, runner = get_runner(args.loop)
    busy = busy_processes()
    if busy:
        print("warning: the machine is not idle; figures will be depressed and noisier:\n  " + "\n  ".join(busy))
    t0 = time.perf_counter()
    if args.transport == "ucx":
        from . import ucxbench
        r = runner(ucxbench.run_latency(args))
    else:
        r = runner(run(args))
    r["meta"] = meta(argv)
    r["meta"]["wall_s"] = time.perf_counter() - t0
    print()
    lines = report(r)
    if r["transport"] == "ucx":
        from .ucxbench import latency_lines
        lines += latency_lines(r)
    print("\n".join(lines))
    print(f"total {fmt_seconds(r['meta']['wall_s'])}")
    r["report"] = lines
    slim = {k: v for k, v in r.items() if k != "samples_us"}   # the plot needs them, the JSON not
    wrote = save_outputs(args.json_path, args.png_path, slim, plot, r)
    print(wrote + (f" (peer engines' logs: {args.peer_log})" if os.path.exists(args.peer_log) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
