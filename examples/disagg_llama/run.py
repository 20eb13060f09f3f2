"""Disaggregated greedy generation with a small random Llama: prefill here, decode in
a child process, the KV cache moved layer by layer through kvengine.

    python examples/disagg_llama/run.py --transport shm
    python examples/disagg_llama/run.py --transport tcp --layers 8 --hidden 512 --max-seq 2048 --check
    python examples/disagg_llama/run.py --layout paged --check             (block pools, block tables)
    python examples/disagg_llama/run.py --layout paged --tp 2 --check      (two decode ranks, half the heads each)

Per request: the prefill worker (this process) runs the prompt through the model
in a worker thread; a forward hook on each decoder layer copies that layer's K/V
into the kvengine source cache and marks the layer ready on a layer stream, so
its push starts while later layers compute. When the forward returns, the
request (row, prompt length, first token) goes to the decode worker, which
waits for the stream's notification (= every layer landed), builds a
DynamicCache from the received rows and decodes greedily. ``--check`` compares
the tokens with a single-process ``model.generate`` (greedy).

Timing, per request (time.monotonic(), one clock for both processes):
  forward   prefill forward pass (all layers + logits)
  transfer  first layer_ready -> every layer landed (stream.wait() resolved)
  exposed   forward end -> every layer landed: the part of the transfer the forward did not hide
  kv@decode forward end -> the decode engine received the notification
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import secrets
import statistics
import sys
import time
from typing import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import kvengine as kv  # noqa: E402
from blocks import BlockAllocator, blocks_needed, head_split_view, push_heads  # noqa: E402
from model import (ModelSpec, build_model, kv_cache_desc, paged_cache_desc, reference_generate,  # noqa: E402
                   versions, weights_digest)
from prefill import Prefiller  # noqa: E402
from tp import combine  # noqa: E402

PREFILL_ID, DECODE_ID = 1, 2


class DecodeProcess:
    """Parent-side handle of a ``decode_worker.py`` child (JSON lines on stdin/stdout)."""

    def __init__(self, proc: asyncio.subprocess.Process, hello: dict) -> None:
        self.proc = proc
        self.hello = hello
        self.address: str = hello["address"]
        self.cache_id: int = hello["cache_id"]
        self.cluster_id: int = DECODE_ID

    @classmethod
    async def start(cls, spec: ModelSpec, transport: str, rows: int, max_seq: int, secret: bytes,
                    torch_threads: int = 0, uvloop: bool = False, timeout: float = 60.0,
                    cluster_id: int = DECODE_ID, extra: Sequence[str] = ()) -> "DecodeProcess":
        argv = [sys.executable, os.path.join(HERE, "decode_worker.py"), "--cluster-id", str(cluster_id),
                "--transport", transport, "--spec", spec.to_json(), "--rows", str(rows),
                "--max-seq", str(max_seq), "--torch-threads", str(torch_threads), *extra]
        if uvloop:
            argv.append("--uvloop")
        env = dict(os.environ, KVENGINE_SECRET=secret.decode())
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, env=env)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), timeout)
            if not line:
                raise RuntimeError(f"decode worker exited ({await proc.wait()}) before saying hello")
            me = cls(proc, json.loads(line))
            me.cluster_id = cluster_id
            return me
        except BaseException:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            raise

    def send(self, obj: dict) -> None:
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())

    async def recv(self, timeout: float = 60.0) -> dict:
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"decode worker exited ({await self.proc.wait()})")
        return json.loads(line)

    async def close(self, timeout: float = 20.0) -> int:
        if self.proc.returncode is None:
            try:
                self.send({"op": "exit"})
                self.proc.stdin.close()
                await asyncio.wait_for(self.proc.wait(), timeout)
            except (asyncio.TimeoutError, BrokenPipeError, ConnectionError):
                self.proc.kill()
        return await self.proc.wait()


def make_prompts(lengths: Sequence[int], vocab_size: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


async def run_session(prompts: Sequence[Sequence[int]], max_new_tokens: int, transport: str = "shm",
                      spec: ModelSpec = ModelSpec(), rows: int = 4, max_seq: int = 512,
                      modes: Sequence[str] = ("layerwise",), warmup: bool = True, timeout: float = 10.0,
                      torch_threads: int = 0, model=None, log=print) -> dict:
    """Start a decode worker, prefill and decode every prompt (once per mode); return
    the tokens and timings. ``mode``: ``"layerwise"`` (push each layer as it is
    computed) or ``"after"`` (push every layer after the forward: the baseline)."""
    secret = secrets.token_hex(16).encode()
    loop = asyncio.get_running_loop()
    worker = asyncio.ensure_future(DecodeProcess.start(spec, transport, rows, max_seq, secret, torch_threads,
                                                       uvloop=False))
    try:
        if model is None:   # build ours while the worker starts
            model = await loop.run_in_executor(None, build_model, spec)
        decode = await worker
    except BaseException:
        worker.cancel()
        raise
    try:
        if decode.hello["weights"] != weights_digest(model):
            raise RuntimeError("the decode worker built different weights: "
                               f"{decode.hello['weights']} != {weights_digest(model)}")
        opts = kv.EngineOptions(transport=transport, secret=secret)
        async with kv.KvEngine(PREFILL_ID, kv.Role.PROMPT, "127.0.0.1:0", opts) as engine:
            t0 = time.monotonic()
            st, per = await engine.link_clusters([kv.ClusterInfo(DECODE_ID, decode.address)])
            if st != kv.LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"link failed: {st.name} {per}")
            await engine.wait_remote_cache(DECODE_ID, decode.cache_id, timeout=10)
            link_ms = (time.monotonic() - t0) * 1e3
            link_transport = engine.stats()["links"][DECODE_ID]["transport"]
            desc = kv_cache_desc(kv, spec, rows, max_seq)
            src = engine.allocate_cache(desc)
            prefiller = Prefiller(engine, model, src)
            log(f"[{transport}] linked over '{link_transport}' in {link_ms:.1f} ms; decode pid "
                f"{decode.hello['pid']}; KV cache {desc.num_tensors} tensors x {desc.shape} float32, "
                f"{2 * desc.row_bytes * spec.num_layers / 2**20:.2f} MiB per request ({spec.num_layers} layers)")
            try:
                # (request id, mode, prompt index); the warm-up requests are not in the summary
                jobs = [(f"warmup-{m}", m, 0) for m in modes] if warmup else []
                jobs += [(f"req-{i}-{m}", m, i) for i in range(len(prompts)) for m in modes]
                results = []
                for n, (rid, mode, i) in enumerate(jobs):
                    r = await _one(prefiller, decode, rid, mode, prompts[i], n % rows, max_new_tokens, timeout)
                    results.append(dict(r, prompt_index=i, warmup=rid.startswith("warmup")))
            finally:
                prefiller.close()
    finally:
        code = await decode.close()
    if code != 0:
        raise RuntimeError(f"decode worker exit status {code}")
    return {"transport": transport, "link_transport": link_transport, "spec": json.loads(spec.to_json()),
            "rows": rows, "max_seq": max_seq, "kv_bytes_per_request": 2 * desc.row_bytes * spec.num_layers,
            "versions": versions(), "requests": results, "summary": summarize(results)}


async def _one(prefiller: Prefiller, decode: DecodeProcess, rid: str, mode: str, prompt: Sequence[int],
               row: int, max_new_tokens: int, timeout: float) -> dict:
    """One request: prefill + layer-wise push here, decode there."""
    dst = kv.CacheIndex(DECODE_ID, decode.cache_id, row)

    def hand_over(first_token: int) -> None:
        # The forward is done: the decode worker gets the request now and waits
        # for the KV's notification.
        decode.send({"op": "decode", "id": rid, "row": row, "prompt_len": len(prompt),
                     "first_token": first_token, "max_new_tokens": max_new_tokens})

    r = await prefiller.run(rid, prompt, dst, row, on_forward_done=hand_over,
                            layerwise=(mode == "layerwise"), timeout=timeout)
    if r.statuses != [kv.LLMStatusCode.LLM_SUCCESS]:
        raise RuntimeError(f"{rid}: KV push failed: {[s.name for s in r.statuses]}")
    reply = await decode.recv(timeout=60)
    if reply.get("id") != rid or "error" in reply:
        raise RuntimeError(f"{rid}: decode worker: {reply}")
    desc = prefiller.cache.desc
    return {"id": rid, "mode": mode, "prompt_len": len(prompt), "row": row,
            "tokens": reply["tokens"], "kv_bytes": desc.row_bytes * desc.num_tensors,
            "forward_ms": r.forward_s * 1e3, "transfer_ms": r.transfer_total_s * 1e3,
            "exposed_ms": r.exposed_s * 1e3, "done_after_forward_ms": r.done_after_forward_s * 1e3,
            "layer0_landed_before_forward_end": r.t_layer0_done < r.t_forward_end,
            "kv_at_decode_ms": (reply["t_notified"] - r.t_forward_end) * 1e3,
            "decode_ms": (reply["t_decode_end"] - reply["t_decode_start"]) * 1e3}


# ------------------------------------------------------------------ --layout paged

class DecodeRanks:
    """The decode side of a paged session: one decode worker, or ``tp`` of them (a TP
    group, each holding ``kv_heads / tp`` heads). A reader per worker routes its
    replies to the request waiting for them and plays the all-reduce: once every rank
    sent its partial for (request, step), every rank gets their sum."""

    def __init__(self, procs: Sequence[DecodeProcess]) -> None:
        self.procs = list(procs)
        self._replies: dict[str, list[asyncio.Future]] = {}
        self._partials: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        self.all_reduces = 0
        self._readers = [asyncio.ensure_future(self._read(r)) for r in range(len(self.procs))]

    def expect(self, rid: str) -> list[asyncio.Future]:
        loop = asyncio.get_running_loop()
        futs = self._replies[rid] = [loop.create_future() for _ in self.procs]
        return futs

    async def _read(self, r: int) -> None:
        proc = self.procs[r].proc
        while True:
            line = await proc.stdout.readline()
            if not line:
                err = RuntimeError(f"decode rank {r} exited ({await proc.wait()})")
                for futs in self._replies.values():
                    if not futs[r].done():
                        futs[r].set_exception(err)
                return
            m = json.loads(line)
            if m.get("op") == "partial":
                key = (m["id"], m["seq"])
                got = self._partials.setdefault(key, {})
                got[r] = torch.frombuffer(bytearray(base64.b64decode(m["data"])), dtype=torch.float32)
                if len(got) == len(self.procs):
                    del self._partials[key]
                    total = combine([got[i] for i in range(len(self.procs))])
                    data = base64.b64encode(total.numpy().tobytes()).decode()
                    self.all_reduces += 1
                    for p in self.procs:
                        p.send({"op": "sum", "id": m["id"], "seq": m["seq"], "data": data})
            elif m.get("id") in self._replies and not self._replies[m["id"]][r].done():
                self._replies[m["id"]][r].set_result(m)

    async def close(self) -> list[int]:
        codes = [await p.close() for p in self.procs]
        for t in self._readers:
            t.cancel()
        return codes


async def run_paged_session(prompts: Sequence[Sequence[int]], max_new_tokens: int, transport: str = "shm",
                            spec: ModelSpec = ModelSpec(), num_blocks: int = 128, block_size: int = 16,
                            tp: int = 1, modes: Sequence[str] = ("layerwise",), warmup: bool = True,
                            timeout: float = 10.0, torch_threads: int = 0, model=None, log=print) -> dict:
    """``run_session`` with block pools: each side keeps a pool of ``num_blocks`` blocks of
    ``block_size`` tokens and a block allocator; requests go in pairs whose blocks are
    interleaved in both pools (random, non-monotone tables); the prefill pushes each
    request's blocks layer by layer (``layer_stream`` with its block tables, torch
    tensors). ``tp=2``: two decode ranks, each holding half the KV heads (``push_heads``),
    their attention outputs combined per layer (``tp.py``)."""
    secret = secrets.token_hex(16).encode()
    loop = asyncio.get_running_loop()
    max_seq = num_blocks * block_size // 2          # two requests share the pool
    extra = ["--layout", "paged", "--num-blocks", str(num_blocks), "--block-size", str(block_size),
             "--tp-size", str(tp)]
    starts = [DecodeProcess.start(spec, transport, 1, 1, secret, torch_threads=torch_threads,
                                  cluster_id=DECODE_ID + r, extra=extra + ["--tp-rank", str(r)])
              for r in range(tp)]
    workers = asyncio.ensure_future(asyncio.gather(*starts))
    try:
        if model is None:
            model = await loop.run_in_executor(None, build_model, spec)
        procs = await workers
    except BaseException:
        workers.cancel()
        raise
    ranks = DecodeRanks(procs)
    try:
        for p in procs:
            if p.hello["weights"] != weights_digest(model):
                raise RuntimeError(f"decode rank {p.hello['tp_rank']} built different weights")
        opts = kv.EngineOptions(transport=transport, secret=secret)
        async with kv.KvEngine(PREFILL_ID, kv.Role.PROMPT, "127.0.0.1:0", opts) as engine:
            st, per = await engine.link_clusters([kv.ClusterInfo(p.cluster_id, p.address) for p in procs])
            if st != kv.LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"link failed: {st.name} {per}")
            for p in procs:
                await engine.wait_remote_cache(p.cluster_id, p.cache_id, timeout=10)
            link_transport = engine.stats()["links"][DECODE_ID]["transport"]
            src = engine.allocate_cache(paged_cache_desc(kv, spec, num_blocks, block_size))
            view = head_split_view(engine, src, tp) if tp > 1 else None
            prefiller = Prefiller(engine, model, src, max_seq=max_seq)
            here, there = BlockAllocator(num_blocks, seed=11), BlockAllocator(num_blocks, seed=12)
            keys = [kv.BlocksCacheKey(p.cluster_id, p.cache_id) for p in procs]
            log(f"[{transport}] paged: pools of {num_blocks} blocks x {src.desc.shape[1:]} float32 "
                f"({src.desc.row_bytes} B per block per tensor); decode: {tp} rank(s), "
                f"{[p.hello['shape'] for p in procs]}")
            try:
                jobs = [(f"warmup-{m}", m, 0) for m in modes] if warmup else []
                jobs += [(f"req-{i}-{m}", m, i) for i in range(len(prompts)) for m in modes]
                results = []
                for k in range(0, len(jobs), 2):          # two requests at a time, blocks interleaved
                    pair = jobs[k:k + 2]
                    sizes = [blocks_needed(len(prompts[i]), block_size) for _, _, i in pair]
                    srcs, dsts = here.alloc_interleaved(sizes), there.alloc_interleaved(sizes)
                    try:
                        rs = await asyncio.gather(*[
                            _one_paged(prefiller, ranks, keys, view, rid, mode, prompts[i], sb, db,
                                       max_new_tokens, timeout)
                            for (rid, mode, i), sb, db in zip(pair, srcs, dsts)])
                    finally:
                        for sb, db in zip(srcs, dsts):
                            here.release(sb)
                            there.release(db)
                    for (rid, _, i), r in zip(pair, rs):
                        results.append(dict(r, prompt_index=i, warmup=rid.startswith("warmup"),
                                            pair=[x[0] for x in pair]))
            finally:
                prefiller.close()
    finally:
        codes = await ranks.close()
    if any(codes):
        raise RuntimeError(f"decode worker exit status {codes}")
    return {"transport": transport, "layout": "paged", "tp": tp, "link_transport": link_transport,
            "spec": json.loads(spec.to_json()), "num_blocks": num_blocks, "block_size": block_size,
            "rank_pool_shapes": [p.hello["shape"] for p in procs], "all_reduces": ranks.all_reduces,
            "versions": versions(), "requests": results, "summary": summarize(results)}


async def _one_paged(prefiller: Prefiller, ranks: DecodeRanks, keys: Sequence[kv.BlocksCacheKey], view,
                     rid: str, mode: str, prompt: Sequence[int], src_table: torch.Tensor, dst_table: torch.Tensor,
                     max_new_tokens: int, timeout: float) -> dict:
    """One request: prefill into ``src_table``, push to ``dst_table`` on every decode rank."""
    engine = prefiller.engine
    replies = ranks.expect(rid)

    def open_streams() -> list[kv.LayerStream]:
        if view is None:       # one decode worker holding every head: one stream, the block tables as tensors
            return [engine.layer_stream(prefiller.cache, list(keys), tensor_num_per_layer=2, timeout=timeout,
                                        notify=rid.encode(), src_blocks=src_table, dst_blocks=dst_table)]
        return push_heads(engine, view, src_table, keys, [dst_table] * len(keys), timeout, rid.encode())

    def hand_over(first_token: int) -> None:
        for p in ranks.procs:
            p.send({"op": "decode", "id": rid, "blocks": dst_table.tolist(), "prompt_len": len(prompt),
                    "first_token": first_token, "max_new_tokens": max_new_tokens})

    r = await prefiller.run_paged(rid, prompt, src_table, open_streams, on_forward_done=hand_over,
                                  layerwise=(mode == "layerwise"))
    if any(s != kv.LLMStatusCode.LLM_SUCCESS for s in r.statuses):
        raise RuntimeError(f"{rid}: KV push failed: {[s.name for s in r.statuses]}")
    got = [await asyncio.wait_for(f, 60) for f in replies]
    for g in got:
        if "error" in g:
            raise RuntimeError(f"{rid}: decode worker: {g}")
    if any(g["tokens"] != got[0]["tokens"] for g in got):
        raise RuntimeError(f"{rid}: the decode ranks disagree: {[g['tokens'] for g in got]}")
    reply = got[0]
    desc = prefiller.cache.desc
    return {"id": rid, "mode": mode, "prompt_len": len(prompt), "src_blocks": src_table.tolist(),
            "dst_blocks": dst_table.tolist(), "tokens": reply["tokens"],
            "kv_bytes": desc.row_bytes * desc.num_tensors * len(src_table),
            "forward_ms": r.forward_s * 1e3, "transfer_ms": r.transfer_total_s * 1e3,
            "exposed_ms": r.exposed_s * 1e3, "done_after_forward_ms": r.done_after_forward_s * 1e3,
            "layer0_landed_before_forward_end": r.t_layer0_done < r.t_forward_end,
            "kv_at_decode_ms": (max(g["t_notified"] for g in got) - r.t_forward_end) * 1e3,
            "decode_ms": (max(g["t_decode_end"] for g in got) - reply["t_decode_start"]) * 1e3}


def summarize(results: list[dict]) -> dict:
    out = {}
    for mode in sorted({r["mode"] for r in results}):
        rs = [r for r in results if r["mode"] == mode and not r["warmup"]]
        if not rs:
            continue
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("forward_ms", "transfer_ms", "exposed_ms", "done_after_forward_ms", "kv_at_decode_ms",
                          "decode_ms")}
        med["exposed_fraction"] = statistics.median(r["exposed_ms"] / r["transfer_ms"] for r in rs)
        med["requests"] = len(rs)
        out[mode] = med
    return out


def print_report(res: dict, log=print) -> None:
    log(f"[{res['transport']}] {'request':<18} {'len':>4} {'forward':>9} {'transfer':>9} {'exposed':>9} "
        f"{'kv@decode':>9} {'decode':>9}  tokens")
    for r in res["requests"]:
        toks = " ".join(map(str, r["tokens"][:12])) + (" ..." if len(r["tokens"]) > 12 else "")
        log(f"[{res['transport']}] {r['id']:<18} {r['prompt_len']:>4} {r['forward_ms']:>7.2f}ms "
            f"{r['transfer_ms']:>7.2f}ms {r['exposed_ms']:>7.2f}ms {r['kv_at_decode_ms']:>7.2f}ms "
            f"{r['decode_ms']:>7.1f}ms  {toks}")
    for mode, s in res["summary"].items():
        log(f"[{res['transport']}] {mode}: median of {s['requests']}: forward {s['forward_ms']:.2f} ms, "
            f"transfer {s['transfer_ms']:.2f} ms, exposed {s['exposed_ms']:.2f} ms "
            f"({100 * s['exposed_fraction']:.0f}% of the transfer), KV at decode {s['kv_at_decode_ms']:.2f} ms "
            f"after the forward")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp", "auto"])
    ap.add_argument("--layers", type=int, default=ModelSpec.num_layers)
    ap.add_argument("--hidden", type=int, default=ModelSpec.hidden_size)
    ap.add_argument("--heads", type=int, default=ModelSpec.num_heads)
    ap.add_argument("--kv-heads", type=int, default=ModelSpec.num_kv_heads)
    ap.add_argument("--seed", type=int, default=ModelSpec.seed)
    ap.add_argument("--prompt-lens", default="7,61,250", help="comma-separated prompt lengths")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--max-seq", type=int, default=512, help="tokens per KV row")
    ap.add_argument("--rows", type=int, default=4, help="request slots in the KV cache")
    ap.add_argument("--mode", default="layerwise", choices=["layerwise", "after", "both"],
                    help="push each layer as it is computed, or all after the forward (baseline), or both")
    ap.add_argument("--layout", default="rows", choices=["rows", "paged"],
                    help="rows: one KV row per request; paged: block pools, block tables, two requests' blocks "
                         "interleaved (blocks.py)")
    ap.add_argument("--block-size", type=int, default=16, help="paged: tokens per block")
    ap.add_argument("--num-blocks", type=int, default=0, help="paged: blocks per pool (0: two longest prompts' worth)")
    ap.add_argument("--tp", type=int, default=1, help="paged: decode ranks, each holding kv_heads / tp heads (TP "
                                                      "emulated; outputs combined per layer)")
    ap.add_argument("--check", action="store_true", help="compare with single-process model.generate")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    ap.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--uvloop", action="store_true")
    args = ap.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    spec = ModelSpec(num_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                     num_heads=args.heads, num_kv_heads=args.kv_heads, seed=args.seed,
                     max_position_embeddings=max(2048, args.max_seq + args.new_tokens))
    prompts = make_prompts([int(x) for x in args.prompt_lens.split(",")], spec.vocab_size)
    modes = ["layerwise", "after"] if args.mode == "both" else [args.mode]
    model = build_model(spec)
    v = versions()
    print(f"disagg_llama: Llama {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_heads} heads "
          f"({spec.num_kv_heads} kv), random weights (seed {spec.seed}); torch {v['torch']}, "
          f"transformers {v['transformers']}")

    if args.tp > 1 and args.layout != "paged":
        ap.error("--tp needs --layout paged")

    async def go() -> dict:
        if args.layout == "paged":
            per = max(-(-len(p) // args.block_size) for p in prompts)
            return await run_paged_session(prompts, args.new_tokens, args.transport, spec,
                                           args.num_blocks or max(8, 4 * per), args.block_size, args.tp, modes,
                                           torch_threads=args.torch_threads, model=model)
        return await run_session(prompts, args.new_tokens, args.transport, spec, args.rows, args.max_seq,
                                 modes, torch_threads=args.torch_threads, model=model)
    if args.uvloop:
        import uvloop
        res = uvloop.run(go())
    else:
        res = asyncio.run(go())
    print_report(res)
    ok = True
    if args.check:
        for r in res["requests"]:
            want = reference_generate(model, prompts[r["prompt_index"]], args.new_tokens)
            r["reference"] = want
            same = r["tokens"] == want
            ok &= same
            print(f"check {r['id']}: {'identical to single-process generate()' if same else f'DIFFERENT: {want}'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
