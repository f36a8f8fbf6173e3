"""The timer wheel (probes/wheel.py): slots, the tick's length, and taking
what is due - pure, no clock."""

from __future__ import annotations

import random

import pytest

from healthgate.probes.wheel import TimerWheel


@pytest.mark.parametrize(
    ("tick", "min_tick", "res", "k"),
    [
        (0.016, 0.002, 0.002, 8),  # the defaults: 8 slots of 2 ms
        (0.010, 0.003, 0.0025, 4),  # slots a little narrower, so 4 make the tick
        (0.002, 0.005, 0.002, 1),  # min_tick above the tick: one slot
        (0.020, 0.020, 0.020, 1),
    ],
)
def test_slots_divide_the_tick(tick: float, min_tick: float, res: float, k: int) -> None:
    wheel: TimerWheel[str] = TimerWheel(tick, min_tick, 20)
    assert wheel.res == pytest.approx(res)
    assert wheel.k == k
    assert wheel.tick == pytest.approx(tick)


@pytest.mark.parametrize(
    ("rate", "k"),
    [
        (0.0, 8),  # nothing to probe: the longest tick
        (500.0, 8),  # 20 / (500 * 2 ms) = 20 slots: capped at 8
        (1_250.0, 8),  # exactly 8
        (2_000.0, 5),  # 16 ms would start 32: 10 ms starts 20
        (5_000.0, 2),
        (10_000.0, 1),
        (1_000_000.0, 1),  # never below one slot
    ],
)
def test_the_tick_follows_the_rate(rate: float, k: int) -> None:
    wheel: TimerWheel[str] = TimerWheel(0.016, 0.002, 20)
    wheel.fit(rate)
    assert wheel.k == k
    wheel.fit(0.0)
    assert wheel.k == 8


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="tick"):
        TimerWheel(0.0, 0.002, 20)
    with pytest.raises(ValueError, match="tick"):
        TimerWheel(0.016, -1.0, 20)


@pytest.mark.parametrize(
    ("due", "slot"),
    [
        (0.0, 0),
        (0.0009, 0),  # within half a slot of 0
        (0.0011, 1),  # nearer 2 ms
        (1.0, 500),
        (12.35, 6175),
    ],
)
def test_a_due_time_goes_to_the_nearest_slot(due: float, slot: int) -> None:
    wheel: TimerWheel[str] = TimerWheel(0.016, 0.002, 20)
    assert wheel.add("a", due) == pytest.approx(wheel.wake_for(slot))
    assert wheel.add("b", due) is None  # the slot was open: no earlier wake-up
    assert wheel.take(slot - 1) is None
    assert wheel.take(slot) == (slot, ["a", "b"])
    assert len(wheel) == 0


@pytest.mark.parametrize(
    ("k", "now", "last"),
    [
        (8, 0.0, 3),  # half a tick ahead of now: 7 ms / 2 ms
        (8, 1.0, 503),
        (1, 12.35, 6175),  # a slot boundary that float division puts just below
        (1, 12.3509, 6175),
    ],
)
def test_a_tick_starts_what_is_due_within_half_a_tick(k: int, now: float, last: int) -> None:
    wheel: TimerWheel[str] = TimerWheel(0.016, 0.002, 20)
    wheel.fit(20 / (k * 0.002))
    assert wheel.k == k
    assert wheel.last_due(now) == last
    # the tick that wakes for a slot starts it
    assert wheel.last_due(wheel.wake_for(last)) == last


def test_slots_are_taken_in_order_and_put_back_first() -> None:
    wheel: TimerWheel[int] = TimerWheel(0.016, 0.002, 20)
    rng = random.Random(7)
    dues = [rng.uniform(0, 1) for _ in range(500)]
    for i, due in enumerate(dues):
        wheel.add(i, due)
    taken: list[int] = []
    slots: list[int] = []
    while (got := wheel.take(10**9)) is not None:
        slot, items = got
        slots.append(slot)
        taken.extend(items)
    assert slots == sorted(slots) and len(set(slots)) == len(slots)
    assert sorted(taken) == list(range(500))
    assert [int(dues[i] / 0.002 + 0.5) for i in taken] == sorted(int(d / 0.002 + 0.5) for d in dues)
    # a tick that ran out of time puts the rest back, before what came since
    wheel.add(1, 0.1)
    got = wheel.take(10**9)
    assert got is not None
    wheel.add(2, 0.1)
    wheel.put_back(got[0], [3, 4])
    wheel.put_back(got[0], [])
    assert wheel.first() == got[0]
    assert wheel.take(got[0]) == (got[0], [3, 4, 2])
    assert wheel.first() is None
    wheel.add(5, 0.2)
    wheel.clear()
    assert wheel.first() is None and wheel.take(10**9) is None
