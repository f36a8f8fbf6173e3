"""The data plane's counts to the engine, once a second (SPEC §8).

Every second the sampler takes what each listener's hops to each upstream
came to since the last second - the listeners of this process, or what
the data-plane workers reported (dataplane/counters.py, workers.py) - and
hands them on:

* per listener, to the ramped failbacks' error gate (controlplane/ramp_gate.py);
* per upstream address, all listeners together, to the engine
  (``observe_traffic``: outlier detection and TRAFFIC health sources,
  health/passive.py), whose records are emitted as any other's; the
  upstreams it ejected have their runs restarted in the data plane;
* in cluster mode, this node's traffic verdicts that flipped, to the
  cluster (``on_verdicts``: cluster/traffic.py writes them as opinions).

The clock is the service's (wall time, as the records'); a sampler that
fails logs it and goes on - it is evidence, never in the way of serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from healthgate.controlplane.health_service import HealthService
from healthgate.controlplane.ramp_gate import RampGate
from healthgate.dataplane.manager import DataPlaneService
from healthgate.health.evidence import Address, Hops, merge
from healthgate.health.traffic import Verdict

log = logging.getLogger("healthgate.health")

VerdictListener = Callable[[dict[str, Verdict]], None]


class EvidenceSampler:
    def __init__(self, health: HealthService, dataplane: DataPlaneService) -> None:
        self.health = health
        self.dataplane = dataplane
        self.gate = RampGate(health)
        self.on_verdicts: VerdictListener | None = None
        # told each second's hops per listener too (practice runs' FRONTEND_ERRORS checks)
        self.listeners: list[Callable[[float, Mapping[str, Mapping[Address, Hops]]], None]] = []
        self.seconds = 0
        self._soon: asyncio.Handle | None = None
        # a run of errors that reached an outlier threshold: the evidence now
        dataplane.on_trip(self.soon)

    def soon(self) -> None:
        """Take the evidence at the end of this event-loop turn (a burst of
        trips: once)."""
        if self._soon is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._soon = loop.call_soon(self._early)

    def _early(self) -> None:
        self._soon = None
        try:
            self.step()
        except Exception:
            log.exception("the traffic evidence sampler failed")

    async def run(self, period: float = 1.0) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + period
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at += period
            if next_at < loop.time():  # (a stall: no catching up with a burst of seconds)
                next_at = loop.time() + period
            try:
                self.step()
            except Exception:
                log.exception("the traffic evidence sampler failed; trying again in %g s", period)

    def step(self) -> None:
        """What the listeners carried since the last step (once a second, and
        at once when an outlier threshold is reached; tests call it)."""
        self.seconds += 1
        now = self.health.clock()
        per_listener = self.dataplane.take_hops()
        self.gate.observe(now, per_listener)
        for listener in self.listeners:
            listener(now, per_listener)
        engine = self.health.engine
        result = engine.observe_traffic(now, merge(per_listener.values()))
        if result.ejected:
            self.dataplane.reset_runs(result.ejected)
        self.health.emit(result.records)
        if result.verdicts and self.on_verdicts is not None:
            self.on_verdicts(result.verdicts)
