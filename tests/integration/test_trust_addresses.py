"""SPEC §7 "Addresses", as a tenant would try it: endpoints at this machine
or the metadata service, a rule listening everywhere, a rule on serve's own
address (which used to keep the next start from answering at all)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import yaml

from healthgate.api.app import ApiSettings
from healthgate.model.addresses import AddressPolicy
from tests.helpers import run_async
from tests.inprocess import InProcessApi
from tests.integration.serve_proc import ServeProcess, wait_for
from tests.integration.servers import free_port

PRODUCER = {"token": "p" * 24, "project": "shop", "role": "producer"}
ADMIN = {"token": "a" * 24, "project": "*", "role": "admin"}


def neg(*ips: str) -> dict[str, Any]:
    return {
        "kind": "NetworkEndpointGroup",
        "project": "shop",
        "region": "us-east1",
        "name": "neg",
        "networkEndpointType": "GCE_VM_IP_PORT",
        "endpoints": [{"ipAddress": ip, "port": 8080} for ip in ips],
    }


def apply_as(token: dict[str, str], docs: list[dict[str, Any]], allow: tuple[str, ...] = ()) -> Any:
    async def go() -> Any:
        settings = ApiSettings(address_policy=AddressPolicy.parse(allow))
        async with InProcessApi([PRODUCER, ADMIN], settings=settings) as api:
            assert api.client is not None
            r = await api.client.post(
                "/v1/apply",
                json={"manifest": yaml.safe_dump_all(docs)},
                headers={"Authorization": f"Bearer {token['token']}"},
            )
            return r.status_code, r.json()

    return run_async(go())


@pytest.mark.parametrize(
    ("ip", "rule"),
    [
        ("169.254.169.254", "metadata service"),
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("fe80::1", "link-local"),
    ],
)
def test_a_producer_may_not_point_endpoints_at_this_machine_or_the_metadata_service(
    ip: str, rule: str
) -> None:
    code, body = apply_as(PRODUCER, [neg("10.0.0.1", ip)])
    assert code == 400, body
    details = body["error"]["details"]
    assert [d["field"] for d in details] == ["endpoints[1].ipAddress"]
    assert rule in details[0]["description"] and "--allow-addresses" in details[0]["description"]


def test_a_producer_may_not_listen_everywhere_but_private_addresses_are_fine() -> None:
    rule = {
        "kind": "ForwardingRule",
        "project": "shop",
        "region": "us-east1",
        "name": "fr",
        "IPAddress": "0.0.0.0",
        "ports": [9000],
        "loadBalancingScheme": "INTERNAL_MANAGED",
        "backendService": "bs",
    }
    code, body = apply_as(PRODUCER, [rule])
    assert code == 400 and body["error"]["details"][0]["field"] == "IPAddress", body
    code, body = apply_as(PRODUCER, [neg("10.0.0.1", "192.168.1.7")])
    assert code == 200, body


def test_an_admin_or_an_allowed_range_may() -> None:
    assert apply_as(ADMIN, [neg("127.0.0.1")])[0] == 200
    assert apply_as(PRODUCER, [neg("127.0.0.1")], allow=("127.0.0.0/8",))[0] == 200
    # a range admits itself only: the metadata address stays refused
    code, body = apply_as(PRODUCER, [neg("169.254.169.254")], allow=("127.0.0.0/8",))
    assert code == 400, body


def rule_on(ip: str, port: int, name: str = "squatter") -> list[dict[str, Any]]:
    base = {"project": "shop", "region": "us-east1"}
    return [
        {**base, "kind": "HealthCheck", "name": "hc", "type": "TCP", "port": 8080},
        {**neg("127.0.1.1"), "name": "neg"},
        {
            **base,
            "kind": "BackendService",
            "name": "bs",
            "loadBalancingScheme": "INTERNAL_MANAGED",
            "protocol": "TCP",
            "healthChecks": ["hc"],
            "backends": [{"group": "neg"}],
        },
        {
            **base,
            "kind": "ForwardingRule",
            "name": name,
            "IPAddress": ip,
            "ports": [port],
            "loadBalancingScheme": "INTERNAL_MANAGED",
            "backendService": "bs",
        },
    ]


def test_no_rule_may_take_serves_own_address_not_even_an_admins(tmp_path: Path) -> None:
    dns_port = free_port()
    with (
        ServeProcess(tmp_path / "own.db", "--dns", f"127.0.0.1:{dns_port}") as s,
        s.client() as api,
    ):
        for ip, port, what in (
            ("127.0.0.1", s.port, "--listen"),
            ("0.0.0.0", s.port, "--listen"),  # (a wildcard overlaps it)
            ("127.0.0.1", dns_port, "--dns"),
        ):
            r = api.post("/v1/apply", json={"manifest": yaml.safe_dump_all(rule_on(ip, port))})
            assert r.status_code == 400, r.text
            detail = r.json()["error"]["details"][0]
            assert detail["field"] == "IPAddress" and what in detail["description"], detail
        ok = api.post("/v1/apply", json={"manifest": yaml.safe_dump_all(rule_on("127.0.0.1", 1))})
        assert ok.status_code == 200, ok.text


def test_a_stored_rule_on_serves_address_is_skipped_and_can_be_deleted(tmp_path: Path) -> None:
    """The issue's trap: the data plane bound first, so a rule on the API's
    port made the next start exit "address in use" - and the rule could no
    longer be deleted through the API."""
    db = tmp_path / "trap.db"
    port = free_port()
    with ServeProcess(db, port=port) as s, s.client() as api:
        r = api.post("/v1/apply", json={"manifest": yaml.safe_dump_all(rule_on("127.0.0.1", 1))})
        assert r.status_code == 200, r.text
    # a rule on the API's port written straight into the store (as an older
    # version, or another node with another --listen, could have)
    with sqlite3.connect(db) as conn:
        (value,) = conn.execute(
            "SELECT value FROM documents WHERE key LIKE '%forwardingRules/squatter'"
        ).fetchone()
        doc = json.loads(value)
        doc["ports"] = [port]
        conn.execute(
            "UPDATE documents SET value = ? WHERE key LIKE '%forwardingRules/squatter'",
            (json.dumps(doc, sort_keys=True),),
        )
    with ServeProcess(db, port=port) as s, s.client() as api:
        fr = "/v1/projects/shop/regions/us-east1/forwardingRules/squatter"
        listener = wait_for(
            lambda: api.get(fr).json().get("status", {}).get("listener"), 10, what="its status"
        )
        assert "serve's own address (--listen)" in str(listener), listener
        assert "not listening" in s.log.read_text()
        assert api.delete(fr).status_code == 200
        assert api.get(fr).status_code == 404


# every spelling of an address the policy refuses (issue 38): a producer's
# endpoint there is refused, and the description says what it carries
SPELLINGS = [
    ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped: stored as 127.0.0.1
    ("::127.0.0.1", "loopback"),  # IPv4-compatible
    ("::ffff:0:127.0.0.1", "loopback"),  # IPv4-translated
    ("::ffff:169.254.169.254", "link-local"),
    ("64:ff9b::127.0.0.1", "loopback"),  # NAT64, the well-known prefix
    ("64:ff9b::a9fe:a9fe", "link-local"),  # ... the metadata address through it
    ("64:ff9b:1:7f00:0:100::", "loopback"),  # NAT64, local use (RFC 8215, /48)
    ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
    ("2002:a9fe:a9fe::1", "link-local"),
    ("fd00:ec2::254", "metadata"),  # AWS over IPv6
    ("fd20:ce::254", "metadata"),  # Google over IPv6
    ("100.100.100.200", "metadata"),  # Alibaba
    ("168.63.129.16", "metadata"),  # Azure's wire server
    ("0.1.2.3", "unspecified"),  # "this network": Linux connects it to this machine
    ("224.0.0.1", "multicast"),
    ("::ffff:0.0.0.0", "unspecified"),
]


@pytest.mark.parametrize(("ip", "rule"), SPELLINGS)
def test_the_policy_holds_for_every_spelling(ip: str, rule: str) -> None:
    policy = AddressPolicy()
    why = policy.refusal(ip)
    assert why is not None and rule in why, (ip, why)
    # a range admits what it covers, however it is written
    assert AddressPolicy.parse(["127.0.0.0/8"]).refusal("::ffff:127.0.0.1") is None


def test_an_endpoint_in_another_spelling_is_refused_through_the_api() -> None:
    code, body = apply_as(PRODUCER, [neg("10.0.0.1", "::ffff:127.0.0.1", "64:ff9b::7f00:1")])
    assert code == 400, body
    fields = {d["field"]: d["description"] for d in body["error"]["details"]}
    assert set(fields) == {"endpoints[1].ipAddress", "endpoints[2].ipAddress"}
    assert "loopback" in fields["endpoints[1].ipAddress"]
    assert "carries 127.0.0.1" in fields["endpoints[2].ipAddress"]


def test_a_mapped_address_is_stored_as_the_ipv4_address_it_is() -> None:
    from healthgate.model.resource import normalise_ip

    assert normalise_ip("::ffff:10.1.2.3") == "10.1.2.3"
    assert normalise_ip("::FFFF:0A01:0203") == "10.1.2.3"
    assert normalise_ip("2001:DB8::1") == "2001:db8::1"


def test_a_udp_rule_on_a_mapped_wildcard_is_a_wildcard() -> None:
    rule = {**rule_on("::ffff:0.0.0.0", 9000)[3], "IPProtocol": "UDP"}
    code, body = apply_as(PRODUCER, [rule])
    assert code == 400, body
    assert "unspecified" in body["error"]["details"][0]["description"]


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [
        ("0.0.0.0", "127.0.0.1", True),
        ("::", "127.0.0.1", True),  # a dual-stack wildcard covers IPv4 too
        ("::", "::1", True),
        ("0.0.0.0", "::1", False),
        ("::ffff:127.0.0.1", "127.0.0.1", True),  # parsed, not compared as text
        ("0:0:0:0:0:0:0:1", "::1", True),
        ("127.0.0.1", "127.0.0.2", False),
    ],
)
def test_listen_addresses_are_compared_parsed(a: str, b: str, want: bool) -> None:
    from healthgate.model.addresses import overlaps

    assert overlaps(a, b) is want and overlaps(b, a) is want


def test_a_webhook_to_a_loopback_spelling_is_refused() -> None:
    hook = {
        "kind": "Webhook",
        "project": "shop",
        "name": "hook",
        "url": "http://[::ffff:127.0.0.1]:9/hook",
        "secret": "0123456789abcdef0123",
    }
    code, body = apply_as(PRODUCER, [hook])
    assert code == 400, body
    assert body["error"]["details"][0]["field"] == "url"


# ---------------------------------------------------------------- ports (issue 38)


def test_a_rule_may_listen_on_a_bounded_number_of_ports() -> None:
    wide = {**rule_on("10.0.0.1", 8000)[3], "ports": None, "portRange": "8000-10000"}
    del wide["ports"]
    code, body = apply_as(ADMIN, [*rule_on("10.0.0.1", 1)[:3], wide])
    assert code == 400, body
    detail = body["error"]["details"][0]
    assert detail["field"] == "portRange" and "at most 100 ports" in detail["description"]


def test_a_project_may_listen_on_a_bounded_number_of_ports() -> None:
    docs = rule_on("10.0.0.1", 1)[:3]
    for i in range(11):
        rule = {
            **rule_on("10.0.0.1", 1, f"fr-{i}")[3],
            "portRange": f"{1000 + 100 * i}-{1099 + 100 * i}",
        }
        del rule["ports"]
        docs.append(rule)
    code, body = apply_as(ADMIN, docs[:13])  # 10 rules of 100 ports: the project's share
    assert code == 200, body
    code, body = apply_as(ADMIN, docs)  # (an admin's too)
    assert code == 400, body
    detail = body["error"]["details"][0]
    assert detail["field"] == "portRange" and "more than the 1000" in detail["description"]


def test_rules_past_the_data_planes_sockets_get_no_listener_until_they_fit() -> None:
    from healthgate.dataplane.manager import DataPlane, DataPlaneSettings
    from healthgate.health.engine import HealthEngine
    from tests.helpers import resources

    base = rule_on("127.0.0.1", 1)[:3]
    ports = [free_port() for _ in range(6)]

    def rule(name: str, first: int) -> dict[str, Any]:
        return {**rule_on("127.0.0.1", 1, name)[3], "ports": ports[first : first + 3]}

    async def go() -> None:
        engine = HealthEngine()
        dp = DataPlane(engine, DataPlaneSettings(max_listening_sockets=5))
        world = {r.path: r for r in resources([*base, rule("a", 0), rule("b", 3)])}
        await dp.sync(world)
        errors = {p.rsplit("/", 1)[1]: li.error for p, li in dp.listeners.items()}
        assert errors["a"] is None
        assert errors["b"] is not None and "5 listening sockets" in errors["b"]
        # "a" goes: "b" fits now, at the next sync
        await dp.sync({r.path: r for r in resources([*base, rule("b", 3)])})
        (only,) = dp.listeners.values()
        assert only.error is None and len(only.servers) == 3
        await dp.close()

    run_async(go())


def test_serve_starts_with_a_stored_rule_that_does_not_fit(tmp_path: Path) -> None:
    """The issue's trap: a stored rule of 2,000 ports took every descriptor,
    and serve could not start again while it was stored."""
    db = tmp_path / "ports.db"
    with ServeProcess(db) as s, s.client() as api:
        r = api.post("/v1/apply", json={"manifest": yaml.safe_dump_all(rule_on("127.0.0.1", 1))})
        assert r.status_code == 200, r.text
    with sqlite3.connect(db) as conn:  # as an older version could have stored it
        (value,) = conn.execute(
            "SELECT value FROM documents WHERE key LIKE '%forwardingRules/squatter'"
        ).fetchone()
        doc = json.loads(value)
        del doc["ports"]
        doc["portRange"] = "20000-21999"
        conn.execute(
            "UPDATE documents SET value = ? WHERE key LIKE '%forwardingRules/squatter'",
            (json.dumps(doc, sort_keys=True),),
        )
    with ServeProcess(db) as s, s.client() as api:
        assert api.get("/healthz").status_code == 200  # it starts, and answers
        assert "at most 100 ports a rule" in s.log.read_text()  # what it skipped, and why
        fr = "/v1/projects/shop/regions/us-east1/forwardingRules/squatter"
        assert api.get(fr).status_code == 404
        # a corrected rule written over it is served
        r = api.post("/v1/apply", json={"manifest": yaml.safe_dump_all(rule_on("127.0.0.1", 1))})
        assert r.status_code == 200, r.text
