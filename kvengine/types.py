"""Plain data types of the public API (pure Python, no native code).

Names and fields follow LLM-DataDist V2 (``CacheDesc``, ``CacheIndex``, ``CacheKey``,
``BlocksCacheKey``, ``KvCacheExtParam``, ``ClusterInfo``); see
docs/api.md for the rules each field obeys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence, SupportsIndex, Union

import numpy as np
from numpy.typing import DTypeLike, NDArray

from .status import LLMParamInvalidError, _NamedIntEnum

__all__ = [
    "Role", "Placement", "DataType", "CacheDesc", "Cache", "CacheIndex", "CacheKey",
    "BlocksCacheKey", "KvCacheExtParam", "ClusterInfo",
]

_U32 = 2**32 - 1
_U64 = 2**64 - 1
_I64 = 2**63 - 1
MAX_SHAPE_RANK = 31
_MAX_CACHE_BYTES = 1 << 48   # keeps every byte offset far inside the native uint64 words


def param_invalid(message: str) -> LLMParamInvalidError:
    return LLMParamInvalidError(message)


class Role(_NamedIntEnum):
    """A label only (as in LLM-DataDist V2): either side of a link may push or pull.
    ``str()`` and ``format()`` give the name (``PROMPT``)."""
    PROMPT = 1
    DECODER = 2
    MIX = 3


class Placement(_NamedIntEnum):
    """Where a cache's memory is; ``str()`` and ``format()`` give the name (``HOST``)."""
    HOST = 0
    DEVICE = 1


class DataType(_NamedIntEnum):
    """LLM-DataDist (GE) data type ids; ``str()`` and ``format()`` give the name (``DT_BF16``)."""
    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_BF16 = 27

    @property
    def numpy_dtype(self) -> np.dtype[np.generic]:
        """The numpy dtype of tensor views (``uint16`` for bf16 unless ml_dtypes is installed)."""
        return _numpy_dtype(self)

    @property
    def itemsize(self) -> int:
        return 2 if self is DataType.DT_BF16 else _NP_BY_DT[self].itemsize

    @classmethod
    def from_any(cls, dtype: DTypeLike | int) -> DataType:
        """Accept a DataType, its int id, its name, or a numpy dtype (or its name)."""
        if isinstance(dtype, DataType):
            return dtype
        if isinstance(dtype, bool):
            raise param_invalid(f"unsupported dtype {dtype!r}")
        if isinstance(dtype, (int, np.integer)):
            try:
                return cls(int(dtype))
            except ValueError:
                raise param_invalid(f"unknown data type id {dtype}") from None
        if isinstance(dtype, str) and dtype.upper() in cls.__members__:
            return cls[dtype.upper()]
        if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
            return cls.DT_BF16
        if dtype is None:  # np.dtype(None) would silently mean float64
            raise param_invalid("dtype must be given, got None")
        try:
            npd = np.dtype(dtype)
        except (TypeError, ValueError):
            raise param_invalid(f"unsupported dtype {dtype!r}") from None
        if npd.name == "bfloat16":
            return cls.DT_BF16
        for dt, candidate in _NP_BY_DT.items():
            if candidate == npd:
                return dt
        raise param_invalid(f"unsupported dtype {dtype!r}")


_NP_BY_DT: dict[DataType, np.dtype[np.generic]] = {
    DataType.DT_FLOAT: np.dtype(np.float32),
    DataType.DT_FLOAT16: np.dtype(np.float16),
    DataType.DT_INT8: np.dtype(np.int8),
    DataType.DT_INT32: np.dtype(np.int32),
    DataType.DT_UINT8: np.dtype(np.uint8),
    DataType.DT_INT16: np.dtype(np.int16),
    DataType.DT_UINT16: np.dtype(np.uint16),
    DataType.DT_UINT32: np.dtype(np.uint32),
    DataType.DT_INT64: np.dtype(np.int64),
    DataType.DT_UINT64: np.dtype(np.uint64),
    DataType.DT_DOUBLE: np.dtype(np.float64),
    DataType.DT_BOOL: np.dtype(np.bool_),
}


def _numpy_dtype(dt: DataType) -> np.dtype[np.generic]:
    if dt is DataType.DT_BF16:
        try:
            import ml_dtypes  # optional
            bf16: np.dtype[np.generic] = np.dtype(ml_dtypes.bfloat16)
            return bf16
        except ImportError:
            return np.dtype(np.uint16)
    return _NP_BY_DT[dt]


def check_timeout(value: object, default: float, name: str = "timeout") -> float:
    """The one rule for every timeout kvengine takes: ``None`` means ``default``; else a
    finite positive number of seconds (an infinite wait is what the engine promises
    never to make). Raises LLMParamInvalidError naming ``name``."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise param_invalid(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise param_invalid(f"{name} must be an int, got {type(value).__name__}")
    n = int(value)
    if not lo <= n <= hi:
        raise param_invalid(f"{name} must be in [{lo}, {hi}], got {n}")
    return n


@dataclass(frozen=True, slots=True, init=False)
class CacheDesc:
    """``num_tensors`` tensors, each of ``shape`` and ``dtype``; dim 0 is the batch or block count.

    The constructor takes more than the fields hold (an int or any sequence of ints for
    ``shape``; a dtype name, numpy dtype or id for ``dtype``) and normalises it: the
    fields are always a tuple of ints, a :class:`DataType` and a :class:`Placement`.

    Layouts (docs/concepts.md): ``block_stride``, elements from one entry of dim 0 to the
    next (torch's ``t.stride(0)``; None: contiguous); ``head_axis``, the dim of the KV
    heads (2 in ``(blocks, block_size, kv_heads, head_dim)``), for head-range transfers.
    """
    num_tensors: int
    shape: tuple[int, ...]
    dtype: DataType
    placement: Placement
    block_stride: int | None
    head_axis: int | None

    def __init__(self, num_tensors: int, shape: int | Iterable[SupportsIndex],
                 dtype: DTypeLike | int = DataType.DT_FLOAT16,
                 placement: Placement | int = Placement.HOST, *, block_stride: int | None = None,
                 head_axis: int | None = None) -> None:
        n = _check_int("CacheDesc.num_tensors", num_tensors, 1, _U32)
        if isinstance(shape, (int, np.integer)):
            shape = (shape,)
        try:
            dims = tuple(shape)
        except TypeError:
            raise param_invalid("CacheDesc.shape must be a sequence of ints") from None
        if not 1 <= len(dims) <= MAX_SHAPE_RANK:
            raise param_invalid(f"CacheDesc.shape must have 1..{MAX_SHAPE_RANK} dims, got {len(dims)}")
        ints = tuple(_check_int("CacheDesc.shape[%d]" % i, d, 1, _I64) for i, d in enumerate(dims))
        object.__setattr__(self, "shape", ints)
        object.__setattr__(self, "dtype", DataType.from_any(dtype))
        try:
            object.__setattr__(self, "placement", Placement(placement))
        except ValueError:
            raise param_invalid(f"unknown placement {placement!r}") from None
        object.__setattr__(self, "num_tensors", n)
        inner = math.prod(ints[1:])
        if block_stride is not None:   # normalised: None when contiguous, so equal descs compare equal
            block_stride = _check_int("CacheDesc.block_stride", block_stride, inner, _I64)
        object.__setattr__(self, "block_stride", None if block_stride == inner else block_stride)
        if head_axis is not None:
            h = _check_int("CacheDesc.head_axis", head_axis, -len(ints), len(ints) - 1)
            if h in (0, -len(ints)):
                raise param_invalid("CacheDesc.head_axis cannot be dim 0 (the blocks)")
            head_axis = h % len(ints)
        object.__setattr__(self, "head_axis", head_axis)
        if self.span * n > _MAX_CACHE_BYTES:
            raise param_invalid(f"cache of {self.span * n} bytes exceeds the {_MAX_CACHE_BYTES}-byte limit")

    @property
    def batch_size(self) -> int:   # dim 0: the number of batch rows (or of blocks)
        return self.shape[0]

    @property
    def size(self) -> int:
        """Bytes of one tensor's data."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one batch row (or one block) of one tensor."""
        return self.size // self.shape[0]

    @property
    def block_stride_bytes(self) -> int:
        """Bytes from one batch row (or block) of a tensor to the next."""
        return self.row_bytes if self.block_stride is None else self.block_stride * self.dtype.itemsize

    @property
    def span(self) -> int:
        """Bytes one tensor reaches from its address (``size`` when contiguous)."""
        return (self.shape[0] - 1) * self.block_stride_bytes + self.row_bytes

    @property
    def nbytes(self) -> int:   # bytes of the whole cache
        return self.size * self.num_tensors

    def to_wire(self) -> dict[str, int | list[int]]:
        out: dict[str, int | list[int]] = {"n": self.num_tensors, "shape": list(self.shape),
                                           "dtype": int(self.dtype), "placement": int(self.placement)}
        if self.block_stride is not None:
            out["block_stride"] = self.block_stride
        if self.head_axis is not None:
            out["head_axis"] = self.head_axis
        return out

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> CacheDesc:   # Any: a peer's JSON, checked here
        return cls(d["n"], tuple(d["shape"]), DataType(d["dtype"]), Placement(d["placement"]),
                   block_stride=d.get("block_stride"), head_axis=d.get("head_axis"))


class Cache:
    """A registered (or engine-allocated) cache. Not built by users.

    ``cache_id`` is the id peers use in :class:`CacheIndex` / :class:`BlocksCacheKey`;
    ``tensors`` are numpy views of the memory; ``tensor_addrs`` their addresses.
    """

    __slots__ = ("cache_id", "desc", "tensors", "tensor_addrs", "_regions", "_keep",
                 "_shared", "_valid", "__weakref__")

    def __init__(self, cache_id: int, desc: CacheDesc, tensors: list[NDArray[Any]], tensor_addrs: list[int],
                 regions: list[tuple[int, int]], keep: object,
                 shared: tuple[int, int, int] | None = None) -> None:
        self.cache_id = cache_id
        self.desc = desc
        self.tensors = tensors
        self.tensor_addrs = tensor_addrs
        self._regions = regions      # per tensor: (native region id, byte offset in region)
        self._keep = keep            # owner of the memory (kept alive while in flight)
        self._shared = shared        # memfd (fd, nbytes, stride) when the cache is shareable
        self._valid = True

    @property
    def cache_desc(self) -> CacheDesc:  # LLM-DataDist's spelling
        return self.desc

    def __repr__(self) -> str:
        return f"Cache(cache_id={self.cache_id}, desc={self.desc})"


@dataclass(frozen=True, slots=True)
class CacheIndex:
    """Names a remote cache row: the peer's cluster id, its cache id, a batch row."""
    cluster_id: int
    cache_id: int
    batch_index: int = 0


PADDING_REQ_ID = _U64   # LLM-DataDist: a key with this req_id pads an unused batch row


@dataclass(frozen=True, slots=True)
class CacheKey:
    """Names batch rows by request: ``(cluster_id, req_id, model_id)``, each a uint64.

    ``cluster_id`` is the cluster that bound the key to one of its rows (the prefill
    side when decode pulls by it; LLM-DataDist's ``prompt_cluster_id``). A key with
    ``req_id == 2**64-1`` is padding: in a ``cache_keys`` list it leaves its row
    unbound, and it names no row. ``model_id`` tells apart keys of one request in
    several caches (K, V, ... of one model each). Numpy integers are accepted and
    stored as ``int``; anything else, or a value outside [0, 2**64-1], raises
    ``LLMParamInvalidError``.
    """
    cluster_id: int
    req_id: int
    model_id: int = 0

    def __post_init__(self) -> None:
        for name in ("cluster_id", "req_id", "model_id"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) <= _U64:
                raise param_invalid(f"CacheKey.{name} must be an int in [0, 2**64-1] (uint64), got {v!r}")
            object.__setattr__(self, name, int(v))

    @property
    def is_padding(self) -> bool:
        """True for a padding key (``req_id == 2**64-1``): it binds and names no row."""
        return self.req_id == PADDING_REQ_ID

    def wire(self) -> tuple[int, int, int]:
        """``(cluster_id, req_id, model_id)``: the key in control messages and tables."""
        return (self.cluster_id, self.req_id, self.model_id)


@dataclass(frozen=True, slots=True)
class BlocksCacheKey:
    """Names a remote block cache: the peer's cluster id and its cache id."""
    cluster_id: int
    cache_id: int


@dataclass(frozen=True, slots=True)
class KvCacheExtParam:
    """Layer ranges: an inclusive ``(first, last)`` tuple (``(-1, -1)`` = all layers) or a
    half-open ``range`` with step 1. A layer is ``tensor_num_per_layer`` consecutive tensors.
    Head ranges (block transfers, caches with a ``head_axis``) are written the same way."""
    src_layer_range: tuple[int, int] | range = (-1, -1)
    dst_layer_range: tuple[int, int] | range = (-1, -1)
    tensor_num_per_layer: int = 2
    src_head_range: tuple[int, int] | range = (-1, -1)
    dst_head_range: tuple[int, int] | range = (-1, -1)


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """A peer to link: its cluster id and its control address ``"host:port"``."""
    remote_cluster_id: int
    address: str = ""


class SupportsDLPack(Protocol):
    """A tensor numpy can read (``np.from_dlpack``): a CPU torch tensor, for one."""
    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...


# A block table: ints, a 1-D numpy integer array, or a 1-D integer CPU tensor (plan.block_ids)
BlockTable = Union[Sequence[int], "NDArray[np.integer[Any]]", SupportsDLPack]

