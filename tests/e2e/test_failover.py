"""Whole failovers: real backends in two regions, real `healthgate serve`, real clients.

The preferred region (us-east1, local to the front end) is made to refuse,
hang or answer 503; traffic must move within the failure window (plus one
interval of probe phase and a small margin), come back within the success
window after it heals, and a client sending idempotent requests throughout
must see no error at all.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from healthgate.health.windows import failure_window, success_window
from tests.e2e.harness import Backends, e2e_world, ports
from tests.integration.serve_proc import ServeProcess, wait_for

FRONT = "/v1/projects/web/global/forwardingRules/shop-frontend"
INTERVAL, TIMEOUT, THRESHOLD = 1, 1, 2
MARGIN = 0.6
PHASE = INTERVAL  # a fault can land anywhere in a probe cycle


class Stack:
    def __init__(
        self,
        tmp: Path,
        *serve_args: str,
        prod: tuple[int, int] | None = None,
        **policy: Any,
    ) -> None:
        self.port, self.front, self.prod = ports()
        if prod is not None:
            self.prod = prod  # the producer rules' ports, region by region
        self.backends = Backends(self.port)
        self.proc = ServeProcess(tmp / "e2e.db", "--per-try-timeout", "0.4", *serve_args)
        self.policy = policy

    def __enter__(self) -> Stack:
        self.backends.__enter__()
        self.proc.start()
        self.api = self.proc.client()
        world = e2e_world(self.port, self.front, self.prod, **self.policy)
        self.apply(world)
        wait_for(
            lambda: (
                self.neg_state("us-east1") == "HEALTHY"
                and self.neg_state("europe-west1") == "HEALTHY"
            ),
            15,
            what="both regions HEALTHY",
        )
        return self

    def world(self) -> list[dict[str, Any]]:
        return e2e_world(self.port, self.front, self.prod, **self.policy)

    def apply(self, docs: list[dict[str, Any]]) -> None:
        self.api.post("/v1/apply", json={"manifest": yaml.safe_dump_all(docs)}).raise_for_status()

    def __exit__(self, *exc: Any) -> None:
        self.api.close()
        self.proc.stop()
        self.backends.__exit__()

    def use_front_protocol(self, protocol: str) -> None:
        """Re-apply the world with the consumer front end speaking TCP or UDP
        (UDP: every backend service and rule too), and wait for its listener."""
        from tests.e2e.harness import e2e_world

        docs = e2e_world(self.port, self.front, self.prod, **self.policy)
        for d in docs:
            if d["kind"] == "BackendService" and (protocol == "UDP" or d["project"] == "web"):
                d["protocol"] = protocol
            if d["kind"] == "ForwardingRule" and protocol == "UDP":
                d["IPProtocol"] = "UDP"
        self.apply(docs)
        layer = protocol.lower()
        wait_for(
            lambda: self.api.get(FRONT).json()["status"]["listener"]["layer"] == layer,
            10,
            what=f"{layer} listener",
        )

    def neg_state(self, region: str) -> str:
        neg = "shop-us" if region == "us-east1" else "shop-eu"
        return str(
            self.api.get(f"/v1/projects/web/regions/{region}/networkEndpointGroups/{neg}").json()[
                "status"
            ]["healthState"]
        )

    def route(self) -> dict[str, Any]:
        return dict(self.api.get(FRONT).json()["status"]["route"])

    def routed_region(self) -> str | None:
        target = self.route()["target"]
        return (
            None
            if target is None
            else ("us-east1" if target.endswith("/shop-us") else "europe-west1")
        )


class Client:
    """Sends GET requests through the front end until stopped; bounded.

    With ``plain``, over one kept-alive socket with no header but ``Host``
    (the front end's fast path, docs/dataplane.md); else with httpx, whose
    ``Connection: keep-alive`` header takes the general path."""

    def __init__(self, port: int, max_requests: int = 20_000, plain: bool = False) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}/"
        self.results: list[tuple[float, int, str]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.max = max_requests
        self.thread = threading.Thread(target=self._run_plain if plain else self._run, daemon=True)

    def _run_plain(self) -> None:
        sock: socket.socket | None = None
        buf = b""
        while not self.stop.is_set() and len(self.results) < self.max:
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                    buf = b""
                sock.sendall(b"GET / HTTP/1.1\r\nHost: front\r\n\r\n")
                while b"\r\n\r\n" not in buf:
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise ConnectionError("closed by the front end")
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(buf) < length:
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise ConnectionError("closed mid-response")
                    buf += chunk
                body, buf = buf[:length].decode(), buf[length:]
                status = int(head.split(b" ")[1])
                self.results.append((time.monotonic(), status, body.split(" ")[0]))
                if status != 200:
                    self.errors.append(f"{status}: {body.strip()}")
            except (OSError, ValueError, IndexError) as exc:
                self.errors.append(repr(exc))
                if sock is not None:
                    sock.close()
                sock = None
            time.sleep(0.02)
        if sock is not None:
            sock.close()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as c:
            while not self.stop.is_set() and len(self.results) < self.max:
                try:
                    r = c.get(self.url)
                    self.results.append((time.monotonic(), r.status_code, r.text.split(" ")[0]))
                    if r.status_code != 200:
                        self.errors.append(f"{r.status_code}: {r.text.strip()}")
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                time.sleep(0.02)

    def __enter__(self) -> Client:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(15)


@dataclass
class Episode:
    """One region broken then healed under a client's steady requests (times
    from time.monotonic)."""

    client: Client
    broke: float
    moved: float  # from the break to the route leaving the region
    healed: float
    back: float  # from the heal to the route returning

    def regions_during(self, margin: float) -> list[str]:
        t0, t1 = self.broke + self.moved + margin, self.healed
        return [region for t, _, region in self.client.results if t0 < t < t1]

    def regions_after(self, margin: float) -> list[str]:
        t0 = self.healed + self.back + margin
        return [region for t, _, region in self.client.results if t > t0]


def break_and_heal(
    stack: Stack, mode: str, fail_within: float, settle: float, plain: bool = False
) -> Episode:
    """Break us-east1 in ``mode`` while a client sends GETs, wait for the
    route to move, heal it, wait for the route to come back."""
    with Client(stack.front, plain=plain) as client:
        time.sleep(0.5)
        broke = time.monotonic()
        stack.backends.set_mode("us-east1", mode)
        wait_for(lambda: stack.routed_region() == "europe-west1", fail_within, 0.02, "failover")
        moved = time.monotonic() - broke
        time.sleep(settle)
        healed = time.monotonic()
        stack.backends.set_mode("us-east1", "ok")
        wait_for(lambda: stack.routed_region() == "us-east1", 10, 0.02, "failback")
        back = time.monotonic() - healed
        time.sleep(settle)
    return Episode(client, broke, moved, healed, back)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with Stack(tmp_path) as s:
        yield s


@pytest.mark.parametrize("client_kind", ["httpx", "plain"])
@pytest.mark.parametrize(
    ("mode", "window"),
    [
        ("refuse", failure_window(0, INTERVAL, THRESHOLD)),
        ("hang", failure_window(TIMEOUT, INTERVAL, THRESHOLD)),
        ("503", failure_window(0, INTERVAL, THRESHOLD)),
    ],
)
def test_failover_and_failback_with_no_client_error(
    stack: Stack, mode: str, window: float, client_kind: str
) -> None:
    """Both request paths of the front end: httpx's requests take the general
    path, the plain client's the fast path (checked on the metrics)."""
    assert stack.routed_region() == "us-east1"
    ep = break_and_heal(stack, mode, window + PHASE + 5, settle=0.5, plain=client_kind == "plain")
    client, moved, back = ep.client, ep.moved, ep.back
    assert client.errors == [], client.errors[:5]
    assert len(client.results) > 50
    assert moved <= window + PHASE + MARGIN, (mode, moved, window)
    assert back <= success_window(0.01, INTERVAL, THRESHOLD) + PHASE + MARGIN, back
    # traffic really moved: answers from europe-west1 while us-east1 was broken, us-east1 again after
    during = ep.regions_during(0.1)
    after = ep.regions_after(0.2)
    assert during and set(during) == {"region=europe-west1"}
    assert after and set(after) == {"region=us-east1"}
    fast = fast_path_requests(stack)
    if client_kind == "plain":
        assert fast > len(ep.client.results) / 2, fast
    else:
        assert fast == 0, fast
    # SPEC §11: this process's listeners applied the failback at once
    status = stack.api.get(FRONT).json()["status"]
    (receipt,) = status["convergence"]
    assert (receipt["dataPlane"], receipt["instance"]) == ("healthgate", "serve"), receipt
    assert receipt["appliedAfterMs"] < 50 and status["decision"]["decision"].endswith("-> shop-us")


def fast_path_requests(stack: Stack) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in stack.api.get("/metrics").text.splitlines()
        if line.startswith("healthgate_listener_events_total{") and 'event="fast_path"' in line
    )


def test_dry_run_moves_nothing(stack: Stack) -> None:
    from tests.e2e.harness import e2e_world as world

    docs = world(stack.port, stack.front, stack.prod)
    for d in docs:
        if d["kind"] == "CompositeHealthCheck" and d["region"] == "us-east1":
            d["mode"] = "DRY_RUN"
    stack.apply(docs)
    assert stack.neg_state("us-east1") == "UNKNOWN"
    stack.backends.set_mode("us-east1", "refuse")
    composite = "/v1/projects/shop/regions/us-east1/compositeHealthChecks/web-composite"
    wait_for(
        lambda: stack.api.get(composite).json()["status"]["healthState"] == "UNHEALTHY",
        10,
        what="composite evaluated",
    )
    time.sleep(1.0)
    assert stack.routed_region() == "us-east1"  # evaluated and logged, but nothing moved
    events = stack.api.get(
        "/v1/projects/shop/events", params={"kind": "CompositeHealthCheck", "state": "UNHEALTHY"}
    ).json()
    assert events["items"]


def test_fail_closed_refuses_when_every_region_is_down(tmp_path: Path) -> None:
    with Stack(tmp_path, whenAllUnhealthy="FAIL_CLOSED") as s:
        s.backends.set_mode("us-east1", "refuse")
        s.backends.set_mode("europe-west1", "refuse")
        wait_for(lambda: s.route()["mode"] == "fail-closed", 10, what="fail closed")
        r = httpx.get(f"http://127.0.0.1:{s.front}/", timeout=5)
        assert r.status_code == 503 and "no region may receive traffic" in r.text
        s.backends.set_mode("europe-west1", "ok")
        wait_for(lambda: s.routed_region() == "europe-west1", 10, what="recovery to europe-west1")
        assert httpx.get(f"http://127.0.0.1:{s.front}/", timeout=5).text.startswith(
            "region=europe-west1"
        )


def test_fail_open_keeps_the_first_region(stack: Stack) -> None:
    stack.backends.set_mode("us-east1", "503")
    stack.backends.set_mode("europe-west1", "503")
    wait_for(lambda: stack.route()["mode"] == "fail-open", 10, what="fail open")
    assert stack.routed_region() == "us-east1"
    r = httpx.get(f"http://127.0.0.1:{stack.front}/", timeout=5)
    assert r.status_code in (502, 503)  # traffic still flows; the backends answer 503


def test_tcp_front_end_fails_over_new_connections(tmp_path: Path) -> None:
    with Stack(tmp_path) as s:
        s.use_front_protocol("TCP")

        def ask() -> str:
            with socket.create_connection(("127.0.0.1", s.front), timeout=5) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                sock.shutdown(socket.SHUT_WR)  # half-close: the answer must still come back
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
            assert b"\r\n\r\n" in data, data
            return data.decode().split("\r\n\r\n", 1)[1].split(" ")[0]

        assert ask() == "region=us-east1"
        s.backends.set_mode("us-east1", "refuse")
        wait_for(lambda: s.routed_region() == "europe-west1", 10, what="failover")
        assert ask() == "region=europe-west1"


def test_udp_sessions_fail_over(tmp_path: Path) -> None:
    from tests.e2e.harness import start_udp_echo

    with Stack(tmp_path) as s:
        echoes = start_udp_echo(s.backends)
        s.use_front_protocol("UDP")

        def ask(payload: bytes) -> str:
            with socket.socket(
                socket.AF_INET, socket.SOCK_DGRAM
            ) as sock:  # a new socket: a new session
                sock.settimeout(2)
                sock.sendto(payload, ("127.0.0.1", s.front))
                data, _ = sock.recvfrom(65536)
                return data.decode()

        assert ask(b"ping") == "region=us-east1 ping"
        s.backends.set_mode("us-east1", "refuse")  # health checks (HTTP) fail: the route moves
        wait_for(lambda: s.routed_region() == "europe-west1", 10, what="failover")
        assert ask(b"pong") == "region=europe-west1 pong"
        for t in echoes:
            s.backends.loop.call_soon_threadsafe(t.close)


@pytest.mark.parametrize("drain", [False, True])
def test_open_tcp_connections_are_kept_or_drained_on_failover(tmp_path: Path, drain: bool) -> None:
    args = ("--drain-on-failover",) if drain else ()
    with Stack(tmp_path, *args) as s:
        s.use_front_protocol("TCP")
        with socket.create_connection(("127.0.0.1", s.front), timeout=5) as sock:
            sock.sendall(
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
            )  # keep-alive: the connection stays open
            assert b"region=us-east1" in sock.recv(65536)
            s.backends.set_mode("us-east1", "503")  # its checks fail; its open connections live on
            wait_for(lambda: s.routed_region() == "europe-west1", 10, what="failover")
            time.sleep(0.3)
            sock.settimeout(3)
            if drain:
                assert sock.recv(65536) == b""  # closed by healthgate
            else:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                assert b"503" in sock.recv(65536)  # still connected to us-east1, by default
