"""LLM-DataDist's Python types: statuses, exception, config, cluster info, cache descriptions and keys.

Names, fields and checks follow LLM-DataDist V2's Python package (see
docs/llm_datadist.md); each maps onto a kvengine type.
"""

from __future__ import annotations

import json
import socket
import struct
from enum import Enum
from typing import Any, Iterable

import kvengine as kv
from kvengine import DataType, LLMStatusCode, Placement
from kvengine.types import Role as LLMRole

__all__ = ["LLMStatusCode", "LLMRole", "DataType", "Placement", "LLMException", "Status", "LLMConfig",
           "LLMClusterInfo", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey",
           "RegisterMemStatus", "Memtype", "MemInfo", "raise_llm"]

U64 = 2**64 - 1
_I64 = 2**63 - 1
_U32 = 2**32 - 1


class LLMException(RuntimeError):
    """LLM-DataDist's exception: ``.status_code`` is the :class:`LLMStatusCode`."""

    def __init__(self, message: str = "", status_code: int = LLMStatusCode.LLM_FAILED) -> None:
        super().__init__(message)
        self._status_code = kv.status.to_status(status_code)

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code

    def __str__(self) -> str:
        return f"[{self._status_code.name}] {super().__str__()}"


def raise_llm(e: kv.LLMError) -> LLMException:
    """The LLMException for a kvengine error (raise it ``from e``)."""
    return LLMException(e.message, e.status)


def param_invalid(message: str) -> LLMException:
    return LLMException(message, LLMStatusCode.LLM_PARAM_INVALID)


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise param_invalid(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


class Status:
    """A status with ``is_ok()`` (LLM-DataDist's ``Status``)."""

    def __init__(self, status: int) -> None:
        self._status = kv.status.to_status(status)

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status

    def is_ok(self) -> bool:
        return self._status == LLMStatusCode.LLM_SUCCESS

    def __repr__(self) -> str:
        return f"Status({self._status.name})"


class RegisterMemStatus(Enum):
    OK = 0
    PREPARING = 1
    FAILED = 2


class Memtype(Enum):
    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class MemInfo:
    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        self.mem_type, self.addr, self.size = mem_type, addr, size


class LLMConfig:
    """Options for :meth:`LLMDataDist.init`: set properties, then ``generate_options()``.

    Only ``device_id`` (required, not used: kvengine moves host memory),
    ``sync_kv_timeout`` (ms), ``listen_ip_info`` (``"ip:port"``),
    ``enable_cache_manager`` / ``local_comm_res`` (either selects CacheManager
    mode, the only one offered) change anything here; the others are accepted,
    checked and passed on as LLM-DataDist spells them.
    """

    _KEYS = {"sync_kv_timeout": "llm.SyncKvCacheWaitTime", "enable_cache_manager": "llm.EnableCacheManager",
             "enable_remote_cache_accessible": "llm.EnableRemoteCacheAccessible",
             "mem_pool_cfg": "llm.MemPoolConfig", "host_mem_pool_cfg": "llm.HostMemPoolConfig",
             "buf_pool_cfg": "llm.BufPoolCfg", "enable_switch_role": "llm.EnableSwitchRole",
             "link_total_time": "llm.LinkTotalTime", "link_retry_count": "llm.LinkRetryCount",
             "rdma_traffic_class": "llm.RdmaTrafficClass", "rdma_service_level": "llm.RdmaServiceLevel",
             "local_comm_res": "llm.LocalCommRes", "transfer_backend": "llm.TransferBackend",
             "global_resource_config": "llm.GlobalResourceConfig", "mem_utilization": "llm.MemoryUtilization",
             "cluster_info": "llm.ClusterInfo", "output_max_size": "llm.OutputMaxSize",
             "deploy_res_path": "llm.deployResPath"}

    def __init__(self) -> None:
        self.device_id: int | list[int] | None = None
        self.listen_ip_info: str | None = None
        self.ge_options: dict[str, str] = {}
        for name in self._KEYS:
            setattr(self, name, None)

    def generate_options(self) -> dict[str, str]:
        o: dict[str, str] = {}
        if self.device_id is not None:
            ids = self.device_id if isinstance(self.device_id, list) else [self.device_id]
            for d in ids:
                check_int("device_id", d, 0, 2**31 - 1)
            o["ge.exec.deviceId"] = o["ge.session_device_id"] = ";".join(str(d) for d in ids)
        if self.listen_ip_info is not None:
            ip, sep, port = str(self.listen_ip_info).rpartition(":")
            if not sep or not ip or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise param_invalid(f"listen_ip_info must be 'ip:port', got {self.listen_ip_info!r}")
            o["llm.ListenIp"], o["llm.ListenPort"] = ip, port
        for name, key in self._KEYS.items():
            v = getattr(self, name)
            if v is None:
                continue
            if name == "sync_kv_timeout":
                check_int("sync_kv_timeout", int(v), 1, 2**31 - 1)
            o[key] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        o.update({str(k): str(v) for k, v in self.ge_options.items()})
        return o


def _ip_str(ip: Any) -> str:
    if isinstance(ip, int) and not isinstance(ip, bool):
        return socket.inet_ntoa(struct.pack("<I", ip))   # LLM-DataDist packs inet_aton little-endian
    if not isinstance(ip, str) or not ip:
        raise param_invalid(f"ip must be a non-empty str or an int, got {ip!r}")
    return ip


class LLMClusterInfo:
    """A peer to link or unlink: ``remote_cluster_id`` and its listen ip:port."""

    def __init__(self) -> None:
        self.remote_cluster_id = 0
        self.remote_role_type = 0
        self.local_ip_infos: list[tuple[str, int]] = []
        self.remote_ip_infos: list[tuple[str, int]] = []

    def append_local_ip_info(self, ip: Any, port: int) -> None:
        self.local_ip_infos.append((_ip_str(ip), check_int("port", port, 0, 65535)))

    def append_remote_ip_info(self, ip: Any, port: int) -> None:
        self.remote_ip_infos.append((_ip_str(ip), check_int("port", port, 0, 65535)))

    def to_kv(self, need_address: bool) -> kv.ClusterInfo:
        cid = check_int("remote_cluster_id", self.remote_cluster_id, 0, U64)
        if not self.remote_ip_infos:
            if need_address:
                raise param_invalid("link needs append_remote_ip_info(ip, port)")
            return kv.ClusterInfo(cid, "")
        if len(self.remote_ip_infos) > 1 or len(self.local_ip_infos) > 1:
            raise param_invalid("one local and one remote ip info at most")
        ip, port = self.remote_ip_infos[0]
        return kv.ClusterInfo(cid, f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")


class CacheDesc:
    """``num_tensors`` tensors of ``shape`` and ``data_type`` (LLM-DataDist's defaults: DEVICE placement)."""

    def __init__(self, num_tensors: int, shape: Iterable[int], data_type: DataType,
                 placement: Placement = Placement.DEVICE, batch_dim_index: int = 0, seq_len_dim_index: int = -1,
                 kv_tensor_format: str | None = None) -> None:
        self.num_tensors = check_int("num_tensors", num_tensors, 0, _U32)
        self.shape = list(shape)
        self.data_type = DataType(data_type.value if isinstance(data_type, Enum) else data_type)
        self.placement = Placement(placement.value if isinstance(placement, Enum) else placement)
        if not 0 <= batch_dim_index < len(self.shape):
            raise param_invalid(f"batch_dim_index {batch_dim_index} is not a dim of {self.shape}")
        if seq_len_dim_index != -1 and not 0 <= seq_len_dim_index < len(self.shape):
            raise param_invalid(f"seq_len_dim_index {seq_len_dim_index} is not a dim of {self.shape}")
        self.batch_dim_index, self.seq_len_dim_index = batch_dim_index, seq_len_dim_index
        self.kv_tensor_format = kv_tensor_format

    @property
    def batch_size(self) -> int:
        return int(self.shape[self.batch_dim_index])

    @property
    def size(self) -> int:
        """Bytes of one tensor."""
        n = self.data_type.itemsize
        for d in self.shape:
            n *= d
        return n

    def to_kv(self) -> kv.CacheDesc:
        """The kvengine description; DEVICE placement is LLM_FEATURE_NOT_ENABLED."""
        if self.placement == Placement.DEVICE:
            raise LLMException("Placement.DEVICE: kvengine moves host memory only; use Placement.HOST and "
                               "CPU tensors (docs/llm_datadist.md)", LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        if self.batch_dim_index != 0:
            raise LLMException("batch_dim_index must be 0 (dim 0 is the batch or block count in kvengine)",
                               LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        try:
            return kv.CacheDesc(self.num_tensors, self.shape, self.data_type, Placement.HOST)
        except kv.LLMError as e:
            raise raise_llm(e) from e

    def __repr__(self) -> str:
        return (f"CacheDesc(num_tensors={self.num_tensors}, shape={self.shape}, data_type={self.data_type}, "
                f"placement={self.placement})")


def _valid_id(x: int) -> bool:
    return 0 <= x < U64


class CacheKey:
    """A request's row: ``CacheKey(prompt_cluster_id, req_id, model_id=0, prefix_id=2**64-1)``."""

    def __init__(self, prompt_cluster_id: int | None = None, req_id: int = U64, model_id: int = 0,
                 prefix_id: int = U64, *, cluster_id: int | None = None) -> None:
        if (prompt_cluster_id is None) == (cluster_id is None):
            raise TypeError("give prompt_cluster_id (or cluster_id) once")
        cid = prompt_cluster_id if prompt_cluster_id is not None else cluster_id
        self.prompt_cluster_id = check_int("cluster_id", cid, 0, U64)
        self.req_id = check_int("req_id", req_id, 0, U64)
        self.model_id = check_int("model_id", model_id, 0, U64)
        self.prefix_id = check_int("prefix_id", prefix_id, 0, U64)
        if _valid_id(self.req_id) == _valid_id(self.prefix_id):
            raise param_invalid("exactly one of req_id and prefix_id must be valid (< 2**64-1)")

    @property
    def cluster_id(self) -> int:
        return self.prompt_cluster_id

    def _t(self) -> tuple[int, int, int, int]:
        return self.prompt_cluster_id, self.req_id, self.model_id, self.prefix_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheKey) and self._t() == other._t()

    def __hash__(self) -> int:
        return hash(self._t())

    def __repr__(self) -> str:
        return f"CacheKey(cluster_id={self.prompt_cluster_id}, req_id={self.req_id}, model_id={self.model_id})"


class CacheKeyByIdAndIndex:
    """The peer's cache by id: ``CacheKeyByIdAndIndex(cluster_id, cache_id, batch_index=0)``."""

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        self.cluster_id = check_int("cluster_id", cluster_id, 0, U64)
        self.cache_id = check_int("cache_id", cache_id, -2**63, _I64)
        self.batch_index = check_int("batch_index", batch_index, 0, _U32)

    def __repr__(self) -> str:
        return f"CacheKeyByIdAndIndex({self.cluster_id}, {self.cache_id}, {self.batch_index})"


class BlocksCacheKey:
    """A block cache by model id: ``BlocksCacheKey(prompt_cluster_id, model_id=0)``."""

    def __init__(self, prompt_cluster_id: int | None = None, model_id: int = 0, *,
                 cluster_id: int | None = None) -> None:
        if (prompt_cluster_id is None) == (cluster_id is None):
            raise TypeError("give prompt_cluster_id (or cluster_id) once")
        cid = prompt_cluster_id if prompt_cluster_id is not None else cluster_id
        self.prompt_cluster_id = check_int("cluster_id", cid, 0, U64)
        self.model_id = check_int("model_id", model_id, 0, U64)

    @property
    def cluster_id(self) -> int:
        return self.prompt_cluster_id

    def __repr__(self) -> str:
        return f"BlocksCacheKey({self.prompt_cluster_id}, model_id={self.model_id})"


def dumps(table: dict[str, dict[int, int]]) -> bytes:
    return json.dumps({k: {str(a): b for a, b in v.items()} for k, v in table.items()}).encode()


def loads(raw: bytes) -> dict[str, dict[int, int]]:
    d = json.loads(raw)
    return {k: {int(a): int(b) for a, b in v.items()} for k, v in d.items()}
