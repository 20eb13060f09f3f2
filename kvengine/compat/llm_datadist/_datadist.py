"""``LLMDataDist``: lifecycle, links and roles, over one :class:`kvengine.sync.SyncKvEngine`.

``init(options)`` starts the engine (listening when ``llm.ListenIp``/``llm.ListenPort``
are given), ``finalize()`` closes it; only one initialized instance per
process, finalized at exit. ``switch_role`` (no links may exist) starts a new
engine with the new role and listen state and registers every cache again, so
cache ids stay what the user was given.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, Callable, Sequence

import kvengine as kv
from kvengine.sync import SyncKvEngine
from ._cache_manager import CacheManager
from ._types import LLMClusterInfo, LLMException, LLMRole, LLMStatusCode, RegisterMemStatus, check_int, raise_llm

__all__ = ["LLMDataDist"]

S = LLMStatusCode
_NOT_INITIALIZED = "llm datadist is not initialized"
_live: "LLMDataDist | None" = None
_live_lock = threading.Lock()


def _ms(timeout: Any, name: str = "timeout") -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
        raise LLMException(f"{name} must be a positive int of milliseconds, got {timeout!r}", S.LLM_PARAM_INVALID)
    return timeout / 1000


def _listen(options: dict[str, str]) -> str | None:
    ip, port = options.get("llm.ListenIp"), options.get("llm.ListenPort")
    info = options.get("llm.ListenIpInfo") or options.get("llm.listenIpInfo")
    if info and ip is None:
        ip, _, port = info.rpartition(":")
    if ip is None:
        return None
    if not port or not port.isdigit():
        raise LLMException(f"listen ip info needs a port, got {ip!r}:{port!r}", S.LLM_PARAM_INVALID)
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class LLMDataDist:
    """LLM-DataDist V2's ``LLMDataDist(role, cluster_id)`` in CacheManager mode."""

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        self._role = LLMRole(role)
        self._cluster_id = check_int("cluster_id", cluster_id, 0, 2**64 - 1)
        self._engine: SyncKvEngine | None = None
        self._options: kv.EngineOptions | None = None
        self._manager: CacheManager | None = None
        self._lock = threading.RLock()

    # -------------------------------------------------------------- lifecycle

    def init(self, options: dict[str, str]) -> None:
        """Start (idempotent). ``llm.SyncKvCacheWaitTime`` (ms) is the transfer timeout."""
        global _live
        with self._lock:
            if self._engine is not None:
                return
            if not isinstance(options, dict):
                raise TypeError("options must be a dict of str to str")
            if options.get("llm.EnableCacheManager") != "1" and "llm.LocalCommRes" not in options:
                raise LLMException("LLM-DataDist's V1 KvCacheManager mode is not offered: set "
                                   "LLMConfig.enable_cache_manager = True (CacheManager mode)",
                                   S.LLM_FEATURE_NOT_ENABLED)
            if "ge.exec.deviceId" not in options and "llm.DeviceId" not in options:
                raise LLMException("device_id is required (LLMConfig.device_id)", S.LLM_PARAM_INVALID)
            tmo = options.get("llm.SyncKvCacheWaitTime", "1000")
            if not tmo.isdigit() or int(tmo) <= 0:
                raise LLMException(f"llm.SyncKvCacheWaitTime must be a positive int (ms), got {tmo!r}",
                                   S.LLM_PARAM_INVALID)
            with _live_lock:
                if _live is not None:
                    raise LLMException("an LLMDataDist is already initialized in this process", S.LLM_FAILED)
                self._options = kv.EngineOptions(sync_kv_timeout=int(tmo) / 1000)
                self._manager = CacheManager(self._cluster_id, self._current)
                self._start(_listen(options))
                _live = self
        atexit.register(self.finalize)

    def _start(self, listen: str | None) -> None:
        assert self._manager is not None
        try:
            e = SyncKvEngine(self._cluster_id, self._role, listen, self._options)
        except kv.LLMError as err:
            raise raise_llm(err) from err
        try:
            self._manager.attach(e)
        except BaseException:
            e.close()
            raise
        self._engine = e

    def _current(self) -> SyncKvEngine:
        e = self._engine
        if e is None:
            raise RuntimeError(_NOT_INITIALIZED)
        return e

    def finalize(self) -> None:
        """Unlink everything and release (no-op if not initialized)."""
        global _live
        with self._lock:
            e, self._engine, self._manager = self._engine, None, None
            with _live_lock:
                if _live is self:
                    _live = None
        if e is not None:
            e.close()
            atexit.unregister(self.finalize)

    @property
    def cache_manager(self) -> CacheManager:
        if self._manager is None:
            raise RuntimeError(_NOT_INITIALIZED)
        return self._manager

    @property
    def kv_cache_manager(self) -> Any:
        raise LLMException("V1 KvCacheManager mode is not offered: use cache_manager", S.LLM_FEATURE_NOT_ENABLED)

    # ------------------------------------------------------------------- links

    def _clusters(self, clusters: Any, link: bool) -> list[kv.ClusterInfo]:
        if not isinstance(clusters, (list, tuple)) or not clusters:
            raise LLMException("clusters must be a non-empty list of LLMClusterInfo", S.LLM_PARAM_INVALID)
        if not all(isinstance(c, LLMClusterInfo) for c in clusters):
            raise TypeError("clusters must be LLMClusterInfo objects")
        return [c.to_kv(link) for c in clusters]

    def link_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
                      ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to each cluster: ``(overall status, [status per cluster])`` (never raises for a cluster)."""
        e = self._current()
        infos, tmo = self._clusters(clusters, True), _ms(timeout)
        return self._links_changed(infos, lambda: e.link_clusters(infos, tmo))

    def unlink_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
                        ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Unlink: ``(overall status, [status per cluster])``; ``force`` drops this end only."""
        e = self._current()
        infos, tmo = self._clusters(clusters, False), _ms(timeout)
        return self._links_changed(infos, lambda: e.unlink_clusters(infos, tmo, force=bool(force)))

    def _links_changed(self, infos: list[kv.ClusterInfo],
                       call: Callable[[], tuple[kv.LLMStatusCode, list[kv.LinkResult]]]
                       ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Run a link or unlink call; the peers' cache directories are read afresh after it."""
        try:
            st, per = call()
        except kv.LLMError as err:
            raise raise_llm(err) from err
        assert self._manager is not None
        for c in infos:
            self._manager.forget(c.remote_cluster_id)
        return st, [r.status for r in per]

    def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        """New role; with ``llm.ListenIpInfo`` (or ListenIp/ListenPort) listen there, without stop
        listening. ``LLM_EXIST_LINK`` while any link exists."""
        with self._lock:
            e = self._current()
            role = LLMRole(role)
            if e.stats()["links"]:
                raise LLMException("switch_role: unlink every cluster first", S.LLM_EXIST_LINK)
            listen = _listen(dict(switch_options or {}))
            e.close()
            self._engine = None
            self._role = role
            self._start(listen)

    # ------------------------------------------------- not offered (HCCL domains)

    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """The two-sided HCCL comm-domain link: not offered (use link_clusters)."""
        self._current()
        raise LLMException("link() (HCCL rank-table comm domain) is not offered: listen with "
                           "LLMConfig.listen_ip_info and use link_clusters", S.LLM_FEATURE_NOT_ENABLED)

    def unlink(self, comm_id: int) -> None:
        self._current()
        raise LLMException("unlink(comm_id) is not offered: use unlink_clusters", S.LLM_FEATURE_NOT_ENABLED)

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        self._current()
        raise LLMException("query_register_mem_status is not offered (no comm domains)", S.LLM_FEATURE_NOT_ENABLED)

    @property
    def engine(self) -> SyncKvEngine:
        """The kvengine.sync engine underneath (kvengine's own API: notifications, stats...)."""
        return self._current()

    def __repr__(self) -> str:
        state = "initialized" if self._engine is not None else "not initialized"
        return f"<LLMDataDist cluster_id={self._cluster_id} role={self._role.name} {state}>"

