"""`kvengine bench cluster` end to end, as a user runs it (tiny: 1 prefill x 1 decode host,
2 s runs): the fault run after the no-fault run, every byte checked, notifications exactly
once on every host (the faulted one after the link is made again) and never wrong, JSON and
the verdict lines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvengine.bench import netbed


@pytest.mark.parametrize("fault", ["partition"])
def test_bench_cluster_runs_a_fault_and_checks_every_notification(fault, tmp_path):
    why = netbed.can_create_namespaces()
    if why is not None:
        pytest.skip(why)
    prefix = tmp_path / "cluster"
    r = subprocess.run([sys.executable, "-m", "kvengine", "bench", "cluster", "--hosts", "2", "--seconds", "2",
                        "--fault", fault, "--out", str(prefix)], capture_output=True, text=True, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "no wrong or duplicate notification anywhere: yes" in out, out[-2000:]
    assert "killed one): yes" in out, out[-2000:]   # exactly once, the faulted host included
    rep = json.loads((tmp_path / "cluster.json").read_text())
    assert [p["fault"] for p in rep["phases"]] == ["none", fault]
    groups = rep["phases"][1]["groups"]
    assert set(groups) == {"faulted", "rest"}
    assert groups["rest"]["exactly_once"] and rep["phases"][0]["groups"]["all"]["exactly_once"]
    assert groups["faulted"]["exactly_once"], groups["faulted"]   # re-sent after the relink
    assert groups["faulted"]["status"].get("layer LLM_SUCCESS", 0) > 0      # it ran before the fault
    assert "rest_p99_over_no_fault" in rep
