"""The peer engines, optional: NIXL (UCX backend) and Mooncake Transfer Engine (TCP).

Each runs as two spawned processes, a target that owns the destination buffer
and an initiator that owns the source buffer and WRITEs into the target, both
on 127.0.0.1, both driven from the benchmark over a pipe. Their libraries are
imported only in those processes (UCX patches memory hooks in the processes
that load it; kvengine's side never loads it). Their logs go to a file.

Install them with ``pip install -e ".[peers]"`` or ``benchmarks/install_peers.sh`` (see docs/benchmarks.md);
when a module is missing the benchmark shows "not installed" and runs the rest.

How each one is driven (PEERS_HOWTO of this project: measured on these CPU-only VMs):

- NIXL 1.5.1: ``nixl_agent(name, nixl_agent_config(enable_prog_thread=False,
  backends=["UCX"]))`` on both sides (the progress thread spins on both vCPUs and
  halves bandwidth here), DRAM registered once, ``initialize_xfer("WRITE", ...)``
  once per transfer shape with one descriptor per tensor (per segment of a block
  table in ``--layout paged``), then per transfer
  ``transfer(h)`` and ``check_xfer_state(h)`` polled until DONE (the handle is
  re-posted). The target must keep calling ``get_new_notifs()`` while the
  initiator transfers (UCX progress: without it the first transfer never
  completes, and over UCX's TCP transport the target's progress moves the bytes);
  it does so in a loop with ``sched_yield()`` only while NIXL is being measured,
  and sleeps in a blocking pipe read otherwise. (Polling with 1 ms sleeps cost
  1.1 ms per 64 KiB over TCP; a pure spin without yielding gave ~1 GB/s over TCP
  on 2 vCPUs; spin + yield was the best for both CMA and TCP.) Same host: UCX's
  default transports (process_vm_writev); the ``tcp`` run sets ``UCX_TLS=tcp``.
- Mooncake TE 0.3.13 (``mooncake-transfer-engine-non-cuda``):
  ``initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")``, ``register_memory``,
  ``batch_transfer_sync_write(peer, srcs, dsts, lens)`` with one entry per tensor
  (per segment of a block table, at most 128 entries a call)
  (``transfer_sync_write`` for one). Its TCP write completes once the initiator has
  written the bytes to its socket (the target sends no acknowledgement), which
  flatters its latency compared with kvengine's and NIXL's remote completion.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable, Generic, Hashable, Literal, TypeVar, overload

if TYPE_CHECKING:
    import numpy as np
    from nixl._api import nixl_xfer_handle
    from numpy.typing import NDArray

# A message over a worker's pipe (pickled): an op and its arguments, or a reply.
Msg = dict[str, Any]
# A transfer a worker prepared (_Side.plans): the engine's own handle.
_Plan = TypeVar("_Plan")
# Mooncake's: (source addresses, destination addresses, lengths), one entry per tensor
MooncakePlan = tuple[list[int], list[int], list[int]]

NIXL, MOONCAKE = "NIXL", "Mooncake"
_MC_BATCH = 128    # entries per Mooncake batch: longer ones overflow its TCP lane queue (0.3.13: -1)
ENGINES = (NIXL, MOONCAKE)
INSTALL_HINT = "pip install -e '.[peers]' or benchmarks/install_peers.sh (see docs/benchmarks.md)"


def available() -> dict[str, tuple[bool, str]]:
    """{engine: (module found, why not)} without importing them here."""
    out: dict[str, tuple[bool, str]] = {}
    for name, mod in ((NIXL, "nixl"), (MOONCAKE, "mooncake")):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        out[name] = (found, "" if found else f"no module {mod!r}")
    return out


# ---------------------------------------------------------------- worker side (spawned processes)

def _digest(buf: NDArray[np.uint8], n: int) -> str:
    return hashlib.blake2b(buf.data[:n], digest_size=16).hexdigest()


def _segs(segs: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
    """A plan's segments, [offset, length] (the same offset both sides) or [src offset,
    dst offset, length] each: (src offsets, dst offsets, lengths)."""
    so = [s[0] for s in segs]
    return so, [s[1] for s in segs] if segs and len(segs[0]) == 3 else so, [s[-1] for s in segs]


class _Side(Generic[_Plan]):
    """One side of one engine in a worker process: a registered buffer of ``size`` bytes."""

    def __init__(self, engine: str, role: str, size: int, seed: int) -> None:
        import numpy as np
        self.engine, self.role, self.size = engine, role, size
        self.buf = np.zeros(size, np.uint8)            # pre-faulted
        if role == "initiator":
            from kvengine._peer import fill_pattern
            fill_pattern(self.buf, seed, 0)
        self.addr: int = self.buf.ctypes.data
        self.plans: dict[Hashable, _Plan] = {}   # by key: a str, or a tuple (sent as a list)
        self.raddr = 0                           # the target's buffer (op_connect)

    def info(self) -> Msg:
        return {"addr": self.addr}

    def _one(self, p: _Plan) -> None:
        """Run one prepared transfer to completion."""
        raise NotImplementedError

    def serve_poll(self, conn: Connection) -> None:
        """Target: let the engine make progress until the next message arrives."""
        raise NotImplementedError

    def op_zero(self, m: Msg) -> Msg:
        self.buf[:m["n"]] = 0
        return {}

    def op_digest(self, m: Msg) -> Msg:
        if "ranges" in m:   # [[offset, length], ...]: one digest of those bytes in that order
            h = hashlib.blake2b(digest_size=16)
            for o, n in m["ranges"]:
                h.update(self.buf.data[o:o + n])
            return {"digest": h.hexdigest()}
        return {"digest": _digest(self.buf, m["n"])}

    def op_run(self, m: Msg) -> Msg:
        """m: key (a prepared transfer or a list of them, cycled), n transfers; the seconds of each."""
        keys = m["key"] if isinstance(m["key"], list) else [m["key"]]
        plans = [self.plans[tuple(k) if isinstance(k, list) else k] for k in keys]
        one, clock = self._one, time.perf_counter
        out: list[float] = []
        for i in range(m["n"]):
            p = plans[i % len(plans)]
            t0 = clock()
            one(p)
            out.append(clock() - t0)
        if m.get("total"):
            return {"seconds": sum(out)}
        return {"seconds": out}


class _NixlSide(_Side["nixl_xfer_handle"]):
    def __init__(self, role: str, size: int, seed: int) -> None:
        super().__init__(NIXL, role, size, seed)
        from nixl._api import nixl_agent, nixl_agent_config
        self.agent = nixl_agent(f"kvbench-{role}-{os.getpid()}",
                                nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.agent.register_memory([(self.addr, size, 0, "")], "DRAM")
        self.remote = ""   # the target agent's name (op_connect)

    def info(self) -> Msg:
        return {"addr": self.addr, "md": self.agent.get_agent_metadata()}

    def op_connect(self, m: Msg) -> Msg:
        self.remote = self.agent.add_remote_agent(m["md"])
        self.raddr = m["addr"]
        return {}

    def op_prepare(self, m: Msg) -> Msg:
        """m: plans [[key, segs], ...]: one WRITE handle each (see _segs)."""
        for key, segs in m["plans"]:
            so, do, ln = _segs(segs)
            local = self.agent.get_xfer_descs([(self.addr + o, n, 0) for o, n in zip(so, ln)], "DRAM")
            remote = self.agent.get_xfer_descs([(self.raddr + o, n, 0) for o, n in zip(do, ln)], "DRAM")
            self.plans[tuple(key) if isinstance(key, list) else key] = \
                self.agent.initialize_xfer("WRITE", local, remote, self.remote)
        return {}

    def _one(self, h: nixl_xfer_handle) -> None:
        a = self.agent
        st = a.transfer(h)
        while st == "PROC":
            st = a.check_xfer_state(h)
        if st != "DONE":
            raise RuntimeError(f"NIXL transfer state {st}")

    def serve_poll(self, conn: Connection) -> None:
        """Target: drive UCX progress until the next message arrives."""
        get, ready, yld = self.agent.get_new_notifs, conn.poll, os.sched_yield
        while not ready(0):
            get()
            yld()


class _MooncakeSide(_Side[MooncakePlan]):
    def __init__(self, role: str, size: int, seed: int) -> None:
        super().__init__(MOONCAKE, role, size, seed)
        from mooncake.engine import TransferEngine
        self.te = TransferEngine()
        rc = self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake initialize returned {rc}")
        rc = self.te.register_memory(self.addr, size)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory returned {rc}")

    def info(self) -> Msg:
        return {"addr": self.addr, "port": self.te.get_rpc_port()}

    def op_connect(self, m: Msg) -> Msg:
        self.remote = f"127.0.0.1:{m['port']}"
        self.raddr = m["addr"]
        return {}

    def op_prepare(self, m: Msg) -> Msg:
        for key, segs in m["plans"]:
            so, do, ln = _segs(segs)
            self.plans[tuple(key) if isinstance(key, list) else key] = (
                [self.addr + o for o in so], [self.raddr + o for o in do], ln)
        return {}

    def _one(self, p: MooncakePlan) -> None:
        srcs, dsts, lens = p
        if len(srcs) == 1:
            rc = self.te.transfer_sync_write(self.remote, srcs[0], dsts[0], lens[0])
        else:   # a long list (paged tables) in batches of at most _MC_BATCH entries
            for i in range(0, len(srcs), _MC_BATCH):
                rc = self.te.batch_transfer_sync_write(self.remote, srcs[i:i + _MC_BATCH], dsts[i:i + _MC_BATCH],
                                                       lens[i:i + _MC_BATCH])
                if rc != 0:
                    break
        if rc != 0:
            raise RuntimeError(f"Mooncake write returned {rc}")

    def serve_poll(self, conn: Connection) -> None:
        conn.poll(None)          # its own threads move the bytes


def _worker(conn: Connection, engine: str, role: str, size: int, seed: int, env: dict[str, str],
            log_path: str | None) -> None:
    os.environ.update(env)
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    side: _Side[Any]
    try:
        if engine == "UCXX":   # kvengine/bench/ucxpeers.py
            from .ucxpeers import UcxxSide
            side = UcxxSide(role, size, seed)
        else:
            side = _NixlSide(role, size, seed) if engine == NIXL else _MooncakeSide(role, size, seed)
    except Exception as e:  # report: the column says why
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    conn.send({"ok": True, "info": side.info(), "pid": os.getpid()})
    while True:
        try:
            m = conn.recv()
        except EOFError:
            return
        op = m["op"]
        if op == "exit":
            conn.send({"ok": True})
            return
        try:
            if op == "poll":
                conn.send({"ok": True})
                side.serve_poll(conn)
                continue
            reply: Msg
            if op == "block":
                reply = {}
            else:
                reply = getattr(side, "op_" + op)(m)
            conn.send(dict(reply, ok=True))
        except Exception as e:
            conn.send({"ok": False, "error": f"{type(e).__name__}: {e}"})


# ---------------------------------------------------------------- benchmark side

class PeerError(RuntimeError):
    pass


class _Proc:
    def __init__(self, engine: str, role: str, size: int, seed: int, env: dict[str, str], log_path: str | None,
                 timeout: float) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, engine, role, size, seed, env, log_path),
                                daemon=True, name=f"kvbench-{engine}-{role}")
        self.proc.start()
        child.close()
        self.timeout = timeout
        hello = self._recv(timeout)
        if "error" in hello:
            self.close()
            raise PeerError(hello["error"])
        self.info, self.pid = hello["info"], hello["pid"]

    def _recv(self, timeout: float) -> Msg:
        if not self.conn.poll(timeout):
            raise PeerError(f"no answer within {timeout:.0f} s")
        try:
            msg: Msg = self.conn.recv()
        except EOFError:
            raise PeerError(f"worker exited (code {self.proc.exitcode})") from None
        return msg

    def call(self, op: str, timeout: float | None = None, **kw: Any) -> Msg:
        try:
            self.conn.send(dict(kw, op=op))
        except (BrokenPipeError, OSError):
            raise PeerError(f"worker gone (code {self.proc.exitcode})") from None
        r = self._recv(timeout or self.timeout)
        if not r.pop("ok", False):
            raise PeerError(r.get("error", "failed"))
        return r

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send({"op": "exit"})
                self.conn.poll(5)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        self.conn.close()


class PeerPair:
    """A target and an initiator of one engine; ``run`` returns seconds measured in the initiator."""

    def __init__(self, engine: str, size: int, transport: str, log_path: str | None = None,
                 seed: int = 99, timeout: float = 120.0) -> None:
        self.engine, self.size = engine, size
        env = {"GLOG_minloglevel": "1"}
        if engine == NIXL:
            env["NIXL_LOG_LEVEL"] = "WARN"
            if transport == "tcp":
                env.update(UCX_TLS="tcp", UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))   # 127.0.0.1 only
        # what the workers run with: these, plus any UCX_/MC_/NIXL_ variable of this environment (inherited)
        self.env = dict({k: v for k, v in os.environ.items() if k.startswith(("UCX_", "MC_", "NIXL_"))}, **env)
        target = _Proc(engine, "target", size, seed, env, log_path, timeout)
        try:
            initiator = _Proc(engine, "initiator", size, seed, env, log_path, timeout)
            try:
                initiator.call("connect", **target.info)
            except BaseException:
                initiator.close()
                raise
        except BaseException:
            target.close()
            raise
        self.target, self.initiator = target, initiator
        self.pids = [target.pid, initiator.pid]

    def prepare(self, plans: list[tuple[str, list[tuple[int, int]]]] | list[tuple[str, list[tuple[int, int, int]]]]
                ) -> None:
        """plans: [(key, [(offset, length) or (src offset, dst offset, length), ...]), ...]:
        the transfers ``run`` may name."""
        self.initiator.call("prepare", plans=[[k, [list(s) for s in segs]] for k, segs in plans])

    @overload
    def run(self, key: str | list[str], n: int, total: Literal[False] = False,
            timeout: float | None = None) -> list[float]: ...
    @overload
    def run(self, key: str | list[str], n: int, total: Literal[True], timeout: float | None = None) -> float: ...

    def run(self, key: str | list[str], n: int, total: bool = False,
            timeout: float | None = None) -> list[float] | float:
        """n transfers of plan ``key`` (or cycling over a list of keys): per-transfer seconds, or their sum."""
        self.target.call("poll")
        try:
            r = self.initiator.call("run", key=key, n=n, total=total, timeout=timeout)
        finally:
            self.target.call("block")
        seconds: list[float] | float = r["seconds"]
        return seconds

    def verify(self, key: str | list[str], nbytes: int) -> bool:
        """Zero the target's first nbytes, run ``key`` once, compare digests of the first nbytes."""
        self.target.call("zero", n=nbytes)
        self.run(key, 1)
        a: str = self.initiator.call("digest", n=nbytes)["digest"]
        b: str = self.target.call("digest", n=nbytes)["digest"]
        return a == b

    def verify_ranges(self, key: str, src: list[list[int]], dst: list[list[int]]) -> bool:
        """Zero the target, run ``key`` once, compare the source ranges with the destination's."""
        self.target.call("zero", n=self.size)
        self.run(key, 1)
        a: str = self.initiator.call("digest", ranges=src)["digest"]
        b: str = self.target.call("digest", ranges=dst)["digest"]
        return a == b

    def close(self) -> None:
        for p in (self.initiator, self.target):
            p.close()


def start_peers(names: list[str], size: int, transport: str, log_path: str | None,
                say: Callable[[str], object] = print) -> tuple[dict[str, PeerPair], dict[str, str]]:
    """Start the pairs that can start: ({name: pair}, {name: why not} for the others)."""
    have = available()
    pairs: dict[str, PeerPair] = {}
    missing: dict[str, str] = {}
    if log_path and any(have[n][0] for n in names):
        open(log_path, "w").close()
    for name in names:
        ok, why = have[name]
        if not ok:
            missing[name] = "not installed"
            continue
        try:
            pairs[name] = PeerPair(name, size, transport, log_path)
        except PeerError as e:
            missing[name] = f"failed to start: {e}"
            say(f"  {name}: failed to start ({e}); its column is left out (log: {log_path})")
    return pairs, missing


def prepare_peers(pairs: dict[str, PeerPair], plans: Any, out: dict[str, Any],
                  say: Callable[[str], object] = print) -> None:
    """Give each pair the run's plans; a pair whose prepare fails is closed and left out."""
    for name, pair in list(pairs.items()):
        try:
            pair.prepare(plans)
        except PeerError as e:
            say(f"  {name}: prepare failed ({e}); left out")
            out["peers"][name] = f"failed: {e}"
            pair.close()
            del pairs[name]


async def check_peers(pairs: dict[str, PeerPair], check: Callable[[PeerPair], bool], what: str,
                      out: dict[str, Any], verify: dict[str, list[bool]],
                      say: Callable[[str], object] = print) -> None:
    """Byte-check each pair's last transfer (``check`` runs in a thread); record the result
    in ``verify``; a pair that fails is closed and left out of the rest of the run."""
    for name, pair in list(pairs.items()):
        try:
            ok = await asyncio.to_thread(check, pair)
        except PeerError as e:
            ok = False
            say(f"  {name}: {e}")
        verify.setdefault(name, []).append(ok)
        if not ok:
            say(f"  {name}: {what} did not land as sent; left out")
            out["peers"][name] = "failed the byte check"
            pair.close()
            del pairs[name]
