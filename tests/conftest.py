"""Shared fixtures: every async test runs under asyncio and under uvloop, and
fails if anything reached the loop's exception handler."""

import asyncio
import os

import numpy as np
import pytest
import uvloop

import kvengine as kv

# UCX's tcp transport uses every interface it finds, and reaches this host's own
# addresses beside 127.0.0.1: tests send traffic to 127.0.0.1 only
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def pytest_configure(config):
    config.addinivalue_line("markers", "one_loop: run this async test under asyncio only (what it tests runs "
                                       "in child processes: this process's loop plays no part)")


def pytest_asyncio_loop_factories(config, item):
    if item.get_closest_marker("one_loop"):
        return {"asyncio": asyncio.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(autouse=True)
async def loop_errors():
    """Fail the test if the loop's exception handler was called (uvloop/asyncpg tearDown rule)."""
    loop = asyncio.get_running_loop()
    errors = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    yield
    assert not errors, f"loop exception handler called: {errors}"


@pytest.fixture(params=["local", "shm", "tcp"])
def transport(request):
    return request.param


async def make_pair(transport="auto", **opts):
    """A prefill engine (cluster 1) and a decode engine (cluster 2) in this process."""
    o = kv.EngineOptions(transport=transport, **opts)
    p = await kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0", o).start()
    d = await kv.KvEngine(2, kv.Role.DECODER, "127.0.0.1:0", o).start()
    return p, d


@pytest.fixture
async def pair(transport):
    """A prefill engine (cluster 1) and a decode engine (cluster 2) in this process, not linked."""
    p, d = await make_pair(transport)
    try:
        yield p, d
    finally:
        await p.close()
        await d.close()
        for e in (p, d):
            assert e.stats()["native"]["jobs_live"] == 0


async def link(a, b):
    st, per = await a.link_clusters([kv.ClusterInfo(b.cluster_id, b.address)])
    assert st == kv.LLMStatusCode.LLM_SUCCESS, per
    return st


def filled(cache, seed):
    from kvengine._peer import fill_pattern
    for i, t in enumerate(cache.tensors):
        fill_pattern(t, seed, i)
    return cache


def snapshot(cache):
    return [np.array(t, copy=True) for t in cache.tensors]
