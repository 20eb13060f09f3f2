"""transport="ucx" across hosts: engines in network namespaces of the test bed, UCX's tcp
transport over the bed's links (UCX_TLS=tcp, UCX_NET_DEVICES=eth0: kvengine/bench/netbed.py).

Proves (issue 14): rows pushed and pulled, a block table and a layer stream arrive
byte-exact across hosts over UCX, and kvengine's own tcp data plane carries none of it;
``transport="auto"`` picks UCX across hosts where both ends allow it (``auto_ucx``) and
tcp where one does not. The faults over UCX (partition, a peer killed or stopped
mid-transfer) are the tcp cases' tests, parametrized: test_cluster_partition.py,
test_cluster_process_faults.py."""

from __future__ import annotations

import asyncio

import pytest

from kvengine.bench.netbed import HB, SECRET
from kvengine.native import _native

pytestmark = pytest.mark.skipif(
    not _native.UCX, reason="kvengine built without UCX: pip install 'kvengine[ucx]' (libucx-cu12), then rebuild")

ROWS, TENSORS, ROW_BYTES = 4, 4, 1 << 20   # 2 layers of K and V; a row: 4 x 1 MiB
SRC_SEED, DST_SEED = 51, 52


@pytest.fixture(autouse=True)
def ucx_tcp(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")   # across hosts: UCX's tcp (sm would pass through the one kernel)


async def _alloc(agent, seed):
    return (await agent.call("alloc", n=TENSORS, shape=[ROWS, ROW_BYTES], dtype="uint8", fill=seed))["cache_id"]


async def test_ucx_moves_rows_blocks_and_layers_across_hosts_byte_exact(bed3):
    bed = bed3
    p, d = await asyncio.gather(bed.spawn(0, 1, role="PROMPT", secret=SECRET, transport="ucx", options=HB),
                                bed.spawn(1, 2, secret=SECRET, transport="ucx", options=HB))
    p_src, p_pull = await _alloc(p, SRC_SEED), await _alloc(p, DST_SEED)
    d_dst, d_src = await _alloc(d, DST_SEED), await _alloc(d, SRC_SEED)
    assert (await p.call("link", cluster_id=2, address=d.address))["status"] == 0
    assert (await p.call("stats"))["stats"]["links"]["2"]["transport"] == "ucx"
    src_rows = (await p.call("digest", cache_id=p_src))["rows"]

    # rows pushed, each into its own row
    r = await p.call("series", cache_id=p_src, targets=[[2, d_dst]], n=ROWS, rows=ROWS, deadline=10, timeout=60)
    assert r["status"] == {"2": {"LLM_SUCCESS": ROWS}}, r["status"]
    assert (await d.call("digest", cache_id=d_dst))["rows"] == src_rows

    # rows pulled back from the decode host's source cache
    hs = [(await p.call("pull_start", cache_id=p_pull, cluster_id=2, src_cache_id=d_src, src_batch=r,
                        dst_batch=r, deadline=10))["handle"] for r in range(ROWS)]
    done = (await p.call("bg", handles=hs, wait=30))["done"]
    assert [st for st, _, _ in done] == [0] * ROWS, done
    assert (await p.call("digest", cache_id=p_pull))["rows"] == (await d.call("digest", cache_id=d_src))["rows"]

    # a block table (rows as blocks), scattered: src row i -> dst row perm[i]
    await d.call("zero", cache_id=d_dst)
    perm = [2, 0, 3, 1]
    r = await p.call("push_blocks", cache_id=p_src, cluster_id=2, dst_cache_id=d_dst, src_blocks=[0, 1, 2, 3],
                     dst_blocks=perm, deadline=10, timeout=60)
    assert r["status"] == 0, r
    got = (await d.call("digest", cache_id=d_dst))["rows"]
    assert all(got[t][perm[i]] == src_rows[t][i] for t in range(TENSORS) for i in range(ROWS))

    # one row as a layer stream (2 layers of 2 tensors) into row 3
    await d.call("zero", cache_id=d_dst)
    r = await p.call("layer_stream", cache_id=p_src, dsts=[[2, d_dst, 3]], src_batch=1, deadline=10, timeout=60)
    assert r["status"] == [0], r
    got = (await d.call("digest", cache_id=d_dst))["rows"]
    assert [got[t][3] for t in range(TENSORS)] == [src_rows[t][1] for t in range(TENSORS)]

    n = (await p.call("stats"))["stats"]["native"]
    pushed, pulled = (2 * ROWS + 1) * TENSORS * ROW_BYTES, ROWS * TENSORS * ROW_BYTES   # rows, blocks, a layer row
    assert n["ucx_bytes_sent"] >= pushed and n["ucx_bytes_received"] >= pulled, n
    assert n["tcp_bytes_sent"] == 0 and n["tcp_bytes_received"] == 0, "kvengine's own tcp data plane was used"


async def test_auto_picks_ucx_across_hosts_where_both_ends_allow_it(bed3):
    bed = bed3
    yes, no = {**HB, "auto_ucx": True}, {**HB, "auto_ucx": False}
    p, d_ucx, d_tcp = await asyncio.gather(bed.spawn(0, 1, role="PROMPT", secret=SECRET, options=yes),
                                           bed.spawn(1, 2, secret=SECRET, options=yes),
                                           bed.spawn(2, 3, secret=SECRET, options=no))
    p_src = await _alloc(p, SRC_SEED)
    dsts = {2: await _alloc(d_ucx, DST_SEED), 3: await _alloc(d_tcp, DST_SEED)}
    for a in (d_ucx, d_tcp):
        assert (await p.call("link", cluster_id=a.cluster_id, address=a.address))["status"] == 0
    links = (await p.call("stats"))["stats"]["links"]
    assert (links["2"]["transport"], links["3"]["transport"]) == ("ucx", "tcp"), links
    r = await p.call("series", cache_id=p_src, targets=[[2, dsts[2]], [3, dsts[3]]], n=2 * ROWS, rows=ROWS,
                     deadline=10, timeout=60)
    assert r["status"] == {"2": {"LLM_SUCCESS": ROWS}, "3": {"LLM_SUCCESS": ROWS}}, r["status"]
    src_rows = (await p.call("digest", cache_id=p_src))["rows"]
    for a in (d_ucx, d_tcp):
        assert (await a.call("digest", cache_id=dsts[a.cluster_id]))["rows"] == src_rows
