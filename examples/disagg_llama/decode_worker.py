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
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import kvengine as kv  # noqa: E402
from model import (ModelSpec, build_model, cache_from_rows, greedy_continue, kv_cache_desc,  # noqa: E402
                   versions, weights_digest)


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

    opts = kv.EngineOptions(transport=args.transport)          # secret from $KVENGINE_SECRET
    async with kv.KvEngine(args.cluster_id, kv.Role.DECODER, "127.0.0.1:0", opts) as engine:
        cache = engine.allocate_cache(kv_cache_desc(kv, spec, args.rows, args.max_seq))
        send({"address": engine.address, "cache_id": cache.cache_id, "pid": os.getpid(),
              "weights": weights_digest(model), "versions": versions()})

        async def decode(req: dict) -> None:
            rid = req["id"]
            try:
                # The KV of this request has landed once its notification is here.
                note = await engine.wait_notification(rid.encode(), timeout=args.wait_timeout)
                t_notified = note.received_at

                def work() -> tuple[float, list[int], float]:
                    t0 = time.monotonic()
                    past = cache_from_rows(cache.tensors, req["row"], req["prompt_len"])
                    tokens = greedy_continue(model, past, req["first_token"], req["max_new_tokens"])
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
