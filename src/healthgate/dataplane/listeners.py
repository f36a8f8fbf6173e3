"""Listener bookkeeping: which listeners the forwarding rules ask for, and
opening and closing them.

* :func:`desired_listeners` - pure: the forwarding rules a data plane serves
  (all of them, or in cluster mode the regional rules of its region and the
  global rules whose ``dataPlaneRegion`` is its region) as listener specs:
  address, ports, :class:`Layer` (UDP for UDP rules, HTTP for a consumer
  rule of an HTTP backend service, TCP otherwise) and side.
* :func:`open_listener` / :func:`close_listener` - the sockets. A listener
  that cannot bind (address in use, not a local address) is logged and
  reported in its ``error``; the rest of the system goes on.

What a listener's connections do is the manager's (dataplane/manager.py):
it hands :func:`open_listener` the protocol factory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import cast

from healthgate.dataplane.counters import ListenerCounters
from healthgate.dataplane.tcp import TcpProxy
from healthgate.dataplane.udp_socket import PktInfoEndpoint, is_wildcard, udp_socket
from healthgate.model.addresses import Reserved, overlaps
from healthgate.model.names import ResourcePath
from healthgate.model.resources import BackendService, ForwardingRule, Resource

log = logging.getLogger("healthgate.dataplane")


class Layer(StrEnum):
    TCP = "tcp"
    HTTP = "http"
    UDP = "udp"


@dataclass(frozen=True, slots=True)
class ListenerSpec:
    ip: str
    ports: tuple[int, ...]
    layer: Layer
    consumer: bool


@dataclass(slots=True)
class Listener:
    spec: ListenerSpec
    servers: list[asyncio.Server] = field(default_factory=list)
    datagrams: list[asyncio.BaseTransport] = field(default_factory=list)
    live: set[TcpProxy] = field(default_factory=set)  # open L4 connections
    error: str | None = None
    counters: ListenerCounters = field(default_factory=ListenerCounters)
    retry: bool = False  # refused for want of room: tried again at the next sync


def taken(spec: ListenerSpec, reserved: Sequence[Reserved]) -> list[Reserved]:
    """serve's own addresses a listener would take (model/addresses.py)."""
    protocol = "UDP" if spec.layer is Layer.UDP else "TCP"
    return [
        r
        for r in reserved
        if protocol in r.protocols and r.port in spec.ports and overlaps(spec.ip, r.ip)
    ]


def serves(rule: ForwardingRule, region: str | None) -> bool:
    """Does a data plane of ``region`` (None: every region) serve this rule?"""
    if region is None:
        return True
    return (rule.data_plane_region if rule.is_global else rule.region) == region


def desired_listeners(
    resources: Mapping[ResourcePath, Resource],
    region: str | None,
    world: Mapping[ResourcePath, Resource] | None = None,
) -> dict[str, ListenerSpec]:
    """rule path -> the listener it asks for (see the module doc), of the
    forwarding rules among ``resources`` (their backend services looked up
    in ``world``, by default ``resources`` itself)."""
    out: dict[str, ListenerSpec] = {}
    lookup = resources if world is None else world
    for path, res in resources.items():
        if not isinstance(res, ForwardingRule) or not serves(res, region):
            continue
        bs_path = res.ref("backend_service")
        bs = lookup.get(bs_path) if bs_path else None
        if not isinstance(bs, BackendService):
            continue
        if res.ip_protocol == "UDP":
            layer = Layer.UDP
        elif res.is_global and bs.protocol == "HTTP":
            layer = Layer.HTTP
        else:
            layer = Layer.TCP
        out[str(path)] = ListenerSpec(res.ip_address, tuple(res.port_list()), layer, res.is_global)
    return out


MIGRATE_REQ = "/proc/sys/net/ipv4/tcp_migrate_req"


def reuse_port_hint() -> str | None:
    """Listeners shared with SO_REUSEPORT (cluster nodes of one region, data-
    plane workers): when one of the processes dies, the connections waiting
    in its accept queue are reset - unless the kernel migrates them to the
    others (net.ipv4.tcp_migrate_req, Linux 5.14+). The advice when it is
    off; None when it is on or not to be known."""
    try:
        with open(MIGRATE_REQ, encoding="ascii") as f:
            on = f.read().strip() != "0"
    except OSError:
        return None
    if on:
        return None
    return (
        "net.ipv4.tcp_migrate_req is 0: when a process sharing these listeners dies, the "
        "connections waiting in its accept queue are reset; sysctl -w net.ipv4.tcp_migrate_req=1 "
        "hands them to the others (docs/cluster.md)"
    )


async def open_listener(
    path: str,
    spec: ListenerSpec,
    factory: Callable[[], asyncio.BaseProtocol],
    reuse_port: bool,
    listener: Listener | None = None,
) -> Listener:
    """Bind every port of ``spec`` (what cannot be bound is the listener's ``error``)."""
    listener = listener or Listener(spec)
    loop = asyncio.get_running_loop()
    for port in spec.ports:
        try:
            if spec.layer is Layer.UDP:  # (its own socket: dataplane/udp_socket.py)
                sock = udp_socket(spec.ip, port, reuse_port)
                protocol = cast(Callable[[], asyncio.DatagramProtocol], factory)
                if is_wildcard(spec.ip):
                    transport: asyncio.BaseTransport = PktInfoEndpoint(sock, protocol())
                else:
                    transport, _ = await loop.create_datagram_endpoint(protocol, sock=sock)
                listener.datagrams.append(transport)
                continue
            server = await loop.create_server(
                cast(Callable[[], asyncio.Protocol], factory),
                spec.ip,
                port,
                reuse_address=True,
                reuse_port=reuse_port or None,
                backlog=1024,
            )
            listener.servers.append(server)
        except OSError as exc:
            listener.error = f"cannot listen on {spec.ip}:{port}: {exc.strerror or exc}"
            log.error("%s: %s", path, listener.error)
    if listener.servers or listener.datagrams:
        log.info(
            "%s: listening on %s port(s) %s (%s)",
            path,
            spec.ip,
            ",".join(map(str, spec.ports)),
            spec.layer,
        )
    return listener


async def close_listener(listener: Listener) -> None:
    """Stop accepting (open connections are the caller's to end)."""
    for transport in listener.datagrams:
        transport.close()
    for server in listener.servers:
        server.close()
    for server in listener.servers:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await server.wait_closed()
