"""Link control plane: framing, channels, handshake and authentication helpers.

A link starts on TCP (the ``listen`` address users know): hello -> welcome ->
attach (the client's proof) -> attached. Nothing private (pid, Unix socket name,
data port, tokens) goes out before the peer has authenticated, and hello-phase
frames are at most HELLO_MAX bytes. When both engines are on one host the client
then joins the server's Unix SEQPACKET socket with a one-time token; that socket
carries file descriptors (sealed memfd caches are shared that way), tells each
side the other's pid from the kernel (SO_PEERCRED, never from a message), and its
EOF tells at once that the peer process died. Across hosts (or with
``transport="tcp"``) the TCP connection stays the control channel and the native
core opens the data connections (docs/protocol.md).

Messages are small JSON objects with a type field ``t``; nothing here moves
payload bytes.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import hashlib
import hmac
import ipaddress
import json
import mmap
import os
import secrets
import socket
import stat
import struct
from typing import Any

PROTOCOL_VERSION = 2           # 2: pid from SO_PEERCRED, nothing before the proof, data-plane leases
MAX_FRAME = 4 << 20          # bytes of one control message once the peer is authenticated
HELLO_MAX = 4096             # bytes of one frame of the hello phase (hello, welcome, attach, attached, join)
MAX_FDS = 512                # descriptors one message may carry
HELLO_PHASE_MAX = 5.0        # seconds: the whole unauthenticated phase, at most (and at most link_timeout)
MAX_PREAUTH = 64             # unauthenticated control connections at once (TCP and Unix), beyond
MAX_PREAUTH_PER_SOURCE = 16  # ... which (or this many from one source address, or Unix uid) a newcomer
PREAUTH_GRACE = 0.5          # evicts the oldest if it waited this many seconds; if not (a burst of
MAX_PREAUTH_BURST = 256      # real peers), it waits too, up to this many; beyond, it is closed at once
MAX_REMOTE_CACHES = 65536    # caches one peer may have announced at once on a link
CLOSE_LINGER = 2.0           # seconds a closed TCP control connection may take to flush

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)   # Linux >= 6.5

_LEN = struct.Struct("!I")

# A control message: a decoded JSON object with a str type field ``t``. Its values are
# whatever JSON a peer sent (hence Any): every reader checks the fields it uses.
Message = dict[str, Any]


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


def encode(msg: Message) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(data: bytes) -> Message:
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:   # RecursionError: deep nesting
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


_process: tuple[int, str] = (0, "")


def process_tag() -> str:
    """A random tag of this process (a new one after fork): a hello carries it so that the
    server can choose the in-process transport. A claim only: the server then requires the
    Unix peer's SO_PEERCRED pid to be its own."""
    global _process
    if _process[0] != os.getpid():
        _process = (os.getpid(), secrets.token_hex(16))
    return _process[1]


def proof(secret: bytes, label: str, *nonces: str) -> str:
    """HMAC-SHA256 over a direction label and both nonces (challenge-response)."""
    mac = hmac.new(secret, label.encode(), hashlib.sha256)
    for n in nonces:
        mac.update(b"\0" + n.encode())
    return mac.hexdigest()


def check_proof(secret: bytes | None, got: object, label: str, *nonces: str) -> bool:
    if secret is None:
        return got is None
    return isinstance(got, str) and hmac.compare_digest(got, proof(secret, label, *nonces))


# ---------------------------------------------------------------------- channels

_HTTP_STARTS = (b"GET ", b"POST", b"PUT ", b"HEAD", b"DELE", b"OPTI", b"PATC", b"CONN", b"TRAC",
                b"PRI ", b"HTTP")


def frame_too_large(head: bytes, n: int, max_frame: int) -> str:
    """The error for a length prefix over ``max_frame``, naming a stranger when the 4
    bytes are not a length at all (an HTTP request, a TLS handshake, a text protocol)."""
    what = None
    if head in _HTTP_STARTS:
        what = "HTTP"
    elif head[0] == 0x16 and head[1] == 0x03:
        what = "a TLS handshake"
    elif all(32 <= b < 127 or b in b"\t\r\n" for b in head):
        what = "text"
    if what is None:
        return f"control frame of {n} bytes exceeds {max_frame}"
    return (f"not a kvengine peer: the first bytes look like {what} ({head!r}), not a frame length "
            f"(read as {n} bytes, over the {max_frame} allowed)")


class StreamChannel:
    """Length-prefixed JSON frames over an asyncio stream: the hello phase, and the
    whole control channel of a TCP-transport link."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, msg: Message, fds: list[int] | tuple[int, ...] = ()) -> None:
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

    def send_nowait(self, msg: Message) -> bool:
        """Queue a small message without waiting (the transport buffers it)."""
        data = encode(msg)
        try:
            self.writer.write(_LEN.pack(len(data)) + data)
        except (RuntimeError, OSError):
            return True   # closed: the reader reports the loss
        return True

    async def recv(self, max_frame: int = MAX_FRAME) -> tuple[Message, list[int]] | None:
        """Next ``(msg, [])``; ``None`` at EOF. Raises ProtocolError on garbage, and on a
        length prefix over ``max_frame`` before reading (or decoding) any of the frame."""
        try:
            head = await self.reader.readexactly(4)
            (n,) = _LEN.unpack(head)
            if n > max_frame:
                raise ProtocolError(frame_too_large(head, n, max_frame))
            return decode(await self.reader.readexactly(n)), []
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    def abort(self) -> None:
        """Close at once (RST), dropping whatever is buffered either way."""
        try:
            self.writer.transport.abort()
        except (RuntimeError, OSError, AttributeError):
            pass

    def close(self) -> None:
        try:
            transport = self.writer.transport
            self.writer.close()
            if transport.get_write_buffer_size():
                # A peer that does not read would keep the connection (and whoever awaits
                # drain()) forever: what it has not taken after CLOSE_LINGER is dropped.
                asyncio.get_running_loop().call_later(CLOSE_LINGER, transport.abort)
        except (RuntimeError, OSError):  # loop already closed
            pass


class SeqpacketChannel:
    """JSON messages with optional file descriptors over a Unix SEQPACKET socket.

    One message per packet. Reading is driven by ``loop.add_reader``: the
    receive queue holds ``(msg, fds)`` pairs, then ``None`` at EOF. At most
    ``_QUEUE_MAX`` messages wait unread (then the socket is not read until the
    consumer catches up). ``max_frame`` / ``max_fds`` bound one message: a larger
    one is a protocol error (the join phase uses HELLO_MAX and no descriptors).
    """

    _QUEUE_MAX = 64

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop,
                 max_frame: int = MAX_FRAME, max_fds: int = MAX_FDS, hold: bool = False) -> None:
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_FRAME)
        except OSError:
            pass
        self.sock = sock
        self.loop = loop
        self.max_frame, self.max_fds = max_frame, max_fds
        # received (msg, fds), a ProtocolError to raise, or None at EOF
        self._queue: asyncio.Queue[tuple[Message, list[int]] | ProtocolError | None] = asyncio.Queue()
        self._closed = False
        self._eof = False
        self._paused = False
        self._hold = hold             # read one message, then wait for release()
        loop.add_reader(sock.fileno(), self._on_readable)

    def release(self, max_frame: int = MAX_FRAME, max_fds: int = MAX_FDS) -> None:
        """End the join phase: read on, with these limits."""
        self.max_frame, self.max_fds = max_frame, max_fds
        self._hold = False
        if self._paused and not self._eof:
            self._paused = False
            self.loop.add_reader(self.sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        while True:
            if self._queue.qsize() >= (1 if self._hold else self._QUEUE_MAX):
                self._paused = True
                self.loop.remove_reader(self.sock.fileno())
                return
            try:
                data, fds, flags, _ = socket.recv_fds(self.sock, self.max_frame, max(self.max_fds, 1))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds, flags = b"", [], 0
            if not data:
                for fd in fds:
                    os.close(fd)
                self._finish()
                return
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) > self.max_fds:
                for fd in fds:
                    os.close(fd)
                self._queue.put_nowait(ProtocolError("control message too large (or too many descriptors)"))
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
            if not self._paused:
                self.loop.remove_reader(self.sock.fileno())
            self._paused = False
            self._queue.put_nowait(None)

    async def recv(self) -> tuple[Message, list[int]] | None:
        """Next ``(msg, fds)``; ``None`` at EOF. Raises ProtocolError on garbage."""
        item = await self._queue.get()
        if self._paused and not self._eof and not self._hold and self._queue.qsize() < self._QUEUE_MAX // 2:
            self._paused = False
            self.loop.add_reader(self.sock.fileno(), self._on_readable)
        if item is None:
            self._queue.put_nowait(None)  # every later recv sees EOF too
            return None
        if isinstance(item, ProtocolError):
            raise item
        return item

    async def send(self, msg: Message, fds: list[int] | tuple[int, ...] = ()) -> None:
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

    def send_nowait(self, msg: Message) -> bool:
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
        fut: asyncio.Future[None] = self.loop.create_future()
        fd = self.sock.fileno()

        def writable() -> None:
            if not fut.done():
                fut.set_result(None)

        self.loop.add_writer(fd, writable)
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
            if not self._paused:
                self.loop.remove_reader(self.sock.fileno())
            self._paused = False
        while not self._queue.empty():   # descriptors nobody will read
            item = self._queue.get_nowait()
            if isinstance(item, tuple):
                for fd in item[1]:
                    os.close(fd)
        self._queue.put_nowait(None)
        self.sock.close()


# ------------------------------------------------------------ peer identity

_UCRED = struct.Struct("3i")   # struct ucred: pid, uid, gid


def _peercred(sock: socket.socket) -> tuple[int, int, int]:
    """SO_PEERCRED: the kernel's record of who connected (or who listened) at the
    other end of a Unix socket; never a peer's claim."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a connected Unix socket."""
    pid = _peercred(sock)[0]
    if pid <= 0:
        raise ProtocolError("the peer's pid is not visible (another pid namespace?)")
    return pid


def peer_uid(sock: socket.socket) -> int:
    return _peercred(sock)[1]


def _pidfd_pid(fd: int) -> int | None:
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def peer_pidfd(sock: socket.socket, pid: int) -> int:
    """A pidfd of the peer process of ``sock`` (``pid`` from :func:`peer_pid`).

    SO_PEERPIDFD (Linux >= 6.5) gives the pidfd of the very process that connected,
    with no pid-reuse window; older kernels fall back to ``os.pidfd_open(pid)``, which
    names whatever process has that pid now: if the peer died between connect() and
    this call and the pid was reused (by a process of a user we may write to), the
    pidfd names that process. That window is microseconds on a live peer.
    Raises ProtocolError if the peer is already gone or names another pid.
    """
    try:
        fd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        fd = -1
    if fd >= 0:
        got = _pidfd_pid(fd)
        if got == pid:
            return fd
        os.close(fd)
        raise ProtocolError(f"the peer's pidfd names pid {got}, SO_PEERCRED said {pid}")
    try:
        return os.pidfd_open(pid)
    except OSError as e:
        raise ProtocolError(f"cannot open a pidfd for the peer (pid {pid}): {e}") from None


def is_local_peer(peer: Any, local: Any) -> bool:   # Any: socket addresses, as typeshed's
    """True if a TCP peer is on this host: its address is 127.0.0.1 or ::1 (also as
    ::ffff:127.0.0.1), or equals the local address of the connection (a host connecting
    to one of its own addresses). Other loopback addresses (127.0.0.2, ...) do not count:
    tests use them to play a remote peer."""
    try:
        p = ipaddress.ip_address(peer[0].split("%")[0])
        l = ipaddress.ip_address(local[0].split("%")[0])
    except (TypeError, ValueError, IndexError, AttributeError):
        return False
    if isinstance(p, ipaddress.IPv6Address) and p.ipv4_mapped is not None:
        p = p.ipv4_mapped
    if isinstance(l, ipaddress.IPv6Address) and l.ipv4_mapped is not None:
        l = l.ipv4_mapped
    return p in (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")) or p == l


# ---------------------------------------------------------------- memfd checks

def memfd_stride(tensor_bytes: int) -> int:
    """Where tensor i starts in a cache's memfd (i * stride): its size rounded up to a
    page. Fixed by the descriptor, so a receiver maps exactly what the descriptor needs."""
    return -(-tensor_bytes // mmap.PAGESIZE) * mmap.PAGESIZE


def seal_memfd(fd: int) -> None:
    """Fix a memfd's size for good: no shrink (a peer's mapping would SIGBUS), no grow,
    no further seals (a peer could otherwise forbid writable mappings)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)


def check_memfd(fd: int, length: int) -> None:
    """A peer's memfd is safe to map ``length`` bytes of: a regular file of exactly
    ``length`` bytes, every page allocated (not sparse: mapping it cannot make us
    allocate the peer's memory), sealed against shrinking and growing."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise ProtocolError(f"the announced fd is not a sealable memfd: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError("the announced fd is not a memfd")
    need = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    if seals & need != need:
        raise ProtocolError("the announced memfd is not sealed against shrinking and growing")
    if st.st_size != length:
        raise ProtocolError(f"the announced memfd has {st.st_size} bytes, not {length}")
    if st.st_blocks * 512 < length:
        raise ProtocolError(f"the announced memfd is sparse ({st.st_blocks * 512} of {length} bytes allocated)")


def unix_listener() -> tuple[socket.socket, str]:
    """A listening abstract-namespace SEQPACKET socket with an unguessable name."""
    name = "kvengine/" + secrets.token_hex(12)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.bind("\0" + name)
    sock.listen(1024)   # a burst of peers joining at once (a full backlog fails their connect)
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
