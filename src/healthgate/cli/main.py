"""The ``healthgate`` command line.

Exit status: 0 success, 1 the input or request was refused (errors printed),
2 a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import ValidationError

from healthgate import __version__
from healthgate.model.manifest import check_manifest_offline, load_manifest_file
from healthgate.model.validation import InvalidResources

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


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


def _print_issues(exc: InvalidResources, source: str) -> None:
    n = len(exc.issues)
    print(f"{source}: {n} error{'s' if n != 1 else ''}:", file=sys.stderr)
    for issue in exc.issues:
        print(f"  - {issue}", file=sys.stderr)


def cmd_validate(args: argparse.Namespace) -> int:
    from healthgate.cli.client import CliError, read_manifest_arg

    source = "standard input" if args.file == "-" else args.file
    try:
        docs, warnings = check_manifest_offline(read_manifest_arg(args.file))
    except CliError as exc:
        print(f"healthgate validate: {exc}", file=sys.stderr)
        return exc.code
    except InvalidResources as exc:
        _print_issues(exc, source)
        return EXIT_REFUSED
    kinds: dict[str, int] = {}
    for d in docs:
        kinds[d.resource.kind] = kinds.get(d.resource.kind, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"{source}: valid ({len(docs)} resources: {summary})")
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    from healthgate.cli.simulate import to_json, to_table
    from healthgate.simulation.runner import simulate
    from healthgate.simulation.scenario import Scenario

    try:
        docs = load_manifest_file(args.file)
    except InvalidResources as exc:
        _print_issues(exc, args.file)
        return EXIT_REFUSED
    try:
        data = yaml.safe_load(Path(args.scenario).read_text(encoding="utf-8"))
        scenario = Scenario.model_validate(data)
    except yaml.YAMLError as exc:
        print(f"{args.scenario}: not valid YAML: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except ValidationError as exc:
        print(f"{args.scenario}: invalid scenario:", file=sys.stderr)
        for err in exc.errors(include_url=False):
            loc = ".".join(str(p) for p in err["loc"])
            print(f"  - field {loc}: {err['msg']}", file=sys.stderr)
        return EXIT_REFUSED
    resources = [d.resource for d in docs]
    result = simulate(resources, scenario)
    if args.output == "json":
        print(to_json(result, resources, scenario))
    else:
        print(to_table(result, resources, scenario, endpoints=not args.no_endpoints))
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:

    import uvloop

    from healthgate.controlplane.errors import ControlError
    from healthgate.dataplane.http import HttpSettings
    from healthgate.dataplane.manager import DataPlaneSettings
    from healthgate.probes.prober import ProbeSettings
    from healthgate.probes.scheduler import SchedulerSettings
    from healthgate.runtime.server import ServeSettings, run_server
    from healthgate.store.base import StoreError

    configure_logging(args.log_level)
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
    settings = ServeSettings(
        db=db,
        store=store,
        node=args.node,
        region=args.region,
        lease_ttl=args.lease_ttl,
        probe_workers=args.probe_workers,
        listen=args.listen,
        manifests=args.file or [],
        tokens_file=args.tokens,
        log_retention=args.log_retention,
        failure_log_rate=args.probe_failure_log_rate,
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
            balance=args.balance,
            workers=args.dataplane_workers,
            http=HttpSettings(per_try_timeout=args.per_try_timeout),
        ),
        agent=args.agent,
        public_healthz=args.public_healthz,
        dns=args.dns,
        dns_zones=args.dns_zone or [],
        xds=args.xds,
        stop_grace=args.stop_grace,
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

    configure_logging("warning")
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


def configure_logging(level: str) -> None:
    """Transitions as JSON lines on stdout; everything else as text on stderr."""
    import logging

    root = logging.getLogger()
    root.setLevel(level.upper())
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(err)
    transitions = logging.getLogger("healthgate.transitions")
    transitions.propagate = False
    transitions.setLevel(logging.INFO)
    out = logging.StreamHandler(sys.stdout)
    out.setFormatter(logging.Formatter("%(message)s"))
    transitions.addHandler(out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="healthgate",
        description="Composite health and automatic cross-region failover.",
    )
    parser.add_argument("--version", action="version", version=f"healthgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("validate", help="check a manifest offline (no server needed)")
    p.add_argument(
        "-f",
        "--file",
        required=True,
        help="manifest (YAML, one resource per document; - for stdin)",
    )
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("version", help="print healthgate's version")
    p.set_defaults(func=lambda _a: print(f"healthgate {__version__}") or EXIT_OK)

    p = sub.add_parser(
        "completion", help="a shell completion script: source <(healthgate completion bash)"
    )
    p.add_argument("shell", choices=["bash"])
    p.set_defaults(func=lambda _a: print(completion_script(parser), end="") or EXIT_OK)

    from healthgate.cli import client

    p = sub.add_parser("serve", help="run the API, store, probes and engine in one process")
    p.add_argument("--db", default="./healthgate.db", help="SQLite file (default ./healthgate.db)")
    p.add_argument(
        "--store",
        metavar="URL",
        help="sqlite:PATH (the default, as --db) or etcd://HOST:PORT[,HOST:PORT...]: cluster mode, "
        "many nodes over one etcd cluster (docs/cluster.md; needs --node and --region)",
    )
    p.add_argument("--node", help="cluster mode: this node's name, unique in the cluster")
    p.add_argument("--region", help="cluster mode: the region this node probes and serves")
    p.add_argument(
        "--lease-ttl",
        type=int,
        default=5,
        metavar="SECONDS",
        help="cluster mode: a dead node's endpoints move after this (default 5)",
    )
    p.add_argument(
        "--listen", default="127.0.0.1:7400", help="API address HOST:PORT (default 127.0.0.1:7400)"
    )
    p.add_argument(
        "-f", "--file", action="append", help="apply this manifest at start-up (repeatable)"
    )
    p.add_argument(
        "--tokens", help="YAML list of {token, project, role}; required to listen beyond loopback"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--log-retention",
        type=int,
        default=100_000,
        help="transition records kept (default 100000)",
    )
    p.add_argument(
        "--probe-failure-log-rate",
        type=float,
        default=1.0,
        help="probe-failure log lines per second (0: none)",
    )
    p.add_argument(
        "--keepalive-probes",
        action="store_true",
        help="keep HTTP(S) probe connections alive between probes",
    )
    p.add_argument(
        "--probe-tick-ms",
        type=positive_float,
        default=None,
        help="the longest tick: how often the prober wakes while probes are in flight at low "
        "rates (it shortens to 2 ms at high rates, ~20 starts per tick); probes start within "
        "half a tick of due, and response times are measured to one tick (default 16)",
    )
    p.add_argument(
        "--tcp-half-open",
        action="store_true",
        help="TCP checks reset right after the SYN+ACK (HAProxy's way) instead of completing "
        "the handshake; the server's accept queue then never sees them",
    )
    p.add_argument(
        "--no-tls-resumption",
        action="store_true",
        help="fresh-connection HTTPS checks make a full TLS handshake every time (by "
        "default each offers its endpoint's last session, as HAProxy's checks do)",
    )
    p.add_argument(
        "--probe-workers",
        type=probe_workers,
        default=None,
        metavar="N",
        help="probe in N worker processes ('auto': one per core), each owning a shard of the "
        "endpoints and sending the serving process only their transitions; 0: in the serving "
        "process itself (it holds about 20,000 endpoints at 1 s). Default: one per core "
        "(at most 8) when there is more than one, 0 in cluster mode",
    )
    p.add_argument(
        "--probe-source",
        metavar="IP",
        help="TCP, HTTP and HTTPS probes leave from this local address (default: the kernel's "
        "choice); for firewalls that admit probers by address",
    )
    p.add_argument("--verify-tls", action="store_true", help="verify HTTPS probe certificates")
    p.add_argument("--ca-file", help="CA bundle for --verify-tls")
    p.add_argument(
        "--no-dataplane", action="store_true", help="open no listeners (control plane only)"
    )
    p.add_argument(
        "--dataplane-workers",
        type=int,
        default=0,
        metavar="N",
        help="run the listeners in N worker processes sharing each port with SO_REUSEPORT "
        "(default 0: in the serving process)",
    )
    p.add_argument(
        "--balance",
        choices=["round-robin", "least-connections"],
        default="round-robin",
        help="how producer listeners pick among HEALTHY endpoints (default round-robin)",
    )
    p.add_argument(
        "--drain-on-failover",
        action="store_true",
        help="close open TCP connections to a region when traffic fails over from it",
    )
    p.add_argument(
        "--per-try-timeout",
        type=float,
        default=2.0,
        help="HTTP front ends: seconds to the first response byte before a retry in the next region",
    )
    p.add_argument(
        "--agent",
        metavar="HOST:PORT",
        help="answer HAProxy's agent-check here (up / down / maint per PSC NEG; docs/integrations.md)",
    )
    p.add_argument(
        "--dns",
        metavar="HOST:PORT",
        help="answer DNS (UDP and TCP) for global rules' dnsName with the routed region's address",
    )
    p.add_argument(
        "--dns-zone",
        action="append",
        metavar="ZONE",
        help="a zone the DNS server is authoritative for (repeatable; default: each dnsName's parent)",
    )
    p.add_argument(
        "--xds",
        metavar="HOST:PORT",
        help="an Envoy ADS server (CDS and EDS): a cluster per global backend service, "
        "one locality per region, priority = failover order",
    )
    p.add_argument(
        "--stop-grace",
        type=non_negative_float,
        default=2.0,
        metavar="SECONDS",
        help="on SIGTERM / SIGINT, open front-end connections get this long to finish before "
        "they are closed (default 2); a second signal exits at once",
    )
    p.add_argument(
        "--public-healthz",
        action="store_true",
        help="serve forwarding rules' .../healthz without a token (for load balancers' checks)",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "export", help="configuration for another data plane that follows healthgate's decisions"
    )
    p.add_argument("target", choices=["haproxy"], help="the data plane")
    p.add_argument("frontend", metavar="FRONTEND", help="a global (consumer) forwarding rule")
    p.add_argument(
        "--agent",
        metavar="HOST:PORT",
        help="the agent address HAProxy asks (default: serve's --agent)",
    )
    client.add_client_options(p)
    p.set_defaults(func=lambda a: client.run_client(client.cmd_export, a))

    p = sub.add_parser("apply", help="create or update the resources of a manifest, atomically")
    p.add_argument("-f", "--file", required=True)
    p.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    client.add_client_options(p)
    p.set_defaults(func=lambda a: client.run_client(client.cmd_apply, a))

    p = sub.add_parser(
        "delete", help="delete the resources of a manifest (atomically), or one resource"
    )
    p.add_argument("-f", "--file")
    p.add_argument("kind", nargs="?")
    p.add_argument("name", nargs="?")
    p.add_argument("--dry-run", action="store_true")
    client.add_client_options(p)
    p.set_defaults(func=lambda a: client.run_client(client.cmd_delete, a))

    p = sub.add_parser("get", help="list resources of a kind, or get one")
    p.add_argument("kind")
    p.add_argument("name", nargs="?")
    p.add_argument(
        "-o",
        "--output",
        choices=["table", "wide", "json", "yaml"],
        default="table",
        help="wide: also when the state last changed and the fingerprint; "
        "yaml can be applied back (apply -f)",
    )
    p.add_argument("-w", "--watch", action="store_true", help="print again whenever it changes")
    p.add_argument(
        "--interval", type=positive_float, default=2.0, help="--watch: seconds between looks (2)"
    )
    client.add_client_options(p)
    p.set_defaults(func=lambda a: client.run_client(client.cmd_get, a))

    p = sub.add_parser("describe", help="a resource's fields, state, and why (the reason tree)")
    p.add_argument("kind")
    p.add_argument("name")
    client.add_client_options(p)
    p.set_defaults(func=lambda a: client.run_client(client.cmd_describe, a))

    p = sub.add_parser("health", help="every endpoint's state, last probe and reason")
    p.add_argument("backend_service", metavar="BACKEND_SERVICE")
    p.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table")
    client.add_client_options(p)
    p.set_defaults(func=lambda a: client.run_client(client.cmd_health, a))

    p = sub.add_parser("events", help="the transition log")
    p.add_argument("--follow", action="store_true", help="keep printing new transitions")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.add_argument("--kind")
    p.add_argument("--resource", help="a resource path or prefix")
    p.add_argument("--state", help="only transitions to this state")
    p.add_argument("--since", help="only the last DURATION (30s, 10m, 2h)")
    p.add_argument("--limit", type=int, default=1000)
    client.add_client_options(p)
    p.set_defaults(func=lambda a: client.run_client(client.cmd_events, a))

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

    p = sub.add_parser("simulate", help="replay a what-if scenario in virtual time")
    p.add_argument("-f", "--file", required=True, help="manifest")
    p.add_argument("--scenario", required=True, help="scenario (YAML); see examples/")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.add_argument("--no-endpoints", action="store_true", help="hide endpoint-level transitions")
    p.set_defaults(func=cmd_simulate)
    return parser


def completion_script(parser: argparse.ArgumentParser) -> str:
    """A bash completion script made from the parser itself: subcommands,
    each one's options, and resource kinds where a command takes one."""
    from healthgate.cli.client import ALIASES
    from healthgate.model.names import KIND_TO_COLLECTION

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cases = []
    for name, p in sub.choices.items():
        options = sorted(o for a in p._actions for o in a.option_strings if o.startswith("--"))
        cases.append(f'    {name}) opts="{" ".join(options)}" ;;')
    kinds = " ".join(sorted({*ALIASES, *KIND_TO_COLLECTION.values()}))
    return f"""# bash completion for healthgate: source <(healthgate completion bash)
_healthgate() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" opts=""
  if [ "$COMP_CWORD" -eq 1 ]; then
    COMPREPLY=( $(compgen -W "{" ".join(sub.choices)}" -- "$cur") ); return
  fi
  case "${{COMP_WORDS[1]}}" in
{chr(10).join(cases)}
  esac
  case "${{COMP_WORDS[1]}}" in
    get|describe|delete)
      if [ "$COMP_CWORD" -eq 2 ] && [[ "$cur" != -* ]]; then
        COMPREPLY=( $(compgen -W "{kinds}" -- "$cur") ); return
      fi ;;
  esac
  COMPREPLY=( $(compgen -W "$opts" -- "$cur") )
}}
complete -F _healthgate healthgate
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.func(args)
    except FileNotFoundError as exc:
        print(f"healthgate: {exc.filename}: no such file", file=sys.stderr)
        return EXIT_REFUSED
    except BrokenPipeError:
        return EXIT_OK
    return rc


if __name__ == "__main__":
    sys.exit(main())
