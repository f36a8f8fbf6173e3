"""What a failed try of an HTTP request leads to: a pure decision.

The L7 front end tries a request at the first region's endpoints, then the
next region's, in failover order. After a try fails, what may be done next
depends only on what happened:

=============  ==========  ==========  ==================================
request        sent?       timed out?  next
=============  ==========  ==========  ==================================
idempotent     either      no          the next endpoint (same region)
idempotent     either      yes         the next region: a region that
                                       hangs is not waited on endpoint by
                                       endpoint
not idempotent no          no          the next endpoint: nothing reached
                                       an upstream, so nothing can repeat
not idempotent no          yes         the next region
not idempotent yes         either      give up (502): the upstream may
                                       have acted on it; never send twice
=============  ==========  ==========  ==================================

"Sent" means any byte of the request may have reached the upstream: a
failed connect is not sent; a timeout or reset after writing is.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from healthgate import http_scan


class NextTry(Enum):
    NEXT_ENDPOINT = "next endpoint"
    NEXT_REGION = "next region"
    GIVE_UP = "give up"


def next_try(idempotent: bool, sent: bool, timed_out: bool) -> NextTry:
    if sent and not idempotent:
        return NextTry.GIVE_UP
    if timed_out:
        return NextTry.NEXT_REGION
    return NextTry.NEXT_ENDPOINT


class PyGauge:
    """Requests in flight on one listener (``_speedups.Gauge`` in C, which
    the fast path counts its exchanges in)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


if http_scan.speedups is not None and hasattr(http_scan.speedups, "Gauge"):
    Gauge: type[PyGauge] = http_scan.speedups.Gauge
else:
    Gauge = PyGauge

Limits = Callable[[], "tuple[float, int] | None"]  # (percent, minConcurrent), None: unbounded


class RetryBudget:
    """A consumer front end's retry budget in this process (SPEC §8,
    ``failoverPolicy.retryBudget``): retries into another region in flight
    never exceed max(minConcurrent, percent x requests in flight); a request
    past it gets its own error, counted. ``limits`` reads the front end's
    backend service as it is now (None: no budget, every retry may go)."""

    __slots__ = ("exhausted", "limits", "requests", "retries")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.requests = Gauge()  # requests in flight (fast and general path)
        self.retries = 0  # of them, retrying in another region now
        self.exhausted = 0

    def admit(self) -> str | None:
        """One more retry into another region: None when it may go (then
        :meth:`done` when it is over), else why not."""
        limits = self.limits()
        if limits is not None:
            percent, least = limits
            allowed = max(least, percent * self.requests.n / 100)
            if self.retries + 1 > allowed:
                self.exhausted += 1
                return (
                    f"retry budget exhausted: {self.retries} retries into other regions in "
                    f"flight of {self.requests.n} requests (retryBudget {percent:g} %, "
                    f"minConcurrent {least})"
                )
        self.retries += 1
        return None

    def done(self) -> None:
        self.retries -= 1
