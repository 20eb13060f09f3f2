"""Decode worker: a kvengine engine and the same model, in its own process.

    python decode_worker.py --cluster-id 2 --transport shm --spec '{"num_layers": 4, ...}' \
        --rows 4 --max-seq 512            (secret: $KVENGINE_SECRET)

Protocol: JSON lines. On start it prints
``{"address", "cache_id", "pid", "weights", "versions"}`` (the engine's address,
the id of its KV cache, a hash of the model's weights). Then, per line on stdin:

- ``{"op": "decode", "id", "row", "prompt_len", "first_token", "max_new_tokens"}``:
  wait for the notification ``id`` (the prefill's layer stream sends it once every
  layer of that request landed in ``row``), build a DynamicCache from positions
  ``[0, prompt_len)`` of that row and decode greedily. Replies
  ``{"id", "tokens", "t_notified", "t_decode_start", "t_decode_end"}`` (time.monotonic()),
  or ``{"id", "error"}``. Requests are served concurrently, replies in completion order.
- ``{"op": "exit"}`` (or end of input): close the engine and exit.

``--layout paged``: the KV cache is a block pool (``model.paged_cache_desc``,
``--num-blocks`` of ``--block-size`` tokens) and a decode request names the
request's block table here, ``"blocks": [...]``, instead of ``"row"``. With
``--tp-size R --tp-rank r`` the pool holds only KV heads ``[r * h, (r + 1) * h)``
(``h = kv_heads / R``) and the rank decodes with ``tp.RankDecoder``: once per
layer and step it prints ``{"op": "partial", "id", "seq", "data"}`` (its
``o_proj`` partial, base64 float32) and waits for ``{"op": "sum", "id", "seq",
"data"}`` on stdin (the all-reduce, played by the driver).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import kvengine as kv  # noqa: E402
from model import (ModelSpec, build_model, cache_from_blocks, cache_from_rows, gather_blocks,  # noqa: E402
                   greedy_continue, kv_cache_desc, paged_cache_desc, versions, weights_digest)
from tp import RankDecoder  # noqa: E402


def send(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def serve(args: argparse.Namespace) -> None:
    spec = ModelSpec.from_json(args.spec)
    model = build_model(spec)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decode")
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    paged = args.layout == "paged"
    rank = RankDecoder(model, args.tp_rank, args.tp_size) if args.tp_size > 1 else None
    sums: dict[tuple[str, int], asyncio.Future] = {}     # (request id, step) -> the all-reduce's result

    opts = kv.EngineOptions(transport=args.transport)          # secret from $KVENGINE_SECRET
    async with kv.KvEngine(args.cluster_id, kv.Role.DECODER, "127.0.0.1:0", opts) as engine:
        if paged:   # a block pool; a TP rank holds only its share of the KV heads
            heads = spec.num_kv_heads // args.tp_size
            cache = engine.allocate_cache(paged_cache_desc(kv, spec, args.num_blocks, args.block_size, heads))
        else:
            cache = engine.allocate_cache(kv_cache_desc(kv, spec, args.rows, args.max_seq))
        send({"address": engine.address, "cache_id": cache.cache_id, "pid": os.getpid(),
              "weights": weights_digest(model), "versions": versions(), "shape": list(cache.desc.shape),
              "tp_rank": args.tp_rank, "tp_size": args.tp_size})

        def all_reduce(rid: str, step: list[int], partial: torch.Tensor) -> torch.Tensor:
            """From the decode thread: send this rank's partial, block until the sum is back."""
            key = (rid, step[0])
            step[0] += 1

            async def exchange() -> str:
                fut = sums.setdefault(key, loop.create_future())
                send({"op": "partial", "id": rid, "seq": key[1],
                      "data": base64.b64encode(partial.numpy().tobytes()).decode()})
                try:
                    return await asyncio.wait_for(fut, args.wait_timeout)
                finally:
                    sums.pop(key, None)
            data = asyncio.run_coroutine_threadsafe(exchange(), loop).result()
            return torch.frombuffer(bytearray(base64.b64decode(data)), dtype=partial.dtype).view(partial.shape)

        async def decode(req: dict) -> None:
            rid = req["id"]
            try:
                # The KV of this request has landed once its notification is here.
                note = await engine.wait_notification(rid.encode(), timeout=args.wait_timeout)
                t_notified = note.received_at

                def work() -> tuple[float, list[int], float]:
                    t0 = time.monotonic()
                    n, first, new = req["prompt_len"], req["first_token"], req["max_new_tokens"]
                    if rank is not None:     # TP: attention of this rank's heads, outputs combined per layer
                        t = [torch.from_numpy(x) for x in cache.tensors]
                        keys = [gather_blocks(t[2 * i], req["blocks"], n) for i in range(spec.num_layers)]
                        values = [gather_blocks(t[2 * i + 1], req["blocks"], n) for i in range(spec.num_layers)]
                        step = [0]
                        tokens = rank.generate(keys, values, n, first, new, lambda p: all_reduce(rid, step, p))
                    else:
                        past = (cache_from_blocks(cache.tensors, req["blocks"], n) if paged
                                else cache_from_rows(cache.tensors, req["row"], n))
                        tokens = greedy_continue(model, past, first, new)
                    return t0, tokens, time.monotonic()
                t0, tokens, t1 = await loop.run_in_executor(pool, work)
                send({"id": rid, "tokens": tokens, "from_cluster": note.cluster_id, "t_notified": t_notified,
                      "t_decode_start": t0, "t_decode_end": t1})
            except Exception as e:   # report, keep serving
                send({"id": rid, "error": f"{type(e).__name__}: {e}"})

        tasks = set()
        while True:
            line = await reader.readline()
            if not line:
                break
            req = json.loads(line)
            if req.get("op") == "exit":
                break
            if req.get("op") == "decode":
                t = asyncio.ensure_future(decode(req))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            elif req.get("op") == "sum":      # the all-reduce's result for (id, seq)
                fut = sums.setdefault((req["id"], req["seq"]), loop.create_future())
                if not fut.done():
                    fut.set_result(req["data"])
            else:
                send({"error": f"unknown op {req.get('op')!r}"})
        if tasks:
            await asyncio.gather(*tasks)
    pool.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster-id", type=int, default=2)
    ap.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp"])
    ap.add_argument("--spec", default=ModelSpec().to_json(), help="ModelSpec as JSON")
    ap.add_argument("--rows", type=int, default=4, help="request slots in the KV cache")
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--layout", default="rows", choices=["rows", "paged"])
    ap.add_argument("--num-blocks", type=int, default=128, help="paged: blocks in the pool")
    ap.add_argument("--block-size", type=int, default=16, help="paged: tokens per block")
    ap.add_argument("--tp-rank", type=int, default=0, help="paged: this rank of a TP decode group")
    ap.add_argument("--tp-size", type=int, default=1, help="paged: ranks of the TP decode group (KV heads split)")
    ap.add_argument("--wait-timeout", type=float, default=60.0, help="seconds to wait for a request's KV")
    ap.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--uvloop", action="store_true")
    args = ap.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.uvloop:
        import uvloop
        uvloop.run(serve(args))
    else:
        asyncio.run(serve(args))


if __name__ == "__main__":
    main()
