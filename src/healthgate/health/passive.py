"""Real traffic in the engine (SPEC §8): the third part beside the endpoint
table and the graph - pure, in virtual time, every call given ``now``.

Once a second the serving process hands :meth:`PassiveHealth.observe` what
its listeners' hops to each upstream address came to
(controlplane/evidence.py). This module knows which addresses are whose:

* an **endpoint** of a producer backend service is reached at its own
  address (its port, or its producer rule's when it has none): its hops
  feed that backend service's outlier detector (health/outliers.py), whose
  ejections the endpoint table applies (the data plane's HEALTHY set no
  longer holds the endpoint; its probe state is untouched);
* a **producer rule's address**, reached by a consumer front end of another
  process, and every endpoint of its backend service, feed the TRAFFIC
  health sources of that backend service (health/traffic.py).

A traffic source's verdict is, in embedded mode, its state at once
(``local_traffic``); in cluster mode the node's verdicts are opinions, and
the nodes' quorum sets the state (cluster/traffic.py calls
:meth:`set_traffic`). Cost: nothing per request; per second, the upstreams
that carried traffic, and nothing at all while no backend service has
``outlierDetection`` and no source is TRAFFIC.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from healthgate.health.endpoints import EndpointTable
from healthgate.health.evidence import Address, Hops
from healthgate.health.graph import HealthGraph
from healthgate.health.outliers import BackendOutliers, EjectionPhase
from healthgate.health.states import Ejection, HealthState, Record
from healthgate.health.traffic import TrafficJudge, Verdict
from healthgate.health.types import EndpointKey
from healthgate.model.names import ResourcePath, endpoint_name, endpoint_path
from healthgate.model.resources import (
    BackendService,
    ForwardingRule,
    HealthSource,
    InstanceGroup,
    NetworkEndpointGroup,
    OutlierDetection,
    Resource,
)


@dataclass(slots=True)
class PassiveResult:
    records: list[Record] = field(default_factory=list)
    # addresses ejected in this second (the data plane restarts their runs)
    ejected: list[Address] = field(default_factory=list)
    # this node's verdicts that flipped (state or judged), per TRAFFIC source
    verdicts: dict[str, Verdict] = field(default_factory=dict)


class PassiveHealth:
    def __init__(
        self,
        table: EndpointTable,
        graph: HealthGraph,
        chance: Callable[[], float] = random.random,
    ) -> None:
        self.table = table
        self.graph = graph
        self.chance = chance
        self.local_traffic = True  # embedded: a verdict is the source's state
        self._world: Mapping[ResourcePath, Resource] = {}
        self._policies: dict[ResourcePath, OutlierDetection] = {}  # producer bs -> its
        self._detectors: dict[ResourcePath, BackendOutliers] = {}
        self._grouped: dict[ResourcePath, tuple[int, int]] = {}  # when its groups were taken
        self._rules: dict[ResourcePath, set[ResourcePath]] = {}  # bs -> its regional rules
        self._rule_bs: dict[ResourcePath, ResourcePath] = {}
        self._judges: dict[str, TrafficJudge] = {}
        self._sources: dict[str, tuple[ResourcePath, HealthSource, HealthState]] = {}
        self._sources_stale = True
        # address -> [(backend service, endpoint key or None for a rule's address)]
        self._index: dict[Address, list[tuple[ResourcePath, EndpointKey | None]]] = {}
        self._index_key: tuple[int, int] = (-1, -1)
        self._changes = 0

    # ------------------------------------------------------------------ resources

    def sync(
        self, now: float, world: Mapping[ResourcePath, Resource], changed: Collection[ResourcePath]
    ) -> None:
        """What the change touched: outlier policies, producer rules, traffic
        sources (the work is the change's)."""
        self._world = world
        moved = False
        for p in changed:
            r = world.get(p)
            if p.collection == "backendServices":
                od = (
                    r.outlier_detection
                    if isinstance(r, BackendService) and not r.is_global
                    else None
                )
                if od is not None:
                    if self._policies.get(p) != od:
                        self._policies[p] = od
                        self._detectors.pop(p, None)  # (a new policy starts afresh)
                else:
                    self._policies.pop(p, None)
                    self._clear_ejections(now, p)
                    self._detectors.pop(p, None)
                moved = True
            elif p.collection == "forwardingRules":
                old = self._rule_bs.pop(p, None)
                if old is not None:
                    self._rules.get(old, set()).discard(p)
                if isinstance(r, ForwardingRule) and not r.is_global:
                    bs = r.ref("backend_service")
                    if bs is not None:
                        self._rule_bs[p] = bs
                        self._rules.setdefault(bs, set()).add(p)
                moved = True
            elif p.collection in ("healthSources", "networkEndpointGroups", "instanceGroups"):
                moved = True
            if p.collection == "healthSources":
                self._sources_stale = True
        if moved:
            self._changes += 1

    def _clear_ejections(self, now: float, bs: ResourcePath) -> None:
        det = self._detectors.get(bs)
        if det is None:
            return
        for key in det.ejected():
            self.table.set_ejected(now, bs, key, None, False, [])

    def watching(self, now: float) -> bool:
        """Is there anything to feed (an outlier policy, a traffic source)?"""
        if self._sources_stale:
            self._refresh_sources(now)
        return bool(self._policies or self._judges)

    def _refresh_sources(self, now: float) -> None:
        self._sources_stale = False
        sources = self.graph.traffic_sources()
        judges = {}
        for path, (_bs, src, state) in sources.items():
            judge = self._judges.get(path)
            if judge is None or judge.policy != src.traffic:
                judge = TrafficJudge(src.traffic, now)
                if state is HealthState.UNHEALTHY:  # (resumed UNHEALTHY: fail static)
                    judge.verdict = Verdict(state, False, 0, 0, "resumed UNHEALTHY", now)
            judges[path] = judge
        self._judges = judges
        self._sources = sources

    # ------------------------------------------------------------------ addresses

    def _address_index(self) -> dict[Address, list[tuple[ResourcePath, EndpointKey | None]]]:
        key = (self._changes, self.table.membership)
        if key == self._index_key:
            return self._index
        self._index_key = key
        wanted = set(self._policies) | {bs for bs, _s, _st in self._sources.values()}
        index: dict[Address, list[tuple[ResourcePath, EndpointKey | None]]] = {}
        for bs in sorted(wanted, key=str):
            for rule_path in sorted(self._rules.get(bs, ()), key=str):
                fr = self._world.get(rule_path)
                if not isinstance(fr, ForwardingRule):
                    continue
                port = fr.port_list()[0]
                index.setdefault((fr.ip_address, port), []).append((bs, None))
                for ip, p in self.table.all_endpoints(bs):
                    entry = (bs, (ip, p))
                    listed = index.setdefault((ip, p if p is not None else port), [])
                    if entry not in listed:
                        listed.append(entry)
        self._index = index
        return index

    def _groups(self, bs: ResourcePath) -> dict[str, list[EndpointKey]]:
        res = self._world.get(bs)
        groups: dict[str, list[EndpointKey]] = {}
        if not isinstance(res, BackendService):
            return groups
        for g in res.refs("backends"):
            group = self._world.get(g)
            if isinstance(group, NetworkEndpointGroup):
                groups[str(g)] = [(e.ip_address, e.port) for e in group.endpoints]
            elif isinstance(group, InstanceGroup):
                groups[str(g)] = [(i.ip_address, group.serving_port) for i in group.instances]
        return groups

    # ------------------------------------------------------------------ a second

    def observe(self, now: float, hops: Mapping[Address, Hops]) -> PassiveResult:
        """One second of this node's traffic (see the module doc)."""
        out = PassiveResult()
        if not self.watching(now):
            return out
        index = self._address_index()
        per_bs: dict[ResourcePath, list[Hops]] = {}  # (traffic sources)
        per_endpoint: dict[ResourcePath, dict[EndpointKey, Hops]] = {}
        addresses: dict[tuple[ResourcePath, EndpointKey], Address] = {}
        for address, h in hops.items():
            for bs, key in index.get(address, ()):
                per_bs.setdefault(bs, []).append(h)
                if key is not None and bs in self._policies:
                    mine = per_endpoint.setdefault(bs, {})
                    before = mine.get(key)
                    mine[key] = h if before is None else before.plus(h)
                    addresses[(bs, key)] = address
        for bs, policy in self._policies.items():
            self._outliers(now, bs, policy, per_endpoint.get(bs, {}), addresses, out)
        for path, judge in self._judges.items():
            bs = self._sources[path][0]
            was = judge.verdict
            v = judge.observe(now, per_bs.get(bs, ()))
            if v.state is not was.state or v.judged != was.judged:
                out.verdicts[path] = v
            if self.local_traffic and v.state is not self._sources[path][2]:
                self.graph.set_traffic(now, path, v.state, v.reason, out.records)
                self._sources[path] = (bs, self._sources[path][1], v.state)
        return out

    def _outliers(
        self,
        now: float,
        bs: ResourcePath,
        policy: OutlierDetection,
        hops: Mapping[EndpointKey, Hops],
        addresses: Mapping[tuple[ResourcePath, EndpointKey], Address],
        out: PassiveResult,
    ) -> None:
        det = self._detectors.get(bs)
        groups_key = (self._changes, self.table.membership)
        if det is None:
            det = self._detectors[bs] = BackendOutliers(policy, self._groups(bs), now, self.chance)
            self._grouped[bs] = groups_key
        elif self._grouped.get(bs) != groups_key:
            det.regroup(self._groups(bs))
            self._grouped[bs] = groups_key
        decisions = det.observe(now, hops)
        # (in a cluster each node ejects by its own traffic: an ejection that
        # moved the aggregation would give the nodes different composites)
        counted = policy.count_as_unhealthy and self.local_traffic
        for d in decisions:
            if d.phase is EjectionPhase.EJECTED:
                self.table.set_ejected(now, bs, d.endpoint, d.until, counted, out.records)
                address = addresses.get((bs, d.endpoint))
                if address is not None:
                    out.ejected.append(address)
            elif d.phase is EjectionPhase.RETURNED:
                self.table.set_ejected(now, bs, d.endpoint, None, counted, out.records)
            out.records.append(
                Ejection(
                    now,
                    bs.project,
                    bs.region,
                    str(bs),
                    endpoint_name(*d.endpoint),
                    endpoint_path(bs, *d.endpoint),
                    d.phase.value,
                    d.reason,
                    d.until,
                    d.ejections,
                    d.detection,
                )
            )

    def set_traffic(self, now: float, source: str, state: HealthState, reason: str) -> list[Record]:
        """A TRAFFIC source's state as the nodes' quorum decided it (cluster mode)."""
        records: list[Record] = []
        self.graph.set_traffic(now, source, state, reason, records)
        entry = self._sources.get(source)
        if entry is not None:
            self._sources[source] = (entry[0], entry[1], state)
        return records

    def verdicts(self) -> dict[str, Verdict]:
        """This node's verdict of every TRAFFIC source (as last judged)."""
        return {path: j.verdict for path, j in self._judges.items()}
