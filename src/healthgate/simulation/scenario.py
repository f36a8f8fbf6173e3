"""The scenario format of ``healthgate simulate``.

A scenario is a YAML mapping::

    duration: 120          # virtual seconds to simulate
    responseTime: 0.01     # how long a healthy endpoint takes to answer (s)
    start: unknown         # or "healthy": endpoints begin already HEALTHY
    events:
      - at: 30             # virtual time, seconds
        select: {project: shop, region: us-east1}
        fault: hang        # hang | refuse | reset | heal
      - at: 40
        select: {endpoint: 127.0.2.1}
        status: 503        # answer HTTP 503 (TCP checks still pass; a status in
                           # the check's degradedStatusCodes is a degraded success)
      - at: 50
        select: {backendService: web, region: europe-west1, count: 1}
        latency: 2.5       # answer after 2.5 s (a timeout if >= timeoutSec)
      - at: 90
        select: {region: us-east1}
        fault: heal

Real traffic (SPEC §8) is scripted too: ``traffic.requestsPerSecond`` is
what each consumer front end carries; each virtual second it goes where the
front end's route sends it - its shares, then the region's HEALTHY endpoints
that are not ejected - and an endpoint fails the fraction of it that an
``errorRate`` event set (``errorKind``: the status or error it fails with,
500 by default; a ``heal`` ends it too)::

    traffic: {requestsPerSecond: 200}
    events:
      - at: 30
        select: {region: us-east1}
        errorRate: 1.0        # every real request fails; the probes still pass

so outlier detection and TRAFFIC health sources are rehearsed in virtual
time. ``stormHoldPercent`` / ``stormHoldWindowSec`` are serve's
``--storm-hold-percent`` / ``--storm-hold-window``.

Practice runs (SPEC §11) of the manifest run as serve runs them: on their
schedule (virtual time 0 is ``startTime``, an RFC 3339 time; 1970-01-01
without one), or started by an event; URL outcome checks answer 200 unless
an event says otherwise; FRONTEND_ERRORS checks read the scripted traffic::

    startTime: "2026-12-08T09:59:00Z"
    events:
      - at: 30
        practice: weekly-us   # POST .../practiceRuns/weekly-us:start
      - at: 45
        url: https://status.internal/ok
        status: 503           # what that URL check sees from then on

``select`` narrows the endpoints by ``project``, ``region``,
``backendService`` and ``group`` (names), ``endpoint`` (``ip`` or
``ip:port``); ``count`` keeps only the first N in address order. An empty
``select`` means every endpoint. A probe's outcome is decided when the probe
starts, from the fault in force at that instant.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from healthgate.model.practice import epoch_of
from healthgate.model.resources import Model


class Selector(Model):
    project: str | None = None
    region: str | None = None
    backend_service: str | None = None
    group: str | None = None
    endpoint: str | None = None
    count: int | None = Field(None, ge=1)


class ScenarioEvent(Model):
    at: float = Field(ge=0)
    select: Selector = Field(default_factory=Selector)
    fault: Literal["hang", "refuse", "reset", "heal"] | None = None
    status: int | None = Field(None, ge=100, le=599)
    latency: float | None = Field(None, ge=0)
    # the fraction of real requests that fail (SPEC §8), and with what
    error_rate: float | None = Field(None, ge=0, le=1)
    error_kind: str = Field("500", pattern=r"^(5[0-9][0-9]|timeout|reset|refused|connect-timeout)$")
    # a practice run started by hand (SPEC §11), by name
    practice: str | None = Field(None, min_length=1, max_length=63)
    # with ``status``: what a practice run's URL check of this URL sees from now on
    url: str | None = Field(None, min_length=1, max_length=2048)

    @model_validator(mode="after")
    def _one_effect(self) -> Self:
        if self.url is not None:
            if (
                self.status is None
                or self.fault
                or self.latency
                or self.error_rate
                or self.practice
            ):
                raise ValueError("url: give it with status alone (what the URL answers)")
            return self
        effects = (self.fault, self.status, self.latency, self.error_rate, self.practice)
        given = [x for x in effects if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of fault, status, latency, errorRate or practice")
        return self


class Traffic(Model):
    requests_per_second: float = Field(0.0, ge=0, le=1_000_000)


class Scenario(Model):
    duration: float = Field(gt=0, le=7 * 24 * 3600)
    response_time: float = Field(0.01, ge=0)
    start: Literal["unknown", "healthy"] = "unknown"
    events: list[ScenarioEvent] = Field(default_factory=list, max_length=10_000)
    traffic: Traffic = Field(default_factory=Traffic)
    storm_hold_percent: float = Field(0.0, ge=0, le=100)
    storm_hold_window_sec: float = Field(30.0, ge=1, le=3600)
    # the wall-clock time of virtual second 0 (practice runs' schedules)
    start_time: str | None = None

    @field_validator("start_time")
    @classmethod
    def _check_start_time(cls, value: str | None) -> str | None:
        if value is not None:
            epoch_of(value)
        return value

    @property
    def epoch(self) -> float:
        return epoch_of(self.start_time) if self.start_time else 0.0
