"""kvengine.sync: the engine for threads. Plain (non-async) tests: every call here
comes from a thread that runs no event loop, as in a model runner."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import kvengine as kv
from kvengine import LLMStatusCode as S
from kvengine.sync import SyncKvEngine, TransferFuture

THREADS, PUSHES = 8, 1000


def announced(pusher, cache):
    """A cache made after linking reaches the peer asynchronously: wait for it."""
    pusher.wait_remote_cache(2, cache.cache_id, timeout=10)
    return cache


@pytest.fixture(params=["local", "shm", "tcp"])
def sync_pair(request):
    o = kv.EngineOptions(transport=request.param)
    with SyncKvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", o) as p, \
            SyncKvEngine(2, kv.Role.DECODER, "127.0.0.1:0", o) as d:
        st, per = p.link_clusters([kv.ClusterInfo(2, d.address)])
        assert st == S.LLM_SUCCESS, per
        yield p, d


def test_runs_on_its_own_uvloop_thread():
    with SyncKvEngine(1) as e:
        assert e.loop_name == "uvloop"
        assert e._thread.daemon and e._thread.is_alive()
        assert e._thread is not threading.current_thread()
    assert not e._thread.is_alive() and e.closed


@pytest.mark.parametrize("sync_pair", ["local", "shm"], indirect=True)
def test_8_threads_x_1000_pushes_byte_exact(sync_pair):
    p, d = sync_pair
    rows, row = THREADS * PUSHES, 512
    desc = kv.CacheDesc(2, (rows, row), np.uint8)
    src = p.register_kv_cache(desc, [np.random.default_rng(i).integers(0, 256, (rows, row), np.uint8)
                                     for i in range(2)])
    dst = announced(p, d.allocate_cache(desc))
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS)

    def worker(t: int) -> None:
        try:
            barrier.wait()
            pending: list[TransferFuture] = []
            for i in range(t * PUSHES, (t + 1) * PUSHES):
                # reversed rows: a push landing in the wrong row cannot go unnoticed
                idx = kv.CacheIndex(2, dst.cache_id, rows - 1 - i)
                if t % 2:
                    assert p.push_kv_cache(src, idx, i, timeout=30) == S.LLM_SUCCESS
                else:
                    pending.append(p.submit_push_kv_cache(src, idx, i, timeout=30))
            for f in pending:
                assert f.result() == S.LLM_SUCCESS, f.message()
        except BaseException as e:   # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    for s, x in zip(src.tensors, dst.tensors):
        assert np.array_equal(x, s[::-1])
    assert p.stats()["by_status"]["LLM_SUCCESS"] == rows


def test_errors_are_the_async_apis(sync_pair):
    p, d = sync_pair
    desc = kv.CacheDesc(2, (4, 64), np.uint8)
    src = p.allocate_cache(desc)
    dst = announced(p, d.allocate_cache(desc))
    with pytest.raises(kv.LLMKvCacheNotExistError):
        p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id + 100, 0))
    with pytest.raises(kv.LLMParamInvalidError, match="batch"):
        p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 9))
    with pytest.raises(kv.LLMNotYetLinkError):
        p.pull_kv_cache(kv.CacheIndex(7, 1, 0), src)
    with pytest.raises(kv.LLMParamInvalidError):
        p.register_kv_cache(desc, [bytearray(3), bytearray(3)])
    f = p.submit_push_kv_blocks(src, kv.BlocksCacheKey(2, dst.cache_id), [0], [9])
    assert f.result(5) == S.LLM_PARAM_INVALID and "block" in f.message()
    with pytest.raises(kv.LLMTimeoutError):
        d.wait_notification(b"never", timeout=0.05)
    with pytest.raises(kv.LLMTimeoutError):
        p.wait_remote_cache(2, 999, timeout=0.05)


def test_blocking_call_on_the_loop_thread_says_so(sync_pair):
    p, _ = sync_pair
    got: concurrent.futures.Future[BaseException] = concurrent.futures.Future()

    def on_loop() -> None:
        try:
            p.stats()
        except BaseException as e:
            got.set_result(e)
    p.loop.call_soon_threadsafe(on_loop)
    e = got.result(5)
    assert isinstance(e, kv.LLMFailedError) and "own event-loop thread" in str(e)


def test_pull_blocks_notifications_and_unregister(sync_pair):
    p, d = sync_pair
    desc = kv.CacheDesc(2, (8, 256), np.uint8)
    src = p.allocate_cache(desc)
    for i, t in enumerate(src.tensors):
        t[:] = np.arange(8 * 256, dtype=np.uint32).reshape(8, 256) * (i + 3) % 251
    dst = announced(p, d.allocate_cache_async(desc).result(10))
    p.push_kv_blocks(src, kv.BlocksCacheKey(2, dst.cache_id), [0, 1, 2], [5, 6, 7], notify=b"req-1")
    note = d.wait_notification(b"req-1", timeout=5)
    assert note.cluster_id == 1 and note.payload == b"req-1"
    for s, x in zip(src.tensors, dst.tensors):
        assert np.array_equal(x[5:8], s[0:3])
    back = p.allocate_cache(desc)
    assert p.pull_kv_blocks(kv.BlocksCacheKey(2, dst.cache_id), back, [5], [4]) == S.LLM_SUCCESS
    assert p.pull_kv_cache(kv.CacheIndex(2, dst.cache_id, 6), back, 3) == S.LLM_SUCCESS
    for s, x in zip(src.tensors, back.tensors):
        assert np.array_equal(x[4], s[0]) and np.array_equal(x[3], s[1])
    assert d.unregister_kv_cache(dst.cache_id).result(10) is None
    with pytest.raises(kv.LLMKvCacheNotExistError):
        p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0))


def test_layer_ready_from_many_threads(sync_pair):
    p, d = sync_pair
    layers = 16
    desc = kv.CacheDesc(2 * layers, (2, 1024), np.uint8)
    src = p.allocate_cache(desc)
    for i, t in enumerate(src.tensors):
        t[:] = i + 1
    dst = announced(p, d.allocate_cache(desc))
    stream = p.layer_stream(src, [kv.CacheIndex(2, dst.cache_id, 1)], src_batch_index=0, timeout=10,
                            notify=b"done")
    assert stream.num_layers == layers
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(stream.layer_ready, reversed(range(layers))))
    assert stream.wait(10) == [S.LLM_SUCCESS]
    assert stream.statuses() == [S.LLM_SUCCESS]
    with pytest.raises(kv.LLMParamInvalidError):
        stream.layer_ready(0)
    d.wait_notification(b"done", timeout=5)
    for i, t in enumerate(dst.tensors):
        assert (t[1] == i + 1).all() and (t[0] == 0).all()


def test_notifications_iterator_ends_at_close():
    o = kv.EngineOptions(transport="local")
    p = SyncKvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", o)
    d = SyncKvEngine(2, kv.Role.DECODER, "127.0.0.1:0", o)
    try:
        p.link_clusters([kv.ClusterInfo(2, d.address)])
        desc = kv.CacheDesc(1, (2, 64), np.uint8)
        src, dst = p.allocate_cache(desc), announced(p, d.allocate_cache(desc))
        got: list[bytes] = []

        def reader() -> None:
            for note in d.notifications():
                got.append(note.payload)
        t = threading.Thread(target=reader)
        t.start()
        for i in range(3):
            p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0), notify=b"n%d" % i)
        deadline = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        d.close()
        t.join(10)
        assert not t.is_alive() and got == [b"n0", b"n1", b"n2"]
    finally:
        p.close()
        d.close()


def test_close_is_idempotent_and_later_calls_say_finalized():
    e = SyncKvEngine(1, listen="127.0.0.1:0")
    cache = e.allocate_cache(kv.CacheDesc(1, (2, 8), np.uint8))
    e.close()
    e.close()
    assert e.closed and not e._thread.is_alive() and e.loop.is_closed()
    with pytest.raises(kv.LLMEngineFinalizedError):
        e.link_clusters([kv.ClusterInfo(2, "127.0.0.1:1")])
    with pytest.raises(kv.LLMEngineFinalizedError):
        e.push_kv_cache(cache, kv.CacheIndex(2, 1, 0))
    f = e.submit_pull_kv_cache(kv.CacheIndex(2, 1, 0), cache)
    assert f.result(1) == S.LLM_ENGINE_FINALIZED and f.message()
    assert isinstance(e.stats(), dict)


def test_start_failure_raises_and_stops_the_thread():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        before = set(threading.enumerate())
        with pytest.raises(kv.LLMLinkFailedError, match="cannot listen"):
            SyncKvEngine(1, listen=f"127.0.0.1:{s.getsockname()[1]}")
        assert not {t for t in threading.enumerate() if t.name.startswith("kvengine")} - before
    finally:
        s.close()
    with pytest.raises(kv.LLMParamInvalidError):
        SyncKvEngine(-1)


def test_transfer_future_cancel_resolves_cancelled(sync_pair):
    p, d = sync_pair
    desc = kv.CacheDesc(2, (2, 4 << 20), np.uint8)   # beyond the inline threshold: queued, cancellable
    src, dst = p.allocate_cache(desc), announced(p, d.allocate_cache(desc))
    futs = [p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, i % 2), i % 2, timeout=30)
            for i in range(8)]
    for f in futs:
        f.cancel()
    got = {f.result(30) for f in futs}
    assert got <= {S.LLM_SUCCESS, S.LLM_CANCELLED}
    assert all(not f.cancelled() for f in futs)


EXIT_WITHOUT_CLOSE = textwrap.dedent("""
    import numpy as np, kvengine as kv
    from kvengine.sync import SyncKvEngine
    o = kv.EngineOptions(transport="{transport}")
    p = SyncKvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", o)
    d = SyncKvEngine(2, kv.Role.DECODER, "127.0.0.1:0", o)
    p.link_clusters([kv.ClusterInfo(2, d.address)])
    desc = kv.CacheDesc(2, (4, 1 << 20), np.uint8)
    src, dst = p.allocate_cache(desc), d.allocate_cache(desc)
    p.wait_remote_cache(2, dst.cache_id, timeout=10)
    p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0))
    futs = [p.submit_push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, i % 4), i % 4, timeout=60)
            for i in range(32)]   # some still in flight at exit
    print("pushed", flush=True)
    {ending}
""")


@pytest.mark.parametrize("transport,ending", [("shm", ""), ("tcp", ""), ("shm", "del p, d"),
                                               ("tcp", "import sys; sys.exit(3)")])
def test_exit_without_close_does_not_hang(transport, ending):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), KVENGINE_SECRET="exit-test")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE.format(transport=transport, ending=ending)],
                       capture_output=True, text=True, timeout=30, env=env)
    took = time.monotonic() - t0
    assert r.stdout.strip() == "pushed", r.stderr
    assert r.returncode == (3 if "exit(3)" in ending else 0), r.stderr
    assert "Traceback" not in r.stderr and "Fatal" not in r.stderr, r.stderr
    assert took < 15, took
