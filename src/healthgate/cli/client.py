"""The commands that talk to a running ``healthgate serve`` over its REST API."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from healthgate.cli.render import table
from healthgate.model.names import COLLECTION_TO_KIND, KIND_TO_COLLECTION, ResourcePath

DEFAULT_SERVER = "http://127.0.0.1:7400"
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


class Unreachable(CliError):
    """Nothing answers at the server's address (it may come back)."""


def collection_of(kind: str) -> str:
    k = kind.strip().lower()
    for name in (*KIND_TO_COLLECTION, *COLLECTION_TO_KIND):
        if k in (name.lower(), name.lower() + "s"):
            return KIND_TO_COLLECTION.get(name, name)
    if k in ALIASES:
        return ALIASES[k]
    known = ", ".join(KIND_TO_COLLECTION)
    raise CliError(f"unknown kind {kind!r} (one of {known}, or a collection name)", EXIT_USAGE)


def token_of(args: argparse.Namespace) -> str | None:
    """The bearer token: from --token-file (or $HEALTHGATE_TOKEN_FILE), else
    --token or $HEALTHGATE_TOKEN (an argument is visible to every local
    user in the process list: a file is the better place)."""
    from healthgate.secrets import read_secret

    path = getattr(args, "token_file", None) or os.environ.get("HEALTHGATE_TOKEN_FILE")
    if path:
        try:
            return read_secret(path, "--token-file")
        except ValueError as exc:
            raise CliError(str(exc)) from None
    token: str | None = getattr(args, "token", None) or os.environ.get("HEALTHGATE_TOKEN")
    return token


class Api:
    def __init__(self, args: argparse.Namespace) -> None:
        self.base = (args.server or os.environ.get("HEALTHGATE_SERVER") or DEFAULT_SERVER).rstrip(
            "/"
        )
        token = token_of(args)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(
            base_url=self.base, headers=headers, timeout=httpx.Timeout(30.0, connect=5.0)
        )

    def request(self, method: str, path: str, **kw: Any) -> Any:
        resp = self.response(method, path, **kw)
        try:
            return resp.json()
        except ValueError:
            kind = resp.headers.get("content-type", "no content type")
            raise CliError(
                f"{self.base} is not a healthgate API: it answered {method} {path} with "
                f"HTTP {resp.status_code} ({kind}); check --server or HEALTHGATE_SERVER"
            ) from None

    def response(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = self.client.request(method, path, **kw)
        except httpx.ConnectError:
            raise Unreachable(
                f"cannot reach healthgate at {self.base}: is `healthgate serve` running? (--server, HEALTHGATE_SERVER)"
            ) from None
        except httpx.HTTPError as exc:
            raise CliError(f"{self.base}: {exc}") from None
        if resp.status_code >= 400:
            raise CliError(format_error(resp))
        return resp

    def stream(
        self, path: str, params: dict[str, Any], last_id: int | None
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        headers = {"Last-Event-ID": str(last_id)} if last_id is not None else {}
        try:
            with self.client.stream(
                "GET",
                path,
                params=params,
                headers=headers,
                timeout=httpx.Timeout(None, connect=5.0),
            ) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise CliError(format_error(resp))
                event_id, data = None, None
                for line in resp.iter_lines():
                    if line.startswith("id: "):
                        event_id = int(line[4:])
                    elif line.startswith("data: "):
                        data = line[6:]
                    elif line == "" and event_id is not None and data is not None:
                        yield event_id, json.loads(data)
                        event_id, data = None, None
        except httpx.ConnectError:
            raise Unreachable(f"cannot reach healthgate at {self.base}") from None


def format_error(resp: httpx.Response) -> str:
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {resp.status_code}: {resp.text[:500]}"
    lines = [f"error {err['code']} {err['status']}: {err['message']}"]
    for d in err.get("details") or []:
        where = f"document {d['document']}, " if d.get("document") else ""
        res = f"{d['resource']}: " if d.get("resource") else ""
        field = f"field {d['field']}: " if d.get("field") else ""
        lines.append(f"  - {where}{res}{field}{d.get('description', '')}")
    return "\n".join(lines)


def project_of(args: argparse.Namespace) -> str:
    project = args.project or os.environ.get("HEALTHGATE_PROJECT")
    if not project:
        raise CliError("--project is required (or set HEALTHGATE_PROJECT)", EXIT_USAGE)
    return str(project)


def collection_url(args: argparse.Namespace, collection: str) -> str:
    project = project_of(args)
    region = args.region or os.environ.get("HEALTHGATE_REGION")
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
    out = Api(args).request("POST", "/v1/apply", json={"manifest": text, "dryRun": args.dry_run})
    print_plan(out, "would be" if args.dry_run else "")
    return EXIT_OK


def print_plan(out: dict[str, Any], mood: str) -> None:
    plan = out["plan"]
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
        out = api.request("POST", "/v1/delete", json={"manifest": text, "dryRun": args.dry_run})
        print_plan(out, "would be" if args.dry_run else "")
        return EXIT_OK
    if not (args.kind and args.name):
        raise CliError("give -f FILE, or KIND NAME", EXIT_USAGE)
    url = f"{collection_url(args, collection_of(args.kind))}/{args.name}"
    out = api.request("DELETE", url)
    print(f"- {out['deleted']}")
    return EXIT_OK


def state_summary(item: dict[str, Any]) -> tuple[str, str]:
    status = item.get("status") or {}
    if "route" in status:
        route = status["route"]
        target = route["target"].rsplit("/", 1)[-1] if route["target"] else "(refuse)"
        return f"-> {target}", route["reason"]
    if "healthState" in status:
        return status["healthState"], status.get("reason", "")
    if "endpoints" in status:
        return (
            f"{status['healthy']}/{status['endpoints']} healthy",
            f"{status['unknown']} unknown, {status['unhealthy']} unhealthy",
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
    url = collection_url(args, collection_of(args.kind))
    if args.name:
        item = api.request("GET", f"{url}/{args.name}")
        if args.output in ("table", "wide"):
            items = [item]
        else:
            emit(item, args.output)
            return EXIT_OK
    else:
        items, token = [], None
        while True:
            page = api.request("GET", url, params={"pageToken": token} if token else None)
            items += page["items"]
            token = page.get("nextPageToken")
            if not token:
                break
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
    out = api.request(
        "GET",
        f"/v1/projects/{project_of(args)}/regions/{region}/backendServices/{args.backend_service}/health",
    )
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


def _get(api: Api, path: str) -> dict[str, Any] | None:
    try:
        result: dict[str, Any] = api.request("GET", "/v1/" + path)
        return result
    except CliError:
        return None


def reason_tree(api: Api, item: dict[str, Any], depth: int = 0) -> list[str]:
    """From a front end, PSC NEG, forwarding rule or composite down to each endpoint's last probe."""
    pad = "  " * depth
    kind = item["kind"]
    state, why = state_summary(item)
    lines = [f"{pad}{kind} {item['selfLink']}: {state} - {why}".rstrip(" -")]
    me = ResourcePath.parse(item["selfLink"])
    if kind == "ForwardingRule" and me.is_global:
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
    elif kind == "HealthSource":
        bs_path = ResourcePath.parse(_resolve(item["sources"][0], me, "backendServices"))
        health = _get(api, f"{bs_path}/health")
        if health:
            lines.append(
                f"{pad}  BackendService {bs_path}: {health['healthy']} of {health['endpoints']} healthy"
            )
            for ep in health["healthStatus"]:
                last = (ep["lastResult"] or {}).get("description", "no probe yet")
                addr = f"{ep['ipAddress']}:{ep['port']}" if ep["port"] else ep["ipAddress"]
                lines.append(f"{pad}    {addr}: {ep['healthState']} - last probe: {last}")
    return lines


def _resolve(ref: str, referrer: ResourcePath, collection: str) -> str:
    from healthgate.model.names import resolve_reference

    return str(resolve_reference(ref, referrer, collection))


def cmd_events(args: argparse.Namespace) -> int:
    api = Api(args)
    project = project_of(args)
    params: dict[str, Any] = {}
    for key in ("kind", "resource", "state"):
        if getattr(args, key):
            params[key] = getattr(args, key)
    if args.since:
        params["since"] = time.time() - parse_duration(args.since)
    if not args.follow:
        params["limit"] = args.limit
        out = api.request("GET", f"/v1/projects/{project}/events", params=params)
        for item in out["items"]:
            print_event(item, args.output)
        return EXIT_OK
    last: int | None = None
    if params.get("since"):
        out = api.request(
            "GET", f"/v1/projects/{project}/events", params={**params, "limit": 10000}
        )
        for item in out["items"]:
            print_event(item, args.output)
        last = out["last"]
    params.pop("since", None)
    delay = 0.5
    while True:  # reconnect after a dropped stream, resuming by id, with backoff
        try:
            for event_id, record in api.stream(
                f"/v1/projects/{project}/events/stream", params, last
            ):
                last = event_id
                delay = 0.5
                print_event({"id": event_id, **record}, args.output)
        except Unreachable as exc:
            print(f"{exc}; retrying in {delay:g} s", file=sys.stderr, flush=True)
        except httpx.HTTPError as exc:  # the server went away mid-stream
            print(f"stream ended ({type(exc).__name__}); reconnecting", file=sys.stderr)
        time.sleep(delay)
        delay = min(delay * 2, 10.0)


def parse_duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return float(text[:-1]) * units[text[-1]]
    if text.replace(".", "", 1).isdigit():
        return float(text)
    raise CliError(f"--since expects a duration like 30s, 10m, 2h, got {text!r}", EXIT_USAGE)


def print_event(item: dict[str, Any], output: str) -> None:
    if output == "json":
        print(json.dumps(item, separators=(",", ":")), flush=True)
        return
    from healthgate.controlplane.recorder import iso

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
    api = Api(args)
    project = project_of(args)
    params = {"agent": args.agent} if args.agent else {}
    path = f"/v1/projects/{project}/global/forwardingRules/{args.frontend}/{args.target}"
    print(api.response("GET", path, params=params).text, end="")
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
    except KeyboardInterrupt:
        return EXIT_OK
