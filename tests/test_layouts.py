"""Cache layouts (issue 12): one registration covers vLLM's combined (2, blocks, ...) tensor
per layer, FlashInfer's (blocks, 2, ...) with K and V interleaved (strided blocks),
SGLang's token pools (page_size 1) and MLA's one latent tensor per layer
(tensor_num_per_layer=1). Checked: the desc's layout fields and their rules, the
stride checks of registration (numpy views, torch tensors and views through
__dlpack__), the planner against numpy slicing on many random tables (plans applied
to plain byte buffers), and block pushes/pulls between layouts byte-exact in one
process (local, shm, tcp) and into another process (shm, tcp)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvengine as kv
from conftest import link
from kvengine import LLMStatusCode as S, layout, plan, status
from kvengine._peer import PeerProcess, row_digests
from kvengine.types import CacheDesc, KvCacheExtParam as Ext

ParamInvalid = status.LLMParamInvalidError
HYP = settings(max_examples=150, deadline=None, database=None)
SECRET = b"layouts-secret"
LAYOUTS = ["vllm", "flashinfer", "separate"]


# ---------------------------------------------------------------- helpers

def build(kind: str, layers: int, nb: int, inner: tuple[int, ...], seed: int, tnpl: int = 2,
          dtype=np.float16):
    """One side in one byte buffer: ``(buf, tensors, regions)``; tensors are K0, V0, ...
    (or one per layer for tnpl 1) as views of per-layer tensors of layout ``kind``,
    regions per tensor ``(region id 1, byte offset in buf)``."""
    e = np.dtype(dtype).itemsize
    per = tnpl * nb * math.prod(inner) * e
    buf = np.random.default_rng(seed).integers(0, 256, layers * per + 64, dtype=np.uint8)
    base = buf.__array_interface__["data"][0]
    shape = {"vllm": (2, nb, *inner), "flashinfer": (nb, 2, *inner)}.get(kind)
    if shape is None or tnpl == 1:
        tensors = [buf[i * per // tnpl:(i + 1) * per // tnpl].view(dtype).reshape(nb, *inner)
                   for i in range(layers * tnpl)]
    else:
        tensors = layout.kv_tensors([buf[i * per:(i + 1) * per].view(dtype).reshape(shape)
                                     for i in range(layers)], kind)
    return buf, tensors, [(1, t.__array_interface__["data"][0] - base) for t in tensors]


def apply_plan(packed, words: int, src: np.ndarray, dst: np.ndarray) -> None:
    """Run a packed plan (region ids ignored: one buffer a side) on byte buffers."""
    for seg in np.asarray(packed, np.uint64).reshape(-1, words).tolist():
        if words == 5:
            _, so, _, do, n = seg
            dst[do:do + n] = src[so:so + n]
        else:
            _, so, _, do, n, rows, ss, ds = seg
            for r in range(rows):
                dst[do + r * ds:do + r * ds + n] = src[so + r * ss:so + r * ss + n]


def same(xs, ys) -> bool:
    """Equal bytes (random bytes as float16 hold NaNs: compare them as integers)."""
    return len(xs) == len(ys) and all(np.array_equal(x.view(np.uint16), y.view(np.uint16)) for x, y in zip(xs, ys))


def expected(dst_tensors, src_tensors, pairs, sbl, dbl, sh=None, dh=None, axis=None):
    """What the destination tensors hold after the transfer, by numpy slicing."""
    out = [np.array(t, copy=True) for t in dst_tensors]
    for s, d in pairs:
        for a, b in zip(sbl, dbl):
            if sh is None:
                out[d][b] = src_tensors[s][a]
            else:
                ix_s = (slice(None),) * (axis - 1) + (slice(sh.start, sh.stop),)
                ix_d = (slice(None),) * (axis - 1) + (slice(dh.start, dh.stop),)
                out[d][b][ix_d] = src_tensors[s][a][ix_s]
    return out


# ---------------------------------------------------------------- the desc

def test_desc_layout_fields_and_rules():
    plain = CacheDesc(4, (8, 16, 2, 32), np.float16)
    assert plain.block_stride is None and plain.head_axis is None and plain.span == plain.size
    assert plain.to_wire() == {"n": 4, "shape": [8, 16, 2, 32], "dtype": 1, "placement": 0}   # unchanged
    # a stride equal to the block's own size is contiguous: normalised away
    assert CacheDesc(4, (8, 16, 2, 32), np.float16, block_stride=16 * 2 * 32) == plain
    fi = CacheDesc(4, (8, 16, 2, 32), np.float16, block_stride=2 * 16 * 2 * 32, head_axis=-2)
    assert fi.head_axis == 2 and fi.block_stride_bytes == 2 * fi.row_bytes
    assert fi.span == 7 * 2 * fi.row_bytes + fi.row_bytes and fi.size == plain.size
    assert CacheDesc.from_wire(fi.to_wire()) == fi
    for kw, rule in [({"block_stride": 100}, r"block_stride must be in \[1024"),
                     ({"head_axis": 0}, "cannot be dim 0"), ({"head_axis": 4}, r"head_axis must be in"),
                     ({"head_axis": -4}, "cannot be dim 0"), ({"block_stride": 2.0}, "must be an int")]:
        with pytest.raises(ParamInvalid, match=rule):
            CacheDesc(4, (8, 16, 2, 32), np.float16, **kw)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_describe_reads_the_layout(kind):
    _, tensors, _ = build(kind, 3, 5, (4, 2, 8), 1)
    desc = layout.describe(tensors, head_axis=2)
    assert desc.num_tensors == 6 and desc.shape == (5, 4, 2, 8) and desc.dtype == kv.DataType.DT_FLOAT16
    assert desc.block_stride == (2 * 64 if kind == "flashinfer" else None)


def test_union_spans_merges_interleaved_and_back_to_back():
    regions, placement = layout.union_spans([1000, 1010, 5000, 1020, 3000], 15)
    assert regions == [(1000, 35), (5000, 15), (3000, 15)]
    assert placement == [(0, 0), (0, 10), (1, 0), (0, 20), (2, 0)]


# ---------------------------------------------------------------- registration

async def test_registration_checks_strides():
    async with kv.KvEngine(1, kv.Role.PROMPT, None) as e:
        layers = [np.zeros((6, 2, 4, 2, 8), np.float16) for _ in range(2)]
        views = layout.kv_tensors(layers, "flashinfer")
        plain = CacheDesc(4, (6, 4, 2, 8), np.float16)
        with pytest.raises(ParamInvalid, match=r"blocks are 256 bytes apart.*block_stride=128"):
            e.register_kv_cache(plain, views)
        desc = layout.describe(views, head_axis=2)
        cache = e.register_kv_cache(desc, views)
        rids = {rid for rid, _ in cache._regions}
        assert len(rids) == 2   # per layer, K and V interleave: one region
        assert [off for _, off in cache._regions] == [0, 128, 0, 128]
        cache.tensors[1][3] = 7   # the views are the caller's memory
        assert (layers[0][3, 1] == 7).all() and not layers[0][3, 0].any()
        heads_swapped = [np.zeros((6, 2, 4, 8), np.float16).transpose(0, 2, 1, 3) for _ in range(4)]
        with pytest.raises(ParamInvalid, match="C-contiguous inside"):
            e.register_kv_cache(plain, heads_swapped)
        ro = [v.copy() for v in layout.kv_tensors([np.zeros((2, 6, 4, 2, 8), np.float16)] * 2, "vllm")]
        ro[2].flags.writeable = False
        with pytest.raises(ParamInvalid, match="tensor 2 is read-only"):
            e.register_kv_cache(plain, ro)
        with pytest.raises(ParamInvalid, match=r"shape \(6, 4, 2, 8\)"):
            e.register_kv_cache(CacheDesc(4, (6, 4, 8, 2), np.float16, block_stride=128), views)
        with pytest.raises(ParamInvalid, match="allocate_cache lays tensors out contiguously"):
            e.allocate_cache(desc)


async def test_registration_of_torch_tensors_and_views():
    torch = pytest.importorskip("torch", reason="torch is in the e2e extra (CI installs it)")
    async with kv.KvEngine(1, kv.Role.PROMPT, None) as e:
        for kind, shape in (("vllm", (2, 6, 4, 2, 8)), ("flashinfer", (6, 2, 4, 2, 8))):
            for dtype in (torch.float16, torch.bfloat16):
                layers = {f"layer.{i}": torch.zeros(shape, dtype=dtype) for i in range(2)}
                views = layout.kv_tensors(layers, kind)
                desc = layout.describe(views, head_axis=2)
                assert desc.dtype == (kv.DataType.DT_BF16 if dtype == torch.bfloat16 else kv.DataType.DT_FLOAT16)
                assert desc.block_stride == (views[0].stride(0) if kind == "flashinfer" else None)
                cache = e.register_kv_cache(desc, views)
                assert cache.tensor_addrs[1] == views[1].data_ptr()
                cache.tensors[3][5].view(np.uint16)[...] = 0x3C00
                assert (layers["layer.1"][5, 1] if kind == "flashinfer" else layers["layer.1"][1, 5]).view(
                    torch.int16).eq(0x3C00).all()
        bad = torch.zeros(6, 2, 4, 8).transpose(1, 2)
        with pytest.raises(ParamInvalid, match="C-contiguous inside"):
            e.register_kv_cache(CacheDesc(1, (6, 4, 2, 8), np.float32), [bad])


# ---------------------------------------------------------------- the planner

@HYP
@given(st.data())
def test_planner_on_layouts_equals_numpy_slicing(data):
    draw = data.draw
    ks, kd = draw(st.sampled_from(LAYOUTS)), draw(st.sampled_from(LAYOUTS))
    tnpl = draw(st.sampled_from([1, 2])) if ks == kd == "separate" else 2
    nl, nbs, nbd = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    inner = (draw(st.integers(1, 3)), 2, 4)
    sbuf, stens, sreg = build(ks, nl, nbs, inner, 1, tnpl)
    dbuf, dtens, dreg = build(kd, nl, nbd, inner, 2, tnpl)
    sdesc, ddesc = layout.describe(stens), layout.describe(dtens)
    n = draw(st.integers(1, min(nbs, nbd)))
    sbl = draw(st.lists(st.integers(0, nbs - 1), min_size=n, max_size=n))
    dbl = draw(st.permutations(range(nbd)))[:n]
    if draw(st.booleans()):   # runs
        s0, d0 = draw(st.integers(0, nbs - n)), draw(st.integers(0, nbd - n))
        sbl, dbl = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    ext = Ext((0, nl - 1), (0, nl - 1), tnpl) if draw(st.booleans()) else None
    packed, total = plan.Planner.blocks(sdesc, ddesc, sbl, dbl, ext, "push", sreg, dreg)
    assert packed.ndim == 1 and total == n * sdesc.row_bytes * len(stens)
    want = expected(dtens, stens, [(i, i) for i in range(len(stens))], sbl, dbl)
    apply_plan(packed, 5, sbuf, dbuf)
    assert same(dtens, want)
    segs = packed.reshape(-1, 5)
    if ks == kd == "vllm" and sbl == list(range(sbl[0], sbl[0] + n)) and dbl == list(range(dbl[0], dbl[0] + n)):
        assert segs.shape[0] <= len(stens)   # runs coalesce on contiguous blocks


def test_strided_blocks_never_coalesce_contiguous_do():
    _, fi, freg = build("flashinfer", 1, 8, (4, 2, 8), 1)
    _, vl, vreg = build("vllm", 1, 8, (4, 2, 8), 2)
    fdesc, vdesc = layout.describe(fi), layout.describe(vl)
    run = list(range(2, 6))
    assert plan.Planner.blocks(vdesc, vdesc, run, run, None, "push", vreg, vreg)[0].size == 2 * 5   # a run each
    assert plan.Planner.blocks(fdesc, vdesc, run, run, None, "push", freg, vreg)[0].size == 5 * 8
    assert plan.Planner.blocks(vdesc, fdesc, run, run, None, "push", vreg, freg)[0].size == 5 * 8


def test_row_transfers_follow_the_block_stride():
    """push_kv_cache of one dim-0 row of a strided cache (a batch row) lands at row * stride."""
    _, fi, freg = build("flashinfer", 1, 4, (3, 8), 3)
    _, vl, vreg = build("vllm", 1, 4, (3, 8), 4)
    fdesc, vdesc = layout.describe(fi), layout.describe(vl)
    segs = plan.plan_cache(fdesc, vdesc, 2, 1, -1, None, op="push")
    assert segs[0][1] == 2 * fdesc.block_stride_bytes and segs[0][3] == 1 * vdesc.row_bytes


# ---------------------------------------------------------------- engines

def engine_side(engine, kind: str, layers: int, nb: int, inner, seed: int, tnpl: int = 2, head_axis=None):
    """A cache of layout ``kind`` registered with ``engine`` (its own memory), filled."""
    _, tensors, _ = build(kind, layers, nb, inner, seed, tnpl)
    desc = layout.describe(tensors, head_axis=head_axis)
    return engine.register_kv_cache(desc, tensors), tensors


@pytest.mark.parametrize("ks,kd", [("flashinfer", "vllm"), ("vllm", "flashinfer"), ("flashinfer", "flashinfer")])
async def test_push_and_pull_between_layouts_byte_exact(pair, ks, kd):
    p, d = pair
    await link(p, d)
    src, stens = engine_side(p, ks, 3, 24, (16, 2, 16), 1)
    dst, dtens = engine_side(d, kd, 3, 20, (16, 2, 16), 2)
    await p.wait_remote_cache(2, dst.cache_id)
    key = kv.BlocksCacheKey(2, dst.cache_id)
    sbl, dbl = [5, 6, 7, 8, 0, 23, 11], [3, 4, 5, 6, 19, 0, 12]
    want = expected(dtens, stens, [(i, i) for i in range(6)], sbl, dbl)
    assert await p.push_kv_blocks(src, key, sbl, dbl, timeout=10) == S.LLM_SUCCESS
    assert same(dtens, want)
    # pull back, layer 2 of the peer into layer 0 here (K and V)
    before = [np.array(t, copy=True) for t in stens]
    ext = Ext((2, 2), (0, 0), 2)
    assert await p.pull_kv_blocks(key, src, [12, 3], [1, 2], ext_param=ext, timeout=10) == S.LLM_SUCCESS
    want = expected(before, dtens, [(4, 0), (5, 1)], [12, 3], [1, 2])
    assert same(stens, want)


async def test_sglang_token_pool_and_mla(pair):
    """SGLang: per-layer K and V pools of (tokens, heads, dim), a token is a block (page_size 1);
    MLA: one latent (blocks, block_size, dim) tensor per layer, tensor_num_per_layer=1."""
    p, d = pair
    await link(p, d)
    src, stens = engine_side(p, "separate", 2, 64, (2, 16), 1)
    dst, dtens = engine_side(d, "separate", 2, 50, (2, 16), 2)
    await p.wait_remote_cache(2, dst.cache_id)
    tokens_s, tokens_d = np.arange(10, 40), np.r_[np.arange(0, 20), np.arange(30, 40)]
    want = expected(dtens, stens, [(i, i) for i in range(4)], tokens_s, tokens_d)
    await p.push_kv_blocks(src, kv.BlocksCacheKey(2, dst.cache_id), tokens_s, tokens_d, timeout=10)
    assert same(dtens, want)
    msrc, mst = engine_side(p, "separate", 4, 12, (16, 72), 3, tnpl=1)
    mdst, mdt = engine_side(d, "separate", 2, 12, (16, 72), 4, tnpl=1)
    await p.wait_remote_cache(2, mdst.cache_id)
    ext = Ext(range(2, 4), range(0, 2), 1)   # layers 2, 3 -> 0, 1
    want = expected(mdt, mst, [(2, 0), (3, 1)], [0, 7, 3], [11, 2, 3])
    await p.push_kv_blocks(msrc, kv.BlocksCacheKey(2, mdst.cache_id), [0, 7, 3], [11, 2, 3], ext_param=ext,
                           timeout=10)
    assert same(mdt, want)
    with pytest.raises(ParamInvalid, match="max layer index 1"):   # the decode side has 2 latent layers
        await p.push_kv_blocks(msrc, kv.BlocksCacheKey(2, mdst.cache_id), [0], [0], ext_param=Ext((3, 3), (2, 2), 1))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_layouts_byte_exact_across_processes(transport):
    """A FlashInfer source here pushes into a FlashInfer cache registered by another process,
    and pulls blocks of a plain cache there into its strided blocks."""
    nb, inner, L = 32, (16, 2, 32), 2
    peer = await PeerProcess.start(cluster_id=2, secret=SECRET, transport=transport)
    try:
        async with kv.KvEngine(1, kv.Role.PROMPT, None, kv.EngineOptions(secret=SECRET, transport=transport)) as e:
            st_, _ = await e.link_clusters([kv.ClusterInfo(2, peer.address)])
            assert st_ == S.LLM_SUCCESS
            src, stens = engine_side(e, "flashinfer", L, nb, inner, 7)
            fi = (await peer.call("register", n=2 * L, shape=[nb, *inner], dtype="float16", layout="flashinfer",
                                  block_stride=2 * math.prod(inner), head_axis=2))["cache_id"]
            plain = (await peer.call("alloc", n=2 * L, shape=[nb, *inner], dtype="float16", fill=5))["cache_id"]
            await e.wait_remote_cache(2, fi)
            await e.wait_remote_cache(2, plain)
            sbl, dbl = np.random.default_rng(1).permutation(nb)[:20], np.random.default_rng(2).permutation(nb)[:20]
            await e.push_kv_blocks(src, kv.BlocksCacheKey(2, fi), sbl, dbl, timeout=30)
            zero = row_digests([np.zeros((1, *inner), np.float16)])[0][0]
            srows = row_digests(stens)
            want = [[zero] * nb for _ in range(2 * L)]
            for t in range(2 * L):
                for s, d in zip(sbl.tolist(), dbl.tolist()):
                    want[t][d] = srows[t][s]
            assert (await peer.call("digest", cache_id=fi))["rows"] == want
            prows = (await peer.call("digest", cache_id=plain))["rows"]
            await e.pull_kv_blocks(kv.BlocksCacheKey(2, plain), src, [0, 1, 2, 31], [9, 10, 11, 3], timeout=30)
            got = row_digests(stens)
            for t in range(2 * L):
                assert [got[t][b] for b in (9, 10, 11, 3)] == [prows[t][b] for b in (0, 1, 2, 31)]
                assert got[t][4] == srows[t][4]   # untouched
    finally:
        await peer.close()
