"""The probe scheduler's timer wheel: due times on short slots, and the tick.

Pure (no clock, no event loop): the scheduler (probes/scheduler.py) asks it
where a due time goes, which slots a tick at some time starts, when the
next tick must run, and how long a tick is at the present probe rate.

* **Slots.** Due times sit on slots ``res`` seconds wide: ``min_tick``, or
  a little less so that whole slots make the tick. Slot ``b`` holds the
  items due within half a slot of ``b * res``. Adding to a slot and taking
  one are O(1); a heap of the occupied slot numbers finds the next one.
* **The tick** is ``k`` slots long. A tick wakes half a tick before its last
  slot's time and starts every slot up to it, so a probe starts at most
  half a tick early or late.
* **Its length follows the rate** (:meth:`fit`): the longest tick, up to
  ``tick``, that makes about ``starts_per_tick`` starts or fewer; shorter
  at higher rates, down to one slot (``min_tick``). Why these numbers is
  in probes/scheduler.py's notes.
"""

from __future__ import annotations

import heapq
import math
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["TimerWheel"]


class TimerWheel(Generic[T]):
    __slots__ = ("_k", "_max_k", "_res", "_slots", "_spt", "_wheel")

    def __init__(self, tick: float, min_tick: float, starts_per_tick: int) -> None:
        if not tick > 0 or not min_tick > 0:
            raise ValueError(f"tick and min_tick must be above 0 (got {tick}, {min_tick})")
        self._res = tick / math.ceil(tick / min(min_tick, tick) - 1e-9)
        self._max_k = max(1, round(tick / self._res))
        self._k = self._max_k  # the tick, in slots (see fit)
        self._spt = starts_per_tick
        self._wheel: dict[int, list[T]] = {}
        self._slots: list[int] = []

    # ----------------------------------------------------------------- the tick

    @property
    def res(self) -> float:
        """A slot's width, in seconds."""
        return self._res

    @property
    def k(self) -> int:
        """The tick, in slots."""
        return self._k

    @property
    def tick(self) -> float:
        """The tick now, in seconds."""
        return self._k * self._res

    def fit(self, rate: float) -> None:
        """The probe rate (starts a second) is now ``rate``: the tick is the
        longest (up to the configured tick) with about ``starts_per_tick``
        starts or fewer."""
        fit = self._spt / (rate * self._res) if rate > 0 else self._max_k
        self._k = max(1, min(self._max_k, int(fit + 1e-9)))

    def wake_for(self, slot: int) -> float:
        """When a tick must run to start ``slot`` (half a tick early at most)."""
        return slot * self._res - (self._k - 1) * self._res / 2

    def last_due(self, now: float) -> int:
        """The last slot that a tick running at ``now`` starts: those due
        within half a tick of now. (+1e-6: ``now / res`` of a time on a slot
        boundary can come out just below the whole number - 12.35 / 0.01 is
        1234.99.. - and then the next tick would be due at once, again and
        again until the clock moves on: uvloop's clock moves in whole
        milliseconds.)"""
        return int((now + (self._k - 1) * self._res / 2) / self._res + 1e-6)

    # ---------------------------------------------------------------- the slots

    def add(self, item: T, due: float) -> float | None:
        """Put ``item`` on the slot of ``due``. When that slot was empty,
        the time a tick must run to start it (the caller's timer may need
        to move earlier); otherwise None."""
        res = self._res
        slot = int(due / res + 0.5)
        wheel = self._wheel
        items = wheel.get(slot)
        if items is not None:  # (the usual case, once probes are many: no call made)
            items.append(item)
            return None
        wheel[slot] = [item]
        heapq.heappush(self._slots, slot)
        return slot * res - (self._k - 1) * res / 2  # (wake_for, inline)

    def take(self, last: int) -> tuple[int, list[T]] | None:
        """The earliest slot and its items, taken off the wheel, if it is
        ``last`` or earlier; otherwise None."""
        slots = self._slots
        if not slots or slots[0] > last:
            return None
        slot = heapq.heappop(slots)
        return slot, self._wheel.pop(slot)

    def put_back(self, slot: int, items: list[T]) -> None:
        """Items of a taken slot that were not started (the tick ran out of
        time), before anything added to the slot since."""
        if not items:
            return
        again = self._wheel.get(slot)
        if again is None:
            self._wheel[slot] = items
            heapq.heappush(self._slots, slot)
        else:
            again[:0] = items

    def first(self) -> int | None:
        """The earliest occupied slot, if any."""
        return self._slots[0] if self._slots else None

    def __len__(self) -> int:
        """Occupied slots."""
        return len(self._slots)

    def clear(self) -> None:
        self._wheel.clear()
        self._slots.clear()
