"""Partition without RST (a switch port down) across network namespaces, under load,
over kvengine's tcp data plane and over UCX's tcp transport (``transport="ucx"``).

Host 0 pushes rows into host 1 and pulls rows from it while host 1's port goes down;
host 2 keeps being served. Proves (docs/reliability.md): every in-flight transfer
resolves LLM_LINK_FAILED within HBT + HBI (+ slack) of the cut; no byte lands after the
status, also once the link heals and the kernel retransmits what was in flight; the
other link is unaffected; after the heal the same peers link again and move bytes
byte-exact."""

from __future__ import annotations

import asyncio
import time

from kvengine import LLMStatusCode as S

from kvengine.bench import netbed
from kvengine.bench.netbed import HB, SECRET, SILENT_BOUND

ROWS, TENSORS, ROW_BYTES = 4, 2, 8 << 20     # a push or pull moves one row: 2 x 8 MiB
SRC_SEED, DST_SEED = 11, 22
LINK_RATE = "1gbit"   # the victim's link, so that the transfers are still in flight at the cut
WINDOW = 1.5          # after the heal: retransmissions have time to arrive (none may land)


async def _alloc(agent, seed):
    return (await agent.call("alloc", n=TENSORS, shape=[ROWS, ROW_BYTES], dtype="uint8", fill=seed))["cache_id"]


async def test_partition_fails_in_flight_transfers_in_bound_and_lands_nothing_after(bed3, transport):
    bed = bed3
    bed.shape(1, LINK_RATE)
    p, victim, other = await asyncio.gather(
        bed.spawn(0, 1, role="PROMPT", secret=SECRET, transport=transport, options=HB),
        bed.spawn(1, 2, secret=SECRET, transport=transport, options=HB),
        bed.spawn(2, 3, secret=SECRET, transport=transport, options=HB))
    # prefill: src (pushed from), pulled (pulled into); victim: dst (pushed into), src2 (pulled from)
    p_src, p_pull = await _alloc(p, SRC_SEED), await _alloc(p, DST_SEED)
    v_dst, v_src = await _alloc(victim, DST_SEED), await _alloc(victim, SRC_SEED)
    o_dst = await _alloc(other, DST_SEED)
    for a in (victim, other):
        assert (await p.call("link", cluster_id=a.cluster_id, address=a.address))["status"] == 0
    assert (await p.call("stats"))["stats"]["links"]["2"]["transport"] == transport
    read_v_dst, read_p_pull = await netbed.remote_view(victim, v_dst), await netbed.remote_view(p, p_pull)
    old, new = netbed.pattern(TENSORS, ROWS * ROW_BYTES, DST_SEED), netbed.pattern(TENSORS, ROWS * ROW_BYTES, SRC_SEED)

    pushes = [(await p.call("push_start", cache_id=p_src, cluster_id=2, dst_cache_id=v_dst, src_batch=r,
                            dst_batch=r, deadline=30))["handle"] for r in range(ROWS)]
    pulls = [(await p.call("pull_start", cache_id=p_pull, cluster_id=2, src_cache_id=v_src, src_batch=r,
                           dst_batch=r, deadline=30))["handle"] for r in range(ROWS)]
    # mid-transfer: some bytes moved both ways, far from all (4 rows of 16 MiB each way at 1 Gbit/s)
    end = time.monotonic() + 10
    while True:
        n = (await p.call("stats"))["stats"]["native"]
        if n[f"{transport}_bytes_sent"] > ROW_BYTES and n[f"{transport}_bytes_received"] > ROW_BYTES:
            break
        assert time.monotonic() < end, "the transfers did not start"
        await asyncio.sleep(0.01)
    bed.cut(1)
    t_cut = time.monotonic()

    # the other link carries on, byte-exact, while the victim's is being declared lost
    o_series = await p.call("series", cache_id=p_src, targets=[[3, o_dst]], n=60, rows=ROWS, deadline=5,
                            gap=0.02, timeout=60)
    assert o_series["status"] == {"3": {"LLM_SUCCESS": 60}}, o_series["status"]
    assert (await other.call("digest", cache_id=o_dst))["rows"] == (await p.call("digest", cache_id=p_src))["rows"]

    done = (await p.call("bg", handles=pushes + pulls, wait=SILENT_BOUND + 5))["done"]
    at_status_dst, at_status_pull = read_v_dst(), read_p_pull()
    report = []
    for kind, hs, res in (("push", pushes, done[:ROWS]), ("pull", pulls, done[ROWS:])):
        for r, (st, t0, t1) in enumerate(res):
            assert st is not None, f"{kind} of row {r} has no status {SILENT_BOUND + 5} s after the cut"
            report.append((kind, r, S(st).name, t1 - t_cut))
    print("\n".join(f"{k} row {r}: {st} at cut{'+' if dt >= 0 else ''}{dt:.3f} s" for k, r, st, dt in report))
    failed = [x for x in report if x[2] != "LLM_SUCCESS"]
    assert {x[0] for x in failed} == {"push", "pull"}, "pushes and pulls were not both in flight at the cut"
    for k, r, st, dt in report:
        if st == "LLM_SUCCESS":
            assert dt < 0.05, f"{k} of row {r} succeeded {dt:.2f} s after the cut"   # crossed the cut
        else:
            assert st == "LLM_LINK_FAILED", f"{k} of row {r}: {st}"
            assert dt <= SILENT_BOUND, f"{k} of row {r} resolved {dt:.2f} s after the cut (bound {SILENT_BOUND} s)"
    # at the status: pushed rows whole or not at all where the push succeeded; cut-short rows
    # hold old or new bytes only, nothing else
    for name, now, res in (("victim's push destination", at_status_dst, done[:ROWS]),
                           ("prefill's pull destination", at_status_pull, done[ROWS:])):
        states = netbed.rows_state(now, old, new, ROWS)
        assert "garbage" not in states, f"{name}: {states}"
        for r, (st, _, _) in enumerate(res):
            if st == S.LLM_SUCCESS:
                assert states[r] == "new", f"{name}: row {r} succeeded but is {states[r]}"

    # heal: what the kernel still retransmits must not land (the victim's lease is long over)
    bed.heal(1)
    assert (await victim.call("wait_link_down", cluster_id=1, timeout=SILENT_BOUND + 5))["down"]
    await asyncio.sleep(WINDOW)   # the observation window itself
    assert netbed.changed(at_status_dst, read_v_dst()) == 0, "bytes landed in the victim after the statuses"
    assert netbed.changed(at_status_pull, read_p_pull()) == 0, "bytes landed in the prefill after the statuses"
    stats = (await p.call("stats"))["stats"]
    assert "2" not in stats["links"] and stats["native"]["jobs_live"] == 0

    # the same peers link again and move bytes, byte-exact
    assert (await p.call("link", cluster_id=2, address=victim.address))["status"] == 0
    r = await p.call("series", cache_id=p_src, targets=[[2, v_dst]], n=ROWS, rows=ROWS, deadline=10, timeout=60)
    assert r["status"] == {"2": {"LLM_SUCCESS": ROWS}}, r["status"]
    assert (await victim.call("digest", cache_id=v_dst))["rows"] == (await p.call("digest", cache_id=p_src))["rows"]
    print(f"detection after the cut: max {max(x[3] for x in failed):.3f} s, bound {SILENT_BOUND} s")
