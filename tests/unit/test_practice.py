"""Practice runs (SPEC §11) decided in virtual time: the calendar, the
refusals, the outcome checks, and the director's whole cycle - against a
world whose every answer the test sets (health/practice.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from healthgate.health.practice import (
    EndShift,
    NegView,
    PracticeDirector,
    StartShift,
    blocked,
    next_start,
    window_at,
)
from healthgate.health.states import HealthState, PracticePhase, PracticeRecord, RouteChange
from healthgate.model.practice import PracticeRun, Schedule
from healthgate.model.resources import Shift
from healthgate.model.validation import parse_resource
from healthgate.simulation.runner import simulate
from healthgate.simulation.scenario import Scenario
from tests.helpers import example_world, resources

FE = "projects/web/global/forwardingRules/shop"
US = "projects/web/regions/us-east1/networkEndpointGroups/shop-us"
EU = "projects/web/regions/europe-west1/networkEndpointGroups/shop-eu"
COMPOSITE = "projects/web/regions/europe-west1/compositeHealthChecks/web"


def at(text: str) -> float:
    """``"2026-12-08 10:00"`` (UTC) in epoch seconds."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def run(**fields: Any) -> PracticeRun:
    doc = {
        "kind": "PracticeRun",
        "name": "weekly-us",
        "project": "web",
        "awayFrom": "us-east1",
        "durationSec": 600,
        **fields,
    }
    res, issues = parse_resource(doc)
    assert res is not None, issues
    assert isinstance(res, PracticeRun)
    return res


class FakeWorld:
    """Every answer set by the test; shifts started are kept as the store would."""

    def __init__(self) -> None:
        self.shifts: dict[str, Shift] = {}
        self.negs = {FE: [NegView(US, HealthState.HEALTHY), NegView(EU, HealthState.HEALTHY)]}
        self.would_strand: list[str] = []
        self.counts = (0, 0, "")
        self.states: dict[str, tuple[HealthState, str]] = {}
        self.url_failures = (0, "")

    def practice_shift(self, run: PracticeRun) -> Shift | None:
        return next((s for s in self.shifts.values() if s.actor == run.actor), None)

    def practice_shifts(self) -> Sequence[Shift]:
        return list(self.shifts.values())

    def touched(self, run: PracticeRun, shift: Shift) -> Mapping[str, Sequence[NegView]]:
        return self.negs

    def stranded(self, shift: Shift) -> list[str]:
        return self.would_strand

    def errors(self, frontend: str, window: int, now: float) -> tuple[int, int, str]:
        assert frontend == FE
        return self.counts

    def state(self, path: str) -> tuple[HealthState, str] | None:
        return self.states.get(path)

    def url(self, run: PracticeRun, index: int) -> tuple[int, str]:
        return self.url_failures

    def act(self, actions: list[Any]) -> list[PracticeRecord]:
        """Carry the actions out as the runner does; the records."""
        records = []
        for a in actions:
            if isinstance(a, StartShift):
                self.shifts[str(a.shift.path)] = a.shift
            elif isinstance(a, EndShift):
                self.shifts.pop(str(a.shift.path), None)
            else:
                records.append(a)
        return records


# ------------------------------------------------------------------ the calendar

TUESDAY_10 = Schedule(weekdays=["TUE"], start_utc="10:00", window_min=60)
DAILY_2330 = Schedule(start_utc="23:30", window_min=90)

# (schedule, now, the window containing it, the next start after it)
CALENDAR = [
    (TUESDAY_10, "2026-12-08 10:00", ("2026-12-08 10:00", "2026-12-08 11:00"), "2026-12-15 10:00"),
    (TUESDAY_10, "2026-12-08 10:59", ("2026-12-08 10:00", "2026-12-08 11:00"), "2026-12-15 10:00"),
    (TUESDAY_10, "2026-12-08 11:00", None, "2026-12-15 10:00"),
    (TUESDAY_10, "2026-12-08 09:59", None, "2026-12-08 10:00"),
    (TUESDAY_10, "2026-12-09 10:30", None, "2026-12-15 10:00"),  # a Wednesday
    (DAILY_2330, "2026-12-09 00:30", ("2026-12-08 23:30", "2026-12-09 01:00"), "2026-12-09 23:30"),
    (DAILY_2330, "2026-12-09 01:00", None, "2026-12-09 23:30"),
]  # fmt: skip


@pytest.mark.parametrize(("schedule", "now", "window", "upcoming"), CALENDAR)
def test_the_schedule_calendar(
    schedule: Schedule, now: str, window: tuple[str, str] | None, upcoming: str
) -> None:
    want = (at(window[0]), at(window[1])) if window else None
    assert window_at(schedule, at(now)) == want
    assert next_start(schedule, at(now)) == at(upcoming)


BLOCKS = [
    ({"start": "2026-12-24T00:00:00Z", "end": "2026-12-27T00:00:00Z"}, "2026-12-23 23:55", True),
    ({"start": "2026-12-24T00:00:00Z", "end": "2026-12-27T00:00:00Z"}, "2026-12-23 23:50", False),
    ({"start": "2026-12-24T00:00:00Z", "end": "2026-12-27T00:00:00Z"}, "2026-12-27 00:00", False),
    ({"weekdays": ["FRI"], "startUtc": "16:00", "durationMin": 960}, "2026-12-12 07:00", True),
    ({"weekdays": ["FRI"], "startUtc": "16:00", "durationMin": 960}, "2026-12-12 08:00", False),
    ({"weekdays": ["FRI"], "startUtc": "16:00", "durationMin": 960}, "2026-12-11 15:51", True),
    ({"startUtc": "02:00", "durationMin": 60}, "2026-12-09 01:55", True),
    ({"startUtc": "02:00", "durationMin": 60}, "2026-12-09 03:00", False),
]  # fmt: skip


@pytest.mark.parametrize(("window", "start", "overlaps"), BLOCKS)
def test_a_blocked_window_stops_a_run_that_would_overlap_it(
    window: dict[str, Any], start: str, overlaps: bool
) -> None:
    """A run of 10 minutes starting at ``start`` (2026-12-11 is a Friday)."""
    why = blocked(run(blockedWindows=[window]), at(start), at(start) + 600)
    assert (why is not None) == overlaps, why


# ------------------------------------------------------------------ the director


def scheduled(**fields: Any) -> PracticeRun:
    return run(schedule={"weekdays": ["TUE"], "startUtc": "10:00", "windowMin": 60}, **fields)


def test_a_scheduled_run_starts_once_a_window_and_completes() -> None:
    world, director, r = FakeWorld(), PracticeDirector(), scheduled()
    assert world.act(director.tick(at("2026-12-08 09:59"), [r], world)) == []
    records = world.act(director.tick(at("2026-12-08 10:00:01"), [r], world))
    assert [x.phase for x in records] == [PracticePhase.STARTED]
    (shift,) = world.shifts.values()
    assert shift.actor == "practice-run/weekly-us" and shift.away_from == "us-east1"
    assert shift.expire_time == at("2026-12-08 10:00:01") + 600
    assert "until" in records[0].reason and records[0].window == at("2026-12-08 10:00")
    # under way: nothing more
    assert world.act(director.tick(at("2026-12-08 10:05"), [r], world)) == []
    assert "underWay" in director.status(r, at("2026-12-08 10:05"))
    # ran out: COMPLETED at the shift's own end, and the shift removed
    records = world.act(director.tick(at("2026-12-08 10:10:02"), [r], world))
    assert [(x.phase, x.time) for x in records] == [(PracticePhase.COMPLETED, shift.expire_time)]
    assert world.shifts == {}
    # the same window: never again; the next one, again
    assert world.act(director.tick(at("2026-12-08 10:30"), [r], world)) == []
    assert director.status(r, at("2026-12-08 10:30"))["next"] == "2026-12-15T10:00:00.000Z"
    records = world.act(director.tick(at("2026-12-15 10:00"), [r], world))
    assert [x.phase for x in records] == [PracticePhase.STARTED]


def test_a_restart_does_not_run_a_window_twice() -> None:
    """The log's records tell a new director which windows were tried."""
    world, first, r = FakeWorld(), PracticeDirector(), scheduled()
    (started,) = world.act(first.tick(at("2026-12-08 10:00"), [r], world))
    world.shifts.clear()  # (and say it completed meanwhile)
    again = PracticeDirector()
    again.seen(started)
    assert world.act(again.tick(at("2026-12-08 10:20"), [r], world)) == []


def test_a_new_writer_takes_over_a_run_under_way() -> None:
    """A run's shift in the store, no memory of starting it: judged on, completed once."""
    world, first, r = FakeWorld(), PracticeDirector(), scheduled()
    world.act(first.tick(at("2026-12-08 10:00"), [r], world))
    (shift,) = world.shifts.values()
    second = PracticeDirector()
    assert world.act(second.tick(at("2026-12-08 10:04"), [r], world)) == []
    records = world.act(second.tick(at("2026-12-08 10:11"), [r], world))
    assert [(x.phase, x.time) for x in records] == [(PracticePhase.COMPLETED, shift.expire_time)]


# (what the world says, the reason's words)
REFUSALS = [
    ("UNHEALTHY", "an incident: projects/web/global/forwardingRules/shop's NEG "
                  "projects/web/regions/europe-west1/networkEndpointGroups/shop-eu is UNHEALTHY"),
    ("shifted", "is shifted away by alice"),
    ("stranded", "would leave projects/web/global/forwardingRules/shop with no backend"),
    ("blocked", "would overlap the blocked window"),
    ("nothing", "no consumer front end reaches it"),
]  # fmt: skip


@pytest.mark.parametrize(("situation", "words"), REFUSALS)
def test_a_run_never_starts_into_an_incident(situation: str, words: str) -> None:
    world, director = FakeWorld(), PracticeDirector()
    r = scheduled(
        blockedWindows=[{"start": "2026-12-08T10:05:00Z", "end": "2026-12-08T12:00:00Z"}]
        if situation == "blocked"
        else []
    )
    if situation == "UNHEALTHY":
        world.negs = {FE: [NegView(US, HealthState.HEALTHY), NegView(EU, HealthState.UNHEALTHY)]}
    elif situation == "shifted":
        shifted = "shifted away by alice until 2026-12-08T12:00:00.000Z: maintenance"
        world.negs = {FE: [NegView(US, HealthState.HEALTHY), NegView(EU, HealthState.HEALTHY, shifted)]}  # fmt: skip
    elif situation == "stranded":
        world.would_strand = [FE]
    elif situation == "nothing":
        world.negs = {}
    (record,) = world.act(director.tick(at("2026-12-08 10:00"), [r], world))
    assert record.phase is PracticePhase.SKIPPED and words in record.reason, record.reason
    assert world.shifts == {}
    # skipped is tried: not again in this window
    assert world.act(director.tick(at("2026-12-08 10:01"), [r], world)) == []


def start_now(r: PracticeRun, world: FakeWorld, director: PracticeDirector) -> Shift:
    (started,) = world.act(director.start(at("2026-12-09 12:00"), r, world))
    assert started.phase is PracticePhase.STARTED and started.window is None
    (shift,) = world.shifts.values()
    return shift


ERRORS = {"type": "FRONTEND_ERRORS", "frontend": "shop", "maxErrorPercent": 5}


# (outcome check, what the world then says, breached?, the reason's words)
BREACHES = [
    (ERRORS, {"counts": (200, 11, "500 x11")}, True,
     "11 of 200 requests through projects/web/global/forwardingRules/shop failed (5.5 %) in 60 s: "
     "500 x11 > maxErrorPercent 5"),
    (ERRORS, {"counts": (200, 10, "500 x10")}, False, ""),  # at the threshold: holds
    (ERRORS, {"counts": (19, 19, "reset x19")}, False, ""),  # below minimumRequests 20
    ({**ERRORS, "minimumRequests": 10}, {"counts": (19, 19, "reset x19")}, True, "19 of 19"),
    ({"type": "COMPOSITE_UNHEALTHY", "composite": "regions/europe-west1/compositeHealthChecks/web"},
     {"states": {COMPOSITE: (HealthState.UNHEALTHY, "health source web-source is UNHEALTHY")}},
     True, f"{COMPOSITE} is UNHEALTHY: health source web-source is UNHEALTHY"),
    ({"type": "COMPOSITE_UNHEALTHY", "composite": "regions/europe-west1/compositeHealthChecks/web"},
     {"states": {COMPOSITE: (HealthState.UNKNOWN, "not evaluated yet")}}, False, ""),
    ({"type": "COMPOSITE_UNHEALTHY", "neg": "regions/europe-west1/networkEndpointGroups/shop-eu"},
     {"states": {EU: (HealthState.UNHEALTHY, "composite is UNHEALTHY")}}, True, "shop-eu is UNHEALTHY"),
    ({"type": "URL", "url": "http://status.internal/ok", "failuresToBreach": 2},
     {"url_failures": (1, "HTTP 503")}, False, ""),
    ({"type": "URL", "url": "http://status.internal/ok", "failuresToBreach": 2, "name": "status"},
     {"url_failures": (2, "HTTP 503")}, True, "status: http://status.internal/ok failed 2 times in a row (HTTP 503)"),
]  # fmt: skip


@pytest.mark.parametrize(("check", "says", "breached", "words"), BREACHES)
def test_an_outcome_check_that_breaches_cancels_the_run(
    check: dict[str, Any], says: dict[str, Any], breached: bool, words: str
) -> None:
    world, director, r = FakeWorld(), PracticeDirector(), run(outcomeChecks=[check])
    shift = start_now(r, world, director)
    for attr, value in says.items():
        setattr(world, attr, value)
    records = world.act(director.tick(at("2026-12-09 12:03"), [r], world))
    if not breached:
        assert records == [] and world.shifts == {str(shift.path): shift}
        return
    (record,) = records
    assert record.phase is PracticePhase.CANCELLED and words in record.reason, record.reason
    assert record.reason.endswith("; traffic returns") and record.check
    assert world.shifts == {}  # traffic returns at once
    assert world.act(director.tick(at("2026-12-09 12:04"), [r], world)) == []


def test_a_shift_ended_by_hand_cancels_the_run() -> None:
    world, director, r = FakeWorld(), PracticeDirector(), run()
    start_now(r, world, director)
    world.shifts.clear()  # DELETE /v1/projects/web/shifts/...
    (record,) = world.act(director.tick(at("2026-12-09 12:02"), [r], world))
    assert record.phase is PracticePhase.CANCELLED and "ended by hand" in record.reason


def test_an_end_that_did_not_go_through_is_asked_for_again_not_recorded_again() -> None:
    world, director, r = FakeWorld(), PracticeDirector(), run(outcomeChecks=[ERRORS])
    shift = start_now(r, world, director)
    world.counts = (100, 50, "500 x50")
    actions = director.tick(at("2026-12-09 12:03"), [r], world)
    assert [type(a).__name__ for a in actions] == ["EndShift", "PracticeRecord"]
    # (the store refused the delete: the shift is still there)
    again = director.tick(at("2026-12-09 12:04"), [r], world)
    assert again == [EndShift(shift, str(r.path))]


def test_a_disabled_schedule_waits_and_a_manual_start_still_runs() -> None:
    world, director, r = FakeWorld(), PracticeDirector(), scheduled(enabled=False)
    assert director.tick(at("2026-12-08 10:00"), [r], world) == []
    assert "next" not in director.status(r, at("2026-12-08 10:00"))
    start_now(r, world, director)


def test_a_record_read_back_from_the_log_is_the_same_record() -> None:
    world, director, r = FakeWorld(), PracticeDirector(), scheduled()
    (started,) = world.act(director.tick(at("2026-12-08 10:00"), [r], world))
    assert PracticeRecord.from_dict(started.to_dict()) == started
    assert PracticeRecord.from_dict({"kind": "PracticeRun", "to": "NOPE"}) is None


# ------------------------------------------------------------------ in simulate

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def simulated(scenario: dict[str, Any], *edits: Any) -> list[Any]:
    docs = example_world()
    run_doc = yaml.safe_load((EXAMPLES / "practice-run.yaml").read_text())
    for edit in edits:
        edit(run_doc)
    base = yaml.safe_load((EXAMPLES / "scenario-practice.yaml").read_text())
    return simulate(
        resources([*docs, run_doc]), Scenario.model_validate({**base, **scenario})
    ).records


def test_simulate_runs_a_scheduled_practice_and_cancels_it_on_the_survivors_errors() -> None:
    """examples/scenario-practice.yaml: the window opens at virtual 60 s;
    europe-west1 fails 10 % of its requests from 240 s - over 2 % in 30 s."""
    t0 = at("2026-12-08 09:59")
    records = simulated({})
    kinds = [(r.time - t0, type(r).__name__, getattr(r, "phase", None)) for r in records]
    assert kinds[:2] == [(60.0, "RouteChange", None), (60.0, "PracticeRecord", "STARTED")], kinds
    cancelled = [r for r in records if isinstance(r, PracticeRecord) and r.phase == "CANCELLED"]
    assert len(cancelled) == 1 and 240 < cancelled[0].time - t0 <= 250, kinds
    assert "> maxErrorPercent 2" in cancelled[0].reason and "500 ×" in cancelled[0].reason
    back = [r for r in records if isinstance(r, RouteChange) and r.time > t0 + 60]
    assert [(r.time, r.current) for r in back] == [
        (cancelled[0].time, "projects/web/regions/us-east1/networkEndpointGroups/shop-us")
    ]


def test_simulate_completes_a_quiet_run_and_skips_one_in_an_incident() -> None:
    t0 = at("2026-12-08 09:59")

    def short(doc: dict[str, Any]) -> None:
        doc["durationSec"] = 120

    quiet = simulated({"events": []}, short)
    phases = [(r.time - t0, r.phase) for r in quiet if isinstance(r, PracticeRecord)]
    assert phases == [(60.0, "STARTED"), (180.0, "COMPLETED")], phases
    routes = [r.time - t0 for r in quiet if isinstance(r, RouteChange)]
    assert routes == [60.0, 180.0]  # away, and back at its end
    down = {"at": 10, "select": {"project": "shop", "region": "europe-west1"}, "fault": "hang"}
    skipped = simulated({"events": [down]}, short)
    (record,) = [r for r in skipped if isinstance(r, PracticeRecord)]
    assert record.phase == "SKIPPED" and "shop-eu is UNHEALTHY" in record.reason, record.reason


def test_simulate_starts_a_run_by_hand_and_a_failing_url_cancels_it() -> None:
    t0 = at("2026-12-08 09:59")

    def by_hand(doc: dict[str, Any]) -> None:
        doc.pop("schedule")
        doc["outcomeChecks"] = [{"type": "URL", "url": "http://status.internal/ok",
                                 "intervalSec": 10, "failuresToBreach": 2}]  # fmt: skip

    events = [
        {"at": 20, "practice": "weekly-us"},
        {"at": 50, "url": "http://status.internal/ok", "status": 503},
    ]
    records = simulated({"events": events}, by_hand)
    phases = [(r.time - t0, r.phase) for r in records if isinstance(r, PracticeRecord)]
    assert phases == [(20.0, "STARTED"), (60.0, "CANCELLED")], phases
    assert "failed 2 times in a row (HTTP 503)" in records[-1].reason


def test_a_run_deleted_under_way_ends_its_shift() -> None:
    world, director, r = FakeWorld(), PracticeDirector(), run()
    start_now(r, world, director)
    (record,) = world.act(director.tick(at("2026-12-09 12:02"), [], world))
    assert record.phase is PracticePhase.CANCELLED and "was deleted" in record.reason
    assert record.path == "projects/web/global/practiceRuns/weekly-us" and world.shifts == {}
