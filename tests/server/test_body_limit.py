"""``--max-request-body`` (body_limit.py) as an ASGI middleware on its own, driven message by
message: a body announced too large is a 413 before the app sees it, a chunked one as soon as
its bytes pass the limit, and a body within the limit reaches the app untouched."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedserve.server.body_limit import DEFAULT_MAX_REQUEST_BODY, BodySizeLimit, BodyTooLarge

LIMIT = 10


class App:
    """An ASGI app that reads the whole body, then answers 200 with it (or as ``mode`` says)."""

    def __init__(self, mode: str = "echo"):
        self.mode, self.calls, self.body = mode, 0, b""

    async def __call__(self, scope, receive, send):
        self.calls += 1
        if scope["type"] != "http":  # lifespan: read one event, answer it
            self.body = (await receive())["body"]
            await send({"type": "lifespan.startup.complete"})
            return
        if self.mode == "start-first":
            await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            while True:
                message = await receive()
                self.body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        except BodyTooLarge:
            if self.mode == "swallow":  # as an app's catch-all error handler would
                await send({"type": "http.response.start", "status": 500, "headers": []})
                await send({"type": "http.response.body", "body": b"oops"})
                return
            raise
        if self.mode == "fail":
            raise RuntimeError("the app's own error")
        if self.mode != "start-first":
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": self.body})


def call(app, chunks: list[bytes], headers: dict | None = None, scope_type: str = "http"):
    """Run the middleware over ``app`` for a request of ``chunks``: (the messages sent, how many
    body messages were read)."""
    middleware = BodySizeLimit(app, max_bytes=LIMIT)
    scope = {
        "type": scope_type,
        "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    queue = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    read = []
    sent = []

    async def receive():
        read.append(1)
        return queue.pop(0)

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    return sent, len(read)


def assert_413(sent, size: str):
    start, body = sent
    assert start["type"] == "http.response.start" and start["status"] == 413
    data = body["body"]
    assert body["type"] == "http.response.body"
    assert dict(start["headers"]) == {
        b"content-type": b"application/json",
        b"connection": b"close",
        b"content-length": str(len(data)).encode(),
    }
    assert json.loads(data) == {
        "error": {
            "message": f"the request body is {size} bytes; this server takes at most {LIMIT} "
            "(--max-request-body)",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        }
    }


def test_the_default_limit_is_8_mib():
    assert DEFAULT_MAX_REQUEST_BODY == 8 * 2**20
    assert BodySizeLimit(App()).max_bytes == DEFAULT_MAX_REQUEST_BODY


def test_a_body_within_the_limit_reaches_the_app_whole():
    app = App()
    sent, _ = call(app, [b"12345", b"67890"], {"content-length": "10"})
    assert app.body == b"1234567890"
    assert [m.get("status") for m in sent] == [200, None] and sent[1]["body"] == b"1234567890"


def test_an_announced_length_over_the_limit_is_a_413_before_a_byte_is_read():
    app = App()
    sent, read = call(app, [b"x" * 11], {"content-length": "11"})
    assert_413(sent, "11")
    assert app.calls == 0 and read == 0


def test_a_length_that_is_not_a_number_is_a_413():
    app = App()
    sent, read = call(app, [b"x"], {"content-length": "1e3"})
    assert_413(sent, "1e3")
    assert app.calls == 0 and read == 0


def test_a_chunked_body_past_the_limit_is_a_413_and_the_rest_is_not_read():
    app = App()
    sent, read = call(app, [b"x" * 6, b"x" * 6, b"x" * 6])
    assert_413(sent, "more than 12")
    assert read == 2


def test_a_chunked_body_of_exactly_the_limit_is_served():
    app = App()
    sent, _ = call(app, [b"x" * 4, b"x" * 6])
    assert sent[0]["status"] == 200 and app.body == b"x" * 10


def test_a_length_that_lies_is_caught_by_the_bytes_counted():
    app = App()
    sent, _ = call(app, [b"x" * 8, b"x" * 8], {"content-length": "5"})
    assert_413(sent, "more than 16")


def test_the_apps_own_answer_to_a_body_too_large_is_replaced_by_the_413():
    app = App("swallow")
    sent, _ = call(app, [b"x" * 20])
    assert_413(sent, "more than 20")


def test_an_answer_already_started_is_left_alone():
    app = App("start-first")
    sent, _ = call(app, [b"x" * 6, b"x" * 6])
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert sent[0]["status"] == 200


def test_the_apps_own_errors_are_not_hidden():
    with pytest.raises(RuntimeError, match="the app's own error"):
        call(App("fail"), [b"ok"])


def test_messages_without_a_body_count_nothing():
    app = App()
    middleware = BodySizeLimit(app, max_bytes=0)
    queue = [{"type": "http.request", "more_body": True}, {"type": "http.request"}]
    sent = []

    async def receive():
        return queue.pop(0)

    async def send(message):
        sent.append(message)

    asyncio.run(middleware({"type": "http", "headers": []}, receive, send))
    assert sent[0]["status"] == 200


def test_other_scopes_pass_through_untouched():
    app = App()
    sent, read = call(app, [b"x" * 50], {"content-length": "50"}, scope_type="lifespan")
    assert app.calls == 1 and read == 1 and app.body == b"x" * 50
    assert sent == [{"type": "lifespan.startup.complete"}]
