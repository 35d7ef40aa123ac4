"""The model runner's flat batch, laid out by hand: each token's id, position and KV slot, each
sequence's bounds, block table and the rows whose logits a step needs; and the batch's trip to
the other tensor-parallel ranks as one tensor."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.model_runner import ModelInput, ModelRunner
from pagedserve.engine.request import Request
from pagedserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from tests.helpers.models import build_tiny_model_dir, host_tier_gib

BLOCK = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model_dir(path, "glm4", max_position_embeddings=128)
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=BLOCK,
        num_kv_pages=32,
        swap_space=host_tier_gib(path, 4, BLOCK),
    )
    return llm.llm_engine.runner


def _request(rid: str, prompt: list[int], computed: int, output=(), **params) -> Request:
    req = Request(rid, prompt, SamplingParams(**params), output_token_ids=list(output))
    req.num_computed_tokens = computed
    return req


def test_a_prefill_a_chunk_a_decode_and_a_draft_flatten_as_laid_out_by_hand(runner):
    # a: a whole prompt of 7 in pages [3, 5]; b: tokens 4..7 of a 10-token prompt, in page 2
    # (its second), with prompt logprobs; c: one decode at position 4; d: a decode at position
    # 4 with 2 drafts, its rows at positions 5 and 6
    a = _request("a", list(range(10, 17)), 0)
    b = _request("b", list(range(30, 40)), 4, prompt_logprobs=1)
    c = _request("c", [50, 51, 52], 4, output=[53, 54])
    d = _request("d", [60, 61, 62, 63, 64], 4)
    sched = SchedulerOutput(
        scheduled=[
            ScheduledRequest(a, 7, [3, 5]),
            ScheduledRequest(b, 4, [7, 2, 9]),
            ScheduledRequest(c, 1, [1, 6]),
            ScheduledRequest(d, 3, [8, 4], spec_token_ids=[70, 71]),
        ],
        page_copies=[(1, 11)],
        swap_out=[(12, 0)],
        swap_in=[(1, 13)],
    )
    inp, prompt_rows = runner.prepare_inputs(sched)
    assert inp == ModelInput(
        input_ids=[10, 11, 12, 13, 14, 15, 16, 34, 35, 36, 37, 54, 64, 70, 71],
        positions=[0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 4, 4, 5, 6],
        # page x 4 + position % 4: a 3 then 5, b 2, c 6, d 4
        slot_mapping=[12, 13, 14, 15, 20, 21, 22, 8, 9, 10, 11, 24, 16, 17, 18],
        query_start_loc=[0, 7, 11, 12, 15],
        seq_lens=[7, 8, 5, 7],
        block_tables=[[3, 5, 0], [7, 2, 9], [1, 6, 0], [8, 4, 0]],
        # a's last row, c's, and d's three (its next token, one after each draft); b completes
        # nothing this step
        logits_rows=[6, 11, 12, 13, 14],
        page_copies=[(1, 11)],
        swap_out=[(12, 0)],
        swap_in=[(1, 13)],
    )
    # b's 4 rows each predict the prompt token after them (tokens 5..8 of 10)
    assert prompt_rows == {1: [7, 8, 9, 10]}


def test_a_prompt_logprob_row_is_one_that_predicts_a_following_prompt_token():
    rows = ModelRunner._num_prompt_logprob_rows
    req = _request("p", [1, 2, 3, 4, 5, 6], 0, prompt_logprobs=0)  # 0: only the token's own
    assert [rows(req, s, e) for s, e in [(0, 6), (0, 3), (3, 6), (4, 6), (5, 6), (6, 7)]] == [
        5,  # the last prompt token predicts an output token, not a prompt one
        3,
        2,
        1,
        0,
        0,  # a decode
    ]
    assert rows(_request("q", [1, 2, 3, 4, 5, 6], 0), 0, 6) == 0  # not asked


def test_a_model_input_crosses_to_the_other_ranks_as_one_tensor_and_back():
    inp = ModelInput(
        input_ids=[5, 6, 7],
        positions=[0, 1, 9],
        slot_mapping=[4, 5, 38],
        query_start_loc=[0, 2, 3],
        seq_lens=[2, 10],
        block_tables=[[1, 0, 0], [2, 8, 9]],
        logits_rows=[1, 2],
        page_copies=[(3, 4)],
        swap_out=[(6, 1), (7, 2)],
        swap_in=[(0, 10)],
        lora_slots=[-1, 2],
        lora_loads=[(2, 7)],
    )
    t = inp.to_tensor()
    # the sizes: tokens, sequences, blocks a table, logits rows, LoRA slots, copies, swap-outs,
    # swap-ins, LoRA loads
    assert t[:9].tolist() == [3, 2, 3, 2, 2, 1, 2, 1, 1]
    assert t[9:].tolist() == [
        *[5, 6, 7, 0, 1, 9, 4, 5, 38, 0, 2, 3, 2, 10],
        *[1, 0, 0, 2, 8, 9, 1, 2, -1, 2, 3, 4, 6, 1, 7, 2, 0, 10, 2, 7],
    ]
    assert ModelInput.from_tensor(t) == inp
    empty = ModelInput([], [], [], [0], [], [], [], [], swap_out=[(1, 2)])
    assert empty.to_tensor().tolist()[:9] == [0, 0, 0, 0, 0, 0, 1, 0, 0]
    assert ModelInput.from_tensor(empty.to_tensor()) == empty


def _reference_logits(runner: ModelRunner, sched: SchedulerOutput):
    """Every row's logits of the step's batch, from one forward pass."""
    inp, _ = runner.prepare_inputs(sched)
    inp.logits_rows = list(range(len(inp.input_ids)))
    return runner.forward(inp)


def test_a_step_samples_each_sequence_and_its_forks_from_its_rows_after_the_prompt_rows(runner):
    prompt_a, prompt_b = list(range(10, 17)), list(range(30, 40))
    a = _request("a", prompt_a, 0, temperature=0.0)
    fork = _request("a#1", prompt_a, 0, temperature=0.0)
    b = _request("b", prompt_b, 0, temperature=0.0, prompt_logprobs=1)
    sched = SchedulerOutput(
        scheduled=[ScheduledRequest(a, 7, [3, 5]), ScheduledRequest(b, 10, [7, 2, 9])]
    )
    ref = _reference_logits(runner, sched)
    sent = []
    runner.broadcast_step = sent.append
    try:
        out = runner.execute_model(sched, {"a": [fork]})
    finally:
        runner.broadcast_step = None
    # b's prompt rows first (rows 7..15 predict its tokens 2..10), then a's last row for a and
    # its fork, then b's last
    assert [inp.logits_rows for inp in sent] == [[7, 8, 9, 10, 11, 12, 13, 14, 15, 6, 6, 16]]
    top = ref.argmax(-1).tolist()
    assert out.sampled_token_ids == {"a": [top[6]], "a#1": [top[6]], "b": [top[16]]}
    first, logprobs = out.prompt_logprobs["b"]
    expected = ref[7:16].log_softmax(-1)
    assert first == 1 and len(logprobs) == 9
    for i, row in enumerate(logprobs):
        target = prompt_b[i + 1]
        assert row[target] == pytest.approx(expected[i, target].item(), abs=1e-5)
    assert out.timing.num_tokens == 17


def test_drafts_the_model_agrees_with_are_kept_with_the_token_after_them(runner):
    prompt = [40, 41, 42, 43, 44]
    req = _request("d", prompt, 0, temperature=0.0)
    prefill = SchedulerOutput(scheduled=[ScheduledRequest(req, 5, [4, 6])])
    ref = _reference_logits(runner, prefill)
    first = int(ref[4].argmax())
    req.output_token_ids.append(first)
    req.all_token_ids.append(first)
    req.num_computed_tokens = 5
    # the model's own next two tokens as drafts: both accepted, and one more sampled
    agree = SchedulerOutput(scheduled=[ScheduledRequest(req, 1, [4, 6])])
    second = int(_reference_logits(runner, agree)[0].argmax())
    req.all_token_ids.append(second)
    third = int(
        _reference_logits(runner, SchedulerOutput(scheduled=[ScheduledRequest(req, 2, [4, 6])]))[
            1
        ].argmax()
    )
    del req.all_token_ids[-1]
    drafted = ScheduledRequest(req, 3, [4, 6, 8], spec_token_ids=[second, third])
    out = runner.execute_model(SchedulerOutput(scheduled=[drafted]))
    assert out.sampled_token_ids["d"][:2] == [second, third]
    assert len(out.sampled_token_ids["d"]) == 3
    wrong = (second + 1) % 300
    rejected = ScheduledRequest(req, 3, [4, 6, 8], spec_token_ids=[wrong, third])
    assert runner.execute_model(SchedulerOutput(scheduled=[rejected])).sampled_token_ids == {
        "d": [second]
    }


def test_a_step_that_only_copies_pages_copies_them_and_runs_no_forward_pass(runner, monkeypatch):
    import torch

    kv = runner.kv_cache  # [layers, K and V, pages, ...]
    kv[:, :, 3] = 1.5
    before = kv.clone()
    monkeypatch.setattr(runner, "forward", lambda inp: pytest.fail("a forward pass"))
    out = runner.execute_model(SchedulerOutput(page_copies=[(3, 20)]))
    assert out.sampled_token_ids == {} and out.timing.num_tokens == 0
    assert out.timing.num_pages_moved == 0  # copy-on-write is not a move between the tiers
    assert bool((kv[:, :, 20] == 1.5).all())
    assert torch.equal(kv[:, :, :20], before[:, :, :20])


def _prefill(rid: str, **params) -> SchedulerOutput:
    req = _request(rid, [50, 51, 52, 53, 54], 0, **params)
    return SchedulerOutput(scheduled=[ScheduledRequest(req, 5, [10, 11])])


def test_a_seeded_request_draws_from_its_own_generator_until_it_is_freed(runner):
    sched = _prefill("s", temperature=5.0, seed=7)
    draws = [runner.execute_model(sched).sampled_token_ids["s"] for _ in range(6)]
    assert len({tuple(d) for d in draws}) > 1  # one generator, advanced by each draw
    runner.free_request("s")
    assert [runner.execute_model(sched).sampled_token_ids["s"] for _ in range(6)] == draws
    runner.free_request("s")
    assert "s" not in runner.generators
    assert runner._generator(_prefill("u", temperature=5.0).scheduled[0].request) is None


def test_a_grammar_bitmask_limits_the_tokens_a_step_samples(runner):
    import numpy as np

    class OnlyToken9:
        def grammar_bitmask(self, requests):
            mask = np.zeros((len(requests), 10), dtype=np.int32)  # 320 tokens, 32 a word
            mask[:, 0] = 1 << 9
            return mask

    sched = _prefill("g", temperature=0.0)
    free = runner.execute_model(sched).sampled_token_ids["g"]
    runner.structured_output_manager = OnlyToken9()
    try:
        assert runner.execute_model(sched).sampled_token_ids["g"] == [9] != free
    finally:
        runner.structured_output_manager = None


def test_a_restored_weight_page_computes_the_step_again_before_sampling(runner, monkeypatch):
    sched = _prefill("w", temperature=0.0)
    clean = runner.execute_model(sched).sampled_token_ids
    forward, passes, restored = runner.forward, [], iter([True, False])

    def counted(inp):
        passes.append(len(inp.input_ids))
        return forward(inp)

    monkeypatch.setattr(runner, "forward", counted)
    monkeypatch.setattr(runner, "patrol_scrub", lambda: next(restored))
    assert runner.execute_model(sched).sampled_token_ids == clean
    assert passes == [5, 5]
    assert runner.execute_model(sched).sampled_token_ids == clean and passes == [5, 5, 5]


def test_a_step_is_timed_from_its_page_moves_to_the_end_of_its_forward_pass(runner, monkeypatch):
    from pagedserve.engine import model_runner

    clock = iter([10.0, 10.5, 12.0])
    monkeypatch.setattr(model_runner.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(runner, "move_pages", lambda inp: None)
    sched = _prefill("t", temperature=0.0)
    sched.swap_out, sched.swap_in = [(1, 2), (3, 4)], [(5, 6)]
    timing = runner.execute_model(sched).timing
    assert (timing.num_pages_moved, timing.move_seconds) == (3, 0.5)
    assert (timing.num_tokens, timing.forward_seconds) == (5, 1.5)


def test_a_rank_runs_its_page_moves_then_a_forward_pass_when_there_are_tokens(runner):
    import torch

    sched = _prefill("r", temperature=0.0)
    inp, _ = runner.prepare_inputs(sched)
    assert torch.equal(runner.run_step(inp), runner.forward(inp))
    assert runner.forward(ModelInput(**{**_fields(inp), "logits_rows": []})) is None
    kv = runner.kv_cache
    kv[:, :, 3] = 2.5
    assert runner.run_step(ModelInput([], [], [], [0], [], [], [], [(3, 21)])) is None
    assert bool((kv[:, :, 21] == 2.5).all())


def _fields(inp: ModelInput) -> dict:
    return {name: getattr(inp, name) for name in ModelInput.__slots__}


def test_a_runner_of_its_own_steps_as_the_engines_does(runner):
    """A rank's runner, made without an engine: no patrol, no grammars."""
    own = ModelRunner(runner.model, runner.device, runner.kv_cache, BLOCK)
    sched = _prefill("o", temperature=0.0)
    assert (
        own.execute_model(sched).sampled_token_ids == runner.execute_model(sched).sampled_token_ids
    )


def test_prompt_logprobs_of_a_chunk_and_of_a_whole_prompt_and_the_sampled_tokens_logprobs(runner):
    import torch

    p1, p2 = list(range(60, 70)), list(range(80, 86))
    first = _request("p1", p1, 0, temperature=0.0, prompt_logprobs=1)
    second = _request("p2", p2, 0, temperature=0.0, prompt_logprobs=1, logprobs=1)
    # p1's first 4 tokens (a chunk: rows 0..3 predict its tokens 2..5), p2 whole (rows 4..8
    # predict its tokens 2..6, row 9 its next token)
    sched = SchedulerOutput(
        scheduled=[ScheduledRequest(first, 4, [12, 13, 14]), ScheduledRequest(second, 6, [15, 16])]
    )
    ref = torch.log_softmax(_reference_logits(runner, sched), -1)
    out = runner.execute_model(sched)
    for rid, prompt, rows in (("p1", p1, range(0, 4)), ("p2", p2, range(4, 9))):
        start, logprobs = out.prompt_logprobs[rid]
        assert start == 1 and len(logprobs) == len(rows)
        for row, target, got in zip(rows, prompt[1:], logprobs, strict=False):
            assert got[target] == pytest.approx(ref[row, target].item(), abs=1e-5)
    token = int(ref[9].argmax())
    assert out.sampled_token_ids == {"p2": [token]}
    assert out.logprobs["p2"][0][token] == pytest.approx(ref[9, token].item(), abs=1e-5)


def test_a_draft_row_counts_the_drafts_before_it_as_output_tokens(runner):
    eos = 7  # always the model's choice (a bias of 100), once min_tokens allows it
    params = {"temperature": 0.0, "min_tokens": 2, "logit_bias": {eos: 100.0}}
    req = _request("m", [40, 41, 42, 43, 44], 0, **params)
    req.eos_token_ids = frozenset({eos})
    (t0,) = runner.execute_model(
        SchedulerOutput([ScheduledRequest(req, 5, [4, 6])])
    ).sampled_token_ids["m"]
    assert t0 != eos  # min_tokens 2: not yet
    req.output_token_ids.append(t0)
    req.all_token_ids.append(t0)
    req.num_computed_tokens = 5
    decode = SchedulerOutput([ScheduledRequest(req, 1, [4, 6])])
    (t1,) = runner.execute_model(decode).sampled_token_ids["m"]
    assert t1 != eos  # one output token: not yet
    # with the drafts [t1, eos]: the row after t1 sees 2 output tokens, and eos is allowed
    drafted = SchedulerOutput([ScheduledRequest(req, 3, [4, 6, 8], spec_token_ids=[t1, eos])])
    assert runner.execute_model(drafted).sampled_token_ids["m"] == [t1, eos, eos]


def test_a_step_swaps_pages_out_to_the_host_tier_and_back_in(runner):
    kv = runner.kv_cache
    kv[:, :, 5] = 3.0
    out = runner.execute_model(SchedulerOutput(swap_out=[(5, 1)]))
    assert out.timing.num_pages_moved == 1
    kv[:, :, 5] = 0.0
    runner.execute_model(SchedulerOutput(swap_in=[(1, 22)]))
    assert bool((kv[:, :, 22] == 3.0).all())
