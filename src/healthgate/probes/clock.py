"""The prober's time: one clock for due times, timers and the records' time.

The scheduler runs on the event loop's monotonic clock (``loop.time()``)
and its timers; the records a result causes carry wall-clock time (epoch
seconds: the transition log, the API). A result is taken at a loop time,
and that very time becomes the record's - converted (:meth:`Clock.wall`),
never read again from the wall clock later, when the result has made its
way through a tick, a pipe or a queue.

:class:`LoopClock` is the event loop's; tests drive a virtual clock with
the same three methods (``tests/unit/test_scheduler_virtual.py``), whose
``wall`` is the identity.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """What probing needs of time: now, a timer, and the wall-clock time of
    a moment of this clock."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], object]) -> TimerHandle: ...

    def wall(self, t: float) -> float: ...


class LoopClock:
    """The running event loop's clock and timers; ``wall`` adds the offset
    between the wall clock and the loop's, measured when made and again
    every ``resync`` seconds (so that a wall clock slewed by NTP is followed
    within that long)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, resync: float = 60.0) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.resync = resync
        self._offset = 0.0
        self._next_sync = float("-inf")

    def time(self) -> float:
        return self.loop.time()

    def call_at(self, when: float, callback: Callable[[], object]) -> TimerHandle:
        return self.loop.call_at(when, callback)

    def wall(self, t: float) -> float:
        if t >= self._next_sync:
            now = self.loop.time()
            self._offset = time.time() - now
            self._next_sync = now + self.resync
        return t + self._offset
