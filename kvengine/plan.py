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
  destination block; runs of consecutive blocks move as one segment.
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import numpy as np

from .types import CacheDesc, KvCacheExtParam, as_int_list, param_invalid

__all__ = ["Segment", "layer_tensors", "plan_cache", "plan_blocks", "coalesce", "block_runs"]

Segment = tuple  # (src_tensor, src_offset, dst_tensor, dst_offset, nbytes)

_MAX_TNPL = 255  # LLM-DataDist's tensor_num_per_layer is a uint8


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _check_op(op: str) -> None:
    if op not in ("push", "pull"):
        raise ValueError(f"op must be 'push' or 'pull', got {op!r}")


def layer_tensors(desc: CacheDesc, layer_range: Any, tnpl: int, what: str) -> range:
    """Tensor indices covered by ``layer_range`` in a cache of ``desc``."""
    if not _is_int(tnpl) or not 1 <= tnpl <= desc.num_tensors or desc.num_tensors % tnpl:
        raise param_invalid(
            f"tensor_num_per_layer {tnpl!r} must divide num_tensors {desc.num_tensors}")
    num_layers = desc.num_tensors // tnpl
    if layer_range is None:
        return range(0, num_layers * tnpl)
    if isinstance(layer_range, range):
        if layer_range.step != 1:
            raise param_invalid(f"{what} must have step 1, got {layer_range!r}")
        start, stop = layer_range.start, layer_range.stop
        if not 0 <= start < stop <= num_layers:
            raise param_invalid(
                f"{what} {layer_range!r} must satisfy 0 <= start < stop <= {num_layers} "
                f"(num_tensors {desc.num_tensors} / tensor_num_per_layer {tnpl})")
        return range(start * tnpl, stop * tnpl)
    if isinstance(layer_range, (tuple, list)) and len(layer_range) == 2 \
            and all(_is_int(v) for v in layer_range):
        first, last = int(layer_range[0]), int(layer_range[1])
        if first == -1 and last == -1:
            return range(0, num_layers * tnpl)
        if not 0 <= first <= last <= num_layers - 1:
            raise param_invalid(
                f"{what} {tuple(layer_range)!r} must be (-1, -1) or satisfy "
                f"0 <= first <= last <= max layer index {num_layers - 1}")
        return range(first * tnpl, (last + 1) * tnpl)
    raise param_invalid(
        f"{what} must be an inclusive (first, last) tuple of ints or a range, got {layer_range!r}")


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
    tnpl = ext.tensor_num_per_layer
    if not _is_int(tnpl) or not 1 <= int(tnpl) <= _MAX_TNPL:
        raise param_invalid(f"tensor_num_per_layer must be an int in [1, {_MAX_TNPL}], got {tnpl!r}")
    tnpl = int(tnpl)
    for side, desc in (("source", src), ("destination", dst)):
        if desc.num_tensors % tnpl:
            raise param_invalid(
                f"tensor_num_per_layer {tnpl} must divide the {side}'s num_tensors {desc.num_tensors}")
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
    value = int(value)
    if not 0 <= value < bound:
        raise param_invalid(f"{name} {value} out of range [0, {bound})")
    return value


def plan_cache(src: CacheDesc, dst: CacheDesc, src_batch: int, dst_batch: int, size: int,
               ext: KvCacheExtParam | None, *, op: str) -> list[Segment]:
    """Segments of a push (``op="push"``) or pull of one batch row of each tensor."""
    _check_op(op)
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
    so, do = sb * srb, db * drb
    return [(s, so, d, do, size) for s, d in pairs]


def block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, count)`` runs where both lists advance by one."""
    runs: list[tuple[int, int, int]] = []
    s0 = d0 = prev_s = prev_d = None
    n = 0
    for s, d in zip(src_blocks, dst_blocks):
        if n and s == prev_s + 1 and d == prev_d + 1:
            n += 1
        else:
            if n:
                runs.append((s0, d0, n))
            s0, d0, n = s, d, 1
        prev_s, prev_d = s, d
    if n:
        runs.append((s0, d0, n))
    return runs


def plan_blocks(src: CacheDesc, dst: CacheDesc, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                ext: KvCacheExtParam | None, *, op: str) -> list[Segment]:
    """Segments of a push or pull of block lists: ``src_blocks[i]`` -> ``dst_blocks[i]``."""
    _check_op(op)
    sbl = as_int_list("src_blocks", src_blocks)
    dbl = as_int_list("dst_blocks", dst_blocks)
    if not sbl or not dbl:
        raise param_invalid("src_blocks and dst_blocks must be non-empty")
    if len(sbl) != len(dbl):
        raise param_invalid(f"src_blocks has {len(sbl)} entries, dst_blocks {len(dbl)}: lengths must be equal")
    ns, nd = src.shape[0], dst.shape[0]
    if min(sbl) < 0 or max(sbl) >= ns:
        bad = next(b for b in sbl if not 0 <= b < ns)
        raise param_invalid(f"source block {bad} out of range [0, {ns})")
    if min(dbl) < 0 or max(dbl) >= nd:
        bad = next(b for b in dbl if not 0 <= b < nd)
        raise param_invalid(f"destination block {bad} out of range [0, {nd})")
    if len(set(dbl)) != len(dbl):
        raise param_invalid("dst_blocks names a block more than once")
    pairs = _tensor_pairs(src, dst, ext)
    sbb, dbb = src.row_bytes, dst.row_bytes
    if sbb != dbb:
        raise param_invalid(f"source block is {sbb} bytes per tensor, destination block {dbb}: must be equal")
    runs = block_runs(sbl, dbl)
    return [(s, rs * sbb, d, rd * dbb, n * sbb) for s, d in pairs for rs, rd, n in runs]


def coalesce(segments: Sequence[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    """Merge consecutive segments that continue each other on both sides.

    Input and output are ``(src_region, src_offset, dst_region, dst_offset, nbytes)``;
    order is kept, and only neighbours in that order merge.
    """
    out: list[list[int]] = []
    for sr, so, dr, do, n in segments:
        if out:
            last = out[-1]
            if last[0] == sr and last[2] == dr and last[1] + last[4] == so and last[3] + last[4] == do:
                last[4] += n
                continue
        out.append([sr, so, dr, do, n])
    return [tuple(x) for x in out]
