"""Large answers from etcd (store/etcd_client.py), against a real member.

gRPC takes at most 4 MiB per answer unless told otherwise. A node used to
ask for a whole prefix in one range (the world, the opinions, the saved
states: a world of 100,000 endpoints is more than that), which failed as
"unavailable" - a node could not start again in a large world - and a
watch catching up after a burst of writes got an answer over the limit,
broke, resumed at the same revision and broke again, for ever: the node
saw nothing more (found with bench/cluster.py: three nodes of four
stopped deciding at about 55,000 of 100,000 endpoints). Now ranges come in
pages at one revision, watch answers in fragments, and the client takes
answers up to RECEIVE_LIMIT; and a watch that keeps breaking at one
revision is warned of."""

from __future__ import annotations

import asyncio
import logging

import pytest

from healthgate.fixtures.etcd_local import EtcdCluster
from healthgate.store import etcd_client
from healthgate.store.etcd import EtcdStore
from healthgate.store.etcd_client import PAGE, RECEIVE_LIMIT, EtcdClient
from tests.helpers import run_async

pytestmark = pytest.mark.cluster

WRITES, KEYS, SIZE = 160, 100, 400  # 6.4 MB: more than gRPC's 4 MiB default


def write(client: EtcdClient, prefix: str, writes: int = WRITES) -> tuple[int, int]:
    """``writes`` revisions of KEYS keys each: (the revision before, the last)."""
    before = int(client.range(client.key("m/none")).header.revision)
    last = 0
    for w in range(writes):
        last = client.put([(f"{prefix}{w:04}-{k:03}", b"x" * SIZE) for k in range(KEYS)])
    return before, last


def test_a_prefix_larger_than_one_answer_is_listed_whole_at_one_revision(
    client: EtcdClient,
) -> None:
    _, last = write(client, "o/")
    revision, kvs = client.list_prefix("o/")
    assert len(kvs) == WRITES * KEYS > PAGE
    assert revision == last
    assert [kv.key for kv in kvs] == sorted(kv.key for kv in kvs)
    assert len({kv.key for kv in kvs}) == len(kvs)


def test_a_page_larger_than_the_client_takes_is_read_in_smaller_pages(
    client: EtcdClient,
) -> None:
    big = 1 << 20  # (etcd takes a request of up to 1.5 MiB)
    count = RECEIVE_LIMIT // big + 4  # one page of them is more than the client takes
    for i in range(count):
        client.put([(f"big/{i:03}", bytes([65 + i % 26]) * big)])
    revision, kvs = client.list_prefix("big/")
    assert len(kvs) == count and revision > 0
    assert all(len(kv.value) == big for kv in kvs)


def test_a_watch_catches_up_through_a_burst_larger_than_one_answer(client: EtcdClient) -> None:
    before, last = write(client, "w/")

    async def follow() -> int:
        got = 0
        async with asyncio.timeout(60):
            async for batch in client.watch_prefix("w/", before + 1):
                assert len({ev.revision for ev in batch}) == 1  # (one revision per batch)
                got += len(batch)
                if batch[-1].revision >= last:
                    return got
        return got

    assert run_async(follow(), timeout=90) == WRITES * KEYS


def test_a_watch_that_keeps_breaking_at_one_revision_is_warned_of(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A watch that cannot get past a revision (here: a client that takes
    at most 16 KiB, and a revision of 40 KB) says so at WARNING, naming the
    prefix and the revision - it used to say it once at INFO, then nothing."""
    monkeypatch.setattr(
        etcd_client, "CHANNEL_OPTIONS", [("grpc.max_receive_message_length", 16 << 10)]
    )
    store = EtcdStore(etcd.endpoints, namespace="/stuck/")
    try:
        client = store.client
        before, last = write(client, "s/", writes=1)  # 100 keys of 400 B, one revision
        wanted = f"has broken {etcd_client.STUCK_AFTER} times in a row at revision {last}"

        async def follow() -> None:
            async for _batch in client.watch_prefix("s/", before + 1):
                raise AssertionError("the revision was larger than the client takes")

        stuck: list[tuple[int, int]] = []  # (breaks, stuck) when warned, and after

        async def until_warned() -> None:
            task = asyncio.create_task(follow())
            try:
                async with asyncio.timeout(30):
                    while not any(wanted in r.getMessage() for r in caplog.records):
                        await asyncio.sleep(0.1)
                stuck.append((client.watch_breaks, client.watches_stuck))
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            stuck.append((client.watch_breaks, client.watches_stuck))

        with caplog.at_level(logging.INFO, logger="healthgate"):
            run_async(until_warned(), timeout=60)
        warned = [r for r in caplog.records if wanted in r.getMessage()]
        assert warned[0].levelno == logging.WARNING and "s/" in warned[0].getMessage()
        # counted for the metrics while stuck; a watch that ends is not stuck
        (breaks, now_stuck), (_, after) = stuck
        assert breaks >= etcd_client.STUCK_AFTER and now_stuck == 1 and after == 0
    finally:
        store.close()
