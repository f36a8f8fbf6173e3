"""The DNS server's answers, on the wire, without sockets (dnspython both ways)."""

from __future__ import annotations

import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdatatype
import pytest

from healthgate.health.engine import HealthEngine
from healthgate.integrations.dns import DnsDirectory, handle
from tests.helpers import OK, TIMEOUT, example_dicts, feed, find, resources


def directory(break_us: bool = False, when_all: str = "FAIL_OPEN") -> DnsDirectory:
    dicts = example_dicts()
    front = find(dicts, "ForwardingRule", "shop-frontend")
    front.update(dnsName="Shop.Example.Test.", dnsTtlSec=7)
    find(dicts, "BackendService", "shop", "global")["failoverPolicy"] = {
        "whenAllUnhealthy": when_all
    }
    engine = HealthEngine()
    world = resources(dicts)
    engine.apply(world, 0.0)
    feed(engine, 1.0, OK, times=3)
    if break_us:
        feed(engine, 2.0, TIMEOUT, "127.0.1.", times=3)
    if when_all == "FAIL_CLOSED":
        feed(engine, 2.0, TIMEOUT, times=3)
    d = DnsDirectory(engine)
    d.update({r.path: r for r in world})
    return d


def ask(d: DnsDirectory, name: str, rtype: str = "A", **kw: object) -> dns.message.Message:
    query = dns.message.make_query(name, rtype, **kw)  # type: ignore[arg-type]
    wire = handle(d, query.to_wire(), 512)
    assert wire is not None
    return dns.message.from_wire(wire)


def addresses(msg: dns.message.Message) -> list[tuple[str, int]]:
    return [(rd.address, rrset.ttl) for rrset in msg.answer for rd in rrset]


@pytest.mark.parametrize(
    ("broken", "when_all", "expected"),
    [(False, "FAIL_OPEN", "us"), (True, "FAIL_OPEN", "eu"), (False, "FAIL_CLOSED", None)],
)
def test_the_a_record_is_the_routed_regions_producer_address(
    broken: bool, when_all: str, expected: str | None
) -> None:
    d = directory(broken, when_all)
    msg = ask(d, "shop.example.test")  # (names are case-insensitive, the trailing dot optional)
    assert msg.rcode() == dns.rcode.NOERROR and msg.flags & dns.flags.AA
    ips = {"us": addresses_for(d, "us-east1"), "eu": addresses_for(d, "europe-west1")}
    assert addresses(msg) == ([(ips[expected], 7)] if expected else [])
    if expected is None:
        assert msg.authority and msg.authority[0].rdtype == dns.rdatatype.SOA  # NODATA


def addresses_for(d: DnsDirectory, region: str) -> str:
    att = f"projects/shop/regions/{region}/serviceAttachments/web-attachment"
    return d._addresses[att]


def test_other_names_types_and_messages() -> None:
    d = directory()
    assert ask(d, "nope.example.test").rcode() == dns.rcode.NXDOMAIN
    refused = ask(d, "example.org")
    assert refused.rcode() == dns.rcode.REFUSED and not refused.flags & dns.flags.AA
    nodata = ask(d, "shop.example.test", "TXT")
    assert nodata.rcode() == dns.rcode.NOERROR and not nodata.answer and nodata.authority
    soa = ask(d, "example.test", "SOA")
    assert soa.answer[0].rdtype == dns.rdatatype.SOA
    update = dns.message.make_query("example.test", "SOA")
    update.set_opcode(dns.opcode.NOTIFY)
    wire = handle(d, update.to_wire(), 512)
    assert wire is not None and dns.message.from_wire(wire).rcode() == dns.rcode.NOTIMP
    garbage = b"\x12\x34" + b"\x00" * 10 + b"\xff" * 20
    reply = handle(d, garbage, 512)
    assert reply is not None and reply[:2] == b"\x12\x34"  # FORMERR, with the query's id
    assert dns.message.from_wire(reply).rcode() == dns.rcode.FORMERR
    assert handle(d, b"\x00", 512) is None  # not even a header: no answer
    response = dns.message.make_response(dns.message.make_query("shop.example.test", "A"))
    assert handle(d, response.to_wire(), 512) is None  # a response is never answered


def test_a_split_route_answers_a_degraded_region_only_when_nothing_healthy_is_left() -> None:
    """SPEC §9: resolvers cache what they get, so a DEGRADED region's share
    of a split (70/30 by trafficDial) is left out of the answers."""
    from healthgate.health.states import Outcome, ProbeResult

    dicts = example_dicts()
    find(dicts, "ForwardingRule", "shop-frontend").update(dnsName="shop.example.test.")
    find(dicts, "BackendService", "shop", "global")["backends"][0]["trafficDial"] = 70
    engine = HealthEngine()
    world = resources(dicts)
    engine.apply(world, 0.0)
    feed(engine, 1.0, OK, times=3)
    d = DnsDirectory(engine)
    d.update({r.path: r for r in world})
    us, eu = addresses_for(d, "us-east1"), addresses_for(d, "europe-west1")
    seen = {addresses(ask(d, "shop.example.test"))[0][0] for _ in range(60)}
    assert seen == {us, eu}  # (both shares answered: 0.7^60 for none of eu's)
    feed(engine, 2.0, ProbeResult(Outcome.DEGRADED, 0.01, 429), "127.0.2.", times=3)
    assert (
        engine.route_table()
        .routes["projects/web/global/forwardingRules/shop-frontend"]
        .shares[1]
        .region
        == "europe-west1"
    )  # (it keeps its share for the data plane)
    seen = {addresses(ask(d, "shop.example.test"))[0][0] for _ in range(60)}
    assert seen == {us}
