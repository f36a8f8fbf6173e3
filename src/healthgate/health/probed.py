"""A prober's table: the threshold machine of the endpoints it is given.

Where a probe result becomes an endpoint's flip for a prober that is not the
serving engine - a probe worker (controlplane/probe_workers.py) - is this
table. It is given endpoints, never the world: each backend service's check
(and the values of the secrets it reads) and the endpoint paths of its
share, as they come and go. It holds them in an
:class:`~healthgate.health.endpoints.EndpointTable` - the same threshold
machine, the same per-result fast path and the same resume as the serving
engine's - with nothing above it (no graph, no resources): what it costs is
its share's endpoints, not the world's.

Pure: no clock (every call takes ``now``), no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from healthgate.health.endpoints import EndpointTable
from healthgate.health.states import HealthState, Record, RecordKind, Transition
from healthgate.health.types import ApplyResult, EndpointKey
from healthgate.model.names import ResourcePath, parse_endpoint_name, split_endpoint_path
from healthgate.model.resources import HealthCheck

# a backend service's check and the values of the secrets it reads, by path
CheckOf = tuple[HealthCheck, Mapping[ResourcePath, str]]


class ProbedTable:
    """The endpoints one prober probes, and their threshold states."""

    def __init__(self) -> None:
        self.table = EndpointTable()
        self._checks: dict[ResourcePath, CheckOf] = {}
        self._paths: dict[str, ResourcePath] = {}  # a backend service's path text, parsed once

    def change(
        self,
        now: float,
        checks: Mapping[ResourcePath, CheckOf],
        put: Iterable[str],
        gone: Iterable[str],
    ) -> ApplyResult:
        """Probe the endpoints ``put`` (paths; one already here keeps its
        state), stop those ``gone`` (first: a path in both is probed), under
        ``checks`` - each backend service's check, given when it is new to
        this table or changed. The targets added, changed (probed anew: the
        check changed) and removed, with their slots. ValueError (naming the
        path) for an endpoint path that does not parse, or of a backend
        service whose check was never given; nothing is changed then."""
        edits: dict[ResourcePath, tuple[list[EndpointKey], list[EndpointKey]]] = {}
        for path in gone:
            bs, key = self._split(path)
            edits.setdefault(bs, ([], []))[1].append(key)
        for path in put:
            bs, key = self._split(path)
            if bs not in checks and bs not in self._checks:
                raise ValueError(f"{path}: no health check given for its backend service")
            edits.setdefault(bs, ([], []))[0].append(key)
        for bs in checks:
            edits.setdefault(bs, ([], []))
        self._checks.update(checks)
        result = ApplyResult()
        table = self.table
        for bs, (added, removed) in edits.items():
            given = self._checks.get(bs)
            desired = dict.fromkeys(table.keys(bs))
            for key in removed:
                desired.pop(key, None)
            desired.update(dict.fromkeys(added))
            if given is None or not desired:
                table.drop(bs, result)
                self._checks.pop(bs, None)
                self._paths.pop(bs.text, None)
                continue
            table.place(now, bs, given[0], given[1], desired, result)
        return result

    def _split(self, path: str) -> tuple[ResourcePath, EndpointKey]:
        text, name = split_endpoint_path(path)
        try:
            bs = self._paths.get(text)
            if bs is None:
                bs = self._paths[text] = ResourcePath.parse(text)
            return bs, parse_endpoint_name(name)
        except ValueError as exc:
            raise ValueError(f"{path!r} is not an endpoint path: {exc}") from None

    def resume(self, now: float, slot: int, state: HealthState, since: float) -> None:
        """Go on from a state decided elsewhere (a worker started again, a
        share moved to this prober): not from UNKNOWN, and no flip said."""
        if state is HealthState.UNKNOWN:
            self.table.set_state(now, slot, state, "assigned")
        else:
            self.table.set_state(since, slot, state, "resumed")

    def checks(self) -> Mapping[ResourcePath, CheckOf]:
        return self._checks

    def endpoint_path(self, slot: int) -> str:
        return self.table.endpoint_path(slot)

    def slot_of_path(self, path: str) -> int | None:
        return self.table.slot_of_path(path)

    def endpoint_count(self) -> int:
        return self.table.endpoint_count()


def flips(records: Iterable[Record]) -> Iterable[Transition]:
    """The endpoint flips among a table's records."""
    for r in records:
        if isinstance(r, Transition) and r.kind is RecordKind.ENDPOINT:
            yield r
