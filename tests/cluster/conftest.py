"""Shared fixtures of the cluster tests: ``etcd``, one real etcd member for
a module (a module may define its own instead), and ``client``, a client
of it on a namespace named after the test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from healthgate.fixtures.etcd_local import EtcdCluster
from healthgate.store.etcd import EtcdStore
from healthgate.store.etcd_client import EtcdClient


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One etcd member for the whole module."""
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"), 1)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture()
def client(etcd: EtcdCluster, request: pytest.FixtureRequest) -> Iterator[EtcdClient]:
    """A client of that member, on a namespace named after the test."""
    store = EtcdStore(etcd.endpoints, namespace=f"/{request.node.name[:40]}/")
    try:
        yield store.client
    finally:
        store.close()
