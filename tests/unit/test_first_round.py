"""When serve freezes the heap a second time: after the first probes have
decided every endpoint (see Server.start)."""

from __future__ import annotations

from typing import Any

import pytest

from healthgate.runtime.server import first_round_seconds
from tests.helpers import resources


def check(name: str, **fields: Any) -> dict[str, Any]:
    return {
        "kind": "HealthCheck",
        "project": "p",
        "region": "r",
        "name": name,
        "type": "TCP",
        **fields,
    }


@pytest.mark.parametrize(
    ("checks", "seconds"),
    [
        ([], 1.0),  # nothing to probe: at once
        ([check("a")], 2 * 4 + 3 + 1),  # the defaults: interval 2, thresholds 3, timeout 3
        ([check("a", checkIntervalSec=1, timeoutSec=1)], 1 * 4 + 1 + 1),
        ([check("a", checkIntervalSec=1, timeoutSec=1, unhealthyThreshold=5)], 1 * 6 + 1 + 1),
        ([check("a"), check("b", checkIntervalSec=5)], 5 * 4 + 3 + 1),  # the longest
        ([check("a", checkIntervalSec=50, timeoutSec=300, healthyThreshold=10)], 120.0),  # capped
    ],
)
def test_first_round_seconds(checks: list[dict[str, Any]], seconds: float) -> None:
    assert first_round_seconds(resources(checks)) == pytest.approx(seconds)
