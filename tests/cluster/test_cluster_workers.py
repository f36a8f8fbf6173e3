"""Cluster mode with ``--probe-workers 2``: each node's share of the probing
runs in worker processes (the same ProbePool as the embedded server). A
worker killed with -9 is started again and its endpoints resume without a
transition; a node killed with -9 hands its share to the survivor's workers
without a transition; a broken region still fails over on every node."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from tests.cluster.stack import ClusterStack, Node
from tests.cluster.test_cluster import EU, US, WINDOW, transitions_since
from tests.e2e.test_probe_workers import _worker_pids
from tests.integration.serve_proc import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterStack]:
    s = ClusterStack(
        tmp_path_factory.mktemp("cluster-workers"), lease_ttl=2, node_args=("--probe-workers", "2")
    )
    try:
        s.start()
        for node in s.live():  # every endpoint decided before anything is broken
            wait_for(lambda n=node: _decided(s, n), 20, what=f"{node.name}: every endpoint HEALTHY")
        yield s
    finally:
        s.close()


def _decided(s: ClusterStack, node: Node) -> bool:
    """Every endpoint decided (a NEG is HEALTHY with 3 of 4: the fourth's
    first decision may still be on its way, and the test counts events)."""
    return all(s.all_endpoints_healthy(r, node) for r in (US, EU))


def test_workers_probe_the_nodes_share_and_a_killed_worker_resumes(stack: ClusterStack) -> None:
    node = next(n for n in stack.live() if n.cluster()["probing"])
    pids = wait_for(lambda: len(_worker_pids(node.log)) == 2 and _worker_pids(node.log), 10)
    # the workers' probes are the node's: counted in its metrics
    metrics = dict(
        line.split(" ", 1) for line in node.get_text("/metrics").splitlines() if line[:1] != "#"
    )
    assert float(metrics["healthgate_probes_started_total"]) > 0
    # ... and its etcd watches' health: none stuck (a break or two is a member restarting)
    assert float(metrics["healthgate_etcd_watches_stuck"]) == 0
    assert float(metrics["healthgate_etcd_watch_breaks_total"]) >= 0
    assert node.cluster()["etcdWatchesStuck"] == 0
    after = stack.last_event_id(node)
    for name, pid in pids.items():
        os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda n=name, p=pid: _worker_pids(node.log).get(n) not in (None, p),
            10,
            what=f"{node.name}'s {name} started again",
        )
    time.sleep(3)  # three probe intervals: would its endpoints flap?
    events = stack.events(node, after)
    assert events == [], "\n".join(
        f"{e['kind']} {e['path']} {e['from']} -> {e['to']}: {e['reason']}" for e in events
    )
    assert all(stack.route_target(n) == US for n in stack.live())


def test_a_killed_node_hands_its_share_to_the_survivors_workers(stack: ClusterStack) -> None:
    probing = [n for n in stack.live() if n.region == US and n.cluster()["probing"]]
    victim = probing[0]
    survivor = next(n for n in stack.live() if n.region == US and n is not victim)
    after = stack.last_event_id(survivor)
    victim.kill()
    wait_for(lambda: survivor.cluster()["probing"] == 4, 15, what="the survivor probes all 4")
    time.sleep(1.5)  # an interval of probes by the survivor's workers
    assert transitions_since(stack, survivor, after) == []
    assert [e for e in stack.events(survivor, after) if e["to"] == "UNKNOWN"] == []
    # the survivor's workers really probe them: break us-east1, every node fails over
    stack.backends.set_mode(US, "refuse")
    broke = time.monotonic()
    wait_for(
        lambda: all(stack.route_target(n) == EU for n in stack.live()),
        WINDOW + 5,
        what="failover on every node",
    )
    took = time.monotonic() - broke
    stack.backends.set_mode(US, "ok")
    wait_for(
        lambda: all(stack.route_target(n) == US for n in stack.live()),
        WINDOW + 5,
        what="failback on every node",
    )
    print(f"\nkill -9 node {victim.name}; us-east1 broken: failover after {took:.2f} s")
    stack.heal_all()
