"""The endpoint table: every endpoint's threshold state, in parallel arrays.

Endpoints are many (up to millions), so they live in arrays indexed by a
small integer *slot*: state, success run, failure run, last result and the
time of the last change - about 40 bytes each, plus the slot's key. Each
slot belongs to one *aggregate*, the endpoint set of one regional backend
service under its one health check, which keeps running counts (total,
healthy, unknown). One probe result is therefore O(1): step the threshold
machine (health/threshold.py), and when the state flips, adjust two
counters and answer with the endpoint's transition. What the flip means
above the endpoints is the graph's business (health/graph.py).

An aggregate is rebuilt only when its backend service, health check or
groups changed, and then only the endpoints that came or went are touched
(the others keep their state, the fail-static choice: a changed check is
confirmed by the next probes, not by forgetting what was known).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping

from healthgate import http_scan
from healthgate.health.pushed import Pushed
from healthgate.health.states import (
    STEADY,
    HealthState,
    Outcome,
    ProbeResult,
    Record,
    RecordKind,
    Transition,
)
from healthgate.health.threshold import RUN_CAP, step
from healthgate.health.types import (
    NO_SECRETS,
    ApplyResult,
    Counts,
    EndpointKey,
    EndpointStatus,
    ProbeTarget,
)
from healthgate.model.checks import Secret
from healthgate.model.names import (
    ResourcePath,
    endpoint_name,
    endpoint_path,
    parse_endpoint_name,
    split_endpoint_path,
)
from healthgate.model.resources import (
    BackendService,
    HealthCheck,
    InstanceGroup,
    NetworkEndpointGroup,
    Resource,
)

UNKNOWN = HealthState.UNKNOWN
HEALTHY = HealthState.HEALTHY
UNHEALTHY = HealthState.UNHEALTHY
DEGRADED = HealthState.DEGRADED
_STATES = (UNKNOWN, HEALTHY, UNHEALTHY, DEGRADED)
_OK = Outcome.OK  # per-probe outcomes as globals (see the note on Outcome)
# on_steady in C (src/healthgate/_kept.c), when built
_steady_table: Callable[..., bytes] | None = getattr(http_scan.speedups, "steady_table", None)


class _Aggregate:
    __slots__ = (
        "all_cache",
        "check",
        "count_ejected",
        "degraded",
        "ejected",
        "healthy",
        "healthy_cache",
        "hthr",
        "path",
        "secrets",
        "slots",
        "total",
        "unknown",
        "uthr",
    )

    def __init__(self, path: ResourcePath, check: HealthCheck) -> None:
        self.path = path
        self.check = check
        self.hthr = check.healthy_threshold
        self.uthr = check.unhealthy_threshold
        self.total = 0
        self.healthy = 0
        self.unknown = 0
        self.degraded = 0  # SPEC §9: working but impaired (counted apart from healthy)
        self.slots: dict[EndpointKey, int] = {}
        self.healthy_cache: tuple[EndpointKey, ...] | None = None
        self.all_cache: tuple[EndpointKey, ...] | None = None  # until slots change
        # ejected from real traffic until (SPEC §8: health/outliers.py), and
        # whether an ejection counts as UNHEALTHY for the aggregation policy
        self.ejected: dict[EndpointKey, float] = {}
        self.count_ejected = False
        # the values of the secrets its check reads (SPEC §10): a new value
        # is a changed check to the probes
        self.secrets: Mapping[ResourcePath, str] = NO_SECRETS

    def count(self, old: int, new: int) -> None:
        """An endpoint of it went from state ``old`` to ``new`` (-1: none)."""
        self.healthy += (new == HEALTHY) - (old == HEALTHY)
        self.unknown += (new == UNKNOWN) - (old == UNKNOWN)
        self.degraded += (new == DEGRADED) - (old == DEGRADED)


def _reason_for_endpoint(state: HealthState, runs: int, threshold: int, last: str) -> str:
    if state is HEALTHY:
        return f"{runs} consecutive successful probes (healthyThreshold {threshold}); last: {last}"
    if state is DEGRADED:
        return (
            f"{runs} consecutive successful probes (healthyThreshold {threshold}), of the last "
            f"{threshold} at least one in degradedStatusCodes; last: {last}"
        )
    return f"{runs} consecutive failed probes (unhealthyThreshold {threshold}); last: {last}"


FlipListener = Callable[[float, ResourcePath, list[Record]], None]


# an endpoint's success run, failure run, and last result's outcome, status,
# latency, time and detail (EndpointTable.observed)
Observed = tuple[int, int, int, int, float, float, str]


class EndpointTable:
    """``on_flip(now, backend_service, records)`` is called with the
    endpoint's transition as ``records`` whenever one flips, and may append
    what the flip causes above (the engine hands it to the graph)."""

    def __init__(self, on_flip: FlipListener | None = None) -> None:
        self.on_flip = on_flip
        # a backend service's counts moved without a flip (an ejection that
        # counts as UNHEALTHY): the graph re-evaluates its sources
        self.on_counts: FlipListener | None = None
        # endpoint arrays, indexed by slot
        self._state = bytearray()
        self._ok = bytearray()
        self._fail = bytearray()
        self._clean = bytearray()  # successes since the last failure or degraded one
        self._agg = array("i")
        self._last_outcome = bytearray()
        self._last_status = array("H")
        self._last_latency = array("f")
        self._last_time = array("d")
        self._since = array("d")
        self._key: list[EndpointKey | None] = []
        self._free: list[int] = []
        self._last_detail: dict[int, str] = {}
        self._aggs: list[_Aggregate | None] = []
        self._agg_ids: dict[ResourcePath, int] = {}
        # a backend service's path as text -> its aggregate: endpoint paths
        # from probe workers and cluster peers name it thousands of times a
        # second, and parsing it each time was most of their cost (29 µs per
        # path); emptied whenever a backend service comes or goes
        self._agg_by_text: dict[str, int] = {}
        self._free_aggs: list[int] = []
        # what each regional backend service's endpoints are made of (its
        # check and groups), and who uses each of them: a change of one is
        # a rebuild of its users only (a change costs what it changes)
        self._inputs: dict[ResourcePath, tuple[ResourcePath, ...]] = {}
        self._users: dict[ResourcePath, set[ResourcePath]] = {}
        self._ports: dict[int, int] = {}  # interned port numbers
        # PUSH checks (SPEC §10, health/pushed.py): the last report of each endpoint
        self.pushed = Pushed(self)
        # moves on whenever a backend service's HEALTHY (or whole) endpoint set changes
        self.generation = 0
        self.membership = 0  # ... whenever its whole endpoint set changes

    # ------------------------------------------------------------------ hot path

    def on_result(self, now: float, slot: int, result: ProbeResult) -> list[Record]:
        """Feed one probe result; the transitions it caused (often none)."""
        agg = self._aggs[self._agg[slot]]
        assert agg is not None
        old = self._state[slot]
        outcome = result.outcome
        new, ok, fail, clean = step(
            _STATES[old],
            self._ok[slot],
            self._fail[slot],
            outcome,
            agg.hthr,
            agg.uthr,
            self._clean[slot],
        )
        self._ok[slot] = ok
        self._fail[slot] = fail
        self._clean[slot] = clean
        self._last_outcome[slot] = outcome
        self._last_status[slot] = result.status
        self._last_latency[slot] = result.latency
        self._last_time[slot] = now
        if result.detail:
            self._last_detail[slot] = result.detail
        elif self._last_detail:
            self._last_detail.pop(slot, None)
        if new == old:
            return []
        self._state[slot] = new
        self._since[slot] = now
        agg.count(old, new)
        self._endpoints_changed(agg)
        key = self._key[slot]
        assert key is not None
        if new in (HEALTHY, DEGRADED):
            reason = _reason_for_endpoint(new, ok, agg.hthr, result.describe())
        else:
            reason = _reason_for_endpoint(new, fail, agg.uthr, result.describe())
        records: list[Record] = [self._transition(now, agg, key, _STATES[old], new, reason)]
        if self.on_flip is not None:
            self.on_flip(now, agg.path, records)
        return records

    def on_results(self, now: float, results: Iterable[tuple[int, ProbeResult]]) -> list[Record]:
        """Feed the results of probes that ended together (a tick's worth);
        the same as :meth:`on_result` for each in turn. The steady state - a
        success for an endpoint already HEALTHY - is taken here without the
        threshold machine's call: what :func:`step` does then is grow the
        success run (capped), zero the failure run and keep the state. (Its
        clean run is not counted here: it is read only after a degraded
        success or a failure, and both start it again from 0.)"""
        other = self.on_result
        records: list[Record] = []
        states, ok_runs, fail_runs = self._state, self._ok, self._fail
        details = self._last_detail
        last_outcome, last_status = self._last_outcome, self._last_status
        last_latency, last_time = self._last_latency, self._last_time
        for slot, result in results:
            if result.outcome is not _OK or states[slot] != HEALTHY:
                records += other(now, slot, result)
                continue
            run = ok_runs[slot]
            if run < RUN_CAP:
                ok_runs[slot] = run + 1
            fail_runs[slot] = 0
            last_outcome[slot] = _OK
            last_status[slot] = result.status
            last_latency[slot] = result.latency
            last_time[slot] = now
            if result.detail:
                details[slot] = result.detail
            elif details:
                details.pop(slot, None)
        return records

    def on_steady(self, now: float, records: bytes) -> bytes:
        """Steady successes (health/states.py's ``STEADY`` records, made by
        the lane: probes/lane.py) of endpoints already HEALTHY,
        taken as :meth:`on_results` takes them, with no Python object per
        result (in C when built). The records not taken - of an endpoint
        not HEALTHY - are returned, for :meth:`on_results`."""
        if _steady_table is not None:
            return _steady_table(
                now,
                records,
                HEALTHY,
                self._state,
                self._ok,
                self._fail,
                self._last_outcome,
                self._last_status,
                self._last_latency,
                self._last_time,
                self._last_detail,
            )
        left = []
        states, ok_runs, fail_runs = self._state, self._ok, self._fail
        for record in STEADY.iter_unpack(records):
            slot, status, latency = record
            if slot >= len(states) or states[slot] != HEALTHY:
                left.append(STEADY.pack(*record))
                continue
            run = ok_runs[slot]
            if run < RUN_CAP:
                ok_runs[slot] = run + 1
            fail_runs[slot] = 0
            self._last_outcome[slot] = _OK
            self._last_status[slot] = status
            self._last_latency[slot] = latency
            self._last_time[slot] = now
            if self._last_detail:
                self._last_detail.pop(slot, None)
        return b"".join(left)

    def set_state(self, now: float, slot: int, new: HealthState, reason: str) -> list[Record]:
        """Set an endpoint's state decided outside this table's threshold
        machine (cluster mode: the quorum of the vantages' opinions, or a
        prober taking an endpoint over from the stored opinion); the
        transition, handed to the graph as a probe's flip would be."""
        agg = self._aggs[self._agg[slot]]
        assert agg is not None
        old = self._force_state(now, agg, slot, new)
        if old == new:
            return []
        key = self._key[slot]
        assert key is not None
        records: list[Record] = [self._transition(now, agg, key, old, new, reason)]
        if self.on_flip is not None:
            self.on_flip(now, agg.path, records)
        return records

    def push_slots(
        self, backend_service: ResourcePath
    ) -> tuple[HealthCheck, Mapping[EndpointKey, int]] | None:
        """A backend service whose check is an enabled PUSH one: its check
        and endpoints (health/pushed.py); else None."""
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        if agg is None or agg.check.type != "PUSH" or not agg.check.enabled:
            return None
        return agg.check, agg.slots

    def push_state(
        self,
        now: float,
        slot: int,
        state: HealthState,
        reason: str,
        records: list[Record],
        flip: bool,
    ) -> None:
        """A pushed endpoint's state (a report, or its TTL run out): within a
        sync its backend service is re-evaluated with the rest (``flip``
        False); from the expiry timer, handed to the graph as a flip."""
        if flip:
            records += self.set_state(now, slot, state, reason)
            return
        agg = self._aggs[self._agg[slot]]
        key = self._key[slot]
        assert agg is not None and key is not None
        old = self._force_state(now, agg, slot, state)
        if old is not state:
            records.append(self._transition(now, agg, key, old, state, reason))

    def state(self, slot: int) -> HealthState:
        return _STATES[self._state[slot]]

    def since(self, slot: int) -> float:
        """When the endpoint's state began."""
        return self._since[slot]

    def observed(self, slot: int) -> Observed:
        """What the probes of an endpoint have shown so far - its runs and
        its last result - without its state (probe workers send these)."""
        return (
            self._ok[slot],
            self._fail[slot],
            self._last_outcome[slot],
            self._last_status[slot],
            float(self._last_latency[slot]),
            self._last_time[slot],
            self._last_detail.get(slot, ""),
        )

    def set_observed(self, slot: int, seen: Observed) -> None:
        """Take what a probe worker's table observed of an endpoint (its
        state comes with its flips, :meth:`set_state`)."""
        ok, fail, outcome, status, latency, when, detail = seen
        self._ok[slot], self._fail[slot] = ok, fail
        # (the clean run is not sent: a worker's flips carry the state it decided)
        self._clean[slot] = 0 if outcome == Outcome.DEGRADED else ok
        self._last_outcome[slot], self._last_status[slot] = outcome, status
        self._last_latency[slot], self._last_time[slot] = latency, when
        if detail:
            self._last_detail[slot] = detail
        else:
            self._last_detail.pop(slot, None)

    def set_ejected(
        self,
        now: float,
        backend_service: ResourcePath,
        key: EndpointKey,
        until: float | None,
        count_as_unhealthy: bool,
        records: list[Record],
    ) -> bool:
        """Eject an endpoint from real traffic until ``until`` (None: it
        returns); its probe state is untouched. With ``count_as_unhealthy``
        a HEALTHY endpoint ejected counts as UNHEALTHY for the aggregation
        policy: the graph is told (``records`` gets what that causes).
        False when there is no such endpoint."""
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        if agg is None or key not in agg.slots:
            return False
        was = key in agg.ejected
        if until is None:
            agg.ejected.pop(key, None)
        else:
            agg.ejected[key] = until
        counted = agg.count_ejected
        agg.count_ejected = count_as_unhealthy
        self._endpoints_changed(agg)
        if (
            (was != (until is not None) or counted != count_as_unhealthy)
            and (count_as_unhealthy or counted)
            and self._state[agg.slots[key]] in (HEALTHY, DEGRADED)
            and self.on_counts is not None
        ):
            self.on_counts(now, backend_service, records)
        return True

    def ejected(self, backend_service: ResourcePath) -> Mapping[EndpointKey, float]:
        """The endpoints ejected from real traffic now, and until when."""
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        return agg.ejected if agg is not None else {}

    def _transition(
        self,
        now: float,
        agg: _Aggregate,
        key: EndpointKey,
        old: HealthState,
        new: HealthState,
        reason: str,
    ) -> Transition:
        p = agg.path
        name = endpoint_name(*key)
        return Transition(
            now,
            p.project,
            p.region,
            RecordKind.ENDPOINT,
            name,
            endpoint_path(p, *key),
            old,
            new,
            reason,
        )

    # ------------------------------------------------------------------ resources

    def sync(
        self,
        now: float,
        resources: Mapping[ResourcePath, Resource],
        changed: Collection[ResourcePath],
        result: ApplyResult,
    ) -> list[ResourcePath]:
        """Rebuild the aggregates whose backend service, check or groups
        changed (``changed``: every path put or deleted), drop those whose
        backend service is gone; returns their paths. The work is the
        change's: only the backend services it touches are looked at."""
        touched: set[ResourcePath] = set()
        for p in changed:
            touched.update(self._users.get(p, ()))
            if p.collection == "backendServices":
                touched.add(p)
        rebuilt: list[ResourcePath] = []
        for path in sorted(touched):
            res = resources.get(path)
            if isinstance(res, BackendService) and not res.is_global:
                check = resources.get(res.refs("health_checks")[0])
                assert isinstance(check, HealthCheck), "validated: the health check exists"
                secrets = check.refs("secret_refs")
                self._use(path, (*res.refs("health_checks"), *res.refs("backends"), *secrets))
                values = (
                    {p: s.value for p in secrets if isinstance(s := resources.get(p), Secret)}
                    if secrets
                    else NO_SECRETS
                )
                self.place(now, path, check, values, self._endpoints_of(res, resources), result)
                rebuilt.append(path)
            elif path in self._agg_ids:  # gone (or no longer a regional one)
                self._use(path, ())
                self._drop_aggregate(path, result)
                rebuilt.append(path)
        reported = self.pushed.sync(now, resources, changed, rebuilt, result.records)
        return rebuilt + [p for p in reported if p not in touched]

    def _use(self, bs: ResourcePath, inputs: tuple[ResourcePath, ...]) -> None:
        """``bs``'s endpoints are made of ``inputs`` from now on (reverse index)."""
        for p in self._inputs.pop(bs, ()):
            users = self._users.get(p)
            if users is not None:
                users.discard(bs)
                if not users:
                    del self._users[p]
        if inputs:
            self._inputs[bs] = inputs
            for p in inputs:
                self._users.setdefault(p, set()).add(bs)

    def _endpoints_of(
        self, bs: BackendService, resources: Mapping[ResourcePath, Resource]
    ) -> dict[EndpointKey, None]:
        keys: dict[EndpointKey, None] = {}
        for group_path in bs.refs("backends"):
            group = resources.get(group_path)
            if isinstance(group, NetworkEndpointGroup):
                for ep in group.endpoints:
                    port = self._ports.setdefault(ep.port, ep.port) if ep.port else None
                    keys[(ep.ip_address, port)] = None
            elif isinstance(group, InstanceGroup):
                for inst in group.instances:
                    keys[(inst.ip_address, group.serving_port)] = None
        return keys

    def place(
        self,
        now: float,
        path: ResourcePath,
        check: HealthCheck,
        secrets: Mapping[ResourcePath, str],
        desired: Mapping[EndpointKey, None],
        result: ApplyResult,
    ) -> None:
        """A backend service's endpoints are ``desired``, under ``check``
        (with these secrets' values) from now on: what came is added, what
        went is freed, what stayed keeps its state (and is probed anew when
        how it is probed changed) - into ``result``. :meth:`sync` calls it
        for the backend services a change touches; a prober given endpoints
        rather than the world (health/probed.py) calls it directly."""
        agg_id = self._agg_ids.get(path)
        if agg_id is None:
            agg_id = self._free_aggs.pop() if self._free_aggs else len(self._aggs)
            agg = _Aggregate(path, check)
            agg.secrets = secrets
            if agg_id == len(self._aggs):
                self._aggs.append(agg)
            else:
                self._aggs[agg_id] = agg
            self._agg_ids[path] = agg_id
            self._agg_by_text.clear()
            old_check: HealthCheck | None = None
            old_secrets = secrets
        else:
            agg_or_none = self._aggs[agg_id]
            assert agg_or_none is not None
            agg = agg_or_none
            old_check, old_secrets = agg.check, agg.secrets
            agg.secrets = secrets
            agg.check, agg.hthr, agg.uthr = (
                check,
                check.healthy_threshold,
                check.unhealthy_threshold,
            )

        for key in [k for k in agg.slots if k not in desired]:
            agg.ejected.pop(key, None)
            slot = agg.slots.pop(key)
            self._free_slot(agg, slot)
            result.removed.append(slot)
            result.removed_paths.append(endpoint_path(path, *key))
        enabled = check.enabled
        probed = enabled and check.type != "PUSH"  # (a PUSH check's reports decide)
        toggled = old_check is not None and old_check.enabled != enabled
        if toggled:
            # every kept endpoint changes meaning: disabled = HEALTHY "not checked",
            # re-enabled = UNKNOWN until probes say otherwise
            target = HEALTHY if not enabled else UNKNOWN
            reason = (
                "not checked (health check disabled)"
                if not enabled
                else "health check enabled: waiting for probes"
            )
            for key, slot in agg.slots.items():
                before = self._force_state(now, agg, slot, target)
                if before is not target:
                    result.records.append(self._transition(now, agg, key, before, target, reason))
                if probed:
                    result.added.append(ProbeTarget(slot, path, key[0], key[1], check, secrets))
                else:
                    result.removed.append(slot)
        elif old_check is not None:
            self._reprobe(agg, old_check, old_secrets, probed, result)
        for key in desired:
            if key in agg.slots:
                continue
            slot = self._alloc_slot(agg_id, key, HEALTHY if not enabled else UNKNOWN, now)
            agg.slots[key] = slot
            self._endpoints_changed(agg, membership=True)
            agg.total += 1
            if enabled:
                agg.unknown += 1
                if probed:
                    result.added.append(ProbeTarget(slot, path, key[0], key[1], check, secrets))
            else:
                agg.healthy += 1

    def _reprobe(
        self,
        agg: _Aggregate,
        old_check: HealthCheck,
        old_secrets: Mapping[ResourcePath, str],
        probed: bool,
        result: ApplyResult,
    ) -> None:
        """What the probes do about the kept endpoints of an aggregate whose
        check changed: probe them (it was PUSH), stop (it is PUSH now), or
        probe them anew (how they are probed changed, a secret with it)."""
        check, secrets, path = agg.check, agg.secrets, agg.path
        if check.type == "PUSH" and old_check.type != "PUSH":
            result.removed.extend(agg.slots.values())
            return
        if not probed or (
            old_check.type != "PUSH" and old_check == check and old_secrets == secrets
        ):
            return
        out = result.added if old_check.type == "PUSH" else result.changed
        for key, slot in agg.slots.items():
            out.append(ProbeTarget(slot, path, key[0], key[1], check, secrets))

    def _force_state(self, now: float, agg: _Aggregate, slot: int, new: HealthState) -> HealthState:
        """Set an endpoint's state outside the threshold machine; returns the old one."""
        old = self._state[slot]
        if old == new:
            return _STATES[old]
        self._state[slot] = new
        self._since[slot] = now
        self._ok[slot] = 0
        self._fail[slot] = 0
        self._clean[slot] = 0
        agg.count(old, new)
        self._endpoints_changed(agg)
        return _STATES[old]

    def drop(self, path: ResourcePath, result: ApplyResult) -> None:
        """A backend service's endpoints are no more (if it had any here)."""
        if path in self._agg_ids:
            self._drop_aggregate(path, result)

    def keys(self, path: ResourcePath) -> Iterable[EndpointKey]:
        """A backend service's endpoints (none: no such backend service here)."""
        agg_id = self._agg_ids.get(path)
        agg = self._aggs[agg_id] if agg_id is not None else None
        return agg.slots.keys() if agg is not None else ()

    def _drop_aggregate(self, path: ResourcePath, result: ApplyResult) -> None:
        agg_id = self._agg_ids.pop(path)
        self._agg_by_text.clear()
        agg = self._aggs[agg_id]
        assert agg is not None
        for key, slot in agg.slots.items():
            self._free_slot(agg, slot)
            result.removed.append(slot)
            result.removed_paths.append(endpoint_path(path, *key))
        self._aggs[agg_id] = None
        self._free_aggs.append(agg_id)

    def _alloc_slot(self, agg_id: int, key: EndpointKey, state: HealthState, now: float) -> int:
        if self._free:
            slot = self._free.pop()
            self._state[slot] = state
            self._ok[slot] = self._fail[slot] = self._clean[slot] = 0
            self._agg[slot] = agg_id
            self._last_outcome[slot] = 0
            self._last_status[slot] = 0
            self._last_latency[slot] = 0.0
            self._last_time[slot] = -1.0
            self._since[slot] = now
            self._key[slot] = key
            return slot
        slot = len(self._key)
        self._state.append(state)
        self._ok.append(0)
        self._fail.append(0)
        self._clean.append(0)
        self._agg.append(agg_id)
        self._last_outcome.append(0)
        self._last_status.append(0)
        self._last_latency.append(0.0)
        self._last_time.append(-1.0)
        self._since.append(now)
        self._key.append(key)
        return slot

    def _free_slot(self, agg: _Aggregate, slot: int) -> None:
        self._endpoints_changed(agg, membership=True)
        state = self._state[slot]
        agg.total -= 1
        agg.count(state, -1)
        self._key[slot] = None
        self._last_detail.pop(slot, None)
        self.pushed.forget(slot)
        self._free.append(slot)

    # ------------------------------------------------------------------ restarts

    def restore(self, endpoints: Mapping[str, tuple[HealthState, float]]) -> None:
        """Resume endpoints from persisted states (``endpoint path -> (state,
        since)``); entries for endpoints that no longer exist are ignored."""
        for path, (state, since) in endpoints.items():
            slot = self.slot_of_path(path)
            if slot is None:
                continue
            agg = self._aggs[self._agg[slot]]
            assert agg is not None
            if agg.check.enabled and agg.check.type != "PUSH":  # (reports decide those)
                self._force_state(since, agg, slot, state)
                self._since[slot] = since

    # ------------------------------------------------------------------ queries

    def targets(self, only: Container[int] | None = None) -> Iterator[ProbeTarget]:
        """Every endpoint that needs probing (disabled checks are not
        probed), or only those of these slots."""
        for agg in self._aggs:
            if agg is None or not agg.check.enabled or agg.check.type == "PUSH":
                continue
            for key, slot in agg.slots.items():
                if only is None or slot in only:
                    yield ProbeTarget(slot, agg.path, key[0], key[1], agg.check, agg.secrets)

    def endpoint_count(self) -> int:
        return len(self._key) - len(self._free)

    def slot_of(self, backend_service: ResourcePath, ip: str, port: int | None) -> int | None:
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        return agg.slots.get((ip, port)) if agg else None

    def slot_of_path(self, path: str) -> int | None:
        """The slot of an endpoint path (``<backend service>/endpoints/<ip:port>``);
        None when there is no such endpoint or the path does not parse."""
        bs_text, name = split_endpoint_path(path)
        by_text = self._agg_by_text
        agg_id = by_text.get(bs_text)
        try:
            if agg_id is None:
                agg_id = self._agg_ids.get(ResourcePath.parse(bs_text))
                if agg_id is None:
                    return None
                if len(by_text) > 2 * len(self._agg_ids) + 64:  # (other spellings: bounded)
                    by_text.clear()
                by_text[bs_text] = agg_id
            agg = self._aggs[agg_id]
            return agg.slots.get(parse_endpoint_name(name)) if agg is not None else None
        except ValueError:
            return None

    def endpoint_path(self, slot: int) -> str:
        return self.path_of(slot) or f"(free slot {slot})"

    def path_of(self, slot: int) -> str | None:
        """A slot's endpoint path (None: a free slot)."""
        key = self._key[slot] if 0 <= slot < len(self._key) else None
        agg = self._aggs[self._agg[slot]] if key is not None else None
        return endpoint_path(agg.path, *key) if key is not None and agg is not None else None

    def last_probe_ok(self, backend_service: ResourcePath) -> list[tuple[EndpointKey, bool]]:
        """(endpoint, did its last probe succeed) for every endpoint probed at
        least once: what /metrics exports, without building full statuses."""
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        if agg is None:
            return []
        ok, outcomes, times = Outcome.OK.value, self._last_outcome, self._last_time
        return [(key, outcomes[slot] == ok) for key, slot in agg.slots.items() if times[slot] >= 0]

    def endpoints(self, backend_service: ResourcePath) -> list[EndpointStatus]:
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        if agg is None:
            return []
        out = []
        for (ip, port), slot in agg.slots.items():
            state = _STATES[self._state[slot]]
            last: ProbeResult | None = None
            last_time = self._last_time[slot]
            if last_time >= 0:
                last = ProbeResult(
                    Outcome(self._last_outcome[slot]),
                    float(self._last_latency[slot]),
                    self._last_status[slot],
                    self._last_detail.get(slot, ""),
                )
            if not agg.check.enabled:
                reason = "not checked (health check disabled)"
            elif agg.check.type == "PUSH":
                reason = self.pushed.reason(slot)
            elif state is UNKNOWN:
                reason = f"{self._ok[slot]} of {agg.hthr} successes, {self._fail[slot]} of {agg.uthr} failures so far"
            elif state is HEALTHY or state is DEGRADED:
                reason = _reason_for_endpoint(
                    state, self._ok[slot], agg.hthr, last.describe() if last else "-"
                )
            else:
                reason = _reason_for_endpoint(
                    state, self._fail[slot], agg.uthr, last.describe() if last else "-"
                )
            out.append(
                EndpointStatus(
                    ip,
                    port,
                    state,
                    self._since[slot],
                    last,
                    last_time if last_time >= 0 else None,
                    reason,
                    agg.ejected.get((ip, port)),
                )
            )
        return out

    def _endpoints_changed(self, agg: _Aggregate, membership: bool = False) -> None:
        """An aggregate's HEALTHY endpoints (with ``membership``, its set of
        endpoints too) changed: drop the cached tuples, and move the
        generation on for the readers that derive from them."""
        agg.healthy_cache = None
        if membership:
            agg.all_cache = None
            self.membership += 1
        self.generation += 1

    def healthy_endpoints(self, backend_service: ResourcePath) -> tuple[EndpointKey, ...]:
        """The HEALTHY endpoints of a backend service that are not ejected
        from real traffic (all the HEALTHY ones when every one is), cached
        until one flips: the data plane reads this per connection. With no
        HEALTHY endpoint left, the DEGRADED ones (SPEC §9: a producer uses
        degraded endpoints only then)."""
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        if agg is None:
            return ()
        cached = agg.healthy_cache
        if cached is None:
            state = self._state
            cached = tuple(k for k, slot in agg.slots.items() if state[slot] == HEALTHY)
            if not cached and agg.degraded:
                cached = tuple(k for k, slot in agg.slots.items() if state[slot] == DEGRADED)
            ejected = agg.ejected
            if ejected:
                serving = tuple(k for k in cached if k not in ejected)
                cached = serving or cached
            agg.healthy_cache = cached
        return cached

    def all_endpoints(self, backend_service: ResourcePath) -> tuple[EndpointKey, ...]:
        """Every endpoint of a backend service, cached until one is added or
        removed (the data plane's fail-open choice reads it per connection)."""
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        if agg is None:
            return ()
        cached = agg.all_cache
        if cached is None:
            cached = agg.all_cache = tuple(agg.slots)
        return cached

    def counts(self, backend_service: ResourcePath) -> Counts | None:
        """(total, healthy, unknown, degraded) of one backend service (an
        ejected endpoint is neither healthy nor degraded here when its
        ejections count as UNHEALTHY)."""
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        if agg is None:
            return None
        healthy, degraded = agg.healthy, agg.degraded
        if agg.count_ejected and agg.ejected:
            state, slots = self._state, agg.slots
            healthy -= sum(1 for k in agg.ejected if state[slots[k]] == HEALTHY)
            degraded -= sum(1 for k in agg.ejected if state[slots[k]] == DEGRADED)
        return Counts(agg.total, healthy, agg.unknown, degraded)

    def backend_services(self) -> list[ResourcePath]:
        return list(self._agg_ids)
