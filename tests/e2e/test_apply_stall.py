"""A large apply does not stall traffic: bench/apply_stall.py, small, with
generous bounds (the figures are printed; the benchmark holds the goal:
p99 under 50 ms and no probe late during a 5 MB dry run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

# timed while a large apply runs: alone on the machine (tests/conftest.py)
pytestmark = pytest.mark.serial


def test_front_end_and_probes_keep_going_during_a_large_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "stall.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "apply_stall.py"),
            "--mb",
            "2",
            "--applies",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)
    result = json.loads(out.read_text())
    during = result["latency_during"]
    assert result["client_errors"] == 0
    assert during["n"] >= 50, during  # the front end kept answering throughout
    assert during["p99_ms"] < 250, during  # (the goal is 50 ms; this machine is shared)
    assert result["probes_started_during"] > 0
    assert result["probes_late_during"] <= max(2, 0.1 * result["probes_started_during"]), result
