"""A process SIGKILLed, or SIGSTOPped then SIGCONTed, mid-transfer, on either side of a
link between two hosts (network namespaces), over kvengine's tcp data plane and over UCX's
tcp transport (``transport="ucx"``).

Prefill (host 0) links to decode (host 1); the survivor moves rows both ways (it pushes
rows into the victim and pulls rows from it) when the victim is killed or stopped.
Proves (docs/reliability.md): the survivor's transfers resolve LLM_LINK_FAILED within
HBT + HBI (+ slack) of the fault; no byte lands after the status, in the survivor's
memory (pull destination) nor, for a stopped victim, in the victim's (push destination),
also once it resumes; the survivor links to a fresh peer (host 2) and moves rows
byte-exact."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from kvengine import LLMStatusCode as S

from kvengine.bench import netbed
from kvengine.bench.netbed import HB, SECRET, SILENT_BOUND

ROWS, TENSORS, ROW_BYTES = 4, 2, 8 << 20
SRC_SEED, DST_SEED = 31, 42
WINDOW = 1.5   # after a stopped victim resumes and found its link gone: nothing may land
RATE, TBF_LATENCY = 125e6, 0.1   # bed.shape(1, "1gbit"): bytes/s, and the longest a packet waits in a tbf


def _queued_bound() -> float:
    """How long after the fault a transfer may still succeed: bytes the victim's kernel
    already held (its socket's send buffer at its largest) still reach the survivor at
    the shaped rate, and each of the two shaped hops may hold a packet for TBF_LATENCY.
    A success later than this did not come from bytes sent before the fault."""
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        wmem_max = int(f.read().split()[2])
    return wmem_max / RATE + 2 * TBF_LATENCY + 0.02


async def _alloc(agent, seed):
    return (await agent.call("alloc", n=TENSORS, shape=[ROWS, ROW_BYTES], dtype="uint8", fill=seed))["cache_id"]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("fault", ["kill", "stop"])
@pytest.mark.parametrize("victim_side", ["decode", "prefill"])
async def test_process_fault_mid_transfer(bed3, victim_side, fault, transport):
    bed = bed3
    bed.shape(1, "1gbit")   # the transfers are still in flight at the fault
    prefill, decode, fresh = await asyncio.gather(
        bed.spawn(0, 1, role="PROMPT", secret=SECRET, transport=transport, options=HB),
        bed.spawn(1, 2, secret=SECRET, transport=transport, options=HB),
        bed.spawn(2, 3, secret=SECRET, transport=transport, options=HB))
    assert (await prefill.call("link", cluster_id=2, address=decode.address))["status"] == 0
    surv, victim = (prefill, decode) if victim_side == "decode" else (decode, prefill)
    s_src, s_pull = await _alloc(surv, SRC_SEED), await _alloc(surv, DST_SEED)
    v_dst, v_src = await _alloc(victim, DST_SEED), await _alloc(victim, SRC_SEED)
    read_s_pull, read_v_dst = await netbed.remote_view(surv, s_pull), await netbed.remote_view(victim, v_dst)
    old, new = netbed.pattern(TENSORS, ROWS * ROW_BYTES, DST_SEED), netbed.pattern(TENSORS, ROWS * ROW_BYTES, SRC_SEED)
    vc = victim.cluster_id
    pushes = [(await surv.call("push_start", cache_id=s_src, cluster_id=vc, dst_cache_id=v_dst, src_batch=r,
                               dst_batch=r, deadline=30))["handle"] for r in range(ROWS)]
    pulls = [(await surv.call("pull_start", cache_id=s_pull, cluster_id=vc, src_cache_id=v_src, src_batch=r,
                              dst_batch=r, deadline=30))["handle"] for r in range(ROWS)]
    end = time.monotonic() + 10
    while True:
        n = (await surv.call("stats"))["stats"]["native"]
        if n[f"{transport}_bytes_sent"] > ROW_BYTES and n[f"{transport}_bytes_received"] > ROW_BYTES:
            break
        assert time.monotonic() < end, "the transfers did not start"
        await asyncio.sleep(0.01)
    os.kill(victim.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    t_fault = time.monotonic()
    try:
        if fault == "stop":
            while _state(victim.pid) != "T":
                assert time.monotonic() - t_fault < 5
                await asyncio.sleep(0.001)

        done = (await surv.call("bg", handles=pushes + pulls, wait=SILENT_BOUND + 5))["done"]
        at_status_pull = read_s_pull()
        at_status_dst = read_v_dst() if fault == "stop" else None   # stopped: what it holds now
        report = []
        for kind, res in (("push", done[:ROWS]), ("pull", done[ROWS:])):
            for r, (st, t0, t1) in enumerate(res):
                assert st is not None, f"{kind} of row {r} has no status {SILENT_BOUND + 5} s after the {fault}"
                report.append((kind, r, S(st).name, t1 - t_fault))
        print(f"\n{victim_side} {fault}: " + ", ".join(f"{k}{r} {st} {dt:+.3f} s" for k, r, st, dt in report))
        failed = [x for x in report if x[2] != "LLM_SUCCESS"]
        assert {x[0] for x in failed} == {"push", "pull"}, "pushes and pulls were not both in flight"
        queued = _queued_bound()
        for k, r, st, dt in report:
            if st == "LLM_SUCCESS":
                assert dt < queued, f"{k} of row {r} succeeded {dt:.3f} s after the {fault}"
            else:
                assert st == "LLM_LINK_FAILED", f"{k} of row {r}: {st}"
                assert dt <= SILENT_BOUND, f"{k} of row {r} resolved {dt:.2f} s after the {fault}"
        checks = [("survivor's pull destination", at_status_pull, done[ROWS:])]
        if at_status_dst is not None:
            checks.append(("victim's push destination", at_status_dst, done[:ROWS]))
        for name, now, res in checks:
            states = netbed.rows_state(now, old, new, ROWS)
            assert "garbage" not in states, f"{name}: {states}"
            for r, (st, _, _) in enumerate(res):
                if st == S.LLM_SUCCESS:
                    assert states[r] == "new", f"{name}: row {r} succeeded but is {states[r]}"
    finally:
        if fault == "stop":
            os.kill(victim.pid, signal.SIGCONT)
    if fault == "stop":
        assert (await victim.call("wait_link_down", cluster_id=surv.cluster_id, timeout=SILENT_BOUND + 5))["down"]
    await asyncio.sleep(WINDOW)   # the observation window itself
    assert netbed.changed(at_status_pull, read_s_pull()) == 0, "bytes landed in the survivor after the statuses"
    if at_status_dst is not None:
        assert netbed.changed(at_status_dst, read_v_dst()) == 0, "bytes landed in the victim after the statuses"
    stats = (await surv.call("stats"))["stats"]
    assert str(vc) not in stats["links"] and stats["native"]["jobs_live"] == 0

    # the survivor links to a fresh peer and moves rows, byte-exact
    f_dst = await _alloc(fresh, DST_SEED)
    assert (await surv.call("link", cluster_id=3, address=fresh.address))["status"] == 0
    r = await surv.call("series", cache_id=s_src, targets=[[3, f_dst]], n=ROWS, rows=ROWS, deadline=10, timeout=60)
    assert r["status"] == {"3": {"LLM_SUCCESS": ROWS}}, r["status"]
    assert (await fresh.call("digest", cache_id=f_dst))["rows"] == (await surv.call("digest", cache_id=s_src))["rows"]
    print(f"{victim_side} {fault}: detection max {max(x[3] for x in failed):.3f} s, bound {SILENT_BOUND} s")
