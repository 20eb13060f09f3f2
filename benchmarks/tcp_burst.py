"""Micro-measure (not the benchmark): a push's wall time by its place in a burst.

`kvengine bench throughput` measures bursts of back-to-back pushes with other columns
run in between; a 1 MiB tcp push costs more there than in a long back-to-back run, and
not only the first of a burst. This runs BURSTS bursts of 16 awaited pushes (2 tensors
x SIZE/2 bytes, into a decode engine in a child process), GAP seconds apart (slept),
after 300 warm-up pushes, and prints the median wall time of the push at each place
in the burst and their sum. ``--pin`` puts this process on CPU 0 and the child on
CPU 1 (all threads, `taskset -a`) after the warm-up; ``--spin`` spins the loop thread
through the gap instead of sleeping.

    python benchmarks/tcp_burst.py 1048576 0.02        # size, gap
    python benchmarks/tcp_burst.py 1048576 0           # no gap: the back-to-back figure
    python benchmarks/tcp_burst.py 1048576 0.02 --pin

Figures: docs/benchmarks.md, "1 MiB pushes in two frames"."""
import argparse
import asyncio
import os
import statistics
import subprocess
import time

import uvloop

from kvengine.bench.harness import KvSide


async def main(args: argparse.Namespace) -> None:
    side = KvSide(args.transport, 2)
    await side.start()
    try:
        engine, peer = side.started()
        src, idx = await side.alloc(2, args.size // 2, 3)
        for _ in range(300):
            await engine.push_kv_cache(src, idx, timeout=5)
        if args.pin:
            for cpu, pid in (("0", os.getpid()), ("1", peer.pid)):
                subprocess.run(["taskset", "-a", "-c", "-p", cpu, str(pid)], check=True, capture_output=True)
        per: list[list[float]] = [[] for _ in range(16)]
        for _ in range(args.bursts):
            if args.spin:
                end = time.perf_counter() + args.gap
                while time.perf_counter() < end:
                    pass
            else:
                await asyncio.sleep(args.gap)
            for i in range(16):
                t0 = time.perf_counter()
                await engine.push_kv_cache(src, idx, timeout=5)
                per[i].append(time.perf_counter() - t0)
        med = [statistics.median(p) * 1e6 for p in per]
        print(f"{args.transport}, {args.size} B, gap {args.gap} s{' pinned' if args.pin else ''}"
              f"{' spun' if args.spin else ''}: median us by place in the burst: "
              + " ".join(f"{m:.0f}" for m in med) + f" | a burst {sum(med) / 1e3:.2f} ms")
    finally:
        await side.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("size", type=int)
    ap.add_argument("gap", type=float)
    ap.add_argument("--bursts", type=int, default=60)
    ap.add_argument("--transport", default="tcp", choices=["tcp", "shm", "ucx"])
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--spin", action="store_true")
    uvloop.run(main(ap.parse_args()))
