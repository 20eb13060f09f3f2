"""Builds and runs tests/native/test_kv_core.c, the standalone C test of the
native core (cython_src/csrc/kv_core.c), no Python involved in what it tests:

* under AddressSanitizer + UndefinedBehaviorSanitizer (leak checking on), and
* without sanitizers at -O2, several runs (optimisation-dependent races);

and tests/native/fuzz_tcp.c, which feeds random and mutated frames through the
TCP data plane's real receive path (cython_src/csrc/kv_tcp.c) under ASan + UBSan,
with a fixed seed (KV_FUZZ_SEED=N or =random, KV_FUZZ_ITERS override; printed).

A missing C compiler is a failure, not a skip: these tests are the only
memory-safety check of the core. tests/native/run_asan.sh does the same by hand.
"""

import os
import random
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "cython_src" / "csrc"
TEST_C = ROOT / "tests" / "native" / "test_kv_core.c"
FUZZ_C = ROOT / "tests" / "native" / "fuzz_tcp.c"

COMMON = ["-std=c99", "-D_GNU_SOURCE", "-DKV_TEST_HOOKS", "-Wall", "-Wextra", "-Werror", "-pthread"]
SANITIZE = ["-g", "-O1", "-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
OPTIMISE = ["-O2"]
SAN_ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
}
BUILD_TIMEOUT = 180
RUN_TIMEOUT = 120  # the program has its own 90 s watchdog; a normal run takes ~1-2 s


def _tail(text, n=60):
    return "\n".join(text.splitlines()[-n:])


def _compiler():
    """`cc`, or $CC (which may carry a launcher, e.g. "ccache gcc")."""
    cc = shlex.split(os.environ.get("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        pytest.fail(f"C compiler {' '.join(cc)!r} not found on PATH: the native core's "
                    "sanitizer tests cannot run. Install a C toolchain "
                    "(e.g. apt-get install gcc) or set CC.", pytrace=False)
    return cc


def _build(tmp_path, name, flags, src=TEST_C):
    exe = tmp_path / name
    cmd = [*_compiler(), *COMMON, *flags, f"-I{CSRC}", str(src), str(CSRC / "kv_core.c"), str(CSRC / "kv_tcp.c"),
           "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    assert r.returncode == 0, f"build failed: {' '.join(cmd)}\n{_tail(r.stderr)}"
    return exe


def _run(exe, extra_env=None, args=(), what=""):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # the ASan runtime must come first
    env.update(extra_env or {})
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=RUN_TIMEOUT,
                       env=env, cwd=ROOT)
    out = r.stdout + r.stderr
    what = f" ({what})" if what else ""
    assert r.returncode == 0, f"{exe.name}{what} exited with {r.returncode}:\n{_tail(out)}"
    assert "0 failed" in r.stdout, f"no summary line from {exe.name}{what}:\n{_tail(out)}"
    return r.stdout


def test_kv_core_asan_ubsan(tmp_path):
    exe = _build(tmp_path, "test_kv_core_asan", SANITIZE)
    out = _run(exe, SAN_ENV)
    assert " passed, 0 failed" in out


def test_kv_core_optimised(tmp_path):
    exe = _build(tmp_path, "test_kv_core_o2", OPTIMISE)
    for _ in range(3):  # cheap (~1 s each); races show up more often over several runs
        _run(exe)


def test_tcp_fuzz_asan_ubsan(tmp_path):
    """Random and mutated frames through the real TCP receive path, under ASan +
    UBSan: canaries intact, exported bytes exactly as the receiver's checks
    allow, counters and events exact, no access to a job's memory after its
    completion, the lease (no write without one, none after it ran out; an
    unfenced push completes at the release, not before), answers naming a job
    before its first frame refused, the idle bound, the core still serving at
    the end, leak-free close (~7 s)."""
    exe = _build(tmp_path, "fuzz_tcp_asan", SANITIZE, FUZZ_C)
    # A fixed seed by default, so CI is reproducible; KV_FUZZ_SEED=random explores.
    seed = os.environ.get("KV_FUZZ_SEED", "20261130")
    if seed == "random":
        seed = str(random.SystemRandom().getrandbits(63))
    iters = os.environ.get("KV_FUZZ_ITERS", "2000")
    what = (f"seed {seed}; rerun: KV_FUZZ_SEED={seed} KV_FUZZ_ITERS={iters}, "
            f"or tests/native/run_asan.sh --fuzz {iters} {seed}")
    out = _run(exe, SAN_ENV, args=[iters, seed], what=what)
    assert f"seed {seed}," in out
    assert " passed, 0 failed" in out, what
