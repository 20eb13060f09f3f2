"""The compiled core (``kvengine._native``), with a clear error when it is not built.

A build with the UCX transport links libucp; when the ``libucx`` wheel is installed
(``pip install "kvengine[ucx]"``) its libraries are loaded first, so the extension
finds them wherever the wheel lives."""


import os

# UCX logs to stdout by default; stdout belongs to the application (kvengine's own peer
# processes speak JSON there). Its log goes to stderr unless UCX_LOG_FILE says otherwise.
# Read once, when libucs loads: so before the libraries below.
os.environ.setdefault("UCX_LOG_FILE", "/dev/stderr")

try:   # the RAPIDS wheel's own loader: dlopen(RTLD_LOCAL) its libucs/libuct/libucp
    import libucx  # type: ignore[import-not-found, unused-ignore]
    libucx.load_library()
except (ImportError, OSError):   # pragma: no cover - depends on what is installed
    pass

try:
    from . import _native
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "kvengine's native extension is not built: run `pip install -e .` in the source tree "
        f"(or `pip install kvengine`) ({e})") from e

__all__ = ["_native"]
