"""The console's sign-in: the admin token in a cookie the page's script cannot read, and a CSRF
token the script holds in memory.

Signing in (a pasted admin token, or the OAuth code flow in gateway/console/oauth.py) puts the
verified token in an `HttpOnly`, `SameSite=Strict` cookie (`Secure` behind TLS) that lives until
the token expires. The admin REST accepts that cookie as it accepts an `Authorization` header,
with one more rule: a request that changes state (anything but GET and HEAD) must carry
`X-CSRF-Token`, an HMAC of the cookie's token under the server's secret key, which the console
reads from `GET /console/api/session` (same-origin only: no CORS header is ever set). A form
another site submits carries the cookie at most (SameSite=Strict stops even that) and never
the header.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

from fastapi import Request, Response

from gateway.http.errors import APIError
from gateway.settings import derive

COOKIE = "loragate_console"
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# A JWT longer than this is not one we minted or an identity provider would send; refusing it
# keeps the cookie under browsers' 4 KiB limit.
MAX_TOKEN_CHARS = 3500


def csrf_token(secret_key: bytes, token: str) -> str:
    """The CSRF token that goes with a session's admin token (changes when the token does)."""
    key = derive(secret_key, "console-csrf")
    return hmac.new(key, token.encode(), hashlib.sha256).hexdigest()


def is_https(request: Request) -> bool:
    """Behind TLS: the request's scheme (uvicorn applies X-Forwarded-Proto from trusted
    proxies, --forwarded-allow-ips)."""
    return request.url.scheme == "https"


def set_session(response: Response, request: Request, token: str, claims: dict[str, Any]) -> None:
    """Keep the verified admin token in the console's cookie until it expires."""
    max_age = max(0, int(claims.get("exp", 0)) - int(time.time()))
    response.set_cookie(
        COOKIE,
        token,
        max_age=max_age,
        path="/",
        httponly=True,
        samesite="strict",
        secure=is_https(request),
    )


def clear_session(response: Response, request: Request) -> None:
    response.delete_cookie(
        COOKIE, path="/", httponly=True, samesite="strict", secure=is_https(request)
    )


def session_token(request: Request) -> str | None:
    token = request.cookies.get(COOKIE)
    return token if token and len(token) <= MAX_TOKEN_CHARS else None


def cookie_authorization(request: Request, secret_key: bytes) -> str | None:
    """The console cookie as an Authorization header value, for a request that has no header
    of its own; None without a cookie. A state-changing request without the matching CSRF
    token is refused (403)."""
    token = session_token(request)
    if token is None:
        return None
    if request.method not in SAFE_METHODS:
        sent = request.headers.get(CSRF_HEADER, "")
        if not hmac.compare_digest(sent.encode(), csrf_token(secret_key, token).encode()):
            raise APIError(
                403,
                "the console's CSRF token is missing or wrong: reload the console",
                type="permission_error",
                code="csrf_failed",
            )
    return f"Bearer {token}"
