"""What a node reads from etcd is not trusted (SPEC §7 "etcd"): a value
that is not JSON under the resources prefix (which used to freeze every
node's mirror: the watch retried the same revision for ever and the next
write never answered), keys that are not UTF-8 (which used to kill the
follower tasks without a word), times that are NaN or absurd, forged
members and election candidates - each logged and skipped while the node
goes on answering writes and reads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as stubs

from healthgate.cluster.affinity_key import parse_keys, shared_affinity_keys
from healthgate.fixtures.etcd_local import EtcdCluster
from healthgate.store.base import StoreError
from healthgate.store.etcd_client import EtcdClient
from tests.cluster.test_etcd_security import WORLD, Node
from tests.integration.serve_proc import wait_for

pytestmark = pytest.mark.cluster

NS = b"/healthgate/"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdCluster, Node]]:
    tmp = tmp_path_factory.mktemp("etcd-values")
    etcd = EtcdCluster(tmp, 1)
    n = Node(tmp, etcd)
    try:
        n.wait_ready("the node")
        yield etcd, n
    finally:
        n.stop()
        etcd.close()


def put_raw(etcd: EtcdCluster, key: bytes, value: bytes) -> None:
    with etcd.channel(etcd.endpoints[0]) as ch:
        stubs.KVStub(ch).Put(pb.PutRequest(key=NS + key, value=value), timeout=5)


def still_answers(n: Node, name: str) -> None:
    """A write is answered (so the mirror moved past what was forged) and read back."""
    base = f"http://127.0.0.1:{n.port}"
    doc = {**WORLD[0], "name": name}
    r = httpx.post(f"{base}/v1/apply", json={"manifest": yaml.safe_dump_all([doc])}, timeout=15)
    assert r.status_code == 200, r.text
    got = httpx.get(f"{base}/v1/projects/shop/regions/us-east1/healthChecks/{name}", timeout=5)
    assert got.status_code == 200
    assert httpx.get(f"{base}/v1/cluster", timeout=5).json()["leading"]
    assert httpx.get(f"{base}/v1/projects/shop/events", timeout=5).status_code == 200


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        (b"r/resources/projects/shop/regions/us-east1/healthChecks/bad", b"not json", "skipping"),
        (b"r/resources/projects/shop/regions/us-east1/healthChecks/bad2", b"[1, 2]", "skipping"),
        (b"r/\xff\xfe", b"{}", "not UTF-8"),
        (b"o/\xff/us-east1", b"{}", "not UTF-8"),
        (b"n/\xc3\x28", b'{"region": "us-east1"}', "not UTF-8"),
        (
            b"o/projects/shop/regions/us-east1/backendServices/web/endpoints/10.0.0.1:80/us-east1",
            b'{"state": "UNHEALTHY", "since": NaN, "reason": "x", "node": "a"}',
            "ignoring the opinion",
        ),
        (b"n/evil", b'{"region": "../../etc"}', "ignoring the member key"),
        (b"e/decisions/dead", b"\xff\xff", "not a node name"),
        (b"l/00000000000000099999", b'{"time": 1e300, "kind": "Endpoint"}', "skipping the log key"),
        # nested deeper than any decoder goes: RecursionError used to escape
        # every handler, and the mirror retried that revision for ever
        (
            b"r/resources/projects/shop/regions/us-east1/healthChecks/deep",
            b"[" * 200_000 + b"]" * 200_000,
            "nested too deeply",
        ),
        (
            b"r/resources/projects/shop/regions/us-east1/healthChecks/deeper",
            b'{"v": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b', "c": 1e9, "u": 1e9}',
            "nested too deeply",
        ),
        (
            b"o/projects/shop/regions/us-east1/backendServices/web/endpoints/10.0.0.2:80/us-east1",
            b"[" * 100_000 + b"]" * 100_000,
            "nested too deeply",
        ),
        (b"l/00000000000000099998", b"[" * 100_000 + b"]" * 100_000, "skipping the log key"),
        (b"n/deep", b"[" * 100_000 + b"]" * 100_000, "ignoring the member key"),
    ],
)
def test_a_forged_or_garbled_key_is_skipped_and_the_node_goes_on(
    node: tuple[EtcdCluster, Node], key: bytes, value: bytes, says: str
) -> None:
    etcd, n = node
    put_raw(etcd, key, value)
    wait_for(lambda: says in n.log.read_text(), 10, what=f"the node saying {says!r}")
    still_answers(n, f"hc-{abs(hash(key)) % 100000}")
    assert "Traceback" not in n.log.read_text()


def test_the_node_log_is_not_read_back_with_a_forged_time(node: tuple[EtcdCluster, Node]) -> None:
    _, n = node
    events = httpx.get(f"http://127.0.0.1:{n.port}/v1/projects/shop/events", timeout=5)
    assert events.status_code == 200
    assert all(abs(e["time"]) < 1e12 for e in events.json()["items"])


def test_log_lines_name_the_key_not_the_whole_value(node: tuple[EtcdCluster, Node]) -> None:
    text = Path(node[1].log).read_text()
    assert "not json" not in text.replace("not JSON", "")  # (the value itself is not echoed)


def test_the_affinity_cookie_key_is_one_pair_for_every_node(
    node: tuple[EtcdCluster, Node],
) -> None:
    """SPEC §9: the node that started first wrote the pair; another asking
    gets the same one (so a cookie of one node verifies on every node); a
    forged value is refused by name, never used."""
    etcd, _n = node
    with etcd.channel(etcd.endpoints[0]) as ch:
        got = stubs.KVStub(ch).Range(pb.RangeRequest(key=NS + b"m/affinity-key"), timeout=5)
    assert got.kvs, "the first node wrote no affinity key"
    stored = parse_keys(bytes(got.kvs[0].value))
    assert len(stored) == 1 and len(stored[0]) == 32
    client = EtcdClient(etcd.endpoints)
    try:
        assert shared_affinity_keys(client) == stored  # (asked again: the same pair)
        put_raw(etcd, b"m/affinity-key", b"zz" * 40)
        with pytest.raises(StoreError, match="m/affinity-key"):
            shared_affinity_keys(client)
        put_raw(etcd, b"m/affinity-key", got.kvs[0].value)
    finally:
        client.close()
    for bad in (b"", b"00" * 31, b"\n".join([b"00" * 32] * 3), b"x" * 1000):
        with pytest.raises(ValueError):
            parse_keys(bad)
