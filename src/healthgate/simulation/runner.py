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
from healthgate.health.states import Outcome, ProbeResult, Record
from healthgate.model.names import ResourcePath
from healthgate.model.resources import InstanceGroup, NetworkEndpointGroup, Resource
from healthgate.probes.timetable import Timetable
from healthgate.simulation.scenario import Scenario, ScenarioEvent, Selector

_EVENT, _END, _START = 0, 1, 2  # at equal times: faults first, then probe ends, then starts


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


def simulate(resources: Sequence[Resource], scenario: Scenario) -> SimulationResult:
    result = SimulationResult()
    engine = result.engine
    result.records.extend(engine.apply(resources, 0.0).records)
    targets = sorted(engine.targets(), key=lambda t: t.slot)

    if scenario.start == "healthy":
        ok = ProbeResult(Outcome.OK, scenario.response_time)
        for t in targets:
            for _ in range(t.check.healthy_threshold):
                engine.on_result(0.0, t.slot, ok)
        # the settled state is the starting point, not part of the timeline
        result.records = []

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
    heapq.heapify(queue)

    faults: dict[int, ScenarioEvent] = {}
    end = scenario.duration
    while queue:
        now, kind, _, slot, payload = heapq.heappop(queue)
        if now > end:
            break
        # ramped failbacks move on in the same virtual time
        step = engine.next_ramp_step(clock[0])
        while step is not None and step <= now:
            result.records.extend(engine.step_ramps(step))
            step = engine.next_ramp_step(step)
        clock[0] = now
        if kind == _EVENT:
            assert isinstance(payload, ScenarioEvent)
            for t in select(targets, resources, payload.select):
                if payload.fault == "heal":
                    faults.pop(t.slot, None)
                else:
                    faults[t.slot] = payload
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
