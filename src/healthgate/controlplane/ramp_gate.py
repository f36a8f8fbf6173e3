"""The error gate of ramped failbacks (SPEC §6, ``failbackMaxErrorPercent``).

While a NEG's ramp runs, the data plane's own counters say how its real
traffic fares: every listener counts, per upstream address, its hops'
successes and errors (dataplane/counters.py; what an error is:
health/evidence.py). Once a second the evidence sampler
(controlplane/evidence.py) hands the gate what each listener's hops came
to; for each front end whose backend service sets
``failbackMaxErrorPercent`` and has a ramp running, the gate sums the hops
to the NEG's addresses (its service attachment's producer rule, and that
rule's endpoints, which a front end that serves the rule itself connects
to) over the last 10 s: more than that percentage failed, out of at least
20, and the engine abandons the ramp (health/graph.py ``abandon_ramp``: the
NEG takes nothing, its ramp starts again from 0 a success window later; the
record has the figures).

The hops are the listeners' in this process or the data-plane workers'
(the same numbers ``/metrics`` shows). In a cluster each node gates its own
data plane's traffic: a node whose front end sees the failures abandons its
ramp, and its record is its own (``local``).

Cost: nothing while no gated ramp runs; then one pass over the gated front
ends' hops a second.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping

from healthgate.controlplane.health_service import HealthService
from healthgate.controlplane.traffic_history import upstreams
from healthgate.health.evidence import Address, Hops
from healthgate.health.states import ERROR_MINIMUM, ERROR_WINDOW

log = logging.getLogger("healthgate.health")

Seconds = dict[str, tuple[int, int]]  # "frontend|neg" -> (hops, errors) in one second


class RampGate:
    def __init__(self, health: HealthService) -> None:
        self.health = health
        self._history: deque[tuple[float, Seconds]] = deque()

    def observe(self, now: float, hops: Mapping[str, Mapping[Address, Hops]]) -> None:
        """One second of every listener's hops (controlplane/evidence.py)."""
        engine = self.health.engine
        gated = engine.gated_ramps(now)
        if not gated:
            self._history.clear()
            return
        second: Seconds = {}
        for frontend, (_, negs) in gated.items():
            listener = hops.get(frontend) or {}
            for neg in negs:
                total = errors = 0
                if listener:
                    for address in self._addresses(neg):
                        h = listener.get(address)
                        if h is not None:
                            total += h.total
                            errors += h.errors
                second[f"{frontend}|{neg}"] = (total, errors)
        self._history.append((now, second))
        while self._history and self._history[0][0] <= now - ERROR_WINDOW:
            self._history.popleft()
        for frontend, (limit, negs) in gated.items():
            for neg in negs:
                key = f"{frontend}|{neg}"
                total = sum(s[key][0] for _, s in self._history if key in s)
                failed = sum(s[key][1] for _, s in self._history if key in s)
                if total >= ERROR_MINIMUM and 100 * failed > limit * total:
                    records = engine.abandon_ramp(now, frontend, neg, total, failed)
                    if records:
                        log.warning(
                            "%s: ramp of %s abandoned: %d of %d failed",
                            frontend,
                            neg,
                            failed,
                            total,
                        )
                        self.health.emit(records)
                        self._forget(key)

    def _addresses(self, neg: str) -> set[tuple[str, int]]:
        """Where a front end's traffic to a PSC NEG goes (controlplane/traffic_history.py)."""
        engine = self.health.engine
        return upstreams(engine, engine.attachment_of(neg) or "")

    def _forget(self, key: str) -> None:
        """An abandoned ramp's counts are spent: its next ramp starts afresh."""
        for _, counters in self._history:
            counters.pop(key, None)
