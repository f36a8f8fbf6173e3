"""serve under systemd's Type=notify, without systemd: this test plays the
notify socket (NOTIFY_SOCKET) and reads what a real serve tells it - READY=1
only once the API answers, WATCHDOG=1 from the event loop (none while the
loop is blocked), RELOADING/READY around SIGHUP, STOPPING=1 on stop - and
checks the shipped unit files with ``systemd-analyze verify`` where it exists."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from healthgate.runtime.systemd import Notifier
from tests.integration.serve_proc import ServeProcess

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"


class NotifySocket:
    """systemd's end: a UNIX datagram socket and the messages with their times."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[tuple[float, str]] = []

    def read(self, timeout: float) -> list[str]:
        """Messages arriving within ``timeout`` seconds (each a list of fields)."""
        deadline = time.monotonic() + timeout
        got: list[str] = []
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                break
            text = data.decode()
            self.messages.append((time.monotonic(), text))
            got.append(text)
        return got

    def until(self, field: str, timeout: float) -> float:
        """Read until a message with ``field`` arrives: its time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                break
            now = time.monotonic()
            self.messages.append((now, data.decode()))
            if field in data.decode().split("\n"):
                return now
        raise TimeoutError(f"no {field} within {timeout} s: {self.messages[-5:]}")

    def close(self) -> None:
        self.sock.close()


def test_ready_watchdog_reload_and_stopping(tmp_path: Path) -> None:
    notify = NotifySocket(tmp_path / "notify.sock")
    env = {
        "NOTIFY_SOCKET": str(notify.path),
        "WATCHDOG_USEC": "400000",  # WatchdogSec=0.4: a ping every 0.2 s
        "HEALTHGATE_DEBUG_BLOCK_ON_USR2": "1.5",
    }
    serve = ServeProcess(tmp_path / "s.db", env=env)
    try:
        serve.start(wait=False)
        # READY=1 comes once the API answers: the very next request is served
        notify.until("READY=1", 30)
        assert httpx.get(f"{serve.url}/readyz", timeout=2).status_code == 200
        ready = next(m for _, m in notify.messages if "READY=1" in m.split("\n"))
        assert "MAINPID=" in ready and "STATUS=serving on" in ready
        # the watchdog pings from the event loop, every half interval
        pings = [m for m in notify.read(1.0) if m == "WATCHDOG=1"]
        assert 3 <= len(pings) <= 8, pings
        # a blocked loop sends nothing - so systemd would restart it
        assert serve.proc is not None
        serve.proc.send_signal(signal.SIGUSR2)
        notify.read(0.3)  # (the signal reaches the loop)
        blocked_from = time.monotonic()
        notify.read(1.0)
        silent = [t for t, m in notify.messages if m == "WATCHDOG=1" and t > blocked_from]
        assert silent == [], "pings while the loop was blocked"
        notify.until("WATCHDOG=1", 3)  # and they come back with the loop
        # SIGHUP: RELOADING=1, then READY=1 with what was done
        serve.proc.send_signal(signal.SIGHUP)
        notify.until("RELOADING=1", 5)
        notify.until("READY=1", 5)
        # stopping
        serve.proc.send_signal(signal.SIGTERM)
        notify.until("STOPPING=1", 5)
        assert serve.proc.wait(15) == 0
    finally:
        serve.stop()
        notify.close()


def test_the_notifier_reads_its_environment() -> None:
    assert not Notifier.from_env({}).enabled  # not under systemd: every call a no-op
    Notifier.from_env({}).ready("x")
    abstract = Notifier.from_env({"NOTIFY_SOCKET": "@hg-test", "WATCHDOG_USEC": "2000000"})
    assert abstract.enabled and abstract.watchdog == 2.0
    # a watchdog meant for another process (WATCHDOG_PID) is not ours
    other = Notifier.from_env({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "1"})
    assert other.watchdog == 0.0
    assert Notifier.from_env({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "soon"}).watchdog == 0.0


def test_an_abstract_socket_is_reached(tmp_path: Path) -> None:
    name = f"hg-notify-test-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    try:
        notifier = Notifier(f"@{name}")
        notifier.send("STATUS=hello")
        assert sock.recv(100) == b"STATUS=hello"
        notifier.close()
    finally:
        sock.close()


def test_a_notify_socket_that_is_gone_stops_nothing(tmp_path: Path) -> None:
    notifier = Notifier(str(tmp_path / "nobody.sock"))
    notifier.send("STATUS=x")  # (logged once, never raised)
    notifier.send("STATUS=y")
    assert notifier._failed


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
@pytest.mark.parametrize("unit", ["healthgate.service", "healthgate-node.service"])
def test_the_units_verify(tmp_path: Path, unit: str) -> None:
    """``systemd-analyze verify`` on the shipped units, their ExecStart
    pointed at this checkout's healthgate (the units say /usr/local/bin)."""
    binary = shutil.which("healthgate") or str(
        Path(__file__).resolve().parents[2] / ".venv/bin/healthgate"
    )
    text = (UNITS / unit).read_text().replace("/usr/local/bin/healthgate", binary)
    (tmp_path / unit).write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(tmp_path / unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    problems = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if line.strip() and "Failed to connect to bus" not in line
    ]
    assert done.returncode == 0 and not problems, done.stdout + done.stderr
