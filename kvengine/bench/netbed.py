"""A multi-host test bed in network namespaces (docs/reliability.md).

One namespace holds a bridge (the "switch"); each host is a namespace with one
veth port into it and the address 10.213.0.<i+1>/24. Every namespace, and every
address used, is one the bed created: nothing is sent to an address outside
them, and nothing is added to the root namespace (veth pairs are created in the
bridge namespace with their other end directly in the host's).

- ``cut(i)`` sets host i's switch port down (no RST: neither side hears anything),
  ``heal(i)`` sets it up again;
- ``shape(i, rate)`` puts a tbf qdisc on both directions of host i's link;
- ``spawn(i, ...)`` starts an engine in host i as a separate process
  (kvengine/bench/agent.py, a kvengine._peer server with a few more ops).

Cleanup: ``close()`` kills every process the bed started (by pid) and deletes its
namespaces. Names carry a prefix and the pytest process's pid, so ``sweep()``
deletes what a crashed earlier run (whose pid is gone) left behind; ``atexit``
and the fixtures' finalizers call ``close()``.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

from kvengine._peer import PeerProcess, fill_pattern

PREFIX = "kvct"                      # every namespace of the bed: kvct<pid>n<k>-br / -h<i>
SUBNET = "10.213.0"                  # inside the bed's namespaces only
# the directory kvengine is imported from: the agents in the namespaces import the same code
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_seq = itertools.count()
_open: set["NetBed"] = set()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


def can_create_namespaces() -> str | None:
    """None if this process can build the bed, else why not (the tests skip with it)."""
    name = f"{PREFIX}{os.getpid()}probe"
    try:
        r = _ip("netns", "add", name, check=False)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    if r.returncode != 0:
        return f"cannot create a network namespace (CAP_NET_ADMIN?): {r.stderr.strip()}"
    _ip("netns", "delete", name, check=False)
    try:
        _run(["tc", "-V"])
    except (FileNotFoundError, subprocess.CalledProcessError):
        return "the `tc` command (iproute2) is not installed"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ns_kill_and_delete(ns: str) -> None:
    """Kill the processes left in ``ns`` (ours: the bed started them), then delete it."""
    r = _ip("netns", "pids", ns, check=False)
    for line in r.stdout.split():
        try:
            pid = int(line)
        except ValueError:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "delete", ns, check=False)


def sweep() -> list[str]:
    """Delete the namespaces of earlier runs of the bed whose pytest process is gone."""
    r = _ip("netns", "list", check=False)
    gone = []
    for line in r.stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if not ns.startswith(PREFIX):
            continue
        digits = ""
        for ch in ns[len(PREFIX):]:
            if not ch.isdigit():
                break
            digits += ch
        if digits and int(digits) != os.getpid() and _pid_alive(int(digits)):
            continue   # another live run's
        if digits and int(digits) == os.getpid() and any(ns.startswith(b.tag) for b in _open):
            continue   # ours, still open
        _ns_kill_and_delete(ns)
        gone.append(ns)
    return gone


class Agent(PeerProcess):
    """A PeerProcess (JSON lines) running kvengine.bench.agent in a host namespace."""

    host: int
    cluster_id: int


class NetBed:
    """``hosts`` namespaces on one bridge; see the module docstring."""

    def __init__(self, hosts: int) -> None:
        self.tag = f"{PREFIX}{os.getpid()}n{next(_seq)}"
        self.bridge = f"{self.tag}-br"
        self.hosts = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.agents: list[Agent] = []
        self._pids: set[int] = set()
        self._made: list[str] = []
        self.closed = False

    # ------------------------------------------------------------------ topology

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def port(self, i: int) -> str:
        """Host i's port on the switch (in the bridge namespace)."""
        return f"vb{i}"

    def setup(self) -> "NetBed":
        _open.add(self)
        try:
            for ns in (self.bridge, *self.hosts):
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            for i, ns in enumerate(self.hosts):
                _ip("-n", self.bridge, "link", "add", self.port(i), "type", "veth",
                    "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.bridge, "link", "set", self.port(i), "master", "br0")
                _ip("-n", self.bridge, "link", "set", self.port(i), "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def cut(self, i: int) -> None:
        """Host i's switch port goes down: its packets are dropped, nobody gets an RST."""
        _ip("-n", self.bridge, "link", "set", self.port(i), "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.bridge, "link", "set", self.port(i), "up")

    def shape(self, i: int, rate: str = "1gbit", burst: str = "256kb", latency: str = "100ms") -> None:
        """A tbf qdisc on both directions of host i's link (to it: the switch port's
        egress; from it: its eth0's egress)."""
        for ns, dev in ((self.bridge, self.port(i)), (self.hosts[i], "eth0")):
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                  "tbf", "rate", rate, "burst", burst, "latency", latency])

    def unshape(self, i: int) -> None:
        for ns, dev in ((self.bridge, self.port(i)), (self.hosts[i], "eth0")):
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)

    # ------------------------------------------------------------------ engines

    async def spawn(self, host: int, cluster_id: int, *, role: str = "DECODER", secret: bytes | None = None,
                    transport: str = "auto", options: dict[str, Any] | None = None, timeout: float = 30.0) -> Agent:
        """Start an engine (cluster ``cluster_id``) in host ``host``, listening on its address."""
        argv = ["ip", "netns", "exec", self.hosts[host], sys.executable, "-m", "kvengine.bench.agent",
                "--cluster-id", str(cluster_id), "--listen", f"{self.addr(host)}:0",
                "--transport", transport, "--role", role]
        if options:
            argv += ["--options", json.dumps(options)]
        if secret:
            argv += ["--secret", secret.decode()]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        if env.get("UCX_NET_DEVICES") == "lo":   # the tests' and benches' default for one host; in a
            env["UCX_NET_DEVICES"] = "eth0"      # host of the bed, its link to the others (its lo reaches
                                                 # itself only, and a peer's 127.0.0.1 is not the peer)
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, env=env, cwd=ROOT)
        self._pids.add(proc.pid)   # `ip netns exec` execs: this is the agent's pid
        try:
            assert proc.stdout is not None   # stdout=PIPE
            line = await asyncio.wait_for(proc.stdout.readline(), timeout)
            hello = json.loads(line)
        except BaseException:
            self._kill(proc.pid)
            await proc.wait()
            raise
        agent = Agent(proc, hello["address"], hello["pid"])
        agent.host, agent.cluster_id = host, cluster_id
        self._pids.add(agent.pid)
        self.agents.append(agent)
        return agent

    @staticmethod
    def _kill(pid: int) -> None:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return

    async def aclose(self, timeout: float = 10.0) -> None:
        """Close the agents gracefully (kill what does not exit in time), then the bed."""
        async def one(a: Agent) -> None:
            if a.proc.returncode is None:
                try:
                    os.kill(a.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            try:
                await asyncio.wait_for(a.close(timeout=timeout / 2), timeout)
            except (asyncio.TimeoutError, OSError):
                a.kill()
                await a.proc.wait()
        await asyncio.gather(*(one(a) for a in self.agents), return_exceptions=True)
        self.close()

    def close(self) -> None:
        """Kill every process the bed started, delete its namespaces (idempotent, sync:
        safe from a finalizer, atexit, or after a KeyboardInterrupt)."""
        if self.closed:
            return
        self.closed = True
        for pid in self._pids:
            self._kill(pid)
        for ns in reversed(self._made):
            _ns_kill_and_delete(ns)
        end = time.monotonic() + 5
        while any(ns in _ip("netns", "list", check=False).stdout for ns in self._made) and time.monotonic() < end:
            time.sleep(0.05)
        _open.discard(self)


@atexit.register
def _close_all() -> None:
    for bed in list(_open):
        bed.close()


# ------------------------------------------------------------------ /proc of a process

def proc_usage(pid: int) -> dict[str, Any]:
    """Open fds, threads and current RSS (kB) of a process, from /proc."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = len(os.listdir(f"/proc/{pid}/task"))
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"fds": fds, "threads": threads, "rss_kb": rss}


# ------------------------------------------------------------------ another process's memory

class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
_libc.process_vm_readv.restype = ctypes.c_ssize_t


def read_remote(pid: int, addrs: list[int], size: int) -> list[np.ndarray]:
    """Copy ``size`` bytes at each address of process ``pid`` (also while it is stopped;
    the namespaces are network namespaces only, the pid namespace is ours)."""
    out = []
    for a in addrs:
        buf = np.empty(size, np.uint8)
        done = 0
        while done < size:
            n = min(size - done, 1 << 30)
            local, remote = _IoVec(buf.ctypes.data + done, n), _IoVec(a + done, n)
            got = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if got <= 0:
                err = ctypes.get_errno()
                raise OSError(err, f"process_vm_readv({pid}, {a + done:#x}): {os.strerror(err)}")
            done += got
        out.append(buf)
    return out


async def remote_view(agent: PeerProcess, cache_id: int) -> Callable[[], list[np.ndarray[Any, Any]]]:
    """A function that reads the agent's cache ``cache_id`` now: one uint8 array per tensor."""
    info = await agent.call("addrs", cache_id=cache_id)
    addrs, size = info["addrs"], info["size"]
    return lambda: read_remote(agent.pid, addrs, size)


def pattern(n: int, size: int, seed: int) -> list[np.ndarray]:
    """What the agents' ``fill`` (kvengine._peer.fill_pattern) puts into a cache of n tensors."""
    out = []
    for i in range(n):
        t = np.empty(size, np.uint8)
        fill_pattern(t, seed, i)
        out.append(t)
    return out


def changed(a: list[np.ndarray], b: list[np.ndarray]) -> int:
    return sum(int(np.count_nonzero(x != y)) for x, y in zip(a, b))


def rows_state(now: list[np.ndarray], before: list[np.ndarray], after: list[np.ndarray], rows: int) -> list[str]:
    """Per dim-0 row: "old" (all of ``before``), "new" (all of ``after``), "mixed" (each
    byte one of the two: a transfer cut short), or "garbage" (a byte that is neither)."""
    out = []
    for r in range(rows):
        olds = news = True
        for x, b, a in zip(now, before, after):
            step = x.size // rows
            xs, bs, as_ = x[r * step:(r + 1) * step], b[r * step:(r + 1) * step], a[r * step:(r + 1) * step]
            eq_b, eq_a = xs == bs, xs == as_
            if not np.all(eq_b | eq_a):
                out.append("garbage")
                break
            olds &= bool(np.all(eq_b))
            news &= bool(np.all(eq_a))
        else:
            out.append("old" if olds else "new" if news else "mixed")
    return out


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


# ------------------------------------------------------------------ the options and bounds of the tests

SECRET = b"cluster-bed-secret"     # engines on different hosts link only with a secret
HB = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0, "link_timeout": 2.0}
HBI, HBT = HB["heartbeat_interval"], HB["heartbeat_timeout"]
SLACK = 1.0                        # scheduling slack on a shared 2-vCPU machine
# A silent peer (partition, SIGSTOP) is lost within HBT + HBI of the fault (docs/api.md, "Bounds");
# a push that had frames on the wire completes at its lease release, by then already passed.
SILENT_BOUND = HBT + HBI + SLACK
