"""Status codes and the exception for each: defined once, here.

Values are LLM-DataDist's own (``ge::Status``, family base ``0x5010B000``), so
numbers logged by kvengine read the same as numbers logged by LLM-DataDist.
``LLM_CANCELLED`` is kvengine's one addition (a fenced cancellation has no
LLM-DataDist code); it sits above the LLM-DataDist range.

The C core mirrors the codes it produces in ``cython_src/csrc/kv_status.h``;
``tests/test_status.py`` checks that header against this table.
"""

from __future__ import annotations

import enum
import numbers
from typing import Callable, Iterable, Self

__all__ = [
    "LLMStatusCode",
    "LinkResult",
    "LLMError",
    "LINK_USABLE_AFTER",
    "LLMFailedError",
    "LLMWaitProcessTimeoutError",
    "LLMKvCacheNotExistError",
    "LLMRepeatRequestError",
    "LLMRequestAlreadyCompletedError",
    "LLMParamInvalidError",
    "LLMEngineFinalizedError",
    "LLMNotYetLinkError",
    "LLMAlreadyLinkError",
    "LLMLinkFailedError",
    "LLMUnlinkFailedError",
    "LLMNotifyPromptUnlinkFailedError",
    "LLMClusterNumExceedLimitError",
    "LLMProcessingLinkError",
    "LLMDeviceOutOfMemoryError",
    "LLMPrefixAlreadyExistError",
    "LLMPrefixNotExistError",
    "LLMSeqLenOverLimitError",
    "LLMNoFreeBlockError",
    "LLMBlocksOutOfMemoryError",
    "LLMCacheIncompatibleError",
    "LLMCacheKeyAlreadyExistError",
    "LLMCopyCacheFailedError",
    "LLMCacheIdAlreadyExistError",
    "LLMExistLinkError",
    "LLMFeatureNotEnabledError",
    "LLMTimeoutError",
    "LLMLinkBusyError",
    "LLMOutOfMemoryError",
    "LLMDeviceMemError",
    "LLMSuspectRemoteError",
    "LLMUnknownError",
    "LLMCancelledError",
]
# Also used inside kvengine, not re-exported by the package: STATUS_TABLE, error_for, raise_for.

# One row per code: (Python name, value, exception class name, extra base, meaning).
# The single source of truth: the enum below spells its rows out member for member, and
# each exception class declared below gets its status and docstring from its row
# (_bind_classes checks at import that the enum and the classes agree with the table,
# member for member and class for class).
STATUS_TABLE: tuple[tuple[str, int, str, type[Exception] | None, str], ...] = (
    ("LLM_SUCCESS", 0x0, "", None, "success"),
    ("LLM_FAILED", 0xFFFFFFFF, "LLMFailedError", None, "generic failure"),
    ("LLM_WAIT_PROCESS_TIMEOUT", 0x5010B001, "LLMWaitProcessTimeoutError", TimeoutError,
     "processing timed out"),
    ("LLM_KV_CACHE_NOT_EXIST", 0x5010B002, "LLMKvCacheNotExistError", None,
     "cache id unknown locally or on the peer, or already unregistered"),
    ("LLM_REPEAT_REQUEST", 0x5010B003, "LLMRepeatRequestError", None, "duplicate request"),
    ("LLM_REQUEST_ALREADY_COMPLETED", 0x5010B004, "LLMRequestAlreadyCompletedError", None,
     "request already completed"),
    ("LLM_PARAM_INVALID", 0x5010B005, "LLMParamInvalidError", ValueError, "invalid argument"),
    ("LLM_ENGINE_FINALIZED", 0x5010B006, "LLMEngineFinalizedError", None,
     "the engine is closed"),
    ("LLM_NOT_YET_LINK", 0x5010B007, "LLMNotYetLinkError", None,
     "no link to that cluster"),
    ("LLM_ALREADY_LINK", 0x5010B008, "LLMAlreadyLinkError", None,
     "a link to that cluster already exists"),
    ("LLM_LINK_FAILED", 0x5010B009, "LLMLinkFailedError", ConnectionError,
     "link setup failed or the link was lost"),
    ("LLM_UNLINK_FAILED", 0x5010B00A, "LLMUnlinkFailedError", None, "unlink failed"),
    ("LLM_NOTIFY_PROMPT_UNLINK_FAILED", 0x5010B00B, "LLMNotifyPromptUnlinkFailedError", None,
     "the peer could not be told about the unlink"),
    ("LLM_CLUSTER_NUM_EXCEED_LIMIT", 0x5010B00C, "LLMClusterNumExceedLimitError", None,
     "too many clusters in one call"),
    ("LLM_PROCESSING_LINK", 0x5010B00D, "LLMProcessingLinkError", None,
     "another link or unlink of that cluster is in progress"),
    ("LLM_DEVICE_OUT_OF_MEMORY", 0x5010B00E, "LLMDeviceOutOfMemoryError", None,
     "device out of memory"),
    ("LLM_PREFIX_ALREADY_EXIST", 0x5010B00F, "LLMPrefixAlreadyExistError", None,
     "prefix already exists"),
    ("LLM_PREFIX_NOT_EXIST", 0x5010B010, "LLMPrefixNotExistError", None, "prefix does not exist"),
    ("LLM_SEQ_LENOVERLIMIT", 0x5010B011, "LLMSeqLenOverLimitError", None,
     "sequence length over limit"),
    ("LLM_NO_FREE_BLOCK", 0x5010B012, "LLMNoFreeBlockError", None, "no free block"),
    ("LLM_BLOCKS_OUT_OF_MEMORY", 0x5010B013, "LLMBlocksOutOfMemoryError", None,
     "blocks out of memory"),
    ("LLM_CACHE_INCOMPATIBLE", 0x5010B014, "LLMCacheIncompatibleError", None,
     "cache incompatible"),
    ("LLM_CACHE_KEY_ALREADY_EXIST", 0x5010B015, "LLMCacheKeyAlreadyExistError", None,
     "cache key already exists"),
    ("LLM_COPY_CACHE_FAILED", 0x5010B016, "LLMCopyCacheFailedError", None, "copy cache failed"),
    ("LLM_CACHE_ID_ALREADY_EXIST", 0x5010B017, "LLMCacheIdAlreadyExistError", None,
     "cache id already exists"),
    ("LLM_EXIST_LINK", 0x5010B018, "LLMExistLinkError", None, "links still exist"),
    ("LLM_FEATURE_NOT_ENABLED", 0x5010B019, "LLMFeatureNotEnabledError", None,
     "feature not enabled"),
    ("LLM_TIMEOUT", 0x5010B01A, "LLMTimeoutError", TimeoutError, "deadline passed"),
    ("LLM_LINK_BUSY", 0x5010B01B, "LLMLinkBusyError", None, "link busy"),
    ("LLM_OUT_OF_MEMORY", 0x5010B01C, "LLMOutOfMemoryError", None, "out of memory"),
    ("LLM_DEVICE_MEM_ERROR", 507053, "LLMDeviceMemError", None, "device memory error"),
    ("LLM_SUSPECT_REMOTE_ERROR", 507057, "LLMSuspectRemoteError", None, "suspect remote error"),
    ("LLM_UNKNOWN_ERROR", -1, "LLMUnknownError", None, "unknown error"),
    # kvengine extension: a transfer cancelled by its caller, after the fence.
    ("LLM_CANCELLED", 0x5010B101, "LLMCancelledError", None, "cancelled by the caller"),
)

# C++ spellings that differ from the Python ones (enum aliases).
_CPP_ALIASES: dict[str, str] = {
    "LLM_WAIT_PROC_TIMEOUT": "LLM_WAIT_PROCESS_TIMEOUT",
    "LLM_SEQ_LEN_OVER_LIMIT": "LLM_SEQ_LENOVERLIMIT",
}


class _NamedIntEnum(enum.IntEnum):
    """An IntEnum that prints by name: ``str()`` and ``format()`` give the member's name
    (Python 3.11's IntEnum gives the number); ``int()``, ``==`` and numeric format specs
    (``f"{code:#x}"``, ``f"{code:d}"``) still give the number; ``repr()`` shows both."""

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        try:
            return format(self.name, spec)
        except ValueError:   # a numeric spec: "d", "#x", "08b", ...
            return int.__format__(self, spec)


class LLMStatusCode(_NamedIntEnum):
    """LLM-DataDist status codes (``ge::Status`` values).

    Written out member by member so that type checkers and IDEs see them; the order and
    values are STATUS_TABLE's, then the C++ spellings (_CPP_ALIASES) as aliases. The
    import fails if the two disagree (_bind_classes), and tests/test_status.py checks it.
    """
    LLM_SUCCESS = 0x0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = 0x5010B001
    LLM_KV_CACHE_NOT_EXIST = 0x5010B002
    LLM_REPEAT_REQUEST = 0x5010B003
    LLM_REQUEST_ALREADY_COMPLETED = 0x5010B004
    LLM_PARAM_INVALID = 0x5010B005
    LLM_ENGINE_FINALIZED = 0x5010B006
    LLM_NOT_YET_LINK = 0x5010B007
    LLM_ALREADY_LINK = 0x5010B008
    LLM_LINK_FAILED = 0x5010B009
    LLM_UNLINK_FAILED = 0x5010B00A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00C
    LLM_PROCESSING_LINK = 0x5010B00D
    LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00E
    LLM_PREFIX_ALREADY_EXIST = 0x5010B00F
    LLM_PREFIX_NOT_EXIST = 0x5010B010
    LLM_SEQ_LENOVERLIMIT = 0x5010B011
    LLM_NO_FREE_BLOCK = 0x5010B012
    LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013
    LLM_CACHE_INCOMPATIBLE = 0x5010B014
    LLM_CACHE_KEY_ALREADY_EXIST = 0x5010B015
    LLM_COPY_CACHE_FAILED = 0x5010B016
    LLM_CACHE_ID_ALREADY_EXIST = 0x5010B017
    LLM_EXIST_LINK = 0x5010B018
    LLM_FEATURE_NOT_ENABLED = 0x5010B019
    LLM_TIMEOUT = 0x5010B01A
    LLM_LINK_BUSY = 0x5010B01B
    LLM_OUT_OF_MEMORY = 0x5010B01C
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1
    LLM_CANCELLED = 0x5010B101
    # C++ spellings (aliases: same value, the Python name above is the canonical one)
    LLM_WAIT_PROC_TIMEOUT = 0x5010B001
    LLM_SEQ_LEN_OVER_LIMIT = 0x5010B011

# Statuses after which the link is still usable (kvengine's rule; LLM-DataDist
# tells users to relink after a timeout, kvengine's fenced abort avoids that).
LINK_USABLE_AFTER = frozenset({
    LLMStatusCode.LLM_SUCCESS,
    LLMStatusCode.LLM_PARAM_INVALID,
    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    LLMStatusCode.LLM_TIMEOUT,
    LLMStatusCode.LLM_CANCELLED,
    LLMStatusCode.LLM_OUT_OF_MEMORY,   # queue full
    LLMStatusCode.LLM_FAILED,          # an unexpected native error on one transfer
})


class LinkResult(int):
    """One cluster's result of ``link_clusters`` / ``unlink_clusters``: its status, and
    why it failed.

    An ``int`` equal to the status code (``==``, ``hash``, ``int()``, ``bool()`` are the
    status's: a list of results compares equal to a list of statuses), so code written
    for bare LLMStatusCode results keeps working. ``status`` is the
    :class:`LLMStatusCode`, ``name`` its name, ``reason`` the failure's explanation
    (``""`` on success). ``str()`` and ``format()`` give the name, as for statuses.
    A number that is not a known code reads as ``LLM_FAILED`` (:func:`to_status`).
    """

    _status: LLMStatusCode
    _reason: str

    def __new__(cls, status: LLMStatusCode | int, reason: str = "") -> Self:
        if not isinstance(reason, str):
            raise TypeError(f"LinkResult reason must be a str, got {type(reason).__name__}")
        st = to_status(status)
        self = super().__new__(cls, st)
        self._status = st
        self._reason = reason
        return self

    @property
    def status(self) -> LLMStatusCode:
        return self._status

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def name(self) -> str:
        return self._status.name

    def __repr__(self) -> str:
        if self._reason:
            return f"<LinkResult {self._status.name}: {self._reason}>"
        return f"<LinkResult {self._status.name}>"

    def __str__(self) -> str:
        return self._status.name

    def __format__(self, spec: str) -> str:
        return format(self._status, spec)

    def __reduce__(self) -> tuple[type[LinkResult], tuple[LLMStatusCode, str]]:
        return (LinkResult, (self._status, self._reason))


class LLMError(Exception):
    """A kvengine call failed with an LLM-DataDist status.

    ``status`` (also ``status_code``, LLM-DataDist's spelling) is the
    :class:`LLMStatusCode`; ``str(exc)`` names the code and the reason.
    """

    status: LLMStatusCode = LLMStatusCode.LLM_FAILED

    def __init__(self, message: str = "", status: int | None = None) -> None:
        if status is not None:
            self.status = _to_status(status)
        self.message = message or _MEANING[self.status]
        super().__init__(f"{self.status.name}: {self.message}")

    @property
    def status_code(self) -> LLMStatusCode:
        return self.status

    def __reduce__(self) -> tuple[Callable[[int, str], LLMError], tuple[LLMStatusCode, str]]:
        return (error_for, (self.status, self.message))


# One class per non-success code, declared statically so IDEs and type checkers see
# them. Each takes its ``status`` and docstring from its STATUS_TABLE row
# (_bind_classes); the extra base (TimeoutError, ValueError, ...) must be the row's.
# No class is a MemoryError: Python's MemoryError means the interpreter's own heap ran
# out, while these codes report a full queue or pool, or device memory (docs/decisions.md 21).

class LLMFailedError(LLMError): ...
class LLMWaitProcessTimeoutError(LLMError, TimeoutError): ...
class LLMKvCacheNotExistError(LLMError): ...
class LLMRepeatRequestError(LLMError): ...
class LLMRequestAlreadyCompletedError(LLMError): ...
class LLMParamInvalidError(LLMError, ValueError): ...
class LLMEngineFinalizedError(LLMError): ...
class LLMNotYetLinkError(LLMError): ...
class LLMAlreadyLinkError(LLMError): ...
class LLMLinkFailedError(LLMError, ConnectionError): ...
class LLMUnlinkFailedError(LLMError): ...
class LLMNotifyPromptUnlinkFailedError(LLMError): ...
class LLMClusterNumExceedLimitError(LLMError): ...
class LLMProcessingLinkError(LLMError): ...
class LLMDeviceOutOfMemoryError(LLMError): ...
class LLMPrefixAlreadyExistError(LLMError): ...
class LLMPrefixNotExistError(LLMError): ...
class LLMSeqLenOverLimitError(LLMError): ...
class LLMNoFreeBlockError(LLMError): ...
class LLMBlocksOutOfMemoryError(LLMError): ...
class LLMCacheIncompatibleError(LLMError): ...
class LLMCacheKeyAlreadyExistError(LLMError): ...
class LLMCopyCacheFailedError(LLMError): ...
class LLMCacheIdAlreadyExistError(LLMError): ...
class LLMExistLinkError(LLMError): ...
class LLMFeatureNotEnabledError(LLMError): ...
class LLMTimeoutError(LLMError, TimeoutError): ...
class LLMLinkBusyError(LLMError): ...
class LLMOutOfMemoryError(LLMError): ...
class LLMDeviceMemError(LLMError): ...
class LLMSuspectRemoteError(LLMError): ...
class LLMUnknownError(LLMError): ...
class LLMCancelledError(LLMError): ...


_MEANING: dict[LLMStatusCode, str] = {}
_CLASS_BY_STATUS: dict[LLMStatusCode, type[LLMError]] = {}


def _bind_classes() -> None:
    """Give each declared class its row's status and docstring; fail the import if the
    declarations and STATUS_TABLE disagree (a missing, extra or misbased class, or an
    LLMStatusCode member that is not the table's, in the table's order)."""
    members = [(m.name, m.value) for m in LLMStatusCode]
    rows = [(name, value) for name, value, *_ in STATUS_TABLE]
    if members != rows:
        raise RuntimeError(f"LLMStatusCode and STATUS_TABLE differ: {sorted(set(members) ^ set(rows))}")
    aliases = {alias: m.name for alias, m in LLMStatusCode.__members__.items() if alias != m.name}
    if aliases != _CPP_ALIASES:
        raise RuntimeError(f"LLMStatusCode's aliases are not _CPP_ALIASES: {aliases}")
    declared = {name: obj for name, obj in globals().items()
                if isinstance(obj, type) and issubclass(obj, LLMError) and obj is not LLMError}
    bound: set[str] = set()
    for name, value, cls_name, extra_base, meaning in STATUS_TABLE:
        status = LLMStatusCode(value)
        _MEANING[status] = meaning
        if not cls_name:
            continue
        cls = declared.get(cls_name)
        if cls is None or cls_name in bound:
            raise RuntimeError(f"{name}: class {cls_name} not declared in status.py, or named twice")
        expected = (LLMError, extra_base) if extra_base else (LLMError,)
        if cls.__bases__ != expected:
            raise RuntimeError(f"{cls_name} must derive from {expected}, not {cls.__bases__}")
        cls.status = status
        cls.__doc__ = f"{name} ({value:#x}): {meaning}."
        _CLASS_BY_STATUS[status] = cls
        bound.add(cls_name)
    if set(declared) != bound:
        raise RuntimeError(f"exception classes without a STATUS_TABLE row: {sorted(set(declared) - bound)}")
    listed = set(__all__) - {"LLMStatusCode", "LinkResult", "LLMError", "LINK_USABLE_AFTER"}
    if listed != bound:
        raise RuntimeError(f"__all__ and the exception classes differ: {sorted(listed ^ bound)}")


_bind_classes()


def to_status(code: object, default: LLMStatusCode = LLMStatusCode.LLM_FAILED) -> LLMStatusCode:
    """The one conversion of a number (native, or from a peer's message) to a status:
    ``default`` for anything that is not a known code. LLM-DataDist's Python layer maps
    any unknown native code to LLM_FAILED, the default. Only integers are codes (a bool,
    float or string from a peer is not: ``false`` must not read as LLM_SUCCESS)."""
    if isinstance(code, numbers.Integral) and not isinstance(code, bool):
        try:
            return LLMStatusCode(int(code))
        except ValueError:
            pass
    return default


_to_status = to_status


def error_for(status: int, message: str = "") -> LLMError:
    """The exception instance for a non-success ``status``."""
    st = _to_status(status)
    if st == LLMStatusCode.LLM_SUCCESS:
        raise ValueError("LLM_SUCCESS is not an error")
    return _CLASS_BY_STATUS[st](message)


def raise_for(status: int, message: str = "") -> LLMStatusCode:
    """Return ``LLM_SUCCESS`` or raise the exception for ``status``."""
    if status == 0:
        return LLMStatusCode.LLM_SUCCESS
    raise error_for(status, message)


def overall(results: Iterable[int]) -> LLMStatusCode:
    """The first failure among per-cluster results, else ``LLM_SUCCESS``."""
    for r in results:
        if r != LLMStatusCode.LLM_SUCCESS:
            return LLMStatusCode(int(r))
    return LLMStatusCode.LLM_SUCCESS
