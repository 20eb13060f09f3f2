"""Plain data types of the public API (pure Python, no native code).

Names and fields follow LLM-DataDist V2 (``CacheDesc``, ``CacheIndex``, ``CacheKey``,
``BlocksCacheKey``, ``KvCacheExtParam``, ``ClusterInfo``); see
docs/api.md for the rules each field obeys.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, Sequence, SupportsIndex, Union

import numpy as np
from numpy.typing import DTypeLike, NDArray

from .status import LLMParamInvalidError, _NamedIntEnum

__all__ = [
    "Role", "Placement", "DataType", "CacheDesc", "Cache", "CacheIndex", "CacheKey",
    "BlocksCacheKey", "KvCacheExtParam", "ClusterInfo", "EngineOptions",
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


def _env_secret() -> bytes | None:
    v = os.environ.get("KVENGINE_SECRET")
    return v.encode() if v else None


def _env_auto_ucx() -> bool | None:
    v = os.environ.get("KVENGINE_AUTO_UCX", "").strip().lower()
    return None if v in ("", "rdma") else v not in ("0", "false", "no", "off")


@dataclass(slots=True)
class EngineOptions:
    """Engine settings. Times are in seconds.

    sync_kv_timeout: default deadline of a transfer (LLM-DataDist's 1000 ms).
    link_timeout: default deadline of link/unlink calls.
    secret: shared secret for authenticated links (default: ``$KVENGINE_SECRET``).
    insecure: without a secret, an engine links only with engines on its own host (the
      peer's address is 127.0.0.1, ::1 or the connection's own local address); ``True``
      links with anyone who reaches the port, unauthenticated: any such host can then
      read and write every registered cache. Default False (docs/security.md).
    transport: ``"auto"`` (local in one process, shm on one host, tcp across hosts),
      ``"local"``, ``"shm"``, ``"tcp"`` or ``"ucx"`` (forced; both ends must agree or say
      auto). ``"ucx"``: one-sided puts and gets through UCX (``pip install "kvengine[ucx]"``;
      ``UCX_TLS`` and the other ``UCX_*`` settings pass through; docs/tuning.md).
    auto_ucx: whether this engine lets ``"auto"`` pick ``"ucx"`` across hosts (it does
      when both ends allow it, else tcp; on one host never): True, False, or None
      (default) = when this host has an RDMA device (``/sys/class/infiniband``), since
      UCX over plain TCP is slower than kvengine's tcp (docs/benchmarks.md, "UCX").
      Default ``$KVENGINE_AUTO_UCX`` (``1``/``true``/``yes``/``on``: True, ``0``/``false``/
      ``no``/``off``: False, unset: None).
    movers: native copy threads.
    inline_threshold: transfers of at most this many bytes are copied on the calling
      thread (a cross-core thread wake-up costs more than the copy).
    chunk_bytes: the unit a mover copies before it checks for an abort (fence granularity),
      and the payload of one TCP data frame.
    tcp_streams: TCP data connections per link (large transfers are striped over them).
    tcp_window_bytes: per TCP link, push bytes sent but not yet consumed by the receiver
      (it CREDITs every data frame it took off the socket); 0: no limit. Paces large
      pushes in the I/O thread, without a Python round trip (default 4 MiB, see
      docs/tuning.md).
    heartbeat_interval / heartbeat_timeout: a peer silent for heartbeat_timeout is lost
      (``LLM_LINK_FAILED``); pings go out every heartbeat_interval.
    scheduling: ``"edf"`` (priority, then earliest deadline first) or ``"fifo"`` (arrival order).
    max_inflight_bytes: per link, bytes handed to the native core at once; the rest waits
      in the link's queue, in scheduling order (default None: no limit; the core's queues
      keep the scheduling order chunk by chunk, docs/tuning.md).
    piece_bytes: transfers are handed over in pieces of at most this many bytes
      (default None: whole).
    max_queued: transfers queued or in flight at once; more fail ``LLM_OUT_OF_MEMORY``.
    max_notifications: received notifications kept until read (oldest dropped beyond).
    """
    sync_kv_timeout: float = 1.0
    link_timeout: float = 3.0
    secret: bytes | None = field(default_factory=_env_secret)
    transport: str = "auto"
    auto_ucx: bool | None = field(default_factory=_env_auto_ucx)
    movers: int = 2
    inline_threshold: int = 256 * 1024
    chunk_bytes: int = 1 << 20
    tcp_streams: int = 4
    tcp_window_bytes: int = 4 << 20
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 2.0
    scheduling: str = "edf"
    max_inflight_bytes: int | None = None
    piece_bytes: int | None = None
    max_queued: int = 1 << 16
    max_notifications: int = 1 << 16
    insecure: bool = False

    def __post_init__(self) -> None:
        for name in ("sync_kv_timeout", "link_timeout", "heartbeat_interval", "heartbeat_timeout"):
            v = getattr(self, name)
            if v is None:   # an option has no default to fall back on
                raise param_invalid(f"EngineOptions.{name} must be a positive, finite number of seconds")
            check_timeout(v, 0.0, f"EngineOptions.{name}")
        if self.transport not in ("auto", "local", "shm", "tcp", "ucx"):
            raise param_invalid("EngineOptions.transport must be 'auto', 'local', 'shm', 'tcp' or 'ucx', "
                                f"got {self.transport!r}")
        if self.auto_ucx is not None and not isinstance(self.auto_ucx, bool):
            raise param_invalid(f"EngineOptions.auto_ucx must be True, False or None, got {self.auto_ucx!r}")
        _check_int("EngineOptions.tcp_streams", self.tcp_streams, 1, 16)
        if isinstance(self.tcp_window_bytes, bool) or self.tcp_window_bytes != 0:
            _check_int("EngineOptions.tcp_window_bytes", self.tcp_window_bytes, 64 << 10, 1 << 40)
        if self.scheduling not in ("edf", "fifo"):
            raise param_invalid(f"EngineOptions.scheduling must be 'edf' or 'fifo', got {self.scheduling!r}")
        if self.max_inflight_bytes is not None:
            _check_int("EngineOptions.max_inflight_bytes", self.max_inflight_bytes, 4096, 1 << 40)
        if self.piece_bytes is not None:
            _check_int("EngineOptions.piece_bytes", self.piece_bytes, 4096, 1 << 40)
        _check_int("EngineOptions.max_queued", self.max_queued, 1, 1 << 24)
        _check_int("EngineOptions.max_notifications", self.max_notifications, 1, 1 << 24)
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise param_invalid("EngineOptions.heartbeat_timeout must exceed heartbeat_interval")
        _check_int("EngineOptions.movers", self.movers, 1, 64)
        _check_int("EngineOptions.inline_threshold", self.inline_threshold, 0, 1 << 30)
        # at most the TCP receiver's frame limit (64 MiB): a chunk is one data frame
        _check_int("EngineOptions.chunk_bytes", self.chunk_bytes, 4096, 64 << 20)
        if self.secret is not None and not isinstance(self.secret, (bytes, bytearray)):
            raise param_invalid("EngineOptions.secret must be bytes")
        if not isinstance(self.insecure, bool):
            raise param_invalid(f"EngineOptions.insecure must be a bool, got {self.insecure!r}")


class SupportsDLPack(Protocol):
    """A tensor numpy can read (``np.from_dlpack``): a CPU torch tensor, for one."""
    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...


# A block table: ints, a 1-D numpy integer array, or a 1-D integer CPU tensor (plan.block_ids)
BlockTable = Union[Sequence[int], "NDArray[np.integer[Any]]", SupportsDLPack]

