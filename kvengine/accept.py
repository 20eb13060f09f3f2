"""The handshake, server side: the control listeners and every connection before it is a link.

Owns: the TCP control server, the Unix join socket, the one-time join tokens,
and the count of unauthenticated connections (:class:`Preauth`). Before a
peer authenticated it costs little and reserves nothing: hello-phase frames
are at most HELLO_MAX bytes (a larger length prefix closes the connection
unread), the phase lasts at most min(link_timeout, HELLO_PHASE_MAX), and the
cluster id is reserved only once the attach carried a valid proof. A link
that comes up is handed to the link manager (kvengine/links.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from typing import Any, Callable

from . import channels, control, kernel
from .control import ProtocolError
from .channels import SeqpacketChannel, StreamChannel
from .dataplane import UCX_SERVES, ucx_peer_serves
from .handshake import NO_SECRET_MSG, hello_problem, is_hex, is_ucx_address, peer_process, ucx_for_auto
from .link import Detached, Link, TaskSet
from .links import LinkManager
from .native import _native
from .status import LLMStatusCode as S, error_for
from .options import EngineOptions

__all__ = ["Acceptor", "Preauth"]

log = logging.getLogger("kvengine")


class Preauth:
    """Unauthenticated connections (TCP, and Unix before the join), counted per source
    (IP address; uid on the Unix socket).

    A newcomer whose source already has MAX_PREAUTH_PER_SOURCE waiting closes the
    oldest of them if that one waited PREAUTH_GRACE. Otherwise, once MAX_PREAUTH wait
    in all, it closes the oldest one of the busiest source: at once if that source has
    more waiting than the newcomer's would (a flood from some sources does not lock
    others out), else if that one waited PREAUTH_GRACE. If nothing may be closed (a
    burst of real peers: their handshakes take milliseconds), the newcomer waits as
    well, up to MAX_PREAUTH_BURST in all; beyond, it is closed at once.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._by_source: dict[Any, dict[Callable[[], None], float]] = {}
        self.count = 0
        self.refused = 0   # connections dropped before a valid hello

    def enter(self, source: Any, close: Callable[[], None]) -> tuple[Any, Callable[[], None]] | None:
        """Count a connection (``close`` closes it at once); its slot, or None: close it now."""
        now = self._loop.time()
        mine = len(self._by_source.get(source, ()))
        evict = None
        crowded: Any = None
        force = False
        if mine >= control.MAX_PREAUTH_PER_SOURCE:
            crowded = source
        elif self.count >= control.MAX_PREAUTH:
            crowded = max(self._by_source, key=lambda k: len(self._by_source[k]))
            force = len(self._by_source[crowded]) > mine + 1   # a heavier source pays, at once
        if crowded is not None:
            oldest, since = next(iter(self._by_source[crowded].items()))
            if force or now - since >= control.PREAUTH_GRACE:
                evict = (crowded, oldest)
            elif self.count >= control.MAX_PREAUTH_BURST:
                return None
        if evict is not None:
            self.leave(evict)
            evict[1]()   # its handler sees the EOF and counts it as refused
        self._by_source.setdefault(source, {})[close] = now
        self.count += 1
        return source, close

    def leave(self, slot: tuple[Any, Callable[[], None]] | None) -> None:
        if slot is None:
            return
        source, close = slot
        per = self._by_source.get(source)
        if per is not None and close in per:
            del per[close]
            self.count -= 1
            if not per:
                del self._by_source[source]


class _Joining:
    """A client that authenticated on TCP (attach) and was given a one-time join token
    for the Unix socket (local/shm), or whose TCP link is being set up."""

    __slots__ = ("cluster_id", "transport", "streams", "peer_token", "incarnation", "expiry", "peer_serves")

    def __init__(self, cluster_id: int, transport: str, streams: int, peer_token: str, incarnation: str) -> None:
        self.cluster_id = cluster_id
        self.transport = transport
        self.streams = streams
        self.peer_token = peer_token
        self.incarnation = incarnation
        self.expiry: asyncio.TimerHandle | None = None
        self.peer_serves = (False, False, False)   # ucx: the messages the client takes (ucx_peer_serves)


class Acceptor:
    """The listening side of links (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, core: _native.Core, options: EngineOptions,
                 cluster_id: int, host: str, token: str, incarnation: str, links: LinkManager,
                 tasks: TaskSet) -> None:
        self._loop = loop
        self._core = core
        self._options = options
        self._cluster_id = cluster_id
        self._host = host
        self._token = token
        self._incarnation = incarnation
        self._links = links
        self._tasks = tasks
        self._joins: dict[str, _Joining] = {}
        self.preauth = Preauth(loop)
        self._server: asyncio.AbstractServer | None = None
        self._unix: socket.socket | None = None
        self.unix_name = ""
        self._data_port: int | None = None

    async def start(self, listen: str | None) -> str | None:
        """Open the Unix join socket and, with ``listen``, the TCP control and data
        listeners; returns the control address (None without ``listen``)."""
        self._unix, self.unix_name = channels.unix_listener()
        self._loop.add_reader(self._unix.fileno(), self._on_unix_accept)
        if listen is None:
            return None
        host, port = control.parse_address(listen)
        # the backlog takes a burst of connections; unauthenticated ones are bounded once accepted
        try:
            self._server = await asyncio.start_server(self._on_tcp, host, port, backlog=1024)
        except OSError as e:   # port in use, address not on this host, unresolvable name
            raise error_for(S.LLM_LINK_FAILED, f"cannot listen on {listen!r}: {_os_error(e)}") from e
        sockname = self._server.sockets[0].getsockname()
        h = sockname[0]
        st, self._data_port = self._core.tcp_listen(h, 0)   # the TCP data plane
        if st:
            raise error_for(st, f"cannot listen for data connections on {h}")
        return f"[{h}]:{sockname[1]}" if ":" in h else f"{h}:{sockname[1]}"

    @property
    def data_port(self) -> int | None:
        return self._data_port

    def stop(self) -> None:
        """Stop accepting (connections in their handshake end on their own)."""
        if self._server is not None:
            self._server.close()
        if self._unix is not None:
            self._loop.remove_reader(self._unix.fileno())
            self._unix.close()
            self._unix = None

    async def wait_closed(self) -> None:
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except (asyncio.TimeoutError, RuntimeError):
                pass

    # ------------------------------------------------------------------ TCP

    def _hello_window(self) -> float:
        return min(self._options.link_timeout, control.HELLO_PHASE_MAX)

    async def _on_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ch = StreamChannel(reader, writer)
        peer, local = writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        slot = self.preauth.enter(peer[0] if isinstance(peer, tuple) else "?", ch.abort)
        if slot is None:
            self.preauth.refused += 1
            ch.abort()
            return
        joining = None
        reply: dict[str, Any] = {}
        keep = handed = False
        try:
            try:
                async with asyncio.timeout(self._hello_window()):
                    item = await ch.recv(control.HELLO_MAX)
                    if item is None:   # closed (or cut short, or evicted) before a whole hello
                        self.preauth.refused += 1
                        return
                    h = item[0]
                    reply, nonce = self._answer_hello(h, kernel.is_local_peer(peer, local))
                    await ch.send(reply)
                    if nonce is None:
                        return
                    item = await ch.recv(control.HELLO_MAX)
                    if item is None:
                        self.preauth.refused += 1
                        return
                    reply, joining = self._answer_attach(item[0], h, reply, nonce)
                    await ch.send(reply)
                    if joining is None:
                        return
            except (TimeoutError, ProtocolError, OSError) as e:
                self.preauth.refused += 1
                log.info("control connection dropped during hello: %s", e)
                return
            self.preauth.leave(slot)   # authenticated: the cluster id is reserved for it
            slot = None
            if joining.transport in ("tcp", "ucx"):
                handed = True   # _attach_tcp ends the reservation
                keep = await self._attach_tcp(ch, joining, reply)
            else:
                # The client joins over Unix; it keeps this connection open until the link
                # is up, and its EOF (or link_timeout) ends an unused reservation.
                async with asyncio.timeout(self._options.link_timeout):
                    await ch.recv(control.HELLO_MAX)
        except (TimeoutError, ProtocolError, OSError, KeyError, TypeError, ValueError) as e:
            log.info("control connection of cluster %s dropped: %s",
                     joining.cluster_id if joining else "?", e or type(e).__name__)
        finally:
            self.preauth.leave(slot)
            if not keep:
                ch.close()
            if joining is not None and joining.transport not in ("tcp", "ucx"):
                self._expire_join(reply.get("join"))
            elif joining is not None and not handed:   # the attached never reached the client
                self._links.release(joining.cluster_id)

    def _answer_hello(self, h: dict[str, Any], local_peer: bool) -> tuple[dict[str, Any], str | None]:
        """The reply to a hello and our nonce (None: the reply is a reject). Reserves nothing."""
        def reject(status: S, msg: str) -> tuple[dict[str, Any], None]:
            log.warning("refusing link from cluster %.40r: %s", h.get("cluster"), msg)
            return {"t": "reject", "status": int(status), "msg": msg}, None

        opts = self._options
        if h.get("t") != "hello":
            return reject(S.LLM_LINK_FAILED, f"expected a hello, got {h.get('t')!r}")
        if h.get("v") != control.PROTOCOL_VERSION:
            return reject(S.LLM_LINK_FAILED, f"protocol version {h.get('v')!r} not supported "
                                             f"(this engine speaks {control.PROTOCOL_VERSION})")
        problem = hello_problem(h)
        if problem is not None:
            return reject(S.LLM_PARAM_INVALID if problem.endswith("'cluster'") else S.LLM_LINK_FAILED,
                          problem)
        cid = h["cluster"]
        if cid == self._cluster_id:
            return reject(S.LLM_PARAM_INVALID, f"cluster id {cid} is this engine's own")
        busy = self._links.busy(cid)
        if busy is not None and not self._links.restarted(cid, h["inc"]):   # (decided after the proof)
            return reject(*busy)
        if h["auth"] != (opts.secret is not None):
            return reject(S.LLM_LINK_FAILED, "authentication mismatch: one engine has a secret, the other not")
        if opts.secret is None and not opts.insecure and not local_peer:
            return reject(S.LLM_LINK_FAILED, NO_SECRET_MSG)
        same_host = h["host"] == self._host
        same_process = same_host and h["process"] == control.process_tag()
        prefs = {h["transport"], opts.transport} - {"auto"}
        if len(prefs) > 1:
            return reject(S.LLM_LINK_FAILED, f"transports conflict: {sorted(prefs)}")
        want = prefs.pop() if prefs else None
        if want == "ucx":
            if not _native.UCX:
                return reject(S.LLM_FEATURE_NOT_ENABLED, "this engine was built without UCX")
            transport = "ucx"
        elif want == "tcp" or not same_host:
            if want in ("local", "shm"):
                return reject(S.LLM_LINK_FAILED, f"transport {want!r} needs both engines on one host")
            # auto across hosts: UCX when both ends have it and allow it (hello's "ucx")
            transport = "ucx" if want is None and h.get("ucx") is True and ucx_for_auto(opts) else "tcp"
        elif want == "local" or (want is None and same_process):
            if not same_process:
                return reject(S.LLM_LINK_FAILED, "transport 'local' needs both engines in one process")
            transport = "local"
        else:
            transport = "shm"
        if transport == "tcp" and self._data_port is None:
            return reject(S.LLM_LINK_FAILED, "this engine has no data port")
        nonce = control.new_nonce()
        return {"t": "welcome", "v": control.PROTOCOL_VERSION, "cluster": self._cluster_id,
                "transport": transport, "nonce": nonce, "streams": min(h["streams"], opts.tcp_streams),
                "inc": self._incarnation,
                "proof": (control.proof(opts.secret, "server", h["nonce"], nonce)
                          if opts.secret is not None else None)}, nonce

    def _answer_attach(self, msg: dict[str, Any], h: dict[str, Any], welcome: dict[str, Any],
                       nonce: str) -> tuple[dict[str, Any], _Joining | None]:
        """Check the attach's proof; then reserve the cluster id and say where to go next."""
        cid, transport = h["cluster"], welcome["transport"]

        def reject(status: S, why: str) -> tuple[dict[str, Any], None]:
            log.warning("refusing link from cluster %s: %s", cid, why)
            return {"t": "reject", "status": int(status), "msg": why}, None

        if msg.get("t") != "attach":
            return reject(S.LLM_LINK_FAILED, f"expected an attach, got {msg.get('t')!r}")
        if not control.check_proof(self._options.secret, msg.get("proof"), "client", nonce, h["nonce"]):
            return reject(S.LLM_LINK_FAILED, "authentication failed")
        ptoken = msg.get("ptoken") if transport == "local" else ""
        if not isinstance(ptoken, str) or len(ptoken) > 64:
            return reject(S.LLM_LINK_FAILED, "malformed attach: bad 'ptoken'")
        if self._links.restarted(cid, h["inc"]):
            # the same cluster id, another engine (a restart), and it proved the secret:
            # the old link is stale; its transfers fail and its tables go with it
            self._links.drop_stale(cid, h["inc"])
        busy = self._links.busy(cid)   # again: it may have changed since the hello
        if busy is not None:
            return reject(*busy)
        self._links.reserve(cid)
        joining = _Joining(cid, transport, welcome["streams"], ptoken, h["inc"])
        if transport == "ucx":
            st, address = self._links.data.ucx_address()
            if st or not is_ucx_address(msg.get("ucx")) or not is_hex(msg.get("ucx_token"), 2 * _native.UCX_TOKEN):
                self._links.release(cid)
                return reject(S.LLM_LINK_FAILED, "malformed attach: bad 'ucx'" if not st else
                              f"no UCX worker here (status {st:#x})")
            # the client's worker address and token (what our messages to it carry), and which
            # messages it takes (ucx_peer_serves), for _attach_tcp
            joining.peer_token = msg["ucx"] + ":" + msg["ucx_token"]
            joining.peer_serves = ucx_peer_serves(msg)
            return {"t": "attached", "ucx": address.hex(), **UCX_SERVES,
                    "ucx_token": secrets.token_hex(_native.UCX_TOKEN)}, joining
        if transport == "tcp":
            return {"t": "attached", "data_port": self._data_port,
                    "data_token": secrets.token_hex(_native.TOKEN_BYTES)}, joining
        token = control.new_nonce()
        joining.expiry = self._loop.call_later(self._options.link_timeout, self._expire_join, token)
        self._joins[token] = joining
        reply = {"t": "attached", "unix": self.unix_name, "join": token}
        if transport == "local":
            reply["ptoken"] = self._token
        return reply, joining

    def _expire_join(self, token: Any) -> None:
        joining = self._joins.pop(token, None) if isinstance(token, str) else None
        if joining is not None:
            if joining.expiry is not None:
                joining.expiry.cancel()
            self._links.release(joining.cluster_id)

    async def _attach_tcp(self, ch: StreamChannel, joining: _Joining, attached: dict[str, Any]) -> bool:
        """Server side of a TCP link after a valid attach: the data link, then the tables."""
        cid, streams, data_token = joining.cluster_id, joining.streams, attached.get("data_token", "")
        link = None
        try:
            link = Link(cid, ch, joining.transport, 0, "", "", incarnation=joining.incarnation)
            if joining.transport == "ucx":
                address, tx = joining.peer_token.split(":")
                self._links.data.add_ucx_link(link, bytes.fromhex(address), bytes.fromhex(attached["ucx_token"]),
                                              bytes.fromhex(tx), joining.peer_serves)
            else:
                self._links.data.add_data_link(link, data_token, streams)
            async with asyncio.timeout(self._options.link_timeout):
                if await self._links.establish(link, False) == S.LLM_SUCCESS:
                    link = None
                    return True
            return False
        finally:
            self._links.release(cid)
            if link is not None:
                link.ch = Detached(ch)   # the caller closes the channel itself
                self._links.abandon(link)

    # ----------------------------------------------------------------- Unix

    def _on_unix_accept(self) -> None:
        while self._unix is not None:
            try:
                sock, _ = self._unix.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("unix accept failed: %s", e)
                return
            # the join phase: one small message, no descriptors
            ch = SeqpacketChannel(sock, self._loop, max_frame=control.HELLO_MAX, max_fds=0, hold=True)
            try:
                source = f"unix:{kernel.peer_uid(sock)}"
            except OSError:
                source = "unix:?"
            slot = self.preauth.enter(source, ch.close)
            if slot is None:
                self.preauth.refused += 1
                ch.close()
                continue
            self._tasks.spawn(self._on_unix_conn(ch, slot))

    async def _on_unix_conn(self, ch: SeqpacketChannel, slot: tuple[Any, Callable[[], None]] | None) -> None:
        keep = False
        link = None
        pidfd = None
        joining = None
        try:
            async with asyncio.timeout(self._hello_window()):
                item = await ch.recv()
            if item is None:
                return
            msg = item[0]
            token = msg.get("token")
            joining = self._joins.pop(token, None) if msg.get("t") == "join" and isinstance(token, str) else None
            if joining is None:
                await ch.send({"t": "reject", "status": int(S.LLM_LINK_FAILED), "msg": "unknown join token"})
                return
            if joining.expiry is not None:
                joining.expiry.cancel()
            self.preauth.leave(slot)
            slot = None
            pid, pidfd = peer_process(ch.sock, joining.transport, joining.peer_token)
            ch.release()
            link = Link(joining.cluster_id, ch, joining.transport, pid, joining.peer_token, "", pidfd,
                        joining.incarnation)
            pidfd = None
            async with asyncio.timeout(self._options.link_timeout):
                keep = await self._links.establish(link, False) == S.LLM_SUCCESS
            if keep:
                link = None
        except (TimeoutError, ProtocolError, OSError, KeyError, TypeError, ValueError) as e:
            log.warning("link attach failed: %s", e)
        finally:
            self.preauth.leave(slot)
            if joining is not None:
                self._links.release(joining.cluster_id)
            if pidfd is not None:
                os.close(pidfd)
            if link is not None:
                link.ch = Detached(ch)
                self._links.abandon(link)
            if not keep:
                ch.close()


def _os_error(e: OSError) -> str:
    """``[Errno 98] Address already in use`` style text of an OSError."""
    if e.errno and e.errno > 0 and not isinstance(e, socket.gaierror):
        return f"[Errno {e.errno}] {os.strerror(e.errno)}"
    return str(e) or type(e).__name__
