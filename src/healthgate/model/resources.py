"""The resource kinds of SPEC §1, with their defaults, ranges and field rules.

Each kind is a frozen pydantic model. Field names are snake_case in Python and
camelCase on the wire (``checkIntervalSec``), with the two cloud spellings
``IPAddress`` and ``IPProtocol`` kept as they are. Unknown fields are refused,
so a typo in a manifest is an error instead of a silently ignored setting.

Rules that involve one resource only live here (ranges, the ``requestPath``
alphabet, "exactly one backend service"); rules across resources live in
:mod:`healthgate.model.rules`. The base every kind shares (wire models,
paths, the ``REFS`` table of reference fields) is model/resource.py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any, Literal, Self

from pydantic import Field, field_validator, model_validator

from healthgate.model.checks import (
    MAX_BODY,
    MAX_HEADERS,
    TTL_MAX,
    TTL_MIN,
    EndpointReport,
    Method,
    Payload,
    ProxyHeader,
    RequestHeader,
    Secret,
    SecretRef,
)
from healthgate.model.names import (
    NAME_RULE,
    ReferenceError_,
    brief,
    is_valid_name,
    resolve_reference,
)
from healthgate.model.practice import PracticeRun, checked_away_from
from healthgate.model.resource import (
    DNS_LABEL_RE,
    HOST_RE,
    PORT_RANGE_RE,
    REQUEST_PATH_RE,
    STATUS_RE,
    Model,
    Port,
    Reference,
    Resource,
    normalise_ip,
    wire_dataclass,
)
from healthgate.model.webhooks import MAX_URL, Webhook, checked_url

__all__ = ["Model", "Reference", "Resource"]

# --------------------------------------------------------------------- health checks


class HealthCheck(Resource):
    kind: Literal["HealthCheck"]
    type: Literal["TCP", "HTTP", "HTTPS", "GRPC", "PUSH"]
    port: Port | None = None
    host: str | None = None
    request_path: str = "/"
    check_interval_sec: int = Field(2, ge=1, le=50)
    timeout_sec: int = Field(3, ge=1, le=300)
    healthy_threshold: int = Field(3, ge=2, le=10)
    unhealthy_threshold: int = Field(3, ge=2, le=10)
    expected_status_codes: list[str] = Field(default_factory=lambda: ["200"], min_length=1)
    # SPEC §9: an answer with one of these is a *degraded* success (a 429 of
    # a backend shedding load); none listed: nothing is ever DEGRADED
    degraded_status_codes: list[str] = Field(default_factory=list, max_length=20)
    grpc_service_name: str | None = Field(None, max_length=1024)
    enabled: bool = True
    # cluster mode (SPEC §4): probers of these regions check the endpoints
    # too, and an endpoint is UNHEALTHY only when a quorum of the live
    # vantages says so; empty: the endpoint's own region decides alone
    vantage_regions: list[str] = Field(default_factory=list, max_length=10)
    # HTTP(S): text that must appear in the first 5,120 bytes of the body
    # (as Route 53 searches), in UTF-8
    response_contains: str | None = Field(None, min_length=1, max_length=1024)
    # every probe's success and failure swap ("healthy while the maintenance
    # page is NOT up"); a probe that could not be made stays no result
    invert: bool = False
    # SPEC §10, what a probe sends (model/checks.py): HTTP(S) method, headers, body
    method: Method = "GET"
    request_headers: list[RequestHeader] = Field(default_factory=list, max_length=MAX_HEADERS)
    request_body: str | None = Field(None, min_length=1, max_length=MAX_BODY)
    # TCP: bytes written once connected, and the first bytes the answer must be
    send: Payload | None = None
    expect: Payload | None = None
    # the PROXY protocol preamble first on every connection (GCP's proxyHeader)
    proxy_header: ProxyHeader = "NONE"
    # HTTPS: a certificate and its key (PEM) to present; verify the server's
    # certificate (against caCertificate, else the prober's CA file or the system store)
    client_certificate: SecretRef | None = None
    verify: bool = False
    ca_certificate: SecretRef | None = None
    # PUSH (SPEC §10): nothing is probed; an endpoint with no report for this long is UNHEALTHY
    ttl_sec: int | None = Field(None, ge=TTL_MIN, le=TTL_MAX)

    REFS = (("secret_refs", "secrets", "secrets"),)

    @field_validator("vantage_regions")
    @classmethod
    def _check_vantage_regions(cls, value: list[str]) -> list[str]:
        for region in value:
            if not is_valid_name(region):
                raise ValueError(f"expected region names ({NAME_RULE}), got {brief(region)}")
        if len(set(value)) != len(value):
            raise ValueError("a region is listed twice")
        return value

    @field_validator("request_path")
    @classmethod
    def _check_request_path(cls, value: str) -> str:
        if not REQUEST_PATH_RE.fullmatch(value):
            raise ValueError(
                "expected 1-80 characters starting with '/', made of letters, digits and "
                f"- / . % ? # & _ ; ~ ! ( ) * [ ] @ $ ^ : ' , +; got {brief(value)}"
            )
        return value

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str | None) -> str | None:
        if value is not None and not HOST_RE.fullmatch(value):
            raise ValueError(f"expected a host name or IP address, got {brief(value)}")
        return value

    @field_validator("expected_status_codes", "degraded_status_codes", mode="before")
    @classmethod
    def _status_codes_as_text(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [str(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
        return value

    @field_validator("expected_status_codes", "degraded_status_codes")
    @classmethod
    def _check_status_codes(cls, value: list[str]) -> list[str]:
        for item in value:
            m = STATUS_RE.fullmatch(item)
            if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
                raise ValueError(
                    f"expected status codes 100-599 or ranges like '200-299', got {brief(item)}"
                )
        return value

    @model_validator(mode="after")
    def _check_type_fields(self) -> Self:
        # the defaults are accepted everywhere, so what GET returns can be PUT back
        http = self.type in ("HTTP", "HTTPS")
        if self.request_path != "/" and not http:
            raise ValueError(f"requestPath: only HTTP and HTTPS checks have one, not {self.type}")
        if self.expected_status_codes != ["200"] and not http:
            raise ValueError(
                f"expectedStatusCodes: only HTTP and HTTPS checks have them, not {self.type}"
            )
        if self.degraded_status_codes and not http:
            raise ValueError(
                f"degradedStatusCodes: only HTTP and HTTPS checks have them, not {self.type}"
            )
        if self.degraded_status_codes and self.invert:
            raise ValueError(
                "degradedStatusCodes: an inverted check has no degraded successes (invert is true)"
            )
        if self.grpc_service_name is not None and self.type != "GRPC":
            raise ValueError(f"grpcServiceName: only GRPC checks have one, not {self.type}")
        if self.response_contains is not None and not http:
            raise ValueError(
                f"responseContains: only HTTP and HTTPS checks read a body, not {self.type}"
            )
        if self.response_contains is not None and len(self.response_contains.encode()) > 1024:
            raise ValueError("responseContains: at most 1,024 bytes of UTF-8")
        self._check_requests(http)
        if (self.ttl_sec is None) == (self.type == "PUSH"):
            raise ValueError(
                "ttlSec: a PUSH check needs one (5-86400)"
                if self.type == "PUSH"
                else f"ttlSec: only PUSH checks have one, not {self.type}"
            )
        if self.type == "PUSH" and (self.proxy_header != "NONE" or self.invert):
            field = "proxyHeader" if self.proxy_header != "NONE" else "invert"
            raise ValueError(f"{field}: a PUSH check probes nothing (its reports are verdicts)")
        if self.type == "PUSH" and self.port is not None:
            raise ValueError("port: a PUSH check probes nothing")
        if self.type == "PUSH" and self.vantage_regions:
            raise ValueError("vantageRegions: a PUSH check probes nothing (its reports decide)")
        return self

    def _check_requests(self, http: bool) -> None:
        """SPEC §10's fields, each on the check types that have it."""
        kind = self.type
        if not http:
            for name, given in (
                ("method", self.method != "GET"),
                ("requestHeaders", bool(self.request_headers)),
                ("requestBody", self.request_body is not None),
            ):
                if given:
                    raise ValueError(f"{name}: only HTTP and HTTPS checks have one, not {kind}")
        if self.request_body is not None:
            if self.method in ("GET", "HEAD"):
                raise ValueError(
                    f"requestBody: a {self.method} request carries no body (method POST, PUT "
                    "or OPTIONS)"
                )
            if len(self.request_body.encode()) > MAX_BODY:
                raise ValueError(f"requestBody: at most {MAX_BODY} bytes of UTF-8")
        if self.method == "HEAD" and self.response_contains is not None:
            raise ValueError("responseContains: the answer to a HEAD request has no body")
        for name, payload in (("send", self.send), ("expect", self.expect)):
            if payload is not None and kind != "TCP":
                raise ValueError(f"{name}: only TCP checks have one, not {kind}")
        for name, given in (
            ("clientCertificate", self.client_certificate is not None),
            ("verify", self.verify),
            ("caCertificate", self.ca_certificate is not None),
        ):
            if given and kind not in ("HTTPS", "GRPC"):
                raise ValueError(f"{name}: only HTTPS and GRPC checks have one, not {kind}")
        if self.ca_certificate is not None and not self.verify:
            raise ValueError("caCertificate: certificates are verified only with verify: true")
        if self.client_certificate is not None and kind == "GRPC" and not self.verify:
            raise ValueError(
                "clientCertificate: a GRPC check speaks TLS with verify: true (gRPC's TLS "
                "always verifies the server)"
            )

    @property
    def secret_refs(self) -> list[tuple[str, str]]:
        """The secrets this check reads, as (wire field, reference) pairs."""
        out = [
            (f"requestHeaders[{i}].valueFrom.secret", h.value_from.secret)
            for i, h in enumerate(self.request_headers)
            if h.value_from is not None
        ]
        if self.client_certificate is not None:
            out.append(("clientCertificate.secret", self.client_certificate.secret))
        if self.ca_certificate is not None:
            out.append(("caCertificate.secret", self.ca_certificate.secret))
        return out

    def status_ranges(self) -> tuple[tuple[int, int], ...]:
        return _ranges(self.expected_status_codes)

    def degraded_ranges(self) -> tuple[tuple[int, int], ...]:
        return _ranges(self.degraded_status_codes)


def _ranges(codes: list[str]) -> tuple[tuple[int, int], ...]:
    out = []
    for item in codes:
        lo, _, hi = item.partition("-")
        out.append((int(lo), int(hi or lo)))
    return tuple(out)


# --------------------------------------------------------------------- groups


@wire_dataclass
class NetworkEndpoint:
    """One endpoint of a NEG: a slotted dataclass, not a model (a world has
    a million of them: ~60 bytes each instead of ~600)."""

    ip_address: str
    port: Port | None = None
    # SPEC §6: new connections in proportion (0-255; 0 drains; unset = 128)
    weight: int | None = Field(None, ge=0, le=255)

    @field_validator("ip_address")
    @classmethod
    def _ip(cls, v: str) -> str:
        return normalise_ip(v)


class NetworkEndpointGroup(Resource):
    kind: Literal["NetworkEndpointGroup"]
    network_endpoint_type: Literal["GCE_VM_IP_PORT", "GCE_VM_IP", "PRIVATE_SERVICE_CONNECT"]
    endpoints: list[NetworkEndpoint] = Field(default_factory=list)
    psc_target_service: str | None = None

    @model_validator(mode="after")
    def _check_type_fields(self) -> Self:
        t = self.network_endpoint_type
        if t == "PRIVATE_SERVICE_CONNECT":
            if not self.psc_target_service:
                raise ValueError("pscTargetService: required for PRIVATE_SERVICE_CONNECT")
            if self.endpoints:
                raise ValueError("endpoints: a PRIVATE_SERVICE_CONNECT group has no endpoints")
        else:
            if self.psc_target_service is not None:
                raise ValueError(f"pscTargetService: only PRIVATE_SERVICE_CONNECT, not {t}")
            seen: set[tuple[str, int | None]] = set()
            for i, ep in enumerate(self.endpoints):
                if t == "GCE_VM_IP_PORT" and ep.port is None:
                    raise ValueError(f"endpoints[{i}].port: required for GCE_VM_IP_PORT")
                if t == "GCE_VM_IP" and ep.port is not None:
                    raise ValueError(
                        f"endpoints[{i}].port: GCE_VM_IP endpoints have no port "
                        "(it comes from the health check or forwarding rule)"
                    )
                key = (ep.ip_address, ep.port)
                if key in seen:
                    raise ValueError(f"endpoints[{i}]: duplicate endpoint {ep.ip_address}")
                seen.add(key)
        return self

    # the pscTargetService may live in another project: resolved like any reference
    REFS = (("psc_target_service", "pscTargetService", "serviceAttachments"),)


@wire_dataclass
class Instance:
    name: str
    ip_address: str
    weight: int | None = Field(None, ge=0, le=255)  # (as an endpoint's)

    @field_validator("ip_address")
    @classmethod
    def _ip(cls, v: str) -> str:
        return normalise_ip(v)


class NamedPort(Model):
    name: str
    port: Port


class InstanceGroup(Resource):
    kind: Literal["InstanceGroup"]
    managed: bool = False
    instances: list[Instance] = Field(default_factory=list)
    named_ports: list[NamedPort] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_instances(self) -> Self:
        names: set[str] = set()
        ips: set[str] = set()
        for i, inst in enumerate(self.instances):
            if inst.name in names:
                raise ValueError(f"instances[{i}].name: duplicate instance {inst.name!r}")
            if inst.ip_address in ips:
                raise ValueError(f"instances[{i}].ipAddress: duplicate address {inst.ip_address}")
            names.add(inst.name)
            ips.add(inst.ip_address)
        return self

    @property
    def serving_port(self) -> int | None:
        """Instances serve on the first named port; without one the port comes
        from the health check (probes) or the forwarding rule (traffic)."""
        return self.named_ports[0].port if self.named_ports else None


# --------------------------------------------------------------------- backend services


class Backend(Model):
    group: str
    capacity_scaler: float | None = Field(None, ge=0.0, le=1.0)
    failover_priority: int | None = Field(None, ge=0, le=1000)
    # the share of what is left that this NEG takes (SPEC §6): 0-100, default 100
    traffic_dial: int | None = Field(None, ge=0, le=100)


class RetryBudget(Model):
    """SPEC §8: retries into another region in flight never exceed
    max(minConcurrent, percent x requests in flight)."""

    percent: float = Field(20.0, ge=0.0, le=100.0)
    min_concurrent: int = Field(3, ge=0, le=100_000)


class FailoverPolicy(Model):
    failback: bool = True
    when_all_unhealthy: Literal["FAIL_OPEN", "FAIL_CLOSED"] = "FAIL_OPEN"
    # SPEC §6 "Gradual failover": ALL_OR_NOTHING (the seeds') or PROPORTIONAL,
    # a NEG's factor = min(1, overprovisioningFactor x its healthy fraction)
    spill: Literal["ALL_OR_NOTHING", "PROPORTIONAL"] = "ALL_OR_NOTHING"
    overprovisioning_factor: float = Field(1.4, ge=1.0, le=10.0)
    # SPEC §6 "Ramped failback": a NEG eligible again grows from 0 over this time
    failback_ramp_sec: int = Field(0, ge=0, le=3600)
    # ... abandoned when the data plane sees more than this percentage of the
    # recovering NEG's requests or connections fail over 10 s (at least 20)
    failback_max_error_percent: float | None = Field(None, ge=0, le=100)
    # SPEC §8: retries into the next region bounded (absent: unbounded)
    retry_budget: RetryBudget | None = None
    # SPEC §9: with session affinity, a client that failed over stays where
    # it is after failback (until its cookie expires) instead of returning
    sticky_failback: bool = False


class OutlierDetection(Model):
    """SPEC §8: endpoints of a producer backend service ejected from real
    traffic by what healthgate's own listeners saw of it (health/outliers.py)."""

    consecutive_errors: int = Field(5, ge=0, le=10_000)  # 0: off
    consecutive_gateway_errors: int = Field(0, ge=0, le=10_000)  # 0: off
    failure_percentage_threshold: int = Field(0, ge=0, le=100)  # 0: off
    failure_percentage_minimum_requests: int = Field(50, ge=1, le=1_000_000)
    interval_sec: int = Field(10, ge=1, le=300)
    base_ejection_time_sec: int = Field(30, ge=1, le=3600)
    max_ejection_time_sec: int = Field(300, ge=1, le=86_400)
    max_ejection_percent: int = Field(10, ge=0, le=100)
    enforcing_percent: int = Field(100, ge=0, le=100)  # 0: detect and record only
    count_as_unhealthy: bool = False

    @model_validator(mode="after")
    def _times(self) -> Self:
        if self.max_ejection_time_sec < self.base_ejection_time_sec:
            raise ValueError(
                f"maxEjectionTimeSec: {self.max_ejection_time_sec} is less than "
                f"baseEjectionTimeSec {self.base_ejection_time_sec}"
            )
        return self


# an HTTP header name (RFC 9110 token)
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")

Scheme = Literal["INTERNAL", "INTERNAL_MANAGED", "EXTERNAL", "EXTERNAL_MANAGED"]


class BackendService(Resource):
    kind: Literal["BackendService"]
    load_balancing_scheme: Scheme
    protocol: Literal["TCP", "UDP", "HTTP", "HTTPS"] = "HTTP"
    health_checks: list[str] = Field(default_factory=list)
    backends: list[Backend] = Field(default_factory=list)
    failover_policy: FailoverPolicy | None = None
    outlier_detection: OutlierDetection | None = None
    # SPEC §9: a client keeps its region (consumer) or endpoint (producer)
    session_affinity: Literal["NONE", "CLIENT_IP", "GENERATED_COOKIE", "HEADER_FIELD"] = "NONE"
    affinity_cookie_ttl_sec: int = Field(0, ge=0, le=1_209_600)  # 0: a session cookie
    affinity_header: str | None = Field(None, min_length=1, max_length=64)
    # SPEC §9 slow start (producer only): an endpoint that joins the HEALTHY
    # set grows from this percent of its weight over slowStartSec (0: off)
    slow_start_sec: int = Field(0, ge=0, le=3600)
    slow_start_min_weight_percent: int = Field(10, ge=1, le=100)

    SCOPES = frozenset({"regional", "global"})
    REFS = (
        ("health_checks", "healthChecks", "healthChecks"),
        ("backends", "backends", "networkEndpointGroups"),
    )

    @model_validator(mode="after")
    def _check_affinity(self) -> Self:
        mode = self.session_affinity
        if mode in ("GENERATED_COOKIE", "HEADER_FIELD") and self.protocol not in ("HTTP", "HTTPS"):
            raise ValueError(
                f"sessionAffinity: {mode} needs an L7 backend service (protocol HTTP or "
                f"HTTPS), not {self.protocol}; CLIENT_IP works at L4"
            )
        if mode == "HEADER_FIELD":
            if self.affinity_header is None:
                raise ValueError("affinityHeader: required with sessionAffinity HEADER_FIELD")
            if not _TOKEN.fullmatch(self.affinity_header):
                raise ValueError(
                    f"affinityHeader: {self.affinity_header!r} is not an HTTP header name"
                )
        elif self.affinity_header is not None:
            raise ValueError("affinityHeader: only with sessionAffinity HEADER_FIELD")
        if self.affinity_cookie_ttl_sec and mode != "GENERATED_COOKIE":
            raise ValueError("affinityCookieTtlSec: only with sessionAffinity GENERATED_COOKIE")
        return self

    @model_validator(mode="after")
    def _check_scope_fields(self) -> Self:
        if self.is_global:
            if self.load_balancing_scheme not in ("EXTERNAL_MANAGED", "INTERNAL_MANAGED"):
                raise ValueError(
                    "loadBalancingScheme: a global (consumer) backend service is "
                    f"EXTERNAL_MANAGED or INTERNAL_MANAGED, not {self.load_balancing_scheme}"
                )
            if self.health_checks:
                raise ValueError(
                    "healthChecks: a global backend service of PSC NEGs takes its health "
                    "from the producers' composite health checks, not from a health check"
                )
            if self.slow_start_sec:
                raise ValueError(
                    "slowStartSec: endpoints start slowly on a regional (producer) backend "
                    "service; a global one's backends are regions (see failbackRampSec)"
                )
            if self.outlier_detection is not None:
                raise ValueError(
                    "outlierDetection: endpoints are ejected on a regional (producer) backend "
                    "service; a global one fails over by its NEGs' composite health"
                )
        else:
            if len(self.health_checks) != 1:
                raise ValueError(
                    "healthChecks: a regional backend service has exactly one health check, "
                    f"got {len(self.health_checks)}"
                )
            if self.failover_policy is not None:
                raise ValueError("failoverPolicy: only global backend services fail over")
            for i, b in enumerate(self.backends):
                if b.failover_priority is not None:
                    raise ValueError(
                        f"backends[{i}].failoverPriority: only global backend services fail over"
                    )
                if b.traffic_dial is not None:
                    raise ValueError(
                        f"backends[{i}].trafficDial: only a global (consumer) backend service "
                        "splits traffic between regions"
                    )
        return self

    @property
    def policy(self) -> FailoverPolicy:
        return self.failover_policy or FailoverPolicy()

    def _resolve_references(self) -> Iterator[Reference]:
        # backends of a regional service may be NEGs or instance groups: a
        # reference to instanceGroups/x is resolved in that collection.
        me = self.path
        for ref in super()._resolve_references():
            if ref.error and ref.field.startswith("backends[") and "instanceGroups" in ref.raw:
                try:
                    target = resolve_reference(ref.raw, me, "instanceGroups")
                    yield Reference(ref.attr, ref.field, ref.raw, target)
                except ReferenceError_ as exc:
                    yield Reference(ref.attr, ref.field, ref.raw, None, str(exc))
                continue
            yield ref


# --------------------------------------------------------------------- composite health


class HealthAggregationPolicy(Resource):
    kind: Literal["HealthAggregationPolicy"]
    healthy_percent_threshold: int = Field(60, ge=0, le=100)
    min_healthy_threshold: int = Field(1, ge=0, le=1_000_000)
    policy_type: Literal["BACKEND_SERVICE_POLICY"] = "BACKEND_SERVICE_POLICY"


class TrafficPolicy(Model):
    """SPEC §8: how a TRAFFIC health source judges the real traffic of its
    backend service (health/traffic.py)."""

    error_percent_threshold: float = Field(10.0, ge=1.0, le=100.0)
    minimum_requests: int = Field(100, ge=1, le=10_000_000)
    window_sec: int = Field(30, ge=5, le=600)
    hold_sec: int = Field(60, ge=10, le=3600)


class MetricPolicy(Model):
    """SPEC §10, metrics as health (Route 53's alarm-based checks): a PromQL
    instant query whose one number decides the source
    (controlplane/metric_sources.py)."""

    prometheus_url: str = Field(min_length=1, max_length=MAX_URL)
    query: str = Field(min_length=1, max_length=4096)
    unhealthy_above: float | None = None
    unhealthy_below: float | None = None
    interval_sec: int = Field(30, ge=1, le=3600)
    insufficient_data: Literal["HEALTHY", "UNHEALTHY", "LAST_KNOWN"] = "LAST_KNOWN"

    @field_validator("prometheus_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return checked_url(value)

    @field_validator("query")
    @classmethod
    def _check_query(cls, value: str) -> str:
        if any((ord(c) < 32 and c not in "\t\n") or ord(c) == 127 for c in value):
            raise ValueError("no control characters other than tabs and line breaks")
        return value

    @field_validator("unhealthy_above", "unhealthy_below")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("expected a finite number")
        return value

    @model_validator(mode="after")
    def _one_threshold(self) -> Self:
        if (self.unhealthy_above is None) == (self.unhealthy_below is None):
            raise ValueError("give unhealthyAbove or unhealthyBelow, exactly one")
        return self


class HealthSource(Resource):
    kind: Literal["HealthSource"]
    source_type: Literal["BACKEND_SERVICE", "TRAFFIC", "METRIC"] = "BACKEND_SERVICE"
    sources: list[str]
    health_aggregation_policy: str | None = None
    traffic_policy: TrafficPolicy | None = None
    metric: MetricPolicy | None = None

    REFS = (
        ("sources", "sources", "backendServices"),
        ("health_aggregation_policy", "healthAggregationPolicy", "healthAggregationPolicies"),
    )

    @field_validator("sources")
    @classmethod
    def _exactly_one(cls, value: list[str]) -> list[str]:
        if len(value) != 1:
            raise ValueError(
                f"expected exactly one backend service per health source, got {len(value)}"
            )
        return value

    @model_validator(mode="after")
    def _type_fields(self) -> Self:
        if self.metric is not None and self.source_type != "METRIC":
            raise ValueError("metric: only for sourceType METRIC")
        if self.source_type == "METRIC":
            if self.metric is None:
                raise ValueError("metric: required for sourceType METRIC")
            if self.health_aggregation_policy is not None or self.traffic_policy is not None:
                field = (
                    "healthAggregationPolicy" if self.traffic_policy is None else "trafficPolicy"
                )
                raise ValueError(f"{field}: a METRIC source is judged by its query (metric)")
        elif self.source_type == "TRAFFIC":
            if self.health_aggregation_policy is not None:
                raise ValueError(
                    "healthAggregationPolicy: a TRAFFIC source judges its backend service's "
                    "traffic as a whole (trafficPolicy), not its endpoints"
                )
        else:
            if self.health_aggregation_policy is None:
                raise ValueError("healthAggregationPolicy: required for sourceType BACKEND_SERVICE")
            if self.traffic_policy is not None:
                raise ValueError("trafficPolicy: only for sourceType TRAFFIC")
        return self

    @property
    def traffic(self) -> TrafficPolicy:
        return self.traffic_policy or TrafficPolicy()


class CompositeHealthCheck(Resource):
    kind: Literal["CompositeHealthCheck"]
    health_sources: list[str] = Field(min_length=1, max_length=10)
    health_destination: str
    mode: Literal["ENFORCE", "DRY_RUN"] = "ENFORCE"

    REFS = (
        ("health_sources", "healthSources", "healthSources"),
        ("health_destination", "healthDestination", "forwardingRules"),
    )


# --------------------------------------------------------------------- front ends


# each port of a rule is a listening socket (a descriptor in every data-plane
# process): one rule of 2,000 ports once took every descriptor serve had
MAX_PORTS_PER_RULE = 100
MAX_PORTS_PER_PROJECT = 1000  # the ports of a project's rules together (model/plan.py)


class ForwardingRule(Resource):
    kind: Literal["ForwardingRule"]
    ip_address: str = Field(alias="IPAddress")
    ports: list[Port] | None = Field(None, min_length=1, max_length=5)
    port_range: str | None = None
    ip_protocol: Literal["TCP", "UDP"] = Field("TCP", alias="IPProtocol")
    load_balancing_scheme: Scheme
    backend_service: str
    data_plane_region: str | None = None
    # DNS (global rules): the name `serve --dns` answers with the routed region's address
    dns_name: str | None = None
    dns_ttl_sec: int | None = Field(None, ge=0, le=86400)  # (5 when dnsName is set)

    SCOPES = frozenset({"regional", "global"})
    REFS = (("backend_service", "backendService", "backendServices"),)

    @field_validator("dns_name")
    @classmethod
    def _check_dns_name(cls, value: str | None) -> str | None:
        if value is None:
            return value
        name = value.lower().removesuffix(".")
        labels = name.split(".")
        if (
            len(name) > 253
            or len(labels) < 2
            or not all(DNS_LABEL_RE.fullmatch(label) for label in labels)
        ):
            raise ValueError(
                "expected a fully qualified domain name of at least two labels, each 1-63 "
                f"letters, digits or '-' not starting or ending with '-'; got {brief(value)}"
            )
        return name

    @property
    def dns_ttl(self) -> int:
        return 5 if self.dns_ttl_sec is None else self.dns_ttl_sec

    _ip = field_validator("ip_address")(classmethod(lambda cls, v: normalise_ip(v)))

    @field_validator("port_range", mode="before")
    @classmethod
    def _port_range_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("port_range")
    @classmethod
    def _check_port_range(cls, value: str | None) -> str | None:
        if value is None:
            return value
        m = PORT_RANGE_RE.fullmatch(value)
        lo = int(m.group(1)) if m else 0
        hi = int(m.group(2) or lo) if m else 0
        if not m or not (1 <= lo <= hi <= 65535):
            raise ValueError(
                f"expected a port or range like '8000-8010' in 1-65535, got {brief(value)}"
            )
        return value

    @model_validator(mode="after")
    def _check_fields(self) -> Self:
        if (self.ports is None) == (self.port_range is None):
            raise ValueError("ports: give exactly one of ports or portRange")
        if self.ports is not None and len(set(self.ports)) != len(self.ports):
            raise ValueError("ports: duplicate port")
        if self.port_range is not None and self.port_count() > MAX_PORTS_PER_RULE:
            raise ValueError(
                f"portRange: at most {MAX_PORTS_PER_RULE} ports a rule (each is a listening "
                f"socket), got {self.port_count()}"
            )
        if (self.dns_name is not None or self.dns_ttl_sec is not None) and not self.is_global:
            raise ValueError("dnsName: only global (consumer) forwarding rules have one")
        if self.dns_ttl_sec is not None and self.dns_name is None:
            raise ValueError("dnsTtlSec: only with dnsName")
        if self.data_plane_region is not None:
            if not self.is_global:
                raise ValueError("dataPlaneRegion: only global forwarding rules have one")
            if not is_valid_name(self.data_plane_region):
                raise ValueError(f"dataPlaneRegion: expected a region name ({NAME_RULE})")
        return self

    def port_count(self) -> int:
        if self.ports is not None:
            return len(self.ports)
        lo, _, hi = (self.port_range or "0").partition("-")
        return int(hi or lo) - int(lo) + 1

    def port_list(self) -> list[int]:
        if self.ports is not None:
            return list(self.ports)
        assert self.port_range is not None
        lo, _, hi = self.port_range.partition("-")
        return list(range(int(lo), int(hi or lo) + 1))


class ConsumerAccept(Model):
    project_id_or_num: str
    connection_limit: int | None = Field(None, ge=0)


class ServiceAttachment(Resource):
    kind: Literal["ServiceAttachment"]
    target_service: str
    connection_preference: Literal["ACCEPT_AUTOMATIC", "ACCEPT_MANUAL"] = "ACCEPT_AUTOMATIC"
    consumer_accept_lists: list[ConsumerAccept] = Field(default_factory=list)

    REFS = (("target_service", "targetService", "forwardingRules"),)

    @model_validator(mode="after")
    def _check_accept(self) -> Self:
        if self.consumer_accept_lists and self.connection_preference != "ACCEPT_MANUAL":
            raise ValueError(
                "consumerAcceptLists: only used with connectionPreference ACCEPT_MANUAL"
            )
        return self

    def accepts(self, project: str) -> bool:
        if self.connection_preference == "ACCEPT_AUTOMATIC":
            return True
        return any(a.project_id_or_num == project for a in self.consumer_accept_lists)


# --------------------------------------------------------------------- shifts

SHIFT_MIN, SHIFT_MAX = 60, 259_200  # seconds a shift may last (1 minute to 72 hours)


class Shift(Resource):
    """Traffic moved away by hand, until ``expireTime`` (SPEC §6). Created
    through ``POST /v1/projects/P/shifts`` (which sets the actor and the
    times), never through a manifest."""

    kind: Literal["Shift"]
    # a region, or the full path of a PSC NEG or a service attachment
    away_from: str = Field(min_length=1, max_length=300)
    expire_time: float  # epoch seconds
    created: float
    # a token's name, or practice-run/NAME (a practice run's: SPEC §11)
    actor: str = Field(min_length=1, max_length=80)
    comment: str = Field(min_length=1, max_length=500)
    force: bool = False  # the safety rule was overridden (by an admin)
    # what a region shift covers: the project's own PSC NEGs there and the
    # consumers of its attachments there (ALL: an admin's or a producer's),
    # or its PSC NEGs only (PSC_NEGS: a consumer's - a consumer token of a
    # project that also publishes never moves the producer's consumers)
    covers: Literal["ALL", "PSC_NEGS"] = "ALL"

    SCOPES = frozenset({"global"})

    @field_validator("away_from")
    @classmethod
    def _check_away_from(cls, value: str) -> str:
        return checked_away_from(value)

    @field_validator("expire_time", "created")
    @classmethod
    def _check_time(cls, value: float) -> float:
        if not math.isfinite(value) or not 0 < value < 4_102_444_800:
            raise ValueError(f"expected a time in seconds since 1970, got {brief(value)}")
        return value

    @field_validator("comment")
    @classmethod
    def _check_comment(cls, value: str) -> str:
        if any(ord(c) < 32 for c in value):
            raise ValueError("one line of text: no control characters")
        return value

    def active(self, now: float) -> bool:
        return now < self.expire_time


AnyResource = (
    HealthCheck
    | NetworkEndpointGroup
    | InstanceGroup
    | BackendService
    | HealthAggregationPolicy
    | HealthSource
    | CompositeHealthCheck
    | ForwardingRule
    | ServiceAttachment
    | Shift
    | Webhook
    | Secret
    | EndpointReport
    | PracticeRun
)

KIND_CLASSES: dict[str, type[Resource]] = {
    cls.model_fields["kind"].annotation.__args__[0]: cls  # type: ignore[union-attr]
    for cls in (
        HealthCheck,
        NetworkEndpointGroup,
        InstanceGroup,
        BackendService,
        HealthAggregationPolicy,
        HealthSource,
        CompositeHealthCheck,
        ForwardingRule,
        ServiceAttachment,
        Shift,
        Webhook,
        Secret,
        EndpointReport,
        PracticeRun,
    )
}
