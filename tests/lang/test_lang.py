"""pagedserve.lang against a live demo-model server: the echo agent of the Kunlun XPU deployment guide keeps its state across
calls (and across client processes with a session_id), forks share the parent's prefix pages,
select follows the logprobs, errors stay on the state, streaming and batches."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest

from pagedserve.lang import (
    Runtime,
    ToolCall,
    assistant,
    declare_tools,
    function,
    gen,
    run_batch,
    select,
    set_default_backend,
    system,
    tool,
    user,
)


@pytest.fixture(scope="module", autouse=True)
def default_backend(demo_thread_server):
    """The demo model's thread server (conftest) is the default backend of the programs here."""
    set_default_backend(Runtime(demo_thread_server[0]))


@function
def echo_agent(s):
    s.state["history"] = s.state.get("history", [])
    s.state["history"].append(s.text)
    s += gen("reply", max_tokens=8)


def test_echo_agent_state_outlives_the_first_call(demo_thread_server):
    first = echo_agent("Hello, world!")
    second = echo_agent("How are you?")
    assert first.error is None and second.error is None
    assert second.state["history"][-2:] == ["Hello, world!", "How are you?"]
    assert second.text.startswith("How are you?") and second.text.endswith(second["reply"])


AGENT = """
import json, sys
from pagedserve.lang import function, gen, set_default_backend, Runtime
@function
def echo_agent(s):
    s.state["history"] = s.state.get("history", [])
    s.state["history"].append(s.text)
    s += gen("reply", max_tokens=4)
set_default_backend(Runtime(sys.argv[1]))
state = echo_agent(sys.argv[2], session_id="agent-7")
assert state.error is None, state.error
print(json.dumps(state.state["history"]))
"""


def test_a_session_id_shares_the_state_with_another_client_process(demo_thread_server):
    url, _ = demo_thread_server

    def client(text: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", AGENT, url, text], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    assert client("first process") == ["first process"]
    assert client("second process") == ["first process", "second process"]
    runtime = Runtime(url)
    assert runtime.delete_session("agent-7")
    assert runtime.load_state("agent-7") == {}


def test_fork_4_on_a_500_token_prefix_prefills_it_once(demo_thread_server):
    url, engine = demo_thread_server
    runtime = Runtime(url)
    assert runtime.http.post("/flush_cache").status_code == 200
    prefix = " ".join(f"word{i}" for i in range(190))

    @function
    def branches(s):
        s += prefix
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f" Branch {i}:" + gen("x", max_tokens=4)
        forks.join()

    stats = engine.get_stats()
    hits0, prompt0 = stats["prefix_cache_hits_total"], stats["prompt_tokens_total"]
    state = branches()
    prefix_tokens = runtime.cache_prefix(prefix)
    assert prefix_tokens >= 500
    stats = engine.get_stats()
    full_blocks = (prefix_tokens // 16) * 16
    # fork's prefill computed the prefix; each branch (and the last cache_prefix) hit its pages
    assert stats["prefix_cache_hits_total"] - hits0 >= 5 * full_blocks
    computed = (stats["prompt_tokens_total"] - prompt0) - (stats["prefix_cache_hits_total"] - hits0)
    assert computed < 2 * prefix_tokens
    assert state.error is None


def test_select_picks_the_choice_with_the_highest_logprob(demo_thread_server):
    url, _ = demo_thread_server
    runtime = Runtime(url)
    choices = ["the cat", "quantum chromodynamics", "a"]
    scores = runtime.score("I saw", choices)

    @function
    def pick(s):
        s += "I saw" + select("c", choices)

    assert pick()["c"] == choices[max(range(3), key=scores.__getitem__)]


def test_role_blocks_follow_the_chat_template_and_gen_constraints(demo_thread_server):
    @function
    def qa(s, question):
        s += system("You answer with numbers.")
        s += user(question)
        s += assistant(gen("n", max_tokens=6, regex=r"[0-9]{1,4}"))
        with s.user():
            s += "And as JSON?"
        s += assistant(
            gen(
                "j",
                max_tokens=40,
                temperature=0,  # the demo model could sample digits past max_tokens
                json_schema={
                    "type": "object",
                    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9999}},
                    "required": ["n"],
                },
            )
        )

    state = qa("What is 2 + 2?")
    assert state.error is None, state.error
    assert state.text.startswith("[gMASK]<sop><|system|>\nYou answer with numbers.<|user|>\n")
    assert re.fullmatch(r"[0-9]{1,4}", state["n"])
    assert isinstance(json.loads(state["j"])["n"], int)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_step_yields_the_call_and_the_result_goes_back(demo_thread_server, stream):
    @function
    def weather_agent(s, question):
        s += declare_tools([WEATHER])
        s += user(question)
        s += assistant(gen("call", tools=[WEATHER], temperature=0, max_tokens=32))
        s += tool(json.dumps({"city": s["call"].arguments["city"], "temperature": 21}))
        s += assistant(gen("answer", max_tokens=8))

    state = weather_agent("Weather in Paris?", stream=stream).wait()
    assert state.error is None, state.error
    call = state["call"]
    assert isinstance(call, ToolCall) and call.name == "get_weather" and call.id
    assert set(call.arguments) == {"city"} and len(call.arguments["city"]) <= 16
    # the text is what the demo model's chat template makes of the same conversation, the call's
    # arguments as the model wrote them (its JSON may space them as it likes)
    assert state.text.startswith("[gMASK]<sop><|system|>\n# 可用工具\n\n## get_weather\n\n{")
    turn = "<|user|>\nWeather in Paris?<|assistant|>\nget_weather\n"
    assert turn in state.text
    written = state.text.split(turn, 1)[1].split("<|observation|>\n", 1)[0]
    assert json.loads(written) == call.arguments
    assert state.text.endswith("<|assistant|>\n" + state["answer"])


def test_a_failing_program_keeps_its_error_and_frees_the_server(demo_thread_server):
    _, engine = demo_thread_server

    @function
    def broken(s):
        s += "x" + gen("a", max_tokens=2)
        s += gen("b", regex="((")

    state = broken()
    assert "unclosed group" in str(state.error)
    assert state["a"] is not None
    deadline = time.monotonic() + 10
    while engine.get_stats()["num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.get_stats()["num_requests_running"] == 0


def test_streaming_yields_the_program_text_in_pieces(demo_thread_server):
    @function
    def story(s):
        s += "Once upon a time"
        s += gen("rest", max_tokens=12, temperature=0)

    pieces = list(story(stream=True).text_iter())
    assert len(pieces) > 2
    assert "".join(pieces) == story().text


def test_run_batch_runs_programs_concurrently(demo_thread_server):
    all_started = threading.Barrier(8, timeout=120)  # one at a time, the first never passes it

    @function
    def classify(s, item):
        all_started.wait()
        s += f"Item: {item}. Category:" + gen("cat", max_tokens=4, choices=["fruit", "tool"])

    states = run_batch(classify, [{"item": f"thing {i}"} for i in range(8)], num_threads=8)
    assert [s.error for s in states] == [None] * 8
    assert [s.text.split(".")[0] for s in states] == [f"Item: thing {i}" for i in range(8)]
    assert all(s["cat"] in ("fruit", "tool") for s in states)
