"""Hostile peers against the control plane (tests/hostile.py speaks the protocol from
docs/protocol.md; the victim engine runs in a child process where the finding is about
one process reaching into another, or about the victim's memory).

Each test names what an engine did before this was fixed, and fails on such an engine:
- a claimed pid steered CMA writes into the victim's own memory (both ends),
- the welcome disclosed pid, Unix name, data port and tokens before authentication,
- memfd caches were unsealed (a peer could shrink them under the owner) and peers' memfds
  were mapped unsealed, larger than the descriptor, or sparse,
- unauthenticated connections could hold 4 MiB each, a hello reserved its cluster id,
  and a length prefix up to 4 MiB was waited for,
- a hello without a field raised in the server instead of getting a reject,
- a peer could announce any number of caches,
- without a secret anyone who reached the port could link.
"""

import asyncio
import ctypes
import fcntl
import json
import os
import resource
import secrets
import socket
import struct

import numpy as np
import pytest

import kvengine as kv
from kvengine import LLMStatusCode as S
from kvengine._peer import PeerProcess, fill_pattern, map_fixed
import hostile as H

SECRET = b"security-test-secret"
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def pattern(seed: int, tensor: int, nbytes: int) -> bytes:
    a = np.zeros(nbytes, np.uint8)
    fill_pattern(a, seed, tensor)
    return a.tobytes()


async def engine(cid: int, **opts) -> kv.KvEngine:
    opts.setdefault("secret", SECRET)
    return await kv.KvEngine(cid, kv.Role.DECODER, "127.0.0.1:0", kv.EngineOptions(**opts)).start()


@pytest.fixture(autouse=True)
async def no_leftover_sockets():
    yield
    H.close_all()
    await asyncio.sleep(0)   # let the transports finish closing before the loop's teardown


@pytest.fixture
async def victim():
    """An engine (cluster 2, with the secret) in a child process."""
    peer = await PeerProcess.start(cluster_id=2, secret=SECRET, options={"link_timeout": 30.0})
    try:
        yield peer
    finally:
        await peer.close()


async def canary_page(victim: PeerProcess) -> int:
    """An address mapped (one page) both here (0xCD bytes) and in the victim (0xAB bytes)."""
    rng = secrets.SystemRandom()
    for _ in range(64):
        addr = rng.randrange(0x200000000000, 0x300000000000, 1 << 30)
        if map_fixed(addr, PAGE) is None:
            continue
        ctypes.memset(addr, 0xCD, PAGE)
        if (await victim.call("canary", addr=addr, size=PAGE, byte=0xAB))["addr"] == addr:
            return addr
    pytest.skip("no address free in both processes")


async def victim_links(victim: PeerProcess) -> dict:
    return (await victim.call("stats"))["stats"]["links"]


# ----------------------------------------------------------------------------- CMA


async def test_cma_writes_reach_the_connected_process_not_a_claimed_pid(victim):
    """Server side: a peer that claims the victim's own pid (as the old hello carried it)
    and announces a 'cma' cache at an address of its choosing: the victim's push must
    write into the peer's own memory (its pid comes from SO_PEERCRED), never its own."""
    addr = await canary_page(victim)
    src = (await victim.call("alloc", n=1, shape=[1, PAGE], dtype="uint8", fill=5))["cache_id"]
    s = await H.handshake(victim.address, 9, SECRET, transport="shm", pid=victim.pid, token="0" * 32)
    try:
        await s.link(table=[{"t": "cache_add", "id": 1, "kind": "cma", "addrs": [addr],
                             "desc": {"n": 1, "shape": [1, PAGE], "dtype": 4, "placement": 0}}])
        s.keepalive()
        st = (await victim.call("push", cache_id=src, cluster_id=9, dst_cache_id=1))["status"]
        assert (await victim.call("peek", addr=addr, size=PAGE))["hex"] == "ab" * PAGE, \
            "the push wrote into the victim's own memory at an address the peer chose"
        if st == S.LLM_SUCCESS:   # CMA into this (the connected) process is allowed here
            assert ctypes.string_at(addr, PAGE) == pattern(5, 0, PAGE)
        else:
            assert st == S.LLM_LINK_FAILED and ctypes.string_at(addr, PAGE) == b"\xcd" * PAGE
    finally:
        s.close()


class _HostileServer:
    """The server side of a link, hostile: it answers a client's hello (either protocol
    version: an old client gets the old welcome, claiming `claimed_pid`) and then, over its
    own Unix socket, announces a 'cma' cache at `addr`."""

    def __init__(self, cluster: int, claimed_pid: int, addr: int) -> None:
        self.cluster, self.claimed_pid, self.addr = cluster, claimed_pid, addr
        self.unix_name = "hostile/" + secrets.token_hex(8)
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.unix.bind("\0" + self.unix_name)
        self.unix.listen(4)
        self.unix.setblocking(False)
        self.tasks: list[asyncio.Task] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.chans: list[H.Unix] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._on_tcp, "127.0.0.1", 0)
        self.tasks.append(asyncio.ensure_future(self._on_unix()))
        return "127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]

    async def _on_tcp(self, reader, writer) -> None:
        self.tasks.append(asyncio.current_task())
        self.writers.append(writer)
        ctl = H.Control(reader, writer)
        h = await ctl.recv()
        sn = secrets.token_hex(16)
        w = {"t": "welcome", "v": H.PROTOCOL_VERSION, "cluster": self.cluster, "transport": "shm", "nonce": sn,
             "inc": "0" * 16, "streams": 1, "proof": H.proof(SECRET, "server", h["nonce"], sn)}
        if "pid" in h:   # an old client: everything in the welcome, pid included
            w.update(pid=self.claimed_pid, ptoken="0" * 32, unix=self.unix_name, token="t" * 32,
                     data_port=1, data_token="00" * 32)
            ctl.send(w)
        else:
            ctl.send(w)
            await ctl.recv()   # attach
            ctl.send({"t": "attached", "unix": self.unix_name, "join": "j" * 32})
        await ctl.closed(30)

    async def _on_unix(self) -> None:
        loop = asyncio.get_running_loop()
        sock, _ = await loop.sock_accept(self.unix)
        ch = H.Unix(sock)
        self.chans.append(ch)
        await ch.recv()   # join (or the old attach)
        await ch.send({"t": "cache_add", "id": 1, "kind": "cma", "addrs": [self.addr],
                       "desc": {"n": 1, "shape": [1, PAGE], "dtype": 4, "placement": 0}})
        await ch.send({"t": "ready"})
        while True:
            item = await ch.recv(30)
            if item is None or item[0]["t"] == "ready":
                break
        await ch.send({"t": "up"})
        while True:   # keep the link alive
            await ch.send({"t": "ping"})
            await asyncio.sleep(0.2)   # heartbeat period

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), 10)
        for w in self.writers:
            w.close()
        for ch in self.chans:
            ch.close()
        self.server.close()
        await self.server.wait_closed()
        self.unix.close()


async def test_cma_client_side_ignores_a_pid_claimed_by_the_server(victim):
    """Client side: the victim links to a hostile server whose welcome claims the victim's
    pid; the victim's push must not write into its own memory."""
    addr = await canary_page(victim)
    src = (await victim.call("alloc", n=1, shape=[1, PAGE], dtype="uint8", fill=6))["cache_id"]
    server = _HostileServer(9, victim.pid, addr)
    address = await server.start()
    try:
        assert (await victim.call("link", cluster_id=9, address=address))["status"] == S.LLM_SUCCESS
        st = (await victim.call("push", cache_id=src, cluster_id=9, dst_cache_id=1))["status"]
        assert (await victim.call("peek", addr=addr, size=PAGE))["hex"] == "ab" * PAGE, \
            "the push wrote into the victim's own memory at an address the peer chose"
        if st == S.LLM_SUCCESS:
            assert ctypes.string_at(addr, PAGE) == pattern(6, 0, PAGE)
    finally:
        await server.close()


# ----------------------------------------------------------------------- disclosure

_PRIVATE_KEYS = {"pid", "ptoken", "unix", "token", "join", "data_port", "data_token"}


async def test_nothing_is_disclosed_before_the_peer_authenticated():
    e = await engine(2)
    try:
        for transport in ("shm", "tcp"):
            ctl = await H.Control.open(e.address)
            ctl.send(H.hello(5, auth=True, transport=transport))
            w = await ctl.recv()
            assert w["t"] == "welcome" and not _PRIVATE_KEYS & set(w), w
            ctl.send({"t": "attach", "proof": "00" * 32, "ptoken": "x"})   # a wrong proof
            r = await ctl.recv()
            assert r is None or (r["t"] == "reject" and not _PRIVATE_KEYS & set(r)), r
            for got in (w, r or {}):
                text = json.dumps(got)
                assert e._token not in text and e._p.acceptor.unix_name not in text   # the secrets themselves
            ctl.close()
        assert e.stats()["links"] == {}

        # the client side: a server that cannot prove the secret learns no pid, no engine
        # token, and gets nothing after the hello
        seen: list[bytes] = []
        finished = asyncio.get_running_loop().create_future()

        async def fake(reader, writer):
            ctl = H.Control(reader, writer)
            h = await ctl.recv()
            seen.append(json.dumps(h).encode())
            ctl.send({"t": "welcome", "v": H.PROTOCOL_VERSION, "cluster": 7, "transport": "shm", "nonce": "11" * 16,
                      "inc": "0" * 16, "streams": 1, "proof": "22" * 32, "pid": 1, "ptoken": "0" * 32, "unix": "x",
                      "token": "t", "data_port": 1, "data_token": "00" * 32})
            try:
                seen.append(await asyncio.wait_for(reader.read(), 10))
            except ConnectionError:
                seen.append(b"")
            writer.close()
            finished.set_result(None)

        server = await asyncio.start_server(fake, "127.0.0.1", 0)
        try:
            port = server.sockets[0].getsockname()[1]
            st, per = await e.link_clusters([kv.ClusterInfo(7, f"127.0.0.1:{port}")])
            assert per == [S.LLM_LINK_FAILED]
            await asyncio.wait_for(finished, 10)
        finally:
            server.close()
            await server.wait_closed()
        hello = json.loads(seen[0])
        assert not {"pid", "token", "ptoken"} & set(hello), hello
        assert e._token.encode() not in seen[0]
        assert seen[1] == b"", "the client went on talking to a server that failed its proof"
    finally:
        await e.close()


# ---------------------------------------------------------------------------- memfd


async def test_a_received_memfd_cannot_be_resized(victim):
    """A peer keeps the memfd of the victim's cache: it can neither shrink it (the victim's
    own mapping would SIGBUS) nor grow it, nor add seals."""
    cid = (await victim.call("alloc", n=2, shape=[2, 4096], dtype="uint8", fill=3))["cache_id"]
    s = await H.handshake(victim.address, 9, SECRET, transport="shm", pid=os.getpid(), token="0" * 32)
    try:
        table = await s.link(keep_fds=True)
        msg = table[cid]
        assert msg["kind"] == "memfd"
        fd = msg["fds"][0]
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, msg["len"] + PAGE)
            with pytest.raises(PermissionError):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0x10)   # F_SEAL_FUTURE_WRITE: no writable maps
            assert os.fstat(fd).st_size == msg["len"]
        finally:
            os.close(fd)
        rows = (await victim.call("digest", cache_id=cid))["rows"]   # its memory is intact
        assert len(rows) == 2
    finally:
        s.close()


def _memfd(name: str, size: int, populate: bool = True, seal: bool = True) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    if populate:
        os.posix_fallocate(fd, 0, size)
    else:
        os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


@pytest.mark.parametrize("bad", ["unsealed", "stride", "larger", "sparse"])
async def test_an_unsafe_memfd_is_refused_and_never_mapped(victim, bad):
    size = 2 * PAGE   # one tensor, (1, size) uint8
    stride = 2 * size if bad == "stride" else size
    actual = 2 * stride if bad == "larger" else stride
    name = f"hostile-{bad}-{secrets.token_hex(4)}"
    fd = _memfd(name, actual, populate=bad != "sparse", seal=bad != "unsealed")
    s = await H.handshake(victim.address, 9, SECRET, transport="shm", pid=os.getpid(), token="0" * 32)
    try:
        msg = {"t": "cache_add", "id": 1, "kind": "memfd", "len": stride, "stride": stride,
               "desc": {"n": 1, "shape": [1, size], "dtype": 4, "placement": 0}}
        with pytest.raises(H.HandshakeRefused):
            await s.link(table=[(msg, [fd])])
    finally:
        s.close()
        os.close(fd)
    with open(f"/proc/{victim.pid}/maps") as f:
        assert name not in f.read(), "the victim mapped the peer's memfd"
    assert "9" not in await victim_links(victim)


# -------------------------------------------------------------------- pre-auth limits


async def _stall(n: int, port: int, sources: list[str]) -> list[socket.socket]:
    """n connections, from `sources` in turn, each stalled inside a hello: every other one
    sends a partial hello within the cap, the others a length prefix just under 4 MiB and
    64 KiB of it."""
    loop = asyncio.get_running_loop()
    big = struct.pack("!I", (4 << 20) - 1) + b"{" * (64 << 10)
    partial = struct.pack("!I", 4000) + b'{"t": "hello", "v": 3, ' + b" " * 1000
    socks = []

    async def one(i: int) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind((sources[i % len(sources)], 0))
        socks.append(sock)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), 10)
            sock.send(big if i % 2 else partial)
        except (OSError, asyncio.TimeoutError):
            pass   # refused or reset by the engine: also fine

    for i in range(0, n, 50):
        await asyncio.gather(*(one(j) for j in range(i, min(n, i + 50))))
    return socks


async def _settled(victim: PeerProcess, want: int, timeout: float) -> dict:
    """Poll the victim's stats until every connection was either refused or is pending."""
    stats = {}
    try:
        async with asyncio.timeout(timeout):
            while True:
                stats = (await victim.call("stats"))["stats"]
                if stats["control_refused"] + stats.get("control_pending", 0) >= want:
                    return stats
    except TimeoutError:
        return stats


async def test_1000_stalled_connections_cost_little_and_the_cluster_links(victim):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    port = int(victim.address.rsplit(":", 1)[1])
    dst = (await victim.call("alloc", n=1, shape=[1, 4096], dtype="uint8"))["cache_id"]
    base = rss_kib(victim.pid)
    # from 10 addresses (127.0.0.1 is the real cluster's): more than the connections that
    # may wait unauthenticated at once (64; up to 256 while they are young), more than the
    # 16 per source
    socks = await _stall(1000, port, [f"127.0.0.{i}" for i in range(10, 20)])
    try:
        stats = await _settled(victim, 1000, 20)
        grown = rss_kib(victim.pid) - base
        assert grown <= 16 << 10, f"1000 stalled connections cost {grown} KiB of the engine's RSS"
        assert 0 < stats["control_pending"] <= 256
        assert stats["control_refused"] >= 1000 - 256
        # the real cluster links meanwhile, and works
        e = await engine(1)
        try:
            st, per = await e.link_clusters([kv.ClusterInfo(2, victim.address)])
            assert per == [S.LLM_SUCCESS]
            src = e.allocate_cache(kv.CacheDesc(1, (1, 4096), np.uint8))
            await e.wait_remote_cache(2, dst)
            assert await e.push_kv_cache(src, kv.CacheIndex(2, dst, 0)) == S.LLM_SUCCESS
        finally:
            await e.close()
    finally:
        for sock in socks:
            sock.close()


async def test_a_hello_reserves_nothing():
    """A stranger's hello (and a failed attach) claiming cluster 1 must not keep the real
    cluster 1 from linking."""
    d = await engine(2, link_timeout=30.0)
    strangers = []
    try:
        for transport in ("shm", "tcp"):
            ctl = await H.Control.open(d.address)
            ctl.send(H.hello(1, auth=True, transport=transport))
            assert (await ctl.recv())["t"] == "welcome"
            strangers.append(ctl)   # stalls after the welcome
        ctl = await H.Control.open(d.address)
        ctl.send(H.hello(1, auth=True))
        assert (await ctl.recv())["t"] == "welcome"
        ctl.send({"t": "attach", "proof": "ab" * 32})
        assert (await ctl.recv())["t"] == "reject"
        strangers.append(ctl)
        p = await engine(1)
        try:
            st, per = await p.link_clusters([kv.ClusterInfo(2, d.address)])
            assert per == [S.LLM_SUCCESS]
        finally:
            await p.close()
    finally:
        for ctl in strangers:
            ctl.close()
        await d.close()


@pytest.mark.parametrize("n", [4097, 1 << 20, (4 << 20) - 1, 1 << 31])
async def test_an_oversized_hello_is_refused_unread(n):
    d = await engine(2, link_timeout=30.0)
    try:
        ctl = await H.Control.open(d.address)
        ctl.send(struct.pack("!I", n))   # no body: the engine must not wait for it
        assert await ctl.closed(5), f"a {n}-byte length prefix kept the connection open"
        ctl.close()
        # a hello of exactly the cap is fine
        ctl = await H.Control.open(d.address)
        body = json.dumps(H.hello(5, auth=True)).encode()
        ctl.send(struct.pack("!I", 4096) + body + b" " * (4096 - len(body)))
        assert (await ctl.recv())["t"] == "welcome"
        ctl.close()
    finally:
        await d.close()


# --------------------------------------------------------------------- malformed input


def _hello(**change) -> dict:
    h = dict(H.hello(5, auth=True), **change)
    return {k: v for k, v in h.items() if v is not H.DROP}


def _malformed_hellos() -> list:
    out = [_hello(**{k: H.DROP}) for k in H.hello(5) if k != "t"]
    for k, v in (("cluster", "5"), ("cluster", True), ("cluster", -1), ("cluster", 2**64),
                 ("cluster", 1.5), ("role", "x"), ("host", 5), ("host", "h" * 1000), ("process", 5),
                 ("transport", 5), ("transport", "carrier-pigeon"), ("transport", None), ("streams", 0),
                 ("streams", 1000), ("streams", "4"), ("streams", True), ("auth", "yes"), ("auth", 1),
                 ("nonce", 5), ("nonce", "zz" * 16), ("nonce", "ab"), ("v", 1), ("v", 2), ("v", None), ("t", "attach"),
                 ("t", 5)):
        out.append(_hello(**{k: v}))
    return out


async def test_every_malformed_hello_gets_a_reject_or_a_close():
    d = await engine(2)
    try:
        for h in _malformed_hellos():
            ctl = await H.Control.open(d.address)
            ctl.send(h)
            r = await ctl.recv()
            if not isinstance(h["t"], str):   # not a control message at all: closed
                assert r is None, (h, r)
            else:
                assert r is not None and r["t"] == "reject" and isinstance(r["status"], int), (h, r)
            ctl.close()
        for raw in (b"[]", b'"hello"', b"5", b"null", b"\xff\xfe", b"{", b'{"t": 5}'[:4],
                    b"[" * 2000 + b"]" * 2000, b'{"t": "hello", "v": ' + b"[" * 1900 + b"]" * 1900 + b"}"):
            ctl = await H.Control.open(d.address)
            ctl.send(H.frame(raw))
            r = await ctl.recv()
            assert r is None or r["t"] == "reject", (raw, r)
            ctl.close()
        # malformed attaches after a good welcome
        for attach in ({"t": "attach"}, {"t": "attach", "proof": 5}, {"t": "attach", "proof": ["x"]},
                       {"t": "hello"}, {"t": "attach", "proof": None}):
            ctl = await H.Control.open(d.address)
            ctl.send(H.hello(5, auth=True))
            assert (await ctl.recv())["t"] == "welcome"
            ctl.send(attach)
            r = await ctl.recv()
            assert r is None or r["t"] == "reject", (attach, r)
            ctl.close()
        # the engine still links
        p = await engine(1)
        try:
            assert (await p.link_clusters([kv.ClusterInfo(2, d.address)]))[1] == [S.LLM_SUCCESS]
        finally:
            await p.close()
    finally:
        await d.close()


async def test_the_caches_a_peer_announces_are_bounded(caplog):
    caplog.set_level("INFO", logger="kvengine")
    d = await engine(2, link_timeout=60.0)   # 65537 messages: seconds on a loaded host
    s = await H.handshake(d.address, 9, SECRET, transport="tcp", pid=os.getpid(), token="0" * 32)
    try:
        await s.read_table()
        s.data.append(await H.Data.open(s.host, s.data_port, s.data_token))
        desc = {"n": 1, "shape": [1, 64], "dtype": 4, "placement": 0}
        for i in range(65537):
            s.ch.send({"t": "cache_add", "id": i + 1, "desc": desc, "kind": "tcp",
                       "regions": [[i + 1, 64]], "placement": [[0, 0]]})
            if i % 1024 == 0:
                try:
                    await s.ch.writer.drain()
                except ConnectionError:
                    break
        with pytest.raises(H.HandshakeRefused):
            await s.finish(timeout=60)
        assert d.stats()["links"] == {}
        assert "more than 65536 caches" in caplog.text
    finally:
        s.close()
        await d.close()


async def test_a_notification_over_the_size_a_sender_may_send_fails_the_link():
    """A peer's notify payload is held until the decode worker takes it (up to
    max_notifications of them): one over MAX_NOTIFY (4 KiB, what push_kv_cache's notify
    may carry) is a protocol error, not megabytes buffered per message."""
    d = await engine(2)
    s = await H.handshake(d.address, 9, SECRET, transport="tcp")
    try:
        await s.link()
        s.keepalive()
        s.ch.send({"t": "notify", "p": "ab" * 4096, "s": 1})          # at the limit: delivered
        note = await d.wait_notification(timeout=5)
        assert note.payload == b"\xab" * 4096 and note.cluster_id == 9
        s.ch.send({"t": "notify", "p": "ab" * (1 << 20), "s": 2})     # 1 MiB: refused
        assert await s.ch.closed(timeout=10), "the link survived a 1 MiB notification"
        assert d.stats()["links"] == {}
        n = d.stats()["notifications"]
        assert n["received"] == 1 and n["pending"] == 0, n
    finally:
        s.close()
        await d.close()


# ------------------------------------------------------------------- safe by default


async def test_without_a_secret_a_remote_peer_is_refused_with_a_hint():
    """127.0.0.2 plays the remote host: not 127.0.0.1/::1, not the accepted socket's own address."""
    d = await engine(2, secret=None)
    try:
        ctl = await H.Control.open(d.address, source="127.0.0.2")
        ctl.send(H.hello(5, auth=False))
        r = await ctl.recv()
        assert r is not None and r["t"] == "reject" and r["status"] == S.LLM_LINK_FAILED, r
        assert "EngineOptions.secret" in r["msg"] and "insecure=True" in r["msg"], r
        ctl.close()
    finally:
        await d.close()
    # a peer connecting from the engine's own (listening) address counts as this host
    d = await kv.KvEngine(2, kv.Role.DECODER, "127.0.0.3:0", kv.EngineOptions(secret=None)).start()
    try:
        for source, want in (("127.0.0.3", "welcome"), ("127.0.0.2", "reject")):
            ctl = await H.Control.open(d.address, source=source)
            ctl.send(H.hello(5, auth=False))
            assert (await ctl.recv())["t"] == want, source
            ctl.close()
    finally:
        await d.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_insecure_links_a_remote_peer_and_no_secret_on_one_host_still_works(monkeypatch, transport):
    with pytest.raises(kv.LLMParamInvalidError, match="insecure"):
        kv.EngineOptions(insecure="yes")
    # one host, no secret: links as always
    p, d = await engine(1, secret=None, transport=transport), await engine(2, secret=None, transport=transport)
    try:
        assert (await p.link_clusters([kv.ClusterInfo(2, d.address)]))[1] == [S.LLM_SUCCESS]
    finally:
        await p.close()
        await d.close()
    # the client connects from 127.0.0.2: refused unless the server is insecure
    real = asyncio.open_connection
    monkeypatch.setattr(asyncio, "open_connection",
                        lambda host, port, **kw: real(host, port, local_addr=("127.0.0.2", 0), **kw))
    for insecure, want in ((False, S.LLM_LINK_FAILED), (True, S.LLM_SUCCESS)):
        p = await engine(1, secret=None, transport=transport)
        d = await engine(2, secret=None, transport=transport, insecure=insecure)
        try:
            assert (await p.link_clusters([kv.ClusterInfo(2, d.address)]))[1] == [want]
            if want == S.LLM_SUCCESS:
                src = p.allocate_cache(kv.CacheDesc(1, (1, 4096), np.uint8))
                src.tensors[0][...] = 7
                dst = d.allocate_cache(kv.CacheDesc(1, (1, 4096), np.uint8))
                await p.wait_remote_cache(2, dst.cache_id)
                await p.push_kv_cache(src, kv.CacheIndex(2, dst.cache_id, 0))
                assert (dst.tensors[0] == 7).all()
        finally:
            await p.close()
            await d.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_a_burst_of_real_peers_from_one_host_links(transport):
    """The pre-auth limits must not refuse real peers that all link at once (80 from one
    address: more than may wait unauthenticated per source, or in all, once they are old)."""
    o = kv.EngineOptions(secret=SECRET, transport=transport, movers=1, link_timeout=30.0)
    d = await kv.KvEngine(1000, kv.Role.DECODER, "127.0.0.1:0", o).start()
    ps = []
    try:
        for i in range(1, 81):
            ps.append(await kv.KvEngine(i, kv.Role.PROMPT, None, o).start())
        res = await asyncio.gather(*(p.link_clusters([kv.ClusterInfo(1000, d.address)]) for p in ps))
        assert [r[0] for r in res] == [S.LLM_SUCCESS] * 80
        assert d.stats()["control_refused"] == 0
    finally:
        for p in ps:
            await p.close()
        await d.close()


async def test_a_peer_with_many_caller_owned_caches_costs_one_pidfd_per_link():
    """CMA regions carry the peer's pidfd into the core: one shared duplicate per link, not
    one per region, or a peer with many registered caches would use up our descriptors
    (320 regions here; the default soft limit is 1024)."""
    e = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0",
                          kv.EngineOptions(transport="shm")).start()
    peer = await PeerProcess.start(cluster_id=2, transport="shm")
    try:
        ids = [(await peer.call("register", n=8, shape=[1, 4096], dtype="uint8"))["cache_id"]
               for _ in range(40)]
        before = len(os.listdir("/proc/self/fd"))
        st, _ = await e.link_clusters([kv.ClusterInfo(2, peer.address)])
        assert st == S.LLM_SUCCESS
        for cid in ids:
            await e.wait_remote_cache(2, cid, timeout=10)
        grown = len(os.listdir("/proc/self/fd")) - before
        assert grown < 16, f"{grown} descriptors for one link with {8 * len(ids)} CMA regions"
        src = e.allocate_cache(kv.CacheDesc(8, (1, 4096), "uint8"))
        await e.push_kv_cache(src, kv.CacheIndex(2, ids[-1], 0), timeout=5)   # CMA still works
    finally:
        await e.close()
        await peer.close()
