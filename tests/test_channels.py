"""The shm control channel keeps its messages in order when its socket is full
(kvengine/channels.py SeqpacketChannel): a message that finds no room waits, and every
later one queues behind it, whether sent with ``send`` or ``send_nowait``. Before, a
``send_nowait`` that found the socket full refused the message (the notifier then sent
it from a task of its own), later ones overtook it once the peer read, and the
receiver took the late notifications for duplicates and dropped them; two ``send``
calls waiting on a full socket at once replaced each other's writer callback, and one
of them never returned."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from kvengine.channels import SeqpacketChannel
from kvengine.control import ProtocolError, decode, encode


def _pair(loop: asyncio.AbstractEventLoop) -> tuple[SeqpacketChannel, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.setblocking(False)
    return SeqpacketChannel(a, loop), b


def _fill(ch: SeqpacketChannel) -> int:
    """Packets written straight into the channel's socket until it has no room."""
    n = 0
    pad = encode({"t": "pad", "x": "." * 200})
    while True:
        try:
            ch.sock.send(pad)
        except BlockingIOError:
            return n
        n += 1


async def _read(peer: socket.socket, count: int, timeout: float = 10.0) -> list[dict]:
    """The next ``count`` non-pad messages the peer end receives (bounded)."""
    loop = asyncio.get_running_loop()
    got: list[dict] = []

    async def run() -> None:
        while len(got) < count:
            data = await loop.sock_recv(peer, 1 << 16)
            assert data, "EOF before every message arrived"
            msg = decode(data)
            if msg["t"] != "pad":
                got.append(msg)
    await asyncio.wait_for(run(), timeout)
    return got


async def test_messages_queued_behind_a_full_socket_leave_in_order():
    loop = asyncio.get_running_loop()
    ch, peer = _pair(loop)
    try:
        assert _fill(ch) > 0
        assert ch.backlog() > 0
        order = []
        waiting = []
        for i in range(30):   # alternate: notifications (send_nowait) and awaited sends
            if i % 3 == 2:
                waiting.append(asyncio.ensure_future(ch.send({"t": "m", "i": i})))
                await asyncio.sleep(0)   # its task runs up to its wait: queued now, in its turn
            else:
                ch.send_nowait({"t": "m", "i": i})   # queued, never refused
            order.append(i)
        await asyncio.sleep(0)   # the awaited sends start (and find the queue)
        assert not any(w.done() for w in waiting)
        handed, waiting_bytes = ch.progress()
        assert waiting_bytes > 0 and ch.backlog() >= waiting_bytes
        got = await _read(peer, len(order))
        assert [m["i"] for m in got] == order
        await asyncio.wait_for(asyncio.gather(*waiting), 5)   # every awaited send returned
        assert ch.backlog() == 0
        assert ch.progress()[0] > handed and ch.progress()[1] == 0
    finally:
        ch.close()
        peer.close()


async def test_a_send_cancelled_while_queued_is_not_sent_and_the_rest_are():
    loop = asyncio.get_running_loop()
    ch, peer = _pair(loop)
    try:
        _fill(ch)
        first = asyncio.ensure_future(ch.send({"t": "m", "i": 0}))
        dropped = asyncio.ensure_future(ch.send({"t": "m", "i": 1}))
        await asyncio.sleep(0)   # both queued
        ch.send_nowait({"t": "m", "i": 2})
        dropped.cancel()
        got = await _read(peer, 2)
        assert [m["i"] for m in got] == [0, 2]
        await asyncio.wait_for(first, 5)
        assert dropped.cancelled()
    finally:
        ch.close()
        peer.close()


async def test_close_fails_the_queued_sends_instead_of_leaving_them_waiting():
    loop = asyncio.get_running_loop()
    ch, peer = _pair(loop)
    try:
        _fill(ch)
        waiting = [asyncio.ensure_future(ch.send({"t": "m", "i": i})) for i in range(3)]
        await asyncio.sleep(0)
        ch.close()
        for w in waiting:
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(w, 5)
    finally:
        ch.close()
        peer.close()


async def test_a_peer_that_reads_nothing_fails_the_channel_at_the_bound(monkeypatch):
    import kvengine.channels as channels
    monkeypatch.setattr(channels, "_OUT_MAX", 64 << 10)
    loop = asyncio.get_running_loop()
    ch, peer = _pair(loop)
    try:
        _fill(ch)
        for i in range(1000):   # ~100 KiB queued: over the (lowered) bound
            ch.send_nowait({"t": "m", "i": i, "x": "y" * 64})
        with pytest.raises(ProtocolError, match="does not read its control channel"):
            await asyncio.wait_for(ch.recv(), 5)
    finally:
        ch.close()
        peer.close()


async def _recv_fds(peer: socket.socket) -> tuple[bytes, list[int]]:
    loop = asyncio.get_running_loop()
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(peer, 1 << 16, 4)
            return data, fds
        except BlockingIOError:
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_reader(peer.fileno(), lambda: ready.done() or ready.set_result(None))
            try:
                await ready
            finally:
                loop.remove_reader(peer.fileno())


async def test_descriptors_queued_behind_a_full_socket_are_the_files_given():
    """A message with descriptors that waits for room carries the files it was given,
    even if the caller's descriptor numbers are closed and reused meanwhile."""
    loop = asyncio.get_running_loop()
    ch, peer = _pair(loop)
    pipes: list[int] = []
    try:
        _fill(ch)
        r, w = os.pipe()
        os.set_blocking(r, False)
        pipes += [r]
        sending = asyncio.ensure_future(ch.send({"t": "m", "i": 0}, [w]))
        await asyncio.sleep(0)   # queued
        os.close(w)
        pipes += os.pipe()       # takes w's number (the lowest free)
        got_fd = None
        while got_fd is None:
            data, fds = await asyncio.wait_for(_recv_fds(peer), 5)
            if decode(data)["t"] == "m":
                got_fd = fds[0]
        pipes.append(got_fd)
        await asyncio.wait_for(sending, 5)
        os.write(got_fd, b"x")   # the received descriptor is the first pipe's write end
        assert os.read(r, 1) == b"x"
    finally:
        for fd in pipes:
            os.close(fd)
        ch.close()
        peer.close()


async def test_control_stalled_counts_the_time_the_peer_took_nothing_while_we_waited():
    """Link.control_stalled (the heartbeat fails a link at heartbeat_timeout of it): only time
    with messages waiting in our queue and no byte taken by the peer counts."""
    from kvengine.link import Link

    class Fake:
        now = (0, 0)

        def progress(self) -> tuple[int, int]:
            return self.now

    ch = Fake()
    link = Link(9, ch, "tcp", 0, "", "127.0.0.1:1")   # type: ignore[arg-type]
    looks = [((0, 4096), 5.0, 0.0),    # the first look only starts the clock
             ((100, 0), 10.0, 0.0),    # nothing waits
             ((100, 50), 11.0, 1.0),   # waiting, nothing taken since the last look
             ((100, 80), 13.0, 3.0),
             ((150, 30), 14.0, 0.0),   # the peer took some: not stalled
             ((150, 30), 15.0, 1.0),
             ((150, 0), 20.0, 0.0)]    # all taken
    for progress, now, want in looks:
        ch.now = progress
        assert link.control_stalled(now) == want, (progress, now)
