"""Resource names, full paths and reference resolution.

Every resource lives in a project and is either regional or global, and its
full name is a path::

    projects/{project}/regions/{region}/{collection}/{name}
    projects/{project}/global/{collection}/{name}

A reference from one resource to another may be that full path or a partial
one (``backendServices/web``, ``regions/us-east1/backendServices/web``,
``global/backendServices/shop``) or, since the field already says which
collection it means, a bare name (``web``). Partial references are resolved
against the *referring* resource's project and region (or ``global`` when the
referrer is global).
"""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass, field
from typing import Final

GLOBAL: Final = "global"

NAME_RE: Final = re.compile(r"[a-z](?:[a-z0-9-]{0,61}[a-z0-9])?")  # (fullmatch: "a\n" is no name)
NAME_RULE: Final = (
    "1-63 characters, lowercase letters, digits and '-', "
    "starting with a letter and not ending with '-'"
)

# kind (manifest) <-> collection (path segment)
KIND_TO_COLLECTION: Final[dict[str, str]] = {
    "HealthCheck": "healthChecks",
    "NetworkEndpointGroup": "networkEndpointGroups",
    "InstanceGroup": "instanceGroups",
    "BackendService": "backendServices",
    "HealthAggregationPolicy": "healthAggregationPolicies",
    "HealthSource": "healthSources",
    "CompositeHealthCheck": "compositeHealthChecks",
    "ForwardingRule": "forwardingRules",
    "ServiceAttachment": "serviceAttachments",
    "Shift": "shifts",  # (written through /v1/projects/P/shifts only: SPEC §6)
    "Webhook": "webhooks",
    "Secret": "secrets",
    # (written through POST .../backendServices/B/endpoints:report only: SPEC §10)
    "EndpointReport": "endpointReports",
    "PracticeRun": "practiceRuns",  # SPEC §11
}
COLLECTION_TO_KIND: Final[dict[str, str]] = {c: k for k, c in KIND_TO_COLLECTION.items()}


def endpoint_name(ip: str, port: int | None) -> str:
    """``ip:port``, ``[v6]:port`` or the bare address; see :func:`parse_endpoint_name`."""
    if port is None:
        return ip
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def parse_endpoint_name(name: str) -> tuple[str, int | None]:
    if name.startswith("["):
        ip, _, port = name[1:].partition("]:")
        return ip, int(port)
    if name.count(":") == 1:
        ip, _, port = name.partition(":")
        return ip, int(port)
    return name, None


ENDPOINTS: Final = "/endpoints/"


def endpoint_path(backend_service: ResourcePath | str, ip: str, port: int | None) -> str:
    """An endpoint's path: ``<backend service path>/endpoints/<ip:port>`` - the
    name of an endpoint everywhere (the log, saved states, opinions, workers)."""
    return f"{backend_service}{ENDPOINTS}{endpoint_name(ip, port)}"


def split_endpoint_path(path: str) -> tuple[str, str]:
    """(backend service path, endpoint name) of an endpoint path ('' if it is not one)."""
    bs, sep, name = path.rpartition(ENDPOINTS)
    return (bs, name) if sep else ("", "")


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel = 3
_BRIEF.maxstring = _BRIEF.maxother = 200
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxdict = _BRIEF.maxset = 8


def brief(value: object, limit: int = 80) -> str:
    """The repr of a rejected value, cut short: error messages never echo a
    whole input (a manifest field may be megabytes, or an alias bomb). The
    repr itself is bounded as it is built (reprlib: a few levels, a few
    items of each), so a value that expands to millions of nodes costs
    microseconds, not the minutes its whole repr took."""
    if isinstance(value, str):
        text = repr(value[: limit + 1])
        size = len(value)
    else:
        text = _BRIEF.repr(value)
        size = len(text)
    if len(text) <= limit and size <= limit:
        return text
    return (
        f"{text[:limit]}... ({size} characters)" if isinstance(value, str) else f"{text[:limit]}..."
    )


def is_valid_name(name: str) -> bool:
    return bool(NAME_RE.fullmatch(name))


class ReferenceError_(ValueError):
    """A reference string that cannot be parsed or points at the wrong collection."""


@dataclass(frozen=True, slots=True, order=True)
class ResourcePath:
    """The full name of one resource. ``region`` is ``"global"`` for global ones."""

    project: str
    region: str
    collection: str
    name: str
    # the text form, computed once: paths are dictionary keys on hot paths
    text: str = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.region == GLOBAL:
            text = f"projects/{self.project}/global/{self.collection}/{self.name}"
        else:
            text = f"projects/{self.project}/regions/{self.region}/{self.collection}/{self.name}"
        object.__setattr__(self, "text", text)

    @property
    def is_global(self) -> bool:
        return self.region == GLOBAL

    @property
    def kind(self) -> str:
        return COLLECTION_TO_KIND[self.collection]

    def __str__(self) -> str:
        return self.text

    @property
    def short(self) -> str:
        """``project/region/name`` - compact, for tables and reasons."""
        return f"{self.project}/{self.region}/{self.name}"

    @classmethod
    def parse(cls, text: str) -> ResourcePath:
        """Parse a *full* path; raises ReferenceError_ for anything else."""
        parts = text.strip("/").split("/")
        if len(parts) == 6 and parts[0] == "projects" and parts[2] == "regions":
            path = cls(parts[1], parts[3], parts[4], parts[5])
        elif len(parts) == 5 and parts[0] == "projects" and parts[2] == GLOBAL:
            path = cls(parts[1], GLOBAL, parts[3], parts[4])
        else:
            raise ReferenceError_(
                f"{text!r} is not a full resource path "
                "(projects/P/regions/R/COLLECTION/NAME or projects/P/global/COLLECTION/NAME)"
            )
        path.check()
        return path

    def check(self) -> None:
        if self.collection not in COLLECTION_TO_KIND:
            raise ReferenceError_(f"unknown collection {self.collection!r}")
        for label, value in (("project", self.project), ("name", self.name)):
            if not is_valid_name(value):
                raise ReferenceError_(f"{label} {value!r} is not a valid name ({NAME_RULE})")
        if not self.is_global and not is_valid_name(self.region):
            raise ReferenceError_(f"region {self.region!r} is not a valid name ({NAME_RULE})")


def resolve_reference(ref: str, referrer: ResourcePath, collection: str) -> ResourcePath:
    """Resolve ``ref`` (full, partial or bare) from ``referrer`` into a full path.

    ``collection`` is what the field expects; a reference that names another
    collection raises ReferenceError_ saying so.
    """
    text = ref.strip()
    if not text:
        raise ReferenceError_("empty reference")
    parts = text.strip("/").split("/")
    if parts[0] == "projects":
        path = ResourcePath.parse(text)
    elif len(parts) == 4 and parts[0] == "regions":
        path = ResourcePath(referrer.project, parts[1], parts[2], parts[3])
    elif len(parts) == 3 and parts[0] == GLOBAL:
        path = ResourcePath(referrer.project, GLOBAL, parts[1], parts[2])
    elif len(parts) == 2:
        path = ResourcePath(referrer.project, referrer.region, parts[0], parts[1])
    elif len(parts) == 1:
        path = ResourcePath(referrer.project, referrer.region, collection, parts[0])
    else:
        raise ReferenceError_(f"cannot parse reference {ref!r}")
    path.check()
    if path.collection != collection:
        raise ReferenceError_(
            f"reference {ref!r} points at {path.collection}, expected {collection}"
        )
    return path
