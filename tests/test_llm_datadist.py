"""kvengine.compat.llm_datadist: LLM-DataDist-style programs in two processes
(tests/llm_datadist_programs.py), byte-checked, and the API's rules in this process."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

import kvengine as kv
from kvengine.compat import llm_datadist as ld
from kvengine.compat.llm_datadist import (CacheDesc, CacheKey, DataType, LLMConfig, LLMDataDist, LLMException,
                                          LLMRole, LLMStatusCode as S, Placement)

import llm_datadist_programs as prog
from ports import listen_port



def two(program: str, arg) -> dict:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    results = ctx.Queue()
    procs = [ctx.Process(target=prog.run, args=(program, role, conn, arg, results))
             for role, conn in (("p", a), ("d", b))]
    for p in procs:
        p.start()
    a.close()   # the children hold the ends now: one that dies ends the other's barrier (EOFError)
    b.close()
    out, errors = {}, []
    try:
        for _ in procs:
            role, kind, value = results.get(timeout=50)
            if kind == "error":
                errors.append(f"{role}: {value}")
            out[role] = value
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0, 0]
    return out


def expected(seed_base, n, shape):
    return [prog.pattern(shape, seed_base + i) for i in range(n)]


def test_push_cache_by_id_and_index():
    out = two("push_cache", listen_port(prog.IP))
    got, sent = out["p"], out["d"]
    for t in range(4):
        assert np.array_equal(got[t][0], sent[t][0])           # whole row 0 -> row 0
        assert (got[t][1] == 0).all()
    for t in (2, 3):                                            # layer 1 of row 1 -> layer 0 of row 2
        assert np.array_equal(got[t - 2][2], sent[t][1])
    assert (got[2][2] == 0).all() and (got[3][2] == 0).all()


def test_pull_cache_by_request_key():
    out = two("pull_cache_by_key", listen_port(prog.IP))
    src, dst = out["p"], out["d"]
    for s, d in zip(src, dst):
        assert np.array_equal(d[0], s[2]) and np.array_equal(d[3], s[0])
        # row 1: untouched, or the removed key's row if a pull ran before the removal arrived
        assert ((d[1] == 0).all() or np.array_equal(d[1], s[0])) and (d[2] == 0).all()


def test_push_blocks_pull_blocks_and_swap_blocks():
    out = two("blocks", listen_port(prog.IP))
    src = out["p"]
    got, swapped = out["d"]
    for t in range(4):
        assert np.array_equal(got[t][3:6], src[t][0:3])
    for t in range(4):   # pull_blocks: the peer's block 4 (its layers as pushed there: none) -> block 1
        assert np.array_equal(got[t][1], src[t][4])
    for t in (2, 3):     # layer 1 of block 5 -> layer 1 of block 0
        assert np.array_equal(got[t][0], src[t][5])
    for t in (0, 1):
        assert (got[t][0] == 0).all()
    for t, (host, back) in enumerate(swapped):
        assert np.array_equal(host, got[t][3:5]) and np.array_equal(back, got[t][3:5])


def test_transfer_cache_async_with_a_layer_synchronizer():
    out = two("transfer_cache_async", listen_port(prog.IP))
    results, status, asked, sent = out["p"]
    assert results == [S.LLM_SUCCESS] and status == S.LLM_SUCCESS
    assert asked == [0, 1, 2, 3]
    got = out["d"]
    for k in range(8):
        assert np.array_equal(got[k], prog.pattern([3, 10], 100 + k)) and np.array_equal(got[k], sent[k])


def test_switch_role():
    out = two("switch_role", (listen_port(prog.IP), listen_port(prog.IP)))
    p_sent, p_first, p_second = out["p"]
    d_sent, d_first, d_second = out["d"]
    for t in range(2):
        assert np.array_equal(p_first[t][1], d_sent[t][0])     # D pushed into P (P listening)
        assert np.array_equal(d_second[t][0], p_first[t][1])   # roles switched: P pushed into D
        assert np.array_equal(d_second[t][1], d_sent[t][1])


def test_unlink_force_on_both_ends():
    out = two("unlink_force", listen_port(prog.IP))
    p_ret, p_rets, p_arrays = out["p"]
    (d_ret, d_rets), after, relinked, d_arrays = out["d"]
    # a forced unlink drops one end; the other end notices the closed channel and drops itself,
    # so whichever end comes second may find no link left (docs/llm_datadist.md, "Unlink")
    for ret, rets in ((d_ret, d_rets), (p_ret, p_rets)):
        assert ret in (S.LLM_SUCCESS, S.LLM_NOT_YET_LINK) and rets == [ret]
    assert S.LLM_SUCCESS in (d_ret, p_ret)
    assert after == S.LLM_NOT_YET_LINK
    assert relinked == S.LLM_SUCCESS
    assert np.array_equal(p_arrays[0][1], d_arrays[0][0]) and np.array_equal(p_arrays[1][1], d_arrays[1][0])


# ------------------------------------------------------------ in this process


@pytest.fixture
def node():
    dd = LLMDataDist(LLMRole.PROMPT, 5)
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    dd.init(cfg.generate_options())
    try:
        yield dd
    finally:
        dd.finalize()


def test_exports():
    for name in ["LLMDataDist", "LLMConfig", "LLMRole", "LLMClusterInfo", "LLMStatusCode", "LLMException", "Status",
                 "DataType", "CacheDesc", "Cache", "CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey",
                 "Placement", "LayerSynchronizer", "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask",
                 "RegisterMemStatus", "Memtype", "MemInfo"]:
        assert hasattr(ld, name), name
    assert issubclass(LLMException, RuntimeError)
    assert LLMException("x", S.LLM_TIMEOUT).status_code == S.LLM_TIMEOUT
    assert ld.Status(S.LLM_SUCCESS).is_ok() and not ld.Status(S.LLM_FAILED).is_ok()
    assert ld.LLMRole.PROMPT == 1 and ld.Placement.HOST == 0 and DataType.DT_BF16 == 27


def test_generate_options():
    cfg = LLMConfig()
    cfg.device_id = 3
    cfg.sync_kv_timeout = 2500
    cfg.listen_ip_info = "127.0.0.1:26000"
    cfg.enable_cache_manager = True
    cfg.link_retry_count = 3
    o = cfg.generate_options()
    assert o["ge.exec.deviceId"] == "3" and o["llm.SyncKvCacheWaitTime"] == "2500"
    assert (o["llm.ListenIp"], o["llm.ListenPort"]) == ("127.0.0.1", "26000")
    assert o["llm.EnableCacheManager"] == "1" and o["llm.LinkRetryCount"] == "3"
    cfg.listen_ip_info = "nope"
    with pytest.raises(LLMException) as e:
        cfg.generate_options()
    assert e.value.status_code == S.LLM_PARAM_INVALID


def test_not_initialized_v1_mode_and_one_per_process(node):
    dd = LLMDataDist(LLMRole.DECODER, 6)
    with pytest.raises(RuntimeError, match="not initialized"):
        dd.cache_manager
    with pytest.raises(RuntimeError, match="not initialized"):
        dd.link_clusters([prog.cluster(5, 1)], 1000)
    dd.finalize()   # no-op
    with pytest.raises(LLMException) as e:
        dd.init({"ge.exec.deviceId": "0"})
    assert e.value.status_code == S.LLM_FEATURE_NOT_ENABLED and "V1" in str(e.value)
    with pytest.raises(LLMException) as e:
        dd.init({"ge.exec.deviceId": "0", "llm.EnableCacheManager": "1"})
    assert e.value.status_code == S.LLM_FAILED   # `node` is initialized in this process


def test_wrong_address_and_device_placement_are_llm_exceptions(node):
    cm = node.cache_manager
    desc = CacheDesc(1, [4, 1024], DataType.DT_FLOAT, Placement.HOST)
    for bad in (0, 8, 2**63, 0xdead0000):
        with pytest.raises(LLMException) as e:
            cm.register_cache(desc, [bad])
        assert e.value.status_code == S.LLM_PARAM_INVALID
    small = np.zeros(16, np.float32)
    with pytest.raises(LLMException) as e:   # valid address, but the cache is larger than what is mapped there?
        cm.register_cache(CacheDesc(1, [1 << 30], DataType.DT_FLOAT, Placement.HOST), [small.ctypes.data])
    assert e.value.status_code == S.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as e:
        cm.register_cache(CacheDesc(1, [4, 1024], DataType.DT_FLOAT), [np.zeros((4, 1024), np.float32).ctypes.data])
    assert e.value.status_code == S.LLM_FEATURE_NOT_ENABLED and "Placement.HOST" in str(e.value)
    with pytest.raises(LLMException) as e:
        node.link("comm", {5: 0, 6: 1}, "{}")
    assert e.value.status_code == S.LLM_FEATURE_NOT_ENABLED


def test_cache_key_rules_and_local_copies(node):
    with pytest.raises(LLMException):
        CacheKey(1, req_id=2**64 - 1)            # neither req_id nor prefix_id valid
    with pytest.raises(LLMException):
        CacheKey(1, req_id=3, prefix_id=4)       # both
    assert CacheKey(cluster_id=1, req_id=3) == CacheKey(1, 3)
    cm = node.cache_manager
    desc = CacheDesc(2, [4, 8], DataType.DT_FLOAT, Placement.HOST)
    a = cm.allocate_cache(desc)
    b = cm.allocate_cache(desc)
    assert (a.cache_id, b.cache_id) == (1, 2)
    a._rows[0][1] = np.arange(32, dtype=np.uint8)
    cm.copy_cache(b, a, dst_batch_index=3, src_batch_index=1, offset=4, size=8)
    assert np.array_equal(b._rows[0][3][4:12], np.arange(4, 12, dtype=np.uint8))
    assert (b._rows[0][3][:4] == 0).all() and (b._rows[0][3][12:] == 0).all()
    with pytest.raises(LLMException):
        cm.copy_cache(b, a, offset=32)
    cm.deallocate_cache(a)
    cm.unregister_cache(a.cache_id)   # unknown: no-op
    with pytest.raises(LLMException) as e:
        cm.transfer_cache_async(b, prog.EventSynchronizer([]), [ld.TransferConfig(1, [1, 2], range(0, 1))])
    assert e.value.status_code == S.LLM_FEATURE_NOT_ENABLED
