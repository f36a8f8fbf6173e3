"""What a probe sends (SPEC §10, "Probe requests"), and kind ``Secret``.

A health check may say more than "GET /": an HTTP(S) check's ``method``,
``requestHeaders`` (a value written in the check, or read from a secret) and
``requestBody``; a TCP check's ``send`` and ``expect``; any check's
``proxyHeader``; an HTTPS check's ``clientCertificate`` and ``caCertificate``.
The pieces are here; the fields are :class:`~healthgate.model.resources.HealthCheck`'s.

A **Secret** holds one value that is written and never read back (as a
webhook's secret: SPEC §7)::

    kind: Secret
    name: api-token
    project: shop
    region: us-east1          # or global
    value: "Bearer 3q2+7w..."   # a header value, or PEM (a certificate and its key, a CA)

The API answers ``valueSet: true`` for it, Change records show
``(secret)``, and a check that uses it shows ``(secret)`` where the value
would be (``describe``); a secret in use cannot be deleted (the references
rule), and writing a new value takes effect on the next probe.
"""

from __future__ import annotations

import hashlib
import re
from typing import ClassVar, Literal, Self

from pydantic import Field, field_validator, model_validator

from healthgate.model.names import brief
from healthgate.model.resource import Model, Resource
from healthgate.model.webhooks import one_line

MAX_SECRET = 32 * 1024  # characters of a secret's value (a certificate chain and its key fit)
MAX_HEADERS = 16
MAX_HEADER_VALUE = 4096  # bytes of one header value
MAX_BODY = 4096  # bytes of a request body
MAX_PAYLOAD = 1024  # bytes of a TCP check's send or expect

# a header name is an HTTP token (RFC 9110 §5.6.2)
HEADER_NAME_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,128}")
# headers the prober writes itself (the framing and the connection are its own)
RESERVED_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "expect",
    }
)
HEX_RE = re.compile(r"(?:[0-9a-fA-F]{2})+")

Method = Literal["GET", "HEAD", "POST", "PUT", "OPTIONS"]
ProxyHeader = Literal["NONE", "PROXY_V1", "PROXY_V2"]


def header_value_problem(value: str) -> str | None:
    """Why ``value`` cannot be a header value (None: it can): no line breaks
    or other control characters (a tab is allowed), at most 4 KiB."""
    if any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in value):
        return "no line breaks or other control characters (a header value is one line)"
    if len(value.encode()) > MAX_HEADER_VALUE:
        return f"at most {MAX_HEADER_VALUE} bytes"
    return None


class SecretRef(Model):
    """``{secret: NAME}``: a Secret of the check's project (a bare name is
    the check's own region; ``global/secrets/NAME`` a global one)."""

    secret: str = Field(min_length=1, max_length=300)


class RequestHeader(Model):
    """One request header: ``value`` written here, or ``valueFrom`` a secret."""

    name: str
    value: str | None = None
    value_from: SecretRef | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not HEADER_NAME_RE.fullmatch(value):
            raise ValueError(
                "expected a header name: 1-128 letters, digits and ! # $ % & ' * + - . ^ _ ` | ~"
                f", got {brief(value)}"
            )
        if value.lower() in RESERVED_HEADERS:
            raise ValueError(
                f"{value} is the prober's own (framing and connection headers are; the Host "
                "header is the check's host)"
            )
        return value

    @field_validator("value")
    @classmethod
    def _check_value(cls, value: str | None) -> str | None:
        if value is not None:
            problem = header_value_problem(value)
            if problem is not None:
                raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _one_value(self) -> Self:
        if (self.value is None) == (self.value_from is None):
            raise ValueError(f"header {self.name}: give value or valueFrom, exactly one")
        return self


class Payload(Model):
    """Bytes a TCP check sends or expects: ``text`` (UTF-8; YAML's "\\r\\n"
    escapes work in double quotes) or ``hex``, exactly one, at most 1 KiB."""

    text: str | None = None
    hex: str | None = None

    @field_validator("hex")
    @classmethod
    def _check_hex(cls, value: str | None) -> str | None:
        if value is not None and not HEX_RE.fullmatch(value):
            raise ValueError(
                f"expected pairs of hex digits such as 50494e470d0a, got {brief(value)}"
            )
        return value

    @model_validator(mode="after")
    def _one_form(self) -> Self:
        if (self.text is None) == (self.hex is None):
            raise ValueError("give text or hex, exactly one")
        data = self.data()
        if not data:
            raise ValueError("at least one byte")
        if len(data) > MAX_PAYLOAD:
            raise ValueError(f"at most {MAX_PAYLOAD} bytes, got {len(data)}")
        return self

    def data(self) -> bytes:
        if self.hex is not None:
            return bytes.fromhex(self.hex)
        return (self.text or "").encode()


class Secret(Resource):
    kind: Literal["Secret"]
    value: str = Field(min_length=1, max_length=MAX_SECRET, repr=False)

    SCOPES = frozenset({"regional", "global"})
    SECRET_FIELDS: ClassVar[frozenset[str]] = frozenset({"value"})

    @field_validator("value")
    @classmethod
    def _check_value(cls, value: str) -> str:
        # line breaks and tabs (PEM has them); no other control characters
        if any((ord(c) < 32 and c not in "\t\r\n") or ord(c) == 127 for c in value):
            raise ValueError("no control characters other than tabs and line breaks")
        return value


# ------------------------------------------------------------------ pushed health

TTL_MIN, TTL_MAX = 5, 86_400
MAX_NOTE = 500


def report_name(backend_service: str, endpoint: str) -> str:
    """The one EndpointReport name of an endpoint of a backend service (a
    report replaces the last one: the store holds one per endpoint)."""
    digest = hashlib.sha256(f"{backend_service}\n{endpoint}".encode()).hexdigest()[:24]
    return f"r-{digest}"


class EndpointReport(Resource):
    """The last state a client reported for an endpoint of a backend service
    whose check is ``type: PUSH`` (SPEC §10, Consul's TTL checks). Written
    only by ``POST .../backendServices/{b}/endpoints:report`` (which sets
    the name, the time and the actor), never by a manifest; the store keeps
    one per endpoint, so a restart (or another cluster node) finds it."""

    kind: Literal["EndpointReport"]
    backend_service: str = Field(min_length=1, max_length=63)  # in the report's region
    endpoint: str = Field(min_length=1, max_length=64)  # "ip:port", "[v6]:port" or "ip"
    state: Literal["HEALTHY", "UNHEALTHY", "DEGRADED"]
    note: str = Field("", max_length=MAX_NOTE)
    time: float  # when it was received (epoch seconds)
    actor: str = Field(min_length=1, max_length=63)

    @field_validator("note")
    @classmethod
    def _check_note(cls, value: str) -> str:
        return one_line(value)
