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
from collections.abc import Iterable, Mapping, Sequence


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
