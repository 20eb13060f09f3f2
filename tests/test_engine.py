"""The cache API through the public engine object: two engines in this process,
over the ``local`` transport and over ``shm`` (memfd mappings and CMA), each
under asyncio and uvloop."""

import asyncio

import numpy as np
import pytest

import kvengine as kv
from kvengine import LLMStatusCode as S
from conftest import filled, link, make_pair, snapshot

F16 = np.float16


def same(a, b):
    """Byte equality (random bytes as float16 contain NaNs)."""
    return np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def desc(n=4, shape=(4, 256), dtype=F16):
    return kv.CacheDesc(n, shape, dtype)


async def test_push_row_byte_exact_other_rows_untouched(pair):
    p, d = pair
    await link(d, p)
    src = filled(p.allocate_cache(desc()), seed=1)
    dst_shared = d.allocate_cache(desc())
    bufs = [np.zeros((4, 256), F16) for _ in range(4)]
    dst_owned = d.register_kv_cache(desc(), bufs)
    for dst, view in ((dst_shared, dst_shared.tensors), (dst_owned, bufs)):
        await p.wait_remote_cache(2, dst.cache_id)
        assert await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 2), src_batch_index=1) == S.LLM_SUCCESS
        for t in range(4):
            assert same(view[t][2], src.tensors[t][1])
            for r in (0, 1, 3):
                assert not view[t][r].any(), "a row the push did not name changed"


async def test_pull_row_and_pull_size(pair):
    p, d = pair
    await link(p, d)
    src = filled(p.allocate_cache(desc()), seed=2)
    dst = d.allocate_cache(desc())
    await d.wait_remote_cache(1, src.cache_id)
    assert await d.pull_kv_cache(kv.CacheIndex(1, src.cache_id, 3), dst, batch_index=0) == S.LLM_SUCCESS
    for t in range(4):
        assert same(dst.tensors[t][0], src.tensors[t][3])
        assert not dst.tensors[t][1:].any()
    # size: bytes per tensor, only the head of the row moves
    await d.pull_kv_cache(kv.CacheIndex(1, src.cache_id, 0), dst, batch_index=1, size=100)
    for t in range(4):
        got = dst.tensors[t][1].view(np.uint8)
        assert same(got[:100], src.tensors[t][0].view(np.uint8)[:100])
        assert not got[100:].any()


@pytest.mark.parametrize("src_range,dst_range,tnpl", [
    ((0, 1), (2, 3), 2),            # inclusive tuples: layers 0-1 -> 2-3
    (range(0, 2), range(2, 4), 2),  # half-open ranges, same mapping
    ((3, 3), (0, 0), 2),            # one layer
    ((1, 6), (0, 5), 1),            # one tensor per layer
    ((-1, -1), (-1, -1), 4),        # all layers
])
async def test_layer_range_mapping_byte_exact(pair, src_range, dst_range, tnpl):
    p, d = pair
    await link(p, d)
    src = filled(p.allocate_cache(desc(8)), seed=3)
    dst = d.allocate_cache(desc(8))
    await p.wait_remote_cache(2, dst.cache_id)
    ext = kv.KvCacheExtParam(src_range, dst_range, tnpl)
    await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 1), src_batch_index=2, ext_param=ext)

    def tensors(r, n_layers):
        if isinstance(r, range):
            layers = list(r)
        elif r == (-1, -1):
            layers = list(range(n_layers))
        else:
            layers = list(range(r[0], r[1] + 1))
        return [l * tnpl + k for l in layers for k in range(tnpl)]

    st, dt = tensors(src_range, 8 // tnpl), tensors(dst_range, 8 // tnpl)
    assert len(st) == len(dt)
    for s, t in zip(st, dt):
        assert same(dst.tensors[t][1], src.tensors[s][2])
    for t in range(8):
        if t not in dt:
            assert not dst.tensors[t].any(), f"tensor {t} outside the layer range changed"
        assert not dst.tensors[t][[0, 2, 3]].any()


async def test_blocks_push_and_pull_non_contiguous(pair):
    p, d = pair
    await link(p, d)
    blocks = kv.CacheDesc(4, (16, 8, 64), F16)   # 16 blocks
    src = filled(p.allocate_cache(blocks), seed=4)
    dst = d.allocate_cache(blocks)
    await p.wait_remote_cache(2, dst.cache_id)
    sb, db = [0, 1, 2, 7, 9, 10], [5, 6, 7, 0, 12, 13]
    await p.push_kv_blocks(src, kv.BlocksCacheKey(2, dst.cache_id), sb, db)
    for t in range(4):
        for s, b in zip(sb, db):
            assert same(dst.tensors[t][b], src.tensors[t][s])
        untouched = [b for b in range(16) if b not in db]
        assert not dst.tensors[t][untouched].any()
    # pull them back into a fresh local cache, reversed order
    back = p.allocate_cache(blocks)
    await p.pull_kv_blocks(kv.BlocksCacheKey(2, dst.cache_id), back, db[::-1], [15, 14, 13, 3, 2, 1])
    for t in range(4):
        for b, s in zip([15, 14, 13, 3, 2, 1], sb[::-1]):
            assert same(back.tensors[t][b], src.tensors[t][s])


async def test_blocks_with_layer_range(pair):
    p, d = pair
    await link(p, d)
    blocks = kv.CacheDesc(4, (8, 32), F16)
    src = filled(p.allocate_cache(blocks), seed=5)
    dst = d.allocate_cache(blocks)
    await p.wait_remote_cache(2, dst.cache_id)
    ext = kv.KvCacheExtParam((1, 1), (0, 0), 2)
    await p.push_kv_blocks(src, kv.BlocksCacheKey(2, dst.cache_id), [3], [4], ext_param=ext)
    assert same(dst.tensors[0][4], src.tensors[2][3])
    assert same(dst.tensors[1][4], src.tensors[3][3])
    assert not dst.tensors[2].any() and not dst.tensors[3].any()


def _bad_calls(p, src, dst_id, blk, dst_blk_id):
    """(rule fragment, call) pairs: each must raise LLMParamInvalidError naming the rule."""
    C, B, E = kv.CacheIndex, kv.BlocksCacheKey, kv.KvCacheExtParam
    return [
        ("push size must be -1", lambda: p.push_kv_cache(src, C(2, dst_id, 0), size=16)),
        ("spans must be equal", lambda: p.push_kv_cache(src, C(2, dst_id, 0), ext_param=E((0, 1), (0, 0)))),
        ("must divide", lambda: p.push_kv_cache(src, C(2, dst_id, 0), ext_param=E((0, 0), (0, 0), 3))),
        ("max layer index", lambda: p.push_kv_cache(src, C(2, dst_id, 0), ext_param=E((0, 2), (0, 2)))),
        ("step 1", lambda: p.push_kv_cache(src, C(2, dst_id, 0), ext_param=E(range(0, 2, 2), range(0, 1)))),
        ("tensor_num_per_layer", lambda: p.push_kv_cache(src, C(2, dst_id, 0), ext_param=E((0, 0), (0, 0), 0))),
        ("destination batch_index", lambda: p.push_kv_cache(src, C(2, dst_id, 4))),
        ("source batch_index", lambda: p.push_kv_cache(src, C(2, dst_id, 0), src_batch_index=-1)),
        ("timeout", lambda: p.push_kv_cache(src, C(2, dst_id, 0), timeout=0)),
        ("CacheIndex", lambda: p.push_kv_cache(src, (2, dst_id, 0))),
        ("pull size", lambda: p.pull_kv_cache(C(2, dst_id, 0), src, size=10**6)),
        ("non-empty", lambda: p.push_kv_blocks(blk, B(2, dst_blk_id), [], [])),
        ("lengths must be equal", lambda: p.push_kv_blocks(blk, B(2, dst_blk_id), [0, 1], [0])),
        ("source block 9 out of range", lambda: p.push_kv_blocks(blk, B(2, dst_blk_id), [9], [0])),
        ("destination block 8 out of range", lambda: p.push_kv_blocks(blk, B(2, dst_blk_id), [0], [8])),
        ("more than once", lambda: p.push_kv_blocks(blk, B(2, dst_blk_id), [0, 1], [3, 3])),
        ("dtype", lambda: p.push_kv_blocks(src, B(2, dst_blk_id), [0], [0])),
        ("BlocksCacheKey", lambda: p.push_kv_blocks(blk, C(2, dst_blk_id, 0), [0], [0])),
    ]


async def test_every_parameter_rule_is_param_invalid_and_touches_nothing(pair):
    p, d = pair
    await link(p, d)
    src = filled(p.allocate_cache(desc()), seed=6)
    dst = d.allocate_cache(desc())
    blk = filled(p.allocate_cache(kv.CacheDesc(4, (8, 32), np.int8)), seed=7)
    dblk = d.allocate_cache(kv.CacheDesc(4, (8, 32), np.int8))
    await p.wait_remote_cache(2, dst.cache_id)
    await p.wait_remote_cache(2, dblk.cache_id)
    for rule, call in _bad_calls(p, src, dst.cache_id, blk, dblk.cache_id):
        with pytest.raises(kv.LLMParamInvalidError, match=rule) as ei:
            await call()
        assert ei.value.status == S.LLM_PARAM_INVALID
    assert not any(t.any() for t in dst.tensors + dblk.tensors)
    # the submit twin reports the same status without raising
    t = p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), size=16)
    assert t.done() and await t == S.LLM_PARAM_INVALID and "size" in t.message()


async def test_not_linked_unknown_cache_and_already_linked(pair):
    p, d = pair
    src = p.allocate_cache(desc())
    with pytest.raises(kv.LLMNotYetLinkError):
        await p.push_kv_cache(src, kv.CacheIndex(2, 1, 0))
    assert await p.submit_pull_kv_cache(kv.CacheIndex(2, 1, 0), src) == S.LLM_NOT_YET_LINK
    await link(p, d)
    with pytest.raises(kv.LLMKvCacheNotExistError, match="cluster 2 has no cache 99"):
        await p.push_kv_cache(src, kv.CacheIndex(2, 99, 0))
    foreign = d.allocate_cache(desc())   # a cache of the other engine is unknown here
    with pytest.raises(kv.LLMKvCacheNotExistError):
        await p.push_kv_cache(foreign, kv.CacheIndex(2, foreign.cache_id, 0))
    st, per = await p.link_clusters([kv.ClusterInfo(2, d.address)])
    assert (st, per) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
    st, per = await d.link_clusters([kv.ClusterInfo(1, p.address)])   # recorded on both ends
    assert per == [S.LLM_ALREADY_LINK]


async def test_cache_registered_after_link_is_usable_by_peer(pair):
    p, d = pair
    await link(p, d)
    src = filled(p.allocate_cache(desc()), seed=8)
    later = [np.zeros((4, 256), F16) for _ in range(4)]
    dst = d.register_kv_cache(desc(), later)
    assert await p.wait_remote_cache(2, dst.cache_id, timeout=5) == S.LLM_SUCCESS
    await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0))
    assert all(same(later[t][0], src.tensors[t][0]) for t in range(4))


async def test_64_concurrent_pushes_byte_exact(pair):
    p, d = pair
    await link(p, d)
    big = kv.CacheDesc(8, (64, 64 * 1024), np.uint8)    # rows of 64 KiB and 512 KiB per push
    src = filled(p.allocate_cache(big), seed=9)
    dst = d.allocate_cache(big)
    await p.wait_remote_cache(2, dst.cache_id)
    statuses = await asyncio.gather(*(
        p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 63 - i), src_batch_index=i, timeout=10)
        for i in range(64)))
    assert statuses == [S.LLM_SUCCESS] * 64
    for t in range(8):
        assert same(dst.tensors[t][::-1], src.tensors[t])


async def _big_pair_caches(p, d, mib=256):
    big = kv.CacheDesc(2, (1, mib << 19), np.uint8)
    src = filled(p.allocate_cache(big), seed=10)
    dst = d.allocate_cache(big)
    await p.wait_remote_cache(2, dst.cache_id)
    return src, dst


async def _link_still_works(p, d):
    small_src = filled(p.allocate_cache(desc()), seed=11)
    small_dst = d.allocate_cache(desc())
    await p.wait_remote_cache(2, small_dst.cache_id)
    assert await p.push_kv_cache(small_src, kv.CacheIndex(2, small_dst.cache_id, 0)) == S.LLM_SUCCESS
    assert same(small_dst.tensors[3][0], small_src.tensors[3][0])


async def test_timeout_is_fenced_and_link_stays_usable(pair):
    p, d = pair
    await link(p, d)
    src, dst = await _big_pair_caches(p, d)
    t = p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), timeout=0.002)
    assert await t == S.LLM_TIMEOUT
    # the fence: when the status is delivered no mover works on the job any more
    assert p.stats()["native"]["jobs_live"] == 0
    assert t.nbytes < 2 * src.desc.size
    assert "did not finish within 0.002 s" in t.message()
    before = snapshot(dst)
    await _link_still_works(p, d)
    assert all(same(a, b) for a, b in zip(before, dst.tensors))
    with pytest.raises(kv.LLMTimeoutError) as ei:
        await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), timeout=0.002)
    assert isinstance(ei.value, TimeoutError)
    # and a full push with time enough still succeeds on the same link
    assert await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), timeout=30) == S.LLM_SUCCESS
    assert same(dst.tensors[1], src.tensors[1])


async def test_task_cancellation_is_fenced(pair):
    p, d = pair
    await link(p, d)
    src, dst = await _big_pair_caches(p, d)
    task = asyncio.ensure_future(p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), timeout=30))
    await asyncio.sleep(0)   # let the push start
    assert not task.done()   # 256 MiB: far from finished
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert p.stats()["native"]["jobs_live"] == 0   # CancelledError came after the fence
    before = snapshot(dst)
    await _link_still_works(p, d)
    assert all(same(a, b) for a, b in zip(before, dst.tensors))


async def test_transfer_cancel_and_await_semantics(pair):
    p, d = pair
    await link(p, d)
    src, dst = await _big_pair_caches(p, d)
    t = p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), timeout=30)
    assert not t.done() and t.status is None
    # cancelling a task that awaits a Transfer does not cancel the transfer
    waiter = asyncio.ensure_future(t._wait())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert t.cancel() is True
    assert await t == S.LLM_CANCELLED and t.status == S.LLM_CANCELLED
    assert t.cancel() is False
    assert p.stats()["native"]["jobs_live"] == 0


async def test_close_resolves_transfers_in_flight(transport):
    p, d = await make_pair(transport)
    try:
        await link(p, d)
        src, dst = await _big_pair_caches(p, d, mib=512)
        ts = [p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), timeout=30) for _ in range(4)]
        await p.close()
        assert all(t.done() for t in ts)
        assert {t.status for t in ts} <= {S.LLM_ENGINE_FINALIZED, S.LLM_NOT_YET_LINK, S.LLM_SUCCESS}
        assert S.LLM_SUCCESS not in {t.status for t in ts[1:]}
        with pytest.raises(kv.LLMEngineFinalizedError):
            await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0))
        with pytest.raises(kv.LLMEngineFinalizedError):
            p.allocate_cache(desc())
        # the peer saw the unlink: its link is gone too
        assert 1 not in d.stats()["links"]
    finally:
        await p.close()
        await d.close()


async def test_unregister(pair):
    p, d = pair
    await link(p, d)
    src = filled(p.allocate_cache(desc()), seed=12)
    dst = d.allocate_cache(desc())
    await p.wait_remote_cache(2, dst.cache_id)
    await d.unregister_kv_cache(dst.cache_id)   # done once the peer confirmed
    with pytest.raises(kv.LLMKvCacheNotExistError):
        await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0))
    await p.unregister_kv_cache(src.cache_id)
    with pytest.raises(kv.LLMKvCacheNotExistError, match="not registered"):
        await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0))
    await p.unregister_kv_cache(12345)   # unknown id: no-op, as in LLM-DataDist


async def test_unregister_waits_for_transfers_in_flight(pair):
    p, d = pair
    await link(p, d)
    src, dst = await _big_pair_caches(p, d)
    t = p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), timeout=30)
    released = d.unregister_kv_cache(dst.cache_id)
    await released
    assert t.done(), "the peer confirmed the unregistration while a transfer still wrote into the cache"
    assert t.status == S.LLM_SUCCESS


async def test_register_kv_cache_inputs(pair):
    p, _ = pair
    dsc = desc(2, (4, 8))
    ok = p.register_kv_cache(dsc, [bytearray(64), memoryview(bytearray(64))])
    assert ok.cache_id >= 1 and ok.tensors[0].shape == (4, 8)
    cases = [
        ("2 buffers for num_tensors 1", kv.CacheDesc(1, (4, 8), F16), [np.zeros((4, 8), F16)] * 2),
        ("not C-contiguous", dsc, [np.zeros((8, 4), F16).T, np.zeros((4, 8), F16)]),
        ("read-only", dsc, [bytes(64), bytes(64)]),
        ("has 32 bytes", dsc, [bytearray(32), bytearray(64)]),
        ("neither the buffer protocol", dsc, [object(), object()]),
        ("list of buffers", dsc, np.zeros((2, 4, 8), F16)),
    ]
    for rule, dd, bufs in cases:
        with pytest.raises(kv.LLMParamInvalidError, match=rule):
            p.register_kv_cache(dd, bufs)
    with pytest.raises(kv.LLMFeatureNotEnabledError):
        p.allocate_cache(kv.CacheDesc(1, (4,), F16, kv.Placement.DEVICE))


async def test_unlink_and_relink(pair):
    p, d = pair
    await link(p, d)
    src = filled(p.allocate_cache(desc()), seed=13)
    dst = d.allocate_cache(desc())
    st, per = await p.unlink_clusters([kv.ClusterInfo(2, d.address)])
    assert st == S.LLM_SUCCESS
    assert 1 not in d.stats()["links"]
    with pytest.raises(kv.LLMNotYetLinkError):
        await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0))
    assert (await p.unlink_clusters([kv.ClusterInfo(2, d.address)]))[1] == [S.LLM_NOT_YET_LINK]
    await link(d, p)   # the other side links this time
    await p.wait_remote_cache(2, dst.cache_id)
    await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0))
    # force: only this end; the peer notices the closed channel
    st, _ = await p.unlink_clusters([kv.ClusterInfo(2, d.address)], force=True)
    assert st == S.LLM_SUCCESS and 2 not in p.stats()["links"]


async def test_link_failures(transport):
    async def fresh(cid, secret=None):
        return await kv.KvEngine(cid, kv.Role.MIX, "127.0.0.1:0",
                                 kv.EngineOptions(transport=transport, secret=secret, link_timeout=2)).start()
    a, b = await fresh(1), await fresh(2)
    s1, s2 = await fresh(3, b"right"), await fresh(4, b"wrong")
    s3 = await fresh(5, b"right")
    try:
        # nobody listens there
        closed = await kv.KvEngine(9, listen="127.0.0.1:0").start()
        addr = closed.address
        await closed.close()
        assert (await a.link_clusters([kv.ClusterInfo(9, addr)]))[1] == [S.LLM_LINK_FAILED]
        # the engine at that address is another cluster
        assert (await a.link_clusters([kv.ClusterInfo(7, b.address)]))[1] == [S.LLM_LINK_FAILED]
        # own id, malformed address, empty list, duplicates in one call
        assert (await a.link_clusters([kv.ClusterInfo(1, b.address)]))[1] == [S.LLM_PARAM_INVALID]
        assert (await a.link_clusters([kv.ClusterInfo(2, "nonsense")]))[1] == [S.LLM_PARAM_INVALID]
        assert await a.link_clusters([]) == (S.LLM_PARAM_INVALID, [])
        st, per = await a.link_clusters([kv.ClusterInfo(2, b.address), kv.ClusterInfo(2, b.address)])
        assert per == [S.LLM_PARAM_INVALID] * 2
        # secrets: mismatch either way fails, and nothing is linked on either end
        for i, (sx, sy) in enumerate(((b"right", b"wrong"), (b"wrong", b"right"), (None, b"right"),
                                      (b"right", None))):
            x, y = await fresh(10 + 2 * i, sx), await fresh(11 + 2 * i, sy)
            try:
                per = (await x.link_clusters([kv.ClusterInfo(y.cluster_id, y.address)]))[1]
                assert per == [S.LLM_LINK_FAILED], (sx, sy)
                assert y.cluster_id not in x.stats()["links"] and x.cluster_id not in y.stats()["links"]
            finally:
                await x.close()
                await y.close()
        assert (await s1.link_clusters([kv.ClusterInfo(5, s3.address)]))[0] == S.LLM_SUCCESS
        # several clusters in one call, linked in parallel
        st, per = await a.link_clusters([kv.ClusterInfo(2, b.address), kv.ClusterInfo(3, s1.address)])
        assert per == [S.LLM_SUCCESS, S.LLM_LINK_FAILED] and st == S.LLM_LINK_FAILED
    finally:
        for e in (a, b, s1, s2, s3):
            await e.close()


async def test_engine_argument_checks():
    with pytest.raises(kv.LLMParamInvalidError, match="cluster_id"):
        kv.KvEngine(-1)
    with pytest.raises(kv.LLMParamInvalidError, match="host:port"):
        kv.KvEngine(1, listen="nohost")
    with pytest.raises(kv.LLMParamInvalidError, match="transport"):
        kv.EngineOptions(transport="carrier-pigeon")
    e = kv.KvEngine(1)
    with pytest.raises(kv.LLMFailedError, match="not started"):
        e.allocate_cache(desc())
    await e.close()


async def test_allocate_cache_async_keeps_the_loop_live(pair):
    p, d = pair
    await link(p, d)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    tick = asyncio.ensure_future(ticker())
    try:
        dst = await d.allocate_cache_async(kv.CacheDesc(2, (1, 64 << 20), np.uint8))   # 128 MiB
    finally:
        tick.cancel()
    assert ticks > 1, "the loop stood still while the cache was pre-faulted"
    src = filled(p.allocate_cache(kv.CacheDesc(2, (1, 64 << 20), np.uint8)), seed=14)
    await p.wait_remote_cache(2, dst.cache_id)
    await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), timeout=30)
    assert all(same(a, b) for a, b in zip(src.tensors, dst.tensors))


async def test_wait_link_on_the_listening_side(pair):
    p, d = pair
    waiter = asyncio.ensure_future(p.wait_link(2, timeout=10))   # p listens; d will link to it
    await asyncio.sleep(0)
    assert not waiter.done()
    await link(d, p)
    assert await waiter == S.LLM_SUCCESS
    assert await p.wait_link(2) == S.LLM_SUCCESS                # already linked: at once
    with pytest.raises(kv.LLMTimeoutError):
        await p.wait_link(99, timeout=0.05)
    # unlink_clusters rejects what link_clusters rejects
    st, per = await p.unlink_clusters([kv.ClusterInfo(2, d.address), kv.ClusterInfo(2, d.address)])
    assert per == [S.LLM_PARAM_INVALID] * 2 and 2 in p.stats()["links"]


def _native_threads():
    """The names of this process's threads that kvengine's native core started."""
    import os
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except FileNotFoundError:   # a thread that ended meanwhile
            continue
        if name.startswith("kv-"):
            names.append(name)
    return sorted(names)


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
async def test_native_threads_are_named_and_stop_on_close(transport):
    """An operator's `top -H` names each native thread (kv-mover-N, kv-tcp-io, kv-ucx-io), and
    closing the engines ends every one of them."""
    from kvengine.native import _native
    if transport == "ucx" and not _native.UCX:
        pytest.skip("kvengine built without UCX: pip install 'kvengine[ucx]' (libucx-cu12), then rebuild")
    before = _native_threads()
    p, d = await make_pair(transport, movers=2)
    try:
        await link(p, d)
        src = filled(p.allocate_cache(desc()), seed=3)
        dst = d.allocate_cache(desc())
        await p.wait_remote_cache(2, dst.cache_id)
        assert await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0)) == S.LLM_SUCCESS
        started = _native_threads()
        io = f"kv-{transport}-io"
        for name in (io, "kv-mover-0", "kv-mover-1"):   # two engines: two of each
            assert started.count(name) - before.count(name) == 2, (name, started)
    finally:
        await p.close()
        await d.close()
    assert _native_threads() == before
