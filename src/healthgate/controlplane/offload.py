"""CPU work off the event loop: manifests parsed, worlds validated, plans made.

A large manifest takes seconds of pure-Python work. It runs in a thread so
that the event loop (probes, listeners, the API) keeps running; the
serving process lowers the interpreter's switch interval so the loop gets
the GIL back within a millisecond (runtime/server.py). While such work runs
the cyclic garbage collector is paused: parsing builds millions of objects,
and a full collection over them - which may start in whichever thread
allocates, the loop's included - held the loop for 100+ ms. The work's
garbage is acyclic and freed by reference counting; collections resume
when the last such job ends.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class _CollectorPause:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._was_enabled:
                gc.enable()


collector_paused = _CollectorPause()
"""``with collector_paused:`` around a whole request that builds a large
world (parse, plan, answer): drop the request's big objects before the
block ends, so that no collection ever walks them."""


def _run_paused(call: Callable[[], T]) -> T:
    with collector_paused:
        return call()


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args)`` in a worker thread, the collector paused meanwhile."""
    return await asyncio.to_thread(_run_paused, functools.partial(fn, *args, **kwargs))


def release(objects: list[object]) -> None:
    """Drop the last references to ``objects`` - lists item by item - in the
    calling thread. Freeing a parsed manifest is a chain of deallocations
    that holds the GIL throughout (~80 ms for 5 MB); item by item, the
    interpreter can hand the GIL to the event loop between items. Call it
    with ``off_loop`` after deleting your own references."""
    while objects:
        item = objects.pop()
        if isinstance(item, list):
            while item:
                item.pop()
        del item
