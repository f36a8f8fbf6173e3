"""A watch over a store that keeps its own change history (memory, SQLite).

The store calls :meth:`WatchHub.notify` after each commit, from whatever
thread committed; every watcher's event is set on its own event loop. A
watcher reads what changed from the store's history (``changes_since``) -
the notification carries no data, so a watcher that was slow or missed a
wake-up still reads every change, in order, exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from itertools import groupby

from healthgate.store.base import Change

Fetch = Callable[[int], Awaitable[list[Change]]]


class WatchHub:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def notify(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed: its watch is over
                loop.call_soon_threadsafe(event.set)

    async def watch(self, from_revision: int, fetch: Fetch) -> AsyncIterator[list[Change]]:
        """One item per committed transaction after ``from_revision``, then
        live ones; ``fetch(after)`` reads the history (may raise Compacted)."""
        event = asyncio.Event()
        me = (asyncio.get_running_loop(), event)
        with self._lock:
            self._waiters.add(me)
        last = from_revision
        try:
            while True:
                event.clear()  # (before the read: a commit during it sets it again)
                changes = await fetch(last)
                if not changes:
                    await event.wait()
                    continue
                for _, group in groupby(changes, key=lambda c: c.revision):
                    batch = list(group)
                    last = batch[0].revision
                    yield batch
        finally:
            with self._lock:
                self._waiters.discard(me)
