"""etcd with TLS client certificates, and with etcd's own users and roles
(SPEC §7 "etcd"), for real: Debian's etcd started as docs/cluster.md says,
a healthgate node on it, and the clients that must be refused."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
import yaml

from healthgate.fixtures.etcd_local import EtcdCluster, TlsFiles
from healthgate.store.base import StoreError
from healthgate.store.etcd import EtcdStore
from healthgate.store.etcd_client import EtcdAuth, EtcdClient, EtcdTls
from tests.integration.serve_proc import wait_for, wait_ready
from tests.integration.servers import free_port

pytestmark = pytest.mark.cluster

WORLD = [
    {
        "kind": "HealthCheck",
        "project": "shop",
        "region": "us-east1",
        "name": "hc",
        "type": "TCP",
        "port": 8080,
    }
]


def tls_files(tmp: Path) -> TlsFiles:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    client = ca.issue_cert("healthgate-node", common_name="healthgate-node")
    files = TlsFiles(
        tmp / "ca.pem", tmp / "server.pem", tmp / "server.key", tmp / "node.pem", tmp / "node.key"
    )
    ca.cert_pem.write_to_path(str(files.ca))
    server.cert_chain_pems[0].write_to_path(str(files.server_cert))
    server.private_key_pem.write_to_path(str(files.server_key))
    client.cert_chain_pems[0].write_to_path(str(files.client_cert))
    client.private_key_pem.write_to_path(str(files.client_key))
    return files


class Node:
    """One healthgate node over the given etcd, with extra options."""

    def __init__(self, tmp: Path, etcd: EtcdCluster, *options: str) -> None:
        self.port = free_port()
        self.log = tmp / f"node-{self.port}.log"
        manifest = tmp / "world.yaml"
        manifest.write_text(yaml.safe_dump_all(WORLD))
        cmd = [
            sys.executable, "-m", "healthgate", "serve", "--store", etcd.url,
            "--node", "a", "--region", "us-east1", "--lease-ttl", "2",
            "--listen", f"127.0.0.1:{self.port}", "-f", str(manifest), *options,
        ]  # fmt: skip
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, what: str) -> None:
        url = f"http://127.0.0.1:{self.port}"
        wait_ready(self.proc, url, what, lambda: self.log.read_text()[-3000:])

    def cluster(self) -> dict[str, object]:
        import httpx

        body: dict[str, object] = httpx.get(
            f"http://127.0.0.1:{self.port}/v1/cluster", timeout=5
        ).json()
        return body

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdCluster, TlsFiles]]:
    tmp = tmp_path_factory.mktemp("etcd-tls")
    files = tls_files(tmp)
    cluster = EtcdCluster(tmp, 1, tls=files)
    yield cluster, files
    cluster.close()


def test_a_node_runs_over_tls_with_a_client_certificate(
    secure: tuple[EtcdCluster, TlsFiles], tmp_path: Path
) -> None:
    etcd, files = secure
    node = Node(
        tmp_path,
        etcd,
        "--etcd-cacert", str(files.ca),
        "--etcd-cert", str(files.client_cert),
        "--etcd-key", str(files.client_key),
    )  # fmt: skip
    try:
        node.wait_ready("the node (over TLS)")
        wait_for(lambda: node.cluster()["leading"], 10, what="the node leading")
    finally:
        node.stop()


@pytest.mark.parametrize(
    "how", ["plaintext", "no client certificate", "a certificate of another CA"]
)
def test_clients_without_the_right_certificate_are_refused(
    secure: tuple[EtcdCluster, TlsFiles], tmp_path: Path, how: str
) -> None:
    etcd, files = secure
    tls: EtcdTls | None = None
    if how == "no client certificate":
        tls = EtcdTls(str(files.ca))
    elif how == "a certificate of another CA":
        other = tls_files(tmp_path)
        tls = EtcdTls(str(files.ca), str(other.client_cert), str(other.client_key))
    store = EtcdStore(etcd.endpoints, tls=tls)
    try:
        with pytest.raises(StoreError):
            store.client.list_prefix("r/")
    finally:
        store.close()


@pytest.fixture(scope="module")
def with_users(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd-auth"), 1)
    cluster.enable_auth("healthgate", "s3cret-pass")
    yield cluster
    cluster.close()


def password_file(tmp: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp / "etcd-password"
    path.write_text(text + "\n")
    os.chmod(path, mode)
    return path


def test_a_node_runs_as_an_etcd_user_whose_role_is_its_prefix(
    with_users: EtcdCluster, tmp_path: Path
) -> None:
    secret = password_file(tmp_path, "s3cret-pass", 0o644)  # (readable: warned about)
    node = Node(
        tmp_path, with_users, "--etcd-user", "healthgate", "--etcd-password-file", str(secret)
    )
    try:
        node.wait_ready("the node (as an etcd user)")
        wait_for(lambda: node.cluster()["leading"], 10, what="the node leading")
    finally:
        node.stop()
    text = node.log.read_text()
    assert "is readable by everyone (mode 644): chmod 600 it" in text
    assert "s3cret-pass" not in text  # (the warning names the file, never the value)


def test_the_user_reaches_nothing_outside_its_prefix_and_a_wrong_password_is_refused(
    with_users: EtcdCluster, tmp_path: Path
) -> None:
    outside = EtcdClient(
        with_users.endpoints, "/elsewhere", auth=EtcdAuth("healthgate", "s3cret-pass")
    )
    try:
        with pytest.raises(StoreError, match="its role needs read and write"):
            outside.list_prefix("x/")
    finally:
        outside.close()
    anonymous = EtcdClient(with_users.endpoints)
    try:
        with pytest.raises(StoreError):
            anonymous.list_prefix("r/")  # (auth is on: no user, no key)
    finally:
        anonymous.close()
    wrong = password_file(tmp_path, "not-the-password")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "healthgate",
            "serve",
            "--store",
            with_users.url,
            "--node",
            "z",
            "--region",
            "us-east1",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--etcd-user",
            "healthgate",
            "--etcd-password-file",
            str(wrong),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert "etcd refused user 'healthgate'" in proc.stderr, proc.stderr
    assert "not-the-password" not in proc.stderr
