"""Admin authentication: OAuth2 bearer JWTs with scope `admin` (joserfc, the JOSE library
Authlib's maintainers moved its JOSE support to).

HS256 with a key from settings (by default one derived from the secret key, so that
`loragate admin token`, run with the same settings, mints tokens the server accepts), or
RS256 against an identity provider's JWKS (a file or a URL). `exp` is required; `iss` and
`aud` are checked when configured; `alg: none` and every other algorithm are refused.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet, OctKey

from gateway.http.errors import APIError
from gateway.settings import Settings
from gateway.tenancy.auth import bearer_token

ADMIN_SCOPE = "admin"


class AdminAuth:
    def __init__(self, settings: Settings) -> None:
        self.algorithm = settings.admin_jwt_algorithm
        self.issuer = settings.admin_jwt_issuer
        self.audience = settings.admin_jwt_audience
        self.key: OctKey | KeySet
        if self.algorithm == "HS256":
            self.key = OctKey.import_key(settings.admin_hs256_key())
        else:
            if not settings.admin_jwt_jwks:
                raise ValueError("RS256 admin tokens need --admin-jwt-jwks (a file or a URL)")
            self.key = KeySet.import_key_set(_read_jwks(settings.admin_jwt_jwks))  # type: ignore[arg-type]
        claims: dict[str, Any] = {"exp": {"essential": True}}
        if self.issuer:
            claims["iss"] = {"essential": True, "value": self.issuer}
        if self.audience:
            claims["aud"] = {"essential": True, "value": self.audience}
        self.claims = jwt.JWTClaimsRegistry(**claims)

    def verify(self, authorization: str | None) -> dict[str, Any]:
        """The token's claims; raises APIError 401 (no token, a bad or expired one) or 403
        (a valid token without the admin scope)."""
        token = bearer_token(authorization)
        if token is None:
            raise _refused(401, "an admin token is required: Authorization: Bearer <JWT>")
        try:
            decoded = jwt.decode(token, self.key, algorithms=[self.algorithm])
            self.claims.validate(decoded.claims)
        except (JoseError, ValueError) as exc:
            raise _refused(401, f"invalid admin token ({_reason(exc)})") from exc
        scopes = str(decoded.claims.get("scope", "")).split()
        if ADMIN_SCOPE not in scopes:
            raise _refused(403, f"the token lacks the {ADMIN_SCOPE!r} scope")
        return decoded.claims


def mint_admin_token(settings: Settings, ttl_seconds: int, subject: str = "loragate-cli") -> str:
    """An HS256 admin token signed with the key the server's settings give."""
    if settings.admin_jwt_algorithm != "HS256":
        raise ValueError("tokens are minted locally only for HS256; ask the identity provider")
    now = int(time.time())
    claims: dict[str, Any] = {"sub": subject, "iat": now, "exp": now + ttl_seconds}
    claims["scope"] = ADMIN_SCOPE
    if settings.admin_jwt_issuer:
        claims["iss"] = settings.admin_jwt_issuer
    if settings.admin_jwt_audience:
        claims["aud"] = settings.admin_jwt_audience
    return jwt.encode({"alg": "HS256"}, claims, OctKey.import_key(settings.admin_hs256_key()))


def _read_jwks(source: str) -> dict[str, Any]:
    if source.startswith(("https://", "http://")):
        response = httpx.get(source, timeout=10)
        response.raise_for_status()
        return dict(response.json())
    return dict(json.loads(Path(source).read_text()))


def _reason(exc: Exception) -> str:
    name = getattr(exc, "error", None) or type(exc).__name__
    return str(name).replace("_", " ")


def _refused(status: int, message: str) -> APIError:
    return APIError(
        status,
        message,
        type="authentication_error" if status == 401 else "permission_error",
        code="invalid_admin_token" if status == 401 else "insufficient_scope",
        headers={"WWW-Authenticate": "Bearer"} if status == 401 else None,
    )
