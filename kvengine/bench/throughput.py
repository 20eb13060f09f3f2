"""Throughput: kvengine push beside memcpy / raw sockets / uvloop streams and the peer engines.

    kvengine bench throughput --transport shm [--quick] [--json PATH] [--out PREFIX]
    kvengine bench throughput --transport tcp
    kvengine bench throughput --transport ucx --ucx-tls tcp|sm|cma   (kvengine/bench/ucxbench.py)
    kvengine bench throughput --layout paged --transport shm|tcp   (block tables: kvengine/bench/paged.py)

Row 0 of a model-shaped cache (one (1, row) tensor per K and V of each layer)
is pushed from a prefill engine in this process into a decode engine in a child
process, over ``--transport`` (shm: the decode engine's memfd cache mapped here,
copied by the movers; tcp: forced TCP on loopback), at sizes from one layer
(2 x 32 KiB) to a whole cache (64 x 4 MiB = 256 MiB). Beside it, in the same
run, interleaved repetition by repetition (the order rotates every time):

- shm: memcpy of the same rows (numpy copyto into pre-faulted buffers), on one thread
  and split over two threads (kvengine copies with 2 mover threads by default);
- tcp: a raw socket (sendall of each row, recv_into a pre-faulted buffer in another
  process, 1-byte ack) and uvloop streams (write + drain of each row; a uvloop
  process reading with limit 4 MiB, readexactly 1 MiB; 1-byte ack);
- NIXL 1.5.1 (UCX, two agents in two processes, DRAM WRITE of one descriptor per
  tensor, progress thread off; ``UCX_TLS=tcp`` for tcp) and Mooncake Transfer
  Engine (TCP, P2PHANDSHAKE on 127.0.0.1, one batch entry per tensor), when
  installed (``.[peers]`` or ``benchmarks/install_peers.sh``); otherwise their columns say so.

Every figure is end to end, one transfer awaited at a time (small sizes: a burst
of back-to-back transfers per measurement). Reported: median GB/s (1e9 B/s) per
size, and the ratio kvengine / each column, the median over repetitions of the
same repetition's ratio. Goals at 256 MiB: >= 1.5x NIXL same host (shm), >= 1.0x
NIXL and >= 1.5x Mooncake over tcp. Writes PREFIX.json and PREFIX.png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Coroutine

import numpy as np
from numpy.typing import NDArray

from . import peers as P
from .baselines import ParallelMemcpy, RawSocket, Streams, memcpy_seconds
from .common import (KiB, MiB, Report, busy_processes, fmt_bytes, fmt_seconds, get_runner, interleaved_sizes, meta,
                     out_paths, parse_bytes, save_outputs)
from .harness import MODEL, TRANSPORTS, KvSide, close_all, footer, gbps, model_label, ratio, table

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.ticker import Formatter

    from kvengine import Cache, CacheIndex

KV = "kvengine"
MEMCPY, MEMCPY2, RAW, STREAMS = "memcpy", "memcpy 2 threads", "raw socket", "uvloop streams"
SIZES = [(2, 32 * KiB), (2, 512 * KiB), (64, 64 * KiB), (64, 256 * KiB), (64, 1 * MiB), (64, 4 * MiB)]
QUICK_SIZES = [(2, 32 * KiB), (64, 256 * KiB), (64, 4 * MiB)]
GOALS = {"shm": {P.NIXL: 1.5}, "tcp": {P.NIXL: 1.0, P.MOONCAKE: 1.5}, "ucx": {P.NIXL: 1.0}}
BURST_BYTES = 16 * MiB            # small sizes: transfers per measurement = BURST_BYTES / size (<= 200)


def burst(nbytes: int) -> int:
    return max(1, min(200, BURST_BYTES // nbytes))


@dataclass
class _Case:
    """One size: kvengine pushes row 0 of ``src``; memcpy/raw/streams send the same rows."""
    tensors: int
    row: int
    src: Cache
    idx: CacheIndex
    rows: list[NDArray[Any]]             # row 0 of each tensor of src
    n: int                               # transfers per measurement
    key: str                             # the peers' name of this size's plan
    views: list[memoryview] = field(default_factory=list)
    memcpy_dst: list[NDArray[np.uint8]] = field(default_factory=list)   # shm: pre-faulted

    @property
    def nbytes(self) -> int:
        return self.tensors * self.row


def col_name(name: str, transport: str) -> str:
    if name == STREAMS:
        import importlib.util
        return STREAMS if importlib.util.find_spec("uvloop") else "asyncio streams"
    if name == P.NIXL:
        return "NIXL (UCX tcp)" if transport == "tcp" else "NIXL (UCX)"
    if name == P.MOONCAKE:
        return "Mooncake (tcp)"
    return name


async def run(args: argparse.Namespace) -> Report:
    T = args.transport
    sizes = args.sizes
    max_bytes = max(t * r for t, r in sizes)
    say = print
    out: Report = {"transport": T, "sizes": [], "peers": {}, "loop": args.loop_name, "memory": args.memory or "engine"}
    t_setup = time.perf_counter()
    say(f"setup: decode engine in a child process ({T}), baselines, peers ...", flush=True)

    # peers first (their processes allocate and register max_bytes on each side)
    pairs, missing = P.start_peers(args.peers, max_bytes, T, args.peer_log, say)
    out["peers"] = {n: ("ok" if n in pairs else missing[n]) for n in args.peers}
    for n in P.ENGINES:
        if n not in args.peers:
            out["peers"][n] = "not run (--peers)"
    kvs = KvSide(T, args.movers)
    raw: RawSocket | None = None
    streams: Streams | None = None
    pmemcpy: ParallelMemcpy | None = None
    try:
        await kvs.start()
        if T == "shm":
            pmemcpy = ParallelMemcpy(2)
        if T == "tcp":
            raw = RawSocket(max_bytes)
            streams = Streams()
            await streams.connect()
        # one source cache per size (kvengine pushes row 0 of it; memcpy/raw/streams send the same rows)
        cases: list[_Case] = []
        for k, (tensors, row) in enumerate(sizes):
            src, idx = await kvs.alloc(tensors, row, seed=11 + k, memory=args.memory or "engine")
            case = _Case(tensors, row, src, idx, [t[0] for t in src.tensors], burst(tensors * row), f"s{k}")
            case.views = [r.data for r in case.rows]
            if T == "shm":
                case.memcpy_dst = [np.ones(row, np.uint8) for _ in range(tensors)]   # pre-faulted
            cases.append(case)
        plans = [(c.key, [(i * c.row, c.row) for i in range(c.tensors)]) for c in cases]
        P.prepare_peers(pairs, plans, out, say)

        # warm-up, and every engine's transfer checked byte for byte at every size
        say(f"setup {time.perf_counter() - t_setup:.1f} s; warm-up and byte-for-byte check ...", flush=True)
        verify: dict[str, list[bool]] = {}
        for c in cases:
            ok = await kvs.verify(c.src, c.idx)
            verify.setdefault(KV, []).append(ok)
            if not ok:
                raise RuntimeError(f"kvengine: pushed {model_label(c.tensors, c.row)} differs from the source")
            await P.check_peers(pairs, lambda pair: pair.verify(c.key, c.nbytes),
                                f"transfer of {fmt_bytes(c.nbytes)}", out, verify, say)
            if pmemcpy is not None:   # shm
                memcpy_seconds(c.rows, c.memcpy_dst)
                pmemcpy.seconds(c.rows, c.memcpy_dst)
            elif raw is not None and streams is not None:   # tcp
                await asyncio.to_thread(raw.send, c.views)
                await streams.send(c.views)
        out["verify"] = verify

        configs = [KV] + ([MEMCPY, MEMCPY2] if T == "shm" else [RAW, STREAMS]) + list(pairs)

        async def measure(name: str, c: _Case) -> float:
            """Seconds per transfer, over a burst of c.n back-to-back transfers."""
            n = c.n
            s: float
            if name == KV:
                s = await kvs.push_seconds(c.src, c.idx, n)
            elif name == MEMCPY:
                s = sum(memcpy_seconds(c.rows, c.memcpy_dst) for _ in range(n))
            elif name == MEMCPY2:
                assert pmemcpy is not None   # an shm column
                pm = pmemcpy
                s = sum(pm.seconds(c.rows, c.memcpy_dst) for _ in range(n))
            elif name == RAW:
                assert raw is not None   # a tcp column
                sock = raw
                s = await asyncio.to_thread(lambda: sum(sock.send(c.views) for _ in range(n)))
            elif name == STREAMS:
                assert streams is not None   # a tcp column
                s = 0.0
                for _ in range(n):
                    s += await streams.send(c.views)
            else:
                s = await asyncio.to_thread(pairs[name].run, c.key, n, True)
            return s / n

        say(f"measuring: {len(configs)} columns x {len(cases)} sizes x {args.reps} repetitions, interleaved "
            f"(columns: {', '.join(col_name(n, T) for n in configs)})", flush=True)
        secs = await interleaved_sizes(out, t_setup, configs, cases, args.reps, f"throughput {T}", measure)

        for k, c in enumerate(cases):
            res: Report = {}
            for name in configs:
                s = secs[(k, name)]
                g = [c.nbytes / x / 1e9 for x in s]
                res[name] = {"GBps": c.nbytes / statistics.median(s) / 1e9, "min_GBps": min(g),
                             "max_GBps": max(g), "per_rep_GBps": g, "s_per_transfer": s}
            kv_s = secs[(k, KV)]
            ratios = {name: statistics.median(b / a for a, b in zip(kv_s, secs[(k, name)]))
                      for name in configs if name != KV}
            out["sizes"].append({"tensors": c.tensors, "row_bytes": c.row, "bytes": c.nbytes,
                                 "transfers_per_measurement": c.n, "results": res, "kv_over": ratios})
        here, there = await kvs.stats()
        out["engine_stats"] = {"prefill": here, "decode": there}
        eo = kvs.options
        out["engine_options"] = {k: getattr(eo, k) for k in eo.__slots__ if k != "secret"}
        out["peer_env"] = {n: p.env for n, p in pairs.items()}
    finally:
        await close_all(kvs, pairs, raw, streams, pmemcpy)
    return out


def goals(r: Report) -> list[Report]:
    T = r["transport"]
    model = next((s for s in r["sizes"] if (s["tensors"], s["row_bytes"]) == MODEL), None)
    out: list[Report] = []
    for name, want in GOALS[T].items():
        g: Report = {"what": f"kvengine >= {want}x {col_name(name, T)} at {model_label(*MODEL)}", "goal": want,
             "peer": name}
        if model is None:
            g["status"] = "not measured (size not in this run)"
        elif name not in model["kv_over"]:
            g["status"] = f"not measured ({r['peers'].get(name, 'not run')})"
        else:
            g["ratio"] = model["kv_over"][name]
            g["met"] = g["ratio"] >= want
            g["status"] = "MET" if g["met"] else "NOT MET"
        out.append(g)
    return out


def report(r: Report, reps: int) -> list[str]:
    T = r["transport"]
    cols = r["columns"]
    others = [c for c in cols if c != KV]
    absent = [n for n in P.ENGINES if n not in cols]
    tls = f" (UCX_TLS={r['ucx_tls']}; kvengine's caches: {r.get('memory', 'numpy')} memory)" if "ucx_tls" in r else \
        (" --memory numpy (register_kv_cache of numpy arrays)" if r.get("memory") == "numpy" else "")
    lines = [f"kvengine bench throughput --transport {T}{tls}: push of row 0 of a model-shaped cache into a decode "
             f"engine in another process ({r['loop']} here), median GB/s (1e9 B/s) of {reps} interleaved "
             f"repetitions; 'x col' = kvengine / that column, the median over repetitions of the same "
             f"repetition's ratio (> 1: kvengine faster)", ""]
    head = ["size (tensors x row)", KV] + [col_name(c, T) for c in others] + \
           [col_name(n, T) for n in absent] + [f"x {col_name(c, T)}" for c in others]
    rows = []
    for s in r["sizes"]:
        res = s["results"]
        rows.append([model_label(s["tensors"], s["row_bytes"]), gbps(res[KV]["GBps"])]
                    + [gbps(res[c]["GBps"]) for c in others]
                    + [r["peers"].get(n, "-") for n in absent]
                    + [ratio(s["kv_over"][c]) for c in others])
    lines.append(table(rows, head))
    lines.append("")
    for g in goals(r):
        lines.append(f"goal: {g['what']}: " + (f"{g['ratio']:.2f}x, {g['status']}" if "ratio" in g else g["status"]))
    lines.extend(footer(r))
    return lines


def plot(r: Report, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker as mt
    T = r["transport"]
    cols = r["columns"]
    num = mt.FuncFormatter(lambda v, _: f"{v:g}")
    times = mt.FuncFormatter(lambda v, _: f"{v:g}x")
    sizes = r["sizes"]
    x = [s["bytes"] for s in sizes]

    def axis(ax: Axes, fmt: Formatter, ylabel: str, title: str) -> None:
        """Both panels: log-log over the sizes, labelled by shape."""
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(x, [model_label(s["tensors"], s["row_bytes"]).replace(" (", "\n(") for s in sizes], fontsize=7)
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_formatter(fmt if ax.get_ylim()[1] / ax.get_ylim()[0] < 20 else mt.NullFormatter())
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    ax = axes[0]
    style: dict[str, dict[str, Any]] = {KV: dict(color="tab:blue", lw=2.4, marker="o"), MEMCPY: dict(color="grey", ls=":", marker="s"),
             MEMCPY2: dict(color="black", ls=":", marker="x"),
             RAW: dict(color="grey", ls="--", marker="s"), STREAMS: dict(color="tab:brown", ls=":", marker="^"),
             P.NIXL: dict(color="tab:green", marker="D"), P.MOONCAKE: dict(color="tab:orange", marker="v"),
             "kvengine tcp": dict(color="tab:purple", ls="--", marker="o"), "UCXX": dict(color="tab:red", marker="^"),
             "ucx_perftest": dict(color="black", ls=":", marker="x")}
    for c in cols:
        y = [s["results"][c]["GBps"] for s in sizes]
        lo = [s["results"][c]["min_GBps"] for s in sizes]
        hi = [s["results"][c]["max_GBps"] for s in sizes]
        ax.plot(x, y, label=col_name(c, T), **style.get(c, {}))
        ax.fill_between(x, lo, hi, color=style.get(c, {}).get("color"), alpha=0.12)
    axis(ax, num, "GB/s (median; band: min..max)", f"push into another process, {T}: kvengine vs baselines and peers")
    ax = axes[1]
    for c in cols:
        if c == KV:
            continue
        ax.plot(x, [s["kv_over"][c] for s in sizes], label=f"kvengine / {col_name(c, T)}", **style.get(c, {}))
    ax.axhline(1.0, color="k", lw=0.8)
    for g in goals(r):
        if g["peer"] in cols:
            ax.plot([MODEL[0] * MODEL[1]], [g["goal"]], marker="_", ms=30, mew=2.5,
                    color=style[g["peer"]]["color"])
            ax.annotate(f"goal >= {g['goal']}x {g['peer']}", (MODEL[0] * MODEL[1], g["goal"]),
                        textcoords="offset points", xytext=(-120, -12), fontsize=7,
                        color=style[g["peer"]]["color"])
    axis(ax, times, "kvengine / column (same repetition, median)", "ratios (> 1: kvengine faster)")
    fig.suptitle(f"kvengine bench throughput --transport {T}  ({r.get('meta', {}).get('time', '')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_sizes(s: str) -> list[tuple[int, int]]:
    out = []
    for part in s.split(","):
        t, row = part.lower().split("x")
        out.append((int(t), parse_bytes(row)))
    return out


def add_common_args(ap: argparse.ArgumentParser, what: str) -> None:
    ap.add_argument("--transport", choices=TRANSPORTS, default="shm",
                    help="shm: same host (memfd mapped by the peer); tcp: forced TCP on loopback; ucx: "
                         "transport='ucx' beside kvengine tcp, NIXL, UCXX, ucx_perftest (bench/ucxbench.py)")
    ap.add_argument("--ucx-tls", default="tcp", help="ucx: UCX_TLS, tcp, sm (sm,self), cma (cma,tcp,self) or as written")
    ap.add_argument("--memory", choices=["numpy", "engine", "both"], default=None,
                    help="kvengine's caches: numpy (register_kv_cache of numpy arrays, as a serving framework "
                         "registers its tensors: same host, the peer's reached with process_vm_writev; the default "
                         "for ucx), engine (allocate_cache: memfd shared memory the peer maps; the default for shm "
                         "and tcp), both (ucx only)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes, repetitions and samples")
    ap.add_argument("--json", default=None, metavar="PATH", help="where to write the JSON (default PREFIX.json)")
    ap.add_argument("--out", default=None, metavar="PREFIX",
                    help=f"path prefix of the outputs (default kvengine-bench/{what}-TRANSPORT)")
    ap.add_argument("--peers", default="auto",
                    help="peer engines to run beside kvengine: auto (those installed), none, or a list: nixl,mooncake")
    ap.add_argument("--movers", type=int, default=2, help="kvengine mover threads (both ends)")
    ap.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                    help="this side's event loop (auto: uvloop when installed)")


def resolve_common(ap: argparse.ArgumentParser, args: argparse.Namespace, what: str) -> None:
    kv_only = args.transport == "ucx" and what.endswith(("-paged", "-headsplit"))   # no peer runs these over UCX
    if kv_only and args.peers.lower() not in ("auto", "none"):
        ap.error("--layout paged --transport ucx: kvengine only (--peers none)")
    if args.memory == "both" and args.transport != "ucx":
        ap.error("--memory both: with --transport ucx only")
    if args.memory is not None and args.transport != "ucx" and what.endswith(("-paged", "-headsplit")):
        ap.error("--memory: not with --layout paged (its caches are the engine's)")
    tls = f"-{args.ucx_tls.replace(',', '+')}" if args.transport == "ucx" else ""
    args.out = args.out or os.path.join("kvengine-bench", f"{what}-{args.transport}{tls}")
    args.json_path, args.png_path = out_paths(args.out, args.json)
    args.peer_log = args.out + "-peers.log"
    p = args.peers.lower()
    if p == "auto":
        args.peers = ([] if kv_only else [P.NIXL, "UCXX"]) if args.transport == "ucx" else list(P.ENGINES)
    elif p == "none":
        args.peers = []
    else:
        names = {"nixl": P.NIXL, "mooncake": P.MOONCAKE, "ucxx": "UCXX"}
        try:
            args.peers = [names[x.strip()] for x in p.split(",") if x.strip()]
        except KeyError:
            ap.error("--peers: auto, none, or a comma-separated list of nixl, mooncake (ucx: nixl, ucxx)")
        if "UCXX" in args.peers and args.transport != "ucx":
            ap.error("--peers ucxx: with --transport ucx only")
    args.ucx_peers = [n for n in args.peers if n in (P.NIXL, "UCXX")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvengine bench throughput", description=__doc__.split("\n")[0],
                                 epilog="Peers: pip install -e '.[peers]' or benchmarks/install_peers.sh; see docs/benchmarks.md.")
    add_common_args(ap, "throughput")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 41, --quick 5; paged: 11, 3)")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated TENSORSxROW, e.g. 2x32K,64x4M (default: one layer 2x32K up to 64x4M)")
    ap.add_argument("--layout", choices=["rows", "paged"], default="rows",
                    help="rows: push_kv_cache of a model-shaped row; paged: push_kv_blocks of random block "
                         "tables of a vLLM-shaped cache (kvengine/bench/paged.py)")
    ap.add_argument("--tables", default=None, help="paged: table sizes in blocks (default 16,256,1024; --quick 16,256)")
    ap.add_argument("--pool", type=int, default=None, help="paged: blocks per tensor (default: the largest table)")
    ap.add_argument("--head-split", type=int, default=1, metavar="N",
                    help="paged: push each block's KV heads split over N TP=N decode ranks' caches, beside the "
                         "same bytes contiguous (kvengine/bench/headsplit.py)")
    args = ap.parse_args(argv)
    paged = args.layout == "paged"
    if args.head_split != 1 and (not paged or args.head_split < 2):
        ap.error("--head-split N: N >= 2, with --layout paged")
    resolve_common(ap, args, "throughput-headsplit" if args.head_split > 1 else
                   "throughput-paged" if paged else "throughput")
    if paged:
        from . import paged as mod
        if args.head_split > 1:
            from . import headsplit as mod   # type: ignore[no-redef]   # the same entry points
        args.tables = [int(x) for x in args.tables.split(",")] if args.tables else \
            (mod.QUICK_TABLES if args.quick else mod.TABLES)
        args.pool = args.pool or max(args.tables)
        if args.pool < max(args.tables):
            ap.error("--pool must hold the largest table")
        args.reps = args.reps or (3 if args.quick else 11)
        if args.transport == "ucx":   # both engines (the decode one a child) take UCX_TLS from here
            from .ucxbench import set_tls
            set_tls(args)
        return _main(args, argv, mod.run, mod.goals, mod.report, mod.plot)
    args.reps = args.reps or (5 if args.quick else 41)
    args.sizes = parse_sizes(args.sizes) if args.sizes else (QUICK_SIZES if args.quick else SIZES)
    if args.transport == "ucx":
        from .ucxbench import run_throughput
        return _main(args, argv, run_throughput, goals, report, plot)
    return _main(args, argv, run, goals, report, plot)


def _main(args: argparse.Namespace, argv: list[str] | None, run: Callable[[argparse.Namespace], Coroutine[Any, Any, Report]],
          goals: Callable[[Report], list[Report]], report: Callable[[Report, int], list[str]],
          plot: Callable[[Report, str], None]) -> int:
    args.loop_name, runner = get_runner(args.loop)
    busy = busy_processes()
    if busy:
        print("warning: the machine is not idle; figures will be depressed and noisier:\n  " + "\n  ".join(busy))
    t0 = time.perf_counter()
    r = runner(run(args))
    r["meta"] = meta(argv)
    r["meta"]["wall_s"] = time.perf_counter() - t0
    r["reps"] = args.reps
    r["goals"] = goals(r)
    print()
    lines = report(r, args.reps)
    print("\n".join(lines))
    print(f"total {fmt_seconds(r['meta']['wall_s'])}")
    r["report"] = lines
    for s in r.get("sizes", []):
        for c in s["results"].values():
            c.pop("s_per_transfer", None)
    wrote = save_outputs(args.json_path, args.png_path, r, plot)
    print(wrote + (f" (peer engines' logs: {args.peer_log})" if os.path.exists(args.peer_log) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
