"""Shared fixtures of the cluster tests: ``etcd``, one real etcd member for
a module (a module may define its own instead), and ``client``, a client
of it on a namespace named after the test; and, for a test on a cluster
stack that fails, every node's route and the tail of its log in the
report (a failure seen once in CI must say what the nodes were doing)."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import pytest

from healthgate.fixtures.etcd_local import EtcdCluster
from healthgate.store.etcd import EtcdStore
from healthgate.store.etcd_client import EtcdClient
from tests.cluster.stack import ClusterStack


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call" and report.failed:
        funcargs: dict[str, Any] = getattr(item, "funcargs", {})
        stack = next((v for v in funcargs.values() if isinstance(v, ClusterStack)), None)
        if stack is not None:
            report.sections.append(("the cluster's nodes at the failure", stack.post_mortem()))
    return report
