"""Fixtures of the multi-host test bed (tests/cluster/netbed.py, docs/reliability.md).

The bed needs CAP_NET_ADMIN (network namespaces, veth, tc): without it every test
here is skipped with the reason, never passed. The engines run in child processes
inside the namespaces; this process only drives them over pipes, so the tests run
under one event loop (asyncio) instead of the suite's asyncio + uvloop pair.
"""

from __future__ import annotations

import asyncio

import pytest

from kvengine.bench import netbed
from kvengine.native import _native




def pytest_asyncio_loop_factories(config, item):
    return {"asyncio": asyncio.new_event_loop}


_reason: list[str | None] = []


def _skip_reason() -> str | None:
    if not _reason:
        _reason.append(netbed.can_create_namespaces())
        if _reason[0] is None:
            netbed.sweep()   # what a crashed earlier run left behind
    return _reason[0]


@pytest.fixture
def bed_factory(request):
    """``bed_factory(n)``: a NetBed of n hosts, set up; closed (processes killed,
    namespaces deleted) when the test ends, however it ends."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    beds = []

    def make(n: int) -> netbed.NetBed:
        bed = netbed.NetBed(n)
        beds.append(bed)
        return bed.setup()

    def finish() -> None:
        for b in beds:
            b.close()
    request.addfinalizer(finish)
    return make


@pytest.fixture
async def bed3(bed_factory):
    """Three hosts: 0 (prefill), 1 and 2 (decode). Agents are closed gracefully when
    the test ends (then killed, and the bed deleted, by bed_factory's finalizer)."""
    bed = bed_factory(3)
    try:
        yield bed
    finally:
        await bed.aclose()


# kvengine's tcp data plane, and UCX's tcp transport (the UCX case skipped, with the reason,
# where kvengine was built without it)
@pytest.fixture(params=["tcp", pytest.param("ucx", marks=pytest.mark.skipif(
    not _native.UCX, reason="kvengine built without UCX: pip install 'kvengine[ucx]' (libucx-cu12), then rebuild"))])
def transport(request, monkeypatch):
    """A test taking it runs over each transport; over UCX with UCX_TLS=tcp (across hosts:
    UCX's shared memory would pass through the one kernel)."""
    if request.param == "ucx":
        monkeypatch.setenv("UCX_TLS", "tcp")
    return request.param
