"""What a newly elected leader writes once so that the stored states are
whole after a gap between two leaders (controlplane/saved_states.py's
``engine_states``): every source, composite and NEG under its own path,
every route; read back, they are the engine's states."""

from __future__ import annotations

from healthgate.controlplane.saved_states import decode_states, engine_states
from healthgate.health.engine import HealthEngine
from healthgate.health.states import HealthState
from tests.helpers import OK, REFUSED, example_world, feed, resources

US = "127.0.1."  # the example's us-east1 endpoints; europe-west1's are 127.0.2.x


def test_a_new_leaders_states_hold_every_node_by_its_path_and_every_route() -> None:
    engine = HealthEngine()
    engine.apply(resources(example_world()), 0.0)
    feed(engine, 1.0, OK, times=3)
    feed(engine, 10.0, REFUSED, US, times=3)  # us-east1 fails over
    held = {status.path: status for _kind, status in engine.node_states()}
    assert len(held) > 3 and any(s.state is HealthState.UNHEALTHY for s in held.values())

    _, nodes, routes, _ = decode_states(engine_states(engine))

    assert nodes == {p: (s.state, s.reason, s.since) for p, s in held.items()}
    table = engine.route_table().routes
    assert set(routes) == set(table)
    for frontend, route in routes.items():
        assert (route.target, route.mode) == (table[frontend].target, table[frontend].mode)
