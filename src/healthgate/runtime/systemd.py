"""systemd's service notifications (``sd_notify(3)``), for ``Type=notify``
units (deploy/systemd/).

When systemd starts ``serve`` with ``NOTIFY_SOCKET`` set, serve tells it

* ``READY=1`` once it is ready: the API answers, the listeners are open and
  the states are restored (``Server.start`` has returned) - not before, so
  that units ordered after it, and ``systemctl start``, wait for a server
  that really serves;
* ``WATCHDOG=1`` every half of ``WATCHDOG_USEC`` (``WatchdogSec=``), sent
  by a task of the event loop: a loop that is blocked sends nothing, and
  systemd restarts the process - which is the point (a ping from a thread
  would keep a frozen server alive);
* ``RELOADING=1`` ... ``READY=1`` around a SIGHUP (the tokens file read
  again), and ``STOPPING=1`` when it begins to stop;
* ``STATUS=...`` lines that ``systemctl status`` shows.

The protocol is one datagram per message on a UNIX socket (an abstract one
when the path starts with ``@``); it is a dozen lines, so it is written
here rather than taken from a library (the Python ones are either bindings
to libsystemd or synchronous and unmaintained). Sends never block: the
socket is non-blocking, and a failed send is logged once and otherwise
ignored - serve never stops because systemd did not listen.

For the tests only: with ``HEALTHGATE_DEBUG_BLOCK_ON_USR2=SECONDS`` in the
environment, SIGUSR2 blocks the event loop for that long (what a frozen loop
looks like to the watchdog). Without that variable SIGUSR2 does nothing of
the sort.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Mapping

log = logging.getLogger("healthgate.systemd")

DEBUG_BLOCK = "HEALTHGATE_DEBUG_BLOCK_ON_USR2"


class Notifier:
    """``sd_notify`` to ``address`` (None: not started by systemd, every call a no-op)."""

    def __init__(self, address: str | None, watchdog_usec: int = 0) -> None:
        self.address = address
        self.watchdog = watchdog_usec / 1e6 if watchdog_usec > 0 else 0.0
        self._sock: socket.socket | None = None
        self._failed = False
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Notifier:
        path = env.get("NOTIFY_SOCKET") or None
        usec = 0
        pid = env.get("WATCHDOG_PID")
        if pid is None or pid == str(os.getpid()):
            try:
                usec = int(env.get("WATCHDOG_USEC", "0"))
            except ValueError:
                log.warning("WATCHDOG_USEC=%r is not a number: no watchdog", env["WATCHDOG_USEC"])
        return cls(path, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> None:
        if self.address is None:
            return
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto("\n".join(fields).encode(), target)
        except OSError as exc:
            if not self._failed:
                log.warning("cannot notify systemd at %s: %s", self.address, exc)
                self._failed = True

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")
        if self.watchdog and self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._ping(), name="systemd-watchdog"
            )

    def reloading(self) -> None:
        monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec}")

    def reloaded(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def stopping(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.send("STOPPING=1", "STATUS=stopping")

    async def _ping(self) -> None:
        """WATCHDOG=1 from the event loop, every half of the watchdog's interval."""
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog / 2)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def install_debug_block(env: Mapping[str, str] = os.environ) -> None:
    """The tests' frozen loop (see the module doc); nothing without the variable."""
    text = env.get(DEBUG_BLOCK)
    if not text:
        return
    seconds = float(text)
    loop = asyncio.get_running_loop()
    log.warning("debug: SIGUSR2 blocks the event loop for %.1f s (%s is set)", seconds, DEBUG_BLOCK)

    def block() -> None:
        log.warning("debug: blocking the event loop for %.1f s", seconds)
        time.sleep(seconds)  # on purpose: this is what the watchdog is for

    loop.add_signal_handler(signal.SIGUSR2, block)
