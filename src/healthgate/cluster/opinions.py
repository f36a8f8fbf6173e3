"""Opinions: what each vantage's prober says of an endpoint, in etcd.

``o/<endpoint path>/<vantage region>`` -> ``{"state", "since", "reason",
"node"}``, written by the node that probes the endpoint for that vantage
(health/placement.py) when its threshold machine flips - and read, through
one watch, by every node, which decides the endpoint by the vantage quorum
(cluster/probing.py).

**Read, never trusted**: :func:`parse_opinion` checks the key's shape and
every field (a known state, a finite time in range, a bounded reason, a
node name); anything else is skipped and logged once - a forged or
garbled opinion is no opinion.

**Written only under the session it was formed in**
(:class:`OpinionWriter`): each queued opinion carries the session epoch
it was formed under; it is dropped if the session has changed by the time
it is written, and the write itself compares this node's member key with
the session's lease inside its transaction - so an opinion formed before
a lost lease never reaches etcd, even if the lease expired while the
write was in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import dataclass
from typing import Any

from healthgate.cluster.session import Session
from healthgate.health.states import HealthState
from healthgate.model.names import is_valid_name, split_endpoint_path
from healthgate.store.base import StoreError, decode_json, sane_time
from healthgate.store.etcd_client import EtcdClient, GuardFailed, KeyValue

log = logging.getLogger("healthgate.cluster")

OPINIONS = "o/"
MAX_REASON = 1000  # characters of a reason kept from an opinion
# reasons repeat ("2 consecutive successful probes ...; last: HTTP 200 in 0
# ms"): one copy of each, among the last REASONS_KEPT distinct ones (a node
# holds an opinion of every endpoint)
REASONS_KEPT = 4096
_reasons: dict[str, str] = {}


def _one_copy(reason: str) -> str:
    kept = _reasons.get(reason)
    if kept is not None:
        return kept
    if len(_reasons) >= REASONS_KEPT:
        _reasons.clear()
    _reasons[reason] = reason
    return reason


@dataclass(frozen=True, slots=True)
class Opinion:
    state: HealthState
    since: float
    reason: str
    node: str
    revision: int = 0  # the etcd revision its key was written at (its mod revision)


def opinion_key(endpoint: str, vantage: str) -> str:
    return f"{OPINIONS}{endpoint}/{vantage}"


_logged: set[str] = set()


def _bad(key: str, why: str) -> None:
    if key not in _logged and len(_logged) < 10_000:
        _logged.add(key)
        log.warning("ignoring the opinion at %s: %s", key, why)


def split_opinion_key(key: str) -> tuple[str, str] | None:
    """(endpoint path, vantage region) of an opinion key; None if it is not one."""
    endpoint, _, vantage = key[len(OPINIONS) :].rpartition("/")
    if not key.startswith(OPINIONS) or not is_valid_name(vantage):
        return None
    bs, name = split_endpoint_path(endpoint)
    if not bs or not name:
        return None
    return endpoint, vantage


def parse_opinion(kv: KeyValue) -> tuple[str, str, Opinion | None]:
    """(endpoint, vantage, the opinion - None when it cannot be trusted)."""
    where = split_opinion_key(kv.key)
    if where is None:
        _bad(kv.key, "not an opinion key")
        return "", "", None
    endpoint, vantage = where
    try:
        d = decode_json(kv.value)
        if not isinstance(d, dict):
            raise ValueError("not an object")
        state = HealthState[str(d["state"])]
        node = str(d["node"])
        if not is_valid_name(node):
            raise ValueError(f"node {node[:70]!r} is not a node name")
        reason = d["reason"]
        if not isinstance(reason, str):
            raise ValueError("reason is not text")
        # (a node's and a region's name, one copy each: a node holds an
        # opinion of every endpoint, 100,000 of them and more)
        node, vantage = sys.intern(node), sys.intern(vantage)
        opinion = Opinion(
            state, sane_time(d["since"]), _one_copy(reason[:MAX_REASON]), node, kv.mod_revision
        )
        return endpoint, vantage, opinion
    except (ValueError, KeyError, TypeError) as exc:
        _bad(kv.key, str(exc))
        return endpoint, vantage, None


class OpinionWriter:
    """This node's opinions to etcd (see the module doc): coalesced - the
    last opinion of a key wins - and written in batches; while etcd cannot
    take them they wait (nothing is decided meanwhile: fail static)."""

    def __init__(self, client: EtcdClient, session: Session, member_key: str, node: str) -> None:
        self.client = client
        self.session = session
        self.member_key = member_key  # this node's, under the session's lease
        self.node = node
        self.writes = 0
        self.dropped = 0  # formed under a session that was lost before they were written
        self._outbox: dict[str, tuple[int, dict[str, Any]]] = {}
        self._wake = asyncio.Event()

    def say(self, path: str, vantage: str, state: HealthState, since: float, why: str) -> None:
        if not self.session.alive:
            return  # formed while the session is lost: never to be written
        value = {"state": state.name, "since": since, "reason": why, "node": self.node}
        self._outbox[opinion_key(path, vantage)] = (self.session.epoch, value)
        self._wake.set()

    @property
    def queued(self) -> dict[str, dict[str, Any]]:
        return {k: v for k, (_, v) in self._outbox.items()}

    def _drop(self, count: int, why: str) -> None:
        if count:
            self.dropped += count
            log.info("dropped %d opinions: %s", count, why)

    async def run(self) -> None:
        failing = False
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._outbox:
                batch, self._outbox = self._outbox, {}
                epoch = self.session.epoch
                fresh = {k: v for k, (e, v) in batch.items() if e == epoch}
                self._drop(len(batch) - len(fresh), "formed under an earlier session")
                if not fresh or not self.session.alive:
                    self._drop(len(fresh), "the session is lost")
                    continue
                items = [
                    (k, json.dumps(v, separators=(",", ":")).encode()) for k, v in fresh.items()
                ]
                guard = [self.client.under_lease(self.member_key, self.session.id)]
                try:
                    await asyncio.to_thread(self.client.put, items, 0, guard)
                    self.writes += len(fresh)
                    if failing:
                        log.info("etcd takes opinions again (%d written)", len(fresh))
                        failing = False
                except GuardFailed:
                    self._drop(len(fresh), "the session ended before they were written")
                except StoreError as exc:
                    if not failing:
                        log.warning("cannot write %d opinions (%s); retrying", len(fresh), exc)
                        failing = True
                    for k, v in fresh.items():  # (newer opinions of a key win)
                        self._outbox.setdefault(k, (epoch, v))
                    await asyncio.sleep(0.5)
