"""Accounting: the transfer counters and latency histograms behind ``engine.stats()``
and ``engine.metrics_text()``.

Owns: the engine-wide counters, the histograms (every link, and per
``(cluster id, transport)``). Written on the loop thread only: by the scheduler
when a transfer finishes (:meth:`Accounting.record`), and by the native fast path
of inline pushes and pulls (``_native.FastPath``), which records its transfers in
the same :class:`Counts` in C. Touches nothing else.

The counters and histograms are C structures (``_native.Counts``,
``_native.Histogram``, cython_src/_fast.pxi): recording one transfer's three
latency phases in two groups costs well under 0.1 us of the loop thread
(docs/benchmarks.md, "The loop thread's cost per push").
"""

from __future__ import annotations

from time import perf_counter

from .native import _native
from .status import LLMStatusCode as S

__all__ = ["Histogram", "Accounting", "PeerCounts", "PHASES"]

PHASES = ("queue", "transfer", "total")

# Latency histogram with log buckets (ratio 2**0.25, from 1 us to ~1.2 h): counts, n,
# total, record(seconds), upper(i), quantile(q), summary()
Histogram = _native.Histogram
# Counters and histograms of one (cluster id, transport), or of every transfer:
# transfers, bytes, by_status, hists {phase: Histogram}, summary()
PeerCounts = _native.Counts


class Accounting:
    """Counters of finished transfers (see the module docstring)."""

    def __init__(self) -> None:
        self.all = PeerCounts()                               # every transfer
        self.peers: dict[tuple[int, str], PeerCounts] = {}   # (cluster id, transport) -> counts

    def peer(self, key: tuple[int, str]) -> PeerCounts:
        """The counts of ``(cluster id, transport)``, created empty when first named."""
        per = self.peers.get(key)
        if per is None:
            per = self.peers[key] = PeerCounts()
        return per

    def record(self, status: S, nbytes: int, peer: tuple[int, str] | None,
               t_queued: float, t_started: float) -> None:
        """One finished transfer. ``peer`` None: it failed before it reached a link
        (counted, no latency). ``t_queued``/``t_started``: perf_counter() stamps (0: none)."""
        name = status.name
        self.all.add(name, nbytes)
        if peer is None:
            return
        per = self.peer(peer)
        per.add(name, nbytes)
        if t_queued:
            now = perf_counter()
            started = t_started or now
            queue, transfer, total = started - t_queued, now - started, now - t_queued
            self.all.times(queue, transfer, total)
            per.times(queue, transfer, total)
