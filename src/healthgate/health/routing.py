"""Consumer route choice (SPEC §2.3 "Failover").

A front end in region R orders its backend service's PSC NEGs by
``failoverPriority`` (lower first; a NEG without one comes after every NEG
with one), then by locality (R's own region first), then by name. Then:

* no route yet: the first NEG that is not UNHEALTHY;
* the current NEG turned UNHEALTHY (or left the service, or its connection
  was refused): the first NEG, in order, that is not UNHEALTHY - failover;
* the current NEG is fine and failback is on: a NEG *before* it in the order
  that is HEALTHY takes the traffic back - failback. UNKNOWN never moves
  traffic: neither away (it is not a failure) nor back (it is not a recovery);
* every NEG UNHEALTHY: FAIL_OPEN keeps using the first NEG in order,
  FAIL_CLOSED refuses new connections.

A DEGRADED NEG (SPEC §9) is eligible, but the order puts it after every
NEG that is not (keeping the order among the degraded ones): traffic on a
DEGRADED NEG moves to a HEALTHY one whether failback is on or not, and
stays on it when none is HEALTHY; an UNKNOWN NEG ahead of it does not take
the traffic (UNKNOWN never moves traffic).

A NEG shifted away (health/shifts.py) takes no traffic, as if UNHEALTHY,
and its reason says who shifted it, until when and why - but a shift never
sends traffic to an UNHEALTHY NEG: when every other NEG is UNHEALTHY, the
shifted one (if it is not) keeps the traffic.

A NEG whose connection the service attachment did not accept is never a
candidate, not even for FAIL_OPEN: no traffic may flow through it.

**Shares** (SPEC §6, :func:`distribute`): the route is a distribution over
the eligible NEGs. ``remaining = 100``; in order, each eligible NEG takes
``remaining x dial x factor x ramp`` (:attr:`Candidate.take`: the factor of
spill PROPORTIONAL, min(1, overprovisioningFactor x healthyFraction); the
progress of a ramped failback, 0 to 1 - health/graph.py); what is left after the last one goes back to them in
proportion to what they took (a dial never drops traffic some NEG may
take; when every eligible NEG's dial is 0, the first one takes it all). The
order starts with the NEG :func:`choose` picked (with failback off, traffic
stays where it is: that NEG stays first), then the others in failover
order. With every dial at 100 this is exactly the single choice. Shares
are whole basis points (0.01 %), largest remainders rounded up, so they
always sum to exactly 100.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from healthgate.health.states import HealthState, RouteMode

NO_PRIORITY = 1 << 30


@dataclass(frozen=True, slots=True)
class Candidate:
    path: str
    name: str
    region: str
    priority: int | None
    state: HealthState
    accepted: bool = True
    shifted: str = ""  # the reason of a shift that keeps it out (health/shifts.py)
    dial: int = 100  # trafficDial (SPEC §6): percent of what is left that it takes
    # spill PROPORTIONAL (SPEC §6): min(1, overprovisioningFactor x healthy
    # fraction), and that fraction (None: not known, or ALL_OR_NOTHING)
    factor: float = 1.0
    fraction: float | None = None
    ramp: float = 1.0  # ramped failback: how far its ramp is, 0-1 (1: none)

    @property
    def take(self) -> float:
        """The part of what is left that it takes: dial x factor x ramp."""
        return self.dial / 100 * self.factor * self.ramp

    def why_take(self, overprovisioning: float) -> str:
        """What its take is made of, for the share's reason."""
        parts = [f"trafficDial {self.dial}"] if self.dial != 100 else []
        if self.fraction is not None:
            parts.append(
                f"healthyFraction {self.fraction:.2f} x overprovisioningFactor "
                f"{overprovisioning:g} = factor {self.factor:.2f}"
            )
        if self.ramp < 1:
            parts.append(f"failback ramp {self.ramp * 100:.0f}% of the way")
        return ", ".join(parts) or "all of it"

    @property
    def eligible(self) -> bool:
        """May it take traffic: neither UNHEALTHY nor shifted away."""
        return self.state is not HealthState.UNHEALTHY and not self.shifted

    @property
    def why_out(self) -> str:
        return self.shifted or "UNHEALTHY"

    def sort_key(self, local_region: str | None) -> tuple[bool, int, int, str, str]:
        prio = NO_PRIORITY if self.priority is None else self.priority
        degraded = self.state is HealthState.DEGRADED  # (SPEC §9: after every other)
        return (degraded, prio, 0 if self.region == local_region else 1, self.name, self.path)


@dataclass(frozen=True, slots=True)
class RouteChoice:
    target: str | None  # NEG path, or None (refuse)
    mode: RouteMode
    reason: str


def order(candidates: Sequence[Candidate], local_region: str | None) -> list[Candidate]:
    return sorted(candidates, key=lambda c: c.sort_key(local_region))


def choose(
    candidates: Sequence[Candidate],
    local_region: str | None,
    current: str | None,
    failback: bool,
    fail_open: bool,
) -> RouteChoice:
    ordered = [c for c in order(candidates, local_region) if c.accepted]
    if not ordered:
        refused = [c for c in candidates if not c.accepted]
        why = "no backends" if not refused else "no backend's connection is accepted"
        return RouteChoice(None, RouteMode.NONE, why)
    by_path = {c.path: c for c in ordered}
    cur = by_path.get(current) if current else None

    if cur is not None and cur.eligible:
        degraded = cur.state is HealthState.DEGRADED
        if failback or degraded:  # (traffic leaves a DEGRADED NEG for a HEALTHY one)
            for c in ordered:
                if c.path == cur.path:
                    break
                if c.state is HealthState.HEALTHY and not c.shifted:
                    why = (
                        f"{cur.name} ({cur.region}) is DEGRADED: moving to {c.name} "
                        f"({c.region}), HEALTHY"
                        if degraded
                        else f"{c.name} ({c.region}) is HEALTHY again: failing back"
                    )
                    return RouteChoice(c.path, RouteMode.NORMAL, why)
        why = f"{cur.name} ({cur.region}) is {cur.state.name}"
        before = [c for c in ordered[: ordered.index(cur)] if c.shifted]
        if before:  # (why not the first: a person moved the traffic, and until when)
            why += f"; {before[0].name} ({before[0].region}) is {before[0].shifted}"
        return RouteChoice(cur.path, RouteMode.NORMAL, why)

    for c in ordered:
        if c.eligible:
            if cur is not None:
                why = (
                    f"{cur.name} ({cur.region}) is {cur.why_out}: failing over to "
                    f"{c.name} ({c.region})"
                )
            elif current is not None:
                why = f"the previous backend left the service: now {c.name} ({c.region})"
            else:
                why = (
                    f"{c.name} ({c.region}) is first by priority and locality and is {c.state.name}"
                )
            return RouteChoice(c.path, RouteMode.NORMAL, why)

    # a shift never sends traffic to an UNHEALTHY NEG: with nothing else
    # left, the shifted one that is not UNHEALTHY keeps (or takes) it
    for c in ordered:
        if c.shifted and c.state is not HealthState.UNHEALTHY:
            return RouteChoice(
                c.path,
                RouteMode.NORMAL,
                f"every other backend is UNHEALTHY: {c.name} ({c.region}) takes traffic "
                f"although {c.shifted}",
            )

    if fail_open:
        first = ordered[0]
        return RouteChoice(
            first.path,
            RouteMode.FAIL_OPEN,
            f"every backend is UNHEALTHY: whenAllUnhealthy FAIL_OPEN keeps {first.name} ({first.region})",
        )
    return RouteChoice(
        None,
        RouteMode.FAIL_CLOSED,
        "every backend is UNHEALTHY: whenAllUnhealthy FAIL_CLOSED refuses traffic",
    )


@dataclass(frozen=True, slots=True)
class Share:
    """One NEG's part of a route's new traffic."""

    neg: str  # PSC NEG path
    region: str
    percent: float  # 0.01 steps; a route's shares sum to 100
    reason: str


def distribute(
    candidates: Sequence[Candidate],
    local_region: str | None,
    primary: str | None,
    overprovisioning: float = 1.4,
) -> tuple[Share, ...]:
    """The route's shares (see the module doc); ``primary`` is :func:`choose`'s
    target (None: no share at all - FAIL_CLOSED or nothing to route to);
    ``overprovisioning`` only names the factor in the reasons."""
    if primary is None:
        return ()
    ordered = [c for c in order(candidates, local_region) if c.accepted]
    first = next((c for c in ordered if c.path == primary), None)
    if first is None:
        return ()
    if not first.eligible:  # FAIL_OPEN, or the shifted NEG that is left: all of it
        return (Share(first.path, first.region, 100.0, "the only NEG that may take traffic"),)
    takers = [first, *(c for c in ordered if c.eligible and c.path != primary)]
    if first.take >= 1:
        return (Share(first.path, first.region, 100.0, f"{first.name} takes all new traffic"),)
    remaining = 1.0
    took, before = [], []
    for c in takers:
        before.append(remaining)
        share = remaining * c.take
        took.append(share)
        remaining -= share
    total = sum(took)
    if total > 0:  # what the dials left goes back in proportion to what each took
        took = [t + remaining * t / total for t in took]
    else:  # every dial at 0: the first takes it all
        took = [1.0] + [0.0] * (len(took) - 1)
    back = f"; the {remaining * 100:.4g}% the dials left handed back" if total and remaining else ""
    if not total:
        why = f"{first.name}: every NEG's take is 0, and a dial never drops traffic: all of it"
        return (Share(first.path, first.region, 100.0, why),)
    out = []
    for c, points, left in zip(takers, _basis_points(took), before, strict=True):
        if points:
            why = f"{c.name}: {c.why_take(overprovisioning)} of the {left * 100:.4g}% left{back}"
            out.append(Share(c.path, c.region, points / 100, why))
    return tuple(out)


def _basis_points(fractions: Sequence[float]) -> list[int]:
    """Fractions summing to 1 as whole basis points summing to exactly 10,000
    (largest remainders first, ties to the earlier NEG)."""
    raw = [f * 10_000 for f in fractions]
    points = [int(r) for r in raw]
    short = 10_000 - sum(points)
    by_remainder = sorted(range(len(raw)), key=lambda i: (-(raw[i] - points[i]), i))
    for i in by_remainder[:short]:
        points[i] += 1
    return points


def ramp_progress(now: float, start: float, seconds: int) -> float:
    """How far a ramped failback is at ``now``, 0-1 (a start still ahead: 0;
    no ramp time: done)."""
    if seconds <= 0:
        return 1.0
    return min(1.0, max(0.0, (now - start) / seconds))


def moved(before: Sequence[Share], after: Sequence[Share]) -> bool:
    """Is this a route change to record (SPEC §6): a NEG gained or lost a
    share, or a share moved by 5 points or more?"""
    was = {s.neg: s.percent for s in before}
    now = {s.neg: s.percent for s in after}
    if was.keys() != now.keys():
        return True
    return any(abs(now[n] - was[n]) >= 5 for n in now)


def split_text(shares: Sequence[Share]) -> str:
    """``70% us-east1, 30% europe-west1``."""
    return ", ".join(f"{s.percent:g}% {s.region}" for s in shares)
