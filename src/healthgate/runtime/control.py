"""The control plane: resources in the store, mirrored into the engine.

Writes are serialised by one lock and go: plan (pure) -> store transaction
(durable, with fingerprint preconditions) -> engine and scheduler. A write is
acknowledged only after the store committed it, so ``kill -9`` loses nothing
that a client was told succeeded; and since the engine is rebuilt from the
store on start-up, the two can never disagree after a crash.

Fingerprints are the store revision that last changed a resource, as a
string. A create, replace or apply that names a fingerprint which is no longer
current is refused with 412 and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from healthgate.health.engine import Route
from healthgate.health.states import HealthState
from healthgate.model.names import ResourcePath
from healthgate.model.plan import Plan, plan_apply, plan_delete
from healthgate.model.resources import Resource
from healthgate.model.validation import Document, Issue, parse_resource
from healthgate.runtime.health_service import HealthService
from healthgate.store.base import PreconditionFailed, Store, Txn

log = logging.getLogger("healthgate.control")

RESOURCE_PREFIX = "resources/"
OUTPUT_ONLY = ("fingerprint", "selfLink", "creationTimestamp", "updateTimestamp", "status")


class ControlError(Exception):
    """A refused request; the API turns it into its one error shape."""

    def __init__(self, code: int, message: str, details: Sequence[Issue] = ()) -> None:
        self.code = code
        self.message = message
        self.details = list(details)
        super().__init__(message)


@dataclass(slots=True)
class Stored:
    resource: Resource
    revision: int
    created: float
    updated: float

    @property
    def fingerprint(self) -> str:
        return str(self.revision)


@dataclass(slots=True)
class ApplyOutcome:
    plan: Plan
    revision: int | None = None  # None for a dry run
    fingerprints: dict[str, str] = field(default_factory=dict)


def split_output_fields(data: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Drop output-only fields (so GET -> edit -> PUT works); return the fingerprint given."""
    body = {k: v for k, v in data.items() if k not in OUTPUT_ONLY}
    fp = data.get("fingerprint")
    return body, (str(fp) if fp is not None else None)


def parse_documents(items: Sequence[tuple[Any, int | None, int | None]]) -> list[Document]:
    docs, issues = [], []
    for data, index, line in items:
        res, problems = parse_resource(data, index, line)
        issues += problems
        if res is not None:
            docs.append(Document(res, index, line))
    if issues:
        raise ControlError(400, "invalid resources", issues)
    return docs


class ControlPlane:
    def __init__(self, store: Store, health: HealthService) -> None:
        self.store = store
        self.health = health
        self.stored: dict[ResourcePath, Stored] = {}
        self._lock = asyncio.Lock()
        # awaited after every committed change, before the client is answered
        # (so that "apply, then connect" finds the listener open)
        self.on_change: list[Callable[[Mapping[ResourcePath, Resource]], Awaitable[None]]] = []

    @property
    def resources(self) -> dict[ResourcePath, Resource]:
        return {p: s.resource for p, s in self.stored.items()}

    # ------------------------------------------------------------------ start-up

    async def load(self) -> int:
        """Read every resource from the store and resume the engine from the last
        known states. Returns the number of resources."""
        docs = await asyncio.to_thread(self.store.list_prefix, RESOURCE_PREFIX)
        stored: dict[ResourcePath, Stored] = {}
        for doc in docs:
            res, issues = parse_resource(doc.value)
            if res is None:  # written by a newer or older version: keep serving the rest
                log.error(
                    "stored resource %s no longer parses: %s", doc.key, "; ".join(map(str, issues))
                )
                continue
            stored[res.path] = Stored(res, doc.revision, doc.created, doc.updated)
        self.stored = stored
        self.health.mute = True
        try:
            self.health.apply(s.resource for s in stored.values())
        finally:
            self.health.mute = False
        states = await asyncio.to_thread(self.store.load_states)
        endpoints, nodes, routes = decode_states(states)
        records = self.health.engine.restore(self.health.clock(), endpoints, nodes, routes)
        self.health.emit(records)
        return len(stored)

    # ------------------------------------------------------------------ writes

    async def apply(
        self,
        documents: Sequence[Document],
        dry_run: bool = False,
        fingerprints: Mapping[ResourcePath, str] | None = None,
        create_only: bool = False,
        replace_only: bool = False,
    ) -> ApplyOutcome:
        async with self._lock:
            current = self.resources
            for doc in documents:
                path = doc.resource.path
                if create_only and path in current:
                    raise ControlError(409, f"{path} already exists")
                if replace_only and path not in current:
                    raise ControlError(404, f"{path} not found")
            plan = plan_apply(current, documents)
            if plan.issues:
                raise ControlError(400, "invalid resources", plan.issues)
            expect = self._expectations(fingerprints or {})
            changed = plan.create + plan.update
            if dry_run or not changed:
                # a stale fingerprint is refused even when nothing would change
                self._check_expectations(expect)
            if dry_run:
                return ApplyOutcome(plan)
            txn = Txn(
                puts={RESOURCE_PREFIX + str(p): plan.result[p].to_wire() for p in changed},
                expect=expect,
            )
            revision = await self._commit(txn) if changed else self.store_revision()
            self._mirror(plan, revision)
            await self._notify(plan)
            return ApplyOutcome(
                plan, revision, {str(p): self.stored[p].fingerprint for p in changed}
            )

    async def delete(
        self,
        paths: Sequence[ResourcePath],
        dry_run: bool = False,
        fingerprints: Mapping[ResourcePath, str] | None = None,
    ) -> ApplyOutcome:
        async with self._lock:
            plan = plan_delete(self.resources, paths)
            missing = [i for i in plan.issues if i.message.endswith("not found")]
            if missing and len(missing) == len(plan.issues) and len(paths) == 1:
                raise ControlError(404, missing[0].message)
            if plan.issues:
                code = 409 if any("in use" in i.message for i in plan.issues) else 404
                raise ControlError(code, "cannot delete: " + plan.issues[0].message, plan.issues)
            expect = self._expectations(fingerprints or {})
            if dry_run:
                self._check_expectations(expect)
                return ApplyOutcome(plan)
            txn = Txn(deletes=[RESOURCE_PREFIX + str(p) for p in plan.delete], expect=expect)
            revision = await self._commit(txn)
            self._mirror(plan, revision)
            await self._notify(plan)
            return ApplyOutcome(plan, revision)

    async def _notify(self, plan: Plan) -> None:
        if not plan.changes:
            return
        resources = self.resources
        for callback in self.on_change:
            try:
                await callback(resources)
            except Exception:  # the change is committed; a listener's trouble is logged
                log.exception("change listener failed")

    def store_revision(self) -> int:
        return max((s.revision for s in self.stored.values()), default=0)

    def _expectations(self, fingerprints: Mapping[ResourcePath, str]) -> dict[str, int | None]:
        expect: dict[str, int | None] = {}
        for path, fp in fingerprints.items():
            try:
                expect[RESOURCE_PREFIX + str(path)] = int(fp)
            except ValueError:
                raise ControlError(
                    412,
                    f"fingerprint {fp!r} of {path} is not current",
                    [Issue("fingerprint", "stale or malformed fingerprint")],
                ) from None
        return expect

    def _check_expectations(self, expect: Mapping[str, int | None]) -> None:
        for key, revision in expect.items():
            current = self.stored.get(ResourcePath.parse(key.removeprefix(RESOURCE_PREFIX)))
            if (current.revision if current else None) != revision:
                raise ControlError(
                    412,
                    f"fingerprint of {key.removeprefix(RESOURCE_PREFIX)} is not current",
                    [Issue("fingerprint", "stale fingerprint: read the resource again")],
                )

    async def _commit(self, txn: Txn) -> int:
        try:
            return await asyncio.to_thread(self.store.commit, txn)
        except PreconditionFailed as exc:
            path = exc.key.removeprefix(RESOURCE_PREFIX)
            raise ControlError(
                412,
                f"fingerprint of {path} is not current (it is {exc.actual}, you sent {exc.expected})",
                [Issue("fingerprint", "stale fingerprint: read the resource again and retry")],
            ) from None

    def _mirror(self, plan: Plan, revision: int) -> None:
        now = self.health.clock()
        for path in plan.delete:
            self.stored.pop(path, None)
        for path in plan.create:
            self.stored[path] = Stored(plan.result[path], revision, now, now)
        for path in plan.update:
            old = self.stored[path]
            self.stored[path] = Stored(plan.result[path], revision, old.created, now)
        if plan.changes:
            result = self.health.apply(s.resource for s in self.stored.values())
            deleted = [str(p) for p in plan.delete] + result.removed_paths
            self.health.forget_states(deleted)


# ---------------------------------------------------------------------- state codec


def encode_record_states(records: Sequence[Any]) -> dict[str, Any]:
    """Records -> state-store puts (last write wins)."""
    puts: dict[str, Any] = {}
    for r in records:
        d = r.to_dict()
        if d["kind"] == "Route":
            puts["route/" + d["frontend"]] = {
                "target": d["to"],
                "mode": d["mode"],
                "reason": d["reason"],
                "since": d["time"],
                "attachment": getattr(r, "attachment", None),
            }
        elif d["kind"] == "Endpoint":
            puts["endpoint/" + d["path"]] = {"state": d["to"], "since": d["time"]}
        else:
            puts["node/" + d["path"]] = {
                "state": d["to"],
                "reason": d["reason"],
                "since": d["time"],
            }
    return puts


def decode_states(
    states: Mapping[str, Any],
) -> tuple[
    dict[str, tuple[HealthState, float]],
    dict[str, tuple[HealthState, str, float]],
    dict[str, Route],
]:
    endpoints: dict[str, tuple[HealthState, float]] = {}
    nodes: dict[str, tuple[HealthState, str, float]] = {}
    routes: dict[str, Route] = {}
    for key, v in states.items():
        kind, _, path = key.partition("/")
        try:
            if kind == "endpoint":
                endpoints[path] = (HealthState[v["state"]], float(v["since"]))
            elif kind == "node":
                nodes[path] = (HealthState[v["state"]], str(v["reason"]), float(v["since"]))
            elif kind == "route":
                routes[path] = Route(
                    path,
                    v["target"],
                    v.get("attachment"),
                    v["mode"],
                    v["reason"],
                    float(v["since"]),
                )
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring unreadable stored state %s", key)
    return endpoints, nodes, routes
