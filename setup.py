"""Builds the one extension, kvengine._native. Metadata lives in pyproject.toml.

KVENGINE_DEBUG=1 builds -O0 -g; KVENGINE_SANITIZE=1 adds ASan/UBSan.
"""
import os

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

ext = Extension(
    "kvengine._native",
    sources=["cython_src/_native.pyx", "cython_src/csrc/kv_core.c", "cython_src/csrc/kv_tcp.c"],
    include_dirs=["cython_src", "cython_src/csrc"],
    extra_compile_args=cflags,
    extra_link_args=ldflags,
)

setup(ext_modules=cythonize([ext], build_dir="build/cython",
                            compiler_directives={"language_level": 3, "embedsignature": True}))
