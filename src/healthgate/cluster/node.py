"""One node of a cluster: the recipes of cluster/, wired.

A node (SPEC §4; docs/cluster.md) is a session (cluster/session.py) under
which it is a member (cluster/membership.py), says opinions
(cluster/opinions.py) and campaigns (cluster/election.py); its probe source
(cluster/probing.py) probes its share and decides from every node's
opinions. This module only wires them:

* **start**: open the session, join, read the members and opinions (so the
  first placement is right), then follow members, opinions and the log,
  write opinions, campaign, resync, compact;
* **the session is lost** (etcd unreachable for a TTL, or the lease
  expired): at once, the node stops leading (its status says so), stops
  saying and correcting opinions (what it believes while not a member is
  never written), and joins again as soon as etcd answers - under a new
  session, resuming its share from the opinions the live probers wrote;
* **the leader** alone writes the transition log and the saved states
  (the recorder's writes carry its election's guard); every node follows
  the log (``l/``) and streams it to its ``events`` subscribers, so any
  node resumes a stream by ``Last-Event-ID``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from healthgate.cluster.election import Election
from healthgate.cluster.ledger import LeaderLedger
from healthgate.cluster.membership import MEMBERS, api_of, join, member_of, members_of
from healthgate.cluster.opinions import OPINIONS, OpinionWriter
from healthgate.cluster.probing import ClusterProbing, ClusterSettings
from healthgate.cluster.session import Session
from healthgate.cluster.sweeper import OpinionSweeper, StateSweeper
from healthgate.cluster.traffic import TRAFFIC, ClusterTraffic
from healthgate.controlplane.recorder import TransitionRecorder
from healthgate.controlplane.saved_states import engine_states
from healthgate.store.base import WRITE_ID, Guard, StoreError, decode_json, sane_time
from healthgate.store.etcd import EtcdStore
from healthgate.store.etcd_client import Event, KeyValue, follow

log = logging.getLogger("healthgate.cluster")

ELECTION = "e/decisions/"
LOG = "l/"
# a new leader writes the transitions it computed that no leader wrote, of this long ago at most
TAKE_OVER_HORIZON = 60.0

__all__ = ["ClusterNode", "ClusterProbing", "ClusterSettings"]


class ClusterNode:
    """Membership, election and the watches of one node (see the module doc)."""

    def __init__(
        self,
        store: EtcdStore,
        settings: ClusterSettings,
        probing: ClusterProbing,
        recorder: TransitionRecorder,
    ) -> None:
        self.store = store
        self.client = store.client
        self.settings = settings
        self.probing = probing
        self.recorder = recorder
        self.session = Session(self.client, settings.lease_ttl)
        self.writer = OpinionWriter(
            self.client, self.session, MEMBERS + settings.node, settings.node
        )
        probing.writer = self.writer
        probing.beat = self.session.beat  # (long placements keep the session alive)
        # TRAFFIC health sources: this node's verdicts out, the nodes' quorum in
        self.traffic = ClusterTraffic(
            self.client, self.session, MEMBERS + settings.node, settings.node, probing.feed,
            probing.clock,
        )  # fmt: skip
        self.election = Election(self.client, ELECTION, settings.node, self._elected, self._deposed)
        # the leader deletes the opinions of endpoints that left the world,
        # and of vantages their checks no longer have
        self.sweeper = OpinionSweeper(
            self.client,
            lambda: probing.opinions,
            probing.endpoint_vantages,
            lambda: self.election.guard if self.leading else None,
            settings.sweep_every,
        )
        # ... and the saved states of resources that left while no node led
        self.state_sweeper = StateSweeper(
            lambda: store.load_states().keys(),
            probing.feed.engine.knows,
            recorder.delete_states,
            lambda: self.leading,
            settings.sweep_every,
        )
        self._tasks: list[asyncio.Task[Any]] = []
        self._campaign: asyncio.Task[None] | None = None
        self._members: dict[str, str] = {}  # as the member watch has them (placed per batch)
        self.apis: dict[str, str] = {}  # node -> its API's address (from its member key)
        # the recorder writes only while this node leads, under the election's guard
        self.ledger = LeaderLedger(store, lambda: self.election.guard)
        recorder.attach(self.ledger)

    @property
    def leader(self) -> str | None:
        return self.election.leader

    @property
    def leading(self) -> bool:
        """Elected, under a session that is still alive (a node cut off from
        etcd says it no longer leads the moment its lease may have ended)."""
        return self.election.leading and self.session.alive

    async def start(self) -> None:
        """Join, read the members and opinions (so the first placement is
        right), then follow everything."""
        await self.session.open()
        await self._join()
        client = self.client
        rev_m, members = await asyncio.to_thread(client.list_prefix, MEMBERS)
        self.probing.set_members(members_of(members))
        self.apis = {kv.key[len(MEMBERS) :]: api for kv in members if (api := api_of(kv))}
        rev_o, opinions = await asyncio.to_thread(client.list_prefix, OPINIONS)
        self.probing.load_opinions(opinions)
        rev_t, verdicts = await asyncio.to_thread(client.list_prefix, TRAFFIC)
        self.traffic.load(verdicts)
        self.recorder.last_id = await asyncio.to_thread(self.store.last_log_id)
        log_rev, _ = await asyncio.to_thread(client.list_prefix, "m/log")
        spawn = self._spawn
        self._members = dict(self.probing.members)
        spawn(
            follow(
                client,
                MEMBERS,
                rev_m,
                self._members_reset,
                self._member_event,
                settled=self._members_settled,
            ),
            "members",
        )
        probing = self.probing
        spawn(
            follow(
                client,
                OPINIONS,
                rev_o,
                probing.load_opinions,
                probing.opinion_changed,
                settled=probing.opinions_settled,
            ),
            "opinions",
        )
        spawn(follow(client, LOG, log_rev, lambda _kvs: None, self._log_event), "log")
        spawn(follow(client, TRAFFIC, rev_t, self.traffic.load, self.traffic.changed), "traffic")
        spawn(self.writer.run(), "opinion-writer")
        spawn(self.traffic.run(), "traffic-writer")
        spawn(self._keep_session(), "session")
        spawn(self._resync(), "resync")
        spawn(self.sweeper.run(), "opinion-sweeper")
        spawn(self.state_sweeper.run(), "state-sweeper")
        spawn(self._compact(), "compaction")
        self._campaign = spawn(self.election.campaign(self.session), "election")

    async def _join(self) -> None:
        s = self.settings
        await join(self.client, self.session, s.node, s.region, s.api_url)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=f"cluster-{name}")
        self._tasks.append(task)
        return task

    # ------------------------------------------------------------------ the session

    async def _keep_session(self) -> None:
        """A lost session: step down and stop saying opinions at once, then
        join again as soon as etcd answers (see the module doc)."""
        while True:
            await self.session.lost.wait()
            self.probing.left()
            self.election.forget_campaign()
            if self._campaign is not None:
                self._campaign.cancel()
            await self.session.close(revoke=True)  # (best effort: it may be gone already)
            while True:
                try:
                    await self.session.open()
                    await self._join()
                    revision, opinions = await asyncio.to_thread(self.client.list_prefix, OPINIONS)
                    break
                except StoreError as exc:
                    log.info("cannot join again yet: %s", exc)
                    await asyncio.sleep(1.0)
            self.probing.joined(opinions, revision)
            self.traffic.rewrite()  # (its verdicts went with the old lease)
            log.warning("node %s joined again (session %d)", self.settings.node, self.session.epoch)
            self._campaign = self._spawn(self.election.campaign(self.session), "election")

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_every)
            queued = self.probing.resync()
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

    # ------------------------------------------------------------------ followers

    def _members_reset(self, kvs: list[KeyValue]) -> None:
        self._members = members_of(kvs)
        self.apis = {kv.key[len(MEMBERS) :]: api for kv in kvs if (api := api_of(kv))}
        self.probing.set_members(dict(self._members))

    def peers(self) -> dict[str, str]:
        """The other live nodes' API addresses (node -> URL)."""
        return {
            n: url for n, url in self.apis.items() if n != self.settings.node and n in self._members
        }

    def _member_event(self, ev: Event) -> None:
        """One member event; placed at the end of its batch (a node's old key
        deleted and its new one created, delivered together after a cut,
        move nothing)."""
        members = self._members
        if ev.deleted:
            members.pop(ev.kv.key[len(MEMBERS) :], None)
            self.apis.pop(ev.kv.key[len(MEMBERS) :], None)
        else:
            member = member_of(ev.kv)
            if member is None:
                return
            members[member[0]] = member[1]
            api = api_of(ev.kv)
            if api is not None:
                self.apis[member[0]] = api

    def _members_settled(self) -> None:
        for node in sorted(set(self.probing.members) - set(self._members)):
            log.warning("node %s left (its lease ended)", node)
        self.probing.set_members(dict(self._members))

    def _log_event(self, ev: Event) -> None:
        """A record the leader wrote, to this node's subscribers (checked:
        an id and a JSON object with a sane time; else skipped, logged)."""
        if ev.deleted or ev.kv.key == LOG:
            return
        try:
            event_id = int(ev.kv.key[len(LOG) :])
            record = decode_json(ev.kv.value)
            if not isinstance(record, dict) or event_id <= 0:
                raise ValueError("not a record")
            record.pop(WRITE_ID, None)
            record["time"] = sane_time(record.get("time", 0.0))
        except (ValueError, TypeError) as exc:
            log.warning("skipping the log key %s: %s", ev.kv.key[:80], exc)
            return
        self.recorder.publish((event_id, record))
        if record.get("kind") == "Change" and record.get("action") == "hold-release":
            # an admin released a failover storm hold on some node: every node's engine
            hold, actor = record.get("hold"), record.get("actor")
            if isinstance(hold, str) and isinstance(actor, str):
                self.probing.feed.release_hold(record["time"], hold, actor)

    # ------------------------------------------------------------------ leading

    def _elected(self, _guard: Guard) -> None:
        # what fell between two leaders is written now: the transitions
        # this node computed that no leader wrote (the last minute's),
        # and the stored states made whole (the ledger's writes carry the
        # election's guard: cluster/ledger.py)
        clock = self.probing.clock
        self.ledger.take_over(clock() - TAKE_OVER_HORIZON)
        self.recorder.save(engine_states(self.probing.feed.engine))
        log.warning("this node (%s) leads: it writes the decisions", self.settings.node)

    def _deposed(self, why: str) -> None:
        level = logging.INFO if why in ("stopping", "resigned") else logging.WARNING
        log.log(level, "this node no longer leads: %s", why)
        self.recorder.stop_persisting()

    def status(self) -> dict[str, Any]:
        probing = self.probing
        return {
            "node": self.settings.node,
            "region": self.settings.region,
            "leader": self.leader,
            "leading": self.leading,
            "member": probing.member and self.session.alive,
            "members": dict(sorted(probing.members.items())),
            "probing": len(probing.mine),
            "probingByNode": dict(sorted(probing.shares.items())),
            "etcdMember": self.client.members.current(),  # the member this node talks to now
            "opinionWrites": self.writer.writes,
            "trafficVerdictWrites": self.traffic.writes,
            "opinionsDropped": self.writer.dropped,
            "opinionsSwept": self.sweeper.swept,  # of endpoints or vantages gone
            "statesSwept": self.state_sweeper.swept,  # of resources gone while no node led
            # etcd watches that broke, and those broken again and again at one
            # revision (this node sees nothing past it there: docs/cluster.md)
            "etcdWatchBreaks": self.client.watch_breaks,
            "etcdWatchesStuck": self.client.watches_stuck,
            # transitions this node decided in the last minute that the log does not hold yet
            "unwrittenRecords": self.ledger.unwritten(self.probing.clock() - TAKE_OVER_HORIZON),
            # seconds from a prober's flip to this node's route change, the last ones
            "routeLags": [round(x, 6) for x in probing.route_lags],
        }

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.election.step_down("stopping")
        with contextlib.suppress(Exception):
            await self.session.close(revoke=True)  # the others take over at once
