"""Backend-service health under an aggregation policy (SPEC §2.2).

With N endpoints, H of them HEALTHY and U UNKNOWN, the policy *holds for h*
when ``h >= minHealthyThreshold`` and ``100·h/N >= healthyPercentThreshold``
(with N = 0 the percentage holds only for a threshold of 0). Then:

* holds for H            -> HEALTHY
* holds for H + D        -> DEGRADED (D: DEGRADED endpoints, SPEC §9 - they
                            count as healthy, and the policy holds only
                            thanks to them)
* fails even for H + D + U -> UNHEALTHY
* otherwise              -> UNKNOWN: the answer waits on unknown endpoints.

Only integers are compared (``100·h >= pct·N``), so there is no rounding at
the boundary: 3 of 4 at 75 % holds exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from healthgate.health.states import HealthState


@dataclass(frozen=True, slots=True)
class PolicyParams:
    healthy_percent: int = 60
    min_healthy: int = 1

    def holds(self, healthy: int, total: int) -> bool:
        if healthy < self.min_healthy:
            return False
        if total == 0:
            return self.healthy_percent == 0
        return 100 * healthy >= self.healthy_percent * total

    def describe(self) -> str:
        return f"healthyPercentThreshold {self.healthy_percent}%, minHealthyThreshold {self.min_healthy}"


def _pct(h: int, n: int) -> str:
    # floor to one decimal, so the shown figure never rounds up past a threshold
    tenths = (1000 * h) // n if n else 0
    return f"{tenths // 10}%" if tenths % 10 == 0 else f"{tenths / 10:.1f}%"


def evaluate(
    policy: PolicyParams, total: int, healthy: int, unknown: int, degraded: int = 0
) -> tuple[HealthState, str]:
    """The answer and a reason a person can read. DEGRADED endpoints (SPEC
    §9) count as healthy for the policy; when it holds only thanks to them
    the answer is DEGRADED."""
    counts = f"{healthy} of {total} endpoints healthy ({_pct(healthy, total)})"
    if policy.holds(healthy, total):
        return HealthState.HEALTHY, (
            f"{counts} >= healthyPercentThreshold {policy.healthy_percent}% "
            f"and >= minHealthyThreshold {policy.min_healthy}"
        )
    if degraded and policy.holds(healthy + degraded, total):
        up = healthy + degraded
        return HealthState.DEGRADED, (
            f"{counts}, {degraded} degraded: {up} of {total} ({_pct(up, total)}) hold "
            f"the policy ({policy.describe()}) only with the degraded ones"
        )
    if degraded:
        counts += f", {degraded} degraded"
    best = healthy + degraded + unknown
    if not policy.holds(best, total):
        why = []
        if best < policy.min_healthy:
            why.append(f"< minHealthyThreshold {policy.min_healthy}")
        if total == 0:
            why.append(f"no endpoints, and healthyPercentThreshold is {policy.healthy_percent}%")
        elif 100 * best < policy.healthy_percent * total:
            why.append(f"< healthyPercentThreshold {policy.healthy_percent}%")
        if unknown:
            counts += f", {unknown} unknown"
            return HealthState.UNHEALTHY, f"{counts}: even if all turn healthy, " + " and ".join(
                why
            )
        return HealthState.UNHEALTHY, f"{counts} " + " and ".join(why)
    return HealthState.UNKNOWN, (
        f"{counts}, {unknown} unknown: the policy ({policy.describe()}) "
        "depends on endpoints not yet known"
    )
