"""``kvengine bench throughput|latency --transport ucx [--ucx-tls tcp|sm|cma|...]``.

kvengine over UCX (``transport="ucx"``, prefill engine here, decode engine in a
child process) beside, in the same run and interleaved as the other benches do:
kvengine over tcp (the same two processes' kind of link, forced tcp on
loopback), NIXL 1.5.1 (UCX backend) and UCXX (kvengine/bench/ucxpeers.py), all
with the same ``UCX_TLS`` (set in this process and inherited by every child);
and ``ucx_perftest`` as the floor (throughput: ``ucp_put_bw`` of the whole size as
one put; latency: ``ucp_put_lat`` of 64 KiB, half a round trip). The tables,
ratios, JSON and PNG are those of throughput.py and latency.py; the goals of
issue 14: 256 MiB push >= 1.0x NIXL (tcp and shared memory), one-layer p50
within 1.5x of NIXL's. ``--memory``: kvengine's caches on both ends are numpy
arrays given to register_kv_cache (the default: what a serving framework does
with its own tensors, and the kind of memory NIXL's and UCXX's columns move),
allocate_cache's memfd shared memory (engine), or both (one more column).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import peers as P
from . import ucxpeers as U
from .common import Report, interleaved_rounds, interleaved_sizes
from .harness import KvSide, close_all, latency_results, model_label

if TYPE_CHECKING:
    from kvengine import Cache, CacheIndex

KV = "kvengine"
KV_TCP = "kvengine tcp"
KV_ENGINE_MEM = "kvengine engine-mem"   # --memory both: kvengine-ucx on allocate_cache's memfd memory
LAT_GOAL = 1.5          # kvengine's one-layer p50 at most 1.5x NIXL's


@dataclass
class _Case:
    """One size: kvengine's source and destination per column (ucx, tcp), the peers' plan key."""
    tensors: int
    row: int
    kv: dict[str, tuple[KvSide, Cache, CacheIndex]]
    n: int                               # transfers per measurement
    key: str

    @property
    def nbytes(self) -> int:
        return self.tensors * self.row


def set_tls(args: argparse.Namespace) -> str:
    """Export UCX_TLS for this process and every child (kvengine's decode engine, NIXL, UCXX),
    and UCX_NET_DEVICES=lo unless set: every end runs on this host, and UCX's tcp transport
    would otherwise reach it through its other interfaces' addresses too."""
    tls: str = U.TLS_PRESETS.get(args.ucx_tls, str(args.ucx_tls))
    os.environ["UCX_TLS"] = tls
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    return tls


def memories(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """(column, memory, over tcp) of the kvengine columns: ``--memory`` numpy (the default: what
    a serving framework does, register_kv_cache of its own tensors), engine (allocate_cache), both
    (the ucx column once more on engine memory)."""
    mem = getattr(args, "memory", None) or "numpy"
    first = "engine" if mem == "engine" else "numpy"
    cols = [(KV, first, False), (KV_TCP, first, True)]
    return cols + ([(KV_ENGINE_MEM, "engine", False)] if mem == "both" else [])


async def _start(args: argparse.Namespace, out: Report, size: int, kvs: KvSide, kvt: KvSide,
                 pairs: dict[str, P.PeerPair]) -> None:
    """Start the peers (into ``pairs``) and both kvengine sides."""
    started, missing = U.start_ucx_peers(args.ucx_peers, size, args.peer_log)
    pairs.update(started)
    out["peers"] = {n: ("ok" if n in pairs else missing.get(n, "not run (--peers)")) for n in U.UCX_ENGINES}
    out["peers"][P.MOONCAKE] = "not run (no UCX transport)"
    await kvs.start()
    await kvt.start()


async def _close(kvs: KvSide, kvt: KvSide, pairs: dict[str, P.PeerPair]) -> None:
    await kvt.close()
    await close_all(kvs, pairs)


async def run_throughput(args: argparse.Namespace) -> Report:
    from .throughput import burst
    tls = set_tls(args)
    sizes = args.sizes
    say = print
    out: Report = {"transport": "ucx", "ucx_tls": tls, "sizes": [], "loop": args.loop_name,
                   "memory": getattr(args, "memory", None) or "numpy"}
    t_setup = time.perf_counter()
    say(f"setup: UCX_TLS={tls}; decode engines in child processes (ucx, tcp), NIXL, UCXX ...", flush=True)
    kvs, kvt = KvSide("ucx", args.movers), KvSide("tcp", args.movers)
    pairs: dict[str, P.PeerPair] = {}
    try:
        await _start(args, out, max(t * r for t, r in sizes), kvs, kvt, pairs)
        floor, why = U.perftest_binary()
        if floor:
            try:
                await asyncio.to_thread(U.perftest, "ucp_put_bw", 1 << 20, 10)
            except P.PeerError as e:
                floor, why = None, str(e)
        out["perftest"] = "ok" if floor else why
        cases: list[_Case] = []
        for k, (tensors, row) in enumerate(sizes):
            kvc: dict[str, tuple[KvSide, Cache, CacheIndex]] = {}
            for name, mem, tcp in memories(args):
                side = kvt if tcp else kvs
                kvc[name] = (side, *await side.alloc(tensors, row, seed=11 + k, memory=mem))
            cases.append(_Case(tensors, row, kvc, burst(tensors * row), f"s{k}"))
        plans = [(c.key, [(i * c.row, c.row) for i in range(c.tensors)]) for c in cases]
        verify: dict[str, list[bool]] = {}
        P.prepare_peers(pairs, plans, out, say)
        for c in cases:
            for name, (side, s, i) in c.kv.items():
                ok = await side.verify(s, i)
                verify.setdefault(name, []).append(ok)
                if not ok:
                    raise RuntimeError(f"{name}: pushed {model_label(c.tensors, c.row)} differs from the source")
            await P.check_peers(pairs, lambda pair: pair.verify(c.key, c.nbytes), f"transfer of {c.nbytes} B",
                                out, verify, say)
        out["verify"] = verify
        configs = list(cases[0].kv) + list(pairs) + ([U.PERFTEST] if floor else [])

        async def measure(name: str, c: _Case) -> float:
            n = c.n
            if name in c.kv:
                side, src, idx = c.kv[name]
                return await side.push_seconds(src, idx, n) / n
            if name == U.PERFTEST:
                try:
                    r = await asyncio.to_thread(U.perftest, "ucp_put_bw", c.nbytes, max(n, 10))
                except P.PeerError as e:   # the floor is missing for this one measurement only
                    say(f"  {U.PERFTEST}: {e}")
                    out.setdefault("perftest_failures", []).append(str(e))
                    return float("nan")
                return c.nbytes / (r["MBps"] * (1 << 20))
            return await asyncio.to_thread(pairs[name].run, c.key, n, True) / n

        say(f"measuring: {len(configs)} columns x {len(cases)} sizes x {args.reps} repetitions, interleaved "
            f"(columns: {', '.join(configs)})", flush=True)
        secs = await interleaved_sizes(out, t_setup, configs, cases, args.reps, f"throughput ucx ({tls})", measure)
        for k, c in enumerate(cases):
            nb = c.nbytes
            res: Report = {}
            for name in configs:
                got = [x for x in secs[(k, name)] if x == x] or [float("nan")]   # nan: a failed floor run
                g = [nb / x / 1e9 for x in got]
                res[name] = {"GBps": nb / statistics.median(got) / 1e9, "min_GBps": min(g),
                             "max_GBps": max(g), "per_rep_GBps": g}
            kv_s = secs[(k, KV)]
            ratios = {name: statistics.median([b / a for a, b in zip(kv_s, secs[(k, name)]) if b == b] or [float("nan")])
                      for name in configs if name != KV}
            out["sizes"].append({"tensors": c.tensors, "row_bytes": c.row, "bytes": nb,
                                 "transfers_per_measurement": c.n, "results": res, "kv_over": ratios})
        here, there = await kvs.stats()
        out["engine_stats"] = {"prefill": here, "decode": there}
        out["peer_env"] = {n: p.env for n, p in pairs.items()}
    finally:
        await _close(kvs, kvt, pairs)
    return out


async def run_latency(args: argparse.Namespace) -> Report:
    from .latency import HALF, LAYERS, ROUNDS
    import kvengine as kv
    tls = set_tls(args)
    say = print
    out: Report = {"transport": "ucx", "ucx_tls": tls, "layer_bytes": 2 * HALF, "layers": LAYERS,
                   "loop": args.loop_name, "memory": getattr(args, "memory", None) or "numpy"}
    t_setup = time.perf_counter()
    say(f"setup: UCX_TLS={tls}; decode engines in child processes (ucx, tcp), NIXL, UCXX ...", flush=True)
    kvs, kvt = KvSide("ucx", args.movers), KvSide("tcp", args.movers)
    pairs: dict[str, P.PeerPair] = {}
    try:
        await _start(args, out, 2 * LAYERS * HALF, kvs, kvt, pairs)
        plans = [(f"l{i}", [(2 * i * HALF, HALF), ((2 * i + 1) * HALF, HALF)]) for i in range(LAYERS)]
        keys = [k for k, _ in plans]
        P.prepare_peers(pairs, plans, out, say)
        await P.check_peers(pairs, lambda pair: pair.verify(keys, 2 * HALF), "the layer", out, {}, say)
        exts = [kv.KvCacheExtParam((i, i), (i, i), 2) for i in range(LAYERS)]
        sides = {}
        for name, mem, tcp in memories(args):
            side = kvt if tcp else kvs
            src, idx = await side.alloc(2 * LAYERS, HALF, seed=5, memory=mem)
            if not await side.verify(src, idx):
                raise RuntimeError(f"{name}: pushed cache differs from the source")
            sides[name] = (side.started()[0], src, idx)
        clock = time.perf_counter

        async def samples(name: str, n: int) -> list[float]:
            if name in sides:
                engine, src, idx = sides[name]
                push, s = engine.push_kv_cache, []
                for i in range(n):
                    t0 = clock()
                    await push(src, idx, 0, ext_param=exts[i % LAYERS], timeout=10)
                    s.append(clock() - t0)
                return s
            return list(await asyncio.to_thread(pairs[name].run, keys, n))

        configs = list(sides) + list(pairs)
        per = max(1, args.n // ROUNDS)
        say(f"measuring: {len(configs)} columns x {ROUNDS} rounds x {per} samples, interleaved", flush=True)

        async def round_of(name: str, r: int) -> list[float]:
            await samples(name, 200 if r == 0 else 20)          # warm-up
            return await samples(name, per)

        lat = await interleaved_rounds(out, t_setup, configs, ROUNDS, f"latency ucx ({tls})", round_of)
        try:
            out["floor"] = await asyncio.to_thread(U.perftest, "ucp_put_lat", 2 * HALF, max(1000, per))
        except P.PeerError as e:
            out["floor"] = {"error": str(e)}
        latency_results(out, lat, KV)
        here, there = await kvs.stats()
        out["engine_stats"] = {"prefill": here, "decode": there}
        out["peer_env"] = {n: p.env for n, p in pairs.items()}
    finally:
        await _close(kvs, kvt, pairs)
    return out


def latency_lines(r: Report) -> list[str]:
    """The ucx run's extra lines under the latency table: the floor and the goal."""
    lines = []
    f = r.get("floor", {})
    if "p50_us" in f:
        lines.append(f"floor: ucx_perftest -t ucp_put_lat -s 65536 (UCX_TLS={r['ucx_tls']}): "
                     f"p50 {f['p50_us']:.1f} us, average {f['avg_us']:.1f} us (half a round trip)")
    else:
        lines.append(f"floor: ucx_perftest not run ({f.get('error', 'no result')})")
    x = r["kv_over"].get(P.NIXL)
    if x is None:
        lines.append(f"goal: kvengine p50 <= {LAT_GOAL}x NIXL's: not measured ({r['peers'].get(P.NIXL)})")
    else:
        got = 1 / x["p50_us"]
        lines.append(f"goal: kvengine one-layer p50 <= {LAT_GOAL}x NIXL's: {got:.2f}x NIXL's, "
                     + ("MET" if got <= LAT_GOAL else "NOT MET"))
    return lines
