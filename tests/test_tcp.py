"""The TCP transport against hostile input: random bytes and premature frames on
every listening port. Nothing may be written into any registered region, the
bad connections are counted and dropped, and the engine keeps serving."""

import asyncio
import os
import random
import struct

import numpy as np
import pytest

import kvengine as kv
from kvengine import LLMStatusCode as S
from conftest import filled, link, snapshot

SECRET = b"tcp-test-secret"
MAGIC = 0x3145564B
F_HELLO, F_DATA, F_READ = 1, 3, 7


def frame(ftype, region=0, xfer=1, offset=0, length=0, total=0, flags=0, status=0):
    """A 64-byte data-plane header (docs/protocol.md)."""
    return struct.pack("<IHHIIQQQQIIQ", MAGIC, ftype, flags, status, region, xfer, offset, length, total,
                       0, 0, 0)


async def engines():
    opts = kv.EngineOptions(transport="tcp", secret=SECRET)
    p = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", opts).start()
    d = await kv.KvEngine(2, kv.Role.DECODER, "127.0.0.1:0", opts).start()
    return p, d


async def blast(host, port, payload: bytes):
    """Connect, send, half-close, wait for the server to drop us (bounded)."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return
    try:
        writer.write(payload)
        await writer.drain()
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 10)
    except (OSError, asyncio.TimeoutError):
        pass
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass


async def test_random_bytes_on_every_port_change_nothing():
    p, d = await engines()
    try:
        await link(p, d)
        src = filled(p.allocate_cache(kv.CacheDesc(4, (4, 4096), np.uint8)), seed=41)
        dst = d.allocate_cache(kv.CacheDesc(4, (4, 4096), np.uint8))
        filled(dst, seed=42)
        await p.wait_remote_cache(2, dst.cache_id)
        before = snapshot(dst)
        host, port = d.address.rsplit(":", 1)
        rng = random.Random(7)
        payloads = []
        for i in range(200):
            n = rng.randrange(1, 8192)
            body = bytes(rng.getrandbits(8) for _ in range(n))
            kind = i % 4
            if kind == 1:    # a valid data-plane header before any HELLO
                body = frame(F_DATA, region=1, length=4096, total=4096) + body
            elif kind == 2:  # HELLO with a wrong token
                body = frame(F_HELLO, length=32) + os.urandom(32) + body
            elif kind == 3:  # a control frame with a plausible length and garbage inside
                body = struct.pack("!I", min(n, 4000)) + body
            payloads.append(body)
        targets = [(host, int(port)), (host, d.stats()["data_port"])]
        for i in range(0, 200, 20):   # 20 connections at a time, to both ports
            await asyncio.gather(*(blast(*targets[j % 2], payloads[j]) for j in range(i, i + 20)))
        assert all(np.array_equal(a, b) for a, b in zip(before, dst.tensors)), "a hostile byte landed"
        native = d.stats()["native"]
        assert native["tcp_refused"] + native["tcp_bad_frames"] >= 100
        assert d.stats()["control_refused"] >= 50
        assert native["tcp_conns"] == 4   # only the real link's streams remain
        # the engine keeps serving: a normal push still succeeds, byte-exact
        assert await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 2), src_batch_index=1) == S.LLM_SUCCESS
        for t in range(4):
            assert np.array_equal(dst.tensors[t][2], src.tensors[t][1])
            assert np.array_equal(dst.tensors[t][[0, 1, 3]], before[t][[0, 1, 3]])
    finally:
        await p.close()
        await d.close()


async def test_frames_from_an_unauthenticated_socket_are_refused():
    p, d = await engines()
    try:
        await link(p, d)
        dst = d.allocate_cache(kv.CacheDesc(1, (1, 4096), np.uint8))
        await p.wait_remote_cache(2, dst.cache_id)
        rid = dst._regions[0][0]   # the native region of tensor 0 (what a peer is told)
        refused = d.stats()["native"]["tcp_refused"]
        # a perfect DATA frame for a real, exported region, but no HELLO first
        await blast("127.0.0.1", d.stats()["data_port"], frame(F_DATA, region=rid, length=4096, total=4096)
                    + b"\xff" * 4096)
        # a READ for it, also without HELLO
        await blast("127.0.0.1", d.stats()["data_port"], frame(F_READ, region=rid, length=4096, total=4096))
        assert not dst.tensors[0].any()
        assert d.stats()["native"]["tcp_refused"] == refused + 2
        assert p.stats()["links"][2]["transport"] == "tcp"   # the real link is untouched
    finally:
        await p.close()
        await d.close()


async def test_wrong_secret_gets_no_link_and_writes_nothing():
    opts = kv.EngineOptions(transport="tcp", secret=SECRET)
    bad = kv.EngineOptions(transport="tcp", secret=b"not-the-secret")
    d = await kv.KvEngine(2, kv.Role.DECODER, "127.0.0.1:0", opts).start()
    p = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", bad).start()
    try:
        dst = d.allocate_cache(kv.CacheDesc(1, (1, 4096), np.uint8))
        st, per = await p.link_clusters([kv.ClusterInfo(2, d.address)])
        assert per == [S.LLM_LINK_FAILED]
        assert p.stats()["links"] == {} and d.stats()["links"] == {}
        with pytest.raises(kv.LLMNotYetLinkError):
            await p.push_kv_cache(p.allocate_cache(kv.CacheDesc(1, (1, 4096), np.uint8)),
                                  kv.CacheIndex(2, dst.cache_id, 0))
        assert not dst.tensors[0].any()
        assert d.stats()["native"]["tcp_conns"] == 0
    finally:
        await p.close()
        await d.close()


async def test_oversized_control_frame_is_dropped():
    _, d = None, await kv.KvEngine(2, listen="127.0.0.1:0", options=kv.EngineOptions(secret=SECRET)).start()
    try:
        host, port = d.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(struct.pack("!I", 1 << 30))   # a 1 GiB "hello"
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""   # dropped at once
        writer.close()
        assert d.stats()["control_refused"] == 1
    finally:
        await d.close()


async def test_pushes_of_up_to_4_mib_go_in_half_chunk_frames():
    """kv_tcp.c frame_bytes: a push of at most 4 MiB leaves in DATA frames of at most
    512 KiB (in one 1 MiB frame a 1 MiB push took about twice as long on loopback under
    BBR: docs/benchmarks.md), a larger one in frames of chunk_bytes (1 MiB); each lands
    whole (the raw peer ACKs a push once all its bytes came)."""
    from test_fencing import HOSTILE, Receiver, hostile_link, tcp_prefill, tcp_table
    cases = [(1 << 20, 512 << 10), (4 << 20, 512 << 10), (8 << 20, 1 << 20)]   # (push, largest frame)
    descs = [kv.CacheDesc(1, (1, n), np.uint8) for n, _ in cases]
    table = [e for i, d in enumerate(descs) for e in tcp_table(d, cache_id=i + 1, region=17 + i)]
    prefill = await tcp_prefill()
    s = rx = None
    try:
        s, _ = await hostile_link(prefill.address, HOSTILE, table)
        rx = Receiver(s, ack=True, abort_ack="all")
        await prefill.wait_link(HOSTILE, timeout=5)
        for i, ((n, largest), desc) in enumerate(zip(cases, descs)):
            await prefill.wait_remote_cache(HOSTILE, i + 1, timeout=5)
            src = prefill.allocate_cache(desc)
            first = len(rx.frames)
            st = await prefill.push_kv_cache(src, kv.CacheIndex(HOSTILE, i + 1, 0), timeout=10)
            assert st == S.LLM_SUCCESS, st
            frames = rx.frames[first:]
            assert sum(frames) == n and max(frames) == largest, (n, frames)
    finally:
        if rx is not None:
            rx.close()
        if s is not None:
            s.close()
        await prefill.close()


# ------------------------------------------------------------------ one-layer pushes the loop thread drives

async def test_one_layer_tcp_pushes_are_driven_by_the_loop_thread():
    """A one-layer tcp push (64 KiB) with nothing else of its link in flight is driven by
    the loop thread (kv_tcp_submit_driven: the I/O thread's round run there, its frame
    sent and the ACK read, no hand-off to the I/O thread and back): the checks of
    tests/test_ucx_more.py's driven_pushes, over tcp."""
    from test_ucx_more import driven_pushes
    await driven_pushes("tcp")


async def test_a_driven_tcp_push_into_a_stopped_peer_is_fenced():
    """A driven tcp push into a SIGSTOPped peer: handed to the I/O thread at the drive's
    bound, its status within the fence's bound, no byte landed before or after the resume
    (tests/test_ucx_more.py's driven_push_into_stopped_peer, over tcp)."""
    from test_ucx_more import driven_push_into_stopped_peer
    await driven_push_into_stopped_peer("tcp")


async def test_tcp_pushes_into_an_engine_that_drives_are_taken_at_once():
    """A peer's pushes into an engine whose loop thread drives its own pushes over tcp are
    taken as they come, not at the I/O thread's next tick (tests/test_ucx_more.py's
    pushes_in_between_drives, over tcp)."""
    from test_ucx_more import pushes_in_between_drives
    await pushes_in_between_drives("tcp")
