"""Helpers shared by the side-by-side benchmarks: pinned child processes,
free ports, and waiting for things, always bounded in time."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, children: bool = False) -> float:
    """utime + stime of ``pid`` from /proc (and of its live children, for a
    server whose workers are child processes, like nginx's)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:  # (a child that just exited)
        return 0.0
    total = (int(fields[11]) + int(fields[12])) / TICKS
    if children:
        total += sum(cpu_seconds(kid) for kid in _children(pid))
    return total


def _children(pid: int) -> list[int]:
    return [int(kid) for kid in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def rss_mb(pid: int, children: bool = False) -> float:
    """Resident memory (VmRSS) of ``pid`` in MB (and of its live children)."""
    total = 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total = int(line.split()[1]) / 1024
    except FileNotFoundError:  # (a child that just exited)
        return 0.0
    if children:
        total += sum(rss_mb(kid) for kid in _children(pid))
    return total


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pinned(cmd: list[str], cpu: int) -> list[str]:
    """Run ``cmd`` on one core (when taskset is there), so peers do not share it."""
    return ["taskset", "-c", str(cpu), *cmd] if shutil.which("taskset") else cmd


def wait_until(pred: Callable[[], object], timeout: float, what: str, every: float = 0.1) -> None:
    """Poll ``pred`` until it is true; TimeoutError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(every)
    raise TimeoutError(what)


def wait_port(port: int, host: str = "127.0.0.1", timeout: float = 30) -> None:
    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex((host, port)) == 0

    wait_until(listening, timeout, f"{host}:{port} not listening", every=0.05)


class Proc:
    """A child process with its output in a log file; stopped by its own PID only."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log = open(log, "wb")  # noqa: SIM115 - lives as long as the process
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(15)
        self.log.close()


@contextmanager
def backend_endpoints(
    count: int,
    base_port: int,
    work: Path,
    host: str = "127.0.0.1",
    nice: int = 0,
    tls: Path | None = None,
) -> Iterator[Proc]:
    """bench/backends.py holding ``count`` HTTP endpoints on 127.0.0.1 from
    ``base_port``, pinned to core 1 (at a lower priority with ``nice``), once it says it is ready (an error with
    its log if it dies first); stopped on the way out."""
    log = work / "backends.log"
    script = Path(__file__).resolve().parent / "backends.py"
    cmd = [sys.executable, str(script), "--count", str(count), "--base-port", str(base_port)]
    cmd += ["--host", host]
    if tls is not None:
        cmd += ["--tls", str(tls)]
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    backend = Proc(pinned(cmd, 1), log)

    def ready() -> bool:
        if backend.p.poll() is not None:
            raise RuntimeError(f"the backend process failed:\n{log.read_text()[-2000:]}")
        return b"\nready\n" in b"\n" + log.read_bytes()

    try:
        wait_until(ready, 120, "backends ready")
        yield backend
    finally:
        backend.stop()
