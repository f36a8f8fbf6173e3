"""An etcd v3 client: connections, deadlines, retries, watches and leases.

What the client library (aetcd's generated gRPC stubs; its client is not
used) leaves out is written once, here, for the store (store/etcd.py) and
the cluster's recipes (cluster/) alike:

* **several members**: requests go to one member at a time; a member that
  refuses, times out or stops answering is left for the next one
  (:class:`Members`). Reads are retried on the next member; a write is
  retried only when it was surely not sent (``UNAVAILABLE``), never after a
  timeout (it may have committed): that one is reported as
  :class:`~healthgate.store.base.Unavailable` and the caller decides.
* **deadlines**: every request has one (``request_timeout``): without quorum
  etcd holds a request until its own timeout (7 s), and fail static wants a
  fast answer.
* **watches that resume**: :meth:`EtcdClient.watch_prefix` re-opens a broken
  watch from the last revision seen + 1 (on the next member), raises
  :class:`~healthgate.store.base.Compacted` when that history is gone, asks
  for the "require leader" flag (a member cut off from its quorum ends the
  watch instead of going silent), and runs a watchdog: every
  ``progress_every`` seconds it asks for a progress report, and a watch that
  answered nothing for ``watch_deadline`` seconds is dropped and re-opened
  elsewhere (a member frozen with SIGSTOP keeps its TCP connection open and
  silent forever). :func:`follow` is the list-then-watch loop every follower
  of a prefix runs.
* **leases**: grant, refresh once (each member for a short while, so that
  one frozen member does not use up the lease), revoke.
* **a namespace**: every key is under ``namespace`` (``/healthgate`` by
  default); callers name keys without it.
* **TLS and etcd's users** (SPEC §7, "etcd"): with :class:`EtcdTls`, every
  channel is TLS, verified against the given CA, with a client certificate
  when one is given (etcd's ``--client-cert-auth``); with
  :class:`EtcdAuth`, the client authenticates as an etcd user (the password
  read from a file, never an argument) and sends its token with every
  request and watch, authenticating again when etcd says the token
  expired. docs/cluster.md shows both with Debian's etcd.

Synchronous calls (from threads, as the SQLite store's are) use a blocking
gRPC channel per member; watches are asyncio streams on the caller's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

import grpc
import grpc.aio
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as stubs

from healthgate.store.base import Compacted, StoreError, TooLarge, Unavailable

log = logging.getLogger("healthgate.store.etcd")

MAX_OPS = 100  # etcd refuses a transaction of more than 128 operations (--max-txn-ops)
# the largest answer this client takes from etcd (gRPC's default is 4 MiB, less
# than one range of a large world): a watch answer comes in fragments of about
# etcd's --max-request-bytes (docs/cluster.md suggests up to 32 MiB) plus one
# event, and ranges in pages (EtcdClient.range_all)
RECEIVE_LIMIT = 80 << 20
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", RECEIVE_LIMIT)]
STUCK_AFTER = 5  # a watch that broke this many times in a row at one revision is warned of
STUCK_WARN_EVERY = 60.0  # seconds between such warnings (of one watch)
# ... where a break counts in a row only if the watch it ended was open less
# than this long (one that answered for longer - members restarted now and
# then over a quiet prefix - starts a new run)
STUCK_WITHIN = 10.0
PAGE = 1000  # keys per page of a range (fewer when a page is larger than RECEIVE_LIMIT)


class AnswerTooLarge(StoreError):
    """etcd's answer is larger than RECEIVE_LIMIT (a range is read in smaller pages)."""


_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # the end of a stream
_CLOSING: set[asyncio.Task[None]] = set()


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def parse_endpoints(text: str) -> list[str]:
    """``etcd://h1:p1,h2:p2`` (or ``h1:p1,h2:p2``) -> ["h1:p1", "h2:p2"]."""
    body = text.removeprefix("etcd://")
    out = []
    for raw in body.split(","):
        part = raw.strip().rstrip("/")
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--store: {part!r} is not HOST:PORT")
        out.append(part)
    if not out:
        raise ValueError("--store: etcd:// needs at least one HOST:PORT")
    return out


@dataclass(frozen=True, slots=True)
class EtcdTls:
    """TLS to the members: the CA that signed their certificates, and this
    client's certificate and key (both or neither)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


@dataclass(frozen=True, slots=True)
class EtcdAuth:
    """An etcd user and its password (read from a file: never in argv)."""

    user: str
    password: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class EtcdSettings:
    request_timeout: float = 2.0
    watch_deadline: float = 3.0  # a watch silent this long (no answer to a progress ask) is dropped
    progress_every: float = 1.0
    history: int = 10_000  # revisions of history kept (the store compacts)
    compact_every: int = 1_000

    @classmethod
    def for_lease(cls, ttl: float) -> EtcdSettings:
        """A cluster node's: a watch on a member that is cut off must move
        to another well within the lease TTL - the leader's key, a dead
        node's opinions and members all end with a lease, and a node whose
        watch sits on a silent member would learn it seconds late (the
        partition tests saw a new leader learn it led 1.8 s after the others)."""
        deadline = min(3.0, max(0.6, 0.6 * ttl))
        return cls(watch_deadline=deadline, progress_every=deadline / 3)


class Members:
    """The member addresses and which one is in use; thread-safe."""

    def __init__(self, endpoints: Sequence[str], tls: EtcdTls | None = None) -> None:
        self.endpoints = list(endpoints)
        self._current = 0
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self.credentials = tls.credentials() if tls is not None else None

    def current(self) -> str:
        with self._lock:
            return self.endpoints[self._current]

    def skip(self, endpoint: str) -> None:
        """``endpoint`` failed: the next request goes to the next member."""
        with self._lock:
            if self.endpoints[self._current] == endpoint:
                self._current = (self._current + 1) % len(self.endpoints)

    def channel(self, endpoint: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(endpoint)
            if ch is None:
                if self.credentials is not None:
                    ch = grpc.secure_channel(endpoint, self.credentials, CHANNEL_OPTIONS)
                else:
                    ch = grpc.insecure_channel(endpoint, CHANNEL_OPTIONS)
                self._channels[endpoint] = ch
            return ch

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str  # without the namespace
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class Event:
    revision: int
    kv: KeyValue
    deleted: bool


class EtcdClient:
    """The members of one etcd cluster, under one namespace (see the module doc)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        namespace: str = "/healthgate",
        settings: EtcdSettings | None = None,
        tls: EtcdTls | None = None,
        auth: EtcdAuth | None = None,
    ) -> None:
        self.settings = settings or EtcdSettings()
        self.members = Members(endpoints, tls)
        self.ns = namespace.rstrip("/")
        self.auth = auth
        self._token: str | None = None
        self._token_lock = threading.Lock()
        self._aio: dict[str, grpc.aio.Channel] = {}
        # watches: how often any broke, and each one's breaks in a row at
        # one revision (the metrics: api/metrics.py's ClusterCollector)
        self.watch_breaks = 0
        self._watch_runs: dict[object, int] = {}

    # ------------------------------------------------------------------ etcd's users

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The auth token to send with a request (authenticating first if need be)."""
        if self.auth is None:
            return ()
        with self._token_lock:
            if self._token is None:
                self._token = self._authenticate()
            return (("token", self._token),)

    def _authenticate(self) -> str:
        assert self.auth is not None
        req = pb.AuthenticateRequest(name=self.auth.user, password=self.auth.password)
        why = "no member answered"
        for _ in self.members.endpoints:
            endpoint = self.members.current()
            stub = stubs.AuthStub(self.members.channel(endpoint))
            try:
                return str(stub.Authenticate(req, timeout=self.settings.request_timeout).token)
            except grpc.RpcError as exc:
                detail = str(exc.details() or exc.code().name)
                if exc.code() in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ):
                    raise AuthFailed(
                        f"etcd refused user {self.auth.user!r}: {detail} "
                        "(--etcd-user, --etcd-password-file)"
                    ) from None
                why = f"etcd {endpoint}: {detail}"
            self.members.skip(endpoint)
        raise Unavailable(why)

    def _token_expired(self, exc: grpc.RpcError) -> bool:
        """An answer that says the token is no longer good: forget it (the
        next request authenticates again)."""
        if self.auth is None or "auth token" not in str(exc.details() or ""):
            return False
        with self._token_lock:
            self._token = None
        return True

    # ------------------------------------------------------------------ keys

    def key(self, key: str) -> bytes:
        """A key with the namespace, as etcd knows it."""
        return f"{self.ns}/{key}".encode()

    def strip(self, raw: bytes) -> str:
        """A key as etcd gave it, without the namespace (not UTF-8: ValueError)."""
        return raw.decode()[len(self.ns) + 1 :]

    def keyvalue(self, kv: Any) -> KeyValue:
        return KeyValue(
            self.strip(kv.key),
            bytes(kv.value),
            int(kv.create_revision),
            int(kv.mod_revision),
            int(kv.lease),
        )

    # ------------------------------------------------------------------ unary calls

    def call(self, method: str, request: Any, *, write: bool = False) -> Any:
        """One unary KV/Lease/Maintenance call on the current member, moving
        on to the next member when it cannot be reached."""
        attempts = len(self.members.endpoints) + 1
        last: grpc.RpcError | None = None
        for _ in range(attempts):
            endpoint = self.members.current()
            channel = self.members.channel(endpoint)
            service, name = method.split(".")
            stub = getattr(stubs, f"{service}Stub")(channel)
            try:
                return getattr(stub, name)(
                    request, timeout=self.settings.request_timeout, metadata=self.metadata()
                )
            except grpc.RpcError as exc:
                code = exc.code()
                last = exc
                if self._token_expired(exc):
                    continue  # (authenticated again on the next attempt)
                if code == grpc.StatusCode.PERMISSION_DENIED:
                    raise StoreError(
                        f"etcd refused {method} for user "
                        f"{self.auth.user if self.auth else '(none)'}: {exc.details()} "
                        "(its role needs read and write on the namespace's prefix)"
                    ) from None
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise _refusal(exc) from None  # etcd refused the request itself
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in str(
                    exc.details()
                ):
                    raise AnswerTooLarge(str(exc.details())) from None  # (any member's would be)
                self.members.skip(endpoint)
                if code in _RETRYABLE or (not write and code == grpc.StatusCode.DEADLINE_EXCEEDED):
                    continue
                break
        assert last is not None
        detail = last.details() or last.code().name
        raise Unavailable(f"etcd {self.members.current()}: {detail}") from None

    def range(self, key: bytes, end: bytes | None = None, **kw: Any) -> Any:
        return self.call("KV.Range", pb.RangeRequest(key=key, range_end=end or b"", **kw))

    def txn(self, compare: list[Any], success: list[Any], failure: Sequence[Any] = ()) -> Any:
        req = pb.TxnRequest(compare=compare, success=success, failure=list(failure))
        return self.call("KV.Txn", req, write=True)

    def range_all(self, key: bytes, end: bytes) -> tuple[int, list[Any]]:
        """Every key in [key, end) and the revision they were read at - in
        pages, all read at that one revision: one answer for a large prefix
        (a world of 100,000 endpoints, as many opinions) would be larger
        than a client takes (RECEIVE_LIMIT). A page too large for it is
        asked again in smaller pages."""
        revision, limit, out = 0, PAGE, []
        while True:
            try:
                resp = self.range(key, end, limit=limit, revision=revision)
            except AnswerTooLarge:
                if limit == 1:
                    raise
                limit = max(1, limit // 8)
                continue
            revision = revision or int(resp.header.revision)
            out.extend(resp.kvs)
            if not resp.more or not resp.kvs:
                return revision, out
            key = resp.kvs[-1].key + b"\0"
            limit = PAGE

    def list_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` (keys that are not UTF-8 are skipped and
        logged), and the revision they were read at."""
        start = self.key(prefix)
        revision, kvs = self.range_all(start, prefix_end(start))
        out = []
        for kv in kvs:
            try:
                out.append(self.keyvalue(kv))
            except ValueError:
                log.warning("skipping an etcd key that is not UTF-8 under %s", prefix)
        return revision, out

    def put(
        self, items: Iterable[tuple[str, bytes]], lease: int = 0, guard: Sequence[Any] = ()
    ) -> int:
        """Put keys, in transactions of at most MAX_OPS (each guarded by the
        ``guard`` compares: False from etcd raises :class:`GuardFailed`);
        the last revision."""
        rev = 0
        pairs = list(items)
        for i in range(0, len(pairs), MAX_OPS):
            ops = [
                pb.RequestOp(request_put=pb.PutRequest(key=self.key(k), value=v, lease=lease))
                for k, v in pairs[i : i + MAX_OPS]
            ]
            resp = self.txn(list(guard), ops)
            if not resp.succeeded:
                raise GuardFailed("a guarded write found its guard gone")
            rev = int(resp.header.revision)
        return rev

    def delete(self, key: str) -> None:
        self.call("KV.DeleteRange", pb.DeleteRangeRequest(key=self.key(key)), write=True)

    def delete_unchanged(self, keys: Sequence[tuple[str, int]], guard: Sequence[Any] = ()) -> bool:
        """Delete these keys, each only if it is still at its revision (its
        mod revision), in one transaction with the ``guard`` compares: all
        or nothing (False: one of them changed, or the guard is gone).
        At most MAX_OPS keys."""
        if len(keys) > MAX_OPS:
            raise ValueError(f"at most {MAX_OPS} keys in one transaction (got {len(keys)})")
        compares = [*guard, *(self.mod_is(k, r) for k, r in keys)]
        ops = [
            pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=self.key(k)))
            for k, _ in keys
        ]
        return bool(self.txn(compares, ops).succeeded)

    def create(self, key: str, value: bytes, lease: int) -> tuple[bool, int]:
        """Create ``key`` under ``lease`` if absent: (created, its create
        revision - an existing key's, if it was there)."""
        k = self.key(key)
        resp = self.txn(
            [
                pb.Compare(
                    key=k, result=pb.Compare.EQUAL, target=pb.Compare.CREATE, create_revision=0
                )
            ],
            [pb.RequestOp(request_put=pb.PutRequest(key=k, value=value, lease=lease))],
            [pb.RequestOp(request_range=pb.RangeRequest(key=k))],
        )
        if resp.succeeded:
            return True, int(resp.header.revision)
        existing = resp.responses[0].response_range.kvs
        return False, int(existing[0].create_revision) if existing else 0

    def compact(self, revision: int) -> None:
        self.call("KV.Compact", pb.CompactionRequest(revision=revision), write=True)

    # ------------------------------------------------------------------ compares

    def created_at(self, key: str, revision: int) -> Any:
        """A compare: ``key`` exists with this create revision."""
        return pb.Compare(
            key=self.key(key),
            result=pb.Compare.EQUAL,
            target=pb.Compare.CREATE,
            create_revision=revision,
        )

    def mod_is(self, key: str, revision: int) -> Any:
        """A compare: ``key`` was last written at ``revision``."""
        return pb.Compare(
            key=self.key(key), result=pb.Compare.EQUAL, target=pb.Compare.MOD, mod_revision=revision
        )

    def under_lease(self, key: str, lease: int) -> Any:
        """A compare: ``key`` is attached to ``lease`` (gone with it)."""
        return pb.Compare(
            key=self.key(key), result=pb.Compare.EQUAL, target=pb.Compare.LEASE, lease=lease
        )

    # ------------------------------------------------------------------ leases

    def grant(self, ttl: int) -> int:
        resp = self.call("Lease.LeaseGrant", pb.LeaseGrantRequest(TTL=ttl), write=True)
        return int(resp.ID)

    def revoke(self, lease: int) -> None:
        with contextlib.suppress(StoreError):
            self.call("Lease.LeaseRevoke", pb.LeaseRevokeRequest(ID=lease), write=True)

    def keep_alive_once(self, lease: int, timeout: float | None = None) -> int:
        """Refresh ``lease`` once, trying each member in turn (each for
        ``timeout`` seconds); its remaining TTL (0 or less: it expired)."""
        why = "no member answered"
        for _ in self.members.endpoints:
            endpoint = self.members.current()
            stub = stubs.LeaseStub(self.members.channel(endpoint))
            try:
                for resp in stub.LeaseKeepAlive(
                    iter([pb.LeaseKeepAliveRequest(ID=lease)]),
                    timeout=timeout or self.settings.request_timeout,
                    metadata=self.metadata(),
                ):
                    return int(resp.TTL)
            except grpc.RpcError as exc:
                self._token_expired(exc)
                why = f"etcd {endpoint}: {exc.details() or exc.code().name}"
            self.members.skip(endpoint)
        raise Unavailable(why)

    # ------------------------------------------------------------------ watches

    def create_request(self, prefix: bytes, start: int) -> Any:
        return pb.WatchRequest(
            # fragment: a revision larger than etcd's --max-request-bytes comes
            # in parts (reassembled in _watch_once), so that no answer is
            # larger than this client takes (RECEIVE_LIMIT): a watch catching
            # up after a burst of large writes used to break on its first
            # answer and resume at the same revision, for ever
            create_request=pb.WatchCreateRequest(
                key=prefix, range_end=prefix_end(prefix), start_revision=start, fragment=True
            )
        )

    def _aio_channel(self, endpoint: str) -> grpc.aio.Channel:
        ch = self._aio.get(endpoint)
        if ch is None:
            credentials = self.members.credentials
            if credentials is not None:
                ch = grpc.aio.secure_channel(endpoint, credentials, CHANNEL_OPTIONS)
            else:
                ch = grpc.aio.insecure_channel(endpoint, CHANNEL_OPTIONS)
            self._aio[endpoint] = ch
        return ch

    async def watch_prefix(self, prefix: str, start: int) -> AsyncIterator[list[Event]]:
        """Every event under ``<ns>/<prefix>`` from revision ``start`` on,
        one list per revision, resuming on other members as needed (see the
        module doc). Raises :class:`Compacted` when ``start`` is gone."""
        full = self.key(prefix)
        next_rev = start
        failures = 0
        warned = -STUCK_WARN_EVERY  # (loop time of the last warning)
        me = object()  # (this watch, among the client's runs)
        runs = self._watch_runs
        loop = asyncio.get_running_loop()
        try:
            while True:
                endpoint = self.members.current()
                opened = loop.time()
                try:
                    async for batch in self._watch_once(endpoint, full, next_rev):
                        if failures:
                            failures = 0
                            runs.pop(me, None)
                        next_rev = batch[-1].revision + 1
                        yield batch
                except Compacted:
                    raise
                except (grpc.RpcError, TimeoutError, _WatchEnded) as exc:
                    failures = failures + 1 if loop.time() - opened < STUCK_WITHIN else 1
                    self.watch_breaks += 1
                    runs[me] = failures
                    warned = self._watch_broke(prefix, endpoint, next_rev, failures, warned, exc)
                    await asyncio.sleep(min(0.05 * 2**failures, 1.0))
        finally:
            runs.pop(me, None)

    @property
    def watches_stuck(self) -> int:
        """Watches that have broken STUCK_AFTER times or more in a row at one
        revision (and see nothing past it until one succeeds)."""
        return sum(1 for n in list(self._watch_runs.values()) if n >= STUCK_AFTER)

    def _watch_broke(
        self,
        prefix: str,
        endpoint: str,
        next_rev: int,
        failures: int,
        warned: float,
        exc: grpc.RpcError | TimeoutError | _WatchEnded,
    ) -> float:
        """A watch broke (``failures`` times in a row): the next member is
        tried, and a person hears of a watch stuck at one revision. The loop
        time of its last warning."""
        if isinstance(exc, grpc.RpcError):
            self._token_expired(exc)
        self.members.skip(endpoint)
        now = asyncio.get_running_loop().time()
        if failures >= STUCK_AFTER and now - warned >= STUCK_WARN_EVERY:
            # nothing after next_rev reaches this node until it succeeds: a
            # person must hear of it (a node that stopped deciding once
            # logged nothing here at serve's usual level)
            log.warning(
                "etcd watch of %s has broken %d times in a row at revision %d, "
                "last on %s (%s): this node sees no change there until it resumes",
                prefix,
                failures,
                next_rev,
                endpoint,
                _why(exc),
            )
            return now
        level = logging.INFO if failures == 1 else logging.DEBUG
        log.log(level, "etcd watch on %s broke (%s); resuming at %d", endpoint, _why(exc), next_rev)
        return warned

    async def _watch_once(
        self, endpoint: str, prefix: bytes, start: int
    ) -> AsyncIterator[list[Event]]:
        stub = stubs.WatchStub(self._aio_channel(endpoint))
        metadata = await asyncio.to_thread(self.metadata) if self.auth else ()
        call = stub.Watch(metadata=(("hasleader", "true"), *metadata))
        await call.write(self.create_request(prefix, start))
        loop = asyncio.get_running_loop()
        last_answer = loop.time()

        async def watchdog() -> None:
            while True:
                await asyncio.sleep(self.settings.progress_every)
                if loop.time() - last_answer > self.settings.watch_deadline:
                    call.cancel()
                    return
                with contextlib.suppress(Exception):
                    await call.write(pb.WatchRequest(progress_request=pb.WatchProgressRequest()))

        dog = asyncio.create_task(watchdog())
        parts: list[Any] = []  # the events of a fragmented answer, until its last part
        try:
            while True:
                resp = await call.read()
                if resp is _EOF:
                    raise _WatchEnded("the member ended the watch")
                last_answer = loop.time()
                if resp.compact_revision:
                    raise Compacted(start - 1, int(resp.compact_revision))
                if resp.canceled:
                    raise _WatchEnded(resp.cancel_reason or "canceled")
                if resp.fragment:
                    parts.extend(resp.events)
                    continue
                raw = [*parts, *resp.events] if parts else resp.events
                parts = []
                events = []
                for ev in raw:
                    try:
                        events.append(self.event(ev))
                    except ValueError:
                        log.warning("skipping an etcd event whose key is not UTF-8")
                for _, group in groupby(events, key=lambda e: e.revision):
                    yield list(group)
        except asyncio.CancelledError:
            if dog.done() and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise _WatchEnded("silent for too long (a frozen member?)") from None
            raise
        finally:
            dog.cancel()
            call.cancel()

    def event(self, ev: Any) -> Event:
        return Event(int(ev.kv.mod_revision), self.keyvalue(ev.kv), ev.type == 1)  # 1: DELETE

    def close(self) -> None:
        self.members.close()
        for ch in self._aio.values():
            with contextlib.suppress(Exception):
                _close_later(ch)
        self._aio.clear()


class AuthFailed(StoreError):
    """etcd refused the user or its password."""


class GuardFailed(StoreError):
    """A guarded write found its compare false: nothing was written."""


async def follow(
    client: EtcdClient,
    prefix: str,
    revision: int,
    reset: Callable[[list[KeyValue]], None],
    apply: Callable[[Event], None],
    retry: float = 1.0,
    settled: Callable[[], None] | None = None,
) -> None:
    """Follow a prefix for ever: each event into ``apply`` (and, with
    ``settled``, a call after each batch of events etcd sent together - a
    watch catching up after a cut delivers history in bursts); when the watch
    cannot resume (compacted) or anything fails, the prefix is listed again
    into ``reset``. A bad key or value is the caller's to skip (``apply``
    and ``reset`` must not raise for one); should they raise anyway, it is
    logged and the follower lists again - it never dies, and never retries
    the same event for ever."""
    while True:
        try:
            async for batch in client.watch_prefix(prefix, revision + 1):
                for ev in batch:
                    try:
                        apply(ev)
                    except Exception:
                        log.exception("skipping an event of %s at revision %d", prefix, ev.revision)
                revision = batch[-1].revision
                if settled is not None:
                    try:
                        settled()
                    except Exception:
                        log.exception("after the events of %s at revision %d", prefix, revision)
        except Compacted:
            log.info("watch of %s compacted past %d: listing again", prefix, revision)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("following %s failed at revision %d; listing again", prefix, revision)
            await asyncio.sleep(retry)
        try:
            revision, kvs = await asyncio.to_thread(client.list_prefix, prefix)
            reset(kvs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("cannot list %s (%s); retrying", prefix, exc)
            await asyncio.sleep(retry)


def _refusal(exc: grpc.RpcError) -> StoreError:
    detail = str(exc.details() or "")
    if "too many operations" in detail:
        return TooLarge(
            f"one write of more keys than etcd takes in a transaction ({detail}): "
            "raise --max-txn-ops on the etcd members (docs/cluster.md) or apply in parts"
        )
    if "too large" in detail:
        return TooLarge(
            f"one write larger than etcd takes ({detail}): raise --max-request-bytes on the "
            "etcd members (docs/cluster.md) or apply in parts"
        )
    return StoreError(f"etcd refused the request: {detail}")


class _WatchEnded(Exception):
    pass


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return str(exc.details() or exc.code().name)
    return str(exc) or type(exc).__name__


def _close_later(ch: grpc.aio.Channel) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # no loop: the channel goes with the process
    task = loop.create_task(ch.close(None))
    _CLOSING.add(task)
    task.add_done_callback(_CLOSING.discard)
