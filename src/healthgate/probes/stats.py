"""What probing has done, in numbers: durations by outcome, running totals,
and the rate at which probe failures are logged.

* :class:`ProbeStats` - a probe-duration histogram by outcome (one list
  increment per probe, counted by the scheduler as each ends).
* :class:`ProbeTotals` - every counter the metrics show of probing, as one
  value: this process's own (``ProbeScheduler.totals``) or a probe worker's,
  sent to its owner every second and added up there with those of workers
  that died (:meth:`ProbeTotals.add`).
* :class:`FailureLogLimiter` - probe failures logged at most ``rate`` a
  second, the rest counted.

Pure bookkeeping, no I/O: shared by the scheduler's owner in the serving
process, the probe workers and cluster nodes.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from healthgate.health.states import Outcome

log = logging.getLogger("healthgate.health")

PROBE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class ProbeStats:
    """A probe-duration histogram by outcome: one list increment per probe."""

    def __init__(self) -> None:
        self.buckets: dict[Outcome, list[int]] = {}
        self.sums: dict[Outcome, float] = {}

    def count(self, outcome: Outcome, latency: float) -> None:
        """One result (the scheduler counts each as it ends)."""
        counts = self.buckets.get(outcome)
        if counts is None:
            counts = self.buckets[outcome] = [0] * (len(PROBE_BUCKETS) + 1)
            self.sums[outcome] = 0.0
        counts[bisect.bisect_left(PROBE_BUCKETS, latency)] += 1
        self.sums[outcome] += latency

    def add(self, outcome: Outcome, counts: Sequence[int], total: float) -> None:
        """Results counted elsewhere (the lane's, probes/lane.py):
        how many per bucket of PROBE_BUCKETS (+Inf last), and their sum."""
        mine = self.buckets.get(outcome)
        if mine is None:
            mine = self.buckets[outcome] = [0] * (len(PROBE_BUCKETS) + 1)
            self.sums[outcome] = 0.0
        _add_counts(mine, list(counts))
        self.sums[outcome] += total


def _add_counts(mine: list[int], theirs: list[int]) -> None:
    for i, n in enumerate(theirs):
        mine[i] += n


@dataclass(slots=True)
class ProbeTotals:
    """Running totals of one prober (or of several, added up)."""

    started: int = 0
    late: int = 0  # started more than late_threshold after due
    skipped: int = 0  # could not start at all (no file descriptor): counted as no result
    finished: int = 0
    suspect: int = 0  # timeouts discarded because the prober lagged
    deferred_ticks: int = 0
    in_flight: int = 0
    tls_handshakes: int = 0
    tls_resumed: int = 0
    buckets: dict[Outcome, list[int]] = field(default_factory=dict)  # probe durations
    sums: dict[Outcome, float] = field(default_factory=dict)
    lag_buckets: list[int] = field(default_factory=lambda: [0] * (len(LAG_BUCKETS) + 1))
    lag_sum: float = 0.0

    def add(self, other: ProbeTotals) -> None:
        self.started += other.started
        self.late += other.late
        self.skipped += other.skipped
        self.finished += other.finished
        self.suspect += other.suspect
        self.deferred_ticks += other.deferred_ticks
        self.in_flight += other.in_flight
        self.tls_handshakes += other.tls_handshakes
        self.tls_resumed += other.tls_resumed
        for outcome, counts in other.buckets.items():
            _add_counts(self.buckets.setdefault(outcome, [0] * len(counts)), counts)
            self.sums[outcome] = self.sums.get(outcome, 0.0) + other.sums.get(outcome, 0.0)
        _add_counts(self.lag_buckets, other.lag_buckets)
        self.lag_sum += other.lag_sum


class FailureLogLimiter:
    """Log probe failures at most ``rate`` per second (0: never), so a dead
    region does not flood the log; the count of suppressed lines is reported."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.clock = clock
        self.tokens = rate
        self.last = clock()
        self.suppressed = 0

    def allow(self) -> bool:
        if self.rate <= 0:
            return False
        now = self.clock()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        self.suppressed += 1
        return False

    def failed(self, path: str, description: str) -> None:
        """A probe of this endpoint failed: a log line, if the rate allows."""
        if self.allow():
            log.info(
                "probe failed: %s: %s (%d similar lines suppressed so far)",
                path,
                description,
                self.suppressed,
            )
