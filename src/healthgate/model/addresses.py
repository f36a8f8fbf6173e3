"""Which addresses a resource may use (SPEC §7, "Addresses").

Two rules, each pure, each naming the field it refuses:

* **serve's own addresses** (:class:`Reserved`): no forwarding rule may
  listen on an address and port that ``serve`` itself uses - the API, the
  DNS, agent and xDS servers, etcd's members - or it would take them at the
  next start (the data plane binds before nothing now, but an operator's
  restart order is not a defence). Refused for everyone, admins included
  (:func:`reserved_conflicts`); a stored rule that conflicts is skipped by
  the data plane, with a log line.
* **the address policy** (:class:`AddressPolicy`): endpoints, instances and
  forwarding-rule addresses written by a principal that is not an admin may
  not be loopback, link-local (the cloud metadata address 169.254.169.254
  among them) or unspecified (0.0.0.0, ::) - else a tenant could make this
  machine probe or proxy to itself, to the metadata service or to etcd, or
  listen on every address. ``serve --allow-addresses CIDR,...`` admits
  ranges anyway (single-tenant use: the demo's loopback regions).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from healthgate.model.resources import (
    ForwardingRule,
    InstanceGroup,
    NetworkEndpointGroup,
    Resource,
)
from healthgate.model.webhooks import Webhook

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

LINK_LOCAL_RULE = (
    "a link-local address (the cloud metadata service, 169.254.169.254, is one) may not be used"
)


@dataclass(frozen=True, slots=True)
class Reserved:
    """An address and port serve itself uses: ``what`` names the option."""

    ip: str
    port: int
    protocols: frozenset[str]  # "TCP", "UDP"
    what: str  # "--listen", "--dns", ...


def _overlaps(a: str, b: str) -> bool:
    """Do two listen addresses overlap (the same, or one a wildcard of the other's family)?"""
    if a == b:
        return True
    wildcards = {"0.0.0.0": 4, "::": 6}
    for wild, other in ((a, b), (b, a)):
        family = wildcards.get(wild)
        if family is not None:
            try:
                return ipaddress.ip_address(other).version == family
            except ValueError:
                return False
    return False


def rule_ports(rule: ForwardingRule) -> list[tuple[int, int]]:
    """A rule's ports as (first, last) spans."""
    if rule.ports is not None:
        return [(p, p) for p in rule.ports]
    first, _, last = (rule.port_range or "0").partition("-")
    return [(int(first), int(last or first))]


def reserved_conflicts(rule: ForwardingRule, reserved: Sequence[Reserved]) -> list[Reserved]:
    """The reserved addresses a rule would take."""
    out = []
    for r in reserved:
        if rule.ip_protocol not in r.protocols or not _overlaps(rule.ip_address, r.ip):
            continue
        if any(lo <= r.port <= hi for lo, hi in rule_ports(rule)):
            out.append(r)
    return out


def reserved_message(r: Reserved) -> str:
    return f"{r.ip}:{r.port} is serve's own address ({r.what}): no forwarding rule may take it"


@dataclass(frozen=True, slots=True)
class AddressPolicy:
    """The addresses a non-admin principal may write (see the module doc)."""

    allowed: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, cidrs: Sequence[str]) -> AddressPolicy:
        """``--allow-addresses``: CIDRs (ValueError naming the bad one)."""
        nets = []
        for text in cidrs:
            try:
                nets.append(ipaddress.ip_network(text.strip(), strict=False))
            except ValueError:
                raise ValueError(f"--allow-addresses: {text!r} is not an address or CIDR") from None
        return cls(tuple(nets))

    def refusal(self, ip: str) -> str | None:
        """Why ``ip`` may not be used (None: it may)."""
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return None  # (the resource's own validation refuses it)
        if any(addr in net for net in self.allowed):
            return None
        if addr.is_unspecified:
            return f"{ip} is unspecified (every address): it may not be used"
        if addr.is_loopback:
            return f"{ip} is a loopback address (this machine): it may not be used"
        if addr.is_link_local:
            return f"{ip}: {LINK_LOCAL_RULE}"
        return None

    def fields(self, res: Resource) -> Iterator[tuple[str, str]]:
        """(field, address) of every address a resource names."""
        if isinstance(res, NetworkEndpointGroup):
            for i, ep in enumerate(res.endpoints):
                yield f"endpoints[{i}].ipAddress", ep.ip_address
        elif isinstance(res, InstanceGroup):
            for i, inst in enumerate(res.instances):
                yield f"instances[{i}].ipAddress", inst.ip_address
        elif isinstance(res, ForwardingRule):
            yield "IPAddress", res.ip_address
        elif isinstance(res, Webhook) and res.address is not None:
            yield "url", res.address  # (a DNS name is checked when it is resolved)

    def violations(self, res: Resource) -> list[tuple[str, str]]:
        """(field, why) for every address of ``res`` the policy refuses."""
        out = []
        for field, ip in self.fields(res):
            why = self.refusal(ip)
            if why is not None:
                out.append((field, why + " (serve --allow-addresses admits a range)"))
        return out
