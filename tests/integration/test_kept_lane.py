"""Kept-alive HTTP and plain TCP checks through the scheduler, with and
without the lane (probes/lane.py), against real servers on loopback.

Each scenario runs twice: with a steady sink (the lane holds steady keys,
when the C speedups are built) and without one (every check on the Python
path, as ``make pure`` runs everything). The results each key sees, in
order, must be the same; with the lane, the steady ones must have come
through it, and the scheduler's counters must add up either way."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from healthgate.health.states import STEADY, Outcome, ProbeResult
from healthgate.probes.batch import LANE_SENDING, BatchProber
from healthgate.probes.lane import KeptLane
from healthgate.probes.prober import Prober, ProbeSettings
from healthgate.probes.scheduler import ProbeScheduler, SchedulerSettings
from healthgate.probes.spec import ProbeSpec
from tests.helpers import run_async
from tests.integration import servers
from tests.integration.servers import Server, free_port

ANSWER = b"HTTP/1.1 %d X\r\nContent-Length: 2\r\n\r\nok"


class Probing:
    """A scheduler with a kept-alive batch prober, its results by key in
    order (an Event when ``want`` of them are in)."""

    def __init__(self, lane: bool, keepalive: bool = True) -> None:
        settings = ProbeSettings(keepalive=keepalive)
        self.seen: list[tuple[Any, Outcome, int]] = []
        self.steady = 0  # results that came as the lane's steady records
        self.want = 0
        self.enough = asyncio.Event()
        self.scheduler = ProbeScheduler(
            Prober(settings),
            self._results,
            SchedulerSettings(),
            batch=BatchProber(settings),
            steady=self._steady if lane else None,
        )
        self.laned = lane and KeptLane is not None

    def _results(self, now: float, results: list[tuple[Any, ProbeResult]]) -> None:
        self._add([(k, r.outcome, r.status) for k, r in results])

    def _steady(self, now: float, records: bytes) -> None:
        got = [(k, Outcome.OK, status) for k, status, _ in STEADY.iter_unpack(records)]
        self.steady += len(got)
        self._add(got)

    def _add(self, got: list[tuple[Any, Outcome, int]]) -> None:
        self.seen += got
        if len(self.seen) >= self.want:
            self.enough.set()

    async def results(self, more: int, timeout: float = 10.0) -> list[tuple[Outcome, int]]:
        """Wait for ``more`` results beyond those seen; all of them."""
        self.want = len(self.seen) + more
        self.enough.clear()
        if len(self.seen) < self.want:
            await asyncio.wait_for(self.enough.wait(), timeout)
        return [(o, s) for _, o, s in self.seen]

    def counted(self) -> None:
        """Every probe started has ended, is in flight, or was dropped."""
        s = self.scheduler.stats
        assert s.started == s.finished + self.scheduler.in_flight + s.dropped, s
        assert s.finished == len(self.seen)

    async def close(self) -> None:
        await self.scheduler.close()


def spec(
    port: int, interval: float = 0.05, timeout: float = 0.5, path: str = "/", contains: bytes = b""
) -> ProbeSpec:
    return ProbeSpec("HTTP", "127.0.0.1", port, timeout, interval, path=path, contains=contains)


lanes = pytest.mark.parametrize("lane", [True, False], ids=["lane", "python"])


def probe_one(
    lane: bool, handler: servers.Handler, results: int, keepalive: bool = True, **kw: Any
) -> tuple[list[tuple[Outcome, int]], int]:
    """One key probed until ``results`` results are in: what it saw, and
    how many connections the server accepted (the counters checked)."""

    async def go() -> tuple[list[tuple[Outcome, int]], int]:
        p = Probing(lane, keepalive)
        async with Server(handler) as srv:
            p.scheduler.start()
            p.scheduler.upsert(1, spec(srv.port, **kw))
            seen = await p.results(results)
            p.counted()
            conns = srv.connections
            await p.close()
        return seen, conns

    result: tuple[list[tuple[Outcome, int]], int] = run_async(go())
    return result


def switchable(state: dict[str, Any]) -> servers.Handler:
    """Answers each request with state["status"]; while state["hang"], reads and never answers."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await servers.read_head(reader)
                state["paths"].append(head.split(b" ")[1])
                if state["hang"]:
                    await asyncio.Event().wait()
                body = state.get("body", b"ok")
                writer.write(
                    b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s"
                    % (state["status"], len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handler


def status_switch(lane: bool, keepalive: bool) -> tuple[Probing, list[Outcome], int]:
    """One key probed while its server answers 200, then 503, then 200
    again: the probing, the outcomes from the switch to 503 on, and how many
    connections the server accepted (the counters checked)."""
    state: dict[str, Any] = {"status": 200, "hang": False, "paths": []}

    async def go() -> tuple[Probing, list[Outcome], int]:
        p = Probing(lane, keepalive)
        async with Server(switchable(state)) as srv:
            p.scheduler.start()
            p.scheduler.upsert(1, spec(srv.port))
            await p.results(6)
            state["status"] = 503
            before = len(p.seen)
            await p.results(4)
            state["status"] = 200
            seen = await p.results(6)
            p.counted()
            conns = srv.connections
            await p.close()
        return p, [o for o, _ in seen[before:]], conns

    result: tuple[Probing, list[Outcome], int] = run_async(go())
    return result


@lanes
def test_a_status_that_changes_is_seen_at_once_and_steady_again_after(lane: bool) -> None:
    p, changed, conns = status_switch(lane, keepalive=True)
    assert conns == 1  # one kept connection all along
    # (one answer may have been on its way as the status changed)
    first_503 = changed.index(Outcome.STATUS)
    assert first_503 <= 1 and changed[first_503 : first_503 + 3] == [Outcome.STATUS] * 3
    assert changed[-3:] == [Outcome.OK] * 3
    if p.laned:
        assert p.steady >= 8  # the first result of each run of successes is the Python path's
    else:
        assert p.steady == 0


@lanes
def test_a_body_that_loses_its_text_fails_at_once_and_is_steady_again_after(lane: bool) -> None:
    state: dict[str, Any] = {"status": 200, "hang": False, "paths": [], "body": b"all good"}

    async def go() -> tuple[Probing, list[tuple[Outcome, int]]]:
        p = Probing(lane)
        async with Server(switchable(state)) as srv:
            p.scheduler.start()
            p.scheduler.upsert(1, spec(srv.port, contains=b"good"))
            await p.results(5)
            state["body"] = b"all bad"
            before = len(p.seen)
            await p.results(4)
            state["body"] = b"good again"
            seen = await p.results(6)
            p.counted()
            await p.close()
        return p, seen[before:]

    p, after = run_async(go())
    changed = [o for o, _ in after]
    first = changed.index(Outcome.CONTENT)
    assert first <= 1 and changed[first : first + 3] == [Outcome.CONTENT] * 3
    assert changed[-3:] == [Outcome.OK] * 3
    assert (p.steady >= 6) if p.laned else (p.steady == 0)


@lanes
def test_a_server_that_stops_answering_times_out_and_a_new_connection_follows(lane: bool) -> None:
    state: dict[str, Any] = {"status": 200, "hang": False, "paths": []}

    async def go() -> tuple[list[tuple[Outcome, int]], int]:
        p = Probing(lane)
        async with Server(switchable(state)) as srv:
            p.scheduler.start()
            p.scheduler.upsert(1, spec(srv.port, timeout=0.2))
            await p.results(4)
            state["hang"] = True
            seen = await p.results(3)
            p.counted()
            conns = srv.connections
            await p.close()
        return seen, conns

    seen, conns = run_async(go())
    assert seen[-2:] == [(Outcome.TIMEOUT, 0)] * 2
    assert conns >= 2  # a timed-out connection is not used again


@lanes
def test_a_server_that_closes_idle_connections_costs_no_failure(lane: bool) -> None:
    async def answer_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await servers.read_head(reader)
            writer.write(ANSWER % 200)
            await writer.drain()
            await asyncio.sleep(0.02)  # its idle timeout, well within the interval
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    seen, conns = probe_one(lane, answer_then_close, 6, interval=0.1)
    assert seen == [(Outcome.OK, 200)] * len(seen)
    assert conns >= len(seen) - 1


@lanes
@pytest.mark.parametrize("keepalive", [True, False], ids=["kept", "fresh"])
def test_an_answer_in_two_parts_is_read_whole(lane: bool, keepalive: bool) -> None:
    async def in_two_parts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await servers.read_head(reader)
                writer.write(ANSWER[:12] % 200)
                await writer.drain()
                await asyncio.sleep(0.05)  # (longer than a tick: read in two)
                writer.write((ANSWER % 200)[12:])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    seen, conns = probe_one(lane, in_two_parts, 5, keepalive, interval=0.1)
    assert seen == [(Outcome.OK, 200)] * len(seen)
    assert conns == 1 if keepalive else conns >= len(seen)


async def poll_until(poll: Any, what: Any = bool) -> Any:
    """Call ``poll`` until ``what`` holds of what it returns (bounded: 5 s)."""
    for _ in range(500):
        got = poll()
        if what(got):
            return got
        await asyncio.sleep(0.01)
    raise AssertionError("nothing came")


def test_the_batch_prober_reads_on_from_what_the_lane_read() -> None:
    """A key handed back mid-answer is a probe in flight in the batch
    prober, from the bytes the lane read; the rest of the answer ends it,
    on the same connection, and it can join the lane again."""
    if KeptLane is None:
        pytest.skip("the C speedups are not built")
    parts: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_cue(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await servers.read_head(reader)
                for _ in range(2):
                    writer.write(await parts.get())
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def go() -> None:
        batch = BatchProber(ProbeSettings(keepalive=True))
        assert batch.open_lane(0.01, lambda: 1)
        async with Server(on_cue) as srv:
            s = spec(srv.port)
            assert batch.start(1, s, 0.0) is None
            whole = ANSWER % 200
            parts.put_nowait(whole[:12])
            parts.put_nowait(whole[12:])
            [(key, first)] = await poll_until(lambda: batch.poll(0.01))
            assert (key, first.outcome) == (1, Outcome.OK)
            assert batch.enter_lane(1, s, 1.0) and batch.in_flight == 0
            assert batch.lane_start(1.0, 1.001, float("inf"), 8) == ([], False)
            parts.put_nowait(whole[:12])
            records, back, _ = await poll_until(lambda: batch.lane_poll(1.01, 9e9), lambda r: r[1])
            assert records == b"" and back == [(1, 0, 1.0, 1.0, None)]  # in flight here now
            assert batch.in_flight == 1 and len(batch.lane) == 0
            parts.put_nowait(whole[12:])
            [(key, second)] = await poll_until(lambda: batch.poll(1.02))
            assert (key, second.outcome, second.latency) == (1, Outcome.OK, pytest.approx(0.02))
            assert srv.connections == 1
            assert batch.enter_lane(1, s, 2.0)  # (its connection kept: it may join again)
        batch.close()

    run_async(go())


def test_the_batch_prober_sends_on_what_the_lane_could_not() -> None:
    """A fresh check whose request the kernel did not take whole is handed
    over with its socket (LANE_SENDING): the batch prober sends the rest,
    and the answer ends the probe there."""
    if KeptLane is None:
        pytest.skip("the C speedups are not built")
    body = b"x" * (8 << 20)  # (more than a new connection's send buffer takes at once)

    async def read_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await servers.read_head(reader)
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(ANSWER % 200)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def go() -> None:
        batch = BatchProber(ProbeSettings(keepalive=False))
        assert batch.open_lane(0.01, lambda: 1)
        async with Server(read_all) as srv:
            s = ProbeSpec("HTTP", "127.0.0.1", srv.port, 5.0, 1.0, method="POST", body=body)
            assert batch.start(1, s, 0.0) is None
            [(_, first)] = await poll_until(lambda: batch.poll(0.01))
            assert first.outcome == Outcome.OK
            assert batch.enter_lane(1, s, 1.0)
            # (the request goes as soon as connect returns: on loopback, then)
            back, deferred = batch.lane_start(1.0, 1.001, float("inf"), 8)
            for _ in range(500):  # bounded: 5 s
                if back:
                    break
                await asyncio.sleep(0.01)
                back = batch.lane_poll(1.01, 9e9)[1]
            assert back == [(1, LANE_SENDING, 1.0, 1.0, None)] and not deferred
            assert batch.in_flight == 1
            [(key, second)] = await poll_until(lambda: batch.poll(1.5))
            assert (key, second.outcome, srv.connections) == (1, Outcome.OK, 2)
        batch.close()

    run_async(go())


@lanes
def test_a_changed_check_and_a_removed_one_leave_at_once(lane: bool) -> None:
    state: dict[str, Any] = {"status": 200, "hang": False, "paths": []}

    async def go() -> tuple[list[bytes], int]:
        p = Probing(lane)
        async with Server(switchable(state)) as srv:
            p.scheduler.start()
            p.scheduler.upsert(1, spec(srv.port))
            p.scheduler.upsert(2, spec(srv.port))
            await p.results(8)
            p.scheduler.upsert(1, spec(srv.port, path="/changed"))
            await p.results(6)
            p.scheduler.remove(2)
            p.scheduler.remove(1)
            ended = len(p.seen)
            await asyncio.sleep(0.2)  # (four intervals: nothing more may come)
            p.counted()
            assert len(p.seen) == ended and p.scheduler.in_flight == 0
            await p.close()
            return state["paths"], srv.connections

    paths, conns = run_async(go())
    assert paths.count(b"/changed") >= 2
    assert conns == 3  # key 1's connection was dropped with its old check


@lanes
def test_a_tcp_check_refused_and_then_answered_again(lane: bool) -> None:
    """A plain TCP check: steady in the lane, handed back when the port
    refuses (the result Python's), in the lane again once it answers."""
    port = free_port()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async def until(p: Probing, outcome: Outcome, times: int) -> None:
        for _ in range(200):  # (at 50 ms an interval: at most 10 s)
            await p.results(1)
            if [o for _, o, _ in p.seen[-times:]] == [outcome] * times:
                return
        raise AssertionError(f"no {times} x {outcome} in a row: {p.seen}")

    async def go() -> tuple[list[Outcome], int, int]:
        p = Probing(lane)
        srv = await asyncio.start_server(accept, "127.0.0.1", port)
        p.scheduler.start()
        p.scheduler.upsert(1, ProbeSpec("TCP", "127.0.0.1", port, 0.5, 0.05))
        await until(p, Outcome.OK, 4)
        srv.close()
        await srv.wait_closed()
        await until(p, Outcome.REFUSED, 2)
        steady_before = p.steady
        srv = await asyncio.start_server(accept, "127.0.0.1", port)
        await until(p, Outcome.OK, 4)
        p.counted()
        await p.close()
        srv.close()
        await srv.wait_closed()
        return [o for _, o, _ in p.seen], steady_before, p.steady

    seen, steady_before, steady = run_async(go())
    runs = [o for i, o in enumerate(seen) if i == 0 or seen[i - 1] != o]
    assert runs == [Outcome.OK, Outcome.REFUSED, Outcome.OK], seen
    if lane and KeptLane is not None:
        assert steady_before >= 3 and steady >= steady_before + 3  # (in the lane again)
    else:
        assert steady == 0


@lanes
def test_a_fresh_check_sees_a_status_change_at_once_and_is_steady_again(lane: bool) -> None:
    """HTTP on a connection of its own per check (no --keepalive-probes):
    steady in the lane, handed over with its socket when the status is not
    expected (the result Python's), in the lane again once it is."""
    p, changed, conns = status_switch(lane, keepalive=False)
    first_503 = changed.index(Outcome.STATUS)
    assert first_503 <= 1 and changed[first_503 : first_503 + 3] == [Outcome.STATUS] * 3
    assert changed[-3:] == [Outcome.OK] * 3
    assert conns >= len(p.seen)  # a connection per check
    if p.laned:
        assert p.steady >= 8
    else:
        assert p.steady == 0


@lanes
def test_a_tcp_check_with_send_and_expect_fails_on_another_answer_and_is_steady_again(
    lane: bool,
) -> None:
    """SPEC §10's send/expect: steady in the lane while the answer begins as
    expected; another answer (handed over with its socket, and the partial
    one read on there) is the Python path's result."""
    state: dict[str, Any] = {"answer": [b"+PONG\r\n"]}

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n")
            for part in state["answer"]:
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0.01)
            await reader.read(1)  # until the prober goes
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def go() -> tuple[Probing, list[Outcome]]:
        p = Probing(lane)
        async with Server(answer) as srv:
            p.scheduler.start()
            s = ProbeSpec(
                "TCP", "127.0.0.1", srv.port, 0.5, 0.05, send=b"PING\r\n", expect=b"+PONG"
            )
            p.scheduler.upsert(1, s)
            await p.results(5)
            state["answer"] = [b"-ERR\r\n"]
            before = len(p.seen)
            await p.results(4)
            state["answer"] = [b"+PO", b"NG\r\n"]  # (in two parts: read on in Python)
            await p.results(5)
            p.counted()
            await p.close()
        return p, [o for _, o, _ in p.seen[before:]]

    p, after = run_async(go())
    first = after.index(Outcome.CONTENT)
    assert first <= 1 and after[first : first + 3] == [Outcome.CONTENT] * 3
    assert after[-3:] == [Outcome.OK] * 3
    if p.laned:
        assert p.steady >= 3
    else:
        assert p.steady == 0
