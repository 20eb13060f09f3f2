"""`kvengine bench latency --layout paged` from the command line: both columns measured
and byte-checked, the ratio and the goal reported, JSON and a PNG. Tiny: this checks
the tool, not speed (the figures are in docs/benchmarks.md)."""

import json

import pytest

from test_bench_cli import bench, check_png


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_bench_latency_paged_reports_the_ratio(transport, tmp_path):
    prefix = tmp_path / f"latency-paged-{transport}"
    out = bench("latency", "--layout", "paged", "--transport", transport, "--blocks", "8", "--n", "200",
                "--out", str(prefix))
    assert "paged / contiguous: p50" in out and "goal: one-layer push of a 8-block request" in out
    r = json.loads((tmp_path / f"latency-paged-{transport}.json").read_text())
    assert r["transport"] == transport and r["blocks"] == 8 and r["layer_bytes"] == 2 * 8 * 32 * 1024
    assert r["verify"] == {"kvengine paged": True, "kvengine contiguous": True}
    for c in ("kvengine paged", "kvengine contiguous"):
        s = r["results"][c]
        assert s["n"] == 200 and 0 < s["p50_us"] <= s["p99_us"] <= s["max_us"]
    x = r["paged_over_contiguous"]["p50_us"]
    assert x == pytest.approx(r["results"]["kvengine paged"]["p50_us"] / r["results"]["kvengine contiguous"]["p50_us"])
    assert r["goals"][0]["status"] == ("MET" if x <= 2.0 else "NOT MET")
    check_png(prefix, out)
