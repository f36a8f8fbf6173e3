"""The demo as the browser tests run it: one process, its ports, its log."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.integration.serve_proc import wait_ready
from tests.integration.servers import free_port


@dataclass(frozen=True)
class Demo:
    url: str  # the API and the dashboard
    front: int  # the consumer front end's port (the demo's traffic goes there)


@contextlib.contextmanager
def running_demo(tmp_path: Path) -> Iterator[Demo]:
    """``healthgate demo`` on free loopback ports, ready; stopped with
    Ctrl-C (SIGINT) as a person would, whatever the test did."""
    api, front = free_port(), free_port()
    log_path = tmp_path / "demo.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "healthgate", "demo", "--listen", f"127.0.0.1:{api}",
             "--front-port", str(front), "--backend-port", str(free_port("127.0.1.1")),
             "--producer-port", str(free_port("127.0.1.100"))],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{api}"
            wait_ready(proc, url, "the demo", lambda: log_path.read_text()[-3000:])
            yield Demo(url, front)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
