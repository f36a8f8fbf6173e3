"""A node's session (cluster/session.py) against a real etcd member: long
synchronous work that beats keeps it, a loop stuck as long without beating
loses it - at its deadline, and etcd lets the lease go."""

from __future__ import annotations

import asyncio
import time

import pytest

from healthgate.cluster.session import Session
from healthgate.store.etcd_client import EtcdClient
from tests.helpers import run_async

pytestmark = pytest.mark.cluster

TTL = 2


def busy(seconds: float, beat: Session | None) -> None:
    """The event loop held (a placement of a large world), beating or not."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)
        if beat is not None:
            beat.beat()


@pytest.mark.parametrize("beating", [True, False])
def test_long_work_that_beats_keeps_the_session(client: EtcdClient, beating: bool) -> None:
    async def go() -> tuple[bool, int, int]:
        session = Session(client, TTL)
        await session.open()
        lease = session.id
        busy(TTL * 2.5, session if beating else None)  # longer than the lease
        await asyncio.sleep(0)  # (the loop runs what came due meanwhile: the deadline)
        await asyncio.sleep(0.05)
        alive, beats = session.alive, session.beats
        await session.close(revoke=False)
        left = client.keep_alive_once(lease, 1.0)  # etcd's word on the lease
        client.revoke(lease)
        return alive, beats, left

    alive, beats, left = run_async(go(), timeout=30)
    if beating:
        assert alive and beats >= 3 and left > 0
    else:
        assert not alive and beats == 0 and left <= 0
