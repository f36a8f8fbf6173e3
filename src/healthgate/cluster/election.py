"""Leader election: etcd's election recipe (``concurrency.Election``).

Every node *campaigns* by creating a key under the election's prefix,
``<prefix><lease in hex>``, attached to its session's lease, with its name
as the value; the candidate whose key has the lowest create revision
leads. Each node *observes* the prefix (list, then watch: store/etcd_client.py
``follow``) and so knows the leader at all times.

The leader's permission to write is a value, not a state of anything:
:class:`~healthgate.store.base.Guard` - its key and that key's create
revision - handed to ``on_elected`` and passed by the writer with every
leader write, which etcd makes only while the key still exists with that
revision (a compare inside the write's transaction). A deposed leader's
late write therefore fails (``NotLeader``) and is dropped, whoever is
slow. A key dies with its session's lease; :meth:`Election.resign` deletes
it at once.

Candidates' values are names read from etcd: one that is not a valid node
name is skipped (and logged), never trusted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from healthgate.cluster.session import Session
from healthgate.model.names import is_valid_name
from healthgate.store.base import Guard, StoreError
from healthgate.store.etcd_client import EtcdClient, Event, KeyValue, follow

log = logging.getLogger("healthgate.cluster")


class Election:
    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        name: str,
        on_elected: Callable[[Guard], None],
        on_deposed: Callable[[str], None],
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.name = name
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.leader: str | None = None  # the leading node's name
        self.guard: Guard | None = None  # while this node leads
        self._candidates: dict[str, tuple[int, str]] = {}  # key -> (create revision, node)
        self._mine: Guard | None = None  # this node's campaign key

    @property
    def leading(self) -> bool:
        return self.guard is not None

    async def campaign(self, session: Session) -> None:
        """Stand for election under ``session`` and observe the election,
        until cancelled (the session's end ends the campaign: the caller
        cancels it and campaigns again under the next session)."""
        key = f"{self.prefix}{session.id:x}"
        while True:
            try:
                _, rev = await asyncio.to_thread(
                    self.client.create, key, self.name.encode(), session.id
                )
                break
            except StoreError as exc:
                log.info("cannot campaign yet (%s); retrying", exc)
                await asyncio.sleep(1.0)
        self._mine = Guard(key, rev)
        revision, kvs = await asyncio.to_thread(self.client.list_prefix, self.prefix)
        self._reset(kvs)
        await follow(self.client, self.prefix, revision, self._reset, self._changed)

    def _candidate(self, kv: KeyValue) -> tuple[int, str] | None:
        try:
            node = kv.value.decode()
        except UnicodeDecodeError:
            node = ""
        if not is_valid_name(node):
            log.warning("ignoring an election key %s whose value is not a node name", kv.key)
            return None
        return kv.create_revision, node

    def _reset(self, kvs: list[KeyValue]) -> None:
        self._candidates = {}
        for kv in kvs:
            candidate = self._candidate(kv)
            if candidate is not None:
                self._candidates[kv.key] = candidate
        self._elect()

    def _changed(self, ev: Event) -> None:
        if ev.deleted:
            self._candidates.pop(ev.kv.key, None)
        else:
            candidate = self._candidate(ev.kv)
            if candidate is None:
                return
            self._candidates[ev.kv.key] = candidate
        self._elect()

    def _elect(self) -> None:
        if not self._candidates:
            self.leader = None
            self.step_down("no candidate")
            return
        key, (rev, node) = min(self._candidates.items(), key=lambda kv: kv[1][0])
        if node != self.leader:
            log.info("leader: %s", node)
        self.leader = node
        mine = self._mine
        if mine is not None and key == mine.key and rev == mine.revision:
            if self.guard is None:
                self.guard = mine
                self.on_elected(mine)
        elif self.guard is not None:
            self.step_down(f"{node} leads")

    def step_down(self, why: str) -> None:
        """This node no longer leads (a session lost, another node leads, stopping)."""
        if self.guard is not None:
            self.guard = None
            self.on_deposed(why)

    async def resign(self) -> None:
        """Step down and delete this node's key (the next candidate leads at once)."""
        mine, self._mine = self._mine, None
        self.step_down("resigned")
        if mine is not None:
            try:
                await asyncio.to_thread(self.client.delete, mine.key)
            except StoreError as exc:
                log.info("could not delete the election key (%s): it ends with its lease", exc)

    def forget_campaign(self) -> None:
        """The session is lost: this node's key is (or will be) gone with it."""
        self._mine = None
        self.step_down("the session was lost")
