"""Every wait the engine makes ends: close() is bounded, idempotent and
cancel-safe, and it ends the notification waiters (wait_notification raises,
notifications() stops) instead of leaving them parked forever."""

import asyncio
import signal

import pytest

import kvengine as kv
from kvengine import LLMStatusCode as S
from kvengine._peer import PeerProcess

from conftest import link, make_pair

HB = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0, "link_timeout": 1.5}


async def test_close_ends_notification_waiters():
    p, d = await make_pair("local")
    try:
        await link(p, d)
        waiter = asyncio.ensure_future(d.wait_notification(b"never", timeout=30))
        seen = []

        async def consume():
            async for note in d.notifications():
                seen.append(note)

        it = asyncio.ensure_future(consume())
        for _ in range(5):   # let both park on their futures
            await asyncio.sleep(0)
        assert not waiter.done() and not it.done()
        await asyncio.wait_for(d.close(), 5)
        with pytest.raises(kv.LLMEngineFinalizedError):
            await asyncio.wait_for(waiter, 1)
        await asyncio.wait_for(it, 1)   # the iteration ended by itself
        assert seen == []
    finally:
        await p.close()
        await d.close()


async def test_close_is_idempotent_and_cancel_safe_against_a_frozen_peer():
    """A frozen peer never answers the unlink: close() gives up after link_timeout.
    Cancelled mid-way, the closing goes on; a second close() waits for it and the
    core ends closed."""
    opts = kv.EngineOptions(transport="tcp", **HB)
    e = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", opts).start()
    peer = await PeerProcess.start(cluster_id=2, transport="tcp", options=HB)
    try:
        st, _ = await e.link_clusters([kv.ClusterInfo(2, peer.address)])
        assert st == S.LLM_SUCCESS
        peer.signal(signal.SIGSTOP)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first = asyncio.ensure_future(e.close())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not first.done()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(e.close(), HB["link_timeout"] + HB["heartbeat_timeout"] + 2)
        elapsed = loop.time() - t0
        assert elapsed < HB["link_timeout"] + HB["heartbeat_timeout"] + 1, elapsed
        # closed: no link, no native job left
        st = e.stats()
        assert st["links"] == {} and st["native"]["jobs_live"] == 0
        await e.close()   # once more: a no-op
        with pytest.raises(kv.LLMEngineFinalizedError):
            e.allocate_cache(kv.CacheDesc(1, (1, 16), "uint8"))
    finally:
        peer.signal(signal.SIGCONT)
        await e.close()
        await peer.close()
