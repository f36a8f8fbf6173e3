"""`serve --dns` asked by Debian's `dig`, over UDP and TCP: the routed
region's address with the rule's TTL, the answers an authoritative server
gives for other names, and the answer moving when a region breaks and
coming back when it heals."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_failover import Stack
from tests.integration.serve_proc import wait_for
from tests.integration.servers import free_port

pytestmark = pytest.mark.skipif(
    shutil.which("dig") is None, reason="needs Debian's bind9-dnsutils (make test installs it)"
)

NAME = "shop.example.test"


def dig(port: int, name: str, rtype: str = "A", tcp: bool = False) -> tuple[str, list[str]]:
    """(status, answer lines) as dig prints them."""
    cmd = ["dig", "@127.0.0.1", "-p", str(port), name, rtype, "+time=2", "+tries=1"]
    cmd += ["+tcp"] if tcp else ["+notcp"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False).stdout
    status = out.split("status: ", 1)[1].split(",", 1)[0] if "status: " in out else "NO ANSWER"
    answers, section = [], None
    for line in out.splitlines():
        if line.startswith(";; ANSWER SECTION"):
            section = "answer"
        elif line.startswith(";;"):
            section = None
        elif section == "answer" and line.strip():
            answers.append(" ".join(line.split()))
    return status, answers


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Stack, int]]:
    dns_port = free_port()
    with Stack(tmp_path, "--dns", f"127.0.0.1:{dns_port}") as st:
        world = st.world()
        for d in world:
            if d["kind"] == "ForwardingRule" and d["project"] == "web":
                d.update(dnsName=NAME + ".", dnsTtlSec=1)
        st.apply(world)
        yield st, dns_port


def address_of(answers: list[str]) -> str | None:
    return answers[0].split()[-1] if answers else None


def test_dig_gets_the_routed_regions_address_and_authoritative_answers(
    stack: tuple[Stack, int],
) -> None:
    _, port = stack
    for tcp in (False, True):
        status, answers = dig(port, NAME, tcp=tcp)
        assert status == "NOERROR"
        assert answers == [f"{NAME}. 1 IN A 127.0.1.100"], answers  # us-east1's producer rule
    assert dig(port, "nope.example.test")[0] == "NXDOMAIN"
    assert dig(port, "www.example.org")[0] == "REFUSED"
    status, answers = dig(port, NAME, "AAAA")
    assert (status, answers) == ("NOERROR", [])  # NODATA: the name exists, no AAAA
    status, answers = dig(port, "example.test", "SOA", tcp=True)
    assert status == "NOERROR" and answers[0].split()[3] == "SOA"
    assert dig(port, "example.test", "NS")[1] == ["example.test. 60 IN NS ns.example.test."]


def test_the_answer_moves_when_a_region_breaks_and_comes_back(stack: tuple[Stack, int]) -> None:
    st, port = stack
    assert address_of(dig(port, NAME)[1]) == "127.0.1.100"
    st.backends.set_mode("us-east1", "refuse")
    broke = time.monotonic()
    wait_for(lambda: address_of(dig(port, NAME)[1]) == "127.0.2.100", 20, what="failover")
    moved = time.monotonic()
    print(f"DNS answer moved {moved - broke:.2f} s after the break (+ TTL 1 s for clients)")
    st.backends.set_mode("us-east1", "ok")
    wait_for(lambda: address_of(dig(port, NAME)[1]) == "127.0.1.100", 20, what="failback")
    print(f"... and back {time.monotonic() - moved:.2f} s after the heal")


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs Debian's haproxy")
def test_haproxy_resolving_the_name_moves_its_traffic(tmp_path: Path) -> None:
    """A real HAProxy whose one server is the DNS name (a `resolvers` section
    with `hold obsolete 0s`, so an address that left the answer is dropped at
    once): a region breaks -> HAProxy's traffic moves within the detection
    window + TTL + its resolve interval."""
    from tests.e2e.harness import break_and_time, one_port_on
    from tests.e2e.test_haproxy import HAProxy

    dns_port = free_port()
    prod = one_port_on("127.0.1.100", "127.0.2.100")  # both regions on one port
    with Stack(tmp_path, "--dns", f"127.0.0.1:{dns_port}", prod=(prod, prod)) as st:
        world = st.world()
        for d in world:
            if d["kind"] == "ForwardingRule" and d["project"] == "web":
                d.update(dnsName=NAME, dnsTtlSec=1)
        st.apply(world)
        section = (
            "resolvers healthgate\n"
            f"    nameserver hg 127.0.0.1:{dns_port}\n"
            "    hold valid 1s\n"
            "    hold obsolete 0s\n"
            "    hold nx 1s\n"
            "    timeout resolve 500ms\n"
            "    timeout retry 500ms\n"
            "backend shop-frontend\n"
            f"    server-template region 1 {NAME}:{prod} resolvers healthgate"
            " init-addr none resolve-prefer ipv4\n"
        )
        with HAProxy(tmp_path, section) as hp:
            wait_for(lambda: hp.region_served() == "us-east1", 15, what="HAProxy resolved us")
            decided, moved = break_and_time(st.neg_state, st.backends.set_mode, hp.region_served)
            print(
                f"HAProxy via DNS: healthgate decided {decided:.2f} s after the break, "
                f"HAProxy's traffic moved {moved:.2f} s later (TTL 1 s, hold valid 1 s)"
            )
            assert moved < 4


def test_a_dialled_route_is_answered_by_weight(stack: tuple[Stack, int]) -> None:
    """trafficDial 70 (SPEC §6): each answer is drawn by share."""
    st, port = stack
    url = "/v1/projects/web/global/backendServices/shop"
    body = {k: v for k, v in st.api.get(url).json().items() if k != "status"}
    body["backends"][0]["trafficDial"] = 70
    assert st.api.put(url, json=body).is_success
    answers: dict[str | None, int] = {}

    def both() -> bool:
        answers.clear()
        for _ in range(150):
            address = address_of(dig(port, NAME)[1])
            answers[address] = answers.get(address, 0) + 1
        return len(answers) == 2

    wait_for(both, 20, interval=0.2, what="answers for both regions")
    us = 100 * answers["127.0.1.100"] / 150
    print(f"\nDNS with a 70/30 route: {answers} = {us:.1f}% us-east1")
    assert abs(us - 70) <= 12, answers  # 150 draws of p = 0.7: one standard deviation is 3.7
