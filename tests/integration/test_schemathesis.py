"""Property-based API testing from the OpenAPI document: no input gets a 5xx.

Bounded: a handful of examples per operation, against a server of its own.
The event stream is left out (it never ends by design; it is tested in
test_api.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.integration.serve_proc import ServeProcess


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with ServeProcess(tmp_path_factory.mktemp("fuzz") / "hg.db") as proc:
        yield proc


def test_no_input_causes_a_server_error(fuzz_server: ServeProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    checked = 0
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]
        if operation.path.endswith("/events/stream"):
            continue

        @given(case=operation.as_strategy())
        @settings(
            max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def check(case: Any) -> None:
            response = case.call(timeout=10)
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:500]}"
            )
            ctype = str(
                response.headers.get("content-type", [""])[0]
                if isinstance(response.headers.get("content-type"), list)
                else response.headers.get("content-type", "")
            )
            if response.status_code >= 400 and ctype.startswith("application/json"):
                body = response.json()
                assert set(body) == {"error"} and {"code", "status", "message", "details"} <= set(
                    body["error"]
                )

        check()
        checked += 1
    assert checked >= 15  # every resource, health, events, apply, delete and operations route
