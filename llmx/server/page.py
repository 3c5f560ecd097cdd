"""The chat page at `/`: static files from `web/` (HTML, ES modules, CSS; no build step, nothing
fetched from elsewhere). The page calls the API from the same origin, so the gate's rules (JSON
bodies, the Host check, no CORS) let it through as they let any client; the API key, when the
server has one, is typed into the page and sent as a Bearer token like any client's.

The page's own files carry no secret and are served without the key: a browser cannot send one
for them, and the page must load before the user can type it.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB = Path(__file__).parent / "web"
PREFIX = "/web"
# Scripts, styles and fetches from this origin only (the model's text is never markup, but a page
# that can load nothing else cannot send a conversation elsewhere), and no framing by other pages.
POLICY = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'"


def is_page(path: str) -> bool:
    """Whether `path` is one of the page's files (open without the API key)."""
    return path == "/" or path.startswith(PREFIX + "/")


def add_page(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(WEB / "index.html", headers={"Content-Security-Policy": POLICY})

    app.mount(PREFIX, StaticFiles(directory=WEB), name="web")
