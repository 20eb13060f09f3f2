"""Errors at the edges: a busy port, a call from another thread or loop, a stranger
(HTTP) on the control port, the CLI's help, the benchmark footer."""

import asyncio
import gc
import logging
import math
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import kvengine as kv
from kvengine import LLMStatusCode as S
from conftest import link, make_pair
from kvengine.registry import LOCAL_REGISTRIES

ROOT = Path(__file__).resolve().parent.parent


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_start_on_a_busy_port_raises_llm_error_and_leaves_the_engine_closed():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        gc.collect()   # earlier tests' garbage closes its descriptors now, not mid-test
        before = _fds()
        e = kv.KvEngine(1, kv.Role.PROMPT, f"127.0.0.1:{port}", kv.EngineOptions(insecure=True))
        with pytest.raises(kv.LLMError) as info:
            await e.start()
        err = info.value
        assert err.status == S.LLM_LINK_FAILED
        assert isinstance(err, OSError)        # LLMLinkFailedError is a ConnectionError
        assert f"127.0.0.1:{port}" in str(err)
        assert "in use" in str(err).lower()
        assert isinstance(err.__cause__, OSError)
        # closed cleanly: calls say it is closed, close() again is fine, nothing left open
        with pytest.raises(kv.LLMEngineFinalizedError):
            e.allocate_cache(kv.CacheDesc(1, (1, 64), np.float16))
        with pytest.raises(kv.LLMEngineFinalizedError):
            await e.start()
        await e.close()
        assert e._token not in LOCAL_REGISTRIES
        del e, err, info
        gc.collect()
        assert _fds() <= before, "the failed start left descriptors open"
    finally:
        busy.close()


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:     # noqa: BLE001 - handed back to the test
            box["error"] = exc
    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the call from another thread hung"
    return box


async def test_call_from_another_thread_or_loop_raises_a_clear_error(pair):
    p, d = pair
    await link(d, p)
    src = p.allocate_cache(kv.CacheDesc(2, (2, 64), np.float16))
    dst = d.allocate_cache(kv.CacheDesc(2, (2, 64), np.float16))
    await p.wait_remote_cache(2, dst.cache_id)
    idx = kv.CacheIndex(2, dst.cache_id, 0)

    def check(box, where):
        err = box.get("error")
        assert isinstance(err, kv.LLMError), box
        assert err.status == S.LLM_FAILED
        assert where in str(err) and "run_coroutine_threadsafe" in str(err), str(err)

    # asyncio.run in a thread: a different running loop
    check(await asyncio.to_thread(_in_thread, lambda: asyncio.run(p.push_kv_cache(src, idx, timeout=2))),
          "another event loop")
    check(await asyncio.to_thread(_in_thread, lambda: asyncio.run(p.wait_link(2, timeout=2))),
          "another event loop")
    check(await asyncio.to_thread(_in_thread, lambda: asyncio.run(p.close())), "another event loop")
    # a plain thread: no running loop
    check(await asyncio.to_thread(_in_thread, lambda: p.allocate_cache(kv.CacheDesc(1, (1, 64), np.float16))),
          "no running event loop")
    t = await asyncio.to_thread(_in_thread, lambda: p.submit_push_kv_cache(src, idx))
    assert t["result"].status == S.LLM_FAILED and "run_coroutine_threadsafe" in t["result"].message()
    # the documented way works, and the engine is unharmed
    loop = asyncio.get_running_loop()
    box = await asyncio.to_thread(_in_thread, lambda: asyncio.run_coroutine_threadsafe(
        p.push_kv_cache(src, idx, timeout=5), loop).result(10))
    assert box.get("result") == S.LLM_SUCCESS, box
    assert await p.push_kv_cache(src, idx) == S.LLM_SUCCESS


async def test_http_on_the_control_port_is_refused_as_not_a_kvengine_peer(pair, caplog):
    p, d = pair
    caplog.set_level(logging.INFO, logger="kvengine")
    host, port = p.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET / HTTP/1.1\r\nHost: localhost\r\nUser-Agent: curl/8\r\nAccept: */*\r\n\r\n")
    await writer.drain()
    try:
        rest = await asyncio.wait_for(reader.read(), 5)    # EOF: the engine closed it
    except ConnectionResetError:
        rest = b""
    assert rest == b""
    writer.close()
    msgs = [r.getMessage() for r in caplog.records]
    hits = [m for m in msgs if "not a kvengine peer" in m]
    assert hits and "HTTP" in hits[0], msgs
    assert not any("exceeds" in m for m in msgs), msgs
    await link(d, p)                                        # a real peer still links
    assert p.stats()["control_refused"] >= 1


def test_frame_too_large_message_names_strangers():
    from kvengine.control import frame_too_large
    assert frame_too_large(b"GET ", 1195725856, 4096).startswith("not a kvengine peer: the first bytes look like HTTP")
    assert "TLS" in frame_too_large(b"\x16\x03\x01\x02", 0x16030102, 4096)
    assert "look like text" in frame_too_large(b"SSH-", 0x5353482D, 4096)
    assert frame_too_large(b"\x01\x00\x00\x00", 1 << 24, 4096) == f"control frame of {1 << 24} bytes exceeds 4096"


def test_demo_help_describes_every_option_with_its_default():
    out = subprocess.run([sys.executable, "-m", "kvengine", "demo", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0, out.stderr
    body = out.stdout.split("options:", 1)[1]
    entries = re.split(r"\n  (?=-)", "\n" + body)
    opts = {}
    for entry in entries:
        entry = " ".join(entry.split())
        if entry.startswith("--"):
            opts[entry.split()[0]] = entry
    expected = {"--layers", "--tokens", "--kv-heads", "--head-dim", "--batch", "--dtype", "--transport",
                "--timeout", "--uvloop"}
    assert set(opts) == expected, opts
    for name, text in opts.items():
        m = re.search(r"\(default: ([^)]+)\)$", text)
        assert m, f"{name}: no default in {text!r}"
        described = text[:m.start()].split(maxsplit=1)
        assert len(described) == 2 and len(described[1].split()) >= 3, f"{name}: no description in {text!r}"
    assert "(default: 16)" in opts["--layers"] and "(default: auto)" in opts["--transport"]


@pytest.mark.parametrize("wall", [0.0, 0.0004, 0.3, 0.4999, 2.5, 40.0])
def test_bench_load_line_never_says_0_s(wall):
    from kvengine.bench.common import fmt_seconds, load_line
    line = load_line({"wall_s": wall, "own_cpu_s": 0.1, "other_cpu_s": 0.0, "other_vcpu_fraction": 0.0,
                      "steal_cpu_s": 0.0})
    assert "during the 0 s" not in line and fmt_seconds(wall) in line
    assert not re.match(r"0(\.0+)? s$", fmt_seconds(wall)), fmt_seconds(wall)


def test_bench_load_line_warns_of_tcp_retransmissions():
    """A run whose TCP retransmitted says so (on loopback under BBR that halves small pushes);
    a clean run says nothing about TCP. The counters are read from this namespace's /proc."""
    from kvengine.bench.common import cpu_snapshot, foreign_load, load_line
    a = cpu_snapshot()
    assert set(a[3]) >= {"RetransSegs", "TCPOFOQueue"} and all(v >= 0 for v in a[3].values())
    ld = foreign_load(a, cpu_snapshot())
    assert ld["tcp"]["congestion_control"] and ld["tcp"]["RetransSegs"] >= 0
    base = {"wall_s": 1.0, "own_cpu_s": 0.1, "other_cpu_s": 0.0, "other_vcpu_fraction": 0.0, "steal_cpu_s": 0.0}
    clean = load_line({**base, "tcp": {"congestion_control": "bbr", "RetransSegs": 0, "TCPOFOQueue": 0}})
    assert "TCP" not in clean
    hit = load_line({**base, "tcp": {"congestion_control": "bbr", "RetransSegs": 38, "TCPDSACKRecv": 24,
                                     "TCPOFOQueue": 20}})
    assert "TCP (bbr) retransmitted 38 segments" in hit and "24 of them spurious" in hit and "20 received" in hit


async def test_start_after_close_raises_instead_of_starting():
    e = kv.KvEngine(1, kv.Role.PROMPT, "127.0.0.1:0")
    await e.close()
    with pytest.raises(kv.LLMEngineFinalizedError):
        await e.start()
    assert "native" not in e.stats() and e.address is None   # no core was made


async def test_every_timeout_follows_one_rule():
    """One validator for every timeout: None means the option's default, anything else must
    be a finite positive number of seconds (link_clusters used to accept inf)."""
    p, d = await make_pair("local")
    try:
        for bad in (math.inf, -1, 0, True, "1", float("nan")):
            with pytest.raises(kv.LLMParamInvalidError):
                await p.link_clusters([kv.ClusterInfo(2, d.address)], timeout=bad)
            with pytest.raises(kv.LLMParamInvalidError):
                await p.wait_link(2, timeout=bad)
            with pytest.raises(kv.LLMParamInvalidError):
                await p.wait_notification(timeout=bad)
            with pytest.raises(kv.LLMParamInvalidError):
                kv.EngineOptions(link_timeout=bad)
    finally:
        await p.close()
        await d.close()


def test_one_status_conversion_with_a_default():
    from kvengine.status import to_status
    assert to_status(0x5010B005) is S.LLM_PARAM_INVALID
    assert to_status(12345) is S.LLM_FAILED                        # unknown native code
    assert to_status("LLM_SUCCESS", S.LLM_LINK_FAILED) is S.LLM_LINK_FAILED   # a peer's junk
    assert to_status(None, S.LLM_LINK_FAILED) is S.LLM_LINK_FAILED
