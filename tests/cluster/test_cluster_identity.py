"""Host identity across network namespaces (kvengine.control.host_identity, docs/protocol.md).

Two network namespaces on one machine are two hosts: their abstract Unix sockets (the
shm join) are apart, so transport="auto" must pick tcp between them, as across
machines; two engines in one namespace still pick shm."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from kvengine import control

from kvengine.bench import netbed
from kvengine.bench.netbed import HB, SECRET

_PRINT = "from kvengine.control import host_identity; print(host_identity())"


def _identity_in(ns: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (netbed.ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _PRINT], capture_output=True,
                          text=True, check=True, env=env, timeout=30).stdout.strip()


def test_the_network_namespace_is_part_of_the_host_identity(bed_factory):
    bed = bed_factory(2)
    ours = control.host_identity()
    a, a2, b = _identity_in(bed.hosts[0]), _identity_in(bed.hosts[0]), _identity_in(bed.hosts[1])
    boot, net, pid = ours.split(":")
    assert net == str(os.stat("/proc/self/ns/net").st_ino)   # read from the kernel, not configured
    assert a == a2, "two processes in one namespace are one host"
    assert len({ours, a, b}) == 3, "three network namespaces are three hosts"
    for other in (a, b):   # same kernel and pid namespace: only the network namespace differs
        o_boot, o_net, o_pid = other.split(":")
        assert (o_boot, o_pid) == (boot, pid) and o_net != net


async def test_auto_picks_tcp_across_namespaces_and_shm_within_one(bed_factory):
    bed = bed_factory(2)
    try:
        p, same, other = await asyncio.gather(bed.spawn(0, 1, role="PROMPT", secret=SECRET, options=HB),
                                              bed.spawn(0, 2, secret=SECRET, options=HB),
                                              bed.spawn(1, 3, secret=SECRET, options=HB))
        for a in (same, other):
            assert (await p.call("link", cluster_id=a.cluster_id, address=a.address))["status"] == 0
        links = (await p.call("stats"))["stats"]["links"]
        assert links["2"]["transport"] == "shm", links
        assert links["3"]["transport"] == "tcp", links
        src = (await p.call("alloc", n=1, shape=[2, 1 << 20], dtype="uint8", fill=3))["cache_id"]
        for a in (same, other):
            dst = (await a.call("alloc", n=1, shape=[2, 1 << 20], dtype="uint8"))["cache_id"]
            r = await p.call("series", cache_id=src, targets=[[a.cluster_id, dst]], n=2, rows=2, deadline=5)
            assert r["status"] == {str(a.cluster_id): {"LLM_SUCCESS": 2}}
            assert (await a.call("digest", cache_id=dst))["rows"] == (await p.call("digest", cache_id=src))["rows"]
    finally:
        await bed.aclose()


def test_without_cap_net_admin_the_bed_says_why(monkeypatch):
    """The skip reason names the missing capability (the tests skip, never pass)."""
    import subprocess as sp

    def fake(argv, **kw):
        return sp.CompletedProcess(argv, 2, "", "mount --make-shared /run/netns failed: Operation not permitted")
    monkeypatch.setattr(netbed.subprocess, "run", fake)
    reason = netbed.can_create_namespaces()
    assert reason is not None and "CAP_NET_ADMIN" in reason and "Operation not permitted" in reason
