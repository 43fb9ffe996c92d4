"""Errors that carry their HTTP status, so storage code can fail precisely without knowing HTTP.

Every error reaches the client as JSON: {"error": {"status", "code", "message", ...}}. Every
error class with a status lives here, whichever layer raises it, so the API's list of
statuses and codes is one file.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from megacache_client.wire.schema import SchemaError, parse_json

T = TypeVar("T")


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")
    status: int
    code: str
    message: str


class ErrorBody(BaseModel):
    """The JSON body of every error response."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these statuses, all with the ErrorBody schema."""
    return {s: {"model": ErrorBody, "description": _DESCRIPTIONS.get(s, "error")}
            for s in statuses}


_DESCRIPTIONS = {
    400: "malformed input (digest, key, length, body)", 401: "missing or invalid token",
    403: "token lacks the scope or namespace", 404: "not found", 408: "upload stalled",
    409: "held by another (a publish claim)", 411: "Content-Length required",
    412: "precondition failed", 413: "too large",
    416: "range not satisfiable", 422: "invalid manifest or parameters",
    424: "a named blob is not stored", 429: "rate limited (Retry-After)",
    431: "headers too large", 503: "storage unavailable", 507: "store full or a quota reached",
}


def error_body(status: int, code: str, message: str, **detail: Any) -> dict[str, Any]:
    """The JSON body of an error response, also for answers given before any route runs."""
    return {"error": {"status": status, "code": code, "message": message, **detail}}


class ApiError(Exception):
    status: int = 500
    code: str = "internal"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        **detail: Any,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        if code is not None:
            self.code = code
        self.detail = detail

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.code, self.message, **self.detail)


class BadRequest(ApiError):
    status, code = 400, "bad_request"


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"


class Forbidden(ApiError):
    status, code = 403, "forbidden"


class NotFound(ApiError):
    status, code = 404, "not_found"


class RequestTimeout(ApiError):
    status, code = 408, "request_timeout"


class Conflict(ApiError):
    status, code = 409, "conflict"


class LengthRequired(ApiError):
    status, code = 411, "length_required"


class PreconditionFailed(ApiError):
    status, code = 412, "precondition_failed"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class RangeNotSatisfiable(ApiError):
    status, code = 416, "range_not_satisfiable"


class Unprocessable(ApiError):
    status, code = 422, "unprocessable"

    @classmethod
    def parsed(cls, model: type[T], body: bytes, what: str, code: str) -> T:
        """`body` as `model` (the wire contract's strict JSON), or this error naming `what`
        and carrying the schema's findings: what every intake of a client's body says."""
        try:
            return parse_json(model, body)
        except SchemaError as exc:
            raise cls(f"{what} does not match the schema", code=code,
                      errors=exc.errors) from None


class FailedDependency(ApiError):
    """A manifest names a blob the store does not hold: refused, never a dangling entry."""

    status, code = 424, "missing_blobs"


class TooManyRequests(ApiError):
    status, code = 429, "rate_limited"


class ServiceUnavailable(ApiError):
    status, code = 503, "unavailable"


class InsufficientStorage(ApiError):
    status, code = 507, "insufficient_storage"
