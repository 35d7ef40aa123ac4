"""The web console at ``/``: a chat and completion playground and a live device monitor.

Three static files shipped in the package (``server/web/``), no build step and no CDN: the page
talks to the server's own routes (``/v1/chat/completions``, ``/v1/completions``, ``/device``,
``/device/pages``, ``/metrics``) with the API key the user types in.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB_DIR = Path(str(files("pagedserve.server") / "web"))
ASSETS_PREFIX = "/console"


def is_web_ui_path(path: str) -> bool:
    return path == "/" or path.startswith(ASSETS_PREFIX)


def install_web_ui(app: FastAPI) -> None:
    """``/`` answers the console's page; ``/console/*`` its script and style sheet."""

    @app.get("/", include_in_schema=False)
    async def console() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount(ASSETS_PREFIX, StaticFiles(directory=WEB_DIR))
