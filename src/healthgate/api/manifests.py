"""Manifests over HTTP: ``POST /v1/apply`` (atomic, or its plan with
``dryRun``) and ``POST /v1/delete``. The writer's role is checked before the
body is read; parsing, checking, planning and encoding the answer run off
the event loop (controlplane/offload.py)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.responses import Response

from healthgate.api.auth import AccessError, Principal
from healthgate.api.state import ApiState, Auth
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.controlplane.offload import collector_paused, off_loop, release
from healthgate.model.manifest import ManifestLimits, parse_manifest
from healthgate.model.validation import Document, InvalidResources, Issue

MANIFEST_PATHS = ("/v1/apply", "/v1/delete")


class ApplyRequest(BaseModel):
    manifest: str = Field(description="a YAML stream, one resource per document")
    dryRun: bool = False


def manifest_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["manifests"])

    async def read_manifest(request: Request) -> tuple[str, bool]:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        raw = await request.body()
        if ctype in ("application/yaml", "application/x-yaml", "text/yaml"):
            return raw.decode("utf-8", errors="replace"), request.query_params.get(
                "dryRun", ""
            ).lower() in ("1", "true")
        try:
            req = ApplyRequest.model_validate_json(raw)
        except Exception as exc:
            raise ControlError(
                Refusal.INVALID,
                'expected {"manifest": "<YAML>", "dryRun": false} or an application/yaml body',
                [Issue("manifest", str(exc).splitlines()[0])],
            ) from None
        return req.manifest, req.dryRun

    def parse_for(text: str, who: Principal) -> list[Document]:
        try:
            docs = parse_manifest(text, ManifestLimits(max_bytes=state.settings.max_manifest_bytes))
        except InvalidResources as exc:
            raise ControlError(Refusal.INVALID, "invalid manifest", exc.issues) from None
        for d in docs:
            try:
                state.check_write(who, d.resource)
            except AccessError as exc:
                raise AccessError(403, f"document {d.index}: {exc.message}") from None
        return docs

    async def manifest_documents(text: str, who: Principal) -> list[Document]:
        # parsing is CPU work (seconds for megabytes): off the event loop
        return await off_loop(parse_for, text, who)

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
        text, dry_run = await read_manifest(request)
        with collector_paused:  # (see offload.py: the big objects die inside)
            docs = await manifest_documents(text, who)
            outcome = await state.control.apply(docs, dry_run=dry_run)
            body = {
                "dryRun": dry_run,
                "plan": outcome.plan.to_dict(),
                "revision": outcome.revision,
                "fingerprints": outcome.fingerprints,
            }
            # freeing a parsed world is work too (a million objects: ~80 ms):
            # the last references are dropped in a worker thread, piece by piece
            garbage: list[object] = [text, docs, outcome]  # (outcome first)
            del docs, outcome, text
            await off_loop(release, garbage)
            return await json_response(body)

    @router.post("/v1/delete", tags=["manifests"], openapi_extra=apply_body)
    async def delete_manifest(request: Request, authorization: Auth = None) -> dict[str, Any]:
        who = state.writer(authorization)
        text, dry_run = await read_manifest(request)
        docs = await manifest_documents(text, who)
        outcome = await state.control.delete([d.resource.path for d in docs], dry_run=dry_run)
        return {"dryRun": dry_run, "plan": outcome.plan.to_dict(), "revision": outcome.revision}

    return router


async def json_response(body: Any) -> Response:
    """A large answer (a plan of thousands of paths) encoded off the event loop."""
    content = await off_loop(json.dumps, body, separators=(",", ":"))
    return Response(content, media_type="application/json")
