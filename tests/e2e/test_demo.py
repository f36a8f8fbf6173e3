"""`healthgate demo` as a user runs it: start, break a region, watch, heal, Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.integration.serve_proc import wait_for
from tests.integration.servers import free_port


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "healthgate", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def test_demo_break_observe_heal_and_stop(tmp_path: Path) -> None:
    api_port, front, backend, producer = (
        free_port(),
        free_port(),
        free_port("127.0.1.1"),
        free_port("127.0.1.100"),
    )
    server = f"http://127.0.0.1:{api_port}"
    log = open(tmp_path / "demo.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "healthgate",
            "demo",
            "--listen",
            f"127.0.0.1:{api_port}",
            "--front-port",
            str(front),
            "--backend-port",
            str(backend),
            "--producer-port",
            str(producer),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:

        def region() -> str:
            try:
                return httpx.get(f"http://127.0.0.1:{front}/", timeout=5).text.split(" ")[0]
            except httpx.HTTPError:
                return ""

        wait_for(lambda: region() == "region=us-east1", 30, 0.2, "the demo serving from us-east1")
        out = cli("demo", "break", "us-east1", "--mode", "refuse", "--server", server)
        assert out.returncode == 0 and "3 endpoint(s) now refuse" in out.stdout, out.stderr
        # answers move at once (requests are retried in the next region), then the route follows
        wait_for(
            lambda: region() == "region=asia-east1",
            15,
            0.2,
            "answers from asia-east1 (next by name)",
        )
        wait_for(
            lambda: (
                "-> shop-asia-east1"
                in cli("get", "fr", "--project", "web", "--server", server).stdout
            ),
            15,
            0.3,
            "the route failing over",
        )
        status = cli("demo", "status", "--server", server)
        assert "us-east1: refuse" in status.stdout
        assert cli("demo", "heal", "us-east1", "--server", server).returncode == 0
        wait_for(lambda: region() == "region=us-east1", 15, 0.2, "failback")
        assert cli("demo", "break", "mars-north1", "--server", server).returncode == 1
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
        log.close()
    text = (tmp_path / "demo.log").read_text()
    assert rc == 0, text[-2000:]
    assert "failing over to shop-asia-east1" in text and "stopping the demo" in text
    # nothing left behind: no listener on any of the demo's ports
    assert not listening(api_port) and not listening(front)
    assert not listening(backend, "127.0.1.1") and not listening(producer, "127.0.1.100")
