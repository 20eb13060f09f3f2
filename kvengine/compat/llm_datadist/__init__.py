"""LLM-DataDist V2's Python API (CacheManager mode) over :mod:`kvengine.sync`.

A program written for ``llm_datadist`` runs with its import and device lines
changed::

    from kvengine.compat.llm_datadist import LLMDataDist, LLMConfig, LLMRole, CacheDesc, ...
    tensor = torch.zeros(shape, dtype=torch.float)          # not .npu()
    CacheDesc(..., placement=Placement.HOST)                  # not DEVICE

Timeouts are milliseconds, addresses plain ints (``tensor.data_ptr()``,
checked against this process's mappings), errors ``LLMException`` with
``.status_code``. What maps to what, and what is not offered (device memory,
HCCL comm-domain ``link()``, V1 KvCacheManager mode): docs/llm_datadist.md.
"""

from kvengine import DataType, LLMStatusCode, Placement

from ._cache_manager import Cache, CacheManager
from ._datadist import LLMDataDist
from ._task import CacheTask, LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig
from ._types import (BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, LLMClusterInfo, LLMConfig,
                     LLMException, LLMRole, MemInfo, Memtype, RegisterMemStatus, Status)

LlmConfig = LLMConfig

__all__ = ["LLMDataDist", "LLMConfig", "LlmConfig", "LLMRole", "LLMClusterInfo", "LLMStatusCode", "LLMException",
           "Status", "DataType", "CacheDesc", "Cache", "CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey",
           "Placement", "LayerSynchronizer", "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask",
           "RegisterMemStatus", "Memtype", "MemInfo", "CacheManager"]
