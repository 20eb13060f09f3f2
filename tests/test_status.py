"""Status codes and their exceptions (kvengine/status.py, cython_src/csrc/kv_status.h).

The expected values are written out from LLM-DataDist's status table (the
LLM-DataDist API reference, "LLMStatusCode"; summarised in docs/llm_datadist.md,
"Statuses"), not read back from kvengine.
"""

from __future__ import annotations

import ast
import copy
import pickle
import re
from pathlib import Path

import pytest


from kvengine import status  # noqa: E402  (pure Python: no native build needed)
LLMStatusCode = status.LLMStatusCode
LLMError = status.LLMError

REPO = Path(__file__).resolve().parents[1]
KV_STATUS_H = REPO / "cython_src" / "csrc" / "kv_status.h"

# LLM-DataDist's LLMStatusCode table, literally: (Python name, hex, decimal). Hex and decimal are both
# copied from the doc so a typo in either shows up in test_doc_table_is_self_consistent.
DOC_TABLE = [
    ("LLM_SUCCESS", 0x0, 0),
    ("LLM_FAILED", 0xFFFFFFFF, 4294967295),
    ("LLM_WAIT_PROCESS_TIMEOUT", 0x5010B001, 1343270913),
    ("LLM_KV_CACHE_NOT_EXIST", 0x5010B002, 1343270914),
    ("LLM_REPEAT_REQUEST", 0x5010B003, 1343270915),
    ("LLM_REQUEST_ALREADY_COMPLETED", 0x5010B004, 1343270916),
    ("LLM_PARAM_INVALID", 0x5010B005, 1343270917),
    ("LLM_ENGINE_FINALIZED", 0x5010B006, 1343270918),
    ("LLM_NOT_YET_LINK", 0x5010B007, 1343270919),
    ("LLM_ALREADY_LINK", 0x5010B008, 1343270920),
    ("LLM_LINK_FAILED", 0x5010B009, 1343270921),
    ("LLM_UNLINK_FAILED", 0x5010B00A, 1343270922),
    ("LLM_NOTIFY_PROMPT_UNLINK_FAILED", 0x5010B00B, 1343270923),
    ("LLM_CLUSTER_NUM_EXCEED_LIMIT", 0x5010B00C, 1343270924),
    ("LLM_PROCESSING_LINK", 0x5010B00D, 1343270925),
    ("LLM_DEVICE_OUT_OF_MEMORY", 0x5010B00E, 1343270926),
    ("LLM_PREFIX_ALREADY_EXIST", 0x5010B00F, 1343270927),
    ("LLM_PREFIX_NOT_EXIST", 0x5010B010, 1343270928),
    ("LLM_SEQ_LENOVERLIMIT", 0x5010B011, 1343270929),
    ("LLM_NO_FREE_BLOCK", 0x5010B012, 1343270930),
    ("LLM_BLOCKS_OUT_OF_MEMORY", 0x5010B013, 1343270931),
    ("LLM_CACHE_INCOMPATIBLE", 0x5010B014, 1343270932),
    ("LLM_CACHE_KEY_ALREADY_EXIST", 0x5010B015, 1343270933),
    ("LLM_COPY_CACHE_FAILED", 0x5010B016, 1343270934),
    ("LLM_CACHE_ID_ALREADY_EXIST", 0x5010B017, 1343270935),
    ("LLM_EXIST_LINK", 0x5010B018, 1343270936),
    ("LLM_FEATURE_NOT_ENABLED", 0x5010B019, 1343270937),
    ("LLM_TIMEOUT", 0x5010B01A, 1343270938),
    ("LLM_LINK_BUSY", 0x5010B01B, 1343270939),
    ("LLM_OUT_OF_MEMORY", 0x5010B01C, 1343270940),
    ("LLM_DEVICE_MEM_ERROR", 507053, 507053),
    ("LLM_SUSPECT_REMOTE_ERROR", 507057, 507057),
    ("LLM_UNKNOWN_ERROR", -1, -1),
]
DOC_CODES = {name: value for name, value, _ in DOC_TABLE}

# C++ spelling -> Python spelling, where they differ.
CPP_ALIASES = {
    "LLM_WAIT_PROC_TIMEOUT": "LLM_WAIT_PROCESS_TIMEOUT",
    "LLM_SEQ_LEN_OVER_LIMIT": "LLM_SEQ_LENOVERLIMIT",
}

# kvengine's own additions (not in LLM-DataDist).
KVENGINE_EXTRA = {"LLM_CANCELLED"}

# Names the public API promises (docs/api.md, "Statuses and exceptions") for some codes.
NAMED_CLASSES = {
    "LLM_PARAM_INVALID": "LLMParamInvalidError",
    "LLM_NOT_YET_LINK": "LLMNotYetLinkError",
    "LLM_TIMEOUT": "LLMTimeoutError",
    "LLM_KV_CACHE_NOT_EXIST": "LLMKvCacheNotExistError",
    "LLM_LINK_FAILED": "LLMLinkFailedError",
    "LLM_WAIT_PROCESS_TIMEOUT": "LLMWaitProcessTimeoutError",
    "LLM_FAILED": "LLMFailedError",
    "LLM_ALREADY_LINK": "LLMAlreadyLinkError",
    "LLM_CANCELLED": "LLMCancelledError",
}

CANONICAL = [m for name, m in LLMStatusCode.__members__.items() if m.name == name]
ERROR_CODES = [m for m in CANONICAL if m != LLMStatusCode.LLM_SUCCESS]
UNKNOWN_CODES = [1, 2, -2, 12345, 0x5010B000, 0x5010B01D, 0x5010B0FF, 0x5010B100, 0x5010B102,
                 0xFFFFFFFE, 2**32, 2**40, -(2**31)]


# ---------------------------------------------------------------------------------------------
# the enum


def test_doc_table_is_self_consistent():
    for name, hexval, dec in DOC_TABLE:
        assert hexval == dec, name
    family = [v for _, v, _ in DOC_TABLE if 0x5010B000 < v < 0x5010C000]
    assert family == [0x5010B000 + n for n in range(1, 0x1C + 1)]


@pytest.mark.parametrize("name,value", list(DOC_CODES.items()))
def test_every_doc_code_has_its_exact_value(name, value):
    member = LLMStatusCode[name]
    assert member.name == name  # the Python spelling is the canonical one
    assert member == value
    assert int(member) == value
    assert LLMStatusCode(value) is member


def test_is_an_int_enum():
    assert issubclass(LLMStatusCode, int)
    assert LLMStatusCode.LLM_PARAM_INVALID == 0x5010B005
    assert LLMStatusCode.LLM_TIMEOUT == 0x5010B01A
    assert LLMStatusCode.LLM_SUCCESS == 0
    assert not LLMStatusCode.LLM_SUCCESS
    assert LLMStatusCode.LLM_FAILED


@pytest.mark.parametrize("code", CANONICAL, ids=lambda c: c.name)
def test_codes_print_by_name_and_compare_by_number(code):
    value = DOC_CODES.get(code.name, int(code))
    assert str(code) == code.name
    assert f"{code}" == code.name and format(code) == code.name and "%s" % code == code.name
    assert f"[{code:>40}]" == f"[{code.name:>40}]"       # string specs apply to the name
    assert f"{code:#x}" == f"{value:#x}" and f"{code:d}" == str(value)   # numeric ones to the number
    assert int(code) == value and code == value and hash(code) == hash(value)
    assert repr(code) == f"<LLMStatusCode.{code.name}: {value}>"


def test_aliases_and_messages_print_by_name():
    import kvengine as kv
    assert str(kv.LLMStatusCode.LLM_SUCCESS) == "LLM_SUCCESS"
    assert f"status {kv.LLMStatusCode.LLM_TIMEOUT}" == "status LLM_TIMEOUT"
    assert str(LLMStatusCode.LLM_WAIT_PROC_TIMEOUT) == "LLM_WAIT_PROCESS_TIMEOUT"   # the Python spelling
    assert str([LLMStatusCode.LLM_SUCCESS]) == "[<LLMStatusCode.LLM_SUCCESS: 0>]"   # containers use repr


@pytest.mark.parametrize("cpp,py", list(CPP_ALIASES.items()))
def test_cpp_alias_spellings(cpp, py):
    assert LLMStatusCode[cpp] is LLMStatusCode[py]
    assert getattr(LLMStatusCode, cpp) is LLMStatusCode[py]
    assert LLMStatusCode[cpp].name == py
    assert LLMStatusCode[cpp] == DOC_CODES[py]


def test_member_set_is_doc_table_plus_kvengine_extras():
    canonical = {m.name for m in CANONICAL}
    assert canonical == set(DOC_CODES) | KVENGINE_EXTRA
    aliases = {name for name, m in LLMStatusCode.__members__.items() if m.name != name}
    # An alias that is not a C++ spelling would mean two table rows share one value.
    assert aliases == set(CPP_ALIASES)


def test_status_table_rows_match_the_enum():
    names = [row[0] for row in status.STATUS_TABLE]
    values = [row[1] for row in status.STATUS_TABLE]
    assert len(set(names)) == len(names)
    assert len(set(values)) == len(values), "two codes share a value (the enum would alias them)"
    assert set(names) == {m.name for m in CANONICAL}
    for name, value, *_ in status.STATUS_TABLE:
        assert LLMStatusCode[name] == value


def test_enum_members_are_the_table_rows_in_order():
    """LLMStatusCode is written out member by member (for type checkers); it must be
    STATUS_TABLE exactly: the same names and values, in the same order, then the C++
    spellings as aliases and nothing else."""
    assert [(m.name, int(m)) for m in LLMStatusCode] == [(r[0], r[1]) for r in status.STATUS_TABLE]
    aliases = {name: m.name for name, m in LLMStatusCode.__members__.items() if m.name != name}
    assert aliases == status._CPP_ALIASES == CPP_ALIASES
    assert list(LLMStatusCode.__members__) == [r[0] for r in status.STATUS_TABLE] + list(CPP_ALIASES)


def test_enum_is_declared_statically():
    """Type checkers read the source: LLMStatusCode is a class statement whose body
    assigns every member (and alias) a literal, in the table's order."""
    tree = ast.parse((REPO / "kvengine" / "status.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMStatusCode"]
    assert [ast.unparse(b) for b in cls.bases] == ["_NamedIntEnum"]
    assigned = [(n.targets[0].id, ast.literal_eval(n.value)) for n in cls.body
                if isinstance(n, ast.Assign)]
    assert assigned == ([(r[0], r[1]) for r in status.STATUS_TABLE]
                        + [(alias, int(LLMStatusCode[py])) for alias, py in CPP_ALIASES.items()])


def test_kvengine_extras_do_not_collide_with_llm_datadist():
    for name in KVENGINE_EXTRA:
        value = int(LLMStatusCode[name])
        assert value not in DOC_CODES.values()
        # outside LLM-DataDist's used range 0x5010B001..0x5010B01C
        assert not 0x5010B000 <= value <= 0x5010B01C


# ---------------------------------------------------------------------------------------------
# one exception class per non-success code


def test_every_error_code_has_exactly_one_distinct_class():
    classes = [type(status.error_for(code)) for code in ERROR_CODES]
    assert len(set(classes)) == len(ERROR_CODES)
    for code, cls in zip(ERROR_CODES, classes):
        assert issubclass(cls, LLMError)
        assert cls is not LLMError
        assert cls.status is code
        # and no other class claims the same code
        assert [c for c in classes if c.status == code] == [cls]


def _declared_classes() -> dict[str, list[str]]:
    """The exception classes status.py declares in its source: name -> base names."""
    tree = ast.parse((REPO / "kvengine" / "status.py").read_text())
    return {node.name: [ast.unparse(b) for b in node.bases]
            for node in tree.body if isinstance(node, ast.ClassDef)}


@pytest.mark.parametrize("row", [r for r in status.STATUS_TABLE if r[2]], ids=lambda r: r[0])
def test_each_code_has_exactly_its_statically_declared_class(row):
    """Type checkers and IDEs read the source: every class is a `class X(LLMError[, Base])`
    statement, with the table's bases, and error_for gives that very class for the code."""
    name, value, cls_name, extra_base, meaning = row
    declared = _declared_classes()
    assert cls_name in declared, f"{cls_name} is not declared by a class statement"
    assert declared[cls_name] == ["LLMError"] + ([extra_base.__name__] if extra_base else [])
    cls = getattr(status, cls_name)
    assert cls.__bases__ == ((LLMError, extra_base) if extra_base else (LLMError,))
    assert cls.status is LLMStatusCode(value) is LLMStatusCode[name]
    assert type(status.error_for(value)) is cls
    assert meaning in cls.__doc__
    assert [c for c, bases in declared.items() if bases[:1] == ["LLMError"]
            and getattr(status, c).status == value] == [cls_name]


def test_declared_classes_are_exactly_the_table_rows():
    declared = {n for n, bases in _declared_classes().items() if bases and bases[0] == "LLMError"}
    assert declared == {row[2] for row in status.STATUS_TABLE if row[2]}
    assert set(status.__all__) == declared | {"LLMStatusCode", "LinkResult", "LLMError", "LINK_USABLE_AFTER"}


def test_package_all_is_the_public_surface():
    import kvengine as kv
    assert len(kv.__all__) == len(set(kv.__all__))
    for helper in ("STATUS_TABLE", "error_for", "raise_for", "status", "LayerRange"):
        assert helper not in kv.__all__
    assert not hasattr(kv, "error_for") and not hasattr(kv, "STATUS_TABLE")
    assert set(status.__all__) <= set(kv.__all__)   # the statuses and their exceptions
    for name in set(kv.__all__) - set(kv._NATIVE):   # (the native ones load the compiled core)
        assert getattr(kv, name) is not None, name
    assert {"KvEngine", "Transfer", "EngineOptions", "CacheDesc", "DataType", "LLMTimeoutError",
            "LINK_USABLE_AFTER"} <= set(kv.__all__)


@pytest.mark.parametrize("code", ERROR_CODES, ids=lambda c: c.name)
def test_error_class_attributes(code):
    exc = status.error_for(code, "boom")
    cls = type(exc)
    assert isinstance(exc, LLMError)
    assert isinstance(exc, Exception)
    assert exc.status is code
    assert exc.status_code is code  # LLM-DataDist's spelling
    assert isinstance(exc.status, LLMStatusCode)
    assert exc.message == "boom"
    assert str(exc) == f"{code.name}: boom"
    assert cls.__name__.startswith("LLM") and cls.__name__.endswith("Error")
    assert getattr(status, cls.__name__) is cls
    assert cls.__name__ in status.__all__
    # constructing the class directly gives the same status
    direct = cls("direct")
    assert direct.status is code and direct.status_code is code
    assert str(direct) == f"{code.name}: direct"


@pytest.mark.parametrize("code", ERROR_CODES, ids=lambda c: c.name)
def test_default_message_is_readable(code):
    exc = type(status.error_for(code))()
    assert exc.message  # a non-empty meaning from the table
    assert str(exc).startswith(code.name + ": ")
    assert len(str(exc)) > len(code.name) + 2
    assert str(status.error_for(code)) == str(exc)


@pytest.mark.parametrize("code_name,cls_name", list(NAMED_CLASSES.items()))
def test_public_class_names(code_name, cls_name):
    cls = getattr(status, cls_name)
    assert cls.status is LLMStatusCode[code_name]
    assert type(status.error_for(LLMStatusCode[code_name])) is cls


def test_timeout_classes_are_timeout_errors():
    assert issubclass(status.LLMTimeoutError, TimeoutError)
    assert issubclass(status.LLMWaitProcessTimeoutError, TimeoutError)
    with pytest.raises(TimeoutError):
        status.raise_for(LLMStatusCode.LLM_TIMEOUT)
    with pytest.raises(TimeoutError):
        status.raise_for(LLMStatusCode.LLM_WAIT_PROC_TIMEOUT)
    timeouts = {c for c in ERROR_CODES if isinstance(status.error_for(c), TimeoutError)}
    assert timeouts == {LLMStatusCode.LLM_TIMEOUT, LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT}


def test_no_status_is_a_memory_error():
    """MemoryError is Python's "the interpreter ran out of memory": code that catches it
    (to free caches, or to die) must not catch a full transfer queue (LLM_OUT_OF_MEMORY,
    EngineOptions.max_queued), a full block pool or device memory (docs/decisions.md 21)."""
    assert not issubclass(status.LLMOutOfMemoryError, MemoryError)
    assert not isinstance(status.error_for(LLMStatusCode.LLM_OUT_OF_MEMORY, "queue full"), MemoryError)
    assert [c for c in ERROR_CODES if isinstance(status.error_for(c), MemoryError)] == []
    with pytest.raises(status.LLMOutOfMemoryError):
        try:
            status.raise_for(LLMStatusCode.LLM_OUT_OF_MEMORY, "queue full")
        except MemoryError:   # pragma: no cover - the point of the test
            pytest.fail("LLMOutOfMemoryError was caught as a MemoryError")


def test_timeout_error_str_and_args():
    # TimeoutError is an OSError: its own __new__/__init__ must not mangle the message.
    exc = status.LLMTimeoutError("deadline of 1.0 s passed")
    assert str(exc) == "LLM_TIMEOUT: deadline of 1.0 s passed"
    assert exc.args == ("LLM_TIMEOUT: deadline of 1.0 s passed",)
    assert exc.message == "deadline of 1.0 s passed"


@pytest.mark.parametrize("row", status.STATUS_TABLE, ids=lambda r: r[0])
def test_extra_bases_from_the_table(row):
    name, value, cls_name, extra_base, _ = row
    if not cls_name:
        assert name == "LLM_SUCCESS"
        return
    cls = getattr(status, cls_name)
    if extra_base is not None:
        assert issubclass(cls, extra_base)
        with pytest.raises(extra_base):
            status.raise_for(value)


def test_llmerror_base_with_explicit_status():
    exc = LLMError("m", status=LLMStatusCode.LLM_LINK_BUSY)
    assert exc.status is LLMStatusCode.LLM_LINK_BUSY
    assert exc.status_code is LLMStatusCode.LLM_LINK_BUSY
    assert str(exc) == "LLM_LINK_BUSY: m"
    exc = LLMError("m", status=0x5010B005)
    assert exc.status is LLMStatusCode.LLM_PARAM_INVALID
    assert LLMError().status is LLMStatusCode.LLM_FAILED
    assert LLMError("x", status=0x5010B0FF).status is LLMStatusCode.LLM_FAILED


# ---------------------------------------------------------------------------------------------
# error_for / raise_for


def test_error_for_success_is_not_an_error():
    with pytest.raises(ValueError):
        status.error_for(LLMStatusCode.LLM_SUCCESS)
    with pytest.raises(ValueError):
        status.error_for(0)


@pytest.mark.parametrize("code", ERROR_CODES, ids=lambda c: c.name)
def test_error_for_returns_and_does_not_raise(code):
    exc = status.error_for(int(code), "why")
    assert exc.status is code
    assert exc.message == "why"
    assert exc.__traceback__ is None


@pytest.mark.parametrize("code", UNKNOWN_CODES)
def test_unknown_codes_map_to_llm_failed(code):
    exc = status.error_for(code, "native said so")
    assert type(exc) is status.LLMFailedError
    assert exc.status is LLMStatusCode.LLM_FAILED
    assert exc.message == "native said so"
    with pytest.raises(status.LLMFailedError) as info:
        status.raise_for(code, "again")
    assert info.value.status is LLMStatusCode.LLM_FAILED
    assert "again" in str(info.value)


def test_to_status_takes_integers_only():
    assert status.to_status(0x5010B009) is LLMStatusCode.LLM_LINK_FAILED
    assert status.to_status(LLMStatusCode.LLM_TIMEOUT) is LLMStatusCode.LLM_TIMEOUT
    for junk in (False, True, 0.0, float(0x5010B009), "0", None, [0], b"\0"):
        assert status.to_status(junk, LLMStatusCode.LLM_LINK_FAILED) is LLMStatusCode.LLM_LINK_FAILED, junk
    assert status.to_status(12345) is LLMStatusCode.LLM_FAILED


def test_raise_for_success_returns_the_enum():
    assert status.raise_for(0) is LLMStatusCode.LLM_SUCCESS
    assert status.raise_for(LLMStatusCode.LLM_SUCCESS) is LLMStatusCode.LLM_SUCCESS


@pytest.mark.parametrize("code", ERROR_CODES, ids=lambda c: c.name)
def test_raise_for_raises_the_class_of_the_code(code):
    cls = type(status.error_for(code))
    with pytest.raises(cls, match="^" + re.escape(f"{code.name}: msg {int(code)}") + "$") as info:
        status.raise_for(int(code), f"msg {int(code)}")
    assert info.value.status is code
    with pytest.raises(LLMError):
        status.raise_for(code)


def test_cpp_alias_values_raise_the_python_class():
    with pytest.raises(status.LLMWaitProcessTimeoutError):
        status.raise_for(LLMStatusCode.LLM_WAIT_PROC_TIMEOUT)
    with pytest.raises(status.LLMSeqLenOverLimitError):
        status.raise_for(LLMStatusCode.LLM_SEQ_LEN_OVER_LIMIT)


def test_link_usable_after():
    usable = status.LINK_USABLE_AFTER
    assert LLMStatusCode.LLM_SUCCESS in usable
    assert LLMStatusCode.LLM_TIMEOUT in usable  # kvengine: a fenced timeout keeps the link
    assert LLMStatusCode.LLM_CANCELLED in usable
    assert LLMStatusCode.LLM_LINK_FAILED not in usable  # the one status that takes a link down
    assert all(isinstance(s, LLMStatusCode) for s in usable)


# ---------------------------------------------------------------------------------------------
# pickling (exceptions cross process boundaries, e.g. in executors)


@pytest.mark.parametrize("code", ERROR_CODES, ids=lambda c: c.name)
@pytest.mark.parametrize("proto", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trip(code, proto):
    exc = status.error_for(code, f"reason {code.name}")
    back = pickle.loads(pickle.dumps(exc, protocol=proto))
    assert type(back) is type(exc)
    assert back.status is code
    assert back.status_code is code
    assert back.message == exc.message
    assert str(back) == str(exc)
    assert back.args == exc.args


@pytest.mark.parametrize("code", ERROR_CODES, ids=lambda c: c.name)
def test_pickle_default_message_and_copy(code):
    exc = type(status.error_for(code))()
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and back.message == exc.message and str(back) == str(exc)
    for dup in (copy.copy(exc), copy.deepcopy(exc)):
        assert type(dup) is type(exc) and dup.status is code and str(dup) == str(exc)


def test_pickle_base_llmerror_keeps_status():
    exc = LLMError("plain", status=LLMStatusCode.LLM_NOT_YET_LINK)
    back = pickle.loads(pickle.dumps(exc))
    assert isinstance(back, LLMError)
    assert back.status is LLMStatusCode.LLM_NOT_YET_LINK
    assert back.message == "plain"


def test_pickle_status_code_enum():
    for code in CANONICAL:
        assert pickle.loads(pickle.dumps(code)) is code


# ---------------------------------------------------------------------------------------------
# the C header mirrors the table

_DEFINE_RE = re.compile(r"^\s*#\s*define\s+KV_(\w+)\s+(0[xX][0-9A-Fa-f]+)[uU]?\s*(?:/\*.*\*/)?\s*$")


def _header_codes() -> dict[str, int]:
    codes: dict[str, int] = {}
    for line in KV_STATUS_H.read_text().splitlines():
        m = _DEFINE_RE.match(line)
        if m:
            assert m.group(1) not in codes, f"KV_{m.group(1)} defined twice"
            codes[m.group(1)] = int(m.group(2), 16)
        elif re.match(r"^\s*#\s*define\s+KV_LLM_", line):
            pytest.fail(f"kv_status.h: cannot parse {line!r}")
    return codes


def test_kv_status_header_matches_enum():
    codes = _header_codes()
    assert codes, "no #define KV_<NAME> 0x...u found in kv_status.h"
    for name, value in codes.items():
        assert name in LLMStatusCode.__members__, f"KV_{name} has no LLMStatusCode member"
        member = LLMStatusCode[name]
        # C values are uint32, so a negative code (LLM_UNKNOWN_ERROR = -1) cannot be mirrored
        assert value == int(member), (name, hex(value), hex(int(member)))
    # the codes the core is documented to produce are all there
    for needed in ("LLM_SUCCESS", "LLM_FAILED", "LLM_PARAM_INVALID", "LLM_TIMEOUT",
                   "LLM_KV_CACHE_NOT_EXIST", "LLM_LINK_FAILED", "LLM_CANCELLED"):
        assert needed in codes


def test_every_kv_llm_symbol_used_by_native_code_is_defined():
    defined = set(_header_codes())
    used: set[str] = set()
    for path in (REPO / "cython_src").rglob("*"):
        if path.suffix in (".c", ".h", ".pyx", ".pxd", ".pxi") and path != KV_STATUS_H:
            used |= set(re.findall(r"\bKV_(LLM_\w+)\b", path.read_text(errors="replace")))
    assert used <= defined, f"used but not defined in kv_status.h: {sorted(used - defined)}"


def test_pure_modules_import_without_the_native_core():
    """Statuses, types and the planner work without a build; KvEngine says how to build."""
    import subprocess
    import sys
    code = (
        "import sys; sys.modules['kvengine._native'] = None\n"
        "import kvengine as kv\n"
        "from kvengine import plan\n"
        "assert kv.LLMStatusCode.LLM_TIMEOUT == 0x5010B01A\n"
        "d = kv.CacheDesc(2, (4, 8), 'float16')\n"
        "assert plan.plan_cache(d, d, 0, 1, -1, None, op='push')\n"
        "try:\n"
        "    kv.KvEngine\n"
        "except ImportError as e:\n"
        "    assert 'pip install -e .' in str(e), e\n"
        "    print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------------------------------
# LinkResult: a per-cluster link/unlink result, equal to its status, with a reason

LinkResult = status.LinkResult


def test_link_result_is_its_status():
    S = LLMStatusCode
    r = LinkResult(S.LLM_LINK_FAILED, "connection refused")
    assert isinstance(r, int) and isinstance(r, LinkResult)
    assert r == S.LLM_LINK_FAILED and S.LLM_LINK_FAILED == r and r == 0x5010B009
    assert r != S.LLM_SUCCESS and r != S.LLM_TIMEOUT
    assert int(r) == 0x5010B009 and type(int(r)) is int
    assert hash(r) == hash(S.LLM_LINK_FAILED) == hash(0x5010B009)
    assert r.status is S.LLM_LINK_FAILED and r.name == "LLM_LINK_FAILED"
    assert r.reason == "connection refused"
    assert bool(r) and not LinkResult(S.LLM_SUCCESS)
    assert r in frozenset({S.LLM_LINK_FAILED}) and r in {S.LLM_LINK_FAILED: "x"}
    assert {r: "x"}[S.LLM_LINK_FAILED] == "x" and {S.LLM_LINK_FAILED: "y"}[r] == "y"
    assert r not in status.LINK_USABLE_AFTER and LinkResult(S.LLM_TIMEOUT) in status.LINK_USABLE_AFTER
    # two results of one status are equal whatever their reasons (they compare as statuses)
    assert r == LinkResult(S.LLM_LINK_FAILED, "another reason")


def test_link_results_compare_with_a_list_of_statuses():
    S = LLMStatusCode
    per = [LinkResult(S.LLM_SUCCESS), LinkResult(S.LLM_LINK_FAILED, "nobody listening"),
           LinkResult(S.LLM_TIMEOUT, "not linked within 3.0 s")]
    assert per == [S.LLM_SUCCESS, S.LLM_LINK_FAILED, S.LLM_TIMEOUT]
    assert [S.LLM_SUCCESS, S.LLM_LINK_FAILED, S.LLM_TIMEOUT] == per
    assert per != [S.LLM_SUCCESS, S.LLM_SUCCESS, S.LLM_TIMEOUT]
    assert per.count(S.LLM_LINK_FAILED) == 1 and per.index(S.LLM_TIMEOUT) == 2
    assert sorted(per) == sorted([S.LLM_SUCCESS, S.LLM_LINK_FAILED, S.LLM_TIMEOUT])


def test_link_result_reason_and_printing():
    S = LLMStatusCode
    ok = LinkResult(S.LLM_SUCCESS)
    assert ok.reason == "" and ok.status is S.LLM_SUCCESS and ok.name == "LLM_SUCCESS"
    assert repr(ok) == "<LinkResult LLM_SUCCESS>"
    r = LinkResult(S.LLM_LINK_FAILED, "connection refused")
    assert repr(r) == "<LinkResult LLM_LINK_FAILED: connection refused>"
    assert str(r) == "LLM_LINK_FAILED" and f"{r}" == "LLM_LINK_FAILED" and "%s" % r == "LLM_LINK_FAILED"
    assert f"[{r:>20}]" == f"[{'LLM_LINK_FAILED':>20}]"
    assert f"{r:#x}" == "0x5010b009" and f"{r:d}" == str(0x5010B009)
    assert str([r]) == "[<LinkResult LLM_LINK_FAILED: connection refused>]"
    with pytest.raises(AttributeError):
        r.reason = "changed"    # read-only, like the int it is
    with pytest.raises(TypeError):
        LinkResult(S.LLM_LINK_FAILED, None)


def test_link_result_from_ints():
    S = LLMStatusCode
    assert LinkResult(0x5010B009, "x").status is S.LLM_LINK_FAILED
    assert LinkResult(0).status is S.LLM_SUCCESS
    unknown = LinkResult(12345, "native said so")     # not a code: LLM_FAILED, as to_status
    assert unknown.status is S.LLM_FAILED and unknown == S.LLM_FAILED


@pytest.mark.parametrize("proto", range(pickle.HIGHEST_PROTOCOL + 1))
def test_link_result_pickle_and_copy(proto):
    r = LinkResult(LLMStatusCode.LLM_TIMEOUT, "not linked within 3.0 s")
    for back in (pickle.loads(pickle.dumps(r, protocol=proto)), copy.copy(r), copy.deepcopy(r)):
        assert type(back) is LinkResult
        assert back == r and back.status is LLMStatusCode.LLM_TIMEOUT
        assert back.reason == "not linked within 3.0 s" and repr(back) == repr(r)
        assert hash(back) == hash(LLMStatusCode.LLM_TIMEOUT)


def test_link_result_is_exported():
    import kvengine as kv
    assert kv.LinkResult is LinkResult
    assert "LinkResult" in kv.__all__ and "LinkResult" in status.__all__
