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
  among them), a cloud metadata service's other addresses
  (:data:`METADATA`), unspecified (0.0.0.0, ::, the 0.0.0.0/8 "this
  network") or multicast - else a tenant could make this machine probe or
  proxy to itself, to the metadata service or to etcd, or listen on every
  address. ``serve --allow-addresses CIDR,...`` admits ranges anyway
  (single-tenant use: the demo's loopback regions).

**Every spelling.** Addresses are compared parsed, never as text: an
IPv4-mapped address is stored as its IPv4 address (model/resource.py's
``normalise_ip``), and an IPv6 address that carries an IPv4 address inside
(IPv4-compatible ``::a.b.c.d``, IPv4-translated ``::ffff:0:a.b.c.d``, NAT64
``64:ff9b::/96`` and ``64:ff9b:1::/48``, 6to4 ``2002::/16``, Teredo's server
and client) is refused when any address it carries would be
(:func:`carried`). A wildcard listener (``0.0.0.0``, ``::``, which on Linux
also takes IPv4 unless the socket is IPv6-only) overlaps every address of
what it covers (:func:`overlaps`).

**Where connections are made**, the address checked is the one used: a
stored document is parsed again whenever it is read (its address reduced
and validated, a bad value from etcd skipped), so the prober and the data
plane connect to the parsed address; a webhook's name is resolved before
every attempt and each address it resolves to is checked here
(controlplane/webhooks.py), reduced forms included.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from healthgate.model.practice import PracticeRun
from healthgate.model.resources import (
    ForwardingRule,
    HealthSource,
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


# cloud metadata services' addresses beyond link-local 169.254.0.0/16
# (each would hand out the machine's credentials to whoever makes it ask)
METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "fd00:ec2::254",  # AWS IMDS over IPv6
        "fd20:ce::254",  # Google Compute Engine over IPv6
        "100.100.100.200",  # Alibaba Cloud
        "168.63.129.16",  # Azure's wire server
        "192.0.0.192",  # Oracle Cloud
    )
)
THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")
_COMPATIBLE = ipaddress.ip_network("::/96")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def carried(addr: Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries inside it (see the module doc)."""
    if isinstance(addr, ipaddress.IPv4Address):
        return []
    out = []
    n = int(addr)
    if addr.ipv4_mapped is not None:
        out.append(addr.ipv4_mapped)
    if addr in _COMPATIBLE and n > 1:  # (not :: or ::1, which are themselves)
        out.append(ipaddress.IPv4Address(n & 0xFFFFFFFF))
    if addr in _TRANSLATED or addr in _NAT64:
        out.append(ipaddress.IPv4Address(n & 0xFFFFFFFF))
    if addr in _NAT64_LOCAL:  # RFC 6052 §2.2, a /48 prefix: bits 48-63, then 72-87
        out.append(ipaddress.IPv4Address(((n >> 64) & 0xFFFF) << 16 | ((n >> 40) & 0xFFFF)))
    if addr.sixtofour is not None:
        out.append(addr.sixtofour)
    if addr.teredo is not None:
        out.extend(addr.teredo)
    return out


def _reduced(addr: Address) -> Address:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def overlaps(a: str, b: str) -> bool:
    """Do two listen addresses overlap: the same address, parsed, or one a
    wildcard that covers the other (``::`` covers IPv4 too: a socket bound
    to it is dual-stack unless made IPv6-only)?"""
    try:
        x, y = _reduced(ipaddress.ip_address(a)), _reduced(ipaddress.ip_address(b))
    except ValueError:
        return a == b
    if x == y:
        return True
    for wild, other in ((x, y), (y, x)):
        if wild.is_unspecified and wild.version in (other.version, 6):
            return True
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
        if rule.ip_protocol not in r.protocols or not overlaps(rule.ip_address, r.ip):
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
        """Why ``ip`` may not be used (None: it may): the address itself,
        and every IPv4 address it carries (:func:`carried`)."""
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return None  # (the resource's own validation refuses it)
        why = self._refusal(addr, ip)
        if why is not None:
            return why
        for inner in carried(addr):
            why = self._refusal(inner, str(inner))
            if why is not None:
                return f"{ip} carries {inner} inside it: {why}"
        return None

    def _refusal(self, addr: Address, ip: str) -> str | None:
        addr = _reduced(addr)  # (as the kernel uses it)
        if any(addr in net for net in self.allowed):
            return None
        if addr.is_unspecified or (addr.version == 4 and addr in THIS_NETWORK):
            return f"{ip} is unspecified (every address, or this network): it may not be used"
        if addr.is_loopback:
            return f"{ip} is a loopback address (this machine): it may not be used"
        if addr.is_link_local:
            return f"{ip}: {LINK_LOCAL_RULE}"
        if addr in METADATA:
            return f"{ip} is a cloud metadata service's address: it may not be used"
        if addr.is_multicast:
            return f"{ip} is a multicast address: it may not be used"
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
        elif isinstance(res, HealthSource) and res.metric is not None:
            address = _address(urlsplit(res.metric.prometheus_url).hostname or "")
            if address is not None:  # (a DNS name is checked each time it is resolved)
                yield "metric.prometheusUrl", address
        elif isinstance(res, PracticeRun):
            for i, check in enumerate(res.outcome_checks):
                address = _address(urlsplit(check.url or "").hostname or "")
                if address is not None:  # (as above)
                    yield f"outcomeChecks[{i}].url", address

    def violations(self, res: Resource) -> list[tuple[str, str]]:
        """(field, why) for every address of ``res`` the policy refuses."""
        out = []
        for field, ip in self.fields(res):
            why = self.refusal(ip)
            if why is not None:
                out.append((field, why + " (serve --allow-addresses admits a range)"))
        return out


def _address(host: str) -> str | None:
    """``host`` as an address, or None for a DNS name."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None
