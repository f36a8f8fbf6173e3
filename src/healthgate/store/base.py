"""The store interface: narrow, so that etcd can implement it later.

Three kinds of data, three rules:

* **Resources** are revisioned documents. Every write is a transaction over
  several documents at once (all or nothing), may carry preconditions (the
  revision each document must still have, or None for "must not exist"), and
  bumps the store's single revision counter. Each document remembers the
  revision that last changed it: that is its *fingerprint*. Watchers see every
  committed change in order.
* **States** are the engine's last known states (endpoints, sources,
  composites, NEGs, routes), last write wins. They let a restart resume where
  it stopped instead of from UNKNOWN (fail static).
* **The log** is the transition log: append only, bounded by a retention
  setting, queried by project, resource, kind, state and time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Document:
    key: str
    value: Mapping[str, Any]
    revision: int  # the store revision that last changed it (the fingerprint)
    created: float
    updated: float


@dataclass(frozen=True, slots=True)
class Change:
    revision: int
    key: str
    value: Mapping[str, Any] | None  # None: deleted


@dataclass(slots=True)
class Txn:
    puts: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    deletes: list[str] = field(default_factory=list)
    # key -> revision it must have now (None: it must not exist)
    expect: dict[str, int | None] = field(default_factory=dict)


class PreconditionFailed(Exception):
    def __init__(self, key: str, expected: int | None, actual: int | None) -> None:
        self.key, self.expected, self.actual = key, expected, actual
        super().__init__(f"{key}: expected revision {expected}, found {actual}")


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


class Store(Protocol):
    def revision(self) -> int: ...
    def get(self, key: str) -> Document | None: ...
    def list_prefix(self, prefix: str) -> list[Document]: ...
    def commit(self, txn: Txn) -> int: ...  # returns the new revision; raises PreconditionFailed
    def watch(self, callback: Callable[[Sequence[Change]], None]) -> Callable[[], None]: ...

    def save_states(self, puts: Mapping[str, Any], deletes: Iterable[str] = ()) -> None:
        """Upsert ``puts``; delete every key starting with one of ``deletes`` (prefixes)."""

    def load_states(self) -> dict[str, Any]: ...

    def append_log(self, records: Sequence[Mapping[str, Any]]) -> list[int]: ...
    def query_log(self, query: LogQuery) -> list[LogEntry]: ...
    def last_log_id(self) -> int: ...
    def trim_log(self, keep: int) -> int: ...

    def close(self) -> None: ...
