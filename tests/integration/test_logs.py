"""``serve --log-format json``: every line serve and its probe workers write
is one JSON object with time, level, logger and message, and a transition's
fields sit beside them - what a log shipper indexes without parsing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers import EXAMPLE
from tests.integration.serve_proc import wait_for
from tests.integration.servers import free_port


def objects(text: str) -> list[dict[str, Any]]:
    lines = [line for line in text.splitlines() if line.strip()]
    out = []
    for line in lines:
        obj = json.loads(line)  # (every line: a JSON object, nothing else)
        assert isinstance(obj, dict), line
        out.append(obj)
    return out


def test_json_logs_from_serve_and_its_workers(tmp_path: Path) -> None:
    port = free_port()
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    cmd = [
        sys.executable, "-m", "healthgate", "serve", "--db", str(tmp_path / "s.db"),
        "--listen", f"127.0.0.1:{port}", "-f", str(EXAMPLE), "--no-dataplane",
        "--probe-workers", "1", "--log-format", "json", "--log-level", "debug",
    ]  # fmt: skip
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            cmd, stdout=o, stderr=e, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    try:
        # the example's endpoints refuse: transitions come within a few probes
        wait_for(lambda: "UNHEALTHY" in out.read_text(), 30, what="a transition")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    logged = objects(err.read_text())
    assert logged and all({"time", "level", "logger", "message"} <= set(o) for o in logged)
    assert all(o["time"].endswith("Z") for o in logged)
    assert any(o.get("worker") == "probe-worker[0]" for o in logged), "no worker line"
    transitions = objects(out.read_text())
    assert transitions
    t = next(o for o in transitions if o.get("kind") == "Endpoint" and o["to"] == "UNHEALTHY")
    assert t["logger"] == "healthgate.transitions" and t["level"] == "INFO"
    assert {"project", "region", "name", "path", "from", "to", "reason"} <= set(t)
    assert t["path"] in t["message"] and "-> UNHEALTHY" in t["message"]
