"""Builds the one extension, kvengine._native. Metadata lives in pyproject.toml.

cython_src/_native.pyx includes cython_src/_fast.pxi (the loop thread's fast path and
the accounting's counters: one extension, so it calls the C core directly; cythonize
rebuilds when either changes).

KVENGINE_DEBUG=1 builds -O0 -g; KVENGINE_SANITIZE=1 adds ASan/UBSan.

The UCX transport (cython_src/csrc/kv_ucx.c, ``transport="ucx"``) is built when
UCX's headers and libraries are found: ``$UCX_HOME`` (include/, lib/), else the
``libucx`` wheel installed in the interpreter that builds (``pip install libucx-cu12``
before ``pip install kvengine``: pip installs an extra's packages after it built
kvengine, so ``kvengine[ucx]`` alone is not enough the first time), else pkg-config
``ucx``. ``KVENGINE_UCX=0`` builds without it;
``KVENGINE_UCX=1`` fails the build when it is not found.
"""
import os
import shutil
import subprocess
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

cflags = ["-std=c99", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Wno-unused-parameter",
          "-Wno-unused-function", "-Wno-sign-compare"]
ldflags = ["-pthread"]
if os.environ.get("KVENGINE_DEBUG"):
    cflags += ["-O0", "-g", "-UNDEBUG"]
else:
    cflags += ["-O2"]
if os.environ.get("KVENGINE_SANITIZE"):
    cflags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    ldflags += ["-fsanitize=address,undefined"]



def find_ucx() -> tuple[str, str] | None:
    """(include dir, lib dir) of a UCX with ucp/api/ucp.h and libucp.so, or None."""
    def ok(inc: str, lib: str) -> bool:
        return os.path.isfile(os.path.join(inc, "ucp", "api", "ucp.h")) and any(
            os.path.exists(os.path.join(lib, n)) for n in ("libucp.so", "libucp.so.0"))
    home = os.environ.get("UCX_HOME")
    if home and ok(os.path.join(home, "include"), os.path.join(home, "lib")):
        return os.path.join(home, "include"), os.path.join(home, "lib")
    # the RAPIDS wheel (libucx-cu12): headers and libraries in its package dir, as the
    # interpreter that will run kvengine sees it. pip builds in an isolated environment
    # (PYTHONPATH to its build env, PYTHONNOUSERSITE) that hides the target environment's
    # packages from this interpreter: look with the environment as given, then without
    # those two, so a libucx-cu12 installed before `pip install kvengine` is found
    plain = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    for env in (None, plain):
        try:
            out = subprocess.run([sys.executable, "-c", "import libucx, os; print(os.path.dirname(libucx.__file__))"],
                                 capture_output=True, text=True, timeout=60, env=env)
        except (OSError, subprocess.SubprocessError):
            continue
        d = out.stdout.strip()
        if out.returncode == 0 and d and ok(os.path.join(d, "include"), os.path.join(d, "lib")):
            return os.path.join(d, "include"), os.path.join(d, "lib")
    if shutil.which("pkg-config"):
        try:
            inc = subprocess.run(["pkg-config", "--variable=includedir", "ucx"], capture_output=True, text=True).stdout.strip()
            lib = subprocess.run(["pkg-config", "--variable=libdir", "ucx"], capture_output=True, text=True).stdout.strip()
            if inc and lib and ok(inc, lib):
                return inc, lib
        except OSError:
            pass
    return None


include_dirs = ["cython_src", "cython_src/csrc"]
libs: list[str] = []
library_dirs: list[str] = []
want_ucx = os.environ.get("KVENGINE_UCX", "auto")
ucx = find_ucx() if want_ucx != "0" else None
if want_ucx == "1" and ucx is None:
    sys.exit("KVENGINE_UCX=1 but no UCX found: pip install libucx-cu12, or set UCX_HOME")
if ucx is not None:
    cflags.append("-DKV_HAVE_UCX")
    include_dirs.append(ucx[0])
    library_dirs.append(ucx[1])
    libs += ["ucp", "ucs"]
    # kvengine/native.py loads the wheel's libraries (libucx.load_library()) before the
    # extension; the rpath finds them where they were at build time otherwise.
    ldflags.append(f"-Wl,-rpath,{ucx[1]}")
    print(f"kvengine: building the UCX transport ({ucx[1]})")
else:
    print("kvengine: building without UCX (transport='ucx' will answer LLM_FEATURE_NOT_ENABLED)")

ext = Extension(
    "kvengine._native",
    sources=["cython_src/_native.pyx", "cython_src/csrc/kv_core.c", "cython_src/csrc/kv_tcp.c",
             "cython_src/csrc/kv_ucx.c"],
    include_dirs=include_dirs,
    libraries=libs,
    library_dirs=library_dirs,
    extra_compile_args=cflags,
    extra_link_args=ldflags,
)

setup(ext_modules=cythonize([ext], build_dir="build/cython",
                            compiler_directives={"language_level": 3, "embedsignature": True}))
