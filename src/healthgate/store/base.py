"""The store interface: the one source of truth, split by concern.

Three kinds of data, three contracts (a store implements all three; the
memory and SQLite stores here, an etcd store for clusters later, all pass the
one contract suite in ``tests/contract/``):

* :class:`ResourceStore` - **resources**, revisioned documents. The store has
  one revision counter; every committed transaction moves it on by one, and
  each document remembers the revision that last changed it (its
  *fingerprint*). A write is one :class:`Txn` over several documents, all or
  nothing, whose preconditions are checked *inside* the transaction:

  - ``expect[key] = revision``: the document still has this revision
    (a fingerprint the client sent);
  - ``expect[key] = None``: the document does not exist (create-only);
  - ``expect[key] = EXISTS``: it exists, at any revision (replace, delete);
  - ``base_revision = R``: nothing at all changed since revision R. The
    writer planned and validated the whole world as of R (references,
    "nothing refers to what is deleted", listen addresses); if another
    writer committed meanwhile the plan may be wrong, so the commit is
    refused with :class:`RevisionMoved` and the writer plans again.

  Readers never read the store directly on the hot path: every process keeps
  a mirror fed by :meth:`ResourceStore.watch` from the revision of the
  snapshot it loaded, *including its own writes* - a writer waits until its
  mirror has applied the revision its commit returned before it answers.
  A watch from a revision older than the store keeps history for raises
  :class:`Compacted`; the watcher then loads a new snapshot.
* :class:`StateStore` - **engine states**, the last known state of every
  endpoint, source, composite, NEG and route, last write wins, so that a
  restart resumes where it stopped (fail static).
* :class:`TransitionLog` - **the transition log**, append only, with
  increasing ids, bounded by a retention, queried by project, resource, kind,
  state and time.

Keys of resources are ``resources/<full resource path>``.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

EXISTS: Final = -1  # an expectation: the document exists, whatever its revision

# times read back from a store outside these are not trusted (epoch seconds)
EARLIEST, LATEST = 0.0, 4_102_444_800.0  # 2100-01-01


# a value read from etcd (or any process that is not this one) is decoded
# only within these bounds: anyone who can write to etcd can put anything there
MAX_VALUE_BYTES = 64 * 1024 * 1024


def decode_json(raw: bytes | str) -> Any:
    """A JSON value read from outside: ValueError (never another error) when
    it is too large or not JSON - deep nesting included, which the decoder
    refuses at its recursion limit (RecursionError, raised by json's C
    scanner before the stack is at risk) and which used to escape every
    handler and freeze the mirror at that revision."""
    if len(raw) > MAX_VALUE_BYTES:
        raise ValueError(f"a value of {len(raw)} bytes, more than {MAX_VALUE_BYTES}")
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def sane_time(value: Any) -> float:
    """A time read from a store (or another process): a finite number of
    seconds within this century and the next (ValueError otherwise)."""
    t = float(value)
    if not math.isfinite(t) or not EARLIEST <= t <= LATEST:
        raise ValueError(f"time {value!r} out of range")
    return t


@dataclass(frozen=True, slots=True)
class Document:
    key: str
    value: Mapping[str, Any]
    revision: int  # the store revision that last changed it (the fingerprint)
    created: float
    updated: float


@dataclass(frozen=True, slots=True)
class Change:
    """One document changed by the transaction that made ``revision``."""

    revision: int
    key: str
    value: Mapping[str, Any] | None  # None: deleted
    time: float = 0.0  # when it was committed (the document's ``updated``)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every document under a prefix, as of one revision."""

    revision: int
    documents: list[Document]


@dataclass(slots=True)
class Txn:
    puts: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    deletes: list[str] = field(default_factory=list)
    # key -> revision it must have now (None: must not exist; EXISTS: must exist)
    expect: dict[str, int | None] = field(default_factory=dict)
    # commit only if the store's revision is still this one (see the module doc)
    base_revision: int | None = None


class StoreError(Exception):
    """The store refused or failed a request (the subclasses say which)."""


class PreconditionFailed(StoreError):
    """A document did not have the revision (or existence) a write expected."""

    def __init__(self, key: str, expected: int | None, actual: int | None) -> None:
        self.key, self.expected, self.actual = key, expected, actual
        super().__init__(f"{key}: expected revision {expected}, found {actual}")


class RevisionMoved(StoreError):
    """Something was committed after the revision a write was planned at."""

    def __init__(self, base: int, actual: int) -> None:
        self.base, self.actual = base, actual
        super().__init__(f"planned at revision {base}, the store is at {actual}")


class Compacted(StoreError):
    """A watch asked for history the store no longer keeps."""

    def __init__(self, requested: int, oldest: int) -> None:
        self.requested, self.oldest = requested, oldest
        super().__init__(f"revision {requested} is compacted (oldest kept: {oldest})")


class Unavailable(StoreError):
    """The store cannot take writes now (no quorum, read-only or full disk)."""


class TooLarge(StoreError):
    """One transaction is larger than the store takes (etcd's --max-txn-ops
    and --max-request-bytes); the message says which limit and how to raise it."""


class NotLeader(StoreError):
    """A write guarded by an election key found the key gone: the writer was
    deposed (cluster mode), and the write was not made."""


@dataclass(frozen=True, slots=True)
class Guard:
    """A leader's permission to write (cluster mode): its election key and
    that key's create revision (cluster/election.py). A guarded write is
    made only while the key still exists with that revision - compared
    inside the write's own transaction - else :class:`NotLeader` and nothing
    is written. A value the writer passes with each write, never state of
    the store. Single-process stores have one writer and ignore it."""

    key: str
    revision: int


@dataclass(frozen=True, slots=True)
class LogQuery:
    project: str | None = None
    path_prefix: str | None = None  # a resource path (or a prefix of one)
    kind: str | None = None
    state: str | None = None  # the new state
    since: float | None = None
    until: float | None = None
    after_id: int = 0
    limit: int = 1000
    kinds: tuple[str, ...] | None = None  # restrict to these kinds (access rules)


@dataclass(frozen=True, slots=True)
class LogEntry:
    id: int
    record: Mapping[str, Any]


class ResourceStore(Protocol):
    def revision(self) -> int: ...
    def get(self, key: str) -> Document | None: ...
    def snapshot(self, prefix: str) -> Snapshot: ...
    def commit(self, txn: Txn) -> int:
        """Execute ``txn`` atomically; return the new revision (the current
        one when it changes nothing: deletes of missing keys, no puts).
        Raises :class:`PreconditionFailed` or :class:`RevisionMoved` and
        writes nothing."""

    def changes_since(self, revision: int, limit: int = 10_000) -> list[Change]:
        """Committed changes with a revision above ``revision``, oldest first
        (whole transactions only). Raises :class:`Compacted`."""

    def watch(self, from_revision: int) -> AsyncIterator[list[Change]]:
        """Every change after ``from_revision``, in order, one transaction's
        changes per item, then live ones as they are committed. Raises
        :class:`Compacted` when that history is gone. Must be used on the
        event loop that serves the process."""


class StateStore(Protocol):
    def save_states(
        self, puts: Mapping[str, Any], deletes: Iterable[str] = (), guard: Guard | None = None
    ) -> None:
        """Delete ``deletes``, then upsert ``puts`` (a key both deleted and put
        is kept, as put), in one transaction. A delete that ends with ``/``
        deletes every key under it (``endpoint/<bs>/endpoints/``); any other
        deletes that one key: ``node/.../web`` never takes ``node/.../web-2``
        with it (state keys never end with ``/``)."""

    def load_states(self, prefix: str = "") -> dict[str, Any]:
        """Every stored state whose key starts with ``prefix``."""
        ...


# A record may carry a write id under this key (cluster mode: the recorder's,
# one per record): stored with it, never returned by query_log - it lets a
# writer whose append timed out find whether it was applied (``written``)
# instead of appending it a second time.
WRITE_ID: Final = "_w"
WRITTEN_SCAN: Final = 1000  # log entries ``written`` looks back through


class TransitionLog(Protocol):
    def append_log(
        self, records: Sequence[Mapping[str, Any]], guard: Guard | None = None
    ) -> list[int]: ...
    def query_log(self, query: LogQuery) -> list[LogEntry]: ...
    def last_log_id(self) -> int: ...
    def trim_log(self, keep: int) -> int: ...
    def written(self, write_ids: Collection[str]) -> dict[str, int]:
        """Which of these write ids the last ``WRITTEN_SCAN`` log entries
        carry: write id -> log id (an append whose outcome was not known -
        a timeout, a connection lost - may have been applied)."""
        ...


def without_write_id(record: Mapping[str, Any]) -> Mapping[str, Any]:
    """A stored record as readers get it (no write id)."""
    if WRITE_ID not in record:
        return record
    return {k: v for k, v in record.items() if k != WRITE_ID}


def written_among(
    entries: Iterable[tuple[int, Mapping[str, Any]]], write_ids: Collection[str]
) -> dict[str, int]:
    """``written`` over (id, stored record) pairs."""
    wanted = set(write_ids)
    out: dict[str, int] = {}
    for entry_id, record in entries:
        wid = record.get(WRITE_ID)
        if isinstance(wid, str) and wid in wanted:
            out[wid] = entry_id
    return out


class Store(ResourceStore, StateStore, TransitionLog, Protocol):
    """All three, as one process uses them."""

    def close(self) -> None: ...


def record_matches(query: LogQuery, record: Mapping[str, Any]) -> bool:
    """Does a transition record pass the query's filters (ids and times aside)?
    Shared by the in-memory log and the live event stream."""
    if query.project is not None and record.get("project") != query.project:
        return False
    if query.kind and record.get("kind") != query.kind:
        return False
    if query.kinds is not None and record.get("kind") not in query.kinds:
        return False
    if query.state and str(record.get("to")) != query.state:
        return False
    return not (query.path_prefix and not record_path(record).startswith(query.path_prefix))


def record_path(record: Mapping[str, Any]) -> str:
    return str(record.get("path") or record.get("frontend") or "")
