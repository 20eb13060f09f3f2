"""The transfer planner (kvengine/plan.py), checked against a byte-level reference model.

Plans are applied to small numpy caches (each tensor viewed as flat bytes:
``dst[dt][do:do+n] = src[st][so:so+n]``) and compared with the expected caches,
computed directly from the API semantics (row ``r`` of tensor ``t`` for caches,
block ``b`` of tensor ``t`` for block caches, inclusive tuple / half-open range
layer ranges, layer ``L`` = tensors ``L*tnpl .. L*tnpl+tnpl-1``).
"""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st


from kvengine import plan, status, types  # noqa: E402  (pure Python: no native build needed)
CacheDesc, DataType, Ext = types.CacheDesc, types.DataType, types.KvCacheExtParam
ParamInvalid = status.LLMParamInvalidError

HYP = settings(max_examples=200, deadline=None, database=None)
DTYPES = [DataType.DT_INT8, DataType.DT_FLOAT16, DataType.DT_BF16, DataType.DT_FLOAT,
          DataType.DT_BOOL, DataType.DT_INT64]


# ---------------------------------------------------------------------------------------------
# reference model


def make_cache(desc: CacheDesc, rng: np.random.Generator) -> list[np.ndarray]:
    """``desc.num_tensors`` arrays of ``desc.shape`` filled with random bytes."""
    npd = desc.dtype.numpy_dtype
    return [rng.integers(0, 256, desc.size, dtype=np.uint8).view(npd).reshape(desc.shape)
            for _ in range(desc.num_tensors)]


def flat(a: np.ndarray) -> np.ndarray:
    """Writable flat byte view of a tensor."""
    v = a.reshape(-1).view(np.uint8)
    assert np.shares_memory(v, a)
    return v


def rows(a: np.ndarray) -> np.ndarray:
    """Writable ``(dim0, row_bytes)`` byte view: row ``r`` is batch row / block ``r``."""
    v = a.reshape(a.shape[0], -1).view(np.uint8)
    assert np.shares_memory(v, a)
    return v


def apply(segments, src: list[np.ndarray], dst: list[np.ndarray]) -> None:
    """Execute a plan byte by byte, refusing anything out of bounds."""
    s8 = [flat(a) for a in src]
    d8 = [flat(a) for a in dst]
    for seg in segments:
        assert len(seg) == 5 and all(type(v) is int for v in seg), seg
        s, so, d, do, n = seg
        assert 0 <= s < len(s8) and 0 <= d < len(d8), seg
        assert n > 0 and 0 <= so and so + n <= s8[s].size and 0 <= do and do + n <= d8[d].size, seg
        d8[d][do:do + n] = s8[s][so:so + n]


def copies(cache: list[np.ndarray]) -> list[np.ndarray]:
    return [a.copy() for a in cache]


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for t, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(flat(g), flat(w)), f"tensor {t} differs"


def ref_layers(spec, num_layers: int) -> list[int]:
    if spec is None or (isinstance(spec, tuple) and tuple(spec) == (-1, -1)):
        return list(range(num_layers))
    if isinstance(spec, range):
        return list(spec)  # half-open
    first, last = spec
    return list(range(first, last + 1))  # inclusive


def ref_layer_tensors(spec, num_tensors: int, tnpl: int) -> list[int]:
    return [layer * tnpl + k for layer in ref_layers(spec, num_tensors // tnpl) for k in range(tnpl)]


def ref_pairs(sd: CacheDesc, dd: CacheDesc, ext) -> list[tuple[int, int]]:
    if ext is None:
        return [(i, i) for i in range(sd.num_tensors)]
    t = ext.tensor_num_per_layer
    s = ref_layer_tensors(ext.src_layer_range, sd.num_tensors, t)
    d = ref_layer_tensors(ext.dst_layer_range, dd.num_tensors, t)
    assert len(s) == len(d)
    return list(zip(s, d))


def ref_range_ok(spec, num_layers: int) -> bool:
    if spec is None:
        return True
    if isinstance(spec, range):
        return spec.step == 1 and 0 <= spec.start < spec.stop <= num_layers
    first, last = spec
    return (first, last) == (-1, -1) or 0 <= first <= last <= num_layers - 1


def expected_cache(src, dst, pairs, sb: int, db: int, nbytes: int) -> list[np.ndarray]:
    """Row ``sb`` of src tensor s -> row ``db`` of dst tensor d (first ``nbytes`` bytes)."""
    exp = copies(dst)
    for s, d in pairs:
        rows(exp[d])[db, :nbytes] = rows(src[s])[sb, :nbytes]
    return exp


def expected_blocks(src, dst, pairs, src_blocks, dst_blocks) -> list[np.ndarray]:
    """Block ``src_blocks[i]`` of src tensor s -> block ``dst_blocks[i]`` of dst tensor d."""
    exp = copies(dst)
    for s, d in pairs:
        for sb, db in zip(src_blocks, dst_blocks):
            rows(exp[d])[db] = rows(src[s])[sb]
    return exp


def ref_runs(src_blocks, dst_blocks) -> list[tuple[int, int, int]]:
    runs: list[list[int]] = []
    for i, (s, d) in enumerate(zip(src_blocks, dst_blocks)):
        if i and s == src_blocks[i - 1] + 1 and d == dst_blocks[i - 1] + 1:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def run_cache(sd, dd, sb, db, size, ext, op, seed=0):
    """Plan, apply, and return (segments, got, expected, src unchanged?)."""
    segs = plan.plan_cache(sd, dd, sb, db, size, ext, op=op)
    rng = np.random.default_rng(seed)
    src, dst = make_cache(sd, rng), make_cache(dd, rng)
    src0, dst0 = copies(src), copies(dst)
    apply(segs, src, dst)
    nbytes = sd.row_bytes if size == -1 else size
    assert_same(src, src0)
    return segs, dst, dst0, expected_cache(src0, dst0, ref_pairs(sd, dd, ext), sb, db, nbytes)


def run_blocks(sd, dd, sbl, dbl, ext, op="push", seed=0):
    segs = plan.plan_blocks(sd, dd, sbl, dbl, ext, op=op)
    rng = np.random.default_rng(seed)
    src, dst = make_cache(sd, rng), make_cache(dd, rng)
    src0, dst0 = copies(src), copies(dst)
    apply(segs, src, dst)
    assert_same(src, src0)
    return segs, dst, dst0, expected_blocks(src0, dst0, ref_pairs(sd, dd, ext), list(sbl), list(dbl))


def D(n, shape, dtype=DataType.DT_FLOAT16):
    return CacheDesc(n, shape, dtype)


# ---------------------------------------------------------------------------------------------
# layer_tensors


def test_layer_tensors_all_layers():
    d = D(8, (2, 4))
    for spec in (None, (-1, -1), [-1, -1], range(0, 4)):
        assert plan.layer_tensors(d, spec, 2, "r") == range(0, 8)
    assert plan.layer_tensors(d, None, 4, "r") == range(0, 8)
    assert plan.layer_tensors(d, (-1, -1), 1, "r") == range(0, 8)


@pytest.mark.parametrize("spec,want", [
    ((0, 0), range(0, 2)), ((1, 2), range(2, 6)), ((3, 3), range(6, 8)), ((0, 3), range(0, 8)),
    (range(1, 3), range(2, 6)), (range(0, 1), range(0, 2)), (range(3, 4), range(6, 8)),
    ((np.int64(1), np.int32(1)), range(2, 4)), ([2, 3], range(4, 8)),
    (range(np.int64(1), np.int64(2)), range(2, 4)),
], ids=repr)
def test_layer_tensors_examples(spec, want):
    assert plan.layer_tensors(D(8, (2, 4)), spec, 2, "r") == want


@pytest.mark.parametrize("tnpl", [1, 2, 3, 4, 6])
def test_layer_tensors_tuple_is_inclusive_range_is_half_open(tnpl):
    num_layers = 12 // tnpl
    d = D(12, (1,))
    for first in range(num_layers):
        for last in range(first, num_layers):
            want = ref_layer_tensors((first, last), 12, tnpl)
            assert list(plan.layer_tensors(d, (first, last), tnpl, "r")) == want
            assert list(plan.layer_tensors(d, range(first, last + 1), tnpl, "r")) == want
            assert want == list(range(first * tnpl, (last + 1) * tnpl))


@pytest.mark.parametrize("spec", [range(0, 4, 2), range(0, 2, -1), range(3, 0, -1)], ids=repr)
def test_layer_tensors_range_step_must_be_1(spec):
    with pytest.raises(ParamInvalid, match=r"src_layer_range must have step 1"):
        plan.layer_tensors(D(8, (2,)), spec, 2, "src_layer_range")


@pytest.mark.parametrize("spec", [range(0, 0), range(2, 2), range(3, 1), range(-1, 2), range(0, 5),
                                  range(4, 5), range(-3, -1)], ids=repr)
def test_layer_tensors_range_bounds(spec):
    with pytest.raises(ParamInvalid, match=r"must satisfy 0 <= start < stop <= 4"):
        plan.layer_tensors(D(8, (2,)), spec, 2, "dst_layer_range")


@pytest.mark.parametrize("spec", [(0, 4), (4, 4), (-1, 0), (0, -1), (-1, 3), (2, 1), (-2, -2),
                                  (-1, -2), (-2, -1), (5, 9), (3, 2)], ids=repr)
def test_layer_tensors_tuple_bounds(spec):
    with pytest.raises(ParamInvalid, match=r"must be \(-1, -1\) or satisfy 0 <= first <= last "
                                           r"<= max layer index 3"):
        plan.layer_tensors(D(8, (2,)), spec, 2, "src_layer_range")


@pytest.mark.parametrize("spec", [(0,), (0, 1, 2), [0], 1, "01", (0.0, 1.0), (0, 1.0),
                                  (True, False), (None, None), ("0", "1"), {0: 1}, 1.5], ids=repr)
def test_layer_tensors_wrong_type(spec):
    with pytest.raises(ParamInvalid, match=r"src_layer_range must be an inclusive \(first, last\) "
                                           r"tuple of ints or a range"):
        plan.layer_tensors(D(8, (2,)), spec, 2, "src_layer_range")


# ---------------------------------------------------------------------------------------------
# every rule raises LLMParamInvalidError naming the rule

A = D(8, (4, 2, 4))                       # 8 tensors, 4 rows of 16 bytes
B = D(8, (4, 2, 4))
A12 = D(12, (4, 2, 4))
ROW = A.row_bytes                         # 16
NB = D(8, (8, 2, 4))                      # block caches: 8 blocks of 16 bytes per tensor


def _cache(sd=A, dd=B, sb=0, db=0, size=-1, ext=None, op="push"):
    return lambda: plan.plan_cache(sd, dd, sb, db, size, ext, op=op)


def _blocks(sbl=(0,), dbl=(0,), sd=NB, dd=NB, ext=None, op="push"):
    return lambda: plan.plan_blocks(sd, dd, sbl, dbl, ext, op=op)


RULES = {
    # a layer is tensor_num_per_layer consecutive tensors: tnpl is an int in [1, 255] ...
    "tnpl_zero": (_cache(ext=Ext(tensor_num_per_layer=0)), r"tensor_num_per_layer must be an int in \[1, 255\]"),
    "tnpl_negative": (_cache(ext=Ext(tensor_num_per_layer=-2)), r"tensor_num_per_layer must be an int in \[1, 255\]"),
    "tnpl_256": (_cache(sd=D(256, (1,)), dd=D(256, (1,)), ext=Ext(tensor_num_per_layer=256)),
                 r"tensor_num_per_layer must be an int in \[1, 255\]"),
    "tnpl_float": (_cache(ext=Ext(tensor_num_per_layer=2.0)), r"tensor_num_per_layer must be an int"),
    "tnpl_bool": (_cache(ext=Ext(tensor_num_per_layer=True)), r"tensor_num_per_layer must be an int"),
    "tnpl_str": (_cache(ext=Ext(tensor_num_per_layer="2")), r"tensor_num_per_layer must be an int"),
    "tnpl_none": (_cache(ext=Ext(tensor_num_per_layer=None)), r"tensor_num_per_layer must be an int"),
    # ... that divides num_tensors on both sides
    "tnpl_divides_src": (_cache(sd=D(9, (4, 2, 4)), dd=D(8, (4, 2, 4)), ext=Ext((0, 0), (0, 0), 2)),
                         r"tensor_num_per_layer 2 must divide the source's num_tensors 9"),
    "tnpl_divides_dst": (_cache(sd=A12, dd=D(10, (4, 2, 4)), ext=Ext((0, 0), (0, 0), 4)),
                         r"tensor_num_per_layer 4 must divide the destination's num_tensors 10"),
    "tnpl_divides_default_ranges": (_cache(sd=A, dd=B, ext=Ext(tensor_num_per_layer=3)),
                                    r"tensor_num_per_layer 3 must divide"),
    "tnpl_divides_blocks": (_blocks(ext=Ext(tensor_num_per_layer=5)), r"tensor_num_per_layer 5 must divide"),
    # ext_param type
    "ext_type": (_cache(ext=((0, 1), (0, 1))), r"ext_param must be a KvCacheExtParam"),
    "ext_type_blocks": (_blocks(ext={"src_layer_range": (0, 1)}), r"ext_param must be a KvCacheExtParam"),
    # layer ranges: inclusive tuples, (-1, -1), ranges with step 1
    "src_tuple_past_end": (_cache(ext=Ext((0, 4), (0, 4))), r"src_layer_range \(0, 4\) must be \(-1, -1\) or satisfy"),
    "dst_tuple_past_end": (_cache(ext=Ext((0, 0), (4, 4))), r"dst_layer_range \(4, 4\) must be \(-1, -1\) or satisfy"),
    "src_tuple_reversed": (_cache(ext=Ext((2, 1), (1, 2))), r"src_layer_range \(2, 1\) must be \(-1, -1\) or satisfy"),
    "src_tuple_half_default": (_cache(ext=Ext((-1, 3), (0, 3))), r"src_layer_range \(-1, 3\) must be \(-1, -1\)"),
    "tuple_bound_uses_tnpl": (_cache(sd=A12, dd=A12, ext=Ext((0, 3), (0, 3), 4)), r"max layer index 2"),
    "src_range_step": (_cache(ext=Ext(range(0, 4, 2), range(0, 2))), r"src_layer_range must have step 1"),
    "dst_range_step": (_cache(ext=Ext(range(0, 2), range(0, 4, 2))), r"dst_layer_range must have step 1"),
    "src_range_empty": (_cache(ext=Ext(range(1, 1), range(1, 1))), r"src_layer_range range\(1, 1\) must satisfy 0 <= start < stop <= 4"),
    "dst_range_past_end": (_cache(ext=Ext(range(0, 2), range(3, 5))), r"dst_layer_range range\(3, 5\) must satisfy 0 <= start < stop <= 4"),
    "src_range_negative": (_cache(ext=Ext(range(-1, 1), range(0, 2))), r"must satisfy 0 <= start < stop"),
    "range_type": (_cache(ext=Ext("0:2", (0, 1))), r"src_layer_range must be an inclusive \(first, last\) tuple"),
    "range_float": (_cache(ext=Ext((0, 1), (0.0, 1.0))), r"dst_layer_range must be an inclusive \(first, last\) tuple"),
    "range_type_blocks": (_blocks(ext=Ext((0,), (0,))), r"must be an inclusive \(first, last\) tuple"),
    # both sides span the same count
    "spans_tuple": (_cache(ext=Ext((0, 1), (0, 2))), r"src_layer_range spans 2 layers, dst_layer_range 3: spans must be equal"),
    "spans_range": (_cache(ext=Ext(range(0, 3), range(1, 3))), r"spans must be equal"),
    "spans_mixed": (_cache(ext=Ext((0, 1), range(0, 3))), r"spans must be equal"),
    "spans_default_vs_part": (_cache(ext=Ext((-1, -1), (0, 2))), r"spans 4 layers, dst_layer_range 3: spans must be equal"),
    "spans_default_both_unequal_caches": (_cache(sd=A12, dd=A, ext=Ext()), r"spans 6 layers, dst_layer_range 4"),
    "spans_blocks": (_blocks(ext=Ext((0, 0), (0, 1))), r"spans must be equal"),
    # without an ext param every tensor maps to the same index: counts must match
    "no_ext_counts": (_cache(sd=A12, dd=A), r"source has 12 tensors, destination 8: give layer ranges"),
    "no_ext_counts_blocks": (_blocks(sd=D(6, (8, 2, 4)), dd=NB), r"source has 6 tensors, destination 8"),
    # dtypes
    "dtype": (_cache(dd=D(8, (4, 8), DataType.DT_INT16)), r"source dtype DT_FLOAT16 differs from destination dtype DT_INT16"),
    "dtype_blocks": (_blocks(dd=D(8, (8, 16), DataType.DT_INT8)), r"source dtype DT_FLOAT16 differs"),
    # batch indices
    "src_batch_high": (_cache(sb=4), r"source batch_index 4 out of range \[0, 4\)"),
    "src_batch_negative": (_cache(sb=-1), r"source batch_index -1 out of range \[0, 4\)"),
    "dst_batch_high": (_cache(db=4), r"destination batch_index 4 out of range \[0, 4\)"),
    "dst_batch_huge": (_cache(db=2**32), r"destination batch_index 4294967296 out of range"),
    "src_batch_bool": (_cache(sb=True), r"source batch_index must be an int"),
    "src_batch_float": (_cache(sb=0.0), r"source batch_index must be an int"),
    "dst_batch_none": (_cache(db=None), r"destination batch_index must be an int"),
    # push's size must be -1
    "push_size_row": (_cache(size=ROW), r"push size must be -1 \(whole row\), got 16"),
    "push_size_small": (_cache(size=1), r"push size must be -1"),
    "push_size_zero": (_cache(size=0), r"push size must be -1"),
    "push_size_minus2": (_cache(size=-2), r"push size must be -1"),
    # pull's size is bytes per tensor (0 < size <= row) or -1
    "pull_size_zero": (_cache(size=0, op="pull"), r"pull size must be -1 or in \(0, 16\] bytes per tensor, got 0"),
    "pull_size_minus2": (_cache(size=-2, op="pull"), r"pull size must be -1 or in \(0, 16\]"),
    "pull_size_over_row": (_cache(size=ROW + 1, op="pull"), r"pull size must be -1 or in \(0, 16\]"),
    "pull_size_over_smaller_row": (_cache(dd=D(8, (4, 1, 4)), size=9, op="pull"), r"pull size must be -1 or in \(0, 8\]"),
    "size_float": (_cache(size=-1.0), r"size must be an int"),
    "size_bool": (_cache(size=True, op="pull"), r"size must be an int"),
    "size_none": (_cache(size=None, op="pull"), r"size must be an int"),
    # whole-row transfers need equal rows
    "rows_push": (_cache(dd=D(8, (4, 4, 4))), r"source row is 16 bytes per tensor, destination row 32: rows must be equal"),
    "rows_pull": (_cache(dd=D(8, (4, 4, 4)), op="pull"), r"rows must be equal \(or give a pull size\)"),
    # block lists: non-empty ...
    "blocks_empty_both": (_blocks(sbl=[], dbl=[]), r"src_blocks and dst_blocks must be non-empty"),
    "blocks_empty_src": (_blocks(sbl=[], dbl=[0]), r"must be non-empty"),
    "blocks_empty_dst": (_blocks(sbl=[0], dbl=()), r"must be non-empty"),
    # ... of equal length ...
    "blocks_lengths": (_blocks(sbl=[0, 1], dbl=[0]), r"src_blocks has 2 entries, dst_blocks 1: lengths must be equal"),
    "blocks_lengths2": (_blocks(sbl=[0], dbl=[0, 1, 2]), r"lengths must be equal"),
    # ... in range ...
    "src_block_high": (_blocks(sbl=[0, 8], dbl=[0, 1]), r"source block 8 out of range \[0, 8\)"),
    "src_block_negative": (_blocks(sbl=[-1], dbl=[0]), r"source block -1 out of range \[0, 8\)"),
    "dst_block_high": (_blocks(sbl=[0], dbl=[9]), r"destination block 9 out of range \[0, 8\)"),
    "dst_block_negative": (_blocks(sbl=[0, 1], dbl=[1, -3]), r"destination block -3 out of range"),
    "dst_block_small_cache": (_blocks(dd=D(8, (2, 2, 4)), sbl=[2], dbl=[2]), r"destination block 2 out of range \[0, 2\)"),
    # ... with no repeated destination block
    "dst_repeated": (_blocks(sbl=[0, 1], dbl=[3, 3]), r"dst_blocks names a block more than once"),
    "dst_repeated_far": (_blocks(sbl=[0, 1, 2, 3], dbl=[5, 1, 2, 5]), r"more than once"),
    # block sizes must match
    "block_bytes": (_blocks(dd=D(8, (8, 4, 4))), r"source block is 16 bytes per tensor, destination block 32: must be equal"),
    # block list element types
    "src_blocks_bool": (_blocks(sbl=[True], dbl=[0]), r"src_blocks must contain only ints"),
    "dst_blocks_float": (_blocks(sbl=[0], dbl=[0.0]), r"dst_blocks must contain only ints"),
    "src_blocks_str": (_blocks(sbl="01", dbl=[0, 1]), r"src_blocks must contain only ints"),
    "src_blocks_none": (_blocks(sbl=None), r"src_blocks must be a sequence of ints"),
    "dst_blocks_int": (_blocks(dbl=3), r"dst_blocks must be a sequence of ints"),
    "src_blocks_2d": (_blocks(sbl=np.zeros((1, 1), np.int64)), r"src_blocks must be a 1-D integer array"),
    "dst_blocks_float_array": (_blocks(dbl=np.zeros(1, np.float32)), r"dst_blocks must be a 1-D integer array"),
    "dst_blocks_bool_array": (_blocks(dbl=np.zeros(1, np.bool_)), r"dst_blocks must be a 1-D integer array"),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_rule_raises_param_invalid(rule):
    call, pattern = RULES[rule]
    with pytest.raises(ParamInvalid, match=pattern) as info:
        call()
    assert info.value.status is status.LLMStatusCode.LLM_PARAM_INVALID
    assert str(info.value).startswith("LLM_PARAM_INVALID: ")


def test_rule_boundaries_are_valid():
    """The value just inside each bound is accepted."""
    plan.plan_cache(A, B, 3, 3, -1, None, op="push")
    plan.plan_cache(A, B, 0, 0, ROW, None, op="pull")
    plan.plan_cache(A, B, 0, 0, 1, None, op="pull")
    plan.plan_cache(A, D(8, (4, 1, 4)), 0, 0, 8, None, op="pull")
    plan.plan_cache(D(255, (1,)), D(255, (1,)), 0, 0, -1, Ext(tensor_num_per_layer=255), op="push")
    plan.plan_cache(A, B, 0, 0, -1, Ext((3, 3), (0, 0)), op="push")
    plan.plan_cache(A, B, 0, 0, -1, Ext(range(3, 4), range(0, 1)), op="push")
    plan.plan_cache(A, B, np.int64(1), np.uint32(2), np.int64(-1), None, op="push")
    plan.plan_blocks(NB, NB, [7, 0], [0, 7], None, op="push")
    plan.plan_blocks(NB, NB, [3, 3, 3], [0, 1, 2], None, op="pull")  # a source block may repeat
    plan.plan_blocks(NB, NB, np.array([1, 2], np.uint8), np.array([2, 3], np.int64), None, op="pull")
    plan.plan_blocks(NB, NB, (np.int64(1),), range(1, 2), None, op="pull")
    plan.plan_blocks(NB, NB, (b for b in [1, 2]), [4, 5], None, op="pull")


# ---------------------------------------------------------------------------------------------
# plan_cache: examples


def test_cache_identity_without_ext_moves_one_row_of_every_tensor():
    sd, dd = D(6, (3, 2, 5), DataType.DT_FLOAT), D(6, (5, 2, 5), DataType.DT_FLOAT)
    segs, got, before, want = run_cache(sd, dd, 2, 4, -1, None, "push")
    assert sorted(segs) == [(t, 2 * 40, t, 4 * 40, 40) for t in range(6)]
    assert_same(got, want)
    for t in range(6):  # untouched rows stay untouched
        assert np.array_equal(rows(got[t])[:4], rows(before[t])[:4])


def test_cache_inclusive_tuple_ranges_move_only_those_layers():
    # 8 layers of K,V; src layers 0..3 -> dst layers 4..7 (tuples are inclusive)
    sd = dd = D(16, (2, 3, 4), DataType.DT_INT8)
    ext = Ext((0, 3), (4, 7), 2)
    segs, got, before, want = run_cache(sd, dd, 1, 0, -1, ext, "push")
    assert sorted(segs) == [(s, 12, s + 8, 0, 12) for s in range(8)]
    assert_same(got, want)
    for t in range(8):  # dst layers 0..3 untouched
        assert np.array_equal(flat(got[t]), flat(before[t]))
    for t in range(8, 16):  # dst row 1 untouched
        assert np.array_equal(rows(got[t])[1], rows(before[t])[1])
        assert not np.array_equal(rows(got[t])[0], rows(before[t])[0])


def test_cache_half_open_range_equals_inclusive_tuple():
    sd = dd = D(12, (2, 8))
    for tnpl in (1, 2, 3):
        nl = 12 // tnpl
        for first in range(nl):
            for last in range(first, nl):
                dst_first = nl - 1 - last
                a = plan.plan_cache(sd, dd, 0, 1, -1, Ext((first, last), (dst_first, dst_first + last - first), tnpl), op="push")
                b = plan.plan_cache(sd, dd, 0, 1, -1, Ext(range(first, last + 1), range(dst_first, dst_first + last - first + 1), tnpl), op="push")
                c = plan.plan_cache(sd, dd, 0, 1, -1, Ext((first, last), range(dst_first, dst_first + last - first + 1), tnpl), op="push")
                assert a == b == c
                assert len(a) == (last - first + 1) * tnpl


def test_cache_single_layer_push():
    # "push each layer as soon as it is computed": first == last sends exactly one layer
    sd = dd = D(8, (1, 16))
    for layer in range(4):
        segs = plan.plan_cache(sd, dd, 0, 0, -1, Ext((layer, layer), (layer, layer)), op="push")
        assert sorted(segs) == [(2 * layer, 0, 2 * layer, 0, 32), (2 * layer + 1, 0, 2 * layer + 1, 0, 32)]


def test_cache_ext_default_ranges_map_all_layers():
    sd = dd = D(6, (2, 4))
    want = plan.plan_cache(sd, dd, 1, 0, -1, None, op="push")
    for ext in (Ext(), Ext(None, None), Ext((-1, -1), range(0, 3)), Ext(range(0, 6), None, 1), Ext(tensor_num_per_layer=3)):
        assert plan.plan_cache(sd, dd, 1, 0, -1, ext, op="push") == want


def test_cache_subset_into_larger_cache():
    # a 4-layer source into layers 2..5 of a 6-layer destination with 3 tensors per layer
    sd, dd = D(12, (2, 3), DataType.DT_INT64), D(18, (3, 3), DataType.DT_INT64)
    ext = Ext((-1, -1), range(2, 6), 3)
    segs, got, before, want = run_cache(sd, dd, 1, 2, -1, ext, "push")
    assert sorted(segs) == [(s, 24, s + 6, 48, 24) for s in range(12)]
    assert_same(got, want)
    for t in (0, 1, 2, 3, 4, 5):
        assert np.array_equal(flat(got[t]), flat(before[t]))


def test_cache_pull_size_copies_a_prefix_of_each_row():
    sd, dd = D(4, (3, 4, 4), DataType.DT_UINT8), D(4, (2, 2, 4), DataType.DT_UINT8)  # rows 16 and 8 bytes
    segs, got, before, want = run_cache(sd, dd, 2, 1, 5, None, "pull")
    assert sorted(segs) == [(t, 32, t, 8, 5) for t in range(4)]
    assert_same(got, want)
    for t in range(4):
        assert np.array_equal(rows(got[t])[1, 5:], rows(before[t])[1, 5:])  # rest of the row untouched
        assert np.array_equal(rows(got[t])[0], rows(before[t])[0])


def test_cache_pull_size_equal_to_row_and_minus_one_agree():
    sd = dd = D(4, (3, 4, 4))
    assert plan.plan_cache(sd, dd, 1, 2, -1, None, op="pull") == plan.plan_cache(sd, dd, 1, 2, sd.row_bytes, None, op="pull")


def test_cache_rank1_shape_rows_are_single_elements():
    sd = dd = D(2, (5,), DataType.DT_FLOAT)
    segs, got, _, want = run_cache(sd, dd, 4, 0, -1, None, "push")
    assert sorted(segs) == [(0, 16, 0, 0, 4), (1, 16, 1, 0, 4)]
    assert_same(got, want)


# ---------------------------------------------------------------------------------------------
# plan_cache: properties


@st.composite
def range_spec(draw, start: int, span: int, num_layers: int):
    """A valid spelling of layers ``start .. start+span-1``."""
    kinds = ["tuple", "range", "list"]
    if start == 0 and span == num_layers:
        kinds += ["all", "none"]
    kind = draw(st.sampled_from(kinds))
    return {"tuple": (start, start + span - 1), "range": range(start, start + span),
            "list": [start, start + span - 1], "all": (-1, -1), "none": None}[kind]


@st.composite
def cache_case(draw, valid_ranges: bool = True):
    tnpl = draw(st.integers(1, 4))
    nls, nld = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    row_shape = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    dtype = draw(st.sampled_from(DTYPES))
    sd = CacheDesc(nls * tnpl, (draw(st.integers(1, 4)), *row_shape), dtype)
    dd = CacheDesc(nld * tnpl, (draw(st.integers(1, 4)), *row_shape), dtype)
    if nls == nld and draw(st.booleans()):
        ext = None
    elif valid_ranges:
        span = draw(st.integers(1, min(nls, nld)))
        s0, d0 = draw(st.integers(0, nls - span)), draw(st.integers(0, nld - span))
        ext = Ext(draw(range_spec(s0, span, nls)), draw(range_spec(d0, span, nld)), tnpl)
    else:
        def any_spec(nl):
            return st.one_of(
                st.none(), st.just((-1, -1)),
                st.tuples(st.integers(-2, nl + 1), st.integers(-2, nl + 1)),
                st.builds(range, st.integers(-1, nl + 1), st.integers(-1, nl + 1), st.sampled_from([1, 1, 1, 2, -1])))
        ext = Ext(draw(any_spec(nls)), draw(any_spec(nld)), tnpl)
    sb = draw(st.integers(0, sd.shape[0] - 1))
    db = draw(st.integers(0, dd.shape[0] - 1))
    return sd, dd, sb, db, ext


@HYP
@given(cache_case(), st.sampled_from(["push", "pull"]), st.integers(0, 2**32 - 1))
def test_plan_cache_matches_reference(case, op, seed):
    sd, dd, sb, db, ext = case
    segs, got, _, want = run_cache(sd, dd, sb, db, -1, ext, op, seed)
    pairs = ref_pairs(sd, dd, ext)
    rb = sd.row_bytes
    assert len(segs) == len(pairs)
    assert sorted(segs) == sorted((s, sb * rb, d, db * rb, rb) for s, d in pairs)
    assert_same(got, want)
    assert plan.coalesce(segs) == segs  # distinct tensor pairs never merge at the tensor level


@HYP
@given(cache_case(valid_ranges=False), st.integers(0, 2**32 - 1))
def test_plan_cache_any_ranges_valid_iff_rules_hold(case, seed):
    sd, dd, sb, db, ext = case
    ok = True
    if ext is not None:
        t = ext.tensor_num_per_layer
        nls, nld = sd.num_tensors // t, dd.num_tensors // t
        ok = ref_range_ok(ext.src_layer_range, nls) and ref_range_ok(ext.dst_layer_range, nld)
        ok = ok and len(ref_layers(ext.src_layer_range, nls)) == len(ref_layers(ext.dst_layer_range, nld))
    if not ok:
        with pytest.raises(ParamInvalid, match=r"layer_range"):
            plan.plan_cache(sd, dd, sb, db, -1, ext, op="push")
        return
    _, got, _, want = run_cache(sd, dd, sb, db, -1, ext, "push", seed)
    assert_same(got, want)


@HYP
@given(st.data())
def test_plan_cache_size_and_batch_rules(data):
    draw = data.draw
    n = draw(st.integers(1, 4))
    sdt = draw(st.sampled_from(DTYPES[:3]))
    ddt = sdt if draw(st.integers(0, 4)) else draw(st.sampled_from(DTYPES[:3]))
    sd = CacheDesc(n, (draw(st.integers(1, 3)), draw(st.integers(1, 4))), sdt)
    dd = CacheDesc(n, (draw(st.integers(1, 3)), draw(st.integers(1, 4))), ddt)
    sb = draw(st.integers(-1, sd.shape[0]))
    db = draw(st.integers(-1, dd.shape[0]))
    srb, drb = sd.row_bytes, dd.row_bytes
    size = draw(st.one_of(st.just(-1), st.integers(-3, max(srb, drb) + 2)))
    op = draw(st.sampled_from(["push", "pull"]))
    ok = 0 <= sb < sd.shape[0] and 0 <= db < dd.shape[0] and sdt == ddt
    if op == "push":
        ok = ok and size == -1 and srb == drb
    else:
        ok = ok and ((size == -1 and srb == drb) or 0 < size <= min(srb, drb))
    if not ok:
        with pytest.raises(ParamInvalid):
            plan.plan_cache(sd, dd, sb, db, size, None, op=op)
        return
    segs, got, _, want = run_cache(sd, dd, sb, db, size, None, op, draw(st.integers(0, 2**32 - 1)))
    nbytes = srb if size == -1 else size
    assert sorted(segs) == [(t, sb * srb, t, db * drb, nbytes) for t in range(n)]
    assert_same(got, want)


# ---------------------------------------------------------------------------------------------
# block_runs


@pytest.mark.parametrize("src,dst,want", [
    ([], [], []),
    ([5], [9], [(5, 9, 1)]),
    ([0, 1, 2], [10, 11, 12], [(0, 10, 3)]),
    ([0, 1, 2, 5, 6], [3, 4, 5, 6, 7], [(0, 3, 3), (5, 6, 2)]),   # src breaks, dst continues
    ([0, 1, 2, 3], [0, 1, 5, 6], [(0, 0, 2), (2, 5, 2)]),          # dst breaks, src continues
    ([3, 2, 1], [0, 1, 2], [(3, 0, 1), (2, 1, 1), (1, 2, 1)]),     # src descending
    ([0, 1], [1, 0], [(0, 1, 1), (1, 0, 1)]),                      # dst descending
    ([4, 4, 4], [0, 1, 2], [(4, 0, 1), (4, 1, 1), (4, 2, 1)]),     # repeated source block
    ([0, 1, 0, 1], [0, 1, 2, 3], [(0, 0, 2), (0, 2, 2)]),
    ([7, 8, 9, 10], [3, 4, 5, 6], [(7, 3, 4)]),
    ([1, 3, 5], [1, 3, 5], [(1, 1, 1), (3, 3, 1), (5, 5, 1)]),     # stride 2 is not a run
])
def test_block_runs_examples(src, dst, want):
    assert plan.block_runs(src, dst) == want
    assert plan.block_runs(src, dst) == ref_runs(src, dst)


@HYP
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=12))
def test_block_runs_property(pairs):
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    runs = plan.block_runs(src, dst)
    assert runs == ref_runs(src, dst)
    # expanding the runs gives back the lists, and neighbouring runs cannot be merged
    assert [s + i for s, _, n in runs for i in range(n)] == src
    assert [d + i for _, d, n in runs for i in range(n)] == dst
    for (s1, d1, n1), (s2, d2, _) in zip(runs, runs[1:]):
        assert not (s1 + n1 == s2 and d1 + n1 == d2)


# ---------------------------------------------------------------------------------------------
# plan_blocks: examples


def test_blocks_runs_move_as_one_segment_per_tensor_pair():
    sd = dd = D(4, (16, 2, 4), DataType.DT_FLOAT16)  # 16 bytes per block
    segs, got, before, want = run_blocks(sd, dd, [0, 1, 2], [10, 11, 12], None)
    assert sorted(segs) == [(t, 0, t, 160, 48) for t in range(4)]
    assert_same(got, want)
    for t in range(4):
        untouched = [b for b in range(16) if b not in (10, 11, 12)]
        assert np.array_equal(rows(got[t])[untouched], rows(before[t])[untouched])


def test_blocks_mixed_runs():
    sd, dd = D(2, (8, 3), DataType.DT_INT8), D(2, (12, 3), DataType.DT_INT8)
    sbl, dbl = [4, 5, 6, 0, 2, 3], [9, 10, 11, 0, 1, 2]
    segs, got, _, want = run_blocks(sd, dd, sbl, dbl, None)
    # runs: (4->9, 3), (0->0, 1), (2->1, 2)
    assert sorted(segs) == sorted([(t, 12, t, 27, 9) for t in range(2)] + [(t, 0, t, 0, 3) for t in range(2)]
                                  + [(t, 6, t, 3, 6) for t in range(2)])
    assert_same(got, want)


def test_blocks_fan_out_of_one_source_block():
    sd = dd = D(2, (4, 4), DataType.DT_FLOAT)
    segs, got, _, want = run_blocks(sd, dd, [1, 1, 1], [3, 0, 2], None, op="pull")
    assert len(segs) == 3 * 2
    assert_same(got, want)


def test_blocks_with_layer_ranges():
    # 3 tensors per layer; src layers 1..2 -> dst layer range(0, 2); other dst layers untouched
    sd, dd = D(9, (6, 2), DataType.DT_BF16), D(6, (5, 2), DataType.DT_BF16)
    ext = Ext((1, 2), range(0, 2), 3)
    sbl, dbl = [5, 0, 1], [0, 3, 4]
    segs, got, before, want = run_blocks(sd, dd, sbl, dbl, ext)
    assert len(segs) == 2 * 6  # runs [(5,0,1), (0,3,2)] x 6 tensor pairs
    pairs = list(zip(range(3, 9), range(0, 6)))
    assert sorted(segs) == sorted([(s, 20, d, 0, 4) for s, d in pairs] + [(s, 0, d, 12, 8) for s, d in pairs])
    assert_same(got, want)
    for t in range(6):
        assert np.array_equal(rows(got[t])[[1, 2]], rows(before[t])[[1, 2]])


def test_blocks_numpy_and_tuple_lists_equal_python_lists():
    want = plan.plan_blocks(NB, NB, [1, 2, 5], [0, 1, 2], None, op="push")
    assert plan.plan_blocks(NB, NB, np.array([1, 2, 5]), (0, 1, 2), None, op="push") == want
    assert plan.plan_blocks(NB, NB, [np.int32(1), np.int64(2), np.uint8(5)], range(3), None, op="pull") == want
    assert all(type(v) is int for seg in want for v in seg)


# ---------------------------------------------------------------------------------------------
# plan_blocks: properties


@st.composite
def block_lists(draw, nbs: int, nbd: int):
    """Equal-length block lists built from runs (so consecutive runs are common), unique dst."""
    specs = draw(st.lists(st.tuples(st.integers(0, nbs - 1), st.integers(0, nbd - 1), st.integers(1, 5)),
                          min_size=1, max_size=5))
    sbl, dbl, used = [], [], set()
    for s0, d0, n in specs:
        for i in range(n):
            s, d = s0 + i, d0 + i
            if s >= nbs or d >= nbd or d in used:
                break
            sbl.append(s)
            dbl.append(d)
            used.add(d)
    return sbl, dbl


@HYP
@given(st.data())
def test_plan_blocks_matches_reference(data):
    draw = data.draw
    tnpl = draw(st.integers(1, 3))
    nls, nld = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(DTYPES))
    inner = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    sd = CacheDesc(nls * tnpl, (draw(st.integers(1, 12)), *inner), dtype)
    dd = CacheDesc(nld * tnpl, (draw(st.integers(1, 12)), *inner), dtype)
    if nls == nld and draw(st.booleans()):
        ext = None
    else:
        span = draw(st.integers(1, min(nls, nld)))
        s0, d0 = draw(st.integers(0, nls - span)), draw(st.integers(0, nld - span))
        ext = Ext(draw(range_spec(s0, span, nls)), draw(range_spec(d0, span, nld)), tnpl)
    sbl, dbl = draw(block_lists(sd.shape[0], dd.shape[0]))
    assume(sbl)
    as_array = draw(st.booleans())
    segs, got, _, want = run_blocks(sd, dd, np.array(sbl) if as_array else sbl, dbl, ext,
                                    draw(st.sampled_from(["push", "pull"])), draw(st.integers(0, 2**32 - 1)))
    assert_same(got, want)
    pairs, runs, bb = ref_pairs(sd, dd, ext), ref_runs(sbl, dbl), sd.row_bytes
    assert len(segs) == len(runs) * len(pairs)
    assert sorted(segs) == sorted((s, rs * bb, d, rd * bb, n * bb) for s, d in pairs for rs, rd, n in runs)
    assert plan.coalesce(segs) == segs  # runs are already maximal


@HYP
@given(st.data())
def test_plan_blocks_any_lists_valid_iff_rules_hold(data):
    draw = data.draw
    nbs, nbd = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    sd, dd = D(2, (nbs, 3), DataType.DT_INT8), D(2, (nbd, 3), DataType.DT_INT8)
    sbl = draw(st.lists(st.integers(-2, nbs + 1), max_size=6))
    dbl = draw(st.lists(st.integers(-2, nbd + 1), max_size=6))
    ok = (len(sbl) > 0 and len(sbl) == len(dbl) and all(0 <= b < nbs for b in sbl)
          and all(0 <= b < nbd for b in dbl) and len(set(dbl)) == len(dbl))
    if not ok:
        with pytest.raises(ParamInvalid, match=r"block"):
            plan.plan_blocks(sd, dd, sbl, dbl, None, op="push")
        return
    _, got, _, want = run_blocks(sd, dd, sbl, dbl, None, "push", draw(st.integers(0, 2**32 - 1)))
    assert_same(got, want)


# ---------------------------------------------------------------------------------------------
# coalesce


@pytest.mark.parametrize("segs,want", [
    ([], []),
    ([(0, 0, 1, 0, 8)], [(0, 0, 1, 0, 8)]),
    ([(0, 0, 1, 100, 8), (0, 8, 1, 108, 4)], [(0, 0, 1, 100, 12)]),                 # contiguous both sides
    ([(0, 0, 1, 100, 8), (0, 8, 1, 108, 4), (0, 12, 1, 112, 1)], [(0, 0, 1, 100, 13)]),
    ([(0, 0, 1, 100, 8), (0, 8, 1, 109, 4)], [(0, 0, 1, 100, 8), (0, 8, 1, 109, 4)]),  # dst gap
    ([(0, 0, 1, 100, 8), (0, 9, 1, 108, 4)], [(0, 0, 1, 100, 8), (0, 9, 1, 108, 4)]),  # src gap
    ([(0, 0, 1, 100, 8), (0, 4, 1, 104, 4)], [(0, 0, 1, 100, 8), (0, 4, 1, 104, 4)]),  # overlap
    ([(0, 8, 1, 108, 4), (0, 0, 1, 100, 8)], [(0, 8, 1, 108, 4), (0, 0, 1, 100, 8)]),  # wrong order
    ([(0, 0, 1, 0, 8), (2, 8, 1, 8, 8)], [(0, 0, 1, 0, 8), (2, 8, 1, 8, 8)]),          # other src region
    ([(0, 0, 1, 0, 8), (0, 8, 2, 8, 8)], [(0, 0, 1, 0, 8), (0, 8, 2, 8, 8)]),          # other dst region
    ([(0, 0, 1, 0, 8), (3, 0, 3, 0, 8), (0, 8, 1, 8, 8)],                             # not neighbours
     [(0, 0, 1, 0, 8), (3, 0, 3, 0, 8), (0, 8, 1, 8, 8)]),
    ([(0, 0, 1, 0, 4), (0, 4, 1, 4, 4), (5, 0, 6, 0, 2), (5, 2, 6, 2, 2)], [(0, 0, 1, 0, 8), (5, 0, 6, 0, 4)]),
])
def test_coalesce_examples(segs, want):
    before = list(segs)
    assert plan.coalesce(segs) == want
    assert segs == before  # input not modified
    assert all(type(s) is tuple for s in plan.coalesce(segs))


@st.composite
def segment_chains(draw):
    """Segment lists where neighbours often continue each other on one or both sides."""
    n = draw(st.integers(0, 10))
    segs = []
    for _ in range(n):
        size = draw(st.integers(1, 6))
        how = draw(st.sampled_from(["both", "both", "both", "src", "dst", "fresh", "region"]))
        if not segs or how == "fresh":
            seg = (draw(st.integers(0, 1)), draw(st.integers(0, 40)), draw(st.integers(0, 1)),
                   draw(st.integers(0, 40)), size)
        else:
            sr, so, dr, do, pn = segs[-1]
            ns, nd = so + pn, do + pn
            if how == "src":
                nd += draw(st.integers(1, 3))
            elif how == "dst":
                ns += draw(st.integers(1, 3))
            elif how == "region":
                sr = 1 - sr
            seg = (sr, ns, dr, nd, size)
        segs.append(seg)
    return segs


def _continues(a, b) -> bool:
    return a[0] == b[0] and a[2] == b[2] and a[1] + a[4] == b[1] and a[3] + a[4] == b[3]


@HYP
@given(segment_chains(), st.integers(0, 2**32 - 1))
def test_coalesce_property(segs, seed):
    out = plan.coalesce(segs)
    # every output segment is a run of consecutive input segments that continue each other ...
    i = 0
    for o in out:
        j, total = i, 0
        while total < o[4]:
            if j > i:
                assert _continues(segs[j - 1], segs[j])
            total += segs[j][4]
            j += 1
        assert total == o[4]
        assert o[:4] == segs[i][:4]
        i = j
    assert i == len(segs)
    # ... and is maximal: no two output neighbours continue each other
    for a, b in zip(out, out[1:]):
        assert not _continues(a, b)
    assert plan.coalesce(out) == out
    # executing the coalesced list is the same as executing the original
    rng = np.random.default_rng(seed)  # chains reach at most 40 + 10 * (6 + 3) bytes
    src = [rng.integers(0, 256, 160, dtype=np.uint8) for _ in range(2)]
    dst_a = [np.zeros(160, np.uint8) for _ in range(2)]
    dst_b = [np.zeros(160, np.uint8) for _ in range(2)]
    apply(segs, src, dst_a)
    apply(out, src, dst_b)
    assert_same(dst_a, dst_b)


# ---------------------------------------------------------------------------------------------
# plans mapped onto regions, then coalesced (what the engine does)


def _to_region(segs, sd: CacheDesc, dd: CacheDesc):
    """Tensors laid out back to back in one region per cache (as allocate_cache does)."""
    return [(0, s * sd.size + so, 0, d * dd.size + do, n) for s, so, d, do, n in segs]


def _region_apply(segs, src_region: np.ndarray, dst_region: np.ndarray) -> None:
    apply(segs, [src_region], [dst_region])


def test_coalesce_merges_whole_tensors_when_batch_is_one():
    sd = dd = D(8, (1, 16))
    segs = _to_region(plan.plan_cache(sd, dd, 0, 0, -1, None, op="push"), sd, dd)
    assert plan.coalesce(segs) == [(0, 0, 0, 0, 8 * 32)]
    segs = _to_region(plan.plan_cache(sd, dd, 0, 0, -1, Ext((1, 2), (0, 1)), op="push"), sd, dd)
    assert plan.coalesce(segs) == [(0, 2 * 32, 0, 0, 4 * 32)]


def test_coalesce_does_not_merge_rows_of_different_tensors():
    sd = dd = D(4, (3, 16))
    segs = _to_region(plan.plan_cache(sd, dd, 1, 1, -1, None, op="push"), sd, dd)
    assert plan.coalesce(segs) == segs and len(segs) == 4


def test_coalesce_merges_block_runs_across_tensors_only_when_contiguous():
    sd = dd = D(2, (4, 8), DataType.DT_INT8)
    all_blocks = _to_region(plan.plan_blocks(sd, dd, [0, 1, 2, 3], [0, 1, 2, 3], None, op="push"), sd, dd)
    assert plan.coalesce(all_blocks) == [(0, 0, 0, 0, 64)]
    tail = _to_region(plan.plan_blocks(sd, dd, [2, 3], [2, 3], None, op="push"), sd, dd)
    assert plan.coalesce(tail) == tail  # tensor 0's blocks 2..3 and tensor 1's blocks 2..3 are not adjacent


@HYP
@given(st.data())
def test_region_coalesced_plans_match_reference(data):
    draw = data.draw
    tnpl = draw(st.integers(1, 3))
    nl = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(DTYPES))
    inner = tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
    sd = CacheDesc(nl * tnpl, (draw(st.integers(1, 3)), *inner), dtype)
    dd = CacheDesc(nl * tnpl, (draw(st.integers(1, 3)), *inner), dtype)
    span = draw(st.integers(1, nl))
    s0, d0 = draw(st.integers(0, nl - span)), draw(st.integers(0, nl - span))
    ext = Ext(draw(range_spec(s0, span, nl)), draw(range_spec(d0, span, nl)), tnpl)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    src_region = rng.integers(0, 256, sd.nbytes, dtype=np.uint8)
    dst_region = rng.integers(0, 256, dd.nbytes, dtype=np.uint8)
    src = [src_region[t * sd.size:(t + 1) * sd.size].view(sd.dtype.numpy_dtype).reshape(sd.shape) for t in range(sd.num_tensors)]
    dst = [dst_region[t * dd.size:(t + 1) * dd.size].view(dd.dtype.numpy_dtype).reshape(dd.shape) for t in range(dd.num_tensors)]
    src0, dst0 = copies(src), copies(dst)
    if draw(st.booleans()):
        sb, db = draw(st.integers(0, sd.shape[0] - 1)), draw(st.integers(0, dd.shape[0] - 1))
        segs = plan.plan_cache(sd, dd, sb, db, -1, ext, op="push")
        want = expected_cache(src0, dst0, ref_pairs(sd, dd, ext), sb, db, sd.row_bytes)
    else:
        sbl, dbl = draw(block_lists(sd.shape[0], dd.shape[0]))
        assume(sbl)
        segs = plan.plan_blocks(sd, dd, sbl, dbl, ext, op="push")
        want = expected_blocks(src0, dst0, ref_pairs(sd, dd, ext), sbl, dbl)
    merged = plan.coalesce(_to_region(segs, sd, dd))
    assert len(merged) <= len(segs)
    assert sum(s[4] for s in merged) == sum(s[4] for s in segs)
    _region_apply(merged, src_region, dst_region)
    assert_same(dst, want)
    assert_same(src, src0)
