"""Membership: who is alive, and in which region.

Each node holds ``n/<node>`` -> ``{"region", "started"}`` under its
session's lease (cluster/session.py): the key lives as long as the node
does, and every node follows the prefix to know the live members.

A node name is unique: the key is *created* only if absent (one etcd
transaction), so two nodes started together with one name cannot both
join. A key held under another lease - another live node, or this node's
previous life whose lease has not ended yet - is waited for, up to the
lease TTL and a little more, and then refused with the reason.

Members read from etcd are checked: a key that is not a node name or a
value without a region name is skipped and logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Iterable

from healthgate.cluster.session import Session
from healthgate.model.names import is_valid_name
from healthgate.store.base import StoreError, decode_json
from healthgate.store.etcd_client import EtcdClient, KeyValue

log = logging.getLogger("healthgate.cluster")

MEMBERS = "n/"
API_RE = re.compile(
    r"https?://[A-Za-z0-9.\-]{1,253}(?::[0-9]{1,5})?|https?://\[[0-9a-fA-F:.]{2,45}\](?::[0-9]{1,5})?"
)


class NameTaken(StoreError):
    """Another live node has this node's name."""


def member_of(kv: KeyValue) -> tuple[str, str] | None:
    """(node, region) of a member key; None (logged) when it cannot be trusted."""
    node = kv.key[len(MEMBERS) :]
    try:
        region = decode_json(kv.value)["region"]
    except (ValueError, KeyError, TypeError):
        region = None
    if not is_valid_name(node) or not isinstance(region, str) or not is_valid_name(region):
        log.warning("ignoring the member key %s: not a node name and region", kv.key[:120])
        return None
    return node, region


def api_of(kv: KeyValue) -> str | None:
    """The API address a member key advertises (None: none, or not one:
    ``http(s)://HOST:PORT`` and nothing more, at most 300 characters)."""
    try:
        api = decode_json(kv.value).get("api")
    except (ValueError, AttributeError, TypeError):
        return None
    if not isinstance(api, str) or len(api) > 300 or not API_RE.fullmatch(api):
        return None
    return api


def members_of(kvs: Iterable[KeyValue]) -> dict[str, str]:
    """node -> region of the member keys that can be trusted."""
    return dict(m for m in map(member_of, kvs) if m is not None)


async def join(client: EtcdClient, session: Session, node: str, region: str, api: str = "") -> None:
    """Create this node's member key under ``session`` (see the module doc),
    with the address its API answers on (for the others' convergence views)."""
    key = MEMBERS + node
    value = json.dumps({"region": region, "started": time.time(), "api": api}).encode()
    deadline = time.monotonic() + session.ttl + 2
    told = False
    while True:
        created, _ = await asyncio.to_thread(client.create, key, value, session.id)
        if created:
            log.info(
                "node %s (%s) joined with lease %x, TTL %ds", node, region, session.id, session.ttl
            )
            return
        if time.monotonic() > deadline:
            raise NameTaken(
                f"--node {node}: another live node has this name "
                "(node names must be unique in a cluster)"
            )
        if not told:
            log.info("waiting for the lease of a previous node %s to end", node)
            told = True
        await asyncio.sleep(0.5)
