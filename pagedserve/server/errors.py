"""OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}`` and the handlers that
make every invalid input a 400 (never FastAPI's 422, never a 500)."""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# OpenAI's error types: a client's error below 500, the server's from 500 on, but for these
ERROR_TYPES = {401: "authentication_error"}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    etype = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    info = ErrorInfo(message=message, type=etype, param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def error_response(exc: APIError) -> JSONResponse:
    body = error_body(exc.status, exc.message, exc.param, exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


# pydantic's error types -> what the value must be, in the words of our own checks
_RULES = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "finite_number": "must be a finite number",
    "too_long": "must have at most {max_length} items",
}
# ... and the types OpenAI's API holds a value to (strict: no "0.5" for a number, no 2.0 for an
# integer), said after the ranges: of a union's errors, a range error says more
_TYPES = {
    "float_type": "must be a number (a JSON number, not a string)",
    "int_type": "must be an integer (a JSON number without a fractional part)",
    "int_from_float": "must be an integer (a JSON number without a fractional part)",
    "bool_type": "must be true or false",
}
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|constrained-\w+|[\w-]+\[.*\]|[A-Z]\w*)$")
FASTAPI_BODY_ERROR = "There was an error parsing the body"  # FastAPI's words for it
MAX_SHOWN = 80  # characters of a bad value quoted back in a message


def validation_error(errors: list[dict]) -> APIError:
    """A 400 naming the field and what it must be, from pydantic's errors. Of the errors a union
    field gives (one per type it could be), a range error says most: it goes first."""
    if not errors:
        return APIError(400, "invalid request")
    first = min(errors, key=lambda e: (e.get("type") not in _RULES, e.get("type") not in _TYPES))
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}")
    param = _param(first.get("loc", ()))
    shown = _shown(first.get("input"))
    rule = _RULES.get(first.get("type")) or _TYPES.get(first.get("type"))
    if param and rule:
        return APIError(
            400, f"{param}={shown} {rule.format(**_numbers(first.get('ctx', {})))}", param
        )
    if param and first.get("type") == "value_error":  # our own validator's words
        return APIError(400, f"{param}={shown}: {first['ctx']['error']}", param)
    where = f"field '{param}'" if param else "the request body"
    return APIError(400, f"{where}: {first.get('msg')} (got {shown})", param)


def _param(loc: tuple) -> str | None:
    """``('body', 'prompt', 'list[constrained-int]', 3)`` -> ``prompt.3``: the field's path
    without pydantic's union tags."""
    parts = [str(p) for p in loc if p != "body" and not _UNION_TAG.match(str(p))]
    return ".".join(parts) or None


def _numbers(ctx: dict) -> dict:
    """Limits as written: 2147483647 in full, 0.0 as 0."""
    return {k: f"{v:g}" if isinstance(v, float) else v for k, v in ctx.items()}


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}... ({len(text)} characters)"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        if exc.status_code == 400 and message == FASTAPI_BODY_ERROR:  # bytes JSON cannot decode
            message = "the request body is not valid JSON: send a JSON object in UTF-8"
        return error_response(APIError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error: %s", exc)
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}"))
