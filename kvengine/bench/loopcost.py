"""Loop-thread cost of a one-layer push: where an awaited push spends the loop thread.

    kvengine bench loopcost [--transport local,shm,tcp,ucx] [--n 20000] [--rounds 7] [--json PATH]

One layer of a 32-layer cache (K + V = 2 x 32 KiB = 64 KiB, cycling the layers),
pushed with ``await engine.push_kv_cache(...)`` one at a time, into a decode engine
in this process (``local``) or in a child process (``shm``, ``tcp``, ``ucx``). Per push, the
median over ``--rounds`` interleaved rounds of ``--n`` pushes:

- wall time, and the loop thread's CPU time (``time.thread_time_ns``: everything the
  loop thread ran, waits excluded; split into user and kernel time, and the times it
  slept, by ``getrusage(RUSAGE_THREAD)``), of the push as the API runs it (``fast``: the
  native fast path takes the inline case whole) and of the same push forced through
  the Python path (``python``: ``submit_push_kv_cache(...)._result()``, what every
  push ran before the fast path);
- the pieces, each timed alone on the live engine with the arguments the push uses:
  the copy (``Core.submit`` of the memoized plan: the C call and the inline memmove),
  the validation, the plan memo lookup, the Transfer, its finish and accounting, a
  histogram record, the coroutine; over tcp and ucx the launch (submit to the I/O thread) and
  the completion (the eventfd reader ``Parts.drain``: poll, resolve, account), timed
  in place around the real pushes, on the thread's CPU clock (a preempted loop thread
  is not charged; the cost of the two clock readings is subtracted).

The cost beyond the copy is the loop thread's CPU per push minus the copy's. Nothing
here is a baseline of another engine: see ``kvengine bench latency`` for those.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from typing import Any, Awaitable, Callable

from .common import KiB, busy_processes, get_runner, meta
from .harness import KvSide, table

LAYERS = 32
HALF = 32 * KiB
QUEUED = ("tcp", "ucx")   # transports whose pushes an I/O thread carries (never inline)
Sampler = Callable[[int], Awaitable[dict[str, float]]]


def _clocks() -> tuple[int, int, float, float, int]:
    """(wall ns, this thread's CPU ns, its user s, its system s, its voluntary context switches)."""
    ru = resource.getrusage(resource.RUSAGE_THREAD)
    return time.perf_counter_ns(), time.thread_time_ns(), ru.ru_utime, ru.ru_stime, ru.ru_nvcsw


def _per(n: int, c0: tuple[int, int, float, float, int]) -> dict[str, float]:
    """Per push since ``c0``: wall, CPU, user and system us, voluntary switches (sleeps)."""
    c1 = _clocks()
    return {"wall": (c1[0] - c0[0]) / n / 1e3, "cpu": (c1[1] - c0[1]) / n / 1e3,
            "user": (c1[2] - c0[2]) / n * 1e6, "sys": (c1[3] - c0[3]) / n * 1e6, "sleeps": (c1[4] - c0[4]) / n}


def _timed(fn: Callable[[int], object], n: int) -> float:
    """Microseconds per call of ``fn(i)``, on this thread's CPU clock."""
    t0 = time.thread_time_ns()
    for i in range(n):
        fn(i)
    return (time.thread_time_ns() - t0) / n / 1e3


class _TimedCore:
    """The core, with the time spent in ``submit`` summed (the scheduler's view of it)."""

    def __init__(self, core: Any) -> None:
        self.core, self.ns = core, 0

    def submit(self, *args: Any) -> Any:
        t0 = time.thread_time_ns()
        r = self.core.submit(*args)
        self.ns += time.thread_time_ns() - t0
        return r

    def __getattr__(self, name: str) -> Any:
        return getattr(self.core, name)


async def _engines(transport: str) -> tuple[Any, Any, Callable[[], Awaitable[None]]]:
    """(prefill engine, decode side, close): decode in this process for ``local``."""
    import kvengine as kv
    if transport != "local":
        kvs = KvSide(transport, 2)
        await kvs.start()
        return kvs.started()[0], kvs, kvs.close
    o = kv.EngineOptions(transport="local", insecure=True)
    p = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", o).start()
    d = await kv.KvEngine(2, kv.Role.DECODER, "127.0.0.1:0", o).start()
    st, per = await p.link_clusters([kv.ClusterInfo(2, d.address or "")])
    if st != kv.LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"local link failed: {per}")

    async def close() -> None:
        await p.close()
        await d.close()
    return p, d, close


async def one(transport: str, n: int, rounds: int) -> dict[str, Any]:
    import kvengine as kv
    from kvengine import plan
    from kvengine.status import LLMStatusCode as S
    from kvengine.transfer import Transfer
    engine, side, close = await _engines(transport)
    try:
        if transport == "local":
            desc = kv.CacheDesc(2 * LAYERS, (1, HALF), "uint8")
            src = engine.allocate_cache(desc)
            dst = side.allocate_cache(desc)
            await engine.wait_remote_cache(2, dst.cache_id)
            idx = kv.CacheIndex(2, dst.cache_id, 0)
        else:
            src, idx = await side.alloc(2 * LAYERS, HALF, seed=5)
        exts = [kv.KvCacheExtParam((i, i), (i, i), 2) for i in range(LAYERS)]
        p = engine._p          # a measuring tool: it reads the parts it times
        push, submit = engine.push_kv_cache, engine.submit_push_kv_cache

        async def fast(k: int) -> dict[str, float]:
            c0 = _clocks()
            for i in range(k):
                await push(src, idx, 0, ext_param=exts[i % LAYERS], timeout=10)
            return _per(k, c0)

        async def python(k: int) -> dict[str, float]:
            c0 = _clocks()
            for i in range(k):
                await submit(src, idx, 0, ext_param=exts[i % LAYERS], timeout=10)._result()
            return _per(k, c0)

        drain_ns = [0, 0]   # tcp, ucx: time in the eventfd reader, calls
        fd = p.core.fileno()

        clock = time.thread_time_ns   # CPU, not wall: a preempted loop thread is not charged
        gaps = []
        for _ in range(1000):
            g0 = clock()
            gaps.append(clock() - g0)
        gap = int(statistics.median(gaps))   # what the two readings cost, subtracted

        def timed_drain() -> None:
            t0 = clock()
            p.drain()
            drain_ns[0] += clock() - t0 - gap
            drain_ns[1] += 1

        async def launch_only(k: int) -> tuple[float, float]:
            """us per push: the launch (submit_push_kv_cache to its return), its Core.submit."""
            tl, timed = 0, _TimedCore(p.core)
            p.scheduler._core = timed
            try:
                for i in range(k):
                    t0 = clock()
                    t = submit(src, idx, 0, ext_param=exts[i % LAYERS], timeout=10)
                    tl += clock() - t0 - gap
                    await t
            finally:
                p.scheduler._core = p.core
            return tl / k / 1e3, timed.ns / k / 1e3

        cols: dict[str, Sampler] = {"fast": fast, "python": python}
        out: dict[str, Any] = {"transport": transport, "n": n, "rounds": rounds}
        got: dict[str, list[dict[str, float]]] = {c: [] for c in cols}
        for c in cols:
            await cols[c](2000)   # warm-up: plans memoized, caches hot
        if transport in QUEUED:
            p.loop.remove_reader(fd)
            p.loop.add_reader(fd, timed_drain)
        try:
            for r in range(rounds):
                order = list(cols)[r % 2:] + list(cols)[:r % 2]
                for c in order:
                    before = list(drain_ns)
                    got[c].append(await cols[c](n))
                    if transport in QUEUED:
                        d_ns, d_calls = drain_ns[0] - before[0], drain_ns[1] - before[1]
                        out.setdefault(f"drain_{c}_us", []).append(d_ns / n / 1e3)
                        out.setdefault(f"drains_per_push_{c}", []).append(d_calls / n)
            if transport in QUEUED:
                launches = [await launch_only(n // 4) for _ in range(3)]
                out["launch_us"] = [a for a, _ in launches]
                out["launch_submit_us"] = [b for _, b in launches]
        finally:
            if transport in QUEUED:
                p.loop.remove_reader(fd)
                p.loop.add_reader(fd, p.drain)
        for c in cols:
            for k in ("wall", "cpu", "user", "sys", "sleeps"):
                out[f"{c}_{k}" + ("_us" if k != "sleeps" else "")] = statistics.median(g[k] for g in got[c])
        for k in [k for k in out if k.startswith(("drain_", "drains_", "launch_"))]:
            out[k] = statistics.median(out[k])

        # the pieces, one at a time, as the push calls them (layer 0's arguments)
        ext = exts[0]
        local = p.registry.get(src)
        link, rc, row, _ = p.targets._resolve(idx, False)
        key = ("pc", local.serial, rc.serial, 0, row, -1, ext)

        def make() -> list[plan.Segment]:
            return plan.plan_cache(local.cache.desc, rc.desc, 0, row, -1, ext, op="push")
        segs, total = p.planner.segments(key, make, local.cache._regions, rc.regions)
        what = ("push_kv_cache", 2, rc.cache_id, None, row)
        inline = engine.options.inline_threshold if transport not in QUEUED else 0
        jobs = p.scheduler.jobs
        pieces: dict[str, Callable[[int], object]] = {
            "validation (registry, options, link and peer cache)": lambda i: (
                p.registry.get(src), plan.transfer_options(10, 1.0, 0, None), p.targets._resolve(idx, False)),
            "plan memo lookup (hit)": lambda i: p.planner.segments(key, make, local.cache._regions, rc.regions),
            "Transfer()": lambda i: Transfer(p.scheduler, what),
            "finish + accounting (Transfer._finish)": lambda i: Transfer(p.scheduler, what)._finish(0, total),
            "accounting.record (counters + 2 x 3 histograms)": lambda i: p.accounting.record(
                S.LLM_SUCCESS, total, (2, transport), 1.0, 1.0),
        }
        if transport not in QUEUED:
            pieces["copy: Core.submit of the plan (C call + inline memmove)"] = lambda i: p.core.submit(
                next(jobs), segs, inline, 0, link.lease_id)
            pieces["fast path call, sync (checks, memo, submit + copy, accounting)"] = lambda i: p.fast.push(
                src, idx, 0, -1, exts[i % LAYERS], 10, 0, None)
        for name, fn in pieces.items():
            fn(0)
            out.setdefault("pieces_us", {})[name] = statistics.median(_timed(fn, n // 4) for _ in range(5))
        from kvengine.native import _native
        scratch = _native.Counts()
        t0 = time.thread_time_ns()
        scratch._bench(n * 10, 3e-6)
        out["pieces_us"]["native accounting of one inline success, one group (C)"] = \
            (time.thread_time_ns() - t0) / (n * 10) / 1e3

        async def nothing() -> int:
            return 0

        async def coro(k: int) -> float:
            t0 = time.thread_time_ns()
            for _ in range(k):
                await nothing()
            return (time.thread_time_ns() - t0) / k / 1e3
        out["pieces_us"]["an async def awaited (the coroutine, inherent)"] = statistics.median(
            [await coro(n) for _ in range(5)])
        out["fast_taken"] = p.fast.taken
        return out
    finally:
        await close()


def report(res: list[dict[str, Any]]) -> list[str]:
    lines = []
    rows = []
    for r in res:
        copy = r["pieces_us"].get("copy: Core.submit of the plan (C call + inline memmove)")
        for c in ("fast", "python"):
            beyond = f"{r[f'{c}_cpu_us'] - copy:.2f}" if copy is not None else "-"
            rows.append([r["transport"], c, f"{r[f'{c}_wall_us']:.2f}", f"{r[f'{c}_cpu_us']:.2f}", beyond,
                         f"{r[f'{c}_user_us']:.1f} / {r[f'{c}_sys_us']:.1f}", f"{r[f'{c}_sleeps']:.2f}"])
    lines.append(table(rows, ["transport", "path", "wall us/push", "loop CPU us/push", "CPU beyond the copy",
                              "user / kernel us", "sleeps/push"], align="llrrrrr"))
    for r in res:
        lines.append("")
        lines.append(f"{r['transport']}: pieces, each alone (loop-thread CPU us per call)")
        prow = [[k, f"{v:.3f}"] for k, v in r["pieces_us"].items()]
        if r["transport"] in QUEUED:
            prow += [["launch: submit_push_kv_cache to return (incl. hand-off to the I/O thread)",
                      f"{r['launch_us']:.3f}"],
                     ["  of which Core.submit (the hand-off: queue the job, wake the I/O thread)",
                      f"{r['launch_submit_us']:.3f}"],
                     ["completion: Parts.drain per push (poll, resolve, account)", f"{r['drain_fast_us']:.3f}"],
                     ["eventfd wake-ups per push", f"{r['drains_per_push_fast']:.2f}"]]
        lines.append(table(prow, ["piece", "us"], align="lr"))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvengine bench loopcost", description=__doc__.split("\n")[0])
    ap.add_argument("--transport", default="local,shm,tcp",
                    help="comma-separated: local, shm, tcp, ucx (UCX_TLS passes through)")
    ap.add_argument("--n", type=int, default=20000, help="pushes per round and column")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the median is reported)")
    ap.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default="auto")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    trs = [t.strip() for t in args.transport.split(",") if t.strip()]
    if not trs or any(t not in ("local", "shm", "tcp", "ucx") for t in trs):
        ap.error("--transport: local, shm, tcp, ucx (comma-separated)")
    busy = busy_processes()
    if busy:
        print("warning: the machine is not idle; figures will be higher and noisier:\n  " + "\n  ".join(busy))
    loop_name, runner = get_runner(args.loop)

    async def run() -> list[dict[str, Any]]:
        return [await one(t, args.n, args.rounds) for t in trs]
    res = runner(run())
    lines = [f"kvengine bench loopcost: one-layer (64 KiB) push awaited one at a time, {loop_name}, "
             f"median of {args.rounds} rounds x {args.n}", ""] + report(res)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta(argv), "results": res, "report": lines}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
