"""The etcd store: the store contract over an etcd v3 cluster (3.4 and later).

Cluster mode's source of truth (SPEC §4). It passes the contract suite the
memory and SQLite stores pass (tests/contract/), with etcd's own revision as
the store revision: fingerprints are etcd revisions, a write is one etcd
transaction with its preconditions as compares. Connections, deadlines,
retries, watches and leases are the client's (store/etcd_client.py).

Key layout, under the client's namespace (``/healthgate`` by default)::

    <ns>/r/<key>         resources: {"v": document, "c": created, "u": updated}
    <ns>/m/resources     touched by every resource write (the base_revision guard)
    <ns>/r/commit        ... and this too, with the commit's time (not a resource:
                         the watch delivers it with the write's resources)
    <ns>/s/<key>         saved engine states (StateStore)
    <ns>/l/<id:020d>     the transition log; <ns>/m/log holds the last id
    <ns>/o/<endpoint>/<vantage region>   endpoint opinions of probers (cluster)
    <ns>/n/<node>        live nodes, each under its lease (cluster)
    <ns>/e/<scope>/<lease>               elections (cluster)

``base_revision`` (nothing changed since the plan) is a compare on
``<ns>/m/resources``: etcd cannot compare "the whole store", and the store's
revision also moves with states and log writes, which do not invalidate a
plan of resources.

**What is read is not trusted.** Anyone who can write to etcd can put
anything under these keys, and a value written by a newer or an older
healthgate may not parse. A resource, state or log value that is not the
JSON object it should be is logged once and skipped (a watch moves past
it; a snapshot leaves it out): one bad key never freezes a mirror.
Times read are finite and within a sane range (:func:`sane_time`).

**Compaction**: the store compacts etcd's history itself, keeping the last
``history`` revisions (as the SQLite store does), at most once per
``compact_every`` revisions.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as stubs

from healthgate.store.base import (
    EXISTS,
    WRITE_ID,
    WRITTEN_SCAN,
    Change,
    Compacted,
    Document,
    Guard,
    LogEntry,
    LogQuery,
    NotLeader,
    PreconditionFailed,
    RevisionMoved,
    Snapshot,
    StoreError,
    Txn,
    Unavailable,
    decode_json,
    record_matches,
    sane_time,
    written_among,
)
from healthgate.store.etcd_client import (
    MAX_OPS,
    EtcdAuth,
    EtcdClient,
    EtcdSettings,
    EtcdTls,
    Event,
    prefix_end,
)

log = logging.getLogger("healthgate.store.etcd")

LOG_ID_WIDTH = 20
COMMIT_KEY = "commit"  # under r/: the last resource commit's time (see the layout)
_COMMIT = "r/" + COMMIT_KEY


def _json_object(raw: bytes) -> dict[str, Any]:
    value = decode_json(raw)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


# The key layout's version (``m/schema``): 1 the first layout (unmarked),
# 2 the same keys, marked. A layout change bumps it and adds a migration here.
SCHEMA_VERSION = 2


class SchemaError(StoreError):
    """etcd holds a newer healthgate's key layout."""


class EtcdStore:
    """The whole store contract on etcd. Synchronous methods (called from
    threads, as the SQLite store's are); the watch is an asyncio stream."""

    def __init__(
        self,
        endpoints: Sequence[str] | EtcdClient,
        namespace: str = "/healthgate",
        settings: EtcdSettings | None = None,
        history: int | None = None,
        tls: EtcdTls | None = None,
        auth: EtcdAuth | None = None,
    ) -> None:
        settings = settings or EtcdSettings()
        if history is not None:
            settings = EtcdSettings(
                settings.request_timeout,
                settings.watch_deadline,
                settings.progress_every,
                history=history,
                compact_every=1,
            )
        if isinstance(endpoints, EtcdClient):
            self.client = endpoints
        else:
            self.client = EtcdClient(endpoints, namespace, settings, tls, auth)
        self.settings = settings
        self._meta = self.client.key("m/resources")
        self._log_meta = self.client.key("m/log")
        self._compacted_at = 0
        self._skipped: set[str] = set()  # bad keys already logged

    # ------------------------------------------------------------------ the layout

    def open_schema(self) -> int:
        """Check the key layout's version (``m/schema``) before anything is
        written: a newer one is refused; an unmarked one - the first
        layout, whose keys are today's - is marked (every node of a cluster
        may do it, once: the key is created only if absent). Returns the
        version found (0: none)."""
        key = self.client.key("m/schema")
        kvs = self.client.range(key).kvs
        if kvs:
            try:
                version = int(kvs[0].value)
            except ValueError:
                raise SchemaError(f"etcd key m/schema holds {kvs[0].value[:40]!r}") from None
            if version > SCHEMA_VERSION:
                raise SchemaError(
                    f"etcd under {self.client.ns} was written by a newer healthgate "
                    f"(key layout {version}; this one reads up to {SCHEMA_VERSION}): run that "
                    "version on every node (docs/operations.md, 'Upgrading')"
                )
            return version
        had_resources = bool(
            self.client.range(
                self.client.key("r/"), prefix_end(self.client.key("r/")), count_only=True
            ).count
        )
        created, _ = self.client.create("m/schema", str(SCHEMA_VERSION).encode(), 0)
        if created and had_resources:
            log.warning("etcd key layout 1 marked as %d (the keys are unchanged)", SCHEMA_VERSION)
        return 0

    # ------------------------------------------------------------------ reading safely

    def _skip(self, key: str, why: object) -> None:
        if key not in self._skipped:
            if len(self._skipped) < 10_000:
                self._skipped.add(key)
            log.error("skipping etcd key %s: %s (written by something else?)", key, why)

    def _document(self, kv: Any) -> Document | None:
        key = "?"
        try:
            key = self.client.strip(kv.key)
            body = _json_object(kv.value)
            value = body["v"]
            if not isinstance(value, dict):
                raise ValueError("its document is not an object")
            return Document(
                key[2:], value, int(kv.mod_revision), sane_time(body["c"]), sane_time(body["u"])
            )
        except (ValueError, KeyError, TypeError) as exc:
            self._skip(key, exc)
            return None

    # ------------------------------------------------------------------ resources

    def revision(self) -> int:
        return int(self.client.range(self._meta, count_only=True).header.revision)

    def get(self, key: str) -> Document | None:
        kvs = self.client.range(self.client.key("r/" + key)).kvs
        return self._document(kvs[0]) if kvs else None

    def snapshot(self, prefix: str) -> Snapshot:
        start = self.client.key("r/" + prefix)
        revision, kvs = self.client.range_all(start, prefix_end(start))
        docs = [d for d in map(self._document, kvs) if d is not None]
        return Snapshot(revision, docs)

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
                    request_range=pb.RangeRequest(key=self.client.key("r/" + k), revision=revision)
                )
                for k in chunk
            ]
            if not revision:
                ops.insert(0, pb.RequestOp(request_range=pb.RangeRequest(key=self._meta)))
            resp = self.client.txn([], ops)
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
                    key=self.client.key("r/" + k),
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
                if self.client.txn(compares, []).succeeded:
                    return revision
                continue
            now = time.time()
            ops = []
            for key, value in txn.puts.items():
                created = self._created(found.get(key), now)
                body = json.dumps({"v": value, "c": created, "u": now}, separators=(",", ":"))
                ops.append(
                    pb.RequestOp(
                        request_put=pb.PutRequest(
                            key=self.client.key("r/" + key), value=body.encode()
                        )
                    )
                )
            ops += [
                pb.RequestOp(
                    request_delete_range=pb.DeleteRangeRequest(key=self.client.key("r/" + k))
                )
                for k in txn.deletes
                if k in found
            ]
            ops.append(pb.RequestOp(request_put=pb.PutRequest(key=self._meta, value=b"")))
            # the commit's time, in the watch's own batch: deletes carry none, and
            # every node must time what a write causes alike (ControlPlane._take)
            stamp = json.dumps({"v": {}, "c": now, "u": now}, separators=(",", ":"))
            ops.append(
                pb.RequestOp(
                    request_put=pb.PutRequest(
                        key=self.client.key("r/" + COMMIT_KEY), value=stamp.encode()
                    )
                )
            )
            resp = self.client.txn(compares, ops)
            if resp.succeeded:
                rev = int(resp.header.revision)
                self._maybe_compact(rev)
                return rev
        raise Unavailable("etcd: the keys kept changing under 20 attempts of one write")

    @staticmethod
    def _created(kv: Any, now: float) -> float:
        """When an existing document was created (now, for a new one or one
        whose stored time cannot be read: it is being replaced anyway)."""
        if kv is None:
            return now
        try:
            return sane_time(_json_object(kv.value)["c"])
        except (ValueError, KeyError, TypeError):
            return now

    def _maybe_compact(self, revision: int) -> None:
        floor = revision - self.settings.history + 1
        if floor > 1 and floor - self._compacted_at >= self.settings.compact_every:
            try:
                self.client.compact(floor)
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
        meta = self.client.range(self._meta).kvs
        top = int(meta[0].mod_revision) if meta else 0
        if top <= revision:
            return []
        out: list[Change] = []
        done = threading.Event()
        timeout = self.settings.request_timeout * 5

        def requests() -> Iterator[Any]:
            yield self.client.create_request(self.client.key("r/"), revision + 1)
            done.wait(timeout)

        members = self.client.members
        stream = stubs.WatchStub(members.channel(members.current())).Watch(
            requests(), timeout=timeout, metadata=self.client.metadata()
        )
        try:
            for resp in stream:
                if resp.compact_revision:
                    raise Compacted(revision, int(resp.compact_revision))
                events = [e for e in map(self._event, resp.events) if e is not None]
                for change in self._changes_of(events):
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

    def _event(self, ev: Any) -> Event | None:
        try:
            return self.client.event(ev)
        except ValueError:
            self._skip(repr(bytes(ev.kv.key)[:80]), "the key is not UTF-8")
            return None

    def watch(self, from_revision: int) -> AsyncIterator[list[Change]]:
        async def changes() -> AsyncIterator[list[Change]]:
            async for batch in self.client.watch_prefix("r/", from_revision + 1):
                out = self._changes_of(batch)
                if out:
                    yield out

        return changes()

    def _changes_of(self, events: Sequence[Event]) -> list[Change]:
        """Watch events as resource changes, each timed by its commit's stamp
        (``r/commit``, written with every resource write: a delete carries
        no time of its own), the stamp itself left out."""
        stamps: dict[int, float] = {}
        for ev in events:
            if ev.kv.key == _COMMIT and not ev.deleted:
                change = self._change_of(ev)
                if change is not None:
                    stamps[ev.revision] = change.time
        out = []
        for ev in events:
            if ev.kv.key == _COMMIT:
                continue
            change = self._change_of(ev, stamps.get(ev.revision))
            if change is not None:
                out.append(change)
        return out

    def _change_of(self, ev: Event, stamp: float | None = None) -> Change | None:
        """A watch event as a resource change (None: a value that is not one,
        skipped - the watch goes on past it)."""
        key = ev.kv.key[2:]
        if ev.deleted:  # (no stamp: written by an older healthgate)
            return Change(ev.revision, key, None, time.time() if stamp is None else stamp)
        try:
            body = _json_object(ev.kv.value)
            value = body["v"]
            if not isinstance(value, dict):
                raise ValueError("its document is not an object")
            return Change(ev.revision, key, value, sane_time(body["u"]))
        except (ValueError, KeyError, TypeError) as exc:
            self._skip(ev.kv.key, exc)
            return None

    # ------------------------------------------------------------------ states

    def save_states(
        self, puts: Mapping[str, Any], deletes: Iterable[str] = (), guard: Guard | None = None
    ) -> None:
        client = self.client
        compares = [client.created_at(guard.key, guard.revision)] if guard else []
        # (StateStore.save_states: deletes first, a "/" at the end a prefix.)
        # etcd refuses a transaction that puts a key it also deletes: a key
        # put needs no delete, and the deletes go in transactions of their own
        deleted = [
            pb.RequestOp(
                request_delete_range=pb.DeleteRangeRequest(
                    key=client.key("s/" + p),
                    range_end=prefix_end(client.key("s/" + p)) if p.endswith("/") else b"",
                )
            )
            for p in dict.fromkeys(deletes)
            if p.endswith("/") or p not in puts
        ]
        put = [
            pb.RequestOp(
                request_put=pb.PutRequest(
                    key=client.key("s/" + k), value=json.dumps(v, separators=(",", ":")).encode()
                )
            )
            for k, v in puts.items()
        ]
        for ops in (deleted, put):
            for i in range(0, len(ops), MAX_OPS):
                if not client.txn(compares, ops[i : i + MAX_OPS]).succeeded:
                    raise NotLeader("this node's election key is gone: it is not the leader")

    def load_states(self, prefix: str = "") -> dict[str, Any]:
        _, kvs = self.client.list_prefix("s/" + prefix)
        out: dict[str, Any] = {}
        for kv in kvs:
            try:
                out[kv.key[2:]] = decode_json(kv.value)
            except ValueError as exc:
                self._skip(kv.key, exc)
        return out

    # ------------------------------------------------------------------ the log

    def _log_key(self, i: int) -> bytes:
        return self.client.key(f"l/{i:0{LOG_ID_WIDTH}d}")

    def append_log(
        self, records: Sequence[Mapping[str, Any]], guard: Guard | None = None
    ) -> list[int]:
        ids: list[int] = []
        for i in range(0, len(records), MAX_OPS):
            ids += self._append_chunk(records[i : i + MAX_OPS], guard)
        return ids

    def _append_chunk(self, records: Sequence[Mapping[str, Any]], guard: Guard | None) -> list[int]:
        client = self.client
        for _ in range(50):
            meta = client.range(self._log_meta).kvs
            last = self._last_id(meta)
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
                )
            ]
            if guard is not None:
                compares.append(client.created_at(guard.key, guard.revision))
            resp = client.txn(compares, ops)
            if resp.succeeded:
                return ids
            if guard is not None and not self.guard_holds(guard):
                raise NotLeader("this node's election key is gone: it is not the leader")
        raise Unavailable("etcd: the log kept moving under 50 attempts of one append")

    def _last_id(self, meta: Any) -> int:
        if not meta:
            return 0
        try:
            last = int(meta[0].value)
        except ValueError:
            last = -1
        if not 0 <= last < 10**LOG_ID_WIDTH - 10**6:
            raise Unavailable(f"etcd: the log's last id {bytes(meta[0].value)[:40]!r} is not one")
        return last

    def guard_holds(self, guard: Guard) -> bool:
        kvs = self.client.range(self.client.key(guard.key)).kvs
        return bool(kvs) and int(kvs[0].create_revision) == guard.revision

    def query_log(self, query: LogQuery) -> list[LogEntry]:
        out: list[LogEntry] = []
        start = self._log_key(query.after_id + 1)
        end = prefix_end(self.client.key("l/"))
        while len(out) < query.limit:
            resp = self.client.range(start, end, limit=1000)
            for kv in resp.kvs:
                entry = self._log_entry(kv)
                if entry is None:
                    continue
                t = float(entry.record.get("time", 0.0))
                if query.since is not None and t < query.since:
                    continue
                if query.until is not None and t >= query.until:
                    continue
                if record_matches(query, entry.record):
                    out.append(entry)
                    if len(out) >= query.limit:
                        break
            if not resp.more or not resp.kvs:
                break
            start = bytes(resp.kvs[-1].key) + b"\0"
        return out

    def _log_entry(self, kv: Any) -> LogEntry | None:
        key = "?"
        try:
            key = self.client.strip(kv.key)
            record = _json_object(kv.value)
            record["time"] = sane_time(record.get("time", 0.0))
            record.pop(WRITE_ID, None)
            return LogEntry(int(key[2:]), record)
        except (ValueError, TypeError) as exc:
            self._skip(key, exc)
            return None

    def written(self, write_ids: Collection[str]) -> dict[str, int]:
        last = self.last_log_id()
        start = self._log_key(max(1, last - WRITTEN_SCAN + 1))
        resp = self.client.range(start, prefix_end(self.client.key("l/")))
        entries = []
        for kv in resp.kvs:
            try:
                key = self.client.strip(kv.key)
                entries.append((int(key[2:]), _json_object(kv.value)))
            except (ValueError, TypeError):
                continue  # (logged by the readers that need it)
        return written_among(entries, write_ids)

    def last_log_id(self) -> int:
        return self._last_id(self.client.range(self._log_meta).kvs)

    def trim_log(self, keep: int) -> int:
        cut = self.last_log_id() - keep
        if cut <= 0:
            return 0
        resp = self.client.call(
            "KV.DeleteRange",
            pb.DeleteRangeRequest(key=self.client.key("l/"), range_end=self._log_key(cut + 1)),
            write=True,
        )
        return int(resp.deleted)

    def close(self) -> None:
        self.client.close()
