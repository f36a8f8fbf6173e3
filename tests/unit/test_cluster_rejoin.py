"""A cluster node that loses its session and joins again (SPEC §4,
"Partitions"), without etcd: ClusterProbing fed opinion events by hand, in
virtual time, and the recorder of a newly elected leader on the memory store.

* while not a member its decisions stand still (what it reads is kept);
* joining again, the opinions listed then are the truth, an older event the
  watch still delivers is dropped, and an endpoint whose decision would
  change is held until a fresh opinion comes or its window passes;
* a prober state taken from a stored opinion gives way to a newer stored
  one, where a state of its own probes corrects it;
* a new leader writes what no leader wrote - and nothing the log holds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import operator
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from healthgate.cluster.ledger import LeaderLedger, bound_dict
from healthgate.cluster.opinions import OpinionWriter, opinion_key
from healthgate.cluster.probing import ClusterProbing, ClusterSettings
from healthgate.controlplane.health_service import HealthService
from healthgate.controlplane.probing import Feed
from healthgate.controlplane.recorder import TransitionRecorder
from healthgate.health.states import HealthState, Outcome, ProbeResult
from healthgate.probes.stats import FailureLogLimiter
from healthgate.store.base import Guard, LogQuery, NotLeader
from healthgate.store.etcd_client import Event, KeyValue
from healthgate.store.memory import MemoryStore
from tests.e2e.harness import e2e_world
from tests.helpers import run_async
from tests.unit.test_cluster_takeover import Said, resources

US, EU = "us-east1", "europe-west1"
H, U = HealthState.HEALTHY, HealthState.UNHEALTHY


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def node(clock: Clock) -> tuple[HealthService, ClusterProbing, Said]:
    made: list[ClusterProbing] = []

    def source(feed: Feed, failure_log: FailureLogLimiter) -> ClusterProbing:
        made.append(ClusterProbing(feed, ClusterSettings("a", US), clock=clock))
        return made[0]

    service = HealthService(source=source)
    said = Said()
    made[0].writer = cast(OpinionWriter, said)
    service.apply(resources(e2e_world(18080, 18090, (18100, 18101))))
    made[0].set_members({"a": US, "c": EU})
    return service, made[0], said


def kv(path: str, state: HealthState, since: float, revision: int, node: str = "c") -> KeyValue:
    value = {"state": state.name, "since": since, "reason": "probed", "node": node}
    return KeyValue(opinion_key(path, US), json.dumps(value).encode(), 1, revision, 0)


def event(path: str, state: HealthState, since: float, revision: int) -> Event:
    return Event(revision, kv(path, state, since, revision), False)


def deleted(path: str, revision: int) -> Event:
    """etcd's deletion event: the key alone, no value."""
    return Event(revision, KeyValue(opinion_key(path, US), b"", 0, 0, 0), True)


def garbled(path: str, revision: int) -> Event:
    return Event(revision, KeyValue(opinion_key(path, US), b"{not json", 1, revision, 0), False)


def us_paths(probing: ClusterProbing) -> list[str]:
    return sorted(p for p in probing.endpoints if f"/{US}/" in p)


def serving(probing: ClusterProbing, path: str) -> HealthState:
    return probing.feed.engine.table.state(probing.endpoints[path].slot)


def say_all(probing: ClusterProbing, state: HealthState, since: float, first: int) -> None:
    for i, path in enumerate(us_paths(probing)):
        probing.opinion_changed(event(path, state, since, first + i))
    probing.opinions_settled()


def test_decisions_stand_still_while_not_a_member_and_are_held_on_joining() -> None:
    clock = Clock()
    _, probing, _ = node(clock)
    paths = us_paths(probing)
    say_all(probing, H, 990.0, 10)
    assert {serving(probing, p) for p in paths} == {H}
    probing.left()
    # the watch catches up after a cut: the opinions of probers that could not reach them
    say_all(probing, U, 995.0, 20)
    assert {serving(probing, p) for p in paths} == {H}  # fail static
    # joined again: the listed opinions say UNHEALTHY - held, not taken at once
    snapshot = [kv(p, U, 995.0, 20 + i) for i, p in enumerate(paths)]
    probing.joined(snapshot, revision=30)
    assert {serving(probing, p) for p in paths} == {H}
    # an event from before the list, delivered late by the watch, is older news
    probing.opinion_changed(event(paths[0], H, 999.0, 25))
    probing.opinions_settled()
    assert probing.opinions[paths[0]][US].state is U
    # a fresh opinion ends the hold of its endpoint (here: it agrees, nothing moves)
    probing.opinion_changed(event(paths[0], H, 1_001.0, 31))
    probing.opinions_settled()
    assert serving(probing, paths[0]) is H
    # the others' window passes without a fresh word: the stored opinions decide
    clock.now += 5.0  # (e2e checks: 1 s interval, thresholds 2, 1 s timeout: a 4 s window)
    probing.release_held()
    assert serving(probing, paths[0]) is H
    assert {serving(probing, p) for p in paths[1:]} == {U}


def test_a_hold_is_only_for_decisions_that_would_change() -> None:
    clock = Clock()
    _, probing, _ = node(clock)
    paths = us_paths(probing)
    say_all(probing, H, 990.0, 10)
    probing.left()
    probing.joined([kv(p, H, 990.0, 10 + i) for i, p in enumerate(paths)], revision=20)
    assert {serving(probing, p) for p in paths} == {H}
    assert not probing._held


def test_a_borrowed_state_gives_way_to_a_newer_opinion_an_own_state_corrects_it() -> None:
    clock = Clock()
    _, probing, said = node(clock)
    probing.set_members({"a": US})  # a probes us-east1's endpoints for its region
    mine = {path: slot for slot, (path, _) in probing.mine.items() if f"/{US}/" in path}
    assert mine
    path, slot = next(iter(mine.items()))
    probing.load_opinions([kv(path, H, 990.0, 10)])  # taken over: HEALTHY, borrowed
    said.queued.clear()
    # a newer stored opinion (a late write of the previous prober): adopted, not fought
    probing.opinion_changed(event(path, U, 995.0, 11))
    probing.opinions_settled()
    assert probing.prober.table.state(slot) is U
    assert said.queued == {}
    # its own probes flip it: from now on the prober is the authority
    for _ in range(2):
        probing._on_results(clock(), [(slot, ProbeResult(Outcome.OK, 0.001))])
    assert probing.prober.table.state(slot) is H
    said.queued.clear()
    probing.opinion_changed(event(path, U, 996.0, 12))  # someone else's stale word
    probing.opinions_settled()
    assert probing.prober.table.state(slot) is H
    assert said.queued[opinion_key(path, US)]["state"] == "HEALTHY"  # corrected


def test_every_node_times_a_records_alike_however_its_opinions_arrived() -> None:
    # one node saw the endpoints fail one by one; one that rejoins gets the
    # same opinions in one batch, in another order: the NEG's record (and the
    # route's) must carry the same time, or a later leader takes the other's
    # for unwritten and writes the transition twice (seen in the cluster tests)
    def times(batches: list[list[tuple[str, float]]]) -> dict[str, float]:
        _, probing, _ = node(Clock())
        say_all(probing, H, 990.0, 10)
        seen: list[Any] = []
        emit = probing.feed.emit

        def seeing(records: list[Any]) -> None:
            seen.extend(records)
            emit(records)

        probing.feed.emit = seeing
        to_dict = operator.methodcaller("to_dict")
        revision = 100
        for batch in batches:
            for path, since in batch:
                revision += 1
                probing.opinion_changed(event(path, U, since, revision))
            probing.opinions_settled()
        return {str(d.get("path") or d["frontend"]): d["time"] for d in map(to_dict, seen)}

    paths = us_paths(node(Clock())[1])
    failed = [(paths[2], 995.9), (paths[0], 995.1), (paths[1], 995.5)]
    one_by_one = times([[f] for f in sorted(failed, key=lambda f: f[1])])
    at_once = times([failed])
    assert one_by_one and at_once == one_by_one


@contextlib.asynccontextmanager
async def follower(store: MemoryStore) -> AsyncIterator[tuple[TransitionRecorder, LeaderLedger]]:
    """A cluster node's recorder and its ledger while it is not the leader
    (it persists nothing, and reads the log back), running until the block
    ends. Its election's guard is always there (the memory store takes any)."""
    recorder = TransitionRecorder(store)
    ledger = LeaderLedger(store, lambda: Guard("election/me", 1))
    recorder.attach(ledger)
    task = asyncio.create_task(recorder.run())
    try:
        yield recorder, ledger
    finally:
        task.cancel()


def take_over(recorder: TransitionRecorder, ledger: LeaderLedger, horizon: float) -> None:
    """What cluster/node.py does when elected."""
    ledger.take_over(horizon)
    recorder.kick()


def record(path: str, to: str, when: float) -> dict[str, Any]:
    return {"time": when, "kind": "Endpoint", "path": path, "from": "HEALTHY", "to": to}


def test_a_new_leader_writes_what_no_leader_wrote_and_nothing_twice() -> None:
    async def go() -> None:
        store = MemoryStore()
        async with follower(store) as (recorder, ledger):
            a, b = record("x/endpoints/1", "UNHEALTHY", 100.0), record("x/endpoints/2", "U", 101.0)
            # this node computed both; the previous leader wrote the first,
            # and this node's watch has not delivered it yet
            ledger.computed([a, b])
            store.append_log([a])
            assert ledger.unwritten(0.0) == 2
            take_over(recorder, ledger, 50.0)
            await recorder.flush()
            logged = [dict(e.record) for e in store.query_log(LogQuery())]
            assert [(r["path"], r["time"]) for r in logged] == [
                ("x/endpoints/1", 100.0),
                ("x/endpoints/2", 101.0),
            ]
            for i, r in enumerate(logged, 1):  # the watch delivers both
                recorder.publish((i, r))
            assert ledger.unwritten(0.0) == 0

    run_async(go(), timeout=10)


def test_a_new_leader_does_not_write_what_the_log_went_past() -> None:
    # this node's record of a transition carries a time a little before the
    # one the writer logged, and the log has gone on since (the path
    # recovered): neither the watch nor the take-over take it for unwritten
    async def go() -> None:
        store = MemoryStore()
        async with follower(store) as (recorder, ledger):
            mine = record("x/negs/1", "UNHEALTHY", 100.0)
            ledger.computed([mine])
            theirs = [record("x/negs/1", "UNHEALTHY", 100.1), record("x/negs/1", "HEALTHY", 104.0)]
            ids = store.append_log(theirs)
            assert ledger.unwritten(0.0) == 1
            recorder.publish((ids[0], theirs[0]))  # its twin: logged later than it
            assert ledger.unwritten(0.0) == 0
            recorder.publish((ids[1], theirs[1]))
            assert ledger.unwritten(0.0) == 0
            # the same when the watch has not delivered the log yet: read there
            ledger.computed([record("x/negs/2", "UNHEALTHY", 200.0)])
            store.append_log([record("x/negs/2", "HEALTHY", 201.0)])
            take_over(recorder, ledger, 50.0)
            await recorder.flush()
            assert len(store.query_log(LogQuery())) == 3  # nothing written

    run_async(go(), timeout=10)


def test_a_node_whose_election_ended_writes_nothing() -> None:
    # the guard is the election's alone: once it is gone, a batch the writer
    # had taken is not written unguarded, and the ledger stops writing
    async def go() -> None:
        store = MemoryStore()
        recorder = TransitionRecorder(store)
        guards: list[Guard] = [Guard("election/me", 1)]
        ledger = LeaderLedger(store, lambda: guards[0] if guards else None)
        recorder.attach(ledger)
        take_over(recorder, ledger, 0.0)
        assert recorder.persist and recorder.guard == Guard("election/me", 1)
        guards.clear()  # deposed: the election dropped its guard
        with pytest.raises(NotLeader):
            recorder._write([record("x/endpoints/1", "UNHEALTHY", 100.0)], {}, [])
        assert not recorder.persist and recorder.guard is None
        task = asyncio.create_task(recorder.run())
        try:
            ledger.computed([record("x/endpoints/2", "UNHEALTHY", 101.0)])
            recorder.kick()
            await recorder.flush()
        finally:
            task.cancel()
        assert store.query_log(LogQuery()) == []
        assert ledger.unwritten(0.0) == 1  # kept for the next leader

    run_async(go(), timeout=10)


@pytest.mark.parametrize(
    ("events", "held"),
    [
        # (kind, revision) in the order the watch delivers them -> the revision held (0: none)
        ([("put", 11)], 11),
        ([("put", 11), ("put", 12)], 12),
        ([("put", 12), ("put", 11)], 12),  # older news: dropped
        ([("put", 11), ("del", 12)], 0),
        ([("put", 11), ("del", 12), ("put", 12)], 0),  # no older than the deletion
        ([("put", 11), ("del", 12), ("put", 13)], 13),
        ([("del", 12), ("put", 11)], 0),  # a deletion of nothing held is remembered too
        ([("put", 11), ("garbled", 12)], 11),  # a value that cannot be trusted: the held stands
        ([("put", 11), ("put", 9)], 11),
        ([("put", 25)], 0),  # at or below the floor (joined at 30): older than the list
    ],
)
def test_opinion_events_apply_in_revision_order(events: list[tuple[str, int]], held: int) -> None:
    _, probing, _ = node(Clock())
    path = us_paths(probing)[0]
    if events == [("put", 25)]:
        probing.left()
        probing.joined([], revision=30)
    make = {
        "put": lambda r: event(path, U if r % 2 else H, 990.0 + r, r),
        "del": lambda r: deleted(path, r),
        "garbled": lambda r: garbled(path, r),
    }
    for kind, revision in events:
        probing.opinion_changed(make[kind](revision))
    probing.opinions_settled()
    got = probing.opinions.get(path, {}).get(US)
    assert (got.revision if got is not None else 0) == held
    if got is not None:
        assert got.state is (U if held % 2 else H)


def test_a_deleted_opinion_is_no_opinion_and_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    # (a deletion's event has no value: it was read as a garbled opinion and
    # logged as one, once for every key deleted)
    _, probing, _ = node(Clock())
    path = us_paths(probing)[0]
    probing.opinion_changed(event(path, U, 990.0, 11))
    with caplog.at_level(logging.INFO, logger="healthgate"):
        probing.opinion_changed(deleted(path, 12))
        probing.opinions_settled()
    assert path not in probing.opinions
    assert not [r for r in caplog.records if "ignoring the opinion" in r.getMessage()]
    # the same reason, read from many opinions, is one string
    probing.opinion_changed(event(path, H, 991.0, 13))
    other = us_paths(probing)[1]
    probing.opinion_changed(event(other, H, 991.0, 14))
    assert probing.opinions[path][US].reason is probing.opinions[other][US].reason


@pytest.mark.parametrize(("inserted", "at_once"), [(25_000, True), (25_000, False), (9_000, True)])
def test_the_ledgers_memories_keep_their_newest(inserted: int, at_once: bool) -> None:
    # (bounded by rebuilding in one pass: deleting the oldest one at a time
    # was quadratic, seconds on the event loop in a failover of 100,000)
    d: dict[int, None] = {}
    if at_once:
        d.update(dict.fromkeys(range(inserted)))
        bound_dict(d, 10_000)
    else:
        for i in range(inserted):
            d[i] = None
            bound_dict(d, 10_000)
    assert 7_500 <= len(d) <= 10_000 or len(d) == inserted
    assert list(d) == list(range(inserted - len(d), inserted))  # the newest, in order
    ledger = LeaderLedger(MemoryStore(), lambda: None)
    ledger.computed([record(f"x/endpoints/{i}", "U", float(i)) for i in range(inserted)])
    assert ledger.unwritten(0.0) == min(
        inserted, 10_000 * 3 // 4 if inserted > 10_000 else inserted
    )
