"""Upgrades of the SQLite store: a database written by the previous layout
is migrated when a newer serve opens it (a backup of the old one beside
it, nothing lost), and a database of a newer layout is refused with a clear
message before anything is written."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from healthgate.store.sqlite import SCHEMA_VERSION, SchemaError, SqliteStore
from tests.helpers import example_world
from tests.integration.serve_proc import ServeProcess


def layout_1(db: Path) -> None:
    """A database exactly as the first releases wrote it: no version mark,
    no index of the log by kind (what layout 2 adds)."""
    with sqlite3.connect(db) as conn:
        conn.execute("DROP INDEX log_project_kind")
        conn.execute("PRAGMA user_version=0")


def user_version(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])


def dump(db: Path) -> list[str]:
    """The database's content as SQL (its pages may move between the file and its WAL)."""
    with sqlite3.connect(db) as conn:
        return list(conn.iterdump())


def indexes(db: Path) -> set[str]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type='index'").fetchall()
    return {r[0] for r in rows}


def test_a_layout_1_database_is_migrated_with_a_backup_and_nothing_lost(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    with ServeProcess(db, "--no-dataplane") as serve, serve.client() as api:
        world = example_world()
        assert api.post("/v1/apply", json={"manifest": _yaml(world)}).status_code == 200
        before = api.get("/v1/projects/shop/regions/us-east1/healthChecks/http-8080").json()
        events_before = api.get("/v1/projects/shop/events?limit=10000").json()["items"]
    layout_1(db)
    assert "log_project_kind" not in indexes(db) and user_version(db) == 0
    with ServeProcess(db, "--no-dataplane") as serve, serve.client() as api:
        after = api.get("/v1/projects/shop/regions/us-east1/healthChecks/http-8080").json()
        assert after["fingerprint"] == before["fingerprint"]
        assert after["checkIntervalSec"] == before["checkIntervalSec"]
        events_after = api.get("/v1/projects/shop/events?limit=10000").json()["items"]
        assert events_after[: len(events_before)] == events_before
        assert "migrated to 2" in serve.log.read_text()
    assert user_version(db) == SCHEMA_VERSION == 2
    assert "log_project_kind" in indexes(db)
    backup = tmp_path / "s.db.layout1.bak"
    assert backup.exists() and (backup.stat().st_mode & 0o077) == 0
    assert user_version(backup) == 0 and "log_project_kind" not in indexes(backup)


def test_a_newer_layout_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    SqliteStore(db).close()
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA user_version=3")
    written = dump(db)
    done = subprocess.run(
        [sys.executable, "-m", "healthgate", "serve", "--db", str(db), "--no-dataplane"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "written by a newer healthgate (database layout 3; this one reads up to 2)" in (
        done.stderr
    )
    assert dump(db) == written and user_version(db) == 3
    # in this process too: refused, and the lock given back (refused again, not "in use")
    for _ in range(2):
        with pytest.raises(SchemaError, match="newer healthgate"):
            SqliteStore(db)


def test_a_new_database_is_marked_with_the_current_layout(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    SqliteStore(db).close()
    assert user_version(db) == SCHEMA_VERSION


def _yaml(docs: list[dict[str, object]]) -> str:
    return yaml.safe_dump_all(docs)
