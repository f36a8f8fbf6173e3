"""Bulk work without the cyclic garbage collector.

Validating a large manifest and loading it into the engine create millions
of objects that all live on. CPython's cyclic collector runs after every
700 net allocations and, more and more often as the heap grows, walks the
older generations - objects that are all still alive: half of the time of
a 1,000,000-endpoint world's validation and load (12.4 s with it, 6.3 s
without; bench/engine.py). :func:`gc_paused` pauses it for the duration of
such work; nested and concurrent uses (threads) keep it paused until the
last one ends. Nothing is collected at the end: what was created lives on,
and reference counting frees the rest as always.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _Pause:
    """How many holders pause the collector, and whether it ran before."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.was_enabled = False


_pause = _Pause()


@contextmanager
def gc_paused() -> Iterator[None]:
    with _pause.lock:
        if _pause.depth == 0:
            _pause.was_enabled = gc.isenabled()
            gc.disable()
        _pause.depth += 1
    try:
        yield
    finally:
        with _pause.lock:
            _pause.depth -= 1
            if _pause.depth == 0 and _pause.was_enabled:
                gc.enable()
