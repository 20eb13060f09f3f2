"""Request keys (kv.CacheKey): binding rules, push and pull by key in one process
and across processes (shm, tcp), keys vanishing with their link, and "ask once":
a transfer to a cache or key the peer has not announced yet asks it before it
fails, so a just-registered cache never fails a transfer."""

import asyncio

import numpy as np
import pytest

import kvengine as kv
from kvengine import LLMStatusCode as S
from kvengine._peer import PeerProcess, row_digests
from conftest import filled, link

F16 = np.float16
SECRET = b"keys-test-secret"
DESC = kv.CacheDesc(4, (4, 256), F16)


def same(a, b):
    return np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


async def until(pred, timeout=5.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.005)


# ------------------------------------------------------------------- the type


def test_cache_key_validity():
    k = kv.CacheKey(1, 7)
    assert (k.cluster_id, k.req_id, k.model_id) == (1, 7, 0)
    assert k == kv.CacheKey(1, 7, 0) and hash(k) == hash(kv.CacheKey(1, 7, 0))
    assert kv.CacheKey(np.uint64(2**64 - 1), np.int32(3), 2**64 - 1).cluster_id == 2**64 - 1
    assert type(kv.CacheKey(np.uint64(5), 1).cluster_id) is int
    assert kv.CacheKey(1, 2**64 - 1).is_padding and not k.is_padding
    for bad in [(-1, 0), (2**64, 0), (1, -1), (1, 2**64), (1, 0, -1), (1, 0, 2**64), (True, 0), (1, 1.0),
                ("1", 0), (1, None), (1, 0, False)]:
        with pytest.raises(kv.LLMParamInvalidError, match="uint64"):
            kv.CacheKey(*bad)
    with pytest.raises(AttributeError):
        k.req_id = 3   # frozen
    assert "CacheKey" in kv.__all__


# --------------------------------------------------------------- binding rules


async def test_binding_rules(pair):
    p, _ = pair
    cache = p.allocate_cache(DESC, cache_keys=[kv.CacheKey(1, 10), kv.CacheKey(1, 2**64 - 1), kv.CacheKey(1, 12)])
    assert p.stats()["cache_keys"] == 2      # the padding key binds nothing
    n = p.stats()["caches"]
    for keys, err, words in [
        ([kv.CacheKey(1, i) for i in range(20, 25)], kv.LLMParamInvalidError, "5 cache_keys for 4"),
        ([kv.CacheKey(2, 20)], kv.LLMParamInvalidError, "this engine's cluster 1"),
        ([kv.CacheKey(1, 20), kv.CacheKey(1, 20)], kv.LLMParamInvalidError, "twice"),
        ([(1, 20)], kv.LLMParamInvalidError, "must be a kvengine.CacheKey"),
        (kv.CacheKey(1, 20), kv.LLMParamInvalidError, "list or tuple"),
        ([kv.CacheKey(1, 21), kv.CacheKey(1, 10)], kv.LLMCacheKeyAlreadyExistError, "already bound"),
    ]:
        with pytest.raises(err, match=words):
            p.allocate_cache(DESC, cache_keys=keys)
        with pytest.raises(err, match=words):
            p.register_kv_cache(DESC, [np.zeros((4, 256), F16) for _ in range(4)], cache_keys=keys)
        with pytest.raises(err, match=words):
            await p.allocate_cache_async(DESC, cache_keys=keys)
    assert p.stats()["caches"] == n, "a refused key list registered a cache"
    assert p.stats()["cache_keys"] == 2
    # bind later, rebind, remove
    p.bind_cache_key(cache, kv.CacheKey(1, 13), 3)
    with pytest.raises(kv.LLMCacheKeyAlreadyExistError):
        p.bind_cache_key(cache, kv.CacheKey(1, 13), 2)
    with pytest.raises(kv.LLMParamInvalidError, match="batch_index"):
        p.bind_cache_key(cache, kv.CacheKey(1, 14), 4)
    with pytest.raises(kv.LLMParamInvalidError, match="padding"):
        p.bind_cache_key(cache, kv.CacheKey(1, 2**64 - 1), 0)
    with pytest.raises(kv.LLMParamInvalidError, match="cluster 1"):
        p.bind_cache_key(cache, kv.CacheKey(7, 14), 0)
    p.remove_cache_key(kv.CacheKey(1, 13))
    p.remove_cache_key(kv.CacheKey(1, 13))          # unknown: a no-op
    p.remove_cache_key(kv.CacheKey(99, 1))
    with pytest.raises(kv.LLMParamInvalidError):
        p.remove_cache_key((1, 13))
    p.bind_cache_key(cache, kv.CacheKey(1, 13), 2)
    # unregistering unbinds
    await p.unregister_kv_cache(cache.cache_id)
    assert p.stats()["cache_keys"] == 0
    with pytest.raises(kv.LLMKvCacheNotExistError):
        p.bind_cache_key(cache, kv.CacheKey(1, 30), 0)
    other = p.allocate_cache(DESC, cache_keys=[kv.CacheKey(1, 10)])
    p.bind_cache_key(other, kv.CacheKey(1, 13), 1)
    assert p.stats()["cache_keys"] == 2


# ---------------------------------------------------------- push and pull by key


@pytest.mark.parametrize("when", ["before_link", "after_link"])
async def test_pull_and_push_by_key(pair, when):
    p, d = pair
    if when == "after_link":
        await link(d, p)
    src = filled(p.allocate_cache(DESC, cache_keys=[kv.CacheKey(1, 100 + r, 5) for r in range(4)]), seed=3)
    dst = d.allocate_cache(DESC)
    d.bind_cache_key(dst, kv.CacheKey(2, 900), 2)
    if when == "before_link":
        await link(d, p)
    for r in range(4):
        assert await d.pull_kv_cache(kv.CacheKey(1, 100 + r, 5), dst, batch_index=3 - r) == S.LLM_SUCCESS
        for t in range(4):
            assert same(dst.tensors[t][3 - r], src.tensors[t][r])
    # push into the row the decode side bound to its own key
    for t in dst.tensors:
        t[...] = 0
    assert await p.push_kv_cache(src, kv.CacheKey(2, 900), src_batch_index=1) == S.LLM_SUCCESS
    for t in range(4):
        assert same(dst.tensors[t][2], src.tensors[t][1])
        assert not dst.tensors[t][[0, 1, 3]].any()
    # the submit twin and a layer stream take keys too
    assert await p.submit_push_kv_cache(src, kv.CacheKey(2, 900), 0) == S.LLM_SUCCESS
    stream = p.layer_stream(src, [kv.CacheKey(2, 900)], src_batch_index=3)
    for layer in range(stream.num_layers):
        stream.layer_ready(layer)
    assert await stream.wait() == [S.LLM_SUCCESS]
    for t in range(4):
        assert same(dst.tensors[t][2], src.tensors[t][3])
    assert p.stats()["links"][2]["remote_keys"] == 1
    assert d.stats()["links"][1]["remote_keys"] == 4


async def test_unknown_keys_and_names(pair):
    p, d = pair
    dst = d.allocate_cache(DESC)
    with pytest.raises(kv.LLMNotYetLinkError):
        await d.pull_kv_cache(kv.CacheKey(1, 5), dst)
    await link(d, p)
    p.allocate_cache(DESC, cache_keys=[kv.CacheKey(1, 5)])
    with pytest.raises(kv.LLMKvCacheNotExistError, match=r"CacheKey\(cluster_id=1, req_id=6, model_id=0\)"):
        await d.pull_kv_cache(kv.CacheKey(1, 6), dst)
    with pytest.raises(kv.LLMKvCacheNotExistError, match="no cache 77"):
        await d.pull_kv_cache(kv.CacheIndex(1, 77, 0), dst)
    with pytest.raises(kv.LLMKvCacheNotExistError, match="no cache 'x'"):
        await d.pull_kv_cache(kv.CacheIndex(1, "x", 0), dst)
    src = p.allocate_cache(DESC)        # a numpy int names a cache too, known or asked for
    assert await d.pull_kv_cache(kv.CacheIndex(1, np.int64(src.cache_id), 0), dst) == S.LLM_SUCCESS
    with pytest.raises(kv.LLMParamInvalidError, match="padding"):
        await d.pull_kv_cache(kv.CacheKey(1, 2**64 - 1), dst)
    with pytest.raises(kv.LLMParamInvalidError, match="is this engine"):
        await d.pull_kv_cache(kv.CacheKey(2, 5), dst)
    with pytest.raises(kv.LLMParamInvalidError, match="CacheIndex or CacheKey"):
        await d.pull_kv_cache((1, 5), dst)
    with pytest.raises(kv.LLMParamInvalidError, match="BlocksCacheKey"):
        await d.pull_kv_blocks(kv.CacheKey(1, 5), dst, [0], [0])
    assert await d.pull_kv_cache(kv.CacheKey(1, 5), dst) == S.LLM_SUCCESS
    # removed: the peer forgets it (key_del); then a pull asks, hears "no", fails
    p.remove_cache_key(kv.CacheKey(1, 5))
    await until(lambda: d.stats()["links"][1]["remote_keys"] == 0)
    with pytest.raises(kv.LLMKvCacheNotExistError, match="asked it"):
        await d.pull_kv_cache(kv.CacheKey(1, 5), dst)
    assert d.stats()["by_status"].get("LLM_KV_CACHE_NOT_EXIST", 0) >= 3


async def test_rebinding_and_unregistering_reach_the_peer(pair):
    p, d = pair
    await link(d, p)
    a = filled(p.allocate_cache(DESC, cache_keys=[kv.CacheKey(1, 1)]), seed=4)
    b = filled(p.allocate_cache(DESC), seed=5)
    dst = d.allocate_cache(DESC)
    assert await d.pull_kv_cache(kv.CacheKey(1, 1), dst) == S.LLM_SUCCESS
    assert same(dst.tensors[0][0], a.tensors[0][0])
    p.remove_cache_key(kv.CacheKey(1, 1))
    p.bind_cache_key(b, kv.CacheKey(1, 1), 2)
    # a barrier: the table's messages keep their order, and the answer to a question
    # follows them (a pull by a key bound after the rebind asks, or finds it)
    p.bind_cache_key(b, kv.CacheKey(1, 99), 3)
    assert await d.pull_kv_cache(kv.CacheKey(1, 99), dst) == S.LLM_SUCCESS
    assert await d.pull_kv_cache(kv.CacheKey(1, 1), dst) == S.LLM_SUCCESS
    assert same(dst.tensors[0][0], b.tensors[0][2])
    await p.unregister_kv_cache(b.cache_id)   # done once the peer confirmed the cache_del
    assert d.stats()["links"][1]["remote_keys"] == 0
    with pytest.raises(kv.LLMKvCacheNotExistError):
        await d.pull_kv_cache(kv.CacheKey(1, 1), dst)


async def test_keys_vanish_with_the_link_and_return_with_the_next(pair):
    p, d = pair
    await link(d, p)
    p.allocate_cache(DESC, cache_keys=[kv.CacheKey(1, r) for r in range(4)])
    dst = d.allocate_cache(DESC)
    assert await d.pull_kv_cache(kv.CacheKey(1, 3), dst) == S.LLM_SUCCESS
    assert d.stats()["links"][1]["remote_keys"] == 4
    st, _ = await d.unlink_clusters([kv.ClusterInfo(1, p.address)])
    assert st == S.LLM_SUCCESS
    with pytest.raises(kv.LLMNotYetLinkError):
        await d.pull_kv_cache(kv.CacheKey(1, 3), dst)
    await link(d, p)
    assert d.stats()["links"][1]["remote_keys"] == 4   # part of the table exchanged at link time
    assert await d.pull_kv_cache(kv.CacheKey(1, 3), dst) == S.LLM_SUCCESS


# -------------------------------------------------------------------- ask once


async def test_a_just_registered_cache_never_fails_a_transfer(pair):
    """Register on one engine and transfer from the other at once, before the
    announcement can have arrived: the transfer asks, and succeeds."""
    p, d = pair
    await link(d, p)
    src = filled(p.allocate_cache(DESC), seed=6)
    for i in range(40):
        dst = d.allocate_cache(DESC, cache_keys=[kv.CacheKey(2, 1000 + i)])
        dst2 = d.register_kv_cache(DESC, [np.zeros((4, 256), F16) for _ in range(4)])
        ts = [p.submit_push_kv_cache(src, kv.CacheKey(2, 1000 + i), i % 4),
              p.submit_push_kv_cache(src, kv.CacheIndex(2, dst2.cache_id, 1), 2),
              p.submit_push_kv_cache(src, kv.CacheIndex(2, dst2.cache_id, 3), 3)]   # shares the question
        assert [await t for t in ts] == [S.LLM_SUCCESS] * 3, [t.message() for t in ts]
        for t in range(4):
            assert same(dst.tensors[t][0], src.tensors[t][i % 4])
            assert same(dst2.tensors[t][1], src.tensors[t][2])
            assert same(dst2.tensors[t][3], src.tensors[t][3])
        # and a pull by the key of a cache the pulling side just learnt nothing about
        back = p.allocate_cache(DESC)
        assert await p.pull_kv_cache(kv.CacheKey(2, 1000 + i), back, 1) == S.LLM_SUCCESS
        assert same(back.tensors[1][1], src.tensors[1][i % 4])
        d.unregister_kv_cache(dst.cache_id)
        d.unregister_kv_cache(dst2.cache_id)
        p.unregister_kv_cache(back.cache_id)


async def test_asking_is_cancellable_and_the_fast_path_asks_nothing(pair):
    p, d = pair
    await link(d, p)
    src = p.allocate_cache(DESC)
    dst = d.allocate_cache(DESC)
    t = p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0))
    assert t.cancel()
    assert await t == S.LLM_CANCELLED
    await p.wait_remote_cache(2, dst.cache_id)
    n = p.stats()["transfers"]
    t = p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0))
    assert type(t) is kv.Transfer          # known: no question, the plain handle
    assert await t == S.LLM_SUCCESS
    assert p.stats()["transfers"] == n + 1


# ------------------------------------------------------------ across processes


@pytest.fixture(params=["shm", "tcp"])
async def xpair(request):
    e = await kv.KvEngine(1, kv.Role.DECODER, "127.0.0.1:0",
                          kv.EngineOptions(secret=SECRET, transport=request.param)).start()
    peer = await PeerProcess.start(cluster_id=2, secret=SECRET, transport=request.param)
    try:
        yield e, peer
    finally:
        await peer.close()
        await e.close()
        assert e.stats()["native"]["jobs_live"] == 0


@pytest.mark.parametrize("kind", ["alloc", "register"])
async def test_pull_by_key_across_processes(xpair, kind):
    """The other process (cluster 2) registers rows under keys; this one pulls by key."""
    e, peer = xpair
    desc = kv.CacheDesc(4, (3, 64, 32), F16)
    remote = (await peer.call(kind, n=4, shape=[3, 64, 32], fill=31,
                              keys=[[2, 500 + r, 1] for r in range(3)]))["cache_id"]
    st, per = await e.link_clusters([kv.ClusterInfo(2, peer.address)])
    assert st == S.LLM_SUCCESS, per
    dst = e.allocate_cache(desc)
    for r in range(3):
        assert await e.pull_kv_cache(kv.CacheKey(2, 500 + r, 1), dst, batch_index=2 - r) == S.LLM_SUCCESS
    theirs = (await peer.call("digest", cache_id=remote))["rows"]
    mine = row_digests(dst.tensors)
    for t in range(4):
        assert mine[t] == theirs[t][::-1]
    # bound after linking, pulled at once (asked for); removed: gone
    await peer.call("bind_key", cache_id=remote, key=[2, 600, 0], row=1)
    assert await e.pull_kv_cache(kv.CacheKey(2, 600), dst, batch_index=0) == S.LLM_SUCCESS
    assert row_digests(dst.tensors)[3][0] == theirs[3][1]
    await peer.call("remove_key", key=[2, 600, 0])
    await until(lambda: e.stats()["links"][2]["remote_keys"] == 3)   # the key_del is on its way
    with pytest.raises(kv.LLMKvCacheNotExistError):
        await e.pull_kv_cache(kv.CacheKey(2, 600), dst)


async def test_push_to_a_cache_registered_at_once_across_processes(xpair):
    e, peer = xpair
    st, _ = await e.link_clusters([kv.ClusterInfo(2, peer.address)])
    assert st == S.LLM_SUCCESS
    src = filled(e.allocate_cache(DESC), seed=32)
    want = row_digests(src.tensors)
    for i in range(25):
        kind = "alloc" if i % 2 else "register"
        cid = (await peer.call(kind, n=4, shape=[4, 256], keys=[[2, 7000 + i, 0]]))["cache_id"]
        ts = [e.submit_push_kv_cache(src, kv.CacheIndex(2, cid, 3), 1),
              e.submit_push_kv_cache(src, kv.CacheKey(2, 7000 + i), 2)]
        assert [await t for t in ts] == [S.LLM_SUCCESS] * 2, [t.message() for t in ts]
        rows = (await peer.call("digest", cache_id=cid))["rows"]
        for t in range(4):
            assert rows[t][3] == want[t][1] and rows[t][0] == want[t][2]
        await peer.call("unregister", cache_id=cid)


async def test_keys_of_a_dead_peer_vanish(xpair):
    e, peer = xpair
    await peer.call("alloc", n=4, shape=[4, 256], keys=[[2, 1, 0], [2, 2, 0]])
    st, _ = await e.link_clusters([kv.ClusterInfo(2, peer.address)])
    assert st == S.LLM_SUCCESS
    assert e.stats()["links"][2]["remote_keys"] == 2
    dst = e.allocate_cache(DESC)
    assert await e.pull_kv_cache(kv.CacheKey(2, 2), dst) == S.LLM_SUCCESS
    peer.kill()
    await until(lambda: 2 not in e.stats()["links"], timeout=10)
    with pytest.raises(kv.LLMNotYetLinkError):
        await e.pull_kv_cache(kv.CacheKey(2, 2), dst)


# ---------------------------------------------------------------- hostile peers

import hostile as H   # noqa: E402
from kvengine import tables   # noqa: E402

HOSTILE_CACHE = {"t": "cache_add", "id": 1, "desc": {"n": 1, "shape": [4, 64], "dtype": 4, "placement": 0},
                 "kind": "tcp", "regions": [[1, 256]], "placement": [[0, 0]]}


@pytest.fixture
async def victim():
    d = await kv.KvEngine(2, kv.Role.DECODER, "127.0.0.1:0", kv.EngineOptions(secret=SECRET)).start()
    try:
        yield d
    finally:
        H.close_all()
        await d.close()
        await asyncio.sleep(0)


async def hostile_link(d, table=()):
    s = await H.handshake(d.address, 9, SECRET, transport="tcp")
    await s.link(table=[HOSTILE_CACHE, *table])
    s.keepalive()
    return s


def key_add(key, cache=1, row=0):
    return {"t": "key_add", "key": key, "cache": cache, "row": row}


GOOD_KEY = [9, 1, 0]
BAD = [
    key_add([5, 1, 0]), key_add("9,1,0"), key_add([9, 1]), key_add([9, 1, 0, 0]), key_add([9, -1, 0]),
    key_add([9, 2**64, 0]), key_add([9, True, 0]), key_add([9, 1.0, 0]), key_add([9, 2**64 - 1, 0]),
    key_add(GOOD_KEY, cache=2), key_add(GOOD_KEY, cache="1"), key_add(GOOD_KEY, cache=[1]),
    key_add(GOOD_KEY, row=4), key_add(GOOD_KEY, row=-1), key_add(GOOD_KEY, row=True), key_add(GOOD_KEY, row=None),
    {"t": "key_del", "key": [9, "x", 0]}, {"t": "key_del"},
    {"t": "cache_query", "req": "a", "id": 1}, {"t": "cache_query", "req": 1},
    {"t": "cache_query", "req": 1, "id": -1}, {"t": "cache_query", "req": 1, "key": [9, 1]},
    {"t": "cache_query", "req": [1], "id": 1},
]


@pytest.mark.parametrize("bad", BAD, ids=range(len(BAD)))
async def test_a_malformed_key_or_question_fails_the_link(victim, bad, caplog):
    caplog.set_level("WARNING", logger="kvengine")
    s = await hostile_link(victim)
    assert 9 in victim.stats()["links"]
    await s.send(bad)
    await until(lambda: 9 not in victim.stats()["links"])
    assert "protocol error" in caplog.text


async def test_a_repeated_key_fails_the_link_and_one_in_the_table_too(victim, caplog):
    caplog.set_level("WARNING", logger="kvengine")
    s = await hostile_link(victim, [key_add(GOOD_KEY)])
    assert victim.stats()["links"][9]["remote_keys"] == 1
    await s.send({"t": "key_del", "key": [9, 77, 0]})     # unknown: a no-op
    await s.send(key_add(GOOD_KEY))
    await until(lambda: 9 not in victim.stats()["links"])
    assert "announced twice" in caplog.text
    with pytest.raises(H.HandshakeRefused):
        await hostile_link(victim, [key_add([9, 1, 0], row=9)])
    assert victim.stats()["links"] == {}


async def test_the_keys_a_peer_announces_are_bounded(victim, caplog, monkeypatch):
    caplog.set_level("WARNING", logger="kvengine")
    monkeypatch.setattr(tables, "MAX_REMOTE_KEYS", 8)
    s = await hostile_link(victim)
    for r in range(8):
        await s.send(key_add([9, r, 0], row=r % 4))
    await s.send({"t": "key_del", "key": [9, 0, 0]})
    await s.send(key_add([9, 100, 0]))                     # 8 again: fine
    await until(lambda: victim.stats()["links"][9]["remote_keys"] == 8)
    await s.send(key_add([9, 101, 0]))
    await until(lambda: 9 not in victim.stats()["links"])
    assert "more than 8 keys" in caplog.text


async def test_questions_are_answered_after_the_announcement(victim):
    s = await hostile_link(victim)
    cache = victim.allocate_cache(kv.CacheDesc(1, (4, 64), np.uint8), cache_keys=[kv.CacheKey(2, 42)])
    await s.send({"t": "cache_query", "req": 5, "key": [2, 42, 0]})
    await s.send({"t": "cache_query", "req": 6, "id": 999})
    seen = []
    while len([m for m in seen if m["t"] == "ok"]) < 2:
        seen.append(await s.recv())
    kinds = [(m["t"], m.get("id", m.get("req"))) for m in seen]
    # the cache and its key (announced now, or already) come before the answer
    assert kinds.index(("cache_add", cache.cache_id)) < kinds.index(("ok", 5))
    assert [m for m in seen if m["t"] == "key_add"] == [
        {"t": "key_add", "key": [2, 42, 0], "cache": cache.cache_id, "row": 0}]
    answers = {m["req"]: m["found"] for m in seen if m["t"] == "ok"}
    assert answers == {5: True, 6: False}


async def test_a_peer_that_does_not_answer_costs_the_transfer_its_timeout_only(victim):
    s = await hostile_link(victim)
    src = victim.allocate_cache(kv.CacheDesc(1, (4, 64), np.uint8))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    t = victim.submit_push_kv_cache(src, kv.CacheIndex(9, 5, 0), timeout=0.3)
    assert await t == S.LLM_TIMEOUT
    assert 0.25 < loop.time() - t0 < 2.0
    assert "did not say whether it has cache 5" in t.message()
    q = None
    while q is None or q["t"] != "cache_query":
        q = await s.recv()
    assert q == {"t": "cache_query", "id": 5, "req": q["req"]}
    # an answer "found" that announced nothing: the transfer fails, the link stays
    t = victim.submit_push_kv_cache(src, kv.CacheKey(9, 3), timeout=2)
    while q["t"] != "cache_query" or "key" not in q:
        q = await s.recv()
    await s.send({"t": "ok", "req": q["req"], "found": True})
    assert await t == S.LLM_KV_CACHE_NOT_EXIST
    assert 9 in victim.stats()["links"]
