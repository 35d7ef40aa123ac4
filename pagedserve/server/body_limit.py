"""``--max-request-body``: a request body over the limit is a 413, decided from its
``Content-Length`` before a byte of it is read, or (a chunked body, which announces no length) as
soon as the bytes received pass the limit. The server never holds more than the limit of a body.

A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` would read the body into memory first.
"""

from __future__ import annotations

import json

from pagedserve.server.errors import error_body

DEFAULT_MAX_REQUEST_BODY = 8 * 2**20


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_REQUEST_BODY):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self.reject(send, length.decode("latin-1"))
        received, too_large, started = 0, False, False

        async def limited_receive():
            nonlocal received, too_large
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                too_large = True
                raise BodyTooLarge
            return message

        async def send_unless_too_large(message) -> None:
            nonlocal started
            if too_large:  # the app's answer to a body it could not finish reading: ours instead
                return
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, send_unless_too_large)
        except Exception:
            if not too_large:
                raise
        if too_large and not started:
            await self.reject(send, f"more than {received}")

    async def reject(self, send, size: str) -> None:
        status = 413
        body = error_body(
            status,
            f"the request body is {size} bytes; this server takes at most {self.max_bytes} "
            f"(--max-request-body)",
            code="request_too_large",
        )
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        headers.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
