#!/usr/bin/env python3
"""An LLM-DataDist push_blocks / pull_blocks program, ported to kvengine: only the import
and the device lines differ from an LLM-DataDist program (marked "kvengine:").

    python push_blocks_sample.py --role p --local_host_ip 127.0.0.1 --remote_host_ip 127.0.0.1 &
    python push_blocks_sample.py --role d --local_host_ip 127.0.0.1 --remote_host_ip 127.0.0.1

The prompt pushes its blocks 0, 1, 2 into the decoder's blocks 3, 4, 5; the decoder pulls
the prompt's block 4 into its block 1; both check every value.

The barriers use torch.distributed (gloo), as LLM-DataDist's samples do.
"""

import argparse
import datetime
import logging
import os

import torch
import torch.distributed as dist

# kvengine: was `from llm_datadist import ...`
from kvengine.compat.llm_datadist import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig,
                                          LLMDataDist, LLMRole, LLMStatusCode, Placement)

logging.basicConfig(format='%(asctime)s %(message)s', level=logging.INFO)

NUM_TENSORS = 4          # 2 layers x (K, V)
BLOCKS_NUM = 6
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
    if role == LLMRole.PROMPT:
        llm_config.listen_ip_info = f"{local_host_ip}:{PORT}"
    datadist.init(llm_config.generate_options())
    logging.info(f"init {role} success, cluster_id={cluster_id}")
    return datadist


def run_prompt_sample(datadist):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                           placement=PLACEMENT)
    # block b of tensor t holds 100 * t + b
    tensors = [device(torch.arange(BLOCKS_NUM, dtype=torch.float).unsqueeze(1).repeat(1, KV_SHAPE) + 100 * t)
               for t in range(NUM_TENSORS)]
    cache = cache_manager.register_blocks_cache(cache_desc, [int(t.data_ptr()) for t in tensors],
                                                BlocksCacheKey(PROMPT_CLUSTER_ID, 0))
    dist.barrier()  # register end
    dist.barrier()  # link end
    cache_manager.push_blocks(BlocksCacheKey(DECODER_CLUSTER_ID, 0), cache, [0, 1, 2], [3, 4, 5])
    logging.info("push_blocks success")
    dist.barrier()  # push end
    dist.barrier()  # decoder pull and unlink end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def run_decoder_sample(datadist, local_host_ip, remote_host_ip):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                           placement=PLACEMENT)
    tensors = [device(torch.full((BLOCKS_NUM, KV_SHAPE), -1, dtype=torch.float)) for _ in range(NUM_TENSORS)]
    cache = cache_manager.register_blocks_cache(cache_desc, [int(t.data_ptr()) for t in tensors],
                                                BlocksCacheKey(DECODER_CLUSTER_ID, 0))
    dist.barrier()  # register end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_local_ip_info(local_host_ip, PORT)
    cluster.append_remote_ip_info(remote_host_ip, PORT)
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")
    dist.barrier()  # link end
    dist.barrier()  # prompt push end
    cache_manager.pull_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[4], dst_blocks=[1])
    logging.info("pull_blocks success")
    for t, tensor in enumerate(tensors):
        want = {0: -1, 1: 100 * t + 4, 2: -1, 3: 100 * t + 0, 4: 100 * t + 1, 5: 100 * t + 2}
        for b, v in want.items():
            assert (tensor.cpu()[b] == v).all(), (t, b, tensor.cpu()[b], v)
    logging.info("every block holds what was pushed or pulled")
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")
    dist.barrier()  # pull and unlink end
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
        run_prompt_sample(datadist)
    else:
        run_decoder_sample(datadist, args.local_host_ip, args.remote_host_ip)
    logging.info('Sample end')
