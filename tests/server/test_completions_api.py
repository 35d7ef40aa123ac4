"""``POST /v1/completions`` in this process on the demo model (FastAPI's TestClient, no socket):
the response's shape and usage, echo, logprobs and their text offsets, several prompts and
choices, streaming (its chunks add up to the whole answer, its usage chunk), and the 4xx/5xx a
request can get. test_server.py checks the same endpoint over HTTP against the openai client and
the HF model; this file is fast enough for mutation testing of completions.py."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.server.completions import _completion_stream
from pagedserve.server.protocol import CompletionRequest
from tests.helpers.apps import AUTH, demo_engine, served

SEEDED = {"temperature": 1.0, "seed": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    return demo_engine()


def complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"max_tokens": 4, **body}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, **body) -> list:
    """The events of a streamed completion: each chunk's JSON, then the text ``[DONE]``."""
    with client.stream(
        "POST", "/v1/completions", json={"max_tokens": 4, **body, "stream": True}, headers=AUTH
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def tokenize(client, text: str) -> list[int]:
    return client.post("/tokenize", json={"prompt": text}, headers=AUTH).json()["tokens"]


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---- the whole answer ---------------------------------------------------------------------------
def test_a_completion_has_openais_shape_and_counts_its_tokens(client):
    out = complete(client, prompt="Hello", **SEEDED)
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert out["model"] == "demo" and isinstance(out["created"], int)
    (choice,) = out["choices"]
    assert (choice["index"], choice["finish_reason"], choice["logprobs"]) == (0, "length", None)
    assert choice["stop_reason"] is None and choice["text"]
    prompt_tokens = len(tokenize(client, "Hello"))
    assert out["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 4,
        "total_tokens": prompt_tokens + 4,
    }


def test_the_same_seed_gives_the_same_text(client):
    a = complete(client, prompt="Hello", **SEEDED)["choices"][0]["text"]
    b = complete(client, prompt="Hello", **SEEDED)["choices"][0]["text"]
    assert a == b


def test_echo_puts_the_prompt_before_the_completion(client):
    plain = complete(client, prompt="Hello", **SEEDED)["choices"][0]["text"]
    echoed = complete(client, prompt="Hello", echo=True, **SEEDED)["choices"][0]["text"]
    assert echoed == "Hello" + plain
    ids = tokenize(client, "Hello")
    by_ids = complete(client, prompt=ids, echo=True, **SEEDED)["choices"][0]["text"]
    assert by_ids.endswith("Hello" + plain)  # the decoded prompt, its special prefix included


def test_several_prompts_and_choices_are_numbered_prompt_by_prompt(client):
    out = complete(client, prompt=["Hello", "The quick"], n=2, **SEEDED)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    first = complete(client, prompt="The quick", n=2, **SEEDED)["choices"]
    assert [c["text"] for c in out["choices"][2:]] == [c["text"] for c in first]
    prompt_tokens = len(tokenize(client, "Hello")) + len(tokenize(client, "The quick"))
    assert out["usage"]["prompt_tokens"] == prompt_tokens
    assert out["usage"]["completion_tokens"] == 16


def test_concurrent_completions_each_get_their_own_answer(client):
    answers = {}

    def ask(name: str) -> None:
        body = {"prompt": "Hello", "max_tokens": 32, **SEEDED}
        answers[name] = client.post("/v1/completions", json=body, headers=AUTH)

    threads = [threading.Thread(target=ask, args=(name,)) for name in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in answers.values()), [r.text for r in answers.values()]
    assert len({r.json()["id"] for r in answers.values()}) == 3
    assert len({r.json()["choices"][0]["text"] for r in answers.values()}) == 1  # the same seed


def test_logit_bias_steers_toward_any_token_of_the_vocabulary(client):
    token = max(tokenize(client, "Hello world, the quick brown fox"))  # not a special token
    out = complete(client, prompt="Hello", logit_bias={str(token): 100}, max_tokens=3)
    shown = client.post("/detokenize", json={"tokens": [token] * 3}, headers=AUTH).json()
    assert out["choices"][0]["text"] == shown["prompt"]
    vocab_size = client.app.state.serving.vocab_size
    r = client.post(
        "/v1/completions", json={"prompt": "Hi", "logit_bias": {str(vocab_size): 1}}, headers=AUTH
    )
    error = error_of(r, 400)
    assert error["param"] == "logit_bias"
    assert (
        error["message"] == f"logit_bias key '{vocab_size}' is not a token id in [0, {vocab_size})"
    )


def test_logprobs_over_the_servers_max_logprobs_are_a_400_naming_it(engine):
    with served(engine, started=False, max_logprobs=2) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "logprobs": 3}, headers=AUTH)
    error = error_of(r, 400)
    assert (error["param"], error["message"]) == (
        "logprobs",
        "logprobs=3 must be in [0, 2] (this server's --max-logprobs)",
    )


def test_a_stop_string_ends_the_text_and_is_the_stop_reason(client):
    text = complete(client, prompt="Hello", max_tokens=8, **SEEDED)["choices"][0]["text"]
    stop = text[2:4]
    (choice,) = complete(client, prompt="Hello", max_tokens=8, stop=[stop], **SEEDED)["choices"]
    assert choice["text"] == text[: text.index(stop)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)


# ---- logprobs -----------------------------------------------------------------------------------
def test_logprobs_give_each_tokens_text_logprob_top_n_and_offset(client):
    (choice,) = complete(client, prompt="Hello", logprobs=2, **SEEDED)["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert "".join(lp["tokens"]) == choice["text"]
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"])
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top.get(token, value) >= value - 1e-6 and max(top.values()) >= value - 1e-6
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert [choice["text"][a:b] for a, b in zip(offsets, offsets[1:])] == lp["tokens"][:-1]


def test_zero_logprobs_give_the_chosen_tokens_only(client):
    (choice,) = complete(client, prompt="Hello", logprobs=0, **SEEDED)["choices"]
    assert all(top == {} for top in choice["logprobs"]["top_logprobs"])
    assert len(choice["logprobs"]["token_logprobs"]) == 4


def test_echoed_logprobs_cover_the_prompt_first(client):
    ids = tokenize(client, "Hello")
    (choice,) = complete(client, prompt="Hello", echo=True, logprobs=1, **SEEDED)["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:])
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[-4] >= len("Hello") - 1
    assert offsets[len(ids)] == len("Hello")  # the completion's first token starts after it
    tail = "".join(lp["tokens"][len(ids) :])
    assert choice["text"] == "Hello" + tail
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])  # the most likely one each


def test_offsets_stop_at_a_stop_string(client):
    text = complete(client, prompt="Hello", max_tokens=8, **SEEDED)["choices"][0]["text"]
    stop = text[3:5]
    (choice,) = complete(client, prompt="Hello", max_tokens=8, stop=[stop], logprobs=0, **SEEDED)[
        "choices"
    ]
    assert max(choice["logprobs"]["text_offset"]) <= len(choice["text"])


# ---- streaming ----------------------------------------------------------------------------------
def test_a_stream_adds_up_to_the_whole_answer_and_ends_with_done(client):
    whole = complete(client, prompt="Hello", **SEEDED)["choices"][0]
    events = stream(client, prompt="Hello", **SEEDED)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" and c["model"] == "demo" for c in chunks)
    assert all(c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_a_stream_with_include_usage_ends_with_a_usage_chunk(client):
    events = stream(
        client, prompt=["Hello", "The"], n=2, stream_options={"include_usage": True}, **SEEDED
    )
    *chunks, usage, done = events
    assert done == "[DONE]" and usage["choices"] == []
    prompt_tokens = len(tokenize(client, "Hello")) + len(tokenize(client, "The"))
    assert usage["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 16,
        "total_tokens": prompt_tokens + 16,
    }
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2, 3]


def test_a_stream_without_include_usage_has_no_usage_chunk(client):
    events = stream(client, prompt="Hello", stream_options={"include_usage": False}, **SEEDED)
    assert all(e == "[DONE]" or e["choices"] for e in events)


def test_each_streamed_choice_adds_up_to_its_whole_text(client):
    greedy = {"temperature": 0, "ignore_eos": True}  # n > 1 draws differ from run to run
    whole = complete(client, prompt=["Hello", "The"], n=2, **greedy)["choices"]
    chunks = stream(client, prompt=["Hello", "The"], n=2, **greedy)[:-1]
    texts = {}
    for c in chunks:
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in whole}


def test_a_streamed_echo_sends_the_prompt_first(client):
    chunks = stream(client, prompt="Hello", echo=True, **SEEDED)[:-1]
    assert chunks[0]["choices"][0]["text"] == "Hello"
    assert chunks[0]["choices"][0]["finish_reason"] is None
    whole = complete(client, prompt="Hello", echo=True, **SEEDED)["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole


def test_streamed_logprobs_cover_each_chunks_tokens_and_offsets_go_on(client):
    whole = complete(client, prompt="Hello", logprobs=1, **SEEDED)["choices"][0]["logprobs"]
    chunks = stream(client, prompt="Hello", logprobs=1, **SEEDED)[:-1]
    tokens, offsets, values = [], [], []
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        assert "".join(lp["tokens"]) == c["choices"][0]["text"]
        tokens += lp["tokens"]
        offsets += lp["text_offset"]
        values += lp["token_logprobs"]
    assert (tokens, offsets) == (whole["tokens"], whole["text_offset"])
    assert values == pytest.approx(whole["token_logprobs"])
    tops = [top for c in chunks for top in c["choices"][0]["logprobs"]["top_logprobs"]]
    assert tops == whole["top_logprobs"] and all(len(top) == 1 for top in tops)


def test_a_streamed_stop_string_is_the_last_chunks_stop_reason_and_caps_its_offsets(client):
    text = complete(client, prompt="Hello", max_tokens=8, **SEEDED)["choices"][0]["text"]
    stop = text[3:5]
    body = {"prompt": "Hello", "max_tokens": 8, "stop": [stop], "logprobs": 0, **SEEDED}
    whole = complete(client, **body)["choices"][0]
    chunks = stream(client, **body)[:-1]
    last = chunks[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-1])
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]
    assert max(offsets) <= len(whole["text"])


# ---- the errors -----------------------------------------------------------------------------------
def test_another_model_is_a_404(client):
    r = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "Hi"}, headers=AUTH)
    assert error_of(r, 404)["code"] == "model_not_found"


def test_echo_with_logprobs_cannot_stream(client):
    r = client.post(
        "/v1/completions",
        json={"prompt": "Hi", "echo": True, "logprobs": 1, "stream": True},
        headers=AUTH,
    )
    error = error_of(r, 400)
    assert (error["param"], error["message"]) == (
        "echo",
        "echo with logprobs is not supported when streaming",
    )
    for body in ({"echo": True, "stream": True}, {"echo": True, "logprobs": 1}):
        r = client.post("/v1/completions", json={"prompt": "Hi", **body}, headers=AUTH)
        assert r.status_code == 200, r.text


def test_a_prompt_longer_than_the_context_is_a_400(client):
    r = client.post("/v1/completions", json={"prompt": "a " * 200}, headers=AUTH)
    error = error_of(r, 400)
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")


def test_a_bad_structured_output_is_a_400_before_anything_runs(client):
    r = client.post("/v1/completions", json={"prompt": "Hi", "guided_regex": "("}, headers=AUTH)
    assert error_of(r, 400)["param"] == "guided_regex"


def test_a_structured_output_holds_the_completion(client):
    out = complete(client, prompt="Hi", guided_choice=["yes", "no"], max_tokens=8)
    assert out["choices"][0]["text"] in ("yes", "no")


def test_bad_sampling_values_are_a_400_naming_the_field(client):
    r = client.post("/v1/completions", json={"prompt": "Hi", "n": 5}, headers=AUTH)
    assert error_of(r, 400)["param"] == "n"  # more than --max-num-seqs 4


def test_a_dead_engine_is_a_503(engine):
    with served(engine, started=False) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi"}, headers=AUTH)
    assert error_of(r, 503)["code"] == "engine_dead"


# ---- the stream, from a stand-in engine's outputs -------------------------------------------------
def outputs(*steps) -> RequestOutput:
    """One output of a request of two sequences: each step (text, token ids, finish reason)."""
    choices = [
        CompletionOutput(i, text, list(ids), finish_reason=reason)
        for i, (text, ids, reason) in enumerate(steps)
    ]
    return RequestOutput("r-0", "Hello", [1, 2], choices, finished=all(c[2] for c in steps))


def streamed(client, outs: list[RequestOutput], **body) -> list[dict]:
    """The choices of the chunks ``_completion_stream`` makes of ``outs``, one list a chunk."""

    async def engine_outputs():
        for out in outs:
            yield out

    async def chunks():
        request = CompletionRequest(prompt="Hello", n=2, **body)
        prompts = [("Hello", [1, 2])]
        stream = _completion_stream(
            client.app.state.serving, request, "cmpl-1", prompts, [engine_outputs()]
        )
        return [json.loads(c.removeprefix("data: "))["choices"] async for c in stream]

    return asyncio.run(chunks())


def test_each_output_sends_what_it_adds_to_each_choice_as_it_comes(client):
    choices = streamed(
        client,
        [
            outputs(("He", [5], None), ("Wo", [7], None)),
            outputs(("Hell", [5, 6], None), ("Wor", [7, 8], None)),
        ],
    )
    assert [[(c["index"], c["text"]) for c in chunk] for chunk in choices] == [
        [(0, "He")],
        [(1, "Wo")],
        [(0, "ll")],
        [(1, "r")],
    ]


def test_a_choice_an_output_adds_nothing_to_sends_nothing_and_the_others_go_on(client):
    choices = streamed(
        client,
        [
            outputs(("He", [5], None), ("Wo", [7], None)),
            outputs(("He", [5], None), ("Wor", [7, 8], None)),
        ],
    )
    assert [(c["index"], c["text"]) for chunk in choices for c in chunk] == [
        (0, "He"),
        (1, "Wo"),
        (1, "r"),
    ]


def test_a_token_whose_text_is_held_back_is_still_sent_as_it_comes(client):
    # vLLM's stream too sends a chunk for new tokens that add no text yet (a stop string's
    # prefix, part of a character): its logprobs, and a token count that is up to date
    choices = streamed(
        client,
        [
            outputs(("He", [5], None), ("Wo", [7], None)),
            outputs(("He", [5, 6], None), ("Wo", [7, 8], None)),
        ],
    )
    assert [(c["index"], c["text"]) for chunk in choices for c in chunk] == [
        (0, "He"),
        (1, "Wo"),
        (0, ""),
        (1, ""),
    ]


def test_a_finished_choice_sends_its_end_once_while_the_others_go_on(client):
    choices = streamed(
        client,
        [
            outputs(("He", [5], "stop"), ("Wo", [7], None)),
            outputs(("He", [5], "stop"), ("Wor", [7, 8], None)),
            outputs(("He", [5], "stop"), ("Worl", [7, 8, 9], "length")),
        ],
    )
    sent = [(c["index"], c["text"], c["finish_reason"]) for chunk in choices for c in chunk]
    assert sent == [(0, "He", "stop"), (1, "Wo", None), (1, "r", None), (1, "l", "length")]
