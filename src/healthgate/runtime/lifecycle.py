"""How ``serve`` and ``demo`` start and stop: signals that always count, and
a stop that always ends.

* **Signals first.** The SIGINT / SIGTERM handlers are installed before
  anything else starts, so a signal that arrives during start-up is not
  lost (nor, with the default action, a half-started process killed
  without cleaning up): it interrupts the start, and what was started is
  stopped. Every signal received is logged with what the process was doing.
* **A second signal exits at once** (status 128 + the signal's number),
  after killing the child processes this one started (``on_hard_exit``).
* **A stop is a list of named steps**, each with a deadline: each step is
  logged, a step that overruns is logged with its name and abandoned, and
  the next one runs. The whole stop has a deadline too, kept by a thread
  (``faulthandler``), not the event loop: if it passes - a step that blocks
  the loop itself - every thread's stack is written to stderr and the
  process exits.

Why the handlers are plain ``signal.signal`` handlers and not
``loop.add_signal_handler``: a plain handler runs whenever the interpreter
next runs Python code in the main thread (uvloop wakes it through the
signal wake-up descriptor), and :meth:`Stopper.wait` wakes the loop every
second, so a signal whose wake-up byte was lost still counts within a
second.

The one stop that once never ended (``healthgate demo`` ignoring Ctrl-C)
was Python 3.11's ``asyncio.wait_for``: when the awaited operation
completes in the same loop iteration as the cancellation, it returns the
result and the cancellation is lost (CPython gh-86296), so the demo's load
generator went on sending requests for ever and its stop waited on it.
``asyncio.timeout`` has no such hole; ruff bans ``wait_for`` here (TID251).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

log = logging.getLogger("healthgate.lifecycle")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True, slots=True)
class StopStep:
    """One step of a stop: its name (logged), the work, and its deadline."""

    name: str
    run: Callable[[], Awaitable[object]]
    timeout: float = 5.0


class Stopper:
    """The process's stop signals (see the module doc)."""

    def __init__(self, name: str = "healthgate", stop_timeout: float = 60.0) -> None:
        self.name = name
        self.stop_timeout = stop_timeout  # the whole stop, after which the process exits
        self.phase = "starting"  # what the process is doing: logged with a signal
        self.received: int | None = None  # the first stop signal
        self.on_hard_exit: list[Callable[[], None]] = []  # quick, synchronous: kill children
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_request: list[Callable[[], object]] = []
        self._previous: dict[int, object] = {}

    # ------------------------------------------------------------------ signals

    def install(self) -> None:
        """Catch SIGINT and SIGTERM from now on (on the event loop's thread)."""
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        for sig in STOP_SIGNALS:
            with contextlib.suppress(ValueError, OSError):  # (not the main thread: tests)
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            log.warning("%s: second signal (%s) while %s: exiting now", self.name, name, self.phase)
            self.hard_exit(128 + signum)
            return
        self.received = signum
        more = "" if self.phase == "running" else f" while {self.phase}"
        log.warning(
            "%s: received %s%s: stopping (send it again to exit at once)", self.name, name, more
        )
        self.request()

    def request(self) -> None:
        """Stop (a signal, or the program itself: the demo's end)."""
        if self._loop is None or self._event is None:
            return
        self._loop.call_soon_threadsafe(self._event.set)
        for callback in self._on_request:
            self._loop.call_soon_threadsafe(callback)

    def on_request(self, callback: Callable[[], object]) -> None:
        self._on_request.append(callback)

    @property
    def requested(self) -> bool:
        return self._event is not None and self._event.is_set()

    async def wait(self) -> None:
        """Until a stop is requested (woken every second: see the module doc)."""
        assert self._event is not None, "install() first"
        while not self._event.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._event.wait()

    def hard_exit(self, code: int) -> None:
        for kill in self.on_hard_exit:
            with contextlib.suppress(Exception):
                kill()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)

    # ------------------------------------------------------------------ running

    async def run(
        self,
        start: Callable[[], Coroutine[Any, Any, None]],
        stop: Callable[[], Awaitable[None]],
        main: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        """Start, then run ``main`` (default: wait for a stop signal), then
        stop - whatever happened, and a signal during ``start`` included."""
        self.install()
        starting = asyncio.create_task(start(), name=f"{self.name}-start")
        self.on_request(starting.cancel)
        try:
            try:
                await starting
            except asyncio.CancelledError:
                if not self.requested:
                    raise
                return  # stopped during start-up: what was started is stopped below
            self.phase = "running"
            runner = asyncio.create_task((main or self.wait)(), name=f"{self.name}-main")
            self.on_request(runner.cancel)
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        finally:
            self.phase = "stopping"
            faulthandler.dump_traceback_later(self.stop_timeout, exit=True)
            try:
                await stop()
            finally:
                faulthandler.cancel_dump_traceback_later()
                self.uninstall()


async def run_steps(steps: Sequence[StopStep], logger: logging.Logger = log) -> None:
    """Run the steps of a stop in order, each bounded (see the module doc)."""
    if not steps:
        return  # nothing had started
    started = time.monotonic()
    for step in steps:
        logger.info("stopping: %s", step.name)
        try:
            async with asyncio.timeout(step.timeout):
                await step.run()
        except TimeoutError:
            logger.warning(
                "stopping: %s did not finish within %g s; going on", step.name, step.timeout
            )
        except Exception:
            logger.exception("stopping: %s failed; going on", step.name)
    logger.info("stopped in %.2f s", time.monotonic() - started)
