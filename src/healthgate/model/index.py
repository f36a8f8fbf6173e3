"""What a plan needs to know of the world without passing over it: who
references whom, which rules listen where, which composite is whose
destination, which rule has which DNS name, how many ports a project's
rules take.

:class:`WorldIndex` is kept by the mirror beside its resources, one
resource at a time (:meth:`WorldIndex.put`, :meth:`WorldIndex.delete`), so
that :func:`healthgate.model.plan.plan_change` checks a change against the
world in proportion to the change - the same rules as the whole-world
check (model/rules.py), asked only of the documents the change can affect.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from healthgate.model.names import ResourcePath
from healthgate.model.resources import (
    CompositeHealthCheck,
    ForwardingRule,
    Resource,
    ServiceAttachment,
)

ListenKey = tuple[str, str]  # (protocol, address)
K = TypeVar("K")


class WorldIndex:
    def __init__(self) -> None:
        # target -> {referrer -> the fields of the referrer that name it}
        self.referrers: dict[ResourcePath, dict[ResourcePath, tuple[str, ...]]] = {}
        self._refs_of: dict[ResourcePath, tuple[ResourcePath, ...]] = {}
        # forwarding rules by where they listen, and by (protocol, IPv6?) for wildcards
        self.listening: dict[ListenKey, set[ResourcePath]] = {}
        self.by_family: dict[tuple[str, bool], set[ListenKey]] = {}
        self.dns_names: dict[str, set[ResourcePath]] = {}
        self.destinations: dict[ResourcePath, set[ResourcePath]] = {}  # rule -> composites
        self.published: dict[ResourcePath, set[ResourcePath]] = {}  # rule -> attachments
        self.ports: dict[str, int] = {}  # project -> ports its rules listen on
        self._stored: dict[ResourcePath, Resource] = {}  # what each entry was made from

    @classmethod
    def of(cls, resources: Iterable[Resource]) -> WorldIndex:
        index = cls()
        for res in resources:
            index.put(res)
        return index

    def put(self, res: Resource) -> None:
        """``res`` is in the world now (created, or replacing its older self)."""
        path = res.path
        if path in self._stored:
            self.delete(path)
        self._stored[path] = res
        targets: dict[ResourcePath, list[str]] = {}
        for ref in res.references():
            if ref.target is not None:
                targets.setdefault(ref.target, []).append(ref.field)
        for target, fields in targets.items():
            self.referrers.setdefault(target, {})[path] = tuple(fields)
        self._refs_of[path] = tuple(targets)
        if isinstance(res, ForwardingRule):
            key = (res.ip_protocol, res.ip_address)
            self.listening.setdefault(key, set()).add(path)
            self.by_family.setdefault((res.ip_protocol, ":" in res.ip_address), set()).add(key)
            if res.dns_name is not None:
                self.dns_names.setdefault(res.dns_name, set()).add(path)
            self.ports[res.project] = self.ports.get(res.project, 0) + res.port_count()
        elif isinstance(res, CompositeHealthCheck):
            dest = res.ref("health_destination")
            if dest is not None:
                self.destinations.setdefault(dest, set()).add(path)
        elif isinstance(res, ServiceAttachment):
            published = res.ref("target_service")
            if published is not None:
                self.published.setdefault(published, set()).add(path)

    def delete(self, path: ResourcePath) -> None:
        res = self._stored.pop(path, None)
        if res is None:
            return
        for target in self._refs_of.pop(path, ()):
            users = self.referrers.get(target)
            if users is not None:
                users.pop(path, None)
                if not users:
                    del self.referrers[target]
        if isinstance(res, ForwardingRule):
            key = (res.ip_protocol, res.ip_address)
            _discard(self.listening, key, path)
            if key not in self.listening:
                family = (res.ip_protocol, ":" in res.ip_address)
                keys = self.by_family.get(family)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self.by_family[family]
            if res.dns_name is not None:
                _discard(self.dns_names, res.dns_name, path)
            left = self.ports.get(res.project, 0) - res.port_count()
            if left > 0:
                self.ports[res.project] = left
            else:
                self.ports.pop(res.project, None)
        elif isinstance(res, CompositeHealthCheck):
            dest = res.ref("health_destination")
            if dest is not None:
                _discard(self.destinations, dest, path)
        elif isinstance(res, ServiceAttachment):
            published = res.ref("target_service")
            if published is not None:
                _discard(self.published, published, path)

    def take(self, put: Mapping[ResourcePath, Resource], deleted: Iterable[ResourcePath]) -> None:
        """One change (model/change.py)."""
        for path in deleted:
            self.delete(path)
        for res in put.values():
            self.put(res)


def _discard(index: dict[K, set[ResourcePath]], key: K, path: ResourcePath) -> None:
    paths = index.get(key)
    if paths is not None:
        paths.discard(path)
        if not paths:
            del index[key]
