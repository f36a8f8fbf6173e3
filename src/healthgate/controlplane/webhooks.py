"""Webhook deliveries (SPEC §6, "Notifications").

Each ``Webhook`` (model/webhooks.py) has one delivery task, on one node: the
server in the embedded mode, the elected writer in a cluster. The task
reads its project's transition log after its **cursor** (the id of the last
record acknowledged), POSTs each record its filters want, in order, and moves
the cursor only after a 2xx - so delivery is at least once and in order per
webhook. The cursor lives in the state store (``webhook/<path>``, written
under the writer's election guard in a cluster), so a restart or a new
writer resends nothing that was acknowledged and loses nothing that was
not; the record in flight when the writer changes may be sent twice (the
receiver dedupes by ``X-Healthgate-Delivery``, the record's id).

A failed delivery (a connection error, a timeout, anything but 2xx -
redirects are not followed) is retried after 1 s, 2 s, 4 s, ... at most
15 min apart; after 24 h of failures the record is given up (logged, and
counted in the status) and the next one is tried. The first delivery of a
new webhook is the first record logged after it was created.

Each body is the record as ``GET /v1/projects/P/events`` shows it (with its
``id``), signed: ``X-Healthgate-Signature: sha256=<hex HMAC-SHA256 of the
body, keyed by the secret>``. A URL that names a host by DNS name is
resolved before every attempt, every address checked against the address
policy (SPEC §7: no loopback, link-local or unspecified address unless
``--allow-addresses`` admits it), and the connection made to the checked
address - so a name that starts to resolve to the metadata service later
reaches nothing. (An address in the URL was checked when it was written.)
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import ssl
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from healthgate import __version__
from healthgate.model.addresses import AddressPolicy
from healthgate.model.change import WorldChange
from healthgate.model.names import ResourcePath
from healthgate.model.resource import Resource
from healthgate.model.webhooks import Webhook, split_url
from healthgate.store.base import Guard, LogQuery, NotLeader, Store, StoreError, sane_time

log = logging.getLogger("healthgate.webhooks")

STATE_PREFIX = "webhook/"
BATCH = 100  # records read from the log at a time
BEHIND_CAP = 1_000  # "behind" counts this many at most


@dataclass(frozen=True, slots=True)
class WebhookSettings:
    first_retry: float = 1.0
    most_retry: float = 900.0
    give_up: float = 86_400.0  # a record is retried this long, then dropped
    timeout: float = 10.0  # one attempt, connect to status line
    refresh: float = 2.0  # how often a node that does not deliver rereads the statuses


OnChange = Callable[[WorldChange], Coroutine[Any, Any, None]]

# who delivers now: (True, the guard of its writes) or (False, None)
Permit = Callable[[], tuple[bool, Guard | None]]


def always() -> tuple[bool, Guard | None]:
    return True, None


@dataclass(slots=True)
class Status:
    """What ``GET`` of a webhook shows, and where its deliveries stand."""

    cursor: int = 0
    delivered: int = 0
    dropped: int = 0
    last_delivery: dict[str, Any] | None = None  # {id, time, status}
    last_error: dict[str, Any] | None = None  # {id, time, message}
    attempts: int = 0  # failed attempts of the record in flight
    next_attempt: float | None = None
    behind: int = 0  # records of the project after the cursor (at most BEHIND_CAP)
    oldest: float | None = None  # time of the oldest record not yet acknowledged

    def to_store(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "delivered": self.delivered,
            "dropped": self.dropped,
            "lastDelivery": self.last_delivery,
            "lastError": self.last_error,
            "attempts": self.attempts,
            "nextAttempt": self.next_attempt,
            "behind": self.behind,
            "oldest": self.oldest,
        }

    @classmethod
    def from_store(cls, value: Any) -> Status:
        """Read back (a value from etcd is checked: bad fields are dropped)."""
        if not isinstance(value, Mapping):
            raise ValueError("not an object")
        out = cls(cursor=_count(value.get("cursor")))
        out.delivered = _count(value.get("delivered"))
        out.dropped = _count(value.get("dropped"))
        out.attempts = _count(value.get("attempts"))
        out.behind = min(_count(value.get("behind")), BEHIND_CAP)
        for attr, key in (("last_delivery", "lastDelivery"), ("last_error", "lastError")):
            item = value.get(key)
            if isinstance(item, Mapping):
                setattr(out, attr, {k: item[k] for k in ("id", "time", "status", "message")
                                    if isinstance(item.get(k), (int, float, str))})  # fmt: skip
        for attr, key in (("next_attempt", "nextAttempt"), ("oldest", "oldest")):
            if value.get(key) is not None:
                setattr(out, attr, sane_time(value.get(key)))
        return out

    def view(self, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cursor": self.cursor,
            "delivered": self.delivered,
            "dropped": self.dropped,
            "behind": self.behind,
            "oldestUndeliveredSec": round(now - self.oldest, 3) if self.oldest else 0,
        }
        if self.last_delivery:
            out["lastDelivery"] = self.last_delivery
        if self.last_error:
            out["lastError"] = self.last_error
        if self.attempts:
            out["attempts"] = self.attempts
        if self.next_attempt:
            out["nextAttempt"] = self.next_attempt
        return out


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
        return 0
    return value


def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class DeliveryFailed(Exception):
    """One attempt failed; the message says why (never with the secret)."""


@dataclass(slots=True)
class _Worker:
    webhook: Webhook
    created: float
    task: asyncio.Task[None]
    status: Status = field(default_factory=Status)


class WebhookDispatcher:
    def __init__(
        self,
        store: Store,
        policy: AddressPolicy,
        settings: WebhookSettings | None = None,
        permit: Permit = always,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.policy = policy
        self.settings = settings or WebhookSettings()
        self.permit = permit
        self.clock = clock
        self._webhooks: dict[ResourcePath, tuple[Webhook, float]] = {}
        self._workers: dict[ResourcePath, _Worker] = {}
        self._statuses: dict[str, Status] = {}  # read back, on a node that does not deliver
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._client = httpx.AsyncClient(
            verify=ssl.create_default_context(),
            follow_redirects=False,
            trust_env=False,  # (no proxy from the environment: the policy checks the real peer)
            headers={"User-Agent": f"healthgate/{__version__}"},
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=20),
        )

    # -- inputs

    def wake(self) -> None:
        """New records in the log (the recorder calls this)."""
        self._wake.set()

    def watch(self, stored: Callable[[], Mapping[ResourcePath, Any]]) -> OnChange:
        """A control-plane change listener that passes on the webhooks of the
        mirror ``stored()`` (path -> Stored), with their creation times."""

        async def changed(change: WorldChange) -> None:
            if not change.touches("webhooks"):
                return  # (a change of anything else changes no webhook)
            self.update(
                {
                    p: (s.resource, s.created)
                    for p, s in stored().items()
                    if isinstance(s.resource, Webhook)
                }
            )

        return changed

    def update(self, webhooks: Mapping[ResourcePath, tuple[Webhook, float]]) -> None:
        """The webhooks now, with their creation times."""
        self._webhooks = dict(webhooks)
        self._changed.set()
        self._wake.set()

    def status(self, path: ResourcePath) -> dict[str, Any] | None:
        worker = self._workers.get(path)
        found = worker.status if worker else self._statuses.get(str(path))
        return found.view(self.clock()) if found else None

    def statuses(self) -> dict[str, Status]:
        out = dict(self._statuses)
        out.update({str(p): w.status for p, w in self._workers.items()})
        return out

    # -- the loop

    async def run(self) -> None:
        try:
            while True:
                delivering, _ = self.permit()
                if delivering:
                    self._reconcile()
                else:
                    await self._stop_workers()
                    await self._reread()
                self._changed.clear()
                try:
                    async with asyncio.timeout(self.settings.refresh):
                        await self._changed.wait()
                except TimeoutError:
                    pass
        finally:
            await self._stop_workers()
            await self._client.aclose()

    def _reconcile(self) -> None:
        for path in [p for p in self._workers if p not in self._webhooks]:
            self._workers.pop(path).task.cancel()
            self._forget(path)
        for path, (hook, created) in self._webhooks.items():
            worker = self._workers.get(path)
            if worker is not None and worker.webhook == hook and not worker.task.done():
                continue
            if worker is not None:
                worker.task.cancel()
            task = asyncio.create_task(self._deliver_all(path), name=f"webhook {path}")
            self._workers[path] = _Worker(hook, created, task)

    def _forget(self, path: ResourcePath) -> None:
        self._statuses.pop(str(path), None)
        ok, guard = self.permit()
        if ok:
            try:
                self.store.save_states({}, [STATE_PREFIX + str(path)], guard)
            except StoreError as exc:
                log.warning("could not remove the delivery state of %s: %s", path, exc)

    async def _stop_workers(self) -> None:
        workers = list(self._workers.values())
        self._workers.clear()
        for w in workers:
            w.task.cancel()
        if workers:
            await asyncio.gather(*(w.task for w in workers), return_exceptions=True)

    async def _reread(self) -> None:
        """A node that does not deliver shows what the writer stored."""
        if not self._webhooks:
            self._statuses.clear()
            return
        try:
            stored = await asyncio.to_thread(self.store.load_states, STATE_PREFIX)
        except StoreError:
            return
        fresh = {}
        for key, value in stored.items():
            try:
                fresh[key.removeprefix(STATE_PREFIX)] = Status.from_store(value)
            except ValueError:
                continue
        self._statuses = fresh

    # -- one webhook

    async def _deliver_all(self, path: ResourcePath) -> None:
        worker = self._workers[path]
        key = STATE_PREFIX + str(path)
        stored = (await asyncio.to_thread(self.store.load_states, key)).get(key)
        try:
            worker.status = Status.from_store(stored) if stored is not None else Status()
        except ValueError:
            log.warning("%s: unreadable delivery state; starting after the last record", path)
            worker.status = Status(cursor=await asyncio.to_thread(self.store.last_log_id))
        if stored is None:
            # a new webhook: from its creation on (records written since it
            # was stored, however late this task starts)
            worker.status.cursor = await asyncio.to_thread(self._first_cursor, worker)
            await self._save(path, worker.status)
        while True:
            self._wake.clear()
            hook = worker.webhook
            entries = await asyncio.to_thread(
                self.store.query_log,
                LogQuery(project=path.project, after_id=worker.status.cursor, limit=BATCH),
            )
            await self._measure(path, worker)
            if not entries:
                await self._idle()
                continue
            for entry in entries:
                if hook.wants(dict(entry.record)):
                    await self._deliver(path, worker, entry.id, dict(entry.record))
                worker.status.cursor = entry.id
            await self._measure(path, worker)
            await self._save(path, worker.status)

    def _first_cursor(self, worker: _Worker) -> int:
        """The id before the first record of the project logged at or after
        the webhook's creation (the last id if none)."""
        last = self.store.last_log_id()
        if not worker.created:
            return last
        found = self.store.query_log(
            LogQuery(project=worker.webhook.project, since=worker.created, limit=1)
        )
        return found[0].id - 1 if found else last

    async def _idle(self) -> None:
        try:
            async with asyncio.timeout(self.settings.refresh):
                await self._wake.wait()
        except TimeoutError:
            pass

    async def _measure(self, path: ResourcePath, worker: _Worker) -> None:
        pending = await asyncio.to_thread(
            self.store.query_log,
            LogQuery(project=path.project, after_id=worker.status.cursor, limit=BEHIND_CAP),
        )
        wanted = [e for e in pending if worker.webhook.wants(dict(e.record))]
        worker.status.behind = len(wanted)
        times = [t for e in wanted[:1] if isinstance(t := e.record.get("time"), (int, float))]
        worker.status.oldest = float(times[0]) if times and math.isfinite(times[0]) else None

    async def _save(self, path: ResourcePath, status: Status) -> None:
        ok, guard = self.permit()
        if not ok:
            raise asyncio.CancelledError  # (deposed: the next writer goes on from the cursor)
        try:
            await asyncio.to_thread(
                self.store.save_states, {STATE_PREFIX + str(path): status.to_store()}, (), guard
            )
        except NotLeader:
            raise asyncio.CancelledError from None
        except StoreError as exc:
            log.warning("%s: the delivery cursor was not saved (%s); will retry", path, exc)

    async def _deliver(
        self, path: ResourcePath, worker: _Worker, record_id: int, record: dict[str, Any]
    ) -> None:
        """Send one record until it is acknowledged or given up."""
        s = self.settings
        status = worker.status
        body = json.dumps({"id": record_id, **record}, separators=(",", ":")).encode()
        first_failure: float | None = None
        while True:
            now = self.clock()
            try:
                code = await self._post(worker.webhook, record_id, body)
            except DeliveryFailed as exc:
                first_failure = first_failure if first_failure is not None else now
                status.attempts += 1
                status.last_error = {"id": record_id, "time": now, "message": str(exc)[:300]}
                if now - first_failure >= s.give_up:
                    log.error(
                        "webhook %s: gave up on record %d after %d attempts over %.0f s: %s",
                        path, record_id, status.attempts, now - first_failure, exc,
                    )  # fmt: skip
                    status.dropped += 1
                    status.attempts, status.next_attempt = 0, None
                    return
                delay = min(s.most_retry, s.first_retry * 2 ** min(status.attempts - 1, 30))
                status.next_attempt = now + delay
                if status.attempts in (1, 5) or status.attempts % 20 == 0:
                    log.warning(
                        "webhook %s: delivery of record %d failed (attempt %d; next in %.0f s): %s",
                        path, record_id, status.attempts, delay, exc,
                    )  # fmt: skip
                await self._measure(path, worker)
                await self._save(path, status)
                await asyncio.sleep(delay)
                continue
            status.attempts, status.next_attempt = 0, None
            status.delivered += 1
            status.last_delivery = {"id": record_id, "time": self.clock(), "status": code}
            status.cursor = record_id
            await self._save(path, status)
            return

    async def _post(self, hook: Webhook, record_id: int, body: bytes) -> int:
        url, host_header, sni = await self._target(hook)
        headers = {
            "Content-Type": "application/json",
            "X-Healthgate-Delivery": str(record_id),
            "X-Healthgate-Signature": sign(hook.secret, body),
            "X-Healthgate-Webhook": str(hook.path),
        }
        if host_header:
            headers["Host"] = host_header
        request = self._client.build_request("POST", url, content=body, headers=headers)
        if sni:
            request.extensions["sni_hostname"] = sni
        try:
            async with asyncio.timeout(self.settings.timeout):
                response = await self._client.send(request, stream=True)
                await response.aclose()  # (the body is not read)
        except TimeoutError:
            raise DeliveryFailed(f"no answer within {self.settings.timeout:.0f} s") from None
        except httpx.HTTPError as exc:
            raise DeliveryFailed(f"{type(exc).__name__}: {exc}"[:300]) from None
        if not 200 <= response.status_code < 300:
            raise DeliveryFailed(f"the receiver answered {response.status_code}")
        return response.status_code

    async def _target(self, hook: Webhook) -> tuple[str, str | None, str | None]:
        return await checked_target(hook.url, self.policy)


async def checked_target(url: str, policy: AddressPolicy) -> tuple[str, str | None, str | None]:
    """(the URL to connect to, a Host header, a TLS server name) for an
    outgoing request (a webhook's, a METRIC source's query): a DNS name is
    resolved here and each address checked against the policy; an address
    in the URL was checked when it was written. DeliveryFailed says why not."""
    parts = split_url(url)
    assert parts is not None  # (validated)
    try:
        ipaddress.ip_address(parts.hostname or "")
        return url, None, None
    except ValueError:
        pass
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, port)
    except OSError as exc:
        raise DeliveryFailed(f"{parts.hostname}: cannot resolve ({exc})") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for ip in addresses:
        why = policy.refusal(ip)
        if why is not None:
            raise DeliveryFailed(f"url: {parts.hostname} resolves to {why}")
    if not addresses:
        raise DeliveryFailed(f"{parts.hostname}: no address")
    ip = addresses[0]
    netloc = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    target = parts._replace(netloc=netloc).geturl()
    host = parts.netloc.rpartition("@")[2]
    return target, host, parts.hostname if parts.scheme == "https" else None


def present_status(hook: Resource, dispatcher: WebhookDispatcher | None) -> dict[str, Any] | None:
    """The status block of a webhook's GET (None before its first look)."""
    if dispatcher is None or not isinstance(hook, Webhook):
        return None
    return dispatcher.status(hook.path)
