"""Metrics as health (SPEC §10, Route 53's alarm-based checks).

A ``HealthSource`` with ``sourceType: METRIC`` is judged by a PromQL instant
query (``GET {prometheusUrl}/api/v1/query``) every ``intervalSec``: its one
number against ``unhealthyAbove`` (or ``unhealthyBelow``) makes the source
UNHEALTHY or HEALTHY, the reason naming the value ("error_ratio 0.071 >
0.05"), and the state travels up the graph as any source's does (the
graph's ``set_traffic``: a state judged outside it). So a region can fail
over on an SLO burn rate or on replication lag.

**When there is no number** - Prometheus unreachable, slow, an error, an
answer too large, no series, more than one - the source follows
``insufficientData``: HEALTHY, UNHEALTHY, or LAST_KNOWN (the default: the
last state stands, UNKNOWN before any), and the reason says why ("no data:
prometheus unreachable (ConnectError ...); last known kept").

Bounds: an answer is read up to 64 KiB, within min(10 s, intervalSec); redirects are
not followed; a URL naming a host by DNS name is resolved before every query and each
address checked against the address policy (SPEC §7), as a webhook's is.

Every node evaluates its METRIC sources itself (a read of Prometheus, no
write to the store): two nodes may disagree for less than an interval at a
threshold's crossing; the writer's records are the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from healthgate.controlplane.webhooks import DeliveryFailed, checked_target
from healthgate.health.states import HealthState, Record
from healthgate.model.addresses import AddressPolicy
from healthgate.model.change import WorldChange
from healthgate.model.names import ResourcePath
from healthgate.model.resources import HealthSource, MetricPolicy, Resource

log = logging.getLogger("healthgate.metric_sources")
# (httpx says every request at INFO: a query a second per source is no news)
logging.getLogger("httpx").setLevel(logging.WARNING)

MAX_ANSWER = 64 * 1024
MAX_TIMEOUT = 10.0


class NoData(Exception):
    """The query gave no one number; the message says why."""


def value_of(answer: Any) -> tuple[float, str]:
    """The one number of an instant query's answer, and the name of its
    series (NoData: why there is none)."""
    if not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error") if isinstance(answer, dict) else None
        raise NoData(f"the query failed: {str(error)[:200]}" if error else "not a query answer")
    data = answer.get("data")
    kind = data.get("resultType") if isinstance(data, dict) else None
    result = data.get("result") if isinstance(data, dict) else None
    sample: Any
    if kind == "scalar" and isinstance(result, list) and len(result) == 2:
        sample, name = result, ""
    elif kind == "vector" and isinstance(result, list):
        if not result:
            raise NoData("the query returned no series")
        if len(result) > 1:
            raise NoData(f"the query returned {len(result)} series: it must return one")
        series = result[0] if isinstance(result[0], dict) else {}
        sample = series.get("value")
        labels = series.get("metric")
        name = str(labels.get("__name__", ""))[:60] if isinstance(labels, dict) else ""
    else:
        raise NoData(
            f"the query returned a {str(kind)[:20]}: a number (scalar or one series) is needed"
        )
    try:
        value = float(sample[1])
    except (TypeError, ValueError, IndexError):
        raise NoData("the answer's sample is not a number") from None
    if math.isnan(value):
        raise NoData("the value is NaN")
    return value, name


def verdict(metric: MetricPolicy, value: float, name: str) -> tuple[HealthState, str]:
    shown = name or (metric.query if len(metric.query) <= 60 else metric.query[:57] + "...")
    if metric.unhealthy_above is not None:
        limit = metric.unhealthy_above
        if value > limit:
            return HealthState.UNHEALTHY, f"{shown} {value:g} > {limit:g} (unhealthyAbove)"
        return HealthState.HEALTHY, f"{shown} {value:g} <= {limit:g} (unhealthyAbove)"
    limit = metric.unhealthy_below if metric.unhealthy_below is not None else -math.inf
    if value < limit:
        return HealthState.UNHEALTHY, f"{shown} {value:g} < {limit:g} (unhealthyBelow)"
    return HealthState.HEALTHY, f"{shown} {value:g} >= {limit:g} (unhealthyBelow)"


class MetricSources:
    """The METRIC sources of the world, each evaluated on its interval."""

    def __init__(
        self,
        set_state: Callable[[float, str, HealthState, str], list[Record]],
        emit: Callable[[list[Record]], None],
        policy: AddressPolicy,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.set_state = set_state  # the engine's set_traffic
        self.emit = emit
        self.policy = policy
        self.clock = clock
        self._sources: dict[str, tuple[HealthSource, asyncio.Task[None]]] = {}
        self._last: dict[str, tuple[HealthState, str]] = {}
        self._client = httpx.AsyncClient(
            follow_redirects=False, limits=httpx.Limits(max_connections=20), trust_env=False
        )

    async def changed(self, change: WorldChange) -> None:
        """A control-plane change listener: start, restart or stop what it touched."""
        if not change.touches("healthSources"):
            return
        items: Mapping[ResourcePath, Resource] = change.world if change.whole else change.put
        paths = set(change.world) if change.whole else set(change.put) | change.deleted
        for path in paths:
            if path.collection != "healthSources":
                continue
            key = str(path)
            res = items.get(path) if path not in change.deleted else None
            running = self._sources.get(key)
            if running is not None and running[0] == res:
                continue
            if running is not None:
                running[1].cancel()
                del self._sources[key]
                self._last.pop(key, None)
            if isinstance(res, HealthSource) and res.metric is not None:
                task = asyncio.get_running_loop().create_task(
                    self._run(key, res), name=f"metric {key}"
                )
                self._sources[key] = (res, task)
        if change.whole:
            for key in [k for k in self._sources if ResourcePath.parse(k) not in change.world]:
                self._sources.pop(key)[1].cancel()

    async def _run(self, key: str, source: HealthSource) -> None:
        metric = source.metric
        assert metric is not None
        while True:
            started = time.monotonic()
            try:
                state, reason = await self.evaluate(key, metric)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop the others
                log.exception("metric source %s: evaluation failed", key)
            else:
                if state is not HealthState.UNKNOWN:
                    self._last[key] = (state, reason)
                self.emit(self.set_state(self.clock(), key, state, reason))
            await asyncio.sleep(max(0.0, metric.interval_sec - (time.monotonic() - started)))

    async def evaluate(self, key: str, metric: MetricPolicy) -> tuple[HealthState, str]:
        try:
            value, name = value_of(await self._query(metric))
        except NoData as exc:
            return self._insufficient(key, metric, str(exc))
        return verdict(metric, value, name)

    def _insufficient(self, key: str, metric: MetricPolicy, why: str) -> tuple[HealthState, str]:
        rule = metric.insufficient_data
        if rule == "LAST_KNOWN":
            last = self._last.get(key)
            state = last[0] if last is not None else HealthState.UNKNOWN
            return state, f"no data: {why}; last known kept (insufficientData LAST_KNOWN)"
        return HealthState[rule], f"no data: {why} (insufficientData {rule})"

    async def _query(self, metric: MetricPolicy) -> Any:
        """The answer of ``GET /api/v1/query``, bounded in size and time."""
        base = metric.prometheus_url.rstrip("/")
        timeout = min(MAX_TIMEOUT, float(metric.interval_sec))
        try:
            async with asyncio.timeout(timeout):
                url, host, sni = await checked_target(base + "/api/v1/query", self.policy)
                headers = {"Host": host} if host else {}
                request = self._client.build_request(
                    "GET", url, params={"query": metric.query}, headers=headers
                )
                if sni:
                    request.extensions["sni_hostname"] = sni
                response = await self._client.send(request, stream=True)
                try:
                    body = bytearray()
                    async for chunk in response.aiter_bytes():  # (decoded: bounded as read)
                        body += chunk
                        if len(body) > MAX_ANSWER:
                            raise NoData(f"an answer larger than {MAX_ANSWER // 1024} KiB")
                finally:
                    await response.aclose()
        except TimeoutError:
            raise NoData(f"prometheus gave no answer within {timeout:g} s") from None
        except DeliveryFailed as exc:
            raise NoData(f"prometheus unreachable ({exc})") from None
        except httpx.HTTPError as exc:
            raise NoData(f"prometheus unreachable ({type(exc).__name__}: {exc})"[:300]) from None
        if response.status_code != 200 and response.status_code not in (400, 422):
            raise NoData(f"prometheus answered HTTP {response.status_code}")
        try:
            return json.loads(bytes(body))
        except ValueError:
            raise NoData("prometheus's answer is not JSON") from None

    async def close(self) -> None:
        for _, task in self._sources.values():
            task.cancel()
        await asyncio.gather(*(t for _, t in self._sources.values()), return_exceptions=True)
        self._sources.clear()
        await self._client.aclose()
