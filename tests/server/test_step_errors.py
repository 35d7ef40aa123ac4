"""A forward pass that raises for another cause than a device fault is a bug, and its requests are
not served as if they were: the server answers exactly the requests of the failing step with a 500
in OpenAI's error shape naming the cause (a stream: an error event, then the end), logs the
traceback once, counts it in /metrics, and goes on serving the others."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from tests.helpers.apps import AUTH, demo_engine, served

MARKER = 4000  # a prompt token whose prefill step is made to raise
BOOM = RuntimeError("an index out of range in a kernel")


@pytest.fixture(scope="module")
def engine():
    engine = demo_engine()
    yield engine
    engine.shutdown()


@pytest.fixture
def failing(engine, monkeypatch):
    """Every forward pass whose batch holds MARKER raises BOOM; the prompts of the requests each
    failed step ended, as the engine saw them."""
    model, forward = engine.model, engine.model.forward
    failed_steps: list[list[list[int]]] = []
    fail_step = engine.fault_recovery.fail_step

    def forward_or_raise(input_ids, *args):
        if (input_ids == MARKER).any():
            raise BOOM
        return forward(input_ids, *args)

    def spied(sched, error, abort):
        failed_steps.append([list(s.request.prompt_token_ids) for s in sched.scheduled])
        return fail_step(sched, error, abort)

    monkeypatch.setattr(model, "forward", forward_or_raise)
    monkeypatch.setattr(engine.fault_recovery, "fail_step", spied)
    return failed_steps


def _complete(client, prompt: list[int], stream: bool) -> tuple[int, str]:
    body = {"model": "demo", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": stream}
    r = client.post("/v1/completions", json=body, headers=AUTH)
    return r.status_code, r.text


def _metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def test_a_failing_forward_pass_answers_its_steps_requests_500_and_serves_on(
    engine, failing, caplog
):
    prompts = [[MARKER, 17, 18], [21, 22, 23, 24], [MARKER, 30], [41, 42], [51, 52, 53]]
    streams = [False, False, True, True, False]
    answers: dict[int, tuple[int, str]] = {}
    with served(engine) as client, caplog.at_level(logging.ERROR):
        before = _metric(client, "pagedserve:engine_step_errors_total")

        def ask(i: int) -> None:
            answers[i] = _complete(client, prompts[i], streams[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        after = _metric(client, "pagedserve:engine_step_errors_total")
        again = _complete(client, [61, 62, 63], stream=False)  # the engine serves on

    in_failed = [p for step in failing for p in step]
    assert failing and all(any(MARKER in p for p in step) for step in failing)
    for i, prompt in enumerate(prompts):
        status, text = answers[i]
        if prompt not in in_failed:  # served, whole
            assert status == 200, text
            assert "error" not in text
            continue
        if streams[i]:  # an error event, then the end of the stream
            events = [e for e in text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))["error"]
        else:
            assert status == 500, text
            error = json.loads(text)["error"]
        assert error["type"] == "server_error"
        assert repr(BOOM) in error["message"] and "a bug in pagedserve" in error["message"]
    assert after - before == len(failing)
    assert again[0] == 200
    tracebacks = [r for r in caplog.records if r.exc_info and r.exc_info[1] is BOOM]
    assert len(tracebacks) == len(failing)  # once per failed step, by the engine alone
    assert engine.check_invariants() == [] and engine.block_manager.usage == 0.0
