"""Many-to-many load across network namespaces: `kvengine bench cluster` (needs root).

    sudo kvengine bench cluster                      # 4 prefill x 4 decode hosts, no fault
    sudo kvengine bench cluster --fault partition    # a no-fault run, then the same with a fault
    sudo kvengine bench cluster --hosts 2 --seconds 4

Builds the multi-host test bed (kvengine/bench/netbed.py: one namespace per host
on a bridge, addresses 10.213.0.x inside the namespaces only), starts an engine
per host, links every prefill to every decode, and runs kvengine/bench/mix.py's
load: one-layer 64 KiB pushes with 20 ms deadlines and 16 MiB whole-request
pushes, from every prefill to every decode. Every push carries a notification;
each decode checks the bytes each one names, and counts them: a success must be
notified exactly once, a failure never: after a partition or a stop the prefills link
to the faulted host again, and the notifications it had not acknowledged are sent
again (kvengine/notify.py). With ``--fault`` the fault hits the first
decode host halfway through the second run: ``partition`` (its port down, no
RST), ``kill`` (SIGKILL), ``stop`` (SIGSTOP, SIGCONT after the run) or ``slow``
(tbf 1 Gbit/s). Reports, for the faulted host and for the rest: aggregate GB/s,
one-layer p50/p99, deadline misses, transfers by status, notifications; and the
rest's one-layer p99 against the no-fault run's. Table, JSON and PNG (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections import Counter
from typing import Any

from . import mix
from .common import Report, out_paths, save_outputs
from .netbed import SECRET, Agent, NetBed, can_create_namespaces, percentile

FAULTS = ("none", "partition", "kill", "stop", "slow")


async def _phase(bed: NetBed, prefills: list[Agent], decodes: list[Agent], caches: dict[int, tuple[int, int]],
                 srcs: dict[int, tuple[int, int]], fault: str, seconds: float, gap: float) -> dict[str, Any]:
    victim = decodes[0]
    await asyncio.gather(*(d.call("verify_start") for d in decodes))
    targets = [[d.cluster_id, *caches[d.cluster_id]] for d in decodes]
    runs = [p.call("mix", timeout=seconds + 60, index=i, layer_cache=srcs[p.cluster_id][0],
                   big_cache=srcs[p.cluster_id][1], targets=targets, seconds=seconds, gap=gap)
            for i, p in enumerate(prefills)]
    task = asyncio.gather(*runs)
    if fault != "none":
        await asyncio.sleep(seconds / 2)   # the fault lands mid-run
        if fault == "partition":
            bed.cut(victim.host)
        elif fault == "kill":
            os.kill(victim.pid, signal.SIGKILL)
        elif fault == "stop":
            os.kill(victim.pid, signal.SIGSTOP)
        elif fault == "slow":
            bed.shape(victim.host, "1gbit")
    results = await task
    if fault == "partition":
        bed.heal(victim.host)
    elif fault == "stop":
        os.kill(victim.pid, signal.SIGCONT)
    elif fault == "slow":
        bed.unshape(victim.host)
    if fault in ("partition", "stop"):   # link again: unacknowledged notifications are sent again
        await asyncio.gather(*(_relink(p, victim) for p in prefills))
    checks = {}
    for d in decodes:
        if fault == "kill" and d is victim:
            continue
        expect = sum(len(r["per"][str(d.cluster_id)]["ok_seqs"]) for r in results)
        checks[d.cluster_id] = await d.call("verify_stop", timeout=60, expect=expect)
    groups = {"faulted": [victim.cluster_id] if fault != "none" else [],
              "rest" if fault != "none" else "all": [d.cluster_id for d in decodes
                                                      if fault == "none" or d is not victim]}
    resent = 0
    for p in prefills:
        resent += (await p.call("stats"))["stats"]["notifications"]["resent"]
    return {"fault": fault, "seconds": seconds, "notes_resent": resent,
            "groups": {g: _summary(results, checks, ids, seconds) for g, ids in groups.items() if ids}}


async def _relink(p: Agent, d: Agent, attempts: int = 50) -> None:
    """Link ``p`` to ``d`` again once both ends have let the failed link go."""
    for _ in range(attempts):
        if str(d.cluster_id) in (await p.call("stats"))["stats"]["links"]:
            return
        if (await p.call("link", cluster_id=d.cluster_id, address=d.address))["status"] == 0:
            return
        await asyncio.sleep(0.1)   # the other end still holds the failed link (ALREADY_LINK)
    raise RuntimeError(f"cluster {p.cluster_id} could not link to {d.cluster_id} again")


def _summary(results: list[dict[str, Any]], checks: dict[int, dict[str, Any]], ids: list[int],
             seconds: float) -> dict[str, Any]:
    lat: list[float] = []
    status: Counter[str] = Counter()
    nbytes = notified = 0
    for r in results:
        for cid in ids:
            p = r["per"][str(cid)]
            lat += p["lat"]
            status.update(p["status"])
            nbytes += p["bytes"]
            notified += p["notified"]
    ok = bad = dup = missing = stray = 0
    checked = all(cid in checks for cid in ids)
    for cid in ids:
        c = checks.get(cid, {})
        ok += sum(c.get("good", {}).values())
        bad += sum(c.get("bad", {}).values())
        dup += sum(c.get("dup", {}).values())
        if cid in checks:   # per source: the notified pushes that succeeded against those received
            for r in results:
                src = str(r["src"])
                sent = set(r["per"][str(cid)]["ok_seqs"])
                got = set(c.get("seqs", {}).get(src, ()))
                missing += len(sent - got)
                stray += len(got - sent)   # a notification for a push that did not succeed
    return {"GBps": nbytes / seconds / 1e9, "layer_p50_ms": percentile(lat, 50) * 1e3 if lat else float("nan"),
            "layer_p99_ms": percentile(lat, 99) * 1e3 if lat else float("nan"), "layer_pushes": len(lat),
            "misses": sum(v for k, v in status.items() if k.endswith("LLM_TIMEOUT")), "status": dict(status),
            "successes_notified": notified, "notes_ok": ok if checked else None, "notes_bad": bad, "notes_dup": dup,
            "notes_missing": missing, "notes_for_failures": stray,
            "exactly_once": (missing == 0 and stray == 0 and bad == 0 and dup == 0) if checked else None,
            "no_wrong_note": (stray == 0 and bad == 0 and dup == 0) if checked else None}


async def run(args: argparse.Namespace) -> Report:
    n = args.hosts
    bed = NetBed(2 * n).setup()
    try:
        prefills = list(await asyncio.gather(*(bed.spawn(i, 1 + i, role="PROMPT", secret=SECRET)
                                               for i in range(n))))
        decodes = list(await asyncio.gather(*(bed.spawn(n + j, 101 + j, secret=SECRET)
                                              for j in range(n))))
        srcs = {}
        for p in prefills:
            layer = await p.call("alloc", n=mix.TENSORS, shape=[mix.LAYER_ROWS, mix.LAYER], dtype="uint8",
                                 fill=p.cluster_id)
            big = await p.call("alloc", n=mix.TENSORS, shape=[1, mix.BIG], dtype="uint8", fill=p.cluster_id)
            srcs[p.cluster_id] = (layer["cache_id"], big["cache_id"])
        caches = {}
        for d in decodes:
            layer = await d.call("alloc", n=mix.TENSORS, shape=[n * mix.LAYER_ROWS, mix.LAYER], dtype="uint8")
            big = await d.call("alloc", n=mix.TENSORS, shape=[n, mix.BIG], dtype="uint8")
            caches[d.cluster_id] = (layer["cache_id"], big["cache_id"])
        phases = []
        for fault in ["none"] + ([args.fault] if args.fault != "none" else []):
            for p in prefills:   # every link up before each run
                for d in decodes:
                    if str(d.cluster_id) in (await p.call("stats"))["stats"]["links"]:
                        continue
                    st = (await p.call("link", cluster_id=d.cluster_id, address=d.address))["status"]
                    if st:
                        raise RuntimeError(f"cluster {p.cluster_id} could not link to {d.cluster_id}: {st:#x}")
            print(f"running {args.seconds:g} s, fault: {fault} ...", flush=True)
            phases.append(await _phase(bed, prefills, decodes, caches, srcs, fault, args.seconds, args.gap))
    finally:
        await bed.aclose()
    out: Report = {"hosts": n, "seconds": args.seconds, "phases": phases}
    if len(phases) == 2:
        base, rest = phases[0]["groups"]["all"], phases[1]["groups"]["rest"]
        out["rest_p99_over_no_fault"] = rest["layer_p99_ms"] / base["layer_p99_ms"]
    return out


def table(r: Report) -> str:
    head = (f"{'run':<10} {'hosts':<8} {'GB/s':>6} {'p50 ms':>7} {'p99 ms':>7} {'misses':>6} {'pushes':>7}  "
            f"{'notified ok/successes':>22} {'lost':>5} {'wrong':>5}  statuses")
    lines = [head, "-" * len(head)]
    for ph in r["phases"]:
        for g, s in ph["groups"].items():
            notes = f"{s['notes_ok']}/{s['successes_notified']}" if s["notes_ok"] is not None else "n/a (killed)"
            lines.append(f"{ph['fault']:<10} {g:<8} {s['GBps']:>6.2f} {s['layer_p50_ms']:>7.2f} "
                         f"{s['layer_p99_ms']:>7.2f} {s['misses']:>6} {s['layer_pushes']:>7}  {notes:>22} "
                         f"{s['notes_missing']:>5} {s['notes_for_failures'] + s['notes_bad'] + s['notes_dup']:>5}  "
                         + ", ".join(f"{k} {v}" for k, v in sorted(s["status"].items())))
    return "\n".join(lines)


def plot(r: Report, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    labels, p50, p99, gbps = [], [], [], []
    for ph in r["phases"]:
        for g, s in ph["groups"].items():
            labels.append(f"{ph['fault']}\n{g}")
            p50.append(s["layer_p50_ms"])
            p99.append(s["layer_p99_ms"])
            gbps.append(s["GBps"])
    xs = list(range(len(labels)))
    axes[0].bar([x - 0.2 for x in xs], p50, 0.4, label="one-layer p50")
    axes[0].bar([x + 0.2 for x in xs], p99, 0.4, label="one-layer p99")
    axes[0].axhline(mix.LAYER_DEADLINE * 1e3, color="grey", ls=":", label="deadline")
    axes[0].set_ylabel("ms")
    axes[1].bar(xs, gbps)
    axes[1].set_ylabel("GB/s delivered")
    for ax in axes:
        ax.set_xticks(xs, labels, fontsize=8)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"kvengine bench cluster: {r['hosts']} prefill x {r['hosts']} decode hosts, "
                 f"{r['seconds']:g} s per run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvengine bench cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4, help="prefill hosts = decode hosts (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each run (default: %(default)s)")
    ap.add_argument("--fault", choices=FAULTS, default="none", help="(default: %(default)s)")
    ap.add_argument("--gap", type=float, default=0.002,
                    help="pause between a prefill's one-layer pushes, seconds (default: %(default)s)")
    ap.add_argument("--out", default="kvengine-bench/cluster", help="output prefix (default: %(default)s)")
    ap.add_argument("--json", default=None, help="JSON path (default: OUT.json)")
    args = ap.parse_args(argv)
    if not 1 <= args.hosts <= 16 or args.seconds <= 0:
        ap.error("--hosts must be in 1..16 and --seconds positive")
    why = can_create_namespaces()
    if why is not None:
        print(f"kvengine bench cluster needs network namespaces: {why}", file=sys.stderr)
        return 2
    r = asyncio.run(run(args))
    print("\n" + table(r))
    for ph in r["phases"]:
        if ph["fault"] != "none":
            print(f"notifications sent again after the relink (cumulative, all prefills): {ph['notes_resent']}")
    if "rest_p99_over_no_fault" in r:
        ratio = r["rest_p99_over_no_fault"]
        print(f"\nthe unfaulted hosts' one-layer p99 under --fault {args.fault}: {ratio:.2f}x the no-fault run's "
              f"(goal <= 1.5x): {'MET' if ratio <= 1.5 else 'NOT MET'}")
    groups = [(g, s) for ph in r["phases"] for g, s in ph["groups"].items()]
    once = all(s["exactly_once"] is not False for g, s in groups)
    right = all(s["no_wrong_note"] is not False for g, s in groups)
    print("notifications: every byte checked; exactly one per success, none for failures (the faulted host "
          f"after the link is made again; not checked on a killed one): {'yes' if once else 'NO'}; "
          f"no wrong or duplicate notification anywhere: {'yes' if right else 'NO'}")
    json_path, png_path = out_paths(args.out, args.json)
    print(save_outputs(json_path, png_path, r, plot))
    return 0 if once and right else 1


if __name__ == "__main__":
    sys.exit(main())
