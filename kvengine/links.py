"""Links: handshake, authentication, cache tables, heartbeats, unlink.

``_Links`` is the link half of :class:`kvengine.KvEngine` (a mixin: it uses the
engine's core, loop, registry and options). A link is set up over TCP (hello,
welcome, attach, attached: the peer authenticates before it learns anything or
reserves its cluster id); on one host it then moves to a Unix SEQPACKET socket
(join; memfds travel there, the peer's pid comes from SO_PEERCRED), across hosts
(or with ``transport="tcp"``) the TCP connection stays the control channel and the
native core opens ``tcp_streams`` data connections. Without a secret only peers on
this host may link (``EngineOptions.insecure`` lifts that).
Protocol: docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import socket
import time
import weakref
from typing import Any, Iterable, Sequence

from . import control
from .native import _native
from .control import ProtocolError, SeqpacketChannel, StreamChannel
from .status import LLMError, LLMStatusCode as S, error_for, to_status
from .transfer import Transfer
from .types import CacheDesc, ClusterInfo, check_timeout

log = logging.getLogger("kvengine")

_U64 = 2**64 - 1
_serials = itertools.count(1)
# Engines of this process by token, for the in-process ("local") transport.
LOCAL_ENGINES: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def group_regions(addrs: Sequence[int], size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Merge tensors that sit back to back into one region.

    Returns ``(regions, placement)``: regions as ``(base, length)`` and, per tensor,
    ``(region index, offset in region)``.
    """
    regions: list[list[int]] = []
    placement: list[tuple[int, int]] = []
    for a in addrs:
        if regions and regions[-1][0] + regions[-1][1] == a:
            placement.append((len(regions) - 1, regions[-1][1]))
            regions[-1][1] += size
        else:
            placement.append((len(regions), 0))
            regions.append([a, size])
    return [tuple(r) for r in regions], placement


async def wait_idle(obj) -> None:
    """Wait until no transfer is in flight on a cache (``_inflight`` / ``_idle`` protocol)."""
    if obj._inflight:
        if obj._idle is None:
            obj._idle = asyncio.get_running_loop().create_future()
        await asyncio.shield(obj._idle)


class RemoteCache:
    """A peer's cache as this engine reaches it: regions in this engine's core."""

    __slots__ = ("cache_id", "desc", "regions", "region_ids", "keep", "serial", "_inflight", "_idle")

    def __init__(self, cache_id: int, desc: CacheDesc, regions: list[tuple[int, int]],
                 region_ids: list[int], keep: Any) -> None:
        self.cache_id = cache_id
        self.desc = desc
        self.regions = regions        # per tensor: (region id, offset)
        self.region_ids = region_ids
        self.keep = keep              # the peer's Cache object (local transport) or None
        self.serial = next(_serials)
        self._inflight = 0
        self._idle = None


class Link:
    __slots__ = ("cluster_id", "ch", "transport", "peer_pid", "peer_token", "remote", "inflight",
                 "reader", "beat", "pending", "up", "closing", "address", "_reqs", "waiters", "tcp_id",
                 "last_rx", "heap", "inflight_bytes", "gone", "pidfd", "lease_id", "lease_until", "serial")

    def __init__(self, cluster_id: int, ch: Any, transport: str, peer_pid: int, peer_token: str,
                 address: str, pidfd: int | None = None) -> None:
        self.cluster_id = cluster_id
        self.ch = ch                  # SeqpacketChannel (local, shm) or StreamChannel (tcp)
        self.transport = transport
        self.peer_pid = peer_pid      # shm/local: from SO_PEERCRED on the Unix socket; tcp: 0
        self.peer_token = peer_token  # local: the peer engine's token (LOCAL_ENGINES); else ""
        self.pidfd = pidfd            # shm: a pidfd of the peer process (CMA regions name it)
        self.address = address
        self.remote: dict[int, RemoteCache] = {}
        self.inflight: set[Transfer] = set()
        self.reader: asyncio.Task | None = None
        self.beat: asyncio.Task | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.up = True
        self.closing = False          # an unlink is under way: EOF is expected
        self._reqs = itertools.count(1)
        self.waiters: dict[int, list[asyncio.Future]] = {}  # cache id -> wait_remote_cache futures
        self.tcp_id = 0               # native link id of the TCP data plane
        self.last_rx = 0.0
        self.heap: list = []          # the scheduler's queue: (key, Transfer)
        self.inflight_bytes = 0       # bytes handed to the core, not yet completed
        self.gone = asyncio.get_running_loop().create_future()   # done when the link is down
        self.lease_id = 0             # shm: the core's mover lease for pushes into the peer (0: none)
        self.serial = next(_serials)  # never reused: names this link's pidfd in the core
        self.lease_until = 0          # its end, CLOCK_BOOTTIME ns


def boot_ns() -> int:
    """The mover leases' clock (the core's): CLOCK_BOOTTIME, which counts suspended time too."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def mover_lease_ns(heartbeat_timeout: float) -> int:
    """How long one echoed ping lets our movers write into a shm peer.

    The mover lease: on a shm link our movers write straight into the peer's
    memory, so a pushing process that was stopped mid-push and resumes after the
    peer dropped the link would go on writing rows the peer may already reuse.
    Each ping we send carries our clock; the peer echoes it in a pong; the lease
    then runs until that clock + this. The peer drops a silent link only after
    heartbeat_timeout without a message from us, and its last echo answered a ping
    it received (so after we sent it): by then the lease, shorter than
    heartbeat_timeout, is over, and our movers start no new chunk (the one in
    progress, at most chunk_bytes per mover, is the residue; docs/security.md).
    """
    return int(0.75 * heartbeat_timeout * 1e9)


class _Joining:
    """Server side: a client that authenticated on TCP (attach) and was given a one-time
    join token for the Unix socket (local/shm), or whose TCP link is being set up."""

    __slots__ = ("cluster_id", "transport", "streams", "peer_token", "expiry")

    def __init__(self, cluster_id: int, transport: str, streams: int, peer_token: str) -> None:
        self.cluster_id = cluster_id
        self.transport = transport
        self.streams = streams
        self.peer_token = peer_token
        self.expiry: asyncio.TimerHandle | None = None


_TRANSPORTS = ("auto", "local", "shm", "tcp")
NO_SECRET_MSG = ("without a secret an engine links only with engines on its own host: set "
                 "EngineOptions.secret (or KVENGINE_SECRET) on both engines, or "
                 "EngineOptions(insecure=True) to link without authentication")


def _is_hex(v: Any, n: int) -> bool:
    if not isinstance(v, str) or len(v) != n:
        return False
    try:
        bytes.fromhex(v)
    except ValueError:
        return False
    return True


def _int_in(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def hello_problem(h: dict) -> str | None:
    """What is malformed in a hello (None: nothing). Unknown fields are ignored."""
    checks = (("cluster", lambda v: _int_in(v, 0, _U64)), ("role", lambda v: _int_in(v, 0, 2**31)),
              ("host", lambda v: isinstance(v, str) and len(v) <= 256),
              ("process", lambda v: isinstance(v, str) and len(v) <= 64),
              ("transport", lambda v: v in _TRANSPORTS),
              ("streams", lambda v: _int_in(v, 1, _native.MAX_STREAMS)),
              ("auth", lambda v: isinstance(v, bool)), ("nonce", lambda v: _is_hex(v, 32)))
    for name, ok in checks:
        if name not in h:
            return f"malformed hello: no {name!r}"
        if not ok(h[name]):
            return f"malformed hello: bad {name!r}"
    return None


def _peer_process(sock: socket.socket, transport: str, ptoken: str) -> tuple[int, int | None]:
    """The peer process at the other end of a Unix link socket, from the kernel (never the
    peer's word): ``(pid, pidfd)``. "local" must be this very process and ``ptoken`` one
    of its engines (no pidfd then); "shm" gets a pidfd for CMA."""
    pid = control.peer_pid(sock)
    if transport == "local":
        if pid != os.getpid() or ptoken not in LOCAL_ENGINES:
            raise ProtocolError("transport 'local' but the peer is not an engine of this process")
        return pid, None
    return pid, control.peer_pidfd(sock, pid)


async def _const(value):
    return value


async def _hello_reply(ch: StreamChannel, cid: int, address: str, phase: str) -> dict | S:
    """The server's answer in the hello phase, or the status to return: the
    connection closed, or the server rejected us."""
    item = await ch.recv(control.HELLO_MAX)
    if item is None:
        log.warning("link to cluster %s at %s: connection closed during %s", cid, address, phase)
        return S.LLM_LINK_FAILED
    msg = item[0]
    if msg["t"] == "reject":
        log.warning("link to cluster %s refused: %s", cid, msg.get("msg"))
        return to_status(msg.get("status"), S.LLM_LINK_FAILED)
    return msg


def overall(results: Iterable[S]) -> S:
    for r in results:
        if r != S.LLM_SUCCESS:
            return r
    return S.LLM_SUCCESS


class _Links:
    """Link management of KvEngine (see the module docstring)."""

    # ------------------------------------------------------------ client side

    async def link_clusters(self, clusters: Sequence[ClusterInfo], timeout: float | None = None
                            ) -> tuple[S, list[S]]:
        """Link to each peer (in parallel): ``(overall status, [status per cluster])``.

        Per cluster: ``LLM_SUCCESS``, ``LLM_ALREADY_LINK``, ``LLM_PROCESSING_LINK``
        (a link to that cluster is being set up), ``LLM_LINK_FAILED`` (unreachable,
        refused, authentication failed), ``LLM_TIMEOUT`` or ``LLM_PARAM_INVALID``.
        The overall status is ``LLM_SUCCESS`` only if every cluster linked.
        """
        self._check_open()
        timeout = self._link_timeout(timeout)
        if isinstance(clusters, ClusterInfo) or not isinstance(clusters, (list, tuple)) or not clusters:
            return S.LLM_PARAM_INVALID, []
        ids = [c.remote_cluster_id for c in clusters if isinstance(c, ClusterInfo)]
        dup = {i for i in ids if ids.count(i) > 1}
        results = await asyncio.gather(*(
            self._link_one(c, timeout) if isinstance(c, ClusterInfo) and c.remote_cluster_id not in dup
            else _const(S.LLM_PARAM_INVALID) for c in clusters))
        return overall(results), results

    def _link_timeout(self, timeout: Any) -> float:
        return check_timeout(timeout, self.options.link_timeout)

    async def _link_one(self, info: ClusterInfo, timeout: float) -> S:
        cid = info.remote_cluster_id
        try:
            host, port = control.parse_address(info.address)
        except (ValueError, TypeError) as e:
            log.warning("link to cluster %s: %s", cid, e)
            return S.LLM_PARAM_INVALID
        if not isinstance(cid, int) or cid == self.cluster_id or not 0 <= cid <= _U64:
            return S.LLM_PARAM_INVALID
        if cid in self._links:
            return S.LLM_ALREADY_LINK
        if cid in self._linking:
            return S.LLM_PROCESSING_LINK
        self._linking.add(cid)
        tcp = uch = link = pidfd = None
        opts = self.options
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port)
                tcp = StreamChannel(reader, writer)
                if opts.secret is None and not opts.insecure and not control.is_local_peer(
                        writer.get_extra_info("peername"), writer.get_extra_info("sockname")):
                    log.warning("link to cluster %s at %s: %s", cid, info.address, NO_SECRET_MSG)
                    return S.LLM_LINK_FAILED
                nonce = control.new_nonce()
                await tcp.send({"t": "hello", "v": control.PROTOCOL_VERSION, "cluster": self.cluster_id,
                                "role": int(self.role), "host": self._host, "process": control.process_tag(),
                                "transport": opts.transport, "streams": opts.tcp_streams,
                                "auth": opts.secret is not None, "nonce": nonce})
                w = await _hello_reply(tcp, cid, info.address, "hello")
                if not isinstance(w, dict):
                    return w
                if w["t"] != "welcome" or w.get("v") != control.PROTOCOL_VERSION:
                    log.warning("link to cluster %s: unexpected reply %r", cid, w.get("t"))
                    return S.LLM_LINK_FAILED
                if w.get("cluster") != cid:
                    log.warning("link to cluster %s: the engine at %s is cluster %s", cid, info.address,
                                w.get("cluster"))
                    return S.LLM_LINK_FAILED
                if not control.check_proof(opts.secret, w.get("proof"), "server", nonce,
                                           str(w.get("nonce"))):
                    log.warning("link to cluster %s: peer failed authentication", cid)
                    return S.LLM_LINK_FAILED
                transport, streams = w.get("transport"), w.get("streams")
                if transport not in ("local", "shm", "tcp") or not _int_in(streams, 1, _native.MAX_STREAMS) \
                        or opts.transport not in ("auto", transport):
                    raise ProtocolError(f"bad welcome (transport {transport!r}, streams {streams!r})")
                attach: dict[str, Any] = {"t": "attach", "proof": (
                    control.proof(opts.secret, "client", str(w["nonce"]), nonce)
                    if opts.secret is not None else None)}
                if transport == "local":
                    attach["ptoken"] = self._token
                await tcp.send(attach)
                a = await _hello_reply(tcp, cid, info.address, "attach")
                if not isinstance(a, dict):
                    return a
                if a["t"] != "attached":
                    raise ProtocolError(f"unexpected reply {a['t']!r} to attach")
                if transport == "tcp":
                    if not _int_in(a.get("data_port"), 1, 65535) or \
                            not _is_hex(a.get("data_token"), 2 * _native.TOKEN_BYTES):
                        raise ProtocolError("bad attached message")
                    w.update(data_port=a["data_port"], data_token=a["data_token"])   # the offer, whole
                    link = Link(cid, tcp, transport, 0, "", info.address)
                    tcp = None
                    self._add_data_link(link, str(w["data_token"]), streams)   # before the table: its regions name the link
                    connect = lambda: self._connect_streams(link, host, int(w["data_port"]), streams)
                    status = await self._establish(link, True, connect)
                else:
                    if not isinstance(a.get("unix"), str) or not isinstance(a.get("join"), str):
                        raise ProtocolError("bad attached message")
                    uch = await control.unix_connect(a["unix"], self._loop)
                    ptoken = str(a.get("ptoken")) if transport == "local" else ""
                    pid, pidfd = _peer_process(uch.sock, transport, ptoken)   # who listens there
                    await uch.send({"t": "join", "token": a["join"]})
                    link = Link(cid, uch, transport, pid, ptoken, info.address, pidfd)
                    uch = pidfd = None
                    # TCP stays open until the link is up: its EOF tells the server to drop a
                    # reservation we abandoned.
                    status = await self._establish(link, True)
                if status == S.LLM_SUCCESS:
                    link = None
                return status
        except TimeoutError:
            log.warning("link to cluster %s at %s timed out after %.3f s", cid, info.address, timeout)
            return S.LLM_TIMEOUT
        except (OSError, ProtocolError, KeyError, ValueError, TypeError) as e:
            log.warning("link to cluster %s at %s failed: %s", cid, info.address, e)
            return S.LLM_LINK_FAILED
        finally:
            self._linking.discard(cid)
            if tcp is not None:
                tcp.close()
            if uch is not None:
                uch.close()
            if pidfd is not None:
                os.close(pidfd)
            if link is not None:
                self._abandon(link)

    def _add_data_link(self, link: Link, data_token: str, streams: int) -> None:
        """Declare the link's TCP data plane in the core: streams presenting ``data_token``
        are bound to it, and its lease and fence follow heartbeat_timeout (lease 0.4,
        fence 0.5, margin 0.05 of it: docs/protocol.md, "Leases")."""
        link.tcp_id = next(self._tcp_ids)
        hbt = self.options.heartbeat_timeout
        st = self._core.tcp_link_add(link.tcp_id, bytes.fromhex(data_token), streams,
                                     self.options.tcp_window_bytes, lease=0.4 * hbt,
                                     fence=0.5 * hbt, margin=0.05 * hbt)
        if st:
            raise ProtocolError(f"cannot add the data link (status {st:#x})")

    async def _connect_streams(self, link: Link, host: str, port: int, streams: int) -> S:
        """Client side of a TCP link: open the data connections, hand them to the core,
        wait until the peer acknowledged every one."""
        ready = self._loop.create_future()
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

    def _abandon(self, link: Link) -> None:
        """A link that never came up: release what it registered."""
        self._drop_remote(link)
        if link.tcp_id:
            self._core.tcp_link_close(link.tcp_id, int(S.LLM_LINK_FAILED))
            link.tcp_id = 0
        self._close_pidfd(link)
        link.ch.close()

    @staticmethod
    def _close_pidfd(link: Link) -> None:
        # After the link's regions were removed: the core holds its own reference (a dup)
        # for regions a job still uses.
        if link.pidfd is not None:
            os.close(link.pidfd)
            link.pidfd = None

    async def _establish(self, link: Link, client: bool, connect=None) -> S:
        """Exchange cache tables and go live on both ends.

        local/shm and the TCP server side send their table first; the TCP client reads
        the server's table, opens the data streams (``connect``), then sends its own.
        The server records the link, then says "up"; the client records it on "up", so
        when link_clusters returns both ends can transfer.
        """
        t_start = boot_ns()   # before our first message: the peer heard from us after this
        if connect is None:
            await self._announce(link, list(self._caches.values()), ready=True)
        status = await self._read_table(link)
        if status == S.LLM_SUCCESS and connect is not None:
            status = await connect()
            if status == S.LLM_SUCCESS:
                await self._announce(link, list(self._caches.values()), ready=True)
        if status != S.LLM_SUCCESS:
            return status
        if client:
            item = await link.ch.recv()
            if item is None or item[0].get("t") != "up":
                msg = item[0] if item else {}
                log.warning("link to cluster %s refused: %s", link.cluster_id, msg.get("msg", "closed"))
                return to_status(msg.get("status"), S.LLM_LINK_FAILED)
        if self._closed or link.cluster_id in self._links:
            if not client:
                await link.ch.send({"t": "reject", "status": int(S.LLM_ALREADY_LINK), "msg": "already linked"})
            return S.LLM_ALREADY_LINK if not self._closed else S.LLM_ENGINE_FINALIZED
        if link.transport == "shm":
            # the first mover lease counts from before our first message of this exchange:
            # the peer's silence clock starts after it heard one (mover_lease_ns)
            until = t_start + mover_lease_ns(self.options.heartbeat_timeout)
            st, lid = self._core.lease_add(until)
            if st:
                log.warning("link to cluster %s: no mover lease (status %#x)", link.cluster_id, st)
                return to_status(st, S.LLM_LINK_FAILED)
            link.lease_id, link.lease_until = lid, until
        self._links[link.cluster_id] = link
        if link.tcp_id:
            self._tcp_links[link.tcp_id] = link
        link.last_rx = self._loop.time()
        link.reader = self._spawn(self._read_link(link))
        link.beat = self._spawn(self._heartbeat(link))
        for fut in self._link_waiters.pop(link.cluster_id, ()):
            if not fut.done():
                fut.set_result(S.LLM_SUCCESS)
        if not client:
            await link.ch.send({"t": "up"})
        log.info("linked cluster %s <-> %s (%s)", self.cluster_id, link.cluster_id, link.transport)
        return S.LLM_SUCCESS

    async def _read_table(self, link: Link) -> S:
        while True:
            item = await link.ch.recv()
            if item is None:
                return S.LLM_LINK_FAILED
            msg, fds = item
            if msg["t"] == "reject":
                log.warning("link to cluster %s refused: %s", link.cluster_id, msg.get("msg"))
                return to_status(msg.get("status"), S.LLM_LINK_FAILED)
            if msg["t"] == "ready":
                return S.LLM_SUCCESS
            if msg["t"] != "cache_add":
                raise ProtocolError(f"unexpected {msg['t']!r} while linking")
            await self._on_cache_add(link, msg, fds)

    # ------------------------------------------------------------ cache tables

    async def _announce(self, link: Link, states: list, ready: bool = False) -> None:
        """Send cache descriptors (and memfds) to the peer."""
        for state in states:
            if state.cache.cache_id not in self._caches:
                continue
            c = state.cache
            msg: dict[str, Any] = {"t": "cache_add", "id": c.cache_id, "desc": c.desc.to_wire()}
            fds: list[int] = []
            if link.transport == "local":
                msg["kind"] = "local"
            elif link.transport == "tcp":
                index = {rid: i for i, (rid, _) in enumerate(state.regions)}
                msg.update(kind="tcp", regions=[list(r) for r in state.regions],
                           placement=[[index[rid], off] for rid, off in c._regions])
            elif state.memfd is not None:
                fd, length, stride = c._shared
                msg.update(kind="memfd", len=length, stride=stride)
                fds = [fd]
            else:
                msg.update(kind="cma", addrs=c.tensor_addrs)
            try:
                await link.ch.send(msg, fds)
            except (ConnectionError, ProtocolError) as e:
                log.warning("cannot announce cache %s to cluster %s: %s", c.cache_id, link.cluster_id, e)
                return
        if ready:
            await link.ch.send({"t": "ready"})

    async def _on_cache_add(self, link: Link, msg: dict, fds: list[int]) -> None:
        """Register a peer's cache in this engine's core. Bad descriptors are a protocol error.

        A memfd is mapped (and pre-faulted) in a worker thread: the loop keeps serving."""
        try:
            cache_id = msg["id"]
            if not _int_in(cache_id, 0, _U64) or cache_id in link.remote:
                raise ProtocolError(f"bad or repeated cache id {cache_id!r}")
            if len(link.remote) >= control.MAX_REMOTE_CACHES:
                raise ProtocolError(f"more than {control.MAX_REMOTE_CACHES} caches announced")
            try:
                desc = CacheDesc.from_wire(msg["desc"])
            except (LLMError, KeyError, TypeError, ValueError) as e:
                raise ProtocolError(f"bad cache descriptor: {e}") from None
            kind = msg.get("kind")
            if (kind == "tcp") != (link.transport == "tcp") or (kind == "local") != (link.transport == "local"):
                raise ProtocolError(f"cache kind {kind!r} on a {link.transport} link")
            n, size = desc.num_tensors, desc.size
            keep = None
            if kind == "local":
                peer = LOCAL_ENGINES.get(link.peer_token)
                state = peer._caches.get(cache_id) if peer is not None else None
                if state is None:
                    raise ProtocolError(f"local cache {cache_id} not found in the peer engine")
                keep = state.cache
                regions, placement = group_regions(keep.tensor_addrs, size)
                kinds = (_native.REGION_LOCAL, 0, 0)
            elif kind == "cma":
                addrs = msg.get("addrs")
                if not isinstance(addrs, list) or len(addrs) != n or \
                        not all(isinstance(a, int) and 0 < a < 2**64 - size for a in addrs):
                    raise ProtocolError("bad tensor addresses")
                regions, placement = group_regions(addrs, size)
                if link.pidfd is None:
                    raise ProtocolError("a 'cma' cache on a link without a peer process")
                kinds = (_native.REGION_PROCESS, link.peer_pid, 0)
            elif kind == "memfd":
                length, stride = msg.get("len"), msg.get("stride")
                # the layout is fixed by the descriptor (so is the size we map), and the
                # memfd must be sealed at exactly that size and fully allocated
                if len(fds) != 1 or stride != control.memfd_stride(size) or length != stride * n:
                    raise ProtocolError("bad memfd cache descriptor")
                control.check_memfd(fds[0], length)
                st, addr = await self._loop.run_in_executor(None, _native.map_fd, fds[0], length)
                if st:
                    raise ProtocolError(f"cannot map the peer's cache (status {st:#x})")
                regions = [(addr, length)]
                placement = [(0, t * stride) for t in range(n)]
                kinds = (_native.REGION_LOCAL, 0, _native.F_UNMAP)
            elif kind == "tcp":
                regions, placement = msg.get("regions"), msg.get("placement")
                ok = (isinstance(regions, list) and isinstance(placement, list) and len(placement) == n
                      and 1 <= len(regions) <= n
                      and all(isinstance(r, list) and len(r) == 2 and all(isinstance(v, int) for v in r)
                              and 0 < r[0] < 2**32 and 0 < r[1] < 2**63 for r in regions)
                      and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], int)
                              and isinstance(p[1], int) and 0 <= p[0] < len(regions)
                              and 0 <= p[1] <= regions[p[0]][1] - size for p in placement))
                if not ok:
                    raise ProtocolError("bad tcp cache descriptor")
                regions = [tuple(r) for r in regions]
                placement = [tuple(p) for p in placement]
                kinds = (_native.REGION_TCP, link.tcp_id, 0)
            else:
                raise ProtocolError(f"unknown cache kind {kind!r}")
            rids = []
            for base, length in regions:
                st, rid = self._core.region_add(kinds[0], kinds[1], base, length, kinds[2])
                if not st and kinds[0] == _native.REGION_PROCESS:
                    # CMA names the peer by the pidfd of the process that connected, not by a
                    # pid that another process could get once the peer is gone (one duplicate
                    # per link in the core, keyed by the link's serial)
                    st = self._core.region_pidfd(rid, -1 if link.pidfd is None else link.pidfd, link.serial)
                    if st:
                        self._core.region_remove(rid)
                if st:
                    for r in rids:
                        self._core.region_remove(r)
                    raise ProtocolError(f"cannot register the peer's cache (status {st:#x})")
                rids.append(rid)
            link.remote[cache_id] = RemoteCache(cache_id, desc, [(rids[ri], off) for ri, off in placement],
                                                rids, keep)
            for fut in link.waiters.pop(cache_id, ()):
                if not fut.done():
                    fut.set_result(S.LLM_SUCCESS)
        finally:
            for fd in fds:
                os.close(fd)

    async def wait_link(self, cluster_id: int, timeout: float | None = None) -> S:
        """Wait until a link with ``cluster_id`` is up, made by either end (a listening
        decode engine uses it to learn that a prefill engine linked to it).

        Returns ``LLM_SUCCESS``; raises ``LLMTimeoutError`` after ``timeout``
        (default ``link_timeout``).
        """
        self._check_open()
        tmo = self._link_timeout(timeout)
        if cluster_id in self._links:
            return S.LLM_SUCCESS
        fut = self._loop.create_future()
        waiters = self._link_waiters.setdefault(cluster_id, [])
        waiters.append(fut)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), tmo)
        except asyncio.TimeoutError:
            raise error_for(S.LLM_TIMEOUT, f"cluster {cluster_id!r} did not link within {tmo:g} s") from None
        finally:
            if fut in waiters:
                waiters.remove(fut)

    async def wait_remote_cache(self, cluster_id: int, cache_id: int, timeout: float | None = None) -> S:
        """Wait until linked peer ``cluster_id`` has announced cache ``cache_id``.

        Caches a peer registers after linking reach this engine asynchronously;
        this is how a prefill worker waits for a decode worker's new cache.
        Returns ``LLM_SUCCESS`` or raises (``LLM_NOT_YET_LINK``, ``LLM_TIMEOUT``, or
        ``LLM_LINK_FAILED`` / ``LLM_NOT_YET_LINK`` if the link goes down meanwhile).
        """
        self._check_open()
        tmo = self._deadline(timeout)
        link = self._links.get(cluster_id)
        if link is None:
            raise error_for(S.LLM_NOT_YET_LINK, f"cluster {cluster_id!r} is not linked")
        if cache_id in link.remote:
            return S.LLM_SUCCESS
        fut = self._loop.create_future()
        link.waiters.setdefault(cache_id, []).append(fut)
        try:
            st = await asyncio.wait_for(asyncio.shield(fut), tmo)
        except asyncio.TimeoutError:
            raise error_for(S.LLM_TIMEOUT, f"cluster {cluster_id} did not announce cache {cache_id} "
                                           f"within {tmo:g} s") from None
        finally:
            futs = link.waiters.get(cache_id)
            if futs and fut in futs:
                futs.remove(fut)
                if not futs:
                    del link.waiters[cache_id]
        if st != S.LLM_SUCCESS:
            raise error_for(st, f"the link to cluster {cluster_id} went down")
        return st

    # ---------------------------------------------------------- a live link

    async def _read_link(self, link: Link) -> None:
        """Serve one link's control messages until it closes."""
        reason = "peer closed the control connection"
        try:
            while True:
                item = await link.ch.recv()
                if item is None:
                    break
                link.last_rx = self._loop.time()
                msg, fds = item
                t = msg["t"]
                if t == "ping":
                    for fd in fds:
                        os.close(fd)
                    ts = msg.get("ts")
                    if ts is not None:   # the peer holds a mover lease: echo its clock at once
                        link.ch.send_nowait({"t": "pong", "ts": ts})
                elif t == "pong":
                    self._on_pong(link, msg)
                elif t == "cache_add":
                    await self._on_cache_add(link, msg, fds)
                elif t == "cache_del":
                    self._spawn(self._on_cache_del(link, msg))
                elif t == "unlink":
                    self._spawn(self._on_unlink(link, msg))
                elif t == "notify":
                    self._on_notify(link, msg)
                elif t == "ok":
                    fut = link.pending.pop(msg.get("req"), None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                else:
                    raise ProtocolError(f"unknown control message {t!r}")
        except ProtocolError as e:
            reason = f"protocol error: {e}"
        except asyncio.CancelledError:
            reason = "engine closing"
            raise
        finally:
            if link.up and not link.closing:
                log.warning("link %s <-> %s lost: %s", self.cluster_id, link.cluster_id, reason)
                self._link_down(link, S.LLM_LINK_FAILED)

    def _on_pong(self, link: Link, msg: dict) -> None:
        """The peer echoed the clock of one of our pings: renew the mover lease from it
        (from when we asked, not from now: a pong read late after a stop is stale)."""
        ts = msg.get("ts")
        if isinstance(ts, bool) or not isinstance(ts, int) or not 0 < ts <= boot_ns():
            raise ProtocolError(f"bad pong {ts!r}")
        until = ts + mover_lease_ns(self.options.heartbeat_timeout)
        if link.lease_id and until > link.lease_until:
            link.lease_until = until
            self._core.lease_renew(link.lease_id, until)

    async def _heartbeat(self, link: Link) -> None:
        """Ping every heartbeat_interval; a peer silent for heartbeat_timeout is lost.

        On a shm link pings carry our clock for the mover lease, and go at least every
        third of the lease, so that it never runs out while the peer answers."""
        interval, limit = self.options.heartbeat_interval, self.options.heartbeat_timeout
        if link.lease_id:
            interval = min(interval, mover_lease_ns(limit) / 3e9)
        loop = self._loop
        while link.up:
            t0 = loop.time()
            await asyncio.sleep(interval)
            if not link.up:
                return
            if loop.time() - t0 > 2 * interval:
                # Our own loop was blocked: the peer's pings may be sitting unread in the
                # socket. Judge the peer only on time this loop was able to listen.
                link.last_rx = max(link.last_rx, loop.time() - interval)
            silent = loop.time() - link.last_rx
            if silent > limit:
                for _ in range(2):   # let the reader take what already arrived
                    await asyncio.sleep(0)
                silent = loop.time() - link.last_rx
            if silent > limit and link.up:
                log.warning("link %s <-> %s lost: no message for %.2f s (heartbeat_timeout %.2f s)",
                            self.cluster_id, link.cluster_id, silent, limit)
                self._link_down(link, S.LLM_LINK_FAILED)
                return
            # Never wait on the peer here: a ping stuck behind a connection the peer does not
            # read must not stop the judgement above (a ping that does not fit is skipped).
            link.ch.send_nowait({"t": "ping", "ts": boot_ns()} if link.lease_id else {"t": "ping"})

    async def _request(self, link: Link, msg: dict, timeout: float) -> dict | None:
        req = next(link._reqs)
        fut = self._loop.create_future()
        link.pending[req] = fut
        try:
            async with asyncio.timeout(timeout):   # the send too: the peer may not be reading
                await link.ch.send(dict(msg, req=req))
                return await fut
        except (ConnectionError, TimeoutError, ProtocolError):
            return None
        finally:
            link.pending.pop(req, None)

    async def _reply(self, link: Link, msg: dict) -> None:
        """Send an answer, waiting at most link_timeout for the peer to take it."""
        try:
            async with asyncio.timeout(self.options.link_timeout):
                await link.ch.send(msg)
        except (ConnectionError, TimeoutError, ProtocolError):
            pass

    async def _on_cache_del(self, link: Link, msg: dict) -> None:
        rc = link.remote.pop(msg.get("id"), None)
        if rc is not None:
            await wait_idle(rc)  # bounded: each transfer has a deadline
            for rid in rc.region_ids:
                self._core.region_remove(rid)
            rc.keep = None
        if link.up:
            await self._reply(link, {"t": "ok", "req": msg.get("req")})

    async def _on_unlink(self, link: Link, msg: dict) -> None:
        link.closing = True
        await self._fence_link(link, S.LLM_NOT_YET_LINK)
        await self._reply(link, {"t": "ok", "req": msg.get("req")})
        self._link_down(link, S.LLM_NOT_YET_LINK)

    async def _fence_link(self, link: Link, status: S) -> None:
        """Abort every transfer on the link and wait until none can write any more."""
        transfers = list(link.inflight)
        for t in transfers:
            t._abort(status)
        for t in transfers:
            await t._fenced()

    def _link_down(self, link: Link, status: S) -> None:
        if not link.up:
            return
        link.up = False
        if not link.gone.done():
            link.gone.set_result(status)
        if self._links.get(link.cluster_id) is link:
            del self._links[link.cluster_id]
        for t in list(link.inflight):
            t._abort(status)
        link.heap.clear()
        if link.lease_id:   # our movers start no more chunks into the peer's memory
            self._core.lease_remove(link.lease_id)
            link.lease_id = 0
        if link.tcp_id:   # closes the data streams; the link's jobs complete with `status`
            self._core.tcp_link_close(link.tcp_id, int(status))
            self._tcp_links.pop(link.tcp_id, None)
            link.tcp_id = 0
        self._drop_remote(link)
        for fut in link.pending.values():
            if not fut.done():
                fut.set_result(None)
        for futs in link.waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_result(status)
        link.waiters.clear()
        self._close_pidfd(link)
        link.ch.close()
        for task in (link.reader, link.beat):
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    def _drop_remote(self, link: Link) -> None:
        # Regions are refcounted natively: a mapping a job still uses survives until it ends.
        for rc in link.remote.values():
            for rid in rc.region_ids:
                self._core.region_remove(rid)
        link.remote.clear()

    async def unlink_clusters(self, clusters: Sequence[ClusterInfo], timeout: float | None = None,
                              force: bool = False) -> tuple[S, list[S]]:
        """Tear links down: ``(overall status, [status per cluster])``.

        Normal unlink tells the peer, which aborts (fenced) its transfers to us
        first; ``force=True`` only drops this end. Unknown cluster: ``LLM_NOT_YET_LINK``.
        """
        self._check_open()
        timeout = self._link_timeout(timeout)
        if isinstance(clusters, ClusterInfo) or not isinstance(clusters, (list, tuple)) or not clusters:
            return S.LLM_PARAM_INVALID, []
        ids = [c.remote_cluster_id for c in clusters if isinstance(c, ClusterInfo)]
        results = []
        for c in clusters:
            if not isinstance(c, ClusterInfo) or ids.count(c.remote_cluster_id) > 1:
                results.append(_const(S.LLM_PARAM_INVALID))   # as link_clusters does
                continue
            link = self._links.get(c.remote_cluster_id)
            results.append(self._unlink_one(link, timeout, graceful=not force) if link
                           else _const(S.LLM_NOT_YET_LINK))
        done = await asyncio.gather(*results)
        return overall(done), done

    async def _unlink_one(self, link: Link, timeout: float, graceful: bool,
                          fence_status: S = S.LLM_NOT_YET_LINK) -> S:
        status = S.LLM_SUCCESS
        link.closing = True
        await self._fence_link(link, fence_status)
        if graceful and link.up:
            reply = await self._request(link, {"t": "unlink"}, timeout)
            if reply is None:
                status = S.LLM_NOTIFY_PROMPT_UNLINK_FAILED
        self._link_down(link, S.LLM_NOT_YET_LINK)
        return status

    # ------------------------------------------------------------ server side
    #
    # Before a peer authenticated it costs little and reserves nothing: hello-phase frames
    # are at most HELLO_MAX bytes (a larger length prefix closes the connection unread),
    # the phase lasts at most min(link_timeout, HELLO_PHASE_MAX), and the cluster id is
    # reserved only once the attach carried a valid proof. Unauthenticated connections
    # (TCP, and Unix before the join) are counted per source (IP address; uid on the
    # Unix socket). A newcomer whose source already has MAX_PREAUTH_PER_SOURCE waiting
    # closes the oldest of them if that one waited PREAUTH_GRACE. Otherwise, once
    # MAX_PREAUTH wait in all, it closes the oldest one of the busiest source: at once if
    # that source has more waiting than the newcomer's would (a flood from some sources
    # does not lock others out), else if that one waited PREAUTH_GRACE. If nothing may be
    # closed (a burst of real peers: their handshakes take milliseconds), the newcomer
    # waits as well, up to MAX_PREAUTH_BURST in all; beyond, it is closed at once.

    def _hello_window(self) -> float:
        return min(self.options.link_timeout, control.HELLO_PHASE_MAX)

    def _preauth_enter(self, source: Any, close) -> tuple | None:
        """Count an unauthenticated connection (``close`` closes it at once); returns its
        slot, or None if it must be closed now."""
        now = self._loop.time()
        mine = len(self._preauth.get(source, ()))
        evict = None
        if mine >= control.MAX_PREAUTH_PER_SOURCE:
            crowded, force = source, False
        elif self._preauth_count >= control.MAX_PREAUTH:
            crowded = max(self._preauth, key=lambda k: len(self._preauth[k]))
            force = len(self._preauth[crowded]) > mine + 1   # a heavier source pays, at once
        else:
            crowded = None
        if crowded is not None:
            oldest, since = next(iter(self._preauth[crowded].items()))
            if force or now - since >= control.PREAUTH_GRACE:
                evict = (crowded, oldest)
            elif self._preauth_count >= control.MAX_PREAUTH_BURST:
                return None
        if evict is not None:
            self._preauth_leave(evict)
            evict[1]()   # its handler sees the EOF and counts it in control_refused
        self._preauth.setdefault(source, {})[close] = now
        self._preauth_count += 1
        return source, close

    def _preauth_leave(self, slot: tuple | None) -> None:
        if slot is None:
            return
        source, close = slot
        per = self._preauth.get(source)
        if per is not None and close in per:
            del per[close]
            self._preauth_count -= 1
            if not per:
                del self._preauth[source]

    async def _on_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ch = StreamChannel(reader, writer)
        peer, local = writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        slot = self._preauth_enter(peer[0] if isinstance(peer, tuple) else "?", ch.abort)
        if slot is None:
            self._counts["control_refused"] += 1
            ch.abort()
            return
        joining = None
        keep = handed = False
        try:
            try:
                async with asyncio.timeout(self._hello_window()):
                    item = await ch.recv(control.HELLO_MAX)
                    if item is None:   # closed (or cut short, or evicted) before a whole hello
                        self._counts["control_refused"] += 1
                        return
                    h = item[0]
                    reply, nonce = self._answer_hello(h, control.is_local_peer(peer, local))
                    await ch.send(reply)
                    if nonce is None:
                        return
                    item = await ch.recv(control.HELLO_MAX)
                    if item is None:
                        self._counts["control_refused"] += 1
                        return
                    reply, joining = self._answer_attach(item[0], h, reply, nonce)
                    await ch.send(reply)
                    if joining is None:
                        return
            except (TimeoutError, ProtocolError, OSError) as e:
                self._counts["control_refused"] += 1
                log.info("control connection dropped during hello: %s", e)
                return
            self._preauth_leave(slot)   # authenticated: the cluster id is reserved for it
            slot = None
            if joining.transport == "tcp":
                handed = True   # _attach_tcp ends the reservation
                keep = await self._attach_tcp(ch, joining, reply)
            else:
                # The client joins over Unix; it keeps this connection open until the link
                # is up, and its EOF (or link_timeout) ends an unused reservation.
                async with asyncio.timeout(self.options.link_timeout):
                    await ch.recv(control.HELLO_MAX)
        except (TimeoutError, ProtocolError, OSError, KeyError, TypeError, ValueError) as e:
            log.info("control connection of cluster %s dropped: %s",
                     joining.cluster_id if joining else "?", e)
        finally:
            self._preauth_leave(slot)
            if not keep:
                ch.close()
            if joining is not None and joining.transport != "tcp":
                self._expire_join(reply.get("join"))
            elif joining is not None and not handed:   # the attached never reached the client
                self._linking.discard(joining.cluster_id)

    def _cluster_busy(self, cid: int) -> tuple[S, str] | None:
        """Why a link with ``cid`` cannot be set up now, or None."""
        if self._closed:
            return S.LLM_LINK_FAILED, "engine closing"
        if cid in self._links:
            return S.LLM_ALREADY_LINK, f"cluster {cid} is already linked"
        if cid in self._linking:
            return S.LLM_PROCESSING_LINK, f"a link with cluster {cid} is being set up"
        return None

    def _answer_hello(self, h: dict, local_peer: bool) -> tuple[dict, str | None]:
        """The reply to a hello and our nonce (None: the reply is a reject). Reserves nothing."""
        def reject(status: S, msg: str) -> tuple[dict, None]:
            log.warning("refusing link from cluster %.40r: %s", h.get("cluster"), msg)
            return {"t": "reject", "status": int(status), "msg": msg}, None

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
        if cid == self.cluster_id:
            return reject(S.LLM_PARAM_INVALID, f"cluster id {cid} is this engine's own")
        busy = self._cluster_busy(cid)
        if busy is not None:
            return reject(*busy)
        if h["auth"] != (self.options.secret is not None):
            return reject(S.LLM_LINK_FAILED, "authentication mismatch: one engine has a secret, the other not")
        if self.options.secret is None and not self.options.insecure and not local_peer:
            return reject(S.LLM_LINK_FAILED, NO_SECRET_MSG)
        same_host = h["host"] == self._host
        same_process = same_host and h["process"] == control.process_tag()
        prefs = {h["transport"], self.options.transport} - {"auto"}
        if len(prefs) > 1:
            return reject(S.LLM_LINK_FAILED, f"transports conflict: {sorted(prefs)}")
        want = prefs.pop() if prefs else None
        if want == "tcp" or not same_host:
            if want in ("local", "shm"):
                return reject(S.LLM_LINK_FAILED, f"transport {want!r} needs both engines on one host")
            transport = "tcp"
        elif want == "local" or (want is None and same_process):
            if not same_process:
                return reject(S.LLM_LINK_FAILED, "transport 'local' needs both engines in one process")
            transport = "local"
        else:
            transport = "shm"
        if transport == "tcp" and self._data_port is None:
            return reject(S.LLM_LINK_FAILED, "this engine has no data port")
        nonce = control.new_nonce()
        return {"t": "welcome", "v": control.PROTOCOL_VERSION, "cluster": self.cluster_id,
                "transport": transport, "nonce": nonce, "streams": min(h["streams"], self.options.tcp_streams),
                "proof": (control.proof(self.options.secret, "server", h["nonce"], nonce)
                          if self.options.secret is not None else None)}, nonce

    def _answer_attach(self, msg: dict, h: dict, welcome: dict, nonce: str) -> tuple[dict, _Joining | None]:
        """Check the attach's proof; then reserve the cluster id and say where to go next."""
        cid, transport = h["cluster"], welcome["transport"]

        def reject(status: S, why: str) -> tuple[dict, None]:
            log.warning("refusing link from cluster %s: %s", cid, why)
            return {"t": "reject", "status": int(status), "msg": why}, None

        if msg.get("t") != "attach":
            return reject(S.LLM_LINK_FAILED, f"expected an attach, got {msg.get('t')!r}")
        if not control.check_proof(self.options.secret, msg.get("proof"), "client", nonce, h["nonce"]):
            return reject(S.LLM_LINK_FAILED, "authentication failed")
        ptoken = msg.get("ptoken") if transport == "local" else ""
        if not isinstance(ptoken, str) or len(ptoken) > 64:
            return reject(S.LLM_LINK_FAILED, "malformed attach: bad 'ptoken'")
        busy = self._cluster_busy(cid)   # again: it may have changed since the hello
        if busy is not None:
            return reject(*busy)
        self._linking.add(cid)
        joining = _Joining(cid, transport, welcome["streams"], ptoken)
        if transport == "tcp":
            return {"t": "attached", "data_port": self._data_port,
                    "data_token": secrets.token_hex(_native.TOKEN_BYTES)}, joining
        token = control.new_nonce()
        joining.expiry = self._loop.call_later(self.options.link_timeout, self._expire_join, token)
        self._joins[token] = joining
        reply = {"t": "attached", "unix": self._unix_name, "join": token}
        if transport == "local":
            reply["ptoken"] = self._token
        return reply, joining

    def _expire_join(self, token: Any) -> None:
        joining = self._joins.pop(token, None) if isinstance(token, str) else None
        if joining is not None:
            joining.expiry.cancel()
            self._linking.discard(joining.cluster_id)

    def _on_unix_accept(self) -> None:
        while True:
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
                source = f"unix:{control.peer_uid(sock)}"
            except OSError:
                source = "unix:?"
            slot = self._preauth_enter(source, ch.close)
            if slot is None:
                self._counts["control_refused"] += 1
                ch.close()
                continue
            self._spawn(self._on_unix_conn(ch, slot))

    async def _on_unix_conn(self, ch: SeqpacketChannel, slot: tuple) -> None:
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
            joining = self._joins.pop(msg.get("token"), None) if msg.get("t") == "join" and \
                isinstance(msg.get("token"), str) else None
            if joining is None:
                await ch.send({"t": "reject", "status": int(S.LLM_LINK_FAILED), "msg": "unknown join token"})
                return
            joining.expiry.cancel()
            self._preauth_leave(slot)
            slot = None
            pid, pidfd = _peer_process(ch.sock, joining.transport, joining.peer_token)
            ch.release()
            link = Link(joining.cluster_id, ch, joining.transport, pid, joining.peer_token, "", pidfd)
            pidfd = None
            async with asyncio.timeout(self.options.link_timeout):
                keep = await self._establish(link, False) == S.LLM_SUCCESS
            if keep:
                link = None
        except (TimeoutError, ProtocolError, OSError, KeyError, TypeError, ValueError) as e:
            log.warning("link attach failed: %s", e)
        finally:
            self._preauth_leave(slot)
            if joining is not None:
                self._linking.discard(joining.cluster_id)
            if pidfd is not None:
                os.close(pidfd)
            if link is not None:
                link.ch = _Detached(ch)
                self._abandon(link)
            if not keep:
                ch.close()

    async def _attach_tcp(self, ch: StreamChannel, joining: _Joining, attached: dict) -> bool:
        """Server side of a TCP link after a valid attach: the data link, then the tables."""
        cid, streams, data_token = joining.cluster_id, joining.streams, attached["data_token"]
        link = None
        try:
            link = Link(cid, ch, "tcp", 0, "", "")
            self._add_data_link(link, data_token, streams)
            async with asyncio.timeout(self.options.link_timeout):
                if await self._establish(link, False) == S.LLM_SUCCESS:
                    link = None
                    return True
            return False
        finally:
            self._linking.discard(cid)
            if link is not None:
                link.ch = _Detached(ch)   # the caller closes the channel itself
                self._abandon(link)

    # --------------------------------------------------------------- native events

    def _on_link_event(self, kind: int, link_id: int, status: int) -> None:
        if kind == _native.EVENT_LINK_READY:
            fut = self._tcp_ready.get(link_id)
            if fut is not None and not fut.done():
                fut.set_result(S.LLM_SUCCESS)
        elif kind == _native.EVENT_LINK_DOWN:
            fut = self._tcp_ready.get(link_id)
            if fut is not None and not fut.done():
                fut.set_result(S.LLM_LINK_FAILED)
            link = self._tcp_links.get(link_id)
            if link is not None and link.up and not link.closing:
                log.warning("link %s <-> %s lost: a data stream failed (%s)%s", self.cluster_id,
                            link.cluster_id, to_status(status, S.LLM_LINK_FAILED).name, self._why_down())
                self._link_down(link, S.LLM_LINK_FAILED)
            # closing: an unlink is under way and finishes the link itself (the peer may
            # close its streams before its "ok" reached us)

    def _why_down(self) -> str:
        """What the core counted since the last link failure, as advice for the log."""
        st = self._core.stats()
        seen, self._down_counts = self._down_counts, {k: st.get(k, 0) for k in _DOWN_HINTS}
        return "".join(hint for k, hint in _DOWN_HINTS.items() if self._down_counts[k] > seen.get(k, 0))


# Native failure counters, and what each one tells the operator when a link fails.
_DOWN_HINTS = {
    "tcp_lease_expired": "; our lease on a data stream expired before the peer renewed it: "
                         "a stalled receiver, or a link slower than about (tcp_window_bytes + "
                         "chunk_bytes) / (0.3 * heartbeat_timeout): raise heartbeat_timeout or lower "
                         "tcp_window_bytes (docs/protocol.md, Leases)",
    "tcp_fence_expired": "; the peer did not acknowledge an abort within 0.5 * heartbeat_timeout",
    "tcp_stalled": "; a data stream made no progress for heartbeat_timeout",
    "tcp_bad_frames": "; the peer sent a malformed or impossible frame",
}


class _Detached:
    """Stands in for a channel its caller still owns."""

    def __init__(self, ch: Any) -> None:
        self._ch = ch

    def close(self) -> None:
        pass
