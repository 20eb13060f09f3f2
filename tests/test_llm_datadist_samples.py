"""LLM-DataDist programs run unchanged but for their import and device lines
(examples/llm_datadist/): push_cache, push_blocks / pull_blocks and
transfer_cache_async, each as two processes on 127.0.0.1 with torch.distributed
(gloo) barriers, as LLM-DataDist's samples run. Each program checks every value it
received and fails otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ports import listen_port

pytest.importorskip("torch")

SAMPLES = Path(__file__).resolve().parent.parent / "examples" / "llm_datadist"


@pytest.mark.parametrize("sample, checks", [
    ("push_cache_sample.py", "after decoder push"),
    ("push_blocks_sample.py", "every block holds what was pushed or pulled"),
    ("transfer_cache_async_sample.py", "every layer holds what the prompt computed"),
])
def test_llm_datadist_sample_runs_as_two_processes(sample, checks):
    env = dict(os.environ, MASTER_PORT=str(listen_port()), SAMPLE_PORT=str(listen_port()))
    procs = [subprocess.Popen([sys.executable, str(SAMPLES / sample), "--role", role], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for role in ("p", "d")]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for role, p, out in zip("pd", procs, outs):
        assert p.returncode == 0, f"{sample} --role {role}:\n{out[-3000:]}"
        assert "Sample end" in out, out[-2000:]
    assert any(checks in out for out in outs), outs
