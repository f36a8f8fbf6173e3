"""The commands that talk to a running ``healthgate serve`` over its REST API."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from healthgate.cli.render import table
from healthgate.client import DEFAULT_SERVER, Client, HealthgateError, Unreachable
from healthgate.model.names import COLLECTION_TO_KIND, KIND_TO_COLLECTION, ResourcePath

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2

ALIASES = {
    "hc": "healthChecks",
    "neg": "networkEndpointGroups",
    "ig": "instanceGroups",
    "bs": "backendServices",
    "policy": "healthAggregationPolicies",
    "hap": "healthAggregationPolicies",
    "source": "healthSources",
    "hs": "healthSources",
    "composite": "compositeHealthChecks",
    "chc": "compositeHealthChecks",
    "fr": "forwardingRules",
    "sa": "serviceAttachments",
}
REGIONAL_ONLY = {
    "healthChecks",
    "networkEndpointGroups",
    "instanceGroups",
    "healthAggregationPolicies",
    "healthSources",
    "compositeHealthChecks",
    "serviceAttachments",
}


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_REFUSED) -> None:
        self.code = code
        super().__init__(message)


def collection_of(kind: str) -> str:
    k = kind.strip().lower()
    for name in (*KIND_TO_COLLECTION, *COLLECTION_TO_KIND):
        if k in (name.lower(), name.lower() + "s"):
            return KIND_TO_COLLECTION.get(name, name)
    if k in ALIASES:
        return ALIASES[k]
    known = ", ".join(KIND_TO_COLLECTION)
    raise CliError(f"unknown kind {kind!r} (one of {known}, or a collection name)", EXIT_USAGE)


def Api(args: argparse.Namespace) -> Client:
    """The library's client (healthgate/client.py) for the CLI's options."""
    return Client(
        args.server,
        token=getattr(args, "token", None),
        token_file=getattr(args, "token_file", None),
    )


def project_of(args: argparse.Namespace) -> str:
    project = args.project or os.environ.get("HEALTHGATE_PROJECT")
    if not project:
        raise CliError("--project is required (or set HEALTHGATE_PROJECT)", EXIT_USAGE)
    return str(project)


def region_of(args: argparse.Namespace) -> str | None:
    region: str | None = args.region or os.environ.get("HEALTHGATE_REGION")
    return region


def collection_url(args: argparse.Namespace, collection: str) -> str:
    project = project_of(args)
    region = region_of(args)
    if region and region != "global":
        return f"/v1/projects/{project}/regions/{region}/{collection}"
    if collection in REGIONAL_ONLY:
        raise CliError(f"{COLLECTION_TO_KIND[collection]} is regional: give --region", EXIT_USAGE)
    return f"/v1/projects/{project}/global/{collection}"


def emit(data: Any, output: str) -> None:
    if output == "json":
        print(json.dumps(data, indent=2))
    else:
        print(yaml.safe_dump(data, sort_keys=False, width=120).rstrip())


# ---------------------------------------------------------------------- commands


def read_manifest_arg(path: str) -> str:
    """The manifest a ``-f`` names: a file, or ``-`` for standard input; a
    clear refusal for a directory, a missing file or text that is not UTF-8."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except IsADirectoryError:
        raise CliError(f"{path} is a directory: give -f a manifest file (or - for stdin)") from None
    except FileNotFoundError:
        raise CliError(f"{path}: no such file") from None
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        name = "standard input" if path == "-" else path
        raise CliError(f"{name} is not UTF-8 text (byte {exc.start})") from None


def cmd_apply(args: argparse.Namespace) -> int:
    text = read_manifest_arg(args.file)
    with Api(args) as api:
        result = api.apply(text, dry_run=args.dry_run)
    print_plan(result.plan, "would be" if args.dry_run else "")
    return EXIT_OK


def print_plan(plan: dict[str, Any], mood: str) -> None:
    diff = plan.get("diff") or {}
    for sign, key in (("+", "create"), ("~", "update"), ("-", "delete")):
        for path in plan.get(key, []):
            print(f"{sign} {path}")
            for change in diff.get(path, []):
                before, after = (json.dumps(change[k]) for k in ("from", "to"))
                print(f"    {change['field']}: {before} -> {after}")
    verbs = {
        "create": "created",
        "update": "updated",
        "delete": "deleted",
        "unchanged": "unchanged",
    }
    for warning in plan.get("warnings") or []:
        print(f"warning: {warning}", file=sys.stderr)
    summary = ", ".join(f"{len(plan[k])} {v}" for k, v in verbs.items() if plan.get(k))
    prefix = f"{mood} " if mood else ""
    print(f"{prefix}{summary or 'nothing to do'}".strip())


def cmd_delete(args: argparse.Namespace) -> int:
    api = Api(args)
    if args.file:
        text = read_manifest_arg(args.file)
        result = api.delete_manifest(text, dry_run=args.dry_run)
        print_plan(result.plan, "would be" if args.dry_run else "")
        return EXIT_OK
    if not (args.kind and args.name):
        raise CliError("give -f FILE, or KIND NAME", EXIT_USAGE)
    collection = collection_of(args.kind)
    collection_url(args, collection)  # (the CLI's checks: --project, a regional kind's --region)
    print(f"- {api.delete(project_of(args), collection, args.name, region_of(args))}")
    return EXIT_OK


def state_summary(item: dict[str, Any]) -> tuple[str, str]:
    status = item.get("status") or {}
    if "route" in status:
        route = status["route"]
        shares = route.get("shares") or []
        if len(shares) > 1:  # (SPEC §6: "70% us-east1, 30% europe-west1")
            return ", ".join(f"{s['percent']:g}% {s['region']}" for s in shares), route["reason"]
        target = route["target"].rsplit("/", 1)[-1] if route["target"] else "(refuse)"
        return f"-> {target}", route["reason"]
    if "healthState" in status:
        return status["healthState"], status.get("reason", "")
    if "endpoints" in status:
        return (
            f"{status['healthy']}/{status['endpoints']} healthy",
            f"{status['unknown']} unknown, {status['unhealthy']} unhealthy"
            + (f", {status['degraded']} degraded" if status.get("degraded") else ""),
        )
    return "", ""


def cmd_get(args: argparse.Namespace) -> int:
    if not getattr(args, "watch", False):
        return get_once(args)
    # --watch: the table again whenever it changes (states, reasons), until Ctrl-C
    shown = ""
    while True:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            get_once(args)
        text = buffer.getvalue()
        if text != shown:
            stamp = time.strftime("%H:%M:%S")
            print(f"-- {stamp}\n{text}", end="", flush=True)
            shown = text
        time.sleep(args.interval)


def get_once(args: argparse.Namespace) -> int:
    api = Api(args)
    collection = collection_of(args.kind)
    collection_url(args, collection)  # (the CLI's checks: --project, a regional kind's --region)
    project, region = project_of(args), region_of(args)
    if args.name:
        item = api.get(project, collection, args.name, region)
        if args.output in ("table", "wide"):
            items = [item]
        else:
            emit(item, args.output)
            return EXIT_OK
    else:
        items = list(api.list(project, collection, region))
        if args.output not in ("table", "wide"):
            emit({"items": items}, args.output)
            return EXIT_OK
    wide = args.output == "wide"
    rows = []
    for item in items:
        state, why = state_summary(item)
        row = [item["name"], item.get("region", "global"), state]
        if wide:  # when it last changed, and what to send as a precondition
            since = (item.get("status") or {}).get("lastChange") or (
                (item.get("status") or {}).get("route") or {}
            ).get("since", "")
            row += [since, item.get("fingerprint", "")]
        rows.append([*row, why])
    headers = ["NAME", "REGION", "STATE", *(["SINCE", "FINGERPRINT"] if wide else []), "WHY"]
    print(table(headers, rows) if rows else "no resources")
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    api = Api(args)
    region = args.region or os.environ.get("HEALTHGATE_REGION")
    if not region:
        raise CliError("--region is required for a regional backend service", EXIT_USAGE)
    out = api.health(project_of(args), region, args.backend_service)
    if args.output != "table":
        emit(out, args.output)
        return EXIT_OK
    print(
        f"{out['backendService']}: {out['healthy']} of {out['endpoints']} endpoints healthy, {out['unknown']} unknown"
    )
    rows = []
    for ep in out["healthStatus"]:
        last = ep["lastResult"] or {}
        addr = f"{ep['ipAddress']}:{ep['port']}" if ep["port"] else ep["ipAddress"]
        rows.append([addr, ep["healthState"], last.get("description", "-"), ep["reason"]])
    print(table(["ENDPOINT", "STATE", "LAST PROBE", "REASON"], rows))
    return EXIT_OK


def cmd_describe(args: argparse.Namespace) -> int:
    api = Api(args)
    collection = collection_of(args.kind)
    item = api.request("GET", f"{collection_url(args, collection)}/{args.name}")
    emit(item, "yaml")
    print("\nwhy:")
    for line in reason_tree(api, item):
        print(line)
    return EXIT_OK


def _get(api: Client, path: str) -> dict[str, Any] | None:
    try:
        result: dict[str, Any] = api.request("GET", "/v1/" + path)
        return result
    except HealthgateError:
        return None


def _share_lines(pad: str, route: dict[str, Any]) -> list[str]:
    """Each share of a front end's route and what made it (SPEC §6: the dial,
    the health factor, the ramp's progress), and the ramps in progress."""
    lines = []
    for s in route.get("shares") or []:
        lines.append(f"{pad}  share {s['percent']:g}% {s['region']}: {s['reason']}")
    for r in route.get("ramps") or []:
        lines.append(
            f"{pad}  ramp {r['neg'].rsplit('/', 1)[-1]}: {r['progress']:.0%} of "
            f"{r['rampSec']} s since {r['start']}"
        )
    return lines


def _convergence_lines(pad: str, status: dict[str, Any]) -> list[str]:
    """How far the front end's last route decision has travelled (SPEC §11)."""
    decision = status.get("decision")
    if not decision:
        return []
    lines = [
        f"{pad}  decision {decision['generation']} at {decision['decidedAt']} "
        f"({decision['decision']}):"
    ]
    for r in status.get("convergence") or []:
        who = f"{r['dataPlane']} {r['instance']}" + (f" on {r['node']}" if r.get("node") else "")
        if r.get("appliedAfterMs") is not None:
            lines.append(f"{pad}    applied by {who} after {r['appliedAfterMs']:g} ms")
        else:
            lines.append(
                f"{pad}    NOT applied by {who} (waiting {r['waitingMs'] / 1000:.0f} s, "
                f"last seen {r['lastSeen']})"
            )
    return lines


def reason_tree(api: Client, item: dict[str, Any], depth: int = 0) -> list[str]:
    """From a front end, PSC NEG, forwarding rule or composite down to each endpoint's last probe."""
    pad = "  " * depth
    kind = item["kind"]
    state, why = state_summary(item)
    lines = [f"{pad}{kind} {item['selfLink']}: {state} - {why}".rstrip(" -")]
    me = ResourcePath.parse(item["selfLink"])
    if kind == "ForwardingRule" and me.is_global:
        lines += _share_lines(pad, (item.get("status") or {}).get("route") or {})
        lines += _convergence_lines(pad, item.get("status") or {})
        bs = _get(
            api,
            f"projects/{me.project}/global/backendServices/{item['backendService'].rsplit('/', 1)[-1]}",
        )
        for backend in (bs or {}).get("backends", []):
            neg = _get(api, _resolve(backend["group"], me, "networkEndpointGroups"))
            if neg:
                lines += reason_tree(api, neg, depth + 1)
    elif kind == "NetworkEndpointGroup" and item.get("pscTargetService"):
        att = _get(api, item["pscTargetService"])
        if att is None:
            lines.append(f"{pad}  (the producer's side is not visible to this token)")
        else:
            fr = _get(
                api,
                _resolve(
                    att["targetService"], ResourcePath.parse(att["selfLink"]), "forwardingRules"
                ),
            )
            if fr:
                lines += reason_tree(api, fr, depth + 1)
    elif kind == "ForwardingRule":
        comps = _get(api, f"projects/{me.project}/regions/{me.region}/compositeHealthChecks") or {
            "items": []
        }
        for comp in comps["items"]:
            if _resolve(comp["healthDestination"], me, "forwardingRules") == str(me):
                lines += reason_tree(api, comp, depth + 1)
    elif kind == "CompositeHealthCheck":
        for src in item["healthSources"]:
            source = _get(api, _resolve(src, me, "healthSources"))
            if source:
                lines += reason_tree(api, source, depth + 1)
    elif kind == "HealthSource" and item.get("sourceType") == "TRAFFIC":
        lines += _traffic_lines(pad, (item.get("status") or {}).get("traffic") or {})
    elif kind == "HealthSource":
        bs_path = ResourcePath.parse(_resolve(item["sources"][0], me, "backendServices"))
        health = _get(api, f"{bs_path}/health")
        if health:
            ejected = f", {health['ejected']} ejected" if health.get("ejected") else ""
            lines.append(
                f"{pad}  BackendService {bs_path}: {health['healthy']} of "
                f"{health['endpoints']} healthy{ejected}"
            )
            for ep in health["healthStatus"]:
                last = (ep["lastResult"] or {}).get("description", "no probe yet")
                addr = f"{ep['ipAddress']}:{ep['port']}" if ep["port"] else ep["ipAddress"]
                out = f" (ejected from real traffic until {ep['ejectedUntil']})" if ep.get(
                    "ejectedUntil"
                ) else ""  # fmt: skip
                lines.append(f"{pad}    {addr}: {ep['healthState']} - last probe: {last}{out}")
    return lines


def _traffic_lines(pad: str, traffic: dict[str, Any]) -> list[str]:
    """A TRAFFIC source's window: this node's, and every node's in a cluster."""
    lines = []
    mine = traffic.get("thisNode")
    if mine:
        lines.append(f"{pad}  real traffic (this node): {mine['state']} - {mine['reason']}")
    for node, v in (traffic.get("nodes") or {}).items():
        judged = "" if v.get("judged") else " (too little traffic to judge)"
        lines.append(f"{pad}  node {node}: {v['state']}{judged} - {v['reason']}")
    return lines


def _resolve(ref: str, referrer: ResourcePath, collection: str) -> str:
    from healthgate.model.names import resolve_reference

    return str(resolve_reference(ref, referrer, collection))


def cmd_events(args: argparse.Namespace) -> int:
    api = Api(args)
    project = project_of(args)
    kind, resource, state = (getattr(args, key) or None for key in ("kind", "resource", "state"))
    since = time.time() - parse_duration(args.since) if args.since else None
    if not args.follow:
        for event in api.events(project, kind, resource, state, since=since, limit=args.limit):
            print_event({"id": event.id, **event.record}, args.output)
        return EXIT_OK
    last: int | None = None
    if since is not None:
        for event in api.events(project, kind, resource, state, since=since, limit=10000):
            print_event({"id": event.id, **event.record}, args.output)
            last = event.id
        if last is None:  # (nothing since then: follow from the end of the log)
            last = int(
                api.request("GET", f"/v1/projects/{project}/events", params={"limit": 1})["last"]
            )

    def retrying(why: Exception | None, delay: float) -> None:
        if isinstance(why, Unreachable):
            print(f"{why}; retrying in {delay:g} s", file=sys.stderr, flush=True)
        else:  # the server went away mid-stream
            name = type(why).__name__ if why else "closed"
            print(f"stream ended ({name}); reconnecting", file=sys.stderr, flush=True)

    for event in api.watch_events(project, last, kind, resource, state, on_retry=retrying):
        print_event({"id": event.id, **event.record}, args.output)
    return EXIT_OK


def parse_duration(text: str, option: str = "--since") -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return float(text[:-1]) * units[text[-1]]
    if text.replace(".", "", 1).isdigit():
        return float(text)
    raise CliError(f"{option} expects a duration like 30s, 10m, 2h, got {text!r}", EXIT_USAGE)


def print_event(item: dict[str, Any], output: str) -> None:
    if output == "json":
        print(json.dumps(item, separators=(",", ":")), flush=True)
        return
    from healthgate.controlplane.recorder import iso

    if item.get("kind") == "Change":  # who changed what
        print(
            f"{iso(item['time'])}  Change               {item['project']:<40} "
            f"{item.get('actor')} {item.get('action')}: {item['reason']}",
            flush=True,
        )
        return
    name = item.get("name") or str(item.get("frontend", "")).rsplit("/", 1)[-1]
    where = f"{item['project']}/{item.get('region', 'global')}/{name}"
    frm = str(item["from"]).rsplit("/", 1)[-1] if item["from"] else "-"
    to = str(item["to"]).rsplit("/", 1)[-1] if item["to"] else "(refuse)"
    print(
        f"{iso(item['time'])}  {item['kind']:<20} {where:<40} {frm} -> {to}  {item['reason']}",
        flush=True,
    )


def cmd_export(args: argparse.Namespace) -> int:
    """A configuration for another data plane that follows healthgate."""
    text = Api(args).export(project_of(args), args.frontend, args.target, args.agent, args.instance)
    print(text, end="")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    """``healthgate report BACKEND_SERVICE ENDPOINT STATE [--note TEXT]``:
    pushed health for a PUSH check (SPEC §10)."""
    region = region_of(args)
    if region is None or region == "global":
        raise CliError("a report is for a regional backend service: give --region", EXIT_USAGE)
    out = Api(args).report(
        project_of(args), region, args.backend_service, args.endpoint, args.state, args.note
    )
    print(f"{out['endpoint']}: {out['healthState']} (reported {out['reported']}, "
          f"until {out['expireTime']})")  # fmt: skip
    return EXIT_OK


def cmd_shift(args: argparse.Namespace) -> int:
    """``healthgate shift away|list|extend|end``: manual moves that expire (SPEC §6)."""
    api = Api(args)
    project = project_of(args)
    if args.action == "away":
        if not args.target or not args.for_ or not args.comment:
            raise CliError(
                "healthgate shift away REGION|PATH --for DURATION --comment TEXT", EXIT_USAGE
            )
        out = api.shift_away(
            project,
            args.target,
            parse_duration(args.for_, "--for"),
            args.comment,
            force=args.force,
            name=args.name,
        )
        print(f"{out['name']}: away from {out['awayFrom']} until {out['expireTime']}")
        for neg in out["affects"]:
            print(f"  takes no traffic: {neg}")
        if out["affectsOtherProjects"]:
            print(f"  and {out['affectsOtherProjects']} PSC NEGs of other projects")
        return EXIT_OK
    if args.action == "list":
        rows = [
            [
                s["name"],
                s["awayFrom"],
                s["expireTime"] if s["active"] else "ended",
                f"{s['secondsLeft'] // 60} min" if s["active"] else "-",
                s["actor"],
                s["comment"],
            ]
            for s in api.shifts(project, include_ended=args.all)
        ]
        headers = ["NAME", "AWAY FROM", "UNTIL", "LEFT", "BY", "COMMENT"]
        print(table(headers, rows) if rows else "no shifts")
        return EXIT_OK
    if not args.target:
        raise CliError(f"healthgate shift {args.action} NAME", EXIT_USAGE)
    if args.action == "extend":
        if not args.for_:
            raise CliError("healthgate shift extend NAME --for DURATION", EXIT_USAGE)
        out = api.extend_shift(
            project, args.target, parse_duration(args.for_, "--for"), args.comment
        )
        print(f"{out['name']}: now until {out['expireTime']}")
        return EXIT_OK
    api.end_shift(project, args.target)
    print(f"{args.target}: ended")
    return EXIT_OK


def when(text: str, option: str) -> float | str:
    """An RFC 3339 time as it is, seconds since 1970 (at least 10 digits)
    as they are, or a duration (30m, 6h) as that long ago."""
    if "T" in text or (text[:4].isdigit() and "-" in text):
        return text
    digits = text.split(".", 1)[0]
    if digits.isdigit() and len(digits) >= 10:
        return float(text)
    return time.time() - parse_duration(text, option)


def cmd_replay(args: argparse.Namespace) -> int:
    """``healthgate replay --from T [--to T] [-f CANDIDATE]...`` (SPEC §11)."""
    candidate = None
    if args.file:
        candidate = "\n---\n".join(read_manifest_arg(path) for path in args.file)
    out = Api(args).replay(
        when(args.from_, "--from"), when(args.to, "--to") if args.to else None, candidate
    )
    if args.output == "json":
        emit(out, "json")
        return EXIT_OK
    print(
        f"replayed {out['results']:,} probe results of {out['endpoints']:,} endpoints "
        f"(history from {out['historyStart'] or 'nothing kept'})"
    )
    for path, why in sorted(out["approximate"].items()):
        print(f"  not replayed exactly: {path}: {why}")
    if out["noHistory"]:
        print(f"  no history for {len(out['noHistory'])} endpoints (they stay UNKNOWN)")
    if out.get("historyTruncated"):
        print("  (some history was left out: a node or worker did not answer, or too much)")
    if out["firstDifference"] is None:
        print("no difference: the candidate does what happened")
    else:
        print(f"first difference: {out['firstDifference']}")
        print(f"{out['differences']} differences in all")
    rows = [
        [
            r["recorded"]["timestamp"] if r["recorded"] else "-",
            r["replayed"]["timestamp"] if r["replayed"] else "-",
            r["kind"],
            r["path"].rsplit("/", 1)[-1],
            str(r["to"]).rsplit("/", 1)[-1],
            r["summary"].split(": ", 1)[-1],
        ]
        for r in out["rows"]
        if args.all or not r["same"]
    ]
    if rows:
        print(table(["RECORDED", "WITH THE CANDIDATE", "KIND", "NAME", "TO", ""], rows))
    return EXIT_OK


def cmd_practice(args: argparse.Namespace) -> int:
    """``healthgate practice start|list|history``: practice runs (SPEC §11)."""
    api = Api(args)
    project = project_of(args)
    if args.action == "start":
        if not args.name:
            raise CliError("healthgate practice start NAME", EXIT_USAGE)
        out = api.start_practice_run(project, args.name)
        if args.output == "json":
            emit(out, "json")
        else:
            print(f"{args.name}: STARTED - {out['reason']}")
        return EXIT_OK
    if args.action == "list":
        runs = [r for r in api.practice_runs(project) if not args.name or r["name"] == args.name]
        if args.output == "json":
            emit(runs, "json")
            return EXIT_OK
        rows = []
        for r in runs:
            status = r.get("status") or {}
            last = status.get("last") or {}
            under_way = status.get("underWay")
            rows.append(
                [
                    r["name"],
                    r["awayFrom"],
                    f"{r['durationSec']} s",
                    f"under way until {under_way['until']}" if under_way else "-",
                    status.get("next", "-" if r.get("schedule") else "by hand"),
                    f"{last['to']} {last['timestamp']}" if last else "-",
                    last.get("reason", ""),
                ]
            )
        headers = ["NAME", "AWAY FROM", "FOR", "NOW", "NEXT", "LAST", "WHY"]
        print(table(headers, rows) if rows else "no practice runs")
        return EXIT_OK
    resource = f"projects/{project}/global/practiceRuns/{args.name}" if args.name else None
    events = api.events(project, kind="PracticeRun", resource=resource, limit=args.limit)
    records = [e.record for e in events]
    if args.output == "json":
        emit(records, "json")
        return EXIT_OK
    rows = [[e["timestamp"], e["name"], e["to"], e["reason"]] for e in records]
    print(table(["TIME", "RUN", "OUTCOME", "WHY"], rows) if rows else "no practice runs yet")
    return EXIT_OK


def cmd_demo_control(args: argparse.Namespace) -> int:
    api = Api(args)
    if args.action == "status":
        emit(api.request("GET", "/v1/demo"), "yaml")
        return EXIT_OK
    if not args.region:
        raise CliError(f"healthgate demo {args.action} REGION", EXIT_USAGE)
    if args.action == "break":
        body: dict[str, Any] = {"mode": args.mode}
        if args.endpoints:
            body["endpoints"] = args.endpoints
        out = api.request("POST", f"/v1/demo/regions/{args.region}/break", json=body)
        print(f"{out['region']}: {out['endpoints']} endpoint(s) now {out['mode']}")
    else:
        out = api.request("POST", f"/v1/demo/regions/{args.region}/heal")
        print(f"{out['region']}: {out['endpoints']} endpoint(s) healthy again")
    return EXIT_OK


def add_client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", help=f"API URL (default: $HEALTHGATE_SERVER or {DEFAULT_SERVER})")
    p.add_argument("--project", help="project (default: $HEALTHGATE_PROJECT)")
    p.add_argument("--region", help="region, or 'global' (default: $HEALTHGATE_REGION)")
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="read the bearer token from FILE (default: $HEALTHGATE_TOKEN_FILE)",
    )
    p.add_argument(
        "--token",
        help="bearer token (default: $HEALTHGATE_TOKEN); visible to every local user in the "
        "process list: prefer --token-file",
    )


def run_client(func: Any, args: argparse.Namespace) -> int:
    try:
        rc: int = func(args)
        return rc
    except CliError as exc:
        print(str(exc), file=sys.stderr)
        return exc.code
    except HealthgateError as exc:  # (the server refused, or nothing answered)
        print(exc.describe(), file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return EXIT_OK
