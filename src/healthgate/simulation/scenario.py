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

``select`` narrows the endpoints by ``project``, ``region``,
``backendService`` and ``group`` (names), ``endpoint`` (``ip`` or
``ip:port``); ``count`` keeps only the first N in address order. An empty
``select`` means every endpoint. A probe's outcome is decided when the probe
starts, from the fault in force at that instant.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

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

    @model_validator(mode="after")
    def _one_effect(self) -> Self:
        effects = (self.fault, self.status, self.latency, self.error_rate)
        given = [x for x in effects if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of fault, status, latency or errorRate")
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
