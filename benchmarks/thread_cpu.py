"""Micro-measure (not the benchmark: `kvengine bench` has that): where the CPUs go during
awaited pushes. Pushes one row (TENSORS x SIZE/TENSORS bytes) from this process into a
decode engine in a child process N times, one at a time, after 500 warm-up pushes, and
prints the wall time per push and, per thread of both processes, its run time and its
run-queue wait per push (/proc/<pid>/task/<tid>/schedstat: time on a CPU, time runnable
but waiting for one). kvengine's native threads are named (kv-tcp-io, kv-ucx-io,
kv-mover-N); the asyncio loop thread is "python". UCX_TLS and KVENGINE_UCX_PEER_ERRORS
pass through for transport ucx.

    python benchmarks/thread_cpu.py tcp 5000 65536          # transport, pushes, bytes a push
    UCX_TLS=sm,self python benchmarks/thread_cpu.py ucx 5000 65536
    UCX_TLS=cma,tcp,self python benchmarks/thread_cpu.py ucx 20 268435456 numpy

The optional fourth argument is the caches' memory: engine (allocate_cache, the default) or
numpy (register_kv_cache of numpy arrays, as `kvengine bench --memory numpy`). The warm-up
is 500 pushes, or 1 GiB of them where pushes are larger than 2 MiB.

With both processes on one 2-vCPU host, the sum of the run times per push against the
wall time per push says how full the CPUs are (docs/benchmarks.md, "Where the two vCPUs
go"). Threads that ran less than 0.5 us a push are left out."""
import os
import sys
import time

import uvloop

from kvengine.bench.harness import KvSide


def threads(pid: int) -> dict[tuple[str, str], tuple[int, int]]:
    """(tid, name) -> (ns on a CPU, ns waiting for one) of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait = f.read().split()[:2]
        except FileNotFoundError:   # ended meanwhile
            continue
        out[(tid, name)] = (int(run), int(wait))
    return out


async def main() -> None:
    transport, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    memory = sys.argv[4] if len(sys.argv) > 4 else "engine"
    side = KvSide(transport, 2)
    await side.start()
    try:
        engine, peer = side.started()
        src, idx = await side.alloc(2, size // 2, 3, memory=memory)
        for _ in range(min(500, max(1, (1 << 30) // size))):
            await engine.push_kv_cache(src, idx, timeout=5)
        a, b, t0 = threads(os.getpid()), threads(peer.pid), time.perf_counter()
        for _ in range(n):
            await engine.push_kv_cache(src, idx, timeout=5)
        dt = time.perf_counter() - t0
        a2, b2 = threads(os.getpid()), threads(peer.pid)
        print(f"{transport}, {size} B a push: {dt / n * 1e6:.1f} us a push (wall)")
        for side_name, before, after in (("prefill", a, a2), ("decode", b, b2)):
            for key, (run, wait) in sorted(after.items(), key=lambda kv: kv[0][1]):
                if key in before:
                    r, w = (run - before[key][0]) / n / 1e3, (wait - before[key][1]) / n / 1e3
                    if r >= 0.5:
                        print(f"  {side_name:8s} {key[1]:14s} on a CPU {r:7.1f} us a push, waiting for one {w:6.1f}")
    finally:
        await side.close()


if __name__ == "__main__":
    uvloop.run(main())
