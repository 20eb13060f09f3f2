"""The transfer planner: pure functions, no I/O, no native code.

Every parameter rule of the cache API lives here, once. A plan is a list of
segments ``(src_tensor, src_offset, dst_tensor, dst_offset, nbytes)`` with
offsets in bytes inside one tensor; the engine maps tensors to native regions
and :func:`coalesce` merges segments that touch in memory.

Rules (LLM-DataDist V2, docs/api.md):
- a layer is ``tensor_num_per_layer`` consecutive tensors (K0, V0, K1, V1, ...);
- a layer range is an inclusive ``(first, last)`` tuple, ``(-1, -1)`` meaning all
  layers, or a half-open ``range`` with step 1; both sides span the same count;
- without an ext param every tensor maps to the tensor of the same index;
- push's ``size`` must be -1; pull's ``size`` is bytes per tensor or -1;
- block lists are non-empty, of equal length, in range, with no repeated
  destination block; runs of consecutive blocks move as one segment where blocks
  are contiguous on both sides (no ``block_stride``);
- head ranges (block transfers only) are written like layer ranges, over the
  ``head_axis`` of caches that name one; both span the same count of heads, and
  the two blocks have the same rows (tokens) and head size: each block moves as
  one 2-D segment (rows of the range's heads), a run of contiguous blocks as one;
- a transfer's priority is an int in [-1000, 1000], its notification at most
  4096 bytes, its timeout finite and positive (types.check_timeout).

:class:`Planner` maps a plan onto native regions, packs it for the core and
memoizes row plans; it is the engine's only planning state. Block tables
(lists, numpy integer arrays, CPU tensors through ``__dlpack__``) are checked
and planned vectorised (:func:`check_blocks`, :meth:`Planner.blocks`): numpy
over the runs, a Python step per tensor pair, none per block or segment.
"""

from __future__ import annotations

import array
import numbers
from typing import Any, Callable, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from . import layout
from .layout import block_runs, coalesce, run_arrays
from .status import LLMError
from .types import CacheDesc, KvCacheExtParam, check_timeout, param_invalid

_packed: Callable[..., tuple[NDArray[np.uint64], int] | None] | None
try:
    from .native import _native
    _packed = _native.plan_blocks_packed
except ImportError:   # the planner works without a build (tests/test_status.py): numpy only
    _packed = None

__all__ = ["Segment", "Packed", "Planner", "block_ids", "check_blocks", "layer_tensors", "plan_cache", "plan_blocks", "coalesce", "block_runs", "run_arrays",
           "check_tensor_num_per_layer", "head_split", "transfer_options", "check_notify", "MAX_NOTIFY"]

Segment = tuple[int, int, int, int, int]  # (src_tensor, src_offset, dst_tensor, dst_offset, nbytes)
# A packed plan for the core: 5 uint64 words per segment (src_region, src_off, dst_region, dst_off, nbytes)
Packed = Union["array.array[int]", "NDArray[np.uint64]"]

_I64_MAX = 2**63 - 1
_MAX_TNPL = 255     # LLM-DataDist's tensor_num_per_layer is a uint8
MAX_NOTIFY = 4096   # bytes of one push notification


def _is_int(v: Any) -> bool:   # numbers.Integral: numpy ints too
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _check_op(op: str) -> None:
    if op not in ("push", "pull"):
        raise ValueError(f"op must be 'push' or 'pull', got {op!r}")


def check_tensor_num_per_layer(tnpl: Any, *descs: tuple[str, CacheDesc]) -> int:
    """``tensor_num_per_layer``: an int in [1, 255] dividing each ``(side, desc)``'s num_tensors."""
    if not _is_int(tnpl) or not 1 <= int(tnpl) <= _MAX_TNPL:
        raise param_invalid(f"tensor_num_per_layer must be an int in [1, {_MAX_TNPL}], got {tnpl!r}")
    n = int(tnpl)
    for side, desc in descs:
        if desc.num_tensors % n:
            raise param_invalid(
                f"tensor_num_per_layer {n} must divide the {side}'s num_tensors {desc.num_tensors}")
    return n


def transfer_options(timeout: Any, default_timeout: float, priority: Any,
                     notify: Any) -> tuple[float, int, bytes | None]:
    """``(timeout, priority, notify)`` of a push or pull, checked."""
    tmo = check_timeout(timeout, default_timeout)
    if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
        raise param_invalid(f"priority must be an int in [-1000, 1000], got {priority!r}")
    return tmo, priority, check_notify(notify)


def check_notify(notify: Any) -> bytes | None:
    """A push's notification: None, or bytes of at most MAX_NOTIFY."""
    if notify is None:
        return None
    if not isinstance(notify, (bytes, bytearray)) or len(notify) > MAX_NOTIFY:
        raise param_invalid(f"notify must be bytes of at most {MAX_NOTIFY}, got {type(notify).__name__}"
                            + (f" of {len(notify)}" if isinstance(notify, (bytes, bytearray)) else ""))
    return bytes(notify)


def layer_tensors(desc: CacheDesc, layer_range: Any, tnpl: int, what: str) -> range:
    """Tensor indices covered by ``layer_range`` in a cache of ``desc``."""
    tnpl = check_tensor_num_per_layer(tnpl, ("cache", desc))
    num_layers = desc.num_tensors // tnpl
    if layer_range is None:
        return range(0, num_layers * tnpl)
    r = _span(layer_range, num_layers, what, "layer",
              f" (num_tensors {desc.num_tensors} / tensor_num_per_layer {tnpl})")
    return range(r.start * tnpl, r.stop * tnpl)


def _span(r: Any, count: int, what: str, unit: str, why: str = "") -> range:
    """A layer or head range (inclusive tuple, (-1, -1) = all, or a half-open range) in
    [0, count), as a half-open range."""
    if isinstance(r, range):
        if r.step != 1:
            raise param_invalid(f"{what} must have step 1, got {r!r}")
        if not 0 <= r.start < r.stop <= count:
            raise param_invalid(f"{what} {r!r} must satisfy 0 <= start < stop <= {count}{why}")
        return r
    if isinstance(r, (tuple, list)) and len(r) == 2 and all(_is_int(v) for v in r):
        first, last = int(r[0]), int(r[1])
        if first == -1 and last == -1:
            return range(0, count)
        if not 0 <= first <= last <= count - 1:
            raise param_invalid(f"{what} {tuple(r)!r} must be (-1, -1) or satisfy "
                                f"0 <= first <= last <= max {unit} index {count - 1}")
        return range(first, last + 1)
    raise param_invalid(f"{what} must be an inclusive (first, last) tuple of ints or a range, got {r!r}")


def _all(r: Any) -> bool:
    return isinstance(r, (tuple, list)) and len(r) == 2 and _is_int(r[0]) and _is_int(r[1]) \
        and int(r[0]) == -1 and int(r[1]) == -1


def head_split(src: CacheDesc, dst: CacheDesc, ext: KvCacheExtParam | None
               ) -> tuple[int, int, tuple[int, int], tuple[int, int]] | None:
    """The head-range rules: None when whole blocks move, else ``(row_bytes, rows,
    (src start, dst start) in a block, (src, dst) row strides)`` in bytes."""
    if ext is None or (_all(ext.src_head_range) and _all(ext.dst_head_range)):
        return None
    (rs, hs, bs), (rd, hd, bd) = layout.block_geometry(src, "source"), layout.block_geometry(dst, "destination")
    if rs != rd:
        raise param_invalid(f"head ranges: source blocks hold {rs} rows (tokens) before the head axis, "
                            f"destination blocks {rd}: must be equal")
    if bs != bd:
        raise param_invalid(f"head ranges: a source head is {bs} bytes, a destination head {bd}: "
                            "head_dim (and dtype) must be equal")
    s = _span(ext.src_head_range, hs, "src_head_range", "head", f" (source kv heads {hs})")
    d = _span(ext.dst_head_range, hd, "dst_head_range", "head", f" (destination kv heads {hd})")
    if len(s) != len(d):
        raise param_invalid(f"src_head_range spans {len(s)} heads, dst_head_range {len(d)}: "
                            "spans must be equal (a destination block holding fewer heads needs "
                            "src_head_range, a source holding fewer dst_head_range)")
    if len(s) == hs == hd:
        return None
    return len(s) * bs, rs, (s.start * bs, d.start * bd), (hs * bs, hd * bd)


def _tensor_pairs(src: CacheDesc, dst: CacheDesc, ext: KvCacheExtParam | None) -> list[tuple[int, int]]:
    if src.dtype != dst.dtype:
        raise param_invalid(f"source dtype {src.dtype.name} differs from destination dtype {dst.dtype.name}")
    if ext is None:
        if src.num_tensors != dst.num_tensors:
            raise param_invalid(
                f"source has {src.num_tensors} tensors, destination {dst.num_tensors}: "
                "give layer ranges (KvCacheExtParam) to map a subset")
        return [(i, i) for i in range(src.num_tensors)]
    if not isinstance(ext, KvCacheExtParam):
        raise param_invalid(f"ext_param must be a KvCacheExtParam, got {type(ext).__name__}")
    tnpl = check_tensor_num_per_layer(ext.tensor_num_per_layer, ("source", src), ("destination", dst))
    s = layer_tensors(src, ext.src_layer_range, tnpl, "src_layer_range")
    d = layer_tensors(dst, ext.dst_layer_range, tnpl, "dst_layer_range")
    if len(s) != len(d):
        raise param_invalid(
            f"src_layer_range spans {len(s) // tnpl} layers, dst_layer_range {len(d) // tnpl}: "
            "spans must be equal")
    return list(zip(s, d))


def _check_index(name: str, value: Any, bound: int) -> int:
    if not _is_int(value):
        raise param_invalid(f"{name} must be an int, got {value!r}")
    v = int(value)
    if not 0 <= v < bound:
        raise param_invalid(f"{name} {v} out of range [0, {bound})")
    return v


def plan_cache(src: CacheDesc, dst: CacheDesc, src_batch: int, dst_batch: int, size: int,
               ext: KvCacheExtParam | None, *, op: str) -> list[Segment]:
    """Segments of a push (``op="push"``) or pull of one batch row of each tensor."""
    _check_op(op)
    if ext is not None and isinstance(ext, KvCacheExtParam) and not (
            _all(ext.src_head_range) and _all(ext.dst_head_range)):
        raise param_invalid("head ranges apply to block transfers (push_kv_blocks, pull_kv_blocks)")
    sb = _check_index("source batch_index", src_batch, src.shape[0])
    db = _check_index("destination batch_index", dst_batch, dst.shape[0])
    pairs = _tensor_pairs(src, dst, ext)
    srb, drb = src.row_bytes, dst.row_bytes
    if not _is_int(size):
        raise param_invalid(f"size must be an int, got {size!r}")
    size = int(size)
    if op == "push":
        if size != -1:
            raise param_invalid(f"push size must be -1 (whole row), got {size}")
    elif size != -1 and not 0 < size <= min(srb, drb):
        raise param_invalid(
            f"pull size must be -1 or in (0, {min(srb, drb)}] bytes per tensor, got {size}")
    if size == -1:
        if srb != drb:
            raise param_invalid(
                f"source row is {srb} bytes per tensor, destination row {drb}: "
                "rows must be equal (or give a pull size)")
        size = srb
    so, do = sb * src.block_stride_bytes, db * dst.block_stride_bytes
    return [(s, so, d, do, size) for s, d in pairs]


def block_ids(name: str, seq: Any) -> NDArray[np.int64]:
    """A block table as a 1-D int64 array: a list or other sequence of ints, a numpy
    integer array, or a CPU tensor (``__dlpack__``, e.g. torch). Ids are checked later."""
    if not isinstance(seq, np.ndarray) and hasattr(seq, "__dlpack__") and not isinstance(seq, (str, bytes)):
        try:
            seq = np.from_dlpack(seq)
        except (TypeError, ValueError, RuntimeError, BufferError) as e:
            raise param_invalid(f"{name}: a tensor must be on the CPU and readable by numpy ({e})") from None
    if isinstance(seq, np.ndarray):
        if seq.ndim != 1 or seq.dtype.kind not in "iu":
            raise param_invalid(f"{name} must be a 1-D integer array, got {seq.ndim}-D {seq.dtype}")
        if seq.dtype == np.uint64 and seq.size and int(seq.max()) > _I64_MAX:
            _too_big(name, seq)
        return seq.astype(np.int64, copy=False)
    if isinstance(seq, (str, bytes)):
        out: list[Any] = list(seq)
    else:
        try:
            out = list(seq)
        except TypeError:
            raise param_invalid(f"{name} must be a sequence of ints") from None
    types = set(map(type, out))   # C speed; per type, not per block
    for t in types:
        if not ((issubclass(t, int) and not issubclass(t, bool)) or issubclass(t, np.integer)):
            bad = next(v for v in out if type(v) is t)
            raise param_invalid(f"{name} must contain only ints, got {bad!r}")
    if not out:
        return np.empty(0, np.int64)
    try:
        return np.array(out, np.int64)
    except OverflowError:
        _too_big(name, out)
        raise


def _too_big(name: str, seq: Any) -> None:
    """Raise for the first id beyond int64 (no cache has that many blocks)."""
    bad = next(int(v) for v in seq if not -_I64_MAX <= int(v) <= _I64_MAX)
    side = "source" if name.startswith("src") else "destination"
    raise param_invalid(f"{side} block {bad} out of range")


def _check_range(side: str, ids: NDArray[np.int64], bound: int) -> None:
    if int(ids.min()) < 0 or int(ids.max()) >= bound:
        bad = int(ids[(ids < 0) | (ids >= bound)][0])
        raise param_invalid(f"{side} block {bad} out of range [0, {bound})" + (": ids are not negative" if bad < 0 else ""))


def check_blocks(src: CacheDesc, dst: CacheDesc, src_blocks: Any,
                 dst_blocks: Any) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """The block-list rules, vectorised: both tables as int64 arrays, or LLM_PARAM_INVALID
    naming the rule (wrong type, empty, lengths, out of range or negative, repeated destination)."""
    sbl = block_ids("src_blocks", src_blocks)
    dbl = block_ids("dst_blocks", dst_blocks)
    if not sbl.size or not dbl.size:
        raise param_invalid("src_blocks and dst_blocks must be non-empty")
    if sbl.size != dbl.size:
        raise param_invalid(f"src_blocks has {sbl.size} entries, dst_blocks {dbl.size}: lengths must be equal")
    _check_range("source", sbl, src.shape[0])
    _check_range("destination", dbl, dst.shape[0])
    if dbl.size > 1:
        srt = np.sort(dbl)
        if bool((srt[1:] == srt[:-1]).any()):
            raise param_invalid("dst_blocks names a block more than once")
    return sbl, dbl


def _block_plan(src: CacheDesc, dst: CacheDesc, src_blocks: Any, dst_blocks: Any, ext: KvCacheExtParam | None,
                op: str) -> tuple[list[tuple[int, int]], Any, tuple[NDArray[np.int64], ...]]:
    """Every rule of a block push or pull: (tensor pairs, head split or None, runs)."""
    _check_op(op)
    sbl, dbl = check_blocks(src, dst, src_blocks, dst_blocks)
    pairs = _tensor_pairs(src, dst, ext)
    heads = head_split(src, dst, ext)
    sbb, dbb = src.row_bytes, dst.row_bytes
    if heads is None and sbb != dbb:
        raise param_invalid(f"source block is {sbb} bytes per tensor, destination block {dbb}: must be equal")
    if src.block_stride is None and dst.block_stride is None:
        return pairs, heads, run_arrays(sbl, dbl)
    return pairs, heads, (sbl, dbl, np.ones(sbl.size, np.int64))   # strided: a segment per block


def plan_blocks(src: CacheDesc, dst: CacheDesc, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                ext: KvCacheExtParam | None, *, op: str) -> list[Segment]:
    """Segments of a push or pull of block lists: ``src_blocks[i]`` -> ``dst_blocks[i]``
    (the tuple form of whole blocks; the engine uses :meth:`Planner.blocks`)."""
    pairs, heads, (rs, rd, n) = _block_plan(src, dst, src_blocks, dst_blocks, ext, op)
    if heads is not None:
        raise param_invalid("plan_blocks plans whole blocks: head ranges need Planner.blocks")
    bb, ss, ds = src.row_bytes, src.block_stride_bytes, dst.block_stride_bytes
    runs = list(zip((rs * ss).tolist(), (rd * ds).tolist(), (n * bb).tolist()))
    return [(s, so, d, do, nb) for s, d in pairs for so, do, nb in runs]


def _native_blocks(src: CacheDesc, dst: CacheDesc, src_blocks: Any, dst_blocks: Any, ext: KvCacheExtParam | None,
                   op: str, src_regions: Sequence[tuple[int, int]], dst_regions: Sequence[tuple[int, int]],
                   strides: tuple[int, int]) -> tuple[NDArray[np.uint64], int] | None:
    """Planner.blocks of whole blocks in one pass of C (``_native.plan_blocks_packed``: the
    same checks, runs, packing and merging), or None: then _block_plan plans, and names any
    broken rule, in its own order (a wrong table before a wrong ext param). Head ranges go
    to _block_plan at once: it would check them all again."""
    if _packed is None or src.row_bytes != dst.row_bytes or not (
            ext is None or (isinstance(ext, KvCacheExtParam) and _all(ext.src_head_range)
                            and _all(ext.dst_head_range))):
        return None
    try:
        _check_op(op)
        sbl, dbl = block_ids("src_blocks", src_blocks), block_ids("dst_blocks", dst_blocks)
        pairs = _tensor_pairs(src, dst, ext)
    except LLMError:
        return None
    return _packed(np.ascontiguousarray(sbl), np.ascontiguousarray(dbl), src.shape[0], dst.shape[0],
                   layout.regs(pairs, src_regions, dst_regions), *strides, src.row_bytes,
                   src.block_stride is None and dst.block_stride is None)


class Planner:
    """Plans mapped onto native regions and packed for the core, row plans memoized."""

    _MEMO_MAX = 4096

    def __init__(self) -> None:
        self._memo: dict[tuple[Any, ...], tuple[array.array[int], int]] = {}

    @property
    def memo(self) -> dict[tuple[Any, ...], tuple[array.array[int], int]]:
        """The memo, ``memo_key(key) -> (packed, bytes)``: read by the native fast path
        (``_native.FastPath``), which runs only what the Planner has checked and memoized."""
        return self._memo

    def segments(self, key: tuple[Any, ...] | None, make: Callable[[], list[Segment]],
                 src_regions: Sequence[tuple[int, int]],
                 dst_regions: Sequence[tuple[int, int]]) -> tuple[array.array[int], int]:
        """The packed plan of ``make()`` and its byte count. ``*_regions``: per tensor,
        ``(native region id, offset)``. ``key`` memoizes it (None: not memoized)."""
        if key is not None:
            key = memo_key(key)   # None: not plain (True == 1, 0.0 == 0 must not hit the memo)
            if key is not None:
                hit = self._memo.get(key)
                if hit is not None:
                    return hit
        mapped = [(src_regions[s][0], src_regions[s][1] + so, dst_regions[d][0], dst_regions[d][1] + do, n)
                  for s, so, d, do, n in make()]
        merged = coalesce(mapped)
        packed = (array.array("Q", [w for seg in merged for w in seg]), sum(seg[4] for seg in merged))
        if key is not None:
            if len(self._memo) >= self._MEMO_MAX:
                self._memo.clear()
            self._memo[key] = packed
        return packed

    @staticmethod
    def blocks(src: CacheDesc, dst: CacheDesc, src_blocks: Any, dst_blocks: Any, ext: KvCacheExtParam | None,
               op: str, src_regions: Sequence[tuple[int, int]],
               dst_regions: Sequence[tuple[int, int]]) -> tuple[NDArray[np.uint64], int]:
        """:func:`plan_blocks` mapped, coalesced and packed like :meth:`segments`, vectorised:
        numpy over the runs, a Python step per tensor pair only (not per block or segment).
        With head ranges: 2-D segments, an ``(n, 8)`` array (kvengine/layout.py). Whole blocks
        go through ``_native.plan_blocks_packed`` first (the same plan in one pass of C; on any
        broken rule it answers None and the checks below name it)."""
        strides = (src.block_stride_bytes, dst.block_stride_bytes)
        got = _native_blocks(src, dst, src_blocks, dst_blocks, ext, op, src_regions, dst_regions, strides)
        if got is not None:
            return got
        pairs, heads, runs = _block_plan(src, dst, src_blocks, dst_blocks, ext, op)
        if heads is not None:
            row_bytes, rows, starts, row_strides = heads
            out8 = layout.pack_rows(pairs, runs, strides, starts, row_bytes, rows, row_strides,
                                    src_regions, dst_regions)
            return out8.reshape(-1, layout.SEG2), int(out8[:, :, 5].sum()) * row_bytes
        bb = src.row_bytes
        out = layout.pack_blocks(pairs, runs, strides, bb, src_regions, dst_regions)
        p, r = out.shape[0], out.shape[1]
        flat = out.reshape(-1, 5)
        total = int(runs[2].sum()) * bb * p
        if p > 1:
            # Runs are maximal, so only a tensor's last run and the next tensor's first can
            # touch in memory (coalesce's rule, checked at those p - 1 places only)
            last, first = out[:-1, -1], out[1:, 0]
            join = ((last[:, 0] == first[:, 0]) & (last[:, 2] == first[:, 2])
                    & (last[:, 1] + last[:, 4] == first[:, 1]) & (last[:, 3] + last[:, 4] == first[:, 3]))
            if join.any():
                keep = np.ones(flat.shape[0], np.bool_)
                keep[r::r] = ~join
                starts = np.flatnonzero(keep)
                merged = flat[starts]
                merged[:, 4] = np.add.reduceat(flat[:, 4], starts)
                flat = merged
        return flat.reshape(-1), total


_ALL = (-1, -1)


def _plain_range(r: Any) -> bool:
    return type(r) is range or (type(r) is tuple and len(r) == 2 and type(r[0]) is int and type(r[1]) is int)


def memo_key(key: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A plan memo key as the memo holds it, or None if it must not be memoized: every part
    of an exact type (so equal means identical), the ext param as the plain tuple
    ``(src_layer_range, dst_layer_range, tensor_num_per_layer)``, which hashes in C (the
    native fast path, cython_src/_fast.pxi, builds the same tuple)."""
    *head, ext = key
    for v in head:
        if type(v) is not int and type(v) is not str:
            return None
    if ext is None:
        return key
    if type(ext) is not KvCacheExtParam:
        return None
    s, d, n = ext.src_layer_range, ext.dst_layer_range, ext.tensor_num_per_layer
    if type(n) is not int or not _plain_range(s) or not _plain_range(d):
        return None
    if ext.src_head_range != _ALL or ext.dst_head_range != _ALL:
        return None   # rows refuse head ranges: plan_cache must see them every time
    return (*head, (s, d, n))
