"""``healthgate demo``: a whole multi-region stack on this machine, in one process.

Three regions of real HTTP backends on loopback (127.0.1.x, 127.0.2.x,
127.0.3.x) that say which region and endpoint answered; a producer project
publishing the service in each region (policy, source, composite, forwarding
rule, attachment); a consumer project with a PSC NEG per region and one global
front end; and a small load generator sending requests through the front end.
It runs the same ``serve`` code path on a temporary SQLite store, and Ctrl-C
stops everything and removes the store.

Break things with ``healthgate demo break REGION --mode hang|refuse|503`` and
``healthgate demo heal REGION`` (or POST /v1/demo/...): transitions appear on
the terminal and the load generator's counts show traffic moving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from fastapi import FastAPI
from pydantic import BaseModel, Field

from healthgate.api.errors import error_response
from healthgate.runtime.regions import MODES, RegionBackends
from healthgate.runtime.server import Server, ServeSettings

log = logging.getLogger("healthgate.demo")

REGIONS = (("us-east1", 1), ("europe-west1", 2), ("asia-east1", 3))
ENDPOINTS_PER_REGION = 3


@dataclass(frozen=True, slots=True)
class DemoSettings:
    listen: str = "127.0.0.1:7400"
    front_port: int = 8088
    backend_port: int = 8080
    producer_port: int = 9080
    rate: float = 20.0  # load-generator requests per second


def demo_manifest(s: DemoSettings) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    backends = []
    for region, n in REGIONS:
        base = {"project": "shop", "region": region}
        docs += [
            {
                **base,
                "kind": "HealthCheck",
                "name": "http",
                "type": "HTTP",
                "port": s.backend_port,
                "requestPath": "/healthz",
                "checkIntervalSec": 1,
                "timeoutSec": 1,
                "healthyThreshold": 2,
                "unhealthyThreshold": 2,
            },
            {
                **base,
                "kind": "NetworkEndpointGroup",
                "name": "web-neg",
                "networkEndpointType": "GCE_VM_IP_PORT",
                "endpoints": [
                    {"ipAddress": f"127.0.{n}.{i}", "port": s.backend_port}
                    for i in range(1, ENDPOINTS_PER_REGION + 1)
                ],
            },
            {
                **base,
                "kind": "BackendService",
                "name": "web",
                "loadBalancingScheme": "INTERNAL_MANAGED",
                "protocol": "HTTP",
                "healthChecks": ["http"],
                "backends": [{"group": "web-neg"}],
            },
            {
                **base,
                "kind": "HealthAggregationPolicy",
                "name": "majority",
                "healthyPercentThreshold": 60,
                "minHealthyThreshold": 2,
            },
            {
                **base,
                "kind": "HealthSource",
                "name": "web-source",
                "sources": ["web"],
                "healthAggregationPolicy": "majority",
            },
            {
                **base,
                "kind": "ForwardingRule",
                "name": "web-fr",
                "IPAddress": f"127.0.{n}.100",
                "ports": [s.producer_port],
                "loadBalancingScheme": "INTERNAL_MANAGED",
                "backendService": "web",
            },
            {
                **base,
                "kind": "CompositeHealthCheck",
                "name": "web-composite",
                "healthSources": ["web-source"],
                "healthDestination": "web-fr",
            },
            {
                **base,
                "kind": "ServiceAttachment",
                "name": "web-attachment",
                "targetService": "web-fr",
                "connectionPreference": "ACCEPT_MANUAL",
                "consumerAcceptLists": [{"projectIdOrNum": "web"}],
            },
            {
                "project": "web",
                "region": region,
                "kind": "NetworkEndpointGroup",
                "name": f"shop-{region}",
                "networkEndpointType": "PRIVATE_SERVICE_CONNECT",
                "pscTargetService": f"projects/shop/regions/{region}/serviceAttachments/web-attachment",
            },
        ]
        backends.append({"group": f"regions/{region}/networkEndpointGroups/shop-{region}"})
    docs += [
        {
            "project": "web",
            "kind": "BackendService",
            "name": "shop",
            "loadBalancingScheme": "EXTERNAL_MANAGED",
            "protocol": "HTTP",
            "backends": backends,
            "failoverPolicy": {"failback": True, "whenAllUnhealthy": "FAIL_OPEN"},
        },
        {
            "project": "web",
            "kind": "ForwardingRule",
            "name": "shop-frontend",
            "IPAddress": "127.0.0.1",
            "portRange": str(s.front_port),
            "loadBalancingScheme": "EXTERNAL_MANAGED",
            "backendService": "shop",
            "dataPlaneRegion": "us-east1",
        },
    ]
    return docs


class LoadGenerator:
    """GET requests through the front end at a steady rate; counts answers by region."""

    def __init__(self, port: int, rate: float) -> None:
        self.port = port
        self.interval = 1.0 / rate
        self.by_region: dict[str, int] = {}
        self.errors = 0
        self.window: list[tuple[float, str]] = []

    async def run(self) -> None:
        reader: asyncio.StreamReader | None = None
        writer: asyncio.StreamWriter | None = None
        while True:
            await asyncio.sleep(self.interval)
            try:
                if writer is None or writer.is_closing():
                    reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                assert reader is not None
                writer.write(b"GET / HTTP/1.1\r\nHost: demo\r\nUser-Agent: healthgate-demo\r\n\r\n")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                length = next(
                    (
                        int(h.split(b":")[1])
                        for h in head.split(b"\r\n")
                        if h.lower().startswith(b"content-length")
                    ),
                    0,
                )
                body = (await reader.readexactly(length)).decode(errors="replace")
                status = int(head[9:12])
                region = (
                    body.split(" ")[0].removeprefix("region=")
                    if status == 200
                    else f"error {status}"
                )
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
                region = "error"
                if writer is not None:
                    writer.close()
                writer = None
            if region.startswith("error"):
                self.errors += 1
            self.by_region[region] = self.by_region.get(region, 0) + 1
            now = time.monotonic()
            self.window.append((now, region))
            self.window = [(t, r) for t, r in self.window if now - t <= 5.0]

    def rates(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for _, region in self.window:
            out[region] = out.get(region, 0) + 0.2
        return {k: round(v, 1) for k, v in sorted(out.items())}


class BreakRequest(BaseModel):
    mode: str = Field(description="hang, refuse or 503 (ok heals)")
    endpoints: int | None = Field(None, ge=1, le=100, description="only the first N endpoints")


def add_demo_routes(app: FastAPI, backends: RegionBackends, load: LoadGenerator) -> None:
    regions = [r for r, _ in REGIONS]

    @app.get("/v1/demo", tags=["demo"])
    async def demo_state() -> dict[str, Any]:
        return {
            "regions": backends.regions(),
            "requestsPerSecond": load.rates(),
            "requests": load.by_region,
            "errors": load.errors,
        }

    @app.post("/v1/demo/regions/{region}/break", tags=["demo"], response_model=None)
    async def demo_break(region: str, body: BreakRequest) -> Any:
        if region not in regions:
            return error_response(
                404, f"no region {region!r} in the demo (one of {', '.join(regions)})"
            )
        if body.mode not in MODES:
            return error_response(
                400,
                f"mode must be one of {', '.join(MODES)}",
                [{"field": "mode", "description": "hang, refuse, 503 or ok"}],
            )
        n = await backends.set_mode(region, body.mode, body.endpoints)
        log.warning("demo: %s %s on %d endpoint(s)", region, body.mode, n)
        return {"region": region, "mode": body.mode, "endpoints": n}

    @app.post("/v1/demo/regions/{region}/heal", tags=["demo"], response_model=None)
    async def demo_heal(region: str) -> Any:
        if region not in regions:
            return error_response(404, f"no region {region!r} in the demo")
        n = await backends.set_mode(region, "ok")
        log.warning("demo: %s healed (%d endpoints)", region, n)
        return {"region": region, "mode": "ok", "endpoints": n}


def human_transitions() -> None:
    """On a terminal, transitions read better as text than as JSON lines."""
    transitions = logging.getLogger("healthgate.transitions")
    transitions.handlers.clear()
    transitions.propagate = False
    handler = logging.StreamHandler(sys.stdout)

    class Human(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            import json

            d = json.loads(record.getMessage())
            frm = str(d["from"]).rsplit("/", 1)[-1]
            to = str(d["to"]).rsplit("/", 1)[-1]
            return f"{d['time'][11:23]}  {d['kind']:<21} {d['project']}/{d['region']}/{d['name']:<16} {frm} -> {to}: {d['reason']}"

    handler.setFormatter(Human())
    transitions.addHandler(handler)
    transitions.setLevel(logging.INFO)


async def run_demo(s: DemoSettings) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="healthgate-demo-"))
    backends = RegionBackends()
    for region, n in REGIONS:
        for i in range(1, ENDPOINTS_PER_REGION + 1):
            backends.add(region, f"127.0.{n}.{i}", s.backend_port)
    manifest = tmp / "demo.yaml"
    manifest.write_text(yaml.safe_dump_all(demo_manifest(s), sort_keys=False))
    server = Server(
        ServeSettings(
            db=str(tmp / "demo.db"), listen=s.listen, manifests=[str(manifest)], failure_log_rate=0
        )
    )
    load = LoadGenerator(s.front_port, s.rate)
    server.configure_app.append(lambda app: add_demo_routes(app, backends, load))
    tasks: list[asyncio.Task[None]] = []
    try:
        await backends.start()
        await server.start()
        tasks.append(asyncio.create_task(load.run()))
        tasks.append(asyncio.create_task(report(load)))
        print_intro(server.url, s, manifest)
        await server.serve_forever()
    finally:
        print("\nstopping the demo ...", flush=True)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop()
        await backends.stop()
        shutil.rmtree(tmp, ignore_errors=True)


async def report(load: LoadGenerator) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            await asyncio.sleep(5)
            rates = ", ".join(f"{r} {v}/s" for r, v in load.rates().items()) or "none yet"
            print(f"-- traffic through the front end (last 5 s): {rates}", flush=True)


def command_name() -> str:
    """How to run this healthgate from another terminal: plain ``healthgate``
    when that is this one on PATH, else its path (``make run`` starts the
    virtual environment's, which is not on PATH)."""
    me = Path(sys.argv[0]).resolve()
    on_path = shutil.which("healthgate")
    if on_path and Path(on_path).resolve() == me:
        return "healthgate"
    if me.name != "healthgate":  # (python -m healthgate)
        return f"{sys.executable} -m healthgate"
    try:
        return str(me.relative_to(Path.cwd()))
    except ValueError:
        return str(me)


def print_intro(url: str, s: DemoSettings, manifest: Path) -> None:
    hg = command_name()
    print(
        f"""
healthgate demo is running.

  front end (clients connect here):  http://127.0.0.1:{s.front_port}/
  API:                               {url}   (OpenAPI: {url}/docs)
  manifest applied:                  {manifest}

Try, in another terminal:
  curl -s http://127.0.0.1:{s.front_port}/                    # answered by us-east1, the local region
  {hg} demo break us-east1 --mode hang     # or refuse, 503; --endpoints N for some
  {hg} get fr --project web                # where the front end routes now
  {hg} describe neg shop-us-east1 --project web --region us-east1
  {hg} events --project shop --follow
  {hg} demo heal us-east1

Ctrl-C stops everything.
""",
        flush=True,
    )
