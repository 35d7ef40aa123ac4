"""pagedserve on Ray Serve: data-parallel replicas of the whole engine behind one
OpenAI-compatible ingress (``pip install 'pagedserve[ray]'``).

- ``affinity``: the routing policies, without Ray (which replica a prompt or a session goes to);
- ``router``: those policies as Ray Serve request routers;
- ``replica``: one replica, a whole engine (its engine core process and KV pool);
- ``ingress``: ``pagedserve serve``'s own app over the replicas;
- ``app``: the application (``build_app``, the builder for ``serve run`` and ``serve deploy``)
  and ``pagedserve serve --data-parallel-backend ray``.

Only ``affinity`` imports without Ray installed.
"""

from __future__ import annotations

import argparse
from typing import Any


def build_app(cli_args: dict[str, Any]):
    """Ray Serve's application builder: ``serve run pagedserve.entrypoints.ray_serve:build_app
    model=demo data-parallel-size=2``, or a ``serve deploy`` config file's ``import_path`` with
    its ``args``. ``cli_args`` are serve's flags without their dashes (``data-parallel-size`` or
    ``data_parallel_size``), as ``serve run``'s ``key=value`` strings or YAML values."""
    from pagedserve.entrypoints.cli.serve import engine_kwargs, tool_settings
    from pagedserve.entrypoints.ray_serve.app import application

    args = parse_cli_args(cli_args)
    return application(args, engine_kwargs(args), tool_settings(args))


def parse_cli_args(cli_args: dict[str, Any]) -> argparse.Namespace:
    """``cli_args`` as serve's parser reads its flags (an unknown one: ``SystemExit`` naming it)."""
    from pagedserve.entrypoints.cli.main import build_parser
    from pagedserve.entrypoints.cli.serve import flag_defaults
    from pagedserve.entrypoints.cli.utils import subparser

    parser = subparser(build_parser(), "serve")
    values = {key: _from_text(value) for key, value in cli_args.items()}
    parser.set_defaults(**flag_defaults(parser, values, "the application's args"))
    return parser.parse_args([])


def _from_text(value: Any) -> Any:
    """``serve run``'s ``key=value`` gives strings: ``true`` and ``false`` are switches."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value
