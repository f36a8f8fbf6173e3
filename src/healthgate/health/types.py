"""What the engine's parts share and answer with: small frozen values.

Endpoints are keyed ``(ip, serving port)`` within a backend service; routes
and route tables are immutable snapshots that the data plane reads without
locks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from healthgate.health.routing import Share
from healthgate.health.states import HealthState, ProbeResult, Record, RouteMode
from healthgate.model.names import ResourcePath
from healthgate.model.resources import HealthCheck

EndpointKey = tuple[str, int | None]  # (ip, serving port)
NO_SECRETS: Mapping[ResourcePath, str] = MappingProxyType({})  # (shared: read-only)


class Counts(NamedTuple):
    """A backend service's endpoints by state; the rest are UNHEALTHY."""

    total: int
    healthy: int
    unknown: int
    degraded: int = 0  # SPEC §9, counted apart from healthy

    @property
    def unhealthy(self) -> int:
        return self.total - self.healthy - self.unknown - self.degraded


@dataclass(frozen=True, slots=True)
class ProbeTarget:
    """What the scheduler needs to probe one endpoint."""

    slot: int
    backend_service: ResourcePath
    ip: str
    port: int | None  # serving port (None for GCE_VM_IP and port-less groups)
    check: HealthCheck
    # the values of the secrets the check reads (SPEC §10), by path; never shown
    secrets: Mapping[ResourcePath, str] = field(default_factory=lambda: NO_SECRETS, repr=False)


@dataclass(frozen=True, slots=True)
class EndpointStatus:
    ip: str
    port: int | None
    state: HealthState
    since: float
    last_result: ProbeResult | None
    last_time: float | None
    reason: str
    ejected_until: float | None = None  # ejected from real traffic until (SPEC §8)


@dataclass(frozen=True, slots=True)
class NodeStatus:
    path: str
    state: HealthState
    reason: str
    since: float
    # healthy / all endpoints (a composite's: the lowest of its sources'; SPEC §6)
    fraction: float | None = None


@dataclass(frozen=True, slots=True)
class Route:
    """Where one consumer front end sends new traffic right now."""

    frontend: str
    target: str | None  # PSC NEG path; None = refuse
    attachment: str | None  # the NEG's service attachment path
    mode: RouteMode
    reason: str
    since: float
    # attachments to try next, in failover order, for a request the target
    # could not serve (only NEGs that are accepted and not UNHEALTHY)
    fallbacks: tuple[str, ...] = ()
    # the split of new traffic (SPEC §6): (attachment, share) in order, when
    # more than one NEG takes a share; empty = all of it to ``attachment``
    split: tuple[tuple[str, float], ...] = ()
    shares: tuple[Share, ...] = ()  # every share, with its reason (empty: no target)
    # the shares as last recorded, where they differ from ``shares``: during
    # a ramped failback the log says where traffic is going (its full
    # shares), the data plane follows the ramp's steps (None: as ``shares``)
    recorded: tuple[Share, ...] | None = None
    # attachments a client with session affinity may stay on when
    # failoverPolicy.stickyFailback holds it there (SPEC §9): accepted,
    # eligible, not shifted and not dialled to 0
    keep: tuple[str, ...] = ()
    # the decision (SPEC §11): the engine's count of route decisions when
    # this route last changed in a way that was recorded (0: none since start)
    generation: int = 0


@dataclass(frozen=True, slots=True)
class RouteTable:
    """An immutable snapshot; readers take it once per connection, no locks."""

    version: int
    routes: Mapping[str, Route]
    published: float = 0.0  # the engine time (``now``) it was published at


@dataclass(slots=True)
class ApplyResult:
    records: list[Record] = field(default_factory=list)
    added: list[ProbeTarget] = field(default_factory=list)  # new probe work
    removed: list[int] = field(default_factory=list)  # slots no longer probed
    removed_paths: list[str] = field(default_factory=list)  # their endpoint paths
    changed: list[ProbeTarget] = field(default_factory=list)  # same slot, new check
