"""What the L7 fast path (dataplane/http.py) and the batch HTTP health
checks (probes/batch.py) read without a parser: a plain request, a whole
response.

Two functions, each a strict subset of what httptools (llhttp) accepts, so
that anything they do not recognise simply takes the parser's path:

* :func:`plain_request` - a request the fast path may forward as it is: GET
  or HEAD of an origin-form target in HTTP/1.1, whole in ``data`` (its head
  ends the read), at most :data:`MAX_HEADERS` header lines of token names
  without ``_`` (which the general path drops, as nginx does) and visible
  ASCII values, exactly one ``Host``, and none of the headers the general
  path rewrites, drops or acts on (:data:`NOT_PLAIN_NAMES`: framing,
  hop-by-hop, who the client says it is). 1 for GET, 2 for HEAD, 0 for
  anything else - which the general path answers (400 without a Host or
  with two, 431 past the header count).
* :func:`whole_response` - ``data`` is exactly one whole HTTP/1.1 response
  that leaves its connection reusable: a status of 200-599 other than 204
  and 304, a single ``Content-Length`` whose body ends where ``data`` ends,
  no ``Transfer-Encoding``, and no ``Connection`` header but
  ``keep-alive``. Its status, or 0. (An upstream's typical answer to a
  plain GET arrives in one read; the proxy then forwards it without feeding
  the parser and without the parser's callbacks; a health check's answer
  read by it costs ~50 ns instead of ~1 µs for probes/http.py's
  ``parse_head``, which it agrees with.)

Both are written in C (``healthgate/_speedups.c``, compiled when the
package is installed, if the machine has a C compiler and Python's
headers). Without it - or with ``HEALTHGATE_PURE_PYTHON=1`` set - the
fallback is :func:`py_plain_request` (regular expressions) and no
``whole_response``: read in Python, a response's framing costs more (~2 µs)
than httptools and its callbacks (and than the probes' ``parse_head``), so
every response then goes through those. tests/unit/test_http_scan.py checks
the C functions against the Python one, httptools and ``parse_head``; the
data-plane and probe tests run with each path (``make pure``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from types import ModuleType

__all__ = [
    "COMPILED",
    "HOP_BY_HOP",
    "MAX_HEADERS",
    "NOT_PLAIN_NAMES",
    "SPOOFABLE",
    "plain_request",
    "whole_response",
]

_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_FIELD = _TOKEN + rb":[\t -~]*\r\n"

# Hop-by-hop headers (RFC 9110 §7.6.1) and framing: the L7 proxy's general
# path drops them (dataplane/http_message.py), with every header that
# ``Connection`` names.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"upgrade",
        b"transfer-encoding",
        b"content-length",
        b"expect",
    }
)
# What a client says of where it is, or of how it reached us: not passed on
# (the proxy says who the client is in X-Forwarded-For, appended to what the
# client sent there; a backend that trusts any of these from a client could
# be told any address, host or scheme).
SPOOFABLE = frozenset(
    {
        b"forwarded",
        b"x-real-ip",
        b"x-forwarded-host",
        b"x-forwarded-proto",
        b"x-forwarded-port",
        b"x-forwarded-server",
        b"x-forwarded-scheme",
        b"x-original-forwarded-for",
        b"true-client-ip",
        b"x-client-ip",
        b"x-cluster-client-ip",
        b"cf-connecting-ip",
        b"fastly-client-ip",
    }
)
# header lines a request may have (431 beyond: as nginx and Envoy bound them)
MAX_HEADERS = 100
# Headers the general path rewrites, drops or acts on: a request with one of
# them is not plain (_speedups.c has the same list; the tests check both
# against this one).
NOT_PLAIN_NAMES = tuple(sorted(HOP_BY_HOP | SPOOFABLE | {b"x-forwarded-for"}))

# (request header names: tokens without "_", which the general path drops)
_REQUEST_FIELD = rb"[!#$%&'*+.^`|~0-9A-Za-z-]+:[\t -~]*\r\n"
_PLAIN = re.compile(rb"(GET|HEAD) /[!-~]* HTTP/1\.1\r\n(?:" + _REQUEST_FIELD + rb")*\r\n")
# each header line starts right after a "\n"; searched for in the lower-cased
# head (faster than re.IGNORECASE: 0.5 against 0.95 µs for a short head)
_NOT_PLAIN = re.compile(rb"\n(?:" + b"|".join(NOT_PLAIN_NAMES) + rb"):")


def py_plain_request(data: bytes, max_headers: int = MAX_HEADERS) -> int:
    if not data.endswith(b"\r\n\r\n"):
        return 0
    m = _PLAIN.fullmatch(data)
    if m is None or data.count(b"\r\n") - 2 > max_headers:
        return 0
    low = data.lower()
    if _NOT_PLAIN.search(low) is not None or low.count(b"\nhost:") != 1:
        return 0
    return 2 if m[1] == b"HEAD" else 1


plain_request: Callable[..., int] = py_plain_request  # (data[, max_headers])
# no Python version: in Python, reading a response's framing costs more
# (~2 µs) than httptools and its callbacks, which the fallback keeps using
whole_response: Callable[[bytes], int] | None = None
# the module itself, for the fast path's protocol bases (dataplane/http.py)
speedups: ModuleType | None = None
COMPILED = False
_BUILT_NAMES = (
    "plain_request",
    "whole_response",
    "FastProxy",
    "FastUpstream",
    "connect_fd",
    "disconnect_fd",
    "KeptLane",
    "steady_table",
    "steady_history",
)
if os.environ.get("HEALTHGATE_PURE_PYTHON", "") in ("", "0"):
    try:
        from healthgate import _speedups
    except ImportError:  # not built on this machine: the Python versions
        pass
    else:
        if all(hasattr(_speedups, name) for name in _BUILT_NAMES):
            plain_request = _speedups.plain_request
            whole_response = _speedups.whole_response
            speedups = _speedups
            COMPILED = True
        # (else a build older than this source - a checkout updated without
        # `pip install -e .` again - whose functions may not be what this
        # code expects: the Python versions, rather than a crash or a mix)
