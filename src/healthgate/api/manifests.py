"""Manifests over HTTP: ``POST /v1/apply`` (atomic, or its plan with
``dryRun``) and ``POST /v1/delete``. The writer's role is checked before the
body is read (api/bodies.py, which reads it whole within a deadline), then a
manifest slot is taken (two at once by default, one per token); parsing,
checking, planning and encoding the answer run off the event loop
(controlplane/offload.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.responses import Response

from healthgate.api.auth import AccessError, Principal
from healthgate.api.state import ApiState, Auth
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.controlplane.offload import collector_paused, off_loop, release
from healthgate.model.manifest import ManifestLimits, parse_manifest, with_field_lines
from healthgate.model.validation import Document, InvalidResources, Issue

MANIFEST_PATHS = ("/v1/apply", "/v1/delete")
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml")


class ApplyRequest(BaseModel):
    manifest: str = Field(description="a YAML stream, one resource per document")
    dryRun: bool = False


def located(body: ManifestBody, issues: list[Issue]) -> list[Issue]:
    """The plan's issues with their fields' lines (the error path only)."""
    try:
        text, _ = body.decode()
    except ControlError:
        return issues
    return with_field_lines(text, issues)


@dataclass(frozen=True, slots=True)
class ManifestBody:
    """A manifest request as received: read on the event loop, decoded off it."""

    raw: bytes
    content_type: str
    dry_run_query: bool  # ?dryRun=true (with a YAML body)

    @classmethod
    async def read(cls, request: Request) -> ManifestBody:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        dry = request.query_params.get("dryRun", "").lower() in ("1", "true")
        return cls(await request.body(), ctype, dry)

    def decode(self) -> tuple[str, bool]:
        """(the YAML text, dry run?); a refusal naming what is wrong."""
        if self.content_type in YAML_TYPES:
            try:
                return self.raw.decode("utf-8"), self.dry_run_query
            except UnicodeDecodeError as exc:
                raise ControlError(
                    Refusal.INVALID,
                    f"the manifest is not UTF-8 (byte {exc.start})",
                    [Issue("manifest", "expected UTF-8 text")],
                ) from None
        try:
            req = ApplyRequest.model_validate_json(self.raw)
        except Exception as exc:
            raise ControlError(
                Refusal.INVALID,
                'expected {"manifest": "<YAML>", "dryRun": false} or an application/yaml body',
                [Issue("manifest", str(exc).splitlines()[0][:200])],
            ) from None
        return req.manifest, req.dryRun


def manifest_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["manifests"])

    def documents_of(body: ManifestBody, who: Principal) -> tuple[list[Document], bool]:
        """Decode, parse and check a manifest: CPU work (seconds for
        megabytes), run off the event loop - the JSON or UTF-8 decoding of a
        5 MB body included, which alone held the loop for milliseconds."""
        text, dry_run = body.decode()
        try:
            docs = parse_manifest(text, ManifestLimits(max_bytes=state.settings.max_manifest_bytes))
        except InvalidResources as exc:
            raise ControlError(Refusal.INVALID, "invalid manifest", exc.issues) from None
        for d in docs:
            try:
                state.check_document(who, d)
            except AccessError as exc:
                raise AccessError(403, f"document {d.index}: {exc.message}") from None
        return docs, dry_run

    apply_body = {
        "requestBody": {
            "content": {
                "application/json": {"schema": ApplyRequest.model_json_schema()},
                "application/yaml": {"schema": {"type": "string"}},
            },
            "required": True,
        }
    }

    @router.post("/v1/apply", tags=["manifests"], openapi_extra=apply_body)
    async def apply(request: Request, authorization: Auth = None) -> Response:
        who = state.writer(authorization)
        raw = await ManifestBody.read(request)  # (read whole already: api/bodies.py)
        async with state.manifest_slot(who):
            return await applied(raw, who)

    async def applied(raw: ManifestBody, who: Principal) -> Response:
        with collector_paused:  # (see offload.py: the big objects die inside)
            docs, dry_run = await off_loop(documents_of, raw, who)
            try:
                outcome = await state.control.apply(docs, dry_run=dry_run)
            except ControlError as exc:  # point each problem at its field's line
                if exc.kind is Refusal.INVALID and exc.details:
                    exc.details = await off_loop(located, raw, exc.details)
                raise
            if not dry_run:
                await state.audit(who, "apply", outcome.plan)
            plan = await off_loop(outcome.plan.to_dict)  # (thousands of paths and warnings)
            body = {
                "dryRun": dry_run,
                "plan": plan,
                "revision": outcome.revision,
                "fingerprints": outcome.fingerprints,
            }
            # freeing a parsed world is work too (a million objects: ~80 ms):
            # the last references are dropped in a worker thread, piece by piece
            garbage: list[object] = [raw, docs, outcome]  # (outcome first)
            del docs, outcome, raw
            await off_loop(release, garbage)
            return await json_response(body)

    @router.post("/v1/delete", tags=["manifests"], openapi_extra=apply_body)
    async def delete_manifest(request: Request, authorization: Auth = None) -> dict[str, Any]:
        who = state.writer(authorization)
        raw = await ManifestBody.read(request)  # (read whole already: api/bodies.py)
        async with state.manifest_slot(who):
            docs, dry_run = await off_loop(documents_of, raw, who)
        outcome = await state.control.delete([d.resource.path for d in docs], dry_run=dry_run)
        if not dry_run:
            await state.audit(who, "delete", outcome.plan)
        return {"dryRun": dry_run, "plan": outcome.plan.to_dict(), "revision": outcome.revision}

    return router


async def json_response(body: Any) -> Response:
    """A large answer (a plan of thousands of paths) encoded off the event loop."""
    content = await off_loop(json.dumps, body, separators=(",", ":"))
    return Response(content, media_type="application/json")
