"""The embedded default store: SQLite in WAL mode.

One connection, guarded by a lock, used from worker threads (the async
callers wrap calls in ``asyncio.to_thread``). ``synchronous=FULL`` makes a
committed transaction durable before ``commit`` returns, so a write that was
acknowledged to a client survives ``kill -9`` and power loss.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from healthgate.store.base import Change, Document, LogEntry, LogQuery, PreconditionFailed, Txn

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta (key, value) VALUES ('revision', 0);
CREATE TABLE IF NOT EXISTS documents (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    revision INTEGER NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS states (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS log (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    project TEXT NOT NULL,
    kind TEXT NOT NULL,
    path TEXT NOT NULL,
    state TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS log_project ON log (project, id);
"""


class SqliteStore:
    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path = str(path)
        self._clock = clock
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(SCHEMA)
        self._watchers: list[Callable[[Sequence[Change]], None]] = []

    # ------------------------------------------------------------------ documents

    def revision(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key='revision'").fetchone()
            return int(row[0])

    def get(self, key: str) -> Document | None:
        with self._lock:
            row = self._db.execute(
                "SELECT key, value, revision, created, updated FROM documents WHERE key=?", (key,)
            ).fetchone()
        return _doc(row) if row else None

    def list_prefix(self, prefix: str) -> list[Document]:
        with self._lock:
            rows = self._db.execute(
                "SELECT key, value, revision, created, updated FROM documents "
                "WHERE key >= ? AND key < ? ORDER BY key",
                (prefix, prefix + "\U0010ffff"),
            ).fetchall()
        return [_doc(r) for r in rows]

    def commit(self, txn: Txn) -> int:
        now = self._clock()
        changes: list[Change] = []
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                for key, expected in txn.expect.items():
                    row = db.execute(
                        "SELECT revision FROM documents WHERE key=?", (key,)
                    ).fetchone()
                    actual = int(row[0]) if row else None
                    if actual != expected:
                        raise PreconditionFailed(key, expected, actual)
                rev = (
                    int(db.execute("SELECT value FROM meta WHERE key='revision'").fetchone()[0]) + 1
                )
                for key, value in txn.puts.items():
                    db.execute(
                        "INSERT INTO documents (key, value, revision, created, updated) VALUES (?, ?, ?, ?, ?) "
                        "ON CONFLICT(key) DO UPDATE SET value=excluded.value, revision=excluded.revision, "
                        "updated=excluded.updated",
                        (key, json.dumps(value, sort_keys=True), rev, now, now),
                    )
                    changes.append(Change(rev, key, value))
                for key in txn.deletes:
                    db.execute("DELETE FROM documents WHERE key=?", (key,))
                    changes.append(Change(rev, key, None))
                db.execute("UPDATE meta SET value=? WHERE key='revision'", (rev,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        for watcher in list(self._watchers):
            watcher(changes)
        return rev

    def watch(self, callback: Callable[[Sequence[Change]], None]) -> Callable[[], None]:
        self._watchers.append(callback)
        return lambda: self._watchers.remove(callback)

    # ------------------------------------------------------------------ states

    def save_states(self, puts: Mapping[str, Any], deletes: Iterable[str] = ()) -> None:
        """Upsert ``puts``; delete every key that starts with one of ``deletes``."""
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(
                    "INSERT INTO states (key, value) VALUES (?, ?) "
                    "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                    [(k, json.dumps(v)) for k, v in puts.items()],
                )
                db.executemany(
                    "DELETE FROM states WHERE key >= ? AND key < ?",
                    [(k, k + "\U0010ffff") for k in deletes],
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def load_states(self) -> dict[str, Any]:
        with self._lock:
            rows = self._db.execute("SELECT key, value FROM states").fetchall()
        return {k: json.loads(v) for k, v in rows}

    # ------------------------------------------------------------------ the log

    def append_log(self, records: Sequence[Mapping[str, Any]]) -> list[int]:
        ids = []
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                for r in records:
                    cur = db.execute(
                        "INSERT INTO log (time, project, kind, path, state, record) VALUES (?, ?, ?, ?, ?, ?)",
                        (
                            r["time"],
                            r["project"],
                            r["kind"],
                            r.get("path") or r.get("frontend") or "",
                            str(r.get("to") or ""),
                            json.dumps(r),
                        ),
                    )
                    ids.append(int(cur.lastrowid or 0))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return ids

    def query_log(self, query: LogQuery) -> list[LogEntry]:
        sql = ["SELECT id, record FROM log WHERE id > ?"]
        args: list[Any] = [query.after_id]
        if query.project:
            sql.append("AND project = ?")
            args.append(query.project)
        if query.path_prefix:
            sql.append("AND path >= ? AND path < ?")
            args += [query.path_prefix, query.path_prefix + "\U0010ffff"]
        if query.kind:
            sql.append("AND kind = ?")
            args.append(query.kind)
        if query.kinds is not None:
            sql.append(f"AND kind IN ({','.join('?' * len(query.kinds))})")
            args += list(query.kinds)
        if query.state:
            sql.append("AND state = ?")
            args.append(query.state)
        if query.since is not None:
            sql.append("AND time >= ?")
            args.append(query.since)
        if query.until is not None:
            sql.append("AND time < ?")
            args.append(query.until)
        sql.append("ORDER BY id LIMIT ?")
        args.append(query.limit)
        with self._lock:
            rows = self._db.execute(" ".join(sql), args).fetchall()
        return [LogEntry(int(i), json.loads(rec)) for i, rec in rows]

    def last_log_id(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT COALESCE(MAX(id), 0) FROM log").fetchone()
        return int(row[0])

    def trim_log(self, keep: int) -> int:
        with self._lock:
            cur = self._db.execute(
                "DELETE FROM log WHERE id <= (SELECT COALESCE(MAX(id), 0) FROM log) - ?", (keep,)
            )
            return cur.rowcount

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _doc(row: tuple[Any, ...]) -> Document:
    key, value, revision, created, updated = row
    return Document(key, json.loads(value), int(revision), float(created), float(updated))
