#!/usr/bin/env python3
"""An LLM-DataDist push_cache program, ported to kvengine: only the import and the
device lines differ from the LLM-DataDist original (marked "kvengine:").

    python push_cache_sample.py --role p --local_host_ip 127.0.0.1 --remote_host_ip 127.0.0.1 &
    python push_cache_sample.py --role d --local_host_ip 127.0.0.1 --remote_host_ip 127.0.0.1

The barriers use torch.distributed (gloo), as LLM-DataDist's samples do.
"""

import argparse
import datetime
import logging
import os

import torch
import torch.distributed as dist

# kvengine: was `from llm_datadist import ...`
from kvengine.compat.llm_datadist import (CacheDesc, CacheKeyByIdAndIndex, DataType, LLMClusterInfo, LLMConfig,
                                          LLMDataDist, LLMRole, LLMStatusCode, Placement)

logging.basicConfig(format='%(asctime)s %(message)s', level=logging.INFO)

NUM_TENSORS = 2
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
    if role == LLMRole.PROMPT:
        llm_config.listen_ip_info = f"{local_host_ip}:{PORT}"
    datadist.init(llm_config.generate_options())
    logging.info(f"init {role} success, cluster_id={cluster_id}")
    return datadist


def run_prompt_sample(datadist):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                           placement=PLACEMENT)
    tensor = device(torch.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=torch.float))
    tensor2 = device(torch.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=torch.float))
    cache = cache_manager.register_cache(cache_desc, [int(tensor.data_ptr()), int(tensor2.data_ptr())])
    dist.barrier()  # register end
    dist.barrier()  # decoder push cache end
    logging.info(f'after decoder push, tensor={tensor.cpu()}')
    logging.info(f'after decoder push, tensor2={tensor2.cpu()}')
    assert (tensor[0] == 1).all() and (tensor[1:] == 0).all()
    dist.barrier()  # unlink end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def run_decoder_sample(datadist, local_host_ip, remote_host_ip):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                           placement=PLACEMENT)
    tensor = device(torch.full((BLOCKS_NUM, KV_SHAPE), 1, dtype=torch.float))
    tensor2 = device(torch.full((BLOCKS_NUM, KV_SHAPE), 1, dtype=torch.float))
    cache = cache_manager.register_cache(cache_desc, [int(tensor.data_ptr()), int(tensor2.data_ptr())])
    dist.barrier()  # register end

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_local_ip_info(local_host_ip, PORT)
    cluster.append_remote_ip_info(remote_host_ip, PORT)
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")

    cache_manager.push_cache(CacheKeyByIdAndIndex(cluster_id=PROMPT_CLUSTER_ID, cache_id=1, batch_index=0), cache,
                             src_batch_index=0)
    dist.barrier()  # push cache end

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_remote_ip_info(remote_host_ip, PORT)
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")
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
        run_prompt_sample(datadist)
    else:
        run_decoder_sample(datadist, args.local_host_ip, args.remote_host_ip)
    logging.info('Sample end')
