"""The per-endpoint series of /metrics, written as text for speed, must still
be valid Prometheus exposition and say what the engine says."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from healthgate.api.metrics import endpoint_series, endpoint_series_parts
from healthgate.controlplane.health_service import HealthService
from healthgate.health.engine import ProbeTarget
from healthgate.health.states import Outcome, ProbeResult
from tests.helpers import example_world, resources


def test_endpoint_series_parse_and_follow_the_last_probe() -> None:
    health = HealthService()
    result = health.engine.apply(resources(example_world()), 0.0)
    targets = list(result.added)
    assert len(targets) >= 2
    assert "endpoint_probe_success{" not in endpoint_series(health)  # nothing probed yet
    ok, failed = targets[0], targets[1]
    health.engine.on_result(1.0, ok.slot, ProbeResult(Outcome.OK, 0.01, 200))
    health.engine.on_result(1.0, failed.slot, ProbeResult(Outcome.REFUSED, 0.01))

    families = list(text_string_to_metric_families(endpoint_series(health)))
    assert [f.name for f in families] == ["healthgate_endpoint_probe_success"]
    got = {
        (s.labels["backend_service"], s.labels["endpoint"]): s.value for s in families[0].samples
    }

    def label(t: ProbeTarget) -> tuple[str, str]:
        return str(t.backend_service), f"{t.ip}:{t.port}" if t.port else t.ip

    assert got == {label(ok): 1.0, label(failed): 0.0}


def test_endpoint_series_in_parts_are_the_whole_text() -> None:
    """/metrics streams the series in parts (the event loop runs between
    them): cut anywhere, they add up to the same text."""
    health = HealthService()
    for target in health.engine.apply(resources(example_world()), 0.0).added:
        health.engine.on_result(1.0, target.slot, ProbeResult(Outcome.OK, 0.01, 200))
    whole = endpoint_series(health)
    assert whole.count("endpoint_probe_success{") >= 2
    for per_part in (1, 2, 1000):
        parts = list(endpoint_series_parts(health, per_part))
        assert "".join(parts) == whole
        assert all(p.endswith("\n") for p in parts)
