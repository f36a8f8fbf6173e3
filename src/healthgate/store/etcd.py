"""The etcd store: the store contract over an etcd v3 cluster (3.4 and later).

Cluster mode's source of truth (SPEC §4). It passes the contract suite the
memory and SQLite stores pass (tests/contract/), with etcd's own revision as
the store revision: fingerprints are etcd revisions, a write is one etcd
transaction with its preconditions as compares.

What the client library (aetcd's generated gRPC stubs; its client is not
used) leaves out is written once, here:

* **several members**: requests go to one member at a time; a member that
  refuses, times out or stops answering is left for the next one
  (:class:`Members`). Reads are retried on the next member; a write is
  retried only when it was surely not sent (``UNAVAILABLE``), never after a
  timeout (it may have committed): that one is reported as
  :class:`~healthgate.store.base.Unavailable` and the caller plans again.
* **deadlines**: every request has one (``request_timeout``): without quorum
  etcd holds a request until its own timeout (7 s), and fail static wants a
  fast 503.
* **watches that resume**: :meth:`EtcdStore.watch_prefix` re-opens a broken
  watch from the last revision seen + 1 (on the next member), raises
  :class:`Compacted` when that history is gone, asks for the "require
  leader" flag (a member cut off from its quorum ends the watch instead of
  going silent), and runs a watchdog: every ``progress_every`` seconds it
  asks for a progress report, and a watch that answered nothing for
  ``watch_deadline`` seconds is dropped and re-opened elsewhere (a member
  frozen with SIGSTOP keeps its TCP connection open and silent forever).
* **leases kept alive**: :class:`Lease`.
* **compaction**: the store compacts etcd's history itself, keeping the last
  ``history`` revisions (as the SQLite store does), at most once per
  ``compact_every`` revisions.

Key layout, under a namespace (``/healthgate`` by default)::

    <ns>/r/<key>         resources: {"v": document, "c": created, "u": updated}
    <ns>/m/resources     touched by every resource write (the base_revision guard)
    <ns>/s/<key>         saved engine states (StateStore)
    <ns>/l/<id:020d>     the transition log; <ns>/m/log holds the last id
    <ns>/o/<endpoint>/<vantage region>   endpoint opinions of probers (cluster)
    <ns>/n/<node>        live nodes, each under its lease (cluster)
    <ns>/e/<scope>/<lease>               elections (cluster)

``base_revision`` (nothing changed since the plan) is a compare on
``<ns>/m/resources``: etcd cannot compare "the whole store", and the store's
revision also moves with states and log writes, which do not invalidate a
plan of resources.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any, TypeVar

import grpc
import grpc.aio
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as stubs

from healthgate.store.base import (
    EXISTS,
    Change,
    Compacted,
    Document,
    LogEntry,
    LogQuery,
    NotLeader,
    PreconditionFailed,
    RevisionMoved,
    Snapshot,
    StoreError,
    TooLarge,
    Txn,
    Unavailable,
    record_matches,
)

log = logging.getLogger("healthgate.store.etcd")

T = TypeVar("T")

MAX_OPS = 100  # etcd refuses a transaction of more than 128 operations (--max-txn-ops)
LOG_ID_WIDTH = 20
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # the end of a stream
_CLOSING: set[asyncio.Task[None]] = set()


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def parse_endpoints(text: str) -> list[str]:
    """``etcd://h1:p1,h2:p2`` (or ``h1:p1,h2:p2``) -> ["h1:p1", "h2:p2"]."""
    body = text.removeprefix("etcd://")
    out = []
    for raw in body.split(","):
        part = raw.strip().rstrip("/")
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--store: {part!r} is not HOST:PORT")
        out.append(part)
    if not out:
        raise ValueError("--store: etcd:// needs at least one HOST:PORT")
    return out


@dataclass(frozen=True, slots=True)
class EtcdSettings:
    request_timeout: float = 2.0
    watch_deadline: float = 3.0  # a watch silent this long (no answer to a progress ask) is dropped
    progress_every: float = 1.0
    history: int = 10_000  # revisions of history kept
    compact_every: int = 1_000


class Members:
    """The member addresses and which one is in use; thread-safe."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        self.endpoints = list(endpoints)
        self._current = 0
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def current(self) -> str:
        with self._lock:
            return self.endpoints[self._current]

    def skip(self, endpoint: str) -> None:
        """``endpoint`` failed: the next request goes to the next member."""
        with self._lock:
            if self.endpoints[self._current] == endpoint:
                self._current = (self._current + 1) % len(self.endpoints)

    def channel(self, endpoint: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(endpoint)
            if ch is None:
                ch = grpc.insecure_channel(endpoint)
                self._channels[endpoint] = ch
            return ch

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str  # without the namespace
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class Event:
    revision: int
    kv: KeyValue
    deleted: bool


class EtcdStore:
    """The whole store contract on etcd. Synchronous methods (called from
    threads, as the SQLite store's are) use a blocking gRPC channel; the
    watches are asyncio streams on the caller's loop."""

    def __init__(
        self,
        endpoints: Sequence[str],
        namespace: str = "/healthgate",
        settings: EtcdSettings | None = None,
        history: int | None = None,
    ) -> None:
        self.settings = settings or EtcdSettings()
        if history is not None:
            self.settings = EtcdSettings(
                **{
                    **{f: getattr(self.settings, f) for f in self.settings.__dataclass_fields__},
                    "history": history,
                    "compact_every": 1,
                }
            )
        self.members = Members(endpoints)
        self.ns = namespace.rstrip("/")
        self._r = f"{self.ns}/r/"
        self._meta = f"{self.ns}/m/resources".encode()
        self._log_meta = f"{self.ns}/m/log".encode()
        self._compacted_at = 0
        # cluster mode: a guarded writer (the elected leader) sets this to its
        # election key and that key's create revision
        self.guard: tuple[str, int] | None = None
        self._aio: dict[str, grpc.aio.Channel] = {}

    # ------------------------------------------------------------------ plumbing

    def _key(self, key: str) -> bytes:
        return f"{self.ns}/{key}".encode()

    def full_key(self, key: str) -> str:
        """A key with the namespace, as etcd knows it."""
        return f"{self.ns}/{key}"

    def _strip(self, raw: bytes) -> str:
        return raw.decode()[len(self.ns) + 1 :]

    def _call(self, method: str, request: Any, *, write: bool = False) -> Any:
        """One unary KV/Lease/Maintenance call on the current member, moving
        on to the next member when it cannot be reached."""
        attempts = len(self.members.endpoints) + 1
        last: grpc.RpcError | None = None
        for _ in range(attempts):
            endpoint = self.members.current()
            channel = self.members.channel(endpoint)
            service, name = method.split(".")
            stub = getattr(stubs, f"{service}Stub")(channel)
            try:
                return getattr(stub, name)(request, timeout=self.settings.request_timeout)
            except grpc.RpcError as exc:
                code = exc.code()
                last = exc
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise _refusal(exc) from None  # etcd refused the request itself
                self.members.skip(endpoint)
                if code in _RETRYABLE or (not write and code == grpc.StatusCode.DEADLINE_EXCEEDED):
                    continue
                break
        assert last is not None
        detail = last.details() or last.code().name
        raise Unavailable(f"etcd {self.members.current()}: {detail}") from None

    def _range(self, key: bytes, end: bytes | None = None, **kw: Any) -> Any:
        req = pb.RangeRequest(key=key, range_end=end or b"", **kw)
        return self._call("KV.Range", req)

    def _txn(self, compare: list[Any], success: list[Any], failure: Sequence[Any] = ()) -> Any:
        req = pb.TxnRequest(compare=compare, success=success, failure=list(failure))
        return self._call("KV.Txn", req, write=True)

    def _guard_compares(self) -> list[Any]:
        if self.guard is None:
            return []
        key, rev = self.guard
        return [
            pb.Compare(
                key=key.encode(),
                result=pb.Compare.EQUAL,
                target=pb.Compare.CREATE,
                create_revision=rev,
            )
        ]

    # ------------------------------------------------------------------ resources

    def revision(self) -> int:
        return int(self._range(self._meta, count_only=True).header.revision)

    def get(self, key: str) -> Document | None:
        kvs = self._range(self._key("r/" + key)).kvs
        return self._document(kvs[0]) if kvs else None

    def _document(self, kv: Any) -> Document:
        body = json.loads(kv.value)
        return Document(
            self._strip(kv.key)[2:], body["v"], int(kv.mod_revision), body["c"], body["u"]
        )

    def snapshot(self, prefix: str) -> Snapshot:
        start = self._key("r/" + prefix)
        resp = self._range(start, prefix_end(start))
        docs = [self._document(kv) for kv in resp.kvs]
        return Snapshot(int(resp.header.revision), docs)

    def _read_many(self, keys: Iterable[str]) -> tuple[int, dict[str, Any], int]:
        """Several resource keys and the resources guard, as of one revision
        (read in transactions of at most MAX_OPS ranges, all at the first one's revision)."""
        names = list(dict.fromkeys(keys))
        found: dict[str, Any] = {}
        revision, meta_rev = 0, 0
        for i in range(0, max(len(names), 1), MAX_OPS):
            chunk = names[i : i + MAX_OPS]
            ops = [
                pb.RequestOp(
                    request_range=pb.RangeRequest(key=self._key("r/" + k), revision=revision)
                )
                for k in chunk
            ]
            if not revision:
                ops.insert(0, pb.RequestOp(request_range=pb.RangeRequest(key=self._meta)))
            resp = self._txn([], ops)
            answers = list(resp.responses)
            if not revision:
                revision = int(resp.header.revision)
                meta = answers.pop(0).response_range.kvs
                meta_rev = int(meta[0].mod_revision) if meta else 0
            for name, op in zip(chunk, answers, strict=True):
                if op.response_range.kvs:
                    found[name] = op.response_range.kvs[0]
        return revision, found, meta_rev

    def commit(self, txn: Txn) -> int:
        keys = [*txn.puts, *txn.deletes, *txn.expect]
        for _ in range(20):
            revision, found, moved = self._read_many(keys)
            if txn.base_revision is not None and moved > txn.base_revision:
                raise RevisionMoved(txn.base_revision, moved)
            for key, expected in txn.expect.items():
                actual = int(found[key].mod_revision) if key in found else None
                missing = actual is None if expected == EXISTS else actual != expected
                if missing:
                    raise PreconditionFailed(key, expected, actual)
            # what was read must still hold at commit (else read again)
            compares = [
                pb.Compare(
                    key=self._key("r/" + k),
                    result=pb.Compare.EQUAL,
                    target=pb.Compare.MOD,
                    mod_revision=int(found[k].mod_revision) if k in found else 0,
                )
                for k in dict.fromkeys(keys)
            ]
            compares.append(
                pb.Compare(
                    key=self._meta,
                    result=pb.Compare.EQUAL,
                    target=pb.Compare.MOD,
                    mod_revision=moved,
                )
            )
            changes = bool(txn.puts) or any(k in found for k in txn.deletes)
            if not changes:
                if self._txn(compares, []).succeeded:
                    return revision
                continue
            now = time.time()
            ops = []
            for key, value in txn.puts.items():
                created = json.loads(found[key].value)["c"] if key in found else now
                body = json.dumps({"v": value, "c": created, "u": now}, separators=(",", ":"))
                ops.append(
                    pb.RequestOp(
                        request_put=pb.PutRequest(key=self._key("r/" + key), value=body.encode())
                    )
                )
            ops += [
                pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=self._key("r/" + k)))
                for k in txn.deletes
                if k in found
            ]
            ops.append(pb.RequestOp(request_put=pb.PutRequest(key=self._meta, value=b"")))
            resp = self._txn(compares, ops)
            if resp.succeeded:
                rev = int(resp.header.revision)
                self._maybe_compact(rev)
                return rev
        raise Unavailable("etcd: the keys kept changing under 20 attempts of one write")

    def _maybe_compact(self, revision: int) -> None:
        floor = revision - self.settings.history + 1
        if floor > 1 and floor - self._compacted_at >= self.settings.compact_every:
            try:
                self._call("KV.Compact", pb.CompactionRequest(revision=floor), write=True)
                self._compacted_at = floor
            except Unavailable as exc:
                log.info("compaction at revision %d postponed: %s", floor, exc)
            except StoreError:
                self._compacted_at = floor

    def compact(self) -> None:
        """Keep the last ``history`` revisions of etcd's history (the cluster's
        leader calls this now and then: opinion and log writes move the
        revision too, not only resource writes)."""
        self._maybe_compact(self.revision())

    def changes_since(self, revision: int, limit: int = 10_000) -> list[Change]:
        meta = self._range(self._meta).kvs
        top = int(meta[0].mod_revision) if meta else 0
        if top <= revision:
            return []
        out: list[Change] = []
        done = threading.Event()

        def requests() -> Iterator[Any]:
            yield self._create_request(self._r, revision + 1)
            done.wait(self.settings.request_timeout * 5)

        channel = self.members.channel(self.members.current())
        stream = stubs.WatchStub(channel).Watch(
            requests(), timeout=self.settings.request_timeout * 5
        )
        try:
            for resp in stream:
                if resp.compact_revision:
                    raise Compacted(revision, int(resp.compact_revision))
                for ev in resp.events:
                    change = self._change_of(self._event(ev))
                    if change.revision > revision + limit:
                        return out
                    out.append(change)
                if out and out[-1].revision >= top:
                    return out
        except grpc.RpcError as exc:
            raise Unavailable(f"etcd watch: {exc.details()}") from None
        finally:
            done.set()
            stream.cancel()
        return out

    def _create_request(self, prefix: str, start: int, progress: bool = False) -> Any:
        key = prefix.encode()
        return pb.WatchRequest(
            create_request=pb.WatchCreateRequest(
                key=key, range_end=prefix_end(key), start_revision=start, progress_notify=progress
            )
        )

    def watch(self, from_revision: int) -> AsyncIterator[list[Change]]:
        async def changes() -> AsyncIterator[list[Change]]:
            async for batch in self.watch_prefix("r/", from_revision + 1):
                yield [self._change_of(ev) for ev in batch]

        return changes()

    def _change_of(self, ev: Event) -> Change:
        key = ev.kv.key[2:]
        if ev.deleted:
            return Change(ev.revision, key, None, time.time())
        body = json.loads(ev.kv.value)
        return Change(ev.revision, key, body["v"], body["u"])

    # ------------------------------------------------------------------ the watch

    def _aio_channel(self, endpoint: str) -> grpc.aio.Channel:
        ch = self._aio.get(endpoint)
        if ch is None:
            ch = grpc.aio.insecure_channel(endpoint)
            self._aio[endpoint] = ch
        return ch

    async def watch_prefix(self, prefix: str, start: int) -> AsyncIterator[list[Event]]:
        """Every event under ``<ns>/<prefix>`` from revision ``start`` on,
        one list per revision, resuming on other members as needed (see the
        module doc). Raises :class:`Compacted` when ``start`` is gone."""
        full = f"{self.ns}/{prefix}"
        next_rev = start
        failures = 0
        while True:
            endpoint = self.members.current()
            try:
                async for batch in self._watch_once(endpoint, full, next_rev):
                    failures = 0
                    next_rev = batch[-1].revision + 1
                    yield batch
            except Compacted:
                raise
            except (grpc.RpcError, TimeoutError, _WatchEnded) as exc:
                failures += 1
                self.members.skip(endpoint)
                level = logging.INFO if failures == 1 else logging.DEBUG
                log.log(
                    level,
                    "etcd watch on %s broke (%s); resuming at %d",
                    endpoint,
                    _why(exc),
                    next_rev,
                )
                await asyncio.sleep(min(0.05 * 2**failures, 1.0))

    async def _watch_once(
        self, endpoint: str, prefix: str, start: int
    ) -> AsyncIterator[list[Event]]:
        stub = stubs.WatchStub(self._aio_channel(endpoint))
        call = stub.Watch(metadata=(("hasleader", "true"),))
        await call.write(self._create_request(prefix, start))
        answered = asyncio.Event()
        loop = asyncio.get_running_loop()
        last_answer = loop.time()

        async def watchdog() -> None:
            while True:
                await asyncio.sleep(self.settings.progress_every)
                if loop.time() - last_answer > self.settings.watch_deadline:
                    call.cancel()
                    return
                with contextlib.suppress(Exception):
                    await call.write(pb.WatchRequest(progress_request=pb.WatchProgressRequest()))

        dog = asyncio.create_task(watchdog())
        try:
            while True:
                resp = await call.read()
                if resp is _EOF:
                    raise _WatchEnded("the member ended the watch")
                last_answer = loop.time()
                answered.set()
                if resp.compact_revision:
                    raise Compacted(start - 1, int(resp.compact_revision))
                if resp.canceled:
                    raise _WatchEnded(resp.cancel_reason or "canceled")
                events = [self._event(ev) for ev in resp.events]
                for _, group in groupby(events, key=lambda e: e.revision):
                    yield list(group)
        except asyncio.CancelledError:
            if dog.done() and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise _WatchEnded("silent for too long (a frozen member?)") from None
            raise
        finally:
            dog.cancel()
            call.cancel()

    def _event(self, ev: Any) -> Event:
        return Event(int(ev.kv.mod_revision), self._keyvalue(ev.kv), ev.type == 1)  # 1: DELETE

    def _keyvalue(self, kv: Any) -> KeyValue:
        return KeyValue(
            self._strip(kv.key),
            bytes(kv.value),
            int(kv.create_revision),
            int(kv.mod_revision),
            int(kv.lease),
        )

    # ------------------------------------------------------------------ plain keys (cluster)

    def list_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        start = self._key(prefix)
        resp = self._range(start, prefix_end(start))
        return int(resp.header.revision), [self._keyvalue(kv) for kv in resp.kvs]

    def put_json(self, items: Mapping[str, Any], lease: int = 0, guarded: bool = False) -> int:
        """Put keys (without the namespace) with JSON values, in transactions
        of at most MAX_OPS; returns the last revision."""
        rev = 0
        pairs = list(items.items())
        guard = self._guard_compares() if guarded else []
        for i in range(0, max(len(pairs), 1), MAX_OPS):
            ops = [
                pb.RequestOp(
                    request_put=pb.PutRequest(
                        key=self._key(k),
                        value=json.dumps(v, separators=(",", ":")).encode(),
                        lease=lease,
                    )
                )
                for k, v in pairs[i : i + MAX_OPS]
            ]
            if not ops:
                break
            resp = self._txn(guard, ops)
            if not resp.succeeded:
                raise NotLeader("this node's election key is gone: it is not the leader")
            rev = int(resp.header.revision)
        return rev

    def delete_key(self, key: str) -> None:
        self._call("KV.DeleteRange", pb.DeleteRangeRequest(key=self._key(key)), write=True)

    def create_key(self, key: str, value: bytes, lease: int) -> int:
        """Create ``key`` under ``lease`` if absent; its create revision (an
        existing key's, if it was there)."""
        k = self._key(key)
        resp = self._txn(
            [
                pb.Compare(
                    key=k, result=pb.Compare.EQUAL, target=pb.Compare.CREATE, create_revision=0
                )
            ],
            [pb.RequestOp(request_put=pb.PutRequest(key=k, value=value, lease=lease))],
            [pb.RequestOp(request_range=pb.RangeRequest(key=k))],
        )
        if resp.succeeded:
            return int(resp.header.revision)
        return int(resp.responses[0].response_range.kvs[0].create_revision)

    def grant(self, ttl: int) -> int:
        resp = self._call("Lease.LeaseGrant", pb.LeaseGrantRequest(TTL=ttl), write=True)
        return int(resp.ID)

    def revoke(self, lease: int) -> None:
        with contextlib.suppress(StoreError):
            self._call("Lease.LeaseRevoke", pb.LeaseRevokeRequest(ID=lease), write=True)

    def keep_alive_once(self, lease: int, timeout: float | None = None) -> int:
        """Refresh ``lease`` once, trying each member in turn (each for
        ``timeout`` seconds: a short one, so that one frozen member does not
        use up the lease); its remaining TTL (0 or less: it expired)."""
        why = "no member answered"
        for _ in self.members.endpoints:
            endpoint = self.members.current()
            stub = stubs.LeaseStub(self.members.channel(endpoint))
            try:
                for resp in stub.LeaseKeepAlive(
                    iter([pb.LeaseKeepAliveRequest(ID=lease)]),
                    timeout=timeout or self.settings.request_timeout,
                ):
                    return int(resp.TTL)
            except grpc.RpcError as exc:
                why = f"etcd {endpoint}: {exc.details() or exc.code().name}"
            self.members.skip(endpoint)
        raise Unavailable(why)

    # ------------------------------------------------------------------ states

    def save_states(self, puts: Mapping[str, Any], deletes: Iterable[str] = ()) -> None:
        guard = self._guard_compares()
        ops = [
            pb.RequestOp(
                request_delete_range=pb.DeleteRangeRequest(
                    key=self._key("s/" + p), range_end=prefix_end(self._key("s/" + p))
                )
            )
            for p in deletes
        ]
        ops += [
            pb.RequestOp(
                request_put=pb.PutRequest(
                    key=self._key("s/" + k), value=json.dumps(v, separators=(",", ":")).encode()
                )
            )
            for k, v in puts.items()
        ]
        for i in range(0, len(ops), MAX_OPS):
            if not self._txn(guard, ops[i : i + MAX_OPS]).succeeded:
                raise NotLeader("this node's election key is gone: it is not the leader")

    def load_states(self) -> dict[str, Any]:
        _, kvs = self.list_prefix("s/")
        return {kv.key[2:]: json.loads(kv.value) for kv in kvs}

    # ------------------------------------------------------------------ the log

    def _log_key(self, i: int) -> bytes:
        return self._key(f"l/{i:0{LOG_ID_WIDTH}d}")

    def append_log(self, records: Sequence[Mapping[str, Any]]) -> list[int]:
        ids: list[int] = []
        for i in range(0, len(records), MAX_OPS):
            ids += self._append_chunk(records[i : i + MAX_OPS])
        return ids

    def _append_chunk(self, records: Sequence[Mapping[str, Any]]) -> list[int]:
        for _ in range(50):
            meta = self._range(self._log_meta).kvs
            last = int(meta[0].value) if meta else 0
            mod = int(meta[0].mod_revision) if meta else 0
            ids = list(range(last + 1, last + 1 + len(records)))
            ops = [
                pb.RequestOp(
                    request_put=pb.PutRequest(
                        key=self._log_key(i), value=json.dumps(r, separators=(",", ":")).encode()
                    )
                )
                for i, r in zip(ids, records, strict=True)
            ]
            ops.append(
                pb.RequestOp(
                    request_put=pb.PutRequest(key=self._log_meta, value=str(ids[-1]).encode())
                )
            )
            compares = [
                pb.Compare(
                    key=self._log_meta,
                    result=pb.Compare.EQUAL,
                    target=pb.Compare.MOD,
                    mod_revision=mod,
                ),
                *self._guard_compares(),
            ]
            resp = self._txn(compares, ops)
            if resp.succeeded:
                return ids
            if self.guard is not None and not self._guard_holds():
                raise NotLeader("this node's election key is gone: it is not the leader")
        raise Unavailable("etcd: the log kept moving under 50 attempts of one append")

    def _guard_holds(self) -> bool:
        if self.guard is None:
            return True
        key, rev = self.guard
        kvs = self._range(key.encode()).kvs
        return bool(kvs) and int(kvs[0].create_revision) == rev

    def query_log(self, query: LogQuery) -> list[LogEntry]:
        out: list[LogEntry] = []
        start = self._log_key(query.after_id + 1)
        end = prefix_end(self._key("l/"))
        while len(out) < query.limit:
            resp = self._range(start, end, limit=1000)
            for kv in resp.kvs:
                record = json.loads(kv.value)
                t = float(record.get("time", 0.0))
                if query.since is not None and t < query.since:
                    continue
                if query.until is not None and t >= query.until:
                    continue
                if record_matches(query, record):
                    out.append(LogEntry(int(self._strip(kv.key)[2:]), record))
                    if len(out) >= query.limit:
                        break
            if not resp.more or not resp.kvs:
                break
            start = bytes(resp.kvs[-1].key) + b"\0"
        return out

    def last_log_id(self) -> int:
        meta = self._range(self._log_meta).kvs
        return int(meta[0].value) if meta else 0

    def trim_log(self, keep: int) -> int:
        cut = self.last_log_id() - keep
        if cut <= 0:
            return 0
        resp = self._call(
            "KV.DeleteRange",
            pb.DeleteRangeRequest(key=self._key("l/"), range_end=self._log_key(cut + 1)),
            write=True,
        )
        return int(resp.deleted)

    def close(self) -> None:
        self.members.close()
        for ch in self._aio.values():
            with contextlib.suppress(Exception):
                _close_later(ch)
        self._aio.clear()


def _refusal(exc: grpc.RpcError) -> StoreError:
    detail = str(exc.details() or "")
    if "too many operations" in detail:
        return TooLarge(
            f"one write of more keys than etcd takes in a transaction ({detail}): "
            "raise --max-txn-ops on the etcd members (docs/cluster.md) or apply in parts"
        )
    if "too large" in detail:
        return TooLarge(
            f"one write larger than etcd takes ({detail}): raise --max-request-bytes on the "
            "etcd members (docs/cluster.md) or apply in parts"
        )
    return StoreError(f"etcd refused the request: {detail}")


class _WatchEnded(Exception):
    pass


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return str(exc.details() or exc.code().name)
    return str(exc) or type(exc).__name__


def _close_later(ch: grpc.aio.Channel) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # no loop: the channel goes with the process
    task = loop.create_task(ch.close(None))
    _CLOSING.add(task)
    task.add_done_callback(_CLOSING.discard)


class Lease:
    """A lease kept alive on the event loop: refreshed every TTL/3 (in a
    thread: the refresh is a blocking call). It is reported lost only when
    etcd says it expired - etcd, not this process, decides: while etcd
    cannot be reached the lease may well live on (etcd extends every lease
    when a new leader is elected), and whatever this node writes meanwhile
    fails or is guarded anyway."""

    def __init__(self, store: EtcdStore, ttl: int) -> None:
        self.store = store
        self.ttl = ttl
        self.id = 0
        self.lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def grant(self) -> int:
        self.id = await asyncio.to_thread(self.store.grant, self.ttl)
        self.lost.clear()
        self._task = asyncio.create_task(self._refresh(), name="etcd-lease")
        return self.id

    async def _refresh(self) -> None:
        loop = asyncio.get_running_loop()
        ok_at = loop.time()
        warned = False
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                left = await asyncio.to_thread(
                    self.store.keep_alive_once, self.id, max(0.2, self.ttl / 4)
                )
            except StoreError as exc:
                if not warned and loop.time() - ok_at > self.ttl:
                    log.warning("lease %x not refreshed for %ds: %s", self.id, self.ttl, exc)
                    warned = True
                continue
            if left <= 0:
                log.warning("lease %x expired", self.id)
                self.lost.set()
                return
            if warned:
                log.info("lease %x refreshed again", self.id)
                warned = False
            ok_at = loop.time()

    async def close(self, revoke: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if revoke and self.id:
            await asyncio.to_thread(self.store.revoke, self.id)
