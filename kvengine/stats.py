"""Accounting: the transfer counters and latency histograms behind ``engine.stats()``
and ``engine.metrics_text()``.

Owns: the engine-wide counters, the histograms (every link, and per
``(cluster id, transport)``). Written only by the scheduler when a transfer
finishes (:meth:`Accounting.record`), on the loop thread. Touches nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from time import perf_counter

from .status import LLMStatusCode as S

__all__ = ["Histogram", "Accounting", "PeerCounts"]

PHASES = ("queue", "transfer", "total")


class Histogram:
    """Latency histogram with log buckets (ratio 2**0.25, from 1 us to ~1.2 h)."""

    __slots__ = ("counts", "n", "total")
    _BASE = 1e-6
    _STEP = 2 ** 0.25
    _N = 128

    def __init__(self) -> None:
        self.counts = [0] * self._N
        self.n = 0
        self.total = 0.0

    def record(self, seconds: float) -> None:
        # bucket i holds (BASE * STEP**(i-1), BASE * STEP**i]; frexp instead of log: this
        # runs three times per transfer, inline pushes included
        if seconds <= self._BASE:
            i = 0
        else:
            m, e = math.frexp(seconds / self._BASE)   # m in [0.5, 1)
            i = 4 * (e - 1) + (1 if m <= 0.5946035575013605 else 2 if m <= 0.7071067811865476
                               else 3 if m <= 0.8408964152537145 else 4)
            if m == 0.5:
                i -= 1   # an exact power of two belongs to the bucket below
            if i >= self._N:
                i = self._N - 1
        self.counts[i] += 1
        self.n += 1
        self.total += seconds

    def upper(self, i: int) -> float:
        return self._BASE * self._STEP ** i

    def quantile(self, q: float) -> float:
        """Upper edge of the bucket holding the q-quantile (seconds); 0 when empty."""
        if not self.n:
            return 0.0
        rank = q * self.n
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return self.upper(i)
        return self.upper(self._N - 1)

    def summary(self) -> dict[str, float]:
        return {"count": self.n, "mean_s": self.total / self.n if self.n else 0.0,
                "p50_s": self.quantile(0.5), "p90_s": self.quantile(0.9), "p99_s": self.quantile(0.99)}


def new_hists() -> dict[str, Histogram]:
    return {phase: Histogram() for phase in PHASES}


@dataclass
class PeerCounts:
    """Counters and histograms of one ``(cluster id, transport)``."""
    transfers: int = 0
    bytes: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    hists: dict[str, Histogram] = field(default_factory=new_hists)

    def summary(self) -> dict[str, object]:
        return {"transfers": self.transfers, "bytes": self.bytes, "by_status": dict(self.by_status),
                "latency": {k: h.summary() for k, h in self.hists.items()}}


class Accounting:
    """Counters of finished transfers (see the module docstring)."""

    def __init__(self) -> None:
        self.all = PeerCounts()                               # every transfer
        self.peers: dict[tuple[int, str], PeerCounts] = {}   # (cluster id, transport) -> counts

    def record(self, status: S, nbytes: int, peer: tuple[int, str] | None,
               t_queued: float, t_started: float) -> None:
        """One finished transfer. ``peer`` None: it failed before it reached a link
        (counted, no latency). ``t_queued``/``t_started``: perf_counter() stamps (0: none)."""
        name = status.name
        groups = [self.all]
        if peer is not None:
            per = self.peers.get(peer)
            if per is None:
                per = self.peers[peer] = PeerCounts()
            groups.append(per)
        for g in groups:
            g.transfers += 1
            g.bytes += nbytes
            g.by_status[name] = g.by_status.get(name, 0) + 1
        if peer is not None and t_queued:
            now = perf_counter()
            started = t_started or now
            for g in groups:
                g.hists["queue"].record(started - t_queued)
                g.hists["transfer"].record(now - started)
                g.hists["total"].record(now - t_queued)
