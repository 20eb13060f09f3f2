"""Listener churn across two hosts: the decode side closes and reopens its engine (same
cluster id, same address) 20 times while the prefill side keeps linking and pushing.

Proves (docs/reliability.md): no leak on either side, measured at the same quiet state
(no link, no transfer, after a full garbage collection) after
warm-up and after the churn: open fds (/proc/PID/fd) and
threads (/proc/PID/task) back to the baseline, current RSS (VmRSS) within a bound, the
native live counters (jobs_live, regions_live, tcp_conns) back to the baseline; and the
prefill kept succeeding between the reopens."""

from __future__ import annotations

import asyncio
import gc
import os

import pytest

import kvengine as kv

from kvengine.bench import netbed
from kvengine.bench.netbed import HB, SECRET, SILENT_BOUND

CYCLES, WARMUP = 20, 3
SHAPE = [1, 1 << 20]            # one 1 MiB row per push
RSS_SLACK_KB = 4096             # allocator noise after warm-up (measured growth: docs/reliability.md)
LIVE = ("jobs_live", "regions_live", "tcp_conns")


async def test_listener_churn_leaks_nothing(bed_factory):
    bed = bed_factory(2)
    try:
        prefill = await bed.spawn(0, 1, role="PROMPT", secret=SECRET, options=HB)
        decode = await bed.spawn(1, 2, secret=SECRET, options=HB)
        src = (await prefill.call("alloc", n=1, shape=SHAPE, dtype="uint8", fill=5))["cache_id"]
        dst = (await decode.call("alloc", n=1, shape=SHAPE, dtype="uint8"))["cache_id"]

        async def reopen() -> None:
            got = await decode.call("reopen", timeout=30)
            assert got["address"] == decode.address
            assert (await decode.call("alloc", n=1, shape=SHAPE, dtype="uint8"))["cache_id"] == dst

        async def quiet() -> dict:
            """Stop the prefill's hammer, reopen the decode engine, wait until the prefill has
            no link: then measure both sides."""
            counts = (await prefill.call("hammer_stop"))["counts"]
            await reopen()
            assert (await prefill.call("wait_link_down", cluster_id=2, timeout=SILENT_BOUND + 5))["down"]
            out = {"counts": counts}
            for name, a in (("prefill", prefill), ("decode", decode)):
                out[name + "_before_gc"] = netbed.proc_usage(a.pid)
                await a.call("gc")   # closed engines wait for a collection to free their core's fds
                native = (await a.call("stats"))["stats"]["native"]
                out[name] = dict(netbed.proc_usage(a.pid), **{k: native[k] for k in LIVE})
            return out

        async def churn(n: int) -> None:
            await prefill.call("hammer_start", cluster_id=2, address=decode.address, cache_id=src,
                               dst_cache_id=dst, deadline=0.5)
            for _ in range(n):
                await asyncio.sleep(0.15)   # the prefill links and pushes meanwhile
                await reopen()

        await churn(WARMUP)
        base = await quiet()
        await churn(CYCLES)
        after = await quiet()
        print(f"\nbaseline {base}\nafter {CYCLES} reopens {after}")
        counts = after["counts"]
        assert counts.get("push_LLM_SUCCESS", 0) >= CYCLES // 2, f"the prefill rarely got through: {counts}"
        for side in ("prefill", "decode"):
            b, a = base[side], after[side]
            assert a["fds"] == b["fds"], f"{side}: fds {b['fds']} -> {a['fds']}"
            assert a["threads"] == b["threads"], f"{side}: threads {b['threads']} -> {a['threads']}"
            for k in LIVE:
                assert a[k] == b[k], f"{side}: native {k} {b[k]} -> {a[k]}"
            assert a["rss_kb"] - b["rss_kb"] <= RSS_SLACK_KB, \
                f"{side}: RSS {b['rss_kb']} -> {a['rss_kb']} kB over {CYCLES} reopens"
    finally:
        await bed.aclose()


async def test_close_releases_the_native_fds_without_a_garbage_collection():
    """In this process, no namespaces: close() alone gives back every fd of the engine
    (Core.release frees the core at close, not when a collection frees the engine)."""
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))
    gc.collect()
    base = fds()
    e = await kv.KvEngine(2, kv.Role.DECODER, "127.0.0.1:0", kv.EngineOptions(transport="tcp", secret=SECRET)).start()
    await e.close()
    left = fds() - base
    del e
    gc.collect()
    assert fds() == base, "the engine leaked fds even after a collection"
    assert left == 0, f"{left} fds stay open after close() until the engine is garbage-collected"
