"""The OpenAPI document says what the API really takes and answers.

FastAPI derives it from the handlers, which take resources as plain JSON
objects (they are validated by the model, with errors in the API's own
shape). This module completes it: every resource kind's schema (from the
pydantic models, camelCase as on the wire) as the request and response body
of the resource routes, and the API's one error shape as the 400 / 401 /
403 / 404 / 409 / 412 / 413 / 503 answers - instead of FastAPI's 422, which
this API never sends.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from healthgate.model.resources import KIND_CLASSES

REGIONAL_KINDS = tuple(KIND_CLASSES)
GLOBAL_KINDS = ("BackendService", "ForwardingRule")
ERRORS = {
    "400": "invalid input: the fields are named in details",
    "401": "no or unknown bearer token",
    "403": "this token may not do this",
    "404": "not found",
    "409": "it exists already, or others refer to it",
    "412": "the fingerprint sent is not current",
    "413": "the body is too large",
    "503": "the store cannot take writes now",
}


class ErrorDetail(BaseModel):
    field: str
    description: str
    document: int | None = None
    line: int | None = None
    resource: str | None = None


class ErrorBody(BaseModel):
    class Inner(BaseModel):
        code: int
        status: str
        message: str
        details: list[ErrorDetail]

    error: Inner


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        template = "#/components/schemas/{model}"
        models: list[type[BaseModel]] = [*KIND_CLASSES.values(), ErrorBody]
        for model in models:
            doc = model.model_json_schema(by_alias=True, ref_template=template)
            schemas.update(doc.pop("$defs", {}))
            schemas[model.__name__] = doc
        for path, operations in schema.get("paths", {}).items():
            for method, op in operations.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for code, text in ERRORS.items():
                    responses.setdefault(
                        code,
                        {
                            "description": text,
                            "content": {"application/json": {"schema": _ref("ErrorBody")}},
                        },
                    )
                _type_resource_bodies(path, method, op)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _type_resource_bodies(path: str, method: str, op: dict[str, Any]) -> None:
    """The resource routes' bodies: one of the kinds of their scope."""
    if not path.startswith("/v1/projects/{project}/") or "{collection}" not in path:
        return
    kinds = GLOBAL_KINDS if "/global/" in path else REGIONAL_KINDS
    one_of = {"oneOf": [_ref(KIND_CLASSES[k].__name__) for k in kinds]}
    if method in ("post", "put"):
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": one_of}}}
    ok = "201" if method == "post" else "200"
    if (method in ("get", "post", "put") and path.endswith("{name}")) or method == "post":
        op["responses"][ok] = {
            "description": "the resource, with fingerprint, selfLink, timestamps and status",
            "content": {"application/json": {"schema": one_of}},
        }
