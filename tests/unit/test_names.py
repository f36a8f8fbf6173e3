import pytest

from healthgate.model.names import ReferenceError_, ResourcePath, resolve_reference

ME = ResourcePath("shop", "us-east1", "healthSources", "src")
GLOBAL_ME = ResourcePath("web", "global", "backendServices", "shop")


@pytest.mark.parametrize(
    ("ref", "referrer", "collection", "expected"),
    [
        ("web", ME, "backendServices", "projects/shop/regions/us-east1/backendServices/web"),
        (
            "backendServices/web",
            ME,
            "backendServices",
            "projects/shop/regions/us-east1/backendServices/web",
        ),
        (
            "regions/eu/backendServices/web",
            ME,
            "backendServices",
            "projects/shop/regions/eu/backendServices/web",
        ),
        (
            "global/backendServices/x",
            ME,
            "backendServices",
            "projects/shop/global/backendServices/x",
        ),
        (
            "projects/other/regions/r1/serviceAttachments/a",
            ME,
            "serviceAttachments",
            "projects/other/regions/r1/serviceAttachments/a",
        ),
        (
            "regions/us-east1/networkEndpointGroups/n",
            GLOBAL_ME,
            "networkEndpointGroups",
            "projects/web/regions/us-east1/networkEndpointGroups/n",
        ),
        (
            "forwardingRules/f",
            GLOBAL_ME,
            "forwardingRules",
            "projects/web/global/forwardingRules/f",
        ),
    ],
)
def test_references_resolve_against_the_referrer(
    ref: str, referrer: ResourcePath, collection: str, expected: str
) -> None:
    assert str(resolve_reference(ref, referrer, collection)) == expected


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("healthChecks/web", "points at healthChecks, expected backendServices"),
        ("", "empty reference"),
        ("a/b/c/d/e/f/g", "cannot parse"),
        ("projects/x/zones/z/backendServices/a", "not a full resource path"),
        ("backendServices/Web", "not a valid name"),
        ("backendServices/web-", "not a valid name"),
    ],
)
def test_bad_references_say_why(ref: str, message: str) -> None:
    with pytest.raises(ReferenceError_, match=message):
        resolve_reference(ref, ME, "backendServices")


def test_path_round_trip() -> None:
    for text in ("projects/p/regions/r/healthChecks/h", "projects/p/global/forwardingRules/f"):
        assert str(ResourcePath.parse(text)) == text
