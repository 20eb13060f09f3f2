"""LLM-DataDist-style programs, written from its Python API documentation, run on
kvengine.compat.llm_datadist: a prompt and a decoder process each, a pipe for the
barriers (where LLM-DataDist's samples use torch.distributed). Only the import and
the device lines differ from an LLM-DataDist program: CPU tensors, Placement.HOST.

Each program function runs in a spawned process and returns what the parent
checks; an assertion inside fails the process."""

from __future__ import annotations

import threading
import time
from typing import Optional

import numpy as np

from kvengine.compat.llm_datadist import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex,
                                          DataType, LayerSynchronizer, LLMClusterInfo, LLMConfig, LLMDataDist,
                                          LLMException, LLMRole, LLMStatusCode, Placement,
                                          TransferWithCacheKeyConfig)

PROMPT_CLUSTER_ID, DECODER_CLUSTER_ID = 0, 1
IP = "127.0.0.1"


class Barrier:
    def __init__(self, conn) -> None:
        self.conn = conn

    def __call__(self) -> None:
        self.conn.send("b")
        assert self.conn.recv() == "b"


def init_llm_datadist(role, cluster_id, listen_port=None, timeout_ms=5000) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.enable_cache_manager = True
    llm_config.sync_kv_timeout = timeout_ms
    if listen_port is not None:
        llm_config.listen_ip_info = f"{IP}:{listen_port}"
    datadist.init(llm_config.generate_options())
    return datadist


def cluster(remote_id, port=None) -> LLMClusterInfo:
    c = LLMClusterInfo()
    c.remote_cluster_id = remote_id
    if port is not None:
        c.append_local_ip_info(IP, 0)
        c.append_remote_ip_info(IP, port)
    return c


def pattern(shape, seed) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def torch_tensors(shape, n, fill):
    import torch
    return [torch.full(shape, fill, dtype=torch.float) for _ in range(n)]


# --------------------------------------------------------------- push_cache


def push_cache(role, conn, port):
    """push_cache_sample: the decoder pushes its row into the prompt's cache 1 by id and index,
    whole row, then one layer into another row with layer ranges."""
    import torch
    barrier = Barrier(conn)
    shape = [3, 10]
    if role == "p":
        datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, port)
        cache_manager = datadist.cache_manager
        cache_desc = CacheDesc(num_tensors=4, shape=shape, data_type=DataType.DT_FLOAT, placement=Placement.HOST)
        tensors = torch_tensors(shape, 4, 0)
        cache = cache_manager.register_cache(cache_desc, [int(t.data_ptr()) for t in tensors])
        assert cache.cache_id == 1
        barrier()   # register end
        barrier()   # decoder push cache end
        got = [t.numpy().copy() for t in tensors]
        barrier()   # unlink end
        cache_manager.unregister_cache(cache.cache_id)
        datadist.finalize()
        return got
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID)
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=4, shape=shape, data_type=DataType.DT_FLOAT, placement=Placement.HOST)
    tensors = [torch.from_numpy(pattern(shape, i)) for i in range(4)]
    cache = cache_manager.register_cache(cache_desc, [int(t.data_ptr()) for t in tensors])
    barrier()
    ret, rets = datadist.link_clusters([cluster(PROMPT_CLUSTER_ID, port)], 5000)
    assert ret == LLMStatusCode.LLM_SUCCESS, rets
    cache_manager.push_cache(CacheKeyByIdAndIndex(cluster_id=PROMPT_CLUSTER_ID, cache_id=1, batch_index=0), cache,
                             src_batch_index=0)
    cache_manager.push_cache(CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, 1, 2), cache, src_batch_index=1,
                             src_layer_range=range(1, 2), dst_layer_range=range(0, 1), tensor_num_per_layer=2)
    try:
        cache_manager.push_cache(CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, 99, 0), cache)
        raise AssertionError("push to an unknown cache id succeeded")
    except LLMException as e:
        assert e.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, e
    barrier()
    ret, _ = datadist.unlink_clusters([cluster(PROMPT_CLUSTER_ID, port)], 5000)
    assert ret == LLMStatusCode.LLM_SUCCESS
    barrier()
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return [t.numpy().copy() for t in tensors]


# --------------------------------------------------------- pull_cache by key


def pull_cache_by_key(role, conn, port):
    """The prompt registers rows under request keys; the decoder pulls by CacheKey."""
    barrier = Barrier(conn)
    shape = [4, 16]
    desc = CacheDesc(2, shape, DataType.DT_FLOAT, Placement.HOST)
    if role == "p":
        datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, port)
        arrays = [pattern(shape, 10 + i) for i in range(2)]
        # one key per row (LLM-DataDist's Python CacheKey needs exactly one valid id, so no padding key)
        keys = [CacheKey(PROMPT_CLUSTER_ID, req_id=7), CacheKey(PROMPT_CLUSTER_ID, req_id=9),
                CacheKey(PROMPT_CLUSTER_ID, req_id=8, model_id=1)]
        datadist.cache_manager.register_cache(desc, [a.ctypes.data for a in arrays], cache_keys=keys)
        barrier()   # registered
        barrier()   # decoder pulled
        datadist.cache_manager.remove_cache_key(CacheKey(PROMPT_CLUSTER_ID, req_id=7))
        barrier()   # key removed
        barrier()   # done
        datadist.finalize()
        return arrays
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID)
    arrays = [np.zeros(shape, np.float32) for _ in range(2)]
    cache = datadist.cache_manager.register_cache(desc, [a.ctypes.data for a in arrays])
    barrier()
    ret, _ = datadist.link_clusters([cluster(PROMPT_CLUSTER_ID, port)], 5000)
    assert ret == LLMStatusCode.LLM_SUCCESS
    datadist.cache_manager.pull_cache(CacheKey(PROMPT_CLUSTER_ID, req_id=8, model_id=1), cache, batch_index=0)
    datadist.cache_manager.pull_cache(CacheKey(PROMPT_CLUSTER_ID, req_id=7), cache, batch_index=3)
    barrier()
    barrier()
    # the removal reaches this engine as a control message: until it arrived a pull by the key
    # still reads the row (docs/api.md, keys); after it, the key is unknown here
    deadline = time.monotonic() + 5
    while True:
        try:
            datadist.cache_manager.pull_cache(CacheKey(PROMPT_CLUSTER_ID, req_id=7), cache, batch_index=1)
        except LLMException as e:
            assert e.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, e
            break
        if time.monotonic() > deadline:
            raise AssertionError("a removed key still pulls 5 s after its removal")
    datadist.unlink_clusters([cluster(PROMPT_CLUSTER_ID)], 5000)
    barrier()
    datadist.finalize()
    return arrays


# ------------------------------------------------- push_blocks / pull_blocks


def blocks(role, conn, port):
    """push_blocks_sample / pull_blocks_sample: both register block caches under
    BlocksCacheKey(own cluster, model_id 0); the prompt pushes, the decoder pulls; then the
    decoder swaps its blocks out to a host cache and back in (swap_blocks)."""
    barrier = Barrier(conn)
    shape = [6, 32]
    desc = CacheDesc(4, shape, DataType.DT_FLOAT, Placement.HOST)
    if role == "p":
        datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, port)
        arrays = [pattern(shape, 20 + i) for i in range(4)]
        cache = datadist.cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays],
                                                             BlocksCacheKey(PROMPT_CLUSTER_ID, 0))
        barrier()   # registered
        barrier()   # linked
        datadist.cache_manager.push_blocks(BlocksCacheKey(DECODER_CLUSTER_ID, 0), cache, [0, 1, 2], [3, 4, 5])
        datadist.cache_manager.push_blocks(BlocksCacheKey(DECODER_CLUSTER_ID, 0), cache, [5], [0],
                                           src_layer_range=range(1, 2), dst_layer_range=range(1, 2),
                                           tensor_num_per_layer=2)
        barrier()   # pushed
        barrier()   # decoder done
        datadist.finalize()
        return arrays
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID)
    arrays = [np.zeros(shape, np.float32) for _ in range(4)]
    cm = datadist.cache_manager
    cache = cm.register_blocks_cache(desc, [a.ctypes.data for a in arrays], BlocksCacheKey(DECODER_CLUSTER_ID, 0))
    barrier()
    ret, _ = datadist.link_clusters([cluster(PROMPT_CLUSTER_ID, port)], 5000)
    assert ret == LLMStatusCode.LLM_SUCCESS
    barrier()
    barrier()
    cm.pull_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[4], dst_blocks=[1])
    got = [a.copy() for a in arrays]
    host = [np.zeros(shape, np.float32) for _ in range(4)]
    cpu_cache = Cache.create_cpu_cache(desc, [h.ctypes.data for h in host])
    cm.swap_blocks(cache, cpu_cache, {3: 0, 4: 1})       # swap out
    for a in arrays:
        a[3:5] = 0
    cm.swap_blocks(cpu_cache, cache, {0: 3, 1: 4})       # swap in
    swapped = [(h[:2].copy(), a[3:5].copy()) for h, a in zip(host, arrays)]
    barrier()
    datadist.unlink_clusters([cluster(PROMPT_CLUSTER_ID)], 5000)
    datadist.finalize()
    return got, swapped


# ----------------------------------------------------- transfer_cache_async


class EventSynchronizer(LayerSynchronizer):
    """Layer l is ready when the 'forward pass' thread set its event."""

    def __init__(self, events):
        self.events = events
        self.asked = []

    def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        self.asked.append(layer_index)
        return self.events[layer_index].wait(10)


def transfer_cache_async(role, conn, port):
    """transfer_cache_async_sample, with a forward pass computing 4 layers in a thread."""
    import torch
    barrier = Barrier(conn)
    layers, shape = 4, [3, 10]
    desc = CacheDesc(num_tensors=2 * layers, shape=shape, data_type=DataType.DT_FLOAT, placement=Placement.HOST)
    if role == "d":
        datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID, port)
        tensors = torch_tensors(shape, 2 * layers, 0)
        cache = datadist.cache_manager.register_blocks_cache(desc, [int(t.data_ptr()) for t in tensors],
                                                             BlocksCacheKey(DECODER_CLUSTER_ID, 0))
        barrier()   # register end
        barrier()   # prompt transfer cache end
        got = [t.numpy().copy() for t in tensors]
        ret, _ = datadist.unlink_clusters([cluster(PROMPT_CLUSTER_ID)], 5000, force=True)
        datadist.cache_manager.unregister_cache(cache.cache_id)
        datadist.finalize()
        return got
    datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID)
    tensors = torch_tensors(shape, 2 * layers, 0)
    cache = datadist.cache_manager.register_blocks_cache(desc, [int(t.data_ptr()) for t in tensors],
                                                         BlocksCacheKey(PROMPT_CLUSTER_ID, 0))
    barrier()
    ret, _ = datadist.link_clusters([cluster(DECODER_CLUSTER_ID, port)], 5000)
    assert ret == LLMStatusCode.LLM_SUCCESS
    events = [threading.Event() for _ in range(layers)]
    sync = EventSynchronizer(events)
    config = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_CLUSTER_ID, 0), range(0, layers), range(0, layers))
    task = datadist.cache_manager.transfer_cache_async(cache, sync, [config])

    def forward():
        for layer in range(layers):
            for k in (2 * layer, 2 * layer + 1):
                tensors[k].copy_(torch.from_numpy(pattern(shape, 100 + k)))
            events[layer].set()
    threading.Thread(target=forward).start()
    results = task.get_results()
    status = task.synchronize(1000)
    barrier()
    datadist.unlink_clusters([cluster(DECODER_CLUSTER_ID)], 5000, force=True)
    datadist.finalize()
    return results, status, sync.asked, [t.numpy().copy() for t in tensors]


# -------------------------------------------------------------- switch_role


def switch_role(role, conn, ports):
    """switch_role_sample: P listens and D pushes into it; after unlinking they swap roles and
    listen state, and the new prompt (old decoder) listens; the new decoder pushes into it."""
    barrier = Barrier(conn)
    shape = [2, 8]
    desc = CacheDesc(2, shape, DataType.DT_FLOAT, Placement.HOST)
    port1, port2 = ports
    me, other = (PROMPT_CLUSTER_ID, DECODER_CLUSTER_ID) if role == "p" else (DECODER_CLUSTER_ID, PROMPT_CLUSTER_ID)
    datadist = init_llm_datadist(LLMRole.PROMPT if role == "p" else LLMRole.DECODER, me,
                                 port1 if role == "p" else None)
    cm = datadist.cache_manager
    arrays = [pattern(shape, 30 + me * 2 + i) for i in range(2)]
    cache = cm.register_cache(desc, [a.ctypes.data for a in arrays])
    sent = [a.copy() for a in arrays]
    barrier()
    if role == "d":
        ret, _ = datadist.link_clusters([cluster(other, port1)], 5000)
        assert ret == LLMStatusCode.LLM_SUCCESS
        try:
            datadist.switch_role(LLMRole.PROMPT, {"llm.ListenIpInfo": f"{IP}:{port2}"})
            raise AssertionError("switch_role while linked succeeded")
        except LLMException as e:
            assert e.status_code == LLMStatusCode.LLM_EXIST_LINK
        cm.push_cache(CacheKeyByIdAndIndex(other, cache.cache_id, 1), cache, 0)
        ret, _ = datadist.unlink_clusters([cluster(other, port1)], 5000)
        assert ret == LLMStatusCode.LLM_SUCCESS
    barrier()   # first round done, unlinked
    first = [a.copy() for a in arrays]
    if role == "p":
        datadist.switch_role(LLMRole.DECODER)   # stop listening
    else:
        datadist.switch_role(LLMRole.PROMPT, {"llm.ListenIpInfo": f"{IP}:{port2}"})
    barrier()   # switched
    if role == "p":
        ret, _ = datadist.link_clusters([cluster(other, port2)], 5000)
        assert ret == LLMStatusCode.LLM_SUCCESS
        cm.push_cache(CacheKeyByIdAndIndex(other, cache.cache_id, 0), cache, 1)
        datadist.unlink_clusters([cluster(other, port2)], 5000)
    barrier()
    second = [a.copy() for a in arrays]
    datadist.finalize()
    return sent, first, second


# ---------------------------------------------------------- unlink force=True


def unlink_force(role, conn, port):
    """Both ends unlink with force=True (as with a broken link); transfers then fail
    LLM_NOT_YET_LINK; a new link works."""
    barrier = Barrier(conn)
    shape = [2, 8]
    desc = CacheDesc(2, shape, DataType.DT_FLOAT, Placement.HOST)
    if role == "p":
        datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, port)
        arrays = [np.zeros(shape, np.float32) for _ in range(2)]
        datadist.cache_manager.register_cache(desc, [a.ctypes.data for a in arrays])
        barrier()   # registered
        barrier()   # linked
        ret, rets = datadist.unlink_clusters([cluster(DECODER_CLUSTER_ID)], 5000, force=True)
        barrier()   # both unlinked
        barrier()   # relinked and pushed
        datadist.finalize()
        return int(ret), [int(r) for r in rets], arrays
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID)
    arrays = [pattern(shape, 40 + i) for i in range(2)]
    cache = datadist.cache_manager.register_cache(desc, [a.ctypes.data for a in arrays])
    barrier()
    ret, _ = datadist.link_clusters([cluster(PROMPT_CLUSTER_ID, port)], 5000)
    assert ret == LLMStatusCode.LLM_SUCCESS
    barrier()
    ret, rets = datadist.unlink_clusters([cluster(PROMPT_CLUSTER_ID, port)], 5000, force=True)
    unlinked = (int(ret), [int(r) for r in rets])
    barrier()
    try:
        datadist.cache_manager.push_cache(CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, 1, 0), cache)
        after = LLMStatusCode.LLM_SUCCESS
    except LLMException as e:
        after = e.status_code
    for _ in range(50):   # the peer may still be dropping its end
        ret, _ = datadist.link_clusters([cluster(PROMPT_CLUSTER_ID, port)], 5000)
        if ret == LLMStatusCode.LLM_SUCCESS:
            break
        import time
        time.sleep(0.1)
    datadist.cache_manager.push_cache(CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, 1, 1), cache, 0)
    barrier()
    datadist.finalize()
    return unlinked, int(after), int(ret), arrays


def run(program, role, conn, arg, results):
    """Process entry: run ``program`` and put (role, result or the exception text)."""
    import faulthandler
    import traceback
    faulthandler.dump_traceback_later(45, exit=True)   # a hung program shows where, then ends
    try:
        results.put((role, "ok", globals()[program](role, conn, arg)))
    except BaseException:
        results.put((role, "error", traceback.format_exc()))
        conn.close()
