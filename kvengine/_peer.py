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
import ctypes
import hashlib
import json
import mmap
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from .engine import KvEngine
    from .transfer import Transfer
    from .types import Cache, CacheDesc

# One JSON line of the protocol (a command, or a reply): values are whatever JSON says.
Message = dict[str, Any]

__all__ = ["fill_pattern", "row_digests", "map_fixed", "PeerProcess"]

_PATTERN_LEN = 65537  # prime: consecutive rows of power-of-two sizes differ


def fill_pattern(arr: NDArray[Any], seed: int, tensor: int) -> None:
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


def row_digests(tensors: list[NDArray[Any]]) -> list[list[str]]:
    """Per tensor, per dim-0 row: a short blake2b hex digest of its bytes."""
    out: list[list[str]] = []
    for t in tensors:
        rows = t.reshape(t.shape[0], -1).view(np.uint8)
        out.append([hashlib.blake2b(r.tobytes(), digest_size=8).hexdigest() for r in rows])
    return out


def map_fixed(addr: int, size: int) -> int | None:
    """Map ``size`` bytes of private anonymous memory at exactly ``addr``
    (MAP_FIXED_NOREPLACE); ``None`` if something is there already. Never unmapped."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    got = libc.mmap(addr, size, mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x100000, -1, 0)   # MAP_FIXED_NOREPLACE
    if got is None or got == ctypes.c_void_p(-1).value:
        return None
    if got != addr:   # a kernel without MAP_FIXED_NOREPLACE took it as a hint
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap(got, size)
        return None
    return addr


class _HeldFaults:
    """Anonymous memory under userfaultfd (missing-page mode): pages come in zeroed on
    first touch, except that the first fault after ``arm()`` is held until ``release()``,
    so the thread that touched the page (e.g. the I/O thread inside recv) stalls there.
    Tests use it to stall a writer inside a write (a page fault on slow memory)."""

    _API, _REGISTER, _COPY = 0xC018AA3F, 0xC020AA00, 0xC028AA03   # UFFDIO_* ioctls (x86_64)

    def __init__(self, size: int) -> None:
        import fcntl
        import struct
        import threading
        self._fcntl, self._struct = fcntl, struct
        self.page = mmap.PAGESIZE
        self.size = -(-size // self.page) * self.page
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        self.fd = libc.syscall(323, os.O_CLOEXEC)   # userfaultfd(2)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "userfaultfd")
        self.mem = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        fcntl.ioctl(self.fd, self._API, bytearray(struct.pack("QQQ", 0xAA, 0, 0)))
        fcntl.ioctl(self.fd, self._REGISTER, bytearray(struct.pack("QQQQ", self.addr, self.size, 1, 0)))
        self._zero = ctypes.create_string_buffer(self.page)
        self.armed = False
        self.gate = threading.Event()
        self.faults = 0
        self.held: int | None = None          # fault number of the held fault
        self.held_addr: int | None = None
        self.faults_while_held = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            msg = os.read(self.fd, 32)
            if len(msg) < 32 or msg[0] != 0x12:   # UFFD_EVENT_PAGEFAULT
                continue
            addr = self._struct.unpack_from("Q", msg, 16)[0] & ~(self.page - 1)
            self.faults += 1
            if self.armed and self.held is None:
                self.held, self.held_addr = self.faults, addr
                self.gate.wait()
            elif self.held is not None and not self.gate.is_set():
                self.faults_while_held += 1
            try:
                self._fcntl.ioctl(self.fd, self._COPY, bytearray(self._struct.pack(
                    "QQQQq", addr, ctypes.addressof(self._zero), self.page, 0, 0)))
            except OSError:   # EEXIST: another fault on that page was served first
                pass

    def release(self) -> None:
        self.gate.set()


class _Server:
    def __init__(self, engine: KvEngine) -> None:
        import kvengine as kv
        self.kv = kv
        self.engine = engine
        self.caches: dict[int, Cache] = {}
        self.bg: dict[int, Transfer] = {}   # push_start handles -> Transfer
        self.held: _HeldFaults | None = None
        self.consumer: asyncio.Task[None] | None = None   # consume_notes: a decode worker's loop
        self.consumed = self.reported = 0

    def _desc(self, m: Message) -> CacheDesc:
        return self.kv.CacheDesc(m["n"], tuple(m["shape"]), m.get("dtype", "float16"),
                                 block_stride=m.get("block_stride"), head_axis=m.get("head_axis"))

    async def _consume(self) -> None:
        async for _ in self.engine.notifications():
            self.consumed += 1

    async def handle(self, m: Message) -> Message:
        kv, e = self.kv, self.engine
        op = m["op"]
        if op in ("alloc", "register"):   # "keys": [[cluster, req, model], ...] bound to rows 0, 1, ...
            desc = self._desc(m)
            keys = [kv.CacheKey(*k) for k in m["keys"]] if m.get("keys") is not None else None
            if op == "alloc":
                cache = e.allocate_cache(desc, cache_keys=keys)
            else:
                if m.get("one_buffer"):   # one array sliced into the tensors (numpy's huge pages where THP allows)
                    n = int(np.prod(desc.shape))
                    flat = np.zeros(n * desc.num_tensors, desc.dtype.numpy_dtype)
                    bufs = [flat[i * n:(i + 1) * n].reshape(desc.shape) for i in range(desc.num_tensors)]
                else:
                    bufs = [np.zeros(desc.shape, dtype=desc.dtype.numpy_dtype) for _ in range(desc.num_tensors)]
                if m.get("layout") == "flashinfer":   # (blocks, 2, ...) per layer: K, V interleaved
                    bufs = kv.layout.kv_tensors([np.zeros((desc.shape[0], 2, *desc.shape[1:]), desc.dtype.numpy_dtype)
                                                 for _ in range(desc.num_tensors // 2)], "flashinfer")
                cache = e.register_kv_cache(desc, bufs, cache_keys=keys)
            if m.get("fill") is not None:
                for i, arr in enumerate(cache.tensors):
                    fill_pattern(arr, m["fill"], i)
            self.caches[cache.cache_id] = cache
            return {"cache_id": cache.cache_id}
        if op == "bind_key":
            e.bind_cache_key(self.caches[m["cache_id"]], kv.CacheKey(*m["key"]), m.get("row", 0))
            return {}
        if op == "remove_key":
            e.remove_cache_key(kv.CacheKey(*m["key"]))
            return {}
        if op == "fill":
            for i, arr in enumerate(self.caches[m["cache_id"]].tensors):
                fill_pattern(arr, m["seed"], i)
            return {}
        if op == "zero":
            for arr in self.caches[m["cache_id"]].tensors:
                arr[...] = 0
            return {}
        if op == "register_held":   # register_kv_cache on _HeldFaults memory (pages untouched)
            desc = self._desc(m)
            self.held = _HeldFaults(desc.size * desc.num_tensors)
            flat = np.frombuffer(self.held.mem, dtype=np.uint8)
            bufs = [flat[i * desc.size:(i + 1) * desc.size] for i in range(desc.num_tensors)]
            cache = e.register_kv_cache(desc, bufs)
            self.caches[cache.cache_id] = cache
            return {"cache_id": cache.cache_id}
        if op == "held":   # arm / release the held fault, and report
            h = self.held
            if h is None:
                raise ValueError("no register_held cache")
            if m.get("zap"):   # drop the pages: the next touch faults again (after a warm-up)
                h.mem.madvise(mmap.MADV_DONTNEED)
            if m.get("arm"):
                h.armed = True
            if m.get("release"):
                h.release()
            return {"faults": h.faults, "held": h.held, "held_addr": h.held_addr,
                    "faults_while_held": h.faults_while_held, "released": h.gate.is_set()}
        if op == "addrs":   # where the cache's tensors sit in this process (read with process_vm_readv)
            cache = self.caches[m["cache_id"]]
            return {"addrs": list(cache.tensor_addrs), "size": cache.desc.size}
        if op == "canary":   # `size` bytes of `byte` at exactly `addr` ({"addr": None} if taken)
            addr = map_fixed(m["addr"], m["size"])
            if addr is not None:
                ctypes.memset(addr, m["byte"], m["size"])
            return {"addr": addr}
        if op == "peek":     # bytes at an address of this process, as hex
            return {"hex": ctypes.string_at(m["addr"], m["size"]).hex()}
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
        if op == "push_times":   # "n" pushes like "push", one after another ("gap" s apart): each one's us
            await e.wait_remote_cache(m["cluster_id"], m["dst_cache_id"], timeout=m.get("timeout"))
            src, idx = self.caches[m["cache_id"]], kv.CacheIndex(m["cluster_id"], m["dst_cache_id"], 0)
            us: list[float] = []
            for _ in range(m["n"]):
                t0 = time.perf_counter()
                st = await e.submit_push_kv_cache(src, idx, 0, timeout=m.get("timeout"))
                if st != kv.LLMStatusCode.LLM_SUCCESS:
                    return {"status": int(st), "us": us}
                us.append((time.perf_counter() - t0) * 1e6)
                await asyncio.sleep(m.get("gap", 0))
            return {"status": 0, "us": us}
        if op == "push_start":   # like "push" (deadline: its timeout), but answers at once with a
            # handle for "push_wait" (PeerProcess.call takes `timeout` for itself: use `deadline`)
            await e.wait_remote_cache(m["cluster_id"], m["dst_cache_id"], timeout=m.get("deadline"))
            t = e.submit_push_kv_cache(self.caches[m["cache_id"]],
                                       kv.CacheIndex(m["cluster_id"], m["dst_cache_id"], m.get("dst_batch", 0)),
                                       m.get("src_batch", 0), timeout=m.get("deadline"))
            handle = len(self.bg) + 1
            self.bg[handle] = t
            return {"handle": handle}
        if op == "push_wait":    # the status of a push_start, or {"status": None} after "wait" s
            t = self.bg[m["handle"]]
            try:
                st = await asyncio.wait_for(t._wait(), m.get("wait", 10))
            except asyncio.TimeoutError:
                return {"status": None}
            return {"status": int(st)}
        if op == "wait_link_down":   # returns once the link to cluster_id is gone (or after timeout)
            try:
                await e.wait_remote_cache(m["cluster_id"], 2**62, timeout=m.get("timeout", 10))
            except (kv.LLMNotYetLinkError, kv.LLMLinkFailedError):
                return {"down": True}
            except kv.LLMTimeoutError:
                return {"down": False}
            return {"down": False}
        if op == "wait_remote":   # until the peer cluster_id's cache cache_id is known here (mapped)
            st = await e.wait_remote_cache(m["cluster_id"], m["cache_id"], timeout=m.get("timeout", 10))
            return {"status": int(st)}
        if op == "stats":
            return {"stats": e.stats()}
        if op == "consume_notes":   # from now on consume every notification as it arrives
            if self.consumer is None:
                self.consumer = asyncio.ensure_future(self._consume())
            return {"ok": True}
        if op == "take_notes" and self.consumer is not None:   # those consumed since the last take
            for _ in range(10_000):   # until what arrived so far is consumed (10 s at most)
                if not e.stats()["notifications"]["pending"]:
                    break
                await asyncio.sleep(0.001)
            taken, self.reported = self.consumed - self.reported, self.consumed
            return {"taken": taken}
        if op == "take_notes":   # consume every buffered notification, as a decode worker would
            payloads: dict[str, int] = {}
            while e.stats()["notifications"]["pending"]:
                note = await e.wait_notification(timeout=1.0)
                payloads[note.payload.hex()] = payloads.get(note.payload.hex(), 0) + 1
            return {"taken": sum(payloads.values()), "payloads": payloads}
        if op == "close":   # close the engine now, timed; the process keeps answering ("exit" ends it)
            t0 = time.monotonic()
            await e.close()
            return {"seconds": time.monotonic() - t0}
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

    def send(obj: Message) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    async with kv.KvEngine(args.cluster_id, kv.Role.DECODER, args.listen, opts) as engine:
        await answer(_Server(engine), reader, send)


async def answer(server: _Server, reader: asyncio.StreamReader, send: Callable[[Message], None]) -> None:
    """Say where the engine listens, then answer one JSON line per command line until EOF or
    "exit" (errors are answered, not raised: the peer keeps serving)."""
    send({"address": server.engine.address, "pid": os.getpid()})
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
        if proc.stdin is None or proc.stdout is None:
            raise ValueError("the peer process needs piped stdin and stdout")
        self.proc, self.address, self.pid = proc, address, pid
        self._stdin, self._stdout = proc.stdin, proc.stdout
        self._lock = asyncio.Lock()

    @classmethod
    async def start(cls, cluster_id: int, transport: str = "auto", secret: bytes | None = None,
                    movers: int = 2, timeout: float = 30.0, tcp_streams: int | None = None,
                    options: Message | None = None) -> PeerProcess:
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
                                                    stdout=asyncio.subprocess.PIPE,
                                                    limit=1 << 26)   # a large cache's row digests
        try:
            assert proc.stdout is not None   # stdout=PIPE
            line = await asyncio.wait_for(proc.stdout.readline(), timeout)
            hello = json.loads(line)
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        return cls(proc, hello["address"], hello["pid"])

    async def call(self, op: str, timeout: float = 30.0, **kw: Any) -> Message:
        async with self._lock:
            self._stdin.write((json.dumps(dict(kw, op=op)) + "\n").encode())
            await self._stdin.drain()
            line = await asyncio.wait_for(self._stdout.readline(), timeout)
        if not line:
            raise ConnectionError("peer process exited")
        reply: Message = json.loads(line)
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
