"""Lookups across resources that several floors need, each written once.

* :func:`published_rule` - the producer forwarding rule a service attachment
  publishes (``targetService``), and :func:`published_address` - that rule's
  address and first port: where a consumer's traffic for one region goes
  (the data plane, DNS, HAProxy's exported section and Envoy's endpoints all
  ask this).
"""

from __future__ import annotations

from collections.abc import Mapping

from healthgate.model.names import ResourcePath
from healthgate.model.resources import ForwardingRule, Resource, ServiceAttachment


def published_rule(
    resources: Mapping[ResourcePath, Resource], attachment: ResourcePath | str
) -> tuple[ResourcePath, ForwardingRule] | None:
    """(path, rule) of the producer forwarding rule ``attachment`` publishes;
    None when the attachment or its rule is missing (or the path is not one)."""
    try:
        path = (
            attachment if isinstance(attachment, ResourcePath) else ResourcePath.parse(attachment)
        )
    except ValueError:
        return None
    sa = resources.get(path)
    if not isinstance(sa, ServiceAttachment):
        return None
    target = sa.ref("target_service")
    fr = resources.get(target) if target is not None else None
    if target is None or not isinstance(fr, ForwardingRule):
        return None
    return target, fr


def published_address(
    resources: Mapping[ResourcePath, Resource], attachment: ResourcePath | str
) -> tuple[str, int] | None:
    """The address and (first) port of the rule ``attachment`` publishes."""
    found = published_rule(resources, attachment)
    if found is None:
        return None
    rule = found[1]
    return rule.ip_address, rule.port_list()[0]
