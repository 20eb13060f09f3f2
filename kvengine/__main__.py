"""``kvengine`` command line: ``kvengine demo``, ``kvengine bench throughput|latency|loopcost|load|cluster|soak``
(also ``python -m kvengine ...``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import time
from typing import Callable



def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


async def demo(args: argparse.Namespace) -> int:
    """Prefill engine here, decode engine in a child process; push a Llama-shaped KV cache."""
    import kvengine as kv
    from kvengine._peer import PeerProcess, fill_pattern, row_digests

    S = kv.LLMStatusCode
    L, B = args.layers, args.batch
    shape = (B, args.tokens, args.kv_heads, args.head_dim)
    desc = kv.CacheDesc(2 * L, shape, args.dtype)
    say = print
    say(f"kvengine demo: {L} layers x (K, V), {B} sequences x {args.tokens} tokens x "
        f"{args.kv_heads} kv heads x {args.head_dim} dim, {desc.dtype.name}: "
        f"{_fmt_bytes(desc.nbytes)} of KV cache")

    secret = os.environ.get("KVENGINE_SECRET", "").encode() or secrets.token_hex(16).encode()
    decode = await PeerProcess.start(cluster_id=2, transport=args.transport, secret=secret)
    try:
        opts = kv.EngineOptions(transport=args.transport, secret=secret)
        async with kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", opts) as prefill:
            dst_id = (await decode.call("alloc", n=desc.num_tensors, shape=list(shape),
                                        dtype=desc.dtype.name))["cache_id"]
            say(f"  decode engine: cluster 2, pid {decode.pid}, {decode.address}, cache {dst_id}")
            t0 = time.perf_counter()
            st, _ = await prefill.link_clusters([kv.ClusterInfo(2, decode.address)])
            if st != S.LLM_SUCCESS:
                say(f"  link failed: {st.name}")
                return 1
            link = prefill.stats()["links"][2]
            say(f"  prefill engine: cluster 1, {prefill.address}; linked (HMAC-authenticated) in "
                f"{(time.perf_counter() - t0) * 1e3:.1f} ms over '{link['transport']}'")
            await prefill.wait_remote_cache(2, dst_id)

            cache = prefill.allocate_cache(desc)
            for i, t in enumerate(cache.tensors):      # "prefill": deterministic K/V bytes
                fill_pattern(t, 42, i)

            # 1. layer by layer, as prefill computes them (row 0): one push per layer
            lat = []
            for layer in range(L):
                ext = kv.KvCacheExtParam((layer, layer), (layer, layer), 2)
                t1 = time.perf_counter()
                await prefill.push_kv_cache(cache, kv.CacheIndex(2, dst_id, 0), 0, ext_param=ext,
                                            timeout=args.timeout)
                lat.append(time.perf_counter() - t1)
            layer_bytes = 2 * desc.row_bytes
            # 2. whole rows (every layer at once) for the other sequences, concurrently
            t2 = time.perf_counter()
            await asyncio.gather(*(prefill.push_kv_cache(cache, kv.CacheIndex(2, dst_id, b), b,
                                                         timeout=args.timeout) for b in range(1, B)))
            rows_s = time.perf_counter() - t2
            rows_bytes = (B - 1) * desc.num_tensors * desc.row_bytes

            # 3. verify every byte on the decode side
            want = row_digests(cache.tensors)
            got = (await decode.call("digest", cache_id=dst_id, timeout=120))["rows"]
            ok = want == got
            lat_us = sorted(x * 1e6 for x in lat)
            say(f"  layer-wise: {L} pushes of {_fmt_bytes(layer_bytes)} (one layer, K+V), "
                f"p50 {statistics.median(lat_us):.0f} us, max {lat_us[-1]:.0f} us, "
                f"{L * layer_bytes / sum(lat) / 1e9:.2f} GB/s")
            if B > 1:
                say(f"  whole rows: {B - 1} concurrent pushes, {_fmt_bytes(rows_bytes)} in "
                    f"{rows_s * 1e3:.1f} ms = {rows_bytes / rows_s / 1e9:.2f} GB/s")
            stats = prefill.stats()
            say(f"  moved {_fmt_bytes(stats['bytes'])} in {stats['transfers']} transfers "
                f"({stats['native']['jobs_inline']} copied inline, {stats['native']['jobs_submitted']} by movers)")
            say(f"  decode side verified: {'every byte matches' if ok else 'MISMATCH'} "
                f"({desc.num_tensors} tensors x {B} rows)")
            return 0 if ok else 2
    finally:
        await decode.close()


_BENCH = {
    "throughput": ("kvengine.bench.throughput",
                   "push GB/s from one layer to a 256 MiB cache beside memcpy/sockets, NIXL and Mooncake "
                   "(--transport ucx: beside kvengine tcp, NIXL, UCXX, ucx_perftest)"),
    "latency": ("kvengine.bench.latency", "one-layer (64 KiB) push p50/p99/p999 beside the same; "
                "--layout paged: one layer of a 64-block request beside the same bytes contiguous"),
    "loopcost": ("kvengine.bench.loopcost", "the loop thread's CPU per one-layer push, and its pieces"),
    "load": ("kvengine.bench.load", "EDF vs FIFO scheduling under mixed load over tcp"),
    "cluster": ("kvengine.bench.cluster", "4 x 4 hosts in network namespaces (root), optionally with a fault"),
    "soak": ("kvengine.bench.soak", "mixed load for N minutes: RSS, fds, threads, live counters stay flat"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvengine", description="KV-cache transfer engine")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="two engines on this host move a Llama-shaped KV cache",
                       description="A decode engine in a child process and a prefill engine here link "
                                   "(HMAC-authenticated); the prefill side pushes a Llama-shaped KV cache "
                                   "layer by layer and row by row, the decode side checks every byte.")
    d.add_argument("--layers", type=int, default=16,
                   help="model layers; the cache holds a K and a V tensor per layer (default: %(default)s)")
    d.add_argument("--tokens", type=int, default=1024,
                   help="tokens per sequence (dim 1 of each tensor) (default: %(default)s)")
    d.add_argument("--kv-heads", type=int, default=8,
                   help="key/value heads per layer (default: %(default)s)")
    d.add_argument("--head-dim", type=int, default=128,
                   help="dimension of one head (default: %(default)s)")
    d.add_argument("--batch", type=int, default=4,
                   help="sequences (cache rows): row 0 is pushed layer by layer, the others whole "
                        "and concurrently (default: %(default)s)")
    d.add_argument("--dtype", default="float16",
                   help="element type, a numpy name: float16, float32, int8, ... "
                        "(default: %(default)s)")
    d.add_argument("--transport", default="auto", choices=["auto", "shm"],
                   help="transport of the link: auto (shm here: two processes on one host) or shm "
                        "forced (default: %(default)s)")
    d.add_argument("--timeout", type=float, default=10.0,
                   help="deadline of each push, in seconds (default: %(default)s)")
    d.add_argument("--uvloop", action="store_true",
                   help="run on uvloop instead of asyncio's default loop (default: %(default)s)")
    b = sub.add_parser("bench", add_help=False,
                       help="benchmarks: kvengine bench throughput|latency|loopcost|load|cluster|soak [--quick] ... (--help after one)",
                       description="kvengine bench throughput|latency|loopcost|load|cluster|soak [options]; each takes --help")
    b.add_argument("what", choices=list(_BENCH),
                   help="; ".join(f"{k}: {v[1]}" for k, v in _BENCH.items()))
    b.add_argument("rest", nargs=argparse.REMAINDER)
    raw = sys.argv[1:] if argv is None else list(argv)
    if raw[:1] == ["bench"] and (len(raw) == 1 or raw[1] in ("-h", "--help")):
        print("usage: kvengine bench {throughput,latency,loopcost,load,cluster,soak} [options]   (each takes --help)\n")
        for k, (_, what) in _BENCH.items():
            print(f"  {k:11s} {what}")
        return 0 if len(raw) > 1 else 2
    args = ap.parse_args(argv)
    if args.cmd == "bench":
        import importlib
        bench_main: Callable[[list[str]], int] = importlib.import_module(_BENCH[args.what][0]).main
        return bench_main(args.rest)
    if args.cmd == "demo":
        if args.uvloop:
            import uvloop
            return uvloop.run(demo(args))
        return asyncio.run(demo(args))
    return 2


if __name__ == "__main__":
    sys.exit(main())
