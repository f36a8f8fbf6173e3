"""kill -9 and restarts: nothing acknowledged is lost, nothing spurious is logged,
and a region that was down stays down across a restart until probes say otherwise."""

from __future__ import annotations

import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.helpers import example_world
from tests.integration.serve_proc import ServeProcess, wait_for
from tests.integration.servers import free_port


def fast_world(project: str, consumer: str, port: int) -> list[dict[str, Any]]:
    return example_world(project, consumer, port=port, fast=True)


def events(c: httpx.Client, project: str) -> list[dict[str, Any]]:
    return list(c.get(f"/v1/projects/{project}/events", params={"limit": 10000}).json()["items"])


def test_kill_9_during_applies_loses_nothing_acknowledged(tmp_path: Path) -> None:
    db = tmp_path / "crash.db"
    acknowledged: set[str] = set()
    rnd = random.Random(4)
    proc = ServeProcess(db)
    n = 0
    for _round in range(5):
        proc.start()
        stop = threading.Event()

        def writer(stop: threading.Event = stop) -> None:
            nonlocal n
            with proc.client() as c:
                while not stop.is_set() and n < 10_000:
                    n += 1
                    name = f"hc-{n}"
                    doc = {
                        "kind": "HealthCheck",
                        "project": "crash",
                        "region": "r1",
                        "name": name,
                        "type": "TCP",
                        "port": 1,
                    }
                    try:
                        resp = c.post("/v1/apply", json={"manifest": yaml.safe_dump(doc)})
                    except httpx.HTTPError:
                        return  # the server died under us: this one was not acknowledged
                    if resp.status_code == 200:
                        acknowledged.add(name)

        t = threading.Thread(target=writer)
        t.start()
        time.sleep(rnd.uniform(0.3, 1.0))
        proc.kill(signal.SIGKILL)
        stop.set()
        t.join(30)
    proc.start()
    with proc.client() as c:
        names: set[str] = set()
        token = None
        while True:
            page = c.get(
                "/v1/projects/crash/regions/r1/healthChecks",
                params={"pageToken": token} if token else {},
            ).json()
            names |= {i["name"] for i in page["items"]}
            token = page.get("nextPageToken")
            if not token:
                break
    proc.stop()
    assert len(acknowledged) > 20, "the writer should have got through many applies"
    assert acknowledged <= names, sorted(acknowledged - names)[:10]
    assert sqlite3.connect(db).execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_kill_9_during_transitions_logs_nothing_spurious(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    dead_port = free_port()
    dicts = fast_world("crashp", "crashc", dead_port)  # every endpoint refuses: all go UNHEALTHY
    proc = ServeProcess(db).start()
    try:
        with proc.client() as c:
            assert (
                c.post("/v1/apply", json={"manifest": yaml.safe_dump_all(dicts)}).status_code == 200
            )
            # kill in the middle of the transitions, restart, let it settle
            time.sleep(1.2)
            proc.kill(signal.SIGKILL)
        proc.start()
        with proc.client() as c:
            wait_for(
                lambda: (
                    sum(
                        e["kind"] == "Endpoint" and e["to"] == "UNHEALTHY"
                        for e in events(c, "crashp")
                    )
                    >= 6
                ),
                15,
                what="all endpoints UNHEALTHY",
            )
            time.sleep(1.0)  # let the last batch reach the store
            before = events(c, "crashp") + events(c, "crashc")
        proc.kill(signal.SIGKILL)  # settled: now a crash must not produce any new record
        proc.start()
        with proc.client() as c:
            time.sleep(4.0)  # several probe rounds at 1 s
            after = events(c, "crashp") + events(c, "crashc")
            assert [e["id"] for e in after] == [e["id"] for e in before], [
                e for e in after if e not in before
            ]
            health = c.get("/v1/projects/crashp/regions/us-east1/backendServices/web/health").json()
            assert {e["healthState"] for e in health["healthStatus"]} == {"UNHEALTHY"}
    finally:
        proc.stop()


class HttpServers:
    """Plain HTTP servers (python -m http.server) on loopback addresses."""

    def __init__(self, addrs: list[str], port: int, root: Path) -> None:
        self.addrs, self.port, self.root = addrs, port, root
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        for addr in self.addrs:
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "http.server",
                        "--bind",
                        addr,
                        "--directory",
                        str(self.root),
                        str(self.port),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for addr in self.addrs:
            wait_for(
                lambda a=addr: _listening(a, self.port), 10, 0.05, f"{addr}:{self.port} listening"
            )

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(10)
        self.procs.clear()


def _listening(addr: str, port: int) -> bool:
    try:
        return httpx.get(f"http://{addr}:{port}/", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[HttpServers, HttpServers, int]]:
    port = free_port()
    us = HttpServers([f"127.0.1.{i}" for i in range(1, 5)], port, tmp_path)
    eu = HttpServers(["127.0.2.1", "127.0.2.2"], port, tmp_path)
    try:
        yield us, eu, port
    finally:
        us.stop()
        eu.stop()


def test_a_region_down_stays_down_across_a_restart(
    tmp_path: Path, servers: tuple[HttpServers, HttpServers, int]
) -> None:
    us, eu, port = servers
    eu.start()  # us-east1 (the local, preferred region) is down from the start
    dicts = fast_world("rs", "rc", port)
    front = "/v1/projects/rc/global/forwardingRules/shop-frontend"
    proc = ServeProcess(tmp_path / "r.db").start()
    try:
        with proc.client() as c:
            c.post("/v1/apply", json={"manifest": yaml.safe_dump_all(dicts)}).raise_for_status()
            wait_for(
                lambda: c.get(front).json()["status"]["route"]["target"].endswith("/shop-eu"),
                15,
                what="failover to eu",
            )
            time.sleep(1.0)
        for how in (signal.SIGTERM, signal.SIGKILL):
            proc.kill(how)
            proc.start()
            with proc.client() as c:
                # right after start, before any probe could decide: still failed over
                route = c.get(front).json()["status"]["route"]
                neg = c.get(
                    "/v1/projects/rc/regions/us-east1/networkEndpointGroups/shop-us"
                ).json()["status"]
                assert route["target"].endswith("/shop-eu"), route
                assert neg["healthState"] == "UNHEALTHY"
        # the region comes back: traffic fails back once probes say so
        us.start()
        started = time.monotonic()
        with proc.client() as c:
            wait_for(
                lambda: c.get(front).json()["status"]["route"]["target"].endswith("/shop-us"),
                15,
                what="failback",
            )
            elapsed = time.monotonic() - started
            # success window at 1 s interval, threshold 2, fast answers: ~1 s, plus up to one interval of phase
            assert elapsed < 1 + 1 + 1.5, elapsed
            restart_records = [e for e in events(c, "rc") if e["kind"] == "Route"]
            assert [r["to"].rsplit("/", 1)[1] for r in restart_records] == [
                "shop-us",
                "shop-eu",
                "shop-us",
            ]
    finally:
        proc.stop()
