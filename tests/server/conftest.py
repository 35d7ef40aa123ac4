"""Fixtures of the in-process API tests: each file declares its ``engine`` (the demo model with
the limits its tests need) and gets ``client``, that engine's app in this process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.apps import served


@pytest.fixture(scope="module")
def client(engine) -> Iterator:
    """``build_app`` over the file's ``engine`` behind FastAPI's TestClient, its loop running."""
    with served(engine) as c:
        yield c
