"""Kind ``PracticeRun`` (SPEC §11): failover exercised on purpose, on a schedule.

A practice run is global, per project::

    kind: PracticeRun
    name: weekly-us
    project: web
    awayFrom: us-east1                  # as a shift: a region, a PSC NEG or attachment path
    durationSec: 900                    # 60-7200
    comment: "weekly failover practice"
    schedule:                           # optional (without it: POST .../practiceRuns/N:start only)
      weekdays: [TUE, THU]              #   default every day
      startUtc: "10:00"
      windowMin: 60                     #   it may still begin this long after startUtc (60)
    outcomeChecks:                      # up to 10; the run is cancelled when one breaches
      - type: FRONTEND_ERRORS           #   a front end's errors over a window
        frontend: shop-frontend
        maxErrorPercent: 5
        windowSec: 60                   #   (60; 10-600)
        minimumRequests: 20             #   (20) fewer hops than this judge nothing
      - type: COMPOSITE_UNHEALTHY       #   a composite (or a PSC NEG, its state) turns UNHEALTHY
        composite: regions/europe-west1/compositeHealthChecks/web
      - type: URL                       #   a URL that must answer 2xx
        url: https://status.internal/ok
        intervalSec: 10
        timeoutSec: 5
        failuresToBreach: 2
    blockedWindows:                     # up to 20: never start a run that would overlap one
      - {start: "2026-12-24T00:00:00Z", end: "2026-12-27T00:00:00Z"}
      - {weekdays: [FRI], startUtc: "16:00", durationMin: 960}

A run is a shift (SPEC §6) by the actor ``practice-run/NAME``: it obeys the
safety rule, and traffic returns when it ends. What decides when a run
starts, whether it may, and when it is cancelled is health/practice.py;
who acts is controlplane/practice.py.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from healthgate.model.names import ResourcePath, brief, is_valid_name
from healthgate.model.resource import Model, Resource
from healthgate.model.webhooks import MAX_URL, checked_url, one_line

DURATION_MIN, DURATION_MAX = 60, 7200
MAX_CHECKS = 10
MAX_BLOCKED = 20
WEEKDAYS = ("MON", "TUE", "WED", "THU", "FRI", "SAT", "SUN")  # (datetime.weekday() order)
Weekday = Literal["MON", "TUE", "WED", "THU", "FRI", "SAT", "SUN"]
HHMM_RE = re.compile(r"([01][0-9]|2[0-3]):([0-5][0-9])")
ACTOR_PREFIX = "practice-run/"


def checked_away_from(value: str) -> str:
    """A region name, or the full path of a PSC NEG or a service attachment
    (what a shift moves traffic away from), in its one spelling."""
    if is_valid_name(value):
        return value
    try:
        path = ResourcePath.parse(value)
    except ValueError:
        path = None
    if path is None or path.collection not in ("networkEndpointGroups", "serviceAttachments"):
        raise ValueError(
            "expected a region name, or the full path of a PSC network endpoint group or "
            f"a service attachment; got {brief(value)}"
        )
    return str(path)


def minutes_of(hhmm: str) -> int:
    """``"10:30"`` -> 630 (validated by the models below)."""
    hours, minutes = hhmm.split(":")
    return int(hours) * 60 + int(minutes)


def _check_hhmm(value: str) -> str:
    if not HHMM_RE.fullmatch(value):
        raise ValueError(
            f"expected a time of day in UTC as HH:MM (00:00-23:59), got {brief(value)}"
        )
    return value


def _check_weekdays(value: list[Weekday]) -> list[Weekday]:
    if len(set(value)) != len(value):
        raise ValueError("a weekday is listed twice")
    return value


class Schedule(Model):
    """Weekly: on these days (every day when none is listed), at ``startUtc``;
    a run may still begin up to ``windowMin`` later (a serve that was down,
    a cluster without a writer then) - never twice in one window."""

    weekdays: list[Weekday] = Field(default_factory=list, max_length=7)
    start_utc: str
    window_min: int = Field(60, ge=1, le=1440)

    _weekdays = field_validator("weekdays")(_check_weekdays)
    _start = field_validator("start_utc")(_check_hhmm)


class BlockedWindow(Model):
    """When no run may be under way: once (``start``, ``end``: RFC 3339
    times) or every week (``weekdays``, ``startUtc``, ``durationMin``)."""

    start: str | None = None
    end: str | None = None
    weekdays: list[Weekday] = Field(default_factory=list, max_length=7)
    start_utc: str | None = None
    duration_min: int | None = Field(None, ge=1, le=10080)

    _weekdays = field_validator("weekdays")(_check_weekdays)

    @field_validator("start", "end")
    @classmethod
    def _check_time(cls, value: str | None) -> str | None:
        if value is not None:
            epoch_of(value)
        return value

    @field_validator("start_utc")
    @classmethod
    def _check_start_utc(cls, value: str | None) -> str | None:
        return None if value is None else _check_hhmm(value)

    @model_validator(mode="after")
    def _check_shape(self) -> Self:
        once = self.start is not None or self.end is not None
        weekly = self.start_utc is not None or self.duration_min is not None or self.weekdays
        if once == bool(weekly):
            raise ValueError(
                "give either start and end (once), or startUtc and durationMin (weekly, "
                "optionally on weekdays)"
            )
        if once:
            if self.start is None or self.end is None:
                raise ValueError("a window given once needs both start and end")
            if epoch_of(self.end) <= epoch_of(self.start):
                raise ValueError("end: must be after start")
        elif self.start_utc is None or self.duration_min is None:
            raise ValueError("a weekly window needs both startUtc and durationMin")
        return self

    @property
    def once(self) -> tuple[float, float] | None:
        if self.start is None or self.end is None:
            return None
        return epoch_of(self.start), epoch_of(self.end)


CheckType = Literal["FRONTEND_ERRORS", "COMPOSITE_UNHEALTHY", "URL"]
_FIELDS: dict[str, tuple[str, ...]] = {
    # the fields each type takes (besides type and name)
    "FRONTEND_ERRORS": ("frontend", "max_error_percent", "window_sec", "minimum_requests"),
    "COMPOSITE_UNHEALTHY": ("composite", "neg"),
    "URL": ("url", "interval_sec", "timeout_sec", "failures_to_breach"),
}
_WIRE = {
    "frontend": "frontend",
    "max_error_percent": "maxErrorPercent",
    "window_sec": "windowSec",
    "minimum_requests": "minimumRequests",
    "composite": "composite",
    "neg": "neg",
    "url": "url",
    "interval_sec": "intervalSec",
    "timeout_sec": "timeoutSec",
    "failures_to_breach": "failuresToBreach",
}


class OutcomeCheck(Model):
    """One thing that must stay true while a run is under way; the run is
    cancelled the moment it does not (health/practice.py judges it)."""

    type: CheckType
    name: str | None = Field(None, max_length=63)
    # FRONTEND_ERRORS: a consumer front end (a global forwarding rule) of the project
    frontend: str | None = Field(None, min_length=1, max_length=300)
    max_error_percent: float | None = Field(None, ge=0, le=100)
    window_sec: int | None = Field(None, ge=10, le=600)
    minimum_requests: int | None = Field(None, ge=1, le=1_000_000)
    # COMPOSITE_UNHEALTHY: a composite health check, or a PSC NEG (its composite's state)
    composite: str | None = Field(None, min_length=1, max_length=300)
    neg: str | None = Field(None, min_length=1, max_length=300)
    # URL: must answer 2xx
    url: str | None = Field(None, min_length=1, max_length=MAX_URL)
    interval_sec: int | None = Field(None, ge=5, le=300)
    timeout_sec: int | None = Field(None, ge=1, le=60)
    failures_to_breach: int | None = Field(None, ge=1, le=10)

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        return None if value is None else checked_url(value)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str | None) -> str | None:
        return None if value is None else one_line(value)

    @model_validator(mode="after")
    def _check_fields(self) -> Self:
        own = _FIELDS[self.type]
        for attr, wire in _WIRE.items():
            if attr not in own and getattr(self, attr) is not None:
                raise ValueError(f"{wire}: not a field of a {self.type} check")
        if self.type == "FRONTEND_ERRORS":
            if self.frontend is None or self.max_error_percent is None:
                raise ValueError("a FRONTEND_ERRORS check needs frontend and maxErrorPercent")
        elif self.type == "COMPOSITE_UNHEALTHY":
            if (self.composite is None) == (self.neg is None):
                raise ValueError("a COMPOSITE_UNHEALTHY check names exactly one composite or neg")
        elif self.url is None:
            raise ValueError("a URL check needs url")
        return self

    # the defaults, where the type has the field
    @property
    def window(self) -> int:
        return self.window_sec or 60

    @property
    def minimum(self) -> int:
        return self.minimum_requests or 20

    @property
    def interval(self) -> int:
        return self.interval_sec or 10

    @property
    def timeout(self) -> int:
        return self.timeout_sec or 5

    @property
    def failures(self) -> int:
        return self.failures_to_breach or 1

    def label(self, index: int) -> str:
        return self.name or f"outcomeChecks[{index}] ({self.type})"


class PracticeRun(Resource):
    kind: Literal["PracticeRun"]
    away_from: str = Field(min_length=1, max_length=300)
    duration_sec: int = Field(ge=DURATION_MIN, le=DURATION_MAX)
    comment: str = Field("practice run", min_length=1, max_length=500)
    enabled: bool = True  # (off: the schedule waits; :start still starts one)
    schedule: Schedule | None = None
    outcome_checks: list[OutcomeCheck] = Field(default_factory=list, max_length=MAX_CHECKS)
    blocked_windows: list[BlockedWindow] = Field(default_factory=list, max_length=MAX_BLOCKED)

    SCOPES = frozenset({"global"})
    REFS = (
        ("frontend_refs", "outcomeChecks", "forwardingRules"),
        ("composite_refs", "outcomeChecks", "compositeHealthChecks"),
        ("neg_refs", "outcomeChecks", "networkEndpointGroups"),
    )

    @field_validator("away_from")
    @classmethod
    def _check_away_from(cls, value: str) -> str:
        return checked_away_from(value)

    @field_validator("comment")
    @classmethod
    def _check_comment(cls, value: str) -> str:
        return one_line(value, "one line of text: no control characters")

    @property
    def actor(self) -> str:
        """Whom the run's shift names (SPEC §11)."""
        return ACTOR_PREFIX + self.name

    def _pairs(self, attr: str, wire: str) -> list[tuple[str, str]]:
        return [
            (f"outcomeChecks[{i}].{wire}", value)
            for i, c in enumerate(self.outcome_checks)
            if (value := getattr(c, attr)) is not None
        ]

    @property
    def frontend_refs(self) -> list[tuple[str, str]]:
        return self._pairs("frontend", "frontend")

    @property
    def composite_refs(self) -> list[tuple[str, str]]:
        return self._pairs("composite", "composite")

    @property
    def neg_refs(self) -> list[tuple[str, str]]:
        return self._pairs("neg", "neg")


def epoch_of(text: str) -> float:
    """An RFC 3339 time with its offset (``2026-12-24T00:00:00Z``) in epoch seconds."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"expected an RFC 3339 time such as 2026-12-24T00:00:00Z, got {brief(text)}"
        ) from None
    if when.tzinfo is None:
        raise ValueError(f"a time needs its offset (Z for UTC), got {brief(text)}")
    value = when.timestamp()
    if not math.isfinite(value) or not 0 < value < 4_102_444_800:
        raise ValueError(f"expected a time between 1970 and 2100, got {brief(text)}")
    return value
