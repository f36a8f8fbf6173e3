"""The plan by the change (model/plan.py's plan_change, over model/index.py)
answers as the plan over the whole world does: every cross-resource rule of
tests/unit/test_validation.py, applied to the example world as a change,
is refused by both with the same fields named, and valid changes are
accepted by both with the same create / update / unchanged."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from healthgate.model.index import WorldIndex
from healthgate.model.plan import plan_apply, plan_change, plan_delete, plan_delete_change
from healthgate.model.validation import Document, InvalidResources
from tests.helpers import documents, example_dicts, find, resources
from tests.unit.test_validation import RULES


def world_of() -> tuple[dict[Any, Any], WorldIndex]:
    world = {r.path: r for r in resources(example_dicts())}
    return world, WorldIndex.of(world.values())


def as_change(dicts: list[dict[str, Any]]) -> list[Document] | None:
    """The documents of a mutated example that differ from the example."""
    base = {(d["kind"], d["name"], d.get("region"), d["project"]): d for d in example_dicts()}
    try:
        docs = documents(dicts)
    except InvalidResources:
        return None  # (refused before any plan: one document's own validation)
    out = []
    for doc, d in zip(docs, dicts, strict=True):
        key = (d["kind"], d["name"], d.get("region"), d["project"])
        if base.get(key) != d:
            out.append(doc)
    return out


def fields(issues: list[Any]) -> set[tuple[str, str]]:
    return {(str(i.name or ""), i.field) for i in issues}


def _mutated(mutate: Any) -> list[Document] | None:
    dicts = example_dicts()
    mutate(dicts)
    return as_change(dicts)


# the rules a plan checks: the others refuse a document by its own
# validation, before any plan (a name's syntax, a range)
CROSS = [r for r in RULES if _mutated(r[1])]


@pytest.mark.parametrize(("rule", "mutate", "field", "words"), CROSS, ids=[r[0] for r in CROSS])
def test_every_rule_refuses_the_same_change(rule: str, mutate: Any, field: str, words: str) -> None:
    change = _mutated(mutate)
    assert change
    world, index = world_of()
    whole = plan_apply(world, change)
    by_change = plan_change(world, index, change)
    assert bool(whole.issues) == bool(by_change.issues), (rule, whole.issues, by_change.issues)
    assert {f for _, f in fields(whole.issues)} == {f for _, f in fields(by_change.issues)}, rule
    assert (whole.create, sorted(whole.update)) == (by_change.create, sorted(by_change.update))


def dial(d: list[dict[str, Any]]) -> None:
    find(d, "BackendService", "shop")["backends"][0]["trafficDial"] = 60


def more_endpoints(d: list[dict[str, Any]]) -> None:
    neg = find(d, "NetworkEndpointGroup", "web-neg", "us-east1")
    neg["endpoints"].append({"ipAddress": "127.0.1.9", "port": 8080})


def new_rule_elsewhere(d: list[dict[str, Any]]) -> None:
    rule = copy.deepcopy(find(d, "ForwardingRule", "web-fr", "us-east1"))
    rule.update(name="web-fr-2", IPAddress="127.0.1.201")
    d.append(rule)


def new_rule_on_a_taken_address(d: list[dict[str, Any]]) -> None:
    rule = copy.deepcopy(find(d, "ForwardingRule", "web-fr", "us-east1"))
    rule.update(name="web-fr-2")  # (the same address and port as web-fr)
    d.append(rule)


def new_rule_on_a_wildcard(d: list[dict[str, Any]]) -> None:
    rule = copy.deepcopy(find(d, "ForwardingRule", "web-fr", "us-east1"))
    rule.update(name="web-fr-any", IPAddress="0.0.0.0")
    d.append(rule)


def taken_dns_name(d: list[dict[str, Any]]) -> None:
    front = find(d, "ForwardingRule", "shop-frontend")
    front["dnsName"] = "shop.example.com"
    other = copy.deepcopy(front)
    other.update(name="shop-frontend-2", IPAddress="127.0.9.9", dnsName="shop.example.com")
    d.append(other)


def second_destination(d: list[dict[str, Any]]) -> None:
    comp = copy.deepcopy(find(d, "CompositeHealthCheck", "web-composite", "us-east1"))
    comp["name"] = "web-composite-2"
    d.append(comp)


CHANGES = [dial, more_endpoints, new_rule_elsewhere, new_rule_on_a_taken_address,
           new_rule_on_a_wildcard, taken_dns_name, second_destination]  # fmt: skip


@pytest.mark.parametrize("mutate", CHANGES, ids=[m.__name__ for m in CHANGES])
def test_changes_are_planned_alike(mutate: Any) -> None:
    dicts = example_dicts()
    mutate(dicts)
    change = as_change(dicts)
    assert change
    world, index = world_of()
    whole = plan_apply(world, change)
    by_change = plan_change(world, index, change)
    assert bool(whole.issues) == bool(by_change.issues), (whole.issues, by_change.issues)
    assert {i.field for i in whole.issues} == {i.field for i in by_change.issues}
    assert (whole.create, sorted(whole.update)) == (by_change.create, sorted(by_change.update))
    assert len(whole.warnings) == len(by_change.warnings)
    for path in (*by_change.create, *by_change.update):
        assert by_change.result[path] == whole.result[path]


def test_deletes_are_planned_alike() -> None:
    world, index = world_of()
    for path in world:
        whole, by_change = plan_delete(world, [path]), plan_delete_change(world, index, [path])
        assert sorted(map(str, whole.in_use)) == sorted(map(str, by_change.in_use)), path
    some = sorted(world)[:5]
    whole, by_change = plan_delete(world, some), plan_delete_change(world, index, some)
    assert sorted(map(str, whole.issues)) == sorted(map(str, by_change.issues))
    assert whole.delete == by_change.delete


def test_the_index_follows_puts_and_deletes() -> None:
    world, index = world_of()
    again = WorldIndex()
    for res in world.values():
        again.put(res)
        again.put(res)  # (a put over itself changes nothing)
    extra = next(iter(world.values()))
    again.delete(extra.path)
    again.put(extra)
    for name in ("referrers", "listening", "dns_names", "destinations", "published", "ports"):
        assert getattr(again, name) == getattr(index, name), name
    for path in list(world):
        index.delete(path)
    assert not index.referrers and not index.listening and not index.ports
