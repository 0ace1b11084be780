"""The console's defences: never framed, no state change without the CSRF token, no tenant
key, the security headers on every console response, the session cookie's attributes."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from console_server import ConsoleServer
from joserfc import jwt
from joserfc.jwk import OctKey
from live_server import TEST_SECRET, free_port

from gateway.settings import Settings

CONSOLE_PATHS = [
    "/console",
    "/console/",
    "/console/static/js/app.js",
    "/console/static/css/console.css",
    "/console/static/vendor/uplot/uPlot.esm.js",
    "/console/static/no-such-file.js",  # a 404 too
    "/console/api/session",
]


def _signed_in(server: ConsoleServer) -> tuple[httpx.Client, str]:
    client = httpx.Client(base_url=server.url, timeout=30)
    answer = client.post("/console/api/session", json={"token": server.admin_token})
    assert answer.status_code == 200, answer.text
    return client, answer.json()["csrf_token"]


@pytest.mark.parametrize("path", CONSOLE_PATHS)
def test_every_console_response_has_the_security_headers(
    console_server: ConsoleServer, path: str
) -> None:
    response = httpx.get(f"{console_server.url}{path}")
    csp = response.headers.get("content-security-policy", "")
    assert "frame-ancestors 'none'" in csp
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["referrer-policy"] == "no-referrer"
    assert response.headers["x-frame-options"] == "DENY"


def test_the_page_has_no_inline_script(console_server: ConsoleServer) -> None:
    page = httpx.get(f"{console_server.url}/console").text
    assert '<script type="module" src="/console/static/js/app.js"></script>' in page
    assert page.count("<script") == 1 and " on" not in page.split("<body>")[1].split(">")[0]


def test_state_changes_need_the_csrf_token(console_server: ConsoleServer) -> None:
    client, csrf = _signed_in(console_server)
    with contextlib.closing(client):
        # The cookie reads (GET needs no CSRF token) ...
        assert client.get("/admin/tenants").status_code == 200
        # ... but changes nothing without the token, or with another.
        for headers in ({}, {"X-CSRF-Token": "0" * 64}):
            refused = client.post("/admin/tenants", json={"name": "csrf-victim"}, headers=headers)
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["code"] == "csrf_failed"
        assert client.delete("/console/api/session").status_code == 403
        names = [t["name"] for t in client.get("/admin/tenants").json()["data"]]
        assert "csrf-victim" not in names
        made = client.post(
            "/admin/tenants", json={"name": "csrf-ok"}, headers={"X-CSRF-Token": csrf}
        )
        assert made.status_code == 201, made.text
        # Signing out ends the cookie's use.
        assert (
            client.delete("/console/api/session", headers={"X-CSRF-Token": csrf}).status_code == 204
        )
        assert client.get("/admin/tenants").status_code == 401
        assert client.get("/console/api/session").json()["signed_in"] is False


def test_a_tenant_key_never_opens_the_console(console_server: ConsoleServer) -> None:
    refused = httpx.post(
        f"{console_server.url}/console/api/session", json={"token": console_server.demo_key}
    )
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_admin_token"
    assert "set-cookie" not in refused.headers
    # A valid token without the admin scope: the admin REST's 403.
    settings = Settings(secret_key=TEST_SECRET)
    claims = {"sub": "reader", "exp": int(time.time()) + 600, "scope": "usage"}
    token = jwt.encode({"alg": "HS256"}, claims, OctKey.import_key(settings.admin_hs256_key()))
    scoped = httpx.post(f"{console_server.url}/console/api/session", json={"token": token})
    assert scoped.status_code == 403
    assert scoped.json()["error"]["code"] == "insufficient_scope"
    # Nor does a tenant key in the console's cookie.
    cookie = {"loragate_console": console_server.demo_key}
    assert httpx.get(f"{console_server.url}/admin/tenants", cookies=cookie).status_code == 401


def test_the_session_cookie(console_server: ConsoleServer) -> None:
    answer = httpx.post(
        f"{console_server.url}/console/api/session", json={"token": console_server.admin_token}
    )
    cookie = answer.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/" in cookie
    assert "secure" not in cookie.replace("samesite=strict", "")  # plain http: no Secure
    assert answer.json()["signed_in"] is True
    assert answer.headers["cache-control"] == "no-store"
    # Behind TLS (a trusted proxy on loopback says so), the cookie is Secure.
    behind_tls = httpx.post(
        f"{console_server.url}/console/api/session",
        json={"token": console_server.admin_token},
        headers={"X-Forwarded-Proto": "https"},
    )
    assert "; secure" in behind_tls.headers["set-cookie"].lower()


@pytest.fixture
def other_origin(console_server: ConsoleServer) -> Iterator[str]:
    """A page on another origin (another port) that frames the console."""
    framing = (
        f'<html><body><iframe id="f" src="{console_server.url}/console"></iframe></body></html>'
    )

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            body = framing.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    port = free_port()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        httpd.shutdown()


def test_the_console_refuses_to_be_framed(page: Any, other_origin: str) -> None:
    page.goto(other_origin)
    page.wait_for_load_state("load")
    (child,) = page.main_frame.child_frames
    # Chromium refuses the navigation (frame-ancestors 'none'): the frame shows its error page,
    # and nothing of the console.
    assert child.url.startswith("chrome-error://"), child.url
    assert "loragate" not in child.content()
