"""What every API route shares: the process's parts, settings, and the
checks and renderings that routes of every family use (who is asking, may
they read or write this, a resource as the API shows it)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Header, Query
from prometheus_client.registry import Collector

from healthgate.api.auth import Access, AccessError, Principal
from healthgate.controlplane.changes import of_plan
from healthgate.controlplane.convergence import ConvergenceMonitor
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.controlplane.health_service import HealthService
from healthgate.controlplane.practice import PracticeRunner, practice_status
from healthgate.controlplane.recorder import TransitionRecorder, iso
from healthgate.controlplane.resources import (
    ControlPlane,
    Stored,
    parse_documents,
    split_output_fields,
)
from healthgate.controlplane.traffic_history import TrafficHistory
from healthgate.controlplane.webhooks import WebhookDispatcher, present_status
from healthgate.health.routing import ramp_progress
from healthgate.model.addresses import AddressPolicy
from healthgate.model.checks import EndpointReport
from healthgate.model.names import GLOBAL, NAME_RULE, ResourcePath, endpoint_path, is_valid_name
from healthgate.model.plan import Plan
from healthgate.model.practice import PracticeRun
from healthgate.model.resources import (
    BackendService,
    ForwardingRule,
    HealthSource,
    NetworkEndpointGroup,
    Resource,
    Shift,
)
from healthgate.model.validation import Document, Issue
from healthgate.model.webhooks import Webhook
from healthgate.store.base import Store

MAX_PAGE = 5000

Auth = Annotated[str | None, Header(alias="Authorization")]
IfMatch = Annotated[str | None, Header(alias="If-Match")]
PageToken = Annotated[str | None, Query(alias="pageToken", max_length=63)]
MaxResults = Annotated[int, Query(alias="maxResults", ge=1, le=MAX_PAGE)]
FingerprintQ = Annotated[str | None, Query(max_length=32)]


@dataclass(frozen=True, slots=True)
class ApiSettings:
    max_body_bytes: int = 1024 * 1024
    max_manifest_bytes: int = 16 * 1024 * 1024
    stream_keepalive: float = 15.0
    max_head_bytes: int = 64 * 1024  # a request's line and headers
    head_timeout: float = 10.0  # ... which must arrive whole within this
    max_connections: int = 1024  # connections and requests at once; 503 beyond
    reserved_for_health: int = 64  # ... and this many more for the health answers
    max_per_source: int = 256  # connections of one client address
    max_streams_per_principal: int = 32  # live event streams of one token
    # a request body must arrive whole within this (408 beyond); bodies read
    # or held by every request together, and by one token (api/bodies.py)
    body_timeout: float = 30.0
    max_body_bytes_held: int = 64 * 1024 * 1024
    max_bodies_per_principal: int = 8
    # manifests worked on at once (each may be 16 MiB and seconds of parsing),
    # one of them a token's at most; the others wait - their bodies read
    # (api/bodies.py) - this long
    manifests_at_once: int = 2
    manifest_wait: float = 60.0
    # names (besides IP addresses and localhost) a request's Host may give
    # (api/browsers.py: DNS rebinding finds nothing)
    allowed_hosts: tuple[str, ...] = ()
    # the addresses non-admin principals may write (model/addresses.py)
    address_policy: AddressPolicy = field(default_factory=AddressPolicy)
    # DNS zones that belong to a project (--dns-zone ZONE=PROJECT): zone -> project
    dns_zones: tuple[tuple[str, str], ...] = ()


@dataclass(slots=True)
class ApiState:
    control: ControlPlane
    health: HealthService
    recorder: TransitionRecorder
    store: Store
    access: Access
    settings: ApiSettings = field(default_factory=ApiSettings)
    ready: bool = False
    collectors: list[Collector] = field(default_factory=list)  # more /metrics families
    dataplane_status: Callable[[], dict[str, dict[str, object]]] | None = None
    webhooks: WebhookDispatcher | None = None  # (deliveries: a webhook's status)
    practice: PracticeRunner | None = None  # practice runs (SPEC §11): their status, :start
    convergence: ConvergenceMonitor | None = None  # route decisions' receipts (SPEC §11)
    peers: Callable[[], dict[str, str]] | None = None  # cluster mode: the other nodes' APIs
    traffic: TrafficHistory | None = None  # each front end's last 15 minutes (the dashboard)
    public_healthz: bool = False  # forwarding rules' healthz without a token
    agent_address: tuple[str, int] | None = None  # where HAProxy's agent-check is answered
    cluster_status: Callable[[], dict[str, Any]] | None = None  # cluster mode: this node's view
    # cluster mode: every node's verdict of a TRAFFIC source
    traffic_status: Callable[[str], dict[str, Any]] | None = None
    manifest_slots: asyncio.Semaphore = field(init=False)
    # one manifest slot per token at most: a token's second waits for its first
    # (token -> its lock and how many of its requests hold or wait for it)
    token_slots: dict[str, tuple[asyncio.Lock, list[int]]] = field(init=False)

    def __post_init__(self) -> None:
        self.manifest_slots = asyncio.Semaphore(self.settings.manifests_at_once)
        self.token_slots = {}

    @contextlib.asynccontextmanager
    async def manifest_slot(self, who: Principal) -> AsyncIterator[None]:
        """One of the few manifest slots, taken once the body has been read
        (api/bodies.py bounds how long that takes and how much is held), one
        per token at a time - so no tenant's manifests hold every slot; 503
        after ``manifest_wait`` seconds in line."""
        key = who.key
        own, users = self.token_slots.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            try:
                async with asyncio.timeout(self.settings.manifest_wait):  # (the wait alone)
                    await own.acquire()
                    try:
                        await self.manifest_slots.acquire()
                    except BaseException:
                        own.release()
                        raise
            except TimeoutError:
                raise ControlError(
                    Refusal.UNAVAILABLE,
                    f"{self.settings.manifests_at_once} manifests are being applied and others "
                    "wait: try again",
                ) from None
            try:
                yield
            finally:
                self.manifest_slots.release()
                own.release()
        finally:
            users[0] -= 1
            if not users[0]:
                self.token_slots.pop(key, None)

    def quorum(
        self, backend_service: ResourcePath, ip: str, port: int | None
    ) -> tuple[str, dict[str, dict[str, object]]] | None:
        """Cluster mode: an endpoint's quorum reason and its vantages' opinions."""
        return self.health.vantages(endpoint_path(backend_service, ip, port))

    async def audit(self, who: Principal, action: str, plan: Plan) -> None:
        """The Change records of an accepted write (controlplane/changes.py),
        stored before the API answers."""
        if plan.changes:
            await self.recorder.append_changes(of_plan(who.name, action, time.time(), plan))

    def principal(self, authorization: str | None) -> Principal:
        return self.access.authenticate(authorization)

    def writer(self, authorization: str | None) -> Principal:
        """A principal that may write something: checked before any work
        (a viewer's manifest is never read, let alone parsed)."""
        who = self.principal(authorization)
        if not who.may_write:
            raise AccessError(403, f"this token ({who.role} of {who.project}) may not write")
        return who

    def check_read(self, who: Principal, project: str) -> None:
        if not who.can_read(project):
            raise AccessError(403, f"this token may not read project {project!r}")

    def check_write(self, who: Principal, res: Resource) -> None:
        psc = (
            isinstance(res, NetworkEndpointGroup)
            and res.network_endpoint_type == "PRIVATE_SERVICE_CONNECT"
        )
        if not who.can_write(res.project, res.kind, res.is_global, psc):
            raise AccessError(
                403, f"this token ({who.role} of {who.project}) may not write {res.kind} {res.path}"
            )

    def check_may_change(self, who: Principal, res: Resource, doc: Document | None = None) -> None:
        """May ``who`` write (or replace, or delete) ``res``: its kind and
        project (403), and a webhook's records - one that would deliver
        records the caller may not read is not the caller's (a consumer
        token of a project that also publishes may not redirect the
        producer's webhook)."""
        self.check_write(who, res)
        moves_attachment = isinstance(res, PracticeRun) and "/serviceAttachments/" in res.away_from
        if moves_attachment and who.role == "consumer":
            raise AccessError(
                403, "a consumer's practice run moves its own PSC NEGs, not an attachment"
            )
        kinds = who.event_kinds()
        if not isinstance(res, Webhook) or kinds is None:
            return
        if not res.events or any(f.kind not in kinds for f in res.events):
            message = (
                f"{res.path}: this token reads only records of kinds {', '.join(kinds)}: "
                "its webhook must name them in events"
            )
            if doc is None:  # (the stored one: not the caller's)
                raise AccessError(403, message + " (this one delivers others)")
            raise ControlError(
                Refusal.INVALID,
                message,
                [doc.issue("events", f"each filter's kind one of {', '.join(kinds)}")],
            )

    def check_document(self, who: Principal, doc: Document) -> None:
        """May ``who`` write this document: its kind and project (403), and,
        unless an admin, its addresses (SPEC §7's address policy: 400 naming
        each field and the rule; model/addresses.py)."""
        if isinstance(doc.resource, EndpointReport):  # (SPEC §10: a client's verdict, timed)
            raise ControlError(
                Refusal.INVALID,
                f"document {doc.index}: an EndpointReport is made through POST "
                ".../backendServices/B/endpoints:report (healthgate report), not a manifest",
                [doc.issue("kind", "EndpointReport: use endpoints:report")],
            )
        if isinstance(doc.resource, Shift):  # (they always expire: made through their own API)
            raise ControlError(
                Refusal.INVALID,
                f"document {doc.index}: a Shift is made through POST "
                f"/v1/projects/{doc.resource.project}/shifts (healthgate shift away), not a manifest",
                [doc.issue("kind", "Shift: use the shifts API")],
            )
        self.check_may_change(who, doc.resource, doc)
        stored = self.control.stored.get(doc.resource.path)
        if stored is not None:  # a replace: what is there must be the caller's to change too
            self.check_may_change(who, stored.resource)
        if who.role == "admin":
            return
        refused = self.settings.address_policy.violations(doc.resource)
        refused += self._zone_violations(doc.resource)
        if refused:
            raise ControlError(
                Refusal.INVALID,
                f"{doc.resource.path}: an address this token may not use",
                [doc.issue(field, why) for field, why in refused],
            )

    def _zone_violations(self, res: Resource) -> list[tuple[str, str]]:
        """A dnsName in a zone that belongs to another project (SPEC §7)."""
        if not isinstance(res, ForwardingRule) or not res.dns_name or not self.settings.dns_zones:
            return []
        name = res.dns_name.rstrip(".").lower()
        owner = None
        best = -1
        for zone, project in self.settings.dns_zones:
            z = zone.rstrip(".").lower()
            if (name == z or name.endswith("." + z)) and len(z) > best:
                owner, best = project, len(z)
        if owner is not None and owner != res.project:
            return [("dnsName", f"{res.dns_name} is in a DNS zone of another project")]
        return []

    def path_of(self, project: str, region: str, collection: str, name: str) -> ResourcePath:
        for label, value in (("project", project), ("name", name)):
            if not is_valid_name(value):
                raise ControlError(
                    Refusal.INVALID,
                    f"invalid {label} {value!r}",
                    [Issue(label, f"expected {NAME_RULE}")],
                )
        if region != GLOBAL and not is_valid_name(region):
            raise ControlError(
                Refusal.INVALID,
                f"invalid region {region!r}",
                [Issue("region", f"expected {NAME_RULE}")],
            )
        return ResourcePath(project, region, collection, name)

    def stored(self, path: ResourcePath) -> Stored:
        """The resource at ``path`` as the mirror has it, or NOT_FOUND."""
        found = self.control.stored.get(path)
        if found is None:
            raise ControlError(Refusal.NOT_FOUND, f"{path} not found")
        return found

    def present(self, stored: Stored) -> dict[str, Any]:
        res = stored.resource
        out = res.to_public()
        out["selfLink"] = str(res.path)
        out["fingerprint"] = stored.fingerprint
        out["creationTimestamp"] = iso(stored.created)
        out["updateTimestamp"] = iso(stored.updated)
        status = self.resource_status(res)
        if status:
            out["status"] = status
        return out

    def resource_status(self, res: Resource) -> dict[str, Any] | None:
        engine = self.health.engine
        path = res.path
        if isinstance(res, BackendService) and not res.is_global:
            counts = engine.counts(path)
            if counts:
                return {
                    "endpoints": counts.total,
                    "healthy": counts.healthy,
                    "degraded": counts.degraded,
                    "unknown": counts.unknown,
                    "unhealthy": counts.unhealthy,
                }
            return None
        if isinstance(res, Webhook):
            return present_status(res, self.webhooks)
        if isinstance(res, PracticeRun):
            return practice_status(self.practice, res)
        if isinstance(res, ForwardingRule):
            listener = self.dataplane_status().get(str(path)) if self.dataplane_status else None
            status = self._fr_status(res)
            if status is not None and listener is not None:
                status["listener"] = listener
            return status
        node = engine.node_status(path)
        if node is None or res.kind in ("ServiceAttachment",):
            return None
        out = _with_fraction(
            {"healthState": node.state.name, "reason": node.reason, "lastChange": iso(node.since)},
            node.fraction,
        )
        if isinstance(res, HealthSource) and res.source_type == "TRAFFIC":
            out["traffic"] = self._traffic(str(path))
        return out

    def _traffic(self, source: str) -> dict[str, Any]:
        """A TRAFFIC source's window as this node judges it (SPEC §8), and in
        cluster mode every node's verdict."""
        v = self.health.engine.passive.verdicts().get(source)
        out: dict[str, Any] = {}
        if v is not None:
            out["thisNode"] = {
                "state": v.state.name,
                "judged": v.judged,
                "requests": v.requests,
                "errors": v.errors,
                "reason": v.reason,
            }
        if self.traffic_status is not None:
            out["nodes"] = self.traffic_status(source)
        return out

    def _fr_status(self, res: ForwardingRule) -> dict[str, Any] | None:
        engine = self.health.engine
        path = res.path
        if res.is_global:
            route = engine.route_table().routes.get(str(path))
            if route is None:
                return None
            out: dict[str, Any] = {
                "route": {
                    "target": route.target,
                    "mode": route.mode,
                    "reason": route.reason,
                    "since": iso(route.since),
                    "generation": route.generation,
                    "fallbacks": list(route.fallbacks),
                    # the split of new traffic (SPEC §6): one share of 100 unless dialled
                    "shares": [
                        {"neg": s.neg, "region": s.region, "percent": s.percent, "reason": s.reason}
                        for s in route.shares
                    ],
                    # ramped failbacks in progress (SPEC §6), with how far each is
                    "ramps": self._ramps(str(path)),
                }
            }
            # SPEC §11: who has applied the last decision, and who not yet
            seen = self.convergence.status(str(path)) if self.convergence is not None else None
            if seen is not None:
                out["convergence"] = seen["receipts"]
                out["decision"] = {k: v for k, v in seen.items() if k != "receipts"}
            return out
        dest = engine.destination_state(path)
        if dest is None:
            return {
                "healthState": "UNKNOWN",
                "reason": "no composite health check has this rule as destination",
            }
        return _with_fraction(
            {"healthState": dest.state.name, "reason": dest.reason, "lastChange": iso(dest.since)},
            dest.fraction,
        )

    def _ramps(self, frontend: str) -> list[dict[str, Any]]:
        engine = self.health.engine
        ramps = engine.ramps().get(frontend, {})
        if not ramps:
            return []
        now = self.health.clock()
        seconds = engine.ramp_seconds(frontend)
        return [
            {
                "neg": neg,
                "start": iso(start),
                "rampSec": seconds,
                "progress": round(ramp_progress(now, start, seconds), 4),
            }
            for neg, start in sorted(ramps.items())
        ]

    def body_to_document(self, body: Any, path: ResourcePath) -> tuple[Document, str | None]:
        if not isinstance(body, dict):
            raise ControlError(
                Refusal.INVALID, "expected a JSON object", [Issue("", "expected a JSON object")]
            )
        data, fingerprint = split_output_fields(body)
        expected = {"kind": path.kind, "project": path.project, "name": path.name}
        if path.is_global:
            data.setdefault("region", GLOBAL)
        expected["region"] = path.region
        for key, want in expected.items():
            given = data.setdefault(key, want)
            if given != want:
                raise ControlError(
                    Refusal.INVALID,
                    f"{key} {given!r} does not match the URL ({want!r})",
                    [Issue(key, f"expected {want!r} as in the URL")],
                )
        (doc,) = parse_documents([(data, None, None)])
        return doc, fingerprint


def _with_fraction(status: dict[str, Any], fraction: float | None) -> dict[str, Any]:
    """A status with its healthy fraction (SPEC §6), when it is known."""
    if fraction is not None:
        status["healthyFraction"] = round(fraction, 4)
    return status
