"""An in-memory store: the contract without a disk, for tests and ``simulate``.

It implements the whole :class:`~healthgate.store.base.Store` contract
(revisions, preconditions inside the transaction, the watch from a revision,
compaction, states, the log) with plain dictionaries under one lock, and is
checked by the same contract suite as the SQLite store. Nothing survives the
process.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from healthgate.store.base import (
    WRITTEN_SCAN,
    Change,
    Compacted,
    Document,
    Guard,
    LogEntry,
    LogQuery,
    Snapshot,
    Txn,
    record_matches,
    without_write_id,
    written_among,
)
from healthgate.store.txn import check_txn
from healthgate.store.watch import WatchHub


class MemoryStore:
    def __init__(self, clock: Callable[[], float] = time.time, history: int = 10_000) -> None:
        self._clock = clock
        self.history = history  # revisions of change history kept for watches
        self._lock = threading.RLock()
        self._docs: dict[str, Document] = {}
        self._revision = 0
        self._changes: list[Change] = []
        self._compacted = 0  # changes at or below this revision are gone
        self._states: dict[str, Any] = {}
        self._log: list[LogEntry] = []
        self._log_id = 0
        self._hub = WatchHub()

    # ------------------------------------------------------------------ resources

    def revision(self) -> int:
        with self._lock:
            return self._revision

    def get(self, key: str) -> Document | None:
        with self._lock:
            return self._docs.get(key)

    def snapshot(self, prefix: str) -> Snapshot:
        with self._lock:
            docs = sorted(
                (d for k, d in self._docs.items() if k.startswith(prefix)), key=lambda d: d.key
            )
            return Snapshot(self._revision, docs)

    def commit(self, txn: Txn) -> int:
        now = self._clock()
        with self._lock:
            check_txn(txn, self._revision, self._current_revision)
            if not txn.puts and not any(k in self._docs for k in txn.deletes):
                return self._revision  # nothing changes: no new revision (as in etcd)
            rev = self._revision + 1
            for key, value in txn.puts.items():
                old = self._docs.get(key)
                created = old.created if old else now
                self._docs[key] = Document(key, dict(value), rev, created, now)
                self._changes.append(Change(rev, key, dict(value), now))
            for key in txn.deletes:
                if self._docs.pop(key, None) is not None:
                    self._changes.append(Change(rev, key, None, now))
            self._revision = rev
            self._compact()
        self._hub.notify()
        return rev

    def _current_revision(self, key: str) -> int | None:
        doc = self._docs.get(key)
        return doc.revision if doc else None

    def _compact(self) -> None:
        floor = self._revision - self.history
        if floor > self._compacted:
            cut = bisect.bisect_right(self._changes, floor, key=lambda c: c.revision)
            del self._changes[:cut]
            self._compacted = floor

    def changes_since(self, revision: int, limit: int = 10_000) -> list[Change]:
        with self._lock:
            if revision < self._compacted:
                raise Compacted(revision, self._compacted + 1)
            start = bisect.bisect_right(self._changes, revision, key=lambda c: c.revision)
            top = revision + limit
            return [c for c in self._changes[start:] if c.revision <= top]

    def watch(self, from_revision: int) -> AsyncIterator[list[Change]]:
        async def fetch(after: int) -> list[Change]:
            return self.changes_since(after)

        return self._hub.watch(from_revision, fetch)

    # ------------------------------------------------------------------ states

    def save_states(
        self, puts: Mapping[str, Any], deletes: Iterable[str] = (), guard: Guard | None = None
    ) -> None:
        with self._lock:
            for gone in deletes:
                if gone.endswith("/"):  # (StateStore.save_states: a prefix)
                    for key in [k for k in self._states if k.startswith(gone)]:
                        del self._states[key]
                else:
                    self._states.pop(gone, None)
            self._states.update(puts)

    def load_states(self, prefix: str = "") -> dict[str, Any]:
        with self._lock:
            return {k: v for k, v in self._states.items() if k.startswith(prefix)}

    # ------------------------------------------------------------------ the log

    def append_log(
        self, records: Sequence[Mapping[str, Any]], guard: Guard | None = None
    ) -> list[int]:
        ids = []
        with self._lock:
            for r in records:
                self._log_id += 1
                self._log.append(LogEntry(self._log_id, dict(r)))
                ids.append(self._log_id)
        return ids

    def query_log(self, query: LogQuery) -> list[LogEntry]:
        out = []
        with self._lock:
            start = bisect.bisect_right(self._log, query.after_id, key=lambda e: e.id)
            for entry in self._log[start:]:
                t = float(entry.record.get("time", 0.0))
                if query.since is not None and t < query.since:
                    continue
                if query.until is not None and t >= query.until:
                    continue
                if record_matches(query, entry.record):
                    out.append(LogEntry(entry.id, without_write_id(entry.record)))
                    if len(out) >= query.limit:
                        break
        return out

    def last_log_id(self) -> int:
        with self._lock:
            return self._log_id

    def written(self, write_ids: Collection[str]) -> dict[str, int]:
        with self._lock:
            return written_among(((e.id, e.record) for e in self._log[-WRITTEN_SCAN:]), write_ids)

    def trim_log(self, keep: int) -> int:
        with self._lock:
            cut = bisect.bisect_right(self._log, self._log_id - keep, key=lambda e: e.id)
            del self._log[:cut]
            return cut

    def close(self) -> None:
        return None
