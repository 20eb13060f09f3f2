"""Hostile peers for the tests, written from docs/protocol.md (raw sockets; no kvengine import).

Control plane (TCP frames: 4-byte big-endian length, then UTF-8 JSON)::

    frame(msg)                      -> bytes: one length-prefixed frame (msg: dict, or raw body bytes)
    hello(cluster, **fields)        -> dict: a valid hello; a field given as DROP is left out
    proof(secret, label, *nonces)   -> str: the HMAC-SHA256 challenge response
    ctl = await Control.open(address, source=None)    raw TCP control connection ("host:port";
                                    source: the local IP to connect from, e.g. "127.0.0.2")
        ctl.send(msg_or_bytes)      a dict goes out as one frame, bytes exactly as given
        await ctl.recv(timeout=5)   -> next frame as a dict (pings skipped), None at EOF
        await ctl.closed(timeout=5) -> True once the peer closed or reset the connection
        ctl.close()

Authenticated handshake as a client (hello -> welcome -> attach -> attached, then for shm
the join over the server's Unix socket)::

    s = await handshake(address, cluster, secret=None, transport="tcp" | "shm", streams=1,
                        source=None, **hello_fields)
        s.ch           the link's control channel: the Control (tcp) or a Unix channel (shm)
        s.tcp          the TCP Control of the hello (for shm it stays open until s.close())
        s.welcome, s.attached   the server's messages as received
        s.data_port, s.data_token (bytes)   tcp only: where the data streams go, and their token
        await s.read_table(timeout=5, keep_fds=False) -> {cache id: cache_add msg} of the server,
                       up to "ready" (keep_fds: a memfd comes as msg["fds"], for the caller to close)
        await s.finish(table=(), timeout=5)  send our cache_adds (dicts, or (dict, [fds])) and
                       "ready", then wait for "up" (tcp: open the data streams first)
        await s.link(table=(), timeout=5, keep_fds=False)    read_table + (tcp: open s.streams data streams
                       and wait for every HELLO_ACK; kept in s.data) + finish; returns the table
        s.keepalive(interval=0.25)           ping in the background (the server's heartbeat)
        await s.recv(timeout=5) / s.send(msg, fds=())   on s.ch
        s.close()

    A Unix channel (Unix) has ``await send(msg, fds=())`` and ``await recv(timeout=5)`` ->
    ``(msg, fds)`` or None at EOF (pings skipped), and ``close()``. ``unix_connect(name)``
    opens one to an abstract name.

    An engine that speaks the older protocol (the welcome carries "unix" or "data_port")
    is followed too: attach with the welcome's token, over Unix for shm. Tests use this to
    show what an old engine let a peer do.

Data plane (tcp links; 64-byte little-endian headers)::

    header(ftype, region=0, xfer=0, offset=0, length=0, total=0, flags=0, status=0,
           region2=0, offset2=0) -> bytes (64)
    parse(hdr64) -> dict of the same field names plus "magic" and "type"
    d = await Data.open(host, port, token=None, ack=True)  connect; with a token send HELLO
                                    (and, with ack, wait for HELLO_ACK; frames before it are
                                    kept and come first from recv_frame)
        d.send(bytes); await d.recv_frame(timeout=5) -> (hdr dict, payload) or None at EOF
        (payload: HELLO, DATA, RDATA carry ``length`` bytes); await d.closed(timeout); d.close()

Every connection made here is in ``OPEN`` until closed; ``close_all()`` closes the rest
(a test's teardown, so that a failed assertion leaves no socket behind).
Every wait is bounded (``timeout``); nothing here sleeps to synchronise.
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

__all__ = ["OPEN", "close_all", "DROP", "frame", "hello", "proof", "host_identity", "Control", "Unix", "unix_connect",
           "Session", "handshake", "header", "parse", "Data", "MAGIC", "HELLO", "HELLO_ACK", "DATA",
           "ACK", "ABORT", "ABORT_ACK", "READ", "RDATA", "RERR", "CREDIT", "LEASE_REQ", "LEASE",
           "HandshakeRefused"]

DROP = object()
_LEN = struct.Struct("!I")
_HDR = struct.Struct("<IHHIIQQQQIIQ")
MAGIC = 0x3145564B
(HELLO, HELLO_ACK, DATA, ACK, ABORT, ABORT_ACK, READ, RDATA, RERR, CREDIT, LEASE_REQ,
 LEASE) = range(1, 13)
_WITH_PAYLOAD = (HELLO, DATA, RDATA)


class HandshakeRefused(Exception):
    """The server answered with a reject (``.msg``: the reject) or closed."""

    def __init__(self, msg: dict | None) -> None:
        super().__init__(f"refused: {msg!r}")
        self.msg = msg


def frame(msg) -> bytes:
    body = msg if isinstance(msg, (bytes, bytearray)) else json.dumps(msg, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


PROTOCOL_VERSION = 3   # docs/protocol.md


def host_identity() -> str:
    """The engine's host identity string: boot id, net and pid namespace inodes."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        parts = [f.read().strip()]
    for ns in ("net", "pid"):
        parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
    return ":".join(parts)


def hello(cluster: int, **fields) -> dict:
    msg = {"t": "hello", "v": PROTOCOL_VERSION, "cluster": cluster, "role": 1, "host": host_identity(),
           "transport": "auto", "streams": 1, "auth": False, "nonce": secrets.token_hex(16),
           "process": secrets.token_hex(16), "inc": secrets.token_hex(8)}
    msg.update(fields)
    return {k: v for k, v in msg.items() if v is not DROP}


def proof(secret: bytes, label: str, *nonces: str) -> str:
    mac = hmac.new(secret, label.encode(), hashlib.sha256)
    for n in nonces:
        mac.update(b"\0" + n.encode())
    return mac.hexdigest()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


OPEN: set = set()   # connections not closed yet (close_all() closes them: test teardown)


def close_all() -> None:
    for c in list(OPEN):
        c.close()


class _Stream:
    """A raw TCP connection of a test: closed by close() or close_all()."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        OPEN.add(self)

    async def closed(self, timeout: float = 5.0) -> bool:
        """Read and drop until EOF/reset; False if the connection is still open after timeout."""
        try:
            async with asyncio.timeout(timeout):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:
            return False
        except ConnectionError:
            pass
        return True

    def close(self) -> None:
        OPEN.discard(self)
        self.writer.close()


class Control(_Stream):
    """A raw TCP control connection."""

    @classmethod
    async def open(cls, address: str, source: str | None = None) -> "Control":
        host, port = _split(address)
        r, w = await asyncio.open_connection(host, port, local_addr=(source, 0) if source else None)
        return cls(r, w)

    def send(self, msg) -> None:
        self.writer.write(msg if isinstance(msg, (bytes, bytearray)) else frame(msg))

    async def recv(self, timeout: float = 5.0, skip=("ping",)) -> dict | None:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    (n,) = _LEN.unpack(await self.reader.readexactly(4))
                    msg = json.loads(await self.reader.readexactly(n))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return None
                if msg.get("t") not in skip:
                    return msg



async def _readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_reader(sock.fileno())


class Unix:
    """A Unix SEQPACKET control channel: one JSON message per packet, fds in SCM_RIGHTS."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        OPEN.add(self)

    async def send(self, msg: dict, fds=()) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        data = json.dumps(msg, separators=(",", ":")).encode()
        while True:
            try:
                self.sock.sendmsg([data], anc)
                return
            except BlockingIOError:
                loop = asyncio.get_running_loop()
                fut = loop.create_future()
                loop.add_writer(self.sock.fileno(), lambda: fut.done() or fut.set_result(None))
                try:
                    await asyncio.wait_for(fut, 5)
                finally:
                    loop.remove_writer(self.sock.fileno())

    async def recv(self, timeout: float = 5.0, skip=("ping",)):
        async with asyncio.timeout(timeout):
            while True:
                try:
                    data, fds, _, _ = socket.recv_fds(self.sock, 4 << 20, 16)
                except BlockingIOError:
                    await _readable(self.sock)
                    continue
                except ConnectionError:
                    return None
                if not data:
                    return None
                msg = json.loads(data)
                if msg.get("t") in skip:
                    for fd in fds:
                        os.close(fd)
                    continue
                return msg, fds

    def close(self) -> None:
        OPEN.discard(self)
        self.sock.close()


async def unix_connect(name: str) -> Unix:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, "\0" + name)
    except BaseException:
        sock.close()
        raise
    return Unix(sock)


class Session:
    """A client link in the making (see the module docstring)."""

    def __init__(self, tcp: Control, ch, transport: str, welcome: dict, attached: dict | None,
                 address: str, streams: int) -> None:
        self.tcp, self.ch, self.transport = tcp, ch, transport
        self.welcome, self.attached = welcome, attached
        src = attached if attached is not None and "data_port" in attached else welcome
        self.data_port = src.get("data_port")
        self.data_token = bytes.fromhex(src["data_token"]) if src.get("data_token") else None
        self.host = _split(address)[0]
        self.streams = streams
        self.data: list[Data] = []
        self._pinger: asyncio.Task | None = None

    async def send(self, msg: dict, fds=()) -> None:
        if isinstance(self.ch, Unix):
            await self.ch.send(msg, fds)
        else:
            self.ch.send(msg)
            await self.ch.writer.drain()

    async def recv(self, timeout: float = 5.0):
        """Next message on the link's channel (pings skipped): a dict, or None at EOF.
        (On a Unix channel the fds that came with it are closed.)"""
        item = await self.ch.recv(timeout)
        if item is None or isinstance(item, dict):
            return item
        msg, fds = item
        for fd in fds:
            os.close(fd)
        return msg

    async def read_table(self, timeout: float = 5.0, keep_fds: bool = False) -> dict[int, dict]:
        """The server's cache_adds up to "ready". keep_fds: a message that came with
        descriptors gets them as msg["fds"] (the caller closes them); else they are closed."""
        table = {}
        async with asyncio.timeout(timeout):
            while True:
                if keep_fds and isinstance(self.ch, Unix):
                    item = await self.ch.recv(timeout)
                    msg = item and dict(item[0], fds=item[1]) if item and item[1] else item and item[0]
                else:
                    msg = await self.recv(timeout)
                if msg is None or msg["t"] == "reject":
                    raise HandshakeRefused(msg)
                if msg["t"] == "ready":
                    return table
                if msg["t"] == "cache_add":
                    table[msg["id"]] = msg

    async def finish(self, table=(), timeout: float = 5.0) -> None:
        try:
            for item in table:
                msg, fds = item if isinstance(item, tuple) else (item, ())
                await self.send(msg, fds)
            await self.send({"t": "ready"})
        except OSError:   # the server already dropped us
            raise HandshakeRefused(None) from None
        msg = await self.recv(timeout)
        if msg is None or msg["t"] != "up":
            raise HandshakeRefused(msg)

    async def link(self, table=(), timeout: float = 5.0, keep_fds: bool = False) -> dict[int, dict]:
        theirs = await self.read_table(timeout, keep_fds)
        if self.transport == "tcp":
            for _ in range(self.streams):
                self.data.append(await Data.open(self.host, self.data_port, self.data_token,
                                                 timeout=timeout))
        await self.finish(table, timeout)
        return theirs

    def keepalive(self, interval: float = 0.25) -> None:
        async def beat():
            while True:
                await self.send({"t": "ping"})
                await asyncio.sleep(interval)   # a heartbeat period, not a synchronisation
        self._pinger = asyncio.ensure_future(beat())

    def close(self) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
        for d in self.data:
            d.close()
        self.ch.close()
        if self.tcp is not self.ch:
            self.tcp.close()


async def handshake(address: str, cluster: int, secret: bytes | None = None, transport: str = "tcp",
                    streams: int = 1, source: str | None = None, timeout: float = 5.0,
                    **hello_fields) -> Session:
    """Link as cluster ``cluster`` up to the cache tables (see the module docstring).
    Raises HandshakeRefused with the server's reject (or None if it closed)."""
    tcp = await Control.open(address, source)
    ok = False
    try:
        h = hello(cluster, transport=transport, streams=streams, auth=secret is not None, **hello_fields)
        tcp.send(h)
        w = await tcp.recv(timeout)
        if w is None or w.get("t") != "welcome":
            raise HandshakeRefused(w)
        cn, sn = h["nonce"], str(w.get("nonce"))
        if secret is not None and w.get("proof") != proof(secret, "server", cn, sn):
            raise HandshakeRefused({"t": "reject", "msg": "the server's proof is wrong", "welcome": w})
        p = proof(secret, "client", sn, cn) if secret is not None else None
        tr = w.get("transport")
        if "unix" in w or "data_port" in w:   # older protocol: everything came with the welcome
            attach = {"t": "attach", "token": w.get("token"), "proof": p}
            if tr == "tcp":
                tcp.send(attach)
                s = Session(tcp, tcp, tr, w, None, address, int(w.get("streams", streams)))
            else:
                u = await unix_connect(w["unix"])
                await u.send(attach)
                s = Session(tcp, u, tr, w, None, address, streams)
            ok = True
            return s
        tcp.send({"t": "attach", "proof": p, "ptoken": secrets.token_hex(16)})
        a = await tcp.recv(timeout)
        if a is None or a.get("t") != "attached":
            raise HandshakeRefused(a)
        if tr == "tcp":
            s = Session(tcp, tcp, tr, w, a, address, int(w.get("streams", streams)))
        else:
            u = await unix_connect(a["unix"])
            await u.send({"t": "join", "token": a["join"]})
            s = Session(tcp, u, tr, w, a, address, streams)
        ok = True
        return s
    finally:
        if not ok:
            tcp.close()


# ------------------------------------------------------------------------ data plane

def header(ftype: int, region: int = 0, xfer: int = 0, offset: int = 0, length: int = 0,
           total: int = 0, flags: int = 0, status: int = 0, region2: int = 0, offset2: int = 0) -> bytes:
    return _HDR.pack(MAGIC, ftype, flags, status, region, xfer, offset, length, total, region2, 0, offset2)


def parse(hdr: bytes) -> dict:
    (magic, ftype, flags, status, region, xfer, offset, length, total, region2, _pad,
     offset2) = _HDR.unpack(hdr)
    return {"magic": magic, "type": ftype, "flags": flags, "status": status, "region": region,
            "xfer": xfer, "offset": offset, "length": length, "total": total, "region2": region2,
            "offset2": offset2}


class Data(_Stream):
    """A raw data-plane connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.early: list = []   # frames that came before the HELLO_ACK (recv_frame returns them first)

    @classmethod
    async def open(cls, host: str, port: int, token: bytes | None = None, ack: bool = True,
                   timeout: float = 5.0) -> "Data":
        r, w = await asyncio.open_connection(host, port)
        d = cls(r, w)
        if token is not None:
            d.send(header(HELLO, length=len(token)) + token)
            while ack:
                item = await d._read(timeout)
                if item is None:
                    d.close()
                    raise HandshakeRefused({"data": None})
                if item[0]["type"] == HELLO_ACK:
                    break
                d.early.append(item)
        return d

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def recv_frame(self, timeout: float = 5.0):
        if self.early:
            return self.early.pop(0)
        return await self._read(timeout)

    async def _read(self, timeout: float):
        async with asyncio.timeout(timeout):
            try:
                hdr = parse(await self.reader.readexactly(64))
                payload = (await self.reader.readexactly(hdr["length"])
                           if hdr["type"] in _WITH_PAYLOAD else b"")
            except (asyncio.IncompleteReadError, ConnectionError):
                return None
        return hdr, payload

