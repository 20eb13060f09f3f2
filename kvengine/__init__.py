"""kvengine: asyncio KV-cache transfer engine with LLM-DataDist's cache API."""

from .status import *  # noqa: F401,F403  (LLMStatusCode, LLMError and one class per code)
from .status import __all__ as _status_all
from .types import (BlocksCacheKey, Cache, CacheDesc, CacheIndex, ClusterInfo, DataType,
                    EngineOptions, KvCacheExtParam, Placement, Role)
from .transfer import Transfer
from .engine import KvEngine

__version__ = "0.1.0"

__all__ = [
    "KvEngine", "Transfer", "EngineOptions", "Role", "Placement", "DataType", "CacheDesc", "Cache",
    "CacheIndex", "BlocksCacheKey", "KvCacheExtParam", "ClusterInfo", "__version__",
] + list(_status_all)
