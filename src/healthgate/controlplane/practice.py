"""Practice runs carried out (SPEC §11): the director decides
(health/practice.py), this acts - it makes and ends the runs' shifts,
emits their records, fetches the URL checks and counts the front ends'
errors.

Once a second (and at once for ``POST .../practiceRuns/N:start``) the
runner asks the director what to do over the engine's view of the world:

* a **shift** to start is created like the shifts API creates one (the
  safety rule checked again inside the write), under the name the director
  gives - the same on every node for one window, so that two writers in a
  hand-over make one shift; a shift to end is deleted (a run that completed,
  or one cancelled: traffic returns at once);
* **records** (kind ``PracticeRun``) go to the log like the engine's, and
  so to webhooks and event streams;
* **FRONTEND_ERRORS** checks read a sliding window of the front end's hops,
  as healthgate's own listeners counted them (dataplane/counters.py: a
  failed try that was retried in another region counts), fed each second by
  the evidence sampler; **URL** checks are fetched every ``intervalSec``
  while their run is under way (a 2xx within ``timeoutSec`` passes;
  redirects are not followed; the answer's body is not read; the address
  policy of SPEC §7 applies, as to a webhook's URL).

In a cluster every node keeps the windows, but only the elected writer
acts (``permit``): it starts and ends the runs once, judging FRONTEND_ERRORS
by its own listeners' traffic. A new writer learns the windows already
tried from the log, and a run under way from its shift in the store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import httpx

from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.controlplane.health_service import HealthService
from healthgate.controlplane.resources import ControlPlane
from healthgate.controlplane.webhooks import DeliveryFailed, checked_target
from healthgate.health.evidence import Address, Hops
from healthgate.health.practice import (
    Action,
    EndShift,
    EngineWorld,
    FrontendErrors,
    PracticeDirector,
    StartShift,
)
from healthgate.health.states import PracticeRecord, RecordKind
from healthgate.model.addresses import AddressPolicy
from healthgate.model.practice import PracticeRun
from healthgate.model.validation import Document, Issue
from healthgate.store.base import LogQuery, Store

log = logging.getLogger("healthgate.practice")


@dataclass(slots=True)
class _UrlCheck:
    failures: int = 0
    last: str = ""
    due: float = 0.0
    task: asyncio.Task[None] | None = None


class PracticeRunner:
    def __init__(
        self,
        control: ControlPlane,
        health: HealthService,
        store: Store,
        policy: AddressPolicy,
        permit: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.control = control
        self.health = health
        self.store = store
        self.policy = policy
        self.permit = permit  # (cluster mode: this node is the elected writer)
        self.clock = clock
        self.director = PracticeDirector()
        self.frontends = FrontendErrors()
        self.world = EngineWorld(health.engine, self.frontends.errors, self._url)
        self._urls: dict[tuple[str, int], _UrlCheck] = {}
        self._client = httpx.AsyncClient(follow_redirects=False, trust_env=False)
        self._lock = asyncio.Lock()  # one tick (or start) acts at a time
        self._learned = False
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ inputs

    def runs(self) -> list[PracticeRun]:
        return [r for r in self.control.resources.values() if isinstance(r, PracticeRun)]

    def observe(self, now: float, hops: Mapping[str, Mapping[Address, Hops]]) -> None:
        """A second of every listener's hops (controlplane/evidence.py)."""
        self.frontends.observe(now, hops)

    def learn(self, records: Iterable[Mapping[str, object]]) -> None:
        """The log's PracticeRun records (oldest first): the windows already tried."""
        for d in records:
            record = PracticeRecord.from_dict(dict(d))
            if record is not None:
                self.director.seen(record)

    def seen(self, records: list[object]) -> None:
        """Records as the log hands them on (cluster mode: the writer's, on
        every node), so that a node elected later knows what was done."""
        for r in records:
            if isinstance(r, PracticeRecord):
                self.director.seen(r)

    async def _learn_from_log(self) -> None:
        if self._learned:
            return
        after = 0
        try:
            while True:  # (bounded: the log keeps --log-retention records)
                query = LogQuery(kind=RecordKind.PRACTICE.value, after_id=after, limit=1000)
                page = await asyncio.to_thread(self.store.query_log, query)
                self.learn(e.record for e in page)
                if len(page) < 1000:
                    break
                after = page[-1].id
        except Exception:
            log.exception("could not read the practice runs' records back; trying again")
            return
        self._learned = True

    # ------------------------------------------------------------------ the loop

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="practice runs")

    async def run(self, period: float = 1.0) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("practice runs: a tick failed; trying again in %g s", period)
            await asyncio.sleep(period)

    async def tick(self) -> list[PracticeRecord]:
        runs = self.runs()
        self.frontends.watched = {str(t) for r in runs for t in r.refs("frontend_refs")}
        if not self.permit():
            self._stop_urls(set())
            self._learned = False  # (leading again later: what was done meanwhile is in the log)
            return []
        await self._learn_from_log()
        async with self._lock:
            now = self.clock()
            self._poll_urls(now, runs)
            return await self._act(self.director.tick(now, runs, self.world))

    async def start_now(self, run: PracticeRun) -> PracticeRecord:
        """``POST .../practiceRuns/N:start``: STARTED or SKIPPED (the record)."""
        if not self.permit():
            raise ControlError(
                Refusal.UNAVAILABLE,
                "practice runs are started by the cluster's elected writer, and there is none now",
            )
        await self._learn_from_log()
        async with self._lock:
            if self.world.practice_shift(run) is not None:
                raise ControlError(Refusal.CONFLICT, f"practice run {run.name} is under way")
            records = await self._act(self.director.start(self.clock(), run, self.world))
        return records[-1]

    async def _act(self, actions: list[Action]) -> list[PracticeRecord]:
        records: list[PracticeRecord] = []
        for action in actions:
            if isinstance(action, StartShift):
                if not await self._start_shift(action):
                    return records  # (its STARTED record is not made: nothing started)
            elif isinstance(action, EndShift):
                await self._end_shift(action)
            else:
                records.append(action)
        if records:
            for r in records:
                log.warning("practice run %s: %s: %s", r.path, r.phase.value, r.reason)
            self.health.emit(list(records))
        return records

    async def _start_shift(self, action: StartShift) -> bool:
        shift = action.shift

        def safe() -> None:
            stranded = self.world.stranded(shift)
            if stranded:
                raise ControlError(
                    Refusal.UNSAFE,
                    f"it would leave {', '.join(stranded)} with no backend able to take traffic",
                    [Issue("awayFrom", "would leave front ends with no eligible backend")],
                )

        try:
            await self.control.apply([Document(shift)], create_only=True, check=safe)
        except ControlError as exc:
            if exc.kind is Refusal.CONFLICT:
                return True  # (another writer made this very shift: it is under way)
            log.warning("practice run: shift %s not made: %s", shift.name, exc.message)
            return False
        for key in [k for k in self._urls if k[0] == action.run]:
            del self._urls[key]  # (a new run's URL checks start afresh)
        return True

    async def _end_shift(self, action: EndShift) -> None:
        try:
            await self.control.delete([action.shift.path])
        except ControlError as exc:
            if exc.kind is not Refusal.NOT_FOUND:
                log.warning("practice run: shift %s not ended yet: %s", action.shift.name,
                            exc.message)  # fmt: skip

    # ------------------------------------------------------------------ URL checks

    def _url(self, run: PracticeRun, index: int) -> tuple[int, str]:
        state = self._urls.get((str(run.path), index))
        return (state.failures, state.last) if state is not None else (0, "")

    def _poll_urls(self, now: float, runs: list[PracticeRun]) -> None:
        """Each URL check of a run under way, every ``intervalSec``."""
        wanted: set[tuple[str, int]] = set()
        for run in runs:
            shift = self.world.practice_shift(run)
            if shift is None or not shift.active(now):
                continue
            for i, check in enumerate(run.outcome_checks):
                if check.type != "URL" or check.url is None:
                    continue
                key = (str(run.path), i)
                wanted.add(key)
                state = self._urls.setdefault(key, _UrlCheck())
                busy = state.task is not None and not state.task.done()
                if now >= state.due and not busy:
                    state.due = now + check.interval
                    state.task = asyncio.get_running_loop().create_task(
                        self._fetch(state, check.url, float(check.timeout))
                    )
        self._stop_urls(wanted)

    def _stop_urls(self, wanted: set[tuple[str, int]]) -> None:
        for key in [k for k in self._urls if k not in wanted]:
            state = self._urls.pop(key)
            if state.task is not None:
                state.task.cancel()

    async def _fetch(self, state: _UrlCheck, url: str, timeout: float) -> None:
        try:
            async with asyncio.timeout(timeout):
                target, host, sni = await checked_target(url, self.policy)
                request = self._client.build_request(
                    "GET", target, headers={"Host": host} if host else {}
                )
                if sni:
                    request.extensions["sni_hostname"] = sni
                response = await self._client.send(request, stream=True)
                await response.aclose()  # (the status is what counts)
            ok = 200 <= response.status_code < 300
            why = f"HTTP {response.status_code}"
        except TimeoutError:
            ok, why = False, f"no answer within {timeout:g} s"
        except DeliveryFailed as exc:
            ok, why = False, str(exc)
        except httpx.HTTPError as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"[:200]
        if ok:
            state.failures, state.last = 0, why
        else:
            state.failures, state.last = state.failures + 1, why

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._stop_urls(set())
        await self._client.aclose()


def practice_status(runner: PracticeRunner | None, run: PracticeRun) -> dict[str, object] | None:
    """The status block of a practice run's GET."""
    if runner is None:
        return None
    return runner.director.status(run, runner.clock())
