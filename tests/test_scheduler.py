"""The scheduler, layer streams, notifications and stats, through the public API."""

import asyncio
import signal

import numpy as np
import pytest

import kvengine as kv
from kvengine import LLMStatusCode as S
from conftest import filled, link, make_pair, snapshot
from kvengine._peer import PeerProcess
from kvengine.bench.netbed import remote_view


@pytest.fixture(params=["shm", "tcp"])
def sched_transport(request):
    return request.param


@pytest.fixture
async def spair(sched_transport):
    p, d = await make_pair(sched_transport)
    try:
        await link(p, d)
        yield p, d
    finally:
        await p.close()
        await d.close()


async def caches(p, d, desc, seed=1):
    src = filled(p.allocate_cache(desc), seed)
    dst = d.allocate_cache(desc)
    await p.wait_remote_cache(2, dst.cache_id)
    return src, dst


async def test_urgent_small_push_overtakes_a_running_large_one(spair):
    p, d = spair
    big_src, big_dst = await caches(p, d, kv.CacheDesc(2, (1, 128 << 20), np.uint8))   # 256 MiB
    small_src, small_dst = await caches(p, d, kv.CacheDesc(2, (1, 32 << 10), np.uint8))  # 64 KiB
    big = p.submit_push_kv_cache(big_src, kv.CacheIndex(2, big_dst.cache_id, 0), timeout=30)
    assert not big.done()   # 256 MiB: under way (its first pieces may already have landed)
    small = p.submit_push_kv_cache(small_src, kv.CacheIndex(2, small_dst.cache_id, 0), timeout=10)
    order = []   # the order the core finished them in (callbacks run as each finishes)
    big.add_done_callback(lambda st: order.append("big"))
    small.add_done_callback(lambda st: order.append("small"))
    assert await small == S.LLM_SUCCESS
    assert order[0] == "small", f"the small push waited for the large one: {order}"
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(small_src.tensors, small_dst.tensors))
    assert await big == S.LLM_SUCCESS
    assert all(np.array_equal(a, b) for a, b in zip(big_src.tensors, big_dst.tensors))


async def test_queued_transfers_past_their_deadline_never_start(sched_transport):
    """Behind a 256 MiB push handed over in 64 KiB pieces (the scheduler's own queue, one
    piece at a time), lower-priority pushes wait; their 5 ms deadline passes long before
    the 4096 pieces (each a loop wake-up) are through, so none of them starts."""
    p, d = await make_pair(sched_transport, max_inflight_bytes=64 << 10, piece_bytes=64 << 10)
    try:
        await link(p, d)
        big_src, big_dst = await caches(p, d, kv.CacheDesc(2, (1, 128 << 20), np.uint8))
        row = 2 * p.options.inline_threshold   # above the inline threshold: these queue
        src, dst = await caches(p, d, kv.CacheDesc(1, (64, row), np.uint8))
        big = p.submit_push_kv_cache(big_src, kv.CacheIndex(2, big_dst.cache_id, 0), timeout=30, priority=10)
        # lower priority, each above the inline threshold: they queue behind the big push
        waiting = [p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, r), r, timeout=0.005)
                   for r in range(64)]
        statuses = await asyncio.gather(*waiting)
        assert not big.done(), "the big push was through before the deadlines: the test proves nothing"
        assert statuses == [S.LLM_TIMEOUT] * 64
        assert all("had not started" in t.message() for t in waiting)
        assert all(t.nbytes == 0 for t in waiting)
        assert await big == S.LLM_SUCCESS
        assert not dst.tensors[0].any(), "a transfer that timed out in the queue touched the destination"
    finally:
        await p.close()
        await d.close()


async def test_transfers_queued_in_the_core_past_their_deadline_never_start():
    """The default: every transfer is handed to the core at once and waits there in rank
    order. Behind a 128 MiB push into a stopped tcp peer (its window full, no CREDIT
    comes), lower-priority pushes never start: they resolve LLM_TIMEOUT with no byte
    sent, the big push finishes once the peer resumes, and the peer's rows for the
    timed-out pushes hold what they held."""
    hb = {"heartbeat_interval": 1.0, "heartbeat_timeout": 60.0}   # the stop is not a lost peer
    p = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", kv.EngineOptions(transport="tcp", **hb)).start()
    peer = await PeerProcess.start(cluster_id=2, transport="tcp", options=hb)
    try:
        st, per = await p.link_clusters([kv.ClusterInfo(2, peer.address)])
        assert st == S.LLM_SUCCESS, per
        row = 2 * p.options.inline_threshold
        big_dst = (await peer.call("alloc", n=1, shape=[1, 128 << 20], dtype="uint8"))["cache_id"]
        dst = (await peer.call("alloc", n=1, shape=[64, row], dtype="uint8", fill=7))["cache_id"]
        for c in (big_dst, dst):
            await p.wait_remote_cache(2, c, timeout=5)
        read = await remote_view(peer, dst)
        before = read()
        big_src = filled(p.allocate_cache(kv.CacheDesc(1, (1, 128 << 20), np.uint8)), 1)
        src = filled(p.allocate_cache(kv.CacheDesc(1, (64, row), np.uint8)), 2)
        peer.signal(signal.SIGSTOP)
        try:
            big = p.submit_push_kv_cache(big_src, kv.CacheIndex(2, big_dst), timeout=60, priority=10)
            waiting = [p.submit_push_kv_cache(src, kv.CacheIndex(2, dst, r), r, timeout=0.005)
                       for r in range(64)]
            statuses = await asyncio.gather(*waiting)
            assert not big.done()
        finally:
            peer.signal(signal.SIGCONT)
        assert statuses == [S.LLM_TIMEOUT] * 64
        assert all("had not started" in t.message() and t.nbytes == 0 for t in waiting)
        assert await big == S.LLM_SUCCESS
        assert all(np.array_equal(a, b) for a, b in zip(read(), before)), \
            "a transfer that timed out in the core's queue touched the destination"
    finally:
        await p.close()
        await peer.close()


async def test_finished_transfers_leave_the_deadline_heap(spair):
    """Deadlines share the scheduler's one timer (a heap of them): a transfer that finished
    leaves the heap, in any order of deadlines, so it holds the live transfers only."""
    p, d = spair
    row = 2 * p.options.inline_threshold   # above the inline threshold: these queue
    src, dst = await caches(p, d, kv.CacheDesc(1, (64, row), np.uint8))
    heap = p._p.scheduler._deadlines
    for r in range(100):   # one at a time: each is the head, and leaves as it finishes
        t = p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, r % 64), r % 64, timeout=60)
        assert len(heap) == 1
        assert await t == S.LLM_SUCCESS
        assert len(heap) == 0
    # at once, each deadline earlier than the one before (the timer re-armed every time)
    ts = [p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, r), r, timeout=60 - r / 10)
          for r in range(64)]
    assert len(heap) == 64
    assert await asyncio.gather(*ts) == [S.LLM_SUCCESS] * 64
    assert len(heap) == 0


async def test_priority_orders_the_queue(sched_transport):
    p, d = await make_pair(sched_transport, max_inflight_bytes=1 << 20, piece_bytes=1 << 20,
                           inline_threshold=0)
    try:
        await link(p, d)
        src, dst = await caches(p, d, kv.CacheDesc(1, (16, 1 << 20), np.uint8))
        order = []
        ts = []
        for r in range(16):
            t = p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, r), r, timeout=30,
                                       priority=r % 4)
            t.add_done_callback(lambda st, r=r: order.append(r))
            ts.append(t)
        await asyncio.gather(*ts)
        # the first went straight to the core; after it, higher priority first, FIFO within a class
        rest = order[1:]
        prios = [r % 4 for r in rest]
        assert prios == sorted(prios, reverse=True), order
        assert all(np.array_equal(src.tensors[0][r], dst.tensors[0][r]) for r in range(16))
    finally:
        await p.close()
        await d.close()


async def test_native_queue_moves_by_priority_then_deadline(sched_transport):
    """Default options: whole transfers go to the core at once, and the movers (shm) or the
    link's I/O thread (tcp) take the most urgent first (priority, then deadline), and a
    more urgent transfer overtakes a running one at the next chunk. A 128 MiB blocker runs
    while the others are submitted (a few hundred microseconds), so their order is the
    native queue's alone. One mover (one stream): with two, a mover preempted while it
    copies a job's last chunk lets the other finish the next job first."""
    p, d = await make_pair(sched_transport, tcp_streams=1, movers=1)
    try:
        await link(p, d)
        block_src, block_dst = await caches(p, d, kv.CacheDesc(1, (1, 128 << 20), np.uint8))
        big_src, big_dst = await caches(p, d, kv.CacheDesc(1, (1, 32 << 20), np.uint8), seed=2)
        src, dst = await caches(p, d, kv.CacheDesc(1, (9, 8 << 20), np.uint8), seed=3)
        order = []

        def push(tag, s, dc, row, prio, tmo):
            t = p.submit_push_kv_cache(s, kv.CacheIndex(2, dc.cache_id, row), row, timeout=tmo, priority=prio)
            t.add_done_callback(lambda st: order.append(tag))
            return t

        ts = [push("blocker", block_src, block_dst, 0, 100, 60)]
        assert not ts[0].done()
        ts.append(push("big", big_src, big_dst, 0, -1, 60))
        plan = [(0, 30), (2, 20), (1, 10), (2, 10), (0, 5), (1, 30), (3, 40), (0, 20)]   # (priority, timeout)
        ts += [push(r, src, dst, r, prio, tmo) for r, (prio, tmo) in enumerate(plan)]
        ts.append(push("urgent", src, dst, 8, 200, 60))
        assert await asyncio.gather(*ts) == [S.LLM_SUCCESS] * len(ts)
        rows = sorted(range(8), key=lambda r: (-plan[r][0], plan[r][1]))
        assert order == ["urgent", "blocker"] + rows + ["big"], order
        assert np.array_equal(src.tensors[0], dst.tensors[0])
        assert np.array_equal(big_src.tensors[0], big_dst.tensors[0])
        assert np.array_equal(block_src.tensors[0], block_dst.tensors[0])
    finally:
        await p.close()
        await d.close()


@pytest.mark.parametrize("window", [64 << 10, 0], ids=["64KiB", "unlimited"])
async def test_tcp_window_moves_every_byte(window):
    """The receiver CREDITs each data frame; with a window of 4 frames a push pauses every
    4 frames until the credits come back. Pushes, a pull and small pushes at once, byte-exact."""
    p, d = await make_pair("tcp", tcp_window_bytes=window, chunk_bytes=16 << 10)
    try:
        await link(p, d)
        desc = kv.CacheDesc(2, (1, 4 << 20), np.uint8)   # 8 MiB: 512 frames
        src, dst = await caches(p, d, desc)
        small_src, small_dst = await caches(p, d, kv.CacheDesc(1, (16, 4096), np.uint8), seed=3)
        remote = filled(d.allocate_cache(desc), 7)   # pulled while the pushes run
        await p.wait_remote_cache(2, remote.cache_id)
        back = p.allocate_cache(desc)
        ts = [p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), timeout=30)]
        ts += [p.submit_push_kv_cache(small_src, kv.CacheIndex(2, small_dst.cache_id, r), r, timeout=30)
               for r in range(16)]
        ts.append(p.submit_pull_kv_cache(kv.CacheIndex(2, remote.cache_id, 0), back, timeout=30))
        assert await asyncio.gather(*ts) == [S.LLM_SUCCESS] * len(ts)
        assert all(np.array_equal(a, b) for a, b in zip(src.tensors, dst.tensors))
        assert np.array_equal(small_src.tensors[0], small_dst.tensors[0])
        assert all(np.array_equal(a, b) for a, b in zip(remote.tensors, back.tensors))
    finally:
        await p.close()
        await d.close()


async def test_fifo_scheduling_option(sched_transport):
    p, d = await make_pair(sched_transport, scheduling="fifo", max_inflight_bytes=1 << 20,
                           piece_bytes=1 << 20, inline_threshold=0)
    try:
        await link(p, d)
        src, dst = await caches(p, d, kv.CacheDesc(1, (8, 1 << 20), np.uint8))
        order = []
        ts = []
        for r in range(8):   # later ones have earlier deadlines: FIFO ignores that
            t = p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, r), r, timeout=30 - r)
            t.add_done_callback(lambda st, r=r: order.append(r))
            ts.append(t)
        await asyncio.gather(*ts)
        assert order == list(range(8))
    finally:
        await p.close()
        await d.close()


async def test_queue_full_is_out_of_memory():
    p, d = await make_pair("tcp", max_queued=4)
    try:
        await link(p, d)
        src, dst = await caches(p, d, kv.CacheDesc(1, (8, 1 << 20), np.uint8))
        ts = [p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, r), r, timeout=30) for r in range(8)]
        full = [t for t in ts if t.done() and t.status == S.LLM_OUT_OF_MEMORY]
        assert len(full) == 4 and "max_queued" in full[0].message()
        assert [await t for t in ts[:4]] == [S.LLM_SUCCESS] * 4
    finally:
        await p.close()
        await d.close()


def current_rss_mib() -> float:
    """Resident set size now (VmRSS), not ru_maxrss: that is the lifetime peak, which an
    earlier test's 256 MiB caches already set, so growth under it would go unseen."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024   # kB
    raise AssertionError("no VmRSS in /proc/self/status")


async def test_10000_concurrent_pushes_on_4_links():
    opts = dict(transport="tcp")
    prefill = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", kv.EngineOptions(**opts)).start()
    decodes = [await kv.KvEngine(10 + i, kv.Role.DECODER, "127.0.0.1:0", kv.EngineOptions(**opts)).start()
               for i in range(4)]
    try:
        desc = kv.CacheDesc(2, (2500, 1024), np.uint8)   # 2500 rows of 2 x 1 KiB per link
        src = filled(prefill.allocate_cache(desc), seed=5)
        dsts = []
        for d in decodes:
            await link(prefill, d)
            dst = d.allocate_cache(desc)
            await prefill.wait_remote_cache(d.cluster_id, dst.cache_id)
            dsts.append(dst)
        rss0 = current_rss_mib()
        ts = [prefill.submit_push_kv_cache(src, kv.CacheIndex(d.cluster_id, dst.cache_id, r), r, timeout=60)
              for r in range(2500) for d, dst in zip(decodes, dsts)]
        assert len(ts) == 10_000
        assert prefill.stats()["queued"] <= 10_000
        statuses = await asyncio.gather(*ts)
        assert statuses == [S.LLM_SUCCESS] * 10_000
        for dst in dsts:
            assert all(np.array_equal(a, b) for a, b in zip(src.tensors, dst.tensors))
        grown_mib = current_rss_mib() - rss0
        assert grown_mib < 256, f"10,000 queued pushes grew the process by {grown_mib:.0f} MiB"
        st = prefill.stats()
        assert st["queued"] == 0 and st["in_flight"] == 0
        assert sum(st["peers"][f"{d.cluster_id}/tcp"]["transfers"] for d in decodes) == 10_000
    finally:
        await prefill.close()
        for d in decodes:
            await d.close()


async def test_layer_stream_delivers_each_layer_before_the_next_is_ready(spair):
    p, d = spair
    layers = 32
    desc = kv.CacheDesc(2 * layers, (2, 16 << 10), np.uint8)
    src = p.allocate_cache(desc)
    dst = d.allocate_cache(desc)
    await p.wait_remote_cache(2, dst.cache_id)
    stream = p.layer_stream(src, [kv.CacheIndex(2, dst.cache_id, 1)], src_batch_index=0, timeout=30,
                            notify=b"req-42")
    from kvengine._peer import fill_pattern
    for i in range(layers):
        for k in (2 * i, 2 * i + 1):          # "compute" layer i only now
            fill_pattern(src.tensors[k], 100 + i, k)
        stream.layer_ready(i)
        assert await stream.wait_layer(i) == [S.LLM_SUCCESS]
        for k in range(2 * layers):
            if k <= 2 * i + 1:
                assert np.array_equal(dst.tensors[k][1], src.tensors[k][0]), f"layer {k // 2} missing"
            else:
                assert not dst.tensors[k].any(), f"layer {k // 2} arrived before it was ready"
    assert await stream.wait() == [S.LLM_SUCCESS]
    note = await d.wait_notification(b"req-42", timeout=5)
    assert note.cluster_id == 1 and note.payload == b"req-42"
    with pytest.raises(kv.LLMParamInvalidError, match="already marked"):
        stream.layer_ready(3)
    with pytest.raises(kv.LLMParamInvalidError, match="out of range"):
        stream.layer_ready(layers)


async def test_layer_stream_from_a_thread_with_a_failing_destination(spair):
    p, d = spair
    layers = 8
    desc = kv.CacheDesc(2 * layers, (1, 8 << 10), np.uint8)
    src = filled(p.allocate_cache(desc), seed=9)
    good = d.allocate_cache(desc)
    bad = d.allocate_cache(desc)
    await p.wait_remote_cache(2, good.cache_id)
    await p.wait_remote_cache(2, bad.cache_id)
    stream = p.layer_stream(src, [kv.CacheIndex(2, good.cache_id, 0), kv.CacheIndex(2, bad.cache_id, 0)],
                            timeout=30)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, lambda: [stream.layer_ready(i) for i in range(4)])   # compute thread
    assert [await stream.wait_layer(i) for i in range(4)] == [[S.LLM_SUCCESS, S.LLM_SUCCESS]] * 4
    await d.unregister_kv_cache(bad.cache_id)    # the second destination goes away mid-stream
    await loop.run_in_executor(None, lambda: [stream.layer_ready(i) for i in range(4, layers)])
    assert await stream.wait() == [S.LLM_SUCCESS, S.LLM_KV_CACHE_NOT_EXIST]
    assert all(np.array_equal(a, b) for a, b in zip(src.tensors, good.tensors))


async def test_layer_stream_times_out_when_layers_never_come(spair):
    p, d = spair
    desc = kv.CacheDesc(4, (1, 4096), np.uint8)
    src, dst = await caches(p, d, desc)
    stream = p.layer_stream(src, [kv.CacheIndex(2, dst.cache_id, 0)], timeout=0.05, notify=b"never")
    stream.layer_ready(0)
    assert await stream.wait() == [S.LLM_TIMEOUT]
    assert await stream.wait_layer(1) == [S.LLM_TIMEOUT]     # never marked: the final word, no hang
    with pytest.raises(kv.LLMTimeoutError, match="finished"):
        stream.layer_ready(1)
    with pytest.raises(kv.LLMTimeoutError):
        await d.wait_notification(b"never", timeout=0.2)
    # cancel: the same, with LLM_CANCELLED
    stream = p.layer_stream(src, [kv.CacheIndex(2, dst.cache_id, 0)], timeout=30)
    stream.cancel()
    assert await stream.wait() == [S.LLM_CANCELLED]
    assert await stream.wait_layer(0) == [S.LLM_CANCELLED]


async def test_layer_stream_notify_set_late(spair):
    p, d = spair
    desc = kv.CacheDesc(4, (1, 4096), np.uint8)
    src, dst = await caches(p, d, desc)
    stream = p.layer_stream(src, [kv.CacheIndex(2, dst.cache_id, 0)], timeout=30, notify=b"placeholder")
    stream.layer_ready(0)
    stream.set_notify(b'{"first_token": 7}')   # known only once the forward pass is done
    stream.layer_ready(1)
    assert await stream.wait() == [S.LLM_SUCCESS]
    assert (await d.wait_notification(timeout=5)).payload == b'{"first_token": 7}'
    with pytest.raises(kv.LLMParamInvalidError, match="already sent"):
        stream.set_notify(b"too late")


async def test_notification_arrives_after_the_data_and_only_on_success(spair):
    p, d = spair
    src, dst = await caches(p, d, kv.CacheDesc(4, (2, 1 << 20), np.uint8))   # 4 MiB rows: queued path
    waiter = asyncio.ensure_future(d.wait_notification(b"row-1", timeout=10))
    await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 1), 0, notify=b"row-1")
    note = await waiter
    assert note.payload == b"row-1"
    # at delivery every byte is in place (the notification follows the completion)
    assert all(np.array_equal(a[1], b[0]) for a, b in zip(dst.tensors, src.tensors))
    # a failed push sends none
    big_src, big_dst = await caches(p, d, kv.CacheDesc(2, (1, 64 << 20), np.uint8))
    t = p.submit_push_kv_cache(big_src, kv.CacheIndex(2, big_dst.cache_id, 0), timeout=30, notify=b"failed")
    assert t.cancel()   # in the same loop step (a 2 ms deadline let the movers finish first under load)
    assert await t == S.LLM_CANCELLED
    await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), 0, notify=b"after")   # a later marker
    assert (await d.wait_notification(b"after", timeout=10)).payload == b"after"
    with pytest.raises(kv.LLMTimeoutError):
        await d.wait_notification(b"failed", timeout=0.1)
    # notifications() yields them in arrival order
    for i in range(3):
        await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), 0, notify=b"n%d" % i)
    got = []
    async for n in d.notifications():
        got.append(n.payload)
        if len(got) == 3:
            break
    assert got == [b"n0", b"n1", b"n2"]
    with pytest.raises(kv.LLMParamInvalidError, match="notify"):
        await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), 0, notify=b"x" * 5000)


async def test_stats_match_what_happened(spair, sched_transport):
    p, d = spair
    # 1 GiB: ~50 ms of copying, so the 2 ms deadline below aborts it first even when the
    # loop waits a few ms for a CPU beside two busy movers (128 MiB finished first once in
    # CI); allocated first, so the pushes after it renew the mover lease its filling delayed
    big_src, big_dst = await caches(p, d, kv.CacheDesc(2, (1, 512 << 20), np.uint8))
    src, dst = await caches(p, d, kv.CacheDesc(2, (8, 1 << 20), np.uint8))
    for r in range(5):
        await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, r), r)
    for a, b in zip(src.tensors, dst.tensors):   # rows 0..4 pushed, rows 5..7 untouched
        assert np.array_equal(a[:5], b[:5]) and not b[5:].any()
    before = snapshot(dst)
    with pytest.raises(kv.LLMKvCacheNotExistError):
        await p.push_kv_cache(src, kv.CacheIndex(2, 999, 0))
    assert await p.submit_push_kv_cache(big_src, kv.CacheIndex(2, big_dst.cache_id, 0), timeout=0.002) \
        == S.LLM_TIMEOUT
    st = p.stats()
    assert st["by_status"] == {"LLM_SUCCESS": 5, "LLM_KV_CACHE_NOT_EXIST": 1, "LLM_TIMEOUT": 1}
    assert st["transfers"] == 7 and st["queued"] == 0 and st["in_flight"] == 0
    peer = st["peers"][f"2/{sched_transport}"]
    assert peer["transfers"] == 6 and peer["by_status"]["LLM_SUCCESS"] == 5
    assert peer["bytes"] >= 5 * 2 * (1 << 20)
    assert peer["latency"]["total"]["count"] == 6
    assert 0 < peer["latency"]["total"]["p50_s"] < 5
    assert st["links"][2]["queue_depth"] == 0 and st["links"][2]["inflight_bytes"] == 0
    text = p.metrics_text()
    assert f'kvengine_transfers_total{{cluster="1",peer="2",transport="{sched_transport}",status="LLM_SUCCESS"}} 5' in text
    assert "# TYPE kvengine_transfer_seconds histogram" in text
    assert f'kvengine_transfer_seconds_count{{cluster="1",peer="2",transport="{sched_transport}",phase="total"}} 6' in text
    # the failed push and the timed-out one (to other caches) left dst as it was
    assert all(np.array_equal(a, b) for a, b in zip(before, dst.tensors))


def test_rank_packs_the_queue_key_in_order():
    """The native queues sort by rank(): it must order keys as the Python heap does
    (priority first, then deadline to the microsecond), and FIFO keys all rank 0."""
    from kvengine.scheduler import rank
    keys = [(-p, d, s) for s, (p, d) in enumerate(
        [(1000, 5.0), (3, 0.0), (3, 0.000002), (3, 1e6), (0, 12.5), (0, 12.500001), (-1000, 0.0), (2, 3.0)])]
    by_rank = sorted(keys, key=rank)
    assert [k[:2] for k in by_rank] == [k[:2] for k in sorted(keys)]
    assert all(0 <= rank(k) < 1 << 63 for k in keys)
    assert rank((-5, -1.0, 0)) < rank((-5, 0.5, 1))                 # a deadline before the clock's 0 clamps low
    assert rank((-5, 1e12, 0)) == rank((-5, 1e13, 1)) < rank((-4, 0.0, 2))   # and a far one high, within its class
    assert rank((17,)) == rank((3,)) == 0
