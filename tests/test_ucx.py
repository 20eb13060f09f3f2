"""transport="ucx": the cross-process suite of tests/test_cross_process.py (push,
pull, blocks, caches announced later, 64 concurrent pushes, timeout fenced, peer
killed mid-transfer) over UCX's tcp and shared-memory transports (and tcp,cma),
plus the initiator's checks at the native core's API. The target's checks
against a hostile peer: tests/test_ucx_hostile.py.

Skipped when kvengine was built without UCX (pip install "kvengine[ucx]", then
rebuild). UCX_TLS is set for both processes (the child inherits it)."""

import asyncio

import numpy as np
import pytest

import kvengine as kv
from kvengine import LLMStatusCode as S
from kvengine.native import _native

pytestmark = pytest.mark.skipif(
    not _native.UCX, reason="kvengine built without UCX: pip install 'kvengine[ucx]' (libucx-cu12), then rebuild")

# The cross-process tests, re-run here with xtransport overridden below.
from test_cross_process import (  # noqa: E402,F401
    decode, prefill, test_64_concurrent_pushes, test_blocks_non_contiguous,
    test_cache_registered_after_link_and_peer_push, test_peer_killed_mid_transfer_then_new_peer,
    test_pull_and_pull_size, test_push_with_layer_ranges_byte_exact, test_timeout_fenced_across_processes)

# UCX_TLS per case: tcp only; shared memory (posix/sysv, cma for zero copy, self); tcp with cma;
# "default": UCX_TLS unset, kvengine's default (every transport but UCX's tcp). "-nopeer":
# KVENGINE_UCX_PEER_ERRORS=0 (endpoints without UCX's error handling: zero-copy rendezvous).
TLS = {"tcp": "tcp", "sm": "sm,self", "tcpcma": "tcp,cma", "default": None,
       "tcp-nopeer": "tcp", "tcpcma-nopeer": "tcp,cma"}


@pytest.fixture(params=sorted(TLS))
def xtransport(request, monkeypatch):
    if TLS[request.param] is None:
        monkeypatch.delenv("UCX_TLS", raising=False)
    else:
        monkeypatch.setenv("UCX_TLS", TLS[request.param])
    if request.param.endswith("-nopeer"):
        monkeypatch.setenv("KVENGINE_UCX_PEER_ERRORS", "0")
    else:
        monkeypatch.delenv("KVENGINE_UCX_PEER_ERRORS", raising=False)
    return "ucx"


def test_without_ucx_feature_not_enabled(monkeypatch):
    """An engine built without UCX refuses transport="ucx" with the install hint."""
    monkeypatch.setattr(_native, "UCX", False)

    async def go():
        with pytest.raises(kv.LLMError) as e:
            await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", kv.EngineOptions(transport="ucx")).start()
        assert e.value.status == S.LLM_FEATURE_NOT_ENABLED
        assert "kvengine[ucx]" in str(e.value)
    asyncio.run(go())


# ------------------------------------------------------------ native checks

def _pair(tls, monkeypatch, window=0):
    """Two cores linked over UCX as link 1 on both, and the tokens (ta, tb): a's messages
    carry tb, b's carry ta. ``window``: the links' (push messages of up to window / 2)."""
    import secrets
    monkeypatch.setenv("UCX_TLS", tls)
    a, b = _native.Core(), _native.Core()
    sa, addr_a = a.ucx_address()
    sb, addr_b = b.ucx_address()
    assert sa == 0 and sb == 0
    ta, tb = secrets.token_bytes(_native.UCX_TOKEN), secrets.token_bytes(_native.UCX_TOKEN)
    assert a.ucx_link_add(1, addr_b, ta, tb, window, 1.0) == 0
    assert b.ucx_link_add(1, addr_a, tb, ta, window, 1.0) == 0
    return a, b, (ta, tb)


def _wait(core, n=1, timeout=10.0):
    import time
    out, end = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        out += core.poll()
        time.sleep(0.002)
    return out


@pytest.mark.parametrize("tls", ["tcp", "sm,self"])
def test_initiator_checks(tls, monkeypatch):
    """Every remote range is checked at submit, before a message exists: out of the
    peer's region, overflowing offsets, a link to our own worker, a repeated token;
    a valid push lands exactly in the registered range (and the target checked it
    again, see tests/test_ucx_hostile.py)."""
    a, b, (ta, tb) = _pair(tls, monkeypatch)
    try:
        src = np.full(1 << 16, 7, np.uint8)
        arena = np.zeros(3 << 16, np.uint8)          # the peer registers only the middle third
        dst = arena[1 << 16: 2 << 16]
        st, rs = a.region_add(_native.REGION_LOCAL, 0, src.ctypes.data, src.nbytes, _native.F_EXPORT)
        st2, rd = b.region_add(_native.REGION_LOCAL, 0, dst.ctypes.data, dst.nbytes, _native.F_EXPORT)
        assert st == st2 == 0
        assert b.ucx_mem_map(rd) == 0
        st, rr = a.region_add(_native.REGION_UCX, 1, rd, dst.nbytes, 0)   # as the table announced it
        assert st == 0

        def seg(*w):
            return np.array(w, dtype=np.uint64)
        # past the end, overflowing offsets, the whole arena: refused at submit
        for off, n in ((1, dst.nbytes), (dst.nbytes, 1), (2**64 - 1, 2), (0, dst.nbytes + 1)):
            st, done, _ = a.submit(10, seg(rs, 0, rr, off, n), 0)
            assert st == S.LLM_PARAM_INVALID, (off, n)
        # a link to our own worker (a peer sending our address back), a token in use
        assert a.ucx_link_add(5, a.ucx_address()[1], b"x" * 16, tb, 0, 1.0) == S.LLM_PARAM_INVALID
        assert a.ucx_link_add(6, b.ucx_address()[1], ta, tb, 0, 1.0) == S.LLM_PARAM_INVALID
        assert a.ucx_link_add(7, b.ucx_address()[1], b"short", tb, 0, 1.0) == S.LLM_PARAM_INVALID
        # a valid push lands exactly in the registered range
        st, done, _ = a.submit(11, seg(rs, 0, rr, 0, dst.nbytes), 0)
        assert st == 0 and not done
        (c,) = _wait(a)
        assert c[:3] == (11, 0, dst.nbytes)
        assert (dst == 7).all() and not arena[: 1 << 16].any() and not arena[2 << 16:].any()
        # and a pull reads it back through the target's checks
        back = np.zeros(1 << 16, np.uint8)
        st, rb = a.region_add(_native.REGION_LOCAL, 0, back.ctypes.data, back.nbytes, _native.F_EXPORT)
        st, done, _ = a.submit(12, seg(rr, 0, rb, 0, back.nbytes), 0)
        assert st == 0
        (c,) = _wait(a)
        assert c[:3] == (12, 0, back.nbytes) and (back == 7).all()
        # only our own caches are ever registered for UCX (F_EXPORT)
        st, plain = a.region_add(_native.REGION_LOCAL, 0, src.ctypes.data, src.nbytes, 0)
        assert a.ucx_mem_map(plain) == S.LLM_PARAM_INVALID
    finally:
        for c in (a, b):
            c.close()
            c.release()


@pytest.mark.parametrize("tls", ["tcp", "sm,self"])
def test_staged_pieces_land_both_ways(tls, monkeypatch):
    """A large staged payload lands piece by piece with one system call each: a pread from
    the staging memfd or a process_vm_writev from its mapping, whichever is timed faster
    for this engine's memory (kv_ucx.c land_how; the first pieces try both). Both ways
    land byte-exact and only inside the registered range, offset for offset (4 MiB
    window: 2 MiB messages, two pieces each)."""
    a, b, _ = _pair(tls, monkeypatch, window=4 << 20)
    try:
        n = 8 << 20                                  # 8 pieces of 1 MiB, several messages
        rng = np.random.default_rng(5)
        arena = np.full(n + (2 << 20), 0xAB, np.uint8)
        dst = arena[1 << 20: (1 << 20) + n]
        st, rd = b.region_add(_native.REGION_LOCAL, 0, dst.ctypes.data, n, _native.F_EXPORT)
        assert st == 0 and b.ucx_mem_map(rd) == 0
        st, rr = a.region_add(_native.REGION_UCX, 1, rd, n, 0)
        assert st == 0
        for k in range(2):
            src = rng.integers(0, 256, n, np.uint8)
            st, rs = a.region_add(_native.REGION_LOCAL, 0, src.ctypes.data, n, _native.F_EXPORT)
            assert st == 0 and a.ucx_mem_map(rs) == 0
            st, done, _ = a.submit(30 + k, np.array([rs, 0, rr, 0, n], dtype=np.uint64), 0)
            assert st == 0
            (c,) = _wait(a)
            assert c[:3] == (30 + k, 0, n), c
            assert (dst == src).all()
            assert (arena[: 1 << 20] == 0xAB).all() and (arena[(1 << 20) + n:] == 0xAB).all()
        s = b.stats()
        assert s["ucx_land_pread"] >= 3 and s["ucx_land_pvw"] >= 3, s
        assert s["ucx_rx_pending"] == 0 and s["ucx_bad_msgs"] == 0
    finally:
        for c in (a, b):
            c.close()
            c.release()


@pytest.mark.parametrize("tls,peer_errors,eager,seg", [
    ("sysv,self", "1", True, None), ("sysv,self", "0", True, None), ("posix,self", "0", True, None),
    ("sm,self", "0", False, None), ("sm,self", "1", False, None), ("tcp", "0", True, None), ("tcp", "1", True, None),
    ("tcp", "1", True, "8K"), ("tcp,cma", "0", True, None), ("tcp,cma", "1", True, None)])
def test_one_layer_push_eager(tls, peer_errors, eager, seg, monkeypatch):
    """A one-layer push (64 KiB in one message) goes eager (the handler checks it and lands
    it: no rendezvous, no staging) wherever UCX's active messages go, shared memory (sysv
    or posix) or tcp (in one segment: kvengine sizes UCX's tcp segments for it; in 8 KiB
    fragments where UCX_TCP_TX_SEG_SIZE says so, as UCX's default has it), and rendezvous
    only where a shared-memory AM lane has a zero-copy lane beside it (sm includes cma: the
    target reads it from the pusher's memory into staging; a small staged one with
    nothing else of its link in progress is landed by the I/O thread). Either way
    byte-exact, only inside the registered range, and the target counts its staged
    receives (ucx_rx_staged)."""
    monkeypatch.setenv("KVENGINE_UCX_PEER_ERRORS", peer_errors)
    if seg:
        monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", seg)
    a, b, _ = _pair(tls, monkeypatch)
    try:
        n = 1 << 16
        src = np.random.default_rng(3).integers(0, 256, n, np.uint8)
        arena = np.full(3 * n, 0xAB, np.uint8)
        dst = arena[n: 2 * n]
        dst[:] = 0
        st, rs = a.region_add(_native.REGION_LOCAL, 0, src.ctypes.data, n, _native.F_EXPORT)
        st2, rd = b.region_add(_native.REGION_LOCAL, 0, dst.ctypes.data, n, _native.F_EXPORT)
        assert st == st2 == 0 and a.ucx_mem_map(rs) == 0 and b.ucx_mem_map(rd) == 0
        st, rr = a.region_add(_native.REGION_UCX, 1, rd, n, 0)
        assert st == 0
        for k in range(3):
            src[:8] = k
            st, done, _ = a.submit(20 + k, np.array([rs, 0, rr, 0, n], dtype=np.uint64), 0)
            assert st == 0
            (c,) = _wait(a)
            assert c[:3] == (20 + k, 0, n), c
            assert (dst == src).all() and (arena[:n] == 0xAB).all() and (arena[2 * n:] == 0xAB).all()
        assert b.stats()["ucx_rx_staged"] == (0 if eager else 3), b.stats()
        assert b.stats()["ucx_rx_pending"] == 0 and b.stats()["ucx_bad_msgs"] == 0
    finally:
        for c in (a, b):
            c.close()
            c.release()


async def test_forged_table_entry_drops_the_link():
    """A cache table entry of kind 'ucx' in the old rkey format ([base, len, rkey]) or
    with a bad region fails the link, registers nothing."""
    from kvengine.tables import CacheTables

    o = kv.EngineOptions(transport="ucx")
    p = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", o).start()
    d = await kv.KvEngine(2, kv.Role.DECODER, "127.0.0.1:0", o).start()
    real = CacheTables._describe

    def forged(link, state, core):
        msg, fds = real(link, state, core)
        msg["regions"] = [[r[0], r[1], "ff"] for r in msg["regions"]]   # an rkey: not taken any more
        return msg, fds
    try:
        d.allocate_cache(kv.CacheDesc(1, (1, 4096), np.uint8))
        CacheTables._describe = staticmethod(forged)  # type: ignore[method-assign]
        st, per = await p.link_clusters([kv.ClusterInfo(2, d.address)], timeout=5)
        assert st != S.LLM_SUCCESS
        assert p.stats()["native"]["regions_live"] == 0
    finally:
        CacheTables._describe = staticmethod(real)  # type: ignore[method-assign]
        await p.close()
        await d.close()


async def test_cancel_is_fenced(monkeypatch):
    """Cancelling a large push resolves only after its flush: the destination does not
    change after the status, and the link stays usable."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    o = kv.EngineOptions(transport="ucx")
    p = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", o).start()
    d = await kv.KvEngine(2, kv.Role.DECODER, "127.0.0.1:0", o).start()
    try:
        desc = kv.CacheDesc(2, (1, 64 << 20), np.uint8)
        src = p.allocate_cache(desc)
        for t in src.tensors:
            t[:] = 5
        dst = d.allocate_cache(desc)
        st, per = await p.link_clusters([kv.ClusterInfo(2, d.address)])
        assert st == S.LLM_SUCCESS, per
        await p.wait_remote_cache(2, dst.cache_id)
        t = p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), timeout=30)
        await asyncio.sleep(0.005)
        t.cancel()
        st = await t
        assert st in (S.LLM_CANCELLED, S.LLM_SUCCESS)
        before = [int(x.sum()) for x in dst.tensors]
        await asyncio.sleep(0.3)
        assert [int(x.sum()) for x in dst.tensors] == before
        assert p.stats()["native"]["jobs_live"] == 0
        assert await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), timeout=30) == S.LLM_SUCCESS
        assert all((x == 5).all() for x in dst.tensors)
    finally:
        await p.close()
        await d.close()


@pytest.mark.parametrize("tls", ["tcp", "sm,self", "tcp-nopeer", "tcp,cma-nopeer"])
async def test_peer_killed_link_failed_within_the_heartbeat_bound(tls, monkeypatch):
    """SIGKILL of the decode process with pushes and a pull in flight: every transfer
    resolves (LLM_LINK_FAILED, or LLM_SUCCESS for what had completed) within
    heartbeat_timeout + heartbeat_interval + 1 s of the kill, none hangs, and no job
    is left in the core."""
    import time
    from kvengine._peer import PeerProcess
    if tls.endswith("-nopeer"):   # KVENGINE_UCX_PEER_ERRORS=0: the control channel reports the death
        tls = tls[: -len("-nopeer")]
        monkeypatch.setenv("KVENGINE_UCX_PEER_ERRORS", "0")
    monkeypatch.setenv("UCX_TLS", tls)
    opts = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}
    p = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0",
                          kv.EngineOptions(transport="ucx", secret=b"s", **opts)).start()
    d = await PeerProcess.start(cluster_id=2, secret=b"s", transport="ucx", options=opts)
    try:
        desc = kv.CacheDesc(2, (1, 32 << 20), np.uint8)
        dst = (await d.call("alloc", n=2, shape=[1, 32 << 20], dtype="uint8"))["cache_id"]
        st, per = await p.link_clusters([kv.ClusterInfo(2, d.address)])
        assert st == S.LLM_SUCCESS, per
        await p.wait_remote_cache(2, dst)
        src = p.allocate_cache(desc)
        mine = p.allocate_cache(desc)
        ts = [p.submit_push_kv_cache(src, kv.CacheIndex(2, dst, 0), timeout=30) for _ in range(8)]
        ts.append(p.submit_pull_kv_cache(kv.CacheIndex(2, dst, 0), mine, timeout=30))
        d.kill()
        t0 = time.monotonic()
        statuses = await asyncio.wait_for(asyncio.gather(*ts), 10)
        took = time.monotonic() - t0
        assert set(statuses) <= {S.LLM_SUCCESS, S.LLM_LINK_FAILED} and S.LLM_LINK_FAILED in statuses
        assert took <= 1.0 + 0.2 + 1.0, took
        assert p.stats()["native"]["jobs_live"] == 0
    finally:
        await p.close()
        await d.close()


_RNDV_PROBE = r"""
import numpy as np, secrets, time
from kvengine.native import _native
a, b = _native.Core(), _native.Core()
ta, tb = secrets.token_bytes(_native.UCX_TOKEN), secrets.token_bytes(_native.UCX_TOKEN)
assert a.ucx_link_add(1, b.ucx_address()[1], ta, tb, 0, 1.0) == 0
assert b.ucx_link_add(1, a.ucx_address()[1], tb, ta, 0, 1.0) == 0
src, dst = np.full(1 << 20, 7, np.uint8), np.zeros(1 << 20, np.uint8)
_, rs = a.region_add(_native.REGION_LOCAL, 0, src.ctypes.data, src.nbytes, _native.F_EXPORT)
_, rd = b.region_add(_native.REGION_LOCAL, 0, dst.ctypes.data, dst.nbytes, _native.F_EXPORT)
assert a.ucx_mem_map(rs) == 0 and b.ucx_mem_map(rd) == 0
_, rr = a.region_add(_native.REGION_UCX, 1, rd, dst.nbytes, 0)
st, done, _ = a.submit(11, np.array([rs, 0, rr, 0, dst.nbytes], dtype=np.uint64), 0)
out, end = [], time.monotonic() + 10
while not out and time.monotonic() < end:
    out += a.poll()
    time.sleep(0.002)
assert out and out[0][:3] == (11, 0, dst.nbytes) and (dst == 7).all(), out
for c in (a, b):
    c.close()
    c.release()
"""


@pytest.mark.parametrize("tls,peer_errors", [("tcp", "1"), ("tcp", "0"), ("tcp,self", "0"), ("tcp,cma", "0")])
def test_peer_errors_off_gives_zero_copy_rendezvous(tls, peer_errors, monkeypatch):
    """KVENGINE_UCX_PEER_ERRORS=0: endpoints without UCX's error handling, and over UCX's
    tcp transport alone our rendezvous is a zero-copy write into the receiver's staging
    (a put: kvengine asks UCX for it, UCX_RNDV_SCHEME=put_zcopy, since UCX 1.22 picks copied
    fragments by itself on one tcp device, lo here: decisions.md #34); with error handling
    (the default) UCX cannot, and the payload goes as active-message fragments over the
    tcp lane (zero-copy fragments with kvengine's 72 KiB tcp segments). With cma beside
    tcp the scheme is UCX's own: the target reads the payload (cma). The push lands either
    way."""
    import os
    import subprocess
    import sys
    monkeypatch.delenv("UCX_RNDV_SCHEME", raising=False)
    env = dict(os.environ, UCX_TLS=tls, UCX_PROTO_INFO="y", KVENGINE_UCX_PEER_ERRORS=peer_errors)
    r = subprocess.run([sys.executable, "-c", _RNDV_PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    at = [i for i, s in enumerate(lines) if "ucp_am_send*(rndv)" in s]
    assert at, r.stderr[-2000:]
    table = "\n".join(lines[at[0]: at[0] + 8])
    big = [s for s in table.splitlines() if "..inf" in s]
    assert big, table
    if tls == "tcp,cma":
        assert "read from remote" in big[0] and "cma" in big[0], table
    elif peer_errors == "0":
        assert "zero-copy" in big[0] and "write to remote" in big[0], table
    else:
        assert "write to remote" not in big[0] and "tcp/lo" in big[0], table
