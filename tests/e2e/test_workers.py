"""Listeners in worker processes (serve --dataplane-workers 2): both workers
take connections on the same port, and traffic still fails over and back
with no client error, driven by health sent from the serving process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from tests.e2e.test_failover import Stack, break_and_heal
from tests.integration.serve_proc import wait_for


def worker_connections(stack: Stack) -> list[float]:
    text = stack.api.get("/metrics").text
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("healthgate_worker_connections_total{")
    ]


def test_two_workers_share_the_port_and_fail_over_with_no_client_error(tmp_path: Path) -> None:
    with Stack(tmp_path, "--dataplane-workers", "2") as s:
        url = f"http://127.0.0.1:{s.front}/"
        answers = set()
        for _ in range(80):  # fresh connections: the kernel spreads them over the workers
            with httpx.Client(timeout=5) as c:
                r = c.get(url)
                assert r.status_code == 200, r.text
                answers.add(r.text.split(" ")[0])
        assert answers == {"region=us-east1"}

        def reported() -> list[float] | None:
            counts = worker_connections(s)
            return counts if len(counts) == 2 and sum(counts) >= 80 else None

        counts = wait_for(reported, 5, what="both workers' counters reported")
        assert min(counts) > 0, counts  # both workers served

        ep = break_and_heal(s, "refuse", 10, settle=1.0)
        assert ep.client.errors == [], ep.client.errors[:5]
        during = ep.regions_during(0.2)
        after = ep.regions_after(0.2)
        assert during and set(during) == {"region=europe-west1"}
        assert after and set(after) == {"region=us-east1"}


def children(pid: int, running: str = "") -> list[int]:
    """A process's children (those whose command line holds ``running``)."""
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        except FileNotFoundError:
            continue
        if running.encode() in cmdline:
            out.append(int(child))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


DATAPLANE = "healthgate.dataplane.workers"


def test_a_dead_worker_is_replaced_and_no_worker_outlives_serve(tmp_path: Path) -> None:
    with Stack(tmp_path, "--dataplane-workers", "2") as s:
        assert s.proc.proc is not None
        serve = s.proc.proc.pid
        first = children(serve, DATAPLANE)
        assert len(first) == 2
        os.kill(first[0], signal.SIGKILL)

        def restarted() -> list[int] | None:
            now = children(serve, DATAPLANE)
            return now if len(now) == 2 and first[0] not in now else None

        replaced = wait_for(restarted, 10, what="the worker started again")
        url = f"http://127.0.0.1:{s.front}/"
        for _ in range(20):
            with httpx.Client(timeout=5) as c:
                assert c.get(url).status_code == 200
        every = children(serve)  # the probe workers too (one per core by default)
        assert set(replaced) <= set(every)
        s.proc.kill(signal.SIGKILL)  # the serving process dies without a word
        wait_for(lambda: not any(alive(p) for p in every), 10, what="workers gone")
