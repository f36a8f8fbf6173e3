"""How the scheduler places a key's next probe (pure arithmetic, no loop)."""

from __future__ import annotations

import random

import pytest

from healthgate.probes.prober import Prober
from healthgate.probes.scheduler import ProbeScheduler, _Entry
from healthgate.probes.spec import ProbeSpec

SPEC = ProbeSpec("TCP", "127.0.0.1", 1, timeout=1.0, interval=1.0)


@pytest.mark.parametrize(
    ("due", "started", "end", "expected"),
    [
        (10.0, 10.0, 10.2, 11.2),  # on time: interval after the end
        (10.0, 10.05, 10.2, 11.15),  # 50 ms late: back in its phase next time
        (10.0, 9.995, 10.2, 11.205),  # started 5 ms early (half a tick): 5 ms later next time
        (10.0, 10.4, 10.6, 11.2),  # 400 ms late (under half an interval): phase kept
    ],
)
def test_next_due_keeps_each_key_in_its_phase(
    due: float, started: float, end: float, expected: float
) -> None:
    sched = ProbeScheduler(Prober(), lambda *a: None, rng=random.Random(0))
    entry = _Entry(SPEC)
    entry.due, entry.started = due, started
    assert sched._next_due(entry, end) == pytest.approx(expected)


def test_after_a_stall_longer_than_half_an_interval_keys_are_spread_again() -> None:
    sched = ProbeScheduler(Prober(), lambda *a: None, rng=random.Random(0))
    nexts = []
    for _ in range(200):
        entry = _Entry(SPEC)
        entry.due, entry.started = 10.0, 10.8  # a 0.8 s stall
        nexts.append(sched._next_due(entry, 11.0))
    assert all(11.0 <= n <= 12.0 for n in nexts)
    assert max(nexts) - min(nexts) > 0.8  # spread over the interval, not one clump
