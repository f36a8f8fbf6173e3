"""Access: who may read and write what.

Bound to loopback (the default), the API needs no credentials: whoever can
reach it is on the machine. Bound anywhere else, every request needs
``Authorization: Bearer TOKEN``; each token is bound to one project (or ``*``)
and one role:

========  ==========================================================
admin     everything, every project
producer  read and write every kind in its project; its events
consumer  read its project; write only consumer kinds (PSC NEGs,
          global backend services and forwarding rules); events of
          its own PSC NEGs and front ends only
viewer    read its project and its events
metrics   ``/metrics`` only (which lists every project): for a scraper
========  ==========================================================

A consumer therefore never sees a producer's backends, sources or
composites: they live in the producer's project. What reaches the consumer is
the state of its own PSC NEGs, whose reasons name the attachment and the
published service's state, not the producer's internals.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from healthgate.health.states import RecordKind

Role = Literal["admin", "producer", "consumer", "viewer", "metrics"]
CONSUMER_EVENT_KINDS: tuple[str, ...] = (
    RecordKind.NEG,
    RecordKind.ROUTE,
    RecordKind.CHANGE,
    RecordKind.RAMP,
    RecordKind.HOLD,
    RecordKind.PRACTICE,
    RecordKind.CONVERGENCE,
)


class TokenEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    token: str = Field(min_length=16)
    project: str
    role: Role
    # who this is, in Change records and shifts (``actor``); without one, the
    # role and the first 8 hex digits of the token's SHA-256 (not a secret)
    name: str | None = Field(None, min_length=1, max_length=63, pattern=r"^[A-Za-z0-9._@+-]+$")

    @property
    def actor(self) -> str:
        if self.name:
            return self.name
        return f"{self.role}-{hashlib.sha256(self.token.encode()).hexdigest()[:8]}"


@dataclass(frozen=True, slots=True)
class Principal:
    project: str  # "*" for every project
    role: Role
    name: str = "local"  # the actor of its writes (``local``: no tokens, on loopback)

    @property
    def key(self) -> str:
        """This principal's token, as a key for its shares (streams, bodies,
        manifest slots): never the token itself."""
        return f"{self.project}/{self.role}/{self.name}"

    def can_read(self, project: str) -> bool:
        return self.role != "metrics" and self.project in ("*", project)

    @property
    def can_scrape(self) -> bool:
        """/metrics lists every project's backend services and endpoints:
        admins and metrics tokens only (a metrics token reads nothing else)."""
        return self.role in ("admin", "metrics")

    def can_write(self, project: str, kind: str, is_global: bool, psc: bool) -> bool:
        if not self.can_read(project) or self.role == "viewer":
            return False
        if self.role == "consumer":
            consumer_kinds = ("BackendService", "ForwardingRule", "Webhook", "PracticeRun")
            return (is_global and kind in consumer_kinds) or psc
        return True

    @property
    def may_write(self) -> bool:
        """May this principal write anything at all (checked before any work)?"""
        return self.role != "viewer"

    def event_kinds(self) -> tuple[str, ...] | None:
        return CONSUMER_EVENT_KINDS if self.role == "consumer" else None


ANONYMOUS_ADMIN = Principal("*", "admin")


class AccessError(Exception):
    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(message)


class Access:
    def __init__(
        self, tokens: list[TokenEntry] | None, open_access: bool, path: str | None = None
    ) -> None:
        self.tokens = tokens or []
        self.open = open_access
        self.path = path  # the tokens file, read again on SIGHUP

    @classmethod
    def for_listen(cls, host: str, tokens_file: str | None) -> Access:
        tokens = load_tokens(tokens_file) if tokens_file else None
        if tokens:
            return cls(tokens, open_access=False, path=tokens_file)
        if not is_loopback(host):
            raise ValueError(
                f"--listen {host} is not a loopback address: give --tokens FILE "
                "(bearer tokens bound to a project and role) to serve beyond this machine"
            )
        return cls(None, open_access=True)

    def reload(self) -> str:
        """Read the tokens file again (SIGHUP): the new tokens take effect
        for the next request; a file that does not parse changes nothing.
        What was done, for the log (never a token's value)."""
        if self.path is None:
            return "no tokens file to reload (serve was started without --tokens)"
        try:
            tokens = load_tokens(self.path)
        except (ValueError, OSError) as exc:
            return f"tokens file not reloaded, the old tokens stay: {exc}"
        if not tokens:
            return "tokens file not reloaded: it holds no token (the old tokens stay)"
        self.tokens = tokens
        return f"tokens reloaded from {self.path}: {len(tokens)} tokens"

    def authenticate(self, authorization: str | None) -> Principal:
        if self.open:
            return ANONYMOUS_ADMIN
        if not authorization or not authorization.lower().startswith("bearer "):
            raise AccessError(401, "missing bearer token (Authorization: Bearer TOKEN)")
        # as bytes: compare_digest refuses str with non-ASCII characters (a
        # hostile header must get 401, not an internal error)
        presented = authorization[7:].strip().encode("utf-8", "surrogateescape")
        for entry in self.tokens:
            if hmac.compare_digest(entry.token.encode(), presented):
                return Principal(entry.project, entry.role, entry.actor)
        raise AccessError(401, "unknown bearer token")


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_tokens(path: str | Path) -> list[TokenEntry]:
    """A YAML list of ``{token, project, role, name}``. Errors name the entry and
    the field, never a value (a malformed file used to print the token);
    a file readable by its group or by everyone is warned about."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text) or []
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "somewhere"
        problem = getattr(exc, "problem", None) or "not YAML"
        raise ValueError(f"{path}: not valid YAML at {where}: {problem}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of {{token, project, role}}")
    out = []
    for i, item in enumerate(data):
        try:
            out.append(TokenEntry.model_validate(item))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'entry'}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(f"{path}: entry {i}: {problems}") from None
    from healthgate.secrets import warn_if_readable

    warn_if_readable(str(path), "the tokens file")
    return out
