"""The Docker deployment: the compose file parses, its files exist, its flags are serve's flags."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from pagedserve.engine.memory_plan import tune

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
# `pagedserve serve`'s flags (vLLM's names), as the serve issue defines them
SERVE_FLAGS = {
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--device",
    "--dtype",
    "--quantization",
    "--block-size",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-model-len",
    "--gpu-memory-utilization",
    "--tensor-parallel-size",
    "--enforce-eager",
    "--enable-prefix-caching",
    "--api-key",
    "--max-queue-len",
    "--log-level",
    "--config",
}
CONTAINER_TO_REPO = {"/app/deploy/": str(ROOT / "deploy") + "/"}


def _interpolate(value):
    """Compose's ${VAR:-default} / ${VAR-default} with every variable unset."""
    if isinstance(value, str):
        return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", value)
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict:
    return _interpolate(yaml.safe_load(COMPOSE.read_text()))


def _flags(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--")}


def _serve_parser():
    from pagedserve.entrypoints.cli.main import build_parser

    return build_parser()


def _subparser_default(command: str, dest: str):
    from pagedserve.entrypoints.cli.utils import subparser

    return subparser(_serve_parser(), command).get_default(dest)


def _local(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        for container, repo in CONTAINER_TO_REPO.items():
            arg = arg.replace(container, repo)
        out.append(arg)
    return out


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]
    return [tuple(ln.split(None, 1)) for ln in lines]


def test_compose_has_server_healthcheck_restart_and_model_volume(compose):
    server = compose["services"]["pagedserve"]
    assert server["build"] == "."
    assert (ROOT / "Dockerfile").is_file()
    assert server["restart"] in ("always", "unless-stopped", "on-failure")
    assert any("/health" in part for part in server["healthcheck"]["test"])
    assert any(v.endswith(":/models:ro") for v in server["volumes"])
    assert "8000" in server["ports"][0]


def test_scale_out_profile_puts_replicas_behind_nginx(compose):
    services = compose["services"]
    replica, nginx = services["replica"], services["nginx"]
    assert replica["profiles"] == nginx["profiles"] == ["scale-out"]
    assert int(replica["deploy"]["replicas"]) > 1
    assert "ports" not in replica  # only nginx is published
    assert nginx["depends_on"]["replica"]["condition"] == "service_healthy"
    conf = (ROOT / "deploy/nginx.conf").read_text()
    assert conf.count("{") == conf.count("}")
    assert re.search(r"server\s+replica:8000", conf)
    assert "proxy_buffering off" in conf


def test_compose_references_files_that_exist(compose):
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith("./deploy") or host.startswith("./configs"):
                assert (ROOT / host).exists(), f"{name} mounts missing {host}"
    for instruction, rest in _dockerfile_instructions():
        if instruction == "COPY":
            for source in rest.split()[:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


def test_compose_and_config_use_only_serve_flags(compose):
    for name in ("pagedserve", "replica"):
        command = compose["services"][name]["command"]
        assert command[0] == "serve"
        assert _flags(command) <= SERVE_FLAGS, _flags(command) - SERVE_FLAGS
    config = yaml.safe_load((ROOT / "deploy/serve.yaml").read_text())
    assert {f"--{k}" for k in config} <= SERVE_FLAGS
    cmd = dict(_dockerfile_instructions())["CMD"]
    assert cmd.startswith('["serve"') and "/app/deploy/serve.yaml" in cmd


def test_serve_parser_accepts_the_compose_command(compose):
    parser = _serve_parser()
    for name in ("pagedserve", "replica"):
        parser.parse_args(_local(compose["services"][name]["command"]))
    config = yaml.safe_load((ROOT / "deploy/serve.yaml").read_text())
    argv = ["serve", "--model", "/models/m"]
    for key, value in config.items():
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    parser.parse_args(argv)


def test_serve_parser_accepts_the_tune_launch_script():
    result = tune("glm-4-9b-chat", "kunlun-xpu-32g", max_model_len=32768, host_limit=float("inf"))
    script = result.launch_script.replace('"${MODEL_DIR:?set MODEL_DIR}"', "/models/m")
    command = script.split("exec pagedserve ", 1)[1].replace("\\\n", " ").replace('"$@"', "")
    argv = shlex.split(command)
    assert _flags(argv) <= SERVE_FLAGS
    _serve_parser().parse_args(argv)


# ---- monitoring: Prometheus and Grafana in the scale-out profile --------------------------------
DASHBOARD = ROOT / "deploy/grafana-dashboard.json"


def _mounts(service: dict) -> dict[str, str]:
    """container path -> repository path of a service's ./deploy bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        host, container = volume.split(":")[:2]
        if host.startswith("./deploy"):
            out[container] = str(ROOT / host)
    return out


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]


def test_scale_out_profile_has_prometheus_scraping_every_replica(compose):
    prometheus = compose["services"]["prometheus"]
    assert prometheus["profiles"] == ["scale-out"]
    config_file = _mounts(prometheus)["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(Path(config_file).read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    targets = {(name, sd["port"]) for sd in job["dns_sd_configs"] for name in sd["names"]}
    serve_port = _subparser_default("serve", "port")  # replicas listen on serve's default port
    assert {("replica", serve_port), ("pagedserve", serve_port)} <= targets
    assert set(compose["services"]) >= {name for name, _ in targets}


def test_grafana_loads_the_dashboard_over_the_profiles_prometheus(compose):
    grafana = compose["services"]["grafana"]
    assert grafana["profiles"] == ["scale-out"]
    mounts = _mounts(grafana)
    datasources = yaml.safe_load(
        Path(mounts["/etc/grafana/provisioning/datasources/pagedserve.yml"]).read_text()
    )["datasources"]
    (source,) = datasources
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert compose["services"]["prometheus"]["ports"][0].endswith(":9090")
    providers = yaml.safe_load(
        Path(mounts["/etc/grafana/provisioning/dashboards/pagedserve.yml"]).read_text()
    )["providers"]
    folder = providers[0]["options"]["path"]
    dashboard_mount = next(c for c, h in mounts.items() if h == str(DASHBOARD))
    assert Path(dashboard_mount).parent == Path(folder)
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == source["uid"]


def test_dashboard_panels_are_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "pagedserve"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            expr = target["expr"]
            for pair in ("()", "[]", "{}"):
                assert expr.count(pair[0]) == expr.count(pair[1]), expr
            assert '{instance=~"$instance"}' in expr, expr  # the server picker applies


def _exported(url: str, api_key: str) -> tuple[set[str], set[str]]:
    """(series names, metric family names) on a live server's /metrics after one request."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120).raise_for_status()
    text = httpx.get(f"{url}/metrics", timeout=30).text
    series = set(re.findall(r"^(pagedserve:\w+)", text, flags=re.M))
    families = set(re.findall(r"^# TYPE (pagedserve:\w+) ", text, flags=re.M))
    # prometheus_client's *_created: when a series was created, nothing to chart
    return series, {f for f in families if not f.endswith("_created")}


def test_every_metric_the_dashboard_queries_is_one_the_server_exports(live_server):
    series, families = _exported(live_server.url, live_server.api_key)
    queried = {name for expr in _dashboard_exprs() for name in re.findall(r"pagedserve:\w+", expr)}
    assert queried and queried <= series, queried - series
    # and the other way: each family the server exports has a panel
    shown = {f for f in families if any(q.startswith(f) for q in queried)}
    assert shown == families, families - shown


def test_dashboard_shows_latency_percentiles_from_histogram_buckets():
    for expr in _dashboard_exprs():
        if "histogram_quantile" in expr:
            assert "_bucket" in expr and "sum by (le)" in expr, expr
    quantiles = " ".join(_dashboard_exprs())
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(pagedserve:{histogram}" in quantiles
