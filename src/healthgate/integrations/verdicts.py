"""The answers other data planes get, derived from the engine (pure).

* **A forwarding rule's health** (``.../forwardingRules/{name}/healthz``):
  200 when the composite delivered to the rule is HEALTHY or DEGRADED (SPEC
  §9: working, impaired - the body says ``"state": "DEGRADED"``), 503
  otherwise (UNHEALTHY, UNKNOWN - not yet known, or in DRY_RUN - or no
  composite at all), with the state and the reason. A load balancer that health-checks
  this URL takes a region out exactly when healthgate would.
* **A PSC NEG's agent answer** (HAProxy's agent-check):

  ============================================  =======
  the NEG                                       answer
  ============================================  =======
  HEALTHY, or UNKNOWN (UNKNOWN never fails      ``up``
  over, SPEC §2.3)
  DEGRADED (SPEC §9) while no route sends it    ``drain``
  traffic (another region is HEALTHY)
  DEGRADED, and a route sends it traffic        ``up``
  (nothing HEALTHY is left)
  UNHEALTHY                                     ``down``
  UNHEALTHY, but the route of a front end that  ``up``
  uses it keeps it under FAIL_OPEN (every
  region is down: traffic stays on the first)
  its connection was not accepted by the        ``maint``
  attachment (no traffic may flow), or no such
  NEG
  ============================================  =======

  A NEG of a route that splits its traffic (``trafficDial``, SPEC §6) is
  answered with a weight: ``up 70%`` (its share) or ``up 0%`` (no share).

  HAProxy then sends traffic to the first server (in the exported failover
  order) that is up, and back to a preferred one as soon as it is up again
  (failback). ``failoverPolicy.failback: false`` has no HAProxy equivalent
  per server; it is documented in docs/integrations.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from healthgate.health.engine import HealthEngine
from healthgate.health.states import HealthState, RouteMode


@dataclass(frozen=True, slots=True)
class RuleHealth:
    code: int  # 200 or 503
    state: str
    reason: str
    since: float | None


def forwarding_rule_health(engine: HealthEngine, rule: str) -> RuleHealth:
    dest = engine.destination_state(rule)
    if dest is None:
        return RuleHealth(
            503, "UNKNOWN", "no composite health check has this rule as destination", None
        )
    code = 200 if dest.state in (HealthState.HEALTHY, HealthState.DEGRADED) else 503
    return RuleHealth(code, dest.state.name, dest.reason, dest.since)


def agent_answer(engine: HealthEngine, neg: str) -> str:
    accepted = engine.neg_accepted(neg)
    if not accepted:
        return "maint"
    status = engine.node_status(neg)
    # HAProxy's drain takes no new traffic: only while healthgate's own routes
    # send a DEGRADED NEG none (one with nothing HEALTHY left keeps its
    # traffic, and a drained one in HAProxy would not)
    if status is not None and status.state is HealthState.DEGRADED and not _routed(engine, neg):
        return "drain"
    if status is None or status.state is not HealthState.UNHEALTHY:
        return "up" + _weight(engine, neg)
    for route in engine.route_table().routes.values():
        if route.target == neg and route.mode is RouteMode.FAIL_OPEN:
            return "up"
    return "down"


def _routed(engine: HealthEngine, neg: str) -> bool:
    """Does a front end's route send this NEG new traffic (its target, or a share)?"""
    return any(
        route.target == neg or any(s.neg == neg for s in route.shares)
        for route in engine.route_table().routes.values()
    )


def _weight(engine: HealthEngine, neg: str) -> str:
    """`` P%`` for a NEG of a route that splits its traffic (SPEC §6): its
    share, or 0 when it takes none (a dial of 0, a third region); HAProxy
    sets the server's weight to that percentage of the exported ``weight``.
    Nothing for a NEG of an unsplit route."""
    for frontend, route in engine.route_table().routes.items():
        if not route.split:
            continue
        for share in route.shares:
            if share.neg == neg:
                return f" {max(1, round(share.percent))}%"
        if any(c.path == neg for c, _ in engine.failover_order(frontend)):
            return " 0%"
    return ""
