"""TRAFFIC health sources in a cluster (SPEC §8): each node judges the real
traffic its own listeners carried; the source follows a quorum of the
nodes that carried enough of it.

``t/<source path>/<node>`` -> ``{"state", "judged", "requests", "errors",
"reason", "since", "node"}``: a node's verdict (health/traffic.py), written
only when it flips - its state, or whether its window held enough traffic
to judge - never per request or per second (at steady state: no write at
all). The key lives under the node's session lease: a node that dies or
is cut off takes its verdicts with it, and writes them again when it joins
again. Every node follows the prefix through one watch and decides each
source by :func:`~healthgate.health.traffic.quorum`: UNHEALTHY when more
than half of the nodes that carried enough traffic say so - so one node
whose own network to a region is broken sees every request fail there and
still does not fail that region over while the others' traffic succeeds.

**Read, never trusted**: a value that is not a well-formed verdict (a known
state, a bounded reason, counts that are whole numbers, the node's name
matching the key) is skipped and logged once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from healthgate.cluster.session import Session
from healthgate.controlplane.probing import Feed
from healthgate.health.states import HealthState
from healthgate.health.traffic import Verdict, quorum
from healthgate.model.names import ResourcePath, is_valid_name
from healthgate.store.base import StoreError, decode_json, sane_time
from healthgate.store.etcd_client import EtcdClient, Event, GuardFailed, KeyValue

log = logging.getLogger("healthgate.cluster")

TRAFFIC = "t/"
MAX_REASON = 1000
_STATES = {"HEALTHY": HealthState.HEALTHY, "UNHEALTHY": HealthState.UNHEALTHY}

_logged: set[str] = set()


def _bad(key: str, why: str) -> None:
    if key not in _logged and len(_logged) < 10_000:
        _logged.add(key)
        log.warning("ignoring the traffic verdict at %s: %s", key[:200], why)


def verdict_key(source: str, node: str) -> str:
    return f"{TRAFFIC}{source}/{node}"


def parse_verdict(kv: KeyValue) -> tuple[str, str, Verdict] | None:
    """(source path, node, verdict), or None when it cannot be trusted."""
    source, _, node = kv.key[len(TRAFFIC) :].rpartition("/")
    try:
        if not kv.key.startswith(TRAFFIC) or not is_valid_name(node):
            raise ValueError("not a verdict key")
        path = ResourcePath.parse(source)
        if path.collection != "healthSources":
            raise ValueError("not a health source's")
        d = decode_json(kv.value)
        if not isinstance(d, dict):
            raise ValueError("not an object")
        state = _STATES[str(d["state"])]
        judged, requests, errors = d["judged"], d["requests"], d["errors"]
        if not isinstance(judged, bool):
            raise ValueError("judged is not true or false")
        for name, n in (("requests", requests), ("errors", errors)):
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 1 << 53:
                raise ValueError(f"{name} is not a count")
        reason = d["reason"]
        if not isinstance(reason, str):
            raise ValueError("reason is not text")
        if d.get("node") != node:
            raise ValueError("the node named in it is not the key's")
        since = sane_time(d["since"])
        return str(path), node, Verdict(state, judged, requests, errors, reason[:MAX_REASON], since)
    except (ValueError, KeyError, TypeError) as exc:
        _bad(kv.key, str(exc))
        return None


class ClusterTraffic:
    """This node's verdicts to etcd, and every node's to the engine's
    TRAFFIC sources (see the module doc)."""

    def __init__(
        self,
        client: EtcdClient,
        session: Session,
        member_key: str,
        node: str,
        feed: Feed,
        clock: Callable[[], float],
    ) -> None:
        self.client = client
        self.clock = clock
        self.session = session
        self.member_key = member_key
        self.node = node
        self.feed = feed  # controlplane/probing.py's Feed: the engine, and where records go
        self.feed.engine.passive.local_traffic = False  # (the quorum decides)
        self.opinions: dict[str, dict[str, Verdict]] = {}  # source -> node -> verdict
        self.mine: dict[str, Verdict] = {}  # this node's, as last said
        self.writes = 0
        self._outbox: dict[str, Verdict] = {}
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------ this node's

    def local(self, verdicts: dict[str, Verdict]) -> None:
        """This node's verdicts that flipped (controlplane/evidence.py)."""
        for source, v in verdicts.items():
            self.mine[source] = v
            self._outbox[source] = v
        if verdicts:
            self._wake.set()
        for source in list(self.opinions):  # (a source that arrived after its verdicts)
            self._decide(source)

    def rewrite(self) -> None:
        """A new session: this node's verdicts went with the old lease."""
        self._outbox.update(self.mine)
        if self._outbox:
            self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._outbox:
                if not self.session.alive:
                    await asyncio.sleep(0.5)  # (rewritten under the next session: rewrite)
                    break
                batch, self._outbox = self._outbox, {}
                items = [
                    (verdict_key(source, self.node), self._encode(v)) for source, v in batch.items()
                ]
                guard = [self.client.under_lease(self.member_key, self.session.id)]
                try:
                    await asyncio.to_thread(self.client.put, items, self.session.id, guard)
                    self.writes += len(items)
                except GuardFailed:
                    pass  # (the session ended: joined again, it rewrites them)
                except StoreError as exc:
                    log.warning("cannot write %d traffic verdicts (%s); retrying", len(items), exc)
                    for source, v in batch.items():
                        self._outbox.setdefault(source, v)
                    await asyncio.sleep(0.5)

    def _encode(self, v: Verdict) -> bytes:
        value = {
            "state": v.state.name,
            "judged": v.judged,
            "requests": v.requests,
            "errors": v.errors,
            "reason": v.reason,
            "since": v.since,
            "node": self.node,
        }
        return json.dumps(value, separators=(",", ":")).encode()

    # ------------------------------------------------------------------ everyone's

    def load(self, kvs: list[KeyValue]) -> None:
        """Every verdict as it is (the watch's start, or after it was reset)."""
        before = set(self.opinions)
        self.opinions = {}
        for kv in kvs:
            parsed = parse_verdict(kv)
            if parsed is not None:
                source, node, v = parsed
                self.opinions.setdefault(source, {})[node] = v
        for source in sorted(before | set(self.opinions)):
            self._decide(source)

    def changed(self, ev: Event) -> None:
        source, _, node = ev.kv.key[len(TRAFFIC) :].rpartition("/")
        if ev.deleted:
            self.opinions.get(source, {}).pop(node, None)
        else:
            parsed = parse_verdict(ev.kv)
            if parsed is None:
                return
            source, node, v = parsed
            self.opinions.setdefault(source, {})[node] = v
        self._decide(source)

    def _decide(self, source: str) -> None:
        engine = self.feed.engine
        status = engine.node_status(source)
        if status is None:
            return  # (no such source here: its resource has not arrived, or is gone)
        nodes = sorted(self.opinions.get(source, {}).items())
        state, reason = quorum(status.state, nodes)
        if state is not status.state:
            self.feed.emit(engine.set_traffic(self.clock(), source, state, reason))

    def status(self, source: str) -> dict[str, Any]:
        """Every node's verdict of a source (the API's status)."""
        return {
            node: {
                "state": v.state.name,
                "judged": v.judged,
                "requests": v.requests,
                "errors": v.errors,
                "reason": v.reason,
            }
            for node, v in sorted(self.opinions.get(source, {}).items())
        }
