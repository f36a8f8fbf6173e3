"""The control plane: resources in the store, mirrored from its watch.

Theory of operation
-------------------
The store is the one source of truth. This process keeps a **mirror** of
every resource (``stored``), and the engine is fed from it - and the mirror
is fed by one thing only: the store's watch, from the revision of the
snapshot it loaded. A write does not touch the mirror; it goes:

1. **plan** against the mirror at its revision R (pure; off the event loop,
   so a large manifest does not stall probes and listeners);
2. **commit** one store transaction whose preconditions are checked inside
   it: create-only and replace-only expectations, the fingerprints the
   client sent, and ``base_revision = R`` - nothing changed since the plan,
   so every rule the plan checked across resources (references, "nothing
   refers to what is deleted") still holds. If another writer got in first
   the commit is refused whole, the mirror catches up, and the write is
   planned again (a few times at most);
3. **wait** until the watch has brought this very commit into the mirror,
   the engine and the listeners, then answer. So "apply, then connect" finds
   the listener open, and a write acknowledged to a client is durable.

Because every write, this process's own included, reaches the mirror the
same way, several processes over one store (a cluster) see the same world.

Fingerprints are the store revision that last changed a resource, as a
string. A write that names a fingerprint which is no longer current is
refused (PRECONDITION_FAILED) and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.controlplane.health_service import HealthService
from healthgate.controlplane.offload import off_loop
from healthgate.controlplane.saved_states import decode_states
from healthgate.gcpause import gc_paused
from healthgate.model.addresses import Reserved
from healthgate.model.change import WorldChange
from healthgate.model.index import WorldIndex
from healthgate.model.manifest import OUTPUT_ONLY
from healthgate.model.names import ResourcePath
from healthgate.model.plan import (
    INCREMENTAL_MAX,
    Plan,
    plan_apply,
    plan_change,
    plan_delete_change,
)
from healthgate.model.resources import Resource
from healthgate.model.validation import Document, Issue, parse_resource
from healthgate.store.base import (
    EXISTS,
    Change,
    Compacted,
    PreconditionFailed,
    ResourceStore,
    RevisionMoved,
    StateStore,
    TooLarge,
    Txn,
    Unavailable,
)

log = logging.getLogger("healthgate.control")

RESOURCE_PREFIX = "resources/"


class ControlStore(ResourceStore, StateStore, Protocol):
    """What the control plane needs of a store."""


@dataclass(frozen=True, slots=True)
class ControlSettings:
    write_attempts: int = 5  # plans of one write when other writers keep getting in first
    apply_timeout: float = 30.0  # a commit not in the mirror by then is reported
    watch_retry: float = 1.0  # seconds between attempts to re-open a failed watch


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
    stored: dict[ResourcePath, Stored] = field(default_factory=dict)  # as written


def split_output_fields(data: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Drop output-only fields (so GET -> edit -> PUT works); return the fingerprint given."""
    body = {k: v for k, v in data.items() if k not in OUTPUT_ONLY}
    fp = data.get("fingerprint")
    return body, (str(fp) if fp is not None else None)


def parse_documents(items: Sequence[tuple[Any, int | None, int | None]]) -> list[Document]:
    docs, issues = [], []
    with gc_paused():  # (a large body: healthgate/gcpause.py)
        for data, index, line in items:
            res, problems = parse_resource(data, index, line)
            issues += problems
            if res is not None:
                docs.append(Document(res, index, line))
    if issues:
        raise ControlError(Refusal.INVALID, "invalid resources", issues)
    return docs


def resource_key(path: ResourcePath) -> str:
    return RESOURCE_PREFIX + str(path)


ChangeListener = Callable[[WorldChange], Awaitable[None]]


class ControlPlane:
    def __init__(
        self,
        store: ControlStore,
        health: HealthService,
        settings: ControlSettings | None = None,
    ) -> None:
        self.store = store
        self.health = health
        self.settings = settings or ControlSettings()
        self.stored: dict[ResourcePath, Stored] = {}
        # the resources of ``stored``, kept beside it change by change: what
        # every layer reads (read-only, through ``resources``), never copied
        self._world: dict[ResourcePath, Resource] = {}
        self._view: Mapping[ResourcePath, Resource] = MappingProxyType(self._world)
        # ... and what a plan looks up in it (model/index.py), kept the same way
        self.index = WorldIndex()
        self.revision = 0  # the store revision the mirror (and the engine) is at
        # awaited with each change (model/change.py) after it reaches the
        # mirror, before a writer waiting for it is answered
        self.on_change: list[ChangeListener] = []
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._follower: asyncio.Task[None] | None = None
        # serve's own addresses: a rule written may not take one (model/addresses.py)
        self.reserved: tuple[Reserved, ...] = ()

    @property
    def resources(self) -> Mapping[ResourcePath, Resource]:
        """The mirror's resources now (a read-only view: it moves with the
        mirror - take ``dict(...)`` for a copy that does not)."""
        return self._view

    # ------------------------------------------------------------------ start-up

    async def load(self) -> int:
        """Read every resource from the store and resume the engine from the
        last known states. Returns the number of resources."""
        snap = await asyncio.to_thread(self.store.snapshot, RESOURCE_PREFIX)
        stored: dict[ResourcePath, Stored] = {}
        with gc_paused():  # (a large world: healthgate/gcpause.py)
            for doc in snap.documents:
                res = _parse_stored(doc.key, doc.value)
                if res is not None:
                    stored[res.path] = Stored(res, doc.revision, doc.created, doc.updated)
        self.stored = stored
        self._world.clear()
        self._world.update((p, s.resource) for p, s in stored.items())
        self.index = WorldIndex.of(self._world.values())
        self.revision = snap.revision
        self.health.mute = True
        try:
            whole = WorldChange(snap.revision, 0.0, self._view, self._view, whole=True)
            self.health.apply_change(whole)
        finally:
            self.health.mute = False
        states = await asyncio.to_thread(self.store.load_states)
        endpoints, nodes, routes, ramps = decode_states(states)
        records = self.health.engine.restore(self.health.clock(), endpoints, nodes, routes, ramps)
        self.health.emit(records)
        self.health.schedule_timers()  # (a ramp in progress goes on)
        return len(stored)

    def start(self) -> None:
        """Follow the store's watch from the loaded revision (on the event loop)."""
        if self._follower is None:
            self._follower = asyncio.create_task(self._follow(), name="control-watch")

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
            self._follower = None
        for _, fut in self._waiters:
            fut.cancel()
        self._waiters.clear()

    # ------------------------------------------------------------------ the mirror

    async def _follow(self) -> None:
        while True:
            try:
                async for batch in self.store.watch(self.revision):
                    await self._take(batch)
            except Compacted:
                log.warning("the store's history moved past revision %d: reloading", self.revision)
                await self._reload()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the store watch failed at revision %d; retrying", self.revision)
                await asyncio.sleep(self.settings.watch_retry)

    async def _take(self, batch: Sequence[Change]) -> None:
        """One committed transaction into the mirror (parsed once), then as
        one change to the engine and the listeners."""
        if not batch:
            return
        put: dict[ResourcePath, Resource] = {}
        deleted: set[ResourcePath] = set()
        for change in batch:
            path_text = change.key.removeprefix(RESOURCE_PREFIX)
            if change.key == path_text:
                continue  # not a resource
            if change.value is None:
                old = self._pop(path_text)
                if old is not None:
                    deleted.add(old.resource.path)
                    put.pop(old.resource.path, None)
                continue
            res = _parse_stored(change.key, change.value)
            if res is None:
                continue
            before = self.stored.get(res.path)
            created = before.created if before else change.time
            self.stored[res.path] = Stored(res, change.revision, created, change.time)
            self._world[res.path] = res
            put[res.path] = res
            deleted.discard(res.path)
        # what the write causes (a dial's route change) is timed by the
        # commit's stored time - the same on every node - not by when this
        # node's watch delivered it (a new writer recorded such a change
        # twice, each node's with its own clock)
        when = max(c.time for c in batch)
        revision = batch[-1].revision
        self.index.take(put, deleted)
        await self._publish(WorldChange(revision, when, self._view, put, frozenset(deleted)))
        self._advance(revision)

    def _pop(self, path_text: str) -> Stored | None:
        try:
            path = ResourcePath.parse(path_text)
        except ValueError:
            return None
        self._world.pop(path, None)
        return self.stored.pop(path, None)

    async def _reload(self) -> None:
        """The watch cannot resume: take a new snapshot and make it the mirror."""
        snap = await asyncio.to_thread(self.store.snapshot, RESOURCE_PREFIX)
        fresh = {}
        for doc in snap.documents:
            res = _parse_stored(doc.key, doc.value)
            if res is not None:
                fresh[res.path] = Stored(res, doc.revision, doc.created, doc.updated)
        before = dict(self._world)
        self.stored = fresh
        self._world.clear()
        self._world.update((p, s.resource) for p, s in fresh.items())
        self.index = WorldIndex.of(self._world.values())
        change = WorldChange.between(snap.revision, time.time(), before, self._view)
        await self._publish(change)
        self._advance(snap.revision)

    async def _publish(self, change: WorldChange) -> None:
        """The mirror changed: the engine takes the change (at its commit's
        time), saved states of what is gone are forgotten, and every change
        listener is told."""
        result = self.health.apply_change(change)
        self.health.forget_states([str(p) for p in change.deleted] + result.removed_paths)
        for callback in self.on_change:
            try:
                await callback(change)
            except Exception:  # the change is committed; a listener's trouble is logged
                log.exception("change listener failed")

    def _advance(self, revision: int) -> None:
        self.revision = max(self.revision, revision)
        still = []
        for rev, fut in self._waiters:
            if rev <= self.revision:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((rev, fut))
        self._waiters = still

    async def wait_for_revision(self, revision: int) -> None:
        """Until the mirror has applied ``revision``."""
        if self.revision >= revision:
            return
        if self._follower is None:
            raise RuntimeError("ControlPlane.start() was not called: nothing follows the store")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((revision, fut))
        try:
            async with asyncio.timeout(self.settings.apply_timeout):
                await fut
        except TimeoutError:
            raise ControlError(
                Refusal.UNAVAILABLE,
                f"the write was committed at revision {revision}, but this server has not "
                f"applied it after {self.settings.apply_timeout:g} s (it is at {self.revision})",
            ) from None

    # ------------------------------------------------------------------ writes

    async def apply(
        self,
        documents: Sequence[Document],
        dry_run: bool = False,
        fingerprints: Mapping[ResourcePath, str] | None = None,
        create_only: bool = False,
        replace_only: bool = False,
        check: Callable[[], None] | None = None,
    ) -> ApplyOutcome:
        """``check``: a rule of the caller's over the world as it is now (the
        mirror and the engine at ``base``), run again at every attempt -
        raising refuses the write - so that it holds when the commit does
        (the commit is refused if anything changed since ``base``)."""
        given = _fingerprints(fingerprints or {})
        for attempt in range(self.settings.write_attempts):
            base = self.revision
            current = self.resources
            if check is not None:
                check()
            if create_only or replace_only:  # (one resource, from the REST API)
                for doc in documents:
                    path = doc.resource.path
                    if create_only and path in current:
                        raise ControlError(Refusal.CONFLICT, f"{path} already exists")
                    if replace_only and path not in current:
                        raise ControlError(Refusal.NOT_FOUND, f"{path} not found")
            if len(documents) <= INCREMENTAL_MAX:
                # the change against the world's index, on the loop: the work
                # is the change's (a dial in a world of a million endpoints
                # costs what it costs in a small one)
                plan = plan_change(current, self.index, documents, self.reserved)
            else:
                # a large manifest: the whole world checked, off the event loop
                # (a 5 MB manifest plans for seconds; probes and listeners must
                # not wait for it) - on a copy, as the mirror moves meanwhile
                snapshot = dict(current)
                plan = await off_loop(plan_apply, snapshot, documents, self.reserved)
            if plan.issues:
                raise ControlError(Refusal.INVALID, "invalid resources", plan.issues)
            changed = plan.create + plan.update
            if dry_run or not changed:
                self._check_fingerprints(given)  # a stale one is refused even when nothing changes
                return ApplyOutcome(plan, None if dry_run else base)
            expect: dict[str, int | None] = {}
            if create_only or replace_only:
                for doc in documents:
                    expect[resource_key(doc.resource.path)] = None if create_only else EXISTS
            expect.update(given)
            txn = Txn(
                puts={resource_key(p): plan.result[p].to_wire() for p in changed},
                expect=expect,
                base_revision=base,
            )
            revision = await self._commit(txn, attempt)
            if revision is None:
                continue  # another writer got in first: plan again on the new world
            await self.wait_for_revision(revision)
            written = {p: self.stored[p] for p in changed if p in self.stored}
            return ApplyOutcome(
                plan, revision, {str(p): s.fingerprint for p, s in written.items()}, written
            )
        raise self._too_busy()

    async def delete(
        self,
        paths: Sequence[ResourcePath],
        dry_run: bool = False,
        fingerprints: Mapping[ResourcePath, str] | None = None,
    ) -> ApplyOutcome:
        given = _fingerprints(fingerprints or {})
        for attempt in range(self.settings.write_attempts):
            base = self.revision
            plan = plan_delete_change(self.resources, self.index, paths)
            if plan.missing and len(paths) == 1:
                raise ControlError(Refusal.NOT_FOUND, f"{plan.missing[0]} not found")
            if plan.in_use:
                raise ControlError(
                    Refusal.IN_USE, "cannot delete: " + plan.in_use[0].message, plan.issues
                )
            if plan.issues:
                raise ControlError(
                    Refusal.NOT_FOUND, "cannot delete: " + plan.issues[0].message, plan.issues
                )
            if dry_run:
                self._check_fingerprints(given)
                return ApplyOutcome(plan)
            expect: dict[str, int | None] = {resource_key(p): EXISTS for p in plan.delete}
            expect.update(given)
            txn = Txn(
                deletes=[resource_key(p) for p in plan.delete], expect=expect, base_revision=base
            )
            revision = await self._commit(txn, attempt)
            if revision is None:
                continue
            await self.wait_for_revision(revision)
            return ApplyOutcome(plan, revision)
        raise self._too_busy()

    async def _commit(self, txn: Txn, attempt: int) -> int | None:
        """The new revision, or None when the world moved since the plan (the
        mirror has caught up when this returns: plan again)."""
        try:
            return await asyncio.to_thread(self.store.commit, txn)
        except RevisionMoved as exc:
            log.info("write planned at revision %d lost a race (attempt %d)", exc.base, attempt + 1)
            await self.wait_for_revision(exc.actual)
            return None
        except PreconditionFailed as exc:
            raise _precondition_error(exc) from None
        except Unavailable as exc:
            raise ControlError(
                Refusal.UNAVAILABLE, f"the store cannot take writes: {exc}"
            ) from None
        except TooLarge as exc:
            raise ControlError(Refusal.INVALID, str(exc)) from None

    def _too_busy(self) -> ControlError:
        return ControlError(
            Refusal.UNAVAILABLE,
            f"other writes kept changing the store while this one was planned "
            f"({self.settings.write_attempts} attempts); try again",
        )

    def _check_fingerprints(self, given: Mapping[str, int | None]) -> None:
        for key, revision in given.items():
            current = self.stored.get(ResourcePath.parse(key.removeprefix(RESOURCE_PREFIX)))
            if (current.revision if current else None) != revision:
                raise ControlError(
                    Refusal.PRECONDITION_FAILED,
                    f"fingerprint of {key.removeprefix(RESOURCE_PREFIX)} is not current",
                    [Issue("fingerprint", "stale fingerprint: read the resource again")],
                )


def _fingerprints(fingerprints: Mapping[ResourcePath, str]) -> dict[str, int | None]:
    expect: dict[str, int | None] = {}
    for path, fp in fingerprints.items():
        try:
            expect[resource_key(path)] = int(fp)
        except ValueError:
            raise ControlError(
                Refusal.PRECONDITION_FAILED,
                f"fingerprint {fp[:40]!r} of {path} is not current",
                [Issue("fingerprint", "stale or malformed fingerprint")],
            ) from None
    return expect


def _precondition_error(exc: PreconditionFailed) -> ControlError:
    path = exc.key.removeprefix(RESOURCE_PREFIX)
    if exc.expected is None:
        return ControlError(Refusal.CONFLICT, f"{path} already exists")
    if exc.actual is None:
        return ControlError(Refusal.NOT_FOUND, f"{path} not found")
    return ControlError(
        Refusal.PRECONDITION_FAILED,
        f"fingerprint of {path} is not current (it is {exc.actual}, you sent {exc.expected})",
        [Issue("fingerprint", "stale fingerprint: read the resource again and retry")],
    )


def _parse_stored(key: str, value: Mapping[str, Any]) -> Resource | None:
    try:
        res, issues = parse_resource(value)
    except RecursionError:  # (a value nested past every bound: skipped, never a frozen mirror)
        log.error("stored resource %s no longer parses: nested too deeply", key)
        return None
    if res is None:  # written by a newer or older version: keep serving the rest
        log.error("stored resource %s no longer parses: %s", key, "; ".join(map(str, issues)))
    return res
