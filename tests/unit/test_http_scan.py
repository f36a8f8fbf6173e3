"""The L7 fast path's readers (http_scan.py): the C functions
against the Python one and against httptools, on tables of cases and on
generated messages - what they accept must be what the parser would make of
it, since an accepted request or response skips the parser."""

from __future__ import annotations

import os

import httptools
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthgate import http_scan
from healthgate.http_scan import NOT_PLAIN_NAMES, py_plain_request
from healthgate.probes.http import parse_head

try:
    from healthgate import _speedups
except ImportError:  # (test_the_speedups_are_built says why that fails here)
    _speedups = None  # type: ignore[assignment]

PURE = os.environ.get("HEALTHGATE_PURE_PYTHON", "") not in ("", "0")
needs_c = pytest.mark.skipif(_speedups is None, reason="the C speedups are not built")


def test_the_speedups_are_built() -> None:
    """`make test` installs a C compiler and Python's headers, so the C path
    is what the suite runs (and, with HEALTHGATE_PURE_PYTHON=1, the other)."""
    assert _speedups is not None, (
        "healthgate._speedups is not built: install gcc and python3-dev, then "
        "`pip install -e .` again (hatch_build.py prints why it skipped)"
    )
    assert http_scan.COMPILED is not PURE, (
        "healthgate._speedups is older than its source (it lacks one of "
        f"{http_scan._BUILT_NAMES}): `pip install -e .` again"
    )
    if PURE:
        assert http_scan.plain_request is py_plain_request
        assert http_scan.whole_response is None


GET = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
PLAIN_CASES: list[tuple[bytes, int]] = [
    (GET, 1),
    (b"HEAD /x?y=1 HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\n", 2),
    (b"GET / HTTP/1.1\r\n\r\n", 0),  # no Host: the general path's 400
    (b"GET / HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n", 0),  # two: the general path's 400
    (b"GET /a HTTP/1.1\r\nHost: a\r\nX-Empty:\r\nUser-Agent: wrk\t1\r\n\r\n", 1),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX_User: admin\r\n\r\n", 0),  # "_": dropped there
    (b"GET / HTTP/1.1\r\nHost: a\r\n" + b"X: y\r\n" * 99 + b"\r\n", 1),  # 100 lines
    (b"GET / HTTP/1.1\r\nHost: a\r\n" + b"X: y\r\n" * 100 + b"\r\n", 0),  # 101: its 431
    (b"POST / HTTP/1.1\r\nHost: a\r\n\r\n", 0),
    (b"get / HTTP/1.1\r\nHost: a\r\n\r\n", 0),
    (b"GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n", 0),  # absolute form
    (b"GET / HTTP/1.0\r\nHost: a\r\n\r\n", 0),
    (b"GET / HTTP/1.1\r\nHost : a\r\n\r\n", 0),  # space before the colon
    (b"GET / HTTP/1.1\r\nHost: \xc3\xa9\r\n\r\n", 0),  # obs-text
    (b"GET / HTTP/1.1\r\nHost: a\nX: b\r\n\r\n", 0),  # a bare LF
    (b"GET / HTTP/1.1\r\nHost: a\r\n", 0),  # not whole
    (b"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET / HTTP/1.1\r\n\r\n", 0),  # pipelined
    (b"GET /  HTTP/1.1\r\n\r\n", 0),
    (b"GET  / HTTP/1.1\r\n\r\n", 0),
    (b"", 0),
    (b"\r\n\r\n", 0),
    (b"GET / HTTP/1.1\r\n:\r\n\r\n", 0),  # no name
    *[(b"GET / HTTP/1.1\r\nHost: a\r\n" + n + b": x\r\n\r\n", 0) for n in NOT_PLAIN_NAMES],
    *[(b"GET / HTTP/1.1\r\nHost: a\r\n" + n.upper() + b":x\r\n\r\n", 0) for n in NOT_PLAIN_NAMES],
    (b"GET / HTTP/1.1\r\nHost: a\r\nTE-X: 1\r\nX-Connection: 1\r\ncontent-lengths: 1\r\n\r\n", 1),
]


@pytest.mark.parametrize(("data", "want"), PLAIN_CASES)
def test_plain_request_cases(data: bytes, want: int) -> None:
    assert py_plain_request(data) == want
    if _speedups is not None:
        assert _speedups.plain_request(data) == want


# pieces of request heads, valid and not, for the generated cases
_REQUEST_PIECES = st.lists(
    st.sampled_from(
        [
            b"GET ",
            b"HEAD ",
            b"POST ",
            b"/",
            b"/a?b",
            b" ",
            b"HTTP/1.1",
            b"HTTP/1.0",
            b"\r\n",
            b"\n",
            b"\r",
            b":",
            b"Host",
            b"host",
            b"X-Forwarded-For",
            b"te",
            b"TE",
            b"Connection",
            b"x",
            b"\t",
            b"\x00",
            b"\x7f",
            b"\xff",
            b"a b",
        ]
    ),
    max_size=24,
).map(b"".join)


_REQUEST_LINES = st.sampled_from(
    [
        b"Host: a\r\n",
        b"Accept: */*\r\n",
        b"X-Empty:\r\n",
        b"User-Agent: a\tb\r\n",
        b"X-Forwarded-For: 1.2.3.4\r\n",
        b"connection: close\r\n",
        b"TE: trailers\r\n",
        b"Host : a\r\n",
        b"Host: \xff\r\n",
        b"Host: a\n",
        b"Host: \x00\r\n",
        b":\r\n",
    ]
)


@st.composite
def _requests(draw: st.DrawFn) -> bytes:
    """Mostly plain requests, each piece sometimes not."""
    line = draw(
        st.sampled_from(
            [b"GET / HTTP/1.1\r\n"] * 4
            + [b"HEAD /a?b=c HTTP/1.1\r\n", b"GET /\xff HTTP/1.1\r\n", b"GET / HTTP/1.0\r\n"]
        )
    )
    lines = b"".join(draw(st.lists(_REQUEST_LINES, max_size=5)))
    end = draw(st.sampled_from([b"\r\n"] * 4 + [b"", b"\n", b"\r\nGET / HTTP/1.1\r\n\r\n"]))
    return line + lines + end


@needs_c
@settings(max_examples=3000, deadline=None)
@given(st.one_of(_requests(), _REQUEST_PIECES, st.binary()))
def test_plain_request_c_agrees_with_python(data: bytes) -> None:
    assert _speedups.plain_request(data) == py_plain_request(data)


class _Response:
    """What httptools makes of bytes given as one response."""

    def __init__(self, data: bytes) -> None:
        self.complete = 0
        self.keep_alive = False
        self.parser = httptools.HttpResponseParser(self)
        self.error: Exception | None = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = exc

    def on_message_complete(self) -> None:
        self.complete += 1
        self.keep_alive = self.parser.should_keep_alive()  # (as the proxy reads it)

    def status(self) -> int:
        return int(self.parser.get_status_code())


NGINX = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Wed, 02 Dec 2026 09:01:00 GMT\r\n"
    b"Content-Type: application/octet-stream\r\nContent-Length: 2\r\nConnection: keep-alive\r\n"
    b"\r\nok"
)
WHOLE_CASES: list[tuple[bytes, int]] = [
    (NGINX, 200),
    (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", 404),
    (b"HTTP/1.1 503 Service Unavailable\r\ncontent-length:  3 \r\n\r\nabc", 503),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: Keep-Alive\r\n\r\nok", 200),
    (b"HTTP/1.1 200 \r\nContent-Length: 0\r\n\r\n", 200),
    (NGINX[:-1], 0),  # the body not all there
    (NGINX + b"x", 0),  # more than one response
    (NGINX + NGINX, 0),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok", 0),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive, x\r\n\r\nok", 0),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", 0),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\nok", 0),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok", 0),
    (b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok", 0),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2 2\r\n\r\nok", 0),
    (b"HTTP/1.1 200 OK\r\nContent-Length:\r\n\r\n", 0),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n", 0),
    (b"HTTP/1.1 200 OK\r\n\r\n", 0),  # no length: read to the close
    (b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n", 0),
    (b"HTTP/1.1 304 Not Modified\r\nContent-Length: 0\r\n\r\n", 0),
    (b"HTTP/1.1 100 Continue\r\n\r\n", 0),
    (b"HTTP/1.1 101 Switching Protocols\r\nContent-Length: 0\r\n\r\n", 0),
    (b"HTTP/1.1 600 X\r\nContent-Length: 0\r\n\r\n", 0),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", 0),
    (b"HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n", 0),  # (valid, but not ours)
    (b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\nok", 0),
    (b"HTTP/1.1 200 OK\r\nX: \xff\r\nContent-Length: 2\r\n\r\nok", 0),
    (b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok", 0),
    (b"HTTP/1.1 2", 0),
    (b"", 0),
]


@needs_c
@pytest.mark.parametrize(("data", "want"), WHOLE_CASES)
def test_whole_response_cases(data: bytes, want: int) -> None:
    assert _speedups.whole_response(data) == want


def _check_with_httptools(data: bytes) -> int:
    status = _speedups.whole_response(data)
    if status:  # then httptools (and the probes' parse_head) read one reusable response
        head = parse_head(data, data.index(b"\r\n\r\n"), len(data))
        assert (head.status, head.reusable) == (status, True), data
        response = _Response(data)
        assert response.error is None, (data, response.error)
        assert response.complete == 1, data
        assert response.status() == status
        assert response.keep_alive
        assert _speedups.whole_response(data[:-1]) == 0  # one byte short: not whole
    return int(status)


@needs_c
@pytest.mark.parametrize(("data", "want"), WHOLE_CASES)
def test_what_whole_response_accepts_httptools_reads_the_same(data: bytes, want: int) -> None:
    assert _check_with_httptools(data) == want


@needs_c
@pytest.mark.parametrize(("data", "want"), WHOLE_CASES)
def test_what_whole_response_accepts_the_probes_parse_head_reads_the_same(
    data: bytes, want: int
) -> None:
    """probes/batch.py takes whole_response's word for a health check's
    answer: parse_head would have found the same status, reusable."""
    if want:
        head = parse_head(data, data.index(b"\r\n\r\n"), 65536)
        assert (head.status, head.reusable, head.error) == (want, True, "")


_HEADER = st.one_of(
    st.sampled_from(
        [
            b"Content-Length: 2\r\n",
            b"content-length:2\r\n",
            b"Content-Length: 0\r\n",
            b"Content-Length: 3 \r\n",
            b"Content-Length: x\r\n",
            b"Connection: keep-alive\r\n",
            b"Connection: close\r\n",
            b"Transfer-Encoding: chunked\r\n",
            b"Server: nginx\r\n",
            b"X:\r\n",
            b"X : y\r\n",
            b"X: \x01\r\n",
            b"X: y\n",
        ]
    ),
    st.tuples(st.text("abcXYZ-_.!~", min_size=0, max_size=6), st.binary(max_size=6)).map(
        lambda nv: nv[0].encode() + b":" + nv[1] + b"\r\n"
    ),
)


@st.composite
def _responses(draw: st.DrawFn) -> bytes:
    """Mostly whole responses, each piece sometimes not."""
    version = draw(st.sampled_from([b"HTTP/1.1"] * 6 + [b"HTTP/1.0", b"HTTP/2", b"http/1.1"]))
    status = draw(
        st.sampled_from([b"200", b"404", b"502"] * 2 + [b"204", b"304", b"100", b"20", b"2000"])
    )
    reason = draw(st.sampled_from([b" OK"] * 3 + [b" ", b"", b" \xff", b" a\tb"]))
    headers = b"".join(draw(st.lists(_HEADER, max_size=4)))
    end = draw(st.sampled_from([b"\r\n"] * 4 + [b"\n", b""]))
    body = draw(st.sampled_from([b"", b"ok", b"abc", b"okHTTP/1.1 200 OK\r\n\r\n"]))
    length = draw(st.sampled_from([b"Content-Length: %d\r\n" % len(body)] * 3 + [b""]))
    return version + b" " + status + reason + b"\r\n" + length + headers + end + body


@needs_c
@settings(max_examples=3000, deadline=None)
@given(st.one_of(_responses(), st.binary(max_size=64)))
def test_generated_responses_agree_with_httptools(data: bytes) -> None:
    _check_with_httptools(data)


@needs_c
def test_only_bytes() -> None:
    for reader in (_speedups.plain_request, _speedups.whole_response):
        with pytest.raises(TypeError):
            reader(bytearray(GET))  # type: ignore[arg-type]
