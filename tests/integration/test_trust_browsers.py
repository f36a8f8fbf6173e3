"""SPEC §7 "Browsers", as an attacker's web page would try it (in-process
API over ASGI; the headers are the browser's): a foreign page may not drive
the loopback API, whatever its Origin, Host or Content-Type."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from healthgate.api.app import ApiSettings
from tests.helpers import example_world, run_async
from tests.inprocess import InProcessApi

MANIFEST = yaml.safe_dump_all(example_world()[:1])  # one health check
THE_CHECK = "/v1/projects/shop/regions/us-east1/healthChecks/http-8080"


def attempt(
    headers: dict[str, str],
    body: bytes | None = None,
    method: str = "POST",
    path: str = "/v1/apply",
    settings: ApiSettings | None = None,
) -> tuple[int, Any, int]:
    """(status, error body, then GET of the check's status)."""

    async def go() -> tuple[int, Any, int]:
        async with InProcessApi(settings=settings) as api:
            assert api.client is not None
            data = body if body is not None else json.dumps({"manifest": MANIFEST}).encode()
            r = await api.client.request(method, path, content=data, headers=headers)
            after = await api.client.get(THE_CHECK)
            return r.status_code, r.json() if r.content else None, after.status_code

    result: tuple[int, Any, int] = run_async(go())
    return result


@pytest.mark.parametrize(
    ("headers", "status", "says"),
    [
        # the experiment: a text/plain POST from a foreign page, on a rebound name
        (
            {"Content-Type": "text/plain", "Origin": "http://evil.test", "Host": "evil.test:7400"},
            403,
            "Host 'evil.test:7400' does not name this API",
        ),
        # DNS rebinding alone: the page's own name, same-origin to the browser
        (
            {
                "Content-Type": "application/json",
                "Origin": "http://evil.test:7400",
                "Host": "evil.test:7400",
            },
            403,
            "--allowed-host",
        ),
        # a foreign page sending to the real address: a cross-origin POST
        (
            {"Content-Type": "text/plain", "Origin": "http://evil.test"},
            403,
            "cross-origin requests are refused",
        ),
        # another local origin (a port of this machine) is foreign too
        (
            {"Content-Type": "application/json", "Origin": "http://127.0.0.1:8080"},
            403,
            "cross-origin",
        ),
        ({"Content-Type": "application/json", "Origin": "null"}, 403, "cross-origin"),
        # no Origin, but a content type a page can send without a preflight
        ({"Content-Type": "text/plain"}, 415, "application/json or application/yaml"),
        (
            {"Content-Type": "application/x-www-form-urlencoded"},
            415,
            "application/json or application/yaml",
        ),
        ({}, 415, "no Content-Type"),
    ],
)
def test_a_foreign_page_cannot_apply_a_manifest(
    headers: dict[str, str], status: int, says: str
) -> None:
    code, body, after = attempt(headers)
    assert code == status, body
    assert says in body["error"]["message"], body
    assert after == 404  # nothing was applied


@pytest.mark.parametrize(
    "headers",
    [
        {"Content-Type": "application/json"},  # the CLI, curl, scripts: no Origin
        {"Content-Type": "application/json; charset=utf-8", "Origin": "http://127.0.0.1:7400"},
        {"Content-Type": "application/json", "Host": "localhost:7400"},
    ],
)
def test_clients_and_the_apis_own_pages_still_apply(headers: dict[str, str]) -> None:
    code, body, after = attempt(headers)
    assert code == 200, body
    assert after == 200


def test_a_yaml_body_is_a_manifest_and_an_allowed_name_may_be_the_host() -> None:
    headers = {
        "Content-Type": "application/yaml",
        "Host": "healthgate.internal:7400",
        "Origin": "http://healthgate.internal:7400",
    }
    refused, _, _ = attempt(headers, MANIFEST.encode())
    assert refused == 403
    settings = ApiSettings(allowed_hosts=("healthgate.internal",))
    code, body, after = attempt(headers, MANIFEST.encode(), settings=settings)
    assert code == 200, body
    assert after == 200


def test_reads_from_a_foreign_page_are_refused_too() -> None:
    """A rebound page that could read the answers would read the topology."""
    code, body, _ = attempt(
        {"Host": "evil.test:7400", "Origin": "http://evil.test:7400"},
        method="GET",
        path="/v1/projects/shop/topology",
    )
    assert code == 403, body
