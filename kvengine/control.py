"""Link control plane: framing, channels, handshake and authentication helpers.

A link starts on TCP (the ``listen`` address users know). Hello and welcome
messages carry each engine's host identity; when both engines are on one host
the client moves the link onto the server's Unix SEQPACKET socket, which can
carry file descriptors (memfd caches are shared that way) and whose EOF tells
at once that the peer process died. Across hosts (or with
``transport="tcp"``) the TCP connection stays the control channel and the
native core opens the data connections (docs/protocol.md).

Messages are small JSON objects with a type field ``t``; nothing here moves
payload bytes.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
from typing import Any

PROTOCOL_VERSION = 1
MAX_FRAME = 4 << 20          # bytes of one control message
MAX_FDS = 512                # descriptors one message may carry

_LEN = struct.Struct("!I")


class ProtocolError(Exception):
    """The peer sent something that is not a valid control message."""


def host_identity() -> str:
    """Same string for every process that can share memfds and use CMA with us.

    Boot id (same kernel), plus the network namespace (abstract Unix sockets are
    per netns) and the pid namespace (pids in CMA calls are per pid ns).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    parts = [boot]
    for ns in ("net", "pid"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            parts.append("?")
    return ":".join(parts)


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(data: bytes) -> dict:
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"bad control message: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError("control message without a type")
    return msg


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); ValueError if malformed."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"address must be 'host:port', got {address!r}")
    host, _, port_s = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_s)
    if not host or not 0 <= port <= 65535:
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host, port


# --------------------------------------------------------------- authentication

def new_nonce() -> str:
    return secrets.token_hex(16)


def proof(secret: bytes, label: str, *nonces: str) -> str:
    """HMAC-SHA256 over a direction label and both nonces (challenge-response)."""
    mac = hmac.new(secret, label.encode(), hashlib.sha256)
    for n in nonces:
        mac.update(b"\0" + n.encode())
    return mac.hexdigest()


def check_proof(secret: bytes | None, got: Any, label: str, *nonces: str) -> bool:
    if secret is None:
        return got is None
    return isinstance(got, str) and hmac.compare_digest(got, proof(secret, label, *nonces))


# ---------------------------------------------------------------------- channels

class StreamChannel:
    """Length-prefixed JSON frames over an asyncio stream: the hello phase, and the
    whole control channel of a TCP-transport link."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, msg: dict, fds: list[int] | tuple[int, ...] = ()) -> None:
        if fds:
            raise ProtocolError("file descriptors cannot cross a TCP control connection")
        data = encode(msg)
        if len(data) > MAX_FRAME:
            raise ProtocolError(f"control message of {len(data)} bytes exceeds {MAX_FRAME}")
        try:
            self.writer.write(_LEN.pack(len(data)) + data)
            await self.writer.drain()
        except (RuntimeError, OSError) as e:   # closed transport, reset
            raise ConnectionError(f"control channel: {e}") from None

    def send_nowait(self, msg: dict) -> bool:
        """Queue a small message without waiting (the transport buffers it)."""
        data = encode(msg)
        try:
            self.writer.write(_LEN.pack(len(data)) + data)
        except (RuntimeError, OSError):
            return True   # closed: the reader reports the loss
        return True

    async def recv(self) -> tuple[dict, list[int]] | None:
        """Next ``(msg, [])``; ``None`` at EOF. Raises ProtocolError on garbage."""
        try:
            head = await self.reader.readexactly(4)
            (n,) = _LEN.unpack(head)
            if n > MAX_FRAME:
                raise ProtocolError(f"control frame of {n} bytes exceeds {MAX_FRAME}")
            return decode(await self.reader.readexactly(n)), []
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    def close(self) -> None:
        try:
            self.writer.close()
        except (RuntimeError, OSError):  # loop already closed
            pass


class SeqpacketChannel:
    """JSON messages with optional file descriptors over a Unix SEQPACKET socket.

    One message per packet. Reading is driven by ``loop.add_reader``: the
    receive queue holds ``(msg, fds)`` pairs, then ``None`` at EOF.
    """

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_FRAME)
        except OSError:
            pass
        self.sock = sock
        self.loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._eof = False
        loop.add_reader(sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(self.sock, MAX_FRAME, MAX_FDS)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds, flags = b"", [], 0
            if not data:
                self._finish()
                return
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                for fd in fds:
                    os.close(fd)
                self._queue.put_nowait(ProtocolError("truncated control message"))
                self._finish()
                return
            try:
                self._queue.put_nowait((decode(data), fds))
            except ProtocolError as e:
                for fd in fds:
                    os.close(fd)
                self._queue.put_nowait(e)
                self._finish()
                return

    def _finish(self) -> None:
        if not self._eof:
            self._eof = True
            self.loop.remove_reader(self.sock.fileno())
            self._queue.put_nowait(None)

    async def recv(self) -> tuple[dict, list[int]] | None:
        """Next ``(msg, fds)``; ``None`` at EOF. Raises ProtocolError on garbage."""
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # every later recv sees EOF too
            return None
        if isinstance(item, ProtocolError):
            raise item
        return item

    async def send(self, msg: dict, fds: list[int] | tuple[int, ...] = ()) -> None:
        if self._closed:
            raise ConnectionError("channel closed")
        data = encode(msg)
        if len(data) > MAX_FRAME:
            raise ProtocolError(f"control message of {len(data)} bytes exceeds {MAX_FRAME}")
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while True:
            try:
                self.sock.sendmsg([data], anc)
                return
            except (BlockingIOError, InterruptedError):
                await self._writable()
            except OSError as e:
                raise ConnectionError(f"control channel: {e}") from None

    def send_nowait(self, msg: dict) -> bool:
        """Send a small message if the socket takes it now; False if it would block."""
        if self._closed:
            return True
        try:
            self.sock.sendmsg([encode(msg)])
            return True
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True   # the reader sees the EOF

    async def _writable(self) -> None:
        fut = self.loop.create_future()
        fd = self.sock.fileno()
        self.loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            self.loop.remove_writer(fd)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._eof:
            self._eof = True
            self.loop.remove_reader(self.sock.fileno())
            self._queue.put_nowait(None)
        self.sock.close()


def unix_listener() -> tuple[socket.socket, str]:
    """A listening abstract-namespace SEQPACKET socket with an unguessable name."""
    name = "kvengine/" + secrets.token_hex(12)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.bind("\0" + name)
    sock.listen(64)
    sock.setblocking(False)
    return sock, name


async def unix_connect(name: str, loop: asyncio.AbstractEventLoop) -> SeqpacketChannel:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, "\0" + name)
    except BaseException:
        sock.close()
        raise
    return SeqpacketChannel(sock, loop)
