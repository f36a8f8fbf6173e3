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
from healthgate.health.evidence import Address, Hops, merge
from healthgate.health.practice import (
    Action,
    EndShift,
    EngineWorld,
    FrontendErrors,
    PracticeDirector,
    StartShift,
)
from healthgate.health.states import Outcome, ProbeResult, Record
from healthgate.health.storms import StormSettings
from healthgate.model.lookups import published_rule
from healthgate.model.names import ResourcePath
from healthgate.model.practice import PracticeRun
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
    format): per front end and upstream address, what its hops came to."""

    def __init__(self, engine: HealthEngine, scenario: Scenario) -> None:
        self.engine = engine
        self.rate = scenario.traffic.requests_per_second
        self.errors: dict[tuple[str, int | None], ScenarioEvent] = {}  # endpoint -> its
        self.runs: dict[Address, int] = {}  # consecutive errors carried between seconds

    def second(self) -> dict[str, dict[Address, Hops]]:
        engine = self.engine
        per_frontend: dict[str, dict[Address, float]] = {}
        keys: dict[Address, tuple[str, int | None]] = {}
        for frontend, route in engine.route_table().routes.items():
            mine = per_frontend.setdefault(frontend, {})
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
                    mine[address] = mine.get(address, 0.0) + n
        out: dict[str, dict[Address, Hops]] = {}
        for frontend, per_endpoint in per_frontend.items():
            hops = out[frontend] = {}
            for address, n in per_endpoint.items():
                total = round(n)
                if total:
                    hops[address] = self._hops(address, total, self.errors.get(keys[address]))
        return out

    def _hops(self, address: Address, total: int, event: ScenarioEvent | None) -> Hops:
        errors = round(total * event.error_rate) if event and event.error_rate else 0
        served = total - errors
        run = self.runs.get(address, 0)
        # errors spread among the successes: the longest run between two
        peak = run + errors if not served else max(run, -(-errors // (served + 1)))
        self.runs[address] = run + errors if not served else errors // (served + 1)
        kind = event.error_kind if event else "500"
        gateway = errors if kind in ("502", "503", "504", "refused", "connect-timeout") else 0
        kinds = {kind: errors} if errors else {}
        return Hops(served, errors, gateway, kinds, peak, peak if gateway else 0,
                    (kind,) * min(peak, 10))  # fmt: skip


class _Practice:
    """Practice runs as serve runs them (health/practice.py): the director
    over the simulated engine, its shifts made and ended in the world."""

    def __init__(self, engine: HealthEngine, resources: list[Resource], clock: list[float]) -> None:
        self.engine = engine
        self.resources = resources
        self.clock = clock
        self.director = PracticeDirector()
        self.frontends = FrontendErrors()
        self.urls: dict[str, tuple[int, float]] = {}  # URL -> (status, since when)
        self.world = EngineWorld(engine, self.frontends.errors, self._url)

    def runs(self) -> list[PracticeRun]:
        return [r for r in self.resources if isinstance(r, PracticeRun)]

    def _url(self, run: PracticeRun, index: int) -> tuple[int, str]:
        check = run.outcome_checks[index]
        status, since = self.urls.get(check.url or "", (200, 0.0))
        if 200 <= status < 300:
            return 0, f"HTTP {status}"
        # fetched every intervalSec: the failures since it went bad
        return int((self.clock[0] - since) // check.interval) + 1, f"HTTP {status}"

    def tick(self, now: float) -> list[Record]:
        runs = self.runs()
        self.frontends.watched = {str(t) for r in runs for t in r.refs("frontend_refs")}
        return self._act(now, self.director.tick(now, runs, self.world))

    def start(self, now: float, name: str) -> list[Record]:
        run = next((r for r in self.runs() if r.name == name), None)
        if run is None or self.world.practice_shift(run) is not None:
            return []
        return self._act(now, self.director.start(now, run, self.world))

    def _act(self, now: float, actions: list[Action]) -> list[Record]:
        records: list[Record] = []
        for action in actions:
            if isinstance(action, StartShift):
                self.resources.append(action.shift)
                records.extend(self.engine.apply(self.resources, now).records)
            elif isinstance(action, EndShift):
                self.resources[:] = [r for r in self.resources if r.path != action.shift.path]
                records.extend(self.engine.apply(self.resources, now).records)
            else:
                records.append(action)
        return records


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


def _time_until(engine: HealthEngine, then: float, now: float, records: list[Record]) -> None:
    """Ramped failbacks move on, and shifts run out, in the same virtual time."""
    while True:
        ramp = engine.next_ramp_step(then)
        ramp = ramp if ramp is not None and ramp <= now else None
        shift = engine.next_shift_expiry(then)
        shift = shift if shift is not None and shift <= now else None
        if ramp is None and shift is None:
            return
        if shift is not None and (ramp is None or shift <= ramp):
            records.extend(engine.expire_shifts(shift))
            then = shift
        else:
            assert ramp is not None
            records.extend(engine.step_ramps(ramp))
            then = ramp


def _settle(
    engine: HealthEngine, targets: Sequence[ProbeTarget], response: float, now: float
) -> None:
    """Every endpoint HEALTHY: enough successes for its threshold."""
    ok = ProbeResult(Outcome.OK, response)
    for t in targets:
        for _ in range(t.check.healthy_threshold):
            engine.on_result(now, t.slot, ok)


def simulate(resources: Sequence[Resource], scenario: Scenario) -> SimulationResult:
    """The scenario over ``resources``; record times are virtual seconds
    from ``scenario.epoch`` (0 unless the scenario gives ``startTime``)."""
    return _Simulation(resources, scenario).run()


class _Simulation:
    def __init__(self, resources: Sequence[Resource], scenario: Scenario) -> None:
        self.result = result = SimulationResult()
        self.scenario = scenario
        self.resources = resources
        engine = self.engine = result.engine
        t0 = self.t0 = scenario.epoch
        engine.set_storm_settings(
            StormSettings(scenario.storm_hold_percent, scenario.storm_hold_window_sec)
        )
        world = list(resources)  # (practice runs add and remove their shifts)
        result.records.extend(engine.apply(world, t0).records)
        self.targets = targets = sorted(engine.targets(), key=lambda t: t.slot)
        if scenario.start == "healthy":
            _settle(engine, targets, scenario.response_time, t0)
            result.records = []  # (the settled state is the starting point, not the timeline's)
        self.queue: list[tuple[float, int, int, int, object]] = []
        self.seq = 0
        for i, ev in enumerate(scenario.events):
            self.push(t0 + ev.at, _EVENT, i, ev)
        n = len(targets)
        self.clock = [t0]
        evenly = iter([i / n for i in range(n)])  # the first probes spread evenly
        self.timetable = Timetable(lambda: self.clock[0], lambda: next(evenly, 0.0))
        for t in targets:
            self.push(self.timetable.first(t.check.check_interval_sec), _START, t.slot, t)
        self.traffic = _Traffic(engine, scenario)
        self.practice = _Practice(engine, world, self.clock)
        if self.traffic.rate or engine.passive.watching(t0) or self.practice.runs():
            for second in range(1, int(scenario.duration) + 1):
                self.push(t0 + second, _TRAFFIC, 0, None)
        heapq.heapify(self.queue)
        self.faults: dict[int, ScenarioEvent] = {}

    def push(self, at: float, kind: int, slot: int, payload: object) -> None:
        self.queue.append((at, kind, self.seq, slot, payload))
        self.seq += 1

    def run(self) -> SimulationResult:
        end = self.t0 + self.scenario.duration
        records = self.result.records
        while self.queue:
            now, kind, _, slot, payload = heapq.heappop(self.queue)
            if now > end:
                break
            _time_until(self.engine, self.clock[0], now, records)
            self.clock[0] = now
            if kind == _TRAFFIC:
                self.second(now)
            elif kind == _EVENT:
                assert isinstance(payload, ScenarioEvent)
                self.event(now, payload)
            elif kind == _START:
                assert isinstance(payload, ProbeTarget)
                res = _outcome(payload, self.faults.get(slot), self.scenario.response_time)
                heapq.heappush(
                    self.queue, (now + res.latency, _END, self.seq, slot, (payload, res))
                )
                self.seq += 1
            else:
                assert isinstance(payload, tuple)
                self.probed(now, slot, payload[0], payload[1])
        return self.result

    def second(self, now: float) -> None:
        """A second of real traffic, and the practice runs' look at the world."""
        per_frontend = self.traffic.second()
        seen = self.engine.observe_traffic(now, merge(per_frontend.values()))
        self.result.records.extend(seen.records)
        for address in seen.ejected:  # (as the data plane does: its runs start again)
            self.traffic.runs.pop(address, None)
        self.practice.frontends.observe(now, per_frontend)
        self.result.records.extend(self.practice.tick(now))

    def event(self, now: float, event: ScenarioEvent) -> None:
        if event.practice is not None:
            self.result.records.extend(self.practice.start(now, event.practice))
        elif event.url is not None:
            assert event.status is not None
            self.practice.urls[event.url] = (event.status, now)
        else:
            chosen = select(self.targets, self.resources, event.select)
            _event(event, chosen, self.faults, self.traffic)

    def probed(self, now: float, slot: int, target: ProbeTarget, res: ProbeResult) -> None:
        self.result.probes += 1
        self.result.records.extend(self.engine.on_result(now, slot, res))
        started = now - res.latency  # (virtual probes start exactly when due)
        interval = target.check.check_interval_sec
        heapq.heappush(
            self.queue,
            (self.timetable.next(interval, started, started, now), _START, self.seq, slot, target),
        )
        self.seq += 1
