"""`healthgate serve` as a real subprocess, for API, crash and restart tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from healthgate.client import KEEPALIVE
from tests.integration.servers import free_port


class ServeProcess:
    def __init__(
        self, db: Path, *extra: str, port: int | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.db = db
        self.env = env or {}
        self.port = port or free_port()
        self.extra = list(extra)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = db.with_suffix(f".{self.port}.log")

    def start(self, wait: bool = True) -> ServeProcess:
        cmd = [
            sys.executable,
            "-m",
            "healthgate",
            "serve",
            "--db",
            str(self.db),
            "--listen",
            f"127.0.0.1:{self.port}",
            "--probe-failure-log-rate",
            "0",
            *self.extra,
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        assert self.proc is not None
        wait_ready(self.proc, self.url, "serve", lambda: self.log.read_text()[-3000:], timeout)

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10.0, limits=KEEPALIVE)

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def describe_exit(code: int) -> str:
    """A return code as a person reads it: a signal by name."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def wait_ready(
    proc: subprocess.Popen[bytes],
    url: str,
    what: str,
    tail: Callable[[], str],
    timeout: float = 30.0,
    get: Callable[[str], httpx.Response] | None = None,
) -> None:
    """Until a healthgate process's ``/readyz`` at ``url`` answers 200 - the
    one wait every test that starts one uses. A process that exits first,
    or one not ready in ``timeout`` seconds, fails with its log's ``tail``.
    (``get``: how to ask, for a process in a network namespace.)"""
    ask = get or (lambda u: httpx.get(u, timeout=1.0))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise RuntimeError(f"{what} exited ({describe_exit(code)}):\n{tail()}")
        try:
            if ask(f"{url}/readyz").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout} s:\n{tail()}")


def wait_for(predicate: Any, timeout: float, interval: float = 0.1, what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy; bounded in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout} s")
