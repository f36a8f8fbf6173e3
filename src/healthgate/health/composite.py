"""Composite health (SPEC §2.3): every source HEALTHY -> HEALTHY; any source
UNHEALTHY -> UNHEALTHY; otherwise UNKNOWN."""

from __future__ import annotations

from collections.abc import Sequence

from healthgate.health.states import HealthState


def combine(sources: Sequence[tuple[str, HealthState, str]]) -> tuple[HealthState, str]:
    """``sources`` is ``[(name, state, reason)]``; returns the composite state and why."""
    if not sources:
        return HealthState.UNKNOWN, "no health sources"
    bad = [(n, r) for n, s, r in sources if s is HealthState.UNHEALTHY]
    if bad:
        head = f"health source {bad[0][0]} is UNHEALTHY: {bad[0][1]}"
        if len(bad) > 1:
            others = ", ".join(n for n, _ in bad[1:])
            head += f" (also UNHEALTHY: {others})"
        return HealthState.UNHEALTHY, head
    unknown = [(n, r) for n, s, r in sources if s is HealthState.UNKNOWN]
    if unknown:
        return HealthState.UNKNOWN, f"health source {unknown[0][0]} is UNKNOWN: {unknown[0][1]}"
    if len(sources) == 1:
        return HealthState.HEALTHY, f"health source {sources[0][0]} is HEALTHY"
    return HealthState.HEALTHY, f"all {len(sources)} health sources are HEALTHY"
