"""One JSON error shape everywhere, and no stack traces to clients.

Every error the API answers is ``{"error": {"code", "message", "details", "request_id"}}``:
``code`` is machine-readable (stable), ``message`` is one human sentence.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

import asyncpg
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("gpufleet.api")

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("gpufleet_request_id", default=None)


class ErrorDetail(BaseModel):
    code: str
    message: str
    details: Any = None
    request_id: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class ApiError(Exception):
    """Raise anywhere in a request to answer with the error shape."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: Any = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details
        self.headers = headers


def error_body(code: str, message: str, details: Any = None) -> dict[str, Any]:
    return {
        "error": {
            "code": code,
            "message": message,
            "details": jsonable_encoder(details) if details is not None else None,
            "request_id": request_id_var.get(),
        }
    }


def error_response(
    status: int, code: str, message: str, details: Any = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(error_body(code, message, details), status_code=status, headers=headers)


# Errors every route may answer, documented once so responses match the OpenAPI schema.
_ERROR_DESCRIPTIONS = {
    400: "malformed request (missing Idempotency-Key, bad cursor, bad JSON)",
    401: "missing or unknown bearer token",
    403: "the principal may not do this",
    404: "no such resource (or not visible to this principal)",
    409: "conflicts with the current state, or an identical request is still in flight",
    413: "request body too large",
    422: "invalid request, or rejected by admission",
    429: "team queue full, or too many requests (or failed authentications) from this principal or address; see Retry-After",
    502: "an agent answered with an error",
    503: "a dependency (database, Temporal, agent) is unreachable",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": desc} for code, desc in _ERROR_DESCRIPTIONS.items()
}

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "request_too_large",
    415: "unsupported_media_type",
}

_DB_UNAVAILABLE = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.InterfaceError,
    # a failover: the server ended the session (shutdown, crash, promotion)
    asyncpg.exceptions.OperatorInterventionError,
    # asyncpg's own client-side errors: no host of a multi-host DSN takes writes yet
    # (TargetServerAttributeNotMatched: the primary gone, the standby not yet promoted), or a
    # pooled connection whose server died mid-operation fails its next statement ("cannot
    # switch to state 15; another operation (2) is in progress"), both seen in chaos --ha
    # runs; the request did nothing, a retry finds a live connection
    asyncpg.exceptions._base.InternalClientError,
)
_BAD_TEXT = (
    asyncpg.exceptions.CharacterNotInRepertoireError,
    asyncpg.exceptions.UntranslatableCharacterError,
    UnicodeEncodeError,
)


def _clean_validation_errors(errors: Any) -> list[dict[str, Any]]:
    out = []
    for e in errors:
        out.append({"loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": e.get("type")})
    return out


def translate_exception(exc: BaseException) -> tuple[int, str, str, Any] | None:
    """Map a non-HTTP exception to (status, code, message, details); None = internal error."""
    if isinstance(exc, _BAD_TEXT):
        return (
            400,
            "invalid_characters",
            "the request contains characters that cannot be stored (NUL or lone surrogates)",
            None,
        )
    if isinstance(exc, _DB_UNAVAILABLE):
        return 503, "database_unavailable", "the database is unreachable; retry later", None
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.details, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        message = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
        return error_response(exc.status_code, code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        for e in errors:
            loc = tuple(str(x).lower() for x in e.get("loc", ()))
            if loc[:2] == ("header", "idempotency-key") and e.get("type") == "missing":
                return error_response(
                    400,
                    "idempotency_key_missing",
                    "this write needs an Idempotency-Key header (a unique string per logical request)",
                )
            if e.get("type") == "json_invalid":
                return error_response(400, "malformed_json", "the request body is not valid JSON")
        return error_response(422, "validation_error", "the request is invalid", _clean_validation_errors(errors))


__all__ = [
    "ERROR_RESPONSES",
    "ApiError",
    "ErrorBody",
    "error_body",
    "error_response",
    "install_error_handlers",
    "request_id_var",
    "translate_exception",
]
