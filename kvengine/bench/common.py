"""Pieces every ``kvengine bench`` command shares: percentiles, a progress bar
(tqdm, or plain prints without it), the machine-load check, run metadata and
the JSON/PNG output paths. No third-party import at module level."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Callable, Coroutine, Protocol, Sequence, TypeVar

KiB = 1 << 10
MiB = 1 << 20

# A report, or a part of one: what a run writes as JSON (numbers, strings, lists, dicts).
Report = dict[str, Any]
# cpu_snapshot(): (wall seconds, {pid: (ppid, CPU ticks)}, steal seconds)
Snapshot = tuple[float, dict[int, tuple[int, int]], float, dict[str, int]]

_T = TypeVar("_T")


class Runner(Protocol):
    """asyncio.run or uvloop.run: run a coroutine to its result."""
    def __call__(self, main: Coroutine[Any, Any, _T], /) -> _T: ...


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of xs, nearest rank below; nan for no samples."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def fmt_bytes(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    for unit, k in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def fmt_seconds(s: float) -> str:
    """A duration that never reads "0 s": 12 s, 2.5 s, 340 ms, 4.2 ms, 80 us."""
    if s >= 10:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.1f} s"
    if s >= 0.01:
        return f"{s * 1e3:.0f} ms"
    if s >= 0.001:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def short_bytes(n: int) -> str:
    """4M, 32K, ..."""
    for unit, k in (("G", 1 << 30), ("M", MiB), ("K", KiB)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def parse_bytes(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": KiB, "M": MiB, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


class Progress:
    """A progress bar over ``total`` steps: tqdm when installed, else one line per ``every`` steps."""

    def __init__(self, total: int, desc: str, every: int | None = None) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self.every = every or max(1, total // 10)
        self._t0 = time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
            print(f"{desc}: {total} steps (pip install tqdm for a progress bar)", flush=True)
        else:
            self.bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, leave=True,
                            file=sys.stderr)

    def step(self, note: str = "") -> None:
        self.n += 1
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(1)
        elif self.n % self.every == 0 or self.n == self.total:
            print(f"  {self.desc}: {self.n}/{self.total} ({fmt_seconds(time.perf_counter() - self._t0)}) {note}",
                  flush=True)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------- machine load

def cpu_snapshot() -> Snapshot:
    """(wall, {pid: (ppid, CPU ticks incl. reaped children)} of every process, steal seconds), from /proc."""
    procs: dict[int, tuple[int, int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            procs[int(d)] = (int(rest[1]), sum(int(x) for x in rest[11:15]))   # utime stime cutime cstime
        except (OSError, IndexError, ValueError):
            pass
    try:
        with open("/proc/stat") as f:
            steal = int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        steal = 0
    return time.perf_counter(), procs, steal / os.sysconf("SC_CLK_TCK"), tcp_counters()


_TCP_COUNTERS = {"Tcp": ("RetransSegs",), "TcpExt": ("TCPOFOQueue", "TCPDSACKRecv")}


def tcp_counters() -> dict[str, int]:
    """This network namespace's TCP retransmission and reordering counters (/proc/net/snmp,
    /proc/net/netstat): RetransSegs, TCPOFOQueue (segments queued out of order),
    TCPDSACKRecv (retransmissions the receiver already had: spurious). Missing ones are left out."""
    out: dict[str, int] = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for names, values in zip(lines[::2], lines[1::2]):
            proto, _, keys = names.partition(":")
            want = _TCP_COUNTERS.get(proto, ())
            for k, v in zip(keys.split(), values.partition(":")[2].split()):
                if k in want:
                    out[k] = int(v)
    return out


def tcp_congestion_control() -> str:
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip()
    except OSError:
        return "?"


def foreign_load(a: Snapshot, b: Snapshot) -> Report:
    """CPU time spent between two snapshots by processes outside this benchmark's process tree
    (including processes that started and ended in between, through their parents' reaped time)."""
    tck = os.sysconf("SC_CLK_TCK")
    mine, grew = {os.getpid()}, True
    while grew:
        new = {pid for pid, (ppid, _) in b[1].items() if ppid in mine} - mine
        grew = bool(new)
        mine |= new
    other = own = 0
    for pid, (_, t) in b[1].items():
        dt = t - a[1].get(pid, (0, 0))[1] if pid in a[1] else t
        if pid in mine:
            own += dt
        elif pid != 2 and b[1][pid][0] != 2:   # not kernel threads (softirq work lands in the senders' time)
            other += dt
    wall = b[0] - a[0]
    return {"wall_s": wall, "own_cpu_s": own / tck, "other_cpu_s": other / tck,
            "other_vcpu_fraction": other / tck / wall if wall > 0 else 0.0, "steal_cpu_s": b[2] - a[2],
            "tcp": {"congestion_control": tcp_congestion_control(),
                    **{k: v - a[3].get(k, v) for k, v in b[3].items()}}}


def record_timing(out: Report, t_setup: float, t_meas: float, snap0: Snapshot, columns: list[str]) -> None:
    """A run's bookkeeping once measuring ended: measuring and setup seconds, the other
    processes' CPU use meanwhile (since ``snap0``), the columns measured."""
    out["measure_s"] = time.perf_counter() - t_meas
    out["load"] = foreign_load(snap0, cpu_snapshot())
    out["setup_s"] = t_meas - t_setup
    out["columns"] = columns


async def interleaved_rounds(out: Report, t_setup: float, configs: list[str], rounds: int, label: str,
                             run: Callable[[str, int], Coroutine[Any, Any, list[float]]],
                             reverse: bool = False) -> dict[str, list[float]]:
    """``rounds`` rounds over every column, each round's order rotated (or, with ``reverse``,
    reversed every other round) so no column always goes first; ``run(column, round)`` gives
    that round's samples (its warm-up is the caller's). The run's timing goes into ``out``
    (:func:`record_timing`). Returns every column's samples."""
    lat: dict[str, list[float]] = {n: [] for n in configs}
    bar = Progress(rounds * len(configs), label, every=len(configs))
    snap0, t_meas = cpu_snapshot(), time.perf_counter()
    try:
        for r in range(rounds):
            if reverse:
                order = configs if r % 2 == 0 else configs[::-1]
            else:
                order = configs[r % len(configs):] + configs[:r % len(configs)]
            for name in order:
                lat[name] += await run(name, r)
                bar.step(f"round {r + 1} {name}")
    finally:
        bar.close()
    record_timing(out, t_setup, t_meas, snap0, configs)
    return lat


async def interleaved_sizes(out: Report, t_setup: float, configs: list[str], cases: Sequence[Any], reps: int,
                            label: str, measure: Callable[[str, Any], Coroutine[Any, Any, float]]
                            ) -> dict[tuple[int, str], list[float]]:
    """``reps`` repetitions of every size (``cases[k].nbytes``) over every column, the column
    order rotated per size and repetition; ``measure(column, case)`` gives one figure. The
    run's timing goes into ``out`` (:func:`record_timing`). Returns ``{(k, column): figures}``."""
    secs: dict[tuple[int, str], list[float]] = {(k, n): [] for k in range(len(cases)) for n in configs}
    bar = Progress(reps * len(cases) * len(configs), label)
    snap0, t_meas = cpu_snapshot(), time.perf_counter()
    try:
        for rep in range(reps):
            for k, c in enumerate(cases):
                r = (rep + k) % len(configs)
                for name in configs[r:] + configs[:r]:
                    secs[(k, name)].append(await measure(name, c))
                    bar.step(f"rep {rep + 1} {short_bytes(c.nbytes)} {name}")
    finally:
        bar.close()
    record_timing(out, t_setup, t_meas, snap0, configs)
    return secs


def load_line(ld: Report) -> str:
    return (f"other processes used {ld['other_cpu_s']:.1f} CPU-s during the {fmt_seconds(ld['wall_s'])} measured "
            f"({ld['other_vcpu_fraction'] * 100:.0f}% of one vCPU; this benchmark {ld['own_cpu_s']:.1f} CPU-s, "
            f"hypervisor steal {ld['steal_cpu_s']:.1f} CPU-s)"
            + ("  <-- the machine was busy: figures are depressed and noisier"
               if ld["other_vcpu_fraction"] > 0.1 else "")
            + tcp_line(ld.get("tcp") or {}))


def tcp_line(t: Report) -> str:
    """A warning when TCP retransmitted during the measurement (in this network namespace: on
    loopback under BBR, segments reordered between CPUs are retransmitted and the window
    shrinks, which can halve a small push's throughput; docs/benchmarks.md, "TCP on loopback")."""
    n = t.get("RetransSegs", 0)
    if not n:
        return ""
    return (f"\nTCP ({t.get('congestion_control', '?')}) retransmitted {n} segments during the measurement "
            f"({t.get('TCPDSACKRecv', 0)} of them spurious, {t.get('TCPOFOQueue', 0)} received out of order)  "
            "<-- tcp figures of this run may be depressed (on loopback under BBR: segments reordered between "
            "CPUs, docs/benchmarks.md \"TCP on loopback\")")


def busy_processes(threshold: float = 0.2, window: float = 1.0) -> list[str]:
    """Processes outside this one that used more than ``threshold`` of a vCPU over ``window`` seconds."""
    a = cpu_snapshot()
    time.sleep(window)
    b = cpu_snapshot()
    tck = os.sysconf("SC_CLK_TCK")
    out = []
    for pid, (ppid, t) in b[1].items():
        if pid == os.getpid() or pid == 2 or ppid == 2 or pid not in a[1]:
            continue
        frac = (t - a[1][pid][1]) / tck / (b[0] - a[0])
        if frac > threshold:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:100]
            except OSError:
                cmd = "?"
            out.append(f"pid {pid} ({frac * 100:.0f}% CPU): {cmd}")
    return out


# ---------------------------------------------------------------- metadata and output

def git_rev() -> str | None:
    """Short commit of the checkout kvengine was imported from (+dirty), or None when installed."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.isdir(os.path.join(root, ".git")):
        return None
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "kvengine", "cython_src"],
                               cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + "+dirty" if dirty else rev) or None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo): figures name it (AMD and Intel VMs differ)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        return "?"


def meta(argv: list[str] | None) -> dict[str, Any]:
    import numpy as np
    import kvengine as kv
    m: dict[str, Any] = {"kvengine": kv.__version__, "git": git_rev(), "python": sys.version.split()[0],
         "numpy": np.__version__, "machine": platform.machine(), "cpu": cpu_model(), "cpus": os.cpu_count(),
         "kernel": platform.release(), "argv": list(sys.argv[1:] if argv is None else argv),
         "time": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    try:
        import importlib.metadata
        m["uvloop"] = importlib.metadata.version("uvloop")
    except importlib.metadata.PackageNotFoundError:
        pass
    return m


def write_json(path: str, obj: Report) -> None:
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def save_outputs(json_path: str, png_path: str, data: Report, plot: Callable[[Report, str], None],
                 plot_data: Report | None = None) -> str:
    """Write ``data`` as JSON and ``plot(plot_data or data, png_path)``; the "wrote ..." line."""
    write_json(json_path, data)
    try:
        plot(data if plot_data is None else plot_data, png_path)
        return f"wrote {json_path} and {png_path}"
    except ImportError:
        return f"wrote {json_path} (pip install 'kvengine[bench]' for the PNG)"


def out_paths(out: str, json_path: str | None) -> tuple[str, str]:
    """(json path, png path) from --out PREFIX and --json PATH (a PREFIX given as the
    PNG's or the JSON's name, ``x.png``, is taken for ``x``: not ``x.png.png``)."""
    root, ext = os.path.splitext(out)
    if ext in (".png", ".json"):
        out = root
    d = os.path.dirname(out)
    if d:
        os.makedirs(d, exist_ok=True)
    return json_path or out + ".json", out + ".png"


def get_runner(loop: str) -> tuple[str, Runner]:
    """asyncio.run or uvloop.run, by name ('auto': uvloop when installed)."""
    import asyncio
    if loop in ("auto", "uvloop"):
        try:
            import uvloop
            return "uvloop", uvloop.run
        except ImportError:
            if loop == "uvloop":
                raise SystemExit("--loop uvloop: uvloop is not installed (pip install 'kvengine[bench]')")
    return "asyncio", asyncio.run
