"""Detection-window arithmetic (SPEC §2.1, seed 003).

The interval runs from the end of one probe to the start of the next, so
``threshold`` failing probes that each run into the timeout take

    failure window = timeoutSec × threshold + checkIntervalSec × (threshold − 1)

from the start of the first failing probe to the UNHEALTHY verdict
(timeout 3, interval 2, threshold 3 -> 13 s), and ``threshold`` passing probes
that each answer in ``responseTime`` take

    success window = responseTime × threshold + checkIntervalSec × (threshold − 1)

(response 1 s, interval 2, threshold 3 -> 7 s). A failure that is immediate
(a refused connection) has responseTime ≈ 0 in place of the timeout.
"""

from __future__ import annotations


def failure_window(timeout: float, interval: float, threshold: int) -> float:
    return timeout * threshold + interval * (threshold - 1)


def success_window(response_time: float, interval: float, threshold: int) -> float:
    return response_time * threshold + interval * (threshold - 1)


def worst_case_failure_detection(timeout: float, interval: float, threshold: int) -> float:
    """From the moment an endpoint breaks to UNHEALTHY, at worst: the break may
    land just after a passing probe ended, so one interval passes before the
    first failing probe starts."""
    return failure_window(timeout, interval, threshold) + interval
