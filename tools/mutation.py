"""Mutation testing of the engine's core and the server's request mapping, one module at a time.

    pip install -e '.[dev]'
    taskset -c 1 nice -n 10 python tools/mutation.py               # every module, then the table
    taskset -c 1 nice -n 10 python tools/mutation.py scheduler     # one module
    python tools/mutation.py --report                              # the table of the last runs

Each module is mutated by mutmut (settings: ``[tool.mutmut]`` in pyproject.toml) in its own copy
of the working tree under ``.mutation/<module>/``, with only that module mutated and only the fast
tests that cover it selected, so that a mutant of the scheduler never starts the HTTP server. Runs
are incremental: mutmut keeps each copy's results and tests only new or changed mutants;
``--survivors`` retests the mutants that survived (after adding tests).

The table counts a mutant as killed when a test failed or timed out on it; the kill rate leaves out
the survivors that a rule of ``EQUIVALENT_RULES`` matches (no test can tell them from the original,
for the reason given). ``--report`` also writes ``benchmarks/results/mutation.json`` (a module
with no run in this tree keeps its last record) and the README's table from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutation"
RESULTS = ROOT / "benchmarks" / "results" / "mutation.json"
README = ROOT / "README.md"
TARGET = 0.95

# module -> (the file mutated, the tests that may kill its mutants): fast, in-process tests only
# (mutmut maps each function to the tests that run it, so a mutant runs only those)
ENGINE_TESTS = ["tests/engine/test_engine.py", "tests/engine/test_device_faults.py"]
CORE_TESTS = ["tests/engine/test_engine_core.py", "tests/engine/test_output_processor.py"]
# the tool-call and reasoning parsers: pure functions of an output text, on the demo tokenizer
TOOL_PARSER_TESTS = ["tests/server/test_tool_parsers.py", "tests/server/test_tool_grammar.py"]


def _named(path: str, *tests: str) -> list[str]:
    """Some tests of a file, by name: its unit tests, where the rest start an engine per test."""
    return [f"{path}::{test}" for test in tests]


ROUTE_TEST = "test_each_route_takes_its_method_and_its_schema_names_its_models"


MODULES = {
    "scheduler": (
        "pagedserve/engine/scheduler.py",
        ["tests/engine/test_scheduler.py"],
    ),
    "block_manager": (
        "pagedserve/engine/block_manager.py",
        ["tests/engine/test_block_manager.py"],
    ),
    "page_allocator": (
        "pagedserve/engine/page_allocator.py",
        ["tests/engine/test_block_manager.py", "tests/engine/test_scheduler.py"],
    ),
    "sampler": (
        "pagedserve/engine/sampler.py",
        [
            "tests/engine/test_sampler.py",
            "tests/engine/test_sampler_mixed_batch.py",
            "tests/engine/test_spec_decode.py",  # accept_drafts, verify_drafts in the engine
            # the sampler with a device's one-call draw (the native kernels')
            "tests/hal/test_native_kernels.py::"
            "test_sampler_with_the_devices_draw_samples_softmax_over_temperature",
        ],
    ),
    "server_sampling": (
        "pagedserve/server/sampling.py",
        ["tests/server/test_server_sampling.py"],
    ),
    "detokenizer": ("pagedserve/engine/detokenizer.py", ["tests/engine/test_detokenizer.py"]),
    "stop_checker": (
        "pagedserve/engine/stop_checker.py",
        ["tests/engine/test_stop_checker.py", *ENGINE_TESTS],
    ),
    "request": ("pagedserve/engine/request.py", ["tests/engine/test_scheduler.py", *ENGINE_TESTS]),
    "spec_decode": (
        "pagedserve/engine/spec_decode.py",
        _named(
            "tests/engine/test_spec_decode.py",
            "test_drafts_follow_the_first_occurrence_of_the_longest_suffix_ngram",
            "test_the_index_a_sequence_grows_finds_what_a_scan_of_it_finds",
            "test_a_growing_index_indexes_each_new_token_once_and_only_the_n_grams_it_looks_up",
            "test_a_request_whose_drafts_keep_failing_backs_off_then_drafts_again",
            "test_failing_drafts_back_off_for_a_cooldown_that_doubles_up_to_its_bound",
            "test_an_accepted_draft_resets_the_failures_and_the_cooldown",
            "test_the_proposer_drafts_up_to_its_k_and_the_room_left_by_the_longest_suffix_match",
            "test_spec_decode_stats_count_steps_drafts_and_acceptances_by_position",
            "test_spec_decode_stats_before_any_draft_are_zero",
        ),
    ),
    "swap_policy": (
        "pagedserve/engine/swap_policy.py",
        _named(
            "tests/engine/test_kv_tiers.py",
            "test_auto_swaps_while_the_copy_is_cheaper_and_recomputes_when_it_is_not",
            "test_auto_charges_a_swap_two_copies_and_a_recompute_a_prefill_of_its_tokens",
            "test_auto_swaps_only_when_the_copy_is_strictly_cheaper",
            "test_auto_swaps_while_either_rate_is_unmeasured",
            "test_a_prefill_of_min_prefill_tokens_is_measured_and_a_step_without_copies_is_not",
            "test_each_rate_moves_part_way_toward_each_new_measurement_and_settles_on_a_steady_one",
        ),
    ),
    "host_tier": ("pagedserve/engine/host_tier.py", ["tests/engine/test_block_manager.py"]),
    "request_group": ("pagedserve/engine/request_group.py", ENGINE_TESTS),
    "limits": ("pagedserve/engine/limits.py", ENGINE_TESTS),
    "llm_engine": (  # its own engines in one file: the whole-engine files run ~30 s a mutant
        "pagedserve/engine/llm_engine.py",
        ["tests/engine/test_llm_engine.py"],
    ),
    "fault_recovery": (  # the tests that inject or provoke a fault: every step runs recovery's
        # checks, so the engines' other tests would run for each of its mutants, and none of them
        # has a fault to recover
        "pagedserve/engine/fault_recovery.py",
        [
            "tests/engine/test_fault_recovery.py",
            "tests/engine/test_device_faults.py",
            *_named(
                "tests/engine/test_engine.py",
                "test_a_detected_kv_page_fault_is_recovered_by_recompute",
                "test_an_unrecovered_kv_page_fault_would_corrupt_the_output",
            ),
            *_named(  # the host tier's frames
                "tests/engine/test_kv_tiers.py",
                "test_a_fault_in_a_swapped_out_page_is_detected_and_its_request_recomputes",
                "test_the_same_host_fault_unrecovered_would_corrupt_the_answer",
                "test_a_host_fault_injected_with_nothing_there_hits_frame_0_and_is_recovered",
                "test_a_host_fault_injection_outside_the_host_tier_names_its_frames",
                "test_a_step_whose_swap_out_fails_recomputes_its_victim",
            ),
        ],
    ),
    "model_runner": (  # its batch and steps, by hand; every engine test runs it, each run long
        "pagedserve/engine/model_runner.py",
        [
            "tests/engine/test_model_runner.py",
            *_named(  # the forward pass against transformers, its prefill in chunks
                "tests/engine/test_engine_numerics.py",
                "test_greedy_matches_transformers_with_chunked_prefill",
            ),
        ],
    ),
    "worker": ("pagedserve/engine/worker.py", ["tests/engine/test_worker.py"]),
    "executor": ("pagedserve/engine/executor.py", ["tests/engine/test_executor.py"]),
    "memory_plan": (  # the plans, without the subprocess and the live servers'
        "pagedserve/engine/memory_plan.py",
        [
            "tests/entrypoints/test_memory_plan.py",
            *_named(
                "tests/entrypoints/test_tune.py",
                "test_glm4_9b_chat_on_kunlun_matches_hand_computation",
                "test_the_kv_tier_caps_the_pool_of_the_default_device",
                "test_an_emulated_pool_stops_at_half_the_hosts_free_ram_and_says_so",
                "test_a_host_too_small_for_one_sequence_is_named_as_the_bound",
                "test_a_device_outside_host_memory_has_no_host_bound",
                "test_tune_model_demo_plans_for_serves_default_device",
                "test_the_explanation_quotes_no_other_models_figures",
                "test_the_launch_script_serves_the_model_name_the_readmes_requests_send",
                "test_tensor_parallel_splits_weights_and_replicates_kv_heads",
                "test_unquantized_weights_are_two_bytes_per_parameter",
                "test_32b_on_32g_device_refuses_bf16_weights_and_fits_int4",
                "test_refuses_tensor_parallel_size_that_does_not_divide_heads",
                "test_refuses_max_model_len_beyond_context",
                "test_refuses_when_one_sequence_does_not_fit_and_says_how_much_is_missing",
                "test_cli_reports_refusal_on_stderr",
                "test_model_directory_config_json_is_read",
                "test_presets_have_the_published_shapes_and_device_schema",
                "test_demo_preset_has_the_shipped_demo_models_shapes",
                "test_demo_model_fits_the_small_emulated_device",
                "test_write_produces_an_executable_launch_script",
                "test_tp_size_divides_the_weights_per_card_and_says_whether_it_fits",
            ),
        ],
    ),
    "messages": ("pagedserve/engine/messages.py", CORE_TESTS),
    "core": ("pagedserve/engine/core.py", CORE_TESTS),
    "core_client": (  # its sockets and a stand-in for the core process: no spawn per mutant
        "pagedserve/engine/core_client.py",
        ["tests/engine/test_core_client.py"],
    ),
    "output_processor": (
        "pagedserve/engine/output_processor.py",
        ["tests/engine/test_output_processor.py"],
    ),
    "async_engine": (  # against a stand-in core: no engine per mutant
        "pagedserve/engine/async_engine.py",
        [
            "tests/engine/test_async_engine_protocol.py",
            *_named(
                "tests/engine/test_async_engine.py",
                "test_the_token_history_counts_each_second_and_forgets_the_old",
            ),
        ],
    ),
    "structured_manager": (
        "pagedserve/engine/structured_output/manager.py",
        [
            "tests/engine/test_structured_output_manager.py",
            *_named(
                "tests/engine/test_structured_output.py",
                "test_replayed_matcher_allows_the_same_tokens_as_the_live_one",
                "test_a_replay_the_grammar_refuses_is_logged",
            ),
        ],
    ),
    "structured_request": (
        "pagedserve/engine/structured_output/request.py",
        ["tests/engine/test_structured_output.py"],
    ),
    "structured_guidance": (  # the grammars and checks, without the engines and servers
        "pagedserve/engine/structured_output/backend_guidance.py",
        _named(
            "tests/engine/test_structured_output.py",
            "test_json_whitespace_is_bounded",
            "test_an_object_that_lists_its_properties_takes_no_others_unless_its_schema_says_so",
            "test_each_kind_of_constraint_becomes_a_grammar_of_exactly_what_it_allows",
            "test_a_constraint_that_compiles_passes_the_check",
            "test_a_constraint_that_cannot_compile_is_refused_naming_its_kind",
            "test_replayed_matcher_allows_the_same_tokens_as_the_live_one",
            "test_a_replay_the_grammar_refuses_is_logged",
            "test_the_grammar_vocabulary_keeps_special_tokens_out_of_text",
            "test_the_grammar_vocabulary_tokenizes_text_without_the_prompts_prefix",
            "test_the_text_of_a_special_token_in_a_constraint_is_written_as_text",
        ),
    ),
    # the request handling every route shares: the in-process API tests (no live server)
    "server_serving": (
        "pagedserve/server/serving.py",
        [
            "tests/server/test_serving.py",
            "tests/server/test_chat_api.py",
            "tests/server/test_completions_api.py",
            "tests/server/test_tokenization_api.py",
            "tests/server/test_app.py",
        ],
    ),
    # SGLang's routes: their tests on an in-process app over the demo model
    "server_sglang_api": (
        "pagedserve/server/sglang_api.py",
        ["tests/server/test_sglang_api.py", *_named("tests/server/test_app.py", ROUTE_TEST)],
    ),
    **{
        f"server_{name}": (f"pagedserve/server/{name}.py", ["tests/server/test_app.py"])
        for name in ("app", "web_ui")
    },
    # the small families' routes: test_app.py's tests of them (each builds its own app)
    "server_info": (
        "pagedserve/server/info.py",
        _named(
            "tests/server/test_app.py",
            "test_each_route_takes_its_method_and_its_schema_names_its_models",
            "test_models_lists_the_served_name_its_root_and_context",
            "test_health_is_200_with_the_engines_figures_while_it_runs",
            "test_health_is_503_once_the_engine_is_dead",
            "test_health_names_how_the_core_ended_before_the_loop_has_handled_it",
            "test_version_is_the_packages",
            "test_metrics_are_prometheus_text",
        ),
    ),
    "server_device": (
        "pagedserve/server/device.py",
        _named(
            "tests/server/test_app.py",
            "test_each_route_takes_its_method_and_its_schema_names_its_models",
            "test_device_reports_the_engines_figures_and_the_served_model",
            "test_device_pages_is_the_page_map",
            "test_scrub_and_invariants_are_the_engine_cores_answers",
            "test_fault_injection_is_403_unless_the_server_allows_it",
            "test_a_fault_the_engine_cannot_inject_is_a_400",
            "test_a_fault_the_engine_cannot_inject_is_a_400_saying_why",
            "test_a_fault_injected_is_the_one_asked_for",
            "test_device_routes_are_503_once_the_engine_is_dead",
            "test_fault_injection_on_a_dead_engine_is_503",
        ),
    ),
    "server_tokenization": (  # its routes, on an app per test
        "pagedserve/server/tokenization.py",
        [
            "tests/server/test_tokenization_api.py",
            *_named(
                "tests/server/test_app.py",
                "test_tokenize_a_prompt_and_detokenize_it_back",
                "test_tokenize_messages_answers_the_prompt_the_template_made",
                "test_tokenize_needs_a_prompt_or_messages",
                "test_detokenize_refuses_an_id_outside_the_vocabulary",
                "test_tokenization_names_the_served_model_only",
            ),
        ],
    ),
    # the API tests share one app per file, so mutmut maps the router (made when the app is
    # built) to a file's first test; test_app.py's route test checks its method and models
    "server_completions": (
        "pagedserve/server/completions.py",
        [
            "tests/server/test_completions_api.py",
            *_named("tests/server/test_app.py", ROUTE_TEST),
        ],
    ),
    "server_chat": (
        "pagedserve/server/chat.py",
        ["tests/server/test_chat_api.py", *_named("tests/server/test_app.py", ROUTE_TEST)],
    ),
    "server_metrics": ("pagedserve/server/metrics.py", ["tests/server/test_metrics.py"]),
    # no server_protocol: mutmut mutates function bodies only, and protocol.py's schemas are class
    # bodies; of its two functions, random_id has nothing to mutate (an f-string) and mutmut skips
    # the decorated serializer. test_errors.py tests the schemas' limits.
    "server_body_limit": ("pagedserve/server/body_limit.py", ["tests/server/test_body_limit.py"]),
    "server_structured": (
        "pagedserve/server/structured.py",
        ["tests/server/test_structured.py", "tests/server/test_server_sampling.py"],
    ),
    "server_tools": (
        "pagedserve/server/tools.py",
        ["tests/server/test_tool_choice.py", "tests/server/test_tool_grammar.py"],
    ),
    "server_chat_output": ("pagedserve/server/chat_output.py", TOOL_PARSER_TESTS),
    "server_errors": (
        "pagedserve/server/errors.py",
        ["tests/server/test_errors.py", "tests/server/test_server_sampling.py"],
    ),
    "server_streaming": ("pagedserve/server/streaming.py", ["tests/server/test_streaming.py"]),
    "server_session_state": (
        "pagedserve/server/session_state.py",
        ["tests/server/test_session_state.py"],
    ),
    "server_tool_parser": (
        "pagedserve/server/tool_parsers/abstract_tool_parser.py",
        TOOL_PARSER_TESTS,
    ),
    "server_glm4_tool_parser": (
        "pagedserve/server/tool_parsers/glm4_tool_parser.py",
        TOOL_PARSER_TESTS,
    ),
    "server_glm45_tool_parser": (
        "pagedserve/server/tool_parsers/glm45_tool_parser.py",
        TOOL_PARSER_TESTS,
    ),
    "server_reasoning_parser": (
        "pagedserve/server/reasoning_parsers/abstract_reasoning_parser.py",
        TOOL_PARSER_TESTS,
    ),
    "server_glm4_reasoning_parser": (
        "pagedserve/server/reasoning_parsers/glm4_reasoning_parser.py",
        TOOL_PARSER_TESTS,
    ),
    "faults": ("pagedserve/hal/faults.py", ["tests/engine/test_device_faults.py"]),
    "kernels": (
        "pagedserve/hal/kernels.py",
        ["tests/hal/test_hal.py", "tests/hal/test_reference_kernels.py"],
    ),
    "tensor_parallel": (  # the shards, in this process: the ranks' processes are unseen
        "pagedserve/models/tensor_parallel.py",
        _named(
            "tests/engine/test_tensor_parallel.py",
            "test_a_size_that_would_cut_int4_groups_is_refused_with_the_reason",
            "test_kv_heads_are_replicated_when_fewer_than_ranks",
            "test_each_rank_reads_only_its_rows_and_columns",
            "test_each_ranks_heads_kv_heads_and_vocabulary_are_its_share_of_the_models",
            "test_a_size_that_cannot_split_the_model_is_refused_naming_each_reason",
            "test_only_the_split_projections_and_the_vocabulary_are_sharded",
            "test_a_tensor_that_is_already_a_ranks_shard_is_taken_as_it_is",
            "test_an_int4_layer_cut_for_a_rank_dequantizes_to_that_ranks_cut_of_the_dense_layer",
            "test_the_vocabulary_is_padded_to_a_multiple_of_64_then_of_the_size",
            "test_each_rank_keeps_its_rows_of_an_odd_vocabulary_and_zeros_past_its_end",
        ),
    ),
}

# Equivalent mutants: no test can tell them from the original, because the program behaves the
# same. A surviving mutant is listed as equivalent only if a rule covers its one changed line; every
# other survivor counts against the kill rate. Two kinds of rule:
# - (module, pattern, why): the line and its mutant are the same once ``pattern`` is dropped from
#   both (the mutation only touched that argument);
# - (module, function, regex of the removed line, regex of the added line, why).
# A rule's module is a regex of the modules it covers.
DROP_RULES = [
    (
        "sampler",
        r"device=[\w.]+|\.to\([\w.]*\)",
        "the tests run on the CPU, where torch puts a new tensor on the CPU whatever device is "
        "named; only a run on an accelerator tells these apart",
    ),
    (
        "sampler",
        r"dtype=(torch\.long|like\.dtype|sorted_logits\.dtype|None)",
        "torch infers int64 from Python ints and float32 from Python floats: the dtype given",
    ),
    (
        "sampler",
        r"dim=[-+]1\b|, [-+]1(?=\))",
        "the tensors are 2-D [rows, vocab]: dim +1 is dim -1, and topk/sort default to it",
    ),
    (
        "executor",
        r"src=0",
        "Device.broadcast's src defaults to 0 (rank 0 sends every message): the same call",
    ),
    (
        "sampler",
        r"strict=\w+",
        "the zipped lists have equal lengths by construction; strict only adds a check",
    ),
]
MATCH_RULES = [
    (
        "server_(tokenization|info|device|completions|chat|app|sglang_api|serving)",
        ".*",
        r'methods=\["[A-Z]+"\]',
        r'methods=\["[a-z]+"\]',
        "Starlette's Route upper-cases the methods it is given: the same route",
    ),
    (
        "server_(tokenization|info|device|completions|chat|app|sglang_api|serving)",
        ".*",
        r'methods=\["GET"\]\)$',
        r"(methods=None|, )\)$",
        "FastAPI's APIRoute takes methods None (its default) as GET: the same route",
    ),
    (
        "server_info",
        "info_router",
        r"error_body\(503, ",
        r"error_body\(504, ",
        "error_body's status only picks the error's type, server_error for any status from 500 "
        "on; the response's own status is the JSONResponse's 503",
    ),
    (
        "server_metrics",
        "__init__",
        r"self\.latest_stats: dict = \{\}$",
        r"self\.latest_stats: dict = None$",
        "the collector reads latest_stats only in a scrape, and the only scrape is render's, "
        "which sets it first (registering the collector does not collect: the registry does not "
        "auto-describe): the first value is never read",
    ),
    (
        "server_chat",
        "chat_output_parsers",
        r"parallel = tools\.parallel if tools is not None else True$",
        r"parallel = tools\.parallel if tools is not None else False$",
        "without tools there is no tool parser, and ChatOutputParser reads parallel only in "
        "reading calls, with a tool parser: the value for no tools is never read",
    ),
    (
        "server_completions",
        "_completion_stream",
        r"sent_text\[index\] = -1 if o\.finished",
        r"sent_text\[index\] = -2 if o\.finished",
        "the mark of a finished choice is only compared with 0 (sent_text[index] < 0): any "
        "negative one marks it the same",
    ),
    (
        "server_streaming",
        "sse_response",
        r"else 500$",
        r"else 501$",
        "the status only picks the event's error type, server_error for any status from 500 on",
    ),
    (
        "server_body_limit",
        "__call__",
        r'decode\("latin-1"\)',
        r'decode\("LATIN-1"\)',
        "Python's codec names are case-insensitive: the same codec",
    ),
    (
        "server_serving",
        "check_admission",
        r'"Retry-After": RETRY_AFTER_S',
        r'"(retry-after|RETRY-AFTER)": RETRY_AFTER_S',
        "HTTP header names are case-insensitive, and Starlette sends every name in lower case",
    ),
    (
        "server_serving",
        "_top_logprob",
        r'encode\("utf-8"\)',
        r'encode\("UTF-8"\)',
        "Python's codec names are case-insensitive: the same codec",
    ),
    (
        "server_serving",
        "chat_logprobs|completion_logprobs",
        r"zip\(token_ids, logprobs, strict=False\)",
        r"zip\(token_ids, logprobs, (strict=(None|True))?\)",
        "a choice's logprobs hold one entry per token (an echoed prompt's one per prompt token), "
        "and a stream's chunk slices both from the same offset: the lengths are equal, so strict "
        "only adds a check (None is falsy, and False the default)",
    ),
    (
        "server_streaming",
        "sse_response",
        r'"Cache-Control": "no-cache"',
        r'"(CACHE-CONTROL|cache-control)": "no-cache"',
        "HTTP header names are case-insensitive, and Starlette sends every name in lower case",
    ),
    (
        "server_glm4_tool_parser",
        "_piece",
        r"return CallSegment\(first\.rstrip\(\), arguments, piece\)$",
        r"arguments, None\)$",
        "a call's source is read only when the output is final (to turn a call that is not JSON "
        "into text), and a piece of a final output is complete: it returns before this line",
    ),
    (
        "server_glm45_tool_parser",
        "_call|_value",
        r"ensure_ascii=False",
        r"ensure_ascii=None",
        "json.dumps reads ensure_ascii only as a truth value: None writes the characters beyond "
        "ASCII as they are, as False does",
    ),
    (
        "server_glm45_tool_parser",
        "_call",
        r'return TextSegment\(""\)',
        r"return TextSegment\(None\)",
        "segments drops every text segment whose text is falsy: an empty one and one of None alike",
    ),
    (
        "server_glm45_tool_parser",
        "grammar",
        r'_text_rule\("(value_text|text_then_call)", "", ',
        r'_text_rule\("(value_text|text_then_call)", None, ',
        "_text_rule writes the length as `length or '*'`: None and an empty length are both any "
        "length",
    ),
    (
        "server_glm45_tool_parser",
        "_pairs",
        r"if (k1|v0|v1) < 0:$",
        r"if (k1|v0|v1) (<= 0|< 1):$",
        "each tag is searched for from where the one before it (the key's opening tag, at 0 or "
        "later) begins, and a different tag begins there: a tag found is at 1 or later, so < 0, "
        "<= 0 and < 1 agree",
    ),
    (
        "server_glm45_tool_parser",
        "segments",
        r"(if end < 0 else|closed=end >= 0 or)",
        r"(if end <= 0 else|if end < 1 else|closed=end > 0 or|closed=end >= 1 or)",
        "the closing tag is searched for from the opening tag's index (0 or later), where it "
        "cannot begin: a closing tag found is at 1 or later, so end is never 0",
    ),
    (
        "detokenizer",
        "__init__|_advance_window",
        r"self\.prefix_offset = 0$",
        r"self\.prefix_offset = None$",
        "a slice from None starts at 0: the same window",
    ),
    (
        "detokenizer",
        "_num_held_back",
        r"len\(self\._text\) - self\._num_emitted",
        r"len\(self\._text\) \+ self\._num_emitted",
        "text already sent never ends in a stop string's prefix (it would have been held back), "
        "so a longer suffix reaching into it never matches: the bound on its length decides "
        "nothing",
    ),
    ("detokenizer", "add_token", r"final=False", r"final=None", "None is falsy, as False is"),
    (
        "output_processor",
        "__init__|get",
        r"self\.updated = False",
        r"self\.updated = None",
        "read only as a truth value: None is falsy, as False is",
    ),
    (
        "sampler",
        "apply_grammar_bitmask",
        r"arange\(32, dtype=torch\.int32\)",
        r"arange\(32, (dtype=None)?\)",
        "int32 words shifted by int64 counts are promoted to int64: the same bits",
    ),
    (
        "sampler",
        "apply_grammar_bitmask",
        r"allowed\.shape\[1\] < logits",
        r"allowed\.shape\[1\] <= logits",
        "at equal widths the pad has no columns: the concatenation changes nothing",
    ),
    (
        "sampler",
        "apply_grammar_bitmask",
        r"bitmask != -1",
        r"bitmask != -2",
        "an all-ones row taken for a constrained one allows every token: the same logits",
    ),
    (
        "sampler",
        "__call__",
        r"meta\.generators, self\.argmax\)",
        r"meta\.generators, \)",
        "a backend's argmax picks the same token as the default one (the same ties); only its "
        "speed differs",
    ),
    (
        "sampler",
        "token_counts",
        r"\(padded < 0\)",
        r"\(padded <= 0\)|\(padded < 1\)",
        "a prefilter: _check_token_ids checks the ids it lets through again, so a valid id 0 "
        "let through is not reported",
    ),
    (
        "server_sampling",
        "logit_bias",
        r"else -1$",
        r"else -2$",
        "any negative stand-in is outside [0, vocab) and rejected the same way",
    ),
    (
        "block_manager",
        "allocate_slots",
        r"copy=i \* self\.block_size < num_computed",
        r"copy=i / self\.block_size < num_computed|copy=i \* self\.block_size <= num_computed",
        "a shared block always holds computed tokens (a fork shares a table that covers exactly "
        "the computed tokens), so the copy is made either way",
    ),
    (
        "block_manager",
        "fork",
        r"num_cached_blocks\.get\(parent\.request_id, 0\)",
        r"num_cached_blocks\.get\(None, 0\)",
        "the child then re-checks from block 0 the blocks its parent cached, and skips them",
    ),
    (
        "block_manager",
        "get_computed_blocks",
        r"block_hashes\.get\(req\.request_id, \(\)\)",
        r"block_hashes\.get\(None, \(\)\)",
        "the stored hashes are a cache: recomputing them from the tokens gives the same",
    ),
    (
        "block_manager",
        "_block_key",
        r"hashes\[i - 1\] if i else None",
        r"None, tokens|\(i\) and False",
        "lookups go block by block from the first and stop at the first miss, so a hit block's "
        "parent was itself verified: the parent check never decides",
    ),
    (
        "block_manager",
        "_cache_full_blocks",
        r"if num_full <= start:",
        r"if num_full < start:",
        "with num_full == start the loop is empty and the count is rewritten unchanged",
    ),
    (
        "spec_decode",
        "drafts",
        r"self\.min_n - 1, -1\)",
        r"self\.min_n - 2, -1\)",
        "the index holds no n-gram shorter than min_n (a test checks it), so a lookup of "
        "min_n - 1 tokens always misses",
    ),
    (
        "scheduler",
        "_schedule_running",
        r"^\s*break$",
        r"^\s*return$",
        "only the last running request can preempt itself, and a step that preempts admits no "
        "waiting request, so the budget this return drops is never used",
    ),
    (
        "scheduler",
        "_scheduled",
        r"if start < req\.num_lost_tokens:",
        r"if start <= req\.num_lost_tokens:",
        "at start == num_lost_tokens the count grows by min(start + n, start) - start = 0",
    ),
    (
        "server_(sampling|sglang_api)",
        "sampling_params|sglang_sampling_params",
        r'split\("=", 1\)\[0\]',
        r'split\("=", ?\d?\)\[0\]',
        "only the first piece is used, the same whatever the split limit",
    ),
    (
        "server_sglang_api",
        "add_logprobs",
        r"zip\(lps, o\.token_ids, strict=False\)",
        r"zip\(lps, o\.token_ids, (strict=None)?\)",
        "zip's strict is False by default, and None is falsy: the same zip",
    ),
    (
        "server_sglang_api",
        "chat_template_roles|_role_pieces",
        r"add_generation_prompt=False",
        r"add_generation_prompt=None",
        "the tokenizer hands the flag to the template, which reads it as a truth value (HF's "
        "templates: {% if add_generation_prompt %}): None is falsy, as False is",
    ),
    (
        "server_sglang_api",
        "_role_pieces",
        r"text\.partition\(_SENTINEL\)",
        r"text\.rpartition\(_SENTINEL\)",
        "the sentinel is the one message's content, rendered once: both split at the same place",
    ),
    (
        "page_allocator",
        "allocate",
        r"popitem\(last=False\)",
        r"last=None",
        "None is falsy: popitem pops the head as with False",
    ),
    (
        "page_allocator",
        "free",
        r"free_queue\[page\] = None",
        r"free_queue\[page\] = ",
        "the free queue's values are never read; only its keys and their order matter",
    ),
    (
        "sampler",
        "draw",
        r"searchsorted|missed",
        r".",
        "guards a rounding case at the top of a block's range (a uniform within 2**-24 of 1) that "
        "no draw reaches; otherwise the draw is unchanged",
    ),
    (
        "sampler",
        "apply_top_k_top_p",
        r"if bool\(\(top_k >= num_candidates\)",
        r".",
        "an early return that skips work: masking with k = all and p = 1 changes no logit",
    ),
    (
        "sampler",
        "apply_top_k_top_p",
        r"mass_before >= top_p|top_p >= 1\.0, torch\.inf",
        r"mass_before > top_p|top_p (> 1\.0|>= 2\.0)",
        "a tie of continuous mass with top_p has probability 0, and top_p = 1 kept as 1 masks only "
        "tokens whose preceding mass rounds to 1 (probability below 1e-7)",
    ),
    (
        "sampler",
        "apply_top_k_top_p|candidate_groups",
        r"top_k > 0",
        r"top_k >= 0",
        "top_k is never 0: SamplingParams turns 0 into -1",
    ),
    (
        "sampler",
        "_keeps_every_candidate",
        r"top_k <= 0",
        r"top_k < 0",
        "top_k is never 0: SamplingParams turns 0 into -1",
    ),
    (
        "sampler",
        "inverse_cdf",
        r"block = min\(block, n\)",
        r"max\(block, n\)",
        "the width only splits the scan in two: a block as wide as the row (or wider, its columns "
        "past the row masked) finds the same first index past u",
    ),
    (
        "sampler",
        "inverse_cdf",
        r"cols >= n|if full < n|max=sums\.shape\[1\] - 1|max=block - 1",
        r"cols > n|full <= n|sums\.shape\[1\] \+ 1|block \+ 1",
        "guards a target that rounding puts past the row's or its block's last weighed entry (u "
        "within 2**-24 of 1, or a block's running sum ending below its vectorised sum); no draw of "
        "the tests reaches it, and elsewhere the index is the same",
    ),
    (
        "sampler",
        "apply_min_p",
        r"if not any\(p\.min_p > 0 ",
        r"p\.min_p >= 0 ",
        "an early return that skips work: min_p = 0 masks nothing",
    ),
    (
        "sampler",
        "candidate_groups",
        r"(plain|nucleus) = \[",
        r".",
        "a row put in one more candidate group is drawn again there with its own top_k/top_p "
        "applied, from the same distribution, and that later draw stands",
    ),
    (
        "sampler",
        "_nucleus_groups",
        r"log_mass\.exp\(\) >= top_p",
        r"\) > top_p|k <= logits",
        "a tie of continuous mass with top_p has probability 0; with k = vocab the rest column "
        "holds no mass and top_p masks it",
    ),
    (
        "sampler",
        "_nucleus_groups",
        r"clamp\(max=1 - 1e-7\)|ids\[f, :1\]",
        r".",
        "the rest column holds the mass beyond the candidates and top_p always masks it: its id "
        "and its clamp never reach a draw",
    ),
    (
        "sampler",
        "_nucleus_groups",
        r"slow = ",
        r"bool\(None\)",
        "a row drawn by both the bounded and the full-sort path keeps the full-sort draw, of the "
        "same distribution",
    ),
    (
        "structured_manager",
        "__init__",
        r'thread_name_prefix="grammar"',
        r"thread_name_prefix=(None|\"XXgrammarXX\"|\"GRAMMAR\")|\(1, \)",
        "the compiling thread's name is read by nothing: no log format shows %(threadName)s; it "
        "only labels the thread in a debugger's stack dump",
    ),
    (
        "core_client",
        "__init__",
        r'name="engine-core", daemon=True\)',
        r'name=(None|"XXengine-coreXX"|"ENGINE-CORE"), daemon|target=self\._run, daemon=True\)',
        "the in-process core thread's name is read by nothing: no log format shows "
        "%(threadName)s; it only labels the thread in a debugger's stack dump",
    ),
    (
        "core_client",
        "__init__|_make_ipc_dir",
        r'self\.ipc_dir = ""$',
        r"self\.ipc_dir = None$",
        "no directory yet: read only as a truth value (shutdown removes it if set), and None is "
        "falsy, as the empty string is",
    ),
    (
        "core_client",
        "_wait_ready",
        r"poller\.register\(self\.output_socket, zmq\.POLLIN\)",
        r"poller\.register\(self\.output_socket, \)",
        "the default flags add POLLOUT, which a PULL socket never signals (it cannot send): "
        "the same events",
    ),
    (
        "core_client",
        "_wait_ready",
        r"poller\.register\(self\.proc\.sentinel, zmq\.POLLIN\)",
        r"poller\.register\(self\.proc\.sentinel, \)",
        "the default flags add POLLOUT, and a process's sentinel is the read end of a pipe, which "
        "poll never reports writable: the same events",
    ),
    (
        "core_client",
        "send",
        r"copy=False\)",
        r"copy=None\)",
        "pyzmq reads copy as a truth value: None is falsy, as False is",
    ),
    (
        "core_client",
        "shutdown",
        r"self\.send\(\[SHUTDOWN\], block=False\)",
        r"block=None\)",
        "send reads block as a truth value: None is falsy, as False is",
    ),
    (
        "core_client",
        "_run",
        r"input_socket\.close\(linger=0\)",
        r"linger=(None|1)\)",
        "the core's input socket is a PULL socket, which sends nothing: its linger (how long "
        "unsent messages are kept after close) has nothing to keep",
    ),
    (
        "core_client",
        "_run",
        r"output_socket\.close\(linger=1000\)",
        r"linger=(None|1001)\)",
        "the in-process core's sockets are inproc ones, whose messages libzmq writes straight "
        "into the peer's pipe: the peer reads them after the writer closed whatever its linger "
        "(pyzmq 27.3 / libzmq 4.3.5: 100 messages, then close with linger 0, 1000 or None, all "
        "100 read 1.5 s later), and close returns at once; a linger bounds only the context's "
        "term(), and the process's shared context is never terminated",
    ),
    (
        "core_client",
        "send",
        r"NOBLOCK, copy=False\)",
        r"NOBLOCK, (copy=True)?\)",
        "copy only picks whether pyzmq copies the message into its frame or lends it the "
        "buffer: encode returns bytes, which nothing can change, so the same frame is sent; "
        "only the cost of copying a message over 64 KiB differs (pyzmq copies a smaller one "
        "either way)",
    ),
    (
        "core_client",
        "__init__",
        r"self\.closed = False$",
        r"self\.closed = None$",
        "read only as a truth value (send, the engine client's shutdown): None is falsy, as "
        "False is",
    ),
    (
        "async_engine",
        "__init__",
        r"self\.(draining|_stopping) = False$",
        r"self\.(draining|_stopping) = None$",
        "read only as a truth value (draining by the server's admission and its drain, "
        "_stopping by _on_dead), and set True to mean yes: None is falsy, as False is",
    ),
    (
        "async_engine",
        "pause|resume",
        r"\[UTILITY, -1, ",
        r"\[UTILITY, -2, ",
        "the call id only comes back in the core's reply, to answer no pending call: the client "
        "numbers its calls from 0, so any negative id answers none",
    ),
    (
        "structured_manager",
        "accept_token",
        r"so\.matcher if so\.matcher is not None else",
        r"so\.matcher if \(so\.matcher is not None\) and False else",
        "matcher_for returns the live matcher when there is one and replays only when it was "
        "released: the shortcut only saves copying the output list",
    ),
    (
        "structured_manager",
        "request",
        r"popitem\(last=False\)",
        r"last=None",
        "None is falsy: popitem pops the head as with False",
    ),
    (
        "structured_manager",
        "shutdown",
        r"wait=False",
        r"wait=None",
        "the executor reads wait as a truth value: None is False",
    ),
    (
        "messages",
        "encode",
        r"packb\(message, use_bin_type=True\)",
        r"packb\(message, \)",
        "use_bin_type=True is msgpack's default since 1.0 (1.2.4 installed): the same bytes",
    ),
    (
        "messages",
        "decode",
        r"raw=False, strict_map_key=False",
        r"\(data, (raw=None, )?strict_map_key=False\)|raw=False, strict_map_key=None",
        "raw=False is msgpack's default since 1.0 (1.2.4 installed), and msgpack reads these "
        "flags as truth values: None is False",
    ),
    (
        "limits",
        "can_fit",
        r"-\(-num_tokens // self\.block_size\) <=",
        r"-\(-num_tokens / self\.block_size\) <=",
        "the page count is an integer, and ceil(x) <= k exactly when x <= k for an integer k: "
        "the exact quotient decides as its ceiling does",
    ),
    (
        "faults",
        "restore",
        r"source\.to\(self\.tensors\[p\.tag\]\.device\)",
        r"source\.to\(None\)",
        "the tests run on the CPU, where the emulated device's weight tier and the rebuilt "
        "checkpoint both live: .to(None) and .to(the tier's device) return the same tensor; only "
        "a weight tier on an accelerator tells these apart",
    ),
    (
        "sampler",
        "apply_penalties",
        r"vocab_size, logits\.device\)",
        r"vocab_size, None\)",
        "the tests run on the CPU, where torch puts a new tensor on the CPU whatever device is "
        "named; only a run on an accelerator tells these apart",
    ),
    (
        "sampler",
        "apply_penalties",
        r"logits > 0",
        r"logits >= 0",
        "a zero logit is 0 whether divided or multiplied",
    ),
    ("sampler", "apply_min_tokens", r'float\("-inf"\)', r"-INF", 'float("-INF") is -inf'),
    (
        "sampler",
        "token_counts",
        r"vocab_size \+ 1",
        r"vocab_size \+ 2",
        "the pad columns past the vocabulary are dropped",
    ),
    (
        "sampler",
        "token_counts|_logprob_dicts",
        r"default=0",
        r"default=1",
        "max over the rows of a batch; with no rows, k = 1 or 0 selects the same nothing",
    ),
    (
        "sampler",
        "token_counts",
        r"default=0",
        r".",
        "max over the rows of a batch, which has a row here: apply_penalties returns before "
        "counting an empty batch",
    ),
    (
        "kernels",
        "_causal_attention",
        r'einsum\("[a-z]+,[a-z]+->[a-z]+"',
        r'einsum\("[A-Z]+,[A-Z]+->[A-Z]+"',
        "einsum's subscripts are letters of either case: the same contraction",
    ),
    (
        "kernels",
        "_causal_attention",
        r'float\("-inf"\)',
        r'float\("-INF"\)',
        "float() reads infinity in any case",
    ),
    (
        "kernels",
        "rotary_cos_sin",
        r"torch\.arange\(max_position, dtype=torch\.float32\)",
        r"torch\.arange\(max_position, (dtype=None)?\)",
        "torch.outer promotes the integer positions against the fp32 inv_freq: below 2^24 they "
        "become the same fp32 values, whatever the default dtype",
    ),
    (
        "kernels",
        "rotary_cos_sin",
        r"dim=-1\)$",
        r"dim=\+1\)$",
        "the angles are [max_position, rotary_dim / 2]: dim 1 is their last",
    ),
    (
        "kernels",
        "apply_rotary",
        r"\.flatten\(-2\)$",
        r"\.flatten\(\+2\)$",
        "x is [T, heads, head_dim] (the contract; the model's only shape), so the stacked pairs "
        "are 4-D and dim 2 is the second last",
    ),
    (
        "kernels",
        "gather_context",
        r"num_blocks = -\(-context_len // block_size\)",
        r"num_blocks = None",
        "only how many pages are gathered before the cut to context_len: the same rows",
    ),
    (
        "memory_plan",
        "_host_limit",
        r'float\("inf"\)',
        r'float\("INF"\)',
        "float() reads infinity in any case",
    ),
    (
        "memory_plan",
        "explain",
        r"for i in range\(2\)\]$",
        r"for i in range\(3\)\]$",
        "a width of the third column too, which no row pads to: the rows use width[0] and "
        "width[1] only",
    ),
    (
        "memory_plan",
        "_smallest_fitting_tp",
        r'check_tensor_parallel\("", model, tp\)',
        r"check_tensor_parallel\((None|\"XXXX\"), model, tp\)",
        "the name only goes into the message of a TuneError that the loop catches and drops, "
        "trying the next size",
    ),
    (
        "fault_recovery",
        "__init__",
        r'environ\.get\("PAGEDSERVE_FAULT_RECOVERY", "on"\) != "off"',
        r'environ\.get\("PAGEDSERVE_FAULT_RECOVERY", (None|"XXonXX"|"ON")?\) != "off"',
        'the default (the variable unset) is only compared with "off": any other default, '
        'None included, means on, as "on" does',
    ),
    (
        "fault_recovery",
        "recover_host_frames",
        r"why = \"a host-tier KV fault\" if fault else",
        r".",
        "why is read only by the warning logged for each request that recomputes: the text of "
        "a log line",
    ),
    (
        "fault_recovery",
        "fail_step",
        r"swap_out\], fault=False\)$",
        r"swap_out\], fault=None\)$",
        "recover_host_frames reads fault only as a truth value: None is falsy, as False is",
    ),
    (
        "model_runner",
        "from_tensor",
        r"2 \* SO, 2 \* SI\]$",
        r"2 \* SO, 3 \* SI\]$",
        "the swap-ins are the tensor's last field: their slice runs to its end whatever length "
        "it is given",
    ),
    (
        "model_runner",
        "to_tensor",
        r"for x in f\], dtype=torch\.long\)$",
        r"for x in f\], (dtype=None)?\)$",
        "a list of Python ints: torch infers int64, torch.long, the dtype given",
    ),
    (
        "model_runner",
        "__init__",
        r"Sampler\(argmax=device\.argmax, categorical=device\.categorical\(\)\)",
        r"Sampler\((argmax=device\.argmax, (categorical=None)?|categorical=device\.categorical\(\))\)",
        "the device's argmax and draw are the backend's one-call versions of the sampler's own "
        "(the same token: tests/hal/test_native_kernels.py checks them against PyTorch's); only "
        "their speed differs",
    ),
    (
        "model_runner",
        "_sample",
        r"drafts\[:j\] if j else",
        r"drafts\[:j\] if \(j\) or True else",
        "for j = 0 the drafts before the row, drafts[:0], are none: the same output tokens",
    ),
    (
        "model_runner",
        "prepare_inputs",
        r"if end - start == 1:",
        r"if end \+ start == 1:",
        "the one-token branch is a fast path that lays out what the general one does for one "
        "token (a chunk of one has no drafts): the mutant only sends decodes the general way",
    ),
    (
        "model_runner",
        "prepare_inputs",
        r"sched\.scheduled\), default=0\)$",
        r"sched\.scheduled\), default=(None|1)\)$",
        "the default is the width of an empty batch, where no table is padded to it",
    ),
    (
        "core|async_engine",
        ".*",
        r"(self\.(stopping|parent_gone|paused)|engine\.detokenize|unread\[0\]|finished) = False$",
        r" = None$",
        "a flag read only as a truth value (if, not, while not), where None is False",
    ),
    (
        "core",
        "run_engine_core",
        r"output_socket\.close\(linger=\d+\)$",
        r"output_socket\.close\(linger=\d+\)$",
        "a millisecond more for close to deliver what is queued: a reading peer gets the same "
        "messages, a gone one none either way",
    ),
    (
        "core",
        "run_engine_core",
        r"input_socket\.close\(linger=0\)$",
        r"input_socket\.close\(linger=(None|1)\)$",
        "the input socket is a PULL, which never queues a message to send: how long its close "
        "waits for them does not matter",
    ),
    (
        "core",
        "__init__",
        r"register\(input_socket, zmq\.POLLIN\)$",
        r"register\(input_socket, \)$",
        "a PULL socket never reports POLLOUT (it cannot send): polling it for POLLIN|POLLOUT, "
        "the default, polls for input alone",
    ),
    (
        "core",
        "_process_input",
        r"poll\(HEARTBEAT_S \* 1000\)",
        r"poll\(HEARTBEAT_S \* 1001\)",
        "a heartbeat half a millisecond later",
    ),
    (
        "core|async_engine",
        "_process_input|_output_handler",
        r"recv\((zmq\.NOBLOCK, )?copy=False\)$",
        r"recv\((zmq\.NOBLOCK, )?copy=None\)$",
        "pyzmq reads copy as a truth value: None, as False, hands back a Frame, whose buffer "
        "is read",
    ),
    (
        "core",
        "_send_outputs",
        r"copy=False\)$",
        r"(copy=(None|True)|, )\)$",
        "copy only chooses whether zmq copies the encoded bytes or takes them as they are: the "
        "peer receives the same message",
    ),
    (
        "executor",
        "shutdown|check_main_module",
        r"self\.joined = False$|\"_inheriting\", False\)",
        r"self\.joined = None$|\"_inheriting\", None\)",
        "a flag read only as a truth value (shutdown's if self.joined; check_main_module's if on "
        "the process's _inheriting), where None is False",
    ),
    (
        "executor",
        "_exit_with_parent",
        r'name="pagedserve-parent-watch", daemon=True\)',
        r'name=(None|"XXpagedserve-parent-watchXX"|"PAGEDSERVE-PARENT-WATCH"), daemon|'
        r"target=watch, daemon=True\)",
        "the watching thread's name is read by nothing: no log format shows %(threadName)s; it "
        "only labels the thread in a debugger's stack dump",
    ),
    (
        "executor",
        "_send",
        r"torch\.tensor\(\[kind, size\], dtype=torch\.long, ",
        r"torch\.tensor\(\[kind, size\], (dtype=None, )?device",
        "kind and size are Python ints, from which torch infers int64: the dtype given",
    ),
    (
        "executor",
        "run_worker",
        r'log_level: str = "info",',
        r'log_level: str = "INFO",',
        "the level is read only as log_level.upper(): the same level",
    ),
    (
        "worker",
        "_init_host_tier",
        r"2\*\*30 // self\.page_bytes\)\)$",
        r"2\*\*30 / self\.page_bytes\)\)$",
        "both operands are positive, and a float quotient never rounds up to the integer above "
        "it (an exact quotient below k is at least k * 2**-53 below, more than half the spacing "
        "of the floats below k): int() of it is the floor that // gives",
    ),
]

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped"}
STATUS |= {36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout"}


def module_config(path: str, tests: list[str]) -> str:
    """pyproject.toml's [tool.mutmut], narrowed to one module and its tests."""
    shared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    config = {**shared, "only_mutate": [path], "pytest_add_cli_args_test_selection": tests}
    lines = ["[tool.mutmut]"]
    for key, value in config.items():
        lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def prepare(module: str) -> Path:
    """A copy of the working tree (tracked and new files) whose pyproject mutates ``module``."""
    path, tests = MODULES[module]
    work = WORK / module
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        src, dst = ROOT / name, work / name
        if src.is_file() and (not dst.exists() or dst.read_bytes() != src.read_bytes()):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    head = (ROOT / "pyproject.toml").read_text().split("[tool.mutmut]")[0]
    (work / "pyproject.toml").write_text(head + module_config(path, tests))
    return work


def run(module: str, survivors_only: bool = False) -> None:
    """mutmut over the module; mutants with a result are skipped, unless ``survivors_only``
    asks to retest those that survived (after new tests)."""
    names = [n for n, s in results(module).items() if s not in ("killed", "timeout")]
    if survivors_only:  # equivalent ones would only survive again
        names = [n for n in names if equivalence(module, n, diff(module, n)) is None]
    if survivors_only and not names:
        return
    work = prepare(module)
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", "1"]
    cmd += names if survivors_only else []
    print(f"== {module}: {' '.join(cmd[:6])} ({len(names)} survivors) in {work}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(work), "HYPOTHESIS_PROFILE": "mutation"}
    subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, check=False)


def results(module: str) -> dict[str, str]:
    """mutant name -> status, from mutmut's records of the last run."""
    path = MODULES[module][0]
    meta = WORK / module / "mutants" / (path + ".meta")
    if not meta.exists():
        return {}
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    return {
        name: STATUS.get(code, "not checked" if code is None else "suspicious")
        for name, code in codes.items()
    }


def diff(module: str, name: str) -> list[str]:
    """The mutant's changed lines, '-' then '+', as mutmut shows them."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    cwd = os.getcwd()
    os.chdir(WORK / module)
    try:
        text = get_diff_for_mutant(name, path=Path(MODULES[module][0]))
    finally:
        os.chdir(cwd)
    return [ln for ln in text.splitlines() if re.match(r"^[-+](?![-+]{2} )", ln)]


def equivalence(module: str, name: str, lines: list[str]) -> str | None:
    """The reason a surviving mutant is equivalent, if a rule covers its one changed line."""
    removed = [ln[1:] for ln in lines if ln.startswith("-")]
    added = [ln[1:] for ln in lines if ln.startswith("+")]
    if len(removed) != 1 or len(added) != 1:
        return None
    old, new = removed[0], added[0]
    function = re.sub(r"__mutmut_\d+$", "", name.rsplit(".", 1)[-1]).rsplit("ǁ", 1)[-1]
    function = function.removeprefix("x_")
    for rule_module, fn, old_re, new_re, reason in MATCH_RULES:
        if re.fullmatch(rule_module, module) and re.fullmatch(fn, function):
            if re.search(old_re, old) and re.search(new_re, new):
                return reason
    for rule_module, pattern, reason in DROP_RULES:
        if re.fullmatch(rule_module, module) and _drop(old, pattern) == _drop(new, pattern):
            return reason
    return None


def _drop(line: str, pattern: str) -> str:
    line = re.sub(pattern, "", line)
    line = re.sub(r",\s*(?=[,)])", "", line)
    return re.sub(r"\(\s*,", "(", line).replace(" ", "")


def summary(module: str) -> dict:
    statuses = results(module)
    killed = [n for n, s in statuses.items() if s in ("killed", "timeout")]
    diffs = {n: diff(module, n) for n in statuses if n not in killed}
    equivalent = {n: r for n in diffs if (r := equivalence(module, n, diffs[n])) is not None}
    survived = sorted(n for n in diffs if n not in equivalent)
    counted = len(statuses) - len(equivalent)
    return {
        "file": MODULES[module][0],
        "tests": MODULES[module][1],
        "mutants": len(statuses),
        "killed": len(killed),
        "equivalent": len(equivalent),
        "survived": len(survived),
        "kill_rate": round(len(killed) / counted, 4) if counted else None,
        "kill_rate_of_all": round(len(killed) / len(statuses), 4) if statuses else None,
        # the modules are run on different days, and the CPU of these machines changes
        "run_on": _machine(),
        "reported": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "equivalent_mutants": [
            {"name": n, "reason": r, "diff": diffs[n]} for n, r in sorted(equivalent.items())
        ],
        "surviving_mutants": [
            {"name": n, "status": statuses[n], "diff": diffs[n]} for n in survived
        ],
    }


def report(modules: list[str]) -> bool:
    """The table of ``modules``: from this tree's runs, or as last recorded for a module that has
    no run here (a fresh checkout has no ``.mutation/``); writes the runs and the README table."""
    stored = json.loads(RESULTS.read_text())["modules"] if RESULTS.exists() else {}
    rows = {m: summary(m) for m in modules if results(m)}
    table = {
        m: rows.get(m) or stored[m] for m in MODULES if m in modules and (m in rows or m in stored)
    }
    print(f"{'module':<16} {'mutants':>7} {'killed':>7} {'equiv':>6} {'alive':>6} {'rate':>7}")
    for module, r in table.items():
        rate = "-" if r["kill_rate"] is None else f"{100 * r['kill_rate']:.1f}%"
        print(
            f"{module:<16} {r['mutants']:>7} {r['killed']:>7} {r['equivalent']:>6} "
            f"{r['survived']:>6} {rate:>7}"
        )
    _write(rows)
    _write_readme()
    return len(table) == len(modules) and all(
        r["kill_rate"] is not None and r["kill_rate"] >= TARGET for r in table.values()
    )


def _write(rows: dict) -> None:
    import mutmut
    import torch

    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    modules = {**old.get("modules", {}), **rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),  # of this report; each module's run_on is the machine of its run
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mutmut": getattr(mutmut, "__version__", "3.8.1"),
        "command": "taskset -c 1 nice -n 10 python tools/mutation.py",
        "target_kill_rate": TARGET,
        "modules": modules,
    }
    RESULTS.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


def _write_readme() -> None:
    """The README's table of every recorded module, between its results markers."""
    modules = json.loads(RESULTS.read_text())["modules"]
    lines = [
        "| module | mutants | killed | equivalent (listed) | survived | kill rate |",
        "|---|---|---|---|---|---|",
    ]
    for r in (modules[m] for m in MODULES if m in modules):
        rate = "-" if r["kill_rate"] is None else f"{100 * r['kill_rate']:.1f}%"
        rate = rate.replace(".0%", "%")
        lines.append(
            f"| `{r['file']}` | {r['mutants']} | {r['killed']} | {r['equivalent']} "
            f"| {r['survived']} | {rate} |"
        )
    marker = f"<!-- results: {RESULTS.relative_to(ROOT)} -->"
    text = README.read_text()
    start = text.index(marker) + len(marker)
    end = text.index("<!-- /results -->", start)
    README.write_text(text[:start] + "\n" + "\n".join(lines) + "\n" + text[end:])
    print(f"wrote the table in {README.relative_to(ROOT)}")


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), flags=re.M)
        cpu = names[0] if names else cpu
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"default: all of {', '.join(MODULES)}")
    parser.add_argument("--report", action="store_true", help="only print and save the table")
    parser.add_argument(
        "--survivors", action="store_true", help="retest only the mutants that survived last time"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.modules) - set(MODULES))
    if unknown:
        parser.error(f"unknown module {unknown[0]!r}; choose from {', '.join(MODULES)}")
    modules = args.modules or list(MODULES)
    if not args.report:
        for module in modules:
            run(module, args.survivors)
    return 0 if report(modules) else 1


if __name__ == "__main__":
    sys.exit(main())
