"""Upgrades of the etcd key layout: an unmarked store (the first layout)
is marked by the first node of the new version, once; a newer layout is
refused before anything is written - by the store, and by serve."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as stubs

from healthgate.fixtures.etcd_local import EtcdCluster
from healthgate.store.etcd import SCHEMA_VERSION, EtcdStore, SchemaError

pytestmark = pytest.mark.cluster
NS = b"/healthgate/"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path, 1)
    try:
        yield cluster
    finally:
        cluster.close()


def raw(etcd: EtcdCluster, key: bytes, value: bytes | None = None) -> bytes | None:
    with etcd.channel(etcd.endpoints[0]) as ch:
        kv = stubs.KVStub(ch)
        if value is not None:
            kv.Put(pb.PutRequest(key=NS + key, value=value), timeout=5)
        kvs = kv.Range(pb.RangeRequest(key=NS + key), timeout=5).kvs
        return bytes(kvs[0].value) if kvs else None


def test_an_unmarked_layout_is_marked_once(etcd: EtcdCluster) -> None:
    raw(etcd, b"r/resources/projects/shop/global/backendServices/x", b'{"v": {}, "c": 1, "u": 1}')
    store = EtcdStore(etcd.endpoints)
    assert store.open_schema() == 0  # (unmarked: the first layout)
    assert raw(etcd, b"m/schema") == str(SCHEMA_VERSION).encode()
    assert EtcdStore(etcd.endpoints).open_schema() == SCHEMA_VERSION  # (once)


def test_a_newer_layout_is_refused_by_the_store_and_by_serve(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    raw(etcd, b"m/schema", b"7")
    with pytest.raises(SchemaError, match="newer healthgate"):
        EtcdStore(etcd.endpoints).open_schema()
    done = subprocess.run(
        [sys.executable, "-m", "healthgate", "serve", "--store", etcd.url, "--node", "a",
         "--region", "us-east1", "--no-dataplane", "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "key layout 7; this one reads up to 2" in done.stderr
    assert raw(etcd, b"n/a") is None  # it never joined
