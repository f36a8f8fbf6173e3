"""A session: an etcd lease kept alive (etcd's ``concurrency.Session``).

:meth:`Session.open` grants a lease of ``ttl`` seconds and keeps it alive
from the event loop, refreshing it every ``ttl / 3`` (the refresh is a
blocking call, made in a thread, each member tried for a short while so
that one frozen member does not use up the lease).

A session is **lost** (:attr:`Session.lost` set, :attr:`Session.alive`
false) as soon as either

* etcd says the lease expired, or
* the lease's deadline passes unrefreshed: a TTL from when the last
  refresh that etcd granted was sent (etcd may have let it go already - or
  may not: on a leader change it extends every lease - but a node that
  cannot know must act as if it had). A timer fires at that very moment:
  the node stops leading and stops writing opinions *at once*, rather than
  when a refresh fails or etcd answers again; :attr:`alive` compares the
  clock with the deadline itself, so nothing reads a stale "alive".

**Long work keeps it alive** (:meth:`Session.beat`): the refresh runs on
the event loop, and a node placing a large world (a membership change moves
a quarter of a million endpoints of a million, seconds of one core, longer
on shared cores) would starve it past the TTL, lose its session to its own
work, and move every node's share again - a storm that never settled in a
world of a million endpoints over four nodes on two cores. That work calls
``beat`` as it goes, which refreshes the lease in place once a third of the
TTL has passed: a node that makes progress is alive; a loop that is stuck
still loses its session.

``epoch`` counts the sessions this process has opened: whatever was formed
under an older epoch (an opinion queued while cut off) belongs to a lost
session and is never written (cluster/opinions.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from healthgate.store.base import StoreError
from healthgate.store.etcd_client import EtcdClient

log = logging.getLogger("healthgate.cluster")


class SessionLost(StoreError):
    """The session's lease expired (or could not be refreshed for a TTL)."""


class Session:
    def __init__(self, client: EtcdClient, ttl: int) -> None:
        self.client = client
        self.ttl = ttl
        self.id = 0  # the lease
        self.epoch = 0  # sessions opened by this process so far
        self.lost = asyncio.Event()
        self.expires = 0.0  # (loop time) when the lease may have ended, unless refreshed
        self._refresh_task: asyncio.Task[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._sent = 0.0  # (loop time) when the last refresh was sent
        self.beats = 0  # refreshes made by beat, from inside long work

    @property
    def alive(self) -> bool:
        return (
            self.id != 0
            and not self.lost.is_set()
            and asyncio.get_running_loop().time() < self.expires
        )

    async def open(self) -> int:
        """A new lease, kept alive from now on; the new epoch."""
        await self._stop_refreshing()
        sent = asyncio.get_running_loop().time()
        self.id = await asyncio.to_thread(self.client.grant, self.ttl)
        self.epoch += 1
        self.lost.clear()
        self._sent = sent
        self._extend(sent + self.ttl)
        self._refresh_task = asyncio.create_task(self._refresh(), name="etcd-session")
        return self.epoch

    def _extend(self, until: float) -> None:
        """The lease lives until ``until`` (loop time) unless refreshed: past
        it, the session is lost at that very moment - not when a refresh
        fails or etcd answers again (the deadline counts from when the
        refresh that etcd granted was *sent*: etcd's own count began no
        earlier)."""
        self.expires = until
        if self._deadline is not None:
            self._deadline.cancel()
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_at(until, self._lose, f"not refreshed for {self.ttl} s")

    def _lose(self, why: str) -> None:
        if not self.lost.is_set():
            log.warning("session (lease %x) lost: %s", self.id, why)
            self.lost.set()

    async def _refresh(self) -> None:
        loop = asyncio.get_running_loop()
        failing = False
        while not self.lost.is_set():
            await asyncio.sleep(max(0.0, self._sent + self.ttl / 3 - loop.time()))
            if loop.time() < self._sent + self.ttl / 3:
                continue  # (beat refreshed it meanwhile)
            sent = self._sent = loop.time()
            try:
                left = await asyncio.to_thread(
                    self.client.keep_alive_once, self.id, max(0.2, self.ttl / 4)
                )
            except StoreError as exc:
                if not failing:
                    log.info("lease %x not refreshed (%s); retrying", self.id, exc)
                    failing = True
                continue  # (the deadline loses the session if this goes on)
            if left <= 0:
                self._lose("etcd says it expired")
                return
            if self.lost.is_set():
                return  # (refreshed too late: the deadline passed meanwhile)
            if failing:
                log.info("lease %x refreshed again", self.id)
                failing = False
            self._extend(sent + left)

    def beat(self) -> None:
        """(On the event loop, from inside long synchronous work.) Refresh the
        lease now if a third of its TTL has passed since the last refresh was
        sent - a blocking call of a few milliseconds, made only while the
        work goes on (see the module doc)."""
        if self.id == 0 or self.lost.is_set():
            return
        loop = asyncio.get_running_loop()
        sent = loop.time()
        if sent < self._sent + self.ttl / 3:
            return
        self._sent = sent
        try:
            left = self.client.keep_alive_once(self.id, max(0.2, self.ttl / 4))
        except StoreError:
            return  # (the refresh task, or the deadline, decides)
        if left <= 0:
            self._lose("etcd says it expired")
            return
        if sent >= self.expires:
            return  # (too late: the deadline has passed, if unseen yet)
        self.beats += 1
        self._extend(sent + left)

    async def _stop_refreshing(self) -> None:
        task, self._refresh_task = self._refresh_task, None
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def close(self, revoke: bool = True) -> None:
        """Stop refreshing; with ``revoke``, end the lease at once (what was
        under it goes now, rather than after the TTL)."""
        await self._stop_refreshing()
        if revoke and self.id:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.client.revoke, self.id)
        self.lost.set()
