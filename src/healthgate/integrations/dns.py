"""An authoritative DNS server for front ends' names (``serve --dns HOST:PORT``).

A global forwarding rule with ``dnsName`` gets an A (or AAAA) record: the
address of the producer forwarding rule its route sends traffic to now,
with a TTL of ``dnsTtlSec`` (5 s by default). When the route moves to
another region, the next answer names that region; clients follow within
the TTL (plus whatever their resolvers add: see docs/integrations.md).

The server is authoritative for its zones (``--dns-zone ZONE[=PROJECT]``,
default: the parent domain of every dnsName) and answers as such a server
does. A zone given with a project is that project's: only its rules'
dnsNames are answered there (a rule of another project that names a name
in it is skipped, and logged) - first come, first served no more; with
tokens every zone must name its project (SPEC §7).

* a name of a zone with records: the records (AA set); another type at
  that name, or a name in the zone with nothing at it but names below it:
  NOERROR with no answer and the zone's SOA (NODATA);
* a name in a zone that does not exist: NXDOMAIN with the SOA;
* the zone's apex: its SOA and NS;
* a name outside every zone: REFUSED; anything but a standard query: NOTIMP;
  a message that does not parse: FORMERR when its header can be read, else
  no answer.

A split route's answers leave out its DEGRADED regions while another is
left (SPEC §9: answers are cached, so a degraded region is named only when
nothing HEALTHY is left). A rule whose route refuses traffic (FAIL_CLOSED,
every region down) has no address: NODATA. The wire format is dnspython's; UDP answers are truncated
(TC) past 512 bytes or the client's EDNS size, TCP messages are
length-prefixed and at most 65,535 bytes. A TCP connection lives at most
``tcp_lifetime`` seconds, each of its reads and writes ``tcp_timeout``; at
most ``max_tcp_connections`` at once, ``max_tcp_per_source`` of one address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from healthgate.health.engine import HealthEngine
from healthgate.health.routing import Share
from healthgate.health.states import HealthState
from healthgate.model.lookups import published_address
from healthgate.model.names import ResourcePath
from healthgate.model.resources import ForwardingRule, Resource

log = logging.getLogger("healthgate.dns")

SOA_TTL = 60


@dataclass(frozen=True, slots=True)
class Entry:
    frontend: str  # the global forwarding rule's path
    ttl: int


def parse_zone(text: str) -> tuple[str, str | None]:
    """``ZONE`` or ``ZONE=PROJECT`` (``--dns-zone``); ValueError naming what is wrong."""
    zone, sep, project = text.partition("=")
    try:
        dns.name.from_text(zone.strip())
    except dns.exception.DNSException as exc:
        raise ValueError(f"--dns-zone {text!r}: {exc}") from None
    if sep and not project.strip():
        raise ValueError(f"--dns-zone {text!r}: ZONE=PROJECT names a project")
    return zone.strip(), (project.strip() or None)


class DnsDirectory:
    """Names, zones and where each name's route points: rebuilt when the
    resources change, read per query with the engine's current routes.
    Every lookup is O(1) in the number of names (a dict or a set per label
    of the name asked: an NXDOMAIN used to scan every name, 17 ms a query at
    10,000 names, on the serving loop)."""

    def __init__(self, engine: HealthEngine, zones: Iterable[str] = ()) -> None:
        self.engine = engine
        # zone -> the project it belongs to (None: anyone's)
        self.owners: dict[dns.name.Name, str | None] = {}
        for text in zones:
            zone, project = parse_zone(text)
            self.owners[dns.name.from_text(zone)] = project
        self.names: dict[dns.name.Name, Entry] = {}
        self.zones: set[dns.name.Name] = set(self.owners)
        self._present: set[dns.name.Name] = set()  # every name with records, and its parents
        self._addresses: dict[str, str] = {}  # attachment path -> producer rule's IP
        self._skipped: set[str] = set()
        self.serial = 1
        # told the front end of each name answered (SPEC §11: receipts)
        self.observer: Callable[[str], None] | None = None

    def update(self, resources: Mapping[ResourcePath, Resource]) -> None:
        names: dict[dns.name.Name, Entry] = {}
        for path, res in resources.items():
            if isinstance(res, ForwardingRule) and res.dns_name:
                name = dns.name.from_text(res.dns_name)
                if self._owned_elsewhere(name, path):
                    continue
                names[name] = Entry(str(path), res.dns_ttl)
        addresses = {}
        for path in resources:
            if path.collection == "serviceAttachments":
                address = published_address(resources, str(path))
                if address is not None:
                    addresses[str(path)] = address[0]
        present = set()
        for named in names:
            up = named
            while len(up) > 1 and up not in present:
                present.add(up)
                up = up.parent()
        self.names, self._addresses, self._present = names, addresses, present
        self.zones = set(self.owners) or {n.parent() for n in names}
        self.serial += 1

    def _owned_elsewhere(self, name: dns.name.Name, rule: ResourcePath) -> bool:
        zone = self.zone_of(name)
        owner = self.owners.get(zone) if zone is not None else None
        if owner is None or owner == rule.project:
            return False
        if str(rule) not in self._skipped:
            self._skipped.add(str(rule))
            log.warning("%s: dnsName %s is in a zone of another project: not answered", rule, name)
        return True

    def zone_of(self, name: dns.name.Name) -> dns.name.Name | None:
        """The closest zone that holds ``name`` (a set lookup per label)."""
        while True:
            if name in self.zones:
                return name
            if len(name) <= 1:
                return None
            name = name.parent()

    def address(self, name: dns.name.Name) -> str | None:
        """The routed region's producer address for a name (None: no route)."""
        entry = self.names.get(name)
        if entry is None:
            return None
        route = self.engine.route_table().routes.get(entry.frontend)
        if route is None or route.target is None or route.attachment is None:
            return None
        if self.observer is not None:  # (SPEC §11: an answer by the route as it is now)
            self.observer(entry.frontend)
        if route.split:  # (SPEC §6: each answer drawn by share, as weighted records)
            split = self._healthy_first(route.split, route.shares)
            attachments = [a for a, _ in split]
            drawn = random.choices(attachments, [p for _, p in split])[0]
            return self._addresses.get(drawn) or self._addresses.get(route.attachment)
        return self._addresses.get(route.attachment)

    def _healthy_first(
        self, split: tuple[tuple[str, float], ...], shares: tuple[Share, ...]
    ) -> tuple[tuple[str, float], ...]:
        """A split without its DEGRADED regions while another is left (SPEC
        §9: a resolver caches what it gets, so DNS answers with a DEGRADED
        region only when nothing HEALTHY is left)."""
        degraded = HealthState.DEGRADED
        kept = tuple(
            pair
            for pair, share in zip(split, shares, strict=False)
            if (status := self.engine.node_status(share.neg)) is None
            or status.state is not degraded
        )
        return kept or split

    def exists(self, name: dns.name.Name, zone: dns.name.Name) -> bool:
        return name == zone or name in self._present


def _soa(zone: dns.name.Name, serial: int) -> dns.rrset.RRset:
    text = f"ns.{zone} hostmaster.{zone} {serial} 60 10 3600 5"
    return dns.rrset.from_text(zone, SOA_TTL, "IN", "SOA", text)


def answer(directory: DnsDirectory, query: dns.message.Message) -> dns.message.Message:
    response = dns.message.make_response(query)
    response.flags |= dns.flags.AA
    response.flags &= ~dns.flags.RA
    if query.opcode() != dns.opcode.QUERY:
        response.set_rcode(dns.rcode.NOTIMP)
        return response
    if len(query.question) != 1:
        response.set_rcode(dns.rcode.FORMERR)
        return response
    question = query.question[0]
    qname, qtype = question.name, question.rdtype
    if question.rdclass != dns.rdataclass.IN:
        response.set_rcode(dns.rcode.REFUSED)
        return response
    zone = directory.zone_of(qname)
    if zone is None:
        response.flags &= ~dns.flags.AA
        response.set_rcode(dns.rcode.REFUSED)
        return response
    soa = _soa(zone, directory.serial)
    if not directory.exists(qname, zone):
        response.set_rcode(dns.rcode.NXDOMAIN)
        response.authority.append(soa)
        return response
    if qname == zone and qtype in (dns.rdatatype.SOA, dns.rdatatype.ANY):
        response.answer.append(soa)
    if qname == zone and qtype in (dns.rdatatype.NS, dns.rdatatype.ANY):
        response.answer.append(dns.rrset.from_text(zone, SOA_TTL, "IN", "NS", f"ns.{zone}"))
    entry = directory.names.get(qname)
    address = directory.address(qname) if entry is not None else None
    if entry is not None and address is not None:
        family = "AAAA" if ipaddress.ip_address(address).version == 6 else "A"
        if qtype in (dns.rdatatype.from_text(family), dns.rdatatype.ANY):
            response.answer.append(dns.rrset.from_text(qname, entry.ttl, "IN", family, address))
    if not response.answer:
        response.authority.append(soa)  # NODATA
    return response


def handle(directory: DnsDirectory, wire: bytes, max_size: int) -> bytes | None:
    """One query on the wire -> the answer on the wire (None: no answer)."""
    try:
        query = dns.message.from_wire(wire)
    except dns.exception.DNSException:
        if len(wire) < 12:
            return None
        # a header can be read: FORMERR with the query's id
        (qid,) = struct.unpack("!H", wire[:2])
        response = dns.message.Message(id=qid)
        response.flags = dns.flags.QR
        response.set_rcode(dns.rcode.FORMERR)
        return response.to_wire()
    if query.flags & dns.flags.QR:
        return None  # a response, not a query: never answer (no loops)
    try:
        response = answer(directory, query)
    except Exception:  # one bad query must not stop the server
        log.exception("DNS answer failed")
        response = dns.message.make_response(query)
        response.set_rcode(dns.rcode.SERVFAIL)
    if query.edns >= 0:
        max_size = max(max_size, min(query.payload, 4096))
    try:
        return response.to_wire(max_size=max_size)
    except dns.exception.TooBig:
        response.answer, response.authority, response.additional = [], [], []
        response.flags |= dns.flags.TC
        return response.to_wire()


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, directory: DnsDirectory) -> None:
        self.directory = directory
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        reply = handle(self.directory, data[:4096], 512)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


class DnsServer:
    def __init__(
        self,
        directory: DnsDirectory,
        host: str,
        port: int,
        tcp_timeout: float = 10.0,
        max_tcp_connections: int = 256,
        tcp_lifetime: float = 30.0,
        max_tcp_per_source: int = 16,
    ) -> None:
        self.directory = directory
        self.host, self.port = host, port
        self.tcp_timeout = tcp_timeout  # each read and write of a TCP connection
        self.max_tcp = max_tcp_connections
        # a TCP connection's whole life, however often it asks (a query every
        # 9 s used to hold its slot for ever), and one address's connections
        self.tcp_lifetime = tcp_lifetime
        self.max_tcp_per_source = max_tcp_per_source
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._by_source: dict[str, int] = {}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tcp = await asyncio.start_server(self._serve_tcp, self.host, self.port)
        if self.port == 0:
            self.port = self._tcp.sockets[0].getsockname()[1]
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Udp(self.directory), local_addr=(self.host, self.port)
        )
        self._udp = transport
        log.info("DNS answering on %s:%d (UDP and TCP)", self.host, self.port)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if peer else ""
        held = self._by_source.get(source, 0)
        if len(self._conns) >= self.max_tcp or held >= self.max_tcp_per_source or task is None:
            writer.close()
            return
        self._conns.add(task)
        self._by_source[source] = held + 1
        try:
            async with asyncio.timeout(self.tcp_lifetime):
                await self._queries(reader, writer)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._conns.discard(task)
            left = self._by_source.get(source, 1) - 1
            if left > 0:
                self._by_source[source] = left
            else:
                self._by_source.pop(source, None)
            writer.close()

    async def _queries(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:  # several queries per connection, each length-prefixed
            async with asyncio.timeout(self.tcp_timeout):
                head = await reader.readexactly(2)
            (length,) = struct.unpack("!H", head)
            async with asyncio.timeout(self.tcp_timeout):
                wire = await reader.readexactly(length)
            reply = handle(self.directory, wire, 65535)
            if reply is None:
                return
            writer.write(struct.pack("!H", len(reply)) + reply)
            async with asyncio.timeout(self.tcp_timeout):  # (a client that never reads)
                await writer.drain()

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            for task in list(self._conns):
                task.cancel()
            await self._tcp.wait_closed()
