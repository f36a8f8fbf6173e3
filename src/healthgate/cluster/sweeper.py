"""Opinions of endpoints that left the world, or of vantages they no longer
have, deleted by the leader.

An opinion (``o/<endpoint path>/<vantage region>``: cluster/opinions.py)
is written by the endpoint's prober, and by no one else. When an endpoint
leaves the world (its NEG, its instance or its backend service removed),
nobody probes it and nobody would ever delete its opinions: they would stay
in etcd for ever - listed by every node when it starts or joins again, held
in every node's memory, in etcd's space - and a world whose endpoints come
and go (autoscaled groups) would grow them without end. The same holds for
the opinions of a vantage region taken out of a health check's
``vantageRegions``: nobody probes from there any more, and nothing counts
them (health/vantage.py counts the endpoint's vantages only).

The elected node sweeps them (:class:`OpinionSweeper`), every ``every``
seconds (``--opinion-sweep-sec``, 300 by default):

* it looks for opinions whose endpoint is in no backend service of the
  world as the serving engine has it now, or whose vantage is not one of
  that endpoint's vantages now (its own region and its check's
  ``vantageRegions``);
* it deletes only those it found at its previous look too, at the same
  revision: an endpoint gone for a whole sweep interval, never one that a
  reload or a quick remove-and-add hid for a moment (so an opinion goes
  one to two intervals after its endpoint or its vantage);
* each delete compares, inside its transaction, every key's revision and
  the leader's election key: an opinion written meanwhile (the endpoint is
  back and probed), or a leader that was deposed, deletes nothing. A batch
  whose compare fails is tried again key by key.

Every node's opinion watch then drops them (cluster/probing.py). A node that
does not lead forgets what it suspected: a new leader looks twice.

**Saved states** (:class:`StateSweeper`, at the same interval): the leader
deletes a resource's saved states when the resource leaves the world
(controlplane/recorder.py ``on_forget``); one that left while no node led
(between a leader's end and the next one's election) left them behind for
ever. The leader lists the saved states at each look and deletes, through
its recorder (in order with its other writes, under the election's guard),
those of endpoints, sources, composites, NEGs and front ends absent from
its engine at this look and the previous one, and still absent as the
delete is queued. Other saved states (a webhook's deliveries) are not its
to judge.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from healthgate.cluster.opinions import Opinion, opinion_key
from healthgate.store.base import Guard, StoreError
from healthgate.store.etcd_client import MAX_OPS, EtcdClient

log = logging.getLogger("healthgate.cluster")

SWEEP_EVERY = 300.0
LOOK_STEP = 10_000  # endpoints looked at between two turns of the event loop


class OpinionSweeper:
    def __init__(
        self,
        client: EtcdClient,
        opinions: Callable[[], Mapping[str, Mapping[str, Opinion]]],
        vantages: Callable[[str], Collection[str] | None],
        guard: Callable[[], Guard | None],
        every: float = SWEEP_EVERY,
    ) -> None:
        self.client = client
        self.opinions = opinions  # endpoint path -> vantage -> opinion, as this node holds them
        # an endpoint path's vantage regions in the world now (None: not in it)
        self.vantages = vantages
        self.guard = guard  # the election's, while this node leads
        self.every = every
        self.swept = 0  # opinions deleted by this node
        self._suspects: dict[str, int] = {}  # opinion key -> revision, found at the last look

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            await self.sweep()

    async def sweep(self) -> int:
        """One look, and the deletes it makes due; how many were deleted."""
        guard = self.guard()
        if guard is None:
            self._suspects = {}
            return 0
        due = self.due(await self.look())
        if not due:
            return 0
        try:
            deleted = await asyncio.to_thread(self.delete, due, guard)
        except StoreError as exc:
            log.warning("could not delete the opinions nothing counts any more: %s", exc)
            return 0
        if deleted:
            log.info(
                "deleted %d opinions of endpoints gone from the world or of vantages "
                "they no longer have",
                deleted,
            )
        self.swept += deleted
        return deleted

    async def look(self) -> dict[str, int]:
        """The opinions whose endpoint is not in the world, or whose vantage
        is not one of its vantages: key -> revision. (On the event loop,
        where this node's opinions live, LOOK_STEP endpoints at a time: a
        look at 200,000 endpoints is ~0.15 s of Python.)"""
        vantages_of = self.vantages
        paths = list(self.opinions())
        found: dict[str, int] = {}
        for start in range(0, len(paths), LOOK_STEP):
            if start:
                await asyncio.sleep(0)
            held = self.opinions()  # (as it is now: a watch's restart replaces it)
            for path in paths[start : start + LOOK_STEP]:
                ops = held.get(path)
                if ops is None:
                    continue
                vantages = vantages_of(path)
                for vantage, op in ops.items():
                    if vantages is None or vantage not in vantages:
                        found[opinion_key(path, vantage)] = op.revision
        return found

    def due(self, found: dict[str, int]) -> dict[str, int]:
        """Of the opinions found now, those found at the last look too, at
        the same revision; the others are remembered for the next."""
        suspects = self._suspects
        due = {k: r for k, r in found.items() if suspects.get(k) == r}
        self._suspects = {k: r for k, r in found.items() if k not in due}
        return due

    def delete(self, due: dict[str, int], guard: Guard) -> int:
        """(In a worker thread.) Delete what is due, in transactions of
        MAX_OPS keys under the guard; a batch whose compare fails key by key.
        How many were deleted."""
        client = self.client
        held = [client.created_at(guard.key, guard.revision)]
        keys = sorted(due.items())
        deleted = 0
        for i in range(0, len(keys), MAX_OPS):
            batch = keys[i : i + MAX_OPS]
            if client.delete_unchanged(batch, held):
                deleted += len(batch)
                continue
            if self.guard() is None:
                break  # deposed meanwhile: the next leader looks again
            deleted += sum(client.delete_unchanged([one], held) for one in batch)
        return deleted


# the saved states of the engine's resources (controlplane/saved_states.py)
ENGINE_STATES = ("endpoint", "node", "route", "ramp")


class StateSweeper:
    def __init__(
        self,
        keys: Callable[[], Iterable[str]],
        knows: Callable[[str], bool],
        delete: Callable[[Sequence[str]], None],
        leading: Callable[[], bool],
        every: float = SWEEP_EVERY,
    ) -> None:
        self.keys = keys  # (in a worker thread) every saved state's key
        self.knows = knows  # is a resource of this path in the engine now?
        self.delete = delete  # queue these keys' deletes with the leader's writes
        self.leading = leading
        self.every = every
        self.swept = 0  # saved states this node deleted
        self._suspects: set[str] = set()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            try:
                await self.sweep()
            except StoreError as exc:
                log.warning("could not list the saved states: %s", exc)

    def _gone(self, key: str) -> bool:
        kind, _, path = key.partition("/")
        return kind in ENGINE_STATES and not self.knows(path)

    async def sweep(self) -> int:
        """One look, and the deletes it makes due; how many were queued."""
        if not self.leading():
            self._suspects = set()
            return 0
        keys = list(await asyncio.to_thread(self.keys))
        found: set[str] = set()
        for start in range(0, len(keys), LOOK_STEP):
            if start:
                await asyncio.sleep(0)
            found.update(k for k in keys[start : start + LOOK_STEP] if self._gone(k))
        # due: found at the last look too, and gone still now (no await from
        # here to the queued delete: a resource back meanwhile keeps its state)
        due = sorted(k for k in found & self._suspects if self._gone(k))
        self._suspects = found - set(due)
        if not due or not self.leading():
            return 0
        self.delete(due)
        self.swept += len(due)
        log.info("deleting %d saved states of resources gone from the world", len(due))
        return len(due)
