#!/usr/bin/env python3
"""An LLM-DataDist transfer_cache_async program, ported to kvengine: only the import and
the device lines differ from an LLM-DataDist program (marked "kvengine:").

    python transfer_cache_async_sample.py --role p --local_host_ip 127.0.0.1 --remote_host_ip 127.0.0.1 &
    python transfer_cache_async_sample.py --role d --local_host_ip 127.0.0.1 --remote_host_ip 127.0.0.1

Here the decoder listens and the prompt links to it. The prompt's "forward pass" computes
4 layers in a thread; a LayerSynchronizer lets each layer go once it is computed; the
decoder checks every value.

The barriers use torch.distributed (gloo), as LLM-DataDist's samples do.
"""

import argparse
import datetime
import logging
import os
import threading

import torch
import torch.distributed as dist

# kvengine: was `from llm_datadist import ...`
from kvengine.compat.llm_datadist import (BlocksCacheKey, CacheDesc, DataType, LayerSynchronizer, LLMClusterInfo,
                                          LLMConfig, LLMDataDist, LLMRole, LLMStatusCode, Placement,
                                          TransferWithCacheKeyConfig)

logging.basicConfig(format='%(asctime)s %(message)s', level=logging.INFO)

NUM_LAYERS = 4
NUM_TENSORS = 2 * NUM_LAYERS   # (K, V) per layer
BLOCKS_NUM = 3
KV_SHAPE = 10
PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
PLACEMENT = Placement.HOST          # kvengine: was Placement.DEVICE
PORT = int(os.environ.get("SAMPLE_PORT", "26000"))   # kvengine: tests run the samples on a free port


def device(t):
    return t                        # kvengine: was t.npu()


def init_process_group(rank, world_size, master_ip, backend='gloo'):
    os.environ['MASTER_ADDR'] = master_ip
    os.environ.setdefault('MASTER_PORT', '29500')
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))


def init_llm_datadist(role, cluster_id, device_id, local_host_ip, remote_host_ip):
    init_process_group(cluster_id, 2, min(local_host_ip, remote_host_ip))
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = device_id
    llm_config.local_comm_res = ""
    if role == LLMRole.DECODER:
        llm_config.listen_ip_info = f"{local_host_ip}:{PORT}"
    datadist.init(llm_config.generate_options())
    logging.info(f"init {role} success, cluster_id={cluster_id}")
    return datadist


class LayerEvents(LayerSynchronizer):
    """A layer may go once the forward pass has set its event."""

    def __init__(self):
        self.events = [threading.Event() for _ in range(NUM_LAYERS)]

    def synchronize_layer(self, layer_index, timeout_in_millis):
        return self.events[layer_index].wait(None if timeout_in_millis is None else timeout_in_millis / 1000)


def run_prompt_sample(datadist, local_host_ip, remote_host_ip):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                           placement=PLACEMENT)
    tensors = [device(torch.zeros((BLOCKS_NUM, KV_SHAPE), dtype=torch.float)) for _ in range(NUM_TENSORS)]
    cache = cache_manager.register_blocks_cache(cache_desc, [int(t.data_ptr()) for t in tensors],
                                                BlocksCacheKey(PROMPT_CLUSTER_ID, 0))
    dist.barrier()  # register end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    cluster.append_local_ip_info(local_host_ip, PORT)
    cluster.append_remote_ip_info(remote_host_ip, PORT)
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")
    synchronizer = LayerEvents()
    config = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_CLUSTER_ID, 0), range(0, NUM_LAYERS),
                                        range(0, NUM_LAYERS))
    task = cache_manager.transfer_cache_async(cache, synchronizer, [config])

    def forward():   # layer l's K and V hold 10 * l + 1 and 10 * l + 2
        for layer in range(NUM_LAYERS):
            tensors[2 * layer].fill_(10 * layer + 1)
            tensors[2 * layer + 1].fill_(10 * layer + 2)
            synchronizer.events[layer].set()
    threading.Thread(target=forward).start()
    results = task.get_results()
    logging.info(f"transfer_cache_async results={results}")
    assert all(r == LLMStatusCode.LLM_SUCCESS for r in results), results
    dist.barrier()  # transfer end
    dist.barrier()  # decoder checked
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")
    dist.barrier()  # unlink end (kvengine: the decoder waits for it: had it finalized first, its close
    #                 would have taken the link down, and this unlink would find none: LLM_NOT_YET_LINK)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def run_decoder_sample(datadist):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                           placement=PLACEMENT)
    tensors = [device(torch.full((BLOCKS_NUM, KV_SHAPE), -1, dtype=torch.float)) for _ in range(NUM_TENSORS)]
    cache = cache_manager.register_blocks_cache(cache_desc, [int(t.data_ptr()) for t in tensors],
                                                BlocksCacheKey(DECODER_CLUSTER_ID, 0))
    dist.barrier()  # register end
    dist.barrier()  # prompt transfer end
    for layer in range(NUM_LAYERS):
        assert (tensors[2 * layer].cpu() == 10 * layer + 1).all() and (tensors[2 * layer + 1].cpu() == 10 * layer + 2).all()
    logging.info("every layer holds what the prompt computed")
    dist.barrier()  # checked
    dist.barrier()  # unlink end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument("--device_id", type=int, default=0)
    parser.add_argument("--role", type=str, default='p', help='p or d')
    parser.add_argument("--local_host_ip", type=str, default="127.0.0.1")
    parser.add_argument("--remote_host_ip", type=str, default="127.0.0.1")
    args = parser.parse_args()
    # kvengine: torch.npu.set_device(args.device_id) removed (host memory)
    role = LLMRole.PROMPT if args.role == 'p' else LLMRole.DECODER
    cluster_id = PROMPT_CLUSTER_ID if args.role == 'p' else DECODER_CLUSTER_ID
    datadist = init_llm_datadist(role, cluster_id, args.device_id, args.local_host_ip, args.remote_host_ip)
    if role == LLMRole.PROMPT:
        run_prompt_sample(datadist, args.local_host_ip, args.remote_host_ip)
    else:
        run_decoder_sample(datadist)
    logging.info('Sample end')
