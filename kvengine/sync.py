"""kvengine for threads: a synchronous, thread-safe facade over :class:`KvEngine`.

    from kvengine.sync import SyncKvEngine
    with SyncKvEngine(1, kv.Role.PROMPT, "127.0.0.1:0") as engine:       # any thread
        engine.link_clusters([kv.ClusterInfo(2, addr)])
        cache = engine.register_kv_cache(desc, tensors)
        engine.push_kv_cache(cache, kv.CacheIndex(2, 1, 0))                # blocks; raises LLMError
        fut = engine.submit_push_kv_cache(cache, kv.CacheIndex(2, 1, 1))   # concurrent.futures.Future
        fut.result()                                                        # -> LLMStatusCode

The engine runs on its own event-loop thread (uvloop when installed), started
by the constructor. Every public ``KvEngine`` method has a twin here with the
same name and parameters: coroutines block until done and return or raise as
the async method does; the ``submit_*`` twins return a :class:`TransferFuture`
(a ``concurrent.futures.Future`` resolving to the final ``LLMStatusCode``,
never raising a status); ``layer_stream`` returns a :class:`SyncLayerStream`.
Any number of threads may call at once. Calling from the engine's own loop
thread (a done-callback) raises ``LLMFailedError``: use ``.engine`` there.

Owns: the loop thread and its shutdown. ``close()`` (or the ``with`` block)
closes the engine and joins the thread; an engine never closed is closed by a
``weakref.finalize`` when it is collected or at interpreter exit, waiting at
most ``max(link_timeout, heartbeat_timeout) + 2`` seconds, and the loop
thread is a daemon, so a process that forgets ``close()`` still exits.
Touches nothing inside the engine: it only calls ``KvEngine``'s public methods
on the loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from typing import Any, Callable, Coroutine, Iterator, Sequence, TypeVar

from .engine import KvEngine
from .loopthread import TransferFuture, _run_loop, _shutdown, new_loop
from .layers import LayerStream
from .notify import Notification
from .status import LLMError, LLMStatusCode as S, LinkResult, error_for
from .transfer import Transfer
from .options import EngineOptions
from .types import BlockTable, BlocksCacheKey, Cache, CacheDesc, CacheIndex, ClusterInfo, KvCacheExtParam, Role

__all__ = ["SyncKvEngine", "SyncLayerStream", "TransferFuture"]


_T = TypeVar("_T")


class SyncLayerStream:
    """:class:`LayerStream` for threads: ``layer_ready(i)`` from any thread, blocking waits."""

    def __init__(self, owner: "SyncKvEngine", stream: LayerStream) -> None:
        self._owner = owner
        self.stream = stream
        self.num_layers = stream.num_layers

    def layer_ready(self, layer: int) -> None:
        """Layer ``layer`` is computed: push it now. Any thread; raises as ``LayerStream.layer_ready``."""
        self.stream.layer_ready(layer)

    def wait(self, timeout: float | None = None) -> list[S | None]:
        """Block until every destination is settled: one status per destination.

        ``timeout`` bounds this wait only (the stream has its own deadline);
        ``LLMTimeoutError`` when it passes first."""
        return self._owner._run(self.stream.wait(), timeout)

    def wait_layer(self, layer: int, timeout: float | None = None) -> list[S | None]:
        return self._owner._run(self.stream.wait_layer(layer), timeout)

    def statuses(self) -> list[S | None]:
        return self._owner._call(self.stream.statuses)

    def cancel(self) -> None:
        self._owner._call(self.stream.cancel)

    def set_notify(self, payload: bytes | None) -> None:
        self._owner._call(self.stream.set_notify, payload)


def _detach() -> None:
    """The finalizer of a wrapped facade: nothing to stop."""


class SyncKvEngine:
    """A :class:`KvEngine` on its own loop thread, with blocking twins of its methods.

    The constructor takes ``KvEngine``'s parameters, plus ``loop`` (``"auto"``:
    uvloop when installed, ``"uvloop"``, ``"asyncio"``), and starts the engine:
    it raises as ``KvEngine.start()`` does (e.g. ``LLMLinkFailedError`` when it
    cannot listen), with the thread already stopped.
    """

    _finalizer: weakref.finalize[Any, Any]

    def __init__(self, cluster_id: int, role: Role = Role.PROMPT, listen: str | None = None,
                 options: EngineOptions | None = None, *, loop: str = "auto") -> None:
        self.engine = engine = KvEngine(cluster_id, role, listen, options)   # checks the arguments
        self.loop_name, self.loop = new_loop(loop)
        self._thread: threading.Thread | None = threading.Thread(
            target=_run_loop, args=(self.loop,), daemon=True, name=f"kvengine-{cluster_id}")
        o = engine.options
        self._bound = max(o.link_timeout, o.heartbeat_timeout) + 2.0
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self.loop, self._thread, engine, self._bound)
        try:
            asyncio.run_coroutine_threadsafe(engine.start(), self.loop).result()
        except BaseException:
            self._finalizer()
            raise

    # ------------------------------------------------------------------ plumbing

    @classmethod
    def wrap(cls, engine: KvEngine, loop: asyncio.AbstractEventLoop) -> "SyncKvEngine":
        """The blocking facade over an engine already started on ``loop``, which runs in
        another thread (an asyncio application with worker threads). It owns neither:
        ``close()`` only detaches the facade (later calls raise ``LLMEngineFinalizedError``);
        close the engine on its loop."""
        self = cls.__new__(cls)
        self.engine, self.loop, self.loop_name = engine, loop, type(loop).__module__.split(".")[0]
        self._thread = None
        self._bound = 0.0
        self._finalizer = weakref.finalize(self, _detach)
        return self

    def _check_thread(self) -> None:
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            raise error_for(S.LLM_FAILED, "a blocking SyncKvEngine call on its own event-loop thread (in a "
                                          "callback?) would wait for itself: use the async engine there "
                                          "(sync_engine.engine)")

    def _closed_error(self) -> LLMError:
        return error_for(S.LLM_ENGINE_FINALIZED, "the engine is closed")

    def _run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        """Run ``coro`` on the loop thread and block for its result (or exception)."""
        self._check_thread()
        if self.closed:
            coro.close()
            raise self._closed_error()
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:
            coro.close()
            raise self._closed_error() from None
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise error_for(S.LLM_TIMEOUT, f"no result within {timeout} s") from None
        except concurrent.futures.CancelledError:
            raise self._closed_error() from None

    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Call plain ``fn(*args)`` on the loop thread and block for its result."""
        self._check_thread()
        if self.closed:
            raise self._closed_error()
        fut: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn(*args))
            except BaseException as e:
                fut.set_exception(e)
        try:
            self.loop.call_soon_threadsafe(run)
        except RuntimeError:
            raise self._closed_error() from None
        return fut.result()

    def _submit(self, launch: Callable[[], Transfer]) -> TransferFuture:
        fut = TransferFuture(self.loop)
        if self.closed:
            fut._message = "the engine is closed"
            fut.set_result(S.LLM_ENGINE_FINALIZED)
            return fut

        def run() -> None:
            try:
                fut._bind(launch())
            except BaseException as e:   # submit_* never raise a status; anything else is a bug: report it
                fut.set_exception(e)
        try:
            self.loop.call_soon_threadsafe(run)
        except RuntimeError:
            fut._message = "the engine is closed"
            fut.set_result(S.LLM_ENGINE_FINALIZED)
        return fut

    def _wait(self, fut: TransferFuture) -> S:
        self._check_thread()
        st = fut.result()
        if st == S.LLM_SUCCESS:
            return S.LLM_SUCCESS
        raise error_for(st, fut.message())

    # ----------------------------------------------------------------- lifecycle

    @property
    def cluster_id(self) -> int:
        return self.engine.cluster_id

    @property
    def role(self) -> Role:
        return self.engine.role

    @property
    def options(self) -> EngineOptions:
        return self.engine.options

    @property
    def address(self) -> str | None:
        return self.engine.address

    def close(self) -> None:
        """Close the engine (as ``KvEngine.close``) and stop the loop thread. Idempotent.

        Waits at most ``max(link_timeout, heartbeat_timeout) + 2`` seconds."""
        self._check_thread()
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "SyncKvEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------- caches

    def allocate_cache(self, desc: CacheDesc) -> Cache:
        """``KvEngine.allocate_cache``; the pre-faulting runs in a worker thread, the loop stays free."""
        return self._run(self.engine.allocate_cache_async(desc))

    def allocate_cache_async(self, desc: CacheDesc) -> concurrent.futures.Future[Cache]:
        """``KvEngine.allocate_cache_async``, as a ``concurrent.futures.Future``."""
        try:
            return asyncio.run_coroutine_threadsafe(self.engine.allocate_cache_async(desc), self.loop)
        except RuntimeError:
            raise self._closed_error() from None

    def register_kv_cache(self, desc: CacheDesc, tensors: Sequence[Any], **kwargs: Any) -> Cache:
        """``KvEngine.register_kv_cache`` (keyword arguments pass through, e.g. ``cache_keys``)."""
        return self._call(lambda: self.engine.register_kv_cache(desc, tensors, **kwargs))

    def unregister_kv_cache(self, cache_id: int) -> concurrent.futures.Future[None]:
        """``KvEngine.unregister_kv_cache``: returns a ``concurrent.futures.Future`` done when the
        memory is released (``.result()`` to wait; bounded as the async future)."""
        async def run() -> None:
            await self.engine.unregister_kv_cache(cache_id)
        self._call(lambda: None)   # raises on a closed facade / loop thread
        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call any other plain ``KvEngine`` method by name on the loop thread (e.g. a method
        newer than this facade); a coroutine result is awaited there."""
        fn = getattr(self.engine, name)
        if asyncio.iscoroutinefunction(fn):
            return self._run(fn(*args, **kwargs))
        return self._call(lambda: fn(*args, **kwargs))

    # --------------------------------------------------------------------- links

    def link_clusters(self, clusters: Sequence[ClusterInfo], timeout: float | None = None
                      ) -> tuple[S, list[LinkResult]]:
        return self._run(self.engine.link_clusters(clusters, timeout))

    def unlink_clusters(self, clusters: Sequence[ClusterInfo], timeout: float | None = None,
                        force: bool = False) -> tuple[S, list[LinkResult]]:
        return self._run(self.engine.unlink_clusters(clusters, timeout, force))

    def wait_link(self, cluster_id: int, timeout: float | None = None) -> S:
        return self._run(self.engine.wait_link(cluster_id, timeout))

    def wait_remote_cache(self, cluster_id: int, cache_id: int, timeout: float | None = None) -> S:
        return self._run(self.engine.wait_remote_cache(cluster_id, cache_id, timeout))

    # ----------------------------------------------------------------- transfers

    def submit_push_kv_cache(self, cache: Cache, dst_index: CacheIndex, src_batch_index: int = 0,
                             size: int = -1, ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None, priority: int = 0,
                             notify: bytes | None = None) -> TransferFuture:
        e = self.engine
        return self._submit(lambda: e.submit_push_kv_cache(cache, dst_index, src_batch_index, size, ext_param,
                                                           timeout, priority, notify))

    def submit_pull_kv_cache(self, src_index: CacheIndex, cache: Cache, batch_index: int = 0,
                             size: int = -1, ext_param: KvCacheExtParam | None = None,
                             timeout: float | None = None, priority: int = 0) -> TransferFuture:
        e = self.engine
        return self._submit(lambda: e.submit_pull_kv_cache(src_index, cache, batch_index, size, ext_param,
                                                           timeout, priority))

    def submit_push_kv_blocks(self, cache: Cache, dst_key: BlocksCacheKey, src_blocks: BlockTable,
                              dst_blocks: BlockTable, ext_param: KvCacheExtParam | None = None,
                              timeout: float | None = None, priority: int = 0,
                              notify: bytes | None = None) -> TransferFuture:
        e = self.engine
        return self._submit(lambda: e.submit_push_kv_blocks(cache, dst_key, src_blocks, dst_blocks, ext_param,
                                                            timeout, priority, notify))

    def submit_pull_kv_blocks(self, src_key: BlocksCacheKey, cache: Cache, src_blocks: BlockTable,
                              dst_blocks: BlockTable, ext_param: KvCacheExtParam | None = None,
                              timeout: float | None = None, priority: int = 0) -> TransferFuture:
        e = self.engine
        return self._submit(lambda: e.submit_pull_kv_blocks(src_key, cache, src_blocks, dst_blocks, ext_param,
                                                            timeout, priority))

    def push_kv_cache(self, cache: Cache, dst_index: CacheIndex, src_batch_index: int = 0,
                      size: int = -1, ext_param: KvCacheExtParam | None = None,
                      timeout: float | None = None, priority: int = 0,
                      notify: bytes | None = None) -> S:
        """``LLM_SUCCESS`` or raise the ``LLMError`` subclass of the status (blocks until fenced)."""
        return self._wait(self.submit_push_kv_cache(cache, dst_index, src_batch_index, size, ext_param,
                                                    timeout, priority, notify))

    def pull_kv_cache(self, src_index: CacheIndex, cache: Cache, batch_index: int = 0,
                      size: int = -1, ext_param: KvCacheExtParam | None = None,
                      timeout: float | None = None, priority: int = 0) -> S:
        return self._wait(self.submit_pull_kv_cache(src_index, cache, batch_index, size, ext_param,
                                                    timeout, priority))

    def push_kv_blocks(self, cache: Cache, dst_key: BlocksCacheKey, src_blocks: BlockTable,
                       dst_blocks: BlockTable, ext_param: KvCacheExtParam | None = None,
                       timeout: float | None = None, priority: int = 0,
                       notify: bytes | None = None) -> S:
        return self._wait(self.submit_push_kv_blocks(cache, dst_key, src_blocks, dst_blocks, ext_param,
                                                     timeout, priority, notify))

    def pull_kv_blocks(self, src_key: BlocksCacheKey, cache: Cache, src_blocks: BlockTable,
                       dst_blocks: BlockTable, ext_param: KvCacheExtParam | None = None,
                       timeout: float | None = None, priority: int = 0) -> S:
        return self._wait(self.submit_pull_kv_blocks(src_key, cache, src_blocks, dst_blocks, ext_param,
                                                     timeout, priority))

    def layer_stream(self, cache: Cache, dsts: Sequence[Any], src_batch_index: int = 0,
                     tensor_num_per_layer: int = 2, timeout: float | None = None,
                     notify: bytes | None = None, priority: int = 0,
                     src_blocks: BlockTable | None = None, dst_blocks: Any = None,
                     src_head_range: Any = (-1, -1), dst_head_range: Any = (-1, -1)) -> SyncLayerStream:
        stream = self._call(lambda: self.engine.layer_stream(cache, dsts, src_batch_index, tensor_num_per_layer,
                                                             timeout, notify, priority, src_blocks, dst_blocks,
                                                             src_head_range, dst_head_range))
        return SyncLayerStream(self, stream)

    # ------------------------------------------------------------- notifications

    def wait_notification(self, match: bytes | None = None, timeout: float | None = None) -> Notification:
        return self._run(self.engine.wait_notification(match, timeout))

    def notifications(self) -> Iterator[Notification]:
        """Every notification as it arrives (blocking iterator); ends when the engine closes."""
        it = self._call(self.engine.notifications)

        async def next_one() -> Notification:
            return await it.__anext__()
        while True:
            try:
                yield self._run(next_one())
            except (StopAsyncIteration, LLMError):
                return

    # ---------------------------------------------------------------- inspection

    def stats(self) -> dict[str, Any]:
        if self.closed:
            return self.engine.stats()
        return self._call(self.engine.stats)

    def metrics_text(self) -> str:
        if self.closed:
            return self.engine.metrics_text()
        return self._call(self.engine.metrics_text)

    def __repr__(self) -> str:
        return f"<SyncKvEngine {self.engine!r} loop={self.loop_name}>"
