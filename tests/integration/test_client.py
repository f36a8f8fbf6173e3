"""healthgate.client against a real serve: manifests, resources with
fingerprints, the errors it raises, and a watch of the log that survives a
server restart without skipping or repeating an event."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest

from healthgate.api.listener import IDLE_TIMEOUT
from healthgate.client import KEEPALIVE_EXPIRY, Client, Event, HealthgateError, Unreachable
from tests.helpers import example_world
from tests.integration.serve_proc import ServeProcess, wait_for
from tests.integration.servers import free_port


def test_the_client_lets_an_idle_connection_go_well_before_the_server_does() -> None:
    """A request sent on a kept-alive connection just as serve closes it for
    idleness meets a reset; httpx's default expiry equals serve's idle
    timeout (5 s), so a client polling every ~5 s met one now and then
    (the partition tests' client did, on CI). Ours lets go at half of it
    at most."""
    assert KEEPALIVE_EXPIRY <= IDLE_TIMEOUT / 2
    with Client("http://127.0.0.1:9") as hg:
        pool = hg.http._transport._pool  # type: ignore[attr-defined]  # (httpx keeps it private)
        assert pool._keepalive_expiry == KEEPALIVE_EXPIRY


def test_apply_get_list_replace_delete(tmp_path: Path) -> None:
    with ServeProcess(tmp_path / "s.db", "--no-dataplane") as serve, Client(serve.url) as hg:
        world = example_world()
        dry = hg.apply(world, dry_run=True)
        assert dry.dry_run and len(dry.created) == len(world)
        done = hg.apply(world)
        assert not done.dry_run and done.created == dry.created and done.revision
        assert hg.apply(world).unchanged == done.created  # (nothing to do the second time)
        check = hg.get("shop", "healthChecks", "http-8080", region="us-east1")
        assert check["kind"] == "HealthCheck"
        assert {c["name"] for c in hg.list("shop", "healthChecks", region="us-east1")} == {
            "http-8080"
        }
        changed = {**check, "checkIntervalSec": 7}
        stale = check["fingerprint"]
        hg.replace("shop", "healthChecks", "http-8080", changed, "us-east1", fingerprint=stale)
        with pytest.raises(HealthgateError) as refused:
            hg.replace("shop", "healthChecks", "http-8080", changed, "us-east1", fingerprint=stale)
        assert refused.value.code == 412 and refused.value.status == "FAILED_PRECONDITION"
        # an invalid manifest: the error names the field, the document, and changes nothing
        bad = [{**world[0], "checkIntervalSec": "often"}]
        with pytest.raises(HealthgateError) as invalid:
            hg.apply(bad)
        assert invalid.value.code == 400
        assert any(d.get("field") == "checkIntervalSec" for d in invalid.value.details)
        assert "checkIntervalSec" in invalid.value.describe()
        deleted = hg.delete_manifest(world)
        assert sorted(deleted.deleted) == sorted(done.created)
        assert hg.cluster() == {"mode": "embedded"} and hg.ready()


def test_a_token_from_a_file_and_unreachable(tmp_path: Path) -> None:
    token = "t" * 32
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"- {{token: {token}, project: shop, role: viewer}}\n")
    tokens.chmod(0o600)
    secret = tmp_path / "token"
    secret.write_text(token + "\n")
    secret.chmod(0o600)
    with ServeProcess(tmp_path / "s.db", "--no-dataplane", "--tokens", str(tokens)) as serve:
        with Client(serve.url) as anonymous, pytest.raises(HealthgateError) as no:
            anonymous.events("shop")
        assert no.value.code == 401
        with Client(serve.url, token_file=secret) as viewer:
            assert viewer.events("shop") == []
    with Client(f"http://127.0.0.1:{free_port()}") as nobody, pytest.raises(Unreachable):
        nobody.events("shop")


def test_a_watch_resumes_across_a_restart_without_gaps_or_repeats(tmp_path: Path) -> None:
    port = free_port()
    db = tmp_path / "s.db"
    world = example_world()  # its endpoints refuse: every region goes UNHEALTHY
    got: queue.Queue[Event] = queue.Queue()
    stop = threading.Event()
    serve = ServeProcess(db, "--no-dataplane", port=port).start()
    hg = Client(serve.url)

    def watch() -> None:
        for event in hg.watch_events("shop", after=0, max_delay=0.5):
            got.put(event)
            if stop.is_set():
                return

    thread = threading.Thread(target=watch, daemon=True)
    try:
        thread.start()
        hg.apply([d for d in world if d.get("region") == "us-east1"])
        first = [got.get(timeout=20) for _ in range(3)]
        serve.stop()  # the stream drops; the client retries meanwhile
        serve = ServeProcess(db, "--no-dataplane", port=port).start()
        hg.apply(world)  # europe-west1 now: more transitions, after the restart
        seen = list(first)

        def after_restart() -> bool:
            seen.extend(_drain(got))
            return any("europe-west1" in e.path for e in seen)

        wait_for(after_restart, 30, what="events from after the restart")
        ids = [e.id for e in seen]
        assert ids == sorted(set(ids)), ids  # nothing repeated, in order
        logged = [e.id for e in Client(serve.url).events("shop", limit=10000)]
        assert ids == logged[: len(ids)]  # nothing skipped
    finally:
        stop.set()
        serve.stop()
        hg.close()  # (the watch ends at its next retry: nothing left running)
        thread.join(5)
        assert not thread.is_alive()


def _drain(q: queue.Queue[Event]) -> list[Event]:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
