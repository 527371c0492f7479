"""`--api-key` that guards every route, not only a list of path prefixes.

Upstream's middleware checks the key only under /v1, /v2, /inference and
/cohere, so /tokenize, /invocations, /metrics, /docs and any route added later
answer without it. This one inverts the rule: everything needs the key except
the paths named public here (liveness and version probes).
"""

from __future__ import annotations

from collections.abc import Awaitable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

# Exact paths; load balancers and orchestrators probe them without credentials.
_PUBLIC_PATHS: set[str] = {"/health", "/ping", "/load", "/version"}


def allow_unauthenticated(*paths: str) -> None:
    """Let other fork modules open a path they add (e.g. `GET /`)."""
    for path in paths:
        if not path.startswith("/"):
            raise ValueError(f"public path must start with '/', got {path!r}")
        _PUBLIC_PATHS.add(path)


def public_paths() -> frozenset[str]:
    return frozenset(_PUBLIC_PATHS)


class DenyByDefaultAuthMiddleware(AuthenticationMiddleware):
    """Same token check as upstream; only the set of guarded paths differs."""

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if (
            scope["type"] not in ("http", "websocket")
            or scope.get("method") == "OPTIONS"
        ):
            # Lifespan events, and CORS preflights (which never carry
            # credentials), pass as upstream lets them.
            return self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in _PUBLIC_PATHS or self.verify_token(Headers(scope=scope)):
            return self.app(scope, receive, send)
        response = JSONResponse(content={"error": "Unauthorized"}, status_code=401)
        return response(scope, receive, send)
