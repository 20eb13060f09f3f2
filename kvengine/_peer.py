"""A kvengine engine in a child process, driven by JSON lines on stdin/stdout.

Used by the demo, the tests and the benchmarks to put the decode side in
another process. Not a public API.

    python -m kvengine._peer --cluster-id 2 --listen 127.0.0.1:0

prints ``{"address": ..., "pid": ...}``, then answers one JSON line per
command line (``{"op": "alloc", ...}``), see ``_Server``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import sys
from typing import Any

import numpy as np

__all__ = ["fill_pattern", "row_digests", "PeerProcess"]

_PATTERN_LEN = 65537  # prime: consecutive rows of power-of-two sizes differ


def fill_pattern(arr: np.ndarray, seed: int, tensor: int) -> None:
    """Fill ``arr`` with bytes determined by (seed, tensor), fast (a tiled random block)."""
    rng = np.random.default_rng((seed * 1_000_003 + tensor) & 0xFFFFFFFF)
    block = rng.integers(0, 256, size=_PATTERN_LEN, dtype=np.uint8)
    flat = arr.reshape(-1).view(np.uint8)
    n = flat.size
    pos = 0
    while pos < n:
        k = min(_PATTERN_LEN, n - pos)
        flat[pos:pos + k] = block[:k]
        pos += k


def row_digests(tensors: list[np.ndarray]) -> list[list[str]]:
    """Per tensor, per dim-0 row: a short blake2b hex digest of its bytes."""
    out = []
    for t in tensors:
        rows = t.reshape(t.shape[0], -1).view(np.uint8)
        out.append([hashlib.blake2b(r.tobytes(), digest_size=8).hexdigest() for r in rows])
    return out


class _Server:
    def __init__(self, engine) -> None:
        import kvengine as kv
        self.kv = kv
        self.engine = engine
        self.caches: dict[int, Any] = {}

    def _desc(self, m: dict):
        return self.kv.CacheDesc(m["n"], tuple(m["shape"]), m.get("dtype", "float16"))

    async def handle(self, m: dict) -> dict:
        kv, e = self.kv, self.engine
        op = m["op"]
        if op in ("alloc", "register"):
            desc = self._desc(m)
            if op == "alloc":
                cache = e.allocate_cache(desc)
            else:
                bufs = [np.zeros(desc.shape, dtype=desc.dtype.numpy_dtype) for _ in range(desc.num_tensors)]
                cache = e.register_kv_cache(desc, bufs)
            if m.get("fill") is not None:
                for i, t in enumerate(cache.tensors):
                    fill_pattern(t, m["fill"], i)
            self.caches[cache.cache_id] = cache
            return {"cache_id": cache.cache_id}
        if op == "fill":
            for i, t in enumerate(self.caches[m["cache_id"]].tensors):
                fill_pattern(t, m["seed"], i)
            return {}
        if op == "zero":
            for t in self.caches[m["cache_id"]].tensors:
                t[...] = 0
            return {}
        if op == "digest":
            return {"rows": row_digests(self.caches[m["cache_id"]].tensors)}
        if op == "unregister":
            await e.unregister_kv_cache(m["cache_id"])
            self.caches.pop(m["cache_id"], None)
            return {}
        if op == "link":
            st, per = await e.link_clusters([kv.ClusterInfo(m["cluster_id"], m["address"])])
            return {"status": int(st)}
        if op == "push":
            await e.wait_remote_cache(m["cluster_id"], m["dst_cache_id"], timeout=m.get("timeout"))
            t = e.submit_push_kv_cache(self.caches[m["cache_id"]],
                                       kv.CacheIndex(m["cluster_id"], m["dst_cache_id"], m.get("dst_batch", 0)),
                                       m.get("src_batch", 0), timeout=m.get("timeout"))
            return {"status": int(await t)}
        if op == "wait_link_down":   # returns once the link to cluster_id is gone (or after timeout)
            try:
                await e.wait_remote_cache(m["cluster_id"], 2**62, timeout=m.get("timeout", 10))
            except (kv.LLMNotYetLinkError, kv.LLMLinkFailedError):
                return {"down": True}
            except kv.LLMTimeoutError:
                return {"down": False}
            return {"down": False}
        if op == "stats":
            return {"stats": e.stats()}
        if op == "exit":
            return {"exit": True}
        raise ValueError(f"unknown op {op!r}")


async def _serve(args: argparse.Namespace) -> None:
    import kvengine as kv
    extra = json.loads(args.options) if args.options else {}
    if args.tcp_streams is not None:
        extra["tcp_streams"] = args.tcp_streams
    opts = kv.EngineOptions(transport=args.transport, secret=args.secret.encode() if args.secret else None,
                            movers=args.movers, **extra)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout

    def send(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    async with kv.KvEngine(args.cluster_id, kv.Role.DECODER, args.listen, opts) as engine:
        server = _Server(engine)
        send({"address": engine.address, "pid": os.getpid()})
        while True:
            line = await reader.readline()
            if not line:
                break
            try:
                reply = await server.handle(json.loads(line))
                send(dict(reply, ok=True))
                if reply.get("exit"):
                    break
            except Exception as e:  # report, keep serving
                send({"ok": False, "error": f"{type(e).__name__}: {e}"})


class PeerProcess:
    """Parent-side handle of a ``python -m kvengine._peer`` child."""

    def __init__(self, proc: asyncio.subprocess.Process, address: str, pid: int) -> None:
        self.proc, self.address, self.pid = proc, address, pid
        self._lock = asyncio.Lock()

    @classmethod
    async def start(cls, cluster_id: int, transport: str = "auto", secret: bytes | None = None,
                    movers: int = 2, timeout: float = 30.0, tcp_streams: int | None = None,
                    options: dict | None = None) -> "PeerProcess":
        """Start the child; ``options``: more EngineOptions fields (JSON-able values)."""
        argv = [sys.executable, "-m", "kvengine._peer", "--cluster-id", str(cluster_id),
                "--listen", "127.0.0.1:0", "--transport", transport, "--movers", str(movers)]
        if options:
            argv += ["--options", json.dumps(options)]
        if tcp_streams is not None:   # None: EngineOptions' default
            argv += ["--tcp-streams", str(tcp_streams)]
        if secret:
            argv += ["--secret", secret.decode()]
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), timeout)
            hello = json.loads(line)
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        return cls(proc, hello["address"], hello["pid"])

    async def call(self, op: str, timeout: float = 30.0, **kw: Any) -> dict:
        async with self._lock:
            self.proc.stdin.write((json.dumps(dict(kw, op=op)) + "\n").encode())
            await self.proc.stdin.drain()
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise ConnectionError("peer process exited")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise RuntimeError(f"peer: {reply['error']}")
        return reply

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)

    def signal(self, sig: int) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)

    async def close(self, timeout: float = 10.0) -> int:
        if self.proc.returncode is None:
            try:
                await self.call("exit", timeout=timeout)
            except (ConnectionError, RuntimeError, asyncio.TimeoutError, BrokenPipeError, OSError):
                pass
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except asyncio.TimeoutError:
                self.kill()
        return await self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m kvengine._peer")
    ap.add_argument("--cluster-id", type=int, required=True)
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--secret", default=None)
    ap.add_argument("--movers", type=int, default=2)
    ap.add_argument("--tcp-streams", type=int, default=None, help="default: EngineOptions' default")
    ap.add_argument("--options", default=None, help="JSON object of more EngineOptions fields")
    ap.add_argument("--uvloop", action="store_true")
    args = ap.parse_args()
    if args.uvloop:
        import uvloop
        uvloop.install()
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
