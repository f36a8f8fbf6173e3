"""How ``make test`` runs the suite: in two parts.

1. ``-n 2`` (pytest-xdist): everything but the families below, on two
   workers - most tests wait on real clocks (probes every second,
   thresholds), not on a core.
2. Alone on the machine, one test at a time: ``-m "cluster or partitions
   or serial"`` - the cluster (three etcd members and several nodes a test,
   whose leases two such tests at once would starve on two cores), the
   partitions (every scenario builds the same network namespaces and
   addresses, 198.18.0.0/24), and the tests marked ``serial`` that time
   what they measure closely (a ramp's line, an idle session's age, a
   large apply beside live traffic).

Run with ``-n`` some other way, the same families stay on one worker each
(``--dist loadgroup``). Everything else binds ports the kernel chose and
files under its own tmp_path, so any two may run side by side."""

from __future__ import annotations

import pytest

SERIAL_FAMILIES = ("partitions", "cluster", "serial")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for family in SERIAL_FAMILIES:
            if item.get_closest_marker(family) is not None:
                item.add_marker(pytest.mark.xdist_group(family))
                break
