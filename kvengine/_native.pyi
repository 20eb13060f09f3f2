"""Type stub of the compiled core ``kvengine._native`` (source: cython_src/_native.pyx).

Every status is an ``int`` LLM status code (``0`` is success; kvengine/status.py).
``tests/test_types.py`` checks that this stub and the compiled module name the same
functions, constants and ``Core`` methods, with the same parameters.
"""

import array
import mmap
from typing import Any, Callable, Final, Iterator

import numpy as np
from numpy.typing import NDArray

# region kinds (``Core.region_add(kind, ...)``)
REGION_LOCAL: Final[int]
REGION_PROCESS: Final[int]
REGION_TCP: Final[int]
REGION_UCX: Final[int]
UCX: Final[bool]
UCX_TOKEN: Final[int]
# uint64 words per segment in ``Core.submit(segs=...)``
SEG_WORDS: Final[int]
# uint64 words per 2-D segment (``Core.submit(..., words=SEG2_WORDS)``): src_region, src_offset,
# dst_region, dst_offset, row_bytes, rows, src_stride, dst_stride
SEG2_WORDS: Final[int]
# region flags
F_UNMAP: Final[int]
F_EXPORT: Final[int]
F_NOTIFY: Final[int]
# completion flag: the job failed before any byte moved
DONE_UNSTARTED: Final[int]
INLINE_REFUSED: Final[int]
SMALL_CMA_WAIT_NS: Final[int]
# completion job ids with the EVENT bit set are events, not jobs
EVENT: Final[int]
EVENT_LINK_READY: Final[int]
EVENT_LINK_DOWN: Final[int]
EVENT_REGION_FREED: Final[int]
EVENT_ID_MASK: Final[int]
EVENT_KIND_MASK: Final[int]
# TCP data connections per link, at most
MAX_STREAMS: Final[int]
# length of a TCP link token
TOKEN_BYTES: Final[int]

def map_fd(fd: int, length: int) -> tuple[int, int]:
    """mmap a shared read-write view of ``fd``, faulted in for writing: ``(status, addr)``."""

def populate_write(buf: mmap.mmap | NDArray[Any] | bytearray) -> int:
    """Fault every page of ``buf`` in for writing (GIL released): 0 or the errno."""

class Core:
    """One native core: region table, mover threads, completion eventfd."""

    def __init__(self, movers: int = 2, chunk_bytes: int = 1 << 20) -> None: ...
    def fileno(self) -> int: ...
    def region_add(self, kind: int, pid: int, addr: int, length: int, flags: int = 0) -> tuple[int, int]:
        """Returns ``(status, region_id)``."""
    def region_remove(self, region_id: int) -> int: ...
    def region_pidfd(self, region_id: int, pidfd: int, key: int = 0) -> int: ...
    def submit(self, job_id: int, segs: array.array[int] | NDArray[np.uint64] | memoryview, inline_max: int,
               rank: int = 0, lease: int = 0, words: int = 5) -> tuple[int, bool, int]:
        """Start a job: returns ``(status, done_inline, nbytes)``. ``segs``: a C-contiguous buffer
        of uint64 (``array.array("Q")``, a numpy uint64 array, or a memoryview of one),
        ``words`` (SEG_WORDS, or SEG2_WORDS for 2-D segments) words per segment."""
    def lease_add(self, until_ns: int) -> tuple[int, int]:
        """Returns ``(status, lease_id)``."""
    def lease_renew(self, lease_id: int, until_ns: int) -> int: ...
    def lease_remove(self, lease_id: int) -> int: ...
    def lease_busy(self, lease_id: int) -> int: ...
    def wait_take(self, job_id: int, bound_ns: int) -> tuple[int, int, int, int] | None: ...
    def abort(self, job_id: int, status: int) -> int: ...
    def reap(self, bound_ns: int) -> list[int]: ...
    def poll(self) -> list[tuple[int, int, int, int]]:
        """Ready completions: ``[(job_id, status, nbytes, flags), ...]``."""
    def close(self) -> None: ...
    def release(self) -> None: ...
    def tcp_listen(self, ip: str, port: int) -> tuple[int, int]:
        """Returns ``(status, bound_port)``."""
    def tcp_link_add(self, link_id: int, token: bytes, nstreams: int, window: int = 0,
                     lease: float = 0.8, fence: float = 1.0, margin: float = 0.1) -> int: ...
    def tcp_conn_add(self, fd: int, link_id: int) -> int: ...
    def tcp_link_close(self, link_id: int, status: int) -> int: ...
    def ucx_address(self) -> tuple[int, bytes]: ...
    def ucx_mem_map(self, region_id: int) -> int: ...
    def ucx_link_add(self, link_id: int, address: bytes, rx_token: bytes, tx_token: bytes,
                     window: int = 0, fence: float = 1.0, lease: float = 1.0, margin: float = 0.05,
                     peer_pull2d: bool = False, peer_pullv: bool = False, peer_pushv: bool = False) -> int: ...
    def ucx_test_send(self, link_id: int, header: bytes, data: bytes = b"", rndv: bool = False) -> int: ...
    def ucx_link_close(self, link_id: int, status: int) -> int: ...
    def stats(self) -> dict[str, int]: ...

# --- the loop thread's hot path and the accounting's counters (cython_src/_fast.pxi) ---

class Histogram:
    """Latency histogram with log buckets (ratio 2**0.25, from 1 us to ~1.2 h), in C."""

    n: Final[int]
    total: Final[float]
    def record(self, seconds: float) -> None: ...
    @property
    def counts(self) -> list[int]: ...
    def upper(self, i: int) -> float: ...
    def quantile(self, q: float) -> float: ...
    def summary(self) -> dict[str, float]: ...

class Counts:
    """Counters and histograms of finished transfers (all, or one peer's)."""

    queue: Final[Histogram]
    transfer: Final[Histogram]
    total: Final[Histogram]
    hists: Final[dict[str, Histogram]]
    def add(self, name: str, nbytes: int) -> None: ...
    def times(self, queue_s: float, transfer_s: float, total_s: float) -> None: ...
    def _bench(self, n: int, seconds: float) -> None: ...
    @property
    def transfers(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def by_status(self) -> dict[str, int]: ...
    def summary(self) -> dict[str, object]: ...

class FastPath:
    """An engine's native hot path of awaited inline pushes and pulls."""

    taken: Final[int]
    launched: Final[int]
    def __init__(self, loop: object, core: Core, options: object, jobs: Iterator[int],
                 caches: dict[int, Any], links: dict[Any, Any], memo: dict[Any, Any], whole: Counts,
                 peer: Callable[[tuple[int, str]], Counts], failed: Callable[..., Any],
                 sched: Any, lease_low_ns: int, t_cache: type, t_index: type,
                 t_ext: type) -> None: ...
    def push(self, cache: object, where: object, src_batch_index: object, size: object, ext_param: object,
             timeout: object, priority: object, notify: object) -> Any:
        """None: not the fast path's; 0: done (success); else a Transfer (a finished failed
        one, or a tcp transfer launched)."""
    def pull(self, where: object, cache: object, batch_index: object, size: object, ext_param: object,
             timeout: object, priority: object) -> Any: ...
    def forget(self) -> None: ...

def plan_blocks_packed(sbl: NDArray[np.int64], dbl: NDArray[np.int64], src_blocks: int, dst_blocks: int,
                       reg: NDArray[np.uint64], src_stride: int, dst_stride: int, nbytes: int,
                       runs: bool) -> tuple[NDArray[np.uint64], int] | None:
    """kvengine/plan.py's Planner.blocks of whole blocks in one pass of C: ``(flat 5-word
    segments, bytes)``, or None if a rule is broken (plan.py then says which)."""
