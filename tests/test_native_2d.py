"""2-D (strided) segments through the Cython binding: ``Core.submit(..., words=SEG2_WORDS)``.

A 2-D segment is (src_region, src_offset, dst_region, dst_offset, row_bytes, rows,
src_stride, dst_stride). These tests drive kvengine._native.Core directly (no engine):
the rules checked at submit (nothing moves on a refusal), local copies inline and by the
movers, and two cores linked over TCP on 127.0.0.1 (pushes carried natively as DATAV
frames, pulls as READs of rows), each checked byte for byte against a numpy model,
guard bytes included. The C-level checks (overflow, CMA, abort) are in
tests/native/test_kv_core.c.
"""

import secrets
import select
import socket
import time

import numpy as np
import pytest

from kvengine import _native
from kvengine.status import LLMStatusCode as S

W = _native.SEG2_WORDS
GUARD = 0x5A


def test_segment_word_counts_are_exported():
    assert _native.SEG_WORDS == 5
    assert _native.SEG2_WORDS == 8


@pytest.fixture
def core():
    c = _native.Core(movers=2, chunk_bytes=1 << 16)
    yield c
    c.close()


def _region(core, arr, flags=0):
    st, rid = core.region_add(_native.REGION_LOCAL, 0, arr.ctypes.data, arr.nbytes, flags)
    assert st == S.LLM_SUCCESS
    return rid


def _model(dst, src, segs):
    """What the 2-D segments must leave in dst (a numpy uint8 copy of it before)."""
    for s in segs:
        _, so, _, do, row, rows, ss, ds = s
        for r in range(rows):
            dst[do + r * ds:do + r * ds + row] = src[so + r * ss:so + r * ss + row]
    return dst


def _wait(core, job_id, timeout=10.0):
    """The completion of job_id: (status, nbytes), waiting on the core's eventfd."""
    end = time.monotonic() + timeout
    while True:
        for jid, st, nb, _flags in core.poll():
            if jid == job_id:
                return st, nb
        left = end - time.monotonic()
        assert left > 0, f"no completion for job {job_id}"
        select.select([core.fileno()], [], [], left)


def _segs(rows):
    return np.array(rows, dtype=np.uint64).reshape(-1)


def test_local_2d_copies_inline_and_by_movers(core):
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.full(1 << 20, GUARD, dtype=np.uint8)
    rs, rd = _region(core, src), _region(core, dst)
    shapes = [(rs, 3, rd, 1, 100, 1000, 300, 257),          # many short rows, gaps
              (rs, 0, rd, 300_000, 40_000, 5, 50_000, 41_000),  # rows over a chunk
              (rs, 11, rd, 600_000, 1, 3000, 3, 2)]           # one-byte rows
    for job, inline_max in ((1, 1 << 30), (2, 0)):
        dst[:] = GUARD
        want = _model(dst.copy(), src, shapes)
        st, done, nb = core.submit(job, _segs(shapes), inline_max, words=W)
        assert st == S.LLM_SUCCESS
        total = sum(s[4] * s[5] for s in shapes)
        if inline_max:
            assert done and nb == total
        else:
            assert not done
            assert _wait(core, job) == (S.LLM_SUCCESS, total)
        assert np.array_equal(dst, want)


@pytest.mark.parametrize("bad", [
    (0, 0, 64, 4, 63, 64),        # source rows overlap
    (0, 0, 64, 4, 64, 63),        # destination rows overlap
    (0, 0, 0, 4, 64, 64),         # empty rows
    (0, 0, 16, 0, 64, 64),        # no rows
    (0, 1, 1024, 64, 1024, 1024),  # one byte past the destination
    (0, 0, 8, 2, 2**64 - 1, 8),   # the stride overflows
    (0, 0, 8, 2**61 + 1, 8, 8),   # rows * stride wraps
])
def test_refused_2d_segments_move_nothing(core, bad):
    src = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)[:1 << 16]
    dst = np.full(1 << 16, GUARD, dtype=np.uint8)
    rs, rd = _region(core, src), _region(core, dst)
    so, do, row, rows, ss, ds = bad
    good = (rs, 0, rd, 0, 16, 2, 32, 32)
    segs = _segs([good, (rs, so, rd, do, row, rows, ss, ds)])
    st, done, nb = core.submit(9, segs, 1 << 30, words=W)
    assert st == S.LLM_PARAM_INVALID
    assert nb == 0
    assert (dst == GUARD).all()


def test_words_must_be_5_or_8_and_divide_the_buffer(core):
    src = np.zeros(4096, dtype=np.uint8)
    rs = _region(core, src)
    seg = _segs([(rs, 0, rs, 2048, 16, 2, 32, 32)])
    assert core.submit(1, seg, 1 << 30, words=6)[0] == S.LLM_PARAM_INVALID
    assert core.submit(1, seg[:7], 1 << 30, words=W)[0] == S.LLM_PARAM_INVALID
    assert core.submit(1, seg, 1 << 30, words=W)[0] == S.LLM_SUCCESS


def _linked_pair(chunk=256 << 10):
    """Core a listens and exports; core b connects two streams. Returns (a, b)."""
    a = _native.Core(movers=1, chunk_bytes=chunk)
    b = _native.Core(movers=1, chunk_bytes=chunk)
    st, port = a.tcp_listen("127.0.0.1", 0)
    assert st == S.LLM_SUCCESS
    tok = bytes(range(32))
    assert a.tcp_link_add(5, tok, 2) == S.LLM_SUCCESS
    assert b.tcp_link_add(5, tok, 2, 1 << 20) == S.LLM_SUCCESS
    for _ in range(2):
        s = socket.create_connection(("127.0.0.1", port))
        assert b.tcp_conn_add(s.detach(), 5) == S.LLM_SUCCESS
    assert _wait(b, _native.EVENT_LINK_READY | 5)[0] == S.LLM_SUCCESS
    return a, b


def test_tcp_2d_push_and_pull_land_byte_exact():
    a, b = _linked_pair()
    try:
        n = 4 << 20
        rng = np.random.default_rng(7)
        asrc = rng.integers(0, 256, n, dtype=np.uint8)
        adst = np.full(n, GUARD, dtype=np.uint8)
        bsrc = rng.integers(0, 256, n, dtype=np.uint8)
        bdst = np.full(n, GUARD, dtype=np.uint8)
        ra_dst = _region(a, adst, _native.F_EXPORT)
        ra_src = _region(a, asrc, _native.F_EXPORT)
        rb_src, rb_dst = _region(b, bsrc), _region(b, bdst)
        st, peer_dst = b.region_add(_native.REGION_TCP, 5, ra_dst, n)
        assert st == S.LLM_SUCCESS
        st, peer_src = b.region_add(_native.REGION_TCP, 5, ra_src, n)
        assert st == S.LLM_SUCCESS

        # 2-D push: head-split-like short rows, rows longer than a frame, one-byte rows
        push = [(rb_src, 5, peer_dst, 3, 256, 4000, 512, 300),
                (rb_src, 0, peer_dst, 2 << 20, 300 << 10, 5, 310 << 10, 301 << 10),
                (rb_src, 77, peer_dst, 3 << 20, 1, 5000, 3, 2)]
        want = _model(adst.copy(), bsrc, [(0, *s[1:2], 0, *s[3:]) for s in push])
        st, done, _ = b.submit(1, _segs(push), 0, words=W)
        assert (st, done) == (S.LLM_SUCCESS, False)
        assert _wait(b, 1) == (S.LLM_SUCCESS, sum(s[4] * s[5] for s in push))
        assert np.array_equal(adst, want)

        # many 1-D blocks (a paged push): several blocks a frame
        blocks = rng.permutation(n // 4096)[:512]
        segs1 = np.array([(rb_src, int(i) * 4096, peer_dst, k * 4096, 4096)
                          for k, i in enumerate(blocks)], dtype=np.uint64).reshape(-1)
        want = adst.copy()
        for k, i in enumerate(blocks):
            want[k * 4096:(k + 1) * 4096] = bsrc[int(i) * 4096:(int(i) + 1) * 4096]
        assert b.submit(2, segs1, 0)[0] == S.LLM_SUCCESS
        assert _wait(b, 2) == (S.LLM_SUCCESS, 512 * 4096)
        assert np.array_equal(adst, want)

        # 2-D pull (READs of rows: the peer announced READ2D)
        pull = [(peer_src, 9, rb_dst, 1, 1000, 300, 1500, 1200)]
        want = _model(bdst.copy(), asrc, [(0, 9, 0, 1, 1000, 300, 1500, 1200)])
        assert b.submit(3, _segs(pull), 0, words=W)[0] == S.LLM_SUCCESS
        assert _wait(b, 3) == (S.LLM_SUCCESS, 300_000)
        assert np.array_equal(bdst, want)

        # out of the peer's region: refused at submit, the link lives
        bad = [(rb_src, 0, peer_dst, n - 100, 100, 2, 100, 100)]
        assert b.submit(4, _segs(bad), 0, words=W)[0] == S.LLM_PARAM_INVALID
        assert a.stats()["tcp_bad_frames"] == 0
        assert b.stats()["tcp_links_failed"] == 0
    finally:
        b.close()
        a.close()


def test_tcp_frames_sent_in_pieces_land_byte_exact():
    """A push of at most 4 MiB goes out in frames of at most 512 KiB (kv_tcp.c,
    frame_bytes) and sendmsg calls of at most 256 KiB (send_max): a DATAV frame's
    gathered runs and a DATA frame's payload are cut mid-run between frames and
    between calls; every byte still lands in place, once, and nothing beside it."""
    a, b = _linked_pair(chunk=1 << 20)
    try:
        n = 4 << 20
        rng = np.random.default_rng(11)
        src = rng.integers(0, 256, n, dtype=np.uint8)
        dst = np.full(n, GUARD, dtype=np.uint8)
        ra_dst = _region(a, dst, _native.F_EXPORT)
        rb_src = _region(b, src)
        st, peer_dst = b.region_add(_native.REGION_TCP, 5, ra_dst, n)
        assert st == S.LLM_SUCCESS
        jid = 0
        # DATAV: runs of 300001 bytes (not a divisor of 256 KiB), gathered into 512 KiB
        # frames, apart on both sides or (even k) back to back at the destination
        rows = [(rb_src, 7 + k * 310_000, peer_dst, 11 + k * 300_001 + (k // 2) * 49, 300_001) for k in range(9)]
        # DATA: one contiguous run of 1 MiB + 5 bytes (two full frames and a tail)
        for segs in (rows, [(rb_src, 100, peer_dst, 2_800_011, (1 << 20) + 5)]):
            jid += 1
            want = dst.copy()
            for _, so, _, do, ln in segs:
                want[do:do + ln] = src[so:so + ln]
            assert b.submit(jid, np.array(segs, dtype=np.uint64).reshape(-1), 0)[0] == S.LLM_SUCCESS
            assert _wait(b, jid) == (S.LLM_SUCCESS, sum(x[4] for x in segs))
            assert np.array_equal(dst, want)
        assert a.stats()["tcp_bad_frames"] == 0
        assert b.stats()["tcp_links_failed"] == 0
    finally:
        b.close()
        a.close()


@pytest.mark.skipif(not _native.UCX, reason="kvengine built without UCX")
@pytest.mark.parametrize("pull2d", [True, False], ids=["pull-rows", "older-peer"])
def test_ucx_carries_2d_segments_in_row_messages(monkeypatch, pull2d):
    """UCX takes a push's 2-D segments whole: their rows go packed in PUSH2D messages of at
    most 256 KiB, which the target lands row by row (ucx_rx_rows counts them). A pull's
    rows are asked for in PULL_REQ2D messages of at most 256 KiB, which the source
    answers packed (ucx_row_pulls counts them), where the peer said it serves them;
    from an older peer (peer_pull2d False) they are expanded into rows at submit. All
    land byte for byte, the gaps between rows untouched."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    a, b = _native.Core(), _native.Core()
    try:
        sa, addr_a = a.ucx_address()
        sb, addr_b = b.ucx_address()
        assert sa == sb == S.LLM_SUCCESS
        ta, tb = secrets.token_bytes(_native.UCX_TOKEN), secrets.token_bytes(_native.UCX_TOKEN)
        assert a.ucx_link_add(1, addr_b, ta, tb, 0, 1.0, peer_pull2d=pull2d) == S.LLM_SUCCESS
        assert b.ucx_link_add(1, addr_a, tb, ta, 0, 1.0, peer_pull2d=pull2d) == S.LLM_SUCCESS
        rng = np.random.default_rng(3)
        src = rng.integers(0, 256, 1 << 18, dtype=np.uint8)
        back = np.full(1 << 18, GUARD, dtype=np.uint8)
        dst = np.full(1 << 18, GUARD, dtype=np.uint8)
        rs, rback = _region(a, src, _native.F_EXPORT), _region(a, back, _native.F_EXPORT)
        rd = _region(b, dst, _native.F_EXPORT)
        st, rr = a.region_add(_native.REGION_UCX, 1, rd, dst.nbytes, 0)   # b's region, as a names it
        assert st == S.LLM_SUCCESS
        push = [(rs, 5, rr, 3, 1000, 200, 1100, 1003)]
        want = _model(dst.copy(), src, [(0, 5, 0, 3, 1000, 200, 1100, 1003)])
        assert a.submit(1, _segs(push), 0, words=W)[0] == S.LLM_SUCCESS
        assert _wait(a, 1) == (S.LLM_SUCCESS, 200_000)
        assert np.array_equal(dst, want)
        assert b.stats()["ucx_rx_rows"] == 1   # 200 rows of 1000 bytes: one message (<= 256 KiB)
        # rows contiguous at the source go unpacked (zero copy, rendezvous), still PUSH2D;
        # rows contiguous at the target go as one plain PUSH of the packed rows
        for job, seg, rows2d in ((3, (rs, 9, rr, 5, 1000, 200, 1000, 1007), 2),
                                 (4, (rs, 11, rr, 7, 1000, 200, 1013, 1000), 2)):
            dst[:] = GUARD
            want = _model(dst.copy(), src, [(0,) + seg[1:2] + (0,) + seg[3:]])
            assert a.submit(job, _segs([seg]), 0, words=W)[0] == S.LLM_SUCCESS
            assert _wait(a, job) == (S.LLM_SUCCESS, 200_000)
            assert np.array_equal(dst, want)
            assert b.stats()["ucx_rx_rows"] == rows2d
        # pulls: rows apart at both ends (PULL_REQ2D: one each, the rows <= 256 KiB, also two
        # rows of nearly 128 KiB); rows back to back at the source (one PULL_REQ, scattered here)
        dst[:] = rng.integers(0, 256, dst.size, dtype=np.uint8)
        for job, seg, reqs2d in ((2, (rr, 3, rback, 7, 1000, 200, 1003, 1200), 1),
                                 (5, (rr, 1, rback, 2, 300, 600, 301, 400), 1),
                                 (6, (rr, 9, rback, 4, 1000, 200, 1000, 1300), 0),
                                 (7, (rr, 0, rback, 0, 130_000, 2, 130_001, 130_003), 1)):
            back[:] = GUARD
            want_back = _model(back.copy(), dst, [(0,) + seg[1:2] + (0,) + seg[3:]])
            before = a.stats()["ucx_row_pulls"]
            assert a.submit(job, _segs([seg]), 0, words=W)[0] == S.LLM_SUCCESS
            assert _wait(a, job) == (S.LLM_SUCCESS, seg[4] * seg[5])
            assert np.array_equal(back, want_back)
            assert a.stats()["ucx_row_pulls"] - before == (reqs2d if pull2d else 0)
    finally:
        a.close()
        b.close()
