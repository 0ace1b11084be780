"""Console sign-in with the identity provider whose JWKS the gateway trusts: the OAuth 2.0 code
flow with PKCE, in Chromium, against a live `loragate serve` and a real authorization server
(identity_provider.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
from console_server import ConsoleServer, screenshot, serve
from identity_provider import CLIENT_ID, IdentityProvider, identity_provider
from live_server import free_port
from playwright.sync_api import expect


@pytest.fixture(scope="module")
def idp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IdentityProvider]:
    with identity_provider(tmp_path_factory.mktemp("idp"), free_port()) as provider:
        yield provider


@pytest.fixture(scope="module")
def oauth_server(
    idp: IdentityProvider, demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConsoleServer]:
    with serve(demo_model_dir, tmp_path_factory.mktemp("oauth-serve"), *idp.serve_flags()) as s:
        yield s


def test_sign_in_with_the_identity_provider(
    page: Any, idp: IdentityProvider, oauth_server: ConsoleServer
) -> None:
    idp.scope, idp.token_requests[:] = "openid admin", []
    page.goto(f"{oauth_server.url}/console")
    page.get_by_role("link", name="Sign in with your identity provider").click()
    expect(page.get_by_role("heading", name="Tenants", exact=True)).to_be_visible()
    expect(page.locator("#who-name")).to_have_text(f"Signed in as {idp.subject}")
    screenshot(page, "signed-in-with-oauth")
    # The code was redeemed once, with the verifier whose S256 challenge the provider saw.
    (redeemed,) = idp.token_requests
    assert redeemed["client_id"] == CLIENT_ID
    assert redeemed["redirect_uri"] == f"{oauth_server.url}/console/oauth/callback"
    assert 43 <= len(redeemed["code_verifier"]) <= 128
    # The session works against the admin REST; the page's script never saw the token.
    names = page.evaluate(
        "async () => (await (await fetch('/admin/tenants')).json()).data.map(t => t.name)"
    )
    assert "demo" in names
    assert page.evaluate("() => document.cookie") == ""


def test_start_sends_a_pkce_challenge(oauth_server: ConsoleServer) -> None:
    started = httpx.get(f"{oauth_server.url}/console/oauth/start")
    assert started.status_code == 302
    query = parse_qs(urlparse(started.headers["location"]).query)
    assert query["code_challenge_method"] == ["S256"]
    assert query["response_type"] == ["code"] and query["client_id"] == [CLIENT_ID]
    assert len(query["state"][0]) >= 32
    cookie = started.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=lax" in cookie and "path=/console/oauth" in cookie
    # Each start makes its own verifier.
    again = parse_qs(
        urlparse(httpx.get(f"{oauth_server.url}/console/oauth/start").headers["location"]).query
    )
    assert again["code_challenge"] != query["code_challenge"]


def test_a_callback_not_started_here_is_refused(
    page: Any, idp: IdentityProvider, oauth_server: ConsoleServer
) -> None:
    # A code with a state this browser never made (a login CSRF): refused, no session.
    page.goto(f"{oauth_server.url}/console/oauth/callback?code=abc&state=forged")
    expect(page.get_by_role("alert")).to_contain_text("sign-in expired or was not started here")
    assert all(c["name"] != "loragate_console" for c in page.context.cookies())


def test_a_user_without_the_admin_scope_is_refused(
    page: Any, idp: IdentityProvider, oauth_server: ConsoleServer
) -> None:
    idp.scope = "openid profile"
    try:
        page.goto(f"{oauth_server.url}/console")
        page.get_by_role("link", name="Sign in with your identity provider").click()
        expect(page.get_by_role("alert")).to_contain_text("lacks the 'admin' scope")
        assert all(c["name"] != "loragate_console" for c in page.context.cookies())
    finally:
        idp.scope = "openid admin"


def test_an_unconfigured_server_offers_no_provider(console_server: ConsoleServer) -> None:
    assert httpx.get(f"{console_server.url}/console/api/session").json()["oauth"] is False
    assert httpx.get(f"{console_server.url}/console/oauth/start").status_code == 404
