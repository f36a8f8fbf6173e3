"""The lane's parts (probes/lane.py, src/healthgate/_kept.c).

* The lane itself, on socket pairs, with the times given: when it sends,
  what it takes as a steady success, what it hands back and why, and the
  timing rule of probes/timetable.py to the last bit.
* The steady records into an endpoint table and an outcome history: the C
  functions and the Python path take the same records to the same state,
  and leave the same records over (both run here, whatever is built).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from healthgate.health import endpoints, history
from healthgate.health.history import EXACT, OutcomeHistory
from healthgate.health.probed import ProbedTable
from healthgate.health.states import STEADY, HealthState, Outcome, ProbeResult, pack_steady
from healthgate.probes.batch import (
    LANE_ANSWER,
    LANE_FAILED,
    LANE_HANDED,
    LANE_IDLE,
    LANE_TIMEOUT,
    LANE_UNSENT,
    pack_sockaddr,
)
from healthgate.probes.http import BODY_SEARCHED
from healthgate.probes.lane import KeptLane
from healthgate.probes.stats import PROBE_BUCKETS
from healthgate.probes.timetable import next_due
from tests.integration.servers import FullBacklog, free_port
from tests.unit.test_probed import BS, CHECK, PATHS

needs_lane = pytest.mark.skipif(KeptLane is None, reason="the C speedups are not built")

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
REQUEST = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture
def lane() -> Iterator[Any]:
    if KeptLane is None:
        pytest.skip("the C speedups are not built")
    lane = KeptLane(0.010, 65536, PROBE_BUCKETS, 7, BODY_SEARCHED)
    yield lane
    lane.close()


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.settimeout(2.0)
    yield a, b
    a.close()
    b.close()


def test_a_steady_success_is_a_record_and_the_key_is_due_an_interval_after_the_end(
    lane: Any, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, server = pair
    lane.enter(5, ours.fileno(), REQUEST, 1.0, 0.5, 10.0, 200, 299, b"")
    assert len(lane) == 1 and lane.next_due == 10.0 and lane.in_flight == 0
    assert lane.start(9.99, 9.995, float("inf")) == (None, False)  # not due before the horizon
    assert lane.start(10.004, 10.005, float("inf")) == (None, False)  # started 4 ms late
    assert server.recv(1000) == REQUEST and lane.in_flight == 1 and lane.next_due is None
    server.sendall(OK)
    records, back, backlog = lane.poll(10.010, float("inf"))
    assert back is None and backlog is False
    assert list(STEADY.iter_unpack(records)) == [(5, 200, pytest.approx(0.006))]
    # probes/timetable.py's rule: an interval after the end, less the lateness
    assert lane.next_due == next_due(1.0, 10.0, 10.004, 10.010, 0.0)
    started, late, finished, total, buckets = lane.take_counts()
    assert (started, late, finished) == (1, 0, 1) and total == pytest.approx(0.006)
    assert sum(buckets) == 1 and buckets[bisect.bisect_left(PROBE_BUCKETS, 0.006)] == 1
    assert lane.take_counts()[:3] == (0, 0, 0)  # taken: counted once


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b"HTTP/1.1 503 X\r\nContent-Length: 2\r\n\r\nno", "a status not expected"),
        (OK[:20], "part of an answer"),
        (OK + b"HTTP/1.1 200", "more than one answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok", "closing"),
        (b"garbage\r\n\r\n", "not HTTP"),
    ],
)
def test_anything_but_a_whole_expected_answer_is_handed_back_with_what_was_read(
    lane: Any, pair: tuple[socket.socket, socket.socket], answer: bytes, why: str
) -> None:
    ours, server = pair
    lane.enter(1, ours.fileno(), REQUEST, 1.0, 0.5, 0.0, 200, 200, b"")
    lane.start(0.001, 0.005, float("inf"))
    server.recv(1000)
    server.sendall(answer)
    records, back, _ = lane.poll(0.003, float("inf"))
    assert records == b"", why
    [(key, what, started, due, data, events, fd)] = back
    assert (key, what, started, due, data, fd) == (1, LANE_ANSWER, 0.001, 0.0, answer, -1)
    assert events & select.EPOLLIN
    assert len(lane) == 0  # it left the lane
    assert lane.take_counts()[:3] == (1, 0, 0)  # started here, finished by the caller


@pytest.mark.parametrize(
    ("body", "steady"),
    [
        (b"all ok here", True),
        (b"x" * (BODY_SEARCHED - 2) + b"ok", True),  # the needle ends at the last byte searched
        (b"x" * (BODY_SEARCHED - 1) + b"ok", False),  # one byte past it: the Python path's
        (b"nothing", False),
    ],
)
def test_response_contains_is_searched_in_the_bytes_the_python_path_searches(
    lane: Any, pair: tuple[socket.socket, socket.socket], body: bytes, steady: bool
) -> None:
    ours, server = pair
    lane.enter(1, ours.fileno(), REQUEST, 1.0, 0.5, 0.0, 200, 200, b"ok")
    lane.start(0.001, 0.005, float("inf"))
    server.recv(1000)
    server.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    records, back, _ = lane.poll(0.003, float("inf"))
    assert (records != b"", back is None) == (steady, steady)


def test_a_closed_connection_is_handed_back_with_nothing_read(
    lane: Any, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, server = pair
    lane.enter(1, ours.fileno(), REQUEST, 1.0, 0.5, 0.0, 200, 200, b"")
    lane.start(0.001, 0.005, float("inf"))
    server.close()
    _, back, _ = lane.poll(0.003, float("inf"))
    assert [(k, what, data) for k, what, _s, _d, data, _e, _f in back] == [(1, LANE_ANSWER, b"")]


def test_a_timeout_and_an_idle_connection_that_spoke_are_handed_back(
    lane: Any, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, _server = pair
    other, other_server = socket.socketpair()
    try:
        other.setblocking(False)
        lane.enter(1, ours.fileno(), REQUEST, 1.0, 0.5, 0.0, 200, 200, b"")
        lane.enter(2, other.fileno(), REQUEST, 1.0, 0.5, 5.0, 200, 200, b"")
        lane.start(0.0, 0.002, float("inf"))  # key 1 only
        assert lane.poll(0.499, float("inf"))[1] is None  # not yet
        other_server.close()  # key 2's connection closes while idle
        records, back, _ = lane.poll(0.5, float("inf"))
        assert records == b""
        assert sorted((k, what, started, due) for k, what, started, due, _d, _e, _f in back) == [
            (1, LANE_TIMEOUT, 0.0, 0.0),
            (2, LANE_IDLE, 0.0, 5.0),
        ]
        assert len(lane) == 0
    finally:
        other.close()
        other_server.close()


def test_a_send_that_fails_hands_the_key_back_unsent(
    lane: Any, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, server = pair
    lane.enter(3, ours.fileno(), REQUEST, 1.0, 0.5, 1.0, 200, 200, b"")
    server.close()
    ours.shutdown(socket.SHUT_WR)  # (a send now fails: EPIPE)
    back, deferred = lane.start(1.0, 1.5, float("inf"))
    assert [(k, what, due) for k, what, _s, due, _d, _e, _f in back] == [(3, LANE_UNSENT, 1.0)]
    assert not deferred and len(lane) == 0 and lane.take_counts()[0] == 0


def test_leaving_says_whether_a_request_was_out_and_a_key_enters_once(
    lane: Any, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, _server = pair
    lane.enter(1, ours.fileno(), REQUEST, 1.0, 0.5, 0.0, 200, 200, b"")
    with pytest.raises(ValueError, match="in the lane already"):
        lane.enter(1, ours.fileno(), REQUEST, 1.0, 0.5, 0.0, 200, 200, b"")
    assert lane.leave(1) is False and lane.leave(1) is None
    lane.enter(1, ours.fileno(), REQUEST, 1.0, 0.5, 0.0, 200, 200, b"")
    lane.start(0.0, 0.1, float("inf"))
    assert lane.leave(1) is True and len(lane) == 0


@pytest.mark.parametrize(
    "args",
    [
        (-1, 3, REQUEST, 1.0, 0.5, 0.0, 200, 200, b""),  # a key out of its range
        (2**31, 3, REQUEST, 1.0, 0.5, 0.0, 200, 200, b""),
        (1, -3, REQUEST, 1.0, 0.5, 0.0, 200, 200, b""),  # not a descriptor
        (1, 3, "text", 1.0, 0.5, 0.0, 200, 200, b""),  # not bytes
        (1, 3, REQUEST, 0.0, 0.5, 0.0, 200, 200, b""),  # no interval
        (1, 3, REQUEST, 1.0, 0.5, 0.0, 200, 200, "ok"),  # a needle not bytes
        (1, 3, REQUEST, 1.0, 0.5, 0.0, 200, 200),  # no needle
    ],
)
def test_what_the_lane_cannot_hold_is_refused(lane: Any, args: tuple[Any, ...]) -> None:
    with pytest.raises((ValueError, TypeError)):
        lane.enter(*args)
    assert len(lane) == 0


def test_a_stalled_key_is_spread_again_within_its_interval(
    lane: Any, pair: tuple[socket.socket, socket.socket]
) -> None:
    """Started more than half an interval late: due again within one
    interval of the end, at a random point (probes/timetable.py)."""
    ours, server = pair
    lane.enter(1, ours.fileno(), REQUEST, 1.0, 0.5, 0.0, 200, 200, b"")
    lane.start(0.7, 0.8, float("inf"))
    server.recv(1000)
    server.sendall(OK)
    lane.poll(0.71, float("inf"))
    assert 0.71 <= lane.next_due < 1.71
    assert lane.take_counts()[1] == 1  # and it counted as late


# ------------------------------------------------------------------ plain TCP checks


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(3.0)
    yield srv
    srv.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def poll_until(lane: Any, now: float, seconds: float = 4.0) -> tuple[bytes, Any]:
    """Poll the lane until it has something to say. (What it waits for is
    the kernel's SYN retransmission, 1 s after a dropped SYN: a timer with no
    event outside the lane's own epoll set; so a bounded poll, 50 ms apart.)"""
    for _ in range(int(seconds / 0.05)):
        records, back, _ = lane.poll(now, float("inf"))
        if records or back:
            return records, back
        time.sleep(0.05)
    raise AssertionError(f"the lane said nothing in {seconds} s")


def test_a_tcp_check_that_connects_is_a_steady_record_and_its_socket_is_reused(
    lane: Any, listener: socket.socket
) -> None:
    port = listener.getsockname()[1]
    lane.enter_tcp(3, pack_sockaddr("127.0.0.1", port), 1.0, 0.5, 10.0)
    assert len(lane) == 1 and lane.next_due == 10.0
    assert lane.start(10.002, 10.005, float("inf")) == (None, False)
    records, back, _ = lane.poll(10.003, float("inf"))
    assert back is None and list(STEADY.iter_unpack(records)) == [(3, 0, pytest.approx(0.001))]
    assert lane.next_due == next_due(1.0, 10.0, 10.002, 10.003, 0.0)
    first, _ = listener.accept()
    with first, pytest.raises(ConnectionResetError):  # reset, not closed: no TIME_WAIT
        first.recv(10)
    fds = open_fds()
    lane.start(11.0, 11.005, float("inf"))
    assert list(STEADY.iter_unpack(lane.poll(11.0, float("inf"))[0])) == [(3, 0, 0.0)]
    assert lane.in_flight == 0
    second, _ = listener.accept()
    second.close()
    assert open_fds() == fds  # the socket of the first check, disconnected and reused
    assert lane.take_counts()[:3] == (2, 0, 2)
    lane.close()
    assert open_fds() == fds - 2  # (the pooled socket closed with the lane, and its epoll set)


def test_a_refused_tcp_check_is_handed_back_with_its_errno(lane: Any) -> None:
    lane.enter_tcp(4, pack_sockaddr("127.0.0.1", free_port()), 1.0, 0.5, 1.0)
    back, deferred = lane.start(1.0, 1.005, float("inf"))
    if back is None:  # (Linux: the reset is read from the epoll set, not by the connect)
        records, back, _ = lane.poll(1.001, float("inf"))
        assert records == b""
    assert [(k, what, s, due, d, e, f) for k, what, s, due, d, e, f in back] == [
        (4, LANE_FAILED, 1.0, 1.0, b"", errno.ECONNREFUSED, -1)
    ]
    assert not deferred and len(lane) == 0
    assert lane.take_counts()[:3] == (1, 0, 0)  # started here, ended by Python


def test_a_tcp_check_whose_handshake_waits_times_out_and_its_socket_is_reset(
    lane: Any,
) -> None:
    fds = open_fds() - 1  # (less the lane's epoll set, which it closes)
    with FullBacklog() as full:
        lane.enter_tcp(5, pack_sockaddr("127.0.0.1", full.port), 1.0, 0.5, 0.0)
        lane.enter_tcp(6, pack_sockaddr("127.0.0.1", full.port), 1.0, 0.5, 0.0)
        assert lane.start(0.0, 0.005, float("inf")) == (None, False)
        assert lane.in_flight == 2
        assert lane.poll(0.49, float("inf"))[:2] == (b"", None)
        assert lane.leave(6) is True  # (a key that leaves in flight: its socket closed)
        records, back, _ = lane.poll(0.5, float("inf"))
        assert records == b"" and [(k, what, s) for k, what, s, _d, _b, _e, _f in back] == [
            (5, LANE_TIMEOUT, 0.0)
        ]
    assert len(lane) == 0 and lane.in_flight == 0
    assert open_fds() == fds + 3  # (both sockets disconnected, for the next checks)
    lane.close()
    assert open_fds() == fds


def test_tcp_connects_under_way_stay_within_the_room_given(lane: Any) -> None:
    """Each connect under way holds a descriptor: the scheduler's cap on
    probes in flight bounds them (a key past it waits, late)."""
    with FullBacklog() as full:
        for key in (1, 2, 3):
            lane.enter_tcp(key, pack_sockaddr("127.0.0.1", full.port), 1.0, 0.2, key / 1000)
        assert lane.start(0.003, 0.005, float("inf"), 2) == (None, False)
        assert lane.connecting == 2 and lane.in_flight == 2 and lane.next_due == 0.003
        assert lane.start(0.1, 0.105, float("inf"), 2) == (None, False)
        assert lane.connecting == 2  # (still no room)
        back = lane.poll(0.203, float("inf"))[1]
        assert sorted(k for k, *_ in back) == [1, 2] and lane.connecting == 0
        lane.start(0.21, 0.215, float("inf"), 2)
        assert lane.connecting == 1 and lane.next_due is None
        assert lane.take_counts()[:2] == (3, 1)  # key 3 started late


def test_a_tcp_check_whose_handshake_ends_later_is_read_from_the_epoll_set(lane: Any) -> None:
    """The path of every check beyond loopback: connect says EINPROGRESS."""
    with FullBacklog() as full:
        lane.enter_tcp(7, pack_sockaddr("127.0.0.1", full.port), 5.0, 5.0, 0.0)
        lane.start(0.0, 0.005, float("inf"))
        assert lane.in_flight == 1
        full.listener.settimeout(0.1)
        for _ in range(len(full.fillers)):  # room in the accept queue for the SYN, sent again
            with contextlib.suppress(TimeoutError):
                full.listener.accept()[0].close()
        records, back = poll_until(lane, 1.5)
    assert back is None and list(STEADY.iter_unpack(records)) == [(7, 0, 1.5)]
    assert lane.in_flight == 0 and lane.next_due == 6.5


def test_a_tcp_check_refused_after_it_began_is_handed_back_with_its_errno(lane: Any) -> None:
    with FullBacklog() as full:
        lane.enter_tcp(8, pack_sockaddr("127.0.0.1", full.port), 5.0, 5.0, 0.0)
        lane.start(0.0, 0.005, float("inf"))
        full.listener.close()  # the SYN sent again meets no listener: a reset
        records, back = poll_until(lane, 1.2)
    assert records == b"" and [(k, what, e) for k, what, _s, _d, _b, e, _f in back] == [
        (8, LANE_FAILED, errno.ECONNREFUSED)
    ]


@pytest.mark.parametrize(
    "args",
    [
        (1, b"\x02\x00", 1.0, 0.5, 0.0),  # too short for its family
        (1, bytes(pack_sockaddr("::1", 80) or b"")[:16], 1.0, 0.5, 0.0),  # IPv6 cut short
        (1, bytes(16), 1.0, 0.5, 0.0),  # no family
        (-1, pack_sockaddr("127.0.0.1", 80), 1.0, 0.5, 0.0),
        (1, pack_sockaddr("127.0.0.1", 80), 0.0, 0.5, 0.0),  # no interval
        (1, "127.0.0.1:80", 1.0, 0.5, 0.0),
    ],
)
def test_a_tcp_check_the_lane_cannot_hold_is_refused(lane: Any, args: tuple[Any, ...]) -> None:
    with pytest.raises((ValueError, TypeError)):
        lane.enter_tcp(*args)
    assert len(lane) == 0


# ------------------------------------------------------------------ fresh HTTP checks

CLOSING = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


def fresh_started(lane: Any, listener: socket.socket, key: int = 9) -> socket.socket:
    """A fresh check of ``key`` begun at 0.0 and its request sent: the
    server's side of its connection, the request read."""
    lane.enter_fresh(
        key, pack_sockaddr(*listener.getsockname()), REQUEST, 1.0, 0.5, 0.0, 200, 299, b""
    )
    assert lane.start(0.0, 0.005, float("inf")) == (None, False)
    assert lane.connecting == 1
    assert lane.poll(0.001, float("inf"))[:2] == (b"", None)  # connected: the request goes
    conn, _ = listener.accept()
    conn.settimeout(2.0)
    assert conn.recv(1000) == REQUEST
    return conn


def test_a_fresh_check_answered_whole_is_a_steady_record_and_its_connection_reset(
    lane: Any, listener: socket.socket
) -> None:
    conn = fresh_started(lane, listener)
    with conn:
        conn.sendall(CLOSING)  # (a fresh check's answer may close: it is not kept)
        records, back, _ = lane.poll(0.002, float("inf"))
        assert back is None and list(STEADY.iter_unpack(records)) == [(9, 200, 0.002)]
        with pytest.raises(ConnectionResetError):
            conn.recv(10)
    assert lane.connecting == 0 and lane.in_flight == 0 and lane.next_due == 1.002
    fds = open_fds()
    with fresh_started(lane, listener, key=11) as again:  # (the same socket, from the pool)
        assert open_fds() == fds + 1  # (the server's side of it)
        again.sendall(CLOSING)
        assert len(lane.poll(0.003, float("inf"))[0]) == STEADY.size


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 500 X\r\nContent-Length: 2\r\n\r\nno",  # not an expected status
        CLOSING[:-1],  # a body still to come
        b"",  # closed without a word
    ],
)
def test_a_fresh_check_that_is_not_steady_is_handed_over_with_its_socket(
    lane: Any, listener: socket.socket, answer: bytes
) -> None:
    conn = fresh_started(lane, listener)
    with conn:
        if answer:
            conn.sendall(answer)
        else:
            conn.shutdown(socket.SHUT_WR)
        records, back, _ = lane.poll(0.002, float("inf"))
        [(key, what, started, due, data, events, fd)] = back
        assert (records, key, what, started, due, data) == (b"", 9, LANE_HANDED, 0.0, 0.0, answer)
        assert events & (select.EPOLLIN | select.EPOLLRDHUP)
        assert len(lane) == 0 and lane.connecting == 0  # it is the caller's now
        with socket.socket(fileno=fd) as sock:  # (connected still: the caller reads on)
            assert sock.getpeername() == listener.getsockname()


def test_a_fresh_check_with_no_answer_times_out_and_a_refused_one_fails(
    lane: Any, listener: socket.socket
) -> None:
    with fresh_started(lane, listener):
        lane.enter_fresh(
            10, pack_sockaddr("127.0.0.1", free_port()), REQUEST, 1.0, 0.5, 0.0, 200, 200, b""
        )
        refused, _ = lane.start(0.1, 0.105, float("inf"))  # (on loopback: as the request goes)
        records, back, _ = lane.poll(0.5, float("inf"))
        back = (refused or []) + (back or [])
    assert records == b"" and sorted((k, what, e) for k, what, _s, _d, _b, e, _f in back) == [
        (9, LANE_TIMEOUT, 0),
        (10, LANE_FAILED, errno.ECONNREFUSED),
    ]
    assert lane.connecting == 0 and len(lane) == 0


@pytest.mark.parametrize(
    "args",
    [
        (1, b"\x02\x00", REQUEST, 1.0, 0.5, 0.0, 200, 200, b""),  # not an address
        (1, pack_sockaddr("127.0.0.1", 80), b"", 1.0, 0.5, 0.0, 200, 200, b""),  # no request
        (1, pack_sockaddr("127.0.0.1", 80), REQUEST, 1.0, 0.0, 0.0, 200, 200, b""),  # no timeout
        (1, pack_sockaddr("127.0.0.1", 80), REQUEST, 1.0, 0.5, 0.0, 200, 200),  # no needle
    ],
)
def test_a_fresh_check_the_lane_cannot_hold_is_refused(lane: Any, args: tuple[Any, ...]) -> None:
    with pytest.raises((ValueError, TypeError)):
        lane.enter_fresh(*args)
    assert len(lane) == 0


# ------------------------------------------------------------------ TCP checks with send and expect


def expect_started(
    lane: Any, listener: socket.socket, send: bytes, expect: bytes, key: int = 12
) -> socket.socket:
    """A TCP check of ``key`` with ``send`` and ``expect`` begun at 0.0 and
    connected (what it sends sent): the server's side of its connection."""
    address = pack_sockaddr(*listener.getsockname())
    lane.enter_tcp(key, address, 1.0, 0.5, 0.0, send, expect)
    assert lane.start(0.0, 0.005, float("inf")) == (None, False)
    records, back, _ = lane.poll(0.001, float("inf"))
    assert back is None and (records != b"") == (not expect)  # (nothing expected: done)
    conn, _ = listener.accept()
    conn.settimeout(2.0)
    if send:
        assert conn.recv(1000) == send
    return conn


@pytest.mark.parametrize(
    ("send", "expect", "answer"),
    [
        (b"PING\r\n", b"+PONG", b"+PONG\r\n"),
        (b"", b"220 ", b"220 mail ready\r\n"),  # a banner
    ],
)
def test_a_tcp_check_answered_as_expected_is_a_steady_record(
    lane: Any, listener: socket.socket, send: bytes, expect: bytes, answer: bytes
) -> None:
    with expect_started(lane, listener, send, expect) as conn:
        conn.sendall(answer)
        records, back, _ = lane.poll(0.002, float("inf"))
        assert back is None and list(STEADY.iter_unpack(records)) == [(12, 0, 0.002)]
        with pytest.raises(ConnectionResetError):
            conn.recv(10)
    assert lane.connecting == 0 and lane.next_due == 1.002


def test_a_tcp_check_that_only_sends_is_done_once_it_has_sent(
    lane: Any, listener: socket.socket
) -> None:
    with expect_started(lane, listener, b"hello\n", b""):
        pass
    assert lane.connecting == 0 and lane.take_counts()[:3] == (1, 0, 1)


@pytest.mark.parametrize("answer", [b"+PO", b"-ERR unknown\r\n", b""])
def test_a_tcp_check_not_answered_as_expected_is_handed_over_with_its_socket(
    lane: Any, listener: socket.socket, answer: bytes
) -> None:
    with expect_started(lane, listener, b"PING\r\n", b"+PONG") as conn:
        if answer:
            conn.sendall(answer)
        else:
            conn.shutdown(socket.SHUT_WR)
        records, back, _ = lane.poll(0.002, float("inf"))
        [(key, what, _s, _d, data, _e, fd)] = back
        assert (records, key, what, data) == (b"", 12, LANE_HANDED, answer)
        os.close(fd)
    assert len(lane) == 0 and lane.connecting == 0


def test_a_tcp_check_expecting_more_than_an_answer_read_is_refused(lane: Any) -> None:
    address = pack_sockaddr("127.0.0.1", 80)
    with pytest.raises(ValueError, match="expect"):
        lane.enter_tcp(1, address, 1.0, 0.5, 0.0, b"", b"x" * 70_000)  # (the fixture reads 64 KiB)
    with pytest.raises(TypeError):
        lane.enter_tcp(1, address, 1.0, 0.5, 0.0, "PING", b"")
    assert len(lane) == 0


# ------------------------------------------------------------------ into a table and a history


def table_with(states: dict[int, HealthState]) -> tuple[ProbedTable, list[int]]:
    table = ProbedTable()
    added = table.change(0.0, {BS: (CHECK, {})}, PATHS, []).added
    slots = sorted(t.slot for t in added)
    for slot in slots:
        table.resume(0.0, slot, states.get(slot, HealthState.HEALTHY), 0.0)
    return table, slots


@pytest.fixture(params=["c", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "c":
        if endpoints._steady_table is None:
            pytest.skip("the C speedups are not built")
    else:
        monkeypatch.setattr(endpoints, "_steady_table", None)
        monkeypatch.setattr(history, "_steady_history", None)
    return str(request.param)


def test_steady_records_go_into_a_table_as_its_results_would(path: str) -> None:
    probe = ProbedTable()
    slots = sorted(t.slot for t in probe.change(0.0, {BS: (CHECK, {})}, PATHS, []).added)
    healthy, other = slots[0], slots[1]
    by_steady, _ = table_with({other: HealthState.UNKNOWN})
    by_results, _ = table_with({other: HealthState.UNKNOWN})
    for table in (by_steady, by_results):  # a failure's detail, to be cleared by a success
        table.table.on_results(1.0, [(healthy, ProbeResult(Outcome.REFUSED, 0.1, 0, "gone"))])
        table.table.on_results(1.5, [(healthy, ProbeResult(Outcome.OK, 0.1, 200))])
        table.table.set_state(1.5, healthy, HealthState.HEALTHY, "test")
    records = pack_steady([(healthy, 204, 0.25), (other, 200, 0.5)])
    left = by_steady.table.on_steady(2.0, records)
    assert left == pack_steady([(other, 200, 0.5)])  # not HEALTHY: the Python path's
    by_results.table.on_results(2.0, [(healthy, ProbeResult(Outcome.OK, 0.25, 204))])
    for slot in slots:
        assert by_steady.table.observed(slot) == by_results.table.observed(slot), path
        assert by_steady.table.state(slot) is by_results.table.state(slot)


def test_a_success_run_stays_capped(path: str) -> None:
    table, slots = table_with({})
    for i in range(300):
        assert table.table.on_steady(float(i), pack_steady([(slots[0], 200, 0.001)])) == b""
    assert table.table.observed(slots[0])[0] == 255


def test_steady_records_extend_a_history_as_record_would(path: str) -> None:
    by_steady, by_record = OutcomeHistory(), OutcomeHistory()

    def path_of(key: int) -> str:
        return f"ep{key}"

    ok = ProbeResult(Outcome.OK, 0.001, 200)
    for h in (by_steady, by_record):  # key 1 past its exact part; key 2 a few; key 3 a failure
        for i in range(EXACT + 2):
            h.record(float(i), [(1, ok)], path_of)
        h.record(0.0, [(2, ok)], path_of)
        h.record(0.0, [(3, ProbeResult(Outcome.REFUSED, 0.001))], path_of)
    now = float(EXACT + 5)
    by_steady.steady(now, pack_steady([(1, 200, 0.002), (2, 200, 0.002), (3, 200, 0.002)]), path_of)
    by_record.record(now, [(k, ProbeResult(Outcome.OK, 0.002, 200)) for k in (1, 2, 3)], path_of)
    assert by_steady.export() == by_record.export(), path


def test_a_steady_record_of_another_status_starts_a_run(path: str) -> None:
    by_steady, by_record = OutcomeHistory(), OutcomeHistory()
    for h in (by_steady, by_record):
        for i in range(EXACT + 1):
            h.record(float(i), [(1, ProbeResult(Outcome.OK, 0.001, 200))], str)
    by_steady.steady(20.0, pack_steady([(1, 204, 0.002)]), str)
    by_record.record(20.0, [(1, ProbeResult(Outcome.OK, 0.002, 204))], str)
    assert by_steady.export() == by_record.export()


def test_records_that_are_not_records_are_refused() -> None:
    if endpoints._steady_table is None:
        pytest.skip("the C speedups are not built")
    table, _ = table_with({})
    with pytest.raises(TypeError):
        table.table.on_steady(1.0, b"\x00" * 15)
