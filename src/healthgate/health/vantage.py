"""Multi-vantage quorum: one endpoint, several probers' opinions, one state.

In cluster mode (SPEC §4) an endpoint is probed from its own region and,
when its health check lists ``vantageRegions``, from each of those regions
too. Each vantage runs the threshold machine on its own probes and holds an
*opinion* (HEALTHY / UNHEALTHY / UNKNOWN). This module turns the opinions
into the endpoint's state, a pure function with no clock and no I/O:

* a vantage with no live node has **no opinion**, and neither has a live
  vantage whose own opinion is still UNKNOWN (its prober just started);
* the endpoint is **UNHEALTHY** only when a quorum - a strict majority - of
  the *live* vantages says UNHEALTHY;
* otherwise it is **HEALTHY** as soon as one live vantage says HEALTHY (a
  lone dissenter, a vantage with a broken path to the endpoint, does not
  take it out), or DEGRADED (SPEC §9) when the live vantages that see it
  up all see it DEGRADED;
* with no opinion at all (every vantage dead or still unknown) the state
  stays what it was - fail static - and is UNKNOWN only if it never had one.

Compared with Route 53, whose checkers in several regions mark an endpoint
healthy when more than 18 % of them see it healthy (a fixed fraction over a
fixed fleet), the quorum here is over the vantages that are alive now, so a
vantage region that is down neither votes nor blocks a decision.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from healthgate.health.states import HealthState

HEALTHY = HealthState.HEALTHY
UNHEALTHY = HealthState.UNHEALTHY
UNKNOWN = HealthState.UNKNOWN
DEGRADED = HealthState.DEGRADED


def vantages_of(own_region: str, listed: Sequence[str]) -> tuple[str, ...]:
    """The regions whose opinions count for an endpoint of ``own_region``."""
    return tuple(dict.fromkeys([own_region, *listed]))


def verdict(
    opinions: Mapping[str, HealthState],
    vantages: Sequence[str],
    live: Collection[str],
    previous: HealthState = UNKNOWN,
) -> tuple[HealthState, str]:
    """The endpoint's state from its vantages' opinions, and why.

    ``opinions``: region -> that vantage's state (absent: none yet);
    ``live``: the vantage regions that have a live prober now."""
    voters = [r for r in vantages if r in live]
    said = {r: opinions.get(r, UNKNOWN) for r in voters}
    down = sorted(r for r, s in said.items() if s is UNHEALTHY)
    up = sorted(r for r, s in said.items() if s is HEALTHY or s is DEGRADED)
    # up: HEALTHY when one of them says HEALTHY, else DEGRADED (SPEC §9)
    best = HEALTHY if any(said[r] is HEALTHY for r in up) else DEGRADED
    if len(vantages) == 1:  # the common case: one region decides alone
        if up or down:
            state = best if up else UNHEALTHY
            return state, f"{state.name} as seen from {(up or down)[0]}"
        return previous, _held(vantages, voters, previous)
    quorum = len(voters) // 2 + 1
    if len(down) >= quorum:
        return UNHEALTHY, (
            f"UNHEALTHY from {len(down)} of {len(voters)} live vantages ({', '.join(down)})"
            + (f"; {', '.join(up)} saw it HEALTHY" if up else "")
        )
    if up:
        why = f"{best.name} from {', '.join(r for r in up if said[r] is best)}"
        if down:
            why += f"; {', '.join(down)} saw it UNHEALTHY, short of a quorum of {quorum}"
        return best, why
    if down:  # the rest of the live vantages have no opinion yet
        return previous, (
            f"{', '.join(down)} saw it UNHEALTHY, short of a quorum of {quorum} "
            f"(no opinion yet from {', '.join(r for r in voters if r not in down)}): "
            f"{previous.name} is kept"
        )
    return previous, _held(vantages, voters, previous)


def _held(vantages: Sequence[str], voters: Sequence[str], previous: HealthState) -> str:
    if not voters:
        return f"no live vantage ({', '.join(vantages)}): {previous.name} is kept"
    return f"no vantage has an opinion yet: {previous.name} is kept"
