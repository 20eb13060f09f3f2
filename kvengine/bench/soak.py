"""Soak: mixed load between two engines for N minutes; does anything grow?

    kvengine bench soak --minutes 10            # tcp (the default), or --transport shm|ucx
    kvengine bench soak --minutes 1 --cycle 10  # a quick look

A prefill engine here and a decode engine in a child process (kvengine._peer).
Each cycle runs ``--cycle`` seconds of load, then lets it drain and samples both
processes at rest:

- load: one-layer pushes (2 x 32 KiB) with a notification, awaited one at a time;
  16 MiB whole-cache pushes; pulls of one-layer rows; every cycle a prefill cache
  is unregistered and a new one allocated, every fourth cycle the link is torn
  down and made again (lifetimes churn, not just traffic); the decode side
  consumes its notifications as they come (``notifications()``, as a decode
  worker does: unconsumed ones are buffered up to ``max_notifications``, then
  the oldest dropped);
- at rest (the decode side has consumed the rest of its notifications and mapped
  the new prefill cache, so no announcement is in flight): RSS (VmRSS),
  open fds and threads of each process (/proc) and the native live counters
  (jobs_live, regions_live, tcp_conns; over ucx also the receives pending or
  orphaned, the endpoint closes under way, and the endpoints kept by UCX or
  parked for a peer's next link) of each engine are sampled. Notifications:
  exactly one per successful notified push, received and consumed.

Passes when, after the warm-up cycles, every rest sample matches the first one
after warm-up: fds, threads and live counters equal, RSS within 5%; every
notified push that succeeded was notified once; a byte check of one row per cycle
held. Prints a table, writes JSON and a PNG (--out, default kvengine-bench/soak).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import time
from collections import Counter
from typing import Any

import numpy as np

import kvengine as kv
from kvengine._peer import PeerProcess, fill_pattern, row_digests

from .common import Report, get_runner, out_paths, save_outputs

S = kv.LLMStatusCode
LAYER = 32 << 10
BIG = 8 << 20          # 2 x 8 MiB = 16 MiB per whole-cache push
WARMUP = 2             # cycles before the baseline
RSS_TOLERANCE = 0.05


def proc_sample(pid: int) -> dict[str, int]:
    """Current RSS (kB), open fds and threads of ``pid``, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"rss_kb": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": len(os.listdir(f"/proc/{pid}/task"))}


LIVE = ("jobs_live", "regions_live", "tcp_conns")
UCX_LIVE = ("ucx_rx_pending", "ucx_rx_orphans", "ucx_ep_closing", "ucx_ep_kept", "ucx_ep_parked")


def live(native: dict[str, int], transport: str) -> dict[str, int]:
    keys = LIVE + (UCX_LIVE if transport == "ucx" else ())
    return {k: int(native.get(k, 0)) for k in keys}


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.secret = secrets.token_hex(16).encode()
        self.samples: list[dict[str, Any]] = []
        self.statuses: Counter[str] = Counter()
        self.notified_ok = 0
        self.notes_taken = 0   # notifications the decode side consumed
        self.bytes = 0

    async def run(self) -> Report:
        a = self.args
        opts = kv.EngineOptions(transport=a.transport, secret=self.secret)
        peer = await PeerProcess.start(cluster_id=2, transport=a.transport, secret=self.secret)
        e = await kv.KvEngine(1, kv.Role.PROMPT, None, opts).start()
        try:
            await peer.call("consume_notes")   # as a decode worker does: as they come
            layer_dst = (await peer.call("alloc", n=2, shape=[64, LAYER], dtype="uint8"))["cache_id"]
            big_dst = (await peer.call("alloc", n=2, shape=[1, BIG], dtype="uint8"))["cache_id"]
            pull_src = (await peer.call("alloc", n=2, shape=[1, LAYER], dtype="uint8", fill=3))["cache_id"]
            info = kv.ClusterInfo(2, peer.address)
            layer_src, big_src = self.fresh(e, 64, LAYER), self.fresh(e, 1, BIG)
            pull_dst = e.allocate_cache(kv.CacheDesc(2, (1, LAYER), np.uint8))
            cycles = max(WARMUP + 2, int(a.minutes * 60 // (a.cycle + 1)))
            t_start = time.monotonic()
            for c in range(cycles):
                if c % 4 == 0 or 2 not in e.stats()["links"]:
                    if 2 in e.stats()["links"]:
                        await e.unlink_clusters([info])
                    st, per = await e.link_clusters([info])
                    assert st == S.LLM_SUCCESS, per
                    for cid in (layer_dst, big_dst, pull_src):
                        await e.wait_remote_cache(2, cid, timeout=10)
                await self.load(e, layer_src, big_src, pull_dst, layer_dst, big_dst, pull_src, a.cycle)
                await self.check_bytes(peer, big_src, big_dst)
                self.notes_taken += (await peer.call("take_notes"))["taken"]
                await e.unregister_kv_cache(layer_src.cache_id)   # lifetimes churn too
                layer_src = self.fresh(e, 64, LAYER)
                # at rest means the decode side has mapped the new cache (and closed its memfd):
                # sampled while that was under way, its fds and RSS would differ by that cache
                await peer.call("wait_remote", cluster_id=1, cache_id=layer_src.cache_id)
                self.samples.append(await self.sample(e, peer, c, time.monotonic() - t_start))
                s = self.samples[-1]
                print(f"cycle {c + 1}/{cycles} at {s['t']:.0f} s: prefill RSS {s['prefill']['rss_kb']} kB "
                      f"fds {s['prefill']['fds']} threads {s['prefill']['threads']}, decode RSS "
                      f"{s['decode']['rss_kb']} kB fds {s['decode']['fds']}; live {s['prefill_live']} / "
                      f"{s['decode_live']}; {sum(self.statuses.values())} transfers", flush=True)
            notes = (await peer.call("stats"))["stats"]["notifications"]
        finally:
            await e.close()
            await peer.close()
        return self.report(notes)

    @staticmethod
    def fresh(e: kv.KvEngine, rows: int, width: int) -> kv.Cache:
        cache = e.allocate_cache(kv.CacheDesc(2, (rows, width), np.uint8))
        for i, t in enumerate(cache.tensors):
            fill_pattern(t, rows, i)
        return cache

    async def load(self, e: kv.KvEngine, layer_src: kv.Cache, big_src: kv.Cache, pull_dst: kv.Cache,
                   layer_dst: int, big_dst: int, pull_src: int, seconds: float) -> None:
        end = time.monotonic() + seconds

        async def layers() -> None:
            row = 0
            while time.monotonic() < end:
                t = e.submit_push_kv_cache(layer_src, kv.CacheIndex(2, layer_dst, row), row, timeout=1.0,
                                           notify=b"soak")
                st = await t
                self.count(st, t.nbytes)
                self.notified_ok += st == S.LLM_SUCCESS
                row = (row + 1) % 64

        async def bigs() -> None:
            while time.monotonic() < end:
                t = e.submit_push_kv_cache(big_src, kv.CacheIndex(2, big_dst, 0), timeout=5.0)
                self.count(await t, t.nbytes)

        async def pulls() -> None:
            while time.monotonic() < end:
                t = e.submit_pull_kv_cache(kv.CacheIndex(2, pull_src, 0), pull_dst, timeout=1.0)
                self.count(await t, t.nbytes)
                await asyncio.sleep(0.002)
        await asyncio.gather(layers(), bigs(), pulls())

    def count(self, st: kv.LLMStatusCode, nbytes: int) -> None:
        self.statuses[S(st).name] += 1
        self.bytes += nbytes

    async def check_bytes(self, peer: PeerProcess, big_src: kv.Cache, big_dst: int) -> None:
        want = row_digests(big_src.tensors)
        got = (await peer.call("digest", cache_id=big_dst))["rows"]
        if got != want:
            raise AssertionError("the decode side's whole-cache row differs from what was pushed")

    async def sample(self, e: kv.KvEngine, peer: PeerProcess, cycle: int, t: float) -> dict[str, Any]:
        for _ in range(100):   # at rest: every transfer resolved (each has a deadline)
            if e.stats()["native"]["jobs_live"] == 0:
                break
            await asyncio.sleep(0.01)
        d = (await peer.call("stats"))["stats"]
        return {"cycle": cycle, "t": t, "prefill": proc_sample(os.getpid()), "decode": proc_sample(peer.pid),
                "prefill_live": live(e.stats()["native"], self.args.transport),
                "decode_live": live(d["native"], self.args.transport)}

    def report(self, notes: dict[str, int]) -> Report:
        base = self.samples[WARMUP]
        problems = []
        for s in self.samples[WARMUP + 1:]:
            for side in ("prefill", "decode"):
                for k in ("fds", "threads"):
                    if s[side][k] != base[side][k]:
                        problems.append(f"cycle {s['cycle'] + 1}: {side} {k} {base[side][k]} -> {s[side][k]}")
                grow = s[side]["rss_kb"] / base[side]["rss_kb"] - 1
                if abs(grow) > RSS_TOLERANCE:
                    problems.append(f"cycle {s['cycle'] + 1}: {side} RSS {grow:+.1%}")
                if s[f"{side}_live"] != base[f"{side}_live"]:
                    problems.append(f"cycle {s['cycle'] + 1}: {side} live {base[side + '_live']} -> "
                                    f"{s[side + '_live']}")
        if notes.get("received", 0) != self.notified_ok or self.notes_taken != self.notified_ok:
            problems.append(f"{self.notified_ok} notified pushes succeeded, {notes.get('received')} "
                            f"notifications received, {self.notes_taken} consumed")
        last = self.samples[-1]
        return {"transport": self.args.transport, "minutes": self.args.minutes, "cycle_s": self.args.cycle,
                "statuses": dict(self.statuses), "bytes": self.bytes, "notified_ok": self.notified_ok,
                "notifications": notes, "notes_taken": self.notes_taken, "samples": self.samples, "problems": problems,
                "rss_growth": {side: last[side]["rss_kb"] / base[side]["rss_kb"] - 1
                               for side in ("prefill", "decode")}}


def plot(r: Report, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    t = [s["t"] / 60 for s in r["samples"]]
    for ax, key, label in ((axes[0], "rss_kb", "RSS (MiB)"), (axes[1], "fds", "open fds"),
                           (axes[2], "threads", "threads")):
        for side, style in (("prefill", "o-"), ("decode", "s--")):
            ys = [s[side][key] / (1024 if key == "rss_kb" else 1) for s in r["samples"]]
            ax.plot(t, ys, style, label=side, markersize=3)
        ax.axvline(r["samples"][WARMUP]["t"] / 60, color="grey", ls=":", label="baseline (after warm-up)")
        ax.set_xlabel("minutes")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    verdict = "flat" if not r["problems"] else f"{len(r['problems'])} problems"
    fig.suptitle(f"kvengine bench soak --transport {r['transport']}: {r['minutes']:g} min, "
                 f"{sum(r['statuses'].values())} transfers, {r['bytes'] / 1e9:.1f} GB: {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvengine bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="how long (default: %(default)s)")
    ap.add_argument("--cycle", type=float, default=20.0,
                    help="seconds of load between two rest samples (default: %(default)s)")
    ap.add_argument("--transport", choices=("tcp", "shm", "ucx"), default="tcp", help="(default: %(default)s)")
    ap.add_argument("--loop", default="auto", choices=("auto", "uvloop", "asyncio"),
                    help="event loop (default: %(default)s: uvloop when installed)")
    ap.add_argument("--out", default="kvengine-bench/soak", help="output prefix (default: %(default)s)")
    ap.add_argument("--json", default=None, help="JSON path (default: OUT.json)")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.cycle <= 0:
        ap.error("--minutes and --cycle must be positive")
    _, run = get_runner(args.loop)
    r = run(Soak(args).run())
    print(f"\n{sum(r['statuses'].values())} transfers ({', '.join(f'{k} {v}' for k, v in r['statuses'].items())}), "
          f"{r['bytes'] / 1e9:.1f} GB; notified pushes ok {r['notified_ok']}, notifications "
          f"{r['notifications']}; RSS growth after warm-up: prefill {r['rss_growth']['prefill']:+.1%}, "
          f"decode {r['rss_growth']['decode']:+.1%}")
    print("soak: flat (fds, threads and live counters back to the baseline at every rest, RSS within 5%)"
          if not r["problems"] else "soak: NOT flat:\n  " + "\n  ".join(r["problems"]))
    json_path, png_path = out_paths(args.out, args.json)
    print(save_outputs(json_path, png_path, r, plot))
    return 0 if not r["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
