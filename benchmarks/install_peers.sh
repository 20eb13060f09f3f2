#!/usr/bin/env bash
# Install the peer engines that `kvengine bench throughput|latency` puts beside
# kvengine, lean and CPU-only:
#
#   NIXL 1.5.1 (UCX backend)               nixl + nixl-cu12 wheels, --no-deps   ~223 MB installed
#   Mooncake Transfer Engine 0.3.13         mooncake-transfer-engine-non-cuda    ~141 MB + 18 MB deps
#                                           + Debian's libibverbs1 (apt)
#
# Usage:   benchmarks/install_peers.sh [PYTHON]     (default: .venv/bin/python, else python3)
#          SKIP_APT=1 benchmarks/install_peers.sh    (libibverbs1 already there, or no root)
#
# The lean alternative to `pip install kvengine[peers]` (which pins a CPU torch for NIXL): `pip install nixl`
# resolves nixl-cu12 AND nixl-cu13, whose metadata require an unpinned `torch`,
# which on Linux resolves to a CUDA build of torch with its nvidia-* wheels
# (~5.9 GB here), and an extra cannot say --no-deps. Mooncake's non-CUDA wheel
# has light dependencies, but it cannot import without libibverbs.so.1 (a system
# library pip cannot install), even when only its TCP transport is used.
# See docs/benchmarks.md, section "kvengine bench: throughput and latency beside NIXL and Mooncake".
set -euo pipefail

PY="${1:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
echo "installing the peers into: $("$PY" -c 'import sys; print(sys.prefix)')"

# 1. libibverbs1: Mooncake's extension links against it (it is not used for TCP)
if [ "${SKIP_APT:-0}" != "1" ] && ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    SUDO=""
    [ "$(id -u)" = "0" ] || SUDO="sudo"
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends libibverbs1
fi

# 2. NIXL, lean: its own wheels only (numpy first: nixl needs it, and --no-deps will not bring it)
"$PY" -m pip install "numpy>=1.24"
"$PY" -m pip install --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"

# 3. Mooncake Transfer Engine, the build without CUDA (deps: aiohttp, requests, msgpack)
"$PY" -m pip install "mooncake-transfer-engine-non-cuda"

# 4. check: both import (kvengine bench imports them only in its worker processes)
"$PY" - <<'EOF'
import importlib, importlib.metadata as md, sys
bad = False
for name, mod, dist in (("NIXL", "nixl._api", "nixl-cu12"), ("Mooncake", "mooncake.engine", "mooncake-transfer-engine-non-cuda")):
    try:
        importlib.import_module(mod)
        print(f"{name}: {dist} {md.version(dist)} imports")
    except Exception as e:
        bad = True
        print(f"{name}: does NOT import: {type(e).__name__}: {e}")
sys.exit(1 if bad else 0)
EOF
