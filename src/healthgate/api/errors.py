"""The one error shape of SPEC §3::

{"error": {"code": 400, "status": "INVALID_ARGUMENT", "message": "...",
           "details": [{"field": "checkIntervalSec", "description": "..."}]}}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.responses import JSONResponse

from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.model.validation import Issue

# a refusal's kind -> (HTTP code, status)
REFUSAL_HTTP: dict[Refusal, tuple[int, str]] = {
    Refusal.INVALID: (400, "INVALID_ARGUMENT"),
    Refusal.NOT_FOUND: (404, "NOT_FOUND"),
    Refusal.CONFLICT: (409, "ALREADY_EXISTS"),
    Refusal.IN_USE: (409, "FAILED_PRECONDITION"),
    Refusal.PRECONDITION_FAILED: (412, "FAILED_PRECONDITION"),
    Refusal.UNSAFE: (409, "FAILED_PRECONDITION"),
    Refusal.UNAVAILABLE: (503, "UNAVAILABLE"),
}

STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    409: "ALREADY_EXISTS",
    412: "FAILED_PRECONDITION",
    413: "PAYLOAD_TOO_LARGE",
    415: "UNSUPPORTED_MEDIA_TYPE",
    422: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


def error_body(
    code: int,
    message: str,
    details: Sequence[Issue | dict[str, Any]] = (),
    status: str | None = None,
) -> dict[str, Any]:
    out = []
    for d in details:
        out.append(d.to_detail() if isinstance(d, Issue) else d)
    return {
        "error": {
            "code": code,
            "status": status or STATUS.get(code, "UNKNOWN"),
            "message": message,
            "details": out,
        }
    }


def error_response(
    code: int,
    message: str,
    details: Sequence[Issue | dict[str, Any]] = (),
    status: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(code, message, details, status), status_code=code)


def refusal_response(exc: ControlError) -> JSONResponse:
    code, status = REFUSAL_HTTP[exc.kind]
    return error_response(code, exc.message, exc.details, status)
