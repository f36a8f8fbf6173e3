"""Frames between healthgate processes (process/frames.py): data only.

A worker reads what clients and backends send; were it ever subverted, what
it writes back must not run code in the serving process. Frames used to be
pickles: one that calls a function when loaded ran it. Now every message
type round-trips as typed data, and anything else is dropped."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest

from healthgate.controlplane import probe_workers as pw
from healthgate.controlplane.probing import Decided
from healthgate.dataplane import workers as dw
from healthgate.dataplane.manager import DataPlaneSettings
from healthgate.health.engine import HealthEngine
from healthgate.health.states import HealthState, Outcome
from healthgate.probes.prober import ProbeSettings
from healthgate.probes.scheduler import SchedulerSettings
from healthgate.probes.stats import ProbeTotals
from healthgate.process.frames import Dropped, decode, encode, expect
from tests.helpers import example_world, resources


def every_message() -> list[Any]:
    world = {r.path: r for r in resources(example_world())}
    engine = HealthEngine()
    engine.apply(list(world.values()), 0.0)
    targets = list(engine.targets())
    totals = ProbeTotals(started=3)
    totals.buckets[Outcome.OK] = [1, 2]
    totals.sums[Outcome.TIMEOUT] = 0.5
    observed = (1, 2, 3, 4, 5.0, 6.0, "refused")
    return [
        dw.Setup(DataPlaneSettings(), 1.0),
        dw.Resources(world),
        dw.health_snapshot(engine, world),
        dw.Stats({"rule": {"requests": 1, "error": None}}, [1, 2], 0.5),
        pw.Setup(0, ProbeSettings(), SchedulerSettings(), 10, 1.0),
        pw.Probe({t.backend_service.text: (t.check, {}) for t in targets}, [], []),
        pw.Probe({}, [("a", 1, 2.0)], ["b"]),
        pw.HistoryWanted(3),
        pw.Flips([Decided("p", HealthState.HEALTHY, 1.0, "why", observed)]),
        pw.Observations([("p", observed)]),
        pw.Failures([("p", "refused")], 3),
        pw.Totals(totals),
    ]


@pytest.mark.parametrize("message", every_message(), ids=lambda m: type(m).__qualname__)
def test_every_message_round_trips_as_typed_data(message: Any) -> None:
    frame = encode(message)
    (size,) = struct.unpack("!I", frame[:4])
    assert size == len(frame) - 4
    back = decode(frame[4:])
    assert back == message and type(back) is type(message)


def test_a_pickle_that_runs_code_is_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    got = decode(pickle.dumps(Evil()))
    assert isinstance(got, Dropped)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("name", "fields", "why"),
    [
        ("builtins.eval", "__import__('os').system('true')", "no such message"),
        ("healthgate.controlplane.probe_workers.Flips", {"decided": [["p", 7, 1.0, "r"]]}, "enum"),
        ("healthgate.controlplane.probe_workers.Totals", {"totals": "not totals"}, "Expected"),
        ("healthgate.dataplane.workers.Resources", {"resources": [[{}, {"kind": "Nope"}]]}, ""),
    ],
)
def test_a_frame_that_is_not_a_message_is_dropped(name: str, fields: object, why: str) -> None:
    got = decode(msgspec.msgpack.encode((name, fields)))
    assert isinstance(got, Dropped) and why in got.why, got
    assert expect(got, pw.Flips) is None


def test_only_registered_messages_are_sent() -> None:
    with pytest.raises(TypeError, match="not a registered message"):
        encode({"a": 1})


def test_a_probe_message_takes_health_checks_only() -> None:
    """A worker is given checks, typed: another kind of resource in their
    place (a backend service, say) is refused with the frame."""
    world = {r.path: r for r in resources(example_world())}
    service = next(r for r in world.values() if r.path.collection == "backendServices")
    name = "healthgate.controlplane.probe_workers.Probe"
    fields = {"checks": {"x": [service.to_wire(), {}]}, "put": [], "gone": []}
    got = decode(msgspec.msgpack.encode((name, fields)))
    assert isinstance(got, Dropped) and "HealthCheck" in got.why, got
