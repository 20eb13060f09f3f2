"""The kvengine side of ``kvengine bench throughput|latency``: a prefill engine in this
process linked to a decode engine in a child process (``kvengine._peer``), over
the transport under test, and the table/ratio helpers both commands print with."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, TypeVar, TypeVarTuple, Unpack

import numpy as np

from .common import MiB, Report, pct

if TYPE_CHECKING:
    from kvengine import Cache, CacheIndex, KvEngine
    from kvengine._peer import PeerProcess

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


class Closable(Protocol):
    """A peer-engine pair or a baseline: closing it joins its processes (blocking)."""
    def close(self) -> None: ...

TRANSPORTS = ("shm", "tcp", "ucx")


class KvSide:
    """Prefill engine here (cluster 1), decode engine in a child process (cluster 2)."""

    def __init__(self, transport: str, movers: int, heartbeat_timeout: float | None = None) -> None:
        import kvengine as kv
        self.transport, self.movers = transport, movers
        if transport == "ucx":   # both ends on this host: UCX's tcp transport on 127.0.0.1 only
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        self.secret = secrets.token_hex(16).encode()
        # large caches: the child allocates on its loop thread, so its heartbeats may pause
        self.more: dict[str, float] = {} if heartbeat_timeout is None else {"heartbeat_timeout": heartbeat_timeout}
        self.options = kv.EngineOptions(transport=transport, secret=self.secret, movers=movers)
        if heartbeat_timeout is not None:
            self.options = kv.EngineOptions(transport=transport, secret=self.secret, movers=movers,
                                            heartbeat_timeout=heartbeat_timeout)
        self.peer: PeerProcess | None = None
        self.engine: KvEngine | None = None
        self.caches: list[Cache] = []

    def started(self) -> tuple[KvEngine, PeerProcess]:
        if self.engine is None or self.peer is None:
            raise RuntimeError("KvSide.start() first")
        return self.engine, self.peer

    async def start(self) -> None:
        import kvengine as kv
        from kvengine._peer import PeerProcess
        self.peer = peer = await PeerProcess.start(cluster_id=2, transport=self.transport, secret=self.secret,
                                                   movers=self.movers, options=dict(self.more) or None)
        self.engine = engine = await kv.KvEngine(1, kv.Role.PROMPT, None, self.options).start()
        st, per = await engine.link_clusters([kv.ClusterInfo(2, peer.address)], timeout=10)
        if st != kv.LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"kvengine: link to the decode process failed: {st!r} {per!r}")
        link = engine.stats()["links"][2]
        if link["transport"] != self.transport:
            raise RuntimeError(f"kvengine: link transport {link['transport']!r}, not {self.transport!r}")

    async def alloc(self, tensors: int, row: int, seed: int, memory: str = "engine") -> tuple[Cache, CacheIndex]:
        """A source cache here (tensors x (1, row) bytes, filled) and its destination in the child:
        (src cache, destination CacheIndex). ``memory``: "engine" (allocate_cache on both ends:
        memfd shared memory) or "numpy" (register_kv_cache of one numpy array per end, sliced
        into the tensors, as a serving framework registers its own tensors)."""
        import kvengine as kv
        from kvengine._peer import fill_pattern
        engine, peer = self.started()
        desc = kv.CacheDesc(tensors, (1, row), np.uint8)
        if memory == "numpy":
            flat = np.empty(tensors * row, np.uint8)
            src = engine.register_kv_cache(desc, [flat[i * row:(i + 1) * row].reshape(1, row) for i in range(tensors)])
        else:
            src = await engine.allocate_cache_async(desc)
        for i, t in enumerate(src.tensors):
            fill_pattern(t, seed, i)
        op = "register" if memory == "numpy" else "alloc"
        dst = (await peer.call(op, n=tensors, shape=[1, row], dtype="uint8", one_buffer=True, timeout=120))["cache_id"]
        await engine.wait_remote_cache(2, dst, timeout=30)
        self.caches.append(src)
        return src, kv.CacheIndex(2, dst, 0)

    async def verify(self, src: Cache, idx: CacheIndex) -> bool:
        """Zero the destination, push once, compare row digests with the source's."""
        from kvengine._peer import row_digests
        engine, peer = self.started()
        await peer.call("zero", cache_id=idx.cache_id, timeout=120)
        await engine.push_kv_cache(src, idx, 0, timeout=60)
        got: list[list[str]] = (await peer.call("digest", cache_id=idx.cache_id, timeout=120))["rows"]
        return got == row_digests(src.tensors)

    async def push_seconds(self, src: Cache, idx: CacheIndex, n: int) -> float:
        """n pushes of row 0, each awaited: total seconds."""
        engine, _ = self.started()
        push, clock = engine.push_kv_cache, time.perf_counter
        t0 = clock()
        for _ in range(n):
            await push(src, idx, 0, timeout=60)
        return clock() - t0

    async def stats(self) -> tuple[Report, Report]:
        engine, peer = self.started()
        here: Report = engine.stats()
        there: Report = (await peer.call("stats"))["stats"]
        return here, there

    async def close(self) -> None:
        if self.engine is not None:
            try:
                await self.engine.close()
            except Exception:
                pass
        if self.peer is not None:
            await self.peer.close()


async def close_all(kvs: KvSide, pairs: Mapping[str, Closable], *baselines: Closable | None) -> None:
    """End a run: kvengine's side first (the others' closing blocks: it joins processes),
    then the peer engines' pairs, then the baselines that were started (None: not started)."""
    await kvs.close()
    for p in pairs.values():
        p.close()
    for b in baselines:
        if b is not None:
            b.close()


def odd_stats(name: str, s: Report) -> str | None:
    """Anything an engine owner should see: failed or aborted transfers, refused connections."""
    odd = {k: v for k, v in s.get("by_status", {}).items() if str(k) not in ("LLM_SUCCESS", "0")}
    nat = s.get("native", {})
    odd.update({k: v for k, v in nat.items()
                if v and any(w in k for w in ("abort", "bad", "fail", "refused")) and k != "regions_live"})
    if s.get("control_refused"):
        odd["control_refused"] = s["control_refused"]
    return f"note: {name}: {odd}" if odd else None


def ucx_tls_of(transport: str) -> str | None:
    """The report's ``ucx_tls`` of a paged or head-split run: the UCX_TLS both engines
    ran with (set from --ucx-tls before they start), None off UCX."""
    import os
    return os.environ.get("UCX_TLS", "") if transport == "ucx" else None


def tls_words(r: Report) -> str:
    """" (UCX_TLS=...)" for a report's first line, "" off UCX (:func:`ucx_tls_of`)."""
    return f" (UCX_TLS={r['ucx_tls']})" if r.get("ucx_tls") is not None else ""


def footer(r: Report) -> list[str]:
    """The lines after a report's table: the machine's load, odd engine counters."""
    from .common import load_line
    lines = []
    if r.get("load"):
        lines.append(load_line(r["load"]))
    for n, st in (r.get("engine_stats") or {}).items():
        o = odd_stats(f"kvengine {n}", st)
        if o:
            lines.append(o)
    return lines


def summary(samples_s: list[float]) -> dict[str, float]:
    us = sorted(x * 1e6 for x in samples_s)
    return {"n": len(us), "p50_us": pct(us, 0.5), "p90_us": pct(us, 0.9), "p99_us": pct(us, 0.99),
            "p999_us": pct(us, 0.999), "max_us": us[-1] if us else float("nan"),
            "mean_us": sum(us) / len(us) if us else float("nan")}


def latency_results(out: Report, lat: dict[str, list[float]], base: str | None = None) -> None:
    """A latency run's figures into ``out``: each column's :func:`summary` (``results``), its
    sorted samples in us (``samples_us``) and, with ``base``, each other column's percentiles
    over the base column's (``kv_over``)."""
    out["results"] = {n: summary(v) for n, v in lat.items()}
    out["samples_us"] = {n: sorted(x * 1e6 for x in v) for n, v in lat.items()}
    if base is not None:
        b = out["results"][base]
        out["kv_over"] = {n: {q: r[q] / b[q] for q in ("p50_us", "p99_us", "p999_us")}
                          for n, r in out["results"].items() if n != base}


def table(rows: list[list[str]], header: list[str], align: str | None = None) -> str:
    """Plain-text table: first column left-aligned, the rest right-aligned (align: 'l'/'r' per column)."""
    align = align or "l" + "r" * (len(header) - 1)
    cols = list(zip(*([header] + rows)))
    w = [max(len(str(c)) for c in col) for col in cols]
    def line(r: list[str] | tuple[str, ...]) -> str:
        return "  ".join(str(c).ljust(w[i]) if align[i] == "l" else str(c).rjust(w[i])
                         for i, c in enumerate(r)).rstrip()
    return "\n".join([line(header), "  ".join("-" * x for x in w)] + [line(r) for r in rows])


def gbps(x: float) -> str:
    if x != x:
        return "-"
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def ratio(x: float | None) -> str:
    if x is None or x != x:
        return "-"
    return f"{x:.2f}x" if x < 10 else f"{x:.1f}x" if x < 100 else f"{x:.0f}x"


def us(x: float) -> str:
    if x != x:
        return "-"
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


async def in_thread(fn: Callable[[Unpack[_Ts]], _T], *a: Unpack[_Ts]) -> _T:
    return await asyncio.to_thread(fn, *a)


def model_label(tensors: int, row: int) -> str:
    from .common import fmt_bytes, short_bytes
    return f"{fmt_bytes(tensors * row)} ({tensors} x {short_bytes(row)})"


MODEL = (64, 4 * MiB)            # the whole model-shaped cache the goals are about: 64 tensors x 4 MiB
