"""One commit as every layer is told it: a change, not a world.

The store's watch delivers each commit once; the control plane parses it
once into the mirror and builds one :class:`WorldChange` - the revision and
time of the commit, the resources it put (created or replaced) and the paths
it deleted - with a read-only view of the whole world after it. The engine,
the probe sources, the data plane and its workers, DNS, xDS and webhooks
each take the change and do work in proportion to it (Envoy's
added/removed-hosts update is the model): nobody passes over every
resource for a one-document change, and the view is the mirror's own
(never copied).

A layer that keeps something derived from a resource looks at
:attr:`WorldChange.changed` (or :meth:`WorldChange.touches`) to know what to
redo; one that caches on the world (the data plane's route choices) keys
the cache on :attr:`WorldChange.revision`, which moves with every change.
``whole`` is set when the change is a new world altogether (the first load,
a reload after the store compacted the history): every layer redoes all of
it, once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from healthgate.model.names import ResourcePath
from healthgate.model.resource import Resource


@dataclass(frozen=True, slots=True)
class WorldChange:
    revision: int  # the store revision of the commit (the world's version)
    time: float  # the commit's stored time (the same on every node)
    world: Mapping[ResourcePath, Resource]  # all of it after the change (read-only)
    put: Mapping[ResourcePath, Resource] = field(default_factory=dict)  # created or replaced
    deleted: frozenset[ResourcePath] = frozenset()
    whole: bool = False  # a new world altogether: redo everything

    @property
    def changed(self) -> frozenset[ResourcePath]:
        """Every path put or deleted."""
        return frozenset(self.put) | self.deleted

    def touches(self, *collections: str) -> bool:
        """Does the change put or delete anything of these collections?"""
        return self.whole or any(p.collection in collections for p in self._paths())

    def _paths(self) -> Iterable[ResourcePath]:
        yield from self.put
        yield from self.deleted

    @classmethod
    def between(
        cls,
        revision: int,
        time: float,
        before: Mapping[ResourcePath, Resource],
        after: Mapping[ResourcePath, Resource],
    ) -> WorldChange:
        """The change from one whole world to another (compared: a reload)."""
        put = {p: r for p, r in after.items() if before.get(p) is not r and before.get(p) != r}
        deleted = frozenset(p for p in before if p not in after)
        return cls(revision, time, after, put, deleted, whole=True)
