"""The benchmarks keep working: run them tiny (no timing is asserted here)."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def test_engine_bench_runs_small(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "engine.py"),
            "--sizes",
            "2000",
            "--results",
            "20000",
            "--flips",
            "50",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())
    assert row["endpoints"] == 2000
    assert row["cascades"] == 50  # every first failure of a 100 % policy cascades to the route
    assert "results/s vs goal" in proc.stdout


def test_replay_bench_runs_small(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "replay.py"),
            "--endpoints",
            "400",
            "--hours",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert figures["endpoints"] == 400 and figures["bytes"]["steady"] < 2048
    # the one-hour outage of region-0 came and went: its routes moved and came back
    assert figures["routeChanges"] > 0 and figures["resultsFed"] < figures["resultsRecorded"]


def test_placement_bench_runs_small() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "placement.py"), "--endpoints", "2000"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "2,000 endpoints, 4 nodes" in proc.stdout and "a node leaving" in proc.stdout
