"""The UCX columns of ``kvengine bench throughput|latency --transport ucx``: UCXX (the
Python UCX binding) as a peer pair like NIXL's, and ``ucx_perftest`` (UCX's own
tool, shipped in the libucx wheel) as the floor.

- UCXX (``ucxx-cu12``, core API ``ucxx._lib.libucxx``): UCXX's Python API has no
  one-sided put, so its column is what a Python program on UCXX does: the
  initiator ``tag_send``s each segment (tag = its index), the target has
  ``tag_recv``s posted into the destination offsets and answers with an 8-byte
  tag message once all landed (remote completion, like kvengine's and NIXL's).
  Both processes drive progress by polling ``worker.progress()`` (no progress
  thread: it spins on the second vCPU). Endpoints from worker addresses
  exchanged over the pipe. Found in this environment, or in the directory
  ``$KVENGINE_UCXX_PATH`` (``pip install --target DIR ucxx-cu12``: installing it into
  kvengine's environment would replace libucx-cu12 1.22 by the 1.21 it pins).
- ``ucx_perftest -t ucp_put_bw`` (throughput: one-sided puts of the whole size)
  and ``-t ucp_put_lat`` (ping-pong of one put; reported as half the round trip),
  server and client processes on 127.0.0.1, the same ``UCX_TLS``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from .peers import NIXL, Msg, PeerError, PeerPair, _segs, _Side

UCXX, PERFTEST = "UCXX", "ucx_perftest"
UCX_ENGINES = (NIXL, UCXX)
ACK_TAG = 1 << 40
# UCX_TLS presets of --ucx-tls (anything else passes through as written)
TLS_PRESETS = {"tcp": "tcp", "sm": "sm,self", "cma": "cma,tcp,self"}


def ucxx_path() -> str | None:
    """Where ucxx is importable from: None = this environment, else $KVENGINE_UCXX_PATH."""
    return os.environ.get("KVENGINE_UCXX_PATH") or None


def ucxx_found() -> tuple[bool, str]:
    path = ucxx_path()
    if path:
        ok = os.path.isdir(os.path.join(path, "ucxx"))
        return ok, "" if ok else f"no ucxx in $KVENGINE_UCXX_PATH={path}"
    try:
        ok = importlib.util.find_spec("ucxx") is not None
    except (ImportError, ValueError):
        ok = False
    return ok, "" if ok else ("not installed (pip install --target DIR ucxx-cu12; "
                              "KVENGINE_UCXX_PATH=DIR)")


class UcxxSide(_Side[list[Any]]):
    """One side of the UCXX pair (a worker process); plans are lists of UCXX Arrays."""

    def __init__(self, role: str, size: int, seed: int) -> None:
        super().__init__(UCXX, role, size, seed)
        path = ucxx_path()
        if path and path not in sys.path:
            sys.path.insert(0, path)
        self.u: Any = importlib.import_module("ucxx._lib.libucxx")
        self.Array: Any = importlib.import_module("ucxx._lib.arr").Array
        self.ctx = self.u.UCXContext(feature_flags=(self.u.Feature.TAG,))
        self.worker = self.u.UCXWorker(self.ctx)
        self.ep: Any = None
        import numpy as np
        self.ack = self.Array(np.zeros(1, np.uint64))
        self.expect: tuple[list[Any], int] = ([], 0)     # target: (plans to receive, count)

    def info(self) -> Msg:
        return {"addr": self.addr, "ucx": bytes(self.worker.address.tobytes())}

    def op_connect(self, m: Msg) -> Msg:
        address = self.u.UCXAddress.create_from_buffer(m["ucx"])
        self.ep = self.u.UCXEndpoint.create_from_worker_address(self.worker, address,
                                                                endpoint_error_handling=False)
        self.raddr = m["addr"]
        return {}

    def op_prepare(self, m: Msg) -> Msg:
        """Initiator: Arrays over the source segments; target: over the destination ones."""
        for key, segs in m["plans"]:
            so, do, ln = _segs(segs)
            offs = so if self.role == "initiator" else do
            self.plans[tuple(key) if isinstance(key, list) else key] = \
                [self.Array(self.buf[o:o + n]) for o, n in zip(offs, ln)]
        return {}

    def op_expect(self, m: Msg) -> Msg:
        keys = m["key"] if isinstance(m["key"], list) else [m["key"]]
        self.expect = ([self.plans[tuple(k) if isinstance(k, list) else k] for k in keys], m["n"])
        return {}

    def _wait(self, reqs: list[Any], stop: Callable[[], bool] = lambda: False) -> bool:
        progress = self.worker.progress
        while not all(r.completed for r in reqs):
            progress()
            if stop():
                return False
        for r in reqs:
            r.check_error()
        return True

    def _one(self, p: list[Any]) -> None:
        tag = self.u.UCXXTag
        reqs = [self.ep.tag_recv(self.ack, tag=tag(ACK_TAG))]
        reqs += [self.ep.tag_send(a, tag=tag(i)) for i, a in enumerate(p)]
        self._wait(reqs)

    def serve_poll(self, conn: Connection) -> None:
        """Target: receive the expected transfers (ack each), then wait for the next message."""
        tag, ready = self.u.UCXXTag, conn.poll
        plans, n = self.expect
        self.expect = ([], 0)
        for i in range(n):
            p = plans[i % len(plans)]
            if not self._wait([self.ep.tag_recv(a, tag=tag(k)) for k, a in enumerate(p)], lambda: ready(0)):
                return
            self._wait([self.ep.tag_send(self.ack, tag=tag(ACK_TAG))])
        conn.poll(None)


class UcxxPair(PeerPair):
    """The UCXX target and initiator: both ends know each other (the target acks)."""

    def __init__(self, size: int, log_path: str | None = None, timeout: float = 120.0) -> None:
        super().__init__(UCXX, size, "ucx", log_path, timeout=timeout)
        try:
            self.target.call("connect", **self.initiator.info)
        except BaseException:
            self.close()
            raise

    def prepare(self, plans: Any) -> None:
        super().prepare(plans)
        self.target.call("prepare", plans=[[k, [list(s) for s in segs]] for k, segs in plans])

    def run(self, key: Any, n: int, total: Any = False, timeout: float | None = None) -> Any:
        self.target.call("expect", key=key, n=n)
        return super().run(key, n, total, timeout)


def start_ucx_peers(names: list[str], size: int, log_path: str | None,
                    say: Callable[[str], object] = print) -> tuple[dict[str, PeerPair], dict[str, str]]:
    """NIXL and UCXX pairs over the UCX_TLS of this environment: ({name: pair}, {name: why not})."""
    from .peers import available
    pairs: dict[str, PeerPair] = {}
    missing: dict[str, str] = {}
    if log_path:
        open(log_path, "w").close()
    for name in names:
        ok, why = available()[NIXL] if name == NIXL else ucxx_found()
        if not ok:
            missing[name] = why or "not installed"
            say(f"  {name}: {missing[name]}; its column is left out")
            continue
        try:
            pairs[name] = PeerPair(NIXL, size, "ucx", log_path) if name == NIXL else UcxxPair(size, log_path)
        except PeerError as e:
            missing[name] = f"failed to start: {e}"
            say(f"  {name}: failed to start ({e}); its column is left out (log: {log_path})")
    return pairs, missing


# ---------------------------------------------------------------- ucx_perftest

def perftest_binary() -> tuple[str | None, str]:
    """(path of ucx_perftest from the libucx wheel, why not)."""
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None, "no libucx wheel"
    root = list(spec.submodule_search_locations)[0]
    exe = os.path.join(root, "bin", "ucx_perftest")
    return (exe, "") if os.access(exe, os.X_OK) else (None, f"no {exe}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def perftest(test: str, nbytes: int, iters: int, timeout: float = 120.0, tries: int = 3) -> dict[str, float]:
    """One ucx_perftest server + client on 127.0.0.1 (this environment's UCX_TLS):
    ``{"p50_us", "avg_us", "MBps"}`` of its "Final" line (MB = 2**20 B, UCX's unit).
    A pair that fails to meet (the server exits) is started again, ``tries`` times."""
    for k in range(tries):
        try:
            return _perftest(test, nbytes, iters, timeout)
        except PeerError:
            if k == tries - 1:
                raise
    raise AssertionError("unreachable")


def _perftest(test: str, nbytes: int, iters: int, timeout: float) -> dict[str, float]:
    exe, why = perftest_binary()
    if exe is None:
        raise PeerError(why)
    lib = os.path.join(os.path.dirname(os.path.dirname(exe)), "lib")
    env = dict(os.environ, LD_LIBRARY_PATH=lib + (":" + os.environ["LD_LIBRARY_PATH"]
                                                  if os.environ.get("LD_LIBRARY_PATH") else ""))
    args = ["-t", test, "-s", str(nbytes), "-n", str(iters), "-p", str(_free_port())]
    server = subprocess.Popen([exe] + args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out = ""
        end = time.monotonic() + timeout
        while time.monotonic() < end:   # the server listens a moment after it starts
            c = subprocess.run([exe, "127.0.0.1"] + args, env=env, capture_output=True, text=True,
                               timeout=timeout)
            out = c.stdout + c.stderr
            if "Final:" in out or server.poll() is not None:
                break
            time.sleep(0.1)
        m = re.search(r"Final:\s+\d+\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+([\d.]+)", out)
        if m is None:
            raise PeerError(f"ucx_perftest {test}: no result ({out.strip()[-200:]!r})")
        return {"p50_us": float(m.group(1)), "avg_us": float(m.group(2)), "MBps": float(m.group(3))}
    finally:
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
