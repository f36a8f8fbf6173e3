"""``healthgate serve`` and ``healthgate demo``: their options and how
they start (the processes themselves are runtime/'s)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from healthgate import logs

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text}")
    return value


def try_timeout(text: str) -> float:
    """A per-try timeout: more than 0, at most an hour (NaN and infinity refused)."""
    value = positive_float(text)
    if not value <= 3600:
        raise argparse.ArgumentTypeError(f"must be at most 3600 seconds, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def within(low: float, high: float, what: str) -> Callable[[str], float]:
    """An option's number, from ``low`` to ``high`` (``what`` says in what)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{low:g} to {high:g} {what}, got {text}")
        return value

    return parse


percent = within(0, 100, "(a percentage)")
storm_window = within(1, 3600, "seconds")
history_hours = within(0, 168, "hours")


def advertise_url(text: str) -> str:
    from healthgate.cluster.membership import API_RE

    if len(text) > 300 or not API_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"http(s)://HOST:PORT and nothing more, got {text[:80]!r}")
    return text


def cidr_list(text: str) -> list[str]:
    """``--allow-addresses``: comma-separated addresses or CIDRs."""
    import ipaddress

    out = [part.strip() for part in text.split(",") if part.strip()]
    for part in out:
        try:
            ipaddress.ip_network(part, strict=False)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not an address or CIDR") from None
    return out


def probe_workers(text: str) -> int:
    """``--probe-workers``: a count, or ``auto`` (one per core this process may run on)."""
    if text == "auto":
        return len(os.sched_getaffinity(0))
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of processes or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:

    import uvloop

    from healthgate.api.state import ApiSettings
    from healthgate.controlplane.errors import ControlError
    from healthgate.dataplane.http_limits import HttpSettings
    from healthgate.dataplane.manager import Balance, DataPlaneSettings
    from healthgate.health.storms import StormSettings
    from healthgate.model.addresses import AddressPolicy
    from healthgate.probes.prober import ProbeSettings
    from healthgate.probes.scheduler import SchedulerSettings
    from healthgate.runtime.server import ServeSettings, run_server
    from healthgate.store.base import StoreError

    logs.configure(args.log_level, args.log_format)
    db, store = args.db, None
    if args.store:
        if args.store.startswith("sqlite:"):
            db = args.store.removeprefix("sqlite:")
        elif args.store.startswith("etcd://"):
            store = args.store
            missing = [o for o, v in (("--node", args.node), ("--region", args.region)) if not v]
            if missing:
                print(
                    f"healthgate serve: --store etcd:// needs {' and '.join(missing)}",
                    file=sys.stderr,
                )
                return EXIT_REFUSED
        else:
            print(
                f"healthgate serve: --store: expected sqlite:PATH or etcd://HOST:PORT[,HOST:PORT...], "
                f"got {args.store!r}",
                file=sys.stderr,
            )
            return EXIT_REFUSED
    try:
        etcd_tls, etcd_auth = etcd_security(args)
        xds_tls, xds_clients = xds_security(args)
    except ValueError as exc:
        print(f"healthgate serve: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    settings = ServeSettings(
        etcd_tls=etcd_tls,
        etcd_auth=etcd_auth,
        db=db,
        store=store,
        node=args.node,
        region=args.region,
        lease_ttl=args.lease_ttl,
        opinion_sweep=args.opinion_sweep_sec,
        advertise_url=args.advertise_url,
        probe_workers=args.probe_workers,
        listen=args.listen,
        manifests=args.file or [],
        tokens_file=args.tokens,
        log_retention=args.log_retention,
        failure_log_rate=args.probe_failure_log_rate,
        storms=StormSettings(args.storm_hold_percent, args.storm_hold_window),
        convergence_alert_sec=args.convergence_alert_sec,
        history_hours=args.history_hours,
        probe=ProbeSettings(
            keepalive=args.keepalive_probes,
            verify_tls=args.verify_tls,
            ca_file=args.ca_file,
            tcp_half_open=args.tcp_half_open,
            source=args.probe_source,
            tls_resume=not args.no_tls_resumption,
        ),
        scheduler=SchedulerSettings(tick=args.probe_tick_ms / 1000)
        if args.probe_tick_ms
        else SchedulerSettings(),
        dataplane=DataPlaneSettings(
            enabled=not args.no_dataplane,
            drain_on_failover=args.drain_on_failover,
            balance=Balance(args.balance),
            workers=args.dataplane_workers,
            http=HttpSettings(per_try_timeout=args.per_try_timeout),
            max_listening_sockets=args.max_listening_sockets,
        ),
        agent=args.agent,
        public_healthz=args.public_healthz,
        dns=args.dns,
        dns_zones=args.dns_zone or [],
        xds=args.xds,
        stop_grace=args.stop_grace,
        xds_tls=xds_tls,
        xds_clients=xds_clients,
        insecure_bind=args.insecure_bind,
        api=ApiSettings(
            allowed_hosts=tuple(args.allowed_host or ()),
            address_policy=AddressPolicy.parse(
                [c for cs in args.allow_addresses or () for c in cs]
            ),
        ),
    )
    try:
        uvloop.run(run_server(settings))
    except ControlError as exc:
        print(f"healthgate serve: {exc.message}", file=sys.stderr)
        for issue in exc.details:
            print(f"  - {issue}", file=sys.stderr)
        return EXIT_REFUSED
    except (ValueError, OSError, StoreError) as exc:
        print(f"healthgate serve: {exc}", file=sys.stderr)  # one line: what, and what to do
        return EXIT_REFUSED
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from healthgate.cli import client

    if args.action in ("break", "heal", "status"):
        return client.run_client(client.cmd_demo_control, args)
    if args.action != "run":
        print(
            "usage: healthgate demo [run | break REGION --mode MODE | heal REGION | status]",
            file=sys.stderr,
        )
        return EXIT_USAGE

    import uvloop

    from healthgate.runtime.demo import DemoError, DemoSettings, human_transitions, run_demo

    logs.configure("warning")
    human_transitions()
    try:
        uvloop.run(
            run_demo(
                DemoSettings(
                    listen=args.listen,
                    front_port=args.front_port,
                    backend_port=args.backend_port,
                    producer_port=args.producer_port,
                    with_=tuple(dict.fromkeys(args.with_ or ())),
                    cluster=args.cluster,
                )
            )
        )
    except DemoError as exc:
        print(f"healthgate demo: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as exc:
        print(f"healthgate demo: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def etcd_security(args: argparse.Namespace) -> tuple[Any, Any]:
    """(EtcdTls or None, EtcdAuth or None) from serve's --etcd-* options."""
    from healthgate.secrets import read_secret
    from healthgate.store.etcd_client import EtcdAuth, EtcdTls

    if bool(args.etcd_cert) != bool(args.etcd_key):
        raise ValueError("--etcd-cert and --etcd-key go together")
    tls = None
    if args.etcd_cacert or args.etcd_cert:
        for option, path in (
            ("--etcd-cacert", args.etcd_cacert),
            ("--etcd-cert", args.etcd_cert),
            ("--etcd-key", args.etcd_key),
        ):
            if path and not os.path.isfile(path):
                raise ValueError(f"{option} {path}: no such file")
        tls = EtcdTls(args.etcd_cacert, args.etcd_cert, args.etcd_key)
    if bool(args.etcd_user) != bool(args.etcd_password_file):
        raise ValueError("--etcd-user and --etcd-password-file go together")
    auth = None
    if args.etcd_user:
        auth = EtcdAuth(
            args.etcd_user, read_secret(args.etcd_password_file, "--etcd-password-file")
        )
    return tls, auth


def xds_security(args: argparse.Namespace) -> tuple[Any, dict[str, frozenset[str]]]:
    """(XdsTls or None, certificate name -> projects) from --xds-tls-* and --xds-client."""
    from healthgate.integrations.xds import XdsTls
    from healthgate.model.names import is_valid_name

    files = (args.xds_tls_cert, args.xds_tls_key, args.xds_client_ca)
    if any(files) and not all(files):
        raise ValueError("--xds-tls-cert, --xds-tls-key and --xds-client-ca go together")
    clients: dict[str, frozenset[str]] = {}
    for text in args.xds_client or ():
        name, sep, projects = text.partition("=")
        wanted = frozenset(p.strip() for p in projects.split(",") if p.strip())
        if not sep or not name.strip() or not wanted or not all(map(is_valid_name, wanted)):
            raise ValueError(f"--xds-client {text!r}: expected NAME=PROJECT[,PROJECT...]")
        clients[name.strip()] = wanted
    if clients and not all(files):
        raise ValueError("--xds-client needs TLS: --xds-tls-cert, --xds-tls-key, --xds-client-ca")
    tls = XdsTls(*files) if all(files) else None
    return tls, clients


def add_serve_command(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the API, store, probes and engine in one process")
    _store_options(p)
    _api_options(p)
    _probe_options(p)
    _dataplane_options(p)
    _integration_options(p)
    _proving_options(p)
    p.set_defaults(func=cmd_serve)


def _proving_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("proving that failover works (docs/operations.md, SPEC §11)")
    g.add_argument(
        "--convergence-alert-sec",
        type=storm_window,
        default=30.0,
        metavar="SECONDS",
        help="a data plane that has not applied a route decision this long after it is "
        "LAGGING (a record, a metric, an alert), 1-3600 (default 30)",
    )
    g.add_argument(
        "--history-hours",
        type=history_hours,
        default=24.0,
        metavar="HOURS",
        help="how long the outcome history of each probed endpoint is kept for "
        "'healthgate replay', 0-168 (default 24; 0: none)",
    )


def _store_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the store; cluster mode (docs/cluster.md)")
    g.add_argument("--db", default="./healthgate.db", help="SQLite file (default ./healthgate.db)")
    g.add_argument(
        "--store",
        metavar="URL",
        help="sqlite:PATH (the default, as --db) or etcd://HOST:PORT[,HOST:PORT...]: cluster mode, "
        "many nodes over one etcd cluster (docs/cluster.md; needs --node and --region)",
    )
    g.add_argument("--node", help="cluster mode: this node's name, unique in the cluster")
    g.add_argument("--region", help="cluster mode: the region this node probes and serves")
    g.add_argument("--etcd-cacert", metavar="FILE", help="cluster mode: TLS to etcd, its CA")
    g.add_argument(
        "--etcd-cert", metavar="FILE", help="cluster mode: this node's client certificate for etcd"
    )
    g.add_argument("--etcd-key", metavar="FILE", help="cluster mode: ... and its key")
    g.add_argument(
        "--etcd-user",
        metavar="NAME",
        help="cluster mode: authenticate to etcd as this user (its role: read and write on "
        "/healthgate/; docs/cluster.md)",
    )
    g.add_argument(
        "--etcd-password-file",
        metavar="FILE",
        help="cluster mode: --etcd-user's password, read from this file (never an argument)",
    )
    g.add_argument(
        "--lease-ttl",
        type=int,
        default=5,
        metavar="SECONDS",
        help="cluster mode: a dead node's endpoints move after this (default 5)",
    )
    g.add_argument(
        "--opinion-sweep-sec",
        type=positive_float,
        default=300.0,
        metavar="SECONDS",
        help="cluster mode: how often the leader looks for opinions of endpoints gone from the "
        "world; one is deleted at the second look that finds it (default 300)",
    )
    g.add_argument(
        "--advertise-url",
        metavar="URL",
        type=advertise_url,
        help="cluster mode: where the other nodes reach this node's API, http(s)://HOST:PORT "
        "(default: http:// and --listen; give it when --listen is 0.0.0.0 or behind NAT)",
    )


def _api_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the API, manifests, logging and stopping")
    g.add_argument(
        "--listen", default="127.0.0.1:7400", help="API address HOST:PORT (default 127.0.0.1:7400)"
    )
    g.add_argument(
        "-f", "--file", action="append", help="apply this manifest at start-up (repeatable)"
    )
    g.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a DNS name clients reach the API by (repeatable); besides it, a request's Host "
        "must be an IP address or localhost (web pages on other names are refused: DNS "
        "rebinding)",
    )
    g.add_argument(
        "--allow-addresses",
        action="append",
        type=cidr_list,
        metavar="CIDR,...",
        help="address ranges non-admin tokens may still use for endpoints, instances and rules "
        "(by default loopback, link-local - the metadata address among them - and unspecified "
        "addresses are refused to them); for single-tenant use",
    )
    g.add_argument(
        "--tokens", help="YAML list of {token, project, role}; required to listen beyond loopback"
    )
    g.add_argument(
        "--public-healthz",
        action="store_true",
        help="serve forwarding rules' .../healthz without a token (for load balancers' checks)",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument(
        "--log-format",
        default="text",
        choices=list(logs.FORMATS),
        help="text (default), or json: one object per line (time, level, logger, message, "
        "and a transition's fields), for log shippers",
    )
    g.add_argument(
        "--log-retention",
        type=int,
        default=100_000,
        help="transition records kept (default 100000)",
    )
    g.add_argument(
        "--stop-grace",
        type=non_negative_float,
        default=2.0,
        metavar="SECONDS",
        help="on SIGTERM / SIGINT, open front-end connections get this long to finish before "
        "they are closed (default 2); a second signal exits at once",
    )


def _probe_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("probing (docs/health.md)")
    g.add_argument(
        "--probe-failure-log-rate",
        type=non_negative_float,
        default=1.0,
        help="probe-failure log lines per second (0: none)",
    )
    g.add_argument(
        "--keepalive-probes",
        action="store_true",
        help="keep HTTP(S) probe connections alive between probes",
    )
    g.add_argument(
        "--probe-tick-ms",
        type=positive_float,
        default=None,
        help="the longest tick: how often the prober wakes while probes are in flight at low "
        "rates (it shortens to 2 ms at high rates, ~20 starts per tick); probes start within "
        "half a tick of due, and response times are measured to one tick (default 16)",
    )
    g.add_argument(
        "--tcp-half-open",
        action="store_true",
        help="TCP checks reset right after the SYN+ACK (HAProxy's way) instead of completing "
        "the handshake; the server's accept queue then never sees them",
    )
    g.add_argument(
        "--no-tls-resumption",
        action="store_true",
        help="fresh-connection HTTPS checks make a full TLS handshake every time (by "
        "default each offers its endpoint's last session, as HAProxy's checks do)",
    )
    g.add_argument(
        "--probe-workers",
        type=probe_workers,
        default=None,
        metavar="N",
        help="probe in N worker processes ('auto': one per core), each owning a shard of the "
        "endpoints and sending the serving process only their transitions; 0: in the serving "
        "process itself (it holds about 20,000 endpoints at 1 s). Default: one per core "
        "(at most 8) when there is more than one, 0 in cluster mode",
    )
    g.add_argument(
        "--probe-source",
        metavar="IP",
        help="TCP, HTTP and HTTPS probes leave from this local address (default: the kernel's "
        "choice); for firewalls that admit probers by address",
    )
    g.add_argument(
        "--storm-hold-percent",
        type=percent,
        default=0.0,
        metavar="P",
        help="failover storms (docs/passive.md): when more than P %% of the probed endpoints "
        "turn UNHEALTHY within --storm-hold-window across two or more regions, routes are "
        "held where they were (default 0: off)",
    )
    g.add_argument(
        "--storm-hold-window",
        type=storm_window,
        default=30.0,
        metavar="SECONDS",
        help="the window of --storm-hold-percent, 1-3600 (default 30)",
    )
    g.add_argument("--verify-tls", action="store_true", help="verify HTTPS probe certificates")
    g.add_argument("--ca-file", help="CA bundle for --verify-tls")


def _dataplane_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the data plane: listeners for forwarding rules (docs/dataplane.md)")
    g.add_argument(
        "--no-dataplane", action="store_true", help="open no listeners (control plane only)"
    )
    g.add_argument(
        "--dataplane-workers",
        type=int,
        default=0,
        metavar="N",
        help="run the listeners in N worker processes sharing each port with SO_REUSEPORT "
        "(default 0: in the serving process)",
    )
    g.add_argument(
        "--balance",
        choices=["round-robin", "least-connections"],
        default="round-robin",
        help="how producer listeners pick among HEALTHY endpoints (default round-robin)",
    )
    g.add_argument(
        "--drain-on-failover",
        action="store_true",
        help="close open TCP connections to a region when traffic fails over from it",
    )
    g.add_argument(
        "--per-try-timeout",
        type=try_timeout,
        default=2.0,
        help="HTTP front ends: seconds to the first response byte before a retry in the next region",
    )
    g.add_argument(
        "--max-listening-sockets",
        type=positive_int,
        default=0,
        metavar="N",
        help="listening sockets of every forwarding rule together; a rule that does not fit "
        "gets no listener (default: a sixteenth of the open-file limit, 64 to 4,096)",
    )


def _integration_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("other data planes that follow healthgate (docs/integrations.md)")
    g.add_argument(
        "--agent",
        metavar="HOST:PORT",
        help="answer HAProxy's agent-check here (up / down / maint per PSC NEG; docs/integrations.md)",
    )
    g.add_argument(
        "--dns",
        metavar="HOST:PORT",
        help="answer DNS (UDP and TCP) for global rules' dnsName with the routed region's address",
    )
    g.add_argument(
        "--dns-zone",
        action="append",
        metavar="ZONE[=PROJECT]",
        help="a zone the DNS server is authoritative for (repeatable; default: each dnsName's "
        "parent); =PROJECT: only that project's rules are answered in it (required with --tokens)",
    )
    g.add_argument(
        "--xds",
        metavar="HOST:PORT",
        help="an Envoy ADS server (CDS and EDS): a cluster per global backend service, "
        "one locality per region, priority = failover order",
    )
    g.add_argument("--xds-tls-cert", metavar="FILE", help="the ADS server's TLS certificate")
    g.add_argument("--xds-tls-key", metavar="FILE", help="... and its key")
    g.add_argument(
        "--xds-client-ca",
        metavar="FILE",
        help="the CA of the Envoys' client certificates (every Envoy must present one)",
    )
    g.add_argument(
        "--xds-client",
        action="append",
        metavar="NAME=PROJECT[,PROJECT]",
        help="an Envoy certificate's common name and the projects whose clusters it receives "
        "(repeatable; with TLS, an Envoy whose name is not given is refused)",
    )
    g.add_argument(
        "--insecure-bind",
        action="store_true",
        help="let --agent, --dns and --xds (without TLS) bind beyond loopback: whoever reaches "
        "them reads every project's routes",
    )


def add_demo_command(sub: Any) -> None:
    from healthgate.cli import client

    p = sub.add_parser(
        "demo", help="a whole multi-region stack on this machine; break and heal regions"
    )
    p.add_argument("action", nargs="?", default="run", choices=["run", "break", "heal", "status"])
    p.add_argument(
        "region", nargs="?", help="for break and heal: us-east1, europe-west1 or asia-east1"
    )
    p.add_argument(
        "--mode",
        default="hang",
        choices=["hang", "refuse", "503"],
        help="how to break it (default hang)",
    )
    p.add_argument("--endpoints", type=int, help="break only the first N endpoints of the region")
    p.add_argument(
        "--listen",
        default="127.0.0.1:7400",
        help="API address of the demo (default 127.0.0.1:7400)",
    )
    p.add_argument(
        "--front-port", type=int, default=8088, help="front-end port on 127.0.0.1 (default 8088)"
    )
    p.add_argument(
        "--backend-port", type=int, default=8080, help="simulated backends' port (default 8080)"
    )
    p.add_argument(
        "--producer-port", type=int, default=9080, help="producer rules' port (default 9080)"
    )
    p.add_argument(
        "--with",
        dest="with_",
        action="append",
        choices=["haproxy", "envoy", "dns"],
        help="also show another data plane following healthgate (repeatable): HAProxy on "
        ":8089 (agent-check), Envoy on :8090 (ADS), DNS on :5353",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="cluster mode: 3 etcd members (Debian's etcd-server) and a node per region, "
        "started and removed with the demo (docs/cluster.md)",
    )
    client.add_client_options(p)
    p.set_defaults(func=cmd_demo)
