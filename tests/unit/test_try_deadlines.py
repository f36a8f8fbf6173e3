"""The fast path's per-try deadlines (dataplane/upstream.py TryDeadlines),
in virtual time: a try added at any moment gives up between the timeout
and the timeout plus one sweep - counted in sweeps, without a clock read per
request."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable
from typing import Any, cast

import pytest

from healthgate.dataplane.upstream import TryDeadlines


class VirtualLoop:
    """call_later on a virtual clock; ``run_until`` fires what is due."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[tuple[float, int, Callable[..., object], tuple[Any, ...]]] = []
        self._seq = 0

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Any:
        self._seq += 1
        heapq.heappush(self._timers, (self.now + delay, self._seq, callback, args))
        return _Handle()

    def run_until(self, t: float) -> None:
        while self._timers and self._timers[0][0] <= t:
            when, _, callback, args = heapq.heappop(self._timers)
            self.now = when
            callback(*args)
        self.now = t


class _Handle:
    def cancel(self) -> None:
        pass


class Try:
    def __init__(self, loop: VirtualLoop) -> None:
        self.loop = loop
        self.expired_at: float | None = None

    def fast_expired(self) -> None:
        self.expired_at = self.loop.now


@pytest.mark.parametrize("timeout", [0.005, 0.055, 0.08, 0.3, 2.0, 5.0, 7.3, 30.0])
@pytest.mark.parametrize("offset", [0.0, 0.001, 0.37, 0.999])
def test_a_try_gives_up_between_the_timeout_and_one_sweep_later(
    timeout: float, offset: float
) -> None:
    loop = VirtualLoop()
    deadlines = TryDeadlines(timeout)
    aloop = cast(asyncio.AbstractEventLoop, loop)
    keeper = Try(loop)  # keeps the sweeps running, as traffic would
    deadlines.add(keeper, aloop)  # type: ignore[arg-type]
    loop.run_until(3 * deadlines.every + offset * deadlines.every)  # some sweeps in, mid-sweep
    start = loop.now
    late = Try(loop)
    deadlines.add(late, aloop)  # type: ignore[arg-type]
    loop.run_until(start + timeout + 3 * deadlines.every)
    assert late.expired_at is not None
    waited = late.expired_at - start
    assert timeout - 1e-9 <= waited <= timeout + deadlines.every + 1e-9, (waited, deadlines.every)
    assert deadlines.every <= 0.25 and (deadlines.every >= 0.01 or deadlines.ticks == 1)


def test_a_try_that_ends_in_time_is_not_expired_and_the_timer_stops() -> None:
    loop = VirtualLoop()
    deadlines = TryDeadlines(1.0)
    done = Try(loop)
    deadlines.add(done, cast(asyncio.AbstractEventLoop, loop))  # type: ignore[arg-type]
    loop.run_until(0.5)
    deadlines.pending.pop(done)  # type: ignore[call-overload]  # (as the proxy does on an answer)
    loop.run_until(5.0)
    assert done.expired_at is None
    assert deadlines.pending == {}
    loop.run_until(10.0)
    assert not loop._timers  # no sweep while nothing is in flight


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan"), float("inf")])
def test_a_timeout_out_of_range_is_refused(timeout: float) -> None:
    with pytest.raises(ValueError, match="per_try_timeout"):
        TryDeadlines(timeout)
