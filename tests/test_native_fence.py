"""The native pieces of the fence, through the Cython binding (kvengine._native.Core):
the TCP lease durations of tcp_link_add, the new counters, one listener per core,
and CMA guarded by a pidfd (Core.region_pidfd). The protocol itself (leases,
fence, release, bad answers) is checked frame by frame by tests/native/fuzz_tcp.c
(tests/test_native_c.py); the engine-level fence by tests/test_fencing.py.
"""

import os
import select
import socket
import time

import numpy as np
import pytest

from kvengine import _native
from kvengine.status import LLMStatusCode as S


@pytest.fixture
def core():
    c = _native.Core(movers=1, chunk_bytes=1 << 16)
    yield c
    c.close()


def test_stats_carry_the_fence_counters(core):
    st = core.stats()
    for k in ("tcp_lease_expired", "tcp_fence_expired", "tcp_stalled", "tcp_accept_paused"):
        assert st[k] == 0, k


def test_tcp_link_add_checks_the_durations(core):
    tok = os.urandom(_native.TOKEN_BYTES)
    assert core.tcp_link_add(1, tok, 1, 0, lease=0.0) == S.LLM_PARAM_INVALID      # under 1 ms
    assert core.tcp_link_add(1, tok, 1, 0, fence=0.0) == S.LLM_PARAM_INVALID
    assert core.tcp_link_add(1, tok, 1, 0, margin=-1.0) == S.LLM_PARAM_INVALID
    assert core.tcp_link_add(1, tok, 1, 0, lease=7200.0) == S.LLM_PARAM_INVALID   # over 1 h
    assert core.tcp_link_add(1, tok, 1, 0, lease=0.4, fence=0.5, margin=0.05) == S.LLM_SUCCESS
    assert core.tcp_link_add(2, tok, 1) == S.LLM_SUCCESS                          # the defaults


def test_one_listener_per_core(core):
    st, port = core.tcp_listen("127.0.0.1", 0)
    assert st == S.LLM_SUCCESS and port
    fds = len(os.listdir("/proc/self/fd"))
    assert core.tcp_listen("127.0.0.1", 0) == (S.LLM_PARAM_INVALID, 0)
    assert len(os.listdir("/proc/self/fd")) == fds                               # nothing leaked
    with socket.create_connection(("127.0.0.1", port), timeout=5):               # the first one serves
        pass


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="os.pidfd_open (Linux 5.3, Python 3.9)")
def test_cma_stops_once_the_pidfd_process_exited(core):
    """The region names a pid (ours, standing for a process that reused the pid of
    one that exited) and the pidfd of the process it meant (a child, exited and
    reaped): the push fails LLM_LINK_FAILED and writes nothing."""
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.full(1 << 16, 0x5A, dtype=np.uint8)
    st, rs = core.region_add(_native.REGION_LOCAL, 0, src.ctypes.data, src.nbytes)
    assert st == 0
    st, rd = core.region_add(_native.REGION_PROCESS, os.getpid(), dst.ctypes.data, dst.nbytes)
    assert st == 0
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    pidfd = os.pidfd_open(pid)
    try:
        os.waitpid(pid, 0)
        assert core.region_pidfd(rs, pidfd) == S.LLM_PARAM_INVALID    # a local region has no pid
        assert core.region_pidfd(rd, pidfd) == S.LLM_SUCCESS
        assert core.region_pidfd(rd, pidfd) == S.LLM_PARAM_INVALID    # once
    finally:
        os.close(pidfd)                                                # the core keeps its own
    segs = np.array([rs, 0, rd, 0, src.nbytes], dtype=np.uint64)
    st, done, nbytes = core.submit(1, segs, 1 << 20)   # CMA is never inline (decisions.md #31)
    assert (st, done, nbytes) == (_native.INLINE_REFUSED, False, 0)
    assert core.submit(1, segs, 0) == (S.LLM_SUCCESS, False, 0)        # the movers take it
    end = time.monotonic() + 10
    got: list = []
    while not got and time.monotonic() < end:
        select.select([core.fileno()], [], [], 0.5)
        got = core.poll()
    assert [(j, st) for j, st, _, _ in got] == [(1, S.LLM_LINK_FAILED)]
    assert got[0][2] == 0
    assert (dst == 0x5A).all()
