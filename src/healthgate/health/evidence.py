"""Real traffic as evidence (SPEC §8): what the data plane saw of one
upstream over a period, as a plain value.

The data plane counts every hop of healthgate's own listeners per upstream
address (dataplane/counters.py) and, once a second, hands the health side
what each upstream's hops came to since the last second: a :class:`Hops`.
The outlier detector (health/outliers.py), traffic health sources
(health/traffic.py) and the ramped failbacks' error gate read these, and
nothing else of the data plane.

What an error is (SPEC §8): an HTTP answer 500-599, a per-try timeout, a
connection refused or reset before an answer (L7); a refused connect or a
reset before the upstream's first byte (L4); an ICMP error on a UDP
session's socket. A *gateway error* is 502, 503, 504 or a connection that
could not be made. Everything else - 4xx included - is a success.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Address = tuple[str, int]

GATEWAY_STATUSES = frozenset({502, 503, 504})
# error kinds besides a status: what a person reads in a reason
TIMEOUT = "timeout"  # no answer within the per-try timeout
RESET = "reset"  # the connection was reset or closed before an answer
REFUSED = "refused"  # no connection could be made (a gateway error)
CONNECT_TIMEOUT = "connect-timeout"  # ... within the connect timeout (a gateway error)
UNREACHABLE = "unreachable"  # an ICMP error on a UDP session (a gateway error)


@dataclass(frozen=True, slots=True)
class Hops:
    """One upstream's hops over a period (usually a second).

    ``peak`` is the longest run of consecutive errors within the period -
    counting the run carried into it from before - and ``peak_kinds`` the
    kinds of its first errors (at most ten): the evidence of a
    consecutive-errors ejection. ``peak_gateway`` likewise for gateway errors.
    """

    served: int = 0
    errors: int = 0
    gateway: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    peak: int = 0
    peak_gateway: int = 0
    peak_kinds: tuple[str, ...] = ()
    # answered hops per latency bucket (dataplane/counters.py's LATENCY_BOUNDS; () - none)
    latency: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return self.served + self.errors

    def plus(self, other: Hops) -> Hops:
        """Two listeners' (or processes') hops of one upstream, together:
        counts add up, a run is one listener's (the longest is kept)."""
        kinds = dict(self.kinds)
        for k, n in other.kinds.items():
            kinds[k] = kinds.get(k, 0) + n
        longest = self if self.peak >= other.peak else other
        latency = self.latency or other.latency
        if self.latency and other.latency:
            latency = tuple(a + b for a, b in zip(self.latency, other.latency, strict=True))
        return Hops(
            self.served + other.served,
            self.errors + other.errors,
            self.gateway + other.gateway,
            kinds,
            max(self.peak, other.peak),
            max(self.peak_gateway, other.peak_gateway),
            longest.peak_kinds,
            latency,
        )


def merge(parts: Iterable[Mapping[Address, Hops]]) -> dict[Address, Hops]:
    """Per upstream, the hops of several listeners or processes together."""
    out: dict[Address, Hops] = {}
    for part in parts:
        for address, hops in part.items():
            before = out.get(address)
            out[address] = hops if before is None else before.plus(hops)
    return out


def kinds_text(kinds: Mapping[str, int], most: int = 4) -> str:
    """ "500 ×39, reset ×3": the commonest kinds first."""
    ranked = sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{k} ×{n}" for k, n in ranked[:most])
    if len(ranked) > most:
        text += f", {len(ranked) - most} more kinds"
    return text
