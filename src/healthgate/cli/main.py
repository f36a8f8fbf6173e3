"""The ``healthgate`` command line.

Exit status: 0 success, 1 the input or request was refused (errors printed),
2 a usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import ValidationError

from healthgate import __version__
from healthgate.model.manifest import load_manifest_file
from healthgate.model.validation import InvalidResources

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2


def _print_issues(exc: InvalidResources, source: str) -> None:
    n = len(exc.issues)
    print(f"{source}: {n} error{'s' if n != 1 else ''}:", file=sys.stderr)
    for issue in exc.issues:
        print(f"  - {issue}", file=sys.stderr)


def cmd_validate(args: argparse.Namespace) -> int:
    try:
        docs = load_manifest_file(args.file)
    except InvalidResources as exc:
        _print_issues(exc, args.file)
        return EXIT_REFUSED
    kinds: dict[str, int] = {}
    for d in docs:
        kinds[d.resource.kind] = kinds.get(d.resource.kind, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    print(f"{args.file}: valid ({len(docs)} resources: {summary})")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="healthgate",
        description="Composite health and automatic cross-region failover.",
    )
    parser.add_argument("--version", action="version", version=f"healthgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("validate", help="check a manifest offline (no server needed)")
    p.add_argument("-f", "--file", required=True, help="manifest (YAML, one resource per document)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("simulate", help="replay a what-if scenario in virtual time")
    p.add_argument("-f", "--file", required=True, help="manifest")
    p.add_argument("--scenario", required=True, help="scenario (YAML); see examples/")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.add_argument("--no-endpoints", action="store_true", help="hide endpoint-level transitions")
    p.set_defaults(func=cmd_simulate)
    return parser


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
