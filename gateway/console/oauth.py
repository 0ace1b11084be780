"""Console sign-in with the identity provider: OAuth 2.0's authorization-code flow with PKCE
(RFC 7636, S256), run by the gateway for the page.

`/console/oauth/start` makes a state and a code verifier, keeps both in a short-lived signed
cookie and sends the browser to the provider with the verifier's challenge.
`/console/oauth/callback` checks the state, redeems the code with the verifier at the token
endpoint, and verifies the access token exactly as the admin REST does (the provider's JWKS,
`iss`, `aud`, the `admin` scope). Only then does it become the console's session (session.py).
The tokens never reach the page's script.

The state cookie is `SameSite=Lax`, not Strict: the provider's redirect back is a cross-site
navigation, and a Strict cookie would not come with it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse

from gateway.console.session import is_https, set_session
from gateway.http.deps import TenancyDep
from gateway.http.errors import APIError
from gateway.settings import Settings, SettingsError, derive

STATE_COOKIE = "loragate_oauth"
STATE_PATH = "/console/oauth"
STATE_TTL = 600  # seconds to sign in at the provider
TOKEN_TIMEOUT = 10.0

router = APIRouter(prefix=STATE_PATH, include_in_schema=False)


@dataclass(frozen=True, slots=True)
class ConsoleOAuth:
    authorize_url: str
    token_url: str
    client_id: str
    client_secret: str | None
    scope: str
    redirect_url: str | None  # None: this server's /console/oauth/callback as the browser saw it

    @classmethod
    def from_settings(cls, settings: Settings) -> ConsoleOAuth | None:
        urls = (settings.console_oauth_authorize_url, settings.console_oauth_token_url)
        if not any(urls) and not settings.console_oauth_client_id:
            return None
        if not all(urls) or not settings.console_oauth_client_id:
            raise SettingsError(
                "console sign-in with an identity provider needs --console-oauth-authorize-url, "
                "--console-oauth-token-url and --console-oauth-client-id together"
            )
        secret = settings.console_oauth_client_secret
        return cls(
            authorize_url=str(settings.console_oauth_authorize_url),
            token_url=str(settings.console_oauth_token_url),
            client_id=str(settings.console_oauth_client_id),
            client_secret=secret.get_secret_value() if secret is not None else None,
            scope=settings.console_oauth_scope,
            redirect_url=settings.console_oauth_redirect_url,
        )


def challenge_of(verifier: str) -> str:
    """PKCE S256: base64url(sha256(verifier)), unpadded."""
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _sign(secret_key: bytes, payload: str) -> str:
    key = derive(secret_key, "console-oauth-state")
    return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


def _pack_state(secret_key: bytes, state: str, verifier: str) -> str:
    payload = base64.urlsafe_b64encode(
        json.dumps({"s": state, "v": verifier, "t": int(time.time())}).encode()
    ).decode()
    return f"{payload}.{_sign(secret_key, payload)}"


def _unpack_state(secret_key: bytes, cookie: str | None) -> tuple[str, str] | None:
    if not cookie or "." not in cookie or len(cookie) > 1024:
        return None
    payload, signature = cookie.rsplit(".", 1)
    if not hmac.compare_digest(signature, _sign(secret_key, payload)):
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(payload))
    except ValueError:
        return None
    if time.time() - int(data.get("t", 0)) > STATE_TTL:
        return None
    return str(data["s"]), str(data["v"])


def _config(request: Request) -> ConsoleOAuth:
    config: ConsoleOAuth | None = getattr(request.app.state, "console_oauth", None)
    if config is None:
        raise APIError(404, "sign-in with an identity provider is not configured", code="not_found")
    return config


def _redirect_uri(request: Request, config: ConsoleOAuth) -> str:
    return config.redirect_url or str(request.url_for("console_oauth_callback"))


def _back_to_console(error: str | None = None) -> RedirectResponse:
    target = "/console" + (f"?{urlencode({'oauth_error': error})}" if error else "#/tenants")
    return RedirectResponse(target, status_code=303)


@router.get("/start")
async def start(request: Request, tenancy: TenancyDep) -> RedirectResponse:
    config = _config(request)
    state = secrets.token_urlsafe(24)
    verifier = secrets.token_urlsafe(48)  # 64 characters, within RFC 7636's 43..128
    query = {
        "response_type": "code",
        "client_id": config.client_id,
        "redirect_uri": _redirect_uri(request, config),
        "scope": config.scope,
        "state": state,
        "code_challenge": challenge_of(verifier),
        "code_challenge_method": "S256",
    }
    separator = "&" if "?" in config.authorize_url else "?"
    response = RedirectResponse(f"{config.authorize_url}{separator}{urlencode(query)}", 302)
    response.set_cookie(
        STATE_COOKIE,
        _pack_state(tenancy.secret_key, state, verifier),
        max_age=STATE_TTL,
        path=STATE_PATH,
        httponly=True,
        samesite="lax",
        secure=is_https(request),
    )
    return response


@router.get("/callback", name="console_oauth_callback")
async def callback(request: Request, tenancy: TenancyDep) -> RedirectResponse:
    config = _config(request)
    params = request.query_params
    if "error" in params:
        return _finish(_back_to_console(f"the identity provider said: {params['error'][:200]}"))
    kept = _unpack_state(tenancy.secret_key, request.cookies.get(STATE_COOKIE))
    if kept is None or not hmac.compare_digest(params.get("state", ""), kept[0]):
        return _finish(_back_to_console("sign-in expired or was not started here: try again"))
    code = params.get("code", "")
    if not code or len(code) > 2048:
        return _finish(_back_to_console("the identity provider sent no code"))
    try:
        token = await _redeem(config, code, kept[1], _redirect_uri(request, config))
        claims = tenancy.admin.verify(f"Bearer {token}")
    except APIError as exc:
        return _finish(_back_to_console(exc.message))
    response = _back_to_console()
    set_session(response, request, token, claims)
    return _finish(response)


def _finish(response: RedirectResponse) -> RedirectResponse:
    response.delete_cookie(STATE_COOKIE, path=STATE_PATH, httponly=True, samesite="lax")
    return response


async def _redeem(config: ConsoleOAuth, code: str, verifier: str, redirect_uri: str) -> str:
    """The access token for the code; APIError 401 with the provider's reason otherwise."""
    form: dict[str, Any] = {
        "grant_type": "authorization_code",
        "code": code,
        "redirect_uri": redirect_uri,
        "client_id": config.client_id,
        "code_verifier": verifier,
    }
    if config.client_secret is not None:
        form["client_secret"] = config.client_secret
    try:
        async with httpx.AsyncClient(timeout=TOKEN_TIMEOUT) as client:
            answer = await client.post(config.token_url, data=form)
    except httpx.HTTPError as exc:
        raise APIError(401, f"the token endpoint did not answer ({type(exc).__name__})") from exc
    try:
        body = answer.json()
    except ValueError:
        body = {}
    if answer.status_code != 200 or not isinstance(body.get("access_token"), str):
        reason = body.get("error_description") or body.get("error") or f"HTTP {answer.status_code}"
        raise APIError(401, f"the identity provider refused the code: {str(reason)[:200]}")
    return str(body["access_token"])
