#!/bin/sh
# Build and run the native core's C tests by hand, the way tests/test_native_c.py
# does: tests/native/test_kv_core.c, or (--fuzz) the TCP receive-path fuzzer
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
# Environment: CC (default cc), OUT (binary path, default a temp dir).
# Test names: new_params regions submit_validation inline mover process_self
#   process_child abort done_flags remove_in_use close poll_small_max concurrent
#   pidfd mover_lease tcp_api accept_emfile seg2d_validation seg2d_copy seg2d_abort
#   large_copy tcp_2d tcp_small_pushes
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
"$cc" -std=c99 -D_GNU_SOURCE -Wall -Wextra -Werror -pthread $flags \
    -I"$csrc" "$here/$prog.c" "$csrc/kv_core.c" "$csrc/kv_tcp.c" -o "$OUT"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
"$OUT" "$@"
