"""The session-affinity cookie's key in a cluster (SPEC §9): one pair for
every node, so a cookie issued by one node verifies on every other.

``m/affinity-key`` -> the hex of the signing key, then (after a rotation)
the previous one, one per line. The first node to start creates it (a
create-if-absent transaction: two nodes starting at once agree on one);
every node reads it back. **Read, never trusted**: a value that is not one
or two keys of :data:`~healthgate.dataplane.affinity.KEY_BYTES` is refused
with an error naming the key, and serve does not start on it.

Rotation: ``healthgate``'s embedded store rotates its key file weekly; in a
cluster the stored pair is kept as it is (rotate it by writing a new first
line and keeping the old one as the second, then restarting the nodes).
"""

from __future__ import annotations

import secrets

from healthgate.dataplane.affinity import KEY_BYTES
from healthgate.store.base import StoreError
from healthgate.store.etcd_client import EtcdClient

AFFINITY_KEY = "m/affinity-key"
MAX_VALUE = 4 * KEY_BYTES + 8


def parse_keys(raw: bytes) -> list[bytes]:
    """The keys in a stored value (ValueError when it is not one or two keys)."""
    if len(raw) > MAX_VALUE:
        raise ValueError("too long")
    keys = [bytes.fromhex(line) for line in raw.decode("ascii").split()]
    if not 1 <= len(keys) <= 2 or any(len(k) != KEY_BYTES for k in keys):
        raise ValueError(f"not one or two keys of {KEY_BYTES} bytes")
    return keys


def shared_affinity_keys(client: EtcdClient) -> list[bytes]:
    """The cluster's pair (created by the first node to ask)."""
    client.create(AFFINITY_KEY, secrets.token_bytes(KEY_BYTES).hex().encode(), 0)
    kvs = client.range(client.key(AFFINITY_KEY)).kvs
    if not kvs:
        raise StoreError(f"etcd key {AFFINITY_KEY}: missing right after it was created")
    try:
        return parse_keys(bytes(kvs[0].value))
    except (ValueError, UnicodeDecodeError) as exc:
        raise StoreError(
            f"etcd key {AFFINITY_KEY}: not the session-affinity keys ({exc}); "
            "delete it and restart the nodes: the first writes a new one"
        ) from None
