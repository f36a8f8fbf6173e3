"""Builders shared by the tests: worlds as plain dicts, turned into resources."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from healthgate.health.engine import HealthEngine
from healthgate.health.states import Outcome, ProbeResult, Record
from healthgate.model.resources import Resource
from healthgate.model.rules import validate_documents
from healthgate.model.validation import (
    Document,
    InvalidResources,
    Issue,
    parse_resource,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "two-regions.yaml"

OK = ProbeResult(Outcome.OK, 0.01, 200)
TIMEOUT = ProbeResult(Outcome.TIMEOUT, 3.0)
REFUSED = ProbeResult(Outcome.REFUSED, 0.0)


def example_dicts() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]


def find(
    dicts: list[dict[str, Any]],
    kind: str,
    name: str,
    region: str | None = None,
    project: str | None = None,
) -> dict[str, Any]:
    for d in dicts:
        if (
            d["kind"] == kind
            and d["name"] == name
            and (region is None or d.get("region") == region)
            and (project is None or d["project"] == project)
        ):
            return d
    raise KeyError((kind, name, region))


def documents(dicts: Iterable[dict[str, Any]]) -> list[Document]:
    docs, issues = [], []
    for i, d in enumerate(dicts, 1):
        res, problems = parse_resource(copy.deepcopy(d), i)
        issues.extend(problems)
        if res is not None:
            docs.append(Document(res, i))
    if issues:
        raise InvalidResources(issues)
    return docs


def issues_of(dicts: Iterable[dict[str, Any]], warnings: bool = False) -> list[Issue]:
    """Every error, field-level or cross-resource (with ``warnings``: only the warnings)."""
    try:
        docs = documents(dicts)
    except InvalidResources as exc:
        return [] if warnings else exc.issues
    return [i for i in validate_documents(docs) if i.warning is warnings]


def resources(dicts: Iterable[dict[str, Any]]) -> list[Resource]:
    docs = documents(dicts)
    problems = [i for i in validate_documents(docs) if not i.warning]
    assert not problems, problems
    return [d.resource for d in docs]


def feed(
    engine: HealthEngine, now: float, result: ProbeResult, ip_prefix: str = "", times: int = 1
) -> list[Record]:
    """Give every endpoint whose address starts with ip_prefix the same result."""
    out: list[Record] = []
    targets = [t for t in engine.targets() if t.ip.startswith(ip_prefix)]
    for _ in range(times):
        for t in targets:
            out.extend(engine.on_result(now, t.slot, result))
    return out


def non_endpoint(records: Iterable[Record]) -> list[Record]:
    return [r for r in records if r.kind != "Endpoint"]


def run_async(coro: Any, timeout: float = 60.0) -> Any:
    """Run a coroutine on a fresh uvloop event loop, bounded in time."""
    import asyncio

    import uvloop

    async def bounded() -> Any:
        async with asyncio.timeout(timeout):
            return await coro

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(bounded())


def example_world(
    producer: str = "shop",
    consumer: str = "web",
    port: int | None = None,
    fast: bool = False,
    listen_port: int | None = None,
) -> list[dict[str, Any]]:
    """The shared example moved into the given projects. With ``port`` the
    endpoints and checks use it (and ``/``); with ``fast`` checks run every
    second with thresholds of 2, so end-to-end tests take seconds. With
    ``listen_port`` the forwarding rules listen on it and the next two ports
    (several worlds in one store must not share a listen address)."""
    out = []
    next_port = iter(range(listen_port or 0, (listen_port or 0) + 3))
    for original in example_dicts():
        d = copy.deepcopy(original)
        d["project"] = producer if d["project"] == "shop" else consumer
        if "pscTargetService" in d:
            d["pscTargetService"] = d["pscTargetService"].replace(
                "projects/shop/", f"projects/{producer}/"
            )
        if d["kind"] == "ServiceAttachment" and d.get("consumerAcceptLists"):
            d["consumerAcceptLists"] = [{"projectIdOrNum": consumer}]
        if d["kind"] == "HealthCheck" and port is not None:
            d.update(port=port, requestPath="/")
        if d["kind"] == "HealthCheck" and fast:
            d.update(checkIntervalSec=1, timeoutSec=1, healthyThreshold=2, unhealthyThreshold=2)
        if d["kind"] == "ForwardingRule" and listen_port is not None:
            if "ports" in d:
                d["ports"] = [next(next_port)]
            else:
                d["portRange"] = str(next(next_port))
        if d["kind"] == "NetworkEndpointGroup" and "endpoints" in d and port is not None:
            for ep in d["endpoints"]:
                ep["port"] = port
        out.append(d)
    return out


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``healthgate ARGS`` as a user runs it: a process of its own, bounded in time."""
    return subprocess.run(
        [sys.executable, "-m", "healthgate", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
