"""Replay for real (SPEC §11): a serve with real backends; us-east1 blinks
(refuses for a few seconds: long enough for its fast checks to fail it
over, and back); its probes' history, replayed under the world as it is,
reproduces every recorded transition and route change at the same time
(to the millisecond); under a candidate with a higher unhealthyThreshold
the false failover does not happen. In process and with probe workers (the
history is kept where the probes run)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.test_failover import Stack
from tests.helpers import run_cli
from tests.integration.serve_proc import wait_for

US_CHECK = "/v1/projects/shop/regions/us-east1/healthChecks/http-8080"


def blink(st: Stack) -> tuple[float, float]:
    """us-east1 refuses until its traffic has moved, then heals; the window."""
    since = time.time()
    time.sleep(1.5)
    st.backends.set_mode("us-east1", "refuse")
    wait_for(lambda: st.routed_region() == "europe-west1", 15, what="failover")
    st.backends.set_mode("us-east1", "ok")
    wait_for(lambda: st.routed_region() == "us-east1", 15, what="failback")
    time.sleep(1.5)
    return since, time.time()


def candidate(st: Stack, **fields: Any) -> str:
    check = {k: v for k, v in st.api.get(US_CHECK).json().items()
             if k not in ("selfLink", "fingerprint", "status") and not k.endswith("Timestamp")}  # fmt: skip
    return yaml.safe_dump({**check, **fields})


@pytest.mark.parametrize("workers", ["0", "2"], ids=["in process", "probe workers"])
def test_replay_reproduces_what_happened_and_a_higher_threshold_removes_the_failover(
    tmp_path: Path, workers: str
) -> None:
    with Stack(tmp_path, "--probe-workers", workers) as st:
        since, until = blink(st)
        same = st.api.post("/v1/replay", json={"from": since, "to": until}, timeout=60)
        assert same.status_code == 200, same.text
        report = same.json()
        assert report["firstDifference"] is None, report["firstDifference"]
        kinds = {r["kind"] for r in report["rows"]}
        assert {"Route", "NetworkEndpointGroup", "CompositeHealthCheck", "HealthSource"} <= kinds
        routes = [r for r in report["rows"] if r["kind"] == "Route"]
        assert len(routes) == 2 and all(r["same"] for r in routes), routes
        assert all(
            abs(r["recorded"]["time"] - r["replayed"]["time"]) <= 0.001 for r in report["rows"]
        )
        assert report["endpoints"] == 6 and report["results"] > 0 and not report["approximate"]

        # with unhealthyThreshold 8 the blink (a few refused probes) moves nothing
        higher = st.api.post(
            "/v1/replay",
            json={"from": since, "to": until, "manifest": candidate(st, unhealthyThreshold=8)},
            timeout=60,
        ).json()
        gone = [r for r in higher["rows"] if r["kind"] == "Route"]
        assert gone and all(r["replayed"] is None for r in gone), gone
        assert "would not happen" in higher["firstDifference"]
        # (nothing was written: the check is as it was)
        assert st.api.get(US_CHECK).json()["unhealthyThreshold"] == 2

        # the CLI prints the same; a check that probes something else is approximate
        other = tmp_path / "candidate.yaml"
        other.write_text(candidate(st, unhealthyThreshold=8, requestPath="/other"))
        out = run_cli("replay", "--from", str(since), "--to", str(until), "-f", str(other),
                      "--server", st.proc.url)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "first difference:" in out.stdout and "would not happen" in out.stdout
        assert "not replayed exactly" in out.stdout and "requestPath" in out.stdout
        bad = st.api.post("/v1/replay", json={"from": until, "to": since})
        assert bad.status_code == 400 and "to" in bad.text
        invalid = st.api.post(
            "/v1/replay",
            json={"from": since, "manifest": candidate(st, unhealthyThreshold=99)},
        )
        assert invalid.status_code == 400 and "unhealthyThreshold" in invalid.text
