"""An engine in a host namespace of the test bed (kvengine/bench/netbed.py), driven by JSON
lines: used by tests/cluster and `kvengine bench cluster`.

kvengine._peer's server (alloc, fill, addrs, digest, link, push_start, push_wait,
wait_link_down, stats, ...) plus what the fault matrix needs:

- ``pull_start``: a pull in the background (its handle works with ``push_wait``);
- ``bg``: wait for background transfers, with each one's status and the seconds
  from its submit to its status (measured here, not across the pipe);
- ``series``: one-layer pushes one after another, round robin over targets, with
  each one's latency;
- ``reopen``: close the engine and start a new one on the same address;
- ``hammer_start`` / ``hammer_stop``: keep linking and pushing to a peer, whatever
  happens to it (listener churn);
- ``push_blocks``, ``layer_stream``: a block-table push, and one row's layers pushed as
  a layer stream (``LLMDataDist.layer_stream``), each answering its status(es);
- ``gc``: a full garbage collection (leak measurements);
- ``mix``, ``verify_start`` / ``verify_stop``: the load of ``kvengine bench cluster``
  and its byte and notification checks (kvengine/bench/mix.py).

    ip netns exec NS python -m kvengine.bench.agent --cluster-id 2 --listen 10.213.0.2:0

prints ``{"address": ..., "pid": ...}`` like kvengine._peer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from typing import Any

import kvengine as kv
from kvengine._peer import _Server, answer

from . import mix


class Server(_Server):
    def __init__(self, engine: kv.KvEngine, args: argparse.Namespace, opts: kv.EngineOptions) -> None:
        super().__init__(engine)
        self.args, self.opts = args, opts
        self.times: dict[int, tuple[float, float | None]] = {}   # handle -> (submit, status time)
        self.hammer: asyncio.Task[None] | None = None
        self.hammer_counts: Counter[str] = Counter()
        self.hammer_stop = asyncio.Event()
        self.verifier: mix.Verifier | None = None

    def _track(self, t: kv.Transfer) -> int:
        loop = asyncio.get_running_loop()
        handle = len(self.bg) + 1
        self.bg[handle] = t
        self.times[handle] = (loop.time(), None)

        async def stamp() -> None:
            await t._wait()
            self.times[handle] = (self.times[handle][0], loop.time())
        asyncio.ensure_future(stamp())
        return handle

    async def handle(self, m: dict[str, Any]) -> dict[str, Any]:
        kv_, e = self.kv, self.engine
        op = m["op"]
        if op == "push_start":   # as _peer's, but stamped
            await e.wait_remote_cache(m["cluster_id"], m["dst_cache_id"], timeout=m.get("deadline"))
            t = e.submit_push_kv_cache(self.caches[m["cache_id"]],
                                       kv_.CacheIndex(m["cluster_id"], m["dst_cache_id"], m.get("dst_batch", 0)),
                                       m.get("src_batch", 0), timeout=m.get("deadline"))
            return {"handle": self._track(t)}
        if op == "pull_start":
            await e.wait_remote_cache(m["cluster_id"], m["src_cache_id"], timeout=m.get("deadline"))
            t = e.submit_pull_kv_cache(kv_.CacheIndex(m["cluster_id"], m["src_cache_id"], m.get("src_batch", 0)),
                                       self.caches[m["cache_id"]], m.get("dst_batch", 0), timeout=m.get("deadline"))
            return {"handle": self._track(t)}
        if op == "bg":   # {"handles": [...], "wait": s} -> per handle [status or None, submit time,
            # status time or None] (CLOCK_MONOTONIC seconds: the same clock as time.monotonic() anywhere)
            hs = m.get("handles") or list(self.bg)
            ts = [self.bg[h] for h in hs]
            await asyncio.wait([asyncio.ensure_future(t._wait()) for t in ts], timeout=m.get("wait", 10))
            await asyncio.sleep(0)   # let the stamps run
            out = []
            for h, t in zip(hs, ts):
                t0, t1 = self.times[h]
                out.append([int(t.status) if t.status is not None else None, t0, t1])
            return {"done": out}
        if op == "series":   # sequential pushes of cache rows, round robin over [cluster, dst cache]
            loop = asyncio.get_running_loop()
            src = self.caches[m["cache_id"]]
            lat: dict[str, list[float]] = {}
            sts: dict[str, Counter[str]] = {}
            targets = m["targets"]
            for cid, dst in targets:   # a cache allocated just now may not be announced yet
                await e.wait_remote_cache(cid, dst, timeout=m.get("deadline"))
            for k in range(m["n"]):
                cid, dst = targets[k % len(targets)]
                row = (k // len(targets)) % m.get("rows", 1)   # each target gets every row in turn
                t0 = loop.time()
                st = await e.push_kv_cache(src, kv_.CacheIndex(cid, dst, row), row, timeout=m.get("deadline"))
                dt = loop.time() - t0
                lat.setdefault(str(cid), []).append(dt)
                sts.setdefault(str(cid), Counter())[kv_.LLMStatusCode(st).name] += 1
                if m.get("gap"):
                    await asyncio.sleep(m["gap"])
            return {"lat": lat, "status": {c: dict(s) for c, s in sts.items()}}
        if op == "reopen":   # the same cluster id and address, a new engine
            await e.close()
            self.caches.clear()
            self.bg.clear()
            self.times.clear()
            self.engine = await kv_.KvEngine(self.args.cluster_id, kv_.Role[self.args.role], e.address,
                                             self.opts).start()
            return {"address": self.engine.address}
        if op == "hammer_start":
            self.hammer_stop.clear()
            self.hammer_counts.clear()
            self.hammer = asyncio.ensure_future(self._hammer(m["cluster_id"], m["address"], m["cache_id"],
                                                             m["dst_cache_id"], m.get("deadline", 0.5)))
            return {}
        if op == "hammer_stop":
            self.hammer_stop.set()
            if self.hammer is not None:
                await asyncio.wait_for(self.hammer, m.get("wait", 30))
            return {"counts": dict(self.hammer_counts)}
        if op == "mix":   # kvengine bench cluster, prefill side (kvengine/bench/mix.py)
            return await mix.run_mix(e, m["index"], self.caches[m["layer_cache"]], self.caches[m["big_cache"]],
                                     m["targets"], m["seconds"], m.get("gap", 0.002))
        if op == "verify_start":   # ... decode side: check each notification's row as it arrives
            self.verifier = mix.Verifier(e, self.caches)
            return {}
        if op == "verify_stop":
            return await self.verifier.stop(m.get("expect", 0)) if self.verifier is not None else {}
        if op == "push_blocks":   # push_kv_blocks of the cache's rows as blocks: status
            await e.wait_remote_cache(m["cluster_id"], m["dst_cache_id"], timeout=m.get("deadline"))
            st = await e.submit_push_kv_blocks(self.caches[m["cache_id"]],
                                               kv_.BlocksCacheKey(m["cluster_id"], m["dst_cache_id"]),
                                               m["src_blocks"], m["dst_blocks"], timeout=m.get("deadline"))
            return {"status": int(st)}
        if op == "layer_stream":   # one row, layer by layer (2 tensors a layer), to [cluster, cache, row]s
            src = self.caches[m["cache_id"]]
            dsts = [kv_.CacheIndex(c, d, r) for c, d, r in m["dsts"]]
            for d in dsts:
                await e.wait_remote_cache(d.cluster_id, d.cache_id, timeout=m.get("deadline"))
            stream = e.layer_stream(src, dsts, src_batch_index=m.get("src_batch", 0), timeout=m.get("deadline"))
            for layer in range(src.desc.num_tensors // 2):
                stream.layer_ready(layer)
            return {"status": [None if st is None else int(st) for st in await stream.wait()]}
        if op == "gc":   # a full collection: what only a reference cycle kept alive goes now
            import gc
            return {"collected": gc.collect()}
        if op == "unlink":
            st, per = await e.unlink_clusters([kv_.ClusterInfo(m["cluster_id"], m["address"])],
                                              force=m.get("force", False))
            return {"status": int(st)}
        return await super().handle(m)

    async def _hammer(self, cid: int, address: str, cache_id: int, dst: int, deadline: float) -> None:
        """Link (again) and push to ``cid`` until stopped, counting what happens."""
        kv_, c = self.kv, self.hammer_counts
        while not self.hammer_stop.is_set():
            e = self.engine
            if cid not in e.stats()["links"]:
                st, _ = await e.link_clusters([kv_.ClusterInfo(cid, address)], timeout=1.0)
                c["link_" + kv_.LLMStatusCode(st).name] += 1
                if st != kv_.LLMStatusCode.LLM_SUCCESS:
                    await asyncio.sleep(0.02)
                    continue
            try:
                await e.wait_remote_cache(cid, dst, timeout=deadline)
                st = await e.push_kv_cache(self.caches[cache_id], kv_.CacheIndex(cid, dst, 0), timeout=deadline)
                c["push_" + kv_.LLMStatusCode(st).name] += 1
            except kv_.LLMError as ex:
                c["push_" + type(ex).__name__] += 1
                await asyncio.sleep(0.01)


async def serve(args: argparse.Namespace) -> None:
    extra = json.loads(args.options) if args.options else {}
    opts = kv.EngineOptions(transport=args.transport, secret=args.secret.encode() if args.secret else None,
                            **extra)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def send(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    engine = await kv.KvEngine(args.cluster_id, kv.Role[args.role], args.listen, opts).start()
    server = Server(engine, args, opts)
    try:
        await answer(server, reader, send)
    finally:
        if server.hammer is not None:
            server.hammer_stop.set()
        await server.engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m kvengine.bench.agent")
    ap.add_argument("--cluster-id", type=int, required=True)
    ap.add_argument("--listen", required=True)
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--role", default="DECODER", choices=[r.name for r in kv.Role])
    ap.add_argument("--secret", default=None)
    ap.add_argument("--options", default=None, help="JSON object of more EngineOptions fields")
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
