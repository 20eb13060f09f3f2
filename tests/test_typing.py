"""The package type-checks: ``mypy`` with pyproject.toml's ``[tool.mypy]`` (strict, Python
3.11, files = kvengine) finds nothing. Runs mypy in a subprocess, as a developer would
(``python -m mypy`` in the checkout), and prints its report when it fails."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _config() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_mypy_config_is_strict_over_the_package():
    project = _config()
    cfg = project["tool"]["mypy"]
    assert cfg["strict"] is True
    assert cfg["python_version"] == "3.11"
    assert cfg["files"] == ["kvengine"]
    # nothing loosened for kvengine's own modules (overrides are for third-party imports only)
    for override in cfg.get("overrides", []):
        modules = override["module"] if isinstance(override["module"], list) else [override["module"]]
        assert not any(m == "kvengine" or m.startswith("kvengine.") for m in modules), override
        assert set(override) == {"module", "ignore_missing_imports"}, override
    assert any(dep.startswith("mypy") for dep in project["project"]["optional-dependencies"]["test"])


@pytest.mark.timeout(300)
def test_package_passes_mypy_strict():
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml")],
                       cwd=REPO, capture_output=True, text=True, timeout=280)
    report = r.stdout + r.stderr
    if r.returncode != 0:
        print(report)
    assert r.returncode == 0, f"mypy --strict reports problems in kvengine:\n{report}"
    assert "Success: no issues found" in r.stdout, report
