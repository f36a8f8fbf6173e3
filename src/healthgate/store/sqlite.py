"""The embedded default store: SQLite in WAL mode.

One connection, guarded by a lock, used from worker threads (the async
callers wrap calls in ``asyncio.to_thread``). ``synchronous=FULL`` makes a
committed transaction durable before ``commit`` returns, so a write that was
acknowledged to a client survives ``kill -9`` and power loss.

Every committed change is also written to a ``changes`` table in the same
transaction: the history that :meth:`SqliteStore.watch` replays from a
revision. It keeps the last ``history`` revisions; a watch from before them
raises :class:`~healthgate.store.base.Compacted`, as etcd does.

One process at a time: the store takes an exclusive lock (``flock``) on
``<database>.lock`` when it opens, and writes its process id there, so a
second ``serve`` on the same file stops at once and names the holder
(two writers that never see each other's commits would diverge).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
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
    StoreError,
    Txn,
    Unavailable,
    without_write_id,
    written_among,
)
from healthgate.store.txn import check_txn
from healthgate.store.watch import WatchHub

log = logging.getLogger("healthgate.store")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta (key, value) VALUES ('revision', 0);
INSERT OR IGNORE INTO meta (key, value) VALUES ('compacted', 0);
CREATE TABLE IF NOT EXISTS documents (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    revision INTEGER NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS changes (
    revision INTEGER NOT NULL,
    key TEXT NOT NULL,
    value TEXT,
    time REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS changes_revision ON changes (revision);
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
CREATE INDEX IF NOT EXISTS log_project_kind ON log (project, kind, id);
"""

# The layout's version, in SQLite's own ``PRAGMA user_version``:
#   1  the layout of the first releases (unmarked: user_version 0, tables present)
#   2  + an index of the log by (project, kind, id): ``events --kind`` no longer
#        scans a project's whole log
SCHEMA_VERSION = 2
MIGRATIONS: dict[int, str] = {
    1: "CREATE INDEX IF NOT EXISTS log_project_kind ON log (project, kind, id);",
}


class SchemaError(StoreError):
    """The database was written by a newer healthgate."""


def _open_failure(path: str, exc: sqlite3.DatabaseError) -> str:
    """One line naming the file and what to do, by SQLite's error code."""
    code = getattr(exc, "sqlite_errorname", "")
    if code in ("SQLITE_NOTADB", "SQLITE_CORRUPT"):
        return (
            f"{path} is not a readable healthgate database ({exc}): move it aside to start "
            "from an empty store, or restore it from a backup"
        )
    if code.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")):
        return f"{path} cannot be opened for writing ({exc}): give serve a writable --db"
    if code == "SQLITE_FULL":
        return f"{path}: the disk is full ({exc}): free space, then start again"
    return f"{path} could not be opened ({exc})"


class StoreLocked(StoreError):
    """Another process has this database open."""


def _lock_file(db_path: str) -> int:
    """Take the exclusive lock beside the database; return its descriptor.
    Opened without following a symlink (another user's link there would
    make this process write its pid wherever the link points) and created
    0600."""
    lock_path = db_path + ".lock"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(f"{lock_path} is a symbolic link: refused (remove it)") from None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise StoreLocked(
            f"{db_path} is in use by process {holder} (lock {lock_path}): "
            "stop that healthgate first, or give this one its own --db"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _create_private(path: str) -> None:
    """A new database file is created 0600 (its WAL and shared-memory files
    take the same mode): the resources, states and log are no one else's.
    A symbolic link that points at nothing is refused: SQLite would create
    the file it points at - wherever another user's link sends it."""
    if path == ":memory:":
        return
    if os.path.islink(path) and not os.path.exists(path):
        raise StoreError(
            f"{path} is a symbolic link to {os.readlink(path)!r}, which does not exist: "
            "refused (remove the link, or give --db the real file)"
        )
    if os.path.exists(path):
        return
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))


class SqliteStore:
    def __init__(
        self,
        path: str | Path,
        clock: Callable[[], float] = time.time,
        history: int = 10_000,
        exclusive: bool = True,
    ) -> None:
        self.path = str(path)
        self._clock = clock
        self.history = history  # revisions of change history kept for watches
        self._lock_fd = _lock_file(self.path) if exclusive else -1
        self._lock = threading.RLock()
        try:
            _create_private(self.path)
        except StoreError:
            self._release_lock()
            raise
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._refuse_newer()  # (before even the journal mode is set)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._open_schema()
        except sqlite3.DatabaseError as exc:
            self._release_lock()
            raise StoreError(_open_failure(self.path, exc)) from None
        except StoreError:
            self._db.close()
            self._release_lock()
            raise
        self._hub = WatchHub()

    # ------------------------------------------------------------------ the layout

    def _refuse_newer(self) -> None:
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise SchemaError(
                f"{self.path} was written by a newer healthgate (database layout {version}; "
                f"this one reads up to {SCHEMA_VERSION}): run that version, or restore the "
                "backup taken when it upgraded the database (docs/operations.md, 'Upgrading')"
            )

    def _open_schema(self) -> None:
        """Create the layout, or migrate an older one (after a backup beside
        it); a newer one was refused before anything was written."""
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        existing = self._db.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name='documents'"
        ).fetchone()
        if existing is None:  # a new database
            self._db.executescript(SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            return
        version = version or 1  # (the first layout carried no version)
        if version == SCHEMA_VERSION:
            return
        backup = f"{self.path}.layout{version}.bak"
        if self.path != ":memory:":
            with contextlib.closing(sqlite3.connect(backup)) as copy:
                self._db.backup(copy)
            os.chmod(backup, 0o600)
        for step in range(version, SCHEMA_VERSION):
            self._db.executescript(
                f"BEGIN; {MIGRATIONS[step]} PRAGMA user_version={step + 1}; COMMIT;"
            )
        log.warning(
            "%s: database layout %d migrated to %d (the layout-%d copy is %s)",
            self.path, version, SCHEMA_VERSION, version, backup,
        )  # fmt: skip

    # ------------------------------------------------------------------ resources

    def _meta(self, key: str) -> int:
        return int(self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()[0])

    def revision(self) -> int:
        with self._lock:
            return self._meta("revision")

    def get(self, key: str) -> Document | None:
        with self._lock:
            row = self._db.execute(
                "SELECT key, value, revision, created, updated FROM documents WHERE key=?", (key,)
            ).fetchone()
        return _doc(row) if row else None

    def snapshot(self, prefix: str) -> Snapshot:
        with self._lock:  # (one connection under one lock: no commit between the reads)
            rows = self._db.execute(
                "SELECT key, value, revision, created, updated FROM documents "
                "WHERE key >= ? AND key < ? ORDER BY key",
                (prefix, prefix + "\U0010ffff"),
            ).fetchall()
            rev = self._meta("revision")
        return Snapshot(rev, [_doc(r) for r in rows])

    def commit(self, txn: Txn) -> int:
        now = self._clock()
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                current = self._meta("revision")
                check_txn(txn, current, self._current_revision)
                rev = current + 1
                rows: list[tuple[int, str, str | None, float]] = []
                for key, value in txn.puts.items():
                    text = json.dumps(value, sort_keys=True)
                    db.execute(
                        "INSERT INTO documents (key, value, revision, created, updated) "
                        "VALUES (?, ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET "
                        "value=excluded.value, revision=excluded.revision, updated=excluded.updated",
                        (key, text, rev, now, now),
                    )
                    rows.append((rev, key, text, now))
                for key in txn.deletes:
                    if db.execute("DELETE FROM documents WHERE key=?", (key,)).rowcount:
                        rows.append((rev, key, None, now))
                if not rows:  # nothing changed: no new revision (as in etcd)
                    db.execute("ROLLBACK")
                    return current
                db.executemany("INSERT INTO changes VALUES (?, ?, ?, ?)", rows)
                db.execute("UPDATE meta SET value=? WHERE key='revision'", (rev,))
                floor = rev - self.history
                if floor > self._meta("compacted"):
                    db.execute("DELETE FROM changes WHERE revision <= ?", (floor,))
                    db.execute("UPDATE meta SET value=? WHERE key='compacted'", (floor,))
                db.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                _rollback(db)
                # a full or read-only disk: nothing was written, nothing acknowledged
                raise Unavailable(f"{self.path}: cannot write ({exc})") from None
            except BaseException:
                _rollback(db)
                raise
        self._hub.notify()
        return rev

    def _current_revision(self, key: str) -> int | None:
        row = self._db.execute("SELECT revision FROM documents WHERE key=?", (key,)).fetchone()
        return int(row[0]) if row else None

    def changes_since(self, revision: int, limit: int = 10_000) -> list[Change]:
        with self._lock:
            compacted = self._meta("compacted")
            if revision < compacted:
                raise Compacted(revision, compacted + 1)
            rows = self._db.execute(
                "SELECT revision, key, value, time FROM changes "
                "WHERE revision > ? AND revision <= ? ORDER BY revision, rowid",
                (revision, revision + limit),
            ).fetchall()
        return [
            Change(int(r), k, json.loads(v) if v is not None else None, float(t))
            for r, k, v, t in rows
        ]

    def watch(self, from_revision: int) -> AsyncIterator[list[Change]]:
        async def fetch(after: int) -> list[Change]:
            return await asyncio.to_thread(self.changes_since, after)

        return self._hub.watch(from_revision, fetch)

    # ------------------------------------------------------------------ states

    def save_states(
        self, puts: Mapping[str, Any], deletes: Iterable[str] = (), guard: Guard | None = None
    ) -> None:
        """(StateStore.save_states: deletes first, a ``/`` at the end a prefix.)"""
        deletes = list(deletes)
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(
                    "DELETE FROM states WHERE key >= ? AND key < ?",
                    [(k, k + "\U0010ffff") for k in deletes if k.endswith("/")],
                )
                db.executemany(
                    "DELETE FROM states WHERE key = ?",
                    [(k,) for k in deletes if not k.endswith("/")],
                )
                db.executemany(
                    "INSERT INTO states (key, value) VALUES (?, ?) "
                    "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                    [(k, json.dumps(v)) for k, v in puts.items()],
                )
                db.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                _rollback(db)
                raise Unavailable(f"{self.path}: cannot write ({exc})") from None
            except BaseException:
                _rollback(db)
                raise

    def load_states(self, prefix: str = "") -> dict[str, Any]:
        with self._lock:
            rows = self._db.execute(
                "SELECT key, value FROM states WHERE key >= ? AND key < ?",
                (prefix, prefix + "\U0010ffff"),
            ).fetchall()
        return {k: json.loads(v) for k, v in rows}

    # ------------------------------------------------------------------ the log

    def append_log(
        self, records: Sequence[Mapping[str, Any]], guard: Guard | None = None
    ) -> list[int]:
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
            except sqlite3.OperationalError as exc:
                _rollback(db)
                raise Unavailable(f"{self.path}: cannot write ({exc})") from None
            except BaseException:
                _rollback(db)
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
        return [LogEntry(int(i), without_write_id(json.loads(rec))) for i, rec in rows]

    def written(self, write_ids: Collection[str]) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, record FROM log ORDER BY id DESC LIMIT ?", (WRITTEN_SCAN,)
            ).fetchall()
        return written_among(((int(i), json.loads(r)) for i, r in rows), write_ids)

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
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # (closing the descriptor releases the lock)
            self._lock_fd = -1


def _rollback(db: sqlite3.Connection) -> None:
    """Roll back what is still open (SQLite rolls back by itself after some
    errors, a full disk among them)."""
    if db.in_transaction:
        db.execute("ROLLBACK")


def _doc(row: tuple[Any, ...]) -> Document:
    key, value, revision, created, updated = row
    return Document(key, json.loads(value), int(revision), float(created), float(updated))
