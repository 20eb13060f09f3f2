"""Plain data types of the public API (kvengine/types.py)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


from kvengine import options, status, types  # noqa: E402  (pure Python: no native build needed)
DataType, CacheDesc, Placement, Role = types.DataType, types.CacheDesc, types.Placement, types.Role
EngineOptions = options.EngineOptions
ParamInvalid = status.LLMParamInvalidError

# LLM-DataDist's DataType values are GE ids (LLM-DataDist API reference, "DataType";
# docs/llm_datadist.md, "Types").
GE_IDS = {
    "DT_FLOAT": 0, "DT_FLOAT16": 1, "DT_INT8": 2, "DT_INT32": 3, "DT_UINT8": 4, "DT_INT16": 6,
    "DT_UINT16": 7, "DT_UINT32": 8, "DT_INT64": 9, "DT_UINT64": 10, "DT_DOUBLE": 11,
    "DT_BOOL": 12, "DT_BF16": 27,
}
ITEMSIZE = {
    "DT_FLOAT": 4, "DT_FLOAT16": 2, "DT_INT8": 1, "DT_INT32": 4, "DT_UINT8": 1, "DT_INT16": 2,
    "DT_UINT16": 2, "DT_UINT32": 4, "DT_INT64": 8, "DT_UINT64": 8, "DT_DOUBLE": 8,
    "DT_BOOL": 1, "DT_BF16": 2,
}
NUMPY = {
    "DT_FLOAT": np.float32, "DT_FLOAT16": np.float16, "DT_INT8": np.int8, "DT_INT32": np.int32,
    "DT_UINT8": np.uint8, "DT_INT16": np.int16, "DT_UINT16": np.uint16, "DT_UINT32": np.uint32,
    "DT_INT64": np.int64, "DT_UINT64": np.uint64, "DT_DOUBLE": np.float64, "DT_BOOL": np.bool_,
}

NON_NATIVE_F2 = ">f2" if sys.byteorder == "little" else "<f2"


class Opaque:
    """Not a dtype, not a shape (stable repr, so test ids are stable)."""

    def __repr__(self) -> str:
        return "Opaque()"


# ---------------------------------------------------------------------------------------------
# enums


def test_datatype_ids_are_ge_ids():
    assert {m.name: int(m) for m in DataType} == GE_IDS


@pytest.mark.parametrize("name", list(GE_IDS))
def test_datatype_itemsize_and_numpy_dtype(name):
    dt = DataType[name]
    assert dt.itemsize == ITEMSIZE[name]
    assert dt.numpy_dtype.itemsize == ITEMSIZE[name]
    if name in NUMPY:
        assert dt.numpy_dtype == np.dtype(NUMPY[name])
    else:  # bf16: ml_dtypes.bfloat16 when installed, else raw uint16
        assert dt.numpy_dtype.name in ("bfloat16", "uint16")


@pytest.mark.parametrize("name", list(GE_IDS))
def test_datatype_prints_by_name(name):
    dt = DataType[name]
    assert str(dt) == name and f"{dt}" == name and f"{dt:<10}|" == f"{name:<10}|"
    assert int(dt) == GE_IDS[name] and dt == GE_IDS[name] and f"{dt:d}" == str(GE_IDS[name])
    assert repr(dt) == f"<DataType.{name}: {GE_IDS[name]}>"
    assert json.dumps({"dtype": dt}) == '{"dtype": %d}' % GE_IDS[name]   # the wire keeps the id


def test_layer_range_alias_is_gone():
    assert not hasattr(types, "LayerRange") and "LayerRange" not in types.__all__


def test_role_and_placement_values():
    assert {m.name: int(m) for m in Role} == {"PROMPT": 1, "DECODER": 2, "MIX": 3}
    assert {m.name: int(m) for m in Placement} == {"HOST": 0, "DEVICE": 1}
    assert issubclass(Role, int) and issubclass(Placement, int)


@pytest.mark.parametrize("member", list(Role) + list(Placement), ids=str)
def test_role_and_placement_print_by_name(member):
    """As DataType and the statuses: str() and format() give the name, numeric format
    specs and int() the number, repr() both; the wire keeps the number."""
    name, value, cls = member.name, int(member), type(member).__name__
    assert str(member) == name and f"{member}" == name and "%s" % member == name
    assert f"{member:>10}|" == f"{name:>10}|"
    assert f"{member:d}" == str(value) and member == value
    assert repr(member) == f"<{cls}.{name}: {value}>"
    assert json.dumps({"role": member}) == '{"role": %d}' % value
    assert str(Role.PROMPT) == "PROMPT" and f"{Placement.HOST}" == "HOST"


# ---------------------------------------------------------------------------------------------
# DataType.from_any


@pytest.mark.parametrize("name", list(GE_IDS))
def test_from_any_accepts_enum_id_and_name(name):
    dt = DataType[name]
    assert DataType.from_any(dt) is dt
    assert DataType.from_any(GE_IDS[name]) is dt
    assert DataType.from_any(np.int64(GE_IDS[name])) is dt
    assert DataType.from_any(np.uint8(GE_IDS[name])) is dt
    assert DataType.from_any(name) is dt
    assert DataType.from_any(name.lower()) is dt


@pytest.mark.parametrize("name", list(NUMPY))
def test_from_any_accepts_numpy_dtypes(name):
    dt = DataType[name]
    npt = NUMPY[name]
    assert DataType.from_any(npt) is dt
    assert DataType.from_any(np.dtype(npt)) is dt
    assert DataType.from_any(np.dtype(npt).name) is dt
    assert DataType.from_any(np.dtype(npt).str) is dt  # e.g. "<f2"
    assert DataType.from_any(np.zeros(1, npt).dtype) is dt


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "BF16", "BFloat16", "DT_BF16"])
def test_from_any_bf16_spellings(spelling):
    assert DataType.from_any(spelling) is DataType.DT_BF16


def test_bf16_numpy_view_dtype():
    """bf16 tensors are ml_dtypes.bfloat16 views when ml_dtypes is installed, else uint16."""
    try:
        import ml_dtypes
    except ImportError:
        assert DataType.DT_BF16.numpy_dtype == np.dtype(np.uint16)
        return
    assert DataType.DT_BF16.numpy_dtype == np.dtype(ml_dtypes.bfloat16)
    assert DataType.from_any(ml_dtypes.bfloat16) is DataType.DT_BF16
    assert DataType.from_any(np.dtype(ml_dtypes.bfloat16)) is DataType.DT_BF16


@pytest.mark.parametrize("bad", [
    5, 13, 14, 26, 28, -1, 2**40, np.int32(99),         # ids GE has but kvengine does not, or none
    "foo", "", "DT_STRING", "DT_UNDEFINED", "float8",   # unknown names
    "complex64", np.complex64, np.dtype("U5"), "S4", "O", "float16,int8", "(2,)f2",
    NON_NATIVE_F2,                                      # non-native byte order
    [("a", "f4", -1)],                                  # numpy raises ValueError for this one
    Opaque(), 3.5, True, False, None, b"\xff",
], ids=repr)
def test_from_any_rejects_unknown(bad):
    with pytest.raises(ParamInvalid):
        DataType.from_any(bad)
    with pytest.raises(ParamInvalid):
        CacheDesc(2, (4, 8), bad)


def test_unknown_dtype_error_is_param_invalid_status():
    with pytest.raises(ParamInvalid) as info:
        CacheDesc(2, (4, 8), "nonsense")
    assert info.value.status == status.LLMStatusCode.LLM_PARAM_INVALID
    assert "nonsense" in str(info.value)


# ---------------------------------------------------------------------------------------------
# CacheDesc validation


def test_cachedesc_defaults_and_normalisation():
    d = CacheDesc(num_tensors=64, shape=[4, 2048, 1024], dtype=DataType.DT_FLOAT16)
    assert d.shape == (4, 2048, 1024) and type(d.shape) is tuple
    assert d.placement is Placement.HOST
    assert d.dtype is DataType.DT_FLOAT16
    d = CacheDesc(np.int64(3), np.array([2, 5]), "float32", 1)
    assert d.num_tensors == 3 and type(d.num_tensors) is int
    assert d.shape == (2, 5) and all(type(x) is int for x in d.shape)
    assert d.dtype is DataType.DT_FLOAT
    assert d.placement is Placement.DEVICE
    assert CacheDesc(1, 7, np.int8).shape == (7,)
    assert CacheDesc(1, np.int64(7), np.int8).shape == (7,)
    assert CacheDesc(1, (3,), np.uint8, Placement.HOST).placement is Placement.HOST


def test_cachedesc_is_frozen_hashable_and_comparable():
    a = CacheDesc(2, (4, 8), "float16")
    b = CacheDesc(2, [4, 8], DataType.DT_FLOAT16, Placement.HOST)
    assert a == b and hash(a) == hash(b)
    assert a != CacheDesc(2, (4, 8), "float16", Placement.DEVICE)
    assert a != CacheDesc(2, (4, 9), "float16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_tensors = 3  # type: ignore[misc]


@pytest.mark.parametrize("n", [0, -1, 2**32, 1.0, 2.5, True, False, "2", None, np.float64(2)], ids=repr)
def test_cachedesc_num_tensors_invalid(n):
    with pytest.raises(ParamInvalid, match="num_tensors"):
        CacheDesc(n, (4, 8), "float16")


def test_cachedesc_num_tensors_bounds_valid():
    assert CacheDesc(1, (1,), "int8").num_tensors == 1
    assert CacheDesc(2**32 - 1, (1,), "int8").num_tensors == 2**32 - 1


def test_cachedesc_rank_limits():
    assert len(CacheDesc(1, (1,) * 31, "int8").shape) == 31
    with pytest.raises(ParamInvalid, match=r"1\.\.31 dims"):
        CacheDesc(1, (1,) * 32, "int8")
    with pytest.raises(ParamInvalid, match=r"1\.\.31 dims"):
        CacheDesc(1, (), "int8")
    with pytest.raises(ParamInvalid, match=r"1\.\.31 dims"):
        CacheDesc(1, [], "int8")


@pytest.mark.parametrize("bad_dim", [0, -1, -(2**63), 2**63, 1.0, 2.5, True, "3", None], ids=repr)
@pytest.mark.parametrize("pos", [0, 1, 2])
def test_cachedesc_dims_must_be_positive_ints(bad_dim, pos):
    shape = [4, 5, 6]
    shape[pos] = bad_dim
    with pytest.raises(ParamInvalid, match=rf"shape\[{pos}\]"):
        CacheDesc(2, shape, "float16")


@pytest.mark.parametrize("shape", [None, 3.5, Opaque()], ids=repr)
def test_cachedesc_shape_not_a_sequence(shape):
    with pytest.raises(ParamInvalid, match="shape"):
        CacheDesc(2, shape, "float16")


def test_cachedesc_total_size_bound():
    """Dims may be int64, but a cache larger than 2**48 bytes is refused (offsets stay far
    inside the native uint64 segment words)."""
    assert CacheDesc(1, (2**48,), "int8").nbytes == 2**48
    with pytest.raises(ParamInvalid, match="exceeds"):
        CacheDesc(1, (2**63 - 1,), "int8")
    with pytest.raises(ParamInvalid, match="exceeds"):
        CacheDesc(2, (2**47 + 1,), "int8")


@pytest.mark.parametrize("placement", [2, -1, "HOST", None, 1.5], ids=repr)
def test_cachedesc_placement_invalid(placement):
    with pytest.raises(ParamInvalid, match="placement"):
        CacheDesc(2, (4, 8), "float16", placement)


# ---------------------------------------------------------------------------------------------
# derived sizes


@pytest.mark.parametrize("n,shape,dtype,size,row", [
    (64, (4, 2048, 1024), DataType.DT_FLOAT16, 4 * 2048 * 1024 * 2, 2048 * 1024 * 2),
    (2, (8,), DataType.DT_INT8, 8, 1),
    (3, (5, 7), DataType.DT_FLOAT, 140, 28),
    (1, (1, 1, 1), DataType.DT_BOOL, 1, 1),
    (4, (16, 128, 8), DataType.DT_BF16, 16 * 128 * 8 * 2, 128 * 8 * 2),
    (5, (3, 2), DataType.DT_UINT64, 48, 16),
])
def test_derived_sizes_examples(n, shape, dtype, size, row):
    d = CacheDesc(n, shape, dtype)
    assert d.batch_size == shape[0]
    assert d.size == size
    assert d.row_bytes == row
    assert d.nbytes == size * n


_descs = st.builds(
    CacheDesc,
    num_tensors=st.integers(1, 300),
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=6).map(tuple),
    dtype=st.sampled_from(list(DataType)),
    placement=st.sampled_from(list(Placement)),
)


@settings(max_examples=200, deadline=None, database=None)
@given(_descs)
def test_derived_sizes_property(d):
    item = ITEMSIZE[d.dtype.name]
    assert d.batch_size == d.shape[0]
    assert d.size == math.prod(d.shape) * item
    assert d.row_bytes == math.prod(d.shape[1:]) * item
    assert d.row_bytes * d.batch_size == d.size
    assert d.nbytes == d.size * d.num_tensors
    if d.dtype.name in NUMPY:  # what a numpy tensor of that desc occupies
        assert np.zeros(d.shape, NUMPY[d.dtype.name]).nbytes == d.size
    assert all(type(v) is int for v in (d.size, d.row_bytes, d.nbytes, d.batch_size))


# ---------------------------------------------------------------------------------------------
# wire form


@settings(max_examples=200, deadline=None, database=None)
@given(_descs)
def test_wire_round_trip(d):
    wire = d.to_wire()
    assert CacheDesc.from_wire(wire) == d
    text = json.dumps(wire)  # plain JSON types only
    back = CacheDesc.from_wire(json.loads(text))
    assert back == d
    assert back.dtype is d.dtype and back.placement is d.placement
    assert type(back.shape) is tuple


def test_wire_form_uses_ge_ids():
    wire = CacheDesc(3, (2, 4), DataType.DT_BF16, Placement.DEVICE).to_wire()
    assert wire["dtype"] == 27 and type(wire["dtype"]) is int
    assert wire["placement"] == 1 and type(wire["placement"]) is int
    assert wire["shape"] == [2, 4]
    assert wire["n"] == 3


@pytest.mark.parametrize("patch", [
    {"dtype": 99}, {"dtype": 5}, {"placement": 7}, {"n": 0}, {"shape": []}, {"shape": [0, 4]},
], ids=repr)
def test_from_wire_rejects_bad_values(patch):
    wire = CacheDesc(3, (2, 4), DataType.DT_FLOAT16).to_wire()
    wire.update(patch)
    with pytest.raises(ValueError):  # LLMParamInvalidError is a ValueError too
        CacheDesc.from_wire(wire)


# ---------------------------------------------------------------------------------------------
# small records


def test_records_defaults():
    assert types.CacheIndex(2, 7).batch_index == 0
    assert types.CacheIndex(cluster_id=2, cache_id=7, batch_index=1) == types.CacheIndex(2, 7, 1)
    assert types.BlocksCacheKey(2, 7) == types.BlocksCacheKey(cluster_id=2, cache_id=7)
    ext = types.KvCacheExtParam()
    assert ext.src_layer_range == (-1, -1) and ext.dst_layer_range == (-1, -1)
    assert ext.tensor_num_per_layer == 2
    assert types.ClusterInfo(2, "10.0.0.2:26000").remote_cluster_id == 2


# ---------------------------------------------------------------------------------------------
# EngineOptions


def test_engine_options_defaults(monkeypatch):
    monkeypatch.delenv("KVENGINE_SECRET", raising=False)
    o = EngineOptions()
    assert o.sync_kv_timeout == 1.0  # LLM-DataDist's 1000 ms
    assert o.link_timeout == 3.0
    assert o.secret is None
    assert o.transport == "auto"
    assert o.movers == 2
    assert o.inline_threshold == 1 << 20
    assert o.chunk_bytes == 1 << 20
    assert o.tcp_window_bytes == 4 << 20
    assert o.max_inflight_bytes is None and o.piece_bytes is None   # per transport (scheduler.py)


def test_engine_options_secret_from_env(monkeypatch):
    monkeypatch.setenv("KVENGINE_SECRET", "s3cret")
    assert EngineOptions().secret == b"s3cret"
    assert EngineOptions(secret=b"explicit").secret == b"explicit"
    monkeypatch.setenv("KVENGINE_SECRET", "")
    assert EngineOptions().secret is None


@pytest.mark.parametrize("kwargs", [
    dict(sync_kv_timeout=0.25, link_timeout=10),
    dict(sync_kv_timeout=2, link_timeout=0.001),
    dict(transport="local"), dict(transport="shm"), dict(transport="auto"),
    dict(movers=1), dict(movers=64), dict(movers=np.int32(4)),
    dict(inline_threshold=0), dict(inline_threshold=1 << 30),
    dict(chunk_bytes=4096), dict(chunk_bytes=64 << 20),
    dict(tcp_window_bytes=0), dict(tcp_window_bytes=64 << 10), dict(tcp_window_bytes=1 << 40),
    dict(secret=b"k"), dict(secret=bytearray(b"k")), dict(secret=None),
], ids=repr)
def test_engine_options_valid(kwargs):
    o = EngineOptions(**kwargs)
    for k, v in kwargs.items():
        assert getattr(o, k) == v


@pytest.mark.parametrize("field", ["sync_kv_timeout", "link_timeout", "heartbeat_interval", "heartbeat_timeout"])
@pytest.mark.parametrize("bad", [0, 0.0, -1, -0.5, float("nan"), float("inf"), "1", None, True, b"1"], ids=repr)
def test_engine_options_timeouts_invalid(field, bad):
    with pytest.raises(ParamInvalid, match=field):
        EngineOptions(**{field: bad})


@pytest.mark.parametrize("field,bad", [
    ("transport", None), ("transport", "AUTO"), ("transport", "rdma"),
    ("tcp_streams", 0), ("tcp_streams", 17), ("heartbeat_interval", 0), ("heartbeat_timeout", -1),
    ("heartbeat_timeout", 0.1),   # not above heartbeat_interval
    ("movers", 0), ("movers", 65), ("movers", 1.5), ("movers", True), ("movers", "2"),
    ("inline_threshold", -1), ("inline_threshold", (1 << 30) + 1), ("inline_threshold", 1.0),
    ("chunk_bytes", 4095), ("chunk_bytes", (64 << 20) + 1), ("chunk_bytes", (1 << 30) + 1), ("chunk_bytes", 0), ("chunk_bytes", None),
    ("secret", "text"), ("secret", 123),
    ("tcp_window_bytes", (64 << 10) - 1), ("tcp_window_bytes", -1), ("tcp_window_bytes", (1 << 40) + 1),
    ("tcp_window_bytes", None), ("tcp_window_bytes", False), ("tcp_window_bytes", 1.5),
], ids=repr)
def test_engine_options_invalid(field, bad):
    with pytest.raises(ParamInvalid, match=field):
        EngineOptions(**{field: bad})


# ---------------------------------------------------------------------------------------------
# the typed surface: py.typed and the stub of the compiled core

PKG = Path(types.__file__).resolve().parent


def test_package_is_marked_typed_and_ships_the_marker():
    assert (PKG / "py.typed").is_file()
    assert (PKG / "_native.pyi").is_file()
    import tomllib
    project = tomllib.loads((PKG.parent / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.11"
    data = project["tool"]["setuptools"]["package-data"]["kvengine"]
    assert "py.typed" in data and "*.pyi" in data


def _stub() -> tuple[dict[str, ast.AST], dict[str, ast.FunctionDef]]:
    tree = ast.parse((PKG / "_native.pyi").read_text())
    top: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top[node.target.id] = node
    core = top["Core"]
    assert isinstance(core, ast.ClassDef)
    methods = {n.name: n for n in core.body if isinstance(n, ast.FunctionDef)}
    return top, methods


def _public(obj) -> set[str]:
    return {n for n in vars(obj) if not n.startswith("_") and not inspect.ismodule(getattr(obj, n))}


def _stub_params(fn: ast.FunctionDef) -> list[tuple[str, str | None]]:
    args = fn.args.args
    defaults = [None] * (len(args) - len(fn.args.defaults)) + [ast.unparse(d) for d in fn.args.defaults]
    return [(a.arg, d) for a, d in zip(args, defaults)]


def _compiled_params(fn) -> list[tuple[str, str | None]]:
    return [(p.name, None if p.default is p.empty else repr(p.default))
            for p in inspect.signature(fn).parameters.values()]


def _norm(params):   # the stub may spell a default as an expression (1 << 20)
    return [(n, None if d is None else repr(eval(d))) for n, d in params]


def test_native_stub_names_every_public_name_of_the_compiled_module():
    native = pytest.importorskip("kvengine.native")._native
    top, methods = _stub()
    assert set(top) == _public(native)
    assert set(methods) - {"__init__"} == _public(native.Core)
    for name, node in top.items():   # constants have the type declared (Final[int], Final[bool])
        if isinstance(node, ast.AnnAssign):
            want = bool if ast.unparse(node.annotation) == "Final[bool]" else int
            assert type(getattr(native, name)) is want, name
    assert _norm(_stub_params(top["map_fd"])) == _compiled_params(native.map_fd)
    for name, fn in methods.items():
        if name != "__init__":
            assert _norm(_stub_params(fn)) == _compiled_params(getattr(native.Core, name)), name
