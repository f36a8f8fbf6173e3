"""A stop that always stops (runtime/lifecycle.py): `healthgate serve` with
traffic in flight, requests hung at an upstream, open event streams and a
half-sent request head, stopped by SIGTERM or SIGINT twelve times in a row;
a signal during start-up; a second signal while the stop waits."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import yaml

from tests.e2e.harness import Backends, e2e_world, ports
from tests.e2e.test_workers import children
from tests.integration.serve_proc import ServeProcess, wait_for

STOPS = 12  # (six of each signal; twenty took two minutes of the suite)
STOP_BOUND = 8.0  # seconds: grace (1 s) + every step's own work, with room for a busy machine


class Traffic:
    """GETs through the front end on one kept-alive connection, until stopped."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.is_set():
                try:
                    client.get(f"http://127.0.0.1:{self.port}/")
                    self.answers += 1
                except httpx.HTTPError:
                    time.sleep(0.01)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@contextmanager
def held_open(s: ServeProcess, hung_rule: int) -> Iterator[list[socket.socket]]:
    """What a stop must not wait for: an event stream, a request the upstream
    never answers (through a producer rule to a hanging region), a request
    head that never completes."""
    socks = []
    try:
        stream = socket.create_connection(("127.0.0.1", s.port), timeout=5)
        stream.sendall(
            f"GET /v1/projects/shop/events/stream HTTP/1.1\r\nHost: 127.0.0.1:{s.port}\r\n\r\n".encode()
        )
        assert stream.recv(4096).startswith(b"HTTP/1.1 200"), "the event stream opened"
        socks.append(stream)
        hung = socket.create_connection(("127.0.1.100", hung_rule), timeout=5)  # us-east1
        hung.sendall(b"GET /slow HTTP/1.1\r\nHost: backend\r\n\r\n")
        socks.append(hung)
        partial = socket.create_connection(("127.0.0.1", s.port), timeout=5)
        partial.sendall(b"POST /v1/apply HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        socks.append(partial)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def stop_and_time(s: ServeProcess, sig: int) -> tuple[float, int]:
    assert s.proc is not None
    started = time.monotonic()
    s.proc.send_signal(sig)
    try:
        code = s.proc.wait(STOP_BOUND * 3)
    except subprocess.TimeoutExpired:
        s.proc.kill()
        raise AssertionError(f"no exit after {sig}:\n{s.log.read_text()[-4000:]}") from None
    return time.monotonic() - started, code


def test_twelve_stops_in_a_row_under_traffic_hung_requests_and_streams(tmp_path: Path) -> None:
    port, front, prod = ports()
    with Backends(port) as backends:
        s = ServeProcess(tmp_path / "stop.db", "--stop-grace", "1", "--per-try-timeout", "0.5")
        s.start()
        try:
            with s.client() as api:
                world = e2e_world(port, front, prod)
                api.post("/v1/apply", json={"manifest": yaml.safe_dump_all(world)})
            backends.set_mode("us-east1", "hang")  # its producer rule's requests hang
            durations = []
            for i in range(STOPS):
                if i:
                    s.start()  # the same store: the world and its states resume
                with ExitStack() as held:
                    traffic = held.enter_context(Traffic(front))
                    held.enter_context(held_open(s, prod[0]))
                    wait_for(lambda t=traffic: t.answers >= 3, 15, what="traffic flowing")
                    assert s.proc is not None
                    workers = children(s.proc.pid)
                    sig = signal.SIGTERM if i % 2 else signal.SIGINT
                    took, code = stop_and_time(s, sig)
                assert code == 0, s.log.read_text()[-3000:]
                assert took < STOP_BOUND, f"stop {i + 1} took {took:.1f} s"
                wait_for(
                    lambda w=workers: not [p for p in w if Path(f"/proc/{p}/cmdline").exists()],
                    3,
                    what=f"serve's children gone: {workers}",
                )
                durations.append(took)
            text = s.log.read_text()
            assert text.count("received SIGTERM") == STOPS // 2
            assert text.count("received SIGINT") == STOPS // 2
            assert text.count("stopped in ") == STOPS
            print(f"{STOPS} stops: max {max(durations):.2f} s, mean {sum(durations) / STOPS:.2f} s")
        finally:
            s.stop()


def test_a_signal_during_start_up_stops_what_was_started(tmp_path: Path) -> None:
    s = ServeProcess(tmp_path / "early.db")
    s.start(wait=False)
    assert s.proc is not None
    # as soon as serve says it is starting (before the store, the probes and the API)
    wait_for(lambda: "starting: store" in s.log.read_text(), 30, 0.005, what="start-up")
    took, code = stop_and_time(s, signal.SIGTERM)
    text = s.log.read_text()
    assert code == 0, text[-3000:]
    assert "received SIGTERM while starting" in text, text[-3000:]
    assert "stopped in " in text
    assert took < STOP_BOUND
    with socket.socket() as probe:  # nothing is left listening
        assert probe.connect_ex(("127.0.0.1", s.port)) != 0


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    port, front, prod = ports()
    with Backends(port) as backends:
        s = ServeProcess(tmp_path / "twice.db", "--stop-grace", "60")
        s.start()
        try:
            with s.client() as api:
                api.post(
                    "/v1/apply", json={"manifest": yaml.safe_dump_all(e2e_world(port, front, prod))}
                )
            backends.set_mode("us-east1", "hang")
            with held_open(s, prod[0]):
                assert s.proc is not None
                s.proc.send_signal(signal.SIGTERM)
                wait_for(
                    lambda: "stopping: the listeners" in s.log.read_text(),
                    10,
                    what="the stop waiting on the hung connection",
                )
                time.sleep(0.2)  # well inside the 60 s grace
                took, code = stop_and_time(s, signal.SIGTERM)
            assert code == 128 + signal.SIGTERM, s.log.read_text()[-3000:]
            assert took < 2.0, took
            assert "second signal (SIGTERM)" in s.log.read_text()
        finally:
            s.stop()
