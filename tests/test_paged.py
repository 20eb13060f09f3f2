"""Paged (block-table) pushes: the vectorised block planner (plan.Planner.blocks)
against the tuple planner it replaced on many random tables, block tables as
lists, numpy arrays and CPU torch tensors, the named errors of invalid tables
(and no byte moved), and paged pushes byte-exact into another process over shm
and tcp."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvengine as kv
from kvengine import LLMStatusCode as S, plan, status
from kvengine._peer import PeerProcess, fill_pattern, row_digests
from kvengine.native import _native
from kvengine.types import CacheDesc, DataType, KvCacheExtParam as Ext

ParamInvalid = status.LLMParamInvalidError
HYP = settings(max_examples=300, deadline=None, database=None)
SECRET = b"paged-secret"


def old_plan_blocks(src, dst, src_blocks, dst_blocks, ext, op):
    """The tuple planner before the vectorised one (plan.py at 418046b), the reference."""
    sbl, dbl = [int(v) for v in src_blocks], [int(v) for v in dst_blocks]
    assert sbl and len(sbl) == len(dbl) and len(set(dbl)) == len(dbl)
    pairs = plan._tensor_pairs(src, dst, ext)
    bb = src.row_bytes
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(sbl, dbl):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return [(s, rs * bb, d, rd * bb, n * bb) for s, d in pairs for rs, rd, n in runs]


def old_packed(src, dst, sbl, dbl, ext, op, sreg, dreg):
    segs = plan.Planner().segments(None, lambda: old_plan_blocks(src, dst, sbl, dbl, ext, op), sreg, dreg)
    return list(segs[0]), segs[1]


def regions(n: int, row: int, nb: int, draw) -> list[tuple[int, int]]:
    """Per tensor (region id, offset): one region holding every tensor back to back (as
    allocate_cache lays them out: block runs coalesce across tensors), one per tensor, or mixed."""
    how = draw(st.sampled_from(["one", "each", "mixed"]))
    if how == "one":
        return [(7, i * row * nb) for i in range(n)]
    if how == "each":
        return [(10 + i, 0) for i in range(n)]
    return [(7 if i % 3 else 20 + i, i * row * nb) for i in range(n)]


@st.composite
def tables(draw, nbs: int, nbd: int):
    """Equal-length tables, unique destinations, made of runs (so runs are common)."""
    out_s, out_d, used = [], [], set()
    for _ in range(draw(st.integers(1, 8))):
        s0, d0, n = draw(st.integers(0, nbs - 1)), draw(st.integers(0, nbd - 1)), draw(st.integers(1, 6))
        for i in range(n):
            s, d = s0 + i, d0 + i
            if s >= nbs or d >= nbd or d in used:
                break
            out_s.append(s)
            out_d.append(d)
            used.add(d)
    return out_s, out_d


@HYP
@given(st.data())
def test_vectorised_planner_equals_the_tuple_planner(data):
    draw = data.draw
    tnpl = draw(st.integers(1, 3))
    nl = draw(st.integers(1, 4))
    nbs, nbd = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    inner = tuple(draw(st.lists(st.integers(1, 4), max_size=2)))
    sd = CacheDesc(nl * tnpl, (nbs, *inner), DataType.DT_FLOAT16)
    dd = CacheDesc(nl * tnpl, (nbd, *inner), DataType.DT_FLOAT16)
    ext = None
    if draw(st.booleans()):
        span = draw(st.integers(1, nl))
        a, b = draw(st.integers(0, nl - span)), draw(st.integers(0, nl - span))
        ext = Ext((a, a + span - 1), (b, b + span - 1), tnpl)
    sbl, dbl = draw(tables(nbs, nbd))
    if not sbl:
        return
    sreg = regions(sd.num_tensors, sd.row_bytes, nbs, draw)
    dreg = regions(dd.num_tensors, dd.row_bytes, nbd, draw)
    op = draw(st.sampled_from(["push", "pull"]))
    form = draw(st.sampled_from(["list", "int64", "int32", "uint16", "tuple"]))
    conv = {"list": list, "tuple": tuple, "int64": lambda x: np.array(x, np.int64),
            "int32": lambda x: np.array(x, np.int32), "uint16": lambda x: np.array(x, np.uint16)}[form]
    got, total = plan.Planner.blocks(sd, dd, conv(sbl), conv(dbl), ext, op, sreg, dreg)
    want, want_total = old_packed(sd, dd, sbl, dbl, ext, op, sreg, dreg)
    assert got.dtype == np.uint64 and got.flags.c_contiguous
    assert got.tolist() == want
    assert total == want_total


def test_contiguous_table_is_one_segment_per_region_run():
    sd = CacheDesc(64, (16, 256), np.float16)
    sreg = [(1, i * sd.size) for i in range(64)]          # one region, tensors back to back
    got, total = plan.Planner.blocks(sd, sd, range(16), range(16), None, "push", sreg, sreg)
    assert got.tolist() == [1, 0, 1, 0, 64 * sd.size] and total == 64 * sd.size
    each = [(i + 1, 0) for i in range(64)]
    got, _ = plan.Planner.blocks(sd, sd, range(4, 8), range(0, 4), None, "push", each, each)
    assert got.reshape(-1, 5).tolist() == [[i + 1, 4 * 512, i + 1, 0, 4 * 512] for i in range(64)]


def test_torch_tables():
    torch = pytest.importorskip("torch")
    sd = CacheDesc(4, (32, 64), np.float16)
    reg = [(i + 1, 0) for i in range(4)]
    want = plan.Planner.blocks(sd, sd, [3, 4, 9], [0, 1, 30], None, "push", reg, reg)[0].tolist()
    for dt in (torch.int64, torch.int32, torch.int16):
        got = plan.Planner.blocks(sd, sd, torch.tensor([3, 4, 9], dtype=dt), torch.tensor([0, 1, 30], dtype=dt),
                                  None, "push", reg, reg)[0]
        assert got.tolist() == want
    with pytest.raises(ParamInvalid, match=r"src_blocks must be a 1-D integer array"):
        plan.Planner.blocks(sd, sd, torch.tensor([3.0]), [0], None, "push", reg, reg)
    with pytest.raises(ParamInvalid, match=r"dst_blocks must be a 1-D integer array"):
        plan.Planner.blocks(sd, sd, [3], torch.tensor([[0]]), None, "push", reg, reg)
    with pytest.raises(ParamInvalid, match=r"dst_blocks must be a 1-D integer array"):
        plan.Planner.blocks(sd, sd, [3], torch.tensor([True]), None, "push", reg, reg)


NB = CacheDesc(2, (8, 16), np.uint8)
REG = [(1, 0), (2, 0)]


@pytest.mark.parametrize("sbl,dbl,rule", [
    ([0, 8], [0, 1], r"source block 8 out of range \[0, 8\)"),
    (np.array([0, 1]), np.array([1, 9]), r"destination block 9 out of range \[0, 8\)"),
    ([-1], [0], r"source block -1 out of range \[0, 8\): ids are not negative"),
    (np.array([0]), np.array([-3], np.int8), r"destination block -3 out of range .*negative"),
    ([0, 1, 2], [4, 5, 4], r"dst_blocks names a block more than once"),
    ([0, 1], [0], r"src_blocks has 2 entries, dst_blocks 1: lengths must be equal"),
    ([], [], r"must be non-empty"),
    (np.array([0.0]), [0], r"src_blocks must be a 1-D integer array"),
    ([0], [np.float64(1)], r"dst_blocks must contain only ints"),
    ([True], [0], r"src_blocks must contain only ints"),
    (np.array([2**63], np.uint64), [0], r"source block 9223372036854775808 out of range"),
    ([2**70], [0], r"source block 1180591620717411303424 out of range"),
])
def test_invalid_tables_name_the_rule(sbl, dbl, rule):
    with pytest.raises(ParamInvalid, match=rule):
        plan.Planner.blocks(NB, NB, sbl, dbl, None, "push", REG, REG)
    with pytest.raises(ParamInvalid, match=rule):
        plan.plan_blocks(NB, NB, sbl, dbl, None, op="push")


async def test_invalid_tables_move_no_byte():
    opts = kv.EngineOptions(secret=SECRET)
    async with kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", opts) as p, \
            kv.KvEngine(2, kv.Role.DECODER, "127.0.0.1:0", opts) as d:
        st_, _ = await p.link_clusters([kv.ClusterInfo(2, d.address)])
        assert st_ == S.LLM_SUCCESS
        desc = CacheDesc(4, (16, 64), np.float16)
        src = p.allocate_cache(desc)
        for i, t in enumerate(src.tensors):
            fill_pattern(t, 3, i)
        dst = d.allocate_cache(desc)
        await p.wait_remote_cache(2, dst.cache_id)
        key = kv.BlocksCacheKey(2, dst.cache_id)
        for sbl, dbl, rule in [([0, 1], [2, 2], "more than once"), ([0, 16], [0, 1], "out of range"),
                               ([0, -1], [0, 1], "negative"), ([0], [0, 1], "lengths must be equal"),
                               (np.array([0.5]), [0], "1-D integer array")]:
            t = p.submit_push_kv_blocks(src, key, sbl, dbl)
            assert await t == S.LLM_PARAM_INVALID and rule in t.message()
        assert not any(t.any() for t in dst.tensors)
        assert p.stats()["native"]["jobs_submitted"] == 0


@pytest.mark.parametrize("transport", ["shm", "tcp", "ucx"])
async def test_paged_push_and_pull_byte_exact_across_processes(transport):
    if transport == "ucx" and not _native.UCX:
        pytest.skip("kvengine built without UCX: pip install 'kvengine[ucx]' (libucx-cu12), then rebuild")
    pool, blk, tensors = 96, (16, 2, 32), 8       # 2 KiB blocks
    desc = CacheDesc(tensors, (pool, *blk), np.float16)
    peer = await PeerProcess.start(cluster_id=2, secret=SECRET, transport=transport)
    try:
        async with kv.KvEngine(1, kv.Role.PROMPT, None, kv.EngineOptions(secret=SECRET, transport=transport)) as e:
            st_, _ = await e.link_clusters([kv.ClusterInfo(2, peer.address)])
            assert st_ == S.LLM_SUCCESS and e.stats()["links"][2]["transport"] == transport
            src = e.allocate_cache(desc)
            for i, t in enumerate(src.tensors):
                fill_pattern(t, 31, i)
            dst = (await peer.call("alloc", n=tensors, shape=[pool, *blk], dtype="float16"))["cache_id"]
            await e.wait_remote_cache(2, dst)
            rng = np.random.default_rng(5)
            zero = row_digests([np.zeros(desc.shape, np.float16)])[0][0]
            want = [[zero] * pool for _ in range(tensors)]
            srows = row_digests(src.tensors)
            torch = pytest.importorskip("torch")
            # a random table, a table with runs, and one as a torch tensor: 80 blocks in all
            sb1, db1 = rng.permutation(pool)[:40], rng.permutation(pool)[:40]
            rest = np.setdiff1d(np.arange(pool), db1)
            sb2, db2 = np.arange(3, 23), rest[:20]
            sb3, db3 = torch.tensor(rng.permutation(pool)[:20].tolist()), torch.tensor(rest[20:40].tolist())
            pushvs = e.stats()["native"]["ucx_pushv"]   # over ucx, many blocks packed in one PUSHV
            for sb, db in ((sb1, db1), (sb2.tolist(), db2.tolist()), (sb3, db3)):
                await e.push_kv_blocks(src, kv.BlocksCacheKey(2, dst), sb, db, timeout=30)
                for t in range(tensors):
                    for s, d in zip(np.asarray(sb).tolist(), np.asarray(db).tolist()):
                        want[t][d] = srows[t][s]
            assert (await peer.call("digest", cache_id=dst))["rows"] == want
            assert (e.stats()["native"]["ucx_pushv"] > pushvs) == (transport == "ucx")
            # and pulled back, as a decode engine pulls a prefill's blocks: a random table
            # into a cache here; its blocks go as READVs of many blocks each over tcp, as
            # PULL_REQVs over ucx
            back = e.allocate_cache(desc)
            readvs, pullvs = e.stats()["native"]["tcp_readv"], e.stats()["native"]["ucx_pullv"]
            assert await e.pull_kv_blocks(kv.BlocksCacheKey(2, dst), back, db1, sb1, timeout=30) == S.LLM_SUCCESS
            brows = row_digests(back.tensors)
            assert [[brows[t][s] for s in sb1.tolist()] for t in range(tensors)] == \
                [[srows[t][s] for s in sb1.tolist()] for t in range(tensors)]
            assert all(not back.tensors[t][np.setdiff1d(np.arange(pool), sb1)].any() for t in range(tensors))
            assert (e.stats()["native"]["tcp_readv"] > readvs) == (transport == "tcp")
            assert (e.stats()["native"]["ucx_pullv"] > pullvs) == (transport == "ucx")
    finally:
        await peer.close()


def test_whole_transfer_piece_is_the_plan_itself():
    """A transfer handed to the core whole passes its packed plan as is: no copy per segment."""
    from kvengine.transfer import Transfer

    class Owner:
        loop = None

    t = Transfer(Owner(), "x")   # type: ignore[arg-type]
    segs = np.arange(5 * 1000, dtype=np.uint64)
    t._segs, t._left = segs, 12345
    piece, n = t._next_piece(1 << 62)
    assert piece is segs and n == 12345 and t._left == 0 and t._cur == segs.size
    t._segs, t._cur, t._left = np.array([1, 0, 2, 0, 100, 3, 0, 4, 0, 50], np.uint64), 0, 150
    piece, n = t._next_piece(120)      # a budget: cut, copied
    assert list(piece) == [1, 0, 2, 0, 100, 3, 0, 4, 0, 20] and n == 120
    piece, n = t._next_piece(120)
    assert list(piece) == [3, 20, 4, 20, 30] and n == 30
