"""The compiled core (``kvengine._native``), with a clear error when it is not built."""

try:
    from . import _native
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "kvengine's native extension is not built: run `pip install -e .` in the source tree "
        f"(or `pip install kvengine`) ({e})") from e

__all__ = ["_native"]
