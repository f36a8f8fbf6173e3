"""Kind ``Webhook`` (SPEC §6, "Notifications"): where a project's records are POSTed.

A webhook is global, per project::

    kind: Webhook
    name: oncall
    project: shop
    url: https://hooks.example.com/healthgate
    secret: "at least 16 characters"      # written, never read back
    events:                               # optional: default every record
      - {kind: Route}                     #   the project may read
      - {kind: CompositeHealthCheck, state: UNHEALTHY}

The delivery (controlplane/webhooks.py) signs each body with the secret.
The URL's host is an address or a DNS name; an address is checked against
SPEC §7's address policy when the webhook is written (model/addresses.py),
a name when it is resolved, before every connection.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, ClassVar, Literal
from urllib.parse import SplitResult, urlsplit

from pydantic import Field, field_validator

from healthgate.model.names import brief
from healthgate.model.resource import HOST_RE, Model, Resource

MAX_URL = 2048
MAX_FILTERS = 20
RECORD_KINDS = (
    "Endpoint",
    "HealthSource",
    "CompositeHealthCheck",
    "NetworkEndpointGroup",
    "Route",
    "Change",
    "Ramp",
    "Ejection",
    "Hold",
    "PracticeRun",
    "Convergence",
)
STATE_RE = re.compile(r"[A-Za-z][A-Za-z_-]{0,39}")
PATH_RE = re.compile(r"[\x21-\x7e]*")  # printable ASCII, no spaces


class WebhookFilter(Model):
    """A record matches when it has this kind (if given) and state (if given):
    a health state (HEALTHY, UNHEALTHY, UNKNOWN), a route's target mode, or
    a Change record's action (apply, delete, create, replace, shift, ...)."""

    kind: Literal[
        "Endpoint", "HealthSource", "CompositeHealthCheck", "NetworkEndpointGroup", "Route",
        "Change", "Ramp", "Ejection", "Hold", "PracticeRun", "Convergence",
    ] | None = None  # fmt: skip
    state: str | None = Field(None, max_length=40)

    @field_validator("state")
    @classmethod
    def _check_state(cls, value: str | None) -> str | None:
        if value is not None and not STATE_RE.fullmatch(value):
            raise ValueError(f"expected a state or action such as UNHEALTHY, got {brief(value)}")
        return value

    def matches(self, record: dict[str, Any]) -> bool:
        if self.kind is not None and record.get("kind") != self.kind:
            return False
        return self.state is None or record.get("to") == self.state


class Webhook(Resource):
    kind: Literal["Webhook"]
    url: str = Field(min_length=1, max_length=MAX_URL)
    secret: str = Field(min_length=16, max_length=256)
    events: list[WebhookFilter] = Field(default_factory=list, max_length=MAX_FILTERS)

    SCOPES = frozenset({"global"})
    SECRET_FIELDS: ClassVar[frozenset[str]] = frozenset({"secret"})

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return checked_url(value)

    @field_validator("secret")
    @classmethod
    def _check_secret(cls, value: str) -> str:
        return one_line(value, "no control characters")

    def wants(self, record: dict[str, Any]) -> bool:
        return not self.events or any(f.matches(record) for f in self.events)

    @property
    def host(self) -> str:
        parts = split_url(self.url)
        assert parts is not None  # (validated)
        return parts.hostname or ""

    @property
    def address(self) -> str | None:
        """The URL's host if it is an address (else None: a DNS name)."""
        try:
            return str(ipaddress.ip_address(self.host))
        except ValueError:
            return None


def checked_url(value: str) -> str:
    """``value`` if it is a URL healthgate sends to (a webhook's, a METRIC
    source's Prometheus), else ValueError saying what is expected."""
    if split_url(value) is None:
        raise ValueError(
            "expected http:// or https:// with a host (an address or a DNS name), an "
            f"optional port and path, no user name, password or fragment; got {brief(value)}"
        )
    return value


def one_line(
    value: str, message: str = "one line: no line breaks or other control characters"
) -> str:
    """``value`` if it has no control characters, else ValueError(``message``)."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(message)
    return value


def split_url(value: str) -> SplitResult | None:
    """The parts of a webhook URL, or None if it is not one we send to."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host or parts.fragment:
        return None
    if parts.username is not None or parts.password is not None or port == 0:
        return None
    if not PATH_RE.fullmatch(parts.path + ("?" + parts.query if parts.query else "")):
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not HOST_RE.fullmatch(host):
            return None
    return parts
