"""`GET`/`HEAD` on `/` and Ollama-style discovery, open without the API key.

Uptime checkers probe `/`, and Ollama-compatible clients probe `/` and
`/api/version` to find a server before they send credentials. Upstream
answers 404 there. These routes say only that the server is up and which vLLM
version it runs (already public at /version): no model names, no arguments.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from vllm.version import __version__ as VLLM_VERSION

from vllm.fork.api_auth import allow_unauthenticated

ROOT_TEXT = "vLLM is running"


async def _root() -> PlainTextResponse:
    return PlainTextResponse(ROOT_TEXT)


async def _api_version() -> JSONResponse:
    return JSONResponse({"version": VLLM_VERSION})


def attach_router(app: FastAPI) -> None:
    routes = {"/": _root, "/api/version": _api_version}
    for path, endpoint in routes.items():
        app.add_api_route(
            path, endpoint, methods=["GET", "HEAD"], include_in_schema=False
        )
    allow_unauthenticated(*routes)
