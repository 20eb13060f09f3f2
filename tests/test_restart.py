"""A peer that restarts under the same cluster id while we still hold its old link
(docs/protocol.md, "Incarnations"; docs/reliability.md).

Each engine start has a random incarnation, sent in the hello and the welcome. When
a hello for a linked cluster id carries another incarnation and its attach proves the
secret, the old link is stale: it is dropped (its transfers resolve LLM_LINK_FAILED,
fenced; its cache tables go) and the new engine links at once, instead of being
refused LLM_ALREADY_LINK until the heartbeat gives up on the old one. The old
engine's cache ids are never used against the new one. A claim that does not prove
the secret drops nothing."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

import hostile as H
import kvengine as kv
from kvengine import LLMStatusCode as S
from kvengine._peer import PeerProcess, fill_pattern, row_digests

SECRET = b"restart-secret"
HBT = 3.0    # long enough that the old link is still up when the new engine links


async def _engine(transport: str) -> kv.KvEngine:
    return await kv.KvEngine(1, kv.Role.DECODER, "127.0.0.1:0", kv.EngineOptions(
        secret=SECRET, transport=transport, heartbeat_interval=0.5, heartbeat_timeout=HBT)).start()


async def _stopped(pid: int) -> None:
    """Until every thread of ``pid`` is stopped (the kernel's word: state T in /proc)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(s == "T" for s in states):
            return
        assert loop.time() < deadline, f"process {pid} not stopped: {states}"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_restarted_peer_replaces_its_stale_link_and_its_cache_ids(transport):
    e = await _engine(transport)
    peers = {"hb": dict(heartbeat_interval=0.5, heartbeat_timeout=HBT)}
    old = await PeerProcess.start(cluster_id=2, secret=SECRET, transport=transport, options=peers["hb"])
    new = await PeerProcess.start(cluster_id=2, secret=SECRET, transport=transport, options=peers["hb"])
    try:
        shape = [2, 1024, 1024]   # 2 rows of 2 MiB per tensor
        old_ids = [(await old.call("alloc", n=8, shape=shape, dtype="uint8"))["cache_id"] for _ in range(2)]
        assert (await old.call("link", cluster_id=1, address=e.address))["status"] == 0
        await e.wait_link(2, timeout=10)
        for cid in old_ids:
            await e.wait_remote_cache(2, cid, timeout=10)
        first = e.stats()["links"][2]["incarnation"]
        src = e.allocate_cache(kv.CacheDesc(8, tuple(shape), np.uint8))
        for i, t in enumerate(src.tensors):
            fill_pattern(t, 7, i)
        before = (await old.call("digest", cache_id=old_ids[1]))["rows"]

        old.signal(signal.SIGSTOP)   # frozen: we still hold its link, its heartbeat is not yet missed
        try:
            await _stopped(old.pid)
            stuck = None
            if transport == "tcp":   # a push the frozen peer cannot take: in flight on the old link
                stuck = e.submit_push_kv_cache(src, kv.CacheIndex(2, old_ids[1], 0), timeout=30)
            new_id = (await new.call("alloc", n=8, shape=shape, dtype="uint8"))["cache_id"]
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            assert (await new.call("link", cluster_id=1, address=e.address))["status"] == 0
            assert loop.time() - t0 < HBT, "the new engine waited for the old link's heartbeat"
            await e.wait_remote_cache(2, new_id, timeout=10)
            link = e.stats()["links"][2]
            assert link["incarnation"] != first and link["remote_caches"] == 1
            if stuck is not None:
                assert await asyncio.wait_for(stuck, HBT) == S.LLM_LINK_FAILED, stuck.message()
            # the old engine's second cache id means nothing on the new link
            with pytest.raises(kv.LLMKvCacheNotExistError):
                await e.push_kv_cache(src, kv.CacheIndex(2, old_ids[1], 0), timeout=5)
            assert await e.push_kv_cache(src, kv.CacheIndex(2, new_id, 1), 0, timeout=10) == S.LLM_SUCCESS
            got = (await new.call("digest", cache_id=new_id))["rows"]
            assert [r[1] for r in got] == [r[0] for r in row_digests(src.tensors)]
        finally:
            old.signal(signal.SIGCONT)
        # the old process, resumed, finds its link gone; nothing of ours landed in it
        assert (await old.call("wait_link_down", cluster_id=1, timeout=2 * HBT))["down"]
        assert (await old.call("digest", cache_id=old_ids[1]))["rows"] == before
    finally:
        await e.close()
        await old.close()
        await new.close()
        assert e.stats()["native"]["jobs_live"] == 0


async def test_a_restart_claim_without_the_secret_drops_nothing():
    e = await _engine("tcp")
    peer = await PeerProcess.start(cluster_id=2, secret=SECRET, transport="tcp")
    try:
        dst = (await peer.call("alloc", n=2, shape=[1, 4096], dtype="uint8"))["cache_id"]
        assert (await peer.call("link", cluster_id=1, address=e.address))["status"] == 0
        await e.wait_remote_cache(2, dst, timeout=10)
        inc = e.stats()["links"][2]["incarnation"]
        ctl = await H.Control.open(e.address)
        try:
            ctl.send(H.hello(2, auth=True, transport="tcp"))   # cluster 2, a new incarnation
            w = await ctl.recv()
            assert w is not None and w["t"] == "welcome", w   # the claim gets as far as the proof
            ctl.send({"t": "attach", "proof": "00" * 32})   # and fails it
            r = await ctl.recv()
            assert r is None or r["t"] == "reject", r
        finally:
            ctl.close()
        link = e.stats()["links"].get(2)
        assert link is not None and link["incarnation"] == inc and link["state"] == "up"
        src = e.allocate_cache(kv.CacheDesc(2, (1, 4096), np.uint8))
        assert await e.push_kv_cache(src, kv.CacheIndex(2, dst, 0), timeout=10) == S.LLM_SUCCESS
    finally:
        await e.close()
        await peer.close()
