"""The Ray Serve application's flags without starting Ray: the builder takes serve's flags as
``serve run``'s ``key=value`` strings or a config file's values, the deployments get the
replicas, autoscaling, router, health checks and drain those flags ask for, and a missing Ray
or a missing backend is a message naming the fix."""

from __future__ import annotations

import sys

import pytest

from pagedserve.entrypoints.cli.main import build_parser
from pagedserve.entrypoints.cli.serve import run_serve
from tests.helpers.tools import require_module

require_module("ray", "the Ray Serve tests need Ray: pip install 'pagedserve[ray]'")


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def engine_options(*argv: str) -> dict:
    from pagedserve.config import EngineConfig
    from pagedserve.entrypoints.cli.serve import engine_kwargs
    from pagedserve.entrypoints.ray_serve.app import _engine_options

    args = serve_args(*argv)
    return _engine_options(args, EngineConfig.from_kwargs(**engine_kwargs(args)))


def test_the_builder_reads_serve_run_key_value_strings_and_config_file_values():
    from pagedserve.entrypoints.ray_serve import parse_cli_args

    args = parse_cli_args(
        {"model": "demo", "data-parallel-size": "3", "enforce_eager": "true", "max-num-seqs": 4}
    )
    assert (args.model, args.data_parallel_size, args.enforce_eager, args.max_num_seqs) == (
        "demo",
        3,
        True,
        4,
    )
    assert parse_cli_args({"enable-prefix-caching": "false"}).enable_prefix_caching is False
    with pytest.raises(SystemExit):
        parse_cli_args({"no-such-flag": "1"})


def test_the_builder_gives_ray_serve_an_application_and_refuses_a_bad_flag_value():
    from ray.serve import Application

    from pagedserve.entrypoints.ray_serve import build_app

    assert isinstance(build_app({"model": "demo", "data-parallel-size": "2"}), Application)
    with pytest.raises(ValueError, match="--block-size 0"):
        build_app({"model": "demo", "block-size": "0"})


def test_a_fixed_number_of_replicas_with_the_router_health_checks_and_drain():
    from pagedserve.entrypoints.ray_serve.router import PowerOfTwoRouter

    options = engine_options(
        *("-dp", "3", "--max-num-seqs", "8", "--shutdown-timeout", "45"),
        *("--request-router", "power-of-two", "--num-cpus-per-replica", "0.5"),
    )
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    assert options["max_ongoing_requests"] == 16  # two batches
    assert options["ray_actor_options"] == {"num_cpus": 0.5}
    assert options["graceful_shutdown_timeout_s"] == 45
    router = options["request_router_config"]
    assert router.get_request_router_class().__name__ == PowerOfTwoRouter.__name__
    assert router.request_router_kwargs == {"block_size": 16, "imbalance_threshold": 8}
    assert options["health_check_period_s"] <= 5


def test_autoscaling_flags_become_ray_serves_autoscaling_config():
    options = engine_options(
        *("-dp", "2", "--min-replicas", "1", "--max-replicas", "4"),
        *("--target-ongoing-requests", "6", "--max-replicas-per-node", "1"),
    )
    auto = options["autoscaling_config"]
    assert (auto.min_replicas, auto.initial_replicas, auto.max_replicas) == (1, 2, 4)
    assert auto.target_ongoing_requests == 6
    assert "num_replicas" not in options and options["max_replicas_per_node"] == 1
    default_target = engine_options("--max-replicas", "2", "--max-num-seqs", "5")
    assert default_target["autoscaling_config"].target_ongoing_requests == 5  # a full batch
    with pytest.raises(ValueError, match="--data-parallel-size 5 .* --max-replicas 4"):
        engine_options("-dp", "5", "--max-replicas", "4")


def test_data_parallel_replicas_without_the_ray_backend_are_refused(capsys):
    assert run_serve(serve_args("-dp", "2")) == 2
    assert "--data-parallel-size 2 needs --data-parallel-backend ray" in capsys.readouterr().err


def test_without_ray_the_backend_flag_says_how_to_install_it(monkeypatch, capsys):
    for name in list(sys.modules):
        if name.split(".")[0] == "ray" or name.startswith("pagedserve.entrypoints.ray_serve"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert run_serve(serve_args("-dp", "2", "--data-parallel-backend", "ray")) == 2
    assert "pip install 'pagedserve[ray]'" in capsys.readouterr().err
