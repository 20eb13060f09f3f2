"""Request keys bound to this engine's rows: which :class:`~kvengine.types.CacheKey`
names which (cache, batch row).

Owns: our key table (key -> (cache id, row)) and each cache's keys. It checks
LLM-DataDist's binding rules (a key names this engine's cluster, at most one
key per row in a ``cache_keys`` list, no more keys than rows, a key bound once:
``LLM_CACHE_KEY_ALREADY_EXIST``). Peers learn of a change through
:class:`KeyPeers` (the link manager, whose cache tables send ``key_add`` /
``key_del``, kvengine/tables.py). It never touches a link, and it does not own
caches (the registry does): the engine drops a cache's keys when it
unregisters the cache, and peers then forget them with the cache.
What a peer announced is the cache tables' (``Link.keys``), not this table's.
"""

from __future__ import annotations

from typing import Any, Protocol

from .link import Key
from .status import LLMStatusCode as S, error_for
from .types import Cache, CacheKey, param_invalid

__all__ = ["KeyTable", "KeyPeers"]


class KeyPeers(Protocol):
    """What the key table needs from the links."""

    def key_changed(self, key: Key) -> None:
        """``key`` was bound or removed: bring every linked peer's view up to date."""


class _NoPeers:
    def key_changed(self, key: Key) -> None:
        pass


class KeyTable:
    """This engine's bound keys (see the module docstring)."""

    def __init__(self, cluster_id: int) -> None:
        self._cluster_id = cluster_id
        self._bound: dict[Key, tuple[int, int]] = {}        # key -> (cache id, row)
        self._by_cache: dict[int, dict[Key, int]] = {}      # cache id -> {key: row}
        self.peers: KeyPeers = _NoPeers()

    def __len__(self) -> int:
        return len(self._bound)

    def lookup(self, key: Key) -> tuple[int, int] | None:
        """``(cache id, row)`` the key is bound to, or None."""
        return self._bound.get(key)

    def of_cache(self, cache_id: int) -> list[tuple[Key, int]]:
        """The keys bound to rows of a cache, with their rows."""
        return list(self._by_cache.get(cache_id, {}).items())

    # ------------------------------------------------------------ checks

    def _check_key(self, key: Any, what: str) -> Key:
        if not isinstance(key, CacheKey):
            raise param_invalid(f"{what} must be a kvengine.CacheKey, got {type(key).__name__}")
        if key.cluster_id != self._cluster_id:
            raise param_invalid(f"{what} {key} names cluster {key.cluster_id}: a key bound here must name "
                                f"this engine's cluster {self._cluster_id} (the cluster that holds the rows)")
        return key.wire()

    def check(self, keys: Any, batch_size: int) -> list[tuple[Key, int]]:
        """Check a ``cache_keys`` argument for a cache of ``batch_size`` rows.

        Returns ``[(key, row)]``: key i names row i; padding keys (``req_id`` 2**64-1)
        leave their row unbound. Raises before anything is registered."""
        if keys is None:
            return []
        if not isinstance(keys, (list, tuple)):
            raise param_invalid(f"cache_keys must be a list or tuple of CacheKey, got {type(keys).__name__}")
        if len(keys) > batch_size:
            raise param_invalid(f"{len(keys)} cache_keys for {batch_size} batch rows (one key per row at most)")
        out: list[tuple[Key, int]] = []
        seen: set[Key] = set()
        for row, k in enumerate(keys):
            wire = self._check_key(k, f"cache_keys[{row}]")
            if k.is_padding:
                continue
            if wire in seen:
                raise param_invalid(f"cache_keys lists {k} twice")
            seen.add(wire)
            if wire in self._bound:
                raise self._exists(k)
            out.append((wire, row))
        return out

    def _exists(self, key: CacheKey) -> Exception:
        cid, row = self._bound[key.wire()]
        return error_for(S.LLM_CACHE_KEY_ALREADY_EXIST,
                         f"{key} is already bound (cache {cid} row {row}); remove_cache_key first")

    # ------------------------------------------------------------ changes

    def bind_all(self, cache: Cache, pairs: list[tuple[Key, int]]) -> Cache:
        """Bind keys that :meth:`check` accepted to a cache registered just now, before its
        announcement task runs (which carries them: no separate announcement)."""
        for key, row in pairs:
            self._add(key, cache.cache_id, row)
        return cache

    def bind(self, cache_id: int, batch_size: int, key: Any, row: Any) -> None:
        """Bind one key to row ``row`` of a registered cache, and tell the peers."""
        wire = self._check_key(key, "key")
        if key.is_padding:
            raise param_invalid(f"{key} is a padding key (req_id 2**64-1): it binds no row")
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < batch_size:
            raise param_invalid(f"batch_index must be an int in [0, {batch_size}), got {row!r}")
        if wire in self._bound:
            raise self._exists(key)
        self._add(wire, cache_id, row)
        self.peers.key_changed(wire)

    def _add(self, key: Key, cache_id: int, row: int) -> None:
        self._bound[key] = (cache_id, row)
        self._by_cache.setdefault(cache_id, {})[key] = row

    def remove(self, key: Any) -> None:
        """Unbind a key and tell the peers; an unknown key is a no-op (as in LLM-DataDist)."""
        if not isinstance(key, CacheKey):
            raise param_invalid(f"key must be a kvengine.CacheKey, got {type(key).__name__}")
        wire = key.wire()
        bound = self._bound.pop(wire, None)
        if bound is None:
            return
        rows = self._by_cache.get(bound[0])
        if rows is not None:
            rows.pop(wire, None)
            if not rows:
                del self._by_cache[bound[0]]
        self.peers.key_changed(wire)

    def drop_cache(self, cache_id: int) -> None:
        """The cache is being unregistered: its keys go (peers forget them with the cache)."""
        for key in self._by_cache.pop(cache_id, {}):
            self._bound.pop(key, None)

    def clear(self) -> None:
        self._bound.clear()
        self._by_cache.clear()
