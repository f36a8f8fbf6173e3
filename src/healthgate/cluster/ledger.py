"""The leader's ledger: what a cluster node's recorder needs beyond embedded.

Every node computes the same transitions (with the same times); only the
elected node writes them to the log, each write guarded by its election.
The recorder (controlplane/recorder.py) stays the plain embedded writer;
this is the cluster's part of it, beside the election:

* **Who writes, under which guard.** The guard is the election's
  (cluster/election.py, its one holder): the ledger says whether this node
  writes now (:attr:`writing`), from its take-over until it is deposed or a
  guarded write fails.
* **Unconfirmed records.** The records this node computed and has not seen
  in the stored log yet (:meth:`computed`, :meth:`logged`). The node's
  status shows how many (:meth:`unwritten`).
* **Catch-up.** A new leader first writes what it computed since a horizon
  and no leader wrote (:meth:`catch_up`), checked against the log itself -
  so that a record the previous leader wrote is never written twice, whether
  or not this node's watch has delivered it yet.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

from healthgate.store.base import Guard, LogQuery, Store, StoreError

log = logging.getLogger("healthgate.recorder")

CATCH_UP_SCAN = 10_000  # log entries a new leader reads back to find what was not written
REMEMBERED = 10_000  # unconfirmed records, and paths' newest logged times, kept at most

Identity = tuple[str, str, float]


class LeaderLedger:
    def __init__(self, store: Store, guard: Callable[[], Guard | None]) -> None:
        self.store = store
        self._guard = guard  # the election's, while it leads
        self._writing = False
        # records this node computed and has not seen in the stored log
        # yet: written by this node if it is elected before they appear
        # (every node computes the same records, with the same times) - and
        # the records seen in the log lately, so that one this node computes
        # only after seeing it there is not taken for unwritten
        self._unconfirmed: dict[Identity, dict[str, Any]] = {}
        self._confirmed: dict[Identity, None] = {}
        # the time of the newest logged record of each path: an unconfirmed
        # record older than it was overtaken (the log went on past it; the
        # writer's twin of it may carry a slightly different time) and is
        # never written by a new leader - it would be a duplicate or out of order
        self._logged_at: dict[str, float] = {}
        self._horizon: float | None = None  # a new leader's, until it has caught up

    # ------------------------------------------------------------ who writes

    @property
    def writing(self) -> bool:
        """This node writes the log now."""
        return self._writing and self._guard() is not None

    def guard(self) -> Guard | None:
        """The guard of this node's writes, while it writes."""
        return self._guard() if self._writing else None

    def take_over(self, horizon: float) -> None:
        """This node was elected: it writes from now on, and first what it
        computed since ``horizon`` (a time) that no leader wrote."""
        self._writing = True
        self._horizon = horizon

    def stop(self) -> None:
        """Deposed, or a guarded write failed: this node writes nothing more."""
        self._writing = False
        self._horizon = None

    # --------------------------------------------------------------- records

    def computed(self, dicts: list[dict[str, Any]]) -> None:
        """Records this node computed: unconfirmed until read in the log. (A
        record of this node's own - its data plane's error gate - is not one
        every node computes: only a writer writes it.)"""
        unconfirmed, confirmed = self._unconfirmed, self._confirmed
        for d in dicts:
            key = identity(d)
            if key not in confirmed and not d.get("local"):
                unconfirmed[key] = d
        bound_dict(unconfirmed, REMEMBERED)

    def logged(self, record: dict[str, Any]) -> None:
        """A record read back from the stored log."""
        key = identity(record)
        self._unconfirmed.pop(key, None)
        self._confirmed[key] = None
        bound_dict(self._confirmed, REMEMBERED)
        path, _, when = key
        newest = max(when, self._logged_at.pop(path, when))
        self._logged_at[path] = newest  # (re-inserted: the bound drops the stalest paths)
        bound_dict(self._logged_at, REMEMBERED)

    def unwritten(self, horizon: float) -> int:
        """Records this node computed since ``horizon`` and has not seen in
        the log yet (0 once the log holds everything it decided)."""
        logged_at = self._logged_at
        return sum(1 for d in self._unconfirmed.values() if _open(d, horizon, logged_at))

    # --------------------------------------------------------------- catch-up

    async def catch_up(self, queued: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """A new leader's first write: what no leader wrote, oldest first,
        leaving out what is ``queued`` already (nothing once caught up;
        None: the log could not be read - try again later)."""
        horizon = self._horizon
        if horizon is None:
            return []
        try:
            missed = await asyncio.to_thread(self._missed, horizon)
        except StoreError as exc:
            log.warning("cannot read the log to catch up (%s); retrying in 1 s", exc)
            return None
        self._horizon = None
        waiting = {identity(d) for d in queued}
        missed = [d for d in missed if identity(d) not in waiting]
        if missed:
            log.warning("writing %d transitions that no leader wrote", len(missed))
        return missed

    @property
    def catching_up(self) -> bool:
        return self._horizon is not None

    def _missed(self, horizon: float) -> list[dict[str, Any]]:
        """(In a worker thread.) The unconfirmed records since ``horizon`` that
        the log does not hold, oldest first."""
        logged_at = dict(self._logged_at)
        candidates = [d for d in list(self._unconfirmed.values()) if _open(d, horizon, logged_at)]
        if not candidates:
            return []
        last = self.store.last_log_id()
        query = LogQuery(since=horizon, after_id=max(0, last - CATCH_UP_SCAN), limit=CATCH_UP_SCAN)
        logged: set[Identity] = set()
        for e in self.store.query_log(query):
            path, to, when = identity(dict(e.record))
            logged.add((path, to, when))
            logged_at[path] = max(when, logged_at.get(path, when))
        missed = [
            d for d in candidates if identity(d) not in logged and _open(d, horizon, logged_at)
        ]
        return sorted(missed, key=lambda d: float(d["time"]))


def _open(d: dict[str, Any], horizon: float, logged_at: dict[str, float]) -> bool:
    """An unconfirmed record that may still need writing: since ``horizon``
    and not older than the newest logged record of its path."""
    when = float(d["time"])
    return when >= horizon and when >= logged_at.get(identity(d)[0], when)


def identity(record: dict[str, Any]) -> Identity:
    """What makes a record the same on every node: what, to what, when."""
    return (
        str(record.get("path") or record.get("frontend")),
        str(record.get("to")),
        float(record.get("time", 0.0)),
    )


def bound_dict(d: dict[Any, Any], most: int) -> None:
    """Keep the newest entries of an insertion-ordered dict: past ``most``,
    its newest three quarters, rebuilt in one pass. (Deleting the oldest one
    at a time is quadratic - each look for the oldest walks past every slot
    deleted before it, until the dict is resized: a failover of 110,000
    transitions stalled a node 2.8 s here.)"""
    if len(d) > most:
        newest = list(itertools.islice(d.items(), len(d) - most * 3 // 4, None))
        d.clear()
        d.update(newest)
