"""Ramped failbacks (SPEC §6, ``failbackRampSec``) - pure bookkeeping.

A consumer front end's NEG that becomes eligible again after being
UNHEALTHY or shifted away grows from 0 to its full take over
``failbackRampSec``: its candidate's ``ramp`` goes 0 → 1 along the way
(health/routing.py turns that into shares). A ramp is recorded when it
starts, ends or is abandoned - never per step:

* **started**: the NEG is eligible again (it was out at the front end's
  last evaluation);
* **ended**: its time is up (recorded at its own end time);
* **abandoned**: the NEG is out again (its ramp starts anew at its next
  recovery), or the data plane's error gate (controlplane/ramp_gate.py) saw
  too many of its requests fail - then its start is put a success window
  ahead, and it starts again from 0 then.

:class:`Ramps` holds, per front end, its NEGs ramping and since when;
the graph (health/graph.py) asks it on each evaluation of a route.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from healthgate.health.routing import Candidate, ramp_progress
from healthgate.health.states import ERROR_WINDOW, RampChange, RampPhase, Record


class Ramps:
    def __init__(self) -> None:
        # front end -> {NEG: ramp start}; a start ahead was put off by the error gate
        self.ramps: dict[str, dict[str, float]] = {}
        # the NEGs that were not eligible at the front end's last evaluation
        self._out: dict[str, frozenset[str]] = {}
        # (front end, NEG) of ramps the error gate put off (their start is
        # ahead: logged when it comes), and of those decided by this node's
        # own data plane's traffic (their records are this node's: local)
        self._waiting: set[tuple[str, str]] = set()
        self._local: set[tuple[str, str]] = set()

    def evaluate(
        self,
        now: float,
        frontend: str,
        project: str,
        candidates: list[Candidate],
        seconds: int,
        records: list[Record],
    ) -> list[Candidate]:
        """A front end's candidates evaluated at ``now``: its ramps started,
        ended or abandoned (records), and the candidates with their ramps
        (the same list: none)."""
        was_out = self._out.get(frontend)
        self._out[frontend] = frozenset(c.path for c in candidates if not c.eligible)
        ramps = dict(self.ramps.pop(frontend, {}))
        if not seconds:
            return candidates
        by_path = {c.path: c for c in candidates}
        events: list[tuple[RampPhase, str, float, float, str]] = []  # phase, NEG, start, at, why
        for neg, start in list(ramps.items()):
            c = by_path.get(neg)
            if c is None or not c.eligible:
                del ramps[neg]
                way = ramp_progress(now, start, seconds) * 100
                why = (
                    f"{neg.rsplit('/', 1)[-1]} is {c.why_out if c else 'no longer a backend'} "
                    f"{way:.0f}% of the way: its ramp starts again at its next recovery"
                )
                events.append((RampPhase.ABANDONED, neg, start, now, why))
            elif now >= start + seconds:
                del ramps[neg]
                why = f"{c.name} ({c.region}) takes its full share again"
                events.append((RampPhase.ENDED, neg, start, start + seconds, why))
            elif start <= now and (frontend, neg) in self._waiting:
                # a ramp the error gate put off (abandon) starts again
                self._waiting.discard((frontend, neg))
                why = (
                    f"{c.name} ({c.region}): its ramp starts again from 0 over {seconds} s, "
                    "a success window after the error gate abandoned it"
                )
                events.append((RampPhase.STARTED, neg, start, start, why))
        back = [
            c for c in candidates if was_out and c.path in was_out and c.eligible and c.accepted
        ]
        for c in back:  # eligible again
            ramps[c.path] = now
            self._local.discard((frontend, c.path))  # (a fresh ramp: every node's)
            why = (
                f"{c.name} ({c.region}) is {c.state.name} again: its share grows "
                f"from 0 over {seconds} s (failbackRampSec)"
            )
            events.append((RampPhase.STARTED, c.path, now, now, why))
        if ramps:
            self.ramps[frontend] = ramps
        after = tuple(sorted(ramps.items()))
        for phase, neg, start, when, why in events:
            local = (frontend, neg) in self._local
            records.append(
                RampChange(
                    when, project, frontend, neg, phase, seconds, start, why, after, local=local
                )
            )
            if phase is not RampPhase.STARTED:
                self._local.discard((frontend, neg))
                self._waiting.discard((frontend, neg))
        if not ramps:
            return candidates
        return [
            replace(c, ramp=ramp_progress(now, ramps[c.path], seconds)) if c.path in ramps else c
            for c in candidates
        ]

    def abandon(
        self,
        now: float,
        frontend: str,
        project: str,
        neg: str,
        seconds: int,
        window: float,
        limit: float | None,
        errors: tuple[int, int],
    ) -> RampChange | None:
        """The error gate saw ``errors`` (requests or connections, failed) of
        a ramping NEG: its ramp is abandoned (the NEG takes nothing) and
        starts again from 0 ``window`` seconds later (None: not ramping)."""
        ramps = self.ramps.get(frontend)
        if not ramps or neg not in ramps or ramps[neg] > now:
            return None
        total, failed = errors
        start = ramps[neg]
        ramps[neg] = now + window  # (a start ahead: no share until then)
        self._waiting.add((frontend, neg))
        self._local.add((frontend, neg))
        why = (
            f"{neg.rsplit('/', 1)[-1]}: {failed} of {total} requests or connections failed in "
            f"the last {ERROR_WINDOW:g} s ({100 * failed / total:.0f}% > failbackMaxErrorPercent "
            f"{limit:g}) {ramp_progress(now, start, seconds) * 100:.0f}% of the way: its ramp "
            f"starts again a success window ({window:g} s) later"
        )
        return RampChange(
            now,
            project,
            frontend,
            neg,
            RampPhase.ABANDONED,
            seconds,
            start,
            why,
            tuple(sorted(ramps.items())),
            (total, failed),
            local=True,
        )

    def running(self, now: float) -> dict[str, list[str]]:
        """Front end -> its NEGs ramping now (started, not put off)."""
        out = {}
        for frontend, ramps in self.ramps.items():
            negs = [n for n, start in ramps.items() if start <= now]
            if negs:
                out[frontend] = negs
        return out

    def next_step(self, now: float, seconds_of: Mapping[str, int]) -> float | None:
        """When a ramp in progress next moves its shares (None: no ramp);
        ``seconds_of``: each front end's failbackRampSec."""
        steps = []
        for frontend, ramps in self.ramps.items():
            seconds = seconds_of.get(frontend, 0)
            if not seconds or not ramps:
                continue
            step = min(1.0, max(0.05, seconds / 200))  # (200 steps: half a point each)
            for start in ramps.values():
                if start > now:  # (put off by the error gate: it starts then)
                    steps.append(start)
                else:
                    steps.append(min(start + seconds, now + step))
        return min(steps) if steps else None

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Every ramp in progress: front end -> {NEG path: start time}."""
        return {p: dict(r) for p, r in self.ramps.items()}

    def restore(self, now: float, ramps: Mapping[str, Mapping[str, float]]) -> None:
        """Ramps in progress, as persisted (a start still ahead was put off
        by the error gate: it is logged when it comes)."""
        self.ramps = {p: dict(r) for p, r in ramps.items() if r}
        self._waiting = {(p, n) for p, r in self.ramps.items() for n, t in r.items() if t > now}
