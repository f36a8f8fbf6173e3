"""The leader deletes the saved states of resources that left the world
while no node led (cluster/sweeper.py's StateSweeper): a state of an
engine resource absent at two looks in a row and still absent as the delete
is queued; never one whose resource is back, never another kind's, never
by a node that does not lead."""

from __future__ import annotations

from collections.abc import Sequence

from healthgate.cluster.sweeper import StateSweeper
from tests.helpers import run_async

EP = "projects/p/regions/r/backendServices/b/endpoints/10.0.0.{}:80"
STORED = [
    *(f"endpoint/{EP.format(i)}" for i in range(30)),
    "node/projects/p/regions/r/networkEndpointGroups/neg-gone",
    "node/projects/p/regions/r/networkEndpointGroups/neg",
    "route/projects/c/global/forwardingRules/gone",
    "ramp/projects/c/global/forwardingRules/gone",
    "webhook/projects/p/global/webhooks/gone",  # (not the engine's)
]


class World:
    def __init__(self) -> None:
        self.paths = {EP.format(i) for i in range(10)} | {
            "projects/p/regions/r/networkEndpointGroups/neg"
        }
        self.deleted: list[str] = []
        self.leading = True

    def sweeper(self) -> StateSweeper:
        def delete(keys: Sequence[str]) -> None:
            self.deleted += keys

        return StateSweeper(
            lambda: STORED, self.paths.__contains__, delete, lambda: self.leading, every=1
        )


def gone(world: World) -> set[str]:
    return {
        k for k in STORED
        if not k.startswith("webhook/") and k.partition("/")[2] not in world.paths
    }  # fmt: skip


def test_states_of_resources_gone_are_deleted_at_the_second_look() -> None:
    world = World()
    sweeper = world.sweeper()
    assert run_async(sweeper.sweep()) == 0  # first look: suspects only
    world.paths.add(EP.format(12))  # back between the looks: kept
    assert run_async(sweeper.sweep()) == len(gone(world))
    assert set(world.deleted) == gone(world) and len(world.deleted) == len(set(world.deleted))
    assert f"endpoint/{EP.format(12)}" not in world.deleted
    assert sweeper.swept == len(gone(world))


def test_a_resource_back_during_a_look_keeps_its_state() -> None:
    """What the look found gone and came back before the delete is queued
    (the look goes in steps: the loop turns between them) is judged again."""
    world = World()
    back = EP.format(15)
    second = [False]

    def knows(path: str) -> bool:
        present = path in world.paths
        if path == back and second[0] and not present:
            world.paths.add(back)  # back right after the look found it gone
        return present

    def delete(keys: Sequence[str]) -> None:
        world.deleted += keys

    sweeper = StateSweeper(lambda: STORED, knows, delete, lambda: True, every=1)
    run_async(sweeper.sweep())
    second[0] = True
    run_async(sweeper.sweep())
    assert f"endpoint/{back}" not in world.deleted
    assert set(world.deleted) == gone(world)


def test_a_node_that_does_not_lead_deletes_nothing_and_forgets() -> None:
    world = World()
    sweeper = world.sweeper()
    run_async(sweeper.sweep())
    world.leading = False
    assert run_async(sweeper.sweep()) == 0
    world.leading = True
    assert run_async(sweeper.sweep()) == 0  # a first look again
    assert world.deleted == []
    assert run_async(sweeper.sweep()) == len(gone(world))
