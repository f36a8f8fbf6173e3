"""The partition scenarios (SPEC §4, "Partitions"), each a function over a
settled :class:`~tests.partitions.ground.Ground` that cuts, waits, heals
and returns what it measured - asserted by tests/partitions/test_partitions.py,
printed by bench/partitions.py. Each leaves the ground healed and settled.

What every scenario measures:

* per node, the seconds from the cut to its route change (when it has one)
  and from the heal to convergence (every node a member again, every
  endpoint HEALTHY everywhere, the routes back);
* ``flaps``: route changes beyond the expected ones, per node;
* ``false``: records that should not exist - a record written after the
  heal but timed more than a second before it (what a node believed while
  cut off, written late), a record logged twice, and a record the scenario
  says cannot happen (an endpoint that every live prober could reach,
  recorded UNHEALTHY).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.partitions.ground import REGIONS, Ground, Node, RouteWatch

LATE_SLACK = 1.0  # a record computed before the heal and written just after it is on time


@dataclass
class Outcome:
    name: str
    cut_to_route: dict[str, float] = field(default_factory=dict)  # node -> seconds
    heal_to_converged: float = 0.0
    flaps: dict[str, int] = field(default_factory=dict)  # node -> unexpected route changes
    false: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        cut = ", ".join(f"{n} {t:.2f}s" for n, t in sorted(self.cut_to_route.items())) or "-"
        flaps = sum(self.flaps.values())
        return (
            f"{self.name}: cut->route {cut}; heal->converged {self.heal_to_converged:.2f}s; "
            f"flaps {flaps}; false records {len(self.false)}"
        )


def _identity(e: dict[str, Any]) -> tuple[str, str, float]:
    return (str(e.get("path")), str(e.get("to")), float(e["time"]))


def check_log(ground: Ground, out: Outcome, since_id: int, heal_wall: float | None) -> None:
    """The log after the scenario: the same on every node, nothing twice,
    nothing written late (see the module doc)."""
    logs = {}
    newest = max(ground.last_id(n) for n in ground.live())
    for node in ground.live():

        def caught_up(n: Node = node) -> bool:
            return ground.last_id(n) >= newest

        ground.wait(caught_up, 10, f"{node.name} has the whole log")
        logs[node.name] = [(e["id"], _identity(e)) for e in node.events(since_id)]
    first = next(iter(logs.values()))
    for name, entries in logs.items():
        if entries != first:
            out.false.append(f"node {name}'s log differs: {entries} vs {first}")
    twice = [k for k, n in Counter(i for _, i in first).items() if n > 1]
    out.false += [f"logged twice: {k}" for k in twice]
    if heal_wall is not None:
        for event in ground.live()[0].events(since_id):
            if event["time"] < heal_wall - LATE_SLACK and event["id"] > out.notes["heal_id"]:
                out.false.append(
                    f"written after the heal, timed {heal_wall - event['time']:.1f}s before it: "
                    f"{event['path']} -> {event['to']} ({event['reason']})"
                )
    out.notes["records"] = len(first)


def _member_or_leading(node: Node) -> bool:
    status = node.cluster()
    return bool(status["member"] or status["leading"])


def _heal(ground: Ground, out: Outcome, watch: RouteWatch) -> float:
    """Heal every cut; wait until converged; the heal's wall time."""
    majority = ground.live()[-1]
    out.notes["heal_id"] = ground.last_id(majority)
    heal_wall = time.time()
    healed = time.monotonic()
    ground.lab.heal()
    ground.settle(60)
    out.heal_to_converged = time.monotonic() - healed - 1.0  # (settle waits a quiet second)
    out.notes["healed_at"] = healed
    return heal_wall


def _count_flaps(out: Outcome, watch: RouteWatch, since: float, allowed: dict[str, int]) -> None:
    for node in watch.nodes:
        n = len(watch.of(node.name, since))
        extra = n - allowed.get(node.name, 0)
        out.flaps[node.name] = max(0, extra)


def region_cut_off(ground: Ground, short: str = "us", etcd_leader_inside: bool = False) -> Outcome:
    """A whole region (its node, its etcd member, its endpoints) cut from the
    rest. The others: its endpoints UNHEALTHY once its node's lease is gone
    and their own probes fail - traffic to the next region. The cut-off node:
    no longer a member, no longer leading, refuses writes, keeps its routes
    (fail static). Healed: one route change back on every node."""
    name = "region cut off" + (" (etcd leader inside)" if etcd_leader_inside else "")
    out = Outcome(name)
    if etcd_leader_inside:
        ground.move_etcd_leader(short)
    since_id = ground.last_id()
    others = [n for n in ground.nodes.values() if n.name != short]
    cut_off = ground.nodes[short]
    with ground.watching() as watch:
        cut = time.monotonic()
        ground.lab.isolate(ground.region(short))
        out.notes.update(
            _first_times(
                {"cut_off_knew_after": lambda: not _member_or_leading(cut_off)},
                cut,
                ground.lease_ttl + 2,
            )
        )
        ground.wait(
            lambda: all(watch.current.get(n.name) == "eu" for n in others),
            ground.lease_ttl + 15,
            "the others route to eu",
        )
        for n in others:
            at = watch.first(n.name, "eu", cut)
            out.cut_to_route[n.name] = (at or time.monotonic()) - cut
        out.notes["cut_off_route"] = cut_off.route()
        out.notes["cut_off_write"] = ground.try_write(cut_off)
        # a client outside the cut region, through another region's front end
        out.notes["served_during_cut"] = ground.served_by("eu")
        heal_wall = _heal(ground, out, watch)
        out.notes["served_after_heal"] = ground.served_by("eu")
        # the cut-off node kept its route; the others moved once each way
        _count_flaps(out, watch, cut, {n.name: 2 for n in others})
        after = out.notes["healed_at"]
        out.notes["changes_after_heal"] = {
            n.name: len(watch.of(n.name, after)) for n in watch.nodes
        }
    check_log(ground, out, since_id, heal_wall)
    return out


def cut_longer_than_the_lease(ground: Ground, short: str = "us", seconds: float = 10.0) -> Outcome:
    """A region's node cut from etcd and from its own endpoints (the others
    still reach them) for longer than its lease: the others take its
    endpoints over and find them HEALTHY. Healed: nothing it believed while
    cut off (its endpoints unreachable) reaches anyone - no record at all."""
    out = Outcome("node cut longer than its lease")
    since_id = ground.last_id()
    node = ground.nodes[short]
    rest = [p for p in ground.lab.places if p not in (f"{short}-node",)]
    etcd_and_own = [p for p in rest if p.endswith("-node") or p == f"{short}-ep"]
    with ground.watching() as watch:
        cut = time.monotonic()
        ground.lab.cut([f"{short}-node"], etcd_and_own)
        out.notes.update(
            _first_times(
                {"knew_after": lambda: not _member_or_leading(node)}, cut, ground.lease_ttl + 2
            )
        )
        time.sleep(max(0.0, seconds - (time.monotonic() - cut)))  # the cut's length is the test
        heal_wall = _heal(ground, out, watch)
        _count_flaps(out, watch, cut, {})
    check_log(ground, out, since_id, heal_wall)
    records = ground.live()[0].events(since_id)
    out.false += [f"record: {e['path']} -> {e['to']} ({e['reason']})" for e in records]
    return out


def cut_from_etcd_only(ground: Ground, short: str = "eu") -> Outcome:
    """A node (and its etcd member) cut from the other nodes and members;
    endpoints reachable by all. Its endpoints move to the others (HEALTHY
    stays HEALTHY); no route moves anywhere; no record."""
    out = Outcome("node cut from etcd only")
    since_id = ground.last_id()
    node = ground.nodes[short]
    others = [f"{n}-node" for n, _ in REGIONS if n != short]
    with ground.watching() as watch:
        cut = time.monotonic()
        ground.lab.cut([f"{short}-node"], others)
        out.notes.update(
            _first_times(
                {"knew_after": lambda: not _member_or_leading(node)}, cut, ground.lease_ttl + 2
            )
        )
        # the others take its endpoints: every one of them probed by someone
        ground.wait(
            lambda: all(
                short not in ground.nodes[o.split("-")[0]].cluster()["members"] for o in others
            ),
            ground.lease_ttl + 3,
            "the others see it gone",
        )
        time.sleep(3.0)  # (two probes of the takers: nothing may flip)
        heal_wall = _heal(ground, out, watch)
        _count_flaps(out, watch, cut, {})
    check_log(ground, out, since_id, heal_wall)
    records = ground.live()[0].events(since_id)
    out.false += [f"record: {e['path']} -> {e['to']} ({e['reason']})" for e in records]
    return out


def flapping_link(
    ground: Ground, short: str = "eu", period: float = 2.0, total: float = 30.0
) -> Outcome:
    """A node's links to the other nodes and members cut ``period`` s, healed
    ``period`` s, for ``total`` s: no route change anywhere, no record."""
    out = Outcome("flapping link")
    since_id = ground.last_id()
    others = [f"{n}-node" for n, _ in REGIONS if n != short]
    with ground.watching() as watch:
        start = time.monotonic()
        cycles = 0
        while time.monotonic() - start < total:
            ground.lab.cut([f"{short}-node"], others)
            time.sleep(period)
            ground.lab.heal()
            time.sleep(period)
            cycles += 1
        out.notes["cycles"] = cycles
        heal_wall = _heal(ground, out, watch)
        _count_flaps(out, watch, start, {})
    check_log(ground, out, since_id, heal_wall)
    records = ground.live()[0].events(since_id)
    out.false += [f"record: {e['path']} -> {e['to']} ({e['reason']})" for e in records]
    return out


def asymmetric(ground: Ground, vantages: bool) -> Outcome:
    """One region's node cannot reach another region's endpoints (the rest
    can). Without vantageRegions only the endpoints' own region probes them:
    nothing happens. With them, one vantage of three says UNHEALTHY and the
    quorum keeps them HEALTHY: nothing happens either."""
    out = Outcome("asymmetric cut" + (" with vantageRegions" if vantages else ""))
    if vantages:
        ground.use_vantages(True)
    try:
        since_id = ground.last_id()
        with ground.watching() as watch:
            cut = time.monotonic()
            ground.lab.cut(["eu-node"], ["us-ep"])
            if vantages:
                ground.wait(
                    lambda: ground.vantage_state("us", "europe-west1") == "UNHEALTHY",
                    10,
                    "eu's opinion of us's endpoints",
                )
            time.sleep(3.0)  # (another round of probes: nothing may flip)
            heal_wall = _heal(ground, out, watch)
            _count_flaps(out, watch, cut, {})
        check_log(ground, out, since_id, heal_wall)
        records = ground.live()[0].events(since_id)
        out.false += [f"record: {e['path']} -> {e['to']} ({e['reason']})" for e in records]
    finally:
        if vantages:
            ground.use_vantages(False)
    return out


def writer_cut(ground: Ground) -> Outcome:
    """The elected writer's node cut from everything while another region's
    endpoints fail and recover: a new leader within lease TTL + 1 s, every
    transition recorded exactly once, nothing written late, the same log on
    every node once healed."""
    out = Outcome("elected writer cut")
    since_id = ground.last_id()
    (leader_name,) = ground.leaders()
    leader = ground.nodes[leader_name]
    victim = next(s for s, _ in REGIONS[::-1] if s != leader_name)  # a region not routed to
    # etcd's own leader elsewhere: its election would extend every lease
    # (region_cut_off measures that case)
    ground.move_etcd_leader(next(s for s, _ in REGIONS if s != leader_name))
    with ground.watching() as watch:
        cut = time.monotonic()
        out.notes["cut_wall"] = time.time()
        ground.lab.isolate([leader.place])
        times = _first_times(
            {
                "new_leader_after": lambda: any(n != leader_name for n in ground.leaders()),
                "old_leader_knew_after": lambda: not leader.cluster()["leading"],
            },
            cut,
            ground.lease_ttl + 5,
        )
        out.notes.update(times)
        if times["new_leader_after"] is None:
            raise TimeoutError(f"no new leader\n{ground.describe()}")
        ground.lab.cut([f"{victim}-ep"], [p for p in ground.lab.places if p != f"{victim}-ep"])
        region = dict(REGIONS)[victim]
        ground.wait(
            lambda: all(
                n.healthy_endpoints(region)[0] == 0 for n in ground.live() if n.name != leader_name
            ),
            15,
            f"{victim}'s endpoints UNHEALTHY",
        )
        ground.lab.heal()  # (the victim's endpoints and the old leader at once)
        heal_wall = time.time()
        out.notes["heal_id"] = ground.last_id(ground.nodes[victim])
        healed = time.monotonic()
        ground.settle(60)
        out.heal_to_converged = time.monotonic() - healed - 1.0
        _count_flaps(out, watch, cut, {})
    check_log(ground, out, since_id, heal_wall)
    kinds = Counter(e["kind"] for e in ground.live()[0].events(since_id))
    out.notes["records_by_kind"] = dict(kinds)
    return out


TRAFFIC_SOURCE = {
    "kind": "HealthSource",
    "project": "shop",
    "region": "us-east1",
    "name": "web-traffic",
    "sourceType": "TRAFFIC",
    "sources": ["backendServices/web"],
    "trafficPolicy": {"windowSec": 10, "minimumRequests": 10, "holdSec": 10},
}


def _us_composite(*sources: str) -> dict[str, Any]:
    return {
        "kind": "CompositeHealthCheck",
        "project": "shop",
        "region": "us-east1",
        "name": "web-composite",
        "healthSources": [f"healthSources/{s}" for s in sources],
        "healthDestination": "forwardingRules/web-fr",
    }


def traffic_quorum(ground: Ground, seconds: float = 24.0) -> Outcome:
    """us-east1 judged by its real traffic too (a TRAFFIC source in its
    composite), traffic through every region's front end; eu's node cut from
    us's node, where us's producer listener is: every request eu's front end
    sends to us-east1 fails (and is retried in europe-west1, where it is
    served). eu's node says UNHEALTHY; us's and asia's, whose traffic
    succeeds, say HEALTHY: one of three is no quorum - no route moves, the
    source stays HEALTHY, no record."""
    out = Outcome("one node's link to a region cut, traffic judged")
    ground.apply([TRAFFIC_SOURCE, _us_composite("web-source", "web-traffic")])
    source = "/v1/projects/shop/regions/us-east1/healthSources/web-traffic"
    try:
        ground.settle(60)
        since_id = ground.last_id()
        writes_before = {n.name: n.cluster()["trafficVerdictWrites"] for n in ground.live()}
        with ground.watching() as watch:
            load = ground.load(seconds, threads=6)
            time.sleep(2.0)  # (every node judges its traffic HEALTHY first)
            # steady traffic, every verdict HEALTHY: no verdict is written
            steady = {n.name: n.cluster()["trafficVerdictWrites"] for n in ground.live()}
            time.sleep(3.0)
            out.notes["steady_verdict_writes"] = sum(
                n.cluster()["trafficVerdictWrites"] - steady[n.name] for n in ground.live()
            )
            cut = time.monotonic()
            ground.lab.cut(["eu-node"], ["us-node"])

            def eu_says_unhealthy() -> bool:
                nodes = ground.nodes["asia"].get(source)["status"]["traffic"].get("nodes", {})
                return bool(nodes.get("eu", {}).get("state") == "UNHEALTHY")

            ground.wait(eu_says_unhealthy, seconds - 7, "eu's verdict of us-east1: UNHEALTHY")
            out.notes["eu_verdict_after"] = round(time.monotonic() - cut, 2)
            out.notes["verdicts"] = ground.nodes["asia"].get(source)["status"]["traffic"]["nodes"]
            out.notes["source"] = {
                n.name: n.get(source)["status"]["healthState"] for n in ground.live()
            }
            out.notes["answers"] = ground.load_result(load)
            heal_wall = _heal(ground, out, watch)
            _count_flaps(out, watch, cut, {})
        out.notes["verdict_writes"] = {
            n.name: n.cluster()["trafficVerdictWrites"] - writes_before[n.name]
            for n in ground.live()
        }
        check_log(ground, out, since_id, heal_wall)
        records = ground.live()[0].events(since_id)
        out.false += [f"record: {e['path']} -> {e['to']} ({e['reason']})" for e in records]
    finally:
        ground.apply([_us_composite("web-source")])
        ground.apply([TRAFFIC_SOURCE], delete=True)
        ground.settle(60)
    return out


def _first_times(
    checks: dict[str, Callable[[], bool]], since: float, timeout: float
) -> dict[str, float | None]:
    """Seconds from ``since`` until each check first held (None: not within ``timeout``)."""
    out: dict[str, float | None] = dict.fromkeys(checks)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(v is None for v in out.values()):
        for name, check in checks.items():
            if out[name] is None and check():
                out[name] = round(time.monotonic() - since, 2)
        time.sleep(0.05)
    return out
