"""kvengine: asyncio KV-cache transfer engine with LLM-DataDist's cache API.

The statuses, types and planner are pure Python and import without the
compiled core; ``KvEngine`` and friends load it on first use (a missing build
then raises an ImportError that says how to build it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import layout, status   # layout: kv.layout.kv_tensors / describe (vLLM, FlashInfer, SGLang, MLA)
from .status import *  # noqa: F401,F403  (LLMStatusCode, LLMError, LINK_USABLE_AFTER, one class per code)
from .options import EngineOptions
from .types import (BlocksCacheKey, Cache, CacheDesc, CacheIndex, CacheKey, ClusterInfo, DataType,
                    KvCacheExtParam, Placement, Role)

if TYPE_CHECKING:   # loaded lazily (they need the compiled core): see __getattr__
    from .engine import KvEngine
    from .layers import LayerStream
    from .notify import Notification
    from .transfer import Transfer

__version__ = "0.1.0"

# The public names: the engine and what its calls take and return, then the statuses
# and their exceptions (kvengine.status.__all__). Helpers such as error_for, raise_for
# and STATUS_TABLE stay in kvengine.status.
__all__ = [
    "KvEngine", "Transfer", "Notification", "LayerStream",
    "EngineOptions", "Role", "Placement", "DataType",
    "CacheDesc", "Cache", "CacheIndex", "CacheKey", "BlocksCacheKey", "KvCacheExtParam", "ClusterInfo",
    "__version__",
]
__all__ += status.__all__

_NATIVE = {"KvEngine": "engine", "Transfer": "transfer", "Notification": "notify", "LayerStream": "layers"}


def _load(name: str) -> type:
    """Module ``__getattr__``: import a native-backed class on first use."""
    module = _NATIVE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvengine' has no attribute {name!r}")
    import importlib
    value: type = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


if not TYPE_CHECKING:   # type checkers see the imports above, and flag any other name
    __getattr__ = _load
