"""`kvengine bench` from the command line, as a user runs it after a fresh install:
progress while it runs, a table with ratios to the baselines measured in the same
run, JSON, and a PNG when matplotlib is there. Tiny sizes and few repetitions: this
checks that the tool works and reports what it measured, not speed (the figures are
in docs/benchmarks.md)."""

import importlib.util
import json
import subprocess
import sys

import pytest

from kvengine.native import _native

BASELINES = {"shm": ["memcpy", "memcpy 2 threads"], "tcp": ["raw socket"]}


def bench(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "kvengine", "bench", *args], capture_output=True, text=True,
                       timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    return out


def check_png(prefix, out: str) -> None:
    png = prefix.parent / (prefix.name + ".png")
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 1000, "no plot written"
    else:   # the run says how to get it
        assert not png.exists() and "kvengine[bench]' for the PNG" in out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_bench_throughput_reports_ratios_json_and_plot(transport, tmp_path):
    prefix = tmp_path / f"throughput-{transport}"
    out = bench("throughput", "--transport", transport, "--quick", "--sizes", "2x32K,4x256K", "--reps", "2",
                "--peers", "none", "--out", str(prefix))
    assert f"throughput {transport}" in out                       # the progress bar (or its plain lines)
    for name in BASELINES[transport]:
        assert f"x {name}" in out                                  # a ratio column per baseline
    assert "NIXL" in out and "not run (--peers)" in out            # peers are named even when not run
    r = json.loads((tmp_path / f"throughput-{transport}.json").read_text())
    assert r["transport"] == transport
    assert [s["bytes"] for s in r["sizes"]] == [64 << 10, 1 << 20]
    assert r["verify"]["kvengine"] == [True, True]                 # every size checked byte for byte
    for s in r["sizes"]:
        assert s["results"]["kvengine"]["GBps"] > 0
        assert sorted(s["kv_over"]) == sorted(BASELINES[transport] + (["uvloop streams"] if transport == "tcp" else []))
        assert all(v > 0 for v in s["kv_over"].values())
    check_png(prefix, out)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_bench_paged_throughput_pushes_and_pulls_tables(transport, tmp_path):
    """--layout paged: random tables pushed, the same bytes contiguous, and the tables
    pulled back (as a decode engine pulls), each checked byte for byte first; the pull
    is reported against the contiguous push, in the table, the JSON and the plot."""
    prefix = tmp_path / f"paged-{transport}"
    out = bench("throughput", "--layout", "paged", "--transport", transport, "--tables", "16", "--reps", "2",
                "--peers", "none", "--out", str(prefix))
    assert "kvengine paged pull" in out and "pull x contiguous" in out
    r = json.loads((tmp_path / f"paged-{transport}.json").read_text())
    assert r["verify"]["kvengine paged"] == r["verify"]["kvengine paged pull"] == [True]
    (t,) = r["tables"]
    assert t["blocks"] == 16 and t["results"]["kvengine paged pull"]["GBps"] > 0
    assert t["pull_over_contiguous"] > 0 and "kvengine paged pull" not in t["paged_over"]
    check_png(prefix, out)


def test_bench_latency_reports_percentiles(tmp_path):
    prefix = tmp_path / "latency-tcp"
    out = bench("latency", "--transport", "tcp", "--quick", "--n", "300", "--peers", "none", "--out", str(prefix))
    assert "p99" in out and "x kv p50" in out
    r = json.loads((tmp_path / "latency-tcp.json").read_text())
    kv = r["results"]["kvengine"]
    assert kv["n"] == 300 and 0 < kv["p50_us"] <= kv["p99_us"] <= kv["max_us"]
    assert set(r["kv_over"]) == {"raw socket", "uvloop streams"}
    check_png(prefix, out)


def _ucx_built() -> bool:
    from kvengine.native import _native
    return bool(_native.UCX)


@pytest.mark.skipif(not _ucx_built(), reason="kvengine built without UCX: pip install 'kvengine[ucx]', then rebuild")
def test_bench_ucx_throughput_and_latency_beside_kvengine_tcp_and_the_floor(tmp_path):
    """--transport ucx: kvengine over UCX and over tcp in the same run (both byte-checked),
    ucx_perftest as the floor when the libucx wheel ships it, the peers named even when
    not run; latency prints the floor and the goal line. --memory both: kvengine-ucx also on
    allocate_cache's memory (its own column, byte-checked); the default is numpy arrays."""
    from kvengine.bench.ucxpeers import perftest_binary
    floor = perftest_binary()[0] is not None
    prefix = tmp_path / "tp-ucx"
    out = bench("throughput", "--transport", "ucx", "--ucx-tls", "tcp", "--quick", "--sizes", "2x32K,4x256K",
                "--reps", "2", "--peers", "none", "--memory", "both", "--out", str(prefix))
    assert "UCX_TLS=tcp" in out and "x kvengine tcp" in out and "UCXX" in out
    r = json.loads((tmp_path / "tp-ucx.json").read_text())
    assert r["transport"] == "ucx" and r["ucx_tls"] == "tcp" and r["memory"] == "both"
    assert r["verify"]["kvengine"] == r["verify"]["kvengine tcp"] == r["verify"]["kvengine engine-mem"] == [True, True]
    want = ["kvengine tcp", "kvengine engine-mem"] + (["ucx_perftest"] if floor else [])
    for s in r["sizes"]:
        assert sorted(s["kv_over"]) == sorted(want) and all(v > 0 for v in s["kv_over"].values())
    check_png(prefix, out)
    prefix = tmp_path / "lat-ucx"
    out = bench("latency", "--transport", "ucx", "--ucx-tls", "tcp", "--quick", "--n", "300", "--peers", "none",
                "--out", str(prefix))
    assert "floor: ucx_perftest" in out and "goal: kvengine" in out
    r = json.loads((tmp_path / "lat-ucx.json").read_text())
    assert r["results"]["kvengine"]["n"] == 300 and set(r["kv_over"]) == {"kvengine tcp"}
    assert r["memory"] == "numpy"
    assert ("p50_us" in r["floor"]) == floor
    check_png(prefix, out)


@pytest.mark.parametrize("what,argv,peers", [
    ("latency", [], ["NIXL", "UCXX"]),
    ("latency", ["--peers", "nixl"], ["NIXL"]),
    ("throughput", [], ["NIXL", "UCXX"]),
    ("throughput-paged", [], []),
    ("throughput-headsplit", [], []),
    ("throughput-paged", ["--peers", "nixl"], None),
    ("latency-paged", ["--peers", "nixl"], None),
])
def test_bench_ucx_peers_beside_rows_only(what, argv, peers, tmp_path):
    """Over UCX the row benchmarks (throughput and latency: `what` as their commands
    pass it) run NIXL and UCXX beside kvengine by default and on request; the paged and
    head-split ones run kvengine only and refuse a peer list (None: refused)."""
    import argparse
    from kvengine.bench.throughput import add_common_args, resolve_common
    ap = argparse.ArgumentParser()
    add_common_args(ap, what)
    args = ap.parse_args(["--transport", "ucx", "--out", str(tmp_path / "x"), *argv])
    if peers is None:
        with pytest.raises(SystemExit) as e:
            resolve_common(ap, args, what)
        assert e.value.code == 2
    else:
        resolve_common(ap, args, what)
        assert [str(p) for p in args.peers] == peers


def test_bench_memory_numpy_runs_on_shm_and_both_only_over_ucx(tmp_path):
    """--memory picks the memory of kvengine's caches: numpy (registered arrays, reached
    with process_vm_writev on one host) on shm too; "both" (an extra column) only in the
    ucx runs, and not with the paged layout, whose caches are the engine's: the command
    refuses rather than ignore it."""
    r = subprocess.run([sys.executable, "-m", "kvengine", "bench", "throughput", "--transport", "shm",
                        "--memory", "both"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--memory both: with --transport ucx only" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvengine", "bench", "throughput", "--transport", "shm",
                        "--layout", "paged", "--memory", "numpy"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--memory: not with --layout paged" in r.stderr
    prefix = tmp_path / "latency-shm"
    out = bench("latency", "--transport", "shm", "--memory", "numpy", "--quick", "--n", "300", "--peers", "none",
                "--out", str(prefix))
    assert "--memory numpy (register_kv_cache of numpy arrays)" in out, out[-2000:]
    r = json.loads((tmp_path / "latency-shm.json").read_text())
    assert r["memory"] == "numpy"
    assert r["results"]["kvengine"]["n"] >= 300


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_bench_soak_samples_at_rest_and_says_flat(transport, tmp_path):
    """A short soak (4 cycles of 1 s): the rest samples, the verdict, the notification
    accounting (each successful notified push received and consumed once); over ucx also
    UCX's receives and endpoint closes, none left at rest."""
    if transport == "ucx" and not _native.UCX:
        pytest.skip("kvengine built without UCX: pip install 'kvengine[ucx]' (libucx-cu12), then rebuild")
    prefix = tmp_path / "soak"
    out = bench("soak", "--transport", transport, "--minutes", "0.05", "--cycle", "1", "--out", str(prefix))
    assert "soak: flat" in out, out[-2000:]
    r = json.loads((tmp_path / "soak.json").read_text())
    assert r["transport"] == transport and len(r["samples"]) == 4 and r["problems"] == []
    assert r["notified_ok"] > 0 and r["notifications"]["received"] == r["notes_taken"] == r["notified_ok"]
    assert set(r["statuses"]) == {"LLM_SUCCESS"}
    for s in r["samples"]:
        assert s["prefill_live"]["jobs_live"] == 0 and s["decode"]["fds"] > 0
        if transport == "ucx":
            for side in ("prefill_live", "decode_live"):
                assert s[side]["ucx_rx_pending"] == s[side]["ucx_ep_closing"] == 0, s
    check_png(prefix, out)


def test_bench_loopcost_reports_the_loop_threads_cost_and_its_pieces(tmp_path):
    out = bench("loopcost", "--transport", "local,tcp", "--n", "400", "--rounds", "1",
                "--json", str(tmp_path / "loopcost.json"))
    assert "loop CPU us/push" in out and "CPU beyond the copy" in out
    res = {r["transport"]: r for r in json.loads((tmp_path / "loopcost.json").read_text())["results"]}
    local, tcp = res["local"], res["tcp"]
    assert local["fast_taken"] >= 400                  # the inline pushes ran the native fast path
    assert tcp["fast_taken"] >= 300                    # one-layer tcp pushes: driven by the loop thread
    assert 0 < local["fast_cpu_us"] <= local["fast_wall_us"] * 1.5 and local["python_cpu_us"] > 0
    assert local["pieces_us"]["copy: Core.submit of the plan (C call + inline memmove)"] > 0
    # ...so no eventfd wake-up and no sleep of the loop a push (decisions.md #35); the
    # scheduler's launch is still timed alone, as the Python path's drain
    assert tcp["drains_per_push_fast"] < 0.5 and tcp["fast_sleeps"] < 0.5, tcp
    assert tcp["launch_us"] > 0 and tcp["drains_per_push_python"] > 0


def test_an_output_prefix_given_as_the_plots_name_is_not_doubled(tmp_path):
    """`--out x.png` (or x.json) names the outputs x.png and x.json, not x.png.png; the
    prefix's directory is made."""
    from kvengine.bench.common import out_paths
    for given in ("run.png", "run.json", "run"):
        assert out_paths(str(tmp_path / "a" / given), None) == (str(tmp_path / "a" / "run.json"),
                                                                str(tmp_path / "a" / "run.png"))
    assert (tmp_path / "a").is_dir()
    assert out_paths(str(tmp_path / "run.png"), "elsewhere.json") == ("elsewhere.json", str(tmp_path / "run.png"))
