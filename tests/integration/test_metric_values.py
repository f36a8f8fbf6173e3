"""A METRIC source's number from Prometheus's answer, and its verdict
(SPEC §10): every shape of answer, tabled; the query's bounds against real
servers on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from healthgate.controlplane.metric_sources import MetricSources, NoData, value_of, verdict
from healthgate.health.states import HealthState
from healthgate.model.addresses import AddressPolicy
from healthgate.model.resources import MetricPolicy
from tests.helpers import run_async
from tests.integration.servers import Server


def vector(*samples: tuple[dict[str, str], str]) -> dict[str, Any]:
    result = [{"metric": m, "value": [1.8e9, v]} for m, v in samples]
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


ANSWERS: list[tuple[str, Any, float | str]] = [
    ("one series", vector(({"__name__": "error_ratio"}, "0.071")), 0.071),
    ("a scalar", {"status": "success", "data": {"resultType": "scalar", "result": [1.8e9, "3"]}}, 3.0),
    ("an expression's series (no name)", vector(({"job": "app"}, "12")), 12.0),
    ("no series", vector(), "no series"),
    ("two series", vector(({}, "1"), ({}, "2")), "2 series"),
    ("NaN", vector(({}, "NaN")), "NaN"),
    ("not a number", vector(({}, "lots")), "not a number"),
    ("an error", {"status": "error", "error": "parse error at char 3"}, "parse error"),
    ("a matrix", {"status": "success", "data": {"resultType": "matrix", "result": []}}, "matrix"),
    ("a string", "hello", "not a query answer"),
    ("no data field", {"status": "success"}, "a None"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "answer", "expected"), ANSWERS, ids=[a[0] for a in ANSWERS])
def test_the_number_of_an_answer(case: str, answer: Any, expected: float | str) -> None:
    if isinstance(expected, float):
        assert value_of(answer)[0] == expected
    else:
        with pytest.raises(NoData, match=expected):
            value_of(answer)


def policy(**kw: Any) -> MetricPolicy:
    return MetricPolicy.model_validate(
        {"prometheusUrl": "http://127.0.0.1:9090", "query": "error_ratio", **kw}
    )


@pytest.mark.parametrize(
    ("kw", "value", "state", "reason"),
    [
        ({"unhealthyAbove": 0.05}, 0.071, HealthState.UNHEALTHY, "error_ratio 0.071 > 0.05 (unhealthyAbove)"),
        ({"unhealthyAbove": 0.05}, 0.05, HealthState.HEALTHY, "error_ratio 0.05 <= 0.05 (unhealthyAbove)"),
        ({"unhealthyBelow": 3}, 2, HealthState.UNHEALTHY, "error_ratio 2 < 3 (unhealthyBelow)"),
        ({"unhealthyBelow": 3}, 3, HealthState.HEALTHY, "error_ratio 3 >= 3 (unhealthyBelow)"),
    ],
)  # fmt: skip
def test_verdicts(kw: dict[str, Any], value: float, state: HealthState, reason: str) -> None:
    assert verdict(policy(**kw), value, "error_ratio") == (state, reason)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({}, "exactly one"),
        ({"unhealthyAbove": 1, "unhealthyBelow": 0}, "exactly one"),
        ({"unhealthyAbove": "inf"}, "finite"),
        ({"unhealthyAbove": 1, "prometheusUrl": "ftp://x"}, "http://"),
        ({"unhealthyAbove": 1, "intervalSec": 0}, "greater than or equal to 1"),
        ({"unhealthyAbove": 1, "query": "a\x00b"}, "control characters"),
    ],
)
def test_a_bad_metric_policy_says_why(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        policy(**kw)


def sources() -> MetricSources:
    return MetricSources(lambda *a: [], lambda r: None, AddressPolicy())


def evaluate_against(handler: Any, **kw: Any) -> tuple[HealthState, str]:
    async def go() -> tuple[HealthState, str]:
        ms = sources()
        try:
            async with Server(handler) as srv:
                metric = policy(
                    prometheusUrl=f"http://127.0.0.1:{srv.port}", unhealthyAbove=1, **kw
                )
                return await ms.evaluate("src", metric)
        finally:
            await ms.close()

    out: tuple[HealthState, str] = run_async(go())
    return out


def answering(body: bytes, delay: float = 0.0) -> Any:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(delay)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 65536):
            writer.write(body[i : i + 65536])
            await writer.drain()
        writer.close()

    return handler


def test_an_answer_too_large_is_no_data() -> None:
    state, reason = evaluate_against(
        answering(b"[" + b"1," * 100_000 + b"1]"), insufficientData="UNHEALTHY"
    )
    assert state is HealthState.UNHEALTHY and "larger than 64 KiB" in reason


def test_a_slow_prometheus_is_no_data_within_the_interval() -> None:
    state, reason = evaluate_against(
        answering(b"{}", delay=5), intervalSec=1, insufficientData="HEALTHY"
    )
    assert state is HealthState.HEALTHY and "no answer within 1 s" in reason


def test_an_answer_that_is_no_json_is_no_data() -> None:
    state, reason = evaluate_against(answering(b"<html>"))
    assert state is HealthState.UNKNOWN and "not JSON" in reason and "LAST_KNOWN" in reason
