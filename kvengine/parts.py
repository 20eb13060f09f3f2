"""The parts of a started engine, wired together; the order they close in; what they report.

Owns: the native core and its eventfd reader, the background tasks, and one
instance of each part. The wiring is the only place where one part is given
another; after it, each part calls the others only through the interfaces it
declared (``CachePeers``, ``TransferOwner``, ``Notifier``, ``Pusher``...).
Nothing here is public: :class:`~kvengine.engine.KvEngine` is the facade.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from typing import Any

from . import plan
from .accept import Acceptor
from .handshake import Dialer
from .keys import KeyTable
from .link import TaskSet, lease_low_ns
from .links import LinkManager
from .native import _native
from .notify import Notifier
from .registry import CacheRegistry
from .scheduler import Scheduler
from .stats import Accounting
from .status import LLMStatusCode as S, error_for
from .tables import CacheTables
from .targets import Targets
from .options import EngineOptions
from .types import Cache, CacheIndex, KvCacheExtParam, Role

__all__ = ["Parts", "UCX_HINT"]

UCX_HINT = ("transport='ucx' needs kvengine built with UCX: pip install \"kvengine[ucx]\" (or libucx-cu12), "
            "then rebuild kvengine (pip install -e . in a source tree) so setup.py finds it")

log = logging.getLogger("kvengine")
_warned: set[str] = set()


class Parts:
    """Every part of one started engine (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, cluster_id: int, role: Role, options: EngineOptions,
                 host: str, token: str) -> None:
        self.loop = loop
        self.thread = threading.get_ident()   # the loop's thread (KvEngine._open's check)
        self.options = options
        if options.transport == "ucx" and not _native.UCX:
            raise error_for(S.LLM_FEATURE_NOT_ENABLED, UCX_HINT)
        self.core = _native.Core(options.movers, options.chunk_bytes)
        self.tasks = TaskSet(loop)
        self.accounting = Accounting()
        self.planner = plan.Planner()
        self.registry = CacheRegistry(loop, self.core, cluster_id, token)
        self.notifier = Notifier(loop, options.max_notifications)
        self.scheduler = Scheduler(loop, self.core, options, self.notifier, self.accounting)
        self.keys = KeyTable(cluster_id)
        self.tables = CacheTables(loop, self.core, self.registry, self.keys)
        self.links = LinkManager(loop, self.core, options, cluster_id, self.registry, self.tables,
                                 self.scheduler, self.notifier, self.tasks)
        self.targets = Targets(loop, cluster_id, options, self.registry, self.links, self.scheduler,
                               self.planner)
        self.incarnation = secrets.token_hex(8)   # this start of this engine: a peer tells restarts apart
        self.dialer = Dialer(loop, options, cluster_id, role, host, token, self.incarnation, self.links)
        self.acceptor = Acceptor(loop, self.core, options, cluster_id, host, token, self.incarnation, self.links,
                                 self.tasks)
        # the hot path of awaited inline pushes and pulls, in C (cython_src/_fast.pxi): it runs
        # only what the planner memoized, and answers "not mine" to anything else
        self.fast = _native.FastPath(loop, self.core, options, self.scheduler.jobs, self.registry.table,
                                     self.links.table, self.planner.memo, self.accounting.all,
                                     self.accounting.peer, self.scheduler.inline_done, self.scheduler,
                                     lease_low_ns(options.heartbeat_timeout), Cache, CacheIndex, KvCacheExtParam)
        self.registry.peers = self.links
        self.keys.peers = self.links
        self.scheduler.on_link_failed = lambda link: self.links.link_down(link, S.LLM_LINK_FAILED)
        loop.add_reader(self.core.fileno(), self.drain)
        _warn_about_secret(options)

    def drain(self) -> None:
        """eventfd readable: route what the core reports to the part that owns it."""
        done = self.core.poll()
        jobs = [c for c in done if not c[0] & _native.EVENT] if done else done
        if len(jobs) != len(done):
            for job_id, status, _, _ in done:
                if job_id & _native.EVENT:
                    kind, ident = job_id & _native.EVENT_KIND_MASK, job_id & _native.EVENT_ID_MASK
                    if kind == _native.EVENT_REGION_FREED:
                        self.registry.on_region_freed(ident)
                    else:
                        self.links.data.on_native_event(kind, ident, status)
        if jobs:
            self.scheduler.on_completions(jobs)

    async def close(self) -> None:
        """Stop listening, unlink, fence, stop the core, release the caches. Bounded
        (``KvEngine.close`` says by what)."""
        self.registry.unpublish()
        self.acceptor.stop()
        self.notifier.close()
        await self.links.close(self.options.link_timeout)
        # a transfer whose peer did not fence it resolves when the peer's lease on it expired
        await self.scheduler.settle(self.options.heartbeat_timeout)
        self.tasks.cancel()
        self.core.close()          # aborts every job, joins the movers and the I/O thread
        self.links.closings.close_all()   # shm sockets still waiting for a peer to finish
        self.loop.remove_reader(self.core.fileno())
        self.drain()
        self.core.release()        # its descriptors and threads' memory, now (not at a GC)
        self.scheduler.close()
        self.registry.close()      # the core is closed: no thread touches the caches any more
        self.keys.clear()
        await self.acceptor.wait_closed()

    def stats(self) -> dict[str, Any]:
        whole = self.accounting.all.summary()
        return {
            "transfers": whole["transfers"], "bytes": whole["bytes"], "by_status": whole["by_status"],
            "queued": self.scheduler.queued, "in_flight": len(self.scheduler.pending),
            "latency": whole["latency"], "links": self.links.summary(),
            "links_closing": self.links.closings.summary(),
            "peers": {f"{cid}/{tr}": c.summary() for (cid, tr), c in self.accounting.peers.items()},
            "notifications": self.notifier.stats(),
            "control_refused": self.acceptor.preauth.refused, "control_pending": self.acceptor.preauth.count,
            "caches": len(self.registry), "cache_keys": len(self.keys),
            "data_port": self.acceptor.data_port, "native": self.core.stats(),
        }

    @staticmethod
    def empty_stats() -> dict[str, Any]:
        """``stats()`` of an engine not started."""
        return {"transfers": 0, "bytes": 0, "by_status": {}, "queued": 0, "in_flight": 0,
                "latency": {k: h.summary() for k, h in Accounting().all.hists.items()}, "links": {},
                "links_closing": {}, "peers": {},
                "notifications": {"sent": 0, "received": 0, "dropped": 0, "pending": 0},
                "control_refused": 0, "control_pending": 0, "caches": 0, "cache_keys": 0}


def _warn_about_secret(opts: EngineOptions) -> None:
    """Once per process: say what running without a secret means."""
    if opts.secret is None and opts.insecure and "insecure" not in _warned:
        _warned.add("insecure")
        log.warning("kvengine: no secret and insecure=True: any host that reaches this engine's "
                    "port can link to it and read and write its registered caches")
    elif opts.secret is None and not opts.insecure and "no_secret" not in _warned:
        _warned.add("no_secret")
        log.warning("kvengine: no secret configured (EngineOptions.secret or KVENGINE_SECRET): "
                    "links are not authenticated; only engines on this host can link")
