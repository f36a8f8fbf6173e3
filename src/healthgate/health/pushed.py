"""Pushed health (SPEC §10, Consul's TTL checks): endpoints whose state is
what a client last reported, until its ``ttlSec`` runs out.

A backend service whose check is ``type: PUSH`` is never probed: the
endpoint table keeps its endpoints, and this part of it sets their states
from the stored reports (kind EndpointReport, one per endpoint, written by
``POST .../endpoints:report``). A report is a verdict - the thresholds do
not apply - taken at its own time; an endpoint with no report for
``ttlSec`` (since its last one, or since it was first placed: its
backend service made, the check made PUSH, this process started) is UNHEALTHY, "no
report since TIME", recorded at the moment the TTL ran out. Everything is a
function of the stored reports and the clock, so every cluster node finds
the same states and the same transition times, and a restart finds the
reports that are still within their TTL.

The work is the change's: a report touches its endpoint; a deadline waits
on a heap (stale entries skipped) until :meth:`Pushed.expire`.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Mapping
from typing import Protocol

from healthgate.health.states import HealthState, Record, timestamp
from healthgate.model.checks import EndpointReport
from healthgate.model.names import ResourcePath, parse_endpoint_name
from healthgate.model.resources import HealthCheck, Resource

EndpointKey = tuple[str, int | None]


class PushTable(Protocol):
    """What of the endpoint table this needs (health/endpoints.py)."""

    def push_slots(self, backend_service: ResourcePath) -> tuple[HealthCheck, Mapping[EndpointKey, int]] | None: ...  # fmt: skip

    def state(self, slot: int) -> HealthState: ...

    def push_state(
        self,
        now: float,
        slot: int,
        state: HealthState,
        reason: str,
        records: list[Record],
        flip: bool,
    ) -> None: ...


def _reason(r: EndpointReport) -> str:
    note = f": {r.note}" if r.note else ""
    return f"reported {r.state} at {timestamp(r.time)} by {r.actor}{note}"


class Pushed:
    def __init__(self, table: PushTable) -> None:
        self.table = table
        # backend service -> endpoint -> its last report; a report's path -> where it is
        self._reports: dict[ResourcePath, dict[EndpointKey, EndpointReport]] = {}
        self._where: dict[ResourcePath, tuple[ResourcePath, EndpointKey]] = {}
        # slot -> (what its deadline counts from, the deadline); deadlines on a heap
        self._base: dict[int, tuple[float, float]] = {}
        self._heap: list[tuple[float, int]] = []
        self._reasons: dict[int, str] = {}  # slot -> why it has its state (the last word)

    def sync(
        self,
        now: float,
        resources: Mapping[ResourcePath, Resource],
        changed: Collection[ResourcePath],
        rebuilt: Iterable[ResourcePath],
        records: list[Record],
    ) -> list[ResourcePath]:
        """Take the change's reports, and place the endpoints of the rebuilt
        PUSH backend services; returns the backend services whose endpoints
        a report changed (for the graph to re-evaluate)."""
        touched: dict[ResourcePath, set[EndpointKey]] = {}
        for p in changed:
            if p.collection != "endpointReports":
                continue
            old = self._where.pop(p, None)
            if old is not None:
                self._reports.get(old[0], {}).pop(old[1], None)
            r = resources.get(p)
            if not isinstance(r, EndpointReport):
                continue
            bs = ResourcePath(r.project, r.region, "backendServices", r.backend_service)
            key = parse_endpoint_name(r.endpoint)
            self._reports.setdefault(bs, {})[key] = r
            self._where[p] = (bs, key)
            touched.setdefault(bs, set()).add(key)
        for bs in rebuilt:
            found = self.table.push_slots(bs)
            if found is not None:
                for key, slot in found[1].items():
                    self._place(now, found[0], bs, key, slot, records)
        out = []
        for bs, keys in touched.items():
            found = self.table.push_slots(bs)
            if found is None:
                continue
            check, slots = found
            for key in keys:
                at = slots.get(key)
                if at is not None:
                    self._place(now, check, bs, key, at, records)
            out.append(bs)
        return out

    def _place(
        self,
        now: float,
        check: HealthCheck,
        bs: ResourcePath,
        key: EndpointKey,
        slot: int,
        records: list[Record],
    ) -> None:
        """An endpoint's state from its last report (if within the TTL), and
        its deadline: the report's time, or when it appeared, plus the TTL."""
        ttl = float(check.ttl_sec or 0)
        report = self._reports.get(bs, {}).get(key)
        previous = self._base.get(slot)
        if report is not None and (previous is None or report.time >= previous[0]):
            base = report.time
            if report.time + ttl > now:
                state = HealthState[report.state]
                self._reasons[slot] = why = _reason(report)
                self.table.push_state(report.time, slot, state, why, records, False)
        elif previous is not None:
            base = previous[0]
        else:
            base = now  # (never reported: from when it is first placed here)
        deadline = base + ttl
        if self._base.get(slot) != (base, deadline):
            self._base[slot] = (base, deadline)
            heapq.heappush(self._heap, (deadline, slot))
            if len(self._heap) > 4 * len(self._base) + 1024:  # (stale entries: compact)
                self._heap = [(d, s) for s, (_, d) in self._base.items()]
                heapq.heapify(self._heap)
        if deadline <= now:
            self._run_out(slot, records, False)

    def _run_out(self, slot: int, records: list[Record], flip: bool) -> None:
        base, deadline = self._base[slot]
        if self.table.state(slot) is not HealthState.UNHEALTHY:
            reason = f"no report since {timestamp(base)} (ttlSec {deadline - base:g})"
            self._reasons[slot] = reason
            self.table.push_state(deadline, slot, HealthState.UNHEALTHY, reason, records, flip)

    def next_expiry(self) -> float | None:
        """When the next endpoint's TTL runs out (None: none waits)."""
        heap = self._heap
        while heap:
            deadline, slot = heap[0]
            if self._base.get(slot, (0.0, None))[1] == deadline:
                return deadline
            heapq.heappop(heap)  # stale: reported again since, or gone
        return None

    def expire(self, now: float) -> list[Record]:
        """Every TTL run out by ``now``: UNHEALTHY, at the time it ran out."""
        records: list[Record] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, slot = heapq.heappop(heap)
            if self._base.get(slot, (0.0, None))[1] == deadline:
                self._run_out(slot, records, True)
        return records

    def reason(self, slot: int) -> str:
        """Why a pushed endpoint has its state: its last report, its TTL run
        out, or none yet."""
        found = self._reasons.get(slot)
        if found is not None:
            return found
        base = self._base.get(slot)
        until = f" (UNHEALTHY at {timestamp(base[1])} without one)" if base else ""
        return f"no report yet{until}"

    def forget(self, slot: int) -> None:
        """The endpoint is gone (its heap entry turns stale)."""
        self._base.pop(slot, None)
        self._reasons.pop(slot, None)
