"""The session-state store (``/sessions/{id}/state``) on its own, without a model: what is kept,
for how long, how much, and the answers of its three routes."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagedserve.server import session_state
from pagedserve.server.errors import APIError, install_error_handlers
from pagedserve.server.session_state import SessionStore, session_router


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(session_state.time, "monotonic", clock)
    return clock


def test_the_defaults_are_1024_sessions_of_256_kib_for_an_hour():
    store = SessionStore()
    assert (store.max_sessions, store.max_bytes, store.ttl_s) == (1024, 256 * 1024, 3600.0)


def test_a_state_put_is_read_back_and_a_missing_one_is_none():
    store = SessionStore()
    store.put("a", {"x": [1, 2], "y": "z"})
    assert store.get("a") == {"x": [1, 2], "y": "z"}
    assert store.get("b") is None


def test_a_put_replaces_the_state():
    store = SessionStore()
    store.put("a", {"x": 1})
    store.put("a", {"y": 2})
    assert store.get("a") == {"y": 2}


def test_delete_says_whether_there_was_a_state():
    store = SessionStore()
    store.put("a", {})
    assert store.delete("a") is True
    assert store.get("a") is None
    assert store.delete("a") is False


def test_a_state_expires_after_ttl_s_untouched_and_not_before(clock):
    store = SessionStore(ttl_s=10)
    store.put("a", {"x": 1})
    store.put("b", {"x": 2})
    clock.now += 10  # exactly the ttl: still kept
    assert store.get("a") == {"x": 1}  # and touched now
    clock.now += 5
    assert store.get("b") is None  # 15 s untouched
    assert store.get("a") == {"x": 1}  # 5 s since it was read
    clock.now += 10.5
    assert store.get("a") is None
    assert len(store.sessions) == 0


def test_expiry_stops_at_the_first_session_still_fresh(clock):
    store = SessionStore(ttl_s=10)
    store.put("old", {})
    clock.now += 8
    store.put("new", {})
    clock.now += 5  # old: 13 s, new: 5 s
    store.put("other", {})
    assert list(store.sessions) == ["new", "other"]


def test_a_put_expires_the_stale_sessions_first(clock):
    store = SessionStore(max_sessions=2, ttl_s=10)
    store.put("a", {})
    store.put("b", {})
    clock.now += 11
    store.put("c", {})
    assert list(store.sessions) == ["c"]


def test_past_max_sessions_the_least_recently_used_goes(clock):
    store = SessionStore(max_sessions=2)
    store.put("a", {"n": 1})
    store.put("b", {"n": 2})
    assert store.get("a") == {"n": 1}  # b is now the least recently used
    store.put("c", {"n": 3})
    assert store.get("b") is None
    assert store.get("a") == {"n": 1} and store.get("c") == {"n": 3}
    store.put("c", {"n": 4})  # a put touches too
    store.put("d", {"n": 5})
    assert list(store.sessions) == ["c", "d"]


def test_max_sessions_states_are_all_kept():
    store = SessionStore(max_sessions=3)
    for sid in "abc":
        store.put(sid, {})
    assert list(store.sessions) == ["a", "b", "c"]


def test_a_state_of_max_bytes_is_kept_and_one_byte_more_is_refused():
    store = SessionStore(max_bytes=12)
    store.put("a", {"x": "123"})  # '{"x": "123"}' is 12 bytes
    assert store.get("a") == {"x": "123"}
    with pytest.raises(APIError) as e:
        store.put("a", {"x": "1234"})
    assert (e.value.status, e.value.param) == (400, "state")
    assert e.value.message == (
        "the session state is 13 bytes of JSON; this server keeps at most 12; keep less in s.state"
    )
    assert store.get("a") == {"x": "123"}  # the old state stays


# ---- the routes ---------------------------------------------------------------------------------
@pytest.fixture
def client():
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(session_router(SessionStore(max_bytes=64)))
    with TestClient(app) as c:
        yield c


def test_put_get_delete_round_trip(client):
    r = client.put("/sessions/s-1.a:b_c/state", json={"k": [1, "two"]})
    assert r.status_code == 200 and r.json() == {"session_id": "s-1.a:b_c", "saved": True}
    r = client.get("/sessions/s-1.a:b_c/state")
    assert r.status_code == 200 and r.json() == {"k": [1, "two"]}
    r = client.delete("/sessions/s-1.a:b_c/state")
    assert r.status_code == 204 and r.content == b""
    r = client.get("/sessions/s-1.a:b_c/state")
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "no state for session 's-1.a:b_c' (new, deleted or expired)",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_deleting_a_missing_state_is_a_404(client):
    r = client.delete("/sessions/nobody/state")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "no state for session 'nobody'"


@pytest.mark.parametrize(
    "body", [b"[1, 2]", b'"text"', b"12", b"not json", b"[" * 5000 + b"]" * 5000]
)
def test_a_state_that_is_not_a_json_object_is_a_400(client, body):
    r = client.put("/sessions/s/state", content=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["param"], error["message"]) == (
        "state",
        "the session state must be a JSON object",
    )


def test_a_state_too_big_is_a_400_naming_state(client):
    r = client.put("/sessions/s/state", json={"x": "y" * 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "state"
    assert client.get("/sessions/s/state").status_code == 404


@pytest.mark.parametrize("sid", ["a" * 129, "a b", "é", "a!", "a%0A"])
@pytest.mark.parametrize("method", ["get", "put", "delete"])
def test_a_session_id_outside_the_alphabet_is_a_400(client, sid, method):
    kwargs = {"json": {}} if method == "put" else {}
    r = getattr(client, method)(f"/sessions/{sid}/state", **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "session_id"
    assert error["message"] == "session_id must be 1-128 characters of letters, digits and _ . : -"


def test_a_session_id_of_128_characters_is_accepted(client):
    sid = "Z9" * 64
    assert client.put(f"/sessions/{sid}/state", json={"a": 1}).status_code == 200
    assert client.get(f"/sessions/{sid}/state").json() == {"a": 1}
