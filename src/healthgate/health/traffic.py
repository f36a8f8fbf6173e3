"""Traffic health sources (SPEC §8): a region judged by its real requests -
pure, in virtual time.

A ``HealthSource`` of ``sourceType: TRAFFIC`` names one producer backend
service. Once a second its judge is given what healthgate's own listeners
carried to that backend service in that second (its endpoints, and its
producer rules' addresses where a consumer front end reaches them from
another process) and keeps a sliding window of ``windowSec`` one-second
buckets. With at least ``minimumRequests`` in the window:

* more than ``errorPercentThreshold`` % failing -> UNHEALTHY ("42 of 310
  requests failed (13.5 %) in 30 s: 500 ×39, reset ×3");
* at or below it -> HEALTHY;

with fewer, the source keeps its state - and after ``holdSec`` of UNHEALTHY
with too little traffic to judge (the traffic has moved away) it turns
HEALTHY again ("no traffic to judge since TIME: trusting probes again"); the
consumer's ramped failback and its error gate (SPEC §6) then protect the
way back. A source starts HEALTHY: until there is traffic to judge, the
probes decide.

:class:`TrafficJudge` is one node's judgement. In embedded mode it is the
source's state; in cluster mode each node's judgement is its opinion, and
:func:`quorum` decides the source from the nodes' opinions (one node whose
own network is broken must not fail a region over alone).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from healthgate.health.evidence import Hops, kinds_text
from healthgate.health.states import HealthState, timestamp
from healthgate.model.resources import TrafficPolicy

HEALTHY = HealthState.HEALTHY
UNHEALTHY = HealthState.UNHEALTHY

FIRST_REASON = "no traffic judged yet: trusting probes"


@dataclass(frozen=True, slots=True)
class Verdict:
    """A judgement of a source: its state, whether the window held enough
    traffic to judge (``judged``), the window's figures and why."""

    state: HealthState
    judged: bool
    requests: int
    errors: int
    reason: str
    since: float  # when this state began


@dataclass(slots=True)
class _Second:
    time: float
    requests: int = 0
    errors: int = 0
    kinds: dict[str, int] = field(default_factory=dict)


class TrafficJudge:
    """One source's judgement on one node (see the module doc)."""

    def __init__(self, policy: TrafficPolicy, now: float) -> None:
        self.policy = policy
        self._window: deque[_Second] = deque()
        self.requests = 0  # in the window
        self.errors = 0
        self.verdict = Verdict(HEALTHY, False, 0, 0, FIRST_REASON, now)
        self._unjudged_since: float | None = now  # too little traffic since (None: enough)

    def observe(self, now: float, hops: Sequence[Hops]) -> Verdict:
        """One second of the backend service's hops; the verdict after it
        (the same object when nothing about it changed)."""
        p = self.policy
        second = _Second(now)
        for h in hops:
            second.requests += h.total
            second.errors += h.errors
            for kind, n in h.kinds.items():
                second.kinds[kind] = second.kinds.get(kind, 0) + n
        window = self._window
        if second.requests:
            window.append(second)
            self.requests += second.requests
            self.errors += second.errors
        while window and window[0].time <= now - p.window_sec:
            old = window.popleft()
            self.requests -= old.requests
            self.errors -= old.errors
        return self._judge(now)

    def _judge(self, now: float) -> Verdict:
        p = self.policy
        v = self.verdict
        requests, errors = self.requests, self.errors
        if requests >= p.minimum_requests:
            self._unjudged_since = None
            failing = 100 * errors > p.error_percent_threshold * requests
            state = UNHEALTHY if failing else HEALTHY
            if state is v.state and v.judged and (state is UNHEALTHY or v.requests == requests):
                return v  # (an UNHEALTHY verdict keeps the figures that made it)
            kinds: dict[str, int] = {}
            for s in self._window:
                for kind, n in s.kinds.items():
                    kinds[kind] = kinds.get(kind, 0) + n
            pct = 100 * errors / requests
            what = f"{errors} of {requests} requests failed ({pct:.1f} %) in {p.window_sec} s"
            if errors:
                what += f": {kinds_text(kinds)}"
            limit = f"errorPercentThreshold {p.error_percent_threshold:g}"
            reason = f"{what} (more than {limit})" if failing else f"{what} (within {limit})"
            since = v.since if state is v.state else now
            self.verdict = Verdict(state, True, requests, errors, reason, since)
            return self.verdict
        # too little traffic to judge: the state stands...
        if self._unjudged_since is None:
            self._unjudged_since = now
        if v.state is UNHEALTHY and now - self._unjudged_since >= p.hold_sec:
            # ... until holdSec of UNHEALTHY without enough of it
            reason = (
                f"no traffic to judge since {timestamp(self._unjudged_since)} "
                f"(fewer than {p.minimum_requests} requests in {p.window_sec} s for "
                f"holdSec {p.hold_sec}): trusting probes again"
            )
            self.verdict = Verdict(HEALTHY, False, requests, errors, reason, now)
        elif v.judged:
            self.verdict = Verdict(v.state, False, requests, errors, v.reason, v.since)
        return self.verdict


def quorum(
    current: HealthState, opinions: Sequence[tuple[str, Verdict]]
) -> tuple[HealthState, str]:
    """A source's state from the nodes' verdicts (cluster mode): of the nodes
    that carried enough traffic to judge, UNHEALTHY when more than half say
    so, else HEALTHY; when none did, the state stands - but turns HEALTHY
    once no node says UNHEALTHY any more (each node's hold has run out)."""
    judges = [(n, v) for n, v in opinions if v.judged]
    bad = [(n, v) for n, v in judges if v.state is UNHEALTHY]
    if judges:
        names = ", ".join(n for n, _ in bad)
        if 2 * len(bad) > len(judges):
            first = bad[0][1]
            return UNHEALTHY, (
                f"{len(bad)} of {len(judges)} nodes carrying enough traffic see it fail "
                f"({names}); {bad[0][0]}: {first.reason}"
            )
        if bad:
            return HEALTHY, (
                f"{len(judges) - len(bad)} of {len(judges)} nodes carrying enough traffic see it "
                f"succeed (failing only on {names}: not a quorum)"
            )
        ok = judges[0]
        return (
            HEALTHY,
            f"{len(judges)} node(s) carrying enough traffic see it succeed; {ok[0]}: {ok[1].reason}",
        )
    if current is UNHEALTHY and any(v.state is UNHEALTHY for _, v in opinions):
        return UNHEALTHY, "no node carries enough traffic to judge: the state stands"
    if current is UNHEALTHY:
        return (
            HEALTHY,
            "no node carries enough traffic to judge, none holds it UNHEALTHY: trusting probes again",
        )
    return current, FIRST_REASON if not opinions else "no node carries enough traffic to judge"
