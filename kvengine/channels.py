"""Control channels: length-prefixed JSON over TCP (``StreamChannel``), and JSON
plus file descriptors over a Unix SEQPACKET socket (``SeqpacketChannel``).

Owns: one socket each, its buffers and the descriptors received and not yet
taken. Every read is bounded (frame size, descriptor count); a frame that is
not a kvengine message closes the channel (kvengine/control.py has the format).
"""

from __future__ import annotations

import array
import asyncio
import collections
import fcntl
import os
import secrets
import socket
import struct
import termios

from .control import (CLOSE_LINGER, MAX_FDS, MAX_FRAME, Message, ProtocolError, decode, encode,
                      frame_too_large)

__all__ = ["StreamChannel", "SeqpacketChannel", "unix_listener", "unix_connect"]

_LEN = struct.Struct("!I")
_OUT_MAX = 64 << 20   # bytes of control messages a SeqpacketChannel queues for a peer that does not read


def _rights(fds: list[int] | tuple[int, ...]) -> list[tuple[int, int, array.array[int]]]:
    """sendmsg's ancillary data for passing ``fds`` (none: empty)."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []


class StreamChannel:
    """Length-prefixed JSON frames over an asyncio stream: the hello phase, and the
    whole control channel of a TCP-transport link."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._written = 0   # bytes given to the transport

    async def send(self, msg: Message, fds: list[int] | tuple[int, ...] = ()) -> None:
        if fds:
            raise ProtocolError("file descriptors cannot cross a TCP control connection")
        data = encode(msg)
        if len(data) > MAX_FRAME:
            raise ProtocolError(f"control message of {len(data)} bytes exceeds {MAX_FRAME}")
        try:
            self._write(data)
            await self.writer.drain()
        except (RuntimeError, OSError) as e:   # closed transport, reset
            raise ConnectionError(f"control channel: {e}") from None

    def send_nowait(self, msg: Message) -> None:
        """Queue a small message without waiting (the transport buffers it, in order)."""
        try:
            self._write(encode(msg))
        except (RuntimeError, OSError):
            pass   # closed: the reader reports the loss

    def _write(self, data: bytes) -> None:
        self.writer.write(_LEN.pack(len(data)) + data)
        self._written += 4 + len(data)

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

    def backlog(self) -> int:
        """Bytes written and not yet taken by the kernel (a peer that does not read)."""
        try:
            return int(self.writer.transport.get_write_buffer_size())
        except (RuntimeError, AttributeError):
            return 0

    def progress(self) -> tuple[int, int]:
        """(bytes the kernel took so far, bytes waiting in our buffer for room)."""
        waiting = self.backlog()
        return self._written - waiting, waiting

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

    Sending keeps order: a message the socket has no room for waits in ``_out``,
    and every later one (``send`` or ``send_nowait``) queues behind it; one writer
    callback flushes them when the socket drains. A peer that leaves more than
    ``_OUT_MAX`` bytes unread fails the link (a ProtocolError for ``recv``).
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
        self._peer_eof = False        # the peer shut its end (or the socket failed)
        self._shut = False            # we shut ours (shutdown_write)
        self._draining = False        # finish(): reading and dropping until the peer's EOF
        self._finished: asyncio.Future[None] | None = None
        # messages the socket had no room for yet, in order: (data, fds, sender's future or None)
        self._out: collections.deque[tuple[bytes, tuple[int, ...], asyncio.Future[None] | None]] = \
            collections.deque()
        self._out_bytes = 0
        self._handed = 0              # bytes the socket took so far (progress)
        self._writing = False         # _flush is registered as the socket's writer
        self._overrun = False         # more than _OUT_MAX queued: the link was told to fail
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
                self._peer_eof = True
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
        """Send ``msg`` (and ``fds``), after every message sent or queued before it; returns
        once the socket took it. Raises ConnectionError if the channel closes first."""
        if self._closed or self._shut:
            raise ConnectionError("channel closed")
        data = encode(msg)
        if len(data) > MAX_FRAME:
            raise ProtocolError(f"control message of {len(data)} bytes exceeds {MAX_FRAME}")
        if not self._out:
            try:
                if self._sendmsg(data, fds):
                    return
            except OSError as e:
                raise ConnectionError(f"control channel: {e}") from None
        fut: asyncio.Future[None] = self.loop.create_future()
        # our own duplicates of the descriptors: the caller's may be closed (and the numbers
        # reused) before the socket has room, and the peer must get these files
        self._enqueue(data, tuple(os.dup(fd) for fd in fds), fut)
        await fut   # (cancelled: the message is not sent)

    def send_nowait(self, msg: Message) -> None:
        """Send a small message now, or queue it behind those waiting: messages leave in
        the order they were given, whatever the socket's room (a notification overtaking
        an earlier one would be taken for a duplicate)."""
        if self._closed or self._shut:
            return
        data = encode(msg)
        if not self._out:
            try:
                if self._sendmsg(data, ()):
                    return
            except OSError:
                return   # the reader sees the EOF
        self._enqueue(data, (), None)

    def _sendmsg(self, data: bytes, fds: list[int] | tuple[int, ...]) -> bool:
        """One message into the socket: True if it took it, False if it has no room now
        (other errors raise OSError)."""
        try:
            self.sock.sendmsg([data], _rights(fds))
        except (BlockingIOError, InterruptedError):
            return False
        self._handed += len(data)
        return True

    def _enqueue(self, data: bytes, fds: tuple[int, ...], fut: asyncio.Future[None] | None) -> None:
        """Queue a message (``fds``: ours, closed once sent or dropped)."""
        self._out.append((data, fds, fut))
        self._out_bytes += len(data)
        if not self._writing:
            self._writing = True
            self.loop.add_writer(self.sock.fileno(), self._flush)
        if self._out_bytes > _OUT_MAX and not self._overrun and not self._eof:
            # a peer that leaves this much unread (a memory bound; the heartbeat's time bound
            # is links.py's): fail the link the way a bad message does (recv raises; the
            # link's two-step close still runs, the socket is not closed here)
            self._overrun = True
            self._queue.put_nowait(ProtocolError(
                f"the peer does not read its control channel: {self._out_bytes} bytes of messages queued"))

    def _flush(self) -> None:
        """Writable: send what is queued, in order, until the socket is full again."""
        while self._out:
            data, fds, fut = self._out[0]
            if fut is None or not fut.cancelled():
                try:
                    if not self._sendmsg(data, fds):
                        return
                except OSError as e:
                    self._drop_out(ConnectionError(f"control channel: {e}"))
                    return
                if fut is not None:
                    fut.set_result(None)
            self._out.popleft()
            self._out_bytes -= len(data)
            for fd in fds:
                os.close(fd)
        self._writing = False
        self.loop.remove_writer(self.sock.fileno())

    def _drop_out(self, exc: Exception) -> None:
        """Nothing queued will be sent: its senders get ``exc``."""
        if self._writing:
            self._writing = False
            self.loop.remove_writer(self.sock.fileno())
        out, self._out, self._out_bytes = self._out, collections.deque(), 0
        for _, fds, fut in out:
            for fd in fds:
                os.close(fd)
            if fut is not None and not fut.done():
                fut.set_exception(exc)

    def backlog(self) -> int:
        """Bytes not yet taken by the peer: in the socket's send queue (TIOCOUTQ) and
        queued here behind it."""
        if self._closed:
            return 0
        try:
            buf = array.array("i", [0])
            fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, buf)
            return buf[0] + self._out_bytes
        except OSError:
            return 0

    def progress(self) -> tuple[int, int]:
        """(bytes the socket took so far, bytes queued here for room)."""
        return self._handed, self._out_bytes

    def finish(self) -> asyncio.Future[None]:
        """The conversation is over, but the socket is not closed yet: nothing more is
        received (what arrives is dropped) or sent; once :meth:`shutdown_write` was called
        and the peer shut its end too (it reads our EOF; we read its), the socket closes and
        the future is done. So each end learns when the other has finished: a shm peer shuts
        its end only once none of its copies into our memory can still run (links.py,
        "link_down"). :meth:`close` ends it at once."""
        if self._finished is None:
            self._finished = self.loop.create_future()
            self._stop_reading()
            if self._closed:
                self._finished.set_result(None)
            elif not self._peer_eof:
                self._draining = True
                self.loop.add_reader(self.sock.fileno(), self._drain)
        return self._finished

    def shutdown_write(self) -> None:
        """Send EOF (nothing more from us); after :meth:`finish`, close once the peer did too."""
        if self._closed or self._shut:
            return
        self._shut = True
        self._drop_out(ConnectionError("channel shut"))
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        if self._peer_eof and self._finished is not None:
            self.close()

    def _drain(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, MAX_FRAME, MAX_FDS)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            for fd in fds:
                os.close(fd)
            if not data:
                self._peer_eof = True
                self._draining = False
                self.loop.remove_reader(self.sock.fileno())
                if self._shut:
                    self.close()
                return

    def _stop_reading(self) -> None:
        """No more messages for recv(): it sees EOF; descriptors queued unread are closed."""
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

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._drop_out(ConnectionError("channel closed"))
        self._stop_reading()
        if self._draining:
            self._draining = False
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        if self._finished is not None and not self._finished.done():
            self._finished.set_result(None)



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
