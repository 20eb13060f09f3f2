"""KvEngine: the public object, a thin facade over the engine's parts.

Owns: the lifecycle (start, close), the loop that started it, and the parts
(kvengine/parts.py wires them at start), which it only calls:

- the cache registry (kvengine/registry.py): our caches;
- the link manager (kvengine/links.py) with the handshake (handshake.py,
  accept.py) and the cache tables (tables.py): our peers;
- the request keys bound to our rows (kvengine/keys.py);
- the transfer front (kvengine/targets.py: what a transfer names, ask once)
  and the scheduler (kvengine/scheduler.py) with the planner (plan.py) and
  the accounting (stats.py): transfers;
- the notifier (kvengine/notify.py): push notifications.

Threading: every method runs on the event loop thread, except the native
movers and I/O threads, which move bytes without the GIL and report through
one eventfd (``loop.add_reader``); ``Parts.drain`` routes what they report.
The picture: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Sequence

from . import control, plan
from .layers import LayerStream
from .notify import Notification
from .options import EngineOptions
from .parts import Parts
from .registry import check_desc
from .stats import Accounting
from .status import LLMError, LLMStatusCode as S, LinkResult, error_for, overall
from .targets import Segments
from .transfer import Transfer
from .types import (BlockTable, BlocksCacheKey, Cache, CacheDesc, CacheIndex, CacheKey, ClusterInfo,
                    KvCacheExtParam, Role, check_timeout, param_invalid)

__all__ = ["KvEngine"]

_U64 = 2**64 - 1


class KvEngine:
    """One cluster's KV-cache transfer engine (LLM-DataDist's ``LLMDataDist`` + cache manager).

    Use ``async with KvEngine(cluster_id, role, listen="127.0.0.1:0") as engine:``.
    ``listen=None`` makes a client-only engine (it can link to others, nobody links to it).
    """

    def __init__(self, cluster_id: int, role: Role = Role.PROMPT, listen: str | None = None,
                 options: EngineOptions | None = None) -> None:
        if isinstance(cluster_id, bool) or not isinstance(cluster_id, int) or not 0 <= cluster_id <= _U64:
            raise param_invalid(f"cluster_id must be an int in [0, 2**64-1], got {cluster_id!r}")
        try:
            role = Role(role)
        except ValueError:
            raise param_invalid(f"role must be a kvengine.Role, got {role!r}") from None
        if listen is not None:
            try:
                control.parse_address(listen)
            except ValueError as e:
                raise param_invalid(str(e)) from None
        if options is None:
            options = EngineOptions()
        elif not isinstance(options, EngineOptions):
            raise param_invalid("options must be an EngineOptions")
        self.cluster_id = cluster_id
        self.role = role
        self.options = options
        self.address: str | None = None
        self._listen = listen
        self._host = control.host_identity()
        self._token = control.new_nonce()
        self._p: Parts | None = None
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> "KvEngine":
        """Start the native core and, with ``listen``, the control servers."""
        if self._p is not None or self._closed:
            self._open()   # closed, or started on another loop: say so
            return self
        loop = asyncio.get_running_loop()
        self._p = p = Parts(loop, self.cluster_id, self.role, self.options, self._host, self._token)
        try:
            self.address = await p.acceptor.start(self._listen)
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self) -> "KvEngine":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Unlink every peer, abort every transfer (fenced), stop the core. Idempotent.

        Transfers still in flight resolve ``LLM_ENGINE_FINALIZED`` (or, if the peer
        could not fence them, ``LLM_LINK_FAILED`` once its lease on them expired).
        Bounded: the graceful unlinks get ``link_timeout`` in all; links still up
        then are dropped, and unfenced transfers resolve within ``heartbeat_timeout``
        of their abort. Cancel-safe: the closing runs in its own task, so a cancelled
        ``close()`` keeps closing and a second call waits for the same task.
        """
        if self._p is not None:
            self._check_loop(self._p.loop)
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        if self._p is not None:
            await self._p.close()

    def _open(self) -> Parts:
        """The parts, if the engine is open and called on its loop; else raise."""
        if self._closed:
            raise error_for(S.LLM_ENGINE_FINALIZED, "the engine is closed")
        if self._p is None:
            raise error_for(S.LLM_FAILED, "the engine is not started: use `async with` or `await engine.start()`")
        p = self._p
        if threading.get_ident() != p.thread or not p.loop.is_running():
            self._check_loop(p.loop)   # else its loop runs on this thread: asyncio's check (a getpid()) spared
        return p

    def _check_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Raise unless the caller runs on the loop that started the engine: its futures, readers
        and timers belong to that loop (called elsewhere, asyncio fails deep inside or waits forever)."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return
        where = ("a thread with no running event loop" if running is None
                 else f"another event loop ({type(running).__name__} in thread "
                      f"{threading.current_thread().name!r})")
        raise error_for(S.LLM_FAILED,
                        f"KvEngine {self.cluster_id} was called from {where}; it runs on the event loop "
                        f"that started it ({type(loop).__name__}): call it there, or from another "
                        f"thread submit the coroutine to that loop: "
                        f"asyncio.run_coroutine_threadsafe(coro, engine_loop).result() "
                        f"(plain methods: engine_loop.call_soon_threadsafe)")

    # ------------------------------------------------------------------- caches

    def allocate_cache(self, desc: CacheDesc, cache_keys: Sequence[CacheKey] | None = None) -> Cache:
        """Engine-owned cache in shared memory (memfd), pre-faulted.

        Peers on this host map it and write straight into it. ``cache.tensors``
        are numpy views; keep using them until you unregister the cache.
        Pre-faulting runs on the calling thread (~0.3-2 s per GiB on these VMs): for
        large caches on a live engine use :meth:`allocate_cache_async`, which keeps
        the loop (and so the links' heartbeats) running meanwhile.
        ``cache_keys``: key i names batch row i (see :meth:`bind_cache_key`).
        """
        p = self._open()
        keys = p.keys.check(cache_keys, check_desc(desc).batch_size)
        return p.keys.bind_all(p.registry.allocate(desc), keys)

    async def allocate_cache_async(self, desc: CacheDesc, cache_keys: Sequence[CacheKey] | None = None) -> Cache:
        """:meth:`allocate_cache`, with the pre-faulting in a worker thread."""
        p = self._open()
        p.keys.check(cache_keys, check_desc(desc).batch_size)
        cache = await p.registry.allocate_async(desc)
        try:   # checked again: a key may have been bound meanwhile
            keys = p.keys.check(cache_keys, desc.batch_size)
        except LLMError:
            await p.registry.unregister(cache.cache_id)
            raise
        return p.keys.bind_all(cache, keys)

    def register_kv_cache(self, desc: CacheDesc, tensors: Sequence[Any],
                          cache_keys: Sequence[CacheKey] | None = None) -> Cache:
        """Register caller-owned buffers, one per tensor (LLM-DataDist's RegisterKvCache):
        numpy arrays, buffer-protocol objects, ``__dlpack__`` CPU tensors (torch) and their
        views; writable; C-contiguous of ``desc.size`` bytes, or of ``desc.shape`` with
        blocks ``desc.block_stride`` apart (kvengine.layout.kv_tensors: vLLM, FlashInfer).
        Kept referenced until unregistered. ``cache_keys``: key i names batch row i."""
        p = self._open()
        keys = p.keys.check(cache_keys, check_desc(desc).batch_size)
        return p.keys.bind_all(p.registry.register(desc, tensors), keys)

    def bind_cache_key(self, cache: Cache, key: CacheKey, batch_index: int = 0) -> None:
        """Bind ``key`` to row ``batch_index`` of a registered ``cache``, and announce it to
        every linked peer (a peer then pushes to or pulls from ``key`` as from a
        :class:`CacheIndex`). ``key.cluster_id`` must be this engine's cluster id; a key
        already bound raises ``LLMCacheKeyAlreadyExistError``; bad input ``LLMParamInvalidError``."""
        p = self._open()
        state = p.registry.get(cache)
        p.keys.bind(state.cache.cache_id, state.cache.desc.batch_size, key, batch_index)

    def remove_cache_key(self, key: CacheKey) -> None:
        """Unbind ``key`` (peers forget it); an unknown key is a no-op, as in LLM-DataDist."""
        self._open().keys.remove(key)

    def unregister_kv_cache(self, cache_id: int) -> asyncio.Future[None]:
        """Forget a cache (an unknown id is a no-op, as in LLM-DataDist).

        New transfers naming it fail at once with ``LLM_KV_CACHE_NOT_EXIST``.
        Its keys are unbound (peers forget them with the cache).
        The memory stays referenced until transfers in flight on it have finished
        (bounded by their deadlines and fences) and every linked peer has confirmed it
        will not touch it any more; a peer that does not confirm within ``link_timeout``
        is unlinked. Caller-owned memory also waits for every same-host peer whose link
        went down meanwhile to finish it (or die): a stopped one could still write it
        (docs/decisions.md #32). Returns a future that is done then; awaiting it is optional.
        """
        p = self._open()
        if cache_id in p.registry:
            p.keys.drop_cache(cache_id)
        return p.registry.unregister(cache_id)

    # -------------------------------------------------------------------- links

    async def link_clusters(self, clusters: Sequence[ClusterInfo], timeout: float | None = None
                            ) -> tuple[S, list[LinkResult]]:
        """Link to each peer (in parallel): ``(overall status, [result per cluster])``.

        Per cluster: ``LLM_SUCCESS``, ``LLM_ALREADY_LINK``, ``LLM_PROCESSING_LINK``
        (a link to that cluster is being set up), ``LLM_LINK_FAILED`` (unreachable,
        refused, authentication failed), ``LLM_TIMEOUT`` or ``LLM_PARAM_INVALID``, as a
        :class:`LinkResult`: equal to its status code, with the failure's ``reason``.
        The overall status is ``LLM_SUCCESS`` only if every cluster linked.
        """
        p = self._open()
        return await p.dialer.link_clusters(clusters, check_timeout(timeout, self.options.link_timeout))

    async def unlink_clusters(self, clusters: Sequence[ClusterInfo], timeout: float | None = None,
                              force: bool = False) -> tuple[S, list[LinkResult]]:
        """Tear links down: ``(overall status, [result per cluster])``.

        Normal unlink tells the peer, which aborts (fenced) its transfers to us
        first; ``force=True`` only drops this end. Unknown cluster: ``LLM_NOT_YET_LINK``.
        """
        p = self._open()
        tmo = check_timeout(timeout, self.options.link_timeout)
        if isinstance(clusters, ClusterInfo) or not isinstance(clusters, (list, tuple)) or not clusters:
            return S.LLM_PARAM_INVALID, []
        ids = [c.remote_cluster_id for c in clusters if isinstance(c, ClusterInfo)]

        async def one(c: Any) -> LinkResult:
            if not isinstance(c, ClusterInfo) or ids.count(c.remote_cluster_id) > 1:
                return LinkResult(S.LLM_PARAM_INVALID, "not a ClusterInfo, or listed twice")
            link = p.links.get(c.remote_cluster_id)
            if link is None:
                return LinkResult(S.LLM_NOT_YET_LINK, f"cluster {c.remote_cluster_id!r} is not linked")
            return await p.links.unlink(link, tmo, graceful=not force)
        done = [await one(c) for c in clusters] if len(clusters) == 1 else \
            list(await asyncio.gather(*(one(c) for c in clusters)))
        return overall(done), done

    async def wait_link(self, cluster_id: int, timeout: float | None = None) -> S:
        """Wait until a link with ``cluster_id`` is up, made by either end (a listening
        decode engine uses it to learn that a prefill engine linked to it).

        Returns ``LLM_SUCCESS``; raises ``LLMTimeoutError`` after ``timeout``
        (default ``link_timeout``).
        """
        p = self._open()
        return await p.links.wait_link(cluster_id, check_timeout(timeout, self.options.link_timeout))

    async def wait_remote_cache(self, cluster_id: int, cache_id: int, timeout: float | None = None) -> S:
        """Wait until linked peer ``cluster_id`` has announced cache ``cache_id``.

        Caches a peer registers after linking reach this engine asynchronously;
        this is how a prefill worker waits for a decode worker's new cache.
        Returns ``LLM_SUCCESS`` or raises (``LLM_NOT_YET_LINK``, ``LLM_TIMEOUT``, or
        ``LLM_LINK_FAILED`` / ``LLM_NOT_YET_LINK`` if the link goes down meanwhile).
        """
        p = self._open()
        tmo = check_timeout(timeout, self.options.sync_kv_timeout)
        link = p.links.get(cluster_id)
        if link is None:
            raise error_for(S.LLM_NOT_YET_LINK, f"cluster {cluster_id!r} is not linked")
        return await p.tables.wait_remote(link, cache_id, tmo)

    # ---------------------------------------------------------------- transfers

    def _submit(self, op: str, cache: Any, where: Any, name: str, kinds: tuple[type, ...], timeout: Any,
                priority: Any, notify: Any, segments: Segments) -> Transfer:
        """Check, plan and launch one push or pull (kvengine/targets.py); a failed check is
        a finished Transfer."""
        try:
            p = self._open()
        except LLMError as e:
            return Transfer.failed(self._p.scheduler if self._p is not None else None, op, e.status, e.message)
        return p.targets.submit(op, cache, where, name, kinds, timeout, priority, notify, segments)

    def submit_push_kv_cache(self, cache: Cache, dst_index: CacheIndex | CacheKey, src_batch_index: int = 0,
                             size: int = -1, ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None, priority: int = 0,
                             notify: bytes | None = None) -> Transfer:
        """Start writing row ``src_batch_index`` of local ``cache`` into the peer's
        ``dst_index`` row (a :class:`CacheIndex`, or a :class:`CacheKey` the peer
        ``key.cluster_id`` bound to a row); returns a :class:`Transfer` (awaiting it never
        raises). A cache or key the peer has not announced yet is asked for first."""
        return self._submit("push_kv_cache", cache, dst_index, "dst_index", (CacheIndex, CacheKey), timeout,
                            priority, notify,
                            lambda planner, local, rc, row: planner.segments(
                                ("pc", local.serial, rc.serial, src_batch_index, row, size, ext_param),
                                lambda: plan.plan_cache(local.cache.desc, rc.desc, src_batch_index,
                                                        row, size, ext_param, op="push"),
                                local.cache._regions, rc.regions))

    def submit_pull_kv_cache(self, src_index: CacheIndex | CacheKey, cache: Cache, batch_index: int = 0,
                             size: int = -1, ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None, priority: int = 0) -> Transfer:
        """Start reading the peer's ``src_index`` row (a :class:`CacheIndex` or a
        :class:`CacheKey`) into row ``batch_index`` of local ``cache``; ``size`` is bytes
        per tensor or -1 for the whole row."""
        return self._submit("pull_kv_cache", cache, src_index, "src_index", (CacheIndex, CacheKey), timeout,
                            priority, None,
                            lambda planner, local, rc, row: planner.segments(
                                ("lc", local.serial, rc.serial, row, batch_index, size, ext_param),
                                lambda: plan.plan_cache(rc.desc, local.cache.desc, row,
                                                        batch_index, size, ext_param, op="pull"),
                                rc.regions, local.cache._regions))

    def submit_push_kv_blocks(self, cache: Cache, dst_key: BlocksCacheKey, src_blocks: BlockTable,
                              dst_blocks: BlockTable, ext_param: KvCacheExtParam | None = None,
                              timeout: float | None = None, priority: int = 0,
                              notify: bytes | None = None) -> Transfer:
        """Start writing local blocks ``src_blocks[i]`` into the peer's ``dst_blocks[i]``
        (``ext_param``: layer ranges, and head ranges for caches with a ``head_axis``)."""
        return self._submit("push_kv_blocks", cache, dst_key, "dst_key", (BlocksCacheKey,), timeout, priority,
                            notify, lambda planner, local, rc, row: planner.blocks(
                                local.cache.desc, rc.desc, src_blocks, dst_blocks, ext_param, "push",
                                local.cache._regions, rc.regions))

    def submit_pull_kv_blocks(self, src_key: BlocksCacheKey, cache: Cache, src_blocks: BlockTable,
                              dst_blocks: BlockTable, ext_param: KvCacheExtParam | None = None,
                              timeout: float | None = None, priority: int = 0) -> Transfer:
        """Start reading the peer's blocks ``src_blocks[i]`` into local ``dst_blocks[i]``."""
        return self._submit("pull_kv_blocks", cache, src_key, "src_key", (BlocksCacheKey,), timeout, priority,
                            None, lambda planner, local, rc, row: planner.blocks(
                                rc.desc, local.cache.desc, src_blocks, dst_blocks, ext_param, "pull",
                                rc.regions, local.cache._regions))

    async def push_kv_cache(self, cache: Cache, dst_index: CacheIndex | CacheKey, src_batch_index: int = 0,
                            size: int = -1, ext_param: KvCacheExtParam | None = None,
                            timeout: float | None = None, priority: int = 0,
                            notify: bytes | None = None) -> S:
        """PushKvCache: ``LLM_SUCCESS`` or raise the :class:`LLMError` subclass of the status.
        ``priority`` (-1000..1000, higher first) and the deadline order the link's queue;
        ``notify`` bytes reach the destination engine after the last byte landed."""
        r = None if self._closed or self._p is None else \
            self._p.fast.push(cache, dst_index, src_batch_index, size, ext_param, timeout, priority, notify)
        if r is None:   # not the common case the native fast path runs whole (kvengine/parts.py)
            r = self.submit_push_kv_cache(cache, dst_index, src_batch_index, size, ext_param, timeout,
                                          priority, notify)
        return S.LLM_SUCCESS if r == 0 else await r._result()

    async def pull_kv_cache(self, src_index: CacheIndex | CacheKey, cache: Cache, batch_index: int = 0,
                            size: int = -1, ext_param: KvCacheExtParam | None = None,
                            timeout: float | None = None, priority: int = 0) -> S:
        """PullKvCache: ``LLM_SUCCESS`` or raise the :class:`LLMError` subclass of the status."""
        r = None if self._closed or self._p is None else \
            self._p.fast.pull(src_index, cache, batch_index, size, ext_param, timeout, priority)
        if r is None:
            r = self.submit_pull_kv_cache(src_index, cache, batch_index, size, ext_param, timeout, priority)
        return S.LLM_SUCCESS if r == 0 else await r._result()

    async def push_kv_blocks(self, cache: Cache, dst_key: BlocksCacheKey, src_blocks: BlockTable,
                             dst_blocks: BlockTable, ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None, priority: int = 0,
                             notify: bytes | None = None) -> S:
        """PushKvBlocks: ``LLM_SUCCESS`` or raise."""
        return await self.submit_push_kv_blocks(cache, dst_key, src_blocks, dst_blocks, ext_param,
                                                timeout, priority, notify)._result()

    async def pull_kv_blocks(self, src_key: BlocksCacheKey, cache: Cache, src_blocks: BlockTable,
                             dst_blocks: BlockTable, ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None, priority: int = 0) -> S:
        """PullKvBlocks: ``LLM_SUCCESS`` or raise."""
        return await self.submit_pull_kv_blocks(src_key, cache, src_blocks, dst_blocks, ext_param,
                                                timeout, priority)._result()

    def layer_stream(self, cache: Cache, dsts: Sequence[Any], src_batch_index: int = 0,
                     tensor_num_per_layer: int = 2, timeout: float | None = None,
                     notify: bytes | None = None, priority: int = 0,
                     src_blocks: BlockTable | None = None,
                     dst_blocks: BlockTable | Sequence[BlockTable] | None = None,
                     src_head_range: Any = (-1, -1), dst_head_range: Any = (-1, -1)) -> LayerStream:
        """Push ``cache`` layer by layer as layers become ready (see kvengine/layers.py).

        ``dsts``: ``CacheIndex`` or ``CacheKey`` rows (source row ``src_batch_index``), or
        ``BlocksCacheKey`` caches with ``src_blocks`` and ``dst_blocks`` (one table, or one
        per destination; lists, numpy int arrays or CPU tensors), and head ranges (one, or
        a list of one per destination: KvCacheExtParam's). ``timeout`` covers the whole
        stream. ``notify`` reaches each destination once all its layers landed."""
        p = self._open()
        local = p.registry.get(cache)
        tmo, prio, note = plan.transfer_options(timeout, self.options.sync_kv_timeout, priority, notify)
        tnpl = plan.check_tensor_num_per_layer(tensor_num_per_layer, ("source", local.cache.desc))

        def notify_peer(cluster_id: int, payload: bytes) -> None:
            link = p.links.get(cluster_id)
            if link is not None:
                p.notifier.send(link, payload)
        return LayerStream(self, p.loop, notify_peer, cache, dsts, src_batch_index, tnpl, tmo, note, prio,
                           src_blocks, dst_blocks, (src_head_range, dst_head_range))

    # ------------------------------------------------------------- notifications

    async def wait_notification(self, match: bytes | None = None, timeout: float | None = None) -> Notification:
        """The next notification whose payload equals ``match`` (any, if None).

        Returns one already received if there is one. Raises ``LLMTimeoutError``
        after ``timeout`` seconds (default ``sync_kv_timeout``)."""
        p = self._open()
        tmo = check_timeout(timeout, self.options.sync_kv_timeout)
        if match is not None and not isinstance(match, (bytes, bytearray)):
            raise param_invalid("match must be bytes or None")
        return await p.notifier.wait(bytes(match) if match is not None else None, tmo)

    def notifications(self) -> AsyncIterator[Notification]:
        """``async for note in engine.notifications():`` every notification, as it arrives
        (shares the buffer with :meth:`wait_notification`: each is delivered once).
        The iteration ends when the engine closes."""
        return self._open().notifier.iterate()

    # ---------------------------------------------------------------- inspection

    def stats(self) -> dict[str, Any]:
        """Counters and latency summaries (see docs/api.md, "Inspection").

        ``latency`` phases: ``queue`` (submit to first byte handed to the core),
        ``transfer`` (first piece to completion), ``total``; each with count, mean
        and p50/p90/p99 in seconds. ``peers`` holds the same per ``"cluster/transport"``.
        """
        return self._p.stats() if self._p is not None else Parts.empty_stats()

    def metrics_text(self) -> str:
        """The counters and histograms in Prometheus text exposition format."""
        from .metrics import render
        p = self._p
        return render(self.cluster_id, self.stats(), p.accounting if p is not None else Accounting())

    def __repr__(self) -> str:
        state = "closed" if self._closed else "started" if self._p is not None else "new"
        return f"<KvEngine cluster={self.cluster_id} role={self.role.name} address={self.address} {state}>"
