"""SPEC §7 "Secrets": no token value in an error or a log line; tokens
from files (the CLI's --token-file); a tokens file readable by others
warned about; SIGHUP reloads the tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.serve_proc import ServeProcess, wait_for
from tests.integration.servers import free_port

A = "a" * 20 + "-secret-A"
B = "b" * 20 + "-secret-B"


def tokens_file(tmp: Path, entries: object, mode: int = 0o600) -> Path:
    path = tmp / "tokens.yaml"
    path.write_text(entries if isinstance(entries, str) else yaml.safe_dump(entries))
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize(
    "content",
    [
        f"- token: {A}\n  project: shop\n  role: [boss\n",  # not YAML, the token on the line
        yaml.safe_dump([{"token": A, "project": "shop", "role": "boss"}]),  # no such role
        yaml.safe_dump([{"token": A, "project": "shop", "role": "admin", "extra": A}]),
        yaml.safe_dump([{"token": "short", "project": "shop", "role": "admin"}]),
    ],
)
def test_a_malformed_tokens_file_is_refused_without_printing_a_token(
    tmp_path: Path, content: str
) -> None:
    path = tokens_file(tmp_path, content)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "healthgate",
            "serve",
            "--db",
            str(tmp_path / "x.db"),
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--tokens",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert str(path) in proc.stderr
    assert A not in proc.stderr and "short" not in proc.stderr, proc.stderr


def test_sighup_reloads_the_tokens_and_a_bad_file_keeps_the_old_ones(tmp_path: Path) -> None:
    path = tokens_file(tmp_path, [{"token": A, "project": "*", "role": "admin"}], 0o644)
    with ServeProcess(tmp_path / "s.db", "--tokens", str(path)) as s:
        assert "the tokens file" in s.log.read_text() and "chmod 600" in s.log.read_text()
        with s.client(A) as a:
            assert a.get("/v1/projects").status_code == 200
        tokens_file(tmp_path, [{"token": B, "project": "*", "role": "admin"}])
        assert s.proc is not None
        s.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "tokens reloaded" in s.log.read_text(), 10, what="the reload")
        with s.client(A) as a, s.client(B) as b:
            assert a.get("/v1/projects").status_code == 401
            assert b.get("/v1/projects").status_code == 200
        tokens_file(tmp_path, "- [not: a, token")
        s.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "not reloaded" in s.log.read_text(), 10, what="the refused reload")
        with s.client(B) as b:
            assert b.get("/v1/projects").status_code == 200
        assert A not in s.log.read_text() and B not in s.log.read_text()


def test_the_cli_reads_its_token_from_a_file(tmp_path: Path) -> None:
    path = tokens_file(tmp_path, [{"token": A, "project": "*", "role": "admin"}])
    secret = tmp_path / "token"
    secret.write_text(A + "\n")
    os.chmod(secret, 0o600)
    with ServeProcess(tmp_path / "c.db", "--tokens", str(path)) as s:
        run = [sys.executable, "-m", "healthgate", "get", "hc", "--project", "shop"]
        run += ["--region", "us-east1", "--server", s.url]
        without = subprocess.run(run, capture_output=True, text=True, timeout=60, check=False)
        assert without.returncode == 1 and "401" in without.stderr + without.stdout
        with_file = subprocess.run(
            [*run, "--token-file", str(secret)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert with_file.returncode == 0, with_file.stderr


def test_the_database_and_its_lock_are_private_and_a_symlinked_lock_is_refused(
    tmp_path: Path,
) -> None:
    from healthgate.store.base import StoreError
    from healthgate.store.sqlite import SqliteStore

    db = tmp_path / "private.db"
    store = SqliteStore(db)
    from healthgate.store.base import Txn

    store.commit(Txn(puts={"resources/x": {"v": 1}}))
    for path in (db, Path(f"{db}.lock"), Path(f"{db}-wal")):
        assert path.exists() and (path.stat().st_mode & 0o077) == 0, (
            path,
            oct(path.stat().st_mode),
        )
    store.close()
    elsewhere = tmp_path / "victim"
    elsewhere.write_text("keep me")
    linked = tmp_path / "linked.db"
    Path(f"{linked}.lock").symlink_to(elsewhere)
    with pytest.raises(StoreError, match="symbolic link"):
        SqliteStore(linked)
    assert elsewhere.read_text() == "keep me"


def test_a_database_path_that_is_a_dangling_symlink_is_refused(tmp_path: Path) -> None:
    """SQLite follows a link to a file that does not exist and creates it -
    wherever another user's link in a shared directory points."""
    from healthgate.store.base import StoreError
    from healthgate.store.sqlite import SqliteStore

    target = tmp_path / "elsewhere" / "planted.db"
    target.parent.mkdir()
    db = tmp_path / "shared.db"
    db.symlink_to(target)
    with pytest.raises(StoreError, match=r"symbolic link to .* which does not exist"):
        SqliteStore(db)
    assert not target.exists()
    # a link to a database that is there is the operator's choice, and works
    SqliteStore(tmp_path / "real.db").close()
    linked = tmp_path / "linked.db"
    linked.symlink_to(tmp_path / "real.db")
    SqliteStore(linked).close()
