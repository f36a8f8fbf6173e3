"""SPEC §10's check fields and Secrets: every refused value names its field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from healthgate.model.validation import check_delete
from tests.helpers import example_dicts, find, issues_of, resources

Mutation = Callable[[list[dict[str, Any]]], None]
PEM_CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
PEM_KEY = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"


def hc(d: list[dict[str, Any]]) -> dict[str, Any]:
    return find(d, "HealthCheck", "http-8080", "us-east1")


def secret(value: str, name: str = "token", region: str = "us-east1") -> dict[str, Any]:
    return {"kind": "Secret", "name": name, "project": "shop", "region": region, "value": value}


def check(secret_value: str | None = None, **fields: Any) -> Mutation:
    def mutate(d: list[dict[str, Any]]) -> None:
        hc(d).update(fields)
        if secret_value is not None:
            d.append(secret(secret_value))

    return mutate


def header(**h: Any) -> dict[str, Any]:
    return {"requestHeaders": [{"name": "Authorization", **h}]}


FROM_SECRET = {"valueFrom": {"secret": "token"}}


def push(**fields: Any) -> Mutation:
    """The check made a PUSH one (with ``fields``)."""

    def mutate(d: list[dict[str, Any]]) -> None:
        h = hc(d)
        for k in [k for k in h if k not in ("kind", "name", "project", "region")]:
            del h[k]
        h.update(type="PUSH", **fields)

    return mutate


METRIC = {"prometheusUrl": "http://10.1.2.3:9090", "query": "error_ratio", "unhealthyAbove": 0.05}


def source(**fields: Any) -> Mutation:
    def mutate(d: list[dict[str, Any]]) -> None:
        src = find(d, "HealthSource", "web-source", "us-east1")
        src.update(fields)
        for k in [k for k, v in fields.items() if v is None]:
            del src[k]

    return mutate


# (case, mutation, field, words)
REFUSED: list[tuple[str, Mutation, str, str]] = [
    ("method unknown", check(method="DELETE"), "method", "GET"),
    ("method on TCP", check(type="TCP", requestPath="/", method="POST"), "method", "only HTTP"),
    ("header name with a space", check(requestHeaders=[{"name": "X A", "value": "1"}]),
     "requestHeaders[0].name", "header name"),
    ("header Host", check(requestHeaders=[{"name": "Host", "value": "a"}]),
     "requestHeaders[0].name", "the prober's own"),
    ("header Content-Length", check(requestHeaders=[{"name": "content-length", "value": "1"}]),
     "requestHeaders[0].name", "the prober's own"),
    ("header value with CR LF", check(**header(value="a\r\nX-Evil: 1")),
     "requestHeaders[0].value", "line breaks"),
    ("header value with NUL", check(**header(value="a\x00b")), "requestHeaders[0].value",
     "control characters"),
    ("header value too long", check(**header(value="a" * 4097)), "requestHeaders[0].value",
     "4096 bytes"),
    ("header with no value", check(**header()), "requestHeaders[0]", "exactly one"),
    ("header with both values", check(**header(value="a", **FROM_SECRET)), "requestHeaders[0]",
     "exactly one"),
    ("seventeen headers",
     check(requestHeaders=[{"name": f"X-{i}", "value": "1"} for i in range(17)]),
     "requestHeaders", "at most 16"),
    ("headers on TCP", check(type="TCP", requestPath="/", **header(value="a")), "requestHeaders",
     "only HTTP"),
    ("body on GET", check(requestBody="x"), "requestBody", "carries no body"),
    ("body too large", check(method="POST", requestBody="x" * 4097), "requestBody", "4096"),
    ("HEAD with responseContains", check(method="HEAD", responseContains="ok"),
     "responseContains", "HEAD"),
    ("send on HTTP", check(send={"text": "PING"}), "send", "only TCP"),
    ("send empty", check(type="TCP", send={"text": ""}), "send", "at least one byte"),
    ("send text and hex", check(type="TCP", send={"text": "a", "hex": "61"}), "send",
     "exactly one"),
    ("send odd hex", check(type="TCP", send={"hex": "616"}), "send.hex", "pairs of hex"),
    ("expect too long", check(type="TCP", expect={"text": "a" * 1025}), "expect", "1024 bytes"),
    ("proxyHeader unknown", check(proxyHeader="PROXY_V3"), "proxyHeader", "PROXY_V2"),
    ("client certificate on HTTP", check(clientCertificate={"secret": "token"}),
     "clientCertificate", "only HTTPS"),
    ("gRPC client certificate without verify",
     check(type="GRPC", requestPath="/", clientCertificate={"secret": "token"}),
     "clientCertificate", "always verifies"),
    ("CA without verify", check(type="HTTPS", caCertificate={"secret": "token"}),
     "caCertificate", "verify: true"),
    ("a header from a missing secret", check(**header(**FROM_SECRET)),
     "requestHeaders[0].valueFrom.secret", "missing resource"),
    ("a header from a secret with a line break", check("a\nb", **header(**FROM_SECRET)),
     "requestHeaders[0].valueFrom.secret", "one line"),
    ("a client certificate without its key",
     check(PEM_CERT, type="HTTPS", clientCertificate={"secret": "token"}),
     "clientCertificate.secret", "private key"),
    ("a CA that is no certificate",
     check("hello", type="HTTPS", verify=True, caCertificate={"secret": "token"}),
     "caCertificate.secret", "CA certificates"),
    ("another project's secret",
     check(**header(valueFrom={"secret": "projects/other/regions/us-east1/secrets/token"})),
     "requestHeaders[0].valueFrom.secret", "its own project"),
    ("a secret from another kind's collection",
     check(**header(valueFrom={"secret": "healthChecks/http-8080"})),
     "requestHeaders[0].valueFrom.secret", "expected secrets"),
    ("PUSH without ttlSec", push(), "ttlSec", "needs one"),
    ("ttlSec too short", push(ttlSec=4), "ttlSec", "greater than or equal to 5"),
    ("ttlSec too long", push(ttlSec=86401), "ttlSec", "less than or equal to 86400"),
    ("ttlSec on HTTP", check(ttlSec=30), "ttlSec", "only PUSH"),
    ("PUSH with a port", push(ttlSec=30, port=80), "port", "probes nothing"),
    ("PUSH with vantages", push(ttlSec=30, vantageRegions=["europe-west1"]), "vantageRegions",
     "probes nothing"),
    ("PUSH inverted", push(ttlSec=30, invert=True), "invert", "probes nothing"),
    ("PUSH with a body", push(ttlSec=30, method="POST"), "method", "only HTTP"),
    ("METRIC without metric", source(sourceType="METRIC", healthAggregationPolicy=None),
     "metric", "required"),
    ("metric on a BACKEND_SERVICE source", source(metric=METRIC), "metric", "only for"),
    ("METRIC with a policy", source(sourceType="METRIC", metric=METRIC),
     "healthAggregationPolicy", "judged by its query"),
    ("a METRIC threshold both ways",
     source(sourceType="METRIC", healthAggregationPolicy=None, metric={**METRIC, "unhealthyBelow": 1}),
     "metric", "exactly one"),
    ("a secret with a control character", lambda d: d.append(secret("a\x07b")), "value",
     "control characters"),
    ("an empty secret", lambda d: d.append(secret("")), "value", "at least 1"),
    ("a secret too large", lambda d: d.append(secret("a" * 32769)), "value", "at most 32768"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "mutate", "field", "words"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_refused_value_names_its_field(
    case: str, mutate: Mutation, field: str, words: str
) -> None:
    dicts = example_dicts()
    mutate(dicts)
    issues = issues_of(dicts)
    matching = [i for i in issues if i.field == field and words in i.message]
    assert matching, f"{case}: expected {field!r} with {words!r}, got {[str(i) for i in issues]}"


def test_a_secrets_value_is_never_in_a_message() -> None:
    dicts = example_dicts()
    check("s3cr3t\nvalue", **header(**FROM_SECRET))(dicts)
    assert all("s3cr3t" not in str(i) for i in issues_of(dicts))


def mtls_with_ca(d: list[dict[str, Any]]) -> None:
    check(
        PEM_CERT + PEM_KEY,
        type="HTTPS",
        verify=True,
        clientCertificate={"secret": "token"},
        caCertificate={"secret": "global/secrets/ca"},
    )(d)
    d.append(secret(PEM_CERT, "ca", "global"))


ACCEPTED: list[tuple[str, Mutation]] = [
    ("headers, literal and from a secret",
     check("Bearer 3q2+7w", requestHeaders=[{"name": "Authorization", **FROM_SECRET},
                                              {"name": "X-Tenant", "value": "shop\tone"}])),
    ("POST with a body", check(method="POST", requestBody='{"probe": true}')),
    ("HEAD", check(method="HEAD")),
    ("TCP send/expect", check(type="TCP", requestPath="/", send={"text": "PING\r\n"},
                              expect={"hex": "2b504f4e47"})),
    ("a banner", check(type="TCP", requestPath="/", expect={"text": "220 "})),
    ("PROXY v2 on HTTP", check(proxyHeader="PROXY_V2")),
    ("PUSH", push(ttlSec=60)),
    ("METRIC", source(sourceType="METRIC", healthAggregationPolicy=None, metric=METRIC)),
    ("PROXY v1 on TCP", check(type="TCP", requestPath="/", proxyHeader="PROXY_V1")),
    ("mTLS with a CA", mtls_with_ca),
]  # fmt: skip


@pytest.mark.parametrize(("case", "mutate"), ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_accepted(case: str, mutate: Mutation) -> None:
    dicts = example_dicts()
    mutate(dicts)
    assert issues_of(dicts) == []


def test_a_secret_in_use_cannot_be_deleted() -> None:
    dicts = example_dicts()
    check("Bearer 3q2+7w", **header(**FROM_SECRET))(dicts)
    world = resources(dicts)
    token = next(r.path for r in world if r.path.collection == "secrets")
    refusal = check_delete([r for r in world if r.path != token], {token})
    assert "healthChecks/http-8080" in str(refusal)
    assert "requestHeaders[0].valueFrom.secret" in str(refusal)
