"""The network data planes, seen from the loop: each TCP or UCX link's native id
(``Link.tcp_id``, one counter for both), TCP data streams' setup, UCX endpoints,
and the native link events (ready, down).

Owns: the native link ids and which live link each one is, the futures of
links whose streams are being connected, the failure counters last seen. It
does not decide a link's fate: a lost stream is reported to the link manager
(``on_lost``), which takes the link down.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from typing import Callable

from .control import ProtocolError
from .link import Link
from .native import _native
from .status import LLMStatusCode as S, to_status
from .options import EngineOptions

__all__ = ["DataPlane", "UCX_SERVES", "ucx_peer_serves"]

log = logging.getLogger("kvengine")

UCX_TCP_WARNING = (
    "UCX_TLS=%r includes UCX's tcp transport: UCX executes raw PUT requests from anyone who "
    "reaches its listening port, below kvengine's checks, so any host that can reach it can write "
    "into this process (docs/security.md, 'UCX links'); use it only on a network where every host "
    "is trusted. Without UCX_TLS, kvengine leaves UCX's tcp transport out")

# What this engine's UCX transport answers, announced in attach and attached: pulls of a head
# range's rows (PULL_REQ2D) and of many small segments (PULL_REQV), and pushes of many small
# segments (PUSHV). Older engines omit the keys.
UCX_SERVES = {"ucx_pull2d": True, "ucx_pullv": True, "ucx_pushv": True}


def ucx_peer_serves(msg: dict[str, object]) -> tuple[bool, bool, bool]:
    """What the peer's attach or attached message says its UCX transport answers:
    (PULL_REQ2D, PULL_REQV, PUSHV), for add_ucx_link."""
    return msg.get("ucx_pull2d") is True, msg.get("ucx_pullv") is True, msg.get("ucx_pushv") is True


# Native failure counters, and what each one tells the operator when a link fails.
_DOWN_HINTS = {
    "tcp_lease_expired": "; our lease on a data stream expired before the peer renewed it: "
                         "a stalled receiver, or a link slower than about (tcp_window_bytes + "
                         "chunk_bytes) / (0.3 * heartbeat_timeout): raise heartbeat_timeout or lower "
                         "tcp_window_bytes (docs/protocol.md, Leases)",
    "tcp_fence_expired": "; the peer did not acknowledge an abort within 0.5 * heartbeat_timeout",
    "tcp_stalled": "; a data stream made no progress for heartbeat_timeout",
    "tcp_bad_frames": "; the peer sent a malformed or impossible frame",
    "ucx_bad_msgs": "; the peer sent a UCX message that failed our checks (region, bounds, state)",
}


class DataPlane:
    """TCP links' data streams (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, core: _native.Core, options: EngineOptions,
                 on_lost: Callable[[Link, str], None]) -> None:
        self._loop = loop
        self._core = core
        self._options = options
        self._on_lost = on_lost
        self._ids = itertools.count(1)
        self._tcp_links: dict[int, Link] = {}   # native link id -> live link
        self._tcp_ready: dict[int, asyncio.Future[S]] = {}
        self._down_counts: dict[str, int] = {}  # native failure counters at the last link failure
        self._ucx_started = False

    def add_data_link(self, link: Link, data_token: str, streams: int) -> None:
        """Declare the link's TCP data plane in the core: streams presenting ``data_token``
        are bound to it, and its lease and fence follow heartbeat_timeout (lease 0.4,
        fence 0.5, margin 0.05 of it: docs/protocol.md, "Leases")."""
        link.tcp_id = next(self._ids)
        hbt = self._options.heartbeat_timeout
        st = self._core.tcp_link_add(link.tcp_id, bytes.fromhex(data_token), streams,
                                     self._options.tcp_window_bytes, lease=0.4 * hbt,
                                     fence=0.5 * hbt, margin=0.05 * hbt)
        if st:
            raise ProtocolError(f"cannot add the data link (status {st:#x})")

    async def connect_streams(self, link: Link, host: str, port: int, streams: int) -> S:
        """Client side of a TCP link: open the data connections, hand them to the core,
        wait until the peer acknowledged every one."""
        ready: asyncio.Future[S] = self._loop.create_future()
        self._tcp_ready[link.tcp_id] = ready
        try:
            infos = await self._loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, addr = infos[0]
            for _ in range(streams):
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    await self._loop.sock_connect(sock, addr)
                except BaseException:
                    sock.close()
                    raise
                st = self._core.tcp_conn_add(sock.detach(), link.tcp_id)   # the core owns the fd now
                if st:
                    return to_status(st, S.LLM_LINK_FAILED)
            return await ready
        finally:
            self._tcp_ready.pop(link.tcp_id, None)

    def ucx_address(self) -> tuple[int, bytes]:
        """``(status, this engine's UCP worker address)``; the first call starts UCX (and
        warns once if UCX_TLS enables UCX's tcp transport)."""
        if not self._ucx_started:
            self._ucx_started = True
            tls = os.environ.get("UCX_TLS")
            if tls is not None and not tls.startswith("^") and ("tcp" in tls.split(",") or "all" in tls.split(",")):
                log.warning(UCX_TCP_WARNING, tls)
        st, address = self._core.ucx_address()
        return st, address

    def add_ucx_link(self, link: Link, peer_address: bytes, rx_token: bytes, tx_token: bytes,
                     peer_serves: tuple[bool, bool, bool] = (False, False, False)) -> None:
        """Declare the link's UCX endpoint to the peer's worker: the peer's messages must
        carry ``rx_token``, ours carry ``tx_token`` (both exchanged on the authenticated
        control channel). Lease, fence and margin as for tcp links (0.4, 0.5, 0.05 of
        heartbeat_timeout): an aborted push whose ABORT_ACK does not come within the
        fence fails the link, and the peer writes our pushes only under our lease.
        ``peer_serves``: what the peer said it answers (ucx_peer_serves): pulls of rows
        (PULL_REQ2D), pulls of many small segments (PULL_REQV), pushes of them (PUSHV)."""
        link.tcp_id = next(self._ids)
        hbt = self._options.heartbeat_timeout
        st = self._core.ucx_link_add(link.tcp_id, peer_address, rx_token, tx_token,
                                     self._options.tcp_window_bytes, fence=0.5 * hbt, lease=0.4 * hbt,
                                     margin=0.05 * hbt, peer_pull2d=peer_serves[0], peer_pullv=peer_serves[1],
                                     peer_pushv=peer_serves[2])
        if st:
            raise ProtocolError(f"cannot reach the peer's UCX worker (status {st:#x})")

    def on_native_event(self, kind: int, link_id: int, status: int) -> None:
        if kind == _native.EVENT_LINK_READY:
            fut = self._tcp_ready.get(link_id)
            if fut is not None and not fut.done():
                fut.set_result(S.LLM_SUCCESS)
        elif kind == _native.EVENT_LINK_DOWN:
            fut = self._tcp_ready.get(link_id)
            if fut is not None and not fut.done():
                fut.set_result(S.LLM_LINK_FAILED)
            link = self._tcp_links.get(link_id)
            if link is not None:
                self._on_lost(link, f"a data stream failed ({to_status(status, S.LLM_LINK_FAILED).name})"
                                    f"{self._why_down()}")

    def _why_down(self) -> str:
        """What the core counted since the last link failure, as advice for the log."""
        st = self._core.stats()
        seen, self._down_counts = self._down_counts, {k: st.get(k, 0) for k in _DOWN_HINTS}
        return "".join(hint for k, hint in _DOWN_HINTS.items() if self._down_counts[k] > seen.get(k, 0))


    def live(self, link: Link) -> None:
        """The link is up: its streams' failures are now its own."""
        if link.tcp_id:
            self._tcp_links[link.tcp_id] = link

    def close(self, link: Link, status: S) -> None:
        """Close the link's data streams; its jobs complete with ``status``."""
        if link.tcp_id:
            if link.transport == "ucx":
                self._core.ucx_link_close(link.tcp_id, int(status))
            else:
                self._core.tcp_link_close(link.tcp_id, int(status))
            self._tcp_links.pop(link.tcp_id, None)
            link.tcp_id = 0
