"""A session: an etcd lease kept alive (etcd's ``concurrency.Session``).

:meth:`Session.open` grants a lease of ``ttl`` seconds and keeps it alive
from the event loop, refreshing it every ``ttl / 3`` (the refresh is a
blocking call, made in a thread, each member tried for a short while so
that one frozen member does not use up the lease).

A session is **lost** (:attr:`Session.lost` set, :attr:`Session.alive`
false) as soon as either

* etcd says the lease expired, or
* this process has not refreshed it for a whole TTL - etcd may have let it
  go already (or may not, on a leader change it extends every lease), but
  a node that cannot know must act as if it had: it stops leading and
  stops writing opinions *at once*, rather than when etcd answers again.

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
        self._refresh_task: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.id != 0 and not self.lost.is_set()

    async def open(self) -> int:
        """A new lease, kept alive from now on; the new epoch."""
        await self._stop_refreshing()
        self.id = await asyncio.to_thread(self.client.grant, self.ttl)
        self.epoch += 1
        self.lost.clear()
        self._refresh_task = asyncio.create_task(self._refresh(), name="etcd-session")
        return self.epoch

    def _lose(self, why: str) -> None:
        if not self.lost.is_set():
            log.warning("session (lease %x) lost: %s", self.id, why)
            self.lost.set()

    async def _refresh(self) -> None:
        loop = asyncio.get_running_loop()
        ok_at = loop.time()
        failing = False
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                left = await asyncio.to_thread(
                    self.client.keep_alive_once, self.id, max(0.2, self.ttl / 4)
                )
            except StoreError as exc:
                if not failing:
                    log.info("lease %x not refreshed (%s); retrying", self.id, exc)
                    failing = True
                if loop.time() - ok_at >= self.ttl:
                    self._lose(f"not refreshed for {self.ttl} s ({exc})")
                    return
                continue
            if left <= 0:
                self._lose("etcd says it expired")
                return
            if failing:
                log.info("lease %x refreshed again", self.id)
                failing = False
            ok_at = loop.time()

    async def _stop_refreshing(self) -> None:
        task, self._refresh_task = self._refresh_task, None
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
