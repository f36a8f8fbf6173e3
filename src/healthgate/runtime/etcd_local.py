"""A throw-away etcd cluster on loopback: ``healthgate demo --cluster``, the
cluster tests and bench/cluster.py (Debian's etcd-server).

``EtcdCluster(tmp, n)`` starts ``n`` members of one cluster, each with its own
data directory and two free loopback ports, waits until the cluster answers
a write, and stops them all on ``close``. Members can be killed, frozen
(SIGSTOP) and brought back, for the cluster-mode scenarios. Never for
production: the members are tuned for loopback (50 ms heartbeats).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import grpc
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as stubs

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
MISSING = "etcd is not installed: apt-get install etcd-server (Debian's package)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Member:
    def __init__(
        self, name: str, data: Path, client: int, peer: int, extra: tuple[str, ...] = ()
    ) -> None:
        self.name, self.data, self.client, self.peer = name, data, client, peer
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data.with_suffix(".log")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client}"

    def start(self, initial_cluster: str, state: str = "new") -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        cmd = [
            ETCD,
            "--name", self.name,
            "--data-dir", str(self.data),
            "--listen-client-urls", f"http://127.0.0.1:{self.client}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.client}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer}",
            "--initial-cluster", initial_cluster,
            "--initial-cluster-state", state,
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--logger", "zap",
            "--log-outputs", str(self.log),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


class EtcdCluster:
    def __init__(self, tmp: Path, size: int = 1, extra: tuple[str, ...] = ()) -> None:
        if not Path(ETCD).exists():
            raise FileNotFoundError(MISSING)
        self.members = [
            Member(f"m{i}", tmp / f"etcd-m{i}", free_port(), free_port(), extra)
            for i in range(size)
        ]
        self.initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer}" for m in self.members)
        for m in self.members:
            m.start(self.initial)
        self.wait_ready()

    @property
    def endpoints(self) -> list[str]:
        return [m.address for m in self.members]

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(self.endpoints)

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Until a write through some member commits (the cluster has a leader)."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            for m in self.members:
                if m.proc is None:
                    continue
                with grpc.insecure_channel(m.address) as ch:
                    try:
                        stubs.KVStub(ch).Put(pb.PutRequest(key=b"/ready", value=b"1"), timeout=1)
                        return
                    except grpc.RpcError as exc:
                        last = exc
            time.sleep(0.1)
        raise RuntimeError(f"etcd did not become ready in {timeout}s: {last}")

    def leader(self) -> Member:
        for m in self.members:
            if m.proc is None:
                continue
            with grpc.insecure_channel(m.address) as ch:
                status = stubs.MaintenanceStub(ch).Status(pb.StatusRequest(), timeout=2)
                if status.leader == status.header.member_id:
                    return m
        raise RuntimeError("no etcd leader")

    def restart(self, member: Member) -> None:
        member.start(self.initial, state="existing")

    def close(self) -> None:
        for m in self.members:
            with contextlib.suppress(Exception):
                if m.proc is not None:
                    os.kill(m.proc.pid, signal.SIGCONT)
            m.kill()
