"""Fuzz every operation of the server's own OpenAPI schema; count the 5xx and the hangs.

    python -m benchmarks.reliability.fuzz [--examples 100] [--seed N]

Serves the demo model in this process (uvicorn in a thread, 127.0.0.1, a free port, an API key),
then, for each operation of GET /openapi.json, sends EXAMPLES bodies that fit the schema and
EXAMPLES that do not (schemathesis: wrong types, out-of-range numbers, missing fields; the
examples are the same on every run, or drawn from --seed). The bar: no answer is a 5xx, none
takes longer than --timeout, every 400 names the field at fault (``param``) unless the body as a
whole is wrong, and a plain completion is still served afterwards. Prints the figures and writes
benchmarks/results/fuzz.json. tests/server/test_reliability_api.py runs the same with fewer examples.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from pagedserve.testing import serve_app

API_KEY = "fuzz-key"
SERVER_LIMITS = dict(max_model_len=64, max_num_seqs=4, num_kv_pages=64, block_size=16)


@contextmanager
def demo_server(**build_app_kwargs) -> Iterator[tuple[str, object]]:
    """(base URL, app) of the demo model served by uvicorn in a thread of this process; small
    limits (64 tokens of context) so that any admitted request is short."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.app import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model="demo", device="cpu", **SERVER_LIMITS))
    app = build_app(engine, "demo", api_key=API_KEY, max_queue_len=16, **build_app_kwargs)
    with serve_app(app, log_level="error") as url:
        yield url, app


def fuzz(base_url: str, examples: int, timeout: float = 30.0, seed: int | None = None) -> dict:
    """Send ``examples`` valid and ``examples`` invalid cases per operation; the figures.
    ``seed``: draw the cases from this seed (None: the same derandomized cases on every run)."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    headers = {"Authorization": f"Bearer {API_KEY}"}
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json", headers=headers)
    statuses: Counter[int] = Counter()
    server_errors: list[str] = []
    unnamed: list[str] = []  # 400s whose error names no field
    hangs: list[str] = []
    operations = 0

    def send(case) -> None:
        where = f"{case.method} {case.formatted_path} {str(case.body)[:200]}"
        try:
            response = case.call(base_url=base_url, headers=headers, timeout=timeout)
        except requests.Timeout:
            hangs.append(where)
            return
        statuses[response.status_code] += 1
        if response.status_code >= 500:
            server_errors.append(f"{response.status_code} {where}: {response.text[:300]}")
        elif response.status_code == 400 and not _names_a_field(response):
            unnamed.append(f"{where}: {response.text[:300]}")

    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            run = settings(
                max_examples=examples,
                derandomize=True,
                database=None,
                deadline=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )(given(operation.as_strategy(generation_mode=mode))(send))
            if seed is not None:
                run = with_seed(seed)(run)
            try:
                run()
            except Exception as e:  # noqa: BLE001 - an operation with nothing to make invalid
                if mode is schemathesis.GenerationMode.POSITIVE:
                    raise
                print(f"  {operation.label}: no invalid cases ({type(e).__name__})")
    return {
        "operations": operations,
        "cases": sum(statuses.values()) + len(hangs),
        "server_errors": len(server_errors),
        "hangs": len(hangs),
        "bad_requests_naming_no_field": len(unnamed),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "server_error_cases": server_errors[:20],
        "hang_cases": hangs[:20],
        "bad_requests_naming_no_field_cases": unnamed[:20],
    }


def _names_a_field(response) -> bool:
    """Whether a 400 names the field at fault (``param``), or says the body as a whole is not
    JSON, or not the object the operation takes (there is no field to name)."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return bool(error.get("param")) or error.get("message", "").startswith(WHOLE_BODY)


WHOLE_BODY = ("the request body",)


def completion_works(base_url: str) -> bool:
    import httpx

    r = httpx.post(
        base_url + "/v1/completions",
        json={"model": "demo", "prompt": "Hello", "max_tokens": 4},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    return r.status_code == 200 and len(r.json()["choices"]) == 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=100, help="cases per operation and mode")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds before a hang")
    parser.add_argument(
        "--seed", type=int, help="draw the cases from this seed (default: the same cases every run)"
    )
    args = parser.parse_args(argv)
    start = time.monotonic()
    with demo_server() as (url, _):
        figures = fuzz(url, args.examples, args.timeout, args.seed)
        figures["completion_after"] = completion_works(url)
    figures["seconds"] = round(time.monotonic() - start, 1)
    figures["examples_per_operation_and_mode"] = args.examples
    print(
        f"{figures['cases']} cases over {figures['operations']} operations: "
        f"{figures['server_errors']} answered 5xx, {figures['hangs']} hung, "
        f"{figures['bad_requests_naming_no_field']} 400s named no field; statuses "
        f"{figures['statuses']}; a plain completion afterwards: "
        f"{'served' if figures['completion_after'] else 'FAILED'}"
    )
    figures["seed"] = args.seed
    cases = figures["server_error_cases"] + figures["hang_cases"]
    for line in cases + figures["bad_requests_naming_no_field_cases"]:
        print("  ", line)
    from benchmarks.results import write_result

    write_result("fuzz", figures)
    ok = not (
        figures["server_errors"] or figures["hangs"] or figures["bad_requests_naming_no_field"]
    )
    ok = ok and figures["completion_after"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
