"""Peers that stop answering: SIGSTOP'd decode processes. Heartbeats turn the
silence into LLM_LINK_FAILED within heartbeat_timeout, transfers in flight
resolve, other links keep working, and the cluster can link again."""

import asyncio
import signal

import numpy as np
import pytest

import kvengine as kv
from kvengine import LLMStatusCode as S
from kvengine._peer import PeerProcess, fill_pattern, row_digests

HB = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}
BOUND = HB["heartbeat_timeout"] + 2 * HB["heartbeat_interval"] + 1.0   # + scheduling slack


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_sigstopped_peer_is_declared_lost_and_others_keep_working(transport):
    opts = kv.EngineOptions(transport=transport, **HB)
    prefill = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", opts).start()
    stopped = await PeerProcess.start(cluster_id=2, transport=transport, options=HB)
    healthy = await PeerProcess.start(cluster_id=3, transport=transport, options=HB)
    try:
        desc = kv.CacheDesc(2, (1, 128 << 20), np.uint8)    # 256 MiB per push
        src = prefill.allocate_cache(desc)
        small = prefill.allocate_cache(kv.CacheDesc(1, (1, 1 << 20), np.uint8))
        fill_pattern(small.tensors[0], 3, 0)
        ids = {}
        for peer in (stopped, healthy):
            ids[peer.pid] = (await peer.call("alloc", n=2, shape=[1, 128 << 20], dtype="uint8"))["cache_id"]
            ids[(peer.pid, "small")] = (await peer.call("alloc", n=1, shape=[1, 1 << 20], dtype="uint8"))["cache_id"]
            st, _ = await prefill.link_clusters([kv.ClusterInfo(2 if peer is stopped else 3, peer.address)])
            assert st == S.LLM_SUCCESS
        loop = asyncio.get_running_loop()
        stopped.signal(signal.SIGSTOP)
        t0 = loop.time()
        inflight = [prefill.submit_push_kv_cache(src, kv.CacheIndex(2, ids[stopped.pid], 0), timeout=30)
                    for _ in range(4)]
        # the healthy link works while the other peer is frozen
        await prefill.push_kv_cache(small, kv.CacheIndex(3, ids[(healthy.pid, "small")], 0), timeout=5)
        statuses = await asyncio.wait_for(asyncio.gather(*inflight), BOUND + 5)
        elapsed = loop.time() - t0
        assert set(statuses) <= {S.LLM_SUCCESS, S.LLM_LINK_FAILED}
        if transport == "tcp":    # nothing can land in a frozen TCP peer
            assert set(statuses) == {S.LLM_LINK_FAILED}
            assert elapsed < BOUND, f"transfers to a stopped peer took {elapsed:.2f} s to resolve"
        # shm: the copies into the frozen peer's memory may finish; the link goes all the same.
        # wait_remote_cache on a cache that never comes returns as soon as the link goes down.
        with pytest.raises((kv.LLMLinkFailedError, kv.LLMNotYetLinkError)):
            await prefill.wait_remote_cache(2, 2**62, timeout=BOUND + 5)
        assert loop.time() - t0 < BOUND, "the frozen peer was not declared lost in time"
        assert 2 not in prefill.stats()["links"] and 3 in prefill.stats()["links"]
        await prefill.push_kv_cache(small, kv.CacheIndex(3, ids[(healthy.pid, "small")], 0), timeout=5)
        rows = (await healthy.call("digest", cache_id=ids[(healthy.pid, "small")]))["rows"]
        assert rows == row_digests(small.tensors)
        # the frozen peer comes back: it finds its link gone, and the cluster can link again
        stopped.signal(signal.SIGCONT)
        assert (await stopped.call("wait_link_down", cluster_id=1, timeout=10))["down"]
        st, per = await prefill.link_clusters([kv.ClusterInfo(2, stopped.address)])
        assert st == S.LLM_SUCCESS, per
        await prefill.wait_remote_cache(2, ids[(stopped.pid, "small")])
        await prefill.push_kv_cache(small, kv.CacheIndex(2, ids[(stopped.pid, "small")], 0), timeout=5)
    finally:
        stopped.signal(signal.SIGCONT)
        await prefill.close()
        await stopped.close()
        await healthy.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_peer_that_pings_but_takes_none_of_our_messages_loses_the_link(transport):
    """A peer that keeps pinging but reads nothing of its control channel (its kernel
    buffers full, ours queueing; here our channel reports just that: messages waiting,
    no byte taken) is lost within heartbeat_timeout of it, as a silent one is. Before,
    its pings kept the link up and every awaited send on the link waited forever.
    (Filling the kernels' buffers for real takes megabytes of control messages: tcp
    grows the send buffer to tcp_wmem's 4 MiB.)"""
    opts = kv.EngineOptions(transport=transport, **HB)
    p = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", opts).start()
    d = await kv.KvEngine(2, kv.Role.DECODER, "127.0.0.1:0", opts).start()
    try:
        assert (await p.link_clusters([kv.ClusterInfo(2, d.address)]))[0] == S.LLM_SUCCESS
        link = p._open().links.get(2)
        assert link is not None and link.transport == transport
        loop = asyncio.get_running_loop()
        link.ch.progress = lambda: (0, 4096)   # type: ignore[method-assign]
        t0 = loop.time()
        with pytest.raises((kv.LLMLinkFailedError, kv.LLMNotYetLinkError)):
            await p.wait_remote_cache(2, 2**62, timeout=BOUND + 5)
        assert loop.time() - t0 < BOUND, f"lost after {loop.time() - t0:.2f} s (bound {BOUND:.2f} s)"
        assert 2 not in p.stats()["links"]
    finally:
        await p.close()
        await d.close()
