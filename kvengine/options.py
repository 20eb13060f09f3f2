"""EngineOptions: every engine setting, its default and its check (pure Python).

The one place an option's meaning, default and bounds are written; the parts read
the validated fields and never check them again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .types import _check_int, check_timeout, param_invalid

__all__ = ["EngineOptions"]


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
      auto). ``"ucx"``: UCX active messages that the target checks, as tcp frames (docs/decisions.md
      #27; ``pip install libucx-cu12`` before kvengine is built: docs/tuning.md;
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
    inline_threshold: int = 1 << 20
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
