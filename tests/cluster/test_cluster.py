"""Cluster mode end to end (SPEC §4): 3 etcd members, 3 healthgate nodes
(a and b in us-east1, c in europe-west1), real backends, a client sending
requests through the front end the whole time. Each scenario starts from
everything up and HEALTHY, asserts its outcome and prints how long it took.

Run these alone with ``pytest -m cluster``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as stubs

from healthgate.health.placement import by_region, probers
from healthgate.store.etcd import EtcdStore
from tests.cluster.stack import SOURCES, ClusterStack, Node, TcpTraffic, Traffic
from tests.integration.receiver import receiver
from tests.integration.serve_proc import wait_for

pytestmark = pytest.mark.cluster

US, EU = "us-east1", "europe-west1"
WINDOW = 1 * 2 + 1 * 1  # timeout x threshold + interval x (threshold - 1), the e2e world's checks


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterStack]:
    # (the leader looks for opinions of endpoints gone every second: the
    # sweep's test; nothing else here removes an endpoint)
    s = ClusterStack(
        tmp_path_factory.mktemp("cluster"), lease_ttl=2, node_args=("--opinion-sweep-sec", "1")
    )
    try:
        s.start()
        yield s
    finally:
        s.close()


@pytest.fixture
def fresh(stack: ClusterStack) -> ClusterStack:
    stack.heal_all()
    return stack


def transitions_since(stack: ClusterStack, node: Node, after: int) -> list[dict[str, object]]:
    return [e for e in stack.events(node, after) if e["kind"] != "Endpoint"]


def test_nodes_share_the_probing_and_agree(fresh: ClusterStack) -> None:
    statuses = {n.name: n.cluster() for n in fresh.live()}
    leaders = {s["leader"] for s in statuses.values()}
    assert len(leaders) == 1 and None not in leaders
    assert sum(s["leading"] for s in statuses.values()) == 1
    # 4 us-east1 endpoints between a and b as rendezvous hashing says, the 2
    # in europe-west1 on c
    regions = by_region({n.name: n.region for n in fresh.live()})
    expected = dict.fromkeys(fresh.nodes, 0)
    for region in (US, EU):
        body = fresh.live()[0].get(f"/v1/projects/shop/regions/{region}/backendServices/web/health")
        for ep in body["healthStatus"]:
            path = f"{body['backendService']}/endpoints/{ep['ipAddress']}:{ep['port']}"
            owner = probers(path, region, (region,), regions)[region]
            expected[owner] += 1
    assert {n: s["probing"] for n, s in statuses.items()} == expected
    assert expected["c"] == 2 and expected["a"] + expected["b"] == 4
    for node in fresh.live():
        assert fresh.route_target(node) == US


def test_kill_a_prober_node(fresh: ClusterStack) -> None:
    leader = fresh.leader()
    # a us-east1 node that probes something (rendezvous may give one of them all
    # four), the leader only if it is that one
    probing = [n for n in fresh.live() if n.region == US and n.cluster()["probing"]]
    victim = next((n for n in probing if n is not leader), probing[0])
    survivor = next(n for n in fresh.live() if n.region == US and n is not victim)
    after = fresh.last_event_id(survivor)
    tcp_port = fresh.producer_ports[0]  # us-east1's TCP producer rule, on a and b
    with Traffic(fresh.front) as traffic, TcpTraffic("127.0.1.100", tcp_port) as tcp:
        time.sleep(0.5)  # traffic flowing before the kill
        victim.kill()
        killed = time.monotonic()
        wait_for(lambda: survivor.cluster()["probing"] == 4, 15, what="the survivor probes all 4")
        took = time.monotonic() - killed
        # one more interval of probes from the survivor, still HEALTHY
        time.sleep(1.5)
    print(
        f"\nkill -9 prober {victim.name}: {survivor.name} probes its endpoints after {took:.2f} s"
    )
    print(
        f"traffic: {traffic.done} requests, {traffic.retried} retried, {len(traffic.errors)} errors"
    )
    print(f"TCP: {tcp.done} connections, {len(tcp.errors)} failed {tcp.errors[:3]}")
    assert took <= fresh.lease_ttl + 1 + 2  # lease TTL + one interval (+ the watch's delivery)
    assert victim.name not in survivor.cluster()["members"]
    changes = transitions_since(fresh, survivor, after)
    assert changes == [], changes  # no route change, nothing above the endpoints moved
    unknown = [e for e in fresh.events(survivor, after) if e["to"] == "UNKNOWN"]
    assert unknown == []
    assert traffic.errors == []
    assert traffic.regions.get(EU, 0) == 0


def test_kill_the_leader_then_break_a_region(fresh: ClusterStack) -> None:
    leader = fresh.leader()
    after = fresh.last_event_id(leader)
    with Traffic(fresh.front) as traffic:
        time.sleep(0.5)
        leader.kill()
        fresh.backends.set_mode(US, "refuse")
        broke = time.monotonic()
        others = fresh.live()
        wait_for(
            lambda: all(fresh.route_target(n) == EU for n in others), 20, what="failover everywhere"
        )
        took = time.monotonic() - broke
        new_leader = wait_for(fresh._leader_or_none, 10, what="a new leader")
    print(f"\nkill -9 leader {leader.name}, break us-east1: failover after {took:.2f} s")
    print(f"new leader {new_leader.name}; traffic: {traffic.done} requests, ")
    print(f"{traffic.retried} retried, {len(traffic.errors)} errors")
    assert took <= WINDOW + fresh.lease_ttl + 1 + 1  # window + TTL + 1 s (+1 s: interval phase)
    assert new_leader is not leader

    def neg_records() -> list[dict[str, object]]:
        return [
            e
            for e in fresh.events(new_leader, after)
            if e["kind"] == "NetworkEndpointGroup" and e["to"] == "UNHEALTHY"
        ]

    wait_for(neg_records, 10, what="the NEG's transition in the log")
    wait_for(lambda: fresh._log_quiet(new_leader), 10, interval=0.5, what="a quiet log")
    records = neg_records()
    assert len(records) == 1, records  # recorded once
    # the same log through every node - up to what both reads saw (a record
    # may still land between two reads: a quiet half second is no promise)
    for node in fresh.live():
        mine = [(e["id"], e["kind"], e.get("path"), e.get("to")) for e in fresh.events(node, after)]
        theirs = [
            (e["id"], e["kind"], e.get("path"), e.get("to"))
            for e in fresh.events(new_leader, after)
        ]
        upto = min(mine[-1][0] if mine else 0, theirs[-1][0] if theirs else 0)
        assert [e for e in mine if e[0] <= upto] == [e for e in theirs if e[0] <= upto]


def test_the_etcd_leader_dies(fresh: ClusterStack) -> None:
    node = fresh.live()[0]
    after = fresh.last_event_id(node)
    old = fresh.etcd.leader()
    with Traffic(fresh.front) as traffic:
        old.kill()
        killed = time.monotonic()
        new = wait_for(lambda: _etcd_leader(fresh), 10, what="a new etcd leader")
        elected = time.monotonic() - killed
        time.sleep(fresh.lease_ttl * 2)  # two lease TTLs: would anything move?
    print(f"\netcd leader {old.name} killed: {new.name} leads after {elected:.2f} s")
    print(f"traffic: {traffic.done} requests, {len(traffic.errors)} errors")
    spurious = fresh.events(node, after)
    assert spurious == [], spurious  # no spurious transition
    assert all(len(n.cluster()["members"]) == 3 for n in fresh.live())
    assert traffic.errors == []


def _etcd_leader(stack: ClusterStack) -> object:
    try:
        return stack.etcd.leader()
    except Exception:
        return None


def test_quorum_lost_then_back(fresh: ClusterStack) -> None:
    node = fresh.nodes["c"]
    writer = fresh.nodes["a"]
    lost = fresh.etcd.members[1:]
    with Traffic(fresh.front) as traffic:
        for member in lost:
            member.kill()
        fresh.backends.set_mode(US, "refuse")
        broke = time.monotonic()
        time.sleep(WINDOW + 2)  # long enough for a failover, had there been quorum
        routes = {n.name: fresh.route_target(n) for n in fresh.live()}
        changed = [dict(d, description="written without quorum") for d in fresh.world]
        manifest = yaml.safe_dump_all(changed)
        refused = httpx.post(writer.url + "/v1/apply", json={"manifest": manifest}, timeout=10)
        read = httpx.get(writer.url + "/v1/projects/shop/regions/us-east1/healthChecks", timeout=5)
        served_during = dict(traffic.regions)
        for member in lost:
            fresh.etcd.restart(member)
        back = time.monotonic()
        wait_for(
            lambda: all(fresh.route_target(n) == EU for n in fresh.live()),
            30,
            what="failover once quorum is back",
        )
        took = time.monotonic() - back
    print(f"\nquorum lost {back - broke:.1f} s: routes {routes}, write {refused.status_code}")
    print(f"quorum back: failover after {took:.2f} s; traffic {traffic.done} requests, ")
    print(f"{traffic.retried} retried, {len(traffic.errors)} errors, served {served_during}")
    assert set(routes.values()) == {US}  # no decision changed without quorum
    assert refused.status_code == 503 and refused.json()["error"]["status"] == "UNAVAILABLE"
    assert read.status_code == 200 and read.json()["items"]
    assert sum(served_during.values()) > 0  # traffic kept flowing (retried into europe-west1)
    assert traffic.errors == []
    assert node.alive


def test_a_frozen_etcd_member(fresh: ClusterStack) -> None:
    # freeze the member node a talks to now
    node = fresh.nodes["a"]
    address = node.cluster()["etcdMember"]
    frozen = next(m for m in fresh.etcd.members if m.address == address)
    after = fresh.last_event_id(node)
    with Traffic(fresh.front) as traffic:
        frozen.freeze()
        try:
            froze = time.monotonic()
            fresh.backends.set_mode(US, "refuse")
            wait_for(
                lambda: all(fresh.route_target(n) == EU for n in fresh.live()),
                30,
                what="failover with a frozen member",
            )
            took = time.monotonic() - froze
        finally:
            frozen.thaw()
    logs = "".join(n.log.read_text() for n in fresh.live())
    print(f"\nfrozen etcd member {frozen.name}: failover after {took:.2f} s")
    print(f"traffic: {traffic.done} requests, {len(traffic.errors)} errors")
    assert "a frozen member?" in logs  # the watchdog noticed
    events = fresh.events(node, after)
    records = [e for e in events if e["kind"] == "NetworkEndpointGroup" and e["to"] == "UNHEALTHY"]
    # (on a failure: every record since, each node's cluster view and the
    # log lines of the writers - what a record written twice needs explaining)
    assert len(records) == 1, (
        records,
        [(e.get("id"), e["kind"], e.get("path"), e.get("to"), e.get("time")) for e in events],
        {n.name: n.cluster() for n in fresh.live()},
        [line for n in fresh.live() for line in n.log.read_text().splitlines()
         if "leader" in line or "transitions" in line or "deposed" in line][-40:],
    )  # fmt: skip
    assert traffic.errors == []


def test_one_dissenting_vantage(fresh: ClusterStack) -> None:
    # us-east1's endpoints are checked from europe-west1 too
    world = [
        dict(d, vantageRegions=[EU]) if d["kind"] == "HealthCheck" and d["region"] == US else d
        for d in fresh.world
    ]
    fresh.apply(world)
    node = fresh.nodes["a"]
    after = fresh.last_event_id(node)
    c = fresh.nodes["c"]
    wait_for(lambda: c.cluster()["probing"] == 2 + 4, 10, what="c probes us-east1 too")
    try:
        # c's path to us-east1 breaks: one vantage of two dissents
        fresh.backends.backends.deny(US, SOURCES["c"])
        started = time.monotonic()

        def dissent_seen() -> bool:
            body = node.get(f"/v1/projects/shop/regions/{US}/backendServices/web/health")
            return all(
                "HEALTHY from us-east1; europe-west1 saw it UNHEALTHY, short of a quorum"
                in e["reason"]
                for e in body["healthStatus"]
            )

        try:
            wait_for(dissent_seen, 30, what="europe-west1's dissent on every endpoint")
        except TimeoutError:
            # (this failed now and then until a node that had stood in for
            # us-east1 while it was broken - the frozen-member and quorum
            # tests make it do so - kept that UNHEALTHY in its prober engine,
            # and failing again was no flip, so no opinion: ClusterHealth.
            # _take_over now starts from UNKNOWN; tests/unit/test_cluster_takeover.py)
            raise AssertionError(f"dissent not seen within 30 s: {fresh.describe()}") from None
        seen = time.monotonic() - started
        assert all(fresh.route_target(n) == US for n in fresh.live())
        assert transitions_since(fresh, node, after) == []  # no failover
        print(f"\none dissenting vantage: seen after {seen:.2f} s, no failover")
        # now us-east1's own probers agree: a quorum of 2 of 2
        for name in ("a", "b"):
            fresh.backends.backends.deny(US, SOURCES[name])
        wait_for(
            lambda: all(fresh.route_target(n) == EU for n in fresh.live()),
            15,
            what="failover on a quorum of vantages",
        )

        def quorum_seen() -> bool:
            body = node.get(f"/v1/projects/shop/regions/{US}/backendServices/web/health")
            return all(
                "UNHEALTHY from 2 of 2 live vantages" in e["reason"] for e in body["healthStatus"]
            )

        wait_for(quorum_seen, 10, what="every endpoint UNHEALTHY by a quorum")
    finally:
        fresh.backends.backends.denied.clear()
        fresh.apply(fresh.world)


def _sse_ids(url: str, headers: dict[str, str], want: int, timeout: float) -> list[tuple[int, str]]:
    """(id, kind) of the first ``want`` events of a stream; bounded in time."""
    out: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout
    with httpx.stream("GET", url, headers=headers, timeout=timeout) as r:
        event_id = 0
        for line in r.iter_lines():
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: ") and event_id:
                out.append((event_id, json.loads(line[6:])["kind"]))
                event_id = 0
                if len(out) >= want:
                    break
            if time.monotonic() > deadline:
                break
    return out


def test_any_node_writes_reads_and_streams_the_one_log(fresh: ClusterStack) -> None:
    a, b, c = fresh.nodes["a"], fresh.nodes["b"], fresh.nodes["c"]
    # a write through b is read back, with its fingerprint, through a and c
    changed = [
        dict(d, description="via b") if d["kind"] == "HealthCheck" else d for d in fresh.world
    ]
    fresh.apply(changed, b)
    path = "/v1/projects/shop/regions/europe-west1/healthChecks/http-8080"
    wait_for(lambda: a.get(path).get("description") == "via b", 5, what="a's mirror")
    assert a.get(path)["fingerprint"] == c.get(path)["fingerprint"] == b.get(path)["fingerprint"]
    # a transition streams from every node with the same id
    stream = "/v1/projects/web/events/stream?kind=NetworkEndpointGroup"
    got: dict[str, list[tuple[int, str]]] = {}
    threads = [
        threading.Thread(
            target=lambda n=n: got.__setitem__(n.name, _sse_ids(n.url + stream, {}, 1, 20)),
            daemon=True,
        )
        for n in (a, b, c)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the streams are open (they start "from now")
    fresh.backends.set_mode(EU, "refuse")
    for t in threads:
        t.join(25)
    assert set(got) == {"a", "b", "c"}
    ids = {name: events[0][0] for name, events in got.items()}
    assert len(set(ids.values())) == 1, got  # one record, one id, on every node
    # and a stream resumed on another node with Last-Event-ID replays it
    first = ids["a"]
    again = _sse_ids(c.url + stream, {"Last-Event-ID": str(first - 1)}, 1, 10)
    assert again[0] == (first, "NetworkEndpointGroup")


def test_the_dashboard_shows_nodes_leader_and_probers(fresh: ClusterStack) -> None:
    from playwright.sync_api import expect, sync_playwright

    from tests.browser.test_dashboard import CHROMIUM, FLAGS

    node = fresh.nodes["c"]
    status = node.cluster()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(node.url + "/")
        nodes = page.locator("#nodes .node")
        expect(nodes).to_have_count(3, timeout=15_000)
        leader = page.locator(f'#nodes .node[data-node="{status["leader"]}"]')
        expect(leader).to_contain_text("leader")
        for name, count in status["probingByNode"].items():
            expect(page.locator(f'#nodes .node[data-node="{name}"]')).to_contain_text(
                f"probes {count}"
            )
        expect(page.locator(".chip").first).to_contain_text("probed by", timeout=15_000)
        browser.close()
    assert sum(status["probingByNode"].values()) == 6


def test_a_second_node_with_a_taken_name_is_refused(fresh: ClusterStack) -> None:
    twin = Node(fresh, "a", US)
    twin.log = fresh.tmp / "node-a-twin.log"
    twin.start()
    assert twin.proc is not None
    code = twin.proc.wait(30)
    out = twin.log.read_text()
    assert code == 1 and "--node a: another live node has this name" in out
    assert "Traceback" not in out
    assert len(fresh.nodes["a"].cluster()["members"]) == 3  # the real a is untouched


def test_a_shift_and_a_webhook_on_every_node(fresh: ClusterStack) -> None:
    """A shift POSTed on one node moves every node's route; a node restarted
    mid-shift (the leader, killed) obeys it at once; its expiry is recorded
    once, by the writer; the webhook gets every record once, across the
    change of writer."""
    a, b = fresh.nodes["a"], fresh.nodes["b"]
    with receiver() as rec:
        after = fresh.last_event_id(a)
        hook = {
            "kind": "Webhook", "name": "oncall", "project": "web",
            "url": f"http://127.0.0.1:{rec.port}/", "secret": "x" * 20,
            "events": [{"kind": "Change"}, {"kind": "Route"}],
        }  # fmt: skip
        fresh.apply([hook], node=a)
        resp = httpx.post(
            b.url + "/v1/projects/web/shifts",
            json={"awayFrom": US, "expiresInSec": 600, "comment": "bad deploy in us"},
            timeout=10,
        )
        assert resp.status_code == 201, resp.text
        name = resp.json()["name"]
        wait_for(lambda: all(fresh.route_target(n) == EU for n in fresh.live()), 5, what="shifted")
        reason = a.get("/v1/projects/web/global/forwardingRules/shop-frontend")["status"]["route"]
        assert "bad deploy in us" in json.dumps(reason)
        leader = fresh.leader()
        leader.kill()
        leader.start()
        leader.wait_ready()
        assert fresh.route_target(leader) == EU  # obeyed from the start
        # the shift runs out (its expiry moved to 2 s from now, in etcd itself)
        key = b"/healthgate/r/resources/projects/web/global/shifts/" + name.encode()
        with fresh.etcd.channel(fresh.etcd.endpoints[0]) as ch:
            kv = stubs.KVStub(ch)
            doc = json.loads(kv.Range(pb.RangeRequest(key=key), timeout=5).kvs[0].value)
            doc["v"]["expireTime"] = doc["u"] = time.time() + 2  # ({"v": the resource, ...})
            kv.Put(pb.PutRequest(key=key, value=json.dumps(doc).encode()), timeout=5)
        wait_for(lambda: all(fresh.route_target(n) == US for n in fresh.live()), 15, what="back")
        writer = wait_for(fresh._leader_or_none, 10, what="a leader")
        wait_for(lambda: fresh._log_quiet(writer), 10, interval=0.5, what="a quiet log")
        records = [e for e in fresh.events(writer, after) if e["project"] == "web"]
        ends = [e for e in records if e["kind"] == "Change" and e["to"] == "shift-end"]
        assert len(ends) == 1, ends
        away = [e for e in records if e["kind"] == "Route" and "shifted away" in e["reason"]]
        assert len(away) == 1, away  # (one record, although the writer changed)
        wanted = [e["id"] for e in records if e["kind"] in ("Change", "Route")]
        wait_for(lambda: rec.acked() == wanted, 20, what="every record delivered once")
        httpx.post(
            a.url + "/v1/delete", json={"manifest": yaml.safe_dump(hook)}, timeout=10
        ).raise_for_status()


def test_a_ramp_is_the_same_on_every_node_and_outlives_its_writer(fresh: ClusterStack) -> None:
    """A ramped failback (SPEC §6): every node starts it at the same time
    (the NEG's transition), the leader killed in the middle comes back with
    it (stored, not in memory), and the log has one start and one end."""
    seconds = 20
    world = [
        dict(d, failoverPolicy={**d.get("failoverPolicy", {}), "failbackRampSec": seconds})
        if d["kind"] == "BackendService" and d["project"] == "web"
        else d
        for d in fresh.world
    ]
    fresh.apply(world)
    front = "/v1/projects/web/global/forwardingRules/shop-frontend"

    def ramp_starts() -> set[str]:
        return {r["start"] for n in fresh.live() for r in n.get(front)["status"]["route"]["ramps"]}

    try:
        a = fresh.nodes["a"]
        fresh.backends.set_mode(US, "refuse")
        wait_for(
            lambda: all(fresh.route_target(n) == EU for n in fresh.live()), 30, what="failover"
        )
        after = fresh.last_event_id(a)
        fresh.backends.set_mode(US, "ok")
        # (each node starts it when its own decision moves: moments apart)
        wait_for(
            lambda: all(n.get(front)["status"]["route"]["ramps"] for n in fresh.live()),
            30,
            what="a ramp on every node",
        )
        [start] = ramp_starts()  # (and at the same time: the NEG's transition)
        leader = fresh.leader()
        leader.kill()
        leader.start()
        leader.wait_ready()
        assert ramp_starts() == {start}  # (the restarted one too)
        shares = leader.get(front)["status"]["route"]["shares"]
        assert {s["region"] for s in shares} == {US, EU}, shares  # in the middle of it
        wait_for(
            lambda: all(
                [s["region"] for s in n.get(front)["status"]["route"]["shares"]] == [US]
                for n in fresh.live()
            ),
            seconds + 10,
            what="the ramp's end everywhere",
        )
        writer = wait_for(fresh._leader_or_none, 10, what="a leader")
        wait_for(lambda: fresh._log_quiet(writer), 10, interval=0.5, what="a quiet log")
        ramps = [e for e in fresh.events(writer, after) if e["kind"] == "Ramp"]
        assert [e["to"] for e in ramps] == ["STARTED", "ENDED"], ramps
        assert ramps[1]["time"] == pytest.approx(ramps[0]["time"] + seconds)
    finally:
        fresh.apply(fresh.world)


def test_a_rotated_secret_reaches_every_nodes_probes(fresh: ClusterStack) -> None:
    """SPEC §10 in cluster mode: a health check's header from a Secret; the
    secret rotated through one node reaches the probes of every node that
    probes us-east1 (a and b share it), without a restart, and back."""
    a, b, c = fresh.nodes["a"], fresh.nodes["b"], fresh.nodes["c"]
    secret = {"kind": "Secret", "name": "token", "project": "shop", "region": US}
    check = next(d for d in fresh.world if d["kind"] == "HealthCheck" and d["region"] == US)
    with_token = {
        **check,
        "requestPath": "/healthz",  # (the clients' requests go to /)
        "requestHeaders": [{"name": "Authorization", "valueFrom": {"secret": "token"}}],
    }
    url = f"/v1/projects/shop/regions/{US}/secrets/token"

    def rotate(node: Node, value: str) -> None:
        resp = httpx.put(node.url + url, json={**secret, "value": value}, timeout=10)
        assert resp.is_success, resp.text

    fresh.backends.backends.required[US] = (b"GET /healthz ", b"\r\nAuthorization: right\r\n")
    try:
        fresh.apply([{**secret, "value": "right"}, with_token], node=a)
        wait_for(lambda: all(fresh.all_endpoints_healthy(US, n) for n in fresh.live()), 15,
                 what="us-east1 HEALTHY with the token")  # fmt: skip
        assert "value" not in b.get(url) and b.get(url)["valueSet"] is True
        rotate(b, "wrong")
        wait_for(lambda: all(fresh.neg_state(US, n) == "UNHEALTHY" for n in fresh.live()), 15,
                 what="us-east1 UNHEALTHY everywhere")  # fmt: skip
        assert all(fresh.route_target(n) == EU for n in fresh.live())
        rotate(c, "right")
        wait_for(lambda: all(fresh.neg_state(US, n) == "HEALTHY" for n in fresh.live()), 15,
                 what="us-east1 HEALTHY again everywhere")  # fmt: skip
    finally:
        fresh.backends.backends.required.pop(US, None)
        fresh.apply([check], node=a)
        httpx.post(
            a.url + "/v1/delete",
            json={"manifest": yaml.safe_dump({**secret, "value": "right"})},
            timeout=10,
        ).raise_for_status()


def test_a_report_to_any_node_counts_on_every_node(fresh: ClusterStack) -> None:
    """SPEC §10's pushed health in cluster mode: us-east1's check made
    PUSH; a report sent to one node is every node's state (it is stored),
    and an UNHEALTHY one fails the region over on every node."""
    a, b, c = fresh.nodes["a"], fresh.nodes["b"], fresh.nodes["c"]
    check = next(d for d in fresh.world if d["kind"] == "HealthCheck" and d["region"] == US)
    push = {k: v for k, v in check.items() if k in ("kind", "name", "project", "region")}
    push.update(type="PUSH", ttlSec=600)
    health = f"/v1/projects/shop/regions/{US}/backendServices/web/health"
    report = f"/v1/projects/shop/regions/{US}/backendServices/web/endpoints:report"
    eps = [f"{e['ipAddress']}:{e['port']}" for e in a.get(health)["healthStatus"]]

    def states(node: Node) -> set[str]:
        return {e["healthState"] for e in node.get(health)["healthStatus"]}

    def send(node: Node, state: str) -> None:
        for ep in eps:
            body = {"endpoint": ep, "state": state, "note": f"from {node.name}"}
            httpx.post(node.url + report, json=body, timeout=10).raise_for_status()

    try:
        fresh.apply([push], node=a)
        send(b, "HEALTHY")
        wait_for(lambda: all(states(n) == {"HEALTHY"} for n in fresh.live()), 10,
                 what="every node HEALTHY from b's reports")  # fmt: skip
        assert "from b" in c.get(health)["healthStatus"][0]["reason"]
        send(c, "UNHEALTHY")
        wait_for(lambda: all(fresh.route_target(n) == EU for n in fresh.live()), 10,
                 what="every node fails us-east1 over")  # fmt: skip
        send(a, "HEALTHY")
        wait_for(lambda: all(fresh.route_target(n) == US for n in fresh.live()), 10,
                 what="back on every node")  # fmt: skip
    finally:
        fresh.apply([check], node=a)


def test_a_practice_run_is_started_and_ended_once_by_the_writer(fresh: ClusterStack) -> None:
    """SPEC §11 in cluster mode: a run whose window opens now is started by
    the elected writer alone - one shift, one STARTED, every node's route
    moves; the writer killed mid-run, the next one takes the run over from
    its shift in the store and, when the shift is ended by hand, records
    CANCELLED once."""
    a = fresh.nodes["a"]
    after = fresh.last_event_id(a)
    now = time.gmtime()
    run = {
        "kind": "PracticeRun", "name": "drill", "project": "web", "awayFrom": US,
        "durationSec": 600, "schedule": {"startUtc": time.strftime("%H:%M", now), "windowMin": 5},
    }  # fmt: skip
    fresh.apply([run], node=a)
    try:
        wait_for(lambda: all(fresh.route_target(n) == EU for n in fresh.live()), 10,
                 what="every node moved by the run")  # fmt: skip
        shifts = a.get("/v1/projects/web/shifts")["items"]
        assert [s["actor"] for s in shifts] == ["practice-run/drill"], shifts
        leader = fresh.leader()
        leader.kill()
        writer = wait_for(fresh._leader_or_none, 15, what="a new leader")
        time.sleep(1.5)  # (its first tick: the run under way, from the store)
        ended = httpx.delete(f"{writer.url}/v1/projects/web/shifts/{shifts[0]['name']}", timeout=10)
        assert ended.status_code == 200, ended.text
        wait_for(lambda: fresh.route_target(writer) == US, 10, what="traffic back")

        def phases() -> list[str]:
            return [e["to"] for e in fresh.events(writer, after) if e["kind"] == "PracticeRun"]

        wait_for(lambda: phases() == ["STARTED", "CANCELLED"], 10, what="STARTED, CANCELLED")
        status = writer.get("/v1/projects/web/global/practiceRuns/drill")["status"]
        assert status["last"]["to"] == "CANCELLED" and "ended by hand" in status["last"]["reason"]
        leader.start()
        leader.wait_ready()
        time.sleep(1.5)
        assert phases() == ["STARTED", "CANCELLED"]  # (never twice in one window)
    finally:
        httpx.post(
            a.url + "/v1/delete", json={"manifest": yaml.safe_dump(run)}, timeout=10
        ).raise_for_status()


def test_every_nodes_receipts_in_one_get_and_no_etcd_write_for_them(fresh: ClusterStack) -> None:
    """SPEC §11 in cluster mode: the front end's listeners on a and b (its
    dataPlaneRegion's nodes) each report applying a decision; a GET on any
    node - c too, which serves no listener of it - merges every node's
    receipts, asking the others over their APIs; the receipts cost etcd no
    write (its revision moves by the decision's own records and states)."""
    a, c = fresh.nodes["a"], fresh.nodes["c"]
    front = "/v1/projects/web/global/forwardingRules/shop-frontend"

    def healthgate_receipts(node: Node) -> set[str]:
        status = node.get(front)["status"]
        return {
            str(r["node"])
            for r in status.get("convergence", [])
            if r["dataPlane"] == "healthgate" and r["appliedAfterMs"] is not None
        }

    fresh.backends.set_mode(US, "refuse")
    wait_for(lambda: all(fresh.route_target(n) == EU for n in fresh.live()), 15, what="failover")
    wait_for(lambda: healthgate_receipts(c) == {"a", "b"}, 5, what="a's and b's receipts on c")
    status = c.get(front)["status"]
    assert status["convergenceNodes"] == {"a": "same decision", "b": "same decision"}, status
    assert status["decision"]["decision"] == "shop-us -> shop-eu"
    assert all(r["appliedAfterMs"] < 1000 for r in status["convergence"]), status
    own = c.get(front + "/convergence?scope=node")
    assert own["node"] == "c" and own["receipts"] == []  # (c serves no listener of it)
    assert healthgate_receipts(a) == {"a", "b"}
    # etcd's revision while the receipts are asked for again and again: no write
    wait_for(lambda: fresh._log_quiet(fresh.leader()), 10, interval=0.5, what="a quiet log")
    with fresh.etcd.channel(fresh.etcd.endpoints[0]) as ch:
        kv = stubs.KVStub(ch)
        before = kv.Range(pb.RangeRequest(key=b"/"), timeout=5).header.revision
        for _ in range(20):
            healthgate_receipts(a)
        after = kv.Range(pb.RangeRequest(key=b"/"), timeout=5).header.revision
    assert after == before, (before, after)


def test_a_replay_on_any_node_reads_each_endpoints_history_from_its_prober(
    fresh: ClusterStack,
) -> None:
    """SPEC §11 in cluster mode: us-east1 blinks; node c (which probes only
    europe-west1) replays the window: the us-east1 endpoints' histories come
    from a and b, and every recorded route change is reproduced."""
    c = fresh.nodes["c"]
    since = time.time()
    time.sleep(1.0)
    fresh.backends.set_mode(US, "refuse")
    wait_for(lambda: all(fresh.route_target(n) == EU for n in fresh.live()), 15, what="failover")
    fresh.backends.set_mode(US, "ok")
    wait_for(lambda: all(fresh.route_target(n) == US for n in fresh.live()), 15, what="failback")
    writer = wait_for(fresh._leader_or_none, 10, what="a leader")
    wait_for(lambda: fresh._log_quiet(writer), 10, interval=0.5, what="a quiet log")
    until = time.time()
    resp = httpx.post(c.url + "/v1/replay", json={"from": since, "to": until}, timeout=60)
    assert resp.status_code == 200, resp.text
    report = resp.json()
    assert report["endpoints"] == 6 and not report["historyTruncated"], report["noHistory"]
    routes = [r for r in report["rows"] if r["kind"] == "Route"]
    assert len(routes) == 2 and all(r["same"] for r in routes), routes
    assert report["firstDifference"] is None, report["firstDifference"]


def test_the_opinions_of_an_endpoint_gone_are_deleted_and_it_comes_back_clean(
    fresh: ClusterStack,
) -> None:
    """An endpoint removed from the world leaves no opinion behind in etcd
    (cluster/sweeper.py: the leader deletes it at its second look); added
    again, it is probed and decided as a new one, and nothing else moves."""
    a = fresh.nodes["a"]
    neg = next(
        d for d in fresh.world if d["kind"] == "NetworkEndpointGroup" and d.get("endpoints")
        and d["region"] == US
    )  # fmt: skip
    gone = neg["endpoints"][-1]
    body = a.get(f"/v1/projects/shop/regions/{US}/backendServices/web/health")
    key = f"o/{body['backendService']}/endpoints/{gone['ipAddress']}:{gone['port']}/{US}"
    store = EtcdStore(fresh.etcd.endpoints)
    try:

        def opinion() -> bool:
            return bool(store.client.list_prefix(key)[1])

        assert opinion()
        after = fresh.last_event_id(a)
        fresh.apply([{**neg, "endpoints": neg["endpoints"][:-1]}], node=a)
        wait_for(lambda: not opinion(), 15, what="its opinion deleted")
        swept = sum(n.cluster()["opinionsSwept"] for n in fresh.live())
        assert swept >= 1
        fresh.apply([neg], node=a)
        wait_for(opinion, 15, what="a new opinion of it")
        wait_for(lambda: all(fresh.all_endpoints_healthy(US, n) for n in fresh.live()), 15,
                 what="every us-east1 endpoint HEALTHY again")  # fmt: skip
        moved = [e for e in transitions_since(fresh, a, after) if e["kind"] != "Change"]
        assert moved == [], moved
        assert all(fresh.route_target(n) == US for n in fresh.live())
    finally:
        store.close()


def test_the_opinions_of_a_vantage_dropped_are_deleted(fresh: ClusterStack) -> None:
    """A health check that stops listing a vantage region leaves none of
    that vantage's opinions behind in etcd (cluster/sweeper.py: nobody
    probes from there any more, and the quorum no longer counts them); the
    endpoints' own region's opinions stay, and nothing moves."""
    a = fresh.nodes["a"]
    body = a.get(f"/v1/projects/shop/regions/{US}/backendServices/web/health")
    endpoints = len(body["healthStatus"])
    prefix = f"o/{body['backendService']}/endpoints/"
    widened = [
        dict(d, vantageRegions=[EU]) if d["kind"] == "HealthCheck" and d["region"] == US else d
        for d in fresh.world
    ]
    store = EtcdStore(fresh.etcd.endpoints)
    try:

        def opinions(vantage: str) -> int:
            keys = [kv.key for kv in store.client.list_prefix(prefix)[1]]
            return sum(key.rsplit("/", 1)[1] == vantage for key in keys)

        after = fresh.last_event_id(a)
        fresh.apply(widened, node=a)
        try:
            wait_for(lambda: opinions(EU) == endpoints, 15,
                     what="europe-west1's opinion of every us-east1 endpoint")  # fmt: skip
        finally:
            fresh.apply(fresh.world, node=a)
        wait_for(lambda: opinions(EU) == 0, 15, what="europe-west1's opinions deleted")
        assert opinions(US) == endpoints
        moved = [e for e in transitions_since(fresh, a, after) if e["kind"] != "Change"]
        assert moved == [], moved
        assert all(fresh.route_target(n) == US for n in fresh.live())
    finally:
        store.close()


def test_saved_states_of_resources_gone_while_no_node_led_are_deleted(
    fresh: ClusterStack,
) -> None:
    """Saved states the leader's forgetting never saw (their resources left
    while no node led: written here straight into etcd) are deleted by the
    leader's sweep; the states of resources in the world stay."""
    a = fresh.nodes["a"]
    body = a.get(f"/v1/projects/shop/regions/{US}/backendServices/web/health")
    bs = body["backendService"]
    live = {f"endpoint/{bs}/endpoints/{e['ipAddress']}:{e['port']}" for e in body["healthStatus"]}
    stale = {
        f"endpoint/{bs}/endpoints/10.9.9.9:80": {"state": "HEALTHY", "since": 1.7e9},
        f"node/projects/shop/regions/{US}/networkEndpointGroups/gone": {
            "state": "HEALTHY", "reason": "long gone", "since": 1.7e9
        },
    }  # fmt: skip
    store = EtcdStore(fresh.etcd.endpoints)
    try:
        kept = live & set(store.load_states())  # (us-east1's endpoints: in the world)
        assert kept, store.load_states().keys()
        store.save_states(stale)
        wait_for(lambda: not set(stale) & set(store.load_states()), 15,
                 what="the stale saved states deleted")  # fmt: skip
        assert kept <= set(store.load_states())
        assert sum(n.cluster()["statesSwept"] for n in fresh.live()) >= len(stale)
    finally:
        store.close()
