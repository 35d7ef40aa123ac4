"""The Ray Serve application: ``openai`` (one ingress, ``ingress.OpenAIIngress``) over ``engine``
(the data-parallel replicas, ``replica.EngineReplica``), with the routing policy, autoscaling,
health checks and drain that the serve flags set.

Two ways in:
- ``pagedserve serve --data-parallel-backend ray ...`` (``run_serve``): joins a Ray cluster or
  starts a Ray instance on this machine, runs the application behind one HTTP port, and on
  SIGTERM drains it;
- Ray Serve's application builder, ``pagedserve.entrypoints.ray_serve:build_app``, for ``serve
  run`` and the ``import_path`` of a ``serve deploy`` config file (KubeRay's RayService).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from pagedserve.entrypoints.ray_serve.ingress import OpenAIIngress
from pagedserve.entrypoints.ray_serve.replica import EngineReplica
from pagedserve.entrypoints.ray_serve.router import POLICIES

logger = logging.getLogger("pagedserve.ray_serve")

APP_NAME = "pagedserve"
HEALTH_CHECK_PERIOD_S = 2.0  # the engine's own liveness is a cheap check: look often
HEALTH_CHECK_TIMEOUT_S = 30.0
ROUTING_STATS_PERIOD_S = 1.0  # how often each replica reports its figures to the router
DRAIN_POLL_S = 0.2
INGRESS_MAX_ONGOING_REQUESTS = 100_000  # the ingress only relays: it queues nothing itself


def application(
    args: argparse.Namespace, engine_kwargs: dict[str, Any], tools: dict[str, Any]
) -> Application:
    """The application the serve flags describe (``engine_kwargs`` and ``tools``: the engine's
    and the tool flags as ``cli.serve`` reads them); ``ValueError`` names a bad flag."""
    from pagedserve.config import EngineConfig

    kwargs = engine_kwargs
    config = EngineConfig.from_kwargs(**kwargs)  # a bad flag fails here, before Ray does anything
    engine = serve.deployment(EngineReplica, name="engine", **_engine_options(args, config))
    ingress = serve.deployment(
        OpenAIIngress,
        name="openai",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},  # it relays; the replicas hold the CPUs
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        graceful_shutdown_timeout_s=args.shutdown_timeout,
    )
    return ingress.bind(engine.bind(kwargs, args.log_level), _app_settings(args, tools))


def _engine_options(args: argparse.Namespace, config) -> dict[str, Any]:
    max_num_seqs = config.scheduler.max_num_seqs
    options: dict[str, Any] = {
        "max_ongoing_requests": args.max_ongoing_requests or 2 * max_num_seqs,
        "ray_actor_options": {"num_cpus": args.num_cpus_per_replica},
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": args.shutdown_timeout,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
        "request_router_config": RequestRouterConfig(
            request_router_class=POLICIES[args.request_router],
            request_router_kwargs={
                "block_size": config.cache.block_size,
                "imbalance_threshold": args.router_imbalance_threshold,
            },
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
    }
    if args.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = args.max_replicas_per_node
    if args.min_replicas is None and args.max_replicas is None:
        options["num_replicas"] = args.data_parallel_size
        return options
    low = args.min_replicas if args.min_replicas is not None else 1
    high = args.max_replicas if args.max_replicas is not None else max(low, args.data_parallel_size)
    if not low <= args.data_parallel_size <= high:
        raise ValueError(
            f"--data-parallel-size {args.data_parallel_size} is the number of replicas to start "
            f"with: it must lie between --min-replicas {low} and --max-replicas {high}"
        )
    options["autoscaling_config"] = AutoscalingConfig(
        min_replicas=low,
        max_replicas=high,
        initial_replicas=args.data_parallel_size,
        target_ongoing_requests=args.target_ongoing_requests or max_num_seqs,
    )
    return options


def _app_settings(args: argparse.Namespace, tools: dict[str, Any]) -> dict[str, Any]:
    """``server.app.build_app``'s settings, as ``pagedserve serve`` gives them."""
    return {
        "served_model_name": args.served_model_name or args.model,
        "api_key": args.api_key or os.environ.get("PAGEDSERVE_API_KEY"),
        "max_queue_len": args.max_queue_len,
        "web_ui": not args.disable_web_ui,
        "enable_fault_injection": bool(args.enable_fault_injection),
        "max_logprobs": args.max_logprobs,
        "max_request_body": args.max_request_body,
        "allowed_origins": args.allowed_origins,
        "tool_parser_plugin": args.tool_parser_plugin,
        **tools,
    }


# ---- pagedserve serve --data-parallel-backend ray ----------------------------------------------
def run_serve(args: argparse.Namespace, app: Application) -> int:
    """Serve ``app`` until SIGTERM or Ctrl-C, then drain: 503 to new requests, those in flight
    finish for up to --shutdown-timeout, and the application is removed (with the Ray instance,
    if this command started it)."""
    import ray

    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    ray.init(address=address or "local", log_to_driver=True, include_dashboard=False)
    stop = _StopSignal()  # after ray.init, which installs handlers of its own
    try:
        serve.start(http_options={"host": args.host, "port": args.port}, proxy_location="HeadOnly")
        handle = serve.run(app, name=APP_NAME, route_prefix="/")
        logger.info(
            "serving %s on http://%s:%d: %d replicas on Ray Serve (%s routing)",
            args.served_model_name or args.model,
            args.host,
            args.port,
            args.data_parallel_size,
            args.request_router,
        )
        stop.wait()
        _drain(handle, args.shutdown_timeout)
        return 0
    finally:
        stop.restore()
        if address:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()


def _drain(handle, timeout: float) -> None:
    """The ingress admits nothing new; wait for what it holds, up to ``timeout`` seconds (the
    replicas then drain within the same bound as Ray Serve stops them)."""
    in_flight = handle.drain.remote().result()
    logger.info("draining %d requests in flight for up to %g s", in_flight, timeout)
    deadline = time.monotonic() + timeout
    while in_flight and time.monotonic() < deadline:
        time.sleep(DRAIN_POLL_S)
        in_flight = handle.num_unfinished.remote().result()
    if in_flight:
        logger.warning("%d requests still in flight after --shutdown-timeout", in_flight)


class _StopSignal:
    """SIGTERM or SIGINT, waited for on the main thread."""

    def __init__(self):
        self.event = threading.Event()
        self.previous = {
            sig: signal.signal(sig, lambda *_: self.event.set())
            for sig in (signal.SIGTERM, signal.SIGINT)
        }

    def wait(self) -> None:
        while not self.event.wait(0.5):
            pass

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
