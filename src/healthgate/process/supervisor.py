"""Worker processes, supervised: one supervisor for every pool (the data
plane's listeners, the probe workers).

Each worker is ``python -m healthgate.process.run <module> <index> <log
level>`` (process/run.py runs the module's ``worker_main``); its stdin carries
the owner's frames to it, its stdout the worker's frames back
(process/frames.py), its stderr is the serving process's (its log lines).
The supervisor:

* **starts** the workers, and sends each what it needs first
  (``greeting``: the settings, the world, the current states) before any
  other frame;
* **restarts** a worker that exits while the pool is open, after a backoff
  that doubles (1 s, 2 s, ... up to 30 s) while workers keep dying young
  and starts again from 1 s once one has lived a minute; the owner hears
  of each exit (``on_exit``: a probe pool adds the dead worker's totals to
  its own) and each start (``on_start``);
* **watches what it writes**: frames to a worker wait in the pipe's
  buffer, never blocking the event loop; a worker whose unread backlog
  passes ``max_backlog`` bytes has stopped reading (it hangs, or is
  stopped with SIGSTOP): it is killed and started again, with everything
  it needs - rather than the serving process holding ever more memory for
  it or waiting on it;
* **stops in order** (:meth:`close`): no restart from then on; each
  worker's stdin is closed (its signal to stop: it closes what it serves
  and exits), each gets ``grace`` seconds and is then killed; its readers
  end with it. Workers never outlive the serving process: a worker whose
  stdin ends exits, and SIGINT from a terminal (which reaches the whole
  process group) is ignored by workers - their owner decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from healthgate.process.frames import FrameTooLarge, encode, read_frame

log = logging.getLogger("healthgate.process")

FIRST_BACKOFF = 1.0
MAX_BACKOFF = 30.0
HEALTHY_LIFE = 60.0  # a worker that lived this long resets the backoff


@dataclass(slots=True)
class WorkerProcess:
    """One worker slot: the process now in it (None while restarting)."""

    index: int
    proc: asyncio.subprocess.Process | None = None
    started: float = 0.0
    backoff: float = FIRST_BACKOFF
    restarts: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


class Supervisor:
    def __init__(
        self,
        name: str,
        module: str,
        count: int,
        on_message: Callable[[int, object], None],
        greeting: Callable[[int], Iterable[object]] = lambda _i: (),
        on_exit: Callable[[int], None] | None = None,
        on_start: Callable[[int], None] | None = None,
        max_backlog: int = 256 << 20,
        read_limit: int = 64 << 20,
        prefix: str = "",
    ) -> None:
        self.name = name  # in log lines: "probe worker w1", "data-plane worker 0"
        self.prefix = prefix
        self.module = module
        self.on_message = on_message
        self.greeting = greeting
        self.on_exit = on_exit
        self.on_start = on_start
        self.max_backlog = max_backlog
        self.read_limit = read_limit
        self.workers = [WorkerProcess(i) for i in range(count)]
        self.closing = False

    def label(self, index: int) -> str:
        return f"{self.name} {self.prefix}{index}"

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        for worker in self.workers:
            await self._spawn(worker)

    async def grow(self, count: int) -> None:
        """More workers (never fewer: a shrinking pool would move endpoints for nothing)."""
        while len(self.workers) < count and not self.closing:
            worker = WorkerProcess(len(self.workers))
            self.workers.append(worker)
            await self._spawn(worker)

    async def _spawn(self, worker: WorkerProcess) -> None:
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            # -P: the working directory is not on the path - serve's may be
            # anyone's, and a healthgate/ or uvloop.py planted there would be
            # imported by every worker
            "-P",
            "-m",
            "healthgate.process.run",
            self.module,
            str(worker.index),
            level,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        worker.proc, worker.started = proc, time.monotonic()
        for message in self.greeting(worker.index):
            self._write(worker, encode(message))
        worker.tasks = [t for t in worker.tasks if not t.done()]
        worker.tasks.append(asyncio.create_task(self._watch(worker, proc)))
        log.info("%s started (pid %d)", self.label(worker.index), proc.pid)
        if self.on_start is not None:
            self.on_start(worker.index)

    async def _watch(self, worker: WorkerProcess, proc: asyncio.subprocess.Process) -> None:
        """Read the worker's frames until it ends; then start it again."""
        assert proc.stdout is not None
        try:
            while (message := await read_frame(proc.stdout, self.read_limit)) is not None:
                try:
                    self.on_message(worker.index, message)
                except Exception:
                    log.exception("%s: a message could not be handled", self.label(worker.index))
        except (FrameTooLarge, ValueError, EOFError) as exc:
            log.error(
                "%s sent an unreadable frame (%s): replacing it", self.label(worker.index), exc
            )
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        code = await proc.wait()
        if worker.proc is proc:
            worker.proc = None
        if self.on_exit is not None:
            self.on_exit(worker.index)
        if self.closing:
            return
        lived = time.monotonic() - worker.started
        if lived >= HEALTHY_LIFE:
            worker.backoff = FIRST_BACKOFF
        delay = worker.backoff
        worker.backoff = min(worker.backoff * 2, MAX_BACKOFF)
        log.warning(
            "%s exited (%s) after %.1f s; starting it again in %g s",
            self.label(worker.index),
            code,
            lived,
            delay,
        )
        await asyncio.sleep(delay)
        if not self.closing:
            worker.restarts += 1
            await self._spawn(worker)

    async def close(self, grace: float = 5.0) -> None:
        """Stop every worker (see the module doc)."""
        self.closing = True
        procs = [w.proc for w in self.workers if w.proc is not None]
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()  # the worker stops its work and exits

        async def stopped(proc: asyncio.subprocess.Process) -> None:
            try:
                async with asyncio.timeout(grace):
                    await proc.wait()
            except TimeoutError:
                log.warning("a worker (pid %d) did not stop in %g s: killed", proc.pid, grace)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

        await asyncio.gather(*(stopped(p) for p in procs))
        tasks = [t for w in self.workers for t in w.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ frames out

    def send(self, index: int, message: object) -> None:
        worker = self.workers[index]
        self._write(worker, encode(message))

    def broadcast(self, message: object) -> None:
        """One message to every worker (encoded once)."""
        frame = encode(message)
        for worker in self.workers:
            self._write(worker, frame)

    def _write(self, worker: WorkerProcess, frame: bytes) -> None:
        proc = worker.proc
        stdin = proc.stdin if proc is not None else None
        if proc is None or stdin is None or stdin.is_closing():
            return  # (a worker being restarted gets everything in its greeting)
        backlog = stdin.transport.get_write_buffer_size()
        if backlog + len(frame) > self.max_backlog:
            log.error(
                "%s stopped reading (%d MiB unread): killing it, it is started again",
                self.label(worker.index),
                backlog >> 20,
            )
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            stdin.transport.abort()
            return
        stdin.write(frame)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None]

    def backlog(self, index: int) -> int:
        proc = self.workers[index].proc
        if proc is None or proc.stdin is None:
            return 0
        return int(proc.stdin.transport.get_write_buffer_size())
