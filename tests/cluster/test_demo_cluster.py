"""``healthgate demo --cluster`` as a user runs it: 3 etcd members and a node
per region come up, a killed node's endpoints move, Ctrl-C removes it all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.serve_proc import wait_for
from tests.integration.servers import free_port

pytestmark = pytest.mark.cluster


def _api_port() -> int:
    """A port that is free with the two the other nodes take (+10, +20)."""
    for _ in range(50):
        port = free_port()
        if port + 20 < 65536 and all(_free(port + d) for d in (10, 20)):
            return port
    raise RuntimeError("no free API ports")


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_demo_cluster_comes_up_moves_a_dead_nodes_endpoints_and_cleans_up(
    tmp_path: Path,
) -> None:
    api = _api_port()
    front, backend, producer = free_port(), free_port("127.0.1.1"), free_port("127.0.1.100")
    log_path = tmp_path / "demo.log"
    cmd = [
        sys.executable, "-m", "healthgate", "demo", "--cluster",
        "--listen", f"127.0.0.1:{api}", "--front-port", str(front),
        "--backend-port", str(backend), "--producer-port", str(producer),
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{api}"

    def cluster() -> Any:
        try:
            return httpx.get(url + "/v1/cluster", timeout=2).json()
        except httpx.HTTPError:
            return None

    try:
        status = wait_for(
            lambda: (c := cluster()) and len(c["members"]) == 3 and c,
            60,
            what="3 nodes",
        )
        assert status["leader"] in ("a", "b", "c")
        text = log_path.read_text()
        pid = int(text.split("node b (europe-west1): API ")[1].split("pid ")[1].split()[0])
        os.kill(pid, signal.SIGKILL)
        # node b's europe-west1 endpoints move to the others
        wait_for(
            lambda: (c := cluster()) and "b" not in c["members"],
            15,
            what="node b gone",
        )
        body = httpx.get(url + "/", timeout=2, follow_redirects=False)
        assert body.status_code in (200, 307)
        assert httpx.get(f"http://127.0.0.1:{front}/", timeout=5).text.startswith("region=")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    out = log_path.read_text()
    assert "Cluster mode: 3 etcd members" in out and "Traceback" not in out
    left = subprocess.run(
        ["pgrep", "-f", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert not left.stdout.strip()
    etcd_left = subprocess.run(
        ["pgrep", "-af", "healthgate-demo-"], capture_output=True, text=True, check=False
    )
    assert "etcd" not in etcd_left.stdout, etcd_left.stdout
