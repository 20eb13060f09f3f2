"""The native fast path of awaited inline pushes and pulls (_native.FastPath, cython_src/_fast.pxi)
and the native accounting (_native.Counts, _native.Histogram): the fast path takes only the
common case the Planner memoized, answers it exactly as the Python path does (bytes, status,
stats), and leaves everything else to the Python path with its rules and messages."""

import asyncio
import math
import random

import numpy as np
import pytest

import kvengine as kv
from kvengine import plan
from kvengine.native import _native
from kvengine.stats import Accounting

from conftest import filled, link, make_pair

S = kv.LLMStatusCode
HALF = 4096
LAUNCHED = ("tcp", "ucx")   # transports whose transfers the fast path hands to the scheduler
DRIVEN = ("tcp", "ucx")   # ...except small pushes the loop thread drives itself (taken; launched if handed back)


@pytest.fixture(params=["local", "shm", "tcp", "ucx"])
def transport(request):
    if request.param == "ucx" and not _native.UCX:
        pytest.skip("kvengine built without UCX: pip install 'kvengine[ucx]' (libucx-cu12), then rebuild")
    return request.param


async def _setup(transport):
    p, d = await make_pair(transport)
    await link(p, d)
    desc = kv.CacheDesc(8, (2, HALF), np.uint8)
    src = filled(p.allocate_cache(desc), 7)
    dst = d.allocate_cache(desc)
    await p.wait_remote_cache(2, dst.cache_id)
    return p, d, src, dst


def _stats_without_clock(st):
    """An engine's stats with the latency figures reduced to their counts."""
    def strip(lat):
        return {k: v["count"] for k, v in lat.items()}
    return {"transfers": st["transfers"], "bytes": st["bytes"], "by_status": st["by_status"],
            "latency": strip(st["latency"]),
            "peers": {k: {**v, "latency": strip(v["latency"])} for k, v in st["peers"].items()}}


async def test_fast_path_runs_the_memoized_common_case_and_accounts_like_the_python_path(transport):
    p, d, src, dst = await _setup(transport)
    try:
        fast = p._p.fast
        exts = [kv.KvCacheExtParam((i, i), (i, i), 2) for i in range(4)]
        idx = kv.CacheIndex(2, dst.cache_id, 1)
        for i in range(12):
            assert await p.push_kv_cache(src, idx, 0, ext_param=exts[i % 4], timeout=5) == S.LLM_SUCCESS
        for t in range(8):
            np.testing.assert_array_equal(dst.tensors[t][1], src.tensors[t][0])
        # the first push of each shape plans it (Python); the rest run natively, inline only;
        # over tcp and ucx the loop thread drives them (decisions.md #33, #35), unless one is
        # handed back to the I/O thread and the scheduler (launched)
        if transport in DRIVEN:
            assert fast.taken + fast.launched == 8 and fast.taken >= 1, (fast.taken, fast.launched)
        else:
            assert fast.taken == (8 if transport not in LAUNCHED else 0)
            assert fast.launched == (8 if transport in LAUNCHED else 0)
        # the same pushes through the Python path: the same counters
        p2, d2, src2, dst2 = await _setup(transport)
        try:
            idx2 = kv.CacheIndex(2, dst2.cache_id, 1)
            for i in range(12):
                st = await p2.submit_push_kv_cache(src2, idx2, 0, ext_param=exts[i % 4], timeout=5)._result()
                assert st == S.LLM_SUCCESS
            assert p2._p.fast.taken == 0 and p2._p.fast.launched == 0
            assert _stats_without_clock(p.stats()) == _stats_without_clock(p2.stats())
            def series(text):   # the metrics' names and labels (bucket edges and sums vary with time)
                return sorted(line.rsplit(" ", 1)[0] for line in text.splitlines()
                              if "_bucket" not in line and "_sum" not in line)
            assert series(p.metrics_text()) == series(p2.metrics_text())
        finally:
            await p2.close()
            await d2.close()
        # pulls too (row 1 of the peer into row 1 here), and a whole-row pull with a size
        before, launched = fast.taken, fast.launched
        for _ in range(3):
            assert await p.pull_kv_cache(idx, src, 1, size=HALF // 2, timeout=5) == S.LLM_SUCCESS
        for t in range(8):
            np.testing.assert_array_equal(src.tensors[t][1][:HALF // 2], dst.tensors[t][1][:HALF // 2])
        assert fast.taken == before + (2 if transport not in LAUNCHED else 0)
        assert fast.launched == launched + (2 if transport in LAUNCHED else 0)
    finally:
        await p.close()
        await d.close()


@pytest.mark.parametrize("transport", ["local", "tcp", "ucx"], indirect=True)
async def test_fast_path_leaves_every_unusual_call_to_the_python_path(transport):
    p, d, src, dst = await _setup(transport)
    try:
        fast = p._p.fast
        ran = lambda: fast.taken + fast.launched   # inline runs (local), launches (tcp, ucx)
        ext = kv.KvCacheExtParam((0, 0), (0, 0), 2)
        idx = kv.CacheIndex(2, dst.cache_id, 0)
        await p.push_kv_cache(src, idx, 0, ext_param=ext)
        await p.push_kv_cache(src, idx, 0, ext_param=ext)
        taken = ran()
        assert taken == 1
        bad = [dict(priority=True), dict(priority=1001), dict(timeout=math.inf), dict(timeout=0),
               dict(timeout=True), dict(size=0), dict(notify=12)]
        for kw in bad:
            with pytest.raises(kv.LLMParamInvalidError):
                await p.push_kv_cache(src, idx, 0, ext_param=ext, **kw)
        with pytest.raises(kv.LLMParamInvalidError):
            await p.push_kv_cache(src, idx, True, ext_param=ext)
        # the same layer ranges with a head range: rows refuse it every time, memoized or not
        before = dst.tensors[0].copy()
        for heads in (dict(src_head_range=(0, 0)), dict(dst_head_range=range(1))):
            with pytest.raises(kv.LLMParamInvalidError, match="head ranges apply to block transfers"):
                await p.push_kv_cache(src, idx, 1, ext_param=kv.KvCacheExtParam((0, 0), (0, 0), 2, **heads))
        np.testing.assert_array_equal(dst.tensors[0], before)
        with pytest.raises(kv.LLMKvCacheNotExistError):
            await p.push_kv_cache(src, kv.CacheIndex(2, 999, 0), 0, ext_param=ext, timeout=0.5)
        with pytest.raises(kv.LLMNotYetLinkError):
            await p.push_kv_cache(src, kv.CacheIndex(3, dst.cache_id, 0), 0, ext_param=ext)
        # valid, but not the fast path's: numpy ints, a notification, a priority, an int timeout
        assert await p.push_kv_cache(src, idx, np.int64(0), ext_param=ext) == S.LLM_SUCCESS
        assert await p.push_kv_cache(src, idx, 0, ext_param=kv.KvCacheExtParam((np.int64(0), 0), (0, 0), 2)) \
            == S.LLM_SUCCESS
        assert await p.push_kv_cache(src, idx, 0, ext_param=ext, notify=b"n") == S.LLM_SUCCESS
        assert ran() == taken
        assert await p.push_kv_cache(src, idx, 0, ext_param=ext, priority=5, timeout=3) == S.LLM_SUCCESS
        assert ran() == taken + 1
        # a cache unregistered here, or by the peer: the Python path says so
        other = p.allocate_cache(src.desc)
        await p.push_kv_cache(other, idx, 0, ext_param=ext)
        await p.unregister_kv_cache(other.cache_id)
        with pytest.raises(kv.LLMKvCacheNotExistError):
            await p.push_kv_cache(other, idx, 0, ext_param=ext)
        assert ran() == taken + 1
        # a transfer above the inline threshold is the scheduler's (tcp: launched as before)
        p.options.inline_threshold = 1024
        try:
            assert await p.push_kv_cache(src, idx, 0, ext_param=ext) == S.LLM_SUCCESS
            assert ran() == taken + 1 + (transport in LAUNCHED)
        finally:
            p.options.inline_threshold = 256 * 1024
        # closed: the Python path answers
        await p.close()
        with pytest.raises(kv.LLMEngineFinalizedError):
            await p.push_kv_cache(src, idx, 0, ext_param=ext)
    finally:
        await p.close()
        await d.close()


def test_memo_keys_hold_plain_values_only():
    ext = kv.KvCacheExtParam((0, 1), range(2, 4), 2)
    assert plan.memo_key(("pc", 1, 2, 0, 0, -1, ext)) == ("pc", 1, 2, 0, 0, -1, ((0, 1), range(2, 4), 2))
    assert plan.memo_key(("pc", 1, 2, 0, 0, -1, None)) == ("pc", 1, 2, 0, 0, -1, None)
    for bad in (("pc", 1, 2, True, 0, -1, None), ("pc", 1, 2, 0, np.int64(0), -1, None),
                ("pc", 1, 2, 0, 0, -1, kv.KvCacheExtParam((0, True), (0, 1), 2)),
                ("pc", 1, 2, 0, 0, -1, kv.KvCacheExtParam((0, 1), (0, 1), 2.0))):
        assert plan.memo_key(bad) is None


def _py_bucket(seconds):
    """The histogram's bucket rule as kvengine/stats.py had it in Python."""
    if seconds <= 1e-6:
        return 0
    m, e = math.frexp(seconds / 1e-6)
    i = 4 * (e - 1) + (1 if m <= 0.5946035575013605 else 2 if m <= 0.7071067811865476
                       else 3 if m <= 0.8408964152537145 else 4)
    if m == 0.5:
        i -= 1
    return min(i, 127)


def test_native_histogram_buckets_as_the_python_rule():
    rnd = random.Random(5)
    values = [0.0, -1.0, 1e-6, 2e-6, 4e-6, 1.5e-6, 1e-3, 0.5, 1e5] + \
        [rnd.random() * 10 ** rnd.uniform(-7, 2) for _ in range(20000)]
    h = _native.Histogram()
    want = [0] * 128
    for v in values:
        h.record(v)
        want[_py_bucket(v)] += 1
    assert h.counts == want and h.n == len(values)
    assert h.total == pytest.approx(sum(values))
    assert h.upper(0) == 1e-6 and h.upper(4) == pytest.approx(2e-6)
    assert h.quantile(0.5) == h.upper(next(i for i in range(128) if sum(want[:i + 1]) >= len(values) / 2))
    assert _native.Histogram().summary() == {"count": 0, "mean_s": 0.0, "p50_s": 0.0, "p90_s": 0.0, "p99_s": 0.0}


def test_counts_keep_the_order_statuses_first_occurred():
    a = Accounting()
    a.record(S.LLM_TIMEOUT, 0, (2, "tcp"), 1.0, 1.0)
    a.all._bench(3, 2e-6)   # three successes the way the fast path counts them
    a.record(S.LLM_SUCCESS, 10, (2, "tcp"), 1.0, 1.0)
    assert list(a.all.by_status.items()) == [("LLM_TIMEOUT", 1), ("LLM_SUCCESS", 4)]
    assert a.all.transfers == 5 and a.all.bytes == 3 * 65536 + 10
    assert a.all.hists["total"].n == 5 and a.peers[(2, "tcp")].hists["total"].n == 2
    b = Accounting()
    b.all._bench(2, 2e-6)
    b.record(S.LLM_CANCELLED, 0, None, 0.0, 0.0)
    assert list(b.all.by_status.items()) == [("LLM_SUCCESS", 2), ("LLM_CANCELLED", 1)]
    assert b.all.summary()["by_status"] == {"LLM_SUCCESS": 2, "LLM_CANCELLED": 1}


async def test_a_small_push_into_registered_memory_goes_to_a_mover_and_its_completion_is_taken_natively():
    """Same host, a peer's registered (caller-owned) cache is reached with CMA, which never
    runs on the loop thread (decisions.md #31): the fast path hands the copy to a mover, waits
    for it at most 200 us and takes its completion out of the core's queue itself
    (kv_core_take), or else has the scheduler adopt the job. Bytes and stats as the Python
    path's; and a large push in flight meanwhile still completes: taking one completion
    does not swallow the eventfd's signal for the others."""
    p, d = await make_pair("shm")
    try:
        await link(p, d)
        desc = kv.CacheDesc(8, (2, HALF), np.uint8)
        src = filled(p.allocate_cache(desc), 7)
        dst = d.register_kv_cache(desc, [np.zeros((2, HALF), np.uint8) for _ in range(8)])
        big_desc = kv.CacheDesc(2, (1, 64 << 20), np.uint8)
        big_src = filled(p.allocate_cache(big_desc), 3)
        big_dst = d.register_kv_cache(big_desc, [np.zeros((1, 64 << 20), np.uint8) for _ in range(2)])
        for c in (dst, big_dst):
            await p.wait_remote_cache(2, c.cache_id)
        fast = p._p.fast
        exts = [kv.KvCacheExtParam((i, i), (i, i), 2) for i in range(4)]
        idx = kv.CacheIndex(2, dst.cache_id, 1)
        for e in exts:   # planned (and memoized) by the Python path
            assert await p.push_kv_cache(src, idx, 0, ext_param=e, timeout=5) == S.LLM_SUCCESS
        before = p.stats()["transfers"]
        taken, launched = fast.taken, fast.launched
        big = p.submit_push_kv_cache(big_src, kv.CacheIndex(2, big_dst.cache_id, 0), timeout=60)
        n = 0
        async with asyncio.timeout(60):   # a lost wake-up would leave the big push unreported
            while not big.done() or n < 200:
                layer = (2 * (n % 4), 2 * (n % 4) + 1)   # K and V of that layer
                for t in layer:
                    dst.tensors[t][1] = 0
                assert await p.push_kv_cache(src, idx, 0, ext_param=exts[n % 4], timeout=5) == S.LLM_SUCCESS
                for t in layer:
                    np.testing.assert_array_equal(dst.tensors[t][1], src.tensors[t][0])
                n += 1
                await asyncio.sleep(0)   # a fast-path push returns without yielding: let the loop read
        assert big.status == S.LLM_SUCCESS, big.message()
        for t in range(2):
            np.testing.assert_array_equal(big_dst.tensors[t], big_src.tensors[t])
        assert fast.taken + fast.launched == taken + launched + n   # every small push: the fast path's
        assert fast.taken > taken, "no completion was taken natively"
        assert p.stats()["transfers"] == before + n + 1
    finally:
        await p.close()
        await d.close()
