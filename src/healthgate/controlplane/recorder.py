"""Transitions leave the engine here: log lines, store, live subscribers.

Every record is written at once as one JSON line on the ``healthgate.transitions``
logger (time, project, region, kind, name, from, to, reason), then persisted
in batches by a background task: appended to the transition log and folded
into the last-known states that a restart resumes from. Live subscribers
(``events --follow``, the dashboard) receive each record with its log id after
it is stored, so a reconnecting client can resume from ``Last-Event-ID``
without gaps.

Persistence is off the probe path: the engine never waits for the disk. A
crash can lose the last batch of *transitions* (never an acknowledged resource
write); on restart the engine resumes from the states before it and the
probes re-establish the rest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from healthgate.controlplane.health_service import HealthListener
from healthgate.controlplane.saved_states import encode_record_states
from healthgate.health.states import Record, timestamp
from healthgate.store.base import WRITE_ID, Guard, NotLeader, Store, StoreError

log = logging.getLogger("healthgate.recorder")
transition_log = logging.getLogger("healthgate.transitions")
audit_log = logging.getLogger("healthgate.changes")  # who changed what (controlplane/changes.py)

Event = tuple[int, dict[str, Any]]
CLOSING: Event = (-1, {})  # sent to every subscriber when the server stops


iso = timestamp  # (kept under its old name for the API's renderings)


def log_line(record: dict[str, Any]) -> str:
    """A transition as one JSON line: the record itself, the same shape the
    API's events have (without the id, which the store gives it later)."""
    return json.dumps(record, separators=(",", ":"))


class Ledger(Protocol):
    """A cluster node's part of the recorder (cluster/ledger.py): whether
    this node writes now and under which guard, the records it computed but
    has not seen in the log, and a new leader's catch-up."""

    @property
    def writing(self) -> bool: ...

    @property
    def catching_up(self) -> bool: ...

    def guard(self) -> Guard | None: ...

    def stop(self) -> None: ...

    def computed(self, dicts: list[dict[str, Any]]) -> None: ...

    def logged(self, record: dict[str, Any]) -> None: ...

    async def catch_up(self, queued: list[dict[str, Any]]) -> list[dict[str, Any]] | None: ...


class TransitionRecorder(HealthListener):
    """The health service's first listener: every record logged, stored,
    streamed; states no longer kept forgotten."""

    def records(self, records: list[Record]) -> None:
        self.on_records(records)

    def forget(self, paths: list[str]) -> None:
        self.on_forget(paths)

    def __init__(
        self, store: Store, retention: int = 100_000, subscriber_queue: int = 10_000
    ) -> None:
        self.store = store
        self.retention = retention
        self.subscriber_queue = subscriber_queue
        self._pending: list[dict[str, Any]] = []
        self._pending_states: dict[str, Any] = {}
        self._pending_deletes: list[str] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._subscribers: set[asyncio.Queue[Event | None]] = set()
        # told (no arguments) whenever records reach the log (webhook deliveries)
        self.wakers: list[Callable[[], None]] = []
        self.counts: dict[tuple[str, str], int] = {}
        self.last_id = 0
        self._since_trim = 0
        # cluster mode (attach): only the elected leader persists, each of
        # its writes guarded by its election, and every node's subscribers
        # are fed from the stored log instead of from the writes
        # (broadcast_writes off; cluster/node.py calls publish)
        self.ledger: Ledger | None = None
        self.broadcast_writes = True
        # cluster mode: every record written carries a write id (store/base.py,
        # WRITE_ID), and after an append whose outcome was not known (etcd
        # timed out, a connection broke after the request went) the records
        # the log already holds are not appended again - a frozen etcd member
        # could apply a write and never answer it
        self.idempotent = False
        self._write_prefix = secrets.token_hex(6)
        self._write_count = 0
        self._uncertain = False
        # Change records waiting for the writer (embedded mode: one writer, ids in order)
        self._changes: list[tuple[list[dict[str, Any]], asyncio.Future[None]]] = []

    def attach(self, ledger: Ledger) -> None:
        """A cluster node's recorder: it writes only while ``ledger`` says so."""
        self.ledger = ledger
        self.broadcast_writes = False
        self.idempotent = True  # (an append that timed out is never made twice)

    @property
    def persist(self) -> bool:
        """This recorder writes the log now (always, embedded)."""
        return self.ledger is None or self.ledger.writing

    @property
    def guard(self) -> Guard | None:
        """What guards its writes (None embedded): the ledger's."""
        return None if self.ledger is None else self.ledger.guard()

    # -- inputs (called on the event loop, never block)

    def on_records(self, records: Sequence[Record]) -> None:
        dicts = [r.to_dict() for r in records]
        for d in dicts:
            transition_log.info(log_line(d), extra={"transition": d})
            # (kind, new state); a route's "to" is a NEG path, so routes are
            # counted by their new mode: a label holds one kind of value
            key = (d["kind"], str(d["mode"] if d["kind"] == "Route" else d["to"]))
            self.counts[key] = self.counts.get(key, 0) + 1
        if self.ledger is not None:  # a cluster node: unconfirmed until read in the log
            self.ledger.computed(dicts)
        if not self.persist:
            return
        self._pending.extend(dicts)
        self._pending_states.update(encode_record_states(records))
        self._kick()

    async def append_changes(self, records: list[dict[str, Any]]) -> None:
        """Change records (controlplane/changes.py), stored before this
        returns: through the writer in embedded mode (so that the log's ids
        and what subscribers receive stay in order), straight to the store
        in cluster mode - any node may append to the log; every node's log
        follower publishes it."""
        if not records:
            return
        for d in records:
            audit_log.info(log_line(d), extra={"transition": d})
        if self.broadcast_writes:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._changes.append((records, done))
            self._kick()
            await done
            return
        await asyncio.to_thread(self.store.append_log, records, None)

    async def _write_changes(self) -> None:
        changes, self._changes = self._changes, []
        records = [r for batch, _ in changes for r in batch]
        try:
            ids = await asyncio.to_thread(self.store.append_log, records, None)
        except Exception as exc:
            for _, done in changes:
                if not done.done():
                    done.set_exception(exc)
            return
        self.last_id = max(self.last_id, *ids)
        for event_id, record in zip(ids, records, strict=True):
            self._broadcast((event_id, record))
        for _, done in changes:
            if not done.done():
                done.set_result(None)

    async def append_own(self, records: Sequence[Record]) -> None:
        """Cluster mode: records of this node's own (its data planes'
        Convergence records), appended by this node whether it leads or not
        - every node's log follower then publishes them."""
        dicts = [r.to_dict() for r in records]
        for d in dicts:
            transition_log.info(log_line(d), extra={"transition": d})
        try:
            await asyncio.to_thread(self.store.append_log, dicts, None)
        except Exception:
            log.exception("could not append %d records of this node's own", len(dicts))

    def stop_persisting(self) -> None:
        """This node is no longer the leader: what is pending is not its to
        write. (A cluster node keeps its records among the ledger's
        unconfirmed.)"""
        if self.ledger is not None:
            self.ledger.stop()
        self._pending.clear()
        self._pending_states.clear()
        self._pending_deletes.clear()

    def kick(self) -> None:
        """Look for work now (a ledger that took over has some)."""
        self._kick()

    def save(self, states: dict[str, Any]) -> None:
        """Persist these states with the next batch (a new leader's full picture)."""
        self._pending_states.update(states)
        self._kick()

    def delete_states(self, keys: Sequence[str]) -> None:
        """Delete these saved states (whole keys) with the next batch - if
        this node still writes (a cluster node: leads)."""
        if self.persist and keys:
            self._pending_deletes += keys
            self._kick()

    def on_forget(self, paths: Sequence[str]) -> None:
        if not self.persist:
            return
        for p in paths:
            if "/endpoints/" in p:
                self._pending_deletes.append("endpoint/" + p)
            else:
                self._pending_deletes += [
                    "node/" + p,
                    "route/" + p,
                    "ramp/" + p,
                    "endpoint/" + p + "/endpoints/",
                ]
        self._kick()

    def _kick(self) -> None:
        self._idle.clear()
        self._wake.set()

    # -- the writer

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            ledger = self.ledger
            while ledger is not None and ledger.catching_up and self.persist:
                missed = await ledger.catch_up(self._pending)
                if missed is not None:
                    self._pending[:0] = missed
                    break
                await asyncio.sleep(1.0)
            while self._pending or self._pending_states or self._pending_deletes or self._changes:
                if self._changes:
                    await self._write_changes()
                batch, self._pending = self._pending, []
                states, self._pending_states = self._pending_states, {}
                deletes, self._pending_deletes = self._pending_deletes, []
                try:
                    ids = await asyncio.to_thread(self._write, batch, states, deletes)
                except NotLeader:
                    log.warning("deposed: %d transitions left to the new leader", len(batch))
                    self.stop_persisting()
                    continue
                except StoreError as exc:  # a full or read-only disk: one line, not a traceback
                    log.error(
                        "could not persist %d transitions: %s; retrying in 1 s", len(batch), exc
                    )
                    self._requeue(batch, states, deletes)
                    await asyncio.sleep(1.0)
                    continue
                except Exception:
                    log.exception("could not persist %d transitions; will retry", len(batch))
                    self._requeue(batch, states, deletes)
                    await asyncio.sleep(1.0)
                    continue
                if self.broadcast_writes:
                    for event_id, record in zip(ids, batch, strict=True):
                        self._broadcast((event_id, record))
            self._idle.set()

    def _requeue(
        self, batch: list[dict[str, Any]], states: dict[str, Any], deletes: list[str]
    ) -> None:
        """A write failed: put it back in front of what came meanwhile."""
        self._pending[:0] = batch
        states.update(self._pending_states)
        self._pending_states = states
        self._pending_deletes[:0] = deletes

    def _stamp(self, batch: list[dict[str, Any]]) -> dict[str, int]:
        """(In a worker thread.) Write ids on records not yet given one; after
        an append of unknown outcome, the ones the log holds already (write
        id -> log id)."""
        for d in batch:
            if WRITE_ID not in d:
                self._write_count += 1
                d[WRITE_ID] = f"{self._write_prefix}-{self._write_count}"
        if not self._uncertain:
            return {}
        written = self.store.written([d[WRITE_ID] for d in batch])
        self._uncertain = False
        if written:
            log.warning(
                "%d transitions of an append that timed out were written after all: "
                "not written again",
                len(written),
            )
        return written

    def _write(
        self, batch: list[dict[str, Any]], states: dict[str, Any], deletes: list[str]
    ) -> list[int]:
        """(In a worker thread.) The batch's log ids, in its order."""
        guard = self.guard
        if guard is None and self.ledger is not None:
            # deposed between taking the batch and writing it: never unguarded
            raise NotLeader("this node no longer leads")
        written = self._stamp(batch) if self.idempotent and batch else {}
        fresh = [d for d in batch if d.get(WRITE_ID) not in written] if written else batch
        try:
            new = iter(self.store.append_log(fresh, guard) if fresh else [])
        except NotLeader:
            raise  # (the guard failed: nothing was written)
        except Exception:
            self._uncertain = self.idempotent  # (it may have been applied)
            raise
        ids = [written[d[WRITE_ID]] if d.get(WRITE_ID) in written else next(new) for d in batch]
        if states or deletes:
            self.store.save_states(states, deletes, guard)
        if ids:
            self.last_id = ids[-1]
        self._since_trim += len(batch)
        if self._since_trim >= 1000:
            self._since_trim = 0
            self.store.trim_log(self.retention)
        return ids

    async def flush(self) -> None:
        """Wait until everything received so far is stored."""
        await self._idle.wait()

    # -- live subscribers

    def subscribe(self) -> asyncio.Queue[Event | None]:
        queue: asyncio.Queue[Event | None] = asyncio.Queue(self.subscriber_queue)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Event | None]) -> None:
        self._subscribers.discard(queue)

    def close_subscribers(self) -> None:
        """The server stops: every live stream is told to end (and its client
        to reconnect with Last-Event-ID), so shutdown does not wait on them."""
        for queue in list(self._subscribers):
            self._subscribers.discard(queue)
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(CLOSING)

    def publish(self, event: Event) -> None:
        """A stored transition, read back from the log (cluster mode), to every subscriber."""
        self.last_id = max(self.last_id, event[0])
        if self.ledger is not None:
            self.ledger.logged(event[1])
        self._broadcast(event)

    def _broadcast(self, event: Event) -> None:
        for wake in self.wakers:
            wake()
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                # a subscriber that cannot keep up is cut off; it resumes by id
                self._subscribers.discard(queue)
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(None)
