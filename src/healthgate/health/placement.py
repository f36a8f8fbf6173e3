"""Who probes what: rendezvous hashing of endpoints over the live nodes.

Pure functions, no I/O. Each endpoint has one or more *vantages* (its own
region, plus the health check's ``vantageRegions``); each vantage is probed
by one live node of that region, chosen by rendezvous (highest random
weight) hashing of the endpoint and vantage over the region's nodes, so that
when a node joins or dies only the endpoints it wins or held move. A region
with no live node has its *own* endpoints probed by the nodes of the other
regions (the caller logs it); an extra vantage with no live node has no
prober and no opinion.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping, Sequence


def weight(node: str, key: str) -> int:
    digest = hashlib.blake2b(f"{node}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous(key: str, nodes: Iterable[str]) -> str | None:
    """The node with the highest weight for ``key`` (None: no node)."""
    best, best_w = None, -1
    for node in nodes:
        w = weight(node, key)
        if w > best_w or (w == best_w and best is not None and node < best):
            best, best_w = node, w
    return best


def by_region(members: Mapping[str, str]) -> dict[str, list[str]]:
    """node -> region, turned into region -> sorted nodes."""
    out: dict[str, list[str]] = {}
    for node, region in members.items():
        out.setdefault(region, []).append(node)
    for nodes in out.values():
        nodes.sort()
    return out


def probers(
    endpoint: str,
    own_region: str,
    vantages: Sequence[str],
    regions: Mapping[str, Sequence[str]],
) -> dict[str, str]:
    """vantage region -> the node that probes ``endpoint`` for it.

    ``regions`` is :func:`by_region` of the live members. A vantage missing
    from the answer has no live prober (no opinion)."""
    out: dict[str, str] = {}
    for vantage in vantages:
        nodes: Sequence[str] = regions.get(vantage, ())
        if not nodes and vantage == own_region:
            nodes = sorted(n for ns in regions.values() for n in ns)  # the others stand in
        owner = rendezvous(f"{endpoint}|{vantage}", nodes)
        if owner is not None:
            out[vantage] = owner
    return out


class Moves:
    """Which endpoints a membership change can move, asked one endpoint at a
    time - so that a node joining or leaving costs the endpoints it moves,
    not a placement of the whole world (at 100,000 endpoints a full
    placement blocked a node's event loop for seconds: past its lease's TTL
    on a loaded machine, which lost its session, which moved the members
    again).

    Rendezvous hashing moves only what the change touches: a node that left
    takes the endpoints it probed with it; a node that joined takes the
    ones it now wins (its weight above their owner's); a region that gained
    its first node or lost its last changes who stands in for its own
    endpoints and whether its vantage has a prober. Anything else keeps its
    probers. The answer is never short (an endpoint it says stays keeps
    exactly its probers) and errs towards moving only for endpoints with
    several vantages (placed again, which is always right)."""

    __slots__ = ("_added", "_all_added", "_flipped", "_joiners", "_live", "_removed")

    def __init__(self, before: Mapping[str, str], after: Mapping[str, str]) -> None:
        """``before``, ``after``: the live members (node -> region)."""
        self._removed = frozenset(n for n, r in before.items() if after.get(n) != r)
        added = [n for n, r in after.items() if before.get(n) != r]
        self._all_added = tuple(sorted(added))
        self._joiners: dict[str, list[str]] = {}  # region -> nodes that joined it
        for n in self._all_added:
            self._joiners.setdefault(after[n], []).append(n)
        self._live = frozenset(after.values())
        self._flipped = frozenset(before.values()) ^ self._live
        self._added = bool(added)

    @property
    def regions_changed(self) -> bool:
        """A region gained its first live node or lost its last."""
        return bool(self._flipped)

    def moves(
        self, endpoint: str, own_region: str, vantages: Sequence[str], owners: Collection[str]
    ) -> bool:
        """Whether the endpoint's probers may change. ``owners``: the nodes
        that probe it now (every vantage's, as :func:`probers` placed them
        under the members before)."""
        if not self._removed.isdisjoint(owners):
            return True
        if not self._flipped.isdisjoint(vantages):
            return True
        if not self._added:
            return False
        standing_in = own_region not in self._live  # every node probes it for its region
        if len(vantages) != 1 or len(owners) != 1:
            if standing_in:
                return True
            return any(v in self._joiners for v in vantages)
        rivals = self._all_added if standing_in else self._joiners.get(own_region, ())
        if not rivals:
            return False
        key = f"{endpoint}|{vantages[0]}"
        (owner,) = owners
        best = weight(owner, key)
        for node in rivals:
            w = weight(node, key)
            if w > best or (w == best and node < owner):
                return True
        return False
