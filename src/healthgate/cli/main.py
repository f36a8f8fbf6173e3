"""The ``healthgate`` command line.

Exit status: 0 success, 1 the input or request was refused (errors printed),
2 a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from healthgate import __version__
from healthgate.cli.serve import (
    EXIT_OK,
    EXIT_REFUSED,
    add_demo_command,
    add_serve_command,
    positive_float,
)
from healthgate.model.manifest import check_manifest_offline, load_manifest_file
from healthgate.model.validation import InvalidResources


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


def _overlaid(files: list[str]) -> list[Any]:
    """Several manifests as one world: a document of a later file replaces
    the one of the same kind, project, region and name before it."""
    from healthgate.model.manifest import load_manifest

    merged: dict[tuple[str, ...], Any] = {}
    for f in files:
        for doc in yaml.safe_load_all(Path(f).read_text(encoding="utf-8")):
            if isinstance(doc, dict):
                key = tuple(str(doc.get(k, "")) for k in ("kind", "project", "region", "name"))
                merged[key] = doc
    return load_manifest(yaml.safe_dump_all(list(merged.values()), sort_keys=False))


def cmd_simulate(args: argparse.Namespace) -> int:
    from healthgate.cli.simulate import to_json, to_table
    from healthgate.simulation.runner import simulate
    from healthgate.simulation.scenario import Scenario

    files = args.file
    name = files[0] if len(files) == 1 else " + ".join(files)
    try:
        docs = load_manifest_file(files[0]) if len(files) == 1 else _overlaid(files)
    except InvalidResources as exc:
        _print_issues(exc, name)
        return EXIT_REFUSED
    except yaml.YAMLError as exc:
        print(f"{name}: not valid YAML: {exc}", file=sys.stderr)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="healthgate",
        description="Composite health and automatic cross-region failover.",
    )
    parser.add_argument("--version", action="version", version=f"healthgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_offline_commands(sub, parser)
    add_serve_command(sub)
    add_client_commands(sub)
    add_demo_command(sub)
    return parser


def add_offline_commands(sub: Any, parser: argparse.ArgumentParser) -> None:
    """The commands that need no server: validate, simulate, version, completion."""
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

    p = sub.add_parser("simulate", help="replay a what-if scenario in virtual time")
    p.add_argument(
        "-f",
        "--file",
        required=True,
        action="append",
        help="manifest; given again, a later file's documents replace the same-named ones",
    )
    p.add_argument("--scenario", required=True, help="scenario (YAML); see examples/")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.add_argument("--no-endpoints", action="store_true", help="hide endpoint-level transitions")
    p.set_defaults(func=cmd_simulate)


def add_client_commands(sub: Any) -> None:
    """The commands that talk to a server's API (cli/client.py)."""
    from healthgate.cli import client

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
    p.add_argument(
        "--instance",
        metavar="NAME",
        help="this HAProxy's name in convergence receipts (default: its address)",
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
    add_shift_command(sub)
    add_practice_command(sub)
    add_replay_command(sub)


def add_shift_command(sub: Any) -> None:
    """``healthgate shift``: manual moves that always expire (SPEC §6)."""
    from healthgate.cli import client

    p = sub.add_parser(
        "report",
        help="pushed health: report an endpoint of a PUSH check's backend service "
        "HEALTHY, UNHEALTHY or DEGRADED (until its ttlSec runs out)",
    )
    p.add_argument("backend_service", metavar="BACKEND_SERVICE")
    p.add_argument("endpoint", metavar="ENDPOINT", help="ip:port, [v6]:port or ip")
    p.add_argument("state", choices=["HEALTHY", "UNHEALTHY", "DEGRADED"])
    p.add_argument("--note", default="", help="why (one line, at most 500 characters)")
    client.add_client_options(p)
    p.set_defaults(func=lambda a: client.run_client(client.cmd_report, a))

    p = sub.add_parser(
        "shift",
        help="move traffic away by hand, for a while: away REGION|PATH --for 2h --comment TEXT; "
        "list; extend NAME --for 1h; end NAME",
    )
    p.add_argument("action", choices=["away", "list", "extend", "end"])
    p.add_argument("target", nargs="?", help="away: a region or a PSC NEG / attachment path; "
                   "extend, end: the shift's name")  # fmt: skip
    p.add_argument("--for", dest="for_", metavar="DURATION", help="how long (60s to 72h)")
    p.add_argument("--comment", help="why (shown in every reason it causes)")
    p.add_argument("--name", help="away: the shift's name (default: generated)")
    p.add_argument("--force", action="store_true", help="an admin's override of the safety rule")
    p.add_argument("--all", action="store_true", help="list: the ones ended in the last hour too")
    client.add_client_options(p)
    p.set_defaults(func=lambda a: client.run_client(client.cmd_shift, a))


def add_replay_command(sub: Any) -> None:
    """``healthgate replay``: real history under a candidate world (SPEC §11)."""
    from healthgate.cli import client

    p = sub.add_parser(
        "replay",
        help="what a candidate (-f) would have done with the probes' real history, "
        "next to what happened: --from 6h [--to 1h] -f CANDIDATE.yaml",
    )
    p.add_argument("--from", dest="from_", required=True, metavar="TIME",
                   help="an RFC 3339 time, or how long ago (30m, 6h, 1d)")  # fmt: skip
    p.add_argument("--to", metavar="TIME", help="as --from (default: now)")
    p.add_argument("-f", "--file", action="append", metavar="CANDIDATE",
                   help="documents that replace resources as they are (default: none - the "
                   "world as it is, which reproduces the log)")  # fmt: skip
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.add_argument("--all", action="store_true", help="every row, the same ones too")
    client.add_client_options(p)
    p.set_defaults(func=lambda a: client.run_client(client.cmd_replay, a))


def add_practice_command(sub: Any) -> None:
    """``healthgate practice``: failover exercised on purpose (SPEC §11)."""
    from healthgate.cli import client

    p = sub.add_parser(
        "practice",
        help="practice runs: start NAME (now); list (each run's next start, last outcome); "
        "history [NAME] (STARTED, COMPLETED, CANCELLED, SKIPPED)",
    )
    p.add_argument("action", choices=["start", "list", "history"])
    p.add_argument("name", nargs="?", help="the practice run's name")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.add_argument("--limit", type=int, default=100, help="history: at most this many records")
    client.add_client_options(p)
    p.set_defaults(func=lambda a: client.run_client(client.cmd_practice, a))


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
    # a crash in native code (the C speedups, uvloop, grpc) leaves every
    # thread's Python stack on stderr - the log - instead of a silent exit
    # (unless already on: PYTHONFAULTHANDLER, or a test runner's own; and a
    # stderr without a descriptor - captured - has nowhere to dump to)
    if not faulthandler.is_enabled():
        with contextlib.suppress(OSError, ValueError):
            faulthandler.enable()
    # gRPC (the etcd client, xDS, gRPC checks) and fork: this process only
    # ever forks to exec a worker, which needs none of gRPC's fork handlers,
    # and those handlers are known to break a process that forks while its
    # channels are busy ("Other threads are currently calling into gRPC,
    # skipping fork() handlers"; grpc/grpc#13873, #15334). Read when gRPC
    # is first imported, which is later than this.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
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
