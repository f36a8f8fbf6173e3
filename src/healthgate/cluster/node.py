"""One node of a cluster: probing its share, deciding from the shared opinions.

How a node works (SPEC §4; docs/cluster.md has the picture):

* it registers under a lease (``n/<node>`` -> its region) and watches the
  other nodes' keys: the live members;
* :class:`ClusterHealth` probes only the endpoints that rendezvous hashing
  gives it (cluster/placement.py), runs the threshold machine on them in a
  *prober* engine of its own, and writes only their flips - *opinions*,
  ``o/<endpoint path>/<vantage region>`` - to etcd (plus a slow resync of
  what differs);
* every node watches every opinion and turns them into endpoint states by
  the vantage quorum (health/vantage.py), fed into its own engine: so every
  node computes the same sources, composites and routes, and its data plane
  follows them; an opinion that cannot be written (no quorum) changes
  nothing anywhere - fail static;
* one node is elected (``e/decisions/``, the etcd election recipe: the
  lowest create revision under the prefix leads) and it alone writes the
  transition log and the saved states, every write guarded by its election
  key (a deposed leader's late write fails and is dropped);
* every node follows the log (``l/``) and streams it to its ``events``
  subscribers, so any node resumes a stream by ``Last-Event-ID``.

When a node takes an endpoint over (its prober died, or the membership
changed), its prober engine resumes from the stored opinion for that
vantage, never from UNKNOWN.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from healthgate.cluster.placement import by_region, probers
from healthgate.controlplane.health_service import HealthService
from healthgate.controlplane.probe_workers import Flip, ProbePool, apply_flips
from healthgate.controlplane.recorder import TransitionRecorder
from healthgate.controlplane.saved_states import engine_states
from healthgate.health.engine import ApplyResult, HealthEngine, endpoint_name
from healthgate.health.states import (
    HealthState,
    Outcome,
    ProbeResult,
    Record,
    RouteChange,
    Transition,
)
from healthgate.health.vantage import vantages_of, verdict
from healthgate.model.resources import Resource
from healthgate.probes.prober import ProbeSettings
from healthgate.probes.scheduler import SchedulerSettings
from healthgate.store.base import Compacted, StoreError
from healthgate.store.etcd import EtcdStore, Event, KeyValue, Lease

log = logging.getLogger("healthgate.cluster")

MEMBERS = "n/"
OPINIONS = "o/"
ELECTION = "e/decisions/"
LOG = "l/"


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    node: str
    region: str
    lease_ttl: int = 5
    probe_workers: int = 0  # probe this node's share in N worker processes
    resync_every: float = 300.0  # anti-entropy: rewrite opinions that differ from the store


@dataclass(frozen=True, slots=True)
class Opinion:
    state: HealthState
    since: float
    reason: str
    node: str


@dataclass(slots=True)
class _Endpoint:
    slot: int  # in the deciding engine
    region: str
    vantages: tuple[str, ...]


def opinion_key(endpoint: str, vantage: str) -> str:
    return f"{OPINIONS}{endpoint}/{vantage}"


def parse_opinion(kv: KeyValue) -> tuple[str, str, Opinion | None]:
    endpoint, _, vantage = kv.key[len(OPINIONS) :].rpartition("/")
    try:
        d = json.loads(kv.value)
        return (
            endpoint,
            vantage,
            Opinion(HealthState[d["state"]], float(d["since"]), str(d["reason"]), str(d["node"])),
        )
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring an unreadable opinion at %s", kv.key)
        return endpoint, vantage, None


class ClusterHealth(HealthService):
    """The health service of a cluster node (see the module doc)."""

    def __init__(
        self,
        store: EtcdStore,
        cluster: ClusterSettings,
        probe_settings: ProbeSettings | None = None,
        scheduler_settings: SchedulerSettings | None = None,
        failure_log_rate: float = 0.0,
    ) -> None:
        super().__init__(probe_settings, scheduler_settings, failure_log_rate=failure_log_rate)
        self.store = store
        self.cluster = cluster
        self.prober = HealthEngine()  # this node's own probes and their threshold states
        self.members: dict[str, str] = {}  # live node -> region
        self.regions: dict[str, list[str]] = {}
        self.opinions: dict[str, dict[str, Opinion]] = {}  # endpoint path -> vantage -> opinion
        self.endpoints: dict[str, _Endpoint] = {}
        self.mine: dict[int, tuple[str, frozenset[str]]] = {}  # prober slot -> (path, vantages)
        self._mine_by_path: dict[str, tuple[int, frozenset[str]]] = {}  # path -> (slot, vantages)
        self._outbox: dict[str, dict[str, Any]] = {}
        self._outbox_wake = asyncio.Event()
        self._orphans: frozenset[str] = frozenset()
        self.opinion_writes = 0
        self.route_lags: deque[float] = deque(maxlen=1000)
        self.shares: dict[str, int] = {}  # node -> endpoints it probes (by placement)
        # worker processes probe this node's share, or (None) this process's scheduler does
        self.pool: ProbePool | None = None
        if cluster.probe_workers > 0:
            self.pool = ProbePool(
                cluster.probe_workers,
                probe_settings or ProbeSettings(),
                scheduler_settings or SchedulerSettings(),
                self._worker_flips,
                self._prober_states,
                self.take_report,
                failure_log=self.failure_log,
            )

    # ------------------------------------------------------------------ resources

    def start(self) -> None:
        if self.pool is not None:
            self.pool.start()
        else:
            super().start()

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        await super().close()

    def apply(self, resources: Iterable[Resource]) -> ApplyResult:
        world = list(resources)
        now = self.clock()
        result = self.engine.apply(world, now)
        probing = self.prober.apply(world, now)
        if self.pool is not None:
            self.pool.world(world)
        for slot in probing.removed:
            self.scheduler.remove(slot)
            gone = self.mine.pop(slot, None)
            if gone is not None:
                self._mine_by_path.pop(gone[0], None)
        self._place({t.slot for t in probing.changed})
        self.emit(result.records)
        self.emit(self._decide_all())
        return result

    def set_members(self, members: dict[str, str]) -> None:
        if members == self.members:
            return
        self.members = members
        self.regions = by_region(members)
        log.info(
            "members: %s",
            ", ".join(f"{n} ({r})" for n, r in sorted(members.items())) or "none",
        )
        self._place(set())
        self.emit(self._decide_all())

    def _place(self, changed: set[int]) -> None:
        """Probe what rendezvous hashing gives this node; stop probing the rest."""
        me = self.cluster.node
        endpoints: dict[str, _Endpoint] = {}
        seen: set[int] = set()
        orphans: set[str] = set()
        shares: dict[str, int] = dict.fromkeys(self.members, 0)
        for t in self.prober.targets():
            path = f"{t.backend_service}/endpoints/{endpoint_name(t.ip, t.port)}"
            region = t.backend_service.region
            vantages = vantages_of(region, t.check.vantage_regions)
            main = self.engine.slot_of(t.backend_service, t.ip, t.port)
            if main is not None:
                endpoints[path] = _Endpoint(main, region, vantages)
            if self.members and region not in self.regions:
                orphans.add(region)
            owners = probers(path, region, vantages, self.regions) if self.members else {}
            for owner in set(owners.values()):
                shares[owner] = shares.get(owner, 0) + 1
            mine = frozenset(v for v, n in owners.items() if n == me)
            if not mine:
                continue
            seen.add(t.slot)
            before = self.mine.get(t.slot)
            if before is None or before[1] != mine:
                self._take_over(t.slot, path, mine)
            self.mine[t.slot] = (path, mine)
            self._mine_by_path[path] = (t.slot, mine)
            if self.pool is None and (before is None or t.slot in changed):
                self.scheduler.upsert(t.slot, self.spec_of(t))
        for slot in [s for s in self.mine if s not in seen]:
            path, _ = self.mine.pop(slot)
            self._mine_by_path.pop(path, None)
            if self.pool is None:
                self.scheduler.remove(slot)
        if self.pool is not None:  # (the workers find spec changes in the world themselves)
            self.pool.assign(self._mine_by_path)
        self.endpoints = endpoints
        self.shares = shares
        if orphans != self._orphans:
            for region in sorted(orphans - self._orphans):
                log.warning(
                    "region %s has no live node: its endpoints are probed by the other regions",
                    region,
                )
            for region in sorted(self._orphans - orphans):
                log.info("region %s has a live node again: it probes its own endpoints", region)
            self._orphans = frozenset(orphans)

    def _take_over(self, slot: int, path: str, vantages: frozenset[str]) -> None:
        """Start from the stored opinion of a vantage this node now probes
        for - or, with none stored, from UNKNOWN: a state left in the prober
        engine from an earlier time this node probed the endpoint (as a
        stand-in for another region, say) would hide the first flip, and
        with it the opinion (an endpoint left UNHEALTHY there and failing
        again would never be said to be UNHEALTHY from this vantage)."""
        stored = self.opinions.get(path, {})
        for vantage in sorted(vantages):
            op = stored.get(vantage)
            if op is not None and op.state is not HealthState.UNKNOWN:
                self.prober.table.set_state(op.since, slot, op.state, "resumed")
                return
        self.prober.table.set_state(self.clock(), slot, HealthState.UNKNOWN, "taken over")

    # ------------------------------------------------------------------ probing

    def _on_results(self, _loop_time: float, results: list[tuple[Hashable, ProbeResult]]) -> None:
        self.results += len(results)
        self.probe_stats.observe(results)
        failure_log = self.failure_log
        if failure_log.rate:
            for key, result in results:
                if result.outcome is not Outcome.OK:
                    failure_log.failed(self.prober.endpoint_path(cast(int, key)), result.describe())
        self._flipped(
            self.prober.on_results(self.clock(), cast("list[tuple[int, ProbeResult]]", results))
        )

    def _worker_flips(self, flips: Sequence[Flip]) -> None:
        """Probe workers' flips of this node's share: into the prober engine,
        and opinions, as this process's own probes' flips are."""
        self._flipped(apply_flips(self.prober.table, flips))

    def _prober_states(self, paths: Iterable[str] | None) -> dict[str, tuple[int, float]]:
        """The prober engine's states of ``paths`` (None: all of this node's
        share), for a worker that starts probing them."""
        out: dict[str, tuple[int, float]] = {}
        table = self.prober.table
        for path in self._mine_by_path if paths is None else paths:
            slot = self._mine_by_path.get(path, (None,))[0]
            if slot is None:
                continue
            state = table.state(slot)
            if state is not HealthState.UNKNOWN:
                out[path] = (int(state), table.since(slot))
        return out

    def _flipped(self, records: list[Record]) -> None:
        for r in records:
            if isinstance(r, Transition) and r.kind == "Endpoint":
                for vantage in self._mine_by_path.get(r.path, (0, ()))[1]:
                    self._say(r.path, vantage, r.current, r.time, r.reason)

    def _say(self, path: str, vantage: str, state: HealthState, since: float, why: str) -> None:
        self._outbox[opinion_key(path, vantage)] = {
            "state": state.name,
            "since": since,
            "reason": why,
            "node": self.cluster.node,
        }
        self._outbox_wake.set()

    async def write_opinions(self) -> None:
        """Opinions to etcd, coalesced (the last state of a key wins); while
        etcd cannot take them they wait here, and nothing is decided."""
        failing = False
        while True:
            await self._outbox_wake.wait()
            self._outbox_wake.clear()
            while self._outbox:
                batch, self._outbox = self._outbox, {}
                try:
                    await asyncio.to_thread(self.store.put_json, batch)
                    self.opinion_writes += len(batch)
                    if failing:
                        log.info("etcd takes opinions again (%d written)", len(batch))
                        failing = False
                except StoreError as exc:
                    if not failing:
                        log.warning("cannot write %d opinions (%s); retrying", len(batch), exc)
                        failing = True
                    batch.update(self._outbox)
                    self._outbox = batch
                    await asyncio.sleep(0.5)

    def resync(self) -> int:
        """Anti-entropy: queue this node's opinions that differ from the store's."""
        queued = 0
        for slot, (path, vantages) in self.mine.items():
            state = self.prober.table.state(slot)
            if state is HealthState.UNKNOWN:
                continue
            stored = self.opinions.get(path, {})
            for vantage in vantages:
                op = stored.get(vantage)
                if op is None or op.state is not state:
                    self._say(path, vantage, state, self.clock(), "resync")
                    queued += 1
        return queued

    # ------------------------------------------------------------------ deciding

    def load_opinions(self, kvs: Iterable[KeyValue]) -> None:
        self.opinions = {}
        for kv in kvs:
            path, vantage, op = parse_opinion(kv)
            if op is not None:
                self.opinions.setdefault(path, {})[vantage] = op
        for slot, (path, vantages) in self.mine.items():
            self._take_over(slot, path, vantages)
        self.emit(self._decide_all())

    def opinion_changed(self, ev: Event) -> None:
        if ev.deleted:
            path, vantage, _ = parse_opinion(ev.kv)
            self.opinions.get(path, {}).pop(vantage, None)
        else:
            path, vantage, op = parse_opinion(ev.kv)
            if op is None:
                return
            self.opinions.setdefault(path, {})[vantage] = op
            self._correct(path, vantage, op)
        self.emit(self._decide(path))

    def _correct(self, path: str, vantage: str, op: Opinion) -> None:
        """The prober of an endpoint is the authority on its opinion: a stored
        opinion that differs from what this node's prober holds now - a late
        write from the previous prober, or this node's own write that was
        overtaken while etcd could not take it - is corrected at once (else it
        would stand until the next transition or the resync)."""
        slot, vantages = self._mine_by_path.get(path, (0, frozenset()))
        if vantage not in vantages:
            return
        state = self.prober.table.state(slot)
        if state is not HealthState.UNKNOWN and state is not op.state:
            log.info(
                "correcting the stored opinion of %s (%s): %s, not %s",
                path,
                vantage,
                state.name,
                op.state.name,
            )
            self._say(path, vantage, state, self.clock(), "corrected by its prober")

    def _live(self, ep: _Endpoint) -> set[str]:
        live = {v for v in ep.vantages if v in self.regions}
        if self.members and ep.region not in self.regions:
            live.add(ep.region)  # the other regions stand in for it
        return live

    def _decide(self, path: str) -> list[Record]:
        ep = self.endpoints.get(path)
        if ep is None:
            return []
        ops = self.opinions.get(path, {})
        live = self._live(ep)
        previous = self.engine.table.state(ep.slot)
        state, reason = verdict({v: o.state for v, o in ops.items()}, ep.vantages, live, previous)
        if state is previous:
            return []
        voters = [o for v, o in ops.items() if v in live and o.state is state]
        if len(ep.vantages) == 1 and voters:
            reason = f"{voters[0].reason} (probed by {voters[0].node})"
        # the opinions' own time, so every node records the same transition
        when = max((o.since for o in voters), default=self.clock())
        records = self.engine.table.set_state(when, ep.slot, state, reason)
        if any(isinstance(r, RouteChange) for r in records):
            # from the prober's flip to this node's new route: etcd's write,
            # the watch and the engine (bench/cluster.py reads these)
            self.route_lags.append(self.clock() - when)
        return records

    def _decide_all(self) -> list[Record]:
        records: list[Record] = []
        for path in self.endpoints:
            records += self._decide(path)
        return records

    def vantages(self, endpoint_path: str) -> tuple[str, dict[str, dict[str, object]]] | None:
        ep = self.endpoints.get(endpoint_path)
        if ep is None:
            return None
        ops = self.opinions.get(endpoint_path, {})
        live = self._live(ep)
        previous = self.engine.table.state(ep.slot)
        _, why = verdict({v: o.state for v, o in ops.items()}, ep.vantages, live, previous)
        owners = probers(endpoint_path, ep.region, ep.vantages, self.regions)
        out: dict[str, dict[str, object]] = {}
        for vantage in ep.vantages:
            op = ops.get(vantage)
            out[vantage] = {
                "live": vantage in live,
                "prober": owners.get(vantage),  # who probes it for this vantage now
                "state": op.state.name if op else "UNKNOWN",
                "node": op.node if op else None,
                "reason": op.reason if op else None,
            }
        return why, out

    def probing(self) -> dict[str, list[str]]:
        """endpoint path -> the vantages this node probes it for."""
        return {path: sorted(v) for path, (_, v) in self._mine_by_path.items()}


class ClusterNode:
    """Membership, election and the watches of one node (see the module doc)."""

    def __init__(
        self,
        store: EtcdStore,
        settings: ClusterSettings,
        health: ClusterHealth,
        recorder: TransitionRecorder,
    ) -> None:
        self.store = store
        self.settings = settings
        self.health = health
        self.recorder = recorder
        self.lease = Lease(store, settings.lease_ttl)
        self.leader: str | None = None  # the leading node's name
        self.leading = False
        self._candidates: dict[str, tuple[int, str]] = {}  # election key -> (create rev, node)
        self._my_key = ""
        self._my_rev = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self._campaign: asyncio.Task[None] | None = None
        recorder.persist = False
        recorder.broadcast_writes = False

    async def start(self) -> None:
        """Join: lease, member key, the current members and opinions (so the
        first placement is right), then follow everything."""
        await self._join()
        rev_m, members = await asyncio.to_thread(self.store.list_prefix, MEMBERS)
        self.health.set_members(_members_of(members))
        rev_o, opinions = await asyncio.to_thread(self.store.list_prefix, OPINIONS)
        self.health.load_opinions(opinions)
        last_log = await asyncio.to_thread(self.store.last_log_id)
        self.recorder.last_id = last_log
        log_rev, _ = await asyncio.to_thread(self.store.list_prefix, "m/log")
        spawn = self._spawn
        spawn(self._follow(MEMBERS, rev_m, self._members_reset, self._member_event), "members")
        spawn(
            self._follow(OPINIONS, rev_o, self.health.load_opinions, self.health.opinion_changed),
            "opinions",
        )
        spawn(self._follow(LOG, log_rev, lambda _kvs: None, self._log_event), "log")
        spawn(self.health.write_opinions(), "opinion-writer")
        spawn(self._keep_membership(), "membership")
        spawn(self._resync(), "resync")
        spawn(self._compact(), "compaction")
        self._campaign = spawn(self._run_election(), "election")

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=f"cluster-{name}")
        self._tasks.append(task)
        return task

    async def _join(self) -> None:
        await self._name_is_free()
        await self.lease.grant()
        member = {"region": self.settings.region, "started": time.time()}
        await asyncio.to_thread(
            self.store.put_json, {MEMBERS + self.settings.node: member}, self.lease.id
        )
        log.info(
            "node %s (%s) joined with lease %x, TTL %ds",
            self.settings.node,
            self.settings.region,
            self.lease.id,
            self.settings.lease_ttl,
        )

    async def _name_is_free(self) -> None:
        """Another live node with this name (or this node's previous life,
        whose lease has not ended yet): wait for its lease, then refuse."""
        key = MEMBERS + self.settings.node
        deadline = time.monotonic() + self.settings.lease_ttl + 2
        told = False
        while True:
            _, kvs = await asyncio.to_thread(self.store.list_prefix, key)
            held = [kv for kv in kvs if kv.key == key and kv.lease and kv.lease != self.lease.id]
            if not held:
                return
            if time.monotonic() > deadline:
                raise StoreError(
                    f"--node {self.settings.node}: another live node has this name "
                    "(node names must be unique in a cluster)"
                )
            if not told:
                log.info("waiting for the lease of a previous node %s to end", self.settings.node)
                told = True
            await asyncio.sleep(0.5)

    async def _keep_membership(self) -> None:
        """A lost lease (etcd unreachable for a whole TTL): step down, then
        join again as soon as etcd answers."""
        while True:
            await self.lease.lost.wait()
            self._step_down("the lease was lost")
            if self._campaign is not None:
                self._campaign.cancel()
            await self.lease.close(revoke=True)
            while True:
                try:
                    await self._join()
                    break
                except StoreError as exc:
                    log.info("cannot join again yet: %s", exc)
                    await asyncio.sleep(1.0)
            self._campaign = self._spawn(self._run_election(), "election")

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_every)
            queued = self.health.resync()
            if queued:
                log.info("resync: %d opinions rewritten", queued)

    async def _compact(self) -> None:
        """The leader keeps etcd's history bounded (the store's last 10,000
        revisions), whatever moves the revision."""
        while True:
            await asyncio.sleep(60.0)
            if self.leading:
                with contextlib.suppress(StoreError):
                    await asyncio.to_thread(self.store.compact)

    # ------------------------------------------------------------------ watches

    async def _follow(
        self,
        prefix: str,
        revision: int,
        reset: Callable[[list[KeyValue]], None],
        apply: Callable[[Event], None],
    ) -> None:
        while True:
            try:
                async for batch in self.store.watch_prefix(prefix, revision + 1):
                    for ev in batch:
                        apply(ev)
                    revision = batch[-1].revision
            except Compacted:
                log.info("watch of %s compacted past %d: listing again", prefix, revision)
            revision, kvs = await asyncio.to_thread(self.store.list_prefix, prefix)
            reset(kvs)

    def _members_reset(self, kvs: list[KeyValue]) -> None:
        self.health.set_members(_members_of(kvs))

    def _member_event(self, ev: Event) -> None:
        members = dict(self.health.members)
        node = ev.kv.key[len(MEMBERS) :]
        if ev.deleted:
            if members.pop(node, None) is not None:
                log.warning("node %s left (its lease ended)", node)
        else:
            try:
                members[node] = str(json.loads(ev.kv.value)["region"])
            except (ValueError, KeyError, TypeError):
                return
        self.health.set_members(members)

    def _log_event(self, ev: Event) -> None:
        if ev.deleted or ev.kv.key == "l/":
            return
        try:
            event_id = int(ev.kv.key[len(LOG) :])
            record = json.loads(ev.kv.value)
        except ValueError:
            return
        self.recorder.publish((event_id, record))

    # ------------------------------------------------------------------ election

    async def _run_election(self) -> None:
        key = f"{ELECTION}{self.lease.id:x}"
        rev = await _retry(
            lambda: self.store.create_key(key, self.settings.node.encode(), self.lease.id)
        )
        self._my_key, self._my_rev = key, rev
        self.store.guard = (self.store.full_key(key), rev)
        revision, kvs = await asyncio.to_thread(self.store.list_prefix, ELECTION)
        self._candidates = {kv.key: (kv.create_revision, kv.value.decode()) for kv in kvs}
        self._elect()

        def reset(kvs: list[KeyValue]) -> None:
            self._candidates = {kv.key: (kv.create_revision, kv.value.decode()) for kv in kvs}
            self._elect()

        def changed(ev: Event) -> None:
            if ev.deleted:
                self._candidates.pop(ev.kv.key, None)
            else:
                self._candidates[ev.kv.key] = (ev.kv.create_revision, ev.kv.value.decode())
            self._elect()

        await self._follow(ELECTION, revision, reset, changed)

    def _elect(self) -> None:
        if not self._candidates:
            self.leader = None
            self._step_down("no candidate")
            return
        key, (_, node) = min(self._candidates.items(), key=lambda kv: kv[1][0])
        if node != self.leader:
            log.info("leader: %s", node)
        self.leader = node
        if key == self._my_key and not self.leading:
            self.leading = True
            # what fell between two leaders is written now: the transitions
            # this node computed that no leader wrote (the last minute's),
            # and the stored states made whole
            missed = self.recorder.take_over(self.health.clock() - 60.0)
            self.recorder.save(engine_states(self.health.engine))
            log.warning(
                "this node (%s) leads: it writes the decisions (%d transitions no leader wrote)",
                self.settings.node,
                missed,
            )
        elif key != self._my_key and self.leading:
            self._step_down(f"{node} leads")

    def _step_down(self, why: str) -> None:
        if self.leading:
            level = logging.INFO if why == "stopping" else logging.WARNING
            log.log(level, "this node no longer leads: %s", why)
        self.leading = False
        self.recorder.stop_persisting()

    def status(self) -> dict[str, Any]:
        return {
            "node": self.settings.node,
            "region": self.settings.region,
            "leader": self.leader,
            "leading": self.leading,
            "members": dict(sorted(self.health.members.items())),
            "probing": len(self.health.mine),
            "probingByNode": dict(sorted(self.health.shares.items())),
            "etcdMember": self.store.members.current(),  # the member this node talks to now
            "opinionWrites": self.health.opinion_writes,
            # seconds from a prober's flip to this node's route change, the last ones
            "routeLags": [round(x, 6) for x in self.health.route_lags],
        }

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._step_down("stopping")
        with contextlib.suppress(Exception):
            await self.lease.close(revoke=True)  # the others take over at once


def _members_of(kvs: Iterable[KeyValue]) -> dict[str, str]:
    out: dict[str, str] = {}
    for kv in kvs:
        try:
            out[kv.key[len(MEMBERS) :]] = str(json.loads(kv.value)["region"])
        except (ValueError, KeyError, TypeError):
            continue
    return out


async def _retry(call: Callable[[], int]) -> int:
    while True:
        try:
            return await asyncio.to_thread(call)
        except StoreError as exc:
            log.info("etcd not ready (%s); retrying", exc)
            await asyncio.sleep(1.0)
