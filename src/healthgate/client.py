"""A Python client of healthgate's REST API - what the ``healthgate`` CLI
itself uses, for automation that should not scrape the CLI's output.

    from healthgate.client import Client

    with Client("http://10.0.0.5:7400", token_file="/etc/healthgate/ci-token") as hg:
        result = hg.apply(open("world.yaml").read())
        print(result.created, result.updated)
        rule = hg.get("web", "forwardingRules", "shop-frontend")
        print(rule["status"]["route"]["target"])
        for event in hg.watch_events("web"):
            print(event.id, event.kind, event.path, event.to, event.reason)

Every call raises :class:`HealthgateError` (the server refused: its code,
status, message and per-field details) or :class:`Unreachable` (nothing
answered). The server, token and project default to the CLI's environment
variables (``HEALTHGATE_SERVER``, ``HEALTHGATE_TOKEN_FILE`` /
``HEALTHGATE_TOKEN``). docs/client.md has more examples.
"""

from __future__ import annotations

import builtins
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import yaml

DEFAULT_SERVER = "http://127.0.0.1:7400"
# Seconds a kept-alive connection may wait idle for its next request. The
# server closes one idle for 5 s (api/listener.py IDLE_TIMEOUT), and httpx's
# default expiry is those same 5 s: a request sent on a connection as the
# server closed it met a reset (ECONNRESET) - a script polling every ~5 s
# now and then, and CI once. Letting it go well before rules that out.
KEEPALIVE_EXPIRY = 2.0
KEEPALIVE = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY)

__all__ = [
    "DEFAULT_SERVER",
    "ApplyResult",
    "Client",
    "Event",
    "HealthgateError",
    "Unreachable",
]


class HealthgateError(Exception):
    """The server refused a request (or answered something that is not healthgate)."""

    def __init__(
        self,
        message: str,
        code: int = 0,
        status: str = "",
        details: list[dict[str, Any]] | None = None,
    ) -> None:
        self.code = code
        self.status = status
        self.message = message
        self.details = details or []
        super().__init__(self.describe())

    def describe(self) -> str:
        """The message and each detail on a line (what the CLI prints)."""
        if not self.code:
            return self.message
        lines = [f"error {self.code} {self.status}: {self.message}"]
        for d in self.details:
            where = f"document {d['document']}, " if d.get("document") else ""
            res = f"{d['resource']}: " if d.get("resource") else ""
            fld = f"field {d['field']}: " if d.get("field") else ""
            lines.append(f"  - {where}{res}{fld}{d.get('description', '')}")
        return "\n".join(lines)

    @classmethod
    def of(cls, resp: httpx.Response) -> HealthgateError:
        try:
            err = resp.json()["error"]
            return cls(
                str(err["message"]), int(err["code"]), str(err["status"]), err.get("details")
            )
        except (ValueError, KeyError, TypeError):
            return cls(f"HTTP {resp.status_code}: {resp.text[:500]}", resp.status_code, "")


class Unreachable(HealthgateError):
    """Nothing answers at the server's address (it may come back)."""


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What an apply (or a manifest delete) did, or would do with ``dry_run``."""

    dry_run: bool
    plan: dict[str, Any]
    revision: int | None  # the store's revision after the write (None for a dry run)
    fingerprints: dict[str, str] = field(default_factory=dict)

    @property
    def created(self) -> list[str]:
        return list(self.plan.get("create", []))

    @property
    def updated(self) -> list[str]:
        return list(self.plan.get("update", []))

    @property
    def deleted(self) -> list[str]:
        return list(self.plan.get("delete", []))

    @property
    def unchanged(self) -> list[str]:
        return list(self.plan.get("unchanged", []))


@dataclass(frozen=True, slots=True)
class Event:
    """One record of the transition log, with its id (resume after it)."""

    id: int
    record: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.record.get("kind"))

    @property
    def path(self) -> str:
        return str(self.record.get("path"))

    @property
    def to(self) -> Any:
        return self.record.get("to")

    @property
    def reason(self) -> str:
        return str(self.record.get("reason"))

    @property
    def time(self) -> float:
        return float(self.record.get("time", 0.0))


def _token(token: str | None, token_file: str | os.PathLike[str] | None) -> str | None:
    from healthgate.secrets import read_secret

    path = token_file or os.environ.get("HEALTHGATE_TOKEN_FILE")
    if path:
        try:
            return read_secret(os.fspath(path), "token file")
        except ValueError as exc:
            raise HealthgateError(str(exc)) from None
    return token or os.environ.get("HEALTHGATE_TOKEN") or None


def collection_path(project: str, collection: str, region: str | None = None) -> str:
    """``/v1/projects/P/regions/R/C`` (or ``/global/C`` without a region)."""
    if region and region != "global":
        return f"/v1/projects/{project}/regions/{region}/{collection}"
    return f"/v1/projects/{project}/global/{collection}"


class Client:
    """healthgate's REST API (see the module doc). Thread-safe as httpx's
    client is; close it (or use ``with``) when done."""

    def __init__(
        self,
        server: str | None = None,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.server = (server or os.environ.get("HEALTHGATE_SERVER") or DEFAULT_SERVER).rstrip("/")
        secret = _token(token, token_file)
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        self.http = httpx.Client(
            base_url=self.server,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=5.0),
            limits=KEEPALIVE,
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------ plumbing

    def response(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request; the response when it succeeded (2xx/3xx)."""
        try:
            resp = self.http.request(method, path, **kw)
        except httpx.ConnectError:
            raise Unreachable(
                f"cannot reach healthgate at {self.server}: is `healthgate serve` running? "
                "(--server, HEALTHGATE_SERVER)"
            ) from None
        except httpx.HTTPError as exc:
            raise HealthgateError(f"{self.server}: {exc}") from None
        if resp.status_code >= 400:
            raise HealthgateError.of(resp)
        return resp

    def request(self, method: str, path: str, **kw: Any) -> Any:
        """One request; its JSON answer."""
        resp = self.response(method, path, **kw)
        try:
            return resp.json()
        except ValueError:
            kind = resp.headers.get("content-type", "no content type")
            raise HealthgateError(
                f"{self.server} is not a healthgate API: it answered {method} {path} with "
                f"HTTP {resp.status_code} ({kind}); check the server's address"
            ) from None

    # ------------------------------------------------------------------ manifests

    @staticmethod
    def _manifest(manifest: str | Iterable[Mapping[str, Any]]) -> str:
        if isinstance(manifest, str):
            return manifest
        return yaml.safe_dump_all([dict(d) for d in manifest], sort_keys=False)

    def apply(
        self, manifest: str | Iterable[Mapping[str, Any]], dry_run: bool = False
    ) -> ApplyResult:
        """Create or update every resource of a manifest (YAML text, or a
        list of resource dicts) at once, or nothing."""
        body = {"manifest": self._manifest(manifest), "dryRun": dry_run}
        out = self.request("POST", "/v1/apply", json=body)
        return ApplyResult(
            bool(out["dryRun"]), out["plan"], out.get("revision"), out.get("fingerprints") or {}
        )

    def delete_manifest(
        self, manifest: str | Iterable[Mapping[str, Any]], dry_run: bool = False
    ) -> ApplyResult:
        """Delete every resource a manifest names, at once, or nothing."""
        body = {"manifest": self._manifest(manifest), "dryRun": dry_run}
        out = self.request("POST", "/v1/delete", json=body)
        return ApplyResult(bool(out["dryRun"]), out["plan"], out.get("revision"))

    # ------------------------------------------------------------------ resources

    def get(
        self, project: str, collection: str, name: str, region: str | None = None
    ) -> dict[str, Any]:
        """One resource as the API shows it (``status`` included)."""
        result: dict[str, Any] = self.request(
            "GET", f"{collection_path(project, collection, region)}/{name}"
        )
        return result

    def list(
        self, project: str, collection: str, region: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Every resource of a collection, page after page."""
        url = collection_path(project, collection, region)
        token: str | None = None
        while True:
            page = self.request("GET", url, params={"pageToken": token} if token else None)
            yield from page["items"]
            token = page.get("nextPageToken")
            if not token:
                return

    def create(
        self, project: str, collection: str, resource: Mapping[str, Any], region: str | None = None
    ) -> dict[str, Any]:
        result: dict[str, Any] = self.request(
            "POST", collection_path(project, collection, region), json=dict(resource)
        )
        return result

    def replace(
        self,
        project: str,
        collection: str,
        name: str,
        resource: Mapping[str, Any],
        region: str | None = None,
        fingerprint: str | None = None,
    ) -> dict[str, Any]:
        """PUT: refused (412) when ``fingerprint`` is given and stale."""
        headers = {"If-Match": fingerprint} if fingerprint else {}
        result: dict[str, Any] = self.request(
            "PUT",
            f"{collection_path(project, collection, region)}/{name}",
            json=dict(resource),
            headers=headers,
        )
        return result

    def delete(
        self,
        project: str,
        collection: str,
        name: str,
        region: str | None = None,
        fingerprint: str | None = None,
    ) -> str:
        """Delete one resource; its path."""
        headers = {"If-Match": fingerprint} if fingerprint else {}
        out = self.request(
            "DELETE", f"{collection_path(project, collection, region)}/{name}", headers=headers
        )
        return str(out["deleted"])

    def health(self, project: str, region: str, backend_service: str) -> dict[str, Any]:
        """A regional backend service's endpoints, their states and last probes."""
        path = f"/v1/projects/{project}/regions/{region}/backendServices/{backend_service}/health"
        result: dict[str, Any] = self.request("GET", path)
        return result

    def report(
        self,
        project: str,
        region: str,
        backend_service: str,
        endpoint: str,
        state: str,
        note: str = "",
    ) -> dict[str, Any]:
        """Report an endpoint's state for a backend service whose check is
        ``type: PUSH`` (SPEC §10): HEALTHY, UNHEALTHY or DEGRADED, until the
        check's ttlSec runs out. The answer: the endpoint's state now and
        when the report expires."""
        path = (
            f"/v1/projects/{project}/regions/{region}/backendServices/{backend_service}"
            "/endpoints:report"
        )
        body = {"endpoint": endpoint, "state": state, "note": note}
        result: dict[str, Any] = self.request("POST", path, json=body)
        return result

    # ------------------------------------------------------------------ the log

    def events(
        self,
        project: str,
        kind: str | None = None,
        resource: str | None = None,
        state: str | None = None,
        since: float | None = None,
        after: int | None = None,
        limit: int = 1000,
    ) -> builtins.list[Event]:
        """Records of the transition log (newest last), filtered."""
        params: dict[str, Any] = {"limit": limit}
        for key, value in (("kind", kind), ("resource", resource), ("state", state)):
            if value:
                params[key] = value
        if since is not None:
            params["since"] = since
        if after is not None:
            params["after"] = after
        out = self.request("GET", f"/v1/projects/{project}/events", params=params)
        return [Event(int(item["id"]), item) for item in out["items"]]

    def watch_events(
        self,
        project: str,
        after: int | None = None,
        kind: str | None = None,
        resource: str | None = None,
        state: str | None = None,
        retry: bool = True,
        max_delay: float = 10.0,
        on_retry: Callable[[Exception | None, float], None] | None = None,
    ) -> Iterator[Event]:
        """The log as it grows, for as long as the caller iterates. A stream
        that drops (the server restarts, a cluster node dies) is resumed
        after the last event seen - on any node of a cluster - with backoff
        (``on_retry(why, delay)`` is told each time); nothing is skipped and
        nothing repeated. ``retry=False`` raises instead. Closing the client
        (from another thread) ends the watch at its next retry."""
        params = {k: v for k, v in (("kind", kind), ("resource", resource), ("state", state)) if v}
        last = after
        delay = 0.5
        while not self.http.is_closed:
            why: Exception | None = None
            try:
                for event in self._stream(project, params, last):
                    last = event.id
                    delay = 0.5
                    yield event
            except (Unreachable, httpx.HTTPError) as exc:
                if not retry:
                    raise
                why = exc
            except RuntimeError:  # (httpx: "the client has been closed")
                if self.http.is_closed:
                    return
                raise
            if on_retry is not None:
                on_retry(why, delay)
            time.sleep(delay)
            delay = min(delay * 2, max_delay)

    def _stream(self, project: str, params: dict[str, Any], last: int | None) -> Iterator[Event]:
        headers = {"Last-Event-ID": str(last)} if last is not None else {}
        try:
            with self.http.stream(
                "GET",
                f"/v1/projects/{project}/events/stream",
                params=params,
                headers=headers,
                timeout=httpx.Timeout(None, connect=5.0),
            ) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise HealthgateError.of(resp)
                event_id, data = None, None
                for line in resp.iter_lines():
                    if line.startswith("id: "):
                        event_id = int(line[4:])
                    elif line.startswith("data: "):
                        data = line[6:]
                    elif line == "" and event_id is not None and data is not None:
                        yield Event(event_id, json.loads(data))
                        event_id, data = None, None
        except httpx.ConnectError:
            raise Unreachable(f"cannot reach healthgate at {self.server}") from None

    # ------------------------------------------------------------------ shifts

    def shift_away(
        self,
        project: str,
        away_from: str,
        expires_in: float,
        comment: str,
        force: bool = False,
        name: str | None = None,
    ) -> dict[str, Any]:
        """Move traffic away from a region (or a PSC NEG or service attachment
        path) for ``expires_in`` seconds (60 to 259,200); refused (409) when
        it would leave a front end with nothing, unless an admin ``force``s it."""
        body: dict[str, Any] = {
            "awayFrom": away_from,
            "expiresInSec": int(expires_in),
            "comment": comment,
        }
        if force:
            body["force"] = True
        if name:
            body["name"] = name
        result: dict[str, Any] = self.request("POST", f"/v1/projects/{project}/shifts", json=body)
        return result

    def shifts(self, project: str, include_ended: bool = False) -> builtins.list[dict[str, Any]]:
        """The project's active shifts (with ``include_ended``, the ones that
        ended in the last hour too)."""
        params = {"all": "true"} if include_ended else None
        out = self.request("GET", f"/v1/projects/{project}/shifts", params=params)
        items: builtins.list[dict[str, Any]] = out["items"]
        return items

    def extend_shift(
        self, project: str, name: str, expires_in: float, comment: str | None = None
    ) -> dict[str, Any]:
        """A shift's end moved to ``expires_in`` seconds from now (at most 72 h)."""
        body: dict[str, Any] = {"expiresInSec": int(expires_in)}
        if comment:
            body["comment"] = comment
        result: dict[str, Any] = self.request(
            "PATCH", f"/v1/projects/{project}/shifts/{name}", json=body
        )
        return result

    def end_shift(self, project: str, name: str) -> None:
        """End a shift now: traffic may come back."""
        self.request("DELETE", f"/v1/projects/{project}/shifts/{name}")

    def replay(
        self,
        since: float | str,
        until: float | str | None = None,
        candidate: str | Iterable[Mapping[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """What ``candidate`` (documents replacing the resources as they
        are; None: the world as it is) would have done with the probes' real
        history from ``since`` to ``until`` (seconds, or RFC 3339 times),
        side by side with what happened (SPEC §11)."""
        body: dict[str, Any] = {"from": since}
        if until is not None:
            body["to"] = until
        if candidate is not None:
            body["manifest"] = self._manifest(candidate)
        result: dict[str, Any] = self.request("POST", "/v1/replay", json=body, timeout=120.0)
        return result

    def start_practice_run(self, project: str, name: str) -> dict[str, Any]:
        """Start a practice run now (SPEC §11): its STARTED record; refused
        (409) in an incident, a blocked window or against the safety rule."""
        result: dict[str, Any] = self.request(
            "POST", f"/v1/projects/{project}/global/practiceRuns/{name}:start"
        )
        return result

    def practice_runs(self, project: str) -> builtins.list[dict[str, Any]]:
        """The project's practice runs, each with its status (under way,
        next start, last record)."""
        return builtins.list(self.list(project, "practiceRuns", "global"))

    # ------------------------------------------------------------------ the rest

    def cluster(self) -> dict[str, Any]:
        """``{"mode": "embedded"}``, or a cluster node's view of the cluster."""
        result: dict[str, Any] = self.request("GET", "/v1/cluster")
        return result

    def export(
        self,
        project: str,
        frontend: str,
        target: str = "haproxy",
        agent: str | None = None,
        instance: str | None = None,
    ) -> str:
        """A configuration for another data plane (``haproxy``) that follows
        healthgate (``instance``: the name its agent checks carry)."""
        params = {"agent": agent} if agent else {}
        if instance:
            params["instance"] = instance
        path = f"/v1/projects/{project}/global/forwardingRules/{frontend}/{target}"
        return self.response("GET", path, params=params).text

    def ready(self) -> bool:
        """Does the server answer /readyz with 200 (loaded and serving)?"""
        try:
            return self.http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False
