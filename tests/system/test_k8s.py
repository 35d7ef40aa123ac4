"""The Kubernetes manifests of deploy/k8s/, without a cluster: every flag they pass is one serve
takes, with a value it accepts; every port and probe path they name is one the server listens on
and serves; the grace period covers the drain; the HPA's metric is one the server exports; the
RayService's application is our builder with serve's flags and the Ray version we pin."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


def documents(name: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((K8S / name).read_text())}


@pytest.fixture(scope="module")
def plain() -> dict[str, dict]:
    return documents("deployment.yaml")


@pytest.fixture(scope="module")
def rayservice() -> dict:
    return documents("rayservice.yaml")["RayService"]


@pytest.fixture(scope="module")
def routes() -> set[str]:
    """The paths the server serves (its app over the demo engine, not started: its OpenAPI
    schema)."""
    from pagedserve.server.app import build_app
    from tests.helpers.apps import demo_engine

    return set(build_app(demo_engine()).openapi()["paths"])


def serve_args(argv: list[str]):
    from pagedserve.entrypoints.cli.main import build_parser

    return build_parser().parse_args(argv)  # SystemExit on an unknown flag or a bad value


def container(doc: dict) -> dict:
    (only,) = doc["spec"]["template"]["spec"]["containers"]
    return only


def port_number(c: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c["ports"] if p["name"] == port)


def test_the_deployments_command_is_serve_with_its_own_flags(plain):
    args = serve_args(container(plain["Deployment"])["args"])
    assert args.command == "serve" and args.host == "0.0.0.0"


def test_the_container_port_the_service_and_the_prometheus_port_are_the_servers(plain):
    c = container(plain["Deployment"])
    port = serve_args(c["args"]).port
    assert port_number(c, "http") == port
    annotations = plain["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port
    service = plain["Service"]["spec"]
    assert service["selector"] == plain["Deployment"]["spec"]["selector"]["matchLabels"]
    assert port_number(c, service["ports"][0]["targetPort"]) == port


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_every_probe_asks_a_path_the_server_serves_on_its_port(plain, routes, probe):
    c = container(plain["Deployment"])
    check = c[probe]["httpGet"]
    assert check["path"] in routes
    assert port_number(c, check["port"]) == serve_args(c["args"]).port
    from pagedserve.server.app import PUBLIC_PATHS

    assert check["path"].startswith(PUBLIC_PATHS)  # no API key needed


def test_the_grace_period_covers_the_prestop_sleep_and_the_drain(plain):
    spec = plain["Deployment"]["spec"]["template"]["spec"]
    c = container(plain["Deployment"])
    (sleep,) = [int(a) for a in c["lifecycle"]["preStop"]["exec"]["command"] if a.isdigit()]
    assert spec["terminationGracePeriodSeconds"] > sleep + serve_args(c["args"]).shutdown_timeout


def test_the_hpa_scales_the_deployment_on_the_waiting_requests_the_server_exports(plain):
    from pagedserve.server.metrics import ServerMetrics

    hpa = plain["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == plain["Deployment"]["metadata"]["name"]
    (metric,) = hpa["metrics"]
    name = metric["pods"]["metric"]["name"]
    (rule,) = yaml.safe_load((K8S / "prometheus-adapter-rules.yaml").read_text())["rules"]["custom"]
    assert rule["name"]["as"] == name
    series = re.match(r"[\w:]+", rule["seriesQuery"]).group()
    assert series == "vllm:num_requests_waiting"
    assert re.search(rf"^{series}\{{", ServerMetrics("m").render({}).decode(), re.M)


def serve_config(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def test_the_rayservice_runs_our_builder_with_serve_flags(rayservice):
    from pagedserve.entrypoints.ray_serve import parse_cli_args

    (app,) = serve_config(rayservice)["applications"]
    module, attr = app["import_path"].split(":")
    assert callable(getattr(importlib.import_module(module), attr))
    args = parse_cli_args(app["args"])  # SystemExit on an unknown flag
    assert args.data_parallel_size >= args.min_replicas
    assert args.max_replicas >= args.data_parallel_size


def test_the_rayservice_serves_on_the_heads_serve_port(rayservice):
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    (c,) = head["containers"]
    assert port_number(c, "serve") == serve_config(rayservice)["http_options"]["port"]


def test_the_rayservice_workers_grace_period_covers_a_replicas_drain(rayservice):
    from pagedserve.entrypoints.ray_serve import parse_cli_args

    (app,) = serve_config(rayservice)["applications"]
    (workers,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    grace = workers["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > parse_cli_args(app["args"]).shutdown_timeout
    assert workers["maxReplicas"] >= parse_cli_args(app["args"]).max_replicas


def test_the_rayservice_asks_for_the_ray_version_pagedserve_pins(rayservice):
    pyproject = (ROOT / "pyproject.toml").read_text()
    (pinned,) = re.findall(r'^ray = \["ray\[serve\]==([\d.]+)"\]', pyproject, re.M)
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == pinned
