"""When each probe of an endpoint is due: SPEC §2.1's timing, pure.

One timing model for everything that probes, real or simulated: the
scheduler (probes/scheduler.py) and the what-if simulator
(simulation/runner.py) each hold a :class:`Timetable` - these two functions
over their own clock and source of ``spread`` fractions in [0, 1) (the event
loop's clock and random spreads in ``serve``; virtual time and even spreads
in the simulator) - so the detection windows they produce are the same by
construction.

* The **interval** runs from the end of one probe to the start of the next:
  probes of one endpoint never overlap.
* A new endpoint's **first probe** is due at a point of its first interval
  given by ``spread``, so that thousands added at once do not fire together.
* **Phase keeping**: a probe that started late (or early) moves the next due
  time back (forward) by as much, so that probes a busy loop started
  together once do not stay in step for ever. After a stall longer than
  half an interval the endpoint is spread again instead.
"""

from __future__ import annotations

from collections.abc import Callable


def first_due(now: float, interval: float, spread: float) -> float:
    """When a newly added endpoint's first probe is due."""
    return now + spread * interval


def next_due(interval: float, due: float, started: float, ended: float, spread: float) -> float:
    """When the next probe is due, for a probe that was due at ``due``,
    started at ``started`` and ended at ``ended``.

    Without the correction, probes that the loop started late together
    (a stall, a burst of work) would end together and stay in step for
    ever: clumps that only ever merge, each making the next tick longer.
    With it, a late start shortens the next gap by the lateness and the
    key is back in its place."""
    offset = due - started  # > 0: started early; < 0: started late
    if offset < -interval / 2:
        return ended + spread * interval
    return ended + interval + offset


class Timetable:
    """The timing rules over an injected clock (``now``) and source of
    spread fractions (``spread``, each call one fraction in [0, 1))."""

    __slots__ = ("now", "spread")

    def __init__(self, now: Callable[[], float], spread: Callable[[], float]) -> None:
        self.now = now
        self.spread = spread

    def first(self, interval: float) -> float:
        """When a probe newly asked for is due: within its first interval from now."""
        return first_due(self.now(), interval, self.spread())

    def next(self, interval: float, due: float, started: float, ended: float) -> float:
        """When the next probe is due, after one that ended at ``ended``."""
        return next_due(interval, due, started, ended, self.spread())
