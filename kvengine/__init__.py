"""kvengine: asyncio KV-cache transfer engine with LLM-DataDist's cache API.

The statuses, types and planner are pure Python and import without the
compiled core; ``KvEngine`` and friends load it on first use (a missing build
then raises an ImportError that says how to build it).
"""

from .status import *  # noqa: F401,F403  (LLMStatusCode, LLMError and one class per code)
from .status import __all__ as _status_all
from .types import (BlocksCacheKey, Cache, CacheDesc, CacheIndex, ClusterInfo, DataType,
                    EngineOptions, KvCacheExtParam, Placement, Role)

__version__ = "0.1.0"

_NATIVE = {"KvEngine": "engine", "Transfer": "transfer", "Notification": "notify", "LayerStream": "layers"}

__all__ = [
    "KvEngine", "Transfer", "Notification", "LayerStream", "EngineOptions", "Role", "Placement", "DataType",
    "CacheDesc", "Cache", "CacheIndex", "BlocksCacheKey", "KvCacheExtParam", "ClusterInfo", "__version__",
] + list(_status_all)


def __getattr__(name: str):
    module = _NATIVE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvengine' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
