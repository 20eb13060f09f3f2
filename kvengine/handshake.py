"""The handshake, client side (``link_clusters``), and the checks both sides share.

A link is set up over TCP (hello, welcome, attach, attached: the peer
authenticates before it learns anything or reserves its cluster id); on one
host it then moves to a Unix SEQPACKET socket (join; memfds travel there, the
peer's pid comes from SO_PEERCRED), across hosts (or with ``transport="tcp"``)
the TCP connection stays the control channel and the native core opens
``tcp_streams`` data connections; with ``transport="ucx"`` it stays the control
channel too, and attach / attached carry each end's UCP worker address (``ucx``).
"auto" across hosts is ucx when both ends allow it (hello's ``ucx``, ``ucx_for_auto``).
 Without a secret only peers on this host may
link (``EngineOptions.insecure`` lifts that). Protocol: docs/protocol.md.

Owns: nothing beyond one handshake's locals. A link that comes up is handed
to the link manager (kvengine/links.py); the server side is kvengine/accept.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from typing import Any, Callable, Sequence

from . import channels, control, kernel
from .control import ProtocolError
from .dataplane import UCX_SERVES, ucx_peer_serves
from .channels import SeqpacketChannel, StreamChannel
from .link import Link
from .links import LinkManager
from .native import _native
from .registry import LOCAL_REGISTRIES
from .status import LLMStatusCode as S, LinkResult, overall, to_status
from .tables import int_in
from .options import EngineOptions
from .types import ClusterInfo, Role

__all__ = ["Dialer", "hello_problem", "peer_process", "NO_SECRET_MSG", "TRANSPORTS", "is_hex", "ucx_for_auto"]

log = logging.getLogger("kvengine")

_U64 = 2**64 - 1
TRANSPORTS = ("auto", "local", "shm", "tcp", "ucx")
UCX_ADDR_HEX = 2 * 16384   # the longest UCP worker address we take (KV_UCX_MAX_BLOB), in hex
NO_SECRET_MSG = ("without a secret an engine links only with engines on its own host: set "
                 "EngineOptions.secret (or KVENGINE_SECRET) on both engines, or "
                 "EngineOptions(insecure=True) to link without authentication")


def is_hex(v: Any, n: int) -> bool:
    if not isinstance(v, str) or len(v) != n:
        return False
    try:
        bytes.fromhex(v)
    except ValueError:
        return False
    return True


def is_ucx_address(v: Any) -> bool:
    return isinstance(v, str) and 2 <= len(v) <= UCX_ADDR_HEX and is_hex(v, len(v))


def rdma_devices() -> list[str]:
    """This host's RDMA devices (InfiniBand / RoCE / iWARP), as the kernel lists them."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def ucx_for_auto(opts: EngineOptions) -> bool:
    """What this engine says in hello's ``ucx``: "auto" may pick UCX with it across hosts
    (built with UCX, and ``auto_ucx`` True, or None with an RDMA device here)."""
    if not _native.UCX or opts.auto_ucx is False:
        return False
    return opts.auto_ucx is True or bool(rdma_devices())


def hello_problem(h: dict[str, Any]) -> str | None:
    """What is malformed in a hello (None: nothing). Unknown fields are ignored."""
    checks: tuple[tuple[str, Callable[[Any], bool]], ...] = (("cluster", lambda v: int_in(v, 0, _U64)), ("role", lambda v: int_in(v, 0, 2**31)),
              ("host", lambda v: isinstance(v, str) and len(v) <= 256),
              ("process", lambda v: isinstance(v, str) and len(v) <= 64),
              ("transport", lambda v: v in TRANSPORTS),
              ("streams", lambda v: int_in(v, 1, _native.MAX_STREAMS)),
              ("auth", lambda v: isinstance(v, bool)), ("nonce", lambda v: is_hex(v, 32)),
              ("inc", lambda v: is_hex(v, 16)))
    for name, ok in checks:
        if name not in h:
            return f"malformed hello: no {name!r}"
        if not ok(h[name]):
            return f"malformed hello: bad {name!r}"
    if not isinstance(h.get("ucx", False), bool):   # optional (engines before issue 14 omit it)
        return "malformed hello: bad 'ucx'"
    return None


def peer_process(sock: socket.socket, transport: str, ptoken: str) -> tuple[int, int | None]:
    """The peer process at the other end of a Unix link socket, from the kernel (never the
    peer's word): ``(pid, pidfd)``. "local" must be this very process and ``ptoken`` one
    of its engines (no pidfd then); "shm" gets a pidfd for CMA."""
    pid = kernel.peer_pid(sock)
    if transport == "local":
        if pid != os.getpid() or ptoken not in LOCAL_REGISTRIES:
            raise ProtocolError("transport 'local' but the peer is not an engine of this process")
        return pid, None
    return pid, kernel.peer_pidfd(sock, pid)


class _Failed(Exception):
    """The handshake ends with this result (its reason is logged once, by link_one)."""

    def __init__(self, result: LinkResult) -> None:
        self.result = result


def _fail(status: S, reason: str) -> _Failed:
    return _Failed(LinkResult(status, reason))


class Dialer:
    """``link_clusters``: the client side of the handshake, many peers in parallel."""

    def __init__(self, loop: asyncio.AbstractEventLoop, options: EngineOptions, cluster_id: int, role: Role,
                 host: str, token: str, incarnation: str, links: LinkManager) -> None:
        self._loop = loop
        self._options = options
        self._cluster_id = cluster_id
        self._role = role
        self._host = host
        self._token = token
        self._incarnation = incarnation
        self._links = links

    async def link_clusters(self, clusters: Sequence[Any], timeout: float) -> tuple[S, list[LinkResult]]:
        if isinstance(clusters, ClusterInfo) or not isinstance(clusters, (list, tuple)) or not clusters:
            return S.LLM_PARAM_INVALID, []
        ids = [c.remote_cluster_id for c in clusters if isinstance(c, ClusterInfo)]
        dup = {i for i in ids if ids.count(i) > 1}

        async def one(c: Any) -> LinkResult:
            if not isinstance(c, ClusterInfo):
                return LinkResult(S.LLM_PARAM_INVALID, f"not a ClusterInfo: {type(c).__name__}")
            if c.remote_cluster_id in dup:
                return LinkResult(S.LLM_PARAM_INVALID, f"cluster {c.remote_cluster_id} is listed twice")
            return await self.link_one(c, timeout)
        results = list(await asyncio.gather(*(one(c) for c in clusters)))
        return overall(results), results

    async def link_one(self, info: ClusterInfo, timeout: float) -> LinkResult:
        cid = info.remote_cluster_id
        try:
            result = await self._link_one(info, timeout)
        except _Failed as e:
            result = e.result
        except TimeoutError:
            result = LinkResult(S.LLM_TIMEOUT, f"timed out after {timeout:.3f} s")
        except (OSError, ProtocolError, KeyError, ValueError, TypeError) as e:
            result = LinkResult(S.LLM_LINK_FAILED, str(e) or type(e).__name__)
        if result.status != S.LLM_SUCCESS and result.reason:
            level = logging.INFO if result.status in (S.LLM_ALREADY_LINK, S.LLM_PROCESSING_LINK) else logging.WARNING
            log.log(level, "link to cluster %s at %s: %s", cid, info.address, result.reason)
        return result

    async def _link_one(self, info: ClusterInfo, timeout: float) -> LinkResult:
        cid = info.remote_cluster_id
        try:
            host, port = control.parse_address(info.address)
        except (ValueError, TypeError) as e:
            raise _fail(S.LLM_PARAM_INVALID, str(e)) from None
        if not isinstance(cid, int) or isinstance(cid, bool) or cid == self._cluster_id or not 0 <= cid <= _U64:
            raise _fail(S.LLM_PARAM_INVALID, f"bad remote cluster id {cid!r}")
        busy = self._links.busy(cid)
        if busy is not None:
            return LinkResult(*busy)
        self._links.reserve(cid)
        tcp: StreamChannel | None = None
        uch: SeqpacketChannel | None = None
        link: Link | None = None
        pidfd: int | None = None
        opts = self._options
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port)
                tcp = StreamChannel(reader, writer)
                if opts.secret is None and not opts.insecure and not kernel.is_local_peer(
                        writer.get_extra_info("peername"), writer.get_extra_info("sockname")):
                    raise _fail(S.LLM_LINK_FAILED, NO_SECRET_MSG)
                nonce = control.new_nonce()
                await tcp.send({"t": "hello", "v": control.PROTOCOL_VERSION, "cluster": self._cluster_id,
                                "role": int(self._role), "host": self._host, "process": control.process_tag(),
                                "transport": opts.transport, "streams": opts.tcp_streams,
                                "auth": opts.secret is not None, "nonce": nonce, "inc": self._incarnation,
                                "ucx": ucx_for_auto(opts)})
                w = await _reply(tcp, "hello")
                if w["t"] != "welcome" or w.get("v") != control.PROTOCOL_VERSION:
                    raise _fail(S.LLM_LINK_FAILED, f"unexpected reply {w.get('t')!r} to the hello")
                if w.get("cluster") != cid:
                    raise _fail(S.LLM_LINK_FAILED, f"the engine there is cluster {w.get('cluster')}")
                if not control.check_proof(opts.secret, w.get("proof"), "server", nonce, str(w.get("nonce"))):
                    raise _fail(S.LLM_LINK_FAILED, "the peer failed authentication")
                transport, streams, inc = w.get("transport"), w.get("streams"), w.get("inc")
                if not is_hex(inc, 16):
                    raise ProtocolError("bad welcome: no incarnation")
                if transport not in ("local", "shm", "tcp", "ucx") or not int_in(streams, 1, _native.MAX_STREAMS) \
                        or opts.transport not in ("auto", transport):
                    raise ProtocolError(f"bad welcome (transport {transport!r}, streams {streams!r})")
                attach: dict[str, Any] = {"t": "attach", "proof": (
                    control.proof(opts.secret, "client", str(w["nonce"]), nonce)
                    if opts.secret is not None else None)}
                if transport == "local":
                    attach["ptoken"] = self._token
                if transport == "ucx":
                    st, address = self._links.data.ucx_address()
                    if st:
                        raise _fail(to_status(st, S.LLM_LINK_FAILED), f"no UCX worker here (status {st:#x})")
                    attach["ucx"] = address.hex()
                    ucx_rx = secrets.token_bytes(_native.UCX_TOKEN)   # what the server's messages carry
                    attach["ucx_token"] = ucx_rx.hex()
                    attach.update(UCX_SERVES)   # the pulls we answer (PULL_REQ2D, PULL_REQV)
                await tcp.send(attach)
                a = await _reply(tcp, "attach")
                if a["t"] != "attached":
                    raise ProtocolError(f"unexpected reply {a['t']!r} to attach")
                if transport == "ucx":
                    if not is_ucx_address(a.get("ucx")) or not is_hex(a.get("ucx_token"), 2 * _native.UCX_TOKEN):
                        raise ProtocolError("bad attached message")
                    link = Link(cid, tcp, transport, 0, "", info.address, incarnation=str(inc))
                    tcp = None
                    self._links.data.add_ucx_link(link, bytes.fromhex(a["ucx"]), ucx_rx,   # before the tables
                                                  bytes.fromhex(a["ucx_token"]), ucx_peer_serves(a))
                    status = await self._links.establish(link, True)
                elif transport == "tcp":
                    if not int_in(a.get("data_port"), 1, 65535) or \
                            not is_hex(a.get("data_token"), 2 * _native.TOKEN_BYTES):
                        raise ProtocolError("bad attached message")
                    link = Link(cid, tcp, transport, 0, "", info.address, incarnation=str(inc))
                    tcp = None
                    assert isinstance(streams, int)   # int_in checked it
                    tcp_link, n = link, streams
                    self._links.data.add_data_link(link, str(a["data_token"]), n)   # before the table: its regions name the link
                    status = await self._links.establish(link, True, lambda: self._links.data.connect_streams(
                        tcp_link, host, int(a["data_port"]), n))
                else:
                    if not isinstance(a.get("unix"), str) or not isinstance(a.get("join"), str):
                        raise ProtocolError("bad attached message")
                    uch = await channels.unix_connect(a["unix"], self._loop)
                    ptoken = str(a.get("ptoken")) if transport == "local" else ""
                    pid, pidfd = peer_process(uch.sock, transport, ptoken)   # who listens there
                    await uch.send({"t": "join", "token": a["join"]})
                    link = Link(cid, uch, transport, pid, ptoken, info.address, pidfd, str(inc))
                    uch = pidfd = None
                    # TCP stays open until the link is up: its EOF tells the server to drop a
                    # reservation we abandoned.
                    status = await self._links.establish(link, True)
                if status == S.LLM_SUCCESS:
                    link = None
                    return LinkResult(status)
                return LinkResult(status, "the peer refused the link while the cache tables were exchanged"
                                  if status != S.LLM_ALREADY_LINK else f"cluster {cid} is already linked")
        finally:
            self._links.release(cid)
            if tcp is not None:
                tcp.close()
            if uch is not None:
                uch.close()
            if pidfd is not None:
                os.close(pidfd)
            if link is not None:
                self._links.abandon(link)


async def _reply(ch: StreamChannel, phase: str) -> dict[str, Any]:
    """The server's answer in the hello phase; raises _Failed if the connection closed
    or the server rejected us."""
    item = await ch.recv(control.HELLO_MAX)
    if item is None:
        raise _fail(S.LLM_LINK_FAILED, f"connection closed during {phase}")
    msg = item[0]
    if msg["t"] == "reject":
        raise _fail(to_status(msg.get("status"), S.LLM_LINK_FAILED), f"refused: {msg.get('msg')}")
    return msg
