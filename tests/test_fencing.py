"""Adversarial proof of the fencing promises (docs/api.md, DESIGN):

- a push's status comes only once no byte of it can still land in the destination;
- LLM_TIMEOUT / LLM_CANCELLED (link usable) only when the peer acknowledged the
  abort; otherwise the link fails and the transfer resolves LLM_LINK_FAILED within
  heartbeat_timeout after the abort;
- no await on a peer is unbounded.

The destinations live in other processes (kvengine._peer children, or raw hostile
peers from tests/hostile.py). Their memory is read from this process with
process_vm_readv at the addresses the peer reported, also while the peer is
SIGSTOPped, so every byte check reads the destination itself. A stopped peer is
resumed after its status came, and its memory must not change for a fixed
observation window (that window is the point of those tests, not synchronisation).
Every bound below is computed from the options."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import numpy as np
import pytest

import kvengine as kv
from kvengine import LLMStatusCode as S
from kvengine._peer import PeerProcess, fill_pattern
from kvengine.bench.netbed import remote_view   # reads a peer process's cache (process_vm_readv)

import hostile   # tests/: raw hostile peers written from docs/protocol.md

# ------------------------------------------------------------------ options and bounds

HB = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0, "link_timeout": 2.0}
HBI, HBT, LINK_TIMEOUT = HB["heartbeat_interval"], HB["heartbeat_timeout"], HB["link_timeout"]
SLACK = 1.0                      # scheduling slack on a noisy 2-vCPU machine
DEADLINE = 1.0                   # the push/pull deadline of the tests
STATUS_BOUND = DEADLINE + HBT + HBI + SLACK   # from submit: deadline, then at most HBT to fence
ABORT_BOUND = HBT + HBI + SLACK               # from an explicit abort (cancel) to the status
WINDOW = 2.0                     # observation window after a stopped peer resumes
CHUNK = 1 << 20                  # EngineOptions.chunk_bytes default
TCP_WINDOW = 4 << 20             # EngineOptions.tcp_window_bytes default
ROW = kv.CacheDesc(2, (1, 64 << 20), np.uint8)   # one 128 MiB row per push
SRC_SEED, DST_SEED = 101, 202
SECRET = b"fencing-secret"


def options(transport: str, **kw) -> kv.EngineOptions:
    return kv.EngineOptions(transport=transport, secret=SECRET, **HB, **kw)


def peer_options() -> dict:
    return dict(HB)


# ------------------------------------------------------------------ another process's memory

def changed(a: list[np.ndarray], b: list[np.ndarray]) -> int:
    """Bytes that differ between two snapshots."""
    return sum(int(np.count_nonzero(x.reshape(-1).view(np.uint8) != y.reshape(-1).view(np.uint8)))
               for x, y in zip(a, b))


def pattern(desc: kv.CacheDesc, seed: int) -> list[np.ndarray]:
    """What _peer's ``fill`` / conftest's ``filled`` put into a cache of ``desc``."""
    out = []
    for i in range(desc.num_tensors):
        t = np.empty(desc.size, np.uint8)
        fill_pattern(t, seed, i)
        out.append(t)
    return out


def own(cache: kv.Cache) -> list[np.ndarray]:
    """A copy of a local cache's bytes."""
    return [np.array(t, copy=True).reshape(-1).view(np.uint8) for t in cache.tensors]


# ------------------------------------------------------------------ processes and bounded waits

def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def spin_until(cond, bound: float, what: str) -> None:
    """Poll ``cond`` without yielding to the loop (the native threads move the bytes), bounded.

    Used for the few milliseconds between starting a transfer and stopping its peer, where
    an await could let the whole transfer finish first."""
    end = time.monotonic() + bound
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {bound} s: {what}")
        time.sleep(0.0002)


async def poll_until(cond, bound: float, what: str, every: float = 0.01) -> None:
    end = time.monotonic() + bound
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {bound} s: {what}")
        await asyncio.sleep(every)


def stop(peer: PeerProcess) -> None:
    os.kill(peer.pid, signal.SIGSTOP)


def resume(peer: PeerProcess) -> None:
    if peer.proc.returncode is None:
        os.kill(peer.pid, signal.SIGCONT)


async def wait_stopped(peer: PeerProcess) -> None:
    await poll_until(lambda: proc_state(peer.pid) == "T", 5, f"peer {peer.pid} stopped", 0.001)


async def resumed_window(peer: PeerProcess, cluster_id: int) -> None:
    """Resume ``peer``, wait until it reports its link to ``cluster_id`` down, and until
    WINDOW seconds have passed since it resumed (the observation window)."""
    loop = asyncio.get_running_loop()
    resume(peer)
    t0 = loop.time()
    reply = await peer.call("wait_link_down", cluster_id=cluster_id, timeout=HBT + 2 * HBI + 5)
    assert reply["down"], "the resumed peer still has its link to us"
    left = WINDOW - (loop.time() - t0)
    if left > 0:
        await asyncio.sleep(left)   # the observation window itself, not a synchronisation


async def start_peers(*cluster_ids: int, transport: str = "tcp") -> list[PeerProcess]:
    return list(await asyncio.gather(*(PeerProcess.start(cluster_id=c, transport=transport, secret=SECRET,
                                                         options=peer_options()) for c in cluster_ids)))


async def close_all(engines=(), peers=()) -> None:
    for p in peers:
        resume(p)
    for e in engines:
        try:
            await asyncio.wait_for(e.close(), LINK_TIMEOUT + HBT + 5)
        except asyncio.TimeoutError:
            pass   # the test has failed already (an unbounded close); do not hang the run
    for p in peers:
        await p.close()


async def status_within(t: kv.Transfer, bound: float):
    """The transfer's status, or None if it has none after ``bound`` seconds (the wait
    never cancels the transfer)."""
    fut = asyncio.ensure_future(t._wait())
    done, _ = await asyncio.wait([fut], timeout=bound)
    if not done:
        fut.cancel()
        return None
    return fut.result()


async def linked(engine: kv.KvEngine, cluster_id: int, address: str) -> None:
    st, per = await engine.link_clusters([kv.ClusterInfo(cluster_id, address)])
    assert st == S.LLM_SUCCESS, per


async def push_fresh_peer(prefill: kv.KvEngine, fresh: PeerProcess, cluster: int, src: kv.Cache,
                          kind: str) -> None:
    """The engine still works: link a new peer (cluster ``cluster``) and push a whole row byte-exact."""
    dst = (await fresh.call(kind, n=ROW.num_tensors, shape=list(ROW.shape), dtype="uint8"))["cache_id"]
    await linked(prefill, cluster, fresh.address)
    await prefill.wait_remote_cache(cluster, dst, timeout=5)
    assert await prefill.push_kv_cache(src, kv.CacheIndex(cluster, dst, 0), timeout=30) == S.LLM_SUCCESS
    read = await remote_view(fresh, dst)
    assert changed(read(), own(src)) == 0, "the push to a fresh peer is not byte-exact"


async def tcp_prefill() -> kv.KvEngine:
    return await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", options("tcp")).start()


def sent(engine: kv.KvEngine) -> int:
    return engine.stats()["native"]["tcp_bytes_sent"]


def received(engine: kv.KvEngine) -> int:
    return engine.stats()["native"]["tcp_bytes_received"]


# ------------------------------------------------------------------ 1. TCP: stopped destination


async def _push_into_stopped(prefill, peer, kind):
    """Start a 128 MiB push into ``peer`` (cluster 2) and stop the peer mid-push.

    Returns (transfer, submit time, src cache, dst cache id, reader of the dst)."""
    dst = (await peer.call(kind, n=ROW.num_tensors, shape=list(ROW.shape), dtype="uint8",
                           fill=DST_SEED))["cache_id"]
    await linked(prefill, 2, peer.address)
    await prefill.wait_remote_cache(2, dst, timeout=5)
    read = await remote_view(peer, dst)
    src = prefill.allocate_cache(ROW)
    for i, t in enumerate(src.tensors):
        fill_pattern(t, SRC_SEED, i)
    base = sent(prefill)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    t = prefill.submit_push_kv_cache(src, kv.CacheIndex(2, dst, 0), timeout=DEADLINE)
    # sent > window + a frame: the peer consumed (wrote) some of it, so it is mid-push
    spin_until(lambda: sent(prefill) - base >= 2 * TCP_WINDOW, 5, "the push started")
    stop(peer)
    assert not t.done(), f"the push finished before its peer was stopped: {t.status!r}"
    return t, t0, src, dst, read


@pytest.mark.parametrize("kind", ["alloc", "register"])
async def test_tcp_no_byte_lands_after_the_status_of_a_push_into_a_stopped_peer(kind):
    """Finding 1: a push into a SIGSTOPped TCP peer resolves LLM_LINK_FAILED within the
    bound (the peer cannot acknowledge the abort), and once the peer resumes, nothing of
    the data still in its kernel's buffers is written into the destination."""
    prefill = await tcp_prefill()
    peer, fresh = await start_peers(2, 3)
    loop = asyncio.get_running_loop()
    try:
        t, t0, src, dst, read = await _push_into_stopped(prefill, peer, kind)
        status = await asyncio.wait_for(t._wait(), STATUS_BOUND + 5)
        elapsed = loop.time() - t0
        at_status = read()               # the peer is stopped: this is what it holds now
        before = pattern(ROW, DST_SEED)
        assert changed(at_status, before) > 0, "nothing had landed: the push was not in flight"
        assert status == S.LLM_LINK_FAILED, \
            f"{status.name}: a stopped peer cannot acknowledge the abort, so the link must fail " \
            f"({t.message()})"
        assert elapsed <= STATUS_BOUND, f"the status took {elapsed:.2f} s (bound {STATUS_BOUND:.2f} s)"
        assert prefill.stats()["native"]["jobs_live"] == 0
        print(f"stopped destination ({kind}): {status.name} after {elapsed:.2f} s")
        await resumed_window(peer, 1)
        after = read()
        n = changed(at_status, after)
        assert n == 0, f"{n} bytes landed in the destination after the push's status"
        assert 2 not in prefill.stats()["links"]
        await push_fresh_peer(prefill, fresh, 3, src, kind)
    finally:
        await close_all([prefill], [peer, fresh])


@pytest.mark.parametrize("teardown", ["unlink_force", "close"])
async def test_tcp_teardown_under_an_aborting_push_lands_nothing_after_the_status(teardown):
    """Finding 1, second half: the push is aborted (cancel) while its peer is stopped, and
    the link is torn down while the abort waits for ABORT_ACKs that cannot come. The
    status is not LLM_CANCELLED (the peer acknowledged nothing), it comes within
    heartbeat_timeout of the abort, the teardown call is bounded, and nothing lands after
    the status when the peer resumes."""
    prefill = await tcp_prefill()
    peer, fresh = await start_peers(2, 3)
    loop = asyncio.get_running_loop()
    try:
        t, _, src, dst, read = await _push_into_stopped(prefill, peer, "alloc")
        await wait_stopped(peer)
        t1 = loop.time()
        assert t.cancel()
        snap: dict[str, list] = {}

        async def on_status():
            st = await t._wait()
            snap["at_status"] = read()     # synchronously, as soon as the status is there
            snap["t"] = loop.time()
            return st

        waiter = asyncio.ensure_future(on_status())
        if teardown == "close":
            await asyncio.wait_for(prefill.close(), LINK_TIMEOUT + HBT + SLACK)
        else:
            st, per = await asyncio.wait_for(
                prefill.unlink_clusters([kv.ClusterInfo(2, peer.address)], force=True), LINK_TIMEOUT + SLACK)
            assert per == [S.LLM_SUCCESS]
        torn = loop.time() - t1
        status = await asyncio.wait_for(waiter, ABORT_BOUND + 5)
        print(f"{teardown}: {status.name} {snap['t'] - t1:.2f} s after the abort; teardown took {torn:.2f} s")
        assert snap["t"] - t1 <= ABORT_BOUND, f"the status took {snap['t'] - t1:.2f} s after the abort"
        assert status in (S.LLM_LINK_FAILED, S.LLM_NOT_YET_LINK, S.LLM_ENGINE_FINALIZED), \
            f"{status.name} after {teardown} under an unacknowledged abort ({t.message()})"
        assert changed(snap["at_status"], pattern(ROW, DST_SEED)) > 0, "the push was not in flight"
        await resumed_window(peer, 1)
        n = changed(snap["at_status"], read())
        assert n == 0, f"{n} bytes landed after the status ({teardown} took {torn:.2f} s)"
        if teardown == "unlink_force":
            await push_fresh_peer(prefill, fresh, 3, src, "alloc")
        else:
            assert prefill.stats()["native"]["jobs_live"] == 0
    finally:
        await close_all([prefill], [peer, fresh])


async def test_tcp_receiver_stalled_inside_a_write_lands_at_most_that_write_after_the_status():
    """Beyond SIGSTOP: the receiver's I/O thread stalls *inside* a write (recv into place) on
    a page fault that takes long (here the page is held by userfaultfd; in life: swap,
    reclaim, file-backed or post-copy memory, or plain preemption). Its lease was valid when
    the write began, so the lease cannot stop that write: the pusher's status comes (the
    peer answers pings, so only the fence ends the push), and when the fault is served the
    stalled recv finishes after the status. The promise holds only up to that one write:
    at most one frame (chunk_bytes) may land after the status, and nothing after it."""
    prefill = await tcp_prefill()
    (peer,) = await start_peers(2)
    loop = asyncio.get_running_loop()
    try:
        dst = (await peer.call("register_held", n=ROW.num_tensors, shape=list(ROW.shape), dtype="uint8"))["cache_id"]
        await linked(prefill, 2, peer.address)
        await prefill.wait_remote_cache(2, dst, timeout=5)
        read = await remote_view(peer, dst)
        src = prefill.allocate_cache(ROW)
        for i, t in enumerate(src.tensors):
            fill_pattern(t, SRC_SEED, i)
        await peer.call("held", arm=True)
        t0 = loop.time()
        t = prefill.submit_push_kv_cache(src, kv.CacheIndex(2, dst, 0), timeout=DEADLINE)
        end = time.monotonic() + 5
        while (await peer.call("held"))["held"] is None:   # the writer's first write faulted
            assert time.monotonic() < end, "the receiver never wrote"
            await asyncio.sleep(0.01)
        status = await status_within(t, STATUS_BOUND + 5)
        elapsed = loop.time() - t0
        held = await peer.call("held")
        assert held["faults_while_held"] == 0, held    # the one writer is stuck in its first write
        assert status is not None, "no status: the push waited on a peer that answers pings"
        assert status == S.LLM_LINK_FAILED, f"{status.name} ({t.message()})"
        assert elapsed <= STATUS_BOUND, f"the status took {elapsed:.2f} s (bound {STATUS_BOUND:.2f} s)"
        # nothing of the push is in place yet (pages come in zeroed): the writer is held in
        # its first write. Now serve the fault: that write completes after the status.
        t1 = loop.time()
        await peer.call("held", release=True)
        reply = await peer.call("wait_link_down", cluster_id=1, timeout=HBT + 2 * HBI + 5)
        assert reply["down"], "the peer still has its link to us"
        left = WINDOW - (loop.time() - t1)
        if left > 0:
            await asyncio.sleep(left)   # the observation window itself, not a synchronisation
        late = sum(int(np.count_nonzero(a)) for a in read())
        print(f"stalled write: {late} bytes landed after the status")
        assert late <= prefill.options.chunk_bytes, \
            f"{late} bytes landed after the status: more than the one write that was under way"
    finally:
        if peer.proc.returncode is None:
            try:
                await peer.call("held", release=True, timeout=5)   # never leave the writer held
            except (RuntimeError, ConnectionError, asyncio.TimeoutError):
                pass
        await close_all([prefill], [peer])


# ------------------------------------------------------------------ 2. TCP: stopped pull source

@pytest.mark.parametrize("kind", ["alloc", "register"])
async def test_tcp_no_byte_lands_after_the_status_of_a_pull_from_a_stopped_peer(kind):
    """Finding 2: a pull whose responder is stopped mid-pull resolves within the bound, and
    our destination does not change after the status, also once the responder resumes."""
    prefill = await tcp_prefill()
    (peer,) = await start_peers(2)
    loop = asyncio.get_running_loop()
    try:
        remote = (await peer.call("alloc", n=ROW.num_tensors, shape=list(ROW.shape), dtype="uint8",
                                  fill=SRC_SEED))["cache_id"]
        await linked(prefill, 2, peer.address)
        await prefill.wait_remote_cache(2, remote, timeout=5)
        if kind == "alloc":
            mine = prefill.allocate_cache(ROW)
        else:
            mine = prefill.register_kv_cache(ROW, [np.zeros(ROW.shape, np.uint8) for _ in range(ROW.num_tensors)])
        for i, t in enumerate(mine.tensors):
            fill_pattern(t, DST_SEED, i)
        base = received(prefill)
        t0 = loop.time()
        t = prefill.submit_pull_kv_cache(kv.CacheIndex(2, remote, 0), mine, timeout=DEADLINE)
        spin_until(lambda: received(prefill) - base >= 2 * CHUNK, 5, "the pull started")
        stop(peer)
        assert not t.done(), f"the pull finished before its peer was stopped: {t.status!r}"
        status = await asyncio.wait_for(t._wait(), STATUS_BOUND + 5)
        at_status = own(mine)
        elapsed = loop.time() - t0
        assert status in (S.LLM_TIMEOUT, S.LLM_LINK_FAILED), f"{status.name} ({t.message()})"
        assert elapsed <= STATUS_BOUND, f"the status took {elapsed:.2f} s (bound {STATUS_BOUND:.2f} s)"
        assert changed(at_status, pattern(ROW, DST_SEED)) > 0, "the pull was not in flight"
        # a status of LLM_TIMEOUT may come before our heartbeat declares the stopped peer lost:
        # resumed before that, the peer would keep its link (and never report it down)
        end = loop.time() + HBT + 2 * HBI + SLACK
        while prefill.stats()["links"].get(2, {}).get("state") == "up":
            assert loop.time() < end, "the stopped peer was not declared lost within the heartbeat bound"
            await asyncio.sleep(0.01)   # polling a condition with a bound, not a synchronisation
        await resumed_window(peer, 1)
        n = changed(at_status, own(mine))
        assert n == 0, f"{n} bytes of the pull landed in our memory after its status"
        assert prefill.stats()["native"]["jobs_live"] == 0
    finally:
        await close_all([prefill], [peer])


# ------------------------------------------------------------------ 5. shm: a stopped pusher

async def test_shm_stopped_pusher_lands_at_most_one_chunk_per_mover_after_the_link_failed():
    """Finding 5: the peer pushes (shm, its movers write straight into our memfd cache) and
    is stopped mid-push. Our link to it fails by heartbeat; when it resumes, at most the
    chunk each of its movers had in progress may still land (chunk_bytes per mover), until
    its push resolves (after which none of its movers touches our memory)."""
    movers = 2
    big = kv.CacheDesc(2, (1, 256 << 20), np.uint8)   # 512 MiB: ~100 ms of copying
    prefill = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", options("shm")).start()
    peer = await PeerProcess.start(cluster_id=2, transport="shm", secret=SECRET, movers=movers,
                                   options=peer_options())
    loop = asyncio.get_running_loop()
    try:
        mine = await prefill.allocate_cache_async(big)      # zeroed: a landed byte is non-zero (255/256)
        src = (await peer.call("alloc", n=2, shape=list(big.shape), dtype="uint8", fill=SRC_SEED))["cache_id"]
        await linked(prefill, 2, peer.address)
        head = mine.tensors[0].reshape(-1)[:4096]
        tail = mine.tensors[-1].reshape(-1)[-4096:]
        handle = (await peer.call("push_start", cache_id=src, cluster_id=1, dst_cache_id=mine.cache_id,
                                  deadline=30))["handle"]
        spin_until(lambda: head.any(), 5, "the peer's push started")
        stop(peer)
        await wait_stopped(peer)
        t_stop = loop.time()
        assert not tail.any(), "the push was over before its peer was stopped"
        with pytest.raises((kv.LLMLinkFailedError, kv.LLMNotYetLinkError)):
            await prefill.wait_remote_cache(2, 2**62, timeout=HBT + 2 * HBI + 5)
        assert loop.time() - t_stop <= HBT + 2 * HBI + SLACK, "the stopped peer was not declared lost in time"
        at_fail = own(mine)
        resume(peer)
        reply = await peer.call("push_wait", handle=handle, wait=HBT + 2 * HBI + 5)
        assert reply["status"] is not None, "the resumed peer's push did not resolve"
        late = changed(at_fail, own(mine))
        bound = movers * prefill.options.chunk_bytes
        print(f"shm: {late} bytes landed after our link to the stopped pusher failed")
        assert late <= bound, \
            f"{late} bytes landed after our link to the stopped pusher failed " \
            f"(bound: {movers} movers x chunk_bytes = {bound}); its push ended {S(reply['status']).name}"
    finally:
        await close_all([prefill], [peer])


async def test_shm_push_after_a_stall_of_our_loop_renews_the_mover_lease_first():
    """Our loop blocked longer than the mover lease (0.75 x heartbeat_timeout) but shorter
    than heartbeat_timeout: the link is healthy, but no pong renewed the lease meanwhile.
    The next pushes (inline, and by the movers) wait for a renewal (one ping) instead of
    being refused by the core, which failed them LLM_LINK_FAILED and took the link down."""
    from conftest import filled, link, make_pair
    p, d = await make_pair("shm", heartbeat_timeout=2.0)
    try:
        await link(p, d)
        small, big = kv.CacheDesc(2, (1, 32 << 10), np.uint8), kv.CacheDesc(2, (1, 16 << 20), np.uint8)
        ssrc, bsrc = filled(p.allocate_cache(small), 1), filled(p.allocate_cache(big), 2)
        sdst, bdst = d.allocate_cache(small), d.allocate_cache(big)
        for c in (sdst, bdst):
            await p.wait_remote_cache(2, c.cache_id)
        await p.push_kv_cache(ssrc, kv.CacheIndex(2, sdst.cache_id, 0))   # the fast path's memo
        time.sleep(0.75 * 2.0 + 0.1)   # the stall itself (not a synchronisation)
        await p.push_kv_cache(ssrc, kv.CacheIndex(2, sdst.cache_id, 0), timeout=5)   # awaited: fast path
        time.sleep(0.75 * 2.0 + 0.1)
        pushes = [p.submit_push_kv_cache(ssrc, kv.CacheIndex(2, sdst.cache_id, 0), timeout=5),
                  p.submit_push_kv_cache(bsrc, kv.CacheIndex(2, bdst.cache_id, 0), timeout=5)]
        assert [await t for t in pushes] == [S.LLM_SUCCESS, S.LLM_SUCCESS], [t.message() for t in pushes]
        for a, b in ((ssrc, sdst), (bsrc, bdst)):
            assert all(np.array_equal(x, y) for x, y in zip(a.tensors, b.tensors))
        assert p.stats()["links"][2]["state"] == "up" and d.stats()["links"][1]["state"] == "up"
    finally:
        await p.close()
        await d.close()


# ------------------------------------------------------------------ shm: a peer that holds our copy

async def _held_peer(size: int, movers: int = 1):
    """A shm prefill (``movers`` movers), a peer (cluster 2) whose cache is caller-owned memory
    under its userfaultfd (so our copies reach it with CMA and fault there), and a fresh peer
    (cluster 3). Returns (prefill, peer, fresh, the peer's cache id)."""
    prefill = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", options("shm", movers=movers)).start()
    peer, fresh = await start_peers(2, 3, transport="shm")
    dst = (await peer.call("register_held", n=2, shape=[1, size // 2], dtype="uint8"))["cache_id"]
    await linked(prefill, 2, peer.address)
    await prefill.wait_remote_cache(2, dst, timeout=5)
    return prefill, peer, fresh, dst


async def _loop_gaps(stop: asyncio.Event) -> float:
    """The longest time this loop did not run, until ``stop``."""
    loop, worst = asyncio.get_running_loop(), 0.0
    last = loop.time()
    while not stop.is_set():
        await asyncio.sleep(0.005)
        now = loop.time()
        worst, last = max(worst, now - last), now
    return worst


async def _until_held(peer: PeerProcess) -> None:
    end = time.monotonic() + 5
    while (await peer.call("held"))["held"] is None:   # our copy faulted on the held page
        assert time.monotonic() < end, "our copy never reached the peer's memory"
        await asyncio.sleep(0.01)


def _native(engine: kv.KvEngine) -> dict:
    return engine.stats()["native"]


async def _awaited(coro) -> S:
    """The status an awaited push_kv_cache ends with (the native fast path's way)."""
    try:
        return await coro
    except kv.LLMError as e:
        return e.status


@pytest.mark.parametrize("size,api", [(32 << 10, "submit"), (32 << 10, "await"), (8 << 20, "submit")],
                         ids=["inline-sized", "inline-sized-awaited", "mover-sized"])
async def test_shm_push_into_memory_the_peer_holds_is_bounded_and_never_stalls_our_loop(size, api):
    """A peer holds a page of its caller-owned cache with userfaultfd: our process_vm_writev
    into it waits in the kernel, where only a fatal signal reaches it, for as long as the peer
    likes. Our event loop never runs such a copy (even one below inline_threshold goes to a
    mover); a mover held for heartbeat_timeout is abandoned: the push resolves LLM_LINK_FAILED
    within the bound, the link fails, a fresh mover takes the held one's place and the
    engine pushes to another peer (one mover in all, so only the fresh one can)."""
    prefill, peer, fresh, dst = await _held_peer(size)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    gaps = asyncio.ensure_future(_loop_gaps(stop))
    try:
        src = prefill.allocate_cache(kv.CacheDesc(2, (1, size // 2), np.uint8))
        for i, t in enumerate(src.tensors):
            fill_pattern(t, SRC_SEED, i)
        if api == "await":   # the first push is planned (and memoized) by the Python path
            await prefill.push_kv_cache(src, kv.CacheIndex(2, dst, 0), timeout=5)
        await peer.call("held", arm=True, zap=True)
        t0 = loop.time()
        if api == "submit":
            t = prefill.submit_push_kv_cache(src, kv.CacheIndex(2, dst, 0), timeout=DEADLINE)
            assert loop.time() - t0 < 0.5, "the submit itself waited on the peer's memory"
        else:   # the fast path: it waits for the copy at most 200 us, then hands it to the scheduler
            fast = prefill._p.fast
            taken, launched = fast.taken, fast.launched
            t = asyncio.ensure_future(_awaited(prefill.push_kv_cache(src, kv.CacheIndex(2, dst, 0),
                                                                     timeout=DEADLINE)))
        await _until_held(peer)
        if api == "submit":
            status = await status_within(t, STATUS_BOUND + 5)
        else:
            done, _ = await asyncio.wait([t], timeout=STATUS_BOUND + 5)
            status = t.result() if done else None
            assert (fast.taken, fast.launched) == (taken, launched + 1), "not the fast path's adoption"
        elapsed = loop.time() - t0
        stop.set()
        worst = await gaps
        assert status == S.LLM_LINK_FAILED, f"{status} ({t.message()})"
        assert elapsed <= STATUS_BOUND, f"the status took {elapsed:.2f} s (bound {STATUS_BOUND:.2f} s)"
        assert worst < 0.5, f"our loop stood still for {worst:.2f} s"
        n = _native(prefill)
        assert (n["jobs_abandoned"], n["movers_stuck"]) == (1, 1), n
        with pytest.raises((kv.LLMLinkFailedError, kv.LLMNotYetLinkError)):
            await prefill.wait_remote_cache(2, dst, timeout=HBT + 2 * HBI + 5)
        await push_fresh_peer(prefill, fresh, 3, prefill.allocate_cache(ROW), "alloc")
        await peer.call("held", release=True)
        await poll_until(lambda: _native(prefill)["movers_stuck"] == 0, 10, "the held mover returned")
        assert _native(prefill)["jobs_live"] == 0
    finally:
        stop.set()
        await close_all([prefill], [peer, fresh])


@pytest.mark.parametrize("size,api", [(4 << 20, "submit"), (32 << 10, "await")],
                         ids=["mover-sized", "inline-sized-awaited"])
async def test_shm_pull_from_memory_the_peer_holds_lands_nothing_after_the_status(size, api):
    """The same hold on the source of a pull (process_vm_readv from the peer): the pull
    resolves LLM_LINK_FAILED within the bound, and when the peer lets the read go on, none
    of it lands in our cache (a mover reads a CMA pull into a buffer of its own and copies
    it into place only if its job was not abandoned meanwhile). Awaited and small, the
    native fast path waits 200 us for it, then the scheduler adopts it."""
    prefill, peer, fresh, src = await _held_peer(size)
    loop = asyncio.get_running_loop()
    try:
        mine = prefill.allocate_cache(kv.CacheDesc(2, (1, size // 2), np.uint8))
        where = kv.CacheIndex(2, src, 0)
        if api == "await":   # the first pull is planned (and memoized) by the Python path
            await prefill.pull_kv_cache(where, mine, timeout=5)
        for i, t in enumerate(mine.tensors):
            fill_pattern(t, DST_SEED, i)
        before = own(mine)
        await peer.call("held", arm=True, zap=True)
        t0 = loop.time()
        if api == "submit":
            t = prefill.submit_pull_kv_cache(where, mine, timeout=DEADLINE)
            await _until_held(peer)
            status = await status_within(t, STATUS_BOUND + 5)
            message = t.message()
        else:
            fast = prefill._p.fast
            launched = fast.launched
            task = asyncio.ensure_future(_awaited(prefill.pull_kv_cache(where, mine, timeout=DEADLINE)))
            await _until_held(peer)
            done, _ = await asyncio.wait([task], timeout=STATUS_BOUND + 5)
            status, message = (task.result() if done else None), ""
            assert fast.launched == launched + 1, "not the fast path's adoption"
        assert status == S.LLM_LINK_FAILED, f"{status} ({message})"
        assert loop.time() - t0 <= STATUS_BOUND
        await peer.call("held", release=True)
        await poll_until(lambda: _native(prefill)["movers_stuck"] == 0, 10, "the held mover returned")
        n = changed(before, own(mine))
        assert n == 0, f"{n} bytes of the pull landed after its status"
    finally:
        await close_all([prefill], [peer, fresh])


async def test_engine_close_with_a_copy_the_peer_holds_is_bounded():
    """Closing the engine while a mover is held in the peer's memory (before the heartbeat
    bound abandoned it): the close waits for it at most 2 s (kv_core.c KV_CLOSE_MOVER_NS),
    then leaves that thread and the native core to it, and the push resolves."""
    prefill, peer, fresh, dst = await _held_peer(8 << 20)
    loop = asyncio.get_running_loop()
    try:
        src = prefill.allocate_cache(kv.CacheDesc(2, (1, 4 << 20), np.uint8))
        await peer.call("held", arm=True)
        t = prefill.submit_push_kv_cache(src, kv.CacheIndex(2, dst, 0))   # no deadline
        await _until_held(peer)
        t0 = loop.time()
        await asyncio.wait_for(prefill.close(), LINK_TIMEOUT + HBT + 5)
        took = loop.time() - t0
        assert took <= 2.0 + LINK_TIMEOUT + SLACK, f"close took {took:.2f} s"
        assert await status_within(t, 1) in (S.LLM_ENGINE_FINALIZED, S.LLM_LINK_FAILED)
    finally:
        await close_all([prefill], [peer, fresh])


@pytest.mark.parametrize("then", ["resume", "kill"])
async def test_shm_caller_owned_memory_is_not_written_after_unregister_reported_it_released(then):
    """Beyond finding 5: the stopped shm pusher writes into our *caller-owned* cache with CMA
    (process_vm_writev into this process). Our link to it fails; unregister_kv_cache's
    future then says when the memory is released: the caller may free or reuse it. A mover
    stopped between its lease check and its copy writes its chunk whenever the process
    resumes (CI saw 1 MiB land after the future was done), and nothing can revoke that
    write. So the future stays pending while the stopped peer lives (it would lie
    otherwise); once the peer resumes and finishes the link (its EOF comes after its
    movers are out: kvengine/closing.py), or dies, it is done, and nothing lands after."""
    movers = 2
    big = kv.CacheDesc(2, (1, 256 << 20), np.uint8)
    prefill = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", options("shm")).start()
    peer = await PeerProcess.start(cluster_id=2, transport="shm", secret=SECRET, movers=movers,
                                   options=peer_options())
    bufs = [np.zeros(big.shape, np.uint8) for _ in range(big.num_tensors)]   # kept alive by the test
    try:
        mine = prefill.register_kv_cache(big, bufs)
        other = prefill.register_kv_cache(kv.CacheDesc(1, (1, 4096), np.uint8), [np.zeros((1, 4096), np.uint8)])
        src = (await peer.call("alloc", n=2, shape=list(big.shape), dtype="uint8", fill=SRC_SEED))["cache_id"]
        await linked(prefill, 2, peer.address)
        head, tail = bufs[0].reshape(-1)[:4096], bufs[-1].reshape(-1)[-4096:]
        handle = (await peer.call("push_start", cache_id=src, cluster_id=1, dst_cache_id=mine.cache_id,
                                  deadline=30))["handle"]
        spin_until(lambda: head.any(), 5, "the peer's push started")
        stop(peer)
        await wait_stopped(peer)
        assert not tail.any(), "the push was over before its peer was stopped"
        with pytest.raises((kv.LLMLinkFailedError, kv.LLMNotYetLinkError)):
            await prefill.wait_remote_cache(2, 2**62, timeout=HBT + 2 * HBI + 5)
        released = prefill.unregister_kv_cache(mine.cache_id)
        done, _ = await asyncio.wait([released], timeout=LINK_TIMEOUT + SLACK)
        assert not done, "unregister_kv_cache reported the memory released while the stopped peer, which " \
                         "can still write into it, lives"
        closing = prefill.stats()["links_closing"]
        assert list(closing) == [2] and closing[2]["pid"] == peer.pid, closing   # what an operator sees
        # a cache registered after the link went down was never the peer's to write
        fresh = prefill.register_kv_cache(kv.CacheDesc(1, (1, 4096), np.uint8), [np.zeros((1, 4096), np.uint8)])
        await asyncio.wait_for(prefill.unregister_kv_cache(fresh.cache_id), SLACK)
        # an allocated (memfd) cache is never handed back to the caller: no wait either
        await asyncio.wait_for(prefill.unregister_kv_cache(prefill.allocate_cache(
            kv.CacheDesc(1, (1, 4096), np.uint8)).cache_id), SLACK)
        assert not released.done()
        if then == "kill":
            peer.proc.kill()
            await asyncio.wait_for(released, SLACK + 1)
            return
        resume(peer)
        await asyncio.wait_for(released, HBT + 2 * HBI + SLACK)   # it finishes the link on waking
        at_release = [b.copy() for b in bufs]
        reply = await peer.call("push_wait", handle=handle, wait=HBT + 2 * HBI + 5)
        assert reply["status"] is not None, "the resumed peer's push did not resolve"
        await asyncio.wait_for(prefill.unregister_kv_cache(other.cache_id), SLACK)   # the peer is out
        assert prefill.stats()["links_closing"] == {}
        late = changed(at_release, bufs)
        assert late == 0, f"{late} bytes landed in caller-owned memory after unregister_kv_cache reported " \
                          f"it released"
    finally:
        await close_all([prefill], [peer])


# ------------------------------------------------------------------ raw hostile peers (tests/hostile.py)

HOSTILE = 9          # first cluster id of the raw peers


def tcp_table(desc: kv.CacheDesc, cache_id: int = 1, region: int = 17) -> list[dict]:
    """A raw peer's cache table: one cache of ``desc`` in one region of its own."""
    return [{"t": "cache_add", "id": cache_id, "desc": desc.to_wire(), "kind": "tcp",
             "regions": [[region, desc.size * desc.num_tensors]],
             "placement": [[0, i * desc.size] for i in range(desc.num_tensors)]}]


async def hostile_link(address: str, cluster: int, table=(), streams: int = 2):
    """An authenticated raw peer linked to the engine at ``address``: it answers the
    heartbeat (pings every heartbeat_interval) and asks a lease on each data stream (so
    the engine may push DATA to it), and otherwise does only what the test makes it do."""
    s = await hostile.handshake(address, cluster, secret=SECRET, transport="tcp", streams=streams)
    try:
        theirs = await s.link(list(table))
        s.keepalive(HBI)
        for d in s.data:
            d.send(hostile.header(hostile.LEASE_REQ, offset=time.monotonic_ns()))
        for d in s.data:   # the engine granted it: the link is healthy before the test lies
            while True:
                item = await d.recv_frame(timeout=5)
                assert item is not None, "the engine closed a data stream before any lie"
                if item[0]["type"] == hostile.LEASE:
                    break
    except BaseException:
        s.close()
        raise
    return s, theirs


# ------------------------------------------------------------------ 3. unbounded waits


@contextlib.asynccontextmanager
async def never_reading():
    """A tcp prefill engine linked to a raw peer that never reads its data connections,
    and a filled source cache: ``(prefill, src)``; both closed at the end (close bounded
    by close_all)."""
    prefill = await tcp_prefill()
    s = None
    try:
        s, _ = await hostile_link(prefill.address, HOSTILE, tcp_table(ROW))
        await prefill.wait_link(HOSTILE, timeout=5)
        await prefill.wait_remote_cache(HOSTILE, 1, timeout=5)
        src = prefill.allocate_cache(ROW)
        for i, t in enumerate(src.tensors):
            fill_pattern(t, SRC_SEED, i)
        yield prefill, src
    finally:
        if s is not None:
            s.close()
        await close_all([prefill])


async def test_push_to_a_peer_that_never_reads_resolves_within_the_bound():
    """Finding 3: the peer answers pings (the heartbeat never fires) but never reads its data
    connections, so no ABORT_ACK can come. The push with a 1 s deadline still resolves
    within deadline + heartbeat_timeout (+ slack), as LLM_LINK_FAILED (LLM_TIMEOUT would
    claim a fence the peer never acknowledged), and close() returns within link_timeout."""
    loop = asyncio.get_running_loop()
    async with never_reading() as (prefill, src):
        base = sent(prefill)
        t0 = loop.time()
        t = prefill.submit_push_kv_cache(src, kv.CacheIndex(HOSTILE, 1, 0), timeout=DEADLINE)
        status = await status_within(t, STATUS_BOUND + 5)
        elapsed = loop.time() - t0
        assert status is not None, f"the push had no status {STATUS_BOUND + 5:.1f} s after a {DEADLINE} s deadline"
        assert sent(prefill) > base, "no DATA went out (the peer's lease request was not honoured?)"
        assert status == S.LLM_LINK_FAILED, f"{status.name}: the peer never acknowledged the abort ({t.message()})"
        assert elapsed <= STATUS_BOUND, f"the status took {elapsed:.2f} s (bound {STATUS_BOUND:.2f} s)"
        assert HOSTILE not in prefill.stats()["links"]
        t1 = loop.time()
        await asyncio.wait_for(prefill.close(), LINK_TIMEOUT + SLACK + 5)
        assert loop.time() - t1 <= LINK_TIMEOUT + SLACK, f"close() took {loop.time() - t1:.2f} s"
        assert prefill.stats()["native"]["jobs_live"] == 0


async def test_cancelling_a_push_to_a_peer_that_never_reads_is_bounded():
    """Finding 3: a task awaiting push_kv_cache is cancelled while the peer neither reads nor
    acknowledges: CancelledError comes within heartbeat_timeout of the cancel."""
    loop = asyncio.get_running_loop()
    async with never_reading() as (prefill, src):
        base = sent(prefill)
        task = asyncio.ensure_future(prefill.push_kv_cache(src, kv.CacheIndex(HOSTILE, 1, 0), timeout=30))
        await poll_until(lambda: sent(prefill) > base, 5, "the push started")
        t1 = loop.time()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=ABORT_BOUND + 5)
        elapsed = loop.time() - t1
        assert done, f"the cancelled push_kv_cache was still waiting {ABORT_BOUND + 5:.1f} s later"
        assert task.cancelled(), f"not CancelledError: {task.exception()!r}"
        assert elapsed <= ABORT_BOUND, f"CancelledError came {elapsed:.2f} s after the cancel"
        assert prefill.stats()["native"]["jobs_live"] == 0


async def test_close_cancelled_midway_against_a_peer_that_never_reads_still_closes():
    """Finding 3: close() with a push stuck on a peer that never reads nor answers the
    unlink; the first close() is cancelled mid-way, the second one still closes the engine
    within link_timeout + heartbeat_timeout, no job is left, the stuck push resolves without
    claiming a fence (not LLM_CANCELLED / LLM_TIMEOUT / LLM_SUCCESS), and a third close()
    is a no-op."""
    loop = asyncio.get_running_loop()
    async with never_reading() as (prefill, src):
        base = sent(prefill)
        t = prefill.submit_push_kv_cache(src, kv.CacheIndex(HOSTILE, 1, 0), timeout=30)
        await poll_until(lambda: sent(prefill) > base, 5, "the push started")
        t0 = loop.time()
        first = asyncio.ensure_future(prefill.close())
        await poll_until(lambda: prefill.stats()["links"].get(HOSTILE, {}).get("state") != "up"
                         or first.done(), 5, "close() under way")
        assert not first.done(), "close() returned at once with a push in flight"
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(prefill.close(), LINK_TIMEOUT + HBT + SLACK + 5)
        elapsed = loop.time() - t0
        assert elapsed <= LINK_TIMEOUT + HBT + SLACK, f"close() took {elapsed:.2f} s"
        assert prefill.stats()["native"]["jobs_live"] == 0
        assert t.done() and t.status not in (S.LLM_SUCCESS, S.LLM_CANCELLED, S.LLM_TIMEOUT), t
        t2 = loop.time()
        await asyncio.wait_for(prefill.close(), 1)
        assert loop.time() - t2 < 0.5


class Receiver:
    """A raw peer's data streams read to the end: every DATA frame is CREDITed; ``ack``:
    a push is ACKed once all its bytes came. ``abort_ack`` says how ABORTs (one per stream)
    are answered: "all" (an ABORT_ACK on each stream, everything before it was read),
    "none", "one" (only on the first stream), "one_twice" (two on the first stream, none
    on the others: a fence faked by repetition)."""

    def __init__(self, s, ack: bool, abort_ack: str) -> None:
        self.ack, self.abort_ack = ack, abort_ack
        self.got: dict[int, int] = {}
        self.frames: list[int] = []   # the payload length of each DATA frame, as it came
        self.aborts = 0
        self.tasks = [asyncio.ensure_future(self._serve(i, d)) for i, d in enumerate(s.data)]

    async def _serve(self, i: int, d) -> None:
        while True:
            item = await d.recv_frame(timeout=3600)
            if item is None:
                return
            h, _ = item
            if h["type"] == hostile.DATA:
                self.frames.append(h["length"])
                d.send(hostile.header(hostile.CREDIT, xfer=h["xfer"], length=h["length"]))
                n = self.got[h["xfer"]] = self.got.get(h["xfer"], 0) + h["length"]
                if self.ack and n == h["total"]:
                    d.send(hostile.header(hostile.ACK, xfer=h["xfer"]))
            elif h["type"] == hostile.ABORT:
                self.aborts += 1
                times = {"all": 1, "none": 0, "one": int(i == 0), "one_twice": 2 * int(i == 0)}[self.abort_ack]
                for _ in range(times):
                    d.send(hostile.header(hostile.ABORT_ACK, xfer=h["xfer"], flags=h["flags"]))

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()


SMALL = kv.CacheDesc(2, (1, 8 << 20), np.uint8)   # 16 MiB per push: more than the window


@pytest.mark.parametrize("abort_ack", ["all", "none", "one", "one_twice"])
async def test_timeout_only_when_the_peer_acknowledged_the_abort(abort_ack):
    """Finding 3, the fence itself: the peer reads and CREDITs everything but never ACKs the
    push, so it is aborted at its deadline. A peer that answers the ABORT on every stream
    gets LLM_TIMEOUT and the link stays usable (the next push succeeds); a peer that does
    not (never, on one stream only, or twice on one stream and never on the other) makes
    the link fail, LLM_LINK_FAILED, within the fence (< heartbeat_timeout after the
    abort), though the heartbeat is answered all along."""
    prefill = await tcp_prefill()
    s = rx = None
    loop = asyncio.get_running_loop()
    try:
        s, _ = await hostile_link(prefill.address, HOSTILE, tcp_table(SMALL))
        rx = Receiver(s, ack=False, abort_ack=abort_ack)
        await prefill.wait_link(HOSTILE, timeout=5)
        await prefill.wait_remote_cache(HOSTILE, 1, timeout=5)
        src = prefill.allocate_cache(SMALL)
        t0 = loop.time()
        t = prefill.submit_push_kv_cache(src, kv.CacheIndex(HOSTILE, 1, 0), timeout=DEADLINE)
        status = await status_within(t, STATUS_BOUND + 5)
        elapsed = loop.time() - t0
        assert status is not None, "no status"
        assert rx.aborts > 0 and sum(rx.got.values()) > 0, "the push was not aborted with frames on the wire"
        assert elapsed <= STATUS_BOUND, f"the status took {elapsed:.2f} s (bound {STATUS_BOUND:.2f} s)"
        if abort_ack == "all":
            assert status == S.LLM_TIMEOUT, f"{status.name} ({t.message()})"
            assert HOSTILE in prefill.stats()["links"], "the link went down after a fenced timeout"
            rx.ack = True
            assert await prefill.push_kv_cache(src, kv.CacheIndex(HOSTILE, 1, 0), timeout=10) == S.LLM_SUCCESS
        else:
            assert status == S.LLM_LINK_FAILED, f"{status.name}: the peer did not acknowledge the abort on " \
                                                f"every stream ({abort_ack})"
            assert HOSTILE not in prefill.stats()["links"]
        assert prefill.stats()["native"]["jobs_live"] == 0
    finally:
        if rx is not None:
            rx.close()
        if s is not None:
            s.close()
        await close_all([prefill])


@pytest.mark.parametrize("then", ["unlink", "silence"])
async def test_a_peer_that_stops_reading_its_control_connection_cannot_hang_the_engine(then):
    """Beyond the spec: the peer pings but stops reading its control connection, and our
    cache announcements (a few MiB of cache_add) fill the connection. Every await on the
    peer must stay bounded all the same: unlink_clusters(timeout) and the unregister of a
    cache (each peer waited for at most link_timeout) return in time, and if the peer then
    also goes silent the heartbeat still declares it lost (a ping stuck behind the full
    connection must not stop the heartbeat's judgement)."""
    prefill = await tcp_prefill()
    s = None
    loop = asyncio.get_running_loop()
    try:
        s = await hostile.handshake(prefill.address, HOSTILE, secret=SECRET, transport="tcp", streams=1)
        await s.link([])
        s.keepalive(HBI)
        await prefill.wait_link(HOSTILE, timeout=5)
        s.tcp.writer.transport.pause_reading()        # the peer reads no more control messages
        n = 50000   # ~1.2 MiB of cache_add per cache (one region per tensor): 6 fill the connection
        caches = [prefill.register_kv_cache(kv.CacheDesc(n, (1, 64), np.uint8),
                                            [np.zeros((1, 64), np.uint8) for _ in range(n)]) for _ in range(6)]
        await poll_until(lambda: prefill.stats()["links"][HOSTILE]["control_backlog_bytes"] > (64 << 10), 10,
                         "our control connection to the peer is full")
        t0 = loop.time()
        released = prefill.unregister_kv_cache(caches[0].cache_id)
        if then == "unlink":
            task = asyncio.ensure_future(prefill.unlink_clusters([kv.ClusterInfo(HOSTILE, "127.0.0.1:1")],
                                                                 timeout=DEADLINE))
            done, _ = await asyncio.wait([task], timeout=DEADLINE + SLACK + 5)
            assert done, f"unlink_clusters(timeout={DEADLINE}) still waiting {DEADLINE + SLACK + 5:.1f} s later"
            assert loop.time() - t0 <= DEADLINE + SLACK, f"unlink took {loop.time() - t0:.2f} s"
        else:
            s._pinger.cancel()                         # and now it is silent, too
            with pytest.raises((kv.LLMLinkFailedError, kv.LLMNotYetLinkError)):
                await prefill.wait_remote_cache(HOSTILE, 2**62, timeout=HBT + 2 * HBI + SLACK + 5)
            assert loop.time() - t0 <= HBT + 2 * HBI + SLACK, \
                f"the silent peer was declared lost after {loop.time() - t0:.2f} s"
        done, _ = await asyncio.wait([released], timeout=LINK_TIMEOUT + SLACK + 5)
        assert done, "unregister_kv_cache never completed"
        assert loop.time() - t0 <= LINK_TIMEOUT + SLACK, f"unregister took {loop.time() - t0:.2f} s"
    finally:
        if s is not None:
            s.close()
        await close_all([prefill])


# ------------------------------------------------------------------ 4. hostile frames on the data plane


def _unknown_frames(rng: np.random.Generator) -> dict[str, bytes]:
    """Frames naming transfer ids the victim never had, each repeated (a flood)."""
    def xid():
        return int(rng.integers(1 << 40, 1 << 62))
    payload = b"\xab" * 4096
    return {
        "ACK": b"".join(hostile.header(hostile.ACK, xfer=xid()) for _ in range(256)),
        "ACK(status)": b"".join(hostile.header(hostile.ACK, xfer=xid(), status=0x5010B002) for _ in range(256)),
        "ABORT_ACK": b"".join(hostile.header(hostile.ABORT_ACK, xfer=xid()) for _ in range(256)),
        "ABORT_ACK(pull)": b"".join(hostile.header(hostile.ABORT_ACK, flags=1, xfer=xid(), length=1 << 20)
                                    for _ in range(256)),
        "RERR": b"".join(hostile.header(hostile.RERR, xfer=xid(), status=0x5010B002, length=4096)
                         for _ in range(256)),
        "RDATA": b"".join(hostile.header(hostile.RDATA, xfer=xid(), length=len(payload), total=len(payload))
                          + payload for _ in range(64)),
    }


async def _victim_dropped(victim: PeerProcess, cluster: int, bad_before: int, d) -> None:
    """The victim failed the raw peer's link: its data connection closed, the link gone,
    the bad frame counted."""
    assert await d.closed(timeout=HBT + SLACK), "the victim kept the data connection of a lying peer"
    end = time.monotonic() + 5
    while True:
        st = (await victim.call("stats"))["stats"]
        if st["native"]["tcp_bad_frames"] > bad_before and str(cluster) not in map(str, st["links"]):
            return
        assert time.monotonic() < end, f"victim: bad frames {st['native']['tcp_bad_frames']}, links {st['links']}"
        await asyncio.sleep(0.02)


async def _first_data(s) -> tuple[object, dict]:
    """Read until the first DATA header arrives on any of the session's streams."""
    tasks = {asyncio.ensure_future(d.recv_frame(timeout=5)): d for d in s.data}
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for f in done:
                d = tasks.pop(f)
                item = f.result()
                assert item is not None, "the victim closed a data stream"
                if item[0]["type"] == hostile.DATA:
                    return d, item[0]
                tasks[asyncio.ensure_future(d.recv_frame(timeout=5))] = d
        raise AssertionError("no DATA frame")
    finally:
        for f in tasks:
            f.cancel()


async def test_lying_frames_fail_the_link_and_the_victim_keeps_working():
    """Finding 4: an authenticated peer floods its data connections with frames naming
    transfers that do not exist (ACK, ABORT_ACK, RERR, RDATA) or that are impossible in the
    transfer's state (an ACK or ABORT_ACK, an RERR or RDATA, for a push still being sent
    to it). Each fails that link (counted in tcp_bad_frames; the premature ones resolve the
    victim's push LLM_LINK_FAILED, never LLM_SUCCESS), no byte of the victim's memory
    changes, and the victim process (a child: a crash shows) keeps working with another
    peer, byte-exact."""
    small = SMALL
    victim = await PeerProcess.start(cluster_id=2, transport="tcp", secret=SECRET, options=peer_options())
    prefill = await tcp_prefill()
    sessions = []
    try:
        dst = (await victim.call("alloc", n=2, shape=list(small.shape), dtype="uint8", fill=DST_SEED))["cache_id"]
        src = (await victim.call("alloc", n=2, shape=list(small.shape), dtype="uint8", fill=SRC_SEED))["cache_id"]
        read_dst = await remote_view(victim, dst)
        read_src = await remote_view(victim, src)
        before = read_dst(), read_src()
        rng = np.random.default_rng(9)
        cluster = HOSTILE
        failures = []
        for name, flood in _unknown_frames(rng).items():
            bad = (await victim.call("stats"))["stats"]["native"]["tcp_bad_frames"]
            s, _ = await hostile_link(victim.address, cluster)
            sessions.append(s)
            st = (await victim.call("stats"))["stats"]
            assert st["native"]["tcp_bad_frames"] == bad and str(cluster) in map(str, st["links"]), st
            s.data[0].send(flood)
            try:
                await _victim_dropped(victim, cluster, bad, s.data[0])
            except AssertionError as e:
                failures.append(f"unknown {name}: {e}")
            s.close()
            cluster += 1
        for name in ("ACK", "ABORT_ACK", "RERR", "RDATA"):
            bad = (await victim.call("stats"))["stats"]["native"]["tcp_bad_frames"]
            s, _ = await hostile_link(victim.address, cluster, tcp_table(small))
            sessions.append(s)
            handle = (await victim.call("push_start", cache_id=src, cluster_id=cluster, dst_cache_id=1,
                                        deadline=30))["handle"]
            d, h = await _first_data(s)
            ftype = getattr(hostile, name)
            extra = b"\xcd" * 4096 if name == "RDATA" else b""
            d.send(hostile.header(ftype, xfer=h["xfer"], length=len(extra) or h["length"], total=h["total"],
                                  status=0x5010B002 if name == "RERR" else 0) + extra)
            try:
                await _victim_dropped(victim, cluster, bad, d)
            except AssertionError as e:
                failures.append(f"premature {name}: {e}")
            reply = await victim.call("push_wait", handle=handle, wait=HBT + HBI + SLACK)
            st = reply["status"]
            if st != S.LLM_LINK_FAILED:
                failures.append(f"premature {name}: the victim's push ended "
                                f"{S(st).name if st is not None else 'not at all'} (want LLM_LINK_FAILED)")
            s.close()
            cluster += 1
        assert victim.proc.returncode is None, f"the victim died ({victim.proc.returncode})"
        after = read_dst(), read_src()
        if changed(before[0], after[0]) or changed(before[1], after[1]):
            failures.append("a lying peer changed the victim's memory")
        for s in sessions:
            s.close()
        # the victim is alive and serves an honest peer, byte-exact
        await linked(prefill, 2, victim.address)
        await prefill.wait_remote_cache(2, dst, timeout=5)
        mine = prefill.allocate_cache(small)
        for i, t in enumerate(mine.tensors):
            fill_pattern(t, 303, i)
        assert await prefill.push_kv_cache(mine, kv.CacheIndex(2, dst, 0), timeout=10) == S.LLM_SUCCESS
        assert changed(read_dst(), own(mine)) == 0
        assert victim.proc.returncode is None, f"the victim died ({victim.proc.returncode})"
        assert not failures, "\n".join(failures)
    finally:
        for s in sessions:
            s.close()
        await close_all([prefill], [victim])


async def test_an_unfinished_data_frame_cannot_pin_a_cache():
    """Finding 7: an authenticated peer starts a DATA frame into our cache and never sends
    the rest (it keeps answering pings). The frame held the cache's region forever, so
    unregister_kv_cache never completed. Now the stream fails after making no progress for
    about heartbeat_timeout, the region is released, and the unregister completes."""
    victim = await tcp_prefill()
    s = None
    loop = asyncio.get_running_loop()
    try:
        mine = victim.allocate_cache(kv.CacheDesc(1, (1, 1 << 20), np.uint8))
        s, theirs = await hostile_link(victim.address, HOSTILE, (), streams=1)
        add = theirs[mine.cache_id]
        rid = add["regions"][add["placement"][0][0]][0]
        d = s.data[0]
        granted = False
        for _ in range(100):   # the victim asks us for a lease before it writes our DATA
            item = await d.recv_frame(timeout=5)
            assert item is not None, "the victim closed the data stream"
            if item[0]["type"] == hostile.LEASE_REQ:
                d.send(hostile.header(hostile.LEASE, offset=item[0]["offset"]))
                granted = True
                break
        assert granted, "no LEASE_REQ from the victim"
        size, first = 1 << 20, 4096
        # one whole frame, then the header of a second one and 10 of its bytes, in one write:
        # once the victim counted the first frame's bytes it has taken the second header too
        d.send(hostile.header(hostile.DATA, region=rid, xfer=1, offset=0, length=first, total=size)
               + b"\x5a" * first
               + hostile.header(hostile.DATA, region=rid, xfer=1, offset=first, length=size - first,
                                total=size)
               + b"\x5a" * 10)   # ... and never the rest
        await poll_until(lambda: received(victim) >= first, 5, "the victim took the first frame")
        assert victim.stats()["native"]["tcp_stalled"] == 0
        t0 = loop.time()
        fut = victim.unregister_kv_cache(mine.cache_id)
        bound = LINK_TIMEOUT + HBT + SLACK
        done, _ = await asyncio.wait([fut], timeout=bound + 5)
        assert done, f"unregister_kv_cache still pending {bound + 5:.1f} s later: the frame pins the region"
        assert loop.time() - t0 <= bound, f"unregister took {loop.time() - t0:.2f} s (bound {bound:.2f} s)"
        assert victim.stats()["native"]["tcp_stalled"] >= 1
        assert HOSTILE not in victim.stats()["links"]
    finally:
        if s is not None:
            s.close()
        await close_all([victim])
