"""Head-split block transfers (issue 12): a TP=1 prefill feeds two TP=2 decode ranks (each
gets half the KV heads of every block) and two TP=2 prefill ranks feed one TP=1 decode
(heads gathered), by push and by pull, in one process (local, shm, tcp) and across
processes (shm, tcp), byte-checked against numpy slicing of the source. The planner's
2-D segments (one per block, or per run of contiguous blocks) against numpy slicing on
many random layouts and head ranges, the head-range rules (LLM_PARAM_INVALID naming the rule, no byte
moved), layer streams with a head range per destination, and a 2-D plan's pieces."""

from __future__ import annotations

import asyncio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvengine as kv
from conftest import link
from kvengine import LLMStatusCode as S, layout, plan, status
from kvengine._peer import PeerProcess, row_digests
from kvengine.types import CacheDesc, KvCacheExtParam as Ext
from kvengine.native import _native
from test_fencing import poll_until
from test_layouts import apply_plan, build, expected, same

ParamInvalid = status.LLMParamInvalidError
HYP = settings(max_examples=150, deadline=None, database=None)
SECRET = b"headsplit-secret"


def with_heads(tensors, axis):
    return layout.describe(tensors, head_axis=axis)


@HYP
@given(st.data())
def test_head_split_plans_equal_numpy_slicing(data):
    draw = data.draw
    ks, kd = draw(st.sampled_from(["vllm", "flashinfer", "separate"])), draw(st.sampled_from(["vllm", "flashinfer"]))
    bs, hd, H = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.sampled_from([2, 4, 6]))
    k = draw(st.integers(1, H))
    gather = draw(st.booleans())
    hs_, hd_ = (k, H) if gather else (H, k)          # heads of a source block, of a destination block
    nl, nbs, nbd = draw(st.integers(1, 2)), draw(st.integers(1, 8)), draw(st.integers(1, 8))
    sbuf, stens, sreg = build(ks, nl, nbs, (bs, hs_, hd), 1)
    dbuf, dtens, dreg = build(kd, nl, nbd, (bs, hd_, hd), 2)
    sdesc, ddesc = with_heads(stens, 2), with_heads(dtens, 2)
    h0 = draw(st.integers(0, H - k))
    sh, dh = (range(0, k), range(h0, h0 + k)) if gather else (range(h0, h0 + k), range(0, k))
    n = draw(st.integers(1, min(nbs, nbd)))
    if draw(st.booleans()):
        s0, d0 = draw(st.integers(0, nbs - n)), draw(st.integers(0, nbd - n))
        sbl, dbl = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    else:
        sbl = draw(st.lists(st.integers(0, nbs - 1), min_size=n, max_size=n))
        dbl = draw(st.permutations(range(nbd)))[:n]
    ext = Ext(src_head_range=sh if gather else (h0, h0 + k - 1), dst_head_range=dh)
    packed, total = plan.Planner.blocks(sdesc, ddesc, sbl, dbl, ext, "push", sreg, dreg)
    want = expected(dtens, stens, [(i, i) for i in range(len(stens))], sbl, dbl, sh, dh, 2)
    full = k == H
    assert packed.ndim == (1 if full else 2)
    assert total == len(stens) * n * bs * k * hd * 2
    if full:   # all heads of both: whole blocks
        apply_plan(packed, 5, sbuf, dbuf)
        assert same(dtens, want)
        return
    assert packed.shape[1] == 8
    contiguous = sdesc.block_stride is None and ddesc.block_stride is None
    runs = len(plan.block_runs(sbl, dbl)) if contiguous else n
    assert packed.shape[0] == runs * len(stens)           # one 2-D segment per block, or per run
    apply_plan(packed, 8, sbuf, dbuf)
    assert same(dtens, want)
    assert layout.submit_form(packed)[1] == 8 and layout.submit_form(packed)[0].size == packed.size


def _desc(heads, nb=8, axis=2, **kw):
    return CacheDesc(4, (nb, 16, heads, 8), np.float16, head_axis=axis, **kw)


REG = [(1, i * 8 * 4096) for i in range(4)]


@pytest.mark.parametrize("src,dst,ext,rule", [
    (_desc(8), _desc(4), Ext(), "source block is 2048 bytes per tensor, destination block 1024"),
    (_desc(8), _desc(4), Ext(src_head_range=(4, 8)), r"src_head_range \(4, 8\) must be \(-1, -1\) or satisfy "
                                                     r"0 <= first <= last <= max head index 7"),
    (_desc(8), _desc(4), Ext(src_head_range=range(6, 9)), r"0 <= start < stop <= 8 \(source kv heads 8\)"),
    (_desc(8), _desc(4), Ext(src_head_range=range(0, 3)), "src_head_range spans 3 heads, dst_head_range 4"),
    (_desc(8), _desc(4), Ext(src_head_range=range(0, 4, 2)), "must have step 1"),
    (_desc(8), _desc(4), Ext(src_head_range="0:4"), "inclusive .first, last. tuple of ints or a range"),
    (CacheDesc(4, (8, 16, 8, 8), np.float16), _desc(4), Ext(src_head_range=range(4)),
     "the source cache of shape .* names no head axis"),
    (_desc(8), CacheDesc(4, (8, 32, 4, 8), np.float16, head_axis=2), Ext(src_head_range=range(4)),
     "source blocks hold 16 rows .tokens. before the head axis, destination blocks 32"),
    (_desc(8), CacheDesc(4, (8, 16, 4, 4), np.float16, head_axis=2), Ext(src_head_range=range(4)),
     "a source head is 16 bytes, a destination head 8"),
    (_desc(8), CacheDesc(4, (8, 16, 4, 8), np.float32, head_axis=2), Ext(src_head_range=range(4)),
     "source dtype DT_FLOAT16 differs from destination dtype DT_FLOAT"),
])
def test_head_range_rules(src, dst, ext, rule):
    with pytest.raises(ParamInvalid, match=rule):
        plan.Planner.blocks(src, dst, [0], [0], ext, "push", REG, REG)


def test_head_ranges_are_for_block_transfers():
    with pytest.raises(ParamInvalid, match="head ranges apply to block transfers"):
        plan.plan_cache(_desc(8), _desc(4), 0, 0, -1, Ext(src_head_range=range(4)), op="push")


def test_full_head_ranges_are_whole_blocks():
    packed, total = plan.Planner.blocks(_desc(8), _desc(8), [0, 1], [2, 3], Ext(range(0, 2), range(0, 2), 2,
                                                                             range(0, 8), (-1, -1)),
                                        "push", REG, REG)
    assert packed.ndim == 1 and packed.size == 5 * 4 and total == 4 * 2 * 2048


def test_a_2d_plan_is_cut_between_segments():
    from kvengine.transfer import Transfer

    class Owner:
        loop = None

    t = Transfer(Owner(), "x")   # type: ignore[arg-type]
    segs = np.array([[1, 0, 2, 0, 100, 3, 400, 200], [1, 50, 2, 60, 10, 4, 400, 200],
                     [1, 90, 2, 90, 50, 1, 400, 200]], np.uint64).reshape(-1)
    t._segs, t._words, t._left = segs, 8, 300 + 40 + 50
    piece, n = t._next_piece(320)          # the first segment alone (300 bytes)
    assert list(piece) == list(segs[:8]) and n == 300
    piece, n = t._next_piece(320)          # the other two fit: 40 + 50
    assert list(piece) == list(segs[8:]) and n == 90 and t._left == 0


# ---------------------------------------------------------------- engines

H, D, BS = 8, 16, 16        # kv heads, head_dim, block size of the TP=1 side


def tp_cache(engine, heads, nb, seed, kind="vllm", layers=2):
    _, tensors, _ = build(kind, layers, nb, (BS, heads, D), seed)
    return engine.register_kv_cache(layout.describe(tensors, head_axis=2), tensors), tensors


async def test_tp1_to_two_tp2_ranks_and_back(pair):
    """Split by push into two TP=2 ranks' caches (FlashInfer and vLLM layouts), pull of a
    rank's heads by the decode side, then gather by push from the two ranks into TP=1."""
    p, d = pair
    await link(p, d)
    src, stens = tp_cache(p, H, 24, 1, "flashinfer")
    ranks = [tp_cache(d, H // 2, 20, 2 + r, kind) for r, kind in enumerate(("flashinfer", "vllm"))]
    for c, _ in ranks:
        await p.wait_remote_cache(2, c.cache_id)
    sbl, dbl = np.array([3, 4, 5, 17, 0, 9]), np.array([10, 11, 12, 0, 19, 4])
    before = [[np.array(t, copy=True) for t in tens] for _, tens in ranks]
    for r, (c, tens) in enumerate(ranks):
        half = range(r * H // 2, (r + 1) * H // 2)
        t = p.submit_push_kv_blocks(src, kv.BlocksCacheKey(2, c.cache_id), sbl, dbl, Ext(src_head_range=half),
                                    timeout=10)
        assert await t == S.LLM_SUCCESS and t.nbytes == 4 * 6 * BS * (H // 2) * D * 2
        assert same(tens, expected(before[r], stens, [(i, i) for i in range(4)], sbl, dbl, half, range(4), 2))
    # decode rank 1 pulls its heads of prefill blocks [1, 2] into its blocks [7, 8]
    c1, t1 = ranks[1]
    snap = [np.array(t, copy=True) for t in t1]
    assert await d.pull_kv_blocks(kv.BlocksCacheKey(1, src.cache_id), c1, [1, 2], [7, 8],
                                  Ext(src_head_range=range(4, 8)), timeout=10) == S.LLM_SUCCESS
    assert same(t1, expected(snap, stens, [(i, i) for i in range(4)], [1, 2], [7, 8], range(4, 8), range(4), 2))
    # gather: both ranks push their halves of blocks dbl into one TP=1 cache, blocks 0..5
    tp1, tp1t = tp_cache(p, H, 8, 9, "vllm")
    await d.wait_remote_cache(1, tp1.cache_id)
    for r, (c, _) in enumerate(ranks):
        await d.push_kv_blocks(c, kv.BlocksCacheKey(1, tp1.cache_id), dbl, np.arange(6),
                               Ext(dst_head_range=(4 * r, 4 * r + 3)), timeout=10)
    for t in range(4):
        assert np.array_equal(tp1t[t][:6].view(np.uint16), stens[t][sbl].view(np.uint16))


async def test_invalid_head_split_moves_no_byte():
    opts = kv.EngineOptions(secret=SECRET)
    async with kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", opts) as p, \
            kv.KvEngine(2, kv.Role.DECODER, "127.0.0.1:0", opts) as d:
        await link(p, d)
        src, _ = tp_cache(p, H, 16, 1)
        dst = d.allocate_cache(CacheDesc(4, (16, BS, H // 2, D), np.float16, head_axis=2))
        await p.wait_remote_cache(2, dst.cache_id)
        key = kv.BlocksCacheKey(2, dst.cache_id)
        for sbl, dbl, ext, rule in [
                ([0, 1], [2, 2], Ext(src_head_range=range(4)), "more than once"),
                ([0, 16], [0, 1], Ext(src_head_range=range(4)), "out of range"),
                ([0, -1], [0, 1], Ext(src_head_range=range(4)), "negative"),
                ([0], [0, 1], Ext(src_head_range=range(4)), "lengths must be equal"),
                (np.array([0.0]), [0], Ext(src_head_range=range(4)), "1-D integer array"),
                ([0], [0], Ext(src_head_range=range(5)), "spans 5 heads, dst_head_range 4"),
                ([0], [0], Ext(src_head_range=range(6, 10)), "stop <= 8"),
                ([0], [0], Ext(), "must be equal")]:
            t = p.submit_push_kv_blocks(src, key, sbl, dbl, ext)
            assert await t == S.LLM_PARAM_INVALID and rule in t.message(), (rule, t.message())
        assert not any(t.any() for t in dst.tensors)
        assert p.stats()["native"]["jobs_submitted"] == 0


async def test_layer_stream_with_a_head_range_per_destination():
    torch = pytest.importorskip("torch", reason="torch is in the e2e extra (CI installs it)")
    o = kv.EngineOptions(transport="local")
    async with kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", o) as p, \
            kv.KvEngine(2, kv.Role.DECODER, "127.0.0.1:0", o) as d:
        await link(p, d)
        src, stens = tp_cache(p, H, 12, 1, "flashinfer", layers=3)
        ranks = [tp_cache(d, H // 2, 12, 2 + r, layers=3) for r in range(2)]
        for c, _ in ranks:
            await p.wait_remote_cache(2, c.cache_id)
        before = [[np.array(t, copy=True) for t in tens] for _, tens in ranks]
        sbl = torch.tensor([4, 5, 6, 1])
        stream = p.layer_stream(src, [kv.BlocksCacheKey(2, c.cache_id) for c, _ in ranks], src_blocks=sbl,
                                dst_blocks=np.array([0, 1, 2, 3]), src_head_range=[range(0, 4), (4, 7)],
                                timeout=10)
        for layer in range(3):
            stream.layer_ready(layer)
        assert await stream.wait() == [S.LLM_SUCCESS, S.LLM_SUCCESS]
        for r, (_, tens) in enumerate(ranks):
            assert same(tens, expected(before[r], stens, [(i, i) for i in range(6)], [4, 5, 6, 1], [0, 1, 2, 3],
                                       range(4 * r, 4 * r + 4), range(4), 2))
        with pytest.raises(ParamInvalid, match="one head range or a list of one per destination"):
            p.layer_stream(src, [kv.BlocksCacheKey(2, ranks[0][0].cache_id)], src_blocks=[0], dst_blocks=[0],
                           src_head_range=[range(4), range(4)])
        with pytest.raises(ParamInvalid, match="head ranges go with BlocksCacheKey"):
            p.layer_stream(src, [kv.CacheIndex(2, ranks[0][0].cache_id, 0)], src_head_range=range(4))


def head_digests(tensors, blocks, heads):
    return row_digests([np.ascontiguousarray(t[blocks][:, :, heads.start:heads.stop]) for t in tensors])


@pytest.mark.parametrize("transport", ["shm", "tcp", "ucx"])
async def test_split_and_gather_across_processes(transport):
    """Two TP=2 decode ranks' caches in another process receive their heads from a TP=1
    prefill here (split); then two TP=2 prefill caches here fill a TP=1 cache there (gather);
    then caches here pull heads back (split and gather). tcp pulls go as READVs of rows
    (many blocks' rows in one frame: decisions.md #39), ucx pulls as PULL_REQVs of rows
    (the same, decisions.md #39) or PULL_REQ2D where the rows are apart at the source
    (decisions.md #38)."""
    if transport == "ucx" and not _native.UCX:
        pytest.skip("kvengine built without UCX: pip install 'kvengine[ucx]' (libucx-cu12), then rebuild")
    nb = 32
    peer = await PeerProcess.start(cluster_id=2, secret=SECRET, transport=transport)
    try:
        async with kv.KvEngine(1, kv.Role.PROMPT, None, kv.EngineOptions(secret=SECRET, transport=transport)) as e:
            st_, _ = await e.link_clusters([kv.ClusterInfo(2, peer.address)])
            assert st_ == S.LLM_SUCCESS
            src, stens = tp_cache(e, H, nb, 5, "flashinfer")
            ranks = [(await peer.call("alloc", n=4, shape=[nb, BS, H // 2, D], head_axis=2))["cache_id"],
                     (await peer.call("register", n=4, shape=[nb, BS, H // 2, D], head_axis=2, layout="flashinfer",
                                      block_stride=2 * BS * (H // 2) * D))["cache_id"]]
            tp1 = (await peer.call("alloc", n=4, shape=[nb, BS, H, D], head_axis=2))["cache_id"]
            for c in (*ranks, tp1):
                await e.wait_remote_cache(2, c)
            rng = np.random.default_rng(3)
            sbl, dbl = rng.permutation(nb)[:24], rng.permutation(nb)[:24]
            pushvs = e.stats()["native"]["ucx_pushv"]   # over ucx: many blocks' heads in one PUSHV
            for r, c in enumerate(ranks):
                half = range(4 * r, 4 * r + 4)
                await e.push_kv_blocks(src, kv.BlocksCacheKey(2, c), sbl, dbl, Ext(src_head_range=half), timeout=30)
                rows = (await peer.call("digest", cache_id=c))["rows"]
                want = head_digests(stens, sbl, half)
                assert [[rows[t][b] for b in dbl.tolist()] for t in range(4)] == want
            assert (e.stats()["native"]["ucx_pushv"] > pushvs) == (transport == "ucx")
            pushvs = e.stats()["native"]["ucx_pushv"]   # the gather's: rows apart there, the 2-D header
            # gather: two TP=2 prefill ranks here (their heads: halves of stens' blocks) -> TP=1 there
            halves = []
            for r in range(2):
                c, tens = tp_cache(e, H // 2, nb, 20 + r)
                for t in range(4):
                    tens[t][...] = stens[t][:, :, 4 * r:4 * r + 4]
                halves.append(c)
            for r, c in enumerate(halves):
                await e.push_kv_blocks(c, kv.BlocksCacheKey(2, tp1), sbl, dbl,
                                       Ext(dst_head_range=range(4 * r, 4 * r + 4)), timeout=30)
            rows = (await peer.call("digest", cache_id=tp1))["rows"]
            want = row_digests([np.ascontiguousarray(t[sbl]) for t in stens])
            assert [[rows[t][b] for b in dbl.tolist()] for t in range(4)] == want
            assert (e.stats()["native"]["ucx_pushv"] > pushvs) == (transport == "ucx")
            # pulls of head ranges, as a decode rank would: heads 4..7 of the TP=1 cache there
            # (split: rows apart at the source), rank 0's heads into heads 0..3 here (gather:
            # rows apart at the destination); over tcp as READVs of rows (fewer than one READ
            # a block and tensor), over ucx as PULL_REQ2D, not one request per token row
            reads, ucx_reads = e.stats()["native"]["tcp_row_reads"], e.stats()["native"]["ucx_row_pulls"]
            ucx_vs = e.stats()["native"]["ucx_pullv"]
            mine, mtens = tp_cache(e, H // 2, nb, 30)
            assert await e.pull_kv_blocks(kv.BlocksCacheKey(2, tp1), mine, dbl, sbl,
                                          Ext(src_head_range=range(4, 8)), timeout=30) == S.LLM_SUCCESS
            whole, wtens = tp_cache(e, H, nb, 31, "flashinfer")
            assert await e.pull_kv_blocks(kv.BlocksCacheKey(2, ranks[0]), whole, dbl, sbl,
                                          Ext(dst_head_range=range(0, 4)), timeout=30) == S.LLM_SUCCESS
            for t in range(4):
                assert np.array_equal(mtens[t][sbl].view(np.uint16), stens[t][sbl][:, :, 4:8].view(np.uint16))
                assert np.array_equal(wtens[t][sbl][:, :, 0:4].view(np.uint16), stens[t][sbl][:, :, 0:4].view(np.uint16))
            row_reads = e.stats()["native"]["tcp_row_reads"] - reads
            assert (0 < row_reads < 24 * 4) if transport == "tcp" else row_reads == 0
            assert (e.stats()["native"]["ucx_row_pulls"] > ucx_reads) == (transport == "ucx")
            assert (e.stats()["native"]["ucx_pullv"] > ucx_vs) == (transport == "ucx")
    finally:
        await peer.close()


async def test_a_tp1_push_to_two_ranks_reads_each_source_row_once():
    """Head-split pushes of one block table to two TP=2 ranks, submitted together (as a
    TP=1 prefill feeds its decode pair), are copied by the movers as a pair, both ranks'
    rows of a source row in one pass (kv_core.c pairable; `chunks_paired` counts them),
    byte-exact. Cancelled mid-way, one of a pair resolves LLM_CANCELLED, nothing of it
    lands after that, and the other goes on alone, byte-exact. A 64 MiB push queued first
    keeps the one mover busy while the pair is submitted; the pair's rows are 512 bytes
    (4 heads x 64 x fp16), 32 MB a rank."""
    nb, heads, dim = 1024, 8, 64
    peer = await PeerProcess.start(cluster_id=2, secret=SECRET, transport="shm")
    try:
        opts = kv.EngineOptions(secret=SECRET, transport="shm", movers=1)
        async with kv.KvEngine(1, kv.Role.PROMPT, None, opts) as e:
            st_, _ = await e.link_clusters([kv.ClusterInfo(2, peer.address)])
            assert st_ == S.LLM_SUCCESS
            rng = np.random.default_rng(8)
            stens = [rng.integers(0, 1 << 16, (nb, BS, heads, dim), dtype=np.uint16).view(np.float16)
                     for _ in range(4)]
            src = e.register_kv_cache(layout.describe(stens, head_axis=2), stens)
            big = e.register_kv_cache(kv.CacheDesc(1, (1, 64 << 20), np.uint8), [np.ones((1, 64 << 20), np.uint8)])
            sink = (await peer.call("alloc", n=1, shape=[1, 64 << 20], dtype="uint8"))["cache_id"]
            ranks = [(await peer.call("alloc", n=4, shape=[nb, BS, heads // 2, dim], head_axis=2))["cache_id"]
                     for _ in range(2)]
            for c in (sink, *ranks):
                await e.wait_remote_cache(2, c)
            halves = [range(0, heads // 2), range(heads // 2, heads)]

            def native() -> dict:
                return e.stats()["native"]

            def pair(sbl, dbl):
                blocker = e.submit_push_kv_cache(big, kv.CacheIndex(2, sink, 0), timeout=60)
                return blocker, [e.submit_push_kv_blocks(src, kv.BlocksCacheKey(2, c), sbl, dbl,
                                                         Ext(src_head_range=halves[r]), timeout=60)
                                 for r, c in enumerate(ranks)]

            async def landed(c, dbl) -> list[list[str]]:
                rows = (await peer.call("digest", cache_id=c))["rows"]
                return [[rows[t][b] for b in dbl.tolist()] for t in range(4)]

            sbl, dbl = rng.permutation(nb)[:1000], rng.permutation(nb)[:1000]
            paired = native()["chunks_paired"]
            blocker, ts = pair(sbl, dbl)
            assert await blocker == S.LLM_SUCCESS
            assert await asyncio.gather(*ts) == [S.LLM_SUCCESS, S.LLM_SUCCESS], [t.message() for t in ts]
            assert native()["chunks_paired"] > paired, "the two ranks' pushes were copied one after the other"
            for r, c in enumerate(ranks):
                assert await landed(c, dbl) == head_digests(stens, sbl, halves[r]), f"rank {r}'s heads differ"

            # again, other blocks; rank 1's push cancelled once the pair is being copied
            sbl, dbl = rng.permutation(nb)[:1000], rng.permutation(nb)[:1000]
            paired = native()["chunks_paired"]
            blocker, ts = pair(sbl, dbl)
            await poll_until(lambda: native()["chunks_paired"] > paired, 30, "the pair being copied", every=0)
            assert ts[1].cancel(), "rank 1's push ended before it could be cancelled"
            assert await ts[1] == S.LLM_CANCELLED
            at_status = await landed(ranks[1], dbl)
            assert await ts[0] == S.LLM_SUCCESS and await blocker == S.LLM_SUCCESS
            assert await landed(ranks[0], dbl) == head_digests(stens, sbl, halves[0]), "rank 0's heads differ"
            assert await landed(ranks[1], dbl) == at_status, "rank 1's cancelled push landed after its status"
    finally:
        await peer.close()


def test_bench_head_split_runs_checks_bytes_and_reports_the_ratio(tmp_path):
    import json
    import subprocess
    import sys
    prefix = tmp_path / "hs"
    r = subprocess.run([sys.executable, "-m", "kvengine", "bench", "throughput", "--layout", "paged", "--head-split",
                        "2", "--tables", "8", "--reps", "2", "--peers", "none", "--out", str(prefix)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = json.loads((tmp_path / "hs.json").read_text())
    assert out["head_split"] == 2 and out["verify"]["head-split"] == [True, True]   # each rank byte-checked
    assert out["verify"]["gather"] == [True]                                        # and the gathered blocks
    t = out["tables"][0]
    assert t["blocks"] == 8 and t["segments_2d"] == 64 * 8 * 2
    assert t["split_over_contiguous"] > 0 and t["gather_over_contiguous"] > 0
    assert "x contiguous" in r.stdout and "goal: 8 blocks, TP=1 -> 2 TP=2 ranks" in r.stdout
    paired = out["engine_stats"]["prefill"]["native"]["chunks_paired"]
    assert f"the movers copied {paired} chunks as head-split pairs" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "kvengine", "bench", "throughput", "--head-split", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--head-split N: N >= 2, with --layout paged" in bad.stderr


def test_bench_head_split_over_ucx_applies_and_names_its_ucx_tls(tmp_path):
    """--transport ucx --ucx-tls tcp: both engines run on UCX's tcp transport (the decode
    engine inherits UCX_TLS) and the report says so; peers other than none are refused."""
    import json
    import subprocess
    import sys
    if not _native.UCX:
        pytest.skip("kvengine built without UCX: pip install 'kvengine[ucx]' (libucx-cu12), then rebuild")
    prefix = tmp_path / "hsu"
    base = [sys.executable, "-m", "kvengine", "bench", "throughput", "--layout", "paged", "--head-split", "2",
            "--tables", "8", "--reps", "2", "--transport", "ucx", "--ucx-tls", "tcp"]
    r = subprocess.run(base + ["--peers", "none", "--out", str(prefix)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = json.loads((tmp_path / "hsu.json").read_text())
    assert out["ucx_tls"] == "tcp" and out["verify"]["head-split"] == [True, True]
    assert "--transport ucx (UCX_TLS=tcp)" in r.stdout
    bad = subprocess.run(base + ["--peers", "nixl"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "kvengine only (--peers none)" in bad.stderr


def test_sync_layer_stream_gathers_heads_from_threads():
    """kvengine.sync: a TP=2 prefill rank's stream, layers marked ready from worker threads,
    fills its half of the heads of a TP=1 cache (dst_head_range)."""
    import concurrent.futures

    from kvengine.sync import SyncKvEngine
    o = kv.EngineOptions(transport="local")
    with SyncKvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", o) as p, \
            SyncKvEngine(2, kv.Role.DECODER, "127.0.0.1:0", o) as d:
        assert p.link_clusters([kv.ClusterInfo(2, d.address)])[0] == S.LLM_SUCCESS
        src = p.allocate_cache(CacheDesc(8, (6, BS, H // 2, D), np.float16, head_axis=2))
        for i, t in enumerate(src.tensors):
            t[...] = i + 1
        dst = d.allocate_cache(CacheDesc(8, (6, BS, H, D), np.float16, head_axis=2))
        p.wait_remote_cache(2, dst.cache_id, timeout=10)
        stream = p.layer_stream(src, [kv.BlocksCacheKey(2, dst.cache_id)], src_blocks=np.array([0, 1]),
                                dst_blocks=[4, 2], dst_head_range=(4, 7), timeout=10)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(stream.layer_ready, range(4)))
        assert stream.wait(10) == [S.LLM_SUCCESS]
        for i, t in enumerate(dst.tensors):
            assert (t[[4, 2]][:, :, 4:] == i + 1).all() and not t[[4, 2]][:, :, :4].any()
            assert not t[[0, 1, 3, 5]].any()
