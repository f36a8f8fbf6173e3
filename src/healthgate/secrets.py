"""Secrets read from files (SPEC §7, "Secrets"): tokens and passwords are
never arguments (argv is visible to every local user) and never printed.

:func:`read_secret` reads one, refusing an empty file and warning when the
file is readable by its group or by everyone (the warning names the file
and its mode, never the value).
"""

from __future__ import annotations

import logging
import os
import stat

log = logging.getLogger("healthgate.secrets")

MAX_SECRET = 64 * 1024


def warn_if_readable(path: str, what: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning(
            "%s %s is readable by %s (mode %o): chmod 600 it",
            what,
            path,
            "everyone" if mode & stat.S_IROTH else "its group",
            stat.S_IMODE(mode),
        )


def read_secret(path: str, what: str) -> str:
    """The secret in ``path`` (its first line, without the line end)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SECRET + 1)
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_SECRET:
        raise ValueError(f"{what} {path}: larger than {MAX_SECRET} bytes: not a secret")
    text = raw.decode("utf-8", "replace").splitlines()
    if not text or not text[0].strip():
        raise ValueError(f"{what} {path}: empty")
    warn_if_readable(path, what)
    return text[0].strip()
