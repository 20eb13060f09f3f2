#!/bin/sh
# Build and run the native core's C tests by hand, the way tests/test_native_c.py
# does: tests/native/test_kv_core.c, then tests/native/test_kv_ucx.c (the UCX
# target's header checks; with UCX found also a two-core loopback over UCX, as
# tests/test_native_ucx.py does), or (--fuzz) the TCP receive-path fuzzer
# tests/native/fuzz_tcp.c.
#
# Usage:
#   tests/native/run_asan.sh                  # ASan + UBSan build, all tests
#   tests/native/run_asan.sh abort close      # only the named tests
#   tests/native/run_asan.sh --plain [tests]  # no sanitizers, -O2
#   tests/native/run_asan.sh --tsan [tests]   # ThreadSanitizer (diagnostic only: the
#                                             #  "concurrent" test's overlapping
#                                             #  destination writes are reported by design)
#   tests/native/run_asan.sh --fuzz [iterations [seed]]
#                                             # the fuzzer, ASan + UBSan (default 2000
#                                             #  iterations, a fresh seed; it prints the
#                                             #  seed: pass it back to replay a run)
#   tests/native/run_asan.sh --fuzz --plain [iterations [seed]]   # the fuzzer at -O2
#
# Environment: CC (default cc), OUT (binary path, default a temp dir), UCX_HOME
# (include/, lib/) or PYTHON (default python3; its libucx wheel) to find UCX,
# UCX_TLS for the loopback (default tcp).
# Test names: new_params regions submit_validation inline mover process_self
#   process_child abort done_flags remove_in_use close poll_small_max concurrent
#   pidfd mover_lease tcp_api accept_emfile seg2d_validation seg2d_copy seg2d_abort seg2d_pair
#   large_copy tcp_2d tcp_close_fence reap lease_busy wait_take
# Exit status is the test program's: 0 and "N passed, 0 failed" on success.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
csrc="$root/cython_src/csrc"
cc=${CC:-cc}

mode=asan
prog=test_kv_core
if [ "${1:-}" = --fuzz ]; then
    prog=fuzz_tcp
    shift
fi
case "${1:-}" in
--plain) mode=plain; shift ;;
--tsan) mode=tsan; shift ;;
esac

case $mode in
asan) flags="-g -O1 -fsanitize=address,undefined -fno-omit-frame-pointer" ;;
tsan) flags="-g -O1 -fsanitize=thread" ;;
plain) flags="-O2" ;;
esac

if [ -z "${OUT:-}" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    OUT="$tmp/$prog"
fi

# shellcheck disable=SC2086  # $flags is a word list
"$cc" -std=c99 -D_GNU_SOURCE -DKV_TEST_HOOKS -Wall -Wextra -Werror -pthread $flags \
    -I"$csrc" "$here/$prog.c" "$csrc/kv_core.c" "$csrc/kv_tcp.c" -o "$OUT"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
"$OUT" "$@"

# the UCX transport's checks (only with the default test set: no names, no --fuzz)
if [ "$prog" = test_kv_core ] && [ $# -eq 0 ]; then
    ucx_inc= ucx_lib=
    if [ -n "${UCX_HOME:-}" ] && [ -f "$UCX_HOME/include/ucp/api/ucp.h" ]; then
        ucx_inc=$UCX_HOME/include ucx_lib=$UCX_HOME/lib
    else
        d=$("${PYTHON:-python3}" -c 'import libucx, os; print(os.path.dirname(libucx.__file__))' 2>/dev/null || true)
        if [ -n "$d" ] && [ -f "$d/include/ucp/api/ucp.h" ]; then
            ucx_inc=$d/include ucx_lib=$d/lib
        fi
    fi
    set --
    if [ -n "$ucx_inc" ]; then
        set -- -DKV_HAVE_UCX -isystem "$ucx_inc" -L"$ucx_lib" -Wl,-rpath,"$ucx_lib" -lucp -lucs
    else
        echo "test_kv_ucx: UCX not found (UCX_HOME, or PYTHON with libucx): the check tests only"
    fi
    # shellcheck disable=SC2086
    "$cc" -std=c99 -D_GNU_SOURCE -DKV_TEST_HOOKS -Wall -Wextra -Werror -pthread $flags -I"$csrc" "$here/test_kv_ucx.c" \
        "$csrc/kv_core.c" "$csrc/kv_tcp.c" "$csrc/kv_ucx.c" "$@" -o "$OUT.ucx"
    UCX_TLS=${UCX_TLS:-tcp} "$OUT.ucx"
    # the close fence alone, UCX's registration-cache entries of abandoned receives
    # suppressed (lsan_ucx_close.supp says why)
    LSAN_OPTIONS=suppressions=$here/lsan_ucx_close.supp UCX_TLS=${UCX_TLS:-tcp} "$OUT.ucx" close_fence
fi
