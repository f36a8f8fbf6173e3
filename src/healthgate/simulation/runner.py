"""Virtual-time probing: the scheduler's timing rules without sockets.

Each endpoint is probed as the real scheduler does (SPEC §2.1): the first
probes are spread evenly over the first interval, a probe lasts its response
time (or the timeout, or ~0 for a refused connection), and the next one
starts ``checkIntervalSec`` after the previous one *ended*. Results go into
the same :class:`HealthEngine` that ``serve`` uses, so the timeline printed is
what the real system would log, to the probe.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from healthgate.health.engine import HealthEngine, ProbeTarget
from healthgate.health.evidence import Address, Hops
from healthgate.health.states import Outcome, ProbeResult, Record
from healthgate.health.storms import StormSettings
from healthgate.model.lookups import published_rule
from healthgate.model.names import ResourcePath
from healthgate.model.resources import InstanceGroup, NetworkEndpointGroup, Resource
from healthgate.probes.timetable import Timetable
from healthgate.simulation.scenario import Scenario, ScenarioEvent, Selector

# at equal times: faults first, then probe ends, then starts, then a second of traffic
_EVENT, _END, _START, _TRAFFIC = 0, 1, 2, 3


@dataclass(slots=True)
class SimulationResult:
    records: list[Record] = field(default_factory=list)
    probes: int = 0
    engine: HealthEngine = field(default_factory=HealthEngine)


def _group_ips(resources: Sequence[Resource], sel: Selector) -> set[str] | None:
    if sel.group is None:
        return None
    ips: set[str] = set()
    for r in resources:
        if r.name != sel.group or (sel.project and r.project != sel.project):
            continue
        if sel.region and r.region != sel.region:
            continue
        if isinstance(r, NetworkEndpointGroup):
            ips.update(e.ip_address for e in r.endpoints)
        elif isinstance(r, InstanceGroup):
            ips.update(i.ip_address for i in r.instances)
    return ips


def select(
    targets: Sequence[ProbeTarget], resources: Sequence[Resource], sel: Selector
) -> list[ProbeTarget]:
    group_ips = _group_ips(resources, sel)
    out = []
    for t in targets:
        bs: ResourcePath = t.backend_service
        if sel.project and bs.project != sel.project:
            continue
        if sel.region and bs.region != sel.region:
            continue
        if sel.backend_service and bs.name != sel.backend_service:
            continue
        if group_ips is not None and t.ip not in group_ips:
            continue
        if sel.endpoint:
            ip, _, port = sel.endpoint.partition(":")
            if t.ip != ip or (port and str(t.port) != port):
                continue
        out.append(t)
    out.sort(key=lambda t: (t.ip, t.port or 0, str(t.backend_service)))
    return out[: sel.count] if sel.count else out


def _outcome(target: ProbeTarget, event: ScenarioEvent | None, response: float) -> ProbeResult:
    check = target.check
    timeout = float(check.timeout_sec)
    http = check.type in ("HTTP", "HTTPS")
    if event is None or event.fault == "heal":
        latency = response
    elif event.fault == "hang":
        return ProbeResult(Outcome.TIMEOUT, timeout)
    elif event.fault == "refuse":
        return ProbeResult(Outcome.REFUSED, 0.0)
    elif event.fault == "reset":
        return ProbeResult(Outcome.RESET, response)
    elif event.status is not None:
        if not http:
            latency = response  # a TCP or gRPC check never sees an HTTP status
        elif any(lo <= event.status <= hi for lo, hi in check.degraded_ranges()):
            return ProbeResult(Outcome.DEGRADED, response, event.status)  # (SPEC §9)
        elif any(lo <= event.status <= hi for lo, hi in check.status_ranges()):
            return ProbeResult(Outcome.OK, response, event.status)
        else:
            return ProbeResult(Outcome.STATUS, response, event.status, "not in expectedStatusCodes")
    else:
        assert event.latency is not None
        latency = event.latency
    if latency >= timeout:
        return ProbeResult(Outcome.TIMEOUT, timeout)
    return ProbeResult(Outcome.OK, latency, 200 if http else 0)


class _Traffic:
    """A second of real traffic where the routes send it (see the scenario
    format): per upstream address, what its hops came to."""

    def __init__(self, engine: HealthEngine, scenario: Scenario) -> None:
        self.engine = engine
        self.rate = scenario.traffic.requests_per_second
        self.errors: dict[tuple[str, int | None], ScenarioEvent] = {}  # endpoint -> its
        self.runs: dict[Address, int] = {}  # consecutive errors carried between seconds

    def second(self) -> dict[Address, Hops]:
        engine = self.engine
        per_endpoint: dict[Address, float] = {}
        keys: dict[Address, tuple[str, int | None]] = {}
        for route in engine.route_table().routes.values():
            for share in route.shares:
                found = published_rule(engine.resources, engine.attachment_of(share.neg) or "")
                if found is None:
                    continue
                fr = found[1]
                bs = fr.ref("backend_service")
                if bs is None:
                    continue
                port = fr.port_list()[0]
                serving = engine.healthy_endpoints(bs) or engine.all_endpoints(bs)
                for ip, p in serving:
                    address = (ip, p if p is not None else port)
                    keys[address] = (ip, p)
                    n = self.rate * share.percent / 100 / len(serving)
                    per_endpoint[address] = per_endpoint.get(address, 0.0) + n
        out = {}
        for address, n in per_endpoint.items():
            total = round(n)
            if not total:
                continue
            event = self.errors.get(keys[address])
            errors = round(total * event.error_rate) if event and event.error_rate else 0
            served = total - errors
            run = self.runs.get(address, 0)
            # errors spread among the successes: the longest run between two
            peak = run + errors if not served else max(run, -(-errors // (served + 1)))
            self.runs[address] = run + errors if not served else errors // (served + 1)
            kind = event.error_kind if event else "500"
            gateway = errors if kind in ("502", "503", "504", "refused", "connect-timeout") else 0
            kinds = {kind: errors} if errors else {}
            out[address] = Hops(served, errors, gateway, kinds, peak, peak if gateway else 0,
                                (kind,) * min(peak, 10))  # fmt: skip
        return out


def _event(
    event: ScenarioEvent,
    targets: Sequence[ProbeTarget],
    faults: dict[int, ScenarioEvent],
    traffic: _Traffic,
) -> None:
    """A scenario event on the endpoints it selects: a fault of their probes,
    an error rate of their real traffic, or both healed."""
    for t in targets:
        if event.fault == "heal":
            faults.pop(t.slot, None)
            traffic.errors.pop((t.ip, t.port), None)
        elif event.error_rate is not None:
            traffic.errors[(t.ip, t.port)] = event
        else:
            faults[t.slot] = event


def _ramps_until(engine: HealthEngine, then: float, now: float, records: list[Record]) -> None:
    """Ramped failbacks move on in the same virtual time."""
    step = engine.next_ramp_step(then)
    while step is not None and step <= now:
        records.extend(engine.step_ramps(step))
        step = engine.next_ramp_step(step)


def _settle(engine: HealthEngine, targets: Sequence[ProbeTarget], response: float) -> None:
    """Every endpoint HEALTHY: enough successes for its threshold."""
    ok = ProbeResult(Outcome.OK, response)
    for t in targets:
        for _ in range(t.check.healthy_threshold):
            engine.on_result(0.0, t.slot, ok)


def simulate(resources: Sequence[Resource], scenario: Scenario) -> SimulationResult:
    result = SimulationResult()
    engine = result.engine
    engine.set_storm_settings(
        StormSettings(scenario.storm_hold_percent, scenario.storm_hold_window_sec)
    )
    result.records.extend(engine.apply(resources, 0.0).records)
    targets = sorted(engine.targets(), key=lambda t: t.slot)
    if scenario.start == "healthy":
        _settle(engine, targets, scenario.response_time)
        result.records = []  # (the settled state is the starting point, not the timeline's)

    queue: list[tuple[float, int, int, int, object]] = []
    seq = 0
    for i, ev in enumerate(scenario.events):
        queue.append((ev.at, _EVENT, seq, i, ev))
        seq += 1
    n = len(targets)
    clock = [0.0]
    evenly = iter([i / n for i in range(n)])  # the first probes spread evenly
    timetable = Timetable(lambda: clock[0], lambda: next(evenly, 0.0))
    for t in targets:
        due = timetable.first(t.check.check_interval_sec)
        queue.append((due, _START, seq, t.slot, t))
        seq += 1
    traffic = _Traffic(engine, scenario)
    if traffic.rate or engine.passive.watching(0.0):
        for second in range(1, int(scenario.duration) + 1):
            queue.append((float(second), _TRAFFIC, seq, 0, None))
            seq += 1
    heapq.heapify(queue)

    faults: dict[int, ScenarioEvent] = {}
    end = scenario.duration
    while queue:
        now, kind, _, slot, payload = heapq.heappop(queue)
        if now > end:
            break
        _ramps_until(engine, clock[0], now, result.records)
        clock[0] = now
        if kind == _TRAFFIC:
            seen = engine.observe_traffic(now, traffic.second())
            result.records.extend(seen.records)
            for address in seen.ejected:  # (as the data plane does: its runs start again)
                traffic.runs.pop(address, None)
        elif kind == _EVENT:
            assert isinstance(payload, ScenarioEvent)
            _event(payload, select(targets, resources, payload.select), faults, traffic)
        elif kind == _START:
            assert isinstance(payload, ProbeTarget)
            res = _outcome(payload, faults.get(slot), scenario.response_time)
            heapq.heappush(queue, (now + res.latency, _END, seq, slot, (payload, res)))
            seq += 1
        else:
            assert isinstance(payload, tuple)
            target: ProbeTarget = payload[0]
            res = payload[1]
            result.probes += 1
            result.records.extend(engine.on_result(now, slot, res))
            started = now - res.latency  # (virtual probes start exactly when due)
            nxt = timetable.next(target.check.check_interval_sec, started, started, now)
            heapq.heappush(queue, (nxt, _START, seq, slot, target))
            seq += 1
    return result
