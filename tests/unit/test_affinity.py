"""Session affinity's pure parts (SPEC §9, dataplane/affinity.py): the
weighted rendezvous hash keeps its promises (the split, what a dial change
moves, what a failure moves), and the cookie cannot be forged, replayed
past its lifetime or broken by a key rotation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from healthgate.dataplane.affinity import (
    COOKIE,
    ROTATE_AFTER,
    CookieSigner,
    cookie_value,
    key_of,
    load_keys,
    rank,
    rendezvous,
    set_cookie,
    tag_of,
)
from healthgate.model.resources import BackendService
from healthgate.model.validation import parse_resource
from tests.helpers import example_world

TAGS = (tag_of("projects/shop/regions/us-east1/serviceAttachments/a"),
        tag_of("projects/shop/regions/europe-west1/serviceAttachments/a"),
        tag_of("projects/shop/regions/asia-east1/serviceAttachments/a"))  # fmt: skip
CLIENTS = [key_of(f"client-{i}".encode()) for i in range(10_000)]


def assign(weights: tuple[float, ...]) -> list[int]:
    return [rendezvous(k, TAGS[: len(weights)], weights) for k in CLIENTS]


@pytest.mark.parametrize(
    "weights",
    [(70.0, 30.0), (50.0, 50.0), (99.0, 1.0), (60.0, 30.0, 10.0), (1.0, 1.0, 1.0)],
)
def test_the_split_follows_the_weights(weights: tuple[float, ...]) -> None:
    got = assign(weights)
    total = sum(weights)
    for i, w in enumerate(weights):
        share = 100 * got.count(i) / len(got)
        # 10,000 draws: the standard deviation is at most 0.5 point
        assert abs(share - 100 * w / total) <= 2.0, (i, share, weights)


@pytest.mark.parametrize(
    ("before", "after", "ideal"),
    [
        ((70.0, 30.0), (60.0, 40.0), 10.0),
        ((70.0, 30.0), (30.0, 70.0), 40.0),
        ((50.0, 50.0), (50.0, 0.0), 50.0),
        ((60.0, 30.0, 10.0), (50.0, 30.0, 20.0), 10.0),
    ],
)
def test_a_change_of_shares_moves_only_the_clients_it_must(
    before: tuple[float, ...], after: tuple[float, ...], ideal: float
) -> None:
    a, b = assign(before), assign(after)
    moved = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    percent = 100 * len(moved) / len(CLIENTS)
    assert percent <= ideal * 1.2 + 1.0, (percent, ideal)
    # nobody moves *to* a target that lost weight, nor away from one that gained
    for x, y in moved:
        assert after[x] < before[x] or after[y] > before[y], (x, y)


def test_a_failed_target_moves_only_its_clients_and_they_come_back() -> None:
    weights = (40.0, 30.0, 30.0)
    before = assign(weights)
    failed = assign((40.0, 0.0, 30.0))
    for x, y in zip(before, failed, strict=True):
        assert x in (y, 1), (x, y)  # (only region 1's clients moved)
    assert 1 not in failed
    assert assign(weights) == before  # back, every one of them


def test_rank_puts_the_assigned_target_first_then_the_next_choices() -> None:
    for k in CLIENTS[:500]:
        order = rank(k, TAGS, (1.0, 2.0, 0.0))
        assert order[0] == rendezvous(k, TAGS, (1.0, 2.0, 0.0))
        assert sorted(order) == [0, 1]  # (weight 0: not a candidate)
    assert rendezvous(CLIENTS[0], TAGS, (0.0, 0.0)) == -1


def test_the_same_key_gets_the_same_answer_in_every_process() -> None:
    # blake2b and splitmix64, no per-process hash seed: pinned, so a change
    # of the hash (which would move every client at an upgrade) is seen here
    assert key_of(b"10.0.0.1") == 0xE6034DE146F68E53


KEY_A, KEY_B = b"a" * 32, b"b" * 32


def test_a_cookie_verifies_and_names_its_client_and_target() -> None:
    signer = CookieSigner([KEY_A])
    value = signer.issue("00000000000000ab", 1_000_000.0, "client-1")
    got = signer.read(value, 1_000_010.0, ttl=0)
    assert got is not None and (got.client, got.target) == ("client-1", "00000000000000ab")


@pytest.mark.parametrize(
    "tamper",
    [
        lambda v: v.replace("00000000000000ab", "00000000000000ac"),  # another target
        lambda v: "other" + v[5:],  # another client
        lambda v: v[:-2] + ("AA" if v[-2:] != "AA" else "BB"),  # the mac
        lambda v: v + ".x",  # a fifth part
        lambda v: v.rsplit(".", 1)[0],  # no mac
        lambda v: "x" * 200,  # too long
        lambda v: "",
    ],
)
def test_a_forged_cookie_is_not_ours(tamper: object) -> None:
    signer = CookieSigner([KEY_A])
    value = signer.issue("00000000000000ab", 1_000_000.0, "client-1")
    assert callable(tamper)
    assert signer.read(tamper(value), 1_000_010.0, ttl=0) is None


def test_a_cookie_expires_with_its_ttl_and_one_from_the_future_is_refused() -> None:
    signer = CookieSigner([KEY_A])
    value = signer.issue("-", 1_000_000.0, "c")
    assert signer.read(value, 1_000_000.0 + 3600, ttl=3600) is not None
    assert signer.read(value, 1_000_000.0 + 3601, ttl=3600) is None
    assert signer.read(value, 1_000_000.0 + 10**7, ttl=0) is not None  # a session cookie
    assert signer.read(value, 1_000_000.0 - 301, ttl=0) is None


def test_a_rotation_breaks_no_session() -> None:
    old = CookieSigner([KEY_A]).issue("-", 1_000_000.0, "c")
    rotated = CookieSigner([KEY_B, KEY_A])
    assert rotated.read(old, 1_000_001.0, 0) is not None
    assert CookieSigner([KEY_B]).read(old, 1_000_001.0, 0) is None  # (two rotations later)


def test_the_cookie_header_is_read_and_written() -> None:
    assert cookie_value(b"a=1; HG_AFFINITY=abc.def; b=2") == "abc.def"
    assert cookie_value(b"a=1") is None
    assert cookie_value(None) is None
    assert cookie_value(b"HG_AFFINITY=" + b"x" * 500) is None
    assert cookie_value(b"HG_AFFINITY=\xff") is None
    line = set_cookie("v", 60)
    assert (
        line == f"Set-Cookie: {COOKIE}=v; Path=/; HttpOnly; SameSite=Lax; Max-Age=60\r\n".encode()
    )
    assert b"Max-Age" not in set_cookie("v", 0)


def test_keys_are_kept_0600_and_rotated_when_old(tmp_path: Path) -> None:
    path = tmp_path / "s.db.affinity-key"
    first = load_keys(path)
    assert len(first) == 1 and len(first[0]) == 32
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_keys(path) == first  # (read again, not replaced)
    old = path.stat().st_mtime - ROTATE_AFTER - 10
    os.utime(path, (old, old))
    rotated = load_keys(path)
    assert rotated[1] == first[0] and rotated[0] != first[0]
    path.write_text("not hex\n")
    assert len(load_keys(path)) == 1  # (unreadable: a new key, not a crash)


def _backend_service(project: str) -> dict[str, object]:
    return next(
        dict(d)
        for d in example_world()
        if d["kind"] == "BackendService" and d["project"] == project
    )


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"sessionAffinity": "STICKY"}, "sessionAffinity"),
        ({"sessionAffinity": "HEADER_FIELD"}, "affinityHeader"),
        ({"sessionAffinity": "HEADER_FIELD", "affinityHeader": "X-User\r\nX: 1"}, "affinityHeader"),
        ({"sessionAffinity": "HEADER_FIELD", "affinityHeader": "x" * 65}, "affinityHeader"),
        ({"sessionAffinity": "CLIENT_IP", "affinityHeader": "X-User"}, "affinityHeader"),
        ({"sessionAffinity": "CLIENT_IP", "affinityCookieTtlSec": 60}, "affinityCookieTtlSec"),
        (
            {"sessionAffinity": "GENERATED_COOKIE", "affinityCookieTtlSec": -1},
            "affinityCookieTtlSec",
        ),
        ({"sessionAffinity": "GENERATED_COOKIE", "protocol": "TCP"}, "sessionAffinity"),
        ({"failoverPolicy": {"stickyFailback": "maybe"}}, "stickyFailback"),
    ],
)
def test_bad_affinity_fields_are_refused_by_name(fields: dict[str, object], named: str) -> None:
    doc = {**_backend_service("web"), **fields}
    resource, issues = parse_resource(doc)
    assert resource is None
    assert any(named in f"{i.field} {i.message}" for i in issues), issues


@pytest.mark.parametrize(
    "fields",
    [
        {"sessionAffinity": "GENERATED_COOKIE", "affinityCookieTtlSec": 3600},
        {"sessionAffinity": "HEADER_FIELD", "affinityHeader": "X-User"},
        {"sessionAffinity": "CLIENT_IP", "failoverPolicy": {"stickyFailback": True}},
    ],
)
def test_good_affinity_fields_are_taken(fields: dict[str, object]) -> None:
    resource, issues = parse_resource({**_backend_service("web"), **fields})
    assert resource is not None, issues
    assert isinstance(resource, BackendService)
    assert resource.session_affinity == fields["sessionAffinity"]
