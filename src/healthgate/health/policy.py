"""Backend-service health under an aggregation policy (SPEC §2.2).

With N endpoints, H of them HEALTHY and U UNKNOWN, the policy *holds for h*
when ``h >= minHealthyThreshold`` and ``100·h/N >= healthyPercentThreshold``
(with N = 0 the percentage holds only for a threshold of 0). Then:

* holds for H            -> HEALTHY
* fails even for H + U   -> UNHEALTHY
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
    policy: PolicyParams, total: int, healthy: int, unknown: int
) -> tuple[HealthState, str]:
    """The three-valued answer and a reason a person can read."""
    counts = f"{healthy} of {total} endpoints healthy ({_pct(healthy, total)})"
    if policy.holds(healthy, total):
        return HealthState.HEALTHY, (
            f"{counts} >= healthyPercentThreshold {policy.healthy_percent}% "
            f"and >= minHealthyThreshold {policy.min_healthy}"
        )
    best = healthy + unknown
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
