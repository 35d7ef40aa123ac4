"""Program state that outlives a client process: ``pagedserve.lang`` keeps ``s.state`` here when a
program runs with a ``session_id``.

``GET /sessions/{id}/state`` reads it (404 if none), ``PUT`` replaces it with a JSON object,
``DELETE`` frees it. Bounded: at most ``max_sessions`` sessions (the least recently used goes
first), ``max_bytes`` of JSON each, and a session nobody touched for ``ttl_s`` seconds expires.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedserve.server.errors import APIError, bad_request

MAX_SESSIONS = 1024
MAX_BYTES = 256 * 1024
TTL_S = 3600.0
_SESSION_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


class SessionStore:
    def __init__(
        self, max_sessions: int = MAX_SESSIONS, max_bytes: int = MAX_BYTES, ttl_s: float = TTL_S
    ):
        self.max_sessions, self.max_bytes, self.ttl_s = max_sessions, max_bytes, ttl_s
        self.sessions: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (time, JSON)

    def _expire(self) -> None:
        now = time.monotonic()
        while self.sessions:
            sid, (touched, _) = next(iter(self.sessions.items()))
            if now - touched <= self.ttl_s:
                break
            del self.sessions[sid]

    def get(self, session_id: str) -> dict[str, Any] | None:
        self._expire()
        entry = self.sessions.get(session_id)
        if entry is None:
            return None
        self.sessions[session_id] = (time.monotonic(), entry[1])
        self.sessions.move_to_end(session_id)
        return json.loads(entry[1])

    def put(self, session_id: str, state: dict[str, Any]) -> None:
        self._expire()
        data = json.dumps(state)
        if len(data) > self.max_bytes:
            raise bad_request(
                f"the session state is {len(data)} bytes of JSON; this server keeps at most "
                f"{self.max_bytes}; keep less in s.state",
                "state",
            )
        self.sessions[session_id] = (time.monotonic(), data)
        self.sessions.move_to_end(session_id)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)

    def delete(self, session_id: str) -> bool:
        return self.sessions.pop(session_id, None) is not None


def _check_id(session_id: str) -> None:
    if not _SESSION_ID.fullmatch(session_id):
        raise bad_request(
            "session_id must be 1-128 characters of letters, digits and _ . : -", "session_id"
        )


def session_router(store: SessionStore) -> APIRouter:
    router = APIRouter()

    @router.get("/sessions/{session_id}/state")
    async def get_state(session_id: str) -> dict:
        _check_id(session_id)
        state = store.get(session_id)
        if state is None:
            raise APIError(404, f"no state for session {session_id!r} (new, deleted or expired)")
        return state

    @router.put("/sessions/{session_id}/state")
    async def put_state(session_id: str, request: Request) -> dict:
        _check_id(session_id)
        try:
            state = await request.json()
        except (ValueError, RecursionError) as e:  # not JSON, or nested past what Python parses
            raise bad_request("the session state must be a JSON object", "state") from e
        if not isinstance(state, dict):
            raise bad_request("the session state must be a JSON object", "state")
        store.put(session_id, state)
        return {"session_id": session_id, "saved": True}

    @router.delete("/sessions/{session_id}/state")
    async def delete_state(session_id: str) -> Response:
        _check_id(session_id)
        if not store.delete(session_id):
            raise APIError(404, f"no state for session {session_id!r}")
        return Response(status_code=204)

    return router
