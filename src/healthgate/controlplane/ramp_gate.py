"""The error gate of ramped failbacks (SPEC §6, ``failbackMaxErrorPercent``).

While a NEG's ramp runs, the data plane's own counters say how its real
traffic fares: every listener counts, per upstream address, what it served
(``served_by``) and the tries that failed (``failed_by``: no connection, a
reset, a timeout, an answer that is retried - dataplane/tcp.py). Once a
second, for each front end whose backend service sets
``failbackMaxErrorPercent`` and has a ramp running, the gate compares the
counters of the NEG's addresses (its service attachment's producer rule,
and that rule's endpoints, which a front end that serves the rule itself
connects to) with those of 10 s before: more than that percentage failed, out of at
least 20, and the engine abandons the ramp (health/graph.py
``abandon_ramp``: the NEG takes nothing, its ramp starts again from 0 a
success window later; the record has the figures).

The counters are the listeners' in this process or summed over the
data-plane workers (the same numbers ``/metrics`` shows). In a cluster each
node gates its own data plane's traffic: a node whose front end sees the
failures abandons its ramp, and its record is its own (``local``).

Cost: nothing while no gated ramp runs; then one pass over the gated front
ends' counters a second.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping

from healthgate.controlplane.health_service import HealthService
from healthgate.dataplane.tcp import failed_key, served_key
from healthgate.health.states import ERROR_MINIMUM, ERROR_WINDOW
from healthgate.model.lookups import published_rule

log = logging.getLogger("healthgate.health")

Counters = dict[str, tuple[int, int]]  # "frontend|neg" -> (served, failed), cumulative
ListenerStats = Callable[[], Mapping[str, Mapping[str, int]]]


class RampGate:
    def __init__(self, health: HealthService, listener_stats: ListenerStats) -> None:
        self.health = health
        self.listener_stats = listener_stats
        self._history: deque[tuple[float, Counters]] = deque()

    async def run(self, period: float = 1.0) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                self.check()
            except Exception:  # (the gate must never stop: it is only a guard)
                log.exception("the ramps' error gate failed; trying again in %g s", period)

    def check(self) -> None:
        engine = self.health.engine
        now = self.health.clock()
        gated = engine.gated_ramps(now)
        if not gated:
            self._history.clear()
            return
        stats = self.listener_stats()
        counters: Counters = {}
        for frontend, (_, negs) in gated.items():
            listener = stats.get(frontend) or {}
            for neg in negs:
                served = failed = 0
                for address in self._addresses(neg):
                    served += listener.get(served_key(address), 0)
                    failed += listener.get(failed_key(address), 0)
                counters[f"{frontend}|{neg}"] = (served, failed)
        self._history.append((now, counters))
        while self._history[0][0] < now - ERROR_WINDOW:
            self._history.popleft()
        for frontend, (limit, negs) in gated.items():
            for neg in negs:
                key = f"{frontend}|{neg}"
                # the baseline: its oldest count within the window
                base = next((c[key] for _, c in self._history if key in c), None)
                if key not in counters or base is None:
                    continue
                served = counters[key][0] - base[0]
                failed = counters[key][1] - base[1]
                total = served + failed
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
        """Where a front end's traffic to a PSC NEG goes: its producer rule's
        address, or - when this data plane serves that rule itself - the
        rule's endpoints."""
        engine = self.health.engine
        found = published_rule(engine.resources, engine.attachment_of(neg) or "")
        if found is None:
            return set()
        fr = found[1]
        port = fr.port_list()[0]
        out = {(fr.ip_address, port)}
        bs = fr.ref("backend_service")
        if bs is not None:
            out |= {(ip, p or port) for ip, p in engine.all_endpoints(bs)}
        return out

    def _forget(self, key: str) -> None:
        """An abandoned ramp's counts are spent: its next ramp starts afresh."""
        for _, counters in self._history:
            counters.pop(key, None)
