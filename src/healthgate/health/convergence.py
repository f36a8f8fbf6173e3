"""Convergence receipts (SPEC §11): how far each route decision has
travelled - pure: fed the decisions, what each data plane says it applied,
and ``now``.

A **decision** is a consumer front end's route change (a Route record): it
carries a *generation* (the engine's count of route decisions) and its
time. Each data plane says when it has applied it, in its own way:

* ``healthgate`` - the front end's own listeners: in this process at once
  (they read the route table per connection), in each worker process when
  it has taken the health snapshot holding the decision
  (:meth:`ConvergenceTracker.holds`);
* ``envoy`` - each Envoy (its node id), when it ACKs the xDS version that
  first carried the decision (:meth:`~ConvergenceTracker.holds`);
* ``haproxy`` - each HAProxy (its address, or the name its ``agent-send``
  adds), when the agent has answered it, after the decision, for every NEG
  of the front end it asks about (:meth:`~ConvergenceTracker.answered`):
  HAProxy checks each server apart, so it routes on the new state once it
  has asked about each;
* ``dns`` - the DNS server, with its first answer for the front end's
  ``dnsName`` after the decision (:meth:`~ConvergenceTracker.served`).

Who is **expected** to apply a decision: every data-plane instance seen
serving the front end within ``expect_within`` seconds before it (one that
answered, asked or acknowledged for it) - so an Envoy or an HAProxy killed
just before a decision is still expected, and one gone for longer is not.
An expected instance that has not applied a decision ``alert_after``
seconds after it is **LAGGING** (a record, once per decision and instance);
one that applies it later is **CAUGHT_UP** (a record too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from healthgate.health.states import ConvergencePhase, ConvergenceRecord, timestamp

# the histogram of appliedAfter, seconds (healthgate_convergence_seconds)
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DATA_PLANES = ("healthgate", "envoy", "haproxy", "dns")
MAX_INSTANCES = 1000  # instances remembered per front end (and HAProxies in all)

Instance = tuple[str, str]  # (data plane, instance)


@dataclass(frozen=True, slots=True)
class Decision:
    frontend: str
    project: str
    generation: int
    time: float
    negs: frozenset[str]  # every PSC NEG of the front end (what HAProxy asks about)
    summary: str  # "shop-us -> shop-eu" (for the records' reasons)


@dataclass(slots=True)
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(BUCKETS) if seconds <= b), len(BUCKETS))
        self.counts[i] += 1
        self.total += seconds


@dataclass(slots=True)
class ConvergenceTracker:
    alert_after: float = 30.0
    expect_within: float = 120.0
    node: str = ""  # (cluster mode: this node's name, on every receipt)
    decisions: dict[str, Decision] = field(default_factory=dict)
    # the current decision's receipts: front end -> instance -> when applied
    applied: dict[str, dict[Instance, float]] = field(default_factory=dict)
    # who served a front end lately: front end -> instance -> last seen
    seen: dict[str, dict[Instance, float]] = field(default_factory=dict)
    # HAProxy: instance -> NEG -> when last answered
    asked: dict[str, dict[str, float]] = field(default_factory=dict)
    # the instances found lagging on the current decision of each front end
    lagging: dict[str, set[Instance]] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(
        default_factory=lambda: {d: Histogram() for d in DATA_PLANES}
    )
    records: list[ConvergenceRecord] = field(default_factory=list)  # CAUGHT_UP, to be taken

    # ------------------------------------------------------------------ inputs

    def decided(self, decision: Decision) -> None:
        """A new route decision: the receipts start again."""
        self.decisions[decision.frontend] = decision
        self.applied[decision.frontend] = {}
        self.lagging.pop(decision.frontend, None)

    def forget(self, frontends: Iterable[str]) -> None:
        """Front ends that are gone."""
        for f in frontends:
            self.decisions.pop(f, None)
            self.applied.pop(f, None)
            self.seen.pop(f, None)
            self.lagging.pop(f, None)

    def holds(
        self, data_plane: str, instance: str, generations: Mapping[str, int], now: float
    ) -> None:
        """``instance`` now routes by these front ends' routes, each of the
        generation given (an xDS version ACKed, a worker's snapshot taken)."""
        who = (data_plane, instance)
        for frontend, generation in generations.items():
            self._seen(frontend, who, now)
            decision = self.decisions.get(frontend)
            if decision is not None and generation >= decision.generation:
                self._applied(decision, who, now)

    def served(self, data_plane: str, instance: str, frontend: str, now: float) -> None:
        """``instance`` answered for ``frontend`` now, by its current route
        (the DNS server; this process's listeners)."""
        who = (data_plane, instance)
        self._seen(frontend, who, now)
        decision = self.decisions.get(frontend)
        if decision is not None and now >= decision.time:
            self._applied(decision, who, now)

    def answered(self, instance: str, neg: str, now: float) -> None:
        """HAProxy ``instance`` was told the state of ``neg`` now."""
        if instance not in self.asked and len(self.asked) >= MAX_INSTANCES:
            return  # (names come from agent-send: bounded; check() makes room)
        asked = self.asked.setdefault(instance, {})
        asked[neg] = now
        who = ("haproxy", instance)
        for frontend, decision in self.decisions.items():
            if neg not in decision.negs:
                continue
            self._seen(frontend, who, now)
            if who in self.applied.get(frontend, {}):
                continue
            # applied once every NEG of the front end it asks about was answered since
            theirs = [asked[n] for n in decision.negs if n in asked]
            if theirs and min(theirs) >= decision.time:
                self._applied(decision, who, now)

    def _seen(self, frontend: str, who: Instance, now: float) -> None:
        seen = self.seen.setdefault(frontend, {})
        if who in seen or len(seen) < MAX_INSTANCES:
            seen[who] = now

    def _applied(self, decision: Decision, who: Instance, now: float) -> None:
        receipts = self.applied.setdefault(decision.frontend, {})
        if who in receipts:
            return
        receipts[who] = now
        after = max(0.0, now - decision.time)
        self.histograms.setdefault(who[0], Histogram()).observe(after)
        late = self.lagging.get(decision.frontend)
        if late is not None and who in late:
            late.discard(who)
            self.records.append(
                self._record(decision, who, ConvergencePhase.CAUGHT_UP, now,
                             f"{who[0]} {who[1]} applied the decision of "
                             f"{timestamp(decision.time)} ({decision.summary}) after {after:.1f} s")
            )  # fmt: skip

    # ------------------------------------------------------------------ reading

    def expected(self, frontend: str) -> list[Instance]:
        """The instances expected to apply the front end's current decision."""
        decision = self.decisions.get(frontend)
        if decision is None:
            return []
        since = decision.time - self.expect_within
        out = {w for w, t in self.seen.get(frontend, {}).items() if t >= since}
        for instance, negs in self.asked.items():  # (HAProxy: by the NEGs it asks about)
            if any(t >= since for n, t in negs.items() if n in decision.negs):
                out.add(("haproxy", instance))
        return sorted(out)

    def last_seen(self, frontend: str, who: Instance) -> float:
        seen = self.seen.get(frontend, {}).get(who, 0.0)
        decision = self.decisions.get(frontend)
        if who[0] == "haproxy" and decision is not None:
            asked = self.asked.get(who[1], {})
            seen = max([seen, *(t for n, t in asked.items() if n in decision.negs)])
        return seen

    def status(self, frontend: str, now: float) -> dict[str, Any] | None:
        """The current decision and its receipts: applied ones first (by
        how long they took), then who has not applied it yet."""
        decision = self.decisions.get(frontend)
        if decision is None:
            return None
        receipts = self.applied.get(frontend, {})
        node = {"node": self.node} if self.node else {}
        done = [
            {"dataPlane": dp, "instance": inst, **node,
             "appliedAfterMs": round(1000 * max(0.0, t - decision.time), 3)}
            for (dp, inst), t in receipts.items()
        ]  # fmt: skip
        done.sort(key=lambda r: (r["appliedAfterMs"], r["dataPlane"], r["instance"]))
        waiting = [
            {"dataPlane": dp, "instance": inst, **node, "appliedAfterMs": None,
             "waitingMs": round(1000 * max(0.0, now - decision.time)),
             "lastSeen": timestamp(self.last_seen(frontend, (dp, inst)))}
            for dp, inst in self.expected(frontend)
            if (dp, inst) not in receipts
        ]  # fmt: skip
        return {
            "generation": decision.generation,
            "decidedAt": timestamp(decision.time),
            "decision": decision.summary,
            "receipts": done + waiting,
        }

    def check(self, now: float) -> list[ConvergenceRecord]:
        """LAGGING for every expected instance that has not applied its
        front end's decision ``alert_after`` seconds after it (once each);
        and the CAUGHT_UP records since the last call."""
        out, self.records = self.records, []
        self._prune(now)
        for frontend, decision in self.decisions.items():
            if now - decision.time < self.alert_after:
                continue
            receipts = self.applied.get(frontend, {})
            late = self.lagging.setdefault(frontend, set())
            for who in self.expected(frontend):
                if who in receipts or who in late:
                    continue
                late.add(who)
                last = self.last_seen(frontend, who)
                out.append(
                    self._record(decision, who, ConvergencePhase.LAGGING, now,
                                 f"{who[0]} {who[1]} has not applied the decision of "
                                 f"{timestamp(decision.time)} ({decision.summary}) after "
                                 f"{now - decision.time:.0f} s (last seen {timestamp(last)})")
                )  # fmt: skip
        return out

    def _prune(self, now: float) -> None:
        """Who has not been seen for twice ``expect_within`` is forgotten."""
        horizon = now - 2 * self.expect_within
        for seen in self.seen.values():
            for who in [w for w, t in seen.items() if t < horizon]:
                del seen[who]
        for instance in [i for i, negs in self.asked.items() if max(negs.values()) < horizon]:
            del self.asked[instance]

    def lagging_now(self) -> dict[str, int]:
        """Instances lagging now, per data plane (the metric's gauge)."""
        out = dict.fromkeys(DATA_PLANES, 0)
        for late in self.lagging.values():
            for dp, _ in late:
                out[dp] = out.get(dp, 0) + 1
        return out

    def _record(
        self, decision: Decision, who: Instance, phase: ConvergencePhase, now: float, reason: str
    ) -> ConvergenceRecord:
        return ConvergenceRecord(
            time=now,
            project=decision.project,
            frontend=decision.frontend,
            phase=phase,
            data_plane=who[0],
            instance=who[1],
            generation=decision.generation,
            decided=decision.time,
            reason=reason,
            node=self.node,
        )
