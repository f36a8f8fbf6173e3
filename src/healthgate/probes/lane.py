"""The lane: a steady HTTP check (kept alive or fresh) or plain TCP check, whole, in C.

Why
---
A kept-alive HTTP check on loopback costs its kernel ~9 µs (the send, the
server's wake-up, the answer, the read) and, before the lane, ~14 µs of
Python: the scheduler's due times and bookkeeping, the batch prober's send,
read and verdict, a result object, the engine's threshold step and the
outcome history - for a result that, most of the time, changes nothing but
a counter (issue 45). A plain TCP check (a connect and the reset) and an
HTTP check on a fresh connection are the same story with a handshake. The
lane does all of
it for such checks in C (``_speedups.KeptLane``, src/healthgate/_kept.c),
with no Python call per check.

What is in the lane
-------------------
A key enters when its probe ends with a success (the scheduler asks the
batch prober: :meth:`BatchProber.enter_lane`), if the C speedups are built
and its check is plain enough:

* an HTTP check with no ``degradedStatusCodes``, not inverted, not HEAD,
  one range of expected statuses (``responseContains`` is searched for in
  C, in the same first 5,120 bytes of the body): kept alive, on its kept
  connection; or on a fresh connection per check (no ``--keepalive-probes``)
  with no PROXY preamble, from no set source address, to an address with
  no IPv6 scope;
* a TCP check, not inverted, with no PROXY preamble, from no set source
  address, to an address with no IPv6 scope: one that only connects (not
  half-open), or one with ``send`` or ``expect`` (SPEC §10).

**Kept-alive HTTP.** From then on the lane holds its connection, its request and its
timing (probes/timetable.py's rule, the same arithmetic): it sends the
request when due, reads the answer, and an answer that is one whole reusable
response with an expected status (and the ``responseContains`` text) is a
**steady success**, packed as a
16-byte record (health/states.py's ``STEADY``: key, status, latency) and re-armed - never a
Python object. Each tick's records go to the steady sink in one call, which
takes them into the endpoint table (:meth:`EndpointTable.on_steady`: a
HEALTHY endpoint's success, the threshold machine's steady step) and the
outcome history (:meth:`OutcomeHistory.steady`), also in C; a record either
cannot take (an endpoint not HEALTHY yet, a run that is not the same) takes
the Python path as a result like any other.

**Plain TCP.** The lane holds the endpoint's address and the key's timing.
When due it connects a socket of its own (from its pool of disconnected
sockets, which reset as they disconnect: no FIN, no TIME_WAIT, as the batch
prober's); a connect that completes - at once, as on loopback, or later in
its epoll set - is a steady success (status 0, the same record), and the
socket is disconnected and pooled. A connect that fails (refused,
unreachable, reset), at once or later, hands the key back with its errno,
and Python makes the result as the batch prober's ``_connected`` would; a
timeout hands it back too. Either way the lane has closed the socket, and
the key is out of the lane until its next success. With ``send`` or
``expect``, the connection then sends and reads as a fresh HTTP check's
(below) does, and the answer's first bytes are the verdict.

**Fresh HTTP.** As a TCP check, and the request goes out as soon as
connect returns (as the batch prober's: on loopback the handshake is in by
then; elsewhere at the connect's end), whole, or the rest is Python's; an answer that is one whole response
with an expected status (``Connection: close`` allowed: the connection is
reset after it all the same) is a steady success, the socket disconnected
and pooled. Anything else - another status, a partial answer, a closed
connection - hands the check over to Python **with its socket** and what
was read (:meth:`BatchProber._go_on`), where the batch prober reads on as if
it had begun the probe itself; a refused or failed connection and a
timeout are handed back as a TCP check's.

Anything else hands a kept-alive key back to Python, where the batch prober goes on
as it always has: an answer that is partial, closing, unexpected or in
several reads (``_read``, from the bytes already read), a timeout, a
connection that spoke or closed while idle (dropped; the key is due again
at its time), a send that failed (the same). A changed or removed key
leaves the lane at once.

Counters (started, late, finished, the durations of its successes) are
kept in C and taken into the scheduler's at the end of each tick, so the
metrics show the same totals with or without the lane.

Without the C speedups (``make pure``, HEALTHGATE_PURE_PYTHON=1) there is
no lane, and every check takes the Python path; the tests run both.
"""

from __future__ import annotations

from healthgate import http_scan
from healthgate.probes.prober import ProbeSettings
from healthgate.probes.spec import ProbeSpec

# (None without the C speedups: then there is no lane)
KeptLane = getattr(http_scan.speedups, "KeptLane", None)


def laneable(spec: ProbeSpec, settings: ProbeSettings) -> bool:
    """Can a check of ``spec`` be in the lane (see the module doc)?"""
    if spec.type == "TCP":
        return (
            not spec.preamble
            and not spec.invert
            and not (spec.plain_tcp and settings.tcp_half_open)
            and settings.source is None
        )
    return (
        spec.type == "HTTP"
        and (settings.keepalive or (not spec.preamble and settings.source is None))
        and not spec.invert
        and not spec.degraded_ranges
        and spec.method != "HEAD"
        and len(spec.status_ranges) == 1
    )
