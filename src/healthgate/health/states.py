"""States, probe results and the records the engine emits."""

from __future__ import annotations

import errno
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import IntEnum, StrEnum
from typing import Any, Final, NamedTuple, Protocol


class HealthState(IntEnum):
    UNKNOWN = 0
    HEALTHY = 1
    UNHEALTHY = 2
    # SPEC §9: working but impaired - successes, some answered with one of
    # the check's degradedStatusCodes. Eligible, but after every HEALTHY one.
    DEGRADED = 3

    def __str__(self) -> str:
        return self.name


class RecordKind(StrEnum):
    """What a record of the transition log is about."""

    ENDPOINT = "Endpoint"
    HEALTH_SOURCE = "HealthSource"
    COMPOSITE = "CompositeHealthCheck"
    NEG = "NetworkEndpointGroup"
    ROUTE = "Route"
    CHANGE = "Change"  # a write accepted through the API: who changed what (not the engine's)
    RAMP = "Ramp"  # a ramped failback started, ended or was abandoned (SPEC §6)
    EJECTION = "Ejection"  # an endpoint ejected from real traffic, or back (SPEC §8)
    HOLD = "Hold"  # route changes held in a failover storm, or released (SPEC §8)
    PRACTICE = "PracticeRun"  # a practice run started, completed, was cancelled or skipped (§11)
    CONVERGENCE = "Convergence"  # a data plane has not applied a route decision in time (§11)


class RouteMode(StrEnum):
    """How a consumer front end routes: to a healthy-enough NEG (normal),
    to the first NEG although every one is UNHEALTHY (fail-open), nowhere
    (fail-closed), or nothing to route to (none)."""

    NORMAL = "normal"
    FAIL_OPEN = "fail-open"
    FAIL_CLOSED = "fail-closed"
    NONE = "none"


class Outcome(IntEnum):
    """What one probe saw. Every failure is a value, never an exception.

    Code that runs per probe names the members it needs as module globals
    (``_OK = Outcome.OK``): ``Outcome.OK`` is a lookup through the enum's
    metaclass, ~100 ns on these machines against ~10 ns for a global."""

    OK = 0
    TIMEOUT = 1
    REFUSED = 2
    RESET = 3
    STATUS = 4  # an HTTP status outside expectedStatusCodes, or gRPC not SERVING
    TLS = 5
    MALFORMED = 6
    ERROR = 7  # any other socket error
    # taken while the prober itself lagged, or not taken at all (the prober
    # had no file descriptor left): counts as no result at all
    SUSPECT = 8
    NOT_CHECKED = 9  # health check disabled
    CONTENT = 10  # the body lacked responseContains
    INVERTED = 11  # an inverted check's probe succeeded: a failure
    DEGRADED = 12  # a success answered with one of degradedStatusCodes (SPEC §9)


class ProbeResult(NamedTuple):
    """One probe's result. A named tuple, not a frozen dataclass: one is made
    per probe, and building a frozen dataclass costs twice as much (each
    field goes through ``object.__setattr__``)."""

    outcome: Outcome
    latency: float = 0.0  # seconds from probe start to result
    status: int = 0  # HTTP status, when there was one
    detail: str = ""

    def describe(self) -> str:
        ms = f"{self.latency * 1000:.0f} ms"
        match self.outcome:
            case Outcome.OK:
                if self.detail:  # (an inverted check's failed probe)
                    return f"{self.detail}, in {ms}"
                return f"HTTP {self.status} in {ms}" if self.status else f"success in {ms}"
            case Outcome.DEGRADED:
                return f"HTTP {self.status} (in degradedStatusCodes) in {ms}"
            case Outcome.CONTENT:
                return f"HTTP {self.status}, {self.detail}"
            case Outcome.INVERTED:
                return f"{self.detail} (the check is inverted: a success is a failure)"
            case Outcome.TIMEOUT:
                return f"timeout after {self.latency:g} s"
            case Outcome.REFUSED:
                return "connection refused"
            case Outcome.RESET:
                return "connection reset"
            case Outcome.STATUS:
                return f"HTTP {self.status}" + (f" ({self.detail})" if self.detail else "")
            case Outcome.TLS:
                return "TLS handshake failed" + (f": {self.detail}" if self.detail else "")
            case Outcome.MALFORMED:
                return "malformed response" + (f": {self.detail}" if self.detail else "")
            case Outcome.SUSPECT:
                return f"no result: {self.detail or 'the prober was overloaded'}"
            case Outcome.NOT_CHECKED:
                return "not checked (health check disabled)"
            case _:
                return "error" + (f": {self.detail}" if self.detail else "")


# A steady success as a 16-byte record - key (an endpoint slot), HTTP status
# (0 for TCP), latency - made by the lane (probes/lane.py) in C, and taken into
# an endpoint table and an outcome history without a ProbeResult per check
# (EndpointTable.on_steady, OutcomeHistory.steady).
STEADY: Final = struct.Struct("=iHxxd")


def steady_results(records: bytes) -> list[tuple[int, ProbeResult]]:
    """Steady records as (key, result): the Python path's view of them."""
    return [(k, ProbeResult(Outcome.OK, lat, st)) for k, st, lat in STEADY.iter_unpack(records)]


def pack_steady(results: Iterable[tuple[int, int, float]]) -> bytes:
    """(key, status, latency) as steady records."""
    return b"".join(STEADY.pack(k, st, lat) for k, st, lat in results)


# the detail of a probe the prober could not make for want of a descriptor (EMFILE)
NO_DESCRIPTOR = "the prober had no file descriptor left (its open-file limit)"
_OWN_LIMITS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def inverted(result: ProbeResult) -> ProbeResult:
    """An inverted check's view of a probe: success and failure swap (no
    result stays no result)."""
    outcome = result.outcome
    if outcome is Outcome.SUSPECT or outcome is Outcome.NOT_CHECKED:
        return result
    if outcome is Outcome.OK:
        return ProbeResult(Outcome.INVERTED, result.latency, result.status, result.describe())
    return ProbeResult(Outcome.OK, result.latency, 0, f"inverted: {result.describe()}")


def local_failure(exc: OSError, latency: float) -> ProbeResult | None:
    """A probe that failed for want of the prober's own resources (file
    descriptors, buffers): no result at all, never a failure of the
    endpoint - a prober out of descriptors must not fail a region over.
    None when the error is not one of those."""
    if exc.errno in _OWN_LIMITS:
        return ProbeResult(Outcome.SUSPECT, latency, 0, NO_DESCRIPTOR)
    return None


def timestamp(t: float) -> str:
    """An engine time (epoch seconds) as ISO 8601, to the millisecond, UTC."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class Transition:
    """One state change of an endpoint, health source, composite or PSC NEG."""

    time: float
    project: str
    region: str
    kind: RecordKind  # (not ROUTE: that is a RouteChange)
    name: str
    path: str
    previous: HealthState
    current: HealthState
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return _head(
            self,
            self.kind,
            self.name,
            self.path,
            self.current.name,
            self.reason,
            region=self.region,
            previous=self.previous.name,
        )


@dataclass(frozen=True, slots=True)
class RouteChange:
    """A consumer front end starts sending new traffic somewhere else."""

    time: float
    project: str
    frontend: str  # forwarding rule path
    previous: str | None  # NEG path
    current: str | None
    mode: RouteMode
    reason: str
    kind: RecordKind = field(default=RecordKind.ROUTE)
    # (neg, region, percent) when new traffic is split (SPEC §6); else empty
    shares: tuple[tuple[str, str, float], ...] = ()
    generation: int = 0  # the decision's (SPEC §11: convergence receipts)

    def to_dict(self) -> dict[str, Any]:
        # the same keys as a Transition's (one shape for every record, in the
        # API and in the log), plus the route's own
        out = _head(
            self,
            self.kind,
            self.frontend.rsplit("/", 1)[-1],
            self.frontend,
            self.current,
            self.reason,
            previous=self.previous,
        ) | {
            "frontend": self.frontend,
            "mode": self.mode,
        }
        if self.shares:
            out["shares"] = [{"neg": n, "region": r, "percent": p} for n, r, p in self.shares]
        if self.generation:
            out["generation"] = self.generation
        return out


@dataclass(frozen=True, slots=True)
class ShiftEnded:
    """A shift that ran out (health/shifts.py): a Change record at its
    ``expireTime`` - every node of a cluster computes the same one, and the
    elected writer stores it once."""

    time: float
    project: str
    name: str
    path: str  # the shift's
    away_from: str
    actor: str
    comment: str

    kind = RecordKind.CHANGE

    def to_dict(self) -> dict[str, Any]:
        return _head(
            self,
            RecordKind.CHANGE.value,
            "shift-end",
            self.path,
            "shift-end",
            f"shift {self.name} away from {self.away_from} expired "
            f"(set by {self.actor}: {self.comment})",
        ) | {
            "actor": self.actor,
            "action": "shift-end",
            "resources": [self.path],
            "resourceCount": 1,
        }


ERROR_WINDOW = 10.0  # s: what failbackMaxErrorPercent counts over (SPEC §6)
ERROR_MINIMUM = 20  # requests or connections in that window before it may abandon


class RampPhase(StrEnum):
    STARTED = "STARTED"
    ENDED = "ENDED"
    ABANDONED = "ABANDONED"


@dataclass(frozen=True, slots=True)
class RampChange:
    """A consumer front end's ramped failback (SPEC §6) of one NEG started
    (it is eligible again: its share grows from 0), ended (full share), or
    was abandoned (UNHEALTHY or shifted away again). Logged at these three
    moments only, never per step; ``ramps`` is every ramp of the front end
    in progress after it (NEG path, start time): what a restart resumes."""

    time: float
    project: str
    frontend: str
    neg: str
    phase: RampPhase
    seconds: int  # failbackRampSec
    start: float
    reason: str
    ramps: tuple[tuple[str, float], ...] = ()
    # an abandonment by the error gate: (requests or connections, failed) in its window
    errors: tuple[int, int] | None = None
    # this node's own (cluster mode): its data plane's traffic abandoned the
    # ramp, the other nodes' may not have - not a record every node computes
    local: bool = False

    kind = RecordKind.RAMP

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _head(
            self,
            RecordKind.RAMP.value,
            self.frontend.rsplit("/", 1)[-1],
            self.frontend,
            self.phase.value,
            self.reason,
        ) | {
            "frontend": self.frontend,
            "neg": self.neg,
            "rampSec": self.seconds,
            "start": self.start,
            "ramps": [{"neg": n, "start": t} for n, t in self.ramps],
        }
        if self.errors is not None:
            total, failed = self.errors
            out["errors"] = {
                "requests": total,
                "failed": failed,
                "percent": round(100 * failed / total, 2) if total else 0.0,
                "windowSec": ERROR_WINDOW,
            }
        if self.local:
            out["local"] = True
        return out


@dataclass(frozen=True, slots=True)
class Ejection:
    """An endpoint ejected from real traffic by outlier detection, returned,
    or detected and not ejected (health/outliers.py). This node's own: each
    data plane ejects by the traffic it carried (``local``)."""

    time: float
    project: str
    region: str
    backend_service: str  # its path
    endpoint: str  # its name (ip:port)
    path: str  # the endpoint's path
    phase: str  # EJECTED, RETURNED, DETECTED
    reason: str
    until: float | None = None  # EJECTED: when it returns
    ejections: int = 0  # times ejected in a row
    detection: str = ""
    local: bool = True

    kind = RecordKind.EJECTION

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _head(
            self,
            RecordKind.EJECTION.value,
            self.endpoint,
            self.path,
            self.phase,
            self.reason,
            region=self.region,
        ) | {
            "backendService": self.backend_service,
            "ejections": self.ejections,
        }
        if self.until is not None:
            out["ejectedUntil"] = timestamp(self.until)
        if self.detection:
            out["detection"] = self.detection
        if self.local:
            out["local"] = True
        return out


class HoldPhase(StrEnum):
    HELD = "HELD"
    LIFTED = "LIFTED"  # fewer than the percentage are UNHEALTHY again
    RELEASED = "RELEASED"  # an admin released it


@dataclass(frozen=True, slots=True)
class Hold:
    """Route changes held in a failover storm (SPEC §8), or let go again."""

    time: float
    hold_id: str
    phase: HoldPhase
    reason: str
    regions: tuple[str, ...] = ()
    unhealthy: int = 0  # endpoints that turned UNHEALTHY within the window
    probed: int = 0  # every endpoint probed
    held: tuple[str, ...] = ()  # the front ends whose routes stayed
    actor: str = ""
    since: float = 0.0  # the storm's first turn to UNHEALTHY: routes are held as they were then
    project: str = ""  # (one record per project with a consumer front end: its log has it)

    kind = RecordKind.HOLD

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _head(
            self,
            RecordKind.HOLD.value,
            self.hold_id,
            f"holds/{self.hold_id}",
            self.phase.value,
            self.reason,
        ) | {
            "regions": list(self.regions),
            "unhealthy": self.unhealthy,
            "probed": self.probed,
            "held": list(self.held),
            "stormSince": timestamp(self.since) if self.since else None,
        }
        if self.actor:
            out["actor"] = self.actor
        return out


class PracticePhase(StrEnum):
    STARTED = "STARTED"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"  # an outcome check breached, or its shift was ended by hand
    SKIPPED = "SKIPPED"  # due (or asked for) and not started: an incident, a blocked window


@dataclass(frozen=True, slots=True)
class PracticeRecord:
    """A practice run (SPEC §11, health/practice.py) started, completed,
    was cancelled or skipped - written by the elected writer alone."""

    time: float
    project: str
    name: str  # the run's
    path: str  # the run's
    phase: PracticePhase
    reason: str
    away_from: str = ""
    shift: str = ""  # the run's shift (its path), when there was one
    until: float | None = None  # when the shift was to end
    window: float | None = None  # the scheduled window it was started (or skipped) in
    check: str = ""  # CANCELLED by this outcome check

    kind = RecordKind.PRACTICE

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _head(
            self,
            RecordKind.PRACTICE.value,
            self.name,
            self.path,
            self.phase.value,
            self.reason,
        ) | {
            "awayFrom": self.away_from,
        }
        if self.shift:
            out["shift"] = self.shift
        if self.until is not None:
            out["until"] = timestamp(self.until)
        if self.window is not None:
            out["window"] = timestamp(self.window)
        if self.check:
            out["check"] = self.check
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PracticeRecord | None:
        """A record read back from the log (None: not one of these)."""
        try:
            return cls(
                time=float(d["time"]),
                project=str(d["project"]),
                name=str(d["name"]),
                path=str(d["path"]),
                phase=PracticePhase(d["to"]),
                reason=str(d.get("reason", "")),
                away_from=str(d.get("awayFrom", "")),
                shift=str(d.get("shift", "")),
                until=_epoch(d.get("until")),
                window=_epoch(d.get("window")),
                check=str(d.get("check", "")),
            )
        except (KeyError, TypeError, ValueError):
            return None


class ConvergencePhase(StrEnum):
    LAGGING = "LAGGING"  # a data plane has not applied a decision within --convergence-alert-sec
    CAUGHT_UP = "CAUGHT_UP"  # ... and has now


@dataclass(frozen=True, slots=True)
class ConvergenceRecord:
    """A data plane late to apply a route decision, or caught up since
    (SPEC §11, health/convergence.py) - this node's own."""

    time: float
    project: str
    frontend: str
    phase: ConvergencePhase
    data_plane: str
    instance: str
    generation: int
    decided: float  # the decision's time
    reason: str
    node: str = ""  # (cluster mode: the node whose data plane it is)

    kind = RecordKind.CONVERGENCE

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _head(
            self,
            RecordKind.CONVERGENCE.value,
            self.frontend.rsplit("/", 1)[-1],
            self.frontend,
            self.phase.value,
            self.reason,
        ) | {
            "frontend": self.frontend,
            "dataPlane": self.data_plane,
            "instance": self.instance,
            "generation": self.generation,
            "decidedAt": timestamp(self.decided),
            "local": True,
        }
        if self.node:
            out["node"] = self.node
        return out


class _Record(Protocol):
    @property
    def time(self) -> float: ...
    @property
    def project(self) -> str: ...


def _head(
    record: _Record,
    kind: str,
    name: str,
    path: str,
    to: str | None,
    reason: str,
    *,
    region: str = "global",
    previous: str | None = None,
) -> dict[str, Any]:
    """The keys every record has, in the API and in the log, in one order
    (a Transition's; the others add their own after them)."""
    return {
        "time": record.time,
        "timestamp": timestamp(record.time),
        "project": record.project,
        "region": region,
        "kind": kind,
        "name": name,
        "path": path,
        "from": previous,
        "to": to,
        "reason": reason,
    }


def _epoch(text: object) -> float | None:
    if not isinstance(text, str):
        return None
    return datetime.fromisoformat(text).timestamp()


Record = (
    Transition
    | RouteChange
    | ShiftEnded
    | RampChange
    | Ejection
    | Hold
    | PracticeRecord
    | ConvergenceRecord
)
