"""Prefill engine in the test process, decode engine in a child process
(kvengine._peer): the shm transport with memfd caches (allocate_cache) and
caller-owned buffers reached with CMA (register_kv_cache). The child reports
per-row digests of its own memory, so every byte check reads the destination
process's memory, not our mapping of it."""

import asyncio

import numpy as np
import pytest

import kvengine as kv
from kvengine import LLMStatusCode as S
from kvengine._peer import PeerProcess, fill_pattern, row_digests

SECRET = b"cross-process-secret"


@pytest.fixture(params=["shm", "tcp"])
def xtransport(request):
    return request.param


@pytest.fixture
async def prefill(xtransport):
    e = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0",
                          kv.EngineOptions(secret=SECRET, transport=xtransport)).start()
    try:
        yield e
    finally:
        await e.close()
        assert e.stats()["native"]["jobs_live"] == 0


@pytest.fixture
async def decode(xtransport):
    peer = await PeerProcess.start(cluster_id=2, secret=SECRET, transport=xtransport)
    try:
        yield peer
    finally:
        await peer.close()


async def linked(prefill, peer):
    st, per = await prefill.link_clusters([kv.ClusterInfo(2, peer.address)])
    assert st == S.LLM_SUCCESS, per
    assert prefill.stats()["links"][2]["transport"] == prefill.options.transport


def local_cache(engine, desc, seed):
    cache = engine.allocate_cache(desc)
    for i, t in enumerate(cache.tensors):
        fill_pattern(t, seed, i)
    return cache


@pytest.mark.parametrize("kind", ["alloc", "register"])
async def test_push_with_layer_ranges_byte_exact(prefill, decode, kind):
    desc = kv.CacheDesc(8, (4, 64, 128), np.float16)
    dst = (await decode.call(kind, n=8, shape=[4, 64, 128], dtype="float16"))["cache_id"]
    await linked(prefill, decode)
    src = local_cache(prefill, desc, seed=21)
    await prefill.push_kv_cache(src, kv.CacheIndex(2, dst, 3), src_batch_index=1,
                                ext_param=kv.KvCacheExtParam((0, 1), (2, 3), 2))
    await prefill.push_kv_cache(src, kv.CacheIndex(2, dst, 0), src_batch_index=2,
                                ext_param=kv.KvCacheExtParam(range(3, 4), range(0, 1), 2))
    # dst tensors 4..7 row 3 <- src tensors 0..3 row 1; dst tensors 0,1 row 0 <- src tensors 6,7 row 2
    src_rows = row_digests(src.tensors)
    zero = row_digests([np.zeros(desc.shape, np.float16)])[0][0]
    want = [[zero] * 4 for _ in range(8)]
    for t in range(4, 8):
        want[t][3] = src_rows[t - 4][1]
    for t in (0, 1):
        want[t][0] = src_rows[t + 6][2]
    assert (await decode.call("digest", cache_id=dst))["rows"] == want


async def test_pull_and_pull_size(prefill, decode):
    desc = kv.CacheDesc(4, (2, 4096), np.uint8)
    remote = (await decode.call("register", n=4, shape=[2, 4096], dtype="uint8", fill=22))["cache_id"]
    await linked(prefill, decode)
    mine = prefill.allocate_cache(desc)
    await prefill.pull_kv_cache(kv.CacheIndex(2, remote, 1), mine, batch_index=0)
    await prefill.pull_kv_cache(kv.CacheIndex(2, remote, 0), mine, batch_index=1, size=1000)
    ref = [np.zeros(desc.shape, np.uint8) for _ in range(4)]
    for i, t in enumerate(ref):
        fill_pattern(t, 22, i)
    for t in range(4):
        assert np.array_equal(mine.tensors[t][0], ref[t][1])
        assert np.array_equal(mine.tensors[t][1][:1000], ref[t][0][:1000])
        assert not mine.tensors[t][1][1000:].any()


async def test_blocks_non_contiguous(prefill, decode):
    desc = kv.CacheDesc(2, (32, 16, 64), np.float16)
    dst = (await decode.call("alloc", n=2, shape=[32, 16, 64], dtype="float16"))["cache_id"]
    await linked(prefill, decode)
    src = local_cache(prefill, desc, seed=23)
    sb, db = [0, 1, 2, 3, 10, 30, 31], [7, 8, 9, 10, 0, 20, 21]
    await prefill.push_kv_blocks(src, kv.BlocksCacheKey(2, dst), sb, db)
    src_rows = row_digests(src.tensors)
    zero = row_digests([np.zeros(desc.shape, np.float16)])[0][0]
    want = [[zero] * 32 for _ in range(2)]
    for t in range(2):
        for s, d in zip(sb, db):
            want[t][d] = src_rows[t][s]
    assert (await decode.call("digest", cache_id=dst))["rows"] == want
    # pull a block list back from the peer
    back = prefill.allocate_cache(desc)
    await prefill.pull_kv_blocks(kv.BlocksCacheKey(2, dst), back, [20, 0], [5, 6])
    assert np.array_equal(back.tensors[1][5].view(np.uint8), src.tensors[1][30].view(np.uint8))
    assert np.array_equal(back.tensors[0][6].view(np.uint8), src.tensors[0][10].view(np.uint8))


async def test_cache_registered_after_link_and_peer_push(prefill, decode):
    await linked(prefill, decode)
    desc = kv.CacheDesc(2, (2, 1024), np.float16)
    src = local_cache(prefill, desc, seed=24)
    for kind in ("alloc", "register"):
        dst = (await decode.call(kind, n=2, shape=[2, 1024], dtype="float16"))["cache_id"]
        await prefill.wait_remote_cache(2, dst, timeout=5)
        await prefill.push_kv_cache(src, kv.CacheIndex(2, dst, 1), src_batch_index=0)
        rows = (await decode.call("digest", cache_id=dst))["rows"]
        assert [r[1] for r in rows] == [r[0] for r in row_digests(src.tensors)]
    # the link works in the other direction too: the child pushes into our cache
    mine = prefill.allocate_cache(desc)
    peer_src = (await decode.call("alloc", n=2, shape=[2, 1024], dtype="float16", fill=25))["cache_id"]
    reply = await decode.call("push", cache_id=peer_src, cluster_id=1, dst_cache_id=mine.cache_id,
                              src_batch=1, dst_batch=0, timeout=5)
    assert reply["status"] == S.LLM_SUCCESS
    ref = [np.zeros(desc.shape, np.float16) for _ in range(2)]
    for i, t in enumerate(ref):
        fill_pattern(t, 25, i)
    assert all(np.array_equal(mine.tensors[t][0].view(np.uint8), ref[t][1].view(np.uint8)) for t in range(2))


async def test_64_concurrent_pushes(prefill, decode):
    desc = kv.CacheDesc(4, (64, 32 * 1024), np.uint8)
    dst = (await decode.call("register", n=4, shape=[64, 32 * 1024], dtype="uint8"))["cache_id"]
    await linked(prefill, decode)
    src = local_cache(prefill, desc, seed=26)
    statuses = await asyncio.gather(*(
        prefill.push_kv_cache(src, kv.CacheIndex(2, dst, (i * 7) % 64), src_batch_index=i, timeout=10)
        for i in range(64)))
    assert statuses == [S.LLM_SUCCESS] * 64
    src_rows = row_digests(src.tensors)
    want = [[None] * 64 for _ in range(4)]
    for t in range(4):
        for i in range(64):
            want[t][(i * 7) % 64] = src_rows[t][i]
    assert (await decode.call("digest", cache_id=dst))["rows"] == want


@pytest.mark.parametrize("kind", ["alloc", "register"])
async def test_timeout_fenced_across_processes(prefill, decode, kind):
    big = kv.CacheDesc(2, (1, 128 << 20), np.uint8)
    dst = (await decode.call(kind, n=2, shape=[1, 128 << 20], dtype="uint8"))["cache_id"]
    await linked(prefill, decode)
    src = local_cache(prefill, big, seed=27)
    t = prefill.submit_push_kv_cache(src, kv.CacheIndex(2, dst, 0), timeout=0.002)
    assert await t == S.LLM_TIMEOUT
    assert prefill.stats()["native"]["jobs_live"] == 0
    before = (await decode.call("digest", cache_id=dst))["rows"]
    # the link is still usable, and the timed-out transfer never writes again
    small = kv.CacheDesc(1, (1, 4096), np.uint8)
    sdst = (await decode.call("alloc", n=1, shape=[1, 4096], dtype="uint8"))["cache_id"]
    await prefill.wait_remote_cache(2, sdst)
    await prefill.push_kv_cache(local_cache(prefill, small, seed=28), kv.CacheIndex(2, sdst, 0))
    assert (await decode.call("digest", cache_id=dst))["rows"] == before
    assert await prefill.push_kv_cache(src, kv.CacheIndex(2, dst, 0), timeout=30) == S.LLM_SUCCESS
    assert (await decode.call("digest", cache_id=dst))["rows"] == row_digests(src.tensors)


@pytest.mark.parametrize("kind", ["alloc", "register"])
async def test_peer_killed_mid_transfer_then_new_peer(prefill, decode, kind):
    big = kv.CacheDesc(4, (1, 32 << 20), np.uint8)          # 128 MiB per push
    dst = (await decode.call(kind, n=4, shape=[1, 32 << 20], dtype="uint8"))["cache_id"]
    await linked(prefill, decode)
    src = local_cache(prefill, big, seed=29)
    # ~40 x 10 ms of queued work: the engine sees the peer's death long before it is done
    transfers = [prefill.submit_push_kv_cache(src, kv.CacheIndex(2, dst, 0), timeout=30) for _ in range(40)]
    decode.kill()
    statuses = await asyncio.wait_for(asyncio.gather(*transfers), 30)   # no hang
    assert set(statuses) <= {S.LLM_SUCCESS, S.LLM_LINK_FAILED}
    assert S.LLM_LINK_FAILED in statuses
    assert prefill.stats()["native"]["jobs_live"] == 0
    assert 2 not in prefill.stats()["links"]
    with pytest.raises(kv.LLMNotYetLinkError):
        await prefill.push_kv_cache(src, kv.CacheIndex(2, dst, 0))
    # a new decode process with the same cluster id links and works
    fresh = await PeerProcess.start(cluster_id=2, secret=SECRET, transport=prefill.options.transport)
    try:
        small = kv.CacheDesc(1, (2, 4096), np.uint8)
        new_dst = (await fresh.call(kind, n=1, shape=[2, 4096], dtype="uint8"))["cache_id"]
        await linked(prefill, fresh)
        s = local_cache(prefill, small, seed=30)
        await prefill.push_kv_cache(s, kv.CacheIndex(2, new_dst, 1))
        rows = (await fresh.call("digest", cache_id=new_dst))["rows"]
        assert rows[0][1] == row_digests(s.tensors)[0][0]
    finally:
        await fresh.close()
