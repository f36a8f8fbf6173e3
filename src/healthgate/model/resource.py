"""The base of every resource kind: wire models, full names, references,
and the patterns the kinds' fields are checked against.

* :class:`Model` - frozen pydantic models with camelCase wire names and no
  unknown fields;
* :class:`Resource` - kind, name, project, region (and so its full path),
  and its references, declared per kind in a ``REFS`` table and resolved
  once against the resource's own path (:class:`Reference`), so that
  validation, the engine and the in-use check walk them the same way.

The kinds themselves are in model/resources.py.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, ClassVar, Self

import pydantic.dataclasses
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from healthgate.model.names import (
    GLOBAL,
    KIND_TO_COLLECTION,
    NAME_RULE,
    ReferenceError_,
    ResourcePath,
    brief,
    is_valid_name,
    resolve_reference,
)

# The requestPath alphabet of SPEC §1: letters, digits and - / . % ? # & _ ; ~ ! ( ) * [ ] @ $ ^ : ' , +
# Every pattern is used with fullmatch: the whole value, a trailing newline
# included ("/h\n" with ``$`` and ``match`` passed, and went into a probe).
REQUEST_PATH_RE = re.compile(r"/[A-Za-z0-9\-/.%?#&_;~!()*\[\]@$^:',+]{0,79}")
HOST_RE = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-.]*[A-Za-z0-9])?")
STATUS_RE = re.compile(r"([1-5][0-9][0-9])(?:-([1-5][0-9][0-9]))?")
DNS_LABEL_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
PORT_RANGE_RE = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?")

Port = Annotated[int, Field(ge=1, le=65535)]


WIRE_CONFIG = ConfigDict(
    extra="forbid",
    frozen=True,
    populate_by_name=True,
    alias_generator=to_camel,
    # no silent trimming: " /healthz" is an error (a space is not in the
    # requestPath alphabet), not "/healthz"
    str_strip_whitespace=False,
)

# the small wire objects a resource holds many of (a NEG's endpoints): the
# same rules as a Model, as slotted frozen dataclasses (a tenth of the memory)
wire_dataclass = pydantic.dataclasses.dataclass(
    frozen=True,
    slots=True,
    config=ConfigDict(**{k: v for k, v in WIRE_CONFIG.items() if k != "frozen"}),  # type: ignore[typeddict-item]
)


class Model(BaseModel):
    """Base of every wire object: camelCase aliases, no unknown fields, frozen."""

    model_config = WIRE_CONFIG

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


_DOTTED = re.compile(
    r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
)


def normalise_ip(value: str) -> str:
    """An address in its one spelling: IPv6 compressed and lower-case, an
    IPv4-mapped IPv6 address (``::ffff:127.0.0.1``, which a dual-stack
    socket connects to - or listens on - as the IPv4 address) as that IPv4
    address, so that every check made on the text sees what the kernel
    will use (model/addresses.py checks the other embedded forms)."""
    # an IPv4 address written the canonical way (no leading zeros) is its own
    # normal form: one regular expression instead of ipaddress (3x faster,
    # a million endpoints in a manifest)
    if _DOTTED.fullmatch(value):
        return value
    try:
        addr = ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"expected an IPv4 or IPv6 address, got {brief(value)}") from None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


@dataclass(frozen=True, slots=True)
class Reference:
    """One resolved reference: where it is written (field) and what it names."""

    attr: str
    field: str
    raw: str
    target: ResourcePath | None
    error: str | None = None


class Resource(Model):
    kind: str
    name: str
    project: str
    region: str = GLOBAL
    description: str = Field("", max_length=2048)

    # "regional", "global" or both
    SCOPES: ClassVar[frozenset[str]] = frozenset({"regional"})
    # (python attribute, wire field, target collection); attribute may name a
    # str, a list of str, or (for "backends") the list of Backend objects.
    REFS: ClassVar[tuple[tuple[str, str, str], ...]] = ()
    # wire fields that are written but never read back (a webhook's secret):
    # the store keeps them, answers and Change records do not show them
    SECRET_FIELDS: ClassVar[frozenset[str]] = frozenset()

    @field_validator("name", "project")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not is_valid_name(value):
            raise ValueError(f"expected {NAME_RULE}, got {brief(value)}")
        return value

    @field_validator("region")
    @classmethod
    def _check_region(cls, value: str) -> str:
        if value != GLOBAL and not is_valid_name(value):
            raise ValueError(
                f"expected 'global' or a region name ({NAME_RULE}), got {brief(value)}"
            )
        return value

    @model_validator(mode="after")
    def _check_scope(self) -> Self:
        scope = "global" if self.region == GLOBAL else "regional"
        if scope not in self.SCOPES:
            want = " or ".join(sorted(self.SCOPES))
            raise ValueError(f"region: a {self.kind} must be {want}; got {self.region!r}")
        return self

    def to_public(self) -> dict[str, Any]:
        """The wire document without its secret fields (what anyone reads back)."""
        out = self.to_wire()
        for name in self.SECRET_FIELDS:
            if out.pop(name, None) is not None:
                out[name + "Set"] = True
        return out

    @cached_property
    def path(self) -> ResourcePath:
        return ResourcePath(self.project, self.region, KIND_TO_COLLECTION[self.kind], self.name)

    @property
    def is_global(self) -> bool:
        return self.region == GLOBAL

    def references(self) -> Iterator[Reference]:
        """Every reference this resource makes, resolved against its own path."""
        return iter(self.resolved_references)

    @cached_property
    def resolved_references(self) -> tuple[Reference, ...]:
        # resources are frozen, so their references are resolved once
        return tuple(self._resolve_references())

    @cached_property
    def reference_targets(self) -> dict[str, list[ResourcePath]]:
        """attribute -> resolved targets (unresolvable ones left out)."""
        out: dict[str, list[ResourcePath]] = {attr: [] for attr, _, _ in self.REFS}
        for ref in self.resolved_references:
            if ref.target is not None:
                out[ref.attr].append(ref.target)
        return out

    def _resolve_references(self) -> Iterator[Reference]:
        me = self.path
        for attr, wire, collection in self.REFS:
            value = getattr(self, attr)
            items: list[tuple[str, str]]
            if value is None:
                continue
            if isinstance(value, str):
                items = [(wire, value)]
            elif attr == "backends":
                items = [(f"backends[{i}].group", b.group) for i, b in enumerate(value)]
            elif attr.endswith("_refs"):  # nested references: (field, reference) pairs
                items = value
            else:
                items = [(f"{wire}[{i}]", v) for i, v in enumerate(value)]
            for field, raw in items:
                try:
                    yield Reference(attr, field, raw, resolve_reference(raw, me, collection))
                except ReferenceError_ as exc:
                    yield Reference(attr, field, raw, None, str(exc))

    def ref(self, attr: str) -> ResourcePath | None:
        """The resolved target of a single-valued reference field (or the first
        of a list, as for a health source's one backend service), or None."""
        targets = self.reference_targets[attr]
        return targets[0] if targets else None

    def refs(self, attr: str) -> list[ResourcePath]:
        """The resolved targets of a list-valued reference field (unresolvable ones skipped)."""
        return self.reference_targets[attr]
