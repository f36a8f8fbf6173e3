"""``serve --probe-workers N``: probes in worker processes, each owning a
shard; a worker killed with -9 is started again and its endpoints resume from
their states without a transition; failover still happens."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from tests.e2e.test_failover import FRONT, Stack
from tests.integration.serve_proc import wait_for


def _worker_pids(log: Path) -> dict[str, int]:
    """The last pid each worker was started with, from serve's log."""
    out: dict[str, int] = {}
    for name, pid in re.findall(r"probe worker (w\d+) started \(pid (\d+)\)", log.read_text()):
        out[name] = int(pid)
    return out


def test_workers_probe_resume_after_kill_9_and_fail_over(tmp_path: Path) -> None:
    with Stack(tmp_path, "--probe-workers", "2", "--probe-failure-log-rate", "20") as s:
        pids = wait_for(
            lambda: len(_worker_pids(s.proc.log)) == 2 and _worker_pids(s.proc.log),
            10,
            what="2 workers",
        )
        # every endpoint was probed by some worker: both regions HEALTHY (the
        # Stack waited for it), and the probes are counted in the serving process
        started = wait_for(
            lambda: _metric(s, "healthgate_probes_started_total") > 0, 10, what="probes counted"
        )
        assert started
        # and so are their durations, by outcome (the workers' histograms, added up)
        assert wait_for(
            lambda: _metric(s, 'healthgate_probe_duration_seconds_count{outcome="OK"}') > 0,
            10,
            what="probe durations counted",
        )
        # every endpoint decided (the Stack waited for the NEGs only)
        wait_for(
            lambda: all(_all_healthy(s, r) for r in ("us-east1", "europe-west1")),
            10,
            what="every endpoint HEALTHY",
        )
        # each endpoint's runs and last probe reach the API too (a small
        # shard's every second)
        last = wait_for(lambda: _last_results(s, "us-east1"), 5, what="last probes in the API")
        for ep in last:
            assert ep["lastResult"]["outcome"] == "OK", ep
            assert "consecutive successful probes" in ep["reason"], ep
            assert not ep["reason"].startswith("0 "), ep
        time.sleep(0.5)  # (the log written)
        after = s.api.get("/v1/projects/shop/events").json()["last"]
        os.kill(pids["w0"], signal.SIGKILL)
        killed = time.monotonic()
        new = wait_for(
            lambda: (p := _worker_pids(s.proc.log)).get("w0") not in (None, pids["w0"]) and p,
            10,
            what="w0 started again",
        )
        print(
            f"\nworker w0 (pid {pids['w0']}) killed: started again as {new['w0']} "
            f"after {time.monotonic() - killed:.2f} s"
        )
        time.sleep(3)  # three probe intervals: would its endpoints flap?
        events = s.api.get(f"/v1/projects/shop/events?after={after}").json()["items"]
        assert events == [], [(e["name"], e["from"], e["to"], e["reason"]) for e in events]
        # and the restarted worker probes: a region breaks, traffic moves
        s.backends.set_mode("us-east1", "refuse")
        wait_for(lambda: s.routed_region() == "europe-west1", 10, what="failover")
        # the workers' failed probes are logged by the serving process
        failed = wait_for(
            lambda: re.findall(r"probe failed: (\S+): (.*) \(\d+ similar", s.proc.log.read_text()),
            10,
            what="probe failures logged",
        )
        assert any("us-east1" in path and "refused" in why for path, why in failed), failed
        s.backends.set_mode("us-east1", "ok")
        wait_for(lambda: s.routed_region() == "us-east1", 10, what="failback")
        assert s.api.get(FRONT).json()["status"]["route"]["mode"] == "normal"


def _last_results(s: Stack, region: str) -> list[dict[str, object]] | None:
    body = s.api.get(f"/v1/projects/shop/regions/{region}/backendServices/web/health").json()
    items: list[dict[str, object]] = body["healthStatus"]
    return items if items and all(ep["lastResult"] for ep in items) else None


def _all_healthy(s: Stack, region: str) -> bool:
    status = s.api.get(f"/v1/projects/shop/regions/{region}/backendServices/web").json()["status"]
    return bool(status["endpoints"] and status["healthy"] == status["endpoints"])


def _metric(s: Stack, name: str) -> float:
    for line in s.api.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
