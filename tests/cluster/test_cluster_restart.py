"""A decode engine replaced under the same cluster id while the prefill still holds the
old link: the old host is partitioned (no RST, no FIN: the prefill hears nothing), and
a new engine with the same cluster id links to the prefill from another host.

Proves (docs/reliability.md, docs/protocol.md "Incarnations"): the new engine links at
once (before the old link's heartbeat gives up; without incarnations it would be
refused LLM_ALREADY_LINK until then); the old link's pushes in flight resolve
LLM_LINK_FAILED within the bound; the old engine's cache ids are never used against the
new one (LLM_KV_CACHE_NOT_EXIST until it announces them); rows pushed to the new engine
are byte-exact; nothing lands in the old engine after the statuses, also once its host
is back; a third host's link is untouched throughout."""

from __future__ import annotations

import asyncio
import time

from kvengine import LLMStatusCode as S

from kvengine.bench import netbed
from kvengine.bench.netbed import SECRET

ROWS, TENSORS, ROW_BYTES = 4, 2, 4 << 20
HB = {"heartbeat_interval": 0.5, "heartbeat_timeout": 4.0, "link_timeout": 4.0}   # a slow heartbeat:
BOUND = 0.45 * HB["heartbeat_timeout"] + 1.0   # the old pushes' lease release after the drop, + slack


async def _alloc(agent, seed):
    return (await agent.call("alloc", n=TENSORS, shape=[ROWS, ROW_BYTES], dtype="uint8", fill=seed))["cache_id"]


async def test_a_replaced_engine_under_the_same_cluster_id_takes_over_at_once(bed_factory):
    bed = bed_factory(4)
    try:
        prefill, old, new, other = await asyncio.gather(
            bed.spawn(0, 1, role="PROMPT", secret=SECRET, options=HB),
            bed.spawn(1, 2, secret=SECRET, options=HB),
            bed.spawn(2, 2, secret=SECRET, options=HB),     # the replacement: cluster 2 as well
            bed.spawn(3, 3, secret=SECRET, options=HB))
        src = await _alloc(prefill, 7)
        old_ids = [await _alloc(old, 1), await _alloc(old, 1)]
        o_dst = await _alloc(other, 1)
        for agent in (old, other):
            assert (await prefill.call("link", cluster_id=agent.cluster_id, address=agent.address))["status"] == 0
        inc0 = (await prefill.call("stats"))["stats"]["links"]["2"]["incarnation"]
        read_old = await netbed.remote_view(old, old_ids[1])

        bed.shape(1, "200mbit")   # the pushes to the old engine are still on the wire at the cut
        pushes = [(await prefill.call("push_start", cache_id=src, cluster_id=2, dst_cache_id=old_ids[1],
                                      src_batch=r, dst_batch=r, deadline=30))["handle"] for r in range(ROWS)]
        series = asyncio.ensure_future(prefill.call(   # the third host's traffic meanwhile
            "series", cache_id=src, targets=[[3, o_dst]], n=200, rows=ROWS, deadline=5, gap=0.005, timeout=60))
        bed.cut(1)
        t_cut = time.monotonic()

        n_dst = await _alloc(new, 1)   # the replacement has one cache: id 1 only
        assert (await new.call("link", cluster_id=1, address=prefill.address))["status"] == 0
        took = time.monotonic() - t_cut
        assert took < HB["heartbeat_timeout"], f"the replacement linked only after {took:.2f} s"
        print(f"\nthe replacement linked {took:.3f} s after the cut")
        done = (await prefill.call("bg", handles=pushes, wait=BOUND + 5))["done"]
        for r, (st, _, t1) in enumerate(done):
            assert st is not None and t1 is not None, f"push {r} has no status"
            if st != S.LLM_SUCCESS:
                assert st == S.LLM_LINK_FAILED, (r, S(st).name)
                assert t1 - t_cut <= took + BOUND, f"push {r} resolved {t1 - t_cut:.2f} s after the cut"
        assert any(st == S.LLM_LINK_FAILED for st, _, _ in done), "no push was in flight at the cut"
        at_status = read_old()

        link = (await prefill.call("stats"))["stats"]["links"]["2"]
        assert link["incarnation"] != inc0 and link["remote_caches"] == 1, link
        # the old engine's table is gone with its link (its cache 2 is unknown now); cache 1 is
        # the one the new engine announced
        r = await prefill.call("series", cache_id=src, targets=[[2, n_dst]], n=ROWS, rows=ROWS, deadline=10,
                               timeout=60)
        assert r["status"] == {"2": {"LLM_SUCCESS": ROWS}}, r
        assert (await new.call("digest", cache_id=n_dst))["rows"] == \
            (await prefill.call("digest", cache_id=src))["rows"]
        s = await series
        assert s["status"] == {"3": {"LLM_SUCCESS": 200}}, s["status"]

        bed.heal(1)   # the old engine's host is back: it learns its link is gone; nothing lands
        bed.unshape(1)
        assert (await old.call("wait_link_down", cluster_id=1, timeout=HB["heartbeat_timeout"] + 5))["down"]
        assert netbed.changed(at_status, read_old()) == 0, "bytes landed in the old engine after the statuses"
        assert (await prefill.call("stats"))["stats"]["native"]["jobs_live"] == 0
    finally:
        await bed.aclose()
