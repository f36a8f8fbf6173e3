"""The store contract (store/base.py), one suite for every store.

Each test takes ``store``, made by every factory in ``STORES``; a new store
(a clustered one) joins by adding its factory there and must pass all of it.
Revisions are opaque increasing numbers: a store may start above 0 (an etcd
namespace starts at the cluster's revision), so the tests count from
``store.revision()`` at the start.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from healthgate.fixtures.etcd_local import EtcdCluster
from healthgate.store.base import (
    EXISTS,
    Change,
    Compacted,
    LogQuery,
    PreconditionFailed,
    RevisionMoved,
    Store,
    Txn,
)
from healthgate.store.etcd import EtcdStore
from healthgate.store.memory import MemoryStore
from healthgate.store.sqlite import SqliteStore, StoreLocked
from tests.helpers import run_async

Factory = Callable[[Path, int], Store]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"), 1)
    yield cluster
    cluster.close()


STORES: dict[str, Factory] = {
    "memory": lambda _tmp, history: MemoryStore(history=history),
    "sqlite": lambda tmp, history: SqliteStore(tmp / "store.db", history=history),
}
ETCD_STORE = "etcd"


@pytest.fixture(params=[*sorted(STORES), ETCD_STORE])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Store]]:
    made: list[Store] = []

    def factory(history: int = 10_000) -> Store:
        if request.param == ETCD_STORE:
            cluster = request.getfixturevalue("etcd")
            namespace = f"/contract/{uuid.uuid4().hex}"
            store: Store = EtcdStore(cluster.endpoints, namespace, history=history)
        else:
            store = STORES[request.param](tmp_path, history)
        made.append(store)
        return store

    yield factory
    for s in made:
        s.close()


@pytest.fixture
def store(make: Callable[..., Store]) -> Store:
    return make()


def put(store: Store, key: str, value: Any = None, **kw: Any) -> int:
    return store.commit(Txn(puts={key: {"v": value if value is not None else key}}, **kw))


# ---------------------------------------------------------------------- revisions


def test_every_commit_moves_the_revision_on_by_one_and_fingerprints_documents(
    store: Store,
) -> None:
    z = store.revision()
    r1 = put(store, "resources/a")
    r2 = store.commit(Txn(puts={"resources/b": {"v": 1}, "resources/c": {"v": 2}}))
    assert (r1, r2) == (z + 1, z + 2)
    assert store.revision() == z + 2
    a, b = store.get("resources/a"), store.get("resources/b")
    assert a is not None and b is not None
    assert (a.revision, b.revision) == (z + 1, z + 2)
    assert b.value == {"v": 1}
    assert store.get("resources/missing") is None


def test_update_keeps_created_and_moves_updated(store: Store) -> None:
    put(store, "k", 1)
    first = store.get("k")
    put(store, "k", 2)
    second = store.get("k")
    assert first is not None and second is not None
    assert second.created == first.created
    assert second.revision == first.revision + 1 and second.value == {"v": 2}


def test_snapshot_is_every_document_under_a_prefix_with_its_revision(store: Store) -> None:
    z = store.revision()
    put(store, "resources/b")
    put(store, "resources/a")
    put(store, "other/x")
    snap = store.snapshot("resources/")
    assert snap.revision == z + 3
    assert [d.key for d in snap.documents] == ["resources/a", "resources/b"]


def test_delete_removes_and_counts_as_a_change(store: Store) -> None:
    z = put(store, "a") - 1
    rev = store.commit(Txn(deletes=["a"]))
    assert store.get("a") is None
    assert rev == z + 2
    changes = store.changes_since(z + 1)
    assert changes == [Change(z + 2, "a", None, changes[0].time)]


def test_a_delete_is_timed_by_its_commit_not_by_its_reader(store: Store) -> None:
    """A delete has no document, hence no stored time: the store stamps it
    with its commit's, so that every node that reads it (later, from its
    watch) times what it causes alike (etcd: the r/commit key)."""
    z = put(store, "a") - 1
    before = time.time()
    store.commit(Txn(deletes=["a"]))
    after = time.time()
    time.sleep(0.3)  # (the reader comes later: its clock would say so)
    (change,) = store.changes_since(z + 1)
    assert change.value is None and before - 0.05 <= change.time <= after + 0.05

    async def watched() -> float:
        async for batch in store.watch(z + 1):
            return batch[0].time
        raise AssertionError("no batch")

    assert abs(run_async(watched(), timeout=10) - change.time) < 1e-6


def test_a_transaction_that_changes_nothing_makes_no_revision(store: Store) -> None:
    z = put(store, "a") - 1
    assert store.commit(Txn()) == z + 1
    assert store.commit(Txn(deletes=["missing"])) == z + 1
    assert store.revision() == z + 1 and store.changes_since(z + 1) == []
    assert store.commit(Txn(deletes=["a", "missing"])) == z + 2


# ---------------------------------------------------------------------- preconditions


@pytest.mark.parametrize(
    ("expect", "ok"),
    [
        (None, False),  # create-only, but it exists
        (EXISTS, True),
        (1, True),  # the fingerprint is current
        (7, False),  # a stale fingerprint
    ],
)
def test_expectations_on_an_existing_document(store: Store, expect: int | None, ok: bool) -> None:
    z = put(store, "a") - 1
    if expect is not None and expect > 0:
        expect += z  # a revision counted from the store's start
    txn = Txn(puts={"a": {"v": "new"}, "b": {"v": "b"}}, expect={"a": expect})
    if ok:
        assert store.commit(txn) == z + 2
    else:
        with pytest.raises(PreconditionFailed) as info:
            store.commit(txn)
        assert info.value.key == "a" and info.value.actual == z + 1
        assert store.revision() == z + 1  # nothing written: not a, not b
        assert store.get("b") is None
        doc = store.get("a")
        assert doc is not None and doc.value == {"v": "a"}


@pytest.mark.parametrize(("expect", "ok"), [(None, True), (EXISTS, False), (1, False)])
def test_expectations_on_a_missing_document(store: Store, expect: int | None, ok: bool) -> None:
    z = store.revision()
    if expect is not None and expect > 0:
        expect += z
    txn = Txn(puts={"a": {"v": 1}}, expect={"a": expect})
    if ok:
        store.commit(txn)
    else:
        with pytest.raises(PreconditionFailed):
            store.commit(txn)
        assert store.revision() == z


def test_a_write_planned_at_an_old_revision_is_refused_whole(store: Store) -> None:
    z = put(store, "a") - 1
    base = store.revision()
    put(store, "b")  # another writer, after the plan
    with pytest.raises(RevisionMoved) as info:
        store.commit(Txn(puts={"c": {"v": 1}}, deletes=["a"], base_revision=base))
    assert (info.value.base, info.value.actual) == (z + 1, z + 2)
    assert store.get("a") is not None and store.get("c") is None
    assert store.commit(Txn(puts={"c": {"v": 1}}, base_revision=z + 2)) == z + 3


# ---------------------------------------------------------------------- history and watch


def test_changes_since_gives_whole_transactions_in_order(store: Store) -> None:
    z = store.revision()
    store.commit(Txn(puts={"a": {"v": 1}, "b": {"v": 2}}))
    store.commit(Txn(deletes=["a"], puts={"c": {"v": 3}}))
    changes = store.changes_since(z)
    assert sorted((c.revision - z, c.key, c.value is None) for c in changes) == [
        (1, "a", False),
        (1, "b", False),
        (2, "a", True),
        (2, "c", False),
    ]
    assert changes[0].value == {"v": 1} and [c.revision - z for c in changes] == [1, 1, 2, 2]
    assert [c.revision - z for c in store.changes_since(z + 1)] == [2, 2]
    assert store.changes_since(z + 2) == []
    assert [c.revision - z for c in store.changes_since(z, limit=1)] == [1, 1]


def test_history_is_compacted_and_an_old_watch_is_told(make: Callable[..., Store]) -> None:
    store = make(history=3)
    z = store.revision()
    for i in range(6):
        put(store, f"k{i}")
    assert [c.revision - z for c in store.changes_since(z + 3)] == [4, 5, 6]
    with pytest.raises(Compacted) as info:
        store.changes_since(z + 2)
    assert info.value.oldest == z + 4

    async def first_item() -> None:
        with pytest.raises(Compacted):
            await anext(aiter(store.watch(z + 1)))

    run_async(first_item(), timeout=10)


def test_watch_replays_from_a_revision_then_follows_live_commits(store: Store) -> None:
    z = put(store, "a") - 1
    put(store, "b")

    async def scenario() -> list[list[tuple[int, str]]]:
        seen: list[list[tuple[int, str]]] = []
        got_two = asyncio.Event()

        async def follow() -> None:
            async for batch in store.watch(z + 1):
                seen.append([(c.revision - z, c.key) for c in batch])
                if len(seen) == 2:
                    got_two.set()
                if len(seen) == 4:
                    return

        task = asyncio.create_task(follow())
        # commit from another thread, as the control plane does
        await asyncio.to_thread(put, store, "c")
        await asyncio.wait_for(got_two.wait(), 5)
        await asyncio.to_thread(
            store.commit, Txn(puts={"d": {"v": 1}, "e": {"v": 2}}, deletes=["a"])
        )
        await asyncio.to_thread(put, store, "f")
        await asyncio.wait_for(task, 5)
        return seen

    seen = run_async(scenario(), timeout=10)
    assert seen[0] == [(2, "b")]
    assert seen[1] == [(3, "c")]
    assert sorted(seen[2]) == [(4, "a"), (4, "d"), (4, "e")]
    assert seen[3] == [(5, "f")]


def test_two_watchers_see_the_same_changes(store: Store) -> None:
    z = store.revision()

    async def scenario() -> tuple[list[int], list[int]]:
        async def collect(n: int) -> list[int]:
            out: list[int] = []
            async for batch in store.watch(z):
                out.append(batch[0].revision - z)
                if len(out) == n:
                    return out
            return out

        one = asyncio.create_task(collect(3))
        two = asyncio.create_task(collect(3))
        for key in "xyz":
            await asyncio.to_thread(put, store, key)
        return await asyncio.wait_for(one, 5), await asyncio.wait_for(two, 5)

    assert run_async(scenario(), timeout=10) == ([1, 2, 3], [1, 2, 3])


# ---------------------------------------------------------------------- states


def test_states_upsert_and_delete_by_key_or_prefix(store: Store) -> None:
    store.save_states({"endpoint/a/1": {"s": 1}, "endpoint/a/2": {"s": 2}, "node/b": {"s": 3}})
    store.save_states({"endpoint/a/1": {"s": 9}}, deletes=["endpoint/a/2"])
    assert store.load_states() == {"endpoint/a/1": {"s": 9}, "node/b": {"s": 3}}
    store.save_states({}, deletes=["endpoint/"])
    assert store.load_states() == {"node/b": {"s": 3}}


def test_a_state_delete_takes_its_own_key_only_and_a_put_beside_it_stays(store: Store) -> None:
    """A removed resource's state goes, never the state of another whose
    name it begins (web, web-2; :80, :8080); deleted and put in one batch
    (removed and added again before the writer ran), a state is kept."""
    store.save_states(
        {"node/p/web": {"s": 1}, "node/p/web-2": {"s": 2}, "endpoint/e/h:80": {"s": 3},
         "endpoint/e/h:8080": {"s": 4}, "route/r": {"s": 5}}
    )  # fmt: skip
    store.save_states({"route/r": {"s": 6}}, deletes=["node/p/web", "endpoint/e/h:80", "route/r"])
    assert store.load_states() == {
        "node/p/web-2": {"s": 2}, "endpoint/e/h:8080": {"s": 4}, "route/r": {"s": 6}
    }  # fmt: skip
    # a prefix over a key put beside it, a key under it, a delete twice
    store.save_states(
        {"endpoint/e/h:9": {"s": 7}},
        deletes=["endpoint/e/", "endpoint/e/h:8080", "route/r", "route/r"],
    )
    assert store.load_states() == {"node/p/web-2": {"s": 2}, "endpoint/e/h:9": {"s": 7}}


# ---------------------------------------------------------------------- the log


def record(project: str, kind: str, path: str, to: str, t: float) -> dict[str, Any]:
    return {"time": t, "project": project, "kind": kind, "path": path, "to": to, "from": "x"}


def test_an_append_of_unknown_outcome_is_found_by_its_write_ids(store: Store) -> None:
    """A writer whose append timed out asks which of its records the log
    holds (``written``) instead of appending them again; readers never see
    the write ids."""
    a = {**record("shop", "Route", "projects/shop/global/forwardingRules/f", "x", 1), "_w": "w-1"}
    b = {**record("shop", "Route", "projects/shop/global/forwardingRules/f", "y", 2), "_w": "w-2"}
    ids = store.append_log([a, b])
    store.append_log([record("shop", "Route", "projects/shop/global/forwardingRules/g", "z", 3)])
    assert store.written(["w-1", "w-2", "w-3"]) == {"w-1": ids[0], "w-2": ids[1]}
    assert all("_w" not in e.record for e in store.query_log(LogQuery()))


def test_log_ids_increase_and_queries_filter(store: Store) -> None:
    ids = store.append_log(
        [
            record("shop", "HealthSource", "projects/shop/regions/r/healthSources/s", "HEALTHY", 1),
            record("shop", "Endpoint", "projects/shop/regions/r/backendServices/b/x", "DOWN", 2),
            record("web", "NetworkEndpointGroup", "projects/web/regions/r/neg/n", "HEALTHY", 3),
        ]
    )
    assert ids == sorted(ids) and len(set(ids)) == 3
    assert store.last_log_id() == ids[-1]

    def q(**kw: Any) -> list[int]:
        return [e.id for e in store.query_log(LogQuery(**kw))]

    assert q(project="shop") == ids[:2]
    assert q(project="shop", kind="Endpoint") == [ids[1]]
    assert q(project="shop", kinds=("HealthSource",)) == [ids[0]]
    assert q(project="shop", state="HEALTHY") == [ids[0]]
    assert q(project="shop", path_prefix="projects/shop/regions/r/backendServices/") == [ids[1]]
    assert q(since=2, until=3) == [ids[1]]
    assert q(after_id=ids[0]) == ids[1:]
    assert q(limit=1) == ids[:1]
    assert store.query_log(LogQuery(project="web"))[0].record["kind"] == "NetworkEndpointGroup"


def test_log_trim_keeps_the_newest(store: Store) -> None:
    ids = store.append_log([record("p", "Endpoint", f"x{i}", "HEALTHY", i) for i in range(10)])
    assert store.trim_log(3) == 7
    assert [e.id for e in store.query_log(LogQuery())] == ids[-3:]
    assert store.last_log_id() == ids[-1]


# ---------------------------------------------------------------------- SQLite only


def test_sqlite_survives_a_reopen_with_its_revision_and_history(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    s = SqliteStore(path)
    put(s, "a")
    put(s, "b")
    s.close()
    s = SqliteStore(path)
    try:
        assert s.revision() == 2
        assert [c.key for c in s.changes_since(0)] == ["a", "b"]
    finally:
        s.close()


def test_sqlite_refuses_a_second_process_on_the_same_database(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    first = SqliteStore(path)
    try:
        with pytest.raises(StoreLocked) as info:
            SqliteStore(path)
        assert str(path) in str(info.value) and "in use by process" in str(info.value)
    finally:
        first.close()
    SqliteStore(path).close()  # released on close


def test_sqlite_says_which_file_is_not_a_database(tmp_path: Path) -> None:
    from healthgate.store.base import StoreError

    path = tmp_path / "corrupt.db"
    path.write_bytes(b"this is not SQLite" * 100)
    with pytest.raises(StoreError) as info:
        SqliteStore(path)
    message = str(info.value)
    assert str(path) in message and "not a readable healthgate database" in message
    assert "\n" not in message
    SqliteStore(tmp_path / "fine.db").close()  # (the lock of the failed one is released)
    with pytest.raises(StoreError):
        SqliteStore(path)


def test_a_full_disk_refuses_the_write_and_loses_nothing(tmp_path: Path) -> None:
    """SQLite's max_page_count stands in for a full disk."""
    from healthgate.store.base import Unavailable

    s = SqliteStore(tmp_path / "full.db")
    try:
        put(s, "kept", "acknowledged")
        s._db.execute(
            "PRAGMA max_page_count = " + str(s._db.execute("PRAGMA page_count").fetchone()[0] + 2)
        )
        with pytest.raises(Unavailable) as info:
            for i in range(200):
                s.commit(Txn(puts={f"big{i}": {"v": "x" * 20_000}}))
        assert str(tmp_path / "full.db") in str(info.value) and "full" in str(info.value)
        doc = s.get("kept")
        assert doc is not None and doc.value == {"v": "acknowledged"}
        rev = s.revision()
        assert [c.revision for c in s.changes_since(rev - 1)] == [rev]  # no half transaction
    finally:
        s.close()


def test_etcd_names_the_limit_an_oversized_write_meets(etcd: EtcdCluster) -> None:
    from healthgate.store.base import TooLarge

    store = EtcdStore(etcd.endpoints, f"/contract/{uuid.uuid4().hex}")
    try:
        small = store.commit(Txn(puts={f"k{i}": {"v": i} for i in range(100)}))
        with pytest.raises(TooLarge, match="--max-txn-ops"):
            store.commit(Txn(puts={f"big{i}": {"v": i} for i in range(300)}))
        assert store.revision() == small and store.get("big0") is None  # nothing written
    finally:
        store.close()
