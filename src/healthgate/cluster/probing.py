"""A cluster node's probe source: probe a share, say opinions, decide from them.

How a node's endpoints get their states (SPEC §4; docs/cluster.md has the
picture), as a probe source (controlplane/probing.py):

* the node places the serving engine's endpoints (every node knows every
  endpoint: it serves the whole world) and probes only those that
  rendezvous hashing gives it (health/placement.py) - in this process or in
  probe workers - into a *prober table* holding that share alone
  (health/probed.py), whose threshold machine flips them;
* a flip of the prober table is this node's **opinion** for the vantages
  it probes the endpoint for (cluster/opinions.py), written to etcd;
* every node watches every opinion and decides each endpoint by the vantage
  quorum (health/vantage.py) - the decision goes into the serving engine
  through the feed, like any other source's - so every node computes the
  same sources, composites and routes, and its data plane follows them. An
  opinion that cannot be written (no quorum) changes nothing anywhere:
  fail static.

When a node takes an endpoint over (its prober died, the membership
changed, or this node's own session was lost and it joined again), its
prober table resumes from the stored opinion for that vantage - what the
live probers said - never from UNKNOWN and never from what this node
itself believed while it was not a member.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from healthgate.cluster.opinions import Opinion, OpinionWriter, parse_opinion, split_opinion_key
from healthgate.controlplane.probe_workers import ProbePool
from healthgate.controlplane.probing import (
    HISTORY_BUDGET,
    Decided,
    Feed,
    LocalProber,
    set_states,
    spec_of,
)
from healthgate.health.engine import ApplyResult, ProbeTarget
from healthgate.health.history import history_export
from healthgate.health.placement import Moves, by_region, probers
from healthgate.health.probed import ProbedTable
from healthgate.health.states import (
    HealthState,
    ProbeResult,
    Record,
    RecordKind,
    RouteChange,
    Transition,
)
from healthgate.health.vantage import vantages_of, verdict
from healthgate.model.change import WorldChange
from healthgate.model.names import endpoint_path
from healthgate.model.resources import HealthCheck
from healthgate.probes.prober import ProbeSettings
from healthgate.probes.scheduler import SchedulerSettings
from healthgate.probes.stats import FailureLogLimiter, ProbeTotals
from healthgate.store.etcd_client import Event, KeyValue

log = logging.getLogger("healthgate.cluster")

# deleted opinions whose revisions are kept (older news of them is dropped;
# the watch delivers in order, so this guards only a list and a watch that overlap)
DELETIONS_KEPT = 100_000
BEAT_EVERY = 8192  # endpoints of long synchronous work between two calls of beat

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    node: str
    region: str
    lease_ttl: int = 5
    probe_workers: int = 0  # probe this node's share in N worker processes
    resync_every: float = 300.0  # anti-entropy: rewrite opinions that differ from the store
    sweep_every: float = 300.0  # the leader deletes opinions of endpoints gone (cluster/sweeper.py)
    api_url: str = ""  # where this node's API answers (in its member key: the others ask it)


@dataclass(slots=True)
class _Endpoint:
    slot: int  # in the serving engine
    region: str
    vantages: tuple[str, ...]
    # seconds a prober needs to confirm or overturn a state: the longer
    # threshold's probes, a timeout and an interval to spare
    window: float


def confirm_window(check: HealthCheck) -> float:
    threshold = max(check.healthy_threshold, check.unhealthy_threshold)
    return check.check_interval_sec * (threshold + 1) + check.timeout_sec


class ClusterProbing:
    """The probe source of a cluster node (see the module doc)."""

    def __init__(
        self,
        feed: Feed,
        cluster: ClusterSettings,
        probe_settings: ProbeSettings | None = None,
        scheduler_settings: SchedulerSettings | None = None,
        failure_log: FailureLogLimiter | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.feed = feed
        self.cluster = cluster
        self.clock = clock
        # this node's share - its own probes and their threshold states - in
        # a prober table of its own (health/probed.py; the world is the
        # serving engine's, never held twice)
        self.prober = ProbedTable()
        self.writer: OpinionWriter | None = None  # (the node sets it: it needs the session)
        # called every BEAT_EVERY endpoints of long synchronous work (a
        # placement of a large world): the node's session refreshed in place
        # (cluster/session.py's beat; the node sets it)
        self.beat: Callable[[], None] = lambda: None
        self.members: dict[str, str] = {}  # live node -> region
        self.regions: dict[str, list[str]] = {}
        self.opinions: dict[str, dict[str, Opinion]] = {}  # endpoint path -> vantage -> opinion
        self.endpoints: dict[str, _Endpoint] = {}
        self.mine: dict[int, tuple[str, frozenset[str]]] = {}  # prober slot -> (path, vantages)
        self._mine_by_path: dict[str, tuple[int, frozenset[str]]] = {}  # path -> (slot, vantages)
        self._orphans: frozenset[str] = frozenset()
        # while this node is not a member (its session lost): it says nothing
        # and corrects nothing; on joining again it resumes from the opinions
        self.member = True
        # opinions are applied in etcd's order: each held opinion carries its
        # key's revision; a deletion's (or an untrusted value's) revision is
        # kept here, the newest DELETIONS_KEPT of them; and a floor below
        # which nothing is older news
        self._deleted: dict[str, int] = {}
        self._floor = 0
        self._dirty: set[str] = set()  # endpoints whose opinions changed in this watch batch
        # after joining again: endpoints whose stored opinions would change
        # this node's decision, held as they are until a fresh opinion comes
        # or their window passes (path -> until, this node's clock)
        self._held: dict[str, float] = {}
        # prober slots whose state was taken from a stored opinion, not yet
        # from this node's own probes (a newer stored opinion replaces it)
        self._borrowed: set[int] = set()
        self.route_lags: deque[float] = deque(maxlen=1000)
        self.shares: dict[str, int] = {}  # node -> endpoints it probes (by placement)
        # serving slot -> (its endpoint path, the nodes that probe it): kept
        # as endpoints come and go, so that a change places only its own
        self._placed: dict[int, tuple[str, frozenset[str]]] = {}
        self._placed_mine: set[str] = set()  # the paths the last placement gave this node
        # what a placement gives this node (path -> its serving target and
        # vantages) and takes away, until it is done (:meth:`_flush`)
        self._put: dict[str, tuple[ProbeTarget, frozenset[str]]] = {}
        self._gone: set[str] = set()
        failure_log = failure_log or FailureLogLimiter(0.0)
        # worker processes probe this node's share, or (None) this process's scheduler does
        self.pool: ProbePool | None = None
        self.local: LocalProber | None = None
        if cluster.probe_workers > 0:
            self.pool = ProbePool(
                cluster.probe_workers,
                probe_settings or ProbeSettings(),
                scheduler_settings or SchedulerSettings(),
                self._worker_flips,
                self._mine_targets,
                self._prober_state,
                failure_log=failure_log,
            )
        else:
            self.local = LocalProber(
                self._on_results,
                self.prober.endpoint_path,
                probe_settings,
                scheduler_settings,
                failure_log,
                self.prober.table,
            )

    # ------------------------------------------------------------------ the source

    async def start(self) -> None:
        if self.pool is not None:
            await self.pool.start()
        elif self.local is not None:
            self.local.start()

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self.local is not None:
            await self.local.close()

    def endpoint_vantages(self, path: str) -> tuple[str, ...] | None:
        """The vantage regions of an endpoint in the world now (None: it is not)."""
        ep = self.endpoints.get(path)  # (a new dict at each placement)
        return None if ep is None else ep.vantages

    def totals(self) -> ProbeTotals:
        if self.pool is not None:
            return self.pool.totals()
        assert self.local is not None
        return self.local.totals()

    def pids(self) -> list[int]:
        return self.pool.pids() if self.pool is not None else []

    async def histories(self) -> tuple[dict[str, list[bytes]], bool]:
        """This node's probes' histories (the others keep theirs: SPEC §11)."""
        if self.pool is not None:
            return await self.pool.histories()
        history = self.local.history if self.local is not None else None
        return history_export(history, HISTORY_BUDGET)

    def apply(self, change: WorldChange, result: ApplyResult) -> None:
        """A commit, as the serving engine took it (``result``: the probe
        work it added, changed and removed): only those endpoints are placed
        and decided (all of them when the change is a new world)."""
        for slot in result.removed:
            self._unplace(slot)
        if change.whole:
            self._place({t.slot for t in result.changed})
            self._decide_all()
            return
        targets = [*result.added, *result.changed]
        self._place_targets(targets, {t.slot for t in result.changed})
        self._flush()
        self._decide([endpoint_path(t.backend_service, t.ip, t.port) for t in targets])

    def _unplace(self, slot: int) -> None:
        """A serving slot probed no more: not probed, not counted, not decided."""
        placed = self._placed.get(slot)
        if placed is not None:
            self.endpoints.pop(placed[0], None)
            self._give_up(placed[0])
        self._unplace_count(slot)

    # ------------------------------------------------------------------ membership

    def set_members(self, members: dict[str, str]) -> None:
        if members == self.members:
            return
        before = self.members
        self.members = members
        self.regions = by_region(members)
        log.info(
            "members: %s",
            ", ".join(f"{n} ({r})" for n, r in sorted(members.items())) or "none",
        )
        if not before or not members:
            self._place(set())
            self._decide_all()
            return
        moves = Moves(before, members)
        self._move(moves)
        if moves.regions_changed:  # (the vantages that have a say changed)
            self._decide_all()

    def _move(self, moves: Moves) -> None:
        """Place again only the endpoints a membership change moves."""
        endpoints = self.endpoints
        moved: set[int] = set()
        for slot, (path, owners) in self._beating(self._placed.items()):
            ep = endpoints.get(path)
            if ep is None or moves.moves(path, ep.region, ep.vantages, owners):
                moved.add(slot)
        if moved:
            self._place_targets(self.feed.engine.targets(moved), set())
            self._flush()
        # (a node that left probes nothing any more: every endpoint it had moved)
        self.shares = {n: self.shares.get(n, 0) for n in self.members}
        if moves.regions_changed:
            self._report_orphans({ep.region for ep in endpoints.values()} - set(self.regions))

    def left(self) -> None:
        """This node's session is lost: it is no member until it joins again.
        Meanwhile it says nothing, corrects nothing, and its decisions stand
        still (fail static): what it reads is kept, not acted on - a watch
        that catches up after a cut replays minutes of history in a burst."""
        self.member = False

    def joined(self, opinions: Iterable[KeyValue], revision: int) -> None:
        """A member again (a new session), with the opinions listed after
        joining, at ``revision``: what the live probers say now. Its probers
        resume from them; anything the watch still delivers from before
        ``revision`` is older news and dropped. An endpoint whose decision
        these opinions would change is **held** as this node has it until a
        fresh opinion of it arrives or its window passes: the opinions may
        be as stale as this node's own view (formed by probers that could
        not reach the endpoint during the cut), and taking them for a few
        seconds only to take them back flaps the routes."""
        self.member = True
        self._floor = max(self._floor, revision)
        self._held = {}
        self._load(opinions)
        now = self.clock()
        for path, ep in self.endpoints.items():
            if self._decision(path) is not None:
                self._held[path] = now + ep.window
        if self._held:
            log.info(
                "joined again: %d endpoints held as they were until fresh opinions come",
                len(self._held),
            )
            self._release_later(max(self._held.values()) - now)
        self._decide_all()

    def _release_later(self, delay: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # (no loop: unit tests call release_held themselves)
        loop.call_later(delay + 0.05, self.release_held)

    def release_held(self) -> None:
        """Decide the held endpoints whose window has passed."""
        now = self.clock()
        due = [path for path, until in self._held.items() if until <= now]
        for path in due:
            del self._held[path]
        if due:
            self._decide(due)

    def _place(self, changed: set[int]) -> None:
        """Probe what rendezvous hashing gives this node of every endpoint;
        stop probing the rest (membership moved, or a new world)."""
        self.endpoints = {}
        self._placed = {}
        self.shares = dict.fromkeys(self.members, 0)
        orphans = self._place_targets(self.feed.engine.targets(), changed)
        for path in self._mine_by_path:
            if path not in self._placed_mine:
                self._give_up(path)
        self._flush()
        self._report_orphans(orphans)

    def _place_targets(self, targets: Iterable[ProbeTarget], changed: set[int]) -> set[str]:
        """Place these serving targets (rendezvous over the live members of
        each vantage region): this node probes its own, counts everyone's,
        knows each endpoint's vantages. The regions without a live node.
        (What this node is to probe from now on waits for :meth:`_flush`.)"""
        me = self.cluster.node
        orphans: set[str] = set()
        self._placed_mine = set()
        for t in self._beating(targets):
            self._unplace_count(t.slot)
            path = endpoint_path(t.backend_service, t.ip, t.port)
            region = t.backend_service.region
            vantages = vantages_of(region, t.check.vantage_regions)
            self.endpoints[path] = _Endpoint(t.slot, region, vantages, confirm_window(t.check))
            if self.members and region not in self.regions:
                orphans.add(region)
            owners = probers(path, region, vantages, self.regions) if self.members else {}
            distinct = frozenset(owners.values())
            for owner in distinct:
                self.shares[owner] = self.shares.get(owner, 0) + 1
            self._placed[t.slot] = (path, distinct)
            mine = frozenset(v for v, n in owners.items() if n == me)
            if not mine:
                self._give_up(path)
                continue
            self._placed_mine.add(path)
            before = self._mine_by_path.get(path)
            if before is None or t.slot in changed:
                self._put[path] = (t, mine)
                self._gone.discard(path)
            elif before[1] != mine:  # (probed already, for other vantages now)
                self._revantage(before[0], path, mine)
        return orphans

    def _revantage(self, slot: int, path: str, vantages: frozenset[str]) -> None:
        """A prober slot this node probes for other vantages from now on:
        resumed from their stored opinions (:meth:`_take_over`)."""
        self._take_over(slot, path, vantages)
        self.mine[slot] = (path, vantages)
        self._mine_by_path[path] = (slot, vantages)

    def _beating(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, with the node's session refreshed in place (:attr:`beat`)
        at the first and every BEAT_EVERY-th: long synchronous work never
        starves the lease."""
        beat = self.beat
        for i, item in enumerate(items):
            if not i % BEAT_EVERY:
                beat()
            yield item

    def _give_up(self, path: str) -> None:
        """This node probes ``path`` no more (when placement is done)."""
        self._put.pop(path, None)
        if path in self._mine_by_path:
            self._gone.add(path)

    def _flush(self) -> None:
        """What placement gave this node and took away: into its prober
        table - what is new to it resumes from the stored opinions
        (:meth:`_take_over`) - and to the probes (this process's scheduler,
        or the workers)."""
        put, gone = self._put, self._gone
        self._put, self._gone = {}, set()
        if not put and not gone:
            return
        checks = {t.backend_service: (t.check, t.secrets) for t, _ in put.values()}
        self.beat()
        result = self.prober.change(self.clock(), checks, put, gone)
        self.beat()
        stopped: list[str] = []
        for slot in result.removed:
            path, _ = self.mine.pop(slot)
            del self._mine_by_path[path]
            self._borrowed.discard(slot)
            stopped.append(path)
            if self.local is not None:
                self.local.remove(slot)
        probe: list[ProbeTarget] = []
        for t in self._beating((*result.added, *result.changed)):
            path = endpoint_path(t.backend_service, t.ip, t.port)
            before = self._mine_by_path.get(path)
            mine = put[path][1]
            if before is None or before[1] != mine:
                self._take_over(t.slot, path, mine)
            self.mine[t.slot] = (path, mine)
            self._mine_by_path[path] = (t.slot, mine)
            probe.append(t)
        for path, (_, mine) in put.items():  # (kept, its check as it was: its vantages may move)
            before = self._mine_by_path.get(path)
            if before is not None and before[1] != mine:
                self._revantage(before[0], path, mine)
        if self.local is not None:
            for t in self._beating(probe):
                self.local.scheduler.upsert(t.slot, spec_of(t))
        elif self.pool is not None:
            self.pool.change(probe, stopped)

    def _unplace_count(self, slot: int) -> None:
        """Take a slot's last placement out of the shares (it is placed again)."""
        placed = self._placed.pop(slot, None)
        if placed is not None:
            for owner in placed[1]:
                self.shares[owner] = max(0, self.shares.get(owner, 1) - 1)

    def _report_orphans(self, orphans: set[str]) -> None:
        if orphans == self._orphans:
            return
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
                self._borrowed.add(slot)
                return
        self.prober.table.set_state(self.clock(), slot, HealthState.UNKNOWN, "taken over")
        self._borrowed.discard(slot)

    # ------------------------------------------------------------------ probing

    def _on_results(self, now: float, results: Sequence[tuple[int, ProbeResult]]) -> None:
        self._flipped(self.prober.table.on_results(now, results))

    def _worker_flips(self, flips: Sequence[Decided]) -> None:
        """Probe workers' flips of this node's share: into the prober table,
        and opinions, as this process's own probes' flips are."""
        self._flipped(set_states(self.prober.table, flips))

    def _mine_targets(self) -> Iterable[ProbeTarget]:
        """This node's share (a worker started again is given its part)."""
        return self.prober.table.targets()

    def _prober_state(self, slot: int) -> tuple[HealthState, float]:
        """Where a worker that starts probing a prober slot resumes."""
        table = self.prober.table
        return table.state(slot), table.since(slot)

    def _flipped(self, records: list[Record]) -> None:
        for r in records:
            if isinstance(r, Transition) and r.kind is RecordKind.ENDPOINT:
                slot, vantages = self._mine_by_path.get(r.path, (-1, frozenset()))
                self._borrowed.discard(slot)  # (its own probes' state from now on)
                for vantage in vantages:
                    self._say(r.path, vantage, r.current, r.time, r.reason)

    def _say(self, path: str, vantage: str, state: HealthState, since: float, why: str) -> None:
        if self.writer is not None and self.member:
            self.writer.say(path, vantage, state, since, why)

    def resync(self) -> int:
        """Anti-entropy: say again this node's opinions that differ from the store's."""
        queued = 0
        if not self.member:
            return 0
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
        """Every opinion, as listed (a watch's start, or its restart)."""
        self._load(kvs)
        self._decide_all()

    def _load(self, kvs: Iterable[KeyValue]) -> None:
        self.opinions = {}
        self._deleted = {}
        for kv in self._beating(kvs):
            path, vantage, op = parse_opinion(kv)
            if op is not None:
                self.opinions.setdefault(path, {})[vantage] = op
        for slot, (path, vantages) in self.mine.items():
            self._take_over(slot, path, vantages)

    def opinion_changed(self, ev: Event) -> None:
        """One opinion event (the decision waits for the end of its watch
        batch: :meth:`opinions_settled`)."""
        key = ev.kv.key
        revision = ev.revision if ev.deleted else ev.kv.mod_revision
        if revision <= self._floor:
            return  # older than what this node holds (listed on joining)
        op: Opinion | None = None
        if ev.deleted:  # (a deletion has no value to read: its key says whose)
            where = split_opinion_key(key)
            if where is None:
                return
            path, vantage = where
        else:
            path, vantage, op = parse_opinion(ev.kv)
            if op is None:
                return  # (a value that cannot be trusted is no opinion: the one held stands)
        ops = self.opinions.get(path)
        held = ops.get(vantage) if ops is not None else None
        if revision <= (held.revision if held is not None else self._deleted.get(key, 0)):
            return  # older than what this node holds
        if op is None:  # deleted
            if held is not None:
                assert ops is not None
                del ops[vantage]
                if not ops:
                    del self.opinions[path]
            deleted = self._deleted
            deleted[key] = revision
            if len(deleted) > DELETIONS_KEPT:  # (the older half forgotten at once)
                self._deleted = dict(itertools.islice(deleted.items(), len(deleted) // 2, None))
        else:
            self._deleted.pop(key, None)
            self.opinions.setdefault(path, {})[vantage] = op
            self._correct(path, vantage, op)
        self._held.pop(path, None)  # (a fresh opinion: held no longer)
        self._dirty.add(path)

    def opinions_settled(self) -> None:
        """The end of a watch batch: decide what its events changed, once -
        a watch that catches up delivers a burst of history, and deciding
        after each event would replay every step of it (a route flapping
        within milliseconds)."""
        dirty, self._dirty = self._dirty, set()
        if dirty:
            self._decide(dirty)

    def _correct(self, path: str, vantage: str, op: Opinion) -> None:
        """The prober of an endpoint is the authority on its opinion: a stored
        opinion that differs from what this node's prober holds now - a late
        write from the previous prober, or this node's own write that was
        overtaken while etcd could not take it - is corrected at once (else it
        would stand until the next transition or the resync). Not while this
        node is no member: what it believes then is not to be written."""
        slot, vantages = self._mine_by_path.get(path, (0, frozenset()))
        if vantage not in vantages or not self.member:
            return
        state = self.prober.table.state(slot)
        if state is not HealthState.UNKNOWN and state is not op.state and slot in self._borrowed:
            # its state was the stored opinion, not its own probes': the newer
            # stored one replaces it (its own thresholds may overturn it later)
            self.prober.table.set_state(op.since, slot, op.state, "resumed")
            return
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

    def _decision(self, path: str) -> Decided | None:
        ep = self.endpoints.get(path)
        if ep is None:
            return None
        if path in self._held and self._held[path] > self.clock():
            return None
        ops = self.opinions.get(path, {})
        live = self._live(ep)
        previous = self.feed.engine.table.state(ep.slot)
        state, reason = verdict({v: o.state for v, o in ops.items()}, ep.vantages, live, previous)
        if state is previous:
            return None
        voters = [o for v, o in ops.items() if v in live and o.state is state]
        if len(ep.vantages) == 1 and voters:
            reason = f"{voters[0].reason} (probed by {voters[0].node})"
        # the opinions' own time, so every node records the same transition
        when = max((o.since for o in voters), default=self.clock())
        return Decided(path, state, when, reason)

    def _decide(self, paths: Iterable[str]) -> None:
        if not self.member:
            return  # (fail static: decided all at once on joining again)
        decided: list[Decided] = []
        for path in self._beating(paths):
            d = self._decision(path)
            if d is not None:
                decided.append(d)
        if not decided:
            return
        records = self.feed.states(decided)
        if any(isinstance(r, RouteChange) for r in records):
            # from the prober's flip to this node's new route: etcd's write,
            # the watch and the engine (bench/cluster.py reads these)
            self.route_lags.append(self.clock() - max(d.since for d in decided))

    def _decide_all(self) -> None:
        self._decide(list(self.endpoints))

    def vantages(self, endpoint_path: str) -> tuple[str, dict[str, dict[str, object]]] | None:
        ep = self.endpoints.get(endpoint_path)
        if ep is None:
            return None
        ops = self.opinions.get(endpoint_path, {})
        live = self._live(ep)
        previous = self.feed.engine.table.state(ep.slot)
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
