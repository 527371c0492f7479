"""auth-deny-default: with --api-key, every route but a few probes needs the key.

The routes come from the running server's own start-up listing, so a route
that a new upstream release adds is checked without editing this file.
"""

from __future__ import annotations

import re

import httpx
import pytest

# Routes that answer without the key: upstream's liveness/version probes, and
# the discovery routes of the api-root-health topic.
PUBLIC = {"/health", "/ping", "/load", "/version", "/", "/api/version"}


def concrete(path: str) -> str:
    # Path parameters ({response_id}, {path:path}) get a harmless value.
    return re.sub(r"\{[^}]+\}", "probe", path)


def test_every_listed_route_needs_the_key(server) -> None:
    routes = server.routes()
    paths = {path for path, _ in routes}
    # Sanity: the listing was parsed and holds the routes that matter most.
    assert {"/v1/completions", "/tokenize", "/invocations", "/metrics"} <= paths

    open_routes = []
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        for path, methods in sorted(routes):
            if path in PUBLIC:
                continue
            for method in sorted(methods - {"HEAD", "OPTIONS"}):
                r = anon.request(method, concrete(path), json={})
                if r.status_code != 401:
                    open_routes.append(f"{method} {path} -> {r.status_code}")
    assert not open_routes, "answered without the API key:\n" + "\n".join(open_routes)


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_public_probes_answer_without_key(server, path: str) -> None:
    r = httpx.get(server.url + path, timeout=60)
    assert r.status_code == 200, (path, r.status_code, r.text)


def test_invocations_needs_the_key(server) -> None:
    body = {"model": server.served_name, "prompt": "hi", "max_tokens": 2}
    r = httpx.post(server.url + "/invocations", json=body, timeout=60)
    assert r.status_code == 401
    r = httpx.post(
        server.url + "/invocations",
        json=body,
        headers={"Authorization": f"Bearer {server.api_key}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_key_opens_guarded_non_v1_routes(server) -> None:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    r = httpx.get(server.url + "/metrics", headers=headers, timeout=60)
    assert r.status_code == 200
    r = httpx.post(
        server.url + "/tokenize",
        json={"model": server.served_name, "prompt": "hi"},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
