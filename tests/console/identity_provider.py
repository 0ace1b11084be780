"""A small OAuth 2.0 authorization server for the console's sign-in tests: the code flow with
PKCE (S256 only), RS256 access tokens, a JWKS. Its /authorize approves at once, as a provider
does for a user already signed in there; everything else it checks as RFC 6749 and RFC 7636 say."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode

import uvicorn
from joserfc import jwt
from joserfc.jwk import RSAKey
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

CLIENT_ID = "loragate-console"
AUDIENCE = "loragate-admin"


@dataclass
class IdentityProvider:
    url: str
    jwks_file: Path
    key: RSAKey
    # What a token carries; a test may change it (a user without the admin scope).
    scope: str = "openid admin"
    subject: str = "alice@example.com"
    codes: dict[str, dict[str, str]] = field(default_factory=dict)
    token_requests: list[dict[str, str]] = field(default_factory=list)

    @property
    def issuer(self) -> str:
        return self.url

    def serve_flags(self) -> list[str]:
        return [
            "--admin-jwt-algorithm",
            "RS256",
            "--admin-jwt-jwks",
            str(self.jwks_file),
            "--admin-jwt-issuer",
            self.issuer,
            "--admin-jwt-audience",
            AUDIENCE,
            "--console-oauth-authorize-url",
            f"{self.url}/authorize",
            "--console-oauth-token-url",
            f"{self.url}/token",
            "--console-oauth-client-id",
            CLIENT_ID,
        ]

    async def authorize(self, request: Request) -> Response:
        q = request.query_params
        if q.get("client_id") != CLIENT_ID or q.get("response_type") != "code":
            return JSONResponse({"error": "unauthorized_client"}, 400)
        if q.get("code_challenge_method") != "S256" or len(q.get("code_challenge", "")) != 43:
            return JSONResponse({"error": "invalid_request", "error_description": "PKCE"}, 400)
        code = secrets.token_urlsafe(16)
        self.codes[code] = {
            "challenge": q["code_challenge"],
            "redirect_uri": q["redirect_uri"],
            "scope": q.get("scope", ""),
        }
        target = f"{q['redirect_uri']}?{urlencode({'code': code, 'state': q.get('state', '')})}"
        return RedirectResponse(target, 302)

    async def token(self, request: Request) -> Response:
        form = {k: str(v) for k, v in (await request.form()).items()}
        self.token_requests.append(form)
        grant = self.codes.pop(form.get("code", ""), None)  # a code redeems once
        if form.get("grant_type") != "authorization_code" or grant is None:
            return JSONResponse({"error": "invalid_grant"}, 400)
        if form.get("client_id") != CLIENT_ID or form.get("redirect_uri") != grant["redirect_uri"]:
            return JSONResponse({"error": "invalid_grant"}, 400)
        verifier = form.get("code_verifier", "").encode()
        challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier).digest()).rstrip(b"=")
        if challenge.decode() != grant["challenge"]:
            return JSONResponse(
                {"error": "invalid_grant", "error_description": "PKCE verification failed"}, 400
            )
        now = int(time.time())
        claims = {
            "iss": self.issuer,
            "aud": AUDIENCE,
            "sub": self.subject,
            "scope": self.scope,
            "iat": now,
            "exp": now + 600,
        }
        access = jwt.encode({"alg": "RS256", "kid": self.key.kid}, claims, self.key)
        return JSONResponse({"access_token": access, "token_type": "Bearer", "expires_in": 600})


@contextlib.contextmanager
def identity_provider(root: Path, port: int) -> Iterator[IdentityProvider]:
    key = RSAKey.generate_key(2048, parameters={"kid": "test-1"})
    jwks_file = root / "jwks.json"
    jwks_file.write_text(json.dumps({"keys": [key.as_dict(private=False)]}))
    provider = IdentityProvider(f"http://127.0.0.1:{port}", jwks_file, key)
    app = Starlette(
        routes=[
            Route("/authorize", provider.authorize),
            Route("/token", provider.token, methods=["POST"]),
        ]
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield provider
    finally:
        server.should_exit = True
        thread.join(10)
