"""Envoy follows healthgate: an ADS server (``serve --xds HOST:PORT``) with
CDS and EDS, state of the world.

For every global (consumer) backend service that a forwarding rule fronts,
one **cluster**, named ``PROJECT/NAME`` (EDS over ADS, round robin), and its
**load assignment**: one locality per region - the address of the producer
forwarding rule that region's PSC NEG reaches - with

* ``priority`` = its place in the failover order (``failoverPriority``,
  locality to the rule's ``dataPlaneRegion``, name; 0 first);
* ``health_status`` from the NEG, as HAProxy's agent answers it
  (integrations/verdicts.py): HEALTHY (or UNKNOWN: it never fails over),
  DEGRADED (SPEC §9: Envoy sends it traffic only when too few hosts are
  HEALTHY; it also comes after every other region in the order), UNHEALTHY,
  or DRAINING when no traffic may flow (not accepted).

What Envoy needs to fail over at once rather than gradually:

* ``overprovisioning_factor`` 100: a priority level gets traffic in
  proportion to its healthy share *times* this factor (Envoy's default 140
  keeps sending some traffic to a level that is partly down); each level
  here is one region, healthy or not, so 100 makes the move whole;
* ``healthy_panic_threshold`` 0 %: Envoy's default (50 %) would, with every
  region down, ignore health and spread traffic over all of them. With 0
  it never panics, and healthgate's ``whenAllUnhealthy`` decides instead:
  FAIL_OPEN reports the route's first region HEALTHY (so Envoy keeps
  sending there), FAIL_CLOSED reports every region UNHEALTHY (Envoy answers
  503, no healthy upstream).

A route that splits its traffic (``trafficDial``, SPEC §6) puts the regions of
its shares in priority 0, each locality weighted by its share in basis points
(``locality_weighted_lb_config``), and every other region after them, one
priority each; Envoy then spreads new requests by those weights.

**Outlier detection** (SPEC §8): when a producer backend service behind the
cluster's regions has ``outlierDetection``, the cluster carries Envoy's
``outlier_detection`` with the same figures - the first such service in
failover order (a cluster has one). Envoy's hosts here are the regions'
producer rule addresses, so what Envoy ejects by its own real traffic is a
region's address: its traffic moves to the next priority, as a TRAFFIC
source does in healthgate's own front ends (docs/integrations.md).

Failback is Envoy's own: as soon as a higher priority is healthy again it
takes the traffic back. ``failback: false`` has no EDS equivalent
(documented).

Who may read what (SPEC §7): on loopback without TLS every local Envoy is
trusted with every project's clusters (as the API without tokens is).
With TLS (``--xds-tls-cert/--xds-tls-key/--xds-client-ca``) every Envoy
must present a certificate of that CA, and its common name is mapped to
the projects whose clusters it receives (``--xds-client NAME=P1,P2``); a
certificate whose name is not mapped is refused (PERMISSION_DENIED).
Streams are capped (``max_streams`` in all, ``max_streams_per_client`` of
one certificate - or one address without TLS: RESOURCE_EXHAUSTED beyond),
and what an Envoy sends is bounded (resource names it may subscribe to, the
size of a request; what a NACK says is logged cut short, once in 10 s a
stream).

Versions: every change of the whole snapshot (clusters or assignments)
makes a new version, pushed at once to every stream that subscribed; a
stream sends a type only when its version moved or the subscribed names
changed. ACKs and NACKs are read (a NACK is logged). When healthgate stops,
Envoy keeps the last configuration it accepted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass

import grpc
from envoy.config.cluster.v3 import cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import address_pb2, config_source_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import any_pb2, duration_pb2, wrappers_pb2

from healthgate.health.engine import HealthEngine
from healthgate.health.states import HealthState
from healthgate.integrations.verdicts import agent_answer
from healthgate.model.change import WorldChange
from healthgate.model.lookups import published_address, published_rule
from healthgate.model.names import ResourcePath, brief
from healthgate.model.resources import BackendService, ForwardingRule, OutlierDetection, Resource

log = logging.getLogger("healthgate.xds")

CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"

_HEALTH = {
    "up": health_check_pb2.HEALTHY,
    "down": health_check_pb2.UNHEALTHY,
    "maint": health_check_pb2.DRAINING,
    "drain": health_check_pb2.DEGRADED,  # (SPEC §9: a DEGRADED NEG, nothing routed to it)
}


def cluster_name(backend_service: ResourcePath) -> str:
    return f"{backend_service.project}/{backend_service.name}"


@dataclass(frozen=True, slots=True)
class Snapshot:
    clusters: dict[str, bytes]  # name -> serialized Cluster
    assignments: dict[str, bytes]  # name -> serialized ClusterLoadAssignment


class XdsSnapshots:
    """The snapshot of a world that changes: the global front ends are
    kept as the changes come (never found again by a pass over every
    resource), and :meth:`build` makes the snapshot from them."""

    def __init__(self, engine: HealthEngine) -> None:
        self.engine = engine
        self.world: Mapping[ResourcePath, Resource] = {}
        self.frontends: dict[ResourcePath, ForwardingRule] = {}

    def take(self, change: WorldChange) -> bool:
        """Take a change; whether it may move the snapshot."""
        self.world = change.world
        paths: Iterable[ResourcePath] = change.world if change.whole else change.changed
        for p in paths:
            if p.collection != "forwardingRules":
                continue
            rule = change.world.get(p)
            if isinstance(rule, ForwardingRule) and rule.is_global:
                self.frontends[p] = rule
            else:
                self.frontends.pop(p, None)
        return change.touches(
            "forwardingRules", "backendServices", "networkEndpointGroups", "serviceAttachments"
        )

    def build(self) -> Snapshot:
        return build_snapshot(self.engine, self.world, self.frontends)


def build_snapshot(
    engine: HealthEngine,
    resources: Mapping[ResourcePath, Resource],
    frontends: Mapping[ResourcePath, ForwardingRule] | None = None,
) -> Snapshot:
    """The clusters and assignments of the global front ends (``frontends``:
    them, by path, when known; else found among ``resources``)."""
    if frontends is None:
        frontends = {
            p: r for p, r in resources.items() if isinstance(r, ForwardingRule) and r.is_global
        }
    return _snapshot(engine, resources, frontends)


def _snapshot(
    engine: HealthEngine,
    resources: Mapping[ResourcePath, Resource],
    frontends: Mapping[ResourcePath, ForwardingRule],
) -> Snapshot:
    clusters: dict[str, bytes] = {}
    assignments: dict[str, bytes] = {}
    for path, res in sorted(frontends.items()):
        bs_path = res.ref("backend_service")
        if bs_path is None or not isinstance(resources.get(bs_path), BackendService):
            continue
        name = cluster_name(bs_path)
        if name in clusters:
            continue  # (two front ends of one service: one cluster)
        outliers = _outliers_behind(engine, resources, str(path))
        bs = resources[bs_path]
        assert isinstance(bs, BackendService)
        affine = bs.session_affinity != "NONE"
        clusters[name] = _cluster(name, outliers, affine).SerializeToString(deterministic=True)
        assignments[name] = _assignment(
            engine, resources, str(path), name, affine
        ).SerializeToString(deterministic=True)
    return Snapshot(clusters, assignments)


def _outliers_behind(
    engine: HealthEngine, resources: Mapping[ResourcePath, Resource], frontend: str
) -> OutlierDetection | None:
    """The outlierDetection of the first producer backend service, in the
    front end's failover order, that has one."""
    for _candidate, attachment in engine.failover_order(frontend):
        found = published_rule(resources, attachment)
        bs_path = found[1].ref("backend_service") if found is not None else None
        bs = resources.get(bs_path) if bs_path is not None else None
        if isinstance(bs, BackendService) and bs.outlier_detection is not None:
            return bs.outlier_detection
    return None


def envoy_outlier_detection(od: OutlierDetection) -> outlier_detection_pb2.OutlierDetection:
    """Envoy's ``outlier_detection`` with SPEC §8's figures: a detection that
    is off here (0) is not enforced there; success-rate detection (which
    SPEC §8 has not) is off."""

    def u32(n: int) -> wrappers_pb2.UInt32Value:
        return wrappers_pb2.UInt32Value(value=n)

    enforcing = od.enforcing_percent
    return outlier_detection_pb2.OutlierDetection(
        consecutive_5xx=u32(max(1, od.consecutive_errors)),
        enforcing_consecutive_5xx=u32(enforcing if od.consecutive_errors else 0),
        consecutive_gateway_failure=u32(max(1, od.consecutive_gateway_errors)),
        enforcing_consecutive_gateway_failure=u32(
            enforcing if od.consecutive_gateway_errors else 0
        ),
        failure_percentage_threshold=u32(max(1, od.failure_percentage_threshold)),
        enforcing_failure_percentage=u32(enforcing if od.failure_percentage_threshold else 0),
        failure_percentage_request_volume=u32(od.failure_percentage_minimum_requests),
        failure_percentage_minimum_hosts=u32(1),
        enforcing_success_rate=u32(0),
        interval=duration_pb2.Duration(seconds=od.interval_sec),
        base_ejection_time=duration_pb2.Duration(seconds=od.base_ejection_time_sec),
        max_ejection_time=duration_pb2.Duration(seconds=od.max_ejection_time_sec),
        max_ejection_percent=u32(od.max_ejection_percent),
    )


def _cluster(
    name: str, outliers: OutlierDetection | None = None, affine: bool = False
) -> cluster_pb2.Cluster:
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        connect_timeout=duration_pb2.Duration(seconds=1),
        # session affinity (SPEC §9): a consistent hash of the route's
        # hash_policy (envoy_hash_policy) over the regions, by their weights
        lb_policy=cluster_pb2.Cluster.MAGLEV if affine else cluster_pb2.Cluster.ROUND_ROBIN,
    )
    cluster.eds_cluster_config.eds_config.CopyFrom(
        config_source_pb2.ConfigSource(
            ads=config_source_pb2.AggregatedConfigSource(),
            resource_api_version=config_source_pb2.ApiVersion.V3,
        )
    )
    cluster.common_lb_config.healthy_panic_threshold.CopyFrom(percent_pb2.Percent(value=0.0))
    if not affine:  # localities weighted (a split route's shares); each carries a weight
        cluster.common_lb_config.locality_weighted_lb_config.SetInParent()
    if outliers is not None:
        cluster.outlier_detection.CopyFrom(envoy_outlier_detection(outliers))
    return cluster


def _assignment(
    engine: HealthEngine,
    resources: Mapping[ResourcePath, Resource],
    frontend: str,
    name: str,
    affine: bool = False,
) -> endpoint_pb2.ClusterLoadAssignment:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    cla.policy.overprovisioning_factor.CopyFrom(wrappers_pb2.UInt32Value(value=100))
    route = engine.route_table().routes.get(frontend)
    # a split route (SPEC §6): its shares are one priority, weighted by share
    # (basis points); every other region follows, one priority each
    weights = (
        {s.neg: round(s.percent * 100) for s in route.shares}
        if route is not None and len(route.shares) > 1
        else {}
    )
    priority = 1 if weights else 0
    for candidate, attachment in engine.failover_order(frontend):
        address = published_address(resources, attachment)
        if address is None:
            continue
        answer = agent_answer(engine, candidate.path).split()[0]  # ("up 70%": its state)
        health = _HEALTH[answer]
        if answer == "up" and candidate.state is HealthState.UNKNOWN:
            health = health_check_pb2.UNKNOWN  # (Envoy routes to UNKNOWN as to HEALTHY)
        elif answer == "up" and candidate.state is HealthState.DEGRADED:
            # (Envoy uses DEGRADED hosts only when too few are HEALTHY: SPEC §9)
            health = health_check_pb2.DEGRADED
        ip, port = address
        endpoint = endpoint_components_pb2.LbEndpoint(health_status=health)
        endpoint.endpoint.address.socket_address.CopyFrom(
            address_pb2.SocketAddress(address=ip, port_value=port)
        )
        weight = weights.get(candidate.path)
        if affine and weight:  # (Maglev weighs hosts, not localities)
            endpoint.load_balancing_weight.CopyFrom(wrappers_pb2.UInt32Value(value=weight))
        locality = endpoint_components_pb2.LocalityLbEndpoints(
            priority=0 if weight else priority,
            load_balancing_weight=wrappers_pb2.UInt32Value(value=weight or 1),
        )
        locality.locality.region = candidate.region
        locality.locality.zone = candidate.name
        locality.lb_endpoints.append(endpoint)
        cla.endpoints.append(locality)
        if not weight:
            priority += 1
    return cla


@dataclass(frozen=True, slots=True)
class XdsTls:
    """The ADS server's certificate and key, and the CA of its clients'."""

    cert: str
    key: str
    client_ca: str

    def credentials(self) -> grpc.ServerCredentials:
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_server_credentials(
            [(read(self.key), read(self.cert))],
            root_certificates=read(self.client_ca),
            require_client_auth=True,
        )


MAX_NAMES = 10_000  # resource names one subscription may list
NACK_LOG_EVERY = 10.0  # seconds between two logged NACKs of one stream
MAX_REQUEST = 1 << 20  # bytes of one request from an Envoy


class _Stream:
    """One Envoy's ADS stream: what it subscribed to, what it was sent."""

    def __init__(self, projects: frozenset[str] | None = None, client: str = "") -> None:
        self.projects = projects  # the projects it may read (None: every one)
        self.client = client  # its certificate's name (or its address, without TLS)
        self.last_nack_log = float("-inf")
        self.names: dict[str, tuple[str, ...]] = {}  # type -> resource names (() = all)
        self.sent: dict[str, tuple[int, tuple[str, ...]]] = {}  # type -> (version, names)
        self.nonce = 0
        self.wake = asyncio.Event()


class XdsServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]
    def __init__(
        self,
        host: str,
        port: int,
        tls: XdsTls | None = None,
        clients: Mapping[str, frozenset[str]] | None = None,
        max_streams: int = 256,
        max_streams_per_client: int = 16,
    ) -> None:
        self.host, self.port = host, port
        self.tls = tls
        self.clients = dict(clients or {})  # certificate common name -> its projects
        self.max_streams = max_streams
        # one certificate's streams (one address's without TLS): one Envoy's
        # key may not take every stream
        self.max_streams_per_client = max_streams_per_client
        self.snapshot = Snapshot({}, {})
        self.version = 0
        self._streams: set[_Stream] = set()
        # SPEC §11, convergence receipts: told each version pushed, and each
        # EDS version an Envoy ACKs - (its node id, the version, the
        # clusters it subscribed to (() - all), the projects it may read)
        self.on_version: Callable[[int], None] | None = None
        self.on_ack: Callable[[str, int, tuple[str, ...], frozenset[str] | None], None] | None = (
            None
        )
        self._server: grpc.aio.Server | None = None

    def update(self, snapshot: Snapshot) -> None:
        """A new snapshot: pushed at once to every stream if it differs."""
        if snapshot == self.snapshot:
            return
        self.snapshot = snapshot
        self.version += 1
        if self.on_version is not None:
            self.on_version(self.version)
        for stream in self._streams:
            stream.wake.set()

    async def start(self) -> None:
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_REQUEST),
                ("grpc.max_concurrent_streams", 16),  # per connection
            ]
        )
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self, self._server)
        address = f"{self.host}:{self.port}"
        if self.tls is not None:
            port = self._server.add_secure_port(address, self.tls.credentials())
        else:
            port = self._server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"--xds: cannot listen on {self.host}:{self.port}")
        self.port = port
        await self._server.start()
        log.info("Envoy ADS (CDS, EDS) answering on %s:%d", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0.5)

    async def StreamAggregatedResources(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        projects, client = await self._projects_of(context)
        if len(self._streams) >= self.max_streams:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this ADS server holds {self.max_streams} streams, as many as it may",
            )
        if sum(1 for s in self._streams if s.client == client) >= self.max_streams_per_client:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this client holds {self.max_streams_per_client} streams, as many as one may",
            )
        stream = _Stream(projects, client)
        self._streams.add(stream)
        reader = asyncio.ensure_future(self._read(request_iterator, stream))
        try:
            while not reader.done():
                for response in self._due(stream):
                    yield response
                stream.wake.clear()
                waiter = asyncio.ensure_future(stream.wake.wait())
                await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
        finally:
            self._streams.discard(stream)
            reader.cancel()

    async def _projects_of(
        self,
        context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
    ) -> tuple[frozenset[str] | None, str]:
        """The projects this stream's Envoy may read (None: every one - no
        TLS) and who it is (its certificate's name, else its address)."""
        if self.tls is None:
            peer = context.peer() or ""
            return None, peer.rsplit(":", 1)[0]
        names = list(context.auth_context().get("x509_common_name", []))
        name = names[0].decode("utf-8", "replace") if names else ""
        projects = self.clients.get(name)
        if projects is None:
            log.warning(
                "an Envoy with certificate name %s is not an --xds-client: refused", brief(name)
            )
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "this certificate's name is not given any project (--xds-client NAME=PROJECT)",
            )
        return projects, name

    async def _read(
        self, requests: AsyncIterator[discovery_pb2.DiscoveryRequest], stream: _Stream
    ) -> None:
        async for request in requests:
            if request.type_url not in (CLUSTER_TYPE, ENDPOINT_TYPE):
                continue
            if request.HasField("error_detail"):
                # (every field is the Envoy's to fill: each cut short, and a
                # stream's NACKs logged once in NACK_LOG_EVERY seconds)
                now = asyncio.get_running_loop().time()
                if now - stream.last_nack_log >= NACK_LOG_EVERY:
                    stream.last_nack_log = now
                    log.warning(
                        "Envoy %s refused %s version %s: %s",
                        brief(request.node.id, 100),
                        request.type_url.rsplit(".", 1)[-1],
                        brief(request.version_info, 40),
                        brief(request.error_detail.message, 300),
                    )
            elif request.type_url == ENDPOINT_TYPE and self.on_ack is not None:
                self._acked(request, stream)
            names = request.resource_names
            if len(names) > MAX_NAMES:
                log.warning(
                    "an Envoy subscribed to %d names: only the first %d", len(names), MAX_NAMES
                )
            stream.names[request.type_url] = tuple(sorted(names[:MAX_NAMES]))
            stream.wake.set()

    def _acked(self, request: discovery_pb2.DiscoveryRequest, stream: _Stream) -> None:
        """An EDS request that ACKs a version this server sent (SPEC §11)."""
        version = request.version_info
        if not request.response_nonce or not version.isdigit() or len(version) > 18:
            return  # (a first request, or not a version of ours)
        node = request.node.id
        instance = node[:100] if node and node.isprintable() else stream.client
        names = tuple(request.resource_names[:MAX_NAMES])
        assert self.on_ack is not None
        try:
            self.on_ack(instance or "envoy", int(version), names, stream.projects)
        except Exception:  # a receipt must never take the stream down
            log.exception("an Envoy's ACK could not be counted")

    def _due(self, stream: _Stream) -> list[discovery_pb2.DiscoveryResponse]:
        out = []
        for type_url, names in stream.names.items():
            if stream.sent.get(type_url) == (self.version, names):
                continue
            table = (
                self.snapshot.clusters if type_url == CLUSTER_TYPE else self.snapshot.assignments
            )
            chosen = sorted(table) if not names else [n for n in names if n in table]
            if stream.projects is not None:  # (cluster names are PROJECT/NAME)
                chosen = [n for n in chosen if n.partition("/")[0] in stream.projects]
            stream.nonce += 1
            response = discovery_pb2.DiscoveryResponse(
                version_info=str(self.version), type_url=type_url, nonce=str(stream.nonce)
            )
            for name in chosen:
                response.resources.append(any_pb2.Any(type_url=type_url, value=table[name]))
            stream.sent[type_url] = (self.version, names)
            out.append(response)
        return out


def envoy_hash_policy(bs: BackendService) -> list[dict[str, object]]:
    """The route ``hash_policy`` matching a consumer backend service's
    session affinity (SPEC §9), for the Envoy route that sends to its
    cluster (the cluster itself is MAGLEV then): Envoy's own generated
    cookie ``HG_AFFINITY`` (Envoy signs nothing: see docs/integrations.md),
    a header, or the source address. Empty without affinity."""
    mode = bs.session_affinity
    if mode == "GENERATED_COOKIE":
        return [{"cookie": {"name": "HG_AFFINITY", "ttl": f"{bs.affinity_cookie_ttl_sec}s",
                            "path": "/"}}]  # fmt: skip
    if mode == "HEADER_FIELD":
        return [{"header": {"header_name": bs.affinity_header}}]
    if mode == "CLIENT_IP":
        return [{"connection_properties": {"source_ip": True}}]
    return []


def bootstrap(
    xds_port: int,
    listen_port: int,
    admin_port: int,
    cluster: str,
    hash_policy: list[dict[str, object]] | None = None,
) -> dict[str, object]:
    """An Envoy bootstrap that knows nothing of the service but healthgate's
    ADS address and a listener routing everything to ``cluster`` (what the
    demo, the tests and docs/integrations.md use); ``hash_policy`` on that
    route for session affinity (:func:`envoy_hash_policy`)."""
    route: dict[str, object] = {"cluster": cluster}
    if hash_policy:
        route["hash_policy"] = hash_policy
    hcm = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
    return {
        "node": {"id": "test-envoy", "cluster": "test"},
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "healthgate"}}],
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
        },
        "static_resources": {
            "clusters": [
                {
                    "name": "healthgate",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        }
                    },
                    "load_assignment": {
                        "cluster_name": "healthgate",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": "127.0.0.1",
                                                    "port_value": xds_port,
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
            ],
            "listeners": [
                {
                    "name": "front",
                    "address": {
                        "socket_address": {"address": "127.0.0.1", "port_value": listen_port}
                    },
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": hcm,
                                        "stat_prefix": "front",
                                        "route_config": {
                                            # the cluster comes from ADS, later
                                            "validate_clusters": False,
                                            "virtual_hosts": [
                                                {
                                                    "name": "all",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "route": route,
                                                        }
                                                    ],
                                                }
                                            ],
                                        },
                                        "http_filters": [
                                            {
                                                "name": "envoy.filters.http.router",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                                                },
                                            }
                                        ],
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
        },
    }
