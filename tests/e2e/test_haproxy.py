"""A real HAProxy (Debian's) follows healthgate through its agent-check:
the configuration is what `healthgate export haproxy` prints; traffic
through HAProxy moves when a region breaks, comes back when it heals, all
regions down follows whenAllUnhealthy, and HAProxy keeps its last state
while healthgate is stopped."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import break_and_time, region_at
from tests.e2e.test_failover import Stack
from tests.helpers import run_cli
from tests.integration.serve_proc import wait_for
from tests.integration.servers import free_port

pytestmark = pytest.mark.skipif(
    shutil.which("haproxy") is None, reason="needs Debian's haproxy (make test installs it)"
)

FRONT = "shop-frontend"


class HAProxy:
    def __init__(self, tmp: Path, backend_section: str) -> None:
        self.port = free_port()
        self.sock = tmp / "haproxy.sock"
        self.cfg = tmp / "haproxy.cfg"
        self.cfg.write_text(
            "global\n"
            f"    stats socket {self.sock} level admin\n"
            "defaults\n"
            "    mode http\n"
            "    timeout connect 1s\n"
            "    timeout client 5s\n"
            "    timeout server 5s\n"
            "frontend fe\n"
            f"    bind 127.0.0.1:{self.port}\n"
            "    default_backend shop-frontend\n" + backend_section
        )
        self.log = tmp / "haproxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> HAProxy:
        check = subprocess.run(
            ["haproxy", "-c", "-f", str(self.cfg)], capture_output=True, text=True, check=False
        )
        assert check.returncode == 0, check.stdout + check.stderr
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["haproxy", "-db", "-f", str(self.cfg)], stdout=log, stderr=subprocess.STDOUT
            )
        wait_for(self.sock.exists, 10, what="haproxy's stats socket")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)

    def _rows(self) -> list[dict[str, str]]:
        """This backend's server rows of HAProxy's own ``show stat``."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(self.sock))
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        lines = data.decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = (dict(zip(header, line.split(","), strict=False)) for line in lines[1:])
        return [
            row
            for row in rows
            if row.get("pxname") == FRONT and row.get("svname") not in ("FRONTEND", "BACKEND")
        ]

    def servers(self) -> dict[str, str]:
        """Each server's status (UP, DOWN or MAINT) from HAProxy's own stats."""
        # an agent-only server reads "no check" while up, "DOWN (agent)" when down
        return {
            row["svname"]: next((s for s in ("DOWN", "MAINT") if row["status"].startswith(s)), "UP")
            for row in self._rows()
        }

    def statuses(self) -> dict[str, str]:
        """Each server's status as HAProxy's stats spell it (``DRAIN``, ...)."""
        return {row["svname"]: row["status"] for row in self._rows()}

    def weights(self) -> dict[str, int]:
        """Each server's current weight (the agent's answers change it)."""
        return {row["svname"]: int(row["weight"]) for row in self._rows()}

    def region_served(self) -> str | None:
        return region_at(f"http://127.0.0.1:{self.port}/")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Stack, HAProxy, int]]:
    agent_port = free_port()
    with Stack(tmp_path, "--agent", f"127.0.0.1:{agent_port}") as st:
        resp = st.api.get(f"/v1/projects/web/global/forwardingRules/{FRONT}/haproxy")
        assert resp.status_code == 200, resp.text
        section = resp.text
        # the CLI prints the same section
        cli = run_cli("export", "haproxy", FRONT, "--project", "web", "--server", st.proc.url)
        assert cli.returncode == 0 and cli.stdout == section, cli.stderr
        # one server per region, in failover order: us-east1 (local) first
        servers = [
            line.split() for line in section.splitlines() if line.strip().startswith("server")
        ]
        assert [s[1] for s in servers] == ["shop-us", "shop-eu"]
        assert "backup" not in servers[0] and "backup" in servers[1]
        assert f"agent-port {agent_port}" in section
        with HAProxy(tmp_path, section) as hp:
            wait_for(lambda: hp.servers() == {"shop-us": "UP", "shop-eu": "UP"}, 10, what="UP")
            yield st, hp, agent_port


def test_traffic_through_haproxy_fails_over_and_back(stack: tuple[Stack, HAProxy, int]) -> None:
    st, hp, _ = stack
    assert wait_for(lambda: hp.region_served() == "us-east1", 10, what="us-east1 served")
    decided, moved = break_and_time(st.neg_state, st.backends.set_mode, hp.region_served)
    print(
        f"failover: healthgate decided {decided:.2f} s after the break, HAProxy moved {moved:.2f} s later"
    )
    assert moved < 2.5  # agent-inter 1 s, plus a check's round trip
    st.backends.set_mode("us-east1", "ok")
    wait_for(lambda: st.neg_state("us-east1") == "HEALTHY", 15, what="us-east1 HEALTHY")
    healed = time.monotonic()
    wait_for(lambda: hp.region_served() == "us-east1", 10, interval=0.05, what="failback")
    print(f"failback: HAProxy moved {time.monotonic() - healed:.2f} s after healthgate")


def test_all_regions_down_follows_when_all_unhealthy(stack: tuple[Stack, HAProxy, int]) -> None:
    st, hp, _ = stack
    for region in ("us-east1", "europe-west1"):
        st.backends.set_mode(region, "refuse")
    wait_for(
        lambda: st.neg_state("us-east1") == "UNHEALTHY" == st.neg_state("europe-west1"),
        15,
        what="both UNHEALTHY",
    )
    # FAIL_OPEN (the example's policy): the first region keeps the traffic
    wait_for(lambda: hp.servers() == {"shop-us": "UP", "shop-eu": "DOWN"}, 5, what="fail open")
    world = [d for d in st.world() if d["kind"] == "BackendService" and d["project"] == "web"]
    world[0]["failoverPolicy"] = {"whenAllUnhealthy": "FAIL_CLOSED"}
    st.apply(world)
    wait_for(lambda: hp.servers() == {"shop-us": "DOWN", "shop-eu": "DOWN"}, 5, what="closed")


def test_haproxy_keeps_its_last_state_while_healthgate_is_stopped(
    stack: tuple[Stack, HAProxy, int],
) -> None:
    st, hp, _ = stack
    st.backends.set_mode("us-east1", "refuse")
    wait_for(lambda: hp.servers() == {"shop-us": "DOWN", "shop-eu": "UP"}, 15, what="failover")
    st.proc.stop()
    time.sleep(3.5)  # three agent intervals with nothing answering: no event to wait on
    # (the servers' addresses are healthgate's own producer listeners in this
    # test, which stop with it: only HAProxy's state is the point here)
    assert hp.servers() == {"shop-us": "DOWN", "shop-eu": "UP"}


def test_haproxy_weighs_a_dialled_route_by_the_agents_answers(
    stack: tuple[Stack, HAProxy, int], tmp_path: Path
) -> None:
    """trafficDial 70 (SPEC §6), exported while split: both regions active,
    and the agent answers ``up 70%`` / ``up 30%``."""
    st, _, _ = stack
    url = "/v1/projects/web/global/backendServices/shop"
    body = {k: v for k, v in st.api.get(url).json().items() if k != "status"}
    body["backends"][0]["trafficDial"] = 70
    assert st.api.put(url, json=body).is_success
    rule = f"/v1/projects/web/global/forwardingRules/{FRONT}"
    wait_for(lambda: len(st.api.get(rule).json()["status"]["route"]["shares"]) == 2, 10,
             what="the split")  # fmt: skip
    section = st.api.get(f"{rule}/haproxy").text
    servers = [line for line in section.splitlines() if line.strip().startswith("server")]
    assert len(servers) == 2 and not any(" backup " in s for s in servers), section
    (tmp_path / "split").mkdir()
    with HAProxy(tmp_path / "split", section) as hp:
        wait_for(lambda: hp.servers() == {"shop-us": "UP", "shop-eu": "UP"}, 10, what="UP")
        seen: dict[str | None, int] = {}

        def weighed() -> bool:
            seen.clear()
            for _ in range(300):
                region = hp.region_served()
                seen[region] = seen.get(region, 0) + 1
            return abs(100 * seen.get("us-east1", 0) / 300 - 70) <= 10

        # (the agent's weights arrive with its first answers: up to agent-inter)
        wait_for(weighed, 15, interval=0.5, what="a 70/30 split through HAProxy")
        print(f"\nHAProxy with a 70/30 route: {seen}")


def test_haproxy_marks_a_region_down_on_its_real_traffic(tmp_path: Path) -> None:
    """SPEC §8: the producer's outlierDetection becomes HAProxy's ``observe
    layer7`` / ``error-limit`` / ``on-error mark-down`` on that region's
    server; a region whose real requests fail while healthgate's checks pass
    is marked down by HAProxy itself, traffic moves to the backup, and the
    region comes back at its next passing check."""
    probe_source = "127.0.0.9"
    agent_port = free_port()
    with Stack(
        tmp_path, "--agent", f"127.0.0.1:{agent_port}", "--probe-source", probe_source
    ) as st:
        url = "/v1/projects/shop/regions/us-east1/backendServices/web"
        doc = {k: v for k, v in st.api.get(url).json().items() if k != "status"}
        doc["outlierDetection"] = {"consecutiveErrors": 3, "baseEjectionTimeSec": 3}
        assert st.api.put(url, json=doc).is_success
        section = st.api.get(f"/v1/projects/web/global/forwardingRules/{FRONT}/haproxy").text
        us_line = next(line for line in section.splitlines() if " shop-us " in line)
        assert "observe layer7 error-limit 3 on-error mark-down" in us_line, section
        assert "check inter 3s rise 1" in us_line
        with HAProxy(tmp_path, section) as hp:
            wait_for(lambda: hp.servers() == {"shop-us": "UP", "shop-eu": "UP"}, 10, what="UP")
            st.backends.backends.gray("us-east1", 500, probe_source)
            with httpx.Client(timeout=5) as client:
                statuses = [
                    client.get(f"http://127.0.0.1:{hp.port}/").status_code for _ in range(6)
                ]
                wait_for(lambda: hp.servers()["shop-us"] == "DOWN", 5, what="shop-us DOWN")
                after = [client.get(f"http://127.0.0.1:{hp.port}/").text for _ in range(20)]
            print(f"\nthrough HAProxy, us-east1 failing real requests: {statuses}")
            assert statuses[:3] == [500, 500, 500], statuses
            assert all(b.startswith("region=europe-west1") for b in after), after[:3]
            assert st.neg_state("us-east1") == "HEALTHY"  # healthgate's own checks still pass
            st.backends.backends.gray("us-east1", 0, probe_source)
            wait_for(lambda: hp.servers()["shop-us"] == "UP", 10, what="shop-us back UP")


@pytest.mark.parametrize("affinity", ["GENERATED_COOKIE", "CLIENT_IP"])
def test_haproxy_keeps_a_client_in_its_region(tmp_path: Path, affinity: str) -> None:
    """SPEC §9 exported: at a 70/30 dial, a cookie client (HAProxy's own
    inserted HG_AFFINITY) or a client address (balance source, consistent
    hash) stays in one region; clients spread about by the dial."""
    agent_port = free_port()
    with Stack(tmp_path, "--agent", f"127.0.0.1:{agent_port}") as st:
        url = "/v1/projects/web/global/backendServices/shop"
        body = {k: v for k, v in st.api.get(url).json().items() if k != "status"}
        body["backends"][0]["trafficDial"] = 70
        body["sessionAffinity"] = affinity
        assert st.api.put(url, json=body).is_success
        rule = f"/v1/projects/web/global/forwardingRules/{FRONT}"
        wait_for(lambda: len(st.api.get(rule).json()["status"]["route"]["shares"]) == 2, 10,
                 what="the split")  # fmt: skip
        section = st.api.get(f"{rule}/haproxy").text
        assert ("cookie HG_AFFINITY insert" in section) == (affinity == "GENERATED_COOKIE")
        assert ("balance source" in section) == (affinity == "CLIENT_IP")
        with HAProxy(tmp_path, section) as hp:
            wait_for(lambda: hp.servers() == {"shop-us": "UP", "shop-eu": "UP"}, 10, what="UP")
            # a consistent hash maps clients by weight: wait for the agent's first
            # answers (up to agent-inter) to turn 100/100 into 70/30
            wait_for(lambda: hp.weights() == {"shop-us": 70, "shop-eu": 30}, 15,
                     what="the agent's weights")  # fmt: skip
            front = f"http://127.0.0.1:{hp.port}/"
            regions = []
            for i in range(1, 81):
                source = f"127.0.6.{i}" if affinity == "CLIENT_IP" else "127.0.0.1"
                transport = httpx.HTTPTransport(local_address=source)
                with httpx.Client(transport=transport, timeout=5) as client:
                    seen = {client.get(front).text.split()[0] for _ in range(5)}
                assert len(seen) == 1, (i, seen)
                regions.append(next(iter(seen)))
            us = regions.count("region=us-east1") / len(regions)
            print(f"\nHAProxy, {affinity} clients at 70/30: {us:.0%} in us-east1")
            assert set(regions) == {"region=us-east1", "region=europe-west1"}, regions
