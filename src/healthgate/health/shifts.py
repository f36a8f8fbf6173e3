"""Shifts (SPEC §6): which PSC NEGs are shifted away, and until when - pure.

A shift of project P away from:

* a **region** R: P's own PSC NEGs in R (a consumer moving its traffic),
  and every PSC NEG of any project that targets one of P's service
  attachments in R (a producer moving its consumers away from a region) -
  the latter unless the shift ``covers`` PSC NEGs only (a consumer's);
* a **PSC NEG** path (P's own): that NEG;
* a **service attachment** path (P's own): every NEG that targets it.

A shifted NEG takes no traffic, as if it were UNHEALTHY, with a reason that
says who shifted it, until when and why (routing.py); a shift never sends
traffic to an UNHEALTHY NEG. A shift is active until its ``expireTime``;
when several cover one NEG, the one that lasts longest gives the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from healthgate.health.states import ShiftEnded, timestamp
from healthgate.model.names import ResourcePath
from healthgate.model.resources import NetworkEndpointGroup, Resource, ServiceAttachment, Shift


@dataclass(frozen=True, slots=True)
class ShiftEffect:
    shift: str  # the shift's path
    actor: str
    until: float
    comment: str

    @property
    def reason(self) -> str:
        return f"shifted away by {self.actor} until {timestamp(self.until)}: {self.comment}"


def shifts_of(resources: Mapping[ResourcePath, Resource]) -> list[Shift]:
    return [r for r in resources.values() if isinstance(r, Shift)]


def affected(shift: Shift, resources: Mapping[ResourcePath, Resource]) -> list[str]:
    """The PSC NEG paths a shift covers (whether active or not)."""
    away = shift.away_from
    attachments: set[str] = set()
    negs: set[str] = set()
    if "/" not in away:  # a region
        for path, r in resources.items():
            if path.project != shift.project or path.region != away:
                continue
            if isinstance(r, ServiceAttachment):
                if shift.covers == "ALL":
                    attachments.add(str(path))
            elif isinstance(r, NetworkEndpointGroup) and r.psc_target_service:
                negs.add(str(path))
    else:
        target = ResourcePath.parse(away)
        if target.project == shift.project:  # (a shift reaches its own project's only)
            if target.collection == "serviceAttachments":
                attachments.add(away)
            else:
                negs.add(away)
    if attachments:
        for path, r in resources.items():
            psc = isinstance(r, NetworkEndpointGroup) and r.psc_target_service
            if psc and str(r.ref("psc_target_service")) in attachments:
                negs.add(str(path))
    return sorted(negs)


def active_effects(
    resources: Mapping[ResourcePath, Resource], now: float
) -> dict[str, ShiftEffect]:
    """PSC NEG path -> the shift that keeps it out now."""
    out: dict[str, ShiftEffect] = {}
    for shift in shifts_of(resources):
        if not shift.active(now):
            continue
        effect = ShiftEffect(str(shift.path), shift.actor, shift.expire_time, shift.comment)
        for neg in affected(shift, resources):
            held = out.get(neg)
            if held is None or held.until < effect.until:
                out[neg] = effect
    return out


def ended(shift: Shift) -> ShiftEnded:
    """The record of a shift that ran out, at its ``expireTime``."""
    return ShiftEnded(
        shift.expire_time,
        shift.project,
        shift.name,
        str(shift.path),
        shift.away_from,
        shift.actor,
        shift.comment,
    )
