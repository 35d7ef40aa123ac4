"""OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}`` and the handlers that
make every invalid input a 400 (never FastAPI's 422, never a 500)."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


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


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    param = ".".join(loc) or None
    where = f"field '{param}'" if param else "the request body"
    return f"{where}: {first.get('msg')} (got {first.get('input')!r})", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(APIError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error: %s", exc)
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}"))
