"""Baselines every benchmark can build without extras, measured beside kvengine.

- memcpy of the same bytes: numpy ``copyto`` into pre-faulted buffers, one thread;
- a raw socket: ``sendall`` from this process, ``recv_into`` a pre-faulted buffer in
  a peer process, a 1-byte ack back (wire: 8-byte length, payload, ack);
- asyncio/uvloop streams: ``write`` + ``drain`` here, ``readexactly`` in a uvloop
  peer process, a 1-byte ack back (same wire format).

The peer processes are started with multiprocessing's spawn context and stay up
across repetitions; their targets live in this module so that they work from an
installed kvengine.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import struct
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Sequence, TypeVarTuple, Unpack

import numpy as np
from numpy.typing import NDArray

HDR = struct.Struct("<Q")          # 8-byte payload length; 1-byte ack back
STOCK_LIMIT = 1 << 16              # asyncio.StreamReader's default limit
PIECE = 4 << 20                    # bytes per write + drain (streams) by default

# What a sender sends as one message: one buffer, or several one after the other.
Views = memoryview | list[memoryview] | tuple[memoryview, ...]
# Rows of a cache (any dtype) and their copies
Rows = Sequence[NDArray[Any]]

_Ts = TypeVarTuple("_Ts")


# ---------------------------------------------------------------- memcpy

def memcpy_seconds(src_rows: Rows, dst_rows: Rows) -> float:
    """Seconds to np.copyto every src row into its dst row, one thread."""
    t0 = time.perf_counter()
    for s, d in zip(src_rows, dst_rows):
        np.copyto(d, s)
    return time.perf_counter() - t0


class ParallelMemcpy:
    """memcpy of the same rows split over ``threads`` threads (rows dealt round-robin; numpy's copy
    releases the GIL): the ceiling for kvengine's movers, which also copy on 2 threads by default."""

    def __init__(self, threads: int = 2) -> None:
        from concurrent.futures import ThreadPoolExecutor
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="memcpy")

    def seconds(self, src_rows: Rows, dst_rows: Rows) -> float:
        k = self.threads

        def part(j: int) -> None:
            for s, d in zip(src_rows[j::k], dst_rows[j::k]):
                np.copyto(d, s)

        t0 = time.perf_counter()
        for f in [self.pool.submit(part, j) for j in range(k)]:
            f.result()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()


# ---------------------------------------------------------------- peer processes

def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            return False
        got += r
    return True


def raw_peer(conn: Connection, nbytes: int) -> None:
    """Receiver of the raw-socket baseline: recv_into a pre-faulted numpy buffer, ack each message."""
    buf = np.ones(nbytes, np.uint8)   # pre-faulted
    view = buf.data
    ls = socket.create_server(("127.0.0.1", 0))
    conn.send(ls.getsockname()[1])
    s, _ = ls.accept()
    ls.close()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hdr = bytearray(HDR.size)
    try:
        while _recv_exact(s, memoryview(hdr)):
            n = HDR.unpack(hdr)[0]
            if n == 0 or n > nbytes or not _recv_exact(s, view[:n]):
                break
            s.sendall(b"\x01")
    finally:
        s.close()


async def _streams_serve(conn: Connection, limit: int, read_piece: int) -> None:
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                n = HDR.unpack(await reader.readexactly(HDR.size))[0]
                if n == 0:
                    break
                left = n
                while left:
                    k = min(read_piece, left)
                    await reader.readexactly(k)
                    left -= k
                writer.write(b"\x01")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            done.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=limit)
    conn.send(server.sockets[0].getsockname()[1])
    await done.wait()
    server.close()


def streams_peer(conn: Connection, limit: int, read_piece: int) -> None:
    """Receiver of the streams baseline: a uvloop process (asyncio without uvloop) reading with
    StreamReader(limit).readexactly(read_piece)."""
    try:
        import uvloop
        uvloop.run(_streams_serve(conn, limit, read_piece))
    except ImportError:
        asyncio.run(_streams_serve(conn, limit, read_piece))


def start_peer(target: Callable[[Connection, Unpack[_Ts]], None], *args: Unpack[_Ts],
               timeout: float = 60.0) -> tuple[BaseProcess, int]:
    """Spawn target(conn, *args); returns (process, the first object it sends: its port)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(child, *args), daemon=True)
    p.start()
    if not parent.poll(timeout):
        p.kill()
        raise RuntimeError(f"{target.__name__} did not start")
    port: int = parent.recv()
    return p, port


# ---------------------------------------------------------------- senders (this process)

def raw_send(sock: socket.socket, view: Views, piece: int = 0) -> float:
    """Blocking (run it on a worker thread): header + sendall (of one buffer, or of a list of
    buffers one by one, or of one buffer in pieces) + wait for the ack. Seconds, end to end."""
    views = view if isinstance(view, (list, tuple)) else [view]
    total = sum(len(v) for v in views)
    ack = bytearray(1)
    t0 = time.perf_counter()
    sock.sendall(HDR.pack(total))
    for v in views:
        if piece:
            for off in range(0, len(v), piece):
                sock.sendall(v[off:off + piece])
        else:
            sock.sendall(v)
    if sock.recv_into(ack, 1) != 1:
        raise ConnectionError("raw peer closed")
    return time.perf_counter() - t0


async def streams_send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, view: Views,
                       piece: int = PIECE) -> float:
    """Header + write/drain (a buffer in pieces, or a list of buffers one by one) + read the ack."""
    views = view if isinstance(view, (list, tuple)) else [view]
    total = sum(len(v) for v in views)
    t0 = time.perf_counter()
    writer.write(HDR.pack(total))
    for v in views:
        for off in range(0, len(v), piece):
            writer.write(v[off:off + piece])
            await writer.drain()
    await reader.readexactly(1)
    return time.perf_counter() - t0


class RawSocket:
    """The raw-socket baseline: a peer process and a connected socket to it."""

    def __init__(self, max_bytes: int) -> None:
        self.proc, port = start_peer(raw_peer, max_bytes)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, views: Views, piece: int = 0) -> float:
        return raw_send(self.sock, views, piece)

    def close(self) -> None:
        try:
            self.sock.sendall(HDR.pack(0))
            self.sock.close()
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class Streams:
    """The streams baseline: a uvloop peer process and an open stream pair to it (call ``connect``
    on the running loop)."""

    def __init__(self, limit: int = PIECE, read_piece: int = 1 << 20) -> None:
        self.limit, self.read_piece = limit, read_piece
        self.proc, self.port = start_peer(streams_peer, limit, read_piece)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def send(self, views: Views, piece: int = PIECE) -> float:
        if self.reader is None or self.writer is None:
            raise RuntimeError("Streams.connect() first")
        return await streams_send(self.reader, self.writer, views, piece)

    def close(self) -> None:
        if self.writer is not None:
            try:
                self.writer.write(HDR.pack(0))
                self.writer.close()
            except (OSError, RuntimeError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
