"""Session affinity (SPEC §9): which region (or endpoint) a client keeps.

**The hash.** A client's key (its address, its generated cookie's id or the
value of a header) is assigned among weighted targets by *weighted
rendezvous hashing* (highest random weight): each target scores
``weight / -ln(u)`` with ``u`` a uniform draw derived from (key, target),
and the highest score wins. The probability of a target is exactly its
weight over the sum, and the assignment moves as little as a change must:

* a dial from 70/30 to 60/40 moves only clients of the target that lost
  weight (the others' winning scores only grew): the ideal 10 %;
* a target that fails (leaves the set) moves only its own clients; when it
  returns, exactly those come back;
* nothing is stored per client and every process (workers, cluster nodes)
  computes the same answer from the same key.

Why not Maglev or a ring: a route has a handful of regions, so scoring each
costs less than keeping a table, and rendezvous is exact where a table is
approximate (Maglev's disruption on removal, a ring's imbalance); weights
change by the second during ramps, which would rebuild a table each time.
A producer's endpoints are scored the same way, once per connection.

**The cookie** ``HG_AFFINITY`` (``GENERATED_COOKIE``): ``id.target.issued.mac``
- a random id (the client's key), the tag of the region it was sent to (for
``failoverPolicy.stickyFailback``), when it was issued (hex seconds) and an
HMAC-SHA256 of the rest under serve's key (truncated to 128 bits). A cookie
that does not verify, or has expired by ``affinityCookieTtlSec``, is
treated as absent (a new one is issued); a valid one only ever selects
among the targets that are eligible now, so forging one picks nothing that
is not. Verification accepts the previous key too: rotating the key breaks
no session (:class:`CookieSigner`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

COOKIE = "HG_AFFINITY"
COOKIE_B = COOKIE.encode() + b"="
MAX_COOKIE = 96  # a value longer than this is not ours
_MASK = (1 << 64) - 1
_SCALE = 1.0 / 2.0**64
KEY_BYTES = 32
ROTATE_AFTER = 7 * 86_400.0  # serve rotates its cookie key at start when older


def key_of(data: bytes) -> int:
    """A client key's 64-bit hash: the same in every process and node."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def tag_of(name: str) -> int:
    """A target's 64-bit tag (its attachment path, its endpoint's address)."""
    return key_of(name.encode())


def _mix(x: int) -> int:
    """splitmix64's finalizer: (key ^ tag) to a well-spread 64-bit value."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def rendezvous(key: int, tags: Sequence[int], weights: Sequence[float]) -> int:
    """The index of the target ``key`` is assigned to (-1: no weight > 0)."""
    best_i, best = -1, -1.0
    for i, w in enumerate(weights):
        if w <= 0:
            continue
        u = (_mix(key ^ tags[i]) + 0.5) * _SCALE  # in (0, 1)
        score = w / -math.log(u)
        if score > best:
            best_i, best = i, score
    return best_i


def rank(key: int, tags: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Every index with a weight > 0, the assigned one first, then in the
    order the key would be assigned if those before were gone."""
    scored = []
    for i, w in enumerate(weights):
        if w > 0:
            u = (_mix(key ^ tags[i]) + 0.5) * _SCALE
            scored.append((w / -math.log(u), i))
    scored.sort(reverse=True)
    return [i for _, i in scored]


@dataclass(frozen=True, slots=True)
class Cookie:
    client: str  # the id: the client's key
    target: str  # the tag (16 hex) of where it was sent, "-" for none
    issued: int  # unix seconds


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class CookieSigner:
    """Issues and verifies ``HG_AFFINITY`` cookies (see the module doc):
    signs with ``keys[0]``, accepts any of ``keys`` (the previous one after
    a rotation)."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys or any(len(k) < 16 for k in keys):
            raise ValueError("affinity keys: at least one, of 16 bytes or more")
        self.keys = tuple(keys)

    def _mac(self, key: bytes, body: str) -> str:
        return _b64(hmac.new(key, body.encode(), hashlib.sha256).digest()[:16])

    @staticmethod
    def new_client() -> str:
        """A new client's id (96 random bits)."""
        return _b64(secrets.token_bytes(12))

    def issue(self, target: str, now: float, client: str) -> str:
        """A cookie value for ``client`` sent to ``target``."""
        body = f"{client}.{target}.{int(now):x}"
        return f"{body}.{self._mac(self.keys[0], body)}"

    def read(self, value: str, now: float, ttl: int) -> Cookie | None:
        """The cookie if it is ours, intact and not expired, else None."""
        if len(value) > MAX_COOKIE:
            return None
        parts = value.split(".")
        if len(parts) != 4:
            return None
        client, target, issued_hex, mac = parts
        body = f"{client}.{target}.{issued_hex}"
        if not any(hmac.compare_digest(mac, self._mac(k, body)) for k in self.keys):
            return None
        try:
            issued = int(issued_hex, 16)
        except ValueError:
            return None
        if issued > now + 300 or (ttl and now - issued > ttl):
            return None
        return Cookie(client, target, issued)


def target_text(tag: int) -> str:
    return f"{tag:016x}"


def set_cookie(value: str, ttl: int) -> bytes:
    """The ``Set-Cookie`` line (CRLF included) for a generated cookie."""
    age = f"; Max-Age={ttl}" if ttl else ""
    return f"Set-Cookie: {COOKIE}={value}; Path=/; HttpOnly; SameSite=Lax{age}\r\n".encode()


def cookie_value(header: bytes | None) -> str | None:
    """``HG_AFFINITY``'s value in a ``Cookie`` header (None: absent)."""
    if not header:
        return None
    for raw in header.split(b";"):
        part = raw.strip()
        if part.startswith(COOKIE_B):
            value = part[len(COOKIE_B) :]
            if len(value) > MAX_COOKIE:
                return None
            try:
                return value.decode("ascii")
            except UnicodeDecodeError:
                return None
    return None


def load_keys(path: Path, now: float | None = None) -> list[bytes]:
    """serve's cookie keys, kept in ``path`` (0600; created when missing):
    the current one first, then the previous one. A key older than
    :data:`ROTATE_AFTER` is rotated (the old one still verifies)."""
    now = time.time() if now is None else now
    keys: list[bytes] = []
    try:
        text = path.read_text(encoding="ascii")
        keys = [bytes.fromhex(line) for line in text.split() if line][:2]
        age = now - path.stat().st_mtime
    except (OSError, ValueError):
        keys, age = [], 0.0
    keys = [k for k in keys if len(k) == KEY_BYTES]
    if keys and age < ROTATE_AFTER:
        return keys
    keys = [secrets.token_bytes(KEY_BYTES), *keys[:1]]
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write("\n".join(k.hex() for k in keys) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return keys
