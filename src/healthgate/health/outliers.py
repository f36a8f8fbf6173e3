"""Outlier detection (SPEC §8): endpoints ejected from real traffic by what
healthgate's own listeners saw of them - pure, in virtual time.

Per producer backend service with ``outlierDetection``, once a second, the
detector is given each endpoint's hops of that second
(:class:`~healthgate.health.evidence.Hops`) and says which endpoints are
ejected and which return. Three detections, each off at 0:

* **consecutive errors**: a run of ``consecutiveErrors`` errors in a row
  (any error: 5xx, timeout, reset, refused);
* **consecutive gateway errors**: a run of ``consecutiveGatewayErrors``
  gateway errors in a row (502, 503, 504, refused; a 500 ends such a run,
  as in Envoy);
* **failure percentage**: at the end of each ``intervalSec``, an endpoint
  that carried at least ``failurePercentageMinimumRequests`` in it and
  failed ``failurePercentageThreshold`` % or more of them.

A detection ejects the endpoint with probability ``enforcingPercent`` %
(0: it is only recorded, as DETECTED), unless the NEG (or instance group)
already has as many endpoints ejected as ``maxEjectionPercent`` allows -
that percentage of its endpoints rounded down, but always one when the
percentage is above 0 (then it is recorded as DETECTED too, with why). A
run is acted upon once: the next consecutive-errors detection of the same
endpoint not ejected waits for a success in between; an ejected one's runs
start again from nothing (dataplane/counters.py ``reset_runs``), so after
its return a new run ejects it again.

An ejected endpoint gets no new connections or requests for
``baseEjectionTimeSec`` x (the times it was ejected in a row), capped at
``maxEjectionTimeSec``; then it returns. That count falls by one for each
``intervalSec`` without an ejection of it. Ejection never changes the probe
state; it counts as UNHEALTHY for the aggregation policy only with
``countAsUnhealthy`` (the engine's business: health/endpoints.py).

Every ejection, return and detection not acted upon is a decision with the
figures that caused it ("5 consecutive errors: 503, 503, reset, 503, 503"),
which the engine makes a record of kind Ejection.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from healthgate.health.evidence import Hops, kinds_text
from healthgate.model.resources import OutlierDetection

EndpointKey = tuple[str, int | None]


class EjectionPhase(StrEnum):
    EJECTED = "EJECTED"
    RETURNED = "RETURNED"
    DETECTED = "DETECTED"  # a detection not acted upon (enforcingPercent, maxEjectionPercent)


@dataclass(frozen=True, slots=True)
class Decision:
    """What the detector decided of one endpoint, and why."""

    endpoint: EndpointKey
    phase: EjectionPhase
    reason: str
    until: float | None = None  # EJECTED: when it returns
    ejections: int = 0  # the times ejected in a row (this one included)
    detection: str = ""  # "consecutiveErrors", "consecutiveGatewayErrors", "failurePercentage"


class _Endpoint:
    __slots__ = ("armed", "armed_gateway", "count", "ejected_in_interval", "group", "until")

    def __init__(self, group: str) -> None:
        self.group = group
        self.until: float | None = None  # ejected until (None: not ejected)
        self.count = 0  # times ejected in a row (falls by one per quiet interval)
        self.ejected_in_interval = False
        self.armed = True  # a consecutive-errors detection may fire (reset by a success)
        self.armed_gateway = True


class _Tally:
    """An endpoint's hops in the interval so far."""

    __slots__ = ("errors", "kinds", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.kinds: dict[str, int] = {}


class BackendOutliers:
    """The detector of one backend service (see the module doc)."""

    def __init__(
        self,
        policy: OutlierDetection,
        groups: Mapping[str, Sequence[EndpointKey]],
        now: float,
        chance: Callable[[], float] = random.random,
    ) -> None:
        self.policy = policy
        self.chance = chance  # [0, 1): the enforcingPercent draw
        self.endpoints: dict[EndpointKey, _Endpoint] = {}
        self.group_sizes: dict[str, int] = {}
        self.interval_start = now
        self._interval: dict[EndpointKey, _Tally] = {}  # this interval's hops so far
        self.regroup(groups)

    def regroup(self, groups: Mapping[str, Sequence[EndpointKey]]) -> None:
        """The NEGs (groups) and their endpoints, now; an endpoint's state is
        kept while it stays, dropped when it goes."""
        seen: dict[EndpointKey, str] = {}
        sizes: dict[str, int] = {}
        for group, keys in groups.items():
            for key in keys:
                if key not in seen:
                    seen[key] = group
                    sizes[group] = sizes.get(group, 0) + 1
        kept = {}
        for key, group in seen.items():
            ep = self.endpoints.get(key) or _Endpoint(group)
            ep.group = group
            kept[key] = ep
        self.endpoints = kept
        self.group_sizes = sizes
        self._interval = {k: v for k, v in self._interval.items() if k in kept}

    # ------------------------------------------------------------------ queries

    def ejected(self) -> dict[EndpointKey, float]:
        """Endpoint -> when it returns, of those ejected now."""
        return {k: ep.until for k, ep in self.endpoints.items() if ep.until is not None}

    def allowed(self, group: str) -> int:
        """How many of a group's endpoints may be ejected at once."""
        pct = self.policy.max_ejection_percent
        if pct <= 0:
            return 0
        return max(1, math.floor(self.group_sizes.get(group, 0) * pct / 100))

    def _ejected_in(self, group: str) -> int:
        return sum(
            1 for ep in self.endpoints.values() if ep.group == group and ep.until is not None
        )

    # ------------------------------------------------------------------ a second

    def observe(self, now: float, hops: Mapping[EndpointKey, Hops]) -> list[Decision]:
        """One second: returns that are due, then the detections of ``hops``
        (each endpoint's hops of that second), then - at an interval's end -
        the failure percentages and the fall of the ejection counts."""
        p = self.policy
        out: list[Decision] = []
        for key, back in self.endpoints.items():
            if back.until is not None and now >= back.until:
                ep = back
                ep.until = None
                ep.armed = ep.armed_gateway = True  # (its runs started again at the ejection)
                out.append(
                    Decision(
                        key,
                        EjectionPhase.RETURNED,
                        f"ejection time over (ejected {ep.count} time(s) in a row): "
                        "takes traffic again",
                        ejections=ep.count,
                    )
                )
        for key, h in hops.items():
            found = self.endpoints.get(key)
            if found is None:
                continue
            ep = found
            tally = self._interval.get(key)
            if tally is None:
                tally = self._interval[key] = _Tally()
            tally.requests += h.total
            tally.errors += h.errors
            kinds = tally.kinds
            for kind, n in h.kinds.items():
                kinds[kind] = kinds.get(kind, 0) + n
            if ep.until is not None:
                continue  # (hops still in flight when it was ejected)
            if h.served:
                ep.armed = ep.armed_gateway = True
            if p.consecutive_errors and ep.armed and h.peak >= p.consecutive_errors:
                ep.armed = False
                reason = f"{h.peak} consecutive errors: {', '.join(h.peak_kinds)}"
                out.append(self._detected(now, key, ep, reason, "consecutiveErrors"))
            elif (
                p.consecutive_gateway_errors
                and ep.armed_gateway
                and h.peak_gateway >= p.consecutive_gateway_errors
            ):
                ep.armed_gateway = False
                reason = f"{h.peak_gateway} consecutive gateway errors (502, 503, 504, refused)"
                out.append(self._detected(now, key, ep, reason, "consecutiveGatewayErrors"))
        if now - self.interval_start >= p.interval_sec:
            out += self._interval_end(now)
        return out

    def _interval_end(self, now: float) -> list[Decision]:
        p = self.policy
        out: list[Decision] = []
        if p.failure_percentage_threshold:
            for key, tally in sorted(self._interval.items(), key=lambda kv: str(kv[0])):
                total, errors, kinds = tally.requests, tally.errors, tally.kinds
                ep = self.endpoints.get(key)
                if (
                    ep is None
                    or ep.until is not None
                    or total < p.failure_percentage_minimum_requests
                ):
                    continue
                if 100 * errors >= p.failure_percentage_threshold * total:
                    reason = (
                        f"{errors} of {total} requests failed ({100 * errors / total:.1f} %) in "
                        f"{p.interval_sec} s (failurePercentageThreshold "
                        f"{p.failure_percentage_threshold}): {kinds_text(kinds)}"
                    )
                    out.append(self._detected(now, key, ep, reason, "failurePercentage"))
        for ep in self.endpoints.values():
            if ep.until is None and ep.count > 0 and not ep.ejected_in_interval:
                ep.count -= 1
            ep.ejected_in_interval = False
        self._interval = {}
        # (intervals keep their phase: a late second does not shift them)
        elapsed = now - self.interval_start
        self.interval_start += p.interval_sec * math.floor(elapsed / p.interval_sec)
        return out

    def _detected(
        self, now: float, key: EndpointKey, ep: _Endpoint, reason: str, detection: str
    ) -> Decision:
        p = self.policy
        if p.enforcing_percent < 100 and not self.chance() * 100 < p.enforcing_percent:
            return Decision(
                key,
                EjectionPhase.DETECTED,
                f"{reason} - not ejected: enforcingPercent {p.enforcing_percent}",
                detection=detection,
            )
        allowed = self.allowed(ep.group)
        held = self._ejected_in(ep.group)
        if held >= allowed:
            return Decision(
                key,
                EjectionPhase.DETECTED,
                f"{reason} - not ejected: maxEjectionPercent {p.max_ejection_percent} allows "
                f"{allowed} of the group's {self.group_sizes.get(ep.group, 0)} endpoints "
                f"at once ({held} ejected)",
                detection=detection,
            )
        ep.count += 1
        ep.ejected_in_interval = True
        ep.armed = ep.armed_gateway = True  # (the data plane restarts its runs: reset_runs)
        seconds = min(p.base_ejection_time_sec * ep.count, p.max_ejection_time_sec)
        ep.until = now + seconds
        return Decision(
            key,
            EjectionPhase.EJECTED,
            f"{reason}; ejected for {seconds} s (ejection {ep.count} in a row)",
            until=ep.until,
            ejections=ep.count,
            detection=detection,
        )
