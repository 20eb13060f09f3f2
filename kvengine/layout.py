"""Cache layouts: the memory a registration describes, and the packed plans of strided
and head-split block transfers (pure numpy, no I/O).

Owns: reading a registered buffer (numpy, buffer protocol, ``__dlpack__`` tensors and
their views) as a strided numpy array and checking its strides against a
:class:`~kvengine.types.CacheDesc`; the spans a tensor covers (what becomes a native
region); the geometry of a block (rows, heads, head bytes); the runs of a block table
and the merging of segments that continue each other; the vectorised packing of a
block table into 5-word (1-D) or 8-word (2-D) segments; and the splitting of serving
frameworks' per-layer tensors into the K/V tensors a desc counts:

- vLLM FlashAttention: one ``(2, num_blocks, block_size, kv_heads, head_dim)`` tensor per
  layer: ``kv_tensors(layers, "vllm")`` gives ``[t[0], t[1], ...]`` (contiguous views);
- FlashInfer: ``(num_blocks, 2, block_size, kv_heads, head_dim)``: ``"flashinfer"`` gives
  ``[t[:, 0], t[:, 1], ...]``, K and V interleaved: blocks ``2 * block_bytes`` apart;
- SGLang token pools (per-layer K and V, ``(tokens, kv_heads, head_dim)``, page_size 1)
  and MLA (one latent tensor per layer): ``"separate"``, the tensors as they are.

The parameter rules (which head ranges, which descs go together) are plan.py's; this
module computes what they allow.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from .types import CacheDesc, DataType, param_invalid

__all__ = ["LAYOUTS", "kv_tensors", "describe", "as_strided_array", "check_tensor", "union_spans",
           "block_geometry", "run_arrays", "block_runs", "coalesce", "regs", "pack_blocks", "pack_rows",
           "submit_form", "SEG1", "SEG2"]

LAYOUTS = ("vllm", "flashinfer", "separate")
SEG1, SEG2 = 5, 8   # words of a 1-D and of a 2-D (strided) segment
U64 = np.uint64


def kv_tensors(layers: Sequence[Any] | Mapping[str, Any], layout: str) -> list[Any]:
    """The tensors a :class:`CacheDesc` counts (K0, V0, K1, V1, ... or one per layer), as
    views of a framework's per-layer tensors (numpy or torch: only indexing is used).
    ``layers``: a list, or a dict in insertion order (vLLM's ``kv_caches``)."""
    items = list(layers.values()) if isinstance(layers, Mapping) else list(layers)
    if layout == "vllm":
        return [kv[i] for kv in items for i in (0, 1)]
    if layout == "flashinfer":
        return [kv[:, i] for kv in items for i in (0, 1)]
    if layout == "separate":
        return items
    raise param_invalid(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def describe(tensors: Sequence[Any], head_axis: int | None = None) -> CacheDesc:
    """The :class:`CacheDesc` of ``tensors`` (all of one shape, dtype and block stride):
    ``num_tensors``, the shape, the dtype and ``block_stride`` read off the first."""
    if not tensors:
        raise param_invalid("describe needs at least one tensor")
    a = as_strided_array(0, tensors[0])
    stride = a.strides[0] // a.itemsize if a.ndim else None
    dt = _dtype_of(tensors[0], a)
    return CacheDesc(len(tensors), a.shape, dt, block_stride=stride, head_axis=head_axis)


def _dtype_of(obj: Any, arr: NDArray[Any]) -> DataType:
    if "bfloat16" in str(getattr(obj, "dtype", "")):
        return DataType.DT_BF16
    return DataType.from_any(arr.dtype)


def as_strided_array(i: int, obj: Any) -> NDArray[Any]:
    """``obj`` (a numpy array, a buffer-protocol object or a CPU ``__dlpack__`` tensor) as a
    numpy array over the same memory, strides kept. A torch bf16 tensor is read as int16."""
    if isinstance(obj, np.ndarray):
        return obj
    try:
        return np.asarray(memoryview(obj))
    except TypeError:
        pass
    if not hasattr(obj, "__dlpack__"):
        raise param_invalid(f"tensor {i}: {type(obj).__name__} has neither the buffer protocol nor __dlpack__")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor) and obj.dtype == torch.bfloat16:
        obj = obj.view(torch.int16)   # numpy has no bf16: same bytes, a dtype it reads
    try:
        return np.from_dlpack(obj)
    except (TypeError, ValueError, RuntimeError, BufferError) as e:
        raise param_invalid(f"tensor {i}: not a CPU buffer numpy can read ({e})") from None


def check_tensor(i: int, arr: NDArray[Any], desc: CacheDesc) -> tuple[int, NDArray[Any]]:
    """``(address, numpy view of desc's shape and dtype)`` of a registered tensor, or
    LLM_PARAM_INVALID: writable; blocks (dim 0) ``desc.block_stride`` elements apart (a
    contiguous buffer of ``desc.size`` bytes when the desc has no block stride), each
    block C-contiguous inside."""
    if not arr.flags.writeable:
        raise param_invalid(f"tensor {i} is read-only")
    npd = desc.dtype.numpy_dtype
    if arr.flags.c_contiguous and desc.block_stride is None:
        if arr.nbytes != desc.size:
            raise param_invalid(f"tensor {i} has {arr.nbytes} bytes, the desc needs {desc.size}")
        flat = arr.reshape(-1).view(np.uint8)
        return int(flat.__array_interface__["data"][0]), flat.view(npd).reshape(desc.shape)
    if arr.shape != desc.shape or arr.itemsize != desc.dtype.itemsize:
        raise param_invalid(f"tensor {i} is a strided view of shape {arr.shape} and {arr.itemsize}-byte "
                            f"items; the desc says {desc.shape} of {desc.dtype.name}")
    e = arr.itemsize
    inner = [d * e for d in _c_strides(desc.shape[1:])]
    if any(n > 1 and s != want for n, s, want in zip(desc.shape[1:], arr.strides[1:], inner)):
        raise param_invalid(f"tensor {i} is not C-contiguous inside a block (C-contiguous inside: byte "
                            f"strides {tuple(inner)} after dim 0), got strides {arr.strides}")
    want0 = desc.block_stride_bytes
    if desc.shape[0] > 1 and arr.strides[0] != want0:
        raise param_invalid(f"tensor {i}: blocks are {arr.strides[0]} bytes apart, the desc says "
                            f"{want0} (block_stride {want0 // e} elements): give "
                            f"CacheDesc(..., block_stride={arr.strides[0] // e if arr.strides[0] > 0 else '?'})"
                            if arr.strides[0] > 0 and arr.strides[0] % e == 0 else
                            f"tensor {i}: dim 0 stride {arr.strides[0]} bytes is not a positive multiple of "
                            f"the item size")
    view = arr.view(npd) if arr.dtype != npd else arr
    return int(arr.__array_interface__["data"][0]), view


def _c_strides(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def union_spans(addrs: Sequence[int], span: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Tensors at ``addrs``, each reaching ``span`` bytes, as native regions: ``(regions,
    placement)``, regions ``(base, length)`` the union of overlapping or touching spans (so
    FlashInfer's interleaved K and V, and back-to-back tensors, share one), placement per
    tensor ``(region index, offset in region)``. Regions keep the order of first use."""
    order = sorted(range(len(addrs)), key=lambda k: addrs[k])
    merged: list[list[int]] = []
    which = [0] * len(addrs)
    for k in order:
        a = addrs[k]
        if merged and a <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], a + span - merged[-1][0])
        else:
            merged.append([a, span])
        which[k] = len(merged) - 1
    first: dict[int, int] = {}
    for k in range(len(addrs)):
        first.setdefault(which[k], len(first))
    regions = [(0, 0)] * len(merged)
    for m, pos in first.items():
        regions[pos] = (merged[m][0], merged[m][1])
    return regions, [(first[which[k]], addrs[k] - merged[which[k]][0]) for k in range(len(addrs))]


def run_arrays(sbl: NDArray[np.int64], dbl: NDArray[np.int64]
               ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """``(src_starts, dst_starts, counts)`` of the runs where both tables advance by one."""
    brk = np.ones(sbl.size, np.bool_)
    if sbl.size > 1:
        np.logical_not((sbl[1:] == sbl[:-1] + 1) & (dbl[1:] == dbl[:-1] + 1), out=brk[1:])
    starts = np.flatnonzero(brk)
    counts = np.diff(starts, append=sbl.size)
    return sbl[starts], dbl[starts], counts


def block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, count)`` runs where both lists advance by one."""
    if not len(src_blocks):
        return []
    rs, rd, n = run_arrays(np.asarray(src_blocks, np.int64), np.asarray(dst_blocks, np.int64))
    return list(zip(rs.tolist(), rd.tolist(), n.tolist()))


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
    return [(x[0], x[1], x[2], x[3], x[4]) for x in out]


def block_geometry(desc: CacheDesc, side: str = "") -> tuple[int, int, int]:
    """``(rows, heads, head_bytes)`` of one block: rows are the dims between dim 0 and the
    head axis (a block's tokens), a row holds ``heads`` heads of ``head_bytes``."""
    a = desc.head_axis
    if a is None:
        raise param_invalid(f"head ranges: the {side} cache of shape {desc.shape} names no head axis: give "
                            "CacheDesc(..., head_axis=...) to transfer head ranges")
    return (math.prod(desc.shape[1:a]), desc.shape[a],
            math.prod(desc.shape[a + 1:]) * desc.dtype.itemsize)


def regs(pairs: list[tuple[int, int]], src_regions: Sequence[tuple[int, int]],
          dst_regions: Sequence[tuple[int, int]]) -> NDArray[np.uint64]:
    return np.array([(src_regions[s][0], src_regions[s][1], dst_regions[d][0], dst_regions[d][1])
                     for s, d in pairs], U64).reshape(-1, 4)


def pack_blocks(pairs: list[tuple[int, int]], runs: tuple[NDArray[np.int64], ...], strides: tuple[int, int],
                nbytes: int, src_regions: Sequence[tuple[int, int]], dst_regions: Sequence[tuple[int, int]]
                ) -> NDArray[np.uint64]:
    """5-word segments ``(p, r, 5)``: per tensor pair, per run ``(src, dst, count)`` of blocks
    ``strides`` bytes apart, ``count * nbytes`` bytes (a run of more than one block only
    where blocks are contiguous on both sides)."""
    rs, rd, n = runs
    reg = regs(pairs, src_regions, dst_regions)
    out = np.empty((reg.shape[0], rs.size, SEG1), U64)
    out[:, :, 0] = reg[:, 0:1]
    np.add(reg[:, 1:2], rs.astype(U64) * U64(strides[0]), out=out[:, :, 1])
    out[:, :, 2] = reg[:, 2:3]
    np.add(reg[:, 3:4], rd.astype(U64) * U64(strides[1]), out=out[:, :, 3])
    out[:, :, 4] = n.astype(U64) * U64(nbytes)
    return out


def pack_rows(pairs: list[tuple[int, int]], runs: tuple[NDArray[np.int64], ...], block_strides: tuple[int, int],
              starts: tuple[int, int], row_bytes: int, rows: int, row_strides: tuple[int, int],
              src_regions: Sequence[tuple[int, int]], dst_regions: Sequence[tuple[int, int]]
              ) -> NDArray[np.uint64]:
    """8-word (2-D) segments ``(p, r, 8)``: per tensor pair, per run of blocks, ``count *
    rows`` rows of ``row_bytes`` from byte ``starts`` of the first block, rows
    ``row_strides`` apart (a head range of each token of the run's blocks)."""
    rs, rd, n = runs
    reg = regs(pairs, src_regions, dst_regions)
    out = np.empty((reg.shape[0], rs.size, SEG2), U64)
    out[:, :, 0] = reg[:, 0:1]
    np.add(reg[:, 1:2], rs.astype(U64) * U64(block_strides[0]) + U64(starts[0]), out=out[:, :, 1])
    out[:, :, 2] = reg[:, 2:3]
    np.add(reg[:, 3:4], rd.astype(U64) * U64(block_strides[1]) + U64(starts[1]), out=out[:, :, 3])
    out[:, :, 4] = row_bytes
    out[:, :, 5] = n.astype(U64) * U64(rows)
    out[:, :, 6] = row_strides[0]
    out[:, :, 7] = row_strides[1]
    return out


def submit_form(segs: Any) -> tuple[Any, int]:
    """``(flat plan, words per segment)`` of a planned transfer for ``Core.submit``: a 2-D
    ``(n, 8)`` plan flat with 8 words (the core takes 2-D segments, ``_native.SEG2_WORDS``)."""
    if isinstance(segs, np.ndarray) and segs.ndim == 2:
        return segs.reshape(-1), segs.shape[1]
    return segs, SEG1
