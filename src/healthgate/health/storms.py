"""Failover storms held (SPEC §8) - pure, in virtual time.

When the evidence itself is the likelier fault - a checker's own network,
a monitoring outage - moving traffic makes things worse. With
``serve --storm-hold-percent P`` (0: off, the default) and
``--storm-hold-window SEC`` (30): when, within the window, more than P % of
all endpoints healthgate probes turn UNHEALTHY and they span two or more
regions, the route changes that would follow are held: the routes are
computed from the NEG states as they were when the hold began (shifts
still act), the NEG and composite records still say what the probes saw.
The hold lifts by itself when fewer than P % are UNHEALTHY, or when an
admin releases it; a region failing alone is never held.

:class:`StormGuard` sees every endpoint flip before the graph does (so the
flip that makes the storm is held too) and says when a hold begins or ends;
the graph keeps the routes (health/graph.py ``hold``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from healthgate.health.states import HealthState, Hold, HoldPhase

UNHEALTHY = HealthState.UNHEALTHY


@dataclass(frozen=True, slots=True)
class StormSettings:
    percent: float = 0.0  # 0: off
    window: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.percent <= 100:
            raise ValueError(f"storm-hold-percent: 0-100, got {self.percent:g}")
        if not 1 <= self.window <= 3600:
            raise ValueError(f"storm-hold-window: 1-3600 seconds, got {self.window:g}")


class StormGuard:
    def __init__(self, settings: StormSettings | None = None) -> None:
        self.settings = settings or StormSettings()
        # (time, endpoint path, region) of each turn to UNHEALTHY, oldest first
        self._turns: deque[tuple[float, str, str]] = deque()
        self._unhealthy: dict[str, str] = {}  # endpoint path -> region, of those UNHEALTHY now
        self.hold: Hold | None = None  # the hold in effect
        self._count = 0
        self._quiet_until = 0.0  # an admin's release: turns before it start no new hold

    @property
    def on(self) -> bool:
        return self.settings.percent > 0

    def flip(
        self, now: float, endpoint: str, region: str, new: HealthState, probed: int
    ) -> Hold | None:
        """An endpoint changed state (``probed``: endpoints probed now); the
        Hold record when a hold begins or lifts with it, else None."""
        if not self.on:
            return None
        if new is UNHEALTHY:
            self._unhealthy[endpoint] = region
            self._turns.append((now, endpoint, region))
        else:
            self._unhealthy.pop(endpoint, None)
        return self.check(now, probed)

    def forget(self, endpoint: str) -> None:
        """An endpoint that is no longer probed."""
        self._unhealthy.pop(endpoint, None)

    def check(self, now: float, probed: int) -> Hold | None:
        s = self.settings
        turns = self._turns
        while turns and turns[0][0] < now - s.window:
            turns.popleft()
        if self.hold is not None:
            share = 100 * len(self._unhealthy) / probed if probed else 0.0
            if share < s.percent:
                return self._end(
                    now,
                    HoldPhase.LIFTED,
                    f"{len(self._unhealthy)} of {probed} endpoints ({share:.1f} %) UNHEALTHY now, "
                    f"fewer than --storm-hold-percent {s.percent:g}: routes follow health again",
                )
            return None
        if not probed:
            return None
        recent = {
            path: region
            for t, path, region in turns
            if path in self._unhealthy and t >= self._quiet_until
        }
        regions = sorted(set(recent.values()))
        share = 100 * len(recent) / probed
        if share <= s.percent or len(regions) < 2:
            return None  # (a region failing alone is never held)
        self._count += 1
        self.hold = Hold(
            now,
            f"storm-{self._count}-{int(now)}",
            HoldPhase.HELD,
            f"{len(recent)} of {probed} probed endpoints ({share:.1f} %) turned UNHEALTHY within "
            f"{s.window:g} s across {len(regions)} regions ({', '.join(regions)}), more than "
            f"--storm-hold-percent {s.percent:g}: the evidence is the likelier fault; routes are "
            "held where they are until fewer are UNHEALTHY or an admin releases the hold",
            tuple(regions),
            len(recent),
            probed,
            since=min(t for t, path, _ in turns if path in recent),
        )
        return self.hold

    def release(self, now: float, hold_id: str, actor: str) -> Hold | None:
        """An admin releases the hold (None: no such hold in effect)."""
        if self.hold is None or self.hold.hold_id != hold_id:
            return None
        self._quiet_until = now
        return self._end(now, HoldPhase.RELEASED, f"released by {actor}", actor)

    def _end(self, now: float, phase: HoldPhase, reason: str, actor: str = "") -> Hold:
        held = self.hold
        assert held is not None
        self.hold = None
        return Hold(
            now, held.hold_id, phase, reason, held.regions, held.unhealthy, held.probed,
            held.held, actor, held.since,
        )  # fmt: skip
