"""The load of `kvengine bench cluster`, run inside the agents (kvengine.bench.agent).

Prefill side (``run_mix``): for a given time, one-layer pushes (2 x 32 KiB, 20 ms
deadline) round robin over every decode target, paced, and whole-request pushes
(2 x 8 MiB, 2 s deadline) round robin too. A prefill's source caches hold
``fill_pattern(seed = its cluster id)``. Every push carries a notification naming
its source, its sequence number, the destination slot and the source row. Source
row r of a prefill always goes to the same slot of a decode cache (its own
slots), so a slot only ever receives those bytes.

Decode side (``Verifier``): consumes notifications as they arrive, regenerates
what the source holds (the same fill_pattern) and compares the named destination
slot with it, byte for byte (a memcmp: cheap enough to check every transfer),
counting ok / bad / duplicates per source. Notifications are sent only for
successes: each success must give exactly one.

Owns: the counters of one run. Touches only the engine's public API.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

import numpy as np

import kvengine as kv
from kvengine._peer import fill_pattern

LAYER = 32 << 10        # one tensor of a one-layer push (K and V: 64 KiB)
BIG = 8 << 20           # one tensor of a whole-request push (16 MiB)
TENSORS = 2
LAYER_ROWS = 32         # source rows (and destination slots) per prefill
LAYER_DEADLINE = 0.020
BIG_DEADLINE = 2.0


def source(seed: int, rows: int, width: int) -> list[np.ndarray[Any, Any]]:
    """What a prefill's source cache of ``rows`` x ``width`` per tensor holds."""
    out = []
    for i in range(TENSORS):
        a = np.empty((rows, width), np.uint8)
        fill_pattern(a, seed, i)
        out.append(a)
    return out


async def run_mix(e: kv.KvEngine, index: int, layer_src: kv.Cache, big_src: kv.Cache,
                  targets: list[list[int]], seconds: float, gap: float) -> dict[str, Any]:
    """``targets``: [cluster id, layer cache id, big cache id] per decode; ``index``: this
    prefill's slot (its rows start at index * LAYER_ROWS in every layer cache)."""
    S = kv.LLMStatusCode
    per: dict[str, dict[str, Any]] = {str(t[0]): {"lat": [], "status": Counter(), "bytes": 0, "notified": 0,
                                                                         "ok_seqs": []}
                                      for t in targets}
    end = time.monotonic() + seconds
    seq = 0

    def note(kind: str, cache: int, slot: int, row: int) -> bytes:
        nonlocal seq
        seq += 1   # the last one sent is this push's: read right after submit
        return json.dumps({"src": e.cluster_id, "seq": seq, "kind": kind, "cache": cache, "slot": slot,
                           "row": row}).encode()

    async def layers() -> None:
        k = 0
        while time.monotonic() < end:
            cid, lcache, _ = targets[k % len(targets)]
            r = (k // len(targets)) % LAYER_ROWS
            slot = index * LAYER_ROWS + r
            t0 = time.perf_counter()
            t = e.submit_push_kv_cache(layer_src, kv.CacheIndex(cid, lcache, slot), r, timeout=LAYER_DEADLINE,
                                       notify=note("layer", lcache, slot, r))
            mine = seq
            st = await t
            p = per[str(cid)]
            p["lat"].append(time.perf_counter() - t0)
            p["status"]["layer " + S(st).name] += 1
            if st == S.LLM_SUCCESS:
                p["bytes"] += t.nbytes
                p["notified"] += 1
                p["ok_seqs"].append(mine)
            k += 1
            await asyncio.sleep(gap)

    async def bigs() -> None:
        k = 0
        while time.monotonic() < end:
            cid, _, bcache = targets[k % len(targets)]
            t = e.submit_push_kv_cache(big_src, kv.CacheIndex(cid, bcache, index), 0, timeout=BIG_DEADLINE,
                                       notify=note("big", bcache, index, 0))
            mine = seq
            st = await t
            p = per[str(cid)]
            p["status"]["big " + S(st).name] += 1
            if st == S.LLM_SUCCESS:
                p["bytes"] += t.nbytes
                p["notified"] += 1
                p["ok_seqs"].append(mine)
            else:
                await asyncio.sleep(0.05)   # a lost link fails at once: do not spin on it
            k += 1

    try:
        await asyncio.gather(layers(), bigs())
    except kv.LLMError:
        pass
    return {"src": e.cluster_id, "seconds": seconds,
            "per": {c: dict(p, status=dict(p["status"])) for c, p in per.items()}}


class Verifier:
    """Checks every notification against the destination slot it names (decode side)."""

    def __init__(self, e: kv.KvEngine, caches: dict[int, kv.Cache]) -> None:
        self.e, self.caches = e, caches
        self.good: Counter[str] = Counter()
        self.bad: Counter[str] = Counter()
        self.dup: Counter[str] = Counter()
        self.seen: set[tuple[int, int]] = set()
        self.seqs: dict[str, list[int]] = {}   # per source, the notifications received
        self.want: dict[tuple[int, str], list[np.ndarray[Any, Any]]] = {}
        self.task = asyncio.ensure_future(self.run())

    def expected(self, src: int, kind: str) -> list[np.ndarray[Any, Any]]:
        got = self.want.get((src, kind))
        if got is None:
            got = self.want[(src, kind)] = source(src, LAYER_ROWS, LAYER) if kind == "layer" else source(src, 1, BIG)
        return got

    async def run(self) -> None:
        async for n in self.e.notifications():
            m = json.loads(n.payload)
            src = str(m["src"])
            if (m["src"], m["seq"]) in self.seen:
                self.dup[src] += 1
                continue
            self.seen.add((m["src"], m["seq"]))
            self.seqs.setdefault(src, []).append(m["seq"])
            want = self.expected(m["src"], m["kind"])
            dst = self.caches[m["cache"]].tensors
            same = all(np.array_equal(np.asarray(dst[i][m["slot"]]).reshape(-1).view(np.uint8), want[i][m["row"]])
                       for i in range(TENSORS))
            (self.good if same else self.bad)[src] += 1

    async def stop(self, expect: int = 0, wait: float = 3.0) -> dict[str, Any]:
        """The counts, once ``expect`` notifications were checked (those still on their way
        when the load ended), or after ``wait`` seconds."""
        end = time.monotonic() + wait
        while (self.e.stats()["notifications"]["pending"] or len(self.seen) < expect) and time.monotonic() < end:
            await asyncio.sleep(0.01)
        self.task.cancel()
        return {"good": dict(self.good), "bad": dict(self.bad), "dup": dict(self.dup), "seqs": self.seqs}   # not "ok": the pipe's flag
