"""Micro-measure (not the benchmark): a push's wall time by its place in a burst.

`kvengine bench throughput` measures bursts of back-to-back pushes with other columns
run in between; a 1 MiB tcp push costs more there than in a long back-to-back run, and
not only the first of a burst. This runs BURSTS bursts of 16 awaited pushes (2 tensors
x SIZE/2 bytes, into a decode engine in a child process), GAP seconds apart (slept),
after 300 warm-up pushes, and prints the median wall time of the push at each place
in the burst and their sum, and how often a CPU went idle in a halt (the cpuidle
states other than POLL, summed over CPUs: on a VM each is an exit to the hypervisor,
and waking that vCPU again costs tens of microseconds). ``--pin`` puts this process
on CPU 0 and the child on CPU 1 (all threads, `taskset -a`) after the warm-up;
``--io-cpus A,B`` pins only the two I/O threads (this process's on CPU A, the child's
on CPU B: ``0,0`` shares one CPU between them, ``0,1`` splits them); ``--spin`` spins
the loop thread through the gap instead of sleeping.

    python benchmarks/tcp_burst.py 1048576 0.02        # size, gap
    python benchmarks/tcp_burst.py 1048576 0           # no gap: the back-to-back figure
    python benchmarks/tcp_burst.py 65536 0.002 --io-cpus 0,0

Figures: docs/benchmarks.md, "1 MiB pushes in two frames" and "Bursts after a gap:
where the two I/O threads run"."""
import argparse
import asyncio
import glob
import os
import statistics
import subprocess
import time

import uvloop

from kvengine.bench.harness import KvSide


IO_THREAD = {"tcp": "kv-tcp-io", "ucx": "kv-ucx-io"}


def halts() -> int | None:
    """Entries into the CPUs' halting idle states so far (None: no cpuidle here)."""
    n, seen = 0, False
    for state in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cpuidle/state[0-9]*"):
        try:
            with open(f"{state}/name") as f:
                if f.read().strip() == "POLL":
                    continue
            with open(f"{state}/usage") as f:
                n += int(f.read())
            seen = True
        except OSError:
            continue
    return n if seen else None


def pin_io_thread(pid: int, name: str, cpu: str) -> None:
    tids = [t for t in os.listdir(f"/proc/{pid}/task")
            if open(f"/proc/{pid}/task/{t}/comm").read().strip() == name]
    if len(tids) != 1:
        raise SystemExit(f"expected one {name} thread in process {pid}, found {len(tids)}")
    os.sched_setaffinity(int(tids[0]), {int(cpu)})


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
        if args.io_cpus:
            a, b = args.io_cpus.split(",")
            pin_io_thread(os.getpid(), IO_THREAD[args.transport], a)
            pin_io_thread(peer.pid, IO_THREAD[args.transport], b)
        h0 = halts()
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
        h1 = halts()
        med = [statistics.median(p) * 1e6 for p in per]
        pins = (" pinned" if args.pin else "") + (f" I/O threads on CPUs {args.io_cpus}" if args.io_cpus else "")
        print(f"{args.transport}, {args.size} B, gap {args.gap} s{pins}"
              f"{' spun' if args.spin else ''}: median us by place in the burst: "
              + " ".join(f"{m:.0f}" for m in med) + f" | a burst {sum(med) / 1e3:.2f} ms"
              + ("" if h0 is None or h1 is None else f" | CPU halts {h1 - h0} ({(h1 - h0) / (16 * args.bursts):.2f} a push)"))
    finally:
        await side.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("size", type=int)
    ap.add_argument("gap", type=float)
    ap.add_argument("--bursts", type=int, default=60)
    ap.add_argument("--transport", default="tcp", choices=["tcp", "shm", "ucx"])
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--io-cpus", metavar="A,B", help="pin this process's I/O thread to CPU A, the child's to B")
    ap.add_argument("--spin", action="store_true")
    uvloop.run(main(ap.parse_args()))
