"""Practice runs (SPEC §11): when one is due, whether it may start, when it
is cancelled - pure: fed ``now`` and what the world looks like, it answers
with what to do (decide, then act: the caller acts).

A run is a shift (health/shifts.py) made by the actor ``practice-run/NAME``
for ``durationSec``. :class:`PracticeDirector` keeps, per run, the window
it last tried and the run under way, and on each :meth:`~PracticeDirector.tick`:

* a run under way: each outcome check is judged (:func:`breach`) and the
  first that breaches cancels it (its shift ends, traffic returns, the
  record has the figures); a shift that ran out completes it; a shift that
  went away early (ended by hand) cancels it;
* a run that is due (its schedule's window contains ``now`` and it has not
  tried this window yet) is started, or skipped with the reason
  (:func:`refusal`): a blocked window overlapping the run, a front end it
  touches with an UNHEALTHY or shifted NEG (an incident), or the safety
  rule (a front end left with nothing).

Records: kind ``PracticeRun``, STARTED / COMPLETED / CANCELLED / SKIPPED.
Times are epoch seconds, the weekly schedule's in UTC.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from healthgate.health.engine import HealthEngine
from healthgate.health.evidence import Address, Hops, kinds_text
from healthgate.health.shifts import affected
from healthgate.health.states import HealthState, PracticePhase, PracticeRecord, timestamp
from healthgate.model.practice import (
    ACTOR_PREFIX,
    WEEKDAYS,
    BlockedWindow,
    OutcomeCheck,
    PracticeRun,
    Schedule,
)
from healthgate.model.practice import minutes_of as _minutes_of
from healthgate.model.resources import Shift

DAY = 86_400.0
KEEP = 600  # s of front-end counts kept: the longest windowSec
EPOCH_WEEKDAY = 3  # 1970-01-01 was a Thursday (WEEKDAYS[3])


# ------------------------------------------------------------------ the calendar


def _weekday(day: int) -> str:
    return WEEKDAYS[(day + EPOCH_WEEKDAY) % 7]


def _on(weekdays: Sequence[str], day: int) -> bool:
    return not weekdays or _weekday(day) in weekdays


def window_at(schedule: Schedule, now: float) -> tuple[float, float] | None:
    """The schedule's window (start, end) that contains ``now``, if any (a
    window may run past midnight: yesterday's is looked at too)."""
    start_of_day = _minutes_of(schedule.start_utc) * 60
    today = math.floor(now / DAY)
    for day in (today, today - 1):
        start = day * DAY + start_of_day
        end = start + schedule.window_min * 60
        if _on(schedule.weekdays, day) and start <= now < end:
            return start, end
    return None


def next_start(schedule: Schedule, now: float) -> float | None:
    """When the schedule's next window opens, after ``now``."""
    start_of_day = _minutes_of(schedule.start_utc) * 60
    today = math.floor(now / DAY)
    for day in range(today, today + 8):
        start = day * DAY + start_of_day
        if start > now and _on(schedule.weekdays, day):
            return start
    return None


def _weekly_overlap(window: BlockedWindow, start: float, end: float) -> bool:
    assert window.start_utc is not None and window.duration_min is not None
    offset = _minutes_of(window.start_utc) * 60
    length = window.duration_min * 60
    first = math.floor(start / DAY) - math.ceil(length / DAY) - 1
    for day in range(first, math.floor(end / DAY) + 1):
        if not _on(window.weekdays, day):
            continue
        w_start = day * DAY + offset
        if w_start < end and start < w_start + length:
            return True
    return False


def blocked(run: PracticeRun, start: float, end: float) -> str | None:
    """Why a run from ``start`` to ``end`` may not happen: the first blocked
    window it would overlap (None: none)."""
    for window in run.blocked_windows:
        once = window.once
        if once is not None:
            if once[0] < end and start < once[1]:
                return (
                    f"it would overlap the blocked window {timestamp(once[0])} to "
                    f"{timestamp(once[1])}"
                )
        elif _weekly_overlap(window, start, end):
            days = ",".join(window.weekdays) or "every day"
            return (
                f"it would overlap the weekly blocked window ({days} {window.start_utc} UTC "
                f"for {window.duration_min} min)"
            )
    return None


# ------------------------------------------------------------------ what the director reads


@dataclass(frozen=True, slots=True)
class NegView:
    """One NEG of a front end, as the incident check reads it."""

    path: str
    state: HealthState
    shifted: str = ""  # the reason of a shift that keeps it out ("": none)


class World(Protocol):
    """What the director reads of the world (the engine's view, the data
    plane's counts, the URL checks' results): the caller's to provide."""

    def practice_shift(self, run: PracticeRun) -> Shift | None:
        """The run's shift in the store (active or run out), if any."""

    def practice_shifts(self) -> Sequence[Shift]:
        """Every practice run's shift in the store (active or run out)."""

    def touched(self, run: PracticeRun, shift: Shift) -> Mapping[str, Sequence[NegView]]:
        """The consumer front ends ``shift`` would move, each with its NEGs."""

    def stranded(self, shift: Shift) -> list[str]:
        """The front ends that have a NEG able to take traffic now and would
        have none with ``shift`` in effect (the safety rule, SPEC §6)."""

    def errors(self, frontend: str, window: int, now: float) -> tuple[int, int, str]:
        """A front end's hops in the last ``window`` s: (all, failed, a
        summary of the failures' kinds)."""

    def state(self, path: str) -> tuple[HealthState, str] | None:
        """A composite's or PSC NEG's state and reason (None: not known)."""

    def url(self, run: PracticeRun, index: int) -> tuple[int, str]:
        """The URL check's consecutive failures so far in this run, and the last one."""


# ------------------------------------------------------------------ judging


def refusal(run: PracticeRun, shift: Shift, world: World, now: float) -> str | None:
    """Why the run may not start now (None: it may)."""
    why = blocked(run, now, now + run.duration_sec)
    if why is not None:
        return why
    touched = world.touched(run, shift)
    if not touched:
        return f"{run.away_from}: no consumer front end reaches it (nothing to practise)"
    for frontend, negs in sorted(touched.items()):
        for neg in negs:
            if neg.state is HealthState.UNHEALTHY:
                return f"an incident: {frontend}'s NEG {neg.path} is UNHEALTHY"
            if neg.shifted:
                return f"an incident: {frontend}'s NEG {neg.path} is {neg.shifted}"
    stranded = world.stranded(shift)
    if stranded:
        return f"it would leave {', '.join(stranded)} with no backend able to take traffic"
    return None


def breach(
    check: OutcomeCheck, index: int, run: PracticeRun, world: World, now: float
) -> str | None:
    """The check's breach with its figures, or None while it holds."""
    label = check.label(index)
    if check.type == "FRONTEND_ERRORS":
        assert check.frontend is not None and check.max_error_percent is not None
        frontend = str(run.refs("frontend_refs")[_nth(run, "frontend", index)])
        total, failed, kinds = world.errors(frontend, check.window, now)
        if total < check.minimum or 100 * failed <= check.max_error_percent * total:
            return None
        return (
            f"{label}: {failed} of {total} requests through {frontend} failed "
            f"({100 * failed / total:.1f} %) in {check.window} s"
            + (f": {kinds}" if kinds else "")
            + f" > maxErrorPercent {check.max_error_percent:g}"
        )
    if check.type == "COMPOSITE_UNHEALTHY":
        attr = "composite_refs" if check.composite is not None else "neg_refs"
        wire = "composite" if check.composite is not None else "neg"
        path = str(run.refs(attr)[_nth(run, wire, index)])
        seen = world.state(path)
        if seen is None or seen[0] is not HealthState.UNHEALTHY:
            return None
        return f"{label}: {path} is UNHEALTHY: {seen[1]}"
    failures, last = world.url(run, index)
    if failures < check.failures:
        return None
    times = "once" if failures == 1 else f"{failures} times in a row"
    return f"{label}: {check.url} failed {times} ({last})"


def _nth(run: PracticeRun, wire: str, index: int) -> int:
    """Which of the run's references of one kind the check at ``index`` holds."""
    return sum(1 for c in run.outcome_checks[:index] if getattr(c, wire) is not None)


# ------------------------------------------------------------------ the director


@dataclass(frozen=True, slots=True)
class StartShift:
    shift: Shift
    run: str  # the run's path


@dataclass(frozen=True, slots=True)
class EndShift:
    shift: Shift
    run: str


Action = StartShift | EndShift | PracticeRecord


@dataclass(slots=True)
class _Run:
    tried: float | None = None  # the start of the window last tried (or a manual start's time)
    shift: Shift | None = None  # the run under way (its shift), as last seen
    last: PracticeRecord | None = None  # the last record, for status
    finished: str = ""  # the shift of the run last completed or cancelled (its end recorded)


@dataclass(slots=True)
class PracticeDirector:
    """Decides practice runs; the caller acts (creates and ends the shifts,
    emits the records). One per serving process; in a cluster only the
    elected writer's acts."""

    runs: dict[str, _Run] = field(default_factory=dict)

    def _state(self, run: PracticeRun) -> _Run:
        return self.runs.setdefault(str(run.path), _Run())

    def seen(self, record: PracticeRecord) -> None:
        """A record of the log (a restart's catch-up): windows tried stay tried."""
        state = self.runs.setdefault(record.path, _Run())
        if record.phase in (PracticePhase.STARTED, PracticePhase.SKIPPED):
            state.tried = max(state.tried or 0.0, record.window or record.time)
        state.last = record

    def tick(self, now: float, runs: Sequence[PracticeRun], world: World) -> list[Action]:
        actions: list[Action] = []
        live = {str(r.path) for r in runs}
        for gone in [p for p in self.runs if p not in live]:
            del self.runs[gone]
        for run in runs:
            state = self._state(run)
            shift = world.practice_shift(run)
            if shift is not None:
                actions += self._under_way(now, run, state, shift, world)
            elif state.shift is not None:
                # its shift went away before it ran out: ended by hand
                actions.append(self._record(run, state, PracticePhase.CANCELLED, now,
                                            "its shift was ended by hand", state.shift))  # fmt: skip
                state.shift = None
            elif run.enabled and run.schedule is not None:
                window = window_at(run.schedule, now)
                if window is not None and (state.tried is None or state.tried < window[0]):
                    actions += self.start(now, run, world, window[0])
        return actions + self._orphans(now, runs, world)

    def _orphans(self, now: float, runs: Sequence[PracticeRun], world: World) -> list[Action]:
        """The shifts of practice runs deleted while under way: ended (the
        run is CANCELLED), so that traffic does not wait for their end."""
        actors = {(r.project, r.actor) for r in runs}
        out: list[Action] = []
        for shift in world.practice_shifts():
            if (shift.project, shift.actor) in actors or not shift.active(now):
                continue
            name = shift.actor.removeprefix(ACTOR_PREFIX)
            path = f"projects/{shift.project}/global/practiceRuns/{name}"
            out.append(EndShift(shift, path))
            out.append(
                PracticeRecord(
                    now, shift.project, name, path, PracticePhase.CANCELLED,
                    "its practice run was deleted; traffic returns", shift.away_from,
                    str(shift.path), shift.expire_time,
                )
            )  # fmt: skip
        return out

    def start(
        self, now: float, run: PracticeRun, world: World, window: float | None = None
    ) -> list[Action]:
        """Start ``run`` now (its schedule's window, or by hand): the shift
        and STARTED, or SKIPPED with the reason."""
        state = self._state(run)
        state.tried = window if window is not None else now
        if world.practice_shift(run) is not None:
            return []  # (under way already)
        shift = Shift(
            kind="Shift",
            name=shift_name(run, window if window is not None else now),
            project=run.project,
            away_from=run.away_from,
            expire_time=now + run.duration_sec,
            created=now,
            actor=run.actor,
            comment=f"{run.comment} (practice run {run.name})",
            # a region: the project's own PSC NEGs there (a producer moving its
            # consumers names its service attachment's path)
            covers="PSC_NEGS",
        )
        why = refusal(run, shift, world, now)
        if why is not None:
            record = self._record(run, state, PracticePhase.SKIPPED, now, f"not started: {why}",
                                  None, window)  # fmt: skip
            return [record]
        state.shift = shift
        until = timestamp(shift.expire_time)
        reason = f"shifted away from {run.away_from} until {until} ({run.duration_sec} s)"
        return [StartShift(shift, str(run.path)), self._record(run, state, PracticePhase.STARTED, now, reason,
                                                shift, window)]  # fmt: skip

    def _under_way(
        self, now: float, run: PracticeRun, state: _Run, shift: Shift, world: World
    ) -> list[Action]:
        if state.finished == str(shift.path):
            return [
                EndShift(shift, str(run.path))
            ]  # (recorded; its end did not go through yet: again)
        state.shift = shift
        if not shift.active(now):
            state.shift = None
            done = self._record(run, state, PracticePhase.COMPLETED, shift.expire_time,
                                f"every outcome check held for {run.duration_sec} s; traffic "
                                "returns", shift)  # fmt: skip
            return [EndShift(shift, str(run.path)), done]
        for i, check in enumerate(run.outcome_checks):
            why = breach(check, i, run, world, now)
            if why is not None:
                state.shift = None
                record = self._record(run, state, PracticePhase.CANCELLED, now,
                                      f"{why}; traffic returns", shift, check=check.label(i))  # fmt: skip
                return [EndShift(shift, str(run.path)), record]
        return []

    def _record(
        self,
        run: PracticeRun,
        state: _Run,
        phase: PracticePhase,
        now: float,
        reason: str,
        shift: Shift | None,
        window: float | None = None,
        check: str = "",
    ) -> PracticeRecord:
        record = PracticeRecord(
            time=now,
            project=run.project,
            name=run.name,
            path=str(run.path),
            phase=phase,
            reason=reason,
            away_from=run.away_from,
            shift=str(shift.path) if shift is not None else "",
            until=shift.expire_time if shift is not None else None,
            window=window,
            check=check,
        )
        state.last = record
        if phase in (PracticePhase.COMPLETED, PracticePhase.CANCELLED) and shift is not None:
            state.finished = str(shift.path)
        return record

    def status(self, run: PracticeRun, now: float) -> dict[str, object]:
        """For GET and the dashboard: under way, the next start, the last record."""
        state = self.runs.get(str(run.path)) or _Run()
        out: dict[str, object] = {}
        if state.shift is not None and state.shift.active(now):
            out["underWay"] = {
                "shift": str(state.shift.path),
                "started": timestamp(state.shift.created),
                "until": timestamp(state.shift.expire_time),
            }
        if run.enabled and run.schedule is not None:
            window = window_at(run.schedule, now)
            pending = window is not None and (state.tried is None or state.tried < window[0])
            upcoming = window[0] if pending and window else next_start(run.schedule, now)
            if upcoming is not None:
                out["next"] = timestamp(upcoming)
        if state.last is not None:
            out["last"] = state.last.to_dict()
        return out


def shift_name(run: PracticeRun, at: float) -> str:
    """``practice-`` and a digest of the run and its start (a window's, or a
    manual start's): one name for one attempt, whichever node makes it."""
    digest = hashlib.sha256(f"{run.path}|{at:.3f}".encode()).hexdigest()[:16]
    return f"practice-{digest}"


# ------------------------------------------------------------------ front ends' errors


class FrontendErrors:
    """Per front end, its hops a second over the last ten minutes - for the
    front ends some FRONTEND_ERRORS check watches (``watched``)."""

    def __init__(self) -> None:
        self.watched: set[str] = set()
        self._seconds: deque[tuple[float, dict[str, tuple[int, int, dict[str, int]]]]] = deque()

    def observe(self, now: float, hops: Mapping[str, Mapping[Address, Hops]]) -> None:
        second: dict[str, tuple[int, int, dict[str, int]]] = {}
        for frontend in self.watched:
            total = failed = 0
            kinds: dict[str, int] = {}
            for h in (hops.get(frontend) or {}).values():
                total += h.total
                failed += h.errors
                for k, n in h.kinds.items():
                    kinds[k] = kinds.get(k, 0) + n
            second[frontend] = (total, failed, kinds)
        self._seconds.append((now, second))
        while self._seconds and self._seconds[0][0] <= now - KEEP:
            self._seconds.popleft()

    def errors(self, frontend: str, window: int, now: float) -> tuple[int, int, str]:
        total = failed = 0
        kinds: dict[str, int] = {}
        for at, second in reversed(self._seconds):
            if at <= now - window:
                break
            t, f, k = second.get(frontend, (0, 0, {}))
            total += t
            failed += f
            for kind, n in k.items():
                kinds[kind] = kinds.get(kind, 0) + n
        return total, failed, kinds_text(kinds)


# ------------------------------------------------------------------ the engine's view


class EngineWorld:
    """:class:`World` over the health engine (its resources, routes and
    states); the data plane's counts and the URL checks come from the
    caller (``errors``, ``urls``) - serve's or the simulator's."""

    def __init__(
        self,
        engine: HealthEngine,
        errors: Callable[[str, int, float], tuple[int, int, str]],
        urls: Callable[[PracticeRun, int], tuple[int, str]],
    ) -> None:
        self.engine = engine
        self._errors = errors
        self._urls = urls

    def practice_shift(self, run: PracticeRun) -> Shift | None:
        actor = run.actor
        found = None
        for res in self.engine.shifts():
            mine = res.actor == actor and res.project == run.project
            if mine and (found is None or res.created > found.created):
                found = res
        return found

    def practice_shifts(self) -> Sequence[Shift]:
        return [s for s in self.engine.shifts() if s.actor.startswith(ACTOR_PREFIX)]

    def touched(self, run: PracticeRun, shift: Shift) -> Mapping[str, Sequence[NegView]]:
        negs = set(affected(shift, self.engine.resources))
        out: dict[str, list[NegView]] = {}
        for frontend in self.engine.route_table().routes:
            order = [c for c, _ in self.engine.failover_order(frontend) if c.accepted]
            if any(c.path in negs for c in order):
                out[frontend] = [NegView(c.path, c.state, c.shifted) for c in order]
        return out

    def stranded(self, shift: Shift) -> list[str]:
        negs = set(affected(shift, self.engine.resources))
        out = []
        for frontend in self.engine.route_table().routes:
            order = [c for c, _ in self.engine.failover_order(frontend) if c.accepted]
            before = [c for c in order if c.eligible]
            if before and not [c for c in before if c.path not in negs]:
                out.append(frontend)
        return out

    def state(self, path: str) -> tuple[HealthState, str] | None:
        node = self.engine.node_status(path)
        return None if node is None else (node.state, node.reason)

    def errors(self, frontend: str, window: int, now: float) -> tuple[int, int, str]:
        return self._errors(frontend, window, now)

    def url(self, run: PracticeRun, index: int) -> tuple[int, str]:
        return self._urls(run, index)
