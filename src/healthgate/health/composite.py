"""Composite health (SPEC §2.3, §9): any source UNHEALTHY -> UNHEALTHY; else
any UNKNOWN -> UNKNOWN; else any DEGRADED -> DEGRADED; else (every source
HEALTHY) HEALTHY."""

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
    degraded = [(n, r) for n, s, r in sources if s is HealthState.DEGRADED]
    if degraded:
        head = f"health source {degraded[0][0]} is DEGRADED: {degraded[0][1]}"
        if len(degraded) > 1:
            head += f" (also DEGRADED: {', '.join(n for n, _ in degraded[1:])})"
        return HealthState.DEGRADED, head
    if len(sources) == 1:
        return HealthState.HEALTHY, f"health source {sources[0][0]} is HEALTHY"
    return HealthState.HEALTHY, f"all {len(sources)} health sources are HEALTHY"
