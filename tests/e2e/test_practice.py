"""Practice runs for real (SPEC §11): a serve with its front end, real
region backends and real traffic. A scheduled run moves traffic away and
brings it back when its time is up; a run started by hand is cancelled the
moment its outcome check sees the survivor's real requests fail, with the
figures; a run is refused while a region is down; webhooks see every record."""

from __future__ import annotations

import json
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_passive import EU, US, PassiveStack
from tests.helpers import run_cli
from tests.integration.receiver import receiver
from tests.integration.serve_proc import wait_for

RUNS = "/v1/projects/web/global/practiceRuns"


def practice(name: str, **fields: Any) -> dict[str, Any]:
    return {
        "kind": "PracticeRun",
        "name": name,
        "project": "web",
        "awayFrom": US,
        "durationSec": 60,
        "comment": "weekly failover drill",
        **fields,
    }


ERRORS_CHECK = {
    "type": "FRONTEND_ERRORS",
    "name": "front end errors",
    "frontend": "shop-frontend",
    "maxErrorPercent": 5,
    "windowSec": 10,
    "minimumRequests": 20,
}


def traffic_for(stack: PassiveStack, seconds: float) -> list[tuple[float, int, str]]:
    """Requests through the front end for ``seconds``: (time, status, region)."""
    out = []
    end = time.monotonic() + seconds
    with httpx.Client(timeout=5) as c:
        while time.monotonic() < end:
            r = c.get(stack.front)
            out.append((time.time(), r.status_code, r.text.split()[0].removeprefix("region=")))
            time.sleep(0.01)
    return out


@pytest.fixture
def stack(tmp_path: Path) -> Any:
    s = PassiveStack(tmp_path, lambda world: None)
    try:
        yield s
    finally:
        s.close()


def test_a_scheduled_run_moves_traffic_and_brings_it_back(stack: PassiveStack) -> None:
    """A window that opens this minute: the run starts by itself, traffic
    leaves us-east1 within a couple of seconds (every request answered).
    serve restarts mid-run - its end brought 6 s near in the store, as if the
    run had been going for minutes - and the new process takes the run over
    from its shift: it completes at its end, once, and traffic returns;
    webhooks see STARTED and COMPLETED."""
    with receiver() as hook:
        hook_doc = {"kind": "Webhook", "name": "drills", "project": "web",
                    "url": f"http://127.0.0.1:{hook.port}/", "secret": "s" * 16,
                    "events": [{"kind": "PracticeRun"}]}  # fmt: skip
        stack.api.post("/v1/projects/web/global/webhooks", json=hook_doc).raise_for_status()
        now = datetime.now(UTC)
        schedule = {"startUtc": now.strftime("%H:%M"), "windowMin": 5}
        resp = stack.api.post(RUNS, json=practice("drill", schedule=schedule,
                                                  outcomeChecks=[ERRORS_CHECK]))  # fmt: skip
        assert resp.status_code == 201, resp.text
        created = time.time()
        wait_for(lambda: stack.region() == EU, 5, interval=0.05, what="traffic moved away")
        moved = time.time() - created
        status = stack.api.get(RUNS + "/drill").json()["status"]
        assert "underWay" in status and status["last"]["to"] == "STARTED", status
        assert status["last"]["window"].startswith(now.strftime("%Y-%m-%dT%H:%M"))
        route = stack.api.get("/v1/projects/web/global/forwardingRules/shop-frontend").json()
        assert "shifted away by practice-run/drill" in route["status"]["route"]["reason"]
        answers = traffic_for(stack, 2)
        assert {s for _, s, _ in answers} == {200} and {r for _, _, r in answers} == {EU}

        # a restart mid-run, its end now 6 s away
        ends_at = time.time() + 6.0
        stack.restart(lambda db: _bring_the_end_near(db, ends_at))
        assert stack.region() == EU  # (obeyed from the start: the run's shift is in the store)
        wait_for(lambda: stack.region() == US, 15, interval=0.1, what="traffic back")
        back = time.time() - ends_at
        assert back < 2.0, back
        wait_for(lambda: len(stack.events("web", "PracticeRun")) == 2, 5, what="COMPLETED")
        started, completed = stack.events("web", "PracticeRun")
        assert (started["to"], completed["to"]) == ("STARTED", "COMPLETED")
        assert completed["time"] == pytest.approx(ends_at, abs=0.01)
        assert "every outcome check held for 60 s" in completed["reason"]
        # never twice in one window (the restarted process read the log)
        time.sleep(1.5)
        assert [e["to"] for e in stack.events("web", "PracticeRun")] == ["STARTED", "COMPLETED"]
        wait_for(lambda: len(hook.acked()) == 2, 10, what="both records delivered")
        bodies = [json.loads(b) for _, b, _ in hook.requests]
        assert [b["to"] for b in bodies] == ["STARTED", "COMPLETED"], bodies
    print(f"\npractice run: traffic moved {moved:.2f} s after the window opened, "
          f"back {back:.2f} s after its end")  # fmt: skip


def _bring_the_end_near(db: Path, ends_at: float) -> None:
    """The practice run's shift, ending at ``ends_at`` (serve is stopped)."""
    with sqlite3.connect(db) as conn:
        key, raw = conn.execute(
            "SELECT key, value FROM documents WHERE key LIKE ?", ("%/shifts/practice-%",)
        ).fetchone()
        doc = json.loads(raw)
        doc["expireTime"] = ends_at
        conn.execute("UPDATE documents SET value=? WHERE key=?", (json.dumps(doc), key))


def test_a_breaching_outcome_check_cancels_the_run_with_its_figures(stack: PassiveStack) -> None:
    """Started by hand; europe-west1's real requests then fail (its health
    checks pass: a gray failure) - the run is cancelled within seconds and
    traffic goes home."""
    resp = stack.api.post(RUNS, json=practice("drill", outcomeChecks=[ERRORS_CHECK]))
    assert resp.status_code == 201, resp.text
    started = stack.api.post(RUNS + "/drill:start")
    assert started.status_code == 200 and started.json()["to"] == "STARTED", started.text
    wait_for(lambda: stack.region() == EU, 3, interval=0.05, what="traffic moved away")
    again = stack.api.post(RUNS + "/drill:start")
    assert again.status_code == 409 and "under way" in again.text, again.text
    stack.gray(EU, 500)
    broke = time.time()
    answers = traffic_for(stack, 4)
    wait_for(lambda: stack.region() == US, 10, interval=0.1, what="traffic back home")
    cancelled = [e for e in stack.events("web", "PracticeRun") if e["to"] == "CANCELLED"]
    assert len(cancelled) == 1, cancelled
    reason = cancelled[0]["reason"]
    assert "front end errors: " in reason and "failed" in reason and "500 ×" in reason, reason
    assert "> maxErrorPercent 5" in reason and reason.endswith("traffic returns")
    assert cancelled[0]["check"] == "front end errors"
    took = cancelled[0]["time"] - broke
    assert took < 5, took
    late = [r for t, s, r in answers if t > cancelled[0]["time"] + 1]
    assert late and set(late) == {US}, answers[-5:]
    print(f"\npractice run cancelled {took:.2f} s after the survivor's requests began to fail")


def test_a_run_is_refused_while_a_region_is_down(stack: PassiveStack) -> None:
    resp = stack.api.post(RUNS, json=practice("drill"))
    assert resp.status_code == 201, resp.text
    stack.backends.set_mode(EU, "hang")
    eu_neg = "/v1/projects/web/regions/europe-west1/networkEndpointGroups/shop-eu"
    wait_for(
        lambda: stack.api.get(eu_neg).json()["status"]["healthState"] == "UNHEALTHY",
        20,
        what="europe-west1 UNHEALTHY",
    )
    refused = stack.api.post(RUNS + "/drill:start")
    assert refused.status_code == 409, refused.text
    assert "an incident" in refused.text and "shop-eu is UNHEALTHY" in refused.text
    (skipped,) = stack.events("web", "PracticeRun")
    assert skipped["to"] == "SKIPPED" and "an incident" in skipped["reason"]
    assert stack.region() == US
    assert stack.api.get(RUNS + "/drill").json()["status"]["last"]["to"] == "SKIPPED"
    # the CLI says the same
    server = ("--server", stack.serve.url, "--project", "web")
    cli = run_cli("practice", "start", "drill", *server)
    assert cli.returncode == 1 and "an incident" in cli.stderr, (cli.stdout, cli.stderr)
    listed = run_cli("practice", "list", *server)
    assert listed.returncode == 0 and "drill" in listed.stdout and "SKIPPED" in listed.stdout
    assert "by hand" in listed.stdout, listed.stdout
    history = run_cli("practice", "history", "drill", *server)
    assert history.returncode == 0 and history.stdout.count("SKIPPED") == 2, history.stdout
