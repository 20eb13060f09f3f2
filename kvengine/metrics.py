"""Prometheus text exposition of ``engine.stats()`` and the accounting's histograms
(no dependency needed). Reads what it is given; owns nothing.
"""

from __future__ import annotations

from typing import Any

from .stats import Accounting

_PHASES = ("queue", "transfer", "total")


def _labels(**kw: Any) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in kw.items()) + "}"


def render(cid: int, st: dict[str, Any], accounting: Accounting) -> str:
    """The exposition of engine ``cid``: ``st`` is its ``stats()``."""
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, Any], float]]) -> None:
        out.append(f"# HELP kvengine_{name} {help_}")
        out.append(f"# TYPE kvengine_{name} {kind}")
        for labels, value in samples:
            out.append(f"kvengine_{name}{_labels(cluster=cid, **labels)} {value}")

    peers = accounting.peers
    metric("transfers_total", "counter", "Transfers finished, by peer, transport and status.",
           [({"peer": p, "transport": tr, "status": s}, n)
            for (p, tr), d in peers.items() for s, n in d.by_status.items()])
    metric("bytes_total", "counter", "Bytes written into destinations, by peer and transport.",
           [({"peer": p, "transport": tr}, d.bytes) for (p, tr), d in peers.items()])
    metric("queue_depth", "gauge", "Transfers waiting in a link's queue.",
           [({"peer": p, "transport": l["transport"]}, l["queue_depth"]) for p, l in st["links"].items()])
    metric("inflight_bytes", "gauge", "Bytes handed to the native core and not yet completed.",
           [({"peer": p, "transport": l["transport"]}, l["inflight_bytes"]) for p, l in st["links"].items()])
    metric("links", "gauge", "Links up.", [({}, len(st["links"]))])
    native = st.get("native", {})
    for key, help_ in (("jobs_aborted", "Native jobs aborted."), ("tcp_bad_frames", "Data connections "
                       "dropped for a malformed frame."), ("tcp_refused", "Data connections refused before "
                       "authentication."), ("tcp_links_failed", "Links failed in the data plane.")):
        metric(f"native_{key}_total", "counter", help_, [({}, native.get(key, 0))])
    metric("control_refused_total", "counter", "Control connections dropped before a valid hello.",
           [({}, st["control_refused"])])
    metric("notifications_total", "counter", "Push notifications, by direction.",
           [({"direction": k}, v) for k, v in st["notifications"].items() if k != "pending"])
    name = "transfer_seconds"
    out.append(f"# HELP kvengine_{name} Transfer latency by phase (queue, transfer, total).")
    out.append(f"# TYPE kvengine_{name} histogram")
    for (p, tr), d in peers.items():
        for phase in _PHASES:
            h = d.hists[phase]
            base = dict(cluster=cid, peer=p, transport=tr, phase=phase)
            seen = 0
            for i, c in enumerate(h.counts):
                seen += c
                if c or i == len(h.counts) - 1:
                    out.append(f"kvengine_{name}_bucket{_labels(**base, le=f'{h.upper(i):.9g}')} {seen}")
            out.append(f"kvengine_{name}_bucket{_labels(**base, le='+Inf')} {h.n}")
            out.append(f"kvengine_{name}_sum{_labels(**base)} {h.total:.9g}")
            out.append(f"kvengine_{name}_count{_labels(**base)} {h.n}")
    return "\n".join(out) + "\n"
