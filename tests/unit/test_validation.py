"""Every validation rule of SPEC §1, each proving the error names the field."""

import ipaddress
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from healthgate.model.manifest import (
    ManifestLimits,
    load_manifest,
    load_manifest_file,
    parse_manifest,
)
from healthgate.model.names import ResourcePath
from healthgate.model.resource import normalise_ip
from healthgate.model.validation import InvalidResources, check_delete
from tests.helpers import ROOT, example_dicts, find, issues_of, resources

SHARED_EXAMPLE = ROOT.parent / "shared" / "examples" / "two-regions.yaml"

Mutation = Callable[[list[dict[str, Any]]], None]


def hc(d: list[dict[str, Any]]) -> dict[str, Any]:
    return find(d, "HealthCheck", "http-8080", "us-east1")


def set_(
    getter: Callable[[list[dict[str, Any]]], dict[str, Any]], key: str, value: Any
) -> Mutation:
    def mutate(d: list[dict[str, Any]]) -> None:
        getter(d)[key] = value

    return mutate


def source(d: list[dict[str, Any]]) -> dict[str, Any]:
    return find(d, "HealthSource", "web-source", "us-east1")


def composite(d: list[dict[str, Any]]) -> dict[str, Any]:
    return find(d, "CompositeHealthCheck", "web-composite", "us-east1")


def producer_bs(d: list[dict[str, Any]]) -> dict[str, Any]:
    return find(d, "BackendService", "web", "us-east1")


def consumer_bs(d: list[dict[str, Any]]) -> dict[str, Any]:
    return find(d, "BackendService", "shop")


def add(doc: dict[str, Any]) -> Mutation:
    return lambda d: d.append(doc)


def second_composite(d: list[dict[str, Any]]) -> None:
    c = dict(composite(d))
    c["name"] = "another"
    d.append(c)


def tcp_with_contains(d: list[dict[str, Any]]) -> None:
    hc(d).update(type="TCP", requestPath="/", responseContains="ready")


def tcp_with_degraded(d: list[dict[str, Any]]) -> None:
    hc(d).update(type="TCP", requestPath="/", degradedStatusCodes=["429"])


def inverted_with_degraded(d: list[dict[str, Any]]) -> None:
    hc(d).update(invert=True, degradedStatusCodes=["429"])


def tcp_with_path(d: list[dict[str, Any]]) -> None:
    h = hc(d)
    h["type"] = "TCP"


RULES: list[tuple[str, Mutation, str, str]] = [
    # (rule, mutation, field named, words of the message)
    ("name syntax", set_(hc, "name", "Bad_Name"), "name", "lowercase letters"),
    ("name length", set_(hc, "name", "a" * 64), "name", "1-63 characters"),
    ("unknown field", set_(hc, "intervalSec", 5), "intervalSec", "unknown field"),
    ("unknown kind", set_(hc, "kind", "LoadBalancer"), "kind", "expected one of"),
    ("missing field", lambda d: hc(d).pop("type"), "type", "required"),
    (
        "checkIntervalSec low",
        set_(hc, "checkIntervalSec", 0),
        "checkIntervalSec",
        "greater than or equal to 1",
    ),
    (
        "checkIntervalSec high",
        set_(hc, "checkIntervalSec", 51),
        "checkIntervalSec",
        "less than or equal to 50",
    ),
    (
        "healthyThreshold low",
        set_(hc, "healthyThreshold", 1),
        "healthyThreshold",
        "greater than or equal to 2",
    ),
    (
        "healthyThreshold high",
        set_(hc, "healthyThreshold", 11),
        "healthyThreshold",
        "less than or equal to 10",
    ),
    (
        "unhealthyThreshold low",
        set_(hc, "unhealthyThreshold", 1),
        "unhealthyThreshold",
        "greater than or equal to 2",
    ),
    (
        "unhealthyThreshold high",
        set_(hc, "unhealthyThreshold", 11),
        "unhealthyThreshold",
        "less than or equal to 10",
    ),
    ("port range", set_(hc, "port", 70000), "port", "less than or equal to 65535"),
    ("timeoutSec", set_(hc, "timeoutSec", 0), "timeoutSec", "greater than or equal to 1"),
    (
        "requestPath no slash",
        set_(hc, "requestPath", "healthz"),
        "requestPath",
        "starting with '/'",
    ),
    (
        "requestPath too long",
        set_(hc, "requestPath", "/" + "a" * 80),
        "requestPath",
        "1-80 characters",
    ),
    ("requestPath bad char", set_(hc, "requestPath", "/a b"), "requestPath", "made of letters"),
    ("requestPath bad char 2", set_(hc, "requestPath", '/a"b'), "requestPath", "made of letters"),
    ("requestPath on TCP", tcp_with_path, "requestPath", "only HTTP and HTTPS"),
    ("responseContains on TCP", tcp_with_contains, "responseContains", "only HTTP and HTTPS"),
    ("responseContains empty", set_(hc, "responseContains", ""), "responseContains", "at least 1"),
    (
        "responseContains too long",
        set_(hc, "responseContains", "é" * 600),
        "responseContains",
        "1,024 bytes",
    ),
    ("invert not a boolean", set_(hc, "invert", "sometimes"), "invert", "boolean"),
    ("degradedStatusCodes on TCP", tcp_with_degraded, "degradedStatusCodes", "only HTTP"),
    ("degradedStatusCodes inverted", inverted_with_degraded, "degradedStatusCodes", "inverted"),
    (
        "degraded status codes",
        set_(hc, "degradedStatusCodes", ["4xx"]),
        "degradedStatusCodes",
        "ranges like",
    ),
    (
        "too many degraded status codes",
        set_(hc, "degradedStatusCodes", [str(c) for c in range(400, 421)]),
        "degradedStatusCodes",
        "at most 20",
    ),
    (
        "status codes",
        set_(hc, "expectedStatusCodes", ["2xx"]),
        "expectedStatusCodes",
        "ranges like",
    ),
    (
        "status range order",
        set_(hc, "expectedStatusCodes", ["299-200"]),
        "expectedStatusCodes",
        "ranges like",
    ),
    (
        "policy percent",
        set_(
            lambda d: find(d, "HealthAggregationPolicy", "strict"), "healthyPercentThreshold", 101
        ),
        "healthyPercentThreshold",
        "less than or equal to 100",
    ),
    (
        "policy min",
        set_(lambda d: find(d, "HealthAggregationPolicy", "strict"), "minHealthyThreshold", -1),
        "minHealthyThreshold",
        "greater than or equal to 0",
    ),
    (
        "source exactly one",
        set_(source, "sources", ["backendServices/web", "backendServices/web"]),
        "sources",
        "exactly one backend service",
    ),
    ("source none", set_(source, "sources", []), "sources", "exactly one backend service"),
    (
        "composite as source",
        set_(source, "sources", ["compositeHealthChecks/web-composite"]),
        "sources[0]",
        "never a health source",
    ),
    (
        "source scheme",
        set_(producer_bs, "loadBalancingScheme", "EXTERNAL"),
        "sources[0]",
        "needs INTERNAL or INTERNAL_MANAGED",
    ),
    ("composite zero sources", set_(composite, "healthSources", []), "healthSources", "at least 1"),
    (
        "composite eleven sources",
        set_(composite, "healthSources", ["healthSources/web-source"] * 11),
        "healthSources",
        "at most 10",
    ),
    (
        "composite duplicate source",
        set_(composite, "healthSources", ["healthSources/web-source"] * 2),
        "healthSources[1]",
        "duplicate",
    ),
    ("one composite per rule", second_composite, "healthDestination", "more than one composite"),
    (
        "same region: source",
        set_(
            source,
            "healthAggregationPolicy",
            "regions/europe-west1/healthAggregationPolicies/default-policy",
        ),
        "healthAggregationPolicy",
        "must share project",
    ),
    (
        "same region: composite",
        set_(composite, "healthDestination", "regions/europe-west1/forwardingRules/web-fr"),
        "healthDestination",
        "must share project",
    ),
    (
        "same project: composite",
        set_(
            composite, "healthSources", ["projects/web/regions/us-east1/healthSources/web-source"]
        ),
        "healthSources[0]",
        "missing resource",
    ),
    (
        "missing reference",
        set_(source, "healthAggregationPolicy", "healthAggregationPolicies/nope"),
        "healthAggregationPolicy",
        "missing resource projects/shop/regions/us-east1/healthAggregationPolicies/nope",
    ),
    (
        "wrong collection",
        set_(producer_bs, "healthChecks", ["backendServices/web"]),
        "healthChecks[0]",
        "expected healthChecks",
    ),
    (
        "regional bs one health check",
        set_(producer_bs, "healthChecks", []),
        "healthChecks",
        "exactly one health check",
    ),
    (
        "published backends types",
        set_(
            producer_bs, "backends", [{"group": "regions/us-east1/networkEndpointGroups/shop-us"}]
        ),
        "backends[0].group",
        "missing resource",
    ),
    (
        "global backends are PSC",
        set_(
            consumer_bs,
            "backends",
            [{"group": "projects/shop/regions/us-east1/networkEndpointGroups/web-neg"}],
        ),
        "backends[0].group",
        "PRIVATE_SERVICE_CONNECT",
    ),
    (
        "global scheme",
        set_(consumer_bs, "loadBalancingScheme", "INTERNAL"),
        "loadBalancingScheme",
        "EXTERNAL_MANAGED or INTERNAL_MANAGED",
    ),
    (
        "PSC target missing",
        set_(
            lambda d: find(d, "NetworkEndpointGroup", "shop-us"),
            "pscTargetService",
            "projects/shop/regions/us-east1/serviceAttachments/nope",
        ),
        "pscTargetService",
        "missing resource",
    ),
    (
        "PSC needs target",
        lambda d: find(d, "NetworkEndpointGroup", "shop-us").pop("pscTargetService"),
        "pscTargetService",
        "required",
    ),
    (
        "endpoint needs port",
        set_(
            lambda d: find(d, "NetworkEndpointGroup", "web-neg", "us-east1"),
            "endpoints",
            [{"ipAddress": "127.0.1.1"}],
        ),
        "endpoints[0].port",
        "required for GCE_VM_IP_PORT",
    ),
    (
        "endpoint ip",
        set_(
            lambda d: find(d, "NetworkEndpointGroup", "web-neg", "us-east1"),
            "endpoints",
            [{"ipAddress": "nope", "port": 1}],
        ),
        "endpoints[0].ipAddress",
        "IPv4 or IPv6",
    ),
    (
        "forwarding rule ports xor range",
        lambda d: find(d, "ForwardingRule", "web-fr", "us-east1").update(portRange="80"),
        "ports",
        "exactly one of ports or portRange",
    ),
    (
        "forwarding rule protocol",
        set_(lambda d: find(d, "ForwardingRule", "web-fr", "us-east1"), "IPProtocol", "UDP"),
        "IPProtocol",
        "needs IPProtocol TCP",
    ),
    (
        "dataPlaneRegion only global",
        set_(
            lambda d: find(d, "ForwardingRule", "web-fr", "us-east1"), "dataPlaneRegion", "us-east1"
        ),
        "dataPlaneRegion",
        "only global",
    ),
    (
        "accept list needs manual",
        set_(
            lambda d: find(d, "ServiceAttachment", "web-attachment", "europe-west1"),
            "consumerAcceptLists",
            [{"projectIdOrNum": "web"}],
        ),
        "consumerAcceptLists",
        "ACCEPT_MANUAL",
    ),
    (
        "failover policy only global",
        set_(producer_bs, "failoverPolicy", {"failback": False}),
        "failoverPolicy",
        "only global",
    ),
    ("health check is regional", set_(hc, "region", "global"), "region", "must be regional"),
    ("duplicate resource", lambda d: d.append(dict(hc(d))), "name", "duplicate resource"),
]


@pytest.mark.parametrize(("rule", "mutate", "field", "words"), RULES, ids=[r[0] for r in RULES])
def test_rule_names_the_field(rule: str, mutate: Mutation, field: str, words: str) -> None:
    dicts = example_dicts()
    mutate(dicts)
    issues = issues_of(dicts)
    assert issues, f"{rule}: no error"
    matching = [i for i in issues if i.field == field and words in i.message]
    assert matching, (
        f"{rule}: expected field {field!r} with {words!r}, got {[str(i) for i in issues]}"
    )
    issue = matching[0]
    assert issue.document is not None and issue.kind  # names the document and its kind
    assert field in str(issue)


def test_the_shared_example_loads_unchanged() -> None:
    path = SHARED_EXAMPLE if SHARED_EXAMPLE.exists() else ROOT / "examples" / "two-regions.yaml"
    docs = load_manifest_file(path)
    assert len(docs) == 20
    assert (ROOT / "examples" / "two-regions.yaml").read_text() == path.read_text()


def test_defaults_are_applied() -> None:
    res = {str(r.path): r for r in resources(example_dicts())}
    eu_hc = res["projects/shop/regions/europe-west1/healthChecks/http-8080"]
    assert eu_hc.model_dump(
        include={
            "check_interval_sec",
            "timeout_sec",
            "healthy_threshold",
            "unhealthy_threshold",
            "expected_status_codes",
            "enabled",
        }
    ) == {
        "check_interval_sec": 2,
        "timeout_sec": 3,
        "healthy_threshold": 3,
        "unhealthy_threshold": 3,
        "expected_status_codes": ["200"],
        "enabled": True,
    }
    policy = res["projects/shop/regions/europe-west1/healthAggregationPolicies/default-policy"]
    assert (policy.healthy_percent_threshold, policy.min_healthy_threshold) == (60, 1)  # type: ignore[attr-defined]


def test_manifest_errors_carry_document_index_and_line() -> None:
    text = "kind: HealthCheck\nproject: p\nregion: r\nname: ok\ntype: TCP\nport: 1\n---\n---\nkind: HealthCheck\nproject: p\nregion: r\nname: bad\ntype: TCP\nport: 0\n"
    with pytest.raises(InvalidResources) as exc:
        load_manifest(text)
    (issue,) = exc.value.issues
    # the line of the field (14), not of its document (9)
    assert (issue.document, issue.line, issue.field) == (3, 14, "port")
    assert str(issue).startswith("document 3 (line 14), HealthCheck bad: field port:")


def test_cross_resource_errors_point_at_the_fields_line_too() -> None:
    text = Path(ROOT / "examples" / "two-regions.yaml").read_text()
    bad = text.replace("healthAggregationPolicies/strict", "healthAggregationPolicies/nope", 1)
    line = bad.splitlines().index("healthAggregationPolicy: healthAggregationPolicies/nope") + 1
    with pytest.raises(InvalidResources) as exc:
        load_manifest(bad)
    (issue,) = exc.value.issues
    assert (issue.field, issue.line) == ("healthAggregationPolicy", line)


def test_all_errors_are_listed_not_just_the_first() -> None:
    dicts = example_dicts()
    hc(dicts)["checkIntervalSec"] = 99
    source(dicts)["healthAggregationPolicy"] = "nope"
    issues = issues_of(dicts)
    assert {i.field for i in issues} >= {"checkIntervalSec"}
    dicts = example_dicts()
    source(dicts)["healthAggregationPolicy"] = "nope"
    composite(dicts)["healthDestination"] = "nope"
    assert {i.field for i in issues_of(dicts)} == {"healthAggregationPolicy", "healthDestination"}


def test_bad_yaml_says_where() -> None:
    with pytest.raises(InvalidResources, match="not valid YAML at line 2"):
        parse_manifest("kind: HealthCheck\n  bad: [\n")


def test_unreadable_yaml_is_an_error_not_a_crash() -> None:
    with pytest.raises(InvalidResources, match="not valid YAML"):
        parse_manifest("kind: HealthCheck\x00\x01")


def test_manifest_size_limit() -> None:
    with pytest.raises(InvalidResources, match="the limit is 10"):
        parse_manifest("x" * 100, ManifestLimits(max_bytes=10))
    with pytest.raises(InvalidResources, match="more than 1 documents"):
        parse_manifest("{}\n---\n{}\n", ManifestLimits(max_documents=1))


def test_in_use_resources_cannot_be_deleted() -> None:
    world = resources(example_dicts())
    target = ResourcePath("shop", "us-east1", "backendServices", "web")
    remaining = [r for r in world if r.path != target]
    issues = check_delete(remaining, [target])
    messages = sorted(i.message for i in issues)
    assert messages == [
        f"{target} is in use: projects/shop/regions/us-east1/forwardingRules/web-fr references it in field backendService",
        f"{target} is in use: projects/shop/regions/us-east1/healthSources/web-source references it in field sources[0]",
    ]
    # deleting the referrers too is fine
    gone = {
        target,
        ResourcePath("shop", "us-east1", "forwardingRules", "web-fr"),
        ResourcePath("shop", "us-east1", "healthSources", "web-source"),
    }
    leftover = [r for r in world if r.path not in gone]
    assert [
        i
        for i in check_delete(leftover, gone)
        if "web-fr" not in i.message and "web-source" not in i.message
    ] == []


def test_cross_project_psc_reference_is_allowed() -> None:
    assert len(resources(example_dicts())) == 20  # shop-us targets project shop from project web


def test_example_file_path_exists() -> None:
    assert Path(ROOT / "examples" / "scenario-us-east1-hangs.yaml").exists()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"dnsName": "shop"}, "dnsName"),  # one label
        ({"dnsName": "-bad.example.test"}, "dnsName"),
        ({"dnsName": "a" * 64 + ".example.test"}, "dnsName"),
        ({"dnsTtlSec": 5}, "dnsTtlSec"),  # a TTL without a name
        ({"dnsName": "shop.example.test", "dnsTtlSec": -1}, "dnsTtlSec"),
    ],
)
def test_dns_name_rules(change: dict[str, Any], field: str) -> None:
    dicts = example_dicts()
    find(dicts, "ForwardingRule", "shop-frontend").update(change)
    assert any(i.field == field for i in issues_of(dicts)), issues_of(dicts)


def test_a_dns_name_belongs_to_one_rule_and_only_global_rules_have_one() -> None:
    dicts = example_dicts()
    front = find(dicts, "ForwardingRule", "shop-frontend")
    front["dnsName"] = "Shop.Example.Test."
    twin = dict(front, name="shop-frontend-2", portRange="9999")
    dicts.append(twin)
    assert [i.field for i in issues_of(dicts)] == ["dnsName"]
    dicts = example_dicts()
    find(dicts, "ForwardingRule", "web-fr", "us-east1")["dnsName"] = "shop.example.test"
    assert any(i.field == "dnsName" for i in issues_of(dicts))
    dicts = example_dicts()
    find(dicts, "ForwardingRule", "shop-frontend")["dnsName"] = "Shop.Example.Test."
    (front_res,) = [
        r for r in resources(dicts) if r.kind == "ForwardingRule" and r.name == "shop-frontend"
    ]
    assert front_res.dns_name == "shop.example.test"  # type: ignore[attr-defined]


def test_a_project_cannot_borrow_another_projects_accepted_psc_neg() -> None:
    """The bypass of ACCEPT_MANUAL: a project not on the accept list uses the
    accepted consumer's NEG (or its backend service) from its own front end."""
    dicts = example_dicts()
    evil_bs = {
        "kind": "BackendService",
        "project": "evil",
        "region": "global",
        "name": "steal",
        "loadBalancingScheme": "EXTERNAL_MANAGED",
        "backends": [{"group": "projects/web/regions/us-east1/networkEndpointGroups/shop-us"}],
    }
    evil_fr = {
        "kind": "ForwardingRule",
        "project": "evil",
        "region": "global",
        "name": "front",
        "IPAddress": "127.0.0.9",
        "portRange": "8089",
        "loadBalancingScheme": "EXTERNAL_MANAGED",
        "backendService": "projects/web/global/backendServices/shop",
    }
    issues = issues_of([*dicts, evil_bs, evil_fr])
    assert {(i.name, i.field) for i in issues} == {
        ("projects/evil/global/backendServices/steal", "backends[0].group"),
        ("projects/evil/global/forwardingRules/front", "backendService"),
    }, issues


@pytest.mark.parametrize(
    ("ip", "protocol", "ports", "project", "overlaps"),
    [
        ("127.0.0.1", "TCP", {"portRange": "8088"}, "web", True),  # the front end's own
        ("127.0.0.1", "TCP", {"portRange": "8050-8100"}, "other", True),
        ("0.0.0.0", "TCP", {"ports": [8088]}, "other", True),  # a wildcard overlaps all
        ("127.0.0.1", "UDP", {"portRange": "8088"}, "web", False),  # another protocol
        ("127.0.0.2", "TCP", {"portRange": "8088"}, "web", False),  # another address
        ("::", "TCP", {"portRange": "8088"}, "web", False),  # another family
    ],
)
def test_two_rules_never_share_a_listen_address(
    ip: str, protocol: str, ports: dict[str, Any], project: str, overlaps: bool
) -> None:
    dicts = example_dicts()
    bs = dict(find(dicts, "BackendService", "shop", "global"), project=project, name="twin")
    if protocol == "UDP":
        bs["protocol"] = "UDP"
    bs["backends"] = [] if project != "web" else bs["backends"]
    twin = {
        "kind": "ForwardingRule",
        "project": project,
        "region": "global",
        "name": "twin-front",
        "IPAddress": ip,
        "IPProtocol": protocol,
        "loadBalancingScheme": "EXTERNAL_MANAGED",
        "backendService": "twin",
        **ports,
    }
    issues = [i for i in issues_of([*dicts, bs, twin]) if i.field == "IPAddress"]
    assert bool(issues) is overlaps, issues
    if overlaps:
        message = issues[0].message
        if project == "web":
            assert "projects/web/global/forwardingRules/shop-frontend" in message
        else:
            assert "another project's forwarding rule" in message and "web" not in message


def test_text_is_not_trimmed_silently_and_a_psc_neg_stays_in_its_region() -> None:
    dicts = example_dicts()
    find(dicts, "HealthCheck", "http-8080", "us-east1")["requestPath"] = " /healthz"
    assert [i.field for i in issues_of(dicts)] == ["requestPath"]
    dicts = example_dicts()
    neg = find(dicts, "NetworkEndpointGroup", "shop-us")
    neg["pscTargetService"] = neg["pscTargetService"].replace("us-east1", "europe-west1")
    assert [i.field for i in issues_of(dicts)] == ["pscTargetService"]


def test_a_destination_no_attachment_publishes_is_a_warning_not_an_error() -> None:
    dicts = [
        d
        for d in example_dicts()
        if not (d["kind"] == "ServiceAttachment" and d["region"] == "us-east1")
    ]
    dicts = [
        d
        for d in dicts
        if not (
            d["kind"] == "NetworkEndpointGroup"
            and d.get("pscTargetService", "").find("us-east1") >= 0
        )
    ]
    for d in dicts:
        if d["kind"] == "BackendService" and d["region"] == "global":
            d["backends"] = [b for b in d["backends"] if "us-east1" not in b["group"]]
    assert issues_of(dicts) == []
    (warning,) = issues_of(dicts, warnings=True)
    assert (
        warning.field == "healthDestination"
        and "no service attachment publishes" in warning.message
    )


@given(
    st.from_regex(r"[0-9]{1,4}(\.[0-9]{1,4}){2,4}", fullmatch=True) | st.ip_addresses(v=4).map(str)
)
def test_the_ipv4_fast_path_agrees_with_ipaddress(value: str) -> None:
    """normalise_ip skips ipaddress for a canonical dotted IPv4 address (a
    million endpoints); on anything else both must agree."""
    try:
        expected: str | None = str(ipaddress.ip_address(value))
    except ValueError:
        expected = None
    try:
        got: str | None = normalise_ip(value)
    except ValueError:
        got = None
    assert got == expected
