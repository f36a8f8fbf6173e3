"""The outcome history of probed endpoints (SPEC §11, for replay) - pure.

Every probe result an endpoint's prober takes is kept, run-length coded: a
*run* is consecutive results with the same outcome (and HTTP status), kept
as its start, its first result's latency, its length and its last
result's time - plus the exact times of its first ten results, because
that is where a threshold machine can flip (thresholds are at most ten;
after ten equal results nothing changes but the count). A steady endpoint
costs one run a day, a few dozen bytes; an endpoint that flips at every
probe costs a run per probe, about six bytes.

Finished runs are appended, as varints, to *segments* of at most
``SEGMENT`` bytes, each starting from an absolute time; an endpoint keeps
at most ``max_bytes`` of them (the oldest segment goes first) and none
older than ``hours`` - the bound of a flapping endpoint. The open run is
held in fields and encoded only when it ends or is read.

Times are milliseconds since the epoch (wall clock, as the records').
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from healthgate import http_scan
from healthgate.health.states import STEADY, Outcome, ProbeResult, steady_results

EXACT = 10  # the first results of a run kept at their exact times (the highest threshold)
SEGMENT = 4096  # bytes of one segment
MAX_BYTES = 64 * 1024  # bytes kept of one endpoint (its oldest segments go first)
# OutcomeHistory.steady in C (src/healthgate/_kept.c), when built
_steady_history: Callable[..., bytes] | None = getattr(http_scan.speedups, "steady_history", None)
MAX_LATENCY_MS = 3_600_000
_NONE: list[bytearray] = []  # (never appended to: see EndpointHistory.__init__)
_NO_ENDS: list[int] = []


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive results with one outcome and status."""

    start: int  # ms: its first result
    outcome: Outcome
    status: int
    latency: int  # ms: its first result's
    count: int
    last: int  # ms: its last result
    firsts: tuple[int, ...]  # ms: its first min(count, EXACT) results, exactly

    def times(self) -> Iterator[int]:
        """Each result's time: the first EXACT exactly, then evenly to the last."""
        yield from self.firsts
        rest = self.count - len(self.firsts)
        if rest <= 0:
            return
        base = self.firsts[-1]
        step = (self.last - base) / rest
        for i in range(1, rest):
            yield base + round(step * i)
        yield self.last

    def results(self) -> Iterator[tuple[int, ProbeResult]]:
        """(ms, the result) for each result of the run."""
        result = ProbeResult(self.outcome, self.latency / 1000, self.status)
        for t in self.times():
            yield t, result

    def flips(self) -> Iterator[tuple[int, ProbeResult]]:
        """The results a threshold machine can flip on: the first EXACT,
        and the last (what the endpoint showed last)."""
        result = ProbeResult(self.outcome, self.latency / 1000, self.status)
        for t in self.firsts:
            yield t, result
        if self.count > len(self.firsts):
            yield self.last, result


def _varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _read(data: bytes | bytearray, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = data[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, i
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 64 bits")


class EndpointHistory:
    """One endpoint's runs (see the module doc)."""

    __slots__ = (
        "code",
        "count",
        "deltas",
        "ends",
        "firsts_end",
        "last",
        "latency",
        "path",
        "segments",
        "start",
    )

    def __init__(self, path: str) -> None:
        self.path = path
        # finished runs, each segment beginning with its base time, and each
        # segment's last run's end (ms) - shared empty ones until the first
        # run ends: a steady endpoint has none (100,000 endpoints: 11 MB less)
        self.segments: list[bytearray] = _NONE
        self.ends: list[int] = _NO_ENDS
        self.code = -1  # the open run's outcome | status << 4 (-1: none)
        self.start = 0
        self.latency = 0
        self.count = 0
        self.last = 0
        self.firsts_end = 0  # the time of the open run's last exact result
        # ... and the gaps between its exact results (bytes once they are all there)
        self.deltas: bytearray | bytes = b""

    def add(self, t: int, result: ProbeResult, max_bytes: int = MAX_BYTES) -> None:
        code = int(result.outcome) | (result.status << 4)
        if code == self.code and t >= self.last:
            self.count += 1
            self.last = t
            if self.count <= EXACT:
                deltas = self.deltas
                if not isinstance(deltas, bytearray):
                    deltas = bytearray(deltas)
                _varint(deltas, t - self.firsts_end)
                self.deltas = bytes(deltas) if self.count == EXACT else deltas
                self.firsts_end = t
            return
        if self.code >= 0:
            self._close(max_bytes)
        self.code = code
        self.start = self.last = self.firsts_end = max(t, self.last)
        self.latency = min(MAX_LATENCY_MS, max(0, round(result.latency * 1000)))
        self.count = 1
        self.deltas = b""

    def _encode_open(self, out: bytearray, cursor: int) -> None:
        _varint(out, self.start - cursor)
        _varint(out, self.code)
        _varint(out, self.latency)
        _varint(out, self.count)
        _varint(out, self.last - self.start)
        out += self.deltas

    def _close(self, max_bytes: int) -> None:
        """The open run goes into the last segment (a new one when it is full)."""
        if self.segments is _NONE:
            self.segments, self.ends = [], []
        segments = self.segments
        if not segments or len(segments[-1]) >= SEGMENT:
            fresh = bytearray()
            _varint(fresh, self.start)
            segments.append(fresh)
            self.ends.append(self.start)
        self._encode_open(segments[-1], self.ends[-1])
        self.ends[-1] = self.last
        while sum(len(s) for s in segments) > max_bytes and len(segments) > 1:
            del segments[0], self.ends[0]

    def prune(self, horizon: int) -> None:
        """Segments whose every run ended before ``horizon`` (ms) go."""
        while self.ends and self.ends[0] < horizon:
            del self.segments[0], self.ends[0]

    def encode(self) -> bytes:
        """Every run, open one included, as segments one after another
        (:func:`decode` reads them back)."""
        out = bytearray()
        for segment in self.segments:
            _varint(out, len(segment))
            out += segment
        if self.code >= 0:
            tail = bytearray()
            _varint(tail, self.start)
            self._encode_open(tail, self.start)
            _varint(out, len(tail))
            out += tail
        return bytes(out)

    @property
    def nbytes(self) -> int:
        """Bytes of encoded history (finished and open runs)."""
        return sum(len(s) for s in self.segments) + 12 + len(self.deltas)


def _decode(segment: bytes | bytearray) -> Iterator[Run]:
    cursor, i = _read(segment, 0)
    while i < len(segment):
        gap, i = _read(segment, i)
        code, i = _read(segment, i)
        latency, i = _read(segment, i)
        count, i = _read(segment, i)
        span, i = _read(segment, i)
        start = cursor + gap
        firsts = [start]
        for _ in range(min(count, EXACT) - 1):
            delta, i = _read(segment, i)
            firsts.append(firsts[-1] + delta)
        if count < 1 or code & 0xF > max(Outcome):
            raise ValueError("not a run")
        yield Run(
            start, Outcome(code & 0xF), code >> 4, latency, count, start + span, tuple(firsts)
        )
        cursor = start + span


def decode(data: bytes) -> list[Run]:
    """What :meth:`EndpointHistory.encode` wrote (ValueError: it is not)."""
    runs: list[Run] = []
    i = 0
    try:
        while i < len(data):
            length, i = _read(data, i)
            runs.extend(_decode(data[i : i + length]))
            i += length
    except IndexError:
        raise ValueError("a history cut short") from None
    return runs


class OutcomeHistory:
    """Every endpoint a prober probes, by its key (a slot), each with its
    path - a slot given to another endpoint starts a history of its own,
    and the old one is kept by path until it ages out."""

    def __init__(self, hours: float = 24.0, max_bytes: int = MAX_BYTES) -> None:
        self.horizon_ms = int(hours * 3_600_000)
        self.max_bytes = max_bytes
        self._by_key: dict[Hashable, EndpointHistory] = {}
        self._retired: list[EndpointHistory] = []
        self._pruned = 0

    def record(
        self,
        now: float,
        results: Sequence[tuple[Any, ProbeResult]],
        path_of: Callable[[Any], str],
    ) -> None:
        """A tick's results at ``now`` (seconds). A result that extends a
        run past its exact part costs two assignments."""
        t = round(now * 1000)
        by_key, max_bytes = self._by_key, self.max_bytes
        for key, result in results:
            h = by_key.get(key)
            if h is not None and h.count >= EXACT:
                code = int(result.outcome) | (result.status << 4)
                if code == h.code and t >= h.last:
                    h.count += 1
                    h.last = t
                    continue
            if h is None or h.path != path_of(key):
                if h is not None:
                    self._retired.append(h)
                h = by_key[key] = EndpointHistory(path_of(key))
            h.add(t, result, max_bytes)
        if t - self._pruned > 60_000:
            self.prune(t)

    def steady(self, now: float, records: bytes, path_of: Callable[[Any], str]) -> None:
        """Steady successes (health/states.py's ``STEADY`` records: the
        lane's, probes/lane.py) at ``now``: what :meth:`record`
        does with them, with no Python object per result for those that
        extend an open run past its exact part (in C when built)."""
        t = round(now * 1000)
        if _steady_history is not None:
            left = _steady_history(self._by_key, t, records, EXACT)
        else:
            kept = []
            by_key = self._by_key
            for record in STEADY.iter_unpack(records):
                h = by_key.get(record[0])
                if h is not None and h.count >= EXACT and h.code == record[1] << 4 and t >= h.last:
                    h.count += 1
                    h.last = t
                else:
                    kept.append(STEADY.pack(*record))
            left = b"".join(kept)
        if left:
            self.record(now, steady_results(left), path_of)
        elif t - self._pruned > 60_000:
            self.prune(t)

    def forget(self, key: Hashable) -> None:
        """The key probes nothing any more: its history is kept by path."""
        h = self._by_key.pop(key, None)
        if h is not None:
            self._retired.append(h)

    def prune(self, t: int) -> None:
        self._pruned = t
        horizon = t - self.horizon_ms
        for h in (*self._by_key.values(), *self._retired):
            h.prune(horizon)
        self._retired = [h for h in self._retired if h.segments or h.last >= horizon]

    def export(
        self, paths: Callable[[str], bool] | None = None, budget: int | None = None
    ) -> tuple[dict[str, list[bytes]], bool]:
        """Each endpoint's histories, encoded (oldest first), for those
        ``paths`` admits - at most ``budget`` bytes of them (the newest
        endpoints' first); and whether some were left out for it."""
        out: dict[str, list[bytes]] = {}
        spent = 0
        for h in (*self._by_key.values(), *self._retired):
            if paths is None or paths(h.path):
                data = h.encode()
                if budget is not None and spent + len(data) > budget:
                    return out, True
                spent += len(data)
                out.setdefault(h.path, []).insert(0, data)
        return out, False

    def nbytes(self) -> int:
        return sum(h.nbytes for h in (*self._by_key.values(), *self._retired))

    def __len__(self) -> int:
        return len(self._by_key)


def runs_of(encoded: Iterable[bytes]) -> list[Run]:
    """An endpoint's runs from its encoded histories, in time order."""
    runs = [run for data in encoded for run in decode(data)]
    runs.sort(key=lambda r: r.start)
    return runs


def merged(histories: Mapping[str, Iterable[bytes]]) -> dict[str, list[Run]]:
    return {path: runs_of(data) for path, data in histories.items()}


def history_export(
    history: OutcomeHistory | None, budget: int
) -> tuple[dict[str, list[bytes]], bool]:
    """:meth:`OutcomeHistory.export` of a prober that may keep none."""
    return history.export(budget=budget) if history is not None else ({}, False)
